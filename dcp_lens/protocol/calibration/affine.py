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
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypedDict

import torch
from jaxtyping import Float
from torch import Tensor

from dcp_lens.protocol.calibration.linalg import ledoit_wolf_shrinkage
from dcp_lens.protocol.calibration.moments import StreamingMoments

# The affine modes, simplest first: a split too small for a mode falls back along this order.
AFFINE_MODES = ("mean", "diag", "full")
# Fewest states each mode is fitted from: a full covariance of width d needs d + 1 states to be
# more than shrinkage fitted to noise (which can move a share on its own); per-dimension
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


class AffineDict(TypedDict):
    """An `AffineCalibration` as plain lists (`AffineCalibration.to_dict`)."""

    mode: str
    source_mean: list[float]
    reference_mean: list[float]
    linear: list[float] | list[list[float]]


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
    # a sweep applies one map to every batch, so [d, d] is cast once rather than once a batch.
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

    def to_dict(self) -> AffineDict:
        """Plain-list form (float64 values survive a JSON round trip exactly)."""
        return {
            "mode": self.mode,
            "source_mean": self.source_mean.tolist(),
            "reference_mean": self.reference_mean.tolist(),
            "linear": self.linear.tolist(),
        }

    @classmethod
    def from_dict(
        cls, data: AffineDict, device: str | torch.device | None = None
    ) -> AffineCalibration:
        """Inverse of `to_dict`; tensors are placed on ``device`` (CPU by default)."""
        missing = {"mode", "source_mean", "reference_mean", "linear"} - set(data)
        if missing:
            raise ValueError(
                f"calibration dict lacks keys {sorted(missing)}; it must come from to_dict()."
            )

        def tensor(values: list[float] | list[list[float]]) -> Tensor:
            return torch.tensor(values, dtype=torch.float64, device=device)

        return cls(
            mode=data["mode"],
            source_mean=tensor(data["source_mean"]),
            reference_mean=tensor(data["reference_mean"]),
            linear=tensor(data["linear"]),
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
