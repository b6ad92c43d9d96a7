"""Durable named pins and the liveness they give."""

from __future__ import annotations

import stat
import threading

import pytest

from alkfs.app import Alkfs
from alkfs.errors import Exists, Invalid, Missing, NotEmpty
from alkfs.git.importer import import_repo
from alkfs.git.objects import canonical
from alkfs.keys import Algorithm, Key
from alkfs.pins import (
    FileAttrs,
    PinDir,
    TooLong,
    from_intent,
    intent_name,
    path_bytes,
    path_ok,
    path_text,
)
from alkfs.schema import SCHEMA_VERSION

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
    import alkfs.pins.durable as pins_mod  # (where `Pins.prime` reads PRIME_MAX)

    pins = app.pins
    pins.pin("one", app.store.add(b"one\n"))
    pins.pin("two", app.store.add(b"two\n"))
    monkeypatch.setattr(pins_mod, "PRIME_MAX", 1)
    assert not pins.prime() and pins.misses.filter is None
    monkeypatch.setattr(pins_mod, "PRIME_MAX", 2)
    assert pins.prime() and pins.misses.filter is not None


# -- the tree of /pins ---------------------------------------------------------------------

FILE = FileAttrs(stat.S_IFREG | 0o640, 1_234_567_890_123_456_789, 5)


def test_a_path_in_pins_is_any_file_name_and_its_bytes_map_to_text_one_to_one():
    for raw in [
        b"My File.pdf",
        b".bashrc",
        b".x.ABCDEF",
        "caf\u00e9".encode(),
        b"latin-1 \xe9t\xe9",  # (not UTF-8)
        "\uf780 escapes themselves".encode(),
        b"\xef\x9e\x80",
        b"a/b/c",
    ]:
        text = path_text(raw)
        assert path_bytes(text) == raw and path_ok(text), raw
    assert path_text(b"\xe9") != path_text("\uf7e9".encode())  # (no two paths share a name)
    assert path_ok("x" * 255) and not path_ok("x" * 256)
    deep = "ab/" + "/".join(["d" * 255] * 15) + "/"  # 3 + 15 * 256 = 3,843 bytes
    assert path_ok(deep + "e" * 253) and not path_ok(deep + "e" * 254)  # 4,096 and 4,097
    for bad in ["", "/a", "a/", "a//b", ".", "..", "a/./b", "a/../b", "nul\0"]:
        assert not path_ok(bad), bad


def test_pins_in_directories_list_a_directory_at_a_time_and_move_with_it(app):
    pins = app.pins
    pins.mkdir("b", 0o755)
    pins.mkdir("b/sub", 0o700)
    names = ["b/.bashrc", "b/My File.pdf", "b/sub/x", "b/sub/y", "b/z", "top"]
    for name in names:
        _, rec = pins.put_pinned(name, name.encode(), attrs=FILE, tree=True)
        assert rec.attrs == FILE and rec.mode == FILE.mode
    with pytest.raises(Invalid):
        pins.pin("b/x", app.store.add(b"x"))  # (the xattr form and the CLI: the narrow names)
    with pytest.raises(Missing):
        pins.put_pinned("nowhere/x", b"x", tree=True)  # (its directory must exist)
    with pytest.raises(Exists):
        pins.mkdir("b/z", 0o755)
    assert [e.name for e in pins.children("")] == ["b", "top"]
    assert [e.name for e in pins.children("b/")] == ["b/.bashrc", "b/My File.pdf", "b/sub", "b/z"]
    # a page at a time, resuming after a name (a directory's own entries are skipped)
    assert [e.name for e in pins.children("b/", "b/My File.pdf", 1)] == ["b/sub"]
    assert [e.name for e in pins.children("b/", "b/sub", 5)] == ["b/z"]
    sub = pins.entry("b/sub")
    assert isinstance(sub, PinDir) and stat.S_IMODE(sub.mode) == 0o700
    assert pins.get("b/sub") is None  # (a directory is no pin)
    assert len(pins) == len(names) and [r.name for r in pins.list()] == sorted(names)

    moved = pins.move("b", "c d")
    assert isinstance(moved, PinDir) and moved.created_ns == pins.entry("c d").created_ns
    assert pins.entry("b") is None and pins.entry("b/sub/x") is None
    assert [e.name for e in pins.children("c d/sub/")] == ["c d/sub/x", "c d/sub/y"]
    assert pins.get("c d/sub/x").attrs == FILE
    with pytest.raises(Invalid):
        pins.move("c d", "c d/sub/into-itself")
    with pytest.raises(NotEmpty):
        pins.rmdir("c d/sub")
    for name in ("c d/sub/x", "c d/sub/y"):
        pins.unpin(name)
    pins.rmdir("c d/sub")
    assert [e.name for e in pins.children("c d/")] == ["c d/.bashrc", "c d/My File.pdf", "c d/z"]
    with pytest.raises(Missing):
        pins.unpin("c d")  # (a directory is removed with rmdir)


