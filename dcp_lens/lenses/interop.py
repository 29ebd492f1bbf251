"""Glue between the unrolled loop and tools that think in blocks: patching results and SAEs.

- `split_by_iteration`: a per-block result (``transformer_lens.patching``'s ``[n_layers, pos]``,
  ``[3, n_layers, pos]``, ...) regrouped as prelude ``[n_prelude, ...]``, core
  ``[iteration, layer, ...]`` and coda ``[n_coda, ...]``.
- `splice_hooks`: fwd_hooks that pass the state after one or every iteration through an
  encode/decode module (a sparse autoencoder, a transcoder, any callable). SAELens cannot be
  installed beside TransformerLens 4, so nothing here depends on it: any object with ``encode``
  and ``decode`` works.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass

from jaxtyping import Float
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.protocol.conditions import HookList, IterationModel


@dataclass
class IterationSplit:
    """A per-block result regrouped by the loop's structure.

    Attributes:
        prelude: the prelude blocks' entries, the block dimension first: ``[n_prelude, ...]``.
        core: the core's entries, ``[iteration, layer, ...]`` (iteration t = 1..k is row t - 1).
            On a dense model every block is an "iteration": ``[n_layers, 1, ...]``.
        coda: the coda blocks' entries, ``[n_coda, ...]``.
    """

    prelude: Tensor
    core: Tensor
    coda: Tensor


def split_by_iteration(
    model: HookedRecurrentTransformer, result: Tensor, layer_dim: int = 0
) -> IterationSplit:
    """Regroup ``result``, whose dimension ``layer_dim`` runs over ``model.blocks`` (the active
    view's ``cfg.n_layers``), into prelude, core ``[iteration, layer, ...]`` and coda.

    The block dimension is moved first in every part: ``get_act_patch_block_every``'s
    ``[3, n_layers, pos]`` with ``layer_dim=1`` gives a core of ``[iteration, layer, 3, pos]``.
    """
    n_layers = model.cfg.n_layers
    if result.shape[layer_dim] != n_layers:
        raise ValueError(
            f"result has {result.shape[layer_dim]} entries along dim {layer_dim} but the model's "
            f"active view has {n_layers} blocks; patch and split inside the same "
            "`with model.iterations(k):`, or pass the right layer_dim."
        )
    blocks = result.movedim(layer_dim, 0)
    if model.is_dense:
        empty = blocks[:0]
        return IterationSplit(prelude=empty, core=blocks[:, None], coda=empty)
    P, L, k = model.cfg.n_prelude, model.cfg.n_core, model.n_iterations
    core = blocks[P : P + k * L]
    return IterationSplit(
        prelude=blocks[:P],
        core=core.reshape(k, L, *core.shape[1:]),
        coda=blocks[P + k * L :],
    )


def splice_hooks(
    model: IterationModel,
    module: object,
    iterations: int | Sequence[int] | None = None,
    *,
    use_error_term: bool = False,
    edit: Callable[[int, Tensor], Tensor] | None = None,
    record: MutableMapping[int, Tensor] | None = None,
) -> HookList:
    """fwd_hooks replacing the state s_t by ``decode(encode(s_t))`` at each t of ``iterations``.

    Args:
        model: the model whose state hooks (``model.state_hook_name(t)``) to use.
        module: anything with ``encode`` and ``decode`` (an SAE); or a callable, applied as the
            whole map (its output is then the "latents" ``edit`` and ``record`` see).
        iterations: one t, several, or None for every iteration 1..k of the active view.
        use_error_term: add back the reconstruction error ``s_t - decode(encode(s_t))``, so
            the forward pass is unchanged until ``edit`` changes the latents (SAELens's
            ``use_error_term``).
        edit: ``edit(t, latents) -> latents``, applied before decoding (e.g. ablate a feature).
        record: a dict that receives ``record[t] = latents`` (before ``edit``) on every pass.

    Returns:
        ``[(hook_name, hook), ...]`` for ``model.run_with_hooks`` or ``with model.hooks(...)``.
    """
    encode, decode = _codec(module)
    if iterations is None:
        wanted = list(range(1, model.n_iterations + 1))
    elif isinstance(iterations, int):
        wanted = [iterations]
    else:
        wanted = list(iterations)

    def spliced(t: int) -> Callable[..., Tensor]:
        def hook(
            state: Float[Tensor, "batch pos d_model"], hook: HookPoint
        ) -> Float[Tensor, "batch pos d_model"]:
            latents = encode(state)
            if record is not None:
                record[t] = latents.detach()
            edited = latents if edit is None else edit(t, latents)
            output = decode(edited)
            if use_error_term:
                output = output + (state - decode(latents)).detach()
            return output.to(state.dtype)

        return hook

    return [(model.state_hook_name(t), spliced(t)) for t in wanted]


def _codec(module: object) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    encode, decode = getattr(module, "encode", None), getattr(module, "decode", None)
    if callable(encode) and callable(decode):
        return encode, decode
    if callable(module):
        return module, _identity
    raise TypeError(
        f"{type(module).__name__} has no encode/decode and is not callable; pass an SAE "
        "(encode, decode) or a function of the state."
    )


def _identity(x: Tensor) -> Tensor:
    return x
