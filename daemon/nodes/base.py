"""The node interface: one class per kind of file or directory in the mount.

How to add a part of the tree (e.g. daemon/nodes/pins.py)
-------------------------------------------------------------
1. Write a class deriving from `Dir`, `StaticDir`, `File` or `Symlink` (all `Node`s).
   A top-level node is constructed as `Cls(ctx, parent)` (`parent` is the root).
2. Register it with ONE line in `daemon/nodes/root.py`'s `TOP_LEVEL` registry:
   `b"pins": "alkfsd.nodes.pins:PinsDir",`.
Nothing in fs.py changes: fs.py finds the node by inode and calls the method
of the same name; every method below has the right default answer.

Identity and inodes
    `ident` is a hashable tuple naming what the node *is*, unique across the mount,
    e.g. `("object", raw_key)`, `("pin", b"release-1")`, `("dir", "/repos/foo/refs")`.
    The inode number is derived from it (`ino_seed()`, override for speed), so the
    same thing keeps its number for the mount's life. Construct child nodes freely
    in `lookup`/`readdir`; the framework counts the ones handed to the kernel and
    keeps the newest instance for an equal ident (permanent nodes stay as they are),
    so keep durable state in the store or the context, not in node instances.

Attributes (cheap, no I/O: readdirplus asks for thousands)
    `mode()`, `size()`, `mtime_ns()`, `nlink()`; `attr()` builds EntryAttributes
    from them with `entry_timeout` / `attr_timeout` (long for immutable things).
    `getattr(req)` may refresh before answering.

Directories (`Dir`)
    `lookup(name, req) -> Node`   ENOENT (raise `fail(errno.ENOENT)`) when absent.
    `readdir(dh, start, emit)`     call `emit(name, node, next_offset)` per entry, in a
                                   stable order, resuming after `start` (0 = beginning);
                                   return as soon as `emit` returns False. Offsets
                                   must be > 2 and unique; `dh.state` is a dict
                                   private to this open directory (cursor caches).
                                   `.` and `..` are not listed (the kernel adds them).
    write side: `create(name, mode, flags, req) -> (Node, Handle)`,
    `mkdir(name, mode, req) -> Node`, `symlink(name, target, req) -> Node`,
    `link(name, node, req) -> Node` (called on the NEW parent), `unlink(name, req)`,
    `rmdir(name, req)`, `rename(name, new_parent, new_name, flags, req)` (on the OLD
    parent), `mknod(...)`. Defaults: ENOENT for a name that is not there, else EPERM.

Files (`File`) and symlinks (`Symlink`)
    `open(flags, req) -> Handle`   default: read-only; a write open is EPERM.
    `Handle.read(off, size)`, `.write(off, buf) -> int`, `.flush()`, `.fsync(datasync)`,
    `.release()`; `Handle.keep_cache` / `.direct_io` go to the kernel with the open.
    `readlink(req) -> bytes` (symlinks; EINVAL otherwise).

Any node
    `setattr(attr, fields, handle, req) -> EntryAttributes` (default EPERM for any change),
    `getxattr(name, req) -> bytes` (ENODATA), `listxattr(req) -> list[bytes]` ([]),
    `setxattr(name, value, req)` (ENOTSUP), `removexattr(name, req)` (ENODATA).
    Never answer ENOSYS for xattrs: the kernel would disable them mount-wide.
    `req` is the request's pyfuse3.RequestContext (uid, gid, pid of the caller);
    `self.ctx` is the mount's Context.

Errors
    Raise `fail(errno.EXXX, "why")` (from alkfsd.errors) or let a library error
    (alkfs.errors) propagate: fs.py maps it to its errno and logs one line. Do slow
    work through `await self.ctx.run_sync(fn, *args)` (sqlite writes, big file I/O,
    hashing big buffers); cheap page-cached reads may run inline.

Who may do what on a shared mount (--allow-other, --owner) is decided in fs.py, from
three class attributes: `root_only` (the control file), `times_by_anyone` (objects:
anyone may freshen them) and `never_written` (names no one creates: a repository's
config, hooks and info).

Mutations in read-only mode are refused with EROFS by fs.py before they reach a
node (namespace changes, xattr changes, setattr, write opens) unless the node sets
`writable_when_read_only = True` (the control file does).

Deleted objects: a view that shows store objects under names registers a callable
in `ctx.deletion_views` mapping a deleted `Key` to `(parent_ino, name, ino)`
entries; the sweep asks the kernel to drop those entries (see context.py).
"""

