"""The library's one exception family. The daemon maps each class to one errno."""

from __future__ import annotations

import logging
import sys


class AlkfsError(Exception):
    """Base of every error the library raises on purpose."""


class Missing(AlkfsError):
    """The object, ref, pin or repository does not exist."""


class Verification(AlkfsError):
    """Content does not hash to its key, or a declared length did not match."""


class TooLarge(AlkfsError):
    """A put over the threshold on a kv-only store."""


class Refused(AlkfsError):
    """The operation is not allowed (protected object, read-only attribute, ...)."""


class Invalid(AlkfsError):
    """Malformed input: a bad key, ref name, repository id, pin name or oid."""


class Exists(AlkfsError):
    """The name is already taken."""


class Stale(AlkfsError):
    """A compare-and-swap lost its race."""


class NotEmpty(AlkfsError):
    """A container still holds something."""


class StoreIO(AlkfsError):
    """An input stream or the backing medium failed."""


class StoreLocked(AlkfsError):
    """Another process holds the store."""


class Corrupt(Verification):
    """Stored bytes no longer hash to their key."""


class NoSpace(StoreIO):
    """The filesystem holding the store is full (ENOSPC, EDQUOT, sqlite's SQLITE_FULL)."""


class Busy(StoreIO):
    """sqlite stayed locked past its busy timeout ("database is locked"): try again."""


class SourceFailed(AlkfsError):
    """A liveness source could not say what is live (an unreadable borrower): the sweep
    that asked ends with `aborted: "protect-failed"` and this message, deleting nothing."""


class Interrupted(AlkfsError):
    """Long work (a sweep, a verify) ended early because the store is closing (SIGTERM,
    an unmount): what it did stays done, the rest is for the next run."""


def log_failure(logger: logging.Logger, what: str, *args: object) -> None:
    """In an `except` block of background work: an error of ours (the database away, the
    disk full, a source refused) as one short line; anything else with its traceback."""
    exc = sys.exc_info()[1]
    if isinstance(exc, AlkfsError):
        logger.error(what + ": %.300s", *args, exc)
    else:
        logger.exception(what, *args)
