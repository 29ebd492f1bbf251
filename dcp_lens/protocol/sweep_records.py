"""What the sweep stage accumulates over its evaluation batches, as accumulators that `add` a
batch, give their `state` for a ``--resume`` snapshot, `restore` one, and are `merged` over the
processes of a data-parallel run: per-example cells (`ExampleCellsAccumulator`), running maxima
(`MaximaAccumulator`), the null control (`NullControlAccumulator`), the probe's subsamples
(`ProbeSampleAccumulator`), and all of them together (`SweepAccumulator`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypedDict, TypeVar

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from dcp_lens.protocol.calibration import FittedMap
from dcp_lens.protocol.conditions import Full, Truncate
from dcp_lens.protocol.fit import FittedMaps, apply_map
from dcp_lens.protocol.probe import ProbeSamples
from dcp_lens.protocol.subsample import Subsample, SubsampleState, row_ids
from dcp_lens.utils.devices import on_host_together
from dcp_lens.utils.snapshots import (
    FieldKind,
    SnapshotFieldError,
    snapshot_field,
    snapshot_key,
    snapshot_numbers,
    snapshot_value,
)

# Per metric: ``"full"`` -> [n] and per sweep condition {k: [n]} (float64, per example).
Values = dict[str, dict[str, Any]]
# A metric's per-example cell: (metric, condition, k); full depth's is (metric, "full", 0).
CellKey = tuple[str, str, int]
# A `walk_fractions` record: (kind, k).
WalkKey = tuple[str, int]
# A jackknife cell: (left-out calibration group, metric, condition, k).
JackknifeKey = tuple[int, str, str, int]
# The kinds of these keys' parts, as a snapshot must hold them.
CELL_KEY: tuple[FieldKind, ...] = ("str", "str", "count")
WALK_KEY: tuple[FieldKind, ...] = ("str", "count")
JACKKNIFE_KEY: tuple[FieldKind, ...] = ("count", "str", "str", "count")
Key = TypeVar("Key", bound=Hashable)


def nan_max(a: float, b: float) -> float:
    """max(a, b), NaN if either is NaN: a non-finite null control never reads as passing."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def nan_max_all(values: Iterable[float]) -> float:
    """The maximum of ``values``, NaN if any is NaN (see `nan_max`)."""
    result = -math.inf
    for value in values:
        result = nan_max(result, value)
    return result


class ExampleCellsAccumulator(Generic[Key]):
    """Per-example values by key, one chunk per evaluation batch (its index in the evaluation):
    `vectors` joins each key's chunks in batch order, whichever process read which batch."""

    def __init__(self) -> None:
        self.chunks: dict[Key, dict[int, Tensor]] = {}

    def add(self, batch: int, cells: Mapping[Key, Sequence[Tensor]]) -> None:
        """Batch ``batch``'s cells, each key's chunks of examples joined."""
        for key, chunks in cells.items():
            self.chunks.setdefault(key, {})[batch] = torch.cat(list(chunks))

    def state(self) -> list[tuple[Key, dict[int, Tensor]]]:
        return list(self.chunks.items())

    def restore(
        self,
        state: object,
        field: str = "cells",
        key: Sequence[FieldKind] = (),
    ) -> None:
        """The chunks ``state`` recorded (``field``: where it sits in its snapshot), each key a
        tuple of ``key``'s kinds (any key without ``key``), each chunk a tensor by batch index;
        else `SnapshotFieldError`."""
        self.chunks = {}
        for i, entry in enumerate(snapshot_value(state, field, "list")):
            pair = snapshot_value(entry, f"{field}[{i}]", "list")
            if len(pair) != 2:
                raise SnapshotFieldError(f"{field}[{i}]", "a (key, chunks) pair", entry)
            name = snapshot_key(pair[0], f"{field}[{i}] key", key) if key else pair[0]
            chunks = snapshot_value(pair[1], f"{field}[{i}] chunks", "dict")
            self.chunks[name] = {
                snapshot_value(batch, f"{field}[{i}] batch", "count"): snapshot_value(
                    chunk, f"{field}[{i}][{batch!r}]", "tensor"
                )
                for batch, chunk in chunks.items()
            }

    @classmethod
    def merged(
        cls, parts: Sequence[ExampleCellsAccumulator[Key]], device: torch.device
    ) -> ExampleCellsAccumulator[Key]:
        """Every part's chunks (each batch read by one part), on ``device``."""
        merged: ExampleCellsAccumulator[Key] = cls()
        for part in parts:
            for key, chunks in part.chunks.items():
                for batch, chunk in chunks.items():
                    merged.chunks.setdefault(key, {})[batch] = chunk.to(device)
        return merged

    def vectors(self) -> dict[Key, Float[Tensor, " n"]]:
        """Per key, its chunks joined in batch order: float64 on the CPU."""
        joined = {
            key: torch.cat([chunks[b] for b in sorted(chunks)]).double()
            for key, chunks in self.chunks.items()
        }
        return on_host_together(joined)  # one transfer, not one per key


