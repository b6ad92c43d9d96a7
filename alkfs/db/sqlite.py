"""The sqlite engine: the store's file, one connection per thread, the posture verified.

Every table of the store (kv blobs, the delete window, repositories, refs, pins)
lives in this one file, so a multi-row change is one transaction.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pysqlite3.dbapi2 as sqlite3

from ..errors import Busy, Invalid, NoSpace, StoreIO
from . import Params, Row

BUSY_TIMEOUT_MS = 5000
GIVE_BACK_PAGES = 2048  # pages a step of give_back frees (8 MiB of 4 KiB pages)
WRITER_CACHE_KIB = 65536  # a bulk writer's page cache (see tune_bulk_writer)
WRITER_CHECKPOINT_PAGES = 2048  # 8 MiB of WAL at the default page size
# Every BACKFILL_COMMITS small puts it applies, the write-behind (alkfs/writebehind.py)
# runs a backfill (a PASSIVE checkpoint, that holds up no writer): the WAL's frames are
# written to the database file and fsynced beside the commits, and the next
# autocheckpoint copies only what arrived since.
BACKFILL_COMMITS = 128
FILE_MODE = 0o600  # the database and (as sqlite does) its -wal and -shm

# sqlite's primary result codes (the low byte of `sqlite_errorcode`) the store answers
# as errors of its own instead of letting them escape as unexpected ones.
SQLITE_BUSY, SQLITE_LOCKED, SQLITE_IOERR, SQLITE_FULL = 5, 6, 10, 13
SQLITE_IOERR_SHMSIZE = SQLITE_IOERR | (19 << 8)  # the -shm could not grow: no space


class _Joined:
    """A tx() inside another of the same thread: its connection, nothing to commit."""

    __slots__ = ("conn",)

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        return self.conn

    def __exit__(self, *exc: object) -> None:
        return None


class SqliteDatabase:
    """A sqlite file in WAL mode, `synchronous=NORMAL`, `busy_timeout=5000`, checked at open."""

    engine = "sqlite"
    arrival = "rowid"
    full_scan = "NOT INDEXED"  # (the range is read whole: the table, not the key index)

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
        # Called (no arguments, must not raise) whenever sqlite says the disk is full,
        # after the transaction was rolled back: the store's reserve (alkfs/reserve.py).
        self.on_full: Callable[[], None] | None = None
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
        try:
            # a new file gives deleted rows' pages back (`give_back`); an existing one
            # keeps its mode until `compact` (asked only of an empty file: on another
            # the pragma waits for the write lock, to do nothing)
            if conn.execute("PRAGMA page_count").fetchone()[0] == 0:
                conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        except sqlite3.Error as exc:
            conn.close()
            raise self.translate(exc) or StoreIO(f"sqlite: {self.path}: {exc}") from exc
        if str(mode).lower() != "wal":
            conn.close()
            raise StoreIO(f"sqlite: journal_mode is {mode}, WAL unavailable at {self.path}")
        # PostgreSQL's greatest(), so one dialect serves both engines (alkfs/db/__init__.py)
        conn.create_function("greatest", 2, max, deterministic=True)
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

    def translate(self, exc: BaseException, tell: bool = True) -> StoreIO | None:
        """The store's error for a sqlite failure that is not a bug: a full disk
        (NoSpace, after telling `on_full`), a lock held past the busy timeout (Busy), an
        I/O error (StoreIO); None for anything else (it stays unexpected)."""
        code = getattr(exc, "sqlite_errorcode", None)
        if not isinstance(exc, sqlite3.Error) or code is None:
            return None
        if code & 0xFF == SQLITE_FULL or code == SQLITE_IOERR_SHMSIZE:
            if tell and self.on_full is not None:
                self.on_full()
            return NoSpace(f"no space left on the device holding {self.path} (sqlite: {exc})")
        if code & 0xFF in (SQLITE_BUSY, SQLITE_LOCKED):
            return Busy(
                f"sqlite: {self.path} stayed locked for {BUSY_TIMEOUT_MS // 1000} s "
                f"({exc}); try again"
            )
        if code & 0xFF == SQLITE_IOERR:
            return StoreIO(f"sqlite: {self.path}: {exc}")
        return None

    def _raise(self, exc: BaseException, tell: bool = True) -> NoReturn:
        """Raise `exc` as `translate` has it (itself when it stays unexpected)."""
        err = self.translate(exc, tell)
        if err is None:
            raise exc
        raise err from exc

    def tx(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE): all of it commits or none of it. A
        tx() inside another of the same thread is part of it (a `_Joined`: no generator,
        as a small put's nested writes make two).

        A failing COMMIT is rolled back too (a full disk must not leave the thread's
        connection inside a transaction), and sqlite's failures leave as the store's
        errors (`translate`)."""
        conn = self.conn()
        if getattr(self._local, "in_tx", False):  # nested: part of this thread's transaction
            return _Joined(conn)
        return self._tx(conn)

    @contextlib.contextmanager
    def _tx(self, conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            self._raise(exc)
        self._local.in_tx = True
        try:
            try:
                yield conn
            finally:
                self._local.in_tx = False
        except BaseException as exc:
            if conn.in_transaction:  # (sqlite may have rolled back itself: SQLITE_FULL)
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                self._raise(exc)
            raise
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            self._raise(exc)

    def execute(self, sql: str, params: Params = ()) -> sqlite3.Cursor:
        try:
            return self.conn().execute(sql, params)
        except sqlite3.Error as exc:
            self._raise(exc)

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[sqlite3.Connection]:
        """A read transaction: its statements see one state of the file."""
        conn = self.conn()
        if conn.in_transaction:  # (inside this thread's tx: that one is consistent already)
            yield conn
            return
        try:
            conn.execute("BEGIN")
        except sqlite3.Error as exc:
            self._raise(exc)
        try:
            yield conn
        finally:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("COMMIT")

    def stream(self, sql: str, params: Params = (), batch: int = 8192) -> Iterator[Row]:
        """The rows of one query, fetched `batch` at a time."""
        cur = self.execute(sql, params)
        while rows := cur.fetchmany(batch):
            yield from rows

    def insert_rows(
        self, conn, head: str, types: tuple[str, ...], rows: list[tuple], tail: str = ""
    ) -> list:
        """Many rows, as multi-row VALUES within sqlite's 32766 parameters a statement
        (what RETURNING returns, else []); rows of one key once a statement."""
        out: list = []
        per = max(1, 32000 // max(1, len(types)))
        marks = "(" + ",".join("?" * len(types)) + ")"
        for i in range(0, len(rows), per):
            part = rows[i : i + per]
            cur = conn.execute(
                f"{head} VALUES {','.join([marks] * len(part))} {tail}",
                [x for row in part for x in row],
            )
            if "RETURNING" in tail.upper():
                out += cur.fetchall()
        return out

    def create(self, statements: list[str]) -> None:
        """Run DDL statements in one transaction."""
        with self.tx() as conn:
            for sql in statements:
                conn.execute(sql)

    def spare_bytes(self) -> int:
        """Bytes of free pages inside the file (what deleted rows left for new ones)."""
        pages = self.execute("PRAGMA freelist_count").fetchone()[0]
        return int(pages) * int(self.execute("PRAGMA page_size").fetchone()[0])

    def reclaim(self) -> None:
        """Checkpoint the WAL and truncate it (deletions grew it; the pages they freed
        are already part of the file, so this needs no new space)."""
        self.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    def incremental(self) -> bool:
        """Whether the file gives free pages back (auto_vacuum = INCREMENTAL)."""
        return int(self.execute("PRAGMA auto_vacuum").fetchone()[0]) == 2

    def give_back(self, stop: Callable[[], bool] = lambda: False) -> int:
        """Return the file's free pages to the filesystem (after a sweep's deletions):
        `incremental_vacuum` in steps of GIVE_BACK_PAGES, each its own short write
        transaction (writers wait one step at most), then the WAL truncated. A file made
        before auto_vacuum keeps its pages for new rows until `compact`. Bytes given."""
        if not self.incremental():
            return 0
        page = int(self.execute("PRAGMA page_size").fetchone()[0])
        given = 0
        while not stop():
            free = int(self.execute("PRAGMA freelist_count").fetchone()[0])
            if free == 0:
                break
            step = min(free, GIVE_BACK_PAGES)
            with self.tx():
                self.execute(f"PRAGMA incremental_vacuum({step})").fetchall()
            given += step * page
        self._truncate_wal_if_free()
        return given

    def _truncate_wal_if_free(self) -> None:
        """Checkpoint and truncate the WAL only if no reader is in it now: a TRUNCATE
        that waits (busy_timeout) would hold every writer meanwhile."""
        conn = self.conn()
        try:
            conn.execute("PRAGMA busy_timeout = 0")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error:
            pass  # (busy: the next time)
        finally:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")

    def compact(self) -> int:
        """Rewrite the file whole (VACUUM, with auto_vacuum = INCREMENTAL from now on):
        every free page goes back, whatever mode the file was made in. Needs the store
        unheld and free space of the file's size. Bytes the file shrank by."""
        before = self.path.stat().st_size
        self.execute("PRAGMA auto_vacuum = INCREMENTAL")
        self.execute("VACUUM")
        self.reclaim()
        return before - self.path.stat().st_size

    def backfill(self) -> None:
        """Copy the WAL's committed frames into the database file (a PASSIVE checkpoint:
        it takes no write lock and waits for nobody; busy, it does nothing)."""
        try:
            self.conn().execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as exc:
            code = (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF
            if code not in (SQLITE_BUSY, SQLITE_LOCKED):
                self._raise(exc)

    def tune_bulk_writer(self) -> None:
        """This thread's connection as a bulk writer's (alkfs/git/importer.py): a page
        cache that keeps the key index warm, a checkpoint every WRITER_CHECKPOINT_PAGES."""
        conn = self.conn()
        if getattr(self._local, "tuned", None) is not conn:
            conn.execute(f"PRAGMA cache_size = -{WRITER_CACHE_KIB}")
            conn.execute(f"PRAGMA wal_autocheckpoint = {WRITER_CHECKPOINT_PAGES}")
            self._local.tuned = conn

    def describe(self) -> str:
        return str(self.path)

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
