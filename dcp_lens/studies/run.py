"""The run workflow: the Depth Control Protocol on model specs, a task and a `ProtocolConfig`,
written into an output folder. ``dcp-lens run`` is a call of `run`; so is a script::

    from dcp_lens.protocol.config import ProtocolConfig
    from dcp_lens.studies.run import RunOptions, run

    outcome = run("out/planted", model="planted:readout_shift",
                  config=ProtocolConfig(n_bootstrap=20), options=RunOptions(n_eval=64))

Every model and its data are loaded and every protocol built (all inputs checked) before the
folder is prepared; the folder follows `dcp_lens.utils.folders.OutputFolder`'s contract: locked
before it is judged, a finished run never replaced without ``overwrite``, an ``overwrite``
written beside it and swapped in at the end with the files a user added kept, an interrupted
run continued with ``resume``. On a torchrun process group every rank computes, rank 0 writes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcp_lens.protocol.config import COMMAND_DEFAULTS, ProtocolConfig
from dcp_lens.studies.commands import DEFAULT_DENSE, DEFAULT_MODEL
from dcp_lens.utils import ownership
from dcp_lens.utils.errors import ConfigError, DamagedFileError, DCPLensError
from dcp_lens.utils.files import (
    MARKER,
    inside,
    mark_complete,
    mark_incomplete,
    safe_name,
    write_text_atomically,
)
from dcp_lens.utils.folders import CHECKPOINTS, OutputFolder, report_target

if TYPE_CHECKING:
    from dcp_lens.protocol.evaluation_set import EvaluationSet
    from dcp_lens.protocol.results import ProtocolResults

TEXT_FLAGS = {"seq_len": "--seq-len", "max_tokens": "--max-tokens", "token_dtype": "--token-dtype"}


@dataclass(frozen=True)
class TextOptions:
    """How a ``text:PATH`` task reads its corpus (`dcp_lens.tasks.text.text_task`); None
    leaves a setting to the task. ``text_field``: the field of a .jsonl record."""

    seq_len: int | None = None
    max_tokens: int | None = None
    text_field: str | None = None
    token_dtype: str | None = None

    def given(self) -> list[str]:
        """The command-line flags of the settings given."""
        flags = [flag for name, flag in TEXT_FLAGS.items() if getattr(self, name) is not None]
        return flags + (["--text-field"] if self.text_field is not None else [])


@dataclass(frozen=True)
class RunOptions:
    """How a run is made, besides the protocol's settings (`ProtocolConfig`): the data's size,
    where and in what dtype it computes, and how it treats an existing folder."""

    n_eval: int | None = None  # None: 512 (text: every window left)
    n_calibration: int | None = None
    text: TextOptions = field(default_factory=TextOptions)
    device: str = "cpu"
    dtype: str | None = None  # None: the model's own
    progress: bool = True
    resume: bool = False
    overwrite: bool = False
    checkpoint_every: int = 16  # batches between --resume snapshots
    # No batch size given: the largest that fits the budget, up to the config's (printed).
    batch_from_budget: bool = False
    command: str = "dcp_lens.studies.run.run"  # recorded in report_data.json


@dataclass
class RunOutcome:
    """What `run` did: the results per model (empty when ``resume`` found the run finished),
    the folder written, and whether it was already finished."""

    results: list[ProtocolResults]
    folder: Path
    already_finished: bool = False

    def summary(self) -> str:
        """The verdict per model and metric, the legend and the flags, as the command prints."""
        from dcp_lens.report.console import format_summaries

        return str(format_summaries(self.results))


@dataclass
class _Plan:
    """One model of a run: its spec, subfolder, "finished" file; its model, protocol and data
    (None when an interrupted run finished it already)."""

    spec: str
    name: str
    model: Any = None
    protocol: Any = None
    data: Any = None


def run(
    out: str | Path,
    model: str = DEFAULT_MODEL,
    dense: str | None = None,
    task: str | None = None,
    config: ProtocolConfig | None = None,
    options: RunOptions | None = None,
) -> RunOutcome:
    """Run the protocol on ``model`` (a model spec, `dcp_lens.zoo.registry.load`) and the dense
    control ``dense`` (None: none) on ``task`` (None: the model's own; a task name,
    ``char_lm:PATH`` or ``text:PATH``), writing ``out``: per model a subfolder of
    ``results.json`` and tables, then ``report.html``, ``report_data.json`` and the combined
    ``results.json`` (written last: it says the run finished).

    Raises:
        ConfigError: a setting or the folder is refused (a finished run without ``overwrite``,
            a folder of other files); nothing is written then.
    """
    from dcp_lens.utils import distributed

    options = options or RunOptions()
    config = config or ProtocolConfig.from_dict(dict(COMMAND_DEFAULTS.get("run", {})))
    _check_text_options(task, options.text)
    options = _on_rank(options, distributed.init_from_environment(options.device))
    try:
        outcome = _run(Path(out), model, dense, task, config, options)
    except BaseException:
        distributed.finish(wait=False)  # no barrier: this rank fails, torchrun stops the others
        raise
    distributed.finish()
    return outcome


def dry_run(
    model: str = DEFAULT_MODEL,
    dense: str | None = None,
    task: str | None = None,
    config: ProtocolConfig | None = None,
    options: RunOptions | None = None,
) -> str:
    """What `run` would hold in memory, per model, without running or writing anything: each
    model is loaded and its data built as `run` would, then `DepthControlProtocol.estimate`
    gives the peak by term and stage against the budget, with the largest batch size that
    fits. Returns the text `dcp-lens run --dry-run` prints."""
    from dcp_lens.protocol.budget import GIB, MemoryEstimate
    from dcp_lens.protocol.dcp import DepthControlProtocol
    from dcp_lens.protocol.evaluation_set import task_data

    options = options or RunOptions()
    config = config or ProtocolConfig.from_dict(dict(COMMAND_DEFAULTS.get("run", {})))
    _check_text_options(task, options.text)
    text = {k: v for k, v in asdict(options.text).items() if v is not None}
    lines: list[str] = []
    data = None
    for spec in [model] + ([dense] if dense else []):
        loaded = _load_model(spec, options)
        if data is None or hasattr(loaded, "planted_task"):
            data = task_data(
                loaded, task, options.n_eval, options.n_calibration, config.seed, **text
            )
        protocol = DepthControlProtocol(loaded, config, spec=spec, progress=False)
        evaluation, calibration = data
        fits = protocol.largest_fitting_batch(evaluation, calibration)
        if options.batch_from_budget and 0 < fits < config.batch_size:
            protocol.use_batch_size(fits)
            lines.append(
                f"batch size {fits}: the largest up to {config.batch_size} whose estimated "
                "peak fits the memory budget (--batch-size sets it)"
            )
        estimate: MemoryEstimate = protocol.estimate(evaluation, calibration)
        budget = protocol.context.budget()
        lines += [
            f"{spec} on {protocol.context.device()}: {len(evaluation)} + {len(calibration)} "
            f"sequences of {int(evaluation.tokens.shape[1])} tokens, batch size "
            f"{protocol.config.batch_size}, {estimate.plan.rows} readout rows a call",
            estimate.table(),
            f"  budget: {'unknown' if budget is None else f'{budget / GIB:.2f} GiB'}; largest "
            f"batch size that fits: {fits if budget is not None else 'unknown'}",
            *(f"  note: {note}" for note in estimate.notes),
        ]
    return "\n".join(lines)


def _on_rank(options: RunOptions, device: str) -> RunOptions:
    values = asdict(options) | {"device": device, "text": options.text}
    return RunOptions(**values)


def _check_text_options(task: str | None, text: TextOptions) -> None:
    given = text.given()
    if given and not (task or "").startswith("text:"):
        raise ConfigError(
            f"{', '.join(given)} apply to --task text:PATH only; drop them or pass a text task."
        )


def _run(
    out: Path,
    model: str,
    dense: str | None,
    task: str | None,
    config: ProtocolConfig,
    options: RunOptions,
) -> RunOutcome:
    from dcp_lens.utils import distributed

    main = distributed.is_main()
    folder = OutputFolder(out, "run", overwrite=options.overwrite, resume=options.resume)
    settings = _settings(model, dense, task, config, options)
    work = None
    if main:
        work = folder.open(staged=True)  # locked, and judged again under the lock
    try:
        done = main and folder.action == "continue" and bool(folder.contents)
        done = done and bool(folder.contents and folder.contents.finished)
        shared = distributed.broadcast_from_main(("" if done else str(work)) if main else None)
        if not shared:  # --resume of a finished run: nothing to do, on every rank
            folder.close()
            return RunOutcome([], out, already_finished=True)
        work = Path(shared)
        if not main:  # this rank's snapshots: recorded as the run's own, as rank 0's files are
            journal = ownership.begin(work, "run")
        specs = [(model, False)] + ([(dense, True)] if dense else [])
        plans = _load(work, specs, task, config, options)
        if options.batch_from_budget:
            config = _batch_from_budget(plans, config, work if options.resume else None)
            settings = _settings(model, dense, task, config, options)
        if main and options.resume:
            _check_resumed_settings(work, settings)
        if main:
            _prepare(folder, work, settings)
        distributed.broadcast_from_main(True)  # no rank starts before the folder is ready
        results = _run_plans(plans, work, task, config, options)
    except (ValueError, TypeError):  # DCPLensError, and the checks torch and the sweep make
        if main:  # a folder this run made, holding nothing --resume could continue, goes
            folder.close(abandon=folder.work != folder.real or not _resumable(work))
        raise
    except BaseException:
        if main:
            folder.close()
        raise
    if not main:
        ownership.end(journal)
        return RunOutcome(results, out)
    folder.finish()  # the manifest, the swap of an --overwrite; then unmarked: finished
    mark_complete(folder.real)
    return RunOutcome(results, out)


def _batch_from_budget(
    plans: list[_Plan], config: ProtocolConfig, resumed: Path | None
) -> ProtocolConfig:
    """The run's config with the largest batch size up to ``config``'s whose estimate fits every
    model's budget (the batch an interrupted run chose, when ``resumed``: a run's batches keep
    their size), set on every plan's protocol and printed."""
    size = config.batch_size
    recorded = resumed / CHECKPOINTS / "command.json" if resumed is not None else None
    if recorded is not None and recorded.is_file():
        size = int(json.loads(recorded.read_text()).get("config.batch_size", size))
    else:
        fits = [
            plan.protocol.largest_fitting_batch(*plan.data)
            for plan in plans
            if plan.protocol is not None
        ]
        size = min([*fits, size]) or size  # none fits: the check before the run says so
    from dcp_lens.utils import distributed

    size = int(distributed.broadcast_from_main(size if distributed.is_main() else None))
    if size == config.batch_size:
        return config
    for plan in plans:
        if plan.protocol is not None:
            plan.protocol.use_batch_size(size)
    print(
        f"batch size {size}: the largest up to {config.batch_size} whose estimated peak fits the "
        "memory budget (--batch-size sets it; `dcp-lens run --dry-run` prints the estimate)"
    )
    return config.replace(batch_size=size)


