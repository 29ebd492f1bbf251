"""`readouts`: the logits of every condition of one k from one batch's cached states (the fast
path), read out together where that fills the device."""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor

from dcp_lens.protocol.budget import CPU_READOUT_ROWS, ReadoutPlan
from dcp_lens.protocol.conditions import Condition, Full, ProtocolModel


def readouts(
    model: ProtocolModel,
    n_iterations: int,
    states: Float[Tensor, "r_plus_1 batch pos d_model"],
    conditions: dict[str, Condition | None],
    full_logits: Float[Tensor, "batch pos d_vocab"],
    plan: ReadoutPlan | None = None,
) -> dict[str, Tensor]:
    """The logits of every condition of one k; a condition equal to another at this depth
    (replay(r) = truncate(r)) is read out once, one whose logits are full depth's rearranged
    (`Condition.logits_from_full`, the base rate) not at all; NaN for a condition that is None
    (a map it needs could not be fitted).

    The conditions are grouped into calls of at most ``plan.rows`` positions (one condition a
    call above it). Without a plan: one call on an accelerator, calls of at most
    `CPU_READOUT_ROWS` positions on the CPU, where a larger call makes no matrix product faster,
    only the temporaries larger."""
    r = n_iterations
    logits: dict[Condition, Tensor] = {}
    for condition in _distinct(r, conditions):
        # Full depth's logits are already known (truncate(r) = replay(r) = full).
        known = full_logits if isinstance(condition, Full) else None
        known = condition.logits_from_full(full_logits) if known is None else known
        if known is not None:
            logits[condition] = known
    to_read = needed_readouts(r, conditions)
    for chunk in readout_groups(states, len(to_read), plan):
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


def readout_groups(states: Tensor, n_readouts: int, plan: ReadoutPlan | None = None) -> list[slice]:
    """How `readouts` splits ``n_readouts`` readouts of ``states``' batch into calls: at most
    ``plan.rows`` positions a call (at least one readout); without a plan, all in one on an
    accelerator and at most `CPU_READOUT_ROWS` positions a call on the CPU."""
    positions = states[0].numel() // states.shape[-1]
    if plan is not None:
        rows = plan.rows
    elif states.device.type == "cpu":
        rows = CPU_READOUT_ROWS
    else:
        rows = max(1, n_readouts) * positions
    group = max(1, rows // max(1, positions))
    return [slice(start, start + group) for start in range(0, n_readouts, group)]


def _distinct(r: int, conditions: dict[str, Condition | None]) -> list[Condition]:
    return list(dict.fromkeys(c.at_depth(r) for c in conditions.values() if c is not None))


def _from_full(condition: Condition) -> bool:
    """Whether ``condition``'s logits come from full depth's (asked of a meta tensor: no data)."""
    return condition.logits_from_full(torch.empty(0, 0, 0, device="meta")) is not None
