"""The sweep stage: every sweep condition at every k of the grid on the evaluation set, from one
full-depth pass per batch (`readouts`), scored per example, with the null control and the
probe's subsamples. Snapshots for ``--resume`` and the merge over processes live here too.
Hands a `SweepOutput` to the probe and decomposition stages."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from dcp_lens.protocol.budget import (
    OutOfMemoryStop,
    ReadoutPlan,
    out_of_memory_message,
    release_device_memory,
)
from dcp_lens.protocol.conditions import SWEEP, Condition, Full, Truncate
from dcp_lens.protocol.confidence import Temperatures
from dcp_lens.protocol.context import RunContext
from dcp_lens.protocol.evaluation_set import EvaluationSet
from dcp_lens.protocol.fit import FittedMaps, apply_map
from dcp_lens.protocol.metrics import IGNORE_INDEX, per_example_metrics, reference_log_probs
from dcp_lens.protocol.probe import ProbeSamples
from dcp_lens.protocol.readout import readouts
from dcp_lens.protocol.states import capture_states
from dcp_lens.protocol.subsample import Subsample, row_ids
from dcp_lens.utils import distributed

# Per metric: ``"full"`` -> [n] and per sweep condition {k: [n]} (float64, per example).
Values = dict[str, dict[str, Any]]


# The jackknife reads the mapped conditions on the evaluation examples whose key is 0 mod this.
JACKKNIFE_EVALUATION_STRIDE = 10
# Per-example records that are not a metric's cells: keys of `Sweep.evaluate`'s accumulators.
_WALK, _JACKKNIFE_ROWS = "_walk", "_jackknife_rows"


@dataclass
class SweepOutput:
    """The sweep stage's hand-off: per-example `Values`, the null control's record and the
    probe's samples (empty on a process other than rank 0).

    Attributes:
        walked: `walk_fractions`' records, ``[n]`` per kind and k: where replay *walks* (its
            top-1 moves to one a later truncation of the grid reads; docs/bracket.md).
        jackknife: per left-out calibration group, ``{metric: {condition: {k: [m]}}}`` for the
            conditions whose maps the jackknife refits, on the ``m`` evaluation examples of
            ``jackknife_rows`` (indices into ``values``' example order).
    """

    values: Values
    null_control: dict[str, Any]
    probe_samples: ProbeSamples
    walked: dict[str, dict[int, Tensor]] = field(default_factory=dict)
    jackknife: list[Values] = field(default_factory=list)
    jackknife_rows: Tensor | None = None


@dataclass(frozen=True)
class _Reference:
    """Full depth's side of every metric of one evaluation batch, computed once for the
    batch's conditions: log-probabilities, probabilities, top-1 and the targets."""

    log_probs: Float[Tensor, "batch pos d_vocab"]
    probs: Float[Tensor, "batch pos d_vocab"]
    top1: Int[Tensor, "batch pos"]
    targets: Int[Tensor, "batch pos"]

    @classmethod
    def of(cls, full_logits: Tensor, targets: Tensor) -> _Reference:
        log_probs = reference_log_probs(full_logits)
        return cls(log_probs, log_probs.exp(), log_probs.argmax(-1), targets)

    def repeated(self, times: int) -> _Reference:
        """This reference for ``times`` stacked copies of the batch (one per condition)."""
        return _Reference(*(t.repeat(times, *[1] * (t.ndim - 1)) for t in (
            self.log_probs, self.probs, self.top1, self.targets
        )))  # fmt: skip

    def score(self, logits: Tensor, metrics: Sequence[str]) -> dict[str, Tensor]:
        """`per_example_metrics` of ``logits`` against this reference: [batch] per metric."""
        return per_example_metrics(
            logits, self.log_probs, self.targets, metrics, self.top1, self.probs
        )


@dataclass
class _BatchScores:
    """What one evaluation batch adds to the sweep's records: per-example cells by key (chunks of
    examples while the batch is read, joined into one tensor per key at its end), and the null
    control's and replay's maxima and sums over the batch."""

    cells: dict[tuple[str, str, int], Any] = field(default_factory=dict)
    replay_difference: dict[int, float] = field(default_factory=dict)
    null: dict[str, float] = field(default_factory=dict)
    halves_diff: float = 0.0
    halves_change: dict[str, float] = field(default_factory=dict)

    def add(self, key: tuple[Any, ...], values: Any) -> Any:
        """Append a chunk's values: a tensor under ``key``, or a metric's under ``(metric,
        *key)``; returns ``values``."""
        if isinstance(values, Tensor):
            self.cells.setdefault(key, []).append(values)
        else:
            for metric, value in values.items():
                self.cells.setdefault((metric, *key), []).append(value)
        return values

    def joined(self) -> _BatchScores:
        self.cells = {
            key: torch.cat(parts) if isinstance(parts, list) else parts
            for key, parts in self.cells.items()
        }
        return self


class Sweep:
    """The sweep of one run over fitted maps and temperatures.

    ``replay_difference`` holds, per k, max |readout(replay(k)) - readout(truncate(k))| over
    every evaluation so far (all noise draws): whether B is identified."""

    def __init__(self, context: RunContext, maps: FittedMaps, temperatures: Temperatures) -> None:
        self.context = context
        self.maps = maps
        self.temperatures = temperatures
        self.replay_difference: dict[int, float] = {}

    def conditions_at(self, k: int) -> dict[str, Condition | None]:
        """Every sweep condition at k (None where a map it needs could not be fitted)."""
        return {name: entry.build(k, self.maps) for name, entry in SWEEP.items()}

    @torch.no_grad()
    def evaluate(self, evaluation: EvaluationSet, stage: str = "evaluation.0") -> SweepOutput:
        """Every condition at every k on ``evaluation`` (snapshot under ``stage``)."""
        context, config, r = self.context, self.context.config, self.context.r
        k_grid, metrics = context.k_grid, context.metrics
        per_example: dict[tuple[str, str, int], list[Tensor]] = {}
        # The null control: every condition that must reproduce full depth at k = r.
        null: dict[str, float] = {
            name: 0.0
            for name, condition in self.conditions_at(r).items()
            if condition is None or condition.reproduces_full_at_r
        }
        n, points = len(evaluation), config.probe_points
        sample = Subsample(points, config.seed + 1)
        trajectory = [Subsample(points, config.seed + 2 + t) for t in range(r + 1)]
        calibrated = {k: Subsample(points, config.seed + 1000 + k) for k in k_grid}
        evaluation_keys = evaluation.example_keys()
        built = {k: self.conditions_at(k) for k in {*k_grid, r}}
        # Under each left-out group's maps, only the conditions those maps change.
        left_out = [_changed(built, maps, k_grid) for maps in self.maps.jackknife]
        halves_diff, halves_change = 0.0, dict[str, float]()
        null_map = self.maps.null
        batches = distributed.assigned(evaluation.batches(config.batch_size))
        done, saved = context.restore(stage)
        if saved is not None:
            per_example = {(m, c, int(k)): list(chunks) for m, c, k, chunks in saved["per_example"]}
            null, halves_diff = dict(saved["null"]), float(saved["halves_diff"])
            halves_change = dict(saved["halves_change"])
            self.replay_difference = {int(k): v for k, v in saved["replay_difference"].items()}
            sample.restore(saved["sample"])
            for t, state in enumerate(saved["trajectory"]):
                trajectory[t].restore(state)
            for k, state in saved["calibrated"].items():
                calibrated[int(k)].restore(state)

        def snapshot() -> dict[str, Any]:
            return {
                "per_example": [[*key, chunks] for key, chunks in per_example.items()],
                "null": null, "halves_diff": halves_diff, "halves_change": halves_change,
                "replay_difference": dict(self.replay_difference),
                "sample": sample.state(), "trajectory": [s.state() for s in trajectory],
                "calibrated": {k: s.state() for k, s in calibrated.items()},
            }  # fmt: skip

        plan = context.readout_plan(evaluation)
        for batch_number, (_, rows) in enumerate(
            context.each(batches[done:], "evaluation"), start=done
        ):
            try:
                states, scored, plan = self._scored_batch(
                    evaluation, rows, plan, built, left_out, evaluation_keys
                )
            except OutOfMemoryStop:  # keep every finished batch for --resume
                context.snapshot(stage, batch_number, batch_number, snapshot)
                raise
            for key, value in scored.cells.items():
                per_example.setdefault(key, []).append(value)
            for k, difference in scored.replay_difference.items():
                self.replay_difference[k] = nan_max(self.replay_difference.get(k, 0.0), difference)
            for name, difference in scored.null.items():
                null[name] = nan_max(null[name], difference)
            halves_diff = nan_max(halves_diff, scored.halves_diff)
            for metric, change in scored.halves_change.items():
                halves_change[metric] = halves_change.get(metric, 0.0) + change
            if config.probe != "none":
                # Held-out reference from even examples, probed states from odd ones: a two-sample
                # test needs independent samples, not two views of the same sequences.
                # The example of each state goes along: the C2ST splits by example, since the
                # positions of one sequence share its content and are not independent draws.
                keep = context.pooled_positions(evaluation, rows)
                example, position = row_ids(evaluation_keys[rows], keep)
                even = example % 2 == 0
                held_out = states[r][keep][even.to(keep.device)]
                sample.add(held_out, example[even], position[even])
                probed = states[:, keep][:, (~even).to(keep.device)]
                probed_examples, probed_positions = example[~even], position[~even]
                for t in range(r + 1):
                    trajectory[t].add(probed[t], probed_examples, probed_positions)
                for k in k_grid:
                    mapping = self.maps.fitted(Truncate(k))
                    calibrated[k].add(
                        apply_map(mapping, probed[k]), probed_examples, probed_positions
                    )
            context.snapshot(stage, batch_number + 1, len(batches), snapshot)
        if distributed.rank_and_world()[1] > 1:
            gathered = distributed.gather_to_main(
                ([i for i, _ in batches], per_example, null, halves_diff, halves_change,
                 self.replay_difference, sample, trajectory, calibrated)
            )  # fmt: skip
            if gathered is None:  # not rank 0: rank 0 decomposes
                return SweepOutput({}, {}, ProbeSamples())
            per_example, null, halves_diff, halves_change, sample, trajectory, calibrated = (
                self._merged(gathered)
            )
        values: Values = {}
        walked: dict[str, dict[int, Tensor]] = {}
        jackknife: list[Values] = [{} for _ in left_out]
        jackknife_rows: Tensor | None = None
        for (metric, condition, k), chunks in per_example.items():
            vector = torch.cat(chunks).double().cpu()
            if metric == _WALK:
                walked.setdefault(condition, {})[k] = vector
            elif metric == _JACKKNIFE_ROWS:
                jackknife_rows = vector.long()
            elif "@" in condition:
                name, group = condition.rsplit("@", 1)
                cells = jackknife[int(group)].setdefault(metric, {})
                cells.setdefault(name, {})[k] = vector
            elif condition == "full":
                values.setdefault(metric, {})["full"] = vector
            else:
                values.setdefault(metric, {}).setdefault(condition, {})[k] = vector
        full_map = self.maps.fitted(Full())
        null_control: dict[str, Any] = {
            "max_abs_logit_diff": nan_max(null.pop("truncate"), null.pop("replay")),
            "calibrate_full_max_abs_logit_diff": nan_max(
                null.pop("calibrate_truncate"), null.pop("calibrate_replay")
            ),
            "shift_at_r_max_abs_logit_diff": null.pop("shift"),
            "calibrate_full_identity_deviation": (
                full_map.identity_deviation() if full_map is not None else math.nan
            ),
            **{f"{name}_at_r_max_abs_logit_diff": value for name, value in null.items()},
            "calibrate_full_halves_max_abs_logit_diff": (
                halves_diff if null_map is not None else math.nan
            ),
            "calibrate_full_halves_metric_change": {
                metric: halves_change.get(metric, math.nan) / n for metric in metrics
            },
        }
        probe_samples = ProbeSamples(
            held_out=sample.tensor(),
            held_out_groups=sample.groups(),
            trajectory=[(s.tensor(), s.groups()) for s in trajectory],
            calibrate_truncate={
                k: (calibrated[k].tensor(), calibrated[k].groups()) for k in k_grid
            },
        )
        return SweepOutput(
            values, null_control, probe_samples, walked,
            jackknife if jackknife_rows is not None else [], jackknife_rows,
        )  # fmt: skip

    def _scored_batch(
        self,
        evaluation: EvaluationSet,
        rows: slice,
        plan: ReadoutPlan,
        built: dict[int, dict[str, Condition | None]],
        left_out: list[dict[int, dict[str, Condition | None]]],
        keys: Tensor,
    ) -> tuple[Tensor, _BatchScores, ReadoutPlan]:
        """`_score_batch`, redone with readout calls of half the rows after the device runs out
        of memory; the plan that fitted comes back for the next batch. Where one example's
        readouts do not fit either, stops with what to change (nothing is recorded of a batch
        that did not finish: ``--resume`` continues from the last finished one)."""
        batch, positions = rows.stop - rows.start, int(evaluation.tokens.shape[1])
        while True:
            try:
                states, scores = self._score_batch(evaluation, rows, plan, built, left_out, keys)
                return states, scores, plan
            except torch.OutOfMemoryError as error:
                release_device_memory(self.context.device())
                smaller = plan.halved(batch, positions)
                if smaller is None:
                    context = self.context
                    raise OutOfMemoryStop(out_of_memory_message(
                        "evaluation", rows, context.config.batch_size, positions,
                        context.budget(), str(context.device()),
                    )) from error  # fmt: skip
                plan = smaller

    def _score_batch(
        self,
        evaluation: EvaluationSet,
        rows: slice,
        plan: ReadoutPlan,
        built: dict[int, dict[str, Condition | None]],
        left_out: list[dict[int, dict[str, Condition | None]]],
        keys: Tensor,
    ) -> tuple[Tensor, _BatchScores]:
        """Every cell of one evaluation batch: its states and the batch's scores, the readouts
        read and scored in chunks of whole examples (``plan``), so that what a batch holds is
        its states, full depth's logits and one chunk's readouts."""
        context, r, k_grid = self.context, self.context.r, self.context.k_grid
        metrics, device, model = context.metrics, context.device(), context.model
        targets = evaluation.targets[rows].to(device)
        states, full_logits = capture_all(context, evaluation.tokens[rows])
        scores = _BatchScores()
        top1: dict[str, dict[int, list[Tensor]]] = {"truncate": {}, "replay": {}}
        chosen = keys[rows] % JACKKNIFE_EVALUATION_STRIDE == 0
        null_map = self.maps.null
        for examples in plan.example_chunks(rows.stop - rows.start):
            chunk_states, chunk_logits = states[:, examples], full_logits[examples]
            scoring = _Reference.of(chunk_logits, targets[examples])
            reference = scores.add(("full", 0), scoring.score(chunk_logits, metrics))
            at_r: dict[str, Tensor] | None = None
            for k in k_grid:
                read = readouts(model, r, chunk_states, built[k], chunk_logits, plan)
                for name in read:
                    tempered = self._tempered(read[name], name, k)
                    scores.add((name, k), scoring.score(tempered, metrics))
                    del tempered
                difference = _max_diff(read["replay"], read["truncate"])
                scores.replay_difference[k] = nan_max(
                    scores.replay_difference.get(k, 0.0), difference
                )
                for name in top1:
                    top1[name].setdefault(k, []).append(read[name].argmax(-1))
                at_r = read if k == r else None
                del read
            # The null control: at k = r every condition must reproduce full depth.
            if at_r is None:
                at_r = readouts(model, r, chunk_states, built[r], chunk_logits, plan)
            for name in at_r:
                at_full = built[r][name]
                if at_full is None or at_full.reproduces_full_at_r:
                    difference = _max_diff(at_r[name], chunk_logits)
                    scores.null[name] = nan_max(scores.null.get(name, 0.0), difference)
            del at_r
            if null_map is not None:
                halves = model.readout(null_map(chunk_states[r]))
                scores.halves_diff = nan_max(scores.halves_diff, _max_diff(halves, chunk_logits))
                moved = scoring.score(halves, metrics)
                for metric in metrics:
                    change = float((moved[metric] - reference[metric]).double().sum())
                    scores.halves_change[metric] = scores.halves_change.get(metric, 0.0) + change
                del halves
            if left_out:
                self._score_jackknife(
                    scores, chunk_states[:, chosen[examples].to(device)],
                    chunk_logits[chosen[examples].to(device)],
                    targets[examples][chosen[examples].to(device)], left_out, plan,
                )  # fmt: skip
        for kind, per_k in walk_fractions(
            {name: {k: torch.cat(parts) for k, parts in per.items()} for name, per in top1.items()},
            full_logits.argmax(-1), targets, r,
        ).items():  # fmt: skip
            for k, value in per_k.items():
                scores.add((_WALK, kind, k), value)
        if left_out:
            index = torch.arange(rows.start, rows.stop)[chosen].double()
            scores.cells[(_JACKKNIFE_ROWS, "rows", 0)] = index
            empty = torch.zeros(0, dtype=torch.float64, device=device)
            for k in k_grid:  # a chunk for every key in every batch, empty where none is read
                for g, conditions in enumerate(left_out):
                    for name in conditions[k]:
                        for metric in metrics:
                            scores.cells.setdefault((metric, f"{name}@{g}", k), empty)
        return states, scores.joined()

    def _score_jackknife(
        self,
        scores: _BatchScores,
        states: Tensor,
        full_logits: Tensor,
        targets: Tensor,
        left_out: list[dict[int, dict[str, Condition | None]]],
        plan: ReadoutPlan,
    ) -> None:
        """The jackknife's cells of one chunk's chosen examples: the mapped conditions under each
        left-out group's maps, read in calls of at most ``plan.rows`` positions and scored one
        condition at a time against full depth's side of the same examples."""
        if states.shape[1] == 0:
            return
        context, r = self.context, self.context.r
        scoring = _Reference.of(full_logits, targets)
        for k in context.k_grid:
            each = {
                f"{name}@{g}": condition
                for g, conditions in enumerate(left_out)
                for name, condition in conditions[k].items()
            }
            labels = list(each)
            # No call holds more rows than the main readouts of a chunk do (all of a k's).
            held = len(SWEEP) * plan.examples * states.shape[2]
            for group in plan.condition_groups(len(labels), states.shape[1], states.shape[2], held):
                names = labels[group]
                read = readouts(
                    context.model, r, states, {n: each[n] for n in names}, full_logits, plan
                )
                for label in names:
                    tempered = self._tempered(read[label], label.rsplit("@", 1)[0], k)
                    scores.add((label, k), scoring.score(tempered, context.metrics))
                    del tempered  # a view keeps the whole call's logits alive
                del read

    def _tempered(self, logits: Tensor, name: str, k: int) -> Tensor:
        """``logits`` at the temperature confidence matching fitted for ``(name, k)``."""
        temperature = self.temperatures.get((name, k), 1.0)
        return logits if temperature == 1.0 else logits / temperature

    def _merged(self, gathered: list[Any]) -> tuple[Any, ...]:
        """Every rank's `evaluate` accumulators combined on rank 0, as one process would have
        them: per-example chunks in batch order, maxima and sums over ranks, subsamples merged."""
        context = self.context
        per_example: dict[tuple[str, str, int], list[Tensor]] = {}
        ordered = sorted(
            (index, key, chunks[position])
            for part in gathered
            for position, index in enumerate(part[0])
            for key, chunks in part[1].items()
        )
        for _, key, chunk in ordered:
            per_example.setdefault(key, []).append(chunk.to(context.device()))
        null = {name: nan_max_all(part[2][name] for part in gathered) for name in gathered[0][2]}
        halves_diff = nan_max_all(part[3] for part in gathered)
        halves_change: dict[str, float] = {}
        for part in gathered:
            for metric, change in part[4].items():
                halves_change[metric] = halves_change.get(metric, 0.0) + change
        for k in context.k_grid:
            differences = [part[5][k] for part in gathered if k in part[5]]
            if differences:
                self.replay_difference[k] = nan_max_all(differences)
        sample = Subsample.merged([part[6] for part in gathered])
        trajectory = [
            Subsample.merged([part[7][t] for part in gathered]) for t in range(context.r + 1)
        ]
        calibrated = {
            k: Subsample.merged([part[8][k] for part in gathered]) for k in context.k_grid
        }
        return per_example, null, halves_diff, halves_change, sample, trajectory, calibrated


def capture_all(
    context: RunContext, tokens: Int[Tensor, "batch pos"]
) -> tuple[Float[Tensor, "r_plus_1 batch pos d_model"], Float[Tensor, "batch pos d_vocab"]]:
    """One full-depth forward: every state s_0..s_r and the full logits."""
    return capture_states(context.model, tokens.to(context.device()))


def evaluate_with_noise(sweep: Sweep, evaluation: EvaluationSet) -> SweepOutput:
    """`Sweep.evaluate`, averaged per example over the context's noise draws, its values in the
    order of the examples' own keys (the order the bootstrap resamples in)."""
    draws = sweep.context.noise_draws()
    output = sweep.evaluate(evaluation)
    values = output.values
    for draw in range(1, draws):
        with _noise_seed(sweep.context.model, draw):
            more = sweep.evaluate(evaluation, f"evaluation.{draw}").values
        values = _accumulate(values, more)
    if draws > 1:
        values = _scale(values, 1.0 / draws)
    # The bootstrap resamples positions in this order: make it the examples' own.
    order = torch.argsort(evaluation.example_keys(), stable=True)
    output.values = _reorder(values, order)
    output.walked = _reorder(output.walked, order)
    if output.jackknife_rows is not None:
        position = torch.empty_like(order)
        position[order] = torch.arange(len(order))
        output.jackknife_rows = position[output.jackknife_rows]
    return output


def _changed(
    built: dict[int, dict[str, Condition | None]], maps: FittedMaps, k_grid: Sequence[int]
) -> dict[int, dict[str, Condition | None]]:
    """Per k, the sweep conditions built from ``maps`` that differ from ``built``'s."""
    changed: dict[int, dict[str, Condition | None]] = {}
    for k in k_grid:
        conditions = {name: entry.build(k, maps) for name, entry in SWEEP.items()}
        changed[k] = {n: c for n, c in conditions.items() if c != built[k][n]}
    return changed


def walk_fractions(
    top1: dict[str, dict[int, Int[Tensor, "batch pos"]]],
    full_top1: Int[Tensor, "batch pos"],
    targets: Int[Tensor, "batch pos"],
    n_iterations: int,
) -> dict[str, dict[int, Tensor]]:
    """Where replay *walks*, per example: a position walks when at some k of the grid replay(k)'s
    top-1 is neither truncate(k)'s nor full depth's, but one that truncate(k') reads for some k'
    of the grid with k < k' < r (the repeated update did later iterations' work). Such a position
    extrapolates along its own trajectory, so replay's gain there at every k (reaching full
    depth's answer early included) may be computation.

    Returns:
        ``{"fraction": {k: [batch]}}``, each example's fraction of scored positions that walk
        (the same at every k), and, for the top-1 metrics, ``{metric: {k: [batch]}}``: replay's
        gain over truncate(k) on the walking positions, summed and divided by the scored
        positions (``accuracy`` against the targets, ``top1_agreement`` against full depth).
    """
    scored = targets != IGNORE_INDEX
    count = scored.sum(-1).clamp(min=1).double()
    grid = sorted(top1["truncate"])
    walks = torch.zeros_like(scored)
    for k in sorted(top1["replay"]):
        replayed = top1["replay"][k]
        later = [top1["truncate"][j] for j in grid if k < j < n_iterations]
        if later:
            read_later = torch.stack([replayed == t for t in later]).any(0)
            walks |= (replayed != top1["truncate"][k]) & (replayed != full_top1) & read_later
    walking = walks & scored

    def per_example(values: Tensor) -> Tensor:
        return ((values * walking).sum(-1).double() / count).cpu()

    out: dict[str, dict[int, Tensor]] = {"fraction": {}, "accuracy": {}, "top1_agreement": {}}
    for k in sorted(top1["replay"]):
        replayed, truncated = top1["replay"][k], top1["truncate"][k]
        out["fraction"][k] = per_example(torch.ones_like(walking))
        for metric, reference in (("accuracy", targets), ("top1_agreement", full_top1)):
            gain = (replayed == reference).double() - (truncated == reference).double()
            out[metric][k] = per_example(gain)
    return out


def nan_max(a: float, b: float) -> float:
    """max(a, b), NaN if either is NaN: a non-finite null control never reads as passing."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def nan_max_all(values: Any) -> float:
    """The maximum of ``values``, NaN if any is NaN (see `nan_max`)."""
    result = -math.inf
    for value in values:
        result = nan_max(result, value)
    return result


def _max_diff(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max())


@contextlib.contextmanager
def _noise_seed(model: Any, draw: int) -> Iterator[None]:
    """The model's initial-state noise seed moved by ``draw`` (restored afterwards)."""
    cfg = model.cfg
    seed = cfg.state_init_seed
    cfg.state_init_seed = seed + 1_000_003 * draw
    try:
        yield
    finally:
        cfg.state_init_seed = seed


def _accumulate(values: Any, more: Any) -> Any:
    """Per-example values of two evaluations added, cell by cell."""
    if isinstance(values, Tensor):
        return values + more
    return {key: _accumulate(value, more[key]) for key, value in values.items()}


def _reorder(values: Any, order: Tensor) -> Any:
    if isinstance(values, Tensor):
        return values[order]
    return {key: _reorder(value, order) for key, value in values.items()}


def _scale(values: Any, factor: float) -> Any:
    if isinstance(values, Tensor):
        return values * factor
    return {key: _scale(value, factor) for key, value in values.items()}
