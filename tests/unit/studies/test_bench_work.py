"""The work counter: a forward counts as one forward per token, and a run's readouts per token
are the sweep's planned readouts (`irreducible_readouts`) on its examples, the jackknife's on
the examples it reads."""

from __future__ import annotations

import pytest
import torch

from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.protocol.conditions import SUBSAMPLED_CONTROLS
from dcp_lens.protocol.dcp import DepthControlProtocol, EvaluationSet
from dcp_lens.protocol.sweep import jackknife_examples
from dcp_lens.studies.bench import BENCH_CONFIG, bench_config
from dcp_lens.studies.bench_floor import irreducible_readouts
from dcp_lens.studies.bench_work import (
    WORK_STAGES,
    UnitCosts,
    WorkCount,
    count_run,
    counting,
    forward_macs_per_token,
)


@pytest.fixture(scope="module")
def model() -> HookedRecurrentTransformer:
    return HookedRecurrentTransformer(bench_config("small", 16, None, 4, 32, 8, 0)).eval()


def test_a_forward_is_one_forward_per_token_and_a_readout_its_coda(model) -> None:
    tokens = torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(0))
    costs = UnitCosts.of(model)
    count = WorkCount(stage="evaluation", tokens={"evaluation": tokens.numel()})
    with torch.no_grad(), counting(model, count):
        model(tokens)
        model.readout(torch.zeros(3, 8, 16))
    rows = count.rows["evaluation"]
    blocks = model.cfg.n_prelude + model.cfg.n_core * model.n_iterations + model.cfg.n_coda
    assert sum(rows[f"block.{i}"] for i in range(len(costs.blocks))) == (blocks + 1) * 24
    assert rows["unembed"] == 2 * 24 and rows["readout"] == 24
    forward = forward_macs_per_token(model, tokens, costs)
    assert forward == pytest.approx(
        count.macs("evaluation", costs) / 24 - (costs.blocks[-1] + costs.unembed) - 4.5 * 32
    )
    assert "readout" not in model.__dict__  # the counter is gone


def test_a_runs_readouts_per_token_are_the_sweeps_planned_readouts(model) -> None:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (112, 8), generator=generator)
    calibration = EvaluationSet.from_tokens(tokens[:32])
    evaluation = EvaluationSet.from_tokens(tokens[32:])
    config = BENCH_CONFIG.replace(
        batch_size=16, match_confidence=False, k_grid=(1, 2, 4), calibration_groups=4
    )
    protocol = DepthControlProtocol(model, config, progress=False)
    counted = count_run(protocol, calibration, evaluation, UnitCosts.of(model), 16)
    planned = irreducible_readouts(protocol)
    jackknifed = int(jackknife_examples(evaluation.example_keys(), 8, 16).sum())
    assert counted["jackknife_examples"] == jackknifed == 2  # 16 tokens: two of the tenth
    per_example = sum(planned["evaluation"].values()) + planned["null"]
    n = len(evaluation)
    expected = (n * per_example + jackknifed * sum(planned["jackknife"].values())) / n
    assert jackknifed < int((evaluation.example_keys() % 10 == 0).sum())  # the cap binds
    assert counted["readouts_per_token"]["evaluation"] == pytest.approx(expected)
    # The calibration pass applies every block up to s_r, no more than a forward.
    assert 0.9 < counted["forwards_per_token"]["calibration pass"] <= 1.05
    # The refits apply no block before the readout's: their only model work is the translators'
    # gate, the readout's geometry at the mean full-depth state (its logits there, and one
    # derivative each way per coordinate: forward mode or a central difference, and a pullback),
    # a fixed number of readouts of single states whatever the tokens.
    refits, d_model = counted["rows"]["refits"], model.cfg.d_model
    n_blocks = len(UnitCosts.of(model).blocks)  # the coda's last
    readout_units = {"readout", "unembed"}
    for i in range(n_blocks - model.cfg.n_coda, n_blocks):
        readout_units |= {f"block.{i}", f"attention.{i}"}
    assert set(refits) <= readout_units
    assert 1 + 2 * d_model <= refits["readout"] <= 1 + 4 * d_model
    assert refits["unembed"] <= refits["readout"]
    assert 0.0 < counted["forwards_per_token"]["refits"] < 0.1
    assert counted["forwards_per_token"]["evaluation"] > 1.0
    # Each stage metered: its seconds, and synchronisations per batch of the two batch loops
    # (two calibration batches, five evaluation batches).
    assert set(counted["stage_seconds"]) == set(WORK_STAGES)
    assert set(counted["syncs_per_batch"]) == {"calibration pass", "evaluation"}
    assert counted["syncs_per_batch"]["evaluation"] == counted["syncs"]["evaluation"] / 5


def test_the_estimate_at_huginns_shape_chooses_a_batch_that_fits_80_and_141_gb_cards() -> None:
    """With no batch given, the batch is the largest up to `run`'s default whose estimated
    peak fits the budget: 85% of an 80 GB and of a 141 GB card."""
    from dcp_lens.protocol.config import COMMAND_DEFAULTS, ProtocolConfig
    from dcp_lens.studies.bench_work import run_estimate

    config = ProtocolConfig(**COMMAND_DEFAULTS["run"])
    for card_gib, budget in ((74.5, 0.85 * 74.5), (131.0, 0.85 * 131.0)):
        chosen = run_estimate("huginn", dtype="bfloat16", config=config, budget_gib=budget)
        assert chosen["batch_from_budget"] and chosen["peak_gib"] <= budget < card_gib
        if chosen["batch"] < config.batch_size:  # one more would not fit
            more = run_estimate(
                "huginn",
                batch=chosen["batch"] + 1,
                dtype="bfloat16",
                config=config,
                budget_gib=budget,
            )
            assert more["peak_gib"] > budget
        assert chosen["host_total_gib"] > 10.0  # the parked groups, printed beside it
    given = run_estimate("huginn", batch=64, dtype="bfloat16", config=config, budget_gib=63.3)
    assert given["batch"] == 64 and not given["batch_from_budget"]  # a given batch stays


def test_controls_past_their_cap_are_counted_on_the_subsamples_examples_only(model) -> None:
    """Shift and the translators below r cost one readout each per example they are read on:
    with the cap at two sequences, the count drops by theirs on every other example."""
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 32, (48, 8), generator=generator)
    calibration = EvaluationSet.from_tokens(tokens[:16])
    evaluation = EvaluationSet.from_tokens(tokens[16:])
    config = BENCH_CONFIG.replace(
        batch_size=16, match_confidence=False, k_grid=(1, 2, 4), calibration_groups=0
    )
    protocol = DepthControlProtocol(model, config, progress=False)
    costs = UnitCosts.of(model)
    everything = count_run(protocol, calibration, evaluation, costs, control_tokens=0)
    capped = count_run(protocol, calibration, evaluation, costs, control_tokens=16)
    n = len(evaluation)
    assert everything["control_examples"] == n and capped["control_examples"] == 2
    below_r = [k for k in protocol.context.k_grid if k < protocol.r]
    per_example = len(SUBSAMPLED_CONTROLS) * len(below_r)
    dropped = (
        everything["readouts_per_token"]["evaluation"] - capped["readouts_per_token"]["evaluation"]
    )
    assert dropped == pytest.approx((n - 2) * per_example / n)
