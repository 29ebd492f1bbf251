"""Generation: greedy or sampled continuation with a KV cache that keeps every block application,
and the logits sampling draws from."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from dcp_lens.model.components.attention import KVCache
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.loss import next_token_loss
from dcp_lens.model.tokenization import Tokenizer, padding_id
from dcp_lens.utils.errors import DCPLensError, InputError
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

        def forward(self, input: Tensor, *, past_kv_cache: KVCache | None = None) -> Tensor: ...

        def to_string(self, tokens: Tensor) -> str | list[str]: ...

        def to_tokens(self, text: str | list[str], prepend_bos: bool | None = None) -> Tensor: ...

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
    ) -> Tensor | str | list[str]:
        """Greedy (default) or sampled continuation. With ``use_past_kv_cache`` every block
        application (every iteration of every core layer) keeps its own keys and values.

        Args:
            input: tokens [batch, pos] (each row a prompt as it is: padding in it is read as
                tokens), a string, or a list of strings. Strings are tokenized with
                ``prepend_bos`` (default: ``cfg.default_prepend_bos``); prompts of different
                lengths are each continued alone, so each row continues exactly as that prompt
                does by itself, and the rows are then padded to one length on ``padding_side``
                (default ``"left"``, as TransformerLens pads a batch of prompts) with the
                tokenizer's pad id (`dcp_lens.model.tokenization.padding_id`).
            max_new_tokens: tokens to add.
            do_sample, temperature, top_k, top_p, freq_penalty, seed: sampling as
                TransformerLens (`sampling_logits`); ``seed`` makes a sample reproducible.
            stop_at_eos, eos_token_id: stop once every row has produced the EOS id (default:
                the tokenizer's); a finished row is filled with it, as TransformerLens does.
            verbose: a progress display (`dcp_lens.utils.progress`).
            return_type: ``"input"`` (a string for a string, a list of strings for a list, else
                tokens), ``"str"`` or ``"tokens"`` ([batch, pos + new]).

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
                    input, max_new_tokens, settings, prepend_bos, padding_side, return_type
                )
        return self._generate_input(
            input, max_new_tokens, settings, prepend_bos, padding_side, return_type
        )

    def _generate_input(
        self,
        input: Tensor | str | list[str],
        max_new_tokens: int,
        settings: GenerationSettings,
        prepend_bos: bool | None,
        padding_side: PaddingSide | None,
        return_type: GenerateReturn,
    ) -> Tensor | str | list[str]:
        """`generate` on one kind of input: tokens, a string or a list of strings."""
        if isinstance(input, Tensor):
            tokens = self._continue(self._as_tokens(input), max_new_tokens, settings)
            return self.to_string(tokens) if return_type == "str" else tokens
        texts = [input] if isinstance(input, str) else list(input)
        prompts = [self.to_tokens(text, prepend_bos=prepend_bos) for text in texts]
        if len({prompt.shape[1] for prompt in prompts}) == 1:
            rows = list(self._continue(torch.cat(prompts), max_new_tokens, settings))
        else:  # each prompt alone: no padding inside any prompt
            rows = [self._continue(prompt, max_new_tokens, settings)[0] for prompt in prompts]
        if return_type == "tokens":
            return self._padded(rows, padding_side or "left", settings)
        strings = [str(self.to_string(row)) for row in rows]
        return strings[0] if isinstance(input, str) and return_type == "input" else strings

    def _continue(
        self, tokens: Int[Tensor, "batch pos"], max_new_tokens: int, settings: GenerationSettings
    ) -> Int[Tensor, "batch pos_new"]:
        """``tokens`` with up to ``max_new_tokens`` tokens added to every row."""
        generator = (
            torch.Generator(device=tokens.device).manual_seed(settings.seed)
            if settings.seed is not None
            else None
        )
        cache = KVCache(self.cfg.n_layers) if settings.use_past_kv_cache else None
        finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        eos = settings.eos_token_id if settings.stop_at_eos else None
        new_input = tokens
        steps = progress_display(range(max_new_tokens), desc="generate", enabled=settings.verbose)
        for _ in steps:
            logits = self.forward(new_input if cache is not None else tokens, past_kv_cache=cache)
            last = logits[:, -1, :]
            if settings.do_sample:
                last = sampling_logits(
                    last,
                    tokens,
                    settings.temperature,
                    settings.freq_penalty,
                    settings.top_k,
                    settings.top_p,
                )
                next_token = torch.multinomial(last.softmax(-1), 1, generator=generator)
            else:
                next_token = last.argmax(-1, keepdim=True)
            if eos is not None:
                next_token = next_token.masked_fill(finished[:, None], eos)
                finished |= next_token[:, 0] == eos
            tokens = torch.cat((tokens, next_token), dim=1)
            new_input = next_token
            if eos is not None and bool(finished.all()):
                break
        return tokens

    def _padded(
        self, rows: list[Tensor], side: PaddingSide, settings: GenerationSettings
    ) -> Int[Tensor, "batch pos"]:
        """Rows of different lengths as one [batch, pos] tensor, padded on ``side`` with the pad
        id; a row that stopped at EOS early is first filled with EOS up to the longest
        continuation, as a batch would have filled it."""
        width = max(len(row) for row in rows)
        pad = padding_id(self.tokenizer)
        out = torch.full((len(rows), width), pad, dtype=rows[0].dtype, device=rows[0].device)
        for i, row in enumerate(rows):
            if side == "left":
                out[i, width - len(row) :] = row
            else:
                out[i, : len(row)] = row
        return out

    def _forward_masked(
        self,
        input: object,
        attention_mask: Tensor,
        return_type: str | None,
        loss_per_token: bool,
        n_iterations: int | None,
        others: dict[str, object],
    ) -> Any:
        """`forward` of tokens with an ``attention_mask`` that pads (`_forward_padded`), at
        ``n_iterations`` when given; ``others`` (forward's other arguments by name) must all be
        None: a padded batch runs tokens only."""
        given = [name for name, value in others.items() if value is not None]
        if given:
            raise InputError(
                f"attention_mask with padding runs tokens only, not with {given}; run each "
                "row's real tokens alone for those (tokens[i:i+1, mask[i]])."
            )
        with (
            self.iterations(n_iterations) if n_iterations is not None else contextlib.nullcontext()
        ):
            padded = self._as_tokens(input)
            return self._forward_padded(padded, attention_mask, return_type, loss_per_token)

    def _forward_padded(
        self,
        tokens: Int[Tensor, "batch pos"],
        attention_mask: Tensor,
        return_type: str | None,
        loss_per_token: bool,
    ) -> Any:
        """`forward` of a padded batch: each row's real tokens (``attention_mask`` True, one
        contiguous run, padding on the left or the right) run alone, so positions, Huginn's
        prefix-keyed noise and attention see only them, exactly as the prompt alone. Logits
        [batch, pos, d_vocab] are zero at pad positions; the loss is the mean next-token
        cross-entropy over real tokens ([batch, pos - 1] with ``loss_per_token``, zero where the
        target or its context is a pad). Refused while hooks are on (a cache, ``run_with_hooks``):
        they would see each row apart."""
        spans = padded_spans(tokens, attention_mask)
        hooked = [name for name, point in self.hook_dict.items() if _has_hooks(point)]
        if hooked:
            raise PaddingError(
                f"a padded batch runs row by row, so hooks (on {hooked[:3]}) would see each row "
                "apart and a cache would keep only the last; run_with_cache / run_with_hooks each "
                "prompt alone (tokens[i:i+1, mask[i]]) or batch prompts of one length."
            )
        logits_rows = [
            self.forward(tokens[row : row + 1, lo:hi]) for row, (lo, hi) in enumerate(spans)
        ]
        if return_type is None:
            return None
        first = logits_rows[0]
        logits = first.new_zeros((*tokens.shape, first.shape[-1]))
        losses = first.new_zeros((tokens.shape[0], tokens.shape[1] - 1))
        for row, ((lo, hi), row_logits) in enumerate(zip(spans, logits_rows, strict=True)):
            logits[row, lo:hi] = row_logits[0]
            if hi - lo > 1:
                row_tokens = tokens[row : row + 1, lo:hi]
                losses[row, lo : hi - 1] = next_token_loss(row_logits, row_tokens, per_token=True)[
                    0
                ]
        if return_type == "logits":
            return logits
        n_targets = sum(max(hi - lo - 1, 0) for lo, hi in spans)
        loss = losses if loss_per_token else losses.sum() / max(n_targets, 1)
        if return_type == "loss":
            return loss
        if return_type == "both":
            return logits, loss
        raise GenerationInputError(
            f"return_type={return_type!r} is not one of 'logits', 'loss', 'both', None."
        )

    def _eos_id(self, eos_token_id: int | None) -> int | None:
        if eos_token_id is not None:
            return eos_token_id
        value = getattr(self.tokenizer, "eos_token_id", None)
        return value if isinstance(value, int) else None


