"""Scratch files for git's writes through the mount, and the pins that keep a push alive.

git writes an object as a temporary file (`objects/tmp_obj_XXXXXX` or
`objects/xx/tmp_obj_XXXXXX`), then `link`s (or `rename`s) it to `xx/<hex>`, then
unlinks the temporary name. A push writes into a quarantine directory of its own
(`objects/tmp_objdir-incoming-XXXXXX/` with `pack/`, `info/` and `xx/` inside), runs
its connectivity check with the quarantine as its object directory, then moves every
file to `objects/xx/<hex>` and removes the quarantine.

Here lives everything that is not yet a stored object:

- `ScratchArea`: a per-mount directory on disk (STORE/scratch, or a fleet member's own
  STORE/nodes/<node>/scratch; emptied when the daemon starts; a temporary directory for
  a mem store). Every scratch file's bytes are one file there, under a serial number;
  the names git sees live in memory.
- `ScratchFile` / `ScratchDir`: the nodes git creates, writes, links, renames and
  removes. Names are kept per directory in memory (`Writes.overlay` for scratch names
  inside store-backed directories such as /git/sha1/ or /repos/<id>/objects/xx/), so a
  scratch directory is private to the repository it was made in and vanishes with its
  content when git (or the daemon, once its creator has exited) removes it.
- `ingest`: a scratch file linked or renamed to `xx/<hex>` is inflated, checked to be
  one canonical git object and stored under the expected key (`store.put(expect=)`);
  a mismatch stores nothing and fails the link with EIO.
- `Writes.sessions`: objects stored through /repos/<id>/objects (migration included)
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
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from alkfs.errors import Verification
from alkfs.git.objects import decode_loose
from alkfs.keys import Algorithm, Key
from alkfs.store import ObjectStat

from .errors import fail
from .handles import inflight_root
from .nodes.base import FIRST_OFFSET, Dir, DirHandle, Emit, File, Handle, Node

if TYPE_CHECKING:
    from alkfs.gc.arbiter import Batch, Pin

    from .context import Context

log = logging.getLogger("alkfsd")

SCRATCH_DIR = "scratch"
GRACE_MIN_S = 600.0  # pins of a push that never writes a ref go after this (or the window)
EXPIRE_EVERY_S = 30.0
EXPIRE_MIN_S = 0.5  # the expiry loop's shortest period (a grace of a few seconds)
SCRATCH_TIMEOUT = 60.0  # entry/attribute timeout of scratch files and directories
RepoKey = tuple[str, int]  # (repository id, creation time): a re-created id is another repo


# -- the area on disk -----------------------------------------------------------------------
def clean(root: Path) -> None:
    """Empty (or create) a scratch directory: nothing in it survives a daemon."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)


def scratch_root(store: Any) -> Path | None:
    """STORE/scratch, or a fleet member's own STORE/nodes/<node>/scratch (emptied at start:
    another daemon's is never touched); None for a memory store (a temporary directory)."""
    root = inflight_root(store)
    return None if root is None else root / SCRATCH_DIR


class ScratchArea:
    """One directory of scratch files, each under a serial number."""

    def __init__(self, root: Path | None) -> None:
        self.temporary = root is None
        self.root = Path(tempfile.mkdtemp(prefix="alkfs-scratch-")) if root is None else root
        clean(self.root)
        self.serial = 0

    def new_file(self) -> tuple[int, Path]:
        self.serial += 1
        path = self.root / f"{self.serial:016x}"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:
            # a fleet member paused past its session's end: the lease holder removed its
            # directories as a dead member's (alkfs/fleet.py); it joined again, they come back
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, flags, 0o600)
        os.close(fd)
        return self.serial, path

    def next_serial(self) -> int:
        self.serial += 1
        return self.serial

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        if not self.temporary:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)


# -- processes --------------------------------------------------------------------------------
def pid_of(ctx: Any) -> int:
    return int(getattr(ctx, "pid", 0) or 0)


def alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


# -- per-mount write state --------------------------------------------------------------------
@dataclass
class Session:
    """The pins one process took in one repository, released together."""

    batch: Batch
    since: float = field(default_factory=time.monotonic)


class Writes:
    """What git's writes leave in the daemon's memory for one mount."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.area = ScratchArea(scratch_root(ctx.store))
        self.overlays: dict[tuple, dict[bytes, Node]] = {}
        self.sessions: dict[tuple[RepoKey, int], Session] = {}
        self.quarantines: dict[int, ScratchDir] = {}  # serial -> a scratch dir made in objects/
        self.locks: dict[tuple[RepoKey, str], Node] = {}  # git's .lock files, by ref
        self.ref_dirs: dict[RepoKey, set[str]] = {}  # mkdir'ed ref directories holding no ref
        configured = ctx.options.push_grace_s  # alkfsd --push-grace
        self.grace_s = (
            max(GRACE_MIN_S, ctx.store.window_ns / 1e9) if configured is None else configured
        )
        # looked at often enough for a short grace to mean what it says
        self.expire_every_s = min(EXPIRE_EVERY_S, max(EXPIRE_MIN_S, self.grace_s / 2))
        self._expiring = False

    # -- scratch names inside store-backed directories ------------------------------------
    def overlay(self, host: Node) -> dict[bytes, Node]:
        found = self.overlays.get(host.ident)
        if found is None:
            found = self.overlays[host.ident] = {}
        return found

    def peek(self, host: Node, name: bytes) -> Node | None:
        names = self.overlays.get(host.ident)
        return None if not names else names.get(name)

    def new_file(self, host: Node, name: bytes, mode: int) -> ScratchFile:
        serial, path = self.area.new_file()
        node = ScratchFile(self.ctx, host, name, serial, path, mode & 0o7777)
        return node

    # -- pins -----------------------------------------------------------------------------
    def hold(self, repo: RepoKey, pid: int, pin: Pin) -> None:
        """Keep `pin` until the process `pid` (or anyone, once it is gone) commits a ref
        in `repo`, or the grace period passes."""
        self._start_expiry()
        s = self.sessions.get((repo, pid))
        if s is None:
            s = self.sessions[(repo, pid)] = Session(self.ctx.store.arbiter.batch())
        s.batch.add(pin)

    def committed(self, repo: RepoKey, pid: int) -> int:
        """A ref write by `pid` in `repo` committed: release that process's pins there and
        those of processes that have exited. Returns how many sessions went."""
        gone = [k for k in self.sessions if k[0] == repo and (k[1] == pid or not alive(k[1]))]
        for k in gone:
            self.sessions.pop(k).batch.release()
        return len(gone)

    def forget_repo(self, repo: RepoKey) -> None:
        """The repository is gone: its pins, locks, ref directories and scratch go too."""
        for k in [k for k in self.sessions if k[0] == repo]:
            self.sessions.pop(k).batch.release()
        for lk in [lk for lk in self.locks if lk[0] == repo]:
            del self.locks[lk]
        self.ref_dirs.pop(repo, None)
        for serial, q in list(self.quarantines.items()):
            if q.repo == repo:
                q.drop_from_host()
                del self.quarantines[serial]

    def pinned(self, repo: RepoKey | None = None) -> int:
        return sum(len(s.batch) for k, s in self.sessions.items() if repo is None or k[0] == repo)

    def push_of(self, pid: int) -> tuple[RepoKey, int] | None:
        """The (repository, receive-pack pid) of the push `pid` works for: it created a
        quarantine directory, or its parent did."""
        if not self.quarantines or pid <= 0:
            return None
        creators = {q.creator: q.repo for q in self.quarantines.values() if q.repo is not None}
        if pid in creators:
            return creators[pid], pid
        parent = parent_of(pid)
        if parent in creators:
            return creators[parent], parent
        return None

    def expire(self, now: float | None = None) -> None:
        """Release sessions older than the grace period; drop quarantines whose creator
        has exited (git removes its own; these are a killed push's)."""
        now = time.monotonic() if now is None else now
        for k, session in list(self.sessions.items()):
            if alive(k[1]):
                # a writer that is still there (a push slower than any grace, a hung
                # `git hash-object`) keeps its pins: the grace counts from its exit
                session.since = now
            elif now - session.since > self.grace_s:
                log.info(
                    "releasing %d pin(s) of repository %s after the grace period",
                    len(session.batch),
                    k[0][0],
                )
                self.sessions.pop(k).batch.release()
        for serial, q in list(self.quarantines.items()):
            if not alive(q.creator):
                q.drop_from_host()
                self.quarantines.pop(serial, None)

    def _start_expiry(self) -> None:
        if self._expiring:
            return
        try:
            trio.lowlevel.spawn_system_task(self._expiry_loop, name="alkfsd pin expiry")
            self._expiring = True
        except RuntimeError:  # not inside trio (direct calls): expired lazily
            pass

    async def _expiry_loop(self) -> None:
        while True:
            await trio.sleep(self.expire_every_s)
            try:
                self.expire()
            except Exception:
                log.exception("scratch expiry failed")

    def close(self) -> None:
        for s in self.sessions.values():
            s.batch.release()
        self.sessions.clear()
        self.area.close()


_WRITES: weakref.WeakKeyDictionary[Context, Writes] = weakref.WeakKeyDictionary()


def writes(ctx: Context) -> Writes:
    w = _WRITES.get(ctx)
    if w is None:
        w = _WRITES[ctx] = Writes(ctx)
    return w


def prepare(ctx: Context) -> Writes:
    """At daemon start: the scratch area is emptied now, before any request."""
    return writes(ctx)


# -- ingest -------------------------------------------------------------------------------------
def ingest_blocking(ctx: Context, data: bytes, algo: Algorithm, key: Key) -> Any:
    """Store a loose object's inflated content under `key` (Verification on any mismatch:
    not zlib, not one canonical object, another digest). Returns the PutResult."""
    canonical = decode_loose(data)
    return ctx.store.put(canonical, len(canonical), algo=algo, expect=key)


async def ingest(
    ctx: Context, node: ScratchFile, algo: Algorithm, hexname: str, repo: RepoKey | None, pid: int
) -> ObjectStat:
    """A scratch file named `hexname` in a fan-out directory: verify and store it; pinned
    for `repo`'s session when it came through a repository, released at once otherwise."""
    key = Key.from_hex(algo, hexname)
    data = node.read_all()
    # Always off the trio thread: the put writes sqlite and may wait out a sweep's delete.
    result = await ctx.run_sync(ingest_blocking, ctx, data, algo, key)
    if repo is not None:
        writes(ctx).hold(repo, pid, result.pin)
    else:
        result.pin.release()
    st = ctx.store.stat(key)
    if st is None:  # swept between the put and now: cannot happen while pinned
        fail(errno.EIO, f"{key} vanished after it was stored")
    return st


PACK_BATCH = 8192  # objects a put_many batch when a pushed pack is ingested
GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "LC_ALL": "C"}


