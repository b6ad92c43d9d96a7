"""The mount's background work, in one place.

Every long-lived worker of a mount (the invalidator, the pin expiry, the derived packs'
intake, the write-behind's applies, the periodic sweep, the refusal counts, the signal handler) is a trio task that
`Workers.run` starts, under the daemon's nursery, when the mount starts, and that stops
there: `main.serve` lists them and cancels them all when the session ends. Short-lived
tasks of the mount (the spool worker of one file being written, staging/spool.py) start
under the same nursery with `start_soon`, so they end with the mount too. There is no
other place for them: `start_soon` while `run` does not run is a RuntimeError (whoever
drives a context without a mount runs `Workers.run` in a nursery of its own first).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVarTuple

import trio

from alkfs.errors import log_failure

log = logging.getLogger("alkfsd")

Ts = TypeVarTuple("Ts")


@dataclass(frozen=True, slots=True)
class Worker:
    """One long-lived task: `fn()` (a function with its arguments bound), named `name`
    (trio's task name, in tracebacks)."""

    name: str
    fn: Callable[[], Awaitable[object]]


class Workers:
    """The mount's tasks: the long-lived ones listed with `add` before `run`, and the
    short-lived ones `start_soon` brings later."""

    def __init__(self) -> None:
        self.workers: list[Worker] = []
        self._nursery: trio.Nursery | None = None

    def add(self, name: str, fn: Callable[[*Ts], Awaitable[object]], *args: *Ts) -> None:
        self.workers.append(Worker(name, functools.partial(fn, *args)))

    @property
    def names(self) -> list[str]:
        return [w.name for w in self.workers]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every worker under a nursery of our own (itself a task of the daemon's
        nursery: `nursery.start(workers.run)`); report started once they are; run until
        cancelled. Each worker catches its own routine failures; one that raises anyway
        ends the mount, as any bug outside a request does (a worker gone quietly, the
        signal handler say, would be worse)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                for w in self.workers:
                    nursery.start_soon(w.fn, name=w.name)
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None

    @staticmethod
    async def _guarded(w: Worker) -> None:
        try:
            await w.fn()
        except Exception:
            log_failure(log, "%s failed", w.name)

    def start_soon(self, fn: Callable[[*Ts], Awaitable[object]], *args: *Ts, name: str) -> None:
        """Start a short-lived task of the mount (an error it raises is logged: it never
        takes the mount's other tasks down). RuntimeError if `run` is not running: the
        task would have no nursery to end with."""
        nursery = self._nursery
        if nursery is None:
            raise RuntimeError(
                f"{name}: Workers.start_soon needs the mount's nursery (Workers.run is not running)"
            )
        nursery.start_soon(self._guarded, Worker(name, functools.partial(fn, *args)), name=name)
