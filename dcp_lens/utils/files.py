"""Output folders: checked before a run (`check_output_folder`), an explicit marker on one
whose run has not finished, and files written whole or not at all (`write_text_atomically`).

``dcp-lens run`` writes each model's results as it goes; a run killed after its first model
would leave ``DIR/default/results.json`` valid while the rest is missing. So the folder carries
``INCOMPLETE`` from the start of the run until its last file is written, and `check_complete`
(called by `dcp_lens.protocol.decomposition.read_results_json`, hence `ProtocolResults.load`)
refuses to
read results from a marked folder or from a folder inside one.
"""

from __future__ import annotations

import os
from pathlib import Path

from dcp_lens.utils.errors import ConfigError, IncompleteRunError

MARKER = "INCOMPLETE"


def check_output_folder(path: str | Path, flag: str = "out") -> Path:
    """``path`` as an output folder, checked before any work: refused if it is a file, if a
    folder above it is a file, or if the folder (or the nearest existing one above) is not
    writable."""
    path = Path(path)
    if not str(path).strip():
        raise ConfigError(f"{flag} is empty; pass an output folder.")
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"{flag} {path} is an existing file, not a folder; pass a folder path (it is "
            "created if needed)."
        )
    existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path}: {existing} is a file; no folder can be made below it.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {existing} is not writable; pass a writable folder.")
    return path


def write_text_atomically(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through ``path.tmp`` and a rename, so that a kill or a
    full disk leaves the previous file or the new one, never half of one. Returns ``path``."""
    path = Path(path)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)
    return path


def mark_incomplete(folder: str | Path, command: str) -> Path:
    """Create ``folder`` if needed and mark it incomplete; returns the marker's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / MARKER
    marker.write_text(
        f"{command} is writing this folder, or was interrupted while writing it: the results "
        "here may be partial. Rerun the command to finish (with --resume: from where it stopped); "
        "it removes this file when done.\n"
    )
    return marker


def mark_complete(folder: str | Path) -> None:
    """Remove the marker: every file of the run is written."""
    (Path(folder) / MARKER).unlink(missing_ok=True)


def check_complete(folder: str | Path) -> None:
    """Raise `IncompleteRunError` if ``folder`` or its parent carries the marker."""
    folder = Path(folder)
    for candidate in (folder, folder.parent):
        marker = candidate / MARKER
        if marker.is_file():
            raise IncompleteRunError(
                f"{candidate} is marked incomplete ({marker}): the run writing it did not finish, "
                "so its results may be partial. Rerun the command that wrote it to finish them."
            )


__all__ = [
    "MARKER",
    "check_complete",
    "check_output_folder",
    "mark_complete",
    "mark_incomplete",
    "write_text_atomically",
]
