"""The notebooks under demos/: each committed notebook is its percent script (demos/NAME.py)
executed as is, with clean outputs that a fresh execution reproduces; the scripts also run as
plain Python at quick sizes (DCP_DEMO_QUICK=1). Commands: docs/notebooks.md."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DEMOS = REPO / "demos"
# Executed at full size: the fast three in the default run (9-21 s each on this 2-core machine
# when idle, 23-67 s when busy); readout_shift (32 s idle, 274 s busy: it distils a retrofit and
# trains probe classifiers) with `pytest -m slow`.
FAST = ["hooking_iterations", "dcp_on_your_model", "huginn_and_ouro", "lenses"]
SLOW = ["readout_shift"]
NOTEBOOKS = FAST + SLOW
SCRIPTS_ONLY = {"quickstart", "real_scale_configs", "retrofit_stories260k", "gpu_check"}
# A fresh number may differ from the committed one by float noise across machines and the last
# printed digit: |fresh - committed| <= ABSOLUTE + RELATIVE * |committed|.
ABSOLUTE, RELATIVE = 0.01, 0.01
WIDGET = "application/vnd.jupyter.widget-view+json"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def committed(name: str) -> dict[str, Any]:
    return json.loads((DEMOS / f"{name}.ipynb").read_text())


def code_cells(notebook: Any) -> list[Any]:
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


def output_text(cell: Any) -> str:
    """What a code cell showed, as text: streams by name (consecutive chunks of one stream
    joined: how prints are chunked depends on timing), results' text/plain, errors. A widget (a
    progress bar drawn by ipywidgets) is live state, not a result: left out."""
    parts, stream = [], None
    for output in cell.get("outputs", []):
        kind = output["output_type"]
        if WIDGET in output.get("data", {}):
            continue
        if kind == "stream":
            marker = "" if output["name"] == stream else f"[{output['name']}] "
            parts.append(marker + _joined(output["text"]))
            stream = output["name"]
            continue
        stream = None
        if kind in ("execute_result", "display_data"):
            parts.append(_joined(output.get("data", {}).get("text/plain", "")))
        else:
            parts.append(f"[error] {output.get('ename')}: {output.get('evalue')}")
    return "".join(parts)


def _joined(text: str | list[str]) -> str:
    return text if isinstance(text, str) else "".join(text)


def differences(fresh: str, old: str) -> list[str]:
    """Where two outputs disagree: different words or layout, or numbers beyond the tolerance."""
    if NUMBER.sub("#", fresh) != NUMBER.sub("#", old):
        return [f"text differs:\n--- committed\n{old}\n--- fresh\n{fresh}"]
    found = []
    for new, was in zip(NUMBER.findall(fresh), NUMBER.findall(old), strict=True):
        a, b = float(new), float(was)
        if not math.isclose(a, b, rel_tol=0, abs_tol=ABSOLUTE + RELATIVE * abs(b)):
            found.append(f"{was} (committed) vs {new} (fresh)")
    return found


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_the_committed_notebook_is_its_script(name: str) -> None:
    jupytext = pytest.importorskip("jupytext", reason='pip install -e ".[notebooks]"')
    script = jupytext.read(DEMOS / f"{name}.py")
    cells = committed(name)["cells"]
    assert [(c.cell_type, c.source) for c in script.cells] == [
        (c["cell_type"], _joined(c["source"])) for c in cells
    ], f"demos/{name}.ipynb is not demos/{name}.py: rebuild it (docs/notebooks.md)"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_the_committed_outputs_are_clean(name: str) -> None:
    """Every cell ran, in order, without an error, a warning or anything on stderr."""
    cells = code_cells(committed(name))
    assert [cell["execution_count"] for cell in cells] == list(range(1, len(cells) + 1))
    for cell in cells:
        for output in cell["outputs"]:
            assert output["output_type"] != "error", output
            assert output.get("name") != "stderr", _joined(output.get("text", ""))
        assert "Warning" not in output_text(cell), output_text(cell)


@pytest.mark.parametrize(
    "name", [*FAST, *(pytest.param(name, marks=pytest.mark.slow) for name in SLOW)]
)
def test_a_fresh_execution_reproduces_the_committed_outputs(name: str, monkeypatch) -> None:
    """The notebook built from its script, executed in a Jupyter kernel at full size, prints
    what the committed notebook shows: the same text, numbers within the tolerance above."""
    jupytext = pytest.importorskip("jupytext", reason='pip install -e ".[notebooks]"')
    nbclient = pytest.importorskip("nbclient", reason='pip install -e ".[notebooks]"')
    # Without ipywidgets tqdm prints a warning in the kernel that the committed outputs lack.
    pytest.importorskip(
        "ipywidgets",
        reason='progress bars in the kernel need ipywidgets: pip install -e ".[notebooks]"',
    )
    monkeypatch.delenv("DCP_DEMO_QUICK", raising=False)  # the kernel inherits the environment
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    notebook = jupytext.read(DEMOS / f"{name}.py")
    client = nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(DEMOS)}}
    )
    client.execute()
    fresh, old = code_cells(notebook), code_cells(committed(name))
    assert len(fresh) == len(old)
    found = [
        f"cell {index}: {difference}"
        for index, (new, was) in enumerate(zip(fresh, old, strict=True))
        for difference in differences(output_text(new), output_text(was))
    ]
    assert not found, f"demos/{name}.ipynb is stale (docs/notebooks.md):\n" + "\n".join(found)


def test_the_comparison_catches_a_stale_number_and_a_missing_row() -> None:
    now = "cross_entropy S -0.645\ntop1_agreement S -0.003\n"
    assert differences(now, now.replace("-0.645", "-0.641")) == []  # within the tolerance
    assert differences(now, now.replace("-0.645", "-0.120")) == [
        "-0.120 (committed) vs -0.645 (fresh)"
    ]
    assert differences(now, "cross_entropy S -0.645\n")[0].startswith("text differs")


def run_demo(name: str) -> str:
    environment = {**os.environ, "DCP_DEMO_QUICK": "1", "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        [sys.executable, str(DEMOS / f"{name}.py")],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_the_demo_runs_as_a_script_at_quick_sizes(name: str) -> None:
    """`python demos/NAME.py` with DCP_DEMO_QUICK=1 (the notebooks run at full size above)."""
    assert run_demo(name)


def test_every_demo_is_tested_and_has_its_executed_notebook() -> None:
    scripts = {path.stem for path in DEMOS.glob("*.py")}
    assert scripts - SCRIPTS_ONLY == set(NOTEBOOKS)
    for name in NOTEBOOKS:
        assert (DEMOS / f"{name}.ipynb").is_file(), name


@pytest.mark.parametrize("name", ["retrofit_stories260k", "real_scale_configs"])
def test_a_script_only_demo_imports_what_it_names(name: str) -> None:
    """Loading the script runs its imports, not its main: a name moved inside the library
    (the retrofit once imported `write_results_json` from where it no longer lived) fails here,
    in the default run, rather than for the first reader who runs the script."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"demo_{name}", DEMOS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(module.main)


