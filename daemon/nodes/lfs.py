"""/lfs and /repos/<id>/lfs: the store's sha256 objects in git-lfs's storage layout
(docs/lfs.md).

    lfs/objects/<xx>/<yy>/<oid>   every sha256 object, by lookup; nothing is listed
    lfs/tmp/                      git-lfs's temporary files (writable, in memory)

git-lfs writes media as a temporary file in `<lfs dir>/tmp/` (`TempFile`: created
O_EXCL, chmod'ed to the repository's permissions), then renames it to
`objects/<xx>/<yy>/<oid>` (`os.MkdirAll` of the two levels first: they always exist
here). The rename stores the file as a sha256 object checked against the name (EIO and
nothing stored on a mismatch); a rename onto an object already stored drops the
temporary file (dedup). `git config lfs.storage MNT/lfs` therefore gives any number of
repositories one deduplicated media store, and `git lfs prune` there finds nothing to
delete. `/repos/<id>/lfs` is the same view inside a repository, for git-lfs's transfer
to a `file://` remote.

Media written here stay pinned until the push grace (alkfsd --push-grace) has passed
since their writer exited, in a session of their own per view that no ref write ends:
git-lfs uploads before git pushes, and another push to the repository must not end
them. A medium looked up here while staged for deletion is pinned the same way (git-lfs
looks before it decides not to upload).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from typing import TYPE_CHECKING

import trio
from pyfuse3 import RequestContext

from alkfs.keys import Algorithm, Key

from ..errors import fail
from ..staging.overlay import ScratchOverlay
from ..staging.scratch import SCRATCH_TIMEOUT, ScratchDir, ScratchFile
from ..staging.writes import RepoKey, pid_of
from .base import DYNAMIC_TIMEOUT, Dir, Emit, Node
from .handles import DirHandle, Handle
from .listing import Entries, readdir_snapshot
from .objfile import ObjectFile

if TYPE_CHECKING:
    from alkfs.gc.arbiter import Pin
    from alkfs.git.refs import Repo
    from alkfs.store import ObjectStat, PutResult

    from ..context import Context

_PAIR = re.compile(rb"[0-9a-f]{2}")
_OID = re.compile(rb"[0-9a-f]{64}")
LFS_SESSION: RepoKey = ("/lfs", 0)  # the pins of media written through /lfs


class LfsDir(Dir):
    """/lfs, or /repos/<id>/lfs: `objects/` and `tmp/` (and what git-lfs makes beside)."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ("repo", "overlay")

    def __init__(self, ctx: Context, parent: Node, repo: Repo | None = None) -> None:
        ident: tuple = ("lfs",) if repo is None else ("repo-lfs", repo.id, repo.created_ns)
        super().__init__(ctx, ident, parent, b"lfs")
        self.repo = repo
        self.overlay = ScratchOverlay(self)

    def session(self) -> RepoKey:
        """Where media written or found here are pinned: a session no ref write ends
        (the push grace after the writer exited ends it): git-lfs's upload agent exits
        before git pushes, and another push to the repository must not end its pins."""
        if self.repo is None:
            return LFS_SESSION
        return (f"lfs:{self.repo.id}", self.repo.created_ns)

    def scratch(self) -> ScratchOverlay:
        return self.overlay

    def tmp(self) -> ScratchDir:
        """The temporary directory: made once, kept for the mount's life."""
        names = self.ctx.writes.overlay(self)
        node = names.get(b"tmp")
        if not isinstance(node, ScratchDir):
            w = self.ctx.writes
            node = ScratchDir(self.ctx, self, b"tmp", w.area.next_serial(), None, 0, self, 0o755)
            names[b"tmp"] = node
        return node

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        if name == b"objects":
            return LfsObjectsDir(self.ctx, self)
        if name == b"tmp":
            return self.tmp()
        node = self.overlay.lookup(name)
        if node is None:
            fail(errno.ENOENT)
        return node

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        def entries() -> Entries:
            self.tmp()
            return [(b"objects", LfsObjectsDir(self.ctx, self)), *self.overlay.entries()]

        await readdir_snapshot(dh, start, emit, entries)

    async def mkdir(self, name: bytes, mode: int, req: RequestContext) -> Node:
        if name == b"objects":
            fail(errno.EEXIST)
        if name == b"tmp":
            self.tmp()
            fail(errno.EEXIST)
        return self.overlay.mkdir(name, mode, None, req)  # (git-lfs's logs/, say)

    async def create(
        self, name: bytes, mode: int, flags: int, req: RequestContext
    ) -> tuple[Node, Handle]:
        if name in (b"objects", b"tmp"):
            fail(errno.EEXIST)
        return await self.overlay.create(name, mode, flags, req)

    async def unlink(self, name: bytes, req: RequestContext) -> None:
        if not self.overlay.unlink(name):
            fail(errno.EISDIR if name in (b"objects", b"tmp") else errno.ENOENT)

    async def rmdir(self, name: bytes, req: RequestContext) -> None:
        if name == b"tmp":
            if self.tmp().entries:  # (shared by every writer of this view)
                fail(errno.ENOTEMPTY)
            return  # (empty: the directory stays, as git-lfs makes it again anyway)
        if name == b"objects":
            fail(errno.EPERM, "the store's objects are removed by its sweeps")
        if not self.overlay.rmdir(name):
            fail(errno.ENOENT)

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, req: RequestContext
    ) -> None:
        if not await self.overlay.rename(name, new_parent, new_name, flags, req):
            fail(errno.EPERM if name in (b"objects", b"tmp") else errno.ENOENT)


