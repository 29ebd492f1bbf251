"""`Llama2cTokenizer`: llama2.c's SentencePiece-BPE tokenizer, read from its ``tokenizer.bin``.

The file format (llama2.c ``tokenizer.py`` export), all little-endian::

    int32 max_token_length
    repeated vocab_size times: float32 score, int32 n_bytes, n_bytes of UTF-8 piece

The vocabulary size is not stored; it is the number of records before the end of the file (pass
``vocab_size`` to :meth:`Llama2cTokenizer.from_file` to check it against the model header).
SentencePiece's ``▁`` has already been replaced by a plain space in the stored pieces.

Encoding follows llama2.c's ``encode``: optional BOS, a dummy-prefix space for non-empty text, one
symbol per Unicode character (UTF-8 byte tokens ``<0xNN>`` when the character is not a piece), then
repeatedly merge the adjacent pair whose concatenation is a piece with the highest score (leftmost
pair on ties), optional EOS.
"""

from __future__ import annotations

import hashlib
import heapq
import re
import struct
from pathlib import Path

from jaxtyping import Int
from torch import Tensor

from dcp_lens.model.tokenization import TransformerLensTokenizer, hf_encode_keywords
from dcp_lens.utils.errors import MissingFileError, WeightsError

UNK_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2

_BYTE_PIECE = re.compile(rb"<0x([0-9A-F]{2})>")


