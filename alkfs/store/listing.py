"""The store's metadata and listing: where an object is (kv, large, or only in the
packs: `Store.packed`), stat, has, list, iter_keys, counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..catalog import Record
from ..errors import Corrupt
from ..keys import Algorithm, Key
from ..tiers import Entry
from ..tiers.sql import SqlTier
from .state import StoreState

GIT_TAGS = (bytes([Algorithm.GIT_SHA1.value]), bytes([Algorithm.GIT_SHA256.value]))


@dataclass(frozen=True, slots=True)
class ObjectStat:
    key: Key
    size: int
    tier: str  # "kv", "large", "mem" or "packs" (a git object its packs hold, only there)
    stored_ns: int


class StoreListing(StoreState):
    """`Store`'s metadata and listing."""

    if TYPE_CHECKING:  # (defined by the other parts of `Store`)

        def _mark_corrupt(self, key: Key) -> None: ...

    # -- metadata ---------------------------------------------------------------
    def _entry(self, key: bytes) -> tuple[Entry, str] | None:
        e = self.kv.stat(key)
        if e is not None:
            return e, self.kv.name
        ahead = self.ahead
        if ahead is not None:
            found = ahead.stat(key)
            if found is not None:
                return Entry(key, found[0], found[1]), self.kv.name
        if self.large is not None:
            e = self.large.stat(key)
            if e is not None:
                return self._recorded(e), "large"
        if self.packed is not None and key[:1] in GIT_TAGS:
            found = self.packed.stat(key)
            if found is not None:
                return Entry(key, found[0], found[1]), "packs"
        return None

    def _packed(self, key: Key) -> bytes | None:
        """A packed git object's bytes, verified (Corrupt, marked, when they are not)."""
        if self.packed is None or not key.algo.is_git:
            return None
        try:
            return self.packed.read(key.raw)
        except Corrupt:
            self._mark_corrupt(key)
            raise

    def _recorded(self, e: Entry) -> Entry:
        """A large file's entry as its catalog row has it: the recorded size (whatever
        the file's), stored at the later of the row's time and the file's mtime."""
        assert self.catalog is not None
        rec = self.catalog.get(e.key)
        if rec is None or not rec.consistent():
            return e  # stored before the catalog: the file is all there is to go by
        return Entry(e.key, rec.size, max(rec.stored_ns, e.stored_ns))

    def _recorded_page(self, page: list[Entry]) -> list[Entry]:
        """`_recorded` for a listing page of large files, with one range query."""
        if not page or self.catalog is None:
            return page
        rows = self.catalog.sizes(page[0].key, page[-1].key)
        out = []
        for e in page:
            row = rows.get(e.key)
            out.append(e if row is None else Entry(e.key, row[0], max(row[1], e.stored_ns)))
        return out

    def record(self, key: Key) -> Record | None:
        """The catalog row of a large object (None: none, or no large tier)."""
        if self.catalog is None:
            return None
        rec = self.catalog.get(key.raw)
        return rec if rec is not None and rec.consistent() else None

    def stat(self, key: Key) -> ObjectStat | None:
        found = self._entry(key.raw)
        if found is None:
            return None
        e, tier = found
        return ObjectStat(key, e.size, tier, e.stored_ns)

    def has(self, key: Key) -> bool:
        return self._entry(key.raw) is not None

    def has_raw(self, key: bytes) -> bool:
        return self._entry(key) is not None

    def written_since(self, key: bytes, since_ns: int) -> bool:
        found = self._entry(key)
        return found is not None and found[0].stored_ns > since_ns

    def list(
        self, after: Key | None = None, limit: int = 1000, algo: Algorithm | None = None
    ) -> list[ObjectStat]:
        """Objects in key order after `after`, at most `limit` (resume from the last one)."""
        lo = after.raw if after is not None else (bytes([algo.value]) if algo else b"")
        if algo is not None and lo < bytes([algo.value]):
            lo = bytes([algo.value])
        hi = bytes([algo.value + 1]) if algo is not None else b"\xff"
        rows = [(e, self.kv.name) for e in self.kv.scan(lo, hi, limit)]
        if self.large is not None:
            rows += [(e, "large") for e in self._recorded_page(self.large.scan(lo, hi, limit))]
        if self.packed is not None and (algo is None or algo.is_git):
            # (git objects kept in their packs alone; one also in the kv is listed once)
            there = {e.key for e, _t in rows}
            rows += [
                (Entry(k, size, ns), "packs")
                for k, size, ns in self.packed.page(lo, hi, limit)
                if k not in there
            ]
        ahead = self.ahead
        if ahead is not None:  # (small objects pending ahead of their commit)
            more = ahead.page(lo, hi, limit)
            if more:
                there = {e.key for e, _t in rows}
                rows += [
                    (Entry(k, size, ns), self.kv.name)
                    for k, size, ns in more
                    if k not in there and k > lo
                ]
        rows.sort(key=lambda r: r[0].key)
        return [ObjectStat(Key(e.key), e.size, t, e.stored_ns) for e, t in rows[:limit]]

    def iter_keys(self) -> Iterator[bytes]:
        """Every stored key (raw), unordered across tiers: the mark scan."""
        if isinstance(self.kv, SqlTier):
            yield from self.kv.iter_keys()
        else:
            yield from self.kv.keys()
        if self.large is not None:
            yield from self.large.iter_keys()
        if self.packed is not None:  # (git objects kept in their packs alone)
            yield from self.packed.only_here()

    def counts(self) -> dict[str, dict[str, int]]:
        """Per algorithm: objects and their bytes, in all and per tier (`packs`: the
        git objects kept in packs alone, counted, their bytes not summed)."""
        out = {
            a.label: {"count": 0, "bytes": 0, "kv": 0, "large": 0, "kv_bytes": 0, "large_bytes": 0}
            for a in Algorithm
        }
        if self.packed is not None:  # git objects kept in their packs alone (no bytes:
            # their canonical sizes are not read; `disk.packs` has the files' bytes), a
            # `packs` key where there are any
            for b, n in self.packed.only_counts().items():
                if not n:
                    continue
                c = out[Algorithm(b).label]
                c["count"] += n
                c["packs"] = n
        if isinstance(self.kv, SqlTier):
            for b, n, size in self.kv.counts():
                c = out[Algorithm(b).label]
                c["count"] += n
                c["bytes"] += size
                c["kv"] += n
                c["kv_bytes"] += size
        else:
            for k in self.kv.keys():  # noqa: SIM118 (a KV store's scan, not a dict)
                c = out[Algorithm(k[0]).label]
                e = self.kv.stat(k)
                c["count"] += 1
                c["kv"] += 1
                c["bytes"] += e.size if e else 0
                c["kv_bytes"] += e.size if e else 0
        if self.large is not None:
            after = b""
            while page := self.large.scan(after, b"\xff", 4096):
                for e in self._recorded_page(page):
                    c = out[Algorithm(e.key[0]).label]
                    c["count"] += 1
                    c["large"] += 1
                    c["bytes"] += e.size
                    c["large_bytes"] += e.size
                after = page[-1].key
        return out
