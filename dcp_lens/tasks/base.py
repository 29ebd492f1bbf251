"""What every task shares: the `Task` interface, the `TaskBatch` it returns, and the splits.

A task is deterministic from its parameters and ``seed``: example ``i`` of a split is a pure
function of ``(seed, split, i)``, so ``task.batch("evaluation", n)`` is the same fixed set in
every process, ``evaluation(200)`` starts with ``evaluation(100)``, and a training loop draws
fresh examples with ``task.batch("train", n, offset=step * n)``. The three splits never share
an example (each task says how it guarantees that).
"""

from __future__ import annotations

import dataclasses
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

Split = Literal["train", "calibration", "evaluation"]
SPLITS: tuple[Split, ...] = ("train", "calibration", "evaluation")


def check_split(split: str) -> Split:
    """Return ``split`` unchanged if it names a split; raise a ValueError naming it otherwise."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}; pick one of those strings.")
    return split  # type: ignore[return-value]


def check_split_fractions(fractions: Sequence[float]) -> tuple[float, float, float]:
    """Validate (train, calibration, evaluation) fractions: three positive numbers summing to 1."""
    values = tuple(float(f) for f in fractions)
    if len(values) != 3 or min(values) <= 0 or abs(sum(values) - 1.0) > 1e-6:
        raise ValueError(
            f"split_fractions={tuple(fractions)!r} must be three positive fractions "
            "(train, calibration, evaluation) that sum to 1, e.g. (0.9, 0.05, 0.05)."
        )
    return values  # type: ignore[return-value]


def example_rng(seed: int, split: Split, index: int) -> random.Random:
    """The random stream of example ``index`` of ``split`` (string seeds are stable across runs)."""
    return random.Random(f"{seed}/{split}/{index}")


@dataclass
class TaskBatch:
    """A batch of examples, with the positions whose predictions are scored.

    Position convention: the logits at position ``p`` predict ``targets[p]``, the token at
    ``p + 1`` (or, for the last position of a character window, the character after it).

    Attributes:
        tokens: the input tokens, ``[batch, pos]`` with ``pos == task.n_ctx``; padding (if the
            task pads) only at the end of a row.
        targets: ``[batch, pos]``, the next token at scored positions and ``IGNORE_INDEX`` (-100)
            everywhere else, so ``F.cross_entropy(logits.flatten(0, 1), targets.flatten())``
            is the task loss.
        scored: ``[batch, pos]``, True exactly where ``targets != IGNORE_INDEX``; never padding.
        attention_mask: ``[batch, pos]``, True on real tokens and False on padding (TransformerLens
            convention, 1 = attend). Padding is at the end, so with causal attention no real token
            ever attends to padding.
        answer_positions: ``[batch, answer]``, for every answer of every example the position whose
            logits predict it (sorted along ``answer``).
        answers: ``[batch, answer]``, ``targets`` gathered at ``answer_positions``. Accuracy is
            the share of ``(example, answer)`` pairs whose top-1 prediction equals the answer.
        metadata: per-example or per-answer tensors, each with leading dim ``batch`` (the task
            documents its keys, e.g. ``"hops"``: ``[batch, answer]`` for variable binding).
        split: the split the examples come from.
        indices: ``[batch]``, the index of each example within its split.
    """

    tokens: Int[Tensor, "batch pos"]
    targets: Int[Tensor, "batch pos"]
    scored: Bool[Tensor, "batch pos"]
    attention_mask: Bool[Tensor, "batch pos"]
    answer_positions: Int[Tensor, "batch answer"]
    answers: Int[Tensor, "batch answer"]
    split: Split
    indices: Int[Tensor, " batch"]
    metadata: dict[str, Tensor] = field(default_factory=dict)

    @classmethod
    def next_token(
        cls,
        stream: Int[Tensor, "batch pos_plus_1"],
        split: Split,
        indices: Int[Tensor, " batch"],
        metadata: dict[str, Tensor],
    ) -> TaskBatch:
        """Language modelling on windows of a token stream: every position predicts the next."""
        tokens, targets = stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
        return cls(
            tokens=tokens,
            targets=targets,
            scored=torch.ones_like(tokens, dtype=torch.bool),
            attention_mask=torch.ones_like(tokens, dtype=torch.bool),
            answer_positions=torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1),
            answers=targets.clone(),
            split=split,
            indices=indices,
            metadata=metadata,
        )

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def to(self, device: torch.device | str) -> TaskBatch:
        """A copy with every tensor (metadata included) on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        metadata = {key: value.to(device) for key, value in self.metadata.items()}
        return dataclasses.replace(self, **moved, metadata=metadata)

    def answer_logits(
        self, logits: Float[Tensor, "batch pos d_vocab"]
    ) -> Float[Tensor, "batch answer d_vocab"]:
        """The logits at every answer position: ``[batch, answer, d_vocab]``."""
        index = self.answer_positions.to(logits.device)[..., None].expand(-1, -1, logits.shape[-1])
        return logits.gather(1, index)

    def correct(self, logits: Float[Tensor, "batch pos d_vocab"]) -> Bool[Tensor, "batch answer"]:
        """Whether the top-1 prediction at each answer position is right: ``[batch, answer]``."""
        return self.answer_logits(logits).argmax(-1) == self.answers.to(logits.device)


