"""Hook names across depths: what ``blocks.{i}`` means in an unrolled loop, and the errors for a
name, cache or patch used at another depth than it belongs to.

``blocks.{i}`` counts block applications of the active view (prelude, k times the core, coda),
as TransformerLens's utilities need (`transformer_lens.patching` loops over ``cfg.n_layers``
blocks). A TransformerLens user who reads ``cache["blocks.3.hook_resid_post"]`` as "layer 3" gets
iteration 1's second core layer on a model with one prelude block and two core layers, so the
first such read from user code warns once (`BlockIndexWarning`), pointing to
``model.hook_name(t, layer, name)``, whose names (`IterationHookName`) never warn.
"""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Protocol, runtime_checkable

from dcp_lens.model.config import RecurrentConfig
from dcp_lens.utils.errors import DCPLensError

BLOCK_NAME = re.compile(r"^blocks\.(\d+)\.")
LOOP_NAME = re.compile(r"^loop\.(\d+)\.")
# Modules whose reads of block names follow the model's own view (no warning for them).
_LIBRARY_PREFIXES = ("dcp_lens.", "transformer_lens.", "hooks.")
# Frames of runtime type checkers that wrap the package's functions (tests run under them).
_WRAPPERS = ("jaxtyping", "beartype", "typeguard")
_warned = False
# Indices ``model.block_index`` handed out: a ``blocks.{i}`` name built from one of them was built
# from an iteration and a layer (``f"blocks.{model.block_index(t, layer)}.hook_z"``), so it does
# not warn.
_helper_indices: set[int] = set()

# A hook point's name, or TransformerLens's filter on names.
HookName = str | Callable[[str], bool]


@runtime_checkable
class ViewedModel(Protocol):
    """What naming a hook point in the active view reads of a model."""

    @property
    def cfg(self) -> RecurrentConfig: ...

    @property
    def n_iterations(self) -> int: ...

    @property
    def is_dense(self) -> bool: ...


class DepthMismatchError(DCPLensError):
    """A cache, hook name, patch or wrapper used at another number of iterations than the one it
    was recorded or built at."""


class HookNameError(DCPLensError):
    """A hook name that names no hook point of the model's active view."""


class PatchShapeError(DCPLensError):
    """A forward hook returned a tensor whose shape differs from the activation it replaces."""


class BlockIndexWarning(UserWarning):
    """``blocks.{i}`` read as a layer index on a looped model (see the module docstring)."""


class IterationHookName(str):
    """A hook name made by the model's iteration-aware helpers (``hook_name``): reading it never
    warns, since it was built from an iteration and a layer."""

    __slots__ = ()


def block_index(name: str) -> int | None:
    """i of a ``blocks.{i}.…`` name, else None."""
    match = BLOCK_NAME.match(name)
    return int(match.group(1)) if match else None


def describe_block(model: ViewedModel, index: int) -> str:
    """What ``blocks.{index}`` is in the model's active view, in words."""
    cfg = model.cfg
    P, L = cfg.n_prelude, cfg.n_core
    k = model.n_iterations
    if index < P:
        return f"prelude block {index}"
    if index < P + k * L:
        t, layer = divmod(index - P, L)
        return f"iteration {t + 1}'s core layer {layer} (model.hook_name({t + 1}, {layer}, …))"
    return f"coda block {index - P - k * L}"


def called_from_user() -> bool:
    """Whether the code that called into the model or cache is outside dcp-lens and
    TransformerLens (so a name read there is the user's own).

    Walks up from here past this module, the one entry point that called it (the cache's
    ``__getitem__``, ``run_with_hooks``, ``add_hook``) and any type-checking wrappers around it."""
    frame: FrameType | None = sys._getframe(1)
    entry_seen = False
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module == __name__ or module.startswith(_WRAPPERS):
            frame = frame.f_back
            continue
        if not entry_seen:
            entry_seen = True
            frame = frame.f_back
            continue
        return not module.startswith(_LIBRARY_PREFIXES)
    return True


def note_block_index(index: int) -> int:
    """Record that ``model.block_index`` returned ``index`` to user code (names built from it
    do not warn); the library's own calls record nothing. Returns ``index``."""
    if called_from_user():
        _helper_indices.add(index)
    return index


def warn_block_index_once(model: ViewedModel, name: HookName) -> None:
    """Warn the first time user code reads ``blocks.{i}`` on a looped model (once per process),
    unless the name was built with the model's helpers: ``hook_name``, or an index that
    ``block_index`` returned."""
    global _warned
    if _warned or isinstance(name, IterationHookName) or not isinstance(name, str):
        return
    index = block_index(name)
    if index is None or getattr(model, "is_dense", True) or index >= model.cfg.n_layers:
        return
    if index in _helper_indices:
        return
    if not called_from_user():
        return
    _warned = True
    warnings.warn(
        f"{name!r}: blocks.{{i}} counts block applications of the unrolled loop (prelude, "
        f"{model.n_iterations} x {model.cfg.n_core} core layers, coda), so blocks.{index} is "
        f"{describe_block(model, index)}, not layer or iteration {index}; name iteration t's core "
        "layer with model.hook_name(t, layer, name). (Shown once.)",
        BlockIndexWarning,
        stacklevel=_user_stacklevel(),
    )


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside this module, wrappers and the entry point."""
    frame: FrameType | None = sys._getframe(1)
    level, entry_seen = 1, False
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if not (module == __name__ or module.startswith(_WRAPPERS)):
            if entry_seen:
                return level
            entry_seen = True
        frame, level = frame.f_back, level + 1
    return 1


def reset_block_index_warning() -> None:
    """Let the next read of a ``blocks.{i}`` name warn again, whatever indices ``block_index``
    returned before (for tests)."""
    global _warned
    _warned = False
    _helper_indices.clear()


def missing_hook_error(model: ViewedModel, name: str) -> DCPLensError:
    """The error for a hook name the active view does not have: another depth's name says which
    depth has it and how to get there."""
    k, n_layers = model.n_iterations, model.cfg.n_layers
    index = block_index(name)
    loop = LOOP_NAME.match(name)
    view = f"the active view has k = {k} iterations, blocks.0 .. blocks.{n_layers - 1}"
    if index is not None and index >= n_layers and not model.is_dense:
        cfg = model.cfg
        needed = -(-(index + 1 - cfg.n_prelude - cfg.n_coda) // cfg.n_core)
        return DepthMismatchError(
            f"hook name {name!r} is not in the model at this depth: {view}. It exists from k = "
            f"{needed} iterations on: add the hook inside `with model.iterations(k):` (k >= "
            f"{needed}), the same view the name was made in."
        )
    if loop is not None and int(loop.group(1)) > k and not model.is_dense:
        t = int(loop.group(1))
        return DepthMismatchError(
            f"hook name {name!r} names iteration {t}, but {view}; add the hook inside `with "
            f"model.iterations(k):` with k >= {t}."
        )
    return HookNameError(
        f"no hook point is named {name!r} ({view}); model.hook_dict lists every name, and "
        "model.hook_name(t, layer, name) / model.state_hook_name(t) build them."
    )
