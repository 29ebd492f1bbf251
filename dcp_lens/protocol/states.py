"""Capture iteration states: the one helper dcp-lens uses to read s_t off a forward pass."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from dcp_lens.protocol.conditions import ProtocolModel


def capture_states(
    model: ProtocolModel,
    tokens: Int[Tensor, "batch pos"],
    iterations: Sequence[int] | None = None,
    *,
    stop_after_last: bool = False,
    **forward_kwargs: object,
) -> tuple[Float[Tensor, "n_states batch pos d_model"], Any]:
    """One forward pass with a hook on the state after each t of ``iterations``.

    Args:
        model: a `HookedRecurrentTransformer` or any model with ``state_hook_name`` and
            ``run_with_hooks`` (hook names refer to its active view).
        tokens: the input.
        iterations: the t to capture (0 = the initial state), in the order wanted; repeats are
            allowed. Default: every t in 0..r of the active view.
        stop_after_last: end the forward once the latest wanted state is captured (the rest
            of the loop, the coda and the unembedding are not run; the output is then None).
        forward_kwargs: passed on to ``run_with_hooks`` (``return_type``, ``stop_at_layer``, ...).

    Returns:
        ``(states, output)``: ``states[i]`` is s_t for ``t = iterations[i]``, and the forward's
        output (the logits unless ``forward_kwargs`` say otherwise).
    """
    wanted = list(range(model.n_iterations + 1)) if iterations is None else list(iterations)
    if not wanted:
        raise ValueError("iterations is empty; name at least one iteration t to capture.")
    names = {t: model.state_hook_name(t) for t in wanted}
    captured: dict[str, Tensor] = {}
    last = names[max(wanted)]

    def keep(name: str) -> Callable[[Tensor, object], None]:
        def hook(state: Tensor, hook: object) -> None:
            captured[name] = state
            if stop_after_last and name == last:
                raise _Captured

        return hook

    unique = list(dict.fromkeys(names.values()))
    output = None
    try:  # run_with_hooks removes its hooks on the way out, exception or not
        output = model.run_with_hooks(
            tokens, fwd_hooks=[(name, keep(name)) for name in unique], **forward_kwargs
        )
    except _Captured:
        pass
    return torch.stack([captured[names[t]] for t in wanted]), output


class _Captured(Exception):
    """Ends a forward early: every state asked for is captured."""
