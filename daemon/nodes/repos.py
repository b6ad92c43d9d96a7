"""/repos: every repository as a bare git repository git reads directly.

/repos/<id>/
    HEAD        `ref: <target>\\n` (refs.head)
    config      a minimal bare config: no reflogs, no auto-gc or maintenance; git's own unpack
                limit, so a large push arrives as one pack that lives only in its
                quarantine and is stored object by object when git moves it out
    refs/       nested directories of ref files `<oid>\\n`; refs/heads and refs/tags always
    objects/    resolves `<xx>/<rest>` for every stored object of the repository's format
                (the loose files of /git/<format>, same inodes) but lists only `info/`
                (`alternates` naming MNT/git/<format>, where git enumerates) and `pack/`

Writes (daemon/scratch.py keeps what is not yet stored):
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
  `ref: refs/...\n`; `packed-refs.lock` may be made and removed (there is never a
  packed-refs file: deletions go ref by ref).
- Ref directories come and go with the refs below them; `mkdir` makes an empty one
  that lives in the daemon's memory until a ref lands below it or it is rmdir'ed.
- objects/ accepts git's loose-object writes and a push's quarantine directories
  (scratch, private to the repository); objects stored here are pinned until a ref
  write of the writing process commits in this repository (see scratch.py).
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
import os
import stat
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from alkfs.git.objects import FORMATS
from alkfs.git.refs import (
    ANY,
    LOST_RACE,
    MAX_REF_NAME,
    RefUpdate,
    Refusal,
    Repo,
    valid_ref_name,
    valid_repo_id,
)
from alkfs.keys import is_hex

from .. import scratch
from ..context import DYNAMIC_TIMEOUT, OBJECT_TIMEOUT
from ..errors import fail
from .base import (
    FIRST_OFFSET,
    BytesHandle,
    Dir,
    DirHandle,
    Emit,
    File,
    Handle,
    Node,
    wants_write,
)
from .gitview import FANOUT, FanoutDir, repo_fanout_ident

if TYPE_CHECKING:
    from ..context import Context

log = logging.getLogger("alkfsd")

Entries = list[tuple[bytes, Node]]

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

    async def mkdir(self, name: bytes, mode: int, ctx: Any) -> Node:
        repo_id = _text(name)
        if repo_id is None or not valid_repo_id(repo_id):
            fail(errno.EINVAL, f"invalid repository id {name!r}")
        refs = self._refs()
        repo = await self.ctx.run_sync(refs.create_repo, repo_id)  # Exists: EEXIST
        return RepoDir(self.ctx, self, repo)

    async def rmdir(self, name: bytes, ctx: Any) -> None:
        repo_id = _text(name)
        if repo_id is None or not valid_repo_id(repo_id):
            fail(errno.ENOENT)
        refs = self._refs()
        repo = refs.repo(repo_id)  # Missing: ENOENT
        await self.ctx.run_sync(refs.delete_repo_if_empty, repo_id)  # NotEmpty: ENOTEMPTY
        scratch.writes(self.ctx).forget_repo(repo_key(repo))


# Never created or replaced through the mount, by anyone, root included (EPERM): git runs
# what they say (hooks, config's core.fsmonitor, core.sshCommand, ...) as whoever runs git
# in the repository. config is the daemon's own minimal file; hooks/ and info/ do not exist.
NEVER_WRITTEN = frozenset({b"config", b"hooks", b"info"})


class RepoDir(Dir):
    """/repos/<id>: HEAD, config, objects/, refs/."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    never_written = NEVER_WRITTEN
    __slots__ = ("repo",)

    def __init__(self, ctx: Context, parent: Node, repo: Repo) -> None:
        super().__init__(ctx, ("repo", repo.id, repo.created_ns), parent, repo.id.encode())
        self.repo = repo

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
        return None

    async def lookup(self, name: bytes, ctx: Any) -> Node:
        if name == b"packed-refs":
            return await packed_refs_node(self)
        node = self._child(name) or _lock_of(self, self.repo, _ROOT_LOCKS.get(name))
        if node is None:
            fail(errno.ENOENT)
        return node

    # -- writes: HEAD.lock and packed-refs.lock; plumbing goes with the last ref ---------
    async def create(self, name: bytes, mode: int, flags: int, ctx: Any) -> tuple[Node, Handle]:
        ref = _ROOT_LOCKS.get(name)
        if ref is None:
            fail(errno.EPERM, f"{self.path}: only HEAD.lock and packed-refs.lock can be made")
        old: Any = None
        if ref.startswith("packed-refs"):
            # git's rewrite deletes what it leaves out of the snapshot taken at lock time
            lock = _lock_of(self, self.repo, "packed-refs")
            if lock is not None and isinstance(lock.old, dict):
                old = lock.old
            else:
                old = await self.ctx.run_sync(self.ctx.refs.refs, self.repo.id)
        node = _new_lock(self, self.repo, ref, name, old)
        return node, LockHandle(node)

    async def unlink(self, name: bytes, ctx: Any) -> None:
        if _drop_lock(self.ctx, self.repo, _ROOT_LOCKS.get(name)):
            return
        if name == b"packed-refs":
            # Every ref is listed there (and nowhere else): as in any git repository whose
            # refs are packed, removing the file removes them. `rm -r` of the repository
            # meets it first.
            n = await self.ctx.run_sync(self.ctx.refs.delete_all_refs, self.repo.id)
            log.info("%s: packed-refs removed: %d ref(s) deleted", self.repo.id, n)
            return
        if name in (b"HEAD", b"config"):
            await _plumbing_goes(self, name)
            return
        await super().unlink(name, ctx)  # objects, refs: EISDIR

    async def rmdir(self, name: bytes, ctx: Any) -> None:
        if name == b"refs":
            await RefDir(self.ctx, self, self.repo, "refs").remove_tree_if_empty()
            return
        if name == b"objects":
            await _plumbing_goes(self, name)
            return
        await super().rmdir(name, ctx)

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, ctx: Any
    ) -> None:
        if name in GC_FILES and new_name in GC_FILES and new_parent is self:
            _move_gc_file(self, name, new_name)
            return
        ref = _ROOT_LOCKS.get(name)
        lock = _lock_of(self, self.repo, ref)
        if lock is None or new_parent is not self or new_name != _ROOT_TARGET.get(name):
            await super().rename(name, new_parent, new_name, flags, ctx)
            return
        await lock.commit(ctx)

    # -- extended attributes: the object format (settable while no ref exists) ----------
    async def getxattr(self, name: bytes, ctx: Any) -> bytes:
        if name != FORMAT_XATTR:
            fail(errno.ENODATA)
        return self.repo.object_format.encode()

    async def listxattr(self, ctx: Any) -> list[bytes]:
        return [FORMAT_XATTR]

    async def setxattr(self, name: bytes, value: bytes, ctx: Any) -> None:
        if name != FORMAT_XATTR:
            fail(errno.ENOTSUP, f"no settable attribute {name!r}")
        fmt = _text(value)
        if fmt not in FORMATS:
            fail(errno.EINVAL, f"{value!r} is not an object format (sha1, sha256)")
        refs = self.ctx.refs
        assert refs is not None
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

    async def removexattr(self, name: bytes, ctx: Any) -> None:
        if name != FORMAT_XATTR:
            fail(errno.ENODATA)
        fail(errno.EPERM, "a repository always has an object format")

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        # The refs come first (packed-refs, then refs/), the plumbing after: `rm -r` unlinks
        # in this order, and the plumbing stops refusing once the refs are gone.
        if start < FIRST_OFFSET or "entries" not in dh.state:
            packed = await packed_refs_node(self)
            out: Entries = [(b"packed-refs", packed)]
            for name in (b"refs", b"HEAD", b"config", b"objects"):
                node = self._child(name)
                assert node is not None
                out.append((name, node))
            dh.state["entries"] = out
        await readdir_snapshot(dh, start, emit, lambda: dh.state["entries"])


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

    async def open(self, flags: int, ctx: Any) -> Handle:
        if wants_write(flags):
            shown = b"" if flags & os.O_TRUNC else self.content()
            return RefWriteHandle(self, self.repo, "HEAD", None, scratch.pid_of(ctx), shown)
        return await super().open(flags, ctx)

    async def setattr(self, attr: Any, fields: Any, handle: Handle | None, ctx: Any) -> Any:
        return _truncate_only(self, fields, handle)


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

    async def open(self, flags: int, ctx: Any) -> Handle:
        if wants_write(flags):
            old = self.ctx.refs.get(self.repo.id, self.ref)
            shown = b"" if flags & os.O_TRUNC or old is None else f"{old}\n".encode()
            return RefWriteHandle(self, self.repo, self.ref, old, scratch.pid_of(ctx), shown)
        return await super().open(flags, ctx)

    async def setattr(self, attr: Any, fields: Any, handle: Handle | None, ctx: Any) -> Any:
        return _truncate_only(self, fields, handle)


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


