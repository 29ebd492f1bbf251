"""Generation and padded batches as TransformerLens has them: prompts of different lengths each
continue exactly as alone (Huginn's prefix-keyed noise included), and the arguments TL users pass
are accepted or refused clearly (padded forwards: test_padding.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import data_path

from dcp_lens import load
from dcp_lens.model.generation import GenerationInputError
from dcp_lens.model.padding import PaddingError
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


def test_left_padding_without_its_mask_is_flagged_and_bad_arguments_refused(model):
    texts = _texts(model)
    with pytest.warns(PaddingWarning, match="attention_mask=mask"):
        tokens = model.to_tokens(texts, padding_side="left")
    padded, mask = model.to_tokens_with_mask(texts, padding_side="left")
    assert torch.equal(tokens, padded)  # the same batch; the mask is what forward needs
    with pytest.raises(GenerationInputError, match="'embeds' is not supported"):
        model.generate(texts, 2, return_type="embeds")
    with pytest.raises(GenerationInputError, match="padding_side"):
        model.generate(texts, 2, padding_side="middle")
    with pytest.raises(PaddingError, match="attention_mask goes with token input"):
        model.generate(texts, 2, attention_mask=mask)
