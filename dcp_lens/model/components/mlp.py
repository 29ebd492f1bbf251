"""Feed-forward layers: GELU MLP and gated-SiLU MLP, with TransformerLens hook points."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from dcp_lens.model.config import RecurrentConfig


class MLP(nn.Module):
    """W_out GELU(x W_in + b_in) + b_out."""

    def __init__(self, cfg: RecurrentConfig):
        super().__init__()
        assert cfg.d_mlp is not None
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp))
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        self.b_out = nn.Parameter(torch.zeros(cfg.d_model))
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        pre = self.hook_pre(x @ self.W_in + self.b_in)
        return self.hook_post(F.gelu(pre)) @ self.W_out + self.b_out


class GatedMLP(nn.Module):
    """W_out (SiLU(x W_gate) * x W_in), no biases (Llama, Huginn, Ouro)."""

    def __init__(self, cfg: RecurrentConfig):
        super().__init__()
        assert cfg.d_mlp is not None
        self.W_gate = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        self.hook_pre = HookPoint()  # gate pre-activation [batch, pos, d_mlp]
        self.hook_pre_linear = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        gate = self.hook_pre(x @ self.W_gate)
        linear = self.hook_pre_linear(x @ self.W_in)
        return self.hook_post(F.silu(gate) * linear) @ self.W_out


def make_mlp(cfg: RecurrentConfig) -> MLP | GatedMLP:
    return GatedMLP(cfg) if cfg.act_fn == "silu_gated" else MLP(cfg)
