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
    recorded (it is the writer's private file until it is stored; /pins' PinFile checks
    a chown first and keeps the owner in the pin); `truncate` applies.

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
from typing import TYPE_CHECKING, Protocol, Self, TypeVar

import pyfuse3
import trio
from pyfuse3 import RequestContext

from alkfs.keys import Algorithm, Key
from alkfs.store import PutResult

from ..errors import errno_of, fail
from ..nodes.base import File, Node, SetattrFields
from ..nodes.handles import Handle, wants_write
from .writer import StagedWriter

if TYPE_CHECKING:
    from alkfs.store import ObjectStat

    from ..context import Context

log = logging.getLogger("alkfsd")


# the kind of StagedFile a parent makes (its methods are handed those: /pins' PinFile)
N_contra = TypeVar("N_contra", bound="StagedFile", contravariant=True)


class StagingParent(Protocol[N_contra]):
    """What a directory accepting new files gives its StagedFile nodes."""

    def store_ahead(self, node: N_contra, data: bytes) -> PutResult | None:
        """For content held in memory, on the trio thread (it never waits): hand `data`
        to the library's write-behind (alkfs/writebehind.py; a named one is pinned under
        its name, no pin held), or None to store it in a worker thread
        (`store_small`)."""
        ...

    def store_small(self, node: N_contra, data: bytes) -> PutResult | None:
        """For content held in memory, in a worker thread: store `data` and name it in
        one step (e.g. the object and its pin in one transaction; the returned pin is
        released already), or None to have it stored by `store.put` and then
        `publish_in_thread`."""
        ...

    def publish_in_thread(self, node: N_contra, result: PutResult) -> None:
        """Run right after the put, in its worker thread (e.g. the durable pin's
        transaction); raising there fails the commit (the pin is released). A parent
        with nothing to do there does nothing."""
        ...

    async def publish(self, node: N_contra, result: PutResult) -> None:
        """Name the stored object (or not); release `result.pin` on every path."""
        ...

    async def closed(self, node: N_contra) -> None:
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
        "committing",
        "idle",
        "host",
    )
    host: StagingParent[Self]  # the directory it is written in (set at __init__)

    def __init__(
        self,
        ctx: Context,
        parent: StagingParent[Self],
        name: bytes,
        algo: Algorithm,
        expect: Key | None = None,
        mode: int = 0o644,
    ) -> None:
        assert isinstance(parent, Node)
        super().__init__(ctx, ("staged", next(_serials)), parent, name)
        self.host: StagingParent[Self] = (
            parent  # the directory it is written in, as a StagingParent
        )
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
        self.committing = False  # a commit is under way (`commit`)
        self.idle: trio.Event | None = None  # set when it ends, for the closes waiting

    def ino_seed(self) -> int:
        # (a serial of this process, mixed, not blake2b of the identity: a new file's
        # number need not be the same in the next run; InodeTable skips one taken)
        return self.ident[1] * 0x9E3779B97F4A7C15

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
        self,
        attr: pyfuse3.EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> pyfuse3.EntryAttributes:
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
    def new_handle(self, flags: int) -> StagedHandle:
        """A handle for an open of this node (the one that created it, or a later one)."""
        self.opens += 1
        return StagedHandle(self, direct_io=(flags & os.O_ACCMODE) == os.O_WRONLY)

    async def open(self, flags: int, req: RequestContext) -> Handle:
        if self.writer.closed:  # stored and closed (a temporary name kept until renamed)
            # (O_RDONLY|O_APPEND reads, as on any Linux file)
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC) or self.key is None:
                fail(errno.EPERM, f"{self.path} is stored: it is immutable")
            st = self.ctx.store.stat(self.key)
            if st is None:
                fail(errno.ENOENT, f"{self.key} is gone")
            return await self.host.stored_file(st).open(flags, req)
        handle = self.new_handle(flags)
        if flags & os.O_TRUNC and wants_write(flags):
            await self.writer.truncate(0)
        return handle

    # -- storing ---------------------------------------------------------------------------
    async def commit(self, *, empty: bool = False) -> None:
        """Store and publish what was written since the last commit (`empty`: also a
        file never written, at its release); a refusal is raised again at every later
        flush until something is written."""
        while self.committing:  # (another close of this file is storing it)
            if self.idle is None:
                self.idle = trio.Event()
            await self.idle.wait()
        self.committing = True  # (a flag, not a trio.Lock: uncontended as nearly always)
        try:
            await self._commit(empty)
        finally:
            self.committing = False
            idle, self.idle = self.idle, None
            if idle is not None:
                idle.set()

    async def _commit(self: Self, empty: bool) -> None:
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
                functools.partial(self.host.publish_in_thread, self),
                functools.partial(self.host.store_small, self),
                functools.partial(self.host.store_ahead, self),
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

    async def last_close(self: Self) -> None:
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

    def __init__(self, node: StagedFile, *, direct_io: bool = False) -> None:
        super().__init__(node)
        # A write-only open (cp, dd, a shell's >) bypasses the page cache: before each
        # cached write the kernel asks for the file's security.capability xattr (to
        # strip it), one more round trip per write: one of a small file's eight. A
        # read-write open (rsync's mkstemp, a program that maps the file) keeps the
        # cache: a direct-I/O file cannot be mapped shared.
        self.direct_io = direct_io
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
