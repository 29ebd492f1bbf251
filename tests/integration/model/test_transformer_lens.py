"""TransformerLens's own utilities run on the recurrent model unchanged and give correct results."""

from __future__ import annotations

import pytest
import torch
from helpers import data_path, make_model, tokens_for
from transformer_lens import patching
from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.model_protocol import TransformerLensModel

from dcp_lens import load


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
    assert torch.allclose(stack[-1] @ model.W_U + model.b_U, logits, atol=1e-10)
    # Every entry is ln_final applied to that block's input stream, its bias left to b_U.
    for layer in (0, 3, 7):
        expected = model.ln_final(cache[f"blocks.{layer}.hook_resid_pre"]) - model.ln_final.b
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


def test_logit_attrs_agree_with_a_manual_computation():
    model = make_model()
    tokens = tokens_for(model)
    logits, cache = model.run_with_cache(tokens)
    answer, wrong = tokens[:, -1], (tokens[:, -1] + 1) % model.cfg.d_vocab
    stack = cache.accumulated_resid(pos_slice=-1)  # [n_layers + 1, batch, d_model]
    attrs = cache.logit_attrs(stack, answer, pos_slice=-1)
    # By hand: centre (LayerNorm), divide by the cached final scale, dot with w * W_U[:, answer].
    scale = cache["ln_final.hook_scale"][:, -1]  # [batch, 1]
    centred = stack - stack.mean(-1, keepdim=True)
    direction = (model.ln_final.w[:, None] * model.W_U[:, answer]).T  # [batch, d_model]
    assert torch.allclose(attrs, (centred / scale * direction).sum(-1), atol=1e-10)
    # The final stream's attribution is the answer's logit less the final norm's bias term.
    bias_term = model.ln_final.b @ model.W_U[:, answer]
    assert torch.allclose(bias_term, model.b_U[answer])  # attributions + b_U = logit
    assert torch.allclose(attrs[-1], logits[:, -1].gather(1, answer[:, None])[:, 0] - bias_term)
    difference = cache.logit_attrs(stack, answer, incorrect_tokens=wrong, pos_slice=-1)
    expected = logits[:, -1].gather(1, answer[:, None]) - logits[:, -1].gather(1, wrong[:, None])
    bias_gap = model.ln_final.b @ (model.W_U[:, answer] - model.W_U[:, wrong])
    assert torch.allclose(difference[-1], expected[:, 0] - bias_gap, atol=1e-10)


def test_get_full_resid_decomposition_adds_up_to_the_stream_entering_the_readout():
    # A pure residual sum (pre-norm, no injection, s_0 = e): heads + neurons + embeddings +
    # accumulated MLP biases are the whole stream.
    model = make_model(injection="none", state_init="embed", n_coda=0)
    _, cache = model.run_with_cache(tokens_for(model))
    parts, labels = cache.get_full_resid_decomposition(return_labels=True)
    n = model.cfg.n_layers
    assert len(labels) == n * model.cfg.n_heads + n * model.cfg.d_mlp + 3
    assert labels[0] == "L0H0" and labels[-3:] == ["embed", "pos_embed", "bias"]
    assert torch.allclose(parts.sum(0), cache["hook_readout_in"], atol=1e-10)
    mlp_only = cache.get_full_resid_decomposition(expand_neurons=False)
    assert torch.allclose(mlp_only.sum(0), cache["hook_readout_in"], atol=1e-10)
    bias = sum(block.mlp.b_out for block in model.blocks)
    assert torch.allclose(model.accumulated_bias(n), bias)
    assert model.accumulated_bias(0).abs().max() == 0


def test_run_with_cache_can_return_the_plain_dict():
    model = make_model()
    tokens = tokens_for(model)
    logits, cache = model.run_with_cache(tokens)
    same_logits, plain = model.run_with_cache(tokens, return_cache_object=False)
    assert type(plain) is dict and set(plain) == set(cache.keys())
    assert torch.equal(logits, same_logits)
    assert torch.equal(plain["loop.2.hook_state"], cache["loop.2.hook_state"])


def test_string_helpers_on_a_model_with_a_tokenizer():
    model = load(f"llama2c:{data_path('stories260K')}")
    text = "Once upon a time"
    tokens = model.to_tokens(text)
    pieces = model.to_str_tokens(text)
    # BOS as llama2.c's vocabulary stores it ("\n<s>\n"), then the pieces of the text.
    assert pieces[0] == model.tokenizer.id_to_piece(1) and "".join(pieces[1:]) == " " + text
    assert model.to_str_tokens(tokens) == pieces == model.to_str_tokens(tokens[0])
    assert model.to_str_tokens([text, text]) == [pieces, pieces]
    time = model.to_single_token("time")  # SentencePiece adds the leading space itself
    assert model.to_single_str_token(time) == " time"
    assert model.get_token_position(time, tokens) == len(pieces) - 1
    assert model.get_token_position("time", text) == len(pieces) - 1
    assert model.get_token_position(1, tokens, mode="last") == 0
    with pytest.raises(ValueError, match="not one"):
        model.to_single_token("once upon")
    with pytest.raises(ValueError, match="does not occur"):
        model.get_token_position(time, tokens[:, :2])
    # logit_attrs takes a token as a string too.
    _, cache = model.run_with_cache(tokens)
    stack = cache.accumulated_resid(pos_slice=-1)
    by_string = cache.logit_attrs(stack, "time", pos_slice=-1)
    by_id = cache.logit_attrs(stack, time, pos_slice=-1)
    assert torch.equal(by_string, by_id)
