"""Git LFS through a real mount with stock git and git-lfs (docs/lfs.md): media pushed to a
`file://` remote in /repos/<id> are sha256 objects, clones pull them back, `lfs.storage`
in /lfs is one deduplicated store that `git lfs prune` cannot empty, and sweeps keep
exactly the media that a pointer reachable from some ref (or a borrower) names."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import GIT_ENV, git, git_out, status, sweep

pytestmark = pytest.mark.skipif(shutil.which("git-lfs") is None, reason="needs git-lfs")

MB5 = 5_000_000


@pytest.fixture
def lfs_env(tmp_path: Path) -> dict[str, str]:
    """git with a global config of its own, where `git lfs install` writes its filters."""
    home = tmp_path / "home"
    home.mkdir()
    env = {
        **os.environ,
        **GIT_ENV,
        "HOME": str(home),
        "GIT_CONFIG_GLOBAL": str(home / ".gitconfig"),
        "GIT_TERMINAL_PROMPT": "0",
    }
    git("lfs", "install", env=env)
    return env


def work(env: dict[str, str], path: Path, media: dict[str, bytes]) -> Path:
    """A work tree tracking *.bin with git-lfs, with `media` committed on main."""
    git_out("init", "-q", "-b", "main", path, env=env)
    git_out("lfs", "track", "*.bin", cwd=path, env=env)
    for name, content in media.items():
        (path / name).write_bytes(content)
    git_out("add", ".", cwd=path, env=env)
    git_out("commit", "-q", "-m", "media", cwd=path, env=env)
    return path


def oid(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def stored(m, content: bytes) -> bool:
    return m.path("objects", "sha256", oid(content)).exists()


def test_the_tour_push_clone_pull_and_fsck_through_the_mount(mount, tmp_path, lfs_env):
    a, b = os.urandom(MB5), os.urandom(MB5)
    w = work(lfs_env, tmp_path / "w", {"a.bin": a, "b.bin": b})
    os.mkdir(mount.path("repos", "r"))
    git_out("push", f"file://{mount.path('repos', 'r')}", "main", cwd=w, env=lfs_env)
    for content in (a, b):  # the media, byte for byte, as sha256 objects
        assert mount.path("objects", "sha256", oid(content)).read_bytes() == content
        lfs_path = mount.path("lfs", "objects", oid(content)[:2], oid(content)[2:4], oid(content))
        assert lfs_path.stat().st_size == MB5
    pointer = git_out("cat-file", "-p", "HEAD:a.bin", cwd=w, env=lfs_env)  # the blob is the pointer
    assert (
        pointer == f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid(a)}\nsize {MB5}\n"
    )
    clone = tmp_path / "clone"
    git_out("clone", "-q", mount.path("repos", "r"), clone, env=lfs_env)
    git_out("lfs", "pull", cwd=clone, env=lfs_env)
    assert (clone / "a.bin").read_bytes() == a and (clone / "b.bin").read_bytes() == b
    assert "Git LFS fsck OK" in git_out("lfs", "fsck", cwd=clone, env=lfs_env)
    assert "Git LFS fsck OK" in git_out("lfs", "fsck", cwd=w, env=lfs_env)
    assert os.listdir(mount.path("lfs", "objects")) == []  # resolves all, lists nothing
    assert mount.tracebacks() == []


def test_two_repositories_store_media_once_and_prune_in_shared_storage_deletes_nothing(
    mount, tmp_path, lfs_env
):
    shared = os.urandom(300_000)
    for name in ("one", "two"):
        w = work(lfs_env, tmp_path / name, {"m.bin": shared})
        os.mkdir(mount.path("repos", name))
        git_out("push", f"file://{mount.path('repos', name)}", "main", cwd=w, env=lfs_env)
    assert status(mount)["objects"]["sha256"]["count"] == 1  # stored once
    storage = mount.path("lfs")
    own = {}
    for i in range(3):  # three clones sharing lfs.storage in the mount
        clone = tmp_path / f"c{i}"
        git_out("init", "-q", "-b", "main", clone, env=lfs_env)
        git_out("config", "lfs.storage", storage, cwd=clone, env=lfs_env)
        git_out("lfs", "track", "*.bin", cwd=clone, env=lfs_env)
        own[i] = os.urandom(50_000 + i)
        (clone / f"own{i}.bin").write_bytes(own[i])
        (clone / "shared.bin").write_bytes(shared)
        git_out("add", ".", cwd=clone, env=lfs_env)
        git_out("commit", "-q", "-m", "x", cwd=clone, env=lfs_env)
        assert stored(mount, own[i])  # `git add` wrote it through /lfs
    for i in range(3):
        done = git("lfs", "prune", "--verbose", cwd=tmp_path / f"c{i}", env=lfs_env)
        out = (done.stdout + done.stderr).decode()
        assert "0 local objects" in out, out
    for content in [shared, *own.values()]:
        assert stored(mount, content)
    assert status(mount)["objects"]["sha256"]["count"] == 4


def test_sweeps_keep_referenced_media_and_drop_it_after_its_last_branch(
    start_mount, tmp_path, lfs_env
):
    mount = start_mount(None, "--window", "0", "--push-grace", "1s")
    keep, drop, both = os.urandom(100_000), os.urandom(100_001), os.urandom(100_002)
    w = work(lfs_env, tmp_path / "w", {"keep.bin": keep, "both.bin": both})
    git_out("checkout", "-q", "-b", "side", cwd=w, env=lfs_env)
    (w / "drop.bin").write_bytes(drop)
    git_out("add", ".", cwd=w, env=lfs_env)
    git_out("commit", "-q", "-m", "side", cwd=w, env=lfs_env)
    other = work(lfs_env, tmp_path / "other", {"both.bin": both})
    for repo, src, refs in (("r", w, ("main", "side")), ("o", other, ("main",))):
        os.mkdir(mount.path("repos", repo))
        git_out("push", f"file://{mount.path('repos', repo)}", *refs, cwd=src, env=lfs_env)
    time.sleep(2.5)  # the uploads' push grace is over: only the pointers keep the media
    for _ in range(3):
        assert sweep(mount)["aborted"] is None
    assert all(stored(mount, c) for c in (keep, drop, both))
    os.unlink(mount.path("repos", "r", "refs", "heads", "side"))  # the last branch reaching drop
    first = sweep(mount)
    assert stored(mount, drop), first  # staged, not yet deleted
    second = sweep(mount)
    assert not stored(mount, drop), second
    assert stored(mount, keep) and stored(mount, both)
    os.unlink(mount.path("repos", "r", "refs", "heads", "main"))
    sweep(mount)
    sweep(mount)
    assert not stored(mount, keep)
    assert mount.path("objects", "sha256", oid(both)).read_bytes() == both  # the other repo's


def test_media_uploaded_before_the_push_survives_sweeps_within_the_push_grace(
    mount, tmp_path, lfs_env
):
    content = os.urandom(200_000)
    w = work(lfs_env, tmp_path / "w", {"m.bin": content})
    os.mkdir(mount.path("repos", "r"))
    remote = f"file://{mount.path('repos', 'r')}"
    git_out("lfs", "push", "--object-id", remote, oid(content), cwd=w, env=lfs_env)  # media only
    assert stored(mount, content)
    # another push to the same repository (a ref written) does not end the media's grace
    other = work(lfs_env, tmp_path / "other", {"o.bin": os.urandom(1000)})
    git_out("push", remote, "main:refs/heads/other", cwd=other, env=lfs_env)
    for _ in range(3):
        sweep(mount)
    assert stored(mount, content)  # (the window is 0: the push grace keeps it)
    git_out("push", remote, "main", cwd=w, env=lfs_env)
    for _ in range(3):
        sweep(mount)
    assert mount.path("objects", "sha256", oid(content)).read_bytes() == content


def test_media_of_an_unpushed_commit_in_a_registered_repository_survives(
    start_mount, tmp_path, lfs_env
):
    mount = start_mount(None, "--window", "0", "--push-grace", "1s")
    content = os.urandom(150_000)
    repo = tmp_path / "borrower"
    git_out("init", "-q", "-b", "main", repo, env=lfs_env)
    git_out("config", "lfs.storage", mount.path("lfs"), cwd=repo, env=lfs_env)
    os.symlink(str(repo), mount.path("roots", "b"))
    git_out("lfs", "track", "*.bin", cwd=repo, env=lfs_env)
    (repo / "m.bin").write_bytes(content)
    git_out("add", ".", cwd=repo, env=lfs_env)
    git_out("commit", "-q", "-m", "not pushed", cwd=repo, env=lfs_env)
    time.sleep(2.5)  # the push grace of what `git add` wrote through /lfs is over
    for _ in range(3):
        assert sweep(mount)["aborted"] is None
    assert mount.path("objects", "sha256", oid(content)).read_bytes() == content
    os.unlink(mount.path("roots", "b"))
    sweep(mount)
    sweep(mount)
    assert not stored(mount, content)


RACE_ROUNDS = 12


def test_a_pointer_pushed_while_sweeps_run_keeps_its_media(start_mount, tmp_path, lfs_env):
    """Pushes of new media (git-lfs uploads, then git pushes the pointer; the upload's pins
    go when the push's ref commits) against a loop of sweeps with a zero window: every
    pushed media stays."""
    m = start_mount(None, "--window", "0")
    w = work(lfs_env, tmp_path / "w", {"seed.bin": os.urandom(1000)})
    os.mkdir(m.path("repos", "r"))
    remote = f"file://{m.path('repos', 'r')}"
    git_out("push", remote, "main", cwd=w, env=lfs_env)
    stop = threading.Event()
    reports: list[dict] = []

    def sweeper() -> None:
        while not stop.is_set():
            reports.append(sweep(m))

    t = threading.Thread(target=sweeper)
    t.start()
    pushed: list[bytes] = []
    try:
        for i in range(RACE_ROUNDS):
            content = os.urandom(20_000 + i)
            (w / f"r{i}.bin").write_bytes(content)
            git_out("add", ".", cwd=w, env=lfs_env)
            git_out("commit", "-q", "-m", f"round {i}", cwd=w, env=lfs_env)
            git_out("push", remote, "main", cwd=w, env=lfs_env)
            pushed.append(content)
    finally:
        stop.set()
        t.join(timeout=120)
    assert len(reports) >= 3, reports
    for _ in range(3):
        sweep(m)
    missing = [i for i, c in enumerate(pushed) if not stored(m, c)]
    assert missing == []
    assert m.tracebacks() == []


def test_a_rename_onto_the_wrong_oid_stores_nothing_and_fails_with_eio(mount):
    tmp = mount.path("lfs", "tmp", "upload")
    tmp.write_bytes(b"not what the name says\n")
    wrong = oid(b"something else")
    target = mount.path("lfs", "objects", wrong[:2], wrong[2:4], wrong)
    with pytest.raises(OSError) as caught:
        os.rename(tmp, target)
    assert caught.value.errno == 5  # EIO
    assert not mount.path("objects", "sha256", wrong).exists()
    assert not mount.path("objects", "sha256", oid(b"not what the name says\n")).exists()
    assert mount.proc.poll() is None


ALKFS = Path(sys.executable).parent / "alkfs"


def test_import_through_the_mount_stores_the_media_and_names_what_is_absent(
    mount, tmp_path, lfs_env
):
    """A repository with LFS history: its media (in .git/lfs/objects) are stored as
    sha256 objects with the pointers, a pointer whose media it lacks is named, and after
    sweeps the imported refs keep them."""
    a, b = os.urandom(120_000), os.urandom(130_000)
    w = work(lfs_env, tmp_path / "w", {"a.bin": a, "b.bin": b})
    lost = oid(b"never uploaded")  # a pointer committed as it is: git-lfs keeps it
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{lost}\nsize 14\n"
    (w / "lost.bin").write_text(pointer)
    git_out("add", ".", cwd=w, env=lfs_env)
    git_out("commit", "-q", "-m", "more", cwd=w, env=lfs_env)
    assert git_out("cat-file", "-p", "HEAD:lost.bin", cwd=w, env=lfs_env) == pointer
    done = subprocess.run(
        [str(ALKFS), "--mount", mount.mnt, "git", "import", w / ".git", "--repo", "imp"],
        capture_output=True,
        env={k: v for k, v in lfs_env.items() if not k.startswith("ALKFS_")},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    said = done.stdout.decode()
    assert "LFS media: 3 named by pointers (2 stored, 0 already present, 1 absent" in said, said
    for content in (a, b):
        assert mount.path("objects", "sha256", oid(content)).read_bytes() == content
    for _ in range(3):
        sweep(mount)
    assert stored(mount, a) and stored(mount, b)


def test_a_fleet_media_pushed_through_one_member_swept_through_the_other(
    start_pg_mount, tmp_path, lfs_env
):
    """Two daemons on one PostgreSQL store: the pointer rows are shared, so sweeps through
    the member that did not see the push keep the media while a ref reaches it, and drop
    it two sweeps after the branch is deleted through the first."""
    store = tmp_path / "store"
    m1 = start_pg_mount(store, "--window", "0", "--push-grace", "1s", mnt=tmp_path / "mnt1")
    m2 = start_pg_mount(store, "--window", "0", mnt=tmp_path / "mnt2")
    content = os.urandom(250_000)
    w = work(lfs_env, tmp_path / "w", {"m.bin": content})
    os.mkdir(m1.path("repos", "r"))
    git_out("push", f"file://{m1.path('repos', 'r')}", "main", cwd=w, env=lfs_env)
    time.sleep(2.5)  # the upload's push grace is over: only the pointer keeps the media
    for _ in range(3):
        assert sweep(m2)["aborted"] is None
    assert m2.path("objects", "sha256", oid(content)).read_bytes() == content
    os.unlink(m1.path("repos", "r", "refs", "heads", "main"))
    sweep(m2)
    sweep(m2)
    assert not stored(m2, content)
    for m in (m1, m2):
        assert m.tracebacks() == [], m.all_logs()


def test_a_staged_medium_looked_up_through_a_repository_stays_for_the_push_grace(mount):
    """git-lfs looks a medium up before it decides not to upload it (the server has it),
    and the pointer comes with the push after: a staged medium found there is kept."""
    content = os.urandom(5000)
    with open(mount.path("objects", "sha256", "new"), "wb") as f:
        f.write(content)
    os.mkdir(mount.path("repos", "r"))
    sweep(mount)  # staged: nothing names it
    h = oid(content)
    assert mount.path("repos", "r", "lfs", "objects", h[:2], h[2:4], h).stat().st_size == 5000
    for _ in range(3):
        sweep(mount)
    assert mount.path("objects", "sha256", h).read_bytes() == content
