"""Shared fixtures for every test level."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import pytest
from pgserver import PgServer

# ALKFS_TEST_DATABASE=postgresql: the suites that exercise the store (the daemon mounts, the
# CLI on --store) keep every store's database in PostgreSQL (the `store_database` fixture)
ON_POSTGRES = os.environ.get("ALKFS_TEST_DATABASE", "") == "postgresql"

# A retired pack generation's grace is 300 s in a daemon (daemon/packs.py); the tests that
# wait for one to go get 2 s unless they set their own (tests/daemon/test_packs_retired.py)
os.environ.setdefault("ALKFS_PACK_RETIRE_GRACE", "2")


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


@pytest.fixture
def store_database(request: pytest.FixtureRequest) -> Iterator[Callable[..., str | None]]:
    """`store_database(store) -> URI | None`: the database a test should give a store. None
    (its sqlite file) normally; under ALKFS_TEST_DATABASE=postgresql a fresh database on the
    session's server, one per STORE directory (the same URI every time the same directory is
    asked for in a test: several mounts, a restart, the CLI and the library all meet it),
    dropped after the test. Fixtures that start processes on a store depend on this one, so
    they are stopped before the databases are dropped."""
    if not ON_POSTGRES:
        yield lambda store: None
        return
    from psycopg.conninfo import conninfo_to_dict

    server: PgServer = request.getfixturevalue("pg_server")
    uris: dict[str, str] = {}

    def database_for(store: str | os.PathLike[str]) -> str:
        where = os.path.realpath(store)
        if where not in uris:
            uris[where] = server.create_database()
        return uris[where]

    yield database_for
    for uri in uris.values():
        name = str(conninfo_to_dict(uri)["dbname"])
        with contextlib.suppress(Exception):
            server.start_again()
            server.terminate(name)
            server.drop_database(name)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "sqlite_file: inspects the store's sqlite file; skipped under ALKFS_TEST_DATABASE=postgresql",
    )
    config.addinivalue_line(
        "markers",
        "not_on_postgres(reason): a premise only a sqlite store has (its exclusive lock, its "
        "single daemon's STORE/scratch); skipped under ALKFS_TEST_DATABASE=postgresql",
    )
    config.addinivalue_line(
        "markers",
        "postgres_bug(reason): a product bug on PostgreSQL; xfail(strict) under "
        "ALKFS_TEST_DATABASE=postgresql only",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not ON_POSTGRES:
        return
    for item in items:
        if item.get_closest_marker("sqlite_file") is not None:
            item.add_marker(pytest.mark.skip(reason="inspects the sqlite file"))
        sqlite_only = item.get_closest_marker("not_on_postgres")
        if sqlite_only is not None:
            reason = sqlite_only.args[0] if sqlite_only.args else sqlite_only.kwargs["reason"]
            item.add_marker(pytest.mark.skip(reason=reason))
        bug = item.get_closest_marker("postgres_bug")
        if bug is not None:
            reason = bug.args[0] if bug.args else bug.kwargs.get("reason", "")
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"PostgreSQL: {reason}"))
