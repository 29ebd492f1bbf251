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

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from dcp_lens.utils import ownership
from dcp_lens.utils.errors import ConfigError, IncompleteRunError, ResourceLimitError

MARKER = "INCOMPLETE"
NAME_LIMIT = 80  # characters of a subfolder name made from a model spec
REPLACING = ".replacing"  # suffix of the sibling folder an --overwrite run writes before the swap


def safe_name(text: str) -> str:
    """A file or folder name made from ``text`` (a model spec, a path) that stays where it is
    put: characters other than letters, digits, ``-``, ``_`` and ``.`` become ``_``, leading
    dots too (so ``..``, ``.`` and hidden names cannot occur), at most `NAME_LIMIT` characters
    (the end, which names the model); an empty result is ``"model"``."""
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[-NAME_LIMIT:]
    stripped = name.lstrip(".")
    name = "_" * (len(name) - len(stripped)) + stripped
    return name or "model"


def inside(path: str | Path, folder: str | Path, flag: str = "--out") -> Path:
    """``path`` if it resolves (links followed) to ``folder`` or below it; else a `ConfigError`
    (dcp-lens writes nothing outside the output folder it was given)."""
    path, folder = Path(path), Path(folder)
    resolved, root = path.resolve(), folder.resolve()
    if resolved != root and root not in resolved.parents:
        raise ConfigError(
            f"{path} resolves to {resolved}, outside {flag} {folder}; dcp-lens writes only inside "
            f"{flag}. Pass a model or file name that stays inside it."
        )
    return path


def check_new_file(path: str | Path, suffix: str, flag: str = "--out") -> Path:
    """``path`` as a file a command is about to write: it must end in ``suffix``, and if it
    exists it must be a file that command wrote before (a ``suffix`` file, not a folder);
    its folder is checked as `check_output_folder` checks one."""
    path = Path(path)
    if path.suffix.lower() != suffix:
        raise ConfigError(
            f"{flag} {path} is not a {suffix} file; this command writes a {suffix} file or a "
            f"folder to hold one. Pass a new {suffix} path or a folder."
        )
    if path.exists() and not path.is_file():
        raise ConfigError(f"{flag} {path} exists and is not a file; pass a {suffix} file path.")
    check_output_folder(path.parent, flag)
    return path


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


def swap_folders(
    new: str | Path, old: str | Path, rescue: Callable[[Path, Path], None] | None = None
) -> None:
    """Put the folder ``new`` in the place of ``old`` and remove what ``old`` held: one atomic
    exchange of the two names where the system has one (Linux ``renameat2``), else two renames.
    A kill before the exchange leaves ``old`` as it was; after it, ``new`` in its place.
    ``rescue(parked, placed)``, called before the old files go, moves what must stay (files a
    user added) from the old folder (``parked``) into the new one (``placed``)."""
    new, old = Path(new), Path(old)
    if _exchange(new, old):
        if rescue is not None:
            rescue(new, old)
        shutil.rmtree(new, ignore_errors=True)  # now the old run's files
        fsync_folder(old.parent)
        return
    parked = _park(old)
    os.replace(new, old)
    if rescue is not None:
        rescue(parked, old)
    shutil.rmtree(parked, ignore_errors=True)
    fsync_folder(old.parent)


def _park(folder: Path) -> Path:
    """Rename ``folder`` to a new name of its own beside it (a rename never replaces a folder
    that holds anything, so no other folder of that name is touched); returns the new name."""
    while True:
        parked = folder.with_name(f".{folder.name}.old.{secrets.token_hex(8)}")
        if os.path.lexists(parked):
            continue
        try:
            os.rename(folder, parked)
        except OSError as error:
            if error.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                continue  # taken in between: another name
            raise
        return parked


def _exchange(first: Path, second: Path) -> bool:
    """Atomically exchange the names ``first`` and ``second`` (Linux renameat2 with
    RENAME_EXCHANGE); False where the system or file system cannot."""
    if not hasattr(os, "uname") or os.uname().sysname != "Linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    result = renameat2(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), exchange)
    return bool(result == 0)


