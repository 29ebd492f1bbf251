"""Every stage of a run survives running out of memory: the calibration pass, the translator
fits, the jackknife refits, confidence matching and the probe. A shortage is forced in each (the
stage's own call raises `torch.OutOfMemoryError`, as the device's allocator does): a stage that
can cut its work redoes it in smaller chunks and gives the uninterrupted numbers; where even
the smallest chunks fail, the run stops with what to change, and ``--resume`` finishes it with
the uninterrupted numbers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers import lm_sets, make_model, numbers_close, result_numbers

import dcp_lens.protocol.confidence as confidence_module
import dcp_lens.protocol.dcp as dcp_module
import dcp_lens.protocol.fit as fit_module
import dcp_lens.protocol.fit_records as fit_records_module
from dcp_lens import DepthControlProtocol
from dcp_lens.protocol.budget import OutOfMemoryStop
from dcp_lens.protocol.probe import ResidualOODProbe
from dcp_lens.utils.snapshots import Checkpoint

SETTINGS = dict(n_bootstrap=20, probe="none", progress=False, batch_size=8, calibration_groups=4)
# The probe's classifier, short (its own numbers are compared, not its quality): the defaults of
# `ResidualOODProbe` (max_points, hidden_width, steps, batch_size, learning_rate).
SHORT_PROBE = (4000, 16, 30, 64, 1e-3)


def _close(a: list[float], b: list[float], tol: float = 1e-6) -> bool:
    return numbers_close(a, b, tol)


@pytest.fixture(scope="module")
def setup():
    model = make_model(dtype=torch.float32)
    evaluation, calibration = lm_sets(model, n=40, pos=10)
    reference = DepthControlProtocol(model, **SETTINGS).run(evaluation, calibration)
    return model, evaluation, calibration, result_numbers(reference)


def _scarce(original: Callable, fails: Callable[..., bool], failed: list[int]) -> Callable:
    """``original``, raising the allocator's error on a call where ``fails(*args)`` is True."""

    def call(*args, **kwargs):
        if fails(*args, **kwargs):
            failed.append(1)
            raise torch.OutOfMemoryError("simulated: out of memory")
        return original(*args, **kwargs)

    return call


@contextmanager
def _short_of_memory(module: object, name: str, fails: Callable[..., bool]) -> Iterator[list]:
    failed: list[int] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, name, _scarce(getattr(module, name), fails, failed))
        yield failed
    assert failed, "the simulated shortage never happened"


def _first(calls: list[int]) -> Callable[..., bool]:
    """Fails the first call only (a shortage that emptying the cache cures)."""

    def fails(*args, **kwargs) -> bool:
        calls.append(1)
        return len(calls) == 1

    return fails


def _stopped_then_resumed(
    model, evaluation, calibration, folder: Path, module, name, settings=SETTINGS
):
    """A run stopped by a shortage in ``module.name`` (every call fails), then resumed without
    it: the stop's message and the resumed run's numbers."""
    checkpoint = Checkpoint(folder, every=16)
    with _short_of_memory(module, name, lambda *a, **k: True):
        with pytest.raises(OutOfMemoryStop, match="--resume") as stop:
            DepthControlProtocol(model, checkpoint=checkpoint, **settings).run(
                evaluation, calibration
            )
    resumed = DepthControlProtocol(model, checkpoint=checkpoint, **settings).run(
        evaluation, calibration
    )
    return str(stop.value), result_numbers(resumed)


# ---------------------------------------------------------------- the calibration pass


def test_the_calibration_pass_reads_a_batch_that_does_not_fit_in_smaller_forwards(setup) -> None:
    model, evaluation, calibration, reference = setup
    seen: list[int] = []
    original = fit_records_module.capture_states

    def scarce(model_, tokens, *args, **kwargs):
        seen.append(int(tokens.shape[0]))
        if tokens.shape[0] > 2:  # the device "holds" two sequences' forward at most
            raise torch.OutOfMemoryError("simulated: out of memory")
        return original(model_, tokens, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fit_records_module, "capture_states", scarce)
        results = DepthControlProtocol(model, **SETTINGS).run(evaluation, calibration)
    assert max(seen) > 2 and 2 in seen  # it failed, then read two sequences a forward
    assert _close(result_numbers(results), reference)


