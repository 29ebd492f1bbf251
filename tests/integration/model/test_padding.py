"""Padded batches in one masked pass (`dcp_lens.model.padding`): every row of a padded batch reads
as its prompt run alone, in the logits, in every cached activation at real positions (Huginn's
prefix-keyed noise included), through a KV cache, and in generation, on the bundled default
model (learned positions), the Huginn fixture (interleaved rotary, noise) and the Ouro fixture
(rotate-half rotary, sandwich norms)."""

from __future__ import annotations

import pytest
import torch
from helpers import data_path

from dcp_lens import load
from dcp_lens.model.components.attention import KVCache
from dcp_lens.model.padding import PaddingError
from dcp_lens.utils.errors import InputError

# float32 models: the masked pass and the lone prompt sum in different orders.
ATOL = 1e-5


@pytest.fixture(scope="module", params=["default", "huginn", "ouro"])
def model(request):
    if request.param == "default":
        return load("default").eval()
    return load(f"{request.param}:{data_path('fixtures', f'{request.param}_tiny')}").eval()


def _texts(model) -> list[str]:
    """Three prompts of different lengths in the model's vocabulary."""
    if hasattr(model.tokenizer, "symbols"):  # a task vocabulary
        symbols = model.tokenizer.symbols
        return ["".join(symbols[1:3]), "".join(symbols[1:8]), "".join(symbols[2:6])]
    return ["To be", "or not to be, that is", "Whether 'tis nobler"]


def _real(activation: torch.Tensor, name: str, real: torch.Tensor) -> torch.Tensor:
    """One row's activation at its real positions (queries and keys for a pattern)."""
    if name.endswith(("hook_pattern", "hook_attn_scores")):  # [head, query, key]
        return activation[:, real][:, :, real]
    return activation[real]


@pytest.mark.parametrize("side", ["left", "right"])
def test_each_row_of_a_padded_batch_is_its_prompt_alone(model, side):
    texts = _texts(model)
    tokens, mask = model.to_tokens_with_mask(texts, padding_side=side)
    assert not bool(mask.all())  # the test needs padding
    fused = model(tokens, attention_mask=mask)  # no hook: the fused attention kernel
    logits, cache = model.run_with_cache(tokens, attention_mask=mask)  # patterns materialised
    for row, text in enumerate(texts):
        real = mask[row]
        alone_logits, alone = model.run_with_cache(model.to_tokens(text))
        torch.testing.assert_close(fused[row, real], alone_logits[0], rtol=0, atol=ATOL)
        torch.testing.assert_close(logits[row, real], alone_logits[0], rtol=0, atol=ATOL)
        assert not fused[row, ~real].any()  # zero at the pads
        for name in alone:
            actual = _real(cache[name][row], name, real)
            torch.testing.assert_close(actual, alone[name][0], rtol=0, atol=ATOL, msg=name)
    if model.cfg.state_init == "huginn":  # the noisy s_0 was among the activations compared
        assert "loop.0.hook_state" in alone


def test_the_loss_counts_real_tokens_only(model):
    texts = _texts(model)
    tokens, mask = model.to_tokens_with_mask(texts, padding_side="left")
    losses = model(tokens, return_type="loss", loss_per_token=True, attention_mask=mask)
    scored = mask[:, 1:] & mask[:, :-1]
    for row, text in enumerate(texts):
        expected = model(model.to_tokens(text), return_type="loss", loss_per_token=True)[0]
        torch.testing.assert_close(losses[row, scored[row]], expected, rtol=0, atol=ATOL)
    assert not losses[~scored].any()
    mean = model(tokens, return_type="loss", attention_mask=mask)
    torch.testing.assert_close(mean, losses[scored].mean(), rtol=0, atol=1e-6)
    # Text in: forward pads and masks it itself.
    logits, loss = model(texts, return_type="both")
    right, right_mask = model.to_tokens_with_mask(texts)
    torch.testing.assert_close(logits, model(right, attention_mask=right_mask), rtol=0, atol=0)
    torch.testing.assert_close(loss, model(right, "loss", attention_mask=right_mask))


def test_a_masked_token_inside_a_row_is_left_out(model):
    """Any mask, not only padding at an end: the row reads as its real tokens alone."""
    tokens = model.to_tokens(_texts(model)[1])
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[0, 2] = False
    logits = model(tokens, attention_mask=mask)
    alone = model(tokens[:, mask[0]])
    torch.testing.assert_close(logits[0, mask[0]], alone[0], rtol=0, atol=ATOL)


def test_a_kv_cache_continues_each_row_where_it_stopped(model):
    texts = _texts(model)
    tokens, mask = model.to_tokens_with_mask(texts, padding_side="left")
    extra = torch.tensor([[3, 4, 5]] * len(texts))
    extra_mask = torch.cat((mask, torch.ones_like(extra, dtype=torch.bool)), dim=1)
    full = model(torch.cat((tokens, extra), dim=1), attention_mask=extra_mask)
    cache = KVCache(model.cfg.n_layers)
    first = model(tokens, attention_mask=mask, past_kv_cache=cache)
    assert torch.equal(cache.attention_mask, mask)
    second = model(extra[:, :1], past_kv_cache=cache)  # no mask: the new tokens are real
    third = model(extra[:, 1:], past_kv_cache=cache)
    chunks = torch.cat((first, second, third), dim=1)
    torch.testing.assert_close(chunks, full, rtol=0, atol=ATOL)
    for row, text in enumerate(texts):
        alone = model(torch.cat((model.to_tokens(text), extra[:1]), dim=1))[0]
        torch.testing.assert_close(chunks[row, -3:], alone[-3:], rtol=0, atol=ATOL)


def test_generate_on_short_and_long_prompts_equals_each_alone(model):
    short, long = _texts(model)[0], _texts(model)[1]
    for use_past_kv_cache in (True, False):
        batch = model.generate([short, long], 6, use_past_kv_cache=use_past_kv_cache)
        kwargs = {"use_past_kv_cache": use_past_kv_cache}
        assert batch == [model.generate(text, 6, **kwargs) for text in (short, long)]
    tokens, mask = model.to_tokens_with_mask([short, long], padding_side="left")
    continued = model.generate(tokens, 6, attention_mask=mask)
    for row, text in enumerate((short, long)):
        alone_tokens = model.generate(model.to_tokens(text), 6)[0]
        assert torch.equal(continued[row, -len(alone_tokens) :], alone_tokens)


def test_bad_masks_and_arguments_are_refused(model):
    tokens, mask = model.to_tokens_with_mask(_texts(model), padding_side="left")
    with pytest.raises(PaddingError, match="shape"):
        model(tokens, attention_mask=mask[:, 1:])
    with pytest.raises(PaddingError, match="0 / 1"):
        model(tokens, attention_mask=mask.long() * 2)
    empty = mask.clone()
    empty[0] = False
    with pytest.raises(PaddingError, match=r"rows \[0\] of attention_mask have no real token"):
        model(tokens, attention_mask=empty)
    stream = model(tokens, stop_at_layer=1, attention_mask=mask)
    with pytest.raises(InputError, match="attention_mask applies to a forward from tokens"):
        model(stream, start_at_layer=1, attention_mask=mask)
    assert torch.equal(model(tokens, attention_mask=torch.ones_like(mask)), model(tokens))
