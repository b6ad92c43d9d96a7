"""Library errors to errno, in one place, and the one wrapper every FUSE handler wears.

A pyfuse3 handler may raise only `pyfuse3.FUSEError`; anything else would escape
`pyfuse3.main()` and take the whole mount down. `fuse_op` turns library errors
into their errno, logs every refusal as one line (op, what, errno, why), logs
anything unexpected with its traceback, and answers EIO for it.

Logs stay bounded whatever a request carried: a line quotes at most LOG_VALUE_MAX
characters of any value (`clip`), and refusals are rate-limited per (op, errno): at
most LOG_BURST lines a second each, the rest counted and reported as one
"... and K more" line (the handlers' owner keeps a `RateLimit` as `log_limit`; the
daemon flushes it every second and at exit). `ClipFormatter` bounds every physical log line as a backstop.
"""

from __future__ import annotations

import errno
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from time import perf_counter_ns
from typing import TYPE_CHECKING, Concatenate, NoReturn, ParamSpec, Protocol, TypeVar, overload

import pyfuse3

from alkfs import errors as lib

if TYPE_CHECKING:
    from .requests_stats import RequestStats

log = logging.getLogger("alkfsd")

# Most specific first: Corrupt is a Verification.
ERRNO: tuple[tuple[type[BaseException], int], ...] = (
    (lib.Missing, errno.ENOENT),
    (lib.Corrupt, errno.EIO),
    (lib.Verification, errno.EIO),
    (lib.TooLarge, errno.EFBIG),
    (lib.Refused, errno.EPERM),
    (lib.Invalid, errno.EINVAL),
    (lib.Exists, errno.EEXIST),
    (lib.Stale, errno.EAGAIN),
    (lib.NotEmpty, errno.ENOTEMPTY),
    (lib.NoSpace, errno.ENOSPC),  # (StoreIOs: before their base)
    (lib.Busy, errno.EBUSY),
    (lib.StoreIO, errno.EIO),
    (lib.StoreLocked, errno.EBUSY),
    (lib.AlkfsError, errno.EIO),
)

# Answers that are part of normal traffic (a shell probing names, ls asking for
# ACLs): logged at debug level only, so the log stays one line per real event.
QUIET = {errno.ENOENT, errno.ENODATA, errno.ENOTSUP}

LOG_VALUE_MAX = 256  # characters of any one value (a path, a reason) quoted in a log line
LOG_LINE_MAX = 2048  # characters of any physical line the daemon's log handler writes
LOG_BURST = 10  # refusal lines per (op, errno) and LOG_WINDOW_S; the rest are counted
LOG_WINDOW_S = 1.0


def clip(text: str, limit: int = LOG_VALUE_MAX) -> str:
    """`text`, cut to `limit` characters and saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text) - limit} more chars]"


# syslog priorities (sd-daemon(3)'s <N> prefixes) of the logging levels, most severe first;
# below INFO: <7> (debug)
SYSLOG_PRIORITY = (
    (logging.CRITICAL, 2),
    (logging.ERROR, 3),
    (logging.WARNING, 4),
    (logging.INFO, 6),
)


def syslog_priority(levelno: int) -> int:
    for level, priority in SYSLOG_PRIORITY:
        if levelno >= level:
            return priority
    return 7


class ClipFormatter(logging.Formatter):
    """Formats as usual, the message on one line (its own line breaks written as \\n), then
    cuts every physical line (tracebacks too) to LOG_LINE_MAX. With `journal`, every
    physical line starts with the record's syslog priority (`<3>` error, `<4>` warning,
    `<6>` info, `<7>` debug), which journald reads from a service's stderr."""

    def __init__(self, fmt: str | None = None, *, journal: bool = False) -> None:
        super().__init__(fmt)
        self.journal = journal

    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(record).replace("\r", "\\r").replace("\n", "\\n")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if len(text) > LOG_LINE_MAX:
            text = "\n".join(clip(line, LOG_LINE_MAX) for line in text.split("\n"))
        if not self.journal:
            return text
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in text.split("\n"))


class RateLimit:
    """At most `burst` log lines per key and window; the rest are counted, and the count is
    logged as one line when the key's window is over (at its next event or `flush`)."""

    def __init__(
        self, burst: int = LOG_BURST, window_s: float = LOG_WINDOW_S, clock=time.monotonic
    ) -> None:
        self.burst = burst
        self.window_s = window_s
        self.clock = clock
        # key -> [window start, lines logged in it, lines suppressed in it]
        self.slots: dict[tuple[str, str], list[float]] = {}

    def allow(self, key: tuple[str, str]) -> bool:
        now = self.clock()
        slot = self.slots.get(key)
        if slot is None or now - slot[0] >= self.window_s:
            if slot is not None:
                self._report(key, slot)
            self.slots[key] = [now, 1, 0]
            return True
        if slot[1] < self.burst:
            slot[1] += 1
            return True
        slot[2] += 1
        return False

    def flush(self, *, force: bool = False) -> None:
        """Log the counts of the windows that are over (all of them with `force`)."""
        now = self.clock()
        for key, slot in list(self.slots.items()):
            if force or now - slot[0] >= self.window_s:
                self._report(key, slot)
                del self.slots[key]

    def _report(self, key: tuple[str, str], slot: list[float]) -> None:
        if slot[2]:
            op, code = key
            log.warning(
                "%s: ... and %d more %s (not logged one by one; at most %d lines in %gs)",
                op,
                slot[2],
                code,
                self.burst,
                self.window_s,
            )
            slot[2] = 0


