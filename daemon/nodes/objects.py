"""/objects/<algo>/<hex>: every stored object as a read-only, verified, cacheable file
(the files: objfile.py)."""

from __future__ import annotations

import errno
import time
from typing import TYPE_CHECKING, cast

from pyfuse3 import EntryAttributes, RequestContext

from alkfs.errors import Invalid
from alkfs.keys import Algorithm, Key
from alkfs.store import ObjectStat, PutResult, Store

from ..errors import fail
from ..staging.staged import StagedFile
from .base import DYNAMIC_TIMEOUT, FIRST_OFFSET, Emit, File, Node, SetattrFields, StaticDir
from .base import Dir as _Dir
from .handles import DirHandle, Handle
from .listing import PAGE, after_cookie
from .objfile import ObjectFile
from .policy import noop_setattr

if TYPE_CHECKING:
    from ..context import Context


ABSENT_TTL_S = DYNAMIC_TIMEOUT  # (as long as the kernel keeps a pin's entry)
ABSENT_MAX = 1024


class Absent:
    """Keys a lookup found absent, answered again without a query while no put has
    ended since (`Store.puts`) and for at most ABSENT_TTL_S: a new file's name is looked
    up three times before it is written (cp's stat, the kernel's O_EXCL lookup, the
    create's check). Only where this process makes every change to the store (not a
    fleet's member, nor a store opened beside its lock holder)."""

    __slots__ = ("store", "on", "keys")

    def __init__(self, store: Store) -> None:
        self.store = store
        self.on = store.sole_writer
        self.keys: dict[bytes, tuple[int, float]] = {}

    def stat(self, key: Key) -> ObjectStat | None:
        store = self.store
        seen = self.keys.get(key.raw)
        if seen is not None:
            if seen[0] == store.puts and time.monotonic() - seen[1] < ABSENT_TTL_S:
                return None
            del self.keys[key.raw]
        puts = store.puts
        st = store.stat(key)
        if st is None and self.on and puts == store.puts:
            if len(self.keys) >= ABSENT_MAX:
                self.keys.clear()
            self.keys[key.raw] = (puts, time.monotonic())
        return st


