"""Planted models at real width: a planted mechanism inside a stream of ``width`` coordinates.

`embed` builds, from any planted model of d coordinates, a model of ``width`` coordinates whose
logits are the original's at every depth, under replay and under any affine combination of
states (the readout's and the MLP's inputs are normalised, so the construction keeps every
normalised input's norm in a fixed ratio to the original's). Before a random rotation Q of the
whole stream (no coordinate of the result is a coordinate of the mechanism), a state is

    z = [a x_dyn, c x_stat | g x_dyn L | n_token + n_position]

- ``x_dyn`` are the coordinates some iteration writes (the MLP's output or the adapter moves
  them) and ``x_stat`` the static ones (a carrier, an input feature: no iteration changes them),
  kept at scales a = 1 and c = `STATIC_SCALE`;
- the **shadow** ``g x_dyn L`` (L an isometry into ``d_shadow`` coordinates, g = ``shadow``)
  copies the dynamic content, at g times its size, into coordinates the readout does not read.
  It is token-, position- and iteration-dependent, and where the mechanism's future is not
  predictable from s_k (distinct computation) neither is the shadow's;
- the **static nuisance** ``n_token + n_position``: an isometric copy of the token's static
  content (a random direction per token would make every function of the token affine in the
  state, a lookup table, and so change the planted truth) and a random direction per position,
  in the remaining coordinates, never read, with norm eta |x_stat| where
  eta^2 = a^2 + g^2 - c^2, so that |z|^2 = (a^2 + g^2) |x|^2 for every state and every affine
  combination of states (the static part of an affine combination is the state's own). The
  position part is used only where every (token, position) has the same |x_stat|.

The read weights are the original's times (a^2 + g^2)^(1/2) (d / width)^(1/2) / scale of the
coordinate read, the written weights the original's lifted by the same map as a state. No
content that changes across iterations can be added independently of the mechanism without
changing replay's readout: replay extrapolates it and its norm grows (|n_k + j Delta|^2 grows
as j^2 |Delta|^2), which rescales the normalised readout input. So the iteration-dependent
nuisance here is the shadow, whose growth the original's norm already carries. A model without
static coordinates gets no static nuisance.

Attention is off in every planted model; the embedded model's attention returns zeros without
computing (its projections would cost width^2 per position and iteration), and its adapter
(models with the concat adapter) acts on the low-dimensional mechanism and shadow only, so a
forward costs O(width * (d_mlp + d_vocab + d + d_shadow)) per position and iteration.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from dcp_lens.model.components.block import TransformerBlock
from dcp_lens.model.components.mlp import MLP
from dcp_lens.model.components.norms import RMSNorm
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.utils.errors import ConfigError, ConfigTypeError
from dcp_lens.zoo.planted.base import (
    PlantedModel,
    adapter_config,
    base_config,
    blank_model,
    position_table,
)

SHADOW_SCALE = 3.0  # g: the shadow's size relative to the dynamic content it copies
STATIC_SCALE = 0.4  # c: the static coordinates' scale inside the read part of the stream
POSITION_SHARE = 0.4  # of the static nuisance's squared norm, where positions may carry it
# The shadow takes this fraction of the coordinates beyond the mechanism (at least one per
# dynamic coordinate); the static nuisance takes the rest.
SHADOW_FRACTION = 0.25


class SilentAttention(nn.Module):
    """Attention that adds nothing, computed as nothing: every planted model's attention is
    zero, and at real width its projections would cost width^2 per position."""

    def forward(
        self, x: Tensor, rotary: object = None, kv_cache: object = None, key_mask: object = None
    ) -> Tensor:
        """``x`` [batch, pos, d_model] -> zeros of the same shape."""
        return torch.zeros_like(x)


class EmbeddedAdapter(nn.Module):
    """The concat adapter of an embedded model, acting on the mechanism only.

    u' = s' - (s' B^T) B + lift(x(s') A_s + x(e') A_e) B, where B [k, width] holds the
    rotated basis of the mechanism and shadow coordinates (k = d + d_shadow), x(.) reads the
    original coordinates from them, A_s, A_e are the original adapter's halves and lift maps
    original coordinates back (scales and shadow). The static nuisance passes through, as
    the original adapter passes its static coordinates.
    """

    kind = "concat_adapter"
    basis: Tensor
    read: Tensor
    lift: Tensor
    A_s: Tensor
    A_e: Tensor

    def __init__(self, basis: Tensor, read: Tensor, lift: Tensor, A_s: Tensor, A_e: Tensor):
        super().__init__()
        self.register_buffer("basis", basis)  # [k, width]
        self.register_buffer("read", read)  # [k, d]: original coordinates from basis coords
        self.register_buffer("lift", lift)  # [d, k]
        self.register_buffer("A_s", A_s)  # [d, d]
        self.register_buffer("A_e", A_e)  # [d, d]

    def forward(self, state: Tensor, embedding: Tensor) -> Tensor:
        """``state``, ``embedding`` [batch, pos, width] -> u [batch, pos, width]."""
        in_basis = state @ self.basis.T
        original = (
            in_basis @ self.read @ self.A_s + (embedding @ self.basis.T) @ self.read @ self.A_e
        )
        return state + (original @ self.lift - in_basis) @ self.basis


class EmbeddedPlantedModel(PlantedModel):
    """A planted model embedded at a larger width (`embed`); ``embedding`` records how."""

    embedding: dict[str, object]

    def _tied_copy(self, block: TransformerBlock) -> TransformerBlock:
        with torch.device("meta"):
            twin = TransformerBlock(self.cfg)
        if isinstance(block.attn, SilentAttention):
            twin.attn = SilentAttention()  # type: ignore[assignment]  # the owner's is silent
        for twin_module, owner_module in zip(twin.modules(), block.modules(), strict=True):
            for name, parameter in owner_module._parameters.items():
                twin_module._parameters[name] = parameter
        return twin


def embed(
    model: PlantedModel,
    width: int,
    seed: int = 0,
    *,
    shadow: float = SHADOW_SCALE,
    static_scale: float = STATIC_SCALE,
) -> EmbeddedPlantedModel:
    """``model`` embedded in a stream of ``width`` coordinates (module docstring): the same
    logits at every depth and under replay, the planted task unchanged.

    Args:
        model: a planted model (no prelude or coda, pre-norm RMS blocks, attention off).
        width: the embedded model's d_model, at least the model's own.
        seed: the rotation's and the nuisance's random draw.
        shadow: g, the shadow's size relative to the dynamic content (0: no shadow).
        static_scale: c, the static coordinates' scale in the read part, in (0, (1 + g^2)^(1/2)].
    """
    weights = _original_weights(model)
    d = model.cfg.d_model
    if isinstance(width, bool) or not isinstance(width, int):
        raise ConfigTypeError(f"width must be an int, got {width!r}.")
    if width < d:
        raise ConfigError(f"width={width} is below the planted model's own d_model={d}.")
    generator = torch.Generator().manual_seed(10007 * seed + width)
    static = _static_coordinates(weights, d)
    n_dyn = int((~static).sum())
    extra = width - d
    d_shadow = max(n_dyn, int(SHADOW_FRACTION * extra)) if extra >= n_dyn and n_dyn else 0
    g = float(shadow) if d_shadow else 0.0
    kappa = math.sqrt(1.0 + g**2)
    if not 0.0 < static_scale <= kappa:
        raise ConfigError(f"static_scale={static_scale} must lie in (0, {kappa:.3f}].")
    nuisance = _static_nuisance(weights, static, width - d - d_shadow, generator)
    c = float(static_scale) if nuisance is not None else kappa
    eta = math.sqrt(max(kappa**2 - c**2, 0.0))
    scale = torch.where(static, c, 1.0).double()
    lift = torch.zeros(d, width, dtype=torch.float64)  # original coordinates -> z
    lift[:, :d] = torch.diag(scale)
    if d_shadow:
        isometry = torch.linalg.qr(torch.randn(d_shadow, n_dyn, generator=generator).double())[0]
        lift[~static, d : d + d_shadow] = g * isometry.T
    rotation = torch.linalg.qr(torch.randn(width, width, generator=generator).double())[0]
    read = torch.zeros(width, d, dtype=torch.float64)  # the read weights' map, z -> original
    read[:d] = torch.diag(kappa * math.sqrt(d / width) / scale)
    cfg_builder = adapter_config if weights.adapter is not None else base_config
    cfg = cfg_builder(width, model.cfg.d_vocab, model.n_iterations, weights.W_in.shape[1])
    embedded = _blank_embedded(cfg).double()
    tokens_z = weights.W_E @ lift
    positions_z = weights.W_pos @ lift
    if nuisance is not None:
        tokens_z[:, d + d_shadow :] = eta * nuisance[0]
        positions_z[:, d + d_shadow :] = eta * nuisance[1]
    with torch.no_grad():
        embedded.embed.W_E.copy_(tokens_z @ rotation.T)
        position_table(embedded).copy_(positions_z @ rotation.T)
        mlp = embedded._core[0][0].mlp
        assert isinstance(mlp, MLP), "planted models have a GELU MLP"
        mlp.W_in.copy_(rotation @ read @ weights.W_in)
        mlp.b_in.copy_(weights.b_in)
        mlp.W_out.copy_(weights.W_out @ lift @ rotation.T)
        mlp.b_out.copy_(weights.b_out @ lift @ rotation.T)
        embedded.unembedding.copy_(rotation @ read @ weights.W_U)
    if weights.adapter is not None:
        k = d + d_shadow
        basis = (rotation[:, :k]).T  # rotated basis vectors of z's first k coordinates
        A = weights.adapter
        from_basis = torch.zeros(k, d, dtype=torch.float64)
        from_basis[:d] = torch.diag(1.0 / scale)
        parts = (basis, from_basis, lift[:, :k], A[:, :d].T, A[:, d:].T)
        adapter = EmbeddedAdapter(*(part.contiguous() for part in parts))
        embedded.inject = adapter  # type: ignore[assignment]  # Inject's forward, low rank
    embedded.planted_task = model.planted_task
    if getattr(model, "tokenizer", None) is not None:
        embedded.tokenizer = model.tokenizer
    embedded.embedding = {
        "width": width,
        "seed": seed,
        "d_original": d,
        "d_shadow": d_shadow,
        "shadow": g,
        "static_scale": c,
        "static_nuisance": eta if nuisance is not None else 0.0,
        "n_static": int(static.sum()),
        "position_nuisance": bool(nuisance is not None and nuisance[1].abs().sum() > 0),
    }
    return embedded


def check_width(builders: Iterable[Callable[[], PlantedModel]], width: int | None) -> None:
    """Refuse, before any work, a ``width`` below the d_model of a model ``builders`` build
    (None: no embedding, nothing to check)."""
    if width is None:
        return
    need = max(builder().cfg.d_model for builder in builders)
    if isinstance(width, bool) or not isinstance(width, int) or width < need:
        raise ConfigError(
            f"width={width!r} is below the widest planted model's d_model={need}; pass an int "
            f">= {need}."
        )


@dataclass(frozen=True)
class _Weights:
    """A planted model's weights in float64 (`_original_weights`)."""

    W_E: Tensor  # [d_vocab, d]
    W_pos: Tensor  # [n_ctx, d]
    W_in: Tensor  # [d, d_mlp], the norm's weight folded in
    b_in: Tensor  # [d_mlp]
    W_out: Tensor  # [d_mlp, d]
    b_out: Tensor  # [d]
    W_U: Tensor  # [d, d_vocab], the final norm's weight folded in
    adapter: Tensor | None  # [d, 2 d] with the concat adapter


def _original_weights(model: PlantedModel) -> _Weights:
    """The planted model's weights in float64, its norms' weights folded into what they feed;
    refuses a model the construction does not cover."""
    cfg = model.cfg
    if (cfg.n_prelude, cfg.n_coda, cfg.n_core) != (0, 0, 1) or cfg.normalization_type != "RMS":
        raise ConfigError("embed takes a planted model: one core layer, RMS norms, no prelude.")
    if cfg.norm_placement != "pre" or cfg.iteration_norm != "none" or not cfg.final_norm:
        raise ConfigError("embed takes pre-norm planted models with a final norm only.")
    if cfg.injection not in ("none", "concat_adapter") or cfg.state_init != "embed":
        raise ConfigError(f"embed cannot embed injection={cfg.injection!r}.")
    block = model._core[0][0]
    if isinstance(block.attn, SilentAttention):
        raise ConfigError("this model is already embedded; embed the planted model itself.")
    if any(p.abs().sum() > 0 for p in block.attn.parameters()):
        raise ConfigError("embed takes planted models, whose attention is zero.")
    mlp = block.mlp
    assert isinstance(mlp, MLP) and isinstance(block.ln2, RMSNorm)
    assert isinstance(model.ln_final, RMSNorm)
    adapter = getattr(model.inject, "W_adapter", None)

    def double(t: Tensor) -> Tensor:
        return t.detach().double().clone()

    return _Weights(
        W_E=double(model.embed.W_E),
        W_pos=double(position_table(model)),
        W_in=double(block.ln2.w)[:, None] * double(mlp.W_in),
        b_in=double(mlp.b_in),
        W_out=double(mlp.W_out),
        b_out=double(mlp.b_out),
        W_U=double(model.ln_final.w)[:, None] * double(model.unembedding),
        adapter=None if adapter is None else double(adapter),
    )


def _static_coordinates(weights: _Weights, d: int) -> Tensor:
    """[d] bool: the coordinates no iteration changes (no live MLP unit writes them and the
    adapter, if any, passes them through from the state)."""
    W_in, b_in, W_out, b_out = weights.W_in, weights.b_in, weights.W_out, weights.b_out
    adapter = weights.adapter
    live = (W_in != 0).any(0) | (b_in != 0)  # a unit with no input is gelu(0) = 0
    static = (W_out[live] == 0).all(0) & (b_out == 0)
    if adapter is not None:
        passes = (adapter == torch.cat([torch.eye(d), torch.zeros(d, d)], 1).double()).all(1)
        static &= passes
    return static


def _static_nuisance(
    weights: _Weights, static: Tensor, room: int, generator: torch.Generator
) -> tuple[Tensor, Tensor] | None:
    """Unit-scale token and position nuisance ([d_vocab, room], [n_ctx, room]) whose sum has,
    for every (token, position), the norm of its static coordinates; None where none fits."""
    W_E, W_pos = weights.W_E, weights.W_pos
    if room < 2 or not bool(static.any()) or bool(W_pos[:, static].any()):
        return None
    static_norm = (W_E[:, None, static] + W_pos[None, :, static]).norm(dim=-1)  # [vocab, pos]
    if static_norm.max() == 0:
        return None
    by_token = (static_norm - static_norm[:, :1]).abs().max() <= 1e-9 * static_norm.max()
    if not by_token:
        return None
    token_norm = static_norm[:, 0]
    spread = (token_norm - token_norm.max()).abs().max() <= 1e-9 * token_norm.max()
    share = POSITION_SHARE if spread else 0.0
    n_position = int(room * share) if share else 0
    tokens = torch.zeros(W_E.shape[0], room, dtype=torch.float64)
    positions = torch.zeros(W_pos.shape[0], room, dtype=torch.float64)
    n_static = int(static.sum())
    if room - n_position < n_static:
        return None
    # The token part is an isometric image of the token's own static content: a random
    # direction per token would make every function of the token affine in the state (a
    # lookup table), and so change what an affine map can recover: the planted truth.
    isometry = torch.linalg.qr(
        torch.randn(room - n_position, n_static, generator=generator).double()
    )[0]
    tokens[:, n_position:] = (W_E[:, static] @ isometry.T) * math.sqrt(1.0 - share)
    if n_position:
        directions = torch.randn(W_pos.shape[0], n_position, generator=generator).double()
        directions /= directions.norm(dim=1, keepdim=True)
        positions[:, :n_position] = directions * float(token_norm.max()) * math.sqrt(share)
    return tokens, positions


def _blank_embedded(cfg: RecurrentConfig) -> EmbeddedPlantedModel:
    """The blank model of ``cfg`` as an `EmbeddedPlantedModel`, its attention silent."""
    model = blank_model(cfg)
    model.__class__ = EmbeddedPlantedModel
    for row in model._core:
        for block in row:
            block.attn = SilentAttention()  # type: ignore[assignment]  # zero, not computed
    model.setup()
    return cast(EmbeddedPlantedModel, model)
