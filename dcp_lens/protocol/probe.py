"""`ResidualOODProbe`: how far a stream is from the reference readout input (docs/design.md §5).

Two scores, both relative to held-out reference states:

- Mahalanobis distance under one Gaussian fitted to the reference (Ledoit-Wolf shrinkage,
  streaming float64 moments), divided by the held-out reference's mean distance (noise floor,
  so the held-out reference scores 1.0).
- A classifier two-sample test (C2ST): a small MLP learns to tell the states from reference
  states; its held-out AUROC is 0.5 when they are indistinguishable. It sees beyond the first
  two moments, which `calibrate` matches by construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from dcp_lens.protocol.calibration import StreamingMoments, ledoit_wolf_shrinkage, symmetric_power


def auroc(scores: Float[Tensor, " n"], labels: Bool[Tensor, " n"]) -> float:
    """Area under the ROC curve of ``scores`` for ``labels`` (True = positive).

    Mann-Whitney rank formula; tied scores get their average rank, so a tie counts 1/2.
    """
    positives = int(labels.sum())
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0:
        raise ValueError(
            f"AUROC needs both classes, got {positives} positives and {negatives} negatives."
        )
    sorted_scores, order = torch.sort(scores.to(torch.float64))
    _, group, group_sizes = torch.unique_consecutive(
        sorted_scores, return_inverse=True, return_counts=True
    )
    last_rank = group_sizes.cumsum(0).to(torch.float64)  # 1-based rank of each group's last
    average_rank = last_rank - (group_sizes.to(torch.float64) - 1) / 2
    ranks = torch.empty_like(sorted_scores)
    ranks[order] = average_rank[group]
    rank_sum = float(ranks[labels].sum())
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


# Permutations of the test labels for the C2ST's null, and the quantile that is its threshold.
N_PERMUTATIONS = 200
NULL_QUANTILE = 0.95
# States whitened at once by `ResidualOODProbe.mahalanobis` (float64 rows of the stream's width).
WHITENED_ROWS = 4096


def _permutation_null(
    scores: Float[Tensor, " n"],
    labels: Bool[Tensor, " n"],
    positive_groups: Tensor | None,
    negative_groups: Tensor | None,
    generator: torch.Generator,
) -> Float[Tensor, " n_permutations"]:
    """AUROCs of the trained classifier's held-out scores under label permutations.

    With the classifier fixed, permuting which test states are "positive" gives the AUROC's
    distribution if both samples came from one distribution. Where every group (example) sits on
    one side, whole groups are permuted, since the positions of one example are not independent;
    otherwise single states are."""
    scores, labels = scores.cpu(), labels.cpu()
    groups = torch.arange(len(scores))
    if positive_groups is not None and negative_groups is not None:
        positive_groups, negative_groups = positive_groups.cpu(), negative_groups.cpu()
        if not bool(torch.isin(positive_groups, negative_groups).any()):
            groups = torch.cat([positive_groups, negative_groups])
    unique, index = groups.unique(return_inverse=True)
    group_label = torch.zeros(len(unique), dtype=torch.bool)
    group_label[index[labels]] = True
    n_positive_groups = int(group_label.sum())
    null = torch.empty(N_PERMUTATIONS, dtype=torch.float64)
    for i in range(N_PERMUTATIONS):
        chosen = torch.zeros(len(unique), dtype=torch.bool)
        chosen[torch.randperm(len(unique), generator=generator)[:n_positive_groups]] = True
        permuted = chosen[index]
        if bool(permuted.all()) or not bool(permuted.any()):
            null[i] = 0.5
            continue
        null[i] = auroc(scores, permuted)
    return null


def _subsample(
    states: Tensor, max_points: int, generator: torch.Generator, groups: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """At most ``max_points`` rows of ``states`` (and their ``groups``), in a seeded random
    order."""
    order = torch.randperm(states.shape[0], generator=generator)[:max_points]
    kept_groups = None if groups is None else groups[order.to(groups.device)]
    return states[order.to(states.device)], kept_groups


def _train_mask(groups: Tensor | None, n: int, generator: torch.Generator) -> Tensor:
    """Which of ``n`` points train the C2ST classifier (the rest test it): the first half
    without ``groups``; with them, every point of a random half of the groups, so that no group
    (e.g. one sequence, whose positions share its content) is on both sides of the split. With
    fewer than two groups, the first half."""
    first_half = torch.arange(n) < n // 2
    if groups is None:
        return first_half
    unique = groups.unique()
    if len(unique) < 2:
        return first_half
    chosen = unique[torch.randperm(len(unique), generator=generator)[: len(unique) // 2]]
    return torch.isin(groups.cpu(), chosen.cpu())


def _features(whitened: Float[Tensor, "n d"]) -> Float[Tensor, "n d+1"]:
    """`ResidualOODProbe.classifier_features` of whitened states (float64 ``[n, d]``)."""
    width = whitened.shape[-1]
    # With a few thousand states an MLP in d >= 256 memorises before it learns a norm (a
    # scale mixture scored AUROC 0.53 without this feature, 0.99 with it), and the radius's
    # distribution, not its mean, is what moment matching leaves different.
    radius = (whitened.pow(2).sum(dim=-1, keepdim=True) - width) / (2 * width) ** 0.5
    return torch.cat([whitened, radius], dim=-1).to(torch.float32)


@dataclass(frozen=True)
class _Side:
    """One side of a two-sample test: its states ``[n, d]`` (``whitened`` by the probe's
    Gaussian already, or not) and each state's group (example), if known."""

    states: Tensor
    groups: Tensor | None = None
    whitened: bool = False

    def subsampled(self, size: int, generator: torch.Generator) -> _Side:
        """``size`` of the states (and their groups) in a seeded random order."""
        order = torch.randperm(self.states.shape[0], generator=generator)[:size]
        groups = None if self.groups is None else self.groups[order]
        return _Side(self.states[order.to(self.states.device)], groups, self.whitened)


