"""The drain (alkfs/git/packs/drain.py): once packed, a git object is kept in its pack alone,
no kv row; builds carry the previous set over; a sweep's candidates are written back loose
before the set without them is published; a set that is the only copy is never withdrawn."""

from __future__ import annotations

import pytest
from helpers import damage_pack_objects, flip_pack_byte, git_objects

from alkfs.app import Alkfs
from alkfs.errors import Corrupt, StoreIO
from alkfs.git import packs
from alkfs.git.importer import import_repo
from alkfs.git.objects import canonical
from alkfs.git.packs.drain import PRIMARY
from alkfs.git.refs import RefUpdate
from alkfs.keys import Algorithm, Key

from .conftest import stored_keys
from .scenarios import everything, side_branch

ALGO = {"sha1": Algorithm.GIT_SHA1, "sha256": Algorithm.GIT_SHA256}


def kv_rows(app: Alkfs, algo: Algorithm) -> int:
    return app.store.kv.count_range(bytes([algo.value]), bytes([algo.value + 1]), 10**9)


def with_branch(make_repo, fmt: str = "sha1"):
    """everything(), and a branch `gone` with one commit of its own (3 objects)."""
    src = make_repo(fmt)
    everything(src)
    side_branch(src, "gone", "only on the branch that goes\n")
    return src


def only_gone(src) -> set[bytes]:
    tip = src.rev("refs/heads/gone")
    out = src.rev_list_keys(tip, "--not", "--exclude=refs/heads/gone", "--all")
    assert len(out) == 3
    return out


def drop_branch(app: Alkfs, src) -> None:
    tip = src.rev("refs/heads/gone")
    [done] = app.refs.update("r", [RefUpdate("refs/heads/gone", None, tip)])
    assert done.ok


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_an_import_keeps_every_object_in_its_pack_alone(app, make_repo, fmt):
    src = make_repo(fmt)
    everything(src)
    import_repo(app, src.gitdir, "r", progress=False)
    algo = ALGO[fmt]
    d = packs.derived_for(app.store, fmt)
    assert d is not None and (d.root / PRIMARY).is_file() and d.primary
    assert kv_rows(app, algo) == 0
    objects = git_objects(src.gitdir)
    assert len(objects) > 30
    for hexid, data in objects.items():
        key = Key.from_hex(algo, hexid)
        st = app.store.stat(key)
        assert st is not None and (st.tier, st.size) == ("packs", len(data))
        assert app.store.get(key) == data
    keys = list(app.store.iter_keys())  # (the mark scan: each packed object once)
    assert len(keys) == len(set(keys)) == len(objects)
    assert set(keys) == {Key.from_hex(algo, h).raw for h in objects}
    c = app.store.counts()[algo.label]
    assert (c["count"], c["kv"], c["packs"]) == (len(objects), 0, len(objects))
    listed, after = [], None  # (the listing of /objects/<algo>: page by page)
    while page := app.store.list(after=after, limit=7, algo=algo):
        listed += page
        after = page[-1].key
    assert [st.key.raw for st in listed] == sorted(Key.from_hex(algo, h).raw for h in objects)
    assert {(st.key.hex, st.size, st.tier) for st in listed} == {
        (h, len(data), "packs") for h, data in objects.items()
    }


def test_a_store_opened_again_still_knows_its_packs_are_the_only_copy(tmp_path, make_repo):
    src = make_repo()
    everything(src)
    with Alkfs.open(tmp_path / "s", window_s=0) as app:
        import_repo(app, src.gitdir, "r", progress=False)
    with Alkfs.open(tmp_path / "s", window_s=0) as app:
        d = packs.derived_for(app.store, "sha1")
        assert d.primary and (d.root / PRIMARY).is_file()
        assert not d.withdraw()


def test_a_sweep_deletes_packed_objects_and_nothing_else(app, make_repo):
    src = with_branch(make_repo)
    import_repo(app, src.gitdir, "r", progress=False)
    gone = only_gone(src)
    drop_branch(app, src)
    staged = app.store.sweep(0)
    assert (staged.aborted, staged.candidates_staged) == (None, 3)
    done = app.store.sweep(0)
    assert (done.aborted, done.deleted, done.cancelled_by_arbitration) == (None, 3, 0)
    d = packs.derived_for(app.store, "sha1")
    gen = d.current()
    assert not any(x[1:] in gen for x in gone)
    assert not any(app.store.has(Key(x)) for x in gone)
    rest = src.rev_list_keys("--exclude=refs/heads/gone", "--all")
    assert stored_keys(app) == rest
    assert kv_rows(app, Algorithm.GIT_SHA1) == 0  # (the written-back copies went too)
    for hexid, data in git_objects(src.gitdir).items():
        key = Key.from_hex(Algorithm.GIT_SHA1, hexid)
        if key.raw in rest:
            assert app.store.get(key) == data