from __future__ import annotations

import errno
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Protocol

import pyfuse3
from pyfuse3 import RequestContext

from ..errors import fail
from ..inodes import derive
from .handles import DirHandle, Handle, wants_write

if TYPE_CHECKING:
    from ..context import Context
    from ..staging.overlay import ScratchOverlay

Emit = Callable[[bytes, "Node", int], bool]
OBJECT_TIMEOUT = 3600.0  # entry and attribute timeout of immutable things
DIR_TIMEOUT = 3600.0
DYNAMIC_TIMEOUT = 1.0  # status, metrics: their size changes
FIRST_OFFSET = 3  # readdir offsets are never 0, 1 or 2 (NFS re-export reads those specially)
# st_blksize: cp and cat size their buffers from it (at least 128 KiB). 1 MiB, the mount's
# max_write, makes cp into the mount write 1 MiB at a time: 8x fewer WRITE requests and
# 8x fewer security.capability getxattrs (the kernel asks before every write syscall).
BLKSIZE = 1 << 20


class SetattrFields(Protocol):
    """Which attributes a setattr changes: what nodes read of pyfuse3's SetattrFields
    (its `setattr` hands one; `attr`, a pyfuse3.EntryAttributes, holds the new values)."""

    @property
    def update_atime(self) -> bool: ...

    @property
    def update_mtime(self) -> bool: ...

    @property
    def update_ctime(self) -> bool: ...

    @property
    def update_mode(self) -> bool: ...

    @property
    def update_uid(self) -> bool: ...

    @property
    def update_gid(self) -> bool: ...

    @property
    def update_size(self) -> bool: ...


