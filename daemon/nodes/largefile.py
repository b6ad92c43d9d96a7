"""A large-tier object's open file: pread, every byte verified before it is served."""

from __future__ import annotations

import errno
import logging
import os
from typing import TYPE_CHECKING

from alkfs.catalog import Record
from alkfs.errors import Corrupt

from .handles import Handle

if TYPE_CHECKING:
    from .objfile import ObjectFile

log = logging.getLogger("alkfsd")


class LargeHandle(Handle):
    """A large-tier file, served by pread; no byte is served before it is verified.

    With the object's catalog row, a READ checks the chunks it covers that this handle
    has not verified yet (a worker thread preads and digests each, and the READ is served
    from those same bytes), and remembers them: a chunk is hashed once per handle. Once
    every chunk is, the store remembers the unchanged file as verified, and later opens
    of it serve by pread alone (`verified`). An object without a row (stored before the
    catalog) is verified whole at its first READ, which records its row. A mismatch (a
    changed byte, a file cut short or grown) is Corrupt, EIO, for every READ touching
    it; the object is marked corrupt (status) and later opens of it fail. Chunks already
    verified by this handle stay readable through it."""

    keep_cache = True

    def __init__(
        self,
        node: ObjectFile,
        fd: int,
        fst: os.stat_result,
        record: Record | None,
        verified: bool,
    ) -> None:
        super().__init__(node)
        self.obj = node
        self.fd = fd
        self.fst = fst
        self.record = record
        self.size = record.size if record is not None else fst.st_size
        self.verified = verified
        self.good = bytearray(0 if verified or record is None else record.count)
        self.left = len(self.good)  # chunks not yet verified by this handle
        self.nowait = True

    async def read(self, off: int, size: int) -> bytes | bytearray:
        if off >= self.size or size <= 0:
            return b""
        n = min(size, self.size - off)
        if not self.verified:
            if self.record is not None:
                return await self._read_checked(off, n)
            await self._verify_whole()
        data = await self._pread(off, n)
        if len(data) != n:  # cut short since it was verified
            self._corrupt(f"{self.obj.key}: the file is shorter than its size")
        return data

    def _corrupt(self, why: str) -> None:
        self.obj.ctx.store.mark_corrupt(self.obj.key)
        raise Corrupt(why)

    async def _verify_whole(self) -> None:
        """An object without a catalog row: verified whole now, which records its row."""
        ctx = self.obj.ctx
        rec = await ctx.run_sync(ctx.store.verify_open, self.obj.key, self.fd, self.fst)
        if rec is not None:
            self.record = rec
            self.size = rec.size
        self.verified = True

    async def _read_checked(self, off: int, n: int) -> bytes:
        rec = self.record
        assert rec is not None
        cs = rec.chunk_size
        first, last = off // cs, (off + n - 1) // cs
        good = self.good
        fresh: dict[int, bytes] = {}
        need = [i for i in range(first, last + 1) if not good[i]]
        if need:
            fresh = await self.obj.ctx.run_sync(self._check, rec, need)
            for i in need:
                if not good[i]:  # (two READs may have checked one chunk at once)
                    good[i] = 1
                    self.left -= 1
            if self.left == 0:
                self._all_verified()
        out: list[bytes] = []
        for i in range(first, last + 1):
            start, end = rec.span(i)
            lo, hi = max(off, start), min(off + n, end)
            chunk = fresh.get(i)
            if chunk is not None:
                out.append(chunk[lo - start : hi - start])
                continue
            # verified by this handle before (no chunk is kept: a handle may stay open
            # long, and many may be open at once); page-cached, so read again inline
            piece = await self._pread(lo, hi - lo)
            if len(piece) != hi - lo:
                self._corrupt(f"{self.obj.key}: the file is shorter than its size")
            out.append(bytes(piece))
        return out[0] if len(out) == 1 else b"".join(out)

    def _check(self, rec: Record, need: list[int]) -> dict[int, bytes]:
        """(worker thread) The chunks `need`, each read once and verified."""
        store, key, fd = self.obj.ctx.store, self.obj.key, self.fd
        return {i: store.read_chunk(key, fd, rec, i) for i in need}

    def _all_verified(self) -> None:
        """Every chunk passed: the store remembers this very file (if it did not change
        since the open) as verified, so later opens of it hash nothing."""
        self.verified = True
        try:
            now = os.fstat(self.fd)
        except OSError:
            return
        self.obj.ctx.store.remember_verified(self.obj.key, self.fst, now)

    async def _pread(self, off: int, n: int) -> bytes | bytearray:
        got = 0
        buf = bytearray(n)
        if self.nowait:
            try:
                got = os.preadv(self.fd, [buf], off, os.RWF_NOWAIT)
            except BlockingIOError:
                got = 0
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                self.nowait = False
        if got == n:
            return buf
        rest = await self.obj.ctx.run_sync(os.pread, self.fd, n - got, off + got)
        return bytes(buf[:got]) + rest

    async def release(self) -> None:
        os.close(self.fd)