def _truncate_only(node: RepoFile, fields: Any, handle: Handle | None) -> Any:
    """O_TRUNC of an open ref or HEAD and touch: accepted (the next write replaces it
    whole). A truncate by path (no open handle) would leave an empty ref: EINVAL."""
    if fields.update_mode or fields.update_uid or fields.update_gid:
        fail(errno.EPERM, f"{node.path}: its mode and owner cannot be changed")
    if fields.update_size and not isinstance(handle, RefWriteHandle):
        fail(errno.EINVAL, f"{node.path}: a ref changes only by writing a new value into it")
    if fields.update_size and isinstance(handle, RefWriteHandle):
        del handle.buf[0:]
        handle.shown = None
    return node.attr()


async def _plumbing_goes(node: Any, name: bytes) -> None:
    """unlink/rmdir of the plumbing (HEAD, config, objects/ and objects/info/alternates,
    info/, pack/): EPERM while the repository holds refs; once they are gone it succeeds
    and changes nothing (`rm -r` of the repository then reaches its `rmdir`, which deletes
    it). `node` is the directory holding `name` (it has `.repo`)."""
    refs = node.ctx.refs
    if await node.ctx.run_sync(refs.has_below, node.repo.id, "refs/"):
        fail(errno.EPERM, f"{node.path}/{name.decode()}: the repository still has refs")


