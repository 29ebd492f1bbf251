"""The DCP decomposition (DESIGN.md §4): split the truncation gap into S, B and D.

For one model and one metric, per-example values Q (higher is better) on the *same* evaluation
examples in every cell (a paired design), with::

    a = truncate(k)   b = calibrate_truncate(k)   c = replay(k)   d = calibrate_replay(k)   e = full
    gap(k)  = Q(e) - Q(a)
    S(k)    = ((Q(b) - Q(a)) + (Q(d) - Q(c))) / 2        # readout shift
    B(k)    = ((Q(c) - Q(a)) + (Q(d) - Q(b))) / 2        # block applications
    D(k)    = Q(e) - Q(d)                                # distinct computation
    I_BS(k) = (Q(d) - Q(c)) - (Q(b) - Q(a))              # interaction
    shift_gap(k) = Q(e) - Q(shift(k))                    # positive control, set against S(k)

so that S + B + D == gap exactly. Q of a cell is the mean over examples. Intervals are paired
bootstrap percentile intervals: each draw resamples example indices once and recomputes every cell
from those same indices.

Conventions:

- *Units.* Condition curves (``curves``) are in the metric's own units, as passed. Everything
  derived (gap, S, B, D, I_BS, shift_gap, shares, truncation slope) is in quality units,
  ``Q = value if higher_is_better else -value``, so a positive gap always means truncation hurts.
- *Area.* The area of a quantity over the k grid is the plain sum over the grid's k (each k weighs
  the same; it works for a single k and uneven grids alike); ``share_X = area(X) / area(gap)``,
  NaN where the gap's area is exactly 0.
- *Non-finite values.* A cell (condition, k) holding any non-finite per-example value is flagged in
  ``nonfinite`` and its mean is NaN (never a mean over the finite subset, which would break the
  pairing); so is every quantity that uses it, with NaN intervals. Shares are taken over the k where
  every cell of the decomposition (a, b, c, d, e) is finite, listed in ``share_k_grid``; the
  truncation slope skips NaN points.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Shaped

from dcp_lens.errors import DamagedFileError
from dcp_lens.incomplete import check_complete
from dcp_lens.metrics import LOSS_METRICS
from dcp_lens.statistics import paired_bootstrap_means, percentile_interval
from dcp_lens.validation import read_json_object

# Conditions measured at every k, in the column order used throughout this module.
CONDITIONS = ("truncate", "calibrate_truncate", "replay", "calibrate_replay", "shift")
ALL_CONDITIONS = ("full", *CONDITIONS)
FACTORS = ("S", "B", "D")
QUANTITIES = ("gap", "S", "B", "D", "I_BS", "shift_gap")
ARCHITECTURES = ("recurrent", "dense")
REPLAY_NOT_REALIZABLE = "not realizable as the same model"

QualityVector = Shaped[np.ndarray, "_n_examples"] | Shaped[torch.Tensor, "_n_examples"]

# Loss values within this of zero are accepted with either sign (float error in KL).
_SIGN_TOLERANCE = 1e-6


def factors(
    *,
    full: Float[np.ndarray, "*batch"],
    truncate: Float[np.ndarray, "*batch"],
    calibrate_truncate: Float[np.ndarray, "*batch"],
    replay: Float[np.ndarray, "*batch"],
    calibrate_replay: Float[np.ndarray, "*batch"],
) -> dict[str, Float[np.ndarray, "*batch"]]:
    """The DCP quantities from cell qualities (higher is better), elementwise.

    Returns:
        ``{"gap", "S", "B", "D", "I_BS"}``, each of the inputs' common shape.
    """
    a, b, c, d, e = truncate, calibrate_truncate, replay, calibrate_replay, full
    return {
        "gap": np.asarray(e - a),
        "S": np.asarray(((b - a) + (d - c)) / 2),
        "B": np.asarray(((c - a) + (d - b)) / 2),
        "D": np.asarray(e - d),
        "I_BS": np.asarray((d - c) - (b - a)),
    }


def decompose(
    values: Mapping[str, QualityVector | Mapping[int, QualityVector]],
    k_grid: Sequence[int],
    *,
    n_iterations: int,
    metric: str = "accuracy",
    higher_is_better: bool = True,
    n_bootstrap: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
) -> Decomposition:
    """Decompose the truncation gap of one metric into S, B and D, with paired bootstrap intervals.

    Args:
        values: per-example metric values, paired over the same n evaluation examples:
            ``{"full": vector, "truncate": {k: vector}, "calibrate_truncate": {k: vector},
            "replay": {k: vector}, "calibrate_replay": {k: vector}, "shift": {k: vector}}``,
            every vector of shape ``[n]`` (numpy or torch, any real or bool dtype), one entry per
            k of ``k_grid`` for every per-k condition.
        k_grid: iteration counts, each in ``1..n_iterations``, no repeats (sorted here).
        n_iterations: r, the model's trained number of iterations (layers for a dense model).
        metric: the metric's name (``"accuracy"``, ``"cross_entropy"``, ``"kl_to_full"``, ...).
        higher_is_better: False when ``values`` are losses (e.g. raw cross-entropy); they are
            negated into qualities for the decomposition. For ``cross_entropy`` and ``kl_to_full``
            the values' sign must agree with this flag.
        n_bootstrap: bootstrap draws (0 gives NaN intervals).
        seed: seed of the example resampling; the same seed resamples the same indices, so
            metrics decomposed with one seed are paired with each other too. The draws are
            ``paired_bootstrap_means(matrix, n_bootstrap, seed)`` with matrix columns ``full``, then
            each condition of `CONDITIONS` in that order with its k in ascending order.
        confidence: coverage of the percentile intervals.

    Returns:
        A `Decomposition`.
    """
    grid = _check_k_grid(k_grid, n_iterations)
    _check_settings(metric, n_bootstrap, confidence)
    matrix = _value_matrix(values, grid)
    _check_sign(matrix, metric, higher_is_better)

    n_k = len(grid)
    finite = np.isfinite(matrix).all(axis=0)
    means = np.where(finite, matrix, 0.0).mean(axis=0)
    means[~finite] = np.nan
    draws = paired_bootstrap_means(matrix, n_bootstrap, seed)
    sign = 1.0 if higher_is_better else -1.0

    point = _quantities(sign * means[:1], sign * means[1:].reshape(len(CONDITIONS), n_k))
    sampled = _quantities(
        sign * draws[:, :1], sign * draws[:, 1:].reshape(n_bootstrap, len(CONDITIONS), n_k)
    )
    cells: dict[str, np.ndarray] = {}
    for name in QUANTITIES:
        low, high = percentile_interval(sampled[name], confidence)
        cells.update({name: point[name], f"{name}_lo": low, f"{name}_hi": high})

    curves: dict[str, np.ndarray] = {}
    nonfinite: dict[str, np.ndarray] = {}
    condition_low, condition_high = percentile_interval(draws, confidence)
    for i, condition in enumerate(CONDITIONS):
        columns = slice(1 + i * n_k, 1 + (i + 1) * n_k)
        curves[condition] = means[columns]
        curves[f"{condition}_lo"] = condition_low[columns]
        curves[f"{condition}_hi"] = condition_high[columns]
        nonfinite[condition] = ~finite[columns]

    decomposed = ~np.isnan(np.stack([point[name] for name in ("gap", "S", "B", "D")])).any(axis=0)
    shares = _shares(point, sampled, decomposed, confidence)
    slope = _truncation_slope(grid, n_iterations, sign * means, sign * draws, confidence)
    return Decomposition(
        metric=metric,
        higher_is_better=higher_is_better,
        n_iterations=n_iterations,
        k_grid=grid,
        n_examples=matrix.shape[0],
        n_bootstrap=n_bootstrap,
        seed=seed,
        confidence=confidence,
        cells=cells,
        curves=curves,
        full=float(means[0]),
        full_lo=float(condition_low[0]),
        full_hi=float(condition_high[0]),
        nonfinite=nonfinite,
        full_nonfinite=bool(~finite[0]),
        shares=shares,
        share_k_grid=tuple(k for k, used in zip(grid, decomposed, strict=True) if used),
        truncation_slope=slope[0],
        truncation_slope_lo=slope[1],
        truncation_slope_hi=slope[2],
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

    def __post_init__(self) -> None:
        n_k = len(self.k_grid)
        for name, keys, dtype in (
            ("cells", _interval_keys(QUANTITIES), np.float64),
            ("curves", _interval_keys(CONDITIONS), np.float64),
            ("nonfinite", CONDITIONS, np.bool_),
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

    def table(self) -> pd.DataFrame:
        """One row per k: ``metric, k, gap, S, B, D, I_BS, shift_gap``, their ``_lo`` / ``_hi``, and
        ``nonfinite`` (any cell at that k flagged)."""
        rows = self._decomposition_rows()
        return pd.DataFrame(rows, columns=["metric", "k", *_TABLE_COLUMNS, "nonfinite"])

    def curves_table(self) -> pd.DataFrame:
        """One row per (condition, k): ``metric, condition, k, value, value_lo, value_hi,
        nonfinite``; ``full`` sits at k = n_iterations. Values in the metric's units."""
        return pd.DataFrame(self._curve_rows(), columns=list(_CURVE_COLUMNS))

    def shares_table(self) -> pd.DataFrame:
        """One row: ``metric, S, S_lo, S_hi, B, ..., D_hi, n_k`` (k values the area is over)."""
        row = {"metric": self.metric, **self.shares, "n_k": len(self.share_k_grid)}
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

    def _decomposition_rows(self) -> list[dict[str, Any]]:
        rows = []
        for i, k in enumerate(self.k_grid):
            flagged = self.full_nonfinite or any(bool(self.nonfinite[c][i]) for c in CONDITIONS)
            row: dict[str, Any] = {"metric": self.metric, "k": k}
            row.update({key: float(self.cells[key][i]) for key in _TABLE_COLUMNS})
            row["nonfinite"] = flagged
            rows.append(row)
        return rows

    def _curve_rows(self) -> list[dict[str, Any]]:
        full = (self.full, self.full_lo, self.full_hi, self.full_nonfinite)
        rows = [_curve_row(self.metric, "full", self.n_iterations, *full)]
        for condition in CONDITIONS:
            for i, k in enumerate(self.k_grid):
                value, low, high = (self.curves[condition + s][i] for s in ("", "_lo", "_hi"))
                flagged = bool(self.nonfinite[condition][i])
                rows.append(_curve_row(self.metric, condition, k, value, low, high, flagged))
        return rows

    def _metric_record(self) -> dict[str, Any]:
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
        }

    @classmethod
    def _from_records(
        cls,
        metric: str,
        n_iterations: int,
        record: Mapping[str, Any],
        decomposition_rows: Sequence[Mapping[str, Any]],
        curve_rows: Sequence[Mapping[str, Any]],
        shares: Mapping[str, Any],
    ) -> Decomposition:
        grid = tuple(int(k) for k in record["k_grid"])
        by_k = {int(row["k"]): row for row in decomposition_rows}
        if sorted(by_k) != sorted(grid):
            raise ValueError(
                f"metric {metric!r}: decomposition rows cover k={sorted(by_k)}, k_grid is {grid}."
            )
        cells = {key: _decode_floats(by_k[k][key] for k in grid) for key in _TABLE_COLUMNS}
        curve_at = {(row["condition"], int(row["k"])): row for row in curve_rows}
        full_row = curve_at[("full", n_iterations)]
        curves: dict[str, np.ndarray] = {}
        nonfinite: dict[str, np.ndarray] = {}
        for condition in CONDITIONS:
            rows = [curve_at[(condition, k)] for k in grid]
            for suffix, key in (("", "value"), ("_lo", "value_lo"), ("_hi", "value_hi")):
                curves[condition + suffix] = _decode_floats(row[key] for row in rows)
            nonfinite[condition] = np.array([bool(row["nonfinite"]) for row in rows])
        return cls(
            metric=metric,
            higher_is_better=bool(record["higher_is_better"]),
            n_iterations=n_iterations,
            k_grid=grid,
            n_examples=int(record["n_examples"]),
            n_bootstrap=int(record["n_bootstrap"]),
            seed=int(record["seed"]),
            confidence=float(record["confidence"]),
            cells=cells,
            curves=curves,
            full=_decode_float(full_row["value"]),
            full_lo=_decode_float(full_row["value_lo"]),
            full_hi=_decode_float(full_row["value_hi"]),
            nonfinite=nonfinite,
            full_nonfinite=bool(full_row["nonfinite"]),
            shares={key: _decode_float(value) for key, value in shares.items()},
            share_k_grid=tuple(int(k) for k in record["share_k_grid"]),
            truncation_slope=_decode_float(record["truncation_slope"]),
            truncation_slope_lo=_decode_float(record["truncation_slope_lo"]),
            truncation_slope_hi=_decode_float(record["truncation_slope_hi"]),
        )


