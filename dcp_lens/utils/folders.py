"""One contract for every folder dcp-lens writes (`run`, `train`, `experiment`, `validate`,
`report` and the API's ``results.save`` / ``results.report``).

- A command writes a folder that is new (or empty), or a folder of its own kind: one holding the
  manifest `MANIFEST` (or the journal `dcp_lens.utils.ownership.JOURNAL`) a command of that kind
  wrote. Any other folder is refused with a message naming what is in it; a file of the
  manifest's name that is not a manifest is never overwritten.
- A file is the command's own only by proof: the command recorded its name and identity in the
  journal before the file appeared (`dcp_lens.utils.ownership`), and the file still has that
  identity. Everything else in the folder is the user's: files there before, files added while
  a command writes the folder or after it was interrupted, files put in place of the command's.
  Replacing a folder (``--overwrite``, a restart, a rewrite) removes the command's own files
  only, the user's are kept (across an ``--overwrite`` swap included) and named in a note.
- The command's temporary files carry its token (recorded first in the journal), so a folder
  interrupted at any write, the first included, is resumed or replaced like any other.
- The lock (`dcp_lens.utils.locks.FolderLock`) is taken before the folder is judged, and the
  judgement (new, finished, unfinished) is made again under it: two commands into one folder,
  started at any offset, never both write it.
- A symbolic link given as the folder is followed: the folder written is the one it points to,
  and the link stays a link.
- A report written to a file (``report --out d/r.html``) keeps its assets in a folder of its own
  beside it, whose manifest records the page too (`report_target`).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal

from dcp_lens.utils import ownership
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
from dcp_lens.utils.ownership import JOURNAL, Record

MANIFEST = ".dcp-lens.json"
FORMAT = "dcp-lens output folder"  # the manifest's "format": what tells it from other JSON
CHECKPOINTS = ".checkpoints"  # a run's --resume snapshots, inside its folder until it finishes
OnFinished = Literal["refuse", "continue", "replace"]
Action = Literal["new", "continue", "restart", "replace"]
RESERVED = (LOCK_FILE, MANIFEST, JOURNAL)  # top-level names the contract itself keeps


@dataclass
class Contents:
    """What a folder holds, judged for a command of ``kind``: ``own`` the files (relative
    paths) its commands wrote and recorded, ``foreign`` everything else (the user's);
    ``finished`` when the last command into it finished; ``record`` the proof read."""

    kind: str
    finished: bool
    own: list[str]
    foreign: list[str]
    record: Record = field(default_factory=Record)


@dataclass
class OutputFolder:
    """The folder ``path`` as ``kind``'s output (``flag`` names it in messages).

    ``on_finished``: what a finished folder of this kind means without ``overwrite`` or
    ``resume``: ``"refuse"`` (a run), ``"continue"`` (training resumes; a report adds itself),
    ``"replace"`` (validate rewrites its own files). ``accepts``: further kinds whose folders
    this command may add its files to (a report inside a ``results.save`` folder). ``claims``:
    files beside the folder that the command writes and records as its own too (the page of a
    report written to a file, whose folder holds its assets). ``nests``: kinds of folder the
    command writes below this one (an experiment's training runs): the files such a folder's
    own manifest or journal proves its are not the user's. ``adds``: a folder that dcp-lens
    did not write is accepted, the command only adding files of names not there (a report of
    a results folder made by hand, into it); its files stay the user's.

    `plan` judges the folder without writing; `open` locks it, judges it again under the lock;
    `prepare` starts the journal and removes what a restart replaces; `finish` records the files
    written in the manifest and releases the lock; `close` releases it without recording (a
    failure)."""

    path: Path
    kind: str
    flag: str = "--out"
    overwrite: bool = False
    resume: bool = False
    on_finished: OnFinished = "refuse"
    accepts: tuple[str, ...] = ()
    claims: tuple[Path, ...] = ()
    nests: tuple[str, ...] = ()
    adds: bool = False
    work: Path | None = None
    action: Action | None = None
    contents: Contents | None = None
    _locks: list[FolderLock] = field(default_factory=list)
    _journal: ownership.Journal | None = None
    _token: str | None = None
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
        """What the folder holds (None: it does not exist, or holds nothing but an empty
        journal or lock); refused with a `ConfigError` naming what is there if it is not this
        command's kind."""
        check_output_folder(self.path, self.flag)
        real = self.real
        if not real.is_dir():
            return None
        manifest, journal = _read_manifest(real), ownership.read_journal(real)
        files = files_in(real)
        kinds = [*([manifest.kind] if manifest else []), *(journal.kinds if journal else [])]
        if not kinds and journal is not None:  # a command killed as its journal began
            kinds = [self.kind]
        if not kinds:
            nested = _nested_own(real, files, self.nests)
            users = [f for f in files if f not in nested]
            if users and not self.adds:
                writer = "a report" if self.kind == REPORT_FILE_KIND else "dcp-lens"
                raise ConfigError(
                    f"{self.flag} {self.path} holds files {writer} did not write "
                    f"({_names(users)}); pass a new or empty folder, so that nothing in it is "
                    "overwritten."
                )
            return None
        kind = kinds[0]
        if kind != self.kind and kind not in self.accepts:
            raise ConfigError(
                f"{self.flag} {self.path} is the folder of a dcp-lens {kind} command "
                f"({_names(files)}), not of {self.kind}; pass another folder."
            )
        record = (manifest.record if manifest else Record()).merge(journal or Record())
        finished = bool(manifest and manifest.finished) and not (real / MARKER).exists()
        own = [f for f in files if record.owns(real, f)]
        own_set = set(own)
        foreign = [f for f in files if f not in own_set]
        return Contents(kind, finished, own, foreign, record)

    def plan(self) -> Action:
        """What writing the folder means now: ``"new"``, ``"continue"`` (keep its files),
        ``"restart"`` (an unfinished folder started again: its own files go) or ``"replace"``
        (a finished one replaced: its own files go). Writes nothing; refuses a folder of
        another kind, and a finished one the command may not replace."""
        contents = self.contents = self.inspect()
        if contents is None:
            return "new"
        if not contents.finished:
            action: Action = "continue" if self.resume else "restart"
        elif self.resume:
            action = "continue"
        elif self.overwrite:
            action = "replace"
        elif self.on_finished == "refuse":
            raise ConfigError(
                f"{self.flag} {self.path} holds a finished {self.kind}; pass --overwrite to "
                "replace it (files you added are kept) or choose another folder."
            )
        else:
            action = self.on_finished
        if action in ("restart", "replace"):
            _refuse_changed(self, contents)
        return action

    def open(self, *, staged: bool = False) -> Path:
        """Lock the folder (created if needed) and judge it again under the lock; returns the
        folder to write in, which `prepare` makes ready. ``staged``: a finished folder being
        replaced is written in a new sibling that `finish` swaps in (a kill before leaves the
        old folder whole); else its own files are removed by `prepare`."""
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
                _clear_staged(real)  # replacements a kill interrupted
                self._token = ownership.new_token()  # the sibling's name: its journal's token
                self.work = real.with_name(f".{real.name}{REPLACING}.{self._token}")
                self.work.mkdir()  # a new name, made here: no other folder is written
                self._locks.append(FolderLock(self.work, self.flag).acquire())
        except BaseException:
            self.close(abandon=True)
            raise
        return self.work

    def prepare(self) -> Path:
        """Make the opened folder ready to write: the journal started (every file written from
        here on is recorded), the command's own files removed when it is restarted or replaced
        in place (temporary files a kill left, always), the manifest saying a command is
        writing it (a finished folder continued stays finished until `finish`). Returns the
        folder to write in."""
        assert self.work is not None, "open the folder first"
        kind = self.contents.kind if self.contents is not None else self.kind
        self._journal = ownership.begin(self.work, kind, self.claims, self._token)
        self._record_own_lock()
        contents = self.contents or Contents(kind, False, [], [])
        replaced = self.action in ("restart", "replace")
        if replaced and contents.foreign:
            kept = _names(contents.foreign)
            _note(f"kept in {self.path} the files dcp-lens did not write: {kept}")
        if self.work != self.real:
            self._write_manifest(self.work, finished=False, record=Record())
            return self.work
        temporary = [  # temporary files, and the files in temporary folders
            f for f in contents.own if any(ownership.TEMPORARY.match(p) for p in f.split("/"))
        ]
        for claim in self.claims:  # a claimed file's temporary files, beside the folder
            for path in claim.parent.glob(f".{glob.escape(claim.name[:60])}.*.tmp"):
                name = Path(os.path.relpath(path.absolute(), self.work)).as_posix()
                if contents.record.owns(self.work, name):
                    path.unlink()
        remove_files(self.work, contents.own if replaced else temporary)
        finished = self.action == "continue" and contents.finished
        self._write_manifest(self.work, finished=finished, record=contents.record)
        return self.work

    def adopt(self, folder: Path) -> None:
        """Record as this command's own what a command in another process (a training worker)
        wrote into ``folder``, a folder below this one: the files its own manifest proves
        its, and that manifest."""
        assert self._journal is not None, "prepare the folder first"
        manifest, journal = _read_manifest(folder), ownership.read_journal(folder)
        if manifest is None:
            return
        record = manifest.record.merge(journal or Record())
        for name in [*files_in(folder), LOCK_FILE, MANIFEST]:
            if name == MANIFEST or record.owns(folder, name):
                self._journal.record(folder / name, whole=name != LOCK_FILE)

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
                self._seal(self.work)
                old_own = self.contents.own if self.contents is not None else []
                swap_folders(self.work, real, _rescue_foreign(old_own))
            else:
                self._seal(real)
        finally:
            self.close()
        return self.path

    def close(self, *, abandon: bool = False) -> None:
        """Release the locks. ``abandon``: the command failed and leaves nothing to continue:
        a staged replacement goes, and so does the folder itself if this command created it
        (its own files; a user's files added meanwhile stay, with the folder)."""
        real = self.real
        if self._journal is not None:
            ownership.end(self._journal)
            self._journal = None
        if abandon and self.work is not None and self.work != real:
            _discard(self.work)
        if abandon and self._created and real.is_dir():
            _discard(real)
        for lock in reversed(self._locks):
            lock.release(remove=abandon)
        self._locks.clear()
        if abandon and self._created and real.is_dir() and not any(real.iterdir()):
            real.rmdir()

    def _record_own_lock(self) -> None:
        lock = next((lock for lock in self._locks if lock.folder == self.work), None)
        if lock is not None and lock.created:
            ownership.record_write(lock.path, lock.path, whole=False)

    def _seal(self, folder: Path) -> None:
        """The manifest of ``folder`` made final (finished, its own files with their
        identities), then its journal removed."""
        manifest, journal = _read_manifest(folder), ownership.read_journal(folder)
        record = (manifest.record if manifest else Record()).merge(journal or Record())
        self._write_manifest(folder, finished=True, record=record)
        if self._journal is not None:
            ownership.end(self._journal)
            self._journal = None
        (folder / JOURNAL).unlink(missing_ok=True)
        fsync_folder(folder)

    def _write_manifest(self, folder: Path, *, finished: bool, record: Record) -> None:
        kind = self.contents.kind if self.contents is not None else self.kind
        tokens = sorted(record.tokens | ({self._journal.token} if self._journal else set()))
        files = {}
        for name in files_in(folder):
            if record.owns(folder, name):
                files[name] = record.current(folder, name)
        if record.owns(folder, LOCK_FILE):
            files[LOCK_FILE] = [os.lstat(folder / LOCK_FILE).st_ino]
        for claim in self.claims:
            name = Path(os.path.relpath(claim.absolute(), folder)).as_posix()
            if record.owns(folder, name):
                files[name] = record.current(folder, name)
        document = {
            "format": FORMAT,
            "kind": kind,
            "finished": finished,
            "files": files,
            "tokens": tokens,
            "note": "the files dcp-lens wrote here; replacing this folder removes those only",
        }
        write_text_atomically(folder / MANIFEST, json.dumps(document, indent=1) + "\n")

    def __enter__(self) -> Path:
        self.open()
        try:
            return self.prepare()
        except BaseException:
            self.close(abandon=self.action == "new")
            raise

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


def _refuse_changed(folder: OutputFolder, contents: Contents) -> None:
    """Refuse to restart or replace a folder in which a file the command wrote was changed or
    put in place of (it is the user's now, and the command would write that name again)."""
    changed = [
        name
        for name in contents.foreign
        if any(len(recorded) > 1 for recorded in contents.record.files.get(name, ()))
    ]
    if changed:
        raise ConfigError(
            f"{folder.flag} {folder.path}: {_names(changed)} were written by dcp-lens and have "
            "been changed or replaced since, so they are yours now and writing the folder would "
            "overwrite them; move them away (or rename them) and rerun."
        )


def _nested_own(real: Path, files: Sequence[str], kinds: tuple[str, ...]) -> set[str]:
    """The files (relative to ``real``) that a folder below ``real`` written by a command of
    one of ``kinds`` proves its own by its manifest or journal: those it recorded and still
    have their identity, its temporary files, and the manifest and journal themselves."""
    if not kinds:
        return set()
    nested: set[str] = set()
    folders = {f.rsplit("/", 1)[0] for f in files if f.rsplit("/", 1)[-1] in (MANIFEST, JOURNAL)}
    for name in sorted(folders):
        below = real / name
        if below.is_symlink() or not below.is_dir():
            continue
        try:
            record = _record_of(below)
        except ConfigError:
            continue  # not a manifest or journal: nothing proven
        if not record.kinds or not set(record.kinds) <= set(kinds):
            continue
        prefix = name + "/"
        for file in files:
            if not file.startswith(prefix):
                continue
            inner = file[len(prefix) :]
            if inner in (MANIFEST, JOURNAL) or record.owns(below, inner):
                nested.add(file)
    return nested


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
        parents.update(p for p in path.parents if folder in p.parents)
    for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
        if parent.is_dir() and not parent.is_symlink() and not os.listdir(parent):
            parent.rmdir()
    fsync_folder(folder)


def rename_folder(root: Path, source: Path, target: Path) -> None:
    """Rename the folder ``source`` to ``target`` (a new name, or an empty folder), both inside
    ``root``, the folder a command is writing: the files in it that ``root``'s manifest and
    journal prove the command's own are recorded under their new names first, so they stay its
    own; the others stay the user's."""
    record = _record_of(root)
    prefix = Path(os.path.realpath(source)).relative_to(os.path.realpath(root)).as_posix()
    for name in files_in(source):
        if record.owns(root, f"{prefix}/{name}"):
            ownership.record_write(target / name, source / name)
    os.rename(source, target)


def remove_own_files(root: Path, path: Path, *, others_to: Path | None = None) -> None:
    """Remove the files below the folder ``path`` that the manifest and journal of ``root``
    (the folder a command is writing, ``path`` inside it) prove the command's own, then the
    folders left empty, ``path`` included. The other files (a user's) stay; with
    ``others_to`` they move to the same place below that folder, where no file has the name."""
    if path.is_symlink() or not path.is_dir():
        return
    record = _record_of(root)
    prefix = Path(os.path.realpath(path)).relative_to(os.path.realpath(root)).as_posix()
    own: list[str] = []
    others: list[str] = []
    for name in files_in(path):
        (own if record.owns(root, f"{prefix}/{name}") else others).append(name)
    for name in others:
        target = others_to / name if others_to is not None else None
        if target is not None and not name.endswith("/") and not os.path.lexists(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path / name, target)
    remove_files(path, own)
    if not os.listdir(path):
        path.rmdir()


def _discard(folder: Path) -> None:
    """Remove what a command wrote into ``folder`` (its own files by its journal, the folders
    left empty, its manifest, journal and lock), then the folder if nothing else is left."""
    try:
        record = _record_of(folder)
    except ConfigError:
        return  # not provably ours: left as it is
    remove_files(folder, [f for f in files_in(folder) if record.owns(folder, f)])
    for root, dirs, _ in os.walk(folder, topdown=False):
        for name in dirs:
            path = Path(root, name)
            if not path.is_symlink() and not os.listdir(path):
                path.rmdir()
    if not files_in(folder):
        for name in (MANIFEST, JOURNAL):
            (folder / name).unlink(missing_ok=True)
        if [p.name for p in folder.iterdir()] in ([], [LOCK_FILE]):
            shutil.rmtree(folder, ignore_errors=True)  # the lock, then the folder


def _record_of(folder: Path) -> Record:
    """The proof ``folder``'s manifest and journal hold together."""
    manifest, journal = _read_manifest(folder), ownership.read_journal(folder)
    return (manifest.record if manifest else Record()).merge(journal or Record())


def _clear_staged(real: Path) -> None:
    """Finish what a kill left beside ``real`` of an ``--overwrite``: a replacement folder
    ``.NAME.replacing.TOKEN`` whose journal holds that token (killed before the swap: its own
    files go), or the old folder parked under that name, whose token the new folder in place
    records (killed after the swap: the user's files in it move to ``real``, the rest goes)."""
    prefix = f".{real.name}{REPLACING}."
    placed = _record_of(real).tokens
    for sibling in real.parent.iterdir():
        token = sibling.name.removeprefix(prefix)
        if not sibling.name.startswith(prefix) or sibling.is_symlink() or not sibling.is_dir():
            continue
        try:
            record = _record_of(sibling)
        except ConfigError:
            continue
        if token in placed:
            own = [f for f in files_in(sibling) if record.owns(sibling, f)]
            _rescue_foreign(own)(sibling, real)
            shutil.rmtree(sibling, ignore_errors=True)
        elif token in record.tokens or set(os.listdir(sibling)) <= {LOCK_FILE, JOURNAL}:
            _discard(sibling)


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
    """After a swap: move the files a user added to (or changed in) the old folder while it
    was being replaced (not the old command's own) into the new one, in place of the links
    made before; one whose name the new folder's own file has is kept as ``NAME.yours``."""
    own = set(old_own)

    def rescue(parked: Path, placed: Path) -> None:
        manifest = _read_manifest(placed)
        new_own = manifest.record if manifest is not None else Record()
        for name in files_in(parked):
            if name in own or name.endswith("/"):
                continue
            source, target = parked / name, placed / name
            if os.path.lexists(target):
                if not source.is_symlink() and os.path.samefile(source, target):
                    continue  # linked before the swap, unchanged since
                if new_own.owns(placed, name):
                    target = target.with_name(target.name + ".yours")
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, target)

    return rescue


def _note(text: str) -> None:
    print(f"dcp-lens: {text}", file=sys.stderr)


@dataclass(frozen=True)
class Manifest:
    """A folder's `MANIFEST`: the kind of command that wrote it, whether it finished, and the
    proof of its own files (`Record`)."""

    kind: str
    finished: bool
    record: Record


def _read_manifest(folder: Path) -> Manifest | None:
    path = folder / MANIFEST
    if not os.path.lexists(path):
        return None
    refusal = (
        f"{path} is not a manifest of dcp-lens (the list of files it wrote in {folder}), so "
        f"{folder} holds files dcp-lens did not write; pass another folder (that file is left "
        "as it is)."
    )
    if path.is_symlink() or not path.is_file():
        raise ConfigError(refusal)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"{refusal} ({' '.join(str(error).split())[:80]})") from error
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ConfigError(refusal)
    kind, files, tokens = document.get("kind"), document.get("files"), document.get("tokens")
    if (
        not isinstance(kind, str)
        or not isinstance(files, dict)
        or not all(ownership.is_identity(v) for v in files.values())
        or not isinstance(tokens, list)
        or not all(isinstance(t, str) for t in tokens)
    ):
        raise ConfigError(f"{path}: kind, files or tokens are damaged; remove the folder.")
    record = Record([kind], set(tokens), {name: [value] for name, value in files.items()})
    return Manifest(kind, document.get("finished") is True, record)


