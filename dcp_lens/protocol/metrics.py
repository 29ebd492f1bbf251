"""The quality measures of a readout, one implementation each.

``IGNORE_INDEX`` marks positions that are not scored (as PyTorch's ``ignore_index``). Everything
that scores logits against targets (training losses, the protocol's per-example metrics, the
retrofit's distillation) goes through `token_cross_entropy` (`dcp_lens.model.loss`, where the
model's own loss lives), so cross-entropy is spelled once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from dcp_lens.model.loss import (  # re-exported: the metrics score with the model's losses
    IGNORE_INDEX as IGNORE_INDEX,
)
from dcp_lens.model.loss import next_token_loss as next_token_loss
from dcp_lens.model.loss import next_token_targets as next_token_targets
from dcp_lens.model.loss import scored_cross_entropy as scored_cross_entropy
from dcp_lens.model.loss import token_cross_entropy as token_cross_entropy
from dcp_lens.utils.registry import add_entry


@dataclass(frozen=True)
class Metric:
    """One quality measure of a readout: how it scores one batch and how to read it.

    Register one with `register_metric`; every name list of metrics (`METRICS`,
    `HIGHER_IS_BETTER`, `LOSS_METRICS`, `NEEDS_ANSWERS`, `VALIDATION`) is a live view of the
    registry, so a registered metric is swept, decomposed and rendered with no other change.

    Attributes:
        name: the metric's name in results and on the command line.
        score: ``score(readout)`` -> ``[batch]``, the metric averaged over each example's scored
            positions (`Readout.mean`).
        higher_is_better: True for a quality (accuracy), False for a loss (cross-entropy).
        needs_answers: whether it reads the targets (an evaluation set without answers drops it).
        validated: whether `dcp-lens validate` recovers the planted factors with it.
        validation_reason: why (shown beside the metric in results and the report).
    """

    name: str
    score: Callable[[Readout], Float[Tensor, " batch"]]
    higher_is_better: bool
    needs_answers: bool = False
    validated: bool = False
    validation_reason: str = "not checked by `dcp-lens validate`"


METRIC_REGISTRY: dict[str, Metric] = {}


def register_metric(metric: Metric) -> Metric:
    """Add ``metric`` to `METRIC_REGISTRY` (a second entry under a taken name is refused)."""
    return add_entry(METRIC_REGISTRY, metric.name, metric, "metric")


class _Names(Sequence[str]):
    """The names of the registered metrics that pass ``keep``, read live from the registry."""

    def __init__(self, keep: Callable[[Metric], bool] = lambda metric: True) -> None:
        self._keep = keep

    def _names(self) -> tuple[str, ...]:
        return tuple(name for name, metric in METRIC_REGISTRY.items() if self._keep(metric))

    def __getitem__(self, index: Any) -> Any:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __add__(self, other: Any) -> tuple[str, ...]:
        return self._names() + tuple(other)

    def __eq__(self, other: object) -> bool:
        return self._names() == (tuple(other) if isinstance(other, Sequence) else other)

    def __hash__(self) -> int:
        return hash(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


class _Field(Mapping[str, Any]):
    """Metric name -> one attribute of the registered metric (a live view)."""

    def __init__(self, get: Callable[[Metric], Any]) -> None:
        self._get = get

    def __getitem__(self, name: str) -> Any:
        return self._get(METRIC_REGISTRY[name])

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(METRIC_REGISTRY))

    def __len__(self) -> int:
        return len(METRIC_REGISTRY)

    def __repr__(self) -> str:
        return repr(dict(self))


# The registered metrics' names, in registration order.
METRICS: Sequence[str] = _Names()
HIGHER_IS_BETTER: Mapping[str, bool] = _Field(lambda metric: metric.higher_is_better)
# Metrics that need the answers (targets); the others are label-free.
NEEDS_ANSWERS: Sequence[str] = _Names(lambda metric: metric.needs_answers)
LOSS_METRICS: Sequence[str] = _Names(lambda metric: not metric.higher_is_better)
# Whether each metric attributes the planted factors correctly (`dcp-lens validate`: every
# planted model's factor >= 0.9 of the gap, every mixture within 0.1 of its stated shares).
VALIDATION: Mapping[str, tuple[bool, str]] = _Field(
    lambda metric: (metric.validated, metric.validation_reason)
)


def metric_precision(logits: Tensor) -> Tensor:
    """``logits`` in float32 at least: metrics of a float16 / bfloat16 model are computed from
    upcast logits, so a log-softmax or a KL never rounds in the model's precision."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def reference_log_probs(
    full_logits: Float[Tensor, "batch pos d_vocab"],
) -> Float[Tensor, "batch pos d_vocab"]:
    """Full-depth log-probabilities, the reference of ``kl_to_full``, in `metric_precision`."""
    return metric_precision(full_logits).log_softmax(-1)


