"""One contract for every folder dcp-lens writes (`run`, `train`, `experiment`, `validate`,
`report` and the API's ``results.save`` / ``results.report``).

- A command writes a folder that is new (or empty), or a folder of its own kind: one holding the
  manifest `MANIFEST` a command of that kind wrote (or, for folders of an earlier version, the
  files that kind writes). Any other folder is refused with a message naming what is in it.
- The manifest lists the files the command wrote. Replacing a folder (``--overwrite``, a
  restart, a rewrite) removes those files only; files a user put into the folder (notes,
  figures) are kept, across an ``--overwrite`` swap included.
- The lock (`dcp_lens.utils.locks.FolderLock`) is taken before the folder is judged, and the
  judgement (new, finished, unfinished) is made again under it: two commands into one folder,
  started at any offset, never both write it.
- A symbolic link given as the folder is followed: the folder written is the one it points to,
  and the link stays a link.
- A report written to a file (``report --out d/r.html``) carries its assets inline and touches
  no other file (`report_target`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal

from dcp_lens.utils.errors import ConfigError
from dcp_lens.utils.files import (
    MARKER,
    REPLACING,
    check_new_file,
    check_output_folder,
    fsync_folder,
    swap_folders,
    write_text_atomically,
)
from dcp_lens.utils.locks import LOCK_FILE, FolderLock

MANIFEST = ".dcp-lens.json"
CHECKPOINTS = ".checkpoints"  # a run's --resume snapshots, inside its folder until it finishes
OnFinished = Literal["refuse", "continue", "replace"]
Action = Literal["new", "continue", "restart", "replace"]

# What a folder of each kind held before folders carried a manifest: the top-level names that
# identify it (any one) and the top-level names that are the command's own. A subfolder holding
# a results.json is a run's too (one per model).
LEGACY: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "run": (
        ("results.json", MARKER, CHECKPOINTS),
        ("results.json", "report.html", "report_data.json", "plotly.min.js", MARKER, CHECKPOINTS),
    ),
    "results": (
        ("decomposition.csv",),
        (
            "results.json",
            "decomposition.csv",
            "curves.csv",
            "shares.csv",
            "report.html",
            "plotly.min.js",
        ),
    ),  # fmt: skip
    "train": (
        ("train_config.json",),
        (
            "train_config.json",
            "checkpoint",
            "checkpoint.old",
            "checkpoint.tmp",
            "history.json",
            "model",
            "accuracy_table.json",
        ),
    ),  # fmt: skip
    "experiment": (
        ("intervention.json", "runs"),
        ("intervention.json", "intervention.md", "intervention.html", "plotly.min.js", "runs"),
    ),
    "validate": (("validation.json",), ("validation.json", "validation.md")),
    "report": (("report.html",), ("report.html", "plotly.min.js")),
}
RESERVED = (LOCK_FILE, MANIFEST)  # top-level names the contract itself keeps


@dataclass
class Contents:
    """What a folder holds, judged for a command of ``kind``: ``own`` the files (relative
    paths) its commands wrote, ``foreign`` everything else; ``finished`` when the last command
    into it finished."""

    kind: str
    finished: bool
    own: list[str]
    foreign: list[str]


@dataclass
class OutputFolder:
    """The folder ``path`` as ``kind``'s output (``flag`` names it in messages).

    ``on_finished``: what a finished folder of this kind means without ``overwrite`` or
    ``resume``: ``"refuse"`` (a run), ``"continue"`` (training resumes; a report adds itself),
    ``"replace"`` (validate rewrites its own files). ``accepts``: further kinds whose folders
    this command may add its files to (a report inside a ``results.save`` folder).

    `plan` judges the folder without writing; `open` locks it, judges it again under the lock
    and prepares it; `finish` records the files written and releases the lock; `close` releases
    it without recording (a failure)."""

    path: Path
    kind: str
    flag: str = "--out"
    overwrite: bool = False
    resume: bool = False
    on_finished: OnFinished = "refuse"
    accepts: tuple[str, ...] = ()
    work: Path | None = None
    action: Action | None = None
    contents: Contents | None = None
    _locks: list[FolderLock] = field(default_factory=list)
    _created: bool = False

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite exclude each other; pass one.")

    @property
    def real(self) -> Path:
        """The folder written: ``path`` with symbolic links followed."""
        return Path(os.path.realpath(self.path))

    def inspect(self) -> Contents | None:
        """What the folder holds (None: it does not exist or is empty); refused with a
        `ConfigError` naming what is there if it is not this command's kind."""
        check_output_folder(self.path, self.flag)
        real = self.real
        if not real.is_dir() or not [p for p in real.iterdir() if p.name not in RESERVED]:
            if (real / MANIFEST).is_file():
                return Contents(self.kind, False, [], [])
            return None
        manifest = _read_manifest(real)
        files = files_in(real)
        if manifest is None:
            legacy = self._legacy(real, files)
            if legacy is None:
                raise ConfigError(
                    f"{self.flag} {self.path} holds files dcp-lens did not write "
                    f"({_names(files)}); pass a new or empty folder, so that nothing in it is "
                    "overwritten."
                )
            return legacy
        kind = manifest.kind
        if kind != self.kind and kind not in self.accepts:
            raise ConfigError(
                f"{self.flag} {self.path} is the folder of a dcp-lens {kind} command "
                f"({_names(files)}), not of {self.kind}; pass another folder."
            )
        finished = manifest.finished and not (real / MARKER).exists()
        if manifest.finished:
            own = [f for f in files if f in set(manifest.files)]
        else:
            kept = set(manifest.kept)
            own = [f for f in files if f not in kept]
        own_set = set(own)
        return Contents(str(kind), finished, own, [f for f in files if f not in own_set])

    def plan(self) -> Action:
        """What writing the folder means now: ``"new"``, ``"continue"`` (keep its files),
        ``"restart"`` (an unfinished folder started again: its own files go) or ``"replace"``
        (a finished one replaced: its own files go). Writes nothing; refuses a folder of
        another kind, and a finished one the command may not replace."""
        contents = self.contents = self.inspect()
        if contents is None:
            return "new"
        if not contents.finished:
            return "continue" if self.resume else "restart"
        if self.resume:
            return "continue"
        if self.overwrite:
            return "replace"
        if self.on_finished == "refuse":
            raise ConfigError(
                f"{self.flag} {self.path} holds a finished {self.kind}; pass --overwrite to "
                "replace it (files you added are kept) or choose another folder."
            )
        return self.on_finished

    def open(self, *, staged: bool = False) -> Path:
        """Lock the folder (created if needed) and judge it again under the lock; returns the
        folder to write in, which `prepare` makes ready. ``staged``: a finished folder being
        replaced is written in a sibling that `finish` swaps in (a kill before leaves the old
        folder whole); else its own files are removed by `prepare`."""
        real = self.real
        check_output_folder(self.path, self.flag)
        try:
            real.mkdir(parents=True)
            self._created = True  # by this command: atomic, so no other command's folder
        except FileExistsError:
            self._created = False
        try:
            self._locks.append(FolderLock(real, self.flag).acquire())
        except BaseException:
            if self._created and not any(real.iterdir()):
                real.rmdir()
            raise
        try:
            self.action = self.plan()
            self.work = real
            if self.action == "replace" and staged:
                work = real.with_name(f".{real.name}{REPLACING}")
                self._locks.append(FolderLock(work, self.flag).acquire())
                for child in work.iterdir():  # a replacement a kill interrupted
                    if child.name != LOCK_FILE:
                        _remove(child)
                self.work = work
        except BaseException:
            self.close(abandon=True)
            raise
        return self.work

    def prepare(self) -> Path:
        """Make the opened folder ready to write: its own files removed when it is restarted
        or replaced in place, the manifest saying a command is writing it (a finished folder
        continued stays finished until `finish`). Returns the folder to write in."""
        assert self.work is not None, "open the folder first"
        foreign = self.contents.foreign if self.contents is not None else []
        if self.work != self.real:
            self._write_manifest(self.work, finished=False, kept=[])
            return self.work
        if self.action in ("restart", "replace") and self.contents is not None:
            remove_files(self.work, self.contents.own)
        finished = self.action == "continue" and bool(self.contents and self.contents.finished)
        own = self.contents.own if finished and self.contents is not None else []
        self._write_manifest(self.work, finished=finished, kept=foreign, files=own)
        return self.work

    def finish(self) -> Path:
        """Record the files written as the command's own, mark the folder finished, swap a
        staged replacement in (the user's files brought along), release the locks. Returns
        the folder (``path``)."""
        assert self.work is not None, "open the folder first"
        real = self.real
        try:
            if self.work != real:
                foreign = self.contents.foreign if self.contents is not None else []
                _link_into(real, self.work, foreign)
                own = [f for f in files_in(self.work) if f not in set(foreign)]
                self._write_manifest(self.work, finished=True, files=own, kept=foreign)
                old_own = self.contents.own if self.contents is not None else []
                swap_folders(self.work, real, _rescue_foreign(old_own))
            else:
                manifest = _read_manifest(real)
                kept = set(manifest.kept if manifest is not None else ())
                own = [f for f in files_in(real) if f not in kept]
                self._write_manifest(real, finished=True, files=own, kept=sorted(kept))
        finally:
            self.close()
        return self.path

    def close(self, *, abandon: bool = False) -> None:
        """Release the locks. ``abandon``: the command failed and leaves nothing to continue:
        a staged replacement goes, and so does the folder itself if this command created it."""
        real = self.real
        for lock in reversed(self._locks):
            lock.release(remove=abandon)
        self._locks.clear()
        if abandon and self.work is not None and self.work != real:
            shutil.rmtree(self.work, ignore_errors=True)
        if abandon and self._created and real.is_dir():
            shutil.rmtree(real, ignore_errors=True)

    def _legacy(self, real: Path, files: list[str]) -> Contents | None:
        for kind in (self.kind, *self.accepts):
            if kind not in LEGACY:
                continue
            signature, owned = LEGACY[kind]
            tops = {f.split("/", 1)[0] for f in files}
            if not tops & set(signature):
                continue
            runs = {t for t in tops if kind == "run" and (real / t / "results.json").is_file()}
            own = [f for f in files if f.split("/", 1)[0] in {*owned, *runs}]
            finished = (real / "results.json").is_file() if kind in ("run", "results") else True
            finished = finished and not (real / MARKER).exists()
            return Contents(kind, finished, own, [f for f in files if f not in set(own)])
        return None

    def _write_manifest(
        self, folder: Path, *, finished: bool, kept: Sequence[str], files: Sequence[str] = ()
    ) -> None:
        kind = self.contents.kind if self.contents is not None else self.kind
        document = {
            "kind": kind, "finished": finished, "files": sorted(files), "kept": sorted(kept),
            "note": "the files dcp-lens wrote here; replacing this folder removes those only",
        }  # fmt: skip
        write_text_atomically(folder / MANIFEST, json.dumps(document, indent=1) + "\n")

    def __enter__(self) -> Path:
        self.open()
        return self.prepare()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if error is None:
            self.finish()
        else:
            self.close(abandon=self.action == "new")


