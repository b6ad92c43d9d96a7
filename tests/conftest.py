"""Shared fixtures for every test level."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from pgserver import PgServer


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """One throwaway PostgreSQL server (tests/pgserver.py) for the whole session, started the
    first time a test asks for it, stopped and removed at session end. Without PostgreSQL
    binaries the test is skipped, except under CI (CI=true), where that is an error."""
    server = PgServer()
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def pg_uri(pg_server: PgServer) -> Iterator[str]:
    """The URI of a fresh, empty database on the session's server, dropped after the test (its
    connections cut first; a failed drop is ignored). A test that left the server stopped
    (stop_now without start_again) has it started again here, for the tests after it."""
    from psycopg.conninfo import conninfo_to_dict

    uri = pg_server.create_database()
    yield uri
    name = str(conninfo_to_dict(uri)["dbname"])
    with contextlib.suppress(Exception):
        pg_server.start_again()
        pg_server.terminate(name)
        pg_server.drop_database(name)
