"""llama2.c version-0 checkpoint and tokenizer readers, checked on the real stories260K model.

The golden check runs an independent plain-PyTorch forward pass (``reference_llama2c_logits`` in
tests/reference.py, out of the package so it can validate the library's own loader) and asserts
that greedy decoding reproduces the continuation published with the model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import data_path
from reference import CONTINUATION, PROMPT, STORY, reference_llama2c_logits, reference_rope_angles
from torch import Tensor

from dcp_lens.zoo.loaders.llama2c_format import (
    HEADER_BYTES,
    Llama2cHeader,
    read_llama2c_checkpoint,
    read_llama2c_header,
)
from dcp_lens.zoo.loaders.tokenizer import Llama2cTokenizer

STORIES260K_BYTES = 1_056_540


CHECKPOINT = data_path("stories260K", "stories260K.bin")
TOKENIZER = data_path("stories260K", "tok512.bin")


def reference_greedy(
    weights: dict[str, Tensor], n_heads: int, n_kv_heads: int, prompt: list[int], n_new: int
) -> list[int]:
    """Greedy (temperature 0) continuation of ``prompt``: ``n_new`` token ids."""
    tokens = list(prompt)
    for _ in range(n_new):
        logits = reference_llama2c_logits(weights, n_heads, n_kv_heads, tokens)
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt) :]


# --------------------------------------------------------------------------------------------
# Independent reference of llama2.c's quadratic BPE merge loop.
# --------------------------------------------------------------------------------------------


def reference_llama2c_encode(tokenizer: Llama2cTokenizer, text: str) -> list[int]:
    """llama2.c's ``encode`` (BOS, dummy prefix, byte fallback, rescan-and-merge), verbatim."""
    lookup = {piece: i for i, piece in enumerate(tokenizer.pieces) if i > 2}
    ids = [1]
    if text:
        ids.append(lookup[b" "])
    for char in text:
        encoded = char.encode("utf-8")
        if encoded in lookup:
            ids.append(lookup[encoded])
        else:
            ids.extend(byte + 3 for byte in encoded)
    body = ids[1:]
    while True:
        best_score, best_id, best_index = -1e10, -1, -1
        for i in range(len(body) - 1):
            merged = lookup.get(tokenizer.pieces[body[i]] + tokenizer.pieces[body[i + 1]])
            if merged is not None and tokenizer.scores[merged] > best_score:
                best_score, best_id, best_index = tokenizer.scores[merged], merged, i
        if best_index == -1:
            break
        body[best_index : best_index + 2] = [best_id]
    return [1] + body


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint() -> tuple[Llama2cHeader, dict[str, Tensor]]:
    return read_llama2c_checkpoint(CHECKPOINT)


@pytest.fixture(scope="module")
def tokenizer() -> Llama2cTokenizer:
    return Llama2cTokenizer.from_file(TOKENIZER, vocab_size=512)


def _write_checkpoint(path: Path, header_ints: list[int], arrays: list[np.ndarray]) -> None:
    with path.open("wb") as handle:
        handle.write(np.asarray(header_ints, dtype="<i4").tobytes())
        for array in arrays:
            handle.write(np.ascontiguousarray(array, dtype="<f4").tobytes())


# --------------------------------------------------------------------------------------------
# Checkpoint reader on the real model
# --------------------------------------------------------------------------------------------


def test_header_matches_readme(checkpoint: tuple[Llama2cHeader, dict[str, Tensor]]) -> None:
    header, _ = checkpoint
    assert (
        header.dim,
        header.hidden_dim,
        header.n_layers,
        header.n_heads,
        header.n_kv_heads,
        header.vocab_size,
        header.seq_len,
    ) == (64, 172, 5, 8, 4, 512, 512)
    assert header.shared_classifier
    assert (header.head_size, header.kv_dim) == (8, 32)
    assert header.file_bytes == STORIES260K_BYTES == CHECKPOINT.stat().st_size
    assert read_llama2c_header(CHECKPOINT) == header


def test_tensor_names_shapes_and_dtypes(
    checkpoint: tuple[Llama2cHeader, dict[str, Tensor]],
) -> None:
    _, tensors = checkpoint
    expected = {
        "token_embedding": (512, 64),
        "rms_att": (5, 64),
        "wq": (5, 64, 64),
        "wk": (5, 32, 64),
        "wv": (5, 32, 64),
        "wo": (5, 64, 64),
        "rms_ffn": (5, 64),
        "w1": (5, 172, 64),
        "w2": (5, 64, 172),
        "w3": (5, 172, 64),
        "rms_final": (64,),
        "freq_cis_real": (512, 4),
        "freq_cis_imag": (512, 4),
    }
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert all(torch.isfinite(t).all() for t in tensors.values())
    # The last float in the file is the last freq_cis_imag entry: check the offsets end-to-end.
    raw = np.fromfile(CHECKPOINT, dtype="<f4", offset=STORIES260K_BYTES - 4)
    assert tensors["freq_cis_imag"][-1, -1].item() == float(raw[0])


