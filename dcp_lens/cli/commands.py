"""What each ``dcp-lens`` command does once its arguments parse: the checks that need no torch,
then a call into `dcp_lens.studies` (or `dcp_lens.training`), imported when the command runs."""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Callable
from pathlib import Path

from dcp_lens.cli.arguments import check_local_paths, check_values, ints, names
from dcp_lens.cli.options import PATH_KINDS, TASK_FILES, protocol_config
from dcp_lens.studies.run import DEFAULT_DENSE, DEFAULT_MODEL
from dcp_lens.utils import bounds
from dcp_lens.utils.errors import ConfigError
from dcp_lens.utils.files import check_output_folder


def run_command(args: argparse.Namespace) -> int:
    """Check ``args`` (`check_arguments`), then the device, then run the command they name with
    ``--threads`` torch threads (torch's own count is restored after); its exit code."""
    check_arguments(args)
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


def check_arguments(args: argparse.Namespace) -> None:
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
        n_eval=args.n_eval,
        n_calibration=args.n_calibration,
        text=text,
        device=args.device,
        dtype=args.dtype,
        progress=not args.quiet,
        resume=args.resume,
        overwrite=args.overwrite,
        checkpoint_every=args.checkpoint_every,
        command=args.command_line,
        batch_from_budget=args.batch_size is None,
    )
    dense = args.dense or (DEFAULT_DENSE if args.model is None else None)
    if args.dry_run:
        spec = args.model or DEFAULT_MODEL
        print(dry_run(spec, dense, args.task, protocol_config(args, "run"), options))
        return 0
    outcome = run(
        args.out,
        args.model or DEFAULT_MODEL,
        dense,
        args.task,
        protocol_config(args, "run"),
        options,
    )
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


def diagnose_command(run_folder: Path) -> str:
    """The ``dcp-lens run`` command that diagnoses the model ``dcp-lens train`` wrote in
    ``run_folder`` (its results in ``run_folder/dcp``)."""
    model, out = str(run_folder / "model"), str(run_folder / "dcp")
    return shlex.join(["dcp-lens", "run", "--model", model, "--out", out])


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
        args.out,
        preset=args.preset,
        seeds=ints(args.seeds, "--seeds") or (),
        regimes=REGIMES if args.regimes is None else (names(args.regimes) or ()),
        n_eval=args.n_eval,
        dense_seeds=dense,
        n_calibration=args.n_calibration,
        protocol_config=protocol_config(args, "experiment"),
        device=args.device,
        jobs=args.jobs,
        progress=not args.quiet,
    )
    print_summary(document, args.out)
    return 0


def _validate(args: argparse.Namespace) -> int:
    from dcp_lens.studies.validate import run_validation

    if args.merge is not None:
        from dcp_lens.studies.validation_merge import run_merge

        given = [f"--{name}" for name in ("models", "coverage", "width") if getattr(args, name)]
        if args.out is None or given:
            raise ConfigError(
                "--merge writes the merged record to --out and runs nothing"
                + (f", so {', '.join(given)} does not apply" if given else "")
                + "; pass --merge A,B --out DIR only."
            )
        return 0 if run_merge(names(args.merge, "--merge") or (), args.out) else 1
    passed = run_validation(
        names(args.models, "--models"),
        config=protocol_config(args, "validate"),
        n_eval=args.n_eval,
        n_calibration=args.n_calibration,
        replicates=args.coverage,
        out=args.out,
        progress=not args.quiet,
        width=args.width,
    )
    return 0 if passed else 1


def _bench(args: argparse.Namespace) -> int:
    from dcp_lens.studies.bench import print_bench, run_bench
    from dcp_lens.studies.bench_work import run_estimate
    from dcp_lens.utils.memory import annotated

    if args.estimate:
        config = protocol_config(args, "run")
        estimate = run_estimate(
            args.preset,
            batch=args.batch_size,
            seq=args.seq,
            d_model=args.d_model,
            n_core=args.n_core,
            n_iterations=args.iterations,
            d_vocab=args.vocab,
            dtype=args.dtype,
            config=config,
            budget_gib=config.memory_budget,  # type: ignore[arg-type]
        )
        print(json.dumps(estimate, indent=2) if args.json else estimate["table"])
        return 0

    if args.count:
        from dcp_lens.studies.bench import RUN_BATCHES
        from dcp_lens.studies.bench_work import print_count, run_count

        counted = run_count(
            args.preset,
            d_model=args.d_model,
            n_core=args.n_core,
            n_iterations=args.iterations,
            d_vocab=args.vocab,
            batch=args.batch_size,
            seq=args.seq,
            config=protocol_config(args, "bench"),
            batches=args.batches if args.batches > 1 else RUN_BATCHES,
        )
        print_count(counted, args.json)
        return 0
    result = run_bench(
        d_model=args.d_model,
        n_core=args.n_core,
        n_iterations=args.iterations,
        batch=args.batch_size,
        seq=args.seq,
        d_vocab=args.vocab,
        repeats=args.repeats,
        device=args.device,
        naive=not args.no_naive,
        preset=args.preset,
        dtype=args.dtype,
        config=protocol_config(args, "bench"),
        batches=args.batches,
    )
    print_bench(annotated(result), args.json)
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _run,
    "report": _report,
    "train": _train,
    "experiment": _experiment,
    "validate": _validate,
    "bench": _bench,
}


__all__ = ["COMMANDS", "check_arguments", "diagnose_command", "run_command"]
