"""The interventions in dcp_lens.hooks, run through TransformerLens hooks on the model."""

from __future__ import annotations

import pytest
import torch
from helpers import make_model, tokens_for

from dcp_lens import hooks
from dcp_lens.protocol.calibration import fit_calibration


def test_truncate_hooks_equal_the_k_iteration_configuration():
    model = make_model(injection="concat_adapter")
    tokens = tokens_for(model)
    for k in (1, 2, 3):
        hooked = model.run_with_hooks(tokens, fwd_hooks=hooks.truncate(k).fwd_hooks(model))
        assert (hooked - model(tokens, n_iterations=k)).abs().max() <= 1e-10


def test_replay_hooks_repeat_the_kth_update():
    model = make_model()
    tokens = tokens_for(model)
    _, cache = model.run_with_cache(tokens)
    states = [cache[model.state_hook_name(t)] for t in range(5)]
    for k in (1, 2, 4):
        expected_state = states[k] + (4 - k) * (states[k] - states[k - 1])
        hooked = model.run_with_hooks(tokens, fwd_hooks=hooks.replay(k).fwd_hooks(model))
        assert (hooked - model.readout(expected_state)).abs().max() <= 1e-10
    # replay(1) is the linchpin: four applications, one distinct update.
    assert not torch.allclose(model.readout(states[1]), model.readout(states[4]))


def test_calibrate_and_shift_map_the_readout_input():
    model = make_model()
    tokens = tokens_for(model, batch=4)  # 48 states: enough for a full map of width 32
    _, cache = model.run_with_cache(tokens)
    s2, s4 = cache[model.state_hook_name(2)], cache[model.state_hook_name(4)]
    calibration = fit_calibration(s2, s4)
    calibrated = model.run_with_hooks(
        tokens, fwd_hooks=hooks.calibrate(hooks.truncate(2), calibration).fwd_hooks(model)
    )
    assert (calibrated - model.readout(calibration(s2))).abs().max() <= 1e-10
    shifted = model.run_with_hooks(tokens, fwd_hooks=hooks.shift(2, calibration).fwd_hooks(model))
    assert (shifted - model.readout(calibration.inverse()(s4))).abs().max() <= 1e-10


def test_hooks_leave_the_model_as_they_found_it():
    model = make_model()
    tokens = tokens_for(model)
    before = model(tokens)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with model.hooks(fwd_hooks=hooks.replay(1).fwd_hooks(model)):
        assert not torch.equal(model(tokens), before)
    model.run_with_hooks(tokens, fwd_hooks=hooks.truncate(2).fwd_hooks(model))
    assert torch.equal(model(tokens), before)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(not hook.fwd_hooks for hook in model.hook_dict.values())


def test_dense_model_truncate_and_replay_use_layers_as_iterations():
    model = make_model(n_core=0, n_prelude=4, n_coda=0)
    tokens = tokens_for(model)
    truncated = model.run_with_hooks(tokens, fwd_hooks=hooks.truncate(2).fwd_hooks(model))
    stream = model(tokens, stop_at_layer=2)
    assert (truncated - model(stream, start_at_layer=4)).abs().max() <= 1e-10
    replayed = hooks.replay(1)
    assert replayed.realizable(model) is False
    assert hooks.truncate(1).realizable(model) is True
    assert model.run_with_hooks(tokens, fwd_hooks=replayed.fwd_hooks(model)).isfinite().all()


@pytest.mark.parametrize("make", [hooks.truncate, hooks.replay])
def test_k_outside_one_to_r_is_an_error(make):
    model = make_model()
    with pytest.raises(ValueError, match="k=0"):
        make(0)
    with pytest.raises(ValueError, match=r"k=5\) needs 1 <= k <= r = 4"):
        make(5).fwd_hooks(model)
    with pytest.raises(TypeError, match="int"):
        make(1.5)


def test_shift_and_calibrate_validate_their_arguments():
    model = make_model()
    with pytest.raises(TypeError, match="state map|StateMap"):  # ours, or beartype's in tests
        hooks.shift(2, lambda h: h)
    calibration = fit_calibration(torch.randn(50, 32), torch.randn(50, 32))
    with pytest.raises(ValueError, match=r"k=9\) needs 1 <= k <= r = 4"):
        hooks.shift(9, calibration).fwd_hooks(model)
    with pytest.raises(ValueError, match="twice"):
        hooks.calibrate(hooks.calibrate(hooks.truncate(1), calibration), calibration)
