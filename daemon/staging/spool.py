"""The spool: where a writer's content past MEM_MAX goes, off the trio thread.

Up to MEM_MAX bytes of a new file stay in memory (staged.py). Past that, each writer has
a `Spooler`: a trio task (started under the mount's nursery, workers.py) that takes the
writer's operations in order from a trio memory channel (the trio side only queues them,
waiting while more than QUEUE_MAX bytes are queued, so memory stays bounded whatever the
file's size) and does the blocking part in a thread of its own limiter (one at a time:
never a token of the requests' limiter, `ctx.run_sync`, so a writer waiting for its
bytes never holds one).

While the writes only move forward (appends, holes, an extending truncate: cp, dd, rsync,
tar), the thread streams them straight into `store.put`, whose own staging file under
the store directory is the only copy. Meanwhile `submit` hands the operations to that
thread through a thread-safe queue (`queue.SimpleQueue`: a put never blocks), so the
thread has each write as soon as the request that brought it is answered; it reports
what it took back to the trio side with `TrioToken.run_sync_soon` (one callback pending
at a time). (Fetching them with `trio.from_thread.run` instead delivered each batch
only when pyfuse3's worker next yielded to trio's scheduler, after a run of back-to-back
requests: the hashing thread idled ~0.25 s of a 1 GiB cp.) `EndStream` (the commit) ends
that put: its result is the commit's; operations queued behind it go to the channel's
side, in order. `TakeBack` (a write went back, a read, a shrinking truncate) ends it too: the
part streamed so far is finished as an object, copied into a spool file under
STORE/spool/ (a fleet member's STORE/nodes/<node>/spool/; unlinked at once,
`clear_spool` at start removes what a crash may leave) and released, left unreferenced
for the sweep (deleting it here could delete an identical object another writer has
just stored and named). From then on the operations are applied to the spool file, a
batch per thread hop, and a commit puts from it. After a commit, the next operation
first copies the committed object into the spool file (a descriptor still open may write
on). Closing the channel (the writer is done) ends the task; a streaming put not yet
committed then stores nothing.

Every wait of the writer (room in the queue, everything applied, the stream's result)
is a trio wait on the spooler's progress: no thread is held while waiting.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
import queue
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, TypeVar

import trio

from alkfs.errors import AlkfsError, NoSpace, StoreIO
from alkfs.keys import Algorithm, Key
from alkfs.reserve import is_no_space
from alkfs.store import PutResult

if TYPE_CHECKING:
    from alkfs.store import Store

log = logging.getLogger("alkfsd")

SPOOL_DIR = "spool"
QUEUE_MAX = 8 << 20  # bytes queued for a writer's spool task before writes wait
ZEROS = bytes(1 << 20)


@dataclass(frozen=True, slots=True)
class Write:
    off: int
    data: bytes


@dataclass(frozen=True, slots=True)
class Truncate:
    size: int


@dataclass(frozen=True, slots=True)
class EndStream:
    """The commit: the streaming put finishes with everything written before it."""


@dataclass(frozen=True, slots=True)
class TakeBack:
    """The writes go back: finish the streaming put, copy it into a spool file, go on."""


@dataclass(frozen=True, slots=True)
class Sync:
    """(spooling) Everything queued before it is in the spool file once it is applied."""


Op = Write | Truncate | EndStream | TakeBack | Sync

# The streaming put's outcome: its result, the operation that ended it, how many
# operations of the last batch it consumed before that, the error that stopped it.
Streamed = tuple[PutResult | None, Op | None, int, BaseException | None]


# What the stream's queue carries besides operations: the writer closed; the task cancelled.
class _Stop(enum.Enum):
    CLOSED = "closed"
    CANCELLED = "cancelled"


_CLOSED: Final = _Stop.CLOSED
_CANCELLED: Final = _Stop.CANCELLED
T = TypeVar("T")


def inflight_root(store: object) -> Path | None:
    """The daemon's own directory for in-flight files: `store.inflight` (a fleet member's
    STORE/nodes/<node>, made 0700 here; STORE itself for a sqlite store), None for a
    memory store. Another daemon of the fleet never uses (nor clears) it."""
    root = getattr(store, "inflight", None)
    if root is None:
        root = getattr(store, "path", None)
        return None if root is None else Path(root)
    root = Path(root)
    path = getattr(store, "path", None)
    if path is not None and root != Path(path):
        for d in (root.parent, root):  # STORE/nodes and STORE/nodes/<node>: the owner's
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, 0o700)
    return root


def spool_dir(store: object) -> str:
    """Where spool files live: the daemon's in-flight directory's spool/ (STORE/spool, or
    STORE/nodes/<node>/spool for a fleet member; a temporary directory for a memory store)."""
    root = inflight_root(store)
    return os.path.join(root, SPOOL_DIR) if root is not None else tempfile.gettempdir()


def clear_spool(store: object) -> int:
    """Remove spool files a crashed daemon left in this daemon's own spool directory (call
    at start: holding the store lock, or as a fleet member in a directory of its own)."""
    root = inflight_root(store)
    if root is None:
        return 0
    root = root / SPOOL_DIR
    n = 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(root):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(root / name)
                n += 1
    return n


def _open_spool(directory: str) -> int:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except (AttributeError, OSError):
        fd, path = tempfile.mkstemp(dir=directory, prefix="w-")
        os.unlink(path)
        return fd


class _Abandoned(AlkfsError):
    """The streaming put was given up (the writer was closed first): it stores nothing."""


def _drained(q: queue.SimpleQueue[T]) -> list[T]:
    """Everything `q` holds now, without waiting."""
    items: list[T] = []
    with contextlib.suppress(queue.Empty):
        while True:
            items.append(q.get_nowait())
    return items


def _zeros(n: int) -> Iterator[bytes]:
    while n > 0:
        chunk = ZEROS[: min(n, len(ZEROS))]
        n -= len(chunk)
        yield chunk


class Spooler:
    """One writer's content past MEM_MAX (see the module docstring). Its task is `run`
    (the writer starts it under the mount's nursery); the trio side calls `submit`, the
    waits and `close`; `pread` and `chunks` run in the caller's worker thread once
    `wait_applied` returned."""

    def __init__(self, store: Store, algo: Algorithm, expect: Key | None, stream: bool) -> None:
        self.store = store
        self.algo = algo
        self.expect = expect
        self.stream = stream
        self.fd = -1
        self._send, self._recv = trio.open_memory_channel[Op](math.inf)
        self.queued = 0  # bytes of the writes not yet taken by the task
        self.submitted = 0
        self.applied = 0
        self.broken: BaseException | None = None  # every later step fails with this
        self.stream_done = trio.Event()
        self.stream_result: PutResult | None = None
        self.source: Key | None = None  # what the spool file must start from (after a commit)
        self._progress = trio.Event()  # set (and replaced) whenever something moved
        self._limiter = trio.CapacityLimiter(1)  # this writer's thread, one hop at a time
        self._leftover: list[Op] = []  # taken by the stream after its end: for the spool
        self._directory = spool_dir(store)
        # While the stream runs, `submit` queues here for its thread (not the channel);
        # the thread's progress comes back through _report (one callback at a time).
        self._direct: queue.SimpleQueue[Op | _Stop] | None = queue.SimpleQueue() if stream else None
        self._token = trio.lowlevel.current_trio_token()
        self._report_lock = threading.Lock()
        self._report: list[int] | None = None  # [applied, taken] not yet told to trio

    # -- the trio side ----------------------------------------------------------------
    def submit(self, op: Op) -> None:
        """Queue one operation (never blocks)."""
        if self._direct is not None:
            self._direct.put(op)
        else:
            try:
                self._send.send_nowait(op)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                self._break(StoreIO("the spool is gone"))
                return
        if isinstance(op, Write):
            self.queued += len(op.data)
        self.submitted += 1

    def close(self) -> None:
        """The writer is done: the task applies what is queued, then ends."""
        if self._direct is not None:
            self._direct.put(_CLOSED)
        self._send.close()

    async def wait_room(self) -> None:
        while self.queued > QUEUE_MAX // 2 and self.broken is None:
            await self._progress.wait()

    async def wait_applied(self) -> None:
        upto = self.submitted
        while self.applied < upto and self.broken is None:
            await self._progress.wait()

    async def wait_stream(self) -> None:
        await self.stream_done.wait()

    def _moved(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    def _break(self, exc: BaseException) -> None:
        if self.broken is None:
            self.broken = exc
        self._moved()

    def _told(self) -> None:
        """(trio thread) Count what the stream's thread reported."""
        with self._report_lock:
            report, self._report = self._report, None
        if report is not None:
            self.applied += report[0]
            self.queued -= report[1]
            self._moved()

    def _tell(self, applied: int, taken: int) -> None:
        """(the stream's thread) Report progress; one callback pending at a time."""
        with self._report_lock:
            if self._report is not None:
                self._report[0] += applied
                self._report[1] += taken
                return
            self._report = [applied, taken]
        try:
            self._token.run_sync_soon(self._told)
        except trio.RunFinishedError:
            raise _Abandoned("the daemon is stopping") from None

    async def _take(self) -> list[Op]:
        """The next operations (at least one; [] when the channel is closed and empty):
        first those queued behind the stream's end (their bytes left `queued` as the
        stream gave them up), then the channel's."""
        if self._leftover:
            batch, self._leftover = self._leftover, []
            return batch
        try:
            batch = [await self._recv.receive()]
        except trio.EndOfChannel:
            return []
        while True:
            try:
                batch.append(self._recv.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        taken = sum(len(op.data) for op in batch if isinstance(op, Write))
        if taken:
            self.queued -= taken
            self._moved()
        return batch

    # -- the task -----------------------------------------------------------------------
    async def run(self) -> None:
        """The task: the stream first (when streaming), then the spool file, until the
        writer closes the channel."""
        ended = False
        try:
            if self.stream:
                await self._run_stream()
            self.stream_done.set()
            while batch := await self._take():
                if self.broken is None:
                    try:
                        await trio.to_thread.run_sync(self._apply, batch, limiter=self._limiter)
                    except Exception as exc:
                        if is_no_space(exc):  # (the store's reserve given back, once)
                            reserve = self.store.reserve
                            if reserve is not None:
                                await trio.to_thread.run_sync(reserve.hit, limiter=self._limiter)
                            # its bytes are of no use now: their space comes back before
                            # the writer hears of the refusal, not when this task ends
                            await trio.to_thread.run_sync(self._empty, limiter=self._limiter)
                        self._break(exc)
                self.applied += len(batch)
                self._moved()
            ended = True
        except _Abandoned:
            ended = True
        finally:
            if not ended:  # (cancelled: a writer still waiting hears it, never waits on)
                self._break(StoreIO("the spool's task was stopped"))
            self.stream_done.set()
            self._moved()
            self._recv.close()
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def _empty(self) -> None:
        """(the spooler's thread) Give the spool file's space back (it stays open)."""
        if self.fd >= 0:
            try:
                os.ftruncate(self.fd, 0)
            except OSError as exc:
                log.warning("spool: could not empty the spool file: %s", exc)

    async def _run_stream(self) -> None:
        direct = self._direct
        assert direct is not None
        out: Streamed | None = None
        abandoned = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._stop_stream_on_cancel, direct)
                try:
                    out = await trio.to_thread.run_sync(self._stream_put, limiter=self._limiter)
                except _Abandoned:  # (raised out of the nursery it would come in a group)
                    abandoned = True
                nursery.cancel_scope.cancel()
        except BaseException:
            # Cancelled as the thread returned: what the put stored is still the
            # commit's, and nothing is left queued where nobody reads.
            partial = self._stream_ended(direct, out)
            if partial is not None:
                partial.pin.release()  # (no spool file now: nobody will read it)
            raise
        partial = self._stream_ended(direct, out)
        if partial is not None:  # (the writes went back: the spool file starts from it)
            try:
                await trio.to_thread.run_sync(self._take_back, partial, limiter=self._limiter)
            except Exception as exc:
                self._break(exc)
        if abandoned:
            raise _Abandoned("the writer was closed")
        if out is not None:
            self.applied += out[2] + (out[1] is not None)
            self._moved()

    def _stream_ended(
        self, direct: queue.SimpleQueue[Op | _Stop], out: Streamed | None
    ) -> PutResult | None:
        """(trio thread, the stream's thread gone) What was queued behind the stream's end
        becomes the spool's, after what the thread took past it and before the channel's;
        the put's result becomes the commit's. Returns the partial object a TakeBack
        ended (the caller's, with its pin)."""
        self._direct = None
        self._told()
        for item in _drained(direct):
            if item is not _CLOSED and item is not _CANCELLED:
                self._leftover.append(item)
                if isinstance(item, Write):
                    self.queued -= len(item.data)
        if out is None:
            return None
        result, end, _, exc = out
        if exc is not None:
            self._break(exc)  # (the put refused: every later step says so)
        if isinstance(end, TakeBack) and result is not None:
            return result
        self.stream_result = result
        self.source = None if result is None else result.key
        return None

    @staticmethod
    async def _stop_stream_on_cancel(direct: queue.SimpleQueue[Op | _Stop]) -> None:
        """Wake the stream's thread when the task is cancelled (it waits on `direct`)."""
        try:
            await trio.sleep_forever()
        finally:
            direct.put(_CANCELLED)

    # -- the thread -------------------------------------------------------------------
    def _stream_put(self) -> Streamed:
        """(the spooler's thread) The streaming put: its result, the operation that ended
        it, how many operations of the last batch it consumed before that (the earlier
        ones are reported by `_tell`), the error that stopped it."""
        end: list[Op] = []
        unreported = [0]
        try:
            result = self.store.put(self._feed(end, unreported), algo=self.algo)
        except _Abandoned:
            raise
        except Exception as exc:
            return None, end[0] if end else None, unreported[0], exc
        return result, end[0] if end else None, unreported[0], None

    def _feed(self, end: list[Op], unreported: list[int]) -> Iterator[bytes]:
        """The streaming put's input: forward writes, holes and extensions as zeros."""
        direct = self._direct
        assert direct is not None
        pos = 0
        done = 0  # operations of the last batch the put has taken
        while True:
            items = [direct.get(), *_drained(direct)]
            batch: list[Op] = []
            stop = False
            for item in items:
                if item is _CLOSED or item is _CANCELLED:
                    stop = True  # (nothing is queued after either)
                    break
                batch.append(item)
            taken = sum(len(op.data) for op in batch if isinstance(op, Write))
            self._tell(done, taken)
            done = unreported[0] = 0
            if stop and not batch:
                raise _Abandoned("the writer was closed")
            for i, op in enumerate(batch):
                if isinstance(op, (EndStream, TakeBack)):
                    end.append(op)
                    self._leftover = batch[i + 1 :]
                    unreported[0] = done
                    return
                if isinstance(op, Write):
                    if op.off > pos:  # a hole before a write
                        yield from _zeros(op.off - pos)
                        pos = op.off
                    pos += len(op.data)
                    yield op.data
                elif isinstance(op, Truncate) and op.size > pos:  # an extending truncate
                    yield from _zeros(op.size - pos)
                    pos = op.size
                done = unreported[0] = i + 1
            if stop:
                raise _Abandoned("the writer was closed")

    def _take_back(self, partial: PutResult) -> None:
        """The writes went back: the streamed part becomes the spool file's start. The
        partial object is released, not deleted: the same bytes may have been stored and
        named by another writer meanwhile (a put of existing bytes dedups into them), and
        an unreferenced object is the sweep's to take, after its window."""
        try:
            self._open(partial.key)
        finally:
            partial.pin.release()

    def _apply(self, batch: list[Op]) -> None:
        for op in batch:
            if self.fd < 0:
                source, self.source = self.source, None
                self._open(source)
            if isinstance(op, Write):
                view = memoryview(op.data)
                off = op.off
                while view:
                    n = os.pwrite(self.fd, view, off)
                    view = view[n:]
                    off += n
            elif isinstance(op, Truncate):
                os.ftruncate(self.fd, op.size)

    def _open(self, source: Key | None) -> None:
        self.fd = _open_spool(self._directory)
        if source is None:
            return
        store = self.store
        with store.pin(source):  # (a committed object may be unreferenced: hold it)
            st = store.stat(source)
            if st is None:
                raise StoreIO(f"{source} was swept before the file was written again")
            path = store.large_path(source) if st.tier == "large" else None
            if path is None:
                data = store.get(source)  # verified: corrupt bytes are never carried over
                os.pwrite(self.fd, data or b"", 0)
                return
            store.verify_file(source, path)  # hashed once, then remembered
            src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                left, off = st.size, 0
                while left > 0:
                    n = os.copy_file_range(src, self.fd, left, off, off)
                    if n <= 0:
                        raise StoreIO(f"{source}: short copy into the spool file")
                    left -= n
                    off += n
            finally:
                os.close(src)

    # -- reads of the spool file (worker threads) ----------------------------------------
    def pread(self, size: int, off: int) -> bytes:
        """(after wait_applied)"""
        self.check()
        return os.pread(self.fd, size, off)

    def chunks(self, length: int) -> Iterator[bytes]:
        pos = 0
        while pos < length:
            chunk = os.pread(self.fd, min(1 << 20, length - pos), pos)
            if not chunk:
                raise StoreIO("the spool file is shorter than what was written")
            pos += len(chunk)
            yield chunk

    def check(self) -> None:
        exc = self.broken
        if exc is None:
            return
        if isinstance(exc, AlkfsError):
            raise exc
        if is_no_space(exc):
            raise NoSpace(f"no space left for the spool file: {exc}")
        raise StoreIO(f"the spool failed: {exc}")
