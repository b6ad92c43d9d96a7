"""Ref writes of /repos/<id>: the compare-and-swap a ref write is, git's lock files (in
memory: `ctx.writes.locks`), packed-refs rewrites, and the plumbing that goes with the last
ref. See repos.py for the protocol."""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from typing import TYPE_CHECKING, Protocol, cast

from pyfuse3 import EntryAttributes, RequestContext

from alkfs.git.refs import ANY, LOST_RACE, MAX_REF_NAME, Expected, RefUpdate, Refusal, Repo
from alkfs.keys import is_hex

from ..errors import fail
from ..staging.writes import pid_of, repo_key
from .base import File, Node, SetattrFields
from .handles import Handle
from .listing import text_of

if TYPE_CHECKING:
    from ..context import Context
    from .refdir import RepoFile

log = logging.getLogger("alkfsd")

PACKED_HEADER = b"# pack-refs with: peeled fully-peeled sorted \n"
QUOTE = 80  # characters of a refused value quoted in a log line


# What a ref lock expects the ref to hold (alkfs.git.refs.Expected), or packed-refs.lock's
# snapshot of the repository's refs taken at lock time (name -> oid).
LockOld = Expected | dict[str, str]


class InRepo(Protocol):
    """A directory of a repository's view (its root, refs/...): what `plumbing_goes` reads."""

    @property
    def ctx(self) -> Context: ...

    @property
    def repo(self) -> Repo: ...

    @property
    def path(self) -> str: ...


async def plumbing_goes(node: InRepo, name: bytes) -> None:
    """unlink/rmdir of the plumbing (HEAD, config, objects/ and objects/info/alternates,
    info/, pack/): EPERM while the repository holds refs; once they are gone it succeeds
    and changes nothing (`rm -r` of the repository then reaches its `rmdir`, which deletes
    it). `node` is the directory holding `name` (it has `.repo`)."""
    refs = node.ctx.refs
    if await node.ctx.run_sync(refs.has_below, node.repo.id, "refs/"):
        fail(errno.EPERM, f"{node.path}/{name.decode()}: the repository still has refs")


def render_packed(rows: list[tuple[str, str, str | None]]) -> bytes:
    out = [PACKED_HEADER]
    for name, oid, peeled in rows:
        out.append(f"{oid} {name}\n".encode())
        if peeled is not None:
            out.append(f"^{peeled}\n".encode())
    return b"".join(out)


def parse_packed(data: bytes) -> dict[str, str]:
    """name -> oid of a packed-refs file git wrote (EINVAL if it is not one)."""
    out: dict[str, str] = {}
    for n, line in enumerate(data.split(b"\n")):
        if not line or line.startswith(b"#") or line.startswith(b"^"):
            continue
        if len(line) > MAX_REF_NAME + 80:
            fail(errno.EINVAL, f"packed-refs: line {n + 1} is too long ({len(line)} bytes)")
        oid, sep, name = line.partition(b" ")
        text = text_of(name)
        if not sep or text is None or not is_hex(oid.decode("ascii", "replace"), len(oid)):
            fail(errno.EINVAL, f"packed-refs: line {n + 1} is not `<oid> <ref>`: {line[:QUOTE]!r}")
        out[text] = oid.decode("ascii")
    return out


# -- ref writes -----------------------------------------------------------------------------
# The files git makes in a repository's top directory to change HEAD or packed-refs: the
# name -> the key its in-memory file is held under. git 2.39 holds `packed-refs.lock` and


ROOT_LOCKS = {
    b"HEAD.lock": "HEAD",
    b"packed-refs.lock": "packed-refs",
    b"packed-refs.new": "packed-refs.new",
}
# `git gc` keeps its pid (and a log of a failed detached run) in the top directory: small
# in-memory files that live as long as the mount, like the locks. Nothing else is written.
GC_FILES = frozenset({b"gc.pid", b"gc.pid.lock", b"gc.log", b"gc.log.lock"})
ROOT_LOCKS.update({n: n.decode() for n in GC_FILES})
ROOT_TARGET = {
    b"HEAD.lock": b"HEAD",
    b"packed-refs.lock": b"packed-refs",
    b"packed-refs.new": b"packed-refs",
}
REF_LINE_MAX = 256  # bytes a ref file (or its lock) takes: `<64 hex>\n` and some slack
HEAD_LINE_MAX = len("ref: \n") + MAX_REF_NAME


