"""Durable named pins and the liveness they give."""

from __future__ import annotations

import threading

import pytest

from alkfs.app import Alkfs
from alkfs.errors import Exists, Invalid, Missing
from alkfs.git.importer import import_repo
from alkfs.git.objects import canonical
from alkfs.keys import Algorithm, Key

from .conftest import stored_keys
from .test_closure import WriteBlocker, _wait_pinned


def test_a_pin_names_one_object_and_is_listed(app):
    key = app.store.add(b"release\n")
    record = app.pins.pin("release-1", key)
    assert (record.name, record.key) == ("release-1", key)
    assert app.pins.get("release-1") == record
    assert app.pins.list() == [record]
    assert app.pins.names_for(key) == ["release-1"]
    assert app.pins.get("nope") is None


def test_pinning_the_same_object_again_is_idempotent(app):
    key = app.store.add(b"x")
    first = app.pins.pin("p", key)
    assert app.pins.pin("p", key) == first
    assert app.pins.list() == [first]


def test_a_name_used_by_another_object_is_refused(app):
    a, b = app.store.add(b"a"), app.store.add(b"b")
    app.pins.pin("p", a)
    with pytest.raises(Exists):
        app.pins.pin("p", b)
    assert app.pins.get("p").key == a


def test_pinning_an_absent_object_or_with_a_bad_name_is_refused(app):
    key = app.store.add(b"here")
    with pytest.raises(Missing):
        app.pins.pin("p", Key.derive(Algorithm.SHA256, b"absent"))
    for bad in ["", ".x", "a/b", "a b", "x" * 129, "-x"]:
        with pytest.raises(Invalid):
            app.pins.pin(bad, key)
    app.pins.pin("x" * 128, key)
    assert [p.name for p in app.pins.list()] == ["x" * 128]


def test_put_pinned_stores_and_pins_in_one_step_and_a_refusal_stores_nothing(app):
    small, large = b"a small file\n", bytes(range(256)) * 1024  # kv tier / large tier
    for name, data in (("small", small), ("large", large)):
        result, record = app.pins.put_pinned(name, data)
        assert result.key == Key.derive(Algorithm.SHA256, data)
        assert not result.pin.held  # given back once the pin row committed
        assert app.pins.get(name) == record and record.key == result.key
        assert app.store.get(result.key) == data
    again, _ = app.pins.put_pinned("small", small)  # the same object again: a no-op
    assert again.key == app.pins.get("small").key
    before = stored_keys(app)
    refused = b"not stored\n"
    with pytest.raises(Exists):
        app.pins.put_pinned("small", refused)
    with pytest.raises(Invalid):
        app.pins.put_pinned("a b", refused)
    assert stored_keys(app) == before
    assert not app.store.has(Key.derive(Algorithm.SHA256, refused))
    result, record = app.pins.put_pinned("small", refused, replace=True)
    assert app.pins.get("small").key == result.key
    report = app.store.sweep(0)
    report = app.store.sweep(0)
    assert app.store.get(result.key) == refused and app.store.get(again.key) is None
    assert report.deleted == 1


def test_one_object_may_carry_many_names(app):
    key = app.store.add(b"shared")
    app.pins.pin("b", key)
    app.pins.pin("a", key)
    assert app.pins.names_for(key) == ["a", "b"]


def test_unpin_and_rename(app):
    a, b = app.store.add(b"a"), app.store.add(b"b")
    app.pins.pin("one", a)
    app.pins.pin("two", b)
    app.pins.rename("one", "uno")
    assert [p.name for p in app.pins.list()] == ["two", "uno"]
    assert app.pins.get("uno").key == a
    with pytest.raises(Exists):
        app.pins.rename("uno", "two")
    with pytest.raises(Missing):
        app.pins.rename("gone", "x")
    with pytest.raises(Invalid):
        app.pins.rename("uno", "bad name")
    app.pins.unpin("uno")
    with pytest.raises(Missing):
        app.pins.unpin("uno")
    assert [p.name for p in app.pins.list()] == ["two"]