class MaximaAccumulator(Generic[Key]):
    """The largest value seen per key (from 0), NaN once any is NaN (`nan_max`)."""

    def __init__(self, keys: Iterable[Key] = ()) -> None:
        self.values: dict[Key, float] = dict.fromkeys(keys, 0.0)

    def add(self, values: Mapping[Key, float]) -> None:
        for key, value in values.items():
            self.values[key] = nan_max(self.values.get(key, 0.0), value)

    def state(self) -> dict[Key, float]:
        return dict(self.values)

    def restore(self, state: object, field: str, key: FieldKind) -> None:
        """The maxima ``state`` recorded, numbers by keys of ``key``; else `SnapshotFieldError`
        (``field``: where ``state`` sits in its snapshot)."""
        self.values = snapshot_numbers(state, field, key)

    @classmethod
    def merged(cls, parts: Sequence[MaximaAccumulator[Key]]) -> MaximaAccumulator[Key]:
        merged: MaximaAccumulator[Key] = cls()
        for key in {key: None for part in parts for key in part.values}:
            merged.values[key] = nan_max_all(p.values[key] for p in parts if key in p.values)
        return merged


class NullState(TypedDict):
    differences: dict[str, float]
    halves_difference: float
    halves_change: dict[str, float]


class ProbeState(TypedDict):
    held_out: SubsampleState
    trajectory: list[SubsampleState]
    calibrated: dict[int, SubsampleState]


# The null control as results record it: largest differences, and per-metric changes.
NullRecord = dict[str, float | dict[str, float]]


@dataclass
class BatchNull:
    """One evaluation batch's side of the null control (`NullControlAccumulator`)."""

    differences: dict[str, float]
    halves_difference: float
    halves_change: dict[str, float]


class NullControlAccumulator:
    """The null control over the batches: per condition that must reproduce full depth at
    k = r, its largest |logit difference| from full depth's; the same for full depth's states
    under the calibration null's map, and each metric's change under it summed over examples."""

    def __init__(self, names: Iterable[str]) -> None:
        self.differences = MaximaAccumulator(names)
        self.halves_difference = 0.0
        self.halves_change: dict[str, float] = {}

    def add(self, batch: BatchNull) -> None:
        self.differences.add(batch.differences)
        self.halves_difference = nan_max(self.halves_difference, batch.halves_difference)
        self._sum(batch.halves_change)

    def _sum(self, change: Mapping[str, float]) -> None:
        for metric, value in change.items():
            self.halves_change[metric] = self.halves_change.get(metric, 0.0) + value

    def state(self) -> NullState:
        return {
            "differences": self.differences.state(),
            "halves_difference": self.halves_difference,
            "halves_change": dict(self.halves_change),
        }

    def restore(self, state: object, field: str = "null") -> None:
        differences = snapshot_field(state, "differences", field, "dict")
        self.differences.restore(differences, f"{field}.differences", "str")
        self.halves_difference = snapshot_field(state, "halves_difference", field, "number")
        change = snapshot_field(state, "halves_change", field, "dict")
        self.halves_change = snapshot_numbers(change, f"{field}.halves_change", "str")

    @classmethod
    def merged(cls, parts: Sequence[NullControlAccumulator]) -> NullControlAccumulator:
        merged = cls(())
        merged.differences = MaximaAccumulator.merged([part.differences for part in parts])
        merged.halves_difference = nan_max_all(part.halves_difference for part in parts)
        for part in parts:
            merged._sum(part.halves_change)
        return merged

    def record(self, n: int, metrics: Sequence[str], maps: FittedMaps) -> NullRecord:
        """The null control as results record it (over ``n`` examples)."""
        null = dict(self.differences.values)
        full_map = maps.fitted(Full())
        return {
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
                self.halves_difference if maps.null is not None else math.nan
            ),
            "calibrate_full_halves_metric_change": {
                metric: self.halves_change.get(metric, math.nan) / n for metric in metrics
            },
        }


