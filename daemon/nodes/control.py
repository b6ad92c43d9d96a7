"""/.alkfs: `control` (write commands), `status` (JSON) and `metrics` (Prometheus).

The control file takes lines. Each open has its own buffer: a command runs once its
line is complete (the write that brings the newline returns when it has run), and an
unterminated last line runs at close (its refusal is close()'s, so `echo -n sweep`
works and reports errors). Input is bounded: one write may complete at most
MAX_LINES lines and one open takes at most MAX_BYTES bytes in all; a write beyond
either is E2BIG and runs nothing. A write is checked whole before anything runs: its
complete lines must be commands and what follows its last newline the start of one,
else EINVAL and the write is not taken (nothing runs; the buffer stays as it was).
Its commands then run in order, and the first that fails ends the write with its errno.

`status` and `metrics` are rendered at open; `stat` reports the size of what a read
gives: while the file is open, the size of the newest open's snapshot, else of a
fresh rendering (so rsync and cp, which size their copy from fstat, copy it whole).
"""

from __future__ import annotations

import errno
import json
import logging
import stat
from typing import TYPE_CHECKING

from pyfuse3 import EntryAttributes, RequestContext

from alkfs.durations import parse_duration, parse_window
from alkfs.gc import staged

from ..errors import clip, fail
from ..packs import repack_now
from ..status import metrics_text, status_json
from .base import DYNAMIC_TIMEOUT, File, Node, SetattrFields, StaticDir
from .handles import BytesHandle, Handle, wants_write

if TYPE_CHECKING:
    from ..context import Context

log = logging.getLogger("alkfsd")

USAGE = (
    b"commands: sweep [WINDOW]   (e.g. sweep, sweep 0, sweep 1h)\n"
    b"          sweep --expire-now [WINDOW]   (delete every staged candidate now)\n"
    b"          sweep --dry-run   (what would be staged: read /.alkfs/dry-run)\n"
    b"          verify\n"
    b"          repack     (build and publish the git views' derived packs now)\n"
)
MAX_LINES = 4  # complete lines (commands) one write may bring
MAX_BYTES = 4096  # bytes one open of the control file takes in all
SWEEP_FLAGS = ("--dry-run", "--expire-now")
STAGED_LINES = 100_000  # candidates /.alkfs/staged lists (then one line says how many more)


class AlkfsDir(StaticDir):
    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("dir", "/.alkfs"), parent, b".alkfs")

    def children(self) -> list[tuple[bytes, Node]]:
        return [
            (b"control", ControlFile(self.ctx, self)),
            (b"status", StatusFile(self.ctx, self)),
            (b"metrics", MetricsFile(self.ctx, self)),
            (b"staged", StagedList(self.ctx, self)),
            (b"dry-run", DryRunFile(self.ctx, self)),
        ]


