"""A plain PyTorch depth-recurrent transformer, written from docs/design.md §2 without the library.

It reads the weights of a `HookedRecurrentTransformer` through `canonical_state_dict()` (the same
numbers, no shared code) and runs the loop directly. Tests compare the library against it, and
`dcp-lens bench` times it as the "plain loop" baseline.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _norm(x: Tensor, weights: dict[str, Tensor], prefix: str, kind: str, eps: float) -> Tensor:
    if kind == "LN":
        centred = x - x.mean(-1, keepdim=True)
        return (
            centred
            / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
            * weights[f"{prefix}.w"]
            + weights[f"{prefix}.b"]
        )
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weights[f"{prefix}.w"]


def _rope(x: Tensor, base: float, interleaved: bool) -> Tensor:
    """x: [batch, head, pos, d_head]."""
    d_head, n_pos = x.shape[-1], x.shape[-2]
    theta = base ** (-torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)
    angle = torch.arange(n_pos, dtype=torch.float32)[:, None] * theta[None, :]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = odd * cos + even * sin
        return out
    half = d_head // 2
    low, high = x[..., :half], x[..., half:]
    return torch.cat([low * cos - high * sin, high * cos + low * sin], dim=-1)


def _attention(x: Tensor, w: dict[str, Tensor], prefix: str, cfg) -> Tensor:
    batch, n_pos, d_model = x.shape
    n_heads, n_kv, d_head = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head

    def heads(name: str, count: int) -> Tensor:
        matrix = w[f"{prefix}.attn.{name}"].permute(1, 0, 2).reshape(d_model, count * d_head)
        out = (x @ matrix).view(batch, n_pos, count, d_head)
        bias = w.get(f"{prefix}.attn.b_{name[-1]}")
        if bias is not None:
            out = out + bias
        return out.transpose(1, 2)  # [batch, head, pos, d_head]

    q, k, v = heads("W_Q", n_heads), heads("W_K", n_kv), heads("W_V", n_kv)
    if cfg.positional_embedding_type != "learned":
        interleaved = cfg.positional_embedding_type == "rotary_interleaved"
        q, k = _rope(q, cfg.rotary_base, interleaved), _rope(k, cfg.rotary_base, interleaved)
    kv_of_head = torch.arange(n_heads) // (n_heads // n_kv)
    k, v = k[:, kv_of_head], v[:, kv_of_head]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d_head)
    causal = torch.tril(torch.ones(n_pos, n_pos, dtype=torch.bool))
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    z = (weights @ v).transpose(1, 2).reshape(batch, n_pos, n_heads * d_head)
    return z @ w[f"{prefix}.attn.W_O"].reshape(n_heads * d_head, d_model)


def _mlp(x: Tensor, w: dict[str, Tensor], prefix: str, cfg) -> Tensor:
    if cfg.act_fn == "silu_gated":
        hidden = F.silu(x @ w[f"{prefix}.mlp.W_gate"]) * (x @ w[f"{prefix}.mlp.W_in"])
        return hidden @ w[f"{prefix}.mlp.W_out"]
    hidden = F.gelu(x @ w[f"{prefix}.mlp.W_in"] + w[f"{prefix}.mlp.b_in"])
    return hidden @ w[f"{prefix}.mlp.W_out"] + w[f"{prefix}.mlp.b_out"]


def _block(x: Tensor, w: dict[str, Tensor], prefix: str, cfg) -> Tensor:
    def norm(h: Tensor, name: str) -> Tensor:
        return _norm(h, w, f"{prefix}.{name}", cfg.normalization_type, cfg.eps)

    if cfg.norm_placement == "pre":
        x = x + _attention(norm(x, "ln1"), w, prefix, cfg)
        return x + _mlp(norm(x, "ln2"), w, prefix, cfg)
    if cfg.norm_placement == "sandwich":
        x = x + norm(_attention(norm(x, "ln1"), w, prefix, cfg), "ln1_post")
        return x + norm(_mlp(norm(x, "ln2"), w, prefix, cfg), "ln2_post")
    x = norm(x + _attention(norm(x, "ln1"), w, prefix, cfg), "ln1_post")
    return norm(x + _mlp(norm(x, "ln2"), w, prefix, cfg), "ln2_post")


_M32 = 0xFFFFFFFF
_PRIME = 2**31 - 1


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = h * 0x85EBCA6B & _M32
    h ^= h >> 13
    h = h * 0xC2B2AE35 & _M32
    return h ^ (h >> 16)


def _causal_noise(tokens: Tensor, width: int, cfg) -> Tensor:
    """The initial-state noise as docs/model.md specifies it, one position at a time with Python
    integers: position p hashes tokens[:p+1] (two polynomial hashes mod 2^31 - 1, digits t + 1),
    mixes them with the seed and p into two key words, and each element's 24-bit uniform goes
    through the inverse normal CDF (truncated at +-3 for "huginn")."""
    seed = cfg.state_init_seed
    low, high = seed & _M32, (seed >> 32) & _M32
    rows = []
    for row in tokens.tolist():
        h1 = h2 = 0
        keys = []
        for p, token in enumerate(row):
            h1 = (h1 * 1_000_003 + token + 1) % _PRIME
            h2 = (h2 * 972_663_749 + token + 1) % _PRIME
            h = _fmix32(low ^ ((p + 1) * 0x9E3779B1 & _M32))
            h = _fmix32(h ^ high ^ (h1 * 0xCC9E2D51 & _M32))
            first = _fmix32(h ^ (h2 * 0x1B873593 & _M32))
            second = _fmix32(first ^ ((h1 ^ h2) * 0x27D4EB2F & _M32) ^ 0x165667B1)
            words = [
                _fmix32(_fmix32(first ^ ((d + 1) * 0x85EBCA77 & _M32)) ^ second)
                for d in range(width)
            ]
            keys.append(words)
        rows.append(keys)
    uniform = ((torch.tensor(rows, dtype=torch.float64) // 256) + 0.5) / 2**24
    if cfg.state_init == "huginn":
        lo, hi = 0.5 * math.erfc(3 / math.sqrt(2)), 0.5 * math.erfc(-3 / math.sqrt(2))
        uniform = lo + uniform * (hi - lo)
    return math.sqrt(2.0) * torch.erfinv(2.0 * uniform - 1.0)


def reference_forward(
    weights: dict[str, Tensor], cfg, tokens: Tensor, n_iterations: int
) -> tuple[list[Tensor], Tensor]:
    """Returns (states s_0..s_k — on a dense model the stream after each layer — , logits)."""
    w = weights
    x = w["embed.W_E"][tokens] * cfg.embed_scale
    if cfg.positional_embedding_type == "learned":
        x = x + w["pos_embed.W_pos"][: tokens.shape[1]]
    if cfg.n_core == 0:
        states = [x]
        for name in [f"prelude.{i}" for i in range(cfg.n_prelude)] + [
            f"coda.{i}" for i in range(cfg.n_coda)
        ]:
            x = _block(x, w, name, cfg)
            states.append(x)
        return states, _unembed(x, w, cfg)
    for i in range(cfg.n_prelude):
        x = _block(x, w, f"prelude.{i}", cfg)
    e = x
    if cfg.state_init == "zeros":
        s = torch.zeros_like(e)
    elif cfg.state_init == "embed":
        s = e
    else:
        s = (_causal_noise(tokens, e.shape[-1], cfg) * cfg.state_init_std).to(e.dtype)
        if cfg.state_init == "huginn":
            s = s * cfg.embed_scale
    states = [s]
    for _ in range(n_iterations):
        if cfg.injection == "add":
            u = s + e
        elif cfg.injection == "concat_adapter":
            u = torch.cat([s, e], dim=-1) @ w["inject.W_adapter"].T
        else:
            u = s
        for layer in range(cfg.n_core):
            u = _block(u, w, f"core.{layer}", cfg)
        if cfg.iteration_norm != "none":
            prefix = "ln_final" if cfg.iteration_norm == "final" else "ln_iter"
            u = _norm(u, w, prefix, cfg.normalization_type, cfg.eps)
        s = u
        states.append(s)
    x = s
    if cfg.pre_coda_norm != "none":
        prefix = "ln_final" if cfg.pre_coda_norm == "final" else "ln_pre_coda"
        x = _norm(x, w, prefix, cfg.normalization_type, cfg.eps)
    for i in range(cfg.n_coda):
        x = _block(x, w, f"coda.{i}", cfg)
    return states, _unembed(x, w, cfg)


def _unembed(x: Tensor, w: dict[str, Tensor], cfg) -> Tensor:
    if cfg.final_norm:
        x = _norm(x, w, "ln_final", cfg.normalization_type, cfg.eps)
    return x @ (w["embed.W_E"].T if cfg.tie_unembed else w["unembed.W_U"])


# The continuation published with stories260K for this prompt (greedy decoding).
PROMPT = "Once upon a time"
CONTINUATION = (
    ", there was a little girl named Lily. She loved to play outside in the park."
    " One day, she saw a big, red ball."
)
STORY = PROMPT + CONTINUATION


# --------------------------------------------------------------------------------------------
# Independent reference implementation of llama2.c's forward pass.
# --------------------------------------------------------------------------------------------


def reference_rope_angles(seq_len: int, head_size: int) -> Tensor:
    """``[seq_len, head_size / 2]`` angles ``pos * 10000^(-2i / head_size)``, in float64."""
    inv_freq = 10000.0 ** (-torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    return torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]


def _rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _rotate_interleaved(x: Tensor, angles: Tensor) -> Tensor:
    """Rotate pairs ``(2i, 2i+1)`` of ``x [seq, heads, head_size]`` by ``angles [seq, hs/2]``."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(start_dim=-2)


