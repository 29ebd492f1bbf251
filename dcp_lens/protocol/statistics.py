"""Interval estimates used across dcp-lens: the paired bootstrap over evaluation examples (the
protocol's intervals) and Student's t over seeds (the training intervention's intervals)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from jaxtyping import Float
from scipy import stats

from dcp_lens.utils.bounds import check_allocation

# Largest index matrix built at once (entries); bounds memory for large evaluation sets.
_INDEX_BUDGET = 1 << 22


def paired_bootstrap_means(
    values: Float[np.ndarray, "n_examples n_cells"], n_bootstrap: int, seed: int
) -> Float[np.ndarray, "n_bootstrap n_cells"]:
    """Means of every cell over bootstrap resamples of the examples, paired across cells.

    Draw i resamples n example indices with replacement once and averages every column over those
    same indices. A column holding any non-finite value is NaN in every draw.

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
    finite = np.isfinite(values).all(axis=0)
    clean = np.where(finite, values, 0.0).astype(np.float64)
    rng = np.random.default_rng(seed)
    draws = np.empty((n_bootstrap, n_cells), dtype=np.float64)
    rows_per_chunk = max(1, _INDEX_BUDGET // n_examples)
    for start in range(0, n_bootstrap, rows_per_chunk):
        rows = min(rows_per_chunk, n_bootstrap - start)
        index = rng.integers(0, n_examples, size=(rows, n_examples))
        # Counts per (draw, example) turn "average over resampled indices" into one matmul.
        flat = (index + n_examples * np.arange(rows)[:, None]).ravel()
        counts = np.bincount(flat, minlength=rows * n_examples).reshape(rows, n_examples)
        draws[start : start + rows] = (counts.astype(np.float64) @ clean) / n_examples
    draws[:, ~finite] = np.nan
    return draws


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
