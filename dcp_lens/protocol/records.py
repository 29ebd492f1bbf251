"""The run-level records of `ProtocolResults` (the null control, the probe's summary, the S
control's calibration) as dataclasses, and the JSON conversions ``results.json`` is written with.

Each record reads and writes its ``results.json`` object with `from_json` / `to_json` (keys in
the order the protocol writes them; a field that is None was not recorded and is left out), and
is also a read-only mapping over that object, so ``results.null_control["max_abs_logit_diff"]``
reads as it does in the file (NaN as NaN). Keys a record does not name (a translator's null
control, a calibration map's own settings, a probe score added by hand) are kept, in order, in
its ``other`` mapping.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, ClassVar, TypeVar, overload

import numpy as np

# A value JSON holds, as Python reads it back. Runtime checkers (the tests' typeguard) cannot
# follow a recursive alias, so at run time the containers' items are left unchecked.
if TYPE_CHECKING:
    JSONValue = None | bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"]
else:
    JSONValue = None | bool | int | float | str | list | dict
JSONObject = dict[str, JSONValue]

_Record = TypeVar("_Record", bound="JSONRecord")


class JSONRecord(Mapping[str, JSONValue]):
    """A dataclass record that reads as the JSON object it writes (`to_json`).

    Subclasses are dataclasses whose fields are the object's keys in order; ``other`` holds the
    keys no field names, written after the fields (or, for `NullControlRecord`, where `to_json` puts
    them)."""

    other: Mapping[str, JSONValue]
    # Fields that hold a record of their own, read with that record's `from_json`.
    nested: ClassVar[Mapping[str, type[JSONRecord]]] = {}

    def to_json(self) -> JSONObject:
        """The record as a JSON object (NaN as NaN; `encode_json` makes it strict JSON)."""
        record: JSONObject = {}
        for item in fields(self):  # type: ignore[arg-type]
            value = getattr(self, item.name)
            if item.name != "other" and value is not None:
                record[item.name] = plain(value, item.name)
        record.update(plain(dict(self.other), "other"))  # type: ignore[arg-type]
        return record

    @classmethod
    def from_json(cls: type[_Record], record: Mapping[str, object]) -> _Record:
        """The record from its JSON object (the inverse of `to_json`; NaN as NaN)."""
        decoded = decode_json(plain(dict(record), cls.__name__))
        assert isinstance(decoded, dict)
        named = {item.name for item in fields(cls) if item.name != "other"}  # type: ignore[arg-type]
        required = [
            item.name
            for item in fields(cls)  # type: ignore[arg-type]
            if item.default is MISSING and item.default_factory is MISSING
        ]
        missing = [name for name in required if name not in decoded]
        if missing:
            raise ValueError(
                f"{cls.__name__} record has keys {sorted(decoded)}; it needs {missing}."
            )
        given: dict[str, object] = {key: value for key, value in decoded.items() if key in named}
        for key, record_type in cls.nested.items():
            value = given.get(key)
            if isinstance(value, Mapping):
                given[key] = record_type.from_json(value)
        other = {key: value for key, value in decoded.items() if key not in named}
        # The subclass is a dataclass whose fields are the named keys (checked when tested).
        return cls(**given, other=other)  # type: ignore[call-arg]

    def __getitem__(self, key: str) -> JSONValue:
        return self.to_json()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_json())

    def __len__(self) -> int:
        return len(self.to_json())


@dataclass(frozen=True, eq=False)
class NullControlRecord(JSONRecord):
    """What must be zero up to float error (docs/design.md §7): at k = r every condition against
    full depth (``max_abs_logit_diff``: truncate and replay; the calibrated ones; ``shift``; each
    translator's, in ``other`` as ``<name>_at_r_max_abs_logit_diff``), how far the full-depth
    map is from the identity, and how much a map fitted on half the calibration split changes
    the logits and each metric."""

    max_abs_logit_diff: float
    calibrate_full_max_abs_logit_diff: float | None = None
    shift_at_r_max_abs_logit_diff: float | None = None
    calibrate_full_identity_deviation: JSONValue = None
    calibrate_full_halves_max_abs_logit_diff: float | None = None
    calibrate_full_halves_metric_change: Mapping[str, float] | None = None
    other: Mapping[str, JSONValue] = field(default_factory=dict)

    def to_json(self) -> JSONObject:
        """As the sweep writes it: the translators' checks after the map's identity deviation."""
        record = super().to_json()
        named = [name for name in record if name not in self.other]
        at = len(named)
        if "calibrate_full_identity_deviation" in named:
            at = named.index("calibrate_full_identity_deviation") + 1
        return {key: record[key] for key in [*named[:at], *self.other, *named[at:]]}


@dataclass(frozen=True, eq=False)
class ProbeSummaryRecord(JSONRecord):
    """The residual OOD probe's scores (`dcp_lens.protocol.probe.probe_run`): at full depth
    (``reference_*``), per iteration (``trajectory`` rows: ``iteration``, ``mahalanobis``,
    ``auroc``, ...), per k for the calibrated truncated states (``calibrate_truncate`` rows, by
    ``k``) and the Spearman correlation of the trajectory's scores with S(k)."""

    reference_auroc: float = math.nan
    reference_mahalanobis: float | None = None
    noise_floor: float | None = None
    trajectory: Sequence[Mapping[str, float | int]] = ()
    calibrate_truncate: Sequence[Mapping[str, float | int]] | None = None
    s_rank_correlation: float | None = None
    other: Mapping[str, JSONValue] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class ConfidenceMatchingRecord(JSONRecord):
    """Loss metrics scored at the temperature that gives full depth's mean entropy: per condition,
    per k (as a string), the temperature."""

    what: str
    temperatures: Mapping[str, Mapping[str, float]]
    other: Mapping[str, JSONValue] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class CalibrationRecord(JSONRecord):
    """The S control's map and its settings (`ProtocolConfig.calibration_mode`); ``other``
    holds what the map itself describes (`CalibrationMap.describe`)."""

    mode: str | None = None
    fitted_on: str | None = None
    covariance: str | None = None
    skip_first_position: bool | None = None
    confidence_matching: ConfidenceMatchingRecord | None = None
    other: Mapping[str, JSONValue] = field(default_factory=dict)
    nested: ClassVar[Mapping[str, type[JSONRecord]]] = {
        "confidence_matching": ConfidenceMatchingRecord
    }

    @classmethod
    def of_run(
        cls,
        mode: str,
        skip_first_position: bool,
        temperatures: Mapping[tuple[str, int], float],
        described: Mapping[str, JSONValue],
    ) -> CalibrationRecord:
        """The record of a run's S control: its map ``mode``, fitted label-free on the
        calibration split; confidence matching's ``temperatures`` per (condition, k), where it
        ran; and what the map itself ``described`` (`CalibrationMap.describe`)."""
        record: dict[str, object] = {
            "mode": mode,
            "fitted_on": "the calibration split, without labels (marginals only)",
            "covariance": "Ledoit-Wolf shrinkage",
            "skip_first_position": skip_first_position,
        }
        if temperatures:
            record["confidence_matching"] = {
                "what": "loss metrics scored at the temperature giving full depth's mean entropy",
                "temperatures": {
                    name: {str(k): t for (n, k), t in temperatures.items() if n == name}
                    for name in dict.fromkeys(n for n, _ in temperatures)
                },
            }
        record.update(described)
        return cls.from_json(record)


# ----------------------------------------------------------------------------- JSON


def plain(value: object, where: str) -> JSONValue:
    """``value`` as plain JSON-like Python (dict/list/str/bool/int/float), None read as NaN."""
    if value is None:
        return math.nan
    if isinstance(value, JSONRecord):
        return value.to_json()
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, str):
        return value
    if isinstance(value, np.ndarray):
        return plain(value.tolist(), where)
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise ValueError(f"{where} has key {key!r}; JSON keys must be str.")
        return {key: plain(item, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise ValueError(f"{where} is a {type(value).__name__} ({value!r}), which JSON cannot hold.")


@overload
def encode_json(value: Mapping[str, object]) -> JSONObject: ...
@overload
def encode_json(value: object) -> JSONValue: ...
def encode_json(value: object) -> JSONValue:
    """``value`` in strict-JSON form: NaN (and None) -> None, +-inf -> "Infinity" / "-Infinity"."""
    return _encode_floats(plain(value, "results"))


def _encode_floats(value: JSONValue) -> JSONValue:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _encode_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_encode_floats(item) for item in value]
    return value


@overload
def decode_json(value: Mapping[str, JSONValue]) -> JSONObject: ...
@overload
def decode_json(value: JSONValue) -> JSONValue: ...
def decode_json(value: JSONValue | Mapping[str, JSONValue]) -> JSONValue:
    """Inverse of `encode_json`: None -> NaN, "Infinity" -> inf, through dicts and lists."""
    if value is None or (isinstance(value, str) and value in ("Infinity", "-Infinity")):
        return decode_float(value)
    if isinstance(value, Mapping):
        return {key: decode_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [decode_json(item) for item in value]
    return value


def decode_float(value: JSONValue) -> float:
    """A number of ``results.json`` as a float: None is NaN, "Infinity" / "-Infinity" inf."""
    if value is None:
        return math.nan
    if value == "Infinity":
        return math.inf
    if value == "-Infinity":
        return -math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is not a number of results.json (a {type(value).__name__}).")
    return float(value)
