"""Input-dependent calibration: optimal transport between Gaussian mixtures fitted to the source
and reference states (k-means clusters, a transport plan between their weights)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from dcp_lens.protocol.calibration.affine import AffineCalibration, fit_calibration
from dcp_lens.protocol.calibration.linalg import ledoit_wolf_shrinkage, symmetric_power
from dcp_lens.protocol.calibration.moments import StreamingMoments


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
    settings: dict[str, int | str]
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
        settings: dict[str, int | str] = {
            "components": components,
            "seed": seed,
            "cost": "Wasserstein-2 (Bures)",
        }
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

    def describe(self) -> dict[str, int | str]:
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
    a = torch.tensor(
        [float(w) if g is not None else 0.0 for w, g in zip(source_weight, source, strict=True)],
        dtype=torch.float64,
    )
    b = torch.tensor(
        [
            float(w) if g is not None else 0.0
            for w, g in zip(reference_weight, reference, strict=True)
        ],
        dtype=torch.float64,
    )
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
