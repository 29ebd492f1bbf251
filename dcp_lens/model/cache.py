"""`RecurrentActivationCache`: TransformerLens's `ActivationCache` whose decompositions add up on a
recurrent model.

TransformerLens decomposes the stream as embeddings plus every ``attn_out`` and ``mlp_out``, which
holds only for a pre-norm stack with nothing re-injected. Here every decomposition goes through
`dcp_lens.model.stream.StreamWalk`: the re-injected embedding, a noise initial state and norms
inside the stream (frozen at their cached scales) are part of it, so

- ``decompose_resid(layer)`` and ``get_full_resid_decomposition(layer)`` sum to the stream
  entering block ``layer`` (``layer = n_layers``: the stream entering ``ln_final``);
- ``accumulated_resid``'s last entry is the stream entering ``ln_final`` (so with
  ``apply_ln=True`` it times ``W_U`` plus ``b_U`` is the logits, as in TransformerLens);
- ``stack_head_results`` / ``stack_neuron_results`` give each head's / neuron's contribution to
  that stream, and ``hook_result`` sums to ``hook_attn_out`` (Ouro's sandwich norm included);
- ``apply_ln_to_stack`` at the final norm applies its cached scale and its weight, so
  ``logit_attrs`` of a decomposition plus ``model.b_U`` (the norm's bias) is the logit, and it
  reads the final norm correctly when there is none.

What cannot be made exact raises a `DecompositionError` naming what to use instead.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor
from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.utilities.slice import Slice, SliceInput

from dcp_lens.model.components.block import OUTPUT_NORMED
from dcp_lens.model.components.norms import LayerNorm, RMSNorm
from dcp_lens.model.names import (
    BLOCK_NAME,
    DepthMismatchError,
    IterationHookName,
    ViewedModel,
    warn_block_index_once,
)
from dcp_lens.model.stream import (
    DecompositionError,
    StreamPoint,
    StreamSource,
    StreamWalk,
    final_stream,
)


class RecurrentActivationCache(ActivationCache):
    """An `ActivationCache` of a `HookedRecurrentTransformer` (see the module docstring).

    It remembers the number of iterations it was recorded at (``recorded_iterations``): a
    ``blocks.{i}`` name means another block at another depth, so reading one while the model runs
    another view raises a `DepthMismatchError` naming both depths (``loop.{t}`` names mean the
    same state at every depth and are read at any)."""

    def __init__(
        self,
        cache_dict: dict[str, Tensor],
        model: ViewedModel,
        has_batch_dim: bool = True,
        recorded_iterations: int | None = None,
    ) -> None:
        super().__init__(cache_dict, model, has_batch_dim=has_batch_dim)
        self.viewed_model = model  # `model`, typed as what reading its view needs
        self.recorded_iterations = (
            model.n_iterations if recorded_iterations is None else recorded_iterations
        )

    def __getitem__(self, key: str | tuple[str | int | None, ...]) -> Tensor:
        if isinstance(key, tuple) and len(key) > 1 and key[1] is not None:
            self._check_depth(f"{key[0]!r} at layer {key[1]}")
        elif isinstance(key, str) and BLOCK_NAME.match(key):
            self._check_depth(repr(key))
            if not isinstance(key, IterationHookName):
                warn_block_index_once(self.viewed_model, key)
        return super().__getitem__(key)

    def _check_depth(self, what: str) -> None:
        model = self.viewed_model
        active = model.n_iterations
        if model.is_dense or active == self.recorded_iterations:
            return
        k = self.recorded_iterations
        raise DepthMismatchError(
            f"cache[{what}]: this cache was recorded at k = {k} iterations, but the model now runs "
            f"k = {active}; blocks.{{i}} names a different block at each depth. Read or patch "
            f"with it inside `with model.iterations({k}):`, or record the cache again at k = "
            f"{active} (model.run_with_cache(tokens, n_iterations={active}))."
        )

    # ------------------------------------------------------------------------- helpers

    def _walk(self) -> StreamWalk:
        self._check_depth("a decomposition")
        if not self.has_batch_dim:
            raise DecompositionError(
                "stream decompositions need the batch dimension the cache was recorded with; "
                "decompose first, then index the batch (cache.remove_batch_dim() drops it)."
            )
        return StreamWalk(self.model, self)

    @staticmethod
    def _slice(pos_slice: Slice | SliceInput) -> Slice:
        return pos_slice if isinstance(pos_slice, Slice) else Slice(pos_slice)

    # ----------------------------------------------------------------- TransformerLens API

    def apply_slice_to_batch_dim(self, batch_slice: Slice | SliceInput) -> RecurrentActivationCache:
        sliced = super().apply_slice_to_batch_dim(batch_slice)
        return RecurrentActivationCache(
            sliced.cache_dict,
            self.viewed_model,
            has_batch_dim=sliced.has_batch_dim,
            recorded_iterations=self.recorded_iterations,
        )

    def accumulated_resid(  # type: ignore[override]
        self,
        layer: int | None = None,
        incl_mid: bool = False,
        apply_ln: bool = False,
        pos_slice: Slice | SliceInput = None,
        mlp_input: bool = False,
        return_labels: bool = False,
    ) -> Tensor | tuple[Tensor, list[str]]:
        """As TransformerLens, but the ``final_post`` entry is the stream entering ``ln_final``
        (after any per-iteration and pre-coda norm), so ``apply_ln=True`` then ``@ W_U + b_U``
        gives the logits. Intermediate entries are each block's input, with ``apply_ln``
        normalised by ``ln_final`` (its own statistics, its weight; its bias is in ``b_U``):
        not the truncated model's readout, which `dcp_lens.lenses.logit_lens` gives.

        Returns [entry, batch, pos, d_model] (``pos`` as ``pos_slice`` leaves it)."""
        n = self.model.cfg.n_layers
        layer = n if layer is None or layer == -1 else layer
        pos_slice = self._slice(pos_slice)
        labels: list[str] = []
        parts: list[Tensor] = []
        for index in range(layer + 1):
            if index == n:
                parts.append(final_stream(self.model, self))
                labels.append("final_post")
                continue
            parts.append(self[f"blocks.{index}.hook_resid_pre"])
            labels.append(f"{index}_pre")
            if (incl_mid and index < layer) or (mlp_input and index == layer):
                parts.append(self[f"blocks.{index}.hook_resid_mid"])
                labels.append(f"{index}_mid")
        stack = torch.stack([pos_slice.apply(p, dim=-2) for p in parts])
        if apply_ln:
            stack = self.apply_ln_to_stack(
                stack,
                layer,
                pos_slice=pos_slice,
                mlp_input=mlp_input,
                has_batch_dim=self.has_batch_dim,
                recompute_ln=layer == n,
            )
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(  # type: ignore[override]
        self,
        residual_stack: Tensor,
        layer: int | None = None,
        mlp_input: bool = False,
        pos_slice: Slice | SliceInput = None,
        batch_slice: Slice | SliceInput = None,
        has_batch_dim: bool = True,
        recompute_ln: bool = False,
    ) -> Tensor:
        """As TransformerLens, with one convention for the final norm (``layer = n_layers``):
        ``stack @ W_U + b_U`` is the logits, ``model.b_U`` being ``ln_final``'s bias through
        ``W_U`` (no single component carries it). Components are centred (LayerNorm), divided by
        the cached ``ln_final.hook_scale`` and multiplied by ``ln_final``'s weight, so times
        `tokens_to_residual_directions` they sum to the logit less ``b_U``. ``recompute_ln``
        (`accumulated_resid`) normalises each entry by its own statistics, then applies the
        weight and not the bias, the same convention. A model without a final norm (Ouro
        normalises each step's state instead) leaves the stack unchanged there.

        ``residual_stack``: [component, batch, pos, d_model] (or without batch); same shape out."""
        n = self.model.cfg.n_layers
        layer = n if layer is None or layer == -1 else layer
        weight = getattr(self.model.ln_final, "w", None)
        if layer == n and weight is None:
            batch_slice = self._slice(batch_slice)
            return batch_slice.apply(residual_stack, dim=1) if has_batch_dim else residual_stack
        scaled = super().apply_ln_to_stack(
            residual_stack, layer, mlp_input, pos_slice, batch_slice, has_batch_dim, recompute_ln
        )
        if layer == n and not recompute_ln and weight is not None:
            scaled = scaled * weight
        bias = getattr(self.model.ln_final, "b", None)
        if layer == n and recompute_ln and bias is not None:
            scaled = scaled - bias  # ln_final whole, less the bias that b_U carries
        return scaled

    def decompose_resid(  # type: ignore[override]
        self,
        layer: int | None = None,
        mlp_input: bool = False,
        mode: Literal["all", "mlp", "attn"] = "all",
        apply_ln: bool = False,
        pos_slice: Slice | SliceInput = None,
        incl_embeds: bool = True,
        return_labels: bool = False,
    ) -> Tensor | tuple[Tensor, list[str]]:
        """The stream entering block ``layer`` (``n_layers``: entering ``ln_final``) as a stack
        [component, batch, pos, d_model] that sums to it: ``embed``, ``pos_embed``,
        ``init_state``, each ``inject_{t}``, each block's ``{i}_attn_out`` / ``{i}_mlp_out`` as
        carried to that point through the norms and adapters in between, and ``bias``.

        ``mode`` keeps only attention or MLP outputs; ``incl_embeds=False`` drops the
        components that are not block outputs (embed, pos_embed, init_state, inject, bias)."""
        walk = self._walk()
        point = walk.point(layer, mlp_input)
        sources, values = walk.components(point)
        keep = []
        for source, value in zip(sources, values, strict=True):
            if source.kind == "attn" and mode == "mlp" or source.kind == "mlp" and mode == "attn":
                continue
            if source.kind not in ("attn", "mlp") and not incl_embeds:
                continue
            keep.append((source.label, value))
        pos_slice = self._slice(pos_slice)
        if not keep:  # e.g. mode="attn" before any block: an empty stack, not an error
            stream = pos_slice.apply(walk.stream(point), dim=-2)
            empty = stream.new_zeros((0, *stream.shape))
            return (empty, []) if return_labels else empty
        stack = torch.stack([pos_slice.apply(value, dim=-2) for _, value in keep])
        if apply_ln:
            stack = self.apply_ln_to_stack(
                stack, point_layer(self, point), pos_slice=pos_slice, mlp_input=mlp_input
            )
        labels = [label for label, _ in keep]
        return (stack, labels) if return_labels else stack

    def _ensure_head_results(self) -> bool:
        """``blocks.{i}.attn.hook_result`` [batch, pos, head, d_model], each head's share of
        ``hook_attn_out`` (through the sandwich norm's cached scale where the block has one)."""
        all_cached = True
        for index in range(self.model.cfg.n_layers):
            key = f"blocks.{index}.attn.hook_result"
            if key in self.cache_dict:
                continue
            all_cached = False
            block = self.model.blocks[index]
            z = self[f"blocks.{index}.attn.hook_z"]
            result = torch.einsum("...hd,hdm->...hm", z, block.attn.W_O.to(z.dtype))
            if block.placement in OUTPUT_NORMED:
                result = self._through_norm(result, block.ln1_post, f"blocks.{index}.ln1_post")
            self.cache_dict[key] = result
        return all_cached

    def _through_norm(self, value: Tensor, norm: LayerNorm | RMSNorm, name: str) -> Tensor:
        """``value`` [batch, pos, n, d_model] through a norm frozen at its cached scale."""
        scale = self[f"{name}.hook_scale"][..., None, :]
        if hasattr(norm, "b"):
            value = value - value.mean(-1, keepdim=True)
        return value / scale * norm.w

    def get_neuron_results(  # type: ignore[override]
        self,
        layer: int,
        neuron_slice: Slice | SliceInput = None,
        pos_slice: Slice | SliceInput = None,
        project_output_onto: Tensor | None = None,
    ) -> Tensor:
        """Each neuron's share of ``blocks.{layer}.hook_mlp_out`` [batch, pos, neuron, d_model]
        (through the sandwich norm's cached scale where the block has one; ``b_out`` apart)."""
        block = self.model.blocks[layer]
        if block.placement not in OUTPUT_NORMED:
            return super().get_neuron_results(layer, neuron_slice, pos_slice, project_output_onto)
        if project_output_onto is not None:
            raise DecompositionError(
                "project_output_onto is not supported through a sandwich norm; project the "
                "returned [batch, pos, neuron, d_model] results yourself."
            )
        neuron_slice, pos_slice = self._slice(neuron_slice), self._slice(pos_slice)
        acts = neuron_slice.apply(self[f"blocks.{layer}.mlp.hook_post"], dim=-1)
        W_out = neuron_slice.apply(block.mlp.W_out, dim=0)
        result = self._through_norm(
            acts[..., None] * W_out, block.ln2_post, f"blocks.{layer}.ln2_post"
        )
        return pos_slice.apply(result, dim=-3)

    def _expanded(
        self, point: StreamPoint, kind: str, walk: StreamWalk, upto: int
    ) -> tuple[list[Tensor], list[str]]:
        """Per-head (kind "attn") or per-neuron ("mlp") contributions of blocks < ``upto`` at
        ``point``, each [batch, pos, n, d_model]."""
        stacks, labels = [], []
        for source in walk.sources:
            if source.kind != kind or source.layer is None or source.layer >= upto:
                continue
            if walk.points[point][1] <= walk.sources.index(source):
                continue
            index = source.layer
            if kind == "attn":
                self._ensure_head_results()
                value = self[f"blocks.{index}.attn.hook_result"]
                labels += [f"L{index}H{h}" for h in range(value.shape[-2])]
            else:
                value = self.get_neuron_results(index)
                labels += [f"L{index}N{n}" for n in range(value.shape[-2])]
            stacks.append(walk.transport(value, source.at, point, extra=1))
        return stacks, labels

    def stack_head_results(  # type: ignore[override]
        self,
        layer: int = -1,
        return_labels: bool = False,
        incl_remainder: bool = False,
        pos_slice: Slice | SliceInput = None,
        apply_ln: bool = False,
    ) -> Tensor | tuple[Tensor, list[str]]:
        """Every head of blocks < ``layer``: its contribution to the stream entering block
        ``layer`` (``n_layers``: entering ``ln_final``), [head_component, batch, pos, d_model];
        with ``incl_remainder`` the rest of the stream last, so the stack sums to it."""
        walk = self._walk()
        point = walk.point(layer)
        upto = self.model.cfg.n_layers if layer in (None, -1) else layer
        stacks, labels = self._expanded(point, "attn", walk, upto)
        return self._finish_stack(
            walk, point, stacks, labels, incl_remainder, pos_slice, apply_ln, return_labels
        )

    def stack_neuron_results(  # type: ignore[override]
        self,
        layer: int,
        pos_slice: Slice | SliceInput = None,
        neuron_slice: Slice | SliceInput = None,
        return_labels: bool = False,
        incl_remainder: bool = False,
        apply_ln: bool = False,
        project_output_onto: Tensor | None = None,
        mlp_input: bool = False,
    ) -> Tensor | tuple[Tensor, list[str]]:
        """Every neuron of blocks < ``layer``: its contribution to the stream entering block
        ``layer`` (``n_layers``: entering ``ln_final``), [neuron_component, batch, pos, d_model]
        (MLP output biases are not neurons: they are in the remainder)."""
        if neuron_slice is not None or project_output_onto is not None:
            raise DecompositionError(
                "neuron_slice and project_output_onto are not supported on a recurrent model; "
                "slice or project the returned stack (its rows are labelled L{layer}N{neuron})."
            )
        walk = self._walk()
        point = walk.point(layer, mlp_input)
        upto = self.model.cfg.n_layers if layer in (None, -1) else layer
        stacks, labels = self._expanded(point, "mlp", walk, upto)
        return self._finish_stack(
            walk, point, stacks, labels, incl_remainder, pos_slice, apply_ln, return_labels
        )

    def _finish_stack(
        self,
        walk: StreamWalk,
        point: StreamPoint,
        stacks: list[Tensor],
        labels: list[str],
        incl_remainder: bool,
        pos_slice: Slice | SliceInput,
        apply_ln: bool,
        return_labels: bool,
    ) -> Tensor | tuple[Tensor, list[str]]:
        d_model = self.model.cfg.d_model
        stream = walk.stream(point)
        if stacks:
            stack = torch.cat(stacks, dim=-2).movedim(-2, 0)
        else:
            stack = stream.new_zeros((0, *stream.shape))
        if incl_remainder:
            stack = torch.cat([stack, (stream - stack.sum(0))[None]])
            labels = [*labels, "remainder"]
        pos_slice = self._slice(pos_slice)
        stack = pos_slice.apply(stack, dim=-2)
        if apply_ln:
            stack = self.apply_ln_to_stack(
                stack, point_layer(self, point), pos_slice=pos_slice, mlp_input=point[0] == "mid"
            )
        assert stack.shape[-1] == d_model
        return (stack, labels) if return_labels else stack

    def get_full_resid_decomposition(  # type: ignore[override]
        self,
        layer: int | None = None,
        mlp_input: bool = False,
        expand_neurons: bool = True,
        apply_ln: bool = False,
        pos_slice: Slice | SliceInput = None,
        return_labels: bool = False,
        project_output_onto: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, list[str]]:
        """Every head, every neuron (or MLP layer, without ``expand_neurons``), then ``embed``,
        ``pos_embed``, ``init_state``, each ``inject_{t}`` and ``bias`` (MLP output biases and
        LayerNorm biases inside the stream): a stack that sums to the stream entering block
        ``layer`` (``n_layers``: entering ``ln_final``)."""
        if project_output_onto is not None:
            raise DecompositionError(
                "project_output_onto is not supported on a recurrent model; multiply the "
                "returned [component, batch, pos, d_model] stack by your projection."
            )
        walk = self._walk()
        point = walk.point(layer, mlp_input)
        n = self.model.cfg.n_layers
        upto = n if layer in (None, -1) else layer
        heads, labels = self._expanded(point, "attn", walk, upto + (1 if mlp_input else 0))
        parts = [torch.cat(heads, dim=-2).movedim(-2, 0)] if heads else []
        sources, values = walk.components(point)
        if expand_neurons:
            neurons, neuron_labels = self._expanded(point, "mlp", walk, upto)
            if neurons:
                parts.append(torch.cat(neurons, dim=-2).movedim(-2, 0))
                labels += neuron_labels
        rest: list[Tensor] = []
        bias: Tensor | None = None
        for source, value in zip(sources, values, strict=True):
            if source.kind in ("attn", "mlp"):
                carried = self._sandwich_bias(walk, source, point, value)
                if carried is not None:
                    bias = carried if bias is None else bias + carried
            if source.kind == "attn":
                continue
            if source.kind == "mlp":
                if not expand_neurons:
                    labels.append(source.label)
                    parts.append(value[None])
                    continue
                b_out = getattr(self.model.blocks[source.layer].mlp, "b_out", None)
                if b_out is None:
                    continue
                carried = self._mlp_bias(walk, source, point, b_out, value)
                bias = carried if bias is None else bias + carried
                continue
            if source.kind == "bias":
                bias = value if bias is None else bias + value
                continue
            labels.append(source.label)
            rest.append(value[None])
        parts += rest
        if bias is not None or expand_neurons:
            stream = walk.stream(point)
            labels.append("bias")
            parts.append((bias if bias is not None else torch.zeros_like(stream))[None])
        pos_slice = self._slice(pos_slice)
        stack = pos_slice.apply(torch.cat(parts), dim=-2)
        if apply_ln:
            stack = self.apply_ln_to_stack(
                stack, point_layer(self, point), pos_slice=pos_slice, mlp_input=mlp_input
            )
        return (stack, labels) if return_labels else stack

    def _mlp_bias(
        self,
        walk: StreamWalk,
        source: StreamSource,
        point: StreamPoint,
        b_out: Tensor,
        value: Tensor,
    ) -> Tensor:
        """An MLP's ``b_out`` carried to ``point`` (through its sandwich norm, if any)."""
        bias = torch.ones_like(value[..., :1]) * b_out
        block = self.model.blocks[source.layer]
        if block.placement in OUTPUT_NORMED:
            bias = self._through_norm(
                bias[..., None, :], block.ln2_post, f"blocks.{source.layer}.ln2_post"
            )[..., 0, :]
        return walk.transport(bias, source.at, point)

    def _sandwich_bias(
        self, walk: StreamWalk, source: StreamSource, point: StreamPoint, value: Tensor
    ) -> Tensor | None:
        """A LayerNorm sandwich norm's own bias (heads and neurons are centred and scaled only)."""
        block = self.model.blocks[source.layer]
        if block.placement not in OUTPUT_NORMED:
            return None
        norm = block.ln1_post if source.kind == "attn" else block.ln2_post
        if not hasattr(norm, "b"):
            return None
        return walk.transport(torch.ones_like(value[..., :1]) * norm.b, source.at, point)

    def logit_lens(self, **kwargs: object) -> Tensor:
        """Refused: TransformerLens's logit lens applies only ``ln_final`` and ``W_U`` to each
        block's input, which on a recurrent model is not what the model reads out."""
        raise DecompositionError(
            "cache.logit_lens() applies ln_final and W_U to each block's input, skipping the "
            "per-iteration norm, the pre-coda norm and the coda a recurrent model reads out "
            "through; use dcp_lens.lenses.logit_lens(model, cache) (the lens at iteration t "
            "equals truncate(t)'s logits)."
        )

    def compute_ssm_effective_attention(self, *args: object, **kwargs: object) -> Tensor:
        raise DecompositionError(
            "compute_ssm_effective_attention: this model has attention, no SSM mixers; read "
            "the attention patterns (blocks.{i}.attn.hook_pattern) instead."
        )

    def compute_ssm_state(self, *args: object, **kwargs: object) -> Tensor:
        raise DecompositionError(
            "compute_ssm_state: this model has no SSM mixers; its recurrent state is "
            "loop.{t}.hook_state (model.state_hook_name(t))."
        )


def point_layer(cache: ActivationCache, point: StreamPoint) -> int:
    """The TransformerLens ``layer`` of a stream point (``n_layers`` for the final stream)."""
    return cache.model.cfg.n_layers if point[0] == "final" else int(point[1])
