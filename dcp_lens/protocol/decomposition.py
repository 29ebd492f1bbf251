"""The DCP decomposition (docs/design.md §4): split the truncation gap into S, B and D.

For one model and one metric, per-example values Q (higher is better) on the *same* evaluation
examples in every cell (a paired design): gap, S (readout shift), B (block applications), D
(distinct computation) and I_BS (the order term) are `dcp_lens.protocol.equations.factors` of the
cells' Q, so that S + B + D == gap exactly, and ``shift_gap(k) = Q(full) - Q(shift(k))`` is the
positive control set against S(k). Q of a cell is the mean over examples. Intervals are paired
bootstrap percentile intervals (`dcp_lens.protocol.statistics`): each draw resamples example
indices once and recomputes every cell from those same indices. This module is the math only;
the result, `dcp_lens.protocol.results.Decomposition`, holds the tables and the
``results.json`` records.

Conventions:

- *Units.* Condition curves are in the metric's own units, as passed. Everything derived (gap, S,
  B, D, I_BS, shift_gap, shares, truncation slope) is in quality units,
  ``Q = value if higher_is_better else -value``, so a positive gap always means truncation hurts.
- *Area.* The area of a quantity over the k grid is the plain sum over the grid's k (each k weighs
  the same; it works for a single k and uneven grids alike); ``share_X = area(X) / area(gap)``,
  NaN where the gap's area is exactly 0.
- *Non-finite values.* A cell (condition, k) holding any non-finite per-example value is flagged in
  ``nonfinite`` and its mean is NaN (never a mean over the finite subset, which would break the
  pairing); so is every quantity that uses it, with NaN intervals. Shares are taken over the k where
  every cell of the decomposition (a, b, c, d, e) is finite, listed in ``share_k_grid``; the
  truncation slope skips NaN points.
- *Further conditions.* Conditions registered in the sweep beyond the five
  (`dcp_lens.protocol.conditions`) are passed in ``values`` too; they get curves with intervals
  and take no part in the factors.
- *The S bracket.* Where ``values`` hold every condition of
  `dcp_lens.protocol.bracket.BRACKET_CONDITIONS` (the translators and the base rate) and
  ``n_bootstrap >= 1``, the bracket (docs/bracket.md) is computed from the same means and the same
  paired bootstrap draws; it sets ``s_identified`` / ``b_identified`` per k (the bracket is
  narrow) and holds ``S_lower`` / ``S_upper`` and the verdict of the shares. The point shares
  ``S``, ``B``, ``D`` (and their intervals) are then the lower end's decomposition (S
  discounted by the base rate, with the B and D that go with it); the per-k cells stay the
  calibrated, undiscounted quantities above.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from jaxtyping import Shaped

from dcp_lens.protocol.bracket import (
    BRACKET_CONDITIONS,
    Bracket,
    BracketRule,
    bracket,
    cell_estimates,
    read_matrix,
)
from dcp_lens.protocol.conditions import DECOMPOSED
from dcp_lens.protocol.equations import factors, share_of_gap
from dcp_lens.protocol.metrics import LOSS_METRICS
from dcp_lens.protocol.results import BRACKET_ROW_KEYS, FACTORS, QUANTITIES, Decomposition
from dcp_lens.protocol.statistics import (
    finite_where_read,
    percentile_interval,
)

QualityVector = Shaped[np.ndarray, "_n_examples"] | Shaped[torch.Tensor, "_n_examples"]

# Loss values within this of zero are accepted with either sign (float error in KL).
_SIGN_TOLERANCE = 1e-6


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
    walked: Mapping[str, Mapping[int, QualityVector]] | None = None,
    jackknife: Sequence[Mapping[str, Mapping[int, QualityVector]]] = (),
    jackknife_rows: QualityVector | None = None,
    replay_same: Mapping[int, bool] | None = None,
    read: Mapping[str, QualityVector] | None = None,
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
            each condition of `DECOMPOSED` in that order with its k in ascending order, then any
            further condition in the order of ``values``.
        confidence: coverage of the percentile intervals.
        walked: `dcp_lens.protocol.sweep.walk_fractions`' records (``fraction`` and per top-1
            metric, ``{k: [n]}``): replay's gain over truncate on the positions where replay
            walks is the bracket's ``walk_gain`` (None: not measured).
        jackknife: per left-out calibration group G, ``{condition: {k: [m]}}``: the conditions
            whose maps were refitted without the group, on the ``m`` examples ``jackknife_rows``
            (indices into the ``n``). Every bootstrap draw b is shifted by group ``b mod G``'s
            deviation of the cell means from the groups' mean, times ``sqrt(G - 1)``, so that
            the draws' spread adds the jackknife variance of the fit to the resampling of the
            examples (docs/bracket.md, "The calibration split in the intervals").
        replay_same: per k, whether replay(k) reads out as truncate(k) up to float error (the
            sweep's ``replay_difference`` within
            `dcp_lens.protocol.verdicts.B_IDENTIFICATION_TOLERANCE`): B is then 0 by
            construction and not identified there (None: not known).
        read: per condition read on a subsample of the examples, ``[n]`` bool: where it was
            read (its other entries, NaN as the sweep leaves them, are ignored); a condition
            not named was read on every example. Such a cell's mean is its partner's
            (`dcp_lens.protocol.conditions.SUBSAMPLED_CONTROLS`: full depth for shift, the
            calibrated cell for a translator) plus its paired difference from the partner on
            its own examples, in the point and in every bootstrap draw
            (`dcp_lens.protocol.statistics.partnered_estimates`; docs/bracket.md).

    Returns:
        A `Decomposition`.
    """
    grid = _check_k_grid(k_grid, n_iterations)
    _check_settings(metric, n_bootstrap, confidence)
    conditions = (*DECOMPOSED, *(c for c in values if c not in ("full", *DECOMPOSED)))
    matrix = _value_matrix(values, grid, conditions)
    where = read_matrix(read, conditions, grid, matrix.shape[0])
    if where is not None:
        matrix = np.where(where, matrix, np.nan)
    _check_sign(matrix, metric, higher_is_better)

    n_k = len(grid)
    finite = finite_where_read(matrix, where)
    means, draws = cell_estimates(matrix, where, conditions, grid, n_bootstrap, seed)
    if jackknife and n_bootstrap:
        deviations = _jackknife_deviations(matrix, conditions, grid, jackknife, jackknife_rows)
        draws = draws + deviations[np.arange(n_bootstrap) % len(deviations)]
    sign = 1.0 if higher_is_better else -1.0
    walk_gain = None
    if walked is not None and all(k in walked.get("fraction", {}) for k in grid):
        # Replay's gain on walking positions: counted per position for the top-1 metrics, and
        # as the walking fraction of the example's gain for the others.
        def gain(k: int) -> np.ndarray:
            if metric in walked:
                return _as_vector(walked[metric][k], f"walked[{metric!r}][{k}]")
            replayed = _column(matrix, conditions, "replay", grid, k)
            truncated = _column(matrix, conditions, "truncate", grid, k)
            return (replayed - truncated) * _as_vector(walked["fraction"][k], "walked")

        walk_gain = np.array([sign * float(np.mean(gain(k))) for k in grid])

    decomposed_columns = slice(1, 1 + len(DECOMPOSED) * n_k)
    point = _quantities(
        sign * means[:1], sign * means[decomposed_columns].reshape(len(DECOMPOSED), n_k)
    )
    sampled = _quantities(
        sign * draws[:, :1],
        sign * draws[:, decomposed_columns].reshape(n_bootstrap, len(DECOMPOSED), n_k),
    )
    cells: dict[str, np.ndarray] = {}
    for name in QUANTITIES:
        low, high = percentile_interval(sampled[name], confidence)
        cells.update({name: point[name], f"{name}_lo": low, f"{name}_hi": high})

    curves: dict[str, np.ndarray] = {}
    nonfinite: dict[str, np.ndarray] = {}
    condition_low, condition_high = percentile_interval(draws, confidence)
    for i, condition in enumerate(conditions):
        columns = slice(1 + i * n_k, 1 + (i + 1) * n_k)
        curves[condition] = means[columns]
        curves[f"{condition}_lo"] = condition_low[columns]
        curves[f"{condition}_hi"] = condition_high[columns]
        nonfinite[condition] = ~finite[columns]

    decomposed = ~np.isnan(np.stack([point[name] for name in ("gap", "S", "B", "D")])).any(axis=0)
    shares = _shares(point, sampled, decomposed, confidence)
    gap_area, gap_low, gap_high = (
        shares.pop(key, math.nan) for key in ("gap_area", "gap_area_lo", "gap_area_hi")
    )
    slope = _truncation_slope(grid, n_iterations, sign * means, sign * draws, confidence)
    same = None if replay_same is None else [bool(replay_same.get(k, False)) for k in grid]
    bracketed = _bracket(conditions, grid, sign * means, sign * draws, confidence, walk_gain, same)
    identified: dict[str, object] = {}
    if bracketed is not None:
        # The point shares are the lower end's decomposition (S discounted, with its B and D).
        for factor in FACTORS:
            for suffix in ("", "_lo", "_hi"):
                shares[f"{factor}{suffix}"] = bracketed.shares[f"{factor}_point{suffix}"]
        identified = {
            "s_identified": bracketed.per_k["S_identified"],
            "b_identified": bracketed.per_k["B_identified"],
            "bracket": {key: v for key, v in bracketed.per_k.items() if key in BRACKET_ROW_KEYS},
            "bracket_shares": bracketed.record(),
        }
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
        conditions=conditions,
        gap_area=gap_area,
        gap_area_lo=gap_low,
        gap_area_hi=gap_high,
        **identified,  # type: ignore[arg-type]
    )


