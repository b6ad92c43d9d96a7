"""The library's write-behind of small puts (alkfs/writebehind.py): acknowledged once
logged, applied many at a time from a worker thread, replayed at the next open."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from alkfs.app import Alkfs
from alkfs.intents import LOG_NAME
from alkfs.keys import Algorithm, Key

pytestmark = pytest.mark.skipif(
    os.environ.get("ALKFS_TEST_DATABASE", "") == "postgresql",
    reason="the write-behind is a sqlite store's (a PostgreSQL store commits each put)",
)


def opened(tmp_path: Path) -> Alkfs:
    """A store whose reserve looked at the disk (its first put does: that one is never
    written behind)."""
    a = Alkfs.open(tmp_path / "store", window_s=0)
    a.store.put(b"warm-up")
    return a


@pytest.fixture
def app(tmp_path: Path):
    a = opened(tmp_path)
    yield a
    a.close()


def test_a_put_is_logged_then_applied_from_a_worker_thread(app):
    behind = app.start_behind()
    assert behind is not None and app.start_behind() is behind
    data = b"written behind\n" * 10
    result = behind.put("a.txt", Algorithm.SHA256, data, None)
    assert result is not None and result.key == Key.derive(Algorithm.SHA256, data)
    assert behind.count == 1 and behind.pending_name(b"a.txt")
    assert behind.pending_hex(result.key.hex.encode())
    assert app.pins.get("a.txt") is None  # (not in the database yet)
    done: list[bool] = []
    t = threading.Thread(target=lambda: done.append(behind.apply()))
    t.start()
    t.join()
    assert done == [True] and behind.count == 0 and not behind.pending_name(b"a.txt")
    assert app.pins.get("a.txt").key == result.key
    assert app.store.get(result.key) == data
    assert (app.store.path / LOG_NAME).stat().st_size == 0
    assert behind.status() == {"pending": 0, "applied": 1, "log_bytes": 0}


def test_content_it_does_not_take_is_declined(app):
    behind = app.start_behind()
    assert behind is not None
    assert behind.put(None, Algorithm.GIT_SHA1, b"blob", None) is None  # (a git algorithm)
    wrong = Key.derive(Algorithm.SHA256, b"other")
    assert behind.put(None, Algorithm.SHA256, b"content", wrong) is None
    behind.held += 1  # (a drain under way)
    assert behind.put(None, Algorithm.SHA256, b"content", None) is None
    behind.held -= 1
    assert behind.count == 0


def test_what_a_process_left_pending_is_applied_at_the_next_open(tmp_path):
    a = opened(tmp_path)
    behind = a.start_behind()
    assert behind is not None
    data = b"left in the log\n"
    result = behind.put("left.txt", Algorithm.BLAKE3, data, None)
    assert result is not None
    assert behind.log is not None
    behind.log.close()  # (the process dies: nothing applied, the log stays)
    behind.log = None
    a.behind = None
    a.close()
    again = Alkfs.open(tmp_path / "store", window_s=0)
    try:
        assert again.pins.get("left.txt").key == result.key
        assert again.store.get(result.key) == data
        assert (tmp_path / "store" / LOG_NAME).stat().st_size == 0
    finally:
        again.close()


def test_close_applies_what_is_left(tmp_path):
    a = opened(tmp_path)
    behind = a.start_behind()
    assert behind is not None
    result = behind.put(None, Algorithm.SHA256, b"closed behind", None)
    assert result is not None
    a.close()
    again = Alkfs.open(tmp_path / "store", window_s=0)
    try:
        assert again.store.get(result.key) == b"closed behind"
    finally:
        again.close()
