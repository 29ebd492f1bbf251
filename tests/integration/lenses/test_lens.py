"""Per-iteration lenses (dcp_lens.lenses.lens): the readout of every state, calibrated or not."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import data_path, lm_sets, make_model, tokens_for

from dcp_lens import DepthControlProtocol, hooks, load
from dcp_lens.lenses.lens import (
    fit_lens_calibrations,
    iteration_states,
    logit_lens,
    prediction_trajectory,
    protocol_calibrations,
)
from dcp_lens.lenses.tuned import JacobianLens, TunedLens
from dcp_lens.model.names import DepthMismatchError


def lens_model():
    # A pre-coda norm and a coda block: what TransformerLens's accumulated_resid lens skips.
    return make_model(pre_coda_norm="own", n_coda=2)


def test_lens_at_r_is_the_logits_and_at_k_the_truncated_models():
    model = lens_model()
    tokens = tokens_for(model)
    logits = model(tokens)
    lens = logit_lens(model, tokens)
    assert lens.shape == (5, 2, 12, model.cfg.d_vocab)
    assert (lens[4] - logits).abs().max() <= 1e-10
    for k in (1, 2, 3):
        truncated = model(tokens, n_iterations=k)
        hooked = model.run_with_hooks(tokens, fwd_hooks=hooks.truncate(k).fwd_hooks(model))
        assert (lens[k] - truncated).abs().max() <= 1e-10
        assert (lens[k] - hooked).abs().max() <= 1e-10


def test_lens_from_a_cache_equals_the_lens_from_tokens_and_differs_from_tl_accumulated_resid():
    model = lens_model()
    tokens = tokens_for(model)
    _, cache = model.run_with_cache(tokens)
    from_cache = logit_lens(model, cache, iterations=[0, 2, 4])
    assert (from_cache - logit_lens(model, tokens)[[0, 2, 4]]).abs().max() <= 1e-10
    states = iteration_states(model, cache)
    assert (states[3] - cache[model.state_hook_name(3)]).abs().max() == 0
    # TransformerLens's lens at the block where s_2 enters the readout is ln_final(s_2) @ W_U:
    # no pre-coda norm, no coda, so not what the truncated model outputs.
    stack = cache.accumulated_resid(apply_ln=True)
    tl_lens = stack[model.block_index(2, 0) + model.cfg.n_core] @ model.W_U + model.b_U
    assert (tl_lens - from_cache[1]).abs().max() > 0.1


def test_a_cache_from_another_view_is_refused_with_a_hint():
    model = lens_model()
    _, cache = model.run_with_cache(tokens_for(model), n_iterations=2)
    with pytest.raises(DepthMismatchError, match=r"k = 2 .* k = 4,.*model.iterations\(2\)"):
        logit_lens(model, cache)
    with model.iterations(2):
        assert logit_lens(model, cache).shape[0] == 3


def test_calibrated_lens_with_the_protocols_maps_is_its_calibrate_truncate():
    model = make_model(pre_coda_norm="own")
    evaluation, calibration = lm_sets(model, n=24)
    protocol = DepthControlProtocol(model, n_bootstrap=10, probe="none", progress=False)
    protocol.fit(calibration)
    maps = protocol_calibrations(protocol)
    assert sorted(maps) == [1, 2, 3, 4]
    tokens = evaluation.tokens[:4]
    lens = logit_lens(model, tokens, calibration=maps)
    assert lens.shape[0] == model.n_iterations + 1  # indexed by iteration, t = 0..r
    assert bool(lens[0].isnan().all())  # no map at t = 0: no calibrated reading
    for k in (1, 2, 3):
        expected = protocol.condition_logits(tokens, "calibrate_truncate", k, via="hooks")
        assert (lens[k] - expected).abs().max() <= 1e-8
    # calibrate(full) is the identity up to the fit's rounding.
    assert (lens[4] - model(tokens)).abs().max() <= 1e-6


def test_every_lens_is_indexed_by_iteration():
    """lens[t] is iteration t in the logit, calibrated, tuned and Jacobian lenses alike."""
    model = make_model(pre_coda_norm="own")
    evaluation, calibration = lm_sets(model, n=16)
    tokens, r = evaluation.tokens[:2], model.n_iterations
    _, cache = model.run_with_cache(tokens)
    plain = logit_lens(model, cache)
    maps = fit_lens_calibrations(model, calibration.tokens)
    calibrated = logit_lens(model, tokens, calibration=maps)
    tuned = TunedLens.fit(model, calibration.tokens, iterations=[2], steps=2)
    jacobian = JacobianLens.fit(model, tokens[:1], iterations=[1, 3])
    lenses = {
        "logit": plain,
        "calibrated": calibrated,
        "tuned": tuned.logits(model, tokens),
        "jacobian": jacobian.logits(model, tokens),
    }
    for name, lens in lenses.items():
        assert lens.shape[0] == r + 1, name
    for t in range(r + 1):
        torch.testing.assert_close(plain[t], logit_lens(model, tokens, [t])[0])
    assert bool(calibrated[0].isnan().all()) and not bool(calibrated[1:].isnan().any())
    torch.testing.assert_close(lenses["tuned"][2], tuned.logits(model, tokens, [2])[0])
    torch.testing.assert_close(lenses["tuned"][r], model(tokens))  # t = r: the model itself
    assert bool(lenses["tuned"][1].isnan().all())
    torch.testing.assert_close(lenses["jacobian"][3], jacobian.logits(model, tokens, [3])[0])
    assert bool(lenses["jacobian"][2].isnan().all())


def test_fit_lens_calibrations_matches_the_protocols_fit_and_moves_moments():
    model = make_model(pre_coda_norm="own")
    _, calibration = lm_sets(model, n=24)
    protocol = DepthControlProtocol(model, n_bootstrap=10, probe="none", progress=False)
    protocol.fit(calibration)
    ours = fit_lens_calibrations(model, calibration.tokens, batch_size=7)
    theirs = protocol_calibrations(protocol)
    for t in (1, 2, 3):
        other = theirs[t]
        assert other is not None
        # The protocol keeps each jackknife group's scatter in float32: the whole split's map
        # agrees to float32's rounding.
        assert torch.allclose(ours[t].linear, other.linear, atol=1e-5)
        assert torch.allclose(ours[t].source_mean, other.source_mean, atol=1e-12)
    # The calibrated s_1 has the full-depth mean on the calibration split.
    states = iteration_states(model, calibration.tokens, [1, 4])
    moved = ours[1](states[0]).reshape(-1, model.cfg.d_model).mean(0)
    assert (moved - states[1].reshape(-1, model.cfg.d_model).mean(0)).abs().max() <= 1e-9


def test_prediction_trajectory_ranks_and_probabilities():
    model = lens_model()
    tokens = tokens_for(model)
    targets = tokens.roll(-1, dims=1)
    trajectory = prediction_trajectory(model, tokens, targets)
    lens = logit_lens(model, tokens)
    probs = lens.detach().softmax(-1)
    t, b, p = 2, 1, 5
    target = int(targets[b, p])
    probability = float(trajectory.probability[t, b, p])
    assert math.isclose(probability, float(probs[t, b, p, target]), rel_tol=1e-6)
    assert int(trajectory.rank[t, b, p]) == int((probs[t, b, p] > probs[t, b, p, target]).sum())
    assert trajectory.exit_probability is None
    # By default the target is the model's own prediction: rank 0 at full depth.
    own = prediction_trajectory(model, tokens)
    assert bool((own.rank[-1] == 0).all())
    table = own.table(example=0, position=3)
    assert list(table["iteration"]) == [0, 1, 2, 3, 4] and table["rank"].iloc[-1] == 0
    # A mismatch is caught by the shape check (jaxtyping while testing, else a ValueError).
    with pytest.raises((ValueError, TypeError)):
        prediction_trajectory(model, tokens, targets[:, :3])


def test_ouro_exit_probabilities_beside_the_trajectory():
    model = load(f"ouro:{data_path('fixtures', 'ouro_tiny')}")
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 7), generator=torch.Generator().manual_seed(1))
    trajectory = prediction_trajectory(model, tokens)
    assert trajectory.exit_probability is not None
    assert bool(trajectory.exit_probability[0].isnan().all())
    expected = model.exit_probabilities(tokens).movedim(-1, 0)
    assert (trajectory.exit_probability[1:] - expected).abs().max() <= 1e-6
    assert "exit_probability" in trajectory.table().columns
    # The lens at every step is Ouro's per-step readout.
    steps = model.exit_outputs(tokens).step_logits.movedim(2, 0)
    assert (logit_lens(model, tokens)[1:] - steps).abs().max() <= 1e-5


def test_lens_on_a_dense_model_reads_every_layer():
    model = make_model(n_core=0, n_prelude=4, n_coda=0)
    tokens = tokens_for(model)
    lens = logit_lens(model, tokens)
    assert lens.shape[0] == 5
    assert (lens[-1] - model(tokens)).abs().max() <= 1e-10
    # Iteration 2 of a dense model is the stream after its second layer, read out.
    after_two = model(tokens, stop_at_layer=2)
    assert (lens[2] - model.ln_final(after_two) @ model.W_U).abs().max() <= 1e-10
