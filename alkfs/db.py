"""The store's sqlite file: one connection per thread, the durability posture verified.

Every table of the store (kv blobs, the delete window, repositories, refs, pins)
lives in this one file, so a multi-row change is one transaction.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pysqlite3.dbapi2 as sqlite3

from .errors import Invalid, StoreIO

BUSY_TIMEOUT_MS = 5000
FILE_MODE = 0o600  # the database and (as sqlite does) its -wal and -shm


def now_ns() -> int:
    return time.time_ns()


class Database:
    """A sqlite file in WAL mode, `synchronous=NORMAL`, `busy_timeout=5000`, checked at open."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        text = os.fspath(path)
        if text == ":memory:" or text.startswith("file::memory:") or text == "":
            raise Invalid("an in-memory sqlite database cannot hold the WAL posture")
        self.path = Path(text)
        self._create_private()
        self._local = threading.local()
        self._all: dict[int, sqlite3.Connection] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.conn()  # open now so a bad posture is a construction error

    def _create_private(self) -> None:
        """A new database file is created here, 0600: sqlite would make it 0644 minus the
        umask, and it creates `-wal` and `-shm` with the database file's permissions, so
        all three are the owner's alone (a shared lock another user held on one byte of
        `-shm` would fail every write)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            os.close(os.open(self.path, flags, FILE_MODE))
        except FileExistsError:
            pass
        except OSError as exc:
            raise StoreIO(f"sqlite: cannot create {self.path}: {exc.strerror}") from exc

    def _open(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=5.0
            )
        except sqlite3.Error as exc:
            raise StoreIO(f"sqlite: cannot open {self.path}: {exc}") from exc
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            conn.close()
            raise StoreIO(f"sqlite: journal_mode is {mode}, WAL unavailable at {self.path}")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        if self.pragma_of(conn, "synchronous") != 1 or (
            self.pragma_of(conn, "busy_timeout") != BUSY_TIMEOUT_MS
        ):
            conn.close()
            raise StoreIO("sqlite: the durability pragmas did not take")
        return conn

    @staticmethod
    def pragma_of(conn: sqlite3.Connection, name: str) -> object:
        return conn.execute(f"PRAGMA {name}").fetchone()[0]

    def pragma(self, name: str) -> object:
        """The live connection's value of a pragma (the posture tests' probe)."""
        return self.pragma_of(self.conn(), name)

    def conn(self) -> sqlite3.Connection:
        slot = getattr(self._local, "slot", None)
        if slot is None or self._closed:
            if self._closed:
                raise StoreIO("the store is closed")
            conn = self._open()
            slot = _Slot(conn)
            self._local.slot = slot
            with self._lock:
                self._all[id(conn)] = conn
            # Closed when its thread ends (the thread-local slot goes with it): a
            # daemon's worker threads come and go, their connections must not pile up.
            weakref.finalize(slot, self._retire, conn)
        return slot.conn

    def _retire(self, conn: sqlite3.Connection) -> None:
        with self._lock:
            self._all.pop(id(conn), None)
        with contextlib.suppress(sqlite3.Error):
            conn.close()

    @contextlib.contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE): all of it commits or none of it."""
        conn = self.conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        else:
            conn.execute("COMMIT")

    def execute(self, sql: str, params: tuple | list = ()) -> sqlite3.Cursor:
        return self.conn().execute(sql, params)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._all = list(self._all.values()), {}
        for conn in conns:
            with contextlib.suppress(sqlite3.Error):
                conn.close()


class _Slot:
    """One thread's connection; its finalizer closes the connection with the thread."""

    __slots__ = ("conn", "__weakref__")

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn


Error = sqlite3.Error
