"""Registries of calibration maps and metrics: a toy map and a toy metric, registered from this
test only, join the sweep, its results and the fast-path-against-hooks checks with no other
change; names are refused where taken or unknown. Also `ProtocolConfig`'s checks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from helpers import assert_every_map_matches_hooks, lm_sets, make_model
from torch import Tensor

from dcp_lens.protocol.calibration import (
    CALIBRATION_MAPS,
    CalibrationMap,
    register_calibration_map,
)
from dcp_lens.protocol.config import ProtocolConfig
from dcp_lens.protocol.dcp import DepthControlProtocol
from dcp_lens.protocol.metrics import (
    HIGHER_IS_BETTER,
    LOSS_METRICS,
    METRIC_REGISTRY,
    METRICS,
    Metric,
    Readout,
    register_metric,
)
from dcp_lens.protocol.results import ProtocolResults
from dcp_lens.utils.errors import ConfigError, ConfigTypeError


@dataclass(frozen=True)
class MeanShift:
    """A toy map: move the source mean onto the reference mean, nothing else."""

    offset: Tensor
    mode: str = "toy_mean_shift"

    def __call__(self, h: Tensor) -> Tensor:
        return h + self.offset.to(h.dtype)

    def inverse(self) -> MeanShift:
        return MeanShift(-self.offset)

    def identity_deviation(self) -> dict[str, float]:
        return {"linear": 0.0, "offset": float(self.offset.abs().max())}


def _total_variation(readout: Readout) -> Tensor:
    """A toy label-free loss: total variation distance to full depth's distribution."""
    distance = 0.5 * (readout.log_probs.exp() - readout.full_probs).abs().sum(-1)
    return readout.mean(distance)


@pytest.fixture
def toys() -> Iterator[None]:
    register_calibration_map(
        CalibrationMap(
            "toy_mean_shift",  # fitted to kept states: exercises the sample path of the fit
            from_states=lambda source, reference, settings: MeanShift(
                reference.mean(0) - source.mean(0)
            ),
        )
    )
    register_metric(Metric("total_variation", _total_variation, higher_is_better=False))
    try:
        yield
    finally:
        CALIBRATION_MAPS.pop("toy_mean_shift")
        METRIC_REGISTRY.pop("total_variation")


def test_a_registered_map_and_metric_run_in_the_sweep_and_the_equivalence_checks(toys, tmp_path):
    assert "total_variation" in METRICS and "total_variation" in LOSS_METRICS
    assert HIGHER_IS_BETTER["total_variation"] is False
    model = make_model()
    evaluation, calibration = lm_sets(model)
    protocol = DepthControlProtocol(
        model,
        calibration_mode="toy_mean_shift",
        metrics=("top1_agreement", "total_variation"),
        n_bootstrap=20,
        probe="none",
        match_confidence=False,
        progress=False,
    )
    results = protocol.run(evaluation, calibration)
    assert results.metrics == ("top1_agreement", "total_variation")
    assert results.calibration["mode"] == "toy_mean_shift"
    assert results.metadata["config"]["calibration_mode"] == "toy_mean_shift"
    curves = results.curves().query("metric == 'total_variation'")
    assert curves["value"].notna().all()
    # Full depth against itself: no distance; truncated readouts are some distance away.
    assert curves.query("condition == 'full'")["value"].abs().max() <= 1e-12
    assert curves.query("condition == 'truncate' and k == 1")["value"].item() > 1e-3
    # The toy map moved the means: calibrate(truncate(1)) is a map of its own kind.
    fitted = protocol.calibrations or {}
    assert all(isinstance(m, MeanShift) for m in fitted.values() if m is not None)
    assert ProtocolResults.load(results.save(tmp_path)) == results
    # The fast-path-against-hooks checks loop over the registries, so they pick both up.
    checked = assert_every_map_matches_hooks(model, calibration, evaluation.tokens[:4])
    assert "toy_mean_shift" in checked and "total_variation" in checked
    assert {"mean", "diag", "full", "mixture"} <= set(checked)


def test_a_taken_or_unknown_name_is_refused(toys):
    with pytest.raises(ValueError, match="calibration map named 'full' is already registered"):
        register_calibration_map(CALIBRATION_MAPS["mixture"].__class__("full", lambda *a: a[0]))
    with pytest.raises(ValueError, match="metric named 'accuracy' is already registered"):
        register_metric(Metric("accuracy", _total_variation, higher_is_better=False))
    assert ProtocolConfig(calibration_mode="toy_mean_shift").calibration_mode == "toy_mean_shift"
    with pytest.raises(ConfigError, match="calibration_mode='affine' is not one of"):
        ProtocolConfig(calibration_mode="affine")


@pytest.mark.parametrize(
    ("settings", "error", "expected"),
    [
        ({"seed": "0"}, ConfigTypeError, r"seed='0' \(str\) must be an int >= 0"),
        ({"seed": None}, ConfigTypeError, r"seed=None \(NoneType\) must be an int"),
        ({"seed": True}, ConfigTypeError, r"seed=True \(bool\) must be an int"),
        ({"batch_size": "8"}, ConfigTypeError, r"batch_size='8' \(str\) must be an int >= 1"),
        ({"batch_size": 0}, ConfigError, r"batch_size=0 must be >= 1"),
        ({"k_grid": ["1"]}, ConfigTypeError, r"k_grid entry='1' \(str\) must be an int"),
        ({"k_grid": [1.5]}, ConfigTypeError, r"k_grid entry=1.5 \(float\) must be an int"),
        ({"k_grid": "12"}, ConfigTypeError, r"k_grid='12' must be a sequence of ints"),
        ({"k_grid": []}, ConfigError, r"k_grid is empty"),
        ({"n_bootstrap": -1}, ConfigError, r"n_bootstrap=-1 must be >= 0"),
        ({"match_confidence": 1}, ConfigTypeError, r"match_confidence=1 \(int\) must be a bool"),
        ({"probe": "full"}, ConfigError, r"probe='full' is not one of \('trajectory', 'none'\)"),
        ({"metrics": ("perplexity",)}, ConfigError, r"metrics \['perplexity'\] are not registered"),
        ({"metrics": "accuracy"}, ConfigTypeError, r"metrics='accuracy' must be a sequence"),
        ({"threads": 2}, ConfigError, r"unknown protocol settings \['threads'\]"),
    ],
)
def test_protocol_settings_are_checked_by_type_and_range(settings, error, expected):
    with pytest.raises(error, match=expected):
        ProtocolConfig.from_dict(settings)
    with pytest.raises(error, match=expected):  # the keyword arguments build the same config
        DepthControlProtocol(make_model(), **settings)


def test_the_config_and_the_keyword_arguments_are_one_object():
    model = make_model()
    config = ProtocolConfig(k_grid=[3, 1], n_bootstrap=50, seed=4)
    assert config.k_grid == (3, 1) and config.grid(4) == (1, 3)
    assert ProtocolConfig.from_dict(config.to_dict()) == config
    by_config = DepthControlProtocol(model, config)
    by_keywords = DepthControlProtocol(model, k_grid=[3, 1], n_bootstrap=50, seed=4)
    assert by_config.config == by_keywords.config
    assert by_keywords.context.k_grid == (1, 3) and by_keywords.config.n_bootstrap == 50
    assert DepthControlProtocol(model, config, seed=5).config.seed == 5
    with pytest.raises(ConfigError, match=r"k=5 is outside \[1, r=4\]"):
        DepthControlProtocol(model, k_grid=[1, 5])
