"""In-process GC state behind one arbitration lock.

The lock guards pin refcounts, in-flight delete markers and the registered
liveness/protect sources. It is never held across I/O: a delete decides and
sets its marker inside the lock, deletes outside it, then clears the marker
once the delete has committed; a pin mint that meets a marker waits for that,
then the put stores afresh (a pin or a ref finds the object gone).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from ..keys import Key


class LivenessSource(Protocol):
    """Something that keeps objects alive (refs, durable pins, an embedder's table)."""

    def live_keys(self) -> Iterable[Key | bytes]:
        """Every key live now; called at mark time, outside the lock (may be slow)."""
        ...

    def contains(self, key: bytes) -> bool:
        """Whether `key` may be live; called under the lock at delete time: quick, no I/O."""
        ...


class Remote(Protocol):
    """Pins other processes' sweeps see (alkfs/fleet.py): a row a pinned key, written
    before the pin is handed out, deleted (lazily) after its last release."""

    def token(self) -> int: ...

    def pin(self, rows: list[tuple[bytes, int]]) -> None: ...

    def unpin(self, rows: list[tuple[bytes, int]]) -> None: ...


ProtectCallback = Callable[[], Iterable[Key | bytes]]
"""Returns keys that must not be deleted now; raising aborts the sweep ("protect-failed")."""


def raw(key: Key | bytes) -> bytes:
    return key.raw if isinstance(key, Key) else bytes(key)


class Pin:
    """One in-process pin on one key. Release it once (or use it as a context manager)."""

    __slots__ = ("_arbiter", "key", "_held")

    def __init__(self, arbiter: Arbiter, key: bytes) -> None:
        self._arbiter = arbiter
        self.key = key
        self._held = True

    @property
    def held(self) -> bool:
        return self._held

    def release(self) -> None:
        if self._held:
            self._held = False
            self._arbiter._release([self.key])

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Batch:
    """A group of pins released together in one locked step (never one by one)."""

    def __init__(self, arbiter: Arbiter) -> None:
        self._arbiter = arbiter
        self._pins: list[Pin] = []

    def add(self, pin: Pin) -> None:
        self._pins.append(pin)

    def __len__(self) -> int:
        return len(self._pins)

    def release(self, then: Callable[[], None] | None = None) -> None:
        """Release every member; `then` runs inside the same locked step (see Arbiter.convert)."""
        keys = []
        for p in self._pins:
            if p._held:
                p._held = False
                keys.append(p.key)
        self._pins.clear()
        self._arbiter._release(sorted(keys), then)

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Arbiter:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._pins: dict[bytes, int] = {}
        self._deleting: set[bytes] = set()
        self._sources: dict[int, LivenessSource] = {}
        self._protects: dict[int, ProtectCallback] = {}
        self._ids = itertools.count(1)
        self._sweeping = threading.Lock()
        self.remote: Remote | None = None
        self._tokens: dict[bytes, int] = {}  # the remote row's token of each pinned key

    # -- pins ---------------------------------------------------------------
    def acquire(self, key: Key | bytes) -> Pin:
        """Mint a pin; waits while a delete of this key is in flight."""
        k = raw(key)
        new: list[tuple[bytes, int]] = []
        with self._cond:
            while k in self._deleting:
                self._cond.wait()
            n = self._pins.get(k, 0)
            self._pins[k] = n + 1
            if n == 0 and self.remote is not None:
                new.append(self._token(k))
        self._publish(new, [k])
        return Pin(self, k)

    def _token(self, k: bytes) -> tuple[bytes, int]:
        assert self.remote is not None
        t = self._tokens[k] = self.remote.token()
        return k, t

    def _publish(self, rows: list[tuple[bytes, int]], keys: list[bytes]) -> None:
        """Write the remote rows of new pinnings (outside the lock); if that fails,
        the pins are given back and the error raised."""
        if not rows:
            return
        assert self.remote is not None
        try:
            self.remote.pin(rows)
        except BaseException:
            self._release(keys)
            raise

    def acquire_counts(self, keys: Iterable[bytes]) -> None:
        """Pin many raw keys in one locked step, without a Pin object each (bulk callers
        such as the import); each waits out an in-flight delete as `acquire` does. Give
        them back with `release_counts`."""
        keys = list(keys)
        new: list[tuple[bytes, int]] = []
        with self._cond:
            counts, deleting = self._pins, self._deleting
            remote = self.remote is not None
            for k in keys:
                while k in deleting:
                    self._cond.wait()
                n = counts.get(k, 0)
                counts[k] = n + 1
                if n == 0 and remote:
                    new.append(self._token(k))
        self._publish(new, keys)

    def release_counts(self, keys: list[bytes]) -> None:
        """Give back pins taken with `acquire_counts`, in one locked step."""
        self._release(keys)

    def _release(self, keys: list[bytes], then: Callable[[], None] | None = None) -> None:
        gone: list[tuple[bytes, int]] = []
        with self._cond:
            for k in keys:
                n = self._pins.get(k, 0) - 1
                if n > 0:
                    self._pins[k] = n
                else:
                    self._pins.pop(k, None)
                    t = self._tokens.pop(k, None)
                    if t is not None:
                        gone.append((k, t))
            if then is not None:
                then()
        if gone and self.remote is not None:
            self.remote.unpin(gone)

    def pinned_tokens(self) -> dict[bytes, int]:
        """The pinned keys with their remote rows' tokens (a copy)."""
        with self._cond:
            return dict(self._tokens)

    def convert(self, pin: Pin, register: Callable[[], None]) -> None:
        """Release `pin` and run `register` in one locked step: never neither-pinned-nor-live."""
        pin._held = False
        self._release([pin.key], register)

    def convert_many(self, pins: list[Pin], register: Callable[[], None]) -> None:
        """`convert` for many pins in one locked step."""
        for pin in pins:
            pin._held = False
        self._release([pin.key for pin in pins], register)

    def released(self, key: bytes) -> Pin:
        """A Pin on `key` that is not held (a result whose object is kept by its name)."""
        pin = Pin(self, key)
        pin._held = False
        return pin

    def batch(self) -> Batch:
        return Batch(self)

    def pin_count(self, key: Key | bytes) -> int:
        with self._cond:
            return self._pins.get(raw(key), 0)

    def pinned_keys(self) -> set[bytes]:
        with self._cond:
            return set(self._pins)

    # -- sources ------------------------------------------------------------
    def register_source(self, source: LivenessSource) -> int:
        with self._cond:
            token = next(self._ids)
            self._sources[token] = source
            return token

    def register_protect(self, callback: ProtectCallback) -> int:
        with self._cond:
            token = next(self._ids)
            self._protects[token] = callback
            return token

    def unregister(self, token: int) -> bool:
        with self._cond:
            return (
                self._sources.pop(token, None) is not None
                or self._protects.pop(token, None) is not None
            )

    def sources(self) -> list[LivenessSource]:
        with self._cond:
            return list(self._sources.values())

    def protects(self) -> list[ProtectCallback]:
        with self._cond:
            return list(self._protects.values())

    # -- the sweep lease ----------------------------------------------------
    def try_begin_sweep(self) -> bool:
        return self._sweeping.acquire(blocking=False)

    def end_sweep(self) -> None:
        self._sweeping.release()

    @property
    def sweeping(self) -> bool:
        return self._sweeping.locked()

    # -- delete-time arbitration -------------------------------------------
    def arbitrate(self, key: Key | bytes, protected: set[bytes] | None = None) -> bool:
        """True: the delete may proceed and this key's delete marker is now held
        (call `conclude` after the engine delete, on every path). False: cancelled,
        because the key is pinned, protected or re-observed live."""
        k = raw(key)
        with self._cond:
            while True:
                if k in self._pins:
                    return False
                if k not in self._deleting:
                    break
                self._cond.wait()
            if protected is not None and k in protected:
                return False
            for source in self._sources.values():
                try:
                    if source.contains(k):
                        return False
                except Exception:
                    return False  # a failing source refuses conservatively
            self._deleting.add(k)
            return True

    def conclude(self, key: Key | bytes) -> None:
        with self._cond:
            self._deleting.discard(raw(key))
            self._cond.notify_all()

    def conclude_many(self, keys: Iterable[bytes]) -> None:
        """`conclude` for many raw keys in one locked step."""
        with self._cond:
            for k in keys:
                self._deleting.discard(k)
            self._cond.notify_all()
