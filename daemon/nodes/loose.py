"""/git/<format>/<xx>/<rest>: the loose form of every stored git object (see gitview.py),
and the fan-out directories that resolve, list and take them (git's loose writes)."""

from __future__ import annotations

import errno
import logging
import os
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

from pyfuse3 import EntryAttributes, RequestContext

from alkfs.errors import Corrupt, Invalid
from alkfs.git.objects import BLOCK, encode_loose, loose_size
from alkfs.keys import Algorithm, Key
from alkfs.store import ObjectStat

from .. import listings
from .. import packs as derived_packs
from ..errors import fail
from ..staging import ingest
from ..staging.overlay import ScratchOverlay
from ..staging.scratch import ScratchFile
from ..staging.writes import RepoKey, pid_of
from .base import FIRST_OFFSET, Dir, Emit, Node, SetattrFields, changes_anything
from .handles import DirHandle, Handle, LoadedHandle, wants_write
from .listing import PAGE, after_cookie, cookie
from .objfile import INLINE_VERIFY, LargeHandle, ObjectFile, verified_get

if TYPE_CHECKING:
    from alkfs.git.refs import Repo

    from ..context import Context

log = logging.getLogger("alkfsd")

FANOUT = tuple(b"%02x" % i for i in range(256))
FIRST_PAGE = 64  # objects asked for by the first listing query of a fan-out directory
ADLER_CHUNK = 1 << 20
LOOSE_INO = 1 << 61  # keeps loose-file inode numbers apart from /objects' ones
_ZHEADER = b"\x78\x01"
_STRIDE = BLOCK + 5  # a stored block: 5 header bytes, then up to BLOCK bytes of the object