def test_a_move_that_would_make_a_path_too_long_is_refused_and_changes_nothing(app):
    pins = app.pins
    parts = ["a"] + ["d" * 255] * 15  # "a/ddd.../ddd": 1 + 15 * 256 = 3,841 bytes
    for i in range(1, len(parts) + 1):
        pins.mkdir("/".join(parts[:i]), 0o755)
    leaf = "/".join(parts) + "/" + "f" * 250  # 4,092 bytes
    pins.put_pinned(leaf, b"deep", attrs=FILE, tree=True)
    with pytest.raises(TooLong):
        pins.put_pinned("/".join(parts) + "/" + "g" * 255, b"x", tree=True)  # 4,097
    with pytest.raises(TooLong):
        pins.move("a", "a12345")  # (5 bytes more below it: 4,097)
    assert pins.get(leaf) is not None and pins.entry("a12345") is None
    pins.move("a", "a1234")  # (4,096: fits)
    assert pins.get("a1234" + leaf[1:]).key == Key.derive(Algorithm.SHA256, b"deep")


def test_attributes_of_files_and_directories_change_and_links_have_none(app):
    pins = app.pins
    pins.mkdir("d", 0o755, mtime_ns=7)
    _, rec = pins.put_pinned("d/f", b"hello", attrs=FILE, tree=True)
    got = pins.set_attrs("d/f", rec.created_ns, 0o600, 42)
    assert (got.mode, got.mtime_ns) == (stat.S_IFREG | 0o600, 42) and pins.get("d/f") == got
    d = pins.entry("d")
    assert pins.set_attrs("d", d.created_ns, 0o700) == PinDir(
        "d", d.created_ns, stat.S_IFDIR | 0o700, 7
    )
    link = pins.pin("link", app.store.add(b"linked"))
    with pytest.raises(Missing):
        pins.set_attrs("link", link.created_ns, 0o600)
    with pytest.raises(Missing):
        pins.set_attrs("d/f", rec.created_ns + 1, 0o600)  # (another row of that name)
    # the same object written again under its name takes the attributes given
    again, _ = pins.put_pinned("d/f", b"hello", attrs=FILE, tree=True)
    assert pins.get("d/f").attrs == FILE and pins.get("d/f").created_ns == rec.created_ns


def test_an_intent_of_a_file_in_pins_carries_its_attributes():
    name = intent_name("a/My File.pdf", FILE)
    assert "\0" in name and from_intent(name, FILE.size) == ("a/My File.pdf", FILE)
    assert from_intent("plain", 3) == ("plain", None)


OWNED = FileAttrs(stat.S_IFREG | 0o640, 1_234_567_890_123_456_789, 5, 1234, 5678)


