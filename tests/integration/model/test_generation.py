"""Generation and padded batches as TransformerLens has them: prompts of different lengths each
continue exactly as alone (Huginn's prefix-keyed noise included), a padded forward reads each row
as that prompt by itself, and the arguments TL users pass are accepted or refused clearly."""

from __future__ import annotations

import pytest
import torch
from helpers import data_path

from dcp_lens import load
from dcp_lens.model.generation import GenerationInputError, PaddingError
from dcp_lens.model.text import PaddingWarning
from dcp_lens.model.tokenization import padding_id

PROMPTS = ["To be", "or not to be, that is", "Whether 'tis nobler"]


@pytest.fixture(scope="module", params=["huginn", "default"])
def model(request):
    """The Huginn fixture (noise on: s_0 keyed on the prefix) and the bundled default model."""
    if request.param == "huginn":
        loaded = load(f"huginn:{data_path('fixtures', 'huginn_tiny')}").eval()
        assert loaded.cfg.state_init == "huginn"
        return loaded
    return load("default").eval()


def _alone(model, text: str, new: int, **kwargs) -> torch.Tensor:
    return model.generate(model.to_tokens(text), new, **kwargs)[0]


def _texts(model) -> list[str]:
    if model.tokenizer is not None and hasattr(model.tokenizer, "symbols"):  # a task vocabulary
        symbols = model.tokenizer.symbols
        return ["".join(symbols[1:3]), "".join(symbols[1:8]), "".join(symbols[2:6])]
    return PROMPTS


@pytest.mark.parametrize("use_past_kv_cache", [True, False])
def test_each_prompt_of_a_batch_generates_what_it_generates_alone(model, use_past_kv_cache):
    texts = _texts(model)
    batch = model.generate(texts, 5, return_type="tokens", use_past_kv_cache=use_past_kv_cache)
    lengths = [model.to_tokens(text).shape[1] for text in texts]
    assert len(set(lengths)) > 1  # the test needs prompts of different lengths
    width = max(lengths) + 5
    pad = padding_id(model.tokenizer)
    assert batch.shape == (len(texts), width)
    for row, text in zip(batch, texts, strict=True):
        alone = _alone(model, text, 5, use_past_kv_cache=use_past_kv_cache)
        assert torch.equal(row[width - len(alone) :], alone)  # left-padded, as TL pads
        assert (row[: width - len(alone)] == pad).all()
    strings = model.generate(texts, 5)  # a list in, a list of strings out
    assert strings == [model.to_string(_alone(model, text, 5)) for text in texts]
    right = model.generate(texts, 5, return_type="tokens", padding_side="right")
    for row, text in zip(right, texts, strict=True):
        alone = _alone(model, text, 5)
        assert torch.equal(row[: len(alone)], alone)


def test_a_padded_forward_reads_each_row_as_the_prompt_alone(model):
    texts = _texts(model)
    for side in ("left", "right"):
        tokens, mask = model.to_tokens_with_mask(texts, padding_side=side)
        assert not bool(mask.all())
        logits = model(tokens, attention_mask=mask)
        losses = model(tokens, return_type="loss", loss_per_token=True, attention_mask=mask)
        for row, text in enumerate(texts):
            alone = model.to_tokens(text)
            real = mask[row]
            torch.testing.assert_close(logits[row, real], model(alone)[0], rtol=0, atol=1e-5)
            expected = model(alone, return_type="loss", loss_per_token=True)[0]
            positions = real[1:] & real[:-1]
            torch.testing.assert_close(losses[row, positions], expected, rtol=0, atol=1e-5)
        mean = model(tokens, return_type="loss", attention_mask=mask)
        torch.testing.assert_close(mean, losses[mask[:, 1:] & mask[:, :-1]].mean())


def test_left_padding_without_its_mask_is_flagged_and_bad_arguments_refused(model):
    texts = _texts(model)
    with pytest.warns(PaddingWarning, match="attention_mask=mask"):
        tokens = model.to_tokens(texts, padding_side="left")
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[0, 2] = False
    mask[0, 0] = True
    with pytest.raises(PaddingError, match="a pad between real tokens"):
        model(tokens, attention_mask=mask)
    with pytest.raises(PaddingError, match="shape"):
        model(tokens, attention_mask=mask[:, 1:])
    with pytest.raises(GenerationInputError, match="'embeds' is not supported"):
        model.generate(texts, 2, return_type="embeds")
    with pytest.raises(GenerationInputError, match="padding_side"):
        model.generate(texts, 2, padding_side="middle")
    assert torch.equal(model(tokens, attention_mask=torch.ones_like(mask)), model(tokens))
    padded, real = model.to_tokens_with_mask(texts, padding_side="left")
    # Row by row, a cache would keep only the last row: refused, with the way out.
    with pytest.raises(PaddingError, match="each prompt alone"):
        model.run_with_cache(padded, attention_mask=real)
    with pytest.raises(PaddingError, match="hooks"):
        model.run_with_hooks(
            padded, attention_mask=real, fwd_hooks=[("hook_embed", lambda a, hook: a)]
        )
