"""The mark by git (alkfs/git/revmark.py): `git rev-list --objects` over the published
derived packs and the objects outside them gives exactly the closure the Python walk
gives, and the walk takes over wherever git's answer could be short. Also the compact
key sets it is kept in (alkfs/keyset.py)."""

from __future__ import annotations

import itertools

import pytest

from alkfs.app import Alkfs
from alkfs.git import revmark
from alkfs.git.importer import import_repo
from alkfs.git.objects import canonical
from alkfs.git.refs import RefUpdate
from alkfs.keys import Algorithm, Key
from alkfs.keyset import KeyUnion, SortedKeys

from .conftest import stored_keys
from .scenarios import everything, side_branch

ALGO = {"sha1": Algorithm.GIT_SHA1, "sha256": Algorithm.GIT_SHA256}


def _tree_entry(mode: bytes, name: bytes, key: Key) -> bytes:
    return mode + b" " + name + b"\0" + key.digest


def _commit_on(app: Alkfs, algo: Algorithm, parent: str, tree: Key, msg: str) -> Key:
    body = (
        f"tree {tree.hex}\nparent {parent}\n"
        "author A <a@x> 1700000000 +0000\ncommitter A <a@x> 1700000000 +0000\n\n"
        f"{msg}\n"
    ).encode()
    return app.store.add(canonical("commit", body), algo)


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_git_computes_the_closure_of_imported_refs(app, make_repo, fmt):
    src = make_repo(fmt)
    everything(src)
    import_repo(app, src.gitdir, "r", progress=False)
    live = app.closure.live_keys()
    assert app.closure.by_git == 1
    assert set(live) == src.rev_list_keys()
    assert isinstance(live, KeyUnion) and any(isinstance(p, SortedKeys) for p in live.parts)


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_objects_stored_after_the_packs_were_built_are_walked_loose(app, make_repo, fmt):
    algo = ALGO[fmt]
    src = make_repo(fmt)
    everything(src)
    import_repo(app, src.gitdir, "r", progress=False)
    tip = src.rev("refs/heads/main")
    blob = app.store.add(canonical("blob", b"after the build\n"), algo)
    old_tree = Key.from_hex(algo, src.rev("refs/heads/main^{tree}"))
    sub = app.store.add(canonical("tree", _tree_entry(b"100644", b"new.txt", blob)), algo)
    tree = app.store.add(
        canonical(
            "tree", _tree_entry(b"40000", b"new", sub) + _tree_entry(b"40000", b"old", old_tree)
        ),
        algo,
    )
    commit = _commit_on(app, algo, tip, tree, "after")
    app.refs.update("r", [RefUpdate("refs/heads/main", commit.hex, tip)])
    live = app.closure.live_keys()
    assert app.closure.by_git == 1
    assert {blob.raw, sub.raw, tree.raw, commit.raw} <= set(live)
    expected = src.rev_list_keys() | {blob.raw, sub.raw, tree.raw, commit.raw}
    assert set(live) == expected


def test_a_missing_commit_hands_the_mark_to_the_walk(app, make_repo):
    algo = Algorithm.GIT_SHA1
    src = make_repo()
    everything(src)
    import_repo(app, src.gitdir, "r", progress=False)
    blob = app.store.add(canonical("blob", b"x\n"), algo)
    tree = app.store.add(canonical("tree", _tree_entry(b"100644", b"x", blob)), algo)
    gone = "ab" * 20  # a parent no one holds: git 2.39 stops there ("bad object")
    commit = _commit_on(app, algo, gone, tree, "orphan")
    app.refs.update("r", [RefUpdate("refs/heads/orphan", commit.hex, None)])
    live = app.closure.live_keys()
    assert app.closure.by_git == 0
    assert set(live) == src.rev_list_keys() | {commit.raw, tree.raw, blob.raw}
    assert app.closure._memo is not None and app.closure._memo[0] is None  # walks again


def test_git_missing_a_stored_tree_hands_the_mark_to_the_walk(app, make_repo, monkeypatch):
    # Objects outside the packs that git is not given (as if a set's record were wrong):
    # git cannot see the new tip, which the store holds, so its answer is not used.
    algo = Algorithm.GIT_SHA1
    src = make_repo()
    everything(src)
    import_repo(app, src.gitdir, "r", progress=False)
    tip = src.rev("refs/heads/main")
    blob = app.store.add(canonical("blob", b"unseen\n"), algo)
    tree = app.store.add(canonical("tree", _tree_entry(b"100644", b"u", blob)), algo)
    commit = _commit_on(app, algo, tip, tree, "unseen")
    app.refs.update("r", [RefUpdate("refs/heads/main", commit.hex, tip)])
    monkeypatch.setattr(revmark, "_outside", lambda store, d, gen: [])
    live = app.closure.live_keys()
    assert app.closure.by_git == 0
    assert set(live) == src.rev_list_keys() | {commit.raw, tree.raw, blob.raw}


