"""Patching results by iteration, and encode/decode modules spliced into the loop."""

from __future__ import annotations

import pytest
import torch
from helpers import make_model, tokens_for
from transformer_lens import patching

from dcp_lens.lenses.interop import splice_hooks, split_by_iteration
from dcp_lens.model.names import DepthMismatchError


def test_split_by_iteration_regroups_transformer_lens_patching():
    model = make_model(n_coda=2)
    clean = tokens_for(model, batch=1, pos=5)
    corrupted = clean.roll(1, dims=1)
    _, clean_cache = model.run_with_cache(clean)
    answer = int(clean[0, -1])

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[0, -1, answer]

    result = patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric)
    split = split_by_iteration(model, result)
    assert split.prelude.shape == (1, 5) and split.coda.shape == (2, 5)
    assert split.core.shape == (4, 2, 5)
    for t in (1, 3, 4):
        for layer in (0, 1):
            assert torch.equal(split.core[t - 1, layer], result[model.block_index(t, layer)])
    assert torch.equal(split.coda[1], result[-1])
    every = torch.stack([result, 2 * result, 3 * result])  # the [3, n_layers, pos] layout
    core = split_by_iteration(model, every, layer_dim=1).core
    assert core.shape == (4, 2, 3, 5) and torch.equal(core[:, :, 2], 3 * split.core)
    with pytest.raises(ValueError, match="model.iterations"):
        split_by_iteration(model, result[:-1])


def test_split_by_iteration_on_a_dense_model_makes_every_layer_an_iteration():
    model = make_model(n_core=0, n_prelude=3, n_coda=0)
    result = torch.arange(6.0).reshape(3, 2)
    split = split_by_iteration(model, result)
    assert split.core.shape == (3, 1, 2) and split.prelude.numel() == split.coda.numel() == 0


class LinearSAE(torch.nn.Module):
    """A toy encode/decode pair: a random linear code with a lossy ReLU."""

    def __init__(self, d_model: int, d_sae: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.W_enc = torch.nn.Parameter(torch.randn(d_model, d_sae, generator=generator).double())
        self.W_dec = torch.nn.Parameter(torch.linalg.pinv(self.W_enc.detach()))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.W_enc)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return z @ self.W_dec


def test_splice_an_sae_at_one_iteration_equals_a_hand_written_hook():
    model = make_model()
    tokens = tokens_for(model)
    sae = LinearSAE(model.cfg.d_model, 64)
    name = model.state_hook_name(2)

    def by_hand(state: torch.Tensor, hook: object) -> torch.Tensor:
        return sae.decode(sae.encode(state))

    expected = model.run_with_hooks(tokens, fwd_hooks=[(name, by_hand)])
    spliced = model.run_with_hooks(tokens, fwd_hooks=splice_hooks(model, sae, 2))
    assert torch.allclose(spliced, expected, atol=1e-10)
    assert (spliced - model(tokens)).abs().max() > 1e-3  # the ReLU code is lossy


def test_splice_at_every_iteration_records_latents_and_keeps_the_forward_with_the_error_term():
    model = make_model()
    tokens = tokens_for(model)
    sae = LinearSAE(model.cfg.d_model, 64)
    latents: dict[int, torch.Tensor] = {}
    fwd_hooks = splice_hooks(model, sae, use_error_term=True, record=latents)
    assert [name for name, _ in fwd_hooks] == [model.state_hook_name(t) for t in (1, 2, 3, 4)]
    logits = model.run_with_hooks(tokens, fwd_hooks=fwd_hooks)
    assert torch.allclose(logits, model(tokens), atol=1e-10)
    assert sorted(latents) == [1, 2, 3, 4] and latents[3].shape == (2, 12, 64)
    # Ablating a latent at iteration 4 (the readout's input) moves the state by its decoder row.
    _, cache = model.run_with_cache(tokens)

    def ablate(t: int, z: torch.Tensor) -> torch.Tensor:
        return z.index_fill(-1, torch.tensor([5]), 0.0) if t == 4 else z

    edited = splice_hooks(model, sae, 4, use_error_term=True, edit=ablate)
    moved_state = cache[model.state_hook_name(4)] - latents[4][..., 5:6] * sae.W_dec[5]
    assert torch.allclose(
        model.run_with_hooks(tokens, fwd_hooks=edited), model.readout(moved_state), atol=1e-10
    )


