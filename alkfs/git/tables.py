"""Co-tenant tables in the store's database (a private in-memory sqlite one in mem mode).

Refs, repositories and durable pins live beside the kv blobs and the delete
window, so each of their changes is one transaction of the store's own database.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import pysqlite3.dbapi2 as sqlite3

from ..schema import Table, ddl

if TYPE_CHECKING:
    from ..db import Conn
    from ..store import Store


class Tables:
    """`tx()` is one write transaction; `read(sql, params)` a consistent read."""

    def __init__(self, store: Store, tables: Sequence[Table]) -> None:
        self._db = store.db  # (its tables were created at open: alkfs/schema.py)
        self._mem: sqlite3.Connection | None = None
        self._lock = threading.RLock()
        if self._db is None:
            self._mem = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            for table in tables:
                for sql in ddl(table, "sqlite"):
                    self._mem.execute(sql)

    def tx(self) -> contextlib.AbstractContextManager[Conn]:
        if self._db is not None:
            return self._db.tx()
        return self._mem_tx()

    @contextlib.contextmanager
    def _mem_tx(self) -> Iterator[sqlite3.Connection]:
        assert self._mem is not None
        with self._lock:
            self._mem.execute("BEGIN IMMEDIATE")
            try:
                yield self._mem
            except BaseException:
                self._mem.execute("ROLLBACK")
                raise
            else:
                self._mem.execute("COMMIT")

    def read(self, sql: str, params: tuple | list = ()) -> list[tuple]:
        if self._db is not None:
            return self._db.execute(sql, params).fetchall()
        assert self._mem is not None
        with self._lock:
            return self._mem.execute(sql, params).fetchall()
