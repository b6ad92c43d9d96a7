"""/repos: every repository as a bare git repository git reads directly.

/repos/<id>/
    HEAD        `ref: <target>\\n` (refs.head)
    config      a minimal bare config: no reflogs, no auto-gc or maintenance; git's own unpack
                limit, so a large push arrives as one pack, kept as a pack of the derived
                set or stored object by object when git moves it out (staging/ingest.py)
    packed-refs every ref, rendered from the refs (a generation per change of them)
    refs/       nested directories of ref files `<oid>\\n`; refs/heads and refs/tags always
    objects/    resolves `<xx>/<rest>` for every stored object of the repository's format
                (the loose files of /git/<format>, same inodes) but lists only `info/`
                (`alternates` naming MNT/git/<format>, where git enumerates) and `pack/`

Writes (daemon/staging/scratch.py keeps what is not yet stored):
- `mkdir /repos/<id>` creates a repository, `rmdir` deletes it once it holds no ref;
  HEAD, config and objects/ refuse unlink (EPERM).
- A ref file written with `<oid>\n` is a compare-and-swap against its value when
  opened (none for a new one): EINVAL for a malformed oid or one not in the store,
  EAGAIN when the ref moved meanwhile. The update is applied by the write that
  completes the line (so `echo` sees the errno), else at close. `rm` deletes.
- git's lockfile protocol: `<ref>.lock` is created exclusively (EEXIST while another
  exists), written, and renamed over `<ref>`: a CAS against the value at lock time.
  Unlinking the lock abandons it; unlinking a locked ref deletes it with a CAS against
  the lock's value (`git update-ref -d`). `HEAD` (and `HEAD.lock`) take
  `ref: refs/...\n`; `packed-refs.lock` rewrites packed-refs (a ref it leaves out is
  deleted); git gc's `gc.pid`, `gc.log` and their locks live in memory for the mount.
- Ref directories come and go with the refs below them; `mkdir` makes an empty one
  that lives in the daemon's memory until a ref lands below it or it is rmdir'ed.
- objects/ accepts git's loose-object writes and a push's quarantine directories
  (scratch, private to the repository); objects stored here are pinned until a ref
  write of the writing process commits in this repository (see staging/scratch.py).
- Every committed ref write releases the pins of its process in that repository.

HEAD, refs and the repository directory change, so their entries and attributes
expire after a second and ref contents are read with direct I/O; objects never
change, so everything under objects/ keeps long timeouts. `user.alkfs.object-format`
on a repository directory reads `sha1` or `sha256`, and can be set while the
repository holds no ref (ENOTEMPTY after). A repository's
directories carry its creation time in their identity: a repository deleted and
created again under the same id is a new directory.
"""

from __future__ import annotations

import errno
import logging
import stat
import time
from typing import TYPE_CHECKING, cast

from pyfuse3 import RequestContext

from alkfs.git.objects import FORMATS
from alkfs.git.refs import Repo, valid_repo_id

from ..errors import fail
from ..staging.writes import repo_key
from .base import DYNAMIC_TIMEOUT, FIRST_OFFSET, OBJECT_TIMEOUT, Dir, Emit, File, Node
from .handles import BytesHandle, DirHandle, Handle, wants_write
from .lfs import LfsDir
from .listing import Entries, readdir_snapshot, text_of
from .refdir import FixedRefDir, HeadFile, RefDir, RepoFile
from .refwrites import (
    GC_FILES,
    ROOT_LOCKS,
    ROOT_TARGET,
    LockFile,
    LockHandle,
    LockOld,
    drop_lock,
    lock_of,
    new_lock,
    plumbing_goes,
    render_packed,
)
from .repoobjects import RepoFanoutDir, RepoObjectsDir
from .reposview import ReposView

if TYPE_CHECKING:
    from ..context import Context

log = logging.getLogger("alkfsd")

# On /repos/<id>: the repository's object format. `mkdir` makes sha1 repositories; setting
# it to sha256 before any ref exists is how a sha256 repository is made through the mount.
FORMAT_XATTR = b"user.alkfs.object-format"

