"""Files being written: content staged outside the trio thread, stored with `store.put`.

Three pieces, shared by every directory that accepts new files (/objects/<algo>,
/pins, and git's loose-object writes):

`StagedWriter(ctx, algo, expect=None)` — the content of one new file.
    `await write(off, buf)`, `await read(off, size)`, `await truncate(size)`, `size`,
    `dirty` (written since the last commit). `await commit(after=None) -> PutResult`
    stores what was written: a worker thread runs `store.put` under `algo`, checked
    against `expect` when given (a mismatch raises Verification and stores nothing),
    then `after(result)` if given (publish a name in the same thread hop). The caller
    owns `result.pin` and releases it once the object's name is published. `close()`
    frees everything (idempotent).
    Up to MEM_MAX bytes stay in memory. Past that, one thread per writer takes the
    writes in order from a queue (the trio thread only queues them, waiting while more
    than QUEUE_MAX bytes are queued, so memory stays bounded whatever the file's size).
    While the writes only move forward (appends, holes, an extending truncate: cp, dd,
    rsync, tar), that thread streams them straight into `store.put`, whose own staging
    file under the store directory is the only copy: by the time the file is closed it
    is hashed and written, and `commit` only waits for the tail and the fsync. A write
    below the end, a read or a shrinking truncate ends the stream: the part streamed so
    far is finished as an object, copied into a spool file under STORE/spool/ (a fleet member's
    STORE/nodes/<node>/spool/)
    (unlinked at once; `clear_spool` at start removes what a crash may leave) and
    left unreferenced for the sweep (deleting it here could delete an identical object
    another writer has just stored and named); from then on the writes go to the spool
    file and `commit` puts from it. A file named by its digest (`expect`) is spooled,
    not streamed, so that nothing is stored unless the content matches the name.

`StagedFile(ctx, parent, name, algo, expect=None, mode=0o644)` — the node of a file
    being written. `parent` implements `publish(node, result)` (name the stored object
    and release `result.pin`, on every path), `closed(node)` (the last handle went) and
    optionally `publish_in_thread(node, result)` (see StagingParent). Its entry timeout
    is 0: its name may vanish or turn into another node at close, and the kernel must
    ask again. `chmod`/`chown`/`utime` on it are
    recorded (it is the writer's private file until it is stored); `truncate` applies.

`StagedHandle(node)` — an open file on a StagedFile: `flush` (every close) commits and
    publishes what was written since the last commit, so `close()` reports a refusal
    (EIO, EEXIST, ...); `release` (the last close) commits a file never written (an
    empty file: a shell closes its redirection's first descriptor before writing, so
    flush alone must not store emptiness) or what was written after the last flush,
    and tells the parent.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pyfuse3
import trio

from alkfs.errors import AlkfsError, StoreIO
from alkfs.keys import Algorithm, Key
from alkfs.store import PutResult

from .errors import errno_of, fail
from .nodes.base import File, Handle, Node, wants_write

if TYPE_CHECKING:
    from .context import Context

log = logging.getLogger("alkfsd")

SPOOL_DIR = "spool"
MEM_MAX = 1 << 20  # a file up to this size never touches the disk before its put
QUEUE_MAX = 8 << 20  # bytes queued for a writer's spool thread before writes wait
ZEROS = bytes(1 << 20)


def inflight_root(store: Any) -> Path | None:
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


def spool_dir(store: Any) -> str:
    """Where spool files live: the daemon's in-flight directory's spool/ (STORE/spool, or
    STORE/nodes/<node>/spool for a fleet member; a temporary directory for a memory store)."""
    root = inflight_root(store)
    return os.path.join(root, SPOOL_DIR) if root is not None else tempfile.gettempdir()


def clear_spool(store: Any) -> int:
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


# Markers queued between writes (a write is ("w", off, bytes), a truncate ("t", size)).
_EOF = object()  # the commit: the streaming put finishes with everything written
_SPILL = object()  # the writes go back: finish the put, copy it into a spool file, go on
_SYNC = object()  # (spooling) everything queued before it is in the spool file
_CLOSE = object()  # the writer is done: the thread ends (a streaming put stores nothing)


def _zeros(n: int) -> Iterator[bytes]:
    while n > 0:
        chunk = ZEROS[: min(n, len(ZEROS))]
        n -= len(chunk)
        yield chunk


class _Spooler:
    """The thread behind one writer's content past MEM_MAX, applying queued items in order.

    Streaming first: writes that only move forward go straight into `store.put` (no copy
    of our own on disk). `_EOF` ends that put: its result is the commit's. `_SPILL`
    (a write went back, a read, a shrinking truncate) ends it too, and the partial
    object is copied into a spool file under STORE/spool and released (the sweep takes
    it unless something names it). From then on the items are applied to the spool
    file, and a commit puts from it. After a commit, the next item first copies the
    committed object into the spool file (a descriptor still open may write on)."""

    def __init__(self, store: Any, algo: Algorithm, expect: Key | None, stream: bool) -> None:
        self.store = store
        self.algo = algo
        self.expect = expect
        self.stream = stream
        self.fd = -1
        self.cond = threading.Condition()
        self.items: collections.deque[Any] = collections.deque()
        self.queued = 0  # bytes of the writes in `items`
        self.submitted = 0
        self.applied = 0
        self.broken: BaseException | None = None  # every later step fails with this
        self.stream_done = False
        self.stream_result: PutResult | None = None
        self.source: Key | None = None  # what the spool file must start from (after a commit)
        self._directory = spool_dir(store)
        threading.Thread(target=self._run, name="alkfsd-spool", daemon=True).start()

    # -- the trio side (never blocks) -----------------------------------------------
    def submit(self, item: Any, nbytes: int = 0) -> None:
        with self.cond:
            self.items.append(item)
            self.queued += nbytes
            self.submitted += 1
            self.cond.notify_all()

    # -- waits (worker threads) ---------------------------------------------------------
    def wait_room(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.queued <= QUEUE_MAX // 2 or self.broken is not None)

    def wait_applied(self) -> None:
        with self.cond:
            upto = self.submitted
            self.cond.wait_for(lambda: self.applied >= upto or self.broken is not None)

    def wait_stream(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.stream_done)

    # -- the thread -------------------------------------------------------------------
    def _next(self) -> Any:
        with self.cond:
            self.cond.wait_for(lambda: bool(self.items))
            item = self.items.popleft()
            if type(item) is tuple and item[0] == "w":
                self.queued -= len(item[2])
            return item

    def _done_one(self) -> None:
        with self.cond:
            self.applied += 1
            self.cond.notify_all()

    def _break(self, exc: BaseException) -> None:
        with self.cond:
            if self.broken is None:
                self.broken = exc
            self.cond.notify_all()

    def _feed(self, end: list[Any]) -> Iterator[bytes]:
        """The streaming put's input: forward writes, holes and extensions as zeros."""
        pos = 0
        while True:
            item = self._next()
            if item is _EOF or item is _SPILL:
                end.append(item)
                return
            if item is _CLOSE:
                end.append(item)
                raise _Abandoned("the writer was closed")
            if type(item) is not tuple:
                self._done_one()
                continue
            if item[1] > pos:  # a hole before a write, or an extending truncate
                yield from _zeros(item[1] - pos)
                pos = item[1]
            if item[0] == "w":
                data = item[2]
                pos += len(data)
                yield data
            self._done_one()

    def _run(self) -> None:
        try:
            if self.stream:
                try:
                    self._run_stream()
                except _Abandoned:
                    return
            with self.cond:
                self.stream_done = True
                self.cond.notify_all()
            while True:
                item = self._next()
                if item is _CLOSE:
                    return
                if self.broken is None:
                    try:
                        self._spool_item(item)
                    except Exception as exc:
                        self._break(exc)
                self._done_one()
        finally:
            with self.cond:
                self.stream_done = True
                self.cond.notify_all()
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def _run_stream(self) -> None:
        end: list[Any] = []
        result: PutResult | None = None
        try:
            result = self.store.put(self._feed(end), algo=self.algo)
        except _Abandoned:
            raise
        except BaseException as exc:
            self._break(exc)  # (the put refused: every later step says so)
        if end and end[0] is _SPILL and result is not None:
            self._take_back(result)
        else:
            with self.cond:
                self.stream_result = result
                self.source = None if result is None else result.key
        if end:
            self._done_one()  # the _EOF or _SPILL

    def _take_back(self, partial: PutResult) -> None:
        """The writes went back: the streamed part becomes the spool file's start. The
        partial object is released, not deleted: the same bytes may have been stored and
        named by another writer meanwhile (a put of existing bytes dedups into them), and
        an unreferenced object is the sweep's to take, after its window."""
        try:
            self._open(partial.key)
        except Exception as exc:
            self._break(exc)
        finally:
            partial.pin.release()

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

    def _spool_item(self, item: Any) -> None:
        if self.fd < 0:
            with self.cond:
                source, self.source = self.source, None
            self._open(source)
        if type(item) is not tuple:
            return  # _SYNC: nothing more to do
        if item[0] == "w":
            _, off, data = item
            view = memoryview(data)
            while view:
                n = os.pwrite(self.fd, view, off)
                view = view[n:]
                off += n
        else:
            os.ftruncate(self.fd, item[1])

    # -- reads of the spool file (worker threads) ----------------------------------------
    def pread(self, size: int, off: int) -> bytes:
        self.wait_applied()
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
        raise StoreIO(f"the spool failed: {exc}")


