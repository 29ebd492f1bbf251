"""Text in and out of a model, as TransformerLens names it: tokens from text (right-padded, with
a mask), strings from tokens, one token's id or position, and a token's unembedding direction."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.tokenization import Tokenizer, encode_text, padding_id
from dcp_lens.utils.errors import DeviceError, InputError, InputTypeError, ResourceLimitError
from dcp_lens.utils.memory import available_memory_bytes


class PaddingWarning(UserWarning):
    """Texts padded on the left for a forward that may not get their mask."""


class TextMethods:
    """Mixin of `HookedRecurrentTransformer`: ``to_tokens``, ``to_string``, ``to_str_tokens`` and
    the other tokenizer methods of TransformerLens, through the model's ``tokenizer``."""

    tokenizer: Tokenizer | None

    if TYPE_CHECKING:

        @property
        def cfg(self) -> RecurrentConfig: ...

        @property
        def W_U(self) -> Tensor: ...

        @property
        def W_E(self) -> Tensor: ...

    def to_tokens(
        self,
        text: str | list[str],
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
    ) -> Tensor:
        """Tokenize text with the model's tokenizer: [batch, pos], texts of different lengths
        padded with the tokenizer's pad id (`padding_id`) on ``padding_side`` (default: the
        tokenizer's ``padding_side``, else right, as TransformerLens); `to_tokens_with_mask`
        also returns which tokens are real, the mask `forward` needs for a padded batch."""
        tokens, mask = self.to_tokens_with_mask(text, prepend_bos, padding_side)
        if padding_side == "left" and not bool(mask.all()):
            warnings.warn(
                "to_tokens padded the shorter texts on the left; the model reads pad tokens as "
                "tokens unless forward gets the mask: use to_tokens_with_mask and pass "
                "attention_mask=mask, or pass the texts themselves to forward or generate, which "
                "mask their padding.",
                PaddingWarning,
                stacklevel=2,
            )
        return tokens

    def to_tokens_with_mask(
        self,
        text: str | list[str],
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
    ) -> tuple[Int[Tensor, "batch pos"], Bool[Tensor, "batch pos"]]:
        """``(tokens, attention_mask)``: tokens [batch, pos] padded with the tokenizer's pad id
        on ``padding_side`` (see `to_tokens`), and True on real tokens (TransformerLens
        convention). ``prepend_bos`` defaults to ``cfg.default_prepend_bos`` (a loader sets it
        from the checkpoint's tokenizer)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; set model.tokenizer or pass token ids.")
        side = padding_side or getattr(self.tokenizer, "padding_side", None) or "right"
        if side not in ("left", "right"):
            raise ValueError(f"padding_side={side!r} must be 'left' or 'right'.")
        texts = [text] if isinstance(text, str) else list(text)
        bos = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
        rows = [encode_text(self.tokenizer, t, bos) for t in texts]
        width = max(len(r) for r in rows)
        pad = padding_id(self.tokenizer)
        padded, real = [], []
        for row in rows:
            fill = width - len(row)
            left = side == "left"
            padded.append([pad] * fill + row if left else row + [pad] * fill)
            real.append(
                [False] * fill + [True] * len(row) if left else [True] * len(row) + [False] * fill
            )
        tokens = torch.tensor(padded, dtype=torch.long)
        mask = torch.tensor(real)
        return self._as_tokens(tokens), mask.to(tokens.device)

    def to_string(self, tokens: Tensor | Sequence[int]) -> str | list[str]:
        """Decode [pos] tokens (or one 0-d token) to a string, or [batch, pos] to a list."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; set model.tokenizer first.")
        if not isinstance(tokens, Tensor):
            return self.tokenizer.decode(list(tokens))
        ids = tokens.tolist()
        if isinstance(ids, int):  # a 0-d tensor: one token (TransformerLens's test_prompt)
            return self.tokenizer.decode([ids])
        if ids and isinstance(ids[0], list):
            return [self.tokenizer.decode(row) for row in ids]
        return self.tokenizer.decode(ids)

    def to_str_tokens(
        self, input: str | list[str] | Tensor | Sequence[int], prepend_bos: bool | None = None
    ) -> list[str] | list[list[str]]:
        """Each token as its own string, as TransformerLens: text (tokenized first, with BOS as
        ``prepend_bos`` or the config says), [pos] tokens, or [1, pos]; a list of texts or
        [batch, pos] tokens give a list per row."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; set model.tokenizer first.")
        if isinstance(input, str):
            return self.to_str_tokens(self.to_tokens(input, prepend_bos=prepend_bos)[0])
        if isinstance(input, list) and input and isinstance(input[0], str):
            return [self.to_str_tokens(text, prepend_bos) for text in input]  # type: ignore
        ids = torch.as_tensor(input)
        if ids.ndim == 2 and ids.shape[0] != 1:
            return [self._str_tokens(row) for row in ids]
        if ids.ndim > 2:
            raise ValueError(f"tokens must be [pos] or [batch, pos], got shape {tuple(ids.shape)}.")
        return self._str_tokens(ids.reshape(-1))

    def _str_tokens(self, ids: Tensor) -> list[str]:
        # A piece as the vocabulary holds it where the tokenizer says (decode drops BOS / EOS).
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer; set model.tokenizer first.")
        piece = getattr(tokenizer, "id_to_piece", None)
        if piece is not None:
            return [piece(int(i)) for i in ids.tolist()]
        return [tokenizer.decode([int(i)]) for i in ids.tolist()]

    def to_single_token(self, string: str) -> int:
        """The id of the one token that ``string`` is (no BOS); a ValueError if it is several."""
        ids = self.to_tokens(string, prepend_bos=False)[0]
        if ids.numel() != 1:
            raise ValueError(
                f"{string!r} is {ids.numel()} tokens ({self.to_str_tokens(ids)}), not one."
            )
        return int(ids.item())

    def to_single_str_token(self, token: int) -> str:
        """The string of token id ``token``."""
        return self._str_tokens(torch.tensor([token]))[0]

    def get_token_position(
        self,
        single_token: str | int | Tensor,
        input: str | Tensor,
        mode: Literal["first", "last"] = "first",
        prepend_bos: bool | None = None,
    ) -> int:
        """Position of ``single_token`` (a string of one token, or an id) in text or in [pos] /
        [1, pos] tokens: its first or last occurrence. A ValueError if it does not occur."""
        tokens = self.to_tokens(input, prepend_bos=prepend_bos) if isinstance(input, str) else input
        if tokens.ndim == 2:
            if tokens.shape[0] != 1:
                raise ValueError(f"tokens must be [pos] or [1, pos], got {tuple(tokens.shape)}.")
            tokens = tokens[0]
        if isinstance(single_token, str):
            single_token = self.to_single_token(single_token)
        token = int(single_token.item()) if isinstance(single_token, Tensor) else single_token
        positions = (tokens == token).nonzero()[:, 0]
        if positions.numel() == 0:
            raise ValueError(f"token {token} does not occur in the input.")
        if mode not in ("first", "last"):
            raise ValueError(f"mode={mode!r} must be 'first' or 'last'.")
        return int(positions[0 if mode == "first" else -1])

    def tokens_to_residual_directions(
        self, tokens: str | int | Tensor
    ) -> Float[Tensor, "*tokens d_model"]:
        """The unembedding column ``W_U[:, token]`` of each token, shape ``tokens.shape +
        (d_model,)``: the direction each token's logit reads in what ``ln_final`` returns.

        The final norm is not folded into the model's weights, and one convention composes, as
        TransformerLens's ``fold_ln``: every stack the cache normalises at the final norm
        (``accumulated_resid(apply_ln=True)``, ``apply_ln_to_stack(layer=-1)``) carries the
        norm's scale and weight, and its bias is ``b_U`` (no component carries it). So a
        normalised stream times these directions plus ``b_U[tokens]`` is the logits, and
        attributions + ``b_U`` = logit."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        index = torch.as_tensor(tokens, device=self.W_U.device)
        return self.W_U[:, index].movedim(0, -1)

    def _as_tokens(self, input: object, offset: int = 0) -> Tensor:
        if isinstance(input, (str, list)) and not isinstance(input, Tensor):
            return self.to_tokens(input)
        if not isinstance(input, Tensor) or input.dtype not in (torch.int64, torch.int32):
            raise InputTypeError(
                f"input must be integer tokens [batch, pos] (or text with a tokenizer), got "
                f"{type(input).__name__} {getattr(input, 'dtype', '')}."
            )
        if input.device.type == "meta":
            raise DeviceError(
                "tokens are on the meta device, which holds shapes but no values; pass tokens on "
                f"the model's device ({self.cfg.device})."
            )
        if input.ndim == 1:
            input = input[None]
        if input.ndim != 2 or 0 in input.shape:
            raise InputError(
                f"tokens must be [batch >= 1, pos >= 1], got shape {tuple(input.shape)}; pass at "
                "least one sequence of at least one token."
            )
        if input.shape[1] + offset > self.cfg.n_ctx:
            raise InputError(
                f"sequence length {input.shape[1] + offset} exceeds n_ctx={self.cfg.n_ctx}; "
                "shorten the input or build the model with a larger n_ctx."
            )
        outside = (input < 0) | (input >= self.cfg.d_vocab)
        if bool(outside.any()):  # one read of the device, not two
            bad = input[outside][0].item()
            raise InputError(
                f"token id {bad} is outside the vocabulary 0..{self.cfg.d_vocab - 1} (d_vocab)."
            )
        self._check_forward_size(input.shape[0], input.shape[1] + offset)
        return input.long()

    def _check_forward_size(self, batch: int, pos: int) -> None:
        """Refuse a forward whose largest tensors (one layer's attention scores, the logits, a
        few residual streams) would not fit in the memory this machine has free."""
        cfg = self.cfg
        element = self.W_E.element_size()
        largest = batch * pos * (cfg.n_heads * pos + cfg.d_vocab + 8 * cfg.d_model) * element
        if self.W_E.device.type != "cpu" or largest < 1 << 30:
            return
        free = available_memory_bytes()
        if free is not None and largest > free:
            raise ResourceLimitError(
                f"tokens [{batch}, {pos}] need about {largest / 2**30:.1f} GiB for one layer's "
                f"attention scores and the logits, more than the {free / 2**30:.1f} GiB free "
                "here; pass fewer or shorter sequences (split a long text into windows)."
            )