class ObjectsDir(StaticDir):
    """/objects: one directory per algorithm, always listed."""

    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("dir", "/objects"), parent, b"objects")
        for _, node in self._entries():
            ctx.inodes.remember(node, permanent=True)
        ctx.deletion_views.append(self._deleted)

    def children(self) -> list[tuple[bytes, Node]]:
        return [(a.label.encode(), AlgoDir(self.ctx, self, a)) for a in Algorithm]

    def algo_dir(self, algo: Algorithm) -> AlgoDir:
        node = self._index[algo.label.encode()]
        assert isinstance(node, AlgoDir)
        return node

    async def setattr(
        self,
        attr: EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> EntryAttributes:
        noop_setattr(self, attr, fields)  # times are accepted and ignored (cp -rp)
        return self.attr()

    def _deleted(self, key: Key) -> list[tuple[int, bytes, int]]:
        known = self.ctx.inodes.known(("object", key.raw))
        if known is None:  # the kernel never kept an entry of it (none is cached as absent)
            return []
        d = self.algo_dir(key.algo)
        return [(d.ino, key.hex.encode(), known.ino)]


class AlgoDir(_Dir):
    """/objects/<algo>: lists in key order, a page at a time, resuming from the last key.

    Writing: a file created here under any name is a StagedFile; when it is closed its
    content is stored under this algorithm (checked against the name when the name is
    a digest), the in-process pin is released at once (nothing names the object: it
    lives by the window: docs/gc.md), and the created name disappears. The names being
    written resolve by lookup but are not listed."""

    __slots__ = ("algo", "staged", "absent")

    def __init__(self, ctx: Context, parent: Node, algo: Algorithm) -> None:
        super().__init__(ctx, ("dir", f"/objects/{algo.label}"), parent, algo.label.encode())
        self.algo = algo
        self.staged: dict[bytes, StagedFile] = {}
        self.absent = Absent(ctx.store)

    def key_of(self, name: bytes) -> Key | None:
        if len(name) != self.algo.hex_len:
            return None
        try:
            return Key.from_hex(self.algo, name.decode("ascii"))
        except (UnicodeDecodeError, Invalid):
            return None

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        key = self.key_of(name)
        if key is None:
            staged = self.staged.get(name)
            if staged is None:
                fail(errno.ENOENT)
            return staged
        st = self.absent.stat(key)
        if st is None:
            staged = self.staged.get(name)
            if staged is None:
                fail(errno.ENOENT)
            return staged
        return ObjectFile.fresh(self.ctx, self, st)

    async def setattr(
        self,
        attr: EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> EntryAttributes:
        noop_setattr(self, attr, fields)  # times are accepted and ignored (cp -rp)
        return self.attr()

    # -- writing ------------------------------------------------------------------------
    async def create(
        self, name: bytes, mode: int, flags: int, req: RequestContext
    ) -> tuple[Node, Handle]:
        if name in self.staged:
            fail(errno.EEXIST, f"{self.path}/{name.decode(errors='replace')} is being written")
        expect = self.key_of(name)
        if expect is not None and self.absent.stat(expect) is not None:
            fail(errno.EEXIST, f"{expect} exists")
        node = StagedFile(self.ctx, self, name, self.algo, expect=expect, mode=mode)
        self.staged[name] = node
        return node, node.new_handle(flags)

    def store_ahead(self, node: StagedFile, data: bytes) -> PutResult | None:
        if node.key is None:  # (a first commit: acknowledged once logged)
            return self.ctx.pending.put(None, self.algo, data, node.writer.expect)
        return None

    def store_small(self, node: StagedFile, data: bytes) -> PutResult | None:
        return None  # the plain put: nothing is named

    def publish_in_thread(self, node: StagedFile, result: PutResult) -> None:
        return None  # nothing is named: the object lives by the window

    def stored_file(self, st: ObjectStat) -> File:
        return ObjectFile(self.ctx, self, st)

    async def publish(self, node: StagedFile, result: PutResult) -> None:
        result.pin.release()  # no name to publish: the object lives by the window
        self._forget(node)

    async def closed(self, node: StagedFile) -> None:
        self._forget(node)

    def _forget(self, node: StagedFile) -> None:
        """The created name disappears (a StagedFile's entry timeout is 0: the kernel
        asks again at the next use of the name)."""
        if self.staged.get(node.name) is node:
            del self.staged[node.name]

    async def unlink(self, name: bytes, req: RequestContext) -> None:
        staged = self.staged.pop(name, None)
        if staged is not None:  # a file being written, given up: nothing is stored
            staged.unlinked = True
            return
        key = self.key_of(name)
        if key is None or not self.ctx.store.has(key):
            fail(errno.ENOENT)
        fail(errno.EPERM, f"{key} cannot be removed: deletion is the sweep's job")

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        """One query fetches PAGE objects; the kernel takes a few hundred entries per call,
        so what it did not take waits in `dh.state` for the next call, which resumes
        after the last entry given (any other offset restarts from that offset's key)."""
        store, ctx, state = self.ctx.store, self.ctx, dh.state
        recent = cast(dict[int, bytes], state.setdefault("recent", {}))
        ahead: list[ObjectStat]
        after: Key | None
        if start >= FIRST_OFFSET and state.get("last") == start:
            ahead = cast(list[ObjectStat], state["ahead"])
            after = cast(Key | None, state["after"])
            done = cast(bool, state["done"])
        else:
            ahead, done = [], False
            if start < FIRST_OFFSET:
                after = None
            elif (raw := recent.get(start)) is not None:
                after = Key(raw)
            else:
                after = after_cookie(self.algo, start)
        i = 0
        try:
            while True:
                while i < len(ahead):
                    st = ahead[i]
                    raw = st.key.raw
                    c = (int.from_bytes(raw[1:9], "big") >> 2) + FIRST_OFFSET  # cookie()
                    name = raw[1:].hex().encode()
                    if not emit(name, ObjectFile.fresh(ctx, self, st, name), c):
                        return
                    i += 1
                    state["last"] = c
                    if len(recent) > 4 * PAGE:
                        recent.clear()
                    recent[c] = raw
                if done:
                    return
                ahead, i = store.list(after=after, limit=PAGE, algo=self.algo), 0
                done = len(ahead) < PAGE
                if ahead:
                    after = ahead[-1].key
        finally:
            state.update(ahead=ahead[i:], after=after, done=done)
