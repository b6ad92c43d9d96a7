"""/repos/<id>/objects: every stored object of the repository's format by name (the loose
files of /git/<format>), git's scratch writes and a push's quarantine, `pack/` (a pushed
pack is stored when its index arrives) and `info/alternates`. See repos.py."""

from __future__ import annotations

import errno
import os
import stat
from typing import TYPE_CHECKING

from pyfuse3 import RequestContext

from ..errors import fail
from ..staging import ingest
from ..staging.overlay import ScratchOverlay
from ..staging.scratch import ScratchFile
from ..staging.writes import RepoKey, pid_of, repo_key
from .base import FIRST_OFFSET, Dir, Emit, File, Node
from .handles import BytesHandle, DirHandle, Handle, wants_write
from .listing import Entries, readdir_snapshot
from .loose import FANOUT, FanoutDir, repo_fanout_ident
from .refwrites import plumbing_goes

if TYPE_CHECKING:
    from ..context import Context
    from .repos import RepoDir


class RepoObjectsDir(Dir):
    """/repos/<id>/objects: resolves <xx>/<rest>, lists only info/ and pack/ (and a push's
    quarantine, scratch names, while it lasts)."""

    __slots__ = ("repo", "overlay", "view")

    def __init__(self, ctx: Context, parent: RepoDir) -> None:
        repo = parent.repo
        super().__init__(ctx, ("repo-objects", repo.id, repo.created_ns), parent, b"objects")
        self.repo = repo
        self.view = parent.view
        self.overlay = ScratchOverlay(self)

    def scratch(self) -> ScratchOverlay:
        return self.overlay

    def _child(self, name: bytes) -> Node | None:
        if name == b"info":
            return RepoInfoDir(self.ctx, self)
        if name == b"pack":
            return RepoPackDir(self.ctx, self)
        if name in _FANOUT:
            return RepoFanoutDir(self.ctx, self, name)
        return None

    def entries_in_c(self) -> list[tuple[bytes, Node]]:
        return [(xx, RepoFanoutDir(self.ctx, self, xx)) for xx in FANOUT]

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        node = self._child(name) or self.overlay.lookup(name)
        if node is None:
            fail(errno.ENOENT)
        return node

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        def entries() -> Entries:
            out = [(n, node) for n in (b"info", b"pack") if (node := self._child(n)) is not None]
            return out + self.overlay.entries()  # a push's quarantine, while it lasts

        await readdir_snapshot(dh, start, emit, entries)

    # -- git's writes: temporary files and quarantine directories (scratch) -------------
    async def mkdir(self, name: bytes, mode: int, req: RequestContext) -> Node:
        node = self._child(name)
        if node is not None:
            return node  # git makes <xx>/ and pack/ before moving objects in: always there
        return self.overlay.mkdir(name, mode, repo_key(self.repo), req)

    async def create(
        self, name: bytes, mode: int, flags: int, req: RequestContext
    ) -> tuple[Node, Handle]:
        if self._child(name) is not None:
            fail(errno.EEXIST)
        return await self.overlay.create(name, mode, flags, req)

    async def rmdir(self, name: bytes, req: RequestContext) -> None:
        if self.overlay.rmdir(name):
            return
        if name in (b"info", b"pack"):
            await plumbing_goes(self, name)
            return
        await super().rmdir(name, req)

    async def link(self, name: bytes, node: Node, req: RequestContext) -> Node:
        return await self.overlay.link(name, node)

    async def unlink(self, name: bytes, req: RequestContext) -> None:
        if not self.overlay.unlink(name):
            await super().unlink(name, req)

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, req: RequestContext
    ) -> None:
        if not await self.overlay.rename(name, new_parent, new_name, flags, req):
            await super().rename(name, new_parent, new_name, flags, req)


_FANOUT = frozenset(FANOUT)


class RepoFanoutDir(FanoutDir):
    """/repos/<id>/objects/<xx>: resolves the objects of that prefix (the git view's
    files), lists none: git enumerates through the alternate, once for all repositories."""

    __slots__ = ()

    def __init__(self, ctx: Context, parent: RepoObjectsDir, xx: bytes) -> None:
        super().__init__(
            ctx, parent, parent.repo.algo, xx, ident=repo_fanout_ident(parent.repo, xx)
        )

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        return None

    def listing_known_empty(self) -> bool:
        return True

    def repo_key(self) -> RepoKey | None:
        parent = self.parent
        assert isinstance(parent, RepoObjectsDir)
        return repo_key(parent.repo)


