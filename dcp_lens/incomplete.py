"""An explicit marker on an output folder whose run has not finished.

``dcp-lens run`` writes each model's results as it goes; a run killed after its first model
would leave ``DIR/default/results.json`` valid while the rest is missing. So the folder carries
``INCOMPLETE`` from the start of the run until its last file is written, and `check_complete`
(called by `dcp_lens.decomposition.read_results_json`, hence `ProtocolResults.load`) refuses to
read results from a marked folder or from a folder inside one.
"""

from __future__ import annotations

from pathlib import Path

from dcp_lens.errors import IncompleteRunError

MARKER = "INCOMPLETE"


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


__all__ = ["MARKER", "check_complete", "mark_complete", "mark_incomplete"]
