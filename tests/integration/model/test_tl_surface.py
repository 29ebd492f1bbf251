"""TransformerLens names beyond the hooks and the cache: ``unembed``, unrolled parameter names
(``SVDInterpreter``), weight processing, and the refusals of what a recurrent model does not
build, each naming the way out."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import data_path, make_model, tokens_for
from tl_names import is_static, surface_table, tl_public_names
from transformer_lens import SVDInterpreter, TransformerLensKeyValueCache, evals, head_detector
from transformer_lens import utilities as tl_utilities
from transformer_lens.FactoredMatrix import FactoredMatrix
from transformer_lens.tools import analysis

from dcp_lens import load
from dcp_lens.model.components.attention import KVCache
from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.utils.errors import DCPLensError, UnsupportedToolError

TABLE = surface_table(set())


def huginn() -> HookedRecurrentTransformer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load(f"huginn:{data_path('fixtures', 'huginn_tiny')}").eval()


def close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
    error = (actual.double() - expected.double()).abs().max().item()
    assert error <= atol, f"{what}: max abs difference {error:.3g} > {atol}"


def test_unembed_of_the_normalised_stream_is_the_logits() -> None:
    model = make_model()
    tokens = tokens_for(model)
    logits, cache = model.run_with_cache(tokens)
    close(model.unembed(cache.accumulated_resid(apply_ln=True)[-1]), logits, 1e-10, "unembed")
    with pytest.raises(UnsupportedToolError, match="d_model=32"):
        model.unembed(logits)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_tl_parameters_name_every_unrolled_block(kv_heads: int) -> None:
    model = make_model(n_key_value_heads=kv_heads)
    params = model.tl_parameters()
    group = model.cfg.n_heads // kv_heads
    for index, block in enumerate(model.blocks):
        W_V = params[f"blocks.{index}.attn.W_V"]
        assert W_V.shape == (model.cfg.n_heads, model.cfg.d_model, model.cfg.d_head)
        for head in range(model.cfg.n_heads):
            assert torch.equal(W_V[head], block.attn.W_V[head // group])
        assert params[f"blocks.{index}.attn.W_O"] is block.attn.W_O
    first, later = model.block_index(1, 1), model.block_index(4, 1)
    assert params[f"blocks.{first}.attn.W_Q"] is params[f"blocks.{later}.attn.W_Q"]
    assert params["unembed.W_U"] is model.W_U and "W_U_untied" not in params
    assert dict(model.tl_named_parameters()).keys() == params.keys()


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_svd_interpreter_reads_the_unrolled_blocks(kv_heads: int) -> None:
    model = make_model(n_key_value_heads=kv_heads)
    interpreter = SVDInterpreter(model)
    group = model.cfg.n_heads // kv_heads
    for iteration in (1, 3):
        index = model.block_index(iteration, 0)
        attn = model.blocks[index].attn
        ov = interpreter.get_singular_vectors("OV", layer_index=index, head_index=3, num_vectors=4)
        V = FactoredMatrix(attn.W_V[3 // group], attn.W_O[3]).V.T  # by hand, from the block
        close(ov, (model.W_U.T @ V[:4].T)[:, None], 1e-10, f"OV of block {index}")
        w_in = interpreter.get_singular_vectors("w_in", layer_index=index, num_vectors=4)
        block = model.blocks[index]
        _, _, Vh = torch.linalg.svd(block.mlp.W_in.T * block.ln2.w)
        close(w_in.abs(), (model.W_U.T @ Vh[:4].T)[:, None].abs(), 1e-8, f"w_in of {index}")


def test_refactor_keeps_the_circuits_and_balances_the_factors() -> None:
    model = make_model(qk_bias=True)
    tokens = tokens_for(model)
    logits = model(tokens)
    qk, ov = model.QK.AB.clone(), model.OV.AB.clone()
    model.refactor_factored_attn_matrices()
    close(model(tokens), logits, 1e-10, "logits")
    close(model.QK.AB, qk, 1e-10, "QK")
    close(model.OV.AB, ov, 1e-10, "OV")
    for attn in (model.blocks[0].attn, model.blocks[model.block_index(2, 1)].attn):
        # Balanced factors: W_Q_eff^T W_Q_eff = W_K_eff^T W_K_eff = diag(S) per head.
        W_Q = torch.cat([attn.W_Q, attn.b_Q[:, None]], dim=1)
        W_K = torch.cat([attn.W_K, attn.b_K[:, None]], dim=1)
        close(W_Q.mT @ W_Q, W_K.mT @ W_K, 1e-10, "balanced Q/K")
        close(attn.W_V.mT @ attn.W_V, attn.W_O @ attn.W_O.mT, 1e-10, "balanced V/O")
    with pytest.raises(UnsupportedToolError, match="no argument"):
        model.refactor_factored_attn_matrices(model.state_dict())


def test_refactor_is_refused_where_the_factors_are_not_a_product() -> None:
    with pytest.raises(UnsupportedToolError, match=r"rotary.*model\.QK\.make_even"):
        huginn().refactor_factored_attn_matrices()
    with pytest.raises(UnsupportedToolError, match="share 2 key/value heads"):
        make_model(n_key_value_heads=2).refactor_factored_attn_matrices()


def test_fold_value_biases_has_nothing_to_fold() -> None:
    model = make_model()
    tokens = tokens_for(model)
    logits = model(tokens)
    state = model.state_dict()
    assert model.fold_value_biases(state) is state and model.fold_value_biases() is None
    assert not any(name.endswith(("b_V", "b_O")) for name in state)
    close(model(tokens), logits, 0.0, "logits")


@pytest.mark.parametrize(
    ("method", "points_to"),
    [("set_use_attn_result", r"compute_head_results\(\)"), ("set_use_hook_mlp_in", "ln2")],
)
def test_unbuilt_hook_switches_refuse_with_the_way_out(method: str, points_to: str) -> None:
    model = make_model()
    getattr(model, method)(False)
    with pytest.raises(UnsupportedToolError, match=points_to):
        getattr(model, method)(True)


def test_a_transformer_lens_kv_cache_is_refused() -> None:
    model = make_model()
    tokens = tokens_for(model)
    tl_cache = TransformerLensKeyValueCache.init_cache(model.cfg, "cpu", 2)
    with pytest.raises(UnsupportedToolError, match=r"KVCache\(model\.cfg\.n_layers\)"):
        model(tokens, past_kv_cache=tl_cache)
    ours = KVCache(model.cfg.n_layers)
    first = model(tokens[:, :5], past_kv_cache=ours)
    second = model(tokens[:, 5:], past_kv_cache=ours)
    close(torch.cat([first, second], dim=1), model(tokens), 1e-10, "our KV cache")


@pytest.mark.parametrize("spec", ["default", "huginn"])
def test_transformer_lens_readout_tools_point_to_dcp_lens_lenses(spec: str) -> None:
    model = huginn() if spec == "huginn" else load("default").eval()
    tokens = tokens_for(model)
    with pytest.raises(UnsupportedToolError, match=r"dcp_lens\.lenses\.logit_lens"):
        analysis.logit_lens(model, tokens)
    with pytest.raises(UnsupportedToolError, match=r"model\.unembed"):
        analysis.logit_readout(model, model(tokens, stop_at_layer=-1))


@pytest.mark.parametrize("spec", ["default", "huginn"])
def test_direct_logit_attribution_adds_up_to_the_logit(spec: str) -> None:
    """TransformerLens's DLA runs on the cache's decompositions: components + b_U = logit."""
    model = huginn() if spec == "huginn" else load("default").eval()
    tokens = tokens_for(model)
    logits = model(tokens)
    for unit in ("component", "head"):
        result = analysis.direct_logit_attribution(
            model, tokens, answer_tokens=torch.tensor([3]), unit=unit
        )
        total = result.attribution.sum(0) + model.b_U[3]
        close(total.detach(), logits[:, -1, 3].detach(), 1e-4, f"DLA by {unit}")


# ----------------------------------------------------------------- the table, walked


def _row_names(kind: str, status: str | None = None) -> list[str]:
    return [
        name.rsplit(".", 1)[1]
        for name, (row, _) in TABLE.items()
        if name.rsplit(".", 1)[0] == kind and (status is None or row == status)
    ]


@pytest.mark.parametrize("spec", ["default", "huginn"])
def test_every_model_name_in_the_table_is_there_or_refused(spec: str) -> None:
    """Reading any TransformerLens name on the model gives a value or a DCPLensError, never an
    AttributeError, TypeError or KeyError; calling a refused one raises a DCPLensError."""
    model = huginn() if spec == "huginn" else load("default").eval()
    names = _row_names("model")
    assert len(names) >= 80, names
    for name in names:
        try:
            value = getattr(model, name)
        except DCPLensError:
            continue  # a property refused on this architecture (W_gate, b_V, W_pos, …)
        if name in _row_names("model", "refused"):
            assert callable(value), name
            with pytest.raises(UnsupportedToolError, match="Instead: "):
                value("gpt2") if is_static(f"model.{name}") else value()
    _, cache = model.run_with_cache(tokens_for(model))
    cache_names = [n.split(".", 1)[1] for n in tl_public_names() if n.startswith("Activation")]
    assert len(cache_names) >= 20
    for name in cache_names:
        assert callable(getattr(cache, name)), name


def test_the_refused_analysis_functions_refuse() -> None:
    model = make_model()
    tokens = tokens_for(model)
    for name in _row_names("tools.analysis", "refused"):
        function = getattr(analysis, name)
        with pytest.raises(DCPLensError):
            if "direct_path" in name:
                _, cache = model.run_with_cache(tokens)
                function(model, tokens, cache, cache, lambda logits: logits.sum(), 0, 0)
            elif name == "faithfulness":
                function(model, tokens[:1], tokens[1:], lambda logits: logits.sum(), [])
            elif name == "JacobianLens":  # a class: its fit takes the model
                function.fit(model, ["x"], corpus="local", show_progress=False)
            else:
                function(model, tokens)


def test_bridge_accessors_match_the_model() -> None:
    model = make_model(n_key_value_heads=2)
    n, heads = model.cfg.n_layers, model.cfg.n_heads
    assert model.W_E_pos.shape == (model.cfg.d_vocab + model.cfg.n_ctx, model.cfg.d_model)
    assert torch.equal(model.W_E_pos[model.cfg.d_vocab + 3], model.pos_embed.W_pos[3])
    assert model.all_head_labels == [f"L{i}H{h}" for i in range(n) for h in range(heads)]
    assert model.attn_head_labels == model.all_head_labels
    assert model.n_params_total == sum(p.numel() for p in set(model.parameters()))
    assert model.hook_aliases == {} and model.original_model is None
    for layers, matrix, view in (
        (*model.QK_for_attn_layers(), model.QK),
        (*model.OV_for_attn_layers(), model.OV),
    ):
        assert layers == list(range(n)) == model.composition_layer_indices()
        close(matrix.AB, view.AB, 0.0, "factored view")
    assert model.block_hooks(2) == [k for k in model.hook_dict if k.startswith("blocks.2.")]
    assert model.block_submodules(0) == ["ln1", "attn", "ln2", "mlp"]
    assert model.blocks_with("attn") == list(enumerate(model.blocks))
    assert model.blocks_with("no_such_part") == []
    assert model.get_hook_point("blocks.3.hook_resid_pre") is model.blocks[3].hook_resid_pre
    assert model.get_hook_point("no.such.hook") is None
    with pytest.raises(UnsupportedToolError, match=f"0..{n - 1}"):
        model.block_hooks(n)
    with pytest.raises(UnsupportedToolError, match="W_E_pos: .*rotary"):
        _ = huginn().W_E_pos


def test_loss_fn_init_weights_and_accumulated_bias() -> None:
    model = make_model()
    tokens = tokens_for(model)
    logits = model(tokens)
    close(model.loss_fn(logits, tokens), model(tokens, return_type="loss"), 1e-12, "loss_fn")
    per_token = model.loss_fn(logits, tokens, per_token=True)
    assert per_token.shape == (tokens.shape[0], tokens.shape[1] - 1)
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0  # left padding on row 0
    for per_token in (False, True):
        expected = tl_utilities.lm_cross_entropy_loss(logits, tokens, mask.bool(), per_token)
        actual = model.loss_fn(logits, tokens, attention_mask=mask, per_token=per_token)
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)
    masked = model(tokens, return_type="loss", attention_mask=mask)
    close(model.loss_fn(model(tokens, attention_mask=mask), tokens, mask), masked, 1e-12, "mask")
    fresh = make_model(dtype=torch.float32)
    other = make_model(dtype=torch.float32, seed=fresh.cfg.seed)
    with torch.no_grad():
        other.embed.W_E.add_(1.0)
    fresh.init_weights()
    other.init_weights()
    close(fresh.embed.W_E, other.embed.W_E, 0.0, "init_weights from cfg.seed")
    expected = sum(model.blocks[i].mlp.b_out for i in range(3))
    close(model.accumulated_bias(3), expected, 1e-12, "accumulated_bias")


def test_get_token_position_finds_the_token() -> None:
    model = load("default")
    tokens = model.to_tokens(model.to_string(torch.tensor([5, 9, 7, 9])), prepend_bos=False)
    assert model.get_token_position(9, tokens) == 1
    assert model.get_token_position(9, tokens, mode="last") == 3


def test_detect_head_reads_every_unrolled_pattern() -> None:
    model = load("default").eval()
    text = model.to_string(torch.tensor([5, 9, 7, 9, 11, 5, 9, 8]))
    scores = head_detector.detect_head(model, text, "previous_token_head")
    tokens = model.to_tokens(text)
    _, cache = model.run_with_cache(tokens)
    pattern = head_detector.get_previous_token_head_detection_pattern(tokens.cpu())
    assert scores.shape == (model.cfg.n_layers, model.cfg.n_heads)
    for layer in (0, model.block_index(2, 0), model.cfg.n_layers - 1):
        for head in range(model.cfg.n_heads):
            expected = head_detector.compute_head_attention_similarity_score(
                cache["pattern", layer][0, head],
                pattern,
                exclude_bos=False,
                exclude_current_token=False,
                error_measure="mul",
            )
            assert abs(float(scores[layer, head]) - expected) <= 1e-6


def test_induction_loss_is_the_loss_on_the_repeated_half() -> None:
    model = make_model(d_vocab=20_000)  # TransformerLens draws ids in 100..20000
    torch.manual_seed(0)
    loss = evals.induction_loss(model, batch_size=2, subseq_len=8, prepend_bos=False, device="cpu")
    torch.manual_seed(0)
    half = torch.randint(100, 20000, (2, 8))
    tokens = torch.cat([half, half], dim=1)
    per_token = model(tokens, return_type="loss", loss_per_token=True)
    close(torch.as_tensor(loss), per_token[:, 9:].mean(), 1e-10, "induction loss")


def test_device_utilities_and_evaluate_on_dataset() -> None:
    model = make_model(dtype=torch.float32)
    assert str(tl_utilities.get_device_for_block_index(3, model.cfg)) == "cpu"
    moved = tl_utilities.move_to_and_update_config(model, torch.float64, print_details=False)
    assert moved.cfg.dtype == torch.float64 and moved.W_E.dtype == torch.float64
    tokens = tokens_for(moved)
    close(moved(tokens), make_model()(tokens), 1e-5, "moved to float64")
    batches = [{"tokens": tokens}, {"tokens": tokens.flip(1)}]
    loss = evals.evaluate_on_dataset(moved, batches, device="cpu")
    expected = sum(float(moved(b["tokens"], return_type="loss")) for b in batches) / 2
    assert abs(loss - expected) <= 1e-12
