"""The ``dcp-lens`` argument parser: one function per command declaring its options. Builds fast
and imports nothing heavy: the registries' names are read only when help is shown."""

from __future__ import annotations

import argparse
import os

from dcp_lens.cli.arguments import HelpFormatter, Parser, path_argument, version
from dcp_lens.cli.help import DESCRIPTION, EXAMPLES, HELP, MODEL_SPECS
from dcp_lens.cli.options import (
    DEFAULT_THREADS,
    DTYPES,
    EXPERIMENTS,
    add_protocol_options,
    registered_names,
)
from dcp_lens.studies.run import DEFAULT_DENSE, DEFAULT_MODEL

DEVICE_HELP = "cpu, cuda, cuda:1, mps, ..."
QUIET_HELP = "no progress bars"
PRESET_HELP = "training preset: tiny, default, lm-tiny or lm"


def build_parser() -> argparse.ArgumentParser:
    """The ``dcp-lens`` argument parser; builds fast, imports nothing heavy."""
    Parser.names = staticmethod(registered_names)  # type: ignore[assignment]
    parser = Parser(
        prog="dcp-lens",
        description=DESCRIPTION,
        epilog=f"{MODEL_SPECS}\n\n{EXAMPLES['run']}",
        formatter_class=HelpFormatter,
    )
    parser.lists = ("metrics", "tasks")
    parser.add_argument("--version", action="version", version=f"dcp-lens {version()}")
    commands = parser.add_subparsers(
        title="commands", dest="command", required=True, parser_class=Parser, metavar="COMMAND"
    )
    _add_run(commands)
    _add_report(commands)
    _add_train(commands)
    _add_experiment(commands)
    _add_validate(commands)
    _add_bench(commands)
    return parser


# What `add_subparsers` returns: the table the commands' parsers are added to.
Commands = argparse._SubParsersAction


def _command(
    commands: Commands[Parser], name: str, summary: str, epilog: str | None = None
) -> Parser:
    sub: Parser = commands.add_parser(
        name,
        help=summary,
        description=summary,
        formatter_class=HelpFormatter,
        epilog=epilog or EXAMPLES[name],
    )
    return sub


def _add_run(commands: Commands[Parser]) -> None:
    run = _command(
        commands,
        "run",
        "run the Depth Control Protocol on a model and its dense control",
        f"{MODEL_SPECS}\n\n{EXAMPLES['run']}",
    )
    run.lists = ("metrics", "maps", "tasks")
    run.add_argument(
        "--model",
        metavar="SPEC",
        help=f"model spec, see below (default: {DEFAULT_MODEL}, with {DEFAULT_DENSE} as --dense)",
    )
    run.add_argument(
        "--dense",
        "--dense-control",
        metavar="SPEC",
        dest="dense",
        help=f"a dense model spec run as the negative control (default: {DEFAULT_DENSE} when "
        "--model is not given, else none); a retrofit's dense parent records which of its "
        "layers became the prelude, core and coda",
    )
    run.add_argument(
        "--task", help="task name, char_lm:PATH or text:PATH (default: the model's own task)"
    )
    _add_run_data(run)
    add_protocol_options(run, "run", unset=("batch_size",))
    for action in run._actions:  # no batch size given: the largest that fits, up to 64
        if action.dest == "batch_size":
            action.help = "sequences per forward pass (default: the largest up to 64 that fits"
            action.help += " the memory budget, printed)"
    run.add_argument("--device", default="cpu", help=DEVICE_HELP)
    run.add_argument(
        "--dtype",
        choices=DTYPES,
        help="compute in this dtype (default: the model's); statistics stay float64",
    )
    run.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=HELP["threads"])
    run.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    run.add_argument("--out", required=True, type=path_argument, help="output folder")
    run.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="continue an interrupted run of the same command",
    )
    run.add_argument("--overwrite", action="store_true", help="replace a finished run's folder")
    run.add_argument(
        "--checkpoint-every", type=int, default=16, help="batches between --resume snapshots"
    )
    run.add_argument("--dry-run", action="store_true", help=HELP["dry_run"])


def _add_run_data(run: Parser) -> None:
    """The options of ``run`` that choose its data: how many sequences, and how a text task
    reads its corpus."""
    run.add_argument(
        "--n-eval", type=int, help="evaluation sequences (default: 512; text: every window left)"
    )
    run.add_argument(
        "--n-calibration",
        type=int,
        help="calibration sequences (default: 512; text: the docs' page Real models and text)",
    )
    run.add_argument(
        "--max-tokens", type=int, help="text: use at most this many corpus tokens (default: all)"
    )
    run.add_argument(
        "--seq-len", type=int, help="text: tokens per window (default: n_ctx, at most 128)"
    )
    run.add_argument("--text-field", help="text: the field of a .jsonl record (default: text)")
    run.add_argument(
        "--token-dtype",
        choices=("uint16", "uint32"),
        help="text: ids of a pre-tokenized .bin (default: from the vocabulary size)",
    )


