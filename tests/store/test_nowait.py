"""`Store.put(wait=False)`: an event loop's small put either completes without waiting or
is WouldWait with nothing changed (the daemon then puts from a worker thread)."""

from __future__ import annotations

import os

import pysqlite3.dbapi2 as sqlite3
import pytest

from alkfs import reserve as reserve_mod
from alkfs.db import sqlite as sqlite_engine
from alkfs.errors import WouldWait
from alkfs.keys import Algorithm
from alkfs.pins import Pins
from alkfs.store import DB_NAME, NOWAIT_PUT_MAX

from .conftest import PG, open_column, sha256_key


def looked(store):
    """The store after its first put (a waiting one): that put looks at the free space
    (alkfs/reserve.py); puts that never wait count on that look for ARM_EVERY_S."""
    store.put(b"the first put looks at the disk\n").pin.release()
    return store


def test_a_small_put_that_need_not_wait_is_stored(column):
    store = column.store
    if store.reserve is not None and store.reserve.size:
        with pytest.raises(WouldWait):  # nothing has looked at the free space yet
            store.put(b"too early\n", wait=False)
    store = looked(store)
    data = b"stored without waiting\n"
    if column.name.startswith(PG):  # every statement is a round trip: never on a loop
        with pytest.raises(WouldWait):
            store.put(data, wait=False)
        assert not store.has(sha256_key(data))
        assert store.arbiter.pin_count(sha256_key(data)) == 0
        return
    result = store.put(data, wait=False)
    assert result.key == sha256_key(data) and result.created
    assert store.arbiter.pin_count(result.key) == 1
    result.pin.release()
    assert store.get(result.key) == data


def test_a_stream_or_a_large_put_is_refused_before_anything_is_read(dual):
    store = dual.store
    with pytest.raises(WouldWait):
        store.put(iter([b"a stream"]), wait=False)
    big = bytes(NOWAIT_PUT_MAX + 1)
    with pytest.raises(WouldWait):
        store.put(big, wait=False)
    over_threshold = bytes(store.threshold + 1)  # (the large tier writes and fsyncs a file)
    with pytest.raises(WouldWait):
        store.put(over_threshold, wait=False)
    assert dual.media() == (0, 0)


