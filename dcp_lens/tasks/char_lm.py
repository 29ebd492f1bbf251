"""Character-level language modelling on a text file.

The file is cut into three contiguous regions, train | calibration | evaluation (by default
90% / 5% / 5% of its characters). A window is ``n_ctx + 1`` consecutive characters inside one
region (the inputs and, shifted by one, their next characters), so windows of different splits
come from disjoint character ranges. Every position is scored; accuracy is next-character top-1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from dcp_lens.tasks.base import (
    SPLITS,
    Split,
    Task,
    TaskBatch,
    check_batch_request,
    check_split,
    check_split_fractions,
    example_rng,
)


@dataclass
class CharLM(Task):
    """Next-character prediction on windows of a UTF-8 text file.

    Args:
        path: the text file.
        n_ctx: characters per window (inputs); each window reads ``n_ctx + 1`` characters.
        seed: the task seed; window ``i`` of a split depends only on ``(seed, split, i)``.
        split_fractions: shares of the file, in order, for (train, calibration, evaluation).

    The vocabulary is the sorted set of characters in the file, nothing else (no padding, no BOS).
    Batch metadata: ``"start"``, ``[batch]``, the character offset of each window in the file.
    """

    name: ClassVar[str] = "char_lm"

    path: str | Path
    n_ctx: int = 128
    seed: int = 0
    split_fractions: Sequence[float] = (0.9, 0.05, 0.05)

    _vocab: list[str] = field(init=False, repr=False, compare=False)
    _ids: dict[str, int] = field(init=False, repr=False, compare=False)
    _data: Tensor = field(init=False, repr=False, compare=False)
    _regions: dict[str, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.path = str(self.path)
        if not Path(self.path).is_file():
            raise ValueError(f"path={self.path!r} is not a file; pass the path of a text file.")
        if self.n_ctx < 1:
            raise ValueError(f"n_ctx={self.n_ctx} must be >= 1 (characters per window).")
        self.split_fractions = check_split_fractions(self.split_fractions)

        text = Path(self.path).read_text(encoding="utf-8")
        # UTF-32 gives one code point per character; sorted code points are the sorted characters.
        code_points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        alphabet = np.unique(code_points)
        self._vocab = [chr(c) for c in alphabet.tolist()]
        self._ids = {char: i for i, char in enumerate(self._vocab)}
        self._data = torch.from_numpy(np.searchsorted(alphabet, code_points).astype(np.int64))

        cuts = np.cumsum([0.0, *self.split_fractions])
        bounds = [round(c * len(text)) for c in cuts]
        self._regions = {s: (bounds[i], bounds[i + 1]) for i, s in enumerate(SPLITS)}
        for split, (start, end) in self._regions.items():
            if end - start < self.n_ctx + 1:
                raise ValueError(
                    f"n_ctx={self.n_ctx} is too long for the {split} region of {self.path!r}: it "
                    f"has {end - start} characters and a window needs n_ctx + 1. Lower n_ctx to "
                    f"at most {end - start - 1} or give {split} a larger split fraction."
                )

    @property
    def vocab(self) -> list[str]:
        """The characters of the file, sorted."""
        return self._vocab

    @property
    def n_chars(self) -> int:
        """Characters in the file."""
        return self._data.shape[0]

    def region(self, split: Split) -> tuple[int, int]:
        """The ``[start, end)`` character range of ``split``; its windows lie inside it."""
        return self._regions[check_split(split)]

    def encode(self, text: str) -> list[int]:
        """One token id per character."""
        try:
            return [self._ids[char] for char in text]
        except KeyError as error:
            raise ValueError(
                f"character {error.args[0]!r} does not occur in {self.path!r}, so it has no token."
            ) from None

    def decode(self, ids: Sequence[int] | Int[Tensor, " pos"]) -> str:
        """The characters of token ids."""
        values = ids.tolist() if isinstance(ids, Tensor) else ids
        return "".join(self._vocab[i] for i in values)

    def batch(self, split: Split, n: int, *, offset: int = 0) -> TaskBatch:
        """Windows ``offset .. offset + n - 1`` of ``split``: tokens, targets ``[n, n_ctx]``,
        every position scored, ``metadata["start"]`` ``[n]``."""
        check_batch_request(split, n, offset, self.n_ctx)
        start, end = self._regions[split]
        last_start = end - (self.n_ctx + 1)
        starts = torch.tensor(
            [
                example_rng(self.seed, split, i).randint(start, last_start)
                for i in range(offset, offset + n)
            ],
            dtype=torch.long,
        )
        window = self._data[starts[:, None] + torch.arange(self.n_ctx + 1)]
        return TaskBatch.next_token(
            window, split, torch.arange(offset, offset + n), metadata={"start": starts}
        )

    def describe(self) -> str:
        """A one-line description for reports."""
        fractions = "/".join(f"{f:g}" for f in self.split_fractions)
        return (
            f"character LM on {Path(self.path).name} ({self.n_chars} characters, "
            f"{self.d_vocab} symbols), windows of {self.n_ctx}, splits {fractions}, "
            f"seed {self.seed}"
        )
