"""`HFTokenizer`: a checkpoint's own Hugging Face tokenizer, read from its local files.

A Hugging Face checkpoint folder ships ``tokenizer.json`` (the `tokenizers` library's format: the
vocabulary, merges, pre-tokenizer, decoder) and ``tokenizer_config.json`` (the special tokens and
whether a BOS token is added). `load_checkpoint_tokenizer` reads both with the `tokenizers` library
alone (no network, no code from the checkpoint). The vocabulary size and the special tokens come
from the files; none is assumed.

The wrapper has the surface `HookedRecurrentTransformer` and the text task use (as
`Llama2cTokenizer`): ``encode(text, bos=...)``, ``decode(ids)``, ``bos_token_id``,
``eos_token_id``, ``pad_token_id``, ``vocab_size``, ``fingerprint()``, and an HF-style call that
pads a batch with the pad id and returns the attention mask.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import tokenizers
from jaxtyping import Int
from torch import Tensor

from dcp_lens.model.tokenization import TransformerLensTokenizer, hf_encode_keywords, padding_id
from dcp_lens.utils.checks import read_json_object
from dcp_lens.utils.errors import (
    ConfigError,
    ConfigTypeError,
    DamagedFileError,
    InputError,
    MissingFileError,
)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class HFTokenizer(TransformerLensTokenizer):
    """A `tokenizers.Tokenizer` with the special tokens of its ``tokenizer_config.json``.

    Args:
        tokenizer: the loaded `tokenizers.Tokenizer`.
        bos_token, eos_token, pad_token: the special tokens' strings (None: the tokenizer has none).
        add_bos_token: whether the checkpoint prepends BOS by default (``prepends_bos``).
        source: where it was read from, for messages.

    Special tokens are added by ``encode`` itself (``bos``), never by the file's post-processor,
    so ``prepend_bos`` means the same for every checkpoint.
    """

    padding_side = "right"  # model.to_tokens right-pads (TransformerLens reads this)

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool | None = None,
        source: str = "tokenizer",
    ) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.bos_token_id = self._special_id(bos_token, "bos_token")
        self.eos_token_id = self._special_id(eos_token, "eos_token")
        self.pad_token_id = self._special_id(pad_token, "pad_token")
        if self.pad_token_id is None:  # the id to_tokens pads with, so TL's masks find it
            self.pad_token_id = padding_id(self)
        # A checkpoint with a BOS token prepends it unless its config says otherwise.
        wants_bos = add_bos_token if add_bos_token is not None else bos_token is not None
        self.prepends_bos = bool(wants_bos) and self.bos_token_id is not None

    @classmethod
    def from_folder(cls, folder: str | Path) -> HFTokenizer:
        """Read ``tokenizer.json`` and (if present) ``tokenizer_config.json`` from ``folder``.

        Raises:
            FileNotFoundError: the folder has no ``tokenizer.json``.
            ValueError: a file is unreadable, or a special token is not in the vocabulary.
        """
        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise MissingFileError(f"{path} does not exist; a tokenizer folder needs it.")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as error:  # the Rust library raises its own exception type
            raise DamagedFileError(f"{path} is not a readable tokenizers file: {error}") from error
        config: dict[str, object] = {}
        config_path = folder / TOKENIZER_CONFIG_FILE
        if config_path.is_file():
            config = read_json_object(config_path)
        add_bos = config.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise ConfigTypeError(
                f"{config_path}: field add_bos_token={add_bos!r} must be true or false (a JSON "
                "boolean, not a string or number); fix the file."
            )
        return cls(
            tokenizer,
            bos_token=_token_string(config, "bos_token", config_path),
            eos_token=_token_string(config, "eos_token", config_path),
            pad_token=_token_string(config, "pad_token", config_path),
            add_bos_token=add_bos,
            source=str(path),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @hf_encode_keywords
    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of ``text``: ``[BOS] + ids + [EOS]`` as requested.

        Raises:
            ValueError: ``bos`` or ``eos`` is asked for but the tokenizer has no such token.
        """
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if bos:
            ids.insert(0, self._require(self.bos_token_id, "BOS", "prepend_bos=False"))
        if eos:
            ids.append(self._require(self.eos_token_id, "EOS", "eos=False"))
        return ids

    def decode(self, ids: list[int] | Int[Tensor, " seq"]) -> str:
        """Text of ``ids`` (special tokens kept)."""
        values = [int(i) for i in ids.tolist()] if isinstance(ids, Tensor) else list(ids)
        return str(self.tokenizer.decode(values, skip_special_tokens=False))

    def _token_string(self, token: object) -> str | None:
        """A special token as the vocabulary spells it (``bos_token``, ``pad_token``, ...)."""
        if not isinstance(token, int):
            return None
        return str(self.tokenizer.id_to_token(token))

    def fingerprint(self) -> str:
        """A hash of everything that decides the ids of a text (cache keys of token files)."""
        payload = json.dumps(
            [self.tokenizer.to_str(), self.bos_token_id, self.eos_token_id], sort_keys=True
        )
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.source!r}, vocab_size={self.vocab_size})"

    def _special_id(self, token: str | None, name: str) -> int | None:
        if token is None:
            return None
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ConfigError(
                f"{self.source}: {name}={token!r} is not in the vocabulary; fix "
                f"{TOKENIZER_CONFIG_FILE} or add the token to {TOKENIZER_FILE}."
            )
        return int(token_id)

    def _require(self, token_id: int | None, name: str, fix: str) -> int:
        if token_id is None:
            raise InputError(
                f"{self.source} has no {name} token ({TOKENIZER_CONFIG_FILE} sets none); pass "
                f"{fix}."
            )
        return token_id


def load_checkpoint_tokenizer(folder: str | Path) -> HFTokenizer | None:
    """The tokenizer a checkpoint folder ships (``tokenizer.json``), or None if it has none."""
    folder = Path(folder)
    return HFTokenizer.from_folder(folder) if (folder / TOKENIZER_FILE).is_file() else None


def _token_string(config: dict[str, object], field: str, source: Path) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, ``{"content": ...}``,
    or null/absent (None); anything else is refused naming the file and field."""
    value = config.get(field)
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise ConfigTypeError(
        f"{source}: field {field}={config.get(field)!r} must be the token's string (or "
        '{"content": string}), not a token id; fix the file.'
    )
