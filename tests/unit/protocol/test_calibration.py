"""Streaming moments, Ledoit-Wolf shrinkage and the affine calibration (docs/design.md §3)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dcp_lens.protocol.calibration import (
    AffineCalibration,
    CalibrationFallbackWarning,
    StreamingMoments,
    fit_calibration,
    ledoit_wolf_shrinkage,
    symmetric_power,
)


def gaussian(n: int, mean: torch.Tensor, mixing: torch.Tensor, seed: int) -> torch.Tensor:
    """n float64 samples of N(mean, mixing mixing^T)."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(n, mixing.shape[1], generator=generator, dtype=torch.float64)
    return noise @ mixing.T + mean


def random_frame(d: int, seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random mean and a well-conditioned random mixing matrix of width d."""
    generator = torch.Generator().manual_seed(seed)
    mean = torch.randn(d, generator=generator, dtype=torch.float64) * 3
    mixing = torch.eye(d, dtype=torch.float64) + torch.randn(
        d, d, generator=generator, dtype=torch.float64
    ) / (2 * d**0.5)
    return mean, scale * mixing


def reference_ledoit_wolf(samples: np.ndarray) -> tuple[np.ndarray, float]:
    """Ledoit & Wolf (2004), Lemma 3.2-3.4, written out directly from the samples."""
    n, p = samples.shape
    centred = samples - samples.mean(axis=0)
    sample_cov = centred.T @ centred / n
    mu = np.trace(sample_cov) / p
    delta_sq = np.sum((sample_cov - mu * np.eye(p)) ** 2) / p
    beta_bar_sq = sum(np.sum((np.outer(row, row) - sample_cov) ** 2) / p for row in centred) / n**2
    beta_sq = min(beta_bar_sq, delta_sq)
    alpha_sq = delta_sq - beta_sq
    shrunk = beta_sq / delta_sq * mu * np.eye(p) + alpha_sq / delta_sq * sample_cov
    return shrunk, beta_sq / delta_sq


def test_streaming_moments_match_one_shot_float64() -> None:
    mean, mixing = random_frame(12, seed=0)
    samples = gaussian(5000, mean + 1e4, mixing, seed=1)  # a large offset, as massive activations
    generator = torch.Generator().manual_seed(2)
    sizes = torch.randint(0, 20, (400,), generator=generator).tolist()  # empty and 1-row chunks too
    assert sum(sizes) < 4900
    moments = StreamingMoments()
    start = 0
    for size in sizes:
        moments.update(samples[start : start + size])
        start += size
    moments.update(samples[start:4900])
    moments.update(samples[4900:].reshape(50, 2, 12))  # leading dimensions are pooled
    assert moments.count == 5000

    reference = samples.numpy()
    centred = reference - reference.mean(axis=0)
    np.testing.assert_allclose(moments.mean.numpy(), reference.mean(axis=0), rtol=1e-12, atol=0)
    np.testing.assert_allclose(
        moments.covariance.numpy(), np.cov(reference.T, bias=True), rtol=1e-12, atol=1e-12
    )
    fourth = np.sum(np.sum(centred**2, axis=1) ** 2)
    assert moments.fourth_moment_sum == pytest.approx(fourth, rel=1e-12)


def test_merge_equals_one_stream() -> None:
    mean, mixing = random_frame(6, seed=3)
    samples = gaussian(900, mean, mixing, seed=4)
    whole = StreamingMoments.from_samples(samples)
    left = StreamingMoments.from_samples(samples[:200])
    left.merge(StreamingMoments.from_samples(samples[200:].split(77)))
    torch.testing.assert_close(left.mean, whole.mean, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(left.covariance, whole.covariance, rtol=1e-12, atol=1e-13)
    assert left.fourth_moment_sum == pytest.approx(whole.fourth_moment_sum, rel=1e-12)


def test_shrunk_power_is_computed_once_and_forgotten_on_update() -> None:
    """A sweep maps every source onto one reference: its root is cached, until new samples."""
    mean, mixing = random_frame(5, seed=8)
    samples = gaussian(300, mean, mixing, seed=9)
    moments = StreamingMoments.from_samples(samples[:100])
    root = moments.shrunk_power(0.5)
    expected = symmetric_power(ledoit_wolf_shrinkage(moments).covariance, 0.5)
    assert torch.equal(root, expected) and moments.shrunk_power(0.5) is root
    moments.update(samples[100:])
    updated = symmetric_power(ledoit_wolf_shrinkage(moments).covariance, 0.5)
    assert torch.equal(moments.shrunk_power(0.5), updated) and not torch.equal(updated, root)
    merged = StreamingMoments.from_samples(samples[:100])
    merged.shrunk_power(-0.5)
    merged.merge(StreamingMoments.from_samples(samples[100:]))
    inverse_root = symmetric_power(ledoit_wolf_shrinkage(merged).covariance, -0.5)
    assert torch.equal(merged.shrunk_power(-0.5), inverse_root)
    # Root and inverse root come from one eigendecomposition, the same bits as computed apart.
    calls = []
    eigh = torch.linalg.eigh

    def counted(matrix):
        calls.append(1)
        return eigh(matrix)

    fresh = StreamingMoments.from_samples(samples)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.linalg, "eigh", counted)
        both = fresh.shrunk_power(0.5), fresh.shrunk_power(-0.5)
    assert len(calls) == 1
    covariance = ledoit_wolf_shrinkage(fresh).covariance
    assert torch.equal(both[0], symmetric_power(covariance, 0.5))
    assert torch.equal(both[1], symmetric_power(covariance, -0.5))


def test_streaming_moments_reject_bad_input() -> None:
    moments = StreamingMoments()
    with pytest.raises(ValueError, match="no samples"):
        _ = moments.mean
    moments.update(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="width 5 but earlier samples had width 4"):
        moments.update(torch.zeros(2, 5))
    bad = torch.zeros(3, 4)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite values \\(in 1 of 3 rows\\)"):
        moments.update(bad)
    with pytest.raises(ValueError, match="shape \\(4,\\)"):
        moments.update(torch.zeros(4))


@pytest.mark.parametrize(
    ("n", "d", "expect_clipped"),
    [(400, 10, False), (60, 40, False), (100, 5, True)],
)
def test_ledoit_wolf_matches_direct_formula(n: int, d: int, expect_clipped: bool) -> None:
    mean, mixing = random_frame(d, seed=n + d)
    if expect_clipped:  # an isotropic population: the sample spread is all noise
        mixing = torch.eye(d, dtype=torch.float64)
    samples = gaussian(n, mean, mixing, seed=5)
    moments = StreamingMoments.from_samples(samples.split(7))
    shrunk = ledoit_wolf_shrinkage(moments)
    expected_cov, expected_intensity = reference_ledoit_wolf(samples.numpy())
    assert shrunk.intensity == pytest.approx(expected_intensity, rel=1e-10, abs=1e-14)
    np.testing.assert_allclose(shrunk.covariance.numpy(), expected_cov, rtol=1e-10, atol=1e-12)
    assert (shrunk.intensity == 1.0) == expect_clipped
    assert shrunk.scale == pytest.approx(float(np.trace(np.cov(samples.numpy().T, bias=True))) / d)


def test_calibrating_reference_onto_itself_is_identity() -> None:
    mean, mixing = random_frame(16, seed=6)
    samples = gaussian(4000, mean, mixing, seed=7)
    moments = StreamingMoments.from_samples(samples)
    for mode in ("mean", "diag", "full"):
        calibration = AffineCalibration.fit(moments, moments, mode)
        deviation = calibration.identity_deviation()
        # Measured: |A - I| <= 1.6e-15, |b| <= 1.5e-14 (|mean| <= 5.7): shrinkage acts alike on
        # both sides, so what is left is float64 rounding of the eigendecompositions.
        assert deviation["linear"] < 1e-12 and deviation["offset"] < 1e-12, (mode, deviation)
        assert calibration.is_identity_within(1e-12)
        torch.testing.assert_close(calibration(samples), samples, rtol=0, atol=1e-11)
    # Two independent reference samples: the map differs from I by sampling noise only.
    # Measured for n = 4000 per side, d = 16: max |A - I| = 0.028, max |b| = 0.20 (|mean| <= 5.7).
    other = StreamingMoments.from_samples(gaussian(4000, mean, mixing, seed=8))
    deviation = AffineCalibration.fit(other, moments, "full").identity_deviation()
    assert deviation["linear"] < 0.1 and deviation["offset"] < 0.4, deviation


@pytest.mark.parametrize("mode", ["diag", "full"])
def test_calibrated_source_matches_reference_moments(mode: str) -> None:
    d = 8
    source_mean, source_mixing = random_frame(d, seed=9, scale=3.0)
    reference_mean, reference_mixing = random_frame(d, seed=10, scale=0.5)
    fit_source = gaussian(20000, source_mean, source_mixing, seed=11)
    reference = gaussian(20000, reference_mean, reference_mixing, seed=12)
    calibration = fit_calibration(fit_source.split(1000), reference.split(1000), mode=mode)

    output = calibration(gaussian(20000, source_mean, source_mixing, seed=13))
    target = StreamingMoments.from_samples(gaussian(20000, reference_mean, reference_mixing, 14))
    got = StreamingMoments.from_samples(output)
    # Mean error in reference standard deviations, covariance error relative to its norm; the
    # sampling error of 20000 points is ~0.01 for both.
    std = target.covariance.diagonal().sqrt()
    assert float(((got.mean - target.mean) / std).abs().max()) < 0.05
    if mode == "full":
        error = (got.covariance - target.covariance).norm() / target.covariance.norm()
        assert float(error) < 0.05
    else:
        variance_ratio = got.covariance.diagonal() / target.covariance.diagonal()
        assert float((variance_ratio - 1).abs().max()) < 0.05


@pytest.mark.parametrize("mode", ["mean", "diag", "full"])
def test_inverse_undoes_calibration(mode: str) -> None:
    mean, mixing = random_frame(10, seed=15, scale=2.0)
    other_mean, other_mixing = random_frame(10, seed=16)
    calibration = fit_calibration(
        gaussian(3000, mean, mixing, seed=17), gaussian(3000, other_mean, other_mixing, 18), mode
    )
    states = gaussian(500, mean, mixing, seed=19).reshape(5, 100, 10)
    inverse = calibration.inverse()
    torch.testing.assert_close(inverse(calibration(states)), states, rtol=0, atol=1e-10)
    torch.testing.assert_close(calibration(inverse(states)), states, rtol=0, atol=1e-10)
    torch.testing.assert_close(inverse.inverse().linear, calibration.linear, rtol=1e-12, atol=1e-12)


def test_mean_mode_only_shifts() -> None:
    mean, mixing = random_frame(6, seed=20)
    source = gaussian(2000, mean, mixing, seed=21)
    reference = gaussian(2000, -mean, 3 * mixing, seed=22)
    calibration = fit_calibration(source, reference, mode="mean")
    assert torch.equal(calibration.linear, torch.ones(6, dtype=torch.float64))
    shift = reference.mean(dim=0) - source.mean(dim=0)
    torch.testing.assert_close(calibration(source) - source, shift.expand(2000, 6))


def test_call_keeps_shape_and_dtype() -> None:
    mean, mixing = random_frame(8, seed=23)
    calibration = fit_calibration(gaussian(500, mean, mixing, 24), gaussian(500, mean, mixing, 25))
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        states = torch.randn(2, 3, 8).to(dtype)
        output = calibration(states)
        assert output.dtype == dtype and output.shape == (2, 3, 8)


@pytest.mark.parametrize("mode", ["mean", "diag", "full"])
def test_to_dict_round_trips_exactly(mode: str) -> None:
    mean, mixing = random_frame(7, seed=26)
    calibration = fit_calibration(
        gaussian(800, mean, mixing, 27), gaussian(800, -mean, mixing.T, 28), mode
    )
    restored = AffineCalibration.from_dict(json.loads(json.dumps(calibration.to_dict())))
    assert restored.mode == mode
    for field in ("source_mean", "reference_mean", "linear"):
        assert torch.equal(getattr(restored, field), getattr(calibration, field)), field
    states = gaussian(50, mean, mixing, 29)
    assert torch.equal(restored(states), calibration(states))


def test_bad_calibration_inputs_raise_with_the_value() -> None:
    samples = torch.randn(100, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="mode='whiten' is not one of"):
        fit_calibration(samples, samples, mode="whiten")
    with pytest.raises(ValueError, match="width 4 but reference states have width 5"):
        fit_calibration(samples, torch.randn(100, 5))
    constant = torch.ones(50, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="source covariance is singular .*states are constant"):
        fit_calibration(constant, samples, mode="full")
    with pytest.raises(ValueError, match="source covariance is singular"):
        fit_calibration(constant, samples, mode="diag")
    # Two reference states cannot fit a covariance: the map falls back to a mean shift, loudly.
    with pytest.warns(CalibrationFallbackWarning, match="needs at least 5 calibration states"):
        assert fit_calibration(samples, samples[:2], mode="full").mode == "mean"
    calibration = fit_calibration(samples, samples)
    with pytest.raises(ValueError, match="states have width 3 but the calibration was fitted on"):
        calibration(torch.randn(2, 3))
    with pytest.raises(ValueError, match="lacks keys \\['linear'\\]"):
        AffineCalibration.from_dict({"mode": "full", "source_mean": [0.0], "reference_mean": [0.0]})
    with pytest.raises(ValueError, match="linear of shape \\(2, 2\\)"):
        AffineCalibration(
            mode="full",
            source_mean=torch.zeros(2, dtype=torch.float64),
            reference_mean=torch.zeros(2, dtype=torch.float64),
            linear=torch.ones(2, dtype=torch.float64),
        )


def test_without_is_merge_run_backwards() -> None:
    """The jackknife's leave-one-group-out moments by subtraction: the same sums (to float64
    rounding) as merging every other group, with a large common offset; nothing left is None."""
    mean, mixing = random_frame(6, seed=21, scale=3.0)
    samples = gaussian(900, mean + 1e3, mixing, seed=22)
    groups = [StreamingMoments.from_samples(samples[g::5]) for g in range(5)]
    whole = StreamingMoments()
    for group in groups:
        whole.merge(group)
    for left_out in range(5):
        expected = StreamingMoments()
        for g, group in enumerate(groups):
            if g != left_out:
                expected.merge(group)
        rest = whole.without(groups[left_out])
        assert rest is not None and rest.count == expected.count
        got, want = rest.state(), expected.state()
        for key in ("mean", "scatter", "norm_weighted_sum", "fourth_sum"):
            scale = float(want[key].abs().max())
            assert float((got[key] - want[key]).abs().max()) <= 1e-9 * scale, key
    assert whole.without(whole) is None
    empty = whole.without(StreamingMoments())
    assert empty is not None and torch.equal(empty.covariance, whole.covariance)


def test_a_refit_decomposes_in_float32_to_float64_powers() -> None:
    """`for_refit`: the shrunk covariance's powers from a float32 eigendecomposition, within
    float32 rounding of the float64 ones and far inside a group's leave-out deviation."""
    mean, mixing = random_frame(24, seed=23)
    samples = gaussian(2000, mean, mixing, seed=24)
    exact = StreamingMoments.from_samples(samples[200:])
    refit = StreamingMoments.from_samples(samples[200:]).for_refit()
    whole = StreamingMoments.from_samples(samples)
    for exponent in (0.5, -0.5):
        want, got = exact.shrunk_power(exponent), refit.shrunk_power(exponent)
        assert got.dtype == torch.float64
        error = float((got - want).norm() / want.norm())
        deviation = float((whole.shrunk_power(exponent) - want).norm() / want.norm())
        assert error < 1e-5 and error < 1e-2 * deviation