class LfsObjectsDir(Dir):
    """lfs/objects: every <xx> resolves, nothing is listed."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ("top",)

    def __init__(self, ctx: Context, parent: LfsDir) -> None:
        super().__init__(ctx, (*parent.ident, "objects"), parent, b"objects")
        self.top = parent

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        if _PAIR.fullmatch(name) is None:
            fail(errno.ENOENT)
        return LfsFanDir(self.ctx, self, self.top, name)

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        return None  # (lists nothing: `git lfs prune` here finds nothing to delete)

    async def mkdir(self, name: bytes, mode: int, req: RequestContext) -> Node:
        fail(errno.EEXIST if _PAIR.fullmatch(name) else errno.EPERM)


class LfsFanDir(Dir):
    """lfs/objects/<xx> (`yy` None) and lfs/objects/<xx>/<yy>."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ("top", "xx", "yy", "overlay")

    def __init__(
        self, ctx: Context, parent: Node, top: LfsDir, xx: bytes, yy: bytes | None = None
    ) -> None:
        name = xx if yy is None else yy
        super().__init__(ctx, (*top.ident, "objects", xx, yy), parent, name)
        self.top, self.xx, self.yy = top, xx, yy
        self.overlay = ScratchOverlay(self, self)  # (this directory adopts: `adopt`)

    def scratch(self) -> ScratchOverlay:
        return self.overlay

    def key_of(self, name: bytes) -> Key | None:
        if self.yy is None or _OID.fullmatch(name) is None or name[:4] != self.xx + self.yy:
            return None
        return Key.from_hex(Algorithm.SHA256, name.decode())

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        if self.yy is None:
            if _PAIR.fullmatch(name) is None:
                fail(errno.ENOENT)
            return LfsFanDir(self.ctx, self, self.top, self.xx, name)
        key = self.key_of(name)
        if key is not None:
            st, pin = await self.ctx.run_sync(_stat_and_hold, self.ctx, key)
            if pin is not None:
                self.ctx.writes.hold(self.top.session(), pid_of(req), pin)
            if st is not None:
                return MediaFile.fresh(self.ctx, self, st)
        node = self.overlay.lookup(name)
        if node is None:
            fail(errno.ENOENT)
        return node

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        await readdir_snapshot(dh, start, emit, self.overlay.entries)

    async def mkdir(self, name: bytes, mode: int, req: RequestContext) -> Node:
        fail(errno.EEXIST if self.yy is None and _PAIR.fullmatch(name) else errno.EPERM)

    async def create(
        self, name: bytes, mode: int, flags: int, req: RequestContext
    ) -> tuple[Node, Handle]:
        if self.yy is None:
            fail(errno.EPERM, "media are written in lfs/tmp/, then renamed to their oid")
        if self.key_of(name) is not None:
            fail(errno.EPERM, "media are written in lfs/tmp/, then renamed to their oid")
        return await self.overlay.create(name, mode, flags, req)

    async def unlink(self, name: bytes, req: RequestContext) -> None:
        if self.overlay.unlink(name):
            return
        key = self.key_of(name)
        if key is not None and await self.ctx.run_sync(self.ctx.store.has, key):
            fail(errno.EPERM, f"{key} cannot be removed: deletion is the sweep's job")
        fail(errno.ENOENT)

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, req: RequestContext
    ) -> None:
        if not await self.overlay.rename(name, new_parent, new_name, flags, req):
            fail(errno.EPERM if self.key_of(name) is not None else errno.ENOENT)

    async def link(self, name: bytes, node: Node, req: RequestContext) -> Node:
        if self.key_of(name) is not None:
            return await self.adopt(name, node, req)
        return await self.overlay.link(name, node)

    # -- media moved in (the overlay's destination) ---------------------------------------
    async def adopt(self, name: bytes, node: Node, req: RequestContext) -> Node:
        """A temporary file renamed (or linked) to <oid>: stored as that sha256 object."""
        key = self.key_of(name)
        if key is None:
            fail(errno.EINVAL, f"{name!r} is not a media name of {self.path}")
        if not isinstance(node, ScratchFile):
            fail(errno.EPERM, f"{node.path} is not a file git-lfs is writing")
        result = await self.ctx.run_sync(_store_media, self.ctx, node, key)
        self.ctx.writes.hold(self.top.session(), pid_of(req), result.pin)
        if node.names <= 1:  # (renamed: its last name goes; media may be large)
            self.ctx.workers.start_soon(_drop_later, node, name="alkfsd lfs tmp")
        st = await self.ctx.run_sync(self.ctx.store.stat, key)
        if st is None:  # (pinned: cannot happen)
            fail(errno.EIO, f"{key} vanished after it was stored")
        return MediaFile.fresh(self.ctx, self, st)

    async def arrived(self, name: bytes, req: RequestContext) -> None:
        return None


