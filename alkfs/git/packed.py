"""The store's git objects read from its published packs: `Store.packed` (alkfs/store.py).

A git object that no kv row and no large file holds is looked up in the published derived
set of its format (alkfs/git/packs.py) and read from it by alkfs/git/packread.py:
inflated, its delta chain applied, hashed and compared with its key. A pack whose bytes
do not verify raises Corrupt for the objects it affects (the store marks them in
`status.corrupt`); the rest are served.

Its size is the canonical size (header and body, as the kv tier keeps git objects) and its
time the oldest modification time of the set's packs (a set rebuilt later is younger:
a sweep's re-check then keeps the object, never the other way round).

A set is opened once per generation and kept while it is the published one; a reader of
the one before keeps its maps (they outlive the files' removal) until it is done.
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


class PackedObjects:
    """`Store.packed`: the published sets of a store, as a tier (thread-safe)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._open: dict[str, tuple[int, PackSet, int]] = {}  # fmt -> (gen, set, time)

    def _set(self, fmt: str) -> tuple[PackSet, int] | None:
        d = derived_for(self.store, fmt)
        if d is None:
            return None
        gen = d.current()
        if gen is None or not gen.indexes:
            return None
        with self._lock:
            cached = self._open.get(fmt)
            if cached is not None and cached[0] == gen.number:
                return cached[1], cached[2]
        opened = self._load(gen)
        if opened is None:
            return None
        with self._lock:
            self._open[fmt] = (gen.number, *opened)
        return opened

    @staticmethod
    def _load(gen: Generation) -> tuple[PackSet, int] | None:
        packs = [idx.path.with_suffix(".pack") for idx in gen.indexes]
        try:
            opened = PackSet(packs, gen.fmt)
        except FileNotFoundError:
            return None  # (retired and removed meanwhile: the next look takes the new one)
        except (OSError, AlkfsError) as exc:
            log.error("packs %s: generation %d cannot be read: %s", gen.fmt, gen.number, exc)
            return None
        times = [ns for rel, ns in gen.mtimes.items() if rel.endswith(".pack")]
        return opened, min(times, default=0)

    def stat(self, key: bytes) -> tuple[int, int] | None:
        fmt = _FMT.get(key[0])
        opened = None if fmt is None else self._set(fmt)
        if opened is None:
            return None
        found = opened[0].stat(key[1:])
        if found is None:
            return None
        kind, size = found
        return len(kind) + 2 + len(str(size)) + size, opened[1]

    def read(self, key: bytes) -> bytes | None:
        fmt = _FMT.get(key[0])
        opened = None if fmt is None else self._set(fmt)
        if opened is None:
            return None
        found = opened[0].read(key[1:])
        if found is None:
            return None
        kind, body = found
        return b"%s %d\0" % (kind, len(body)) + body
