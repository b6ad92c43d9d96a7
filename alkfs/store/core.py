"""The store itself: `Store`, assembled from its parts, and its construction: opening
(the lock, privacy, the fleet, the reserve), closing.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, cast

from .. import privacy
from ..binding import DB_NAME as DB_NAME
from ..binding import open_database, settle
from ..errors import StoreIO, StoreLocked
from ..fleet import Fleet
from ..reserve import Reserve
from ..settings import settings
from .batches import StoreBatches
from .deletes import StoreDeletes
from .listing import StoreListing
from .puts import StorePuts
from .reads import StoreReads
from .state import StoreState

if TYPE_CHECKING:
    from ..db.postgres import PostgresDatabase

DEFAULT_THRESHOLD = 131072
DEFAULT_WINDOW_S = 3600
LOCK_NAME = "alkfs.lock"


class Store(StorePuts, StoreBatches, StoreListing, StoreReads, StoreDeletes, StoreState):
    """A content-addressed store: small objects in its database, large ones in a directory."""

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
                    ttl = settings().fleet_ttl_s
                    # (a member's database is a PostgreSQL one: `database` was given)
                    store.fleet = Fleet(store, cast("PostgresDatabase", db), own, ttl)
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
        """Between the small puts the write-behind applies (alkfs/writebehind.py; a
        thread that may wait): the database's log written into its file, and the
        reserve's look at the disk made ahead of the puts it acknowledges, which never
        look (`Reserve.look_ahead`)."""
        if self.db is not None:
            self.db.backfill()
        if self.reserve is not None:
            self.reserve.look_ahead()