def ingest_pack_blocking(
    ctx: Context, pack: Path, idx: Path, object_format: str, algo: Algorithm
) -> list[Any]:
    """Every object of a pack git indexed (a push's pack, migrated out of its
    quarantine), verified and stored; returns the PutResults (their pins are the
    caller's). git itself reads the pack (`cat-file --batch-all-objects`) from a
    throwaway repository in the scratch area holding links to the two files."""
    results: list[Any] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")} | GIT_ENV
    with tempfile.TemporaryDirectory(dir=writes(ctx).area.root, prefix="pack-") as tmp:
        gitdir = Path(tmp) / "repo.git"
        subprocess.run(
            ["git", "init", "-q", "--bare", f"--object-format={object_format}", str(gitdir)],
            env=env,
            check=True,
            capture_output=True,
            umask=0o077,  # its files are the daemon's alone, whatever the daemon's umask
        )
        os.link(pack, gitdir / "objects" / "pack" / "pack-pushed.pack")
        os.link(idx, gitdir / "objects" / "pack" / "pack-pushed.idx")
        cat = ["git", f"--git-dir={gitdir}", "cat-file", "--batch-all-objects", "--batch"]
        with subprocess.Popen(
            [*cat, "--unordered"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        ) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            items: list[tuple[bytes, Algorithm, bytes]] = []
            tag = bytes([algo.value])
            try:
                while line := proc.stdout.readline():
                    oid, kind, size = line.split()
                    n = int(size)
                    body = proc.stdout.read(n + 1)
                    if len(body) != n + 1:
                        raise Verification(f"git cat-file ended inside {oid.decode()}")
                    canonical = kind + b" " + size + b"\0" + body[:n]
                    items.append((canonical, algo, tag + bytes.fromhex(oid.decode())))
                    if len(items) >= PACK_BATCH:
                        results += ctx.store.put_many(items)
                        items = []
                if items:
                    results += ctx.store.put_many(items)
                err = proc.stderr.read()
                if proc.wait() != 0:
                    why = err.decode(errors="replace").strip()
                    raise Verification(f"git could not read the pushed pack: {why}")
            except BaseException:
                proc.kill()
                for r in results:
                    r.pin.release()
                raise
    return results


async def ingest_pack(
    ctx: Context, pack: ScratchFile, idx: ScratchFile, repo: Any, pid: int
) -> int:
    """A push's pack arrived in /repos/<id>/objects/pack: store every object in it,
    pinned for the push's session. Returns how many objects it held."""
    results = await ctx.run_sync(
        ingest_pack_blocking, ctx, pack.disk, idx.disk, repo.object_format, repo.algo
    )
    w = writes(ctx)
    for r in results:
        w.hold((repo.id, repo.created_ns), pid, r.pin)
    log.info("repository %s: stored %d object(s) of a pushed pack", repo.id, len(results))
    return len(results)


async def freshened(ctx: Context, key: Key, pid: int) -> None:
    """A loose file was touched: if the toucher works for a push, pin the object for it
    (in a worker thread: the pin waits out an in-flight delete of the key)."""
    w = _WRITES.get(ctx)
    if w is None:
        return
    owner = w.push_of(pid)
    if owner is not None:
        w.hold(owner[0], owner[1], await ctx.run_sync(ctx.store.pin, key))


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

    async def open(self, flags: int, ctx: Any) -> Handle:
        fd = os.open(self.disk, os.O_RDWR | os.O_CLOEXEC)
        if flags & os.O_TRUNC:
            os.ftruncate(fd, 0)
        return ScratchHandle(self, fd)

    async def setattr(self, attr: Any, fields: Any, handle: Handle | None, ctx: Any) -> Any:
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
        return os.pwrite(self.fd, buf, off)

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

    async def lookup(self, name: bytes, ctx: Any) -> Node:
        node = self.entries.get(name)
        if node is None:
            fail(errno.ENOENT)
        return node

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        if start < FIRST_OFFSET or "entries" not in dh.state:
            dh.state["entries"] = sorted(self.entries.items())
        listed = dh.state["entries"]
        first = 0 if start < FIRST_OFFSET else start - FIRST_OFFSET + 1
        for i in range(first, len(listed)):
            name, node = listed[i]
            if not emit(name, node, i + FIRST_OFFSET):
                return

    async def create(self, name: bytes, mode: int, flags: int, ctx: Any) -> tuple[Node, Handle]:
        if name in self.entries:
            fail(errno.EEXIST)
        node = writes(self.ctx).new_file(self, name, mode)
        self.entries[name] = node
        return node, await node.open(flags & ~os.O_TRUNC, ctx)

    async def mkdir(self, name: bytes, mode: int, ctx: Any) -> Node:
        if name in self.entries:
            fail(errno.EEXIST)
        w = writes(self.ctx)
        node = ScratchDir(
            self.ctx, self, name, w.area.next_serial(), self.repo, self.creator, None, mode & 0o777
        )
        self.entries[name] = node
        return node

    async def link(self, name: bytes, node: Node, ctx: Any) -> Node:
        if name in self.entries:
            fail(errno.EEXIST)
        if not isinstance(node, ScratchFile):
            fail(errno.EXDEV, "only scratch files can be linked into a scratch directory")
        node.names += 1
        self.entries[name] = node
        return node

    async def unlink(self, name: bytes, ctx: Any) -> None:
        node = self.entries.get(name)
        if node is None:
            fail(errno.ENOENT)
        if node.is_dir:
            fail(errno.EISDIR)
        del self.entries[name]
        assert isinstance(node, ScratchFile)
        node.drop_name()

    async def rmdir(self, name: bytes, ctx: Any) -> None:
        node = self.entries.get(name)
        if node is None:
            fail(errno.ENOENT)
        if not isinstance(node, ScratchDir):
            fail(errno.ENOTDIR)
        if node.entries:
            fail(errno.ENOTEMPTY)
        del self.entries[name]

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, ctx: Any
    ) -> None:
        node = self.entries.get(name)
        if node is None:
            fail(errno.ENOENT)
        await move(self.entries, name, node, new_parent, new_name, flags, ctx)

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
            names = writes(self.ctx).overlays.get(self.host.ident)
            if names is not None and names.get(self.name) is self:
                del names[self.name]
        self.destroy()


