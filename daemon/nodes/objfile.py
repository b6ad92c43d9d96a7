"""An object as a file: read-only, verified before any byte is served, cacheable; its
extended attributes (algorithm, size, tier, git type, pins; `user.alkfs.pin.NAME` pins)."""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Self

import pyfuse3
from pyfuse3 import RequestContext

from alkfs.errors import Corrupt
from alkfs.git.objects import MAX_HEADER, parse_header
from alkfs.keys import Key
from alkfs.pins import valid_pin_name
from alkfs.store import ObjectStat

from ..errors import fail
from .base import BLKSIZE, File, Node, SetattrFields
from .handles import Handle, LoadedHandle
from .largefile import LargeHandle
from .pinning import pin_object, unpin_object
from .policy import noop_setattr

if TYPE_CHECKING:
    from ..context import Context

log = logging.getLogger("alkfsd")

INLINE_VERIFY = 65536  # kv objects up to this size are loaded and hashed on the trio thread

XATTR = b"user.alkfs."
X_ALGO = b"user.alkfs.algorithm"
X_SIZE = b"user.alkfs.size"
X_TIER = b"user.alkfs.tier"
X_GIT_TYPE = b"user.alkfs.git.type"
X_PINS = b"user.alkfs.pins"
PINS_LISTED = 256  # pin names an object's xattrs show at most
PINS_VALUE_MAX = 16 << 10  # bytes of user.alkfs.pins at most (the kernel's limit: 64 KiB)
X_PIN = b"user.alkfs.pin."
READ_ONLY_XATTRS = (X_ALGO, X_SIZE, X_TIER, X_GIT_TYPE, X_PINS)
OBJECT_MODE = stat.S_IFREG | 0o444


def format_ns(ns: int) -> str:
    """A creation time as text: ISO 8601, UTC, milliseconds (as the sweep report's)."""
    return datetime.fromtimestamp(ns / 1e9, UTC).isoformat(timespec="milliseconds")


