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
    Up to MEM_MAX bytes stay in memory. Past that, a Spooler (spool.py) takes the
    writes in order: streamed straight into `store.put` while they only move forward
    (by the time the file is closed it is hashed and written, and `commit` only waits
    for the tail and the fsync), into a spool file once they go back. A file named by
    its digest (`expect`) is spooled, not streamed, so that nothing is stored unless
    the content matches the name.

`StagedFile(ctx, parent, name, algo, expect=None, mode=0o644)` — the node of a file
    being written. `parent` is a StagingParent: `publish(node, result)` (name the stored
    object and release `result.pin`, on every path), `closed(node)` (the last handle
    went), `publish_in_thread(node, result)` and `stored_file(st)`. Its entry timeout
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

import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import pyfuse3
import trio
from pyfuse3 import RequestContext

from alkfs.errors import StoreIO
from alkfs.keys import Algorithm, Key
from alkfs.store import PutResult

from ..errors import errno_of, fail
from ..nodes.base import File, Handle, Node, wants_write
from .spool import QUEUE_MAX, EndStream, Spooler, Sync, TakeBack, Truncate, Write

if TYPE_CHECKING:
    from alkfs.store import ObjectStat

    from ..context import Context

log = logging.getLogger("alkfsd")

MEM_MAX = 1 << 20  # a file up to this size never touches the disk before its put


class StagedWriter:
    """The content of one new file (see the module docstring)."""

    def __init__(self, ctx: Context, algo: Algorithm, expect: Key | None = None) -> None:
        self.ctx = ctx
        self.algo = algo
        self.expect = expect
        self.size = 0
        self.dirty = False  # written since the last commit
        self.mem: bytearray | None = bytearray()
        self.spool: Spooler | None = None
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
            await self._spill()
        spool = self.spool
        assert spool is not None
        spool.check()
        if off < self.size and self.streaming:
            await self._take_back()
        spool.submit(Write(off, buf))
        self.size = max(self.size, end)
        if spool.queued > QUEUE_MAX:
            await spool.wait_room()
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
            await self._spill()
        assert self.spool is not None
        self.spool.check()
        if size < self.size and self.streaming:
            await self._take_back()
        self.spool.submit(Truncate(size))
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
        spool.submit(Sync())
        await spool.wait_applied()
        data = await self.ctx.run_sync(spool.pread, n, off)
        return data + bytes(n - len(data))

    async def _spill(self) -> None:
        """Past MEM_MAX: a spooler takes over, streaming into a put (its task starts under
        the mount's nursery; the state changes before the first await)."""
        assert self.mem is not None
        data = bytes(self.mem)
        if len(data) < self.size:  # an in-memory file extended by truncate
            data += bytes(self.size - len(data))
        self.mem = None
        # A file named by its digest is not streamed: a put that streams cannot be checked
        # against the name before it stores (a spool file can).
        self.streaming = self.expect is None
        self.spool = spool = Spooler(self.ctx.store, self.algo, self.expect, self.streaming)
        spool.submit(Write(0, data))
        await self.ctx.workers.start_soon(spool.run, name="alkfsd spool")

    async def _take_back(self) -> None:
        """End the stream: what was written so far moves into a spool file."""
        assert self.spool is not None
        self.streaming = False
        self.spool.submit(TakeBack())
        await self.spool.wait_applied()
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
            # (shielded as a thread hop is: the put this waits for runs on regardless, and
            # its pin is the caller's once it is taken)
            if self.streaming:
                self.streaming = False
                spool.submit(EndStream())
                with trio.CancelScope(shield=True):
                    await spool.wait_stream()
                spool.check()
                result, spool.stream_result = spool.stream_result, None
                if result is None:
                    raise StoreIO("the streaming put gave no result")
                put = functools.partial(_given, result)
            else:
                spool.submit(Sync())
                with trio.CancelScope(shield=True):
                    await spool.wait_applied()
                spool.check()
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

    def _put_from_spool(self) -> PutResult:
        spool = self.spool
        assert spool is not None
        spool.check()
        return self.ctx.store.put(
            spool.chunks(self.size), self.size, algo=self.algo, expect=self.expect
        )

    def close(self) -> None:
        """Free the memory or end the spooler (a streaming put not committed stores nothing)."""
        if self.closed:
            return
        self.closed = True
        self.mem = None
        if self.spool is not None:
            self.spool.close()
            self.spool = None


def _given(result: PutResult) -> PutResult:
    return result


class StagingParent(Protocol):
    """What a directory accepting new files gives its StagedFile nodes."""

    def publish_in_thread(self, node: StagedFile, result: PutResult) -> None:
        """Run in the put's worker thread right after the put (e.g. the durable pin's
        transaction); raising there fails the commit (the pin is released). A parent
        with nothing to do there does nothing."""
        ...

    async def publish(self, node: StagedFile, result: PutResult) -> None:
        """Name the stored object (or not); release `result.pin` on every path."""
        ...

    async def closed(self, node: StagedFile) -> None:
        """The last handle of `node` was released."""
        ...

    def stored_file(self, st: ObjectStat) -> File:
        """The read-only file of a stored object (a StagedFile opened again after its
        content was stored, under a temporary name kept until renamed)."""
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
        "host",
    )

    def __init__(
        self,
        ctx: Context,
        parent: StagingParent,
        name: bytes,
        algo: Algorithm,
        expect: Key | None = None,
        mode: int = 0o644,
    ) -> None:
        assert isinstance(parent, Node)
        super().__init__(ctx, ("staged", next(_serials)), parent, name)
        self.host = parent  # the directory it is written in, as a StagingParent
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

    async def setattr(
        self, attr: Any, fields: Any, handle: Handle | None, req: RequestContext
    ) -> Any:
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

    async def open(self, flags: int, req: RequestContext) -> Handle:
        if self.writer.closed:  # stored and closed (a temporary name kept until renamed)
            # (O_RDONLY|O_APPEND reads, as on any Linux file)
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC) or self.key is None:
                fail(errno.EPERM, f"{self.path} is stored: it is immutable")
            st = self.ctx.store.stat(self.key)
            if st is None:
                fail(errno.ENOENT, f"{self.key} is gone")
            return await self.host.stored_file(st).open(flags, req)
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
                result = await self.writer.commit(
                    functools.partial(self.host.publish_in_thread, self)
                )
            except Exception as exc:
                self.error = errno_of(exc) or errno.EIO
                raise
            try:
                await self.host.publish(self, result)
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
            await self.host.closed(self)


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
