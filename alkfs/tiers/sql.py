"""The SQL kv tier: `blobs(key, size, stored_ns, value)` in the store's database.

`SqlTier` runs on the sqlite engine as it is; `PgTier` (alkfs/tiers/postgres.py) changes
what PostgreSQL does differently (the upserts). The bulk fast paths of the importer,
the closure walk and the derived packs are methods here, so no module above the tiers
holds SQL of the kv table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter

from ..db import Database
from . import Entry

BLOB_PREFIX = b"blob "  # a git blob's canonical header starts with it
IN_BATCH = 500  # keys an IN (...) list of values
PRESENT_BATCH = 8000  # keys a presence query (within sqlite's 32766 parameters)


class SqlTier:
    """Small objects as rows. `size` sits before `value` so metadata never reads the blob."""

    name = "kv"

    def __init__(self, db: Database) -> None:
        self.db = db  # (its tables were created with the store's schema: alkfs/schema.py)

    # -- one object ----------------------------------------------------------------
    def stat(self, key: bytes) -> Entry | None:
        row = self.db.execute("SELECT size, stored_ns FROM blobs WHERE key = ?", (key,)).fetchone()
        return None if row is None else Entry(key, row[0], row[1])

    def read(self, key: bytes) -> bytes | None:
        row = self.db.execute("SELECT value FROM blobs WHERE key = ?", (key,)).fetchone()
        return None if row is None else bytes(row[0])

    def put(self, key: bytes, data: bytes, now_ns: int) -> bool:
        """Insert unless present (first writer wins); a re-put freshens instead."""
        with self.db.tx() as conn:
            cur = conn.execute(
                "INSERT INTO blobs (key, size, stored_ns, value) VALUES (?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                (key, len(data), now_ns, data),
            )
            if cur.rowcount == 1:
                return True
            conn.execute("UPDATE blobs SET stored_ns = ? WHERE key = ?", (now_ns, key))
            return False

    def freshen(self, key: bytes, now_ns: int) -> bool:
        cur = self.db.execute("UPDATE blobs SET stored_ns = ? WHERE key = ?", (now_ns, key))
        return cur.rowcount == 1

    def delete(self, key: bytes) -> int | None:
        row = self.db.execute("DELETE FROM blobs WHERE key = ? RETURNING size", (key,)).fetchone()
        return None if row is None else row[0]

    def delete_unwritten(
        self, key: bytes, staged_ns: int, keep: Callable[[bytes], bool] | None = None
    ) -> int | None | bool:
        """The sweep's delete of a staged candidate, decided under the row's lock: the
        bytes freed; None if absent; False if it was written after `staged_ns`, or
        `keep` says so (the fleet's pins), and is kept."""
        with self.db.tx() as conn:
            row = conn.execute(
                "SELECT stored_ns FROM blobs WHERE key = ?" + self._lock_row, (key,)
            ).fetchone()
            if row is None:
                return None
            if row[0] > staged_ns or (keep is not None and keep(key)):
                return False
            self._between_lock_and_delete(key)
            got = conn.execute("DELETE FROM blobs WHERE key = ? RETURNING size", (key,)).fetchone()
            return None if got is None else got[0]

    _lock_row = ""  # (sqlite: the transaction holds the file's write lock already)

    def _between_lock_and_delete(self, key: bytes) -> None:
        """A seam for the put-vs-delete race test (alkfs/tiers/postgres.py)."""

    # -- many objects ----------------------------------------------------------------
    _ROWS = 8191  # rows an INSERT statement: 4 parameters each, within sqlite's 32766

    def insert_many(self, raws: Sequence[bytes], datas: Sequence[bytes], stamp: int) -> list[bool]:
        """Insert (key, content) rows in one transaction, in the order given; rows
        already present keep their bytes and count as written now. Which rows created
        their entry (of identical keys, only the first). The caller has pinned every key.

        Multi-row INSERTs (sqlite releases the GIL once for thousands of rows, not once
        a row) with the blobs bound as bytearray, which pysqlite binds directly (a bytes
        parameter first goes through two failing adapter-protocol attribute lookups)."""
        n = len(raws)
        created = [True] * n
        inserted = 0
        with self.db.tx() as conn:
            for j in range(0, n, self._ROWS):
                part = datas[j : j + self._ROWS]
                m = len(part)
                params: list[object] = [stamp] * (4 * m)
                params[0::4] = map(bytearray, raws[j : j + m])
                params[1::4] = map(len, part)
                params[3::4] = map(bytearray, part)
                inserted += conn.execute(
                    "INSERT INTO blobs (key, size, stored_ns, value) VALUES "
                    + ",".join(["(?,?,?,?)"] * m)
                    + " ON CONFLICT DO NOTHING",
                    params,
                ).rowcount
            if inserted != n:
                # Some were present: they keep their bytes and count as written now.
                old: set[bytes] = set()
                fresh = sorted(set(raws))
                for j in range(0, len(fresh), IN_BATCH):
                    chunk = list(map(bytearray, fresh[j : j + IN_BATCH]))
                    marks = ",".join("?" * len(chunk))
                    old.update(
                        bytes(k)
                        for (k,) in conn.execute(
                            f"SELECT key FROM blobs WHERE stored_ns != ? AND key IN ({marks})",
                            (stamp, *chunk),
                        )
                    )
                conn.executemany(
                    "UPDATE blobs SET stored_ns = ? WHERE key = ?",
                    [(stamp, bytearray(raw)) for raw in sorted(old)],
                )
                created = [raw not in old for raw in raws]
        return created

    def insert_absent(self, raws: Sequence[bytes], datas: Sequence[bytes], stamp: int) -> int:
        """Insert the rows not present, stored at `stamp`; a present row is left as it is
        (its bytes and its stored time: a write that came first stays a write). Returns how
        many were inserted. (Git objects the packs alone held, written back loose.)"""
        inserted = 0
        with self.db.tx() as conn:
            for raw, data in zip(raws, datas, strict=True):
                inserted += conn.execute(
                    "INSERT INTO blobs (key, size, stored_ns, value) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT DO NOTHING",
                    (bytearray(raw), len(data), stamp, bytearray(data)),
                ).rowcount
        return inserted

    def delete_range(self, lo: bytes, hi: bytes, expect: int) -> int:
        """Delete the rows lo <= key <= hi in one statement, if there are `expect` of
        them (else nothing: rows arrived meanwhile); how many."""
        with self.db.tx() as conn:
            n = conn.execute(
                "SELECT count(*) FROM blobs WHERE key >= ? AND key <= ?", (lo, hi)
            ).fetchone()[0]
            if n != expect:
                return 0
            return conn.execute("DELETE FROM blobs WHERE key >= ? AND key <= ?", (lo, hi)).rowcount

    def delete_many(self, raws: Sequence[bytes]) -> int:
        """Delete these rows in one transaction; how many there were. (Git objects a
        published pack holds: alkfs/git/packs/drain.py.)"""
        gone = 0
        with self.db.tx() as conn:
            for i in range(0, len(raws), IN_BATCH):
                chunk = list(map(bytearray, raws[i : i + IN_BATCH]))
                marks = ",".join("?" * len(chunk))
                gone += conn.execute(f"DELETE FROM blobs WHERE key IN ({marks})", chunk).rowcount
        return gone

    def present(self, raws: Sequence[bytes]) -> set[bytes]:
        """Which of these keys the tier holds: one pass over their key range when they
        are most of the table, batched lookups otherwise."""
        have: set[bytes] = set()
        if not raws:
            return have
        if self.high_water() <= 2 * len(raws):
            lo, hi = bytearray(min(raws)), bytearray(max(raws))
            have.update(
                bytes(k)
                for (k,) in self.db.stream(
                    "SELECT key FROM blobs WHERE key >= ? AND key <= ?", (lo, hi)
                )
            )
            return have
        for i in range(0, len(raws), PRESENT_BATCH):
            # bytearray parameters: pysqlite binds them directly (bytes go through adapters)
            chunk = list(map(bytearray, raws[i : i + PRESENT_BATCH]))
            marks = ",".join("?" * len(chunk))
            have.update(
                bytes(k)
                for (k,) in self.db.execute(f"SELECT key FROM blobs WHERE key IN ({marks})", chunk)
            )
        return have

    def values(self, raws: Sequence[bytes]) -> Iterator[tuple[bytes, bytes]]:
        """(key, stored bytes, unverified) of those of these keys the tier holds."""
        for i in range(0, len(raws), IN_BATCH):
            chunk = list(map(bytearray, raws[i : i + IN_BATCH]))
            marks = ",".join("?" * len(chunk))
            for key, value in self.db.execute(
                f"SELECT key, value FROM blobs WHERE key IN ({marks})", chunk
            ).fetchall():
                yield bytes(key), bytes(value)

    def count_range(self, lo: bytes, hi: bytes, limit: int) -> int:
        """Rows with lo <= key < hi, counted up to `limit`."""
        return self.db.execute(
            "SELECT count(*) FROM (SELECT 1 FROM blobs WHERE key >= ? AND key < ? LIMIT ?) AS r",
            (lo, hi, limit),
        ).fetchone()[0]

    def git_range(self, lo: bytes, hi: bytes, conn=None) -> Iterator[tuple[bytes, bytes | None]]:
        """(key, value) of every row with lo <= key < hi, the value None for git blobs
        (a whole-range read: the derived packs' and the closure walk's one pass)."""
        sql = (
            "SELECT key, CASE WHEN substr(value, 1, 5) != ? THEN value END "
            f"FROM blobs {self.db.full_scan} WHERE key >= ? AND key < ?"
        )
        params = (BLOB_PREFIX, lo, hi)
        rows = self.db.stream(sql, params) if conn is None else _batches(conn, sql, params)
        for key, value in rows:
            yield bytes(key), None if value is None else bytes(value)

    def kinds_range(self, lo: bytes, hi: bytes, conn) -> Iterator[tuple[bytes, bytes]]:
        """(key, first two bytes of the value) of every row with lo <= key < hi."""
        sql = "SELECT key, substr(value, 1, 2) FROM blobs WHERE key >= ? AND key < ?"
        for key, kind in _batches(conn, sql, (lo, hi)):
            yield bytes(key), bytes(kind)

    # -- arrival order (what derived packs build from) ---------------------------------
    def high_water(self, conn=None) -> int:
        """The arrival number of the newest row (0: none); later rows get higher ones."""
        sql = f"SELECT coalesce(max({self.db.arrival}), 0) FROM blobs"
        return (conn or self.db).execute(sql).fetchone()[0]

    def arrived(
        self, lo: bytes, hi: bytes, after: int, upto: int | None = None, conn=None
    ) -> Iterator[bytes]:
        """Keys with lo <= key < hi that arrived after `after` (and at or before `upto`)."""
        a = self.db.arrival
        sql = f"SELECT key FROM blobs WHERE {a} > ? AND key >= ? AND key < ?"
        params: tuple = (after, lo, hi)
        if upto is not None:
            sql += f" AND {a} <= ?"
            params += (upto,)
        rows = self.db.stream(sql, params) if conn is None else _batches(conn, sql, params)
        for (key,) in rows:
            yield bytes(key)

    def arrived_values(
        self, lo: bytes, hi: bytes, after: int, conn
    ) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) of the rows with lo <= key < hi that arrived after `after`."""
        sql = f"SELECT key, value FROM blobs WHERE {self.db.arrival} > ? AND key >= ? AND key < ?"
        for key, value in _batches(conn, sql, (after, lo, hi)):
            yield bytes(key), bytes(value)

    def count_arrived(self, lo: bytes, hi: bytes, after: int) -> int:
        a = self.db.arrival
        return self.db.execute(
            f"SELECT count(*) FROM blobs WHERE {a} > ? AND key >= ? AND key < ?", (after, lo, hi)
        ).fetchone()[0]

    # -- the whole tier ------------------------------------------------------------------
    def scan(self, after: bytes, before: bytes, limit: int) -> list[Entry]:
        rows = self.db.execute(
            "SELECT key, size, stored_ns FROM blobs WHERE key > ? AND key < ? ORDER BY key LIMIT ?",
            (after, before, limit),
        ).fetchall()
        return [Entry(bytes(k), s, t) for k, s, t in rows]

    def iter_keys(self) -> Iterator[bytes]:
        """Every key, in one pass of the key index (the sweep's mark scan)."""
        yield from map(itemgetter(0), self.db.stream("SELECT key FROM blobs"))

    def counts(self) -> list[tuple[int, int, int]]:
        """(algorithm byte, rows, bytes) per algorithm."""
        rows = self.db.execute(
            "SELECT substr(key, 1, 1), count(*), coalesce(sum(size), 0) FROM blobs GROUP BY 1"
        ).fetchall()
        return [(bytes(b)[0], n, int(size)) for b, n, size in rows]

    def rows(self) -> int:
        return self.db.execute("SELECT count(*) FROM blobs").fetchone()[0]


def _batches(conn, sql: str, params: tuple) -> Iterator[tuple]:
    cur = conn.execute(sql, params)
    while rows := cur.fetchmany(8192):
        yield from rows