class ResidualOODProbe:
    """Mahalanobis and classifier two-sample scores of states against reference states.

    ``max_points`` caps the states per side of the C2ST (half train, half test); the MLP has two
    hidden layers of ``hidden_width`` and trains for ``steps`` Adam steps on minibatches of
    ``batch_size``, all seeded, on the data's device.
    """

    def __init__(
        self,
        max_points: int = 4000,
        hidden_width: int = 128,
        steps: int = 400,
        batch_size: int = 256,
        learning_rate: float = 1e-3,
    ) -> None:
        for name, value, minimum in (
            ("max_points", max_points, 4),
            ("hidden_width", hidden_width, 1),
            ("steps", steps, 1),
            ("batch_size", batch_size, 1),
        ):
            if value < minimum:
                raise ValueError(f"{name}={value} must be >= {minimum}.")
        if not learning_rate > 0.0:
            raise ValueError(f"learning_rate={learning_rate} must be positive.")
        self.max_points = max_points
        self.hidden_width = hidden_width
        self.steps = steps
        self.batch_size = batch_size
        self.learning_rate = learning_rate
        self.mean: Tensor | None = None  # [d] float64
        self.covariance: Tensor | None = None  # [d, d] float64, shrunk
        self.shrinkage_intensity: float | None = None
        self.noise_floor: float | None = None
        self._whitening: Tensor | None = None  # [d, d] float64, covariance^{-1/2}
        self._held_out: Tensor | None = None  # held-out reference states, the C2ST's negatives
        self._held_out_whitened: Tensor | None = None  # the same, whitened once (`whiten`)
        self._held_out_groups: Tensor | None = None  # their group (example) ids, if given
        # The permutation null of the last two-sample test: the AUROC's NULL_QUANTILE and p-value.
        self.last_null: dict[str, float] = {}

    def fit(
        self,
        reference: Float[Tensor, "n d"],
        held_out: Float[Tensor, "m d"] | None = None,
        seed: int = 0,
        held_out_groups: Int[Tensor, " m"] | None = None,
    ) -> ResidualOODProbe:
        """Fit the Gaussian on ``reference`` and the noise floor on ``held_out``.

        Without ``held_out`` the reference is split in two halves by a permutation seeded with
        ``seed``: the first fits, the second is held out. ``held_out_groups`` gives each held-out
        state's group (the example it comes from): the C2ST then never trains and tests on states
        of one example, whose positions are not independent. Returns ``self``.
        """
        if held_out is None:
            if reference.shape[0] < 8:
                raise ValueError(
                    f"reference has {reference.shape[0]} states; splitting off a held-out half "
                    "needs at least 8 (or pass held_out)."
                )
            order = torch.randperm(
                reference.shape[0], generator=torch.Generator().manual_seed(seed)
            ).to(reference.device)
            half = reference.shape[0] // 2
            reference, held_out = reference[order[:half]], reference[order[half:]]
        if held_out.shape[-1] != reference.shape[-1]:
            raise ValueError(
                f"reference states have width {reference.shape[-1]} but held_out states have "
                f"width {held_out.shape[-1]}; both must come from the same stream."
            )
        if reference.shape[0] < 3 or held_out.shape[0] < 1:
            raise ValueError(
                f"the probe needs at least 3 reference states and 1 held-out state, got "
                f"{reference.shape[0]} and {held_out.shape[0]}."
            )
        moments = StreamingMoments.from_samples(reference)
        shrunk = ledoit_wolf_shrinkage(moments)
        self.mean = moments.mean
        self.covariance = shrunk.covariance
        self.shrinkage_intensity = shrunk.intensity
        self._whitening = symmetric_power(shrunk.covariance, -0.5, "reference covariance")
        self.noise_floor = float(self.mahalanobis(held_out).mean())
        # The C2ST's reference side must be held out too: states the Gaussian was fitted on are
        # whitened to a smaller radius than any fresh state, which the classifier would detect.
        generator = torch.Generator().manual_seed(seed)
        if held_out_groups is not None and held_out_groups.shape != (held_out.shape[0],):
            raise ValueError(
                f"held_out_groups has shape {tuple(held_out_groups.shape)}; expected "
                f"({held_out.shape[0]},), one group id per held-out state."
            )
        self._held_out, self._held_out_groups = _subsample(
            held_out, self.max_points, generator, held_out_groups
        )
        self._held_out_whitened = self.whiten(self._held_out)
        return self

    def _require_gaussian(self) -> tuple[Tensor, Tensor]:
        if self.mean is None or self._whitening is None:
            raise RuntimeError("the probe is not fitted: call fit(reference_states) first.")
        return self.mean, self._whitening

    def whiten(self, x: Float[Tensor, "n d"]) -> Float[Tensor, "n d"]:
        """``(x - mean) C^{-1/2}`` under the fitted Gaussian, float64 ``[n, d]``."""
        mean, whitening = self._require_gaussian()
        if x.shape[-1] != mean.shape[0]:
            raise ValueError(
                f"states have width {x.shape[-1]} but the probe was fitted on width "
                f"{mean.shape[0]}."
            )
        return (x.to(torch.float64) - mean.to(x.device)) @ whitening.to(x.device)

    def mahalanobis(self, x: Float[Tensor, "n d"]) -> Float[Tensor, " n"]:
        """Mahalanobis distance of each state to the reference Gaussian, float64 ``[n]``."""
        # In chunks, so many wide states never sit whitened in float64 all at once.
        return torch.cat([self.whiten(chunk).norm(dim=-1) for chunk in x.split(WHITENED_ROWS)])

    def relative_mahalanobis(self, x: Float[Tensor, "n d"]) -> float:
        """Mean Mahalanobis distance of ``x`` over the noise floor (held-out reference: ~1.0)."""
        distance = float(self.mahalanobis(x).mean())
        if self.noise_floor is None:
            raise RuntimeError("the probe has no noise floor: call fit(reference_states) first.")
        return distance / self.noise_floor

    def classifier_features(self, x: Float[Tensor, "n d"]) -> Float[Tensor, "n d+1"]:
        """What the C2ST classifier sees: the whitened state and its standardised squared radius.

        Returns float32 ``[n, d + 1]``: ``whiten(x)`` and ``(|z|^2 - d) / sqrt(2 d)`` (zero mean,
        unit variance for reference states that are Gaussian).
        """
        return _features(self.whiten(x))

    def c2st_auroc(
        self, x: Float[Tensor, "n d"], seed: int = 0, groups: Int[Tensor, " n"] | None = None
    ) -> float:
        """Held-out AUROC of an MLP telling ``x`` from held-out reference states (0.5: alike).

        Both sides are subsampled to the same size (at most ``max_points``) and split in halves,
        one to train the classifier on `classifier_features`, one to measure its AUROC. With
        ``groups`` (and ``held_out_groups`` given to `fit`), each side is split by group instead
        (see `_train_mask`).
        """
        held_out = self._require_held_out_whitened().to(x.device)
        sides = (_Side(x, groups), _Side(held_out, self._held_out_groups, whitened=True))
        return self._two_sample_auroc(*sides, seed)

    def _require_held_out(self) -> Tensor:
        if self._held_out is None:
            raise RuntimeError(
                "the classifier two-sample test needs held-out reference states, which a probe "
                "restored by from_dict() does not keep: call fit(reference_states) first."
            )
        return self._held_out

    def _require_held_out_whitened(self) -> Tensor:
        self._require_held_out()
        assert self._held_out_whitened is not None
        return self._held_out_whitened

    def _two_sample_auroc(self, positive: _Side, negative: _Side, seed: int) -> float:
        per_side = min(positive.states.shape[0], negative.states.shape[0], self.max_points)
        if per_side < 4:
            raise ValueError(
                f"the two-sample test needs at least 4 states per side, got "
                f"{positive.states.shape[0]} states and {negative.states.shape[0]} reference "
                "states."
            )
        generator = torch.Generator().manual_seed(seed)
        sides = [side.subsampled(per_side, generator) for side in (positive, negative)]
        train_masks = [_train_mask(side.groups, per_side, generator) for side in sides]
        positives, negatives = (self._side_features(side) for side in sides)

        def labelled(first: Tensor, second: Tensor) -> tuple[Tensor, Tensor]:
            labels = torch.cat([torch.ones(len(first)), torch.zeros(len(second))])
            return torch.cat([first, second]), labels.to(first.device)

        (pos_train, neg_train) = (mask.to(positives.device) for mask in train_masks)
        train_x, train_y = labelled(positives[pos_train], negatives[neg_train])
        test_x, test_y = labelled(positives[~pos_train], negatives[~neg_train])
        classifier = self._train_classifier(train_x, train_y, seed)
        with torch.no_grad():
            test_scores = classifier(test_x).squeeze(-1)
        observed = auroc(test_scores, test_y.bool())
        positive_groups, negative_groups = (side.groups for side in sides)
        null = _permutation_null(
            test_scores,
            test_y.bool(),
            None if positive_groups is None else positive_groups[~train_masks[0].cpu()],
            None if negative_groups is None else negative_groups[~train_masks[1].cpu()],
            generator,
        )
        self.last_null = {
            "auroc_threshold": float(torch.quantile(null, NULL_QUANTILE)),
            "auroc_p_value": float((1 + (null >= observed).sum()) / (1 + len(null))),
        }
        return observed

    def _side_features(self, side: _Side) -> Tensor:
        return _features(side.states) if side.whitened else self.classifier_features(side.states)

    def _train_classifier(self, inputs: Tensor, labels: Tensor, seed: int) -> nn.Module:
        # Built under a forked CPU RNG so the seed fixes the initial weights without touching
        # the caller's global random state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            classifier = nn.Sequential(
                nn.Linear(inputs.shape[1], self.hidden_width),
                nn.GELU(),
                nn.Linear(self.hidden_width, self.hidden_width),
                nn.GELU(),
                nn.Linear(self.hidden_width, 1),
            )
        classifier.to(inputs.device)
        optimizer = torch.optim.Adam(classifier.parameters(), lr=self.learning_rate)
        loss_fn = nn.BCEWithLogitsLoss()
        generator = torch.Generator().manual_seed(seed)
        batch_size = min(self.batch_size, inputs.shape[0])
        epochs = -(-self.steps * batch_size // inputs.shape[0])
        order = torch.cat(
            [torch.randperm(inputs.shape[0], generator=generator) for _ in range(epochs)]
        )
        order = order.to(inputs.device)
        threads = torch.get_num_threads()
        if inputs.device.type == "cpu":
            # These matmuls are too small to gain from threads, and on a busy machine OpenMP's
            # spin-waiting makes them many times slower; restored below.
            torch.set_num_threads(1)
        try:
            with torch.enable_grad():
                for step in range(self.steps):
                    batch = order[step * batch_size : (step + 1) * batch_size]
                    optimizer.zero_grad(set_to_none=True)
                    loss = loss_fn(classifier(inputs[batch]).squeeze(-1), labels[batch])
                    loss.backward()
                    optimizer.step()
        finally:
            torch.set_num_threads(threads)
        return classifier.eval()

    def reference_score(self, seed: int = 0) -> dict[str, float]:
        """The noise floor's own `score`: the held-out reference states kept by `fit`, their C2ST
        run between two halves of them (at most ``max_points // 2`` per side; ~0.5)."""
        held_out = self._require_held_out_whitened()
        half = held_out.shape[0] // 2
        groups = self._held_out_groups
        halves = (None, None) if groups is None else (groups[:half], groups[half:])
        sides = (
            _Side(held_out[:half], halves[0], whitened=True),
            _Side(held_out[half:], halves[1], whitened=True),
        )
        return {
            "mahalanobis": self.relative_mahalanobis(self._require_held_out()),
            "auroc": self._two_sample_auroc(*sides, seed),
        }

    def score(
        self, x: Float[Tensor, "n d"], seed: int = 0, groups: Int[Tensor, " n"] | None = None
    ) -> dict[str, float]:
        """``{"mahalanobis": relative Mahalanobis, "auroc": C2ST AUROC}`` of the states ``x``
        (``groups``: each state's example, as in `c2st_auroc`). Where ``x`` is whitened in one
        piece for its Mahalanobis distances (at most `WHITENED_ROWS` states), the C2ST takes
        its states from that piece rather than whitening them again."""
        if x.shape[0] > WHITENED_ROWS:
            return {
                "mahalanobis": self.relative_mahalanobis(x),
                "auroc": self.c2st_auroc(x, seed, groups),
                **self.last_null,
            }
        held_out = self._require_held_out_whitened().to(x.device)
        whitened = self.whiten(x)
        distance = float(whitened.norm(dim=-1).mean())
        if self.noise_floor is None:
            raise RuntimeError("the probe has no noise floor: call fit(reference_states) first.")
        sides = (
            _Side(whitened, groups, whitened=True),
            _Side(held_out, self._held_out_groups, whitened=True),
        )
        return {
            "mahalanobis": distance / self.noise_floor,
            "auroc": self._two_sample_auroc(*sides, seed),
            **self.last_null,
        }

    def to_dict(self) -> dict[str, Any]:
        """The fitted Gaussian, noise floor and classifier settings as plain lists and numbers.

        Reference states are not included, so a restored probe scores Mahalanobis only.
        """
        if self.mean is None or self.covariance is None or self.noise_floor is None:
            raise RuntimeError("the probe is not fitted: call fit(reference_states) first.")
        return {
            "mean": self.mean.tolist(),
            "covariance": self.covariance.tolist(),
            "shrinkage_intensity": self.shrinkage_intensity,
            "noise_floor": self.noise_floor,
            "max_points": self.max_points,
            "hidden_width": self.hidden_width,
            "steps": self.steps,
            "batch_size": self.batch_size,
            "learning_rate": self.learning_rate,
        }

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], device: str | torch.device | None = None
    ) -> ResidualOODProbe:
        """Inverse of `to_dict`; tensors are placed on ``device`` (CPU by default)."""
        missing = {"mean", "covariance", "noise_floor"} - set(data)
        if missing:
            raise ValueError(
                f"probe dict lacks keys {sorted(missing)}; it must come from to_dict()."
            )
        settings = ("max_points", "hidden_width", "steps", "batch_size", "learning_rate")
        probe = cls(**{key: data[key] for key in settings if key in data})
        probe.mean = torch.tensor(data["mean"], dtype=torch.float64, device=device)
        probe.covariance = torch.tensor(data["covariance"], dtype=torch.float64, device=device)
        probe.shrinkage_intensity = data.get("shrinkage_intensity")
        probe.noise_floor = float(data["noise_floor"])
        probe._whitening = symmetric_power(probe.covariance, -0.5, "reference covariance")
        return probe