def test_an_ill_conditioned_refit_falls_back_to_float64() -> None:
    """Past a condition number of 1e3 float32 would move the inverse root by 4e-4 and more, a
    sizeable part of a group's leave-out deviation: the refit decomposes in float64 there."""
    from dcp_lens.protocol.calibration.linalg import power_of, symmetric_eigh

    generator = torch.Generator().manual_seed(5)
    basis, _ = torch.linalg.qr(torch.randn(32, 32, generator=generator, dtype=torch.float64))
    for condition, exact in ((1e2, False), (1e5, True)):
        values = torch.logspace(0, math.log10(condition), 32, dtype=torch.float64)
        matrix = (basis * values) @ basis.T
        want = power_of((*symmetric_eigh(matrix), None), -0.5)
        got = power_of((*symmetric_eigh(matrix, dtype=torch.float32), None), -0.5)
        error = float((got - want).norm() / want.norm())
        assert (error < 1e-12) if exact else (0 < error < 1e-4), (condition, error)


@pytest.mark.parametrize("storage", [torch.float32, torch.float64])
def test_states_spanning_few_directions_whiten(storage: torch.dtype) -> None:
    """States in a 6-dimensional subspace of a 64-wide stream (a planted mechanism embedded at
    width, a real stream's unused directions), the scatter kept in ``storage`` and so many
    samples that Ledoit-Wolf shrinks by nothing (the fourth-moment sum set to zero, read as no
    dispersion): the shrunk eigenvalues on the unused directions are rounding (in float32 some
    below zero, in float64 too close to zero to decompose). The rounding floor lifts them, so
    the inverse root exists, and on the spanned directions it whitens the states as the exact
    covariance does."""
    from dcp_lens.protocol.calibration.linalg import symmetric_eigh

    generator = torch.Generator().manual_seed(3)
    basis, _ = torch.linalg.qr(torch.randn(64, 6, generator=generator, dtype=torch.float64))
    spread = torch.logspace(0, 2, 6, dtype=torch.float64)
    samples = torch.randn(4096, 6, generator=generator, dtype=torch.float64) * spread
    exact = StreamingMoments.from_samples(samples @ basis.T + 30.0)
    state = exact.state()
    covariance = exact.covariance
    state["scatter"] = state["scatter"].to(storage)
    state["fourth_sum"] = torch.zeros((), dtype=torch.float64)
    rounded = StreamingMoments.from_state(state, storage=storage)
    shrunk = ledoit_wolf_shrinkage(rounded)
    assert shrunk.intensity == 0.0
    with pytest.raises(ValueError, match="singular"):
        symmetric_eigh(shrunk.covariance)
    inverse_root = rounded.shrunk_power(-0.5)
    spanned = basis.T @ covariance @ basis
    whitened = basis.T @ inverse_root @ basis @ spanned @ basis.T @ inverse_root @ basis
    assert torch.allclose(whitened, torch.eye(6, dtype=torch.float64), atol=1e-3)