def _add_report(commands: Commands[Parser]) -> None:
    report = _command(
        commands, "report", "re-render report.html of a finished run folder from its files"
    )
    report.add_argument("folder", type=path_argument, help="a folder written by dcp-lens run")
    report.add_argument(
        "--out", type=path_argument, help="where to write (default: FOLDER/report.html)"
    )


def _add_train(commands: Commands[Parser]) -> None:
    train = _command(commands, "train", "train a model on a task preset")
    train.add_argument("--preset", default="default", help=PRESET_HELP)
    train.add_argument("--regime", default="fixed", help="fixed, sampled, every-iteration or dense")
    train.add_argument("--seed", type=int, default=0, help="training seed")
    train.add_argument("--steps", type=int, help="override the preset's number of steps")
    train.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="continue the run in --out if there is one (--no-resume: start over)",
    )
    train.add_argument(
        "--out", required=True, type=path_argument, help="run folder (resumed if present)"
    )


def _add_experiment(commands: Commands[Parser]) -> None:
    experiment = _command(
        commands,
        "experiment",
        "run an experiment: training-intervention (the docs' page Design, section 6)",
    )
    experiment.lists = ("metrics", "maps")
    experiment.add_argument("name", choices=EXPERIMENTS, help="which experiment")
    experiment.add_argument("--preset", default="default", help=PRESET_HELP)
    experiment.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    experiment.add_argument(
        "--dense-seeds", help="seeds of the dense control (default: the first of --seeds)"
    )
    experiment.add_argument("--regimes", help="comma-separated training regimes (default: all)")
    experiment.add_argument("--n-eval", type=int, default=512, help="evaluation sequences")
    experiment.add_argument("--n-calibration", type=int, default=512, help="calibration sequences")
    add_protocol_options(experiment, "experiment", skip=("seed",))  # seeded per model: --seeds
    experiment.add_argument("--device", default="cpu", help=DEVICE_HELP)
    cpus = os.cpu_count() or 1
    experiment.add_argument(
        "--jobs",
        type=int,
        default=cpus,
        help="trainings at once, one process and one thread each (default: the CPU count, "
        f"{cpus} here)",
    )
    experiment.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    experiment.add_argument(
        "--out", required=True, type=path_argument, help="experiment folder (resumed)"
    )


def _add_validate(commands: Commands[Parser]) -> None:
    validate = _command(
        commands,
        "validate",
        "the protocol on every planted model of known answer, on every metric",
    )
    validate.lists = ("metrics", "maps")
    validate.add_argument("--models", help=HELP["models"])
    validate.add_argument("--n-eval", type=int, default=512, help="evaluation sequences")
    validate.add_argument("--n-calibration", type=int, default=512, help="calibration sequences")
    add_protocol_options(validate, "validate")
    validate.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=HELP["threads"])
    validate.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    validate.add_argument(
        "--out",
        type=path_argument,
        help="write validation.json and validation.md here (default: print only)",
    )
    validate.add_argument("--coverage", type=int, metavar="N", help=HELP["coverage"])
    validate.add_argument(
        "--width",
        type=int,
        metavar="N",
        help="embed every planted model in a stream of N coordinates (docs/validation.md)",
    )
    validate.add_argument("--merge", metavar="DIRS", help=HELP["merge"])


def _add_bench(commands: Commands[Parser]) -> None:
    bench = _command(
        commands, "bench", "cost of the sweep, the naive sweep and a hooks-off forward"
    )
    bench.lists = ("metrics", "maps")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument(
        "--preset", choices=("small", "huginn"), default="small", help=HELP["bench_preset"]
    )
    bench.add_argument("--d-model", type=int, help="width of the benchmark model")
    bench.add_argument("--n-core", type=int, help="blocks in the recurrent core")
    bench.add_argument("--iterations", type=int, help="iterations r of the core")
    bench.add_argument("--vocab", type=int, help="vocabulary size")
    bench.add_argument("--seq", type=int, help="tokens per sequence")
    bench.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="the model's compute dtype (statistics stay float64)",
    )
    bench.add_argument("--repeats", type=int, default=5, help=HELP["repeats"])
    bench.add_argument("--batches", type=int, default=1, help=HELP["batches"])
    bench.add_argument("--no-naive", action="store_true", help="skip the slow naive sweep")
    bench.add_argument("--estimate", action="store_true", help=HELP["estimate"])
    bench.add_argument("--count", action="store_true", help=HELP["count"])
    # --batch-size: the preset's; --probe: none for the timed bench, the run's for --estimate
    add_protocol_options(bench, "bench", unset=("batch_size", "probe"))
    bench.add_argument("--device", default="cpu", help=DEVICE_HELP)
    bench.add_argument("--threads", type=int, help=HELP["bench_threads"])


__all__ = ["build_parser"]
