"""The jackknife's refitted maps and translators, held as the whole split's plus a difference.

A leave-one-group-out refit differs from the whole split's map by a few percent, so it is held
as that difference, scaled to its largest entry and stored in float16 (a quarter of a float64
d x d matrix), and applied as the whole split's map plus the difference's product. The
difference's rounding is 5e-4 of its largest entry, a few 1e-5 of the map's output: small
beside the spread between refits that the jackknife measures. Inverses (the shift's) are formed
from the rebuilt float64 linear part when first asked for.
"""

from __future__ import annotations

import functools

import torch
from jaxtyping import Float
from torch import Tensor

from dcp_lens.protocol.calibration import AffineCalibration, FittedMap
from dcp_lens.protocol.translator import AffineTranslator


def compressed(difference: Tensor) -> tuple[Tensor, float]:
    """``difference`` as float16 scaled to its largest magnitude, and that scale (0: zeros)."""
    scale = float(difference.abs().max()) if difference.numel() else 0.0
    if scale == 0.0 or not torch.isfinite(torch.tensor(scale)):
        return difference.to(torch.float16) * 0, 0.0
    return (difference / scale).to(torch.float16), scale


class LeftOutAffine:
    """A jackknife refit of a full-mode `AffineCalibration`: ``whole``'s linear part plus a
    compressed difference, the refit's own means. Applied in ``h``'s precision (float32 at
    least), as `AffineCalibration` is."""

    mode = "full"

    def __init__(self, whole: AffineCalibration, refit: AffineCalibration) -> None:
        self.whole = whole
        self.source_mean, self.reference_mean = refit.source_mean, refit.reference_mean
        linear = whole.linear.to(refit.linear.device)
        self.delta, self.scale = compressed(refit.linear - linear)
        self._cast: dict[tuple[torch.dtype, torch.device], tuple[Tensor, ...]] = {}

    @classmethod
    def of(cls, whole: FittedMap | None, refit: FittedMap) -> FittedMap:
        """``refit`` compressed against ``whole`` where both are full-mode affine maps, else
        ``refit`` as it is."""
        if (
            isinstance(whole, AffineCalibration)
            and isinstance(refit, AffineCalibration)
            and whole.linear.ndim == 2
            and refit.linear.ndim == 2
        ):
            return cls(whole, refit)
        return refit

    @property
    def width(self) -> int:
        return int(self.source_mean.shape[0])

    @property
    def linear(self) -> Float[Tensor, "d d"]:
        """The refit's linear part, float64 (rebuilt; the map keeps only the difference)."""
        base = self.whole.linear.to(self.delta.device)
        return base + self.scale * self.delta.to(torch.float64)

    def __call__(self, h: Float[Tensor, "*batch d"]) -> Float[Tensor, "*batch d"]:
        dtype = torch.promote_types(h.dtype, torch.float32)
        key = (dtype, h.device)
        self.whole(h[..., :0, :] if h.ndim > 1 else h[:0])  # the whole map's cast, shared
        _, _, linear = self.whole._cast[key]
        if key not in self._cast:
            self._cast[key] = tuple(
                t.to(device=h.device, dtype=dtype) for t in (self.source_mean, self.reference_mean)
            )
        source_mean, reference_mean = self._cast[key]
        flat = (h.to(dtype) - source_mean).reshape(-1, self.width)
        out = torch.addmm(reference_mean, flat, linear.T)
        delta = self.delta.to(device=h.device, dtype=dtype)
        out = torch.addmm(out, flat, delta.T, alpha=self.scale)
        return out.reshape(h.shape).to(h.dtype)

    def identity_deviation(self) -> dict[str, float]:
        """How far the refit is from the identity (`AffineCalibration.identity_deviation`)."""
        return AffineCalibration(
            "full", self.source_mean, self.reference_mean, self.linear
        ).identity_deviation()

    def inverse(self) -> LeftOutAffine:
        """The refit's inverse, held the same way against the whole split's inverse."""
        return self._inverse

    @functools.cached_property
    def _inverse(self) -> LeftOutAffine:
        exact = AffineCalibration(
            mode="full",
            source_mean=self.reference_mean,
            reference_mean=self.source_mean,
            linear=torch.linalg.inv(self.linear),
        )
        return LeftOutAffine(self.whole.inverse(), exact)


class LeftOutTranslator:
    """A jackknife refit of an `AffineTranslator`: ``whole`` plus a compressed difference of the
    weight and the difference of the bias."""

    def __init__(self, whole: AffineTranslator, refit: AffineTranslator) -> None:
        self.whole = whole
        self.d_model = refit.d_model
        self.delta, self.scale = compressed(refit.weight - whole.weight.to(refit.weight.device))
        self.bias_delta = refit.bias - whole.bias.to(refit.bias.device)
        self._cast: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}

    def __call__(self, state: Float[Tensor, "*batch d_model"]) -> Float[Tensor, "*batch d_model"]:
        dtype = torch.promote_types(state.dtype, torch.float32)
        key = (dtype, state.device)
        if key not in self._cast:
            self._cast[key] = (
                self.delta.to(state.device),
                self.bias_delta.to(device=state.device, dtype=dtype),
            )
        delta, bias = self._cast[key]
        moved = self.whole(state).to(dtype)
        flat = state.to(dtype).reshape(-1, self.d_model)
        extra = torch.addmm(bias, flat, delta.to(dtype).T, alpha=self.scale)
        return (moved + extra.reshape(moved.shape)).to(state.dtype)
