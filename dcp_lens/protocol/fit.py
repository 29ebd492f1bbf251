"""The fit stage: every calibration map the sweep's conditions ask for, fitted label-free on the
calibration split (streaming moments, or subsamples of states for a map fitted to states), the
calibration null, and the probe's reference states. Hands a `FittedMaps` to the later stages."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from jaxtyping import Float
from torch import Tensor

from dcp_lens.protocol.calibration import (
    CALIBRATION_MAPS,
    CalibrationMap,
    StateMap,
    StreamingMoments,
    all_finite,
)
from dcp_lens.protocol.conditions import SWEEP, Condition, Full
from dcp_lens.protocol.confidence import ConfidenceMatching
from dcp_lens.protocol.context import RunContext
from dcp_lens.protocol.evaluation_set import EvaluationSet
from dcp_lens.protocol.states import capture_states
from dcp_lens.protocol.subsample import Subsample, row_ids
from dcp_lens.protocol.translator import AffineTranslator
from dcp_lens.utils import distributed

# The paired translators of the S bracket's upper end (`fit_translators`): the least-squares
# affine map from each source's readout inputs to the same positions' full-depth states (closed
# form), on at most this many calibration positions (the leading sequences of the calibration
# split, kept from the fit stage's own pass).
TRANSLATOR_POINTS = 2048
TRANSLATOR_RIDGE = 1e-4  # the least squares' ridge, relative to the mean square of a column


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
    """

    maps: dict[str, StateMap | None]
    null: StateMap | None
    probe_reference: Tensor | None
    mode: str
    n_iterations: int
    translators: dict[str, AffineTranslator | None] = field(default_factory=dict)

    def __call__(self, source: Condition) -> StateMap | None:
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

    def fitted(self, source: Condition) -> StateMap | None:
        """The map fitted from ``source``'s readout inputs to full depth's (None: non-finite)."""
        label = source.at_depth(self.n_iterations).label
        if label not in self.maps:
            raise KeyError(
                f"no calibration was fitted from {label}; fitted: {sorted(self.maps)}. Fit "
                "again after changing k_grid or the registered sweep conditions."
            )
        return self.maps[label]

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
    conditions = sources(context)
    # One stream of moments per source; a stream that ever turns non-finite (replay can
    # explode) is dropped, and the conditions that need it are reported as non-finite.
    streams: dict[str, StreamingMoments | None] = {
        label: StreamingMoments() for label in conditions
    }
    samples = {
        label: Subsample(config.calibration_points, config.seed + 7 + i)
        for i, label in enumerate(conditions if entry.needs_states else ())
    }
    sample = Subsample(config.probe_points, config.seed)
    calibration_keys = calibration.example_keys()
    batches = distributed.assigned(calibration.batches(config.batch_size))
    done, saved = context.restore("calibration")
    if saved is not None:
        streams = {
            label: None if state is None else StreamingMoments.from_state(state)
            for label, state in saved["streams"].items()
        }
        for label, state in saved["samples"].items():
            samples[label].restore(state)
        sample.restore(saved["sample"])
    matching = confidence is not None
    if confidence is not None:
        confidence.stash = {}
    # The translators' leading positions of each batch this pass reads (`fit_translators`).
    leading: dict[int, Tensor] = {}
    n_leading = translator_rows(calibration)
    for batch_number, (index, rows) in enumerate(
        context.each(batches[done:], "calibration"), start=done
    ):
        # Only the states: the maps are fitted to readout inputs, not to logits.
        states, _ = capture_states(
            context.model, calibration.tokens[rows].to(device), stop_after_last=True
        )
        pieces = None
        if confidence is not None and matching:
            pieces = confidence.pieces(calibration, index, rows)
            matching = pieces is not None  # past the budget, later batches are not read
            if pieces:
                confidence.stash[index] = confidence.keep(states, pieces, rows.start)
        if rows.start < n_leading:
            leading[index] = _leading_states(context, calibration, rows, states, n_leading)
        keep = context.pooled_positions(calibration, rows)
        pooled = states[:, keep]  # [r + 1, n_tokens, d]
        example, position = row_ids(calibration_keys[rows], keep)
        sample.add(pooled[r], example, position)
        for label, moments in streams.items():
            if moments is None:
                continue
            state = conditions[label].readout_input(pooled)
            if all_finite(state):
                moments.update(state)
                if entry.needs_states:
                    samples[label].add(state, example, position)
            else:
                streams[label] = None
        context.snapshot(
            "calibration", batch_number + 1, len(batches),
            lambda: {
                "streams": {n: None if m is None else m.state() for n, m in streams.items()},
                "samples": {label: s.state() for label, s in samples.items()},
                "sample": sample.state(),
            },
        )  # fmt: skip
    if distributed.rank_and_world()[1] > 1:
        streams, samples, sample = _merged_fit(streams, samples, sample, device)
    reference = streams["full"]
    maps = {
        label: None
        if source is None or reference is None
        else _fit_map(entry, config, source, reference, samples.get(label), samples.get("full"))
        for label, source in streams.items()
    }
    translators = fit_translators(context, calibration, leading)
    return FittedMaps(maps, _fit_halves(entry, config, sample), sample.tensor(),
                      config.calibration_mode, r, translators)  # fmt: skip


