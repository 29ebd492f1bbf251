"""TransformerLens's hook surface on a recurrent model: caches and hooks named in the view of
``n_iterations``, hook names checked against the active view, and forward hooks checked for the
shape they return."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from torch import Tensor
from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.HookedRootModule import HookedRootModule

from dcp_lens.model.cache import RecurrentActivationCache
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.names import (
    HookName,
    PatchShapeError,
    missing_hook_error,
    warn_block_index_once,
)
from dcp_lens.utils.errors import UnsupportedToolError

HookT = TypeVar("HookT", bound="HookSurface")
# A hook as TransformerLens calls it, ``hook(activation, hook=point)``: a replacement or None.
HookFunction = Callable[..., Tensor | None]


class HookSurface(HookedRootModule):
    """Mixin of `HookedRecurrentTransformer`: ``run_with_cache``, ``run_with_hooks``, ``hooks``
    and ``add_hook`` as TransformerLens has them, in the view of ``n_iterations``."""

    if TYPE_CHECKING:

        @property
        def cfg(self) -> RecurrentConfig: ...

        @property
        def n_iterations(self) -> int: ...

        @property
        def is_dense(self) -> bool: ...

        def iterations(self, k: int) -> contextlib.AbstractContextManager[object]: ...

    def run_with_cache(
        self, *model_args: Any, **kwargs: Any
    ) -> tuple[Any, ActivationCache | dict[str, Tensor]]:
        """Like TransformerLens: returns (output, `ActivationCache`) with every iteration's
        activations under its own ``blocks.{i}`` name. With ``n_iterations=k`` the cache is
        recorded in the k-iteration view (use ``with model.iterations(k):`` to analyse it);
        with ``return_cache_object=False`` the cache is a plain ``{hook name: tensor}`` dict."""
        n_iterations = kwargs.pop("n_iterations", None)
        if n_iterations is not None and not self.is_dense:
            with self.iterations(n_iterations):
                return self.run_with_cache(*model_args, **kwargs)
        return_cache_object = kwargs.pop("return_cache_object", True)
        output, cache_dict = super().run_with_cache(*model_args, **kwargs)
        if not return_cache_object:  # as TransformerLens: the plain {hook name: tensor} dict
            return output, cache_dict
        has_batch_dim = not kwargs.get("remove_batch_dim", False)
        return output, RecurrentActivationCache(cache_dict, self, has_batch_dim=has_batch_dim)

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Refused when turned on: this model builds no per-head Q/K/V input forks, which
        TransformerLens's direct-path patching needs."""
        if use_split_qkv_input:
            raise UnsupportedToolError(
                "set_use_split_qkv_input(True): this model builds no per-head copies of the "
                "stream entering Q, K and V, so transformer_lens.patching.get_act_patch_direct_path"
                " cannot run; patch a head's q, k or v (get_act_patch_attn_head_q_by_pos, …) or "
                "write the edge patch with model.run_with_hooks."
            )

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """Refused when turned on: this model builds no per-head attention input forks."""
        if use_attn_in:
            raise UnsupportedToolError(
                "set_use_attn_in(True): this model builds no per-head attention inputs; hook "
                "blocks.{i}.ln1.hook_normalized (every head's shared input) instead."
            )

    def run_with_hooks(self, *model_args: Any, **kwargs: Any) -> Any:
        """Like TransformerLens; hook names refer to the view of ``n_iterations`` if given.

        A name another view has raises a `DepthMismatchError` saying which ``k`` has it, and a
        forward hook returning a tensor of another shape than its activation raises a
        `PatchShapeError` at that hook (its name and both shapes)."""
        for name, _ in kwargs.get("fwd_hooks", []):
            warn_block_index_once(self, name)
        n_iterations = kwargs.pop("n_iterations", None)
        if n_iterations is not None and not self.is_dense:
            with self.iterations(n_iterations):
                return super().run_with_hooks(*model_args, **kwargs)
        return super().run_with_hooks(*model_args, **kwargs)

    @contextlib.contextmanager
    def hooks(
        self: HookT,
        fwd_hooks: Sequence[tuple[HookName, HookFunction]] = (),
        bwd_hooks: Sequence[tuple[HookName, HookFunction]] = (),
        reset_hooks_end: bool = True,
        clear_contexts: bool = False,
    ) -> Iterator[HookT]:
        """TransformerLens's ``hooks`` context, with names checked against the active view and
        forward hooks checked for the shape they return (see `run_with_hooks`)."""
        checked = [(self._checked_name(name), shape_checked(hook)) for name, hook in fwd_hooks]
        backward = [(self._checked_name(name), hook) for name, hook in bwd_hooks]
        with super().hooks(checked, backward, reset_hooks_end, clear_contexts):
            yield self

    def add_hook(  # type: ignore[override]
        self,
        name: HookName,
        hook: HookFunction,
        dir: Literal["fwd", "bwd"] = "fwd",
        is_permanent: bool = False,
        level: int | None = None,
        prepend: bool = False,
    ) -> None:
        """TransformerLens's ``add_hook``, with the checks of `run_with_hooks`."""
        warn_block_index_once(self, name)
        hook = shape_checked(hook) if dir == "fwd" else hook
        super().add_hook(self._checked_name(name), hook, dir, is_permanent, level, prepend)

    def _checked_name(self, name: HookName) -> HookName:
        if isinstance(name, str) and name not in self.mod_dict:
            raise missing_hook_error(self, name)
        return name


def shape_checked(hook: HookFunction) -> HookFunction:
    """``hook`` with what it returns checked against the activation's shape."""
    if getattr(hook, "shape_checked", False):
        return hook

    def checked(activation: object, *args: object, **kwargs: object) -> Tensor | None:
        try:
            result = hook(activation, *args, **kwargs)
        except RuntimeError as error:
            if "size" not in str(error) or not isinstance(activation, Tensor):
                raise
            name = getattr(kwargs.get("hook"), "name", None) or "a hook point"
            raise PatchShapeError(
                f"the hook on {name} failed on its activation of shape "
                f"{tuple(activation.shape)}: {error} (a patch cached from a prompt of another "
                "length or batch must be sliced or padded to this run's positions first)."
            ) from error
        if (
            isinstance(result, Tensor)
            and isinstance(activation, Tensor)
            and result.shape != activation.shape
        ):
            point = kwargs.get("hook")
            name = getattr(point, "name", None) or "a hook point"
            raise PatchShapeError(
                f"the hook on {name} returned a tensor of shape {tuple(result.shape)}, but the "
                f"activation it replaces has shape {tuple(activation.shape)}; return a tensor of "
                "that shape (a patch cached from a prompt of another length or batch must be "
                "sliced or padded to this run's positions first)."
            )
        return result

    checked.shape_checked = True  # type: ignore[attr-defined]
    checked.__name__ = repr(hook)
    return checked
