"""Large sets of raw keys kept compact: what a sweep holds live at a million objects and more.

- `SortedKeys`: raw keys of one width (one algorithm) in one sorted buffer, 21 or 33 bytes
  a key (a Python `set` of the same keys costs ~90 bytes a key), with a 65,536-entry
  fan-out on the key's first two digest bytes so that a lookup bisects a few records.
  Built from keys given in ascending order (`SortedKeys.Builder`), e.g. the output of
  `sort -u`, never sorting in Python.
- `KeyUnion`: the union of several containers (the sources' sets, a `SortedKeys` per
  format, a small `set` of extras), answering `in` without copying any of them.
"""

from __future__ import annotations

from array import array
from collections.abc import Container, Iterable, Iterator

FANOUT = 1 << 16
SHARE_FROM = 4096  # a set this large joins a union as it is, not copied


class SortedKeys:
    """Raw keys of width `width`, sorted and distinct, with a two-byte fan-out (the bytes
    after the key's first, its algorithm). Immutable once built."""

    __slots__ = ("width", "_buf", "_fan", "_n")

    def __init__(self, width: int, buf: bytes | bytearray, fan: array) -> None:
        self.width = width
        self._buf = bytes(buf)
        self._fan = fan  # fan[i]: how many keys have digest[:2] < i (FANOUT + 1 entries)
        self._n = len(buf) // width

    class Builder:
        """Takes keys in strictly ascending order (`add`), then `done()`."""

        def __init__(self, width: int) -> None:
            if width < 3:
                raise ValueError("a key needs an algorithm byte and two digest bytes")
            self.width = width
            self._buf = bytearray()
            self._counts = array("I", bytes(4 * FANOUT))
            self._last = b""

        def add(self, key: bytes) -> None:
            if len(key) != self.width:
                raise ValueError(f"a key of {len(key)} bytes in a set of {self.width}")
            if key <= self._last:
                raise ValueError("keys must come in ascending order, once each")
            self._last = key
            self._buf += key
            self._counts[(key[1] << 8) | key[2]] += 1

        def __len__(self) -> int:
            return len(self._buf) // self.width

        def done(self) -> SortedKeys:
            fan = array("I", bytes(4 * (FANOUT + 1)))
            total = 0
            for i in range(FANOUT):
                fan[i] = total
                total += self._counts[i]
            fan[FANOUT] = total
            return SortedKeys(self.width, self._buf, fan)

    def __len__(self) -> int:
        return self._n

    def __contains__(self, key: object) -> bool:
        w = self.width
        if not isinstance(key, (bytes, bytearray)) or len(key) != w or self._n == 0:
            return False
        b = (key[1] << 8) | key[2]
        start, end = self._fan[b] * w, self._fan[b + 1] * w
        # a search in C over the fan-out's few records; a match must start on a record
        buf = self._buf
        pos = buf.find(key, start, end)
        while pos != -1:
            if (pos - start) % w == 0:
                return True
            pos = buf.find(key, pos + 1, end)
        return False

    def __iter__(self) -> Iterator[bytes]:
        w, buf = self.width, self._buf
        for i in range(0, len(buf), w):
            yield buf[i : i + w]

    @property
    def nbytes(self) -> int:
        return len(self._buf) + self._fan.itemsize * len(self._fan)


class KeyUnion:
    """The union of `parts` (containers of raw keys) and `extra`, kept apart: membership
    asks each; iteration yields each part's keys (a key in two parts comes twice)."""

    __slots__ = ("parts", "extra")

    def __init__(self, parts: Iterable[Container[bytes]] = (), extra: Iterable[bytes] = ()) -> None:
        self.parts: list[Container[bytes]] = list(parts)
        self.extra: set[bytes] = set(extra)

    def add(self, keys: Iterable[bytes] | Container[bytes]) -> None:
        """Keys join as a part (a `SortedKeys` or another union's parts) or, when they
        are a plain collection, into `extra`."""
        if isinstance(keys, SortedKeys) or (
            isinstance(keys, (set, frozenset)) and len(keys) > SHARE_FROM
        ):
            self.parts.append(keys)  # (by reference: never changed through the union)
        elif isinstance(keys, KeyUnion):
            self.parts.extend(keys.parts)
            self.extra |= keys.extra
        else:
            self.extra.update(keys)  # type: ignore[arg-type]

    def __contains__(self, key: object) -> bool:
        if key in self.extra:
            return True
        for p in self.parts:  # noqa: SIM110 (a loop, not any(): runs once per stored object)
            if key in p:
                return True
        return False

    def __or__(self, other: Iterable[bytes]) -> KeyUnion:
        out = KeyUnion(self.parts, self.extra)
        out.add(other)
        return out

    def __iter__(self) -> Iterator[bytes]:
        yield from self.extra
        for p in self.parts:
            yield from p  # type: ignore[misc]

    def __len__(self) -> int:
        """Keys counted once per part they are in."""
        return len(self.extra) + sum(len(p) for p in self.parts)  # type: ignore[arg-type,misc]
