"""The lenses TransformerLens refuses on looped models: the tuned lens (affine translators per
iteration) and the Jacobian lens (per-iteration Jacobians), on the Huginn and Ouro fixtures; the
translator on its own; prediction trajectories over a task's unscored positions."""

from __future__ import annotations

import pytest
import torch
from helpers import data_path, make_model, tokens_for

from dcp_lens import load
from dcp_lens.lenses.lens import logit_lens, prediction_trajectory
from dcp_lens.lenses.tuned import JacobianLens, LensError, TunedLens, final_stream_hook
from dcp_lens.protocol.translator import AffineTranslator, TranslatorError

HUGINN = data_path("fixtures", "huginn_tiny")
OURO = data_path("fixtures", "ouro_tiny")


@pytest.fixture(scope="module")
def huginn():
    return load(f"huginn:{HUGINN}").eval()


@pytest.fixture(scope="module")
def ouro():
    return load(f"ouro:{OURO}").eval()


def _splits(model, n: int = 8, pos: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.d_vocab, (2 * n, pos), generator=generator)
    return tokens[:n], tokens[n:]


def _kl(full: torch.Tensor, lens: torch.Tensor) -> float:
    p = full.log_softmax(-1)
    return float((p.exp() * (p - lens.log_softmax(-1))).sum(-1).mean())


def test_tuned_lens_at_r_is_the_identity_readout_and_fitting_lowers_kl(huginn, tmp_path):
    calibration, evaluation = _splits(huginn)
    lens = TunedLens.fit(huginn, calibration, iterations=[1, 2], steps=15, lr=1e-2)
    r = huginn.n_iterations
    assert lens.translator(r).is_identity
    assert not lens.translator(1).is_identity
    tuned = lens.logits(huginn, evaluation)
    assert [int(t) for t in sorted(lens.translators)] == [1, 2, r]
    assert (tuned[-1] - huginn(evaluation)).abs().max() <= 1e-5
    # On the split it was fitted on, the tuned lens is closer to the full output than the logit
    # lens (the translator starts at the identity, so Adam can only improve the fit loss).
    full = huginn(calibration)
    fitted = lens.logits(huginn, calibration, [1])[0]
    assert _kl(full, fitted) < _kl(full, logit_lens(huginn, calibration, [1])[0])
    path = lens.save(tmp_path / "lens.safetensors")
    again = TunedLens.load(path)
    torch.testing.assert_close(again.logits(huginn, evaluation), tuned, equal_nan=True)
    with pytest.raises(LensError, match="no translator for iteration 3"):
        lens.logits(huginn, evaluation, [3])


def test_translator_starts_at_identity_and_recovers_a_planted_affine_shift(tmp_path):
    generator = torch.Generator().manual_seed(1)
    d, vocab = 6, 12
    W_U = torch.randn(d, vocab, generator=generator)
    states = torch.randn(4, 5, d, generator=generator)
    shift = torch.randn(d, generator=generator)

    def readout(x: torch.Tensor) -> torch.Tensor:
        return x @ W_U

    translator = AffineTranslator(d)
    assert translator.is_identity and torch.equal(translator(states), states)
    history = translator.fit(states - shift, readout(states), readout, steps=300, lr=5e-2)
    assert history[-1] < 0.02 * history[0]
    assert (translator(states - shift) @ W_U - states @ W_U).abs().max() < 0.2
    again = AffineTranslator.load(translator.save(tmp_path / "t.safetensors"))
    assert torch.equal(again.weight, translator.weight) and torch.equal(again.bias, translator.bias)
    with pytest.raises(TranslatorError, match="width 5"):
        translator(torch.zeros(2, 5))


def test_jacobian_lens_runs_on_every_iteration_of_huginn_and_matches_finite_differences():
    model = load(f"huginn:{HUGINN}").eval().to(torch.float64)
    tokens = torch.randint(0, model.cfg.d_vocab, (1, 5), generator=torch.Generator().manual_seed(2))
    r = model.n_iterations
    lens = JacobianLens.fit(model, tokens)
    assert sorted(lens.jacobians) == list(range(r + 1))
    for jacobian in lens.jacobians.values():
        assert jacobian.shape == (model.cfg.d_model,) * 2 and torch.isfinite(jacobian).all()
    readout = lens.logits(model, tokens)
    assert readout.shape == (r + 1, 1, 5, model.cfg.d_vocab) and torch.isfinite(readout).all()
    # Column k of J_t: the summed final stream's response to s_t + eps e_k at every position.
    t, k, eps = 2, 3, 1e-6
    final = final_stream_hook(model)

    def summed_final(step: float) -> torch.Tensor:
        kept = {}

        def nudge(state, hook):
            state = state.clone()
            state[..., k] += step
            return state

        def keep(stream, hook):
            kept["x"] = stream

        model.run_with_hooks(
            tokens, return_type=None, fwd_hooks=[(model.state_hook_name(t), nudge), (final, keep)]
        )
        return kept["x"][0].sum(0)

    column = (summed_final(eps) - summed_final(-eps)) / (2 * eps) / tokens.shape[1]
    assert torch.allclose(lens.jacobians[t][:, k], column, atol=1e-5)


def test_jacobian_lens_at_r_is_the_logit_lens_where_the_readout_is_the_final_norm(ouro):
    tokens = torch.randint(0, ouro.cfg.d_vocab, (1, 4), generator=torch.Generator().manual_seed(3))
    r = ouro.n_iterations
    lens = JacobianLens.fit(ouro, tokens, iterations=[1, r])
    assert torch.allclose(lens.jacobians[r], torch.eye(ouro.cfg.d_model, dtype=torch.float64))
    assert (lens.logits(ouro, tokens, [r])[0] - ouro(tokens)).abs().max() <= 1e-5
    assert not torch.allclose(lens.jacobians[1], torch.eye(ouro.cfg.d_model, dtype=torch.float64))


def test_prediction_trajectory_leaves_unscored_positions_out():
    model = make_model()
    tokens = tokens_for(model)
    targets = tokens.roll(-1, dims=1)
    targets[:, :4] = -100
    trajectory = prediction_trajectory(model, tokens, targets)
    assert torch.isnan(trajectory.probability[:, :, :4]).all()
    assert (trajectory.rank[:, :, :4] == -1).all()
    assert torch.isfinite(trajectory.probability[:, :, 4:]).all()
    assert (trajectory.rank[:, :, 4:] >= 0).all()
