"""The sweep stage: every sweep condition at every k of the grid on the evaluation set, from one
full-depth pass per batch (`readouts`), scored per example, with the null control and the
probe's subsamples, accumulated batch by batch into `SweepAccumulator` (which snapshot for
``--resume`` and merge over processes). Hands a `SweepOutput` to the probe and decomposition
stages."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from dcp_lens.protocol.budget import (
    OutOfMemoryStop,
    ReadoutPlan,
    out_of_memory_message,
    release_device_memory,
)
from dcp_lens.protocol.conditions import SWEEP, Condition
from dcp_lens.protocol.confidence import Temperatures
from dcp_lens.protocol.context import RunContext
from dcp_lens.protocol.evaluation_set import EvaluationSet
from dcp_lens.protocol.fit import FittedMaps
from dcp_lens.protocol.metrics import IGNORE_INDEX, per_example_metrics, reference_log_probs
from dcp_lens.protocol.probe import ProbeSamples
from dcp_lens.protocol.readout import readouts
from dcp_lens.protocol.states import capture_states
from dcp_lens.protocol.sweep_records import (
    BatchScores,
    MaximaAccumulator,
    NullControlAccumulator,
    ProbeSampleAccumulator,
    SweepAccumulator,
    SweepOutput,
    Values,
    nan_max,
)
from dcp_lens.utils import distributed

# The jackknife reads the mapped conditions on the evaluation examples whose key is 0 mod this,
JACKKNIFE_EVALUATION_STRIDE = 10
# up to this many tokens (those with the smallest keys): its readouts then cost the same in a
# run of any size, and a few thousand positions read each refit's cell means far more finely
# than the refits differ.
JACKKNIFE_TOKENS = 8192


def jackknife_examples(
    keys: Int[Tensor, " n"], seq_len: int, tokens: int | None = None
) -> Bool[Tensor, " n"]:
    """Which evaluation examples the jackknife reads: those whose key is 0 mod
    `JACKKNIFE_EVALUATION_STRIDE`, at most ``tokens`` // ``seq_len`` of them (at least one;
    ``tokens`` defaults to `JACKKNIFE_TOKENS`), the smallest keys first. Keys hash the
    examples' tokens, so the choice depends on neither the batch size nor the order of the
    examples.

    Args:
        keys: ``[n]`` the evaluation set's example keys (`EvaluationSet.example_keys`).
        seq_len: tokens per example.
    """
    candidates = torch.nonzero(keys % JACKKNIFE_EVALUATION_STRIDE == 0).squeeze(1)
    limit = max(1, (JACKKNIFE_TOKENS if tokens is None else tokens) // max(1, seq_len))
    order = torch.argsort(keys[candidates], stable=True)
    chosen = torch.zeros(len(keys), dtype=torch.bool)
    chosen[candidates[order[:limit]]] = True
    return chosen


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


@dataclass(frozen=True)
class _Evaluation:
    """What every batch of one evaluation reads: the data, its examples' keys and those the
    jackknife reads (`jackknife_examples`), the sweep
    conditions at every k of the grid and at r, and per left-out calibration group the
    conditions its maps change (only those are read again for the jackknife)."""

    data: EvaluationSet
    keys: Int[Tensor, " n"]
    jackknifed: Bool[Tensor, " n"]
    built: dict[int, dict[str, Condition | None]]
    left_out: list[dict[int, dict[str, Condition | None]]]


class Sweep:
    """The sweep of one run over fitted maps and temperatures.

    ``replay_difference`` holds, per k, max |readout(replay(k)) - readout(truncate(k))| over
    every evaluation so far (all noise draws): whether B is identified. ``jackknife_tokens``
    caps the jackknife's examples (`jackknife_examples`; None: `JACKKNIFE_TOKENS`)."""

    def __init__(
        self,
        context: RunContext,
        maps: FittedMaps,
        temperatures: Temperatures,
        jackknife_tokens: int | None = None,
    ) -> None:
        self.context = context
        self.jackknife_tokens = jackknife_tokens
        self.maps = maps
        self.temperatures = temperatures
        self._replay: MaximaAccumulator[int] = MaximaAccumulator()

    @property
    def replay_difference(self) -> dict[int, float]:
        return self._replay.values

    def conditions_at(self, k: int) -> dict[str, Condition | None]:
        """Every sweep condition at k (None where a map it needs could not be fitted)."""
        return {name: entry.build(k, self.maps) for name, entry in SWEEP.items()}

    @torch.no_grad()
    def evaluate(self, evaluation: EvaluationSet, stage: str = "evaluation.0") -> SweepOutput:
        """Every condition at every k on ``evaluation`` (snapshot under ``stage``)."""
        context, config = self.context, self.context.config
        run = self._evaluation(evaluation)
        records = self._records(run)
        done = context.restore(stage, records.restore)
        batches = distributed.assigned(evaluation.batches(config.batch_size))
        plan = context.readout_plan(evaluation)
        for batch_number, (index, rows) in enumerate(
            context.each(batches[done:], "evaluation"), start=done
        ):
            try:
                states, scores, plan = self._scored_batch(run, rows, plan)
            except OutOfMemoryStop:  # keep every finished batch for --resume
                context.snapshot(stage, batch_number, batch_number, records.state)
                raise
            records.add(index, scores)
            if config.probe != "none":
                keep = context.pooled_positions(evaluation, rows)
                records.probe.add(states, keep, run.keys[rows], self.maps)
            context.snapshot(stage, batch_number + 1, len(batches), records.state)
        if distributed.rank_and_world()[1] > 1:
            gathered = distributed.gather_to_main(records)
            if gathered is None:  # not rank 0: rank 0 decomposes
                return SweepOutput({}, {}, ProbeSamples())
            records = SweepAccumulator.merged(gathered, context.device())
        self._replay = records.replay_difference
        jackknife_rows = torch.nonzero(run.jackknifed).squeeze(1) if run.left_out else None
        return records.output(len(evaluation), context.metrics, self.maps, jackknife_rows)

    def _evaluation(self, evaluation: EvaluationSet) -> _Evaluation:
        built = {k: self.conditions_at(k) for k in {*self.context.k_grid, self.context.r}}
        # Under each left-out group's maps, only the conditions those maps change.
        left_out = [_changed(built, maps, self.context.k_grid) for maps in self.maps.jackknife]
        keys = evaluation.example_keys()
        chosen = jackknife_examples(keys, int(evaluation.tokens.shape[1]), self.jackknife_tokens)
        return _Evaluation(evaluation, keys, chosen, built, left_out)

    def _records(self, run: _Evaluation) -> SweepAccumulator:
        """Empty records of ``run`` (replay's differences go on from earlier evaluations)."""
        context, config = self.context, self.context.config
        # The null control: every condition that must reproduce full depth at k = r.
        null = [
            name
            for name, condition in run.built[context.r].items()
            if condition is None or condition.reproduces_full_at_r
        ]
        probe = ProbeSampleAccumulator(config.probe_points, config.seed, context.r, context.k_grid)
        return SweepAccumulator(NullControlAccumulator(null), self._replay, probe)

    def _scored_batch(
        self, run: _Evaluation, rows: slice, plan: ReadoutPlan
    ) -> tuple[Tensor, BatchScores, ReadoutPlan]:
        """`_score_batch`, redone with readout calls of half the rows after the device runs out
        of memory; the plan that fitted comes back for the next batch. Where one example's
        readouts do not fit either, stops with what to change (nothing is recorded of a batch
        that did not finish: ``--resume`` continues from the last finished one)."""
        batch, positions = rows.stop - rows.start, int(run.data.tokens.shape[1])
        while True:
            try:
                states, scores = self._score_batch(run, rows, plan)
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
        self, run: _Evaluation, rows: slice, plan: ReadoutPlan
    ) -> tuple[Tensor, BatchScores]:
        """Every cell of one evaluation batch: its states and the batch's scores, the readouts
        read and scored in chunks of whole examples (``plan``), so that what a batch holds is
        its states, full depth's logits and one chunk's readouts."""
        context, r, k_grid = self.context, self.context.r, self.context.k_grid
        metrics, device, model = context.metrics, context.device(), context.model
        built, left_out = run.built, run.left_out
        targets = run.data.targets[rows].to(device)
        states, full_logits = capture_all(context, run.data.tokens[rows])
        scores = BatchScores()
        null = scores.null
        top1: dict[str, dict[int, list[Tensor]]] = {"truncate": {}, "replay": {}}
        chosen = run.jackknifed[rows]
        null_map = self.maps.null
        for examples in plan.example_chunks(rows.stop - rows.start):
            chunk_states, chunk_logits = states[:, examples], full_logits[examples]
            scoring = _Reference.of(chunk_logits, targets[examples])
            reference = scores.add("full", 0, scoring.score(chunk_logits, metrics))
            at_r: dict[str, Tensor] | None = None
            for k in k_grid:
                read = readouts(model, r, chunk_states, built[k], chunk_logits, plan)
                for name in read:
                    tempered = self._tempered(read[name], name, k)
                    scores.add(name, k, scoring.score(tempered, metrics))
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
                    null.differences[name] = nan_max(null.differences.get(name, 0.0), difference)
            del at_r
            if null_map is not None:
                halves = model.readout(null_map(chunk_states[r]))
                null.halves_difference = nan_max(
                    null.halves_difference, _max_diff(halves, chunk_logits)
                )
                moved = scoring.score(halves, metrics)
                for metric in metrics:
                    change = float((moved[metric] - reference[metric]).double().sum())
                    null.halves_change[metric] = null.halves_change.get(metric, 0.0) + change
                del halves
            if left_out:
                picked = chosen[examples].to(device)
                self._score_jackknife(
                    scores, chunk_states[:, picked], chunk_logits[picked],
                    targets[examples][picked], left_out, plan,
                )  # fmt: skip
        for kind, per_k in walk_fractions(
            {name: {k: torch.cat(parts) for k, parts in per.items()} for name, per in top1.items()},
            full_logits.argmax(-1), targets, r,
        ).items():  # fmt: skip
            for k, value in per_k.items():
                scores.walked[(kind, k)] = [value]
        if left_out:
            empty = torch.zeros(0, dtype=torch.float64, device=device)
            for k in k_grid:  # a cell for every key, empty where none is read
                for g, conditions in enumerate(left_out):
                    for name in conditions[k]:
                        for metric in metrics:
                            scores.jackknife.setdefault((g, metric, name, k), [empty])
        return states, scores

    def _score_jackknife(
        self,
        scores: BatchScores,
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
                (g, name): condition
                for g, conditions in enumerate(left_out)
                for name, condition in conditions[k].items()
            }
            labels = list(each)
            # No call holds more rows than the main readouts of a chunk do (all of a k's).
            held = len(SWEEP) * plan.examples * states.shape[2]
            for group in plan.condition_groups(len(labels), states.shape[1], states.shape[2], held):
                named = {f"{name}@{g}": (g, name) for g, name in labels[group]}
                read = readouts(
                    context.model, r, states, {n: each[named[n]] for n in named}, full_logits, plan
                )
                for label, (g, name) in named.items():
                    tempered = self._tempered(read[label], name, k)
                    for metric, value in scoring.score(tempered, context.metrics).items():
                        scores.jackknife.setdefault((g, metric, name, k), []).append(value)
                    del tempered  # a view keeps the whole call's logits alive
                del read

    def _tempered(self, logits: Tensor, name: str, k: int) -> Tensor:
        """``logits`` at the temperature confidence matching fitted for ``(name, k)``."""
        temperature = self.temperatures.get((name, k), 1.0)
        return logits if temperature == 1.0 else logits / temperature


