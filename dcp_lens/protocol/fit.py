"""The fit stage: every calibration map the sweep's conditions ask for, fitted label-free on the
calibration split (streaming moments, or subsamples of states for a map fitted to states), the
calibration null, and the probe's reference states, from what one pass over the split
accumulates (`CalibrationAccumulator`). Hands a `FittedMaps` to the later stages."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from jaxtyping import Float, Int
from torch import Tensor

from dcp_lens.protocol.budget import (
    OutOfMemoryStop,
    in_smaller_chunks,
    retried_once,
    stage_stop_message,
)
from dcp_lens.protocol.calibration import (
    CALIBRATION_MAPS,
    MIN_STATES,
    CalibrationFallbackWarning,
    CalibrationMap,
    FittedMap,
    MapSettings,
    StreamingMoments,
    all_finite,
)
from dcp_lens.protocol.conditions import SWEEP, Condition, Full, ProtocolModel
from dcp_lens.protocol.confidence import ConfidenceMatching
from dcp_lens.protocol.context import RunContext
from dcp_lens.protocol.evaluation_set import EvaluationSet
from dcp_lens.protocol.fit_records import (
    CalibrationAccumulator,
    LeadingStates,
    PassChunks,
    fold_stop,
    group_major,
    leading_states,
    moments_host,
    pass_stop,
    read_batch,
    translator_rows,
)
from dcp_lens.protocol.gate import (
    REPLACED,
    GateRecord,
    ReadoutGeometry,
    StateReadout,
    judge,
    ridge_scale,
)
from dcp_lens.protocol.jackknife import LeftOutAffine, LeftOutTranslator
from dcp_lens.protocol.metrics import IGNORE_INDEX
from dcp_lens.protocol.states import capture_states
from dcp_lens.protocol.subsample import Subsample
from dcp_lens.protocol.translator import AffineTranslator, MeanTranslator
from dcp_lens.utils import distributed

# A paired translator of the S bracket's upper end: the whole split's, or a jackknife refit.
Translator = AffineTranslator | LeftOutTranslator
# The translators' held-out gate (`dcp_lens.protocol.gate`): its folds where the jackknife is off.
GATE_FOLDS = 10
# What to change when a fit after the calibration pass runs out of memory at its smallest.
_FEWER_MAPS = "--calibration-groups 0 (no jackknife refits) or a shorter --k grid (fewer maps)"


@dataclass
class FittedMaps:
    """The fit stage's hand-off.

    Attributes:
        maps: per source condition's label at depth r (``"full"`` is calibrate(full)), the map
            from its readout inputs to full depth's; None where its states were non-finite.
        null: the same kind of map fitted between two halves of full depth's states (None: not
            fittable), the calibration null.
        probe_reference: the probe's reference subsample of full-depth readout inputs ``[n, d]``.
        mode: the calibration mode asked for (a map fitted in another mode fell back).
        n_iterations: r, the depth the source labels are taken at.
        translators: per source label, the paired translator of the S bracket's upper end.
        base_rate: ``[n_buckets, d_vocab]`` log of full depth's mean distribution per position
            bucket on the calibration split (the base-rate control), None where not swept.
        jackknife: the same maps and translators fitted with one calibration group left out,
            one per group (``config.calibration_groups``; empty when 0): the sweep
            reads the mapped conditions under each so the intervals carry the calibration
            split's variability (docs/bracket.md, "The calibration split in the intervals").
        states: per source label, the calibration states its map was fitted from.
        gate: per source label, how its paired translator was judged (`GateRecord`).
    """

    maps: dict[str, FittedMap | None]
    null: FittedMap | None
    probe_reference: Tensor | None
    mode: str
    n_iterations: int
    translators: Mapping[str, Translator | None] = field(default_factory=dict)
    base_rate: Tensor | None = None
    jackknife: list[FittedMaps] = field(default_factory=list)
    states: dict[str, int] = field(default_factory=dict)
    gate: dict[str, GateRecord] = field(default_factory=dict)

    def __call__(self, source: Condition) -> FittedMap | None:
        """`fitted`: a `FittedMaps` is the `MapLookup` the sweep's builders are handed."""
        return self.fitted(source)

    def translator(self, source: Condition) -> Callable[[Tensor], Tensor] | None:
        """The paired translator fitted from ``source``'s readout inputs to each example's own
        full-depth readout (None: non-finite); the identity where ``source`` is full depth."""
        source = source.at_depth(self.n_iterations)
        if isinstance(source, Full):
            return _identity
        if source.label not in self.translators:
            raise KeyError(
                f"no translator was fitted from {source.label}; fitted: {sorted(self.translators)}."
                " Fit again after changing k_grid or the registered sweep conditions."
            )
        return self.translators[source.label]

    def fitted(self, source: Condition) -> FittedMap | None:
        """The map fitted from ``source``'s readout inputs to full depth's (None: non-finite)."""
        label = source.at_depth(self.n_iterations).label
        if label not in self.maps:
            raise KeyError(
                f"no calibration was fitted from {label}; fitted: {sorted(self.maps)}. Fit "
                "again after changing k_grid or the registered sweep conditions."
            )
        return self.maps[label]

    def fitted_record(self) -> dict[str, dict[str, int | str | None]]:
        """Per map (and the null): the states it was fitted from and the mode it was fitted in
        (None where it could not be fitted), as results record them."""
        record: dict[str, dict[str, int | str | None]] = {
            label: {"states": self.states.get(label, 0), "mode": getattr(m, "mode", None)}
            for label, m in self.maps.items()
        }
        record["calibration_null"] = {"mode": getattr(self.null, "mode", None)}
        return record

    def mean_translators(self) -> list[str]:
        """Sources whose paired translator's held-out readout was no closer to full depth's than
        the mean state's, replaced by `MeanTranslator` (`dcp_lens.protocol.gate.judge`)."""
        return [label for label, t in self.translators.items() if isinstance(t, MeanTranslator)]

    def gate_record(self) -> dict[str, dict[str, object]]:
        """Per source, how its paired translator was judged and on what evidence, as results
        record it (`GateRecord.record`)."""
        return {label: record.record() for label, record in self.gate.items()}

    def failures(self) -> list[str]:
        """Source conditions whose map could not be fitted (non-finite states)."""
        return [label for label, mapping in self.maps.items() if mapping is None]

    def fallbacks(self) -> list[str]:
        """Maps fitted in a simpler mode than asked, as ``"truncate(1): diag"``: the
        calibration split had too few states for the mode."""
        return [
            f"{label}: {mapping.mode}"
            for label, mapping in self.maps.items()
            if mapping is not None and mapping.mode != self.mode
        ]


