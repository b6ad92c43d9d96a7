"""The store test columns and their instruments.

Every conformance row runs against one or more *columns*: a freshly opened store
of one mode over a private tmp directory (dual-tier sqlite+local, kv-only
sqlite, mem, and the two on-disk modes with their database in PostgreSQL: a
fresh database on the session's throwaway server), plus medium oracles that look at the backing media directly (a
separate sqlite connection counting rows, a walk of the large-tier directory)
so placement and residue are observed without trusting the facade.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pysqlite3.dbapi2 as sqlite3  # the store's own sqlite: see oracle_connect
import pytest

from alkfs.keys import Algorithm, Key
from alkfs.store import DB_NAME, LARGE_DIR, Store

TUNED_THRESHOLD = 1024
"""Small, so the content matrix crosses it and both tiers' bodies are exercised."""


def patterned(length: int, modulus: int) -> bytes:
    """Deterministic content: byte i is (i * 31 + 7) mod `modulus` (distinct per modulus)."""
    return bytes((i * 31 + 7) % modulus for i in range(length))


def sha256_key(data: bytes) -> Key:
    return Key.derive(Algorithm.SHA256, data)


class SetSource:
    """A liveness source backed by a set the test edits (thread-safe)."""

    def __init__(self) -> None:
        self._keys: set[bytes] = set()
        self._lock = threading.Lock()

    def add(self, key: Key) -> None:
        with self._lock:
            self._keys.add(key.raw)

    def remove(self, key: Key) -> None:
        with self._lock:
            self._keys.discard(key.raw)

    def live_keys(self) -> list[bytes]:
        with self._lock:
            return list(self._keys)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._keys


class SetProtect:
    """A protect callback returning the keys the test names."""

    def __init__(self) -> None:
        self.keys: list[Key] = []

    def __call__(self) -> list[Key]:
        return list(self.keys)


class FailingStream:
    """A readable stream that serves `fail_after` bytes of `data` and then raises."""

    def __init__(self, data: bytes, fail_after: int) -> None:
        self._data = data
        self._fail_after = fail_after
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        if self._pos >= self._fail_after:
            raise OSError("the source device went away (injected)")
        end = self._fail_after if n < 0 else min(self._fail_after, self._pos + n)
        chunk = self._data[self._pos : end]
        self._pos = end
        return chunk


def failing_chunks(data: bytes, fail_after: int, chunk: int = 64) -> Iterator[bytes]:
    """An iterable source (the other put input shape) that fails mid-stream."""
    for start in range(0, fail_after, chunk):
        yield data[start : min(start + chunk, fail_after)]
    raise OSError("the generator's upstream failed (injected)")


def chunked(data: bytes, chunk: int = 100) -> Iterator[bytes]:
    """Content as an iterable of chunks: the unknown-length put path."""
    for start in range(0, len(data), chunk):
        yield data[start : start + chunk]


def oracle_connect(root: Path) -> sqlite3.Connection:
    """A separate connection to a store's sqlite file, from the same sqlite library the
    store links. (The stdlib's copy must not be used in-process: POSIX locks are per
    process, so its close drops the store's locks and it may checkpoint away the WAL.)"""
    return sqlite3.connect(root / DB_NAME, isolation_level=None)