class Readout:
    """One batch of a readout's logits against full depth, what every `Metric` scores.

    What several metrics share (the log-softmax, the top-1 prediction's largest logit and ties,
    full depth's top-1 and probabilities) is computed once, on first use. Everything is in
    `metric_precision`.
    """

    def __init__(
        self,
        logits: Float[Tensor, "batch pos d_vocab"],
        full_log_probs: Float[Tensor, "batch pos d_vocab"],
        targets: Int[Tensor, "batch pos"],
        full_top1: Int[Tensor, "batch pos"] | None = None,
        full_probs: Float[Tensor, "batch pos d_vocab"] | None = None,
    ) -> None:
        self.logits = metric_precision(logits)
        self.full_log_probs = metric_precision(full_log_probs)
        self.targets = targets
        self.scored = targets != IGNORE_INDEX
        self.count = self.scored.sum(-1).clamp(min=1).to(self.logits.dtype)
        self._full_top1 = full_top1
        self._full_probs = full_probs

    @cached_property
    def log_probs(self) -> Float[Tensor, "batch pos d_vocab"]:
        """The readout's log-softmax (the costliest pass over the logits, taken once)."""
        return self.logits.log_softmax(-1)

    @cached_property
    def _top(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """What the top-1 hits read: the largest logit ``[batch, pos]``, whether all logits are
        finite ``[batch, pos]``, where the largest is tied ``[batch, pos]``, and the argmax of
        the tied positions only ``[n_tied]``."""
        # PyTorch's CPU max with indices (and argmax) is much slower than amax, a
        # fast enough pass to take twice: the largest, then the number of logits below it (the
        # sum of the signs of logit - largest, -1 below and 0 at a tie). Where the largest is
        # unique, a reference is the prediction exactly when its logit is the largest; only
        # tied positions need the argmax (the first index among tied maxima), taken on those
        # rows alone. A difference rounds to 0 only at equal logits (no flush to zero), and if
        # it did, the position would only be sent to the exact argmax.
        largest = self.logits.amax(-1, keepdim=True)
        below = (self.logits - largest).sign_().sum(-1)
        largest = largest.squeeze(-1)
        # All logits are finite exactly when the largest and the smallest are (amax and amin
        # propagate NaN): two reductions, not a mask of the logits.
        finite = torch.isfinite(largest) & torch.isfinite(self.logits.amin(-1))
        tied = finite & (below + self.logits.shape[-1] > 1.5)
        return largest, finite, tied, self.logits[tied].argmax(-1)

    def hits(self, reference: Int[Tensor, "batch pos"]) -> Bool[Tensor, "batch pos"]:
        """Whether the top-1 prediction (the argmax: the first index among tied maxima) is
        ``reference`` at each position; False where ``reference`` is no class (IGNORE_INDEX)."""
        largest, _, tied, tied_top = self._top
        vocabulary = self.logits.shape[-1]
        is_class = (reference >= 0) & (reference < vocabulary)
        index = reference.clamp(0, vocabulary - 1).unsqueeze(-1)
        hit = is_class & (self.logits.gather(-1, index).squeeze(-1) == largest)
        if tied_top.numel():
            hit[tied] = tied_top == reference[tied]
        return hit

    @property
    def full_top1(self) -> Int[Tensor, "batch pos"]:
        if self._full_top1 is None:
            self._full_top1 = self.full_log_probs.argmax(-1)
        return self._full_top1

    @property
    def full_probs(self) -> Float[Tensor, "batch pos d_vocab"]:
        if self._full_probs is None:
            self._full_probs = self.full_log_probs.exp()
        return self._full_probs

    def mean(self, values: Float[Tensor, "batch pos"]) -> Float[Tensor, " batch"]:
        """``values`` averaged over each example's scored positions."""
        return (values * self.scored).sum(-1) / self.count

    def hit_rate(self, reference: Int[Tensor, "batch pos"]) -> Float[Tensor, " batch"]:
        """The share of scored positions whose prediction is ``reference``; NaN for an example
        with a non-finite readout at a scored position (it has no prediction)."""
        finite = self._top[1]
        hit = torch.where(finite, self.hits(reference).to(self.logits.dtype), torch.nan)
        bad = (torch.isnan(hit) & self.scored).any(-1)
        return torch.where(bad, torch.nan, (hit * self.scored).nansum(-1) / self.count)


def _cross_entropy(readout: Readout) -> Tensor:
    losses = token_cross_entropy(readout.log_probs, readout.targets, log_probs=True)
    return readout.mean(losses)


def _kl_to_full(readout: Readout) -> Tensor:
    # KL(full || readout) = sum p_full (log p_full - log p), as F.kl_div(log_target=True)
    # computes it, with p_full = exp(log p_full) taken once per batch rather than per call.
    # The difference first: near full depth, where the protocol's comparisons sit, it is
    # exact where sum p log p_full - sum p log p would lose the small KL to cancellation.
    difference = readout.full_log_probs - readout.log_probs
    kl = (metric_precision(readout.full_probs) * difference).sum(-1)
    kl = kl.clamp_min(0.0)  # KL >= 0: a negative sum is rounding, not a value (NaN stays)
    return readout.mean(kl)


_VALIDATED = "planted factors recovered by `dcp-lens validate` (seeds 0 and 1)"
register_metric(
    Metric(
        "accuracy",
        lambda readout: readout.hit_rate(readout.targets),
        higher_is_better=True,
        needs_answers=True,
        validated=True,
        validation_reason=_VALIDATED,
    )
)
register_metric(
    Metric(
        "top1_agreement",
        lambda readout: readout.hit_rate(readout.full_top1),
        higher_is_better=True,
        validated=True,
        validation_reason="label-free: agreement with the full-depth top-1 prediction; "
        + _VALIDATED,
    )
)
register_metric(
    Metric(
        "cross_entropy",
        _cross_entropy,
        higher_is_better=False,
        needs_answers=False,
        validated=False,
        validation_reason="fails `dcp-lens validate`'s bracket rule (3-6 of 17 planted rows pass "
        "at seeds 0 and 1, S flagged on 71-73% of identifiable k's): the S bracket is wide on "
        "every readout shift (the repair up to the base rate is ambiguous), and confidence "
        "rescaling books 0.23-0.27 of block_count's gap as S inside a narrow bracket",
    )
)
register_metric(
    Metric(
        "kl_to_full",
        _kl_to_full,
        higher_is_better=False,
        validated=False,
        validation_reason="fails `dcp-lens validate`'s bracket rule (5-7 of 17 planted rows pass "
        "at seeds 0 and 1, S flagged on 66-74% of identifiable k's): the S bracket is wide on "
        "every readout shift (the repair up to the base rate is ambiguous), and confidence "
        "rescaling books 0.08-0.17 of block_count's gap as S inside a narrow bracket",
    )
)


def per_example_metrics(
    logits: Float[Tensor, "batch pos d_vocab"],
    full_log_probs: Float[Tensor, "batch pos d_vocab"],
    targets: Int[Tensor, "batch pos"],
    metrics: Sequence[str],
    full_top1: Int[Tensor, "batch pos"] | None = None,
    full_probs: Float[Tensor, "batch pos d_vocab"] | None = None,
) -> dict[str, Float[Tensor, " batch"]]:
    """Each metric averaged over an example's scored positions: [batch] per metric.

    ``full_log_probs`` are the full-depth log-probabilities (`reference_log_probs`), the reference
    of ``kl_to_full``; ``full_top1`` their argmax, the reference of ``top1_agreement`` (computed
    here when None; a sweep passes it once for every condition), and ``full_probs``
    ``full_log_probs.exp()`` (likewise). Everything is computed in `metric_precision` (float32 at
    least, whatever the model computes in). A non-finite readout has no prediction: its accuracy
    is NaN, never the argmax of NaNs. Each metric is scored by its `METRIC_REGISTRY` entry.
    """
    readout = Readout(logits, full_log_probs, targets, full_top1, full_probs)
    unknown = [name for name in metrics if name not in METRIC_REGISTRY]
    if unknown:
        raise ValueError(f"metrics {unknown} are not registered; expected some of {METRICS}.")
    return {name: METRIC_REGISTRY[name].score(readout) for name in metrics}
