"""Small puts acknowledged ahead of their database commit: the intents log.

The on-disk format of the write-behind (alkfs/writebehind.py, which appends, applies
and replays): a small file written through the mount is in the store once its intent is
in this log (`STORE/intents.log`): one `writev()` into the page cache, the same
durability as the database's own commits, which are not fsynced either
(`synchronous=NORMAL`).

A record: the header (magic, length of the body, crc32 of the body), then the body: the
pin name's length (u16, 0: no pin) and the name (utf-8), the key (its algorithm byte and
digest), the content. A torn or damaged tail is dropped: its writer never heard success.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from .errors import Invalid
from .keys import Key

LOG_NAME = "intents.log"
MAGIC = b"ALKI"
_HEAD = struct.Struct("<4sII")  # magic, body length, crc32 of the body
_NAME = struct.Struct("<H")


class Intent(NamedTuple):
    """One small object to store (its key computed from `data` by whoever made it),
    pinned as `name` unless that is None. (A tuple: one is made at every small close.)"""

    name: str | None
    key: Key
    data: bytes

    def parts(self) -> list[bytes]:
        """The record as the pieces one `writev` writes (the content is not copied)."""
        name = b"" if self.name is None else self.name.encode()
        lead = _NAME.pack(len(name)) + name + self.key.raw
        crc = zlib.crc32(self.data, zlib.crc32(lead))
        return [_HEAD.pack(MAGIC, len(lead) + len(self.data), crc) + lead, self.data]

    def encode(self) -> bytes:
        return b"".join(self.parts())


def decode(blob: bytes) -> Iterator[Intent]:
    """The whole records of a log's bytes, in order, up to the first torn or damaged one."""
    pos, end = 0, len(blob)
    while pos + _HEAD.size <= end:
        magic, length, crc = _HEAD.unpack_from(blob, pos)
        body = blob[pos + _HEAD.size : pos + _HEAD.size + length]
        if magic != MAGIC or len(body) != length or zlib.crc32(body) != crc:
            return
        try:
            (n,) = _NAME.unpack_from(body, 0)
            name = body[2 : 2 + n].decode() if n else None
            size = Key.size_of(body[2 + n])
            key = Key(bytes(body[2 + n : 2 + n + size]))
            data = bytes(body[2 + n + size :])
        except (Invalid, IndexError, UnicodeDecodeError, struct.error):
            return
        if not key.matches(data):
            return
        yield Intent(name, key, data)
        pos += _HEAD.size + length


class IntentLog:
    """The store's intents log, opened for appending (one process: the lock holder)."""

    def __init__(self, root: Path) -> None:
        self.path = root / LOG_NAME
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.size = os.fstat(self.fd).st_size

    def append(self, intent: Intent) -> None:
        """One writev of the record (OSError: nothing of it is kept; a full disk is ENOSPC)."""
        parts = intent.parts()
        try:
            written = os.writev(self.fd, parts)
        except OSError:
            self._cut()
            raise
        if written != len(parts[0]) + len(parts[1]):  # (a disk that filled up within it)
            self._cut()
            raise OSError(28, "No space left on device (a short write of the intents log)")
        self.size += written

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, self.size)

    def reset(self) -> None:
        """Every intent in the log is applied: empty it."""
        os.ftruncate(self.fd, 0)
        self.size = 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
