"""The DCP decomposition: its identity, planted answers, the paired bootstrap, non-finite cells
and input errors. Pure numbers; no model is built (the results' round trips:
tests/unit/protocol/test_results.py)."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable

import numpy as np
import pytest

from dcp_lens.protocol.conditions import DECOMPOSED as CONDITIONS
from dcp_lens.protocol.decomposition import decompose
from dcp_lens.protocol.equations import factors
from dcp_lens.protocol.results import (
    ProtocolResults,
)
from dcp_lens.protocol.statistics import paired_bootstrap_means

R = 8
GRID = (1, 2, 4, 6)


def planted_gap(k: int) -> float:
    return 0.4 * (1 - k / R)


def build_values(
    cell: Callable[[str, int], np.ndarray], grid: tuple[int, ...] = GRID
) -> dict[str, object]:
    """``cell(condition, k)`` for every per-k condition and k; ``cell("full", R)`` for full."""
    values: dict[str, object] = {"full": cell("full", R)}
    for condition in CONDITIONS:
        values[condition] = {k: cell(condition, k) for k in grid}
    return values


def noisy_values(
    planted: str, n: int = 2000, seed: int = 0, noise: float = 0.25, spread: float = 1.0
) -> dict[str, object]:
    """Per-example qualities: a shared per-example level, a planted mean effect, own noise.

    Cells that the planted factor repairs sit at the full-depth mean 0, the others at
    -planted_gap(k); ``planted`` is "S" (calibration repairs), "B" (replay repairs) or "D"."""
    rng = np.random.default_rng(seed)
    level = spread * rng.normal(size=n)
    repaired = {
        "S": {"calibrate_truncate", "calibrate_replay"},
        "B": {"replay", "calibrate_replay"},
    }
    repaired["D"] = set()

    def cell(condition: str, k: int) -> np.ndarray:
        mean = 0.0 if condition in repaired[planted] | {"full", "shift"} else -planted_gap(k)
        return level + mean + noise * rng.normal(size=n)

    return build_values(cell)


def value_matrix(values: dict[str, object], grid: tuple[int, ...] = GRID) -> np.ndarray:
    """The column layout `decompose` documents: full, then each condition's k ascending."""
    columns = [values["full"]] + [values[c][k] for c in CONDITIONS for k in grid]  # type: ignore[index]
    return np.stack(columns, axis=1).astype(np.float64)


def factors_from_draws(draws: np.ndarray) -> dict[str, np.ndarray]:
    """`factors` of every draw of a matrix laid out as `value_matrix`: ``[draws, k]`` each."""
    full = np.broadcast_to(draws[:, :1], (draws.shape[0], len(GRID)))
    per_condition = np.split(draws[:, 1:], len(CONDITIONS), axis=1)
    cells = dict(zip(CONDITIONS, per_condition, strict=True))
    return factors(
        full=full,
        truncate=cells["truncate"],
        calibrate_truncate=cells["calibrate_truncate"],
        replay=cells["replay"],
        calibrate_replay=cells["calibrate_replay"],
    )


# ----------------------------------------------------------------------------- the identity


def test_identity_holds_per_k_and_in_every_bootstrap_draw() -> None:
    rng = np.random.default_rng(1)
    values = build_values(lambda c, k: rng.normal(loc=rng.normal(), scale=3.0, size=500))
    result = decompose(values, GRID, n_iterations=R, n_bootstrap=300, seed=4)
    cells = result.cells
    np.testing.assert_allclose(
        cells["S"] + cells["B"] + cells["D"], cells["gap"], rtol=0, atol=1e-9
    )

    draws = paired_bootstrap_means(value_matrix(values), 300, seed=4)
    sampled = factors_from_draws(draws)
    residual = sampled["S"] + sampled["B"] + sampled["D"] - sampled["gap"]
    assert np.abs(residual).max() <= 1e-9
    # decompose's intervals are the percentiles of exactly these paired draws.
    for name in ("gap", "S", "B", "D", "I_BS"):
        low, high = np.percentile(sampled[name], [2.5, 97.5], axis=0)
        np.testing.assert_allclose(cells[f"{name}_lo"], low, rtol=0, atol=1e-12)
        np.testing.assert_allclose(cells[f"{name}_hi"], high, rtol=0, atol=1e-12)


def test_factors_match_the_formulas_on_scalars() -> None:
    a, b, c, d, e = (np.array(v) for v in (0.1, 0.5, 0.2, 0.7, 0.9))
    out = factors(full=e, truncate=a, calibrate_truncate=b, replay=c, calibrate_replay=d)
    assert out["gap"] == pytest.approx(0.8)
    assert out["S"] == pytest.approx(((0.5 - 0.1) + (0.7 - 0.2)) / 2)
    assert out["B"] == pytest.approx(((0.2 - 0.1) + (0.7 - 0.5)) / 2)
    assert out["D"] == pytest.approx(0.2)
    assert out["I_BS"] == pytest.approx((0.7 - 0.2) - (0.5 - 0.1))


