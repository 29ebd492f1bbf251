"""HookedRecurrentTransformer against an independent plain loop, plus hooks, ties, generation."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import data_path, make_model, tokens_for
from reference import reference_forward
from transformer_lens import patching

from dcp_lens import HookedRecurrentTransformer, RecurrentConfig, load
from dcp_lens.model import names as names_module
from dcp_lens.model.components.attention import KVCache
from dcp_lens.model.hooked_recurrent_transformer import ResumeError
from dcp_lens.model.names import (
    BlockIndexWarning,
    DepthMismatchError,
    HookNameError,
    PatchShapeError,
)

# Equivalence is checked in float64, where any real mistake is many orders above 1e-5.
TOL = 1e-5


def assert_matches_reference(model: HookedRecurrentTransformer, k: int) -> None:
    tokens = tokens_for(model)
    with model.iterations(k):
        logits, cache = model.run_with_cache(tokens)
        states = [cache[model.state_hook_name(t)] for t in range(k + 1)]
    ref_states, ref_logits = reference_forward(model.canonical_state_dict(), model.cfg, tokens, k)
    for t, (ours, theirs) in enumerate(zip(states, ref_states, strict=True)):
        assert (ours - theirs).abs().max() <= TOL, f"state {t} differs"
    assert (logits - ref_logits).abs().max() <= TOL


@pytest.mark.parametrize(
    "injection,placement,k",
    list(
        itertools.product(
            ["none", "add", "concat_adapter"], ["pre", "sandwich", "sandwich_residual"], [2, 4, 6]
        )
    ),
)
def test_matches_plain_loop_for_every_injection_and_placement(injection, placement, k):
    model = make_model(injection=injection, norm_placement=placement)
    assert_matches_reference(model, k)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(
            normalization_type="RMS",
            positional_embedding_type="rotary_interleaved",
            qk_bias=True,
            n_key_value_heads=2,
            act_fn="silu_gated",
            tie_unembed=True,
            embed_scale=5.0,
            pre_coda_norm="final",
            norm_placement="sandwich_residual",
            injection="concat_adapter",
        ),
        dict(
            normalization_type="RMS",
            positional_embedding_type="rotary_rotate_half",
            iteration_norm="own",
            final_norm=False,
            n_prelude=0,
            n_coda=0,
            state_init="embed",
            injection="none",
            norm_placement="sandwich",
            act_fn="silu_gated",
        ),
        dict(state_init="normal", state_init_std=0.5, pre_coda_norm="own", iteration_norm="final"),
        dict(n_core=0, n_prelude=3, n_coda=2),
    ],
    ids=["huginn-like", "ouro-like", "noise-init", "dense"],
)
@pytest.mark.parametrize("k", [1, 4, 7])
def test_matches_plain_loop_for_real_model_options(overrides, k):
    model = make_model(**overrides)
    if model.is_dense:
        k = model.n_iterations  # a dense model has one view: its layers
        tokens = tokens_for(model)
        logits, cache = model.run_with_cache(tokens)
        ref_states, ref_logits = reference_forward(
            model.canonical_state_dict(), model.cfg, tokens, 0
        )
        for t in range(k + 1):
            assert (cache[model.state_hook_name(t)] - ref_states[t]).abs().max() <= TOL
        assert (logits - ref_logits).abs().max() <= TOL
        return
    assert_matches_reference(model, k)


def test_forward_argument_equals_view_context_and_restores_view():
    model = make_model()
    tokens = tokens_for(model)
    with model.iterations(6):
        in_context = model(tokens)
        assert model.cfg.n_layers == 1 + 6 * 2 + 1
    assert model.cfg.n_layers == 1 + 4 * 2 + 1 and model.n_iterations == 4
    assert torch.equal(model(tokens, n_iterations=6), in_context)
    assert model.cfg.n_layers == 10


def test_every_iteration_has_distinct_cache_entries():
    model = make_model()
    _, cache = model.run_with_cache(tokens_for(model))
    outputs = [cache[model.hook_name(t, 1, "hook_resid_post")] for t in range(1, 5)]
    patterns = [cache[model.hook_name(t, 0, "attn.hook_pattern")] for t in range(1, 5)]
    for a, b in itertools.combinations(range(4), 2):
        assert not torch.allclose(outputs[a], outputs[b])
        assert not torch.allclose(patterns[a], patterns[b])
    assert len({model.state_hook_name(t) for t in range(5)}) == 5


def test_hook_on_iteration_t_changes_later_iterations_only():
    model = make_model()
    tokens = tokens_for(model)
    _, clean = model.run_with_cache(tokens)
    target = 2

    def perturb(state, hook):
        return state + 1.0

    with model.hooks(fwd_hooks=[(model.state_hook_name(target), perturb)]):
        _, patched = model.run_with_cache(tokens)
    for t in range(5):
        name = model.state_hook_name(t)
        same = torch.equal(clean[name], patched[name])
        assert same == (t < target), f"state {t}: changed={not same}"
    assert not torch.equal(clean["hook_readout_in"], patched["hook_readout_in"])


def test_tied_gradient_is_sum_of_untied_copies():
    model = make_model()
    tokens = tokens_for(model)
    untied = make_model()
    untied.load_state_dict(model.state_dict())
    # Give every application its own copy of the core parameters.
    for row in untied._core:
        for block in row:
            for module in block.modules():
                for name, parameter in list(module._parameters.items()):
                    module._parameters[name] = torch.nn.Parameter(parameter.detach().clone())
    untied.setup()
    model(tokens, return_type="loss").backward()
    untied(tokens, return_type="loss").backward()
    for layer in range(2):
        tied_grad = model._core[0][layer].attn.W_Q.grad
        copies = [untied._core[t][layer].attn.W_Q.grad for t in range(4)]
        assert all(g is not None and g.abs().sum() > 0 for g in copies)
        assert torch.allclose(tied_grad, sum(copies), atol=1e-6)
        assert not torch.allclose(copies[0], copies[3])


@pytest.mark.parametrize("positional", ["learned", "rotary_interleaved"])
def test_generate_with_and_without_kv_cache(positional):
    model = make_model(positional_embedding_type=positional, init_std=0.5)
    prompt = tokens_for(model, batch=2, pos=5)
    for k in (2, 4, 6):
        cached = model.generate(prompt, 10, n_iterations=k, use_past_kv_cache=True)
        uncached = model.generate(prompt, 10, n_iterations=k, use_past_kv_cache=False)
        assert torch.equal(cached, uncached)
        assert cached.shape == (2, 15)


def test_save_load_round_trip_keeps_ties(tmp_path):
    from safetensors import safe_open

    model = make_model(iteration_norm="own", pre_coda_norm="final")
    model.save_pretrained(tmp_path)
    loaded = HookedRecurrentTransformer.from_pretrained(tmp_path)
    tokens = tokens_for(model)
    assert torch.equal(model(tokens, n_iterations=5), loaded(tokens, n_iterations=5))
    for (name, a), (_, b) in zip(
        model.canonical_state_dict().items(), loaded.canonical_state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        keys = list(handle.keys())
    unique = {id(p) for p in model.parameters()}
    assert len(keys) == len(unique)
    assert not any(k.startswith("blocks.") for k in keys)
    # One update moves every copy of a shared parameter.
    with loaded.iterations(6):
        with torch.no_grad():
            loaded._core[0][1].mlp.W_in.add_(1.0)
        copies = [loaded.blocks[loaded.block_index(t, 1)].mlp.W_in for t in range(1, 7)]
        assert all(c is copies[0] for c in copies)
        assert loaded._iteration_hooks[3].ln_iter.w is loaded._iteration_hooks[1].ln_iter.w
        assert loaded.ln_pre_coda.w is loaded.ln_final.w


def test_deepcopy_and_dtype_keep_ties():
    import copy

    model = make_model()
    twin = copy.deepcopy(model).to(torch.float64)
    assert twin._core[3][0].attn.W_O is twin._core[0][0].attn.W_O
    assert twin._core[0][0].attn.W_O is not model._core[0][0].attn.W_O
    assert twin.blocks[3].attn.W_O.dtype == torch.float64


def test_dense_model_uses_the_same_hook_names():
    model = make_model(n_core=0, n_prelude=4, n_coda=0)
    _, cache = model.run_with_cache(tokens_for(model))
    assert model.n_iterations == 4 and model.cfg.n_layers == 4
    assert "blocks.3.attn.hook_pattern" in cache.keys() and "hook_readout_in" in cache.keys()
    assert torch.equal(cache[model.state_hook_name(4)], cache["hook_readout_in"])
    with pytest.raises(ValueError, match="dense"):
        with model.iterations(2):
            pass


def test_start_and_stop_at_layer_compose_to_the_full_forward():
    model = make_model(injection="concat_adapter")
    tokens = tokens_for(model)
    full, cache = model.run_with_cache(tokens)
    e = cache["blocks.0.hook_resid_post"]  # the prelude's output, injected at every iteration
    for split in range(model.cfg.n_layers):
        middle = model(tokens, stop_at_layer=split)
        assert (middle - cache[f"blocks.{split}.hook_resid_pre"]).abs().max() <= TOL
        resumed = model(middle, start_at_layer=split, prelude_output=e)
        assert (resumed - full).abs().max() <= TOL, split
    assert (model.readout(cache[model.readout_hook_name]) - full).abs().max() <= TOL
    final_stream = model(tokens, stop_at_layer=model.cfg.n_layers)
    assert (
        final_stream - cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    ).abs().max() <= TOL
    with pytest.raises(ValueError, match="prelude_output"):
        model(cache["blocks.3.hook_resid_pre"], start_at_layer=3)


def test_loss_matches_logits():
    model = make_model()
    tokens = tokens_for(model)
    logits, loss = model(tokens, return_type="both")
    flat_logits, flat_targets = logits[:, :-1].reshape(-1, 40), tokens[:, 1:].reshape(-1)
    manual = torch.nn.functional.cross_entropy(flat_logits, flat_targets)
    assert torch.allclose(loss, manual)
    assert model(tokens, return_type=None) is None
    assert model(tokens, return_type="loss", loss_per_token=True).shape == (2, 11)


def test_two_models_from_one_config_do_not_affect_each_other():
    config = RecurrentConfig(d_model=16, n_heads=2, d_head=8, d_mlp=32, d_vocab=20, n_ctx=16)
    a, b = HookedRecurrentTransformer(config), HookedRecurrentTransformer(config)
    tokens = torch.randint(0, 20, (2, 8), generator=torch.Generator().manual_seed(0))
    before = b(tokens)
    with a.iterations(8):
        assert a.cfg.n_layers == 1 + 2 * 8 + 1
        assert b.cfg.n_layers == config.n_layers == 1 + 2 * 4 + 1
        assert torch.equal(b(tokens), before)
    assert a.cfg is not config and b.cfg is not a.cfg


def test_capture_states_can_stop_after_the_last_state_and_leaves_no_hook():
    """stop_after_last ends the forward at the last state asked for: the same states, no
    output, and every temporary hook removed (the readout of s_r is then full depth's logits)."""
    from dcp_lens.protocol.states import capture_states

    model = make_model()
    tokens = tokens_for(model)
    with torch.no_grad():
        states, logits = capture_states(model, tokens)
        stopped, output = capture_states(model, tokens, stop_after_last=True)
        early, _ = capture_states(model, tokens, iterations=[2, 0], stop_after_last=True)
        assert output is None and torch.equal(stopped, states)
        assert torch.equal(early, states[[2, 0]])
        torch.testing.assert_close(model.readout(stopped[-1]), logits, rtol=0, atol=1e-12)
    assert all(not point.fwd_hooks for point in model.hook_dict.values())


# ------------------------------------------------- the causal initial state (Huginn fixture)


@pytest.fixture(scope="module")
def huginn() -> HookedRecurrentTransformer:
    """The Huginn fixture with its default load: state_init="huginn", noise on."""
    model = load(f"huginn:{data_path('fixtures', 'huginn_tiny')}").eval()
    assert model.cfg.state_init == "huginn"
    return model


def prompts(model: HookedRecurrentTransformer, batch: int = 8, pos: int = 32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(11)
    return torch.randint(0, model.cfg.d_vocab, (batch, pos), generator=generator)


@torch.no_grad()
def test_every_prefix_gives_the_logits_of_the_longer_forward(huginn):
    tokens = prompts(huginn)
    full = huginn(tokens)
    worst = max(
        (full[:, :p] - huginn(tokens[:, :p])).abs().max().item()
        for p in range(1, tokens.shape[1] + 1)
    )
    assert worst <= 1e-5
    # The noise is there and causal: changing the last token leaves earlier states alone.
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % huginn.cfg.d_vocab
    _, cache = huginn.run_with_cache(tokens)
    _, other = huginn.run_with_cache(changed)
    state, moved = cache["loop.0.hook_state"], other["loop.0.hook_state"]
    assert state.abs().max() > 0.5 and torch.equal(state[:, :-1], moved[:, :-1])
    assert (state[:, -1] - moved[:, -1]).abs().max() > 0.1


@torch.no_grad()
def test_generation_with_and_without_the_kv_cache_agree_on_long_prompts(huginn):
    tokens = prompts(huginn)
    with_cache = huginn.generate(tokens, 16, use_past_kv_cache=True)
    without = huginn.generate(tokens, 16, use_past_kv_cache=False)
    assert with_cache.shape == (8, 48) and torch.equal(with_cache, without)
    with huginn.iterations(6):
        deeper = huginn.generate(tokens[:2], 8, use_past_kv_cache=True)
        assert torch.equal(deeper, huginn.generate(tokens[:2], 8, use_past_kv_cache=False))
        assert (huginn(tokens)[:, :10] - huginn(tokens[:, :10])).abs().max() <= 1e-5


@torch.no_grad()
def test_an_example_draws_its_noise_whatever_its_batch_order_or_padding(huginn):
    tokens = prompts(huginn)
    logits = huginn(tokens)
    order = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])
    assert (huginn(tokens[order]) - logits[order]).abs().max() <= 1e-5
    assert (huginn(tokens[3:4]) - logits[3:4]).abs().max() <= 1e-5
    padded = torch.cat([tokens[:, :20], torch.zeros(8, 12, dtype=torch.long)], dim=1)
    assert (huginn(padded)[:, :20] - logits[:, :20]).abs().max() <= 1e-5


