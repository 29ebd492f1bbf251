"""The dcp-lens command line. It parses and checks its arguments before importing torch, so
that help and argument errors are instant; each command imports what it needs when it runs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from dcp_lens.protocol.config import COMMAND_DEFAULTS, ProtocolConfig
from dcp_lens.utils.errors import ConfigError, DCPLensError, ResourceLimitError
from dcp_lens.utils.files import (
    MARKER,
    check_new_file,
    check_output_folder,
    inside,
    mark_complete,
    mark_incomplete,
    replacement_folder,
    safe_name,
    swap_folders,
    write_text_atomically,
)
from dcp_lens.utils.locks import LOCK_FILE, FolderLock
from dcp_lens.utils.memory import (
    MMAP_THRESHOLD_MAX,
    fixed_threshold,
    limit_heap_fragmentation,
    release_keep,
)
from dcp_lens.utils.signals import exit_code, signal_name, stop_on_signals

if TYPE_CHECKING:
    from dcp_lens.protocol.dcp import EvaluationSet
    from dcp_lens.protocol.results import ProtocolResults

DEFAULT_MODEL, DEFAULT_DENSE = "default", "default-dense"
DTYPES = ("float64", "float32", "bfloat16", "float16")
EXPERIMENTS = ("training-intervention",)
PATH_KINDS = ("huginn", "ouro", "llama2c", "bridge")  # model specs KIND:PATH of local files
TASK_FILES = ("char_lm", "text")
CHECKPOINTS = ".checkpoints"  # the --resume snapshots, inside --out until the run finishes
# Measured with `dcp-lens run --quiet` on this project's busy 2-core machine (README, Command
# line): one thread was fastest; OpenMP threads spin-wait for a core another process holds.
DEFAULT_THREADS = 1
THREADS_HELP = "CPU threads for torch (1 was fastest on a 2-core machine: docs/cli.md)"

DESCRIPTION = """\
The Depth Control Protocol for depth-recurrent transformers: split the gap between full depth
and truncated depth into readout shift (S), block applications (B) and distinct computation (D).
Run dcp-lens COMMAND --help for a command's options, their defaults and an example."""

# Kept in step with the registry by tests/acceptance/test_cli.py (the names are listed here so that
# help
# does not import the loaders).
MODEL_SPECS = """\
model specs (--model, --dense):
  default, default-every-iteration, default-dense
                    the bundled models (recurrent; trained every iteration; the dense control)
  planted:NAME      a planted model whose answer is known; NAME is one of readout_shift,
                    distinct_computation, block_count, readout_shift_by_token_type,
                    readout_shift_by_position, mixture_shift_distinct, mixture_shift_blocks,
                    readout_shift_soft, distinct_computation_soft, block_count_soft,
                    distinct_computation_context, block_count_context, frame_flip,
                    distinct_computation_skewed, mixture_three_way,
                    distinct_computation_smooth, readout_shift_step
  huginn:PATH       a local Huginn-0125 checkpoint folder (config.json and safetensors)
  ouro:PATH         a local Ouro checkpoint folder
  llama2c:PATH      a llama2.c checkpoint (.bin, or a folder with it and its tokenizer); dense
  bridge:PATH       a local Hugging Face folder through a TransformerLens TransformerBridge; dense
  PATH              a folder written by save_pretrained (dcp-lens train writes RUN/model)"""

EXAMPLES = {
    "run": "example:\n  dcp-lens run --model planted:readout_shift --out out/planted\n"
    "  dcp-lens run --out out/default   (the bundled default and default-dense)",
    "report": "example:\n  dcp-lens report out/default",
    "train": "example:\n  dcp-lens train --preset tiny --out runs/tiny && "
    "dcp-lens run --model runs/tiny/model --out runs/tiny/dcp",
    "experiment": "example:\n  dcp-lens experiment training-intervention --preset tiny "
    "--seeds 0,1 --out runs/intervention",
    "validate": "example:\n  dcp-lens validate --models readout_shift,block_count "
    "--out out/validate\n  dcp-lens validate --coverage 10 --out out/coverage",
    "bench": "example:\n  dcp-lens bench --d-model 64 --iterations 8 --batch-size 4 --seq 32 "
    "--json",
}

