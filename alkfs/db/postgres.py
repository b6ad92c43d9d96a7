"""The PostgreSQL engine: the store's tables in a PostgreSQL database (psycopg 3).

psycopg's synchronous API with a `psycopg_pool.ConnectionPool`, called from worker
threads as the rest of the library is. The semantics are the sqlite engine's:

- write transactions run one at a time: each takes a transaction-scoped advisory lock
  (`pg_advisory_xact_lock`) first, as sqlite's `BEGIN IMMEDIATE` takes the file's write
  lock, so the read-check-write steps of refs, pins and the window need nothing more;
- a thread inside a `tx()` or `snapshot()` runs its other statements on the same
  connection (as sqlite's per-thread connection does);
- `?` placeholders are rewritten to psycopg's `%s` once per statement text;
- a lost connection is `StoreIO` (EIO through the mount) and the pool reconnects;
- one store per database at a time: a session advisory lock on a connection of its own
  (`pg_try_advisory_lock`), held while the store is open with `lock=True`.

A password in the URI is never shown: every message names the database by `redact(uri)`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import NoReturn

import psycopg
import psycopg_pool
from psycopg import errors as pgerrors
from psycopg.rows import TupleRow

from ..errors import Busy, Invalid, NoSpace, StoreIO, StoreLocked
from . import Params, Row, Rows
from .uri import redact

WRITER_LOCK = 0x616C6B66_73777274  # "alkfswrt": every write transaction takes it
WRITE_BOUND_S = 60.0  # how long a stalled writer may hold WRITER_LOCK (a fleet: its TTL)
STORE_LOCK = 0x616C6B66_73746F72  # "alkfstor": held by the one daemon (or CLI) of the store
POOL_MAX = 24  # above the daemon's 16 worker threads, the importer's writer and the sweep
CONNECT_TIMEOUT_S = 10
# What one daemon holds at most: the pool, the store's lock, the fleet's listener and the
# sweep lease (docs/operations.md, "Connections"; a statement opens one of its own only
# while the pool has none to give, after a server restart).
CONNECTIONS_EACH = POOL_MAX + 3
QUICK_S = 1.0  # how long a statement waits for a pooled connection before its own

log = logging.getLogger("alkfs.db")


class _Result:
    """The rows of one statement run outside a transaction (fetched whole; the
    connection went back to the pool)."""

    __slots__ = ("rows", "rowcount", "_i")

    def __init__(self, rows: list[Row], rowcount: int) -> None:
        self.rows = rows
        self.rowcount = rowcount
        self._i = 0

    def fetchone(self) -> Row:  # (None past the last row)
        if self._i >= len(self.rows):
            return None
        self._i += 1
        return self.rows[self._i - 1]

    def fetchall(self) -> list[Row]:
        out = self.rows[self._i :]
        self._i = len(self.rows)
        return out

    def fetchmany(self, size: int = 8192) -> list[Row]:
        out = self.rows[self._i : self._i + size]
        self._i += len(out)
        return out

    def __iter__(self) -> Iterator[Row]:
        return iter(self.fetchall())


_SQL: dict[str, str] = {}
_TYPE = {"key": "bytea", "int": "bigint", "text": "text"}


def pg_sql(sql: str) -> str:
    """A statement in the store's dialect (`?` placeholders) as psycopg takes it."""
    out = _SQL.get(sql)
    if out is None:
        if "%" in sql:
            raise Invalid("a store statement may not contain '%'")
        out = _SQL[sql] = sql.replace("?", "%s")
    return out


class _Conn:
    """A pooled connection inside a transaction, taking the store's dialect."""

    __slots__ = ("raw", "_named", "_n", "_cursors")

    def __init__(self, raw: psycopg.Connection, named: bool) -> None:
        self.raw = raw
        self._named = named  # a snapshot: SELECTs stream through server-side cursors
        self._n = 0
        self._cursors: list[psycopg.ServerCursor[TupleRow]] = []

    def close_cursors(self) -> None:
        """Close the server-side cursors of the transaction (before it ends)."""
        for cur in self._cursors:
            with contextlib.suppress(Exception):
                cur.close()
        self._cursors.clear()

    def execute(self, sql: str, params: Params = ()) -> Rows:
        if self._named and sql.lstrip()[:6].upper() == "SELECT":
            self._n += 1
            cur = self.raw.cursor(name=f"alkfs_{self._n}")
            cur.itersize = 8192
            self._cursors.append(cur)
            return cur.execute(pg_sql(sql), params or None)
        return self.raw.execute(pg_sql(sql), params or None)

    def executemany(self, sql: str, params: Iterable[Params]) -> Rows:
        cur = self.raw.cursor()
        cur.executemany(pg_sql(sql), params)
        return cur