def test_freq_cis_tables_are_interleaved_rope_angles(
    checkpoint: tuple[Llama2cHeader, dict[str, Tensor]],
) -> None:
    header, tensors = checkpoint
    angles = reference_rope_angles(header.seq_len, header.head_size)
    torch.testing.assert_close(tensors["freq_cis_real"].double(), angles.cos(), atol=1e-5, rtol=0.0)
    torch.testing.assert_close(tensors["freq_cis_imag"].double(), angles.sin(), atol=1e-5, rtol=0.0)


def test_reference_forward_greedy_reproduces_published_continuation(
    checkpoint: tuple[Llama2cHeader, dict[str, Tensor]], tokenizer: Llama2cTokenizer
) -> None:
    header, tensors = checkpoint
    prompt_ids = tokenizer.encode(PROMPT, bos=True)
    story_ids = tokenizer.encode(STORY, bos=True)
    assert story_ids[: len(prompt_ids)] == prompt_ids, "prompt must tokenize as a prefix"
    n_new = len(story_ids) - len(prompt_ids)

    generated = reference_greedy(
        tensors, header.n_heads, header.n_kv_heads, prompt_ids, n_new=n_new
    )

    assert tokenizer.decode(generated) == CONTINUATION
    assert generated == story_ids[len(prompt_ids) :]


def test_truncated_checkpoint_names_file_sizes_and_array(tmp_path: Path) -> None:
    data = CHECKPOINT.read_bytes()
    # 100 floats into wq: past token_embedding [512, 64] and rms_att [5, 64].
    cut = HEADER_BYTES + 4 * (512 * 64 + 5 * 64 + 100)
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(data[:cut])
    with pytest.raises(ValueError) as error:
        read_llama2c_checkpoint(truncated)
    message = str(error.value)
    assert str(truncated) in message
    assert str(STORIES260K_BYTES) in message and str(cut) in message
    assert "'wq'" in message


def test_checkpoint_with_trailing_bytes_is_rejected(tmp_path: Path) -> None:
    padded = tmp_path / "padded.bin"
    padded.write_bytes(CHECKPOINT.read_bytes() + b"\0" * 8)
    with pytest.raises(ValueError, match="8 unexpected trailing bytes"):
        read_llama2c_checkpoint(padded)


@pytest.mark.parametrize(
    ("field_index", "value", "field"),
    [(0, -64, "dim"), (3, 7, "n_heads"), (4, 3, "n_kv_heads"), (6, 0, "seq_len")],
)
def test_corrupt_header_names_the_field(
    tmp_path: Path, field_index: int, value: int, field: str
) -> None:
    data = bytearray(CHECKPOINT.read_bytes())
    data[4 * field_index : 4 * field_index + 4] = np.int32(value).astype("<i4").tobytes()
    corrupt = tmp_path / "corrupt.bin"
    corrupt.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{field}={value}") as error:
        read_llama2c_checkpoint(corrupt)
    assert str(corrupt) in str(error.value)


# --------------------------------------------------------------------------------------------
# Checkpoint reader on synthetic files
# --------------------------------------------------------------------------------------------


def test_unshared_classifier_round_trips_bit_for_bit(tmp_path: Path) -> None:
    dims = {"dim": 8, "hidden_dim": 12, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}
    vocab, seq_len = 10, 6
    header = Llama2cHeader(**dims, vocab_size=vocab, seq_len=seq_len, shared_classifier=False)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape).astype(np.float32) for _, shape in header.array_shapes()]
    path = tmp_path / "unshared.bin"
    _write_checkpoint(path, [*dims.values(), -vocab, seq_len], arrays)

    read_header, tensors = read_llama2c_checkpoint(path)

    assert read_header == header
    assert list(tensors) == [name for name, _ in header.array_shapes()]
    assert list(tensors)[-1] == "wcls"
    for (name, _), array in zip(header.array_shapes(), arrays, strict=True):
        assert np.array_equal(tensors[name].numpy(), array), name


def test_shared_header_with_unshared_size_hints_at_wcls(tmp_path: Path) -> None:
    dims = [8, 12, 1, 2, 2, 4, 3]
    header = Llama2cHeader(*dims)
    path = tmp_path / "extra_wcls.bin"
    arrays = [np.zeros(shape, np.float32) for _, shape in header.array_shapes()]
    _write_checkpoint(path, dims, [*arrays, np.zeros((4, 8), np.float32)])
    with pytest.raises(ValueError, match="wcls"):
        read_llama2c_checkpoint(path)


