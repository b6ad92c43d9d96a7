"""A freshen (touch) never reports success for an object a sweep is deleting."""

from __future__ import annotations

import threading

from alkfs.store import Store

from .conftest import patterned


def test_a_freshen_meeting_an_in_flight_delete_waits_and_reports_the_object_gone(
    tmp_path,
) -> None:
    store = Store.open(tmp_path / "s", threshold=1024)
    try:
        key = store.add(patterned(200, 173))
        assert store.arbiter.arbitrate(key) is True  # the delete marker is now held
        answer: list[bool] = []
        toucher = threading.Thread(target=lambda: answer.append(store.freshen(key)))
        toucher.start()
        toucher.join(0.5)  # time enough to answer wrongly, were it not waiting
        assert toucher.is_alive() and answer == []  # waiting for the delete to conclude
        assert store.engine_delete(key.raw) == 200
        store.arbiter.conclude(key)
        toucher.join(5)
        assert answer == [False]  # the caller learns it must write the object again
        assert not store.has(key)
    finally:
        store.close()


def test_a_freshen_of_a_present_object_succeeds_and_holds_no_pin_after(tmp_path) -> None:
    store = Store.open(tmp_path / "s", threshold=1024)
    try:
        key = store.add(patterned(200, 167))
        assert store.freshen(key) is True
        assert store.arbiter.pin_count(key) == 0
    finally:
        store.close()
