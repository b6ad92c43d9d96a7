"""The store's database: one seam, two engines (a sqlite file, a PostgreSQL database).

Everything above this package (`store`, `gc`, `catalog`, `git/refs`, `pins`) writes one
dialect: `?` placeholders, `INSERT ... ON CONFLICT`, `RETURNING`, `greatest()`, and the
column names of `alkfs/schema.py`. Each engine runs it with the same semantics:

- `tx()`: one write transaction; write transactions of a store run one at a time (sqlite's
  `BEGIN IMMEDIATE`; PostgreSQL: a transaction-scoped advisory lock), all or nothing.
- `execute(sql, params)`: one statement on its own (inside a `tx()` of the same thread,
  part of it); `fetchone`/`fetchall`/iteration/`rowcount` on what it returns.
- `snapshot()`: a read-only transaction whose statements see one state of the database.
- `stream(sql, params)`: the rows of a big query, fetched in batches.
- `insert_rows(conn, "INSERT INTO t (a, b)", ("key", "int"), rows, tail)`: many rows in
  few statements (sqlite: multi-row VALUES; PostgreSQL: `unnest` of one array a column,
  three parameters however many rows); `tail` may be `ON CONFLICT ...` and `RETURNING`.
- failures that are not bugs leave as the store's errors (`translate`): `NoSpace`,
  `Busy`, `StoreIO` (a lost connection is `StoreIO`: EIO through the mount).

The kv tier's fast paths (`alkfs/tiers/sql.py`, `alkfs/tiers/postgres.py`) are the only
SQL that differs between the engines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeAlias

import pysqlite3.dbapi2 as sqlite3


def now_ns() -> int:
    return time.time_ns()


# A row as the driver hands it: a tuple whose columns' types follow from the SQL text
# (int, bytes, str, float or None), which no checker can see. The drivers' own stubs say
# as much (typeshed's sqlite3 `Cursor.fetchone() -> Any`, psycopg's `TupleRow =
# tuple[Any, ...]`); this is the one place that Any is spelled (this module is exempt
# from disallow_any_explicit in pyproject.toml for it): each query's reader states its
# columns' types by how it uses them.
Row: TypeAlias = Any
# A statement's parameters (`?` placeholders: a sequence, as both drivers take them).
Params: TypeAlias = Sequence[object]


class Rows(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Row: ...  # (None past the last row)

    def fetchall(self) -> list[Row]: ...

    def fetchmany(self, size: int = ...) -> list[Row]: ...

    def __iter__(self) -> Iterator[Row]: ...


class Conn(Protocol):
    """A connection inside a transaction (what `tx()` and `snapshot()` yield)."""

    def execute(self, sql: str, params: Params = ()) -> Rows: ...

    def executemany(self, sql: str, params: Iterable[Params]) -> Rows: ...


class Database(Protocol):
    engine: str  # "sqlite" | "postgresql"
    arrival: str  # the kv column giving arrival order ("rowid" | "seq")
    full_scan: str  # a FROM-clause hint that a query reads the whole range

    def tx(self) -> AbstractContextManager[Conn]: ...

    def snapshot(self) -> AbstractContextManager[Conn]: ...

    def execute(self, sql: str, params: Params = ()) -> Rows: ...

    def stream(self, sql: str, params: Params = (), batch: int = 8192) -> Iterator[Row]: ...

    def create(self, statements: list[str]) -> None: ...

    def insert_rows(
        self, conn: Conn, head: str, types: tuple[str, ...], rows: list[tuple], tail: str = ""
    ) -> list[Row]: ...

    def translate(self, exc: BaseException) -> Exception | None: ...

    def spare_bytes(self) -> int: ...

    def reclaim(self) -> None: ...

    def backfill(self) -> None: ...

    def give_back(self, stop: Callable[[], bool] = ...) -> int: ...

    def compact(self) -> int: ...

    def tune_bulk_writer(self) -> None: ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


def errors() -> tuple[type[BaseException], ...]:
    """The exception classes of every engine's driver (what a sweep ends on as report data)."""
    out: list[type[BaseException]] = [sqlite3.Error]
    try:
        import psycopg
        import psycopg_pool

        out += [psycopg.Error, psycopg_pool.PoolTimeout]
    except ImportError:  # (the PostgreSQL engine is optional)
        pass
    return tuple(out)


Error = errors()
