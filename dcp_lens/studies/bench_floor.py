"""The sweep's cost against the work it cannot skip, for `dcp-lens bench`: the irreducible
work of a fitted protocol's sweep (`irreducible_work`: the passes and the readouts its conditions
need, `irreducible_readouts` counts them), and the floor of the work beyond it that the sweep's
definition asks of any implementation (`overhead_floor`: the maps applied, the metrics scored)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TypedDict, TypeVar

import torch
from torch import Tensor

from dcp_lens.protocol.conditions import Calibrate, Condition, Shift, Translate
from dcp_lens.protocol.confidence import matched
from dcp_lens.protocol.dcp import DepthControlProtocol, EvaluationSet
from dcp_lens.protocol.fit import FittedMaps
from dcp_lens.protocol.metrics import per_example_metrics, reference_log_probs
from dcp_lens.protocol.readout import needed_readouts, readout_groups
from dcp_lens.protocol.states import capture_states
from dcp_lens.protocol.sweep import jackknife_examples, sweep_conditions

T = TypeVar("T")


def irreducible_work(
    protocol: DepthControlProtocol, calibration: EvaluationSet, evaluation: EvaluationSet
) -> Callable[[], dict[str, float]]:
    """The work no implementation of ``protocol``'s sweep can skip, as a function that does it
    and returns the seconds of each part (`IRREDUCIBLE_PARTS`). ``protocol`` must be fitted (its
    maps tell which readouts the conditions need, as in the sweep).

    - ``calibration_pass``: one forward of each calibration batch through s_r, keeping every
      state s_0..s_r (what the fit stage reads; the maps need no logits);
    - ``matching_readouts``: confidence matching's readouts of the calibration positions it reads
      (`ConfidenceMatching.pieces`): full depth's, and per k each distinct condition given a
      temperature, when a loss metric is matched;
    - ``evaluation_pass``: one forward of each evaluation batch, keeping every state and the
      logits;
    - ``evaluation_readouts``: per evaluation batch, per k of the grid (and r), the readouts the
      sweep's conditions need (`needed_readouts`: each distinct condition once, none for full
      depth or the base rate), the calibration null's, and the jackknife's (the conditions each
      left-out calibration group's maps change, on the tenth of the examples it reads).

    The calibration pass includes the base rate's one readout of s_r per batch.

    A readout is ``model.readout`` of a captured state, grouped into calls as the sweep groups
    them (`readout_groups`): its cost does not depend on the state's values, so the maps and
    translators that move a state before its readout, the moments, the temperatures' solves and
    the metrics are the sweep's overhead, not in this."""
    context, model, r = protocol.context, protocol.model, protocol.r
    device, size = context.device(), context.config.batch_size
    plan = irreducible_readouts(protocol)
    sweep_reads, matched_reads = plan["evaluation"], plan["matching"]
    null_reads, matching = plan["null"], context.matches_confidence()
    jackknife_reads, base_reads = plan["jackknife"], plan["base_rate"]
    jackknifed = jackknife_examples(evaluation.example_keys(), int(evaluation.tokens.shape[1]))
    confidence = protocol.confidence

    def read(states: Tensor, state: Tensor, n: int) -> None:
        for group in readout_groups(states, n):
            copies = len(range(n)[group])
            model.readout(state if copies == 1 else torch.cat([state] * copies))

    def work() -> dict[str, float]:
        seconds = dict.fromkeys(IRREDUCIBLE_PARTS, 0.0)

        def clock(part: str, start: float) -> float:
            synchronize(device)
            now = time.perf_counter()
            seconds[part] += now - start
            return now

        start = time.perf_counter()
        budget_left = matching
        for index, rows in enumerate(calibration.batches(size)):
            tokens = calibration.tokens[rows].to(device)
            states, _ = capture_states(model, tokens, stop_after_last=True)
            if base_reads:  # the base rate's table: full depth's readout of the batch
                read(states, states[r], 1)
            start = clock("calibration_pass", start)
            pieces = confidence.pieces(calibration, index, rows) if budget_left else None
            budget_left = pieces is not None
            for sequences, positions in pieces or []:
                local = slice(sequences.start - rows.start, sequences.stop - rows.start)
                kept = states[:, local, :positions]
                read(kept, kept[-1], 1)
                for k, n in matched_reads.items():
                    read(kept, kept[k], n)
            start = clock("matching_readouts", start)
        for rows in evaluation.batches(size):
            states, _ = capture_states(model, evaluation.tokens[rows].to(device))
            start = clock("evaluation_pass", start)
            for k, n in sweep_reads.items():
                read(states, states[k], n)
            read(states, states[r], null_reads)
            chosen = jackknifed[rows].to(device)
            if bool(chosen.any()):
                for k, n in jackknife_reads.items():
                    read(states[:, chosen], states[k][chosen], n)
            start = clock("evaluation_readouts", start)
        return seconds

    return work


class IrreducibleReadouts(TypedDict):
    """`irreducible_readouts`: readouts per k (``null`` and ``base_rate``: per batch, 0 or 1)."""

    evaluation: dict[int, int]
    null: int
    jackknife: dict[int, int]
    base_rate: int
    matching: dict[int, int]


def irreducible_readouts(protocol: DepthControlProtocol) -> IrreducibleReadouts:
    """The readouts of `irreducible_work`: ``evaluation`` {k: readouts of one evaluation batch},
    ``null`` (the calibration null's, per batch), ``matching`` {k: readouts of each calibration
    piece confidence matching reads, besides full depth's}.

    Raises:
        ValueError: ``protocol`` is not fitted yet."""
    context, r, maps = protocol.context, protocol.r, protocol.maps
    if maps is None:
        raise ValueError("the irreducible work needs a fitted protocol: call protocol.fit first.")
    grid = [*context.k_grid, *([] if r in context.k_grid else [r])]
    matching = context.matches_confidence()
    return {
        "evaluation": {k: len(needed_readouts(r, sweep_conditions(k, maps))) for k in grid},
        "null": int(maps.null is not None),
        # The jackknife's: per k, the conditions each left-out group's maps change, read on the
        # evaluation examples `jackknife_examples` picks.
        "jackknife": {
            k: sum(
                len(needed_readouts(r, _moved(k, maps, left_out))) for left_out in maps.jackknife
            )
            for k in context.k_grid
        },
        "base_rate": int(maps.base_rate is not None),
        "matching": {
            k: len(needed_readouts(r, matched(k, maps))) if matching else 0 for k in context.k_grid
        },
    }


FLOOR_PARTS = ("maps", "metrics")


def overhead_floor(
    protocol: DepthControlProtocol, evaluation: EvaluationSet
) -> tuple[dict[str, float], dict[str, int]]:
    """Seconds, over all of ``evaluation``, of the work beyond `irreducible_work` that the sweep's
    definition asks of any implementation (`FLOOR_PARTS`):

    - ``maps``: each mapped condition's map or translator applied to its readout input (one
      d x d product over the batch's positions: `Calibrate`, `Translate`, `Shift` and the
      calibration null), the jackknife's left-out maps on the tenth of the examples they read;
    - ``metrics``: every readout of the sweep scored by the run's metrics against full depth's
      reference (made once per batch), full depth's own and the jackknife's included.

    Conditions whose logits are full depth's (full depth itself past its own score, truncate(r),
    the base rate's rearranged logits) are not scored here. Neither the maps' and translators'
    solves, the jackknife's refits, the streamed moments nor
    the temperatures are in it, so the sweep's true floor lies above ``1 + floor /
    irreducible``. Timed on every evaluation batch (its states and readouts computed untimed):
    the jackknife reads the examples `jackknife_examples` picks (key 0 mod 10, capped), so its
    share differs from batch to batch, and one batch scaled up misstates it (at eight batches of
    the bench the first held one such example in 16, the set 19 in 128). The jackknife's cells
    are scored as the sweep scores them, stacked in the readout's groups. Returns the seconds per
    part and how many maps and readouts each part timed over all batches (the jackknife's on the
    examples it reads).
    ``protocol`` must be fitted.

    Raises:
        ValueError: ``protocol`` is not fitted yet.
    """
    context, model, r, maps = protocol.context, protocol.model, protocol.r, protocol.maps
    if maps is None:
        raise ValueError("the overhead floor needs a fitted protocol: call protocol.fit first.")
    device, metrics = context.device(), context.metrics
    seconds = dict.fromkeys(FLOOR_PARTS, 0.0)
    calls = dict.fromkeys(FLOOR_PARTS, 0)

    def timed(part: str, fn: Callable[[], T]) -> T:
        synchronize(device)
        start = time.perf_counter()
        out = fn()
        synchronize(device)
        seconds[part] += time.perf_counter() - start
        return out

    def reference(logits: Tensor, answers: Tensor) -> tuple[Tensor, ...]:
        log_probs = timed("metrics", lambda: reference_log_probs(logits))
        probs, top1 = timed("metrics", lambda: (log_probs.exp(), log_probs.argmax(-1)))
        return log_probs, answers, top1, probs

    def score(logits: Tensor, against: tuple[Tensor, ...], n: int = 1) -> None:
        log_probs, answers, top1, probs = against
        calls["metrics"] += n
        timed(
            "metrics", lambda: per_example_metrics(logits, log_probs, answers, metrics, top1, probs)
        )

    def mapped_logits(at: Tensor, conditions: list[Condition]) -> list[Tensor]:
        out = []
        for condition in conditions:
            mapped = _mapped(condition, at)
            if mapped is None:
                state = condition.readout_input(at)
            else:
                calls["maps"] += 1
                state = timed("maps", mapped)
            out.append(model.readout(state))
        return out

    plan = _floor_plan(context.k_grid, r, maps)
    picked = jackknife_examples(evaluation.example_keys(), int(evaluation.tokens.shape[1]))
    for rows in evaluation.batches(context.config.batch_size):
        states, full_logits = capture_states(model, evaluation.tokens[rows].to(device))
        targets = evaluation.targets[rows].to(device)
        full = reference(full_logits, targets)
        score(full_logits, full)
        chosen = picked[rows].to(device)
        jackknifed = bool(chosen.any())
        if jackknifed:
            sub_states = states[:, chosen]
            sub = reference(full_logits[chosen], targets[chosen])
        for needed, changed in plan.values():
            for logits in mapped_logits(states, needed):
                score(logits, full)
            if not (jackknifed and changed):
                continue
            # The jackknife's cells, scored as the sweep scores them: stacked in the readout's
            # groups against a reference repeated as often (the stacking is not timed).
            cells = mapped_logits(sub_states, changed)
            for piece in readout_groups(sub_states, len(cells)):
                stacked = cells[piece]
                repeated = tuple(t.repeat(len(stacked), *[1] * (t.ndim - 1)) for t in sub)
                score(torch.cat(stacked), repeated, len(stacked))
        if maps.null is not None:
            calls["maps"] += 1
            halves = model.readout(timed("maps", functools.partial(maps.null, states[r])))
            score(halves, full)
    return seconds, calls


def _moved(k: int, maps: FittedMaps, left_out: FittedMaps) -> dict[str, Condition | None]:
    """The sweep conditions at k that a left-out group's maps change (the jackknife reads
    those again), as the sweep reads them (`sweep_conditions`)."""
    built = sweep_conditions(k, maps)
    return {n: c for n, c in sweep_conditions(k, left_out).items() if c != built[n]}


def _floor_plan(
    k_grid: tuple[int, ...], r: int, maps: FittedMaps
) -> dict[int, tuple[list[Condition], list[Condition]]]:
    """Per k of ``k_grid`` (and r): the readouts the sweep's conditions need with the fitted
    ``maps``, and those the jackknife's left-out groups' maps change."""
    plan: dict[int, tuple[list[Condition], list[Condition]]] = {}
    for k in [*k_grid, *([] if r in k_grid else [r])]:
        changed: list[Condition] = []
        for left_out in maps.jackknife if k in k_grid else []:
            changed.extend(needed_readouts(r, _moved(k, maps, left_out)))
        plan[k] = needed_readouts(r, sweep_conditions(k, maps)), changed
    return plan


def _mapped(condition: Condition, states: Tensor) -> Callable[[], Tensor] | None:
    """What moves ``condition``'s readout input by a fitted map, as a call whose input is
    computed before it (None for a condition that maps nothing)."""
    if isinstance(condition, Calibrate | Translate):
        inner = condition.inner.readout_input(states)
        move = condition.state_map if isinstance(condition, Calibrate) else condition.translator
        return lambda: move(inner)
    if isinstance(condition, Shift):
        inverse, last = condition.state_map.inverse(), states[-1]
        return lambda: inverse(last)
    return None


IRREDUCIBLE_PARTS = ("calibration_pass", "matching_readouts", "evaluation_pass",
                     "evaluation_readouts")  # fmt: skip


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a CUDA device's; a CPU's is done when it returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = [
    "FLOOR_PARTS",
    "IRREDUCIBLE_PARTS",
    "IrreducibleReadouts",
    "irreducible_readouts",
    "irreducible_work",
    "overhead_floor",
    "synchronize",
]