def _default_null_control() -> dict[str, Any]:
    return {"max_abs_logit_diff": math.nan}


def _default_probe() -> dict[str, Any]:
    return {"reference_auroc": math.nan, "trajectory": []}


@dataclass(frozen=True, eq=False)
class ProtocolResults:
    """Everything DCP measured on one model: one `Decomposition` per metric plus run metadata.

    ``replay_realizable`` defaults to ``architecture == "recurrent"``: on a dense model replay is
    computable but is not the same model in another configuration (`REPLAY_NOT_REALIZABLE`).
    ``null_control`` needs ``max_abs_logit_diff``; ``null_control``, ``probe`` and ``metadata`` must
    be JSON-like (dicts with str keys, lists, str, bool, int, float; numpy scalars and arrays are
    converted); None in them is stored as NaN, since JSON null stands for NaN here.
    Equality is exact, NaN equal to NaN.
    """

    model: str
    architecture: str
    n_iterations: int
    decompositions: Mapping[str, Decomposition]
    replay_realizable: bool | None = None
    null_control: Mapping[str, Any] = field(default_factory=_default_null_control)
    probe: Mapping[str, Any] = field(default_factory=_default_probe)
    metadata: Mapping[str, Any] = field(default_factory=dict)

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
        if "max_abs_logit_diff" not in self.null_control:
            raise ValueError(
                f"null_control has keys {sorted(self.null_control)}; it needs 'max_abs_logit_diff'."
            )
        realizable = self.architecture == "recurrent"
        if self.replay_realizable is not None:
            realizable = bool(self.replay_realizable)
        object.__setattr__(self, "decompositions", decompositions)
        object.__setattr__(self, "replay_realizable", realizable)
        for name in ("null_control", "probe", "metadata"):
            object.__setattr__(self, name, _plain(getattr(self, name), name))

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

    def to_results_json(self) -> dict[str, Any]:
        """This run as one element of ``results.json``'s ``runs`` list (DESIGN.md §8).

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
            "shares": {d.metric: {f: d.shares[f] for f in FACTORS} for d in decompositions},
            "share_intervals": {
                d.metric: {
                    key: d.shares[key] for key in _interval_keys(FACTORS) if key not in FACTORS
                }
                for d in decompositions
            },
            "curves": [row for d in decompositions for row in d._curve_rows()],
            "null_control": self.null_control,
            "probe": self.probe,
            "metrics": {d.metric: d._metric_record() for d in decompositions},
            "nonfinite": self._nonfinite_rows(),
            "metadata": self.metadata,
        }
        return _to_json(run)

    @classmethod
    def from_results_json(cls, run: Mapping[str, Any]) -> ProtocolResults:
        """Rebuild from one ``runs`` element written by `to_results_json` (exactly)."""
        missing = [key for key in _RUN_KEYS if key not in run]
        if missing:
            raise ValueError(
                f"results.json run is missing keys {missing}; was it written by dcp-lens?"
            )
        n_iterations = int(run["n_iterations"])
        decompositions = {
            metric: Decomposition._from_records(
                metric,
                n_iterations,
                record,
                [row for row in run["decomposition"] if row["metric"] == metric],
                [row for row in run["curves"] if row["metric"] == metric],
                {**run["shares"][metric], **run["share_intervals"][metric]},
            )
            for metric, record in run["metrics"].items()
        }
        return cls(
            model=run["model"],
            architecture=run["architecture"],
            n_iterations=n_iterations,
            decompositions=decompositions,
            replay_realizable=bool(run["replay_realizable"]),
            null_control=_from_json(run["null_control"]),
            probe=_from_json(run["probe"]),
            metadata=_from_json(run["metadata"]),
        )

    def save(self, directory: str | Path) -> Path:
        """Write ``results.json`` (this run only) and ``decomposition.csv``, ``curves.csv``,
        ``shares.csv`` into ``directory`` (created if needed). Returns the directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_results_json([self], directory / "results.json")
        self.table().to_csv(directory / "decomposition.csv", index=False)
        self.curves().to_csv(directory / "curves.csv", index=False)
        self.shares().to_csv(directory / "shares.csv", index=False)
        return directory

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

    def _nonfinite_rows(self) -> list[dict[str, Any]]:
        return [
            {"metric": row["metric"], "condition": row["condition"], "k": row["k"]}
            for d in self.decompositions.values()
            for row in d._curve_rows()
            if row["nonfinite"]
        ]


