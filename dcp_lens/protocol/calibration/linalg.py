"""Linear algebra of the calibration maps: Ledoit-Wolf shrinkage of a covariance and powers of
symmetric positive-definite matrices through their eigendecomposition."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from jaxtyping import Float
from torch import Tensor


@runtime_checkable
class CovarianceMoments(Protocol):
    """What `ledoit_wolf_shrinkage` reads of streamed moments (`StreamingMoments` has it)."""

    @property
    def count(self) -> int: ...

    @property
    def covariance(self) -> Float[Tensor, "d d"]: ...

    @property
    def fourth_moment_sum(self) -> float: ...


@dataclass(frozen=True, eq=False)
class ShrunkCovariance:
    """A Ledoit-Wolf estimate: ``(1 - intensity) * S + intensity * scale * I``."""

    covariance: Float[Tensor, "d d"]
    intensity: float
    scale: float


def ledoit_wolf_shrinkage(moments: CovarianceMoments) -> ShrunkCovariance:
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
    return power_of((*symmetric_eigh(matrix, name), None), exponent)


# The smallest eigenvalue over the largest below which a float32 decomposition is not used.
FLOAT32_CONDITION = 1e-3


def rounding_floor(matrix: Float[Tensor, "d d"]) -> float:
    """What rounding cannot tell from zero in the eigenvalues of a symmetric ``[d, d]`` matrix
    of summed moments: ``eps * |matrix|_F``, ``eps`` the larger of float32's (the jackknife's
    calibration groups sum their scatter in float32; rounding each entry moves every eigenvalue
    by at most about this, Weyl's bound) and ``2 d`` times float64's (at least twice what
    `symmetric_eigh` refuses as singular).

    A covariance of states that span fewer directions than the stream has (a planted mechanism
    embedded in a wider stream, a real stream's unused directions) has eigenvalues at zero that
    come out as rounding, below zero included, and the Ledoit-Wolf shrinkage of many samples is
    too small to lift them. The whole split's maps and every jackknife refit must lift them to
    one floor: a refit whose unused eigenvalues differ from the whole's changes its map there by
    their ratio, which the jackknife would read as calibration variance.

    The floor must stay below the small real eigenvalues of the directions the states do vary
    in, which the readout may read strongly: it clamps them too, and the map, fitted between two
    streams whose small eigenvalues differ, then moves what it should leave. So it carries no
    factor of the width: with one of ``sqrt(d)``, a planted near tie embedded at width 1024
    changed its top-1 under a map that should leave it (docs/validation.md, coverage at width
    2048)."""
    width = matrix.shape[0]
    eps = max(torch.finfo(torch.float32).eps, 2 * width * torch.finfo(torch.float64).eps)
    return eps * float(torch.linalg.matrix_norm(matrix))


def storage_rounding(matrix: Float[Tensor, "d d"], storage: torch.dtype) -> float:
    """``eps * |matrix|_F`` with ``eps`` the machine epsilon of ``storage``: about the Frobenius
    norm of what rounding each entry of ``matrix`` to ``storage`` changes (at most half that)."""
    return torch.finfo(storage).eps * float(torch.linalg.matrix_norm(matrix))


def symmetric_eigh(
    matrix: Float[Tensor, "d d"],
    name: str = "covariance",
    dtype: torch.dtype = torch.float64,
    floor: float = 0.0,
) -> tuple[Float[Tensor, " d"], Float[Tensor, "d d"]]:
    """Float64 eigenvalues (ascending) and eigenvectors of the symmetric part of ``matrix``,
    decomposed in ``dtype`` (float64 unless asked; a lower precision falls back to float64 where
    the matrix's condition number exceeds 1 / `FLOAT32_CONDITION`). Eigenvalues below ``floor``
    (`rounding_floor`: what rounding cannot tell from zero) are raised to it.

    Raises ValueError (naming ``name``) if the matrix is not positive definite to float64
    precision after that."""
    if dtype != torch.float64:
        low = (matrix.to(dtype) + matrix.to(dtype).T) / 2
        values, vectors = torch.linalg.eigh(low)
        # Only a well-conditioned matrix: at a condition number of 1e3 the float32 powers are
        # within 1.4e-5 (relative) of the float64 ones, at 1e4 already 4e-4.
        values = values.clamp(min=floor)
        if float(values[-1]) > 0.0 and float(values[0]) > FLOAT32_CONDITION * float(values[-1]):
            return values.to(torch.float64), vectors.to(torch.float64)
    symmetric = (matrix.to(torch.float64) + matrix.to(torch.float64).T) / 2
    eigenvalues, eigenvectors = torch.linalg.eigh(symmetric)
    eigenvalues = eigenvalues.clamp(min=floor)
    _check_definite(float(eigenvalues[0]), float(eigenvalues[-1]), symmetric.shape[0], name)
    return eigenvalues, eigenvectors


def _check_definite(smallest: float, largest: float, width: int, name: str) -> None:
    if largest <= 0.0 or smallest <= largest * width * torch.finfo(torch.float64).eps:
        raise ValueError(
            f"{name} is singular (smallest eigenvalue {smallest:.3e}, largest {largest:.3e}). "
            "After Ledoit-Wolf shrinkage and the rounding floor this happens only when the "
            "states are constant or there are fewer than 3 of them; check the states and the split."
        )


# A decomposition `subspace_eigh` returns: eigenvalues ``[m]`` and eigenvectors ``[d, m]`` of the
# matrix on a subspace, and its one eigenvalue on the rest (None: the m = d vectors are all).
Eigen = tuple[Tensor, Tensor, float | None]


def subspace_eigh(
    shrunk: ShrunkCovariance,
    covariance: Float[Tensor, "d d"],
    basis: Float[Tensor, "d m"],
    floor: float,
    tolerance: float,
    name: str = "covariance",
) -> Eigen | None:
    """The eigendecomposition of ``shrunk`` (the Ledoit-Wolf estimate of ``covariance``, float64
    ``[d, d]``) from its block on the span of ``basis`` (orthonormal columns, float64 ``[d, m]``),
    in O(d^2 m + m^3) rather than O(d^3); None where the covariance is not inside that span.

    With Q = ``basis`` and P an orthonormal complement, S = ``covariance``, the estimate is
    ``(1 - a) S + a mu I``. Where S P = 0 it equals exactly
    ``Q ((1 - a) Q^T S Q + a mu I) Q^T + a mu P P^T``: its eigenvectors are Q's block's, mapped
    by Q, and on P its one eigenvalue is ``a mu``. What that drops of S is
    ``(1 - a) |S - Q Q^T S Q Q^T|_F`` (the blocks Q^T S P and P^T S P, computed as such, without
    cancellation); where it exceeds ``tolerance`` this returns None and the caller decomposes the
    whole matrix. Eigenvalues below ``floor`` are raised to it, as `symmetric_eigh` does, so the
    powers (`power_of`) differ from the whole decomposition's by at most
    ``|p| floor^(p - 1) * dropped`` in the Frobenius norm for an exponent p (the powers are
    Lipschitz with that constant on ``[floor, inf)``).

    Raises ValueError (naming ``name``) where the estimate is singular, as `symmetric_eigh`."""
    projected = covariance @ basis  # [d, m]: S Q
    block = basis.T @ projected  # [m, m]: Q^T S Q
    coupling = projected - basis @ block  # [d, m]: P P^T S Q
    outside = covariance - basis @ projected.T  # [d, d]: P P^T S
    outside -= coupling @ basis.T  # P P^T S P P^T
    dropped = (1.0 - shrunk.intensity) * float(
        (2 * coupling.pow(2).sum() + outside.pow(2).sum()).sqrt()
    )
    if dropped > tolerance:
        return None
    identity_part = shrunk.intensity * shrunk.scale
    own = (1.0 - shrunk.intensity) * block + identity_part * torch.eye(
        block.shape[0], dtype=block.dtype, device=block.device
    )
    values, vectors = torch.linalg.eigh((own + own.T) / 2)
    values = values.clamp(min=floor)
    rest = max(identity_part, floor)
    smallest, largest = min(float(values[0]), rest), max(float(values[-1]), rest)
    _check_definite(smallest, largest, covariance.shape[0], name)
    return values, basis @ vectors, rest


def power_of(eigen: Eigen, exponent: float) -> Float[Tensor, "d d"]:
    """The matrix ``V diag(values^p) V^T + rest^p (I - V V^T)`` of a decomposition
    ``(values [m], V [d, m], rest)`` (`symmetric_eigh`'s with rest None, or `subspace_eigh`'s)
    to the power p = ``exponent``, float64 ``[d, d]``."""
    values, vectors, rest = eigen
    if rest is None:
        return (vectors * values.pow(exponent)) @ vectors.T
    on_rest = rest**exponent
    power = (vectors * (values.pow(exponent) - on_rest)) @ vectors.T
    power.diagonal().add_(on_rest)
    return power