def repo_key(repo: Repo) -> scratch.RepoKey:
    return (repo.id, repo.created_ns)


# -- packed-refs: every ref, in a new file per generation ----------------------------------
PACKED_HEADER = b"# pack-refs with: peeled fully-peeled sorted \n"
QUOTE = 80  # characters of a refused value quoted in a log line


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

    async def open(self, flags: int, ctx: Any) -> Handle:
        if wants_write(flags):
            fail(errno.EPERM, f"{self.path}: git rewrites it through packed-refs.lock")
        h = BytesHandle(self, self.data)
        h.keep_cache = True
        return h


def render_packed(rows: list[tuple[str, str, str | None]]) -> bytes:
    out = [PACKED_HEADER]
    for name, oid, peeled in rows:
        out.append(f"{oid} {name}\n".encode())
        if peeled is not None:
            out.append(f"^{peeled}\n".encode())
    return b"".join(out)


async def packed_refs_node(repo_dir: RepoDir) -> PackedRefsFile:
    """The current generation of the repository's packed-refs (built in a worker thread
    when a ref moved since the last one)."""
    ctx, repo = repo_dir.ctx, repo_dir.repo
    k = repo_key(repo)
    cached = ctx.packed_refs.get(k)
    if cached is None or cached[0] != ctx.refs.version(repo.id):

        def build() -> tuple[int, bytes, int]:
            version, rows = ctx.refs.packed(repo.id)  # Missing: ENOENT
            return version, render_packed(rows), time.time_ns()

        cached = await ctx.run_sync(build)
        prev = ctx.packed_refs.get(k)
        if prev is None or prev[0] <= cached[0]:
            ctx.packed_refs[k] = cached
    version, data, made_ns = cached
    return PackedRefsFile(ctx, repo_dir, repo, version, data, made_ns)


