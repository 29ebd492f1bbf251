"""The canonical state dict of a `HookedRecurrentTransformer`: each parameter once (a shared
core block's under ``core.{l}``, not once per unrolled copy), the form `save_pretrained` writes
and `from_pretrained` reads."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

# The model is typed Any: `HookedRecurrentTransformer` imports this module, and an import of it
# here, even for types only, would close a circle.
Model = Any


def state_dict_of(model: Model) -> dict[str, Tensor]:
    """Each parameter once, under a name that does not depend on the unrolled view:
    ``prelude.{i}.…``, ``core.{l}.…``, ``coda.{c}.…``, ``embed.W_E``, …"""
    owners: list[tuple[str, nn.Module | None]] = [
        ("embed", model.embed),
        ("pos_embed", model.pos_embed),
        ("inject", model.inject),
        ("ln_final", model.ln_final),
        ("ln_pre_coda", model.ln_pre_coda if model.cfg.pre_coda_norm == "own" else None),
    ]
    owners += [(f"prelude.{i}", b) for i, b in enumerate(model._prelude)]
    owners += [(f"core.{i}", b) for i, b in enumerate(model._core[0])]
    owners += [(f"coda.{i}", b) for i, b in enumerate(model._coda)]
    if model.cfg.iteration_norm == "own" and not model.is_dense:
        owners.append(
            (
                "ln_iter",
                model._iteration_hooks[1].ln_iter if len(model._iteration_hooks) > 1 else None,
            )
        )
    state: dict[str, Tensor] = {
        f"{prefix}.{name}": p
        for prefix, module in owners
        if module is not None
        for name, p in module.named_parameters()
    }
    if model.W_U_untied is not None:
        state["unembed.W_U"] = model.W_U_untied
    return state


def load_into(model: Model, state: dict[str, Tensor], source: str = "state dict") -> None:
    """Copy a `state_dict_of` into ``model`` (strict: names and shapes must match)."""
    if len(model._iteration_hooks) < 2 and model.cfg.iteration_norm == "own":
        model._set_view(max(model._active, 1))
    expected = state_dict_of(model)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{source}: missing keys {missing[:10]}{'…' if len(missing) > 10 else ''}, "
            f"unexpected keys {unexpected[:10]}{'…' if len(unexpected) > 10 else ''}."
        )
    for name, parameter in expected.items():
        value = state[name]
        if tuple(value.shape) != tuple(parameter.shape):
            raise ValueError(
                f"{source}: {name} has shape {tuple(value.shape)}, expected "
                f"{tuple(parameter.shape)}."
            )
        with torch.no_grad():
            parameter.copy_(value)
    model.tie_weights()
