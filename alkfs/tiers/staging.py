"""Writing a large object's staging file beside the hashing of the same bytes.

`StagingWriter(path, fd)` takes the chunks a put hashes and writes them in helper
threads: hashlib, BLAKE3 and os.write all release the GIL, so they overlap instead of
running one after the other. The staging thread digests the bytes a chunk at a time
(catalog.ChunkDigester: the catalog row the put records), in the same pass that writes
them.

The file is written with O_DIRECT where the file system takes it: the staging thread
copies the chunks into page-aligned buffers of DIRECT_BUFFER bytes (a few per writer,
reused across writers from a small pool), and an I/O thread writes each full buffer
straight to the disk, so no page of the page cache is filled on the way. (The copy was
the caller's: its thread also hashes the whole object, the longest of the three; an
O_DIRECT write waits for the disk, so the copy and digest do not wait behind it.) Measured on
this machine's VM (docs/architecture.md, "Large writes"): a fresh page-cache page cost more than the
disk write itself once memory freed by a deleted object had gone back to the host, and
a 1 GiB put spent most of its time in the kernel's copy into those pages. The tail of a
file (under ALIGN bytes) goes through the page cache. Where O_DIRECT is refused (at
open or at a write: EINVAL), the file is written through the page cache instead, and
every WRITEBACK_STEP bytes the kernel is asked to start writing the range back
(sync_file_range, SYNC_FILE_RANGE_WRITE: it does not wait), so the fsync a put ends
with waits only for the tail.

`write(chunk)` takes a chunk (the caller must not change it afterwards); `finish()`
waits for every write and fsyncs, raising the first write error; `digester` then holds
the size and chunk digests of everything written; `close()` stops the threads, gives the
buffers back and closes the descriptor (idempotent, on every path).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from ..catalog import ChunkDigester

WRITEBACK_STEP = 8 << 20
QUEUE_CHUNKS = 8  # chunks waiting for the thread (1 MiB each from a mount's writes)
SYNC_FILE_RANGE_WRITE = 2
DIRECT_BUFFER = 4 << 20  # bytes of one O_DIRECT write (a multiple of ALIGN)
DIRECT_BUFFERS = 3  # a writer's buffers: one filling, the others written or waiting
ALIGN = 4096  # what an O_DIRECT write's offset, length and address are a multiple of
POOL_MAX = DIRECT_BUFFERS  # idle buffers kept for the next writer (a fresh page costs)

_pool: list[mmap.mmap] = []
_pool_lock = threading.Lock()


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = libc.sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn
    return None


_SFR = _sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing [offset, offset+length) back to the disk; never waits, never fails
    (an error shows at the fsync)."""
    if _SFR is not None:
        _SFR(fd, offset, length, SYNC_FILE_RANGE_WRITE)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; False where the file system refuses it."""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
    except OSError:
        return False
    return True


def _take_buffer() -> mmap.mmap:
    with _pool_lock:
        if _pool:
            return _pool.pop()
    return mmap.mmap(-1, DIRECT_BUFFER)  # anonymous: page-aligned


def _give_buffer(buf: mmap.mmap) -> None:
    with _pool_lock:
        if len(_pool) < POOL_MAX:
            _pool.append(buf)
            return
    with contextlib.suppress(BufferError):  # (a view a kept traceback holds: GC frees it)
        buf.close()


class StagingWriter:
    """See the module docstring."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.digester = ChunkDigester()
        self._error: BaseException | None = None
        self._abandoned = False
        self.direct = set_direct(fd, True)  # (False once a write has been refused)
        # The caller's chunks go to the staging thread through _queue (at most
        # QUEUE_CHUNKS wait). O_DIRECT: that thread copies them into buffers (`_fill`
        # bytes of `_current` filled) and hands each full one to the I/O thread through
        # _io; it comes back through _free. Otherwise the staging thread writes them.
        self._queue: queue.Queue[bytes | bytearray | None] = queue.Queue(QUEUE_CHUNKS)
        self._io: queue.Queue[tuple[mmap.mmap, int] | None] = queue.Queue()
        self._free: queue.Queue[mmap.mmap] = queue.Queue()
        self._buffers: list[mmap.mmap] = []
        self._current: mmap.mmap | None = None
        self._fill = 0
        self._io_thread: threading.Thread | None = None
        self._thread = threading.Thread(target=self._run, name="alkfs-staging", daemon=True)
        try:
            if self.direct:
                for _ in range(DIRECT_BUFFERS):
                    buf = _take_buffer()
                    self._buffers.append(buf)
                    self._free.put(buf)
                self._io_thread = threading.Thread(
                    target=self._run_io, name="alkfs-io", daemon=True
                )
                self._io_thread.start()
            self._thread.start()
        except BaseException:  # (a thread that cannot start: nothing is kept)
            self._stop_io()
            for buf in self._buffers:
                _give_buffer(buf)
            self._buffers = []
            raise

    def write(self, chunk: bytes | bytearray) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(chunk)  # (waits while QUEUE_CHUNKS wait)

    def finish(self) -> None:
        self._stop()
        if self._error is not None:
            raise self._error
        os.fsync(self.fd)

    def close(self) -> None:
        self._abandoned = True  # (buffers still queued are not written: nobody reads them)
        self._stop()
        buffers, self._buffers, self._current = self._buffers, [], None
        for buf in buffers:
            _give_buffer(buf)
        if self.fd >= 0:
            fd, self.fd = self.fd, -1  # never closed twice, even if close() raises
            os.close(fd)

    def _stop(self) -> None:
        """Every chunk queued so far written (or dropped after an error or `close`), the
        threads gone."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._stop_io()

    def _stop_io(self) -> None:
        if self._io_thread is not None and self._io_thread.is_alive():
            self._io.put(None)
            self._io_thread.join()

    def _run(self) -> None:
        """The staging thread: digest each chunk, then copy it into the O_DIRECT buffers
        (the I/O thread writes them) or write it through the page cache."""
        written = started = 0
        while (item := self._queue.get()) is not None:
            if self._error is not None or self._abandoned:
                continue  # drain: the caller learns of the error at its next call
            try:
                self.digester.update(item)  # (BLAKE3 releases the GIL, as os.write does)
                if self._buffers:
                    self._copy(item)
                    continue
                write_all(self.fd, item)
                written += len(item)
                if written - started >= WRITEBACK_STEP:
                    start_writeback(self.fd, started, written - started)
                    started = written
            except BaseException as exc:
                self._error = exc
        if self._current is not None and self._fill and self._error is None and not self._abandoned:
            self._send()  # (the last buffer: its tail goes through the page cache)
        self._stop_io()

    def _copy(self, chunk: bytes | bytearray) -> None:
        view = memoryview(chunk)
        while view:
            if self._current is None:
                self._current = self._free.get()  # (waits while every buffer is in flight)
                if self._error is not None:
                    return
            n = min(len(view), DIRECT_BUFFER - self._fill)
            self._current[self._fill : self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == DIRECT_BUFFER:
                self._send()

    def _send(self) -> None:
        assert self._current is not None
        self._io.put((self._current, self._fill))
        self._current, self._fill = None, 0

    def _run_io(self) -> None:
        """The I/O thread: write each full buffer (in order), give it back."""
        while (item := self._io.get()) is not None:
            buf, n = item
            try:
                if self._error is None and not self._abandoned:
                    with memoryview(buf) as view:
                        self._write_direct(view[:n])
            except BaseException as exc:
                self._error = exc
            finally:
                self._free.put(buf)  # (even after an error: the copy may wait for it)

    def _write_direct(self, view: memoryview) -> None:
        """Write one buffer's bytes: whole blocks with O_DIRECT, a tail (only the last
        buffer has one) through the page cache. A write the file system refuses with
        EINVAL is made through the page cache instead, as is everything after it."""
        while view:
            n = len(view)
            if self.direct:
                n -= n % ALIGN  # O_DIRECT takes whole blocks only
                if n == 0:
                    self._buffered()
                    continue
            try:
                n = os.write(self.fd, view[:n])
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self._buffered()
                continue
            view = view[n:]

    def _buffered(self) -> None:
        if self.direct:
            self.direct = False
            set_direct(self.fd, False)
