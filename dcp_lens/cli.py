"""The dcp-lens command line: the parser and a dispatch table. It parses and checks its
arguments before importing torch, so that help and argument errors are instant; each command is
a call into `dcp_lens.studies` (or `dcp_lens.training`), imported when it runs."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import warnings
from collections.abc import Callable, Sequence

from dcp_lens.protocol.options import (
    TASK_FILES,
    add_protocol_options,
    protocol_config,
    registered_names,
)
from dcp_lens.studies.commands import (
    DEFAULT_DENSE,
    DEFAULT_MODEL,
    DESCRIPTION,
    DTYPES,
    EXAMPLES,
    HELP,
    MODEL_SPECS,
    diagnose_command,
)
from dcp_lens.utils import bounds
from dcp_lens.utils.arguments import (
    HelpFormatter,
    Parser,
    check_local_paths,
    check_values,
    ints,
    names,
    one_line,
    path_argument,
    show_warning,
    version,
)
from dcp_lens.utils.files import check_output_folder
from dcp_lens.utils.memory import limit_heap_fragmentation
from dcp_lens.utils.signals import exit_code, how_to_continue, signal_name, stop_on_signals

EXPERIMENTS = ("training-intervention",)
PATH_KINDS = (
    "huginn",
    "ouro",
    "llama2c",
    "bridge",
    "raven-retrofit",
)  # model specs KIND:PATH of local files
# One thread: OpenMP threads spin-wait for a core another process holds (docs/cli.md).
DEFAULT_THREADS = 1


def build_parser() -> argparse.ArgumentParser:
    """The ``dcp-lens`` argument parser; builds fast, imports nothing heavy."""
    Parser.names = staticmethod(registered_names)  # type: ignore[assignment]
    parser = Parser(
        prog="dcp-lens", description=DESCRIPTION, epilog=f"{MODEL_SPECS}\n\n{EXAMPLES['run']}",
        formatter_class=HelpFormatter,
    )  # fmt: skip
    parser.lists = ("metrics", "tasks")
    parser.add_argument("--version", action="version", version=f"dcp-lens {version()}")
    commands = parser.add_subparsers(
        title="commands", dest="command", required=True, parser_class=Parser, metavar="COMMAND"
    )

    def command(name: str, summary: str, epilog: str | None = None) -> Parser:
        sub: Parser = commands.add_parser(
            name, help=summary, description=summary, formatter_class=HelpFormatter,
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
        "--dense", "--dense-control", metavar="SPEC", dest="dense",
        help=f"a dense model spec run as the negative control (default: {DEFAULT_DENSE} when "
        "--model is not given, else none); a retrofit's dense parent records which of its "
        "layers became the prelude, core and coda",
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
        "--token-dtype", choices=("uint16", "uint32"),
        help="text: ids of a pre-tokenized .bin (default: from the vocabulary size)",
    )  # fmt: skip
    add_protocol_options(run, "run", unset=("batch_size",))
    for action in run._actions:  # no batch size given: the largest that fits, up to 64
        if action.dest == "batch_size":
            action.help = "sequences per forward pass (default: the largest up to 64 that fits"
            action.help += " the memory budget, printed)"
    run.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps, ...")
    run.add_argument(
        "--dtype", choices=DTYPES,
        help="compute in this dtype (default: the model's); statistics stay float64",
    )  # fmt: skip
    run.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=HELP["threads"])
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    run.add_argument("--out", required=True, type=path_argument, help="output folder")
    run.add_argument(
        "--resume", action=argparse.BooleanOptionalAction, default=False,
        help="continue an interrupted run of the same command",
    )  # fmt: skip
    run.add_argument("--overwrite", action="store_true", help="replace a finished run's folder")
    run.add_argument(
        "--checkpoint-every", type=int, default=16, help="batches between --resume snapshots"
    )
    run.add_argument("--dry-run", action="store_true", help=HELP["dry_run"])

    report = command("report", "re-render report.html of a finished run folder from its files")
    report.add_argument("folder", type=path_argument, help="a folder written by dcp-lens run")
    report.add_argument(
        "--out", type=path_argument, help="where to write (default: FOLDER/report.html)"
    )

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
    train.add_argument(
        "--out", required=True, type=path_argument, help="run folder (resumed if present)"
    )

    experiment = command(
        "experiment", "run an experiment: training-intervention (the docs' page Design, section 6)"
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
    experiment.add_argument(
        "--out", required=True, type=path_argument, help="experiment folder (resumed)"
    )

    validate = command(
        "validate", "the protocol on every planted model of known answer, on every metric"
    )
    validate.lists = ("metrics", "maps")
    validate.add_argument("--models", help=HELP["models"])
    validate.add_argument("--n-eval", type=int, default=512, help="evaluation sequences")
    validate.add_argument("--n-calibration", type=int, default=512, help="calibration sequences")
    add_protocol_options(validate, "validate")
    validate.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=HELP["threads"])
    validate.add_argument("--quiet", action="store_true", help="no progress bars")
    validate.add_argument(
        "--out", type=path_argument,
        help="write validation.json and validation.md here (default: print only)",
    )  # fmt: skip
    validate.add_argument("--coverage", type=int, metavar="N", help=HELP["coverage"])
    validate.add_argument(
        "--width",
        type=int,
        metavar="N",
        help="embed every planted model in a stream of N coordinates (docs/validation.md)",
    )

    bench = command("bench", "cost of the sweep, the naive sweep and a hooks-off forward")
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
        "--dtype", choices=DTYPES, default="float32",
        help="the model's compute dtype (statistics stay float64)",
    )  # fmt: skip
    bench.add_argument("--repeats", type=int, default=5, help=HELP["repeats"])
    bench.add_argument("--batches", type=int, default=1, help=HELP["batches"])
    bench.add_argument("--no-naive", action="store_true", help="skip the slow naive sweep")
    bench.add_argument("--estimate", action="store_true", help=HELP["estimate"])
    bench.add_argument("--count", action="store_true", help=HELP["count"])
    add_protocol_options(
        bench, "bench", unset=("batch_size", "probe")
    )  # --batch-size: the preset's
    bench.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps, ...")
    bench.add_argument("--threads", type=int, help=HELP["bench_threads"])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():  # restores how warnings are shown when main returns
        warnings.showwarning = show_warning
        try:
            args.command_line = shlex.join(["dcp-lens", *(sys.argv[1:] if argv is None else argv)])
            # Freed tensors reused within a batch, free pages returned after it; or the strict
            # fixed mmap threshold of $DCP_LENS_MMAP_THRESHOLD (dcp_lens.utils.memory).
            limit_heap_fragmentation()
            with stop_on_signals():
                return _command(args)
        except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM, SIGHUP, SIGQUIT (utils.signals)
            then = how_to_continue(args.command, getattr(args, "out", None))
            print(
                f"dcp-lens {args.command}: stopped by {signal_name(stop)}; {then}", file=sys.stderr
            )
            return exit_code(stop)
        except BaseException as error:  # one line, never a traceback (a panic included)
            if isinstance(error, SystemExit | GeneratorExit):
                raise
            print(f"dcp-lens {args.command}: error: {one_line(error)}", file=sys.stderr)
            return 2


def _command(args: argparse.Namespace) -> int:
    _check_arguments(args)
    device = getattr(args, "device", None)
    if device is not None and device.strip() != "cpu":  # imports torch: after the other checks
        from dcp_lens.utils.devices import check_device

        check_device(device)
    if getattr(args, "threads", None) is None:
        return COMMANDS[args.command](args)
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return COMMANDS[args.command](args)
    finally:
        torch.set_num_threads(previous)  # main called from Python leaves torch as it found it


def _check_arguments(args: argparse.Namespace) -> None:
    """Everything that can be checked before torch is imported and any work starts: empty
    values, counts, lists, local paths, sizes and the output folder's place."""
    check_values(args)
    check_local_paths(args, {"model": PATH_KINDS, "dense": PATH_KINDS, "task": TASK_FILES})
    out = getattr(args, "out", None)
    if out is not None and args.command != "report":
        check_output_folder(out, "--out")
    bounds.check_threads(getattr(args, "threads", None))
    bounds.check_steps(getattr(args, "steps", None) if args.command == "train" else None)
    bounds.check_coverage(getattr(args, "coverage", None))
    counts = (getattr(args, name, None) for name in ("n_eval", "n_calibration", "seq_len"))
    bounds.check_sequences(*counts)


