"""Small puts acknowledged ahead of their database commit: the write-behind.

A small file's close (`cp`'s, one file at a time) used to wait for its own sqlite
transaction: the object's row, its pin's row, the commit, about two thirds of what the
daemon spent on the file. With the write-behind, `put` appends the intent to the store's
intents log (alkfs/intents.py, its on-disk format: one write into the page cache, as
durable as sqlite's commits, which are not fsynced either) and returns at once; `apply`
(a worker thread: it waits for sqlite) stores the intents many at a time. Whoever opens
the store with its lock applies what a process that died left in the log (`replay`,
from `Alkfs.open`).

What is acknowledged and not applied yet is not in the database; it is in the pending
index here (by key and by pin name), registered as the store's `ahead` (Store.stat, has,
get, read_range, list see a pending object as a kv object) and the pins' `ahead` (their
lookups and listings see a pending pin). A library change that could conflict with a
pending one (a change of a pending pin's name, a rename, a directory made or removed, a
sweep's mark) applies what is pending first, from its own thread. The owner
(`Alkfs.start_behind`) decides when to apply otherwise (the daemon: once closes pause);
this module only does it, from any thread (thread-safe).

Only a store this process alone writes (not a fleet's member), on sqlite, with room on
its disk (no reserve armed), for content of the kv tier under a non-git algorithm.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .db.sqlite import BACKFILL_COMMITS
from .errors import AlkfsError, NoSpace
from .intents import LOG_NAME, Intent, IntentLog, decode
from .keys import Algorithm, Key
from .pins import PinRecord, from_intent
from .store import BEHIND_PUT_MAX, PutResult

if TYPE_CHECKING:
    from .pins import Pins

log = logging.getLogger("alkfs")

# The owner applies once APPLY_BYTES of content or APPLY_COUNT intents wait (see the
# daemon's driver, daemon/staging/pending.py, for its other rules).
APPLY_BYTES = 32 << 20
APPLY_COUNT = 20_000
APPLY_BATCH = 4096  # intents a transaction applies (each holds sqlite's write lock)
PENDING_MAX = 64 << 20  # bytes of content waiting: beyond, `put` declines
LOG_MAX = 256 << 20  # the log's size beyond which `put` declines until applied
AHEAD_ALGOS = frozenset({Algorithm.SHA256, Algorithm.BLAKE3})


def apply(pins: Pins, intents: Sequence[Intent], stamps: Mapping[str, int] | None = None) -> None:
    """Store and pin `intents` in one transaction (a worker thread: it may wait); a new
    pin's creation time is its name's in `stamps` if there."""
    pins.put_pinned_many([(i.name, i.key, i.data) for i in intents], stamps)


def replay(pins: Pins) -> int:
    """Apply what the log holds (a process that died left it) and empty it; how many."""
    store = pins.store
    if store.path is None:
        return 0
    path = store.path / LOG_NAME
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return 0
    if not blob:
        return 0
    intents = list(decode(blob))
    apply(pins, intents)
    with open(path, "r+b") as f:
        f.truncate(0)
        os.fsync(f.fileno())
    log.info("intents: applied %d small put(s) a stopped daemon had acknowledged", len(intents))
    return len(intents)


class WriteBehind:
    """The intents acknowledged and not applied yet (see the module docstring)."""

    def __init__(self, pins: Pins) -> None:
        self.pins = pins
        store = pins.store
        assert store.path is not None
        self.log: IntentLog | None = IntentLog(store.path)
        self.limit = min(store.threshold, BEHIND_PUT_MAX)
        self.items: list[Intent] = []
        self.count = 0  # len(items): read without the lock by the owner's checks
        # the index of what is pending (`_add`): raw key -> (its content, acknowledged
        # ns); pin name -> its pending record
        self.objects: dict[bytes, tuple[bytes, int]] = {}
        self.pins_ahead: dict[str, PinRecord] = {}
        self._acked: list[int] = []  # the ns each pending intent was acknowledged at
        self.bytes = 0
        self.applied = 0  # intents applied (status)
        self.held = 0  # while above 0 (a drain under way), `put` declines
        self.failures = 0  # failed applies in a row
        self._since_backfill = 0
        self._lock = threading.Lock()  # the index and the log (held briefly)
        self._applying = threading.Lock()  # one apply at a time
        store.ahead = self  # (reads and lookups see what is pending: `stat`, `pinned`)
        pins.ahead = self

    # -- acknowledging (any thread; never waits for the database) -----------------------
    def put(
        self, name: str | None, algo: Algorithm, data: bytes, expect: Key | None
    ) -> PutResult | None:
        """Log the intent of storing `data` (pinned as `name`) and return its result (no
        pin held: a named one is pinned under its name), or None: store it otherwise
        (not here, too large, the disk filling up, the content not `expect`, a corrupt
        copy to replace, a drain under way, an apply failing, a log that failed: nothing
        was logged)."""
        log_ = self.log
        if (
            log_ is None
            or self.held
            or self.failures
            or len(data) > self.limit
            or algo not in AHEAD_ALGOS
            or self.bytes + len(data) > PENDING_MAX
            or log_.size > LOG_MAX
        ):
            return None
        store = self.pins.store
        reserve = store.reserve
        if reserve is not None and not (reserve.settled() and not reserve.have):
            return None
        key = Key.digest_of(algo, data)
        if (expect is not None and key != expect) or key.raw in store.corrupt:
            return None
        intent = Intent(name, key, data)
        # (a pending pin shows the creation time its row will have: the mount knows a
        # file by it)
        now = time.time_ns() if name is None else self.pins._stamps()
        with self._lock:
            try:
                log_.append(intent)
            except OSError as exc:
                log.debug("intents log: %s; not written behind", exc)
                return None
            self.items.append(intent)
            self._acked.append(now)
            self.bytes += len(data)
            self._add(intent, now)
            self.count += 1  # (last: a reader that sees the count sees the index)
        if name is not None:
            self.pins.misses.moved()  # (a memo of the name found absent is stale now)
        for hook in store.changed_hooks:  # (what a listing shows changed, as at a put's end)
            hook()
        return PutResult(key, store.arbiter.released(key.raw), True)

    def logged(self) -> int:
        """Intents logged since the start (applied ones and pending ones)."""
        return self.applied + self.count

    # -- read-your-writes (any thread; Store.ahead, Pins.ahead) -------------------------
    def stat(self, key: bytes) -> tuple[int, int] | None:
        found = self.objects.get(key)
        return None if found is None else (len(found[0]), found[1])

    def read(self, key: bytes) -> bytes | None:
        found = self.objects.get(key)
        return None if found is None else found[0]

    def page(self, after: bytes, before: bytes, limit: int) -> list[tuple[bytes, int, int]]:
        objects = self.objects
        if not objects:
            return []
        keys = sorted(k for k in list(objects) if after <= k < before)[:limit]
        out = []
        for k in keys:
            found = objects.get(k)
            if found is not None:
                out.append((k, len(found[0]), found[1]))
        return out

    def pinned(self, name: str) -> PinRecord | None:
        return self.pins_ahead.get(name)

    def pinned_below(self, prefix: str) -> list[PinRecord]:
        return sorted(
            (r for n, r in list(self.pins_ahead.items()) if n.startswith(prefix)),
            key=lambda r: r.name,
        )

    def settle(self) -> bool:
        """Apply everything pending now (a thread that may wait); whether it all went."""
        return self.apply()

    def due(self) -> bool:
        """Enough waits to apply now (APPLY_BYTES or APPLY_COUNT)."""
        return self.bytes >= APPLY_BYTES or self.count >= APPLY_COUNT

    # -- applying (a worker thread: it waits for sqlite) ---------------------------------
    def apply(self) -> bool:
        """Apply what is pending now, APPLY_BATCH at a time (each its own transaction);
        whether all of it went (a failure is logged once an episode and counted in
        `failures`; nothing is lost: it stays logged). The log is emptied once nothing
        is pending."""
        return all(self.apply_some() for _ in range(-(-self.count // APPLY_BATCH)))

    def apply_some(self) -> bool:
        """One batch (see `apply`)."""
        with self._applying:
            with self._lock:
                batch = self.items[:APPLY_BATCH]
            if not batch:
                return True
            self._since_backfill += len(batch)
            backfill = self._since_backfill >= BACKFILL_COMMITS
            try:
                self._apply_batch(batch, backfill)
            except Exception as exc:
                self.failures += 1
                if self.failures == 1:  # (one line an episode: it is retried until it goes)
                    log.error(
                        "intents: %d small put(s) not applied yet (%s); trying again; "
                        "closes commit their own files meanwhile",
                        len(batch),
                        exc,
                        exc_info=not isinstance(exc, AlkfsError),
                    )
                return False
            if self.failures:
                log.info("intents: applied after %d failed attempt(s)", self.failures)
                self.failures = 0
            with self._lock:
                del self.items[: len(batch)]
                del self._acked[: len(batch)]
                self.count = len(self.items)
                self.applied += len(batch)
                for intent in batch:
                    self.bytes -= len(intent.data)
                self._index()
                if not self.items and self.log is not None:
                    self.log.reset()
            return True

    def _add(self, intent: Intent, ns: int) -> None:
        """(holding `_lock`) One pending intent into the index."""
        _index_into(self.objects, self.pins_ahead, intent, ns)

    def _index(self) -> None:
        """(holding `_lock`) The index of what is still pending, made anew and then
        swapped in whole (readers look without the lock)."""
        objects: dict[bytes, tuple[bytes, int]] = {}
        pins_ahead: dict[str, PinRecord] = {}
        for intent, ns in zip(self.items, self._acked, strict=True):
            _index_into(objects, pins_ahead, intent, ns)
        self.objects, self.pins_ahead = objects, pins_ahead

    def _stamps_of(self, batch: Sequence[Intent]) -> dict[str, int]:
        """The creation times the batch's pending pins showed, by pin name."""
        shown = self.pins_ahead
        return {
            r.name: r.created_ns
            for r in (shown.get(from_intent(i.name, 0)[0]) for i in batch if i.name is not None)
            if r is not None
        }

    def _apply_batch(self, batch: list[Intent], backfill: bool) -> None:
        """The batch's transaction; then, every BACKFILL_COMMITS intents, the database's
        log copied into its file (as the commits of small files made on the loop asked
        for it)."""
        store = self.pins.store
        stamps = self._stamps_of(batch)
        try:
            apply(self.pins, batch, stamps)
        except NoSpace:
            if store.reserve is None:
                raise
            store.reserve.hit()  # (what the store keeps for itself makes room: once more)
            apply(self.pins, batch, stamps)
        if backfill:
            self._since_backfill = 0
            store.backfill()

    def close(self) -> None:
        """Apply what is left, here; the log closes (left for the next open if that
        fails)."""
        with self._applying:
            log_, self.log = self.log, None
            if log_ is None:
                return
            try:
                if self.items:
                    apply(self.pins, self.items, self._stamps_of(self.items))
                log_.reset()
                with self._lock:
                    self.items.clear()
                    self._acked.clear()
                    self.count = 0
                    self._index()
            except Exception:
                log.exception("intents: left in %s for the next open", log_.path)
            finally:
                log_.close()
                if self.pins.store.ahead is self:
                    self.pins.store.ahead = None
                if self.pins.ahead is self:
                    self.pins.ahead = None

    def status(self) -> dict[str, int]:
        return {
            "pending": self.count,
            "applied": self.applied,
            "log_bytes": 0 if self.log is None else self.log.size,
        }


def _index_into(
    objects: dict[bytes, tuple[bytes, int]],
    pins_ahead: dict[str, PinRecord],
    intent: Intent,
    ns: int,
) -> None:
    """An intent acknowledged at `ns` into an index of what is pending."""
    objects[intent.key.raw] = (intent.data, ns)
    if intent.name is not None:
        r = _record(intent.name, intent.key, len(intent.data), ns)
        pins_ahead.setdefault(r.name, r)  # (the first of one name is the one applied)


def _record(name: str, key: Key, size: int, ns: int) -> PinRecord:
    """The pin an intent named `name` makes (an `intent_name`: a file written into /pins)."""
    path, attrs = from_intent(name, size)
    if attrs is None:
        return PinRecord(path, key, ns)
    return PinRecord(path, key, ns, attrs.mode, attrs.mtime_ns, attrs.size, attrs.uid, attrs.gid)
