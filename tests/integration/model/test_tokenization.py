"""The tokenizers dcp-lens attaches offer what TransformerLens's utilities read: special tokens as
strings, a Hugging Face call; `tokenize_and_concatenate` runs on them and rebuilds the text."""

from __future__ import annotations

import pytest
import torch
from helpers import data_path
from transformer_lens.utilities import tokenize_and_concatenate

from dcp_lens import load
from dcp_lens.model.tokenization import VocabularyTokenizer

datasets = pytest.importorskip("datasets")

DOCUMENTS = ["Once upon a time there was a cat.", "The cat sat.", "It was happy, and it slept."]


@pytest.fixture(scope="module", params=["huginn", "llama2c"])
def model(request):
    if request.param == "huginn":
        return load(f"huginn:{data_path('fixtures', 'huginn_tiny')}")
    return load(f"llama2c:{data_path('stories260K')}")


def test_tokenize_and_concatenate_joins_documents_with_eos(model) -> None:
    tokenizer = model.tokenizer
    if tokenizer.eos_token is None:
        pytest.skip("this fixture's tokenizer has no EOS token, which TransformerLens requires")
    dataset = datasets.Dataset.from_dict({"text": DOCUMENTS})
    rows = tokenize_and_concatenate(dataset, tokenizer, max_length=8, num_proc=None)[:]["tokens"]
    assert rows.shape[1] == 8 and bool((rows[:, 0] == tokenizer.bos_token_id).all())
    # The reference: each document's ids without BOS, EOS between documents, cut into rows of 7.
    ids = []
    for i, text in enumerate(DOCUMENTS):
        ids += model.to_tokens(text, prepend_bos=False)[0].tolist()
        ids += [tokenizer.eos_token_id] if i < len(DOCUMENTS) - 1 else []
    expected = torch.tensor(ids[: 7 * (len(ids) // 7)]).reshape(-1, 7)
    assert torch.equal(rows[:, 1:], expected)


def test_the_call_and_special_tokens_match_to_tokens(model) -> None:
    tokenizer = model.tokenizer
    texts = ["Once", "Once upon a time"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    tokens, mask = model.to_tokens_with_mask(texts)
    assert torch.equal(batch["input_ids"], tokens)
    assert torch.equal(batch["attention_mask"].bool(), mask)
    single = tokenizer("Once", add_special_tokens=False)
    assert single["input_ids"] == model.to_tokens("Once", prepend_bos=False)[0].tolist()
    assert tokenizer.pad_token is not None
    assert tokenizer.decode([model.tokenizer.pad_token_id]) or tokenizer.pad_token
    with pytest.raises(ValueError, match="padding=True"):
        tokenizer(texts, return_tensors="pt")
    with pytest.raises(ValueError, match="vocabulary is the checkpoint's"):
        tokenizer.add_special_tokens({"pad_token": "<PAD>"})


def test_a_vocabulary_tokenizer_names_its_tokens() -> None:
    tokenizer = VocabularyTokenizer(["<0>", "<1>", "<2>"])
    assert tokenizer.pad_token == "<0>" and tokenizer.eos_token is None
    assert tokenizer("<1><2>") == {"input_ids": [1, 2], "attention_mask": [1, 1]}
