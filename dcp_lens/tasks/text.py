"""Language modelling on a text corpus with the model's own tokenizer (``--task text:PATH``).

The corpus is one of:

- a text file (UTF-8), read in chunks of whole lines;
- a folder: every ``*.txt`` below it, in sorted path order, one document each;
- a ``.jsonl`` file: one document per line, the string under ``text_field``;
- a pre-tokenized ``.bin`` file of uint16 or uint32 ids (as nanoGPT's ``prepare.py`` and
  llama2.c's ``tinystories.py pretokenize`` write them), memory-mapped as it is.

Text is tokenized once into a token file (`np.memmap`) in the cache folder (``$DCP_LENS_CACHE``,
default ``~/.cache/dcp-lens``), named by the hash of the corpus's content and of the tokenizer, so a
second run reads it back. Documents are joined with the tokenizer's EOS (else BOS) between them.
Only ``max_tokens`` tokens are used (the first ones of the stream).

The used stream is cut into disjoint windows of ``n_ctx + 1`` tokens (``n_ctx`` when the model
prepends BOS, which then starts each window); a seeded permutation orders them, evaluation
example ``i`` is window ``perm[i]`` and calibration example ``i`` window ``perm[-1 - i]``, so the
two splits share no token while ``n_evaluation + n_calibration <= n_windows``. Windows are read
from the memory map per batch; the corpus is never held in memory whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

import numpy as np
import torch
from torch import Tensor

from dcp_lens.model.tokenization import encode_text, tokenizer_fingerprint
from dcp_lens.tasks.base import Split, Task, TaskBatch, check_batch_request
from dcp_lens.utils.errors import ConfigError, DCPLensError, InputError
from dcp_lens.utils.files import write_text_atomically

CACHE_ENV = "DCP_LENS_CACHE"
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# Characters of text tokenized per call: large enough to amortise the call, small enough that the
# ids of one chunk (Python ints) stay a few MB.
_CHUNK_CHARS = 1 << 18
MAX_LINE_CHARS = 64 << 20  # one record of a .jsonl corpus, read whole
_HASH_BLOCK = 1 << 20


def cache_dir() -> Path:
    """Where token files are cached: ``$DCP_LENS_CACHE`` or ``~/.cache/dcp-lens``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dcp-lens")