def test_file_shorter_than_header_and_versioned_magic(tmp_path: Path) -> None:
    short = tmp_path / "short.bin"
    short.write_bytes(b"\x01\x00")
    with pytest.raises(ValueError, match="header"):
        read_llama2c_checkpoint(short)
    versioned = tmp_path / "v1.bin"
    versioned.write_bytes(np.asarray([0x616B3432, 1] + [0] * 5, dtype="<i4").tobytes())
    with pytest.raises(ValueError, match="version"):
        read_llama2c_checkpoint(versioned)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def test_tokenizer_vocabulary(tokenizer: Llama2cTokenizer) -> None:
    assert tokenizer.vocab_size == len(tokenizer) == 512
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.id_to_piece(0) == "<unk>"
    assert tokenizer.id_to_piece(3) == "<0x00>" and tokenizer.id_to_piece(258) == "<0xFF>"
    assert tokenizer.piece_to_id(" Once") is not None


def test_tokenizer_round_trips_story(tokenizer: Llama2cTokenizer) -> None:
    ids = tokenizer.encode(STORY)
    assert ids[0] == 1 and ids[1] == tokenizer.piece_to_id(" Once")
    assert tokenizer.decode(ids) == STORY
    with_eos = tokenizer.encode(STORY, bos=True, eos=True)
    assert with_eos == [*ids, 2]
    assert tokenizer.decode(with_eos) == STORY
    # Without BOS the dummy-prefix space stays (llama2.c strips it only right after BOS).
    assert tokenizer.decode(tokenizer.encode(STORY, bos=False)) == " " + STORY


@pytest.mark.parametrize(
    "text",
    [
        STORY,
        "Once upon a time, there was a little girl named Lily.",
        "über 😀 naïve — 世界\n\tend",
        "  two leading spaces and <0x41> and <s> literally",
        "a",
        "",
    ],
)
def test_tokenizer_matches_llama2c_merge_loop_and_round_trips(
    tokenizer: Llama2cTokenizer, text: str
) -> None:
    ids = tokenizer.encode(text)
    assert ids == reference_llama2c_encode(tokenizer, text)
    assert tokenizer.decode(ids) == text


def test_tokenizer_byte_fallback(tokenizer: Llama2cTokenizer) -> None:
    for char in ("😀", "ü"):
        assert tokenizer.piece_to_id(char) is None, f"{char!r} should be outside the vocabulary"
        ids = tokenizer.encode(char, bos=False)
        expected_bytes = [byte + 3 for byte in char.encode("utf-8")]
        assert ids[-len(expected_bytes) :] == expected_bytes
        assert tokenizer.decode([1, *ids]) == char
    # A lone continuation byte is invalid UTF-8 and decodes to the replacement character.
    assert tokenizer.decode([0x80 + 3]) == "\ufffd"


def test_tokenizer_call_is_hf_like(tokenizer: Llama2cTokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    assert tokenizer(PROMPT) == {"input_ids": ids, "attention_mask": [1] * len(ids)}
    batch = tokenizer(PROMPT, return_tensors="pt")
    assert torch.equal(batch["input_ids"], torch.tensor([ids]))
    assert tokenizer.decode(batch["input_ids"][0]) == PROMPT


def test_truncated_tokenizer_names_file_and_offset(tmp_path: Path) -> None:
    data = TOKENIZER.read_bytes()
    truncated = tmp_path / "tok_truncated.bin"
    truncated.write_bytes(data[:-3])
    with pytest.raises(ValueError, match=r"byte offset \d+") as error:
        Llama2cTokenizer.from_file(truncated)
    assert str(truncated) in str(error.value)
    # Cut at a record boundary: only the expected vocab_size can tell.
    cut_at_boundary = tmp_path / "tok_short.bin"
    cut_at_boundary.write_bytes(data[: -(8 + len(b"\xe2\x80\x8a"))])
    assert Llama2cTokenizer.from_file(cut_at_boundary).vocab_size == 511
    with pytest.raises(ValueError, match="vocab_size=512"):
        Llama2cTokenizer.from_file(cut_at_boundary, vocab_size=512)


def test_corrupt_tokenizer_length_names_offset(tmp_path: Path) -> None:
    path = tmp_path / "tok_corrupt.bin"
    records = [(0.0, b"<unk>"), (0.0, b"<s>"), (0.0, b"</s>")]
    body = b"".join(
        np.float32(score).astype("<f4").tobytes() + np.int32(len(p)).astype("<i4").tobytes() + p
        for score, p in records
    )
    bad_length = np.float32(0).astype("<f4").tobytes() + np.int32(-5).astype("<i4").tobytes()
    path.write_bytes(np.int32(5).astype("<i4").tobytes() + body + bad_length)
    with pytest.raises(ValueError, match=r"byte offset \d+.*length -5") as error:
        Llama2cTokenizer.from_file(path)
    assert str(path) in str(error.value)