@torch.no_grad()
def test_the_seed_moves_the_noise_as_the_sweeps_noise_draws_need(huginn):
    tokens = prompts(huginn, batch=2)
    _, cache = huginn.run_with_cache(tokens)
    seed = huginn.cfg.state_init_seed
    huginn.cfg.state_init_seed = seed + 1_000_003
    try:
        _, moved = huginn.run_with_cache(tokens)
    finally:
        huginn.cfg.state_init_seed = seed
    first, second = cache["loop.0.hook_state"], moved["loop.0.hook_state"]
    assert (first - second).abs().mean() > 0.3  # two independent draws
    # Huginn's truncated normal: std * sqrt(d_model)-scaled, within three standard deviations.
    scale = huginn.cfg.state_init_std * huginn.cfg.embed_scale
    assert abs(first.std().item() / scale - 0.9866) < 0.03
    assert first.abs().max().item() <= 3 * scale + 1e-5
    assert abs(first.mean().item()) < 0.05 * scale


def test_a_kv_cache_without_the_noise_prefix_is_refused(huginn):
    tokens = prompts(huginn, batch=1, pos=6)
    cache = KVCache(huginn.cfg.n_layers)
    huginn(tokens, past_kv_cache=cache)
    del cache.noise_prefix  # as a cache filled by something else would be
    with pytest.raises(ResumeError, match="prefix state"):
        huginn(tokens[:, :1], past_kv_cache=cache)


