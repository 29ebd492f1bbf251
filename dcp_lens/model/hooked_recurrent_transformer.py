"""`HookedRecurrentTransformer`: a depth-recurrent transformer in which every iteration is hookable.

The loop ``s_t = Core(Inject(s_{t-1}, e))`` is unrolled with tied weights: ``model.blocks`` holds
one block object per application (``n_prelude + k * n_core + n_coda`` of them), and every copy of
a core layer holds the *same* ``nn.Parameter`` objects. TransformerLens therefore names each
application ``blocks.{i}.…``, ``run_with_cache`` keeps every iteration, and ``ActivationCache`` and
``transformer_lens.patching`` work unchanged. A model with ``n_core == 0`` is a dense transformer
through the same code path.

Iteration-level hook points (see `state_hook_name`, `inject_hook_name`, `readout_hook_name`)::

    loop.0.hook_state      s_0, the initial state
    loop.{t}.hook_inject   u_t = Inject(s_{t-1}, e), the core's input at iteration t
    loop.{t}.ln_iter       the per-iteration norm, when the config has one
    loop.{t}.hook_state    s_t, the state after iteration t (after any per-iteration norm)
    hook_readout_in        the stream entering the readout (PreCoda, coda, ln_final, unembed)
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, TypeVar

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.nn.modules.module import _IncompatibleKeys
from transformer_lens.hook_points import HookPoint

from dcp_lens.model import canonical
from dcp_lens.model.components.attention import KVCache
from dcp_lens.model.components.block import TransformerBlock
from dcp_lens.model.components.embeddings import Embed, Inject, PosEmbed
from dcp_lens.model.components.norms import LayerNorm, NoNorm, RMSNorm, make_norm
from dcp_lens.model.components.rotary import rotary_tables
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.folder import CONFIG_FILE, SINGLE_FILE, load_pretrained_folder
from dcp_lens.model.generation import Generation
from dcp_lens.model.hooking import HookSurface
from dcp_lens.model.loss import next_token_loss
from dcp_lens.model.names import IterationHookName, note_block_index
from dcp_lens.model.noise import causal_noise
from dcp_lens.model.padding import Padding, padded_outputs, padding_for
from dcp_lens.model.peers import register_with_pyvene
from dcp_lens.model.text import TextMethods
from dcp_lens.model.tl_surface import TLSurface
from dcp_lens.model.tokenization import Tokenizer
from dcp_lens.model.views import IterationHooks, ViewModuleList, ViewState
from dcp_lens.model.weights import WeightViews
from dcp_lens.utils.checks import check_limit
from dcp_lens.utils.devices import check_device
from dcp_lens.utils.errors import (
    DCPLensError,
    InputError,
)
from dcp_lens.utils.files import written_atomically

ReturnType = Literal["logits", "loss", "both"] | None
_ModelT = TypeVar("_ModelT", bound="HookedRecurrentTransformer")
# The attribute of a `KVCache` holding the initial-state noise's prefix state (`PrefixState`).
NOISE_PREFIX = "noise_prefix"


class ResumeError(DCPLensError):
    """A forward resumed with ``start_at_layer`` lacks something the rest of the loop needs."""


class HookedRecurrentTransformer(TextMethods, Generation, WeightViews, TLSurface, HookSurface):
    """A prelude, one weight-shared core applied k times, a coda and a readout, all hookable.

    Args:
        cfg: the architecture; ``cfg.n_iterations`` is the default number of iterations r.
        tokenizer: optional; anything with ``encode(str) -> list[int]`` and ``decode(ids)``
            enables `to_tokens`, `to_string` and string input to `generate`.
    """

    # The task a saved model was trained on (``task.json`` beside its weights), for `dcp-lens run`.
    task_config: dict[str, Any] | None = None
    # The block every prelude, core and coda application is built from (a subclass may use its
    # own `TransformerBlock` subclass, e.g. with a gate on the attention output).
    block_class: type[TransformerBlock] = TransformerBlock
    # Where a loader's architecture breaks an assumption of the protocol: feature -> what it
    # means for a run. `DepthControlProtocol` records it in ``results.metadata["model_caveats"]``.
    protocol_caveats: Mapping[str, str] = MappingProxyType({})
    rotary_cos: Tensor  # [n_ctx, d_head / 2] buffers, rotary models only
    rotary_sin: Tensor

    def __init__(self, cfg: RecurrentConfig, tokenizer: Tokenizer | None = None):
        super().__init__()
        if not isinstance(cfg, RecurrentConfig):
            raise TypeError(f"cfg must be a RecurrentConfig, got {type(cfg).__name__}.")
        self._cfg = copy.deepcopy(cfg)  # the model owns its config: views change n_layers
        cfg = self._cfg
        self.tokenizer = tokenizer
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        if cfg.positional_embedding_type == "learned":
            self.pos_embed: PosEmbed | None = PosEmbed(cfg)
            self.hook_pos_embed: HookPoint | None = HookPoint()
        else:
            self.pos_embed, self.hook_pos_embed = None, None
            with torch.device("cpu"):  # real values even when the model is built on meta
                cos, sin = rotary_tables(cfg.n_ctx, cfg.d_head, cfg.rotary_base, cfg.rotary_scaling)
            self.register_buffer("rotary_cos", cos, persistent=False)
            self.register_buffer("rotary_sin", sin, persistent=False)
        self.inject = Inject(cfg)
        self.hook_readout_in = HookPoint()  # [batch, pos, d_model]
        self.ln_pre_coda = make_norm(cfg) if cfg.pre_coda_norm != "none" else None
        self.ln_final = make_norm(cfg) if cfg.final_norm else NoNorm(cfg)
        self.W_U_untied = (
            None if cfg.tie_unembed else nn.Parameter(torch.empty(cfg.d_model, cfg.d_vocab))
        )
        self.hook_logits = HookPoint()  # [batch, pos, d_vocab]

        self._prelude = [self.block_class(cfg) for _ in range(cfg.n_prelude)]
        self._coda = [self.block_class(cfg) for _ in range(cfg.n_coda)]
        # _core[t][l]: layer l in iteration t + 1; _core[0] owns the parameters, later rows share.
        self._core: list[list[TransformerBlock]] = [
            [self.block_class(cfg) for _ in range(cfg.n_core)]
        ]
        self._iteration_hooks: list[IterationHooks] = [IterationHooks(cfg, 0)]
        self._active = -1
        self._view = ViewState()
        self._view_lists: dict[int, tuple[ViewModuleList, ViewModuleList]] = {}
        self._set_view(cfg.n_iterations)
        self._init_weights()

    # ----------------------------------------------------------------- configuration and views

    @property
    def cfg(self) -> RecurrentConfig:
        return self._cfg

    @property
    def config(self) -> RecurrentConfig:
        """``cfg`` under the name Hugging Face models use (pyvene's `IntervenableModel` reads
        ``model.config``; `dcp_lens.model.peers` enters the class in pyvene's mappings then)."""
        register_with_pyvene(type(self))
        return self._cfg

    @property
    def device(self) -> torch.device:
        """The device of the weights (the embedding's), as Hugging Face models have it."""
        return self.embed.W_E.device

    @property
    def is_dense(self) -> bool:
        return self.cfg.is_dense

    @property
    def n_iterations(self) -> int:
        """Iterations of the active view (the default ``cfg.n_iterations`` outside `iterations`).

        On a dense model, the number of layers (its "iterations" for the protocol)."""
        return self.cfg.n_layers if self.is_dense else self._active

    def _set_view(self, k: int) -> None:
        """Unroll the loop to k iterations: rebuild ``blocks`` and ``loop``, then re-name hooks."""
        if k == self._active:
            return
        while len(self._core) < k:
            self._core.append([self._tied_copy(block) for block in self._core[0]])
        while len(self._iteration_hooks) <= k:
            t = len(self._iteration_hooks)
            hooks = IterationHooks(self.cfg, t)
            self._iteration_hooks.append(hooks)
            self._tie_iteration_norm(hooks)
        if k not in self._view_lists:  # one pair of lists per view, kept for wrappers built on it
            rows = self._core[: k if not self.is_dense else 0]
            core = [block for row in rows for block in row]
            self._view_lists[k] = (
                ViewModuleList(self._prelude + core + self._coda, self._view, k),
                ViewModuleList(self._iteration_hooks[: k + 1], self._view, k),
            )
        self.blocks, self.loop = self._view_lists[k]
        # New blocks and containers follow the model's mode (patching refuses a mixed model).
        self.blocks.train(self.training)
        self.loop.train(self.training)
        self._active = self._view.active = k
        self.cfg.n_layers = len(self.blocks)
        # Before blocks[i]: the iteration that ends there (0: the loop is entered), as
        # docs/design.md §2 reads: s_0 = Init(e) at the loop's start, s_t after iteration t's core.
        P, L = self.cfg.n_prelude, self.cfg.n_core
        self._iteration_ending_at = {} if self.is_dense else {P + t * L: t for t in range(k + 1)}
        self.setup()

    @contextlib.contextmanager
    def iterations(self, k: int) -> Iterator[HookedRecurrentTransformer]:
        """``with model.iterations(k):`` the same weights unrolled to k iterations (k > r allowed).

        Inside the block ``cfg.n_layers`` and every hook name describe the k-iteration view."""
        self._check_iterations(k)
        previous = self._active
        self._set_view(k)
        try:
            yield self
        finally:
            self._set_view(previous)

    def _check_iterations(self, k: object) -> int:
        if self.is_dense:
            raise ValueError(
                "a dense model (n_core = 0) has no loop to unroll; truncate it with "
                "dcp_lens.hooks.truncate(k) or stop_at_layer instead."
            )
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"the number of iterations must be an int, got {k!r}.")
        if k < 1:
            raise ValueError(f"n_iterations={k}: a model with a core needs at least 1 iteration.")
        check_limit("n_iterations", k, "iterations")
        return k

    def _tied_copy(self, block: TransformerBlock) -> TransformerBlock:
        with torch.device("meta"):
            twin = type(block)(self.cfg)
        _share_parameters(twin, block)
        return twin

    def _tie_iteration_norm(self, hooks: IterationHooks) -> None:
        if hooks.ln_iter is None:
            return
        source = (
            self.ln_final
            if self.cfg.iteration_norm == "final"
            else self._iteration_hooks[1].ln_iter
        )
        if source is not None and source is not hooks.ln_iter:
            _share_parameters(hooks.ln_iter, source)

    def reset_hooks(
        self,
        clear_contexts: bool = True,
        direction: Literal["fwd", "bwd", "both"] = "both",
        including_permanent: bool = False,
        level: int | None = None,
    ) -> None:
        """As TransformerLens, but on every block and iteration object the model ever built: a
        hook left on a block of a longer view (``n_iterations=8`` on r = 4) must not outlive it.

        Hook points that hold no hook (and no context) are skipped: every hooked forward ends
        here, and a deep model has a thousand-odd hook points."""
        for hook_point in self._every_hook_point():
            if clear_contexts and hook_point.ctx:
                hook_point.clear_context()
            if hook_point.fwd_hooks or hook_point.bwd_hooks:
                hook_point.remove_hooks(direction, including_permanent, level)
        self.is_caching = False

    def _every_hook_point(self) -> list[HookPoint]:
        """The hook points of the active view (``hook_dict``) and of every block and iteration
        object built for any view, once each; cached until the view or ``hook_dict`` changes."""
        sizes = (len(self.hook_dict), len(self._core), len(self._iteration_hooks))
        cached = self.__dict__.get("_hook_point_cache")
        if cached is not None and cached[0] is self.hook_dict and cached[1] == sizes:
            return cached[2]
        built = [*self._prelude, *(b for row in self._core for b in row), *self._coda]
        points = {id(point): point for point in self.hook_dict.values()}
        for module in [*built, *self._iteration_hooks]:
            for point in module.modules():
                if isinstance(point, HookPoint):
                    points.setdefault(id(point), point)
        every = list(points.values())
        self.__dict__["_hook_point_cache"] = (self.hook_dict, sizes, every)
        return every

    def tie_weights(self) -> None:
        """Make every copy of a shared layer hold its owner's parameters again (after loading)."""
        for row in self._core[1:]:
            for twin, owner in zip(row, self._core[0], strict=True):
                _share_parameters(twin, owner)
        for hooks in self._iteration_hooks[1:]:
            self._tie_iteration_norm(hooks)
        if self.ln_pre_coda is not None and self.cfg.pre_coda_norm == "final":
            _share_parameters(self.ln_pre_coda, self.ln_final)

    def _init_weights(self) -> None:
        """Matrices ~ N(0, init_std^2) from ``cfg.seed``; norms start at 1, biases at 0."""
        generator = torch.Generator().manual_seed(self.cfg.seed if self.cfg.seed is not None else 0)
        for parameter in self.parameters():
            if parameter.ndim >= 2 and parameter.device.type != "meta":
                with torch.no_grad():
                    noise = torch.randn(parameter.shape, generator=generator)
                    parameter.copy_(noise * self.cfg.init_std)
        if self.cfg.pre_coda_norm == "final" and self.ln_pre_coda is not None:
            _share_parameters(self.ln_pre_coda, self.ln_final)

    # ---------------------------------------------------------------------- index helpers

    def block_index(self, iteration: int, layer: int = 0) -> int:
        """Index into ``model.blocks`` of core layer ``layer`` (0..n_core-1) at iteration
        ``iteration`` (1..k). On a dense model iteration t is block t - 1 (layer must be 0)."""
        if self.is_dense:
            if layer != 0 or not 1 <= iteration <= self.cfg.n_layers:
                raise ValueError(
                    f"dense model: iteration must be in 1..{self.cfg.n_layers} and layer 0, "
                    f"got iteration={iteration}, layer={layer}."
                )
            return iteration - 1
        if not 1 <= iteration <= self._active:
            raise ValueError(
                f"iteration={iteration} is outside 1..{self._active} (the active view); "
                f"use `with model.iterations(k):` for more iterations."
            )
        if not 0 <= layer < self.cfg.n_core:
            raise ValueError(f"layer={layer} is outside 0..{self.cfg.n_core - 1} (core layers).")
        return note_block_index(self.cfg.n_prelude + (iteration - 1) * self.cfg.n_core + layer)

    def hook_name(self, iteration: int, layer: int, name: str) -> str:
        """Full hook name of ``name`` (e.g. ``"hook_resid_post"``, ``"attn.hook_pattern"``) in
        core layer ``layer`` at iteration ``iteration``."""
        return IterationHookName(f"blocks.{self.block_index(iteration, layer)}.{name}")

    def state_hook_name(self, t: int) -> str:
        """Hook name of the state after t iterations (t = 0: the initial state).

        On a dense model: ``blocks.{t-1}.hook_resid_post`` (t = 0: ``blocks.0.hook_resid_pre``)."""
        top = self.n_iterations
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= top:
            raise ValueError(f"t={t!r} must be an int in 0..{top} (the active view).")
        if self.is_dense:
            name = "blocks.0.hook_resid_pre" if t == 0 else f"blocks.{t - 1}.hook_resid_post"
            return IterationHookName(name)
        return f"loop.{t}.hook_state"

    def inject_hook_name(self, t: int) -> str:
        """Hook name of u_t, the core's input at iteration t (1..k)."""
        if self.is_dense or not 1 <= t <= self._active:
            raise ValueError(f"t={t!r} must be in 1..{self._active} on a recurrent model.")
        return f"loop.{t}.hook_inject"

    @property
    def readout_hook_name(self) -> str:
        """Hook name of the stream entering the readout (PreCoda, coda, ln_final, unembed)."""
        return "hook_readout_in"

    # -------------------------------------------------------------------------- forward

    def forward(
        self,
        input: Tensor | str | list[str] | None = None,
        return_type: ReturnType = "logits",
        loss_per_token: bool = False,
        *,
        n_iterations: int | None = None,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        tokens: Int[Tensor, "batch pos"] | None = None,
        prelude_output: Float[Tensor, "batch pos d_model"] | None = None,
        past_kv_cache: object = None,
        input_ids: Int[Tensor, "batch pos"] | None = None,
        attention_mask: Tensor | None = None,
    ) -> Any:
        """Run the model.

        Args:
            input: tokens [batch, pos] (or text, with a tokenizer); with ``start_at_layer`` the
                residual stream [batch, pos, d_model] entering ``blocks[start_at_layer]``.
            return_type: ``"logits"`` [batch, pos, d_vocab], ``"loss"`` (mean next-token cross-
                entropy; [batch, pos - 1] with ``loss_per_token``), ``"both"``, or None.
            n_iterations: run k iterations of the same weights instead of the active view's.
            start_at_layer: resume from ``blocks[start_at_layer]``'s ``hook_resid_pre``. Resuming
                inside the loop needs ``prelude_output`` (e) when the injection uses it.
            stop_at_layer: return the stream entering ``blocks[stop_at_layer]`` instead.
            tokens: the tokens, for the loss when ``input`` is a residual stream.
            past_kv_cache: a `KVCache` to read and extend (generation); another library's cache
                is refused with the way to build one.
            input_ids: the tokens under Hugging Face's name, in place of ``input`` (pyvene calls
                ``model(**{"input_ids": tokens})``).
            attention_mask: [batch, pos], True on real tokens (TransformerLens's argument), for
                prompts of different lengths in one batch padded on the left or the right
                (`to_tokens_with_mask`); text input gets its own. One masked pass, each row as its
                real tokens alone (`dcp_lens.model.padding`); with a KV cache, the mask of the
                new tokens (the cache keeps the earlier ones').
        """
        input = _the_input(input, input_ids)
        resumed = (start_at_layer, prelude_output, tokens)
        if attention_mask is not None and any(value is not None for value in resumed):
            raise InputError(
                "attention_mask applies to a forward from tokens, not with start_at_layer, "
                "prelude_output or tokens=; run from the tokens with the mask, or each row's "
                "real tokens alone (tokens[i:i+1, mask[i]])."
            )
        if n_iterations is not None and (self.is_dense or n_iterations != self._active):
            with self.iterations(n_iterations):
                return self.forward(
                    input,
                    return_type,
                    loss_per_token,
                    start_at_layer=start_at_layer,
                    stop_at_layer=stop_at_layer,
                    tokens=tokens,
                    prelude_output=prelude_output,
                    past_kv_cache=past_kv_cache,
                    attention_mask=attention_mask,
                )
        start = self._check_layer("start_at_layer", start_at_layer, 0)
        stop = self._check_layer("stop_at_layer", stop_at_layer, self.cfg.n_layers)
        if stop < start:
            raise ValueError(f"stop_at_layer={stop} comes before start_at_layer={start}.")
        past_kv_cache = self.check_past_kv_cache(past_kv_cache)
        offset = past_kv_cache.length if past_kv_cache is not None else 0
        padding: Padding | None = None
        if start_at_layer is None:
            if isinstance(input, (str, list)) and attention_mask is None:
                input, attention_mask = self.to_tokens_with_mask(input)
            tokens = self._as_tokens(input, offset)
            past_mask = past_kv_cache.attention_mask if past_kv_cache is not None else None
            padding = padding_for(attention_mask, tokens.shape, tokens.device, past_mask, offset)
            if past_kv_cache is not None:
                past_kv_cache.attention_mask = None if padding is None else padding.key_mask
            x = self._embed(tokens, offset, padding)
        else:
            x = self._resumed_stream(input, start, prelude_output)
        x = self._run_blocks(
            x,
            (start, stop),
            start_at_layer is not None,
            tokens,
            prelude_output,
            past_kv_cache,
            padding,
        )
        if stop_at_layer is not None:  # as TransformerLens: the stream, even at n_layers
            return x
        if padding is not None and return_type is not None:
            logits = self._finish(x, "logits", tokens, loss_per_token)
            assert isinstance(logits, Tensor) and tokens is not None
            return padded_outputs(logits, tokens, padding.query_mask, return_type, loss_per_token)
        return self._finish(x, return_type, tokens, loss_per_token)

    def _resumed_stream(
        self, input: object, start: int, embedding: Tensor | None
    ) -> Float[Tensor, "batch pos d_model"]:
        """The residual stream ``input`` resumed at ``blocks[start]``, checked: its shape, and the
        prelude's output ``embedding`` (e) given when a later iteration injects it."""
        if not isinstance(input, Tensor) or input.ndim != 3 or input.shape[-1] != self.cfg.d_model:
            raise ValueError(
                "with start_at_layer, input must be a residual stream [batch, pos, d_model="
                f"{self.cfg.d_model}], got {getattr(input, 'shape', type(input).__name__)}."
            )
        if not self.is_dense:
            # Resuming before the last iteration: later iterations inject e again.
            P, L = self.cfg.n_prelude, self.cfg.n_core
            needs_e = self.cfg.injection != "none" and P <= start < P + (self._active - 1) * L
            if embedding is None and needs_e:
                raise ResumeError(
                    f"start_at_layer={start} is inside the loop; pass prelude_output (e, the "
                    "prelude's output) so later iterations can inject it."
                )
        return input

    def _run_blocks(
        self,
        x: Float[Tensor, "batch pos d_model"],
        span: tuple[int, int],
        resumed: bool,
        tokens: Tensor | None,
        embedding: Tensor | None,
        past_kv_cache: KVCache | None,
        padding: Padding | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """The stream ``x`` entering ``blocks[start]`` carried to the one entering
        ``blocks[stop]`` (``span``: start, stop), crossing every iteration's boundary on the way:
        the loop's entry, each iteration's state, the readout's input. A ``resumed`` stream has
        already crossed the boundary before ``blocks[start]``; ``embedding`` is the prelude's
        output e when the caller has it; ``padding``: a padded batch's masks and positions."""
        start, stop = span
        offset = past_kv_cache.length if past_kv_cache is not None else 0
        rotary = self._rotary(x.shape[1], offset, padding)
        key_mask = None if padding is None else padding.key_mask
        for i in range(start, stop + 1):
            if i > start or not resumed:
                t = self._iteration_ending_at.get(i)
                if t == 0:
                    embedding = x
                    x, _ = self._enter_loop(embedding, tokens, past_kv_cache, offset, padding)
                elif t is not None:
                    x, _ = self._finish_iteration(t, x, embedding)
                elif self.is_dense and i == self.cfg.n_layers:
                    x = self.hook_readout_in(x)
            if i == stop:
                break
            cache = past_kv_cache[i] if past_kv_cache is not None else None
            x = self._apply_block(i, x, rotary, cache, key_mask)
        return x

    def _apply_block(
        self,
        i: int,
        x: Float[Tensor, "batch pos d_model"],
        rotary: tuple[Tensor, Tensor] | None,
        cache: Any,
        key_mask: Tensor | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """``blocks[i]`` on the stream entering it (a subclass adds what runs between blocks);
        ``key_mask`` [batch, past + pos] in a padded batch (`dcp_lens.model.padding`)."""
        return self.blocks[i](x, rotary, cache, key_mask)

    def readout(
        self,
        state: Float[Tensor, "batch pos d_model"],
        return_type: ReturnType = "logits",
        tokens: Int[Tensor, "batch pos"] | None = None,
        loss_per_token: bool = False,
    ) -> Any:
        """Run only the readout on a state: ``hook_readout_in``, PreCoda, coda, ln_final, unembed.

        This is how a truncated or calibrated condition is read out from a cached state."""
        x = self._enter_readout(state)
        rotary = self._rotary(x.shape[1], 0)
        for block in [] if self.is_dense else self._coda:
            x = block(x, rotary, None)
        return self._finish(x, return_type, tokens, loss_per_token)

    def _enter_loop(
        self,
        embedding: Tensor,
        tokens: Tensor | None = None,
        kv_cache: KVCache | None = None,
        offset: int = 0,
        padding: Padding | None = None,
    ) -> tuple[Tensor, Tensor]:
        """s_0 = Init(e), then the first iteration's input u_1 = Inject(s_0, e)."""
        initial = self._initial_state(embedding, tokens, kv_cache, offset, padding)
        state = self._iteration_hooks[0].hook_state(initial)
        return self._next_input(0, state, embedding), state

    def _finish_iteration(
        self, t: int, x: Tensor, embedding: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """s_t = IterationNorm(core output); then u_{t+1} = Inject(s_t, e), or after the last
        iteration the readout's input."""
        hooks = self._iteration_hooks[t]
        state = hooks.hook_state(x if hooks.ln_iter is None else hooks.ln_iter(x))
        return self._next_input(t, state, embedding), state

    def _next_input(self, t: int, state: Tensor, embedding: Tensor | None) -> Tensor:
        if t == self._active:
            return self._enter_readout(state)
        if embedding is None:  # resumed inside the loop: only an injection-free loop goes on
            if self.cfg.injection != "none":
                raise ResumeError(
                    f"iteration {t + 1} injects e, which a stream resumed with start_at_layer "
                    "does not carry; pass prelude_output=e."
                )
            return self._iteration_hooks[t + 1].hook_inject(state)
        return self._iteration_hooks[t + 1].hook_inject(self.inject(state, embedding))

    def _enter_readout(self, state: Tensor) -> Tensor:
        state = self.hook_readout_in(state)
        return state if self.ln_pre_coda is None else self.ln_pre_coda(state)

    def _finish(
        self, x: Tensor, return_type: ReturnType, tokens: Tensor | None, loss_per_token: bool
    ) -> Tensor | tuple[Tensor, Tensor] | None:
        if return_type is None:
            return None
        logits = self.hook_logits(self.ln_final(x) @ self.W_U)
        if return_type == "logits":
            return logits
        if tokens is None:
            raise ValueError(
                "return_type='loss' needs the tokens: pass tokens=... with a residual input."
            )
        loss = next_token_loss(logits, tokens, per_token=loss_per_token)
        if return_type == "loss":
            return loss
        if return_type == "both":
            return logits, loss
        raise ValueError(
            f"return_type={return_type!r} is not one of 'logits', 'loss', 'both', None."
        )

    def _initial_state(
        self,
        embedding: Tensor,
        tokens: Tensor | None = None,
        kv_cache: KVCache | None = None,
        offset: int = 0,
        padding: Padding | None = None,
    ) -> Tensor:
        """s_0: zeros, e, or noise drawn causally (`dcp_lens.model.noise`): position p's noise
        depends only on ``cfg.state_init_seed``, p and ``tokens[:, :p+1]``, so it is the same in
        a prefix's forward, in generation with or without a KV cache (the cache carries the
        prefix state), at any number of iterations and in any batch, slot or padding (with the
        attention mask, ``padding``: p and the prefix are the row's own real tokens)."""
        kind = self.cfg.state_init
        if kind == "zeros":
            return torch.zeros_like(embedding)
        if kind == "embed":
            return embedding
        state = getattr(kv_cache, NOISE_PREFIX, None) if kv_cache is not None else None
        if kv_cache is not None and state is None and tokens is not None and offset > 0:
            raise ResumeError(
                f"this KV cache holds {offset} positions but not the prefix state the "
                f"initial-state noise (state_init={kind!r}) continues from; extend only a cache "
                "this model's forward started (as generate does)."
            )
        noise, after = causal_noise(
            tokens,
            embedding.shape[1],
            embedding.shape[2],
            self.cfg.state_init_seed,
            truncated=kind == "huginn",
            state=state,
            batch=embedding.shape[0],
            mask=None if padding is None else padding.query_mask,
            positions=None if padding is None else padding.positions,
        )
        if kv_cache is not None and after is not None:
            setattr(kv_cache, NOISE_PREFIX, after)
        scale = self.cfg.state_init_std * (self.cfg.embed_scale if kind == "huginn" else 1.0)
        return (noise * scale).to(device=embedding.device, dtype=embedding.dtype)

    def _embed(self, tokens: Tensor, offset: int, padding: Padding | None = None) -> Tensor:
        x = self.hook_embed(self.embed(tokens))
        if self.pos_embed is not None and self.hook_pos_embed is not None:
            rows = None if padding is None else padding.positions
            positions = self.pos_embed(tokens.shape[1], offset, rows).expand_as(x)  # TL: [b, p, d]
            x = x + self.hook_pos_embed(positions)
        return x

    def _rotary(
        self, n_positions: int, offset: int, padding: Padding | None = None
    ) -> tuple[Tensor, Tensor] | None:
        """cos and sin [pos, d_head / 2], or [batch, pos, d_head / 2] in a padded batch."""
        if self.pos_embed is not None:
            return None
        dtype = self.embed.W_E.dtype
        if padding is not None:
            rows = padding.positions.to(self.rotary_cos.device)
            return self.rotary_cos[rows].to(dtype), self.rotary_sin[rows].to(dtype)
        cos = self.rotary_cos[offset : offset + n_positions].to(dtype)
        sin = self.rotary_sin[offset : offset + n_positions].to(dtype)
        return cos, sin

    def _check_layer(self, name: str, value: int | None, default: int) -> int:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}.")
        if value < 0:
            value += self.cfg.n_layers
        if not 0 <= value <= self.cfg.n_layers:
            raise ValueError(f"{name}={value} is outside 0..{self.cfg.n_layers} (cfg.n_layers).")
        return value

    def to(self: _ModelT, *args: Any, **kwargs: Any) -> _ModelT:
        """`torch.nn.Module.to`, with an unavailable device refused in one line."""
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            check_device(device)
        return super().to(*args, **kwargs)

    def cuda(self: _ModelT, device: int | torch.device | None = None) -> _ModelT:
        """`torch.nn.Module.cuda`, with a missing GPU refused in one line."""
        check_device(f"cuda:{device}" if isinstance(device, int) else device or "cuda")
        return super().cuda(device)

    def _apply(self: _ModelT, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> _ModelT:
        """Every move or cast (``.to``, ``.half``, ``.float``, ``.cuda``, ``.cpu``) ends here:
        ``cfg.dtype`` and ``cfg.device`` then follow the weights, as TransformerLens keeps them."""
        result = super()._apply(fn, recurse)
        self.sync_cfg_to_weights()
        return result

    def sync_cfg_to_weights(self) -> None:
        """Set ``cfg.dtype`` and ``cfg.device`` to the embedding's (a model on meta keeps both)."""
        weight = self.embed.W_E
        if weight.device.type == "meta":
            return
        self.cfg.dtype = weight.dtype
        self.cfg.device = str(weight.device)

    # ------------------------------------------------------------------ save and load

    def canonical_state_dict(self) -> dict[str, Tensor]:
        """Each parameter once, under a name that does not depend on the unrolled view:
        ``prelude.{i}.…``, ``core.{l}.…``, ``coda.{c}.…``, ``embed.W_E``, …"""
        return canonical.state_dict_of(self)

    def load_canonical_state_dict(
        self, state: dict[str, Tensor], source: str = "state dict"
    ) -> None:
        """Copy a `canonical_state_dict` into the model (strict: names and shapes must match)."""
        canonical.load_into(self, state, source)

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (each shared tensor once) to a folder,
        each whole or not at all and, inside a folder a command is writing, recorded as the
        command's own before it lands (`dcp_lens.utils.files.written_atomically`)."""
        from safetensors.torch import save_file

        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        self.cfg.to_json(folder / CONFIG_FILE)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.canonical_state_dict().items()}
        with written_atomically(folder / SINGLE_FILE) as partial:
            save_file(tensors, str(partial), metadata={"format": "dcp-lens"})
        return folder

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device | None = None, **overrides: Any
    ) -> HookedRecurrentTransformer:
        """Load a folder written by `save_pretrained` (safetensors only, never pickle);
        ``overrides`` replace config fields (e.g. ``n_iterations=8``). The config and the
        weights' shapes and dtypes are checked on the meta device before anything is allocated
        (`dcp_lens.model.folder.load_pretrained_folder`)."""
        return load_pretrained_folder(cls, path, device=device, **overrides)

    def load_state_dict(
        self, state_dict: Mapping[str, Tensor], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """`torch.nn.Module.load_state_dict`, then re-tie the shared weights."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.tie_weights()
        return result

    def extra_repr(self) -> str:
        c = self.cfg
        kind = (
            "dense"
            if self.is_dense
            else f"{c.n_prelude} + {c.n_core} x {self._active} + {c.n_coda}"
        )
        return f"{kind} blocks, d_model={c.d_model}, n_heads={c.n_heads}, d_vocab={c.d_vocab}"


def _the_input(input: object, input_ids: object) -> Any:
    """The tokens (or stream) given once: as ``input`` or as Hugging Face's ``input_ids``."""
    if input is None:
        if input_ids is None:
            raise InputError("pass the tokens as input (or as input_ids=...).")
        return input_ids
    if input_ids is not None:
        raise InputError("pass the tokens once: as input or as input_ids, not both.")
    return input


def _share_parameters(twin: nn.Module, owner: nn.Module) -> None:
    """Point every parameter of ``twin`` at the same ``nn.Parameter`` object as ``owner``'s."""
    for twin_module, owner_module in zip(twin.modules(), owner.modules(), strict=True):
        for name, parameter in owner_module._parameters.items():
            twin_module._parameters[name] = parameter


__all__ = [
    "HookedRecurrentTransformer",
    "IterationHooks",
    "LayerNorm",
    "RMSNorm",
    "next_token_loss",
]
