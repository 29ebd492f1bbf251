"""The sweep stage: every sweep condition at every k of the grid on the evaluation set, from one
full-depth pass per batch (`readouts`), scored per example, with the null control and the
probe's subsamples, accumulated batch by batch into `SweepAccumulator` (which snapshot for
``--resume`` and merge over processes). Hands a `SweepOutput` to the probe and decomposition
stages."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, cast, runtime_checkable

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from dcp_lens.protocol.budget import (
    OutOfMemoryStop,
    ReadoutPlan,
    out_of_memory_message,
    release_device_memory,
)
from dcp_lens.protocol.conditions import (
    SUBSAMPLED_CONTROLS,
    SWEEP,
    Calibrate,
    Condition,
    Full,
    Shift,
)
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
    JackknifeKey,
    MaximaAccumulator,
    NullControlAccumulator,
    ProbeSampleAccumulator,
    SweepAccumulator,
    SweepOutput,
    Values,
)
from dcp_lens.utils import distributed
from dcp_lens.utils.syncs import DeferredScalars

# The jackknife reads the mapped conditions on the evaluation examples whose key is 0 mod this,
JACKKNIFE_EVALUATION_STRIDE = 10
# up to this many tokens (those with the smallest keys): its readouts then cost the same in a
# run of any size, and a few thousand positions read each refit's cell means far more finely
# than the refits differ.
JACKKNIFE_TOKENS = 8192
# The controls of `SUBSAMPLED_CONTROLS` (shift and the translators) are read on at most this
# many tokens of the evaluation (`control_examples`), 64 sequences of 1024 tokens: a fixed cost
# in a run of any size, below a fifth of a forward per token at Huginn-0125's layout over the
# default 512 sequences (docs/bench.md).
CONTROL_TOKENS = 65536


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


def control_examples(
    keys: Int[Tensor, " n"], seq_len: int, jackknifed: Bool[Tensor, " n"], tokens: int
) -> Bool[Tensor, " n"]:
    """Which evaluation examples the controls of `SUBSAMPLED_CONTROLS` are read on: at most
    ``tokens`` // ``seq_len`` examples (at least one; every example where ``tokens`` is 0 or
    they all fit), the jackknife's (``jackknifed``, `jackknife_examples`, capped at no more
    than this) first, so that its cells stay paired with the controls', then the smallest
    keys. Keys hash the examples' tokens, so the choice depends on neither the batch size nor
    the order of the examples.

    Args:
        keys: ``[n]`` the evaluation set's example keys (`EvaluationSet.example_keys`).
        seq_len: tokens per example.
        jackknifed: ``[n]`` the examples the jackknife reads.
    """
    limit = max(1, tokens // max(1, seq_len))
    if tokens == 0 or limit >= len(keys):
        return torch.ones(len(keys), dtype=torch.bool)
    order = torch.argsort(keys, stable=True)
    order = order[torch.argsort((~jackknifed[order]).to(torch.int8), stable=True)]
    chosen = torch.zeros(len(keys), dtype=torch.bool)
    chosen[order[:limit]] = True
    return chosen


@dataclass(frozen=True)
class _Reference:
    """Full depth's side of every metric of one chunk of examples, computed once for the
    chunk's conditions: log-probabilities, probabilities, top-1 and the targets."""

    log_probs: Float[Tensor, "batch pos d_vocab"]
    probs: Float[Tensor, "batch pos d_vocab"]
    top1: Int[Tensor, "batch pos"]
    targets: Int[Tensor, "batch pos"]

    @classmethod
    def of(cls, full_logits: Tensor, targets: Tensor) -> _Reference:
        log_probs = reference_log_probs(full_logits)
        return cls(log_probs, log_probs.exp(), log_probs.argmax(-1), targets)

    def score(self, logits: Tensor, metrics: Sequence[str]) -> dict[str, Tensor]:
        """`per_example_metrics` of ``logits`` against this reference: [batch] per metric."""
        return per_example_metrics(
            logits, self.log_probs, self.targets, metrics, self.top1, self.probs
        )


@dataclass(frozen=True)
class _Evaluation:
    """What every batch of one evaluation reads: the data, its examples' keys and those the
    jackknife reads (`jackknife_examples`), the sweep conditions at every k of the grid and at
    r (`sweep_conditions`), per left-out calibration group the conditions its maps change
    (only those are read again for the jackknife), and the controls read on a subsample
    (``subsampled``: none where it holds every example) with its examples
    (``controlled``, `control_examples`)."""

    data: EvaluationSet
    keys: Int[Tensor, " n"]
    jackknifed: Bool[Tensor, " n"]
    built: dict[int, dict[str, Condition | None]]
    left_out: list[dict[int, dict[str, Condition | None]]]
    controlled: Bool[Tensor, " n"]
    subsampled: tuple[str, ...]


