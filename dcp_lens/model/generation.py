"""Generation: greedy or sampled continuation with a KV cache that keeps every block application,
and the logits sampling draws from."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float, Int
from torch import Tensor

from dcp_lens.model.components.attention import KVCache
from dcp_lens.model.config import RecurrentConfig
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

        def forward(self, input: Tensor, *, past_kv_cache: KVCache | None = None) -> Tensor: ...

        def to_string(self, tokens: Tensor) -> str | list[str]: ...

    @torch.no_grad()
    def generate(
        self,
        input: Int[Tensor, "batch pos"] | str,
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
    ) -> Tensor | str | list[str]:
        """Greedy (default) or sampled continuation: tokens [batch, pos + new], or a string
        when ``input`` is a string. With ``use_past_kv_cache`` every block application (every
        iteration of every core layer) keeps its own keys and values.

        Sampling as TransformerLens: ``temperature``, then ``freq_penalty`` times each token's
        count so far subtracted from its logit, then ``top_k`` and ``top_p`` (nucleus: the
        smallest set of tokens whose probability reaches ``top_p``)."""
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise SamplingError(f"top_p={top_p} must be in (0, 1].")
        if top_k is not None and top_k < 1:
            raise SamplingError(f"top_k={top_k} must be >= 1.")
        if n_iterations is not None and not self.is_dense and n_iterations != self._active:
            with self.iterations(n_iterations):
                return self.generate(
                    input,
                    max_new_tokens,
                    do_sample=do_sample,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    freq_penalty=freq_penalty,
                    use_past_kv_cache=use_past_kv_cache,
                    stop_at_eos=stop_at_eos,
                    eos_token_id=eos_token_id,
                    seed=seed,
                    verbose=verbose,
                )
        was_string = isinstance(input, str)
        tokens = self._as_tokens(input)
        generator = (
            torch.Generator(device=tokens.device).manual_seed(seed) if seed is not None else None
        )
        cache = KVCache(self.cfg.n_layers) if use_past_kv_cache else None
        finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        new_input = tokens
        for _ in progress_display(range(max_new_tokens), desc="generate", enabled=verbose):
            logits = self.forward(new_input if cache is not None else tokens, past_kv_cache=cache)
            last = logits[:, -1, :]
            if do_sample:
                last = sampling_logits(last, tokens, temperature, freq_penalty, top_k, top_p)
                next_token = torch.multinomial(last.softmax(-1), 1, generator=generator)
            else:
                next_token = last.argmax(-1, keepdim=True)
            if stop_at_eos and eos_token_id is not None:
                next_token = next_token.masked_fill(finished[:, None], eos_token_id)
                finished |= next_token[:, 0] == eos_token_id
            tokens = torch.cat((tokens, next_token), dim=1)
            new_input = next_token
            if stop_at_eos and bool(finished.all()):
                break
        if was_string:
            return self.to_string(tokens[0])
        return tokens


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
