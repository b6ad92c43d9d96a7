"""The floor of a pyfuse3 file system on this machine: one that does nothing.

    .venv/bin/python bench/nullfs.py MNT

A flat, in-memory pyfuse3 file system (the same pyfuse3 build, trio loop and mount
options as alkfsd, 1 MiB st_blksize) that keeps names and sizes and throws every written
byte away. `cp` and `cp -r` into it cost exactly the FUSE requests alkfs answers (lookup,
create, write, flush, release, mkdir, getattr) and nothing else, so the write benchmark
runs it as a peer: a target below what this file system reaches cannot be met by any
file system built on pyfuse3 here. SIGTERM or SIGINT unmounts it and exits 0.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys

import pyfuse3
import trio

BLKSIZE = 1 << 20


class NullFS(pyfuse3.Operations):
    def __init__(self) -> None:
        super().__init__()
        self.next_ino = pyfuse3.ROOT_INODE + 1
        self.names: dict[tuple[int, bytes], int] = {}
        self.attrs: dict[int, pyfuse3.EntryAttributes] = {
            pyfuse3.ROOT_INODE: self._attr(pyfuse3.ROOT_INODE, stat.S_IFDIR | 0o755)
        }

    @staticmethod
    def _attr(ino: int, mode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.st_mode = mode
        a.st_nlink = 2 if stat.S_ISDIR(mode) else 1
        a.st_blksize = BLKSIZE
        a.entry_timeout = a.attr_timeout = 300
        return a

    def _new(self, parent: int, name: bytes, mode: int) -> pyfuse3.EntryAttributes:
        if (parent, name) in self.names:
            raise pyfuse3.FUSEError(errno.EEXIST)
        ino, self.next_ino = self.next_ino, self.next_ino + 1
        self.names[(parent, name)] = ino
        self.attrs[ino] = self._attr(ino, mode)
        return self.attrs[ino]

    async def getattr(self, inode: int, ctx: object = None) -> pyfuse3.EntryAttributes:
        return self.attrs[inode]

    async def lookup(self, parent: int, name: bytes, ctx: object = None) -> pyfuse3.EntryAttributes:
        ino = self.names.get((parent, name))
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.attrs[ino]

    async def mkdir(self, parent: int, name: bytes, mode: int, ctx: object) -> object:
        return self._new(parent, name, stat.S_IFDIR | 0o755)

    async def create(self, parent: int, name: bytes, mode: int, flags: int, ctx: object) -> object:
        attr = self._new(parent, name, stat.S_IFREG | 0o644)
        return pyfuse3.FileInfo(fh=attr.st_ino), attr

    async def open(self, inode: int, flags: int, ctx: object) -> pyfuse3.FileInfo:
        return pyfuse3.FileInfo(fh=inode)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        a = self.attrs[fh]
        a.st_size = max(a.st_size, off + len(buf))
        return len(buf)

    async def setattr(self, inode: int, attr: object, fields: object, fh: object, ctx: object):
        return self.attrs[inode]

    async def flush(self, fh: int) -> None:
        return None

    async def release(self, fh: int) -> None:
        return None

    async def opendir(self, inode: int, ctx: object) -> int:
        return inode

    async def readdir(self, fh: int, start_id: int, token: object) -> None:
        return None

    async def statfs(self, ctx: object) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = s.f_bfree = s.f_bavail = 1 << 30
        return s


async def serve() -> None:
    async with trio.open_nursery() as nursery:

        async def stop_on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    pyfuse3.terminate()
                    return

        nursery.start_soon(stop_on_signal)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


def main() -> int:
    mnt = sys.argv[1]
    options = set(pyfuse3.default_options) | {"fsname=nullfs"}
    pyfuse3.init(NullFS(), mnt, options)
    try:
        trio.run(serve)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