CONFIG = """\
[core]
\trepositoryformatversion = {version}
\tfilemode = true
\tbare = true
\tlogAllRefUpdates = false
{extensions}# Maintenance inside the mount is the daemon's: no auto-gc, no packing of refs (they
# are always listed in packed-refs here), no reflogs to expire, no commit-graph written
# into objects/info (the mount's derived graph is the one git reads).
[gc]
\tauto = 0
\tpackRefs = false
\treflogExpire = never
\treflogExpireUnreachable = never
\twriteCommitGraph = false
[maintenance]
\tauto = false
[receive]
\tautogc = false
"""


def configtext_of(object_format: str) -> bytes:
    """The repository's config: format version 1 with the objectformat extension for sha256."""
    if object_format == "sha256":
        return CONFIG.format(
            version=1, extensions="[extensions]\n\tobjectformat = sha256\n"
        ).encode()
    return CONFIG.format(version=0, extensions="").encode()


class ReposDir(Dir):
    """/repos: one directory per repository, in id order."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ("view",)

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("dir", "/repos"), parent, b"repos")
        self.view = ReposView()  # (this node lives as long as the mount: root.py)

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        repo_id = text_of(name)
        if repo_id is None or not valid_repo_id(repo_id):
            fail(errno.ENOENT)
        return RepoDir(self.ctx, self, self.ctx.refs.repo(repo_id))  # Missing: ENOENT

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        def entries() -> Entries:
            repos = self.ctx.refs.repos()
            return [(r.id.encode(), RepoDir(self.ctx, self, r)) for r in repos]

        await readdir_snapshot(dh, start, emit, entries)

    async def mkdir(self, name: bytes, mode: int, req: RequestContext) -> Node:
        repo_id = text_of(name)
        if repo_id is None or not valid_repo_id(repo_id):
            fail(errno.EINVAL, f"invalid repository id {name!r}")
        refs = self.ctx.refs
        repo = await self.ctx.run_sync(refs.create_repo, repo_id)  # Exists: EEXIST
        return RepoDir(self.ctx, self, repo)

    async def rmdir(self, name: bytes, req: RequestContext) -> None:
        repo_id = text_of(name)
        if repo_id is None or not valid_repo_id(repo_id):
            fail(errno.ENOENT)
        refs = self.ctx.refs
        repo = refs.repo(repo_id)  # Missing: ENOENT
        await self.ctx.run_sync(refs.delete_repo_if_empty, repo_id)  # NotEmpty: ENOTEMPTY
        self.ctx.writes.forget_repo(repo_key(repo))
        self.view.forget(repo_key(repo))


# Never created or replaced through the mount, by anyone, root included (EPERM): git runs
# what they say (hooks, config's core.fsmonitor, core.sshCommand, ...) as whoever runs git
# in the repository. config is the daemon's own minimal file; hooks/ and info/ do not exist.
NEVER_WRITTEN = frozenset({b"config", b"hooks", b"info"})


class RepoDir(Dir):
    """/repos/<id>: HEAD, config, objects/, refs/."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    never_written = NEVER_WRITTEN
    __slots__ = ("repo", "view")

    def __init__(self, ctx: Context, parent: ReposDir, repo: Repo) -> None:
        super().__init__(ctx, ("repo", repo.id, repo.created_ns), parent, repo.id.encode())
        self.repo = repo
        self.view = parent.view

    def mtime_ns(self) -> int:
        return self.repo.created_ns

    def _child(self, name: bytes) -> Node | None:
        if name == b"HEAD":
            return HeadFile(self.ctx, self)
        if name == b"packed-refs":
            return None  # built in lookup (a generation per change of the refs)
        if name == b"config":
            return ConfigFile(self.ctx, self)
        if name == b"objects":
            return RepoObjectsDir(self.ctx, self)
        if name == b"refs":
            return FixedRefDir(self.ctx, self, self.repo, "refs")
        if name == b"lfs":
            return LfsDir(self.ctx, self, self.repo)
        return None

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        if name == b"packed-refs":
            return await packed_refs_node(self)
        node = self._child(name) or lock_of(self, self.repo, ROOT_LOCKS.get(name))
        if node is None:
            fail(errno.ENOENT)
        return node

    # -- writes: HEAD.lock and packed-refs.lock; plumbing goes with the last ref ---------
    async def create(
        self, name: bytes, mode: int, flags: int, req: RequestContext
    ) -> tuple[Node, Handle]:
        ref = ROOT_LOCKS.get(name)
        if ref is None:
            fail(
                errno.EPERM,
                f"{self.path}: only HEAD.lock, packed-refs.lock and gc files can be made",
            )
        old: LockOld = None
        if ref.startswith("packed-refs"):
            # git's rewrite deletes what it leaves out of the snapshot taken at lock time
            lock = lock_of(self, self.repo, "packed-refs")
            if lock is not None and isinstance(lock.old, dict):
                old = lock.old
            else:
                old = await self.ctx.run_sync(self.ctx.refs.refs, self.repo.id)
        node = new_lock(self, self.repo, ref, name, old)
        return node, LockHandle(node)

    async def unlink(self, name: bytes, req: RequestContext) -> None:
        if drop_lock(self.ctx, self.repo, ROOT_LOCKS.get(name)):
            return
        if name == b"packed-refs":
            # Every ref is listed there (and nowhere else): as in any git repository whose
            # refs are packed, removing the file removes them. `rm -r` of the repository
            # meets it first.
            n = await self.ctx.run_sync(self.ctx.refs.delete_all_refs, self.repo.id)
            log.info("%s: packed-refs removed: %d ref(s) deleted", self.repo.id, n)
            return
        if name in (b"HEAD", b"config"):
            await plumbing_goes(self, name)
            return
        await super().unlink(name, req)  # objects, refs: EISDIR

    async def rmdir(self, name: bytes, req: RequestContext) -> None:
        if name == b"refs":
            await RefDir(self.ctx, self, self.repo, "refs").remove_tree_if_empty()
            return
        if name == b"objects":
            await plumbing_goes(self, name)
            return
        await super().rmdir(name, req)

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, req: RequestContext
    ) -> None:
        if name in GC_FILES and new_name in GC_FILES and new_parent is self:
            _move_gc_file(self, name, new_name)
            return
        ref = ROOT_LOCKS.get(name)
        lock = lock_of(self, self.repo, ref)
        if lock is None or new_parent is not self or new_name != ROOT_TARGET.get(name):
            await super().rename(name, new_parent, new_name, flags, req)
            return
        await lock.commit(req)

    # -- extended attributes: the object format (settable while no ref exists) ----------
    async def getxattr(self, name: bytes, req: RequestContext) -> bytes:
        if name != FORMAT_XATTR:
            fail(errno.ENODATA)
        return self.repo.object_format.encode()

    async def listxattr(self, req: RequestContext) -> list[bytes]:
        return [FORMAT_XATTR]

    async def setxattr(self, name: bytes, value: bytes, req: RequestContext) -> None:
        if name != FORMAT_XATTR:
            fail(errno.ENOTSUP, f"no settable attribute {name!r}")
        fmt = text_of(value)
        if fmt not in FORMATS:
            fail(errno.EINVAL, f"{value!r} is not an object format (sha1, sha256)")
        refs = self.ctx.refs
        this = repo_key(self.repo)
        # NotEmpty (ENOTEMPTY) once a ref exists; Missing (ENOENT) if removed meanwhile
        new = await self.ctx.run_sync(refs.set_object_format, self.repo.id, fmt)

        def ours(node: Node) -> bool:
            repo = getattr(node, "repo", None)
            return isinstance(repo, Repo) and repo_key(repo) == this

        # Every node of this repository the kernel holds (config, refs/, objects/ and its
        # fan-outs) takes the new format now. Rare (an empty repository), so a scan.
        for node in self.ctx.inodes.nodes():
            if isinstance(node, RepoFanoutDir) and node.parent is not None and ours(node.parent):
                node.algo = new.algo
            if ours(node):
                node.repo = new  # type: ignore[attr-defined]
        self.repo = new
        if self.ino:  # fan-outs the kernel resolved under the old format go
            self.ctx.invalidator.submit(self.ino, b"objects", 0)

    async def removexattr(self, name: bytes, req: RequestContext) -> None:
        if name != FORMAT_XATTR:
            fail(errno.ENODATA)
        fail(errno.EPERM, "a repository always has an object format")

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        # The refs come first (packed-refs, then refs/), the plumbing after: `rm -r` unlinks
        # in this order, and the plumbing stops refusing once the refs are gone.
        if start < FIRST_OFFSET or "entries" not in dh.state:
            packed = await packed_refs_node(self)
            out: Entries = [(b"packed-refs", packed)]
            for name in (b"refs", b"HEAD", b"config", b"objects"):  # (lfs/ resolves, unlisted)
                node = self._child(name)
                assert node is not None
                out.append((name, node))
            dh.state["entries"] = out
        await readdir_snapshot(dh, start, emit, lambda: cast(Entries, dh.state["entries"]))


