"""The local large-object engine: one file per object, `<root>/<algo>/<xx>/<hex>`.

A put writes a staging file, fsyncs it, links it into place (never overwriting:
first writer wins) and fsyncs the directory. A crash leaves the whole object
or nothing; stale staging files are removed at open.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

from ..errors import Invalid
from ..keys import Algorithm, Key
from . import Entry
from .staging import StagingWriter

STAGING = ".staging"


def fsync_dir(path: Path) -> None:
    """Make a directory's entries durable (after a create, link or rename in it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalTier:
    name = "large"

    def __init__(
        self, root: str | os.PathLike[str], clear_staging: bool = True, own: str | None = None
    ) -> None:
        """`clear_staging`: remove what a crashed writer left. Only the store's lock
        holder may: beside a holder, those files are its puts in flight. `own`: a
        member of a fleet stages in a directory of its own, `.staging/<own>`, and
        never touches the others' (alkfs/fleet.py)."""
        self.root = Path(root)
        self.staging = self.root / STAGING if own is None else self.root / STAGING / own
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # 0700: the owner's alone
        self.staging.mkdir(mode=0o700, parents=True, exist_ok=True)
        if clear_staging:
            for stale in os.listdir(self.staging):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.staging / stale)

    def path(self, key: bytes) -> Path:
        k = Key(key)
        h = k.hex
        return self.root / k.algo.label / h[:2] / h

    def stat(self, key: bytes) -> Entry | None:
        try:
            st = os.stat(self.path(key))
        except FileNotFoundError:
            return None
        return Entry(key, st.st_size, st.st_mtime_ns)

    def read(self, key: bytes) -> bytes | None:
        try:
            with open(self.path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def new_writer(self) -> StagingWriter:
        """A fresh staging file, written by a StagingWriter (close it on every path)."""
        path = self.staging / uuid.uuid4().hex
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o400)
        except FileNotFoundError:  # (a fleet member's, removed while it was paused)
            self.staging.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, flags, 0o400)
        try:
            return StagingWriter(path, fd)
        except BaseException:  # (the thread could not start): leave nothing behind
            os.close(fd)
            self.discard(path)
            raise

    def discard(self, staging: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)

    def publish(self, key: bytes, staging: Path, now_ns: int) -> bool:
        """Move a complete, fsynced staging file into place. False: it existed (freshened)."""
        target = self.path(key)
        parent = target.parent
        if not parent.is_dir():
            parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            parent.mkdir(mode=0o700, exist_ok=True)
            fsync_dir(parent.parent)
        try:
            os.link(staging, target)
        except FileExistsError:
            self.discard(staging)
            self.freshen(key, now_ns)
            return False
        os.unlink(staging)
        os.utime(target, ns=(now_ns, now_ns))
        fsync_dir(parent)
        return True

    def freshen(self, key: bytes, now_ns: int) -> bool:
        try:
            os.utime(self.path(key), ns=(now_ns, now_ns))
            return True
        except FileNotFoundError:
            return False

    def delete(self, key: bytes) -> int | None:
        path = self.path(key)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return None
        return size

    def scan(self, after: bytes, before: bytes, limit: int) -> list[Entry]:
        """Entries with after < key < before, in key order, at most `limit`."""
        out: list[Entry] = []
        for algo in Algorithm:
            lo, hi = bytes([algo.value]), bytes([algo.value + 1])
            if hi <= after or lo >= before:
                continue
            adir = self.root / algo.label
            try:
                fans = sorted(os.listdir(adir))
            except FileNotFoundError:
                continue
            first_fan = after[1:2].hex() if after[:1] == lo else ""
            for fan in fans:
                if fan < first_fan or len(fan) != 2:
                    continue
                try:
                    names = sorted(os.listdir(adir / fan))
                except FileNotFoundError:
                    continue
                for name in names:
                    try:
                        key = Key.from_hex(algo, name).raw
                    except Invalid:
                        continue
                    if key <= after:
                        continue
                    if key >= before:
                        return out
                    try:
                        st = os.stat(adir / fan / name)
                    except FileNotFoundError:
                        continue
                    out.append(Entry(key, st.st_size, st.st_mtime_ns))
                    if len(out) >= limit:
                        return out
        return out

    def iter_keys(self):
        after = b""
        while page := self.scan(after, b"\xff", 4096):
            for e in page:
                yield e.key
            after = page[-1].key

    def files(self) -> int:
        """Committed object files (the medium oracle of the tests)."""
        return sum(1 for _ in self.iter_keys())