class Llama2cTokenizer(TransformerLensTokenizer):
    """SentencePiece BPE with byte fallback, as llama2.c runs it.

    Args:
        pieces: the vocabulary, ``pieces[i]`` the UTF-8 bytes of token ``i`` (spaces, not ``▁``).
        scores: merge priority of each piece; a higher score merges first.
        max_token_length: the longest piece in bytes, as stored in the file header.
    """

    bos_token_id: int = BOS_TOKEN_ID
    eos_token_id: int = EOS_TOKEN_ID
    # model.to_tokens right-pads with EOS (`padding_id`); TransformerLens's masks read these.
    pad_token_id: int = EOS_TOKEN_ID
    unk_token_id: int = UNK_TOKEN_ID
    prepends_bos = True  # llama2.c starts every text with BOS (a call's add_special_tokens)

    def __init__(self, pieces: list[bytes], scores: list[float], max_token_length: int) -> None:
        if len(pieces) != len(scores):
            raise ValueError(f"got {len(pieces)} pieces but {len(scores)} scores; pass one each.")
        if len(pieces) <= EOS_TOKEN_ID:
            raise ValueError(
                f"vocabulary has {len(pieces)} pieces; llama2.c needs at least <unk>, <s>, </s>."
            )
        self.pieces = list(pieces)
        self.scores = list(scores)
        self.max_token_length = max_token_length
        special = {UNK_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID}
        # Byte and special pieces are excluded from lookup so that literal text such as "<0x41>"
        # is encoded as characters, never as the token it happens to spell (SentencePiece does
        # the same; on ordinary text this matches llama2.c exactly).
        self._byte_of_id: dict[int, int] = {}
        self._piece_to_id: dict[bytes, int] = {}
        for token_id, piece in enumerate(self.pieces):
            match = _BYTE_PIECE.fullmatch(piece)
            if match is not None:
                self._byte_of_id[token_id] = int(match.group(1), 16)
            elif token_id not in special:
                self._piece_to_id.setdefault(piece, token_id)
        self._id_of_byte = {byte: token_id for token_id, byte in self._byte_of_id.items()}

    @classmethod
    def from_file(cls, path: str | Path, vocab_size: int | None = None) -> Llama2cTokenizer:
        """Read a llama2.c ``tokenizer.bin``; ``vocab_size``, if given, must match the record count.

        Raises:
            WeightsError: the file is truncated or corrupt (the message names the file and the
                byte offset of the bad record), or holds a different number of tokens.
        """
        path = Path(path)
        if not path.is_file():
            raise MissingFileError(f"{path} does not exist; pass a llama2.c tokenizer.bin.")
        data = path.read_bytes()
        if len(data) < 4:
            raise WeightsError(
                f"{path}: {len(data)} bytes, too short for the int32 max_token_length header at "
                "byte offset 0; is this a llama2.c tokenizer.bin?"
            )
        (max_token_length,) = struct.unpack_from("<i", data, 0)
        if max_token_length <= 0:
            raise WeightsError(
                f"{path}: max_token_length={max_token_length} at byte offset 0 must be positive; "
                "the file is corrupt or not a llama2.c tokenizer.bin."
            )
        pieces: list[bytes] = []
        scores: list[float] = []
        offset = 4
        while offset < len(data) and (vocab_size is None or len(pieces) < vocab_size):
            token_id = len(pieces)
            if offset + 8 > len(data):
                raise WeightsError(
                    f"{path}: truncated at byte offset {offset}: token {token_id} needs an 8-byte "
                    f"(score, length) record but only {len(data) - offset} bytes remain."
                )
            score, length = struct.unpack_from("<fi", data, offset)
            if not 0 <= length <= max_token_length:
                raise WeightsError(
                    f"{path}: corrupt at byte offset {offset + 4}: token {token_id} has length "
                    f"{length}, expected 0..{max_token_length} (max_token_length)."
                )
            offset += 8
            if offset + length > len(data):
                raise WeightsError(
                    f"{path}: truncated at byte offset {offset}: token {token_id} needs {length} "
                    f"bytes but only {len(data) - offset} remain."
                )
            pieces.append(data[offset : offset + length])
            scores.append(score)
            offset += length
        if vocab_size is not None and len(pieces) != vocab_size:
            raise WeightsError(
                f"{path}: holds {len(pieces)} tokens, expected vocab_size={vocab_size} "
                f"(file ends at byte offset {offset}); tokenizer and model do not match."
            )
        if offset != len(data):
            raise WeightsError(
                f"{path}: {len(data) - offset} unexpected bytes after token {len(pieces) - 1} at "
                f"byte offset {offset}; vocab_size={vocab_size} does not match the file."
            )
        try:
            return cls(pieces, scores, max_token_length)
        except ValueError as error:
            raise WeightsError(f"{path}: {error}") from error

    @property
    def vocab_size(self) -> int:
        """Number of tokens."""
        return len(self.pieces)

    def fingerprint(self) -> str:
        """A hash of the pieces and scores (cache keys of token files)."""
        digest = hashlib.sha256()
        for piece, score in zip(self.pieces, self.scores, strict=True):
            digest.update(struct.pack("<fi", score, len(piece)) + piece)
        return digest.hexdigest()

    def id_to_piece(self, token_id: int) -> str:
        """The piece of ``token_id`` as text (a space where SentencePiece writes ``▁``)."""
        self._check_id(token_id)
        return self.pieces[token_id].decode("utf-8", errors="replace")

    def piece_to_id(self, piece: str) -> int | None:
        """The id of a (non-byte, non-special) piece, or ``None`` if it is not in the vocabulary."""
        return self._piece_to_id.get(piece.encode("utf-8"))

    @hf_encode_keywords
    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of ``text``: ``[BOS] + pieces + [EOS]`` with BOS/EOS as requested."""
        ids = self._merge(self._initial_ids(text))
        return ([BOS_TOKEN_ID] if bos else []) + ids + ([EOS_TOKEN_ID] if eos else [])

    def decode(self, ids: list[int] | Int[Tensor, " seq"]) -> str:
        """Text of ``ids``; BOS/EOS are dropped and a space right after BOS is stripped (llama2.c).

        Byte tokens are joined back into UTF-8; invalid sequences become U+FFFD.
        """
        if isinstance(ids, Tensor):
            ids = [int(i) for i in ids.tolist()]
        out = bytearray()
        previous: int | None = None
        for token_id in ids:
            self._check_id(token_id)
            if token_id in (BOS_TOKEN_ID, EOS_TOKEN_ID):
                previous = token_id
                continue
            if token_id in self._byte_of_id:
                out.append(self._byte_of_id[token_id])
            else:
                piece = self.pieces[token_id]
                if previous == BOS_TOKEN_ID and piece.startswith(b" "):
                    piece = piece[1:]
                out += piece
            previous = token_id
        return out.decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})."
            )

    def _initial_ids(self, text: str) -> list[int]:
        """One token per character, or its UTF-8 byte tokens when the character is not a piece."""
        if not text:
            return []
        ids: list[int] = []
        for char in " " + text:  # SentencePiece's dummy prefix
            encoded = char.encode("utf-8")
            token_id = self._piece_to_id.get(encoded)
            if token_id is not None:
                ids.append(token_id)
                continue
            for byte in encoded:
                fallback = self._id_of_byte.get(byte)
                ids.append(UNK_TOKEN_ID if fallback is None else fallback)
        return ids

    def _merge_candidate(self, left: int, right: int) -> tuple[float, int] | None:
        """(score, id) of the piece ``left + right``, or ``None`` if the pair cannot merge."""
        if left in self._byte_of_id or right in self._byte_of_id:
            return None
        if left == UNK_TOKEN_ID or right == UNK_TOKEN_ID:
            return None
        merged = self._piece_to_id.get(self.pieces[left] + self.pieces[right])
        return None if merged is None else (self.scores[merged], merged)

    def _merge(self, ids: list[int]) -> list[int]:
        """Apply BPE merges: best score first, leftmost pair on ties, until none applies.

        A heap over a linked list gives the same merge order as llama2.c's quadratic rescan
        (each step takes the highest-scoring adjacent pair, the leftmost on a tie) in
        O(n log n), so long texts stay fast. Merged symbols keep their left position, which
        keeps positions ordered left to right for the tie-break.
        """
        n = len(ids)
        ids = list(ids)
        next_of = list(range(1, n + 1))  # n means "end"
        prev_of = list(range(-1, n - 1))
        alive = [True] * n
        heap: list[tuple[float, int, int, int]] = []

        def push(left_pos: int) -> None:
            right_pos = next_of[left_pos]
            if right_pos >= n:
                return
            candidate = self._merge_candidate(ids[left_pos], ids[right_pos])
            if candidate is not None:
                heapq.heappush(heap, (-candidate[0], left_pos, ids[left_pos], ids[right_pos]))

        for pos in range(n - 1):
            push(pos)
        while heap:
            _, left_pos, left_id, right_id = heapq.heappop(heap)
            right_pos = next_of[left_pos]
            stale = (
                not alive[left_pos]
                or right_pos >= n
                or ids[left_pos] != left_id
                or ids[right_pos] != right_id
            )
            if stale:
                continue
            candidate = self._merge_candidate(left_id, right_id)
            assert candidate is not None  # it was a candidate when pushed, and ids are unchanged
            ids[left_pos] = candidate[1]
            alive[right_pos] = False
            next_of[left_pos] = next_of[right_pos]
            if next_of[left_pos] < n:
                prev_of[next_of[left_pos]] = left_pos
            if prev_of[left_pos] >= 0:
                push(prev_of[left_pos])
            push(left_pos)
        return [token_id for pos, token_id in enumerate(ids) if alive[pos]]