class RepoPackDir(Dir):
    """/repos/<id>/objects/pack: lists nothing once a pack is in the store. When a pack's
    index arrives (git moves it after the pack: a push, or `git repack` run here) the pack
    is kept as a pack of the derived set, or its objects are verified and stored one by
    one, and pinned for the push either way (ingest.ingest_pack says which);
    from then on its files still resolve by name for the git process that made them but
    are no longer listed (every object is served by the store and the derived packs, so
    a local clone or a later git never copies or re-reads this pack), and they go when git
    removes the pack's `.keep` (a push's refs are written) or the files themselves."""

    __slots__ = ("repo", "overlay", "view")

    def __init__(self, ctx: Context, parent: RepoObjectsDir) -> None:
        repo = parent.repo
        super().__init__(ctx, ("repo-pack", repo.id, repo.created_ns), parent, b"pack")
        self.repo = repo
        self.view = parent.view
        self.overlay = ScratchOverlay(self, self)  # (a pack's index arriving: `arrived`)

    def scratch(self) -> ScratchOverlay:
        return self.overlay

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        node = self.overlay.lookup(name)
        if node is None:
            fail(errno.ENOENT)
        return node

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        def entries() -> Entries:
            stored = self.view.ingested_packs.get(repo_key(self.repo), set())
            listed = self.overlay.entries()
            return [(n, node) for n, node in listed if n.partition(b".")[0] not in stored]

        await readdir_snapshot(dh, start, emit, entries)

    async def create(
        self, name: bytes, mode: int, flags: int, req: RequestContext
    ) -> tuple[Node, Handle]:
        return await self.overlay.create(name, mode, flags, req)

    async def link(self, name: bytes, node: Node, req: RequestContext) -> Node:
        out = await self.overlay.link(name, node)
        await self.arrived(name, req)
        return out

    async def adopt(self, name: bytes, node: ScratchFile, req: RequestContext) -> Node | None:
        return None  # (a file moved in stays a scratch file: `arrived` sees it)

    async def arrived(self, name: bytes, req: RequestContext) -> None:
        """A file was linked or moved in: the index completes a pack, which is ingested."""
        if not (name.startswith(b"pack-") and name.endswith(b".idx")):
            return
        names = self.overlay.names()
        idx = names.get(name)
        pack = names.get(name[:-4] + b".pack")
        if not isinstance(pack, ScratchFile) or not isinstance(idx, ScratchFile):
            fail(errno.EIO, f"{self.path}: {name!r} arrived without its pack")
        try:
            await ingest.ingest_pack(self.ctx, pack, idx, self.repo, pid_of(req))
        except BaseException:
            self.overlay.unlink(name)  # a refused pack: its index is not kept
            raise
        stem = name.partition(b".")[0]  # pack-<hex>: its .pack, .idx, .rev, .bitmap, .keep
        self.view.ingested_packs.setdefault(repo_key(self.repo), set()).add(stem)

    async def unlink(self, name: bytes, req: RequestContext) -> None:
        if not self.overlay.unlink(name):
            fail(errno.ENOENT)
        if name.startswith(b"pack-") and name.endswith(b".keep"):
            stem = name[:-5]  # the push is done: its pack is in the store, the files go
            for ext in (b".pack", b".idx", b".rev", b".bitmap", b".promisor"):
                if self.overlay.lookup(stem + ext) is not None:
                    self.overlay.unlink(stem + ext)

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, req: RequestContext
    ) -> None:
        if not await self.overlay.rename(name, new_parent, new_name, flags, req):
            fail(errno.ENOENT)


class RepoInfoDir(Dir):
    """/repos/<id>/objects/info: `alternates` only."""

    __slots__ = ("repo",)

    def __init__(self, ctx: Context, parent: RepoObjectsDir) -> None:
        repo = parent.repo
        super().__init__(ctx, ("repo-info", repo.id, repo.created_ns), parent, b"info")
        self.repo = repo

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        if name != b"alternates":
            fail(errno.ENOENT)
        return AlternatesFile(self.ctx, self)

    async def unlink(self, name: bytes, req: RequestContext) -> None:
        if name != b"alternates":
            fail(errno.ENOENT)
        await plumbing_goes(self, name)

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        if start < FIRST_OFFSET:
            emit(b"alternates", AlternatesFile(self.ctx, self), FIRST_OFFSET)


class AlternatesFile(File):
    """objects/info/alternates: the absolute path of MNT/git/<format>."""

    __slots__ = ("data",)

    def __init__(self, ctx: Context, parent: RepoInfoDir) -> None:
        repo = parent.repo
        super().__init__(ctx, ("repo-alternates", repo.id, repo.created_ns), parent, b"alternates")
        mnt = os.path.abspath(ctx.mountpoint) if ctx.mountpoint else ""
        self.data = f"{mnt}/git/{repo.object_format}\n".encode()

    def mode(self) -> int:
        return stat.S_IFREG | 0o444

    def size(self) -> int:
        return len(self.data)

    async def open(self, flags: int, req: RequestContext) -> Handle:
        if wants_write(flags):
            fail(errno.EPERM, f"{self.path} is read-only")
        return BytesHandle(self, self.data)
