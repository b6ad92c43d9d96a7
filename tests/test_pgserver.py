"""The throwaway PostgreSQL server of tests/pgserver.py and the fixtures pg_server and pg_uri."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from pgserver import PgServer, _kill_postmaster, _postmaster_pid


def test_answers_over_its_unix_socket_only(pg_server: PgServer, pg_uri: str) -> None:
    with psycopg.connect(pg_uri) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert conn.info.host == str(pg_server.base)
        assert conn.execute("SELECT inet_server_addr()").fetchone() == (None,)  # not TCP
        assert conn.execute("SHOW listen_addresses").fetchone() == ("",)
        assert conn.execute("SHOW fsync").fetchone() == ("off",)
        assert conn.execute("SHOW max_connections").fetchone() == ("200",)


def test_each_database_is_its_own(pg_server: PgServer, pg_uri: str) -> None:
    other = pg_server.create_database()
    try:
        assert other != pg_uri
        with psycopg.connect(pg_uri) as conn:
            conn.execute("CREATE TABLE only_here (v int)")
        with psycopg.connect(other) as conn:
            assert conn.execute("SELECT to_regclass('only_here')").fetchone() == (None,)
        with psycopg.connect(pg_uri) as conn:
            assert conn.execute("SELECT to_regclass('only_here')").fetchone() == ("only_here",)
    finally:
        pg_server.drop_database(str(psycopg.conninfo.conninfo_to_dict(other)["dbname"]))
    with pytest.raises(psycopg.OperationalError, match="does not exist"):
        psycopg.connect(other, connect_timeout=5)


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_stop_now_then_start_again_same_uri_same_data(
    pg_server: PgServer, pg_uri: str, mode: str
) -> None:
    with psycopg.connect(pg_uri, autocommit=True) as conn:
        # an immediate stop is a crash: only a synchronously committed row is sure to survive
        conn.execute("SET synchronous_commit = on")
        conn.execute("CREATE TABLE kept (v text)")
        conn.execute("INSERT INTO kept VALUES ('before')")
        pg_server.stop_now(mode)
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(pg_uri, connect_timeout=5)
    pg_server.start_again()
    with psycopg.connect(pg_uri) as conn:
        assert conn.execute("SELECT v FROM kept").fetchall() == [("before",)]


def test_terminate_cuts_the_other_connections_of_that_database(
    pg_server: PgServer, pg_uri: str
) -> None:
    victims = [psycopg.connect(pg_uri, autocommit=True) for _ in range(2)]
    bystander = psycopg.connect(pg_server.uri("postgres"), autocommit=True)
    try:
        assert pg_server.terminate(victims[0].info.dbname) == 2
        for victim in victims:
            with pytest.raises(psycopg.OperationalError):
                victim.execute("SELECT 1")
        assert bystander.execute("SELECT 1").fetchone() == (1,)
        with psycopg.connect(pg_uri) as conn:  # the database itself is fine
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        for c in (*victims, bystander):
            c.close()


START_AND_DIE = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from pgserver import PgServer
server = PgServer()
server.start()
print(server.base, flush=True)
if sys.argv[2] == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_a_dead_test_process_leaves_no_server(pg_server: PgServer, how: str) -> None:
    """The test process ends without cleanup(): by SIGKILL (the watchdog stops the server) or
    by a plain exit (atexit does)."""
    here = Path(__file__).parent
    proc = subprocess.run(
        [sys.executable, "-c", START_AND_DIE, str(here), how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == (-signal.SIGKILL if how == "sigkill" else 0), proc.stderr
    base = Path(proc.stdout.strip())
    assert base.name.startswith("alkfs-pg-"), proc.stdout
    deadline = time.monotonic() + 30
    try:
        while (_postmaster_pid(base / "data") is not None or base.exists()) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert _postmaster_pid(base / "data") is None
        assert not base.exists()
    finally:
        _kill_postmaster(base / "data")


def test_the_session_server_is_a_postmaster_of_its_own_data(pg_server: PgServer) -> None:
    pid = _postmaster_pid(pg_server.datadir)
    assert pid is not None and pid != os.getpid()
    with psycopg.connect(pg_server.uri()) as conn:
        assert conn.execute("SHOW data_directory").fetchone() == (str(pg_server.datadir),)