def test_a_replacing_pin_moves_the_name_in_one_step_only_from_the_object_it_names(app):
    a, b, c = app.store.add(b"a"), app.store.add(b"b"), app.store.add(b"c")
    app.pins.pin("p", a)
    with pytest.raises(Exists):
        app.pins.pin("p", b, replace=c)  # the name is on a, not on c: refused, unchanged
    assert app.pins.get("p").key == a
    counter = app.pins.write_counter
    assert app.pins.pin("p", b, replace=a).key == b
    assert app.pins.pin("p", c, replace=True).key == c
    assert [(r.name, r.key) for r in app.pins.list()] == [("p", c)]
    assert app.pins.write_counter == counter + 2


def test_a_replacing_rename_drops_the_target_in_the_same_step(app):
    a, b = app.store.add(b"a"), app.store.add(b"b")
    app.pins.pin("one", a)
    app.pins.pin("two", b)
    app.pins.rename("one", "two", replace=True)
    assert [(r.name, r.key) for r in app.pins.list()] == [("two", a)]
    app.pins.rename("two", "two", replace=True)  # onto itself: nothing changes
    assert [(r.name, r.key) for r in app.pins.list()] == [("two", a)]


def test_pins_survive_a_reopen(tmp_path, app):
    key = app.store.add(b"durable")
    record = app.pins.pin("keep", key)
    app.close()
    again = Alkfs.open(tmp_path / "store", window_s=0)
    try:
        assert again.pins.list() == [record]
        for _ in range(2):
            assert again.store.sweep(0).deleted == 0
        assert again.store.has(key)
    finally:
        again.close()


def test_a_pin_on_a_plain_object_keeps_that_object_only(app):
    kept = app.store.add(b"kept")
    dropped = app.store.add(b"dropped")
    assert app.store.has(dropped)
    app.pins.pin("kept", kept)
    assert app.store.sweep(0).candidates_staged == 1
    assert app.store.sweep(0).deleted == 1
    assert stored_keys(app) == {kept.raw}
    assert not app.store.has(dropped)


def test_a_pin_on_a_git_commit_keeps_its_whole_closure(app, make_repo):
    src = make_repo()
    src.write("a.txt", "a\n")
    c1 = src.commit("one")
    src.write("b.txt", "b\n")
    src.commit("two")
    import_repo(app, src.gitdir, "r", progress=False)
    app.pins.pin("old", Key.from_hex(Algorithm.GIT_SHA1, c1))
    app.refs.delete_repo("r")
    first, second = app.store.sweep(0), app.store.sweep(0)
    kept = src.rev_list_keys(c1)
    assert first.candidates_staged == len(src.all_object_keys() - kept)
    assert second.deleted == first.candidates_staged
    assert stored_keys(app) == kept
    assert app.pins.live_keys() == kept


def test_unpinning_makes_the_object_a_candidate(app):
    key = app.store.add(b"temporary")
    app.pins.pin("t", key)
    assert app.store.sweep(0).candidates_staged == 0
    app.pins.unpin("t")
    assert app.store.sweep(0).candidates_staged == 1
    assert app.store.sweep(0).deleted == 1
    assert not app.store.has(key)


def test_contains_is_live_when_cold_or_after_a_pin_write_and_exact_otherwise(app):
    a, b = app.store.add(b"a"), app.store.add(b"b")
    app.pins.pin("a", a)
    assert app.pins.contains(b.raw) is True
    app.pins.live_keys()
    assert (app.pins.contains(a.raw), app.pins.contains(b.raw)) == (True, False)
    app.pins.pin("b", b)
    assert app.pins.contains(b.raw) is True
    assert app.pins.builds == 1