# Failures reported as one line with exit code 2: dcp-lens's own errors and the ones torch and the
# OS raise on bad input (an unavailable file, a failed allocation).
REPORTED = (ValueError, TypeError, OSError, RuntimeError, MemoryError)


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (``dcp-lens run: error: ...``), exit code 2;
    its help ends with the registered names of ``lists`` ("metrics", "tasks")."""

    lists: tuple[str, ...] = ()

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def format_help(self) -> str:
        text = super().format_help()
        return f"{text}\n{registered_names(self.lists)}\n" if self.lists else text


def registered_names(kinds: Sequence[str]) -> str:
    """Lines of help naming what the metric, calibration map and task registries hold
    (``kinds``: "metrics", "maps", "tasks"). Imports them, and torch, only when help is shown:
    argument errors stay instant."""
    from dcp_lens.protocol.calibration import CALIBRATION_MAPS
    from dcp_lens.protocol.metrics import METRICS
    from dcp_lens.tasks import TASKS

    tasks = [f"{name}:PATH" if name in TASK_FILES else name for name in TASKS]
    lines = {
        "metrics": f"metrics (--metrics): {', '.join(METRICS)}",
        "maps": f"calibration maps (--calibration-mode): {', '.join(CALIBRATION_MAPS)}",
        "tasks": f"tasks (--task): {', '.join(tasks)} (PATH: a local corpus file)",
    }
    return "\n".join(lines[kind] for kind in kinds)


def diagnose_command(run_folder: Path) -> str:
    """The ``dcp-lens run`` command that diagnoses the model ``dcp-lens train`` wrote in
    ``run_folder`` (its results in ``run_folder/dcp``)."""
    model, out = str(run_folder / "model"), str(run_folder / "dcp")
    return shlex.join(["dcp-lens", "run", "--model", model, "--out", out])


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples as written; an option's default appended to its help unless
    the help already says it or there is none to show (None, a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        shown = "(default" in text or default is None or default is False
        if shown or default is argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def _path(text: str) -> Path:
    """A path argument; an empty one is refused (``Path("")`` would quietly be the cwd)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; pass a file or folder")
    return Path(text)


