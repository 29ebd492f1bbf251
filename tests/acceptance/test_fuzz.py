"""The fuzz suite: every input is a success or a clean refusal, never anything else.

Properties (hypothesis) over the command line's arguments, ``report --out``, config, tokenizer,
snapshot and training-state files and the Python entry points: each outcome is success or a
`DCPLensError` (on the command line: exit code 0 or 2 and one line on stderr, no traceback),
never another exception, and no command writes a file outside its ``--out``. A fault-injection
test SIGKILLs ``run``, ``run --overwrite`` and ``train`` at a random moment and checks the
folder: the old finished run, or an INCOMPLETE new one that ``--resume`` finishes, never a
mixture of two runs. `test_the_property_finds_an_unchecked_input` shows the suite failing when
one check is taken away.

The default run keeps a few examples of each (under two minutes in all); ``pytest -m slow``
runs the long profile. ``DCP_LENS_FUZZ_SEED`` replays the fault injection's random delays.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import data_path, outcome
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from dcp_lens import HookedRecurrentTransformer, load
from dcp_lens.cli import main
from dcp_lens.protocol.dcp import DepthControlProtocol
from dcp_lens.utils.errors import DCPLensError
from dcp_lens.utils.ownership import TEMPORARY

QUICK = settings(
    max_examples=12,
    deadline=60_000,  # ms per example: a hang fails the test instead of stalling the suite
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=False,
)
LONG = settings(QUICK, max_examples=150, deadline=300_000)
SMALL = ["--n-eval", "16", "--n-calibration", "16", "--bootstrap", "5", "--probe", "none"]
ROOT = Path(__file__).resolve().parents[2]

# Values a careless or hostile user types for a flag.
HOSTILE = st.sampled_from(
    [
        "",
        " ",
        "0",
        "-1",
        "1e3",
        "3e7",
        "abc",
        "..",
        "/",
        ".",
        ",",
        "1,,2",
        "1.5",
        "999999999999",
        "nan",
        "planted:",
        "\x00",
        "../..",
        "-",
        "--out",
    ]
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


# ------------------------------------------------------------------------------------ helpers


class Unclean(AssertionError):
    """An outcome the property forbids: another exception, a traceback, a file outside --out."""


def clean(action: Callable[[], Any], name: str) -> str:
    """`outcome`, with any other exception turned into `Unclean` naming it."""
    try:
        return outcome(action, name)
    except Unclean:
        raise
    except BaseException as error:  # the property's counterexample
        raise Unclean(f"{name}: {type(error).__name__}: {error}") from error


def files_under(folder: Path) -> set[Path]:
    return {path for path in folder.rglob("*") if path.is_file() or path.is_symlink()}


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Run the command line in this process: (exit code, stderr); argparse's exit included."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 2
    err = capsys.readouterr().err
    return code, err


def check_cli_outcome(code: int, err: str, argv: list[str]) -> None:
    if code not in (0, 2) or "Traceback" in err:
        raise Unclean(f"{argv}: exit {code}, stderr {err!r}")
    errors = [line for line in err.splitlines() if ": error:" in line]
    bugs = ("KeyError", "IndexError", "AttributeError", "AssertionError", "NameError",
            "UnboundLocalError", "ZeroDivisionError", "StopIteration")  # fmt: skip
    if any(f"error: {bug}:" in line for line in errors for bug in bugs):
        raise Unclean(f"{argv}: a bug reported as an error: {err!r}")
    if code == 2 and len(errors) != 1:
        raise Unclean(f"{argv}: exit 2 without exactly one error line: {err!r}")


@contextlib.contextmanager
def sandbox(root: Path) -> Iterator[Path]:
    """A fresh folder for one example, removed after it."""
    folder = root / f"case{time.monotonic_ns()}"
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def outside(before: set[Path], after: set[Path], allowed: Path) -> list[Path]:
    """New files that are not inside ``allowed`` (resolved)."""
    root = allowed.resolve()
    return [p for p in after - before if root != p.resolve() and root not in p.resolve().parents]


# ------------------------------------------------------------------- command-line arguments


@st.composite
def run_arguments(draw: st.DrawFn) -> tuple[list[str], str]:
    """``run`` (usually) or ``validate``/``bench`` arguments: small working ones, with one to
    three replaced by hostile values; and the --out given (relative to the sandbox)."""
    command = draw(st.sampled_from(["run", "run", "run", "validate", "bench"]))
    out = draw(st.sampled_from(["out", "a/b/out", "..", ".", "out/..", "file.txt", "out.html"]))
    if command == "run":
        model = draw(
            st.sampled_from(
                [
                    "planted:readout_shift",
                    "planted:block_count",
                    "..",
                    ".",
                    "/",
                    "planted:nope",
                    "huginn:/nonexistent",
                    "default-dense",
                    "huginn:..",
                ]
            )
        )
        options = {
            "--model": model,
            "--n-eval": "16",
            "--n-calibration": "16",
            "--bootstrap": "5",
            "--probe": "none",
            "--out": out,
        }
        flags = ["--k", "--metrics", "--batch-size", "--seed", "--threads", "--n-eval",
                 "--checkpoint-every", "--task", "--dense", "--max-tokens", "--dtype"]  # fmt: skip
    elif command == "validate":
        options = {
            "--models": "readout_shift",
            "--n-eval": "16",
            "--n-calibration": "16",
            "--bootstrap": "5",
            "--out": out,
        }
        flags = ["--models", "--metrics", "--n-eval", "--seed", "--threads"]
    else:
        options = {"--d-model": "16", "--iterations": "2", "--batch-size": "1", "--seq": "4",
                   "--repeats": "1", "--vocab": "16"}  # fmt: skip
        flags = [
            "--d-model",
            "--iterations",
            "--batch-size",
            "--seq",
            "--vocab",
            "--k",
            "--threads",
        ]
    for flag in draw(st.lists(st.sampled_from(flags), max_size=3, unique=True)):
        options[flag] = draw(HOSTILE)
    argv = [command]
    for flag, value in options.items():
        argv += [flag, value]
    if command == "run" and draw(st.booleans()):
        argv.append(draw(st.sampled_from(["--resume", "--overwrite", "--quiet"])))
    return [*argv, "--quiet"] if command != "bench" else argv, out


def check_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: tuple[list[str], str]
) -> None:
    argv, out = case
    with sandbox(tmp_path) as box:
        (box / "file.txt").write_text("a user's file")
        cwd = box / "cwd"
        cwd.mkdir()
        before = files_under(tmp_path)
        previous = Path.cwd()
        os.chdir(cwd)
        try:
            code, err = cli(argv, capsys)
        finally:
            os.chdir(previous)
        check_cli_outcome(code, err, argv)
        stray = outside(before, files_under(tmp_path), cwd / out if "--out" in argv else cwd)
        if stray:
            raise Unclean(f"{argv}: wrote outside --out: {sorted(map(str, stray))}")
        if (box / "file.txt").read_text() != "a user's file":
            raise Unclean(f"{argv}: overwrote a file it was not given")


@settings(QUICK, max_examples=8)
@given(case=run_arguments())
def test_command_line_arguments_are_run_or_refused_in_one_line(tmp_path, capsys, case):
    check_arguments(tmp_path, capsys, case)


@pytest.mark.slow
@LONG
@given(case=run_arguments())
def test_command_line_arguments_long(tmp_path, capsys, case):
    check_arguments(tmp_path, capsys, case)


# --------------------------------------------------------------------------- report --out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fuzz") / "run"
    assert (
        main(["run", "--model", "planted:readout_shift", *SMALL, "--quiet", "--out", str(out)]) == 0
    )
    return out


REPORT_OUTS = st.sampled_from(
    [
        "results.json",
        "report.html",
        "report_data.json",
        "planted_readout_shift",
        "planted_readout_shift/shares.csv",
        "planted_readout_shift/results.json",
        "new.html",
        "new",
        "new/deeper/r.html",
        "INCOMPLETE",
        ".checkpoints",
        "plotly.min.js",
        "x.HTML",
        "planted_readout_shift/report.html",
        "..",
        "results.json/x.html",
    ]
)


@settings(QUICK, max_examples=6)
@given(target=REPORT_OUTS)
def test_report_never_overwrites_the_run_it_reads(tmp_path, capsys, finished_run, target):
    with sandbox(tmp_path) as box:
        run = shutil.copytree(finished_run, box / "run")
        kept = {p: p.read_bytes() for p in files_under(run) if p.suffix not in (".html", ".js")}
        argv = ["report", str(run), "--out", str(run / target)]
        code, err = cli(argv, capsys)
        check_cli_outcome(code, err, argv)
        changed = [str(p) for p, data in kept.items() if not p.is_file() or p.read_bytes() != data]
        if changed:
            raise Unclean(f"{argv}: changed the run's files {changed}")
        assert main(["report", str(run)]) == 0
        capsys.readouterr()


# ------------------------------------------------------- the folder contract, every writer


FOLDER_STATES = ["absent", "empty", "user files", "finished run", "save folder", "report folder",
                 "link to user files", "link to save folder", "a file"]  # fmt: skip
WRITERS = ["results.save", "results.report folder", "results.report file", "report --out",
           "report --out file", "run --overwrite"]  # fmt: skip


def make_folder(box: Path, state: str, finished: Path) -> Path:
    """A target folder ``box/target`` in ``state`` (user files: notes, a .lock, plotly.min.js
    and validation.md of the user's own)."""
    target = box / "target"
    results = box / "results"
    if state == "a file":
        target.write_text("a user's file")
    elif state in ("empty", "user files", "link to user files"):
        real = box / "real" if state.startswith("link") else target
        real.mkdir()
        if state != "empty":
            for name in ("notes.txt", ".lock", "plotly.min.js", "validation.md"):
                (real / name).write_text(f"the user's {name}")
        if real != target:
            target.symlink_to(real)
    elif state == "finished run":
        shutil.copytree(finished, target)
        (target / "notes.txt").write_text("the user's notes")
    elif state in ("save folder", "report folder", "link to save folder"):
        from dcp_lens.protocol.results import ProtocolResults

        run = ProtocolResults.load(finished / "planted_readout_shift")
        real = box / "real" if state.startswith("link") else target
        run.save(real) if state != "report folder" else run.report(real)
        (real / "notes.txt").write_text("the user's notes")
        if real != target:
            target.symlink_to(real)
    results.mkdir()
    return target


def check_folder_contract(
    tmp_path: Path, capsys: Any, finished: Path, state: str, writer: str
) -> None:
    from dcp_lens.protocol.results import ProtocolResults

    with sandbox(tmp_path) as box:
        target = make_folder(box, state, finished)
        mine = [p for p in files_under(box) if p.is_file() and not p.is_symlink()]
        user = {p: p.read_bytes() for p in mine if b"the user's" in p.read_bytes()}
        run_before = (target / "results.json").read_bytes() if state == "finished run" else None
        run = ProtocolResults.load(finished / "planted_readout_shift")
        argv: list[str] = []
        if writer == "results.save":
            clean(lambda: run.save(target), writer)
        elif writer == "results.report folder":
            clean(lambda: run.report(target), writer)
        elif writer == "results.report file":
            clean(lambda: run.report(target / "r.html"), writer)
        elif writer.startswith("report"):
            argv = [
                "report",
                str(finished),
                "--out",
                str(target / "r.html" if "file" in writer else target),
            ]
        else:
            argv = [
                "run",
                "--model",
                "planted:readout_shift",
                *SMALL,
                "--quiet",
                "--overwrite",
                "--out",
                str(target),
            ]
        if argv:
            code, err = cli(argv, capsys)
            check_cli_outcome(code, err, argv)
        changed = [str(p) for p, data in user.items() if not p.is_file() or p.read_bytes() != data]
        if changed:
            raise Unclean(f"{writer} into {state}: changed the user's files {changed}")
        if run_before is not None and writer != "run --overwrite":
            if (target / "results.json").read_bytes() != run_before:
                raise Unclean(f"{writer} replaced a finished run's results.json")
        if "link" in state and not target.is_symlink():
            raise Unclean(f"{writer} replaced the link {target}")
        stray = [p.name for p in box.iterdir() if ".replacing" in p.name]
        if stray:
            raise Unclean(f"{writer} left {stray}")


@settings(QUICK, max_examples=8)
@given(state=st.sampled_from(FOLDER_STATES), writer=st.sampled_from(WRITERS))
def test_every_writer_keeps_the_folder_contract(tmp_path, capsys, finished_run, state, writer):
    check_folder_contract(tmp_path, capsys, finished_run, state, writer)


@pytest.mark.slow
@settings(LONG, max_examples=80)
@given(state=st.sampled_from(FOLDER_STATES), writer=st.sampled_from(WRITERS))
def test_every_writer_keeps_the_folder_contract_long(tmp_path, capsys, finished_run, state, writer):
    check_folder_contract(tmp_path, capsys, finished_run, state, writer)


ARRAYS = st.builds(
    lambda rows, cols, kind, low, ragged: (
        [[low + (i * 7 + j) % 9 for j in range(cols - (ragged and i % 2))] for i in range(rows)]
        if kind == "list"
        else np.full((rows, cols), low).astype(kind)
    ),
    st.integers(0, 3),
    st.integers(0, 6),
    st.sampled_from(["list", "int64", "int32", "uint8", "float32", "float64", "bool", "complex64"]),
    st.integers(-2, 3),
    st.booleans(),
)
POSITIONS = st.one_of(
    st.none(),
    st.lists(st.lists(st.one_of(st.integers(-2, 8), st.floats(-1, 8)), max_size=3), max_size=4),
)


@QUICK
@given(tokens=ARRAYS, positions=POSITIONS)
def test_evaluation_sets_from_lists_and_arrays_are_taken_or_refused(tokens, positions):
    from dcp_lens.protocol.evaluation_set import EvaluationSet

    clean(lambda: EvaluationSet.from_tokens(tokens, positions), "evaluation set")


# ------------------------------------------------------------------ config and snapshot files


CONFIG_FIELDS = ["vocab_size", "padded_vocab_size", "n_embd", "n_heads", "block_size",
                 "mean_recurrence", "intermediate_size", "n_layers_in_prelude", "rope_base",
                 "init_values", "norm_eps", "qk_bias", "head_dim"]  # fmt: skip
TOKENIZER_FIELDS = ["add_bos_token", "bos_token", "eos_token", "pad_token", "model_max_length"]


@st.composite
def file_damage(draw: st.DrawFn) -> tuple[str, Any]:
    """(file, new content): a field set to any JSON value, a whole file replaced, or bytes."""
    file = draw(st.sampled_from(["config.json", "tokenizer_config.json"]))
    kind = draw(st.sampled_from(["field", "field", "whole", "bytes"]))
    if kind == "bytes":
        return file, draw(st.binary(max_size=64))
    if kind == "whole":
        return file, json.dumps(draw(JSON))
    fields = CONFIG_FIELDS if file == "config.json" else TOKENIZER_FIELDS
    return file, (draw(st.sampled_from(fields)), draw(JSON))


@pytest.fixture(scope="module")
def huginn_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = shutil.copytree(
        data_path("fixtures", "huginn_tiny"), tmp_path_factory.mktemp("h") / "h"
    )
    for path in folder.iterdir():
        path.chmod(0o644)
    return folder


def check_damaged_checkpoint(huginn_copy: Path, damage: tuple[str, Any]) -> None:
    file, change = damage
    path = huginn_copy / file
    original = path.read_bytes()
    try:
        if isinstance(change, bytes):
            path.write_bytes(change)
        elif isinstance(change, tuple):
            document = json.loads(original)
            document[change[0]] = change[1]
            path.write_text(json.dumps(document))
        else:
            path.write_text(change)
        model: list[Any] = []
        clean(lambda: model.append(load(f"huginn:{huginn_copy}")), f"huginn {file}")
        if model:  # it loaded: it must also run
            clean(lambda: model[0](torch.zeros(1, 4, dtype=torch.long)), "huginn forward")
    finally:
        path.write_bytes(original)


@QUICK
@given(damage=file_damage())
def test_damaged_checkpoint_configs_load_or_are_refused(huginn_copy, damage):
    check_damaged_checkpoint(huginn_copy, damage)


@pytest.mark.slow
@LONG
@given(damage=file_damage())
def test_damaged_checkpoint_configs_long(huginn_copy, damage):
    check_damaged_checkpoint(huginn_copy, damage)


SNAPSHOTS = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda done, state: {"done": done, "state": state}, JSON, JSON),
    st.builds(lambda value: value, JSON),
    st.builds(lambda n: torch.zeros(n), st.integers(0, 4)),
)


