"""Several daemons on one PostgreSQL store: sessions, pin rows, the sweep lease, the logs.

Every process that opens a PostgreSQL-backed store joins its fleet (seed 000's fleet
family; `alkfs/schema.py` documents the tables):

- **A session row** (`fleet_nodes`) with an expiry on the database's clock, renewed
  every TTL/3 by a heartbeat thread, and never renewed once it passed: a daemon paused
  past its TTL finds its session over and joins again under the same id (`_lapsed`).
- **Pin rows** (`fleet_pins`): an in-process pin (`gc/arbiter.py`) writes its row before
  the pin is handed out, and its release deletes the row lazily (a protection that lasts
  a little longer is harmless). Each pinning has a token, so a late release never
  deletes the row of a newer pinning of the same key.
- **Delete-time arbitration** (`pinned_elsewhere`, at the start of the sweep's
  transaction): a pin row of another live session keeps the object; so does any ref or
  durable-pin change since the sweep computed what is live (`fleet_epoch`, bumped in
  those transactions). Write transactions of the store run one at a time
  (alkfs/db/postgres.py), so a publish and a delete never interleave.
- **Publishing a name** (`guard_publish`, inside the ref or pin transaction): refused
  (Stale: write again) when this process's session is over, or when what it names
  reaches an object that a pinning it held when its session lapsed lost (the closure of
  the named objects is walked, only while such a loss is remembered: writes that do not
  depend on a lost object go on at once); the named objects must still be stored.
- **One sweep at a time** (`sweep_lease`): an advisory lock on a connection of its own
  that also runs the sweep's statements, so losing the lock ends the sweep as report
  data. The lease holder removes what dead sessions left.
- **What one daemon changes, the others learn**: deletions go to `fleet_deletions` with
  `NOTIFY alkfs_deleted`, ref changes to `NOTIFY alkfs_refs` (payload: the repository),
  a derived pack set published for the fleet to `NOTIFY alkfs_packs` (payload: the
  format; alkfs/git/shared_packs.py); a listener thread replays the log from where it
  was (after a reconnect too) into the store's deletion hooks, and calls the `on_refs`
  and `on_packs` callbacks.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from .errors import AlkfsError, Stale
from .machine import machine_id
from .settings import Settings

if TYPE_CHECKING:
    from .db import Conn
    from .db.postgres import PostgresDatabase
    from .gc.needs import FleetStore

log = logging.getLogger("alkfs.fleet")

DEFAULT_TTL_S = Settings().fleet_ttl_s  # (ALKFS_FLEET_TTL: alkfs/settings.py)
NOW = "(extract(epoch from clock_timestamp()) * 1000000000)::bigint"
SWEEP_LOCK = 0x616C6B66_73776570  # "alkfswep"
UNPIN_EVERY_S = 0.5
LOG_KEEP_NS = 3600 * 10**9  # deletion log rows older than this are pruned by the lease holder
NODES_DIR = "nodes"


class FleetNode(TypedDict):
    """A session of the fleet, as status shows it (`Fleet.nodes`)."""

    id: str
    host: str
    pid: int
    since_ns: int
    sweeping: bool
    live: bool
    pins: int
    self: bool


class Fleet:
    """This process's membership of its store's fleet (see the module docstring)."""

    def __init__(
        self, store: FleetStore, db: PostgresDatabase, node: str, ttl_s: float = DEFAULT_TTL_S
    ) -> None:
        self.store = store
        self.db = db
        self.ttl_ns = int(ttl_s * 1e9)
        # a member that stops answering holds the store's write lock no longer than this
        db.write_bound_s = ttl_s
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()
        self._unpins: list[tuple[bytes, int]] = []
        self.tainted: set[bytes] = set()  # pinned when the session lapsed, and gone since
        # the closure of some keys (raw) and how many of its objects are missing, set by
        # alkfs/app.py: a publish is refused only when what it names reaches a tainted
        # object, or one that is gone (None: any taint refuses)
        self.reaches: Callable[[list[bytes]], tuple[set[bytes], int]] | None = None
        self.lapses = 0
        self.on_refs: list[Callable[[str | None], None]] = []
        self.on_packs: list[Callable[[str | None], None]] = []  # (a format, None: any)
        self.on_roots: list[Callable[[str | None], None]] = []  # (a sweep asks for a read)
        self.machine = machine_id()
        self._stop = threading.Event()
        self._wake = threading.Event()  # (unpin: the beat thread flushes now)
        self.node = node  # (also the name of its in-flight directories)
        self._join()
        self.last_seq = self._max_seq()
        self._threads = [
            threading.Thread(target=self._beat, name="alkfs-fleet-beat", daemon=True),
            threading.Thread(target=self._listen, name="alkfs-fleet-listen", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- the session ------------------------------------------------------------------
    def _join(self, conn: Conn | None = None) -> None:
        (conn or self.db).execute(
            "INSERT INTO fleet_nodes (id, host, pid, started_ns, expiry_ns, sweeping) "
            f"VALUES (?, ?, ?, {NOW}, {NOW} + ?, 0)",
            (self.node, self.host, self.pid, self.ttl_ns),
        )
        (conn or self.db).execute(
            "INSERT INTO fleet_machines (node, machine) VALUES (?, ?) ON CONFLICT DO NOTHING",
            (self.node, self.machine),
        )

    def _max_seq(self) -> int:
        return self.db.execute("SELECT coalesce(max(seq), 0) FROM fleet_deletions").fetchone()[0]

    def renew(self) -> bool:
        """Extend the session by a TTL; False (and a new session) if it had lapsed."""
        cur = self.db.execute(
            f"UPDATE fleet_nodes SET expiry_ns = {NOW} + ? WHERE id = ? AND expiry_ns > {NOW}",
            (self.ttl_ns, self.node),
        )
        if cur.rowcount == 1:
            return True
        self._lapsed()
        return False

    def _lapsed(self) -> None:
        """The session is over (paused past the TTL, or the database was away that long):
        join again, pin again what is pinned now, and remember what lost its object
        meanwhile (a publish depending on it is refused until those pins are gone)."""
        self.lapses += 1
        lost: set[bytes] = set()
        with self.db.tx() as conn:  # (under the writer lock: no delete interleaves)
            conn.execute("DELETE FROM fleet_pins WHERE node = ?", (self.node,))
            conn.execute("DELETE FROM fleet_nodes WHERE id = ?", (self.node,))
            self._join(conn)  # a new session under the same name
            held = self.store.arbiter.pinned_tokens()
            self._insert(conn, held.items())
            for key in held:
                if not self.store.has_raw(key):
                    lost.add(key)
        with self._lock:
            self.tainted |= lost
        log.error(
            "fleet: the session of %s lapsed (paused past its TTL?); it joined again, "
            "%d pins renewed, %d of their objects were collected meanwhile",
            self.node,
            len(held),
            len(lost),
        )
        # (the derived sets it held may have been retired and removed meanwhile)
        self._tell(self.on_packs, None)
        self._remake_dirs()

    def _remake_dirs(self) -> None:
        """Its in-flight directories again: a lease holder that took this session for a
        dead one removed them (puts of large objects stage in one)."""
        dirs = []
        if self.store.path is not None:
            dirs += [self.store.path / NODES_DIR, self.store.path / NODES_DIR / self.node]
        large = self.store.large
        if large is not None:
            dirs += [large.staging.parent, large.staging]
        for d in dirs:
            try:
                d.mkdir(mode=0o700, exist_ok=True)
            except OSError as exc:
                log.error("fleet: cannot make %s again: %s", d, exc)

    def _beat(self) -> None:
        """Released pins' rows go at once (`unpin` wakes this thread: a put's pin row
        must not outlive its close by more than a round trip, or a sweep right after
        would find it and keep an orphan that two sweeps with --window 0 should delete);
        the session is renewed every third of the TTL."""
        every = max(0.05, self.ttl_ns / 3e9)
        renewed = time.monotonic()
        failing = False
        while not self._stop.is_set():
            self._wake.wait(UNPIN_EVERY_S)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.flush_unpins()
                if time.monotonic() - renewed >= every:
                    renewed = time.monotonic()
                    self.renew()
                if failing:
                    failing = False
                    log.info("fleet: the heartbeat reaches the database again")
            except Exception as exc:  # (the database away: again at the next beat, quietly)
                if not failing:
                    failing = True
                    log.warning("fleet: heartbeat failed (again every beat, quietly): %s", exc)

    # -- pin rows ---------------------------------------------------------------------
    def token(self) -> int:
        return next(self._tokens)

    def _insert(self, conn: Conn, rows: Iterable[tuple[bytes, int]]) -> None:
        self.db.insert_rows(
            conn,
            "INSERT INTO fleet_pins (key, node, token)",
            ("key", "text", "int"),
            [(key, self.node, token) for key, token in rows],
            "ON CONFLICT (key, node) DO UPDATE SET token = excluded.token",
        )

    def pin(self, rows: list[tuple[bytes, int]]) -> None:
        """Write pin rows (key, token) now: before the pins are handed out."""
        if rows:
            with self.db.tx() as conn:
                self._insert(conn, rows)

    def unpin(self, rows: list[tuple[bytes, int]]) -> None:
        """Released pinnings: their rows go with the next flush."""
        with self._lock:
            self._unpins += rows
            gone = {k for k, _ in rows}
            if self.tainted & gone:
                self.tainted -= gone
        self._wake.set()

    def flush_unpins(self) -> None:
        with self._lock:
            rows, self._unpins = self._unpins, []
        try:
            for i in range(0, len(rows), 5000):
                part = rows[i : i + 5000]
                self.db.execute(
                    "DELETE FROM fleet_pins WHERE node = ? AND (key, token) IN (VALUES "
                    + ",".join(["(?::bytea, ?::bigint)"] * len(part))
                    + ")",
                    [self.node, *(x for row in part for x in row)],
                )
        except Exception:
            with self._lock:
                self._unpins = rows + self._unpins
            raise

    # -- arbitration and publishing ----------------------------------------------------
    def epoch(self) -> int:
        return self.db.execute("SELECT coalesce(max(n), 0) FROM fleet_epoch").fetchone()[0]

    def pinned_elsewhere(self, keys: list[bytes]) -> set[bytes]:
        """Which of these keys another live session's pin row names, read once for a
        sweep's batch at the start of its transaction (this process's own pins are its
        arbiter's, exact where its rows lag). Enough for the whole transaction: a pin
        taken later either comes with a write of the object (the put's upsert moves
        `stored_ns`, or waits for the row lock and stores afresh) or with a publish
        whose transaction checks the object is stored, after this one (the writer
        lock)."""
        if not keys:
            return set()
        rows = self.db.execute(
            "SELECT DISTINCT p.key FROM fleet_pins p JOIN fleet_nodes n ON n.id = p.node "
            f"WHERE p.key = ANY(?) AND p.node <> ? AND n.expiry_ns > {NOW}",
            (keys, self.node),
        ).fetchall()
        return {bytes(k) for (k,) in rows}

    def deleted(self, keys: list[bytes]) -> None:
        """Log deletions (inside the sweep's transaction): every daemon replays them."""
        if keys:
            self.db.execute(
                f"INSERT INTO fleet_deletions (key, node, at_ns) SELECT k, ?, {NOW} "
                "FROM unnest(?::bytea[]) AS k",
                (self.node, keys),
            )
            self.db.execute("SELECT pg_notify('alkfs_deleted', '')")

    def guard_publish(self, conn: Conn, keys: Iterable[bytes] = ()) -> None:
        """Inside a ref or pin transaction: this session is live and owes no lost
        object, the named objects are stored; then the epoch moves (Stale otherwise)."""
        keys = list(keys)
        with self._lock:
            tainted = set(self.tainted)
        if tainted and self._depends(keys, tainted):
            raise Stale(
                "this daemon was paused past its session's TTL and objects it was "
                "writing were collected meanwhile: write them again"
            )
        row = conn.execute(
            f"SELECT 1 FROM fleet_nodes WHERE id = ? AND expiry_ns > {NOW}", (self.node,)
        ).fetchone()
        if row is None:
            raise Stale("this daemon's fleet session lapsed (paused past its TTL?): try again")
        for key in keys:
            if not self.store.has_raw(key):
                raise Stale("an object this names was collected meanwhile: write it again")
        conn.execute(
            "INSERT INTO fleet_epoch (id, n) VALUES (1, 1) "
            "ON CONFLICT (id) DO UPDATE SET n = fleet_epoch.n + 1"
        )

    def bump_epoch(self, conn: Conn) -> None:
        """Inside a write transaction: the epoch moves (a sweep's delete batch that began
        before re-checks), as a ref or pin change moves it."""
        conn.execute(
            "INSERT INTO fleet_epoch (id, n) VALUES (1, 1) "
            "ON CONFLICT (id) DO UPDATE SET n = fleet_epoch.n + 1"
        )

    def _depends(self, keys: list[bytes], tainted: set[bytes]) -> bool:
        """Whether a publish of `keys` needs one of the `tainted` objects: one of them, or
        (a git object) in its closure, walked whole (a rare path: only after a lapse).
        Writes that reach none of them go on at once."""
        if tainted.intersection(keys):
            return True
        if not keys:
            return False  # (a root's registration names no object)
        if self.reaches is None:
            return True
        reached, missing = self.reaches(keys)  # (a lost tree or commit is not read: missing)
        return missing > 0 or not tainted.isdisjoint(reached)

    def refs_changed(self, conn: Conn, repo: str) -> None:
        conn.execute("SELECT pg_notify('alkfs_refs', ?)", (repo,))

    # -- the sweep lease ---------------------------------------------------------------
    @contextlib.contextmanager
    def sweep_lease(self) -> Iterator[bool]:
        """True while this process holds the fleet's sweep lease (False: another does).
        Every statement of this thread runs on the lease's connection meanwhile."""
        with self.db.dedicated(bind=True) as conn:
            row = conn.execute("SELECT pg_try_advisory_lock(%s)", (SWEEP_LOCK,)).fetchone()
            if not row or not row[0]:
                yield False
                return
            try:
                self.db.execute("UPDATE fleet_nodes SET sweeping = 1 WHERE id = ?", (self.node,))
                self.reap()
                yield True
            finally:
                with contextlib.suppress(Exception):
                    self.db.execute(
                        "UPDATE fleet_nodes SET sweeping = 0 WHERE id = ?", (self.node,)
                    )
                    conn.execute("SELECT pg_advisory_unlock(%s)", (SWEEP_LOCK,))

    def reap(self) -> list[str]:
        """Remove the sessions that ended more than a TTL ago, their pin rows and their
        in-flight files, and prune the deletion log (the lease holder does it)."""
        rows = self.db.execute(
            f"SELECT id FROM fleet_nodes WHERE expiry_ns < {NOW} - ?", (self.ttl_ns,)
        ).fetchall()
        dead = [r[0] for r in rows]
        for node in dead:
            with self.db.tx() as conn:
                conn.execute("DELETE FROM fleet_pins WHERE node = ?", (node,))
                conn.execute("DELETE FROM fleet_pack_holds WHERE node = ?", (node,))
                conn.execute("DELETE FROM fleet_machines WHERE node = ?", (node,))
                conn.execute("DELETE FROM fleet_nodes WHERE id = ?", (node,))
            self.remove_files_of(node)
        self.db.execute(f"DELETE FROM fleet_deletions WHERE at_ns < {NOW} - ?", (LOG_KEEP_NS,))
        if dead:
            log.info("fleet: removed %d ended sessions and their files", len(dead))
        return dead

    def remove_files_of(self, node: str) -> None:
        root = self.store.path
        if root is None:
            return
        for path in (root / NODES_DIR / node, root / "large" / ".staging" / node):
            shutil.rmtree(path, ignore_errors=True)
        for path in root.glob(f"derived/*/tmp-{node}-*"):  # (its derived builds cut short)
            shutil.rmtree(path, ignore_errors=True)

    def inflight_dir(self) -> Path | None:
        """This process's own directory for in-flight files (spool, scratch)."""
        if self.store.path is None:
            return None
        return self.store.path / NODES_DIR / self.node

    # -- what the others did -------------------------------------------------------------
    def _listen(self) -> None:
        """LISTEN for deletions and ref changes; replay the deletion log (at each notice,
        at least every second, and from where it was after a reconnect)."""
        lost = False
        while not self._stop.is_set():
            try:
                with self.db.dedicated() as conn:
                    conn.execute("LISTEN alkfs_deleted")
                    conn.execute("LISTEN alkfs_refs")
                    conn.execute("LISTEN alkfs_packs")
                    conn.execute("LISTEN alkfs_roots")
                    self.replay()
                    if lost:  # (not at the first connection: nothing was missed then)
                        lost = False
                        log.info("fleet: the listener is back; the deletion log replayed")
                        for fn in list(self.on_refs):
                            fn(None)  # (ref changes missed while away: any repository's)
                        self._tell(self.on_packs, None)
                        self._tell(self.on_roots, None)
                    while not self._stop.is_set():
                        repos: set[str] = set()
                        packs: set[str] = set()
                        roots = False
                        for note in conn.notifies(timeout=1.0, stop_after=1):
                            if note.channel == "alkfs_refs":
                                repos.add(note.payload)
                            elif note.channel == "alkfs_packs":
                                packs.add(note.payload)
                            elif note.channel == "alkfs_roots":
                                roots = True
                        if roots:
                            self._tell(self.on_roots, None)
                        self.replay()
                        for repo in repos:
                            for fn in list(self.on_refs):
                                fn(repo)
                        for fmt in packs:
                            self._tell(self.on_packs, fmt)
            except Exception as exc:
                if self._stop.is_set():
                    return
                if not lost:
                    lost = True
                    log.warning("fleet: listener lost its connection (%s); again each second", exc)
                self._stop.wait(1.0)

    @staticmethod
    def _tell(callbacks: list[Callable[[str | None], None]], what: str | None) -> None:
        for fn in list(callbacks):
            try:
                fn(what)
            except Exception:
                log.exception("fleet: a notice's callback failed (%s)", what)

    def replay(self) -> int:
        """Run the deletion hooks for what the log has after `last_seq`."""
        n = 0
        while True:
            rows = self.db.execute(
                "SELECT seq, key, node FROM fleet_deletions WHERE seq > ? ORDER BY seq LIMIT 10000",
                (self.last_seq,),
            ).fetchall()
            if not rows:
                return n
            for seq, key, node in rows:
                if node != self.node:  # (its own deletions ran the hooks already)
                    self.store.on_deleted(bytes(key))
                    n += 1
                self.last_seq = seq

    def machine_live(self, machine: str) -> bool:
        """Whether a live session of the fleet runs on `machine`."""
        row = self.db.execute(
            "SELECT 1 FROM fleet_machines m JOIN fleet_nodes n ON n.id = m.node "
            f"WHERE m.machine = ? AND n.expiry_ns > {NOW} LIMIT 1",
            (machine,),
        ).fetchone()
        return row is not None

    def ask_roots(self) -> None:
        """Wake the daemons of every machine: a sweep asks them to read their roots."""
        self.db.execute("SELECT pg_notify('alkfs_roots', '')")

    # -- status ------------------------------------------------------------------------
    def nodes(self) -> list[FleetNode]:
        rows = self.db.execute(
            f"SELECT id, host, pid, started_ns, sweeping, expiry_ns > {NOW} FROM fleet_nodes "
            "ORDER BY started_ns"
        ).fetchall()
        pins = dict(
            self.db.execute("SELECT node, count(*) FROM fleet_pins GROUP BY node").fetchall()
        )
        return [
            {
                "id": node,
                "host": host,
                "pid": pid,
                "since_ns": started,
                "sweeping": bool(sweeping),
                "live": bool(live),
                "pins": int(pins.get(node, 0)),
                "self": node == self.node,
            }
            for node, host, pid, started, sweeping, live in rows
        ]

    def close(self) -> None:
        """Leave the fleet: stop the threads, drop this session's rows."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=5)
        with contextlib.suppress(Exception):
            self.flush_unpins()
        try:
            with self.db.tx() as conn:
                conn.execute("DELETE FROM fleet_pins WHERE node = ?", (self.node,))
                conn.execute("DELETE FROM fleet_pack_holds WHERE node = ?", (self.node,))
                conn.execute("DELETE FROM fleet_machines WHERE node = ?", (self.node,))
                conn.execute("DELETE FROM fleet_nodes WHERE id = ?", (self.node,))
        except AlkfsError as exc:
            log.warning("fleet: could not leave cleanly (%s): the session expires", exc)
        self.remove_files_of(self.node)