class PostgresDatabase:
    engine = "postgresql"
    arrival = "seq"
    full_scan = ""

    def __init__(self, uri: str, *, lock: bool | str = True, pool_max: int = POOL_MAX) -> None:
        """`lock`: True takes the store's lock alone (no other process may open the
        database meanwhile: a migration); "shared" with the other members of the fleet
        (what Store.open takes); False none."""
        self.uri = uri
        self._shared = lock == "shared"
        self.name = redact(uri)
        self._local = threading.local()
        self._holder: psycopg.Connection | None = None
        self._lost: str | None = None  # why the store is not this process's any more
        self._lock_mutex = threading.Lock()
        self.on_full = None  # (the server's disk is not the store's: nothing to tell)
        self.write_bound_s = WRITE_BOUND_S  # (a fleet's TTL: alkfs/fleet.py)
        # A connection of its own first: a server that is not there (or refuses) fails
        # at once with its own reason, not after the pool's timeout as "incomplete".
        if lock:
            self._take_store_lock()
            self._require_sessions()
        else:
            self._connect().close()
        try:
            self.pool = psycopg_pool.ConnectionPool(
                uri,
                min_size=1,
                max_size=pool_max,
                kwargs={
                    "autocommit": True,
                    "connect_timeout": CONNECT_TIMEOUT_S,
                    # which process a session is (pg_stat_activity): one line per member
                    "application_name": f"alkfs[{os.getpid()}]",
                },
                timeout=CONNECT_TIMEOUT_S,
                open=False,
                name="alkfs",
            )
            self.pool.open(wait=True, timeout=CONNECT_TIMEOUT_S)
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            with contextlib.suppress(Exception):
                self.pool.close()
            self._release_store_lock()
            raise StoreIO(f"postgresql: cannot connect to {self.name}: {_why(exc)}") from None

    def _connect(self) -> psycopg.Connection:
        try:
            return psycopg.connect(self.uri, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
        except psycopg.Error as exc:
            raise StoreIO(f"postgresql: cannot connect to {self.name}: {_why(exc)}") from None

    def _require_sessions(self) -> None:
        """Refuse a connection that is not one server session: a pooler in transaction
        (or statement) mode hands each transaction to whichever server connection is
        free, so the store's lock, the fleet's sweep lease and LISTEN would belong to a
        session this process no longer talks to. Seen by holding a second connection's
        transaction open (the pooler gives it the server connection the lock was taken
        on, the most recently freed one) while the holder asks whether its own session
        holds the lock: directly, or through session pooling, it always does."""
        holder = self._holder
        assert holder is not None
        probe = self._connect()
        try:
            with probe.transaction():
                (theirs,) = probe.execute("SELECT pg_backend_pid()").fetchone() or (0,)
                mine, held = holder.execute(
                    "SELECT pg_backend_pid(), EXISTS (SELECT 1 FROM pg_locks WHERE "
                    "locktype = 'advisory' AND granted AND pid = pg_backend_pid())"
                ).fetchone() or (0, False)
        except psycopg.Error as exc:
            self._release_store_lock()
            raise StoreIO(f"postgresql: cannot connect to {self.name}: {_why(exc)}") from None
        finally:
            probe.close()
        if not held or mine == theirs:
            self._release_store_lock()
            raise StoreIO(
                f"postgresql: {self.name} does not keep one server session per connection "
                "(a connection pooler in transaction or statement mode?): alkfs needs "
                "sessions for its locks and notifications; connect to the server directly "
                "or through a pooler in session mode"
            )

    def _release_store_lock(self) -> None:
        if self._holder is not None:
            # Unlocked first, answered: a closed connection's backend ends (and lets go
            # of its locks) a moment later, so a store opened right after a close could
            # still find the lock taken.
            with contextlib.suppress(Exception):
                if not self._holder.broken and not _gone(self._holder):
                    self._holder.execute("SELECT pg_advisory_unlock_all()")
            with contextlib.suppress(Exception):
                self._holder.close()
            self._holder = None

    @contextlib.contextmanager
    def _connection(self) -> Iterator[psycopg.Connection]:
        """A pooled connection; when none comes within QUICK_S, one of its own. The pool
        hands out none while the server is down (each caller would wait out the pool's
        timeout) nor for a while after it is back (its reconnection attempts back off
        exponentially): a connection of its own fails at once with the server's reason,
        or works. (Bounded: the pool is larger than the threads that use it.)"""
        bound = getattr(self._local, "bound", None)
        if bound is not None:
            yield bound
            return
        kept = getattr(self._local, "kept", None)
        if kept is not None:
            conn = kept.conn
            if not conn.broken and not _gone(conn):
                yield conn  # (this thread's: no pool round trip a statement)
                return
            self._local.kept = None  # (its finalizer gives it back; the pool drops it)
        raw = None
        for _ in range(POOL_MAX + 1):
            try:
                raw = self.pool.getconn(timeout=QUICK_S)
            except psycopg_pool.PoolTimeout:
                raw = None
                break
            if not _gone(raw):
                break
            raw.close()  # (a session the server ended: the pool discards it)
            self.pool.putconn(raw)
            raw = None
        if raw is not None:
            # Kept by this thread until it ends (as the sqlite engine's connection a
            # thread): checking one out and back a statement cost a third of a small get.
            self._local.kept = _Kept(raw)
            weakref.finalize(self._local.kept, _give_back, self.pool, raw)
            yield raw
            return
        own = self._connect()
        try:
            yield own
        finally:
            own.close()

    def _take_store_lock(self) -> None:
        conn = self._connect()
        how = "pg_try_advisory_lock_shared" if self._shared else "pg_try_advisory_lock"
        got = conn.execute(f"SELECT {how}(%s)", (STORE_LOCK,)).fetchone()
        if not got or not got[0]:
            conn.close()
            raise StoreLocked(
                f"the database {self.name} is held by another alkfs process"
                + (" alone (a migration?)" if self._shared else "")
            )
        self._holder = conn

    @contextlib.contextmanager
    def dedicated(self, bind: bool = False) -> Iterator[psycopg.Connection]:
        """A connection of its own (a session: advisory locks, LISTEN), closed after;
        `bind`: every statement of this thread runs on it meanwhile."""
        conn = self._connect()
        if bind:
            self._local.bound = conn
        try:
            yield conn
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            self._raise(exc)
        finally:
            if bind:
                self._local.bound = None
            with contextlib.suppress(Exception):
                conn.close()

    def _check_store_lock(self) -> None:
        """The store's lock is a session's: a server restart (or a terminated backend)
        ends it. Its connection's socket turns readable then (the server's goodbye, or
        EOF), seen here with one poll before each statement; the lock is taken again
        at once, and if another process took it meanwhile every statement fails from
        then on (the store is someone else's now)."""
        holder = self._holder
        if holder is None:
            if self._lost is not None:
                raise StoreLocked(self._lost)
            return
        if not _gone(holder):
            return
        with self._lock_mutex:
            if self._holder is not holder:
                return  # (another thread took it again already)
            self._release_store_lock()
            try:
                self._take_store_lock()
            except StoreLocked:
                self._lost = (
                    f"the database {self.name} was taken by another alkfs process while "
                    "its connection was lost: this one stops using it"
                )
                log.error("%s", self._lost)
                raise StoreLocked(self._lost) from None
            except StoreIO:
                self._holder = holder  # (down: checked again by the next statement)
                raise
            log.warning("postgresql: %s: the store's lock was lost and taken again", self.name)

    # -- errors ---------------------------------------------------------------------
    def translate(self, exc: BaseException) -> Exception | None:
        if isinstance(exc, psycopg_pool.PoolTimeout):
            return StoreIO(f"postgresql: no connection to {self.name}: {_why(exc)}")
        if not isinstance(exc, psycopg.Error):
            return None
        if isinstance(exc, pgerrors.DiskFull):
            return NoSpace(f"postgresql: the server of {self.name} is out of space")
        if isinstance(exc, (pgerrors.LockNotAvailable, pgerrors.DeadlockDetected)):
            return Busy(f"postgresql: {self.name}: {_why(exc)}; try again")
        if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)) or (
            exc.sqlstate or ""
        ).startswith(("08", "57P", "53")):
            return StoreIO(f"postgresql: {self.name}: {_why(exc)}")
        return None

    def _raise(self, exc: BaseException) -> NoReturn:
        err = self.translate(exc)
        if err is None:
            raise exc
        raise err from None

    # -- statements -----------------------------------------------------------------
    @contextlib.contextmanager
    def _transaction(self, write: bool) -> Iterator[_Conn]:
        inner = getattr(self._local, "conn", None)
        if inner is not None:  # nested: part of this thread's transaction
            yield inner
            return
        self._check_store_lock()
        try:
            with self._connection() as raw, raw.transaction():
                if write:
                    self._lock_writer(raw)
                else:
                    raw.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                conn = _Conn(raw, named=not write)
                self._local.conn = conn
                try:
                    yield conn
                finally:
                    self._local.conn = None
                    conn.close_cursors()
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            self._raise(exc)

    def _lock_writer(self, raw: psycopg.Connection) -> None:
        """Take the store's write lock in this transaction, bounded. A writer that stops
        answering (SIGSTOP, a lost network) must not hold it for everyone: the server
        ends an idle transaction after the bound (idle_in_transaction_session_timeout:
        the session goes, and the lock with it) and a statement running past it
        (statement_timeout). A COPY waiting for rows from a stopped client hears no
        cancel, so a writer that waited the bound (lock_timeout) ends the session of a
        holder stalled that long on its client's data (`_end_stalled_writer`) and asks
        once more; otherwise it gives up (Busy: EBUSY through a mount)."""
        ms = str(int(self.write_bound_s * 1000))
        sql = (
            "SELECT set_config('statement_timeout', %s, true),"
            " set_config('idle_in_transaction_session_timeout', %s, true),"
            " set_config('lock_timeout', %s, true), pg_advisory_xact_lock(%s)"
        )
        try:
            with raw.transaction():  # (a savepoint: a lock wait that ends is undone alone)
                raw.execute(sql, (ms, ms, ms, WRITER_LOCK))
        except pgerrors.LockNotAvailable:
            if not self._end_stalled_writer():
                raise
            raw.execute(sql, (ms, ms, ms, WRITER_LOCK))

    def _end_stalled_writer(self) -> bool:
        """End the session holding the write lock if it has waited longer than the
        bound for its client's data (a COPY of a member that stopped); whether one was."""
        conn = self._connect()
        try:
            rows = conn.execute(
                "SELECT a.pid, a.application_name, pg_terminate_backend(a.pid)"
                " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s"
                " AND l.objid = %s AND a.pid <> pg_backend_pid() AND a.state = 'active'"
                " AND a.wait_event = 'ClientRead'"
                " AND a.state_change < now() - make_interval(secs => %s)",
                (WRITER_LOCK >> 32, WRITER_LOCK & 0xFFFFFFFF, self.write_bound_s),
            ).fetchall()
        except psycopg.Error as exc:
            log.warning("postgresql: could not look at the write lock's holder: %s", _why(exc))
            return False
        finally:
            conn.close()
        for pid, app, _ended in rows:
            log.error(
                "postgresql: ended session %s (%s): it held the store's write lock while "
                "waiting %g s and more for its client's data",
                pid,
                app,
                self.write_bound_s,
            )
        return bool(rows)

    def tx(self) -> contextlib.AbstractContextManager[_Conn]:
        """One write transaction: all of it commits or none; one at a time per store."""
        return self._transaction(write=True)

    def snapshot(self) -> contextlib.AbstractContextManager[_Conn]:
        """A read-only transaction (REPEATABLE READ): one state of the database."""
        return self._transaction(write=False)

    def execute(self, sql: str, params: Params = ()) -> Rows:
        local = self._local
        inner = getattr(local, "conn", None)
        try:
            if inner is not None:
                return inner.execute(sql, params)
            self._check_store_lock()
            kept = getattr(local, "kept", None)
            if kept is not None and getattr(local, "bound", None) is None:
                raw = kept.conn  # (the common case, inline: a small get is ~150 us)
                if not raw.broken and not _gone(raw):
                    cur = kept.cursor.execute(pg_sql(sql), params or None)
                    rows = cur.fetchall() if cur.description is not None else []
                    return _Result(rows, cur.rowcount)
            with self._connection() as raw:
                cur = raw.execute(pg_sql(sql), params or None)
                rows = cur.fetchall() if cur.description is not None else []
                return _Result(rows, cur.rowcount)
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            self._raise(exc)

    def stream(self, sql: str, params: Params = (), batch: int = 8192) -> Iterator[Row]:
        """The rows of one query through a server-side cursor, `batch` at a time."""
        try:
            with (
                self._connection() as raw,
                raw.transaction(),
                raw.cursor(name="alkfs_stream") as cur,
            ):
                cur.itersize = batch
                cur.execute(pg_sql(sql), params or None)
                while rows := cur.fetchmany(batch):
                    yield from rows
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            self._raise(exc)

    def insert_rows(
        self, conn, head: str, types: tuple[str, ...], rows: list[tuple], tail: str = ""
    ) -> list:
        """Many rows: COPY into a temporary table, then one INSERT ... SELECT (a third
        of the time of one parameter array a column, which psycopg dumps in Python;
        and multi-row VALUES cost more to parse than to insert). Inside a transaction."""
        if not rows:
            return []
        inner = conn if isinstance(conn, _Conn) else getattr(self._local, "conn", None)
        if inner is None:
            raise Invalid("insert_rows runs inside a transaction")
        raw = inner.raw
        cols = ", ".join(f"c{i} {_TYPE[t]}" for i, t in enumerate(types))
        names = ", ".join(f"c{i}" for i in range(len(types)))
        raw.execute(f"CREATE TEMP TABLE alkfs_rows ({cols}) ON COMMIT DROP")
        try:
            with raw.cursor().copy(f"COPY alkfs_rows ({names}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
            cur = raw.execute(pg_sql(f"{head} SELECT {names} FROM alkfs_rows {tail}"))
            return cur.fetchall() if "RETURNING" in tail.upper() else []
        finally:
            raw.execute("DROP TABLE IF EXISTS alkfs_rows")

    def create(self, statements: list[str]) -> None:
        with self.tx() as conn:
            for sql in statements:
                conn.execute(sql)

    # -- the engine's own -----------------------------------------------------------
    def spare_bytes(self) -> int:
        return 0  # (the database's space is the server's, not the store directory's)

    def reclaim(self) -> None:
        pass

    def backfill(self) -> None:
        pass  # (no log of ours to copy: the server checkpoints)

    def give_back(self, stop: Callable[[], bool] = lambda: False) -> int:
        return 0  # (the server's autovacuum reuses the space of deleted rows)

    def compact(self) -> int:
        return 0  # (VACUUM FULL is the server administrator's: it locks the tables)

    def tune_bulk_writer(self) -> None:
        pass

    def describe(self) -> str:
        return self.name

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.pool.close()
        self._release_store_lock()


class _Kept:
    """A pooled connection a thread keeps, with one cursor reused for its statements
    outside transactions (a new cursor a statement cost a fifth of a small get); its
    finalizer gives the connection back to the pool."""

    __slots__ = ("conn", "cursor", "__weakref__")

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn
        self.cursor = conn.cursor()


def _give_back(pool: psycopg_pool.ConnectionPool, conn: psycopg.Connection) -> None:
    with contextlib.suppress(Exception):
        pool.putconn(conn)


def _gone(conn: psycopg.Connection) -> bool:
    """Whether an idle connection's session has ended (a server restart, a terminated
    backend): its socket is readable (the server's goodbye, or EOF) while nothing was
    asked. One poll, no round trip (the pool's own check costs one per checkout)."""
    if conn.closed:
        return True
    try:
        # (poll, not select: the daemon raises its descriptor limit past FD_SETSIZE)
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))
    except (OSError, ValueError, psycopg.Error):
        return True


_FULL_SERVER = ("too many clients", "too many connections", "connection slots are reserved")


def _why(exc: BaseException) -> str:
    """The first line of a driver message (they can be long; never the URI itself), and
    what a refusal for the server's connection limit means here: that first, so a log
    line that quotes only the start of a reason (LOG_VALUE_MAX) still says it."""
    text = str(exc).strip().splitlines()
    why = (text[0] if text else type(exc).__name__)[:300]
    if isinstance(exc, psycopg.Error) and (
        exc.sqlstate == "53300" or any(m in why for m in _FULL_SERVER)
    ):
        why = (
            f"the server's connection limit: each alkfsd uses up to {CONNECTIONS_EACH} "
            "connections; raise max_connections or the role's or database's CONNECTION "
            f"LIMIT ({why})"
        )
    return why
