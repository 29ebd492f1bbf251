"""`RunContext`: what every stage of a DCP run shares (the model, its settings, the k grid and
metrics, progress bars and run snapshots), handed to each stage by `DepthControlProtocol`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from jaxtyping import Bool
from torch import Tensor

from dcp_lens.protocol.budget import (
    MIN_ACCELERATOR_ROWS,
    MemoryEstimate,
    ModelShape,
    ReadoutPlan,
    budget_bytes,
    estimate_with,
)
from dcp_lens.protocol.conditions import ProtocolModel
from dcp_lens.protocol.config import ProtocolConfig
from dcp_lens.protocol.evaluation_set import EvaluationSet
from dcp_lens.protocol.metrics import LOSS_METRICS
from dcp_lens.utils.memory import release_free_memory
from dcp_lens.utils.progress import progress as progress_display
from dcp_lens.utils.snapshots import Checkpoint

_Item = TypeVar("_Item")


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
    # The budget in bytes once read (`budget`): [] until then.
    _budget: list[int | None] = field(default_factory=list, init=False, repr=False)

    @property
    def r(self) -> int:
        """The model's iterations at full depth."""
        return int(self.model.n_iterations)

    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def each(self, items: Sequence[_Item], description: str) -> Iterator[_Item]:
        """``items`` with a progress bar; the heap's free pages go back to the system after
        each (`dcp_lens.utils.memory.release_free_memory`)."""
        bar = progress_display(items, desc=f"DCP {description}", enabled=self.progress, leave=False)
        for item in bar:
            yield item
            release_free_memory()

    def restore(
        self, stage: str, into: Callable[[Any], None], on: torch.device | None = None
    ) -> int:
        """Batches done of ``stage``'s last snapshot, its state loaded on ``on`` (default: the
        model's device) and handed to ``into`` (an accumulator's ``restore``); 0 without a
        snapshot (``into`` is not called)."""
        if self.checkpoint is None:
            return 0
        return self.checkpoint.restore(stage, on or self.device(), into)[0]

    def snapshot(self, stage: str, done: int, total: int, state: Callable[[], object]) -> None:
        """Snapshot ``state()`` after ``done`` of ``total`` batches of ``stage`` (when due)."""
        if self.checkpoint is not None:
            self.checkpoint.save(stage, done, total, state)

    def budget(self) -> int | None:
        """Bytes this run may use on its device (`dcp_lens.protocol.budget.budget_bytes`), read
        once, at the first stage that asks: every stage plans against the budget the run
        started with, whatever other processes take or free meanwhile."""
        if not self._budget:
            budget = self.config.memory_budget  # a float once the config is checked
            self._budget.append(
                budget_bytes(None if budget is None else float(budget), self.device())
            )
        return self._budget[0]

    def n_streams(self) -> int:
        """Conditions a calibration map is fitted from: full depth, truncate(k) and replay(k)
        for every k of the grid below r."""
        return 1 + 2 * sum(1 for k in self.k_grid if k < self.r)

    def estimate(self, data: EvaluationSet, readout_rows: int | None = None) -> MemoryEstimate:
        """This run's peak memory on batches of ``data`` (`estimate_run_memory`)."""
        return self.estimate_at(
            min(self.config.batch_size, max(1, len(data))),
            int(data.tokens.shape[1]),
            self.budget(),
            readout_rows,
        )

    def estimate_at(
        self, batch_size: int, seq_len: int, budget: int | None, readout_rows: int | None = None
    ) -> MemoryEstimate:
        """This run's peak memory on batches of ``batch_size`` x ``seq_len`` tokens under
        ``budget`` (`dcp_lens.protocol.budget.estimate_with`)."""
        return estimate_with(
            ModelShape.of(self.model),
            self.config,
            self.n_streams(),
            batch_size=batch_size,
            seq_len=seq_len,
            budget=budget,
            device_type=self.device().type,
            readout_rows=readout_rows,
        )

    def readout_plan(self, data: EvaluationSet) -> ReadoutPlan:
        """How batches of ``data`` are read out: rows per call from the budget
        (`estimate_run_memory`'s plan)."""
        batch, positions = min(self.config.batch_size, max(1, len(data))), int(data.tokens.shape[1])
        rows = self.estimate(data).plan.rows
        if self.device().type != "cpu" and self.config.memory_budget is None:
            rows = max(rows, MIN_ACCELERATOR_ROWS)
        return ReadoutPlan.of(rows, batch, positions)

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