# ----------------------------------------------------------------------------- internals


def _bracket(
    conditions: tuple[str, ...],
    grid: tuple[int, ...],
    qualities: np.ndarray,
    draws: np.ndarray,
    confidence: float,
    walk_gain: np.ndarray | None = None,
    replay_same: Sequence[bool] | None = None,
) -> Bracket | None:
    """The S bracket from the decomposition's own cell means ``qualities`` ``[columns]`` and
    bootstrap draws ``[n_bootstrap, columns]`` (quality units, columns as `_value_matrix`);
    None where a bracket condition was not swept or there are no draws."""
    if not set(BRACKET_CONDITIONS) <= set(conditions) or draws.shape[0] < 1:
        return None
    n_k = len(grid)

    def cells(array: np.ndarray) -> dict[str, np.ndarray]:
        split = {"full": np.repeat(array[..., :1], n_k, axis=-1)}
        for name in BRACKET_CONDITIONS:
            i = conditions.index(name)
            split[name] = array[..., 1 + i * n_k : 1 + (i + 1) * n_k]
        return split

    rule = BracketRule(confidence=confidence)
    return bracket(
        cells(qualities),
        cells(draws),
        grid,
        rule=rule,
        walk_gain=walk_gain,
        replay_same=replay_same,
    )


def _column(
    matrix: np.ndarray, conditions: tuple[str, ...], name: str, grid: tuple[int, ...], k: int
) -> np.ndarray:
    """The ``[n]`` column of condition ``name`` at ``k`` in `_value_matrix`'s layout."""
    return matrix[:, 1 + conditions.index(name) * len(grid) + grid.index(k)]


