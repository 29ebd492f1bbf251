"""Command-line argument helpers that need nothing of dcp-lens's stages: argparse with one-line
errors, a help formatter that shows defaults, path and list parsing, and the checks every
command's arguments get before torch is imported (empty values, counts below their minimum)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from dcp_lens.utils.errors import ConfigError, DCPLensError

# The smallest value each count flag takes (a flag a command does not have is skipped).
MINIMUMS = {
    "n_eval": 1, "n_calibration": 1, "batch_size": 1, "bootstrap": 0, "jobs": 1, "steps": 1,
    "noise_draws": 1, "probe_points": 1, "calibration_points": 1, "mixture_components": 1,
    "d_model": 1, "n_core": 1, "iterations": 1, "batch": 1, "seq": 1, "repeats": 1, "vocab": 2,
    "threads": 1, "max_tokens": 1, "seq_len": 1, "checkpoint_every": 1, "coverage": 1,
    "seed": 0, "calibration_groups": 0, "batches": 1,
}  # fmt: skip
TEXT_VALUES = (
    "model",
    "dense",
    "task",
    "k",
    "metrics",
    "seeds",
    "dense_seeds",
    "regimes",
    "models",
)
SEED_LIMIT = 2**63  # seeds are int64 for torch and numpy: at most 2**63 - 1


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (``dcp-lens run: error: ...``), exit code 2;
    its help ends with ``names(lists)`` (the registered metrics, tasks, ...)."""

    lists: tuple[str, ...] = ()
    names: Callable[[Sequence[str]], str] | None = None

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def format_help(self) -> str:
        text = super().format_help()
        if not self.lists or self.names is None:
            return text
        return f"{text}\n{self.names(self.lists)}\n"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples as written; an option's default appended to its help unless
    the help already says it or there is none to show (None, a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        shown = "(default" in text or default is None or default is False
        if shown or default is argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def path_argument(text: str) -> Path:
    """A path argument; an empty one is refused (``Path("")`` would quietly be the cwd)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; pass a file or folder")
    return Path(text)


def ints(text: str | None, flag: str = "--k") -> list[int] | None:
    """The comma-separated integers of ``text`` (None: the flag was not given)."""
    if text is None:
        return None
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ConfigError(f"{flag} must be comma-separated integers, got {text!r}.") from error
    if not values:
        raise ConfigError(f"{flag} must be comma-separated integers, got {text!r}.")
    return values


def names(text: str | None, flag: str = "--metrics") -> tuple[str, ...] | None:
    """The comma-separated names of ``text`` (None: the flag was not given)."""
    if text is None:
        return None
    found = tuple(part.strip() for part in text.split(",") if part.strip())
    if not found:
        raise ConfigError(f"{flag} {text!r} names nothing; give comma-separated names.")
    return found


def check_values(args: argparse.Namespace) -> None:
    """Empty text values, counts below their minimum, seeds past int64, integer and name
    lists that do not parse: refused naming the flag."""
    for name in TEXT_VALUES:
        value = getattr(args, name, None)
        if value is not None and not value.strip():
            raise ConfigError(f"{_flag(name)} is empty; give a value or leave the flag out.")
    for name, minimum in MINIMUMS.items():
        value = getattr(args, name, None)
        if isinstance(value, int) and value < minimum:
            raise ConfigError(f"{_flag(name)} {value} must be >= {minimum}.")
    for name in ("k", "seeds", "dense_seeds"):
        listed = ints(getattr(args, name, None), _flag(name)) or []
        if name != "k" and any(not 0 <= seed < SEED_LIMIT for seed in listed):
            raise ConfigError(f"{_flag(name)} seeds must lie in 0..2**63-1, got {listed}.")
    seed = getattr(args, "seed", None)
    if isinstance(seed, int) and seed >= SEED_LIMIT:
        raise ConfigError(f"--seed {seed} is past 2**63-1 (seeds are 64-bit); pass a smaller seed.")
    for name in ("metrics", "models", "regimes"):
        names(getattr(args, name, None), f"--{name}")


def check_local_paths(args: argparse.Namespace, kinds: dict[str, Sequence[str]]) -> None:
    """Specs ``KIND:PATH`` of local files (``kinds``: flag -> the kinds that name a path):
    the path must exist, and a task's (``text``, ``char_lm``) must be a file or folder, not a
    pipe or device that may never end (``text`` reads one with ``--max-tokens``)."""
    from pathlib import Path

    for flag, named in kinds.items():
        kind, _, path = (getattr(args, flag, None) or "").partition(":")
        if kind in named and path and not os.path.lexists(path):
            raise ConfigError(f"--{flag} {kind}:{path}: {path} does not exist; pass a local path.")
        endless = flag == "task" and kind in named and path
        if endless and not (Path(path).is_file() or Path(path).is_dir()):
            if kind != "text" or getattr(args, "max_tokens", None) is None:
                raise ConfigError(
                    f"--{flag} {kind}:{path}: {path} is a device, pipe or socket, not a file: it "
                    "may never end; pass a file (text:PATH also reads one with --max-tokens N)."
                )


# Errors reported by their message alone: dcp-lens's own and those torch and the system raise on
# bad input (an unavailable file, a failed allocation); any other is named by its type too.
PLAIN_ERRORS = (ValueError, TypeError, OSError, RuntimeError, MemoryError)


def one_line(error: BaseException) -> str:
    """``error``'s message on one line; a failed allocation says what to lower."""
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, DCPLensError):
        return text
    if not isinstance(error, PLAIN_ERRORS):
        return f"{type(error).__name__}: {text}"
    if isinstance(error, MemoryError) or "alloc" in text.lower() or "out of memory" in text:
        return f"could not allocate memory ({text}); lower the batch, sequence or model size."
    return text


def show_warning(message: Warning | str, category: type[Warning], *_: object, **__: object) -> None:
    """Warnings as one line each: ``dcp-lens: warning: ...``."""
    print(f"dcp-lens: warning: {' '.join(str(message).split())}", file=sys.stderr)


def version() -> str:
    """The installed dcp-lens's version."""
    from importlib import metadata

    try:
        return metadata.version("dcp-lens")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


__all__ = [
    "HelpFormatter",
    "Parser",
    "check_local_paths",
    "check_values",
    "ints",
    "names",
    "one_line",
    "path_argument",
    "show_warning",
    "version",
]
