"""A run given no batch size takes the largest that fits its memory budget, up to the default,
says so, and a resumed run keeps the batch size it started with."""

from __future__ import annotations

import json

import torch

from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.protocol.budget import GIB
from dcp_lens.protocol.dcp import DepthControlProtocol, EvaluationSet
from dcp_lens.studies import run as run_module
from dcp_lens.studies.bench import bench_config


def _plan(budget_gib: float | None) -> run_module._Plan:
    cfg = bench_config("huginn", 96, None, 4, 4096, 64, 0)
    model = HookedRecurrentTransformer(cfg).eval()
    tokens = torch.randint(0, 4096, (128, 64), generator=torch.Generator().manual_seed(0))
    data = (EvaluationSet.from_tokens(tokens[:64]), EvaluationSet.from_tokens(tokens[64:]))
    protocol = DepthControlProtocol(
        model, batch_size=64, memory_budget=budget_gib, probe="none", progress=False
    )
    return run_module._Plan("bench", "model", model, protocol, data)


def test_no_batch_size_takes_the_largest_that_fits_and_says_so(capsys, tmp_path) -> None:
    plan = _plan(None)
    peak = {}
    for size in (16, 17):
        plan.protocol.use_batch_size(size)
        peak[size] = plan.protocol.estimate(*plan.data).peak_bytes
    assert peak[16] < peak[17]  # the batch moves the peak at this shape
    budget = (peak[16] + peak[17]) / 2 / GIB
    plan = _plan(budget)
    config = run_module._batch_from_budget([plan], plan.protocol.config, None)
    assert config.batch_size == plan.protocol.config.batch_size == 16
    assert plan.protocol.context.config.batch_size == 16
    assert plan.protocol.estimate(*plan.data).peak_bytes <= budget * GIB
    assert "batch size 16: the largest up to 64" in capsys.readouterr().out
    # Resumed: the batch size the interrupted run recorded, whatever the budget says now.
    recorded = tmp_path / run_module.CHECKPOINTS / "command.json"
    recorded.parent.mkdir(parents=True)
    recorded.write_text(json.dumps({"config.batch_size": "24"}))
    plan = _plan(budget)
    config = run_module._batch_from_budget([plan], plan.protocol.config, tmp_path)
    assert config.batch_size == plan.protocol.config.batch_size == 24
