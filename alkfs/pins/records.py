"""The rows of the pins table as records (`PinRecord`, `PinDir`: an `Entry`), a file's
attributes (`FileAttrs`) and their columns, and the name an intent of a file written into
/pins carries (`intent_name`, `from_intent`)."""

from __future__ import annotations

import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..keys import Key

DIR_KEY = b""  # the key column of a directory's row
_COLUMNS = "name, key, created_ns, mode, mtime_ns, size, uid, gid"


@dataclass(frozen=True)
class FileAttrs:
    """What a pin written as a file shows: its st_mode (S_IFREG and the permission
    bits), modification time and size (its object's), its owner and group (None: the
    mount's owner's)."""

    mode: int
    mtime_ns: int
    size: int
    uid: int | None = None
    gid: int | None = None


@dataclass(frozen=True)
class PinRecord:
    name: str
    key: Key
    created_ns: int
    mode: int | None = None  # a pin written as a file: its st_mode (None: a link's pin)
    mtime_ns: int | None = None
    size: int | None = None
    uid: int | None = None  # a file's owner and group (None: the mount's owner's)
    gid: int | None = None

    @property
    def attrs(self) -> FileAttrs | None:
        """A file's attributes (None: a pin made by `ln -s`, setfattr or the CLI)."""
        if self.mode is None:
            return None
        mtime = self.created_ns if self.mtime_ns is None else self.mtime_ns
        size = 0 if self.size is None else self.size
        return FileAttrs(self.mode, mtime, size, self.uid, self.gid)


@dataclass(frozen=True)
class PinDir:
    """A directory of pins in /pins (a row of its own: kept when empty)."""

    name: str
    created_ns: int
    mode: int
    mtime_ns: int
    uid: int | None = None  # its owner and group (None: the mount's owner's)
    gid: int | None = None


Entry = PinRecord | PinDir


def _entry(row: Sequence) -> Entry:
    """A row of _COLUMNS as its record."""
    name, key, created, mode, mtime, size, uid, gid = row
    key = bytes(key)
    if key == DIR_KEY:
        return PinDir(
            name,
            created,
            mode if mode is not None else stat.S_IFDIR | 0o755,
            mtime if mtime is not None else created,
            uid,
            gid,
        )
    return PinRecord(name, Key(key), created, mode, mtime, size, uid, gid)


class PinsAhead(Protocol):
    """Pins acknowledged ahead of their commit (alkfs/writebehind.py registers its pending
    index as `Pins.ahead`): lookups and listings see them; a change of a name pending
    there applies what is pending first."""

    count: int  # intents pending (0: nothing to look at)

    def pinned(self, name: str) -> PinRecord | None:
        """The pending pin `name` (None: none pending)."""
        ...

    def pinned_below(self, prefix: str) -> list[PinRecord]:
        """The pending pins whose names start with `prefix` ("": all), in name order."""
        ...

    def settle(self) -> bool:
        """Apply what is pending (a thread that may wait); whether it all went."""
        ...


def intent_name(name: str, attrs: FileAttrs) -> str:
    """The name an intent (alkfs/intents.py) of a file written into /pins carries: the
    path and the file's mode and time after a NUL each (no name holds a NUL), then, for
    a file given an owner or a group, both (each empty for None) after a NUL each."""
    text = f"{name}\0{attrs.mode}\0{attrs.mtime_ns}"
    if attrs.uid is None and attrs.gid is None:
        return text  # (the form before owners: what an older daemon logged)
    return f"{text}\0{_id_text(attrs.uid)}\0{_id_text(attrs.gid)}"


def from_intent(name: str, size: int) -> tuple[str, FileAttrs | None]:
    """(the pin name, the file's attributes or None) of an intent's name (either form
    `intent_name` writes)."""
    if "\0" not in name:
        return name, None
    path, mode, mtime, *owner = name.split("\0")
    uid, gid = (_id_of(owner[0]), _id_of(owner[1])) if owner else (None, None)
    return path, FileAttrs(int(mode), int(mtime), size, uid, gid)


def _id_text(n: int | None) -> str:
    return "" if n is None else str(n)


def _id_of(text: str) -> int | None:
    return None if text == "" else int(text)


def _attr_values(
    attrs: FileAttrs | None,
) -> tuple[int | None, int | None, int | None, int | None, int | None]:
    """A file's (mode, mtime_ns, size, uid, gid) columns (NULLs: a link's pin)."""
    if attrs is None:
        return (None, None, None, None, None)
    return (attrs.mode, attrs.mtime_ns, attrs.size, attrs.uid, attrs.gid)
