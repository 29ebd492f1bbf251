"""The results of DCP on one model: `Decomposition` (one metric) and `ProtocolResults` (a run),
their tables, and ``results.json`` I/O (docs/design.md §8). Nothing here computes science: the
numbers come from `dcp_lens.protocol.decomposition.decompose` and the protocol; rendering is in
`dcp_lens.report.html`."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from jaxtyping import Bool, Float

from dcp_lens.protocol.conditions import DECOMPOSED, SWEEP
from dcp_lens.protocol.records import (
    CalibrationRecord,
    JSONObject,
    JSONValue,
    NullControlRecord,
    ProbeSummaryRecord,
    decode_float,
    decode_json,
    encode_json,
    plain,
)
from dcp_lens.utils.checks import read_json_object
from dcp_lens.utils.errors import DamagedFileError
from dcp_lens.utils.files import check_complete, write_text_atomically
from dcp_lens.utils.folders import OutputFolder, report_target
from dcp_lens.utils.registry import renderer

if TYPE_CHECKING:  # annotations only: the figures are drawn by the report stage
    import plotly.graph_objects as go

__all__ = [
    "Decomposition", "ProtocolResults", "read_results_json", "write_results_json",
    "encode_json", "decode_json",
]  # fmt: skip
# A value of a table row or a bracket record: a number, a flag or a name.
Cell = float | int | bool | str

FACTORS = ("S", "B", "D")
QUANTITIES = ("gap", "S", "B", "D", "I_BS", "shift_gap")
ARCHITECTURES = ("recurrent", "dense")
# Per k, the S bracket's ends and the B and D brackets (docs/bracket.md), each with its interval,
# and the upper interval end of each bracket's width: the bracket's columns of a decomposition row.
BRACKET_ROW_KEYS = (
    *(
        f"{name}{suffix}"
        for name in ("S_lower", "S_upper", "B_lower", "B_upper", "D_lower", "D_upper")
        for suffix in ("", "_lo", "_hi")
    ),
    "S_width_hi",
    "B_width_hi",
    "order_width_hi",
)
# The bracket's fields named in ``results.json``'s ``shares[metric]`` (the whole record is in
# ``bracket[metric]``).
BRACKET_SHARE_KEYS = (
    "S_lower", "S_upper", "S_identified", "B_identified", "stable", "verdict", "reason", "bound",
)  # fmt: skip
REPLAY_NOT_REALIZABLE = "not realizable as the same model"
# The flag of a row whose S is not identified, in the report and on its figures' hover.
S_NOT_IDENTIFIED = (
    "S is a lower bound and D an upper bound, B may hold the missed shift (calibrated states "
    "still differ from full depth)"
)


@dataclass(frozen=True, eq=False)
class Decomposition:
    """The DCP decomposition of one metric for one model run (built by `decompose`).

    Arrays are read-only, one entry per k of ``k_grid``. Equality is exact, NaN equal to NaN.

    Attributes:
        cells: ``gap, S, B, D, I_BS, shift_gap`` and each with ``_lo`` / ``_hi`` (quality units).
        curves: the mean of every per-k condition (``truncate``, ..., ``shift``) and each with
            ``_lo`` / ``_hi``, in the metric's units; ``full`` / ``full_lo`` / ``full_hi`` hold the
            full-depth value (at k = n_iterations).
        nonfinite: per per-k condition, whether the cell held a non-finite value (its mean is NaN);
            ``full_nonfinite`` the same for ``full``.
        shares: ``S, B, D`` shares of the gap's area over ``share_k_grid``, each with ``_lo`` /
            ``_hi``.
        truncation_slope: least-squares slope of Q(truncate(k)) against k / r over the k < r of the
            grid plus the point (1, Q(full)); quality units, positive when quality rises with depth.
        gap_area: the gap's area over ``share_k_grid`` with its interval; a share is ``stable``
            only where that interval excludes 0 (a share of a gap that may be 0 means nothing).
        s_identified: per k, whether S is identified: the calibrated truncated states are not
            told apart from full-depth ones beyond the probe's null (``residual_auroc`` against
            ``residual_auroc_threshold``). Where False, S is a lower bound and D an upper bound,
            and B may hold the part of the shift the map missed (where replay repairs the frame).
        b_identified: per k, whether B (and I_BS) is identified: replay(k) and truncate(k) read
            out differently on the evaluation set. Where False, B = I_BS = 0 by construction.
        validated: whether this metric attributes planted factors correctly
        (`dcp_lens.protocol.metrics`),
            with ``validation_reason``.
        bracket: per k, `BRACKET_ROW_KEYS` (the S bracket ``[S_lower, S_upper]``, the B and D
            brackets, intervals and widths; quality units), or None where the run swept no
            translators and base rate. Where present, ``s_identified`` / ``b_identified`` are
            read from it (the bracket is narrow), and the probe's ``residual_auroc`` is a
            diagnostic only.
        bracket_shares: the bracket of the shares (`dcp_lens.protocol.bracket.Bracket.record`):
            ``S_lower``, ``S_upper`` with intervals, ``S_identified``, ``B_identified``,
            ``stable``, ``verdict`` (S, B, D, mixed, inconclusive) and ``reason``; or None.
    """

    metric: str
    higher_is_better: bool
    n_iterations: int
    k_grid: tuple[int, ...]
    n_examples: int
    n_bootstrap: int
    seed: int
    confidence: float
    cells: Mapping[str, Float[np.ndarray, " k"]]
    curves: Mapping[str, Float[np.ndarray, " k"]]
    full: float
    full_lo: float
    full_hi: float
    nonfinite: Mapping[str, Bool[np.ndarray, " k"]]
    full_nonfinite: bool
    shares: Mapping[str, float]
    share_k_grid: tuple[int, ...]
    truncation_slope: float
    truncation_slope_lo: float
    truncation_slope_hi: float
    conditions: tuple[str, ...] = DECOMPOSED
    gap_area: float = math.nan
    gap_area_lo: float = math.nan
    gap_area_hi: float = math.nan
    s_identified: Bool[np.ndarray, " k"] | None = None
    b_identified: Bool[np.ndarray, " k"] | None = None
    residual_auroc: Float[np.ndarray, " k"] | None = None
    residual_auroc_threshold: Float[np.ndarray, " k"] | None = None
    validated: bool = False
    validation_reason: str = "not validated"
    bracket: Mapping[str, Float[np.ndarray, " k"]] | None = None
    bracket_shares: Mapping[str, Cell | None] | None = None

    def __post_init__(self) -> None:
        n_k = len(self.k_grid)
        if self.bracket is not None:
            if set(self.bracket) != set(BRACKET_ROW_KEYS):
                raise ValueError(
                    f"Decomposition.bracket has keys {sorted(self.bracket)}; expected"
                    f" {BRACKET_ROW_KEYS}."
                )
            arrays = {key: np.array(self.bracket[key], np.float64) for key in BRACKET_ROW_KEYS}
            for key, array in arrays.items():
                if array.shape != (n_k,):
                    raise ValueError(
                        f"Decomposition.bracket[{key!r}] has shape {array.shape};"
                        f" expected ({n_k},)."
                    )
                array.flags.writeable = False
            object.__setattr__(self, "bracket", arrays)
        if self.bracket_shares is not None:
            object.__setattr__(
                self, "bracket_shares", {k: _share_value(v) for k, v in self.bracket_shares.items()}
            )
        # One order whatever assembled the curves (one process or several): the sweep
        # registry's, conditions it does not hold after them in the order given.
        order = {name: i for i, name in enumerate(SWEEP)}
        conditions = sorted(self.conditions, key=lambda name: order.get(name, len(order)))
        object.__setattr__(self, "conditions", tuple(conditions))
        # Flags not measured are not granted: False (not identified) and NaN scores.
        for name, dtype, missing in (
            ("s_identified", np.bool_, False),
            ("b_identified", np.bool_, False),
            ("residual_auroc", np.float64, math.nan),
            ("residual_auroc_threshold", np.float64, math.nan),
        ):
            given = getattr(self, name)
            array = np.full(n_k, missing, dtype) if given is None else np.array(given, dtype)
            if array.shape != (n_k,):
                raise ValueError(
                    f"Decomposition.{name} has shape {array.shape}; expected ({n_k},)."
                )
            array.flags.writeable = False
            object.__setattr__(self, name, array)
        if self.conditions[: len(DECOMPOSED)] != DECOMPOSED:
            raise ValueError(
                f"Decomposition.conditions={self.conditions} must start with {DECOMPOSED}."
            )
        for name, keys, dtype in (
            ("cells", _interval_keys(QUANTITIES), np.float64),
            ("curves", _interval_keys(self.conditions), np.float64),
            ("nonfinite", self.conditions, np.bool_),
        ):
            given = getattr(self, name)
            if set(given) != set(keys):
                raise ValueError(f"Decomposition.{name} has keys {sorted(given)}; expected {keys}.")
            arrays = {key: np.array(given[key], dtype=dtype) for key in keys}
            for key, array in arrays.items():
                if array.shape != (n_k,):
                    raise ValueError(
                        f"Decomposition.{name}[{key!r}] has shape {array.shape}; expected ({n_k},)"
                        " (one entry per k of k_grid)."
                    )
                array.flags.writeable = False
            object.__setattr__(self, name, arrays)
        share_keys = _interval_keys(FACTORS)
        if set(self.shares) != set(share_keys):
            raise ValueError(
                f"Decomposition.shares has keys {sorted(self.shares)}; expected {share_keys}."
            )
        object.__setattr__(self, "shares", {key: float(self.shares[key]) for key in share_keys})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Decomposition):
            return NotImplemented
        return all(_same(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))

    @property
    def stable(self) -> bool:
        """Whether the shares mean something: with a bracket, its rule (the gap and full depth
        over the base rate clearly above zero, every share's interval narrow enough to name a
        factor; docs/bracket.md); without, whether the gap's area interval excludes 0."""
        if self.bracket_shares is not None:
            return bool(self.bracket_shares["stable"])
        low, high = self.gap_area_lo, self.gap_area_hi
        return bool(math.isfinite(low) and math.isfinite(high) and (low > 0 or high < 0))

    def table(self) -> pd.DataFrame:
        """One row per k: ``metric, k, gap, S, B, D, I_BS, shift_gap``, their ``_lo`` / ``_hi``,
        ``nonfinite`` (any cell at that k flagged), ``S_identified``, ``B_identified``,
        ``residual_auroc`` and ``residual_auroc_threshold``."""
        rows = self._decomposition_rows()
        bracket = BRACKET_ROW_KEYS if self.bracket is not None else ()
        columns = ["metric", "k", *_TABLE_COLUMNS, *bracket, *_FLAG_COLUMNS]
        return pd.DataFrame(rows, columns=columns)

    def curves_table(self) -> pd.DataFrame:
        """One row per (condition, k): ``metric, condition, k, value, value_lo, value_hi,
        nonfinite``; ``full`` sits at k = n_iterations. Values in the metric's units."""
        return pd.DataFrame(self._curve_rows(), columns=list(_CURVE_COLUMNS))

    def shares_table(self) -> pd.DataFrame:
        """One row: ``metric, S, S_lo, S_hi, B, ..., D_hi``, the bracket's fields, ``gap_area``
        with ``_lo`` / ``_hi`` (the gap summed over the ``n_k`` k values the shares divide by),
        ``gap_mean`` (the gap's mean over the grid's k: the "mean gap" the console and
        report.html show), ``n_k``, ``stable`` and ``validated``. No column is named plain
        ``gap``: the two quantities keep two names."""
        bracketed = dict(self.bracket_shares or {})
        own = {"": self.gap_area, "_lo": self.gap_area_lo, "_hi": self.gap_area_hi}
        area = {f"gap_area{end}": bracketed.pop(f"gap{end}", value) for end, value in own.items()}
        gaps = self.cells["gap"][np.isfinite(self.cells["gap"])]
        row = {
            "metric": self.metric,
            **self.shares,
            **bracketed,
            **area,
            "gap_mean": float(gaps.mean()) if gaps.size else math.nan,
            "n_k": len(self.share_k_grid),
            "stable": self.stable,
            "validated": self.validated,
        }
        return pd.DataFrame([row])

    def truncation_curve(self) -> pd.DataFrame:
        """The classic truncation curve: ``k, depth_fraction (k / r), quality`` for every k of the
        grid below r, then (r, 1.0, Q(full)); quality units."""
        sign = 1.0 if self.higher_is_better else -1.0
        ks = [k for k in self.k_grid if k < self.n_iterations]
        truncated = dict(zip(self.k_grid, self.curves["truncate"], strict=True))
        return pd.DataFrame(
            {
                "k": [*ks, self.n_iterations],
                "depth_fraction": [k / self.n_iterations for k in ks] + [1.0],
                "quality": [sign * float(truncated[k]) for k in ks] + [sign * self.full],
            }
        )

    def _decomposition_rows(self) -> list[dict[str, Cell]]:
        rows = []
        for i, k in enumerate(self.k_grid):
            flagged = self.full_nonfinite or any(bool(self.nonfinite[c][i]) for c in DECOMPOSED)
            row: dict[str, Cell] = {"metric": self.metric, "k": k}
            row.update({key: float(self.cells[key][i]) for key in _TABLE_COLUMNS})
            if self.bracket is not None:
                row.update({key: float(self.bracket[key][i]) for key in BRACKET_ROW_KEYS})
            row["nonfinite"] = flagged
            row["S_identified"] = bool(self.s_identified[i])  # type: ignore[index]
            row["B_identified"] = bool(self.b_identified[i])  # type: ignore[index]
            row["residual_auroc"] = float(self.residual_auroc[i])  # type: ignore[index]
            threshold = self.residual_auroc_threshold[i]  # type: ignore[index]
            row["residual_auroc_threshold"] = float(threshold)
            rows.append(row)
        return rows

    def _curve_rows(self) -> list[dict[str, Cell]]:
        full = (self.full, self.full_lo, self.full_hi, self.full_nonfinite)
        rows = [_curve_row(self.metric, "full", self.n_iterations, *full)]
        for condition in self.conditions:
            for i, k in enumerate(self.k_grid):
                value, low, high = (self.curves[condition + s][i] for s in ("", "_lo", "_hi"))
                flagged = bool(self.nonfinite[condition][i])
                rows.append(_curve_row(self.metric, condition, k, value, low, high, flagged))
        return rows

    def _metric_record(self) -> JSONObject:
        return {
            "higher_is_better": self.higher_is_better,
            "k_grid": list(self.k_grid),
            "share_k_grid": list(self.share_k_grid),
            "area": "sum over k",
            "n_examples": self.n_examples,
            "n_bootstrap": self.n_bootstrap,
            "seed": self.seed,
            "confidence": self.confidence,
            "truncation_slope": self.truncation_slope,
            "truncation_slope_lo": self.truncation_slope_lo,
            "truncation_slope_hi": self.truncation_slope_hi,
            "validated": self.validated,
            "reason": self.validation_reason,
        }

    @classmethod
    def _from_records(
        cls,
        metric: str,
        n_iterations: int,
        record: JSONObject,
        decomposition_rows: Sequence[JSONObject],
        curve_rows: Sequence[JSONObject],
        shares: JSONObject,
        bracket_shares: JSONObject | None = None,
    ) -> Decomposition:
        grid = _ints(record["k_grid"], "k_grid")
        by_k = {_int(row["k"], "k"): row for row in decomposition_rows}
        if sorted(by_k) != sorted(grid):
            raise ValueError(
                f"metric {metric!r}: decomposition rows cover k={sorted(by_k)}, k_grid is {grid}."
            )
        cells = {key: _floats(by_k[k][key] for k in grid) for key in _TABLE_COLUMNS}
        flags: dict[str, np.ndarray] = {}
        for key, name in _FLAG_FIELDS.items():  # absent from older results.json files
            if all(key in by_k[k] for k in grid):
                values = [by_k[k][key] for k in grid]
                is_flag = key.endswith("_identified")
                flags[name] = np.array(values, bool) if is_flag else _floats(values)
        bracket = None
        if bracket_shares is not None and all(key in by_k[grid[0]] for key in BRACKET_ROW_KEYS):
            bracket = {key: _floats(by_k[k][key] for k in grid) for key in BRACKET_ROW_KEYS}
        curve_at = {(str(row["condition"]), _int(row["k"], "k")): row for row in curve_rows}
        full_row = curve_at[("full", n_iterations)]
        named = dict.fromkeys(str(row["condition"]) for row in curve_rows)
        named.pop("full", None)
        conditions = (*DECOMPOSED, *(c for c in named if c not in DECOMPOSED))
        curves: dict[str, np.ndarray] = {}
        nonfinite: dict[str, np.ndarray] = {}
        for condition in conditions:
            rows = [curve_at[(condition, k)] for k in grid]
            for suffix, key in (("", "value"), ("_lo", "value_lo"), ("_hi", "value_hi")):
                curves[condition + suffix] = _floats(row[key] for row in rows)
            nonfinite[condition] = np.array([bool(row["nonfinite"]) for row in rows])
        return cls(
            metric=metric,
            higher_is_better=bool(record["higher_is_better"]),
            n_iterations=n_iterations,
            k_grid=grid,
            n_examples=_int(record["n_examples"], "n_examples"),
            n_bootstrap=_int(record["n_bootstrap"], "n_bootstrap"),
            seed=_int(record["seed"], "seed"),
            confidence=decode_float(record["confidence"]),
            cells=cells,
            curves=curves,
            full=decode_float(full_row["value"]),
            full_lo=decode_float(full_row["value_lo"]),
            full_hi=decode_float(full_row["value_hi"]),
            nonfinite=nonfinite,
            full_nonfinite=bool(full_row["nonfinite"]),
            shares={key: decode_float(shares[key]) for key in _interval_keys(FACTORS)},
            share_k_grid=_ints(record["share_k_grid"], "share_k_grid"),
            truncation_slope=decode_float(record["truncation_slope"]),
            truncation_slope_lo=decode_float(record["truncation_slope_lo"]),
            truncation_slope_hi=decode_float(record["truncation_slope_hi"]),
            conditions=conditions,
            gap_area=decode_float(shares.get("gap_area")),
            gap_area_lo=decode_float(shares.get("gap_area_lo")),
            gap_area_hi=decode_float(shares.get("gap_area_hi")),
            validated=bool(record.get("validated", False)),
            validation_reason=str(record.get("reason", "not validated")),
            bracket=bracket,
            bracket_shares=(
                None
                if bracket_shares is None
                else {key: _share_value(value) for key, value in bracket_shares.items()}
            ),
            **flags,
        )