def _rows(
    states: Float[Tensor, "r_plus_1 batch pos d_model"], t: int, among: Int[Tensor, " n"]
) -> Callable[[Tensor], Tensor]:
    """The rows of s_t at the flat (example, position) indices ``among[index]``."""
    flat = states[t].reshape(-1, states.shape[-1])

    def rows(index: Tensor) -> Tensor:
        return flat[among[index.to(among.device)]]

    return rows


def _mapped(
    mapping: FittedMap | None, rows: Callable[[Tensor], Tensor]
) -> Callable[[Tensor], Tensor]:
    return lambda index: apply_map(mapping, rows(index))


class ProbeSampleAccumulator:
    """The probe's subsamples of the evaluation's states (`ProbeSamples`): full depth's states
    of even examples (the held-out reference), and of odd examples every s_t and
    calibrate(truncate(k)) at every k of the grid. A two-sample test needs independent samples,
    not two views of the same sequences; and each state keeps its example, since the C2ST splits
    by example (the positions of one sequence share its content)."""

    def __init__(self, points: int, seed: int, r: int, k_grid: Sequence[int]) -> None:
        self.held_out = Subsample(points, seed + 1)
        self.trajectory = [Subsample(points, seed + 2 + t) for t in range(r + 1)]
        self.calibrated = {k: Subsample(points, seed + 1000 + k) for k in k_grid}

    def add(
        self,
        states: Float[Tensor, "r_plus_1 batch pos d_model"],
        keep: Bool[Tensor, "batch pos"],
        keys: Int[Tensor, " batch"],
        maps: FittedMaps,
    ) -> None:
        """Sample the pooled positions ``keep`` of one batch's ``states`` (its examples' keys).
        Only the rows a subsample keeps are copied (and mapped): what this holds beside the
        batch is the subsamples, not a copy of the batch's states."""
        example, position = row_ids(keys, keep)
        even = example % 2 == 0
        r = len(self.trajectory) - 1
        pooled = keep.flatten().nonzero().squeeze(1)  # flat (example, position) of each row
        held, probed = pooled[even.to(pooled.device)], pooled[(~even).to(pooled.device)]
        self.held_out.add_selected(_rows(states, r, held), example[even], position[even])
        probed_examples, probed_positions = example[~even], position[~even]
        for t, subsample in enumerate(self.trajectory):
            subsample.add_selected(_rows(states, t, probed), probed_examples, probed_positions)
        for k, subsample in self.calibrated.items():
            mapped = _mapped(maps.fitted(Truncate(k)), _rows(states, k, probed))
            subsample.add_selected(mapped, probed_examples, probed_positions)

    def state(self) -> ProbeState:
        return {
            "held_out": self.held_out.state(),
            "trajectory": [s.state() for s in self.trajectory],
            "calibrated": {k: s.state() for k, s in self.calibrated.items()},
        }

    def restore(self, state: object, field: str = "probe") -> None:
        self.held_out.restore(snapshot_field(state, "held_out", field, "dict"), f"{field}.held_out")
        trajectory = snapshot_field(state, "trajectory", field, "list")
        if len(trajectory) != len(self.trajectory):
            expected = f"a list of {len(self.trajectory)} subsamples (t = 0..r)"
            raise SnapshotFieldError(f"{field}.trajectory", expected, trajectory)
        for t, (subsample, saved) in enumerate(zip(self.trajectory, trajectory, strict=True)):
            subsample.restore(saved, f"{field}.trajectory[{t}]")
        for k, saved in snapshot_field(state, "calibrated", field, "dict").items():
            if type(k) is not int or k not in self.calibrated:
                expected = f"a k of the grid {sorted(self.calibrated)}"
                raise SnapshotFieldError(f"{field}.calibrated key", expected, k)
            self.calibrated[k].restore(saved, f"{field}.calibrated[{k}]")

    @classmethod
    def merged(cls, parts: Sequence[ProbeSampleAccumulator]) -> ProbeSampleAccumulator:
        merged = object.__new__(cls)
        merged.held_out = Subsample.merged([part.held_out for part in parts])
        merged.trajectory = [
            Subsample.merged([part.trajectory[t] for part in parts])
            for t in range(len(parts[0].trajectory))
        ]
        merged.calibrated = {
            k: Subsample.merged([part.calibrated[k] for part in parts]) for k in parts[0].calibrated
        }
        return merged

    def samples(self) -> ProbeSamples:
        return ProbeSamples(
            held_out=self.held_out.tensor(),
            held_out_groups=self.held_out.groups(),
            trajectory=[(s.tensor(), s.groups()) for s in self.trajectory],
            calibrate_truncate={k: (s.tensor(), s.groups()) for k, s in self.calibrated.items()},
        )


