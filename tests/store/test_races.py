"""Writers racing a window-0 sweeper: nothing held is ever missing; every report adds up."""

from __future__ import annotations

import random
import threading
from collections import Counter

import trio
import trio.lowlevel

from alkfs.errors import Missing
from alkfs.gc.sweep import SweepReport
from alkfs.keys import Key
from alkfs.pins import Pins

from .conftest import Column, chunked, patterned, sha256_key

WRITERS = 8
ROUNDS = 60


class CountingSource:
    """A liveness source many holders share: a key is live while any holder holds it."""

    def __init__(self) -> None:
        self._counts: Counter[bytes] = Counter()
        self._lock = threading.Lock()

    def hold(self, key: Key) -> None:
        with self._lock:
            self._counts[key.raw] += 1

    def drop(self, key: Key) -> None:
        with self._lock:
            self._counts[key.raw] -= 1
            if not self._counts[key.raw]:
                del self._counts[key.raw]

    def live_keys(self) -> list[bytes]:
        with self._lock:
            return list(self._counts)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._counts


def assert_report_adds_up(report: SweepReport) -> None:
    if report.aborted is not None:
        assert report.aborted == "sweeper-lock"
        taken = (report.taken, report.candidates_staged, report.deleted)
        assert taken + (report.cancelled_by_arbitration,) == (0, 0, 0, 0)
        return
    assert report.deleted + report.cancelled_by_arbitration == report.taken
    assert report.live + report.candidates_staged <= report.scanned


async def test_eight_writers_racing_window_zero_sweeps_never_lose_a_held_object(
    column: Column,
) -> None:
    store = column.store
    source = CountingSource()
    store.register_source(source)
    t = column.threshold
    pool = [patterned(t - 100 + 13 * i, 97 + i) for i in range(6)]
    pool += [patterned(column.big(17 * i), 113 + i) for i in range(6)]
    reports: list[SweepReport] = []
    checks = Counter()

    async def sweeper(done: trio.Event) -> None:
        while not done.is_set():
            reports.append(await trio.to_thread.run_sync(store.sweep, 0))
            await trio.lowlevel.checkpoint()

    async def writer(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(ROUNDS):
            data = rng.choice(pool)
            shape = data if rng.random() < 0.5 else chunked(data, 257)
            result = await trio.to_thread.run_sync(store.put, shape)
            assert result.key == sha256_key(data)
            checks["created" if result.created else "deduplicated"] += 1
            assert await trio.to_thread.run_sync(store.get, result.key) == data, "pinned"
            if rng.random() < 0.5:
                source.hold(result.key)
                result.pin.release()
                await trio.lowlevel.checkpoint()
                got = await trio.to_thread.run_sync(store.get, result.key)
                assert got == data, "held by the liveness source"
                source.drop(result.key)
            else:
                await trio.lowlevel.checkpoint()
                got = await trio.to_thread.run_sync(store.read_range, result.key, 0, len(data))
                assert got is not None and got[0] == data, "still pinned"
                result.pin.release()
            checks["held reads"] += 2

    # The race must be real: objects deleted under the writers and stored afresh. Whether
    # a round gets there is timing (a busy machine may sweep nothing a writer re-puts), so
    # a round that did not is run again, up to three; every round's checks count.
    rounds = 0
    while True:
        rounds += 1
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sweeper, done)
            nursery.start_soon(sweeper, done)  # contended: sweeper-lock aborts are data
            async with trio.open_nursery() as writers:
                for seed in range(WRITERS):
                    writers.start_soon(writer, seed + 100 * rounds)
            done.set()
        deleted = sum(r.deleted for r in reports if r.aborted is None)
        if (deleted > 0 and checks["created"] > len(pool)) or rounds == 3:
            break

    assert checks["held reads"] == 2 * WRITERS * ROUNDS * rounds
    for report in reports:
        assert_report_adds_up(report)
    ran = [r for r in reports if r.aborted is None]
    # Every staged candidate was taken by a later sweep or still waits in the window.
    staged = sum(r.candidates_staged for r in ran)
    assert staged == sum(r.taken for r in ran) + column.window_rows()
    # The race was real: objects were deleted under the writers and stored afresh.
    assert sum(r.deleted for r in ran) > 0, reports
    assert checks["created"] > len(pool), checks

    # Quiescent: nothing pinned, nothing live. Two sweeps empty the store exactly.
    assert store.arbiter.pinned_keys() == set()
    assert source.live_keys() == []
    first = store.sweep()
    assert_report_adds_up(first)
    present = len(store.list(limit=10_000))
    second = store.sweep()
    assert (second.taken, second.deleted, second.cancelled_by_arbitration) == (present, present, 0)
    assert second.candidates_staged == 0
    assert store.list() == []
    assert column.media() == (0, 0)
    assert column.window_rows() == 0


