"""The sweep: execute what earlier sweeps staged, then mark and stage what is dead now.

A sweep is never an error: every outcome, aborts included, is a SweepReport.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import json
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from itertools import filterfalse, islice, repeat
from typing import NotRequired, Protocol, TypedDict, cast

from ..db import Error as DatabaseError
from ..db import now_ns
from ..durations import MAX_WINDOW_S
from ..errors import AlkfsError, Interrupted, SourceFailed, log_failure
from ..keys import Key
from ..keyset import KeyUnion
from .arbiter import raw
from .needs import CollectedStore
from .window import TAKE_BATCH

STAGE_BATCH = 10_000
DELETE_TX = 512  # deletions a transaction (a put of one of them waits for its commit)
MAX_WINDOW_NS = int(MAX_WINDOW_S * 1e9)  # (a staged deadline is never later than this)
END_OF_TIME = (1 << 63) - 1  # (a take at this instant takes every staged candidate)
DRY_RUN_LIST = 10_000  # candidates a dry run lists (it counts them all)
DUE_PAGE = 10_000  # window rows read at a time to find the candidates due (nothing taken)
SCAN_CHUNK = 65_536  # keys taken from the mark scan at a time (set operations run in C)


class AbortCause(enum.StrEnum):
    SWEEPER_LOCK = "sweeper-lock"
    NO_LIVENESS_SOURCES = "no-liveness-sources"
    PROTECT_FAILED = "protect-failed"
    IO_ERROR = "io-error"  # the medium failed mid-sweep: what was done stays done, the rest waits
    INTERRUPTED = "interrupted"  # the store closed mid-sweep (SIGTERM, unmount): the same


def _now() -> str:
    """A report's time: now, UTC, to the millisecond."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class SweepFigures(TypedDict):
    """A sweep's report as JSON shows it (`SweepReport.to_dict`)."""

    aborted: str | None
    candidates_staged: int
    deleted: int
    cancelled_by_arbitration: int
    taken: int
    live: int
    scanned: int
    bytes_freed: int
    started_at: str
    duration_s: float
    detail: NotRequired[str | None]


class SweepProgressFigures(TypedDict):
    """How far a running sweep got (`Store.sweep_progress`, the status's `sweep_progress`)."""

    phase: str
    scanned: int
    staged: int
    taken: int
    deleted: int


@dataclass
class SweepReport:
    aborted: str | None = None
    candidates_staged: int = 0
    deleted: int = 0
    cancelled_by_arbitration: int = 0
    taken: int = 0  # candidates taken from the window: always deleted + cancelled_by_arbitration
    live: int = 0
    scanned: int = 0
    bytes_freed: int = 0
    started_at: str = field(default_factory=_now)
    duration_s: float = 0.0
    detail: str | None = None  # why it aborted, when a source said (an unreadable root)

    def to_dict(self) -> SweepFigures:
        out = cast(SweepFigures, asdict(self))  # (asdict is typed dict[str, Any])
        if out["detail"] is None:
            del out["detail"]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


# How far a running sweep got, told at its existing batch and chunk points (never a key
# at a time): the phase ("live": finding what is live; "executing": deleting the staged
# candidates due, `deleted`/`taken` so far; "marking": `scanned` so far; "staging":
# `candidates_staged` so far) and the report as it stands (read it, do not keep it).
SweepProgress = Callable[[str, SweepReport], None]


class SweepStore(CollectedStore, Protocol):
    """What a sweep needs of its store (alkfs/gc/needs.py) and where it keeps its report."""

    last_sweep: SweepReport | None


def _raw_keys(keys: Iterable[Key | bytes]) -> Iterable[bytes]:
    """The keys as raw bytes, lazily; a plain collection of bytes passes as it is."""
    if type(keys) in (set, frozenset, list, tuple) and set(map(type, keys)) <= {bytes}:
        return keys  # type: ignore[return-value]  # (raw() of bytes is the key itself)
    return map(raw, keys)


def _protected_set(store: CollectedStore) -> set[bytes]:
    out: set[bytes] = set()
    for callback in store.arbiter.protects():
        out.update(_raw_keys(callback()))
    return out