def parse_packed(data: bytes) -> dict[str, str]:
    """name -> oid of a packed-refs file git wrote (EINVAL if it is not one)."""
    out: dict[str, str] = {}
    for n, line in enumerate(data.split(b"\n")):
        if not line or line.startswith(b"#") or line.startswith(b"^"):
            continue
        if len(line) > MAX_REF_NAME + 80:
            fail(errno.EINVAL, f"packed-refs: line {n + 1} is too long ({len(line)} bytes)")
        oid, sep, name = line.partition(b" ")
        text = _text(name)
        if not sep or text is None or not is_hex(oid.decode("ascii", "replace"), len(oid)):
            fail(errno.EINVAL, f"packed-refs: line {n + 1} is not `<oid> <ref>`: {line[:QUOTE]!r}")
        out[text] = oid.decode("ascii")
    return out


# -- ref writes -----------------------------------------------------------------------------
# The files git makes in a repository's top directory to change HEAD or packed-refs: the
# name -> the key its in-memory file is held under. git 2.39 holds `packed-refs.lock` and
# writes the new content into `packed-refs.new`, which it renames over `packed-refs`.
_ROOT_LOCKS = {
    b"HEAD.lock": "HEAD",
    b"packed-refs.lock": "packed-refs",
    b"packed-refs.new": "packed-refs.new",
}
# `git gc` keeps its pid (and a log of a failed detached run) in the top directory: small
# in-memory files that live as long as the mount, like the locks. Nothing else is written.
GC_FILES = frozenset({b"gc.pid", b"gc.pid.lock", b"gc.log", b"gc.log.lock"})
_ROOT_LOCKS.update({n: n.decode() for n in GC_FILES})
_ROOT_TARGET = {
    b"HEAD.lock": b"HEAD",
    b"packed-refs.lock": b"packed-refs",
    b"packed-refs.new": b"packed-refs",
}
REF_LINE_MAX = 256  # bytes a ref file (or its lock) takes: `<64 hex>\n` and some slack
HEAD_LINE_MAX = len("ref: \n") + MAX_REF_NAME


def line_cap(ref: str, old: Any) -> int:
    """How many bytes a write handle of `ref` takes (EINVAL / ENAMETOOLONG beyond)."""
    if ref == "HEAD":
        return HEAD_LINE_MAX
    if ref.startswith("gc."):
        return 4096
    if ref.startswith("packed-refs"):  # git rewrites it whole: bounded per line of the snapshot
        n = len(old) if isinstance(old, dict) else 0
        return (n + 64) * (MAX_REF_NAME + 2 * 66 + 4)
    return REF_LINE_MAX


def refuse_long(ref: str, path: str, end: int, cap: int) -> None:
    """A write reaching byte `end` of a file that takes `cap`: HEAD's is a ref name
    (ENAMETOOLONG), packed-refs' a file (EFBIG), any other an invalid value (EINVAL)."""
    if end <= cap:
        return
    if ref == "HEAD":
        code = errno.ENAMETOOLONG
    elif ref.startswith("packed-refs"):
        code = errno.EFBIG
    else:
        code = errno.EINVAL
    fail(code, f"{path}: {end} bytes; this file takes at most {cap}")


async def write_ref(
    ctx: Context, repo: Repo, ref: str, data: bytes, old: Any, pid: int, *, delete: bool = False
) -> None:
    """Apply `data` (`<oid>\n`, or `ref: <target>\n` for HEAD) to `ref` with a CAS against
    `old` (None: must not exist; ANY: whatever). EINVAL for bad content or a missing
    object, EAGAIN for a lost race. A committed write releases the writer's pins."""
    refs = ctx.refs
    if ref == "HEAD":  # (its write handles took at most HEAD_LINE_MAX bytes)
        text = data.decode("utf-8", "replace")
        if not text.startswith("ref: ") or text.count("\n") != 1 or not text.endswith("\n"):
            fail(errno.EINVAL, f"{repo.id}: HEAD takes `ref: refs/...`, not {text[:QUOTE]!r}")
        await ctx.run_sync(refs.set_head, repo.id, text[5:-1])  # Invalid: EINVAL
        return
    if ref in ("packed-refs", "packed-refs.new"):
        await rewrite_packed(ctx, repo, data, old)
        return
    if delete:
        new = None
    else:
        text = data.decode("ascii", "replace")
        oid = text[:-1] if text.endswith("\n") else text
        if not is_hex(oid, repo.algo.hex_len):
            what = f"{text[:QUOTE]!r}"
            fail(errno.EINVAL, f"{repo.id}: {ref}: {what} is not a {repo.object_format} id")
        new = oid
    updates = [RefUpdate(ref, new, old)]
    outcome = (
        await ctx.run_sync(lambda: refs.update(repo.id, updates, True, heads_are_commits=True))
    )[0]
    if not outcome.ok:
        code = errno.EAGAIN if outcome.reason in LOST_RACE else errno.EINVAL
        if delete and outcome.reason == Refusal.MISSING_REF:
            code = errno.ENOENT
        fail(code, f"{repo.id}: {ref}: {outcome.reason}")
    w = scratch.writes(ctx)
    w.committed(repo_key(repo), pid)
    dirs = w.ref_dirs.get(repo_key(repo))
    if dirs and not delete:
        dirs.difference_update([d for d in dirs if ref.startswith(d + "/")])