def line_cap(ref: str, old: LockOld) -> int:
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
    ctx: Context,
    repo: Repo,
    ref: str,
    data: bytes,
    old: LockOld,
    pid: int,
    *,
    delete: bool = False,
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
    updates = [RefUpdate(ref, new, cast(Expected, old))]  # (a snapshot: packed-refs only)
    outcome = (
        await ctx.run_sync(lambda: refs.update(repo.id, updates, True, heads_are_commits=True))
    )[0]
    if not outcome.ok:
        code = errno.EAGAIN if outcome.reason in LOST_RACE else errno.EINVAL
        if delete and outcome.reason == Refusal.MISSING_REF:
            code = errno.ENOENT
        fail(code, f"{repo.id}: {ref}: {outcome.reason}")
    w = ctx.writes
    w.committed(repo_key(repo), pid)
    dirs = w.ref_dirs.get(repo_key(repo))
    if dirs and not delete:
        dirs.difference_update([d for d in dirs if ref.startswith(d + "/")])


async def rewrite_packed(ctx: Context, repo: Repo, data: bytes, snapshot: LockOld) -> None:
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
        self,
        node: RepoFile,
        repo: Repo,
        ref: str,
        old: str | None,
        pid: int,
        shown: bytes = b"",
    ) -> None:
        super().__init__(node)
        self.repo = repo
        self.ref = ref
        self.old = old if ref != "HEAD" else ANY
        self.pid = pid
        self.buf = bytearray()
        self.shown: bytes | None = shown  # the value at open, until written or truncated
        self.emptied = False  # ftruncate()d to 0 and nothing written since: no value at close
        self.applied = False

    async def read(self, off: int, size: int) -> bytes:
        if self.shown is not None:
            return self.shown[off : off + size]
        return bytes(self.buf[off : off + size])

    async def write(self, off: int, buf: bytes) -> int:
        if self.applied:
            fail(errno.EINVAL, f"{self.node.path}: one line per open")
        end = off + len(buf)
        self.emptied = False  # (a value was meant: a refused one already had its errno)
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
        if self.applied:
            return
        if self.buf:
            await self.apply()
        elif self.emptied:  # (`truncate -s 0 REF`): an empty ref is no value
            fail(errno.EINVAL, f"{self.node.path}: emptied and closed; a ref is not emptied")


class LockFile(File):
    """git's `<ref>.lock`: written in memory, applied by the rename over `<ref>` as a CAS
    against the ref's value when the lock was made. Each lock is an inode of its own whose
    entry is never cached: after the rename the kernel shows it under the ref's name, and
    the next path walk must find the ref itself."""

    entry_timeout = 0.0
    attr_timeout = 0.0
    __slots__ = ("repo", "ref", "old", "buf", "made_ns")

    def __init__(
        self, ctx: Context, parent: Node, repo: Repo, ref: str, name: bytes, old: LockOld
    ) -> None:
        serial = ctx.writes.area.next_serial()
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

    async def open(self, flags: int, req: RequestContext) -> Handle:
        if flags & os.O_TRUNC:
            self.buf.clear()
        return LockHandle(self)

    async def setattr(
        self,
        attr: EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> EntryAttributes:
        if fields.update_size:
            del self.buf[attr.st_size :]
        return self.attr()

    def held(self) -> bool:
        return self.ctx.writes.locks.get((repo_key(self.repo), self.ref)) is self

    async def commit(self, req: RequestContext) -> None:
        """The rename over the ref: apply, and the lock is gone whatever the outcome (git
        unlinks it after a failed rename and gets ENOENT, which it ignores)."""
        if not self.held():
            fail(errno.ENOENT, f"{self.path} is not held")
        # A refused rename keeps the lock: git unlinks it next (and so abandons it).
        await write_ref(self.ctx, self.repo, self.ref, bytes(self.buf), self.old, pid_of(req))
        drop_lock(self.ctx, self.repo, self.ref)


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
        self.emptied = False  # (a value was meant: a refused one already had its errno)
        refuse_long(self.lock.ref, self.lock.path, end, line_cap(self.lock.ref, self.lock.old))
        if len(b) < end:
            b.extend(bytes(end - len(b)))
        b[off:end] = buf
        return len(buf)


def lock_of(parent: Node, repo: Repo, ref: str | None) -> LockFile | None:
    if ref is None:
        return None
    node = parent.ctx.writes.locks.get((repo_key(repo), ref))
    return node if isinstance(node, LockFile) else None


def new_lock(parent: Node, repo: Repo, ref: str, name: bytes, old: LockOld) -> LockFile:
    w = parent.ctx.writes
    k = (repo_key(repo), ref)
    if k in w.locks:
        fail(errno.EEXIST, f"{repo.id}: {ref} is locked")
    node = LockFile(parent.ctx, parent, repo, ref, name, old)
    w.locks[k] = node
    return node


def drop_lock(ctx: Context, repo: Repo, ref: str | None) -> bool:
    if ref is None:
        return False
    return ctx.writes.locks.pop((repo_key(repo), ref), None) is not None