def put_into(store, content: bytes, results: list) -> None:
    results.append(store.put(content))


def test_a_put_meeting_an_in_flight_delete_waits_for_it_and_stores_afresh(column: Column) -> None:
    store = column.store
    for content in (patterned(column.threshold - 1, 83), patterned(column.big(5), 79)):
        key = store.add(content)
        assert store.arbiter.arbitrate(key) is True  # the delete marker is held
        results: list = []
        putter = threading.Thread(target=put_into, args=(store, content, results))
        putter.start()
        putter.join(0.2)
        assert putter.is_alive(), "the pin mint waits for the in-flight delete"
        assert results == []
        assert store.engine_delete(key.raw) == len(content)
        assert not store.has(key)
        store.arbiter.conclude(key)
        putter.join()
        (result,) = results
        assert (result.key, result.created) == (key, True), "stored afresh after the delete"
        assert store.get(key) == content
        # The fresh put's pin now cancels any delete.
        assert store.arbiter.arbitrate(key) is False
        result.pin.release()


def test_a_delete_arbitrated_while_a_pin_is_held_is_cancelled(column: Column) -> None:
    store = column.store
    source = CountingSource()
    store.register_source(source)
    result = store.put(b"pinned before the arbitration")
    assert store.arbiter.arbitrate(result.key) is False
    source.hold(result.key)
    result.pin.release()
    assert store.arbiter.arbitrate(result.key) is False, "re-observed live"
    source.drop(result.key)
    assert store.arbiter.arbitrate(result.key, protected={result.key.raw}) is False
    assert store.arbiter.arbitrate(result.key) is True
    store.arbiter.conclude(result.key)
    assert store.has(result.key), "arbitration alone deletes nothing"


def test_reads_racing_re_puts_of_the_same_large_object_never_report_it_corrupt(
    dual: Column,
) -> None:
    """A re-put or touch changes a large file's times, never its bytes: reads racing it
    must serve the bytes, not call the object corrupt."""
    store = dual.store
    content = patterned(8 * dual.threshold + 5, 71)
    key = store.add(content)
    stop = threading.Event()

    def freshen_forever() -> None:
        while not stop.is_set():
            store.freshen(key)
            store.add(content)

    toucher = threading.Thread(target=freshen_forever)
    toucher.start()
    try:
        for i in range(300):
            offset = (i * 97) % len(content)
            piece, _ = store.read_range(key, offset, 64)
            assert piece == content[offset : offset + 64]
            if i % 10 == 0:
                assert store.get(key) == content
    finally:
        stop.set()
        toucher.join()
    assert store.corrupt == set()


def test_a_pin_minted_while_a_sweep_deletes_waits_for_the_commit_and_finds_it_gone(
    sqlite_column: Column,
) -> None:
    """The sweep deletes a part of its candidates in one transaction. A pin of one
    already deleted in it, made before the commit, must find the object gone (Missing),
    not see the uncommitted delete's row through another connection and pin an object
    the commit removes (found by test_write_pins' racing sweep loop)."""
    store = sqlite_column.store
    pins = Pins(store)
    store.register_source(pins)
    ka, kb = store.add(b"deleted first\n"), store.add(b"deleted second\n")
    assert store.sweep(0).candidates_staged == 2  # unpinned: the next sweep deletes both
    first, second = sorted((ka, kb), key=lambda k: k.raw)  # (a part goes in key order)
    blocked, go = threading.Event(), threading.Event()

    def hold(raw: bytes) -> None:  # `first` is deleted, the transaction still open
        if raw == second.raw:
            blocked.set()
            assert go.wait(30)

    store.kv._between_lock_and_delete = hold  # type: ignore[method-assign]  # (the seam)
    reports: list[SweepReport] = []
    sweeper = threading.Thread(target=lambda: reports.append(store.sweep(0)))
    sweeper.start()
    assert blocked.wait(30)
    outcome: list[object] = []

    def pin_first() -> None:
        try:
            outcome.append(pins.pin("late", first))
        except Missing as exc:
            outcome.append(exc)

    pinner = threading.Thread(target=pin_first)
    pinner.start()
    pinner.join(0.3)
    go.set()
    sweeper.join(30)
    pinner.join(30)
    assert not sweeper.is_alive() and not pinner.is_alive()
    assert reports[0].deleted == 2
    assert [type(o) for o in outcome] == [Missing]
    assert pins.get("late") is None
    assert not store.has(first) and not store.has(second)
