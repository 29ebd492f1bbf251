"""The residual-stream OOD probe (docs/design.md §5): Mahalanobis noise floor and classifier
two-sample test."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from dcp_lens.protocol.calibration import fit_calibration
from dcp_lens.protocol.probe import ResidualOODProbe, auroc

D = 64


def frame(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference distribution N(mean, mixing mixing^T): a random mean, correlated dims."""
    generator = torch.Generator().manual_seed(seed)
    mean = torch.randn(D, generator=generator)
    mixing = torch.eye(D) + torch.randn(D, D, generator=generator) / D**0.5
    return mean, mixing


def gaussian(n: int, seed: int, shift: float = 0.0, scale: float = 1.0) -> torch.Tensor:
    """n float32 reference states, optionally mean-shifted along a fixed direction and rescaled."""
    mean, mixing = frame()
    generator = torch.Generator().manual_seed(seed)
    states = torch.randn(n, D, generator=generator) @ mixing.T * scale + mean
    return states + shift * mixing[:, 0] / mixing[:, 0].norm()


def scale_mixture(n: int, seed: int) -> torch.Tensor:
    """Same mean and covariance as the reference, not Gaussian: half the states at variance
    0.5, half at 1.5 (so the Mahalanobis radius is bimodal), in the reference frame."""
    mean, mixing = frame()
    generator = torch.Generator().manual_seed(seed)
    variance = torch.where(torch.rand(n, 1, generator=generator) < 0.5, 0.5, 1.5)
    return variance.sqrt() * torch.randn(n, D, generator=generator) @ mixing.T + mean


@pytest.fixture(scope="module")
def probe() -> ResidualOODProbe:
    return ResidualOODProbe().fit(gaussian(8000, seed=1), seed=0)


def test_auroc_matches_pairwise_count_with_ties() -> None:
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (60,), generator=generator).float()  # many ties
    labels = torch.rand(60, generator=generator) < 0.4
    positives, negatives = scores[labels].tolist(), scores[~labels].tolist()
    pairs = list(itertools.product(positives, negatives))
    expected = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p, q in pairs) / len(pairs)
    assert auroc(scores, labels) == pytest.approx(expected, abs=1e-12)
    ordered = torch.arange(10.0)
    assert auroc(ordered, ordered >= 5) == 1.0
    assert auroc(ordered, ordered < 5) == 0.0
    assert auroc(torch.ones(10), ordered >= 5) == 0.5
    with pytest.raises(ValueError, match="0 positives and 10 negatives"):
        auroc(ordered, ordered > 100)


def test_held_out_reference_is_the_noise_floor(probe: ResidualOODProbe) -> None:
    fresh = gaussian(4000, seed=2)
    # Measured: relative Mahalanobis 0.997, AUROC 0.494 (0.49-0.51 over seeds 0-4);
    # reference_score AUROC 0.526 (2000 states per side).
    assert probe.relative_mahalanobis(fresh) == pytest.approx(1.0, abs=0.02)
    assert 0.4 <= probe.c2st_auroc(fresh) <= 0.6
    reference = probe.reference_score()
    assert reference["mahalanobis"] == pytest.approx(1.0, abs=1e-12)  # the floor's own states
    assert 0.4 <= reference["auroc"] <= 0.6


def test_mean_shift_is_detected(probe: ResidualOODProbe) -> None:
    shifted = gaussian(4000, seed=3, shift=40.0)
    scores = probe.score(shifted)
    # Measured: relative Mahalanobis 3.42, AUROC 1.0.
    assert scores["mahalanobis"] > 2.0
    assert scores["auroc"] > 0.95


def test_full_calibration_brings_a_shifted_stream_back(probe: ResidualOODProbe) -> None:
    calibration = fit_calibration(
        gaussian(8000, seed=4, shift=40.0, scale=3.0), gaussian(8000, seed=5), mode="full"
    )
    shifted = gaussian(4000, seed=6, shift=40.0, scale=3.0)
    # Measured: 4.44 before calibration, 1.003 after.
    assert probe.relative_mahalanobis(shifted) > 3.0
    assert probe.relative_mahalanobis(calibration(shifted)) == pytest.approx(1.0, abs=0.03)


def test_c2st_sees_beyond_the_first_two_moments(probe: ResidualOODProbe) -> None:
    # The mixture is calibrated onto the reference so its first two moments match empirically,
    # as calibrate() leaves a truncated stream; only higher moments still differ.
    calibration = fit_calibration(scale_mixture(8000, seed=7), gaussian(8000, seed=8))
    mixture = calibration(scale_mixture(4000, seed=9))
    scores = probe.score(mixture)
    # Measured: relative Mahalanobis 0.965 (the mean radius of a scale mixture is a bit
    # smaller), AUROC 0.913 (0.913-0.928 over seeds 0-4).
    assert scores["mahalanobis"] == pytest.approx(1.0, abs=0.06)
    assert scores["auroc"] >= 0.8


