"""The store facade: routing by length, verified reads, the put paths, stat, list, GC entry points.

Thread-safe and synchronous: the daemon calls it from worker threads.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar, cast

from . import privacy
from .binding import DB_NAME as DB_NAME
from .binding import open_database, settle
from .catalog import Catalog, ChunkDigester, Record
from .db import Database, now_ns
from .durations import MAX_WINDOW_S
from .errors import (
    AlkfsError,
    Corrupt,
    Interrupted,
    Invalid,
    NoSpace,
    Refused,
    StoreIO,
    StoreLocked,
    TooLarge,
    Verification,
    WouldWait,
)
from .fleet import DEFAULT_TTL_S, NODES_DIR, Fleet
from .gc.arbiter import Arbiter, LivenessSource, Pin, ProtectCallback
from .gc.sweep import SweepProgress, SweepReport, sweep
from .gc.window import MemoryWindow, SqlWindow
from .git.objects import MAX_HEADER, check_canonical
from .keys import HASH_OF, Algorithm, Key
from .reserve import Reserve, is_no_space
from .tiers import Entry
from .tiers.local import LocalTier
from .tiers.memory import MemoryTier
from .tiers.sql import SqlTier
from .tiers.staging import StagingWriter

DEFAULT_THRESHOLD = 131072
NOWAIT_PUT_MAX = 65536  # put(wait=False) takes bytes up to this (hashed in ~40 us)
DEFAULT_WINDOW_S = 3600
INERT_GRACE_NS = 3600 * 10**9  # a catalog row without its file is removed once this old
CHUNK = 1 << 20
MODES = ("dual-tier", "kv-only", "mem")
LARGE_DIR = "large"
GIT_TAGS = (bytes([Algorithm.GIT_SHA1.value]), bytes([Algorithm.GIT_SHA256.value]))
LOCK_NAME = "alkfs.lock"

Source = bytes | bytearray | memoryview | BinaryIO | Iterable[bytes]


@dataclass(frozen=True, slots=True)
class ObjectStat:
    key: Key
    size: int
    tier: str  # "kv", "large", "mem" or "packs" (a git object its packs hold, only there)
    stored_ns: int


class PackedTier(Protocol):
    """Git objects read from the store's packs (alkfs/git/packed.py registers one as
    `Store.packed`): a lookup after the kv and large tiers."""

    def stat(self, key: bytes) -> tuple[int, int] | None:
        """(canonical size, stored ns) of a packed object; None when no pack holds it."""
        ...

    def read(self, key: bytes) -> bytes | None:
        """Its canonical bytes, verified against the key (Corrupt if not); None when
        no pack holds it."""
        ...


@dataclass(slots=True)
class PutResult:
    """The stored key and the in-process pin that protects it until its name is published."""

    key: Key
    pin: Pin
    created: bool


def _chunks(source: Source) -> Iterator[bytes]:
    """The input as chunks; a failing input surfaces as StoreIO."""
    if isinstance(source, bytes | bytearray | memoryview):
        yield bytes(source)
        return
    try:
        if hasattr(source, "read"):
            while chunk := source.read(CHUNK):
                yield chunk
        else:
            yield from source
    except AlkfsError:
        raise
    except Exception as exc:
        raise StoreIO(f"the input stream failed: {exc}") from exc


def _kv_tier(db: Database) -> SqlTier:
    if db.engine == "postgresql":
        from .tiers.postgres import PgTier

        return PgTier(db)
    return SqlTier(db)


F = TypeVar("F", bound=Callable[..., Any])


def _counted(fn: F) -> F:
    """A Store method that may add objects: `Store.puts` moves when it ends."""

    @functools.wraps(fn)
    def counted(self: Store, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.puts += 1
            for hook in self.changed_hooks:
                hook()

    return cast(F, counted)


class Store:
    """A content-addressed store: small objects in its database, large ones in a directory."""

    def __init__(
        self,
        path: Path | None,
        mode: str,
        threshold: int,
        window_s: float,
        db: Database | None,
        *,
        clear_staging: bool = True,
        own: str | None = None,
    ) -> None:
        if mode not in MODES:
            raise Invalid(f"unknown mode {mode!r}")
        self.path = path
        self.mode = mode
        self.threshold = threshold
        self.window_ns = int(window_s * 1e9)
        self.db = db
        self.log = logging.getLogger("alkfs.store")
        self.arbiter = Arbiter()
        self.kv: SqlTier | MemoryTier
        self.large: LocalTier | None = None
        self.catalog: Catalog | None = None
        if db is None:
            self.kv = MemoryTier()
            self.window: SqlWindow | MemoryWindow = MemoryWindow()
        else:
            self.kv = _kv_tier(db)
            self.window = SqlWindow(db)
            if mode == "dual-tier":
                assert path is not None
                self.large = LocalTier(path / LARGE_DIR, clear_staging=clear_staging, own=own)
                self.catalog = Catalog(db)
        self.fleet: Fleet | None = None  # a PostgreSQL store's membership (alkfs/fleet.py)
        # where the daemon keeps its in-flight files: STORE, or a fleet member's own
        self.inflight: Path | None = path if own is None or path is None else path / NODES_DIR / own
        self.last_sweep: SweepReport | None = None
        # How far the running verify and sweep got (None when none runs), for a status to
        # show: objects looked at by the verify; the sweep's phase and figures (SweepProgress)
        self.verifying: int | None = None
        self.sweep_progress: dict[str, Any] | None = None
        # Set when the store's owner stops (SIGTERM, an unmount): long work (sweeps,
        # verify, a borrower's git) checks it at its next safe point and ends (Interrupted)
        self.stopping = threading.Event()
        self.corrupt: set[bytes] = set()
        # Puts that ended (stored or not), moved after each: a lookup that found a key
        # absent and saw no put end meanwhile may answer the same until one does.
        self.puts = 0
        self.deleted_hooks: list[Callable[[bytes], None]] = []
        # called with (raw keys, contents) of every kv put, new or not, right after the
        # insert (inside its transaction where it has one): e.g. LFS pointers recorded
        self.put_hooks: list[Callable[[Sequence[bytes], Sequence[bytes]], None]] = []
        # called (in the calling thread) after every put ends and every deletion: what a
        # listing of the store shows may have changed (the daemon's cached listings)
        self.changed_hooks: list[Callable[[], None]] = []
        # Held once around all of a sweep's deletions, with the keys due at its start (the
        # layers above register them: alkfs/app.py adds the derived packs' guard).
        self.delete_guards: list[
            Callable[[list[bytes]], AbstractContextManager[set[bytes] | None]]
        ] = []
        # Run at the end of `verify` (the layers above register them: alkfs/app.py adds
        # the derived packs' check).
        self.verify_hooks: list[Callable[[], object]] = []
        # git objects in the store's packs (alkfs/app.py registers alkfs/git/packed.py's):
        # looked up after the kv and large tiers, tier "packs"
        self.packed: PackedTier | None = None
        self._verified: dict[bytes, tuple[int, int, int, int]] = {}
        self._lock_fd: int | None = None
        self._inert_upto = 0  # catalog rows stored up to this were looked at (reap_inert_rows)
        self._vlock = threading.Lock()
        self.reserve: Reserve | None = None  # STORE/reserve (alkfs/reserve.py): the lock holder's

    # -- construction ---------------------------------------------------------
    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        mode: str | None = None,
        threshold: int | None = None,
        window_s: float | None = None,
        lock: bool = True,
        create: bool = True,
        database: str | None = None,
    ) -> Store:
        """Open (creating on first use) the store at `path`, its database in its sqlite
        file or (`database`: a postgresql:// URI) in PostgreSQL. Settings given at
        creation stick."""
        root = Path(path)
        if mode == "mem":
            return cls.memory(threshold or DEFAULT_THRESHOLD, window_s or 0)
        if not root.exists():
            if not create:
                raise StoreIO(f"no store at {root}")
            root.parent.mkdir(parents=True, exist_ok=True)  # (not the store's: as mkdir -p)
            root.mkdir(mode=0o700)  # the store is its owner's alone (alkfs/privacy.py)
        # A sqlite store is one process's (STORE/alkfs.lock); a PostgreSQL one is its
        # fleet's: each member with a session and directories of its own.
        member = database is not None and lock
        own = uuid.uuid4().hex[:16] if member else None
        lock_fd = cls._take_lock(root) if lock and not member else None
        try:
            if lock:  # (the lock held, or a fleet's member; before sqlite makes -wal, -shm)
                privacy.tighten_at_open(root)
            db = open_database(root, database, lock="shared" if member else lock)
            try:
                meta = settle(db, root, mode, threshold, DEFAULT_THRESHOLD)
            except BaseException:
                db.close()
                raise
            store = cls(
                root,
                meta["mode"],
                int(meta["threshold"]),
                DEFAULT_WINDOW_S if window_s is None else window_s,
                db,
                clear_staging=lock,  # beside a lock holder, staging files are its puts
                own=own,
            )
            if own is not None:
                try:
                    ttl = float(os.environ.get("ALKFS_FLEET_TTL") or DEFAULT_TTL_S)
                    store.fleet = Fleet(store, db, own, ttl)  # type: ignore[arg-type]
                except BaseException:
                    db.close()
                    raise
                store.arbiter.remote = store.fleet
        except BaseException:
            if lock_fd is not None:
                os.close(lock_fd)
            raise
        store._lock_fd = lock_fd
        if lock:
            try:
                # A fleet member keeps its own (the members' STORE is one directory: one
                # shared file would be made and removed by each of them in turn).
                where = root
                if store.fleet is not None:
                    assert store.inflight is not None
                    where = store.inflight
                    for d in (where.parent, where):  # (0700 each: not mkdir's parents=)
                        d.mkdir(mode=0o700, exist_ok=True)
                store.reserve = Reserve(where)
                if db.engine == "sqlite":  # (PostgreSQL's disk is the server's)
                    db.on_full = store.reserve.hit  # type: ignore[attr-defined]
                store.reserve.spare = db.spare_bytes
                store.reserve.reclaim = db.reclaim
                store.reserve.open()
            except BaseException:
                store.close()
                raise
        return store

    @classmethod
    def memory(cls, threshold: int = DEFAULT_THRESHOLD, window_s: float = 0) -> Store:
        return cls(None, "mem", threshold, window_s, None)

    @staticmethod
    def _take_lock(root: Path) -> int:
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            raise StoreLocked(
                f"the store {root} is held by another process"
                + (f" (pid {holder})" if holder else "")
                + f"; lock {root / LOCK_NAME}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    @staticmethod
    def is_locked(path: str | os.PathLike[str]) -> bool:
        lock = Path(path) / LOCK_NAME
        if not lock.exists():
            return False
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    @property
    def holds_lock(self) -> bool:
        """This process holds `STORE/alkfs.lock`: no other process opens the store's
        database (a fleet's member and a store opened beside the lock holder do not)."""
        return self._lock_fd is not None

    @property
    def sole_writer(self) -> bool:
        """Every change to the store is made by this process (a memory store, or one
        whose lock this process holds; never a fleet's): what it found absent or listed
        can change only through its own calls, which memos of absence rely on."""
        return self.fleet is None and (self.path is None or self.holds_lock)

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.close()
            self.fleet = None
        if self.db is not None:
            self.db.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def backfill(self) -> None:
        """What the database asks for between the puts that must not wait (its
        `on_backfill`; on a thread that may wait): its log written into its file, and the
        reserve's look at the disk made ahead of them (`Reserve.look_ahead`)."""
        if self.db is not None:
            self.db.backfill()
        if self.reserve is not None:
            self.reserve.look_ahead()

    # -- puts -----------------------------------------------------------------
    @_counted
    def put(
        self,
        source: Source,
        length: int | None = None,
        algo: Algorithm = Algorithm.SHA256,
        expect: Key | None = None,
        within: Callable[[Key], None] | None = None,
        wait: bool = True,
    ) -> PutResult:
        """Store a stream; returns the key and a pin the caller releases once the
        object's name is published. Nothing is left behind when it fails; on a full
        disk that is NoSpace (and, while the disk stays full, before reading anything).

        `within(key)` names the object in the same transaction: for an object of the
        kv tier it runs inside the transaction that inserts it (one commit; if it
        raises, nothing is stored), for a large one in a transaction right after the
        file is published. The returned pin is held throughout either way.

        `wait=False` (an event loop's small put): WouldWait, with nothing changed,
        wherever the put would wait or do more than hash and write a page-cached
        transaction (see `_waits`); the caller puts again where it may wait."""
        reserve = self.reserve
        if not wait:
            why = self._waits(source)
            if why:
                raise WouldWait(why)
            try:
                return self._put(source, length, algo, expect, within, wait=False)
            except NoSpace as exc:  # (the waiting put meets it again and tells the reserve)
                raise WouldWait("the disk is full") from exc
        if reserve is None:
            return self._put(source, length, algo, expect, within)
        reserve.admit()
        try:
            return self._put(source, length, algo, expect, within)
        except NoSpace:
            reserve.hit()  # (now that the staging file is gone)
            raise

    def _waits(self, source: Source) -> str:
        """Why a put of `source` cannot be one that never waits ('' if it can): only
        bytes of the kv tier up to NOWAIT_PUT_MAX, while the reserve is in place."""
        if not isinstance(source, (bytes, bytearray, memoryview)):
            return "a stream is put from a worker thread"
        if len(source) > min(self.threshold, NOWAIT_PUT_MAX):
            return "a put this large is made from a worker thread"
        reserve = self.reserve
        if reserve is not None and not reserve.settled():
            return "the reserve needs a look at the disk first"
        return ""

    def _put(
        self,
        source: Source,
        length: int | None,
        algo: Algorithm,
        expect: Key | None,
        within: Callable[[Key], None] | None = None,
        wait: bool = True,
    ) -> PutResult:
        if expect is not None and expect.algo is not algo:
            raise Invalid("the expected key has another algorithm")
        spill = self.mode == "dual-tier"
        if length is not None and length > self.threshold and self.mode == "kv-only":
            raise TooLarge(f"{length} bytes is over the kv-only threshold {self.threshold}")
        hasher = algo.hasher()
        buf = bytearray()
        head = b""
        total = 0
        staging: Path | None = None
        writer: StagingWriter | None = None
        try:
            for chunk in _chunks(source):
                if not chunk:
                    continue
                total += len(chunk)
                if length is not None and total > length:
                    raise Verification(f"more bytes than the declared length {length}")
                if len(head) < MAX_HEADER:
                    head += chunk[: MAX_HEADER - len(head)]
                if writer is not None:
                    writer.write(chunk)  # written by its thread while this one hashes
                hasher.update(chunk)
                if writer is None:
                    buf += chunk
                    if len(buf) > self.threshold:
                        if self.mode == "kv-only":
                            raise TooLarge(f"over the kv-only threshold {self.threshold}")
                        if spill:
                            assert self.large is not None
                            writer = self.large.new_writer()
                            staging = writer.path
                            writer.write(buf)
                            buf = bytearray()
            if length is not None and total != length:
                raise Verification(f"{total} bytes where {length} were declared")
            if algo.is_git:
                check_canonical(head, total)
            key = Key.of(algo, hasher.digest())
            if expect is not None and key != expect:
                raise Verification(f"the content hashes to {key}, not {expect}")
            if writer is not None:
                writer.finish()  # every byte written and fsynced
                writer.close()
            if not wait and key.raw in self.corrupt:
                raise WouldWait("a corrupt object is repaired from a worker thread")
            pin = self.arbiter.acquire(key, wait=wait)  # pin before publish
            try:
                if key.raw in self.corrupt:
                    # Known-bad stored bytes: these good ones replace them (under our pin,
                    # so no sweep can act on the key meanwhile) instead of deduping into them.
                    self.log.warning("repairing corrupt object %s with a verified re-put", key)
                    self.engine_delete(key.raw)
                    self.on_deleted(key.raw)
                stamp = now_ns()
                if staging is not None:
                    assert self.large is not None and writer is not None
                    created = self._publish_large(key, staging, writer.digester, stamp)
                    staging = None
                    if within is not None:
                        with self.tx():
                            within(key)
                elif within is not None or not wait:
                    with self.tx(wait):
                        created = self.kv.put(key.raw, bytes(buf), stamp)
                        self._put_done((key.raw,), (buf,))
                        if within is not None:
                            within(key)
                else:
                    created = self.kv.put(key.raw, bytes(buf), stamp)
                    self._put_done((key.raw,), (buf,))
            except BaseException:
                pin.release()
                raise
            return PutResult(key, pin, created)
        except OSError as exc:
            if is_no_space(exc):
                raise NoSpace(f"no space left on the device holding the store: {exc}") from exc
            raise StoreIO(f"the large tier failed: {exc}") from exc
        finally:
            if writer is not None:
                writer.close()
            if staging is not None and self.large is not None:
                self.large.discard(staging)

    def tx(self, wait: bool = True) -> AbstractContextManager[object]:
        """The database's write transaction, to join several changes into one commit (a
        memory store has none: nothing to join). `wait=False`: see `Database.tx`."""
        return self.db.tx(wait) if self.db is not None else contextlib.nullcontext()

    def _publish_large(self, key: Key, staging: Path, digester: ChunkDigester, stamp: int) -> bool:
        """Record the object's catalog row, then link its staging file into place (the
        caller holds the key's pin: no delete of it runs meanwhile). The row comes first,
        so every visible object a put made has its row; a crash between the two leaves a
        row without a file, which is inert (see alkfs/catalog.py). A row this put added
        is removed again if the link fails. False: the object existed (freshened)."""
        assert self.large is not None and self.catalog is not None
        rec = digester.record(key.raw, stamp)
        had = self.catalog.get(key.raw) is not None
        self.catalog.put(rec)
        try:
            return self.large.publish(key.raw, staging, stamp)
        except BaseException:
            if not had:
                self.catalog.delete(key.raw)
            raise

    def add(self, data: Source, algo: Algorithm = Algorithm.SHA256) -> Key:
        """Store and release the pin at once: the object lives while something keeps it."""
        result = self.put(data, algo=algo)
        result.pin.release()
        return result.key

    def pin(self, key: Key) -> Pin:
        """An in-process pin (waits out an in-flight delete of this key)."""
        return self.arbiter.acquire(key)

    def freshen(self, key: Key) -> bool:
        """Count the object as written now (a staged delete of it will be cancelled).

        Done under a pin: a delete already in flight finishes first (then this says
        False, and the caller writes the object again), and none can start meanwhile."""
        with self.arbiter.acquire(key):
            stamp = now_ns()
            if self.kv.freshen(key.raw, stamp):
                return True
            if self.large is None or not self.large.freshen(key.raw, stamp):
                return False
            assert self.catalog is not None
            self.catalog.freshen(key.raw, stamp)
            return True

    # -- metadata ---------------------------------------------------------------
    def _entry(self, key: bytes) -> tuple[Entry, str] | None:
        e = self.kv.stat(key)
        if e is not None:
            return e, self.kv.name
        if self.large is not None:
            e = self.large.stat(key)
            if e is not None:
                return self._recorded(e), "large"
        if self.packed is not None and key[:1] in GIT_TAGS:
            found = self.packed.stat(key)
            if found is not None:
                return Entry(key, found[0], found[1]), "packs"
        return None

    def _packed(self, key: Key) -> bytes | None:
        """A packed git object's bytes, verified (Corrupt, marked, when they are not)."""
        if self.packed is None or not key.algo.is_git:
            return None
        try:
            return self.packed.read(key.raw)
        except Corrupt:
            self._mark_corrupt(key)
            raise

    def _recorded(self, e: Entry) -> Entry:
        """A large file's entry as its catalog row has it: the recorded size (whatever
        the file's), stored at the later of the row's time and the file's mtime."""
        assert self.catalog is not None
        rec = self.catalog.get(e.key)
        if rec is None or not rec.consistent():
            return e  # stored before the catalog: the file is all there is to go by
        return Entry(e.key, rec.size, max(rec.stored_ns, e.stored_ns))

    def _recorded_page(self, page: list[Entry]) -> list[Entry]:
        """`_recorded` for a listing page of large files, with one range query."""
        if not page or self.catalog is None:
            return page
        rows = self.catalog.sizes(page[0].key, page[-1].key)
        out = []
        for e in page:
            row = rows.get(e.key)
            out.append(e if row is None else Entry(e.key, row[0], max(row[1], e.stored_ns)))
        return out

    def record(self, key: Key) -> Record | None:
        """The catalog row of a large object (None: none, or no large tier)."""
        if self.catalog is None:
            return None
        rec = self.catalog.get(key.raw)
        return rec if rec is not None and rec.consistent() else None

    def stat(self, key: Key) -> ObjectStat | None:
        found = self._entry(key.raw)
        if found is None:
            return None
        e, tier = found
        return ObjectStat(key, e.size, tier, e.stored_ns)

    def has(self, key: Key) -> bool:
        return self._entry(key.raw) is not None

    def has_raw(self, key: bytes) -> bool:
        return self._entry(key) is not None

    def written_since(self, key: bytes, since_ns: int) -> bool:
        found = self._entry(key)
        return found is not None and found[0].stored_ns > since_ns

    def list(
        self, after: Key | None = None, limit: int = 1000, algo: Algorithm | None = None
    ) -> list[ObjectStat]:
        """Objects in key order after `after`, at most `limit` (resume from the last one)."""
        lo = after.raw if after is not None else (bytes([algo.value]) if algo else b"")
        if algo is not None and lo < bytes([algo.value]):
            lo = bytes([algo.value])
        hi = bytes([algo.value + 1]) if algo is not None else b"\xff"
        rows = [(e, self.kv.name) for e in self.kv.scan(lo, hi, limit)]
        if self.large is not None:
            rows += [(e, "large") for e in self._recorded_page(self.large.scan(lo, hi, limit))]
            rows.sort(key=lambda r: r[0].key)
        return [ObjectStat(Key(e.key), e.size, t, e.stored_ns) for e, t in rows[:limit]]

    def iter_keys(self) -> Iterator[bytes]:
        """Every stored key (raw), unordered across tiers: the mark scan."""
        if isinstance(self.kv, SqlTier):
            yield from self.kv.iter_keys()
        else:
            yield from self.kv.keys()
        if self.large is not None:
            yield from self.large.iter_keys()

    def counts(self) -> dict[str, dict[str, int]]:
        """Per algorithm: objects and their bytes, in all and per tier."""
        out = {
            a.label: {"count": 0, "bytes": 0, "kv": 0, "large": 0, "kv_bytes": 0, "large_bytes": 0}
            for a in Algorithm
        }
        if isinstance(self.kv, SqlTier):
            for b, n, size in self.kv.counts():
                c = out[Algorithm(b).label]
                c["count"] += n
                c["bytes"] += size
                c["kv"] += n
                c["kv_bytes"] += size
        else:
            for k in self.kv.keys():
                c = out[Algorithm(k[0]).label]
                e = self.kv.stat(k)
                c["count"] += 1
                c["kv"] += 1
                c["bytes"] += e.size if e else 0
                c["kv_bytes"] += e.size if e else 0
        if self.large is not None:
            after = b""
            while page := self.large.scan(after, b"\xff", 4096):
                for e in self._recorded_page(page):
                    c = out[Algorithm(e.key[0]).label]
                    c["count"] += 1
                    c["large"] += 1
                    c["bytes"] += e.size
                    c["large_bytes"] += e.size
                after = page[-1].key
        return out

    # -- verified reads -----------------------------------------------------------
    def _check(self, key: Key, data: bytes) -> bytes:
        if not key.matches(data):
            self._mark_corrupt(key)
            raise Corrupt(f"{key}: stored bytes do not hash to the key")
        return data

    def mark_corrupt(self, key: Key) -> None:
        """Report the object in `status.corrupt` (until a verified re-put or read clears it)."""
        if key.raw not in self.corrupt:
            self.log.error("corrupt object %s: stored bytes do not hash to the key", key)
        self.corrupt.add(key.raw)

    _mark_corrupt = mark_corrupt

    def large_path(self, key: Key) -> Path | None:
        if self.large is None:
            return None
        return self.large.path(key.raw)

    def kv_value(self, key: Key) -> bytes | None:
        """The kv tier's bytes for `key`, unverified (callers verify)."""
        return self.kv.read(key.raw)

    def get(self, key: Key) -> bytes | None:
        """The object's bytes, verified; None when absent; Corrupt when they do not hash."""
        data = self.kv.read(key.raw)
        if data is not None:
            return self._check(key, data)
        if self.large is None:
            return self._packed(key)
        path = self.large.path(key.raw)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read()
                # Served unhashed only if this very file was verified before and did
                # not change while it was read (an edit changes its ctime).
                if self.is_verified(key, st) and self.is_verified(key, os.fstat(f.fileno())):
                    return data
        except FileNotFoundError:
            return self._packed(key)
        self._check_large(key, data, st)
        self.remember_verified(key, st)
        return data

    def _check_large(self, key: Key, data: bytes, st: os.stat_result) -> None:
        """A whole large file's bytes against its catalog row (its size, every chunk), or,
        without a row, against its key, recording the row then; Corrupt (marked) if not."""
        rec = self.record(key)
        if rec is not None:
            view = memoryview(data)
            ok = len(data) == rec.size and all(
                rec.matches(i, view[slice(*rec.span(i))]) for i in range(rec.count)
            )
            if not ok:
                self._mark_corrupt(key)
                raise Corrupt(f"{key}: stored bytes do not hash to the key")
            return
        self._check(key, data)
        digester = ChunkDigester()
        digester.update(data)
        self._record_verified(key, digester, st)

    def _record_verified(self, key: Key, digester: ChunkDigester, st: os.stat_result) -> None:
        """Record the row of a large file just verified whole against its key (an object
        stored before the catalog, or one whose row was lost or wrong)."""
        assert self.catalog is not None
        new = digester.record(key.raw, st.st_mtime_ns)
        old = self.catalog.get(key.raw)
        if old is not None:
            if (old.size, old.chunk_size, old.chunk_algo, old.chunks) == (
                new.size,
                new.chunk_size,
                new.chunk_algo,
                new.chunks,
            ):
                return
            self.log.warning("%s: its catalog row did not match its verified bytes", key)
            new = Record(
                new.key,
                new.size,
                max(old.stored_ns, new.stored_ns),
                new.chunk_size,
                new.chunk_algo,
                new.chunks,
            )
        self.catalog.put(new)

    @staticmethod
    def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def is_verified(self, key: Key, st: os.stat_result) -> bool:
        """Whether this very file (same inode, size, mtime and ctime) was already verified."""
        return self._verified.get(key.raw) == self._identity(st)

    def remember_verified(self, key: Key, st: os.stat_result) -> None:
        with self._vlock:
            self._verified[key.raw] = self._identity(st)
            self.corrupt.discard(key.raw)

    def verify_file(self, key: Key, path: Path) -> None:
        """Verify a whole large-tier file in one streaming pass; Corrupt on mismatch."""
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if self.is_verified(key, st):
                return
            self._stream_large(key, f.fileno(), st)

    def verify_open(self, key: Key, fd: int, st: os.stat_result) -> Record | None:
        """Verify the whole open large file `fd` (fstat `st`) in one pass, against its row
        or, without one, against its key (recording the row): its row afterwards.
        Corrupt (marked) on a mismatch."""
        self._stream_large(key, fd, st)
        return self.record(key)

    def read_chunk(self, key: Key, fd: int, rec: Record, i: int) -> bytes:
        """Chunk i of the open large file `fd`, verified against its row: Corrupt (and
        marked) unless the file holds exactly that chunk there (no byte changed, not cut
        short, and for the last one nothing after it)."""
        start, end = rec.span(i)
        extra = 1 if i == rec.count - 1 else 0  # a byte past the size: the file grew
        data = os.pread(fd, end - start + extra, start)
        if not rec.matches(i, data):
            self.log.warning("%s: bytes %d-%d are not its recorded chunk %d", key, start, end, i)
            self._mark_corrupt(key)
            raise Corrupt(f"{key}: stored bytes do not hash to the key")
        return data

    def _stream_large(
        self,
        key: Key,
        fd: int,
        st: os.stat_result,
        *,
        full: bool = False,
        offset: int = 0,
        length: int = 0,
    ) -> bytes:
        """One pass over a whole large file, keeping bytes [offset, offset+length) of it.
        Checked against its catalog row (every chunk, nothing past its size) or, without
        a row or when `full` (verify), against its key, the row being recorded (or
        corrected) from the same pass. Corrupt (marked) on any mismatch."""
        rec = None if full else self.record(key)
        parts: builtins.list[bytes] = []
        end = offset + length

        def keep(pos: int, chunk: bytes) -> None:
            lo, hi = max(offset, pos), min(end, pos + len(chunk))
            if lo < hi:
                parts.append(chunk[lo - pos : hi - pos])

        if rec is not None:
            for i in range(rec.count):
                keep(rec.span(i)[0], self.read_chunk(key, fd, rec, i))
            if rec.count == 0 and os.pread(fd, 1, 0):
                self._mark_corrupt(key)
                raise Corrupt(f"{key}: stored bytes do not hash to the key")
        else:
            h = key.algo.hasher()
            digester = ChunkDigester()
            pos = 0
            while chunk := os.pread(fd, CHUNK, pos):
                h.update(chunk)
                digester.update(chunk)
                keep(pos, chunk)
                pos += len(chunk)
            if h.digest() != key.digest:
                self._mark_corrupt(key)
                raise Corrupt(f"{key}: stored bytes do not hash to the key")
            self._record_verified(key, digester, st)
        self.remember_verified(key, st)
        return b"".join(parts)

    def read_range(self, key: Key, offset: int, length: int) -> tuple[bytes, str] | None:
        """A verified slice and the SHA-256 hex of exactly that slice; None when absent."""
        if offset < 0 or length < 0:
            raise Invalid("negative offset or length")
        data = self.kv.read(key.raw)
        if data is not None:
            piece = self._check(key, data)[offset : offset + length]
        else:
            path = self.large_path(key)
            try:
                if path is None:
                    raise FileNotFoundError
                with open(path, "rb") as f:
                    piece = self._large_slice(key, f, offset, length)
            except FileNotFoundError:
                whole = self._packed(key)
                if whole is None:
                    return None
                piece = whole[offset : offset + length]
        return piece, hashlib.sha256(piece).hexdigest()

    def _large_slice(self, key: Key, f: BinaryIO, offset: int, length: int) -> bytes:
        """A slice of an open large-tier file, never unverified bytes.

        Fast path: the file was verified whole before and is unchanged across the pread.
        With a catalog row, only the chunks the slice covers are read and checked. An
        object without a row is verified whole (its row recorded) in one streaming pass
        that keeps the slice, so a freshen racing the read is no error."""
        fd = f.fileno()
        st = os.fstat(fd)
        if self.is_verified(key, st):
            piece = os.pread(fd, length, offset)
            if self.is_verified(key, os.fstat(fd)):
                return piece
            st = os.fstat(fd)
        rec = self.record(key)
        if rec is None:
            return self._stream_large(key, fd, st, offset=offset, length=length)
        parts: builtins.list[bytes] = []
        for i in rec.covering(offset, length):
            start, end = rec.span(i)
            chunk = self.read_chunk(key, fd, rec, i)
            lo, hi = max(offset, start), min(offset + length, end)
            parts.append(chunk[lo - start : hi - start])
        return b"".join(parts)

    def verify(self, progress: Callable[[int], None] | None = None) -> builtins.list[Key]:
        """Re-hash every object against its key (ignoring what was remembered); a large
        object's catalog row is recorded or corrected from the same pass. Returns the
        corrupt ones."""
        self._verified.clear()
        bad: builtins.list[Key] = []
        self.verifying = 0
        try:
            for n, raw in enumerate(self.iter_keys(), 1):
                self.check_stopping(n)
                self.verifying = n
                key = Key(raw)
                try:
                    if not self._verify_one(key):
                        continue
                except Corrupt:
                    bad.append(key)
                if progress is not None:
                    progress(n)
            for hook in list(self.verify_hooks):  # e.g. the derived packs (alkfs/git/packs.py)
                try:
                    hook()
                except AlkfsError as exc:
                    self.log.error("verify: %s", exc)
        finally:
            self.verifying = None
        return sorted(bad)

    def _verify_one(self, key: Key) -> bool:
        """Verify one object fully; False if it is absent."""
        if self.large is None or self.kv.stat(key.raw) is not None:
            return self.get(key) is not None
        try:
            with open(self.large.path(key.raw), "rb") as f:
                self._stream_large(key, f.fileno(), os.fstat(f.fileno()), full=True)
        except FileNotFoundError:
            return self.get(key) is not None  # (deleted meanwhile, or moved tier: none)
        return True

    def check_stopping(self, n: int = 0) -> None:
        """Interrupted once the store's owner stops (checked every 256th call with `n`)."""
        if not n & 0xFF and self.stopping.is_set():
            raise Interrupted("the store is closing: stopped at a safe point")

    # -- GC -------------------------------------------------------------------------
    def register_source(self, source: LivenessSource) -> int:
        return self.arbiter.register_source(source)

    def register_protect(self, callback: ProtectCallback) -> int:
        return self.arbiter.register_protect(callback)

    def unregister(self, token: int) -> bool:
        return self.arbiter.unregister(token)

    def sweep(
        self,
        window_s: float | None = None,
        *,
        expire_now: bool = False,
        progress: SweepProgress | None = None,
    ) -> SweepReport:
        """One sweep (alkfs/gc/sweep.py); `progress` is told how far it got, and
        `sweep_progress` shows it meanwhile."""
        tracked = False

        def track(phase: str, report: SweepReport) -> None:
            nonlocal tracked
            tracked = True
            self.sweep_progress = {
                "phase": phase,
                "scanned": report.scanned,
                "staged": report.candidates_staged,
                "taken": report.taken,
                "deleted": report.deleted,
            }
            if progress is not None:
                try:
                    progress(phase, report)
                except Exception as exc:  # (a display never changes the sweep)
                    self.log.debug("sweep: the progress callback failed: %s", exc)

        try:
            if window_s is not None:  # (a staged deadline is never beyond 10 years)
                window_s = max(0.0, min(window_s, MAX_WINDOW_S))
            report = sweep(
                self,
                None if window_s is None else int(window_s * 1e9),
                expire_now=expire_now,
                progress=track,
            )
            if tracked:
                track("finishing", report)  # (inert rows, free pages given back)
            if report.aborted is None:
                try:
                    self.reap_inert_rows()
                except AlkfsError as exc:  # (the next sweep tries again)
                    self.log.warning("sweep: inert catalog rows not looked at: %s", exc)
            if report.deleted and self.db is not None:
                try:  # the pages the deleted rows held go back to the filesystem
                    self.db.give_back(self.stopping.is_set)
                except AlkfsError as exc:  # (the next sweep's deletions try again)
                    self.log.warning("sweep: the database kept its free pages: %s", exc)
            return report
        finally:
            if tracked:  # (not another sweep's: a refused one told nothing)
                self.sweep_progress = None
            if self.reserve is not None:
                self.reserve.recheck(reclaim=True)  # (what it freed may end a full disk)

    def reap_inert_rows(self, now: int | None = None) -> int:
        """Remove the catalog rows without their file (a large put cut short between
        its row's commit and its link) stored more than INERT_GRACE_NS ago, each checked
        again under its row lock (a put of the same content waits, then records afresh).
        Incremental: each row's stored time is looked at once (per process) after the
        grace; a file without a row is never removed (an object stored before the
        catalog). How many went."""
        if self.catalog is None or self.large is None or self.db is None:
            return 0
        upto = (now_ns() if now is None else now) - INERT_GRACE_NS
        if upto <= self._inert_upto:
            return 0
        gone = 0
        for key in self.catalog.stored_between(self._inert_upto, upto):
            if os.path.exists(self.large.path(key)):
                continue
            with self.db.tx():
                self.catalog.lock(key)
                if not os.path.exists(self.large.path(key)):
                    gone += self.catalog.delete_stored_by(key, upto)
        self._inert_upto = upto
        if gone:
            self.log.info("sweep: removed %d catalog rows whose files were never linked", gone)
        return gone

    def engine_delete(self, key: bytes) -> int | None:
        """Remove from whichever tier holds it: bytes freed, or None if it was absent."""
        freed = self.kv.delete(key)
        if freed is None and self.large is not None:
            freed = self.large.delete(key)
            if self.catalog is not None:
                # After the file: a visible object never lacks its row (a crash between
                # leaves an inert row, replaced by the next put of the same content).
                self.catalog.delete(key)
        return freed

    def delete_staged(
        self, key: bytes, staged_ns: int, keep: Callable[[bytes], bool] | None = None
    ) -> int | None | bool:
        """The sweep's delete of a candidate staged at `staged_ns` (its delete marker
        held): the bytes freed, None if it was absent, False if it was written since
        (kept; also when `keep` says so). A kv row is decided and deleted under its row
        lock."""
        if isinstance(self.kv, SqlTier):
            freed = self.kv.delete_unwritten(key, staged_ns, keep)
            if freed is not None:
                return freed
        elif self.kv.stat(key) is not None:
            if self.written_since(key, staged_ns):
                return False
            return self.kv.delete(key)
        if self.catalog is not None:
            self.catalog.lock(key)  # (a put of it waits for this transaction)
        if self.written_since(key, staged_ns) or (keep is not None and keep(key)):
            return False
        return self.engine_delete(key)

    def on_deleted(self, key: bytes) -> None:
        with self._vlock:
            self._verified.pop(key, None)
            self.corrupt.discard(key)
        for changed in self.changed_hooks:
            changed()
        for hook in self.deleted_hooks:
            try:
                hook(key)
            except Exception:
                self.log.exception("a deletion hook failed for %s", Key(key))

    def delete(self, key: Key) -> bool:
        """Delete now, unless something protects it (Refused). False if it was absent."""
        try:
            protected = {
                k.raw if isinstance(k, Key) else bytes(k)
                for cb in self.arbiter.protects()
                for k in cb()
            }
        except Exception as exc:
            raise Refused(f"{key}: a protect source failed; not deleted") from exc
        if not self.arbiter.arbitrate(key, protected):
            raise Refused(f"{key} is protected (pinned or live)")
        try:
            freed = self.engine_delete(key.raw)
        finally:
            self.arbiter.conclude(key)
        if freed is not None:
            self.on_deleted(key.raw)
            if self.reserve is not None:
                self.reserve.recheck()
        return freed is not None

    # -- batched puts (many small objects in one transaction) -----------------------
    @_counted
    def put_many(
        self,
        items: Sequence[tuple[bytes, Algorithm, Key | bytes | None]],
        hashed: bool = False,
    ) -> builtins.list[PutResult]:
        """Store many (content, algo, expected key) at once, each like `put`: the small
        ones share one kv transaction. Every item is checked before anything is stored
        (a bad one raises and stores nothing of the small ones); each result carries
        its own pin, to release once the object's name is published. An expected key
        may be given as a Key or as its raw bytes (algorithm byte + digest).

        `hashed`: every item has its expected key, computed from these very bytes by
        this process (alkfs/intents.py: an Intent is made from its content's digest,
        and a logged one is checked against it when read back), so none is hashed
        again."""
        from .git.objects import TYPES as GIT_TYPES

        def made(raw: bytes) -> Key:  # a key built from a digest just computed: valid
            key = object.__new__(Key)
            object.__setattr__(key, "raw", raw)
            return key

        if self.reserve is not None:
            self.reserve.admit()  # (a full disk: nothing of the batch is stored)
        checked: builtins.list[tuple[bytes, bytes, int]] = []  # (raw key, data, index)
        keys: builtins.list[Key | None] = [None] * len(items)
        big: builtins.list[int] = []
        limit = self.threshold if self.mode != "mem" else None
        tags = {a: bytes([a.value]) for a in Algorithm}
        hashers = {a: HASH_OF[a.value] for a in Algorithm}
        last: Algorithm | None = None
        for i, (data, algo, expect) in enumerate(items):
            if algo is not last:  # (Enum hashing is slow; batches are mostly one algorithm)
                last, tag, hasher = algo, tags[algo], hashers[algo]
            want = None if expect is None else expect.raw if isinstance(expect, Key) else expect
            if want is not None and want[:1] != tag:
                raise Invalid("the expected key has another algorithm")
            if limit is not None and len(data) > limit:
                if self.mode == "kv-only":
                    raise TooLarge(f"{len(data)} bytes is over the kv-only threshold {limit}")
                big.append(i)
                continue
            if algo is Algorithm.GIT_SHA1 or algo is Algorithm.GIT_SHA256:
                # the common case checked inline; check_canonical says what is wrong
                nul = data.find(b"\0", 0, MAX_HEADER)
                sp = data.find(b" ", 0, nul)
                if (
                    nul < 0
                    or data[:sp] not in GIT_TYPES
                    or data[sp + 1 : nul] != b"%d" % (len(data) - nul - 1)
                ):
                    check_canonical(data[:MAX_HEADER], len(data))
            raw = want if hashed and want is not None else tag + hasher(data).digest()
            if want is not None and want != raw:
                raise Verification(f"the content hashes to {made(raw)}, not {Key(bytes(want))}")
            key = expect if isinstance(expect, Key) else made(raw)
            keys[i] = key
            checked.append((raw, bytes(data), i))
        checked.sort()  # key order: the kv index is written where it is already warm
        pins = self.pin_many([raw for raw, _, _ in checked])  # pin before publish
        results: builtins.list[PutResult | None] = [None] * len(items)
        try:
            created = self._kv_insert(
                [raw for raw, _, _ in checked], [data for _, data, _ in checked], now_ns()
            )
            for (_, _, i), pin, was_made in zip(checked, pins, created, strict=True):
                k = keys[i]
                assert k is not None
                results[i] = PutResult(k, pin, was_made)
            for i in big:
                data, algo, expect = items[i]
                if expect is not None and not isinstance(expect, Key):
                    expect = Key(bytes(expect))
                results[i] = self.put(data, algo=algo, expect=expect)
        except BaseException:
            for pin in pins:
                pin.release()
            for r in results:
                if r is not None and r.pin is not None:
                    r.pin.release()
            raise
        return [r for r in results if r is not None]

    def _kv_insert(
        self, raws: Sequence[bytes], datas: Sequence[bytes], stamp: int
    ) -> builtins.list[bool]:
        """Insert (key, content) rows in one kv transaction, in the order given; rows
        already present keep their bytes and count as written now. Which rows created
        their entry (of identical keys, only the first). The caller has pinned every key."""
        kv = self.kv
        if isinstance(kv, SqlTier):
            created = kv.insert_many(raws, datas, stamp)
        else:
            created = [kv.put(raw, data, stamp) for raw, data in zip(raws, datas, strict=True)]
        if len(raws) != len(set(raws)):  # identical items: the first one created the entry
            seen: set[bytes] = set()
            first = []
            for raw, c in zip(raws, created, strict=True):
                first.append(c and raw not in seen)
                seen.add(raw)
            created = first
        self._put_done(raws, datas)
        return created

    def _put_done(self, raws: Sequence[bytes], datas: Sequence[bytes | bytearray]) -> None:
        for hook in self.put_hooks:
            hook(raws, datas)  # type: ignore[arg-type]  # (read, never kept)

    def pin_many(self, raws: builtins.list[bytes]) -> builtins.list[Pin]:
        """In-process pins on many keys (raw bytes) in one locked step: `pin` for each,
        with the same waits for in-flight deletes and the same counts."""
        self.pin_raws(raws)
        arbiter = self.arbiter
        return [Pin(arbiter, raw) for raw in raws]

    def pin_raws(self, raws: Iterable[bytes]) -> None:
        """pin_many without a Pin object each; give them back with `unpin_raws`."""
        self.arbiter.acquire_counts(raws)

    def unpin_raws(self, raws: builtins.list[bytes]) -> None:
        self.arbiter.release_counts(raws)

    # -- the git import's fast path: hashed on the caller's thread, stored on another ----
    class Digested:
        """Git objects with the keys `digest_git` derived from their bytes, for
        `put_digested`, which stores them under these keys without hashing again.
        Only `digest_git` makes one; it holds immutable bytes only, so a key can never
        be paired with content other than the content that hashed to it."""

        __slots__ = ("algo", "raws", "datas", "big")
        algo: Algorithm
        raws: tuple[bytes, ...]
        datas: tuple[bytes, ...]
        big: tuple[int, ...]

        def __init__(
            self, algo: Algorithm, raws: tuple[bytes, ...], datas: tuple[bytes, ...], big: tuple
        ) -> None:
            for name, value in (("algo", algo), ("raws", raws), ("datas", datas), ("big", big)):
                object.__setattr__(self, name, value)

        def __setattr__(self, name: str, value: object) -> None:
            raise AttributeError("a digested batch is immutable")

    def digest_git(
        self, algo: Algorithm, kinds: builtins.list[bytes], bodies: Sequence[bytes | bytearray]
    ) -> Digested:
        """The canonical git objects of (kind, body) pairs, "<kind> <size>\\0<body>",
        each hashed here. The caller compares `.raws` (algorithm byte + digest, in input
        order) with the ids it expects; `put_digested` stores them under exactly these."""
        from .git.objects import TYPES as GIT_TYPES

        if algo is Algorithm.GIT_SHA1:
            hasher = hashlib.sha1
        elif algo is Algorithm.GIT_SHA256:
            hasher = hashlib.sha256
        else:
            raise Invalid(f"{algo.label} is not a git object format")
        if len(kinds) != len(bodies):
            raise Invalid("one kind per body")
        if not frozenset(GIT_TYPES).issuperset(kinds):
            bad = next(k for k in kinds if k not in GIT_TYPES)
            raise Verification(f"not a git object type: {bad[:16]!r}")
        datas = tuple(
            [b"%s %d\0%s" % kb for kb in zip(kinds, map(len, bodies), bodies, strict=True)]
        )
        tag = bytes([algo.value])
        raws = tuple([tag + hasher(data).digest() for data in datas])
        big: tuple[int, ...] = ()
        if self.mode != "mem":
            limit = self.threshold
            big = tuple(i for i, data in enumerate(datas) if len(data) > limit)
            if big and self.mode == "kv-only":
                raise TooLarge(f"{len(datas[big[0]])} bytes is over the kv-only threshold {limit}")
        return Store.Digested(algo, raws, datas, big)

    @_counted
    def put_digested(self, batch: Digested) -> builtins.list[bool]:
        """Store a `digest_git` batch under its keys (small objects in one kv transaction,
        in the batch's order), each pinned before it is published: which ones were
        created, in the batch's order. The pins stay until the caller's `unpin_raws(batch.raws)`
        (released here if this fails)."""
        if type(batch) is not Store.Digested:
            raise Invalid("not a batch hashed by digest_git")
        raws, datas = batch.raws, batch.datas
        if self.reserve is not None:
            self.reserve.admit()
        self.pin_raws(raws)  # pin before publish
        try:
            if batch.big:
                skip = set(batch.big)
                small = [i for i in range(len(raws)) if i not in skip]
                done = self._kv_insert(
                    [raws[i] for i in small], [datas[i] for i in small], now_ns()
                )
                created = [False] * len(raws)
                for i, c in zip(small, done, strict=True):
                    created[i] = c
            else:
                # in the source's order: git's pack order keeps what is read together
                # together (sorting by key measured no faster with the importer's cache)
                created = self._kv_insert(raws, datas, now_ns())
            for i in batch.big:
                r = self.put(datas[i], algo=batch.algo, expect=Key(raws[i]))
                r.pin.release()  # the batch's pin holds it
                created[i] = r.created
        except BaseException:
            self.unpin_raws(list(raws))
            raise
        return created
