"""Counts of the FUSE requests that reach Python: per operation, how many and how long
(a histogram), and the bytes read and written (the metrics' `alkfs_fuse_request_seconds`,
`alkfs_fuse_read_bytes_total`, `alkfs_fuse_written_bytes_total`).

Updated on the trio thread by the handlers' wrapper (errors.fuse_op): a clock read and a
few list updates a request. Read from other threads (the metrics' HTTP server) only as a
`snapshot()`, a copy taken under a lock the trio thread holds for no longer than a copy."""

from __future__ import annotations

import bisect
import threading
from typing import TypedDict

# upper bounds of the latency buckets, in seconds (the last bucket is +Inf)
BOUNDS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
_BOUNDS_NS = tuple(int(b * 1e9) for b in BOUNDS_S)


class StatsSnapshot(TypedDict):
    """`RequestStats.snapshot`: per operation (count, seconds, bucket counts), and bytes."""

    ops: dict[str, tuple[int, float, list[int]]]
    read_bytes: int
    written_bytes: int


class RequestStats:
    def __init__(self) -> None:
        # op -> [count, total ns, bucket counts (len(BOUNDS_S) + 1)]
        self.ops: dict[str, list] = {}
        self.read_bytes = 0
        self.written_bytes = 0
        self._lock = threading.Lock()

    def observe(self, op: str, ns: int) -> None:
        row = self.ops.get(op)
        if row is None:
            row = self.ops[op] = [0, 0, [0] * (len(BOUNDS_S) + 1)]
        row[0] += 1
        row[1] += ns
        row[2][bisect.bisect_left(_BOUNDS_NS, ns)] += 1

    def snapshot(self) -> StatsSnapshot:
        """{"ops": {op: (count, seconds, [bucket counts])}, "read_bytes", "written_bytes"}."""
        with self._lock:
            for _ in range(3):  # (the trio thread may add an op while we copy)
                try:
                    ops = {op: (r[0], r[1] / 1e9, list(r[2])) for op, r in self.ops.items()}
                    break
                except RuntimeError:
                    continue
            else:
                ops = {}
        return {"ops": ops, "read_bytes": self.read_bytes, "written_bytes": self.written_bytes}
