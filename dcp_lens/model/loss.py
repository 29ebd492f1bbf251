"""The losses a model is trained and scored with: cross-entropy once, over scored positions.

``IGNORE_INDEX`` marks positions that are not scored (as PyTorch's ``ignore_index``). The model's
``forward(return_type="loss")``, the training regimes, the tasks' targets and the protocol's
metrics (`dcp_lens.protocol.metrics`) all score through `token_cross_entropy`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

IGNORE_INDEX = -100


def token_cross_entropy(
    logits: Float[Tensor, "*batch pos d_vocab"],
    targets: Int[Tensor, "*batch pos"],
    *,
    log_probs: bool = False,
) -> Float[Tensor, "*batch pos"]:
    """Cross-entropy of every position's prediction; 0 where ``targets == IGNORE_INDEX``.

    ``log_probs=True``: ``logits`` are already log-probabilities (``logits.log_softmax(-1)``),
    for a caller that needs them anyway; the result is the same bits (PyTorch's cross-entropy is
    the negative log-likelihood of the log-softmax)."""
    loss = F.nll_loss if log_probs else F.cross_entropy
    losses = loss(
        logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return losses.view(targets.shape)


def scored_cross_entropy(
    logits: Float[Tensor, "*batch pos d_vocab"], targets: Int[Tensor, "*batch pos"]
) -> Float[Tensor, ""]:
    """Mean cross-entropy over the scored positions (``targets != IGNORE_INDEX``)."""
    scored = targets != IGNORE_INDEX
    return token_cross_entropy(logits, targets).sum() / scored.sum().clamp(min=1)


def next_token_targets(tokens: Int[Tensor, "batch pos"]) -> Int[Tensor, "batch pos"]:
    """Language-modelling targets: position p predicts ``tokens[p + 1]``; the last is not scored."""
    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[:, :-1] = tokens[:, 1:]
    return targets


def next_token_loss(
    logits: Float[Tensor, "batch pos d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    per_token: bool = False,
) -> Tensor:
    """Cross-entropy of predicting tokens[:, 1:] from logits[:, :-1]: mean, or [batch, pos - 1]."""
    losses = token_cross_entropy(logits[:, :-1], tokens[:, 1:])
    return losses if per_token else losses.mean()