async def move(
    names: dict[bytes, Node],
    name: bytes,
    node: Node,
    new_parent: Node,
    new_name: bytes,
    flags: int,
    ctx: Any,
) -> None:
    """rename(2) of a scratch entry held in `names`: into a scratch directory or a scratch
    overlay it moves; into a fan-out directory (anything with `adopt`) a file is ingested."""
    if flags:
        fail(errno.EINVAL, "rename flags are not supported here")
    if isinstance(new_parent, ScratchDir):
        target = new_parent.entries
    elif hasattr(new_parent, "adopt") and isinstance(node, ScratchFile):
        await new_parent.adopt(new_name, node, ctx)  # type: ignore[attr-defined]
        if names.get(name) is node:
            # The kernel now shows this inode under the object's name until the entry
            # expires: its bytes (the same object, git's compression) stay until the
            # daemon's end. git renames only where link fails; it links otherwise.
            del names[name]
            node.names -= 1
        return
    elif hasattr(new_parent, "scratch_names"):
        target = new_parent.scratch_names()  # type: ignore[attr-defined]
    else:
        fail(errno.EXDEV, f"cannot move {node.path} there")
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
    arrived = getattr(new_parent, "arrived", None)
    if arrived is not None:
        await arrived(new_name, ctx)


# -- scratch names inside store-backed directories (/git/<format>[/xx], /repos/<id>/objects[/xx])
# The host directory's own methods call these first; each returns None / False when the
# name is not a scratch name, so the host answers for its store-backed names as before.
def lookup_in(host: Node, name: bytes) -> Node | None:
    w = _WRITES.get(host.ctx)
    return None if w is None else w.peek(host, name)


