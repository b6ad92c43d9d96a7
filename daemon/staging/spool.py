"""The spool: where a writer's content past MEM_MAX goes, off the trio thread.

Up to MEM_MAX bytes of a new file stay in memory (staged.py). Past that, one worker per
writer takes the writes in order from a queue (the trio side only queues them, waiting
while more than QUEUE_MAX bytes are queued, so memory stays bounded whatever the
file's size). While the writes only move forward (appends, holes, an extending truncate:
cp, dd, rsync, tar), the worker streams them straight into `store.put`, whose own staging
file under the store directory is the only copy. A write below the end, a read or a
shrinking truncate ends the stream: the part streamed so far is finished as an object,
copied into a spool file under STORE/spool/ (a fleet member's STORE/nodes/<node>/spool/)
(unlinked at once; `clear_spool` at start removes what a crash may leave) and left
unreferenced for the sweep; from then on the writes go to the spool file.
"""

from __future__ import annotations

import collections
import contextlib
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from alkfs.errors import AlkfsError, StoreIO
from alkfs.keys import Algorithm, Key
from alkfs.store import PutResult

SPOOL_DIR = "spool"
QUEUE_MAX = 8 << 20  # bytes queued for a writer's spool thread before writes wait
ZEROS = bytes(1 << 20)


def inflight_root(store: Any) -> Path | None:
    """The daemon's own directory for in-flight files: `store.inflight` (a fleet member's
    STORE/nodes/<node>, made 0700 here; STORE itself for a sqlite store), None for a
    memory store. Another daemon of the fleet never uses (nor clears) it."""
    root = getattr(store, "inflight", None)
    if root is None:
        root = getattr(store, "path", None)
        return None if root is None else Path(root)
    root = Path(root)
    path = getattr(store, "path", None)
    if path is not None and root != Path(path):
        for d in (root.parent, root):  # STORE/nodes and STORE/nodes/<node>: the owner's
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, 0o700)
    return root


def spool_dir(store: Any) -> str:
    """Where spool files live: the daemon's in-flight directory's spool/ (STORE/spool, or
    STORE/nodes/<node>/spool for a fleet member; a temporary directory for a memory store)."""
    root = inflight_root(store)
    return os.path.join(root, SPOOL_DIR) if root is not None else tempfile.gettempdir()


def clear_spool(store: Any) -> int:
    """Remove spool files a crashed daemon left in this daemon's own spool directory (call
    at start: holding the store lock, or as a fleet member in a directory of its own)."""
    root = inflight_root(store)
    if root is None:
        return 0
    root = root / SPOOL_DIR
    n = 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(root):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(root / name)
                n += 1
    return n


def _open_spool(directory: str) -> int:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except (AttributeError, OSError):
        fd, path = tempfile.mkstemp(dir=directory, prefix="w-")
        os.unlink(path)
        return fd


class _Abandoned(AlkfsError):
    """The streaming put was given up (the writer was closed first): it stores nothing."""


# Markers queued between writes (a write is ("w", off, bytes), a truncate ("t", size)).
_EOF = object()  # the commit: the streaming put finishes with everything written
_SPILL = object()  # the writes go back: finish the put, copy it into a spool file, go on
_SYNC = object()  # (spooling) everything queued before it is in the spool file
_CLOSE = object()  # the writer is done: the thread ends (a streaming put stores nothing)


def _zeros(n: int) -> Iterator[bytes]:
    while n > 0:
        chunk = ZEROS[: min(n, len(ZEROS))]
        n -= len(chunk)
        yield chunk


