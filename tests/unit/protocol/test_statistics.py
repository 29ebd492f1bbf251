"""Means and paired bootstrap draws of cells read on a subsample of the examples: each such
cell is its partner's mean plus its paired difference from the partner where it was read, and
what it holds where it was not read is never used."""

from __future__ import annotations

import numpy as np
import pytest

from dcp_lens.protocol.statistics import paired_bootstrap_means, partnered_estimates, read_means


def _cells(n: int = 400, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two cells sharing a per-example level: the partner (read everywhere) and a control that
    is the partner plus 0.1 plus small noise, read on the first quarter; inf elsewhere."""
    rng = np.random.default_rng(seed)
    level = rng.normal(size=n)
    partner = level + 0.05 * rng.normal(size=n)
    control = partner + 0.1 + 0.01 * rng.normal(size=n)
    read = np.ones((n, 2), bool)
    read[n // 4 :, 1] = False
    values = np.stack([partner, np.where(read[:, 1], control, np.inf)], axis=1)
    return values, read


def test_a_subsampled_cell_is_its_partner_plus_the_paired_difference_where_read() -> None:
    values, read = _cells()
    means, draws = partnered_estimates(values, read, [[], [0]], n_bootstrap=400, seed=1)
    rows = read[:, 1]
    expected = values[:, 0].mean() + (values[rows, 1] - values[rows, 0]).mean()
    assert means[1] == pytest.approx(expected, abs=1e-12)
    assert means[0] == pytest.approx(values[:, 0].mean(), abs=1e-12)
    assert np.isfinite(draws).all()  # the inf where it was not read is never read
    # Paired: the difference's draws spread as the difference's noise (0.01), far below the
    # shared level's (1.0) that a comparison of unpaired means would carry.
    difference = draws[:, 1] - draws[:, 0]
    assert difference.std() < 0.01
    unpaired = read_means(values, read)
    assert unpaired[1] == pytest.approx(values[rows, 1].mean())
    assert np.isfinite(unpaired).all()


def test_without_a_finite_partner_the_cell_is_its_own_mean_where_read() -> None:
    values, read = _cells()
    values[0, 0] = np.nan  # the partner is not finite where the control was read
    means, draws = partnered_estimates(values, read, [[], [0]], n_bootstrap=50, seed=1)
    assert np.isnan(means[0]) and np.isnan(draws[:, 0]).all()
    assert means[1] == pytest.approx(values[read[:, 1], 1].mean(), abs=1e-12)
    assert np.isfinite(draws[:, 1]).all()


def test_read_everywhere_gives_the_plain_means_and_draws() -> None:
    rng = np.random.default_rng(2)
    values = rng.normal(size=(300, 3))
    everywhere = np.ones_like(values, bool)
    plain = paired_bootstrap_means(values, 100, 5)
    masked = paired_bootstrap_means(values, 100, 5, everywhere)
    np.testing.assert_allclose(masked, plain, rtol=0, atol=1e-12)
    means, draws = partnered_estimates(values, everywhere, [[], [0], [0]], 100, 5)
    np.testing.assert_allclose(draws, plain, rtol=0, atol=1e-12)
    np.testing.assert_allclose(means, values.mean(axis=0), rtol=0, atol=1e-12)


def test_a_non_finite_value_where_read_makes_the_cell_nan() -> None:
    values, read = _cells()
    values[3, 1] = np.nan  # inside the read quarter
    means, draws = partnered_estimates(values, read, [[], [0]], 20, 0)
    assert np.isnan(means[1]) and np.isnan(draws[:, 1]).all() and np.isfinite(means[0])