def sweep(
    store: SweepStore,
    window_ns: int | None = None,
    *,
    expire_now: bool = False,
    batch: int | None = None,
    progress: SweepProgress | None = None,
) -> SweepReport:
    """Run one sweep over `store` with the given window (default: the store's).
    `expire_now`: every staged candidate is taken whatever its deadline (each is still
    re-arbitrated at its delete). `batch`: candidates taken from the window at a time
    (default TAKE_BATCH). `progress`: told how far it got (SweepProgress), from this
    thread."""
    report = SweepReport()
    t0 = time.monotonic()
    arbiter = store.arbiter
    if not arbiter.try_begin_sweep():
        report.aborted = AbortCause.SWEEPER_LOCK.value
        return report
    try:
        with _lease(store) as leased:
            if leased:
                # (in a fleet, from when the lease is held: the lease's own connection
                # takes a moment to open, while another member's sweep may still end)
                report.started_at = _now()
                t0 = time.monotonic()
                window = store.window_ns if window_ns is None else window_ns
                _run(
                    store,
                    report,
                    max(0, min(window, MAX_WINDOW_NS)),
                    expire_now,
                    TAKE_BATCH if batch is None else max(1, batch),
                    progress,
                )
            else:
                report.aborted = AbortCause.SWEEPER_LOCK.value  # (another daemon's sweep)
    except Interrupted:
        store.log.info("sweep: stopped at a safe point, the store is closing")
        report.aborted = AbortCause.INTERRUPTED.value
    except (OSError, AlkfsError, *DatabaseError) as exc:  # type: ignore[misc]
        # A sweep is never an error: a failing medium ends it as report data. Every
        # delete already done was arbitrated; untaken rows stay staged for the next one.
        store.log.error("sweep: the store failed mid-sweep, stopped: %s", exc)
        report.aborted = AbortCause.IO_ERROR.value
    finally:
        arbiter.end_sweep()
        report.duration_s = round(time.monotonic() - t0, 6)
        store.last_sweep = report
    return report


def _lease(store: CollectedStore) -> contextlib.AbstractContextManager[bool]:
    """The fleet's sweep lease (alkfs/fleet.py); a store of one process has it."""
    if store.fleet is None:
        return contextlib.nullcontext(True)
    return store.fleet.sweep_lease()


def _delete(
    store: CollectedStore,
    report: SweepReport,
    part: list[tuple[bytes, int]],
    protected: set[bytes],
    epoch: int | None,
) -> None:
    """Delete what of `part` arbitration lets go, in one database transaction (one
    commit, not one a key); the deletion hooks run once it committed. In a fleet, a ref
    or pin change since `epoch` (when this sweep computed what is live) keeps them all."""
    arbiter = store.arbiter
    gone: list[tuple[bytes, int | None]] = []
    cancelled = 0
    fleet = store.fleet
    marked: list[bytes] = []
    try:
        with store.tx():
            keep = None
            if fleet is not None:
                if fleet.epoch() != epoch:
                    report.cancelled_by_arbitration += len(part)
                    return
                keep = fleet.pinned_elsewhere([key for key, _ in part]).__contains__
            for key, staged_ns in part:
                if not arbiter.arbitrate(key, protected):
                    cancelled += 1
                    continue
                marked.append(key)
                # Decided under the delete marker and the row's lock: a put that published
                # before is a write since staging; one after waits for the delete (for
                # the marker, then for the transaction) and stores afresh.
                freed = store.delete_staged(key, staged_ns, keep)
                if freed is False:
                    cancelled += 1
                    continue
                gone.append((key, freed))
            if fleet is not None:
                fleet.deleted([key for key, freed in gone if freed is not None])
    finally:
        # The markers go once the transaction has ended, never before its commit: a pin
        # minted meanwhile (a pin, a ref, a freshen) then looks at the object and finds
        # it gone. Released at the delete instead, its look went through another
        # connection, which still saw the uncommitted delete's row: it pinned an object
        # the commit then removed.
        arbiter.conclude_many(marked)
    report.cancelled_by_arbitration += cancelled
    for key, freed in gone:
        report.deleted += 1
        report.bytes_freed += freed or 0
        if freed is not None:
            store.on_deleted(key)


