"""Derived packs (alkfs/git/packs/): built by git from verified store objects, verified
by git's own tools, published by generation, never listing what a sweep deleted."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import pytest
from helpers import flip_pack_byte, git, git_out

from alkfs.app import Alkfs
from alkfs.errors import StoreIO
from alkfs.git import packs
from alkfs.git.importer import import_repo
from alkfs.git.objects import canonical
from alkfs.git.refs import RefUpdate
from alkfs.keys import Algorithm, Key


def history(make_repo, fmt: str, commits: int = 6):
    """A repository with nested directories, edited files, a tag and two branches."""
    repo = make_repo(fmt)
    for i in range(commits):
        repo.write("README", "".join(f"line {j} of the readme, edit {i}\n" for j in range(60)))
        repo.write(f"src/pkg/mod{i % 3}.py", f"def f():\n    return {i}\n" * (20 + i))
        repo.write("docs/deep/er/notes.txt", f"notes {i}\n" * 30)
        repo.commit(f"commit {i}")
    repo.git("tag", "-a", "v1", "-m", "a tag")
    repo.git("checkout", "-q", "-b", "side")
    repo.write("side.txt", "side\n")
    repo.commit("side")
    repo.git("checkout", "-q", "main")
    return repo


def pack_ids(gen: packs.Generation) -> set[str]:
    """The ids `git show-index` reads from every idx of the set."""
    out: set[str] = set()
    for rel in gen.files:
        if rel.endswith(".idx"):
            with open(gen.root / rel, "rb") as f:
                text = subprocess.run(
                    ["git", "show-index", f"--object-format={gen.fmt}"],
                    stdin=f,
                    capture_output=True,
                    check=True,
                ).stdout.decode()
            out.update(line.split()[1] for line in text.splitlines())
    return out


def store_ids(app: Alkfs, algo: Algorithm) -> set[str]:
    return {raw[1:].hex() for raw in app.store.iter_keys() if raw[0] == algo.value}


def user_of(tmp_path: Path, fmt: str, objdir: Path, name: str = "user") -> Path:
    """A repository whose only objects are the alternate `objdir`."""
    path = tmp_path / name
    git("init", "-q", "--bare", f"--object-format={fmt}", str(path), cwd=tmp_path)
    (path / "objects" / "info" / "alternates").write_text(f"{objdir}\n")
    return path


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_an_import_leaves_every_object_in_a_set_git_verifies(app, make_repo, tmp_path, fmt):
    repo = history(make_repo, fmt)
    import_repo(app, repo.gitdir, "r", progress=False)
    d = packs.derived_for(app.store, fmt)
    gen = d.current()
    assert gen is not None and gen.number == 1
    assert (d.root / "CURRENT").read_text() == "1\n"
    names = gen.names_in("pack")
    stem = names[-1].rsplit(".", 1)[0]
    assert names == sorted([f"{stem}.idx", f"{stem}.keep", f"{stem}.pack", "multi-pack-index"])
    assert gen.names_in("info") == ["commit-graphs"]
    chain = (gen.root / "info/commit-graphs/commit-graph-chain").read_text().split()
    assert len(chain) == 1 and (gen.root / f"info/commit-graphs/graph-{chain[0]}.graph").exists()
    # exactly the store's objects of this format, as git reads the index
    assert (
        pack_ids(gen) == store_ids(app, repo.algo) == {Key(k).hex for k in repo.all_object_keys()}
    )
    idx = gen.root / "pack" / f"{stem}.idx"
    user = user_of(tmp_path, fmt, gen.root)
    verify = git_out("verify-pack", "-v", str(idx), cwd=user)  # (in a repository of the format)
    assert verify.rstrip().endswith(": ok")
    git("multi-pack-index", f"--object-dir={gen.root}", "verify", cwd=user)
    git("commit-graph", "verify", f"--object-dir={gen.root}", cwd=user)
    for name, oid in repo.for_each_ref().items():
        git("update-ref", name, oid, cwd=user)
    git("fsck", "--full", "--strict", "--no-dangling", cwd=user)
    assert git_out("rev-list", "--objects", "--all", cwd=user) == repo.git(
        "rev-list", "--objects", "--all"
    )
    assert git_out("count-objects", "-v", cwd=user).splitlines()[0] == "count: 0"
    meta = json.loads((gen.root / "alkfs.json").read_text())
    # (the import's own pack: git packed it from the source and checked it, packs/adopt.py)
    assert (meta["generation"], meta["objects"], meta["mode"]) == (1, gen.objects, "adopt")


def test_deltas_are_found_between_versions_of_one_file(app, make_repo, tmp_path):
    repo = history(make_repo, "sha1", commits=8)
    import_repo(app, repo.gitdir, "r", progress=False)
    gen = packs.derived_for(app.store, "sha1").current()
    idx = next(gen.root / r for r in gen.files if r.endswith(".idx"))
    lines = git_out("verify-pack", "-v", str(idx), cwd=tmp_path).splitlines()
    deltas = [x for x in lines if len(x.split()) == 7]  # sha type size packed offset depth base
    assert len(deltas) >= 5


def test_a_second_import_lands_in_a_pack_beside_the_previous_ones(app, make_repo, tmp_path):
    repo = history(make_repo, "sha1")
    import_repo(app, repo.gitdir, "r", progress=False)
    d = packs.derived_for(app.store, "sha1")
    first = d.current()
    [base] = [r for r in first.files if r.endswith(".pack")]
    base_bytes = (first.root / base).read_bytes()
    repo.write("README", "a new readme\n" * 50)
    repo.write("new/file.txt", "new\n")
    repo.commit("more")
    import_repo(app, repo.gitdir, "r", progress=False)
    second = d.current()
    assert second.number == 2 and second.meta["mode"] == "adopt"
    assert d.last_build is not None and d.last_build.new_objects == 5  # commit, 2 trees, 2 blobs
    assert len(second.indexes) == 2
    # the previous pack is the same file (a hard link), the new pack holds only the new
    assert (second.root / base).read_bytes() == base_bytes
    assert sorted(i.count for i in second.indexes)[0] == 5
    assert pack_ids(second) == store_ids(app, Algorithm.GIT_SHA1)
    assert not first.root.exists()  # retired and pruned: nothing held it
    assert d.generations_on_disk() == [2]
    chain = (second.root / "info/commit-graphs/commit-graph-chain").read_text().split()
    assert len(chain) == 2  # one more layer
    user = user_of(tmp_path, "sha1", second.root)
    git("update-ref", "refs/heads/main", repo.rev("main"), cwd=user)
    git("fsck", "--full", "--strict", "--no-dangling", cwd=user)
    git("commit-graph", "verify", f"--object-dir={second.root}", cwd=user)
    git("multi-pack-index", f"--object-dir={second.root}", "verify", cwd=user)
    for idx in second.indexes:
        assert git_out("verify-pack", "-v", str(idx.path), cwd=user).rstrip().endswith(": ok")


def test_imported_packs_are_consolidated_geometrically(app, make_repo, tmp_path):
    repo = history(make_repo, "sha1", commits=3)
    import_repo(app, repo.gitdir, "r", progress=False)
    d = packs.derived_for(app.store, "sha1")
    base = d.current().objects
    modes = []
    for i in range(12):
        repo.write(f"more/f{i}.txt", f"file {i}\n" * (i + 1))
        repo.commit(f"more {i}")
        import_repo(app, repo.gitdir, "r", progress=False)
        modes.append((d.last_build.mode, d.last_build.packs))
    # packs beside the base until they hold more than half as many objects as the base
    # pack (4 new objects each: commit, 2 trees, blob), then one consolidated pack
    assert modes[0] == ("adopt", 2)
    first_full = next(i for i, (mode, _n) in enumerate(modes) if mode != "adopt")
    assert modes[first_full] == ("incremental", 1)
    assert 2 * 4 * (first_full + 1) > base
    gen = d.current()
    assert pack_ids(gen) == store_ids(app, Algorithm.GIT_SHA1)
    user = user_of(tmp_path, "sha1", gen.root)
    git("update-ref", "refs/heads/main", repo.rev("main"), cwd=user)
    git("fsck", "--full", "--strict", "--no-dangling", cwd=user)
    git("commit-graph", "verify", f"--object-dir={gen.root}", cwd=user)
    git("multi-pack-index", f"--object-dir={gen.root}", "verify", cwd=user)


def test_a_sweep_publishes_a_set_without_every_object_it_deletes(app, make_repo, tmp_path):
    repo = history(make_repo, "sha1")
    import_repo(app, repo.gitdir, "r", progress=False)
    store = app.store
    loose = store.add(canonical("blob", b"nobody refers to me\n"), algo=Algorithm.GIT_SHA1)
    side = repo.rev("side")
    d = packs.derived_for(store, "sha1")
    d.build()
    before = d.current()
    assert loose.digest in before and bytes.fromhex(side) in before
    # the side branch dies: its commit, root tree and blob become dead with the loose blob
    [out] = app.refs.update("r", [RefUpdate("refs/heads/side", None, side)])
    assert out.ok
    first = store.sweep(0)
    assert (first.deleted, first.candidates_staged) == (0, 4)
    assert d.current().number == before.number  # staging alone publishes nothing
    dead = {loose.hex, side, repo.rev("side^{tree}"), repo.rev("side:side.txt")}
    # a build meanwhile moves what is staged into a pack of its own, named by no graph
    for _ in range(2):  # (and a third set: an intake, which keeps that pack as it is)
        d.build()
        gen = d.current()
        assert gen.staged_index is not None
        assert {x.hex() for x in gen.staged_index.digests()} == dead
        assert not any(gen.main_holds(bytes.fromhex(x)) for x in dead)
        assert dead.isdisjoint(x.hex() for x in gen.graph_commits())
        assert pack_ids(gen) == store_ids(app, Algorithm.GIT_SHA1)
    assert d.current().meta["mode"] == "intake"
    second = store.sweep(0)
    assert second.deleted == 4
    after = d.current()
    # the sweep only dropped that pack: the same main pack files, a new multi-pack-index
    assert (after.meta["mode"], after.staged_index, after.objects) == (
        "drop",
        None,
        gen.objects - 4,
    )
    main = {rel for rel in gen.files if rel.startswith("pack/pack-")}
    assert {rel for rel in after.files if rel.startswith("pack/pack-")} == {
        rel for rel in main if gen.staged_index.path.name[: -len(".idx")] not in rel
    }
    ids = pack_ids(after)
    assert dead.isdisjoint(ids)
    assert ids == store_ids(app, Algorithm.GIT_SHA1)
    user = user_of(tmp_path, "sha1", after.root)
    git("update-ref", "refs/heads/main", repo.rev("main"), cwd=user)
    git("fsck", "--full", "--strict", "--no-dangling", cwd=user)
    git("commit-graph", "verify", f"--object-dir={after.root}", cwd=user)


def test_the_graph_commits_read_from_a_set_are_the_commits_it_graphs(app, make_repo):
    """Generation.graph_commits (the OID chunks of every commit-graph layer) of an
    imported history: every commit of it, sha1 and sha256."""
    for fmt in ("sha1", "sha256"):
        repo = history(make_repo, fmt)
        import_repo(app, repo.gitdir, f"r-{fmt}", progress=False)
        gen = packs.derived_for(app.store, fmt).current()
        commits = set(repo.git("rev-list", "--all").split())
        assert len(commits) == 7
        assert {c.hex() for c in gen.graph_commits()} == commits


def test_a_commit_on_a_staged_parent_stays_out_of_the_intakes_graph(app, make_repo, tmp_path):
    """A staged commit in the staged pack, then a child of it arrives (live again for a
    while): the intake's graph layer names neither, so a sweep that deletes both later
    can drop the staged pack and leave no graph naming a deleted commit."""
    repo = history(make_repo, "sha1")
    import_repo(app, repo.gitdir, "r", progress=False)
    store = app.store
    d = packs.derived_for(store, "sha1")
    side = repo.rev("side")
    [out] = app.refs.update("r", [RefUpdate("refs/heads/side", None, side)])
    assert out.ok and store.sweep(0).candidates_staged == 3
    d.build()
    assert bytes.fromhex(side) in d.current() and not d.current().main_holds(bytes.fromhex(side))
    body = (
        f"tree {repo.rev('side^{tree}')}\nparent {side}\n"
        "author A <a@example.com> 1700000000 +0000\n"
        "committer A <a@example.com> 1700000000 +0000\n\na child of a staged commit\n"
    ).encode()
    child = store.add(canonical("commit", body), algo=Algorithm.GIT_SHA1)
    d.build()
    gen = d.current()
    assert gen.meta["mode"] == "intake" and child.digest in gen
    assert {child.digest, bytes.fromhex(side)}.isdisjoint(gen.graph_commits())
    user = user_of(tmp_path, "sha1", gen.root)
    git("commit-graph", "verify", f"--object-dir={gen.root}", cwd=user)
    # both die: the sweep that deletes them drops the staged pack and keeps the graph
    graph = gen.graph_commits()  # (the sweep's process has no mount: gen goes at once)
    assert store.sweep(0).deleted == 3  # (the side objects; the child is staged now)
    after = d.current()
    assert after.meta["mode"] == "drop" and after.graph_commits() == graph
    user = user_of(tmp_path, "sha1", after.root, "after")
    git("commit-graph", "verify", f"--object-dir={after.root}", cwd=user)
    git("multi-pack-index", f"--object-dir={after.root}", "verify", cwd=user)


def left_out_by_scan(d: packs.Derived, gen: packs.Generation) -> set[bytes]:
    lo, hi = bytes([d.algo.value]), bytes([d.algo.value + 1])
    upto = gen.meta["max_rowid"]
    return {k[1:] for k in d._kv().arrived(lo, hi, 0, upto=upto) if k[1:] not in gen}


def test_a_set_records_the_objects_it_left_out(app, make_repo):
    """Every build records the kv objects it left out (staged for deletion and not in its
    staged pack), the same as comparing every stored key with the set would find (or
    more: one deleted since is not listed, each is stat'ed): an intake carries the
    previous record (less what was deleted since), a consolidation records anew, a drop
    of the staged pack adds what that held."""
    repo = history(make_repo, "sha1")
    import_repo(app, repo.gitdir, "r", progress=False)
    store = app.store
    d = packs.derived_for(store, "sha1")
    assert d.current().left_out() == [] == d.current().meta["left_out"]
    a = store.add(canonical("blob", b"dead before any set held it\n"), algo=Algorithm.GIT_SHA1)
    assert store.sweep(0).candidates_staged == 1  # staged
    d.build()
    gen = d.current()
    assert gen.meta["mode"] == "intake" and gen.left_out() == [a.digest]
    assert gen.meta["left_out"] == [a.hex] and left_out_by_scan(d, gen) == {a.digest}
    b = store.add(canonical("blob", b"packed, then dead\n"), algo=Algorithm.GIT_SHA1)
    d.build()
    gen = d.current()
    assert gen.meta["mode"] == "intake" and b.digest in gen and gen.left_out() == [a.digest]
    report = store.sweep(0)  # deletes a, stages b
    assert (report.deleted, report.candidates_staged) == (1, 1)
    d.build()  # b is in a main pack and staged: a consolidation, b in the staged pack
    gen = d.current()
    assert gen.meta["mode"] != "intake" and b.digest in gen and not gen.main_holds(b.digest)
    assert gen.left_out() == [] and left_out_by_scan(d, gen) == set()
    c = store.add(canonical("blob", b"staged, then deleted\n"), algo=Algorithm.GIT_SHA1)
    report = store.sweep(0)  # deletes b (the set without its pack is published), stages c
    assert (report.deleted, report.candidates_staged) == (1, 1)
    gen = d.current()
    assert gen.meta["mode"] == "drop" and gen.left_out() == [b.digest]  # (b: gone since)
    assert left_out_by_scan(d, gen) == set()
    assert store.sweep(0).deleted == 1 and not store.has(c)  # and c
    e = store.add(canonical("blob", b"new\n"), algo=Algorithm.GIT_SHA1)
    d.build()
    gen = d.current()
    assert gen.meta["mode"] == "intake" and e.digest in gen
    assert gen.left_out() == [] and left_out_by_scan(d, gen) == set()  # (both deleted)


def test_a_record_missing_or_malformed_reads_as_none(app, make_repo):
    repo = history(make_repo, "sha1")
    import_repo(app, repo.gitdir, "r", progress=False)
    gen = packs.derived_for(app.store, "sha1").current()
    for bad in (None, "00", ["zz"], ["00" * 19], [7]):
        gen.meta["left_out"] = bad
        assert gen.left_out() is None
    del gen.meta["left_out"]  # (a set built before sets recorded it)
    assert gen.left_out() is None


def test_a_sweep_deleting_packed_objects_rebuilds_before_it_deletes(app, make_repo):
    repo = history(make_repo, "sha1")
    import_repo(app, repo.gitdir, "r", progress=False)
    store = app.store
    d = packs.derived_for(store, "sha1")
    blob = store.add(canonical("blob", b"dead but packed\n"), algo=Algorithm.GIT_SHA1)
    d.build()  # packed before any sweep saw it dead
    number = d.current().number
    assert blob.digest in d.current()
    assert store.sweep(0).candidates_staged == 1
    assert d.current().number == number
    seen: list[bool] = []
    d.on_publish.append(lambda old, new: seen.append(store.has(blob)))
    report = store.sweep(0)
    assert report.deleted == 1 and not store.has(blob)
    assert d.current().number == number + 1 and blob.digest not in d.current()
    assert seen == [True]  # published while the object was still there: before the delete
    assert pack_ids(d.current()) == store_ids(app, Algorithm.GIT_SHA1)


def test_a_failed_rebuild_withdraws_the_packs_before_deleting(app, make_repo, monkeypatch):
    # (a store whose kv keeps every object: where the packs are the only copy, the
    # deletions wait instead: test_drain.py)
    monkeypatch.setenv("ALKFS_DRAIN", "0")
    repo = history(make_repo, "sha1")
    import_repo(app, repo.gitdir, "r", progress=False)
    store = app.store
    d = packs.derived_for(store, "sha1")
    blob = store.add(canonical("blob", b"dead\n"), algo=Algorithm.GIT_SHA1)
    d.build()
    store.sweep(0)
    monkeypatch.setenv("PATH", "/nonexistent")  # git cannot run: the rebuild fails
    assert store.sweep(0).deleted == 1 and not store.has(blob)
    gen = d.current()
    assert gen is not None and gen.files == {} and gen.objects == 0
    assert (d.root / "CURRENT").read_text() == f"{gen.number}\n"
    assert d.last_error is not None


def test_orphans_and_unfinished_builds_are_removed_at_open(tmp_path, make_repo):
    repo = history(make_repo, "sha1", commits=2)
    with Alkfs.open(tmp_path / "s", window_s=0) as app:
        import_repo(app, repo.gitdir, "r", progress=False)
    root = tmp_path / "s" / "derived" / "sha1"
    (root / "tmp-9-1-abc" / "gen" / "pack").mkdir(parents=True)
    (root / "gen-7").mkdir()
    (root / "CURRENT.tmp").write_text("7\n")
    with Alkfs.open(tmp_path / "s", window_s=0) as app:
        d = packs.derived_for(app.store, "sha1")
        assert d.current().number == 1
        assert sorted(p.name for p in root.iterdir()) == ["CURRENT", "PRIMARY", "gen-1"]
        assert pack_ids(d.current()) == store_ids(app, Algorithm.GIT_SHA1)


def test_a_trailer_that_does_not_match_is_refused(app, make_repo, tmp_path):
    repo = history(make_repo, "sha1", commits=2)
    import_repo(app, repo.gitdir, "r", progress=False)
    gen = packs.derived_for(app.store, "sha1").current()
    for rel in gen.files:
        if not rel.endswith((".keep", "-chain")):
            packs.verify_trailer(gen.root / rel, "sha1")
    bad = tmp_path / "bad.pack"
    data = bytearray((gen.root / next(r for r in gen.files if r.endswith(".pack"))).read_bytes())
    data[20] ^= 1
    bad.write_bytes(bytes(data))
    with pytest.raises(StoreIO, match="trailer"):
        packs.verify_trailer(bad, "sha1")


def test_verify_finds_a_published_file_changed_in_place(app, make_repo):
    repo = history(make_repo, "sha1", commits=2)
    import_repo(app, repo.gitdir, "r", progress=False)
    d = packs.derived_for(app.store, "sha1")
    assert d.verify() is None
    idx = next(d.current().root / r for r in d.current().files if r.endswith(".idx"))
    data = bytearray(idx.read_bytes())
    data[1100] ^= 1
    idx.write_bytes(bytes(data))
    assert "trailer checksum" in d.verify()


def test_two_checks_at_once_withdraw_a_corrupt_set_once(app, make_repo, monkeypatch):
    """The mount's start check and a `verify` can find the same corrupt set at once: one
    withdraws it, the other finds it replaced and publishes nothing (before, each
    published an empty set, and a rebuild waited for was another empty one: CI).
    (A store whose kv keeps every object: a set that is the only copy is never
    withdrawn, test_drain.py.)"""
    monkeypatch.setenv("ALKFS_DRAIN", "0")
    repo = history(make_repo, "sha1", commits=2)
    import_repo(app, repo.gitdir, "r", progress=False)
    d = packs.derived_for(app.store, "sha1")
    gen = d.current()
    flip_pack_byte(next(gen.root / r for r in gen.files if r.endswith(".pack")))
    start = threading.Barrier(4)
    found: list[list[str]] = []

    def check() -> None:
        start.wait()
        found.append(packs.verify_sets(app.store))

    threads = [threading.Thread(target=check) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(found) == [[], [], [], ["sha1"]]
    assert d.current().number == gen.number + 1 and d.current().objects == 0
    assert "withdrawn at verify" in d.last_error
    assert d.withdraw(only=gen) is False  # replaced: nothing published
    assert d.current().number == gen.number + 1


def test_a_store_opened_by_a_relative_path_rebuilds_its_packs(tmp_path, make_repo, monkeypatch):
    """A build writes the previous set's directory into an alternates file, which git
    reads relative to the build's own object directory: a store opened as "store" wrote
    a relative path there, pack-objects failed and the packs were withdrawn."""
    repo = history(make_repo, "sha1")
    monkeypatch.chdir(tmp_path)
    with Alkfs.open("store", window_s=0) as app:
        import_repo(app, repo.gitdir, "r", progress=False)
        store = app.store
        d = packs.derived_for(store, "sha1")
        d.build()
        blob = store.add(canonical("blob", b"dead but packed\n"), algo=Algorithm.GIT_SHA1)
        d.build()
        assert store.sweep(0).candidates_staged == 1
        assert store.sweep(0).deleted == 1  # (the set is rebuilt without it first)
        assert d.last_error is None
        gen = d.current()
        assert gen is not None and gen.objects > 0 and blob.digest not in gen
        assert pack_ids(gen) == store_ids(app, Algorithm.GIT_SHA1)
