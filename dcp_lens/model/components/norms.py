"""Normalisation layers with TransformerLens hook points (``hook_scale``, ``hook_normalized``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from dcp_lens.model.config import RecurrentConfig


class LayerNorm(nn.Module):
    """LayerNorm: (x - mean) / sqrt(var + eps) * w + b."""

    def __init__(self, cfg: RecurrentConfig):
        super().__init__()
        self.eps = cfg.eps
        self.w = nn.Parameter(torch.ones(cfg.d_model))
        self.b = nn.Parameter(torch.zeros(cfg.d_model))
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        if not (self.hook_scale.fwd_hooks or self.hook_normalized.fwd_hooks):
            return F.layer_norm(x, self.w.shape, self.w, self.b, self.eps)  # fused, same math
        x = x - x.mean(-1, keepdim=True)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized(x / scale * self.w + self.b)


class RMSNorm(nn.Module):
    """RMSNorm: x / sqrt(mean(x^2) + eps) * w, over the last ``width`` features (default
    ``d_model``; a query or key projection's width for QK-norm)."""

    def __init__(self, cfg: RecurrentConfig, width: int | None = None):
        super().__init__()
        self.eps = cfg.eps
        self.w = nn.Parameter(torch.ones(cfg.d_model if width is None else width))
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, width]

    def forward(self, x: Float[Tensor, "batch pos width"]) -> Float[Tensor, "batch pos width"]:
        if not (self.hook_scale.fwd_hooks or self.hook_normalized.fwd_hooks):
            return F.rms_norm(x, self.w.shape, self.w, self.eps)  # fused, same math
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized(x / scale * self.w)


class NoNorm(nn.Module):
    """Identity in place of a final norm (Ouro reads out its per-iteration-normed state)."""

    def __init__(self, cfg: RecurrentConfig):
        super().__init__()
        self.hook_normalized = HookPoint()

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        return self.hook_normalized(x)


def make_norm(cfg: RecurrentConfig) -> LayerNorm | RMSNorm:
    """The norm of ``cfg.normalization_type`` ("LN" or "RMS")."""
    return RMSNorm(cfg) if cfg.normalization_type == "RMS" else LayerNorm(cfg)