def sources(context: RunContext) -> dict[str, Condition]:
    """Every condition a map is fitted from, by label at depth r: full depth and whatever the
    registered sweep conditions ask for at the grid's k."""
    return _wanted(context).maps


def translator_sources(context: RunContext) -> dict[str, Condition]:
    """Every condition a paired translator is fitted from (full depth needs none), by label."""
    return _wanted(context).translators


def _wanted(context: RunContext) -> _Wanted:
    wanted = _Wanted(context.r)
    for k in context.k_grid:
        for entry in SWEEP.values():
            entry.build(k, wanted)
    return wanted


@torch.no_grad()
def fit_maps(
    context: RunContext,
    calibration: EvaluationSet,
    confidence: ConfidenceMatching | None = None,
) -> FittedMaps:
    """Fit every map of `sources` on ``calibration`` (streaming moments of each source's readout
    inputs against full depth's), snapshotting as it goes. ``confidence`` (when matching) keeps
    the states it will read, so that it needs no forward pass of its own."""
    config, device = context.config, context.device()
    entry = CALIBRATION_MAPS[config.calibration_mode]
    wanted = _wanted(context)
    announce_fallbacks(context, calibration, config.calibration_mode)
    host = moments_host(context)
    if host is not None:  # one group filled at a time: the pass reads the split group by group
        front = max(translator_rows(calibration), _confidence_rows(calibration, confidence))
        groups = config.calibration_groups
        calibration = group_major(calibration, config.batch_size, groups, front)
    records = CalibrationAccumulator(
        context, calibration, wanted.maps, entry, wanted.wants_base_rate, host
    )
    # With parked groups the snapshot is read into host memory: the groups come to the device
    # one at a time as the pass fills them (`GroupMoments`), the rest of the records at once.
    done = context.restore("calibration", records.restore, host)
    if confidence is not None:
        confidence.start_stash()
    leading = LeadingStates(calibration)
    batches = distributed.assigned(calibration.batches(config.batch_size))
    batch = min(config.batch_size, max(1, len(calibration)))
    plan = context.readout_plan(calibration)
    chunks = PassChunks(batch, plan, batch, int(calibration.tokens.shape[1]))
    for batch_number, (index, rows) in enumerate(
        context.each(batches[done:], "calibration"), start=done
    ):
        try:
            (states, base), chunks = in_smaller_chunks(
                functools.partial(read_batch, context, calibration, rows, records),
                chunks,
                PassChunks.halved,
                device,
                functools.partial(pass_stop, context, rows),
            )
        except OutOfMemoryStop:  # the records hold every finished batch: keep them for --resume
            context.snapshot("calibration", batch_number, batch_number, records.state)
            raise
        try:
            records.add(context, calibration, rows, states, base)
            if confidence is not None:
                confidence.stash_batch(calibration, index, rows, states)
            leading.add(context, calibration, index, rows, states)
        except torch.OutOfMemoryError as error:  # the records changed part way: not snapshotted
            raise OutOfMemoryStop(fold_stop(context, rows)) from error
        del states, base
        context.snapshot("calibration", batch_number + 1, len(batches), records.state)
    records.flush()
    if distributed.rank_and_world()[1] > 1:
        records.merge_processes(device)
    return _fitted(context, calibration, entry, records, leading)