def _live(store: CollectedStore, report: SweepReport) -> KeyUnion | None:
    """Every key live now (sources and protects), or None with the report aborted. The
    sources' sets are kept as they are (the refs' closure as a compact `SortedKeys`
    where git computed it), not copied into one."""
    sources = store.arbiter.sources()
    if not sources:
        report.aborted = AbortCause.NO_LIVENESS_SOURCES.value
        return None
    try:
        protected = _protected_set(store)
        live = KeyUnion()
        for source in sources:
            keys = source.live_keys()
            live.add(keys if isinstance(keys, KeyUnion) else _raw_keys(keys))
    except Interrupted:
        raise
    except SourceFailed as exc:
        report.detail = str(exc)[:2000]
        store.log.error("sweep: protect-failed, nothing deleted: %.2000s", exc)
        report.aborted = AbortCause.PROTECT_FAILED.value
        return None
    except Exception:
        log_failure(store.log, "sweep: a liveness or protect source failed; nothing deleted")
        report.aborted = AbortCause.PROTECT_FAILED.value
        return None
    live.add(protected)
    try:
        # sources whose keys follow from what the others keep (LFS media: alkfs/git/lfs.py)
        for source in sources:
            live_from = getattr(source, "live_from", None)
            if live_from is not None:
                live.add(_raw_keys(live_from(live)))
    except Interrupted:
        raise
    except Exception:
        log_failure(store.log, "sweep: a liveness source failed; nothing deleted")
        report.aborted = AbortCause.PROTECT_FAILED.value
        return None
    return live


def _run(
    store: CollectedStore,
    report: SweepReport,
    window_ns: int,
    expire_now: bool = False,
    batch_size: int = TAKE_BATCH,
    progress: SweepProgress | None = None,
) -> None:
    epoch = None if store.fleet is None else store.fleet.epoch()  # (before what is live)
    if progress is not None:
        progress("live", report)
    live = _live(store, report)
    if live is None:
        return

    # Execute: overdue candidates (every staged one with `expire_now`), re-arbitrated
    # one by one at delete time. The delete guards (e.g. derived packs: no set published
    # after these deletes lists them, git/packs.py) are entered once, over every candidate
    # due now, and held until the last batch is done: a guard that must publish a set
    # without them publishes one for the whole sweep, not one a batch.
    cutoff = END_OF_TIME if expire_now else now_ns()
    if progress is not None:
        progress("executing", report)
    with contextlib.ExitStack() as guards:
        guarded: set[bytes] = set()
        kept: set[bytes] = set()
        if store.delete_guards:
            guarded = _due(store, cutoff)
            if guarded:
                kept = _enter_guards(store, guards, sorted(guarded))
        while True:
            store.check_stopping()  # (between batches: each batch is whole or not taken)
            batch = store.window.take(cutoff, batch_size)
            if not batch:
                break
            report.taken += len(batch)
            with contextlib.ExitStack() as late:
                # (one due after the guards were entered: guarded for its own batch)
                unguarded = [key for key, _ in batch if key not in guarded]
                kept_now = kept
                if unguarded and store.delete_guards:
                    kept_now = kept | _enter_guards(store, late, unguarded)
                try:
                    protected_now = _protected_set(store) | kept_now
                except Exception:
                    log_failure(store.log, "sweep: protect failed at delete time; batch cancelled")
                    report.cancelled_by_arbitration += len(batch)
                    continue
                for i in range(0, len(batch), DELETE_TX):
                    _delete(store, report, batch[i : i + DELETE_TX], protected_now, epoch)
                    if progress is not None:
                        progress("executing", report)

    # Mark and stage. It makes no reference cycles, so the cyclic collector is paused
    # meanwhile: the window's row tuples would otherwise trigger collections that walk
    # every key of `live` (and of the sources' own sets), up to a quarter of the sweep.
    collecting = gc.isenabled()
    gc.disable()
    try:
        _mark_and_stage(store, report, live, window_ns, progress)
    finally:
        if collecting:
            gc.enable()


def _due(store: CollectedStore, cutoff: int) -> set[bytes]:
    """The staged candidates due at `cutoff` (the keys alone, read page by page; nothing
    is taken): what this sweep's batches will take, unless a deadline moves meanwhile."""
    out: set[bytes] = set()
    after = b""
    while True:
        store.check_stopping()
        page = store.window.page(after, DUE_PAGE)
        if not page:
            return out
        out.update(key for key, visible_after in page if visible_after <= cutoff)
        after = page[-1][0]


