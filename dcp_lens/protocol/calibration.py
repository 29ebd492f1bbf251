"""Label-free affine calibration of the readout input (docs/design.md §3, `calibrate` and `shift`).

CORAL-style moment matching: a stream with mean mu_src and covariance C_src is moved into the
frame the readout saw in training (mu_ref, C_ref)::

    calibrate(h) = mu_ref + A (h - mu_src)
    A = I                                    mode "mean"
    A = diag(sigma_ref / sigma_src)          mode "diag"
    A = C_ref^{1/2} C_src^{-1/2}             mode "full"  (A C_src A^T = C_ref)

Covariances are Ledoit-Wolf shrunk toward (trace / d) * I, so A is always invertible and
``shift = calibrate.inverse()``. All statistics stream in float64 on the data's device.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from jaxtyping import Float
from torch import Tensor

from dcp_lens.utils.registry import add_entry

# The affine modes, simplest first: a split too small for a mode falls back along this order.
AFFINE_MODES = ("mean", "diag", "full")
# Fewest states each mode is fitted from: a full covariance of width d needs d + 1 states to be
# more than shrinkage fitted to noise (one program moved a share by 0.15 that way); per-dimension
# variances need 3 (see the singular-covariance error of "diag").
MIN_STATES = {"full": lambda width: width + 1, "diag": lambda width: 3, "mean": lambda width: 1}


class CalibrationFallbackWarning(UserWarning):
    """A calibration split too small for the chosen mode: a simpler mode was fitted instead (the
    protocol records which maps fell back in its results' metadata)."""


def usable_mode(mode: str, n_states: int, width: int) -> str:
    """``mode``, or the richest simpler mode ``n_states`` states can fit (with a warning)."""
    fitted = mode
    while fitted != "mean" and n_states < MIN_STATES[fitted](width):
        fitted = AFFINE_MODES[AFFINE_MODES.index(fitted) - 1]
    if fitted != mode:
        warnings.warn(
            CalibrationFallbackWarning(
                f"calibration mode {mode!r} needs at least {MIN_STATES[mode](width)} calibration "
                f"states (width {width}), got {n_states}; fitted {fitted!r} instead. Use more "
                "calibration sequences to fit the mode asked for."
            ),
            stacklevel=3,
        )
    return fitted


def _check_mode(mode: str) -> None:
    if mode not in AFFINE_MODES:
        raise ValueError(f"mode={mode!r} is not one of {AFFINE_MODES}; pick one of those strings.")


def all_finite(x: Tensor) -> bool:
    """Whether every element of ``x`` is finite: its largest and smallest are (max and min
    propagate NaN), two reductions rather than a mask the size of ``x``. True when empty."""
    if x.numel() == 0:
        return True
    return bool(torch.isfinite(x.amax())) and bool(torch.isfinite(x.amin()))


class StreamingMoments:
    """Streaming float64 mean and covariance of d-dimensional samples, in one pass.

    Besides the mean and the scatter matrix sum_k y_k y_k^T (y = x - mean) it keeps the two
    fourth-order sums that the Ledoit-Wolf shrinkage intensity needs, sum_k |y_k|^2 y_k and
    sum_k |y_k|^4, so `ledoit_wolf_shrinkage` needs no second pass over the data. Each batch's
    sums are taken about the batch's own mean and merged with Chan et al.'s pairwise update
    (extended to the fourth-order terms): no raw power sums of uncentred data are ever formed, so
    a large common offset (a massive activation) costs no precision.
    """

    def __init__(self, storage: torch.dtype = torch.float64) -> None:
        # The scatter matrix is kept in ``storage`` between updates (float32 for the jackknife's
        # groups, whose leave-out is the float64 whole less one group); every update and merge
        # is computed in float64.
        self._storage = storage
        self._count = 0
        self._mean: Tensor | None = None  # [d]
        self._scatter: Tensor | None = None  # [d, d], sum of y y^T
        self._norm_weighted_sum: Tensor | None = None  # [d], sum of |y|^2 y
        self._fourth_sum: Tensor | None = None  # [], sum of |y|^4
        # Of the shrunk covariance, until an update: its eigendecomposition and its powers.
        self._eigen: tuple[Tensor, Tensor] | None = None
        self._powers: dict[float, Tensor] = {}
        self._eigh_dtype = torch.float64  # float32 for a jackknife refit: `for_refit`

    @classmethod
    def from_samples(cls, samples: Tensor | Iterable[Tensor]) -> StreamingMoments:
        """Moments of one tensor ``[..., d]`` or of every tensor an iterable yields, streamed."""
        moments = cls()
        for chunk in [samples] if isinstance(samples, Tensor) else samples:
            moments.update(chunk)
        return moments

    def update(self, x: Float[Tensor, "*batch d"]) -> None:
        """Add the samples ``x`` (every leading dimension is pooled; empty batches are ignored)."""
        if not isinstance(x, Tensor) or not torch.is_floating_point(x):
            raise TypeError(
                f"samples must be a floating-point tensor, got {type(x).__name__}"
                f"{'' if not isinstance(x, Tensor) else f' of dtype {x.dtype}'}."
            )
        if x.ndim < 2:
            raise ValueError(
                f"samples must have shape [..., n, d], got shape {tuple(x.shape)}; "
                "pass a single vector as x[None]."
            )
        if self._mean is not None and x.shape[-1] != self._mean.shape[0]:
            raise ValueError(
                f"samples have width {x.shape[-1]} but earlier samples had width "
                f"{self._mean.shape[0]}; every update must come from the same stream."
            )
        if self._mean is not None and x.device != self._mean.device:
            raise ValueError(
                f"samples are on {x.device} but the moments live on {self._mean.device}; "
                "move the samples there."
            )
        samples = x.reshape(-1, x.shape[-1])
        if samples.shape[0] == 0:
            return
        if not all_finite(samples):
            bad = int((~torch.isfinite(samples)).any(dim=1).sum())
            raise ValueError(
                f"samples contain non-finite values (in {bad} of {samples.shape[0]} rows); "
                "the stream has overflowed or is corrupt upstream."
            )
        samples = samples.to(torch.float64)
        batch_mean = samples.mean(dim=0)
        centred = samples - batch_mean
        squared_norms = centred.pow(2).sum(dim=1)
        batch = (
            samples.shape[0],
            batch_mean,
            centred.T @ centred,
            centred.T @ squared_norms,
            squared_norms.pow(2).sum(),
        )
        self._merge(*batch)

    def merge(self, other: StreamingMoments) -> None:
        """Fold the samples of ``other`` into these moments (as if they had been updated here)."""
        if other._count == 0:
            return
        assert other._mean is not None and other._scatter is not None
        assert other._norm_weighted_sum is not None and other._fourth_sum is not None
        if self._mean is not None and other._mean.shape != self._mean.shape:
            raise ValueError(
                f"cannot merge moments of width {other._mean.shape[0]} into width "
                f"{self._mean.shape[0]}."
            )
        self._merge(
            other._count, other._mean, other._scatter, other._norm_weighted_sum, other._fourth_sum
        )

    def without(self, part: StreamingMoments) -> StreamingMoments | None:
        """New moments of these samples less ``part``'s, a subset of them (merged into these
        earlier): `merge` run backwards, so one group's leave-out costs a few d x d operations
        rather than a merge of every other group. None where nothing is left."""
        self._require_samples()
        if part._count == 0:
            rest = StreamingMoments()
            rest.merge(self)
            return rest
        if part._count >= self._count:
            return None
        assert self._mean is not None and self._scatter is not None
        assert self._norm_weighted_sum is not None and self._fourth_sum is not None
        assert part._mean is not None and part._scatter is not None
        assert part._norm_weighted_sum is not None and part._fourth_sum is not None
        device = self._mean.device
        count = self._count - part._count
        part_mean = part._mean.to(device)
        mean = (self._mean * self._count - part_mean * part._count) / count
        # The part's sums about the whole's mean, taken off the whole's; what is left are the
        # rest's sums about the whole's mean, recentred onto the rest's own mean.
        moved = _recentre(
            part._count, part_mean - self._mean,
            part._scatter.to(device=device, dtype=torch.float64),
            part._norm_weighted_sum.to(device), part._fourth_sum.to(device),
        )  # fmt: skip
        about_whole = (
            whole - piece
            for whole, piece in zip(
                (self._scatter.to(torch.float64), self._norm_weighted_sum, self._fourth_sum),
                moved,
                strict=True,
            )
        )
        rest = StreamingMoments()
        rest._count, rest._mean = count, mean
        rest._scatter, rest._norm_weighted_sum, rest._fourth_sum = _uncentre(
            count, mean - self._mean, *about_whole
        )
        return rest

    def _merge(
        self, count: int, mean: Tensor, scatter: Tensor, norm_weighted: Tensor, fourth: Tensor
    ) -> None:
        self._eigen, self._powers = None, {}
        if self._count == 0:
            self._count, self._mean, self._scatter = count, mean, scatter.to(self._storage)
            self._norm_weighted_sum, self._fourth_sum = norm_weighted, fourth
            return
        assert self._mean is not None and self._scatter is not None
        assert self._norm_weighted_sum is not None and self._fourth_sum is not None
        device = self._mean.device
        mean, scatter = mean.to(device), scatter.to(device=device, dtype=torch.float64)
        norm_weighted, fourth = norm_weighted.to(device), fourth.to(device)
        total = self._count + count
        merged_mean = self._mean + (mean - self._mean) * (count / total)
        own = _recentre(
            self._count,
            self._mean - merged_mean,
            self._scatter.to(torch.float64),
            self._norm_weighted_sum,
            self._fourth_sum,
        )
        new = _recentre(count, mean - merged_mean, scatter, norm_weighted, fourth)
        self._count = total
        self._mean = merged_mean
        self._scatter, self._norm_weighted_sum, self._fourth_sum = (
            own_part + new_part for own_part, new_part in zip(own, new, strict=True)
        )
        self._scatter = self._scatter.to(self._storage)

    def state(self) -> dict[str, Any]:
        """The count and the float64 sums, all `from_state` needs (tensors and an int)."""
        return {
            "count": self._count,
            "mean": self._mean,
            "scatter": self._scatter,
            "norm_weighted_sum": self._norm_weighted_sum,
            "fourth_sum": self._fourth_sum,
        }

    @classmethod
    def from_state(
        cls, state: dict[str, Any], storage: torch.dtype = torch.float64
    ) -> StreamingMoments:
        """The moments `state` recorded, exactly (the scatter kept in ``storage`` from then)."""
        moments = cls(storage)
        moments._count = int(state["count"])
        moments._mean, moments._scatter = state["mean"], state["scatter"]
        moments._norm_weighted_sum = state["norm_weighted_sum"]
        moments._fourth_sum = state["fourth_sum"]
        return moments

    def _require_samples(self) -> None:
        if self._count == 0:
            raise ValueError("no samples: call update(x) with at least one sample first.")

    @property
    def count(self) -> int:
        """Number of samples seen."""
        return self._count

    @property
    def width(self) -> int | None:
        """Dimension d of the samples, or None before the first update."""
        return None if self._mean is None else int(self._mean.shape[0])

    @property
    def device(self) -> torch.device | None:
        """Device the moments live on (that of the first samples), or None before any."""
        return None if self._mean is None else self._mean.device

    @property
    def mean(self) -> Float[Tensor, " d"]:
        """Sample mean, float64 ``[d]``."""
        self._require_samples()
        assert self._mean is not None
        return self._mean

    @property
    def covariance(self) -> Float[Tensor, "d d"]:
        """Maximum-likelihood covariance (divided by n, as Ledoit-Wolf use), float64 ``[d, d]``."""
        self._require_samples()
        assert self._scatter is not None
        return self._scatter / self._count

    def shrunk_power(self, exponent: float, name: str = "covariance") -> Float[Tensor, "d d"]:
        """The Ledoit-Wolf shrunk covariance to the power ``exponent`` (`symmetric_power`). Its
        eigendecomposition and each power are computed once until the next update: a sweep maps
        every source onto the same full-depth reference, so the reference's root is needed once,
        not once per source, and full depth's own stream needs its root and its inverse root
        from one eigendecomposition."""
        if exponent not in self._powers:
            if self._eigen is None:
                self._eigen = symmetric_eigh(
                    ledoit_wolf_shrinkage(self).covariance, name, self._eigh_dtype
                )
            self._powers[exponent] = _power_of(*self._eigen, exponent)
        return self._powers[exponent]

    def for_refit(self) -> StreamingMoments:
        """These moments with `shrunk_power`'s eigendecomposition taken in float32 (returns self):
        for the jackknife's refits (`dcp_lens.protocol.fit.fit_maps`), whose maps differ from the
        whole split's by about 1e-2 relative, at half a float64 decomposition's time (the refits'
        largest cost). Only where the shrunk covariance is well conditioned (`symmetric_eigh`):
        there the float32 powers are within about 1e-5 of the float64 ones; elsewhere float64.
        Their powers stay float64."""
        self._eigh_dtype = torch.float32
        self._eigen, self._powers = None, {}
        return self

    @property
    def fourth_moment_sum(self) -> float:
        """sum_k |x_k - mean|^4 over all samples (feeds the Ledoit-Wolf intensity)."""
        self._require_samples()
        assert self._fourth_sum is not None
        return float(self._fourth_sum)


def _uncentre(
    count: int, offset: Tensor, scatter: Tensor, norm_weighted: Tensor, fourth: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """`_recentre` backwards: sums about the mean from sums about ``mean - offset`` (the sums
    ``_recentre(count, offset, ...)`` returns)."""
    central = scatter - count * torch.outer(offset, offset)
    offset_sq = offset.dot(offset)
    central_offset = central @ offset
    trace = torch.diagonal(central).sum()
    central_norm_weighted = (
        norm_weighted - offset * trace - 2 * central_offset - count * offset_sq * offset
    )
    central_fourth = (
        fourth
        - 4 * offset.dot(central_offset)
        - count * offset_sq**2
        - 4 * offset.dot(central_norm_weighted)
        - 2 * offset_sq * trace
    )
    return central, central_norm_weighted, central_fourth


def _recentre(
    count: int, offset: Tensor, scatter: Tensor, norm_weighted: Tensor, fourth: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Central sums about a new centre, y' = y + offset, from sums about the mean (sum y = 0)."""
    offset_sq = offset.dot(offset)
    scatter_offset = scatter @ offset
    trace = torch.diagonal(scatter).sum()
    new_scatter = scatter + count * torch.outer(offset, offset)
    new_norm_weighted = (
        norm_weighted + offset * trace + 2 * scatter_offset + count * offset_sq * offset
    )
    new_fourth = (
        fourth
        + 4 * offset.dot(scatter_offset)
        + count * offset_sq**2
        + 4 * offset.dot(norm_weighted)
        + 2 * offset_sq * trace
    )
    return new_scatter, new_norm_weighted, new_fourth


@dataclass(frozen=True, eq=False)
class ShrunkCovariance:
    """A Ledoit-Wolf estimate: ``(1 - intensity) * S + intensity * scale * I``."""

    covariance: Float[Tensor, "d d"]
    intensity: float
    scale: float


def ledoit_wolf_shrinkage(moments: StreamingMoments) -> ShrunkCovariance:
    """Ledoit-Wolf (2004) shrinkage of the sample covariance toward ``mu * I``, mu = trace / d.

    With S the ML covariance of n samples and the normalised norm |A|^2 = tr(A A^T) / d::

        delta^2 = |S - mu I|^2
        beta^2  = min(delta^2, sum_k |y_k y_k^T - S|^2 / n^2)
        intensity = beta^2 / delta^2

    where sum_k |y_k y_k^T - S|_F^2 = sum_k |y_k|^4 - n |S|_F^2 comes from the streamed fourth
    moments, so one pass over the data suffices. Returns a `ShrunkCovariance` whose
    ``covariance`` is float64 ``[d, d]``.
    """
    covariance = moments.covariance
    count = moments.count
    width = covariance.shape[0]
    scale = float(torch.diagonal(covariance).sum()) / width
    identity = torch.eye(width, dtype=covariance.dtype, device=covariance.device)
    distance = float((covariance - scale * identity).pow(2).sum()) / width
    frobenius_sq = float(covariance.pow(2).sum())
    # Clamped at zero: the difference of two sums can round to a tiny negative.
    dispersion = max(moments.fourth_moment_sum - count * frobenius_sq, 0.0) / count**2 / width
    intensity = 0.0 if distance == 0.0 else min(dispersion, distance) / distance
    shrunk = (1.0 - intensity) * covariance + (intensity * scale) * identity
    return ShrunkCovariance(covariance=shrunk, intensity=intensity, scale=scale)


def symmetric_power(
    matrix: Float[Tensor, "d d"], exponent: float, name: str = "covariance"
) -> Float[Tensor, "d d"]:
    """``matrix ** exponent`` for a symmetric positive-definite matrix, via float64 eigh.

    Raises ValueError (naming ``name``) if the matrix is not positive definite to float64
    precision. Returns float64 ``[d, d]``.
    """
    return _power_of(*symmetric_eigh(matrix, name), exponent)


# The smallest eigenvalue over the largest below which a float32 decomposition is not used.
FLOAT32_CONDITION = 1e-3


def symmetric_eigh(
    matrix: Float[Tensor, "d d"], name: str = "covariance", dtype: torch.dtype = torch.float64
) -> tuple[Float[Tensor, " d"], Float[Tensor, "d d"]]:
    """Float64 eigenvalues (ascending) and eigenvectors of the symmetric part of ``matrix``,
    decomposed in ``dtype`` (float64 unless asked; a lower precision falls back to float64 where
    the matrix's condition number exceeds 1 / `FLOAT32_CONDITION`).

    Raises ValueError (naming ``name``) if the matrix is not positive definite to float64
    precision."""
    if dtype != torch.float64:
        low = (matrix.to(dtype) + matrix.to(dtype).T) / 2
        values, vectors = torch.linalg.eigh(low)
        # Only a well-conditioned matrix: at a condition number of 1e3 the float32 powers are
        # within 1.4e-5 (relative) of the float64 ones, at 1e4 already 4e-4.
        if float(values[-1]) > 0.0 and float(values[0]) > FLOAT32_CONDITION * float(values[-1]):
            return values.to(torch.float64), vectors.to(torch.float64)
    symmetric = (matrix.to(torch.float64) + matrix.to(torch.float64).T) / 2
    eigenvalues, eigenvectors = torch.linalg.eigh(symmetric)
    smallest, largest = float(eigenvalues[0]), float(eigenvalues[-1])
    if largest <= 0.0 or smallest <= largest * symmetric.shape[0] * torch.finfo(torch.float64).eps:
        raise ValueError(
            f"{name} is singular (smallest eigenvalue {smallest:.3e}, largest {largest:.3e}). "
            "After Ledoit-Wolf shrinkage this happens only when the states are constant or "
            "there are fewer than 3 of them; check the states and the split."
        )
    return eigenvalues, eigenvectors


def _power_of(eigenvalues: Tensor, eigenvectors: Tensor, exponent: float) -> Tensor:
    return (eigenvectors * eigenvalues.pow(exponent)) @ eigenvectors.T


@dataclass(frozen=True, eq=False)
class AffineCalibration:
    """The affine map ``h -> reference_mean + A (h - source_mean)``.

    ``linear`` is A: a vector ``[d]`` (the diagonal of A) for modes "mean" and "diag", a matrix
    ``[d, d]`` for "full". All parameters are float64. Build one with `fit` or `fit_calibration`.
    """

    mode: str
    source_mean: Float[Tensor, " d"]
    reference_mean: Float[Tensor, " d"]
    linear: Float[Tensor, " d"] | Float[Tensor, "d d"]
    # The parameters in the precision and on the device they are applied in, by (dtype, device):
    # a sweep applies one map to every batch, and casting [d, d] each time cost a sixth of a call.
    _cast: dict[tuple[torch.dtype, torch.device], tuple[Tensor, ...]] = field(
        default_factory=dict, init=False, repr=False
    )

    def __post_init__(self) -> None:
        _check_mode(self.mode)
        width = self.source_mean.shape[0]
        expected = (width,) if self.mode != "full" else (width, width)
        shapes = (self.reference_mean.shape, self.linear.shape)
        if self.reference_mean.shape != (width,) or self.linear.shape != expected:
            raise ValueError(
                f"mode {self.mode!r} with source_mean of width {width} needs reference_mean of "
                f"shape {(width,)} and linear of shape {expected}; got {shapes[0]}, {shapes[1]}."
            )
        for name in ("source_mean", "reference_mean", "linear"):
            value = getattr(self, name)
            if value.dtype != torch.float64:
                object.__setattr__(self, name, value.to(torch.float64))

    @classmethod
    def fit(
        cls, source: StreamingMoments, reference: StreamingMoments, mode: str = "full"
    ) -> AffineCalibration:
        """Fit the map that moves the ``source`` moments onto the ``reference`` moments.

        Covariances are Ledoit-Wolf shrunk first ("diag" uses the shrunk diagonals too), so the
        map is invertible whenever neither stream is constant. With fewer states than ``mode``
        needs (`MIN_STATES`) a simpler mode is fitted, with a `CalibrationFallbackWarning`.
        """
        _check_mode(mode)
        if source.width != reference.width:
            raise ValueError(
                f"source states have width {source.width} but reference states have width "
                f"{reference.width}; calibrate streams of the same model width."
            )
        mode = usable_mode(mode, min(source.count, reference.count), source.width or 0)
        source_mean = source.mean
        reference_mean = reference.mean.to(source_mean.device)
        if mode == "mean":
            linear = torch.ones_like(source_mean)
        elif mode == "diag":
            source_var = torch.diagonal(ledoit_wolf_shrinkage(source).covariance)
            reference_var = torch.diagonal(ledoit_wolf_shrinkage(reference).covariance)
            for name, variances in (("source", source_var), ("reference", reference_var)):
                if float(variances.min()) <= 0.0:
                    raise ValueError(
                        f"{name} covariance is singular (smallest variance "
                        f"{float(variances.min()):.3e}); after Ledoit-Wolf shrinkage this "
                        "happens only when a dimension is constant and the states are "
                        "constant or fewer than 3."
                    )
            linear = (reference_var.to(source_var.device) / source_var).sqrt()
        else:
            inverse_root = source.shrunk_power(-0.5, "source covariance")
            root = reference.shrunk_power(0.5, "reference covariance")
            linear = root.to(inverse_root.device) @ inverse_root
        return cls(mode=mode, source_mean=source_mean, reference_mean=reference_mean, linear=linear)

    @property
    def width(self) -> int:
        """Dimension d the map acts on."""
        return int(self.source_mean.shape[0])

    def __call__(self, h: Float[Tensor, "*batch d"]) -> Float[Tensor, "*batch d"]:
        """Calibrated states, same shape and dtype as ``h``.

        The map is fitted in float64 and applied in ``h``'s precision (float32 at least): centring
        first keeps a large common offset from costing precision, and a float32 sweep does not
        pay for float64 matrix products.
        """
        if h.shape[-1] != self.width:
            raise ValueError(
                f"states have width {h.shape[-1]} but the calibration was fitted on width "
                f"{self.width}."
            )
        dtype = torch.promote_types(h.dtype, torch.float32)
        key = (dtype, h.device)
        if key not in self._cast:
            self._cast[key] = tuple(
                t.to(device=h.device, dtype=dtype)
                for t in (self.source_mean, self.reference_mean, self.linear)
            )
        source_mean, reference_mean, linear = self._cast[key]
        centred = h.to(dtype) - source_mean
        if linear.ndim == 1:
            return torch.addcmul(reference_mean, centred, linear).to(h.dtype)
        # One fused product and sum (addmm) over the flattened positions.
        flat = torch.addmm(reference_mean, centred.reshape(-1, self.width), linear.T)
        return flat.reshape(centred.shape).to(h.dtype)

    def inverse(self) -> AffineCalibration:
        """The inverse map ``h -> source_mean + A^{-1} (h - reference_mean)`` (same mode)."""
        return self._inverse

    @functools.cached_property
    def _inverse(self) -> AffineCalibration:
        inverse_linear = (
            1.0 / self.linear if self.linear.ndim == 1 else torch.linalg.inv(self.linear)
        )
        return AffineCalibration(
            mode=self.mode,
            source_mean=self.reference_mean,
            reference_mean=self.source_mean,
            linear=inverse_linear,
        )

    def identity_deviation(self) -> dict[str, float]:
        """How far the map is from the identity, in the units of h.

        Returns ``{"linear": max |A - I|, "offset": max |b|}`` for the map written ``A h + b``.
        """
        linear = self.linear
        if linear.ndim == 1:
            linear_deviation = float((linear - 1.0).abs().max())
            offset = self.reference_mean - linear * self.source_mean
        else:
            identity = torch.eye(self.width, dtype=linear.dtype, device=linear.device)
            linear_deviation = float((linear - identity).abs().max())
            offset = self.reference_mean - linear @ self.source_mean
        return {"linear": linear_deviation, "offset": float(offset.abs().max())}

    def is_identity_within(self, tol: float) -> bool:
        """Whether both max |A - I| and max |b| (see `identity_deviation`) are <= ``tol``."""
        return all(value <= tol for value in self.identity_deviation().values())

    def to_dict(self) -> dict[str, Any]:
        """Plain-list form (float64 values survive a JSON round trip exactly)."""
        return {
            "mode": self.mode,
            "source_mean": self.source_mean.tolist(),
            "reference_mean": self.reference_mean.tolist(),
            "linear": self.linear.tolist(),
        }

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], device: str | torch.device | None = None
    ) -> AffineCalibration:
        """Inverse of `to_dict`; tensors are placed on ``device`` (CPU by default)."""
        missing = {"mode", "source_mean", "reference_mean", "linear"} - set(data)
        if missing:
            raise ValueError(
                f"calibration dict lacks keys {sorted(missing)}; it must come from to_dict()."
            )

        def tensor(key: str) -> Tensor:
            return torch.tensor(data[key], dtype=torch.float64, device=device)

        return cls(
            mode=data["mode"],
            source_mean=tensor("source_mean"),
            reference_mean=tensor("reference_mean"),
            linear=tensor("linear"),
        )


def fit_calibration(
    source: Tensor | Iterable[Tensor],
    reference: Tensor | Iterable[Tensor],
    mode: str = "full",
) -> AffineCalibration:
    """Stream the source and reference states (a tensor ``[..., d]`` or an iterable of them)
    and fit the `AffineCalibration` moving source onto reference."""
    _check_mode(mode)
    return AffineCalibration.fit(
        StreamingMoments.from_samples(source), StreamingMoments.from_samples(reference), mode
    )


# ----------------------------------------------------------------- input-dependent calibration


@dataclass(frozen=True, eq=False)
class MixtureCalibration:
    """A label-free map for readout shifts that differ between inputs: optimal transport between
    Gaussian mixtures fitted to the source states and to the reference states.

    Fitted from samples (no labels, no pairing of an example's s_k with its own s_r)::

        g = base(h)                              # the pooled full CORAL map first
        clusters: k-means on {base(source)} u {reference}, one partition for both sides
        P = optimal transport plan between the clusters' weights on each side, with the
            Wasserstein-2 cost between the clusters' Gaussians
        T_i(g) = sum_j P_ij / w_i * CORAL_{i -> j}(g)     (an affine map per source cluster)
        map(h) = sum_i posterior_i(g) T_i(g)

    Only the two marginals are matched, so the map cannot carry an example's answer: where the
    source and reference marginals already agree (same clusters, same weights, same moments) the
    plan is diagonal and every T_i is the identity, and the map injects nothing. ``inverse()`` is
    the same construction fitted from reference to source.

    Attributes:
        base: the pooled affine map applied first.
        centres: ``[K, d]`` the source clusters' means in the base frame (posterior centres).
        temperature: the posterior's variance per dimension (the mean within-cluster spread).
        log_weights: ``[K]`` log source weights of the clusters (-inf where a cluster is empty).
        linear: ``[K, d, d]`` the linear part of each T_i; ``offset``: ``[K, d]`` T_i(centre_i).
    """

    base: AffineCalibration
    centres: Float[Tensor, "K d"]
    temperature: float
    log_weights: Float[Tensor, " K"]
    linear: Float[Tensor, "K d d"]
    offset: Float[Tensor, "K d"]
    settings: dict[str, Any]
    reverse: MixtureCalibration | None = None

    mode = "mixture"

    @classmethod
    def fit(
        cls,
        source: Float[Tensor, "n d"],
        reference: Float[Tensor, "m d"],
        components: int = 4,
        seed: int = 0,
        _reverse: bool = True,
    ) -> MixtureCalibration:
        """Fit on samples of source and reference states (float64 internally)."""
        if components < 1:
            raise ValueError(f"components={components} must be >= 1.")
        source, reference = source.double(), reference.double()
        for name, states in (("source", source), ("reference", reference)):
            if states.ndim != 2 or states.shape[0] < 3 * components:
                raise ValueError(
                    f"{name} states have shape {tuple(states.shape)}; a mixture calibration with "
                    f"{components} components needs [n >= {3 * components}, d] samples: raise "
                    "the calibration split or lower the components."
                )
        base = fit_calibration(source, reference, "full")
        moved = base(source)
        centres = _kmeans(torch.cat([moved, reference]), components, seed)
        source_cluster = _nearest(moved, centres)
        reference_cluster = _nearest(reference, centres)
        # Each cluster's Gaussian: mean and Ledoit-Wolf covariance plus a small ridge, since a
        # cluster of identical states (discrete states) has no spread of its own.
        ridge = 1e-6 * float(torch.cat([moved, reference]).var(0).mean().clamp(min=1e-12))
        source_gaussians = [_gaussian(moved[source_cluster == i], ridge) for i in range(components)]
        reference_gaussians = [
            _gaussian(reference[reference_cluster == i], ridge) for i in range(components)
        ]
        source_weight = torch.bincount(source_cluster, minlength=components).double()
        reference_weight = torch.bincount(reference_cluster, minlength=components).double()
        plan = _transport_plan(
            source_gaussians,
            reference_gaussians,
            source_weight / source_weight.sum(),
            reference_weight / reference_weight.sum(),
        )
        width = source.shape[1]
        linear = torch.zeros(components, width, width, dtype=torch.float64)
        offset = torch.zeros(components, width, dtype=torch.float64)
        means = torch.stack(
            [g[0] if g is not None else centres[i] for i, g in enumerate(source_gaussians)]
        )
        for i, gaussian in enumerate(source_gaussians):
            row = plan[i]
            if gaussian is None or float(row.sum()) <= 0:
                linear[i] = torch.eye(width, dtype=torch.float64)
                offset[i] = means[i]
                continue
            source_root_inverse = symmetric_power(gaussian[1], -0.5, "cluster covariance")
            for j in torch.nonzero(row > 0).flatten().tolist():
                target = reference_gaussians[j]
                assert target is not None
                share = float(row[j] / row.sum())
                target_root = symmetric_power(target[1], 0.5, "cluster covariance")
                linear[i] += share * (target_root @ source_root_inverse)
                offset[i] += share * target[0]
        # An isotropic Gaussian per cluster: its variance per dimension is the mean spread.
        spread = (moved - means[source_cluster]).pow(2).mean()
        temperature = float(spread.clamp(min=1e-12))
        settings = {"components": components, "seed": seed, "cost": "Wasserstein-2 (Bures)"}
        mapping = cls(
            base=base,
            centres=means,
            temperature=temperature,
            log_weights=source_weight.clamp(min=1e-300).log(),
            linear=linear,
            offset=offset,
            settings=settings,
        )
        if _reverse:
            reverse = cls.fit(reference, source, components, seed, _reverse=False)
            object.__setattr__(mapping, "reverse", reverse)
            object.__setattr__(reverse, "reverse", mapping)
        return mapping

    @property
    def width(self) -> int:
        return int(self.centres.shape[1])

    def posterior(self, g: Float[Tensor, "n d"]) -> Float[Tensor, "n K"]:
        """Membership of base-frame states in the source clusters (soft, sums to 1)."""
        centres = self.centres.to(device=g.device, dtype=g.dtype)
        distance = torch.cdist(g, centres).pow(2)
        logits = self.log_weights.to(device=g.device, dtype=g.dtype) - distance / (
            2 * self.temperature
        )
        return logits.softmax(-1)

    def __call__(self, h: Float[Tensor, "*batch d"]) -> Float[Tensor, "*batch d"]:
        """Calibrated states, same shape and dtype as ``h`` (computed in float32 at least)."""
        dtype = torch.promote_types(h.dtype, torch.float32)
        g = self.base(h).to(dtype).reshape(-1, self.width)
        weights = self.posterior(g)  # [n, K]
        centres, linear, offset = (
            t.to(device=h.device, dtype=dtype) for t in (self.centres, self.linear, self.offset)
        )
        out = torch.zeros_like(g)
        for i in range(linear.shape[0]):
            mapped = (g - centres[i]) @ linear[i].T + offset[i]
            out += weights[:, i : i + 1] * mapped
        return out.reshape(h.shape).to(h.dtype)

    def inverse(self) -> MixtureCalibration:
        """The same construction fitted from reference to source (used by `shift`)."""
        if self.reverse is None:
            raise ValueError("this mixture calibration was fitted without its reverse map.")
        return self.reverse

    def identity_deviation(self) -> dict[str, float]:
        """How far the map is from the identity: the base map's deviation, and per cluster
        max |L_i - I| and max |T_i(centre_i) - centre_i|."""
        eye = torch.eye(self.width, dtype=torch.float64)
        base = self.base.identity_deviation()
        return {
            "linear": max(base["linear"], float((self.linear - eye).abs().max())),
            "offset": max(base["offset"], float((self.offset - self.centres).abs().max())),
        }

    def describe(self) -> dict[str, Any]:
        """The map and its settings, for results."""
        return {"mode": self.mode, **self.settings}


def _kmeans(points: Tensor, k: int, seed: int, restarts: int = 8) -> Tensor:
    """k-means: the best (least within-cluster spread) of ``restarts`` k-means++ starts refined
    by Lloyd's iterations, ``[k, d]``; seeded."""
    best, best_spread = None, math.inf
    for restart in range(restarts):
        centres = _kmeans_once(points, k, seed * 1009 + restart)
        spread = float(torch.cdist(points, centres).min(-1).values.pow(2).sum())
        if spread < best_spread:
            best, best_spread = centres, spread
    assert best is not None
    return best


def _kmeans_once(points: Tensor, k: int, seed: int, iterations: int = 30) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    first = int(torch.randint(points.shape[0], (), generator=generator))
    centres = [points[first]]
    for _ in range(1, k):
        distance = torch.cdist(points, torch.stack(centres)).pow(2).min(-1).values
        if float(distance.sum()) <= 0:
            centres.append(points[int(torch.randint(points.shape[0], (), generator=generator))])
            continue
        chosen = torch.multinomial(
            (distance / distance.sum()).float().cpu(), 1, generator=generator
        )
        centres.append(points[int(chosen)])
    stacked = torch.stack(centres)
    for _ in range(iterations):
        assignment = _nearest(points, stacked)
        for i in range(k):
            members = points[assignment == i]
            if members.shape[0]:
                stacked[i] = members.mean(0)
    return stacked


def _nearest(points: Tensor, centres: Tensor) -> Tensor:
    return torch.cdist(points, centres.to(points.dtype)).argmin(-1)


def _gaussian(states: Tensor, ridge: float) -> tuple[Tensor, Tensor] | None:
    """Mean and shrunk covariance (+ ridge I) of a cluster's states; None below 3 states."""
    if states.shape[0] < 3:
        return None
    covariance = ledoit_wolf_shrinkage(StreamingMoments.from_samples(states)).covariance
    eye = torch.eye(states.shape[1], dtype=covariance.dtype, device=covariance.device)
    return states.mean(0), covariance + ridge * eye


def _transport_plan(
    source: list[tuple[Tensor, Tensor] | None],
    reference: list[tuple[Tensor, Tensor] | None],
    source_weight: Tensor,
    reference_weight: Tensor,
) -> Tensor:
    """Optimal transport plan ``[K, K]`` between the clusters' weights, Wasserstein-2 cost
    between their Gaussians; clusters too small to have moments carry no mass."""
    from scipy.optimize import linprog

    k = len(source)
    a = torch.tensor([float(w) if g is not None else 0.0 for w, g in zip(source_weight, source,
                      strict=True)], dtype=torch.float64)  # fmt: skip
    b = torch.tensor([float(w) if g is not None else 0.0 for w, g in zip(reference_weight,
                      reference, strict=True)], dtype=torch.float64)  # fmt: skip
    if float(a.sum()) <= 0 or float(b.sum()) <= 0:
        raise ValueError("no cluster has enough states on both sides to fit a mixture map.")
    a, b = a / a.sum(), b / b.sum()
    cost = torch.full((k, k), 1e30, dtype=torch.float64)
    for i, gi in enumerate(source):
        for j, gj in enumerate(reference):
            if gi is None or gj is None:
                continue
            root = symmetric_power(gi[1], 0.5, "cluster covariance")
            cross = symmetric_power(root @ gj[1] @ root, 0.5, "cluster covariance")
            bures = torch.trace(gi[1]) + torch.trace(gj[1]) - 2 * torch.trace(cross)
            cost[i, j] = (gi[0] - gj[0]).pow(2).sum() + bures.clamp(min=0)
    equality = []
    for i in range(k):
        row = torch.zeros(k, k)
        row[i, :] = 1
        equality.append(row.flatten())
    for j in range(k):
        column = torch.zeros(k, k)
        column[:, j] = 1
        equality.append(column.flatten())
    result = linprog(
        cost.flatten().numpy(),
        A_eq=torch.stack(equality).numpy(),
        b_eq=torch.cat([a, b]).numpy(),
        bounds=(0, None),
        method="highs",
    )
    if not result.success:
        raise ValueError(f"the transport problem between clusters failed: {result.message}")
    return torch.tensor(result.x, dtype=torch.float64).view(k, k).clamp(min=0)


# ----------------------------------------------------------------- the registry of maps


@runtime_checkable
class StateMap(Protocol):
    """What the protocol needs of a fitted calibration map: apply it, invert it (``shift``),
    say how far it is from the identity (the null control), and name its ``mode`` (a fitted
    mode other than the one asked for is recorded as a fallback)."""

    @property
    def mode(self) -> str: ...

    def __call__(self, h: Tensor) -> Tensor: ...

    def inverse(self) -> StateMap: ...

    def identity_deviation(self) -> dict[str, float]: ...


@runtime_checkable
class MapSettings(Protocol):
    """The protocol settings a map's fit may read (a `dcp_lens.protocol.config.ProtocolConfig`)."""

    @property
    def mixture_components(self) -> int: ...

    @property
    def calibration_points(self) -> int: ...

    @property
    def seed(self) -> int: ...


@dataclass(frozen=True)
class CalibrationMap:
    """One kind of calibration map of the S control, as `CALIBRATION_MAPS` registers it.

    A map is fitted either from the streamed moments of the source and reference readout inputs
    (``from_moments``; no states kept) or, when ``from_moments`` is None, from fixed-size
    subsamples of them (``from_states``; the protocol keeps ``calibration_points`` states per
    condition). ``from_states`` also fits the calibration null (between two halves of full
    depth's states), so every map has it.

    Attributes:
        name: the ``calibration_mode`` that picks it.
        from_states: ``(source [n, d], reference [m, d], settings) -> map``.
        from_moments: ``(source, reference, settings) -> map`` from `StreamingMoments`, or None.
        describe: ``settings -> dict``: what results record of the map beyond its mode.
        lower_bound: whether the map's gain bounds readout shift from below (docs/bracket.md):
            an affine moment-matching map cannot add information about the example; a map that
            can move each state anywhere on the other marginal (optimal transport between
            mixtures) can carry out the remaining computation itself, so with it S is never
            identified and the verdict stays inconclusive.
    """

    name: str
    from_states: Callable[[Tensor, Tensor, MapSettings], StateMap]
    from_moments: Callable[[StreamingMoments, StreamingMoments, MapSettings], StateMap] | None = (
        None
    )
    describe: Callable[[MapSettings], dict[str, Any]] = lambda settings: {}
    lower_bound: bool = True

    @property
    def needs_states(self) -> bool:
        """Whether the protocol must keep subsamples of states to fit it."""
        return self.from_moments is None


CALIBRATION_MAPS: dict[str, CalibrationMap] = {}


def register_calibration_map(entry: CalibrationMap) -> CalibrationMap:
    """Add ``entry`` to `CALIBRATION_MAPS` (a second entry under a taken name is refused); its
    name is then a ``calibration_mode`` of the protocol and of ``dcp-lens run``."""
    return add_entry(CALIBRATION_MAPS, entry.name, entry, "calibration map")


def _affine(mode: str) -> CalibrationMap:
    return CalibrationMap(
        mode,
        from_states=lambda source, reference, settings: fit_calibration(source, reference, mode),
        from_moments=lambda source, reference, settings: AffineCalibration.fit(
            source, reference, mode
        ),
    )


for _mode in AFFINE_MODES:
    register_calibration_map(_affine(_mode))
register_calibration_map(
    CalibrationMap(
        "mixture",
        from_states=lambda source, reference, settings: MixtureCalibration.fit(
            source, reference, settings.mixture_components, settings.seed
        ),
        describe=lambda settings: {
            "components": settings.mixture_components,
            "calibration_points": settings.calibration_points,
            "plan": "optimal transport between cluster weights, Wasserstein-2 (Bures) cost",
        },
        lower_bound=False,
    )
)
