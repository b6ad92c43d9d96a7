"""The store directory is its owner's alone, whatever the umask.

Any other local user who can reach a file of the store can hold a shared lock on one
byte of `store.db-shm` (every write then fails once the 5 s busy timeout runs out),
hold `alkfs.lock` (no daemon starts), read every object out of `store.db` and
`large/`, or keep a read transaction open that stops WAL checkpoints. So:

- every directory of the store is created 0700 and every file 0600 (the immutable
  large objects 0400), by an explicit mode at each creation point, never through the
  process umask (which can only take bits away);
- `check_owner` refuses a store directory another user can write (group or other
  write bit) or that belongs to another uid: whoever can write it can replace its
  files;
- `tighten` removes the group and other bits of an existing store made before this
  (or by hand), once, at open.

`prepare` checks a store directory about to be opened (`Alkfs.open`, which the daemon
and the command line use); `tighten_at_open` tightens it once `Store.open` holds its lock.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from .errors import Refused, StoreIO

DIR_MODE = 0o700
FILE_MODE = 0o600
LOOSE = 0o077  # any bit of group or others

log = logging.getLogger("alkfs.store")


def prepare(path: str | os.PathLike[str]) -> None:
    """Before a store directory is opened: create it 0700 when missing, and refuse it when
    another user could change it."""
    root = Path(path)
    if not root.exists():
        root.parent.mkdir(parents=True, exist_ok=True)  # (not the store's: as mkdir -p)
        root.mkdir(mode=DIR_MODE, exist_ok=True)
    check_owner(root)


def tighten_at_open(path: str | os.PathLike[str]) -> None:
    """Once the store is open for writing (its lock held, or a fleet's member): tighten
    whatever is loose, saying so in one log line. Never before: a process the lock
    refuses, or one opened beside the lock holder, changes nothing of the store."""
    root = Path(path)
    tightened = tighten(root)
    if tightened:
        log.warning(
            "tightened %d entries of the store %s to owner-only access"
            " (group and other permission bits removed)",
            tightened,
            root,
        )


def check_owner(root: Path) -> None:
    """Refuse a store directory that another user could change."""
    try:
        st = os.stat(root)
    except OSError as exc:
        raise StoreIO(f"cannot use the store directory {root}: {exc.strerror}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise StoreIO(f"the store {root} is not a directory")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise Refused(
            f"the store directory {root} belongs to uid {st.st_uid}, not to uid {uid} that"
            f" opens it: refused (its owner could change the store); chown {uid} {root}"
        )
    if st.st_mode & 0o022:
        raise Refused(
            f"the store directory {root} is writable by other users"
            f" (mode {stat.S_IMODE(st.st_mode):04o}): refused; chmod 700 {root}"
        )


def tighten(root: Path) -> int:
    """Take the group and other bits off every entry of the store; returns how many changed.

    The top level is always looked at (a handful of entries). A directory below it
    (`large/`, `spool/`, `scratch/`) is walked only when its own mode is loose, and it
    is tightened after everything inside it, so a walk cut short by a crash is redone
    at the next open, and a tight store costs one `scandir` of its top level. Entries
    are changed through descriptors opened without following symlinks (`os.fwalk`,
    `O_NOFOLLOW`): a directory that others could write until now cannot redirect a
    chmod elsewhere."""
    changed = 0
    try:
        with os.scandir(root) as it:
            entries = [(e.name, e.stat(follow_symlinks=False).st_mode) for e in it]
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise StoreIO(f"cannot read the store directory {root}: {exc.strerror}") from exc
    try:
        for name, mode in entries:
            if not mode & LOOSE or stat.S_ISLNK(mode):
                continue
            if stat.S_ISDIR(mode):
                for _, dirnames, filenames, dirfd in os.fwalk(
                    name, topdown=False, dir_fd=top, onerror=_walk_error
                ):
                    for inner in (*filenames, *dirnames):
                        changed += _tighten_one(inner, dirfd, root)
            changed += _tighten_one(name, top, root)
        changed += _tighten_one(".", top, root)
    finally:
        os.close(top)
    return changed


def _walk_error(exc: OSError) -> None:
    if not isinstance(exc, FileNotFoundError):  # a staging or spool file that just went
        raise StoreIO(f"cannot make {exc.filename} private to its owner: {exc.strerror}")


def _tighten_one(name: str, dirfd: int, root: Path) -> int:
    """fchmod one entry (never through a symlink) without its group and other bits; 1 if
    it changed."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        mode = os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode
        if stat.S_ISLNK(mode) or not mode & LOOSE:
            return 0  # (most entries of a walk: no open for them)
        fd = os.open(name, flags, dir_fd=dirfd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO):
            return 0  # gone, a symlink, or a socket: nothing of the store to tighten
        raise _failed(name, root, exc) from exc
    try:
        mode = os.fstat(fd).st_mode
        if not mode & LOOSE:
            return 0
        os.fchmod(fd, stat.S_IMODE(mode) & ~LOOSE)
        return 1
    except OSError as exc:
        raise _failed(name, root, exc) from exc
    finally:
        os.close(fd)


def _failed(name: str, root: Path, exc: OSError) -> StoreIO:
    where = root if name == "." else f"{name} in {root}"
    return StoreIO(f"cannot make {where} private to its owner: {exc.strerror}")
