"""Interval estimates used across dcp-lens: the paired bootstrap over evaluation examples (the
protocol's intervals) and Student's t over seeds (the training intervention's intervals)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from jaxtyping import Bool, Float
from scipy import stats

from dcp_lens.utils.bounds import check_allocation

# Largest index matrix built at once (entries); bounds memory for large evaluation sets.
_INDEX_BUDGET = 1 << 22


def paired_bootstrap_means(
    values: Float[np.ndarray, "n_examples n_cells"],
    n_bootstrap: int,
    seed: int,
    read: Bool[np.ndarray, "n_examples n_cells"] | None = None,
) -> Float[np.ndarray, "n_bootstrap n_cells"]:
    """Means of every cell over bootstrap resamples of the examples, paired across cells.

    Draw i resamples n example indices with replacement once and averages every column over those
    same indices. A column holding any non-finite value is NaN in every draw. With ``read``, a
    column is averaged over the resampled indices where it was read (its other entries are
    ignored, whatever they hold): a cell read on a subsample of the examples is resampled
    jointly with the others, the draw's own count of its examples in the denominator (NaN in
    a draw that resamples none of them).

    Args:
        values: ``[n, cells]`` per-example values.
        read: ``[n, cells]`` where each cell was read (None: everywhere).

    Returns:
        ``[n_bootstrap, n_cells]`` float64 resampled means.
    """
    n_examples, n_cells = values.shape
    if n_examples == 0:
        raise ValueError("values has 0 examples; the bootstrap needs at least one.")
    if n_bootstrap < 0:
        raise ValueError(f"n_bootstrap={n_bootstrap} must be >= 0.")
    check_allocation(
        8 * n_bootstrap * n_cells, f"n_bootstrap={n_bootstrap} draws of {n_cells} cells"
    )
    finite = finite_where_read(values, read)
    clean = np.where(finite & _everywhere(read, values.shape), values, 0.0).astype(np.float64)
    rng = np.random.default_rng(seed)
    draws = np.empty((n_bootstrap, n_cells), dtype=np.float64)
    rows_per_chunk = max(1, _INDEX_BUDGET // n_examples)
    for start in range(0, n_bootstrap, rows_per_chunk):
        rows = min(rows_per_chunk, n_bootstrap - start)
        index = rng.integers(0, n_examples, size=(rows, n_examples))
        # Counts per (draw, example) turn "average over resampled indices" into one matmul.
        flat = (index + n_examples * np.arange(rows)[:, None]).ravel()
        counts = np.bincount(flat, minlength=rows * n_examples).reshape(rows, n_examples)
        weights = counts.astype(np.float64)
        if read is None:
            draws[start : start + rows] = (weights @ clean) / n_examples
        else:
            with np.errstate(invalid="ignore", divide="ignore"):
                draws[start : start + rows] = (weights @ clean) / (weights @ read)
    draws[:, ~finite] = np.nan
    return draws


def read_means(
    values: Float[np.ndarray, "n_examples n_cells"],
    read: Bool[np.ndarray, "n_examples n_cells"] | None = None,
) -> Float[np.ndarray, " n_cells"]:
    """Each column's mean over the examples where it was read (``read``; None: every example),
    NaN where a read value is non-finite or none was read: the point `paired_bootstrap_means`
    resamples."""
    finite = finite_where_read(values, read)
    where = _everywhere(read, values.shape)
    total = np.where(finite & where, values, 0.0).astype(np.float64).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = total / where.sum(axis=0) if read is not None else total / values.shape[0]
    means[~finite] = np.nan
    return np.asarray(means)


def partnered_estimates(
    values: Float[np.ndarray, "n_examples n_cells"],
    read: Bool[np.ndarray, "n_examples n_cells"],
    partners: Sequence[Sequence[int]],
    n_bootstrap: int,
    seed: int,
) -> tuple[Float[np.ndarray, " n_cells"], Float[np.ndarray, "n_bootstrap n_cells"]]:
    """Cell means and paired bootstrap draws where some cells were read on a subsample of the
    examples: such a cell is estimated as its partner's mean over every example plus its own
    difference from the partner on the examples where it was read (the difference estimator
    of two-phase sampling), so that every comparison with the partner is paired. A cell's
    partner is the first of ``partners[j]`` read on every example and finite where cell j was
    read; without one, the cell's mean over its own examples. Cells read everywhere are plain
    means. The draws resample the examples once for every cell (`paired_bootstrap_means`).

    Args:
        values: ``[n, cells]`` per-example values (ignored where not read).
        read: ``[n, cells]`` where each cell was read.
        partners: per cell, the columns it may be compared with, in order of preference.

    Returns:
        ``([cells], [n_bootstrap, cells])`` float64 means and draws.
    """
    read = np.asarray(read, bool)
    everywhere = np.asarray(read.all(axis=0))
    differences = np.array(values, dtype=np.float64)
    chosen: list[tuple[int, int]] = []
    for column in (int(c) for c in np.flatnonzero(~everywhere)):
        rows = read[:, column]
        for partner in partners[column]:
            if everywhere[partner] and np.isfinite(values[rows, partner]).all():
                differences[:, column] = values[:, column] - values[:, partner]
                chosen.append((column, partner))
                break
    means = read_means(differences, read)
    draws = paired_bootstrap_means(differences, n_bootstrap, seed, read)
    for cell, partner in chosen:
        means[cell] += means[partner]
        draws[:, cell] += draws[:, partner]
    return means, draws


def _everywhere(read: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    return np.ones(shape, bool) if read is None else np.asarray(read, bool)


def finite_where_read(values: np.ndarray, read: np.ndarray | None) -> np.ndarray:
    """``[n_cells]``: every value the column read is finite."""
    return np.asarray((np.isfinite(values) | ~_everywhere(read, values.shape)).all(axis=0))


def percentile_interval(draws: np.ndarray, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval over axis 0, ignoring NaN draws; NaN where no draw is defined."""
    low = np.full(draws.shape[1:], np.nan)
    high = np.full(draws.shape[1:], np.nan)
    defined = ~np.isnan(draws).all(axis=0) if draws.shape[0] else np.zeros(low.shape, bool)
    if defined.any():
        tail = 50.0 * (1.0 - confidence)
        low[defined], high[defined] = np.nanpercentile(
            draws[:, defined], [tail, 100.0 - tail], axis=0
        )
    return low, high


def t_interval(values: Sequence[float] | np.ndarray, confidence: float) -> tuple[float, float]:
    """``mean -+ t_{(1 + confidence) / 2, n - 1} * sd / sqrt(n)`` of ``values`` (n >= 2)."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1 or len(values) < 2:
        raise ValueError(f"a t-interval needs >= 2 values, got shape {values.shape}.")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must lie strictly between 0 and 1.")
    mean = float(values.mean())
    half = float(stats.t.ppf((1 + confidence) / 2, len(values) - 1))
    half *= float(values.std(ddof=1)) / math.sqrt(len(values))
    return mean - half, mean + half