def _has_hooks(point: nn.Module) -> bool:
    """Whether anything is hooked on ``point``: a TransformerLens hook or a PyTorch one."""
    return bool(
        getattr(point, "fwd_hooks", None)
        or getattr(point, "bwd_hooks", None)
        or point._forward_hooks
        or point._forward_pre_hooks
        or point._backward_hooks
    )


def padded_spans(tokens: Int[Tensor, "batch pos"], attention_mask: Tensor) -> list[tuple[int, int]]:
    """Per row, ``(start, end)`` of its real tokens: the one contiguous run where
    ``attention_mask`` [batch, pos] is true (left or right padding). A mask of another shape,
    a row with no real token or with a pad between real tokens is refused."""
    mask = torch.as_tensor(attention_mask).to(device=tokens.device).bool()
    if mask.shape != tokens.shape:
        raise PaddingError(
            f"attention_mask has shape {tuple(mask.shape)}, the tokens {tuple(tokens.shape)}; "
            "pass the mask to_tokens_with_mask returns with its tokens (True on real tokens)."
        )
    spans = []
    for row, real in enumerate(mask):
        where = real.nonzero()[:, 0]
        if where.numel() == 0 or int(where[-1]) - int(where[0]) + 1 != where.numel():
            what = "no real token" if where.numel() == 0 else "a pad between real tokens"
            raise PaddingError(
                f"row {row} of attention_mask has {what}; a row's real tokens must be one run, "
                "padded on the left or on the right."
            )
        spans.append((int(where[0]), int(where[-1]) + 1))
    return spans


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


class PaddingError(DCPLensError, ValueError):
    """An attention mask that does not describe a padded batch of these tokens."""


class SamplingError(DCPLensError):
    """A sampling setting of `HookedRecurrentTransformer.generate` outside its range."""


def sampling_logits(
    logits: Float[Tensor, "batch d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    temperature: float = 1.0,
    freq_penalty: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Float[Tensor, "batch d_vocab"]:
    """The logits generate samples from: divided by ``temperature``, less ``freq_penalty``
    times each token's count in ``tokens``, with tokens outside the top k and outside the
    nucleus of mass ``top_p`` set to -inf (the most likely token always stays)."""
    logits = logits / temperature
    if freq_penalty:
        counts = torch.zeros_like(logits).scatter_add_(
            -1, tokens, torch.ones_like(tokens, dtype=logits.dtype)
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
