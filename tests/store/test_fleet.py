"""Several processes on one PostgreSQL store (alkfs/fleet.py), as two stores opened in one
test on the same database and directory: each is a member of the fleet with its own
session, pin rows and connection pool, as two daemons are."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from alkfs.app import Alkfs
from alkfs.errors import Stale
from alkfs.git.refs import RefUpdate
from alkfs.keys import Algorithm
from alkfs.store import Store

from .conftest import patterned, register

THRESHOLD = 1024


@pytest.fixture
def two(tmp_path: Path, pg_uri: str) -> Iterator[tuple[Store, Store]]:
    root = tmp_path / "s"
    a = Store.open(root, threshold=THRESHOLD, window_s=0, database=pg_uri)
    b = Store.open(root, threshold=THRESHOLD, window_s=0, database=pg_uri)
    try:
        yield a, b
    finally:
        b.close()
        a.close()


def sql(uri: str, query: str, params: tuple = ()) -> list[tuple]:
    with psycopg.connect(uri, autocommit=True) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def wait_for(predicate, timeout: float = 5.0) -> float:
    """Seconds until `predicate()` held (fails after `timeout`)."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "not within the bound"
        time.sleep(0.01)
    return time.monotonic() - t0


def test_what_one_member_stores_the_other_reads(two) -> None:
    a, b = two
    small, large = patterned(100, 7), patterned(5 * THRESHOLD + 3, 11)
    keys = [a.add(small), a.add(large)]
    assert [b.get(k) for k in keys] == [small, large]
    assert b.stat(keys[1]).tier == "large"
    assert a.fleet.node != b.fleet.node
    nodes = a.fleet.nodes()
    assert sorted(n["id"] for n in nodes) == sorted([a.fleet.node, b.fleet.node])
    assert [n["self"] for n in nodes if n["id"] == a.fleet.node] == [True]


def test_a_pin_held_by_one_member_keeps_the_object_from_the_others_sweeps(two) -> None:
    a, b = two
    register(b)
    result = a.put(patterned(300, 13))  # pinned by a until released
    assert b.sweep().candidates_staged == 1  # (b's arbiter knows nothing of a's pin)
    report = b.sweep()
    assert (report.deleted, report.cancelled_by_arbitration) == (0, 1), "a's pin row kept it"
    assert a.has(result.key)
    result.pin.release()
    a.fleet.flush_unpins()  # (released rows go lazily: at most half a second later)
    report = b.sweep()  # executes what the last one staged again
    assert report.deleted == 1
    assert not a.has(result.key)


def test_one_sweep_at_a_time_in_the_fleet(two) -> None:
    a, b = two
    register(a)
    register(b)
    with a.fleet.sweep_lease() as got:
        assert got is True
        report = b.sweep()
        assert report.aborted == "sweeper-lock"
    assert b.sweep().aborted is None
    assert [n["sweeping"] for n in a.fleet.nodes()] == [False, False]


def test_a_deletion_through_one_member_reaches_the_others_hooks(two) -> None:
    a, b = two
    register(b)
    key = a.add(patterned(200, 17))
    a.fleet.flush_unpins()
    seen: list[bytes] = []
    a.deleted_hooks.append(seen.append)
    mine: list[bytes] = []
    b.deleted_hooks.append(mine.append)
    b.sweep()
    assert b.sweep().deleted == 1
    delay = wait_for(lambda: key.raw in seen, timeout=2.0)
    assert delay < 2.0
    time.sleep(0.3)
    assert seen == [key.raw] and mine == [key.raw], "once each, the sweeper's own not replayed"


def test_a_ref_made_through_one_member_keeps_its_objects_from_the_others_sweep(
    tmp_path: Path, pg_uri: str
) -> None:
    """The sweep computed what is live before the ref existed; the epoch it compares
    at delete time moved, so nothing of that batch is deleted."""
    root = tmp_path / "s"
    with (
        Alkfs.open(root, window_s=0, database=pg_uri) as a,
        Alkfs.open(root, window_s=0, database=pg_uri) as b,
    ):
        blob = a.store.add(b"blob 5\0hello", algo=Algorithm.GIT_SHA1)
        a.refs.create_repo("r")
        b.store.sweep()  # stages the blob: nothing names it yet
        assert b.store.window.rows() == 1
        epoch = b.store.fleet.epoch()
        [out] = a.refs.update("r", [RefUpdate("refs/tags/t", blob.hex, None)])
        assert out.ok
        assert b.store.fleet.epoch() == epoch + 1
        # b's next sweep executes the staged row against its new view: the blob is live
        report = b.store.sweep()
        assert report.deleted == 0 and b.store.has(blob)
        wait_for(lambda: b.refs.refs("r") == {"refs/tags/t": blob.hex})


