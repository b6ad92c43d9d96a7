"""/repos: every repository as a bare git repository git reads directly.

/repos/<id>/
    HEAD        `ref: <target>\\n` (refs.head)
    config      a minimal bare config: no reflogs, no auto-gc or maintenance, pushes unpacked
    refs/       nested directories of ref files `<oid>\\n`; refs/heads and refs/tags always
    objects/    resolves `<xx>/<rest>` for every stored object of the repository's format
                (the loose files of /git/<format>, same inodes) but lists only `info/`
                (`alternates` naming MNT/git/<format>, where git enumerates) and `pack/`

HEAD, refs and the repository directory change, so their entries and attributes
expire after a second and ref contents are read with direct I/O; objects never
change, so everything under objects/ keeps long timeouts. A repository's
directories carry its creation time in their identity: a repository deleted and
created again under the same id is a new directory.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from alkfs.git.refs import Repo, valid_repo_id

from ..context import DYNAMIC_TIMEOUT
from ..errors import fail
from .base import FIRST_OFFSET, BytesHandle, Dir, DirHandle, Emit, File, Handle, Node, wants_write
from .gitview import FANOUT, EmptyDir, FanoutDir, repo_fanout_ident

if TYPE_CHECKING:
    from ..context import Context

Entries = list[tuple[bytes, Node]]

CONFIG = """\
[core]
\trepositoryformatversion = {version}
\tfilemode = true
\tbare = true
\tlogAllRefUpdates = false
{extensions}[gc]
\tauto = 0
[maintenance]
\tauto = false
[receive]
\tunpackLimit = 100000
\tautogc = false
[transfer]
\tunpackLimit = 100000
"""


def config_text(object_format: str) -> bytes:
    """The repository's config: format version 1 with the objectformat extension for sha256."""
    if object_format == "sha256":
        return CONFIG.format(
            version=1, extensions="[extensions]\n\tobjectformat = sha256\n"
        ).encode()
    return CONFIG.format(version=0, extensions="").encode()


async def readdir_snapshot(
    dh: DirHandle, start: int, emit: Emit, entries: Callable[[], Entries]
) -> None:
    """List a small changing directory: the entries are taken once per open directory
    (when listing starts), so offsets (index + FIRST_OFFSET) stay stable for it."""
    if start < FIRST_OFFSET or "entries" not in dh.state:
        dh.state["entries"] = entries()
    listed: Entries = dh.state["entries"]
    first = 0 if start < FIRST_OFFSET else start - FIRST_OFFSET + 1
    for i in range(first, len(listed)):
        name, node = listed[i]
        if not emit(name, node, i + FIRST_OFFSET):
            return


def _text(name: bytes) -> str | None:
    try:
        return name.decode("utf-8")
    except UnicodeDecodeError:
        return None


class ReposDir(Dir):
    """/repos: one directory per repository, in id order."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("dir", "/repos"), parent, b"repos")

    def _refs(self) -> Any:
        refs = self.ctx.refs
        if refs is None:
            fail(errno.ENOENT, "repositories are not available")
        return refs

    async def lookup(self, name: bytes, ctx: Any) -> Node:
        repo_id = _text(name)
        if repo_id is None or not valid_repo_id(repo_id):
            fail(errno.ENOENT)
        return RepoDir(self.ctx, self, self._refs().repo(repo_id))  # Missing: ENOENT

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        def entries() -> Entries:
            refs = self.ctx.refs
            repos = refs.repos() if refs is not None else []
            return [(r.id.encode(), RepoDir(self.ctx, self, r)) for r in repos]

        await readdir_snapshot(dh, start, emit, entries)


class RepoDir(Dir):
    """/repos/<id>: HEAD, config, objects/, refs/."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ("repo",)

    def __init__(self, ctx: Context, parent: Node, repo: Repo) -> None:
        super().__init__(ctx, ("repo", repo.id, repo.created_ns), parent, repo.id.encode())
        self.repo = repo

    def mtime_ns(self) -> int:
        return self.repo.created_ns

    def _child(self, name: bytes) -> Node | None:
        if name == b"HEAD":
            return HeadFile(self.ctx, self)
        if name == b"config":
            return ConfigFile(self.ctx, self)
        if name == b"objects":
            return RepoObjectsDir(self.ctx, self)
        if name == b"refs":
            return RefDir(self.ctx, self, self.repo, "refs")
        return None

    async def lookup(self, name: bytes, ctx: Any) -> Node:
        node = self._child(name)
        if node is None:
            fail(errno.ENOENT)
        return node

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        def entries() -> Entries:
            out = []
            for name in (b"HEAD", b"config", b"objects", b"refs"):
                node = self._child(name)
                assert node is not None
                out.append((name, node))
            return out

        await readdir_snapshot(dh, start, emit, entries)


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

    async def getattr(self, ctx: Any) -> Any:
        self.data = self.content()
        return self.attr()

    async def open(self, flags: int, ctx: Any) -> Handle:
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