# ----------------------------------------------------------------------------- planted answers

# For each planted factor, the cells equal to full (the rest equal truncate).
EXACT_CASES = {
    "S": {"calibrate_truncate", "calibrate_replay"},  # (i) only calibration helps: b = d = e, a = c
    "B": {"replay", "calibrate_replay"},  # (ii) only replay helps: c = d = e, a = b
    "D": set(),  # (iii) nothing helps: a = b = c = d
}


@pytest.mark.parametrize("planted", ["S", "B", "D"])
def test_exact_single_factor_cases_get_the_whole_gap(planted: str) -> None:
    rng = np.random.default_rng(2)
    full = rng.uniform(size=400)
    drop = {k: rng.uniform(size=400) * planted_gap(k) * 2 for k in GRID}

    def cell(condition: str, k: int) -> np.ndarray:
        repaired = condition in EXACT_CASES[planted] | {"full", "shift"}
        return full if repaired else full - drop[k]

    result = decompose(build_values(cell), GRID, n_iterations=R, n_bootstrap=200)
    others = [f for f in ("S", "B", "D") if f != planted]
    np.testing.assert_allclose(result.cells[planted], result.cells["gap"], rtol=0, atol=1e-12)
    assert (result.cells[f"{planted}_lo"] > 0).all()
    for factor in others:
        for key in (factor, f"{factor}_lo", f"{factor}_hi"):
            np.testing.assert_allclose(result.cells[key], 0.0, rtol=0, atol=1e-12)
    assert result.shares[planted] == pytest.approx(1.0, abs=1e-12)
    assert result.shares[f"{planted}_lo"] == pytest.approx(1.0, abs=1e-12)
    for factor in others:
        assert result.shares[factor] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("planted", ["S", "B", "D"])
def test_noisy_planted_factor_meets_the_acceptance_rule(planted: str) -> None:
    result = decompose(noisy_values(planted, seed=5), GRID, n_iterations=R, seed=7)
    others = [f for f in ("S", "B", "D") if f != planted]
    # The acceptance rule: >= 90% of the gap's area, interval excluding 0, others <= 10%.
    assert result.shares[planted] >= 0.9
    assert result.shares[f"{planted}_lo"] > 0
    assert (result.cells[f"{planted}_lo"] > 0).all()
    for factor in others:
        assert abs(result.shares[factor]) <= 0.1
    np.testing.assert_allclose(result.cells["shift_gap"], 0.0, atol=0.03)


@pytest.mark.parametrize("planted", ["S", "B", "D"])
def test_intervals_of_the_other_factors_cover_zero_at_the_nominal_rate(planted: str) -> None:
    """Over independent noisy data sets, the 95% intervals of the factors that are truly 0 contain
    0 about 95% of the time (per k and for the shares); the planted factor's never do."""
    others = [f for f in ("S", "B", "D") if f != planted]
    covered_per_k, covered_share, planted_excluded = [], [], []
    for replicate in range(60):
        values = noisy_values(planted, n=300, seed=1000 + replicate)
        result = decompose(values, GRID, n_iterations=R, n_bootstrap=400, seed=replicate)
        for factor in others:
            cells = result.cells
            covered_per_k += list((cells[f"{factor}_lo"] <= 0) & (cells[f"{factor}_hi"] >= 0))
            shares = result.shares
            covered_share.append(shares[f"{factor}_lo"] <= 0 <= shares[f"{factor}_hi"])
        planted_excluded.append(result.shares[f"{planted}_lo"] > 0)
    assert 0.88 <= np.mean(covered_per_k) <= 0.99
    assert 0.85 <= np.mean(covered_share) <= 1.0
    assert all(planted_excluded)


def test_truncation_slope_is_the_least_squares_line_through_truncate_and_full() -> None:
    grid = (1, 2, 4, 8)

    def cell(condition: str, k: int) -> np.ndarray:
        if condition == "full":
            return np.full(50, 0.8)
        if condition == "truncate" and k < R:
            return np.full(50, 0.2 + 0.6 * k / R)
        return np.zeros(50)  # truncate(r) is not a point of the fit: (1, full) is

    result = decompose(build_values(cell, grid), grid, n_iterations=R, n_bootstrap=20)
    assert result.truncation_slope == pytest.approx(0.6, abs=1e-12)
    assert result.truncation_slope_lo == pytest.approx(0.6, abs=1e-12)
    curve = result.truncation_curve()
    assert curve["k"].tolist() == [1, 2, 4, 8]
    np.testing.assert_allclose(curve["quality"], [0.275, 0.35, 0.5, 0.8], atol=1e-12)