async def rewrite_packed(ctx: Context, repo: Repo, data: bytes, snapshot: Any) -> None:
    """git's rename of packed-refs.lock over packed-refs: the refs of the lock-time
    snapshot that the new file leaves out are deleted, all or none, each only if it still
    holds its snapshot value (EAGAIN otherwise: the rewrite lost a race and nothing
    changes). Nothing else changes: a ref the file lists keeps its current value."""
    listed = parse_packed(data)
    before: dict[str, str] = snapshot if isinstance(snapshot, dict) else {}
    gone = [RefUpdate(name, None, oid) for name, oid in before.items() if name not in listed]
    for _ in range(2):
        if not gone:
            return
        outcomes = await ctx.run_sync(ctx.refs.update, repo.id, gone, True)
        bad = [o for o in outcomes if not o.ok and o.reason != Refusal.ATOMIC_SIBLING_FAILED]
        if not bad:
            log.info("%s: packed-refs rewrite deleted %d ref(s)", repo.id, len(gone))
            return
        # a ref someone else deleted meanwhile is as the rewrite wants it: retry without
        if any(o.reason != Refusal.MISSING_REF for o in bad):
            break
        missing = {o.name for o in bad}
        gone = [u for u in gone if u.name not in missing]
    fail(errno.EAGAIN, f"{repo.id}: packed-refs rewrite: {bad[0].name}: {bad[0].reason}")


class RefWriteHandle(Handle):
    """An open ref (or HEAD) for writing: the line is applied as one CAS against the value
    at open, by the write that completes it (else at flush). Until something is written
    (or it is truncated), a read gives the value at open, as a file opened O_RDWR would."""

    direct_io = True

    def __init__(
        self, node: RepoFile, repo: Repo, ref: str, old: str | None, pid: int, shown: bytes = b""
    ) -> None:
        super().__init__(node)
        self.repo = repo
        self.ref = ref
        self.old = old if ref != "HEAD" else ANY
        self.pid = pid
        self.buf = bytearray()
        self.shown: bytes | None = shown  # the value at open, until written or truncated
        self.applied = False

    async def read(self, off: int, size: int) -> bytes:
        if self.shown is not None:
            return self.shown[off : off + size]
        return bytes(self.buf[off : off + size])

    async def write(self, off: int, buf: bytes) -> int:
        if self.applied:
            fail(errno.EINVAL, f"{self.node.path}: one line per open")
        end = off + len(buf)
        refuse_long(self.ref, self.node.path, end, line_cap(self.ref, None))
        self.shown = None
        if len(self.buf) < end:
            self.buf.extend(bytes(end - len(self.buf)))
        self.buf[off:end] = buf
        if b"\n" in buf:
            await self.apply()
        return len(buf)

    async def apply(self) -> None:
        self.applied = True
        await write_ref(self.node.ctx, self.repo, self.ref, bytes(self.buf), self.old, self.pid)

    async def flush(self) -> None:
        if not self.applied and self.buf:
            await self.apply()


