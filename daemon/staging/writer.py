"""The content of one new file (`StagedWriter`, see staged.py): in memory up to MEM_MAX,
then a Spooler's (spool.py); stored by `commit`."""

from __future__ import annotations

import errno
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import trio

from alkfs.errors import StoreIO
from alkfs.keys import Algorithm, Key
from alkfs.store import BEHIND_PUT_MAX, PutResult

from ..errors import fail
from .spool import QUEUE_MAX, EndStream, Spooler, Sync, TakeBack, Truncate, Write

if TYPE_CHECKING:
    from ..services import Services

MEM_MAX = 1 << 20  # a file up to this size never touches the disk before its put


class Put(Protocol):
    """A commit's put (a functools.partial), called in a worker thread."""

    def __call__(self) -> PutResult: ...


class StagedWriter:
    """The content of one new file (see the module docstring)."""

    def __init__(self, ctx: Services, algo: Algorithm, expect: Key | None = None) -> None:
        self.ctx = ctx
        self.algo = algo
        self.expect = expect
        self.size = 0
        self.dirty = False  # written since the last commit
        # (a first write at 0 is kept as the bytes it came in: cp's one write of a small
        # file is never copied; a second write makes it a bytearray)
        self.mem: bytes | bytearray | None = b""
        self.spool: Spooler | None = None
        self.streaming = False
        self.closed = False

    # -- content ----------------------------------------------------------------------
    async def write(self, off: int, buf: bytes) -> int:
        if self.closed:
            fail(errno.EBADF, "the file was closed")
        n = len(buf)
        self.dirty = True
        end = off + n
        mem = self.mem
        if mem is not None:
            if end <= MEM_MAX:
                if not mem and off == 0 and self.size == 0 and type(buf) is bytes:
                    self.mem = buf
                    self.size = end
                    return n
                if not isinstance(mem, bytearray):
                    self.mem = mem = bytearray(mem)
                if off > len(mem):
                    mem.extend(bytes(off - len(mem)))
                mem[off:end] = buf
                self.size = max(self.size, end)
                return n
            self._spill()
        spool = self.spool
        assert spool is not None
        spool.check()
        if off < self.size and self.streaming:
            await self._take_back()
        spool.submit(Write(off, buf))
        self.size = max(self.size, end)
        if spool.queued > QUEUE_MAX:
            await spool.wait_room()
            spool.check()
        return n

    async def truncate(self, size: int) -> None:
        if self.closed:
            fail(errno.EBADF, "the file was closed")
        self.dirty = True
        if self.mem is not None:
            if size <= MEM_MAX:
                if size < len(self.mem):
                    self.mem = self.mem[:size]
                self.size = size
                return
            self._spill()
        assert self.spool is not None
        self.spool.check()
        if size < self.size and self.streaming:
            await self._take_back()
        self.spool.submit(Truncate(size))
        self.size = size

    async def read(self, off: int, size: int) -> bytes:
        if self.mem is not None:
            data = bytes(self.mem[off : off + size])
            if off + len(data) < min(off + size, self.size):  # a hole past what was written
                data += bytes(min(off + size, self.size) - off - len(data))
            return data
        spool = self.spool
        assert spool is not None
        n = max(0, min(size, self.size - off))
        if n == 0:
            return b""
        if self.streaming:
            await self._take_back()
        spool.submit(Sync())
        await spool.wait_applied()
        data = await self.ctx.run_sync(spool.pread, n, off)
        return data + bytes(n - len(data))

    def _spill(self) -> None:
        """Past MEM_MAX: a spooler takes over, streaming into a put (its task starts under
        the mount's nursery; it never awaits, so no request sees the writer half changed)."""
        assert self.mem is not None
        data = bytes(self.mem)
        if len(data) < self.size:  # an in-memory file extended by truncate
            data += bytes(self.size - len(data))
        self.mem = None
        # A file named by its digest is not streamed: a put that streams cannot be checked
        # against the name before it stores (a spool file can).
        self.streaming = self.expect is None
        self.spool = spool = Spooler(self.ctx.store, self.algo, self.expect, self.streaming)
        spool.submit(Write(0, data))
        self.ctx.workers.start_soon(spool.run, name="alkfsd spool")

    async def _take_back(self) -> None:
        """End the stream: what was written so far moves into a spool file."""
        assert self.spool is not None
        self.streaming = False
        self.spool.submit(TakeBack())
        await self.spool.wait_applied()
        self.spool.check()

    # -- storing ------------------------------------------------------------------------
    async def commit(
        self,
        after: Callable[[PutResult], None] | None = None,
        own: Callable[[bytes], PutResult | None] | None = None,
        ahead: Callable[[bytes], PutResult | None] | None = None,
    ) -> PutResult:
        """Store the content now; the caller owns the returned pin. `after(result)` runs
        in the put's worker thread, right after it (publish a name without a second
        thread hop); if it raises, the pin is released and the error propagates. For
        content held in memory: `ahead(data)` first, right here on the trio thread (it
        never waits: the library's write-behind, alkfs/writebehind.py; its result is
        returned as it is, None: stored as any other), then `own(data)` in the worker
        thread may store and name it in one step instead of the put and `after` (its
        result is returned as it is; None: the put and `after` run). There is one way
        to store what the write-behind does not take: a put in a worker thread."""
        if self.closed:
            fail(errno.EBADF, "the file was closed")
        self.dirty = False
        put: Put
        if self.mem is not None:
            data = bytes(self.mem)
            if len(data) < self.size:
                data += bytes(self.size - len(data))
            if ahead is not None and len(data) <= BEHIND_PUT_MAX:
                acked = ahead(data)
                if acked is not None:
                    return acked
            put = functools.partial(self.ctx.store.put, data, algo=self.algo, expect=self.expect)
            if own is not None:
                return await self.ctx.run_sync(self._own_or_put, own, data, put, after)
        else:
            spool = self.spool
            assert spool is not None
            spool.check()
            # (shielded as a thread hop is: the put this waits for runs on regardless, and
            # its pin is the caller's once it is taken)
            if self.streaming:
                self.streaming = False
                spool.submit(EndStream())
                with trio.CancelScope(shield=True):
                    await spool.wait_stream()
                # (the result first: a put that stored is the commit's even if the
                # spooler was stopped after it; without one, the error says why)
                result, spool.stream_result = spool.stream_result, None
                if result is None:
                    spool.check()
                    raise StoreIO("the streaming put gave no result")
                put = functools.partial(_given, result)
            else:
                spool.submit(Sync())
                with trio.CancelScope(shield=True):
                    await spool.wait_applied()
                spool.check()
                put = functools.partial(self._put_from_spool)
        return await self.ctx.run_sync(self._put_then, put, after)

    @classmethod
    def _own_or_put(
        cls,
        own: Callable[[bytes], PutResult | None],
        data: bytes,
        put: Put,
        after: Callable[[PutResult], None] | None,
    ) -> PutResult:
        result = own(data)
        return result if result is not None else cls._put_then(put, after)

    @staticmethod
    def _put_then(put: Put, after: Callable[[PutResult], None] | None) -> PutResult:
        result = put()
        if after is not None:
            try:
                after(result)
            except BaseException:
                result.pin.release()
                raise
        return result

    def _put_from_spool(self) -> PutResult:
        spool = self.spool
        assert spool is not None
        spool.check()
        return self.ctx.store.put(
            spool.chunks(self.size), self.size, algo=self.algo, expect=self.expect
        )

    def close(self) -> None:
        """Free the memory or end the spooler (a streaming put not committed stores nothing)."""
        if self.closed:
            return
        self.closed = True
        self.mem = None
        if self.spool is not None:
            self.spool.close()
            self.spool = None


def _given(result: PutResult) -> PutResult:
    return result
