"""The ref-closure liveness source: every object reachable from any ref of any repository.

The walk follows commits (tree and every parent), trees (every entry except
gitlinks) and tags (their target). A missing or corrupt object stops its own
branch, never the walk. Blob bodies are never read: a tree entry's mode, or the
kv pass below, says an entry is a blob, and a large-tier object shows its type in
its first bytes. A walk that met a missing object is not memoized for reuse.

The walk loads a format's trees, commits and tags in one sequential pass of the
kv table (far cheaper than as many random lookups), then walks in memory; a mem
store, or one with more than SCAN_MAX objects of the format, walks by batched
lookups instead.

`RefClosure` has git compute the closure where the store has published derived packs
(alkfs/git/revmark.py: `git rev-list --objects` over them, kept as a `SortedKeys`, a few
bytes a key) and walks in Python otherwise, or when git's answer could be short
(`ALKFS_MARK=python` always walks in Python).

The memo is keyed on the refs snapshot's fingerprint, so an unchanged set of
refs costs one ordered read, not a walk. `contains` runs under the store's
arbitration lock and answers only from the memo: live when the memo is cold,
live when `write_counter` moved since the memo was built (a ref write may have
landed after the mark), exact otherwise. The counter is read *before* the
snapshot and every write bumps it *after* its commit, so a write straddling a
mark always answers live.
"""

from __future__ import annotations

import binascii
import hashlib
import threading
from binascii import unhexlify
from collections.abc import Callable, Container, Iterable
from typing import TYPE_CHECKING

from ..errors import AlkfsError
from ..keys import Algorithm, Key
from ..keyset import KeyUnion
from ..settings import settings
from ..tiers.sql import SqlTier
from .objects import ID_ONLY, MAX_HEADER, WALK_ENTRY, parse_header
from .refs import Refs, oid_key
from .revmark import git_closure

if TYPE_CHECKING:
    from ..store import Store

SCAN_MAX = 1_000_000
PRELOAD_FROM = 10_000  # a walk stopping at a known set preloads only from this many tips
_FORMAT = {Algorithm.GIT_SHA1: "sha1", Algorithm.GIT_SHA256: "sha256"}


