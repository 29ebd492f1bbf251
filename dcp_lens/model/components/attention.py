"""Causal multi-head / grouped-query attention with TransformerLens hook points."""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor, nn
from torch.nn import functional as F
from transformer_lens.hook_points import HookPoint

from dcp_lens.model.components.norms import RMSNorm
from dcp_lens.model.components.rotary import apply_rotary
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.padding import attention_allowed


class KVCacheEntry:
    """Keys and values (after rotary) of one block application, grown one chunk at a time."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None  # [batch, pos, kv_head, d_head]
        self.values: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[1])

    def extend(
        self,
        keys: Float[Tensor, "batch new kv_head d_head"],
        values: Float[Tensor, "batch new kv_head d_head"],
    ) -> tuple[
        Float[Tensor, "batch all kv_head d_head"], Float[Tensor, "batch all kv_head d_head"]
    ]:
        """Append this chunk and return every key and value so far."""
        if self.keys is None or self.values is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat((self.keys, keys), dim=1)
            self.values = torch.cat((self.values, values), dim=1)
        return self.keys, self.values


class KVCache:
    """One `KVCacheEntry` per block application, so every iteration keeps its own keys.

    ``attention_mask`` [batch, length] is True on the real tokens among the cached positions, or
    None when all are real (`dcp_lens.model.padding`): the next chunk reads only real keys and
    counts its positions from each row's first real token."""

    def __init__(self, n_layers: int) -> None:
        self.entries = [KVCacheEntry() for _ in range(n_layers)]
        self.attention_mask: Tensor | None = None

    def __getitem__(self, index: int) -> KVCacheEntry:
        return self.entries[index]

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def length(self) -> int:
        """Number of positions already cached."""
        return self.entries[0].length if self.entries else 0


class Attention(nn.Module):
    """Causal self-attention.

    Weights follow TransformerLens's layout: ``W_Q`` [head, d_model, d_head], ``W_K``/``W_V``
    [kv_head, d_model, d_head], ``W_O`` [head, d_head, d_model]; ``b_Q``/``b_K`` exist only with
    ``cfg.qk_bias`` and are added before the rotary embedding (as Huginn's qk_bias).
    ``q_norm`` / ``k_norm`` exist only with ``cfg.qk_norm``: RMSNorms over the whole query
    projection [n_heads * d_head] and key projection [kv_head * d_head], before the split into
    heads (OLMo-2); ``hook_q`` and ``hook_k`` see their output.
    """

    def __init__(self, cfg: RecurrentConfig):
        super().__init__()
        n_kv = cfg.n_key_value_heads
        assert n_kv is not None
        self.n_heads, self.n_kv_heads, self.d_head = cfg.n_heads, n_kv, cfg.d_head
        self.rotary = cfg.positional_embedding_type != "learned"
        self.interleaved = cfg.positional_embedding_type == "rotary_interleaved"
        self.W_Q = nn.Parameter(torch.empty(cfg.n_heads, cfg.d_model, cfg.d_head))
        self.W_K = nn.Parameter(torch.empty(n_kv, cfg.d_model, cfg.d_head))
        self.W_V = nn.Parameter(torch.empty(n_kv, cfg.d_model, cfg.d_head))
        self.W_O = nn.Parameter(torch.empty(cfg.n_heads, cfg.d_head, cfg.d_model))
        self.b_Q: nn.Parameter | None
        self.b_K: nn.Parameter | None
        if cfg.qk_bias:
            self.b_Q = nn.Parameter(torch.zeros(cfg.n_heads, cfg.d_head))
            self.b_K = nn.Parameter(torch.zeros(n_kv, cfg.d_head))
        else:
            self.b_Q, self.b_K = None, None
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg, cfg.n_heads * cfg.d_head)
            self.k_norm = RMSNorm(cfg, n_kv * cfg.d_head)
        else:
            self.q_norm, self.k_norm = None, None
        self.hook_q = HookPoint()  # [batch, pos, head, d_head]
        self.hook_k = HookPoint()  # [batch, pos, kv_head, d_head]
        self.hook_v = HookPoint()  # [batch, pos, kv_head, d_head]
        self.hook_rot_q = HookPoint()
        self.hook_rot_k = HookPoint()
        self.hook_attn_scores = HookPoint()  # [batch, head, query_pos, key_pos]
        self.hook_pattern = HookPoint()  # [batch, head, query_pos, key_pos]
        self.hook_z = HookPoint()  # [batch, pos, head, d_head]
        # Fused scaled-dot-product attention whenever no hook or cache reads the scores or the
        # pattern (`forward`); False always materialises them (tests compare the two paths).
        self.fused = True

    def forward(
        self,
        x: Float[Tensor, "batch pos d_model"],
        rotary: tuple[Tensor, Tensor] | None = None,
        kv_cache: KVCacheEntry | None = None,
        key_mask: Tensor | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """``rotary``: cos and sin [pos, d_head/2] (or [batch, pos, d_head/2] in a padded
        batch) for these positions (rotary models only); ``key_mask`` [batch, past + pos]: True
        on real tokens, in a padded batch (`dcp_lens.model.padding`), else None."""
        batch, n_pos, _ = x.shape
        # One fused matmul for q, k and v (the weights keep TransformerLens's per-head layout).
        fused = torch.cat([flat_heads(self.W_Q), flat_heads(self.W_K), flat_heads(self.W_V)], dim=1)
        q, k, v = (x @ fused).split(
            [w.shape[0] * self.d_head for w in (self.W_Q, self.W_K, self.W_V)], -1
        )
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, n_pos, self.n_heads, self.d_head)
        k = k.view(batch, n_pos, self.n_kv_heads, self.d_head)
        v = v.view(batch, n_pos, self.n_kv_heads, self.d_head)
        q = self.hook_q(q if self.b_Q is None else q + self.b_Q)
        k = self.hook_k(k if self.b_K is None else k + self.b_K)
        v = self.hook_v(v)
        if self.rotary:
            assert rotary is not None, "rotary models must pass the cos/sin tables"
            q = self.hook_rot_q(apply_rotary(q, *rotary, interleaved=self.interleaved))
            k = self.hook_rot_k(apply_rotary(k, *rotary, interleaved=self.interleaved))
        past = 0
        if kv_cache is not None:
            past = kv_cache.length
            k, v = kv_cache.extend(k, v)
        if self.n_kv_heads != self.n_heads:
            group = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(group, dim=2)
            v = v.repeat_interleave(group, dim=2)
        n_query, n_key = q.shape[1], k.shape[1]
        if self.fused and not (_watched(self.hook_attn_scores) or _watched(self.hook_pattern)):
            # Nobody reads the scores or the pattern: one fused kernel that never forms them.
            plain = past == 0 and key_mask is None
            mask = None if plain else _allowed(n_query, n_key, past, key_mask, x.device)
            z = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=mask,
                is_causal=plain,
            ).transpose(1, 2)
        else:
            scores = q.transpose(1, 2) @ k.permute(0, 2, 3, 1) / math.sqrt(self.d_head)
            allowed = _allowed(n_query, n_key, past, key_mask, x.device)
            scores = self.hook_attn_scores(scores.masked_fill(~allowed, float("-inf")))
            pattern = self.hook_pattern(scores.softmax(dim=-1))
            z = (pattern @ v.transpose(1, 2)).transpose(1, 2)
        z = self.hook_z(self.gate_output(x, z))  # [batch, pos, head, d_head]
        return z.reshape(batch, n_pos, -1) @ self.W_O.reshape(-1, self.W_O.shape[-1])

    def gate_output(
        self, x: Float[Tensor, "batch pos d_model"], z: Float[Tensor, "batch pos head d_head"]
    ) -> Float[Tensor, "batch pos head d_head"]:
        """Each head's output before ``W_O`` (ungated here; a subclass may gate it)."""
        return z


