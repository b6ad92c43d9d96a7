"""The wiring every caller uses: a store with its refs and pins, both registered as liveness sources."""

from __future__ import annotations

import functools
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from . import __version__, privacy, writebehind
from .binding import BINDING_NAME
from .gc import staged
from .git import packs
from .git.closure import RefClosure
from .git.lfs import LfsMedia
from .git.packed import PackedObjects
from .git.refs import Refs
from .keys import Key
from .pins import Pins
from .roots import Roots
from .settings import settings
from .store import DB_NAME, DEFAULT_THRESHOLD, Store

if TYPE_CHECKING:
    from .fleet import FleetNode
    from .gc.sweep import SweepFigures


def store_exists(path: str | os.PathLike[str]) -> bool:
    """Whether `path` holds a store (its sqlite file, or its binding to a database)."""
    return any(os.path.exists(os.path.join(path, n)) for n in (DB_NAME, BINDING_NAME))


class StoreFigures(TypedDict):
    path: str | None
    mode: str
    threshold: int
    window_s: int | float


class DatabaseFigures(TypedDict):
    engine: str
    name: str


class FleetFigures(TypedDict):
    self: str
    nodes: list[FleetNode]


# Bytes on disk by part (`Alkfs.disk`): database, database_free (None: not a sqlite
# store), large, packs.
DiskFigures = dict[str, int | None]


class StagedFigures(TypedDict):
    """The delete window's candidates (`Alkfs.staged`)."""

    count: int | None
    bytes: int | None
    next_deadline: str | None


class Verifying(TypedDict):
    """A running verify (the mount's status): objects looked at of those stored."""

    done: int
    total: int


class Status(TypedDict):
    """The status JSON (docs/operations.md), the library's part (`Alkfs.status`; the daemon adds its
    own: daemon/status.py)."""

    version: str
    store: StoreFigures
    database: DatabaseFigures | None
    fleet: FleetFigures | None
    objects: dict[str, dict[str, int]]
    disk: DiskFigures
    pins: int
    repos: int
    roots: int
    staged: StagedFigures
    sweeping: bool
    last_sweep: SweepFigures | None
    corrupt: list[str]