def _allow(owner: object, key: tuple[str, str]) -> bool:
    limit = getattr(owner, "log_limit", None)
    return limit is None or limit.allow(key)


class Fail(Exception):
    """A refusal a node raises on purpose: the errno and a sentence saying why (for the log)."""

    def __init__(self, errno_: int, why: str = "", quiet: bool = False) -> None:
        super().__init__(why or errno.errorcode.get(errno_, str(errno_)))
        self.errno = errno_
        self.why = why
        self.quiet = quiet  # (a refusal ordinary tools meet every day: logged at debug)


def fail(errno_: int, why: str = "", *, quiet: bool = False) -> NoReturn:
    raise Fail(errno_, why, quiet)


def errno_of(exc: BaseException) -> int | None:
    """The errno an exception answers with, or None when it is unexpected (a bug)."""
    if isinstance(exc, pyfuse3.FUSEError):
        return exc.errno
    if isinstance(exc, Fail):
        return exc.errno
    for cls, code in ERRNO:
        if isinstance(exc, cls):
            return code
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    return None


def name_of(code: int) -> str:
    return errno.errorcode.get(code, str(code))


class Handled(Protocol):
    """What `fuse_op`'s wrapper uses of the Operations whose handler it wraps (fs.py)."""

    @property
    def stats(self) -> RequestStats: ...

    def count_error(self, op: str, code: int) -> None: ...


Ops = TypeVar("Ops", bound=Handled)
Ops_contra = TypeVar("Ops_contra", bound=Handled, contravariant=True)
P = ParamSpec("P")
R = TypeVar("R")


class Describe(Protocol[Ops_contra]):
    """Names what a request was about, from the handler's own positional arguments
    (daemon/requests.py's `of_*`)."""

    def __call__(self, ops: Ops_contra, /, *args: object) -> str: ...


Handler = Callable[Concatenate[Ops, P], Awaitable[R]]
Wrapped = Callable[Concatenate[Ops, P], Coroutine[object, object, R]]


@overload
def fuse_op() -> Callable[[Handler[Ops, P, R]], Wrapped[Ops, P, R]]: ...


@overload
def fuse_op(describe: Describe[Ops]) -> Callable[[Handler[Ops, P, R]], Wrapped[Ops, P, R]]: ...


def fuse_op(
    describe: Describe[Ops] | None = None,
) -> Callable[[Handler[Ops, P, R]], Wrapped[Ops, P, R]]:
    """Wrap an Operations handler: every exception leaves as FUSEError with one log line.

    `describe(self, *args)` names what the request was about (a path or key) for the log.
    """

    def deco(fn: Handler[Ops, P, R]) -> Wrapped[Ops, P, R]:
        op = fn.__name__.lstrip("_")

        @functools.wraps(fn)
        async def wrapper(self: Ops, /, *args: P.args, **kwargs: P.kwargs) -> R:
            t0 = perf_counter_ns()
            try:
                return await fn(self, *args, **kwargs)
            except Exception as exc:
                code = errno_of(exc)
                if code is None:
                    self.count_error(op, errno.EIO)
                    if _allow(self, (op, "unexpected errors (EIO)")):
                        what = clip(_safe_describe(describe, self, args))
                        log.error(
                            "%s %s: unexpected error; answering EIO: %s",
                            op,
                            what,
                            clip(f"{type(exc).__name__}: {exc}"),
                            exc_info=exc,
                        )
                    raise pyfuse3.FUSEError(errno.EIO) from None
                self.count_error(op, code)
                quiet = code in QUIET or getattr(exc, "quiet", False)
                level = logging.DEBUG if quiet else logging.WARNING
                # Named only when logged: a quiet ENOENT (a shell or git probing names,
                # cp checking its target) is normal traffic and would pay for the path.
                if log.isEnabledFor(level) and (
                    level == logging.DEBUG or _allow(self, (op, f"errno={name_of(code)}"))
                ):
                    what = clip(_safe_describe(describe, self, args))
                    why = "" if isinstance(exc, pyfuse3.FUSEError) else clip(str(exc))
                    log.log(
                        level,
                        "%s %s: errno=%s%s",
                        op,
                        what,
                        name_of(code),
                        f" ({why})" if why else "",
                    )
                raise pyfuse3.FUSEError(code) from None
            finally:
                self.stats.observe(op, perf_counter_ns() - t0)

        return wrapper

    return deco


def _safe_describe(describe: Describe[Ops] | None, self: Ops, args: tuple[object, ...]) -> str:
    if describe is None:
        return ""
    try:
        return describe(self, *args)
    except Exception:
        return repr(args[:2])