def test_a_candidate_live_again_is_kept_and_packed_again(tmp_path, make_repo):
    src = with_branch(make_repo)
    app = Alkfs.open(tmp_path / "store", window_s=3600)
    try:
        import_repo(app, src.gitdir, "r", progress=False)
        d = packs.derived_for(app.store, "sha1")
        gone = only_gone(src)
        tip = src.rev("refs/heads/gone")
        drop_branch(app, src)
        assert app.store.sweep().candidates_staged == 3  # (a one-hour window)
        d.build()  # the staged three move into the set's staged pack, read from the packs
        gen = d.current()
        assert gen.staged_index is not None
        assert {x[1:] for x in gone} == set(gen.staged_index.digests())
        [back] = app.refs.update("r", [RefUpdate("refs/heads/gone", tip, None)])
        assert back.ok
        report = app.store.sweep(expire_now=True)
        assert (report.deleted, report.cancelled_by_arbitration) == (0, 3)
        assert all(app.store.has(Key(x)) for x in gone)
        d.build()
        d.drain()
        gen = d.current()
        assert all(gen.main_holds(x[1:]) for x in gone)
        assert kv_rows(app, Algorithm.GIT_SHA1) == 0
        assert stored_keys(app) == src.all_object_keys()
        for hexid, data in git_objects(src.gitdir).items():
            assert app.store.get(Key.from_hex(Algorithm.GIT_SHA1, hexid)) == data
    finally:
        app.close()


def test_a_put_after_staging_keeps_a_packed_candidate(app, make_repo):
    src = with_branch(make_repo)
    import_repo(app, src.gitdir, "r", progress=False)
    gone = only_gone(src)
    drop_branch(app, src)
    assert app.store.sweep(0).candidates_staged == 3
    blob = Key.from_hex(Algorithm.GIT_SHA1, src.rev("refs/heads/gone:gone-only.txt"))
    data = app.store.get(blob)
    assert data is not None and app.store.stat(blob).tier == "packs"
    app.store.add(data, Algorithm.GIT_SHA1)  # written again after it was staged
    report = app.store.sweep(0)
    assert (report.deleted, report.cancelled_by_arbitration) == (2, 1)
    assert app.store.get(blob) == data
    assert {x for x in gone if app.store.has(Key(x))} == {blob.raw}


def test_new_objects_are_built_with_everything_the_packs_alone_hold(app, make_repo):
    small = make_repo(name="small")
    small.write("a.txt", "a\n")
    small.commit("one")
    import_repo(app, small.gitdir, "small", progress=False)
    big = make_repo(name="big")
    everything(big)
    for i in range(8):
        big.write(f"dir/f{i}.txt", f"{i}\n" * 50)
        big.commit(f"c{i}")
    d = packs.derived_for(app.store, "sha1")
    first = d.current()
    import_repo(app, big.gitdir, "big", progress=False)
    built = d.last_build
    # (the import's own pack beside the first: the smaller holds under half the larger)
    assert built is not None and built.mode == "adopt" and built.packs == 2
    # a new loose object: the next build carries what the packs alone hold
    loose = app.store.add(canonical("blob", b"arrived loose\n"), algo=Algorithm.GIT_SHA1)
    built = d.build(exclude=[])
    assert built is not None and built.objects == d.current().objects
    assert loose.raw[1:] in d.current()
    d.drain()
    gen = d.current()
    assert gen.number > first.number
    assert set(gen.digests()) == {
        k[1:] for k in small.all_object_keys() | big.all_object_keys()
    } | {loose.raw[1:]}
    assert kv_rows(app, Algorithm.GIT_SHA1) == 0
    for repo in (small, big):
        for hexid, data in git_objects(repo.gitdir).items():
            assert app.store.get(Key.from_hex(Algorithm.GIT_SHA1, hexid)) == data


def test_the_drain_leaves_staged_objects_loose(tmp_path, make_repo, monkeypatch):
    src = with_branch(make_repo)
    app = Alkfs.open(tmp_path / "store", window_s=3600)
    try:
        monkeypatch.setenv("ALKFS_DRAIN", "0")
        import_repo(app, src.gitdir, "r", progress=False)
        assert kv_rows(app, Algorithm.GIT_SHA1) == len(src.all_object_keys())
        drop_branch(app, src)
        assert app.store.sweep().candidates_staged == 3
        monkeypatch.setenv("ALKFS_DRAIN", "1")
        d = packs.derived_for(app.store, "sha1")
        assert d.drain() == len(src.all_object_keys()) - 3
        assert kv_rows(app, Algorithm.GIT_SHA1) == 3
        assert all(app.store.stat(Key(x)).tier == "kv" for x in only_gone(src))
    finally:
        app.close()