# ----------------------------------------------------------------------------- commands


def _run(args: argparse.Namespace) -> int:
    from dcp_lens.studies.run import RunOptions, TextOptions, dry_run, run

    text = TextOptions(args.seq_len, args.max_tokens, args.text_field, args.token_dtype)
    options = RunOptions(
        n_eval=args.n_eval, n_calibration=args.n_calibration, text=text, device=args.device,
        dtype=args.dtype, progress=not args.quiet, resume=args.resume, overwrite=args.overwrite,
        checkpoint_every=args.checkpoint_every, command=args.command_line,
        batch_from_budget=args.batch_size is None,
    )  # fmt: skip
    dense = args.dense or (DEFAULT_DENSE if args.model is None else None)
    if args.dry_run:
        spec = args.model or DEFAULT_MODEL
        print(dry_run(spec, dense, args.task, protocol_config(args, "run"), options))
        return 0
    outcome = run(
        args.out, args.model or DEFAULT_MODEL, dense, args.task, protocol_config(args, "run"),
        options,
    )  # fmt: skip
    if outcome.already_finished:
        print(f"{args.out} holds a finished run; nothing to resume.")
    elif outcome.results:  # rank 0 of a process group: the verdicts, then where they are
        print(outcome.summary())
        print(f"\nwrote {args.out / 'results.json'}; open {args.out / 'report.html'}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from dcp_lens.studies.run import report

    print(f"wrote {report(args.folder, args.out)}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from dcp_lens.report.html import format_accuracy_table
    from dcp_lens.training import preset, train

    overrides = {"steps": args.steps} if args.steps is not None else {}
    config = preset(args.preset, regime=args.regime, seed=args.seed, **overrides)
    result = train(config, args.out, resume=args.resume, progress=True)
    if result.accuracy_table is not None:
        print(format_accuracy_table(result.accuracy_table))
    print(f"model in {args.out / 'model'}; diagnose it with: {diagnose_command(args.out)}")
    return 0


def _experiment(args: argparse.Namespace) -> int:
    from dcp_lens.studies.intervention import print_summary, run_training_intervention
    from dcp_lens.training import REGIMES

    dense = None if args.dense_seeds is None else ints(args.dense_seeds, "--dense-seeds")
    document = run_training_intervention(
        args.out, preset=args.preset, seeds=ints(args.seeds, "--seeds") or (),
        regimes=REGIMES if args.regimes is None else (names(args.regimes) or ()),
        n_eval=args.n_eval, dense_seeds=dense, n_calibration=args.n_calibration,
        protocol_config=protocol_config(args, "experiment"), device=args.device, jobs=args.jobs,
        progress=not args.quiet,
    )  # fmt: skip
    print_summary(document, args.out)
    return 0


def _validate(args: argparse.Namespace) -> int:
    from dcp_lens.studies.validate import run_validation

    passed = run_validation(
        names(args.models, "--models"), config=protocol_config(args, "validate"),
        n_eval=args.n_eval, n_calibration=args.n_calibration, replicates=args.coverage,
        out=args.out, progress=not args.quiet, width=args.width,
    )  # fmt: skip
    return 0 if passed else 1


def _bench(args: argparse.Namespace) -> int:
    from dcp_lens.studies.bench import print_bench, run_bench
    from dcp_lens.studies.bench_work import run_estimate
    from dcp_lens.utils.memory import annotated

    if args.estimate:
        config = protocol_config(args, "run")
        estimate = run_estimate(
            args.preset, batch=args.batch_size, seq=args.seq, d_model=args.d_model,
            n_core=args.n_core, n_iterations=args.iterations, d_vocab=args.vocab,
            dtype=args.dtype, config=config, budget_gib=config.memory_budget,  # type: ignore[arg-type]
        )  # fmt: skip
        print(json.dumps(estimate, indent=2) if args.json else estimate["table"])
        return 0

    if args.count:
        from dcp_lens.studies.bench import RUN_BATCHES
        from dcp_lens.studies.bench_work import print_count, run_count

        counted = run_count(
            args.preset, d_model=args.d_model, n_core=args.n_core, n_iterations=args.iterations,
            d_vocab=args.vocab, batch=args.batch_size, seq=args.seq,
            config=protocol_config(args, "bench"),
            batches=args.batches if args.batches > 1 else RUN_BATCHES,
        )  # fmt: skip
        print_count(counted, args.json)
        return 0
    result = run_bench(
        d_model=args.d_model, n_core=args.n_core, n_iterations=args.iterations,
        batch=args.batch_size, seq=args.seq, d_vocab=args.vocab, repeats=args.repeats,
        device=args.device, naive=not args.no_naive, preset=args.preset, dtype=args.dtype,
        config=protocol_config(args, "bench"), batches=args.batches,
    )  # fmt: skip
    print_bench(annotated(result), args.json)
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _run, "report": _report, "train": _train, "experiment": _experiment,
    "validate": _validate, "bench": _bench,
}  # fmt: skip
