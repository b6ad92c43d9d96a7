"""/pins: every durable pin as a symbolic link `<name> -> ../objects/<algo>/<hex>`.

Pins come and go (setfattr on an object, the command line), so entries and
attributes expire after a second. A link's identity includes the object it
names: a name pinned again to another object is another inode.
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any

from alkfs.pins import PinRecord, valid_pin_name

from ..context import DYNAMIC_TIMEOUT
from ..errors import fail
from .base import Dir, DirHandle, Emit, Node, Symlink
from .repos import readdir_snapshot

if TYPE_CHECKING:
    from ..context import Context


def target(rec: PinRecord) -> bytes:
    return f"../objects/{rec.key.algo.label}/{rec.key.hex}".encode()


class PinsDir(Dir):
    """/pins: the pins in name order."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("dir", "/pins"), parent, b"pins")

    async def lookup(self, name: bytes, ctx: Any) -> Node:
        pins = self.ctx.pins
        try:
            text = name.decode("utf-8")
        except UnicodeDecodeError:
            fail(errno.ENOENT)
        if pins is None or not valid_pin_name(text):
            fail(errno.ENOENT)
        rec = pins.get(text)
        if rec is None:
            fail(errno.ENOENT)
        return PinLink(self.ctx, self, rec)

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        def entries() -> list[tuple[bytes, Node]]:
            pins = self.ctx.pins
            records = pins.list() if pins is not None else []
            return [(r.name.encode(), PinLink(self.ctx, self, r)) for r in records]

        await readdir_snapshot(dh, start, emit, entries)


class PinLink(Symlink):
    """One pin; its time is the pin's creation time."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ("record",)

    def __init__(self, ctx: Context, parent: Node, rec: PinRecord) -> None:
        name = rec.name.encode()
        super().__init__(ctx, ("pin", name, rec.key.raw), parent, name, target(rec))
        self.record = rec

    def mtime_ns(self) -> int:
        return self.record.created_ns

    async def readlink(self, ctx: Any) -> bytes:
        rec = self.ctx.pins.get(self.record.name)
        if rec is None or rec.key != self.record.key:
            fail(errno.ENOENT, f"the pin {self.record.name} is gone")
        return self.target