def test_the_walk_alone_when_asked_gives_the_same_closure(app, make_repo, monkeypatch):
    src = make_repo()
    everything(src)
    import_repo(app, src.gitdir, "r", progress=False)
    by_git = app.closure.live_keys()
    monkeypatch.setenv("ALKFS_MARK", "python")
    app.refs.update("r", [RefUpdate("refs/heads/extra", src.rev("refs/heads/main"), None)])
    by_walk = app.closure.live_keys()
    assert app.closure.by_git == 1 and app.closure.builds == 2
    assert set(by_walk) == set(by_git) == src.rev_list_keys()


def test_a_sweep_by_the_git_mark_deletes_exactly_what_no_ref_reaches(tmp_path, make_repo):
    src = make_repo()
    everything(src)
    side_branch(src, "dropped", "only on dropped\n")
    app = Alkfs.open(tmp_path / "store", window_s=0)
    try:
        import_repo(app, src.gitdir, "r", progress=False)
        dropped = src.rev("refs/heads/dropped")
        app.refs.update("r", [RefUpdate("refs/heads/dropped", None, dropped)])
        keep = src.rev_list_keys("--exclude=refs/heads/dropped", "--all")
        only_dropped = src.rev_list_keys(
            "refs/heads/dropped", "--not", "--exclude=refs/heads/dropped", "--all"
        )
        assert len(only_dropped) == 3  # the commit, its tree and the new blob
        first = app.store.sweep(0)
        assert app.closure.by_git >= 1
        assert (first.aborted, first.candidates_staged) == (None, 3)
        second = app.store.sweep(0)
        assert (second.aborted, second.deleted) == (None, 3)
        assert stored_keys(app) == keep
    finally:
        app.close()


# -- the key sets ---------------------------------------------------------------------------
def _keys(n: int, width: int = 21) -> list[bytes]:
    import hashlib

    out = sorted(
        {b"\x03" + hashlib.sha256(str(i).encode()).digest()[: width - 1] for i in range(n)}
    )
    return out


def test_sorted_keys_answer_membership_exactly():
    keys = _keys(5000)
    b = SortedKeys.Builder(21)
    for k in keys[::2]:
        b.add(k)
    s = b.done()
    assert len(s) == 2500
    assert all(k in s for k in keys[::2])
    assert not any(k in s for k in keys[1::2])
    assert list(s) == keys[::2]
    assert b"\x03" not in s and 7 not in s and keys[0][:20] not in s
    edge = [b"\x03\x00\x00" + bytes(18), b"\x03\xff\xff" + b"\xff" * 18]
    e = SortedKeys.Builder(21)
    for k in edge:
        e.add(k)
    done = e.done()
    assert all(k in done for k in edge) and keys[0] not in done


def test_sorted_keys_refuse_keys_out_of_order_or_of_another_width():
    b = SortedKeys.Builder(21)
    b.add(b"\x03" + bytes([5]) * 20)
    with pytest.raises(ValueError, match="ascending order"):
        b.add(b"\x03" + bytes([4]) * 20)
    with pytest.raises(ValueError, match="once each"):
        b.add(b"\x03" + bytes([5]) * 20)  # (twice)
    with pytest.raises(ValueError, match="a key of 33 bytes in a set of 21"):
        b.add(b"\x03" + bytes([6]) * 32)


def test_a_union_asks_its_parts_and_never_changes_them():
    big = set(_keys(5000)[:4500])
    b = SortedKeys.Builder(21)
    rest = _keys(5000)[4500:]
    for k in rest[:250]:
        b.add(k)
    u = KeyUnion()
    u.add(big)
    u.add(b.done())
    u.add({rest[-1]})
    assert u.parts[0] is big  # (a large set is shared, not copied)
    assert all(k in u for k in big) and all(k in u for k in rest[:250])
    assert rest[-1] in u and rest[300] not in u
    v = u | {rest[300]}
    assert rest[300] in v and rest[300] not in u
    assert len(big) == 4500
    assert set(u) == big | set(rest[:250]) | {rest[-1]}


def test_sorted_keys_never_match_across_two_records():
    # five-byte keys in one fan-out bucket (03 04): 03 04 03 04 03 is in neither record
    # but in the bytes of the two together (from the fourth byte of the first)
    chosen = [bytes.fromhex("0304030304"), bytes.fromhex("0304030404")]
    straddling = bytes.fromhex("0304030403")
    assert b"".join(chosen).find(straddling) == 3
    b = SortedKeys.Builder(5)
    for k in chosen:
        b.add(k)
    s = b.done()
    assert straddling not in s
    assert all(k in s for k in chosen)
    every = [b"\x03\x04" + bytes(t) for t in itertools.product(b"\x03\x04", repeat=3)]
    assert {k for k in every if k in s} == set(chosen)
