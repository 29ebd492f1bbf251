"""Ouro's early-exit gate and the exit distribution over iterations it defines."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn

from dcp_lens.model.config import RecurrentConfig


class ExitGate(nn.Module):
    """Ouro's early-exit gate, a linear map d_model -> 1 with bias (``nn.Linear`` key names)."""

    def __init__(self, cfg: RecurrentConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, cfg.d_model))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, state: Float[Tensor, "*batch d_model"]) -> Float[Tensor, " *batch"]:
        return (state @ self.weight.T + self.bias)[..., 0]


def exit_distribution(
    gate_logits: Float[Tensor, "*batch k"],
) -> Float[Tensor, "*batch k"]:
    """p_t = lambda_t prod_{j<t}(1 - lambda_j) for t < k and p_k = prod_{j<k}(1 - lambda_j), with
    lambda = sigmoid(gate_logits); lambda_k is unused, so the p_t sum to 1."""
    exit_now = torch.sigmoid(gate_logits)
    survived = torch.cumprod(1 - exit_now[..., :-1], dim=-1)
    survived_before = torch.cat((torch.ones_like(exit_now[..., :1]), survived), dim=-1)
    exits = exit_now[..., :-1] * survived_before[..., :-1]
    return torch.cat((exits, survived_before[..., -1:]), dim=-1)
