"""The store's state, shared by the mixins `Store` is made of (alkfs/store/core.py):
its tiers, its hooks, and what its long work shows.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from ..catalog import Catalog
from ..db import Database
from ..errors import Invalid
from ..fleet import NODES_DIR, Fleet
from ..gc.arbiter import Arbiter
from ..gc.sweep import SweepProgressFigures, SweepReport
from ..gc.window import MemoryWindow, SqlWindow
from ..reserve import Reserve
from ..tiers.local import LocalTier
from ..tiers.memory import MemoryTier
from ..tiers.sql import SqlTier

CHUNK = 1 << 20
MODES = ("dual-tier", "kv-only", "mem")
LARGE_DIR = "large"


class PackedTier(Protocol):
    """Git objects read from the store's packs (alkfs/git/packed.py registers one as
    `Store.packed`): a lookup after the kv and large tiers."""

    def stat(self, key: bytes) -> tuple[int, int] | None:
        """(canonical size, stored ns) of a packed object; None when no pack holds it."""
        ...

    def read(self, key: bytes) -> bytes | None:
        """Its canonical bytes, verified against the key (Corrupt if not); None when
        no pack holds it."""
        ...

    def holds(self, key: bytes) -> bool:
        """Whether a published set lists it (no read)."""
        ...

    def page(self, after: bytes, before: bytes, limit: int) -> list[tuple[bytes, int, int]]:
        """(key, size, stored ns) of packed objects with after < key < before, in order."""
        ...

    def only_counts(self) -> dict[int, int]:
        """{algorithm byte: objects kept in packs alone}."""
        ...

    def only_here(self) -> Iterator[bytes]:
        """The keys of the objects kept in packs alone (no kv row): the mark scan."""
        ...


class AheadTier(Protocol):
    """Small objects acknowledged ahead of their commit (alkfs/writebehind.py registers
    its pending index as `Store.ahead`): looked up after the kv tier, as kv objects."""

    def stat(self, key: bytes) -> tuple[int, int] | None:
        """(size, acknowledged ns) of a pending object; None when none is pending."""
        ...

    def read(self, key: bytes) -> bytes | None:
        """Its bytes (hashed by whoever acknowledged them); None when none is pending."""
        ...

    def page(self, after: bytes, before: bytes, limit: int) -> list[tuple[bytes, int, int]]:
        """(key, size, acknowledged ns) of pending objects with after <= key < before, in
        order (at most `limit`)."""
        ...

    def settle(self) -> bool:
        """Apply what is pending (a thread that may wait): before a sweep's mark. Whether
        it all went (if not, it stays pending and acknowledged: nothing is lost)."""
        ...


def _kv_tier(db: Database) -> SqlTier:
    if db.engine == "postgresql":
        from ..tiers.postgres import PgTier

        return PgTier(db)
    return SqlTier(db)


class StoreState:
    """What every part of a `Store` works on: set up by its constructor."""

    def __init__(
        self,
        path: Path | None,
        mode: str,
        threshold: int,
        window_s: float,
        db: Database | None,
        *,
        clear_staging: bool = True,
        own: str | None = None,
    ) -> None:
        if mode not in MODES:
            raise Invalid(f"unknown mode {mode!r}")
        self.path = path
        self.mode = mode
        self.threshold = threshold
        self.window_ns = int(window_s * 1e9)
        self.db = db
        self.log = logging.getLogger("alkfs.store")
        self.arbiter = Arbiter()
        self.kv: SqlTier | MemoryTier
        self.large: LocalTier | None = None
        self.catalog: Catalog | None = None
        if db is None:
            self.kv = MemoryTier()
            self.window: SqlWindow | MemoryWindow = MemoryWindow()
        else:
            self.kv = _kv_tier(db)
            self.window = SqlWindow(db)
            if mode == "dual-tier":
                assert path is not None
                self.large = LocalTier(path / LARGE_DIR, clear_staging=clear_staging, own=own)
                self.catalog = Catalog(db)
        self.fleet: Fleet | None = None  # a PostgreSQL store's membership (alkfs/fleet.py)
        # where the daemon keeps its in-flight files: STORE, or a fleet member's own
        self.inflight: Path | None = path if own is None or path is None else path / NODES_DIR / own
        self.last_sweep: SweepReport | None = None
        # How far the running verify and sweep got (None when none runs), for a status to
        # show: objects looked at by the verify; the sweep's phase and figures (SweepProgress)
        self.verifying: int | None = None
        self.sweep_progress: SweepProgressFigures | None = None
        # Set when the store's owner stops (SIGTERM, an unmount): long work (sweeps,
        # verify, a borrower's git) checks it at its next safe point and ends (Interrupted)
        self.stopping = threading.Event()
        self.corrupt: set[bytes] = set()
        # Puts that ended (stored or not), moved after each: a lookup that found a key
        # absent and saw no put end meanwhile may answer the same until one does.
        self.puts = 0
        self.deleted_hooks: list[Callable[[bytes], None]] = []
        # called with (raw keys, contents) of every kv put, new or not, right after the
        # insert (inside its transaction where it has one): e.g. LFS pointers recorded
        self.put_hooks: list[Callable[[Sequence[bytes], Sequence[bytes]], None]] = []
        # called (in the calling thread) after every put ends and every deletion: what a
        # listing of the store shows may have changed (the daemon's cached listings)
        self.changed_hooks: list[Callable[[], None]] = []
        # Held once around all of a sweep's deletions, with the keys due at its start (the
        # layers above register them: alkfs/app.py adds the derived packs' guard).
        self.delete_guards: list[
            Callable[[list[bytes]], AbstractContextManager[set[bytes] | None]]
        ] = []
        # Run before a drain deletes kv rows of packed git objects (alkfs/git/packs/
        # drain.py): what must have read them first (alkfs/app.py adds the LFS scan).
        self.before_drain: list[Callable[[], object]] = []
        # Run at the end of `verify` (the layers above register them: alkfs/app.py adds
        # the derived packs' check).
        self.verify_hooks: list[Callable[[], object]] = []
        # git objects in the store's packs (alkfs/app.py registers alkfs/git/packed.py's):
        # looked up after the kv and large tiers, tier "packs"
        self.packed: PackedTier | None = None
        # small objects acknowledged and not in the database yet (alkfs/writebehind.py
        # registers its index): reads and lookups see them as kv objects
        self.ahead: AheadTier | None = None
        self._verified: dict[bytes, tuple[int, int, int, int]] = {}
        self._lock_fd: int | None = None
        self._inert_upto = 0  # catalog rows stored up to this were looked at (reap_inert_rows)
        self._vlock = threading.Lock()
        self.reserve: Reserve | None = None  # STORE/reserve (alkfs/reserve.py): the lock holder's
