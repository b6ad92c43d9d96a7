"""Setattr rules shared by nodes that cannot change."""

from __future__ import annotations

import errno
import stat

from pyfuse3 import EntryAttributes

from ..errors import fail
from .base import Node, SetattrFields


def noop_setattr(node: Node, attr: EntryAttributes, fields: SetattrFields) -> bool:
    """The rule for things that cannot change (objects, pins, the fixed directories): a
    chmod, chown or truncate to the value it already has succeeds and does nothing (so
    `cp -p`, `rsync -a` and `install` work); any other change is EPERM. Returns whether
    times were set (the caller freshens an object; a directory ignores them)."""
    a = node.attr()

    def asks(field: str) -> int | None:
        return getattr(attr, field, None)  # (None: no value given, so not the same)

    if fields.update_size and asks("st_size") != a.st_size:
        fail(errno.EPERM, f"{node.describe()}: its size cannot change")
    mode = asks("st_mode")
    # (the mode as shown, or before an --owner-only mount masked it: `cp -a`/`rsync -a`
    # of a tree whose directories are 0755 set that)
    if fields.update_mode and (
        mode is None or stat.S_IMODE(mode) not in (stat.S_IMODE(a.st_mode), node.mode() & 0o7777)
    ):
        fail(errno.EPERM, f"{node.describe()}: its mode is {stat.S_IMODE(a.st_mode):o}")
    if (fields.update_uid and asks("st_uid") != a.st_uid) or (
        fields.update_gid and asks("st_gid") != a.st_gid
    ):
        fail(errno.EPERM, f"{node.describe()}: its owner cannot change")
    return bool(fields.update_atime or fields.update_mtime)
