"""The Depth Control Protocol's interventions as TransformerLens hook sets (``dcp_lens.hooks``).

>>> from dcp_lens import hooks
>>> linchpin = hooks.replay(1).fwd_hooks(model)  # doctest: +SKIP
>>> logits = model.run_with_hooks(tokens, fwd_hooks=linchpin)  # doctest: +SKIP
"""

from dcp_lens.hooks.interventions import (
    Intervention,
    calibrate,
    full,
    replay,
    shift,
    truncate,
)

__all__ = ["Intervention", "calibrate", "full", "replay", "shift", "truncate"]