def _allowed(
    n_query: int, n_key: int, past: int, key_mask: Tensor | None, device: torch.device
) -> Tensor:
    """[query, key], or [batch, 1, query, key] with a ``key_mask`` (a padded batch): True where
    a query may read a key."""
    if key_mask is None:
        return _causal(n_query, n_key, past, device).logical_not()
    return attention_allowed(key_mask, n_query, past)


def _causal(n_query: int, n_key: int, past: int, device: torch.device) -> Tensor:
    """``[query, key]``: True where the key lies in the query's future (queries from ``past``)."""
    return torch.ones(n_query, n_key, dtype=torch.bool, device=device).triu(past + 1)


def _watched(point: HookPoint) -> bool:
    """Whether anything reads ``point``: a TransformerLens hook, a cache, a plain PyTorch
    forward or backward hook registered on it, or a wrapper that replaced its ``forward``
    (nnsight's) while that wrapper is tracing."""
    return bool(
        point.fwd_hooks
        or point.bwd_hooks
        or point._forward_hooks
        or point._forward_pre_hooks
        or point._backward_hooks
        or point._backward_pre_hooks
    ) or _wrapped_and_tracing(point)


# Where nnsight keeps a wrapped module's state (``module.__dict__``); its ``active()`` returns
# the interleaver of the trace running now, or None.
NNSIGHT_STATE = "__nnsight__"


def _wrapped_and_tracing(point: HookPoint) -> bool:
    """A replaced ``forward`` (as nnsight installs on every module it wraps): while nnsight's
    trace is running, or always for a wrapper this code does not know (reading then costs the
    fused kernel, never a value the wrapper asked for)."""
    if "forward" not in point.__dict__:
        return False
    active = getattr(point.__dict__.get(NNSIGHT_STATE), "active", None)
    if active is None:
        return True
    return active()[0] is not None


def flat_heads(
    weight: Float[Tensor, "head d_model d_head"],
) -> Float[Tensor, "d_model head_d_head"]:
    """[head, d_model, d_head] -> [d_model, head * d_head], heads major (as x @ W_Q[h])."""
    return weight.permute(1, 0, 2).reshape(weight.shape[1], -1)


def set_fused_attention(model: nn.Module, enabled: bool) -> None:
    """Turn the fused attention path on or off in every `Attention` of ``model`` (on by default;
    off, the scores and the pattern are always materialised, as a hook on them would make them).
    Nothing needs it to read the pattern: a hook, a cache or an nnsight trace on ``hook_pattern``
    turns the fused path off for that forward."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.fused = enabled
