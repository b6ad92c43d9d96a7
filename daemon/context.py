"""What every node can reach: the store, its refs and pins, the options, the one helper for
blocking work, the inode table, the invalidator and the mount's write state.

The context sits at the top of the write-state layer (it owns `Writes`); the framework
below names it for types only."""

from __future__ import annotations

import functools
import grp
import logging
import os
import pwd
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypedDict, TypeVar, TypeVarTuple

import trio

from alkfs.app import Alkfs
from alkfs.gc.sweep import dry_run
from alkfs.git.refs import Refs
from alkfs.keys import Key
from alkfs.pins import Pins
from alkfs.settings import settings
from alkfs.store import Store

from .inodes import InodeTable
from .invalidate import Invalidator
from .listings import Listings
from .packs import Served
from .requests_stats import RequestStats
from .staging.pending import Pending
from .staging.writes import Writes
from .workers import Workers

log = logging.getLogger("alkfsd")

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class PackFigures(TypedDict):
    """One format's derived packs in the status (daemon/packs.py's `Served.status`)."""

    generation: int | None
    objects: int
    packs: int
    bytes: int
    built_at: str | None
    last_error: str | None
    primary: bool
    drained: int


INVALIDATE_WAIT_S = 10.0  # how long a sweep request waits for the kernel to drop entries

# A deletion view maps a deleted key to the kernel entries that showed it:
# (parent inode, name, inode of the entry) triples, e.g. /objects/<algo>/<hex>.
DeletionView = Callable[[Key], Iterable[tuple[int, bytes, int]]]


@dataclass
class Options:
    read_only: bool = False
    allow_other: bool = False
    threads: int = 16
    push_grace_s: float | None = None  # None: max(10 min, the window) (scratch.Writes)
    # --owner USER[:GROUP]: the tree shows as theirs and they may change it as root can
    # (but the control file, root's alone). None: the daemon's own user.
    owner_uid: int | None = None
    owner_gid: int | None = None
    # Per-user bounds of a shared mount (--allow-other or --owner), per uid other than
    # root's (fs.py): open write handles and bytes written through them not yet released
    # (ALKFS_MAX_WRITE_HANDLES, 64; ALKFS_MAX_SPOOL_BYTES, 1 GiB), and open read handles
    # (ALKFS_MAX_READ_HANDLES, 1024: each may hold a descriptor of the daemon's, a large
    # object, a pack); all users but root together hold at most half the daemon's
    # descriptor limit, so root's, the owner's and the daemon's own work always have the
    # other half. (alkfs/settings.py)
    max_write_handles: int = field(default_factory=lambda: settings().max_write_handles)
    max_spool_bytes: int = field(default_factory=lambda: settings().max_spool_bytes)
    max_read_handles: int = field(default_factory=lambda: settings().max_read_handles)

    @property
    def owner_only(self) -> bool:
        """--owner without --allow-other: root and that user alone."""
        return self.owner_uid is not None and not self.allow_other

    @property
    def shared(self) -> bool:
        """Other users reach the mount (the kernel is given allow_other): the daemon
        makes every permission decision itself (fs.py)."""
        return self.allow_other or self.owner_uid is not None


def parse_owner(text: str) -> tuple[int, int]:
    """`USER[:GROUP]` (names or numbers) -> (uid, gid); GROUP defaults to USER's group.
    ValueError with a sentence when either is unknown."""
    user, _, group = str(text).partition(":")
    try:
        pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
        uid, gid = pw.pw_uid, pw.pw_gid
    except KeyError:
        if not user.isdigit():
            raise ValueError(f"--owner: no user {user!r}") from None
        uid, gid = int(user), int(user)
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            try:
                gid = grp.getgrnam(group).gr_gid
            except KeyError:
                raise ValueError(f"--owner: no group {group!r}") from None
    return uid, gid


