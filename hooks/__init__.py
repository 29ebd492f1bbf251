"""The Depth Control Protocol's conditions as TransformerLens hook sets (``dcp_lens.hooks``).

This folder installs as ``dcp_lens.hooks`` and only re-exports: the conditions live, typed and
type-checked, in `dcp_lens.protocol.conditions`, where each class holds its hook form, its closed
form over
cached states and its (B, D) coordinates.

>>> from dcp_lens import hooks
>>> linchpin = hooks.replay(1).fwd_hooks(model)  # doctest: +SKIP
>>> logits = model.run_with_hooks(tokens, fwd_hooks=linchpin)  # doctest: +SKIP
"""

from dcp_lens.protocol.conditions import (
    Calibrate,
    Condition,
    Full,
    IterationModel,
    Replay,
    Shift,
    StateMap,
    Truncate,
    calibrate,
    full,
    replay,
    shift,
    truncate,
)

__all__ = [
    "Calibrate",
    "Condition",
    "Full",
    "IterationModel",
    "Replay",
    "Shift",
    "StateMap",
    "Truncate",
    "calibrate",
    "full",
    "replay",
    "shift",
    "truncate",
]
