"""The ref closure equals `git rev-list --objects --all`; its memo and arbitration discipline."""

from __future__ import annotations

import threading

import pytest

from alkfs.app import Alkfs
from alkfs.db.sqlite import SqliteDatabase as Database
from alkfs.git import packs
from alkfs.git.importer import import_repo
from alkfs.git.objects import canonical
from alkfs.git.refs import RefUpdate
from alkfs.keys import Algorithm, Key

from .conftest import stored_keys
from .scenarios import SCENARIOS, everything


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_closure_of_the_imported_refs_equals_git_rev_list_objects_all(
    app, make_repo, scenario, fmt
):
    src = make_repo(fmt)
    SCENARIOS[scenario](src)
    import_repo(app, src.gitdir, "r", progress=False)
    assert set(app.closure.live_keys()) == src.rev_list_keys()
    assert app.closure.by_git == 1  # (the import built the packs: git computed it)


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_one_repository_with_every_shape_closes_exactly_and_two_sweeps_delete_nothing(
    app, make_repo, fmt
):
    src = make_repo(fmt)
    everything(src)
    import_repo(app, src.gitdir, "all", progress=False)
    assert app.refs.repo("all").object_format == fmt
    assert set(app.closure.live_keys()) == src.rev_list_keys()
    assert stored_keys(app) == src.all_object_keys()
    first, second = app.store.sweep(0), app.store.sweep(0)
    assert (first.aborted, first.candidates_staged, first.deleted) == (None, 0, 0)
    assert (second.aborted, second.candidates_staged, second.deleted) == (None, 0, 0)
    assert stored_keys(app) == src.all_object_keys()


def test_a_missing_object_stops_its_branch_and_never_the_walk(app, make_repo, monkeypatch):
    # the walk's row: objects deleted behind the store's back from a store whose kv holds
    # them (not drained), its packs withdrawn (a pack would still serve them)
    monkeypatch.setenv("ALKFS_MARK", "python")
    monkeypatch.setenv("ALKFS_DRAIN", "0")
    src = make_repo()
    src.write("a/one.txt", "one\n")
    src.write("b/two.txt", "two\n")
    c1 = src.commit("first")
    src.write("c.txt", "three\n")
    c2 = src.commit("second")
    import_repo(app, src.gitdir, "r", progress=False)
    assert packs.derived_for(app.store, "sha1").withdraw()
    tree_a = Key.from_hex(Algorithm.GIT_SHA1, src.rev(f"{c1}:a"))
    first = Key.from_hex(Algorithm.GIT_SHA1, c1)
    app.store.engine_delete(tree_a.raw)
    app.store.engine_delete(first.raw)
    # c1 and the tree a/ (shared by both commits) are gone: neither is walked, and what
    # only they reach is not live; everything c2 reaches another way still is.
    expected = {
        Key.from_hex(Algorithm.GIT_SHA1, src.rev(x)).raw
        for x in (c2, f"{c2}^{{tree}}", f"{c2}:b", f"{c2}:b/two.txt", f"{c2}:c.txt")
    }
    assert set(app.closure.live_keys()) == expected


def test_the_memo_is_keyed_on_the_refs_fingerprint(app, make_repo):
    src = make_repo()
    src.write("f", "1\n")
    c1 = src.commit("one")
    src.write("f", "2\n")
    src.commit("two")
    import_repo(app, src.gitdir, "r", progress=False)
    closure = app.closure
    first = closure.live_keys()
    assert closure.builds == 1
    assert set(closure.live_keys()) == set(first)
    assert closure.builds == 1  # unchanged refs: no walk
    app.refs.update("r", [RefUpdate("refs/heads/main", src.rev("main"), src.rev("main"))])
    closure.live_keys()
    assert closure.builds == 1  # a write that changed nothing moves no fingerprint
    app.refs.update("r", [RefUpdate("refs/heads/old", c1, None)])
    closure.live_keys()
    assert closure.builds == 2


def test_contains_answers_from_the_memo_only_live_when_cold_or_after_a_write(app):
    blob = app.store.add(canonical("blob", b"tip\n"), Algorithm.GIT_SHA1)
    other = app.store.add(canonical("blob", b"other\n"), Algorithm.GIT_SHA1)
    app.refs.create_repo("r")
    app.refs.update("r", [RefUpdate("refs/heads/main", blob.hex, None)])
    closure = app.closure
    assert closure.contains(other.raw) is True  # cold memo: unknown is live
    assert closure.builds == 0  # and contains never walks
    closure.live_keys()
    assert closure.contains(blob.raw) is True
    assert closure.contains(other.raw) is False  # a built memo answers exactly
    app.refs.update("r", [RefUpdate("refs/heads/other", other.hex, None)])
    assert closure.contains(other.raw) is True  # the counter moved: live until the next mark
    assert closure.builds == 1
    app.refs.update("r", [RefUpdate("refs/heads/other", None)])
    closure.live_keys()
    assert closure.contains(other.raw) is False
    assert closure.builds == 1  # the refs are back to the memo's fingerprint: no walk


class WriteBlocker:
    """Another connection holding the store's write lock, so a ref or pin write parks mid-flight."""

    def __init__(self, app: Alkfs) -> None:
        assert app.store.path is not None
        self.db = Database(app.store.path / "store.db")
        self.conn = self.db.conn()
        self.conn.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        self.conn.execute("ROLLBACK")
        self.db.close()


def _wait_pinned(app: Alkfs, key: Key, writer: threading.Thread) -> None:
    while app.store.arbiter.pin_count(key) == 0:
        assert writer.is_alive()
        threading.Event().wait(0.001)