@pytest.mark.parametrize("on_span", [True, False])
def test_a_refit_lifts_unused_directions_to_the_whole_splits_floor(
    on_span: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The jackknife's refit (the whole split less one group) and the whole split map the
    directions their states do not use alike: the refit shares the whole's eigenvalue floor,
    decomposed on the whole's span (``on_span``) or in full. With a floor of its own, its map
    there differs by the floors' ratio, and the jackknife would read that as calibration
    variance of every state with a part outside the span."""
    from dcp_lens.protocol.calibration import moments as moments_module

    if not on_span:
        monkeypatch.setattr(moments_module, "SUBSPACE_SHARE", 0.0)
    generator = torch.Generator().manual_seed(4)
    basis, _ = torch.linalg.qr(torch.randn(64, 64, generator=generator, dtype=torch.float64))
    used, unused = basis[:, :6], basis[:, 6:]
    samples = torch.randn(4096, 6, generator=generator, dtype=torch.float64)
    samples = samples * torch.logspace(0, 2, 6, dtype=torch.float64) @ used.T + 30.0
    state = StreamingMoments.from_samples(samples).state()
    state["fourth_sum"] = torch.zeros((), dtype=torch.float64)  # no shrinkage: see above
    whole = StreamingMoments.from_state(state)
    group = StreamingMoments(torch.float32)
    group.update(samples[:400])
    want = unused.T @ whole.shrunk_power(-0.5) @ unused
    errors = []
    for within in (whole, None):
        rest = whole.without(group)
        assert rest is not None
        rest.for_refit(within)
        got = unused.T @ rest.shrunk_power(-0.5) @ unused
        errors.append(float((got - want).norm() / want.norm()))
    shared, own = errors
    assert shared < 1e-6 and own > 1e-4, errors


def embedded_states(
    m: int, noise: float = 0.0, n: int = 4000, width: int = 96, seed: int = 0
) -> torch.Tensor:
    """n float32 states varying in m random directions (the same for every ``seed``) of a
    ``width``-wide stream (spreads 0.2 to 3, a common offset of 5) plus isotropic noise of
    standard deviation ``noise``; the samples drawn with ``seed``."""
    basis, _ = torch.linalg.qr(
        torch.randn(width, m, generator=torch.Generator().manual_seed(m), dtype=torch.float64)
    )
    generator = torch.Generator().manual_seed(1000 + seed)
    spread = torch.linspace(0.2, 3.0, m, dtype=torch.float64)
    inside = torch.randn(n, m, generator=generator, dtype=torch.float64) * spread
    outside = noise * torch.randn(n, width, generator=generator, dtype=torch.float64)
    return (inside @ basis.T + outside + 5.0).float()


def grouped(
    states: torch.Tensor, groups: int = 10
) -> tuple[list[StreamingMoments], StreamingMoments]:
    """Moments per group (float32 scatters, as the protocol keeps them) and merged."""
    parts = [StreamingMoments(torch.float32) for _ in range(groups)]
    for g, part in enumerate(parts):
        part.update(states[g::groups])
    whole = StreamingMoments()
    for part in parts:
        whole.merge(part)
    return parts, whole


@pytest.mark.parametrize("exponent", [-0.5, 0.5])
@pytest.mark.parametrize("m", [8, 96])
def test_subspace_powers_equal_the_full_decomposition(m: int, exponent: float) -> None:
    """Float64 moments of states in 8 of 96 directions, and of full-rank states: decomposed on
    the span of the eigenvectors above rounding (`StreamingMoments.span`), the shrunk
    covariance's powers equal the full decomposition's within 1e-9 (relative, Frobenius)."""
    from dcp_lens.protocol.calibration.linalg import (
        power_of,
        rounding_floor,
        storage_rounding,
        subspace_eigh,
        symmetric_eigh,
    )

    moments = StreamingMoments.from_samples(embedded_states(m).double())
    shrunk = ledoit_wolf_shrinkage(moments)
    floor = rounding_floor(shrunk.covariance)
    want = power_of((*symmetric_eigh(shrunk.covariance, floor=floor), None), exponent)
    basis = moments.span()
    assert basis.shape == (96, m)
    tolerance = storage_rounding(shrunk.covariance, torch.float32)
    eigen = subspace_eigh(shrunk, moments.covariance, basis, floor, tolerance)
    assert eigen is not None
    error = float((power_of(eigen, exponent) - want).norm() / want.norm())
    assert error < 1e-9, error


def test_subspace_decomposition_refuses_states_outside_the_span() -> None:
    """Full-rank states and the span of only their 8 widest directions: what the subspace
    would drop is far above rounding, so `subspace_eigh` returns None (the full one is used)."""
    from dcp_lens.protocol.calibration.linalg import (
        rounding_floor,
        storage_rounding,
        subspace_eigh,
    )

    moments = StreamingMoments.from_samples(embedded_states(96).double())
    shrunk = ledoit_wolf_shrinkage(moments)
    tolerance = storage_rounding(shrunk.covariance, torch.float32)
    floor = rounding_floor(shrunk.covariance)
    partial = moments.span()[:, -8:]
    assert subspace_eigh(shrunk, moments.covariance, partial, floor, tolerance) is None


@pytest.mark.parametrize("noise", [0.0, 1e-2])
def test_a_refit_is_decomposed_on_the_whole_splits_span_where_it_stays_in_it(
    noise: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The jackknife's leave-one-group-out moments (float32 group scatters) of states in 8 of
    96 directions: with the whole split's span the refit takes no full eigendecomposition, and
    its map moves states as the full decomposition's within 1e-6 of the map's output (the
    leave-out moves them by about 1e-2). With noise in every direction (rank 96, above half the
    width) the refit decomposes in full and its map is the same as without a span."""
    from dcp_lens.protocol.calibration import moments as moments_module

    source_parts, source = grouped(embedded_states(8, noise, seed=1) * 1.5 + 0.3)
    reference_parts, reference = grouped(embedded_states(8, noise, seed=2))
    whole = AffineCalibration.fit(source, reference)
    for total in (source, reference):
        total.span()
    calls = []
    full_eigh = moments_module.symmetric_eigh

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return full_eigh(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(moments_module, "symmetric_eigh", counted)
    refits = [
        AffineCalibration.fit(
            source.without(source_parts[g]).for_refit(source if within else None),  # type: ignore[union-attr]
            reference.without(reference_parts[g]).for_refit(reference if within else None),  # type: ignore[union-attr]
        )
        for within in (True, False)
        for g in (0, 1)
    ]
    assert len(calls) == (4 if noise == 0.0 else 8)
    states = (embedded_states(8, noise, n=256, seed=3) * 1.5 + 0.3).double()
    for on_span, plain in zip(refits[:2], refits[2:], strict=True):
        moved = plain(states).double() - plain.reference_mean
        difference = float((on_span(states).double() - plain(states).double()).norm())
        leave_out = float((plain(states).double() - whole(states).double()).norm())
        if noise == 0.0:
            assert difference < 1e-6 * float(moved.norm()) and leave_out > 1e-4 * float(
                moved.norm()
            ), (difference, leave_out)
        else:
            assert torch.equal(on_span.linear, plain.linear)


def test_a_refit_whose_whole_split_spans_no_direction_is_decomposed_in_full() -> None:
    """Ledoit-Wolf shrinks isotropic states all the way to a multiple of the identity, so the
    whole split's span is empty; its refits take the full decomposition, not an empty block."""
    samples = torch.randn(24, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    within = StreamingMoments.from_samples(samples)
    assert within.span().shape == (16, 0)  # the case under test
    refit = StreamingMoments.from_samples(samples[:20]).for_refit(within)
    alone = StreamingMoments.from_samples(samples[:20])
    power = refit.shrunk_power(-0.5)
    assert torch.isfinite(power).all()
    assert torch.allclose(power, alone.shrunk_power(-0.5), rtol=1e-4, atol=1e-6)
