"""When the write-behind of small puts is applied: the trio driver of alkfs/writebehind.py.

A close hands a small file to the library's write-behind (`put`: logged, acknowledged);
the `run` worker applies what waits, many at a time on a worker thread, once closes
pause (the gather time; see `_settle`).

What is acknowledged and not applied yet is not in the database, but the library
answers for it (its pending index: Store.ahead, Pins.ahead), so requests do not wait for
it. Only views that read the database's own counts wait for the apply first (`drain`:
the status and metrics files, dry-run, verify). While a drain runs, new closes take the
direct path (their own put in a worker thread), so a drain always ends.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from alkfs.keys import Algorithm, Key
from alkfs.settings import settings
from alkfs.store import PutResult
from alkfs.writebehind import APPLY_BATCH, WriteBehind

if TYPE_CHECKING:
    from ..services import Services

log = logging.getLogger("alkfsd")

# The worker applies once closes pause for the gather time (ALKFS_INTENTS_GATHER_S, 50 ms
# by default: alkfs/settings.py; no intent logged meanwhile), or once the write-behind is
# due (alkfs/writebehind.py: APPLY_BYTES, APPLY_COUNT), or the oldest has waited
# HOLD_MAX_S: a burst of small files (cp -r of a tree) is applied after it, not against it
# on the daemon's other CPU and the GIL; a longer stream in steps.
HOLD_MAX_S = 5.0
RETRY_S = 0.2  # after a failed apply (doubling up to RETRY_MAX_S)
RETRY_MAX_S = 5.0
DRAIN_TRIES = 3  # failed applies after which a waiting request goes on without them


class Pending:
    """The daemon's side of the write-behind (see the module docstring); without one
    (`behind` None: not a live mount, read-only, not a sqlite store this process alone
    writes, ALKFS_INTENTS=off) every close commits its own file."""

    def __init__(self, ctx: Services, enabled: bool) -> None:
        self.ctx = ctx
        self.gather_s = settings().intents_gather_s  # (tests hold intents pending with it)
        self.behind: WriteBehind | None = None
        if enabled and not ctx.read_only:
            self.behind = ctx.app.start_behind()
        self._wake = trio.Event()

    @property
    def count(self) -> int:
        """Intents pending."""
        behind = self.behind
        return 0 if behind is None else behind.count

    # -- the close (the trio thread) ---------------------------------------------------
    def put(
        self, name: str | None, algo: Algorithm, data: bytes, expect: Key | None
    ) -> PutResult | None:
        """WriteBehind.put (None: take the direct path); the worker is woken."""
        behind = self.behind
        if behind is None:
            return None
        result = behind.put(name, algo, data, expect)
        if result is not None:
            self._wake.set()
        return result

    # -- applying ------------------------------------------------------------------------
    async def run(self) -> None:
        """The worker (workers.py): apply what arrives once closes pause (`_settle`)."""
        if self.behind is None:
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
        """Until closes pause for `gather_s`, or enough waits (see HOLD_MAX_S)."""
        behind = self.behind
        assert behind is not None
        start = trio.current_time()
        while True:
            seen = behind.logged()
            await trio.sleep(self.gather_s)
            if behind.logged() == seen or behind.due() or trio.current_time() - start >= HOLD_MAX_S:
                return

    async def _apply(self) -> bool:
        """Apply what is pending now (a batch a thread hop); whether all of it went."""
        behind = self.behind
        assert behind is not None
        for _ in range(-(-behind.count // APPLY_BATCH)):
            with trio.CancelScope(shield=True):  # (the thread runs on regardless)
                if not await self.ctx.run_sync(behind.apply_some):
                    return False
        return True

    async def drain(self) -> None:
        """Until everything acknowledged so far is applied and the log emptied (new
        closes meanwhile take the direct path). Once applying failed DRAIN_TRIES times
        in a row (the worker's tries count), requests go on without waiting until it
        works again (the daemon stays up; nothing acknowledged is lost: it stays in the
        log)."""
        behind = self.behind
        if behind is None or not behind.count or behind.failures >= DRAIN_TRIES:
            return  # (nothing pending; or applying fails: the worker goes on trying alone)
        behind.held += 1
        try:
            while behind.count and behind.failures < DRAIN_TRIES:  # (the worker's tries)
                if not await self._apply():
                    await trio.sleep(RETRY_S)
            if not behind.count:
                return
            # they stay logged: applied when it works again, or when the store next opens
            log.warning(
                "intents: requests go on without %d acknowledged small put(s) applied",
                behind.count,
            )
        finally:
            behind.held -= 1

    def close(self) -> None:
        """At the mount's end (no trio loop): the library applies what is left."""
        behind, self.behind = self.behind, None
        if behind is not None:
            behind.close()

    def status(self) -> dict[str, int]:
        behind = self.behind
        if behind is None:
            return {"pending": 0, "applied": 0, "log_bytes": 0}
        return behind.status()