def _settings(
    model: str, dense: str | None, task: str | None, config: ProtocolConfig, options: RunOptions
) -> dict[str, str]:
    """What makes a run's results (recorded for --resume): the specs, the task, the data's
    size and reading, the dtype and every protocol setting."""
    values: dict[str, object] = {
        "model": model, "dense": dense, "task": task, "n_eval": options.n_eval,
        "n_calibration": options.n_calibration, "dtype": options.dtype,
        **{f"text.{k}": v for k, v in asdict(options.text).items()},
        **{f"config.{k}": v for k, v in config.to_dict().items()},
    }  # fmt: skip
    return {key: str(value) for key, value in sorted(values.items())}


def _check_resumed_settings(work: Path, settings: dict[str, str]) -> None:
    recorded = work / CHECKPOINTS / "command.json"
    if not recorded.is_file():
        return
    from dcp_lens.utils.checks import read_json_object

    try:
        before = dict(read_json_object(recorded))
    except DCPLensError as error:
        raise DamagedFileError(
            f"{' '.join(str(error).split())} It records the interrupted command; start again "
            "without --resume (the run's snapshots are discarded)."
        ) from error
    changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
    if changed:
        raise ConfigError(
            f"--resume continues the same run, but {', '.join(changed)} differ from the "
            f"interrupted command ({recorded}); rerun it as it was or drop --resume."
        )


