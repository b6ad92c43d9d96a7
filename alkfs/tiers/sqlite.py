"""The sqlite kv engine: `blobs(key, size, stored_ns, value)` in the store's database file."""

from __future__ import annotations

from collections.abc import Iterator
from operator import itemgetter

from ..db import Database
from . import Entry

SCHEMA = """
CREATE TABLE IF NOT EXISTS blobs (
    key BLOB PRIMARY KEY,
    size INTEGER NOT NULL,
    stored_ns INTEGER NOT NULL,
    value BLOB NOT NULL
);
"""


class SqliteTier:
    """Small objects as rows. `size` sits before `value` so metadata never reads the blob."""

    name = "kv"

    def __init__(self, db: Database) -> None:
        self.db = db
        db.conn().executescript(SCHEMA)

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
                "INSERT OR IGNORE INTO blobs (key, size, stored_ns, value) VALUES (?, ?, ?, ?)",
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

    def scan(self, after: bytes, before: bytes, limit: int) -> list[Entry]:
        rows = self.db.execute(
            "SELECT key, size, stored_ns FROM blobs WHERE key > ? AND key < ? ORDER BY key LIMIT ?",
            (after, before, limit),
        ).fetchall()
        return [Entry(bytes(k), s, t) for k, s, t in rows]

    def iter_keys(self) -> Iterator[bytes]:
        """Every key, in one pass of the key index (the sweep's mark scan)."""
        yield from map(itemgetter(0), self.db.conn().execute("SELECT key FROM blobs"))

    def rows(self) -> int:
        return self.db.execute("SELECT count(*) FROM blobs").fetchone()[0]