@dataclass
class BatchScores:
    """What one evaluation batch adds to `SweepAccumulator`: per-example cells by key (chunks of
    examples while the batch is read), replay's largest difference from truncate per k, and the
    batch's side of the null control."""

    values: dict[CellKey, list[Tensor]] = field(default_factory=dict)
    walked: dict[WalkKey, list[Tensor]] = field(default_factory=dict)
    jackknife: dict[JackknifeKey, list[Tensor]] = field(default_factory=dict)
    replay_difference: dict[int, float] = field(default_factory=dict)
    read: dict[str, Tensor] = field(default_factory=dict)
    null: BatchNull = field(default_factory=lambda: BatchNull({}, 0.0, {}))

    def add(self, condition: str, k: int, scores: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """Append a chunk's ``scores`` ([chunk] per metric) of ``condition`` at k."""
        for metric, value in scores.items():
            self.values.setdefault((metric, condition, k), []).append(value)
        return scores


class SweepState(TypedDict):
    values: list[tuple[CellKey, dict[int, Tensor]]]
    walked: list[tuple[WalkKey, dict[int, Tensor]]]
    jackknife: list[tuple[JackknifeKey, dict[int, Tensor]]]
    null: NullState
    replay_difference: dict[int, float]
    probe: ProbeState


@dataclass
class SweepAccumulator:
    """Every accumulator of one evaluation: the metrics' per-example cells, where replay walks
    (`walk_fractions`' records), the jackknife's cells, the null control, replay's largest
    difference from truncate per k, and the probe's subsamples."""

    null: NullControlAccumulator
    replay_difference: MaximaAccumulator[int]
    probe: ProbeSampleAccumulator
    values: ExampleCellsAccumulator[CellKey] = field(default_factory=ExampleCellsAccumulator)
    walked: ExampleCellsAccumulator[WalkKey] = field(default_factory=ExampleCellsAccumulator)
    jackknife: ExampleCellsAccumulator[JackknifeKey] = field(
        default_factory=ExampleCellsAccumulator
    )

    def add(self, batch: int, scores: BatchScores) -> None:
        self.values.add(batch, scores.values)
        self.walked.add(batch, scores.walked)
        self.jackknife.add(batch, scores.jackknife)
        self.null.add(scores.null)
        self.replay_difference.add(scores.replay_difference)

    def state(self) -> SweepState:
        return {
            "values": self.values.state(),
            "walked": self.walked.state(),
            "jackknife": self.jackknife.state(),
            "null": self.null.state(),
            "replay_difference": self.replay_difference.state(),
            "probe": self.probe.state(),
        }

    def restore(self, state: object) -> None:
        """What ``state`` recorded; a field missing or of the wrong type (a string where a k or
        a number belongs) raises `SnapshotFieldError` naming it."""
        for name, cells, key in (
            ("values", self.values, CELL_KEY),
            ("walked", self.walked, WALK_KEY),
            ("jackknife", self.jackknife, JACKKNIFE_KEY),
        ):
            cells.restore(snapshot_field(state, name, "state", "list"), f"state.{name}", key)
        self.null.restore(snapshot_field(state, "null", "state", "dict"), "state.null")
        replay = snapshot_field(state, "replay_difference", "state", "dict")
        self.replay_difference.restore(replay, "state.replay_difference", "count")
        self.probe.restore(snapshot_field(state, "probe", "state", "dict"), "state.probe")

    @classmethod
    def merged(cls, parts: Sequence[SweepAccumulator], device: torch.device) -> SweepAccumulator:
        """Every process's records combined, as one process reading every batch would have them:
        cells in batch order, maxima and sums over the processes, subsamples merged."""
        return cls(
            NullControlAccumulator.merged([part.null for part in parts]),
            MaximaAccumulator.merged([part.replay_difference for part in parts]),
            ProbeSampleAccumulator.merged([part.probe for part in parts]),
            ExampleCellsAccumulator.merged([part.values for part in parts], device),
            ExampleCellsAccumulator.merged([part.walked for part in parts], device),
            ExampleCellsAccumulator.merged([part.jackknife for part in parts], device),
        )

    def output(
        self, n: int, metrics: Sequence[str], maps: FittedMaps, jackknife_rows: Tensor | None
    ) -> SweepOutput:
        """The sweep's hand-off over ``n`` examples; the jackknife's cells where
        ``jackknife_rows`` says which examples it read."""
        values: Values = {}
        for (metric, condition, k), vector in self.values.vectors().items():
            if condition == "full":
                values.setdefault(metric, {})["full"] = vector
            else:
                values.setdefault(metric, {}).setdefault(condition, {})[k] = vector
        walked: dict[str, dict[int, Tensor]] = {}
        for (kind, k), vector in self.walked.vectors().items():
            walked.setdefault(kind, {})[k] = vector
        jackknife: list[Values] = [{} for _ in maps.jackknife] if jackknife_rows is not None else []
        for (group, metric, condition, k), vector in self.jackknife.vectors().items():
            jackknife[group].setdefault(metric, {}).setdefault(condition, {})[k] = vector
        return SweepOutput(
            values,
            self.null.record(n, metrics, maps),
            self.probe.samples(),
            walked,
            jackknife,
            jackknife_rows,
            self.replay_difference.state(),
        )


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
        replay_difference: per k, max |readout(replay(k)) - readout(truncate(k))| over every
            evaluation of the sweep so far: whether replay reads out as truncate (B identified).
        read: per condition read on a subsample of the examples (the controls of
            `dcp_lens.protocol.conditions.SUBSAMPLED_CONTROLS` where their cap binds), ``[n]``
            bool: where it was read (its values are NaN elsewhere); a condition not named was
            read on every example.
    """

    values: Values
    null_control: NullRecord
    probe_samples: ProbeSamples
    walked: dict[str, dict[int, Tensor]] = field(default_factory=dict)
    jackknife: list[Values] = field(default_factory=list)
    jackknife_rows: Tensor | None = None
    replay_difference: dict[int, float] = field(default_factory=dict)
    read: dict[str, Tensor] = field(default_factory=dict)