class Walker:
    """Reads git objects from the store in batches (verified) and walks their closure."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def _fetch(self, algo: Algorithm, ids: list[bytes]) -> dict[bytes, bytes]:
        """raw id -> verified canonical bytes, for the ids that are stored and sound."""
        store = self.store
        prefix = bytes([algo.value])
        out: dict[bytes, bytes] = {}
        hasher = algo.hasher
        kv = store.kv
        if isinstance(kv, SqlTier):
            for key, value in kv.values([prefix + x for x in ids]):
                h = hasher()
                h.update(value)
                if h.digest() == key[1:]:
                    out[key[1:]] = value
                else:
                    self._get(Key(key))  # records the corruption
        missing = [x for x in ids if x not in out]
        for x in missing:
            data = self._get(Key(prefix + x))
            if data is not None:
                out[x] = data
        return out

    def _get(self, key: Key) -> bytes | None:
        """Verified bytes; for a large-tier blob only its header (a blob's body is never
        needed, and a large one is not worth reading); None when absent or corrupt."""
        store = self.store
        path = store.large_path(key)
        if path is not None and store.kv.stat(key.raw) is None:
            try:
                with open(path, "rb") as f:
                    head = f.read(MAX_HEADER)
                kind, size, hlen = parse_header(head)
            except FileNotFoundError:
                pass  # (not a large file: kept in its pack, or absent)
            except (OSError, AlkfsError):
                return None
            else:
                if kind == "blob":
                    return head[:hlen]
        try:
            return store.get(key)
        except AlkfsError:
            return None

    def closure(self, tips: Iterable[Key]) -> set[bytes]:
        """Raw keys of every object reachable from `tips` (git keys only; others are ignored).

        Blob keys are included as named by their trees, whether stored or not;
        every other key is included only if its object was read."""
        return self.walk(tips)[0]

    def walk(
        self, tips: Iterable[Key], known: Container[bytes] | None = None
    ) -> tuple[set[bytes], int]:
        """The closure, and how many needed objects could not be read (missing or corrupt).

        `known`: raw keys of a set already closed under reachability (another walk's
        result): the walk stops at them and leaves them out, and reads objects by batched
        lookups unless more than PRELOAD_FROM tips remain (a borrower's own history is
        a small part of the store's)."""
        missing = [0]
        by_algo: dict[Algorithm, set[bytes]] = {}
        for key in tips:
            if key.algo.is_git:
                by_algo.setdefault(key.algo, set()).add(key.digest)
        live: set[bytes] = set()
        for algo, ids in by_algo.items():
            prefix = bytes([algo.value])
            stop = None
            if known is not None:
                stop = known
                ids = {x for x in ids if prefix + x not in known}
            live.update(prefix + x for x in self._walk(algo, ids, missing, stop))
        return live, missing[0]

    def _preload(self, algo: Algorithm) -> tuple[dict[bytes, bytes], set[bytes]] | None:
        """Every non-blob kv object of this format, and the ids of its kv blobs, in one
        sequential pass of the table.

        A walk reads most trees and commits of the store; one pass costs a fraction
        of as many random lookups. None (walk by batched lookups) on a mem store or
        when the format has more than SCAN_MAX objects."""
        kv = self.store.kv
        if not isinstance(kv, SqlTier):
            return None
        lo, hi = bytes([algo.value]), bytes([algo.value + 1])
        if kv.count_range(lo, hi, SCAN_MAX + 1) > SCAN_MAX:
            return None
        objects: dict[bytes, bytes] = {}
        blobs: set[bytes] = set()
        for key, value in kv.git_range(lo, hi):
            if value is None:
                blobs.add(key[1:])
            else:
                objects[key[1:]] = value
        return objects, blobs

    def _walk(
        self,
        algo: Algorithm,
        tips: set[bytes],
        missing: list[int],
        known: Container[bytes] | None = None,
    ) -> set[bytes]:
        entry = WALK_ENTRY[_FORMAT[algo]]
        ids = ID_ONLY[_FORMAT[algo]]
        hexlen = algo.hex_len
        digest_of = hashlib.sha1 if algo is Algorithm.GIT_SHA1 else hashlib.sha256
        prefix = bytes([algo.value])
        wanted = tips and (known is None or len(tips) > PRELOAD_FROM)
        loaded = self._preload(algo) if wanted else None
        preload, kv_blobs = loaded if loaded is not None else (None, set())
        seen: set[bytes] = set()  # read (or named as a blob): never visited again
        found: set[bytes] = set()  # the closure
        frontier = set(tips)
        while frontier:
            self.store.check_stopping()  # (a level of the walk at a time)
            frontier -= seen
            if known is not None:  # (closed already: stop there)
                frontier = {x for x in frontier if prefix + x not in known}
            if not frontier:
                break
            seen |= frontier
            if preload is None:
                objects = self._fetch(algo, list(frontier))
            else:
                objects = {}
                rest = []
                for x in frontier:
                    data = preload.get(x)
                    if data is not None and digest_of(data).digest() == x:
                        objects[x] = data
                    else:  # not in the pass (or corrupt: the store's own read records it)
                        rest.append(x)
                if rest:
                    objects.update(self._fetch(algo, rest))
            missing[0] += len(frontier) - len(objects)
            found.update(objects)
            nxt: set[bytes] = set()
            for data in objects.values():
                nul = data.find(b"\0")
                if data.startswith(b"tree "):
                    if preload is not None and b"160000 " not in data:
                        # No gitlink: every entry is walked. A tree in the pass is walked,
                        # a kv blob is live as it is, anything else (large tier, absent)
                        # is read to learn what it is.
                        new = set(ids.findall(data, nul + 1))
                        new -= seen
                        blobs = new & kv_blobs
                        if blobs:
                            seen |= blobs
                            found |= blobs
                            new -= blobs
                        nxt |= new
                        continue
                    modes = dict(map(reversed, entry.findall(data, nul + 1)))
                    for child in modes.keys() - seen:
                        mode = modes[child]
                        if mode.lstrip(b"0") == b"40000":  # git accepts a zero-padded 040000
                            nxt.add(child)
                        elif mode != b"160000":  # gitlinks belong to other repositories
                            seen.add(child)
                            if known is None or prefix + child not in known:
                                found.add(child)
                elif data.startswith(b"commit "):
                    # "tree <hex>\n", then "parent <hex>\n" lines
                    pos = nul + 1
                    try:
                        if data.startswith(b"tree ", pos):
                            nxt.add(unhexlify(data[pos + 5 : pos + 5 + hexlen]))
                            pos += 6 + hexlen
                        while data.startswith(b"parent ", pos):
                            nxt.add(unhexlify(data[pos + 7 : pos + 7 + hexlen]))
                            pos += 8 + hexlen
                    except (ValueError, binascii.Error):
                        pass
                elif data.startswith(b"tag "):
                    pos = nul + 1
                    if data.startswith(b"object ", pos):
                        try:
                            nxt.add(unhexlify(data[pos + 7 : pos + 7 + hexlen]))
                        except (ValueError, binascii.Error):
                            pass
            frontier = nxt
        return found


class RefClosure:
    """The refs liveness source (register it with `store.register_source`)."""

    def __init__(self, store: Store, refs: Refs) -> None:
        self.store = store
        self.refs = refs
        self.walker = Walker(store)
        self.builds = 0  # how many walks ran (a memo hit runs none)
        self.by_git = 0  # how many formats' closures git computed (the rest: walked here)
        # (fingerprint, counter, keys); the fingerprint is None when the walk met a missing
        # object, so that a later mark walks again (the object may have been stored since)
        self._memo: tuple[str | None, int, Container[bytes]] | None = None
        self._lock = threading.Lock()

    def _counter(self) -> int:
        return self.refs.write_counter

    def live_keys(self) -> KeyUnion:
        counter = self._counter()  # before the snapshot: see the module docstring
        rows, fingerprint = self.refs.snapshot()
        with self._lock:
            memo = self._memo
            if memo is not None and memo[0] == fingerprint:
                self._memo = (fingerprint, counter, memo[2])
                return memo[2]  # type: ignore[return-value]  # (always a KeyUnion)
        tips = [k for k in (oid_key(oid) for _r, _n, oid in rows) if k is not None]
        keys, missing = self._closure(tips)
        with self._lock:
            self.builds += 1
            self._memo = (fingerprint if missing == 0 else None, counter, keys)
        return keys

    def _closure(self, tips: list[Key]) -> tuple[KeyUnion, int]:
        """The tips' closure, by git where it can (per format), else by the walk."""
        by_algo: dict[Algorithm, list[bytes]] = {}
        for key in tips:
            if key.algo.is_git:
                by_algo.setdefault(key.algo, []).append(key.digest)
        out = KeyUnion()
        missing = 0
        use_git = settings().mark != "python"
        for algo, ids in by_algo.items():
            got = git_closure(self.store, algo, ids) if use_git else None
            if got is None:
                keys, n = self.walker.walk(Key(bytes([algo.value]) + x) for x in ids)
                out.add(keys)
            else:
                listed, named, n = got
                out.add(listed)
                out.add(named)
                self.by_git += 1
            missing += n
        return out, missing

    def contains(self, key: bytes) -> bool:
        return memo_contains(self._memo, key, self._counter)

    def last_live(self) -> Container[bytes] | None:
        """What the last `live_keys` found (closed under reachability), or None."""
        memo = self._memo
        return None if memo is None else memo[2]


def memo_contains(
    memo: tuple[str | None, int, Container[bytes]] | None,
    key: bytes,
    counter: Callable[[], int],
) -> bool:
    """The shared arbitration answer: cold → live, hit → live, miss → live iff the counter moved."""
    if memo is None or key in memo[2]:
        return True
    return counter() != memo[1]