def write_results_json(
    runs: Sequence[ProtocolResults | Mapping[str, Any]], path: str | Path
) -> Path:
    """Write ``{"runs": [...]}`` to ``path`` as strict JSON (floats at full precision).

    ``runs`` holds `ProtocolResults` or dicts already in the ``runs`` element form.
    Returns the path.
    """
    encoded = [r.to_results_json() if isinstance(r, ProtocolResults) else _to_json(r) for r in runs]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")  # never a half-written results.json
    partial.write_text(json.dumps({"runs": encoded}, indent=2, allow_nan=False) + "\n")
    partial.replace(path)
    return path


def read_results_json(path: str | Path) -> list[ProtocolResults]:
    """Every run of a ``results.json`` written by `write_results_json`, as `ProtocolResults`.

    Raises:
        IncompleteRunError: its folder (or the folder above) is marked incomplete.
        DamagedFileError: the file is truncated or not valid JSON (named, with how to recover).
    """
    check_complete(Path(path).parent)
    recovery = "Delete it and rerun the command that wrote it (an experiment recomputes it)."
    document = read_json_object(path, error=DamagedFileError, recovery=recovery)
    if not isinstance(document.get("runs"), list):
        raise DamagedFileError(
            f"{path} has no top-level 'runs' list; expected {{'runs': [...]}}. {recovery}"
        )
    return [ProtocolResults.from_results_json(run) for run in document["runs"]]


