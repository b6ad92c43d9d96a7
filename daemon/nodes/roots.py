"""/roots: every registered borrower as a symbolic link `<name> -> /its/path` (docs/gc.md).

- `ln -s /path/to/repo NAME` registers the repository at that absolute path (a work
  tree or a git dir) as NAME (EINVAL: a relative target, a path in this mount, not a
  git repository, a bad name; EEXIST: NAME is another path's).
- `rm NAME` unregisters it (ENOENT when there is none).
- Changing it is root's and the mount owner's alone (fs.py's `may_change`), as for pins.

Entries and attributes expire after a second: the command line changes roots too.
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING

from pyfuse3 import RequestContext

from alkfs.errors import Exists, Invalid, Missing
from alkfs.pins import valid_pin_name
from alkfs.roots import RootRecord

from ..errors import clip, fail
from .base import DYNAMIC_TIMEOUT, FIRST_OFFSET, Dir, Emit, Node, Symlink
from .handles import DirHandle
from .listing import readdir_snapshot
from .listing import text_of as _text

if TYPE_CHECKING:
    from ..context import Context


class RootsDir(Dir):
    """/roots: the registered borrowers in name order."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("dir", "/roots"), parent, b"roots")

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        text = _text(name)
        if text is None or not valid_pin_name(text):
            fail(errno.ENOENT)
        rec = await self.ctx.run_sync(self.ctx.app.roots.get, text)
        if rec is None:
            fail(errno.ENOENT)
        return RootLink(self.ctx, self, rec)

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        records: list[RootRecord] = []
        if start < FIRST_OFFSET or "entries" not in dh.state:  # (readdir_snapshot's rule)
            records = await self.ctx.run_sync(self.ctx.app.roots.list)

        def entries() -> list[tuple[bytes, Node]]:
            return [(r.name.encode(), RootLink(self.ctx, self, r)) for r in records]

        await readdir_snapshot(dh, start, emit, entries)

    async def symlink(self, name: bytes, target: bytes, req: RequestContext) -> Node:
        text = _text(name)
        if text is None or not valid_pin_name(text):
            fail(errno.EINVAL, f"invalid root name {clip(repr(name), 160)}")
        path = _text(target)
        if path is None or not os.path.isabs(path):
            fail(errno.EINVAL, f"a root's target must be an absolute path: {clip(repr(target))}")
        path = os.path.normpath(path)  # noqa: ASYNC240 (a string operation: no I/O)
        # (realpath in a worker thread: a symbolic link into this mount is followed by
        # requests this thread must answer)
        real = await self.ctx.run_sync(os.path.realpath, path)
        mnt = self.ctx.mountpoint
        if mnt is not None and any(
            p == mnt or p.startswith(mnt.rstrip("/") + "/") for p in (path, real)
        ):
            fail(
                errno.EINVAL,
                f"{clip(path)} is in this mount: its repositories' refs are roots already",
            )
        try:
            rec = await self.ctx.run_sync(self.ctx.app.roots.add, text, path)
        except Invalid as exc:
            fail(errno.EINVAL, clip(str(exc), 300))
        except Exists as exc:
            fail(errno.EEXIST, clip(str(exc), 300))
        self.ctx.invalidator.submit(self.ino, name, 0)
        return RootLink(self.ctx, self, rec)

    async def unlink(self, name: bytes, req: RequestContext) -> None:
        text = _text(name)
        if text is None or not valid_pin_name(text):
            fail(errno.ENOENT)
        try:
            await self.ctx.run_sync(self.ctx.app.roots.remove, text)
        except Missing:
            fail(errno.ENOENT)


class RootLink(Symlink):
    """One root; its time is its registration's."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ("record",)

    def __init__(self, ctx: Context, parent: Node, rec: RootRecord) -> None:
        name = rec.name.encode()
        super().__init__(
            ctx, ("root", name, rec.path, rec.created_ns), parent, name, rec.path.encode()
        )
        self.record = rec

    def mtime_ns(self) -> int:
        return self.record.created_ns
