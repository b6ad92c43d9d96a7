"""A commit staged for deletion, left out of a set into its staged pack, then made live
again before the sweep that would delete it (which cancels its deletion): its descendants
are packed by the next builds, and none of them fails. (It used to wedge packing for
good: the second intake after it asked `git commit-graph write --split` for a commit
whose ancestor is in no graph layer nor in any pack of the set, and git failed with
"could not read" that ancestor at every build after, so nothing new was ever packed.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import git, git_out, status

from alkfs.app import Alkfs
from alkfs.git import packs
from alkfs.git.importer import import_repo
from alkfs.git.objects import canonical
from alkfs.git.refs import RefUpdate
from alkfs.keys import Algorithm

# no intake of its own: the test's repacks are the only builds
NO_INTAKE = {"ALKFS_PACK_EVERY": "3600", "ALKFS_PACK_POLL": "0.2"}


def commit(work: Path, name: str) -> str:
    """A commit on the checked-out branch of `work` that adds one file; its id."""
    (work / f"{name}.txt").write_text(f"{name}\n" + "".join(f"line {i}\n" for i in range(50)))
    git("-C", work, "add", f"{name}.txt")
    git("-C", work, "commit", "-q", "-m", name)
    return git_out("-C", work, "rev-parse", "HEAD").strip()


def control(m, command: str) -> None:
    m.path(".alkfs", "control").write_text(command + "\n")


def published_meta(store: Path) -> dict:
    """alkfs.json of the published sha1 set."""
    d = store / "derived" / "sha1"
    return json.loads((d / f"gen-{int((d / 'CURRENT').read_text())}" / "alkfs.json").read_text())


def packed(mnt: Path) -> set[str]:
    """Every id the idx files listed in MNT/git/sha1/pack hold (`git show-index`)."""
    out: set[str] = set()
    pack_dir = mnt / "git" / "sha1" / "pack"
    for name in sorted(os.listdir(pack_dir)):
        if name.endswith(".idx"):
            with open(pack_dir / name, "rb") as f:
                text = subprocess.run(
                    ["git", "show-index"], stdin=f, capture_output=True, check=True
                ).stdout.decode()
            out.update(line.split()[1] for line in text.splitlines())
    return out


@pytest.mark.parametrize("packed_first", [False, True], ids=["loose", "packed"])
def test_a_commit_made_live_again_before_its_deletion_never_wedges_packing(
    start_mount, tmp_path, packed_first
):
    """X is left out of the set as a candidate (`loose`: never packed; `packed`: packed,
    then moved to the set's staged pack, which the cancelled sweep's guard drops)."""
    m = start_mount(tmp_path / "store", "--window", "0", env=NO_INTAKE)
    repo = m.path("repos", "r")
    os.mkdir(repo)
    work = tmp_path / "work"
    git("init", "-q", "-b", "main", work)
    for i in range(20):  # (enough that the builds below are intakes, not consolidations)
        commit(work, f"history-{i}")
    git("-C", work, "push", "-q", repo, "main")
    control(m, "repack")

    # X: pushed to a branch, the branch deleted, X staged by a sweep
    git("-C", work, "checkout", "-q", "-b", "tmp")
    x = commit(work, "x")
    git("-C", work, "push", "-q", repo, "tmp")
    if packed_first:
        control(m, "repack")
        assert x in packed(m.mnt)
    git("-C", work, "push", "-q", repo, ":tmp")
    control(m, "sweep")
    assert status(m)["last_sweep"]["candidates_staged"] == 3  # X, its tree, its blob
    control(m, "repack")  # (X is left out: in the set's staged pack if it was packed)
    assert (x in packed(m.mnt)) == packed_first

    # X live again before the sweep that takes it: that sweep cancels its deletion
    git("-C", work, "push", "-q", repo, "tmp:main")
    control(m, "sweep")
    report = status(m)["last_sweep"]
    assert report["deleted"] == 0 and report["cancelled_by_arbitration"] >= 3, report

    # Y on X, then Z on Y, each pushed and packed by an intake: no build fails
    y = commit(work, "y")
    git("-C", work, "push", "-q", repo, "tmp:main")
    control(m, "repack")
    z = commit(work, "z")
    git("-C", work, "push", "-q", repo, "tmp:main")
    control(m, "repack")  # (it failed with EIO: "git commit-graph failed (128)")
    packs = status(m)["packs"]["sha1"]
    assert packs["last_error"] is None, packs
    assert published_meta(m.store_path)["mode"] == "intake"  # (a layer over the others)

    # every object reachable from the refs is packed, and git finds all of it
    listed = git_out("-C", work, "rev-list", "--objects", "tmp").splitlines()
    reachable = {line.split()[0] for line in listed}
    assert {x, y, z} <= reachable <= packed(m.mnt)
    user = tmp_path / "user"
    git("init", "-q", "--bare", user)
    (user / "objects" / "info" / "alternates").write_text(f"{m.mnt}/git/sha1\n")
    git(f"--git-dir={user}", "update-ref", "refs/heads/main", z)
    git(f"--git-dir={user}", "fsck", "--full", "--strict", "--no-dangling")
    git(f"--git-dir={user}", "commit-graph", "verify", f"--object-dir={m.mnt}/git/sha1")
    git(f"--git-dir={user}", "multi-pack-index", f"--object-dir={m.mnt}/git/sha1", "verify")

    # and a later object is packed too (the builds after it go on)
    w = commit(work, "w")
    git("-C", work, "push", "-q", repo, "tmp:main")
    control(m, "repack")
    assert w in packed(m.mnt)
    assert status(m)["packs"]["sha1"]["last_error"] is None
    assert m.tracebacks() == [], m.all_logs()[-3000:]


def test_a_grandchild_of_a_staged_commit_stays_out_of_the_intakes_graph(tmp_path):
    """Library level: X in the set's staged pack and live again (still staged), Y on X and
    Z on Y each packed by an intake. Y's layer cannot hold Y (its parent is staged), and
    neither may Z's: git would add Y and X to it, reading them from the packs, and a
    layer naming a staged commit keeps the sweep from merely dropping the staged pack
    (or, with X in no pack of the set, fails the build). The sweep that takes X (live:
    cancelled) drops the staged pack; the next intake packs X again."""
    src = tmp_path / "src.git"
    git("init", "-q", "--bare", "-b", "main", src)
    stream = []
    for i in range(20):
        stream.append(
            f"commit refs/heads/main\ncommitter C <c@example.com> {1700000000 + i} +0000\n"
        )
        stream.append(f"data 4\nc{i:02d}\nM 100644 inline f{i}.txt\ndata 3\n{i:02d}\n\n")
    stream.append("commit refs/heads/side\ncommitter C <c@example.com> 1700000100 +0000\n")
    stream.append("data 4\nside\nfrom refs/heads/main\nM 100644 inline side.txt\ndata 2\nx\n\n")
    git(f"--git-dir={src}", "fast-import", "--quiet", input=("".join(stream)).encode())
    x = git_out(f"--git-dir={src}", "rev-parse", "side").strip()
    x_tree = git_out(f"--git-dir={src}", "rev-parse", "side^{tree}").strip()
    with Alkfs.open(tmp_path / "store", window_s=0) as app:
        store = app.store
        import_repo(app, str(src), "r", progress=False)
        d = packs.derived_for(store, "sha1")
        assert d is not None and bytes.fromhex(x) in d.current()
        [out] = app.refs.update("r", [RefUpdate("refs/heads/side", None, x)])
        assert out.ok and store.sweep(0).candidates_staged == 3
        d.build()  # (X moves to the staged pack)
        assert not d.current().main_holds(bytes.fromhex(x))
        [out] = app.refs.update("r", [RefUpdate("refs/heads/side", x, None)])
        assert out.ok  # X live again, still staged

        def child(parent: str, msg: str) -> str:
            body = (
                f"tree {x_tree}\nparent {parent}\n"
                "author A <a@example.com> 1700000200 +0000\n"
                f"committer A <a@example.com> 1700000200 +0000\n\n{msg}\n"
            ).encode()
            key = store.add(canonical("commit", body), algo=Algorithm.GIT_SHA1)
            d.build()
            assert d.current().meta["mode"] == "intake"
            return key.hex

        y = child(x, "y")
        z = child(y, "z")
        gen = d.current()
        graphed = {c.hex() for c in gen.graph_commits()}
        assert {x, y, z}.isdisjoint(graphed)
        user = tmp_path / "user"
        git("init", "-q", "--bare", user)
        (user / "objects" / "info" / "alternates").write_text(f"{gen.root}\n")
        git(f"--git-dir={user}", "commit-graph", "verify", f"--object-dir={gen.root}")

        [out] = app.refs.update("r", [RefUpdate("refs/heads/side", z, x)])
        assert out.ok
        before = gen.number
        report = store.sweep(0)  # takes X: live, cancelled; the set without the staged pack
        assert (report.deleted, report.cancelled_by_arbitration) == (0, 3), report
        assert (d.current().number, d.current().meta["mode"]) == (before + 1, "drop")
        assert bytes.fromhex(x) not in d.current()
        d.build()  # the next intake packs X again
        gen = d.current()
        assert gen.meta["mode"] == "intake" and gen.main_holds(bytes.fromhex(x))
        stored = {raw[1:] for raw in store.iter_keys() if raw[0] == Algorithm.GIT_SHA1.value}
        assert stored == gen.digests()
        (user / "objects" / "info" / "alternates").write_text(f"{gen.root}\n")
        git(f"--git-dir={user}", "update-ref", "refs/heads/side", z)
        git(f"--git-dir={user}", "fsck", "--full", "--strict", "--no-dangling")
        git(f"--git-dir={user}", "commit-graph", "verify", f"--object-dir={gen.root}")
        git(f"--git-dir={user}", "multi-pack-index", f"--object-dir={gen.root}", "verify")


def test_a_failed_commit_graph_write_leaves_the_layers_as_they_were(tmp_path, monkeypatch):
    """Library level: git refusing the new layer (here: asked for a commit whose parent
    is in no pack) no longer fails the build with the temporary file it left: the set is
    published with its layers as they were, and git verifies it."""
    src = tmp_path / "src.git"
    git("init", "-q", "--bare", "-b", "main", src)
    stream = []
    for i in range(10):
        stream.append(
            f"commit refs/heads/main\ncommitter C <c@example.com> {1700000000 + i} +0000\n"
        )
        stream.append(f"data 4\nc{i:02d}\nM 100644 inline f{i}.txt\ndata 3\n{i:02d}\n\n")
    git(f"--git-dir={src}", "fast-import", "--quiet", input=("".join(stream)).encode())
    tree = git_out(f"--git-dir={src}", "rev-parse", "main^{tree}").strip()
    with Alkfs.open(tmp_path / "store", window_s=0) as app:
        store = app.store
        import_repo(app, str(src), "r", progress=False)
        d = packs.derived_for(store, "sha1")
        assert d is not None
        before = d.current()
        assert before is not None
        layers = before.graph_commits()
        body = (
            f"tree {tree}\nparent {'1' * 40}\n"
            "author A <a@example.com> 1700000200 +0000\n"
            "committer A <a@example.com> 1700000200 +0000\n\nan orphan's child\n"
        ).encode()
        orphan = store.add(canonical("commit", body), algo=Algorithm.GIT_SHA1)
        # (every commit graphable: the layer is asked for the orphan's child)
        monkeypatch.setattr(packs.intake, "_graphable", lambda commits, known=None: sorted(commits))
        result = d.build()
        assert result is not None and result.mode == "intake"
        gen = d.current()
        assert gen is not None and orphan.digest in gen and gen.graph_commits() == layers
        assert sorted(gen.names_in("info/commit-graphs")) == sorted(
            before.names_in("info/commit-graphs")
        )
        user = tmp_path / "user"
        git("init", "-q", "--bare", user)
        (user / "objects" / "info" / "alternates").write_text(f"{gen.root}\n")
        git(f"--git-dir={user}", "commit-graph", "verify", f"--object-dir={gen.root}")
        git(f"--git-dir={user}", "multi-pack-index", f"--object-dir={gen.root}", "verify")
