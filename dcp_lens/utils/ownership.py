"""What a command wrote into an output folder, recorded before it lands: the proof that a file is
the command's own (`dcp_lens.utils.folders` removes such files only).

While a command writes a folder (`begin` .. `end`), the folder's journal `JOURNAL` holds one JSON
line per event, appended (and flushed to disk) before the event can be seen in the folder:

- ``{"kind": KIND, "token": TOKEN}`` first: the command and a random token of its own. Every
  temporary file the command makes in the folder carries the token in its name
  (`temporary_prefix`), so a temporary file a kill left behind is known as the command's by the
  token, and a file of the same look that a user made is not (the token is not guessable).
- ``{"file": NAME, "id": [INODE, SIZE, MTIME_NS, SHA256]}`` for each file written whole
  (`dcp_lens.utils.files.written_atomically` records it between its last byte and the rename
  that puts it in place), ``{"file": NAME, "id": [INODE]}`` for a file created exclusively and
  then appended to (the lock).

A file is the command's own only if its name was recorded with its identity (`identity`) and it
still has it: a file a user adds, at any time, or puts in place of one of the command's under
the same name, has another inode and is the user's. Events in a folder below another folder
being written are recorded in both journals.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

from dcp_lens.utils.errors import ConfigError

JOURNAL = ".dcp-lens.journal"
TOKEN_CHARACTERS = 16  # hex digits of a command's token
# A temporary file: ``.NAME.TOKEN.RANDOM.tmp`` (RANDOM as `tempfile.mkstemp` makes it).
TEMPORARY = re.compile(r"^\..*\.(?P<token>[0-9a-f]{16})\.[a-z0-9_]+\.tmp$")
_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_PROCESS_TOKEN = secrets.token_hex(TOKEN_CHARACTERS // 2)  # temporary names outside any folder


def new_token() -> str:
    """A command's random token (`TOKEN_CHARACTERS` hex digits)."""
    return secrets.token_hex(TOKEN_CHARACTERS // 2)


def identity(info: os.stat_result, path: Path | None = None) -> list[int | str]:
    """A file's identity as a journal records it: ``[inode, size, mtime_ns, sha256]`` for a
    file written whole (``path`` given: its content is hashed, so that a copy of the folder
    still proves its files), ``[inode]`` for one that is appended to after it is recorded."""
    if path is None:
        return [info.st_ino]
    return [info.st_ino, info.st_size, info.st_mtime_ns, _digest(path)]


def matches(recorded: list[int | str], info: os.stat_result, path: Path) -> bool:
    """Does the file ``path`` (``info`` its lstat) still have the identity ``recorded``: the
    same inode (and size and time), or the same size and content (a copy)?"""
    if not stat.S_ISREG(info.st_mode):
        return False
    if len(recorded) == 1:
        return recorded[0] == info.st_ino
    if recorded[:3] == [info.st_ino, info.st_size, info.st_mtime_ns]:
        return True
    return recorded[1] == info.st_size and recorded[3] == _digest(path)


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()[:32]


@dataclass
class Journal:
    """The open journal of ``folder`` (a resolved path) for a command of ``kind``."""

    folder: Path
    kind: str
    claims: tuple[Path, ...] = ()  # files beside the folder the command writes too (resolved)
    token: str = field(default_factory=new_token)
    _fd: int | None = None

    def name_of(self, path: Path) -> str:
        """``path``'s name in this journal: relative to the folder (``../NAME`` for a claim)."""
        return Path(
            os.path.relpath(Path(os.path.realpath(path.parent)) / path.name, self.folder)
        ).as_posix()

    def append(self, event: dict[str, object]) -> None:
        assert self._fd is not None, "begin the journal first"
        os.write(self._fd, (json.dumps(event, separators=(",", ":")) + "\n").encode())
        os.fsync(self._fd)

    def record(self, path: Path, *, whole: bool = True) -> None:
        """Record the file ``path`` (in the folder, or below it) as this command's own."""
        info = os.lstat(path)
        self.append({"file": self.name_of(path), "id": identity(info, path if whole else None)})


_ACTIVE: list[Journal] = []
_GUARD = threading.Lock()


def begin(
    folder: Path, kind: str, claims: tuple[Path, ...] = (), token: str | None = None
) -> Journal:
    """Open (or continue) ``folder``'s journal for a command of ``kind`` and record the
    command's token; until `end`, the files written into the folder (and the files ``claims``
    beside it) are recorded in it. The journal must be a regular file of one name (a link or
    special file is refused)."""
    claimed = tuple(Path(os.path.realpath(c.parent)) / c.name for c in claims)
    journal = Journal(Path(os.path.realpath(folder)), kind, claimed)
    journal.token = token or journal.token
    path = journal.folder / JOURNAL
    try:
        fd = os.open(path, _FLAGS | os.O_CREAT, 0o644)
    except OSError as error:
        raise _refusal(path, f"cannot be opened as a regular file ({error})") from error
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise _refusal(path, "not a regular file of its own")
    journal._fd = fd
    journal.append({"kind": kind, "token": journal.token})
    record_write(path, path, whole=False)  # in the journals of folders above
    with _GUARD:
        _ACTIVE.append(journal)
    return journal


def end(journal: Journal) -> None:
    """Stop recording into ``journal`` and close it."""
    with _GUARD:
        if journal in _ACTIVE:
            _ACTIVE.remove(journal)
    if journal._fd is not None:
        os.close(journal._fd)
        journal._fd = None


def _journals_of(path: Path) -> list[Journal]:
    """The active journals of the folders ``path`` lies in (innermost first)."""
    parent = Path(os.path.realpath(path.parent))
    with _GUARD:
        found = [
            j
            for j in _ACTIVE
            if j.folder == parent or j.folder in parent.parents or parent / path.name in j.claims
        ]
    return sorted(found, key=lambda j: len(j.folder.parts), reverse=True)


def temporary_prefix(path: Path) -> str:
    """The start of the name of a temporary file that is to become ``path``: ``.NAME.TOKEN.``,
    the token of the command writing ``path``'s folder (`TEMPORARY`)."""
    journals = _journals_of(path)
    token = journals[0].token if journals else _PROCESS_TOKEN
    return f".{path.name[:60]}.{token}."


def record_write(path: Path, written: Path, *, whole: bool = True) -> None:
    """Record ``written`` (a temporary file, complete) as the file ``path`` it is about to
    become, in every journal of a folder ``path`` lies in; called before the rename.
    ``whole`` False: ``path`` itself, appended to later (recorded by its inode)."""
    journals = _journals_of(path)
    if not journals:
        return
    recorded = identity(os.lstat(written), written if whole else None)
    for journal in journals:
        journal.append({"file": journal.name_of(path), "id": recorded})


@dataclass
class Record:
    """What a folder's journal (or manifest) holds: the kinds of command that wrote it, their
    tokens, and per file name the identities recorded for it."""

    kinds: list[str] = field(default_factory=list)
    tokens: set[str] = field(default_factory=set)
    files: dict[str, list[list[int | str]]] = field(default_factory=dict)

    def add(self, name: str, recorded: list[int | str]) -> None:
        self.files.setdefault(name, [])
        if recorded not in self.files[name]:
            self.files[name].append(recorded)

    def merge(self, other: Record) -> Record:
        merged = Record([*self.kinds, *other.kinds], self.tokens | other.tokens)
        for source in (self, other):
            for name, identities in source.files.items():
                for recorded in identities:
                    merged.add(name, recorded)
        return merged

    def current(self, folder: Path, name: str) -> list[int | str]:
        """The identity of the file ``name`` now: the recorded one it still has by inode, size
        and time (not hashed again), else made afresh."""
        info = os.lstat(folder / name)
        now = [info.st_ino, info.st_size, info.st_mtime_ns]
        for recorded in self.files.get(name, ()):
            if len(recorded) > 1 and recorded[:3] == now:
                return recorded
        return identity(info, folder / name)

    def owns(self, folder: Path, name: str) -> bool:
        """Is the file ``name`` (relative to ``folder``) one this record proves its own: a
        recorded file that still has a recorded identity, or a temporary file of a recorded
        token?"""
        try:
            info = os.lstat(folder / name)
        except OSError:
            return False
        if any(matches(recorded, info, folder / name) for recorded in self.files.get(name, ())):
            return True
        temporary = TEMPORARY.match(name.rsplit("/", 1)[-1])
        return bool(temporary and temporary["token"] in self.tokens and stat.S_ISREG(info.st_mode))


def read_journal(folder: Path) -> Record | None:
    """``folder``'s journal (None: it has none). A last line a kill cut short is left out; a
    journal that is not one (a link, a special file, lines that are not events) is refused."""
    path = folder / JOURNAL
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode):
        raise _refusal(path, "not a regular file")
    with open(path, "rb") as file:
        lines = file.read().split(b"\n")[:-1]  # the part after the last newline: unfinished
    record = Record()
    for number, line in enumerate(lines, 1):
        try:
            event = json.loads(line)
            if "token" in event:
                if not isinstance(event["kind"], str) or not isinstance(event["token"], str):
                    raise TypeError("kind and token must be strings")
                record.kinds.append(event["kind"])
                record.tokens.add(event["token"])
            else:
                name, recorded = event["file"], event["id"]
                if not isinstance(name, str) or not is_identity(recorded):
                    raise TypeError("file must be a name, id an identity")
                record.add(name, recorded)
        except (ValueError, TypeError, KeyError) as error:
            raise _refusal(path, f"damaged at line {number} ({error})") from error
    return record


def is_identity(value: object) -> bool:
    """Is ``value`` an identity as `identity` makes one?"""
    if not isinstance(value, list) or len(value) not in (1, 4):
        return False
    numbers, digest = (value, None) if len(value) == 1 else (value[:3], value[3])
    if not all(type(v) is int and v >= 0 for v in numbers):
        return False
    return digest is None or (isinstance(digest, str) and len(digest) == 32)


def _refusal(path: Path, what: str) -> ConfigError:
    return ConfigError(
        f"{path} (dcp-lens's record of the files it writes in {path.parent}) is {what}; "
        "remove it or pass another folder."
    )


__all__ = [
    "JOURNAL",
    "TEMPORARY",
    "Journal",
    "Record",
    "begin",
    "new_token",
    "end",
    "identity",
    "is_identity",
    "matches",
    "read_journal",
    "record_write",
    "temporary_prefix",
]
