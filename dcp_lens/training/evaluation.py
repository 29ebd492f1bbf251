"""Held-out accuracy of a trained model per hop count h and per iteration count k."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.tasks import SPLITS, Split, Task
from dcp_lens.training.regimes import readout_logits


class OverallAccuracy(TypedDict):
    """One k's accuracy over every query, as ``accuracy_table.json`` writes it."""

    k: int
    accuracy: float


class HopsAccuracy(TypedDict):
    """The accuracy at one (h, k) and the number of queries with h hops."""

    hops: int
    k: int
    accuracy: float
    queries: int


class AccuracyRecord(TypedDict):
    """`AccuracyTable.to_dict`: the table as ``accuracy_table.json`` holds it."""

    split: str
    n_programs: int
    full_depth: int
    k_values: list[int]
    overall: list[OverallAccuracy]
    rows: list[HopsAccuracy]


@dataclass
class AccuracyTable:
    """Held-out top-1 accuracy per hop count h and per iteration count k.

    Attributes:
        k_values: the iteration counts read out (layer counts for a dense model).
        overall: k -> accuracy over every query.
        by_hops: h -> k -> accuracy over queries of h hops (empty for tasks without hops).
        queries_per_hop: h -> number of queries of h hops.
        n_programs: programs evaluated (first ``n_programs`` of ``split``).
        split: the split evaluated.
        full_depth: r (or the number of layers of a dense model).
    """

    k_values: list[int]
    overall: dict[int, float]
    by_hops: dict[int, dict[int, float]]
    queries_per_hop: dict[int, int]
    n_programs: int
    split: str
    full_depth: int

    def at(self, hops: int, k: int) -> float:
        """Accuracy at h = ``hops`` and k (NaN when no query has that many hops)."""
        return self.by_hops.get(hops, {}).get(k, math.nan)

    def to_dict(self) -> AccuracyRecord:
        """JSON-ready: long-format rows ``{"hops", "k", "accuracy", "queries"}``."""
        return {
            "split": self.split,
            "n_programs": self.n_programs,
            "full_depth": self.full_depth,
            "k_values": list(self.k_values),
            "overall": [{"k": k, "accuracy": self.overall[k]} for k in self.k_values],
            "rows": [
                {"hops": h, "k": k, "accuracy": acc, "queries": self.queries_per_hop[h]}
                for h, per_k in sorted(self.by_hops.items())
                for k, acc in per_k.items()
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AccuracyTable:
        by_hops: dict[int, dict[int, float]] = {}
        queries: dict[int, int] = {}
        for row in data["rows"]:
            by_hops.setdefault(int(row["hops"]), {})[int(row["k"])] = float(row["accuracy"])
            queries[int(row["hops"])] = int(row["queries"])
        return cls(
            k_values=[int(k) for k in data["k_values"]],
            overall={int(r["k"]): float(r["accuracy"]) for r in data["overall"]},
            by_hops=by_hops,
            queries_per_hop=queries,
            n_programs=int(data["n_programs"]),
            split=str(data["split"]),
            full_depth=int(data["full_depth"]),
        )


@torch.no_grad()
def evaluate_accuracy(
    model: HookedRecurrentTransformer,
    task: Task,
    n: int,
    k_values: Sequence[int] | None = None,
    *,
    split: Split = "evaluation",
    batch_size: int = 128,
    max_hops: int | None = None,
) -> AccuracyTable:
    """Accuracy of ``truncate(k)`` per hop count and per k on the first ``n`` programs of
    ``split``, with one forward pass per chunk of programs (k may exceed r on a recurrent model;
    on a dense model k counts layers). ``k_values`` defaults to 1..full depth; ``max_hops``
    overrides the task's chain length (tasks that have one)."""
    full_depth = model.cfg.n_layers if model.is_dense else model.cfg.n_iterations
    ks = list(range(1, full_depth + 1)) if k_values is None else [int(k) for k in k_values]
    if not ks or min(ks) < 1 or (model.is_dense and max(ks) > full_depth):
        raise ValueError(
            f"k_values={ks} must be non-empty, >= 1, and <= {full_depth} on a dense model."
        )
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}.")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct_total = torch.zeros(len(ks), dtype=torch.long)
    n_total = 0
    correct_by_hops: dict[int, torch.Tensor] = {}
    queries_by_hops: dict[int, int] = {}
    extra = {} if max_hops is None else {"max_hops": max_hops}
    try:
        for start in range(0, n, batch_size):
            batch = task.batch(split, min(batch_size, n - start), offset=start, **extra)
            logits = readout_logits(model, batch.tokens.to(device), ks)
            correct = torch.stack([batch.correct(each).cpu() for each in logits])  # [k, b, a]
            correct_total += correct.flatten(1).sum(1)
            n_total += correct[0].numel()
            hops = batch.metadata.get("hops")
            if hops is None:
                continue
            for h in hops.unique().tolist():
                mask = hops == h
                correct_by_hops[h] = correct_by_hops.get(h, 0) + correct[:, mask].sum(1)
                queries_by_hops[h] = queries_by_hops.get(h, 0) + int(mask.sum())
    finally:
        model.train(was_training)
    return AccuracyTable(
        k_values=ks,
        overall={k: float(c) / n_total for k, c in zip(ks, correct_total.tolist(), strict=True)},
        by_hops={
            h: {
                k: float(c) / queries_by_hops[h]
                for k, c in zip(ks, correct_by_hops[h].tolist(), strict=True)
            }
            for h in sorted(correct_by_hops)
        },
        queries_per_hop=dict(sorted(queries_by_hops.items())),
        n_programs=n,
        split=split,
        full_depth=full_depth,
    )
