"""Space the store keeps for itself, so that a full disk still lets things be deleted.

`STORE/reserve` is a preallocated file (0600) of `size` bytes: min(64 MiB, max(8 MiB,
1 % of the filesystem)), never more than an eighth of it. It is made once the
filesystem has less than ARM_FACTOR * size free (looked at when the store opens, then
at puts, at most once every ARM_EVERY_S, or just before by the write-behind's backfill:
`look_ahead`), so a store on a roomy disk holds none.

sqlite needs free space even to delete (its WAL grows before anything is freed). When
a write finds the disk full (`hit`: ENOSPC, EDQUOT, SQLITE_FULL), the store removes
the reserve (its space pays for what the next step writes) and drops what it can
rebuild (`shedders`: derived data); if less than `2 * size` is free after that, the
reserve is not made again and the store enters the "disk full" state (one log line). In it,
new objects are refused up front with NoSpace (`admit`), so puts cannot eat the space
the reserve gave back; unpins, ref and repository deletes and sweeps run. Once
`2 * size` is free again (the reserve and as much spare, of which pages sqlite freed
inside store.db count: `spare`; deleting small objects gives the filesystem nothing
back, but new small objects reuse those pages), the reserve is made again and the
state left (one log line). That is looked at by each refused put and after deletes and
sweeps (`recheck`; after a sweep, the WAL is checkpointed and truncated first:
`reclaim`). A store opened with its reserve missing and too little space to make it
starts in the disk full state.

Thread-safe: one lock, held across a statvfs, an unlink, the reserve's allocation and
the shedders.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .errors import NoSpace

RESERVE_NAME = "reserve"
RESERVE_MAX = 64 << 20
RESERVE_MIN = 8 << 20
ARM_FACTOR = 16  # the reserve is made once less than this many times its size is free
ARM_EVERY_S = 1.0  # how often a put looks at the free space while there is no reserve
LOOK_AHEAD_S = 0.5  # `look_ahead` looks this long before a put would have to
FILE_MODE = 0o600
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
MIB = 1 << 20

log = logging.getLogger("alkfs.store")


def is_no_space(exc: BaseException) -> bool:
    """Whether an OSError says the disk (or the quota) is full."""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS


def reserve_size(total: int) -> int:
    """The reserve for a filesystem of `total` bytes (see the module docstring)."""
    return max(0, min(RESERVE_MAX, max(RESERVE_MIN, total // 100), total // 8))


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


class Reserve:
    """See the module docstring. `full` is the state; `size` the reserve's bytes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / RESERVE_NAME
        st = os.statvfs(root)
        self.size = reserve_size(st.f_blocks * st.f_frsize)
        self.full = False
        self.have = False  # the reserve is in place
        self._next_look = 0.0  # (monotonic) when a put next looks at the free space
        # Called when the disk is found full, before the reserve is touched: each drops
        # data the store can rebuild (derived packs) and returns the bytes it freed.
        self.shedders: list[Callable[[], int]] = []
        # Bytes free inside the store's own files (sqlite's free pages), for `recheck`.
        self.spare: Callable[[], int] | None = None
        # Gives the filesystem back what the store's files hold and no longer need (a
        # WAL checkpoint that truncates it): `recheck(reclaim=True)`, after sweeps.
        self.reclaim: Callable[[], None] | None = None
        self._lock = threading.RLock()  # (a shedder's own full-disk error calls `hit`)

    # -- measurements ---------------------------------------------------------------
    def free(self) -> int:
        """Bytes a write of this process could still take on the store's filesystem."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def present(self) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return st.st_blocks * 512 >= self.size

    # -- the state --------------------------------------------------------------------
    def open(self) -> None:
        """At the store's open: the reserve in place, or the disk full state entered."""
        if self.size == 0:
            return
        self._arm("at open")

    def _arm(self, when: str) -> None:
        """Make the reserve if the disk is filling up; the disk full state if it cannot."""
        with self._lock:
            if self.have or self.full:
                return
            if self.present():
                self.have = True
                return
            if self.free() >= ARM_FACTOR * self.size:
                return  # (room enough: no reserve yet)
            if self._create():
                self.have = True
            else:
                self._enter(self.free(), f"{when}, too little space for the reserve")

    def settled(self) -> bool:
        """Whether `admit` would answer now without looking at the disk."""
        return not self.full and (self.have or not self.size or time.monotonic() < self._next_look)

    def look_ahead(self) -> None:
        """Look at the free space now if a put would have to within LOOK_AHEAD_S (from a
        thread that may wait: the write-behind's backfill, alkfs/writebehind.py), so that
        the small files it acknowledges ahead keep finding the reserve settled."""
        if self.full or self.have or not self.size:
            return
        now = time.monotonic()
        if now + LOOK_AHEAD_S < self._next_look:
            return
        self._next_look = now + ARM_EVERY_S
        self._arm("ahead of the puts")

    def admit(self) -> None:
        """Before a new object is written: NoSpace while the disk is full."""
        if not self.full:
            if self.have or not self.size:
                return
            now = time.monotonic()
            if now < self._next_look:
                return
            self._next_look = now + ARM_EVERY_S
            self._arm("at a put")
            if not self.full:
                return
        self.recheck()
        if self.full:
            raise NoSpace(
                f"no space left on the device holding the store {self.root}: "
                f"{_mib(self.free())} free, new objects wait for {_mib(2 * self.size)} "
                "(unpin, delete refs or repositories, then sweep)"
            )

    def recheck(self, *, reclaim: bool = False) -> None:
        """Leave the disk full state when the reserve can be made again with as much
        spare; with `reclaim`, first give back what the store's files no longer need."""
        if not self.full:
            return
        if reclaim and self.reclaim is not None:
            try:
                self.reclaim()
            except Exception as exc:
                log.warning("on a full disk, reclaiming the store's unused space failed: %s", exc)
        spare = self._spare()  # (a database read: outside the lock)
        with self._lock:
            if self.full and self._create(spare):
                self.full = False
                self.have = True
                log.warning(
                    "disk no longer full: %s free on the store's filesystem (%s), %s inside "
                    "the database; the reserve (%s) is back and new objects are accepted again",
                    _mib(self.free()),
                    self.root,
                    _mib(spare),
                    _mib(self.size),
                )

    def hit(self) -> None:
        """A write found the disk full: shed derived data, then give the reserve back.
        Never raises (it runs on the failing write's error path)."""
        try:
            self._hit()
        except Exception as exc:
            log.error("the store's reserve could not be released: %s", exc)

    def _hit(self) -> None:
        if self.size == 0:
            return
        with self._lock:
            if self.full:
                return
            free = self.free()
            if free >= 2 * self.size:
                return  # (that write was just larger than what is free)
            # The reserve goes first: its space pays for what dropping derived data
            # writes (a new, empty set's few bytes); it is made again if that freed
            # enough at once (a mount frees a set's files once nobody holds them).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.have = False
            for shed in list(self.shedders):
                try:
                    shed()
                except Exception as exc:
                    log.error("dropping derived data on a full disk failed: %s", exc)
            if self._create():
                self.have = True
                return
            self._enter(self.free(), "a write found no space left")

    def _enter(self, free: int, why: str) -> None:
        self.full = True
        log.error(
            "disk full: %s on the store's filesystem (%s), %s free (the reserve's "
            "space included), kept for unpins, ref and repository deletes and sweeps; new "
            "objects answer ENOSPC until %s are free",
            why,
            self.root,
            _mib(free),
            _mib(2 * self.size),
        )

    def _spare(self) -> int:
        if self.spare is None:
            return 0
        try:
            return self.spare()
        except Exception:
            return 0

    def _create(self, spare: int = 0) -> bool:
        """Make the reserve if `2 * size` is free: what it takes, and as much spare, of
        which `spare` bytes may be inside the store's files."""
        if self.present():
            return True
        free = self.free()
        if free < self.size or free + spare < 2 * self.size:
            return False
        tmp = self.root / f"{RESERVE_NAME}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
            try:
                try:
                    os.posix_fallocate(fd, 0, self.size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    zeros = bytes(MIB)
                    for off in range(0, self.size, MIB):
                        os.pwrite(fd, zeros[: self.size - off], off)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if not is_no_space(exc):
                log.error("the store's reserve %s could not be made: %s", self.path, exc)
            return False
        return True
