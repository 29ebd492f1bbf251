"""TransformerLens's own utilities run on the recurrent model unchanged and give correct results."""

from __future__ import annotations

import torch
from helpers import make_model, tokens_for
from transformer_lens import patching
from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.model_protocol import TransformerLensModel


def test_is_a_transformer_lens_model_with_an_activation_cache():
    model = make_model()
    assert isinstance(model, TransformerLensModel)
    _, cache = model.run_with_cache(tokens_for(model))
    assert isinstance(cache, ActivationCache)
    assert cache["resid_pre", 3].shape == (2, 12, 32)


def test_accumulated_resid_with_final_ln_is_the_logit_lens():
    model = make_model()
    tokens = tokens_for(model)
    logits, cache = model.run_with_cache(tokens)
    stack, labels = cache.accumulated_resid(apply_ln=True, return_labels=True)
    assert len(labels) == model.cfg.n_layers + 1 and labels[-1] == "final_post"
    assert torch.allclose(stack[-1] @ model.W_U, logits, atol=1e-10)
    # Every entry is ln_final applied to that block's input stream.
    for layer in (0, 3, 7):
        expected = model.ln_final(cache[f"blocks.{layer}.hook_resid_pre"])
        assert torch.allclose(stack[layer], expected, atol=1e-10)


def test_decompose_resid_sums_to_the_stream_when_the_stream_is_a_pure_sum():
    # No injection, s_0 = e, pre-norm: the stream entering the readout is embed + pos_embed +
    # every attn_out and mlp_out, so TransformerLens's decomposition must add up exactly.
    model = make_model(injection="none", state_init="embed", n_coda=0)
    _, cache = model.run_with_cache(tokens_for(model))
    parts, labels = cache.decompose_resid(return_labels=True)
    assert labels[:2] == ["embed", "pos_embed"]
    assert len(labels) == 2 + 2 * model.cfg.n_layers
    assert torch.allclose(parts.sum(0), cache["hook_readout_in"], atol=1e-10)


def test_act_patch_resid_pre_equals_a_hand_written_patching_loop():
    model = make_model()
    clean = tokens_for(model, batch=1, pos=6)
    corrupted = clean.clone()
    corrupted[0, 1] = (corrupted[0, 1] + 7) % model.cfg.d_vocab
    answer = int(clean[0, -1])
    _, clean_cache = model.run_with_cache(clean)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[0, -1].log_softmax(-1)[answer]

    library = patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric)
    assert library.shape == (model.cfg.n_layers, 6)
    by_hand = torch.zeros(model.cfg.n_layers, 6, dtype=torch.float64)
    for layer in range(model.cfg.n_layers):
        for pos in range(6):
            name = f"blocks.{layer}.hook_resid_pre"

            def patch(act, hook, pos=pos, name=name):
                act = act.clone()
                act[:, pos] = clean_cache[name][:, pos]
                return act

            logits = model.run_with_hooks(corrupted, fwd_hooks=[(name, patch)])
            by_hand[layer, pos] = metric(logits)
    assert torch.allclose(library.double(), by_hand, atol=1e-6)
    # Patching iteration 2's core input at the corrupted position must matter.
    assert library[model.block_index(2, 0), 1] != library[model.block_index(2, 0), 0]


def test_an_eval_model_stays_in_eval_mode_across_views_and_patching_runs():
    model = make_model().eval()
    tokens = tokens_for(model, batch=1, pos=6)
    with model.iterations(7):
        assert all(not module.training for module in model.modules())
        model(tokens)
    model(tokens, n_iterations=9)
    assert all(not module.training for module in model.modules())
    with model.iterations(7):
        _, clean_cache = model.run_with_cache(tokens)
        corrupted = tokens.clone()
        corrupted[0, 1] = (corrupted[0, 1] + 5) % model.cfg.d_vocab

        def metric(logits: torch.Tensor) -> torch.Tensor:
            return logits[0, -1, 0]

        patched = patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric)
        assert patched.shape == (model.cfg.n_layers, 6)
    model.train()
    with model.iterations(11):  # a training model builds its new blocks in training mode
        assert all(module.training for module in model.modules())