def _confidence_rows(calibration: EvaluationSet, confidence: ConfidenceMatching | None) -> int:
    """The leading calibration sequences confidence matching reads (0 without it)."""
    if confidence is None:
        return 0
    scored = (calibration.targets != IGNORE_INDEX).sum(-1).cumsum(0)
    return int(torch.searchsorted(scored, confidence.budget(calibration))) + 1


def _fitted(
    context: RunContext,
    calibration: EvaluationSet,
    entry: CalibrationMap,
    records: CalibrationAccumulator,
    leading: LeadingStates,
) -> FittedMaps:
    """The maps, the calibration null and the translators fitted from the calibration pass's
    ``records``, and with calibration groups their refits with each group left out."""
    config, r = context.config, context.r
    totals = {label: moments.total() for label, moments in records.streams.items()}
    (translators, left_out_translators, gate), _ = in_smaller_chunks(
        lambda _: fit_translators(context, calibration, leading.states),
        False,
        retried_once,
        context.device(),
        lambda _: _after_pass_stop(context, "translator fits", _FEWER_MAPS),
    )
    base_rate = None if records.base is None else records.base.table()
    maps = FittedMaps(
        _fit_whole(entry, config, records, totals),
        _fit_null(entry, config, records.sample, records.halves),
        records.sample.tensor(),
        config.calibration_mode,
        r,
        translators,
        base_rate,
    )
    maps.states = {label: 0 if total is None else total.count for label, total in totals.items()}
    maps.gate = gate
    populated = sum(bool(m.count) for m in (records.streams["full"].groups or []))
    if config.calibration_groups >= 2 and populated >= 2:
        left_out_maps = _refit_left_out(context, entry, records, totals, maps.maps)
        for refits, refit_translators in zip(left_out_maps, left_out_translators, strict=True):
            # The base rate is not refitted: see `BaseRateSums.table`.
            maps.jackknife.append(
                FittedMaps(
                    refits, None, None, config.calibration_mode, r, refit_translators, base_rate
                )
            )
    return maps


def _fit_whole(
    entry: CalibrationMap,
    config: MapSettings,
    records: CalibrationAccumulator,
    totals: dict[str, StreamingMoments | None],
) -> dict[str, FittedMap | None]:
    """Every map fitted on the whole calibration split (None where its states were
    non-finite)."""
    reference = totals["full"]
    return {
        label: None
        if source is None or reference is None
        else _fit_map(
            entry,
            config,
            source,
            reference,
            records.samples.get(label),
            records.samples.get("full"),
        )
        for label, source in totals.items()
    }