def test_owners_are_set_at_creation_kept_by_renames_and_changed_by_set_attrs(tmp_path, app):
    """The owner and group (None: the mount's owner's) travel with the row: set when the
    file or directory is made, kept by a rename of it or of a directory above it, by
    `ln`'s pin of the same attributes and across a reopen, changed by `set_attrs`."""
    pins = app.pins
    made = pins.mkdir("d", 0o750, mtime_ns=7, uid=1234, gid=5678)
    assert (made.uid, made.gid) == (1234, 5678) and pins.entry("d") == made
    pins.mkdir("d/sub", 0o755)
    assert (pins.entry("d/sub").uid, pins.entry("d/sub").gid) == (None, None)
    _, rec = pins.put_pinned("d/sub/f", b"hello", attrs=OWNED, tree=True)
    assert (rec.uid, rec.gid) == (1234, 5678) and pins.get("d/sub/f").attrs == OWNED
    _, plain = pins.put_pinned("d/plain", b"plain", attrs=FILE, tree=True)
    assert (plain.uid, plain.gid) == (None, None)
    pins.pin("d/again", rec.key, attrs=pins.get("d/sub/f").attrs, tree=True)  # (`ln`)
    assert pins.get("d/again").attrs == OWNED

    moved = pins.move("d/sub/f", "d/g")  # a pin
    assert (moved.uid, moved.gid) == (1234, 5678) and pins.get("d/g") == moved
    pins.move("d", "e")  # a directory, with everything below it
    assert (pins.entry("e").uid, pins.entry("e").gid) == (1234, 5678)
    assert pins.get("e/g").attrs == OWNED and pins.entry("e/sub").uid is None
    assert [(r.name, r.uid, r.gid) for r in pins.list()] == [
        ("e/again", 1234, 5678),
        ("e/g", 1234, 5678),
        ("e/plain", None, None),
    ]

    got = pins.set_attrs("e/g", rec.created_ns, gid=65534)  # a group alone
    assert (got.uid, got.gid, got.mode) == (1234, 65534, OWNED.mode) and pins.get("e/g") == got
    got = pins.set_attrs("e/plain", plain.created_ns, mtime_ns=9, uid=0, gid=0)
    assert (got.uid, got.gid, got.mtime_ns) == (0, 0, 9) and pins.get("e/plain") == got
    e = pins.entry("e")
    assert pins.set_attrs("e", e.created_ns, uid=65534) == PinDir(
        "e", e.created_ns, stat.S_IFDIR | 0o750, 7, 65534, 5678
    )
    # the same object written again under its name takes the owner given
    pins.put_pinned("e/g", b"hello", attrs=FILE, tree=True)
    assert (pins.get("e/g").uid, pins.get("e/g").gid) == (None, None)
    pins.put_pinned("e/g", b"hello", attrs=OWNED, tree=True)
    assert pins.get("e/g").attrs == OWNED
    app.close()
    with Alkfs.open(tmp_path / "store") as again:
        assert again.pins.get("e/g").attrs == OWNED
        assert (again.pins.entry("e").uid, again.pins.entry("e").gid) == (65534, 5678)
        assert again.pins.get("e/plain").uid == 0


def test_an_intent_carries_the_owner_and_one_of_the_form_before_owners_still_parses():
    """A file given an owner logs it in its intent's name; an intent logged before (three
    fields: pending in a log when alkfs was upgraded) is read as it was."""
    name = intent_name("a/My File.pdf", OWNED)
    assert name.count("\0") == 4 and from_intent(name, OWNED.size) == ("a/My File.pdf", OWNED)
    group_only = FileAttrs(FILE.mode, FILE.mtime_ns, FILE.size, None, 5678)
    assert from_intent(intent_name("g", group_only), FILE.size) == ("g", group_only)
    old = f"a/My File.pdf\0{FILE.mode}\0{FILE.mtime_ns}"  # (as an older daemon logged it)
    assert intent_name("a/My File.pdf", FILE) == old
    assert from_intent(old, FILE.size) == ("a/My File.pdf", FILE)
    assert (FILE.uid, FILE.gid) == (None, None)


def test_intents_applied_many_at_a_time_keep_the_owner(app):
    data = b"hello"
    key = Key.derive(Algorithm.SHA256, data)
    app.pins.mkdir("d", 0o755)
    app.pins.put_pinned_many(
        [
            (intent_name("d/owned", OWNED), key, data),
            (f"d/old\0{FILE.mode}\0{FILE.mtime_ns}", key, data),
        ]
    )
    assert app.pins.get("d/owned").attrs == OWNED
    assert app.pins.get("d/old").attrs == FILE