def _stat_and_hold(ctx: Context, key: Key) -> tuple[ObjectStat | None, Pin | None]:
    """The medium's attributes, and a pin on it if a sweep staged it for deletion: git-lfs
    looks a medium up before it decides not to upload it, and the pointer that names it
    comes with the push after that (the pin lasts the push grace)."""
    store = ctx.store
    st = store.stat(key)
    if st is None or store.window.visible_after(key.raw) is None:
        return st, None
    pin = store.pin(key)
    if not store.has(key):  # (deleted meanwhile)
        pin.release()
        return None, None
    return st, pin


async def _drop_later(node: ScratchFile) -> None:
    """The temporary file's bytes go once the kernel has let go of its entry under the
    media's name (until then it shows the renamed inode: SCRATCH_TIMEOUT), not at the
    daemon's end as a loose object's do: media may be gigabytes."""
    await trio.sleep(SCRATCH_TIMEOUT + 1.0)
    if node.names <= 0:
        await node.ctx.run_sync(_unlink, node.disk)


def _unlink(path: str | os.PathLike[str]) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _store_media(ctx: Context, node: ScratchFile, key: Key) -> PutResult:
    """The temporary file's bytes stored under `key` (Verification, hence EIO, when they
    hash to another oid: nothing is stored). Streamed from the scratch file."""
    with open(node.disk, "rb") as f:
        return ctx.store.put(f, os.fstat(f.fileno()).st_size, Algorithm.SHA256, expect=key)


class MediaFile(ObjectFile):
    """A sha256 object as lfs/objects/<xx>/<yy>/<oid>: its entry is asked again after a
    while (a sweep invalidates /objects' entries, not every view's)."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ()