class Alkfs:
    """An opened store plus its git refs (`refs`) and durable pins (`pins`)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.refs = Refs(store)
        self.closure = RefClosure(store, self.refs)
        self.pins = Pins(store, closure=self.closure)
        self.roots = Roots(store, self.closure)  # borrowers (docs/gc.md)
        refs, roots = self.refs, self.roots
        self.lfs = LfsMedia(store, (lambda: refs.write_counter, lambda: roots.write_counter))
        self.behind: writebehind.WriteBehind | None = None  # (start_behind)
        self._tokens = [
            store.register_source(self.closure),
            store.register_source(self.pins),
            store.register_source(self.roots),
            store.register_source(self.lfs),  # (last: its media follow the others' keys)
            store.arbiter.register_protect(self.lfs.protect),
        ]
        store.delete_guards.append(functools.partial(packs.guard_deletes, store))
        if store.path is not None and store.packed is None:  # git objects read from packs
            store.packed = PackedObjects(store)
        store.verify_hooks.append(functools.partial(packs.verify_sets, store))
        store.before_drain.append(self.lfs.scan)  # (pointers recorded before rows go)
        if store.reserve is not None:  # a full disk drops the derived packs first
            store.reserve.shedders.append(functools.partial(packs.shed, store))
        if store.fleet is not None:  # another daemon's ref change: views made again
            walker = self.closure.walker
            store.fleet.reaches = lambda raws: walker.walk(map(Key, raws))
            store.fleet.on_refs.append(self.refs.changed_elsewhere)
            store.fleet.on_roots.append(self.roots.asked)  # (a sweep elsewhere asks)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        mode: str | None = None,
        threshold: int | None = None,
        window_s: float | None = None,
        lock: bool = True,
        database: str | None = None,
    ) -> Alkfs:
        if mode != "mem":
            privacy.prepare(path)  # the store is its owner's alone
        store = Store.open(
            path, mode=mode, threshold=threshold, window_s=window_s, lock=lock, database=database
        )
        try:
            app = cls(store)
            if store.holds_lock:  # what a stopped daemon acknowledged and did not commit
                writebehind.replay(app.pins)
            return app
        except BaseException:
            store.close()
            raise

    @classmethod
    def memory(cls, threshold: int | None = None, window_s: float = 0) -> Alkfs:
        return cls(Store.memory(threshold or DEFAULT_THRESHOLD, window_s))

    def status(self) -> Status:
        """The status JSON's figures (docs/operations.md); reads the whole store: not for the
        trio thread."""
        store = self.store
        last = store.last_sweep
        window_s = store.window_ns / 1e9
        return {
            "version": __version__,
            "store": {
                "path": None if store.path is None else str(store.path.resolve()),
                "mode": store.mode,
                "threshold": store.threshold,
                "window_s": int(window_s) if window_s.is_integer() else window_s,
            },
            "database": None
            if store.db is None
            else {"engine": store.db.engine, "name": store.db.describe()},
            "fleet": None
            if store.fleet is None
            else {"self": store.fleet.node, "nodes": store.fleet.nodes()},
            "objects": (counts := store.counts()),
            "disk": self.disk(counts),
            "pins": len(self.pins.list()),
            "repos": len(self.refs.repos()),
            "roots": len(self.roots),
            "staged": self.staged(),
            "sweeping": store.arbiter.sweeping,
            "last_sweep": None if last is None else last.to_dict(),
            "corrupt": sorted(str(Key(k)) for k in list(store.corrupt)),
        }

    def disk(self, counts: dict[str, dict[str, int]]) -> DiskFigures:
        """Bytes on disk by part: the sqlite file (with its WAL; None on PostgreSQL) and
        its free pages, the large tier's objects, the git packs' files (each once)."""
        store = self.store
        database = spare = None
        db = store.db
        if db is not None and db.engine == "sqlite" and store.path is not None:
            database = sum(
                _allocated(store.path / f"{DB_NAME}{ext}") for ext in ("", "-wal", "-shm")
            )
            spare = db.spare_bytes()
        packs = 0 if store.path is None else _tree_allocated(store.path / "derived")
        return {
            "database": database,
            "database_free": spare,
            "large": sum(c["large_bytes"] for c in counts.values()),
            "packs": packs,
        }

    def staged(self) -> StagedFigures:
        """The delete window's candidates: count, bytes, and the first deadline (ISO)."""
        t = staged.totals(self.store)
        first = t["first_deadline_ns"]
        return {
            "count": t["count"],
            "bytes": t["bytes"],
            "next_deadline": None
            if first is None
            else datetime.fromtimestamp(first / 1e9, UTC).isoformat(timespec="seconds"),
        }

    def start_behind(self) -> writebehind.WriteBehind | None:
        """The write-behind of small puts (alkfs/writebehind.py), made once for a store
        this process alone writes, on sqlite, on disk (None elsewhere, or with
        ALKFS_INTENTS=off): `behind`. Its owner applies it; `close` applies what is left."""
        if self.behind is None and settings().intents:
            store = self.store
            if (
                store.path is not None
                and store.sole_writer
                and store.db is not None
                and store.db.engine == "sqlite"
                and store.mode != "mem"
            ):
                self.behind = writebehind.WriteBehind(self.pins)
        return self.behind

    def close(self) -> None:
        behind, self.behind = self.behind, None
        if behind is not None:
            behind.close()
        for token in self._tokens:
            self.store.unregister(token)
        self._tokens = []
        if isinstance(self.store.packed, PackedObjects):
            self.store.packed.close()
        self.store.close()

    def __enter__(self) -> Alkfs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _allocated(path: Path) -> int:
    """Bytes a file holds on disk (0 if missing)."""
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


def _tree_allocated(root: Path) -> int:
    """Bytes the files under `root` hold on disk, a file with many links counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for top, _dirs, names in os.walk(root):
        for name in names:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:
                continue  # (removed meanwhile)
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total