def test_the_epoch_check_cancels_a_batch_when_refs_moved_after_the_mark(two, monkeypatch) -> None:
    a, b = two
    register(b)
    key = a.add(patterned(120, 19))
    b.sweep()
    import alkfs.gc.sweep as sweep_mod

    real = sweep_mod._delete

    def meanwhile(store, report, part, protected, epoch):  # a ref/pin commit elsewhere
        with a.db.tx() as conn:
            a.fleet.guard_publish(conn, [])
        return real(store, report, part, protected, epoch)

    monkeypatch.setattr(sweep_mod, "_delete", meanwhile)
    report = b.sweep()
    assert (report.deleted, report.cancelled_by_arbitration) == (0, 1)
    assert b.has(key)


def test_a_member_paused_past_its_ttl_cannot_publish_what_was_collected(
    tmp_path: Path, pg_uri: str
) -> None:
    """a's session lapses (as if SIGSTOPped past the TTL: its expiry is moved into the
    past); b's sweep collects the object a is still writing; a's ref to it is refused."""
    root = tmp_path / "s"
    with (
        Alkfs.open(root, window_s=0, database=pg_uri) as a,
        Alkfs.open(root, window_s=0, database=pg_uri) as b,
    ):
        a.refs.create_repo("r")
        result = a.store.put(b"blob 4\0lost", algo=Algorithm.GIT_SHA1)  # a push in flight
        b.store.sweep()  # staged: unnamed
        sql(pg_uri, "UPDATE fleet_nodes SET expiry_ns = 0 WHERE id = %s", (a.store.fleet.node,))
        report = b.store.sweep()
        assert report.deleted == 1, "a's pin row is a dead session's"
        [out] = a.refs.update("r", [RefUpdate("refs/heads/x", result.key.hex, None)])
        assert (out.ok, out.reason) == (False, "missing-object")
        other = a.store.add(b"blob 5\0other", algo=Algorithm.GIT_SHA1)
        with pytest.raises(Stale):  # (any publish: the session is over)
            a.refs.update("r", [RefUpdate("refs/heads/y", other.hex, None)])
        assert a.refs.refs("r") == {}
        assert a.store.fleet.renew() is False  # never renewed: a new session instead
        assert a.store.fleet.tainted == {result.key.raw}
        # while the lost object is still pinned by a: what names it or reaches it is
        # refused, and only that
        with pytest.raises(Stale):
            a.store.fleet.guard_publish(a.store.db, [result.key.raw])
        entry = b"100644 f\0" + result.key.digest
        tree = a.store.add(b"tree %d\0" % len(entry) + entry, algo=Algorithm.GIT_SHA1)
        with pytest.raises(Stale):  # (its closure holds the lost blob)
            a.store.fleet.guard_publish(a.store.db, [tree.raw])
        unrelated = a.store.add(b"blob 9\0unrelated", algo=Algorithm.GIT_SHA1)
        [out] = a.refs.update("r", [RefUpdate("refs/heads/u", unrelated.hex, None)])
        assert out.ok and a.store.fleet.tainted == {result.key.raw}
        result.pin.release()
        assert a.store.fleet.tainted == set()
        again = a.store.put(b"blob 4\0lost", algo=Algorithm.GIT_SHA1)  # written again
        [out] = a.refs.update("r", [RefUpdate("refs/heads/x", again.key.hex, None)])
        again.pin.release()
        assert out.ok and b.store.has(again.key)


def test_the_lease_holders_connection_killed_mid_sweep_ends_it_as_report_data(
    two, pg_uri: str, monkeypatch
) -> None:
    a, b = two
    register(a)
    register(b)
    import alkfs.gc.sweep as sweep_mod

    monkeypatch.setattr(sweep_mod, "DELETE_TX", 1)
    for i in range(4):
        a.add(patterned(50 + i, 23))
    a.fleet.flush_unpins()
    assert a.sweep().candidates_staged == 4
    cut = threading.Event()

    def kill(_key: bytes) -> None:
        if not cut.is_set():
            cut.set()  # the lease's connection: the one holding the advisory lock
            sql(
                pg_uri,
                "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
                "AND objid = %s",
                (0x73776570,),
            )

    a.deleted_hooks.append(kill)
    report = a.sweep()
    assert (report.aborted, report.deleted) == ("io-error", 1)
    # the other member takes the lease and finishes (the untaken rows are still staged;
    # the taken ones are staged again by its sweep and deleted by the next)
    total = 0
    for _ in range(3):
        r = b.sweep()
        assert r.aborted is None
        total += r.deleted
    assert total == 3
    assert b.kv.rows() == 0


def test_each_member_keeps_its_disk_reserve_in_its_own_directory(two) -> None:
    """The members' STORE is one directory: each keeps its reserve (alkfs/reserve.py) in
    its own in-flight directory, never STORE/reserve, and takes it along when it leaves."""
    a, b = two
    assert a.reserve is not None and b.reserve is not None
    for s in (a, b):
        assert s.reserve.path == s.path / "nodes" / s.fleet.node / "reserve"
    assert a.reserve.path != b.reserve.path
    a.reserve.path.write_bytes(b"\0" * 4096)  # (as if the disk had filled: it is made)
    a.close()
    assert not a.reserve.path.parent.exists() and not (b.path / "reserve").exists()
    assert b.reserve.path.parent.is_dir()