class LockFile(File):
    """git's `<ref>.lock`: written in memory, applied by the rename over `<ref>` as a CAS
    against the ref's value when the lock was made. Each lock is an inode of its own whose
    entry is never cached: after the rename the kernel shows it under the ref's name, and
    the next path walk must find the ref itself."""

    entry_timeout = 0.0
    attr_timeout = 0.0
    __slots__ = ("repo", "ref", "old", "buf", "made_ns")

    def __init__(
        self, ctx: Context, parent: Node, repo: Repo, ref: str, name: bytes, old: Any
    ) -> None:
        serial = scratch.writes(ctx).area.next_serial()
        super().__init__(ctx, ("reflock", repo.id, repo.created_ns, ref, serial), parent, name)
        self.repo = repo
        self.ref = ref
        self.old = old
        self.buf = bytearray()
        self.made_ns = time.time_ns()

    def mode(self) -> int:
        return stat.S_IFREG | 0o644

    def size(self) -> int:
        return len(self.buf)

    def mtime_ns(self) -> int:
        return self.made_ns

    async def open(self, flags: int, ctx: Any) -> Handle:
        if flags & os.O_TRUNC:
            self.buf.clear()
        return LockHandle(self)

    async def setattr(self, attr: Any, fields: Any, handle: Handle | None, ctx: Any) -> Any:
        if fields.update_size:
            del self.buf[attr.st_size :]
        return self.attr()

    def held(self) -> bool:
        return scratch.writes(self.ctx).locks.get((repo_key(self.repo), self.ref)) is self

    async def commit(self, ctx: Any) -> None:
        """The rename over the ref: apply, and the lock is gone whatever the outcome (git
        unlinks it after a failed rename and gets ENOENT, which it ignores)."""
        if not self.held():
            fail(errno.ENOENT, f"{self.path} is not held")
        # A refused rename keeps the lock: git unlinks it next (and so abandons it).
        await write_ref(
            self.ctx, self.repo, self.ref, bytes(self.buf), self.old, scratch.pid_of(ctx)
        )
        _drop_lock(self.ctx, self.repo, self.ref)


class LockHandle(Handle):
    direct_io = True

    def __init__(self, node: LockFile) -> None:
        super().__init__(node)
        self.lock = node

    async def read(self, off: int, size: int) -> bytes:
        return bytes(self.lock.buf[off : off + size])

    async def write(self, off: int, buf: bytes) -> int:
        b = self.lock.buf
        end = off + len(buf)
        refuse_long(self.lock.ref, self.lock.path, end, line_cap(self.lock.ref, self.lock.old))
        if len(b) < end:
            b.extend(bytes(end - len(b)))
        b[off:end] = buf
        return len(buf)


def _lock_of(parent: Node, repo: Repo, ref: str | None) -> LockFile | None:
    if ref is None:
        return None
    w = scratch._WRITES.get(parent.ctx)
    node = None if w is None else w.locks.get((repo_key(repo), ref))
    return node if isinstance(node, LockFile) else None


def _new_lock(parent: Node, repo: Repo, ref: str, name: bytes, old: Any) -> LockFile:
    w = scratch.writes(parent.ctx)
    k = (repo_key(repo), ref)
    if k in w.locks:
        fail(errno.EEXIST, f"{repo.id}: {ref} is locked")
    node = LockFile(parent.ctx, parent, repo, ref, name, old)
    w.locks[k] = node
    return node


def _move_gc_file(repo_dir: RepoDir, name: bytes, new_name: bytes) -> None:
    """rename of one gc file over another (git's gc.pid.lock -> gc.pid)."""
    w = scratch.writes(repo_dir.ctx)
    k = repo_key(repo_dir.repo)
    node = w.locks.pop((k, name.decode()), None)
    if not isinstance(node, LockFile):
        fail(errno.ENOENT)
    node.ref = new_name.decode()
    node.name = new_name
    w.locks[(k, node.ref)] = node


