"""Memory bounded by the batch and known before the run: the budget's readout plan, a batch
redone in smaller chunks after running out of memory, a stop that --resume finishes, and the
up-front refusal of a run whose estimate exceeds its budget."""

from __future__ import annotations

import pytest
import torch
from helpers import lm_sets, make_model, numbers_close, out_of_memory_from, result_numbers

import dcp_lens.protocol.sweep as sweep_module
from dcp_lens import DepthControlProtocol
from dcp_lens.protocol.budget import GIB, OutOfMemoryStop, ReadoutPlan
from dcp_lens.utils.errors import ResourceLimitError
from dcp_lens.utils.snapshots import Checkpoint

SETTINGS = dict(n_bootstrap=20, probe="none", progress=False, batch_size=8, calibration_groups=4)


def _same(a: list[float], b: list[float], tol: float = 1e-9) -> bool:
    return numbers_close(a, b, tol)


@pytest.fixture(scope="module")
def setup():
    model = make_model(dtype=torch.float32)
    evaluation, calibration = lm_sets(model, n=40, pos=10)
    reference = DepthControlProtocol(model, **SETTINGS).run(evaluation, calibration)
    return model, evaluation, calibration, result_numbers(reference)


def test_the_plan_cuts_batches_into_whole_examples_within_the_rows() -> None:
    plan = ReadoutPlan.of(rows=25, batch=8, positions=10)
    assert plan.examples == 2 and plan.conditions == 1
    assert [c.stop - c.start for c in plan.example_chunks(7)] == [2, 2, 2, 1]
    assert ReadoutPlan.of(rows=200, batch=8, positions=10).conditions == 2
    smallest = ReadoutPlan.of(rows=3, batch=8, positions=10)
    assert smallest.examples == 1 and smallest.halved(8, 10) is None
    assert plan.condition_groups(5, examples=1, positions=10) == [
        slice(0, 2),
        slice(2, 4),
        slice(4, 6),
    ]


def test_a_tight_budget_gives_the_same_numbers_in_smaller_chunks(setup) -> None:
    model, evaluation, calibration, reference = setup
    seen: list[int] = []
    original = sweep_module.readouts

    def counting(model_, r, states, conditions, full_logits, plan=None):
        seen.append(int(states.shape[1]))
        return original(model_, r, states, conditions, full_logits, plan)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sweep_module, "readouts", counting)
        patch.setattr(
            "dcp_lens.protocol.context.RunContext.readout_plan",
            lambda self, data: ReadoutPlan.of(20, 8, int(data.tokens.shape[1])),
        )
        results = DepthControlProtocol(model, **SETTINGS).run(evaluation, calibration)
    assert max(seen) <= 2  # no readout call held more than two examples
    assert _same(result_numbers(results), reference, tol=1e-6)


def test_running_out_of_memory_redoes_the_batch_in_smaller_chunks(setup) -> None:
    model, evaluation, calibration, reference = setup
    original = sweep_module.readouts
    failed: list[int] = []

    def scarce(model_, r, states, conditions, full_logits, plan=None):
        if states.shape[1] > 2:  # the device "holds" two examples' readouts at most
            failed.append(int(states.shape[1]))
            raise torch.OutOfMemoryError("simulated: out of memory")
        return original(model_, r, states, conditions, full_logits, plan)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sweep_module, "readouts", scarce)
        results = DepthControlProtocol(model, **SETTINGS).run(evaluation, calibration)
    assert failed, "the simulated shortage never happened"
    assert _same(result_numbers(results), reference, tol=1e-6)