def write_text_atomically(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all (`write_bytes_atomically`)."""
    return write_bytes_atomically(path, text.encode("utf-8"))


def write_bytes_atomically(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file of a unique name in the same folder,
    flushed to disk, renamed over ``path``, the folder flushed after the rename: a kill, a power
    loss or a full disk leaves the previous file or the new one, never half of one, and writers
    of the same path at once each leave a whole file. Returns ``path``.

    Raises:
        ResourceLimitError: the disk is full (the message names it and the file).
    """
    with written_atomically(path) as partial:
        with open(partial, "wb") as file:
            file.write(data)
    return Path(path)


@contextlib.contextmanager
def written_atomically(path: str | Path) -> Iterator[Path]:
    """A temporary path in ``path``'s folder for a writer that takes a path (``torch.save``,
    ``safetensors``' ``save_file``, ``DataFrame.to_csv``); when the block ends it is flushed
    to disk and renamed over ``path``, then the folder is flushed. If the block raises, the
    temporary file goes and ``path`` is left as it was. A full disk raises `ResourceLimitError`
    naming the disk and the file."""
    path = Path(path)
    prefix = ownership.temporary_prefix(path)  # a name of the writing command's own
    descriptor, name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    os.close(descriptor)
    partial = Path(name)
    try:
        os.chmod(partial, 0o666 & ~_UMASK)  # as a plain open would make it, not mkstemp's 0600
        yield partial
        _fsync_file(partial)
        ownership.record_write(path, partial)  # the command's own, recorded before it lands
        os.replace(partial, path)
    except BaseException as error:
        partial.unlink(missing_ok=True)
        if is_disk_full(error, path.parent):
            raise disk_full(path, error) from error
        raise
    fsync_folder(path.parent)


def temporary_folder(path: str | Path) -> Path:
    """A new empty folder beside ``path``, of a unique name that marks it as the temporary
    form of ``path`` of the command writing its folder (`dcp_lens.utils.ownership.TEMPORARY`),
    created here (so no other folder is written)."""
    path = Path(path)
    prefix = ownership.temporary_prefix(path)
    return Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=path.parent))


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once, at import: os.umask is process-wide and not thread-safe


def disk_full(path: str | Path, cause: BaseException | None = None) -> ResourceLimitError:
    """The error for a write of ``path`` that ran out of space: it names the file system's
    mount point and the file, and says what to do."""
    path = Path(path)
    mount = _mount_point(path.parent)
    detail = f" ({' '.join(str(cause).split())[:120]})" if cause is not None else ""
    return ResourceLimitError(
        f"no space left on {mount} while writing {path}{detail}; nothing was written in part. "
        "Free space and rerun the command (with --resume where it has one)."
    )


def is_disk_full(error: BaseException, folder: str | Path | None = None) -> bool:
    """Is ``error`` a write that ran out of space: the system's ``ENOSPC`` / ``EDQUOT``, or a
    library's own words for it (safetensors' "No space left", torch's "unexpected pos" of a
    short write, when ``folder``'s disk has under a megabyte free)?"""
    if isinstance(error, OSError) and error.errno in DISK_FULL:
        return True
    text = str(error).lower()
    if "no space left" in text or "storagefull" in text or "disk quota" in text:
        return True
    short_write = "unexpected pos" in text or "failed to write" in text
    return short_write and folder is not None and _free_bytes(Path(folder)) < 1 << 20


@contextlib.contextmanager
def naming_full_disk(path: str | Path) -> Iterator[None]:
    """Within the block, an error that says the disk is full (`is_disk_full`) becomes a
    `ResourceLimitError` naming the disk and ``path`` (a file or folder being written)."""
    try:
        yield
    except Exception as error:
        if is_disk_full(error, Path(path).parent):
            raise disk_full(path, error) from error
        raise


def fsync_folder(folder: str | Path) -> None:
    """Flush ``folder``'s entries (a rename in it) to disk; a no-op where folders cannot be
    opened (Windows)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the rename itself still happened
    finally:
        os.close(descriptor)


def _fsync_file(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _free_bytes(folder: Path) -> int:
    try:
        return int(shutil.disk_usage(folder).free)
    except OSError:
        return 1 << 62


def _mount_point(folder: Path) -> Path:
    """The mount point holding ``folder`` (the nearest existing folder above it that is one)."""
    current = folder.absolute()
    while not current.exists() and current != current.parent:
        current = current.parent
    while not os.path.ismount(current) and current != current.parent:
        current = current.parent
    return current


def mark_incomplete(folder: str | Path, command: str) -> Path:
    """Create ``folder`` if needed and mark it incomplete; returns the marker's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / MARKER
    write_text_atomically(
        marker,
        f"{command} is writing this folder, or was interrupted while writing it: the results "
        "here may be partial. Rerun the command to finish (with --resume: from where it stopped); "
        "it removes this file when done.\n",
    )
    return marker


def mark_complete(folder: str | Path) -> None:
    """Remove the marker: every file of the run is written."""
    (Path(folder) / MARKER).unlink(missing_ok=True)
    fsync_folder(folder)


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
    "check_new_file",
    "check_output_folder",
    "disk_full",
    "fsync_folder",
    "inside",
    "is_disk_full",
    "naming_full_disk",
    "mark_complete",
    "mark_incomplete",
    "safe_name",
    "swap_folders",
    "temporary_folder",
    "write_bytes_atomically",
    "write_text_atomically",
    "written_atomically",
]