def _drop_lock(ctx: Context, repo: Repo, ref: str | None) -> bool:
    w = scratch._WRITES.get(ctx)
    if ref is None or w is None:
        return False
    return w.locks.pop((repo_key(repo), ref), None) is not None


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
        w = scratch._WRITES.get(self.ctx)
        dirs = None if w is None else w.ref_dirs.get(repo_key(self.repo))
        return dirs or set()

    def _full(self, name: bytes, *, making: bool = False) -> str:
        part = _text(name)
        if not part or "/" in part or part in (".", ".."):
            if making:  # a name git would refuse too (check-ref-format)
                fail(errno.EINVAL, f"{self.repo.id}: invalid ref name component {name[:QUOTE]!r}")
            fail(errno.ENOENT)
        return f"{self.ref}/{part}"

    async def lookup(self, name: bytes, ctx: Any) -> Node:
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
            lock = _lock_of(self, self.repo, full[:-5])
            if lock is not None:
                return lock
        fail(errno.ENOENT)

    # -- writes ---------------------------------------------------------------------------
    async def create(self, name: bytes, mode: int, flags: int, ctx: Any) -> tuple[Node, Handle]:
        full = self._full(name, making=True)
        if full.endswith(".lock"):
            ref = full[:-5]
            if not valid_ref_name(ref):
                fail(errno.EINVAL, f"{self.repo.id}: invalid ref name {ref!r}")
            old = self.ctx.refs.get(self.repo.id, ref)
            node = _new_lock(self, self.repo, ref, name, old)
            return node, LockHandle(node)
        if not valid_ref_name(full):
            fail(errno.EINVAL, f"{self.repo.id}: invalid ref name {full!r}")
        old = self.ctx.refs.get(self.repo.id, full)
        new = NewRefFile(self.ctx, self, self.repo, full)
        return new, RefWriteHandle(new, self.repo, full, old, scratch.pid_of(ctx))

    async def mkdir(self, name: bytes, mode: int, ctx: Any) -> Node:
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
        w = scratch.writes(self.ctx)
        w.ref_dirs.setdefault(repo_key(self.repo), set()).add(full)
        return self._dir(part)

    async def unlink(self, name: bytes, ctx: Any) -> None:
        full = self._full(name)
        if full.endswith(".lock") and _drop_lock(self.ctx, self.repo, full[:-5]):
            return
        old = self.ctx.refs.get(self.repo.id, full)
        if old is None:
            await self.lookup(name, ctx)  # ENOENT, or a directory:
            fail(errno.EISDIR)
        lock = _lock_of(self, self.repo, full)
        expect = lock.old if lock is not None else ANY  # git deletes under its lock
        await write_ref(self.ctx, self.repo, full, b"", expect, scratch.pid_of(ctx), delete=True)

    async def rmdir(self, name: bytes, ctx: Any) -> None:
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
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, ctx: Any
    ) -> None:
        full = self._full(name)
        lock = _lock_of(self, self.repo, full[:-5]) if full.endswith(".lock") else None
        if lock is None or new_parent is not self or new_name != name[:-5] or flags:
            fail(errno.EPERM, f"{self.repo.id}: refs move only by `<ref>.lock` -> `<ref>`")
        await lock.commit(ctx)

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


class RepoObjectsDir(scratch.ScratchOverlay, Dir):
    """/repos/<id>/objects: resolves <xx>/<rest>, lists only info/ and pack/."""

    __slots__ = ("repo",)

    def __init__(self, ctx: Context, parent: RepoDir) -> None:
        repo = parent.repo
        super().__init__(ctx, ("repo-objects", repo.id, repo.created_ns), parent, b"objects")
        self.repo = repo

    def _child(self, name: bytes) -> Node | None:
        if name == b"info":
            return RepoInfoDir(self.ctx, self)
        if name == b"pack":
            return RepoPackDir(self.ctx, self)
        if name in _FANOUT:
            return RepoFanoutDir(self.ctx, self, name)
        return None

    async def lookup(self, name: bytes, ctx: Any) -> Node:
        node = self._child(name) or scratch.lookup_in(self, name)
        if node is None:
            fail(errno.ENOENT)
        return node

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        def entries() -> Entries:
            out = [(n, node) for n in (b"info", b"pack") if (node := self._child(n)) is not None]
            return out + scratch.entries_in(self)  # a push's quarantine, while it lasts

        await readdir_snapshot(dh, start, emit, entries)

    # -- git's writes: temporary files and quarantine directories (scratch) -------------
    async def mkdir(self, name: bytes, mode: int, ctx: Any) -> Node:
        node = self._child(name)
        if node is not None:
            return node  # git makes <xx>/ and pack/ before moving objects in: always there
        return scratch.mkdir_in(self, name, mode, repo_key(self.repo), ctx)

    async def create(self, name: bytes, mode: int, flags: int, ctx: Any) -> tuple[Node, Handle]:
        if self._child(name) is not None:
            fail(errno.EEXIST)
        return await super().create(name, mode, flags, ctx)

    async def rmdir(self, name: bytes, ctx: Any) -> None:
        if scratch.rmdir_in(self, name):
            return
        if name in (b"info", b"pack"):
            await _plumbing_goes(self, name)
            return
        await super().rmdir(name, ctx)


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

    def repo_key(self) -> scratch.RepoKey | None:
        parent = self.parent
        assert isinstance(parent, RepoObjectsDir)
        return repo_key(parent.repo)


