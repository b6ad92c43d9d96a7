"""What the dispatch (fs.py) checks and builds around every request.

Bad input is refused before any node sees it: a name longer than NAME_MAX bytes
(ENAMETOOLONG, for every operation that takes a name; the kernel lets FUSE names of up
to 1024 bytes through) and an extended attribute value over XATTR_VALUE_MAX bytes
(E2BIG, nothing changed). Also here: the FileInfo an open answers with, and how a
request's target is named in a log line (`fuse_op`'s describers)."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, cast

import pyfuse3

from .errors import fail
from .nodes.handles import Handle

if TYPE_CHECKING:
    from .fs import Operations

OTHER_FIELDS = ("update_mode", "update_uid", "update_gid", "update_size")

NAME_MAX = 255  # bytes of one name (statfs says so too), as on every Linux file system
XATTR_VALUE_MAX = 4096  # bytes of an extended attribute's value (user.alkfs.* take a word)


def check_name(name: bytes) -> None:
    """ENAMETOOLONG for a name no Linux file system would take."""
    if len(name) > NAME_MAX:
        fail(errno.ENAMETOOLONG, f"a name of {len(name)} bytes (at most {NAME_MAX})")


def file_info(fh: int, handle: Handle) -> pyfuse3.FileInfo:
    """A handle's FileInfo. FileInfo.noflush (third_party/pyfuse3-noflush.patch, which
    alkfsd requires: pyfuse3_patches): closing a file whose handle has nothing to flush
    (every read-only open) costs no FLUSH round trip."""
    fi = pyfuse3.FileInfo(fh=fh, keep_cache=handle.keep_cache, direct_io=handle.direct_io)
    fi.noflush = not handle.flushes
    return fi


# A describer is called with the handler's own positional arguments (`fuse_op`): the
# inode, handle or parent inode first, and (of_child, of_xattr) a name second.


def of_ino(self: Operations, *args: object) -> str:
    ino = cast(int, args[0])
    node = self.inodes.get(ino)
    return node.describe() if node is not None else f"inode {ino}"


def of_child(self: Operations, *args: object) -> str:
    ino, name = cast(tuple[int, bytes], args[:2])
    node = self.inodes.get(ino)
    base = node.describe() if node is not None else f"inode {ino}"
    return f"{base.rstrip('/')}/{name.decode('utf-8', 'backslashreplace')}"


def of_link(self: Operations, *args: object) -> str:
    """link(inode, new parent, new name): the new name."""
    return of_child(self, *args[1:])


def of_xattr(self: Operations, *args: object) -> str:
    """The node and the attribute's name, as text (`/pins/x [user.alkfs.pin.y]`)."""
    ino, name = cast(tuple[int, bytes], args[:2])
    return f"{of_ino(self, ino)} [{name.decode('utf-8', 'backslashreplace')}]"


def of_fh(self: Operations, *args: object) -> str:
    fh = cast(int, args[0])
    h = self.handles.get(fh)
    return h.node.describe() if h is not None else f"handle {fh}"


def of_dh(self: Operations, *args: object) -> str:
    fh = cast(int, args[0])
    h = self.dirs.get(fh)
    return h.node.describe() if h is not None else f"dir handle {fh}"