@dataclass(frozen=True)
class _Batch:
    """One evaluation batch as the sweep scores it: the evaluation it belongs to, its rows of
    the evaluation set and the plan its readouts are cut by (`ReadoutPlan`)."""

    run: _Evaluation
    rows: slice
    plan: ReadoutPlan

    @property
    def size(self) -> int:
        return self.rows.stop - self.rows.start

    @property
    def positions(self) -> int:
        return int(self.run.data.tokens.shape[1])


@dataclass(frozen=True)
class _Chunk:
    """Whole examples of one batch read together: their states ``[r + 1, chunk, pos, d_model]``,
    full depth's logits ``[chunk, pos, d_vocab]``, full depth's side of the metrics and the
    examples' rows of the batch."""

    states: Float[Tensor, "r_plus_1 chunk pos d_model"]
    logits: Float[Tensor, "chunk pos d_vocab"]
    reference: _Reference
    examples: slice

    def subset(self, picked: Bool[Tensor, " chunk"]) -> _Chunk:
        """The chunk's ``picked`` examples (a mask on the device), full depth's side with them."""
        reference = self.reference
        chosen = _Reference(
            reference.log_probs[picked],
            reference.probs[picked],
            reference.top1[picked],
            reference.targets[picked],
        )
        return _Chunk(self.states[:, picked], self.logits[picked], chosen, self.examples)


class Sweep:
    """The sweep of one run over fitted maps and temperatures.

    ``replay_difference`` holds, per k, max |readout(replay(k)) - readout(truncate(k))| over
    every evaluation so far (all noise draws): whether B is identified. ``jackknife_tokens``
    caps the jackknife's examples (`jackknife_examples`; None: `JACKKNIFE_TOKENS`),
    ``control_tokens`` those the controls of `SUBSAMPLED_CONTROLS` are read on
    (`control_examples`; 0: every example; None: the config's ``control_tokens``, else
    `CONTROL_TOKENS`)."""

    def __init__(
        self,
        context: RunContext,
        maps: FittedMaps,
        temperatures: Temperatures,
        jackknife_tokens: int | None = None,
        control_tokens: int | None = None,
    ) -> None:
        self.context = context
        self.jackknife_tokens = jackknife_tokens
        configured = context.config.control_tokens  # an int or None once the config is checked
        if control_tokens is None and configured is not None:
            control_tokens = int(configured)
        self.control_tokens = CONTROL_TOKENS if control_tokens is None else control_tokens
        self.maps = maps
        self.temperatures = temperatures
        self._replay: MaximaAccumulator[int] = MaximaAccumulator()

    @property
    def replay_difference(self) -> dict[int, float]:
        return self._replay.values

    def conditions_at(self, k: int) -> dict[str, Condition | None]:
        """Every sweep condition at k as the sweep reads it (`sweep_conditions`)."""
        return sweep_conditions(k, self.maps)

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
                states, scores, plan = self._scored_batch(_Batch(run, rows, plan))
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
        output = records.output(len(evaluation), context.metrics, self.maps, jackknife_rows)
        output.read = {name: run.controlled.clone() for name in run.subsampled}
        return output

    def _evaluation(self, evaluation: EvaluationSet) -> _Evaluation:
        built = {k: self.conditions_at(k) for k in {*self.context.k_grid, self.context.r}}
        # Under each left-out group's maps, only the conditions those maps change.
        left_out = [_changed(built, maps, self.context.k_grid) for maps in self.maps.jackknife]
        keys, seq_len = evaluation.example_keys(), int(evaluation.tokens.shape[1])
        jackknife_tokens = (
            JACKKNIFE_TOKENS if self.jackknife_tokens is None else self.jackknife_tokens
        )
        if self.control_tokens:  # the jackknife reads inside the controls' subsample
            jackknife_tokens = min(jackknife_tokens, self.control_tokens)
        chosen = jackknife_examples(keys, seq_len, jackknife_tokens)
        controlled = control_examples(keys, seq_len, chosen, self.control_tokens)
        names = [name for name in SUBSAMPLED_CONTROLS if name in built[self.context.r]]
        subsampled = () if bool(controlled.all()) else tuple(names)
        return _Evaluation(evaluation, keys, chosen, built, left_out, controlled, subsampled)

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

    def _scored_batch(self, batch: _Batch) -> tuple[Tensor, BatchScores, ReadoutPlan]:
        """`_score_batch`, redone with readout calls of half the rows after the device runs out
        of memory; the plan that fitted comes back for the next batch. Where one example's
        readouts do not fit either, stops with what to change (nothing is recorded of a batch
        that did not finish: ``--resume`` continues from the last finished one)."""
        while True:
            try:
                states, scores = self._score_batch(batch)
                return states, scores, batch.plan
            except torch.OutOfMemoryError as error:
                smaller = batch.plan.halved(batch.size, batch.positions)
                if smaller is None:
                    raise OutOfMemoryStop(self._out_of_memory(batch)) from error
            # Out of the handler, the failed call's tensors are no longer referenced.
            release_device_memory(self.context.device())
            batch = replace(batch, plan=smaller)

    def _out_of_memory(self, batch: _Batch) -> str:
        context = self.context
        config, device = context.config, str(context.device())
        rows, positions = batch.rows, batch.positions
        budget = context.budget()
        return out_of_memory_message(
            "evaluation", rows, config.batch_size, positions, budget, device
        )

    def _score_batch(self, batch: _Batch) -> tuple[Tensor, BatchScores]:
        """Every cell of one evaluation batch: its states and the batch's scores, the readouts
        read and scored in chunks of whole examples (``batch.plan``), so that what a batch holds
        is its states, full depth's logits and one chunk's readouts."""
        context = self.context
        states, full_logits = capture_all(context, batch.run.data.tokens[batch.rows])
        targets = batch.run.data.targets[batch.rows].to(context.device())
        accumulator = _BatchAccumulator(self, batch, states, full_logits, targets)
        for examples in batch.plan.example_chunks(batch.size):
            accumulator.add(examples)
        return states, accumulator.scores()

    def tempered(self, logits: Tensor, name: str, k: int) -> Tensor:
        """``logits`` at the temperature confidence matching fitted for ``(name, k)``."""
        temperature = self.temperatures.get((name, k), 1.0)
        return logits if temperature == 1.0 else logits / temperature


