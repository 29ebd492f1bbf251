"""The ``dcp-lens`` command line: ``run`` (diagnose models), ``report`` (re-render a finished
run's report.html), ``train``, ``experiment`` (the controlled training intervention),
``validate`` (the planted models) and ``bench`` (what it costs)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from dcp_lens import distributed
from dcp_lens.checkpoint import Checkpoint, die_if_asked
from dcp_lens.devices import check_device
from dcp_lens.errors import ConfigError, DCPLensError
from dcp_lens.incomplete import MARKER, mark_complete, mark_incomplete
from dcp_lens.memory import limit_heap_fragmentation
from dcp_lens.protocol import DepthControlProtocol, EvaluationSet, task_data
from dcp_lens.registry import load
from dcp_lens.report import format_summary
from dcp_lens.results import ProtocolResults, write_results_json
from dcp_lens.validation import check_output_folder

DEFAULT_MODEL, DEFAULT_DENSE = "default", "default-dense"
DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}  # fmt: skip
EXPERIMENTS = ("training-intervention",)
CHECKPOINTS = ".checkpoints"  # the --resume snapshots, inside --out until the run finishes
K_HELP = "comma-separated k grid (default: every k if r <= 8, else 1-4 and a x1.5 grid to r)"


# Failures reported as one line with exit code 2: dcp-lens's own errors and the ones torch and the
# OS raise on bad input (an unavailable file, a failed allocation).
REPORTED = (ValueError, TypeError, OSError, RuntimeError, MemoryError)


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (``dcp-lens run: error: ...``), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="dcp-lens", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="run the Depth Control Protocol on models")
    run.add_argument("--model", help=f"model spec (default: {DEFAULT_MODEL!r})")
    run.add_argument("--dense", help="a dense model spec to run as the negative control")
    run.add_argument(
        "--task", help="task name, char_lm:PATH or text:PATH (default: the model's own task)"
    )
    run.add_argument("--k", help=K_HELP)
    run.add_argument("--metrics", help="comma-separated metrics (default: all the task defines)")
    run.add_argument(
        "--n-eval", type=int, help="evaluation sequences (default 512; text: every window left)"
    )
    run.add_argument(
        "--n-calibration", type=int, help="calibration sequences (default 512; text: see README)"
    )
    run.add_argument("--max-tokens", type=int, help="text: use at most this many corpus tokens")
    run.add_argument("--seq-len", type=int, help="text: tokens per window (default: n_ctx, <= 128)")
    run.add_argument("--text-field", default="text", help="text: the field of a .jsonl record")
    run.add_argument("--token-dtype", choices=("uint16", "uint32"), help="text: ids of a .bin")
    run.add_argument("--batch-size", type=int, default=64)
    run.add_argument("--bootstrap", type=int, default=1000, help="paired bootstrap draws")
    run.add_argument(
        "--calibration-mode", default="full", choices=("mean", "diag", "full", "mixture")
    )
    run.add_argument("--probe", default="trajectory", choices=("trajectory", "none"))
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--device", default="cpu")
    run.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        help="compute in this dtype (default: the model's); statistics stay float64",
    )
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    run.add_argument("--out", required=True, type=Path, help="output folder")
    run.add_argument(
        "--resume", action="store_true", help="continue an interrupted run of the same command"
    )
    run.add_argument("--overwrite", action="store_true", help="replace a finished run's folder")
    run.add_argument(
        "--checkpoint-every", type=int, default=16, help="batches between --resume snapshots"
    )

    report = commands.add_parser(
        "report", help="re-render report.html of a finished run folder from its results.json"
    )
    report.add_argument("folder", type=Path, help="a folder written by dcp-lens run")
    report.add_argument("--out", type=Path, help="where to write (default: FOLDER/report.html)")

    train = commands.add_parser("train", help="train a model on a task preset")
    train.add_argument("--preset", default="default", help="training preset (tiny, default)")
    train.add_argument("--regime", default="fixed", help="fixed, sampled, every-iteration, dense")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--steps", type=int, help="override the preset's number of steps")
    train.add_argument("--no-resume", action="store_true", help="start over even if a run exists")
    train.add_argument("--out", required=True, type=Path, help="run folder (resumed if present)")

    experiment = commands.add_parser(
        "experiment", help="run an experiment: training-intervention (docs/design.md §6)"
    )
    experiment.add_argument("name", choices=EXPERIMENTS, help="which experiment")
    experiment.add_argument("--preset", default="default", help="training preset (tiny, default)")
    experiment.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    experiment.add_argument(
        "--dense-seeds", help="seeds of the dense control (default: the first of --seeds)"
    )
    experiment.add_argument("--regimes", help="comma-separated training regimes (default: all)")
    experiment.add_argument("--n-eval", type=int, default=512, help="evaluation sequences")
    experiment.add_argument("--n-calibration", type=int, default=512, help="calibration sequences")
    experiment.add_argument("--bootstrap", type=int, default=200, help="paired bootstrap draws")
    experiment.add_argument("--probe", default="trajectory", choices=("trajectory", "none"))
    experiment.add_argument("--device", default="cpu")
    experiment.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="trainings at once, one process and thread each (default: the CPU count)",
    )
    experiment.add_argument("--quiet", action="store_true", help="no progress bars")
    experiment.add_argument("--out", required=True, type=Path, help="experiment folder (resumed)")

    validate = commands.add_parser(
        "validate", help="DCP on every planted model of known ground truth, on every metric"
    )
    validate.add_argument("--models", help="comma-separated planted models (default: all)")
    validate.add_argument("--metrics", help="comma-separated metrics (default: all)")
    validate.add_argument("--n-eval", type=int, default=512, help="evaluation sequences")
    validate.add_argument("--n-calibration", type=int, default=512, help="calibration sequences")
    validate.add_argument("--bootstrap", type=int, default=200, help="paired bootstrap draws")
    validate.add_argument("--seed", type=int, default=0, help="seed of the models and splits")
    validate.add_argument("--quiet", action="store_true", help="no progress bars")
    validate.add_argument("--out", type=Path, help="write validation.json and validation.md here")

    bench = commands.add_parser("bench", help="cost of the sweep, naive sweep, hooks-off forward")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--d-model", type=int, default=256)
    bench.add_argument("--n-core", type=int, default=2)
    bench.add_argument("--iterations", type=int, default=16)
    bench.add_argument("--batch", type=int, default=16)
    bench.add_argument("--seq", type=int, default=128)
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--k", help=K_HELP)
    bench.add_argument("--no-naive", action="store_true", help="skip the slow naive sweep")
    bench.add_argument("--device", default="cpu")

    args = parser.parse_args(argv)
    limit_heap_fragmentation()
    with warnings.catch_warnings():  # restores how warnings are shown when main returns
        warnings.showwarning = _show_warning
        try:
            args.command_line = _command_line(argv)
            return _command(args)
        except REPORTED as error:
            print(f"dcp-lens {args.command}: error: {_one_line(error)}", file=sys.stderr)
            return 2


def _command(args: argparse.Namespace) -> int:
    _check_arguments(args)
    if args.command == "run":
        return _run(args, args.command_line)
    if args.command == "report":
        return _report(args)
    if args.command == "train":
        return _train(args)
    if args.command == "experiment":
        return _experiment(args)
    if args.command == "validate":
        return _validate(args)
    from dcp_lens.bench import print_bench, run_bench

    result = run_bench(
        d_model=args.d_model, n_core=args.n_core, n_iterations=args.iterations,
        batch=args.batch, seq=args.seq, repeats=args.repeats, k_grid=_ints(args.k),
        device=args.device, naive=not args.no_naive,
    )  # fmt: skip
    print_bench(result, args.json)
    return 0


def _check_arguments(args: argparse.Namespace) -> None:
    """Everything that can be checked before any work: empty specs and lists, counts, the
    output folder and the device."""
    for flag in ("model", "dense", "task", "k", "metrics", "seeds", "dense_seeds", "regimes"):
        value = getattr(args, flag, None)
        if value is not None and not value.strip():
            name = "--" + flag.replace("_", "-")
            raise ConfigError(f"{name} is empty; give a value or leave the flag out.")
    minimums = {
        "n_eval": 1, "n_calibration": 1, "batch_size": 1, "bootstrap": 0, "jobs": 1, "steps": 1,
        "d_model": 1, "n_core": 1, "iterations": 1, "batch": 1, "seq": 1, "repeats": 1,
        "checkpoint_every": 1,
    }  # fmt: skip
    for name, minimum in minimums.items():
        value = getattr(args, name, None)
        if value is not None and value < minimum:
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be >= {minimum}.")
    for name in ("k", "seeds", "dense_seeds"):
        _ints(getattr(args, name, None), f"--{name.replace('_', '-')}")
    check_output_folder(getattr(args, "out", None) or ".", "--out")
    if getattr(args, "device", None) is not None:
        check_device(args.device)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, DCPLensError):
        return text
    if isinstance(error, MemoryError) or "alloc" in text.lower() or "out of memory" in text:
        return f"could not allocate memory ({text}); lower the batch, sequence or model size."
    return text


def _show_warning(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
    print(f"dcp-lens: warning: {' '.join(str(message).split())}", file=sys.stderr)


def _run(args: argparse.Namespace, command: str) -> int:
    """``dcp-lens run``, on every rank of a torchrun process group (rank 0 writes)."""
    args.device = distributed.init_from_environment(args.device)
    try:
        code = _run_models(args, command)
    except BaseException:
        # No barrier: this rank exits non-zero and torchrun stops the others.
        distributed.finish(wait=False)
        raise
    distributed.finish()
    return code


def _run_models(args: argparse.Namespace, command: str) -> int:
    from dcp_lens.report import write_report
    from dcp_lens.report_data import (
        REPORT_DATA,
        collect_report_data,
        environment,
        write_report_data,
    )

    specs = [(args.model or DEFAULT_MODEL, False)]
    dense = args.dense or (DEFAULT_DENSE if args.model is None else None)
    if dense:
        specs.append((dense, True))
    runs: list[ProtocolResults] = []
    extras: list[dict[str, Any]] = []
    data: tuple[EvaluationSet, EvaluationSet] | None = None
    text_flags = {"--seq-len": args.seq_len, "--max-tokens": args.max_tokens}
    text_flags["--token-dtype"] = args.token_dtype
    is_text = (args.task or "").startswith("text:")
    given = [flag for flag, value in text_flags.items() if value is not None]
    if given and not is_text:
        raise ValueError(f"{', '.join(given)} apply to --task text:PATH only.")
    text_options = dict(
        seq_len=args.seq_len, max_tokens=args.max_tokens, text_field=args.text_field,
        token_dtype=args.token_dtype,
    ) if is_text else {}  # fmt: skip
    main = distributed.is_main()
    # Rank 0 checks and prepares the folder; no rank starts before it has.
    if not distributed.broadcast_from_main(_prepare_folder(args) if main else None):
        return 0
    for spec, is_negative_control in specs:
        folder = args.out / _folder_name(spec)
        finished = args.out / CHECKPOINTS / folder.name / "finished"
        if args.resume and finished.is_file():  # this model finished before the interruption
            runs.append(_read_finished(folder))
            extras.append(_report_data(folder)["runs"][runs[-1].model])
            continue
        model = load(spec).to(device=args.device, dtype=DTYPES.get(args.dtype)).eval()
        if is_negative_control and not model.is_dense:
            raise ValueError(
                f"--dense {spec!r} is not a dense model (it has a weight-shared core)."
            )
        if data is None or hasattr(model, "planted_task"):
            data = task_data(
                model, args.task, args.n_eval, args.n_calibration, args.seed, **text_options
            )
        protocol = DepthControlProtocol(
            model, k_grid=_ints(args.k), metrics=_names(args.metrics),
            calibration_mode=args.calibration_mode, batch_size=args.batch_size,
            n_bootstrap=args.bootstrap, seed=args.seed, probe=args.probe, spec=spec,
            progress=not args.quiet and main,
            checkpoint=Checkpoint(args.out / CHECKPOINTS / folder.name, args.checkpoint_every),
        )  # fmt: skip
        results = protocol.run(*data)
        if not main:  # rank 0 writes
            continue
        runs.append(results)
        extra = collect_report_data(
            protocol, data[0], vocab=_vocab(model, args.task, args.seed),
            n_bootstrap=min(args.bootstrap, 200),
        )  # fmt: skip
        extras.append(extra)
        # Per-model results are written as each finishes (results.json last: it says the model
        # is finished); the folder is marked incomplete until all are.
        results.save(folder)
        write_report_data([extra], folder / REPORT_DATA, command=command, environment=environment())
        finished.write_text(f"{spec}\n")
        print(format_summary(results))
        die_if_asked(f"model:{len(runs)}")
    if not main:
        return 0
    write_report_data(extras, args.out / REPORT_DATA, command=command, environment=environment())
    report = write_report(runs, args.out, _report_data(args.out))
    write_results_json(runs, args.out / "results.json")  # last: results.json means finished
    shutil.rmtree(args.out / CHECKPOINTS, ignore_errors=True)
    mark_complete(args.out)
    print(f"wrote {args.out / 'results.json'}; open {report}")
    return 0


def _prepare_folder(args: argparse.Namespace) -> bool:
    """Check ``--out`` against ``--resume`` and ``--overwrite`` and mark it incomplete.
    Returns False when there is nothing left to do (``--resume`` of a finished run).

    A finished folder (``results.json``, no ``INCOMPLETE``) is never replaced without
    ``--overwrite``; an interrupted one is continued with ``--resume`` (the same command), or
    started again without it."""
    out, snapshots = args.out, args.out / CHECKPOINTS
    if args.resume and args.overwrite:
        raise ConfigError("--resume and --overwrite exclude each other; pass one.")
    if _finished(out) and not args.overwrite:
        if args.resume:
            print(f"{out} holds a finished run; nothing to resume.")
            return False
        raise ConfigError(
            f"--out {out} holds a finished run (results.json); pass --overwrite to replace it "
            "or choose another folder."
        )
    settings = _run_settings(args)
    recorded = snapshots / "command.json"
    if args.resume and recorded.is_file():
        before = json.loads(recorded.read_text())
        changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
        if changed:
            raise ConfigError(
                f"--resume continues the same run, but {', '.join(changed)} differ from the "
                f"interrupted command ({recorded}); rerun it as it was or pass --overwrite."
            )
    if not args.resume:  # start again: snapshots of another run must not be resumed
        shutil.rmtree(snapshots, ignore_errors=True)
    mark_incomplete(out, "dcp-lens run")
    snapshots.mkdir(parents=True, exist_ok=True)
    _write_atomically(recorded, json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return True


def _run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What makes a run's results: every ``run`` option but where and how it is shown."""
    ignored = {"resume", "overwrite", "quiet", "out", "checkpoint_every", "command_line"}
    ignored |= {"command", "device"}
    return {key: str(value) for key, value in sorted(vars(args).items()) if key not in ignored}