class Node:
    """Base of every file and directory in the mount (see the module docstring)."""

    is_dir: ClassVar[bool] = False
    entry_timeout: float = OBJECT_TIMEOUT
    attr_timeout: float = OBJECT_TIMEOUT
    writable_when_read_only: ClassVar[bool] = False
    # On a shared mount (fs.py): only root (and the daemon's user) may change it, not
    # the --owner user; any user may set its times (an object's freshen); names that no
    # one may create in this directory, root included.
    root_only: ClassVar[bool] = False
    times_by_anyone: ClassVar[bool] = False
    never_written: ClassVar[frozenset[bytes]] = frozenset()
    caches_listing: ClassVar[bool] = False  # the kernel caches its listing (listings.py)

    __slots__ = ("ctx", "ident", "ino", "parent", "name")

    def __init__(self, ctx: Context, ident: tuple, parent: Node | None, name: bytes) -> None:
        self.ctx = ctx
        self.ident = ident
        self.parent = parent
        self.name = name
        self.ino = 0

    def ino_seed(self) -> int:
        return derive(self.ident)

    @property
    def path(self) -> str:
        """The node's path in the mount (for logs)."""
        parts = []
        node: Node | None = self
        while node is not None and node.parent is not None:
            parts.append(node.name.decode("utf-8", "backslashreplace"))
            node = node.parent
        return "/" + "/".join(reversed(parts))

    def describe(self) -> str:
        return self.path

    # -- attributes ---------------------------------------------------------------
    def mode(self) -> int:
        return stat.S_IFREG | 0o444

    def size(self) -> int:
        return 0

    def mtime_ns(self) -> int:
        return self.ctx.started_ns

    def nlink(self) -> int:
        return 1

    def scratch(self) -> ScratchOverlay | None:
        """The scratch names a directory keeps beside its own entries (git's temporary
        files, a push's quarantine: staging/overlay.py), or None (most nodes)."""
        return None

    def attr(self) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = self.ino
        a.generation = 0
        a.entry_timeout = self.entry_timeout
        a.attr_timeout = self.attr_timeout
        a.st_mode = self.mode() & self.ctx.mode_mask
        a.st_nlink = self.nlink()
        a.st_uid = self.ctx.uid
        a.st_gid = self.ctx.gid
        a.st_rdev = 0
        size = self.size()
        a.st_size = size
        a.st_blksize = BLKSIZE
        a.st_blocks = (size + 511) // 512
        t = self.mtime_ns()
        a.st_atime_ns = t
        a.st_mtime_ns = t
        a.st_ctime_ns = t
        return a

    async def getattr(self, req: RequestContext) -> pyfuse3.EntryAttributes:
        return self.attr()

    async def setattr(
        self,
        attr: pyfuse3.EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> pyfuse3.EntryAttributes:
        if changes_anything(fields):
            fail(errno.EPERM, "its attributes cannot be changed")
        return self.attr()

    # -- extended attributes --------------------------------------------------------
    async def getxattr(self, name: bytes, req: RequestContext) -> bytes:
        fail(errno.ENODATA)

    async def listxattr(self, req: RequestContext) -> list[bytes]:
        return []

    async def setxattr(self, name: bytes, value: bytes, req: RequestContext) -> None:
        fail(errno.ENOTSUP, f"no settable attribute {name!r}")

    async def removexattr(self, name: bytes, req: RequestContext) -> None:
        fail(errno.ENODATA)

    # -- files ------------------------------------------------------------------------
    async def open(self, flags: int, req: RequestContext) -> Handle:
        fail(errno.EISDIR if self.is_dir else errno.EPERM)

    async def readlink(self, req: RequestContext) -> bytes:
        fail(errno.EINVAL, "not a symbolic link")

    # -- directories --------------------------------------------------------------------
    def entries_in_c(self) -> list[tuple[bytes, Node]]:
        """Children whose LOOKUPs pyfuse3 may answer once this node is handed to the kernel
        (listings.py): fixed names, attributes that change only with their listing."""
        return []

    def listing_known_empty(self) -> bool:
        """A caching node (`caches_listing`) whose listing is known to be empty now,
        without a look (listings.py then lets pyfuse3 answer its READDIRs)."""
        return False

    async def opendir(self, req: RequestContext) -> DirHandle:
        fail(errno.ENOTDIR)

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        fail(errno.ENOTDIR)

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        fail(errno.ENOTDIR)

    async def create(
        self, name: bytes, mode: int, flags: int, req: RequestContext
    ) -> tuple[Node, Handle]:
        fail(errno.ENOTDIR)

    async def mkdir(self, name: bytes, mode: int, req: RequestContext) -> Node:
        fail(errno.ENOTDIR)

    async def mknod(self, name: bytes, mode: int, rdev: int, req: RequestContext) -> Node:
        fail(errno.ENOTDIR)

    async def symlink(self, name: bytes, target: bytes, req: RequestContext) -> Node:
        fail(errno.ENOTDIR)

    async def link(self, name: bytes, node: Node, req: RequestContext) -> Node:
        fail(errno.ENOTDIR)

    async def unlink(self, name: bytes, req: RequestContext) -> None:
        fail(errno.ENOTDIR)

    async def rmdir(self, name: bytes, req: RequestContext) -> None:
        fail(errno.ENOTDIR)

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, req: RequestContext
    ) -> None:
        fail(errno.ENOTDIR)


def changes_anything(fields: SetattrFields) -> bool:
    return any(
        getattr(fields, f, False)
        for f in (
            "update_atime",
            "update_mtime",
            "update_ctime",
            "update_mode",
            "update_uid",
            "update_gid",
            "update_size",
        )
    )