# ----------------------------------------------------------------------------- internals

_TABLE_COLUMNS = (
    "gap", "S", "B", "D", "I_BS",
    "S_lo", "S_hi", "B_lo", "B_hi", "D_lo", "D_hi",
    "gap_lo", "gap_hi", "I_BS_lo", "I_BS_hi",
    "shift_gap", "shift_gap_lo", "shift_gap_hi",
)  # fmt: skip
_CURVE_COLUMNS = ("metric", "condition", "k", "value", "value_lo", "value_hi", "nonfinite")
_RUN_KEYS = (
    "model", "architecture", "n_iterations", "replay_realizable", "decomposition", "shares",
    "share_intervals", "curves", "null_control", "probe", "metrics", "metadata",
)  # fmt: skip


def _interval_keys(names: Sequence[str]) -> tuple[str, ...]:
    return tuple(f"{name}{suffix}" for name in names for suffix in ("", "_lo", "_hi"))


def _curve_row(
    metric: str, condition: str, k: int, value: float, low: float, high: float, flagged: bool
) -> dict[str, Any]:
    values = (metric, condition, k, float(value), float(low), float(high), flagged)
    return dict(zip(_CURVE_COLUMNS, values, strict=True))


def _check_k_grid(k_grid: Sequence[int], n_iterations: int) -> tuple[int, ...]:
    if isinstance(n_iterations, bool) or not isinstance(n_iterations, int) or n_iterations < 1:
        raise ValueError(f"n_iterations={n_iterations!r} must be an int >= 1 (the model's r).")
    grid = [int(k) for k in k_grid]
    if not grid:
        raise ValueError("k_grid is empty; pass at least one k in 1..n_iterations.")
    for k in grid:
        if not 1 <= k <= n_iterations:
            raise ValueError(f"k={k} in k_grid is outside 1..n_iterations={n_iterations}.")
    repeated = sorted({k for k in grid if grid.count(k) > 1})
    if repeated:
        raise ValueError(f"k_grid repeats k={repeated}; list each k once.")
    return tuple(sorted(grid))


