"""Writing a large object's staging file beside the hashing of the same bytes.

`StagingWriter(path, fd)` takes the chunks a put hashes and writes them in a helper
thread: hashlib and os.write both release the GIL, so the two overlap instead of
running one after the other. Every WRITEBACK_STEP bytes it asks the kernel to start
writing the range back (sync_file_range, SYNC_FILE_RANGE_WRITE: it does not wait), so
the fsync a put ends with waits only for the tail instead of the whole file. The same
thread digests the bytes a chunk at a time (catalog.ChunkDigester: the catalog row the
put records), in the same pass that writes them.

`write(chunk)` queues a chunk (the caller must not change it afterwards); `finish()`
waits for every write and fsyncs, raising the first write error; `digester` then holds
the size and chunk digests of everything written; `close()` stops the thread and closes
the descriptor (idempotent, on every path).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import queue
import threading
from pathlib import Path
from typing import Any

from ..catalog import ChunkDigester

WRITEBACK_STEP = 8 << 20
QUEUE_CHUNKS = 8  # chunks waiting for the thread (1 MiB each from a mount's writes)
SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Any:
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


class StagingWriter:
    """See the module docstring."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.digester = ChunkDigester()
        self._queue: queue.Queue[bytes | bytearray | None] = queue.Queue(QUEUE_CHUNKS)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="alkfs-staging", daemon=True)
        self._thread.start()

    def write(self, chunk: bytes | bytearray) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(chunk)

    def finish(self) -> None:
        self._stop()
        if self._error is not None:
            raise self._error
        os.fsync(self.fd)

    def close(self) -> None:
        self._stop()
        if self.fd >= 0:
            fd, self.fd = self.fd, -1  # never closed twice, even if close() raises
            os.close(fd)

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        written = started = 0
        while (chunk := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain: the caller learns of the error at its next call
            try:
                self.digester.update(chunk)  # (BLAKE3 releases the GIL, as os.write does)
                write_all(self.fd, chunk)
                written += len(chunk)
                if written - started >= WRITEBACK_STEP:
                    start_writeback(self.fd, started, written - started)
                    started = written
            except BaseException as exc:
                self._error = exc
