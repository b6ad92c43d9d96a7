"""Scratch files for git's writes through the mount, and the pins that keep a push alive.

git writes an object as a temporary file (`objects/tmp_obj_XXXXXX` or
`objects/xx/tmp_obj_XXXXXX`), then `link`s (or `rename`s) it to `xx/<hex>`, then
unlinks the temporary name. A push writes into a quarantine directory of its own
(`objects/tmp_objdir-incoming-XXXXXX/` with `pack/`, `info/` and `xx/` inside), runs
its connectivity check with the quarantine as its object directory, then moves every
file to `objects/xx/<hex>` and removes the quarantine.

What is not yet a stored object lives in this package (the state: `ctx.writes`, a
`Writes`, writes.py; the names beside a store-backed directory's own: overlay.py; the
storing: ingest.py; here the nodes and `move`):

- `ScratchArea` (writes.py): a per-mount directory on disk (STORE/scratch, or a fleet member's own
  STORE/nodes/<node>/scratch; emptied when the daemon starts; a temporary directory for
  a mem store). Every scratch file's bytes are one file there, under a serial number;
  the names git sees live in memory.
- `ScratchFile` / `ScratchDir`: the nodes git creates, writes, links, renames and
  removes. Names are kept per directory in memory (a ScratchOverlay for scratch names
  inside store-backed directories such as /git/sha1/ or /repos/<id>/objects/xx/), so a
  scratch directory is private to the repository it was made in and vanishes with its
  content when git (or the daemon, once its creator has exited) removes it.
- `ingest` (ingest.py): a scratch file linked or renamed to `xx/<hex>` is inflated, checked to be
  one canonical git object and stored under the expected key (`store.put(expect=)`);
  a mismatch stores nothing and fails the link with EIO.
- `Writes.sessions` (writes.py): objects stored through /repos/<id>/objects (migration included)
  stay pinned, in one in-process Batch per (repository, writing process), until a ref
  write of that process in that repository commits (git's receive-pack migrates the
  quarantine and writes the refs itself), or until any ref write in that repository
  commits once the writing process has exited, or until the grace period
  (max(10 min, the sweep window), or alkfsd's `--push-grace`) has passed since the
  writing process exited (a live writer keeps its pins however long it takes). Objects written
  through /git/<format>/ (by alternates users, whose refs live outside the mount) are not
  pinned: the window protects them, as it protects every object written before the ref
  that names it.
- Freshens (`touch`/`utime` of a loose file) made by a process that belongs to a push
  (the quarantine's creator or one of its children, e.g. unpack-objects finding an
  object already stored) pin that object in the push's session, so an object a push
  relies on without re-sending it cannot be swept before the push's ref commits.

fsync of a scratch file succeeds without touching the disk: the object becomes durable
when it is stored (the store fsyncs large objects and commits small ones), and a
scratch file never outlives the daemon.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from pyfuse3 import EntryAttributes, RequestContext

from alkfs.reserve import is_no_space

from ..errors import fail
from ..nodes.base import FIRST_OFFSET, Dir, Emit, File, Node, SetattrFields
from ..nodes.handles import DirHandle, Handle
from .writes import RepoKey, Writes

if TYPE_CHECKING:
    from ..context import Context

SCRATCH_TIMEOUT = 60.0  # entry/attribute timeout of scratch files and directories


def new_file(w: Writes, host: Node, name: bytes, mode: int) -> ScratchFile:
    """A new scratch file named `name` in `host` (its bytes: a new file of the area)."""
    serial, path = w.area.new_file()
    return ScratchFile(host.ctx, host, name, serial, path, mode & 0o7777)


# -- nodes --------------------------------------------------------------------------------------
class ScratchFile(File):
    """A temporary file git made: bytes on disk in the scratch area, names in memory.
    Every change to it goes through the kernel, which keeps its entry and attributes
    current itself: they are cached long (git stats each file of a quarantine)."""

    entry_timeout = SCRATCH_TIMEOUT
    attr_timeout = SCRATCH_TIMEOUT
    __slots__ = ("serial", "disk", "perm", "names", "mtime")

    def __init__(
        self, ctx: Context, parent: Node, name: bytes, serial: int, disk: Path, perm: int
    ) -> None:
        super().__init__(ctx, ("scratch", serial), parent, name)
        self.serial = serial
        self.disk = disk
        self.perm = perm
        self.names = 1
        self.mtime = time.time_ns()

    def mode(self) -> int:
        return stat.S_IFREG | self.perm

    def size(self) -> int:
        try:
            return os.stat(self.disk).st_size
        except FileNotFoundError:
            return 0

    def nlink(self) -> int:
        return self.names

    def mtime_ns(self) -> int:
        return self.mtime

    def read_all(self) -> bytes:
        with open(self.disk, "rb") as f:
            return f.read()

    def drop_name(self) -> None:
        """One name less; the bytes go with the last one (open handles keep reading)."""
        self.names -= 1
        if self.names <= 0:
            try:
                os.unlink(self.disk)
            except FileNotFoundError:
                pass

    async def open(self, flags: int, req: RequestContext) -> Handle:
        fd = os.open(self.disk, os.O_RDWR | os.O_CLOEXEC)
        if flags & os.O_TRUNC:
            os.ftruncate(fd, 0)
        return ScratchHandle(self, fd)

    async def setattr(
        self,
        attr: EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> EntryAttributes:
        if fields.update_size:
            os.truncate(self.disk, attr.st_size)
        if fields.update_mode:
            self.perm = attr.st_mode & 0o7777
        if fields.update_mtime:
            self.mtime = attr.st_mtime_ns or time.time_ns()
        return self.attr()


class ScratchHandle(Handle):
    """An open scratch file: reads and writes go to its bytes on disk."""

    direct_io = False

    def __init__(self, node: ScratchFile, fd: int) -> None:
        super().__init__(node)
        self.fd = fd

    async def read(self, off: int, size: int) -> bytes:
        return os.pread(self.fd, size, off)

    async def write(self, off: int, buf: bytes) -> int:
        try:
            return os.pwrite(self.fd, buf, off)
        except OSError as exc:
            if is_no_space(exc):  # ENOSPC as it is, and the store's reserve given back
                reserve = self.node.ctx.store.reserve
                if reserve is not None:
                    await self.node.ctx.run_sync(reserve.hit)
            raise

    async def fsync(self, datasync: bool) -> None:
        return None  # see the module docstring: durability comes with the store

    async def release(self) -> None:
        os.close(self.fd)


class ScratchDir(Dir):
    """A directory git made for itself under a repository's objects/ (a push's quarantine
    and its `xx/`, `pack/`, `info/`): private to that repository, in memory."""

    entry_timeout = SCRATCH_TIMEOUT
    attr_timeout = SCRATCH_TIMEOUT
    __slots__ = ("serial", "entries", "repo", "creator", "host", "perm")

    def __init__(
        self,
        ctx: Context,
        parent: Node,
        name: bytes,
        serial: int,
        repo: RepoKey | None,
        creator: int,
        host: Node | None,
        perm: int = 0o755,
    ) -> None:
        super().__init__(ctx, ("scratchdir", serial), parent, name)
        self.serial = serial
        self.entries: dict[bytes, Node] = {}
        self.repo = repo
        self.creator = creator
        self.host = host  # the store-backed directory whose overlay names it (top level)
        self.perm = perm

    def mode(self) -> int:
        return stat.S_IFDIR | self.perm

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        node = self.entries.get(name)
        if node is None:
            fail(errno.ENOENT)
        return node

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        if start < FIRST_OFFSET or "entries" not in dh.state:
            dh.state["entries"] = sorted(self.entries.items())
        listed = cast(list[tuple[bytes, Node]], dh.state["entries"])
        first = 0 if start < FIRST_OFFSET else start - FIRST_OFFSET + 1
        for i in range(first, len(listed)):
            name, node = listed[i]
            if not emit(name, node, i + FIRST_OFFSET):
                return

    async def create(
        self, name: bytes, mode: int, flags: int, req: RequestContext
    ) -> tuple[Node, Handle]:
        if name in self.entries:
            fail(errno.EEXIST)
        node = new_file(self.ctx.writes, self, name, mode)
        self.entries[name] = node
        return node, await node.open(flags & ~os.O_TRUNC, req)

    async def mkdir(self, name: bytes, mode: int, req: RequestContext) -> Node:
        if name in self.entries:
            fail(errno.EEXIST)
        w = self.ctx.writes
        node = ScratchDir(
            self.ctx, self, name, w.area.next_serial(), self.repo, self.creator, None, mode & 0o777
        )
        self.entries[name] = node
        return node

    async def link(self, name: bytes, node: Node, req: RequestContext) -> Node:
        if name in self.entries:
            fail(errno.EEXIST)
        if not isinstance(node, ScratchFile):
            fail(errno.EXDEV, "only scratch files can be linked into a scratch directory")
        node.names += 1
        self.entries[name] = node
        return node

    async def unlink(self, name: bytes, req: RequestContext) -> None:
        node = self.entries.get(name)
        if node is None:
            fail(errno.ENOENT)
        if node.is_dir:
            fail(errno.EISDIR)
        del self.entries[name]
        assert isinstance(node, ScratchFile)
        node.drop_name()

    async def rmdir(self, name: bytes, req: RequestContext) -> None:
        node = self.entries.get(name)
        if node is None:
            fail(errno.ENOENT)
        if not isinstance(node, ScratchDir):
            fail(errno.ENOTDIR)
        if node.entries:
            fail(errno.ENOTEMPTY)
        del self.entries[name]

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, req: RequestContext
    ) -> None:
        node = self.entries.get(name)
        if node is None:
            fail(errno.ENOENT)
        await move(self.entries, name, node, new_parent, new_name, flags, req)

    def destroy(self) -> None:
        """Drop every name below (the bytes of files nobody else names go too)."""
        for node in self.entries.values():
            if isinstance(node, ScratchDir):
                node.destroy()
            elif isinstance(node, ScratchFile):
                node.drop_name()
        self.entries.clear()

    def drop_from_host(self) -> None:
        if self.host is not None:
            names = self.ctx.writes.overlays.get(self.host.ident)
            if names is not None and names.get(self.name) is self:
                del names[self.name]
        self.destroy()


class Destination(Protocol):
    """What a directory holding scratch names (a ScratchOverlay's host) does when a scratch
    entry is moved in or linked there (`move`, `ScratchOverlay.link`)."""

    async def adopt(self, name: bytes, node: ScratchFile, req: RequestContext) -> Node | None:
        """A scratch file renamed to `name` here: store it and return the stored file's
        node (its scratch name then goes), or None: it becomes the scratch name `name`."""
        ...

    async def arrived(self, name: bytes, req: RequestContext) -> None:
        """A scratch entry now has the name `name` here."""
        ...


class Plain:
    """The destination of a directory that only keeps scratch names."""

    async def adopt(self, name: bytes, node: ScratchFile, req: RequestContext) -> Node | None:
        return None

    async def arrived(self, name: bytes, req: RequestContext) -> None:
        return None


PLAIN = Plain()


async def move(
    names: dict[bytes, Node],
    name: bytes,
    node: Node,
    new_parent: Node,
    new_name: bytes,
    flags: int,
    req: RequestContext,
) -> None:
    """rename(2) of a scratch entry held in `names`: into a scratch directory, or into a
    directory with scratch names (`new_parent.scratch()`), whose destination may adopt a
    file (a fan-out directory ingests it); anywhere else EXDEV."""
    if flags:
        fail(errno.EINVAL, "rename flags are not supported here")
    destination: Destination | None = None
    if isinstance(new_parent, ScratchDir):
        target = new_parent.entries
    else:
        overlay = new_parent.scratch()
        if overlay is None:
            fail(errno.EXDEV, f"cannot move {node.path} there")
        destination = overlay.destination
        if isinstance(node, ScratchFile) and await destination.adopt(new_name, node, req):
            if names.get(name) is node:
                # The kernel now shows this inode under the object's name until the entry
                # expires: its bytes (the same object, git's compression) stay until the
                # daemon's end. git renames only where link fails; it links otherwise.
                del names[name]
                node.names -= 1
            return
        target = overlay.names()
    old = target.get(new_name)
    if old is node:
        return
    if old is not None:
        if old.is_dir or node.is_dir:
            fail(errno.EEXIST if old.is_dir else errno.ENOTDIR)
        assert isinstance(old, ScratchFile)
        old.drop_name()
    del names[name]
    target[new_name] = node
    node.parent = new_parent
    node.name = new_name
    if isinstance(node, ScratchDir) and node.host is not None:
        node.host = new_parent if not isinstance(new_parent, ScratchDir) else None
    if destination is not None:
        await destination.arrived(new_name, req)