# -- the loose form by arithmetic ---------------------------------------------------------------
def loose_segments(
    n: int, offset: int, size: int
) -> Iterator[bytes | tuple[int, int] | slice[int, int, int | None]]:
    """Bytes [offset, offset+size) of the loose file of an `n`-byte object, in order, as
    `bytes` (framing: the zlib header, stored-block headers), `(start, length)` (a range
    of the canonical object) or a `slice` of the big-endian adler32 trailer."""
    total = loose_size(n)
    end = min(offset + size, total)
    trailer = total - 4
    last = max(1, -(-n // BLOCK)) - 1
    pos = max(offset, 0)
    while pos < end:
        if pos < 2:
            yield _ZHEADER[pos:end]
            pos = min(end, 2)
        elif pos >= trailer:
            yield slice(pos - trailer, end - trailer)
            pos = end
        else:
            block, within = divmod(pos - 2, _STRIDE)
            start = block * BLOCK
            clen = min(BLOCK, n - start)
            if within < 5:
                head = (
                    bytes([block == last])
                    + clen.to_bytes(2, "little")
                    + (clen ^ 0xFFFF).to_bytes(2, "little")
                )
                piece = head[within : within + end - pos]
                yield piece
                pos += len(piece)
            else:
                cpos = start + within - 5
                length = min(start + clen, cpos + end - pos) - cpos
                yield (cpos, length)
                pos += length


def repo_fanout_ident(repo: Repo, xx: bytes) -> tuple[str, str, int, bytes]:
    """The identity of /repos/<id>/objects/<xx> (repos.py), found here when objects go."""
    return ("repo-fanout", repo.id, repo.created_ns, xx)


class Sizes:
    """What the fan-out directories of one object directory learn about their size: the
    objects in the last prefix listed whole, which sizes the first query of the next."""

    __slots__ = ("typical",)

    def __init__(self) -> None:
        self.typical = FIRST_PAGE


class FanoutDir(Dir):
    """/git/<format>/<xx>: the objects whose id starts with xx, listed a page at a time in
    key order (offsets are the objects' cookies, as in /objects). The kernel caches the
    listing, checked at each open against the listing then (daemon/listings.py): git lists
    all 256 in every process that abbreviates an id, and most hold nothing unpacked. So
    does /repos/<id>/objects/<xx>, which lists nothing."""

    caches_listing = True
    __slots__ = ("algo", "prefix", "overlay", "sizes")

    def mtime_ns(self) -> int:
        return listings.of(self.ctx).mtime_ns(self.ino, self.ctx.started_ns)

    def __init__(
        self,
        ctx: Context,
        parent: Node,
        algo: Algorithm,
        xx: bytes,
        ident: tuple | None = None,
        sizes: Sizes | None = None,
    ) -> None:
        super().__init__(ctx, ident or ("dir", f"{parent.path}/{xx.decode()}"), parent, xx)
        self.algo = algo
        self.prefix = int(xx, 16)
        self.sizes = sizes  # (shared by the 256 of /git/<format>; none in /repos)
        self.overlay = ScratchOverlay(self, self)  # (this directory adopts: `adopt`)

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        if len(name) != self.algo.hex_len - 2:
            node = self.overlay.lookup(name)  # git's tmp_obj_* (never 38 or 62 long)
            if node is None:
                fail(errno.ENOENT)
            return node
        try:
            key = Key.from_hex(self.algo, self.name.decode() + name.decode("ascii"))
        except (UnicodeDecodeError, Invalid):
            fail(errno.ENOENT)
        st = self.ctx.store.stat(key)
        if st is None:
            fail(errno.ENOENT)
        return LooseFile.fresh(self.ctx, self, st)

    def listing_known_empty(self) -> bool:
        fmt = "sha1" if self.algo is Algorithm.GIT_SHA1 else "sha256"
        return derived_packs.served(self.ctx).known_empty(fmt, self.prefix)

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        """The kernel takes a few dozen entries per call: what one query fetched beyond
        them waits in `dh.state` for the next call, which resumes after the last entry
        it was given (any other offset restarts from that offset's key)."""
        algo, prefix, state_ = self.algo, self.prefix, dh.state
        fmt = "sha1" if algo is Algorithm.GIT_SHA1 else "sha256"
        unpacked = await derived_packs.served(self.ctx).unpacked(fmt, prefix)
        if unpacked is not None:  # a set is published: list only what it lacks
            for st in unpacked:
                c = cookie(st.key)
                if c <= start:
                    continue
                if not emit(st.key.hex[2:].encode(), LooseFile.fresh(self.ctx, self, st), c):
                    return
            return
        recent = cast(dict[int, bytes], state_.setdefault("recent", {}))
        ahead: list[ObjectStat]
        after: Key | None
        if start >= FIRST_OFFSET and state_.get("last") == start:
            ahead = cast(list[ObjectStat], state_["ahead"])
            after = cast(Key | None, state_["after"])
            done, count = cast(bool, state_["done"]), cast(int, state_["count"])
        else:
            ahead, done, count = [], False, 0
            if start < FIRST_OFFSET:
                rest = algo.digest_len - 1
                after = Key.of(algo, bytes([prefix - 1]) + b"\xff" * rest) if prefix else None
            else:
                raw = recent.get(start)
                after = Key(raw) if raw is not None else after_cookie(algo, start)
                count = -1  # not listed from the start: says nothing about the prefix's size
        typical = self.sizes.typical if self.sizes is not None else FIRST_PAGE
        limit = max(FIRST_PAGE, typical + typical // 4 + 8)
        i = 0
        try:
            while True:
                while i < len(ahead):
                    st = ahead[i]
                    c = cookie(st.key)
                    if not emit(st.key.hex[2:].encode(), LooseFile.fresh(self.ctx, self, st), c):
                        return
                    i += 1
                    state_["last"] = c
                    if len(recent) > 4 * PAGE:
                        recent.clear()
                    recent[c] = st.key.raw
                if done:
                    return
                page = self.ctx.store.list(after=after, limit=limit, algo=algo)
                ahead, i = [st for st in page if st.key.raw[1] == prefix], 0
                done = len(ahead) < len(page) or len(page) < limit
                if page:
                    after = page[-1].key
                if count >= 0:
                    count += len(ahead)
                    if done and self.sizes is not None:
                        self.sizes.typical = count
                limit = min(limit * 2, PAGE)
        finally:
            state_.update(ahead=ahead[i:], after=after, done=done, count=count)

    # -- git's writes ---------------------------------------------------------------------
    def repo_key(self) -> RepoKey | None:
        """The repository whose pins objects stored here join (none in /git/<format>)."""
        return None

    def key_of(self, name: bytes) -> Key | None:
        if len(name) != self.algo.hex_len - 2:
            return None
        try:
            return Key.from_hex(self.algo, self.name.decode() + name.decode("ascii"))
        except (UnicodeDecodeError, Invalid):
            return None

    async def adopt(self, name: bytes, node: Node, req: RequestContext) -> Node:
        """`link`/`rename` of a scratch file to `<xx>/<rest>`: verify and store it."""
        key = self.key_of(name)
        if key is None:
            fail(errno.EINVAL, f"{name!r} is not an object name of {self.path}")
        if not isinstance(node, ScratchFile):
            fail(errno.EPERM, f"{node.path} is not a file git is writing")
        st = await ingest.ingest(self.ctx, node, self.algo, key.hex, self.repo_key(), pid_of(req))
        return LooseFile.fresh(self.ctx, self, st)

    async def arrived(self, name: bytes, req: RequestContext) -> None:
        return None

    def scratch(self) -> ScratchOverlay:
        return self.overlay

    async def create(
        self, name: bytes, mode: int, flags: int, req: RequestContext
    ) -> tuple[Node, Handle]:
        if self.key_of(name) is not None:
            fail(errno.EPERM, "objects are written as a temporary file, then linked")
        return await self.overlay.create(name, mode, flags, req)

    async def link(self, name: bytes, node: Node, req: RequestContext) -> Node:
        if self.key_of(name) is not None:
            return await self.adopt(name, node, req)
        return await self.overlay.link(name, node)

    async def unlink(self, name: bytes, req: RequestContext) -> None:
        if not self.overlay.unlink(name):
            await super().unlink(name, req)  # an object: EPERM (deletion is the sweep's)

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, req: RequestContext
    ) -> None:
        if not await self.overlay.rename(name, new_parent, new_name, flags, req):
            await super().rename(name, new_parent, new_name, flags, req)


class LooseFile(ObjectFile):
    """One object in loose form. The same inode under /git/<format>/<xx>/ and every
    /repos/<id>/objects/<xx>/, so the kernel's cached pages serve them all. Attributes,
    times (touch freshens: git freshens what it finds in an alternate) and extended
    attributes are the object's, as in /objects."""

    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node, st: ObjectStat) -> None:
        super().__init__(ctx, parent, st, st.key.raw[2:].hex().encode())
        self.ident = ("loose", st.key.raw)

    def ino_seed(self) -> int:
        raw = self.st.key.raw
        return int.from_bytes(raw[1:9], "big") ^ (raw[0] << 56) ^ LOOSE_INO

    def describe(self) -> str:
        return f"{self.st.key} (loose)"

    def size(self) -> int:
        return loose_size(self.st.size)

    async def setattr(
        self,
        attr: EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> EntryAttributes:
        """touch/utime freshens (ObjectFile); a toucher working for a push pins it first."""
        if changes_anything(fields):
            await ingest.freshened(self.ctx, self.key, pid_of(req))
        return await super().setattr(attr, fields, handle, req)

    async def open(self, flags: int, req: RequestContext) -> Handle:
        if wants_write(flags):
            fail(errno.EPERM, f"{self.key} is immutable")
        if self.st.tier == "large":
            inner = await super().open(flags, req)
            assert isinstance(inner, LargeHandle)
            return LooseLargeHandle(self, inner)
        handle = LoadedHandle(self, self.load)
        if self.may_push():
            self.push(await handle.load())
        return handle

    async def load(self) -> bytes:
        """The loose file of a kv object, verified (small ones inline, no thread hop; a
        packed one in a thread)."""
        size = self.st.size if self.st.tier != "packs" else INLINE_VERIFY + 1
        return encode_loose(await verified_get(self.ctx, self.key, size))


class LooseLargeHandle(Handle):
    """A large object in loose form: the canonical bytes come from the /objects reader
    (pread, verified as they are served), the framing is arithmetic, and the adler32
    trailer is summed along sequential reads (a thread finishes it otherwise)."""

    keep_cache = True

    def __init__(self, node: LooseFile, inner: LargeHandle) -> None:
        super().__init__(node)
        self.loose = node
        self.inner = inner
        self.n = inner.size
        self.adler_pos = 0
        self.adler = 1

    async def read(self, off: int, size: int) -> bytes:
        out = bytearray()
        for seg in loose_segments(self.n, off, size):
            if isinstance(seg, bytes):
                out += seg
            elif isinstance(seg, tuple):
                start, length = seg
                data = await self.inner.read(start, length)
                if len(data) != length:
                    raise Corrupt(f"{self.loose.key}: the file is shorter than its size")
                if start == self.adler_pos:
                    self.adler = zlib.adler32(data, self.adler)
                    self.adler_pos += length
                out += data
            else:
                out += (await self._adler32()).to_bytes(4, "big")[seg]
        return bytes(out)

    async def _adler32(self) -> int:
        if self.n:
            await self.inner.read(self.n - 1, 1)  # completes the verification, or fails
        if self.adler_pos < self.n:  # not read in order: sum the rest in a thread
            await self.loose.ctx.run_sync(self._sum_rest)
        return self.adler

    def _sum_rest(self) -> None:
        value, pos = self.adler, self.adler_pos
        while pos < self.n:
            chunk = os.pread(self.inner.fd, min(ADLER_CHUNK, self.n - pos), pos)
            if not chunk:
                raise Corrupt(f"{self.loose.key}: the file is shorter than its size")
            value = zlib.adler32(chunk, value)
            pos += len(chunk)
        self.adler, self.adler_pos = value, pos

    async def release(self) -> None:
        await self.inner.release()
