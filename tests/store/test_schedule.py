"""The delete window over time and across restarts, and the direct delete."""

from __future__ import annotations

import time

import pytest

from alkfs.errors import Refused
from alkfs.keys import Key

from .conftest import Column, SetProtect, patterned, register

HOUR_NS = 3600 * 10**9


def test_a_candidate_waits_out_its_window_and_a_shorter_window_never_pulls_it_forward(
    column: Column,
) -> None:
    store = column.store
    register(store)
    key = store.add(patterned(column.big(3), 61))
    before = time.time_ns()
    staged = store.sweep(window_s=3600)
    after = time.time_ns()
    assert (staged.candidates_staged, staged.taken) == (1, 0)
    deadline = store.window.visible_after(key.raw)
    assert before + HOUR_NS <= deadline <= after + HOUR_NS

    for window_s in (3600, 0):
        report = store.sweep(window_s=window_s)
        assert (report.taken, report.candidates_staged, report.deleted) == (0, 0, 0)
        assert store.window.visible_after(key.raw) == deadline
    assert store.has(key)
    assert column.window_rows() == 1


def test_staged_candidates_survive_a_reopen_and_the_next_sweep_executes_them(
    sqlite_column: Column, tmp_path
) -> None:
    store = sqlite_column.store
    register(store)
    dead = [store.add(patterned(n, 59)) for n in (10, sqlite_column.big(1))]
    assert store.sweep().candidates_staged == 2
    store.close()

    col = sqlite_column.reopen()
    try:
        assert col.window_rows() == 2
        register(col.store)
        report = col.store.sweep()
        assert (report.taken, report.deleted, report.cancelled_by_arbitration) == (2, 2, 0)
        assert not any(col.store.has(k) for k in dead)
        assert col.media() == (0, 0)
    finally:
        col.store.close()


def test_a_direct_delete_refuses_what_is_protected_and_deletes_what_is_dead(
    column: Column,
) -> None:
    store = column.store
    source = register(store)
    protect = SetProtect()
    store.register_protect(protect)
    heard: list[bytes] = []
    store.deleted_hooks.append(heard.append)

    pinned = store.put(b"pinned")
    live = store.add(b"live")
    source.add(live)
    named = store.add(patterned(column.big(2), 53))
    protect.keys = [named]
    for key in (pinned.key, live, named):
        with pytest.raises(Refused) as caught:
            store.delete(key)
        assert type(caught.value) is Refused
        assert store.has(key)

    def broken() -> list[Key]:
        raise RuntimeError("cannot say")

    token = store.register_protect(broken)
    dead = store.add(b"dead")
    with pytest.raises(Refused):
        store.delete(dead)
    store.unregister(token)
    assert store.delete(dead) is True
    assert store.delete(dead) is False
    assert not store.has(dead)
    assert heard == [dead.raw]

    pinned.pin.release()
    assert store.delete(pinned.key) is True
    assert heard == [dead.raw, pinned.key.raw]


def test_every_swept_object_is_announced_to_the_deletion_hooks_once(column: Column) -> None:
    store = column.store
    register(store)
    heard: list[bytes] = []
    store.deleted_hooks.append(heard.append)
    store.deleted_hooks.insert(0, lambda key: 1 / 0)  # a failing hook never stops a sweep
    keys = sorted(store.add(patterned(n, 47)) for n in (5, column.threshold, column.big(4)))
    store.sweep()
    report = store.sweep()
    assert report.deleted == 3
    assert sorted(heard) == [k.raw for k in keys]
    assert store.last_sweep is report
