"""The entries of /pins and of its directories; the directories themselves
are nodes/pins.py's.

- `PinLink`: a pin made by `ln -s`, setfattr or the CLI, a symbolic link
  `<name> -> ../objects/<algo>/<hex>` with one `../` more per directory level.
- `PinFileEntry`: a pin written as a file, a regular file of its object's size with the
  mode, time, owner and group its writer gave (chmod, touch, utime, chown set them: the
  pin's row keeps them; an owner never set is the mount's), its key in
  `user.alkfs.key`; reads are its object's, verified.
- `PinFile`: a file being written (a StagedFile): one writer only; on close its content
  is stored and pinned under its path with its attributes, and the entry becomes a
  `PinFileEntry`.
- `Tree`: what the mount keeps of /pins besides the database: the files being written
  (by their path), the paths whose intent is logged and not applied yet, the last path
  found unpinned.

Who may change an owner or a group (`owner_change`, Linux's rules): root (a request of
uid 0) any; any other user no owner, and a group only of what it shows as its own, to
its group or one of its supplementary groups (/proc/<pid>/status); anything else is
EPERM, a chown to what it is a no-op. A pin made as a link keeps no owner
(`noop_setattr`).

An entry's identity is its row's (creation time and key), never its name: a rename
keeps its inode, a name pinned again is another inode (another row).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import TYPE_CHECKING

import pyfuse3
import trio
from pyfuse3 import RequestContext

from alkfs.errors import Missing
from alkfs.keys import Algorithm
from alkfs.pins import Entry, FileAttrs, PinRecord, path_bytes, path_text

from ..errors import fail
from ..staging.staged import StagedFile, StagingParent
from . import pinning
from .base import DYNAMIC_TIMEOUT, File, Node, SetattrFields, Symlink
from .handles import Handle, wants_write
from .objfile import ObjectFile
from .policy import noop_setattr

if TYPE_CHECKING:
    from ..context import Context

X_KEY = b"user.alkfs.key"


def link_target(rec: PinRecord) -> bytes:
    """`../objects/<algo>/<hex>`, one `../` more for each directory the pin is in."""
    up = "../" * rec.name.count("/")
    return f"{up}../objects/{rec.key.algo.label}/{rec.key.hex}".encode()


def leaf_of(name: str) -> bytes:
    """The last component of a pin's path, as the kernel names it."""
    return path_bytes(name[name.rfind("/") + 1 :])


