"""Planted ground truth: hand-built recurrent models whose truncation gap has a known cause.

Each model is an ordinary `HookedRecurrentTransformer` (no prelude or coda, one core layer, RMS
pre-norm, attention switched off) whose MLP is set by hand. A GELU MLP computes any linear map
exactly, since gelu(z) - gelu(-z) = z, and |z| up to exp(-200) as (gelu(cz) + gelu(-cz)) / c for
large c. Positions do not interact, so every position of a sequence is an independent example.
Run DCP on one (``dcp-lens run --model planted:readout_shift``) to check a setup: it must give the
planted factor >= 90% of the gap's area and the others within 10%; a mixture's shares must lie
within 0.1 of its true shares (`expected_shares`). ``dcp-lens validate`` runs them all.

===============================  ====================================================  ========
model                            mechanism                                             DCP must
===============================  ====================================================  ========
``readout_shift``                answer in e at every depth; a clock rotates by        S
                                 2 pi / 11 each iteration and biases the answer
                                 logits unless at r
``distinct_computation``         one-hot node, one step of a 13-cycle per iteration;   D
                                 the answer is the node after r steps
``block_count``                  every iteration adds the same vote +-delta (sign of   B
                                 an XOR of two input features) to a noisy answer
``readout_shift_by_token_type``  the answer's logits shifted by a turning clock, in    S
                                 opposite directions for two token types
``readout_shift_by_position``    the same, the type set by the position's parity       S
``readout_shift_step``           ``readout_shift`` with the clock turned once, at the  S
                                 last iteration: replay's readout is truncation's
``mixture_shift_distinct``       half the tokens ``readout_shift_step``, half a        S + D
                                 32-cycle
``mixture_shift_blocks``         half the tokens ``readout_shift_step``, half          S + B
                                 ``block_count``
``*_soft``                       the first three with answers drawn from the full-     S, D, B
                                 depth prediction (cross-entropy = KL to full)
===============================  ====================================================  ========
"""

from __future__ import annotations

import inspect
import math
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from dcp_lens.model.tokenization import VocabularyTokenizer
from dcp_lens.protocol.dcp import EvaluationSet
from dcp_lens.protocol.metrics import HIGHER_IS_BETTER, IGNORE_INDEX, per_example_metrics
from dcp_lens.protocol.results import FACTORS
from dcp_lens.protocol.states import capture_states
from dcp_lens.utils.devices import check_device, check_dtype
from dcp_lens.utils.errors import ConfigError, ConfigTypeError
from dcp_lens.zoo.planted.ambiguous import frame_flip_gated, frame_warp, readout_shift_walk
from dcp_lens.zoo.planted.base import SEQUENCE_LENGTH, PlantedModel, PlantedTask
from dcp_lens.zoo.planted.bracket import (
    block_count_context,
    distinct_computation_context,
    distinct_computation_skewed,
    distinct_computation_smooth,
    frame_flip,
    mixture_three_way,
)
from dcp_lens.zoo.planted.embedding import embed
from dcp_lens.zoo.planted.factors import (
    block_count,
    block_count_soft,
    distinct_computation,
    distinct_computation_soft,
    mixture_shift_blocks,
    mixture_shift_distinct,
    readout_shift,
    readout_shift_by_position,
    readout_shift_by_token_type,
    readout_shift_soft,
    readout_shift_step,
)
from dcp_lens.zoo.planted.nuisance import nuisance_distinct, nuisance_shift


@dataclass(frozen=True)
class PlantedKind:
    """One planted model kind: its builder, the factor behind its whole gap (mixtures name each of
    theirs, "S+B"), whether the S and B brackets can identify its truth on the evaluation data
    (docs/bracket.md: False where a paired map can do the remaining computation, a permutation
    or flip of the state, where the base rate is a large part of the gap, or where replay's
    readout walks between answers; the bracket must then be flagged "not identified" at every k
    with a gap), and its suite: ``"point"`` (validated since the point decomposition),
    ``"bracket"`` (added with the bracket), ``"nuisance"`` (the translators' gate,
    tests/integration/zoo/test_nuisance.py; not in the validation suite, whose committed tables
    they would change)."""

    build: Callable[..., PlantedModel]
    factor: str
    identifiable: bool
    suite: Literal["point", "bracket", "nuisance"]