class File(Node):
    """A read-only regular file; subclasses override `open` (and `size`)."""

    __slots__ = ()

    async def open(self, flags: int, req: RequestContext) -> Handle:
        if wants_write(flags):
            fail(errno.EPERM, "read-only file")
        return Handle(self)


class Symlink(Node):
    __slots__ = ("target",)

    def __init__(
        self, ctx: Context, ident: tuple, parent: Node | None, name: bytes, target: bytes
    ) -> None:
        super().__init__(ctx, ident, parent, name)
        self.target = target

    def mode(self) -> int:
        return stat.S_IFLNK | 0o777

    def size(self) -> int:
        return len(self.target)

    async def readlink(self, req: RequestContext) -> bytes:
        return self.target

    async def open(self, flags: int, req: RequestContext) -> Handle:
        fail(errno.ELOOP)


class Dir(Node):
    """A directory. Defaults: empty, nothing can be created or removed in it."""

    is_dir = True
    entry_timeout = DIR_TIMEOUT
    attr_timeout = DIR_TIMEOUT
    __slots__ = ()

    def mode(self) -> int:
        return stat.S_IFDIR | 0o755

    def nlink(self) -> int:
        return 2

    async def opendir(self, req: RequestContext) -> DirHandle:
        return DirHandle(self)

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        fail(errno.ENOENT)

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        return None

    async def _existing(self, name: bytes, req: RequestContext) -> Node:
        return await self.lookup(name, req)  # ENOENT when absent

    async def create(
        self, name: bytes, mode: int, flags: int, req: RequestContext
    ) -> tuple[Node, Handle]:
        fail(errno.EPERM, "files cannot be created here")

    async def mkdir(self, name: bytes, mode: int, req: RequestContext) -> Node:
        fail(errno.EPERM, "directories cannot be created here")

    async def mknod(self, name: bytes, mode: int, rdev: int, req: RequestContext) -> Node:
        fail(errno.EPERM, "special files cannot be created here")

    async def symlink(self, name: bytes, target: bytes, req: RequestContext) -> Node:
        fail(errno.EPERM, "symbolic links cannot be created here")

    async def link(self, name: bytes, node: Node, req: RequestContext) -> Node:
        fail(errno.EPERM, "hard links cannot be created here")

    async def unlink(self, name: bytes, req: RequestContext) -> None:
        child = await self._existing(name, req)
        fail(errno.EISDIR if child.is_dir else errno.EPERM, f"{child.path} cannot be removed")

    async def rmdir(self, name: bytes, req: RequestContext) -> None:
        child = await self._existing(name, req)
        fail(errno.EPERM if child.is_dir else errno.ENOTDIR, f"{child.path} cannot be removed")

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, req: RequestContext
    ) -> None:
        child = await self._existing(name, req)
        fail(errno.EPERM, f"{child.path} cannot be renamed")


class StaticDir(Dir):
    """A directory with a fixed list of children, built once by `children()`."""

    __slots__ = ("_children", "_index")

    def __init__(self, ctx: Context, ident: tuple, parent: Node | None, name: bytes) -> None:
        super().__init__(ctx, ident, parent, name)
        self._children: list[tuple[bytes, Node]] | None = None
        self._index: dict[bytes, Node] = {}

    def children(self) -> list[tuple[bytes, Node]]:
        """(name, node) in listing order; called once."""
        return []

    def _entries(self) -> list[tuple[bytes, Node]]:
        if self._children is None:
            self._children = self.children()
            self._index = dict(self._children)
        return self._children

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        self._entries()
        node = self._index.get(name)
        if node is None:
            fail(errno.ENOENT)
        return node

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        entries = self._entries()
        first = 0 if start < FIRST_OFFSET else start - FIRST_OFFSET + 1
        for i in range(first, len(entries)):
            name, node = entries[i]
            if not emit(name, node, i + FIRST_OFFSET):
                return
