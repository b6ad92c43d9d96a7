"""The PostgreSQL engine on a real server: the put-vs-delete race, the posture rows of
tests/store/test_sqlite_engine.py, the store-directory binding, the schema version, a
lost connection, and passwords kept out of everything shown."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pysqlite3.dbapi2 as sqlite3
import pytest

from alkfs.app import Alkfs
from alkfs.binding import BINDING_NAME
from alkfs.db.postgres import PostgresDatabase
from alkfs.db.uri import has_password, redact
from alkfs.errors import Invalid, StoreIO, StoreLocked
from alkfs.schema import SCHEMA_VERSION, statements
from alkfs.store import DB_NAME, Store
from alkfs.tiers.postgres import PgTier

from .conftest import register, sha256_key

TABLES = (
    "meta",
    "blobs",
    "gc_window",
    "catalog",
    "git_repos",
    "git_refs",
    "pins",
    "roots",
    "lfs_pointers",
)
FLEET = (
    "fleet_nodes",
    "fleet_machines",
    "root_tips",
    "fleet_pins",
    "fleet_epoch",
    "fleet_deletions",
    "fleet_packs",
    "fleet_pack_holds",
)


def pg_one(uri: str, sql: str, params: tuple = ()) -> object:
    with psycopg.connect(uri, autocommit=True) as conn:
        row = conn.execute(sql, params).fetchone()
        return None if row is None else row[0]


def lock_waiters(uri: str) -> int:
    """Backends of the database waiting on a lock (a row lock or an advisory lock)."""
    return int(
        pg_one(
            uri,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()",
        )
    )


def wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def run(target, *args) -> tuple[threading.Thread, dict]:
    """`target(*args)` in a thread; its result or exception lands in the dict."""
    out: dict = {}

    def body() -> None:
        try:
            out["result"] = target(*args)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


@pytest.fixture
def kv_store(tmp_path: Path, pg_uri: str) -> Iterator[Store]:
    store = Store.open(tmp_path / "s", mode="kv-only", window_s=0, database=pg_uri)
    yield store
    store.close()


# -- 1. the put-vs-delete race ---------------------------------------------------------


class DoNothingPgTier(PgTier):
    """What sqlite's put does, on PostgreSQL (intentionally broken): `ON CONFLICT DO
    NOTHING`, then a separate freshen. DO NOTHING does not wait for the sweep's row lock."""

    def put(self, key: bytes, data: bytes, now_ns: int) -> bool:
        cur = self.db.execute(
            "INSERT INTO blobs (key, size, stored_ns, value) VALUES (?, ?, ?, ?) "
            "ON CONFLICT DO NOTHING",
            (key, len(data), now_ns, data),
        )
        if cur.rowcount == 1:
            return True
        self.db.execute("UPDATE blobs SET stored_ns = ? WHERE key = ?", (now_ns, key))
        return False


def race(store: Store, uri: str, tier: PgTier) -> dict:
    """A: the sweep's delete of a row staged at 200, holding the row lock ~1 s between
    its decision and its delete; B: a put of the same row meanwhile."""
    key = sha256_key(b"raced row").raw
    data = b"raced row"
    assert tier.put(key, data, 100) is True  # written before the staging instant
    locked = threading.Event()
    seen: dict = {}

    def hold(k: bytes) -> None:
        assert k == key
        locked.set()
        # B is running its put: give it time to block on (or pass) the row lock.
        seen["b_waiting"] = wait_for(lambda: lock_waiters(uri) >= 1, timeout=1.0)
        time.sleep(1.0 if not seen["b_waiting"] else 0.3)
        seen["b_done_before_a_deleted"] = "result" in b_out or "error" in b_out

    tier._between_lock_and_delete = hold  # (on the instance)
    a, a_out = run(tier.delete_unwritten, key, 200)
    assert locked.wait(10), "A never reached its delete"
    b, b_out = run(tier.put, key, data, 300)
    a.join(20)
    b.join(20)
    assert not a.is_alive() and not b.is_alive()
    assert "error" not in a_out and "error" not in b_out, (a_out, b_out)
    seen.update(a=a_out["result"], b=b_out["result"], after=tier.read(key), data=data)
    return seen


def test_a_put_waits_for_the_sweeps_row_lock_and_the_object_survives(kv_store, pg_uri) -> None:
    assert type(kv_store.kv) is PgTier
    seen = race(kv_store, pg_uri, kv_store.kv)
    assert seen["b_waiting"] is True, "B's put blocked on A's row lock"
    assert seen["b_done_before_a_deleted"] is False, "B finished only after A committed"
    assert seen["a"] == len(seen["data"]), "A deleted the row it decided on"
    assert seen["b"] is True, "B inserted afresh after the delete"
    assert seen["after"] == seen["data"]
    assert kv_store.kv.stat(sha256_key(b"raced row").raw).stored_ns == 300


def test_a_do_nothing_put_loses_the_object_under_the_same_schedule(kv_store, pg_uri) -> None:
    """The race the first test catches is real: sqlite's put shape loses the object."""
    seen = race(kv_store, pg_uri, DoNothingPgTier(kv_store.db))
    assert seen["a"] == len(seen["data"])
    assert seen["b"] is False, "B was told the object is present"
    assert seen["after"] is None, "and then it was gone"


# -- 2. the posture ------------------------------------------------------------------


@pytest.fixture
def db(pg_uri: str) -> Iterator[PostgresDatabase]:
    database = PostgresDatabase(pg_uri, lock=False)
    database.create(statements("postgresql"))
    database.execute("CREATE TABLE t (n bigint NOT NULL)")
    yield database
    database.close()


def test_the_engine_names_itself(db: PostgresDatabase, pg_uri: str) -> None:
    assert (db.engine, db.arrival) == ("postgresql", "seq")
    assert db.describe() == pg_uri  # (no password in it: shown as it is)
    assert {
        r[0] for r in db.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    } == {
        *TABLES,
        *FLEET,
        "t",
    }


def test_write_transactions_run_one_at_a_time(db: PostgresDatabase, pg_uri: str) -> None:
    first_in = threading.Event()
    release = threading.Event()
    second_in = threading.Event()

    def first() -> None:
        with db.tx() as conn:
            conn.execute("INSERT INTO t (n) VALUES (1)")
            first_in.set()
            assert release.wait(20)

    def second() -> int:
        assert first_in.wait(20)
        with db.tx() as conn:
            n = conn.execute("SELECT count(*) FROM t").fetchone()[0]
            second_in.set()
            conn.execute("INSERT INTO t (n) VALUES (2)")
            return n

    a, a_out = run(first)
    b, b_out = run(second)
    assert first_in.wait(20)
    assert wait_for(lambda: lock_waiters(pg_uri) == 1), "the second waits on the writer lock"
    assert not second_in.is_set(), "the second's first statement has not run"
    release.set()
    a.join(20)
    b.join(20)
    assert a_out == {"result": None} and "error" not in b_out, (a_out, b_out)
    assert b_out["result"] == 1, "the second ran after the first committed (it saw its row)"
    assert db.execute("SELECT n FROM t ORDER BY n").fetchall() == [(1,), (2,)]


def test_a_nested_statement_is_part_of_the_threads_transaction(db: PostgresDatabase) -> None:
    inside = threading.Event()
    done = threading.Event()
    seen: dict = {}

    def writer() -> None:
        with db.tx() as conn:
            conn.execute("INSERT INTO t (n) VALUES (7)")
            seen["nested"] = db.execute("SELECT count(*) FROM t").fetchone()[0]
            inside.set()
            assert done.wait(20)
        seen["after"] = db.execute("SELECT count(*) FROM t").fetchone()[0]

    w, w_out = run(writer)
    assert inside.wait(20)
    seen["other_thread"] = db.execute("SELECT count(*) FROM t").fetchone()[0]
    done.set()
    w.join(20)
    assert "error" not in w_out, w_out
    assert seen == {"nested": 1, "other_thread": 0, "after": 1}


def test_a_failing_transaction_leaves_nothing(db: PostgresDatabase) -> None:
    with pytest.raises(psycopg.errors.UniqueViolation), db.tx() as conn:
        conn.execute("INSERT INTO meta (name, value) VALUES ('x', '1')")
        conn.execute("INSERT INTO meta (name, value) VALUES ('x', '2')")
    assert db.execute("SELECT count(*) FROM meta").fetchone()[0] == 0


def test_a_snapshot_sees_one_state_while_another_thread_commits(db: PostgresDatabase) -> None:
    db.execute("INSERT INTO t (n) VALUES (1)")
    first = threading.Event()
    committed = threading.Event()

    def reader() -> tuple[int, int]:
        with db.snapshot() as conn:
            before = conn.execute("SELECT count(*) FROM t").fetchone()[0]
            first.set()
            assert committed.wait(20)
            return before, conn.execute("SELECT count(*) FROM t").fetchone()[0]

    r, r_out = run(reader)
    assert first.wait(20)
    with db.tx() as conn:
        conn.execute("INSERT INTO t (n) VALUES (2), (3)")
    committed.set()
    r.join(20)
    assert r_out == {"result": (1, 1)}
    assert db.execute("SELECT count(*) FROM t").fetchone()[0] == 3


def test_members_share_the_database_and_a_lone_holder_excludes_them(
    tmp_path: Path, pg_uri: str
) -> None:
    """Stores open the database as members of its fleet (a shared lock); a process that
    needs it alone (a migration) is refused while one is open, and refuses them."""
    first = Store.open(tmp_path / "a", database=pg_uri)
    try:
        with Store.open(tmp_path / "a", database=pg_uri) as second:  # (same directory)
            assert second.fleet is not None and first.fleet is not None
            assert second.fleet.node != first.fleet.node
        with pytest.raises(StoreLocked) as caught:
            PostgresDatabase(pg_uri, lock=True)
        assert "held by another alkfs process" in str(caught.value)
        assert PostgresDatabase(pg_uri, lock=False).close() is None  # (lock=False: a reader)
    finally:
        first.close()
    alone = PostgresDatabase(pg_uri, lock=True)
    try:
        with pytest.raises(StoreLocked, match="alone"):
            Store.open(tmp_path / "a", database=pg_uri)
    finally:
        alone.close()
    again = PostgresDatabase(pg_uri, lock=True)
    again.close()
    with Store.open(tmp_path / "a", database=pg_uri) as store:
        assert store.db.engine == "postgresql"


def test_stream_returns_every_row_in_order(db: PostgresDatabase) -> None:
    db.execute("INSERT INTO t (n) SELECT g FROM generate_series(1, 20000) AS g")
    rows = [n for (n,) in db.stream("SELECT n FROM t ORDER BY n", batch=1000)]
    assert rows == list(range(1, 20001))


# -- 3. the binding of a store directory to its database ------------------------------


def table_rows(uri: str) -> dict[str, int]:
    with psycopg.connect(uri, autocommit=True) as conn:
        names = [
            r[0]
            for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        ]
        return {n: conn.execute(f"SELECT count(*) FROM {n}").fetchone()[0] for n in names}


def test_a_postgresql_store_opened_without_its_database_is_refused(tmp_path, pg_uri) -> None:
    root = tmp_path / "s"
    Store.open(root, database=pg_uri).close()
    binding = (root / BINDING_NAME).read_text()
    with pytest.raises(Invalid) as caught:
        Store.open(root)
    assert pg_uri in str(caught.value) and "--database" in str(caught.value)
    assert not (root / DB_NAME).exists(), "no sqlite file made beside it"
    assert (root / BINDING_NAME).read_text() == binding


def test_a_sqlite_store_opened_with_a_database_is_refused(tmp_path, pg_uri) -> None:
    root = tmp_path / "s"
    with Store.open(root) as store:
        store.add(b"in the sqlite file")
    with pytest.raises(Invalid) as caught:
        Store.open(root, database=pg_uri)
    assert "migrate" in str(caught.value)
    assert table_rows(pg_uri) == {}, "nothing created in the database"
    assert not (root / BINDING_NAME).exists()
    with Store.open(root) as store:
        assert store.get(sha256_key(b"in the sqlite file")) == b"in the sqlite file"


def test_a_second_directory_on_a_database_holding_a_store_is_refused(tmp_path, pg_uri) -> None:
    with Store.open(tmp_path / "a", database=pg_uri) as store:
        store.add(b"a's object")
    before = table_rows(pg_uri)
    meta = pg_one(pg_uri, "SELECT string_agg(name || '=' || value, ',' ORDER BY name) FROM meta")
    with pytest.raises(Invalid) as caught:
        Store.open(tmp_path / "b", database=pg_uri)
    assert "is not its directory" in str(caught.value)
    assert table_rows(pg_uri) == before
    assert (
        pg_one(pg_uri, "SELECT string_agg(name || '=' || value, ',' ORDER BY name) FROM meta")
        == meta
    )
    assert not (tmp_path / "b" / BINDING_NAME).exists()
    assert not (tmp_path / "b" / DB_NAME).exists()


def test_a_directory_opened_with_another_database_is_refused(tmp_path, pg_uri, pg_server) -> None:
    root = tmp_path / "s"
    with Store.open(root, database=pg_uri) as store:
        store.add(b"kept in the first database")
    binding = (root / BINDING_NAME).read_text()
    other = pg_server.create_database()
    try:
        with pytest.raises(Invalid) as caught:
            Store.open(root, database=other)
        assert "was made in the database" in str(caught.value)
        assert pg_uri in str(caught.value) and other in str(caught.value)
        assert set(table_rows(other).values()) <= {0}, "no row written in the other database"
        assert (root / BINDING_NAME).read_text() == binding
        assert not (root / DB_NAME).exists()
    finally:
        pg_server.drop_database(other.split("/")[3].split("?")[0])
    with Store.open(root, database=pg_uri) as store:
        assert store.get(sha256_key(b"kept in the first database")) is not None


# -- 4. the schema version --------------------------------------------------------------


def test_a_postgresql_store_of_a_newer_schema_is_refused(tmp_path, pg_uri) -> None:
    root = tmp_path / "s"
    Store.open(root, database=pg_uri).close()
    assert pg_one(pg_uri, "SELECT value FROM meta WHERE name = 'schema_version'") == str(
        SCHEMA_VERSION
    )
    pg_one(pg_uri, "UPDATE meta SET value = '999' WHERE name = 'schema_version' RETURNING 1")
    with pytest.raises(StoreIO) as caught:
        Store.open(root, database=pg_uri)
    assert "schema version 999" in str(caught.value) and "newer alkfs" in str(caught.value)
    assert pg_one(pg_uri, "SELECT value FROM meta WHERE name = 'schema_version'") == "999"


def test_a_sqlite_store_of_a_newer_schema_is_refused(tmp_path) -> None:
    root = tmp_path / "s"
    Store.open(root).close()
    conn = sqlite3.connect(root / DB_NAME, isolation_level=None)
    try:
        conn.execute("UPDATE meta SET value = '999' WHERE name = 'schema_version'")
        assert conn.total_changes == 1
    finally:
        conn.close()
    with pytest.raises(StoreIO) as caught:
        Store.open(root)
    assert "schema version 999" in str(caught.value) and "newer alkfs" in str(caught.value)


# -- 5. a lost connection ---------------------------------------------------------------


def test_a_lost_server_is_store_io_and_the_store_recovers(tmp_path, pg_uri, pg_server) -> None:
    with Store.open(tmp_path / "s", mode="dual-tier", threshold=1024, database=pg_uri) as store:
        small = store.add(b"small before the outage")
        large = store.add(b"L" * 5000)
        pg_server.stop_now()
        try:
            for _attempt in range(2):
                t0 = time.monotonic()
                with pytest.raises(StoreIO) as caught:
                    store.get(small)
                assert time.monotonic() - t0 < 5, "fails fast, not after the pool's 10 s"
                assert "postgresql" in str(caught.value)
                assert not isinstance(caught.value, psycopg.Error)
            t0 = time.monotonic()
            with pytest.raises(StoreIO):
                store.add(b"written during the outage")
            assert time.monotonic() - t0 < 5
        finally:
            pg_server.start_again()
        t0 = time.monotonic()
        assert store.get(small) == b"small before the outage"
        assert time.monotonic() - t0 < 5, "the same store serves again at once"
        assert store.get(large) == b"L" * 5000
        after = store.add(b"small after the outage")
        assert store.get(after) == b"small after the outage"
        assert store.get(sha256_key(b"written during the outage")) is None
    with Store.open(tmp_path / "s", database=pg_uri) as store:
        assert store.get(after) == b"small after the outage"


def test_a_sweep_whose_connection_is_cut_aborts_and_the_next_completes(
    tmp_path, pg_uri, pg_server, monkeypatch
) -> None:
    import alkfs.gc.sweep

    monkeypatch.setattr(alkfs.gc.sweep, "DELETE_TX", 1)  # (a commit a deletion: cut between)
    with Store.open(tmp_path / "s", mode="kv-only", window_s=0, database=pg_uri) as store:
        keep = store.add(b"live")
        for i in range(5):
            store.add(f"garbage {i}".encode())
        register(store, [keep])
        assert store.kv.rows() == 6
        report = store.sweep()  # (stages the garbage; the next sweep deletes it)
        assert (report.aborted, report.candidates_staged, report.deleted) == (None, 5, 0)

        # The server goes away before the sweep.
        pg_server.stop_now()
        try:
            report = store.sweep()
        finally:
            pg_server.start_again()
        assert (report.aborted, report.deleted) == ("io-error", 0)
        assert store.kv.rows() == 6

        # ... and during one: after its first delete.
        deleted: list[bytes] = []

        def cut(key: bytes) -> None:
            deleted.append(key)
            if len(deleted) == 1:
                pg_server.stop_now()

        store.deleted_hooks.append(cut)
        try:
            report = store.sweep()
        finally:
            pg_server.start_again()
        assert (report.aborted, report.deleted) == ("io-error", 1)
        assert store.kv.rows() == 5, "nothing more deleted"

        # The next sweep completes; what the cut one had taken from the window is staged
        # again by it, and deleted by the one after.
        report = store.sweep()
        assert report.aborted is None
        done = report.deleted
        report = store.sweep()
        assert report.aborted is None
        assert done + report.deleted == 4
        assert store.kv.rows() == 1 and store.get(keep) == b"live"


# -- 6. passwords ----------------------------------------------------------------------

SECRET = "sekr3t-pw"


@pytest.fixture
def secret_uri(pg_server, pg_uri: str) -> str:
    """pg_uri as the role `alk` with a password (trust auth: the server does not check it)."""
    dbname = pg_uri.split("/")[3].split("?")[0]
    with psycopg.connect(pg_server.uri(), autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'alk'").fetchone() is None:
            conn.execute(f"CREATE ROLE alk LOGIN PASSWORD '{SECRET}'")
        conn.execute(f'ALTER DATABASE "{dbname}" OWNER TO alk')
    return pg_uri.replace("postgresql://postgres@", f"postgresql://alk:{SECRET}@")


def test_a_password_is_shown_nowhere(tmp_path, secret_uri, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="psycopg")
    root = tmp_path / "s"
    app = Alkfs.open(root, database=secret_uri)
    try:
        shown = app.store.db.describe()
        assert shown == secret_uri.replace(f":{SECRET}@", "@")
        assert SECRET not in (root / BINDING_NAME).read_text()
        assert json.loads((root / BINDING_NAME).read_text())["database"] == shown
        status = json.dumps(app.status())
        assert SECRET not in status and shown in status
        with pytest.raises(Invalid) as locked:  # (a directory that is not the store's)
            Store.open(tmp_path / "other", database=secret_uri)
        assert SECRET not in str(locked.value) and shown in str(locked.value)
    finally:
        app.close()
    wrong = secret_uri.replace("port=5432", "port=1")
    t0 = time.monotonic()
    with pytest.raises(StoreIO) as refused:
        Store.open(tmp_path / "third", database=wrong)
    assert time.monotonic() - t0 < 5, "a server that is not there fails at once"
    assert SECRET not in str(refused.value) and "No such file or directory" in str(refused.value)
    with pytest.raises(Invalid) as unbound:
        Store.open(root)
    assert SECRET not in str(unbound.value) and shown in str(unbound.value)
    with Store.open(root, database=secret_uri) as store:
        store.add(b"reopened with the password")
    assert caplog.records, "something was logged to look at"
    for record in caplog.records:
        assert SECRET not in record.getMessage()


@pytest.mark.parametrize(
    ("uri", "shown", "secret"),
    [
        ("postgresql://u:pw@h:5432/db", "postgresql://u@h:5432/db", True),
        ("postgres://u:p%40ss@h/db?sslmode=require", "postgres://u@h/db?sslmode=require", True),
        ("postgresql://u:p@ss@h/db", "postgresql://u@h/db", True),
        ("postgresql://:pw@h/db", "postgresql://@h/db", True),
        ("postgresql://u@h/db", "postgresql://u@h/db", False),
        ("postgresql:///db?host=/run/pg", "postgresql:///db?host=/run/pg", False),
        (
            "postgresql://h/db?user=u&password=pw",
            "postgresql://h/db?user=u&password=%2A%2A%2A",
            True,
        ),
        ("postgresql://h/db?sslpassword=pw", "postgresql://h/db?sslpassword=%2A%2A%2A", True),
        ("host=h dbname=db user=u password=pw", "host=h dbname=db user=u password=***", True),
        ("host=h password = 'a b\\' c' dbname=db", "host=h password = *** dbname=db", True),
        ("host=h dbname=db sslpassword=pw", "host=h dbname=db sslpassword=***", True),
        ("host=h dbname=db user=u", "host=h dbname=db user=u", False),
    ],
)
def test_redact_and_has_password(uri: str, shown: str, secret: bool) -> None:
    assert redact(uri) == shown
    assert has_password(uri) is secret
    for word in ("pw", "p%40ss", "ss@", "a b"):
        if secret and word in uri:
            assert word not in redact(uri)


def test_the_store_lock_survives_a_server_restart(tmp_path, pg_uri, pg_server) -> None:
    """The lock's session ends with the restart; the next statement takes it again."""
    with Store.open(tmp_path / "s", mode="kv-only", database=pg_uri) as store:
        pg_server.stop_now()
        pg_server.start_again()
        assert store.get(store.add(b"after the restart")) == b"after the restart"
        with pytest.raises(StoreLocked):
            PostgresDatabase(pg_uri, lock=True).close()


def test_a_store_whose_lock_was_taken_meanwhile_stops_using_the_database(
    tmp_path, pg_uri, pg_server
) -> None:
    with Store.open(tmp_path / "s", mode="kv-only", database=pg_uri) as store:
        key = store.add(b"before")
        pg_server.stop_now()
        pg_server.start_again()
        other = PostgresDatabase(pg_uri, lock=True)  # (first after the restart)
        try:
            with pytest.raises(StoreLocked, match="taken by another alkfs process"):
                store.get(key)
            with pytest.raises(StoreLocked):
                store.add(b"after")
        finally:
            other.close()