class ConfigFile(RepoFile):
    __slots__ = ()

    def __init__(self, ctx: Context, parent: RepoDir) -> None:
        repo = parent.repo
        super().__init__(ctx, ("repo-config", repo.id, repo.created_ns), parent, b"config", repo)

    def content(self) -> bytes:
        return configtext_of(self.repo.object_format)


class PackedRefsFile(File):
    """/repos/<id>/packed-refs: every ref of the repository in git's packed format (sorted,
    fully peeled: every ref to an annotated tag carries the id it peels to, so git never
    reads an object to learn that a ref is not a tag). Each generation is its own inode with fixed
    content, so a file git opened (or mmapped) never changes under it; the entry is never
    cached, so the next lookup after a ref moved finds the new generation."""

    entry_timeout = 0.0
    attr_timeout = OBJECT_TIMEOUT
    __slots__ = ("repo", "data", "made_ns")

    def __init__(
        self, ctx: Context, parent: Node, repo: Repo, version: int, data: bytes, made_ns: int
    ) -> None:
        ident = ("packed-refs", repo.id, repo.created_ns, version, made_ns)
        super().__init__(ctx, ident, parent, b"packed-refs")
        self.repo = repo
        self.data = data
        self.made_ns = made_ns

    def mode(self) -> int:
        return stat.S_IFREG | 0o444

    def size(self) -> int:
        return len(self.data)

    def mtime_ns(self) -> int:
        return self.made_ns

    async def open(self, flags: int, req: RequestContext) -> Handle:
        if wants_write(flags):
            fail(errno.EPERM, f"{self.path}: git rewrites it through packed-refs.lock")
        h = BytesHandle(self, self.data)
        h.keep_cache = True
        return h


