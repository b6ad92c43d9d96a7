"""The SQL kv engine and the delete window: the posture, the key index, stage/take.

The kv and window rows run on both engines (a sqlite file, a PostgreSQL database on
the session's throwaway server); the posture rows are sqlite's (their PostgreSQL
counterparts are in test_postgres_engine.py)."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from alkfs.db import Error as DriverError
from alkfs.db.sqlite import SqliteDatabase as Database
from alkfs.errors import Invalid
from alkfs.gc.window import TAKE_BATCH, MemoryWindow, SqlWindow
from alkfs.schema import statements
from alkfs.store import DB_NAME, Store
from alkfs.tiers.sql import SqlTier

from .conftest import oracle_connect, sha256_key

# -- the durability posture ---------------------------------------------------------


def test_the_live_connection_runs_wal_synchronous_normal_and_busy_timeout(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as store:
        assert str(store.db.pragma("journal_mode")).lower() == "wal"
        assert store.db.pragma("synchronous") == 1
        assert store.db.pragma("busy_timeout") == 5000

        # Connections are per thread: another thread's connection holds the posture too.
        seen: list[object] = []

        def probe() -> None:
            seen.extend(store.db.pragma(p) for p in ("journal_mode", "synchronous", "busy_timeout"))

        worker = threading.Thread(target=probe)
        worker.start()
        worker.join()
        assert [str(seen[0]).lower(), seen[1], seen[2]] == ["wal", 1, 5000]


@pytest.mark.parametrize("target", [":memory:", "file::memory:?cache=shared", ""])
def test_a_database_that_cannot_hold_wal_is_refused_at_construction(target: str) -> None:
    with pytest.raises(Invalid) as caught:
        Database(target)
    assert type(caught.value) is Invalid


def test_the_schema_is_created_once_and_reopening_is_a_no_op(tmp_path: Path) -> None:
    for _ in range(2):
        with Store.open(tmp_path / "s") as store:
            store.add(b"kept across reopen")
    conn = oracle_connect(tmp_path / "s")
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"blobs", "gc_window", "meta"} <= tables
        assert conn.execute("SELECT count(*) FROM blobs").fetchone()[0] == 1
    finally:
        conn.close()


def open_db_files(root: Path) -> int:
    """File descriptors this process holds on the store's sqlite file."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(root / DB_NAME):
                n += 1
        except OSError:
            continue
    return n


def test_a_finished_threads_connection_is_closed_with_it(tmp_path: Path) -> None:
    """Worker threads come and go (trio's thread cache): their connections must not pile up."""

    def use(store: Store) -> None:
        assert store.has(store.add(b"touched from a worker thread"))

    with Store.open(tmp_path / "s") as store:
        for rounds in (1, 30):
            for _ in range(rounds):
                worker = threading.Thread(target=use, args=(store,))
                worker.start()
                worker.join()
            if rounds == 1:
                after_one = open_db_files(tmp_path / "s")
        assert open_db_files(tmp_path / "s") == after_one
    assert open_db_files(tmp_path / "s") == 0


# -- the kv engine --------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "postgresql":
        from alkfs.db.postgres import PostgresDatabase

        database: Any = PostgresDatabase(request.getfixturevalue("pg_uri"))
    else:
        database = Database(tmp_path / DB_NAME)
    database.create(statements(database.engine))
    yield database
    database.close()


def kv_tier(db: Any) -> SqlTier:
    if db.engine == "postgresql":
        from alkfs.tiers.postgres import PgTier

        return PgTier(db)
    return SqlTier(db)


