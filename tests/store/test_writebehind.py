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
from alkfs.pins import FileAttrs, intent_name

FILE = FileAttrs(0o100644, 1_700_000_000_000_000_000, 13)

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
    assert behind.count == 1 and behind.pinned("a.txt") is not None
    assert behind.read(result.key.raw) == data and behind.stat(result.key.raw)[0] == len(data)
    assert app.store.kv.read(result.key.raw) is None  # (not in the database yet)
    done: list[bool] = []
    t = threading.Thread(target=lambda: done.append(behind.apply()))
    t.start()
    t.join()
    assert done == [True] and behind.count == 0 and behind.pinned("a.txt") is None
    assert behind.read(result.key.raw) is None  # (the index holds what is pending only)
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


def in_thread(fn):
    """`fn()` run in another thread (as a daemon's worker runs library calls)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_a_pending_object_is_read_through_the_store_before_its_apply(app):
    behind = app.start_behind()
    assert behind is not None
    data = b"read your writes\n" * 3
    result = behind.put(None, Algorithm.SHA256, data, None)
    assert result is not None
    key = result.key
    assert app.store.kv.read(key.raw) is None  # (not in the database)
    st = in_thread(lambda: app.store.stat(key))
    assert st is not None and st.size == len(data) and st.tier == "kv"
    assert in_thread(lambda: app.store.get(key)) == data
    assert app.store.has(key) and app.store.has_raw(key.raw)
    assert app.store.read_range(key, 5, 4)[0] == data[5:9]
    assert [s.key for s in app.store.list(algo=Algorithm.SHA256)].count(key) == 1
    assert behind.count == 1  # (reading applied nothing)


def test_a_pending_pin_is_found_and_listed_and_a_change_of_it_applies_it_first(app):
    behind = app.start_behind()
    assert behind is not None
    app.pins.mkdir("d", 0o755)
    app.pins.pin("d/old", app.store.put(b"pinned before").key, tree=True)
    a = behind.put(intent_name("d/new", FILE), Algorithm.SHA256, b"pinned behind", None)
    assert a is not None and behind.count == 1
    found = in_thread(lambda: app.pins.entry("d/new"))
    assert found is not None and found.key == a.key and found.attrs == FILE
    assert app.pins.get("d/new") == found
    assert [e.name for e in app.pins.children("d/")] == ["d/new", "d/old"]
    assert [e.name for e in app.pins.children("d/", after="d/new")] == ["d/old"]
    assert app.pins.has_below("d/") and "d/new" in [r.name for r in app.pins.list()]
    assert app.pins.names_for(a.key) == ["d/new"]
    assert behind.count == 1
    assert behind.apply() and app.pins.get("d/new") == found  # (its row as it was shown)
    b = behind.put(intent_name("d/newer", FILE), Algorithm.SHA256, b"behind again", None)
    assert b is not None and behind.count == 1
    in_thread(lambda: app.pins.unpin("d/newer"))  # (applied first, then unpinned)
    assert behind.count == 0 and app.pins.get("d/newer") is None
    assert app.store.get(b.key) == b"behind again"


def test_a_sweep_applies_what_is_pending_before_its_mark(app):
    behind = app.start_behind()
    assert behind is not None
    result = behind.put("kept", Algorithm.SHA256, b"kept by its pending pin", None)
    assert result is not None
    for _ in range(2):
        in_thread(lambda: app.store.sweep(0))
    assert behind.count == 0
    assert app.store.get(result.key) == b"kept by its pending pin"
    assert app.pins.get("kept").key == result.key
