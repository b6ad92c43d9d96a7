"""/repos/<id>/refs and HEAD: refs as files `<oid>\\n`, nested directories of them; every
write is a compare-and-swap (refwrites.py). See repos.py for the protocol."""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING

from pyfuse3 import EntryAttributes, RequestContext

from alkfs.git.refs import ANY, Repo, valid_ref_name

from ..errors import fail
from ..staging.writes import pid_of, repo_key
from .base import DYNAMIC_TIMEOUT, Dir, Emit, File, Node, SetattrFields
from .handles import BytesHandle, DirHandle, Handle, wants_write
from .listing import Entries, readdir_snapshot, text_of
from .refwrites import QUOTE, LockHandle, RefWriteHandle, drop_lock, lock_of, new_lock, write_ref

if TYPE_CHECKING:
    from ..context import Context
    from .repos import RepoDir


class RepoFile(File):
    """A small generated file of a repository; its content is read at open."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ("repo", "data")

    def __init__(
        self,
        ctx: Context,
        ident: tuple,
        parent: Node,
        name: bytes,
        repo: Repo,
        data: bytes | None = None,
    ) -> None:
        super().__init__(ctx, ident, parent, name)
        self.repo = repo
        self.data = self.content() if data is None else data

    def content(self) -> bytes:
        return b""

    def size(self) -> int:
        return len(self.data)

    def mtime_ns(self) -> int:
        return self.repo.created_ns

    async def getattr(self, req: RequestContext) -> EntryAttributes:
        self.data = self.content()
        return self.attr()

    async def open(self, flags: int, req: RequestContext) -> Handle:
        if wants_write(flags):
            fail(errno.EPERM, f"{self.path} is read-only")
        self.data = self.content()
        return BytesHandle(self, self.data, direct_io=True)


class HeadFile(RepoFile):
    __slots__ = ()

    def __init__(self, ctx: Context, parent: RepoDir) -> None:
        repo = parent.repo
        super().__init__(ctx, ("repo-head", repo.id, repo.created_ns), parent, b"HEAD", repo)

    def content(self) -> bytes:
        return f"ref: {self.ctx.refs.head(self.repo.id)}\n".encode()

    async def open(self, flags: int, req: RequestContext) -> Handle:
        if wants_write(flags):
            shown = b"" if flags & os.O_TRUNC else self.content()
            return RefWriteHandle(self, self.repo, "HEAD", None, pid_of(req), shown)
        return await super().open(flags, req)

    async def setattr(
        self,
        attr: EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> EntryAttributes:
        return _truncate_only(self, attr, fields, handle)


class RefFile(RepoFile):
    """A ref: `<oid>\\n`."""

    __slots__ = ("ref",)

    def __init__(self, ctx: Context, parent: Node, repo: Repo, ref: str, oid: str) -> None:
        self.ref = ref
        ident = ("ref", repo.id, repo.created_ns, ref)
        name = ref.rpartition("/")[2].encode()
        super().__init__(ctx, ident, parent, name, repo, f"{oid}\n".encode())

    def content(self) -> bytes:
        oid = self.ctx.refs.get(self.repo.id, self.ref)
        if oid is None:
            fail(errno.ENOENT, f"{self.repo.id}: {self.ref} is gone")
        return f"{oid}\n".encode()

    async def open(self, flags: int, req: RequestContext) -> Handle:
        if wants_write(flags):
            old = self.ctx.refs.get(self.repo.id, self.ref)
            shown = b"" if flags & os.O_TRUNC or old is None else f"{old}\n".encode()
            return RefWriteHandle(self, self.repo, self.ref, old, pid_of(req), shown)
        return await super().open(flags, req)

    async def setattr(
        self,
        attr: EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> EntryAttributes:
        return _truncate_only(self, attr, fields, handle)


class NewRefFile(RefFile):
    """A ref being created: empty until its first line is written. Its entry is never
    cached: a refused first write leaves no name behind."""

    entry_timeout = 0.0
    attr_timeout = 0.0
    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node, repo: Repo, ref: str) -> None:
        super().__init__(ctx, parent, repo, ref, "")
        self.data = b""

    def content(self) -> bytes:
        oid = self.ctx.refs.get(self.repo.id, self.ref)
        return b"" if oid is None else f"{oid}\n".encode()


def _truncate_only(
    node: RepoFile, attr: EntryAttributes, fields: SetattrFields, handle: Handle | None
) -> EntryAttributes:
    """O_TRUNC at open (as any `>` does), a truncate to 0 of an open ref or HEAD, and touch:
    accepted (the next write replaces it whole; after an ftruncate, a close with nothing
    written is EINVAL, see RefWriteHandle.flush). A truncate by path (no open handle), or
    to another size, would leave no ref: EINVAL."""
    if fields.update_mode or fields.update_uid or fields.update_gid:
        fail(errno.EPERM, f"{node.path}: its mode and owner cannot be changed")
    if fields.update_size and (not isinstance(handle, RefWriteHandle) or attr.st_size != 0):
        fail(errno.EINVAL, f"{node.path}: a ref changes only by writing a new value into it")
    if fields.update_size and isinstance(handle, RefWriteHandle):
        del handle.buf[0:]
        handle.shown = None
        handle.emptied = True
    return node.attr()


class RefDir(Dir):
    """/repos/<id>/refs[/...]: one level of the ref namespace (refs/heads and refs/tags
    always exist). Every ref and every directory of refs resolves by name; listings show
    only refs/heads, refs/tags and directories made by mkdir that hold no ref yet, as in a
    git repository whose refs are all packed: `packed-refs` lists them, and git reads all
    refs of a repository in a few requests whatever their number. Each request costs one
    index probe, never a scan of the refs. Entries are never cached: a directory vanishes
    with its last ref."""

    entry_timeout = 0.0
    attr_timeout = 0.0
    __slots__ = ("repo", "ref")

    def __init__(self, ctx: Context, parent: Node, repo: Repo, ref: str) -> None:
        name = ref.rpartition("/")[2].encode()
        super().__init__(ctx, ("refdir", repo.id, repo.created_ns, ref), parent, name)
        self.repo = repo
        self.ref = ref

    def _always(self) -> tuple[str, ...]:
        return ("heads", "tags") if self.ref == "refs" else ()

    def _dir(self, name: str) -> RefDir:
        cls = FixedRefDir if name in self._always() else RefDir
        return cls(self.ctx, self, self.repo, f"{self.ref}/{name}")

    def _made(self) -> set[str]:
        """Directories below refs/ made by mkdir that hold no ref yet (in memory)."""
        dirs = self.ctx.writes.ref_dirs.get(repo_key(self.repo))
        return dirs or set()

    def _full(self, name: bytes, *, making: bool = False) -> str:
        part = text_of(name)
        if not part or "/" in part or part in (".", ".."):
            if making:  # a name git would refuse too (check-ref-format)
                fail(errno.EINVAL, f"{self.repo.id}: invalid ref name component {name[:QUOTE]!r}")
            fail(errno.ENOENT)
        return f"{self.ref}/{part}"

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        full = self._full(name)
        part = full.rpartition("/")[2]
        refs = self.ctx.refs
        oid = refs.get(self.repo.id, full)  # Missing (no repository): ENOENT
        if oid is not None:
            return RefFile(self.ctx, self, self.repo, full, oid)
        if (
            part in self._always()
            or full in self._made()
            or refs.has_below(self.repo.id, full + "/")
        ):
            return self._dir(part)
        if full.endswith(".lock"):
            lock = lock_of(self, self.repo, full[:-5])
            if lock is not None:
                return lock
        fail(errno.ENOENT)

    # -- writes ---------------------------------------------------------------------------
    async def create(
        self, name: bytes, mode: int, flags: int, req: RequestContext
    ) -> tuple[Node, Handle]:
        full = self._full(name, making=True)
        if full.endswith(".lock"):
            ref = full[:-5]
            if not valid_ref_name(ref):
                fail(errno.EINVAL, f"{self.repo.id}: invalid ref name {ref!r}")
            old = self.ctx.refs.get(self.repo.id, ref)
            node = new_lock(self, self.repo, ref, name, old)
            return node, LockHandle(node)
        if not valid_ref_name(full):
            fail(errno.EINVAL, f"{self.repo.id}: invalid ref name {full!r}")
        old = self.ctx.refs.get(self.repo.id, full)
        new = NewRefFile(self.ctx, self, self.repo, full)
        return new, RefWriteHandle(new, self.repo, full, old, pid_of(req))

    async def mkdir(self, name: bytes, mode: int, req: RequestContext) -> Node:
        full = self._full(name, making=True)
        part = full.rpartition("/")[2]
        if not valid_ref_name(full + "/x"):
            fail(errno.EINVAL, f"{self.repo.id}: invalid ref directory {full!r}")
        refs = self.ctx.refs
        if refs.get(self.repo.id, full) is not None:
            fail(errno.EEXIST)
        if (
            part in self._always()
            or full in self._made()
            or refs.has_below(self.repo.id, full + "/")
        ):
            fail(errno.EEXIST)
        w = self.ctx.writes
        w.ref_dirs.setdefault(repo_key(self.repo), set()).add(full)
        return self._dir(part)

    async def unlink(self, name: bytes, req: RequestContext) -> None:
        full = self._full(name)
        if full.endswith(".lock") and drop_lock(self.ctx, self.repo, full[:-5]):
            return
        old = self.ctx.refs.get(self.repo.id, full)
        if old is None:
            await self.lookup(name, req)  # ENOENT, or a directory:
            fail(errno.EISDIR)
        lock = lock_of(self, self.repo, full)
        expect = lock.old if lock is not None else ANY  # git deletes under its lock
        await write_ref(self.ctx, self.repo, full, b"", expect, pid_of(req), delete=True)

    async def rmdir(self, name: bytes, req: RequestContext) -> None:
        full = self._full(name)
        if self.ctx.refs.get(self.repo.id, full) is not None:
            fail(errno.ENOTDIR)
        await self._dir(full.rpartition("/")[2]).remove_tree_if_empty(exists_check=True)

    async def remove_tree_if_empty(self, exists_check: bool = False) -> None:
        """rmdir of this directory: ENOTEMPTY while a ref or a made directory is below."""
        prefix = self.ref + "/"
        made = self._made()
        if self.ctx.refs.has_below(self.repo.id, prefix) or any(d.startswith(prefix) for d in made):
            fail(errno.ENOTEMPTY)
        part = self.ref.rpartition("/")[2]
        parent = self.ref.rpartition("/")[0]
        always = self.ref == "refs" or (parent == "refs" and part in ("heads", "tags"))
        if exists_check and self.ref not in made and not always:
            fail(errno.ENOENT)
        made.discard(self.ref)  # refs/, heads/ and tags/ always come back (empty)

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, req: RequestContext
    ) -> None:
        full = self._full(name)
        lock = lock_of(self, self.repo, full[:-5]) if full.endswith(".lock") else None
        if lock is None or new_parent is not self or new_name != name[:-5] or flags:
            fail(errno.EPERM, f"{self.repo.id}: refs move only by `<ref>.lock` -> `<ref>`")
        await lock.commit(req)

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        def entries() -> Entries:
            prefix = self.ref + "/"
            dirs = set(self._always())
            for made in self._made():
                if made.startswith(prefix):
                    dirs.add(made[len(prefix) :].partition("/")[0])
            return [(d.encode(), self._dir(d)) for d in sorted(dirs)]

        await readdir_snapshot(dh, start, emit, entries)


class FixedRefDir(RefDir):
    """refs/, refs/heads and refs/tags: they exist as long as the repository does, so their
    entries are cached as long as the repository directory's (a second), which saves git
    a lookup per path walk."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ()