def _load(
    work: Path,
    specs: Sequence[tuple[str, bool]],
    task: str | None,
    config: ProtocolConfig,
    options: RunOptions,
) -> list[_Plan]:
    """Every model loaded, its data built and its protocol made (every input checked), for
    the models an interrupted run did not finish."""
    from dcp_lens.protocol.dcp import DepthControlProtocol
    from dcp_lens.protocol.evaluation_set import task_data
    from dcp_lens.utils import distributed
    from dcp_lens.utils.snapshots import Checkpoint

    names = _folder_names([spec for spec, _ in specs])
    text = {k: v for k, v in asdict(options.text).items() if v is not None}
    plans: list[_Plan] = []
    data: tuple[EvaluationSet, EvaluationSet] | None = None
    first: Any = None
    for (spec, is_negative_control), name in zip(specs, names, strict=True):
        inside(work / name, work)
        if options.resume and (work / CHECKPOINTS / name / "finished").is_file():
            plans.append(_Plan(spec, name))  # finished before the interruption
            continue
        model = _load_model(spec, options)
        if is_negative_control and not model.is_dense:
            raise ConfigError(
                f"--dense {spec!r} is not a dense model (it has a weight-shared core); pass a "
                "dense model as the negative control."
            )
        if data is None or hasattr(model, "planted_task"):
            data = task_data(
                model, task, options.n_eval, options.n_calibration, config.seed, **text
            )
        elif first is not None:
            _check_same_data(first, model, spec, task)
        first = first if first is not None else model
        protocol = DepthControlProtocol(
            model, config, spec=spec, progress=options.progress and distributed.is_main(),
            checkpoint=Checkpoint(work / CHECKPOINTS / name, options.checkpoint_every),
        )  # fmt: skip
        plans.append(_Plan(spec, name, model, protocol, data))
    return plans