@QUICK
@given(snapshot=SNAPSHOTS)
def test_resume_snapshots_restore_or_are_refused(tmp_path, snapshot):
    from dcp_lens.utils.snapshots import Checkpoint

    checkpoint = Checkpoint(tmp_path / "snapshots")
    checkpoint.folder.mkdir(exist_ok=True)
    path = checkpoint._path("calibration")
    if isinstance(snapshot, bytes):
        path.write_bytes(snapshot)
    else:
        torch.save(snapshot, path)
    restored: list[Any] = []
    clean(
        lambda: restored.append(checkpoint.restore("calibration", torch.device("cpu"))), "snapshot"
    )
    if restored:
        assert type(restored[0][0]) is int and restored[0][0] >= 0


@pytest.fixture(scope="module")
def training_state(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A training checkpoint of the tiny preset (written without training) and its config."""
    from dcp_lens.training import preset
    from dcp_lens.training.loop import make_optimizer
    from dcp_lens.training.regimes import build_regime_model
    from dcp_lens.training.state import RunState, save_checkpoint

    config = preset("tiny", steps=4)
    model = build_regime_model(config.model, config.regime)
    optimizer, names = make_optimizer(model, config)
    out = tmp_path_factory.mktemp("state")
    state = RunState(step=1, max_hops=None, history={"steps": []})
    save_checkpoint(out, model, optimizer, names, torch.Generator(), state, config)
    return out / "checkpoint", config


@QUICK
@given(
    field=st.sampled_from(
        ["step", "max_hops", "history", "parameter_names", "param_groups", "format", "config"]
    ),
    value=JSON,
    drop=st.booleans(),
)
def test_training_states_restore_or_are_refused(tmp_path, training_state, field, value, drop):
    from dcp_lens.training.loop import make_optimizer
    from dcp_lens.training.regimes import build_regime_model
    from dcp_lens.training.state import load_checkpoint

    source, config = training_state
    folder = shutil.copytree(source, tmp_path / f"c{time.monotonic_ns()}")
    plain = json.loads((folder / "trainer_state.json").read_text())
    if drop:
        plain.pop(field, None)
    else:
        plain[field] = value
    (folder / "trainer_state.json").write_text(json.dumps(plain))
    model = build_regime_model(config.model, config.regime)
    optimizer, names = make_optimizer(model, config)
    clean(
        lambda: load_checkpoint(folder, model, optimizer, names, torch.Generator()), "train state"
    )


# ------------------------------------------------------------------------ Python entry points


TOKENS = st.builds(
    lambda batch, pos, dtype, low, high, meta: (
        torch.randint(low, high + 1, (batch, pos)).to(dtype).to("meta" if meta else "cpu")
    ),
    st.integers(0, 3),
    st.integers(0, 10),
    st.sampled_from([torch.long, torch.int32, torch.float32, torch.uint8, torch.bool]),
    st.integers(-3, 0),
    st.integers(0, 40),
    st.booleans(),
)


@functools.cache
def planted() -> HookedRecurrentTransformer:
    return load("planted:readout_shift")


def check_forward(tokens: torch.Tensor) -> None:
    clean(lambda: planted()(tokens), "forward")


@QUICK
@given(tokens=TOKENS)
def test_forward_takes_tokens_or_refuses_them(tokens):
    check_forward(tokens)


@QUICK
@given(
    spec=st.sampled_from(["planted:readout_shift", "default", "planted:block_count", "..", ""]),
    overrides=st.dictionaries(
        st.sampled_from(["device", "dtype", "seed", "size", "bogus", "n_iterations", "angle"]),
        st.one_of(JSON, st.sampled_from(["cuda", "meta", "cpu", "float64", "int8", "cuda:7"])),
        max_size=2,
    ),
)
def test_load_builds_or_refuses(spec, overrides):
    clean(lambda: load(spec, **overrides), "load")


PROTOCOL_SETTINGS = st.dictionaries(
    st.sampled_from(["seed", "batch_size", "k_grid", "n_bootstrap", "metrics", "probe"]),
    st.one_of(JSON, st.lists(st.one_of(st.integers(-2, 9), st.floats(0, 9), st.text(max_size=2)))),
    max_size=2,
)


@settings(QUICK, max_examples=6)
@given(settings_=PROTOCOL_SETTINGS)
def test_protocol_settings_are_taken_or_refused(settings_):
    clean(lambda: DepthControlProtocol(planted(), progress=False, **settings_), "protocol")


# --------------------------------------------------- the property fails when a check is removed


def test_the_property_finds_an_unchecked_input(monkeypatch):
    """Take the token checks out of the model's forward: the forward property must then find
    an input that fails with something other than a DCPLensError (an IndexError, ...)."""

    def unchecked(self: HookedRecurrentTransformer, input: Any, offset: int = 0) -> torch.Tensor:
        return input.long() if input.ndim == 2 else input[None].long()

    monkeypatch.setattr(HookedRecurrentTransformer, "_as_tokens", unchecked)
    search = settings(  # stop at the first counterexample: no shrinking, no replay database
        QUICK, max_examples=100, database=None, phases=[Phase.generate], report_multiple_bugs=False
    )
    with pytest.raises(Unclean) as found:
        search(given(tokens=TOKENS)(check_forward))()
    assert not isinstance(found.value.__cause__, DCPLensError)


# -------------------------------------------------------------------------- fault injection


def fault_seed() -> int:
    return int(os.environ.get("DCP_LENS_FUZZ_SEED") or random.SystemRandom().randrange(10**6))


def start(argv: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    code = "import sys; from dcp_lens.cli import main; raise SystemExit(main(sys.argv[1:]))"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", code, *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def kill_after(
    process: subprocess.Popen[bytes], delay: float, started: Path | Callable[[], bool]
) -> bool:
    """SIGKILL ``process`` ``delay`` seconds after ``started`` appears (or is true: the command
    has passed its checks and begun writing: python's and torch's start-up are not what is
    tested); False if it had finished by then."""
    begun = started if callable(started) else started.exists
    deadline = time.monotonic() + 120
    while not begun() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        process.wait(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        return True


def seeds_in(folder: Path) -> set[int]:
    """The seeds of every results.json under ``folder``: one seed means one run's files."""
    seeds = set()
    for path in folder.rglob("results.json"):
        for run in json.loads(path.read_text())["runs"]:
            seeds.add(run["metadata"]["seed"])
    return seeds


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def run_command(out: Path, seed: int, *extra: str) -> list[str]:
    return [
        "run",
        "--model",
        "planted:readout_shift",
        *SMALL,
        "--seed",
        str(seed),
        "--quiet",
        "--checkpoint-every",
        "1",
        "--batch-size",
        "8",
        "--out",
        str(out),
        *extra,
    ]


def check_killed_run(tmp_path: Path, rng: random.Random, reference: Path) -> None:
    out = tmp_path / "killed"
    delay = rng.uniform(0.0, 3.0)
    killed = kill_after(start(run_command(out, 0), tmp_path), delay, out)
    note = f"(killed={killed} after {delay:.1f}s; DCP_LENS_FUZZ_SEED replays)"
    contract = {".lock", ".dcp-lens.json", ".dcp-lens.journal"}  # before the models load
    if out.exists() and not (out / "INCOMPLETE").exists():
        names = {p.name for p in out.iterdir() if not TEMPORARY.match(p.name)}
        only_lock = names <= contract
        assert only_lock or (out / "results.json").is_file(), f"an unmarked partial folder {note}"
    assert seeds_in(out) <= {0}, note if out.exists() else note
    code = main(run_command(out, 0, "--resume"))
    assert code == 0, note
    assert (out / "results.json").read_text() == (reference / "results.json").read_text(), note


def check_killed_overwrite(tmp_path: Path, rng: random.Random, reference: Path) -> None:
    out = shutil.copytree(reference, tmp_path / "replaced")
    old = digest(out)
    delay = rng.uniform(0.0, 3.0)

    def sibling() -> bool:  # the replacement's folder, beside the old one
        return any(tmp_path.glob(".replaced.replacing.*"))

    killed = kill_after(start(run_command(out, 5, "--overwrite"), tmp_path), delay, sibling)
    note = f"(killed={killed} after {delay:.1f}s; DCP_LENS_FUZZ_SEED replays)"
    if (out / "INCOMPLETE").exists():  # the new run, swapped in before its marker went
        assert seeds_in(out) == {5}, f"a mixed folder {note}"
    elif seeds_in(out) == {0}:
        assert digest(out) == old, f"the old run was changed {note}"
    else:
        assert seeds_in(out) == {5} and main(["report", str(out)]) == 0, note
    assert main(run_command(out, 5, "--overwrite")) == 0, note
    assert seeds_in(out) == {5}
    assert sorted(p.name for p in tmp_path.iterdir() if "replaced" in p.name) == ["replaced"]


def check_killed_train(tmp_path: Path, rng: random.Random) -> None:
    out = tmp_path / "train"
    argv = ["train", "--preset", "tiny", "--steps", "3", "--out", str(out)]
    delay = rng.uniform(0.0, 3.0)
    killed = kill_after(start(argv, tmp_path), delay, out)
    note = f"(killed={killed} after {delay:.1f}s; DCP_LENS_FUZZ_SEED replays)"
    assert main(argv) == 0, note  # resumed from its checkpoint, or started over
    history = json.loads((out / "history.json").read_text())
    assert len(history["steps"]) == 3, note
    load(str(out / "model"))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main(run_command(out, 0)) == 0
    return out


@pytest.mark.parametrize("scenario", ["run", "overwrite", "train"])
def test_a_kill_at_a_random_moment_leaves_a_folder_that_finishes(
    tmp_path, capsys, reference_run, scenario
):
    seed = fault_seed()
    rng = random.Random(seed)
    print(f"DCP_LENS_FUZZ_SEED={seed}")
    check_killed(scenario, tmp_path, rng, reference_run)


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(6))
@pytest.mark.parametrize("scenario", ["run", "overwrite", "train"])
def test_kills_long(tmp_path, capsys, reference_run, scenario, attempt):
    check_killed(scenario, tmp_path, random.Random(fault_seed() + attempt), reference_run)


def check_killed(scenario: str, tmp_path, rng: random.Random, reference_run) -> None:
    """The kill scenario ``scenario`` ("run", "overwrite" or "train") with ``rng``."""
    if scenario == "run":
        check_killed_run(tmp_path, rng, reference_run)
    elif scenario == "overwrite":
        check_killed_overwrite(tmp_path, rng, reference_run)
    else:
        check_killed_train(tmp_path, rng)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
@pytest.mark.slow
def test_a_real_signal_stops_a_run_in_one_line_and_it_resumes(tmp_path, reference_run, signum):
    out = tmp_path / "out"
    process = start(run_command(out, 0), tmp_path)
    deadline = time.monotonic() + 120
    while not list((out / ".checkpoints").rglob("*.pt")) and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    text = err.decode().strip()
    assert process.returncode == 128 + signum and "Traceback" not in text, text
    assert len(text.splitlines()) == 1 and "--resume" in text, text
    assert main(run_command(out, 0, "--resume")) == 0
    assert (out / "results.json").read_text() == (reference_run / "results.json").read_text()