def fit_translators(
    context: RunContext, calibration: EvaluationSet, leading: dict[int, Tensor] | None = None
) -> dict[str, AffineTranslator | None]:
    """A paired `AffineTranslator` per source of `translator_sources`: the ridge least-squares
    affine map from the source's readout inputs to full depth's states s_r at the same positions
    (`_least_squares`), over the pooled positions of the leading calibration sequences (at most
    `TRANSLATOR_POINTS` positions, `translator_rows`). None where the source's states are
    non-finite.

    ``leading`` holds, by calibration batch index, those positions' states [r + 1, n, d_model]
    as the fit stage's pass kept them (`_leading_states`); a batch missing from it (after a
    resume, or read by another rank) is recomputed in the same batch, so every rank fits the
    same translators from the same bytes (no merge needed)."""
    wanted = translator_sources(context)
    if not wanted:
        return {}
    n_rows, leading = translator_rows(calibration), leading or {}
    pieces = []
    for index, rows in enumerate(calibration.batches(context.config.batch_size)):
        if rows.start >= n_rows:
            break
        piece = leading.get(index)
        if piece is None:
            tokens = calibration.tokens[rows].to(context.device())
            states, _ = capture_states(context.model, tokens, stop_after_last=True)
            piece = _leading_states(context, calibration, rows, states, n_rows)
        pieces.append(piece)
    states = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)  # [r + 1, n, d_model]
    target = states[-1].double()
    translators: dict[str, AffineTranslator | None] = {}
    for label, source in wanted.items():
        state = source.readout_input(states)
        translators[label] = (
            _least_squares(state, target) if all_finite(state) and all_finite(target) else None
        )
    return translators


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


def _least_squares(
    source: Float[Tensor, "n d_model"], target: Float[Tensor, "n d_model"]
) -> AffineTranslator | None:
    """The affine map h -> h A + c closest to ``target`` in least squares (a ridge of
    `TRANSLATOR_RIDGE` times the mean square of ``source``'s columns), as an `AffineTranslator`
    (W = (A - I)^T, b = c); None where the solution is not finite. Paired, so it can learn any
    remaining computation that is affine in the state: an upper end for S."""
    d_model = source.shape[-1]
    x = torch.cat([source.double(), torch.ones_like(source[:, :1]).double()], dim=1)
    # The normal equations' two products in one (one pass over x).
    products = x.T @ torch.cat([x, target.double()], dim=1)  # [d + 1, d + 1 + d]
    gram, cross = products[:, : d_model + 1], products[:, d_model + 1 :]
    ridge = TRANSLATOR_RIDGE * float(gram.diagonal().mean()) + 1e-12
    gram.diagonal().add_(ridge)
    solution = torch.linalg.solve(gram, cross)
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
) -> StateMap:
    if entry.from_moments is not None:
        return entry.from_moments(source, reference, config)  # type: ignore[arg-type]
    assert source_sample is not None and reference_sample is not None
    source_states, reference_states = source_sample.tensor(), reference_sample.tensor()
    assert source_states is not None and reference_states is not None
    return entry.from_states(source_states, reference_states, config)  # type: ignore[arg-type]


def _fit_halves(entry: CalibrationMap, config: object, sample: Subsample) -> StateMap | None:
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


def apply_map(mapping: StateMap | None, state: Tensor) -> Tensor:
    """``mapping(state)``, or NaN where no calibration could be fitted."""
    return mapping(state) if mapping is not None else torch.full_like(state, math.nan)


def _merged_fit(
    streams: dict[str, StreamingMoments | None],
    samples: dict[str, Subsample],
    sample: Subsample,
    device: torch.device,
) -> tuple[dict[str, StreamingMoments | None], dict[str, Subsample], Subsample]:
    """`fit_maps`'s moments and subsamples merged over every rank, in rank order on every rank
    (so every rank fits the same maps), on ``device``. A stream that turned non-finite on any
    rank is dropped."""
    parts = distributed.all_gather((streams, samples, sample))
    merged: dict[str, StreamingMoments | None] = {}
    for label in streams:
        each = [part[0][label] for part in parts]
        total: StreamingMoments | None = None
        if all(moments is not None for moments in each):
            total = StreamingMoments()
            for moments in each:
                total.merge(moments)
        merged[label] = distributed.moved(total, device)
    merged_samples = {
        label: distributed.moved(Subsample.merged([part[1][label] for part in parts]), device)
        for label in samples
    }
    probe = distributed.moved(Subsample.merged([part[2] for part in parts]), device)
    return merged, merged_samples, probe


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

    def __call__(self, source: Condition) -> _Pending:
        source = source.at_depth(self.r)
        self.maps.setdefault(source.label, source)
        return _Pending()

    def translator(self, source: Condition) -> Callable[[Tensor], Tensor]:
        source = source.at_depth(self.r)
        if not isinstance(source, Full):
            self.translators.setdefault(source.label, source)
        return _identity


def _identity(h: Tensor) -> Tensor:
    return h
