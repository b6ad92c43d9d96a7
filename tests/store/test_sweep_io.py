"""A sweep whose medium fails mid-way ends as report data, deletes nothing early, loses nothing."""

from __future__ import annotations

from pathlib import Path

from alkfs.store import Store

from .conftest import SetSource, oracle_connect, patterned


def test_a_sweep_meeting_a_locked_database_aborts_as_io_error_and_the_next_one_executes(
    tmp_path: Path,
) -> None:
    store = Store.open(tmp_path / "s", threshold=1024)
    try:
        store.register_source(SetSource())
        orphan = store.add(patterned(300, 211))
        staged = store.sweep(0)
        assert (staged.aborted, staged.candidates_staged, staged.deleted) == (None, 1, 0)

        blocker = oracle_connect(tmp_path / "s")
        blocker.execute("BEGIN EXCLUSIVE")  # another writer holds the file past busy_timeout
        try:
            failed = store.sweep(0)
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert failed.aborted == "io-error"
        assert (failed.deleted, failed.candidates_staged, failed.cancelled_by_arbitration) == (
            0,
            0,
            0,
        )
        assert store.get(orphan) == patterned(300, 211)
        assert store.last_sweep is failed

        executed = store.sweep(0)
        assert (executed.aborted, executed.taken, executed.deleted) == (None, 1, 1)
        assert not store.has(orphan)
    finally:
        store.close()
