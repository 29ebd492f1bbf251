"""`validate` across several planted models: one memory budget for the whole suite."""

from __future__ import annotations

import dcp_lens.protocol.budget as budget_module
from dcp_lens.protocol.budget import GIB
from dcp_lens.studies.validate import validate


def test_the_suite_plans_every_model_against_the_budget_it_started_with(monkeypatch):
    """Memory taken by another process after the first model (here: the machine reports 1 MiB
    from the second reading on) does not refuse a later model of the suite."""
    readings: list[int] = []

    def available() -> int:
        readings.append(64 * GIB if not readings else 1 << 20)
        return readings[-1]

    monkeypatch.setattr(budget_module, "available_memory_bytes", available)
    rows = validate(
        ["readout_shift", "block_count"],
        ["accuracy"],
        n_eval=16,
        n_calibration=16,
        n_bootstrap=5,
        probe="none",
    )
    assert [row.model for row in rows] == ["readout_shift", "block_count"]
    assert len(readings) == 1