class Context:
    """Shared by every node of one mount. Owned by the trio thread, except where noted."""

    def __init__(
        self,
        store: Store,
        *,
        app: Alkfs | None = None,
        options: Options | None = None,
        live: bool = True,
    ) -> None:
        self.store = store
        self.app: Alkfs = app if app is not None else Alkfs(store)  # (refs, pins, sources)
        self.refs: Refs = self.app.refs
        self.pins: Pins = self.app.pins
        self.options = options or Options()
        self.inodes = InodeTable()
        # a kernel session serves this context (main: always); False for direct calls of
        # Operations with no session: nothing acknowledged ahead (staging/pending.py), no
        # listing cached (listings.py), no page pushed at an open (nodes/objfile.py)
        self.live = live
        self.invalidator = Invalidator()
        self.workers = Workers()  # the mount's background tasks (main.serve starts them)
        self.limiter = trio.CapacityLimiter(self.options.threads)
        self.deletion_views: list[DeletionView] = []
        self.errors: dict[tuple[str, int], int] = {}
        self.stats = RequestStats()  # FUSE requests by operation, latencies, bytes
        self.mountpoint: str | None = None
        # /repos/<id>/packed-refs: (repo id, created_ns) -> (refs version, content, made_ns)
        self.packed_refs: dict[tuple[str, int], tuple[int, bytes, int]] = {}
        # /repos/<id>/objects/pack: stems of packs git moved in whose objects are stored
        self.ingested_packs: dict[tuple[str, int], set[bytes]] = {}
        self.started_ns = time.time_ns()
        self.next_sweep_ts: float | None = None  # (the periodic sweeper sets it)
        self.last_dry_run: dict[str, object] | None = None  # (/.alkfs/dry-run)
        self.daemon_uid = os.getuid()  # who may do anything (with root)
        self.daemon_gid = os.getgid()
        o = self.options
        self.uid = o.owner_uid if o.owner_uid is not None else self.daemon_uid  # shown
        self.gid = o.owner_gid if o.owner_gid is not None else self.daemon_gid
        # --owner without --allow-other: the kernel checks the modes (default_permissions:
        # daemon/main.py) and the tree shows the owner's bits only, so that no other user
        # sees anything, not even what the kernel has cached (entries, attributes)
        self.mode_mask = ~0o077 if o.owner_only else ~0
        store.deleted_hooks.append(self._on_deleted)

    @functools.cached_property
    def writes(self) -> Writes:
        """What git's writes leave in memory, and the scratch area (emptied when made:
        `main` makes it before the first request)."""
        return Writes(self)

    @functools.cached_property
    def pending(self) -> Pending:
        """Small files acknowledged ahead of their commit (staging/pending.py; only for a
        live mount: direct calls commit each file as before)."""
        return Pending(self, enabled=self.live)

    @functools.cached_property
    def listings(self) -> Listings:
        """The directory listings the kernel caches (listings.py; without a kernel
        session, never caching)."""
        return Listings(self, kernel=self.live)

    @functools.cached_property
    def packs(self) -> Served:
        """The derived packs this mount serves (made at first use, on the trio thread: the
        git view's first listing or the intake worker)."""
        return Served(self)

    def packs_status(self) -> dict[str, PackFigures]:
        """The derived packs' part of the status ({} until they are made)."""
        served: Served | None = self.__dict__.get("packs")
        return served.status() if served is not None else {}

    def prepare(self) -> None:
        """At mount start, before any request: the write state is made (and the scratch
        area emptied)."""
        _ = self.writes

    @property
    def read_only(self) -> bool:
        return self.options.read_only

    async def run_sync(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """The one way to run blocking work (sqlite writes, big file I/O, big hashes, sweeps)."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    # -- sweeps -------------------------------------------------------------------
    def _on_deleted(self, raw_key: bytes) -> None:
        """Store hook, called in the sweeping thread: queue the kernel invalidations."""
        key = Key(raw_key)
        for view in list(self.deletion_views):
            try:
                for parent, name, ino in view(key):
                    self.invalidator.submit(parent, name, ino)
            except Exception:
                log.exception("deletion view failed for %s", key)

    async def sweep(
        self, window_s: float | None = None, *, scheduled: bool = False, expire_now: bool = False
    ):
        """Run one sweep in a worker thread; return once the kernel has been told what went.
        A scheduled sweep that finds another daemon of the fleet sweeping is skipped
        quietly (no log line; `status.last_sweep` keeps the last one that ran)."""
        before = self.store.last_sweep
        report = await self.run_sync(
            functools.partial(self.store.sweep, window_s, expire_now=expire_now)
        )
        if scheduled and report.aborted == "sweeper-lock":
            self.store.last_sweep = before
            log.debug("scheduled sweep skipped: another daemon of the fleet is sweeping")
            return report
        log.info("sweep %s", report.to_json())
        seq = self.invalidator.submitted
        if not await self.invalidator.wait(seq, INVALIDATE_WAIT_S):  # (holds no thread)
            log.warning("sweep: the kernel did not take every invalidation in time")
        return report

    async def dry_run(self) -> dict[str, object]:
        """What a sweep would stage now (nothing changes); kept for /.alkfs/dry-run."""
        await self.pending.drain()  # (its mark reads the pins' rows: the pending ones too)
        result = await self.run_sync(dry_run, self.store)
        self.last_dry_run = result
        log.info(
            "sweep --dry-run: %d object(s), %d bytes would be staged",
            result["would_stage"],
            result["would_stage_bytes"],
        )
        return result

    async def verify(self) -> list[Key]:
        await self.pending.drain()  # (it re-hashes the database's objects: the pending too)
        bad = await self.run_sync(self.store.verify)
        log.info("verify: %d corrupt object(s)%s", len(bad), "".join(f" {k}" for k in bad))
        return bad

    def close(self) -> None:
        """At the mount's end: pins of push sessions released, scratch bytes removed."""
        pending: Pending | None = self.__dict__.get("pending")
        if pending is not None:
            pending.close()
        writes = self.__dict__.pop("writes", None)
        if writes is not None:
            writes.close()
        listings_: Listings | None = self.__dict__.get("listings")
        if listings_ is not None:
            listings_.close()
        try:
            self.store.deleted_hooks.remove(self._on_deleted)
        except ValueError:
            pass
