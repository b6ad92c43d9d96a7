"""Pin changes through the mount (worker threads), shared by /pins and the objects'
`user.alkfs.pin.NAME` attributes; the kernel is told which /pins entries changed. Each is
one library call, atomic in Pins (one transaction: a replacing rename, an unpin of a pin
on a given object, a file's attributes set only while it names its object)."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING

from alkfs.errors import Missing
from alkfs.keys import Key
from alkfs.pins import Entry, FileAttrs, PinDir, PinRecord, Pins

from ..errors import fail

if TYPE_CHECKING:
    from alkfs.store import PutResult

    from ..context import Context


def pins_dir_ino(ctx: Context) -> int | None:
    node = ctx.inodes.known(("dir", "/pins"))
    return None if node is None else node.ino


def changed(ctx: Context, *names: str) -> None:
    """Tell the kernel that these /pins entries changed (off the request path)."""
    ino = pins_dir_ino(ctx)
    if ino is not None:
        for name in names:
            ctx.invalidator.submit(ino, name.encode(), 0)


# -- pin changes (worker threads) --------------------------------------------------------
# (`tree`: a path in /pins, any file name, its directory must exist; otherwise a name of
# the xattr form. `attrs`: a file written into /pins.)
def pin(
    pins: Pins,
    name: str,
    key: Key,
    replace: Key | None = None,
    attrs: FileAttrs | None = None,
    tree: bool = False,
) -> PinRecord:
    """Pin `key` as `name` (Invalid: bad name; Missing: not stored). A pin `name` on
    `replace` (what this writer stored before) is replaced; on any other object, Exists."""
    return pins.pin(name, key, replace=replace or False, attrs=attrs, tree=tree)


def put_pinned(
    pins: Pins,
    name: str,
    data: bytes,
    replace: Key | None = None,
    attrs: FileAttrs | None = None,
    tree: bool = False,
) -> PutResult:
    """Store `data` and pin it as `name` in one transaction (as `pin`: Invalid, Exists);
    the result's pin is released already."""
    result, _ = pins.put_pinned(name, data, replace=replace or False, attrs=attrs, tree=tree)
    return result


def move(pins: Pins, old: str, new: str) -> Entry:
    """Rename the pin or directory `old` of /pins to `new`, replacing an entry `new` of
    its kind (a directory only if empty): one transaction."""
    return pins.move(old, new, replace=True)


def mkdir(pins: Pins, name: str, mode: int) -> PinDir:
    return pins.mkdir(name, mode)


def rmdir(pins: Pins, name: str) -> None:
    pins.rmdir(name)


def set_attrs(
    pins: Pins,
    name: str,
    created_ns: int,
    mode: int | None,
    mtime_ns: int | None,
    uid: int | None = None,
    gid: int | None = None,
) -> Entry:
    """The mode, time, owner and group of a file or directory of /pins (each None: as
    it is; the caller checked who may change an owner)."""
    return pins.set_attrs(name, created_ns, mode, mtime_ns, uid, gid)


def set_file_attrs(
    pins: Pins,
    name: str,
    key: Key,
    mode: int | None,
    mtime_ns: int | None,
    uid: int | None = None,
    gid: int | None = None,
) -> Entry | None:
    """`set_attrs` of the file pin `name` if it still names `key` (None: it does not)."""
    try:
        return pins.set_attrs(name, None, mode, mtime_ns, uid, gid, key=key)
    except Missing:
        return None


def unpin(pins: Pins, name: str, key: Key | None = None) -> None:
    pins.unpin(name, key)


async def pin_object(ctx: Context, name: str, key: Key) -> None:
    """setfattr -n user.alkfs.pin.NAME: EINVAL bad name, EEXIST taken, ENOENT gone."""
    await ctx.run_sync(pin, ctx.pins, name, key)
    changed(ctx, name)


async def unpin_object(ctx: Context, name: str, key: Key) -> None:
    """setfattr -x user.alkfs.pin.NAME: ENODATA unless NAME pins this object."""
    try:
        await ctx.run_sync(unpin, ctx.pins, name, key)
    except Missing:
        fail(errno.ENODATA, f"no pin {name!r} on {key}")
    changed(ctx, name)