@dataclass(frozen=True, eq=False)
class ProtocolResults:
    """Everything DCP measured on one model: one `Decomposition` per metric plus run metadata.

    ``replay_realizable`` defaults to ``architecture == "recurrent"``: on a dense model replay is
    computable but is not the same model in another configuration (`REPLAY_NOT_REALIZABLE`).
    ``null_control``, ``probe`` and ``calibration`` are records (`NullControlRecord`,
    `ProbeSummaryRecord`, `CalibrationRecord` of `dcp_lens.protocol.records`;
    ``Record.from_json(dict)`` builds one), each also readable as the JSON object it writes
    (``results.null_control["max_abs_logit_diff"]``).
    ``metadata`` must be JSON-like (dicts with str keys, lists, str, bool, int, float; numpy
    scalars and arrays are converted); None in it is stored as NaN, since JSON null stands for NaN
    here. Equality is exact, NaN equal to NaN.
    """

    model: str
    architecture: str
    n_iterations: int
    decompositions: Mapping[str, Decomposition]
    replay_realizable: bool | None = None
    null_control: NullControlRecord = field(default_factory=lambda: NullControlRecord(math.nan))
    probe: ProbeSummaryRecord = field(default_factory=ProbeSummaryRecord)
    metadata: Mapping[str, object] = field(default_factory=dict)
    calibration: CalibrationRecord = field(default_factory=CalibrationRecord)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r} is not one of {ARCHITECTURES}.")
        if not self.decompositions:
            raise ValueError("decompositions is empty; pass at least one metric's Decomposition.")
        decompositions: dict[str, Decomposition] = {}
        for metric, decomposition in self.decompositions.items():
            if metric != decomposition.metric:
                raise ValueError(
                    f"decompositions[{metric!r}] holds metric {decomposition.metric!r}; key each"
                    " by its own metric."
                )
            if decomposition.n_iterations != self.n_iterations:
                raise ValueError(
                    f"decomposition of {metric!r} has n_iterations={decomposition.n_iterations};"
                    f" this run has n_iterations={self.n_iterations}."
                )
            decompositions[metric] = decomposition
        realizable = self.architecture == "recurrent"
        if self.replay_realizable is not None:
            realizable = bool(self.replay_realizable)
        object.__setattr__(self, "decompositions", decompositions)
        object.__setattr__(self, "replay_realizable", realizable)
        object.__setattr__(self, "metadata", plain(self.metadata, "metadata"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProtocolResults):
            return NotImplemented
        return all(_same(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metrics decomposed, in insertion order."""
        return tuple(self.decompositions)

    def table(self) -> pd.DataFrame:
        """One row per (metric, k): ``model, architecture, metric, k, gap, S, B, D, I_BS,
        shift_gap``, their ``_lo`` / ``_hi``, ``nonfinite``."""
        return self._stack([d.table() for d in self.decompositions.values()])

    def curves(self) -> pd.DataFrame:
        """One row per (metric, condition, k): ``model, architecture, metric, condition, k, value,
        value_lo, value_hi, nonfinite``; values in each metric's units."""
        return self._stack([d.curves_table() for d in self.decompositions.values()])

    def shares(self) -> pd.DataFrame:
        """One row per metric: ``model, architecture, metric, S, S_lo, S_hi, B, ..., D_hi, n_k``."""
        return self._stack([d.shares_table() for d in self.decompositions.values()])

    def nonfinite(self) -> pd.DataFrame:
        """The flagged cells: ``metric, condition, k`` for every cell with a non-finite value."""
        return pd.DataFrame(self._nonfinite_rows(), columns=["metric", "condition", "k"])

    def to_results_json(self) -> JSONObject:
        """This run as one element of ``results.json``'s ``runs`` list (docs/design.md §8).

        Returns:
            A dict ready for ``json.dumps(..., allow_nan=False)``: NaN is ``None``, infinities are
            ``"Infinity"`` / ``"-Infinity"``. Besides the schema's keys it holds
            ``replay_realizable``, ``share_intervals``, ``metrics`` (per-metric settings and the
            truncation slope), ``nonfinite`` and ``metadata``; decomposition rows add ``gap_lo/hi``,
            ``I_BS_lo/hi``, ``shift_gap(_lo/_hi)`` and ``nonfinite``; curve rows add
            ``value_lo/hi`` and ``nonfinite``.
        """
        decompositions = self.decompositions.values()
        run = {
            "model": self.model,
            "architecture": self.architecture,
            "n_iterations": self.n_iterations,
            "replay_realizable": self.replay_realizable,
            "decomposition": [row for d in decompositions for row in d._decomposition_rows()],
            "shares": {
                d.metric: {
                    **{f: d.shares[f] for f in FACTORS},
                    "stable": d.stable,
                    **{k: d.bracket_shares[k] for k in BRACKET_SHARE_KEYS if d.bracket_shares},
                }
                for d in decompositions
            },
            "bracket": {
                d.metric: d.bracket_shares for d in decompositions if d.bracket_shares is not None
            },
            "share_intervals": {
                d.metric: {
                    **{key: d.shares[key] for key in _interval_keys(FACTORS) if key not in FACTORS},
                    "gap_area": d.gap_area,
                    "gap_area_lo": d.gap_area_lo,
                    "gap_area_hi": d.gap_area_hi,
                }
                for d in decompositions
            },
            "curves": [row for d in decompositions for row in d._curve_rows()],
            "null_control": self.null_control,
            "probe": self.probe,
            "metrics": {d.metric: d._metric_record() for d in decompositions},
            "nonfinite": self._nonfinite_rows(),
            "metadata": self.metadata,
            "calibration": self.calibration,
        }
        return _object(encode_json(run), "run")

    @classmethod
    def from_results_json(cls, run: Mapping[str, JSONValue]) -> ProtocolResults:
        """Rebuild from one ``runs`` element written by `to_results_json` (exactly)."""
        missing = [key for key in _RUN_KEYS if key not in run]
        if missing:
            raise ValueError(
                f"results.json run is missing keys {missing}; was it written by dcp-lens?"
            )
        n_iterations = _int(run["n_iterations"], "n_iterations")
        rows = _objects(run["decomposition"], "decomposition")
        curves = _objects(run["curves"], "curves")
        shares = _object(run["shares"], "shares")
        intervals = _object(run["share_intervals"], "share_intervals")
        brackets = _object(run.get("bracket", {}), "bracket")
        decompositions = {
            metric: Decomposition._from_records(
                metric,
                n_iterations,
                _object(record, f"metrics[{metric!r}]"),
                [row for row in rows if row["metric"] == metric],
                [row for row in curves if row["metric"] == metric],
                {**_object(shares[metric], "shares"), **_object(intervals[metric], "intervals")},
                _object(brackets[metric], "bracket") if metric in brackets else None,
            )
            for metric, record in _object(run["metrics"], "metrics").items()
        }
        return cls(
            model=str(run["model"]),
            architecture=str(run["architecture"]),
            n_iterations=n_iterations,
            decompositions=decompositions,
            replay_realizable=bool(run["replay_realizable"]),
            null_control=NullControlRecord.from_json(_object(run["null_control"], "null_control")),
            probe=ProbeSummaryRecord.from_json(_object(run["probe"], "probe")),
            metadata=_object(decode_json(run["metadata"]), "metadata"),
            calibration=CalibrationRecord.from_json(
                _object(run.get("calibration", {}), "calibration")
            ),
        )

    def figures(self) -> dict[str, go.Figure]:
        """The figures of report.html for this run as plotly figures (`dcp_lens.report.html.
        report_figures`): ``quality_<metric>``, ``decomposition_<metric>``, ``probe``."""
        return renderer().report_figures([self])

    def report(self, path: str | Path, report_data: Mapping[str, object] | None = None) -> Path:
        """Write report.html for this run to ``path``: an ``.html`` file (plotly.js in the folder
        ``<name>_files/`` beside it, which the report owns; no other file is touched), or a
        folder (new, a report's or a `save` folder) to hold ``report.html`` and
        ``plotly.min.js``; ``report_data``: a
        `dcp_lens.studies.report_extras.read_report_data` document. A path that is neither
        (``results.json``, ``x.txt``) or a file dcp-lens did not write is refused.
        Several runs side by side: `dcp_lens.report.html.write_report`. Returns the file's path."""
        target = report_target(path)
        with target.folder as folder:  # a lone file: plotly.js in <name>_files/, its folder
            renderer().write_report([self], target.file if target.lone else folder, report_data)
        return target.file

    def summary(self) -> str:
        """What ``dcp-lens run`` prints for this run: per validated metric the quality at full
        depth and at the smallest k, the gap, the shares and the verdict sentence (the report's
        and ``results.json``'s), then a legend of S, B, D and the flags once; lines within 100
        characters. ``print(results.summary())``."""
        return str(renderer().format_summary(self))

    def __repr__(self) -> str:
        shares = "; ".join(
            f"{metric} " + " ".join(f"{f} {d.shares[f]:.2f}" for f in FACTORS)
            for metric, d in self.decompositions.items()
            if d.validated
        )
        return (
            f"<ProtocolResults {self.model} ({self.architecture}, r = {self.n_iterations}): "
            f"{shares or 'no validated metric'}; print(.summary()) for the verdicts>"
        )

    def _repr_html_(self) -> str:
        """The headline (shares, slope, gap, verdict and flags) for Jupyter."""
        return str(renderer().headline_html(self))

    def save(self, directory: str | Path) -> Path:
        """Write ``results.json`` (this run only) and ``decomposition.csv``, ``curves.csv``,
        ``shares.csv`` into ``directory``: a new folder or one `save` wrote (its own files
        replaced, files added to it kept); a folder of other files, or a ``dcp-lens run``
        folder, is refused (`dcp_lens.utils.folders.OutputFolder`). Returns the directory."""
        with OutputFolder(
            Path(directory), "results", flag="directory", on_finished="replace"
        ) as out:
            for name, table in (
                ("decomposition.csv", self.table()), ("curves.csv", self.curves()),
                ("shares.csv", self.shares()),
            ):  # fmt: skip
                write_text_atomically(out / name, table.to_csv(index=False))
            write_results_json([self], out / "results.json")
        return Path(directory)

    @classmethod
    def load(cls, directory: str | Path) -> ProtocolResults:
        """Read back what `save` wrote (from ``results.json``; the CSVs are for people)."""
        path = Path(directory) / "results.json"
        runs = read_results_json(path)
        if len(runs) != 1:
            raise ValueError(
                f"{path} holds {len(runs)} runs; ProtocolResults.load reads a single-run folder,"
                " use read_results_json for several."
            )
        return runs[0]

    def _stack(self, frames: list[pd.DataFrame]) -> pd.DataFrame:
        table = pd.concat(frames, ignore_index=True)
        table.insert(0, "architecture", self.architecture)
        table.insert(0, "model", self.model)
        return table

    def _nonfinite_rows(self) -> list[dict[str, Cell]]:
        return [
            {"metric": row["metric"], "condition": row["condition"], "k": row["k"]}
            for d in self.decompositions.values()
            for row in d._curve_rows()
            if row["nonfinite"]
        ]


def write_results_json(
    runs: Sequence[ProtocolResults | Mapping[str, object]], path: str | Path
) -> Path:
    """Write ``{"runs": [...]}`` to ``path`` as strict JSON (floats at full precision).

    ``runs`` holds `ProtocolResults` or dicts already in the ``runs`` element form.
    Returns the path.
    """
    encoded = [
        r.to_results_json() if isinstance(r, ProtocolResults) else encode_json(r) for r in runs
    ]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomically(
        path, json.dumps({"runs": encoded}, indent=2, allow_nan=False) + "\n"
    )


def read_results_json(path: str | Path) -> list[ProtocolResults]:
    """Every run of a ``results.json`` written by `write_results_json`, as `ProtocolResults`.

    Raises:
        IncompleteRunError: its folder (or the folder above) is marked incomplete.
        DamagedFileError: the file is truncated or not valid JSON (named, with how to recover).
    """
    check_complete(Path(path).parent)
    recovery = "Delete it and rerun the command that wrote it (an experiment recomputes it)."
    document = read_json_object(path, error=DamagedFileError, recovery=recovery, finite=True)
    if not isinstance(document.get("runs"), list):
        raise DamagedFileError(
            f"{path} has no top-level 'runs' list; expected {{'runs': [...]}}. {recovery}"
        )
    try:
        return [ProtocolResults.from_results_json(run) for run in document["runs"]]
    except DamagedFileError:
        raise
    except (ValueError, TypeError) as error:  # a field of the wrong type, named by the reader
        text = " ".join(str(error).split()).removeprefix("results.json: ")
        raise DamagedFileError(f"{path}: {text[:300]} {recovery}") from error


# ----------------------------------------------------------------------------- internals

_TABLE_COLUMNS = (
    "gap", "S", "B", "D", "I_BS",
    "S_lo", "S_hi", "B_lo", "B_hi", "D_lo", "D_hi",
    "gap_lo", "gap_hi", "I_BS_lo", "I_BS_hi",
    "shift_gap", "shift_gap_lo", "shift_gap_hi",
)  # fmt: skip
_FLAG_COLUMNS = (
    "nonfinite", "S_identified", "B_identified", "residual_auroc", "residual_auroc_threshold",
)  # fmt: skip
_FLAG_FIELDS = {
    "S_identified": "s_identified",
    "B_identified": "b_identified",
    "residual_auroc": "residual_auroc",
    "residual_auroc_threshold": "residual_auroc_threshold",
}
_CURVE_COLUMNS = ("metric", "condition", "k", "value", "value_lo", "value_hi", "nonfinite")
_RUN_KEYS = (
    "model", "architecture", "n_iterations", "replay_realizable", "decomposition", "shares",
    "share_intervals", "curves", "null_control", "probe", "metrics", "metadata",
)  # fmt: skip


def _share_value(value: JSONValue) -> Cell:
    """A bracket share's value as `Decomposition` holds it: floats (None read back as NaN),
    bools and strings as they are."""
    if value is None or value in ("Infinity", "-Infinity"):
        return decode_float(value)
    if isinstance(value, bool | str):
        return value
    return decode_float(value)


def _interval_keys(names: Sequence[str]) -> tuple[str, ...]:
    return tuple(f"{name}{suffix}" for name in names for suffix in ("", "_lo", "_hi"))


def _curve_row(
    metric: str, condition: str, k: int, value: float, low: float, high: float, flagged: bool
) -> dict[str, Cell]:
    values = (metric, condition, k, float(value), float(low), float(high), flagged)
    return dict(zip(_CURVE_COLUMNS, values, strict=True))


def _same(left: object, right: object) -> bool:
    """Exact equality with NaN equal to NaN, through dicts, sequences and arrays."""
    if isinstance(left, np.ndarray) or isinstance(right, np.ndarray):
        return (
            isinstance(left, np.ndarray)
            and isinstance(right, np.ndarray)
            and left.dtype == right.dtype
            and left.shape == right.shape
            and bool(np.array_equal(left, right, equal_nan=left.dtype.kind == "f"))
        )
    if isinstance(left, Mapping) and isinstance(right, Mapping):
        return list(left) == list(right) and all(_same(left[k], right[k]) for k in left)
    if isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
        return (
            type(left) is type(right)
            and len(left) == len(right)
            and all(_same(a, b) for a, b in zip(left, right, strict=True))
        )
    if isinstance(left, float) and isinstance(right, float):
        return left == right or (math.isnan(left) and math.isnan(right))
    return type(left) is type(right) and left == right


def _floats(values: Iterable[JSONValue]) -> np.ndarray:
    return np.array([decode_float(value) for value in values], dtype=np.float64)


def _object(value: JSONValue, where: str) -> JSONObject:
    """``value`` as a JSON object, or a `ValueError` naming where it was read."""
    if not isinstance(value, dict):
        raise ValueError(f"results.json: {where} is {value!r}; expected a JSON object.")
    return value


def _objects(value: JSONValue, where: str) -> list[JSONObject]:
    """``value`` as a list of JSON objects, or a `ValueError` naming where it was read."""
    if not isinstance(value, list):
        raise ValueError(f"results.json: {where} is {value!r}; expected a list of objects.")
    return [_object(item, f"{where}[{i}]") for i, item in enumerate(value)]


def _ints(value: JSONValue, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"results.json: {where} is {value!r}; expected a list of integers.")
    return tuple(_int(item, where) for item in value)


def _int(value: JSONValue, where: str) -> int:
    """``value`` as an integer: a JSON integer only (a string, bool or fraction is refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"results.json: {where} holds {value!r} ({type(value).__name__}); expected an integer."
        )
    return value