# ---------------------------------------------------------- dtype, device, depth, shapes


def test_cfg_dtype_and_device_follow_the_weights():
    model = load(f"huginn:{data_path('fixtures', 'huginn_tiny')}", dtype="bfloat16")
    assert model.cfg.dtype == torch.bfloat16 and model.cfg.device == "cpu"
    for cast, dtype in (
        (lambda m: m.float(), torch.float32),
        (lambda m: m.half(), torch.float16),
        (lambda m: m.to(torch.float64), torch.float64),
        (lambda m: m.cpu(), torch.float64),
    ):
        cast(model)
        assert model.cfg.dtype == dtype == model.W_E.dtype and model.cfg.device == "cpu"
    assert model.device == model.W_E.device and model.config is model.cfg


def test_a_cache_used_at_another_depth_names_both_depths():
    model = make_model()
    tokens = tokens_for(model, batch=1, pos=6)
    _, cache = model.run_with_cache(tokens)
    with model.iterations(6), pytest.raises(DepthMismatchError, match=r"k = 4.*k = 6"):
        patching.get_act_patch_resid_pre(model, tokens, cache, lambda logits: logits[0, -1, 0])
    with model.iterations(2), pytest.raises(DepthMismatchError, match="iterations\\(4\\)"):
        cache.decompose_resid()
    with model.iterations(4):  # the recorded depth: fine
        assert cache.decompose_resid().shape[1:] == (1, 6, model.cfg.d_model)
    assert torch.equal(cache["loop.2.hook_state"], cache[model.state_hook_name(2)])


