"""`EvaluationSet`: the token sequences DCP scores, their targets and answers, and `task_data`,
the evaluation and calibration sets of a model's task."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from dcp_lens.protocol.metrics import IGNORE_INDEX
from dcp_lens.utils.checks import check_targets
from dcp_lens.utils.errors import InputError, InputTypeError

if TYPE_CHECKING:  # annotations only: a task batch is built by the tasks stage
    from dcp_lens.tasks import TaskBatch

INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass
class EvaluationSet:
    """Token sequences, the positions whose predictions are scored, and their answers.

    ``targets[i, p]`` is what the logits at position p of example i should predict, or -100 where
    position p is not scored. Build one with `from_task_batch` (task data with answers) or
    `from_tokens` (language modelling: the next token is the target; no accuracy).
    """

    tokens: Int[Tensor, "n pos"]
    targets: Int[Tensor, "n pos"]
    attention_mask: Bool[Tensor, "n pos"] | None = None
    has_answers: bool = True
    metadata: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokens = _integer_tensor(self.tokens, "tokens")
        self.targets = _integer_tensor(self.targets, "targets")
        if self.tokens.ndim != 2 or self.tokens.shape[0] == 0 or self.tokens.shape[1] == 0:
            raise InputError(
                f"the evaluation set is empty or not [n, pos]: tokens have shape "
                f"{tuple(self.tokens.shape)}; pass at least one sequence."
            )
        if self.targets.shape != self.tokens.shape:
            raise InputError(
                f"targets {tuple(self.targets.shape)} must have the shape of tokens "
                f"{tuple(self.tokens.shape)} (-100 where a position is not scored)."
            )
        for name, tensor in (("targets", self.targets), ("attention_mask", self.attention_mask)):
            if tensor is not None and tensor.device != self.tokens.device:
                raise InputError(
                    f"{name} are on {tensor.device}, tokens on {self.tokens.device}; put them on "
                    "one device (the model moves them to its own)."
                )
        if self.attention_mask is not None:
            self.attention_mask = _mask_tensor(self.attention_mask, tuple(self.tokens.shape))
        if not isinstance(self.has_answers, bool):
            raise InputTypeError(f"has_answers={self.has_answers!r} must be True or False.")
        self.metadata = _checked_metadata(self.metadata, len(self.tokens))
        check_targets(self.targets, None, "the evaluation set's targets")
        if not bool(self.scored.any()):
            raise InputError("no position is scored: every target is -100.")
        if self.attention_mask is not None and bool((self.scored & ~self.attention_mask).any()):
            raise InputError("a scored position is padding (attention_mask is False there).")

    @classmethod
    def from_task_batch(cls, batch: TaskBatch) -> EvaluationSet:
        """From a `dcp_lens.tasks.TaskBatch` (tokens, targets with -100, attention mask)."""
        metadata = dict(getattr(batch, "metadata", {}) or {})
        return cls(
            batch.tokens, batch.targets, getattr(batch, "attention_mask", None), True, metadata
        )

    @classmethod
    def from_tokens(
        cls,
        tokens: Int[Tensor, "n pos"] | np.ndarray | Sequence[Sequence[int]],
        scored_positions: Int[Tensor, "n m"]
        | np.ndarray
        | Sequence[Sequence[int | float]]
        | None = None,
    ) -> EvaluationSet:
        """Language modelling: logits at p predict tokens[p + 1]. ``scored_positions`` (indices
        in 0..pos-2 per example) restricts scoring; by default every position but the last."""
        tokens = _integer_tensor(tokens, "tokens")
        if tokens.ndim != 2 or tokens.shape[0] == 0 or tokens.shape[1] < 2:
            raise InputError(
                f"the evaluation set is empty or too short: tokens have shape "
                f"{tuple(tokens.shape)}; language modelling needs [n >= 1, pos >= 2]."
            )
        targets = torch.full_like(tokens, IGNORE_INDEX)
        if scored_positions is None:
            targets[:, :-1] = tokens[:, 1:]
        else:
            positions = _integer_tensor(scored_positions, "scored_positions").cpu()
            n_pos = tokens.shape[1]
            if positions.ndim != 2 or positions.shape[0] != tokens.shape[0]:
                raise InputError(
                    f"scored_positions must be [n={tokens.shape[0]}, m] (one row of positions "
                    f"per example), got shape {tuple(positions.shape)}."
                )
            if bool(((positions < 0) | (positions > n_pos - 2)).any()):
                bad = positions[(positions < 0) | (positions > n_pos - 2)][0].item()
                raise InputError(
                    f"scored position {bad} is outside the sequence: positions 0..{n_pos - 2} "
                    f"have a next token (sequence length {n_pos})."
                )
            positions = positions.to(tokens.device)
            rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None].expand_as(positions)
            targets[rows, positions] = tokens[rows, positions + 1]
        return cls(tokens, targets, None, has_answers=False)

    @property
    def scored(self) -> Bool[Tensor, "n pos"]:
        return self.targets != IGNORE_INDEX

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def reordered(self, order: Int[Tensor, " n"]) -> EvaluationSet:
        """The examples in the order ``order`` (a permutation of the example indices)."""
        mask = None if self.attention_mask is None else self.attention_mask[order]
        metadata = {name: value[order] for name, value in self.metadata.items()}
        tokens, targets = self.tokens[order], self.targets[order]
        return EvaluationSet(tokens, targets, mask, self.has_answers, metadata)

    def batches(self, batch_size: int) -> list[slice]:
        return [slice(i, min(i + batch_size, len(self))) for i in range(0, len(self), batch_size)]

    def example_keys(self) -> Int[Tensor, " n"]:
        """One non-negative int64 per example, a hash of its tokens up to padding: what keys an
        example's noise, probe sampling and bootstrap order, so none of them depends on the
        batch size or the order of the examples."""
        keys = [int(digest[:15], 16) for digest in self._digests()]
        return torch.tensor(keys, dtype=torch.int64)

    def _digests(self) -> list[str]:
        rows = []
        tokens = self.tokens.cpu().numpy()  # read once, not once per example
        mask = None if self.attention_mask is None else self.attention_mask.cpu().numpy()
        for i in range(len(self)):
            row = tokens[i] if mask is None else tokens[i][mask[i]]
            rows.append(hashlib.sha1(row.tobytes()).hexdigest())
        return rows

    def fingerprints(self) -> set[str]:
        """One hash per example (its tokens up to padding), to detect overlapping splits."""
        return set(self._digests())


def task_data(
    model: Any,
    task: str | None,
    n_eval: int | None,
    n_calibration: int | None,
    seed: int,
    **text_options: Any,
) -> tuple[EvaluationSet, EvaluationSet]:
    """Evaluation and calibration sets for a model: its planted task, the task it was trained on
    (``model.task_config``), or ``task`` (a task name, ``char_lm:PATH``, or ``text:PATH`` in the
    model's own tokens with ``text_options`` of `dcp_lens.tasks.text.text_task`), built with
    ``seed``. A task with its own vocabulary is refused on a model with its own tokenizer.

    Returns:
        ``(evaluation, calibration)``: ``n_eval`` and ``n_calibration`` sequences (None: 512, or
        for a text corpus `TextLM.split_sizes`) from the task's disjoint splits.
    """
    planted = getattr(model, "planted_task", None)
    if planted is not None and task is None:
        return planted.evaluation(n_eval or 512), planted.calibration(n_calibration or 512)
    from dcp_lens.tasks import Task, check_task_tokens, get_task
    from dcp_lens.tasks.text import text_task

    built: Task
    if task is not None and task.startswith("text:"):
        built = text_task(model, task.partition(":")[2], seed=seed, **text_options)
        n_eval, n_calibration = built.split_sizes(n_eval, n_calibration)
    elif task is not None:
        name, _, path = task.partition(":")
        kwargs: dict[str, str] = {"path": path} if path else {}
        built = get_task(name, seed=seed, **kwargs)
    elif getattr(model, "task_config", None):
        built = get_task(**model.task_config)
    else:
        raise ValueError(
            "this model has no task of its own; pass a task name, char_lm:PATH or text:PATH "
            "(--task)."
        )
    check_task_tokens(built, model)
    evaluation = EvaluationSet.from_task_batch(built.evaluation(n_eval or 512))
    calibration = EvaluationSet.from_task_batch(built.calibration(n_calibration or 512))
    return evaluation, calibration


def as_evaluation_set(data: object, name: str) -> EvaluationSet:
    """``data`` as an `EvaluationSet` (a `dcp_lens.tasks.TaskBatch` is converted)."""
    from dcp_lens.tasks import TaskBatch

    if isinstance(data, TaskBatch):
        return EvaluationSet.from_task_batch(data)
    if not isinstance(data, EvaluationSet):
        raise TypeError(
            f"{name} must be an EvaluationSet or a TaskBatch, got {type(data).__name__}; build "
            "one with EvaluationSet.from_task_batch(batch) or EvaluationSet.from_tokens(tokens)."
        )
    return data


def _integer_tensor(value: object, name: str) -> Tensor:
    """``value`` (a tensor, numpy array or nested list of whole numbers) as an int64 tensor on
    its device; floats with a fraction, booleans, complex values, strings and tensors without
    data (the meta device) are refused naming ``name``."""
    if isinstance(value, Tensor):
        tensor = value
    else:
        try:
            array = np.asarray(value)
        except (ValueError, TypeError) as error:  # ragged lists
            raise InputTypeError(
                f"{name} must be a tensor, numpy array or list of equal-length rows of integers; "
                f"{type(value).__name__} could not be read as one ({error})."
            ) from error
        if array.dtype.kind not in "iuf" or array.dtype == object:
            raise InputTypeError(
                f"{name} must hold integers (token ids), got a {array.dtype} array; pass a "
                "tensor or array of int64."
            )
        tensor = torch.from_numpy(array.copy())
    if tensor.device.type == "meta":
        raise InputError(
            f"{name} are on the meta device (shapes without data); pass tensors that hold values."
        )
    if tensor.dtype in INTEGER_DTYPES:
        return tensor.long()
    if tensor.dtype.is_floating_point:
        whole = bool(torch.isfinite(tensor).all()) and bool((tensor == tensor.round()).all())
        if whole and tensor.numel() and bool((tensor.abs() < 2**53).all()):
            return tensor.long()
        raise InputTypeError(
            f"{name} must hold integers (token ids, positions), got {tensor.dtype} values with a "
            "fraction or a non-finite value; pass integer tensors."
        )
    raise InputTypeError(
        f"{name} must hold integers (token ids), got {tensor.dtype}; pass an int64 tensor."
    )


def _mask_tensor(mask: object, shape: tuple[int, ...]) -> Tensor:
    """An attention mask as a boolean tensor of ``shape``: booleans, or 0 / 1 integers."""
    if not isinstance(mask, Tensor):
        mask = torch.from_numpy(np.asarray(mask).copy())
    if tuple(mask.shape) != shape:
        raise InputError(
            f"attention_mask has shape {tuple(mask.shape)}, tokens {shape}; pass one boolean per "
            "token (True where it is a real token)."
        )
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_floating_point or mask.dtype in INTEGER_DTYPES:
        if bool(((mask == 0) | (mask == 1)).all()):
            return mask.bool()
    raise InputTypeError(
        f"attention_mask must be booleans (or 0 / 1), got {mask.dtype} values other than 0 and 1."
    )


def _checked_metadata(metadata: object, n: int) -> dict[str, Tensor]:
    """Per-example metadata: a dict of tensors (or arrays, lists) whose first dimension is the
    number of examples ``n``."""
    if not isinstance(metadata, dict):
        raise InputTypeError(
            f"metadata must be a dict of per-example tensors, got {type(metadata).__name__}."
        )
    checked: dict[str, Tensor] = {}
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise InputTypeError(f"metadata key {key!r} must be a string.")
        tensor = value if isinstance(value, Tensor) else None
        if tensor is None:
            try:
                tensor = torch.as_tensor(value)
            except (ValueError, TypeError, RuntimeError) as error:
                raise InputTypeError(
                    f"metadata[{key!r}] must be a tensor, array or list of numbers, one per "
                    f"example ({error})."
                ) from error
        if tensor.ndim == 0 or tensor.shape[0] != n:
            raise InputError(
                f"metadata[{key!r}] has {tensor.shape[0] if tensor.ndim else 'no'} entries along "
                f"its first dimension, but the set has {n} examples; give one per example."
            )
        checked[key] = tensor
    return checked