# ----------------------------------------------------------------- the probe stage of a run


@dataclass
class ProbeSamples:
    """The states the probe stage scores, each row with its example key (``groups``).

    Attributes:
        held_out: full depth's states of even examples ``[n, d]``, the held-out reference.
        trajectory: per t in 0..r, s_t of odd examples with their keys.
        calibrate_truncate: per k, calibrate(truncate(k)) of odd examples with their keys.
    """

    held_out: Tensor | None = None
    held_out_groups: Tensor | None = None
    trajectory: list[tuple[Tensor | None, Tensor | None]] = field(default_factory=list)
    calibrate_truncate: dict[int, tuple[Tensor | None, Tensor | None]] = field(default_factory=dict)

    def to(self, device: torch.device) -> ProbeSamples:
        """These samples with every tensor on ``device`` (``self`` where they are there)."""

        def moved(value: Tensor | None) -> Tensor | None:
            return None if value is None else value.to(device)

        if all(t is None or t.device == device for t in self._tensors()):
            return self
        return ProbeSamples(
            moved(self.held_out),
            moved(self.held_out_groups),
            [(moved(rows), moved(groups)) for rows, groups in self.trajectory],
            {k: (moved(rows), moved(g)) for k, (rows, g) in self.calibrate_truncate.items()},
        )

    def _tensors(self) -> list[Tensor | None]:
        pairs = [*self.trajectory, *self.calibrate_truncate.values()]
        return [self.held_out, self.held_out_groups, *(t for pair in pairs for t in pair)]


