"""Open files and directories: what a node's `open` / `opendir` returns (see base.py for
the node contract)."""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING

from ..errors import fail

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .base import Node


def wants_write(flags: int) -> bool:
    """Whether an open may change the file: a write access mode or O_TRUNC. O_APPEND alone
    is not one (Linux opens O_RDONLY|O_APPEND for reading; its writes fail EBADF)."""
    return (flags & os.O_ACCMODE) != os.O_RDONLY or bool(flags & os.O_TRUNC)


class Handle:
    """An open file. Defaults: no reads (EBADF), no writes (EBADF), nothing to flush."""

    keep_cache: bool = False
    direct_io: bool = False

    def __init__(self, node: Node) -> None:
        self.node = node

    async def read(self, off: int, size: int) -> bytes | bytearray | memoryview:
        fail(errno.EBADF, "not open for reading")

    async def write(self, off: int, buf: bytes) -> int:
        fail(errno.EBADF, "not open for writing")

    async def flush(self) -> None:
        return None

    @property
    def flushes(self) -> bool:
        """Its flush does something (so the kernel must send FLUSH at every close)."""
        return type(self).flush is not Handle.flush

    async def fsync(self, datasync: bool) -> None:
        return None

    async def release(self) -> None:
        return None


class BytesHandle(Handle):
    """Serves a buffer computed at open (small generated files)."""

    def __init__(self, node: Node, data: bytes, *, direct_io: bool = False) -> None:
        super().__init__(node)
        self.data = data
        self.direct_io = direct_io

    async def read(self, off: int, size: int) -> bytes:
        return self.data[off : off + size]


class LoadedHandle(Handle):
    """A small file's bytes, fetched at its first read and kept for the open: with
    keep_cache the kernel serves repeated reads from its pages, so an open of a file
    whose pages the kernel holds costs no query at all."""

    keep_cache = True

    def __init__(self, node: Node, fetch: Callable[[], Awaitable[bytes]]) -> None:
        super().__init__(node)
        self.fetch = fetch
        self.data: bytes | None = None

    async def load(self) -> bytes:
        data = self.data
        if data is None:
            data = self.data = await self.fetch()
        return data

    async def read(self, off: int, size: int) -> bytes:
        return (await self.load())[off : off + size]


class DirHandle:
    """An open directory; `state` is the node's to keep a cursor in."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.state: dict[str, object] = {}

    async def release(self) -> None:
        return None