def files_in(folder: Path) -> list[str]:
    """Every file and link under ``folder`` as a relative POSIX path, sorted; links are not
    followed, the contract's own top-level files are left out."""
    found: list[str] = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        base = Path(root).relative_to(folder)
        links = [d for d in dirs if (Path(root) / d).is_symlink()]
        for name in [*files, *links]:
            relative = (base / name).as_posix()
            if relative not in RESERVED:
                found.append(relative)
        empty = [d for d in dirs if d not in links and not os.listdir(Path(root) / d)]
        found += [(base / d).as_posix() + "/" for d in empty]
    return sorted(found)


def remove_files(folder: Path, relative: Iterable[str]) -> None:
    """Remove the files ``relative`` (paths under ``folder``), then the folders they leave
    empty; nothing else."""
    parents: set[Path] = set()
    for name in relative:
        path = folder / name.rstrip("/")
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir() and not os.listdir(path):
            path.rmdir()
        elif path.exists() and not path.is_dir():
            path.unlink()  # a FIFO or socket a command made
        parents.update(p for p in path.parents if folder in p.parents)
    for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
        if parent.is_dir() and not parent.is_symlink() and not os.listdir(parent):
            parent.rmdir()
    fsync_folder(folder)


def _link_into(old: Path, new: Path, relative: Iterable[str]) -> None:
    """Hard-link (else copy) the files ``relative`` of ``old`` into ``new``: the user's files
    of a folder being replaced, so that they are in the folder whichever name it has."""
    for name in relative:
        source, target = old / name.rstrip("/"), new / name.rstrip("/")
        if target.exists() or target.is_symlink():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(source), target)
        elif source.is_dir():
            target.mkdir(exist_ok=True)
        else:
            try:
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)


