"""`RunContext`: what every stage of a DCP run shares (the model, its settings, the k grid and
metrics, progress bars and run snapshots), handed to each stage by `DepthControlProtocol`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool
from torch import Tensor
from tqdm.auto import tqdm

from dcp_lens.protocol.conditions import ProtocolModel
from dcp_lens.protocol.config import ProtocolConfig
from dcp_lens.protocol.evaluation_set import EvaluationSet
from dcp_lens.protocol.metrics import LOSS_METRICS
from dcp_lens.utils.memory import release_free_memory
from dcp_lens.utils.snapshots import Checkpoint


@dataclass
class RunContext:
    """The model and settings of one protocol, shared by its stages.

    Attributes:
        model: the model the protocol runs on.
        config: its settings.
        k_grid: ``config``'s grid on this model (`ProtocolConfig.grid`).
        metrics: the metrics scored: ``config.metrics``, else (once the evaluation set is known)
            every registered metric it defines.
        progress: whether to show progress bars.
        checkpoint: where the stages snapshot and resume from (None: no snapshots).
    """

    model: ProtocolModel
    config: ProtocolConfig
    k_grid: tuple[int, ...]
    metrics: tuple[str, ...]
    progress: bool = True
    checkpoint: Checkpoint | None = None

    @property
    def r(self) -> int:
        """The model's iterations at full depth."""
        return int(self.model.n_iterations)

    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def each(self, items: Sequence[Any], description: str) -> Iterator[Any]:
        """``items`` with a progress bar; the heap's free pages go back to the system after
        each (`dcp_lens.utils.memory.release_free_memory`)."""
        for item in tqdm(items, desc=f"DCP {description}", disable=not self.progress, leave=False):
            yield item
            release_free_memory()

    def restore(self, stage: str) -> tuple[int, Any]:
        """Batches done and state of ``stage``'s last snapshot; ``(0, None)`` without one."""
        if self.checkpoint is None:
            return 0, None
        return self.checkpoint.restore(stage, self.device())

    def snapshot(self, stage: str, done: int, total: int, state: Any) -> None:
        if self.checkpoint is not None:
            self.checkpoint.save(stage, done, total, state)

    def pooled_positions(self, data: EvaluationSet, rows: slice) -> Bool[Tensor, "batch pos"]:
        """Positions pooled into the calibration statistics: every real (non-padding) token."""
        tokens = data.tokens[rows]
        keep = torch.ones_like(tokens, dtype=torch.bool)
        if data.attention_mask is not None:
            keep &= data.attention_mask[rows]
        if self.config.skip_first_position:
            keep[:, 0] = False
        return keep.to(self.device())

    def matches_confidence(self) -> bool:
        """Whether loss metrics are scored at matched confidence (and temperatures fitted)."""
        return self.config.match_confidence and bool(set(self.metrics) & set(LOSS_METRICS))

    def noise_draws(self) -> int:
        """Evaluations averaged per example: ``config.noise_draws`` with a noisy initial state."""
        noisy = getattr(getattr(self.model, "cfg", None), "state_init", "zeros") in (
            "normal",
            "huginn",
        )
        return self.config.noise_draws if noisy else 1