def capture_all(
    context: RunContext, tokens: Int[Tensor, "batch pos"]
) -> tuple[Float[Tensor, "r_plus_1 batch pos d_model"], Float[Tensor, "batch pos d_vocab"]]:
    """One full-depth forward: every state s_0..s_r and the full logits."""
    return capture_states(context.model, tokens.to(context.device()))


def evaluate_with_noise(sweep: Sweep, evaluation: EvaluationSet) -> SweepOutput:
    """`Sweep.evaluate`, averaged per example over the context's noise draws, its values in the
    order of the examples' own keys (the order the bootstrap resamples in); replay's difference
    from truncate is the largest over the draws."""
    draws = sweep.context.noise_draws()
    output = sweep.evaluate(evaluation)
    values, replay = output.values, MaximaAccumulator[int]()
    replay.add(output.replay_difference)
    for draw in range(1, draws):
        with _noise_seed(sweep.context.model, draw):
            more = sweep.evaluate(evaluation, f"evaluation.{draw}")
        values = _added(values, more.values)
        replay.add(more.replay_difference)
    output.replay_difference = replay.values
    if draws > 1:
        values = _each_vector(values, lambda v, at: v * (1.0 / draws))
    # The bootstrap resamples positions in this order: make it the examples' own.
    order = torch.argsort(evaluation.example_keys(), stable=True)
    output.values = _each_vector(values, lambda v, at: v[order])
    output.walked = {
        kind: {k: v[order] for k, v in per_k.items()} for kind, per_k in output.walked.items()
    }
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


