"""The dcp-lens command line: the parser (`dcp_lens.cli.parser`), its option tables and help
texts, the argument helpers and what each command does (`dcp_lens.cli.commands`). It parses and
checks its arguments before importing torch, so that help and argument errors are instant; each
command is a call into `dcp_lens.studies` (or `dcp_lens.training`), imported when it runs."""

from __future__ import annotations

import shlex
import sys
import warnings
from collections.abc import Sequence

from dcp_lens.cli.arguments import one_line, show_warning
from dcp_lens.cli.commands import run_command
from dcp_lens.cli.options import protocol_config
from dcp_lens.cli.parser import build_parser
from dcp_lens.utils.memory import limit_heap_fragmentation
from dcp_lens.utils.signals import exit_code, how_to_continue, signal_name, stop_on_signals


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dcp-lens`` with ``argv`` (default: the process's arguments); its exit code: 0 done,
    1 a validation that failed, 2 an error (one line on stderr, never a traceback), or the
    code of the signal that stopped it."""
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():  # restores how warnings are shown when main returns
        warnings.showwarning = show_warning
        try:
            args.command_line = shlex.join(["dcp-lens", *(sys.argv[1:] if argv is None else argv)])
            # Freed tensors reused within a batch, free pages returned after it; or the strict
            # fixed mmap threshold of $DCP_LENS_MMAP_THRESHOLD (dcp_lens.utils.memory).
            limit_heap_fragmentation()
            with stop_on_signals():
                return run_command(args)
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


__all__ = ["build_parser", "main", "protocol_config"]
