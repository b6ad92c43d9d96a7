"""The kv tier on PostgreSQL: `SqlTier` with PostgreSQL's upserts.

A put is `INSERT ... ON CONFLICT (key) DO UPDATE` (a re-put freshens), never `DO
NOTHING`: measured on PostgreSQL 15, `DO NOTHING` does not wait for another
transaction's `SELECT ... FOR UPDATE` of the row, so a put that found the row could
return while the sweep's delete, holding that lock, removes it. `DO UPDATE` waits for
the lock; if the delete commits, the put then inserts afresh. The sweep's delete
(`delete_unwritten`) decides under `FOR UPDATE`.
"""

from __future__ import annotations

from collections.abc import Sequence

from .sql import SqlTier

_PUT = (
    "INSERT INTO blobs (key, size, stored_ns, value) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (key) DO UPDATE SET stored_ns = EXCLUDED.stored_ns "
    "RETURNING (xmax = 0)"  # (true: the row was inserted, not updated)
)


class PgTier(SqlTier):
    _lock_row = " FOR UPDATE"
    _ROWS = 20000  # rows a statement (its arrays' size)

    def put(self, key: bytes, data: bytes, now_ns: int) -> bool:
        """Insert unless present (first writer wins); a re-put freshens instead."""
        row = self.db.execute(_PUT, (key, len(data), now_ns, data)).fetchone()
        return bool(row[0])

    def insert_many(self, raws: Sequence[bytes], datas: Sequence[bytes], stamp: int) -> list[bool]:
        """SqlTier.insert_many with upserts: one transaction, rows already present keep
        their bytes and count as written now; of identical keys only the first creates."""
        first: dict[bytes, int] = {}
        for i, raw in enumerate(raws):
            first.setdefault(raw, i)
        order = sorted(first)  # (key order: concurrent batches lock rows in one order)
        made: set[bytes] = set()
        with self.db.tx() as conn:
            for j in range(0, len(order), self._ROWS):
                part = order[j : j + self._ROWS]
                rows = self.db.insert_rows(
                    conn,
                    "INSERT INTO blobs (key, size, stored_ns, value)",
                    ("key", "int", "int", "key"),
                    [(raw, len(d), stamp, bytes(d)) for raw in part for d in (datas[first[raw]],)],
                    "ON CONFLICT (key) DO UPDATE SET stored_ns = EXCLUDED.stored_ns"
                    " RETURNING key, (xmax = 0)",
                )
                made.update(bytes(k) for k, inserted in rows if inserted)
        return [raw in made and first[raw] == i for i, raw in enumerate(raws)]