@dataclass
class TextLM(Task):
    """Next-token prediction on windows of a corpus, in the model's own token ids.

    Args:
        path: a text file, a folder of ``.txt``, a ``.jsonl`` or a pre-tokenized ``.bin``.
        tokenizer: the model's tokenizer (``model.tokenizer``); not needed for ``.bin``.
        n_ctx: tokens per window (inputs).
        seed: orders the windows; example ``i`` of a split depends only on ``(seed, split, i)``.
        max_tokens: use at most this many tokens of the stream (None: all of it).
        prepend_bos: start every window with the tokenizer's BOS.
        text_field: the field of each ``.jsonl`` record that holds its text.
        token_dtype: ``"uint16"`` or ``"uint32"``, the ids of a ``.bin`` (default: uint16 for a
            vocabulary of at most 65536 ids, else uint32); the token file uses the same rule.
        vocab_size: the id range of a ``.bin`` without a tokenizer (default: the model's).

    Splits: ``"evaluation"`` and ``"calibration"`` (there is no ``"train"``). Every position is
    scored; accuracy is next-token top-1. Metadata ``"window"``, ``[batch]``: the window index.
    """

    name: ClassVar[str] = "text"
    uses_model_tokenizer: ClassVar[bool] = True

    path: str | Path
    tokenizer: Any = None
    n_ctx: int = 128
    seed: int = 0
    max_tokens: int | None = None
    prepend_bos: bool = False
    text_field: str = "text"
    token_dtype: str | None = None
    vocab_size: int | None = None

    _tokens: np.ndarray = field(init=False, repr=False, compare=False)
    _order: np.ndarray = field(init=False, repr=False, compare=False)
    token_file: Path = field(init=False, compare=False)

    def __post_init__(self) -> None:
        self.path = str(self.path)
        source = Path(self.path)
        if not source.exists():
            raise ValueError(
                f"text corpus {self.path!r} does not exist; pass a text file, a folder of .txt, "
                "a .jsonl or a pre-tokenized .bin."
            )
        if not (source.is_file() or source.is_dir()) and self.max_tokens is None:
            raise ConfigError(
                f"text corpus {self.path!r} is a device, pipe or socket, not a file: it may never "
                "end, so it is read only with max_tokens (--max-tokens N); pass one or a file."
            )
        if self.n_ctx < 1:
            raise ValueError(f"n_ctx={self.n_ctx} must be >= 1 (tokens per window).")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1 (or None for all).")
        is_bin = source.is_file() and source.suffix == ".bin"
        if self.tokenizer is None and (not is_bin or self.prepend_bos):
            raise ValueError(
                f"text corpus {self.path!r} needs the model's tokenizer "
                f"({'to add BOS' if is_bin else 'to tokenize it'}), but none was given; load a "
                "model that ships one (huginn:, ouro:, llama2c:) or pass pre-tokenized .bin."
            )
        if self.vocab_size is None and self.tokenizer is not None:
            self.vocab_size = len(self.tokenizer)
        dtype = self._dtype()
        if is_bin:
            self.token_file = source
            self._tokens = _read_token_file(source, dtype)
        else:
            self.token_file = self._tokenize(source, dtype)
            self._tokens = _read_token_file(self.token_file, dtype)
        if self.max_tokens is not None:
            self._tokens = self._tokens[: self.max_tokens]  # a view of the memory map
        if is_bin and self.vocab_size is not None:  # ids written elsewhere: check them once
            _check_ids(self._tokens, self.vocab_size, self.token_file)
        if self.n_windows < 2:
            raise ValueError(
                f"{self.path!r} gives {len(self._tokens)} tokens, fewer than two windows of "
                f"{self._span} tokens; lower n_ctx or raise max_tokens."
            )
        self._order = np.random.default_rng(self.seed).permutation(self.n_windows)

    # ------------------------------------------------------------------------ Task interface

    @property
    def vocab(self) -> list[str]:
        """Each id's text by the tokenizer (ids as strings for a ``.bin`` without one)."""
        if self.tokenizer is None:
            return [str(i) for i in range(self.d_vocab)]
        return [self.tokenizer.decode([i]) for i in range(self.d_vocab)]

    @property
    def d_vocab(self) -> int:
        """The tokenizer's vocabulary size (for a ``.bin`` without one: the largest id + 1)."""
        if self.vocab_size is not None:
            return self.vocab_size
        return int(self._tokens.max()) + 1 if len(self._tokens) else 0

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` by the model's tokenizer (no BOS)."""
        return encode_text(self._require_tokenizer(), text, False)

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """The text of token ids."""
        values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        return str(self._require_tokenizer().decode(values))

    def batch(self, split: Split, n: int, *, offset: int = 0) -> TaskBatch:
        """Windows ``offset .. offset + n - 1`` of ``split``: tokens and targets ``[n, n_ctx]``
        read from the memory map, every position scored."""
        check_batch_request(split, n, offset, self.n_ctx)
        if split == "train":
            raise ValueError("the text task has no train split; use 'evaluation' or 'calibration'.")
        if offset + n > self.n_windows:
            raise ValueError(
                f"{split} examples {offset}..{offset + n - 1} do not exist: {self.path!r} has "
                f"{self.n_windows} windows of {self._span} tokens in {len(self._tokens)} tokens; "
                "ask for fewer or raise max_tokens."
            )
        positions = np.arange(offset, offset + n)
        windows = self._order[positions] if split == "evaluation" else self._order[-1 - positions]
        starts = windows * self._span
        rows = np.stack([self._tokens[s : s + self._span] for s in starts]).astype(np.int64)
        stream = torch.from_numpy(rows)
        if self.prepend_bos:
            bos = torch.full((n, 1), self._require_tokenizer().bos_token_id, dtype=torch.long)
            stream = torch.cat((bos, stream), dim=1)
        window = torch.from_numpy(windows.astype(np.int64))
        return TaskBatch.next_token(
            stream, split, torch.from_numpy(positions), metadata={"window": window}
        )

    def describe(self) -> str:
        """A one-line description for reports."""
        return (
            f"text LM on {Path(self.path).name} ({len(self._tokens)} tokens used, "
            f"{self.n_windows} windows of {self.n_ctx}), seed {self.seed}"
        )

    def to_dict(self) -> dict[str, object]:
        """Name and parameters; the tokenizer is given by its fingerprint (pass the model's
        tokenizer again to rebuild)."""
        params = super().to_dict()
        tokenizer = params.pop("tokenizer")
        params["tokenizer_fingerprint"] = (
            None if tokenizer is None else tokenizer_fingerprint(tokenizer)
        )
        return params

    def split_sizes(self, n_evaluation: int | None, n_calibration: int | None) -> tuple[int, int]:
        """(evaluation, calibration) window counts: None means, for calibration, a quarter of the
        windows up to 512, and for evaluation every window left, so the whole used corpus is read.

        Raises:
            ValueError: the two together need more windows than the used corpus has.
        """
        calibration = n_calibration or min(512, self.n_windows // 4) or 1
        evaluation = n_evaluation or self.n_windows - calibration
        if evaluation < 1 or evaluation + calibration > self.n_windows:
            raise ValueError(
                f"{evaluation} evaluation + {calibration} calibration windows do not fit in the "
                f"{self.n_windows} disjoint windows of {self._span} tokens that {self.n_tokens} "
                "tokens give; lower --n-eval / --n-calibration or raise --max-tokens."
            )
        return evaluation, calibration

    # ------------------------------------------------------------------------ the corpus

    @property
    def n_tokens(self) -> int:
        """Tokens used (at most ``max_tokens``)."""
        return len(self._tokens)

    @property
    def n_windows(self) -> int:
        """Disjoint windows in the used tokens; evaluation + calibration examples fit in it."""
        return len(self._tokens) // self._span

    @property
    def _span(self) -> int:
        """Corpus tokens per window: the inputs and the next token, less a prepended BOS."""
        return self.n_ctx + (0 if self.prepend_bos else 1)

    def _dtype(self) -> np.dtype[Any]:
        if self.token_dtype is not None:
            if self.token_dtype not in TOKEN_DTYPES:
                raise ValueError(
                    f"token_dtype={self.token_dtype!r} is not one of {sorted(TOKEN_DTYPES)}."
                )
            return np.dtype(TOKEN_DTYPES[self.token_dtype])
        fits_16 = self.vocab_size is None or self.vocab_size <= 1 << 16
        return np.dtype(np.uint16 if fits_16 else np.uint32)

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this text task has no tokenizer (a pre-tokenized .bin); pass one.")
        return self.tokenizer

    def _tokenize(self, source: Path, dtype: np.dtype[Any]) -> Path:
        """The cached token file of ``source`` (written on first use, atomically).

        Without ``max_tokens`` the cache is named by the hash of the whole corpus; with it, by
        the hash of the text read for those tokens only (the corpus is read once, as far as
        needed: a bounded read of an endless stream ends)."""
        tokenizer = self._require_tokenizer()
        key = hashlib.sha256()
        key.update(tokenizer_fingerprint(tokenizer).encode())
        key.update(f"{dtype.name}/{self.max_tokens}/{self.text_field}".encode())
        folder = cache_dir()
        if self.max_tokens is None:
            key.update(_content_hash(source, self.text_field).encode())
            target = folder / f"{source.stem[:40]}-{key.hexdigest()[:24]}.{dtype.name}"
            if target.is_file():
                return target
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f"{source.stem[:40]}.{os.getpid()}.partial"
        read = hashlib.sha256()
        try:
            with partial.open("wb") as out:
                written = self._write_tokens(source, tokenizer, dtype, out, read)
            if self.max_tokens is not None:
                key.update(read.hexdigest().encode())
                target = folder / f"{source.stem[:40]}-{key.hexdigest()[:24]}.{dtype.name}"
                if target.is_file():
                    return target
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        metadata = {"source": str(source), "tokens": written, "dtype": dtype.name}
        write_text_atomically(
            target.with_name(target.name + ".json"), json.dumps(metadata, indent=2)
        )
        return target

    def _write_tokens(
        self, source: Path, tokenizer: Any, dtype: np.dtype[Any], out: BinaryIO, read: Any
    ) -> int:
        """Tokenize ``source`` into ``out`` (at most ``max_tokens``), hashing into ``read``
        the text it read; returns the number of tokens written."""
        separator = [
            i for i in (getattr(tokenizer, "eos_token_id", None),) if isinstance(i, int)
        ] or [i for i in (getattr(tokenizer, "bos_token_id", None),) if isinstance(i, int)]
        written = 0
        # Chunks no longer than the tokens wanted, so a small max_tokens reads little.
        chunk_chars = min(_CHUNK_CHARS, max(self.max_tokens or _CHUNK_CHARS, 4096))
        for document_index, document in enumerate(_documents(source, self.text_field, chunk_chars)):
            read.update(f"\0document {document_index}\0".encode())
            for chunk_index, chunk in enumerate(document):
                read.update(chunk.encode("utf-8", "surrogatepass"))
                ids = _encode(tokenizer, chunk, source)
                if document_index and not chunk_index:
                    ids = separator + ids
                if self.max_tokens is not None:
                    ids = ids[: self.max_tokens - written]
                written += _write_ids(out, ids, dtype, source)
                if self.max_tokens is not None and written >= self.max_tokens:
                    return written
        return written


def text_task(
    model: Any,
    path: str | Path,
    *,
    seed: int = 0,
    seq_len: int | None = None,
    max_tokens: int | None = None,
    text_field: str = "text",
    token_dtype: str | None = None,
) -> TextLM:
    """The text task of ``path`` in ``model``'s own tokens: its tokenizer, its BOS convention
    (``cfg.default_prepend_bos``) and windows of ``seq_len`` tokens (default: the model's
    context, at most 128)."""
    cfg = model.cfg
    tokenizer = getattr(model, "tokenizer", None)
    prepend_bos = bool(cfg.default_prepend_bos) and tokenizer is not None
    prepend_bos = prepend_bos and getattr(tokenizer, "bos_token_id", None) is not None
    n_ctx = seq_len if seq_len is not None else min(int(cfg.n_ctx), 128)
    if n_ctx > cfg.n_ctx:
        raise ValueError(f"seq_len={n_ctx} exceeds the model's context n_ctx={cfg.n_ctx}.")
    return TextLM(
        path,
        tokenizer=tokenizer,
        n_ctx=n_ctx,
        seed=seed,
        max_tokens=max_tokens,
        prepend_bos=prepend_bos,
        text_field=text_field,
        token_dtype=token_dtype,
        vocab_size=None if tokenizer is not None else int(cfg.d_vocab),
    )


def _read_token_file(path: Path, dtype: np.dtype[Any]) -> np.ndarray:
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(
            f"{path} has {size} bytes, not a whole number of {dtype.name} ids; pass "
            "token_dtype (--token-dtype) matching how it was written."
        )
    if size == 0:
        raise ValueError(f"{path} holds no tokens.")
    return np.memmap(path, dtype=dtype, mode="r")


def _check_ids(tokens: np.ndarray, vocab_size: int, path: Path) -> None:
    """Every id must be < vocab_size (checked in blocks, never loading the file whole)."""
    block = 1 << 22
    for start in range(0, len(tokens), block):
        largest = int(tokens[start : start + block].max())
        if largest >= vocab_size:
            raise ValueError(
                f"{path} holds token id {largest}, outside the vocabulary of {vocab_size} ids; "
                "the tokens were written for another tokenizer or with another token_dtype."
            )


def _write_ids(out: BinaryIO, ids: list[int], dtype: np.dtype[Any], source: Path) -> int:
    array = np.asarray(ids, dtype=np.int64)
    if len(array) and (array.min() < 0 or array.max() > np.iinfo(dtype).max):
        raise ValueError(f"{source}: token ids do not fit {dtype.name}; pass token_dtype.")
    array.astype(dtype).tofile(out)
    return len(array)


def _content_hash(source: Path, text_field: str) -> str:
    """sha256 of the corpus bytes (a folder: its .txt names and bytes; jsonl: and the field)."""
    digest = hashlib.sha256()
    files = sorted(source.rglob("*.txt")) if source.is_dir() else [source]
    for file in files:
        digest.update(str(file.relative_to(source) if source.is_dir() else file.name).encode())
        with file.open("rb") as handle:
            while block := handle.read(_HASH_BLOCK):
                digest.update(block)
    if source.suffix == ".jsonl":
        digest.update(text_field.encode())
    return digest.hexdigest()


def _documents(source: Path, text_field: str, chunk_chars: int) -> Iterator[Iterator[str]]:
    """The corpus as documents, each a stream of text chunks (whole lines, ~``chunk_chars``)."""
    if source.is_dir():
        files = sorted(source.rglob("*.txt"))
        if not files:
            raise ValueError(f"folder {source} holds no .txt file.")
        for file in files:
            yield _line_chunks(file, chunk_chars)
    elif source.suffix == ".jsonl":
        with source.open(encoding="utf-8") as handle:
            number = 0
            while line := handle.readline(MAX_LINE_CHARS + 1):
                number += 1
                if len(line) > MAX_LINE_CHARS:
                    raise InputError(
                        f"{source}:{number}: a line of more than {MAX_LINE_CHARS:,} characters; "
                        "a .jsonl corpus holds one record of text per line. Split the record."
                    )
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError) as error:
                    raise InputError(
                        f"{source}:{number}: not a JSON record ({' '.join(str(error).split())}); "
                        "a .jsonl corpus holds one JSON object per line."
                    ) from error
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ValueError(
                        f"{source}:{number}: no string field {text_field!r}; pass the field that "
                        "holds the text (--text-field)."
                    )
                yield _text_chunks(text, chunk_chars)
    else:
        yield _line_chunks(source, chunk_chars)


def _text_chunks(text: str, chunk_chars: int) -> Iterator[str]:
    """A record's text in chunks of about ``chunk_chars`` characters, each ending at a line
    break or a space where there is one (so a long record is tokenized a piece at a time)."""
    start = 0
    while len(text) - start > chunk_chars:
        end = start + chunk_chars
        cut = max(text.rfind("\n", start, end), text.rfind(" ", start, end))
        end = cut + 1 if cut > start else end
        yield text[start:end]
        start = end
    if start < len(text) or not text:
        yield text[start:]


def _encode(tokenizer: Any, text: str, source: Path) -> list[int]:
    """``encode_text``, with a tokenizer's own crash (the `tokenizers` library's
    PanicException, a BaseException: a pattern of its tokenizer.json that backtracks without
    end, ...) turned into an error naming the corpus and the tokenizer."""
    try:
        return encode_text(tokenizer, text, False)
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as error:
        if isinstance(error, DCPLensError):
            raise
        raise InputError(
            f"the tokenizer failed on {source} ({type(error).__name__}: "
            f"{' '.join(str(error).split())[:200]}); its tokenizer.json may be damaged (a "
            "pattern that cannot be run); check the tokenizer, or pass pre-tokenized ids (.bin)."
        ) from error


def _line_chunks(path: Path, chunk_chars: int) -> Iterator[str]:
    """A text file in chunks of whole lines of about ``chunk_chars`` characters."""
    with path.open(encoding="utf-8") as handle:
        lines: list[str] = []
        size = 0
        while line := handle.readline(chunk_chars):  # a line without end is read in pieces
            lines.append(line)
            size += len(line)
            if size >= chunk_chars:
                yield "".join(lines)
                lines, size = [], 0
        if lines:
            yield "".join(lines)
