"""The daemon's background work (daemon/workers.py, staging/spool.py), called directly on a
real store: every worker starts under `Workers.run` and stops with it; a writer's spooler
runs as a trio task; no wait of a writer holds a worker thread, so a mount with one
request thread still streams, takes back and commits large files."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import trio
import trio.lowlevel
import trio.testing
from helpers import RecordingInvalidator

from alkfs.app import Alkfs
from alkfs.errors import StoreIO
from alkfs.keys import Algorithm
from alkfsd import context as context_mod
from alkfsd.context import Context, Options
from alkfsd.staging.spool import QUEUE_MAX, Spooler, Sync, TakeBack, Write
from alkfsd.staging.writer import MEM_MAX, StagedWriter
from alkfsd.workers import Workers


@pytest.fixture
def app(tmp_path: Path):
    a = Alkfs.open(tmp_path / "store", window_s=0)
    yield a
    a.close()


@pytest.fixture
async def ctx(app: Alkfs):
    """A mount's context with one request thread, its workers running as a mount runs them
    (`Workers.run` in a nursery: a writer's spooler starts under it); they stop before the
    context is closed."""
    c = Context(app.store, app=app, options=Options(threads=1), kernel=RecordingInvalidator())
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(c.workers.run)
            yield c
            nursery.cancel_scope.cancel()
    finally:
        c.close()


async def commits_as(app: Alkfs, w: StagedWriter, want: bytes | bytearray) -> None:
    """The writer's commit stores exactly `want`, under its sha256."""
    result = await w.commit()
    try:
        assert result.key.raw[1:] == hashlib.sha256(want).digest()
        assert app.store.get(result.key) == bytes(want)
    finally:
        result.pin.release()


async def test_every_worker_starts_under_run_and_stops_with_it() -> None:
    workers = Workers()
    started: list[str] = []
    stopped: list[str] = []

    async def worker(name: str) -> None:
        started.append(name)
        try:
            await trio.sleep_forever()
        finally:
            stopped.append(name)

    for name in ("a", "b", "c"):
        workers.add(f"alkfsd {name}", worker, name)
    async with trio.open_nursery() as nursery:
        await nursery.start(workers.run)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(started) == ["a", "b", "c"] and stopped == []
        nursery.cancel_scope.cancel()
    assert sorted(stopped) == ["a", "b", "c"]


async def test_short_lived_tasks_run_under_the_mounts_nursery_and_a_failing_one_is_logged(
    caplog,
) -> None:
    workers = Workers()
    done = trio.Event()
    alive = trio.Event()

    async def long() -> None:
        alive.set()
        await trio.sleep_forever()

    async def task() -> None:
        done.set()

    async def broken() -> None:
        raise RuntimeError("a spooler's bug")

    workers.add("alkfsd long", long)
    async with trio.open_nursery() as nursery:
        await nursery.start(workers.run)
        workers.start_soon(broken, name="alkfsd broken")
        workers.start_soon(task, name="alkfsd short")
        await done.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert alive.is_set() and not nursery.cancel_scope.cancel_called
        nursery.cancel_scope.cancel()
    assert "alkfsd broken failed" in caplog.text


async def test_a_short_lived_task_without_the_mounts_nursery_is_refused() -> None:
    """Before `run` starts or after it ended there is no nursery to start a task under:
    RuntimeError, not a task nobody stops."""

    async def task() -> None:
        raise AssertionError("never started")

    workers = Workers()
    with pytest.raises(RuntimeError, match="Workers.run is not running"):
        workers.start_soon(task, name="alkfsd early")
    async with trio.open_nursery() as nursery:
        await nursery.start(workers.run)
        nursery.cancel_scope.cancel()
    with pytest.raises(RuntimeError, match="Workers.run is not running"):
        workers.start_soon(task, name="alkfsd late")


async def test_with_one_request_thread_a_large_file_streams_takes_back_and_commits(
    app, ctx
) -> None:
    """threads=1: the one token of the requests' limiter. A writer past QUEUE_MAX waits for
    room, a read takes the stream back into a spool file, a commit waits for the spooler:
    all of it with that one token (the spooler's threads have a limiter of their own)."""
    w = StagedWriter(ctx, Algorithm.SHA256)
    chunk = bytes(range(256)) * 4096  # 1 MiB
    want = bytearray()
    for _ in range(QUEUE_MAX // len(chunk) * 3):  # well past QUEUE_MAX, forward only
        assert await w.write(len(want), chunk) == len(chunk)
        want += chunk
    assert w.spool is not None and w.streaming
    assert await w.read(5, 11) == bytes(want[5:16])  # the stream is taken back
    assert not w.streaming
    await w.write(3, b"back")  # a write below the end goes to the spool file
    want[3:7] = b"back"
    await w.truncate(len(want) + MEM_MAX)  # an extension: zeros
    want += bytes(MEM_MAX)
    await commits_as(app, w, want)
    w.close()


async def test_the_streams_thread_takes_a_write_while_the_trio_thread_does_not_yield(
    app, ctx
) -> None:
    """While a large file streams, its thread takes each write from a thread-safe queue as
    soon as `submit` queued it: it does not wait for the trio thread to come back to its
    scheduler (pyfuse3's fast path answers write after write without yielding; fetching
    the writes through trio.from_thread left the hashing thread idle meanwhile)."""
    w = StagedWriter(ctx, Algorithm.SHA256)
    chunk = bytes(range(256)) * 4096  # 1 MiB
    want = bytearray()
    for _ in range(3):  # past MEM_MAX: the spooler's stream starts
        await w.write(len(want), chunk)
        want += chunk
    spool = w.spool
    assert spool is not None and w.streaming
    with trio.fail_after(30):
        while spool.queued:  # everything so far taken, and told to the trio side
            await trio.sleep(0.01)
    assert spool._report is None
    await w.write(len(want), chunk)  # (queued only: no checkpoint on this path)
    want += chunk
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the trio thread busy: no checkpoint here
        with spool._report_lock:
            report = spool._report
        if report is not None and report[1] == len(chunk):
            break
        time.sleep(0.005)
    else:
        raise AssertionError("the stream's thread did not take the write")
    await commits_as(app, w, want)
    w.close()


@pytest.mark.parametrize("late", [False, True], ids=["in-the-threads-batch", "still-queued"])
async def test_writes_queued_behind_a_take_back_go_to_the_spool_file_counted_once(
    app, ctx, late: bool
) -> None:
    """Operations queued behind the one that ends the stream (in the batch its thread took,
    or still in its queue when it ended) are applied to the spool file in order, and their
    bytes leave the writer's queued count once: it ends at 0, so `wait_room` waits as it
    should."""
    spool = Spooler(app.store, Algorithm.SHA256, None, True)
    first, second = b"a" * (3 * MEM_MAX), b"b" * MEM_MAX
    spool.submit(Write(0, first))
    if late:
        ctx.workers.start_soon(spool.run, name="alkfsd spool")
        with trio.fail_after(30):
            while spool.queued:  # the thread took the first write (and said so)
                await trio.sleep(0.01)
        spool.submit(TakeBack())
        deadline = time.monotonic() + 30
        while spool._report is None:  # the thread took the TakeBack: no checkpoint
            assert time.monotonic() < deadline
            time.sleep(0.005)
    else:
        spool.submit(TakeBack())  # (all queued before the task starts: one batch)
    spool.submit(Write(len(first), second))
    spool.submit(Sync())
    if not late:
        ctx.workers.start_soon(spool.run, name="alkfsd spool")
    with trio.fail_after(30):
        await spool.wait_applied()
    spool.check()
    assert spool.applied == spool.submitted == 4
    assert spool.queued == 0
    assert spool.pread(len(first) + len(second) + 1, 0) == first + second
    spool.close()


async def test_a_commit_keeps_what_its_stream_stored_when_the_mount_stops_meanwhile(app) -> None:
    """The mount's tasks cancelled while a commit waits for its stream (shielded): the
    put ends with the commit's operation and its result is the commit's, not EIO."""
    ctx = Context(app.store, app=app, options=Options(threads=1), kernel=RecordingInvalidator())
    try:
        async with trio.open_nursery() as nursery:
            stop = trio.CancelScope()

            async def workers(task_status=trio.TASK_STATUS_IGNORED) -> None:
                with stop:
                    await ctx.workers.run(task_status=task_status)

            await nursery.start(workers)
            w = StagedWriter(ctx, Algorithm.SHA256)
            chunk = bytes(range(256)) * 4096  # 1 MiB
            want = bytearray()
            for _ in range(48):  # the last ~8 MiB still queued for the stream's thread
                await w.write(len(want), chunk)
                want += chunk

            async def stop_soon() -> None:
                await trio.lowlevel.checkpoint()  # (the commit has queued its EndStream by now)
                stop.cancel()

            nursery.start_soon(stop_soon)
            with trio.fail_after(60):
                await commits_as(app, w, want)
            assert w.spool is not None
            assert isinstance(w.spool.broken, StoreIO)  # (stopped before the writer closed)
            w.close()
    finally:
        ctx.close()


async def test_a_writer_waiting_on_a_stopped_spooler_hears_it(app) -> None:
    """The spooler's task cancelled with an operation queued but not applied: the writer's
    wait ends and it hears EIO (the spool is gone), instead of waiting for ever."""
    ctx = Context(app.store, app=app, options=Options(threads=1), kernel=RecordingInvalidator())
    try:
        async with trio.open_nursery() as nursery:
            stop = trio.CancelScope()
            spool = Spooler(app.store, Algorithm.SHA256, None, False)

            async def run() -> None:
                with stop:
                    await spool.run()

            nursery.start_soon(run)
            await trio.testing.wait_all_tasks_blocked()  # (waiting for its first operation)
            spool.submit(Write(0, b"queued"))
            stop.cancel()  # before the task takes the write to its thread
            with trio.fail_after(10):
                await spool.wait_applied()
            with pytest.raises(StoreIO):
                spool.check()
            spool.close()
    finally:
        ctx.close()


async def test_a_stream_waiting_for_writes_stops_when_the_mount_stops(app) -> None:
    """The stream's thread waits on its queue, not in trio: cancelling the mount's tasks
    wakes it (nothing is stored) and they end."""
    ctx = Context(app.store, app=app, options=Options(threads=1), kernel=RecordingInvalidator())
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(ctx.workers.run)
                w = StagedWriter(ctx, Algorithm.SHA256)
                await w.write(0, b"s" * (3 * MEM_MAX))
                assert w.spool is not None and w.streaming
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()
        assert w.spool.stream_result is None
        w.close()
        assert list(app.store.iter_keys()) == []
    finally:
        ctx.close()


async def test_a_streamed_file_committed_twice_keeps_what_was_written(app, ctx) -> None:
    """A commit ends the stream; a later write (a descriptor still open) starts from the
    committed object, copied into a spool file."""
    w = StagedWriter(ctx, Algorithm.SHA256)
    data = b"x" * (3 * MEM_MAX)
    await w.write(0, data)
    first = await w.commit()
    first.pin.release()
    await w.write(len(data), b"tail")
    second = await w.commit()
    try:
        assert app.store.get(first.key) == data
        assert app.store.get(second.key) == data + b"tail"
    finally:
        second.pin.release()
    w.close()


async def test_a_small_file_in_memory_keeps_every_write_pattern(app) -> None:
    """The first write at 0 is kept as the bytes it came in (not copied); any later write,
    a hole, a shrinking truncate or a read works on it as on a copy."""
    ctx = Context(app.store, app=app, options=Options(threads=1), kernel=RecordingInvalidator())
    try:
        first = b"0123456789"
        cases: list[tuple[list[tuple[str, int, bytes]], bytes]] = [
            ([("w", 0, first)], first),
            ([("w", 0, first), ("w", 3, b"abc")], b"012abc6789"),
            ([("w", 0, first), ("w", 12, b"Z")], first + b"\0\0Z"),
            ([("w", 0, first), ("t", 4, b"")], b"0123"),
            ([("w", 0, first), ("t", 4, b""), ("w", 6, b"x")], b"0123\0\0x"),
            ([("t", 3, b""), ("w", 0, b"ab")], b"ab\0"),
            ([("w", 2, b"cd")], b"\0\0cd"),
        ]
        for ops, want in cases:
            w = StagedWriter(ctx, Algorithm.SHA256)
            for op, off, data in ops:
                if op == "w":
                    assert await w.write(off, data) == len(data)
                else:
                    await w.truncate(off)
            assert w.size == len(want), ops
            assert await w.read(0, 100) == want, ops
            result = await w.commit()
            try:
                assert app.store.get(result.key) == want, ops
            finally:
                result.pin.release()
            w.close()
    finally:
        ctx.close()


async def test_a_sweep_waiting_for_the_kernel_holds_no_request_thread(app, monkeypatch) -> None:
    """A sweep returns once the kernel took its invalidations, waiting at most
    INVALIDATE_WAIT_S. Here nothing takes them (no kernel session runs the invalidator),
    so the sweep waits its full bound; meanwhile the mount's one request thread is free."""
    monkeypatch.setattr(context_mod, "INVALIDATE_WAIT_S", 2.0)
    ctx = Context(app.store, app=app, options=Options(threads=1))
    try:
        ctx.invalidator.submit(1, b"never-taken")
        before = app.store.last_sweep
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ctx.sweep)
            with trio.fail_after(30):
                while app.store.last_sweep is before:  # the sweep ran: now it waits
                    await trio.sleep(0.01)
            with trio.fail_after(1.0):  # (the wait's bound is 2 s)
                assert await ctx.run_sync(sum, [1, 2]) == 3
    finally:
        ctx.close()
