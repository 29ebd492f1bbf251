"""The residual stream of a recurrent model as an exact sum of components.

On a plain pre-norm transformer the stream entering layer L *is* the sum of the embeddings and
every earlier ``attn_out`` and ``mlp_out``. A recurrent model's stream is not: every iteration
re-injects the prelude output e (``add``: s + e; ``concat_adapter``: W [s; e]), the initial state
may be noise, and norms sit inside the stream (Huginn renormalises the residual sum after each
sublayer, Ouro normalises the state after each step). Each of those is *linear once the norm's
scale is frozen at its cached value*, so the stream is still a sum of components, each carried
along the path from where it entered to the point read:

    stream(point) = sum_c  T_{c -> point}(value_c)

where T is a composition of linear maps (a norm with its cached ``hook_scale``; the state half
of a concat adapter; zero when the state is re-initialised). Components: ``embed``,
``pos_embed``, ``init_state`` (a noise initial state), ``inject_{t}`` (what iteration t's
injection adds: e, or e's half of the adapter), every block's ``{i}_attn_out`` / ``{i}_mlp_out``,
and ``bias`` (LayerNorm biases of norms inside the stream, when there are any).

`StreamWalk` follows the forward pass over a cache and gives those components at any point; the
model's `RecurrentActivationCache` uses it so TransformerLens's decompositions add up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from dcp_lens.utils.errors import DCPLensError

# A point of the stream: ("pre", i), ("mid", i), ("post", i), ("state", t), ("readout_in",),
# ("final",) (the stream entering ln_final).
StreamPoint = tuple[str | int, ...]
# A linear map on [*batch_pos, *extra, d_model]; ``extra`` counts the dims between them.
LinearOp = Callable[[Tensor, int], Tensor]


class DecompositionError(DCPLensError):
    """A decomposition that cannot be made exact on this cache or architecture."""


@dataclass
class StreamSource:
    """One component: its label, kind, the block it comes from, where it enters (an index into
    the walk's ops) and its value there [*batch_pos, d_model]."""

    label: str
    kind: str  # "embed" | "pos_embed" | "init_state" | "inject" | "attn" | "mlp" | "bias"
    layer: int | None
    at: int
    value: Tensor


class StreamWalk:
    """The forward pass of ``model`` replayed over ``cache`` as linear maps and components.

    Args:
        model: a `HookedRecurrentTransformer` in the view the cache was recorded in.
        cache: a mapping of hook names to tensors from ``model.run_with_cache`` (every norm's
            ``hook_scale`` inside the stream must be in it).
    """

    def __init__(self, model: Any, cache: Any):
        refusal = getattr(model, "stream_refusal", None)
        if refusal:  # an architecture whose stream this walk does not follow
            raise DecompositionError(refusal)
        self.model = model
        self.cache = cache
        self.ops: list[LinearOp] = []
        self.sources: list[StreamSource] = []
        self.points: dict[StreamPoint, tuple[int, int]] = {}
        self._walk()

    # ------------------------------------------------------------------ building the walk

    def _get(self, name: str) -> Tensor:
        try:
            return self.cache[name]
        except KeyError as error:
            raise DecompositionError(
                f"the cache holds no {name!r}, which the stream decomposition needs; record it "
                "with model.run_with_cache(tokens) without a names_filter that drops it."
            ) from error

    def _source(self, label: str, kind: str, value: Tensor, layer: int | None = None) -> None:
        self.sources.append(StreamSource(label, kind, layer, len(self.ops), value))

    def _mark(self, point: StreamPoint) -> None:
        self.points[point] = (len(self.ops), len(self.sources))

    def _norm(self, module: Any, name: str) -> None:
        """A norm inside the stream: linear with its cached scale; a LayerNorm's bias enters."""
        if module is None or not hasattr(module, "w"):
            return
        scale = self._get(f"{name}.hook_scale")
        gain = module.w
        centre = hasattr(module, "b")

        def op(x: Tensor, extra: int, scale: Tensor = scale, gain: Tensor = gain) -> Tensor:
            s = scale.reshape(*scale.shape[:-1], *([1] * extra), 1)
            if centre:
                x = x - x.mean(-1, keepdim=True)
            return x / s * gain

        self.ops.append(op)
        if centre:
            ones = torch.ones_like(scale)
            self._source("bias", "bias", ones * module.b)

    def _walk(self) -> None:
        model, cfg = self.model, self.model.cfg
        self._source("embed", "embed", self._get("hook_embed"))
        if model.pos_embed is not None:
            self._source("pos_embed", "pos_embed", self._get("hook_pos_embed"))
        n, P = cfg.n_layers, cfg.n_prelude
        embedding: Tensor | None = None
        for i in range(n + 1):
            t = model._iteration_ending_at.get(i)
            if t == 0:
                embedding = (
                    self._get(f"blocks.{P - 1}.hook_resid_post")
                    if P > 0
                    else self._embedding_from_embeds()
                )
                self._enter_loop()
                self._next_input(0, embedding)
            elif t is not None:
                hooks = model.loop[t]
                self._norm(hooks.ln_iter, f"loop.{t}.ln_iter")
                self._mark(("state", t))
                self._next_input(t, embedding)
            elif model.is_dense and i == n:
                self._mark(("readout_in",))
            if i == n:
                break
            self._block(i)
        self._mark(("final",))

    def _embedding_from_embeds(self) -> Tensor:
        embed = self._get("hook_embed")
        return embed if self.model.pos_embed is None else embed + self._get("hook_pos_embed")

    def _enter_loop(self) -> None:
        kind = self.model.cfg.state_init
        if kind == "embed":
            self._mark(("state", 0))
            return
        self.ops.append(lambda x, extra: torch.zeros_like(x))  # s_0 does not carry e
        if kind != "zeros":
            self._source("init_state", "init_state", self._get("loop.0.hook_state"))
        self._mark(("state", 0))

    def _next_input(self, t: int, embedding: Tensor | None) -> None:
        model = self.model
        if t == model.n_iterations:
            self._mark(("readout_in",))
            self._norm(model.ln_pre_coda, "ln_pre_coda")
            return
        kind = model.cfg.injection
        assert embedding is not None
        if kind == "add":
            self._source(f"inject_{t + 1}", "inject", embedding, t + 1)
        elif kind == "concat_adapter":
            W = model.inject.W_adapter  # [d_model, 2 d_model]: state half, then e half
            d = W.shape[0]
            state_half = W[:, :d].T

            def adapter(x: Tensor, extra: int, weight: Tensor = state_half) -> Tensor:
                return x @ weight

            self.ops.append(adapter)
            self._source(f"inject_{t + 1}", "inject", embedding @ W[:, d:].T, t + 1)

    def _block(self, i: int) -> None:
        block = self.model.blocks[i]
        self._mark(("pre", i))
        self._source(f"{i}_attn_out", "attn", self._get(f"blocks.{i}.hook_attn_out"), i)
        if block.placement == "sandwich_residual":
            self._norm(block.ln1_post, f"blocks.{i}.ln1_post")
        self._mark(("mid", i))
        self._source(f"{i}_mlp_out", "mlp", self._get(f"blocks.{i}.hook_mlp_out"), i)
        if block.placement == "sandwich_residual":
            self._norm(block.ln2_post, f"blocks.{i}.ln2_post")
        self._mark(("post", i))

    # ------------------------------------------------------------------------- reading

    def point(self, layer: int | None, mlp_input: bool = False) -> StreamPoint:
        """The point TransformerLens's ``layer`` / ``mlp_input`` name: the input of block
        ``layer`` (its MLP input with ``mlp_input``), or with layer = n_layers the stream entering
        ``ln_final``."""
        n = self.model.cfg.n_layers
        if layer is None or layer == -1:
            layer = n
        if not 0 <= layer <= n:
            raise DecompositionError(f"layer={layer} is outside 0..{n} (cfg.n_layers).")
        if layer == n:
            if mlp_input:
                raise DecompositionError("mlp_input=True names no MLP at layer = n_layers.")
            return ("final",)
        return ("mid" if mlp_input else "pre", layer)

    def transport(self, value: Tensor, start: int, point: StreamPoint, extra: int = 0) -> Tensor:
        """Carry ``value`` [*batch_pos, *extra, d_model], entering before op ``start``, to
        ``point``."""
        end = self.points[point][0]
        for op in self.ops[start:end]:
            value = op(value, extra)
        return value

    def components(
        self, point: StreamPoint
    ) -> tuple[list[StreamSource], list[Float[Tensor, "*batch_pos d_model"]]]:
        """The sources entered before ``point`` and their contributions there (biases summed
        into one ``bias`` entry, placed last)."""
        _, n_sources = self.points[point]
        sources, values = [], []
        bias: Tensor | None = None
        for source in self.sources[:n_sources]:
            value = self.transport(source.value, source.at, point)
            if source.kind == "bias":
                bias = value if bias is None else bias + value
                continue
            sources.append(source)
            values.append(value)
        if bias is not None:
            sources.append(StreamSource("bias", "bias", None, 0, bias))
            values.append(bias)
        return sources, values

    def stream(self, point: StreamPoint) -> Tensor:
        """The cached stream at ``point`` (what the components must add up to)."""
        model = self.model
        kind = point[0]
        if kind in ("pre", "mid", "post"):
            suffix = {"pre": "resid_pre", "mid": "resid_mid", "post": "resid_post"}[kind]
            return self._get(f"blocks.{point[1]}.hook_{suffix}")
        if kind == "state":
            return self._get(model.state_hook_name(point[1]))
        if kind == "readout_in":
            return self._get("hook_readout_in")
        return final_stream(model, self.cache)


def final_stream(model: Any, cache: Any) -> Float[Tensor, "*batch_pos d_model"]:
    """The stream entering ``ln_final`` (what ``ln_final`` then ``W_U`` turn into the logits)."""
    coda = model.cfg.n_coda if not model.is_dense else 0
    if coda > 0 or model.is_dense:
        return cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    if model.ln_pre_coda is not None:
        return cache["ln_pre_coda.hook_normalized"]
    return cache["hook_readout_in"]