def test_pins_in_directories_keep_their_objects_across_a_reopen_and_sweeps(tmp_path, app):
    pins = app.pins
    pins.mkdir(".hidden dir", 0o755)
    keys = {}
    for name in [".hidden dir/.profile.backup", ".x.ABCDEF", "with space"]:
        result, _ = pins.put_pinned(name, name.encode(), attrs=FILE, tree=True)
        keys[name] = result.key
    gone, _ = pins.put_pinned("gone", b"unpinned later", attrs=FILE, tree=True)
    pins.unpin("gone")
    app.close()
    again = Alkfs.open(tmp_path / "store", window_s=0)
    try:
        assert again.store.sweep(0).candidates_staged == 1
        assert again.store.sweep(0).deleted == 1
        for name, key in keys.items():
            assert again.pins.get(name).key == key and again.store.get(key) == name.encode()
        assert not again.store.has(gone.key)
    finally:
        again.close()


def test_a_store_made_before_the_pins_had_attributes_is_migrated(tmp_path):
    """A store of schema version 1 (the pins table without mode, mtime_ns and size) opens,
    gets the columns, and keeps its pins."""
    import sqlite3 as stdlib_sqlite3

    root = tmp_path / "old"
    with Alkfs.open(root) as app:
        key = app.store.add(b"old pin")
        app.pins.pin("old", key)
    conn = stdlib_sqlite3.connect(root / "store.db", isolation_level=None)
    try:  # (as version 1 left it)
        for column in ("mode", "mtime_ns", "size", "uid", "gid"):
            conn.execute(f"ALTER TABLE pins DROP COLUMN {column}")
        conn.execute("UPDATE meta SET value = '1' WHERE name = 'schema_version'")
    finally:
        conn.close()
    with Alkfs.open(root) as app:
        assert [(r.name, r.key, r.mode) for r in app.pins.list()] == [("old", key, None)]
        app.pins.mkdir("dir", 0o755)
        app.pins.put_pinned("dir/f", b"new", attrs=FILE, tree=True)
        assert app.pins.get("dir/f").attrs == FILE
        version = app.store.db.execute(
            "SELECT value FROM meta WHERE name = 'schema_version'"
        ).fetchone()[0]
        assert version == str(SCHEMA_VERSION) == "3"


def test_a_postgresql_store_made_before_the_pins_had_attributes_is_migrated(tmp_path, pg_uri):
    import psycopg

    root = tmp_path / "old"
    with Alkfs.open(root, database=pg_uri) as app:
        key = app.store.add(b"old pin")
        app.pins.pin("old", key)
    with psycopg.connect(pg_uri, autocommit=True) as pg:  # (as version 1 left it)
        pg.execute(
            "ALTER TABLE pins DROP COLUMN mode, DROP COLUMN mtime_ns, DROP COLUMN size,"
            " DROP COLUMN uid, DROP COLUMN gid"
        )
        pg.execute("UPDATE meta SET value = '1' WHERE name = 'schema_version'")
    with Alkfs.open(root, database=pg_uri) as app:
        assert [(r.name, r.key, r.mode) for r in app.pins.list()] == [("old", key, None)]
        app.pins.mkdir("dir", 0o755)
        app.pins.put_pinned("dir/f", b"new", attrs=FILE, tree=True)
        assert app.pins.get("dir/f").attrs == FILE
        assert [e.name for e in app.pins.children("")] == ["dir", "old"]


def _as_version_2_left_it_sqlite(root) -> None:
    import sqlite3 as stdlib_sqlite3

    conn = stdlib_sqlite3.connect(root / "store.db", isolation_level=None)
    try:
        for column in ("uid", "gid"):
            conn.execute(f"ALTER TABLE pins DROP COLUMN {column}")
        conn.execute("UPDATE meta SET value = '2' WHERE name = 'schema_version'")
    finally:
        conn.close()


def _a_version_2_tree(app) -> tuple[Key, int]:
    """A store's pins as version 2 kept them: a link, a directory and a file in it."""
    key = app.store.add(b"old pin")
    app.pins.pin("old", key)
    app.pins.mkdir("dir", 0o750, mtime_ns=7)
    _, rec = app.pins.put_pinned("dir/f", b"old file", attrs=FILE, tree=True)
    return key, rec.created_ns