async def packed_refs_node(repo_dir: RepoDir) -> PackedRefsFile:
    """The current generation of the repository's packed-refs (built in a worker thread
    when a ref moved since the last one)."""
    ctx, repo, kept = repo_dir.ctx, repo_dir.repo, repo_dir.view.packed_refs
    k = repo_key(repo)
    cached = kept.get(k)
    if cached is None or cached[0] != ctx.refs.version(repo.id):

        def build() -> tuple[int, bytes, int]:
            version, rows = ctx.refs.packed(repo.id)  # Missing: ENOENT
            return version, render_packed(rows), time.time_ns()

        cached = await ctx.run_sync(build)
        prev = kept.get(k)
        if prev is None or prev[0] <= cached[0]:
            kept[k] = cached
    version, data, made_ns = cached
    return PackedRefsFile(ctx, repo_dir, repo, version, data, made_ns)


def _move_gc_file(repo_dir: RepoDir, name: bytes, new_name: bytes) -> None:
    """rename of one gc file over another (git's gc.pid.lock -> gc.pid)."""
    w = repo_dir.ctx.writes
    k = repo_key(repo_dir.repo)
    node = w.locks.pop((k, name.decode()), None)
    if not isinstance(node, LockFile):
        fail(errno.ENOENT)
    node.ref = new_name.decode()
    node.name = new_name
    w.locks[(k, node.ref)] = node
