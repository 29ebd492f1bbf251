"""How dcp-lens talks to a tokenizer, whichever kind a model carries (`Llama2cTokenizer`,
`HFTokenizer`, a Hugging Face tokenizer): encode with or without BOS, the id that pads a batch, and
a fingerprint for caches. Model-free, so tasks and the model share it."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from dcp_lens.utils.errors import UnsupportedToolError


@runtime_checkable
class Encoder(Protocol):
    """Anything that turns text into token ids: ``encode(text)``, or ``encode(text, bos=...)``."""

    @property
    def encode(self) -> Callable[..., Sequence[int]]: ...


@runtime_checkable
class Tokenizer(Encoder, Protocol):
    """What a model's tokenizer offers dcp-lens: text to ids and ids back to text. Optional
    extras are read where used: ``bos_token_id``, ``pad_token_id``, ``eos_token_id``,
    ``id_to_piece``, ``fingerprint``."""

    def decode(self, ids: list[int]) -> str: ...


def encode_text(tokenizer: Encoder, text: str, bos: bool) -> list[int]:
    """Token ids of ``text`` by any tokenizer dcp-lens attaches, with BOS first iff ``bos``."""
    try:
        return list(tokenizer.encode(text, bos=bos))
    except TypeError:
        ids = list(tokenizer.encode(text))
        bos_id = getattr(tokenizer, "bos_token_id", None)
        return ([bos_id] + ids) if bos and bos_id is not None else ids


def padding_id(tokenizer: object) -> int:
    """The id that right-pads a batch: the tokenizer's pad token, else its EOS, else 0 (padding
    is masked out and never scored, so any real id is safe)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def tokenizer_fingerprint(tokenizer: object) -> str:
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


def hf_encode_keywords(encode: Callable[..., list[int]]) -> Callable[..., Any]:
    """Let a tokenizer's ``encode(text, bos=...)`` also take Hugging Face's keywords, as
    TransformerLens's evals call it: ``add_special_tokens`` (BOS first iff True and the tokenizer
    prepends BOS by default; True when only ``return_tensors`` is given, as in Hugging Face) and
    ``return_tensors="pt"`` (ids as a [1, pos] tensor). Without them, ``encode`` is unchanged."""

    @functools.wraps(encode)
    def wrapped(
        self: object,
        text: str,
        *args: object,
        add_special_tokens: bool | None = None,
        return_tensors: str | None = None,
        **kwargs: object,
    ) -> Any:
        if add_special_tokens is None and return_tensors is not None:
            add_special_tokens = True
        if add_special_tokens is not None:
            kwargs["bos"] = add_special_tokens and bool(getattr(self, "prepends_bos", False))
        ids = encode(self, text, *args, **kwargs)
        if return_tensors is None:
            return ids
        if return_tensors == "pt":
            import torch

            return torch.tensor([ids], dtype=torch.long)
        raise ValueError(f"return_tensors={return_tensors!r}: use None or 'pt'.")

    return wrapped