def _check_migrated_to_3(app, key: Key, created_ns: int) -> None:
    pins = app.pins
    assert [(r.key, r.mode, r.uid) for r in pins.list() if r.name == "old"] == [(key, None, None)]
    assert pins.get("dir/f").attrs == FILE  # (no owner: the mount's, as shown before)
    d = pins.entry("dir")
    assert (d.mode, d.mtime_ns, d.uid, d.gid) == (stat.S_IFDIR | 0o750, 7, None, None)
    got = pins.set_attrs("dir/f", created_ns, uid=1234, gid=5678)
    assert pins.get("dir/f") == got and (got.uid, got.gid) == (1234, 5678)
    pins.put_pinned("dir/new", b"new", attrs=OWNED, tree=True)
    assert pins.get("dir/new").attrs == OWNED
    pins.move("dir", "moved")
    assert pins.get("moved/f").uid == 1234 and pins.get("moved/new").attrs == OWNED


def test_a_store_made_before_the_pins_had_owners_is_migrated(tmp_path):
    """A store of schema version 2 (the pins table without uid and gid) opens, gets the
    columns (NULL: the mount's owner) and keeps its pins and their attributes."""
    root = tmp_path / "old"
    with Alkfs.open(root) as app:
        key, created_ns = _a_version_2_tree(app)
    _as_version_2_left_it_sqlite(root)
    with Alkfs.open(root) as app:
        _check_migrated_to_3(app, key, created_ns)
        version = app.store.db.execute(
            "SELECT value FROM meta WHERE name = 'schema_version'"
        ).fetchone()[0]
        assert version == str(SCHEMA_VERSION) == "3"
    with Alkfs.open(root) as app:  # (and opens again as it is: nothing to migrate)
        assert app.pins.get("moved/new").attrs == OWNED


def test_a_postgresql_store_made_before_the_pins_had_owners_is_migrated(tmp_path, pg_uri):
    import psycopg

    root = tmp_path / "old"
    with Alkfs.open(root, database=pg_uri) as app:
        key, created_ns = _a_version_2_tree(app)
    with psycopg.connect(pg_uri, autocommit=True) as pg:  # (as version 2 left it)
        pg.execute("ALTER TABLE pins DROP COLUMN uid, DROP COLUMN gid")
        pg.execute("UPDATE meta SET value = '2' WHERE name = 'schema_version'")
    with Alkfs.open(root, database=pg_uri) as app:
        _check_migrated_to_3(app, key, created_ns)
    with psycopg.connect(pg_uri, autocommit=True) as pg:
        version = pg.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
        assert version == ("3",)


def test_a_postgresql_store_made_before_the_pins_had_owners_moves_back_to_sqlite(tmp_path, pg_uri):
    """`alkfs migrate` back to sqlite of a version 2 store no open has brought up to date:
    the store is migrated first, and its rows are copied whole."""
    import psycopg

    from alkfs.migrate import to_sqlite

    root = tmp_path / "old"
    with Alkfs.open(root, database=pg_uri) as app:
        key, created_ns = _a_version_2_tree(app)
    with psycopg.connect(pg_uri, autocommit=True) as pg:  # (as version 2 left it)
        pg.execute("ALTER TABLE pins DROP COLUMN uid, DROP COLUMN gid")
        pg.execute("UPDATE meta SET value = '2' WHERE name = 'schema_version'")
    to_sqlite(root, pg_uri)
    with Alkfs.open(root) as app:
        assert app.store.db.engine == "sqlite"
        _check_migrated_to_3(app, key, created_ns)


def test_an_unpin_or_a_file_attribute_change_on_a_given_object_is_one_step(app):
    """`unpin(name, key)` and `set_attrs(..., key=)` act only while the pin names that
    object, checked in their own transaction (the mount's unpin of an object's pin xattr
    and its chmod of a file written into /pins used a lock of the daemon's for that)."""
    pins = app.pins
    a, _ = pins.put_pinned("f", b"first", attrs=FILE, tree=True)
    b, _ = pins.put_pinned("g", b"second", attrs=FILE, tree=True)
    with pytest.raises(Missing):
        pins.unpin("f", b.key)
    with pytest.raises(Missing):
        pins.set_attrs("f", None, 0o600, key=b.key)
    changed = pins.set_attrs("f", None, 0o600, key=a.key)
    assert stat.S_IMODE(changed.mode) == 0o600 and pins.get("f").mode == changed.mode
    pins.unpin("f", a.key)
    assert pins.get("f") is None and pins.get("g").key == b.key
