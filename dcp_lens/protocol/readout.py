"""`readouts`: the logits of every condition of one k from one batch's cached states (the fast
path), read out together where that fills the device."""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor

from dcp_lens.protocol.conditions import Condition, Full, ProtocolModel

# The most positions one CPU readout call takes when it groups several conditions.
CPU_READOUT_ROWS = 2048


def readouts(
    model: ProtocolModel,
    n_iterations: int,
    states: Float[Tensor, "r_plus_1 batch pos d_model"],
    conditions: dict[str, Condition | None],
    full_logits: Float[Tensor, "batch pos d_vocab"],
) -> dict[str, Tensor]:
    """The logits of every condition of one k; a condition equal to another at this depth
    (replay(r) = truncate(r)) is read out once, one whose logits are full depth's rearranged
    (`Condition.logits_from_full`, the base rate) not at all; NaN for a condition that is None
    (a map it needs could not be fitted).

    On an accelerator the conditions go through one readout call (a larger batch fills the
    device). On the CPU they are grouped into calls of at most `CPU_READOUT_ROWS` positions
    (one condition a call above it): past that a larger batch makes no matrix product faster,
    only the temporaries larger (on the `dcp-lens bench` model five conditions of 2048
    positions read out one at a time took 0.20 s against 0.24 s in one call)."""
    r = n_iterations
    logits: dict[Condition, Tensor] = {}
    for condition in _distinct(r, conditions):
        # Full depth's logits are already known (truncate(r) = replay(r) = full).
        known = full_logits if isinstance(condition, Full) else None
        known = condition.logits_from_full(full_logits) if known is None else known
        if known is not None:
            logits[condition] = known
    to_read = needed_readouts(r, conditions)
    for chunk in readout_groups(states, len(to_read)):
        chunk_conditions = to_read[chunk]
        inputs = [condition.readout_input(states) for condition in chunk_conditions]
        read = model.readout(inputs[0] if len(inputs) == 1 else torch.cat(inputs))
        logits.update(zip(chunk_conditions, read.chunk(len(inputs)), strict=True))
    missing = torch.full_like(full_logits, math.nan)
    return {name: missing if c is None else logits[c.at_depth(r)] for name, c in conditions.items()}


def needed_readouts(n_iterations: int, conditions: dict[str, Condition | None]) -> list[Condition]:
    """The readouts `readouts` runs for ``conditions`` at depth ``n_iterations``: each distinct
    condition once, less full depth and those rearranged from its logits. `dcp-lens bench`
    counts them as the sweep's irreducible work."""
    return [
        condition
        for condition in _distinct(n_iterations, conditions)
        if not isinstance(condition, Full) and not _from_full(condition)
    ]


def readout_groups(states: Tensor, n_readouts: int) -> list[slice]:
    """How `readouts` splits ``n_readouts`` readouts of ``states``' batch into calls: all in one
    on an accelerator, at most `CPU_READOUT_ROWS` positions a call (at least one readout) on the
    CPU."""
    group = n_readouts
    if states.device.type == "cpu":
        positions = states[0].numel() // states.shape[-1]
        group = max(1, CPU_READOUT_ROWS // max(1, positions))
    return [slice(start, start + group) for start in range(0, n_readouts, max(1, group))]


def _distinct(r: int, conditions: dict[str, Condition | None]) -> list[Condition]:
    return list(dict.fromkeys(c.at_depth(r) for c in conditions.values() if c is not None))


def _from_full(condition: Condition) -> bool:
    """Whether ``condition``'s logits come from full depth's (asked of a meta tensor: no data)."""
    return condition.logits_from_full(torch.empty(0, 0, 0, device="meta")) is not None