def test_size_is_exact_and_served_by_the_key_index(db: Database) -> None:
    tier = kv_tier(db)
    key = sha256_key(b"size probe").raw
    value = b"\xab" * (256 * 1024)
    assert tier.put(key, value, 1) is True
    if db.engine == "postgresql":
        entry = tier.stat(key)
        assert (entry.size, entry.stored_ns) == (len(value), 1)
        assert tier.stat(sha256_key(b"absent").raw) is None
        with db.snapshot() as conn:  # (one state, planned without the table's statistics)
            conn.execute("SET LOCAL enable_seqscan = off")
            plan = " ".join(
                r[0]
                for r in conn.execute(
                    "EXPLAIN SELECT size, stored_ns FROM blobs WHERE key = ?", (key,)
                ).fetchall()
            )
        assert "blobs_pkey" in plan and "Seq Scan" not in plan, plan
        return
    statements: list[str] = []
    conn = db.conn()
    conn.set_trace_callback(statements.append)
    try:
        entry = tier.stat(key)
        absent = tier.stat(sha256_key(b"absent").raw)
    finally:
        conn.set_trace_callback(None)
    assert (entry.size, entry.stored_ns) == (len(value), 1)
    assert absent is None

    # The statement stat ran, planned: a search of the key's index, never a scan.
    (template,) = {re.sub(r"[xX]'[0-9a-fA-F]*'", "?", sql) for sql in statements}
    assert "value" not in template
    assert template.count("?") == 1, template
    plan = conn.execute("EXPLAIN QUERY PLAN " + template, (key,)).fetchall()
    details = " ".join(row[3] for row in plan)
    assert "USING INDEX" in details, details
    assert "SCAN" not in details, details


def test_the_first_writer_wins_and_a_re_put_only_freshens(db: Database) -> None:
    tier = kv_tier(db)
    key = sha256_key(b"first").raw
    assert tier.put(key, b"first", 10) is True
    assert tier.put(key, b"a different value under the same key", 20) is False
    assert tier.read(key) == b"first"
    assert (tier.stat(key).size, tier.stat(key).stored_ns) == (5, 20)
    assert tier.freshen(key, 30) is True
    assert tier.stat(key).stored_ns == 30
    assert tier.delete(key) == 5
    assert tier.delete(key) is None
    assert tier.freshen(key, 40) is False
    assert tier.rows() == 0


def test_a_row_stored_after_the_newest_were_deleted_arrives_after_them(db: Database) -> None:
    """Arrival order survives deletions at the top (sqlite would reuse their rowids, and
    a row stored then would count as arrived before a derived set built meanwhile)."""
    tier = kv_tier(db)
    keys = [sha256_key(b"row %d" % i).raw for i in range(4)]
    for k in keys[:3]:
        assert tier.put(k, k, 1)
    built_at = tier.high_water()  # (what a derived set records as its max_rowid)
    for k in keys[1:3]:  # the two newest go
        assert tier.delete(k) == len(k)
    assert tier.put(keys[3], keys[3], 2)
    tier.insert_many([sha256_key(b"bulk %d" % i).raw for i in range(2)], [b"a", b"b"], 3)
    arrived = set(tier.arrived(b"\x00", b"\xff", built_at))
    assert arrived == {keys[3], *(sha256_key(b"bulk %d" % i).raw for i in range(2))}
    assert set(tier.arrived(b"\x00", b"\xff", 0, upto=built_at)) == {keys[0]}
    assert tier.high_water() > built_at
    assert tier.rows() == 4


def test_an_empty_value_round_trips(db: Database) -> None:
    tier = kv_tier(db)
    key = sha256_key(b"").raw
    assert tier.put(key, b"", 1) is True
    assert tier.read(key) == b""
    assert tier.stat(key).size == 0
    assert [e.key for e in tier.scan(b"", b"\xff", 10)] == [key]


# -- the delete window: the durable and the in-memory form share one contract ----------


@pytest.fixture(params=["database", "memory"])
def window(request: pytest.FixtureRequest, db: Database) -> SqlWindow | MemoryWindow:
    return SqlWindow(db) if request.param == "database" else MemoryWindow()


def rows_of(window: SqlWindow | MemoryWindow, keys: list[bytes]) -> list[tuple[bytes, int]]:
    return sorted((k, window.visible_after(k)) for k in keys if window.visible_after(k) is not None)