class _BatchAccumulator:
    """The scores of one evaluation batch (`BatchScores`), added chunk by chunk of whole
    examples: every condition at every k, the null control, the calibration null's readout and
    the jackknife's cells of the chunk's chosen examples; `scores` adds where replay walks.

    Args:
        sweep: the sweep whose maps, temperatures and context the batch is read with.
        batch: the batch.
        states: ``[r + 1, batch, pos, d_model]`` its states s_0..s_r.
        full_logits: ``[batch, pos, d_vocab]`` full depth's logits.
        targets: ``[batch, pos]`` its next tokens.
    """

    def __init__(
        self,
        sweep: Sweep,
        batch: _Batch,
        states: Float[Tensor, "r_plus_1 batch pos d_model"],
        full_logits: Float[Tensor, "batch pos d_vocab"],
        targets: Int[Tensor, "batch pos"],
    ) -> None:
        self.sweep, self.batch, self.context = sweep, batch, sweep.context
        self.states, self.full_logits, self.targets = states, full_logits, targets
        self.batch_scores = BatchScores()
        self.deferred = DeferredScalars()  # the batch's maxima and sums, read once in `scores`
        self.top1: dict[str, dict[int, list[Tensor]]] = {"truncate": {}, "replay": {}}

    def add(self, examples: slice) -> None:
        """Score the batch's ``examples`` (a chunk the plan reads at once)."""
        logits = self.full_logits[examples]
        reference = _Reference.of(logits, self.targets[examples])
        chunk = _Chunk(self.states[:, examples], logits, reference, examples)
        full = self.batch_scores.add("full", 0, self._scored(chunk, logits))
        context = self.context
        at_r = None
        for k in context.k_grid:
            read = self._add_depth(chunk, k)
            if k == context.r:
                at_r = read
            del read
        if at_r is None:
            at_r = self._read(chunk, self.batch.run.built[context.r])
        self._add_null(chunk, at_r)
        del at_r
        self._add_halves(chunk, full)
        if self.batch.run.left_out:
            self._add_jackknife(chunk)

    def scores(self) -> BatchScores:
        """The batch's scores, with where replay walks (`walk_fractions`) and a jackknife cell
        for every key (empty where none of the batch's examples is read)."""
        scores, top1 = self.batch_scores, self.top1
        joined = {
            name: {k: torch.cat(parts) for k, parts in per.items()} for name, per in top1.items()
        }
        walked = walk_fractions(joined, self.full_logits.argmax(-1), self.targets, self.context.r)
        for kind, per_k in walked.items():
            for k, value in per_k.items():
                scores.walked[(kind, k)] = [value]
        empty = torch.zeros(0, dtype=torch.float64, device=self.context.device())
        for key in self._jackknife_keys():
            scores.jackknife.setdefault(key, [empty])
        maxima, sums = self.deferred.read()  # the batch's one read of its scalars
        for scalar, number in maxima.items():
            kind, name = cast(tuple[str, Any], scalar)
            if kind == "replay":
                scores.replay_difference[name] = number
            elif kind == "null":
                scores.null.differences[name] = number
            else:
                scores.null.halves_difference = number
        scores.null.halves_change = {str(metric): number for metric, number in sums.items()}
        return scores

    def _add_depth(self, chunk: _Chunk, k: int) -> dict[str, Tensor]:
        """Every condition at k on ``chunk``: scored, replay's difference from truncate, the
        top-1 where replay walks reads; the readouts come back (the null control's at r). The
        subsampled controls are read on the chunk's examples of the subsample (`_add_controls`)
        below r; at r, where they are full depth and cost no readout, on every example, their
        scores kept only on the subsample's."""
        run, r = self.batch.run, self.context.r
        subsampled = run.subsampled if k != r else ()
        built = {name: c for name, c in run.built[k].items() if name not in subsampled}
        read = self._read(chunk, built)
        scores = self.batch_scores
        picked = self._controlled(chunk) if run.subsampled else None
        for name, logits in read.items():
            scored = self._scored(chunk, self.sweep.tempered(logits, name, k))
            if picked is not None and name in run.subsampled:
                scored = {metric: v.masked_fill(~picked, math.nan) for metric, v in scored.items()}
            scores.add(name, k, scored)
        if picked is not None and subsampled:
            self._add_controls(chunk, k, picked)
        self.deferred.maximum(("replay", k), _max_diff(read["replay"], read["truncate"]))
        for name, per_k in self.top1.items():
            per_k.setdefault(k, []).append(read[name].argmax(-1))
        return read

    def _controlled(self, chunk: _Chunk) -> Bool[Tensor, " chunk"]:
        """Which of the chunk's examples the subsampled controls are read on, on the device."""
        batch = self.batch
        return batch.run.controlled[batch.rows][chunk.examples].to(self.context.device())

    def _add_controls(self, chunk: _Chunk, k: int, picked: Bool[Tensor, " chunk"]) -> None:
        """The subsampled controls at k, read on the chunk's ``picked`` examples only: each
        metric's ``[chunk]`` vector holds NaN (not read) on the others."""
        run, examples = self.batch.run, int(chunk.logits.shape[0])
        conditions = {name: run.built[k][name] for name in run.subsampled}
        chosen = chunk.subset(picked) if bool(picked.any()) else None
        read = self._read(chosen, conditions) if chosen is not None else {}
        for name in run.subsampled:
            scored: dict[str, Tensor] = {}
            if chosen is not None:
                tempered = self.sweep.tempered(read.pop(name), name, k)
                scored = self._scored(chosen, tempered)
                del tempered  # a view keeps the whole call's logits alive
            vectors = {}
            for metric in self.context.metrics:
                vector = torch.full(
                    (examples,), math.nan, dtype=torch.float64, device=picked.device
                )
                if metric in scored:
                    vector[picked] = scored[metric].to(torch.float64)
                vectors[metric] = vector
            self.batch_scores.add(name, k, vectors)

    def _add_null(self, chunk: _Chunk, at_r: dict[str, Tensor]) -> None:
        """The null control: at k = r every condition that must reproduce full depth does."""
        built = self.batch.run.built[self.context.r]
        for name, logits in at_r.items():
            condition = built[name]
            if condition is None or condition.reproduces_full_at_r:
                self.deferred.maximum(("null", name), _max_diff(logits, chunk.logits))

    def _add_halves(self, chunk: _Chunk, full: Mapping[str, Tensor]) -> None:
        """The calibration null: full depth's states under the map fitted between two halves of
        the calibration split should read out as full depth does."""
        null_map = self.sweep.maps.null
        if null_map is None:
            return
        halves = self.context.model.readout(null_map(chunk.states[self.context.r]))
        self.deferred.maximum(("halves", None), _max_diff(halves, chunk.logits))
        moved = self._scored(chunk, halves)
        for metric in self.context.metrics:
            self.deferred.add(metric, (moved[metric] - full[metric]).double().sum())

    def _add_jackknife(self, chunk: _Chunk) -> None:
        """The jackknife's cells of the chunk's chosen examples: the mapped conditions under
        each left-out group's maps, scored against full depth's side of the same examples."""
        picked = self.batch.run.jackknifed[self.batch.rows][chunk.examples]
        if not bool(picked.any()):
            return
        picked = picked.to(self.context.device())
        logits = chunk.logits[picked]
        targets = chunk.reference.targets[picked]
        chosen = _Chunk(
            chunk.states[:, picked], logits, _Reference.of(logits, targets), chunk.examples
        )
        for k in self.context.k_grid:
            self._add_jackknife_at(chosen, k)

    def _add_jackknife_at(self, chosen: _Chunk, k: int) -> None:
        """The jackknife's cells at k: its readouts in calls of at most the plan's rows, each
        call's logits scored and let go before the next call."""
        left_out = self.batch.run.left_out
        labels = [(g, name) for g, conditions in enumerate(left_out) for name in conditions[k]]
        examples, positions = chosen.logits.shape[:2]
        for group in self.batch.plan.condition_groups(len(labels), examples, positions):
            named = {f"{name}@{g}": (g, name) for g, name in labels[group]}
            read = self._read(
                chosen, {label: left_out[g][k][name] for label, (g, name) in named.items()}
            )
            for label, (g, name) in named.items():
                tempered = self.sweep.tempered(read.pop(label), name, k)
                for metric, value in self._scored(chosen, tempered).items():
                    self.batch_scores.jackknife.setdefault((g, metric, name, k), []).append(value)
                del tempered  # a view keeps the whole call's logits alive

    def _read(self, chunk: _Chunk, conditions: dict[str, Condition | None]) -> dict[str, Tensor]:
        """`readouts` of ``conditions`` on ``chunk``, in calls of at most the plan's rows."""
        context = self.context
        return readouts(
            context.model, context.r, chunk.states, conditions, chunk.logits, self.batch.plan
        )

    def _scored(self, chunk: _Chunk, logits: Tensor) -> dict[str, Tensor]:
        return chunk.reference.score(logits, self.context.metrics)

    def _jackknife_keys(self) -> Iterator[JackknifeKey]:
        for k in self.context.k_grid:
            for g, conditions in enumerate(self.batch.run.left_out):
                for name in conditions[k]:
                    for metric in self.context.metrics:
                        yield g, metric, name, k


