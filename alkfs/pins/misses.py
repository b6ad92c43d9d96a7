"""Names known to be unpinned, answered without a query: `Misses`, and the Bloom filter
of every pin name it may hold (`NameFilter`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator


class NameFilter:
    """A Bloom filter of pin names: `maybe(name)` is False only for a name never added
    (16 bits a name, 6 of them set: ~1 name in 1,000 never added is a maybe). It holds up
    to `capacity` names; `add` past that is False (the caller drops the filter)."""

    BITS_PER_NAME = 16
    SPOTS = 6
    MIN_NAMES = 1 << 20  # (2 MiB)

    def __init__(self, names: int) -> None:
        self.capacity = max(self.MIN_NAMES, 2 * names)
        self.size = self.capacity * self.BITS_PER_NAME
        self.bits = bytearray(self.size // 8)
        self.count = 0

    def add(self, name: str) -> bool:
        """Add `name`: False when the filter is full. A name already in (every spot set:
        a re-pin, a replace) changes nothing and is not counted again."""
        return self.add_many((name,))

    def add_many(self, names: Iterable[str]) -> bool:
        """`add` each of `names` (False once the filter is full: the rest are not added)."""
        bits, size, spots_ = self.bits, self.size, range(self.SPOTS)
        for name in names:
            h = hash(name)
            a, b = h & 0xFFFFFFFF, ((h >> 32) & 0xFFFFFFFF) | 1
            new = False
            for i in spots_:
                spot = (a + i * b) % size
                byte, bit = spot >> 3, 1 << (spot & 7)
                if not bits[byte] & bit:
                    if not new:
                        if self.count >= self.capacity:
                            return False
                        self.count += 1
                        new = True
                    bits[byte] |= bit
        return True

    def maybe(self, name: str) -> bool:
        # (add_many's arithmetic, stopping at the first clear bit: a new name's lookup
        # asks this three times, and in a filter mostly clear the first spot answers)
        h = hash(name)
        a, b = h & 0xFFFFFFFF, ((h >> 32) & 0xFFFFFFFF) | 1
        size, bits = self.size, self.bits
        for i in range(self.SPOTS):
            spot = (a + i * b) % size
            if not bits[spot >> 3] >> (spot & 7) & 1:
                return False
        return True


class Misses:
    """Names known to be unpinned, answered without a query: those `Pins.get` found
    unpinned, until any pin changes (a mount looks a new name up three times before it
    is written: cp's stat, the kernel's O_EXCL lookup, the create's check), and, once
    `prime` has loaded every pin name into a `NameFilter`, every name it says was never
    pinned (so a new name costs no query at all). Only where every change to the table
    passes through this process's `Pins` (`on`: not a fleet's store, nor one opened
    beside its lock holder).

    Every change runs inside `changing()`, which encloses its commit: it forgets every
    name found unpinned when it starts, and no query that overlapped it may add one
    (`epoch`); a change that names a pin adds the name to the filter first (`adding`)."""

    LIMIT = 4096

    def __init__(self, on: bool) -> None:
        self.on = on
        self._lock = threading.Lock()
        self._names: set[str] = set()
        self._epoch = 0
        self._writing = 0
        self.filter: NameFilter | None = None

    def known(self, name: str) -> bool:
        if name in self._names:
            return True
        f = self.filter
        return f is not None and not f.maybe(name)

    def prime(self, scan: Callable[[], Iterable[str] | None]) -> bool:
        """Build the filter from `scan()` (every pin name; None: too many to hold). False
        (no filter) then, or when a change was under way or ran meanwhile."""
        if not self.on:
            return False
        with self._lock:
            if self._writing:
                return False
            epoch = self._epoch
        scanned = scan()
        if scanned is None:
            return False
        names = list(scanned)
        f = NameFilter(len(names))
        f.add_many(names)
        with self._lock:
            if epoch != self._epoch:
                return False
            self.filter = f
        return True

    def adding(self, name: str) -> None:
        """(inside `changing()`, before its commit) `name` is about to be pinned."""
        self.adding_many((name,))

    def adding_many(self, names: Iterable[str]) -> None:
        """`adding` for each of `names`, in one locked step."""
        with self._lock:
            f = self.filter
            if f is not None and not f.add_many(names):
                self.filter = None  # (full: lookups query again, as before `prime`)

    def drop_filter(self) -> None:
        """(inside `changing()`) Too many names change at once: lookups query again."""
        with self._lock:
            self.filter = None

    def before_query(self) -> int:
        return self._epoch

    def steady(self, epoch: int) -> bool:
        """No change to the pins ran or began since `before_query()` said `epoch` (a
        caller's own memo of what it found since then holds); never where another
        process changes pins too (`on` false)."""
        return self.on and epoch == self._epoch and not self._writing

    def missed(self, name: str, epoch: int) -> None:
        """The query begun at `epoch` found no pin `name`."""
        if not self.on:
            return
        with self._lock:
            if epoch != self._epoch or self._writing:
                return
            if len(self._names) >= self.LIMIT:
                self._names.clear()
            self._names.add(name)

    def moved(self) -> None:
        """A pin appeared outside the database (one pending ahead of its commit: alkfs/
        writebehind.py): a caller's memo of a name found absent is stale."""
        with self._lock:
            self._epoch += 1

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        with self._lock:
            self._writing += 1
            self._epoch += 1
            self._names.clear()
        try:
            yield
        finally:
            with self._lock:
                self._writing -= 1
                self._epoch += 1
