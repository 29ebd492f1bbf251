"""The fit stage: every calibration map the sweep's conditions ask for, fitted label-free on the
calibration split (streaming moments, or subsamples of states for a map fitted to states), the
calibration null, and the probe's reference states. Hands a `FittedMaps` to the later stages."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from dcp_lens.protocol.budget import device_memory_bytes
from dcp_lens.protocol.calibration import (
    CALIBRATION_MAPS,
    MIN_STATES,
    CalibrationFallbackWarning,
    CalibrationMap,
    FittedMap,
    StreamingMoments,
    all_finite,
)
from dcp_lens.protocol.conditions import SWEEP, Condition, Full, position_bucket
from dcp_lens.protocol.confidence import ConfidenceMatching
from dcp_lens.protocol.context import RunContext
from dcp_lens.protocol.evaluation_set import EvaluationSet
from dcp_lens.protocol.jackknife import LeftOutAffine, LeftOutTranslator
from dcp_lens.protocol.metrics import IGNORE_INDEX
from dcp_lens.protocol.states import capture_states
from dcp_lens.protocol.subsample import Subsample, row_ids
from dcp_lens.protocol.translator import AffineTranslator
from dcp_lens.utils import distributed
from dcp_lens.utils.errors import ResourceLimitError

# The paired translators of the S bracket's upper end (`fit_translators`): the least-squares
# affine map from each source's readout inputs to the same positions' full-depth states (closed
# form), on at most this many calibration positions (the leading sequences of the calibration
# split, kept from the fit stage's own pass).
TRANSLATOR_POINTS = 2048
TRANSLATOR_RIDGE = 1e-4  # the least squares' ridge, relative to the mean square of a column
# A calibration group's states are folded into its moments once this many have come: fewer
# for wide states (about 1 MB of float32 rows a buffer), at least 64 (an update's own d x d work
# is then small beside its product).
GROUP_BUFFER_ROWS = 4096
GROUP_BUFFER_ELEMENTS = 2**18
# The fit refuses to start when its moments would take more than this share of the free memory.
MOMENT_MEMORY_SHARE = 0.5


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
    """

    maps: dict[str, FittedMap | None]
    null: FittedMap | None
    probe_reference: Tensor | None
    mode: str
    n_iterations: int
    translators: dict[str, Any] = field(default_factory=dict)
    base_rate: Tensor | None = None
    jackknife: list[FittedMaps] = field(default_factory=list)
    states: dict[str, int] = field(default_factory=dict)

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

    def fitted_record(self) -> dict[str, dict[str, Any]]:
        """Per map (and the null): the states it was fitted from and the mode it was fitted in
        (None where it could not be fitted), as results record them."""
        record: dict[str, dict[str, Any]] = {
            label: {"states": self.states.get(label, 0), "mode": getattr(m, "mode", None)}
            for label, m in self.maps.items()
        }
        record["calibration_null"] = {"mode": getattr(self.null, "mode", None)}
        return record

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
    config, r, device = context.config, context.r, context.device()
    entry = CALIBRATION_MAPS[config.calibration_mode]
    wanted = _wanted(context)
    conditions = wanted.maps
    n_groups = max(1, config.calibration_groups)
    # One stream of moments per source and calibration group (example key mod n_groups; the
    # groups' moments merge into the whole split's); a stream that ever turns non-finite
    # (replay can explode) is dropped, and the conditions that need it reported non-finite.
    # With groups, each group's scatter is kept in float32 (a group is only ever subtracted from
    # the float64 whole they merge into); alone, the one group is the whole, kept in float64.
    storage = torch.float32 if n_groups >= 2 else torch.float64
    streams: dict[str, list[StreamingMoments] | None] = {
        label: [StreamingMoments(storage) for _ in range(n_groups)] for label in conditions
    }
    samples = {
        label: Subsample(config.calibration_points, config.seed + 7 + i)
        for i, label in enumerate(conditions if entry.needs_states else ())
    }
    sample = Subsample(config.probe_points, config.seed)
    # Moments of full depth's states of even and odd examples: the null's map is fitted from
    # every calibration state (a map fitted from moments), not from the probe's subsample.
    halves = [StreamingMoments(), StreamingMoments()] if entry.from_moments else None
    if distributed.rank_and_world()[1] > 1:
        halves = None  # each rank would hold only its own batches: the merged subsample fits it
    announce_fallbacks(context, calibration, config.calibration_mode)
    base = _BaseRateSums(1, calibration) if wanted.wants_base_rate else None
    # Each group's states wait here until there are enough for one update (small groups of a
    # batch would make many tiny updates).
    pending: dict[str, list[list[Tensor]]] = {
        label: [[] for _ in range(n_groups)] for label in conditions
    }
    buffer_rows = 0  # set from the states' width on the first batch, with the memory check
    calibration_keys = calibration.example_keys()
    batches = distributed.assigned(calibration.batches(config.batch_size))
    done, saved = context.restore("calibration")
    if saved is not None:
        streams = {
            label: None
            if states is None
            else [StreamingMoments.from_state(s, storage) for s in states]
            for label, states in saved["streams"].items()
        }
        for label, state in saved["samples"].items():
            samples[label].restore(state)
        sample.restore(saved["sample"])
        if base is not None and saved.get("base") is not None:
            base.restore(saved["base"])
        if halves is not None and saved.get("halves") is not None:
            halves = [StreamingMoments.from_state(state) for state in saved["halves"]]
    matching = confidence is not None
    if confidence is not None:
        confidence.stash = {}
    # The translators' leading positions of each batch this pass reads (`fit_translators`).
    leading: dict[int, Tensor] = {}
    n_leading = translator_rows(calibration)
    plan = context.readout_plan(calibration)
    for batch_number, (index, rows) in enumerate(
        context.each(batches[done:], "calibration"), start=done
    ):
        # Only the states: the maps are fitted to readout inputs, not to logits.
        states, _ = capture_states(
            context.model, calibration.tokens[rows].to(device), stop_after_last=True
        )
        if not buffer_rows:  # before any moments are held
            width = int(states.shape[-1])
            buffer_rows = max(64, min(GROUP_BUFFER_ROWS, GROUP_BUFFER_ELEMENTS // max(1, width)))
            check_moment_memory(len(conditions), n_groups, width, buffer_rows, device)
        pieces = None
        if confidence is not None and matching:
            pieces = confidence.pieces(calibration, index, rows)
            matching = pieces is not None  # past the budget, later batches are not read
            if pieces:
                confidence.stash[index] = confidence.keep(states, pieces, rows.start)
        if base is not None:  # full depth's readout in chunks of examples, summed on the device
            for chunk in plan.example_chunks(rows.stop - rows.start):
                chunk_rows = slice(rows.start + chunk.start, rows.start + chunk.stop)
                full_logits = context.model.readout(states[r][chunk])
                base.add(full_logits, calibration_keys[chunk_rows], chunk_rows)
                del full_logits
        if rows.start < n_leading:
            leading[index] = _leading_states(context, calibration, rows, states, n_leading)
        keep = context.pooled_positions(calibration, rows)
        pooled = states[:, keep]  # [r + 1, n_tokens, d]
        example, position = row_ids(calibration_keys[rows], keep)
        sample.add(pooled[r], example, position)
        if halves is not None and not all_finite(pooled[r]):
            halves = None  # the null falls back to the probe's subsample, which says so
        if halves is not None:  # full depth's states by example parity: the calibration null
            even = (example % 2 == 0).to(pooled.device)
            halves[0].update(pooled[r][even])
            halves[1].update(pooled[r][~even])
        group = (example % n_groups).to(pooled.device)
        present = [(g, group == g) for g in range(n_groups) if bool((group == g).any())]
        for label, moments in streams.items():
            if moments is None:
                continue
            state = conditions[label].readout_input(pooled)
            if all_finite(state):
                for g, rows_of_group in present:
                    pending[label][g].append(state[rows_of_group])
                    if sum(len(x) for x in pending[label][g]) >= buffer_rows:
                        moments[g].update(torch.cat(pending[label][g]))
                        pending[label][g] = []
                if entry.needs_states:
                    samples[label].add(state, example, position)
            else:
                streams[label] = None
        context.snapshot(
            "calibration", batch_number + 1, len(batches),
            lambda: {
                "streams": _flushed(streams, pending) and {
                    n: None if m is None else [g.state() for g in m] for n, m in streams.items()
                },
                "samples": {label: s.state() for label, s in samples.items()},
                "sample": sample.state(),
                "base": None if base is None else base.state(),
                "halves": _halves_state(halves),  # noqa: B023 (called now, in this batch)
            },
        )  # fmt: skip
    _flushed(streams, pending)
    if distributed.rank_and_world()[1] > 1:
        streams, samples, sample, base = _merged_fit(streams, samples, sample, base, device)

    totals = {label: _merge_groups(groups) for label, groups in streams.items()}

    def fitted_maps(left_out: int | None) -> dict[str, FittedMap | None]:
        merged = {
            label: _left_out(totals[label], groups, left_out) for label, groups in streams.items()
        }
        reference = merged["full"]
        maps: dict[str, FittedMap | None] = {}
        for label, source in merged.items():
            try:
                maps[label] = None if source is None or reference is None else _fit_map(
                    entry, config, source, reference,
                    _without(samples.get(label), left_out, n_groups),
                    _without(samples.get("full"), left_out, n_groups),
                )  # fmt: skip
            except ValueError:
                if left_out is None:
                    raise
                maps[label] = None  # too few states without the group: no jackknife cell
        return maps

    translators, left_out_translators = fit_translators(context, calibration, leading)
    maps = FittedMaps(
        fitted_maps(None), _fit_null(entry, config, sample, halves), sample.tensor(),
        config.calibration_mode, r, translators, None if base is None else base.table(),
    )  # fmt: skip
    maps.states = {label: 0 if total is None else total.count for label, total in totals.items()}
    populated = sum(bool(m.count) for m in (streams.get("full") or []))
    if config.calibration_groups >= 2 and populated >= 2:
        left_out_maps = _refit_left_out(context, entry, streams, totals, samples, maps.maps)
        for g in range(n_groups):
            maps.jackknife.append(
                FittedMaps(
                    left_out_maps[g],
                    None,
                    None,
                    config.calibration_mode,
                    r,
                    left_out_translators[g],
                    maps.base_rate,  # the base rate is not refitted: see `_BaseRateSums.table`
                )  # fmt: skip
            )
    return maps


def _refit_left_out(
    context: RunContext,
    entry: CalibrationMap,
    streams: dict[str, list[StreamingMoments] | None],
    totals: dict[str, StreamingMoments | None],
    samples: dict[str, Subsample],
    whole: dict[str, FittedMap | None],
) -> list[dict[str, FittedMap | None]]:
    """Every map refitted with each calibration group left out, one stream at a time: full
    depth's left-out moments are formed once per group, each other stream's group moments are
    released once its refits are done, and each refit is held as a difference from the whole
    split's map (`LeftOutAffine`). None where a refit cannot be fitted (too few states)."""
    config, n_groups = context.config, max(1, context.config.calibration_groups)
    references = [_left_out(totals["full"], streams["full"], g) for g in range(n_groups)]
    refits: list[dict[str, FittedMap | None]] = [{} for _ in range(n_groups)]
    labels = [label for label in streams if label != "full"] + ["full"]
    with warnings.catch_warnings():  # the whole split's fit already said so
        warnings.simplefilter("ignore")
        for label in context.each(labels, "jackknife fits"):
            for g, reference in enumerate(references):
                source = (
                    reference if label == "full" else _left_out(totals[label], streams[label], g)
                )
                fitted: FittedMap | None = None
                if source is not None and reference is not None:
                    try:
                        fitted = _fit_map(
                            entry, config, source, reference,
                            _without(samples.get(label), g, n_groups),
                            _without(samples.get("full"), g, n_groups),
                        )  # fmt: skip
                    except ValueError:
                        fitted = None  # too few states without the group: no jackknife cell
                refits[g][label] = (
                    None if fitted is None else LeftOutAffine.of(whole[label], fitted)
                )
            if label != "full":  # its groups' moments are no longer needed
                streams[label], totals[label] = None, None
    return [{label: refit[label] for label in whole} for refit in refits]


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


def moment_bytes(n_streams: int, n_groups: int, width: int, buffer_rows: int) -> int:
    """Bytes the fit stage's moments hold: per stream and calibration group, a float64 d x d
    scatter and its vectors, and up to ``buffer_rows`` float32 states waiting; per stream the
    whole split's merged moments once more."""
    per_moments = 8 * (width * width + 3 * width)
    waiting = 4 * buffer_rows * width
    return n_streams * (n_groups * (per_moments + waiting) + per_moments)


def check_moment_memory(
    n_streams: int, n_groups: int, width: int, buffer_rows: int, device: torch.device
) -> None:
    """Refuse, before the calibration pass, a fit whose moments (`moment_bytes`) would take more
    than `MOMENT_MEMORY_SHARE` of ``device``'s free memory, with what to change."""
    needed = moment_bytes(n_streams, n_groups, width, buffer_rows)
    # What the device can give, PyTorch's cached memory included (it is reused before the
    # driver is asked): memory a notebook's earlier work left cached does not count as taken.
    free = device_memory_bytes(device) or 0
    if free and needed > MOMENT_MEMORY_SHARE * free:
        single = moment_bytes(n_streams, 1, width, buffer_rows)
        raise ResourceLimitError(
            f"the calibration fit would hold {needed / 2**30:.1f} GiB of moments ({n_streams} "
            f"conditions x {n_groups} calibration groups of {width} x {width} float64), more "
            f"than {MOMENT_MEMORY_SHARE:.0%} of the {free / 2**30:.1f} GiB free on {device}. "
            f"Pass fewer calibration groups (--calibration-groups 0 turns the jackknife off: "
            f"{single / 2**30:.1f} GiB) or a shorter --k grid."
        )


def _flushed(
    streams: dict[str, list[StreamingMoments] | None], pending: dict[str, list[list[Tensor]]]
) -> bool:
    """Fold every group's waiting states into its moments (dropped for a non-finite stream)."""
    for label, groups in pending.items():
        moments = streams[label]
        for g, waiting in enumerate(groups):
            if waiting and moments is not None:
                moments[g].update(torch.cat(waiting))
            groups[g] = []
    return True


class _BaseRateSums:
    """Full depth's predicted distributions summed per calibration group and position bucket
    (`position_bucket`) over scored positions: the base rate's table, whole or with one group
    left out."""

    def __init__(self, n_groups: int, calibration: EvaluationSet) -> None:
        self.n_groups = n_groups
        self.targets = calibration.targets
        length = int(calibration.tokens.shape[1])
        self.buckets = position_bucket(torch.arange(length))
        self.n_buckets = int(self.buckets.max()) + 1 if length else 1
        self.sums: Tensor | None = None  # [n_groups, n_buckets, d_vocab] float64
        self.counts = torch.zeros(n_groups, self.n_buckets, dtype=torch.float64)

    def add(self, full_logits: Tensor, keys: Tensor, rows: slice) -> None:
        """Fold one chunk of full depth's logits ``[n, pos, d_vocab]`` (the examples ``rows``,
        their keys ``keys``) into the sums, on the logits' device (no copy to the host)."""
        device = full_logits.device
        probs = full_logits.float().softmax(-1)
        scored = (self.targets[rows] != IGNORE_INDEX).to(device)
        if self.sums is None:
            self.sums = torch.zeros(
                self.n_groups, self.n_buckets, probs.shape[-1], dtype=torch.float64, device=device
            )
            self.counts = self.counts.to(device)
        buckets = self.buckets[: probs.shape[1]].to(device)
        group = keys.to(device) % self.n_groups
        for g in range(self.n_groups):
            weight = (scored & (group == g)[:, None]).to(probs.dtype)
            total = torch.einsum("npv,np->pv", probs, weight).double()  # [pos, d_vocab]
            self.sums[g].index_add_(0, buckets, total)
            self.counts[g].index_add_(0, buckets, weight.sum(0).double())

    def table(self) -> Tensor | None:
        """``[n_buckets, d_vocab]`` log mean distribution; a bucket with no scored position takes
        the mean over every position.

        The jackknife keeps this table for every left-out group: the base rate is a discount,
        and the accuracy of a near-tied mode read on a tenth of the evaluation examples jumps
        when the mode flips, a spread of that subsample rather than of the fit."""
        if self.sums is None:
            return None
        sums, counts = self.sums.sum(0), self.counts.sum(0)
        overall = sums.sum(0) / counts.sum().clamp(min=1.0)
        mean = torch.where(
            counts[:, None] > 0, sums / counts.clamp(min=1.0)[:, None], overall[None]
        )
        return mean.clamp(min=1e-12).log().float()

    def state(self) -> dict[str, Tensor | None]:
        return {"sums": self.sums, "counts": self.counts}

    def restore(self, state: dict[str, Tensor | None]) -> None:
        self.sums, counts = state["sums"], state["counts"]
        assert counts is not None
        self.counts = counts

    def merge(self, other: _BaseRateSums) -> None:
        if other.sums is None:
            return
        if self.sums is None:
            self.sums, self.counts = other.sums.clone(), other.counts.clone()
            return
        self.sums = self.sums + other.sums.to(self.sums.device)
        self.counts = self.counts + other.counts.to(self.counts.device)


def _merge_groups(groups: list[StreamingMoments] | None) -> StreamingMoments | None:
    """Every group's moments merged (None where there are none); a group is left out later by
    subtraction (`_left_out`)."""
    if groups is None:
        return None
    total = StreamingMoments()
    for moments in groups:
        total.merge(moments)
    return total if total.count else None


def _left_out(
    total: StreamingMoments | None, groups: list[StreamingMoments] | None, left_out: int | None
) -> StreamingMoments | None:
    """``total`` (every group merged) less group ``left_out``'s moments, to be decomposed in float32
    (`StreamingMoments.for_refit`): the jackknife's refit of one stream. ``total`` itself where
    ``left_out`` is None."""
    if total is None or groups is None or left_out is None:
        return total
    rest = total.without(groups[left_out])
    return None if rest is None else rest.for_refit()


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
) -> tuple[dict[str, AffineTranslator | None], list[dict[str, Any]]]:
    """A paired `AffineTranslator` per source of `translator_sources`: the ridge least-squares
    affine map from the source's readout inputs to full depth's states s_r at the same positions
    (`_least_squares`), over the pooled positions of the leading calibration sequences (at most
    `TRANSLATOR_POINTS` positions, `translator_rows`). None where the source's states are
    non-finite.

    Returns:
        The translators, and per calibration group (``config.calibration_groups`` >= 2, else
        none) the translators fitted with that group's positions left out (the jackknife's).

    ``leading`` holds, by calibration batch index, those positions' states [r + 1, n, d_model]
    as the fit stage's pass kept them (`_leading_states`); a batch missing from it (after a
    resume, or read by another rank) is recomputed in the same batch, so every rank fits the
    same translators from the same bytes (no merge needed)."""
    wanted = translator_sources(context)
    n_groups = context.config.calibration_groups
    left_out: list[dict[str, Any]] = [{} for _ in range(max(0, n_groups))]
    if n_groups < 2:
        left_out = []
    if not wanted:
        return {}, left_out
    n_rows, leading = translator_rows(calibration), leading or {}
    pieces, keys = [], []
    for index, rows in enumerate(calibration.batches(context.config.batch_size)):
        if rows.start >= n_rows:
            break
        piece = leading.get(index)
        if piece is None:
            tokens = calibration.tokens[rows].to(context.device())
            states, _ = capture_states(context.model, tokens, stop_after_last=True)
            piece = _leading_states(context, calibration, rows, states, n_rows)
        pieces.append(piece)
        keys.append(_leading_keys(context, calibration, rows, n_rows))
    states = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)  # [r + 1, n, d_model]
    group = torch.cat(keys).to(states.device) % max(1, n_groups)
    target = states[-1]
    translators: dict[str, AffineTranslator | None] = {}
    for label, source in wanted.items():
        state = source.readout_input(states)
        finite = all_finite(state) and all_finite(target)
        if finite and left_out:
            # The whole split's normal equations are the groups' summed: formed once for both.
            translators[label], each = _least_squares_left_out(state, target, group, n_groups)
        else:
            translators[label], each = (_least_squares(state, target) if finite else None), []
        whole = translators[label]
        if left_out and whole is not None:
            for fitted, translator in zip(left_out, each, strict=True):
                fitted[label] = None if translator is None else LeftOutTranslator(whole, translator)
        else:
            for fitted in left_out:
                fitted[label] = None
    return translators, left_out


