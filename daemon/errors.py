"""Library errors to errno, in one place, and the one wrapper every FUSE handler wears.

A pyfuse3 handler may raise only `pyfuse3.FUSEError`; anything else would escape
`pyfuse3.main()` and take the whole mount down. `fuse_op` turns library errors
into their errno, logs every refusal as one line (op, what, errno, why), logs
anything unexpected with its traceback, and answers EIO for it.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import pyfuse3

from alkfs import errors as lib

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
    (lib.StoreIO, errno.EIO),
    (lib.StoreLocked, errno.EBUSY),
    (lib.AlkfsError, errno.EIO),
)

# Answers that are part of normal traffic (a shell probing names, ls asking for
# ACLs): logged at debug level only, so the log stays one line per real event.
QUIET = {errno.ENOENT, errno.ENODATA, errno.ENOTSUP}


class Fail(Exception):
    """A refusal a node raises on purpose: the errno and a sentence saying why (for the log)."""

    def __init__(self, errno_: int, why: str = "") -> None:
        super().__init__(why or errno.errorcode.get(errno_, str(errno_)))
        self.errno = errno_
        self.why = why


def fail(errno_: int, why: str = "") -> NoReturn:
    raise Fail(errno_, why)


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


F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def fuse_op(describe: Callable[..., str] | None = None) -> Callable[[F], F]:
    """Wrap an Operations handler: every exception leaves as FUSEError with one log line.

    `describe(self, *args)` names what the request was about (a path or key) for the log.
    """

    def deco(fn: F) -> F:
        op = fn.__name__.lstrip("_")

        @functools.wraps(fn)
        async def wrapper(self: Any, *args: Any) -> Any:
            try:
                return await fn(self, *args)
            except Exception as exc:
                code = errno_of(exc)
                if code is None:
                    what = _safe_describe(describe, self, args)
                    log.exception("%s %s: unexpected error; answering EIO", op, what)
                    self.count_error(op, errno.EIO)
                    raise pyfuse3.FUSEError(errno.EIO) from None
                self.count_error(op, code)
                level = logging.DEBUG if code in QUIET else logging.WARNING
                # Named only when logged: a quiet ENOENT (a shell or git probing names,
                # cp checking its target) is normal traffic and would pay for the path.
                if log.isEnabledFor(level):
                    what = _safe_describe(describe, self, args)
                    why = "" if isinstance(exc, pyfuse3.FUSEError) else str(exc)
                    log.log(
                        level,
                        "%s %s: errno=%s%s",
                        op,
                        what,
                        name_of(code),
                        f" ({why})" if why else "",
                    )
                raise pyfuse3.FUSEError(code) from None

        return wrapper  # type: ignore[return-value]

    return deco


def _safe_describe(describe: Callable[..., str] | None, self: Any, args: tuple[Any, ...]) -> str:
    if describe is None:
        return ""
    try:
        return describe(self, *args)
    except Exception:
        return repr(args[:2])
