"""/git/sha1 and /git/sha256: the store's git objects as a git object directory.

`/git/<format>/<xx>/<rest>` is the loose object of the key `<xx><rest>`: a zlib
stream of stored deflate blocks (alkfs.git.objects.loose_size / encode_loose), so
its size is known without compressing and any range is arithmetic over the
canonical bytes. A repository whose `objects/info/alternates` names the directory
reads every stored object of its format; /repos/<id>/objects resolves objects through
the same nodes.

`pack/` and `info/` serve the published derived set (alkfs/git/packs/, daemon/packs.py):
`pack/pack-<h>.pack`, `.idx`, `.keep`, `multi-pack-index` and `info/commit-graphs/`, each
an immutable file read straight from its backing file (pread; in a thread beyond
INLINE_READ), with keep_cache, long attribute timeouts, no FLUSH, and EPERM for any
setattr (a pack is not an object: git then freshens the one object through its loose
path). Every generation's files have their own inodes; a name that a new set reuses
(`multi-pack-index`, `commit-graph-chain`) has a short entry timeout, and publishing a set
drops the kernel's entries of the names that changed. A retired file stays readable for
every open handle; its generation's directory goes after the last release. A fan-out
directory lists only the objects no published pack holds (git reads a whole one to
abbreviate an id) and still resolves every object by name.

All 256 fan-out directories always exist and are listed, empty or not. git opens
`<xx>/<rest>` by path, so a fan-out directory is one lookup whose entry the
kernel keeps for the mount's life (long timeouts, one inode per directory); a
directory that appeared only once it held an object would need a negative entry
with a short timeout, or an invalidation on every first object of a prefix, and
git would re-ask for it. git's enumerations (`--batch-all-objects`, fsck,
abbreviated ids) open all 256 paths anyway, and in any store of more than a few
thousand objects every prefix is populated. The kernel caches the listings of the fan-out
directories and of `pack/` and `info/` (FOPEN_CACHE_DIR, checked at every open against the
listing then: daemon/listings.py), so a git process's 256 listings cost an OPENDIR and a
RELEASEDIR each, no READDIR.

Writes are git's own loose-object protocol (daemon/staging/scratch.py): a temporary file made
in `<format>/` or `<format>/<xx>/` lives in the scratch area; `link` or `rename` of it to
`<xx>/<rest>` inflates it, checks it is one canonical object with that id and stores it
(EIO and nothing stored otherwise); unlinking the temporary name, fsync and chmod of it,
and `mkdir` of an existing fan-out directory succeed. Objects written here are not pinned
(their refs live outside the mount; the sweep window protects them); the same writes
through /repos/<id>/objects are pinned until a ref of that repository commits.

git through alternates pays FUSE requests per object: lookup (once: long entry and
attribute timeouts), then open + release per open (no flush: FOPEN_NOFLUSH). Lookups
and opens of kv objects are answered inline (one indexed sqlite read, no thread hop, no
writes); the first open of the kernel's inode of an object up to INLINE_VERIFY pushes
the whole loose file into its page cache (ObjectFile.push), so no read request comes,
nor the attribute refresh a read causes; later opens load nothing unless the kernel
evicted the pages and reads again.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from typing import TYPE_CHECKING, cast

from pyfuse3 import EntryAttributes, RequestContext

from alkfs.keys import Algorithm, Key

from .. import listings
from .. import packs as derived_packs
from ..errors import fail
from ..staging.overlay import ScratchOverlay
from .base import (
    DYNAMIC_TIMEOUT,
    FIRST_OFFSET,
    OBJECT_TIMEOUT,
    Dir,
    Emit,
    Node,
    SetattrFields,
    StaticDir,
    changes_anything,
)
from .handles import DirHandle, Handle, wants_write
from .loose import FANOUT, FanoutDir, Sizes, repo_fanout_ident

if TYPE_CHECKING:
    from alkfs.git.packs import Generation

    from ..context import Context

log = logging.getLogger("alkfsd")

FORMATS = {b"sha1": Algorithm.GIT_SHA1, b"sha256": Algorithm.GIT_SHA256}
INLINE_READ = 128 << 10  # derived-file reads up to this are a pread on the trio thread
REUSED_NAMES = (b"multi-pack-index", b"commit-graph-chain", b"commit-graph")


# -- nodes ----------------------------------------------------------------------------------------
class GitDir(StaticDir):
    """/git: one object directory per git object format."""

    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("dir", "/git"), parent, b"git")
        for _, node in self._entries():
            ctx.inodes.remember(node, permanent=True)
        ctx.deletion_views.append(self._deleted)

    def children(self) -> list[tuple[bytes, Node]]:
        return [(name, ObjectDir(self.ctx, self, algo)) for name, algo in FORMATS.items()]

    def object_dir(self, algo: Algorithm) -> ObjectDir:
        node = self._index[b"sha1" if algo is Algorithm.GIT_SHA1 else b"sha256"]
        assert isinstance(node, ObjectDir)
        return node

    def _deleted(self, key: Key) -> list[tuple[int, bytes, int]]:
        """The kernel entries that showed `key`: /git/<format>/<xx>/<rest> and every
        /repos/<id>/objects/<xx>/<rest> the kernel has looked up."""
        if not key.algo.is_git:
            return []
        known = self.ctx.inodes.known(("loose", key.raw))
        if known is None:  # the kernel holds no entry of it, in any directory
            return []
        fan = self.object_dir(key.algo).fanout(key.hex[:2].encode())
        rest = key.hex[2:].encode()
        out = [(fan.ino, rest, known.ino)]
        fmt = "sha1" if key.algo is Algorithm.GIT_SHA1 else "sha256"
        for repo in self.ctx.refs.repos():
            if repo.object_format == fmt:
                d = self.ctx.inodes.known(repo_fanout_ident(repo, key.hex[:2].encode()))
                if d is not None:
                    out.append((d.ino, rest, known.ino))
        return out


class ObjectDir(StaticDir):
    """/git/<format>: 256 fan-out directories, then empty `info/` and `pack/`; git's
    temporary files beside them (scratch names)."""

    __slots__ = ("algo", "sizes", "overlay")

    def __init__(self, ctx: Context, parent: Node, algo: Algorithm) -> None:
        label = "sha1" if algo is Algorithm.GIT_SHA1 else "sha256"
        self.algo = algo
        self.sizes = Sizes()  # what its fan-out directories learn about their size
        super().__init__(ctx, ("dir", f"/git/{label}"), parent, label.encode())
        self.overlay = ScratchOverlay(self)
        self._entries()  # now, on the trio thread: the sweep's deletion view reads them

    def children(self) -> list[tuple[bytes, Node]]:
        out: list[tuple[bytes, Node]] = [
            (xx, FanoutDir(self.ctx, self, self.algo, xx, sizes=self.sizes)) for xx in FANOUT
        ]
        fmt = self.name.decode()
        for sub in (b"info", b"pack"):
            out.append((sub, DerivedDir(self.ctx, self, fmt, sub.decode(), sub)))
        for _, node in out:
            self.ctx.inodes.remember(node, permanent=True)
        derived_packs.served(self.ctx).views.append(self._published)
        return out

    def entries_in_c(self) -> list[tuple[bytes, Node]]:
        return [(name, node) for name, node in self._entries() if isinstance(node, FanoutDir)]

    def _published(self, fmt: str, old: Generation | None, new: Generation | None) -> None:
        """A new derived set of `fmt` (any thread): drop the kernel's entries of every
        name of the old set the new one lacks, and of the reused names (they get their
        new inode at the next lookup); a shared pack keeps its entry and inode."""
        if fmt != self.name.decode() or old is None:
            return
        dirs: set[str] = set()
        kept = set() if new is None else set(new.files)
        for rel in old.files:
            parent, _, name = rel.rpartition("/")
            dirs.add(parent)
            if rel not in kept or name.encode() in REUSED_NAMES:
                self._drop(parent, name.encode())
        for rel in dirs:  # subdirectories (info/commit-graphs) too
            parent, _, name = rel.rpartition("/")
            if parent:
                self._drop(parent, name.encode())

    def _drop(self, parent_rel: str, name: bytes) -> None:
        parent = self.ctx.inodes.known(("dir", f"{self.path}/{parent_rel}"))
        if parent is not None:
            self.ctx.invalidator.submit(parent.ino, name, 0)

    def fanout(self, xx: bytes) -> FanoutDir:
        self._entries()
        node = self._index[xx]
        assert isinstance(node, FanoutDir)
        return node

    # -- git's writes: scratch names beside the fan-out directories ----------------------
    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        self._entries()
        node = self._index.get(name) or self.overlay.lookup(name)
        if node is None:
            fail(errno.ENOENT)
        return node

    async def mkdir(self, name: bytes, mode: int, req: RequestContext) -> Node:
        self._entries()
        node = self._index.get(name)
        if node is None:
            fail(errno.EPERM, "only git's fan-out directories are made here")
        return node  # git makes <xx>/ before writing into it: it is always there

    # -- the scratch names (git's writes): composition, see staging/overlay.py ----------
    def scratch(self) -> ScratchOverlay:
        return self.overlay

    async def create(
        self, name: bytes, mode: int, flags: int, req: RequestContext
    ) -> tuple[Node, Handle]:
        return await self.overlay.create(name, mode, flags, req)

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


class EmptyDir(Dir):
    """A directory that is always empty."""

    __slots__ = ()


class DerivedDir(Dir):
    """`pack/`, `info/` or `info/commit-graphs/` of /git/<format>: the published set's
    files under that path (nothing when no set is published). The kernel caches the
    listing, checked at each open (daemon/listings.py)."""

    caches_listing = True
    __slots__ = ("fmt", "rel")

    def mtime_ns(self) -> int:
        return listings.of(self.ctx).mtime_ns(self.ino, self.ctx.started_ns)

    def __init__(self, ctx: Context, parent: Node, fmt: str, rel: str, name: bytes) -> None:
        super().__init__(ctx, ("dir", f"{parent.path}/{name.decode()}"), parent, name)
        self.fmt = fmt
        self.rel = rel

    def _child(self, gen: Generation, name: bytes, retired: bool = False) -> Node | None:
        try:
            text = name.decode("ascii")
        except UnicodeDecodeError:
            return None
        rel = f"{self.rel}/{text}"
        if rel in gen.files:
            return DerivedFile(self.ctx, self, gen, rel, name, retired)
        if text in gen.names_in(self.rel):
            return DerivedDir(self.ctx, self, self.fmt, rel, name)
        return None

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        served = derived_packs.served(self.ctx)
        gen = served.current(self.fmt)
        node = None if gen is None else self._child(gen, name)
        if node is None and name not in REUSED_NAMES:
            # a name git listed before a publish and opens now: the retired generation
            # still resolves it for its grace (never listed again)
            for old in served.retired(self.fmt):
                node = self._child(old, name, retired=True)
                if node is not None:
                    break
        if node is None:
            fail(errno.ENOENT)
        return node

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        gen = cast("Generation | None", dh.state.get("gen"))
        if gen is None or start < FIRST_OFFSET:  # one listing sees one set
            gen = dh.state["gen"] = derived_packs.served(self.ctx).current(self.fmt)
        if gen is None:
            return
        names = gen.names_in(self.rel)
        first = 0 if start < FIRST_OFFSET else start - FIRST_OFFSET + 1
        for i in range(first, len(names)):
            name = names[i].encode()
            node = self._child(gen, name)
            if node is not None and not emit(name, node, i + FIRST_OFFSET):
                return


class DerivedFile(Node):
    """One file of a published derived set: immutable, read from its backing file."""

    times_by_anyone = True  # (refused with EPERM for all: a pack is not an object)
    __slots__ = ("fmt", "number", "rel", "backing", "_size", "_mtime", "retired")

    def __init__(
        self,
        ctx: Context,
        parent: Node,
        gen: Generation,
        rel: str,
        name: bytes,
        retired: bool = False,
    ) -> None:
        # A pack, idx or graph name is its content's checksum (and a .keep never changes):
        # one inode across the generations that share the file, so the kernel's cached
        # pages survive an intake. A reused name gets an inode per generation.
        ident = (
            ("derived", gen.fmt, rel)
            if name not in REUSED_NAMES
            else ("derived", gen.fmt, rel, gen.number)
        )
        super().__init__(ctx, ident, parent, name)
        self.fmt = gen.fmt
        self.number = gen.number
        self.rel = rel
        self.backing = str(gen.root / rel)
        self._size = gen.files[rel]
        self._mtime = gen.mtimes.get(rel, ctx.started_ns)
        self.retired = retired  # resolved from a retired generation, for its grace

    @property
    def entry_timeout(self) -> float:  # type: ignore[override]
        """Short for a name the next set has again, or one only a retired set has; its
        content's own inode never changes."""
        return DYNAMIC_TIMEOUT if self.retired or self.name in REUSED_NAMES else OBJECT_TIMEOUT

    def describe(self) -> str:
        return f"{self.path} (derived generation {self.number})"

    def size(self) -> int:
        return self._size

    def mtime_ns(self) -> int:
        return self._mtime

    async def setattr(
        self,
        attr: EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> EntryAttributes:
        if changes_anything(fields):
            # git's freshening utime on a pack, every gc: EPERM (git then freshens the
            # objects it needs through their loose paths), logged at debug only
            times_only = not (fields.update_size or fields.update_mode)
            times_only = times_only and not (fields.update_uid or fields.update_gid)
            fail(errno.EPERM, f"{self.path} is a derived file: it never changes", quiet=times_only)
        return self.attr()

    async def open(self, flags: int, req: RequestContext) -> Handle:
        if wants_write(flags):
            fail(errno.EPERM, f"{self.path} is a derived file: it never changes")
        served = derived_packs.served(self.ctx)
        number, backing = self.number, self.backing
        gen = served.current(self.fmt)
        if gen is not None and self.name not in REUSED_NAMES and self.rel in gen.files:
            # the same file in the published set (a name is its content's checksum):
            # open it there, so a retired generation can go
            number, backing = gen.number, str(gen.root / self.rel)
        handle = DerivedHandle(self, -1, number)
        if not served.acquire(self.fmt, number, handle):
            fail(errno.ENOENT, f"{self.path}: its generation was retired")
        try:
            handle.fd = os.open(backing, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            await served.release(self.fmt, number, handle)
            fail(errno.ENOENT if exc.errno == errno.ENOENT else errno.EIO, str(exc))
        return handle


class DerivedHandle(Handle):
    """An open derived file: its generation is held until release, or until the daemon
    revokes the handle (a retired generation held too long: daemon/packs.py). Revoking
    puts /dev/null under the descriptor (dup2: its number is never reused meanwhile),
    so the retired file's space goes back at once; reads then fail with EIO."""

    keep_cache = True

    def __init__(self, node: DerivedFile, fd: int, number: int) -> None:
        super().__init__(node)
        self.fd = fd
        self.number = number  # the generation held
        self.revoked = False
        self._fd_lock = threading.Lock()  # revoke (a thread) against release's close

    def shared_rel(self) -> str | None:
        node = self.node
        assert isinstance(node, DerivedFile)
        return None if node.name in REUSED_NAMES else node.rel

    def revoke(self) -> None:
        """(any thread) Stop serving this handle: its generation goes."""
        self.revoked = True
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            with self._fd_lock:
                if self.fd >= 0:
                    os.dup2(null, self.fd)
        finally:
            os.close(null)

    async def read(self, off: int, size: int) -> bytes:
        node = self.node
        assert isinstance(node, DerivedFile)
        if size <= INLINE_READ:
            data = os.pread(self.fd, size, off)
        else:
            data = await node.ctx.run_sync(os.pread, self.fd, size, off)
        if self.revoked:  # (checked after the read: a read that raced it may be /dev/null's)
            fail(errno.EIO, f"{node.path}: its retired generation was held too long and went")
        return data

    async def release(self) -> None:
        node = self.node
        assert isinstance(node, DerivedFile)
        with self._fd_lock:
            fd, self.fd = self.fd, -1
            if fd >= 0:
                os.close(fd)
        if fd >= 0:
            await derived_packs.served(node.ctx).release(node.fmt, self.number, self)