def test_c2st_is_seeded_and_leaves_global_rng_alone(probe: ResidualOODProbe) -> None:
    states = scale_mixture(1000, seed=10)
    rng_before = torch.get_rng_state()
    first = probe.c2st_auroc(states, seed=3)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert probe.c2st_auroc(states, seed=3) == first


def test_to_dict_round_trips_the_gaussian(probe: ResidualOODProbe) -> None:
    restored = ResidualOODProbe.from_dict(json.loads(json.dumps(probe.to_dict())))
    assert probe.mean is not None and probe.covariance is not None
    assert torch.equal(restored.mean, probe.mean)
    assert torch.equal(restored.covariance, probe.covariance)
    assert restored.noise_floor == probe.noise_floor
    states = gaussian(100, seed=11, shift=5.0)
    torch.testing.assert_close(
        restored.mahalanobis(states), probe.mahalanobis(states), rtol=1e-12, atol=0
    )
    with pytest.raises(RuntimeError, match="restored by from_dict\\(\\) does not keep"):
        restored.c2st_auroc(states)


def test_bad_probe_inputs_raise_with_the_value(probe: ResidualOODProbe) -> None:
    with pytest.raises(RuntimeError, match="not fitted"):
        ResidualOODProbe().mahalanobis(torch.zeros(3, D))
    with pytest.raises(ValueError, match="width 5 but the probe was fitted on width 64"):
        probe.relative_mahalanobis(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="reference has 6 states"):
        ResidualOODProbe().fit(torch.randn(6, D))
    with pytest.raises(ValueError, match="at least 4 states per side, got 3"):
        probe.c2st_auroc(torch.zeros(3, D))
    with pytest.raises(ValueError, match="max_points=2 must be >= 4"):
        ResidualOODProbe(max_points=2)


def test_an_explicit_held_out_set_sets_the_noise_floor() -> None:
    held_out = gaussian(1000, seed=12)
    probe = ResidualOODProbe(max_points=500).fit(gaussian(3000, seed=13), held_out=held_out)
    assert probe.relative_mahalanobis(held_out) == pytest.approx(1.0, abs=1e-12)
    assert probe.relative_mahalanobis(held_out.double()) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="the probe needs at least 3 reference states"):
        ResidualOODProbe().fit(gaussian(2, seed=14), held_out=held_out)


def test_c2st_splits_by_example_so_positions_of_one_sequence_do_not_leak() -> None:
    # Two samples of one distribution, 10 positions per sequence that share the sequence's own
    # offset: split by point, the classifier memorises offsets seen in training and "detects"
    # the other sample; split by example (groups), it cannot.
    generator = torch.Generator().manual_seed(0)

    def sequences(n: int, first_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = 3 * torch.randn(n, 1, 16, generator=generator, dtype=torch.float64)
        states = offsets + 0.3 * torch.randn(n, 10, 16, generator=generator, dtype=torch.float64)
        groups = torch.arange(first_id, first_id + n)[:, None].expand(n, 10)
        return states.reshape(-1, 16), groups.reshape(-1)

    reference, _ = sequences(300, 0)
    held_out, held_out_groups = sequences(150, 1000)
    probed, probed_groups = sequences(150, 2000)
    by_point = ResidualOODProbe(max_points=1500).fit(reference, held_out, seed=0)
    by_example = ResidualOODProbe(max_points=1500).fit(
        reference, held_out, seed=0, held_out_groups=held_out_groups
    )
    leaky = by_point.score(probed, seed=0)["auroc"]
    grouped = by_example.score(probed, seed=0, groups=probed_groups)["auroc"]
    assert abs(grouped - 0.5) < 0.08, grouped
    assert leaky > grouped + 0.15, (leaky, grouped)
    # one group id per held-out state (ValueError; under the tests' jaxtyping hook, TypeError)
    with pytest.raises((ValueError, TypeError)):
        ResidualOODProbe().fit(reference, held_out, held_out_groups=held_out_groups[:5])


def test_a_score_whitens_each_state_once_with_the_same_numbers() -> None:
    """`score` whitens the states once for both scores and the held-out reference once at
    `fit`; its numbers equal those of whitening every side of the two-sample test anew (the
    states re-drawn and whitened, as `c2st_auroc` of raw states does), within 1e-6."""
    from dcp_lens.protocol.probe import _Side

    probe = ResidualOODProbe(max_points=300, steps=60).fit(gaussian(1200, seed=1), seed=0)
    states = scale_mixture(500, seed=11)
    groups = torch.arange(500) // 5
    got = probe.score(states, seed=2, groups=groups)
    assert probe._held_out is not None
    anew = probe._two_sample_auroc(
        _Side(states, groups), _Side(probe._held_out, probe._held_out_groups), seed=2
    )
    want = {"mahalanobis": probe.relative_mahalanobis(states), "auroc": anew, **probe.last_null}
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key
    assert 0.5 < got["auroc"] < 1.0  # a test that can tell: the mixture is seen