def _prepare(folder: OutputFolder, work: Path, settings: dict[str, str]) -> None:
    """The folder made ready under the lock: an interrupted run's own files removed unless
    resumed, marked incomplete, the run's settings recorded for --resume."""
    folder.prepare()  # an interrupted run's own files go unless resumed
    mark_incomplete(work, "dcp-lens run")
    (work / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
    text = json.dumps(settings, indent=2, sort_keys=True) + "\n"
    write_text_atomically(work / CHECKPOINTS / "command.json", text)


def _run_plans(
    plans: list[_Plan], work: Path, task: str | None, config: ProtocolConfig, options: RunOptions
) -> list[ProtocolResults]:
    from dcp_lens.protocol.results import write_results_json
    from dcp_lens.report.html import write_report
    from dcp_lens.studies.report_extras import REPORT_DATA, collect_report_data, write_report_data
    from dcp_lens.utils import distributed
    from dcp_lens.utils.environment import environment
    from dcp_lens.utils.snapshots import die_if_asked

    main = distributed.is_main()
    runs: list[ProtocolResults] = []
    extras: list[dict[str, object]] = []
    pairing = _layer_pairing(plans)
    for plan in plans:
        folder = work / plan.name
        if plan.protocol is None:
            runs.append(_read_finished(folder))
            extras.append(report_data_of(folder)["runs"][runs[-1].model])
            continue
        results = _resumed(plan, work, options.resume)
        if not main:  # rank 0 writes
            continue
        if pairing is not None:  # both runs record how the control's layers line up
            results = replace(results, metadata={**results.metadata, "layer_pairing": pairing})
        runs.append(results)
        vocab = _vocab(plan.model, task, config.seed)
        extra = collect_report_data(
            plan.protocol, plan.data[0], vocab=vocab, n_bootstrap=min(config.n_bootstrap, 200)
        )
        extras.append(extra)
        # Per-model results are written as each finishes (results.json last: it says the model
        # is finished); the folder is marked incomplete until all are.
        _save_model(results, folder)
        env = environment()
        write_report_data([extra], folder / REPORT_DATA, command=options.command, environment=env)
        write_text_atomically(work / CHECKPOINTS / plan.name / "finished", f"{plan.spec}\n")
        die_if_asked(f"model:{len(runs)}")
    if not main:
        return runs
    env = environment()
    write_report_data(extras, work / REPORT_DATA, command=options.command, environment=env)
    write_report(runs, work, report_data_of(work))
    write_results_json(runs, work / "results.json")  # last: results.json means finished
    shutil.rmtree(work / CHECKPOINTS, ignore_errors=True)
    die_if_asked("written")
    return runs


def _layer_pairing(plans: Sequence[_Plan]) -> dict[str, Any] | None:
    """How the dense control's layers line up with the model's (`layer_pairing`), when the run
    has a dense control and the model's kind registers a pairing."""
    from dcp_lens.zoo.registry import layer_pairing

    if len(plans) < 2:
        return None
    return layer_pairing(plans[0].spec, plans[1].spec)


def _save_model(results: ProtocolResults, folder: Path) -> None:
    """One model's results.json and tables in its subfolder of the run (the run's own)."""
    from dcp_lens.protocol.results import write_results_json

    folder.mkdir(parents=True, exist_ok=True)
    for name, table in (
        ("decomposition.csv", results.table()), ("curves.csv", results.curves()),
        ("shares.csv", results.shares()),
    ):  # fmt: skip
        write_text_atomically(folder / name, table.to_csv(index=False))
    write_results_json([results], folder / "results.json")


def _resumed(plan: _Plan, work: Path, resume: bool) -> ProtocolResults:
    """``plan``'s protocol run; with ``resume``, snapshots that load but do not fit the run
    (another version's, edited) are refused naming their folder."""
    snapshots = work / CHECKPOINTS / plan.name
    try:
        results: ProtocolResults = plan.protocol.run(*plan.data)
    except (KeyError, IndexError, TypeError, AttributeError, RuntimeError) as cause:
        if not (resume and any(snapshots.glob("*.pt"))):
            raise
        text = " ".join(str(cause).split())[:160] or type(cause).__name__
        raise DamagedFileError(
            f"the --resume snapshots in {snapshots} do not fit this run ({type(cause).__name__}: "
            f"{text}); start the run again without --resume."
        ) from cause
    return results


def _load_model(spec: str, options: RunOptions) -> Any:
    import torch

    from dcp_lens.zoo.registry import load

    dtype = getattr(torch, options.dtype) if options.dtype else None
    return load(spec).to(device=options.device, dtype=dtype).eval()


def _folder_names(specs: Sequence[str]) -> list[str]:
    """One subfolder name per model spec, safe (`safe_name`) and distinct."""
    names: list[str] = []
    for spec in specs:
        name = safe_name(spec)
        while name in names or name == CHECKPOINTS:
            name += "_2"
        names.append(name)
    return names


def _check_same_data(first: Any, model: Any, spec: str, task: str | None) -> None:
    """The dense control is evaluated on the first model's data: refused unless it reads that
    data as the first model does (the same task when no task is given, the same vocabulary
    and tokenizer)."""
    reasons = []
    first_task, task_config = (getattr(m, "task_config", None) for m in (first, model))
    if task is None and first_task != task_config:
        reasons.append(f"its task {task_config} differs from {first_task}")
    if int(first.cfg.d_vocab) != int(model.cfg.d_vocab):
        reasons.append(f"its vocabulary of {model.cfg.d_vocab} differs from {first.cfg.d_vocab}")
    elif _tokenizer_print(first) != _tokenizer_print(model):
        reasons.append("its tokenizer differs")
    if reasons:
        raise ConfigError(
            f"--dense {spec!r} would be evaluated on --model's data, but {'; '.join(reasons)}; "
            "pass a dense control trained on the same task and tokenizer (or --task)."
        )


def _tokenizer_print(model: Any) -> tuple[str, ...] | None:
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        return None
    return tuple(tokenizer.decode([i]) for i in range(int(model.cfg.d_vocab)))


def _resumable(work: Path | None) -> bool:
    """Does ``work`` hold snapshots or finished models that ``--resume`` would continue?"""
    if work is None:
        return False
    snapshots = work / CHECKPOINTS
    return any(snapshots.rglob("*.pt")) or any(snapshots.rglob("finished"))


def _read_finished(folder: Path) -> ProtocolResults:
    """A model's results saved by an interrupted run (its parent folder is still marked)."""
    from dcp_lens.protocol.results import ProtocolResults

    document = json.loads((folder / "results.json").read_text())
    return ProtocolResults.from_results_json(document["runs"][0])


def report_data_of(folder: Path) -> dict[str, Any]:
    """The ``report_data.json`` of a run folder (or of one model's subfolder)."""
    from dcp_lens.studies.report_extras import REPORT_DATA, read_report_data

    return read_report_data(folder / REPORT_DATA)


def _vocab(model: Any, task: str | None, seed: int) -> list[str] | None:
    """Token strings of the task the run evaluates on (None: show token ids)."""
    from dcp_lens.tasks import get_task

    if hasattr(model, "planted_task") and task is None:
        return None
    tokenizer = getattr(model, "tokenizer", None)
    if task is not None and task.startswith("text:"):  # in the model's own tokens
        if tokenizer is None:
            return None
        return [tokenizer.decode([i]) for i in range(int(model.cfg.d_vocab))]
    if task is not None:
        name, _, path = task.partition(":")
        return list(get_task(name, seed=seed, **({"path": path} if path else {})).vocab)
    config = getattr(model, "task_config", None)
    return list(get_task(**config).vocab) if config else None


# ----------------------------------------------------------------------------- report


def report(folder: str | Path, out: str | Path | None = None) -> Path:
    """Render ``report.html`` of the finished run in ``folder`` again from its files, into
    ``folder`` (default), another folder, or an ``.html`` file (plotly.js in the folder
    ``<name>_files/`` beside it, which the report owns: no other file is touched). Returns the
    report's path."""
    folder = Path(folder)
    if not (folder / "results.json").is_file():
        raise ConfigError(
            f"{folder / 'results.json'} does not exist; pass a folder written by dcp-lens run."
        )
    target = report_target(out if out is not None else folder, source=folder)
    from dcp_lens.protocol.results import read_results_json
    from dcp_lens.report.html import write_report

    runs = read_results_json(folder / "results.json")
    data = report_data_of(folder)
    with target.folder as work:  # a lone file: plotly.js in <name>_files/, its folder
        write_report(runs, target.file if target.lone else work / target.within, data)
    return target.file


__all__ = [
    "DEFAULT_DENSE",
    "DEFAULT_MODEL",
    "MARKER",
    "RunOptions",
    "RunOutcome",
    "TextOptions",
    "report",
    "run",
]