def test_the_write_lock_held_elsewhere_is_would_wait_and_nothing_changes(dual, tmp_path):
    store = looked(dual.store)
    pins = Pins(store)
    data = b"the lock is held\n"
    key = sha256_key(data)
    other = sqlite3.connect(dual.root / DB_NAME, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(WouldWait):
            store.put(data, wait=False)
        with pytest.raises(WouldWait):
            pins.put_pinned("held", data, wait=False)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert not store.has(key)
    assert pins.get("held") is None
    assert store.arbiter.pin_count(key) == 0
    # refused at once: this thread's connection never ran sqlite's busy wait
    assert store.db.pragma("busy_timeout") == 0
    assert store.db.pragma("wal_autocheckpoint") == 0
    # (and a page cache that holds the key index's random leaves, as a bulk writer's)
    assert store.db.pragma("cache_size") == -sqlite_engine.WRITER_CACHE_KIB
    # the lock gone, the same call completes (the connection's posture is not stuck)
    result, record = pins.put_pinned("held", data, wait=False)
    assert record.key == key and store.get(key) == data
    assert store.arbiter.pin_count(key) == 0  # (put_pinned releases its pin)
    store.put(b"a waiting put\n").pin.release()  # the waiting posture comes back
    assert store.db.pragma("busy_timeout") == sqlite_engine.BUSY_TIMEOUT_MS
    assert store.db.pragma("wal_autocheckpoint") == sqlite_engine.AUTOCHECKPOINT_PAGES


def test_a_delete_in_flight_is_would_wait(dual):
    store = looked(dual.store)
    data = b"being deleted\n"
    key = sha256_key(data)
    assert store.arbiter.arbitrate(key)  # the delete marker a sweep holds
    try:
        with pytest.raises(WouldWait):
            store.arbiter.acquire(key, wait=False)
        with pytest.raises(WouldWait):
            store.put(data, wait=False)
    finally:
        store.arbiter.conclude(key)
    assert store.arbiter.pin_count(key) == 0 and not store.has(key)
    store.put(data, wait=False).pin.release()
    assert store.has(key)


def test_puts_that_never_wait_keep_the_wal_bounded(tmp_path):
    """Their commits never checkpoint; every NOWAIT_COMMITS-th is refused so that its
    waiting retry (which checkpoints) keeps the WAL from growing with each file."""
    col = open_column("kv-only", tmp_path, threshold=1 << 17)
    try:
        store = looked(col.store)
        refused = 0
        for i in range(1500):
            data = f"small file {i}\n".encode() * 200  # ~3 KiB: a page and its overflow
            try:
                result = store.put(data, algo=Algorithm.SHA256, wait=False)
            except WouldWait:
                refused += 1
                result = store.put(data)
            result.pin.release()
        assert refused == 1500 // sqlite_engine.NOWAIT_COMMITS
        wal = os.path.getsize(col.root / f"{DB_NAME}-wal")
        # 1,500 commits of several pages each: ~30 MiB of WAL if none checkpointed
        assert wal < 16 << 20, wal
        assert store.counts()["sha256"]["count"] == 1501
    finally:
        col.store.close()


def test_puts_that_never_wait_ask_for_a_backfill_every_backfill_commits(tmp_path):
    """... and once more BACKFILL_LEAD commits before the refused one (whose checkpoint
    then copies only what came since)."""
    col = open_column("kv-only", tmp_path, threshold=1 << 17)
    try:
        store = looked(col.store)
        asked_at: list[int] = []
        puts = [0]
        store.db.on_backfill = lambda: asked_at.append(puts[0])
        refused_at = []
        for i in range(sqlite_engine.NOWAIT_COMMITS):
            try:
                store.put(f"small file {i}\n".encode(), wait=False).pin.release()
                puts[0] += 1
            except WouldWait:  # (the checkpoint's turn: not asked then, see _posture)
                refused_at.append(puts[0])
        assert refused_at == [sqlite_engine.NOWAIT_COMMITS - 1]
        every = sqlite_engine.BACKFILL_COMMITS
        lead = sqlite_engine.BACKFILL_LEAD
        assert asked_at == [every - 1, 2 * every - 1, 3 * every - 1, refused_at[0] - lead]
        store.put(b"a waiting put asks for nothing\n").pin.release()
        assert len(asked_at) == 4
    finally:
        col.store.close()


def test_the_backfill_looks_at_the_disk_ahead_of_the_puts_that_never_wait(tmp_path, monkeypatch):
    """No reserve on a roomy disk: a put looks at the free space once every ARM_EVERY_S,
    and a put that must not wait cannot look (WouldWait: it is put from a worker thread,
    a waiting commit). The backfill looks ahead instead, so those puts go on."""
    col = open_column("kv-only", tmp_path, threshold=1 << 17)
    try:
        store = looked(col.store)
        reserve = store.reserve
        assert reserve is not None and reserve.size and not reserve.have
        clock = [reserve_mod.time.monotonic()]
        monkeypatch.setattr(reserve_mod.time, "monotonic", lambda: clock[0])
        store.put(b"within the second\n", wait=False).pin.release()
        clock[0] += reserve_mod.ARM_EVERY_S - reserve_mod.LOOK_AHEAD_S / 2  # due soon
        store.backfill()
        clock[0] += reserve_mod.LOOK_AHEAD_S  # past the first look's second
        store.put(b"after the second\n", wait=False).pin.release()
        clock[0] += reserve_mod.ARM_EVERY_S  # and past the backfill's look: a put looks
        with pytest.raises(WouldWait, match="reserve needs a look"):
            store.put(b"nobody looked\n", wait=False)
    finally:
        col.store.close()


def test_a_backfill_writes_the_log_into_the_file_while_a_writer_holds_the_lock(tmp_path):
    """A PASSIVE checkpoint: the pages the commits left in the WAL reach the database file,
    and a writer holding sqlite's write lock meanwhile is not waited for."""
    col = open_column("kv-only", tmp_path, threshold=1 << 17)
    try:
        store = looked(col.store)
        for i in range(200):
            store.put(os.urandom(3000) + b"%d" % i, wait=False).pin.release()
        path = col.root / DB_NAME
        before = os.path.getsize(path)
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            store.db.backfill()
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert os.path.getsize(path) >= before + 200 * 3000
        assert store.counts()["sha256"]["count"] == 201
    finally:
        col.store.close()
