"""What the fit stage accumulates over the calibration split, as accumulators that `add` a batch,
give their `state` for a ``--resume`` snapshot, `restore` one, and are merged over the processes
of a data-parallel run: each source's moments per calibration group (`GroupMoments`), full
depth's predicted distributions (`BaseRateSums`), and all of them with the subsamples a map, the
probe and the calibration null are fitted from (`CalibrationAccumulator`). The translators' leading
states (`LeadingStates`) are kept beside them, never snapshotted."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict, TypeVar

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from dcp_lens.protocol.budget import (
    TRANSLATOR_POINTS,
    ReadoutPlan,
    group_buffer_rows,
    moment_bytes,
    stage_stop_message,
)
from dcp_lens.protocol.calibration import (
    CalibrationMap,
    MomentsState,
    StreamingMoments,
    all_finite,
)
from dcp_lens.protocol.conditions import Condition, position_bucket
from dcp_lens.protocol.context import RunContext
from dcp_lens.protocol.evaluation_set import EvaluationSet
from dcp_lens.protocol.metrics import IGNORE_INDEX
from dcp_lens.protocol.states import capture_states
from dcp_lens.protocol.subsample import Subsample, SubsampleState, row_ids
from dcp_lens.utils import distributed
from dcp_lens.utils.devices import copy_without_wait
from dcp_lens.utils.errors import ResourceLimitError
from dcp_lens.utils.snapshots import SnapshotFieldError, snapshot_field, snapshot_value

# The paired translators of the S bracket's upper end are fitted on at most this many
# calibration positions (the leading sequences of the calibration split, `translator_rows`).

_Item = TypeVar("_Item")


def moments_host(context: RunContext) -> torch.device | None:
    """Where a calibration group's moments wait while another group is filled: the host, for a
    run with calibration groups on an accelerator in one process (the device then holds one
    group's moments per source, not every group's); None otherwise (every group stays where the
    states are: on the CPU the host is the device)."""
    if context.config.calibration_groups < 2 or context.device().type == "cpu":
        return None
    return None if distributed.rank_and_world()[1] > 1 else torch.device("cpu")


def group_major(
    calibration: EvaluationSet, batch_size: int, n_groups: int, leading_rows: int
) -> EvaluationSet:
    """``calibration`` in the order a pass with parked groups reads it: the batches holding the
    first ``leading_rows`` sequences as they are (the translators and confidence matching read
    the leading sequences), then the rest by calibration group (example key mod ``n_groups``),
    each group in its own order. The groups and every record but the float rounding of the
    moments' sums do not depend on the order."""
    n = len(calibration)
    front = min(n, -(-leading_rows // batch_size) * batch_size)
    rest = torch.arange(front, n)
    group = calibration.example_keys()[rest] % max(1, n_groups)
    order = torch.cat([torch.arange(front), rest[torch.argsort(group, stable=True)]])
    return calibration.reordered(order)


class GroupMoments:
    """One source's streamed moments per calibration group (example key mod the groups; the
    groups merge into the whole split's). A group's states wait in a buffer until there are
    enough for one update (small groups of a batch would make many tiny updates). Once the
    source's states turn non-finite (replay can explode) its moments are dropped: ``groups`` is
    None, and the conditions that need it are reported non-finite."""

    def __init__(
        self, n_groups: int, storage: torch.dtype, host: torch.device | None = None
    ) -> None:
        # With groups, each group's scatter is kept in float32 (a group is only ever subtracted
        # from the float64 whole they merge into); alone, the one group is the whole (float64).
        self.storage = storage
        self.groups: list[StreamingMoments] | None = [
            StreamingMoments(storage) for _ in range(n_groups)
        ]
        self.pending: list[list[Tensor]] = [[] for _ in range(n_groups)]
        # With a ``host``, one group at a time is filled on the states' device (``resident``);
        # the others wait on the host, their moments and their stray rows (``parked``), so the
        # device holds one group's moments, not every group's (`group_major` orders the pass).
        self.host = host
        self.resident: int | None = None
        self.parked: list[list[Tensor]] = [[] for _ in range(n_groups)]
        self.compute: torch.device | None = None

    def add(
        self, state: Float[Tensor, "n d"], present: list[tuple[int, Bool[Tensor, " n"]]], rows: int
    ) -> bool:
        """Buffer ``state``'s rows of each group present, folding every resident group's buffer
        into its moments once they hold ``rows`` per resident group between them (so the rows
        waiting are bounded by that, whatever the groups' shares of the batches); returns whether
        ``state`` was finite (else drops). With a host, the group with most of the rows becomes
        the resident one first, and the other groups' rows are parked on the host."""
        if self.groups is None:
            return False
        if not all_finite(state):
            self.groups = None
            return False
        if self.host is not None and present:
            self.compute = state.device
            most = max(present, key=lambda item: int(item[1].sum()))[0]
            if most != self.resident:
                self._make_resident(most)
        for g, rows_of_group in present:
            if self.host is not None and g != self.resident:
                self.parked[g].append(copy_without_wait(state[rows_of_group], self.host))
                continue
            self.pending[g].append(state[rows_of_group])
        resident = 1 if self.host is not None else len(self.pending)
        if sum(len(x) for waiting in self.pending for x in waiting) >= rows * resident:
            for g in range(len(self.pending)):
                self._fold_pending(g)
        return True

    def _make_resident(self, group: int) -> None:
        """Fill ``group`` on the compute device from now on: the resident group's moments go
        to the host, ``group``'s come to the device with its parked rows folded in."""
        assert self.groups is not None and self.host is not None and self.compute is not None
        if self.resident is not None:
            self._fold_pending(self.resident)
            self.groups[self.resident] = self.groups[self.resident].to(self.host)
        self.groups[group] = self.groups[group].to(self.compute)
        self.resident = group
        if self.parked[group]:
            self.groups[group].update(self._parked_rows(group))
            self.parked[group] = []

    def _parked_rows(self, group: int) -> Tensor:
        """``group``'s parked rows on the compute device (each piece copied back without the host
        waiting: the stream runs it after the copy that parked it)."""
        assert self.compute is not None
        return torch.cat([copy_without_wait(rows, self.compute) for rows in self.parked[group]])

    def _fold_pending(self, group: int) -> None:
        if self.pending[group] and self.groups is not None:
            self.groups[group].update(torch.cat(self.pending[group]))
        self.pending[group] = []

    def flush(self) -> None:
        """Fold every group's waiting states into its moments (a parked group's on the compute
        device, the result merged into its moments on the host)."""
        for g in range(len(self.pending)):
            self._fold_pending(g)
            if self.parked[g] and self.groups is not None and self.compute is not None:
                assert self.host is not None
                part = StreamingMoments(self.storage)
                part.update(self._parked_rows(g))
                moments = self.groups[g]
                moments.merge(part.to(self.host))
                self.groups[g] = moments.to(self.host)
            self.parked[g] = []

    def state(self) -> list[MomentsState] | None:
        """The groups' moments, their buffers folded in first."""
        self.flush()
        return None if self.groups is None else [g.state() for g in self.groups]

    def restore(self, state: object, field: str = "groups") -> None:
        """The groups' moments ``state`` recorded (``field``: where it sits in its snapshot);
        None or one moments per group, else `SnapshotFieldError`."""
        saved = snapshot_value(state, field, "optional list")
        if saved is not None and len(saved) != len(self.pending):
            raise SnapshotFieldError(field, f"a list of {len(self.pending)} groups' moments", state)
        moments = [
            StreamingMoments.from_state(s, self.storage, f"{field}[{g}]")
            for g, s in enumerate(saved or ())
        ]
        self.groups = None if saved is None else moments
        if self.host is not None and self.groups is not None:
            self.groups = [moments.to(self.host) for moments in self.groups]
            self.resident = None

    @classmethod
    def merged(cls, parts: Sequence[GroupMoments]) -> GroupMoments:
        """The groups' moments over every part, merged group by group in float64 (None where any
        part's turned non-finite); the parts' buffers are flushed."""
        groups = [part.groups for part in parts]
        merged = cls(len(groups[0] or ()), torch.float64)
        if any(each is None for each in groups):
            merged.groups = None
            return merged
        total = [StreamingMoments() for _ in groups[0] or ()]
        for each in groups:
            for g, moments in enumerate(each or ()):
                total[g].merge(moments)
        merged.groups = total
        return merged

    def total(self) -> StreamingMoments | None:
        """Every group's moments merged (None where there are none); a group is left out later
        by subtraction (`left_out`)."""
        if self.groups is None:
            return None
        total = StreamingMoments()
        for moments in self.groups:  # one group at a time on the compute device
            total.merge(moments if self.compute is None else moments.to(self.compute))
        return total if total.count else None

    def left_out(self, total: StreamingMoments | None, group: int) -> StreamingMoments | None:
        """``total`` (every group merged) less ``group``'s moments, prepared as the jackknife's
        refit of this source within ``total`` (`StreamingMoments.for_refit`: ``total``'s
        eigenvalue floor, and its span or a float32 decomposition)."""
        if total is None or self.groups is None:
            return total
        rest = total.without(self.groups[group])
        return None if rest is None else rest.for_refit(total)

    def release(self) -> None:
        self.groups = None


class BaseRateState(TypedDict):
    sums: Tensor | None
    counts: Tensor


class BaseRateSums:
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

    def add(
        self, full_logits: Float[Tensor, "n pos d_vocab"], keys: Int[Tensor, " n"], rows: slice
    ) -> None:
        """Fold one chunk of full depth's logits (the examples ``rows``, their keys ``keys``)
        into the sums, on the logits' device (no copy to the host)."""
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

    def state(self) -> BaseRateState:
        return {"sums": self.sums, "counts": self.counts}

    def restore(self, state: object, field: str = "base") -> None:
        self.sums = snapshot_field(state, "sums", field, "optional tensor")
        self.counts = snapshot_field(state, "counts", field, "tensor")

    def merge(self, other: BaseRateSums) -> None:
        if other.sums is None:
            return
        if self.sums is None:
            self.sums, self.counts = other.sums.clone(), other.counts.clone()
            return
        self.sums = self.sums + other.sums.to(self.sums.device)
        self.counts = self.counts + other.counts.to(self.counts.device)


class CalibrationState(TypedDict):
    streams: dict[str, list[MomentsState] | None]
    samples: dict[str, SubsampleState]
    sample: SubsampleState
    base: BaseRateState | None
    halves: list[MomentsState] | None


class CalibrationAccumulator:
    """Everything the calibration pass accumulates: per source condition (by label) its moments
    per group (`GroupMoments`) and, for a map fitted to states, its subsample; the probe's
    reference subsample of full depth's states; the moments of even and odd examples' full-depth
    states (``halves``, the calibration null of a map fitted from moments); and full depth's
    predicted distributions (the base-rate control) where a sweep condition reads them."""

    def __init__(
        self,
        context: RunContext,
        calibration: EvaluationSet,
        conditions: dict[str, Condition],
        entry: CalibrationMap,
        wants_base_rate: bool,
        host: torch.device | None = None,
    ) -> None:
        config = context.config
        self.conditions = conditions
        self.n_groups = max(1, config.calibration_groups)
        self.host = host  # where groups not being filled wait (`moments_host`)
        self.device = context.device()
        storage = torch.float32 if self.n_groups >= 2 else torch.float64
        self.streams = {label: GroupMoments(self.n_groups, storage, host) for label in conditions}
        self.samples = {
            label: Subsample(config.calibration_points, config.seed + 7 + i)
            for i, label in enumerate(conditions if entry.needs_states else ())
        }
        self.sample = Subsample(config.probe_points, config.seed)
        self.halves: list[StreamingMoments] | None = None
        # The null's map is fitted from every calibration state (a map fitted from moments), not
        # from the probe's subsample; each rank would hold only its own batches: under torchrun
        # the merged subsample fits it.
        if entry.from_moments and distributed.rank_and_world()[1] == 1:
            self.halves = [StreamingMoments(), StreamingMoments()]
        self.base = BaseRateSums(1, calibration) if wants_base_rate else None
        self.buffer_rows = 0  # set from the states' width on the first batch

    def base_part(
        self,
        context: RunContext,
        calibration: EvaluationSet,
        rows: slice,
        states: Float[Tensor, "r_plus_1 batch pos d_model"],
        plan: ReadoutPlan,
    ) -> BaseRateSums | None:
        """One calibration batch's base-rate sums (rows ``rows``, full depth's readout in chunks
        of examples, ``plan``), apart from the records' own: `add` folds them in, so a batch that
        runs out of memory here leaves the records as they were. None without a base rate."""
        if self.base is None:
            return None
        part, keys = BaseRateSums(self.base.n_groups, calibration), calibration.example_keys()
        for chunk in plan.example_chunks(rows.stop - rows.start):
            chunk_rows = slice(rows.start + chunk.start, rows.start + chunk.stop)
            full_logits = context.model.readout(states[context.r][chunk])
            part.add(full_logits, keys[chunk_rows], chunk_rows)
            del full_logits
        return part

    def add(
        self,
        context: RunContext,
        calibration: EvaluationSet,
        rows: slice,
        states: Float[Tensor, "r_plus_1 batch pos d_model"],
        base: BaseRateSums | None = None,
    ) -> None:
        """Fold one calibration batch's states (rows ``rows``) and its base-rate sums (``base``,
        `base_part`) into every record."""
        r, keys = context.r, calibration.example_keys()
        if not self.buffer_rows:  # before any moments are held
            width = int(states.shape[-1])
            self.buffer_rows = group_buffer_rows(width)
            on_device = 1 if self.host is not None else self.n_groups
            full = context.config.calibration_mode == "full"
            positions = int(states[0].numel()) // width
            check_moment_memory(
                len(self.conditions),
                self.n_groups,
                width,
                on_device,
                positions,
                context.budget(),
                context.device(),
                full,
                states.element_size(),
            )
        keep = context.pooled_positions(calibration, rows)
        pooled = states[:, keep]  # [r + 1, n_tokens, d]
        if self.base is not None and base is not None:
            self.base.merge(base)
        example, position = row_ids(keys[rows], keep)
        self.sample.add(pooled[r], example, position)
        if self.halves is not None and not all_finite(pooled[r]):
            self.halves = None  # the null falls back to the probe's subsample, which says so
        if self.halves is not None:  # full depth's states by example parity
            even = (example % 2 == 0).to(pooled.device)
            self.halves[0].update(pooled[r][even])
            self.halves[1].update(pooled[r][~even])
        group = (example % self.n_groups).to(pooled.device)
        present = [(g, group == g) for g in range(self.n_groups) if bool((group == g).any())]
        for label, moments in self.streams.items():
            if moments.groups is None:
                continue
            state = self.conditions[label].readout_input(pooled)
            if moments.add(state, present, self.buffer_rows) and label in self.samples:
                self.samples[label].add(state, example, position)

    def flush(self) -> None:
        for moments in self.streams.values():
            moments.flush()

    def state(self) -> CalibrationState:
        return {
            "streams": {label: moments.state() for label, moments in self.streams.items()},
            "samples": {label: s.state() for label, s in self.samples.items()},
            "sample": self.sample.state(),
            "base": None if self.base is None else self.base.state(),
            "halves": None if self.halves is None else [h.state() for h in self.halves],
        }

    def restore(self, state: object) -> None:
        """What ``state`` recorded; a field missing or of the wrong type (a string where a count
        belongs, a condition this run does not have) raises `SnapshotFieldError` naming it."""
        streams = snapshot_field(state, "streams", "state", "dict")
        samples = snapshot_field(state, "samples", "state", "dict")
        for label, moments in streams.items():
            self._own(self.streams, label, "state.streams").restore(
                moments, f"state.streams[{label!r}]"
            )
        for label, sample in samples.items():
            self._own(self.samples, label, "state.samples").restore(
                sample, f"state.samples[{label!r}]"
            )
        self.sample.restore(snapshot_field(state, "sample", "state", "dict"), "state.sample")
        base = snapshot_field(state, "base", "state", "optional dict")
        if self.base is not None and base is not None:
            self.base.restore(base, "state.base")
        halves = snapshot_field(state, "halves", "state", "optional list")
        if self.halves is not None:
            if halves is not None and len(halves) != 2:
                raise SnapshotFieldError("state.halves", "None or the moments of 2 halves", halves)
            self.halves = (
                None
                if halves is None
                else [
                    StreamingMoments.from_state(h, field=f"state.halves[{i}]")
                    for i, h in enumerate(halves)
                ]
            )
        if self.host is not None:  # read on the host: all but the groups' moments to the device
            self._to_device()

    def _to_device(self) -> None:
        """The subsamples, base-rate sums and halves on the records' device (the groups' moments
        stay where they are: `GroupMoments` brings one group at a time, to this device even
        where no batch is left to read)."""
        for moments in self.streams.values():
            moments.compute = self.device
        for sample in (*self.samples.values(), self.sample):
            if sample.rows is not None:
                sample.rows = sample.rows.to(self.device)
        if self.base is not None and self.base.sums is not None:
            self.base.sums = self.base.sums.to(self.device)
            self.base.counts = self.base.counts.to(self.device)
        if self.halves is not None:
            self.halves = [half.to(self.device) for half in self.halves]

    @staticmethod
    def _own(records: dict[str, _Item], label: object, field: str) -> _Item:
        """``records[label]``, else `SnapshotFieldError` (a condition this run does not have)."""
        if not isinstance(label, str) or label not in records:
            raise SnapshotFieldError(f"{field} key", f"one of {sorted(records)}", label)
        return records[label]

    def merge_processes(self, device: torch.device) -> None:
        """Every rank's moments (per group), subsamples and base-rate sums merged in rank order
        on every rank (so every rank fits the same maps), on ``device``. A source whose states
        turned non-finite on any rank is dropped."""
        parts: list[CalibrationAccumulator] = distributed.all_gather(self)
        for label in self.streams:
            merged = GroupMoments.merged([part.streams[label] for part in parts])
            self.streams[label] = distributed.moved(merged, device)
        for label in self.samples:
            merged_sample = Subsample.merged([part.samples[label] for part in parts])
            self.samples[label] = distributed.moved(merged_sample, device)
        self.sample = distributed.moved(Subsample.merged([p.sample for p in parts]), device)
        self.base = parts[0].base  # every part is a copy: merge into the first
        for part in parts[1:]:
            if self.base is not None and part.base is not None:
                self.base.merge(part.base)


@dataclass(frozen=True)
class PassChunks:
    """How the calibration pass cuts one batch of ``batch`` sequences of ``positions`` tokens:
    ``sequences`` per forward, full depth's readout for the base rate by ``plan``."""

    sequences: int
    plan: ReadoutPlan
    batch: int
    positions: int

    def halved(self) -> PassChunks | None:
        """Half the sequences per forward and half the readout rows (None: one sequence and one
        example's readout already)."""
        plan = self.plan.halved(self.batch, self.positions) or self.plan
        if self.sequences <= 1 and plan is self.plan:
            return None
        return dataclasses.replace(self, sequences=max(1, self.sequences // 2), plan=plan)


def read_batch(
    context: RunContext,
    calibration: EvaluationSet,
    rows: slice,
    records: CalibrationAccumulator,
    chunks: PassChunks,
) -> tuple[Float[Tensor, "r_plus_1 batch pos d_model"], BaseRateSums | None]:
    """One calibration batch's states, its forward run ``chunks.sequences`` sequences at a time,
    and its base-rate sums (`CalibrationAccumulator.base_part`): nothing of the records changes."""
    tokens, device = calibration.tokens[rows], context.device()
    states: Tensor | None = None
    for start in range(0, len(tokens), chunks.sequences):
        stop = min(len(tokens), start + chunks.sequences)
        # Only the states: the maps are fitted to readout inputs, not to logits.
        part, _ = capture_states(context.model, tokens[start:stop].to(device), stop_after_last=True)
        if stop - start == len(tokens):
            states = part
            break
        if states is None:
            states = part.new_empty((part.shape[0], len(tokens), *part.shape[2:]))
        states[:, start:stop] = part
        del part
    assert states is not None
    return states, records.base_part(context, calibration, rows, states, chunks.plan)


def pass_stop(context: RunContext, rows: slice, chunks: PassChunks) -> str:
    return stage_stop_message(
        "calibration",
        str(context.device()),
        f"running one sequence per forward (sequences {rows.start}-{rows.stop - 1})",
        "Every finished calibration batch is kept (with a --resume snapshot folder).",
        f"--batch-size {max(1, context.config.batch_size // 2)} (the batch size is fixed for a "
        "run) or --calibration-groups 0 (no jackknife moments)",
    )


def fold_stop(context: RunContext, rows: slice) -> str:
    return stage_stop_message(
        "calibration",
        str(context.device()),
        f"after reading sequences {rows.start}-{rows.stop - 1}, while folding them into the "
        "moments",
        "--resume continues from the last calibration snapshot (the records had changed part "
        "way through this batch, so it was not snapshotted).",
        "--calibration-groups 0 (no jackknife moments) or a shorter --k grid",
    )


class LeadingStates:
    """The translators' leading calibration positions of each batch the calibration pass reads
    (by batch index), so that `fit_translators` needs no forward pass of its own. Not
    snapshotted nor merged: a batch missing here (after a resume, or read by another rank) is
    recomputed from the same bytes."""

    def __init__(self, calibration: EvaluationSet) -> None:
        self.rows = translator_rows(calibration)
        self.states: dict[int, Tensor] = {}

    def add(
        self,
        context: RunContext,
        calibration: EvaluationSet,
        index: int,
        rows: slice,
        states: Float[Tensor, "r_plus_1 batch pos d_model"],
    ) -> None:
        if rows.start < self.rows:
            self.states[index] = leading_states(context, calibration, rows, states, self.rows)


def translator_rows(calibration: EvaluationSet) -> int:
    """How many leading calibration sequences the translators are fitted on: as many whole
    sequences as `TRANSLATOR_POINTS` positions hold (at least one)."""
    length = max(1, int(calibration.tokens.shape[1]))
    return max(1, min(len(calibration), TRANSLATOR_POINTS // length))


def leading_states(
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


def check_moment_memory(
    n_streams: int,
    n_groups: int,
    width: int,
    resident: int,
    batch_positions: int,
    budget: int | None,
    device: torch.device,
    full: bool = True,
    element_bytes: int = 4,
) -> None:
    """Refuse, before the calibration pass, a fit whose moments
    (`dcp_lens.protocol.budget.moment_bytes`: ``resident`` of ``n_groups`` groups on
    ``device``, their waiting rows at ``element_bytes``) would alone take more than the run's
    ``budget`` (bytes, `RunContext.budget`: read once when the run starts; None where the
    device does not say), with what to change. The whole estimate is checked against the
    same budget before any batch (`DepthControlProtocol`); this names the moments' share."""
    needed = moment_bytes(
        n_streams, n_groups, width, resident, batch_positions, full, element_bytes
    )
    if budget and needed > budget:
        single = moment_bytes(n_streams, 1, width, 1, batch_positions, full, element_bytes)
        raise ResourceLimitError(
            f"the calibration fit would hold {needed / 2**30:.1f} GiB of moments ({n_streams} "
            f"conditions x {resident} of {n_groups} calibration groups on the device, "
            f"{width} wide, float32 with the groups, float64 alone), more "
            f"than the run's budget of {budget / 2**30:.1f} GiB on {device}. "
            f"Pass fewer calibration groups (--calibration-groups 0 turns the jackknife off: "
            f"{single / 2**30:.1f} GiB) or a shorter --k grid."
        )