def test_a_ref_write_straddling_a_mark_answers_live_never_dead(app):
    tip = app.store.add(canonical("blob", b"straddled\n"), Algorithm.GIT_SHA1)
    app.refs.create_repo("r")
    closure = app.closure
    blocker = WriteBlocker(app)
    outcome: list = []
    writer = threading.Thread(
        target=lambda: outcome.extend(
            app.refs.update("r", [RefUpdate("refs/heads/main", tip.hex, None)])
        )
    )
    writer.start()
    _wait_pinned(app, tip, writer)  # the write holds its pin and waits on the database lock
    assert set(closure.live_keys()) == set()  # the mark's snapshot misses the in-flight write
    assert app.refs.write_counter == 0  # no bump before the commit
    blocker.release()
    writer.join()
    assert [o.ok for o in outcome] == [True]
    assert app.refs.write_counter == 1  # the bump follows the commit
    assert app.store.arbiter.pin_count(tip) == 0
    assert closure.contains(tip.raw) is True  # just referenced: live, never exact-dead
    assert closure.builds == 1


def test_a_sweep_across_a_ref_write_keeps_the_newly_referenced_object(app):
    tip = app.store.add(canonical("blob", b"orphan, then referenced\n"), Algorithm.GIT_SHA1)
    app.refs.create_repo("r")
    staged = app.store.sweep(0)
    assert staged.candidates_staged == 1
    app.refs.update("r", [RefUpdate("refs/heads/main", tip.hex, None)])
    second = app.store.sweep(0)
    assert (second.deleted, second.cancelled_by_arbitration) == (0, 1)
    third = app.store.sweep(0)
    assert (third.deleted, third.candidates_staged) == (0, 0)
    assert app.store.has(tip)


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_objects_in_the_large_tier_are_walked_like_the_rest(tmp_path, make_repo, fmt, monkeypatch):
    # (an import keeps every object in its pack, whatever its size: the kv and large
    # tiers' path, where a fleet or ALKFS_DRAIN=0 keeps git objects, is walked here)
    monkeypatch.setenv("ALKFS_DRAIN", "0")
    src = make_repo(fmt)
    everything(src)
    src.write("big/file.bin", bytes(range(256)) * 8)
    for i in range(12):  # a tree bigger than the threshold
        src.write(f"big/wide-{i:02}.txt", f"{i}\n")
    src.commit("big things")
    app = Alkfs.open(tmp_path / "small", threshold=300, window_s=0)
    try:
        import_repo(app, src.gitdir, "r", progress=False)
        tiers = {app.store.stat(Key(k)).tier for k in stored_keys(app)}
        assert tiers == {"kv", "large"}
        assert set(app.closure.live_keys()) == src.rev_list_keys()
        assert app.closure.by_git == 1  # (the large tree written loose for git)
        assert (app.store.sweep(0).candidates_staged, app.store.sweep(0).deleted) == (0, 0)
    finally:
        app.close()


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_a_memory_store_walks_by_lookups_to_the_same_closure(make_repo, fmt):
    src = make_repo(fmt)
    everything(src)
    app = Alkfs.memory()
    try:
        import_repo(app, src.gitdir, "r", progress=False)
        assert set(app.closure.live_keys()) == src.rev_list_keys()
        assert stored_keys(app) == src.all_object_keys()
    finally:
        app.close()


def test_a_walk_that_met_a_missing_object_walks_again_at_the_next_mark(app, make_repo, monkeypatch):
    monkeypatch.setenv("ALKFS_MARK", "python")  # (see the test above)
    monkeypatch.setenv("ALKFS_DRAIN", "0")
    src = make_repo()
    src.write("d/f.txt", "f\n")
    tip = src.commit("one")
    import_repo(app, src.gitdir, "r", progress=False)
    assert packs.derived_for(app.store, "sha1").withdraw()
    sub = Key.from_hex(Algorithm.GIT_SHA1, src.rev(f"{tip}:d"))
    data = app.store.get(sub)
    app.store.engine_delete(sub.raw)
    assert sub.raw not in app.closure.live_keys()
    app.store.add(data, Algorithm.GIT_SHA1)  # the object arrives after the mark
    assert set(app.closure.live_keys()) == src.rev_list_keys()
    assert app.closure.builds == 2  # same refs, but the first walk was incomplete


@pytest.mark.parametrize("memory", [False, True], ids=["sqlite", "mem"])
def test_a_zero_padded_tree_mode_is_walked_like_any_tree(tmp_path, make_repo, memory):
    # git accepts (with a warning) trees whose subtree entries say 040000 instead of 40000.
    src = make_repo()
    src.write("inner/leaf.txt", "under a zero-padded mode\n")
    src.commit("one")
    inner = src.git("rev-parse", "HEAD:inner").strip()
    padded = b"040000 inner\0" + bytes.fromhex(inner)
    tree = src.git("hash-object", "-t", "tree", "--literally", "-w", "--stdin", input=padded)
    commit = src.git("commit-tree", tree.strip(), "-m", "padded").strip()
    src.git("update-ref", "refs/heads/padded", commit)
    app = Alkfs.memory() if memory else Alkfs.open(tmp_path / "store")
    try:
        import_repo(app, src.gitdir, "r", progress=False)
        assert set(app.closure.live_keys()) == src.rev_list_keys()
        leaf = src.git("rev-parse", "HEAD:inner/leaf.txt").strip()
        assert Key.from_hex(Algorithm.GIT_SHA1, leaf).raw in app.closure.live_keys()
    finally:
        app.close()
