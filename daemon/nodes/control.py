"""/.alkfs: `control` (write commands), `status` (JSON) and `metrics` (Prometheus)."""

from __future__ import annotations

import errno
import stat
from typing import TYPE_CHECKING, Any

from alkfs.durations import parse_duration

from ..context import DYNAMIC_TIMEOUT
from ..errors import fail
from ..status import metrics_text, status_json
from .base import BytesHandle, File, Handle, Node, StaticDir, wants_write

if TYPE_CHECKING:
    from ..context import Context


USAGE = b"commands: sweep [WINDOW]   (e.g. sweep, sweep 0, sweep 1h)\n          verify\n"


class AlkfsDir(StaticDir):
    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("dir", "/.alkfs"), parent, b".alkfs")

    def children(self) -> list[tuple[bytes, Node]]:
        return [
            (b"control", ControlFile(self.ctx, self)),
            (b"status", StatusFile(self.ctx, self)),
            (b"metrics", MetricsFile(self.ctx, self)),
        ]


class ControlFile(File):
    """Write `sweep [WINDOW]` or `verify`; the write returns when the command is done."""

    writable_when_read_only = True
    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("file", "/.alkfs/control"), parent, b"control")

    def mode(self) -> int:
        return stat.S_IFREG | 0o600

    async def open(self, flags: int, ctx: Any) -> Handle:
        return ControlHandle(self)

    async def setattr(self, attr: Any, fields: Any, handle: Handle | None, ctx: Any) -> Any:
        # `echo sweep > control` truncates first: accept that (and touch) as no-ops.
        if fields.update_mode or fields.update_uid or fields.update_gid:
            fail(errno.EPERM, "the control file's owner and mode are fixed")
        if fields.update_size and attr.st_size != 0:
            fail(errno.EINVAL, "the control file takes commands, not data")
        return self.attr()


class ControlHandle(Handle):
    direct_io = True

    async def read(self, off: int, size: int) -> bytes:
        return USAGE[off : off + size]

    async def write(self, off: int, buf: bytes) -> int:
        try:
            text = bytes(buf).decode("utf-8")
        except UnicodeDecodeError:
            fail(errno.EINVAL, "a control command is text")
        lines = [line.split() for line in text.splitlines() if line.strip()]
        if not lines:
            fail(errno.EINVAL, "empty control command")
        for words in lines:
            await self.run(words)
        return len(buf)

    async def run(self, words: list[str]) -> None:
        ctx = self.node.ctx
        cmd, args = words[0], words[1:]
        if cmd == "sweep" and len(args) <= 1:
            window = None
            if args:
                try:
                    window = parse_duration(args[0])
                except ValueError:
                    fail(errno.EINVAL, f"not a duration: {args[0]!r}")
            if ctx.read_only:
                fail(errno.EROFS, "the mount is read-only: no sweeps")
            await ctx.sweep(window)
        elif cmd == "verify" and not args:
            await ctx.verify()
        else:
            fail(errno.EINVAL, f"unknown control command {' '.join(words)!r}")


class _Generated(File):
    """A file whose content is computed (in a worker thread) at each open."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ()

    def mode(self) -> int:
        return stat.S_IFREG | 0o444

    def render(self) -> bytes:
        raise NotImplementedError

    async def open(self, flags: int, ctx: Any) -> Handle:
        if wants_write(flags):
            fail(errno.EPERM, f"{self.path} is read-only")
        return BytesHandle(self, await self.content(), direct_io=True)

    async def content(self) -> bytes:
        raise NotImplementedError


class StatusFile(_Generated):
    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("file", "/.alkfs/status"), parent, b"status")

    async def content(self) -> bytes:
        return await self.ctx.run_sync(status_json, self.ctx)


class MetricsFile(_Generated):
    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("file", "/.alkfs/metrics"), parent, b"metrics")

    async def content(self) -> bytes:
        return await self.ctx.run_sync(metrics_text, self.ctx, dict(self.ctx.errors))
