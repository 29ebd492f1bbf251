"""Planted models of the suite's kinds that the suite does not carry (built here from the zoo's
parts): a rotation and a cycle of coordinates as marginal-preserving frame changes, a D-only
model with a different skewed prior and cycle, a three-way mixture in other proportions, and of
the map class and the order of S and B: a gated sign flip on other coordinates, an elementwise
warp at other levels (frame changes no affine map undoes) and a walk along a line of another
size and step (a constant per-step update).

On every validated metric the truth must lie inside the bracket, the row be flagged at every k
with a gap, or the verdict be "inconclusive"; and the verdict must never name a factor that is
not the truth's, nor one whose true share is below 0.65 of the gap. Slow (a DCP run per model,
as `dcp-lens validate` runs them): ``pytest -m slow tests/acceptance/test_unseen_planted.py``."""

from __future__ import annotations

import pytest
import torch

from dcp_lens.protocol.bracket import BracketRule, has_gap
from dcp_lens.studies import validate
from dcp_lens.studies import validation_rules as rules
from dcp_lens.zoo import planted
from dcp_lens.zoo.planted import base

pytestmark = pytest.mark.slow

CODES = 2.0 * ((torch.arange(16)[:, None] >> torch.arange(4)) & 1).float() - 1.0  # [16, 4]


def _frame_change(linear: torch.Tensor, n_iterations: int, seed: int) -> planted.PlantedModel:
    """Each iteration applies ``linear`` (which maps the 16 codes of {-1, 1}^4 onto themselves)
    to the state; nothing is computed, so the truth is S = 1. Each token's answer is full
    depth's own readout of it."""
    model = base.blank_model(base.base_config(4, 16, n_iterations, 8))
    with torch.no_grad():
        model.embed.W_E.copy_(CODES)
        base.set_linear_mlp(model, linear - torch.eye(4), 1.0)  # every code has RMS 1
        model.unembedding.copy_(3.0 * CODES.T)
        answers = model(torch.arange(16)[:, None])[:, 0].argmax(-1)
    model.planted_task = planted.PlantedTask(answers, 16, seed)
    return model


def frame_rotation(n_iterations: int = 8, seed: int = 0) -> planted.PlantedModel:
    rotation = torch.eye(4)
    rotation[:2, :2] = torch.tensor([[0.0, -1.0], [1.0, 0.0]])  # a quarter turn of a plane
    return _frame_change(rotation, n_iterations, seed)


def frame_cycle(n_iterations: int = 8, seed: int = 0) -> planted.PlantedModel:
    return _frame_change(torch.eye(4)[[1, 2, 0, 3]], n_iterations, seed)  # period 3, not 2


def skewed_small_cycle(n_iterations: int = 8, seed: int = 0) -> planted.PlantedModel:
    return planted.distinct_computation_context(7, n_iterations, seed, skew=6)


def three_way_unequal(n_iterations: int = 8, seed: int = 0) -> planted.PlantedModel:
    blocks = planted.block_count(16, n_iterations, seed)
    with torch.no_grad():
        blocks.unembedding.mul_(50.0)
    shift_blocks = base.mixture(
        planted.readout_shift_step(8, n_iterations, seed), blocks, ("S", "B")
    )
    return base.mixture(
        shift_blocks, planted.distinct_computation(64, n_iterations, seed), ("S+B", "D")
    )


def gated_flip_other(n_iterations: int = 8, seed: int = 0) -> planted.PlantedModel:
    # Another gate and other coordinates than the suite's frame_flip_gated.
    return planted.frame_flip_gated(n_iterations, seed, flipped=(1, 3), gate=0)


def warp_other(n_iterations: int = 8, seed: int = 0) -> planted.PlantedModel:
    return planted.frame_warp(n_iterations, seed, magnitudes=(0.4, 1.2))


def walk_other(n_iterations: int = 8, seed: int = 0) -> planted.PlantedModel:
    return planted.readout_shift_walk(5, n_iterations, seed, strength=2.0)


UNSEEN = {  # name: (builder, the truth's factors)
    "frame_rotation": (frame_rotation, "S"),
    "frame_cycle": (frame_cycle, "S"),
    "skewed_small_cycle": (skewed_small_cycle, "D"),
    "three_way_unequal": (three_way_unequal, "S+B+D"),
    "gated_flip_other": (gated_flip_other, "S"),
    "warp_other": (warp_other, "S"),
    "walk_other": (walk_other, "S"),
}


@pytest.mark.parametrize("name", sorted(UNSEEN))
def test_an_unseen_planted_kind_is_bracketed_or_flagged_never_confidently_wrong(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    builder, factors = UNSEEN[name]
    monkeypatch.setitem(planted.BUILDERS, name, builder)
    monkeypatch.setitem(planted.EXPECTED_FACTOR, name, factors)
    config = validate._config(None, None, {}).replace(seed=0)
    run, expected = validate._run_planted(name, config, 512, 512, False)
    counted = [m for m in config.metrics or () if run["metrics"][m]["validated"] is not False]
    assert counted, "no validated metric to judge"
    for metric in counted:
        truth = expected[metric]
        rows = rules.per_k_of(run, metric)
        clear = has_gap(
            [r["gap_lo"] for r in rows], [r["gap"] for r in rows], BracketRule()
        ).tolist()
        assert any(clear), f"{name}: no k with a gap, nothing was tested"
        # Judged as ambiguous: flagged_every_k says whether every k with a gap is flagged.
        judgement = rules.judge_run(run, metric, truth, identifiable=False)
        verdict = run["shares"][metric]["verdict"]
        assert judgement.in_bracket or judgement.flagged_every_k or verdict == "inconclusive", (
            name,
            metric,
            judgement,
        )
        assert verdict in ("inconclusive", "mixed") or verdict in factors, (name, metric, verdict)
        # Never a named factor whose truth is below 0.65 of the gap.
        assert not judgement.confident_wrong, (name, metric, verdict, truth)
        # Where the truth is outside the bracket, the share-level flag must say so too.
        if not judgement.in_bracket:
            assert verdict == "inconclusive", (name, metric, verdict)