def test_losses_are_negated_into_qualities_but_curves_keep_their_units() -> None:
    rng = np.random.default_rng(3)

    def cell(condition: str, k: int) -> np.ndarray:
        loss = 1.0 if condition == "full" else 1.0 + 2 * planted_gap(k)
        return loss + 0.1 * rng.uniform(size=300)

    result = decompose(
        build_values(cell), GRID, n_iterations=R, metric="cross_entropy", higher_is_better=False
    )
    assert (result.cells["gap"] > 0).all()
    assert result.truncation_slope > 0
    assert result.full == pytest.approx(1.05, abs=0.01)
    assert (result.curves["truncate"] > result.full).all()


# ----------------------------------------------------------------------------- pairing


def test_identical_cells_give_a_zero_width_interval() -> None:
    """truncate == full per example: every paired draw has gap exactly 0; unpaired would not."""
    rng = np.random.default_rng(4)
    full = rng.normal(size=300)
    values = build_values(lambda c, k: full if c in ("full", "truncate") else full + 1.0)
    result = decompose(values, GRID, n_iterations=R, n_bootstrap=500)
    assert (result.cells["gap_lo"] == 0).all() and (result.cells["gap_hi"] == 0).all()


def test_paired_intervals_are_much_narrower_than_unpaired_on_correlated_cells() -> None:
    values = noisy_values("S", n=1000, seed=8, noise=0.05, spread=2.0)
    result = decompose(values, GRID, n_iterations=R, n_bootstrap=1000, seed=1)
    paired_width = result.cells["S_hi"] - result.cells["S_lo"]

    # Unpaired: every cell resampled with its own indices.
    matrix = value_matrix(values)
    columns = [
        paired_bootstrap_means(matrix[:, [j]], 1000, seed=100 + j) for j in range(matrix.shape[1])
    ]
    draws = np.concatenate(columns, axis=1)
    unpaired = factors_from_draws(draws)["S"]
    low, high = np.percentile(unpaired, [2.5, 97.5], axis=0)
    assert (paired_width < 0.1 * (high - low)).all()


def test_bootstrap_of_5000_examples_has_no_pathological_cost() -> None:
    # Speed is measured by `dcp-lens bench`; this bound (about 100x the time on an idle machine)
    # only catches a per-draw loop or a quadratic blow-up, and holds on a busy machine.
    rng = np.random.default_rng(5)
    values = build_values(lambda c, k: rng.uniform(size=5000), grid=(1, 2))
    start = time.perf_counter()
    decompose(values, (1, 2), n_iterations=R, n_bootstrap=1000)
    assert time.perf_counter() - start < 60.0


# ----------------------------------------------------------------------------- non-finite cells


def test_non_finite_cells_are_flagged_and_left_out_of_the_shares() -> None:
    values = noisy_values("B", n=500, seed=9)
    values["replay"][1][3] = np.inf  # type: ignore[index]
    values["calibrate_replay"][1][7] = np.nan  # type: ignore[index]
    values["shift"][4][0] = -np.inf  # type: ignore[index]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = decompose(values, GRID, n_iterations=R, n_bootstrap=200)

    flagged = {(c, k) for c in CONDITIONS for i, k in enumerate(GRID) if result.nonfinite[c][i]}
    assert flagged == {("replay", 1), ("calibrate_replay", 1), ("shift", 4)}
    assert not result.full_nonfinite
    for condition in CONDITIONS:
        assert np.isnan(result.curves[condition]).sum() == int((condition, 1) in flagged) + int(
            (condition, 4) in flagged
        )
    for name in ("S", "B", "D", "I_BS", "S_lo", "B_hi", "D_lo"):
        assert np.isnan(result.cells[name][0]) and np.isfinite(result.cells[name][1:]).all()
    assert np.isfinite(result.cells["gap"]).all() and np.isfinite(result.cells["gap_lo"]).all()
    assert np.isnan(result.cells["shift_gap"][2]) and np.isfinite(result.cells["S"][2])

    assert result.share_k_grid == (2, 4, 6)
    used = slice(1, None)
    gap_area = result.cells["gap"][used].sum()
    for factor in ("S", "B", "D"):
        assert result.shares[factor] == pytest.approx(result.cells[factor][used].sum() / gap_area)
        assert np.isfinite(result.shares[f"{factor}_lo"])
    assert sum(result.shares[f] for f in ("S", "B", "D")) == pytest.approx(1.0, abs=1e-12)

    run = ProtocolResults("planted:block_count", "recurrent", R, {"accuracy": result})
    assert run.nonfinite().to_dict("records") == [
        {"metric": "accuracy", "condition": "replay", "k": 1},
        {"metric": "accuracy", "condition": "calibrate_replay", "k": 1},
        {"metric": "accuracy", "condition": "shift", "k": 4},
    ]