class RepoPackDir(scratch.ScratchOverlay, Dir):
    """/repos/<id>/objects/pack: lists nothing once a pack is in the store. When a pack's
    index arrives (git moves it after the pack: a push, or `git repack` run here) every
    object of the pack is verified and stored, pinned for the push (scratch.ingest_pack);
    from then on its files still resolve by name for the git process that made them but
    are no longer listed (every object is served by the store and the derived packs, so
    a local clone or a later git never copies or re-reads this pack), and they go when git
    removes the pack's `.keep` (a push's refs are written) or the files themselves."""

    __slots__ = ("repo",)

    def __init__(self, ctx: Context, parent: RepoObjectsDir) -> None:
        repo = parent.repo
        super().__init__(ctx, ("repo-pack", repo.id, repo.created_ns), parent, b"pack")
        self.repo = repo

    async def lookup(self, name: bytes, ctx: Any) -> Node:
        node = scratch.lookup_in(self, name)
        if node is None:
            fail(errno.ENOENT)
        return node

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        def entries() -> Entries:
            stored = self.ctx.ingested_packs.get(repo_key(self.repo), set())
            listed = scratch.entries_in(self)
            return [(n, node) for n, node in listed if n.partition(b".")[0] not in stored]

        await readdir_snapshot(dh, start, emit, entries)

    async def link(self, name: bytes, node: Node, ctx: Any) -> Node:
        out = await super().link(name, node, ctx)
        await self.arrived(name, ctx)
        return out

    async def arrived(self, name: bytes, ctx: Any) -> None:
        """A file was linked or moved in: the index completes a pack, which is ingested."""
        if not (name.startswith(b"pack-") and name.endswith(b".idx")):
            return
        names = self.scratch_names()
        idx = names.get(name)
        pack = names.get(name[:-4] + b".pack")
        if not isinstance(pack, scratch.ScratchFile) or not isinstance(idx, scratch.ScratchFile):
            fail(errno.EIO, f"{self.path}: {name!r} arrived without its pack")
        try:
            await scratch.ingest_pack(self.ctx, pack, idx, self.repo, scratch.pid_of(ctx))
        except BaseException:
            scratch.unlink_in(self, name)  # a refused pack: its index is not kept
            raise
        stem = name.partition(b".")[0]  # pack-<hex>: its .pack, .idx, .rev, .bitmap, .keep
        self.ctx.ingested_packs.setdefault(repo_key(self.repo), set()).add(stem)

    async def unlink(self, name: bytes, ctx: Any) -> None:
        if not scratch.unlink_in(self, name):
            fail(errno.ENOENT)
        if name.startswith(b"pack-") and name.endswith(b".keep"):
            stem = name[:-5]  # the push is done: its pack is in the store, the files go
            for ext in (b".pack", b".idx", b".rev", b".bitmap", b".promisor"):
                if scratch.lookup_in(self, stem + ext) is not None:
                    scratch.unlink_in(self, stem + ext)

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, ctx: Any
    ) -> None:
        if not await scratch.rename_from(self, name, new_parent, new_name, flags, ctx):
            fail(errno.ENOENT)


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

    async def unlink(self, name: bytes, ctx: Any) -> None:
        if name != b"alternates":
            fail(errno.ENOENT)
        await _plumbing_goes(self, name)

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