class Task(ABC):
    """A deterministic source of examples with disjoint train / calibration / evaluation splits.

    Subclasses are dataclasses whose fields are their parameters (so ``to_dict`` round-trips
    through ``get_task(**task.to_dict())``), and set ``name``, ``vocab`` and ``n_ctx``.
    """

    name: ClassVar[str]
    # True for tasks in the model's own token ids (text); False for tasks with their own vocabulary.
    uses_model_tokenizer: ClassVar[bool] = False
    seed: int
    n_ctx: int

    @property
    @abstractmethod
    def vocab(self) -> list[str]:
        """The token strings; token id ``i`` is ``vocab[i]``."""

    @property
    def d_vocab(self) -> int:
        """Number of tokens, ``len(vocab)``."""
        return len(self.vocab)

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; a ValueError names any symbol outside the vocabulary."""

    @abstractmethod
    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """The text of token ids (inverse of ``encode``)."""

    @abstractmethod
    def batch(self, split: Split, n: int, *, offset: int = 0) -> TaskBatch:
        """Examples ``offset .. offset + n - 1`` of ``split``; tensors are ``[n, n_ctx]``."""

    @abstractmethod
    def describe(self) -> str:
        """A one-line description for reports."""

    def calibration(self, n: int) -> TaskBatch:
        """The first ``n`` calibration examples (a fixed set for a given seed)."""
        return self.batch("calibration", n)

    def evaluation(self, n: int) -> TaskBatch:
        """The first ``n`` evaluation examples (a fixed set for a given seed)."""
        return self.batch("evaluation", n)

    def to_dict(self) -> dict[str, object]:
        """Name and parameters, JSON-ready: ``get_task(**task.to_dict())`` rebuilds the task."""
        assert dataclasses.is_dataclass(self), "tasks are dataclasses"
        params = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        params = {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}
        return {"name": self.name, **params}


def check_task_tokens(task: Task, model: Any) -> None:
    """Refuse a task whose token ids mean nothing to ``model``.

    Raises:
        ValueError: the task numbers symbols by its own vocabulary (``char_lm``, variable
            binding) but the model has its own tokenizer, or the task's ids exceed the model's
            vocabulary.
    """
    tokenizer = getattr(model, "tokenizer", None)
    # A tokenizer of the task's own symbols (a bundled model's) numbers them as the task does.
    same_symbols = getattr(tokenizer, "symbols", None) == list(task.vocab)
    if tokenizer is not None and not task.uses_model_tokenizer and not same_symbols:
        raise ValueError(
            f"task {task.name!r} numbers its symbols by its own vocabulary ({task.d_vocab} "
            f"symbols), but this model has its own tokenizer ({type(tokenizer).__name__}, "
            f"{len(tokenizer)} tokens): its token ids would mean other tokens to the model. "
            "Use --task text:PATH to read the file in the model's own tokens."
        )
    d_vocab = model.cfg.d_vocab
    if task.d_vocab > d_vocab:
        raise ValueError(
            f"task {task.describe()} has {task.d_vocab} tokens, more than the model's "
            f"d_vocab={d_vocab}."
        )


def check_batch_request(split: str, n: int, offset: int, n_ctx: int | None = None) -> Split:
    """Validate the arguments of `Task.batch` (with ``n_ctx``: that its tokens, targets and
    mask fit this machine's memory, before they are built); return the split."""
    if n < 1:
        raise ValueError(f"n={n} must be >= 1 (the number of examples in the batch).")
    if offset < 0:
        raise ValueError(f"offset={offset} must be >= 0 (the index of the first example).")
    if n_ctx is not None:
        from dcp_lens.utils.bounds import check_allocation

        check_allocation(
            n * n_ctx * 8 * 4,
            f"{n:,} sequences of n_ctx={n_ctx:,} tokens",
            "lower the number of sequences or the task's n_ctx",
        )
    return check_split(split)
