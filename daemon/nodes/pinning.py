"""Pin changes through the mount shared by /pins and the objects' `user.alkfs.pin.NAME`
attributes; the kernel is told which /pins entries changed. Each change is one call of
`Pins` in a worker thread, atomic there (one transaction: a replacing rename, an unpin of
a pin on a given object, a file's attributes set only while it names its object)."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING

from alkfs.errors import Missing
from alkfs.keys import Key
from alkfs.pins import Entry, Pins

from ..errors import fail

if TYPE_CHECKING:
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


async def pin_object(ctx: Context, name: str, key: Key) -> None:
    """setfattr -n user.alkfs.pin.NAME: EINVAL bad name, EEXIST taken, ENOENT gone."""
    await ctx.run_sync(ctx.pins.pin, name, key)
    changed(ctx, name)


async def unpin_object(ctx: Context, name: str, key: Key) -> None:
    """setfattr -x user.alkfs.pin.NAME: ENODATA unless NAME pins this object."""
    try:
        await ctx.run_sync(ctx.pins.unpin, name, key)
    except Missing:
        fail(errno.ENODATA, f"no pin {name!r} on {key}")
    changed(ctx, name)