def entries_in(host: Node) -> list[tuple[bytes, Node]]:
    w = _WRITES.get(host.ctx)
    if w is None:
        return []
    names = w.overlays.get(host.ident)
    return sorted(names.items()) if names else []


async def create_in(
    host: Node, name: bytes, mode: int, flags: int, ctx: Any
) -> tuple[Node, Handle]:
    """A new scratch file in a store-backed directory (git's tmp_obj_*, a lock file)."""
    w = writes(host.ctx)
    names = w.overlay(host)
    if name in names:
        fail(errno.EEXIST)
    node = w.new_file(host, name, mode)
    names[name] = node
    return node, await node.open(flags & ~os.O_TRUNC, ctx)


def mkdir_in(host: Node, name: bytes, mode: int, repo: RepoKey | None, ctx: Any) -> ScratchDir:
    """A scratch directory (a push's quarantine) in a repository's objects/."""
    w = writes(host.ctx)
    names = w.overlay(host)
    if name in names:
        fail(errno.EEXIST)
    w.expire()  # a killed push's quarantine goes before a new one comes
    node = ScratchDir(
        host.ctx, host, name, w.area.next_serial(), repo, pid_of(ctx), host, mode & 0o777
    )
    names[name] = node
    w.quarantines[node.serial] = node
    return node