class StagedWriter:
    """The content of one new file (see the module docstring)."""

    def __init__(self, ctx: Context, algo: Algorithm, expect: Key | None = None) -> None:
        self.ctx = ctx
        self.algo = algo
        self.expect = expect
        self.size = 0
        self.dirty = False  # written since the last commit
        self.mem: bytearray | None = bytearray()
        self.spool: _Spooler | None = None
        self.streaming = False
        self.closed = False

    # -- content ----------------------------------------------------------------------
    async def write(self, off: int, buf: bytes) -> int:
        if self.closed:
            fail(errno.EBADF, "the file was closed")
        n = len(buf)
        self.dirty = True
        end = off + n
        mem = self.mem
        if mem is not None:
            if end <= MEM_MAX:
                if off > len(mem):
                    mem.extend(bytes(off - len(mem)))
                mem[off:end] = buf
                self.size = max(self.size, end)
                return n
            self._spill()
        spool = self.spool
        assert spool is not None
        spool.check()
        if off < self.size and self.streaming:
            await self._take_back()
        spool.submit(("w", off, buf), n)
        self.size = max(self.size, end)
        if spool.queued > QUEUE_MAX:
            await self.ctx.run_sync(spool.wait_room)
            spool.check()
        return n

    async def truncate(self, size: int) -> None:
        if self.closed:
            fail(errno.EBADF, "the file was closed")
        self.dirty = True
        if self.mem is not None:
            if size <= MEM_MAX:
                if size < len(self.mem):
                    del self.mem[size:]
                self.size = size
                return
            self._spill()
        assert self.spool is not None
        self.spool.check()
        if size < self.size and self.streaming:
            await self._take_back()
        self.spool.submit(("t", size))
        self.size = size

    async def read(self, off: int, size: int) -> bytes:
        if self.mem is not None:
            data = bytes(self.mem[off : off + size])
            if off + len(data) < min(off + size, self.size):  # a hole past what was written
                data += bytes(min(off + size, self.size) - off - len(data))
            return data
        spool = self.spool
        assert spool is not None
        n = max(0, min(size, self.size - off))
        if n == 0:
            return b""
        if self.streaming:
            await self._take_back()
        spool.submit(_SYNC)
        data = await self.ctx.run_sync(spool.pread, n, off)
        return data + bytes(n - len(data))

    def _spill(self) -> None:
        """Past MEM_MAX: a thread takes over, streaming into a put."""
        assert self.mem is not None
        data = bytes(self.mem)
        if len(data) < self.size:  # an in-memory file extended by truncate
            data += bytes(self.size - len(data))
        self.mem = None
        # A file named by its digest is not streamed: a put that streams cannot be checked
        # against the name before it stores (a spool file can).
        self.streaming = self.expect is None
        self.spool = _Spooler(self.ctx.store, self.algo, self.expect, self.streaming)
        self.spool.submit(("w", 0, data), len(data))

    async def _take_back(self) -> None:
        """End the stream: what was written so far moves into a spool file."""
        assert self.spool is not None
        self.streaming = False
        self.spool.submit(_SPILL)
        await self.ctx.run_sync(self.spool.wait_applied)
        self.spool.check()

    # -- storing ------------------------------------------------------------------------
    async def commit(self, after: Callable[[PutResult], None] | None = None) -> PutResult:
        """Store the content now; the caller owns the returned pin. `after(result)` runs
        in the same worker thread right after the put (publish a name without a second
        thread hop); if it raises, the pin is released and the error propagates."""
        if self.closed:
            fail(errno.EBADF, "the file was closed")
        self.dirty = False
        put: Callable[[], PutResult]
        if self.mem is not None:
            data = bytes(self.mem)
            if len(data) < self.size:
                data += bytes(self.size - len(data))
            put = functools.partial(self.ctx.store.put, data, algo=self.algo, expect=self.expect)
        else:
            spool = self.spool
            assert spool is not None
            spool.check()
            if self.streaming:
                self.streaming = False
                spool.submit(_EOF)
                put = self._stream_result
            else:
                spool.submit(_SYNC)
                put = self._put_from_spool
        return await self.ctx.run_sync(self._put_then, put, after)

    @staticmethod
    def _put_then(
        put: Callable[[], PutResult], after: Callable[[PutResult], None] | None
    ) -> PutResult:
        result = put()
        if after is not None:
            try:
                after(result)
            except BaseException:
                result.pin.release()
                raise
        return result

    def _stream_result(self) -> PutResult:
        spool = self.spool
        assert spool is not None
        spool.wait_stream()
        spool.check()
        result, spool.stream_result = spool.stream_result, None
        if result is None:
            raise StoreIO("the streaming put gave no result")
        return result

    def _put_from_spool(self) -> PutResult:
        spool = self.spool
        assert spool is not None
        spool.wait_applied()
        spool.check()
        return self.ctx.store.put(
            spool.chunks(self.size), self.size, algo=self.algo, expect=self.expect
        )

    def close(self) -> None:
        """Free the memory or end the thread (a streaming put not committed stores nothing)."""
        if self.closed:
            return
        self.closed = True
        self.mem = None
        if self.spool is not None:
            self.spool.submit(_CLOSE)
            self.spool = None