class Spooler:
    """The thread behind one writer's content past MEM_MAX, applying queued items in order.

    Streaming first: writes that only move forward go straight into `store.put` (no copy
    of our own on disk). `_EOF` ends that put: its result is the commit's. `_SPILL`
    (a write went back, a read, a shrinking truncate) ends it too, and the partial
    object is copied into a spool file under STORE/spool and released (the sweep takes
    it unless something names it). From then on the items are applied to the spool
    file, and a commit puts from it. After a commit, the next item first copies the
    committed object into the spool file (a descriptor still open may write on)."""

    def __init__(self, store: Any, algo: Algorithm, expect: Key | None, stream: bool) -> None:
        self.store = store
        self.algo = algo
        self.expect = expect
        self.stream = stream
        self.fd = -1
        self.cond = threading.Condition()
        self.items: collections.deque[Any] = collections.deque()
        self.queued = 0  # bytes of the writes in `items`
        self.submitted = 0
        self.applied = 0
        self.broken: BaseException | None = None  # every later step fails with this
        self.stream_done = False
        self.stream_result: PutResult | None = None
        self.source: Key | None = None  # what the spool file must start from (after a commit)
        self._directory = spool_dir(store)
        threading.Thread(target=self._run, name="alkfsd-spool", daemon=True).start()

    # -- the trio side (never blocks) -----------------------------------------------
    def submit(self, item: Any, nbytes: int = 0) -> None:
        with self.cond:
            self.items.append(item)
            self.queued += nbytes
            self.submitted += 1
            self.cond.notify_all()

    # -- waits (worker threads) ---------------------------------------------------------
    def wait_room(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.queued <= QUEUE_MAX // 2 or self.broken is not None)

    def wait_applied(self) -> None:
        with self.cond:
            upto = self.submitted
            self.cond.wait_for(lambda: self.applied >= upto or self.broken is not None)

    def wait_stream(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.stream_done)

    # -- the thread -------------------------------------------------------------------
    def _next(self) -> Any:
        with self.cond:
            self.cond.wait_for(lambda: bool(self.items))
            item = self.items.popleft()
            if type(item) is tuple and item[0] == "w":
                self.queued -= len(item[2])
            return item

    def _done_one(self) -> None:
        with self.cond:
            self.applied += 1
            self.cond.notify_all()

    def _break(self, exc: BaseException) -> None:
        with self.cond:
            if self.broken is None:
                self.broken = exc
            self.cond.notify_all()

    def _feed(self, end: list[Any]) -> Iterator[bytes]:
        """The streaming put's input: forward writes, holes and extensions as zeros."""
        pos = 0
        while True:
            item = self._next()
            if item is _EOF or item is _SPILL:
                end.append(item)
                return
            if item is _CLOSE:
                end.append(item)
                raise _Abandoned("the writer was closed")
            if type(item) is not tuple:
                self._done_one()
                continue
            if item[1] > pos:  # a hole before a write, or an extending truncate
                yield from _zeros(item[1] - pos)
                pos = item[1]
            if item[0] == "w":
                data = item[2]
                pos += len(data)
                yield data
            self._done_one()

    def _run(self) -> None:
        try:
            if self.stream:
                try:
                    self._run_stream()
                except _Abandoned:
                    return
            with self.cond:
                self.stream_done = True
                self.cond.notify_all()
            while True:
                item = self._next()
                if item is _CLOSE:
                    return
                if self.broken is None:
                    try:
                        self._spool_item(item)
                    except Exception as exc:
                        self._break(exc)
                self._done_one()
        finally:
            with self.cond:
                self.stream_done = True
                self.cond.notify_all()
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def _run_stream(self) -> None:
        end: list[Any] = []
        result: PutResult | None = None
        try:
            result = self.store.put(self._feed(end), algo=self.algo)
        except _Abandoned:
            raise
        except BaseException as exc:
            self._break(exc)  # (the put refused: every later step says so)
        if end and end[0] is _SPILL and result is not None:
            self._take_back(result)
        else:
            with self.cond:
                self.stream_result = result
                self.source = None if result is None else result.key
        if end:
            self._done_one()  # the _EOF or _SPILL

    def _take_back(self, partial: PutResult) -> None:
        """The writes went back: the streamed part becomes the spool file's start. The
        partial object is released, not deleted: the same bytes may have been stored and
        named by another writer meanwhile (a put of existing bytes dedups into them), and
        an unreferenced object is the sweep's to take, after its window."""
        try:
            self._open(partial.key)
        except Exception as exc:
            self._break(exc)
        finally:
            partial.pin.release()

    def _open(self, source: Key | None) -> None:
        self.fd = _open_spool(self._directory)
        if source is None:
            return
        store = self.store
        with store.pin(source):  # (a committed object may be unreferenced: hold it)
            st = store.stat(source)
            if st is None:
                raise StoreIO(f"{source} was swept before the file was written again")
            path = store.large_path(source) if st.tier == "large" else None
            if path is None:
                data = store.get(source)  # verified: corrupt bytes are never carried over
                os.pwrite(self.fd, data or b"", 0)
                return
            store.verify_file(source, path)  # hashed once, then remembered
            src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                left, off = st.size, 0
                while left > 0:
                    n = os.copy_file_range(src, self.fd, left, off, off)
                    if n <= 0:
                        raise StoreIO(f"{source}: short copy into the spool file")
                    left -= n
                    off += n
            finally:
                os.close(src)

    def _spool_item(self, item: Any) -> None:
        if self.fd < 0:
            with self.cond:
                source, self.source = self.source, None
            self._open(source)
        if type(item) is not tuple:
            return  # _SYNC: nothing more to do
        if item[0] == "w":
            _, off, data = item
            view = memoryview(data)
            while view:
                n = os.pwrite(self.fd, view, off)
                view = view[n:]
                off += n
        else:
            os.ftruncate(self.fd, item[1])

    # -- reads of the spool file (worker threads) ----------------------------------------
    def pread(self, size: int, off: int) -> bytes:
        self.wait_applied()
        self.check()
        return os.pread(self.fd, size, off)

    def chunks(self, length: int) -> Iterator[bytes]:
        pos = 0
        while pos < length:
            chunk = os.pread(self.fd, min(1 << 20, length - pos), pos)
            if not chunk:
                raise StoreIO("the spool file is shorter than what was written")
            pos += len(chunk)
            yield chunk

    def check(self) -> None:
        exc = self.broken
        if exc is None:
            return
        if isinstance(exc, AlkfsError):
            raise exc
        raise StoreIO(f"the spool failed: {exc}")