def reference_llama2c_logits(
    weights: dict[str, Tensor], n_heads: int, n_kv_heads: int, tokens: list[int]
) -> Tensor:
    """Logits ``[len(tokens), vocab]`` of a llama2.c model, computed in float64.

    ``weights`` uses llama2.c's names and ``[L, out, in]`` layouts (as ``read_llama2c_checkpoint``
    returns them); the classifier is ``wcls`` if present, else the token embedding.
    """
    w = {name: tensor.to(torch.float64) for name, tensor in weights.items()}
    n_layers, dim = w["rms_att"].shape
    head_size = dim // n_heads
    queries_per_kv = n_heads // n_kv_heads
    seq = len(tokens)
    angles = reference_rope_angles(seq, head_size)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()

    x = w["token_embedding"][torch.tensor(tokens)]
    for layer in range(n_layers):
        h = _rms_norm(x, w["rms_att"][layer])
        q = (h @ w["wq"][layer].T).view(seq, n_heads, head_size)
        k = (h @ w["wk"][layer].T).view(seq, n_kv_heads, head_size)
        v = (h @ w["wv"][layer].T).view(seq, n_kv_heads, head_size)
        q, k = _rotate_interleaved(q, angles), _rotate_interleaved(k, angles)
        # Query head h reads kv head h // queries_per_kv, as in llama2.c.
        k = k.repeat_interleave(queries_per_kv, dim=1)
        v = v.repeat_interleave(queries_per_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_size)
        attention = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        mixed = torch.einsum("hqk,khd->qhd", attention, v).reshape(seq, dim)
        x = x + mixed @ w["wo"][layer].T

        h = _rms_norm(x, w["rms_ffn"][layer])
        gated = F.silu(h @ w["w1"][layer].T) * (h @ w["w3"][layer].T)
        x = x + gated @ w["w2"][layer].T
    x = _rms_norm(x, w["rms_final"])
    classifier = w.get("wcls", w["token_embedding"])
    return x @ classifier.T