def noop_setattr(node: Node, attr: Any, fields: Any) -> bool:
    """The rule for things that cannot change (objects, pins, the fixed directories): a
    chmod, chown or truncate to the value it already has succeeds and does nothing (so
    `cp -p`, `rsync -a` and `install` work); any other change is EPERM. Returns whether
    times were set (the caller freshens an object; a directory ignores them)."""
    a = node.attr()

    def asks(field: str) -> Any:
        return getattr(attr, field, None)  # (None: no value given, so not the same)

    if fields.update_size and asks("st_size") != a.st_size:
        fail(errno.EPERM, f"{node.describe()}: its size cannot change")
    mode = asks("st_mode")
    if fields.update_mode and (mode is None or stat.S_IMODE(mode) != stat.S_IMODE(a.st_mode)):
        fail(errno.EPERM, f"{node.describe()}: its mode is {stat.S_IMODE(a.st_mode):o}")
    if (fields.update_uid and asks("st_uid") != a.st_uid) or (
        fields.update_gid and asks("st_gid") != a.st_gid
    ):
        fail(errno.EPERM, f"{node.describe()}: its owner cannot change")
    return bool(fields.update_atime or fields.update_mtime)


class StagingParent(Protocol):
    """What a directory accepting new files gives its StagedFile nodes. It may also
    define `publish_in_thread(node, result)`: run in the put's worker thread right after
    the put (e.g. the durable pin's transaction); raising there fails the commit (the
    pin is released)."""

    async def publish(self, node: StagedFile, result: PutResult) -> None:
        """Name the stored object (or not); release `result.pin` on every path."""
        ...

    async def closed(self, node: StagedFile) -> None:
        """The last handle of `node` was released."""
        ...


