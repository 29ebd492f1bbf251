"""How dcp-lens talks to a tokenizer, whichever kind a model carries (`Llama2cTokenizer`,
`HFTokenizer`, a Hugging Face tokenizer): encode with or without BOS, the id that pads a batch, and
a fingerprint for caches. Model-free, so tasks and the model share it."""

from __future__ import annotations

import hashlib
from typing import Any


def encode_text(tokenizer: Any, text: str, bos: bool) -> list[int]:
    """Token ids of ``text`` by any tokenizer dcp-lens attaches, with BOS first iff ``bos``."""
    try:
        return list(tokenizer.encode(text, bos=bos))
    except TypeError:
        ids = list(tokenizer.encode(text))
        bos_id = getattr(tokenizer, "bos_token_id", None)
        return ([bos_id] + ids) if bos and bos_id is not None else ids


def padding_id(tokenizer: Any) -> int:
    """The id that right-pads a batch: the tokenizer's pad token, else its EOS, else 0 (padding
    is masked out and never scored, so any real id is safe)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of a tokenizer (its ``fingerprint()``, or a Hugging Face fast tokenizer's JSON)."""
    if hasattr(tokenizer, "fingerprint"):
        return str(tokenizer.fingerprint())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()
    raise ValueError(
        f"cannot fingerprint tokenizer {type(tokenizer).__name__} for the token-file cache; give "
        "it a fingerprint() method returning a hash of its vocabulary and rules."
    )