@dataclass
class Column:
    """One opened store of one mode, with oracles over its backing media."""

    name: str
    store: Store
    root: Path | None
    database: str | None = None  # a PostgreSQL column's URI

    @property
    def engine(self) -> str:
        return "mem" if self.store.db is None else self.store.db.engine

    def reopen(self) -> Column:
        """The same store opened again (after `store.close()`)."""
        assert self.root is not None
        return open_column(self.name, self.root.parent, self.threshold, self.database)

    @property
    def threshold(self) -> int:
        return self.store.threshold

    @property
    def mode(self) -> str:
        return self.store.mode

    @property
    def has_large_tier(self) -> bool:
        return self.store.mode == "dual-tier"

    @property
    def accepts_large(self) -> bool:
        """Whether over-threshold content can be stored at all (not kv-only)."""
        return self.store.mode != "kv-only"

    def big(self, extra: int) -> int:
        """A length for a 'large' row: over the threshold where the column takes it,
        at most the threshold on kv-only (whose rows then all live in the kv tier)."""
        if self.accepts_large:
            return 2 * self.threshold + extra
        return self.threshold - extra

    # -- the medium oracles ---------------------------------------------------
    def _sql(self, query: str) -> int:
        assert self.root is not None
        if self.database is not None:
            import psycopg

            with psycopg.connect(self.database) as pg:
                row = pg.execute(query).fetchone()
                assert row is not None
                return row[0]
        conn = oracle_connect(self.root)
        try:
            return conn.execute(query).fetchone()[0]
        finally:
            conn.close()

    def pool_rows(self) -> int:
        """Objects held by the kv tier (sqlite rows; the memory engine's entries on mem)."""
        if self.root is None:
            return len(self.store.kv.keys())
        return self._sql("SELECT count(*) FROM blobs")

    def window_rows(self) -> int:
        """Candidates waiting in the delete window."""
        if self.root is None:
            return self.store.window.rows()
        return self._sql("SELECT count(*) FROM gc_window")

    def large_files(self) -> int:
        """Committed object files under the large-tier directory (staging excluded)."""
        if not self.has_large_tier:
            return 0
        assert self.root is not None
        n = 0
        for algo in Algorithm:
            adir = self.root / LARGE_DIR / algo.label
            if adir.is_dir():
                n += sum(len(files) for _, _, files in os.walk(adir))
        return n

    def staging_files(self) -> int:
        if not self.has_large_tier:
            return 0
        assert self.root is not None
        return sum(len(files) for _, _, files in os.walk(self.root / LARGE_DIR / ".staging"))

    def media(self) -> tuple[int, int]:
        return self.pool_rows(), self.large_files()


PG = "pg-"  # a column kind's prefix: its database in PostgreSQL


def open_column(
    kind: str, base: Path, threshold: int = TUNED_THRESHOLD, database: str | None = None
) -> Column:
    """A fresh store of `kind` ("dual-tier", "kv-only", "mem", or one of the first two
    prefixed with "pg-", whose `database` is a PostgreSQL URI)."""
    if kind == "mem":
        return Column(kind, Store.memory(threshold, window_s=0), None)
    root = base / f"store-{kind}"
    mode = kind.removeprefix(PG)
    if kind.startswith(PG):
        assert database is not None
    else:
        database = None
    store = Store.open(root, mode=mode, threshold=threshold, window_s=0, database=database)
    return Column(kind, store, root, database)


def _open(request: pytest.FixtureRequest, tmp_path: Path) -> Column:
    kind = request.param
    uri = request.getfixturevalue("pg_uri") if kind.startswith(PG) else None
    return open_column(kind, tmp_path, database=uri)


DURABLE = ["dual-tier", "kv-only", "pg-dual-tier", "pg-kv-only"]


@pytest.fixture(params=["dual-tier", "kv-only", "mem", "pg-dual-tier", "pg-kv-only"])
def column(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Column]:
    """Every mode: dual-tier sqlite+local, kv-only sqlite, mem, and both on PostgreSQL."""
    col = _open(request, tmp_path)
    yield col
    col.store.close()


@pytest.fixture(params=DURABLE)
def sqlite_column(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Column]:
    """The modes backed by a database (the window is durable there): sqlite's file or
    PostgreSQL."""
    col = _open(request, tmp_path)
    yield col
    col.store.close()


@pytest.fixture
def dual(tmp_path: Path) -> Iterator[Column]:
    col = open_column("dual-tier", tmp_path)
    yield col
    col.store.close()


@pytest.fixture
def kv_only(tmp_path: Path) -> Iterator[Column]:
    col = open_column("kv-only", tmp_path)
    yield col
    col.store.close()


def register(store: Store, keys: Iterable[Key] = ()) -> SetSource:
    source = SetSource()
    for k in keys:
        source.add(k)
    store.register_source(source)
    return source