_serials = iter(range(1, 1 << 62))


class StagedFile(File):
    """A new regular file being written (see the module docstring)."""

    entry_timeout = 0.0  # the name may vanish or name another node at close
    attr_timeout = 1.0  # the attributes change only through this node (the kernel knows)
    __slots__ = (
        "writer",
        "perm",
        "uid",
        "gid",
        "times_ns",
        "opens",
        "key",
        "error",
        "unlinked",
        "attempted",
        "lock",
        "extra",
    )

    def __init__(
        self,
        ctx: Context,
        parent: Node,
        name: bytes,
        algo: Algorithm,
        expect: Key | None = None,
        mode: int = 0o644,
    ) -> None:
        super().__init__(ctx, ("staged", next(_serials)), parent, name)
        self.writer = StagedWriter(ctx, algo, expect)
        self.perm = stat.S_IMODE(mode)
        self.uid = ctx.uid
        self.gid = ctx.gid
        self.times_ns = time.time_ns()
        self.opens = 0
        self.key: Key | None = None  # the stored object, once committed
        self.error: int | None = None  # the errno of the last failed commit
        self.unlinked = False  # removed while open: nothing is stored at close
        self.attempted = False  # a commit was tried (an empty file is stored at release)
        self.lock = trio.Lock()
        self.extra: Any = None  # the parent's own state (e.g. a pin it holds)

    # -- attributes -----------------------------------------------------------------
    def mode(self) -> int:
        return stat.S_IFREG | self.perm

    def size(self) -> int:
        return self.writer.size

    def mtime_ns(self) -> int:
        return self.times_ns

    def attr(self) -> pyfuse3.EntryAttributes:
        a = super().attr()
        a.st_uid = self.uid
        a.st_gid = self.gid
        return a

    async def setattr(self, attr: Any, fields: Any, handle: Handle | None, ctx: Any) -> Any:
        if fields.update_size and attr.st_size != self.writer.size:
            if self.writer.closed:
                fail(errno.EPERM, f"{self.path} is stored: it is immutable")
            await self.writer.truncate(attr.st_size)
        if fields.update_mode:
            self.perm = stat.S_IMODE(attr.st_mode)
        if fields.update_uid:
            self.uid = attr.st_uid
        if fields.update_gid:
            self.gid = attr.st_gid
        if fields.update_mtime:
            self.times_ns = attr.st_mtime_ns
        return self.attr()

    # -- opening ------------------------------------------------------------------------
    def new_handle(self) -> StagedHandle:
        """A handle for the open that created this node."""
        self.opens += 1
        return StagedHandle(self)

    async def open(self, flags: int, ctx: Any) -> Handle:
        if self.writer.closed:  # stored and closed (a temporary name kept until renamed)
            # (O_RDONLY|O_APPEND reads, as on any Linux file)
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC) or self.key is None:
                fail(errno.EPERM, f"{self.path} is stored: it is immutable")
            from .nodes.objects import ObjectFile  # (objects.py imports this module)

            st = self.ctx.store.stat(self.key)
            if st is None:
                fail(errno.ENOENT, f"{self.key} is gone")
            assert self.parent is not None
            return await ObjectFile(self.ctx, self.parent, st).open(flags, ctx)
        handle = self.new_handle()
        if flags & os.O_TRUNC and wants_write(flags):
            await self.writer.truncate(0)
        return handle

    # -- storing ---------------------------------------------------------------------------
    async def commit(self, *, empty: bool = False) -> None:
        """Store and publish what was written since the last commit (`empty`: also a
        file never written, at its release); a refusal is raised again at every later
        flush until something is written."""
        async with self.lock:
            if not self.writer.dirty and not (empty and not self.attempted):
                if self.error is not None:
                    fail(self.error, f"{self.path} was not stored")
                return
            if self.unlinked:
                self.writer.dirty = False
                return
            self.attempted = True
            try:
                after = getattr(self.parent, "publish_in_thread", None)
                result = await self.writer.commit(
                    None if after is None else functools.partial(after, self)
                )
            except Exception as exc:
                self.error = errno_of(exc) or errno.EIO
                raise
            try:
                await self.parent.publish(self, result)  # type: ignore[union-attr]
            except BaseException as exc:  # cancellation too: a pin must never leak
                result.pin.release()  # (publish releases it; a second release is a no-op)
                self.error = errno_of(exc) or errno.EIO
                raise
            self.error = None
            self.key = result.key

    async def last_close(self) -> None:
        try:
            if (self.writer.dirty or not self.attempted) and not self.unlinked:
                try:
                    await self.commit(empty=True)
                except Exception as exc:
                    log.warning("release %s: not stored (%s)", self.path, exc)
        finally:
            self.writer.close()
            await self.parent.closed(self)  # type: ignore[union-attr]


class StagedHandle(Handle):
    """An open file on a StagedFile (see the module docstring)."""

    def __init__(self, node: StagedFile) -> None:
        super().__init__(node)
        self.staged = node
        self.released = False

    async def read(self, off: int, size: int) -> bytes:
        return await self.staged.writer.read(off, size)

    async def write(self, off: int, buf: bytes) -> int:
        return await self.staged.writer.write(off, buf)

    async def flush(self) -> None:
        await self.staged.commit()

    async def release(self) -> None:
        if self.released:
            return
        self.released = True
        node = self.staged
        node.opens -= 1
        if node.opens <= 0:
            await node.last_close()
