"""What every part of one mount reads: the store with its refs and pins, the options, the
one helper for blocking work, the inode table, the invalidator, the workers, the listings
and the request counts. Nothing here holds what a write leaves behind: that is the write
state, which the context adds (`Context`, context.py) and hands to those who write.

The framework and the write-state modules below the context are typed against these
services alone (layers.toml)."""

from __future__ import annotations

import functools
import grp
import logging
import os
import pwd
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar, TypeVarTuple

import trio

from alkfs.app import Alkfs
from alkfs.git.refs import Refs
from alkfs.keys import Key
from alkfs.pins import Pins
from alkfs.settings import settings
from alkfs.store import Store

from .inodes import InodeTable
from .invalidate import Invalidator, KernelChannel
from .listings import Listings
from .requests_stats import RequestStats
from .workers import Workers

log = logging.getLogger("alkfsd")

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

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


class Services:
    """Shared by every node of one mount. Owned by the trio thread, except where noted."""

    def __init__(
        self,
        store: Store,
        *,
        app: Alkfs | None = None,
        options: Options | None = None,
        kernel: KernelChannel | None = None,
    ) -> None:
        """`kernel`: what the mount tells the kernel through (None: an `Invalidator`, for
        the kernel session `main` mounts; a test's fake without a session otherwise)."""
        self.store = store
        self.app: Alkfs = app if app is not None else Alkfs(store)  # (refs, pins, sources)
        self.refs: Refs = self.app.refs
        self.pins: Pins = self.app.pins
        self.options = options or Options()
        self.inodes = InodeTable()
        self.invalidator: KernelChannel = kernel if kernel is not None else Invalidator()
        self.workers = Workers()  # the mount's background tasks (main.serve starts them)
        self.limiter = trio.CapacityLimiter(self.options.threads)
        self.deletion_views: list[DeletionView] = []
        self.errors: dict[tuple[str, int], int] = {}
        self.stats = RequestStats()  # FUSE requests by operation, latencies, bytes
        self.mountpoint: str | None = None
        self.started_ns = time.time_ns()
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
    def listings(self) -> Listings:
        """The directory listings the kernel caches (listings.py; without a kernel
        session, never caching)."""
        return Listings(self, kernel=self.live)

    @property
    def live(self) -> bool:
        """A kernel session serves this mount (main: always); not for direct calls of the
        operations: nothing acknowledged ahead (staging/pending.py), no listing cached
        (listings.py), no page pushed at an open (nodes/objfile.py)."""
        return self.invalidator.session

    @property
    def read_only(self) -> bool:
        return self.options.read_only

    async def run_sync(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """The one way to run blocking work (sqlite writes, big file I/O, big hashes, sweeps)."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    def _on_deleted(self, raw_key: bytes) -> None:
        """Store hook, called in the sweeping thread: queue the kernel invalidations."""
        key = Key(raw_key)
        for view in list(self.deletion_views):
            try:
                for parent, name, ino in view(key):
                    self.invalidator.submit(parent, name, ino)
            except Exception:
                log.exception("deletion view failed for %s", key)

    def close(self) -> None:
        """At the mount's end: the listings' state dropped, the store's hook removed."""
        listings_: Listings | None = self.__dict__.get("listings")
        if listings_ is not None:
            listings_.close()
        try:
            self.store.deleted_hooks.remove(self._on_deleted)
        except ValueError:
            pass
