"""The mount's context: its services (services.py) and its write state. What git's writes
leave in memory and the scratch area (`writes`), the small files acknowledged ahead of
their commit (`pending`), the derived packs being built (`packs`), and the sweeps,
dry runs and verifications that change or read what they hold.

The context sits at the top of the write-state layer (it owns `Writes`); the views above
write through it, and what sits below is typed against the services alone."""

from __future__ import annotations

import functools
import logging

from alkfs.gc.sweep import dry_run
from alkfs.keys import Key

from .packs import PackFigures, Served
from .services import Options, Services
from .staging.pending import Pending
from .staging.writes import Writes

__all__ = ["INVALIDATE_WAIT_S", "Context", "Options", "PackFigures"]

log = logging.getLogger("alkfsd")

INVALIDATE_WAIT_S = 10.0  # how long a sweep request waits for the kernel to drop entries


class Context(Services):
    """The services of one mount and its write state. Owned by the trio thread, except
    where noted."""

    next_sweep_ts: float | None = None  # (the periodic sweeper sets it)
    last_dry_run: dict[str, object] | None = None  # (/.alkfs/dry-run)

    @functools.cached_property
    def writes(self) -> Writes:
        """What git's writes leave in memory, and the scratch area (emptied when made:
        `main` makes it before the first request)."""
        return Writes(self)

    @functools.cached_property
    def pending(self) -> Pending:
        """Small files acknowledged ahead of their commit (staging/pending.py; only for a
        live mount: direct calls commit each file as before)."""
        return Pending(self, enabled=self.live)

    @functools.cached_property
    def packs(self) -> Served:
        """The derived packs this mount serves (made at first use, on the trio thread: the
        git view's first listing or the intake worker)."""
        return Served(self)

    def packs_status(self) -> dict[str, PackFigures]:
        """The derived packs' part of the status ({} until they are made)."""
        served: Served | None = self.__dict__.get("packs")
        return served.status() if served is not None else {}

    def prepare(self) -> None:
        """At mount start, before any request: the write state is made (and the scratch
        area emptied)."""
        _ = self.writes

    async def sweep(
        self, window_s: float | None = None, *, scheduled: bool = False, expire_now: bool = False
    ):
        """Run one sweep in a worker thread; return once the kernel has been told what went.
        A scheduled sweep that finds another daemon of the fleet sweeping is skipped
        quietly (no log line; `status.last_sweep` keeps the last one that ran)."""
        before = self.store.last_sweep
        report = await self.run_sync(
            functools.partial(self.store.sweep, window_s, expire_now=expire_now)
        )
        if scheduled and report.aborted == "sweeper-lock":
            self.store.last_sweep = before
            log.debug("scheduled sweep skipped: another daemon of the fleet is sweeping")
            return report
        log.info("sweep %s", report.to_json())
        seq = self.invalidator.submitted
        if not await self.invalidator.wait(seq, INVALIDATE_WAIT_S):  # (holds no thread)
            log.warning("sweep: the kernel did not take every invalidation in time")
        return report

    async def dry_run(self) -> dict[str, object]:
        """What a sweep would stage now (nothing changes); kept for /.alkfs/dry-run."""
        await self.pending.drain()  # (its mark reads the pins' rows: the pending ones too)
        result = await self.run_sync(dry_run, self.store)
        self.last_dry_run = result
        log.info(
            "sweep --dry-run: %d object(s), %d bytes would be staged",
            result["would_stage"],
            result["would_stage_bytes"],
        )
        return result

    async def verify(self) -> list[Key]:
        await self.pending.drain()  # (it re-hashes the database's objects: the pending too)
        bad = await self.run_sync(self.store.verify)
        log.info("verify: %d corrupt object(s)%s", len(bad), "".join(f" {k}" for k in bad))
        return bad

    def close(self) -> None:
        """At the mount's end: pins of push sessions released, scratch bytes removed."""
        pending: Pending | None = self.__dict__.get("pending")
        if pending is not None:
            pending.close()
        writes = self.__dict__.pop("writes", None)
        if writes is not None:
            writes.close()
        super().close()