def _max_diff(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max())


@runtime_checkable
class _Seeded(Protocol):
    """A model config with an initial-state noise seed."""

    state_init_seed: int


@contextlib.contextmanager
def _noise_seed(model: object, draw: int) -> Iterator[None]:
    """The model's initial-state noise seed (``model.cfg.state_init_seed``) moved by ``draw``
    (restored afterwards)."""
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, _Seeded):
        raise TypeError(
            f"noise draws need a model config with a state_init_seed, got {type(cfg).__name__}."
        )
    seed = cfg.state_init_seed
    cfg.state_init_seed = seed + 1_000_003 * draw
    try:
        yield
    finally:
        cfg.state_init_seed = seed


def _each_vector(
    values: Values, change: Callable[[Tensor, tuple[str, str, int | None]], Tensor]
) -> Values:
    """``values`` with each per-example vector, at (metric, condition, k) (k None for full
    depth's), replaced by ``change(vector, (metric, condition, k))``."""
    out: Values = {}
    for metric, per in values.items():
        out[metric] = {}
        for name, cells in per.items():
            if isinstance(cells, Tensor):
                out[metric][name] = change(cells, (metric, name, None))
            else:
                out[metric][name] = {k: change(v, (metric, name, k)) for k, v in cells.items()}
    return out


def _added(values: Values, more: Values) -> Values:
    """Per-example values of two evaluations added, cell by cell."""
    return _each_vector(values, lambda v, at: v + _vector_at(more, at))


def _vector_at(values: Values, at: tuple[str, str, int | None]) -> Tensor:
    metric, name, k = at
    cells = values[metric][name]
    return cells if k is None else cells[k]