def test_a_set_that_is_the_only_copy_is_never_withdrawn(app, make_repo):
    src = with_branch(make_repo)
    import_repo(app, src.gitdir, "r", progress=False)
    d = packs.derived_for(app.store, "sha1")
    gen = d.current()
    flip_pack_byte(next(gen.root / r for r in gen.files if r.endswith(".pack")))
    assert packs.verify_sets(app.store) == ["sha1"]  # reported ...
    assert d.current() is gen and "corrupt" in (d.last_error or "")  # ... not withdrawn
    listed = set(app.store.corrupt)  # (every object the damage affects, read or not)
    assert listed
    assert not d.withdraw()
    assert packs.shed(app.store) == 0 and d.current() is gen
    bad, good = 0, 0
    for hexid, want in git_objects(src.gitdir).items():
        key = Key.from_hex(Algorithm.GIT_SHA1, hexid)
        try:
            got = app.store.get(key)
        except Corrupt:
            bad += 1
            assert key.raw in listed
            continue
        assert got == want
        good += 1
    assert bad == len(listed) > 0 and good > 0  # (never served wrong: the rest are served)


def test_a_failed_rebuild_before_deleting_keeps_the_candidates(app, make_repo, monkeypatch):
    src = with_branch(make_repo)
    import_repo(app, src.gitdir, "r", progress=False)
    gone = only_gone(src)
    drop_branch(app, src)
    assert app.store.sweep(0).candidates_staged == 3
    d = packs.derived_for(app.store, "sha1")
    before = d.current()
    monkeypatch.setenv("PATH", "/nonexistent")  # git cannot run: the rebuild fails
    report = app.store.sweep(0)
    assert (report.deleted, report.cancelled_by_arbitration) == (0, 3)
    assert d.current() is before and before.objects > 3  # (not withdrawn)
    assert all(app.store.has(Key(x)) for x in gone)
    assert report.candidates_staged == 3  # (its mark staged them again)
    monkeypatch.undo()
    again = app.store.sweep(0)
    assert again.deleted == 3 and not any(app.store.has(Key(x)) for x in gone)
    assert kv_rows(app, Algorithm.GIT_SHA1) == 0


def test_an_unreadable_set_that_is_the_only_copy_is_kept_and_not_built_over(tmp_path, make_repo):
    src = make_repo()
    everything(src)
    with Alkfs.open(tmp_path / "s", window_s=0) as app:
        import_repo(app, src.gitdir, "r", progress=False)
        gen = packs.derived_for(app.store, "sha1").current()
        idx = next(gen.root / r for r in gen.files if r.endswith(".idx"))
    idx.chmod(0o644)
    idx.write_bytes(b"not an idx")
    with Alkfs.open(tmp_path / "s", window_s=0) as app:
        d = packs.derived_for(app.store, "sha1")
        assert d.current() is None and d.broken is not None and "unreadable" in d.last_error
        assert gen.root.is_dir()  # (kept on disk)
        app.store.add(canonical("blob", b"new\n"), Algorithm.GIT_SHA1)
        with pytest.raises(StoreIO, match="only copy"):
            d.build()
        assert sorted(p.name for p in d.root.iterdir()) == ["CURRENT", PRIMARY, gen.root.name]


def test_a_freshen_after_staging_keeps_a_packed_candidate(app, make_repo):
    """git freshens an object it finds packed through its loose path (utime): the
    store writes it back into the kv, stored now, and its staged delete is cancelled."""
    src = with_branch(make_repo)
    import_repo(app, src.gitdir, "r", progress=False)
    drop_branch(app, src)
    assert app.store.sweep(0).candidates_staged == 3
    blob = Key.from_hex(Algorithm.GIT_SHA1, src.rev("refs/heads/gone:gone-only.txt"))
    assert app.store.kv.read(blob.raw) is None
    assert app.store.freshen(blob)
    assert app.store.stat(blob).tier == "kv"
    report = app.store.sweep(0)
    assert (report.deleted, report.cancelled_by_arbitration) == (2, 1)
    assert app.store.has(blob)
    absent = Key.from_hex(Algorithm.GIT_SHA1, "ab" * 20)
    assert not app.store.freshen(absent)


def test_a_process_beside_the_lock_holder_reads_what_the_packs_alone_hold(tmp_path, make_repo):
    src = make_repo()
    everything(src)
    with Alkfs.open(tmp_path / "s", window_s=0) as app:
        import_repo(app, src.gitdir, "r", progress=False)
        beside = Alkfs.open(tmp_path / "s", lock=False)  # (as `alkfs` beside a daemon)
        try:
            assert packs.derived_for(beside.store, "sha1") is None  # (the holder's sets)
            for hexid, data in git_objects(src.gitdir).items():
                key = Key.from_hex(Algorithm.GIT_SHA1, hexid)
                assert beside.store.has(key) and beside.store.get(key) == data
            # the holder publishes a new set (and drains): the next look reads it
            app.store.add(canonical("blob", b"after\n"), Algorithm.GIT_SHA1)
            d = packs.derived_for(app.store, "sha1")
            d.build()
            d.drain()
            new = Key.derive(Algorithm.GIT_SHA1, canonical("blob", b"after\n"))
            assert app.store.kv.read(new.raw) is None
            assert beside.store.get(new) == canonical("blob", b"after\n")
        finally:
            beside.close()