def _names(files: Sequence[str], shown: int = 4) -> str:
    if not files:
        return "nothing"
    more = f" and {len(files) - shown} more" if len(files) > shown else ""
    return ", ".join(files[:shown]) + more


# ----------------------------------------------------------------------------- reports


@dataclass(frozen=True)
class ReportTarget:
    """Where a report goes: ``file`` the report's path; ``folder`` the `OutputFolder` to
    write it in, or, for a report written to a file of its own, the folder of its assets
    beside it (``<name>_files``), whose manifest records the page too."""

    file: Path
    folder: OutputFolder
    lone: bool = False
    within: str = ""  # the report's folder below ``folder`` (a run's per-model folder)


REPORT_FILE_KIND = "report file"  # the assets folder of a report written to a file


def report_target(path: str | Path, source: str | Path | None = None) -> ReportTarget:
    """Check where a report is to be written, before anything is: a ``.html`` file (a new
    one, or one a report wrote: its assets folder's manifest records it; plotly.js goes into
    that folder, ``<name>_files``, and no other file is touched) or a folder (``source``, the
    run folder the report is made from; else a new folder, a report folder or a
    ``results.save`` folder), which gets ``report.html`` and ``plotly.min.js``."""
    path = Path(path)
    if path.is_dir() or (not path.exists() and not path.suffix):
        within = ""
        if source is not None and path.resolve() == Path(source).resolve():
            run = _run_holding(path)
            if run is not None:  # a run's per-model folder: its run folder's manifest records it
                within = path.resolve().name
                folder = OutputFolder(run, "run", on_finished="continue", accepts=("results",))
            elif _unrecorded(path):  # results made by hand or elsewhere: the report adds its own
                folder = OutputFolder(path, "report", on_finished="continue", adds=True)
            else:
                accepts = ("results", "report")
                folder = OutputFolder(path, "run", on_finished="continue", accepts=accepts)
        else:
            folder = OutputFolder(path, "report", on_finished="continue", accepts=("results",))
        folder.plan()
        own = folder.contents.own if folder.contents is not None else []
        for name in ("report.html", "plotly.min.js"):
            if os.path.lexists(path / name) and f"{within}/{name}".lstrip("/") not in own:
                raise ConfigError(
                    f"--out {path / name} exists and is not a file dcp-lens wrote there (or "
                    "it was changed since, so it is yours); pass another folder."
                )
        return ReportTarget(path / "report.html", folder, within=within)
    check_new_file(path, ".html", "--out")
    assets = path.with_name(path.stem + "_files")
    folder = OutputFolder(assets, REPORT_FILE_KIND, on_finished="replace", claims=(path,))
    folder.plan()
    record = folder.contents.record if folder.contents is not None else Record()
    if os.path.lexists(path) and not record.owns(folder.real, f"../{path.name}"):
        raise ConfigError(
            f"--out {path} exists and is not a report dcp-lens wrote (its assets folder "
            f"{assets} does not record it); pass a new .html path or a folder (its report.html "
            "is replaced)."
        )
    return ReportTarget(path, folder, lone=True)


def _run_holding(path: Path) -> Path | None:
    """The run folder whose manifest records ``path``'s results.json (``path`` one of its
    per-model folders, with no manifest of its own), else None."""
    real = Path(os.path.realpath(path))
    if not _unrecorded(real):
        return None
    try:
        manifest = _read_manifest(real.parent)
    except ConfigError:
        return None
    if manifest is None or manifest.kind != "run":
        return None
    return real.parent if manifest.record.owns(real.parent, f"{real.name}/results.json") else None


def _unrecorded(path: Path) -> bool:
    """Does the folder ``path`` hold neither a manifest nor a journal?"""
    return not any(os.path.lexists(path / name) for name in (MANIFEST, JOURNAL))


__all__ = [
    "CHECKPOINTS",
    "FORMAT",
    "MANIFEST",
    "Contents",
    "OutputFolder",
    "ReportTarget",
    "REPORT_FILE_KIND",
    "files_in",
    "remove_files",
    "remove_own_files",
    "rename_folder",
    "report_target",
]