def _refit_left_out(
    context: RunContext,
    entry: CalibrationMap,
    records: CalibrationAccumulator,
    totals: dict[str, StreamingMoments | None],
    whole: dict[str, FittedMap | None],
) -> list[dict[str, FittedMap | None]]:
    """Every map refitted with each calibration group left out, one stream at a time: full
    depth's left-out moments are formed once per group, each other stream's group moments are
    released once its refits are done, and each refit is held as a difference from the whole
    split's map (`LeftOutAffine`). None where a refit cannot be fitted (too few states)."""
    n_groups, streams = records.n_groups, records.streams
    device = context.device()

    def stop(_: object) -> str:
        return _after_pass_stop(context, "jackknife fits", _FEWER_MAPS)

    references, _ = in_smaller_chunks(
        lambda _: [streams["full"].left_out(totals["full"], g) for g in range(n_groups)],
        False,
        retried_once,
        device,
        stop,
    )
    refits: list[dict[str, FittedMap | None]] = [{} for _ in range(n_groups)]
    labels = [label for label in streams if label != "full"] + ["full"]
    with warnings.catch_warnings():  # the whole split's fit already said so
        warnings.simplefilter("ignore")
        for label in context.each(labels, "jackknife fits"):
            each, _ = in_smaller_chunks(
                functools.partial(
                    _refit_stream, context, entry, records, totals, whole, references, label
                ),
                False,
                retried_once,
                device,
                stop,
            )
            for g, refit in enumerate(each):
                refits[g][label] = refit
            if label != "full":  # its groups' moments are no longer needed
                streams[label].release()
                totals[label] = None
    return [{label: refit[label] for label in whole} for refit in refits]


def _refit_stream(
    context: RunContext,
    entry: CalibrationMap,
    records: CalibrationAccumulator,
    totals: dict[str, StreamingMoments | None],
    whole: dict[str, FittedMap | None],
    references: list[StreamingMoments | None],
    label: str,
    tried: object = None,
) -> list[FittedMap | None]:
    """Source ``label``'s map refitted with each calibration group left out, as differences from
    the whole split's (None where a refit cannot be fitted); changes nothing it is handed.
    ``tried``: whether this is the second try (`retried_once`), the same work either way."""
    n_groups = records.n_groups
    out: list[FittedMap | None] = []
    for g, reference in enumerate(references):
        source = reference if label == "full" else records.streams[label].left_out(totals[label], g)
        fitted: FittedMap | None = None
        if source is not None and reference is not None:
            try:
                fitted = _fit_map(
                    entry,
                    context.config,
                    source,
                    reference,
                    _without(records.samples.get(label), g, n_groups),
                    _without(records.samples.get("full"), g, n_groups),
                )
            except ValueError:
                fitted = None  # too few states without the group: no jackknife cell
        out.append(None if fitted is None else LeftOutAffine.of(whole[label], fitted))
    return out


def _after_pass_stop(context: RunContext, stage: str, change: str) -> str:
    """The stop of a stage after the calibration pass (its snapshot holds what it reads)."""
    return stage_stop_message(
        stage,
        str(context.device()),
        "after emptying the cache and trying again",
        "--resume does not read the calibration split again: it fits from the calibration "
        "pass's last snapshot (with a --resume snapshot folder).",
        change,
    )


def pooled_count(context: RunContext, data: EvaluationSet) -> int:
    """States each calibration stream pools over ``data`` (every real token, less position 0
    with ``skip_first_position``)."""
    if data.attention_mask is not None:
        count = int(data.attention_mask.sum())
    else:
        count = int(data.tokens.numel())
    if context.config.skip_first_position:
        count -= len(data)
    return max(0, count)


