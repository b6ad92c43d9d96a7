"""Kernel entry invalidation off the request path.

Same mechanism as `pyfuse3.invalidate_entry_async` (a queue drained by one worker that
calls the blocking `pyfuse3.invalidate_entry`, which releases the GIL), plus a sequence
number so a caller can wait, with a bound, until what it queued has reached the kernel —
the control file's `sweep` uses that to return only once the deleted objects' entries are
gone. Never call the blocking form inside a request: the kernel may need a lock that
request holds.

The worker is a trio task (`run`, started with the mount's other background tasks,
workers.py) fed by a memory channel of `Invalidation`s; each blocking call runs in a
thread of its own limiter (one at a time, in order: never a token of the requests'
limiter). `submit` may be called from any thread (the store's deletion hook runs in the
sweeping thread): it hands the item to the trio thread with `run_sync_soon`, which never
blocks. Waiting (`wait`) is a trio wait: no thread is held.
"""

from __future__ import annotations

import errno
import logging
import math
import threading
from dataclasses import dataclass
from typing import Protocol

import pyfuse3
import trio

log = logging.getLogger("alkfsd")


@dataclass(frozen=True, slots=True)
class Invalidation:
    """One kernel entry to drop: `name` in the directory `parent`, which showed `deleted`
    (0: whatever it showed); or, `name` None, the attributes of the inode `parent` (a
    directory's cached listing is then checked against its mtime: daemon/listings.py).
    `seq` is its place in submission order."""

    parent: int
    name: bytes | None
    deleted: int
    seq: int


class KernelChannel(Protocol):
    """What a mount tells the kernel through: the `Invalidator` of a kernel session, or a
    fake for direct calls of the operations with no session (the tests'
    `RecordingInvalidator`), handed to the mount's services when they are made."""

    # A kernel session takes what is queued: the mount then caches listings
    # (listings.py), pushes an object's pages at its first open (nodes/objfile.py) and
    # acknowledges small files ahead of their commit (staging/pending.py).
    session: bool

    def submit(self, parent_ino: int, name: bytes | None, deleted_ino: int = 0) -> int: ...

    def submit_inode(self, ino: int) -> int: ...

    @property
    def submitted(self) -> int: ...

    async def wait(self, seq: int, timeout: float) -> bool: ...  # noqa: ASYNC109


class Invalidator:
    """Queue (parent inode, name, deleted inode) triples for the kernel."""

    session = True  # (KernelChannel)

    def __init__(self) -> None:
        self._lock = threading.Lock()  # submit runs in any thread
        self._submitted = 0
        self._done = 0  # (the trio thread's)
        self._send, self._recv = trio.open_memory_channel[Invalidation](math.inf)
        self._token: trio.lowlevel.TrioToken | None = None  # while `run` runs
        self._early: list[Invalidation] = []  # submitted before `run` started
        self._ended = False
        self._progress = trio.Event()

    def submit_inode(self, ino: int) -> int:
        """Queue the invalidation of an inode's attributes (a directory's cached listing is
        then checked against its mtime: daemon/listings.py); returns its sequence number."""
        return self.submit(ino, None)

    def submit(self, parent_ino: int, name: bytes | None, deleted_ino: int = 0) -> int:
        """Queue one invalidation (thread-safe, never blocks); returns its sequence number."""
        with self._lock:
            self._submitted += 1
            seq = self._submitted
            item = Invalidation(parent_ino, name, deleted_ino, seq)
            if self._ended:  # the mount is over: nothing to tell
                return seq
            if self._token is None:
                self._early.append(item)
                return seq
            try:  # (under the lock: items reach the channel in the order of seq)
                self._token.run_sync_soon(self._queue, item)
            except trio.RunFinishedError:
                self._ended = True
        return seq

    @property
    def submitted(self) -> int:
        with self._lock:
            return self._submitted

    async def wait(self, seq: int, timeout: float) -> bool:  # noqa: ASYNC109 (says if in time)
        """Until every request up to `seq` was handed to the kernel (or `timeout` passed):
        whether they were. A trio wait: it holds no worker thread."""
        with trio.move_on_after(timeout):
            while self._done < seq:
                await self._progress.wait()
        return self._done >= seq

    def _queue(self, item: Invalidation) -> None:
        """(the trio thread, from run_sync_soon: must not raise)"""
        try:
            self._send.send_nowait(item)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    async def run(self) -> None:
        """The worker: hand each queued request to the kernel, in order, until cancelled
        (the mount's end)."""
        limiter = trio.CapacityLimiter(1)
        with self._lock:
            self._token = trio.lowlevel.current_trio_token()
            early, self._early = self._early, []
        for item in early:  # before any run_sync_soon callback: the order of seq holds
            self._queue(item)
        try:
            async for item in self._recv:
                try:
                    await trio.to_thread.run_sync(_invalidate, item, limiter=limiter)
                finally:
                    self._done = max(self._done, item.seq)
                    self._progress.set()
                    self._progress = trio.Event()
        finally:
            with self._lock:
                self._ended = True
                self._token = None


def _invalidate(item: Invalidation) -> None:
    """(a worker thread) One blocking `pyfuse3.invalidate_entry` (or `invalidate_inode`,
    attributes only); what the kernel no longer knows is fine, anything else is logged."""
    try:
        if item.name is None:
            pyfuse3.invalidate_inode(item.parent, attr_only=True)
        else:
            pyfuse3.invalidate_entry(item.parent, item.name, item.deleted)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ENODEV):
            log.warning(
                "invalidate %s in inode %d: errno=%s",
                (item.name or b"").decode("utf-8", "backslashreplace"),
                item.parent,
                errno.errorcode.get(exc.errno or 0, exc.errno),
            )
    except Exception:
        log.exception(
            "invalidate %s in inode %d failed",
            (item.name or b"").decode("utf-8", "backslashreplace"),
            item.parent,
        )
