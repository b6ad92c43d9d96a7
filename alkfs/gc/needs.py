"""What the collector and the fleet need of a store, stated as Protocols: `Store`
(alkfs/store, a layer above) has all of it, and alkfs/gc/ and alkfs/fleet.py name only
these (never `Store`, not even for types). The sweep's own (it also keeps the last
report) is `SweepStore` in alkfs/gc/sweep.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from ..keys import Key
from .arbiter import Arbiter
from .window import MemoryWindow, SqlWindow

# A delete guard (Store.delete_guards): entered once around a sweep's deletions with the
# raw keys due; the keys it says must be kept (None: none).
DeleteGuard = Callable[[list[bytes]], AbstractContextManager[set[bytes] | None]]


class HasSize(Protocol):
    """A stored object's stat, as far as the collector reads it (alkfs/store's ObjectStat)."""

    @property
    def size(self) -> int: ...


class WindowStore(Protocol):
    """The delete window and a stat: what a listing of the staged candidates reads
    (alkfs/gc/staged.py)."""

    @property
    def window(self) -> SqlWindow | MemoryWindow: ...

    def stat(self, key: Key) -> HasSize | None: ...


class SweepFleet(Protocol):
    """What a sweep asks of the fleet it runs in (alkfs/fleet.py's `Fleet`)."""

    def sweep_lease(self) -> AbstractContextManager[bool]: ...

    def epoch(self) -> int: ...

    def pinned_elsewhere(self, keys: list[bytes]) -> set[bytes]: ...

    def deleted(self, keys: list[bytes]) -> None: ...


class CollectedStore(WindowStore, Protocol):
    """What a sweep and a dry run read and call on the store (all but the last report:
    alkfs/gc/sweep.py's `SweepStore`)."""

    @property
    def arbiter(self) -> Arbiter: ...

    @property
    def log(self) -> logging.Logger: ...

    @property
    def window_ns(self) -> int: ...

    @property
    def fleet(self) -> SweepFleet | None: ...

    @property
    def delete_guards(self) -> Sequence[DeleteGuard]: ...

    def tx(self) -> AbstractContextManager[object]: ...

    def delete_staged(
        self, key: bytes, staged_ns: int, keep: Callable[[bytes], bool] | None = None
    ) -> int | None | bool: ...

    def on_deleted(self, key: bytes) -> None: ...

    def check_stopping(self, n: int = 0) -> None: ...

    def iter_keys(self) -> Iterator[bytes]: ...


class HasStaging(Protocol):
    """The large tier, as far as the fleet reads it: where its puts stage."""

    @property
    def staging(self) -> Path: ...


class FleetStore(Protocol):
    """What a fleet membership (alkfs/fleet.py) reads and calls on its store."""

    @property
    def arbiter(self) -> Arbiter: ...

    @property
    def path(self) -> Path | None: ...

    @property
    def large(self) -> HasStaging | None: ...

    def has_raw(self, key: bytes) -> bool: ...

    def on_deleted(self, key: bytes) -> None: ...