def announce_fallbacks(context: RunContext, calibration: EvaluationSet, mode: str) -> None:
    """Warn before the calibration pass where the split is too small for ``mode`` at this
    width: which mode the maps, the jackknife's refits and the null will be fitted in, and
    how many sequences the mode asked for needs."""
    if mode not in MIN_STATES:
        return
    width = int(getattr(getattr(context.model, "cfg", None), "d_model", 0) or 0)
    if not width:
        return
    needed, pooled = MIN_STATES[mode](width), pooled_count(context, calibration)
    groups = context.config.calibration_groups
    fits = {
        "the maps": pooled,
        "the jackknife's refits": pooled * (groups - 1) // groups if groups >= 2 else needed,
        "the calibration null": pooled // 2,
    }
    short = {what: n for what, n in fits.items() if n < needed}
    if not short:
        return
    per_sequence = max(1, pooled // max(1, len(calibration)))
    sequences = -(-2 * needed // per_sequence)
    warnings.warn(
        CalibrationFallbackWarning(
            f"calibration mode {mode!r} needs at least {needed} states at width {width}; this "
            f"calibration split pools {pooled} ({len(calibration)} sequences): "
            + "; ".join(f"{what} will fall back from {n} states" for what, n in short.items())
            + f". {sequences} calibration sequences of this length fit {mode!r} everywhere."
        ),
        stacklevel=3,
    )


def _without(sample: Subsample | None, left_out: int | None, n_groups: int) -> Subsample | None:
    """``sample`` less the rows of calibration group ``left_out`` (None: as it is)."""
    if sample is None or left_out is None or sample.tensor() is None:
        return sample
    rows, keys = sample.tensor(), sample.groups()
    assert rows is not None and keys is not None
    kept = Subsample(1, 0)
    keep = keys % n_groups != left_out
    kept.rows, kept.keys = rows[keep.to(rows.device)], keys[keep]
    return kept


def fit_translators(
    context: RunContext, calibration: EvaluationSet, leading: dict[int, Tensor] | None = None
) -> tuple[
    dict[str, AffineTranslator | None], list[dict[str, Translator | None]], dict[str, GateRecord]
]:
    """A paired `AffineTranslator` per source of `translator_sources`: the ridge least-squares
    affine map from the source's readout inputs to full depth's states s_r at the same positions
    (`_least_squares`, the ridge chosen on held-out folds), over the pooled positions of the
    leading calibration sequences (at most `TRANSLATOR_POINTS` positions, `translator_rows`),
    or `MeanTranslator` where the held-out gate replaced it (`dcp_lens.protocol.gate.judge`:
    over the calibration groups, or `GATE_FOLDS` folds of the example keys without them). None
    where the source's states are non-finite.

    Returns:
        The translators; per calibration group (``config.calibration_groups`` >= 2, else
        none) the translators fitted with that group's positions left out (the jackknife's);
        and per source the gate's `GateRecord`.

    ``leading`` holds, by calibration batch index, those positions' states [r + 1, n, d_model]
    as the fit stage's pass kept them (`leading_states`); a batch missing from it (after a
    resume, or read by another rank) is recomputed in the same batch, so every rank fits the
    same translators from the same bytes (no merge needed)."""
    wanted = translator_sources(context)
    n_groups = context.config.calibration_groups
    left_out: list[dict[str, Translator | None]] = [{} for _ in range(max(0, n_groups))]
    if n_groups < 2:
        left_out = []
    if not wanted:
        return {}, left_out, {}
    states, example_keys = _leading(context, calibration, leading or {})
    folds = n_groups if left_out else GATE_FOLDS
    group = example_keys % folds
    target = states[-1]
    geometry = None  # the readout's geometry at the mean full-depth state: one for every source
    if all_finite(target):
        geometry = ReadoutGeometry(
            _state_readout(context), target.double().mean(0).to(target.dtype)
        )
    translators: dict[str, AffineTranslator | None] = {}
    gate: dict[str, GateRecord] = {}
    for label, source in wanted.items():
        state = source.readout_input(states)
        each: list[AffineTranslator | None] = []
        if geometry is None or not all_finite(state):
            translators[label] = None
        else:
            with torch.no_grad():
                gate[label] = judge(state, target, group, folds, geometry)
            translators[label], each = _gated_fit(state, target, group, n_groups, gate[label])
        whole = translators[label]
        if left_out and whole is not None:
            for fitted, translator in zip(left_out, each, strict=True):
                fitted[label] = None if translator is None else LeftOutTranslator(whole, translator)
        else:
            for fitted in left_out:
                fitted[label] = None
    return translators, left_out, gate


def _leading(
    context: RunContext, calibration: EvaluationSet, leading: dict[int, Tensor]
) -> tuple[Float[Tensor, "r_plus_1 n d_model"], Int[Tensor, " n"]]:
    """The translators' positions: their states [r + 1, n, d_model] (from ``leading``, a batch
    missing from it recomputed) and each position's example key [n]."""
    n_rows = translator_rows(calibration)
    pieces, keys = [], []
    for index, rows in enumerate(calibration.batches(context.config.batch_size)):
        if rows.start >= n_rows:
            break
        piece = leading.get(index)
        if piece is None:
            tokens = calibration.tokens[rows].to(context.device())
            states, _ = capture_states(context.model, tokens, stop_after_last=True)
            piece = leading_states(context, calibration, rows, states, n_rows)
        pieces.append(piece)
        keys.append(_leading_keys(context, calibration, rows, n_rows))
    states = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
    return states, torch.cat(keys).to(states.device)


def _state_readout(context: RunContext) -> StateReadout:
    return _state_readout_of(context.model)


def _state_readout_of(model: ProtocolModel) -> StateReadout:
    """``model``'s readout of pooled states [n, d_model] -> [n, d_vocab], each position read as
    a sequence of its own (pooled positions come from different sequences)."""

    def readout(states: Tensor) -> Tensor:
        return model.readout(states[:, None, :])[:, 0, :]

    return readout


def _gated_fit(
    state: Float[Tensor, "n d_model"],
    target: Float[Tensor, "n d_model"],
    group: Int[Tensor, " n"],
    n_groups: int,
    gate: GateRecord,
) -> tuple[AffineTranslator | None, list[AffineTranslator | None]]:
    """The translator the gate decided on and its jackknife refits (one per calibration group
    where ``n_groups`` >= 2): at the chosen ridge, or `MeanTranslator` in every one where the
    gate replaced it (not refitted per group, as the base rate's table is not)."""
    if gate.judged == REPLACED:
        constant = MeanTranslator(target.double().mean(0).float())
        return constant, [constant] * (n_groups if n_groups >= 2 else 0)
    ridge = gate.ridge * ridge_scale(state)
    if n_groups >= 2:
        return _least_squares_left_out(state, target, group, n_groups, ridge)
    return _least_squares(state, target, ridge), []


def _leading_keys(
    context: RunContext, calibration: EvaluationSet, rows: slice, n_rows: int
) -> Tensor:
    """The example key of every position `leading_states` keeps of ``rows`` (same order)."""
    rows = slice(rows.start, min(rows.stop, n_rows))
    keep = context.pooled_positions(calibration, rows)
    if not bool(keep.any()):
        keep = torch.ones_like(keep)
    keys = calibration.example_keys()[rows][:, None].expand(keep.shape)
    return keys[keep.cpu()]


def _least_squares(
    source: Float[Tensor, "n d_model"], target: Float[Tensor, "n d_model"], ridge: float
) -> AffineTranslator | None:
    """The affine map h -> h A + c closest to ``target`` in least squares with ``ridge`` on A
    (absolute; the bias c unshrunk), as an `AffineTranslator` (W = (A - I)^T, b = c); None where
    the solution is not finite. Paired, so it can learn any remaining computation that is affine
    in the state: an upper end for S."""
    x = torch.cat([source.double(), torch.ones_like(source[:, :1]).double()], dim=1)
    return _solved(x.T @ x, x.T @ target.double(), source.shape[-1], ridge)


def _least_squares_left_out(
    source: Float[Tensor, "n d_model"],
    target: Float[Tensor, "n d_model"],
    group: Int[Tensor, " n"],
    n_groups: int,
    ridge: float,
) -> tuple[AffineTranslator | None, list[AffineTranslator | None]]:
    """`_least_squares` on every row, and with each group's rows left out in turn, from
    per-group normal equations (each row's products are formed once, not once per group, and
    the whole split's are their sum)."""
    x = torch.cat([source.double(), torch.ones_like(source[:, :1]).double()], dim=1)
    y = target.double()
    grams, moments = [], []
    for g in range(n_groups):
        rows = (group == g).nonzero().squeeze(1)
        x_g = x.index_select(0, rows)
        grams.append(x_g.T @ x_g)
        moments.append(x_g.T @ y.index_select(0, rows))
    gram, moment = torch.stack(grams).sum(0), torch.stack(moments).sum(0)
    d = source.shape[-1]
    whole = _solved(gram, moment, d, ridge)
    return whole, [_solved(gram - grams[g], moment - moments[g], d, ridge) for g in range(n_groups)]


def _solved(gram: Tensor, moment: Tensor, d_model: int, ridge: float) -> AffineTranslator | None:
    """The solution of the normal equations ``gram @ A = moment`` (the last row and column the
    bias's) with ``ridge`` added to the linear part's diagonal, as a translator; None where no
    position is left to fit (a jackknife refit whose group held every translator position: the
    bias's diagonal, the count of positions, is zero) or the solution is not finite.

    With at least one position and a positive ridge the ridged gram is positive definite (its
    Schur complement in the bias is the centred gram plus the ridge); where rounding loses that,
    the minimum-norm solution (a pseudo-inverse) stands in, so a singular gram never raises."""
    if not float(gram[d_model, d_model]) > 0.0:
        return None
    gram = gram.clone()
    gram.diagonal()[:d_model].add_(ridge + 1e-12)
    # The ridged gram is positive definite: a Cholesky solve, cheaper than an LU solve.
    factor, info = torch.linalg.cholesky_ex(gram)
    if int(info) == 0:
        solution = torch.cholesky_solve(moment, factor)
    else:  # lost definiteness to rounding
        solution, info = torch.linalg.solve_ex(gram, moment)
        if int(info) != 0:
            solution = torch.linalg.pinv(gram, hermitian=True) @ moment
    linear, bias = solution[:d_model], solution[d_model]
    weight = (linear - torch.eye(d_model, dtype=linear.dtype, device=linear.device)).T
    if not bool(weight.isfinite().all() and bias.isfinite().all()):
        return None
    return AffineTranslator(d_model, weight.float(), bias.float())  # kept where it was solved


def _fit_map(
    entry: CalibrationMap,
    config: MapSettings,
    source: StreamingMoments,
    reference: StreamingMoments,
    source_sample: Subsample | None,
    reference_sample: Subsample | None,
) -> FittedMap:
    if entry.from_moments is not None:
        return entry.from_moments(source, reference, config)
    assert source_sample is not None and reference_sample is not None
    source_states, reference_states = source_sample.tensor(), reference_sample.tensor()
    assert source_states is not None and reference_states is not None
    return entry.from_states(source_states, reference_states, config)


def _fit_null(
    entry: CalibrationMap,
    config: MapSettings,
    sample: Subsample,
    halves: list[StreamingMoments] | None,
) -> FittedMap | None:
    """The calibration null: from the moments of even and odd examples' full-depth states where
    the map is fitted from moments, else from the probe's subsample (`_fit_halves`)."""
    if halves is None or entry.from_moments is None:
        return _fit_halves(entry, config, sample)
    if min(halves[0].count, halves[1].count) < 8:
        return None
    try:
        return entry.from_moments(halves[0], halves[1], config)
    except ValueError:
        return None


def _fit_halves(entry: CalibrationMap, config: MapSettings, sample: Subsample) -> FittedMap | None:
    """The real calibration null: the same kind of map fitted between two disjoint halves
    of the calibration split's full-depth states (even and odd examples). It should leave
    full depth's readout as it is; `calibrate(full)` fitted onto itself is the identity by
    construction and tests nothing."""
    states, groups = sample.tensor(), sample.groups()
    if states is None or groups is None or not bool(states.isfinite().all()):
        return None
    even = groups.to(states.device) % 2 == 0
    if int(even.sum()) < 8 or int((~even).sum()) < 8:
        return None
    try:
        return entry.from_states(states[even], states[~even], config)
    except ValueError:
        return None


def apply_map(mapping: FittedMap | None, state: Tensor) -> Tensor:
    """``mapping(state)``, or NaN where no calibration could be fitted."""
    return mapping(state) if mapping is not None else torch.full_like(state, math.nan)


class _Pending:
    """Stands in for a map while `sources` asks the sweep what to fit."""

    def __call__(self, h: Tensor) -> Tensor:
        return h

    def inverse(self) -> _Pending:
        return self


class _Wanted:
    """The `MapLookup` `sources` hands the sweep's builders: it records what they ask for."""

    def __init__(self, r: int) -> None:
        self.r = r
        self.maps: dict[str, Condition] = {"full": Full()}
        self.translators: dict[str, Condition] = {}
        self.wants_base_rate = False

    def __call__(self, source: Condition) -> _Pending:
        source = source.at_depth(self.r)
        self.maps.setdefault(source.label, source)
        return _Pending()

    def translator(self, source: Condition) -> Callable[[Tensor], Tensor]:
        source = source.at_depth(self.r)
        if not isinstance(source, Full):
            self.translators.setdefault(source.label, source)
        return _identity

    @property
    def base_rate(self) -> Tensor:
        self.wants_base_rate = True
        return torch.zeros(1, 1)


def _identity(h: Tensor) -> Tensor:
    return h