def test_a_hook_name_of_another_depth_says_which_depth_has_it():
    model = make_model()
    tokens = tokens_for(model, batch=1, pos=6)
    with pytest.raises(DepthMismatchError, match=r"k = 4 .*k >= 6"):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.12.hook_resid_pre", lambda a, hook: a)])
    with pytest.raises(DepthMismatchError, match="k >= 7"):
        model.run_with_hooks(tokens, fwd_hooks=[("loop.7.hook_state", lambda a, hook: a)])
    with pytest.raises(HookNameError, match="hook_dict"):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_nothing", lambda a, hook: a)])
    with model.iterations(6):  # where the name exists
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.12.hook_resid_pre", lambda a, hook: a)])


def test_a_patch_of_another_shape_fails_at_the_hook_with_both_shapes():
    model = make_model()
    short, long = tokens_for(model, batch=1, pos=6), tokens_for(model, batch=1, pos=9)
    _, long_cache = model.run_with_cache(long)
    name = model.hook_name(2, 0, "hook_resid_pre")

    def replace(activation, hook):
        return long_cache[hook.name]

    with pytest.raises(PatchShapeError, match=rf"{name}.*\(1, 9, 32\).*\(1, 6, 32\)"):
        model.run_with_hooks(short, fwd_hooks=[(name, replace)])

    def assign(activation, hook):
        activation[:] = long_cache[hook.name]

    with pytest.raises(PatchShapeError, match=rf"{name}.*\(1, 6, 32\)"):
        model.run_with_hooks(short, fwd_hooks=[(name, assign)])