def test_a_pin_write_straddling_a_mark_answers_live_never_dead(app):
    key = app.store.add(canonical("blob", b"pinned mid-mark\n"), Algorithm.GIT_SHA1)
    app.pins.live_keys()  # a built memo, so the answer is not merely cold
    blocker = WriteBlocker(app)
    done = threading.Event()
    writer = threading.Thread(target=lambda: (app.pins.pin("late", key), done.set()))
    writer.start()
    _wait_pinned(app, key, writer)  # in-process pin held, the row waits on the database lock
    assert app.pins.live_keys() == set()
    assert app.pins.write_counter == 0
    blocker.release()
    writer.join()
    assert done.is_set()
    assert app.store.arbiter.pin_count(key) == 0
    assert app.pins.write_counter == 1
    assert app.pins.contains(key.raw) is True


def test_pins_written_after_the_mark_keep_only_what_they_name_unless_git(app):
    """A sweep's arbitration after its mark (the memo): a dead object stays dead while
    other plain objects are pinned, unpinned and renamed (steady churn must not starve
    the sweep); the newly pinned object is live; a git object pinned since makes every
    candidate live (its closure would need a walk)."""
    dead = app.store.add(b"nobody keeps this")
    kept = app.store.add(b"pinned before the mark")
    app.pins.pin("before", kept)
    app.pins.live_keys()  # (what the sweep's mark computes)
    assert app.pins.contains(dead.raw) is False
    later = [app.store.add(f"pinned after the mark {i}".encode()) for i in range(50)]
    for i, key in enumerate(later):
        app.pins.pin(f"later-{i}", key)
    app.pins.rename("later-0", "renamed")
    app.pins.unpin("later-1")
    assert app.pins.contains(dead.raw) is False
    assert all(app.pins.contains(k.raw) for k in later)
    assert app.pins.contains(kept.raw) is True
    blob = app.store.add(canonical("blob", b"git\n"), algo=Algorithm.GIT_SHA1)
    app.pins.pin("a-git-object", blob)
    assert app.pins.contains(dead.raw) is True
    app.pins.live_keys()  # the next mark: exact again
    assert app.pins.contains(dead.raw) is False


# -- names found unpinned (Pins.misses) --------------------------------------------------
def test_a_name_found_unpinned_is_answered_again_until_any_pin_changes(app):
    pins, store = app.pins, app.store
    assert pins.misses.on  # (a sqlite store: this process makes every change; a fleet's is off)
    key = store.add(b"named later\n")
    other = store.add(b"another\n")
    assert pins.get("later") is None
    assert pins.misses.known("later")  # the next lookups of a new name cost no query
    pins.pin("unrelated", other)  # any change forgets every name
    assert not pins.misses.known("later")
    for change, expect in (
        (lambda: pins.pin("later", key), key),
        (lambda: pins.rename("later", "moved"), None),
        (lambda: pins.rename("moved", "later"), key),
        (lambda: pins.unpin("later"), None),
        (lambda: pins.put_pinned("later", b"named later\n"), key),
    ):
        pins.get("later")  # (a miss is recorded here whenever there is one)
        change()
        got = pins.get("later")
        assert (got.key if got else None) == expect


def test_a_miss_from_a_query_that_overlapped_a_change_is_not_kept(app):
    """The interleavings of a lookup in one thread and a pin change in another, made
    one at a time: the query's miss is recorded only if no change began or ended
    since the query began."""
    pins, store = app.pins, app.store
    misses = pins.misses
    key = store.add(b"overlapped\n")
    # the query began, then a whole change ran, then the query's (stale) miss came in
    epoch = misses.before_query()
    pins.pin("late", key)
    misses.missed("late", epoch)
    assert not misses.known("late") and pins.get("late") is not None
    # the query began while a change was under way (its commit not yet made)
    pins.unpin("late")
    with misses.changing():
        epoch = misses.before_query()
        misses.missed("late", epoch)
        assert not misses.known("late")
    misses.missed("late", epoch)  # (and after it ended: the epoch moved on)
    assert not misses.known("late")
    # no change in between: kept
    epoch = misses.before_query()
    misses.missed("late", epoch)
    assert misses.known("late") and pins.get("late") is None