# The one registry of planted kinds; the tables below are its views.
KINDS: dict[str, PlantedKind] = {
    "readout_shift": PlantedKind(readout_shift, "S", True, "point"),
    "distinct_computation": PlantedKind(distinct_computation, "D", False, "point"),
    "block_count": PlantedKind(block_count, "B", True, "point"),
    "readout_shift_by_token_type": PlantedKind(readout_shift_by_token_type, "S", True, "point"),
    "readout_shift_by_position": PlantedKind(readout_shift_by_position, "S", True, "point"),
    "mixture_shift_distinct": PlantedKind(mixture_shift_distinct, "S+D", False, "point"),
    "mixture_shift_blocks": PlantedKind(mixture_shift_blocks, "S+B", True, "point"),
    "readout_shift_soft": PlantedKind(readout_shift_soft, "S", True, "point"),
    "distinct_computation_soft": PlantedKind(distinct_computation_soft, "D", False, "point"),
    "block_count_soft": PlantedKind(block_count_soft, "B", True, "point"),
    "distinct_computation_context": PlantedKind(distinct_computation_context, "D", True, "bracket"),
    "block_count_context": PlantedKind(block_count_context, "B", True, "bracket"),
    "frame_flip": PlantedKind(frame_flip, "S", False, "bracket"),
    "distinct_computation_skewed": PlantedKind(distinct_computation_skewed, "D", False, "bracket"),
    "mixture_three_way": PlantedKind(mixture_three_way, "S+B+D", False, "bracket"),
    "distinct_computation_smooth": PlantedKind(distinct_computation_smooth, "D", False, "bracket"),
    "readout_shift_step": PlantedKind(readout_shift_step, "S", True, "bracket"),
    "frame_flip_gated": PlantedKind(frame_flip_gated, "S", False, "bracket"),
    "frame_warp": PlantedKind(frame_warp, "S", False, "bracket"),
    "readout_shift_walk": PlantedKind(readout_shift_walk, "S", False, "bracket"),
    "nuisance_shift": PlantedKind(nuisance_shift, "S", True, "nuisance"),
    "nuisance_distinct": PlantedKind(nuisance_distinct, "D", True, "nuisance"),
}
BUILDERS: dict[str, Callable[..., PlantedModel]] = {
    name: kind.build for name, kind in KINDS.items()
}
EXPECTED_FACTOR = {name: kind.factor for name, kind in KINDS.items()}
IDENTIFIABLE = {name: kind.identifiable for name, kind in KINDS.items()}
# The suite the point decomposition was validated on before the bracket; `dcp-lens validate`
# judges every model of BRACKET_PLANTED by the bracket rule (docs/validation.md).
PLANTED = tuple(name for name, kind in KINDS.items() if kind.suite == "point")
NUISANCE_PLANTED = tuple(name for name, kind in KINDS.items() if kind.suite == "nuisance")
BRACKET_PLANTED = tuple(name for name, kind in KINDS.items() if kind.suite != "nuisance")


