"""A push's received pack kept as a pack of the set (packs/adopt.py `keep_pack`): indexed
again by the daemon with `index-pack --fsck-objects`, its objects pinned for the push, and
published beside the set's packs — never once more in the kv. A thin push (completed by
receive-pack with bases the set holds) publishes only what the set lacks; a pack whose
objects git's fsck refuses is refused whole (EIO), nothing published or stored.

Only a store of one process keeps pushed packs as packs: a fleet's (PostgreSQL) stores
their objects in the kv, as before (tests/daemon/test_write_git.py checks both).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from helpers import git, git_out

from alkfs.git.packs import MAX_PACKS

pytestmark = pytest.mark.not_on_postgres("a fleet's store keeps pushed objects in the kv")


def published(store: Path) -> dict:
    """alkfs.json of the published sha1 set ({} before there is one)."""
    d = store / "derived" / "sha1"
    if not (d / "CURRENT").exists():
        return {}
    return json.loads((d / f"gen-{int((d / 'CURRENT').read_text())}" / "alkfs.json").read_text())


def status(mount) -> dict:
    return json.loads(mount.path(".alkfs", "status").read_text())


def objects_of(gitdir: Path) -> list[str]:
    return sorted(git_out(f"--git-dir={gitdir}", "rev-list", "--objects", "--all").splitlines())


def files_repo(path: Path, files: int, edit: str = "") -> Path:
    """A work tree of `files` files of ~4 KiB each, committed (again with line 7 of every
    file changed when `edit` is given: blobs git sends as deltas against the first)."""
    if not path.exists():
        git("init", "-q", "-b", "main", path)
    for i in range(files):
        lines = [f"file {i} line {n}: {'x' * (40 + (i * n) % 23)}\n" for n in range(64)]
        if edit:
            lines[7] = f"file {i} edited: {edit}\n"
        (path / f"f{i:03}.txt").write_text("".join(lines))
    git("add", "-A", cwd=path)
    env = {"GIT_AUTHOR_DATE": "1700000000 +0000", "GIT_COMMITTER_DATE": "1700000000 +0000"}
    git(
        "-c",
        "user.name=A",
        "-c",
        "user.email=a@x",
        "commit",
        "-q",
        "-m",
        edit or "first",
        cwd=path,
        env=env,
    )
    return path


def test_a_pushed_pack_is_kept_as_a_pack_and_no_object_enters_the_kv(mount, tmp_path):
    src = files_repo(tmp_path / "src", 150)
    os.mkdir(mount.path("repos", "r"))
    git("push", "-q", mount.path("repos", "r"), "main", cwd=src)

    pushed = objects_of(src / ".git")
    assert len(pushed) == 152  # 150 blobs, a tree, a commit: past git's unpack limit (100)
    assert f"repository r: kept as a pack {len(pushed)} object(s)" in mount.log()
    meta = published(mount.store_path)
    assert meta["mode"] == "keep" and meta["objects"] == len(pushed)
    counts = status(mount)["objects"]["git-sha1"]
    assert counts["kv"] == 0 and counts["packs"] == len(pushed)
    clone = tmp_path / "clone.git"
    git("clone", "-q", "--mirror", mount.path("repos", "r"), clone)
    assert objects_of(clone) == pushed
    git(f"--git-dir={clone}", "fsck", "--full", "--strict", "--no-dangling")
    git(f"--git-dir={mount.path('repos', 'r')}", "fsck", "--full", "--no-dangling")
    assert mount.tracebacks() == []


def test_a_thin_push_publishes_only_what_the_set_lacks(mount, tmp_path):
    src = files_repo(tmp_path / "src", 150)
    os.mkdir(mount.path("repos", "r"))
    git("push", "-q", mount.path("repos", "r"), "main", cwd=src)
    first = published(mount.store_path)["objects"]
    files_repo(src, 150, edit="second")
    # git sends the 150 edited blobs as deltas against blobs the mount has (a thin pack);
    # receive-pack appends those bases, which the set already holds: they are not packed again
    git("push", "-q", mount.path("repos", "r"), "main", cwd=src)

    pushed = objects_of(src / ".git")
    assert len(pushed) == first + 152
    meta = published(mount.store_path)
    assert meta["mode"] == "keep" and meta["objects"] == len(pushed)
    assert status(mount)["objects"]["git-sha1"]["kv"] == 0
    clone = tmp_path / "clone.git"
    git("clone", "-q", "--mirror", mount.path("repos", "r"), clone)
    assert objects_of(clone) == pushed
    assert git_out(f"--git-dir={clone}", "rev-parse", "main") == git_out(
        "rev-parse", "main", cwd=src
    )
    git(f"--git-dir={clone}", "fsck", "--full", "--strict", "--no-dangling")
    assert mount.tracebacks() == []


def test_a_pack_git_fsck_refuses_is_refused_whole_and_nothing_is_stored(mount, tmp_path):
    work = tmp_path / "work.git"
    git("init", "-q", "--bare", work)
    blobs = [
        git_out(
            f"--git-dir={work}", "hash-object", "-w", "--stdin", input=f"blob {i}\n".encode()
        ).strip()
        for i in range(120)
    ]
    # a commit without a tree: git's fsck calls that an error (missingTree)
    bad = git_out(
        f"--git-dir={work}",
        "hash-object",
        "-t",
        "commit",
        "--literally",
        "-w",
        "--stdin",
        input=b"author A <a@x> 1700000000 +0000\ncommitter A <a@x> 1700000000 +0000\n\nno tree\n",
    ).strip()
    ids = "".join(f"{x}\n" for x in [*blobs, bad]).encode()
    name = git_out(
        f"--git-dir={work}", "pack-objects", "-q", str(tmp_path / "p"), input=ids
    ).strip()
    os.mkdir(mount.path("repos", "r"))
    pack_dir = mount.path("repos", "r", "objects", "pack")
    before = published(mount.store_path)

    shutil.copyfile(tmp_path / f"p-{name}.pack", pack_dir / f"pack-{name}.pack")
    shutil.copyfile(tmp_path / f"p-{name}.idx", pack_dir / "tmp_idx_x")
    with pytest.raises(OSError) as err:  # (git moves the index in last: the pack arrives)
        os.rename(pack_dir / "tmp_idx_x", pack_dir / f"pack-{name}.idx")
    assert err.value.errno == errno.EIO

    assert published(mount.store_path) == before
    assert not mount.path("git", "sha1", bad[:2], bad[2:]).exists()
    assert not mount.path("git", "sha1", blobs[0][:2], blobs[0][2:]).exists()
    assert status(mount)["objects"]["git-sha1"]["kv"] == 0
    assert "git index-pack --fsck-objects refused the objects" in mount.log()
    assert mount.tracebacks() == []


def set_packs(store: Path) -> int:
    """How many packs the published sha1 set has."""
    d = store / "derived" / "sha1"
    return len(list(d.glob(f"gen-{int((d / 'CURRENT').read_text())}/pack/*.pack")))


def test_more_than_max_packs_kept_pushes_are_consolidated_into_one(start_mount, tmp_path):
    """Each push kept as a pack adds one to the set; past MAX_PACKS (12) the intake
    consolidates them into one pack (no kv arrival asks for a build)."""
    m = start_mount(env={"ALKFS_PACK_EVERY": "0", "ALKFS_PACK_POLL": "0.1"})
    src = tmp_path / "src"
    os.mkdir(m.path("repos", "r"))
    for i in range(MAX_PACKS + 1):
        files_repo(src, 110, edit=f"round {i}")
        git("push", "-q", m.path("repos", "r"), "main", cwd=src)
    assert m.log().count("repository r: kept as a pack") == MAX_PACKS + 1
    deadline = time.monotonic() + 60
    while set_packs(m.store_path) != 1:
        assert time.monotonic() < deadline, "the kept packs were never consolidated"
        time.sleep(0.1)
    pushed = objects_of(src / ".git")
    assert published(m.store_path)["objects"] == len(pushed)
    assert status(m)["objects"]["git-sha1"]["kv"] == 0
    clone = tmp_path / "clone.git"
    git("clone", "-q", "--mirror", m.path("repos", "r"), clone)
    assert objects_of(clone) == pushed
    assert m.tracebacks() == []