class ControlFile(File):
    """Write `sweep [WINDOW]`, `verify` or `repack`; the write returns when it is done."""

    writable_when_read_only = True
    root_only = True  # root's (the daemon's user's) alone, even with --owner
    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("file", "/.alkfs/control"), parent, b"control")

    def mode(self) -> int:
        return stat.S_IFREG | 0o600

    def attr(self) -> EntryAttributes:
        a = super().attr()
        a.st_uid = self.ctx.daemon_uid  # (not the --owner user's: they may not write it)
        a.st_gid = self.ctx.daemon_gid
        return a

    async def open(self, flags: int, req: RequestContext) -> Handle:
        return ControlHandle(self)

    async def setattr(
        self,
        attr: EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> EntryAttributes:
        # `echo sweep > control` truncates first: accept that (and touch) as no-ops.
        if fields.update_mode or fields.update_uid or fields.update_gid:
            fail(errno.EPERM, "the control file's owner and mode are fixed")
        if fields.update_size and attr.st_size != 0:
            fail(errno.EINVAL, "the control file takes commands, not data")
        return self.attr()


class ControlHandle(Handle):
    direct_io = True

    def __init__(self, node: Node) -> None:
        super().__init__(node)
        self.pending = bytearray()  # the unterminated line so far
        self.taken = 0  # bytes this open has accepted

    async def read(self, off: int, size: int) -> bytes:
        return USAGE[off : off + size]

    async def write(self, off: int, buf: bytes) -> int:
        data = bytes(buf)
        if self.taken + len(data) > MAX_BYTES:
            fail(
                errno.E2BIG,
                f"the control file takes at most {MAX_BYTES} bytes per open "
                f"({self.taken} taken, a write of {len(data)}): nothing run",
            )
        lines = (bytes(self.pending) + data).split(b"\n")
        rest = lines.pop()  # after the last newline: not a line yet
        if len(lines) > MAX_LINES:
            fail(
                errno.E2BIG,
                f"a write to the control file completes at most {MAX_LINES} lines, "
                f"not {len(lines)}: nothing run",
            )
        commands = [words for words in map(parse, lines) if words]  # EINVAL: not taken
        if lines and not commands:
            fail(errno.EINVAL, "empty control command")
        if not may_start(rest):  # (so `echo -n bogus` fails at its write, not only at close)
            fail(errno.EINVAL, f"{clip(repr(rest), 100)} cannot start a control command")
        self.taken += len(data)
        self.pending[:] = rest
        for words in commands:
            await self.run(words)
        return len(data)

    async def _last_line(self) -> None:
        """An unterminated last line runs when the file is closed."""
        if not self.pending:
            return
        line = bytes(self.pending)
        self.pending.clear()
        words = parse(line)
        if words:  # (trailing blanks: nothing to run)
            await self.run(words)

    async def flush(self) -> None:
        await self._last_line()

    async def release(self) -> None:
        try:
            await self._last_line()  # (no FLUSH came: nobody to tell but the log)
        except Exception as exc:
            log.warning("release /.alkfs/control: the last line did not run (%s)", exc)

    async def run(self, words: list[str]) -> None:
        ctx = self.node.ctx
        cmd, args = words[0], words[1:]
        if cmd == "sweep":
            if ctx.read_only:
                fail(errno.EROFS, "the mount is read-only: no sweeps")
            flags = [a for a in args if a in SWEEP_FLAGS]
            rest = [a for a in args if a not in SWEEP_FLAGS]
            if "--dry-run" in flags:
                await ctx.dry_run()
                return
            window = parse_window(rest[0]) if rest else None
            await ctx.sweep(window, expire_now="--expire-now" in flags)
        elif cmd == "verify":
            await ctx.verify()
        elif cmd == "repack":
            if ctx.read_only:
                fail(errno.EROFS, "the mount is read-only: no repack")
            log.info("repack: %s", json.dumps(await repack_now(ctx), default=str))


def may_start(text: bytes) -> bool:
    """Whether an unterminated line can still become a command (a loose check: the
    complete line is parsed again)."""
    try:
        line = text.decode("ascii")
    except UnicodeDecodeError:
        return False
    words = line.split()
    if not words:
        return True
    ended = line[-1].isspace()  # the last word is complete
    cmd = words[0]
    if len(words) == 1 and not ended:
        return any(c.startswith(cmd) for c in ("sweep", "verify", "repack"))
    if cmd in ("verify", "repack"):
        return len(words) == 1
    if cmd != "sweep" or len(words) > 3:
        return False
    if len(words) == 1:
        return True
    last = words[-1]
    if last.startswith("-") and (len(words) == 2 or not ended):
        return any(f.startswith(last) if not ended else f == last for f in SWEEP_FLAGS)
    if ended:
        try:
            parse_duration(last)
        except ValueError:
            return False
        return True
    return all(c in "0123456789.smhdwSMHDW" for c in last)


def parse(line: bytes) -> list[str]:
    """The words of one command line ([] for a blank one); EINVAL for anything but
    `sweep [WINDOW]`, `verify` and `repack`."""
    try:
        words = line.decode("utf-8").split()
    except UnicodeDecodeError:
        fail(errno.EINVAL, "a control command is text")
    if not words:
        return words
    cmd, args = words[0], words[1:]
    flags = [a for a in args if a in SWEEP_FLAGS]
    rest = [a for a in args if a not in SWEEP_FLAGS]
    dry = "--dry-run" in flags
    if cmd == "sweep" and len(rest) <= 1 and len(flags) <= 1:  # (one flag: they exclude)
        if dry and rest:
            fail(errno.EINVAL, "sweep --dry-run takes no window")
        if rest:
            try:
                parse_window(rest[0])
            except ValueError:
                fail(
                    errno.EINVAL,
                    f"not a window (a duration of at most 10 years): {clip(repr(rest[0]), 64)}",
                )
        return words
    if cmd in ("verify", "repack") and not args:
        return words
    fail(errno.EINVAL, f"unknown control command {clip(repr(' '.join(words)), 100)}")


class _Generated(File):
    """A file whose content is computed (in a worker thread) at each open. Its size is
    that of what a read gives: the newest open's snapshot while it is open, else a
    fresh rendering; attributes are never cached by the kernel, so an fstat after open
    asks again (rsync and cp size their copy from it)."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = 0.0
    __slots__ = ("snapshot", "open_count")

    def __init__(self, ctx: Context, ident: tuple, parent: Node, name: bytes) -> None:
        super().__init__(ctx, ident, parent, name)
        self.snapshot = b""  # the newest rendering (its length is size())
        self.open_count = 0

    def mode(self) -> int:
        return stat.S_IFREG | 0o444

    def size(self) -> int:
        return len(self.snapshot)

    async def getattr(self, req: RequestContext) -> EntryAttributes:
        if self.open_count == 0:
            self.snapshot = await self.content()
        return self.attr()

    async def open(self, flags: int, req: RequestContext) -> Handle:
        if wants_write(flags):
            fail(errno.EPERM, f"{self.path} is read-only")
        data = await self.content()
        self.snapshot = data
        self.open_count += 1
        return SnapshotHandle(self, data)

    async def content(self) -> bytes:
        raise NotImplementedError


class SnapshotHandle(BytesHandle):
    """Serves one rendering of a generated file; the node counts the open ones."""

    def __init__(self, node: _Generated, data: bytes) -> None:
        super().__init__(node, data, direct_io=True)
        self.generated = node
        self.released = False

    async def release(self) -> None:
        if not self.released:
            self.released = True
            self.generated.open_count -= 1


class StatusFile(_Generated):
    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("file", "/.alkfs/status"), parent, b"status")

    async def content(self) -> bytes:
        # (its counts are the database's, which cannot merge what is pending ahead of
        # its commit: applied first)
        await self.ctx.pending.drain()
        return await self.ctx.run_sync(status_json, self.ctx)


class MetricsFile(_Generated):
    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("file", "/.alkfs/metrics"), parent, b"metrics")

    async def content(self) -> bytes:
        ctx = self.ctx
        await ctx.pending.drain()  # (the database's counts, as the status file's)
        return await ctx.run_sync(metrics_text, ctx, dict(ctx.errors), ctx.stats.snapshot())


class StagedList(_Generated):
    """The staged candidates, one `KEY SIZE DEADLINE` line each in key order (at most
    STAGED_LINES, then a line saying how many more: `alkfs staged` on an unheld store
    lists them all)."""

    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("file", "/.alkfs/staged"), parent, b"staged")

    async def content(self) -> bytes:
        return await self.ctx.run_sync(staged_text, self.ctx)


def staged_text(ctx: Context) -> bytes:
    out = list(staged.lines(ctx.store, STAGED_LINES))
    listed = len(out)
    total = staged.totals(ctx.store)["count"] or 0
    if total > listed:
        out.append(f"# {total - listed} more not listed (alkfs --store STORE staged)")
    return "".join(line + "\n" for line in out).encode()


class DryRunFile(_Generated):
    """The last `sweep --dry-run`'s result (JSON; `null` before the first)."""

    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("file", "/.alkfs/dry-run"), parent, b"dry-run")

    async def content(self) -> bytes:
        return (json.dumps(self.ctx.last_dry_run, indent=2) + "\n").encode()