def sweep_conditions(k: int, maps: FittedMaps) -> dict[str, Condition | None]:
    """Every sweep condition at k built from ``maps`` (None where a map it needs could not be
    fitted), as the sweep reads it: a condition that reads full depth's state through the map
    fitted from full depth onto itself (calibrate(truncate(r)), calibrate(replay(r)), shift(r))
    is full depth. That map matches a distribution onto itself, so it is the identity by
    construction (what the null control records of it is ``calibrate_full_identity_deviation``);
    reading it out would only add the fit's rounding."""
    onto_itself = maps.fitted(Full()) if "full" in maps.maps else None
    conditions = {name: entry.build(k, maps) for name, entry in SWEEP.items()}
    return {
        name: Full() if _through(condition, onto_itself) else condition
        for name, condition in conditions.items()
    }


def _through(condition: Condition | None, state_map: object) -> bool:
    """Whether ``condition`` maps its readout input by ``state_map`` (not None)."""
    mapped = isinstance(condition, Calibrate | Shift)
    return state_map is not None and mapped and getattr(condition, "state_map", None) is state_map


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
    output.read = {name: mask[order] for name, mask in output.read.items()}
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
        conditions = sweep_conditions(k, maps)
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
        return (values * walking).sum(-1).double() / count

    out: dict[str, dict[int, Tensor]] = {"fraction": {}, "accuracy": {}, "top1_agreement": {}}
    for k in sorted(top1["replay"]):
        replayed, truncated = top1["replay"][k], top1["truncate"][k]
        out["fraction"][k] = per_example(torch.ones_like(walking))
        for metric, reference in (("accuracy", targets), ("top1_agreement", full_top1)):
            gain = (replayed == reference).double() - (truncated == reference).double()
            out[metric][k] = per_example(gain)
    return out


def _max_diff(a: Tensor, b: Tensor) -> Tensor:
    """The largest |a - b| as a 0-d tensor on their device (NaN where any difference is)."""
    return (a - b).abs().max()


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