def test_shift_read_on_a_subsample_is_paired_with_full_depth_where_read() -> None:
    """A control read on a quarter of the examples (NaN elsewhere, as the sweep leaves it):
    its cells are finite and not flagged, shift_gap is full minus shift on that quarter, and
    with every example read the result is the unmasked one exactly."""
    values = noisy_values("S", n=800, seed=3, noise=0.05, spread=2.0)
    read = np.zeros(800, bool)
    read[::4] = True
    masked = {**values, "shift": {k: np.where(read, v, np.nan) for k, v in values["shift"].items()}}  # type: ignore[union-attr]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = decompose(masked, GRID, n_iterations=R, n_bootstrap=300, read={"shift": read})
    assert not result.nonfinite["shift"].any()
    full = np.asarray(values["full"])
    for i, k in enumerate(GRID):
        shift = np.asarray(values["shift"][k])  # type: ignore[index]
        assert result.cells["shift_gap"][i] == pytest.approx((full - shift)[read].mean())
    low, high = result.cells["shift_gap_lo"], result.cells["shift_gap_hi"]
    assert np.isfinite(low).all() and (high - low < 0.05).all()  # paired: no shared level
    assert np.isfinite([result.shares[f"{f}_{e}"] for f in "SBD" for e in ("lo", "hi")]).all()
    everywhere = decompose(
        values, GRID, n_iterations=R, n_bootstrap=300, read={"shift": read | True}
    )
    plain = decompose(values, GRID, n_iterations=R, n_bootstrap=300)
    for name, cell in plain.cells.items():
        np.testing.assert_array_equal(everywhere.cells[name], cell)


def test_non_finite_full_makes_everything_nan_without_crashing() -> None:
    values = noisy_values("S", n=100)
    values["full"][0] = np.nan  # type: ignore[index]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = decompose(values, GRID, n_iterations=R, n_bootstrap=50)
    assert result.full_nonfinite
    assert np.isnan(result.cells["gap"]).all() and np.isnan(result.cells["D_hi"]).all()
    assert result.share_k_grid == ()
    assert all(math.isnan(v) for v in result.shares.values())


# ----------------------------------------------------------------------------- input errors


def drop_condition(values: dict) -> None:
    del values["calibrate_replay"]


def add_k_outside_grid(values: dict) -> None:
    values["truncate"][3] = values["truncate"][1]


def shorten_one_vector(values: dict) -> None:
    values["replay"][2] = values["replay"][2][:-1]


def drop_a_k(values: dict) -> None:
    del values["shift"][4]


def rename_a_condition(values: dict) -> None:
    values["replay_calibrated"] = values.pop("calibrate_replay")


def empty_everything(values: dict) -> None:
    values["full"] = values["full"][:0]
    for condition in CONDITIONS:
        values[condition] = {k: v[:0] for k, v in values[condition].items()}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (drop_condition, r"missing conditions \['calibrate_replay'\]"),
        (add_k_outside_grid, r"values\['truncate'\] has k=\[3\] outside k_grid"),
        (
            shorten_one_vector,
            r"values\['replay'\]\[2\] has 99 examples but values\['full'\] has 100",
        ),
        (drop_a_k, r"values\['shift'\] has no vector for k=\[4\]"),
        (
            rename_a_condition,
            r"missing conditions \['calibrate_replay'\].*given: \['replay_calibrated'\]",
        ),
        (empty_everything, r"values\['full'\] has 0 examples"),
    ],
)
def test_bad_values_raise_naming_the_offender(mutate: Callable[[dict], None], message: str) -> None:
    values = noisy_values("S", n=100)
    mutate(values)
    with pytest.raises(ValueError, match=message):
        decompose(values, GRID, n_iterations=R)


@pytest.mark.parametrize(
    ("k_grid", "message"),
    [([1, 9], r"k=9 in k_grid is outside 1..n_iterations=8"), ([], "k_grid is empty")],
)
def test_bad_k_grid_raises(k_grid: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decompose(noisy_values("S", n=50), k_grid, n_iterations=R)


def test_repeated_k_raises() -> None:
    with pytest.raises(ValueError, match=r"repeats k=\[2\]"):
        decompose(noisy_values("S", n=50), [1, 2, 2, 4, 6], n_iterations=R)


def test_losses_passed_as_qualities_raise() -> None:
    values = build_values(lambda c, k: np.full(20, 2.3))
    with pytest.raises(ValueError, match="higher_is_better=False"):
        decompose(values, GRID, n_iterations=R, metric="cross_entropy")
