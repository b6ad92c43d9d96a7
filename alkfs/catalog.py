"""The large tier's catalog: one row per large object, its recorded size and chunk digests.

A large object's put digests every CHUNK_SIZE bytes of it (BLAKE3: twice SHA-256's speed
here, and it releases the GIL) in the same pass that hashes and writes it, and records
the row before the file is linked into place, under the put's pin. So a read of any
range checks only the chunks it covers, and `stat` shows the recorded size whatever the
file's. A row is a pure function of the object's content (except `stored_ns`), so a row
left without its file by a crash between the commit and the link is inert: the next put
of the same content replaces it, and a sweep removes it once it is INERT_GRACE_NS old
(`Store.reap_inert_rows`; a sweep's delete removes the file first, then the row, in
its transaction). A file without a row (stored
before the catalog existed, or its row lost with the last commits of a power failure:
`synchronous=NORMAL`) is verified whole at its first read or `verify`, which records it.

The table is `catalog` in alkfs/schema.py, the same on both engines.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import blake3

from .db import Database
from .keys import Algorithm

CHUNK_SIZE = 1 << 20
CHUNK_ALGO = Algorithm.BLAKE3
DIGEST_LEN = 32  # BLAKE3 and SHA-256 alike


def chunk_digest(algo: int, data: bytes | bytearray | memoryview) -> bytes:
    if algo == Algorithm.BLAKE3.value:
        return blake3.blake3(data).digest()
    if algo == Algorithm.SHA256.value:
        return hashlib.sha256(data).digest()
    raise ValueError(f"no chunk digest algorithm {algo}")


@dataclass(frozen=True, slots=True)
class Record:
    """One catalog row (alkfs/schema.py: catalog)."""

    key: bytes
    size: int
    stored_ns: int
    chunk_size: int
    chunk_algo: int
    chunks: bytes

    @property
    def count(self) -> int:
        return len(self.chunks) // DIGEST_LEN

    def span(self, i: int) -> tuple[int, int]:
        """[start, end) of chunk i."""
        start = i * self.chunk_size
        return start, min(self.size, start + self.chunk_size)

    def covering(self, offset: int, length: int) -> range:
        """The chunks that bytes [offset, offset+length) touch (within the size)."""
        end = min(self.size, offset + length)
        if length <= 0 or offset >= end:
            return range(0)
        return range(offset // self.chunk_size, (end - 1) // self.chunk_size + 1)

    def matches(self, i: int, data: bytes | bytearray | memoryview) -> bool:
        """Whether `data` is exactly chunk i (its length and its digest)."""
        start, end = self.span(i)
        if len(data) != end - start:
            return False
        want = self.chunks[i * DIGEST_LEN : (i + 1) * DIGEST_LEN]
        return chunk_digest(self.chunk_algo, data) == want

    def consistent(self) -> bool:
        """Its digests count the chunks its size has (a row can be trusted to read by)."""
        if self.chunk_size <= 0 or self.size < 0:
            return False
        return self.count == -(-self.size // self.chunk_size)


class ChunkDigester:
    """Digests a stream CHUNK_SIZE bytes at a time as it goes (no copy of the data)."""

    __slots__ = ("chunk_size", "size", "_h", "_fill", "_out")

    def __init__(self, chunk_size: int = CHUNK_SIZE) -> None:
        self.chunk_size = chunk_size
        self.size = 0
        self._h = blake3.blake3()
        self._fill = 0
        self._out = bytearray()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        self.size += len(view)
        cs = self.chunk_size
        while view:
            room = cs - self._fill
            if self._fill == 0 and len(view) >= cs:  # whole chunks: one call each
                self._out += blake3.blake3(view[:cs]).digest()
                view = view[cs:]
                continue
            part = view[:room]
            self._h.update(part)
            self._fill += len(part)
            view = view[len(part) :]
            if self._fill == cs:
                self._out += self._h.digest()
                self._h = blake3.blake3()
                self._fill = 0

    def digests(self) -> bytes:
        """Every chunk's digest, the last (partial) one included."""
        out = bytes(self._out)
        if self._fill:
            out += self._h.digest()
        return out

    def record(self, key: bytes, stored_ns: int) -> Record:
        return Record(key, self.size, stored_ns, self.chunk_size, CHUNK_ALGO.value, self.digests())


class Catalog:
    """The catalog table of a store's database (thread-safe: one connection per thread)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def get(self, key: bytes) -> Record | None:
        row = self.db.execute(
            "SELECT size, stored_ns, chunk_size, chunk_algo, chunks FROM catalog WHERE key = ?",
            (key,),
        ).fetchone()
        if row is None:
            return None
        return Record(key, row[0], row[1], row[2], row[3], bytes(row[4]))

    def put(self, rec: Record) -> None:
        """Record (or re-record) an object: one committed statement."""
        self.db.execute(
            "INSERT INTO catalog (key, size, stored_ns, chunk_size, chunk_algo, chunks)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO UPDATE SET size = excluded.size,"
            " stored_ns = excluded.stored_ns, chunk_size = excluded.chunk_size,"
            " chunk_algo = excluded.chunk_algo, chunks = excluded.chunks",
            (rec.key, rec.size, rec.stored_ns, rec.chunk_size, rec.chunk_algo, rec.chunks),
        )

    def freshen(self, key: bytes, now_ns: int) -> None:
        self.db.execute(
            "UPDATE catalog SET stored_ns = greatest(stored_ns, ?) WHERE key = ?", (now_ns, key)
        )

    def lock(self, key: bytes) -> None:
        """Inside a transaction: hold the row until it ends (PostgreSQL; sqlite's
        transaction holds the whole file already)."""
        if self.db.engine == "postgresql":
            self.db.execute("SELECT 1 FROM catalog WHERE key = ? FOR UPDATE", (key,))

    def delete(self, key: bytes) -> None:
        self.db.execute("DELETE FROM catalog WHERE key = ?", (key,))

    def sizes(self, lo: bytes, hi: bytes) -> dict[bytes, tuple[int, int]]:
        """(size, stored_ns) of the rows with lo <= key <= hi (a listing page's range)."""
        rows = self.db.execute(
            "SELECT key, size, stored_ns FROM catalog WHERE key >= ? AND key <= ?", (lo, hi)
        )
        return {bytes(k): (size, ns) for k, size, ns in rows}

    def rows(self) -> int:
        return self.db.execute("SELECT count(*) FROM catalog").fetchone()[0]

    def stored_between(self, lo_ns: int, hi_ns: int) -> list[bytes]:
        """Keys of the rows whose stored time is in (lo_ns, hi_ns]."""
        rows = self.db.execute(
            "SELECT key FROM catalog WHERE stored_ns > ? AND stored_ns <= ?", (lo_ns, hi_ns)
        ).fetchall()
        return [bytes(k) for (k,) in rows]

    def delete_stored_by(self, key: bytes, upto_ns: int) -> bool:
        """Delete the row if it was stored at or before `upto_ns` (not re-put since)."""
        cur = self.db.execute(
            "DELETE FROM catalog WHERE key = ? AND stored_ns <= ?", (key, upto_ns)
        )
        return cur.rowcount == 1