def translator_rows(calibration: EvaluationSet) -> int:
    """How many leading calibration sequences the translators are fitted on: as many whole
    sequences as `TRANSLATOR_POINTS` positions hold (at least one)."""
    length = max(1, int(calibration.tokens.shape[1]))
    return max(1, min(len(calibration), TRANSLATOR_POINTS // length))


def _leading_states(
    context: RunContext,
    calibration: EvaluationSet,
    rows: slice,
    states: Float[Tensor, "r_plus_1 batch pos d_model"],
    n_rows: int,
) -> Float[Tensor, "r_plus_1 n d_model"]:
    """The states of ``rows``' (one calibration batch) sequences below ``n_rows`` at their pooled
    positions (every position where none is pooled), a copy."""
    rows = slice(rows.start, min(rows.stop, n_rows))
    keep = context.pooled_positions(calibration, rows)
    if not bool(keep.any()):
        keep = torch.ones_like(keep)
    return states[:, : rows.stop - rows.start][:, keep]


def _leading_keys(
    context: RunContext, calibration: EvaluationSet, rows: slice, n_rows: int
) -> Tensor:
    """The example key of every position `_leading_states` keeps of ``rows`` (same order)."""
    rows = slice(rows.start, min(rows.stop, n_rows))
    keep = context.pooled_positions(calibration, rows)
    if not bool(keep.any()):
        keep = torch.ones_like(keep)
    keys = calibration.example_keys()[rows][:, None].expand(keep.shape)
    return keys[keep.cpu()]


def _least_squares(
    source: Float[Tensor, "n d_model"], target: Float[Tensor, "n d_model"]
) -> AffineTranslator | None:
    """The affine map h -> h A + c closest to ``target`` in least squares (a ridge of
    `TRANSLATOR_RIDGE` times the mean square of ``source``'s columns), as an `AffineTranslator`
    (W = (A - I)^T, b = c); None where the solution is not finite. Paired, so it can learn any
    remaining computation that is affine in the state: an upper end for S."""
    x = torch.cat([source.double(), torch.ones_like(source[:, :1]).double()], dim=1)
    return _solved(x.T @ x, x.T @ target.double(), source.shape[-1])


def _least_squares_left_out(
    source: Float[Tensor, "n d_model"],
    target: Float[Tensor, "n d_model"],
    group: Int[Tensor, " n"],
    n_groups: int,
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
    d_model = source.shape[-1]
    whole = _solved(gram, moment, d_model)
    return whole, [_solved(gram - grams[g], moment - moments[g], d_model) for g in range(n_groups)]


def _solved(gram: Tensor, moment: Tensor, d_model: int) -> AffineTranslator | None:
    """The ridge solution of the normal equations ``gram @ A = moment`` as a translator."""
    gram = gram.clone()
    ridge = TRANSLATOR_RIDGE * float(gram.diagonal().mean()) + 1e-12
    gram.diagonal().add_(ridge)
    # The ridged gram is positive definite: a Cholesky solve, about half an LU solve's time.
    factor, info = torch.linalg.cholesky_ex(gram)
    if int(info) == 0:
        solution = torch.cholesky_solve(moment, factor)
    else:  # lost definiteness to rounding
        solution = torch.linalg.solve(gram, moment)
    linear, bias = solution[:d_model], solution[d_model]
    weight = (linear - torch.eye(d_model, dtype=linear.dtype, device=linear.device)).T
    if not bool(weight.isfinite().all() and bias.isfinite().all()):
        return None
    return AffineTranslator(d_model, weight.float().cpu(), bias.float().cpu())


def _fit_map(
    entry: CalibrationMap,
    config: object,
    source: StreamingMoments,
    reference: StreamingMoments,
    source_sample: Subsample | None,
    reference_sample: Subsample | None,
) -> FittedMap:
    if entry.from_moments is not None:
        return entry.from_moments(source, reference, config)  # type: ignore[arg-type]
    assert source_sample is not None and reference_sample is not None
    source_states, reference_states = source_sample.tensor(), reference_sample.tensor()
    assert source_states is not None and reference_states is not None
    return entry.from_states(source_states, reference_states, config)  # type: ignore[arg-type]


def _halves_state(halves: list[StreamingMoments] | None) -> list[dict[str, Any]] | None:
    return None if halves is None else [h.state() for h in halves]


def _fit_null(
    entry: CalibrationMap,
    config: object,
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
        return entry.from_moments(halves[0], halves[1], config)  # type: ignore[arg-type]
    except ValueError:
        return None


def _fit_halves(entry: CalibrationMap, config: object, sample: Subsample) -> FittedMap | None:
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
        return entry.from_states(states[even], states[~even], config)  # type: ignore[arg-type]
    except ValueError:
        return None


def apply_map(mapping: FittedMap | None, state: Tensor) -> Tensor:
    """``mapping(state)``, or NaN where no calibration could be fitted."""
    return mapping(state) if mapping is not None else torch.full_like(state, math.nan)


def _merged_fit(
    streams: dict[str, list[StreamingMoments] | None],
    samples: dict[str, Subsample],
    sample: Subsample,
    base: _BaseRateSums | None,
    device: torch.device,
) -> tuple[
    dict[str, list[StreamingMoments] | None], dict[str, Subsample], Subsample, _BaseRateSums | None
]:
    """`fit_maps`'s moments (per group), subsamples and base-rate sums merged over every rank, in
    rank order on every rank (so every rank fits the same maps), on ``device``. A stream that
    turned non-finite on any rank is dropped."""
    parts = distributed.all_gather((streams, samples, sample, base))
    merged: dict[str, list[StreamingMoments] | None] = {}
    for label in streams:
        each = [part[0][label] for part in parts]
        total: list[StreamingMoments] | None = None
        if all(groups is not None for groups in each):
            total = [StreamingMoments() for _ in each[0]]
            for groups in each:
                for g, moments in enumerate(groups):
                    total[g].merge(moments)
        merged[label] = distributed.moved(total, device)
    merged_samples = {
        label: distributed.moved(Subsample.merged([part[1][label] for part in parts]), device)
        for label in samples
    }
    probe = distributed.moved(Subsample.merged([part[2] for part in parts]), device)
    merged_base = parts[0][3]  # every part is a copy: merge into the first
    for part in parts[1:]:
        if merged_base is not None:
            merged_base.merge(part[3])
    return merged, merged_samples, probe, merged_base


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


UNBOUNDED_MAP_REASON = (
    "the calibration map {mode!r} can carry out remaining computation itself (it moves each state"
    " anywhere on full depth's marginal), so its gain is no lower bound on readout shift and S is"
    " not identified; run with an affine map (--calibration-mode full) for a verdict."
)


def bounded(decomposition: Any, mode: str) -> Any:
    """``decomposition`` as it is where calibration map ``mode`` bounds S from below; else with
    S unidentified at every k and the verdict inconclusive (`CalibrationMap.lower_bound`)."""
    shares = decomposition.bracket_shares
    if shares is None or CALIBRATION_MAPS[mode].lower_bound:
        return decomposition
    reason = UNBOUNDED_MAP_REASON.format(mode=mode)
    shares = {**shares, "S_identified": False, "verdict": "inconclusive",
              "reason": f"{reason} {shares.get('reason', '')}".strip()}  # fmt: skip
    unidentified = np.zeros_like(np.asarray(decomposition.s_identified, dtype=bool))
    return dataclasses.replace(decomposition, bracket_shares=shares, s_identified=unidentified)
