"""Small files acknowledged once their intent is logged, committed shortly after.

A small file's close (`cp`'s, one file at a time) used to wait for its own sqlite
transaction on the trio thread: the object's row, its pin's row, the commit, about two
thirds of what the daemon spent on the file. Now the close writes the intent into the
store's intents log (alkfs/intents.py: one write into the page cache, as durable as
sqlite's commits, which are not fsynced either) and is answered; the `run` worker
applies the intents many at a time in one transaction on a worker thread.

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
import os
from typing import TYPE_CHECKING

import trio

from alkfs import intents
from alkfs.db.sqlite import BACKFILL_COMMITS
from alkfs.intents import Intent, IntentLog
from alkfs.keys import Algorithm, Key
from alkfs.store import NOWAIT_PUT_MAX, PutResult

if TYPE_CHECKING:
    from ..context import Context

log = logging.getLogger("alkfsd")

GATHER_S = 0.01  # after the first intent, how long the worker lets more arrive (default)
PENDING_MAX = 16 << 20  # bytes of content waiting: beyond, closes take the direct path
LOG_MAX = 256 << 20  # the log's size beyond which closes take the direct path until drained
RETRY_S = 0.2  # after a failed apply
AHEAD_ALGOS = frozenset({Algorithm.SHA256, Algorithm.BLAKE3})


class Pending:
    """The intents acknowledged and not applied yet (see the module docstring)."""

    def __init__(self, ctx: Context, enabled: bool) -> None:
        self.ctx = ctx
        store = ctx.store
        self.log: IntentLog | None = None
        # ALKFS_INTENTS=off: every close commits its own transaction (as before the log);
        # ALKFS_INTENTS_GATHER_S: the worker's wait (tests hold intents pending with it)
        if os.environ.get("ALKFS_INTENTS", "").lower() in ("0", "off", "no"):
            enabled = False
        self.gather_s = _env_float("ALKFS_INTENTS_GATHER_S", GATHER_S)
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

    def pending_name(self, name: bytes) -> bool:
        return name in self.names

    def pending_hex(self, name: bytes) -> bool:
        return name in self.hexes

    # -- applying ------------------------------------------------------------------------
    async def run(self) -> None:
        """The worker (workers.py): apply what arrives, a little while after it arrives."""
        if self.log is None:
            return
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            await trio.sleep(self.gather_s)
            while not await self._apply():
                await trio.sleep(RETRY_S)

    async def _apply(self) -> bool:
        """Apply what is pending now (in one worker-thread transaction); whether it went.
        The log is emptied once nothing is pending."""
        async with self._lock:
            batch = self.items[: self.count]
            if not batch:
                return True
            self._since_backfill += len(batch)
            backfill = self._since_backfill >= BACKFILL_COMMITS
            try:
                with trio.CancelScope(shield=True):  # (the thread runs on regardless)
                    await self.ctx.run_sync(self._apply_batch, batch, backfill)
            except Exception:
                log.exception("intents: %d small put(s) not applied yet; trying again", len(batch))
                return False
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
        intents.apply(self.ctx.pins, batch)
        if backfill:
            self._since_backfill = 0
            self.ctx.store.backfill()

    async def drain(self) -> None:
        """Until everything acknowledged so far is applied and the log emptied (new
        closes meanwhile take the direct path)."""
        if not self.count:
            return
        self.draining += 1
        try:
            while self.count:
                if not await self._apply():
                    await trio.sleep(RETRY_S)
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


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default