def _calibration_stop_and_resume(model, evaluation, calibration, folder: Path) -> list[float]:
    """A run stopped by a shortage from the third calibration batch on, resumed: its numbers
    beside an uninterrupted run's."""
    # A snapshot folds the groups' waiting rows into their float32 moments, which rounds them:
    # the uninterrupted run snapshots where the stopped one does (after two batches).
    uninterrupted = Checkpoint(folder / "uninterrupted", every=2)
    reference = result_numbers(
        DepthControlProtocol(model, checkpoint=uninterrupted, **SETTINGS).run(
            evaluation, calibration
        )
    )
    calls: list[int] = []

    def from_the_third_batch(model_, tokens, *args, **kwargs) -> bool:
        calls.append(1)
        return len(calls) >= 3

    checkpoint = Checkpoint(folder / "stopped", every=2)
    with _short_of_memory(fit_records_module, "capture_states", from_the_third_batch):
        with pytest.raises(OutOfMemoryStop, match="--resume") as stop:
            DepthControlProtocol(model, checkpoint=checkpoint, **SETTINGS).run(
                evaluation, calibration
            )
    assert "calibration stage" in str(stop.value) and "--batch-size 4" in str(stop.value)
    done, _ = checkpoint.restore("calibration", torch.device("cpu"))
    assert done == 2  # the two finished batches
    resumed = DepthControlProtocol(model, checkpoint=checkpoint, **SETTINGS).run(
        evaluation, calibration
    )
    assert _close(result_numbers(resumed), reference)
    return reference


def test_a_calibration_batch_that_never_fits_stops_and_resume_finishes_it(setup, tmp_path) -> None:
    model, evaluation, calibration, _ = setup
    _calibration_stop_and_resume(model, evaluation, calibration, tmp_path)


def test_resume_with_parked_groups_reads_the_snapshot_into_host_memory(
    setup, tmp_path, monkeypatch
) -> None:
    """On an accelerator the groups not being filled wait on the host (forced here on the CPU):
    a resumed pass reads its snapshot there, and the groups go to the device one at a time."""
    model, evaluation, calibration, _ = setup
    host = torch.device("cpu")
    monkeypatch.setattr(fit_module, "moments_host", lambda context: host)
    read_on: list[tuple[str, torch.device]] = []
    original = Checkpoint.restore

    def spied(self, stage, device, into=None):
        read_on.append((stage, device))
        return original(self, stage, device, into)

    monkeypatch.setattr(Checkpoint, "restore", spied)
    _calibration_stop_and_resume(model, evaluation, calibration, tmp_path)
    # The resumed run's read of its calibration snapshot (the last one) went to the host.
    calibration_reads = [device for stage, device in read_on if stage == "calibration"]
    assert calibration_reads[-1] is host


# ---------------------------------------------------------- the stages after the pass


@pytest.mark.parametrize(
    ("module", "name", "stage"),
    [
        (fit_module, "judge", "translator fits"),
        (fit_module, "_refit_stream", "jackknife fits"),
    ],
)
def test_a_fit_after_the_pass_is_tried_again_then_stops_and_resumes(
    setup, tmp_path, module, name, stage
) -> None:
    model, evaluation, calibration, reference = setup
    with _short_of_memory(module, name, _first([])):
        again = DepthControlProtocol(model, **SETTINGS).run(evaluation, calibration)
    assert _close(result_numbers(again), reference)
    message, resumed = _stopped_then_resumed(model, evaluation, calibration, tmp_path, module, name)
    assert f"{stage} stage" in message and "--calibration-groups 0" in message
    assert _close(resumed, reference)


def test_confidence_matching_reads_out_in_smaller_calls_then_stops_and_resumes(
    setup, tmp_path
) -> None:
    model, evaluation, calibration, reference = setup

    def too_many_rows(model_, r, states, conditions, full_logits, plan=None) -> bool:
        return plan is None or plan.rows >= 40  # the device "holds" three examples' readouts

    with _short_of_memory(confidence_module, "readouts", too_many_rows):
        smaller = DepthControlProtocol(model, **SETTINGS).run(evaluation, calibration)
    assert _close(result_numbers(smaller), reference)
    message, resumed = _stopped_then_resumed(
        model, evaluation, calibration, tmp_path, confidence_module, "readouts"
    )
    assert "confidence matching stage" in message and "--no-match-confidence" in message
    assert _close(resumed, reference)


def test_the_probe_stops_and_resume_probes_the_finished_evaluation(tmp_path) -> None:
    model = make_model(dtype=torch.float32)
    evaluation, calibration = lm_sets(model, n=24, pos=10)
    settings = {**SETTINGS, "probe": "trajectory", "probe_points": 64}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ResidualOODProbe.__init__, "__defaults__", SHORT_PROBE)
        run = DepthControlProtocol(model, **settings).run(evaluation, calibration)
        reference = result_numbers(run)
        message, resumed = _stopped_then_resumed(
            model, evaluation, calibration, tmp_path, dcp_module, "probe_run", settings
        )
    assert "probe stage" in message and "--probe-points" in message
    assert _close(resumed, reference)
