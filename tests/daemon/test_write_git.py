"""git writing objects through a real mount: pushes into /repos/<id> (quarantine, migration,
fsck, clones equal to the pusher), alternates users committing against /git/<format>
(nothing the mount has is copied), git's own loose-object writes into /git/<format>
verified against their names (EIO and nothing stored on a mismatch), the pins that keep a
push alive until its ref commits, and pushes racing a sweep loop with `--window 0`.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import threading
import time
import zlib
from pathlib import Path

import pytest
from helpers import GIT_ENV, git, git_out

from alkfs.git.objects import canonical, object_id

RACE_S = 20.0  # how long pushes run against the sweep loop


def fast_import(
    gitdir: Path, branch: str, commits: int, files: int, *, seed: str, parent: str | None = None
) -> str:
    """Append `commits` commits to `branch`, each adding `files` new blobs (content unique
    to `seed`); returns the new tip."""
    out = []
    for i in range(commits):
        out.append(f"commit refs/heads/{branch}\n")
        out.append("committer C O Mitter <c@example.com> 1700000000 +0000\n")
        msg = f"{seed} {i}\n".encode()
        out.append(f"data {len(msg)}\n{msg.decode()}")
        if i == 0 and parent:
            out.append(f"from {parent}\n")
        for j in range(files):
            data = f"{seed} commit {i} file {j}\n".encode() * (1 + j % 3)
            out.append(f"M 100644 inline d{i % 7}/{seed}-{i}-{j}.txt\ndata {len(data)}\n")
            out.append(data.decode() + "\n")
    git(f"--git-dir={gitdir}", "fast-import", "--quiet", input="".join(out).encode())
    return git_out(f"--git-dir={gitdir}", "rev-parse", f"refs/heads/{branch}").strip()


def source_repo(path: Path, fmt: str = "sha1") -> Path:
    """A bare repository with main (30 commits x 8 files), feature/x, an annotated and a
    lightweight tag: ~340 objects."""
    git("init", "-q", "--bare", f"--object-format={fmt}", "-b", "main", path)
    main = fast_import(path, "main", 30, 8, seed="main")
    fast_import(path, "feature/x", 5, 4, seed="feature", parent=main)
    git(f"--git-dir={path}", "tag", "-a", "-m", "release one", "v1", "main~3")
    git(f"--git-dir={path}", "tag", "light", "feature/x")
    return path


def refs_of(gitdir: Path) -> str:
    return git_out(f"--git-dir={gitdir}", "for-each-ref", "--format=%(objectname) %(refname)")


def objects_listed(gitdir: Path) -> list[str]:
    return sorted(git_out(f"--git-dir={gitdir}", "rev-list", "--objects", "--all").splitlines())


def local_loose(objects: Path) -> set[str]:
    """Ids of the loose objects a repository holds itself (not through alternates)."""
    out = set()
    for xx in objects.iterdir():
        if re.fullmatch(r"[0-9a-f]{2}", xx.name):
            out |= {xx.name + f.name for f in xx.iterdir() if re.fullmatch(r"[0-9a-f]+", f.name)}
    return out


def sweep(mount) -> None:
    with open(mount.path(".alkfs", "control"), "w") as f:
        f.write("sweep\n")


def loose_path(mount, fmt: str, oid: str) -> Path:
    return mount.path("git", fmt, oid[:2], oid[2:])


def scratch_of(mount) -> Path:
    """The daemon's scratch area: STORE/scratch, or a fleet member's (a PostgreSQL store)
    STORE/nodes/<its id>/scratch."""
    fleet = json.loads(mount.path(".alkfs", "status").read_text())["fleet"]
    if fleet is None:
        return mount.store_path / "scratch"
    return mount.store_path / "nodes" / fleet["self"] / "scratch"


def assert_clean(mount, repo: str) -> None:
    """fsck --full through the mount is clean and no scratch is left behind."""
    gitdir = mount.path("repos", repo)
    git(f"--git-dir={gitdir}", "fsck", "--full", "--no-dangling")
    assert sorted(os.listdir(gitdir / "objects")) == ["info", "pack"]
    assert os.listdir(scratch_of(mount)) == []
    assert "Warning" not in mount.all_logs()  # -X dev: no unclosed file, no other warning


# -- pushes -----------------------------------------------------------------------------------
def test_a_push_of_branches_tags_and_hundreds_of_objects_clones_back_identically(mount, tmp_path):
    src = source_repo(tmp_path / "src.git")
    assert len(objects_listed(src)) > 300
    os.mkdir(mount.path("repos", "r1"))
    git(f"--git-dir={src}", "push", "-q", mount.path("repos", "r1"), "main", "feature/x", "--tags")

    assert_clean(mount, "r1")
    # more than git's unpack limit (100): one pack, kept as a pack of the set (a fleet's
    # store, on PostgreSQL: stored object by object at migration)
    pushed = len(objects_listed(src))
    on_postgres = os.environ.get("ALKFS_TEST_DATABASE") == "postgresql"
    how = "stored" if on_postgres else "kept as a pack"
    assert f"repository r1: {how} {pushed} object(s) of a pushed pack" in mount.log()
    clone = tmp_path / "clone.git"
    git("clone", "-q", "--mirror", mount.path("repos", "r1"), clone)
    assert refs_of(clone) == refs_of(src)
    assert objects_listed(clone) == objects_listed(src)
    git(f"--git-dir={clone}", "fsck", "--full", "--no-dangling")
    assert mount.tracebacks() == []


def test_a_second_push_sends_only_new_objects_and_moves_the_ref(mount, tmp_path):
    src = source_repo(tmp_path / "src.git")
    os.mkdir(mount.path("repos", "r2"))
    git(f"--git-dir={src}", "push", "-q", mount.path("repos", "r2"), "main")
    old = git_out(f"--git-dir={src}", "rev-parse", "main").strip()
    new = fast_import(src, "main", 3, 5, seed="again", parent=old)
    git(f"--git-dir={src}", "push", "-q", mount.path("repos", "r2"), "main")
    assert mount.path("repos", "r2", "refs", "heads", "main").read_text() == f"{new}\n"
    assert_clean(mount, "r2")


def test_a_push_into_a_sha256_repository_created_by_the_library(
    start_mount, store_database, tmp_path
):
    from alkfs.app import Alkfs

    store = tmp_path / "store"
    with Alkfs.open(store, database=store_database(store)) as app:
        app.refs.create_repo("r256", "sha256")
    mount = start_mount(store)
    src = source_repo(tmp_path / "src.git", "sha256")
    git(f"--git-dir={src}", "push", "-q", mount.path("repos", "r256"), "main", "--tags")
    assert_clean(mount, "r256")
    clone = tmp_path / "clone.git"
    git("clone", "-q", "--mirror", mount.path("repos", "r256"), clone)
    pushed = [line for line in refs_of(src).splitlines() if "refs/heads/feature" not in line]
    assert refs_of(clone).splitlines() == pushed
    assert mount.tracebacks() == []


def test_mkdir_then_the_format_attribute_makes_a_sha256_repository_git_pushes_into(mount, tmp_path):
    gitdir = mount.path("repos", "m256")
    os.mkdir(gitdir)
    assert os.listxattr(gitdir) == ["user.alkfs.object-format"]
    assert os.getxattr(gitdir, "user.alkfs.object-format") == b"sha1"
    assert "objectformat" not in (gitdir / "config").read_text()
    # the kernel now holds config, refs/, objects/ and a fan-out made for sha1
    assert sorted(os.listdir(gitdir / "refs")) == ["heads", "tags"]
    assert os.path.isdir(gitdir / "objects" / "ab")
    os.setxattr(gitdir, "user.alkfs.object-format", b"sha256")
    assert os.getxattr(gitdir, "user.alkfs.object-format") == b"sha256"
    assert "\tobjectformat = sha256\n" in (gitdir / "config").read_text()
    assert git_out(f"--git-dir={gitdir}", "rev-parse", "--show-object-format") == "sha256\n"

    src = source_repo(tmp_path / "src.git", "sha256")
    git(f"--git-dir={src}", "push", "-q", gitdir, "main", "--tags")
    assert_clean(mount, "m256")
    tip = git_out(f"--git-dir={src}", "rev-parse", "main").strip()
    assert (gitdir / "refs" / "heads" / "main").read_text() == f"{tip}\n"
    assert len(tip) == 64

    # once a ref exists the format is fixed; bad values and other names are refused
    for name, value, code in [
        ("user.alkfs.object-format", b"sha1", errno.ENOTEMPTY),
        ("user.alkfs.object-format", b"md5", errno.EINVAL),
        ("user.alkfs.other", b"x", errno.ENOTSUP),
    ]:
        with pytest.raises(OSError) as caught:
            os.setxattr(gitdir, name, value)
        assert caught.value.errno == code, name
    with pytest.raises(OSError) as caught:
        os.removexattr(gitdir, "user.alkfs.object-format")
    assert caught.value.errno == errno.EPERM
    assert os.getxattr(gitdir, "user.alkfs.object-format") == b"sha256"
    assert git_out(f"--git-dir={gitdir}", "rev-parse", "main") == f"{tip}\n"
    assert mount.tracebacks() == []


# -- pins -------------------------------------------------------------------------------------
def test_objects_written_into_a_repository_stay_pinned_until_a_ref_there_commits(mount, tmp_path):
    os.mkdir(mount.path("repos", "p"))
    gitdir = mount.path("repos", "p")
    (tmp_path / "kept").write_bytes(b"written into the repository\n")
    (tmp_path / "free").write_bytes(b"written through the git view\n")
    (tmp_path / "tip").write_bytes(b"the ref's own object\n")
    kept = git_out(f"--git-dir={gitdir}", "hash-object", "-w", tmp_path / "kept").strip()
    plain = tmp_path / "plain.git"
    git("init", "-q", "--bare", plain)
    free = git_out(
        f"--git-dir={plain}",
        "hash-object",
        "-w",
        tmp_path / "free",
        env={"GIT_OBJECT_DIRECTORY": str(mount.path("git", "sha1"))},
    ).strip()
    assert loose_path(mount, "sha1", kept).exists() and loose_path(mount, "sha1", free).exists()
    sweep(mount)
    sweep(mount)  # window 0: staged by the first, deleted by the second unless kept
    assert loose_path(mount, "sha1", kept).exists()
    assert not loose_path(mount, "sha1", free).exists()

    # A ref write in that repository (by another process: the writer has exited) commits:
    # the pins go, and the object nothing references goes with the next two sweeps.
    tip = git_out(f"--git-dir={gitdir}", "hash-object", "-w", tmp_path / "tip").strip()
    git(f"--git-dir={gitdir}", "update-ref", "refs/tags/tip", tip)
    sweep(mount)
    sweep(mount)
    assert not loose_path(mount, "sha1", kept).exists()
    assert loose_path(mount, "sha1", tip).exists()
    assert mount.tracebacks() == []


def test_pushes_racing_a_sweep_loop_lose_no_reachable_object(mount, tmp_path):
    src = tmp_path / "src.git"
    git("init", "-q", "--bare", "-b", "main", src)
    tip = fast_import(src, "main", 4, 6, seed="base")
    os.mkdir(mount.path("repos", "race"))
    os.mkdir(mount.path("repos", "race2"))
    stop = threading.Event()
    sweeps = []
    errors: list[BaseException] = []

    def sweeper() -> None:
        try:
            while not stop.is_set():
                sweep(mount)
                sweeps.append(1)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=sweeper)
    thread.start()
    pushes = 0
    try:
        deadline = time.monotonic() + RACE_S
        while time.monotonic() < deadline:
            # every third round is large enough (> 100 objects) to arrive as a pack
            big = pushes % 3 == 0
            tip = fast_import(
                src, "main", 12 if big else 2, 8 if big else 6, seed=f"round{pushes}", parent=tip
            )
            git(f"--git-dir={src}", "branch", "-f", f"b{pushes % 3}", tip)
            git(f"--git-dir={src}", "push", "-q", "-f", mount.path("repos", "race"), "main")
            target = mount.path("repos", "race2")
            git(f"--git-dir={src}", "push", "-q", "-f", target, f"b{pushes % 3}")
            pushes += 1
    finally:
        stop.set()
        thread.join()
    assert errors == []
    assert pushes >= 3 and len(sweeps) >= 3
    sweep(mount)
    sweep(mount)
    for repo in ("race", "race2"):
        assert_clean(mount, repo)
        clone = tmp_path / f"{repo}.git"
        git("clone", "-q", "--mirror", mount.path("repos", repo), clone)
        assert refs_of(clone) == "".join(
            line + "\n"
            for line in refs_of(src).splitlines()
            if line.split()[1] in {r.split()[1] for r in refs_of(clone).splitlines()}
        )
        for line in refs_of(clone).splitlines():
            oid, name = line.split()
            assert sorted(
                git_out(f"--git-dir={clone}", "rev-list", "--objects", name).splitlines()
            ) == sorted(git_out(f"--git-dir={src}", "rev-list", "--objects", oid).splitlines())
    assert mount.tracebacks() == []


# -- alternates users --------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_a_commit_through_alternates_copies_nothing_the_mount_has(mount, tmp_path, fmt):
    work = tmp_path / "work"
    git("init", "-q", "-b", "main", f"--object-format={fmt}", work)
    (work / "src").mkdir()
    (work / "README").write_text("hello\n")
    (work / "src" / "a.txt").write_text("a\n")
    git("add", "-A", cwd=work)
    git("commit", "-q", "-m", "root", cwd=work)
    base = git_out("rev-parse", "HEAD", cwd=work).strip()
    # git's own loose-object writes store every object in the mount's git view
    pack = subprocess.run(
        ["git", "pack-objects", "--all", "--revs", "--stdout"],
        cwd=work,
        input=b"",
        capture_output=True,
        check=True,
        env={**os.environ, **GIT_ENV},
    ).stdout
    view = mount.path("git", fmt)
    git("unpack-objects", "-q", cwd=work, input=pack, env={"GIT_OBJECT_DIRECTORY": str(view)})
    for line in git_out("rev-list", "--objects", "--all", cwd=work).splitlines():
        assert loose_path(mount, fmt, line.split()[0]).exists()

    user = tmp_path / "user"
    git("init", "-q", "-b", "main", f"--object-format={fmt}", user)
    (user / ".git" / "objects" / "info" / "alternates").write_text(f"{view}\n")
    git("update-ref", "refs/heads/main", base, cwd=user)
    git("reset", "-q", "--hard", "main", cwd=user)
    before = local_loose(user / ".git" / "objects")
    assert before == set()

    (user / "README").write_text("hello again\n")  # a new blob
    (user / "copy-of-a.txt").write_text("a\n")  # a blob the mount already has
    git("add", "-A", cwd=user)
    git("commit", "-q", "-m", "second", cwd=user)
    commit = git_out("rev-parse", "HEAD", cwd=user).strip()
    tree = git_out("rev-parse", "HEAD^{tree}", cwd=user).strip()
    blob = object_id("blob", b"hello again\n", fmt)
    existing = object_id("blob", b"a\n", fmt)
    assert local_loose(user / ".git" / "objects") == {commit, tree, blob}
    assert loose_path(mount, fmt, existing).exists()
    for oid in (commit, tree, blob):
        assert not loose_path(mount, fmt, oid).exists()
    git("fsck", "--full", "--no-dangling", cwd=user)
    assert mount.tracebacks() == []


def test_touch_of_a_loose_file_in_either_view_freshens_it(mount, tmp_path):
    os.mkdir(mount.path("repos", "t"))
    (tmp_path / "f").write_bytes(b"freshen me\n")
    oid = git_out(
        f"--git-dir={mount.path('repos', 't')}", "hash-object", "-w", tmp_path / "f"
    ).strip()
    for path in (
        loose_path(mount, "sha1", oid),
        mount.path("repos", "t", "objects", oid[:2], oid[2:]),
    ):
        os.utime(path, (1, 1))
        os.utime(path)
    assert mount.tracebacks() == []


# -- verification -------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["git/sha1", "repos/v/objects"])
def test_a_loose_object_linked_under_another_name_fails_with_eio_and_stores_nothing(
    mount, tmp_path, where
):
    os.mkdir(mount.path("repos", "v"))
    data = canonical("blob", b"the real content\n")
    oid = object_id("blob", b"the real content\n")
    wrong = oid[:-1] + ("0" if oid[-1] != "0" else "1")
    fan = mount.path(*where.split("/"), oid[:2])
    for content, name in ((zlib.compress(data), wrong), (b"not zlib at all", oid)):
        tmp = fan / "tmp_obj_test01"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o444)
        os.write(fd, content)
        os.fsync(fd)
        os.close(fd)
        with pytest.raises(OSError) as link_err:
            os.link(tmp, fan / name[2:])
        assert link_err.value.errno == errno.EIO
        with pytest.raises(OSError) as rename_err:
            os.rename(tmp, fan / name[2:])
        assert rename_err.value.errno == errno.EIO
        os.unlink(tmp)
        assert not tmp.exists()
    assert not mount.path("objects", "git-sha1", wrong).exists()
    assert not mount.path("objects", "git-sha1", oid).exists()

    # the daemon goes on serving, and the right name stores it
    tmp = fan / "tmp_obj_test02"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o444)
    os.write(fd, zlib.compress(data))
    os.close(fd)
    os.link(tmp, fan / oid[2:])
    os.unlink(tmp)
    assert mount.path("objects", "git-sha1", oid).read_bytes() == data
    assert zlib.decompress((fan / oid[2:]).read_bytes()) == data
    assert mount.tracebacks() == []


@pytest.mark.not_on_postgres(
    "STORE/scratch is a single daemon's: a fleet member's is new each start"
)
def test_the_scratch_area_is_emptied_when_the_daemon_starts(start_mount, tmp_path):
    store = tmp_path / "store"
    (store / "scratch" / "old").mkdir(parents=True)
    (store / "scratch" / "old" / "tmp_obj_left").write_bytes(b"a killed daemon's scratch")
    mount = start_mount(store)
    assert os.listdir(store / "scratch") == []
    assert mount.tracebacks() == []
