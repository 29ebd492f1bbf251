"""Read llama2.c's legacy ("version 0") checkpoint format into named tensors.

Layout, all little-endian::

    int32 dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
    float32 token_embedding [vocab, dim]
            rms_att [L, dim]
            wq [L, dim, dim];  wk [L, kv_dim, dim];  wv [L, kv_dim, dim];  wo [L, dim, dim]
            rms_ffn [L, dim]
            w1 [L, hidden, dim];  w2 [L, dim, hidden];  w3 [L, hidden, dim]
            rms_final [dim]
            freq_cis_real [seq_len, head_size / 2];  freq_cis_imag [seq_len, head_size / 2]
            wcls [vocab, dim]          only when the stored vocab_size is negative

A negative ``vocab_size`` means the classifier is not shared with the token embedding. Weight
matrices are stored in ``nn.Linear`` ``[out, in]`` layout and returned that way.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from dcp_lens.utils.checks import check_limit
from dcp_lens.utils.errors import ConfigTypeError, DCPLensError, MissingFileError, WeightsError

HEADER_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
HEADER_BYTES = 4 * len(HEADER_FIELDS)
FLOAT_BYTES = 4
# Header field -> the RecurrentConfig field whose bound applies to it.
HEADER_LIMITS = (
    ("dim", "d_model"), ("hidden_dim", "d_mlp"), ("n_layers", "n_prelude"), ("n_heads", "n_heads"),
    ("vocab_size", "d_vocab"), ("seq_len", "n_ctx"),
)  # fmt: skip
# llama2.c's newer export formats (version >= 1) start with this magic ("ak42").
_VERSIONED_MAGIC = 0x616B3432


@dataclass(frozen=True)
class Llama2cHeader:
    """The 7-int header of a llama2.c version-0 checkpoint.

    ``vocab_size`` is the absolute value; ``shared_classifier`` records its sign in the file
    (positive: the classifier reuses the token embedding; negative: a ``wcls`` array follows).
    """

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool = True

    def __post_init__(self) -> None:
        for name in HEADER_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigTypeError(
                    f"{name} must be an int, got {type(value).__name__} ({value!r})."
                )
            if value <= 0:
                raise WeightsError(
                    f"header field {name}={value} must be positive; the file is corrupt or not a "
                    "llama2.c version-0 checkpoint."
                )
        # Declared sizes are bounded before any size is computed from them.
        for name, field in HEADER_LIMITS:
            check_limit(field, getattr(self, name), f"header field {name}")
        if self.dim % self.n_heads != 0:
            raise WeightsError(
                f"header field n_heads={self.n_heads} does not divide dim={self.dim}; the file is "
                "corrupt or not a llama2.c version-0 checkpoint."
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise WeightsError(
                f"header field n_kv_heads={self.n_kv_heads} does not divide "
                f"n_heads={self.n_heads}; the file is corrupt or not a llama2.c checkpoint."
            )
        if self.head_size % 2 != 0:
            raise WeightsError(
                f"header field n_heads={self.n_heads} gives head_size={self.head_size} (dim / "
                "n_heads), which must be even for rotary embeddings."
            )

    @property
    def head_size(self) -> int:
        """Width of one attention head, ``dim // n_heads``."""
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the key and value projections, ``n_kv_heads * head_size``."""
        return self.n_kv_heads * self.head_size

    def to_dict(self) -> dict[str, int | bool]:
        """The header as a JSON-ready dict."""
        return dataclasses.asdict(self)

    def array_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of every float32 array, in file order (``wcls`` if unshared)."""
        L, dim, hidden, kv_dim = self.n_layers, self.dim, self.hidden_dim, self.kv_dim
        shapes: list[tuple[str, tuple[int, ...]]] = [
            ("token_embedding", (self.vocab_size, dim)),
            ("rms_att", (L, dim)),
            ("wq", (L, dim, dim)),
            ("wk", (L, kv_dim, dim)),
            ("wv", (L, kv_dim, dim)),
            ("wo", (L, dim, dim)),
            ("rms_ffn", (L, dim)),
            ("w1", (L, hidden, dim)),
            ("w2", (L, dim, hidden)),
            ("w3", (L, hidden, dim)),
            ("rms_final", (dim,)),
            ("freq_cis_real", (self.seq_len, self.head_size // 2)),
            ("freq_cis_imag", (self.seq_len, self.head_size // 2)),
        ]
        if not self.shared_classifier:
            shapes.append(("wcls", (self.vocab_size, dim)))
        return shapes

    @property
    def file_bytes(self) -> int:
        """Exact size in bytes of a checkpoint with this header."""
        floats = sum(math.prod(shape) for _, shape in self.array_shapes())
        return HEADER_BYTES + FLOAT_BYTES * floats


def read_llama2c_header(path: str | Path) -> Llama2cHeader:
    """Read and validate only the header of a llama2.c version-0 checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path} does not exist; pass a llama2.c .bin checkpoint.")
    with path.open("rb") as handle:
        raw = handle.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise WeightsError(
            f"{path}: {len(raw)} bytes, expected at least the {HEADER_BYTES}-byte header "
            f"({', '.join(HEADER_FIELDS)} as int32); the file is truncated or not a checkpoint."
        )
    values = [int(v) for v in np.frombuffer(raw, dtype="<i4")]
    if values[0] == _VERSIONED_MAGIC:
        raise WeightsError(
            f"{path}: starts with the magic 0x{_VERSIONED_MAGIC:08x} of llama2.c's versioned "
            "export (version >= 1); only the legacy version-0 format is supported. Re-export "
            "with `export.py --version 0`."
        )
    fields = dict(zip(HEADER_FIELDS, values, strict=True))
    shared = fields["vocab_size"] > 0
    fields["vocab_size"] = abs(fields["vocab_size"])
    try:
        return Llama2cHeader(**fields, shared_classifier=shared)
    except DCPLensError as error:
        raise type(error)(f"{path}: {error}") from error


def read_llama2c_checkpoint(
    path: str | Path,
) -> tuple[Llama2cHeader, dict[str, Float[Tensor, "..."]]]:
    """Read a llama2.c version-0 checkpoint.

    Returns:
        The header and a dict of float32 tensors keyed by llama2.c's names, with the shapes of
        :meth:`Llama2cHeader.array_shapes` (weights ``[L, out, in]``, norms ``[L, dim]``,
        ``rms_final [dim]``, ``freq_cis_real``/``freq_cis_imag`` ``[seq_len, head_size / 2]``,
        ``wcls [vocab, dim]`` only when the classifier is unshared).

    Raises:
        WeightsError: a header field is nonsense (named), or the file size differs from the size
            the header implies (expected and actual byte counts and the array that was cut).
    """
    path = Path(path)
    header = read_llama2c_header(path)
    actual = path.stat().st_size
    expected = header.file_bytes
    if actual != expected:
        raise WeightsError(_size_mismatch_message(path, header, actual))
    flat = np.fromfile(path, dtype="<f4", offset=HEADER_BYTES)
    tensors: dict[str, Tensor] = {}
    start = 0
    for name, shape in header.array_shapes():
        count = math.prod(shape)
        array = flat[start : start + count].reshape(shape).astype(np.float32, copy=False)
        tensors[name] = torch.from_numpy(array)
        start += count
    return header, tensors


def _size_mismatch_message(path: Path, header: Llama2cHeader, actual: int) -> str:
    """Name the array the file ends inside (or the surplus) for a wrong-sized checkpoint."""
    expected = header.file_bytes
    described = (
        f"{path}: {actual} bytes, but its header ({_header_text(header)}) implies {expected} bytes"
    )
    if actual > expected:
        surplus = actual - expected
        hint = ""
        if header.shared_classifier and surplus == header.vocab_size * header.dim * FLOAT_BYTES:
            hint = (
                " (exactly one [vocab, dim] classifier: an unshared wcls with a positive "
                "vocab_size in the header?)"
            )
        return f"{described}; {surplus} unexpected trailing bytes{hint}."
    offset = HEADER_BYTES
    for name, shape in header.array_shapes():
        size = FLOAT_BYTES * math.prod(shape)
        if actual < offset + size:
            return (
                f"{described}; the file is truncated inside array {name!r} {list(shape)}, which "
                f"spans bytes {offset}..{offset + size} (has {max(actual - offset, 0)} of its "
                f"{size} bytes)."
            )
        offset += size
    raise AssertionError("unreachable: a short file must end inside some array")


def _header_text(header: Llama2cHeader) -> str:
    return ", ".join(f"{name}={getattr(header, name)}" for name in HEADER_FIELDS) + (
        "" if header.shared_classifier else ", unshared classifier"
    )