@pytest.mark.slow
def test_the_retrofit_demo_distils_and_runs_dcp_at_a_toy_size(tmp_path: Path) -> None:
    """`python demos/retrofit_stories260k.py` end to end at a toy size: both models reported."""
    command = [
        sys.executable,
        str(DEMOS / "retrofit_stories260k.py"),
        "--out",
        str(tmp_path),
        "--steps",
        "3",
        "--sequences",
        "96",
        "--held-out",
        "32",
        "--length",
        "32",
        "--bootstrap",
        "20",
    ]
    subprocess.run(command, check=True, cwd=REPO, capture_output=True, timeout=1200)
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert len(runs) == 2 and all("shares" in run for run in runs)


def test_gpu_check_script_runs_its_steps_on_a_toy_size(tmp_path: Path) -> None:
    """demos/gpu_check.sh (the GPU measurement) end to end on the CPU at a toy Huginn size: every
    figure it reports is in its JSON (forwards per token, seconds and synchronisations by stage,
    memory beside the estimate), and the bench JSON holds the figures it prints."""
    from dcp_lens.studies.bench_work import WORK_STAGES

    environment = {
        **os.environ,
        "DEVICE": "cpu",
        "BENCH": "1",
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "BENCH_ARGS": "--d-model 96 --iterations 2 --vocab 128 --batch-size 1 --seq 8 --repeats 1",
        "GPU_CHECK_ARGS": "--d-model 96 --iterations 2 --vocab 128 --seq 8 --n 8 --batch-size 2 "
        "--matmul 64 --forward-repeats 1 --n-bootstrap 50",
    }
    completed = subprocess.run(
        ["bash", str(REPO / "demos" / "gpu_check.sh"), str(tmp_path)],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    bench = json.loads((tmp_path / "bench_huginn_bf16.json").read_text())
    assert bench["preset"] == "huginn" and bench["dtype"] == "bfloat16"
    assert (bench["model"]["n_prelude"], bench["model"]["n_core"], bench["model"]["n_coda"]) == (
        2,
        4,
        2,
    )
    assert bench["model"]["n_layers"] == 2 + 4 * 2 + 2
    per_million = bench["sweep_seconds_per_million_tokens"]
    assert per_million == pytest.approx(1e6 / bench["sweep_tokens_per_second"])
    assert f"{per_million:.1f} s per 1M tokens" in completed.stdout
    check = json.loads((tmp_path / "gpu_check.json").read_text())
    run = check["run"]
    assert check["matmul"]["tflops"] > 0 and check["forward"]["tokens_per_second"] > 0
    assert 0 < check["forward"]["share_of_matmul_rate"]
    assert run["sequences"] == [8, 8] and run["seconds_per_million_tokens"] == pytest.approx(
        run["seconds"] * 1e6 / (2 * 8 * 8)
    )
    stages = run["stage_seconds"]
    assert set(stages) == {*WORK_STAGES, "decomposition and bootstrap"}
    assert run["stages_done"] == list(stages)
    assert sum(stages.values()) <= run["seconds"] * 1.01
    forwards = run["forwards_per_token"]
    assert set(forwards) == set(WORK_STAGES)
    # The pass reads each calibration token once through s_r; the evaluation reads more.
    assert 0.9 <= forwards["calibration pass"] <= 1.2 < forwards["evaluation"]
    assert set(run["syncs_per_batch"]) == {"calibration pass", "evaluation"}
    assert run["peak_memory_gib"] > 0 and run["estimated_peak_gib"] > 0
    # Host memory beside the device's, and TF32 as `dcp-lens run` leaves it (off).
    assert run["peak_host_memory_gib"] > 0 and run["estimated_host_gib"] >= 0
    assert check["tf32"] is False and check["estimate"] == run["estimate"]