def _check_settings(metric: str, n_bootstrap: int, confidence: float) -> None:
    if not metric:
        raise ValueError("metric is empty; name it (e.g. 'accuracy').")
    if n_bootstrap < 0:
        raise ValueError(f"n_bootstrap={n_bootstrap} must be >= 0.")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must lie strictly between 0 and 1.")


def _as_vector(vector: object, where: str) -> np.ndarray:
    if isinstance(vector, torch.Tensor):
        vector = vector.detach().to("cpu", torch.float64).numpy()
    array = np.asarray(vector)
    if array.dtype.kind not in "biuf":
        raise ValueError(f"{where} has dtype {array.dtype}; expected real or bool values.")
    if array.ndim != 1:
        raise ValueError(f"{where} has shape {array.shape}; expected one value per example, [n].")
    return array.astype(np.float64)


def _value_matrix(
    values: Mapping[str, QualityVector | Mapping[int, QualityVector]], grid: tuple[int, ...]
) -> np.ndarray:
    """``[n, 1 + 5 * len(grid)]``: full, then each per-k condition's k in grid order."""
    unknown = sorted(set(values) - set(ALL_CONDITIONS))
    if unknown:
        raise ValueError(f"values has unknown conditions {unknown}; expected {ALL_CONDITIONS}.")
    missing = [c for c in ALL_CONDITIONS if c not in values]
    if missing:
        raise ValueError(
            f"values is missing conditions {missing}; expected all of {ALL_CONDITIONS}."
        )
    full = values["full"]
    if isinstance(full, Mapping):
        raise ValueError("values['full'] must be one vector (full depth has no k), not a dict.")
    columns = [_as_vector(full, "values['full']")]
    n_examples = columns[0].shape[0]
    if n_examples == 0:
        raise ValueError("values['full'] has 0 examples; the evaluation set is empty.")
    for condition in CONDITIONS:
        per_k = values[condition]
        if not isinstance(per_k, Mapping):
            raise ValueError(f"values[{condition!r}] must map each k of k_grid to a vector.")
        given = {int(k): vector for k, vector in per_k.items()}
        outside = sorted(set(given) - set(grid))
        if outside:
            raise ValueError(f"values[{condition!r}] has k={outside} outside k_grid={list(grid)}.")
        absent = [k for k in grid if k not in given]
        if absent:
            raise ValueError(f"values[{condition!r}] has no vector for k={absent} of k_grid.")
        for k in grid:
            where = f"values[{condition!r}][{k}]"
            column = _as_vector(given[k], where)
            if column.shape[0] != n_examples:
                raise ValueError(
                    f"{where} has {column.shape[0]} examples but values['full'] has {n_examples};"
                    " every cell must be evaluated on the same examples (paired design)."
                )
            columns.append(column)
    return np.stack(columns, axis=1)


