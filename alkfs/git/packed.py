"""The store's git objects read from its published packs: `Store.packed` (alkfs/store/).

A git object that no kv row and no large file holds is looked up in the published derived
set of its format (alkfs/git/packs/) and read from it by alkfs/git/packread.py:
inflated, its delta chain applied, hashed and compared with its key. A pack whose bytes
do not verify raises Corrupt for the objects it affects (the store marks them in
`status.corrupt`); the rest are served.

Its size is the canonical size (header and body, as the kv tier keeps git objects) and its
time the oldest modification time of the set's packs (a set rebuilt later is younger:
a sweep's re-check then keeps the object, never the other way round).

A set is opened once per generation and kept while it is the published one; once a newer
one is published it is closed as soon as no read uses it (a read of it in progress ends
first: the maps outlive the files' removal), so the store never holds a retired set.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from ..errors import AlkfsError
from ..keys import Algorithm
from .packread import PackSet
from .packs import Generation, derived_for

if TYPE_CHECKING:
    from ..store import Store

log = logging.getLogger("alkfs.packs")
_FMT = {Algorithm.GIT_SHA1.value: "sha1", Algorithm.GIT_SHA256.value: "sha256"}


class _Opened:
    """One generation's packs, opened, and how many reads use them now."""

    __slots__ = ("number", "packs", "stored_ns", "users", "retired")

    def __init__(self, number: int, packs: PackSet, stored_ns: int) -> None:
        self.number, self.packs, self.stored_ns = number, packs, stored_ns
        self.users = 0
        self.retired = False


class PackedObjects:
    """`Store.packed`: the published sets of a store, as a tier (thread-safe). A set is
    closed (its maps and descriptors let go) once a newer one is published and the last
    read of it ended, so that a retired generation's files are not held by the store."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._open: dict[str, _Opened] = {}
        self._told: set[str] = set()  # formats whose publishes retire the open set

    def _acquire(self, fmt: str) -> _Opened | None:
        d = derived_for(self.store, fmt)
        if d is None:
            return None
        if fmt not in self._told:
            with self._lock:
                if fmt not in self._told:
                    self._told.add(fmt)
                    d.on_publish.append(lambda _old, _new: self._retire(fmt))
        gen = d.current()
        if gen is None or not gen.indexes:
            self._retire(fmt)
            return None
        with self._lock:
            cur = self._open.get(fmt)
            if cur is not None and cur.number == gen.number:
                cur.users += 1
                return cur
        opened = self._load(gen)
        if opened is None:
            return None
        with self._lock:
            cur = self._open.get(fmt)
            if cur is not None and cur.number == gen.number:  # (opened meanwhile)
                opened.packs.close()
                cur.users += 1
                return cur
            if cur is not None:
                self._drop(cur)
            self._open[fmt] = opened
            opened.users = 1
            return opened

    def _release(self, opened: _Opened) -> None:
        with self._lock:
            opened.users -= 1
            if opened.retired and opened.users == 0:
                opened.packs.close()

    def _drop(self, opened: _Opened) -> None:
        """(under the lock) Retire an open set: closed now, or by its last read."""
        opened.retired = True
        if opened.users == 0:
            opened.packs.close()

    def _retire(self, fmt: str) -> None:
        """A new set was published (or none is): the open one goes."""
        with self._lock:
            cur = self._open.pop(fmt, None)
            if cur is not None:
                self._drop(cur)

    @staticmethod
    def _load(gen: Generation) -> _Opened | None:
        packs = [idx.path.with_suffix(".pack") for idx in gen.indexes]
        try:
            opened = PackSet(packs, gen.fmt)
        except FileNotFoundError:
            return None  # (retired and removed meanwhile: the next look takes the new one)
        except (OSError, AlkfsError) as exc:
            log.error("packs %s: generation %d cannot be read: %s", gen.fmt, gen.number, exc)
            return None
        times = [ns for rel, ns in gen.mtimes.items() if rel.endswith(".pack")]
        return _Opened(gen.number, opened, min(times, default=0))

    def stat(self, key: bytes) -> tuple[int, int] | None:
        fmt = _FMT.get(key[0])
        opened = None if fmt is None else self._acquire(fmt)
        if opened is None:
            return None
        try:
            found = opened.packs.stat(key[1:])
        finally:
            self._release(opened)
        if found is None:
            return None
        kind, size = found
        return len(kind) + 2 + len(str(size)) + size, opened.stored_ns

    def read(self, key: bytes) -> bytes | None:
        fmt = _FMT.get(key[0])
        opened = None if fmt is None else self._acquire(fmt)
        if opened is None:
            return None
        try:
            found = opened.packs.read(key[1:])
        finally:
            self._release(opened)
        if found is None:
            return None
        kind, body = found
        return b"%s %d\0" % (kind, len(body)) + body

    def close(self) -> None:
        """Close every open set (the store closes)."""
        with self._lock:
            for fmt in list(self._open):
                self._drop(self._open.pop(fmt))
