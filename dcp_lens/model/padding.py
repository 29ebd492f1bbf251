"""Padded batches in one masked pass: prompts of different lengths in one [batch, pos] tensor with
an ``attention_mask`` (True on real tokens, TransformerLens's convention).

Each row then reads as its real tokens alone:

- attention never reads a pad key (a pad query reads itself, so no row of scores is all -inf);
- positions (learned or rotary) count from the row's first real token, so a left-padded row
  starts at position 0 as the prompt alone does;
- Huginn's causal noise is keyed by the row's own real prefix (`dcp_lens.model.noise`: a pad
  adds nothing to the prefix hash and the position key is the row's own position);
- a KV cache keeps the mask of the positions it holds (`KVCache.attention_mask`), so a later
  chunk continues each row where it stopped;
- logits at pad positions are zero and the loss counts only a real token predicted from a real
  one.

Activations at pad positions (in a cache or a hook) are computed from the pad token and mean
nothing; read real positions (``cache[name][row, mask[row]]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from dcp_lens.model.loss import next_token_loss
from dcp_lens.utils.errors import DCPLensError


class PaddingError(DCPLensError, ValueError):
    """An attention mask that does not describe a padded batch of these tokens."""


@dataclass(frozen=True)
class Padding:
    """What one forward over a padded batch needs.

    Attributes:
        key_mask: [batch, past + pos], True on real tokens: the cached positions' and these.
        positions: [batch, pos], each new token's position counted from its row's first real
            token (a pad gets the position of the real token before it, or 0).
    """

    key_mask: Bool[Tensor, "batch key"]
    positions: Int[Tensor, "batch pos"]

    @property
    def query_mask(self) -> Bool[Tensor, "batch pos"]:
        """[batch, pos]: True on the new tokens that are real."""
        return self.key_mask[:, -self.positions.shape[1] :]


def check_attention_mask(
    attention_mask: object, shape: tuple[int, ...], device: torch.device
) -> Bool[Tensor, "batch pos"]:
    """``attention_mask`` as booleans [batch, pos] on ``device``; refused unless it has the
    tokens' ``shape`` and holds booleans or 0 / 1."""
    mask = torch.as_tensor(attention_mask, device=device)
    if tuple(mask.shape) != tuple(shape):
        raise PaddingError(
            f"attention_mask has shape {tuple(mask.shape)}, the tokens {tuple(shape)}; pass one "
            "value per token (True on real tokens), as to_tokens_with_mask returns it."
        )
    if mask.dtype != torch.bool:
        if bool(((mask != 0) & (mask != 1)).any()):
            raise PaddingError(
                f"attention_mask must hold booleans or 0 / 1 (1 on real tokens), got {mask.dtype} "
                "values other than 0 and 1."
            )
        mask = mask != 0
    return mask


def padding_for(
    attention_mask: object,
    shape: tuple[int, ...],
    device: torch.device,
    past_mask: Tensor | None = None,
    past: int = 0,
) -> Padding | None:
    """The `Padding` of a forward over tokens of ``shape`` after ``past`` cached positions whose
    mask is ``past_mask`` ([batch, past]; None: all real), or None when every token is real (the
    forward then runs unmasked, exactly as without a mask)."""
    if attention_mask is None and past_mask is None:
        return None
    batch, n_new = shape
    new = (
        torch.ones(shape, dtype=torch.bool, device=device)
        if attention_mask is None
        else check_attention_mask(attention_mask, shape, device)
    )
    if past_mask is None:
        past_mask = torch.ones(batch, past, dtype=torch.bool, device=device)
    if tuple(past_mask.shape) != (batch, past):
        raise PaddingError(
            f"the KV cache holds a mask of shape {tuple(past_mask.shape)} for {past} positions; "
            f"these tokens have {batch} rows. Extend a cache with the rows it was started with."
        )
    key_mask = torch.cat((past_mask.to(device), new), dim=1)
    if bool(key_mask.all()):
        return None
    empty = (~key_mask.any(dim=1)).nonzero()[:, 0].tolist()
    if empty:
        raise PaddingError(
            f"rows {empty} of attention_mask have no real token; every row needs at least one "
            "(drop empty prompts from the batch)."
        )
    positions = (key_mask.long().cumsum(dim=1) - 1).clamp(min=0)[:, past:]
    return Padding(key_mask, positions)


def attention_allowed(
    key_mask: Bool[Tensor, "batch key"], n_query: int, past: int
) -> Bool[Tensor, "batch 1 query key"]:
    """True where a query may read a key: a real key at or before it, and the query itself (so a
    pad query has one key and its softmax is defined). Queries are the last ``n_query`` of the
    ``past + n_query`` keys."""
    n_key = key_mask.shape[1]
    keys = torch.arange(n_key, device=key_mask.device)
    queries = torch.arange(past, past + n_query, device=key_mask.device)
    causal = keys[None, :] <= queries[:, None]  # [query, key]
    own = keys[None, :] == queries[:, None]
    return ((causal & key_mask[:, None, :]) | own)[:, None]


def padded_outputs(
    logits: Float[Tensor, "batch pos d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    mask: Bool[Tensor, "batch pos"],
    return_type: str | None,
    loss_per_token: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """A padded forward's result: logits [batch, pos, d_vocab] zero at pads; the loss over the
    positions whose token and next token are both real (per token [batch, pos - 1], zero
    elsewhere; else their mean)."""
    logits = logits.masked_fill(~mask[..., None], 0.0)
    if return_type == "logits":
        return logits
    scored = mask[:, 1:] & mask[:, :-1]
    losses = next_token_loss(logits, tokens, per_token=True).masked_fill(~scored, 0.0)
    loss = losses if loss_per_token else losses.sum() / scored.sum().clamp(min=1)
    if return_type == "loss":
        return loss
    return logits, loss
