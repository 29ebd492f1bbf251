"""The logit-lens idioms of TransformerLens on `RecurrentActivationCache`, on every bundled model,
both fixtures and every norm type and placement: each stack the cache normalises at the final
norm, times ``W_U`` plus ``b_U``, is the model's logits (as on a TransformerLens model loaded
with ``fold_ln``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import data_path, make_model
from torch import Tensor

from dcp_lens import load
from dcp_lens.model.cache import RecurrentActivationCache
from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.zoo.bundled import BUNDLED

# float32 models (bundled, fixtures): a few ulps of logits of order 10; built models are float64.
ATOL = {torch.float32: 1e-4, torch.float64: 1e-9}

BUILT = {
    "LN-pre-own_pre_coda": dict(normalization_type="LN", pre_coda_norm="own"),
    "RMS-pre-own_iteration": dict(normalization_type="RMS", iteration_norm="own"),
    "LN-sandwich": dict(normalization_type="LN", norm_placement="sandwich"),
    "RMS-sandwich": dict(normalization_type="RMS", norm_placement="sandwich"),
    "LN-sandwich_residual-final_iteration": dict(
        normalization_type="LN", norm_placement="sandwich_residual", iteration_norm="final"
    ),
    "RMS-sandwich_residual": dict(normalization_type="RMS", norm_placement="sandwich_residual"),
    "LN-no_final_norm": dict(normalization_type="LN", final_norm=False, iteration_norm="own"),
    "LN-dense": dict(normalization_type="LN", n_core=0, n_prelude=3),
}
MODELS: dict[str, Callable[[], HookedRecurrentTransformer]] = {
    **{name: (lambda name=name: load(name)) for name in sorted(BUNDLED)},
    "huginn_tiny": lambda: load(f"huginn:{data_path('fixtures', 'huginn_tiny')}"),
    "ouro_tiny": lambda: load(f"ouro:{data_path('fixtures', 'ouro_tiny')}"),
    **{name: (lambda fields=fields: make_model(**fields)) for name, fields in BUILT.items()},
}


def run(name: str) -> tuple[HookedRecurrentTransformer, Tensor, Tensor, RecurrentActivationCache]:
    """(model, tokens [2, 9], logits [2, 9, d_vocab], cache) of one model."""
    model = MODELS[name]().eval()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, model.cfg.d_vocab, (2, 9), generator=generator)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
    return model, tokens, logits, cache


def close(actual: Tensor, expected: Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    error = (actual - expected).abs().max().item()
    tolerance = ATOL[expected.dtype]
    assert error <= tolerance, f"{what}: off the logits by {error:.3g} > {tolerance}"


def test_every_norm_type_and_bundled_model_is_covered() -> None:
    norms = {fields["normalization_type"] for fields in BUILT.values()}
    assert norms == {"LN", "RMS"}
    assert set(BUNDLED) <= set(MODELS) and len(BUNDLED) >= 3


@pytest.mark.parametrize("name", list(MODELS))
def test_logit_lens_idioms_give_the_logits(name: str) -> None:
    model, tokens, logits, cache = run(name)
    W_U, b_U = model.W_U, model.b_U
    with torch.no_grad():
        stack = cache.accumulated_resid(apply_ln=True)
        close(stack[-1] @ W_U + b_U, logits, "accumulated_resid(apply_ln=True)[-1] @ W_U + b_U")
        last = cache.accumulated_resid(apply_ln=True, pos_slice=-1)
        close(last[-1] @ W_U + b_U, logits[:, -1], "accumulated_resid(pos_slice=-1)")
        # An earlier entry is ln_final's readout of that block's input: the TransformerLens lens.
        layer = model.cfg.n_layers // 2
        early = model.ln_final(cache.accumulated_resid()[layer]) @ W_U  # its resid_pre
        close(stack[layer] @ W_U + b_U, early, f"accumulated_resid entry {layer}")

        parts = cache.decompose_resid()
        scaled = cache.apply_ln_to_stack(parts, layer=-1)
        close(scaled.sum(0) @ W_U + b_U, logits, "apply_ln_to_stack(decompose_resid())")
        applied = cache.decompose_resid(apply_ln=True)
        close(applied.sum(0) @ W_U + b_U, logits, "decompose_resid(apply_ln=True)")
        full = cache.get_full_resid_decomposition(apply_ln=True)
        close(full.sum(0) @ W_U + b_U, logits, "get_full_resid_decomposition(apply_ln=True)")

        attrs = cache.logit_attrs(parts, tokens)
        expected = logits.gather(-1, tokens[..., None])[..., 0]
        close(attrs.sum(0) + b_U[tokens], expected, "logit_attrs(decompose_resid()) + b_U")
        wrong = (tokens + 1) % model.cfg.d_vocab
        diff = cache.logit_attrs(parts, tokens, incorrect_tokens=wrong)
        gap = logits.gather(-1, wrong[..., None])[..., 0]
        close(diff.sum(0) + b_U[tokens] - b_U[wrong], expected - gap, "logit_attrs difference")


@pytest.mark.parametrize("name", ["default", "LN-pre-own_pre_coda"])
def test_the_lens_holds_on_a_layernorm_with_a_large_bias(name: str) -> None:
    """A bias counted twice (or dropped) moves every logit by ``ln_final.b @ W_U``."""
    model, _, _, _ = run(name)
    with torch.no_grad():
        model.ln_final.b.add_(1.0)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, model.cfg.d_vocab, (1, 6), generator=generator)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
        lens = cache.accumulated_resid(apply_ln=True)[-1] @ model.W_U + model.b_U
    assert model.b_U.abs().max() > 0.1
    close(lens, logits, "accumulated_resid(apply_ln=True)[-1] @ W_U + b_U")