class ObjectFile(File):
    """One object. Attributes come from the listing or lookup that made the node.

    `pushed`: the kernel's inode was given this file's pages at its first open (see
    `push`). Nodes handed to the kernel are made with `fresh`, which carries the flag
    over from the instance the inode table holds."""

    times_by_anyone = True  # touch freshens: git does it on what it finds in an alternate
    __slots__ = ("st", "pushed")

    def __init__(
        self, ctx: Context, parent: Node, st: ObjectStat, name: bytes | None = None
    ) -> None:
        raw = st.key.raw
        self.ctx = ctx
        self.ident = ("object", raw)
        self.parent = parent
        self.name = raw[1:].hex().encode() if name is None else name
        self.ino = 0
        self.st = st
        self.pushed = False

    @classmethod
    def fresh(cls, ctx: Context, parent: Node, st: ObjectStat, *args: bytes | None) -> Self:
        """A node about to be handed to the kernel. It replaces the instance the inode
        table holds, so it inherits `pushed`; when the table holds none, the kernel has no
        inode of it (never had, or forgot it) and the next open may push pages again."""
        node = cls(ctx, parent, st, *args)
        old = ctx.inodes.known(node.ident)
        if isinstance(old, ObjectFile):
            node.pushed = old.pushed
        return node

    def may_push(self) -> bool:
        """Claim the one push of this kernel inode's pages, if this is the instance the
        kernel's inode maps to and the object loads without an await (INLINE_VERIFY):
        the push must come before any other open of the inode is answered, and an await
        between the claim and the push would let one be (its read would then hold the
        page the push needs, and the trio thread would wait on it for ever)."""
        if self.pushed or not self.ctx.live or self.st.size > INLINE_VERIFY:
            return False
        if not self.ino or self.ctx.inodes.get(self.ino) is not self:
            return False
        self.pushed = True
        return True

    def push(self, data: bytes) -> None:
        """Give the kernel's inode the file's pages while answering its first open: the
        read, and the attribute refresh a read causes, never come.

        Free of deadlock: the kernel holds a page locked while a read of it waits for
        us, and no read of an inode can be pending before the first open of it is
        answered (the load before the push never awaits: `may_push`); a later open of the
        same kernel inode, on this instance or on one that replaced it (`fresh`), never
        pushes."""
        if not data:
            return
        try:
            pyfuse3.notify_store(self.ino, 0, data)
        except OSError as exc:  # the kernel dropped the inode meanwhile: reads still work
            log.debug("notify_store %s: %s", self.describe(), exc)

    @property
    def key(self) -> Key:
        return self.st.key

    def ino_seed(self) -> int:
        raw = self.st.key.raw
        return int.from_bytes(raw[1:9], "big") ^ (raw[0] << 56)

    def attr(self) -> pyfuse3.EntryAttributes:
        # The generic Node.attr, unrolled: readdirplus builds one per listed object.
        # (size() stays a call: subclasses such as the loose view report another size.)
        st = self.st
        a = pyfuse3.EntryAttributes()
        a.st_ino = self.ino
        a.entry_timeout = a.attr_timeout = self.entry_timeout
        a.st_mode = OBJECT_MODE & self.ctx.mode_mask
        a.st_nlink = 1
        a.st_uid = self.ctx.uid
        a.st_gid = self.ctx.gid
        a.st_size = size = self.size()
        a.st_blksize = BLKSIZE
        a.st_blocks = (size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = st.stored_ns
        return a

    def describe(self) -> str:
        return str(self.st.key)

    def mode(self) -> int:
        return stat.S_IFREG | 0o444

    def size(self) -> int:
        return self.st.size

    def mtime_ns(self) -> int:
        return self.st.stored_ns

    # -- reads ------------------------------------------------------------------------
    async def open(self, flags: int, req: RequestContext) -> Handle:
        # O_APPEND alone is no write (Linux opens O_RDONLY|O_APPEND for reading).
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC):
            fail(errno.EPERM, f"{self.key} is immutable")
        store = self.ctx.store
        key = self.key
        if self.st.tier == "large":
            if key.raw in store.corrupt:
                raise Corrupt(f"{key} is known to be corrupt")
            path = store.large_path(key)
            if path is None:
                fail(errno.ENOENT)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                fst = os.fstat(fd)
                verified = store.is_verified(key, fst)
                record = None if verified else store.record(key)  # (one indexed SELECT)
            except BaseException:
                os.close(fd)
                raise
            return LargeHandle(self, fd, fst, record, verified)
        # (a packed object is inflated and its delta chain applied: never on the trio thread)
        inline = self.st.size if self.st.tier != "packs" else INLINE_VERIFY + 1
        handle = LoadedHandle(self, functools.partial(verified_get, self.ctx, self.key, inline))
        if self.may_push():
            self.push(await handle.load())  # verified: a corrupt object fails its open
        return handle

    # -- touch: freshen -----------------------------------------------------------------
    async def setattr(
        self,
        attr: pyfuse3.EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> pyfuse3.EntryAttributes:
        # A chmod/chown/truncate to what it is already is a no-op (cp -p, rsync -a).
        if noop_setattr(self, attr, fields):
            if not await self.ctx.run_sync(self.ctx.store.freshen, self.key):
                fail(errno.ENOENT, f"{self.key} is gone")
            st = self.ctx.store.stat(self.key)
            if st is not None:
                self.st = st
        return self.attr()

    # -- extended attributes -----------------------------------------------------------------
    def _pin_names(self) -> list[str]:
        """The first PINS_LISTED names of its pins: an object may be pinned by thousands of
        paths (the empty file in a backup tree), and an xattr list or value over 64 KiB
        fails for the reader (E2BIG) with cp -a, rsync -X or getfattr -d."""
        return [str(n) for n in self.ctx.pins.names_for(self.key, PINS_LISTED)]

    def _pins_value(self, names: list[str]) -> bytes:
        """user.alkfs.pins: the names, comma-separated, at most PINS_VALUE_MAX bytes (then
        `,...` after the last whole name)."""
        out = b""
        for n in names:
            part = (b"," if out else b"") + n.encode("utf-8", "surrogateescape")
            if len(out) + len(part) > PINS_VALUE_MAX:
                return out + b",..."
            out += part
        return out + (b",..." if len(names) >= PINS_LISTED else b"")

    def _git_type(self) -> str:
        store = self.ctx.store
        head: bytes | None
        if self.st.tier == "large":
            path = store.large_path(self.key)
            with open(path, "rb") as f:  # type: ignore[arg-type]
                head = f.read(MAX_HEADER)
        elif self.st.tier == "packs":
            head = store.get(self.key)  # (verified, from its pack)
        else:
            value = store.kv_value(self.key)
            head = None if value is None else value[:MAX_HEADER]
        if head is None:
            fail(errno.ENOENT)
        return parse_header(head)[0]

    async def listxattr(self, req: RequestContext) -> list[bytes]:
        names = [X_ALGO, X_SIZE, X_TIER]
        if self.key.algo.is_git:
            names.append(X_GIT_TYPE)
        names.append(X_PINS)
        # (the xattr form's names only: a pin path with '/' or odd bytes is no xattr name)
        pinned = await self.ctx.run_sync(self._pin_names)  # (a query: off the trio thread)
        names += [X_PIN + n.encode() for n in pinned if valid_pin_name(n)]
        return names

    async def getxattr(self, name: bytes, req: RequestContext) -> bytes:
        if name == X_ALGO:
            return self.key.algo.label.encode()
        if name == X_SIZE:
            return str(self.st.size).encode()
        if name == X_TIER:
            return self.st.tier.encode() if self.st.tier in ("large", "packs") else b"kv"
        if name == X_GIT_TYPE and self.key.algo.is_git:
            # (a sqlite read, or a packed object inflated: off the trio thread)
            return (await self.ctx.run_sync(self._git_type)).encode()
        if name == X_PINS:
            return self._pins_value(await self.ctx.run_sync(self._pin_names))
        if name.startswith(X_PIN):
            pin_name = name[len(X_PIN) :].decode("utf-8", "surrogateescape")
            rec = self.ctx.pins.get(pin_name)
            if rec is not None and rec.key == self.key:
                return format_ns(rec.created_ns).encode()
        fail(errno.ENODATA)

    async def setxattr(self, name: bytes, value: bytes, req: RequestContext) -> None:
        if name in READ_ONLY_XATTRS:
            fail(errno.EPERM, f"{name.decode()} is read-only")
        if name.startswith(X_PIN):  # pin as <name>: EINVAL for a bad name, EEXIST if taken
            await self._pin(name[len(X_PIN) :].decode("utf-8", "surrogateescape"))
            return
        fail(errno.ENOTSUP, f"no settable attribute {name!r}")

    async def removexattr(self, name: bytes, req: RequestContext) -> None:
        if name in READ_ONLY_XATTRS:
            fail(errno.EPERM, f"{name.decode()} is read-only")
        if name.startswith(X_PIN) and len(name) > len(X_PIN):
            await self._unpin(name[len(X_PIN) :].decode("utf-8", "surrogateescape"))
            return
        fail(errno.ENODATA)

    async def _pin(self, name: str) -> None:
        await pin_object(self.ctx, name, self.key)

    async def _unpin(self, name: str) -> None:
        await unpin_object(self.ctx, name, self.key)


async def verified_get(ctx: Context, key: Key, size: int) -> bytes:
    """A kv object's bytes, verified (a small one inline: no thread hop); ENOENT if gone."""
    if size <= INLINE_VERIFY:
        data = ctx.store.get(key)
    else:
        data = await ctx.run_sync(ctx.store.get, key)
    if data is None:
        fail(errno.ENOENT, f"{key} is gone")
    return data