def _finished(folder: Path) -> bool:
    """Does ``folder`` hold a finished run (results.json, not marked incomplete)?"""
    return (folder / "results.json").is_file() and not (folder / MARKER).is_file()


def _read_finished(folder: Path) -> ProtocolResults:
    """A model's results saved by an interrupted run (its parent folder is still marked)."""
    document = json.loads((folder / "results.json").read_text())
    return ProtocolResults.from_results_json(document["runs"][0])


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(text)
    partial.replace(path)


def _report(args: argparse.Namespace) -> int:
    from dcp_lens.report import write_report
    from dcp_lens.results import read_results_json

    source = args.folder / "results.json"
    if not source.is_file():
        raise FileNotFoundError(f"{source} does not exist; pass a folder written by dcp-lens run.")
    report = write_report(
        read_results_json(source), args.out or args.folder, _report_data(args.folder)
    )
    print(f"wrote {report}")
    return 0


def _report_data(folder: Path) -> dict[str, Any]:
    from dcp_lens.report_data import REPORT_DATA, read_report_data

    return read_report_data(folder / REPORT_DATA)


def _vocab(model: Any, task: str | None, seed: int) -> list[str] | None:
    """Token strings of the task the run evaluates on (None: show token ids)."""
    from dcp_lens.tasks import get_task

    if hasattr(model, "planted_task") and task is None:
        return None
    if task is not None:
        name, _, path = task.partition(":")
        return list(get_task(name, seed=seed, **({"path": path} if path else {})).vocab)
    config = getattr(model, "task_config", None)
    return list(get_task(**config).vocab) if config else None