def _check_sign(matrix: np.ndarray, metric: str, higher_is_better: bool) -> None:
    """Catch losses passed as qualities (and back) for metrics whose sign is known."""
    if metric not in LOSS_METRICS:
        return
    finite = matrix[np.isfinite(matrix)]
    if finite.size == 0:
        return
    if higher_is_better and finite.max() > _SIGN_TOLERANCE:
        raise ValueError(
            f"metric={metric!r} with higher_is_better=True, but a value is {finite.max():.4g} > 0:"
            " these look like losses; pass higher_is_better=False or negate them."
        )
    if not higher_is_better and finite.min() < -_SIGN_TOLERANCE:
        raise ValueError(
            f"metric={metric!r} with higher_is_better=False, but a value is {finite.min():.4g} < 0:"
            " these look like negated losses; pass higher_is_better=True or the raw loss."
        )


def _quantities(full: np.ndarray, per_k: np.ndarray) -> dict[str, np.ndarray]:
    """`factors` plus shift_gap, from qualities ``full`` (``[1]`` or ``[B, 1]``) and ``per_k``
    (``[..., 5, K]``, conditions in `CONDITIONS` order)."""
    full = np.broadcast_to(full, per_k[..., 0, :].shape)
    cells = dict(zip(CONDITIONS, np.moveaxis(per_k, -2, 0), strict=True))
    quantities = factors(
        full=full,
        truncate=cells["truncate"],
        calibrate_truncate=cells["calibrate_truncate"],
        replay=cells["replay"],
        calibrate_replay=cells["calibrate_replay"],
    )
    quantities["shift_gap"] = np.asarray(full - cells["shift"])
    return quantities


