"""Generation: greedy or sampled continuation with a KV cache that keeps every block application,
and the logits sampling draws from."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from dcp_lens.model.components.attention import KVCache
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.padding import PaddingError, check_attention_mask
from dcp_lens.model.tokenization import Tokenizer, padding_id
from dcp_lens.utils.errors import DCPLensError
from dcp_lens.utils.progress import progress as progress_display


class Generation:
    """Mixin of `HookedRecurrentTransformer`: ``generate`` as TransformerLens has it."""

    if TYPE_CHECKING:

        @property
        def cfg(self) -> RecurrentConfig: ...

        @property
        def is_dense(self) -> bool: ...

        _active: int

        def iterations(self, k: int) -> contextlib.AbstractContextManager[object]: ...

        def _as_tokens(self, input: object, offset: int = 0) -> Tensor: ...

        def forward(
            self,
            input: Tensor,
            *,
            past_kv_cache: KVCache | None = None,
            attention_mask: Tensor | None = None,
        ) -> Tensor: ...

        def to_string(self, tokens: Tensor) -> str | list[str]: ...

        def to_tokens(self, text: str | list[str], prepend_bos: bool | None = None) -> Tensor: ...

        def to_tokens_with_mask(
            self,
            text: str | list[str],
            prepend_bos: bool | None = None,
            padding_side: PaddingSide | None = None,
        ) -> tuple[Tensor, Tensor]: ...

        tokenizer: Tokenizer | None

        hook_dict: dict[str, HookPoint]

    @torch.no_grad()
    def generate(
        self,
        input: Int[Tensor, "batch pos"] | str | list[str],
        max_new_tokens: int = 10,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        freq_penalty: float = 0.0,
        use_past_kv_cache: bool = True,
        n_iterations: int | None = None,
        stop_at_eos: bool = False,
        eos_token_id: int | None = None,
        seed: int | None = None,
        verbose: bool = False,
        prepend_bos: bool | None = None,
        padding_side: PaddingSide | None = None,
        return_type: GenerateReturn = "input",
        attention_mask: Tensor | None = None,
    ) -> Tensor | str | list[str]:
        """Greedy (default) or sampled continuation. With ``use_past_kv_cache`` every block
        application (every iteration of every core layer) keeps its own keys and values.

        Args:
            input: tokens [batch, pos] (each row a prompt as it is, unless ``attention_mask``
                marks its padding), a string, or a list of strings. Strings are tokenized with
                ``prepend_bos`` (default: ``cfg.default_prepend_bos``); prompts of different
                lengths are padded on the left with the tokenizer's pad id
                (`dcp_lens.model.tokenization.padding_id`) and continued in one masked batch
                (`dcp_lens.model.padding`), so each row continues as that prompt does by
                itself; the rows come back padded on ``padding_side`` (default ``"left"``, as
                TransformerLens pads a batch of prompts).
            max_new_tokens: tokens to add.
            do_sample, temperature, top_k, top_p, freq_penalty, seed: sampling as
                TransformerLens (`sampling_logits`); ``seed`` makes a sample reproducible.
            stop_at_eos, eos_token_id: stop once every row has produced the EOS id (default:
                the tokenizer's); a finished row is filled with it, as TransformerLens does.
            verbose: a progress display (`dcp_lens.utils.progress`).
            return_type: ``"input"`` (a string for a string, a list of strings for a list, else
                tokens), ``"str"`` or ``"tokens"`` ([batch, pos + new]).
            attention_mask: [batch, pos] for token input, True on real tokens: a batch padded
                (on the left) by the caller, continued in one masked pass.

        Returns:
            tokens [batch, pos + new], a string, or a list of strings (``return_type``).

        Defaults that differ from TransformerLens's, and why: greedy decoding
        (``do_sample=False``; TL samples) and no stop at EOS (TL stops), so that a continuation
        is reproducible and every row keeps one length, which the lens and DCP studies compare
        token for token; no progress display (``verbose=False``; TL shows one), since studies
        call generate in loops. Pass TL's values to get its behaviour.
        """
        if return_type not in GENERATE_RETURNS:
            raise GenerationInputError(
                f"return_type={return_type!r} is not one generate offers; use one of "
                f"{GENERATE_RETURNS} (TransformerLens's 'embeds' is not supported: pass tokens)."
            )
        if padding_side not in (None, *PADDING_SIDES):
            raise GenerationInputError(
                f"padding_side={padding_side!r} must be one of {PADDING_SIDES} (or None: left)."
            )
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise SamplingError(f"top_p={top_p} must be in (0, 1].")
        if top_k is not None and top_k < 1:
            raise SamplingError(f"top_k={top_k} must be >= 1.")
        settings = GenerationSettings(
            do_sample,
            temperature,
            top_k,
            top_p,
            freq_penalty,
            use_past_kv_cache,
            stop_at_eos,
            self._eos_id(eos_token_id),
            seed,
            verbose,
        )
        if n_iterations is not None and not self.is_dense and n_iterations != self._active:
            with self.iterations(n_iterations):
                return self._generate_input(
                    input,
                    max_new_tokens,
                    settings,
                    prepend_bos,
                    padding_side,
                    return_type,
                    attention_mask,
                )
        return self._generate_input(
            input,
            max_new_tokens,
            settings,
            prepend_bos,
            padding_side,
            return_type,
            attention_mask,
        )

    def _generate_input(
        self,
        input: Tensor | str | list[str],
        max_new_tokens: int,
        settings: GenerationSettings,
        prepend_bos: bool | None,
        padding_side: PaddingSide | None,
        return_type: GenerateReturn,
        attention_mask: Tensor | None = None,
    ) -> Tensor | str | list[str]:
        """`generate` on one kind of input: tokens, a string or a list of strings."""
        if isinstance(input, Tensor):
            tokens = self._as_tokens(input)
            mask = None
            if attention_mask is not None:
                mask = check_attention_mask(attention_mask, tuple(tokens.shape), tokens.device)
            tokens, mask = self._continue(tokens, max_new_tokens, settings, mask)
            if return_type == "str":
                return [str(self.to_string(row)) for row in _real_rows(tokens, mask)]
            return tokens
        elif attention_mask is not None:
            raise PaddingError(
                "attention_mask goes with token input; text is tokenized and masked by generate."
            )
        texts = [input] if isinstance(input, str) else list(input)
        prompts, mask = self.to_tokens_with_mask(texts, prepend_bos, "left")
        tokens, mask = self._continue(prompts, max_new_tokens, settings, mask)
        rows = _real_rows(tokens, mask)
        if return_type == "tokens":
            side = padding_side or "left"
            return tokens if side == "left" else self._padded(rows, side)
        strings = [str(self.to_string(row)) for row in rows]
        return strings[0] if isinstance(input, str) and return_type == "input" else strings

    def _continue(
        self,
        tokens: Int[Tensor, "batch pos"],
        max_new_tokens: int,
        settings: GenerationSettings,
        mask: Bool[Tensor, "batch pos"] | None = None,
    ) -> tuple[Int[Tensor, "batch pos_new"], Bool[Tensor, "batch pos_new"] | None]:
        """``tokens`` with up to ``max_new_tokens`` tokens added to every row, and the mask
        (``mask`` [batch, pos], True on real tokens, with True for every new token)."""
        generator = (
            torch.Generator(device=tokens.device).manual_seed(settings.seed)
            if settings.seed is not None
            else None
        )
        cache = KVCache(self.cfg.n_layers) if settings.use_past_kv_cache else None
        finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        eos = settings.eos_token_id if settings.stop_at_eos else None
        new_input, new_mask = tokens, mask
        steps = progress_display(range(max_new_tokens), desc="generate", enabled=settings.verbose)
        for _ in steps:
            if cache is not None:  # the cache keeps the mask of what it holds
                logits = self.forward(new_input, past_kv_cache=cache, attention_mask=new_mask)
            else:
                logits = self.forward(tokens, attention_mask=mask)
            last = logits[:, -1, :]
            if settings.do_sample:
                last = sampling_logits(
                    last,
                    tokens,
                    settings.temperature,
                    settings.freq_penalty,
                    settings.top_k,
                    settings.top_p,
                    mask,
                )
                next_token = torch.multinomial(last.softmax(-1), 1, generator=generator)
            else:
                next_token = last.argmax(-1, keepdim=True)
            if eos is not None:
                next_token = next_token.masked_fill(finished[:, None], eos)
                finished |= next_token[:, 0] == eos
            tokens = torch.cat((tokens, next_token), dim=1)
            if mask is not None:
                mask = torch.cat((mask, torch.ones_like(next_token, dtype=torch.bool)), dim=1)
            new_input, new_mask = next_token, None
            if eos is not None and bool(finished.all()):
                break
        return tokens, mask

    def _padded(self, rows: list[Tensor], side: PaddingSide) -> Int[Tensor, "batch pos"]:
        """Rows of different lengths as one [batch, pos] tensor, padded on ``side`` with the pad
        id."""
        width = max(len(row) for row in rows)
        pad = padding_id(self.tokenizer)
        out = torch.full((len(rows), width), pad, dtype=rows[0].dtype, device=rows[0].device)
        for i, row in enumerate(rows):
            if side == "left":
                out[i, width - len(row) :] = row
            else:
                out[i, : len(row)] = row
        return out

    def _eos_id(self, eos_token_id: int | None) -> int | None:
        if eos_token_id is not None:
            return eos_token_id
        value = getattr(self.tokenizer, "eos_token_id", None)
        return value if isinstance(value, int) else None


def _real_rows(
    tokens: Int[Tensor, "batch pos"], mask: Bool[Tensor, "batch pos"] | None
) -> list[Int[Tensor, " real"]]:
    """Each row's real tokens (all of them without a mask)."""
    return (
        list(tokens)
        if mask is None
        else [row[real] for row, real in zip(tokens, mask, strict=True)]
    )


PaddingSide = Literal["left", "right"]
PADDING_SIDES: tuple[PaddingSide, ...] = ("left", "right")
GenerateReturn = Literal["input", "str", "tokens"]
GENERATE_RETURNS: tuple[GenerateReturn, ...] = ("input", "str", "tokens")


@dataclass(frozen=True)
class GenerationSettings:
    """`HookedRecurrentTransformer.generate`'s decoding settings, as passed."""

    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    freq_penalty: float
    use_past_kv_cache: bool
    stop_at_eos: bool
    eos_token_id: int | None
    seed: int | None
    verbose: bool


class GenerationInputError(DCPLensError, ValueError):
    """A `HookedRecurrentTransformer.generate` argument outside what it accepts."""


class SamplingError(DCPLensError):
    """A sampling setting of `HookedRecurrentTransformer.generate` outside its range."""


def sampling_logits(
    logits: Float[Tensor, "batch d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    temperature: float = 1.0,
    freq_penalty: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    mask: Bool[Tensor, "batch pos"] | None = None,
) -> Float[Tensor, "batch d_vocab"]:
    """The logits generate samples from: divided by ``temperature``, less ``freq_penalty``
    times each token's count in ``tokens`` (real tokens only, with a ``mask``), with tokens
    outside the top k and outside the nucleus of mass ``top_p`` set to -inf (the most likely
    token always stays)."""
    logits = logits / temperature
    if freq_penalty:
        ones = torch.ones_like(tokens, dtype=logits.dtype)
        counts = torch.zeros_like(logits).scatter_add_(
            -1, tokens, ones if mask is None else ones * mask.to(logits.dtype)
        )
        logits = logits - freq_penalty * counts
    if top_k is not None:
        threshold = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probabilities = ordered.softmax(-1)
        outside = probabilities.cumsum(-1) - probabilities >= top_p  # mass before reaches top_p
        drop = torch.zeros_like(outside).scatter(-1, order, outside)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