class TransformerLensTokenizer:
    """What TransformerLens's utilities read from a Hugging Face tokenizer, for the tokenizers
    dcp-lens attaches (a mixin): the special tokens as strings (``bos_token``, ``eos_token``,
    ``pad_token``; ``pad_token`` is the token batches are padded with, `padding_id`), and a call
    ``tokenizer(text_or_texts, add_special_tokens=..., padding=..., return_tensors=...)``
    returning ``{"input_ids": ..., "attention_mask": ...}``. So
    ``transformer_lens.utilities.tokenize_and_concatenate(dataset, model.tokenizer, ...)``
    works on a tokenizer with an EOS token. Special tokens cannot be added: the vocabulary is the
    checkpoint's."""

    padding_side = "right"

    @property
    def bos_token(self) -> str | None:
        return self._token_string(getattr(self, "bos_token_id", None))

    @property
    def eos_token(self) -> str | None:
        return self._token_string(getattr(self, "eos_token_id", None))

    @property
    def pad_token(self) -> str | None:
        has_pad = any(
            isinstance(getattr(self, name, None), int) for name in ("pad_token_id", "eos_token_id")
        )
        return self._token_string(padding_id(self)) if has_pad else None

    def __call__(
        self,
        text: str | Sequence[str],
        add_special_tokens: bool = True,
        padding: bool | str = False,
        return_tensors: str | None = None,
        truncation: bool = False,
        max_length: int | None = None,
    ) -> dict[str, object]:
        """Token ids as a Hugging Face tokenizer returns them: ``input_ids`` (a list for one
        text, a list of lists for several; ``"pt"`` or ``"np"`` arrays with ``return_tensors``,
        which needs rows of one length or ``padding=True``) and ``attention_mask``.
        ``add_special_tokens``: BOS first where this tokenizer prepends it by default."""
        texts = [text] if isinstance(text, str) else list(text)
        bos = add_special_tokens and bool(getattr(self, "prepends_bos", False))
        rows = [encode_text(self, item, bos) for item in texts]  # type: ignore[arg-type]
        if truncation and max_length is not None:
            rows = [row[:max_length] for row in rows]
        masks = [[1] * len(row) for row in rows]
        if padding and padding != "do_not_pad":
            width = max((len(row) for row in rows), default=0)
            pad, left = padding_id(self), self.padding_side == "left"
            rows = [
                [pad] * (width - len(r)) + r if left else r + [pad] * (width - len(r)) for r in rows
            ]
            masks = [
                [0] * (width - len(m)) + m if left else m + [0] * (width - len(m)) for m in masks
            ]
        if return_tensors is None:
            ids: object = rows[0] if isinstance(text, str) else rows
            mask: object = masks[0] if isinstance(text, str) else masks
            return {"input_ids": ids, "attention_mask": mask}
        if len({len(row) for row in rows}) > 1:
            raise ValueError("rows of different lengths cannot form one tensor; pass padding=True.")
        if return_tensors == "pt":
            import torch

            return {"input_ids": torch.tensor(rows), "attention_mask": torch.tensor(masks)}
        if return_tensors == "np":
            import numpy as np

            return {"input_ids": np.array(rows), "attention_mask": np.array(masks)}
        raise ValueError(f"return_tensors={return_tensors!r}: use None, 'pt' or 'np'.")

    @property
    def init_kwargs(self) -> dict[str, object]:
        """What TransformerLens's ``get_tokenizer_with_bos`` reads to rebuild a tokenizer that
        prepends BOS: this one already does (it is returned as is), or has no BOS token."""
        prepends = bool(getattr(self, "prepends_bos", False))
        if not prepends and self.bos_token is not None:
            raise UnsupportedToolError(
                f"this tokenizer has a BOS token ({self.bos_token!r}) but does not prepend it by "
                "default, and cannot be rebuilt from the Hugging Face Hub; prepend it per call: "
                "model.to_tokens(text, prepend_bos=True)."
            )
        return {"name_or_path": type(self).__name__, "add_bos_token": prepends}

    def add_special_tokens(self, tokens: object) -> int:
        """Refused: the vocabulary is the checkpoint's, and a new token would have no
        embedding."""
        raise ValueError(
            f"cannot add special tokens {tokens!r}: a dcp-lens tokenizer's vocabulary is the "
            "checkpoint's (a new token has no embedding). Pad with the existing pad_token "
            f"({self.pad_token!r}; None where the tokenizer has neither a pad nor an EOS token: "
            "right-pad token ids yourself with model.to_tokens)."
        )

    def _token_string(self, token: object) -> str | None:
        if not isinstance(token, int):
            return None
        piece = getattr(self, "id_to_piece", None)
        if piece is not None:
            return str(piece(token))
        return str(self.decode([token]))  # type: ignore[attr-defined]


class VocabularyTokenizer(TransformerLensTokenizer):
    """A tokenizer for a model whose vocabulary is a list of symbols (a task's own vocabulary,
    or a planted model's ``<0>``, ``<1>``, …): token id i is ``symbols[i]``.

    ``encode`` matches the longest symbol at each place and skips whitespace no symbol starts
    with; ``decode`` joins the symbols (with ``separator``). No BOS, EOS or pad token: a batch is
    right-padded with id 0 and masked (`padding_id`).
    """

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __init__(self, symbols: list[str], separator: str = "") -> None:
        if not symbols or len(set(symbols)) != len(symbols) or "" in symbols:
            raise ValueError(
                "symbols must be a non-empty list of distinct, non-empty strings; got "
                f"{len(symbols)} symbols with {len(symbols) - len(set(symbols))} repeated."
            )
        self.symbols = list(symbols)
        self.separator = separator
        self._ids = {symbol: i for i, symbol in enumerate(self.symbols)}
        self._longest = max(len(symbol) for symbol in self.symbols)
        self.pad_token_id = 0

    def __len__(self) -> int:
        return len(self.symbols)

    @hf_encode_keywords
    def encode(self, text: str, bos: bool = False) -> list[int]:
        """Token ids of ``text`` (``bos`` is accepted and ignored: there is no BOS token)."""
        ids: list[int] = []
        at = 0
        while at < len(text):
            for width in range(min(self._longest, len(text) - at), 0, -1):
                found = self._ids.get(text[at : at + width])
                if found is not None:
                    ids.append(found)
                    at += width
                    break
            else:
                if text[at].isspace():
                    at += 1
                    continue
                raise ValueError(
                    f"{text[at : at + 10]!r} (at character {at}) starts with no symbol of this "
                    f"vocabulary ({len(self.symbols)} symbols, e.g. {self.symbols[:8]})."
                )
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The symbols of ``ids`` joined by the separator."""
        return self.separator.join(self.symbols[int(i)] for i in ids)

    def id_to_piece(self, token: int) -> str:
        return self.symbols[int(token)]

    def fingerprint(self) -> str:
        return hashlib.sha256("\x00".join(self.symbols).encode("utf-8")).hexdigest()

    def __repr__(self) -> str:
        return f"VocabularyTokenizer({len(self.symbols)} symbols, e.g. {self.symbols[:5]})"