def _enter_guards(
    store: CollectedStore, stack: contextlib.ExitStack, raws: list[bytes]
) -> set[bytes]:
    """Enter every delete guard of the store for `raws` on `stack`; the keys they say
    must be kept (e.g. a fleet member still serves them in an older set)."""
    kept: set[bytes] = set()
    for guard in store.delete_guards:
        more = stack.enter_context(guard(raws))
        if more:
            kept |= more
    return kept


def _mark_and_stage(
    store: CollectedStore,
    report: SweepReport,
    live: Container[bytes],
    window_ns: int,
    progress: SweepProgress | None = None,
) -> None:
    """Stage every stored object neither live nor already staged."""
    arbiter = store.arbiter
    window = store.window
    mark_started = now_ns()  # a write after this instant cancels the candidate at execution
    staged = window.staged_keys()
    dead: list[bytes] = []
    keys = store.iter_keys()
    if progress is not None:
        progress("marking", report)
    while chunk := list(islice(keys, SCAN_CHUNK)):
        store.check_stopping()
        report.scanned += len(chunk)
        not_live = list(filterfalse(live.__contains__, chunk))
        report.live += len(chunk) - len(not_live)
        dead += filterfalse(staged.__contains__, not_live)
        if progress is not None:
            progress("marking", report)
    pinned = arbiter.pinned_keys()  # taken after the scan: covers puts that raced it
    if pinned:
        kept = [k for k in dead if k in pinned]
        report.live += len(kept)
        dead = [k for k in dead if k not in pinned]
    visible = now_ns() + window_ns
    if progress is not None:
        progress("staging", report)
    for i in range(0, len(dead), STAGE_BATCH):
        store.check_stopping()
        report.candidates_staged += window.stage(
            zip(dead[i : i + STAGE_BATCH], repeat(visible)), mark_started
        )
        if progress is not None:
            progress("staging", report)


def dry_run(store: CollectedStore, limit: int = DRY_RUN_LIST) -> dict[str, object]:
    """What a sweep would stage now, changing nothing: the report's figures with
    `would_stage` (how many) and `candidates` (up to `limit`: key, size, why)."""
    report = SweepReport()
    t0 = time.monotonic()
    out: dict = {"dry_run": True, "would_stage": 0, "would_stage_bytes": 0, "candidates": []}
    if not store.arbiter.try_begin_sweep():
        report.aborted = AbortCause.SWEEPER_LOCK.value
        return {**report.to_dict(), **out}
    try:
        live = _live(store, report)
        if live is not None:
            staged = store.window.staged_keys()
            pinned = store.arbiter.pinned_keys()
            keys = store.iter_keys()
            while chunk := list(islice(keys, SCAN_CHUNK)):
                store.check_stopping()
                report.scanned += len(chunk)
                for raw_key in chunk:
                    if raw_key in live or raw_key in pinned:
                        report.live += 1
                    elif raw_key not in staged:
                        _would_stage(store, out, raw_key, limit)
    except Interrupted:
        report.aborted = AbortCause.INTERRUPTED.value
    except (OSError, AlkfsError, *DatabaseError) as exc:  # type: ignore[misc]
        store.log.error("sweep --dry-run: the store failed: %s", exc)
        report.aborted = AbortCause.IO_ERROR.value
    finally:
        store.arbiter.end_sweep()
        report.duration_s = round(time.monotonic() - t0, 6)
    out["more"] = out["would_stage"] - len(out["candidates"])
    return {**report.to_dict(), **out}


def _would_stage(store: CollectedStore, out: dict, raw_key: bytes, limit: int) -> None:
    key = Key(raw_key)
    st = store.stat(key)
    size = 0 if st is None else st.size
    out["would_stage"] += 1
    out["would_stage_bytes"] += size
    if len(out["candidates"]) < limit:
        why = "no ref, pin or registered root reaches it" if key.algo.is_git else "no pin names it"
        out["candidates"].append({"key": str(key), "size": size, "why": why})