def groups_of(pid: int | None) -> frozenset[int] | None:
    """The supplementary groups of the process `pid` (the `Groups:` line of
    /proc/<pid>/status; None: unreadable, e.g. the process is gone)."""
    if not pid:
        return None
    try:
        with open(f"/proc/{int(pid)}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        return None
    return None


def owner_change(
    req: RequestContext | None,
    uid: int,
    gid: int,
    attr: pyfuse3.EntryAttributes,
    fields: SetattrFields,
    what: str,
) -> tuple[int | None, int | None]:
    """The owner and group a setattr asks `what` (shown as `uid`:`gid`) to take, each None
    when not asked or the same as now (a no-op), once allowed (see the module docstring;
    EPERM otherwise)."""
    new_uid = attr.st_uid if fields.update_uid and attr.st_uid != uid else None
    new_gid = attr.st_gid if fields.update_gid and attr.st_gid != gid else None
    if new_uid is None and new_gid is None:
        return None, None
    asker = getattr(req, "uid", None)
    if asker == 0:
        return new_uid, new_gid
    if new_uid is not None:
        fail(errno.EPERM, f"{what}: only root gives it another owner")
    if asker != uid:
        fail(errno.EPERM, f"{what}: only its owner (or root) changes its group")
    if new_gid != getattr(req, "gid", None):
        groups = groups_of(getattr(req, "pid", None))
        if groups is None or new_gid not in groups:
            fail(errno.EPERM, f"{what}: uid {asker} is not in the group {new_gid}")
    return new_uid, new_gid


def show_owner(ctx: Context, a: pyfuse3.EntryAttributes, rec: Entry) -> pyfuse3.EntryAttributes:
    """`a` with the owner and group of the row `rec` (none kept: the mount's owner's)."""
    a.st_uid = ctx.uid if rec.uid is None else rec.uid
    a.st_gid = ctx.gid if rec.gid is None else rec.gid
    return a


async def set_owned_attrs(
    ctx: Context,
    rec: Entry,
    now: pyfuse3.EntryAttributes,
    attr: pyfuse3.EntryAttributes,
    fields: SetattrFields,
    req: RequestContext | None,
) -> Entry | None:
    """A pin's or a directory of pins' setattr: its mode, modification time, owner and
    group are kept in its row (an owner or group by `owner_change`'s rules). The row as
    it is now, or None when nothing of it changed."""
    uid, gid = owner_change(req, now.st_uid, now.st_gid, attr, fields, f"/pins/{rec.name}")
    mode = stat.S_IMODE(attr.st_mode) if fields.update_mode else None
    mtime = attr.st_mtime_ns if fields.update_mtime else None
    if mode is None and mtime is None and uid is None and gid is None:
        return None
    try:
        return await ctx.run_sync(
            ctx.pins.set_attrs, rec.name, rec.created_ns, mode, mtime, uid, gid
        )
    except Missing:
        fail(errno.ENOENT, f"/pins/{rec.name} is gone")


class Tree:
    """The state of /pins the library does not hold (one per mount: PinsDir's; a pin
    acknowledged ahead of its commit is the library's: Pins.entry finds it)."""

    __slots__ = ("staged", "unpinned", "unpinned_epoch")

    def __init__(self) -> None:
        self.staged: dict[bytes, PinFile] = {}  # path -> the file being written there
        self.unpinned = b""  # the last path found unpinned, at this pins epoch
        self.unpinned_epoch = -1


class PinLink(Symlink):
    """A pin made by `ln -s`, setfattr or the CLI; its time is the pin's creation time."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ("record",)

    def __init__(self, ctx: Context, parent: Node, rec: PinRecord) -> None:
        ident = ("pin", rec.created_ns, rec.key.raw)
        super().__init__(ctx, ident, parent, leaf_of(rec.name), link_target(rec))
        self.record = rec

    def mtime_ns(self) -> int:
        return self.record.created_ns

    def moved(self, parent: Node | None, rec: PinRecord) -> None:
        """The pin was renamed (the kernel keeps this inode under its new name)."""
        self.record, self.parent, self.name = rec, parent, leaf_of(rec.name)
        self.target = link_target(rec)

    async def readlink(self, req: RequestContext) -> bytes:
        rec = self.ctx.pins.get(self.record.name)
        if rec is None or rec.key != self.record.key:
            fail(errno.ENOENT, f"the pin {self.record.name} is gone")
        return self.target

    async def setattr(
        self,
        attr: pyfuse3.EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> pyfuse3.EntryAttributes:
        # `touch -h`: freshens the object; a chmod/chown to what it is is a no-op
        if noop_setattr(self, attr, fields):
            await self.ctx.run_sync(self.ctx.store.freshen, self.record.key)
        return self.attr()


class PinFileEntry(File):
    """A pin written as a file: its object's bytes, the mode, time, owner and group it
    was given."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ("record",)

    def __init__(self, ctx: Context, parent: Node, rec: PinRecord) -> None:
        super().__init__(ctx, ("pinfile", rec.created_ns, rec.key.raw), parent, leaf_of(rec.name))
        self.record = rec

    def moved(self, parent: Node | None, rec: PinRecord) -> None:
        self.record, self.parent, self.name = rec, parent, leaf_of(rec.name)

    def mode(self) -> int:
        return stat.S_IFREG | stat.S_IMODE(self.record.mode or 0o644)

    def size(self) -> int:
        return self.record.size or 0

    def mtime_ns(self) -> int:
        rec = self.record
        return rec.created_ns if rec.mtime_ns is None else rec.mtime_ns

    def attr(self) -> pyfuse3.EntryAttributes:
        return show_owner(self.ctx, super().attr(), self.record)

    def _fresh(self) -> PinRecord:
        """The row as it is now (ENOENT: unpinned, or the name pinned anew)."""
        rec = self.ctx.pins.get(self.record.name)
        if rec is None or rec.created_ns != self.record.created_ns or rec.key != self.record.key:
            fail(errno.ENOENT, f"the pin {self.record.name} is gone")
        self.record = rec
        return rec

    async def getattr(self, req: RequestContext) -> pyfuse3.EntryAttributes:
        self._fresh()
        return self.attr()

    async def open(self, flags: int, req: RequestContext) -> Handle:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC):
            fail(errno.EPERM, f"/pins/{self.record.name} is a pin: it is immutable")
        st = self.ctx.store.stat(self.record.key)
        if st is None:
            fail(errno.ENOENT, f"{self.record.key} is gone")
        return await ObjectFile(self.ctx, self, st).open(flags, req)

    async def setattr(
        self,
        attr: pyfuse3.EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> pyfuse3.EntryAttributes:
        """chmod, chown and the modification time are the pin's (its row keeps them;
        `owner_change` says who may chown); a size other than its own is EPERM, an
        access time alone is ignored."""
        a = self.attr()
        if fields.update_size and attr.st_size != a.st_size:
            fail(errno.EPERM, f"/pins/{self.record.name}: its size cannot change")
        got = await set_owned_attrs(self.ctx, self.record, a, attr, fields, req)
        if got is not None:
            assert isinstance(got, PinRecord)
            self.record = got
        return self.attr()

    async def getxattr(self, name: bytes, req: RequestContext) -> bytes:
        if name == X_KEY:
            return str(self.record.key).encode()
        fail(errno.ENODATA)

    async def listxattr(self, req: RequestContext) -> list[bytes]:
        return [X_KEY]

    async def setxattr(self, name: bytes, value: bytes, req: RequestContext) -> None:
        if name == X_KEY:
            fail(errno.EPERM, f"{X_KEY.decode()} is read-only")
        fail(errno.ENOTSUP, f"no settable attribute {name!r}")


class PinFile(StagedFile):
    """A new file in /pins (its path there: `pin_path`): one writer only (a second write
    open would truncate or interleave with the first writer's bytes, and the last close
    would win). Its owner and group, shown as the StagedFile's, are the mount's until a
    chown (`owner_change`'s rules) sets them (`owner`: what its row takes)."""

    __slots__ = ("pin_path", "owner")

    def __init__(
        self,
        ctx: Context,
        host: StagingParent[PinFile],
        parent: Node,
        name: bytes,
        path: bytes,
        mode: int,
    ):
        super().__init__(ctx, host, name, Algorithm.SHA256, mode=mode)
        self.parent = parent  # (the directory it is listed in; `host` stores it)
        self.pin_path = path
        self.owner: tuple[int | None, int | None] = (None, None)  # (uid, gid) set by chown

    @property
    def pin_name(self) -> str:
        return path_text(self.pin_path)

    def file_attrs(self, size: int) -> FileAttrs:
        return FileAttrs(stat.S_IFREG | self.perm, self.times_ns, size, *self.owner)

    async def open(self, flags: int, req: RequestContext) -> Handle:
        if wants_write(flags) and self.opens > 0 and not self.writer.closed:
            fail(errno.EEXIST, f"{self.path} is being written by another open file")
        return await super().open(flags, req)

    async def settled(self) -> None:
        """Until no commit of this file is under way (one that was is pinned now, or
        failed): what a rename, an unlink or a chmod of it then does stays done."""
        while self.committing:
            if self.idle is None:
                self.idle = trio.Event()
            await self.idle.wait()

    async def setattr(
        self,
        attr: pyfuse3.EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> pyfuse3.EntryAttributes:
        """Recorded until the content is stored (the pin takes them); once it is (a
        chmod right after the close, racing the commit of an empty file at release; a
        descriptor still open), they go to the pin's row too. An owner or group by
        `owner_change`'s rules (EPERM: nothing changes)."""
        uid, gid = owner_change(req, self.uid, self.gid, attr, fields, f"/pins/{self.pin_name}")
        out = await super().setattr(attr, fields, handle, req)
        if uid is not None or gid is not None:
            was_uid, was_gid = self.owner
            self.owner = (was_uid if uid is None else uid, was_gid if gid is None else gid)
        if not (fields.update_mode or fields.update_mtime or uid is not None or gid is not None):
            return out
        await self.settled()
        if self.key is not None and not self.writer.dirty and not self.unlinked:
            ctx = self.ctx
            await ctx.run_sync(
                pinning.set_file_attrs,
                ctx.pins,
                self.pin_name,
                self.key,
                self.perm if fields.update_mode else None,
                self.times_ns if fields.update_mtime else None,
                uid,
                gid,
            )
        return out