def _version() -> str:
    try:
        return metadata.version("dcp-lens")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The ``dcp-lens`` argument parser; builds fast, imports nothing heavy."""
    parser = _Parser(
        prog="dcp-lens", description=DESCRIPTION, epilog=f"{MODEL_SPECS}\n\n{EXAMPLES['run']}",
        formatter_class=_HelpFormatter,
    )  # fmt: skip
    parser.lists = ("metrics", "tasks")
    parser.add_argument("--version", action="version", version=f"dcp-lens {_version()}")
    commands = parser.add_subparsers(
        title="commands", dest="command", required=True, parser_class=_Parser, metavar="COMMAND"
    )

    def command(name: str, summary: str, epilog: str | None = None) -> _Parser:
        sub: _Parser = commands.add_parser(
            name, help=summary, description=summary, formatter_class=_HelpFormatter,
            epilog=epilog or EXAMPLES[name],
        )  # fmt: skip
        return sub

    run = command(
        "run", "run the Depth Control Protocol on a model and its dense control",
        f"{MODEL_SPECS}\n\n{EXAMPLES['run']}",
    )  # fmt: skip
    run.lists = ("metrics", "maps", "tasks")
    run.add_argument(
        "--model", metavar="SPEC",
        help=f"model spec, see below (default: {DEFAULT_MODEL}, with {DEFAULT_DENSE} as --dense)",
    )  # fmt: skip
    run.add_argument(
        "--dense", metavar="SPEC",
        help=f"a dense model spec run as the negative control (default: {DEFAULT_DENSE} when "
        "--model is not given, else none)",
    )  # fmt: skip
    run.add_argument(
        "--task", help="task name, char_lm:PATH or text:PATH (default: the model's own task)"
    )
    run.add_argument(
        "--n-eval", type=int, help="evaluation sequences (default: 512; text: every window left)"
    )
    run.add_argument(
        "--n-calibration",
        type=int,
        help="calibration sequences (default: 512; text: see docs/models.md)",
    )
    run.add_argument(
        "--max-tokens", type=int, help="text: use at most this many corpus tokens (default: all)"
    )
    run.add_argument(
        "--seq-len", type=int, help="text: tokens per window (default: n_ctx, at most 128)"
    )
    run.add_argument("--text-field", default="text", help="text: the field of a .jsonl record")
    run.add_argument(
        "--token-dtype", choices=("uint16", "uint32"),
        help="text: ids of a pre-tokenized .bin (default: from the vocabulary size)",
    )  # fmt: skip
    add_protocol_options(run, "run")
    run.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps, ...")
    run.add_argument(
        "--dtype", choices=DTYPES,
        help="compute in this dtype (default: the model's); statistics stay float64",
    )  # fmt: skip
    run.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    run.add_argument("--out", required=True, type=_path, help="output folder (created if needed)")
    run.add_argument(
        "--resume", action=argparse.BooleanOptionalAction, default=False,
        help="continue an interrupted run of the same command",
    )  # fmt: skip
    run.add_argument("--overwrite", action="store_true", help="replace a finished run's folder")
    run.add_argument(
        "--checkpoint-every", type=int, default=16, help="batches between --resume snapshots"
    )

    report = command("report", "re-render report.html of a finished run folder from its files")
    report.add_argument("folder", type=_path, help="a folder written by dcp-lens run")
    report.add_argument("--out", type=_path, help="where to write (default: FOLDER/report.html)")

    train = command("train", "train a model on a task preset")
    train.add_argument(
        "--preset", default="default", help="training preset: tiny, default, lm-tiny or lm"
    )
    train.add_argument("--regime", default="fixed", help="fixed, sampled, every-iteration or dense")
    train.add_argument("--seed", type=int, default=0, help="training seed")
    train.add_argument("--steps", type=int, help="override the preset's number of steps")
    train.add_argument(
        "--resume", action=argparse.BooleanOptionalAction, default=True,
        help="continue the run in --out if there is one (--no-resume: start over)",
    )  # fmt: skip
    train.add_argument("--out", required=True, type=_path, help="run folder (resumed if present)")

    experiment = command(
        "experiment", "run an experiment: training-intervention (docs/design.md, section 6)"
    )
    experiment.lists = ("metrics", "maps")
    experiment.add_argument("name", choices=EXPERIMENTS, help="which experiment")
    experiment.add_argument(
        "--preset", default="default", help="training preset: tiny, default, lm-tiny or lm"
    )
    experiment.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    experiment.add_argument(
        "--dense-seeds", help="seeds of the dense control (default: the first of --seeds)"
    )
    experiment.add_argument("--regimes", help="comma-separated training regimes (default: all)")
    experiment.add_argument("--n-eval", type=int, default=512, help="evaluation sequences")
    experiment.add_argument("--n-calibration", type=int, default=512, help="calibration sequences")
    add_protocol_options(experiment, "experiment", skip=("seed",))  # seeded per model: --seeds
    experiment.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps, ...")
    experiment.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1,
        help="trainings at once, one process and one thread each (default: the CPU count, "
        f"{os.cpu_count() or 1} here)",
    )  # fmt: skip
    experiment.add_argument("--quiet", action="store_true", help="no progress bars")
    experiment.add_argument("--out", required=True, type=_path, help="experiment folder (resumed)")

    validate = command(
        "validate", "the protocol on every planted model of known answer, on every metric"
    )
    validate.lists = ("metrics", "maps")
    validate.add_argument(
        "--models",
        help="comma-separated planted models (default: all of planted.BRACKET_PLANTED; with "
        "--coverage, these besides every mixture)",
    )  # fmt: skip
    validate.add_argument("--n-eval", type=int, default=512, help="evaluation sequences")
    validate.add_argument("--n-calibration", type=int, default=512, help="calibration sequences")
    add_protocol_options(validate, "validate")
    validate.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    validate.add_argument("--quiet", action="store_true", help="no progress bars")
    validate.add_argument(
        "--out", type=_path,
        help="write validation.json and validation.md here (default: print only)",
    )  # fmt: skip
    validate.add_argument(
        "--coverage", type=int, metavar="N",
        help="instead of the suite: replicate every mixture (and each model of --models) N times "
        "with seeds seed, seed+1, ... and report how often each 95%% interval covers the truth",
    )  # fmt: skip

    bench = command("bench", "cost of the sweep, the naive sweep and a hooks-off forward")
    bench.lists = ("metrics", "maps")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument(
        "--preset", choices=("small", "huginn"), default="small",
        help="model shape: small (1 + 2 x 16 + 1, d_model 256, vocabulary 512, batch 16 x 128) "
        "or huginn (Huginn-0125: 2 + 4 x 32 + 2, d_model 5280, vocabulary 65536, batch 4 x 1024; "
        "random weights, for a GPU); the flags below replace its values",
    )  # fmt: skip
    bench.add_argument("--d-model", type=int, help="width of the benchmark model")
    bench.add_argument("--n-core", type=int, help="blocks in the recurrent core")
    bench.add_argument("--iterations", type=int, help="iterations r of the core")
    bench.add_argument("--vocab", type=int, help="vocabulary size")
    bench.add_argument("--seq", type=int, help="tokens per sequence")
    bench.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16", "float64"), default="float32",
        help="the model's compute dtype (statistics stay float64)",
    )  # fmt: skip
    bench.add_argument(
        "--repeats", type=int, default=5,
        help="timed rounds of forward, plain loop and sweep, alternated (times: the fastest; "
        "sweep / forward: the median of the rounds' paired ratios)",
    )  # fmt: skip
    bench.add_argument(
        "--batches", type=int, default=1,
        help="calibration and evaluation batches each (default 1); the sweep's fixed costs "
        "(solves, the jackknife's refits) weigh less as it grows, as in a run's 512 + 512 "
        "sequences",
    )  # fmt: skip
    bench.add_argument("--no-naive", action="store_true", help="skip the slow naive sweep")
    add_protocol_options(bench, "bench", unset=("batch_size",))  # --batch-size: the preset's
    bench.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps, ...")
    bench.add_argument(
        "--threads", type=int,
        help="CPU threads for torch (default: torch's own, so that figures compare with a plain "
        "PyTorch run; --threads 1 is what run uses)",
    )  # fmt: skip
    return parser


def add_protocol_options(
    parser: argparse.ArgumentParser,
    command: str,
    *,
    skip: Sequence[str] = (),
    unset: Sequence[str] = (),
) -> None:
    """Declare every `ProtocolConfig` setting as an option of ``command``: the one spelling and
    help each field's metadata gives, with ``command``'s default (`COMMAND_DEFAULTS`); ``skip``
    leaves settings out, ``unset`` defaults them to None (the command decides). An old spelling
    (``--batch``) is a hidden alias that warns. Reads no registry, so no torch import."""
    defaults = COMMAND_DEFAULTS.get(command, {})
    for setting in dataclasses.fields(ProtocolConfig):
        if setting.name in skip:
            continue
        meta = setting.metadata
        default = None if setting.name in unset else defaults.get(setting.name, setting.default)
        options: dict[str, Any] = {"help": meta["help"]}
        if isinstance(setting.default, bool):
            options.update(action=argparse.BooleanOptionalAction, default=default)
        elif meta.get("kind") in ("ints", "names"):
            options["default"] = None if default is None else ",".join(map(str, default))
        elif isinstance(setting.default, int):
            options.update(type=int, default=default)
        else:
            options.update(default=default, choices=meta.get("choices"))
        parser.add_argument(meta["flag"], **options)
        dest = meta["flag"].lstrip("-").replace("-", "_")
        for alias in meta.get("aliases", ()):
            typed = {"type": options["type"]} if "type" in options else {}
            parser.add_argument(
                alias, dest=dest, action=_DeprecatedAlias, default=argparse.SUPPRESS,
                help=argparse.SUPPRESS, preferred=meta["flag"], **typed,
            )  # fmt: skip


class _DeprecatedAlias(argparse.Action):
    """An old spelling of an option: stores like the new one, with a warning naming it."""

    def __init__(self, *args: Any, preferred: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.preferred = preferred

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        print(f"dcp-lens: warning: {option} is deprecated; use {self.preferred}.", file=sys.stderr)
        setattr(namespace, self.dest, values)


def protocol_config(args: argparse.Namespace, command: str) -> ProtocolConfig:
    """The `ProtocolConfig` of ``command``'s parsed options (`add_protocol_options`): its
    defaults, then every setting given. A setting the command does not declare, or leaves to
    itself (None), keeps the command's default."""
    values = dict(COMMAND_DEFAULTS.get(command, {}))
    for setting in dataclasses.fields(ProtocolConfig):
        flag = setting.metadata["flag"]
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is None:
            continue
        kind = setting.metadata.get("kind")
        if kind == "ints":
            value = tuple(_ints(value, flag) or ())
        elif kind == "names":
            value = _names(value)
        values[setting.name] = value
    return ProtocolConfig.from_dict(values)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():  # restores how warnings are shown when main returns
        warnings.showwarning = _show_warning
        try:
            args.command_line = _command_line(argv)
            # Freed tensors reused within a batch, free pages returned after it; or the strict
            # fixed mmap threshold of $DCP_LENS_MMAP_THRESHOLD (dcp_lens.utils.memory).
            limit_heap_fragmentation()
            with stop_on_signals():
                return _command(args)
        except REPORTED as error:
            print(f"dcp-lens {args.command}: error: {_one_line(error)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM, SIGHUP, SIGQUIT (utils.signals)
            print(f"dcp-lens {args.command}: stopped by {signal_name(stop)}; {_after_stop(args)}",
                  file=sys.stderr)  # fmt: skip
            return exit_code(stop)


def _after_stop(args: argparse.Namespace) -> str:
    """How to continue a command stopped by a signal."""
    out = getattr(args, "out", None)
    if args.command == "run" and out is not None:
        return (
            f"{out} is kept (marked INCOMPLETE if the run had started); rerun the same command "
            "with --resume to continue."
        )
    if args.command in ("train", "experiment") and out is not None:
        return f"rerun the same command to continue from {out}'s last checkpoint."
    return "nothing was written in part; rerun the command."


def _command(args: argparse.Namespace) -> int:
    _check_arguments(args)
    _check_device(args)  # imports torch: after every check that does not need it
    if getattr(args, "threads", None) is None:
        return _dispatch(args)
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _dispatch(args)
    finally:
        torch.set_num_threads(previous)  # main called from Python leaves torch as it found it


def _dispatch(args: argparse.Namespace) -> int:
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
    from dcp_lens.studies.bench import print_bench, run_bench

    result = run_bench(
        d_model=args.d_model, n_core=args.n_core, n_iterations=args.iterations,
        batch=args.batch_size, seq=args.seq, d_vocab=args.vocab, repeats=args.repeats,
        device=args.device, naive=not args.no_naive, preset=args.preset, dtype=args.dtype,
        config=protocol_config(args, "bench"), batches=args.batches,
    )  # fmt: skip
    threshold = fixed_threshold()
    result["allocator"] = (
        f"as in run: glibc's, mmap threshold {MMAP_THRESHOLD_MAX >> 20} MB, free heap past "
        f"{release_keep() >> 20} MB returned after each batch"
        if threshold is None
        else f"fixed {threshold}-byte mmap threshold ($DCP_LENS_MMAP_THRESHOLD)"
    )
    print_bench(result, args.json)
    return 0


def _check_arguments(args: argparse.Namespace) -> None:
    """Everything that can be checked before torch is imported and any work starts: empty specs
    and lists, counts, integer lists and the output folder."""
    names = ("model", "dense", "task", "k", "metrics", "seeds", "dense_seeds", "regimes", "models")
    for flag in names:
        value = getattr(args, flag, None)
        if value is not None and not value.strip():
            name = "--" + flag.replace("_", "-")
            raise ConfigError(f"{name} is empty; give a value or leave the flag out.")
    minimums = {
        "n_eval": 1, "n_calibration": 1, "batch_size": 1, "bootstrap": 0, "jobs": 1, "steps": 1,
        "noise_draws": 1, "probe_points": 1, "calibration_points": 1, "mixture_components": 1,
        "d_model": 1, "n_core": 1, "iterations": 1, "batch": 1, "seq": 1, "repeats": 1, "vocab": 2,
        "threads": 1, "max_tokens": 1, "seq_len": 1, "checkpoint_every": 1,
    }  # fmt: skip
    for name, minimum in minimums.items():
        value = getattr(args, name, None)
        if value is not None and value < minimum:
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be >= {minimum}.")
    for name in ("k", "seeds", "dense_seeds"):
        _ints(getattr(args, name, None), f"--{name.replace('_', '-')}")
    for name in ("metrics", "models", "regimes"):
        _names(getattr(args, name, None), f"--{name}")
    for flag, kinds in (("model", PATH_KINDS), ("dense", PATH_KINDS), ("task", TASK_FILES)):
        kind, _, path = (getattr(args, flag, None) or "").partition(":")
        if kind in kinds and path and not Path(path).exists():
            raise ConfigError(f"--{flag} {kind}:{path}: {path} does not exist; pass a local path.")
        endless = kind in TASK_FILES and path and not (Path(path).is_file() or Path(path).is_dir())
        if endless and (kind != "text" or getattr(args, "max_tokens", None) is None):
            raise ConfigError(
                f"--{flag} {kind}:{path}: {path} is a device, pipe or socket, not a file: it may "
                "never end; pass a file (text:PATH also reads one with --max-tokens N)."
            )
    if args.command == "report" and not (args.folder / "results.json").is_file():
        raise ConfigError(
            f"{args.folder / 'results.json'} does not exist; pass a folder written by dcp-lens run."
        )
    out = getattr(args, "out", None)
    if args.command == "report":
        _check_report_out(args)
    elif out is not None:
        check_output_folder(out, "--out")
    _check_sizes(args)


def _check_report_out(args: argparse.Namespace) -> None:
    """``report``'s ``--out``: a folder (to hold report.html) or an .html file; never a file
    the report did not write (``--out RUN/results.json`` would destroy the run)."""
    out = args.out
    if out is None:
        return
    if out.is_dir() or (not out.exists() and not out.suffix):
        check_output_folder(out, "--out")
        target = out / "report.html"
    else:
        target = check_new_file(out, ".html", "--out")
    if target.exists() and not _is_report(target):
        raise ConfigError(
            f"--out {target} exists and is not a report dcp-lens wrote; pass a new .html path or "
            "a folder (its report.html is replaced)."
        )


def _is_report(path: Path) -> bool:
    with path.open("rb") as file:
        head = file.read(4096)
    return b"<html" in head.lower() and b"dcp-lens" in head.lower()


# Sizes checked before anything is allocated: counts past these are typos, not runs.
MAX_SEQUENCES = 1 << 22  # --n-eval, --n-calibration
MAX_STEPS = 10_000_000  # train --steps: far past every preset, far below a loop of years
MAX_THREADS = 1024


def _check_sizes(args: argparse.Namespace) -> None:
    """Counts that would allocate more than this machine has, or loop for years, refused before
    any work: --n-eval and --n-calibration (tokens), --threads, train --steps."""
    from dcp_lens.utils.memory import physical_memory_bytes

    threads = getattr(args, "threads", None)
    cores = os.cpu_count() or 1
    if threads is not None and threads > max(MAX_THREADS, cores):
        raise ResourceLimitError(
            f"--threads {threads} is more than this machine can run ({cores} CPUs; at most "
            f"{max(MAX_THREADS, cores)}); pass at most {cores}."
        )
    steps = getattr(args, "steps", None)
    if args.command == "train" and steps is not None and steps > MAX_STEPS:
        raise ResourceLimitError(
            f"--steps {steps} is past dcp-lens's bound of {MAX_STEPS:,} training steps (years "
            "on this machine); pass a number of steps a run can finish."
        )
    memory = physical_memory_bytes()
    counts = [getattr(args, name, None) for name in ("n_eval", "n_calibration")]
    total = sum(count for count in counts if count is not None)
    for flag, count in zip(("--n-eval", "--n-calibration"), counts, strict=True):
        if count is not None and count > MAX_SEQUENCES:
            raise ResourceLimitError(
                f"{flag} {count} is past dcp-lens's bound of {MAX_SEQUENCES:,} sequences; pass "
                "fewer (512 is the default)."
            )
    # Tokens and targets (int64) of every sequence, windows of --seq-len or the usual 128.
    needed = total * (getattr(args, "seq_len", None) or 128) * 8 * 2
    if memory is not None and needed > memory // 2:
        raise ResourceLimitError(
            f"--n-eval and --n-calibration ({total:,} sequences) need about "
            f"{needed / 2**30:.1f} GiB of tokens, more than half of this machine's "
            f"{memory / 2**30:.1f} GiB; pass fewer sequences."
        )


def _check_device(args: argparse.Namespace) -> None:
    """An unavailable ``--device`` is refused before any model is loaded."""
    device = getattr(args, "device", None)
    if device is not None and device.strip() != "cpu":
        from dcp_lens.utils.devices import check_device

        check_device(device)


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
    from dcp_lens.utils import distributed

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
    """Load every model and its data and build every protocol (all the inputs checked), then
    lock and prepare the folder, then run; a run that fails its checks leaves no folder."""
    from dcp_lens.protocol.dcp import DepthControlProtocol, task_data
    from dcp_lens.utils import distributed
    from dcp_lens.utils.snapshots import Checkpoint

    specs = [(args.model or DEFAULT_MODEL, False)]
    dense = args.dense or (DEFAULT_DENSE if args.model is None else None)
    if dense:
        specs.append((dense, True))
    text_flags = {"--seq-len": args.seq_len, "--max-tokens": args.max_tokens}
    text_flags["--token-dtype"] = args.token_dtype
    is_text = (args.task or "").startswith("text:")
    given = [flag for flag, value in text_flags.items() if value is not None]
    if given and not is_text:
        raise ConfigError(
            f"{', '.join(given)} apply to --task text:PATH only; drop them or pass a text task."
        )
    text_options = dict(
        seq_len=args.seq_len, max_tokens=args.max_tokens, text_field=args.text_field,
        token_dtype=args.token_dtype,
    ) if is_text else {}  # fmt: skip
    main = distributed.is_main()
    work = _work_folder(args)
    if work is None:
        print(f"{args.out} holds a finished run; nothing to resume.")
        return 0
    names = _model_folder_names([spec for spec, _ in specs])
    plans: list[_Plan] = []
    data: tuple[EvaluationSet, EvaluationSet] | None = None
    first: Any = None
    for (spec, is_negative_control), name in zip(specs, names, strict=True):
        folder = inside(work / name, work)
        finished = work / CHECKPOINTS / name / "finished"
        if args.resume and finished.is_file():  # this model finished before the interruption
            plans.append(_Plan(spec, folder, finished, None, None, None))
            continue
        model = _load_model(spec, args)
        if is_negative_control and not model.is_dense:
            raise ConfigError(
                f"--dense {spec!r} is not a dense model (it has a weight-shared core); pass a "
                "dense model as the negative control."
            )
        if data is None or hasattr(model, "planted_task"):
            data = task_data(
                model, args.task, args.n_eval, args.n_calibration, args.seed, **text_options
            )
        elif first is not None:
            _check_same_data(first, model, spec, args.task)
        first = first if first is not None else model
        protocol = DepthControlProtocol(
            model, protocol_config(args, "run"), spec=spec, progress=not args.quiet and main,
            checkpoint=Checkpoint(work / CHECKPOINTS / name, args.checkpoint_every),
        )  # fmt: skip
        plans.append(_Plan(spec, folder, finished, model, protocol, data))
    # Rank 0 locks and prepares the folder; no rank starts before it has.
    lock = FolderLock(work) if main else None
    new = not work.exists()
    try:
        if lock is not None:
            lock.acquire()
            if work != args.out:
                FolderLock(args.out).acquire().release()  # nobody else writes the old run
        distributed.broadcast_from_main(_prepare_folder(args, work) if main else None)
        return _run_plans(args, command, plans, work)
    except (ValueError, TypeError):  # DCPLensError and the checks torch and the sweep make
        # Refused by a check the sweep makes as it starts: a folder this run made, holding
        # nothing that --resume could continue, goes (an --overwrite's replacement always).
        if main and (work != args.out or (new and not _resumable(work))):
            shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.release()


def _resumable(work: Path) -> bool:
    """Does ``work`` hold snapshots or finished models that ``--resume`` would continue?"""
    return any((work / CHECKPOINTS).rglob("*.pt")) or any((work / CHECKPOINTS).rglob("finished"))


@dataclass
class _Plan:
    """One model of a run: its spec, subfolder, "finished" file; its model, protocol and data
    (None when an interrupted run finished it already)."""

    spec: str
    folder: Path
    finished: Path
    model: Any
    protocol: Any
    data: Any


def _run_plans(args: argparse.Namespace, command: str, plans: list[_Plan], work: Path) -> int:
    from dcp_lens.protocol.results import write_results_json
    from dcp_lens.report.console import format_summaries
    from dcp_lens.report.html import write_report
    from dcp_lens.studies.report_extras import REPORT_DATA, collect_report_data, write_report_data
    from dcp_lens.utils import distributed
    from dcp_lens.utils.environment import environment
    from dcp_lens.utils.snapshots import die_if_asked

    main = distributed.is_main()
    runs: list[ProtocolResults] = []
    extras: list[dict[str, Any]] = []
    for plan in plans:
        if plan.protocol is None:
            runs.append(_read_finished(plan.folder))
            extras.append(_report_data(plan.folder)["runs"][runs[-1].model])
            continue
        results = _resumed(args, plan, work)
        if not main:  # rank 0 writes
            continue
        runs.append(results)
        extra = collect_report_data(
            plan.protocol, plan.data[0], vocab=_vocab(plan.model, args.task, args.seed),
            n_bootstrap=min(args.bootstrap, 200),
        )  # fmt: skip
        extras.append(extra)
        # Per-model results are written as each finishes (results.json last: it says the model
        # is finished); the folder is marked incomplete until all are.
        results.save(plan.folder)
        env = environment()
        write_report_data([extra], plan.folder / REPORT_DATA, command=command, environment=env)
        plan.finished.write_text(f"{plan.spec}\n")
        die_if_asked(f"model:{len(runs)}")
    if not main:
        return 0
    write_report_data(extras, work / REPORT_DATA, command=command, environment=environment())
    write_report(runs, work, _report_data(work))
    write_results_json(runs, work / "results.json")  # last: results.json means finished
    shutil.rmtree(work / CHECKPOINTS, ignore_errors=True)
    die_if_asked("written")
    if work != args.out:  # an --overwrite run: its folder takes the old run's place at once
        swap_folders(work, args.out)
    mark_complete(args.out)
    print(format_summaries(runs))  # the verdict per model and metric, the legend, the flags
    print(f"\nwrote {args.out / 'results.json'}; open {args.out / 'report.html'}")
    return 0


def _resumed(args: argparse.Namespace, plan: _Plan, work: Path) -> ProtocolResults:
    """``plan``'s protocol run; with ``--resume``, snapshots that load but do not fit the run
    (another version's, edited) are refused naming their folder."""
    from dcp_lens.utils.errors import DamagedFileError

    snapshots = work / CHECKPOINTS / plan.folder.name
    try:
        results: ProtocolResults = plan.protocol.run(*plan.data)
    except (KeyError, IndexError, TypeError, AttributeError, RuntimeError) as cause:
        if not (args.resume and any(snapshots.glob("*.pt"))):
            raise
        text = " ".join(str(cause).split())[:160] or type(cause).__name__
        raise DamagedFileError(
            f"the --resume snapshots in {snapshots} do not fit this run ({type(cause).__name__}: "
            f"{text}); start the run again without --resume."
        ) from cause
    return results


def _load_model(spec: str, args: argparse.Namespace) -> Any:
    import torch

    from dcp_lens.zoo.registry import load

    dtype = getattr(torch, args.dtype) if args.dtype else None
    return load(spec).to(device=args.device, dtype=dtype).eval()


def _model_folder_names(specs: Sequence[str]) -> list[str]:
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
    data as the first model does (the same task when --task is not given, the same vocabulary
    and tokenizer)."""
    reasons = []
    if task is None and getattr(first, "task_config", None) != getattr(model, "task_config", None):
        reasons.append(
            f"its task {getattr(model, 'task_config', None)} differs from "
            f"{getattr(first, 'task_config', None)}"
        )
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


def _work_folder(args: argparse.Namespace) -> Path | None:
    """Where this run writes, checked against ``--resume`` and ``--overwrite`` without writing:
    ``--out`` itself, or (``--overwrite`` of a finished run) a sibling folder that takes its
    place when the run has finished. None: ``--resume`` of a finished run, nothing to do.

    A finished folder (``results.json``, no ``INCOMPLETE``) is never replaced without
    ``--overwrite``; an interrupted one is continued with ``--resume`` (the same command), or
    started again without it."""
    out = args.out
    if args.resume and args.overwrite:
        raise ConfigError("--resume and --overwrite exclude each other; pass one.")
    if _finished(out):
        if args.resume:
            return None
        if not args.overwrite:
            raise ConfigError(
                f"--out {out} holds a finished run (results.json); pass --overwrite to replace "
                "it or choose another folder."
            )
        return replacement_folder(out)
    if out.is_dir() and any(p.name != LOCK_FILE for p in out.iterdir()) and not _ours(out):
        raise ConfigError(
            f"--out {out} is a folder of other files (no results.json, INCOMPLETE or "
            f"{CHECKPOINTS}); pass a new or empty folder so that nothing in it is overwritten."
        )
    recorded = out / CHECKPOINTS / "command.json"
    if args.resume and recorded.is_file():
        before = _recorded_settings(recorded)
        settings = _run_settings(args)
        changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
        if changed:
            raise ConfigError(
                f"--resume continues the same run, but {', '.join(changed)} differ from the "
                f"interrupted command ({recorded}); rerun it as it was or drop --resume."
            )
    return out


def _ours(folder: Path) -> bool:
    """Does ``folder`` hold files a dcp-lens run wrote (or started to)?"""
    return any((folder / name).exists() for name in ("results.json", MARKER, CHECKPOINTS))


def _recorded_settings(path: Path) -> dict[str, Any]:
    """The settings an interrupted run recorded in ``command.json``, refused if damaged."""
    from dcp_lens.utils.checks import read_json_object
    from dcp_lens.utils.errors import DamagedFileError

    try:
        return dict(read_json_object(path))
    except DCPLensError as error:
        raise DamagedFileError(
            f"{_one_line(error)} It records the interrupted command; start again without "
            "--resume (the run's snapshots are discarded)."
        ) from error


def _prepare_folder(args: argparse.Namespace, work: Path) -> bool:
    """Mark ``work`` incomplete and record the run's settings (the lock on it is held)."""
    snapshots = work / CHECKPOINTS
    if not args.resume:  # start again: no file of an interrupted run may be mixed in
        for child in work.iterdir():
            if child.name != LOCK_FILE:
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    mark_incomplete(work, "dcp-lens run")
    snapshots.mkdir(parents=True, exist_ok=True)
    settings = json.dumps(_run_settings(args), indent=2, sort_keys=True) + "\n"
    write_text_atomically(snapshots / "command.json", settings)
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
    from dcp_lens.protocol.results import ProtocolResults

    document = json.loads((folder / "results.json").read_text())
    return ProtocolResults.from_results_json(document["runs"][0])


def _report(args: argparse.Namespace) -> int:
    from dcp_lens.protocol.results import read_results_json
    from dcp_lens.report.html import write_report

    runs = read_results_json(args.folder / "results.json")
    data = _report_data(args.folder)
    out = args.out or args.folder
    with FolderLock(out if out.is_dir() or not out.suffix else out.parent):
        report = write_report(runs, out, data)
    print(f"wrote {report}")
    return 0


def _report_data(folder: Path) -> dict[str, Any]:
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


def _command_line(argv: Sequence[str] | None) -> str:
    return shlex.join(["dcp-lens", *(sys.argv[1:] if argv is None else argv)])


def _train(args: argparse.Namespace) -> int:
    from dcp_lens.report.html import format_accuracy_table
    from dcp_lens.training import preset, train

    overrides = {"steps": args.steps} if args.steps is not None else {}
    config = preset(args.preset, regime=args.regime, seed=args.seed, **overrides)
    with FolderLock(args.out):  # after the checks: a refused command leaves no folder
        result = train(config, args.out, resume=args.resume)
    if result.accuracy_table is not None:
        print(format_accuracy_table(result.accuracy_table))
    print(f"model in {args.out / 'model'}; diagnose it with: {diagnose_command(args.out)}")
    return 0


def _experiment(args: argparse.Namespace) -> int:
    from dcp_lens.report.html import markdown_table
    from dcp_lens.studies.intervention import run_training_intervention
    from dcp_lens.training import REGIMES

    regimes = REGIMES if args.regimes is None else (_names(args.regimes) or ())
    document = run_training_intervention(
        args.out, preset=args.preset, seeds=_ints(args.seeds, "--seeds") or (),
        regimes=regimes, n_eval=args.n_eval,
        dense_seeds=None if args.dense_seeds is None else _ints(args.dense_seeds, "--dense-seeds"),
        n_calibration=args.n_calibration, protocol_config=protocol_config(args, "experiment"),
        device=args.device, jobs=args.jobs, progress=not args.quiet,
    )  # fmt: skip
    print(f"\n{document['metric']} shares over seeds (preset {document['preset']}):")
    print("\n".join(markdown_table(document["regimes"])))
    for regime, checks in document["verdict"].items():
        labels = ", ".join(f"{name} {check['label']}" for name, check in checks.items())
        print(f"{regime}: {labels}")
    written = ", ".join(str(args.out / name) for name in ("intervention.json", "intervention.md"))
    print(f"wrote {written}; open {args.out / 'intervention.html'}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from dcp_lens.studies import validate as validation

    config = protocol_config(args, "validate")
    names = _names(args.models, "--models")
    coverage = None
    rows: list[validation.ValidationRow] = []
    if args.coverage is not None:
        mixtures = [n for n in validation.MIXTURES if n not in (names or ())]
        coverage = validation.coverage(
            [*mixtures, *(names or ())], config=config, replicates=args.coverage,
            n_eval=args.n_eval, n_calibration=args.n_calibration, progress=not args.quiet,
        )  # fmt: skip
        print("\n".join(validation.coverage_markdown(coverage)))
    else:
        rows = validation.validate(
            names, config=config, n_eval=args.n_eval,
            n_calibration=args.n_calibration, progress=not args.quiet,
        )  # fmt: skip
        print("\n".join(validation.markdown(rows)))
    if args.out is not None:
        settings = {
            "seed": config.seed, "n_eval": args.n_eval, "n_calibration": args.n_calibration,
            "n_bootstrap": config.n_bootstrap, "config": config.to_dict(),
        }  # fmt: skip
        with FolderLock(args.out):
            validation.save(rows, args.out, settings, coverage)
        print(f"wrote {args.out / 'validation.json'} and {args.out / 'validation.md'}")
    passed = coverage["passed"] if coverage is not None else validation.suite_passed(rows)
    return 0 if passed else 1


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


def _names(text: str | None, flag: str = "--metrics") -> tuple[str, ...] | None:
    """The comma-separated names of ``text`` (None: the flag was not given)."""
    if text is None:
        return None
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise ConfigError(f"{flag} {text!r} names nothing; give comma-separated names.")
    return names


if __name__ == "__main__":
    raise SystemExit(main())
