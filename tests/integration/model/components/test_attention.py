"""The fused attention path (scaled-dot-product attention, taken when nothing reads the scores
or the pattern) against the materialised one, on every kind of model the library loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import make_model, tokens_for

import dcp_lens
from dcp_lens.model.components.attention import Attention, set_fused_attention

FIXTURES = Path(__file__).resolve().parents[4] / "demos" / "data" / "fixtures"
SPECS = [
    "default",
    "default-dense",
    "planted:readout_shift",
    "planted:distinct_computation",
    f"huginn:{FIXTURES / 'huginn_tiny'}",
    f"ouro:{FIXTURES / 'ouro_tiny'}",
    f"raven-retrofit:{FIXTURES / 'retrofit_llama_tiny'}",
    f"raven-retrofit:{FIXTURES / 'retrofit_olmo_tiny'}",
]


def _logits_both_ways(model, tokens) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        set_fused_attention(model, True)
        fused = model(tokens)
        set_fused_attention(model, False)
        materialised = model(tokens)
        set_fused_attention(model, True)
    return fused, materialised


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.split("/")[-1])
def test_fused_attention_gives_the_materialised_logits(spec: str) -> None:
    # The retrofit fixtures' random adapters amplify float32 rounding over their default 32
    # iterations (the paths differ by ~1e-4 there); 4 iterations compare the attention paths.
    overrides = {"n_iterations": 4} if spec.startswith("raven-retrofit:") else {}
    model = dcp_lens.load(spec, **overrides).float().eval()
    length = min(32, int(model.cfg.n_ctx))
    tokens = torch.randint(
        0, model.cfg.d_vocab, (3, length), generator=torch.Generator().manual_seed(1)
    )
    fused, materialised = _logits_both_ways(model, tokens)
    scale = float(materialised.abs().max())
    assert float((fused - materialised).abs().max()) <= 1e-5 * max(1.0, scale)


def test_fused_attention_in_float64_and_with_grouped_query_heads() -> None:
    model = make_model(n_key_value_heads=2)
    fused, materialised = _logits_both_ways(model, tokens_for(model, batch=3, pos=16))
    assert float((fused - materialised).abs().max()) <= 1e-10


def test_fused_attention_in_bfloat16_stays_within_its_rounding() -> None:
    model = make_model(dtype=torch.float32)
    tokens = tokens_for(model, batch=2, pos=16)
    with torch.no_grad():
        reference = model(tokens)
    model = model.to(torch.bfloat16)
    fused, materialised = _logits_both_ways(model, tokens)
    # Both paths round the same products to bfloat16: each is as far from float32 as the other.
    error_fused = float((fused.float() - reference).abs().max())
    error_materialised = float((materialised.float() - reference).abs().max())
    assert error_fused <= 2 * error_materialised + 1e-2


def test_a_hook_or_a_cache_on_the_pattern_still_sees_it() -> None:
    model = make_model()
    tokens = tokens_for(model, batch=2, pos=10)
    _, cache = model.run_with_cache(tokens)
    patterns = [name for name in cache.keys() if name.endswith("hook_pattern")]
    assert patterns, "run_with_cache returned no attention pattern"
    for name in patterns:
        rows = cache[name].sum(-1)
        assert torch.allclose(rows, torch.ones_like(rows))
    seen: list[str] = []
    model.run_with_hooks(
        tokens,
        fwd_hooks=[
            (lambda name: name.endswith("hook_attn_scores"), lambda t, hook: seen.append(hook.name))
        ],
    )
    assert len(seen) == len(patterns)


def test_generation_with_the_kv_cache_uses_the_fused_path_with_an_offset_mask() -> None:
    model = make_model(dtype=torch.float32)
    prompt = tokens_for(model, batch=1, pos=6)
    runs = []
    for fused in (True, False):
        set_fused_attention(model, fused)
        torch.manual_seed(0)
        runs.append(
            model.generate(
                prompt, max_new_tokens=8, do_sample=False, use_past_kv_cache=True, verbose=False
            )
        )
    set_fused_attention(model, True)
    assert torch.equal(runs[0], runs[1])
    assert all(module.fused for module in model.modules() if isinstance(module, Attention))


def test_nnsight_reads_the_attention_pattern_without_a_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nnsight = pytest.importorskip(
        "nnsight", reason="nnsight is not installed (pip install nnsight torch==2.13.0)"
    )
    from dcp_lens.model.components import attention

    model = make_model()
    tokens = tokens_for(model)
    _, cache = model.run_with_cache(tokens)
    layer = model.block_index(3, 1)
    wrapped = nnsight.NNsight(model)
    with wrapped.trace(tokens):
        scores = wrapped.blocks[0].attn.hook_attn_scores.output.save()  # in forward order
        pattern = wrapped.blocks[layer].attn.hook_pattern.output.save()
        logits = wrapped.output.save()
    # The cache runs the norms unfused (it records their scales): float64 rounding apart.
    assert (pattern - cache["pattern", layer]).abs().max() <= 1e-12
    masked = scores.isinf()
    assert torch.equal(masked, cache["attn_scores", 0].isinf())
    assert (scores - cache["attn_scores", 0])[~masked].abs().max() <= 1e-12
    assert (logits - model(tokens)).abs().max() <= 1e-10
    # Outside the trace the wrapped model takes the fused kernel again.
    calls = []
    fused = attention.F.scaled_dot_product_attention
    monkeypatch.setattr(
        attention.F,
        "scaled_dot_product_attention",
        lambda *a, **k: calls.append(1) or fused(*a, **k),
    )
    model(tokens)
    assert len(calls) == model.cfg.n_layers
