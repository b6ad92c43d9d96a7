"""The delete window: staged candidates and when each becomes deletable.

Staging is idempotent and forward-only (a re-stage never moves a deadline
earlier); a take is bounded and removes what it returns (`visible_after <= now`).
The durable form lives in the store's database (either engine); mem mode keeps the
same schedule in memory.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from ..db import Database

TAKE_BATCH = 1024


class SqlWindow:
    """The window's table (alkfs/schema.py: gc_window)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def stage(self, rows: Iterable[tuple[bytes, int]], staged_ns: int) -> int:
        """Stage (key, visible_after) rows in one transaction; returns how many."""
        params = [(k, v, staged_ns) for k, v in rows]
        if not params:
            return 0
        if len({k for k, _, _ in params}) != len(params):  # (one row a key a statement)
            latest: dict[bytes, int] = {}
            for k, v, _ in params:
                latest[k] = v if k not in latest else max(latest[k], v)
            params = [(k, v, staged_ns) for k, v in latest.items()]
        with self.db.tx() as conn:  # (few statements: PostgreSQL's executemany is row by row)
            self.db.insert_rows(
                conn,
                "INSERT INTO gc_window (key, visible_after, staged_ns)",
                ("key", "int", "int"),
                params,
                "ON CONFLICT(key) DO UPDATE SET "
                "visible_after = greatest(gc_window.visible_after, excluded.visible_after)",
            )
        return len(params)

    def take(self, now_ns: int, limit: int = TAKE_BATCH) -> list[tuple[bytes, int]]:
        """Remove and return up to `limit` overdue rows as (key, staged_ns), oldest first."""
        with self.db.tx() as conn:
            rows = conn.execute(
                "DELETE FROM gc_window WHERE key IN ("
                " SELECT key FROM gc_window WHERE visible_after <= ?"
                " ORDER BY visible_after LIMIT ?) RETURNING key, staged_ns",
                (now_ns, limit),
            ).fetchall()
        return sorted((bytes(k), s) for k, s in rows)

    def staged_keys(self) -> set[bytes]:
        return {k for (k,) in self.db.stream("SELECT key FROM gc_window")}

    def staged_between(self, lo: bytes, hi: bytes) -> set[bytes]:
        """The staged keys k with lo <= k <= hi."""
        return {
            bytes(k)
            for (k,) in self.db.execute(
                "SELECT key FROM gc_window WHERE key >= ? AND key <= ?", (lo, hi)
            ).fetchall()
        }

    def page(self, after: bytes, limit: int) -> list[tuple[bytes, int]]:
        """Up to `limit` staged (key, visible_after) in key order after `after`."""
        rows = self.db.execute(
            "SELECT key, visible_after FROM gc_window WHERE key > ? ORDER BY key LIMIT ?",
            (after, limit),
        ).fetchall()
        return [(bytes(k), v) for k, v in rows]

    def totals(self) -> tuple[int, int, int | None]:
        """(staged candidates, their bytes, the earliest deadline or None)."""
        count, size, first = self.db.execute(
            "SELECT count(*), coalesce(sum(coalesce(b.size, c.size, 0)), 0), "
            "min(w.visible_after) FROM gc_window w "
            "LEFT JOIN blobs b ON b.key = w.key LEFT JOIN catalog c ON c.key = w.key"
        ).fetchone()
        return int(count), int(size), None if first is None else int(first)

    def rows(self) -> int:
        return self.db.execute("SELECT count(*) FROM gc_window").fetchone()[0]

    def visible_after(self, key: bytes) -> int | None:
        row = self.db.execute(
            "SELECT visible_after FROM gc_window WHERE key = ?", (key,)
        ).fetchone()
        return None if row is None else row[0]


class MemoryWindow:
    def __init__(self) -> None:
        self._rows: dict[bytes, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def stage(self, rows: Iterable[tuple[bytes, int]], staged_ns: int) -> int:
        # Validated in full before anything changes: all or nothing, like the durable form.
        params = [(bytes(k), int(v)) for k, v in rows]
        with self._lock:
            for k, v in params:
                old = self._rows.get(k)
                self._rows[k] = (max(v, old[0]), old[1]) if old else (v, staged_ns)
        return len(params)

    def take(self, now_ns: int, limit: int = TAKE_BATCH) -> list[tuple[bytes, int]]:
        with self._lock:
            due = sorted((v, k) for k, (v, _) in self._rows.items() if v <= now_ns)[:limit]
            return sorted((k, self._rows.pop(k)[1]) for _, k in due)

    def staged_keys(self) -> set[bytes]:
        with self._lock:
            return set(self._rows)

    def staged_between(self, lo: bytes, hi: bytes) -> set[bytes]:
        with self._lock:
            return {k for k in self._rows if lo <= k <= hi}

    def page(self, after: bytes, limit: int) -> list[tuple[bytes, int]]:
        with self._lock:
            keys = sorted(k for k in self._rows if k > after)[:limit]
            return [(k, self._rows[k][0]) for k in keys]

    def rows(self) -> int:
        return len(self._rows)

    def visible_after(self, key: bytes) -> int | None:
        row = self._rows.get(key)
        return None if row is None else row[0]
