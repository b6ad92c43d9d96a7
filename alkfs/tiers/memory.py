"""The in-memory engine (mode `mem`, and tests)."""

from __future__ import annotations

import bisect
import threading

from . import Entry


class MemoryTier:
    name = "mem"

    def __init__(self) -> None:
        self._data: dict[bytes, tuple[bytes, int]] = {}
        self._order: list[bytes] = []
        self._lock = threading.Lock()

    def stat(self, key: bytes) -> Entry | None:
        found = self._data.get(key)
        return None if found is None else Entry(key, len(found[0]), found[1])

    def read(self, key: bytes) -> bytes | None:
        found = self._data.get(key)
        return None if found is None else found[0]

    def put(self, key: bytes, data: bytes, now_ns: int) -> bool:
        with self._lock:
            if key in self._data:
                value, _ = self._data[key]
                self._data[key] = (value, now_ns)
                return False
            self._data[key] = (bytes(data), now_ns)
            bisect.insort(self._order, key)
            return True

    def freshen(self, key: bytes, now_ns: int) -> bool:
        with self._lock:
            if key not in self._data:
                return False
            self._data[key] = (self._data[key][0], now_ns)
            return True

    def delete(self, key: bytes) -> int | None:
        with self._lock:
            found = self._data.pop(key, None)
            if found is None:
                return None
            del self._order[bisect.bisect_left(self._order, key)]
            return len(found[0])

    def scan(self, after: bytes, before: bytes, limit: int) -> list[Entry]:
        with self._lock:
            i = bisect.bisect_right(self._order, after)
            keys = self._order[i : i + limit]
            out = []
            for k in keys:
                if k >= before:
                    break
                value, ts = self._data[k]
                out.append(Entry(k, len(value), ts))
            return out

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._order)
