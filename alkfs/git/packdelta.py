"""Git's delta format applied (`apply_delta`, `delta_sizes`: the header's varints), and
the cache of inflated delta bases (`BaseCache`), for the pack reader (packread.py: what
is checked, and the memory a read holds)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..errors import Corrupt

CACHE_BYTES = 16 << 20  # inflated delta bases kept, in bytes of their bodies
CACHE_ITEM_MAX = 4 << 20  # a base larger than this is never kept

Object = tuple[bytes, bytes]  # (type name, body)


class BaseCache:
    """Inflated delta bases by (pack, offset), least recently used out first: at most
    `limit` bytes of bodies, none over `item_max`. Thread-safe."""

    def __init__(self, limit: int = CACHE_BYTES, item_max: int = CACHE_ITEM_MAX) -> None:
        self.limit = limit
        self.item_max = min(item_max, limit)
        self._items: OrderedDict[tuple[int, int], Object] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[int, int]) -> Object | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: tuple[int, int], item: Object) -> None:
        size = len(item[1])
        if size > self.item_max:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= len(old[1])
            self._items[key] = item
            self._bytes += size
            while self._bytes > self.limit:
                _, gone = self._items.popitem(last=False)
                self._bytes -= len(gone[1])

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[tuple[int, int]]:
        """The keys, least recently used first."""
        with self._lock:
            return list(self._items)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    """A delta header's size (7 bits a byte, least significant first) at `buf[i]`; the
    value and the index after it."""
    value = shift = 0
    while True:
        if i >= len(buf):
            raise Corrupt("delta header cut short")
        c = buf[i]
        i += 1
        value |= (c & 0x7F) << shift
        if not c & 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise Corrupt("delta header size over 64 bits")


def delta_sizes(delta: bytes) -> tuple[int, int]:
    """(source size, target size) a delta's header states."""
    src, i = _varint(delta, 0)
    tgt, _ = _varint(delta, i)
    return src, tgt


def apply_delta(base: bytes, delta: bytes) -> bytes:
    """The target of git's delta format applied to `base`: a header of the base's size and
    the target's (varints), then copies from the base (opcode with the top bit set, its
    low 4 bits saying which offset bytes follow and the next 3 which size bytes; a size
    of 0 is 0x10000) and inserts (opcode 1..127: that many literal bytes follow). Anything
    else, a copy outside the base, a target longer or shorter than stated: `Corrupt`."""
    src, i = _varint(delta, 0)
    if src != len(base):
        raise Corrupt(f"a delta against {src} bytes applied to a base of {len(base)}")
    tgt, i = _varint(delta, i)
    out = bytearray()
    made = 0
    n = len(delta)
    try:
        with memoryview(base) as source:
            while i < n:
                c = delta[i]
                i += 1
                if c & 0x80:
                    off = size = 0
                    if c & 0x0F:
                        if c & 0x01:
                            off = delta[i]
                            i += 1
                        if c & 0x02:
                            off |= delta[i] << 8
                            i += 1
                        if c & 0x04:
                            off |= delta[i] << 16
                            i += 1
                        if c & 0x08:
                            off |= delta[i] << 24
                            i += 1
                    if c & 0x70:
                        if c & 0x10:
                            size = delta[i]
                            i += 1
                        if c & 0x20:
                            size |= delta[i] << 8
                            i += 1
                        if c & 0x40:
                            size |= delta[i] << 16
                            i += 1
                    if size == 0:
                        size = 0x10000
                    end = off + size
                    if end > src:
                        raise Corrupt(f"delta copies {size} bytes at {off} of a {src}-byte base")
                    made += size
                    if made > tgt:
                        raise Corrupt(f"delta makes more than its {tgt} bytes")
                    out += source[off:end]
                elif c:
                    end = i + c
                    if end > n:
                        raise Corrupt("delta insert cut short")
                    made += c
                    if made > tgt:
                        raise Corrupt(f"delta makes more than its {tgt} bytes")
                    out += delta[i:end]
                    i = end
                else:
                    raise Corrupt("delta opcode 0 (reserved)")
    except IndexError:
        raise Corrupt("delta copy cut short") from None
    if made != tgt:
        raise Corrupt(f"delta makes {made} bytes, its header says {tgt}")
    return bytes(out)