class ConfigFile(RepoFile):
    __slots__ = ()

    def __init__(self, ctx: Context, parent: RepoDir) -> None:
        repo = parent.repo
        super().__init__(ctx, ("repo-config", repo.id, repo.created_ns), parent, b"config", repo)

    def content(self) -> bytes:
        return config_text(self.repo.object_format)


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


class RefDir(Dir):
    """/repos/<id>/refs[/...]: one level of the ref namespace (refs/heads and refs/tags
    always exist)."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ("repo", "ref")

    def __init__(self, ctx: Context, parent: Node, repo: Repo, ref: str) -> None:
        name = ref.rpartition("/")[2].encode()
        super().__init__(ctx, ("refdir", repo.id, repo.created_ns, ref), parent, name)
        self.repo = repo
        self.ref = ref

    def _always(self) -> tuple[str, ...]:
        return ("heads", "tags") if self.ref == "refs" else ()

    def _dir(self, name: str) -> RefDir:
        return RefDir(self.ctx, self, self.repo, f"{self.ref}/{name}")

    async def lookup(self, name: bytes, ctx: Any) -> Node:
        part = _text(name)
        if not part or "/" in part or part in (".", ".."):
            fail(errno.ENOENT)
        full = f"{self.ref}/{part}"
        refs = self.ctx.refs
        oid = refs.get(self.repo.id, full)  # Missing (no repository): ENOENT
        if oid is not None:
            return RefFile(self.ctx, self, self.repo, full, oid)
        if part in self._always() or refs.refs(self.repo.id, full + "/"):
            return self._dir(part)
        fail(errno.ENOENT)

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        def entries() -> Entries:
            prefix = self.ref + "/"
            files: dict[str, Node] = {}
            dirs = set(self._always())
            for full, oid in self.ctx.refs.refs(self.repo.id, prefix).items():
                part, sep, _ = full[len(prefix) :].partition("/")
                if sep:
                    dirs.add(part)
                else:
                    files[part] = RefFile(self.ctx, self, self.repo, full, oid)
            out: Entries = [(d.encode(), self._dir(d)) for d in dirs if d not in files]
            out += [(f.encode(), node) for f, node in files.items()]
            out.sort(key=lambda e: e[0])
            return out

        await readdir_snapshot(dh, start, emit, entries)


class RepoObjectsDir(Dir):
    """/repos/<id>/objects: resolves <xx>/<rest>, lists only info/ and pack/."""

    __slots__ = ("repo",)

    def __init__(self, ctx: Context, parent: RepoDir) -> None:
        repo = parent.repo
        super().__init__(ctx, ("repo-objects", repo.id, repo.created_ns), parent, b"objects")
        self.repo = repo

    def _child(self, name: bytes) -> Node | None:
        repo = self.repo
        if name == b"info":
            return RepoInfoDir(self.ctx, self)
        if name == b"pack":
            return EmptyDir(self.ctx, ("repo-pack", repo.id, repo.created_ns), self, b"pack")
        if name in _FANOUT:
            return RepoFanoutDir(self.ctx, self, name)
        return None

    async def lookup(self, name: bytes, ctx: Any) -> Node:
        node = self._child(name)
        if node is None:
            fail(errno.ENOENT)
        return node

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        def entries() -> Entries:
            return [(n, node) for n in (b"info", b"pack") if (node := self._child(n)) is not None]

        await readdir_snapshot(dh, start, emit, entries)


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


class RepoInfoDir(Dir):
    """/repos/<id>/objects/info: `alternates` only."""

    __slots__ = ("repo",)

    def __init__(self, ctx: Context, parent: RepoObjectsDir) -> None:
        repo = parent.repo
        super().__init__(ctx, ("repo-info", repo.id, repo.created_ns), parent, b"info")
        self.repo = repo

    async def lookup(self, name: bytes, ctx: Any) -> Node:
        if name != b"alternates":
            fail(errno.ENOENT)
        return AlternatesFile(self.ctx, self)

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

    async def open(self, flags: int, ctx: Any) -> Handle:
        if wants_write(flags):
            fail(errno.EPERM, f"{self.path} is read-only")
        return BytesHandle(self, self.data)
