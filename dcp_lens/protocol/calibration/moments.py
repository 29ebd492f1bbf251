"""Streaming float64 moments of readout inputs (mean, scatter and the fourth-order sums
Ledoit-Wolf shrinkage needs), in one pass that merges and subtracts exactly."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypedDict

import torch
from jaxtyping import Float
from torch import Tensor

from dcp_lens.protocol.calibration.linalg import (
    Eigen,
    ledoit_wolf_shrinkage,
    power_of,
    rounding_floor,
    storage_rounding,
    subspace_eigh,
    symmetric_eigh,
)
from dcp_lens.utils.devices import copy_without_wait, host_copy_done
from dcp_lens.utils.snapshots import snapshot_field

# The largest share of the width the states' span may have for `for_refit`'s subspace
# decomposition: above it, one full eigendecomposition costs about as much.
SUBSPACE_SHARE = 0.5


def all_finite(x: Tensor) -> bool:
    """Whether every element of ``x`` is finite: its largest and smallest are (max and min
    propagate NaN), two reductions rather than a mask the size of ``x``. True when empty."""
    if x.numel() == 0:
        return True
    return bool(torch.isfinite(x.amax())) and bool(torch.isfinite(x.amin()))


class MomentsState(TypedDict):
    """A `StreamingMoments`' count and float64 sums (None before the first sample)."""

    count: int
    mean: Tensor | None
    scatter: Tensor | None
    norm_weighted_sum: Tensor | None
    fourth_sum: Tensor | None


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
        # Of the shrunk covariance, until an update: its eigendecomposition, its powers and the
        # span of its eigenvectors above rounding (`span`).
        self._eigen: Eigen | None = None
        self._powers: dict[float, Tensor] = {}
        self._span: Tensor | None = None
        # Its value on the identity (a mu), its eigenvalue floor and float32 rounding of it.
        self._levels: tuple[float, float, float] | None = None
        self._eigh_dtype = torch.float64  # float32 for a jackknife refit: `for_refit`
        # For a jackknife refit (`for_refit`): its whole split and that split's eigenvalue floor.
        self._within: StreamingMoments | None = None
        self._floor: float | None = None
        # Set while a copy off the device into these (pinned host) sums may be unfinished:
        # `to` queues it without waiting; `_ready` waits before the host reads them.
        self._copied: torch.cuda.Event | None = None

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
        self._ready()
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
        self._ready()
        if self.device is None or self.device.type == "cpu":  # read on the host
            other._ready()
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
        if device.type == "cpu":  # read on the host
            part._ready()
        part_mean = copy_without_wait(part._mean, device)
        mean = (self._mean * self._count - part_mean * part._count) / count
        # The part's sums about the whole's mean, taken off the whole's; what is left are the
        # rest's sums about the whole's mean, recentred onto the rest's own mean.
        moved = _recentre(
            part._count,
            part_mean - self._mean,
            copy_without_wait(part._scatter, device).to(torch.float64),
            copy_without_wait(part._norm_weighted_sum, device),
            copy_without_wait(part._fourth_sum, device),
        )
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
        self._eigen, self._powers, self._span, self._levels = None, {}, None, None
        if self._count == 0:
            self._count, self._mean, self._scatter = count, mean, scatter.to(self._storage)
            self._norm_weighted_sum, self._fourth_sum = norm_weighted, fourth
            return
        assert self._mean is not None and self._scatter is not None
        assert self._norm_weighted_sum is not None and self._fourth_sum is not None
        device = self._mean.device
        mean = copy_without_wait(mean, device)
        scatter = copy_without_wait(scatter, device).to(torch.float64)
        norm_weighted = copy_without_wait(norm_weighted, device)
        fourth = copy_without_wait(fourth, device)
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

    def state(self) -> MomentsState:
        """The count and the float64 sums, all `from_state` needs (tensors and an int)."""
        self._ready()
        return {
            "count": self._count,
            "mean": self._mean,
            "scatter": self._scatter,
            "norm_weighted_sum": self._norm_weighted_sum,
            "fourth_sum": self._fourth_sum,
        }

    @classmethod
    def from_state(
        cls, state: object, storage: torch.dtype = torch.float64, field: str = "moments"
    ) -> StreamingMoments:
        """The moments `state` recorded, exactly (the scatter kept in ``storage`` from then).
        A field of the wrong type raises `SnapshotFieldError` naming it (``field`` is where
        ``state`` sits in its snapshot)."""
        moments = cls(storage)
        moments._count = snapshot_field(state, "count", field, "count")
        moments._mean = snapshot_field(state, "mean", field, "optional tensor")
        moments._scatter = snapshot_field(state, "scatter", field, "optional tensor")
        moments._norm_weighted_sum = snapshot_field(
            state, "norm_weighted_sum", field, "optional tensor"
        )
        moments._fourth_sum = snapshot_field(state, "fourth_sum", field, "optional tensor")
        return moments

    def _ready(self) -> None:
        """Wait for the copy that brought these sums to the host, if one may be unfinished."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def _require_samples(self) -> None:
        self._ready()
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

    def to(self, device: torch.device) -> StreamingMoments:
        """These moments with their sums on ``device`` (``self`` where they are there already,
        or hold none yet)."""
        if self._mean is None or self._mean.device == device:
            return self
        assert self._scatter is not None
        assert self._norm_weighted_sum is not None and self._fourth_sum is not None
        moved = StreamingMoments(self._storage)
        moved._count, moved._eigh_dtype = self._count, self._eigh_dtype
        moved._within, moved._floor = self._within, self._floor
        # Off a GPU into pinned host memory and back without the host waiting (the stream
        # orders the copies; `_ready` waits where the host reads them).
        moved._mean = copy_without_wait(self._mean, device)
        moved._scatter = copy_without_wait(self._scatter, device)
        moved._norm_weighted_sum = copy_without_wait(self._norm_weighted_sum, device)
        moved._fourth_sum = copy_without_wait(self._fourth_sum, device)
        source = self._mean.device
        moved._copied = host_copy_done(source) if device.type == "cpu" else None
        return moved

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
                self._eigen = self._decomposed(name)
            self._powers[exponent] = power_of(self._eigen, exponent)
        return self._powers[exponent]

    def _decomposed(self, name: str) -> Eigen:
        """The shrunk covariance's eigendecomposition, its eigenvalues lifted to
        `eigenvalue_floor`: on the whole split's `span` where these are a refit's moments
        (`for_refit`) and the states stay in it, else in full."""
        shrunk = ledoit_wolf_shrinkage(self)
        floor = self.eigenvalue_floor(shrunk.covariance)
        # A refit's sums hold float32-stored group scatters: what the subspace drops below their
        # rounding, the whole decomposition could not resolve either.
        tolerance = storage_rounding(shrunk.covariance, torch.float32)
        self._levels = (shrunk.intensity * shrunk.scale, floor, tolerance)
        basis = None if self._within is None else self._within.span(name)
        width = shrunk.covariance.shape[0]
        if basis is not None and 0 < basis.shape[1] <= SUBSPACE_SHARE * width:
            eigen = subspace_eigh(
                shrunk, self.covariance, basis.to(shrunk.covariance.device), floor, tolerance, name
            )
            if eigen is not None:
                return eigen
        values, vectors = symmetric_eigh(shrunk.covariance, name, self._eigh_dtype, floor)
        return values, vectors, None

    def span(self, name: str = "covariance") -> Float[Tensor, "d m"]:
        """Orthonormal eigenvectors ``[d, m]`` of the shrunk covariance whose eigenvalues stand
        above its value on the identity (``a mu``, or `eigenvalue_floor` where that is higher)
        by more than float32 rounding of the scatter can make (`storage_rounding`): the
        directions the states vary in. Computed once until the next update."""
        if self._span is None:
            if self._eigen is None:
                self._eigen = self._decomposed(name)
            values, vectors, _ = self._eigen
            assert self._levels is not None
            identity_part, floor, noise = self._levels
            self._span = vectors[:, values > max(identity_part, floor) + noise]
        return self._span

    def for_refit(self, within: StreamingMoments | None = None) -> StreamingMoments:
        """These moments (returns self) prepared for a jackknife refit
        (`dcp_lens.protocol.fit.fit_maps`) of ``within`` (the whole split's moments, of which
        these are a part; None: the refit stands alone).

        The refit shares ``within``'s `eigenvalue_floor` (see `rounding_floor`), and borrows its
        `span`: the states of a part of the split vary only in directions the whole split's
        vary in, so where that span has at most `SUBSPACE_SHARE` of the width the
        eigendecomposition is taken on it (`subspace_eigh`, exact where the states stay in it,
        checked against float32 rounding of the sums). Otherwise the full one is taken, in
        float32 where the shrunk covariance is well conditioned (`symmetric_eigh`): the refits'
        maps differ from the whole split's by about 1e-2 relative, the float32 powers from the
        float64 ones by about 1e-5; elsewhere in float64. The powers stay float64."""
        self._eigh_dtype = torch.float32
        self._within = within
        self._floor = None if within is None else within.eigenvalue_floor()
        self._eigen, self._powers, self._span, self._levels = None, {}, None, None
        return self

    def eigenvalue_floor(self, shrunk: Tensor | None = None) -> float:
        """The floor `shrunk_power` lifts the shrunk covariance's eigenvalues to: the whole
        split's where `for_refit` gave one, else `rounding_floor` of the shrunk covariance
        (``shrunk``, float64 ``[d, d]``, where the caller has it)."""
        if self._floor is not None:
            return self._floor
        if self._levels is not None:  # computed with the eigendecomposition
            return self._levels[1]
        if shrunk is None:
            shrunk = ledoit_wolf_shrinkage(self).covariance
        return rounding_floor(shrunk)

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