def test_splice_a_plain_callable_and_refuse_anything_else():
    model = make_model()
    tokens = tokens_for(model)
    halved = model.run_with_hooks(tokens, fwd_hooks=splice_hooks(model, lambda s: s / 2, [1, 3]))
    by_hand = [(model.state_hook_name(t), lambda s, hook: s / 2) for t in (1, 3)]
    assert torch.allclose(halved, model.run_with_hooks(tokens, fwd_hooks=by_hand), atol=1e-12)
    with pytest.raises(TypeError, match="encode/decode"):
        splice_hooks(model, object())


# ----------------------------------------------------------------------------- peers


def _huginn():
    from helpers import data_path

    from dcp_lens import load

    return load(f"huginn:{data_path('fixtures', 'huginn_tiny')}").eval()


def test_pyvene_interchange_and_zero_interventions_equal_hand_written_hooks():
    pv = pytest.importorskip("pyvene", reason="pyvene is not installed (pip install pyvene)")
    model = _huginn()
    generator = torch.Generator().manual_seed(0)
    base, source = torch.randint(0, model.cfg.d_vocab, (2, 1, 12), generator=generator)
    # pyvene's documented usage, unmodified: a component at a layer, dicts of input_ids.
    config = {"layer": 3, "component": "block_output", "intervention_type": pv.VanillaIntervention}
    patched = pv.IntervenableModel(config, model=model)
    _, out = patched({"input_ids": base}, [{"input_ids": source}], {"sources->base": 5})
    _, cache = model.run_with_cache(source)

    def swap(activation, hook):
        activation = activation.clone()
        activation[:, 5] = cache[hook.name][:, 5]
        return activation

    expected = model.run_with_hooks(base, fwd_hooks=[("blocks.3.hook_resid_post", swap)])
    assert (out - expected).abs().max() <= 1e-5
    assert (out - model(base)).abs().max() > 1e-3  # the intervention did something
    # Any module path works too: zero iteration 2's state at position 3.
    zero = {"component": "loop[2].hook_state.output", "intervention_type": pv.ZeroIntervention}
    _, out = pv.IntervenableModel(zero, model=model)(
        {"input_ids": base}, unit_locations={"base": 3}
    )

    def zero_at_3(activation, hook):
        return activation.index_fill(1, torch.tensor([3]), 0.0)

    expected = model.run_with_hooks(base, fwd_hooks=[("loop.2.hook_state", zero_at_3)])
    assert (out - expected).abs().max() <= 1e-5


def test_nnsight_inside_the_view_it_traces_equals_the_hooks_and_across_views_says_so():
    nnsight = pytest.importorskip(
        "nnsight", reason="nnsight is not installed (pip install nnsight)"
    )
    model = _huginn()
    tokens = torch.randint(
        0, model.cfg.d_vocab, (1, 12), generator=torch.Generator().manual_seed(1)
    )
    with model.iterations(6):
        wrapped = nnsight.NNsight(model)  # built inside the view it traces
        with wrapped.trace(tokens):
            block = wrapped.blocks[12].hook_resid_pre.output.save()  # in forward order
            state = wrapped.loop[6].hook_state.output.save()
        _, cache = model.run_with_cache(tokens)
        assert (state - cache["loop.6.hook_state"]).abs().max() <= 1e-5
        assert (block - cache[model.hook_name(6, 0, "hook_resid_pre")]).abs().max() <= 1e-5
    early = nnsight.NNsight(model)  # built at r = 4
    with model.iterations(6), pytest.raises(DepthMismatchError, match=r"k = 4 view.*k = 6"):
        with early.trace(tokens):
            early.loop[6].hook_state.output.save()