def _jackknife_deviations(
    matrix: np.ndarray,
    conditions: tuple[str, ...],
    grid: tuple[int, ...],
    jackknife: Sequence[Mapping[str, Mapping[int, QualityVector]]],
    rows: QualityVector | None,
) -> np.ndarray:
    """``[G, columns]``: per left-out group, ``sqrt(G - 1)`` times the deviation of each
    refitted column's mean (on the jackknife's rows) from the groups' mean; 0 for columns no
    group refits. Its mean square over groups is the jackknife variance of the column means."""
    n_groups = len(jackknife)
    deviations = np.zeros((n_groups, matrix.shape[1]))
    if n_groups < 2 or rows is None:
        return deviations
    m = len(_as_vector(rows, "jackknife_rows"))
    for i, condition in enumerate(conditions):
        for j, k in enumerate(grid):
            vectors = [group.get(condition, {}).get(k) for group in jackknife]
            if any(vector is None for vector in vectors):
                continue
            means = np.array(
                [
                    float(np.mean(_as_vector(vector, f"jackknife[{condition}][{k}]")))
                    for vector in vectors
                ]
            )
            if len(_as_vector(vectors[0], "jackknife")) != m or not np.isfinite(means).all():
                continue
            spread = means - means.mean()
            # Groups that agree to rounding add nothing (no interval moves off its point).
            spread[np.abs(spread) <= 1e-12 * max(1.0, float(np.abs(means).max()))] = 0.0
            deviations[:, 1 + i * len(grid) + j] = math.sqrt(n_groups - 1) * spread
    return deviations


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
    values: Mapping[str, QualityVector | Mapping[int, QualityVector]],
    grid: tuple[int, ...],
    conditions: tuple[str, ...],
) -> np.ndarray:
    """``[n, 1 + len(conditions) * len(grid)]``: full, then each condition's k in grid order."""
    missing = [c for c in ("full", *DECOMPOSED) if c not in values]
    if missing:
        further = [c for c in conditions if c not in DECOMPOSED]
        raise ValueError(
            f"values is missing conditions {missing}; expected all of {('full', *DECOMPOSED)}"
            f" (further conditions given: {further})."
        )
    full = values["full"]
    if isinstance(full, Mapping):
        raise ValueError("values['full'] must be one vector (full depth has no k), not a dict.")
    columns = [_as_vector(full, "values['full']")]
    n_examples = columns[0].shape[0]
    if n_examples == 0:
        raise ValueError("values['full'] has 0 examples; the evaluation set is empty.")
    for condition in conditions:
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
    (``[..., 5, K]``, conditions in `DECOMPOSED` order)."""
    full = np.broadcast_to(full, per_k[..., 0, :].shape)
    cells = dict(zip(DECOMPOSED, np.moveaxis(per_k, -2, 0), strict=True))
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
        return share_of_gap(quantities[name], quantities["gap"], used)

    shares: dict[str, float] = {}
    if used.any():
        low, high = percentile_interval(sampled["gap"][..., used].sum(axis=-1)[:, None], confidence)
        shares.update(
            gap_area=float(point["gap"][..., used].sum()),
            gap_area_lo=float(low[0]),
            gap_area_hi=float(high[0]),
        )
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