def test_a_store_opened_beside_its_lock_holder_keeps_no_misses(app, tmp_path):
    """Another process (here: a second open without the lock) changes the pins of a
    store it does not hold: a name it found unpinned must be asked for again."""
    from alkfs.pins import Pins
    from alkfs.store import Store

    beside = Store.open(tmp_path / "store", lock=False)
    try:
        pins = Pins(beside)
        assert not pins.misses.on
        assert pins.get("later") is None
        app.pins.pin("later", app.store.add(b"pinned by the holder\n"))
        got = pins.get("later")
        assert got is not None and got.key == app.pins.get("later").key
    finally:
        beside.close()


def test_a_primed_filter_answers_names_never_pinned_without_a_query(app):
    """After `prime` (what a mount does at start), a name never pinned is known
    unpinned before any lookup of it; every name a change pins (a pin, a put, a
    rename's target) is asked for again; a change during the scan leaves no filter."""
    pins, store = app.pins, app.store
    key = store.add(b"primed\n")
    pins.pin("before", key)
    assert not pins.misses.known("fresh")  # (no filter yet: only a lookup's miss)
    assert pins.prime()
    assert pins.misses.known("fresh") and pins.get("fresh") is None
    assert not pins.misses.known("before") and pins.get("before").key == key
    pins.pin("pinned", key)
    pins.put_pinned("put", b"put after the prime\n")
    pins.rename("before", "renamed")
    for name in ("pinned", "put", "renamed"):
        assert not pins.misses.known(name)
        assert pins.get(name) is not None
    assert pins.get("before") is None  # (a maybe of the filter: the query says no)

    def scan_with_a_change() -> list[str]:
        names = [n for (n,) in pins.tables.read("SELECT name FROM pins")]
        pins.pin("during", key)  # lands after the scan read the names
        return names

    pins.misses.filter = None
    assert not pins.misses.prime(scan_with_a_change)
    assert pins.misses.filter is None and pins.get("during") is not None


def test_a_full_filter_is_dropped_and_lookups_query_again():
    from alkfs.pins import Misses, NameFilter

    misses = Misses(on=True)
    assert misses.prime(lambda: ["a", "b"])
    f = misses.filter
    assert f is not None and f.capacity == NameFilter.MIN_NAMES
    f.count = f.capacity  # (as if that many were added since)
    with misses.changing():
        misses.adding("c")
    assert misses.filter is None and not misses.known("c") and not misses.known("zz")
    assert not Misses(on=False).prime(lambda: [])


def test_a_name_added_again_is_not_counted_again():
    """(a re-pin or a replace of the same name must not fill the filter: it would be
    dropped, and every new name would cost a query again)"""
    from alkfs.pins import NameFilter

    f = NameFilter(0)
    assert f.add("report") and f.count == 1
    f.count = f.capacity  # full
    assert f.add("report")  # already in: still True, still full, not dropped
    assert f.count == f.capacity
    assert not f.add("another") and not f.maybe("another")


def test_adding_many_names_counts_each_new_name_once_and_stops_when_full():
    from alkfs.pins import NameFilter

    names = [f"n{i}" for i in range(500)] + ["n1", "n2"]  # (two added again)
    f = NameFilter(0)
    assert f.add_many(names)
    assert f.count == 500 and all(f.maybe(n) for n in names)
    assert sum(bin(b).count("1") for b in f.bits) <= 500 * NameFilter.SPOTS
    full = NameFilter(0)
    full.count = full.capacity - 1  # room for one more name
    assert not full.add_many(["first", "second"])
    assert full.maybe("first") and not full.maybe("second")
    assert full.count == full.capacity


def test_a_store_of_more_pins_than_prime_max_loads_no_filter(app, monkeypatch):
    import alkfs.pins as pins_mod

    pins = app.pins
    pins.pin("one", app.store.add(b"one\n"))
    pins.pin("two", app.store.add(b"two\n"))
    monkeypatch.setattr(pins_mod, "PRIME_MAX", 1)
    assert not pins.prime() and pins.misses.filter is None
    monkeypatch.setattr(pins_mod, "PRIME_MAX", 2)
    assert pins.prime() and pins.misses.filter is not None