def _rescue_foreign(old_own: Sequence[str]) -> Callable[[Path, Path], None]:
    """After a swap: move the files a user added to the old folder while it was being
    replaced (neither the old command's nor linked already) into the new one."""
    own = set(old_own)

    def rescue(parked: Path, placed: Path) -> None:
        for name in files_in(parked):
            target = placed / name.rstrip("/")
            if name in own or target.exists() or target.is_symlink() or name.endswith("/"):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(parked / name, target)

    return rescue


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


@dataclass(frozen=True)
class Manifest:
    """A folder's `MANIFEST`: the kind of command that wrote it, whether it finished, the files
    it wrote and the files it found there and kept."""

    kind: str
    finished: bool
    files: list[str]
    kept: list[str]


def _read_manifest(folder: Path) -> Manifest | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"{path} (the list of files dcp-lens wrote in {folder}) is damaged ({error}); "
            "remove the folder or pass another one."
        ) from error
    if not isinstance(document, dict) or not isinstance(document.get("kind"), str):
        raise ConfigError(
            f"{path} is not a dcp-lens manifest (expected a JSON object with a 'kind'); remove "
            "it or pass another folder."
        )
    for key in ("files", "kept"):
        value = document.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path}: {key!r} must be a list of file names; remove it.")
    return Manifest(
        document["kind"],
        bool(document.get("finished")),
        document.get("files", []),
        document.get("kept", []),
    )