def expected_shares(
    name: str, model: PlantedModel, evaluation: EvaluationSet, metric: str, k_grid: Sequence[int]
) -> dict[str, float]:
    """The true S, B, D shares of planted model ``name``'s truncation gap area over ``k_grid``.

    A single-factor model's gap is its factor's by construction (1 for it, 0 for the others). A
    mixture's gap at every k is the sum of its mechanisms' gaps over their own positions (no
    position interacts with another), so the true share of a factor is the area of the gap on its
    positions over the whole gap's area, measured on ``evaluation`` from truncation alone.
    """
    task = model.planted_task
    if task.factors is None:
        factor = EXPECTED_FACTOR.get(name)
        if factor not in FACTORS:
            raise ValueError(f"{name!r} is not a single-factor planted model of {BRACKET_PLANTED}.")
        return {f: float(f == factor) for f in FACTORS}
    masks = task.factor_masks(evaluation.tokens)
    sign = 1.0 if HIGHER_IS_BETTER[metric] else -1.0
    areas = dict.fromkeys(FACTORS, 0.0)
    with torch.no_grad():
        states, full_logits = capture_states(model, evaluation.tokens)
        full_log_probs = full_logits.log_softmax(-1)
        for factor, mask in masks.items():
            targets = torch.where(mask, evaluation.targets, IGNORE_INDEX)
            count = mask.sum(-1).to(full_logits.dtype)

            def total(logits: Tensor, targets: Tensor = targets, count: Tensor = count) -> float:
                means = per_example_metrics(logits, full_log_probs, targets, (metric,))[metric]
                return float((means * count).sum())

            full = total(full_logits)
            areas[factor] = sum(sign * (full - total(model.readout(states[k]))) for k in k_grid)
    gap = sum(areas.values())
    return {f: areas[f] / gap if gap else math.nan for f in FACTORS}


def load_planted(name: str, **overrides: object) -> PlantedModel:
    """``load("planted:NAME", size=…, n_iterations=…, seed=…, width=…)``; ``width`` embeds the
    model in a stream of that many coordinates (`dcp_lens.zoo.planted.embedding.embed`)."""
    if name not in BUILDERS:
        raise ConfigError(f"unknown planted model {name!r}; choose one of {tuple(BUILDERS)}.")
    fields = dict(overrides)
    device, dtype = fields.pop("device", None), fields.pop("dtype", None)
    width = fields.pop("width", None)
    builder = BUILDERS[name]
    accepted = [p for p in inspect.signature(builder).parameters if p not in ("device", "dtype")]
    unknown = sorted(set(fields) - set(accepted))
    if unknown:
        raise ConfigError(
            f"planted:{name} takes no {', '.join(unknown)}; its options are {accepted}, device "
            "and dtype."
        )
    hints = typing.get_type_hints(builder)
    for field, value in fields.items():
        wanted = hints.get(field)
        kinds = (int, float) if wanted is float else (wanted,) if wanted is int else None
        if kinds is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise ConfigTypeError(
                f"planted:{name} option {field}={value!r:.40} must be "
                f"{'a number' if wanted is float else 'an int'}."
            )
    target = None if device is None else check_device(device)
    kind = None if dtype is None else check_dtype(dtype)
    model = builder(**fields)  # type: ignore[arg-type]
    if width is not None:
        seed = fields.get("seed", 0)  # an int: checked against the builder's hints above
        model = embed(model, typing.cast(int, width), seed=typing.cast(int, seed))
    if target or kind:
        model = model.to(device=target, dtype=kind)
    # Planted models number their symbols themselves: <0>, <1>, … give them strings.
    model.tokenizer = VocabularyTokenizer([f"<{i}>" for i in range(model.cfg.d_vocab)])
    return model


__all__ = [
    "BRACKET_PLANTED",
    "BUILDERS",
    "EXPECTED_FACTOR",
    "IDENTIFIABLE",
    "KINDS",
    "NUISANCE_PLANTED",
    "PLANTED",
    "PlantedKind",
    "PlantedModel",
    "PlantedTask",
    "SEQUENCE_LENGTH",
    "block_count",
    "block_count_context",
    "block_count_soft",
    "distinct_computation",
    "distinct_computation_context",
    "distinct_computation_skewed",
    "distinct_computation_smooth",
    "distinct_computation_soft",
    "embed",
    "expected_shares",
    "frame_flip",
    "frame_flip_gated",
    "frame_warp",
    "load_planted",
    "nuisance_distinct",
    "nuisance_shift",
    "mixture_shift_blocks",
    "mixture_shift_distinct",
    "mixture_three_way",
    "readout_shift",
    "readout_shift_by_position",
    "readout_shift_by_token_type",
    "readout_shift_soft",
    "readout_shift_step",
    "readout_shift_walk",
]