def test_a_batch_that_never_fits_stops_and_resume_finishes_it(setup, tmp_path) -> None:
    model, evaluation, calibration, reference = setup
    fails_at_the_third_batch = out_of_memory_from(sweep_module.capture_all, 3)
    checkpoint = Checkpoint(tmp_path / "snapshots", every=16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sweep_module, "capture_all", fails_at_the_third_batch)
        with pytest.raises(OutOfMemoryStop, match="--resume") as stop:
            DepthControlProtocol(model, checkpoint=checkpoint, **SETTINGS).run(
                evaluation, calibration
            )
    message = str(stop.value)
    assert "batch size 8" in message and "--batch-size 4" in message
    snapshots = sorted(p.name for p in checkpoint.folder.iterdir())
    assert any(name.startswith("evaluation.0") for name in snapshots)
    done, _ = checkpoint.restore("evaluation.0", torch.device("cpu"))
    assert done == 2  # the two finished batches, kept although the snapshot interval is 16
    resumed = DepthControlProtocol(model, checkpoint=checkpoint, **SETTINGS).run(
        evaluation, calibration
    )
    assert _same(result_numbers(resumed), reference, tol=1e-9)


def test_a_run_over_its_budget_is_refused_before_any_batch_naming_what_fits(setup) -> None:
    model, evaluation, calibration, _ = setup
    protocol = DepthControlProtocol(model, **SETTINGS)
    small = DepthControlProtocol(model, **{**SETTINGS, "batch_size": 1})
    needs = protocol.estimate(evaluation, calibration).peak_bytes
    needs_one = small.estimate(evaluation, calibration).peak_bytes
    assert needs_one < needs
    budget = (needs_one + needs) / 2 / GIB
    with pytest.raises(ResourceLimitError, match=r"--batch-size [1-7]\b") as refused:
        DepthControlProtocol(model, **SETTINGS, memory_budget=budget).run(evaluation, calibration)
    assert "estimated peak memory" in str(refused.value)
    with pytest.raises(ResourceLimitError, match="No batch size fits"):
        DepthControlProtocol(model, **SETTINGS, memory_budget=needs_one / 4 / GIB).run(
            evaluation, calibration
        )


def test_the_memory_budget_setting_is_checked_where_it_enters() -> None:
    from dcp_lens.protocol.config import ProtocolConfig
    from dcp_lens.utils.errors import ConfigError

    assert ProtocolConfig(memory_budget="40GiB").memory_budget == 40.0
    assert ProtocolConfig(memory_budget=2.5).memory_budget == 2.5
    for bad in (0, -1, "lots", float("nan"), True):
        with pytest.raises(ConfigError, match="memory_budget"):
            ProtocolConfig(memory_budget=bad)


def test_a_default_run_lets_no_numpy_or_torch_warning_through(tmp_path) -> None:
    """`run` on a planted model, the probe on: numpy's and torch's warnings are errors here,
    and none of theirs is recorded."""
    import warnings

    from dcp_lens.protocol.config import ProtocolConfig
    from dcp_lens.studies.run import RunOptions, run

    config = ProtocolConfig(n_bootstrap=50, probe_points=300, batch_size=32)
    options = RunOptions(n_eval=64, n_calibration=64, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("error", category=RuntimeWarning)  # numpy's empty means
        warnings.filterwarnings("error", module="torch")
        warnings.filterwarnings("error", module="numpy")
        outcome = run(tmp_path / "out", "planted:readout_shift", config=config, options=options)
    assert outcome.results
    foreign = [w for w in caught if "/numpy/" in w.filename or "/torch/" in w.filename]
    assert not foreign, [str(w.message) for w in foreign]


def test_a_run_reads_its_budget_once_and_plans_every_stage_against_it(setup, monkeypatch):
    """What the machine can give is read when the run starts; a later stage does not re-read
    it, so memory another process takes during the run cannot change the plan."""
    import dcp_lens.protocol.budget as budget_module

    model, evaluation, calibration, expected = setup
    readings: list[int] = []

    def available() -> int:
        readings.append(64 * GIB if not readings else 1 << 20)
        return readings[-1]

    monkeypatch.setattr(budget_module, "available_memory_bytes", available)
    result = DepthControlProtocol(model, **SETTINGS).run(evaluation, calibration)
    assert len(readings) == 1
    assert _same(result_numbers(result), expected)