def test_staging_is_idempotent_and_a_restage_moves_the_deadline_forward_only(window) -> None:
    key = b"\x01window-key"
    assert window.stage([(key, 1_000_000_000)], staged_ns=1) == 1
    assert window.stage([(key, 1_000_000_000)], staged_ns=2) == 1
    assert window.rows() == 1
    assert window.visible_after(key) == 1_000_000_000

    window.stage([(key, 2_000_000_000)], staged_ns=3)
    assert (window.rows(), window.visible_after(key)) == (1, 2_000_000_000)
    window.stage([(key, 1_000_000_000)], staged_ns=4)
    assert window.visible_after(key) == 2_000_000_000, "never backwards"

    other = b"\x01window-other"
    window.stage([(other, 1_000_000_000)], staged_ns=5)
    assert window.rows() == 2
    assert window.staged_keys() == {key, other}
    # A re-stage keeps the original staging instant (what written-since compares to).
    assert window.take(2_000_000_000) == [(key, 1), (other, 5)]


def test_a_stage_call_failing_mid_way_stages_nothing(window) -> None:
    prior = b"\x01window-prior"
    window.stage([(prior, 1_000_000_000)], staged_ns=1)
    bad_rows = [(b"\x01window-aborted-a", 2_000_000_000), (b"\x01window-aborted-b", None)]
    with pytest.raises((*DriverError, TypeError)):  # (either engine's integrity error)
        window.stage(bad_rows, staged_ns=2)
    assert window.staged_keys() == {prior}
    assert window.rows() == 1
    good = [(b"\x01window-aborted-a", 2_000_000_000), (b"\x01window-aborted-b", 2_000_000_000)]
    assert window.stage(good, staged_ns=3) == 2
    assert window.rows() == 3


def test_a_take_returns_the_overdue_set_and_leaves_future_rows(window) -> None:
    past_pre_epoch = b"\x01win-past-pre-epoch"
    past = b"\x01win-past"
    future = b"\x01win-future"
    far_future = b"\x01win-far-future"
    window.stage(
        [
            (past_pre_epoch, -1_000_000_000),
            (past, 1_000_000_000),
            (future, 2_000_000_000),
            (far_future, 3_600_000_000_000),
        ],
        staged_ns=7,
    )
    assert window.take(1_000_000_001) == sorted([(past_pre_epoch, 7), (past, 7)])
    assert window.take(1_000_000_001) == [], "a taken row is never handed out twice"
    assert rows_of(window, [past_pre_epoch, past, future, far_future]) == sorted(
        [(far_future, 3_600_000_000_000), (future, 2_000_000_000)]
    )


def test_a_take_at_exactly_visible_after_is_overdue(window) -> None:
    equal = b"\x01win-equal-boundary"
    later = b"\x01win-nanosecond-later"
    window.stage([(equal, 1_500_000_000), (later, 1_500_000_001)], staged_ns=1)
    assert window.take(1_500_000_000) == [(equal, 1)], "visible_after == now is overdue"
    assert window.take(1_500_000_000) == []
    assert window.take(1_500_000_001) == [(later, 1)]
    assert window.rows() == 0


def test_a_take_is_bounded_oldest_deadlines_first_across_the_backlog(window) -> None:
    total = TAKE_BATCH + 7
    keys = [f"\x01win-backlog-{i:05}".encode() for i in range(total)]
    # Deadlines run opposite to key order, so "oldest first" is not "smallest key first".
    window.stage([(k, (total - i) * 1_000_000) for i, k in enumerate(keys)], staged_ns=1)
    horizon = (total + 1) * 1_000_000
    first = window.take(horizon)
    assert [k for k, _ in first] == sorted(keys[7:]), "exactly the batch, oldest first"
    assert [k for k, _ in window.take(horizon)] == sorted(keys[:7])
    assert window.take(horizon) == []
    assert window.take(horizon, limit=5) == []


def test_an_empty_window_takes_empty(window) -> None:
    assert window.take(2**62) == []
    assert window.staged_keys() == set()
    assert window.rows() == 0
    assert window.stage([], staged_ns=1) == 0