def unlink_in(host: Node, name: bytes) -> bool:
    w = _WRITES.get(host.ctx)
    node = None if w is None else w.peek(host, name)
    if node is None or w is None:
        return False
    if node.is_dir:
        fail(errno.EISDIR)
    del w.overlays[host.ident][name]
    assert isinstance(node, ScratchFile)
    node.drop_name()
    return True


def rmdir_in(host: Node, name: bytes) -> bool:
    w = _WRITES.get(host.ctx)
    node = None if w is None else w.peek(host, name)
    if node is None or w is None:
        return False
    if not isinstance(node, ScratchDir):
        fail(errno.ENOTDIR)
    if node.entries:
        fail(errno.ENOTEMPTY)
    del w.overlays[host.ident][name]
    w.quarantines.pop(node.serial, None)
    return True


async def rename_from(
    host: Node, name: bytes, new_parent: Node, new_name: bytes, flags: int, ctx: Any
) -> bool:
    w = _WRITES.get(host.ctx)
    node = None if w is None else w.peek(host, name)
    if node is None or w is None:
        return False
    await move(w.overlays[host.ident], name, node, new_parent, new_name, flags, ctx)
    return True


async def link_in(host: Node, name: bytes, node: Node) -> Node:
    """link(2) of a scratch file to another scratch name in a store-backed directory."""
    if not isinstance(node, ScratchFile):
        fail(errno.EPERM, "only scratch files can be linked here")
    names = writes(host.ctx).overlay(host)
    if name in names:
        fail(errno.EEXIST)
    node.names += 1
    names[name] = node
    return node


class ScratchOverlay:
    """For a directory where git also makes its temporary files: its scratch names sit
    beside its own entries. create, link and scratch_names go to the scratch area;
    unlink and rename do too when the name is a scratch one, else to the next class
    (so mix it in first: `class X(ScratchOverlay, Dir)`)."""

    __slots__ = ()

    async def create(self, name: bytes, mode: int, flags: int, ctx: Any) -> tuple[Node, Handle]:
        return await create_in(self, name, mode, flags, ctx)  # type: ignore[arg-type]

    def scratch_names(self) -> dict[bytes, Node]:
        return writes(self.ctx).overlay(self)  # type: ignore[attr-defined, arg-type]

    async def link(self, name: bytes, node: Node, ctx: Any) -> Node:
        return await link_in(self, name, node)  # type: ignore[arg-type]

    async def unlink(self, name: bytes, ctx: Any) -> None:
        if not unlink_in(self, name):  # type: ignore[arg-type]
            await super().unlink(name, ctx)  # type: ignore[misc]

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, ctx: Any
    ) -> None:
        if not await rename_from(self, name, new_parent, new_name, flags, ctx):  # type: ignore[arg-type]
            await super().rename(name, new_parent, new_name, flags, ctx)  # type: ignore[misc]


def close(ctx: Context) -> None:
    """At daemon end: pins released, scratch bytes removed."""
    w = _WRITES.pop(ctx, None)
    if w is not None:
        w.close()