def _names(files: Sequence[str], shown: int = 4) -> str:
    if not files:
        return "nothing"
    more = f" and {len(files) - shown} more" if len(files) > shown else ""
    return ", ".join(files[:shown]) + more


# ----------------------------------------------------------------------------- reports


@dataclass(frozen=True)
class ReportTarget:
    """Where a report goes: ``file`` the report's path; ``folder`` the `OutputFolder` to
    write it in (None: a lone file, with its assets inlined)."""

    file: Path
    folder: OutputFolder | None

    def write_page(self, page: str) -> Path:
        """Write a lone page (``folder`` None) to ``file``, its folder made if missing."""
        self.file.parent.mkdir(parents=True, exist_ok=True)
        return write_text_atomically(self.file, page)


def report_target(path: str | Path, source: str | Path | None = None) -> ReportTarget:
    """Check where a report is to be written, before anything is: a ``.html`` file (a new
    one, or a report dcp-lens wrote; plotly.js goes inside it, no other file is touched) or
    a folder (``source``, the run folder the report is made from; else a new folder, a report
    folder or a ``results.save`` folder), which gets ``report.html`` and ``plotly.min.js``."""
    path = Path(path)
    if path.is_dir() or (not path.exists() and not path.suffix):
        if source is not None and path.resolve() == Path(source).resolve():
            folder = OutputFolder(path, "run", on_finished="continue", accepts=("results",))
        else:
            folder = OutputFolder(path, "report", on_finished="continue", accepts=("results",))
        folder.plan()
        report = path / "report.html"
        listed = (folder.real / MANIFEST).is_file() and folder.contents is not None
        own = folder.contents.own if listed and folder.contents is not None else []
        if report.exists() and "report.html" not in own and not is_report(report):
            raise ConfigError(
                f"--out {report} exists and is not a report dcp-lens wrote; pass another folder."
            )
        return ReportTarget(report, folder)
    check_new_file(path, ".html", "--out")
    if path.exists() and not is_report(path):
        raise ConfigError(
            f"--out {path} exists and is not a report dcp-lens wrote; pass a new .html path or "
            "a folder (its report.html is replaced)."
        )
    return ReportTarget(path, None)


def is_report(path: Path) -> bool:
    """Does ``path`` hold a report dcp-lens wrote (an HTML page naming dcp-lens at its top)?"""
    try:
        with path.open("rb") as file:
            head = file.read(4096).lower()
    except OSError:
        return False
    return b"<html" in head and (b"dcp-lens" in head or b"<title>dcp report" in head)


__all__ = [
    "CHECKPOINTS",
    "LEGACY",
    "MANIFEST",
    "Contents",
    "OutputFolder",
    "ReportTarget",
    "files_in",
    "is_report",
    "remove_files",
    "report_target",
]
