"""`Derived`'s reads of the store's objects of its format: straight from the kv table,
verified (a corrupt one is logged and left out), by scan, by row id, or by digest."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ...errors import StoreIO
from ...tiers.sql import SqlTier
from .sets import Generation, _hash

if TYPE_CHECKING:
    from ...keys import Algorithm
    from ...store import Store

log = logging.getLogger("alkfs.packs")


class KvRead:
    """A mixin of `Derived` (builder.py): the kv objects of its format. Needs only the
    store and the format."""

    store: Store
    fmt: str
    algo: Algorithm

    if TYPE_CHECKING:  # (drain.py: Derived's other part)

        @property
        def primary(self) -> bool: ...
        def packed_values(self, digests: list[bytes]) -> Iterator[tuple[bytes, bytes]]: ...

    def _kv(self) -> SqlTier:
        kv = self.store.kv
        if not isinstance(kv, SqlTier):
            raise StoreIO("derived packs need a store on disk")
        return kv

    def _range(self) -> tuple[bytes, bytes]:
        return bytes([self.algo.value]), bytes([self.algo.value + 1])

    @property
    def _records_left_out(self) -> bool:
        """Whether a set's record of what it left out is the whole truth: on sqlite,
        whose single writer numbers rows in commit order, so no row committed after the
        build's snapshot has a number at or below its max_rowid. PostgreSQL numbers rows
        (`seq`) when they are inserted, not when they commit: a row whose transaction was
        still open at the snapshot has a lower number than rows it saw, so only a scan
        finds it. There no set records it (and none is trusted)."""
        return self._kv().db.engine == "sqlite"

    def left_out(self, gen: Generation) -> list[bytes] | None:
        """What `gen` recorded it left out; None where only a scan tells."""
        return gen.left_out() if self._records_left_out else None

    def still_left_out(self, gen: Generation) -> list[bytes] | None:
        """`left_out(gen)` less those deleted since (a new set's record carries them)."""
        before = self.left_out(gen)
        if before:
            tag = bytes([self.algo.value])
            have = self._kv().present([tag + d for d in before])
            before = [d for d in before if tag + d in have]
        return before

    def max_rowid(self) -> int:
        return self._kv().high_water()

    def new_since(self, gen: Generation | None) -> int:
        """How many kv objects of the format arrived after `gen` was built."""
        lo, hi = self._range()
        after = 0 if gen is None else int(gen.meta.get("max_rowid", 0))
        return self._kv().count_arrived(lo, hi, after)

    def arrived(self, after: int, upto: int | None = None) -> list[bytes]:
        """The digests of the format's kv objects whose row ids are in (after, upto]."""
        lo, hi = self._range()
        return [k[1:] for k in self._kv().arrived(lo, hi, after, upto=upto)]

    def _scan(self) -> tuple[dict[bytes, bytes], list[bytes], list[bytes], int]:
        """Every non-blob of the format (verified, digest -> bytes), the blob digests, the
        corrupt ones (logged), and the highest row id seen (read in the same transaction)."""
        lo, hi = self._range()
        kv = self._kv()
        digest = _hash(self.fmt)
        objects: dict[bytes, bytes] = {}
        blobs: list[bytes] = []
        corrupt: list[bytes] = []
        with kv.db.snapshot() as conn:
            top = kv.high_water(conn)
            for key, value in kv.git_range(lo, hi, conn):
                d = key[1:]
                if value is None:
                    blobs.append(d)
                elif digest(value).digest() == d:
                    objects[d] = value
                else:
                    log.error("derived %s: corrupt object %s left out", self.fmt, d.hex())
                    corrupt.append(d)
        return objects, blobs, corrupt, top

    def _scan_kinds(self) -> tuple[dict[bytes, bytes], int]:
        """digest -> the first two bytes of the type ("co", "tr", "bl", "ta") of every kv
        object of the format, and the highest row id, read in one transaction."""
        lo, hi = self._range()
        kv = self._kv()
        kinds: dict[bytes, bytes] = {}
        with kv.db.snapshot() as conn:
            top = kv.high_water(conn)
            for key, kind in kv.kinds_range(lo, hi, conn):
                kinds[key[1:]] = kind
        return kinds, top

    def _read_many(self, digests: list[bytes]) -> Iterator[tuple[bytes, bytes]]:
        """(digest, verified canonical bytes) for these objects (corrupt/absent skipped):
        from the kv, and those the kv lacks from the published set when its packs are
        their only copy (drain.py)."""
        prefix = bytes([self.algo.value])
        digest = _hash(self.fmt)
        found: set[bytes] = set()
        for n, (key, value) in enumerate(self._kv().values([prefix + d for d in digests])):
            self.store.check_stopping(n)
            d = key[1:]
            found.add(d)
            if digest(value).digest() == d:
                yield d, value
            else:
                log.error("derived %s: corrupt object %s left out", self.fmt, d.hex())
        if len(found) < len(digests) and self.primary:
            yield from self.packed_values([d for d in digests if d not in found])
