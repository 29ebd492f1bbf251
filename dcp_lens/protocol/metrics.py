"""The quality measures of a readout, one implementation each.

``IGNORE_INDEX`` marks positions that are not scored (as PyTorch's ``ignore_index``). Everything
that scores logits against targets (training losses, the protocol's per-example metrics, the
retrofit's distillation) goes through `token_cross_entropy` (`dcp_lens.model.loss`, where the
model's own loss lives), so cross-entropy is spelled once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from dcp_lens.model.loss import (  # re-exported: the metrics score with the model's losses
    IGNORE_INDEX as IGNORE_INDEX,
)
from dcp_lens.model.loss import next_token_loss as next_token_loss
from dcp_lens.model.loss import next_token_targets as next_token_targets
from dcp_lens.model.loss import scored_cross_entropy as scored_cross_entropy
from dcp_lens.model.loss import token_cross_entropy as token_cross_entropy

METRICS = ("accuracy", "top1_agreement", "cross_entropy", "kl_to_full")
HIGHER_IS_BETTER = {
    "accuracy": True,
    "top1_agreement": True,
    "cross_entropy": False,
    "kl_to_full": False,
}
# Metrics that need the answers (targets); the others are label-free.
NEEDS_ANSWERS = ("accuracy",)
LOSS_METRICS = tuple(name for name in METRICS if not HIGHER_IS_BETTER[name])

# Whether each metric attributes the planted factors correctly (`dcp-lens validate`: every
# planted model's factor >= 0.9 of the gap, every mixture within 0.1 of its stated shares).
VALIDATION: dict[str, tuple[bool, str]] = {
    "accuracy": (True, "planted factors recovered by `dcp-lens validate` (seeds 0 and 1)"),
    "top1_agreement": (
        True,
        "label-free: agreement with the full-depth top-1 prediction; planted factors recovered "
        "by `dcp-lens validate` (seeds 0 and 1)",
    ),
    "cross_entropy": (
        False,
        "fails `dcp-lens validate` even at matched confidence: books 0.24 of planted "
        "block_count's gap as S, and misses mixtures and type-dependent shifts by > 0.1",
    ),
    "kl_to_full": (
        False,
        "fails `dcp-lens validate` even at matched confidence: mixtures' shares miss the truth "
        "by > 0.1 (mixture_shift_distinct at seed 0: D 1.76 for 0.09)",
    ),
}


def metric_precision(logits: Tensor) -> Tensor:
    """``logits`` in float32 at least: metrics of a float16 / bfloat16 model are computed from
    upcast logits, so a log-softmax or a KL never rounds in the model's precision."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def reference_log_probs(
    full_logits: Float[Tensor, "batch pos d_vocab"],
) -> Float[Tensor, "batch pos d_vocab"]:
    """Full-depth log-probabilities, the reference of ``kl_to_full``, in `metric_precision`."""
    return metric_precision(full_logits).log_softmax(-1)


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
    is NaN, never the argmax of NaNs."""
    logits, full_log_probs = metric_precision(logits), metric_precision(full_log_probs)
    scored = targets != IGNORE_INDEX
    count = scored.sum(-1).clamp(min=1).to(logits.dtype)
    out: dict[str, Tensor] = {}
    # One log-softmax serves cross-entropy and KL (the costliest pass over the logits).
    log_probs = logits.log_softmax(-1) if {"cross_entropy", "kl_to_full"} & {*metrics} else None
    if "cross_entropy" in metrics:
        assert log_probs is not None
        losses = token_cross_entropy(log_probs, targets, log_probs=True)
        out["cross_entropy"] = (losses * scored).sum(-1) / count
    if "accuracy" in metrics or "top1_agreement" in metrics:
        # The prediction is the argmax, the first index among tied maxima, which max's indices
        # are too (documented, and tested on inputs full of ties): one pass, where amax with a
        # count of tied maxima took two. All logits are finite exactly when the largest and the
        # smallest are (max and amin propagate NaN): two reductions, not a mask of the logits.
        largest, predicted = logits.max(-1)
        finite = torch.isfinite(largest) & torch.isfinite(logits.amin(-1))
        if full_top1 is None and "top1_agreement" in metrics:
            full_top1 = full_log_probs.argmax(-1)
        references = {"accuracy": targets, "top1_agreement": full_top1}
        for name, reference in references.items():
            if name not in metrics or reference is None:
                continue
            # IGNORE_INDEX is no class: never a hit.
            hit = torch.where(finite, (predicted == reference).to(logits.dtype), torch.nan)
            bad = (torch.isnan(hit) & scored).any(-1)
            out[name] = torch.where(bad, torch.nan, (hit * scored).nansum(-1) / count)
    if "kl_to_full" in metrics:
        assert log_probs is not None
        # KL(full || readout) = sum p_full (log p_full - log p), as F.kl_div(log_target=True)
        # computes it, with p_full = exp(log p_full) taken once per batch rather than per call.
        # The difference first: near full depth, where the protocol's comparisons sit, it is
        # exact where sum p log p_full - sum p log p would lose the small KL to cancellation.
        if full_probs is None:
            full_probs = full_log_probs.exp()
        kl = (metric_precision(full_probs) * (full_log_probs - log_probs)).sum(-1)
        kl = kl.clamp_min(0.0)  # KL >= 0: a negative sum is rounding, not a value (NaN stays)
        out["kl_to_full"] = (kl * scored).sum(-1) / count
    return out