def test_blocks_names_warn_once_and_hook_name_never(recwarn):
    model = make_model()
    _, cache = model.run_with_cache(tokens_for(model, batch=1, pos=6))
    names_module.reset_block_index_warning()
    cache[model.hook_name(2, 1, "hook_resid_post")]  # built from (t, layer): no warning
    assert not [w for w in recwarn if issubclass(w.category, BlockIndexWarning)]
    with pytest.warns(BlockIndexWarning, match=r"blocks\.3 is iteration 2's core layer 0"):
        cache["blocks.3.hook_resid_post"]
    cache["blocks.4.hook_resid_post"]  # once per process
    assert not [w for w in recwarn if issubclass(w.category, BlockIndexWarning)]
    assert model.hook_name(2, 0, "hook_resid_post") == "blocks.3.hook_resid_post"


def test_names_built_with_block_index_do_not_warn(recwarn):
    model = make_model()
    _, cache = model.run_with_cache(tokens_for(model, batch=1, pos=6))
    names_module.reset_block_index_warning()
    model.hook_name(2, 0, "hook_resid_post")  # the library's own call records nothing
    i = model.block_index(2, 1)  # iteration 2's core layer 1: blocks.4
    cache[f"blocks.{i}.hook_resid_post"]
    assert not [w for w in recwarn if issubclass(w.category, BlockIndexWarning)]
    with pytest.warns(BlockIndexWarning, match=r"blocks\.3 is iteration 2's core layer 0"):
        cache["blocks.3.hook_resid_post"]  # typed by hand: still warns


def test_an_nnsight_style_reference_to_another_views_blocks_is_refused():
    model = make_model()
    blocks = model.blocks  # what a wrapper built at r = 4 holds
    with model.iterations(6):
        with pytest.raises(DepthMismatchError, match=r"k = 4 view.*k = 6"):
            getattr(blocks, "12")
    assert getattr(blocks, "3") is model.blocks[3]  # back at r = 4: the same list again
