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
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import AlkfsError
from ..keys import Algorithm
from ..tiers.sql import SqlTier
from .packread import PackSet
from .packs import CURRENT, DERIVED_DIR, FORMATS, Generation, derived_for
from .packs.drain import PRIMARY, open_packs

if TYPE_CHECKING:
    from ..store import Store

log = logging.getLogger("alkfs.packs")
KV_SET_MAX = 200_000  # kv rows of a format read into a set at once (more: looked up)
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
        self._beside: dict[str, Generation] = {}  # (opened beside the lock holder)

    def _generation(self, fmt: str) -> Generation | None:
        """The published set of `fmt`: the store's own (`derived_for`; a fleet's: the one
        this member serves, looked up at first use), or, in a process
        opened beside the store's lock holder, the one its CURRENT names (read again at
        each look: the holder publishes and drains meanwhile)."""
        d = derived_for(self.store, fmt)
        if d is not None:
            if fmt not in self._told:
                with self._lock:
                    if fmt not in self._told:
                        self._told.add(fmt)
                        d.on_publish.append(lambda _old, _new: self._retire(fmt))
            if not d.looked:  # (a fleet's member: its first look at the published set;
                d.refresh()  # the listener's notices keep it current after)
            return d.current()
        if self.store.path is None:
            return None
        root = self.store.path / DERIVED_DIR / fmt
        try:
            number = int((root / CURRENT).read_text())
        except (OSError, ValueError):
            return None
        cached = self._beside.get(fmt)
        if cached is not None and cached.number == number:
            return cached
        try:
            gen = Generation.load(fmt, number, root / f"gen-{number}") if number else None
        except (OSError, AlkfsError, ValueError):
            return None
        if gen is not None:
            self._beside[fmt] = gen
        return gen

    def _acquire(self, fmt: str) -> _Opened | None:
        gen = self._generation(fmt)
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
        try:
            opened = open_packs(gen)
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

    def holds(self, key: bytes) -> bool:
        """Whether the published set of the key's format lists it (its idx alone)."""
        fmt = _FMT.get(key[0])
        gen = None if fmt is None else self._generation(fmt)
        return gen is not None and key[1:] in gen

    def page(self, after: bytes, before: bytes, limit: int) -> list[tuple[bytes, int, int]]:
        """(key, canonical size, stored ns) of up to `limit` objects of the published
        sets with after < key < before, in key order (a listing's page; the kv's own
        rows are merged in by the store)."""
        found: list[bytes] = []
        for fmt, algo in FORMATS.items():
            tag = bytes([algo.value])
            if not after[:1] <= tag <= before[:1]:
                continue
            gen = self._generation(fmt)
            if gen is None or not gen.indexes:
                continue
            start = after[1:] if after[:1] == tag else b""
            for idx in gen.indexes:
                found += (tag + x for x in idx.names_after(start, limit))
        out = []
        for key in sorted(set(k for k in found if after < k < before))[:limit]:
            st = self.stat(key)
            if st is not None:
                out.append((key, *st))
        return out

    def _only_copy(self) -> Iterator[tuple[Algorithm, Generation, set[bytes] | None]]:
        """(algorithm, published set, the kv's keys of the format or None when there are
        KV_SET_MAX or more) of each format whose sets are the only copy of what they
        hold (drain.py: PRIMARY). Elsewhere the kv keeps every object a set holds, and
        nothing is looked at."""
        kv = self.store.kv
        if self.store.path is None or not isinstance(kv, SqlTier):
            return
        for fmt, algo in FORMATS.items():
            if not (self.store.path / DERIVED_DIR / fmt / PRIMARY).exists():
                continue
            gen = self._generation(fmt)
            if gen is None or not gen.indexes:
                continue
            lo, hi = bytes([algo.value]), bytes([algo.value + 1])
            loose = None
            if kv.count_range(lo, hi, KV_SET_MAX) < KV_SET_MAX:
                loose = {e.key for e in kv.scan(lo, hi, KV_SET_MAX)}
            yield algo, gen, loose

    def only_counts(self) -> dict[int, int]:
        """{algorithm byte: how many objects its published set holds that the kv does
        not} (from the idx files and the kv's keys, nothing read; an object two packs
        list counts twice)."""
        out: dict[int, int] = {}
        for algo, gen, loose in self._only_copy():
            if loose is None:
                both = sum(1 for _ in self._kv_held(algo, gen))
            else:
                both = sum(1 for k in loose if k[1:] in gen)
            out[algo.value] = max(0, gen.objects - both)
        return out

    def _kv_held(self, algo: Algorithm, gen: Generation) -> Iterator[bytes]:
        """The kv's keys of the format the set also holds (a paged scan)."""
        kv = self.store.kv
        assert isinstance(kv, SqlTier)
        after, hi = bytes([algo.value]), bytes([algo.value + 1])
        while page := kv.scan(after, hi, 4096):
            yield from (e.key for e in page if e.key[1:] in gen)
            after = page[-1].key

    def only_here(self) -> Iterator[bytes]:
        """The keys (raw) of the objects the published sets hold and the kv does not:
        those kept in their packs alone (alkfs/git/packs/drain.py). For the mark scan."""
        kv = self.store.kv
        if not isinstance(kv, SqlTier):
            return
        for algo, gen, loose in self._only_copy():
            tag = bytes([algo.value])
            for idx in gen.indexes:
                chunk: list[bytes] = []
                for digest in idx.digests():
                    chunk.append(tag + digest)
                    if len(chunk) >= 4096:
                        yield from _absent(kv, chunk, loose)
                        chunk = []
                yield from _absent(kv, chunk, loose)

    def close(self) -> None:
        """Close every open set (the store closes)."""
        with self._lock:
            for fmt in list(self._open):
                self._drop(self._open.pop(fmt))


def _absent(kv: SqlTier, keys: list[bytes], loose: set[bytes] | None) -> list[bytes]:
    if loose is not None:
        return [k for k in keys if k not in loose]
    have = kv.present(keys)
    return [k for k in keys if k not in have]
