"""Kernel entry invalidation off the request path.

Same mechanism as `pyfuse3.invalidate_entry_async` (a queue drained by one
thread that calls the blocking `pyfuse3.invalidate_entry`, which releases the
GIL), plus a sequence number so a caller can wait, with a bound, until what it
queued has reached the kernel — the control file's `sweep` uses that to return
only once the deleted objects' entries are gone. Never call the blocking form
inside a request: the kernel may need a lock that request holds.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading

import pyfuse3

log = logging.getLogger("alkfsd")


class Invalidator:
    """Queue (parent inode, name, deleted inode) triples for the kernel.

    With `live=False` (no kernel session: the direct-call tests) the requests are
    only recorded in `recorded`.
    """

    def __init__(self, live: bool) -> None:
        self.live = live
        self.recorded: list[tuple[int, bytes | None, int]] = []
        self._q: queue.SimpleQueue[tuple[int, bytes | None, int] | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._submitted = 0
        self._done = 0
        self._thread: threading.Thread | None = None

    def submit_inode(self, ino: int) -> int:
        """Queue the invalidation of an inode's attributes (a directory's cached listing is
        then checked against its mtime: daemon/listings.py); returns its sequence number."""
        return self.submit(ino, None)

    def submit(self, parent_ino: int, name: bytes | None, deleted_ino: int = 0) -> int:
        """Queue one invalidation (thread-safe); returns its sequence number."""
        with self._cond:
            self._submitted += 1
            seq = self._submitted
            if not self.live:
                self.recorded.append((parent_ino, name, deleted_ino))
                self._done = seq
                return seq
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="alkfsd-invalidate", daemon=True
                )
                self._thread.start()
            self._q.put((parent_ino, name, deleted_ino))  # in order of seq
        return seq

    @property
    def submitted(self) -> int:
        with self._cond:
            return self._submitted

    def wait(self, seq: int, timeout: float) -> bool:
        """Block until every request up to `seq` was handed to the kernel (or timeout)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._done >= seq, timeout)

    def stop(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=5)
            self._thread = None

    def _loop(self) -> None:
        while (item := self._q.get()) is not None:
            parent, name, deleted = item
            try:
                if name is None:
                    pyfuse3.invalidate_inode(parent, attr_only=True)
                else:
                    pyfuse3.invalidate_entry(parent, name, deleted)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ENODEV):
                    log.warning(
                        "invalidate %r in inode %d: errno=%s",
                        name,
                        parent,
                        errno.errorcode.get(exc.errno or 0, exc.errno),
                    )
            except Exception:
                log.exception("invalidate %r in inode %d failed", name, parent)
            finally:
                with self._cond:
                    self._done += 1
                    self._cond.notify_all()