def _command_line(argv: Sequence[str] | None) -> str:
    return shlex.join(["dcp-lens", *(sys.argv[1:] if argv is None else argv)])


def _train(args: argparse.Namespace) -> int:
    from dcp_lens.report import format_accuracy_table
    from dcp_lens.training import preset, train

    overrides = {"steps": args.steps} if args.steps is not None else {}
    config = preset(args.preset, regime=args.regime, seed=args.seed, **overrides)
    result = train(config, args.out, resume=not args.no_resume)
    if result.accuracy_table is not None:
        print(format_accuracy_table(result.accuracy_table))
    model_dir = args.out / "model"
    print(f"model in {model_dir}; diagnose it with: dcp-lens run --model {model_dir}")
    return 0


def _experiment(args: argparse.Namespace) -> int:
    from dcp_lens.experiment import run_training_intervention
    from dcp_lens.report import markdown_table
    from dcp_lens.training import REGIMES

    regimes = REGIMES if args.regimes is None else (_names(args.regimes) or ())
    document = run_training_intervention(
        args.out, preset=args.preset, seeds=_ints(args.seeds, "--seeds") or (),
        regimes=regimes, n_eval=args.n_eval,
        dense_seeds=None if args.dense_seeds is None else _ints(args.dense_seeds, "--dense-seeds"),
        n_calibration=args.n_calibration, n_bootstrap=args.bootstrap, probe=args.probe,
        device=args.device, jobs=args.jobs, progress=not args.quiet,
    )  # fmt: skip
    print(f"\n{document['metric']} shares over seeds (preset {document['preset']}):")
    print("\n".join(markdown_table(document["regimes"])))
    for regime, checks in document["verdict"].items():
        labels = ", ".join(f"{name} {check['label']}" for name, check in checks.items())
        print(f"{regime}: {labels}")
    print(f"wrote {args.out / 'intervention.json'} and {args.out / 'intervention.md'}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from dcp_lens import planted_validation as validation

    rows = validation.validate(
        _names(args.models), _names(args.metrics), seed=args.seed, n_eval=args.n_eval,
        n_calibration=args.n_calibration, n_bootstrap=args.bootstrap, progress=not args.quiet,
    )  # fmt: skip
    print("\n".join(validation.markdown(rows)))
    if args.out is not None:
        settings = {
            "seed": args.seed, "n_eval": args.n_eval, "n_calibration": args.n_calibration,
            "n_bootstrap": args.bootstrap,
        }  # fmt: skip
        validation.save(rows, args.out, settings)
        print(f"wrote {args.out / 'validation.json'} and {args.out / 'validation.md'}")
    return 0 if validation.suite_passed(rows) else 1


def _folder_name(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in spec)[-80:]


def _ints(text: str | None, flag: str = "--k") -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ConfigError(f"{flag} must be comma-separated integers, got {text!r}.") from error
    if not values:
        raise ConfigError(f"{flag} must be comma-separated integers, got {text!r}.")
    return values


def _names(text: str | None) -> tuple[str, ...] | None:
    return tuple(part.strip() for part in text.split(",") if part.strip()) if text else None


if __name__ == "__main__":
    raise SystemExit(main())
