"""Small files acknowledged once their intent is logged, committed shortly after.

A small file's close (`cp`'s, one file at a time) used to wait for its own sqlite
transaction on the trio thread: the object's row, its pin's row, the commit, about two
thirds of what the daemon spent on the file. Now the close writes the intent into the
store's intents log (alkfs/intents.py: one write into the page cache, as durable as
sqlite's commits, which are not fsynced either) and is answered; the `run` worker
applies the intents many at a time on a worker thread, once closes pause (see
APPLY_BYTES).

What is acknowledged and not applied yet is not in the database. Every request that
could see the difference waits for the apply first (`drain`): Operations lets through
only the requests of the files being written and the lookups and creates of names that
are not pending (`Node.passes_intents`, fs.py); sweeps drain too. While a drain runs,
new closes take the direct path (their own transaction), so a drain always ends. A name
pending here counts as taken (`pending_name`), so no other pin takes it meanwhile.

Only a store this process alone writes (not a fleet's member), on sqlite, with room on
its disk (no reserve armed), for content of the kv tier under a non-git algorithm.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from alkfs import intents
from alkfs.db.sqlite import BACKFILL_COMMITS
from alkfs.errors import AlkfsError, NoSpace
from alkfs.intents import Intent, IntentLog
from alkfs.keys import Algorithm, Key
from alkfs.settings import settings
from alkfs.store import NOWAIT_PUT_MAX, PutResult

if TYPE_CHECKING:
    from ..context import Context

log = logging.getLogger("alkfsd")

# The worker applies once closes pause for the gather time (ALKFS_INTENTS_GATHER_S, 50 ms
# by default: alkfs/settings.py; no intent logged meanwhile), or once
# APPLY_BYTES of content or APPLY_COUNT intents wait, or the oldest has waited HOLD_MAX_S:
# a burst of small files (cp -r of a tree) is applied after it, not against it on the
# daemon's other CPU and the GIL; a longer stream in steps of APPLY_BYTES.
APPLY_BYTES = 32 << 20
APPLY_COUNT = 20_000
HOLD_MAX_S = 5.0
APPLY_BATCH = 4096  # intents a transaction applies (each holds sqlite's write lock)
PENDING_MAX = 64 << 20  # bytes of content waiting: beyond, closes take the direct path
LOG_MAX = 256 << 20  # the log's size beyond which closes take the direct path until drained
RETRY_S = 0.2  # after a failed apply (doubling up to RETRY_MAX_S)
RETRY_MAX_S = 5.0
DRAIN_TRIES = 3  # failed applies after which a waiting request goes on without them
AHEAD_ALGOS = frozenset({Algorithm.SHA256, Algorithm.BLAKE3})


class Pending:
    """The intents acknowledged and not applied yet (see the module docstring)."""

    def __init__(self, ctx: Context, enabled: bool) -> None:
        self.ctx = ctx
        store = ctx.store
        self.log: IntentLog | None = None
        # ALKFS_INTENTS=off: every close commits its own transaction (as before the log);
        # ALKFS_INTENTS_GATHER_S: the worker's wait (tests hold intents pending with it)
        knobs = settings()
        if not knobs.intents:
            enabled = False
        self.gather_s = knobs.intents_gather_s
        if enabled and store.path is not None and store.sole_writer and not ctx.read_only:
            if store.db is not None and store.db.engine == "sqlite" and store.mode != "mem":
                self.log = IntentLog(store.path)
        self.limit = min(store.threshold, NOWAIT_PUT_MAX)
        self.items: list[Intent] = []
        self.count = 0  # len(items): read by every request's gate (errors.fuse_op)
        self.names: set[bytes] = set()  # pin names pending (as the kernel names them)
        self.hexes: set[bytes] = set()  # the pending objects' hex digests (/objects names)
        self.bytes = 0
        self.draining = 0
        self.applied = 0  # intents applied (status)
        self._since_backfill = 0
        self.failures = 0  # failed applies in a row
        self._wake = trio.Event()
        self._lock = trio.Lock()  # one apply at a time

    # -- the close (the trio thread) ---------------------------------------------------
    def put(
        self, name: str | None, algo: Algorithm, data: bytes, expect: Key | None
    ) -> PutResult | None:
        """Log the intent of storing `data` (pinned as `name`) and return its result (no
        pin held: a named one is pinned under its name), or None: take the direct path
        (not here, too large, the disk filling up, the content not `expect`, a corrupt
        copy to replace, a drain under way, a log that failed: nothing was logged)."""
        log_ = self.log
        if (
            log_ is None
            or self.draining
            or self.failures
            or len(data) > self.limit
            or algo not in AHEAD_ALGOS
            or self.bytes + len(data) > PENDING_MAX
            or log_.size > LOG_MAX
        ):
            return None
        store = self.ctx.store
        reserve = store.reserve
        if reserve is not None and not (reserve.settled() and not reserve.have):
            return None
        key = Key.digest_of(algo, data)
        if (expect is not None and key != expect) or key.raw in store.corrupt:
            return None
        intent = Intent(name, key, data)
        try:
            log_.append(intent)
        except OSError as exc:
            log.debug("intents log: %s; the direct path", exc)
            return None
        self.items.append(intent)
        self.count += 1
        self.bytes += len(data)
        if name is not None:
            self.names.add(name.encode())
        self.hexes.add(key.raw[1:].hex().encode())
        self._wake.set()
        return PutResult(key, store.arbiter.released(key.raw), True)

    def logged(self) -> int:
        """Intents logged since the start (applied ones and pending ones)."""
        return self.applied + self.count

    def pending_name(self, name: bytes) -> bool:
        return name in self.names

    def pending_hex(self, name: bytes) -> bool:
        return name in self.hexes

    # -- applying ------------------------------------------------------------------------
    async def run(self) -> None:
        """The worker (workers.py): apply what arrives once closes pause (`_settle`)."""
        if self.log is None:
            return
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            await self._settle()
            wait = RETRY_S
            while not await self._apply():
                await trio.sleep(wait)
                wait = min(2 * wait, RETRY_MAX_S)

    async def _settle(self) -> None:
        """Until closes pause for `gather_s`, or enough waits (see APPLY_BYTES)."""
        start = trio.current_time()
        while True:
            seen = self.logged()
            await trio.sleep(self.gather_s)
            if (
                self.logged() == seen
                or self.bytes >= APPLY_BYTES
                or self.count >= APPLY_COUNT
                or trio.current_time() - start >= HOLD_MAX_S
            ):
                return

    async def _apply(self) -> bool:
        """Apply what is pending now (APPLY_BATCH at a time, each in a worker-thread
        transaction); whether all of it went. The log is emptied once nothing is pending."""
        for _ in range(-(-self.count // APPLY_BATCH)):
            if not await self._apply_some():
                return False
        return True

    async def _apply_some(self) -> bool:
        async with self._lock:
            batch = self.items[: min(self.count, APPLY_BATCH)]
            if not batch:
                return True
            self._since_backfill += len(batch)
            backfill = self._since_backfill >= BACKFILL_COMMITS
            try:
                with trio.CancelScope(shield=True):  # (the thread runs on regardless)
                    await self.ctx.run_sync(self._apply_batch, batch, backfill)
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
            del self.items[: len(batch)]
            self.count = len(self.items)
            self.applied += len(batch)
            for intent in batch:
                self.bytes -= len(intent.data)
            self.names = {i.name.encode() for i in self.items if i.name is not None}
            self.hexes = {i.key.hex.encode() for i in self.items}
            if not self.items and self.log is not None:
                self.log.reset()
            return True

    def _apply_batch(self, batch: list[Intent], backfill: bool) -> None:
        """(a worker thread) The batch's transaction; then, every BACKFILL_COMMITS
        intents, the database's log copied into its file (as the commits of small files
        made on the loop asked for it, main._backfill)."""
        store = self.ctx.store
        try:
            intents.apply(self.ctx.pins, batch)
        except NoSpace:
            if store.reserve is None:
                raise
            store.reserve.hit()  # (what the store keeps for itself makes room: once more)
            intents.apply(self.ctx.pins, batch)
        if backfill:
            self._since_backfill = 0
            self.ctx.store.backfill()

    async def drain(self) -> None:
        """Until everything acknowledged so far is applied and the log emptied (new
        closes meanwhile take the direct path). Once applying failed DRAIN_TRIES times
        in a row (the worker's tries count), requests go on without waiting until it
        works again (the daemon stays up; nothing acknowledged is lost: it stays in the
        log)."""
        if not self.count or self.failures >= DRAIN_TRIES:
            return  # (nothing pending; or applying fails: the worker goes on trying alone)
        self.draining += 1
        try:
            while self.count and self.failures < DRAIN_TRIES:  # (the worker's tries count)
                if not await self._apply():
                    await trio.sleep(RETRY_S)
            if not self.count:
                return
            # they stay logged: applied when it works again, or when the store next opens
            log.warning(
                "intents: requests go on without %d acknowledged small put(s) applied",
                self.count,
            )
        finally:
            self.draining -= 1

    def close(self) -> None:
        """At the mount's end (no trio loop): apply what is left, here; the log closes."""
        log_, self.log = self.log, None
        if log_ is None:
            return
        try:
            if self.items:
                intents.apply(self.ctx.pins, self.items)
            log_.reset()
            self.items.clear()
            self.count = 0
        except Exception:
            log.exception("intents: left in %s for the next open", log_.path)
        finally:
            log_.close()

    def status(self) -> dict[str, int]:
        return {
            "pending": self.count,
            "applied": self.applied,
            "log_bytes": 0 if self.log is None else self.log.size,
        }