def test_nothing_is_drained_from_a_pack_that_does_not_verify(tmp_path, make_repo, monkeypatch):
    """A pack whose files' checksums hold but one of whose objects does not hash to its
    name (written again behind the store's back): git's index-pack --verify fails it,
    and every kv row stays."""
    src = make_repo()
    everything(src)
    monkeypatch.setenv("ALKFS_DRAIN", "0")
    app = Alkfs.open(tmp_path / "s", window_s=0)
    try:
        import_repo(app, src.gitdir, "r", progress=False)
        rows = kv_rows(app, Algorithm.GIT_SHA1)
        d = packs.derived_for(app.store, "sha1")
        gen = d.current()
        damage_pack_objects(next(gen.root / r for r in gen.files if r.endswith(".pack")))
        monkeypatch.setenv("ALKFS_DRAIN", "1")
        assert d.drain() == 0
        assert kv_rows(app, Algorithm.GIT_SHA1) == rows and not d.primary
        assert "does not verify" in (d.last_error or "")
    finally:
        app.close()


def test_dropping_the_staged_pack_keeps_what_is_not_due_yet(tmp_path, make_repo):
    """The staged pack holds candidates of two sweeps; the sweep that deletes the first
    drops that pack: the other, staged for later and kept in no other pack, is written
    back loose first (it was lost: a branch pushed again later reached a missing commit)."""
    src = with_branch(make_repo)
    side_branch(src, "later", "only on the branch that goes later\n")
    app = Alkfs.open(tmp_path / "store", window_s=3600)
    try:
        import_repo(app, src.gitdir, "r", progress=False)
        d = packs.derived_for(app.store, "sha1")
        later_tip = src.rev("refs/heads/later")
        later = src.rev_list_keys(later_tip, "--not", "--exclude=refs/heads/later", "--all")
        [done] = app.refs.update("r", [RefUpdate("refs/heads/later", None, later_tip)])
        assert done.ok
        assert app.store.sweep().candidates_staged == 3  # (due in an hour)
        drop_branch(app, src)
        assert app.store.sweep(window_s=0).candidates_staged == 3  # (due now)
        d.build()  # both in the staged pack, and in no other
        gen = d.current()
        assert {x[1:] for x in later | only_gone(src)} == set(gen.staged_index.digests())
        report = app.store.sweep(window_s=0)
        assert report.deleted == 3
        assert all(app.store.has(Key(x)) for x in later)
        [back] = app.refs.update("r", [RefUpdate("refs/heads/later", later_tip, None)])
        assert back.ok
        report = app.store.sweep(expire_now=True)
        assert report.cancelled_by_arbitration == 3
        d.build()
        d.drain()
        for hexid, data in git_objects(src.gitdir).items():
            key = Key.from_hex(Algorithm.GIT_SHA1, hexid)
            if key.raw not in only_gone(src):
                assert app.store.get(key) == data
    finally:
        app.close()


def test_many_packed_objects_are_read_by_git_as_the_python_reader_reads_them(
    tmp_path, make_repo, monkeypatch
):
    """`packed_values` of many objects (a sweep's candidates written back, an undrain)
    asks git for them (cat-file --batch) and hashes each: the same (digest, canonical
    bytes) as the reader of alkfs/git/packread.py; on a pack whose objects were
    damaged, both leave out the same objects and serve the rest."""
    from alkfs.git.packs import drain

    src = make_repo()
    everything(src)
    app = Alkfs.open(tmp_path / "s", window_s=0)
    try:
        import_repo(app, src.gitdir, "r", progress=False)
        d = packs.derived_for(app.store, "sha1")
        digests = sorted(d.current().digests()) + [b"\x01" * 20]  # (one no pack holds)

        def read(threshold: int) -> dict[bytes, bytes]:
            monkeypatch.setattr(drain, "GIT_READS_FROM", threshold)
            return dict(d.packed_values(digests))

        by_git, by_python = read(0), read(10**9)
        assert by_git == by_python and len(by_git) == len(digests) - 1
        assert by_git == {bytes.fromhex(x): v for x, v in git_objects(src.gitdir).items()}
        damage_pack_objects(
            next(d.current().root / r for r in d.current().files if r.endswith(".pack"))
        )
        by_git, by_python = read(0), read(10**9)
        assert by_git == by_python and 0 < len(by_git) < len(digests) - 1
    finally:
        app.close()
