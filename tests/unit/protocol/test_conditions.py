"""Conditions as objects: a condition defined here, registered in the sweep, is measured by the
protocol and checked fast path = hooks with no other change; registries refuse taken names."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import assert_fast_path_matches_hooks, lm_sets, make_model
from torch import Tensor

from dcp_lens import DepthControlProtocol, hooks
from dcp_lens.protocol.conditions import (
    DECOMPOSED,
    SWEEP,
    Condition,
    HookList,
    IterationModel,
    SweepCondition,
    register_sweep_condition,
    unregister_sweep_condition,
)
from dcp_lens.protocol.results import ProtocolResults
from dcp_lens.tasks import VariableBinding, register_task
from dcp_lens.zoo.registry import register_loader, register_named


class Halfway(Condition):
    """Test-only: the readout sees the midpoint of s_k and s_r (B = r, D = r)."""

    name = "halfway"

    def __init__(self, k: int) -> None:
        self.k = k

    @property
    def label(self) -> str:
        return f"halfway({self.k})"

    def coordinates(self, r: int) -> tuple[int, int]:
        return r, r

    def fwd_hooks(self, model: IterationModel) -> HookList:
        captured: dict[str, Tensor] = {}

        def keep(state: Tensor, hook: Any) -> None:
            captured["s_k"] = state

        def mix(readout_input: Tensor, hook: Any) -> Tensor:
            return (captured.pop("s_k") + readout_input) / 2

        return [(model.state_hook_name(self.k), keep), (model.readout_hook_name, mix)]

    def readout_input(self, states: Tensor) -> Tensor:
        return (states[self.k] + states[-1]) / 2


@pytest.fixture
def halfway_registered() -> Iterator[None]:
    register_sweep_condition(SweepCondition("halfway", lambda k, fitted: Halfway(k)))
    try:
        yield
    finally:
        unregister_sweep_condition("halfway")


def test_a_registered_condition_joins_the_sweep_results_and_equivalence(
    halfway_registered, tmp_path
):
    model = make_model()
    evaluation, calibration = lm_sets(model)
    # Raw loss values (no confidence matching), so that halfway(r) is exactly full depth.
    protocol = DepthControlProtocol(
        model, n_bootstrap=20, probe="none", match_confidence=False, progress=False
    )
    results = protocol.run(evaluation, calibration)
    curves = results.curves()
    halfway = curves[curves["condition"] == "halfway"]
    assert len(halfway) == len(protocol.context.k_grid) * len(results.metrics)
    assert halfway["value"].notna().all()
    # At k = r the midpoint of s_r and s_r is full depth; below r it is not.
    full_ce = curves.query("condition == 'full' and metric == 'cross_entropy'")["value"].item()
    at_r = halfway.query("metric == 'cross_entropy' and k == 4")["value"].item()
    assert at_r == pytest.approx(full_ce, abs=1e-9)
    assert results.null_control["halfway_at_r_max_abs_logit_diff"] <= 1e-9
    # The equivalence test iterates over the registry and so checks it.
    assert "halfway" in assert_fast_path_matches_hooks(protocol, evaluation.tokens[:4])
    # The factors are untouched by a further condition, and results.json round-trips it.
    assert tuple(results.table().columns[:6]) == (
        "model",
        "architecture",
        "metric",
        "k",
        "gap",
        "S",
    )
    assert ProtocolResults.load(results.save(tmp_path)) == results


def test_the_builtin_conditions_carry_their_coordinates():
    calibration = hooks.Truncate(2)  # any condition stands in for a map's source here
    identity = _Identity()
    r = 8
    assert hooks.full().coordinates(r) == (8, 8)
    assert hooks.truncate(3).coordinates(r) == (3, 3)
    assert hooks.replay(1).coordinates(r) == (8, 1)  # the linchpin: full budget, one iteration
    assert hooks.calibrate(hooks.replay(2), identity).coordinates(r) == (8, 2)
    assert hooks.shift(3, identity).coordinates(r) == (8, 8)
    assert calibration.at_depth(2) == hooks.full() and hooks.replay(8).at_depth(8) == hooks.full()
    assert tuple(SWEEP)[: len(DECOMPOSED)] == DECOMPOSED


def test_registries_refuse_a_taken_name_naming_the_existing_entry():
    with pytest.raises(ValueError, match=r"sweep condition named 'replay'.*already registered"):
        register_sweep_condition(SweepCondition("replay", lambda k, fitted: Halfway(k)))
    with pytest.raises(ValueError, match="'full' is the reference"):
        register_sweep_condition(SweepCondition("full", lambda k, fitted: Halfway(k)))
    with pytest.raises(ValueError, match=r"loader kind named 'planted'.*dcp_lens\.zoo\.planted"):
        register_loader("planted")(lambda argument, **overrides: None)
    with pytest.raises(ValueError, match=r"named model named 'default'.*already registered"):
        register_named("default")(lambda **overrides: None)

    class Impostor(VariableBinding):
        name = "variable_binding"

    with pytest.raises(ValueError, match=r"task named 'variable_binding'.*VariableBinding"):
        register_task(Impostor)
    with pytest.raises(ValueError, match="one of the decomposition's conditions"):
        unregister_sweep_condition("truncate")


class _Identity:
    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def inverse(self) -> _Identity:
        return self
