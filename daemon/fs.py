"""The pyfuse3 Operations: find the node by inode (or the handle by number) and call it.

Dispatch only. Every handler wears `fuse_op` (errors.py): library errors become
their errno in one place, anything unexpected is logged with its traceback and
answered with EIO, so no request can take the mount down.

Who may do what on a shared mount, and the per-user bounds, are access.py's (the
dispatch asks it before calling a node); the bounds every name and xattr value keep are
requests.py's.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pyfuse3
from pyfuse3 import RequestContext

from . import listings
from .access import OTHER, ROOT, Access
from .errors import RateLimit, fail, fuse_op
from .listings import CACHED_FH, Listings
from .nodes.base import Node, SetattrFields
from .nodes.handles import DirHandle, Handle, wants_write
from .nodes.root import Root
from .requests import (
    NAME_MAX,
    OTHER_FIELDS,
    XATTR_VALUE_MAX,
    check_name,
    file_info,
    of_child,
    of_dh,
    of_fh,
    of_ino,
    of_link,
    of_xattr,
)

if TYPE_CHECKING:
    from .context import Context

log = logging.getLogger("alkfsd")


RENAME_WHITEOUT = 4  # (linux/fs.h; os and pyfuse3 do not name it)


# pyfuse3.readdir_reply's shape: (token, name, attributes, next offset) -> the kernel took it
ReaddirReply = Callable[[pyfuse3.ReaddirToken, bytes, pyfuse3.EntryAttributes, int], bool]


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(self, ctx: Context, readdir_reply: ReaddirReply = pyfuse3.readdir_reply) -> None:
        """`readdir_reply`: how a listing's entries reach the kernel (pyfuse3's, or a
        direct-call test's collector)."""
        super().__init__()
        self.ctx = ctx
        self.inodes = ctx.inodes
        self.root = Root(ctx)
        self.inodes.remember(self.root, permanent=True)
        self.root.register_permanent()
        self.handles: dict[int, Handle] = {}
        self.dirs: dict[int, DirHandle] = {}
        self._next_fh = 1
        self.log_limit = RateLimit()  # refusal lines per (op, errno) and second (errors.py)
        self.readdir_reply = readdir_reply
        self.shared = ctx.options.shared
        self.guard = Access(ctx)  # who may do what, per-user bounds (access.py)
        self.pending = ctx.pending  # small files acknowledged ahead of their commit
        self.stats = ctx.stats  # requests, latencies and bytes (the metrics)

    # -- helpers ------------------------------------------------------------------
    def count_error(self, op: str, code: int) -> None:
        k = (op, code)
        self.ctx.errors[k] = self.ctx.errors.get(k, 0) + 1

    def node(self, ino: int) -> Node:
        node = self.inodes.get(ino)
        if node is None:
            fail(errno.ENOENT, f"inode {ino} is not known")
        return node

    def _fh_for(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def _mutating(self, node: Node | None = None) -> None:
        if self.ctx.read_only and not (node is not None and node.writable_when_read_only):
            fail(errno.EROFS, "the mount is read-only")

    def _creating(self, parent_inode: int, name: bytes, req: RequestContext) -> Node:
        """The directory a new `name` is made in, once every creation's checks passed."""
        check_name(name)
        self._mutating()
        parent = self.node(parent_inode)
        self.guard.may_change(req, parent)
        self.guard.refuse_never_written(parent, name)
        return parent

    def _entry(self, node: Node) -> pyfuse3.EntryAttributes:
        """Count `node` as handed to the kernel and return its attributes."""
        self.inodes.remember(node)
        return node.attr()

    # -- names ----------------------------------------------------------------------
    @fuse_op(of_child)
    async def lookup(
        self, parent_inode: int, name: bytes, req: RequestContext
    ) -> pyfuse3.EntryAttributes:
        check_name(name)
        parent = self.node(parent_inode)
        self.guard.may_read(req, parent, os.X_OK)
        if name == b".":
            child = parent
        elif name == b"..":
            child = parent.parent or parent
        else:
            epoch = self.listings.epoch()
            child = await parent.lookup(name, req)
            if child.caches_listing:
                self.listings.looked_up(self.inodes.ino_for(child), child, epoch)
        attr = self._entry(child)
        self.listings.enter(child.ino, child, self.inodes)  # (LOOKUPs of its fan-out in C)
        return attr

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        try:
            listings_ = self.listings
            for ino, n in inode_list:
                n -= listings_.taken(ino, n)  # (lookups answered in C: not counted here)
                if n:
                    self.inodes.forget(ino, n)
                if not self.inodes.lookups(ino):
                    listings_.leave(ino, self.inodes)
                    listings_.forgotten(ino)
        except Exception:
            log.exception("forget failed")

    @fuse_op(of_ino)
    async def getattr(self, inode: int, req: RequestContext) -> pyfuse3.EntryAttributes:
        self.guard.seen(req)  # (EACCES for a user a mount without --allow-other keeps out)
        return await self.node(inode).getattr(req)

    @fuse_op(of_ino)
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: SetattrFields,
        fh: int | None,
        req: RequestContext,
    ) -> pyfuse3.EntryAttributes:
        node = self.node(inode)
        self._mutating(node)
        if self.shared and not (
            node.times_by_anyone
            and self.guard.who(req) == OTHER
            and not any(getattr(fields, f, False) for f in OTHER_FIELDS)
        ):
            self.guard.may_change(req, node)  # (anyone may freshen an object: set its times)
        handle = self.handles.get(fh) if fh is not None else None
        return await node.setattr(attr, fields, handle, req)

    @fuse_op(of_ino)
    async def readlink(self, inode: int, req: RequestContext) -> bytes:
        self.guard.seen(req)
        return await self.node(inode).readlink(req)

    @fuse_op(of_child)
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, req: RequestContext
    ) -> pyfuse3.EntryAttributes:
        parent = self._creating(parent_inode, name, req)
        return self._entry(await parent.mknod(name, mode, rdev, req))

    @fuse_op(of_child)
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, req: RequestContext
    ) -> pyfuse3.EntryAttributes:
        parent = self._creating(parent_inode, name, req)
        return self._entry(await parent.mkdir(name, mode, req))

    @fuse_op(of_child)
    async def unlink(self, parent_inode: int, name: bytes, req: RequestContext) -> None:
        self._mutating()
        parent = self.node(parent_inode)
        self.guard.may_change(req, parent)
        await parent.unlink(name, req)

    @fuse_op(of_child)
    async def rmdir(self, parent_inode: int, name: bytes, req: RequestContext) -> None:
        self._mutating()
        parent = self.node(parent_inode)
        self.guard.may_change(req, parent)
        await parent.rmdir(name, req)

    @fuse_op(of_child)
    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, req: RequestContext
    ) -> pyfuse3.EntryAttributes:
        parent = self._creating(parent_inode, name, req)
        return self._entry(await parent.symlink(name, target, req))

    @fuse_op(of_child)
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        req: RequestContext,
    ) -> None:
        check_name(name_old)
        check_name(name_new)
        if flags & RENAME_WHITEOUT:
            fail(errno.EINVAL, "rename: no whiteouts here (RENAME_WHITEOUT)")
        self._mutating()
        old = self.node(parent_inode_old)
        new = self.node(parent_inode_new)
        self.guard.may_change(req, old, new)
        self.guard.refuse_never_written(new, name_new)
        await old.rename(name_old, new, name_new, flags, req)

    @fuse_op(of_link)
    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, req: RequestContext
    ) -> pyfuse3.EntryAttributes:
        check_name(new_name)
        self._mutating()
        target = self.node(inode)
        parent = self.node(new_parent_inode)
        self.guard.may_change(req, parent, target)
        self.guard.refuse_never_written(parent, new_name)
        return self._entry(await parent.link(new_name, target, req))

    # -- files ------------------------------------------------------------------------
    @fuse_op(of_ino)
    async def open(self, inode: int, flags: int, req: RequestContext) -> pyfuse3.FileInfo:
        node = self.node(inode)
        uid = reader = None
        if wants_write(flags):
            self._mutating(node)
            self.guard.may_change(req, node)
            uid = self.guard.bounded_uid(req)
        else:
            reader = self.guard.bounded_reader(req)
        if (flags & os.O_ACCMODE) != os.O_WRONLY:
            self.guard.may_read(req, node)
        handle = await node.open(flags, req)
        fh = self._fh_for()
        self.handles[fh] = handle
        self.guard.count_open(fh, uid)
        self.guard.count_read(fh, reader)
        return file_info(fh, handle)

    @fuse_op(of_child)
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, req: RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        parent = self._creating(parent_inode, name, req)
        uid = self.guard.bounded_uid(req)
        child, handle = await parent.create(name, mode, flags, req)
        attr = self._entry(child)
        fh = self._fh_for()
        self.handles[fh] = handle
        self.guard.count_open(fh, uid)
        return file_info(fh, handle), attr

    def _handle(self, fh: int) -> Handle:
        h = self.handles.get(fh)
        if h is None:
            fail(errno.EBADF, f"no open file {fh}")
        return h

    @fuse_op(of_fh)
    async def read(  # type: ignore[override]  # (pyfuse3 takes any buffer)
        self, fh: int, off: int, size: int
    ) -> bytes | bytearray | memoryview:
        data = await self._handle(fh).read(off, size)
        self.stats.read_bytes += len(data)
        return data

    @fuse_op(of_fh)
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self._handle(fh)
        if self.guard.bound:
            self.guard.count_bytes(fh, off, len(buf))
        n = await handle.write(off, buf)
        self.stats.written_bytes += n
        return n

    # flush (every close) and release (the last) come with every open: a handle that
    # does nothing there is answered without the wrapper's coroutine (git opens and
    # closes one file per object).
    async def flush(self, fh: int) -> None:
        h = self.handles.get(fh)
        if h is None or h.flushes:
            await self._flush(fh)

    @fuse_op(of_fh)
    async def _flush(self, fh: int) -> None:
        await self._handle(fh).flush()

    @fuse_op(of_fh)
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self._handle(fh).fsync(datasync)

    async def release(self, fh: int) -> None:
        if self.guard.bound:
            self.guard.uncount(fh)
        if self.guard.reading:
            self.guard.uncount_read(fh)
        h = self.handles.get(fh)
        if h is not None and type(h).release is Handle.release:
            del self.handles[fh]
            return
        await self._release(fh)

    @fuse_op(of_fh)
    async def _release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is not None:
            await h.release()

    # -- directories --------------------------------------------------------------------
    # A node with `caches_listing` has its listing cached by the kernel, checked at every
    # open against the listing now (daemon/listings.py): READDIRs of such an open are
    # served from the snapshot its OPENDIR took, and come only when the cache was dropped.
    @functools.cached_property
    def listings(self) -> Listings:
        return listings.of(self.ctx)

    @fuse_op(of_ino)
    async def opendir(  # type: ignore[override, unused-ignore]  # (a stock pyfuse3 says int only; the patched build, FileInfo too)
        self, inode: int, req: RequestContext
    ) -> int | pyfuse3.FileInfo:
        node = self.node(inode)
        self.guard.may_read(req, node)
        dh = await node.opendir(req)
        fh = self._fh_for()
        self.dirs[fh] = dh
        try:
            return await self.listings.open(inode, fh, node, dh)
        except BaseException:
            self.dirs.pop(fh, None)
            raise

    @fuse_op(of_dh)
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        dh = self.dirs.get(fh)
        if dh is None and not fh & CACHED_FH:
            fail(errno.EBADF, f"no open directory {fh}")
        reply = self.readdir_reply
        inodes = self.inodes

        ino_for, count = inodes.ino_for, inodes.count

        def emit(name: bytes, node: Node, next_id: int) -> bool:
            ino_for(node)
            if not reply(token, name, node.attr(), next_id):
                return False
            count(node)
            return True

        if dh is None:  # opened in C (listings.py)
            await self.listings.cached_readdir(
                fh & ~CACHED_FH, self.node(fh & ~CACHED_FH), start_id, emit
            )
        elif not self.listings.replay(fh, start_id, emit):
            await dh.node.readdir(dh, start_id, emit)

    # (every listing ends in one: a handle with nothing to release skips the wrapper)
    async def releasedir(self, fh: int) -> None:
        self.listings.release(fh)
        dh = self.dirs.pop(fh, None)
        if dh is not None and type(dh).release is not DirHandle.release:
            await self._releasedir(fh, dh)

    @fuse_op(of_dh)
    async def _releasedir(self, fh: int, dh: DirHandle) -> None:
        await dh.release()

    @fuse_op(of_dh)
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None

    # -- extended attributes ------------------------------------------------------------
    async def getxattr(self, inode: int, name: bytes, req: RequestContext) -> bytes:
        # Only the user.* namespace exists here. Answering EOPNOTSUPP (not ENODATA) for
        # security.selinux and system.posix_acl_* lets `ls -l` remember that this file
        # system has no SELinux labels or ACLs after the first entry, instead of asking
        # twice for every entry (two requests each). Never ENOSYS: the kernel would
        # switch extended attributes off for the whole mount.
        if not name.startswith(b"user."):
            self.count_error("getxattr", errno.EOPNOTSUPP)  # (counted, never logged)
            raise pyfuse3.FUSEError(errno.EOPNOTSUPP)
        if self.shared:
            self.guard.seen(req)
        return await self._getxattr(inode, name, req)

    @fuse_op(of_xattr)
    async def _getxattr(self, inode: int, name: bytes, req: RequestContext) -> bytes:
        return await self.node(inode).getxattr(name, req)

    @fuse_op(of_ino)
    async def listxattr(self, inode: int, req: RequestContext) -> list[bytes]:
        self.guard.seen(req)
        return await self.node(inode).listxattr(req)

    @fuse_op(of_xattr)
    async def setxattr(self, inode: int, name: bytes, value: bytes, req: RequestContext) -> None:
        if not name.startswith(b"user."):
            fail(errno.EOPNOTSUPP, "only user.* extended attributes exist here")
        if len(value) > XATTR_VALUE_MAX:
            fail(errno.E2BIG, f"a value of {len(value)} bytes (at most {XATTR_VALUE_MAX})")
        node = self.node(inode)
        self._mutating(node)
        self.guard.may_change(req, node)  # (a pin is a change: root's and the owner's)
        await node.setxattr(name, value, req)

    @fuse_op(of_xattr)
    async def removexattr(self, inode: int, name: bytes, req: RequestContext) -> None:
        if not name.startswith(b"user."):
            fail(errno.EOPNOTSUPP, "only user.* extended attributes exist here")
        node = self.node(inode)
        self._mutating(node)
        self.guard.may_change(req, node)
        await node.removexattr(name, req)

    # -- the file system ----------------------------------------------------------------
    @fuse_op()
    async def access(self, inode: int, mode: int, req: RequestContext) -> bool:
        if not self.shared:
            return True
        who = self.guard.who(req)
        if who == ROOT:
            return True
        node = self.node(inode)
        if mode & os.W_OK and (who == OTHER or node.root_only):
            return False
        return self.guard.may_access(req, node, mode & (os.R_OK | os.X_OK))

    @fuse_op()
    async def statfs(self, req: RequestContext) -> pyfuse3.StatvfsData:
        out = pyfuse3.StatvfsData()
        path = self.ctx.store.path
        if path is not None:
            st = os.statvfs(path)
            for f in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail"):
                setattr(out, f, getattr(st, f))
            out.f_files = st.f_files
            out.f_ffree = st.f_ffree
            out.f_favail = st.f_favail
        out.f_namemax = NAME_MAX
        return out