def probe_run(
    reference: Tensor | None,
    samples: ProbeSamples,
    *,
    n_iterations: int,
    points: int,
    seed: int,
    progress: Any = lambda items, description: items,
) -> tuple[dict[str, Any], ResidualOODProbe | None]:
    """The probe stage of a run: fit `ResidualOODProbe` on the fit stage's ``reference`` states
    against the sweep's held-out full-depth states, then score s_t for every t and
    calibrate(truncate(k)) for every k. ``progress(items, description)`` wraps the iterations.

    Returns:
        The probe's summary as results record it (``reference_auroc``, ``trajectory``, ...; NaN
        and empty without usable states) and the fitted probe (None without one).
    """
    usable = [reference, samples.held_out]
    if any(x is None or not x.isfinite().all() for x in usable):
        return {"reference_auroc": math.nan, "trajectory": []}, None
    assert reference is not None and samples.held_out is not None
    probe = ResidualOODProbe(max_points=points).fit(
        reference.double(),
        samples.held_out.double(),
        seed=seed,
        held_out_groups=samples.held_out_groups,
    )

    def score(sample: tuple[Tensor | None, Tensor | None]) -> dict[str, float]:
        rows, groups = sample
        if rows is None or not bool(rows.isfinite().all()):
            return {"mahalanobis": math.nan, "auroc": math.nan}
        return probe.score(rows.double(), seed=seed, groups=groups)

    trajectory = [
        {"iteration": t, **score(sample)}
        for t, sample in enumerate(progress(samples.trajectory, "probe"))
    ]
    calibrated = [{"k": k, **score(sample)} for k, sample in samples.calibrate_truncate.items()]
    # s_r of the probed examples against the held-out reference: full depth against itself.
    at_full_depth = trajectory[n_iterations]
    summary = {
        "reference_auroc": at_full_depth["auroc"],
        "reference_mahalanobis": at_full_depth["mahalanobis"],
        "noise_floor": probe.noise_floor,
        "trajectory": trajectory,
        "calibrate_truncate": calibrated,
    }
    return summary, probe


def s_rank_correlation(probe: dict[str, Any], k_grid: Any, s_cells: Any) -> float:
    """Spearman correlation over k of the probe's Mahalanobis score of s_k with S(k)
    (docs/design.md §5): does the directly measured readout shift order the k's as S does?"""
    by_iteration = {row["iteration"]: row["mahalanobis"] for row in probe.get("trajectory", [])}
    pairs = [
        (by_iteration.get(k, math.nan), float(s)) for k, s in zip(k_grid, s_cells, strict=True)
    ]
    pairs = [(m, s) for m, s in pairs if math.isfinite(m) and math.isfinite(s)]
    if len(pairs) < 3:
        return math.nan
    ranks = torch.tensor(pairs, dtype=torch.float64).argsort(0).argsort(0).double()
    ranks = ranks - ranks.mean(0)
    denominator = float(ranks.norm(dim=0).prod())
    return float((ranks[:, 0] * ranks[:, 1]).sum()) / denominator if denominator else math.nan