def _shares(
    point: dict[str, np.ndarray],
    sampled: dict[str, np.ndarray],
    used: np.ndarray,
    confidence: float,
) -> dict[str, float]:
    def share(quantities: dict[str, np.ndarray], name: str) -> np.ndarray:
        gap_area = quantities["gap"][..., used].sum(axis=-1)
        area = quantities[name][..., used].sum(axis=-1)
        safe = np.where(gap_area == 0, 1.0, gap_area)
        return np.where(gap_area == 0, np.nan, area / safe)

    shares: dict[str, float] = {}
    for name in FACTORS:
        if not used.any():
            shares.update({name: math.nan, f"{name}_lo": math.nan, f"{name}_hi": math.nan})
            continue
        low, high = percentile_interval(share(sampled, name)[:, None], confidence)
        shares.update(
            {
                name: float(share(point, name)),
                f"{name}_lo": float(low[0]),
                f"{name}_hi": float(high[0]),
            }
        )
    return shares


def _truncation_slope(
    grid: tuple[int, ...],
    n_iterations: int,
    means: np.ndarray,
    draws: np.ndarray,
    confidence: float,
) -> tuple[float, float, float]:
    """Least-squares slope of quality against k / r: truncate(k) for k < r, plus (1, full)."""
    # Column 0 is full; truncate(k) sits in columns 1..len(grid).
    points = [(k / n_iterations, 1 + i) for i, k in enumerate(grid) if k < n_iterations]
    points.append((1.0, 0))
    points = [(x, column) for x, column in points if np.isfinite(means[column])]
    if len(points) < 2:
        return math.nan, math.nan, math.nan
    x = np.array([p[0] for p in points])
    columns = [p[1] for p in points]
    centred = x - x.mean()
    weights = centred / (centred @ centred)  # the slope is linear in y: slope = weights @ y
    low, high = percentile_interval((draws[:, columns] @ weights)[:, None], confidence)
    return float(means[columns] @ weights), float(low[0]), float(high[0])


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


def _plain(value: object, where: str) -> Any:
    """``value`` as plain JSON-like Python (dict/list/str/bool/int/float), None read as NaN."""
    if value is None:
        return math.nan
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, str):
        return value
    if isinstance(value, np.ndarray):
        return _plain(value.tolist(), where)
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise ValueError(f"{where} has key {key!r}; JSON keys must be str.")
        return {key: _plain(item, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise ValueError(f"{where} is a {type(value).__name__} ({value!r}), which JSON cannot hold.")


def _to_json(value: Any) -> Any:
    """``value`` in strict-JSON form: NaN (and None) -> None, +-inf -> "Infinity" / "-Infinity"."""
    return _encode_floats(_plain(value, "results"))


def _encode_floats(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _encode_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_encode_floats(item) for item in value]
    return value


def _from_json(value: Any) -> Any:
    """Inverse of `_to_json` for free-form dicts: None -> NaN, "Infinity" -> inf."""
    if value is None or (isinstance(value, str) and value in ("Infinity", "-Infinity")):
        return _decode_float(value)
    if isinstance(value, dict):
        return {key: _from_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_from_json(item) for item in value]
    return value


def _decode_float(value: Any) -> float:
    if value is None:
        return math.nan
    if value == "Infinity":
        return math.inf
    if value == "-Infinity":
        return -math.inf
    return float(value)


def _decode_floats(values: Iterable[Any]) -> np.ndarray:
    return np.array([_decode_float(value) for value in values], dtype=np.float64)
