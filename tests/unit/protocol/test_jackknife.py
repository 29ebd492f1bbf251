"""The calibration split in the intervals: the leave-one-group-out jackknife's
deviations widen the paired bootstrap's intervals by the fit's spread and by nothing else, and
the walk statistic of replay (docs/bracket.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dcp_lens.protocol.conditions import BaseRate, position_bucket
from dcp_lens.protocol.decomposition import DECOMPOSED, decompose
from dcp_lens.protocol.metrics import IGNORE_INDEX
from dcp_lens.protocol.sweep import walk_fractions

N, R, GRID = 400, 4, (1, 2, 3, 4)


def _values(rng: np.random.Generator) -> dict:
    """Accuracy-like values with a readout-shift gap: calibration repairs truncation."""
    full = (rng.random(N) < 0.9).astype(float)
    values: dict = {"full": full}
    for name in DECOMPOSED:
        values[name] = {}
        for k in GRID:
            repaired = name in ("calibrate_truncate", "calibrate_replay", "shift")
            p = 0.9 if repaired or k == R else 0.3
            values[name][k] = (rng.random(N) < p).astype(float)
    return values


def _jackknife(values: dict, rows: np.ndarray, spread: float, groups: int = 10) -> list:
    """Per group, calibrate_truncate on ``rows`` moved by a deviation of size ``spread``."""
    offsets = np.linspace(-spread, spread, groups)
    return [
        {"calibrate_truncate": {k: values["calibrate_truncate"][k][rows] + o for k in GRID}}
        for o in offsets
    ]


def test_identical_groups_leave_the_intervals_as_they_are():
    values = _values(np.random.default_rng(0))
    rows = np.arange(0, N, 10)
    plain = decompose(values, GRID, n_iterations=R, n_bootstrap=300, seed=1)
    same = decompose(
        values,
        GRID,
        n_iterations=R,
        n_bootstrap=300,
        seed=1,
        jackknife=_jackknife(values, rows, 0.0),
        jackknife_rows=rows,
    )
    assert same.shares["S_lo"] == pytest.approx(plain.shares["S_lo"])
    assert same.shares["S_hi"] == pytest.approx(plain.shares["S_hi"])
    assert same.shares["S"] == plain.shares["S"]  # the point never moves


def test_a_spread_fit_widens_the_interval_of_s_by_its_jackknife_variance():
    values = _values(np.random.default_rng(0))
    rows = np.arange(0, N, 10)
    plain = decompose(values, GRID, n_iterations=R, n_bootstrap=1000, seed=1)
    spread = 0.1
    widened = decompose(
        values,
        GRID,
        n_iterations=R,
        n_bootstrap=1000,
        seed=1,
        jackknife=_jackknife(values, rows, spread),
        jackknife_rows=rows,
    )
    width = lambda d: d.shares["S_hi"] - d.shares["S_lo"]  # noqa: E731
    assert widened.shares["S"] == plain.shares["S"]
    assert width(widened) > 1.5 * width(plain)
    # The jackknife variance of the cell, (G - 1) / G * sum(dev^2), carried into the draws: the
    # variance of S's draws grows by it times (dS / d cell)^2. S's area moves by half the shift
    # at every k of the grid; the share divides by the gap's area.
    offsets = np.linspace(-spread, spread, 10)
    jackknife_var = 9 / 10 * float(np.sum((offsets - offsets.mean()) ** 2))
    gap_area = sum(values["full"].mean() - values["truncate"][k].mean() for k in GRID)
    added = jackknife_var * (0.5 * len(GRID) / gap_area) ** 2
    sd_plain, sd_widened = width(plain) / 3.92, width(widened) / 3.92
    assert sd_widened**2 - sd_plain**2 == pytest.approx(added, rel=0.5)


def test_a_position_that_walks_once_counts_its_replay_gain_at_every_k():
    truncate = {
        1: torch.tensor([[0, 0, 0]]),
        2: torch.tensor([[1, 1, 0]]),
        4: torch.tensor([[2, 2, 2]]),
    }
    replay = {1: torch.tensor([[1, 2, 5]]), 2: torch.tensor([[1, 0, 0]]), 4: truncate[4]}
    full = torch.tensor([[2, 2, 2]])
    targets = torch.tensor([[2, 2, IGNORE_INDEX]])
    walked = walk_fractions({"truncate": truncate, "replay": replay}, full, targets, 4)
    # Position 0 walks at k = 1 (to truncate(2)'s answer); position 1 reads full depth's answer
    # there and position 2 is not scored. A walking position counts at every k.
    assert [walked["fraction"][k].tolist() for k in (1, 2, 4)] == [[0.5], [0.5], [0.5]]
    # Replay's accuracy gain on the walking position: k = 1 reads 1 (target 2): 0 - 0; k = 2
    # reads 1 where truncate(2) read 1: 0. Against full depth (top1_agreement) the same.
    assert walked["accuracy"][1].tolist() == [0.0] and walked["accuracy"][2].tolist() == [0.0]
    gaining = {**replay, 2: torch.tensor([[2, 0, 0]])}
    walked = walk_fractions({"truncate": truncate, "replay": gaining}, full, targets, 4)
    assert walked["accuracy"][2].tolist() == [0.5]  # position 0: 1 - 0, over 2 scored positions


def test_the_base_rate_reads_its_table_row_per_position_bucket():
    table = torch.randn(position_bucket(torch.tensor(40)).item() + 1, 5).log_softmax(-1)
    condition = BaseRate(table)
    logits = condition.logits(40, 3, torch.device("cpu"))
    assert logits.shape == (3, 40, 5)
    for position in (0, 15, 16, 39):
        assert torch.equal(logits[2, position], table[position_bucket(torch.tensor(position))])
    with pytest.raises(TypeError, match="no readout input"):
        condition.readout_input(torch.zeros(2, 1, 4, 3))


def test_translator_solve_matches_a_general_solve() -> None:
    """`_solved`'s Cholesky solve of the ridged normal equations gives the LU solve's translator."""
    from dcp_lens.protocol import fit

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(400, 9, generator=generator, dtype=torch.float64)
    x = torch.cat([x, torch.ones(400, 1, dtype=torch.float64)], dim=1)
    y = x[:, :9] @ torch.randn(9, 9, generator=generator, dtype=torch.float64) + 0.1
    gram, moment = x.T @ x, x.T @ y
    translator = fit._solved(gram, moment, 9, 0.5)
    ridged = gram.clone()
    ridged.diagonal()[:9].add_(0.5 + 1e-12)  # the bias is not shrunk
    solution = torch.linalg.solve(ridged, moment)
    assert translator is not None
    want_weight = (solution[:9] - torch.eye(9, dtype=torch.float64)).T.float()
    assert torch.allclose(translator.weight, want_weight, atol=1e-5)
    assert torch.allclose(translator.bias, solution[9].float(), atol=1e-5)


def test_left_out_translators_equal_direct_fits_without_the_group() -> None:
    """The whole split's and each left-out group's translators, solved from the groups' summed
    normal equations, are the least-squares fits on exactly those rows."""
    from dcp_lens.protocol import fit

    generator = torch.Generator().manual_seed(5)
    source = torch.randn(300, 6, generator=generator) * 3 + 1
    target = source @ torch.randn(6, 6, generator=generator) + 0.5 * torch.randn(300, 6)
    group = torch.randint(0, 4, (300,), generator=generator)
    whole, left_out = fit._least_squares_left_out(source, target, group, 4, 1e-3)
    direct = fit._least_squares(source, target, 1e-3)
    assert whole is not None and direct is not None
    assert torch.allclose(whole.weight, direct.weight, atol=1e-5)
    assert torch.allclose(whole.bias, direct.bias, atol=1e-5)
    for g, translator in enumerate(left_out):
        keep = group != g
        alone = fit._least_squares(source[keep], target[keep], 1e-3)
        assert translator is not None and alone is not None
        assert torch.allclose(translator.weight, alone.weight, atol=1e-5)
        assert not torch.allclose(translator.weight, whole.weight, atol=1e-4)  # a group matters


def test_a_refit_without_positions_is_none_and_a_singular_gram_never_raises() -> None:
    """A group holding every translator position leaves its refit no position (an all-zero gram,
    the bias's diagonal included): that refit is None, not a crash; and a gram singular even with
    its ridge (definiteness lost to rounding) is solved by the minimum-norm solution."""
    from dcp_lens.protocol import fit

    generator = torch.Generator().manual_seed(7)
    source = torch.randn(16, 4, generator=generator)
    target = source @ torch.randn(4, 4, generator=generator) + 0.5
    group = torch.zeros(16, dtype=torch.long)  # group 1 holds no position
    whole, left_out = fit._least_squares_left_out(source, target, group, 2, 1e-6)
    assert whole is not None
    assert left_out[0] is None  # every position left out
    assert left_out[1] is not None and torch.allclose(left_out[1].weight, whole.weight)

    gram = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 4.0]], dtype=torch.float64)
    moment = torch.tensor([[2.0, 0.0], [2.0, 0.0], [4.0, 8.0]], dtype=torch.float64)
    translator = fit._solved(gram, moment, 2, -1e-12)  # the linear part exactly singular
    assert translator is not None
    linear = translator.weight.T.double() + torch.eye(2, dtype=torch.float64)
    assert torch.allclose(linear, torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64))
    assert torch.allclose(translator.bias, torch.tensor([1.0, 2.0]))


def test_maps_and_translators_apply_as_written() -> None:
    """The fused products (addmm) give h + h W^T + b and m_ref + A (h - m_src), on any batch
    shape, and an in-place edit of a translator's weight is not served from a stale cast."""
    from dcp_lens.protocol.calibration import AffineCalibration
    from dcp_lens.protocol.translator import AffineTranslator

    generator = torch.Generator().manual_seed(7)
    h = torch.randn(2, 3, 5, 8, generator=generator)
    weight, bias = torch.randn(8, 8, generator=generator), torch.randn(8, generator=generator)
    translator = AffineTranslator(8, weight, bias)
    assert torch.allclose(translator(h), h + h @ weight.T + bias, atol=1e-5)
    translator.weight.mul_(2.0)
    assert torch.allclose(translator(h), h + h @ (2 * weight).T + bias, atol=1e-5)
    means = torch.randn(8, generator=generator), torch.randn(8, generator=generator)
    linear = torch.randn(8, 8, generator=generator)
    full = AffineCalibration("full", means[0], means[1], linear)
    want = means[1] + (h - means[0]) @ linear.T
    assert torch.allclose(full(h), want, atol=1e-5)
    diag = AffineCalibration("diag", means[0], means[1], linear[0].abs())
    assert torch.allclose(diag(h), means[1] + (h - means[0]) * linear[0].abs(), atol=1e-5)
    assert full(h.double()).dtype == torch.float64 and full(h).shape == h.shape


def test_a_fit_whose_moments_would_not_fit_is_refused_before_it_starts() -> None:
    """Each calibration group holds a float32 d x d moment per condition: at a Huginn-sized
    width the jackknife's moments run to tens of GiB when every group is on the device, refused
    up front with the way out."""
    from dcp_lens.protocol import fit_records
    from dcp_lens.protocol.budget import moment_bytes
    from dcp_lens.utils.errors import ResourceLimitError

    huge = moment_bytes(21, 10, 5280, 10, 8192)
    assert huge > 2 * moment_bytes(21, 0, 5280, 1, 8192)  # the groups are most of it
    budget, cpu = 8 * 2**30, torch.device("cpu")
    with pytest.raises(ResourceLimitError, match="--calibration-groups 0"):
        fit_records.check_moment_memory(21, 10, 5280, 10, 8192, budget, cpu)
    fit_records.check_moment_memory(21, 10, 256, 10, 8192, budget, cpu)  # small: passes


def test_the_check_before_the_pass_and_the_estimate_size_the_moments_alike() -> None:
    """One memory model: what the check before the pass sizes (each group's scatter at the
    float32 it is stored in, its waiting rows, the float64 whole) is the estimate's moments,
    their buffers less the batch being folded, and the whole split's moments."""
    from dcp_lens.protocol.budget import ModelShape, estimate_run_memory, moment_bytes

    shape = ModelShape(5280, 65536, 17920, 32, 3_564_976_800, 2, 55)
    positions = 4 * 1024
    for groups, device_type, resident in ((10, "cuda", 1), (10, "cpu", 10), (0, "cuda", 1)):
        estimate = estimate_run_memory(
            shape,
            batch_size=4,
            seq_len=1024,
            n_streams=17,
            calibration_groups=groups,
            readout_rows=4096,
            device_type=device_type,
        )
        terms = estimate.terms
        held = terms["moments"] + terms["moment_buffers"] + terms["moment_totals"]
        batch = positions * 5280 * 2
        assert held - batch == moment_bytes(17, groups, 5280, resident, positions, True, 2)
    scatter = 4 * 5280**2
    whole = 8 * (5280**2 + 3 * 5280)
    assert moment_bytes(1, 10, 5280, 1, 4096) == scatter + 4 * 3 * 5280 + 4 * 64 * 5280 + whole
    # Narrow states wait in a longer buffer, whatever the batch's positions.
    assert moment_bytes(1, 10, 256, 1, 128) == moment_bytes(1, 10, 256, 1, 1)
    assert moment_bytes(1, 10, 256, 1, 1, totals=False) - 4 * (256**2 + 3 * 256) == 4 * 1024 * 256


def test_a_left_out_refit_held_as_a_float16_difference_applies_as_the_refit() -> None:
    """The jackknife keeps each refit as the whole split's map plus a scaled float16
    difference: applied, inverted and as a translator it matches the refit within 5e-5 (3e-4
    inverted) of the map's scale."""
    from dcp_lens.protocol.calibration import AffineCalibration
    from dcp_lens.protocol.jackknife import LeftOutAffine, LeftOutTranslator
    from dcp_lens.protocol.translator import AffineTranslator

    generator = torch.Generator().manual_seed(4)
    d = 48
    whole_linear = torch.eye(d, dtype=torch.float64) + 0.3 * torch.randn(
        d, d, generator=generator, dtype=torch.float64
    )
    refit_linear = whole_linear + 0.02 * torch.randn(d, d, generator=generator, dtype=torch.float64)
    means = [torch.randn(d, generator=generator, dtype=torch.float64) for _ in range(4)]
    whole = AffineCalibration("full", means[0], means[1], whole_linear)
    refit = AffineCalibration("full", means[2], means[3], refit_linear)
    held = LeftOutAffine.of(whole, refit)
    assert isinstance(held, LeftOutAffine) and held.delta.dtype == torch.float16
    h = torch.randn(3, 5, d, generator=generator)
    scale = float(refit(h).abs().max())
    assert float((held(h) - refit(h)).abs().max()) <= 5e-5 * scale
    assert float((held.inverse()(h) - refit.inverse()(h)).abs().max()) <= 3e-4 * scale
    diag = AffineCalibration("diag", means[0], means[1], whole_linear[0].abs())
    assert LeftOutAffine.of(diag, diag) is diag  # only full-mode maps are held as differences
    weights = [0.1 * torch.randn(d, d, generator=generator) for _ in range(2)]
    translators = [
        AffineTranslator(d, weights[0], means[0].float()),
        AffineTranslator(d, weights[0] + 0.01 * weights[1], means[1].float()),
    ]
    moved = LeftOutTranslator(*translators)
    assert float((moved(h) - translators[1](h)).abs().max()) <= 1e-5 * float(
        translators[1](h).abs().max()
    )
