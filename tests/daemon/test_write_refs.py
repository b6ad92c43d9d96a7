"""Refs and repositories written through a real mount: `git update-ref` with GIT_DIR in
the mount (create, update with an old value, delete; a stale old value refused), ref files
written directly (compare-and-swap against the value at open; EINVAL, EAGAIN), git's
`.lock` + rename protocol, HEAD rewrites, ref directories that come and go with their refs,
and repositories made and removed with mkdir/rmdir, with every errno docs/git.md gives and
the daemon serving normally afterwards.
"""

from __future__ import annotations

import errno
import os
import zlib
from pathlib import Path

import pytest
from helpers import git, git_out, write_close
from helpers import os_errno as errno_of

from alkfs.git.objects import canonical, object_id


def write_file(path: Path, data: bytes) -> None:
    write_close(path, data, replace=True)


def commits(mount, repo: str, n: int) -> list[str]:
    """`n` commits stored through the repository (git writing loose objects with GIT_DIR
    in the mount)."""
    gitdir = mount.path("repos", repo)
    tree = git_out(f"--git-dir={gitdir}", "hash-object", "-w", "-t", "tree", "--stdin", input=b"")
    out = []
    for i in range(n):
        oid = git_out(f"--git-dir={gitdir}", "commit-tree", "-m", f"commit {i}", tree.strip())
        out.append(oid.strip())
    return out


@pytest.fixture
def repo(mount):
    os.mkdir(mount.path("repos", "r"))
    return mount.path("repos", "r")


def test_git_update_ref_creates_updates_and_deletes_and_refuses_a_stale_old_value(mount, repo):
    a, b, c = commits(mount, "r", 3)
    env = {"GIT_DIR": str(repo)}
    git("update-ref", "refs/heads/main", a, env=env)
    assert (repo / "refs" / "heads" / "main").read_text() == f"{a}\n"
    git("update-ref", "refs/heads/main", b, a, env=env)
    assert (repo / "refs" / "heads" / "main").read_text() == f"{b}\n"

    stale = git("update-ref", "refs/heads/main", c, a, env=env, check=False)
    assert stale.returncode != 0
    assert (repo / "refs" / "heads" / "main").read_text() == f"{b}\n"
    stale_delete = git("update-ref", "-d", "refs/heads/main", a, env=env, check=False)
    assert stale_delete.returncode != 0
    assert (repo / "refs" / "heads" / "main").read_text() == f"{b}\n"

    git("update-ref", "refs/tags/deep/v1", c, env=env)
    assert git_out("for-each-ref", "--format=%(objectname) %(refname)", env=env) == (
        f"{b} refs/heads/main\n{c} refs/tags/deep/v1\n"
    )
    git("update-ref", "-d", "refs/heads/main", b, env=env)
    git("update-ref", "-d", "refs/tags/deep/v1", env=env)
    assert not (repo / "refs" / "heads" / "main").exists()
    assert not (repo / "refs" / "tags" / "deep").exists()
    assert git_out("for-each-ref", env=env) == ""
    assert sorted(os.listdir(repo)) == [
        "HEAD",
        "config",
        "objects",
        "packed-refs",
        "refs",
    ]  # no lock
    assert mount.tracebacks() == []


def test_a_ref_file_write_is_a_compare_and_swap_against_the_value_at_open(mount, repo):
    a, b, c = commits(mount, "r", 3)
    main = repo / "refs" / "heads" / "main"
    write_file(main, f"{a}\n".encode())  # a new ref
    assert main.read_text() == f"{a}\n"

    fd = os.open(main, os.O_WRONLY | os.O_TRUNC)  # opened while it holds a
    write_file(main, f"{b}\n".encode())  # another writer moves it meanwhile
    assert errno_of(os.write, fd, f"{c}\n".encode()) == errno.EAGAIN
    os.close(fd)
    assert main.read_text() == f"{b}\n"

    assert errno_of(write_file, main, b"not an oid\n") == errno.EINVAL
    missing = object_id("blob", b"never stored\n")
    assert errno_of(write_file, main, f"{missing}\n".encode()) == errno.EINVAL
    assert errno_of(write_file, repo / "refs" / "heads" / "new", b"zz\n") == errno.EINVAL
    assert main.read_text() == f"{b}\n"
    assert not (repo / "refs" / "heads" / "new").exists()

    os.unlink(main)
    assert not main.exists()
    assert os.listdir(repo / "refs" / "heads") == []
    assert git("--git-dir", repo, "fsck", "--full").returncode == 0
    assert mount.tracebacks() == []


def test_ref_directories_appear_and_vanish_with_their_refs(mount, repo):
    (a,) = commits(mount, "r", 1)
    refs = repo / "refs"
    os.mkdir(refs / "heads" / "team")
    os.mkdir(refs / "heads" / "team" / "empty")
    assert sorted(os.listdir(refs / "heads" / "team")) == ["empty"]
    write_file(refs / "heads" / "team" / "feature", f"{a}\n".encode())
    # refs are listed in packed-refs, not in their directories; they resolve by path
    assert sorted(os.listdir(refs / "heads" / "team")) == ["empty"]
    assert (refs / "heads" / "team" / "feature").read_text() == f"{a}\n"
    assert (refs / "heads" / "team").is_dir()
    assert errno_of(os.rmdir, refs / "heads" / "team") == errno.ENOTEMPTY
    os.rmdir(refs / "heads" / "team" / "empty")
    os.makedirs(refs / "notes" / "x")
    write_file(refs / "notes" / "x" / "y", f"{a}\n".encode())
    assert (refs / "notes" / "x" / "y").read_text() == f"{a}\n"
    os.unlink(refs / "heads" / "team" / "feature")
    assert not (refs / "heads" / "team").exists()
    os.unlink(refs / "notes" / "x" / "y")
    assert sorted(os.listdir(refs)) == ["heads", "tags"]
    assert mount.tracebacks() == []


def test_the_lock_protocol_is_a_compare_and_swap_against_the_value_at_lock_time(mount, repo):
    a, b, c = commits(mount, "r", 3)
    heads = repo / "refs" / "heads"
    write_file(heads / "main", f"{a}\n".encode())

    lock = heads / "main.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    assert errno_of(os.open, lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666) == errno.EEXIST
    os.write(fd, f"{b}\n".encode())
    os.close(fd)
    assert (heads / "main").read_text() == f"{a}\n"  # nothing moves before the rename
    os.rename(lock, heads / "main")
    assert (heads / "main").read_text() == f"{b}\n"
    assert not lock.exists()

    # the ref moves between lock and rename: the rename loses the race
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    os.write(fd, f"{c}\n".encode())
    os.close(fd)
    fd2 = os.open(heads / "main", os.O_WRONLY)
    os.write(fd2, f"{a}\n".encode())
    os.close(fd2)
    assert errno_of(os.rename, lock, heads / "main") == errno.EAGAIN
    assert (heads / "main").read_text() == f"{a}\n"
    os.unlink(lock)  # abandons the lock
    assert not lock.exists()

    # a malformed lock content is refused at rename, nothing moves
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    os.write(fd, b"garbage\n")
    os.close(fd)
    assert errno_of(os.rename, lock, heads / "main") == errno.EINVAL
    os.unlink(lock)
    assert (heads / "main").read_text() == f"{a}\n"
    assert mount.tracebacks() == []


def test_head_is_rewritten_directly_through_its_lock_and_by_git(mount, repo):
    head = repo / "HEAD"
    assert head.read_text() == "ref: refs/heads/main\n"
    write_file(head, b"ref: refs/heads/dev\n")
    assert head.read_text() == "ref: refs/heads/dev\n"
    fd = os.open(repo / "HEAD.lock", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    os.write(fd, b"ref: refs/heads/trunk\n")
    os.close(fd)
    os.rename(repo / "HEAD.lock", head)
    assert head.read_text() == "ref: refs/heads/trunk\n"
    git("symbolic-ref", "HEAD", "refs/heads/main", env={"GIT_DIR": str(repo)})
    assert head.read_text() == "ref: refs/heads/main\n"
    assert errno_of(write_file, head, b"not a ref\n") == errno.EINVAL
    assert head.read_text() == "ref: refs/heads/main\n"
    assert mount.tracebacks() == []


def test_repositories_are_made_and_removed_with_mkdir_and_rmdir_and_every_errno(mount):
    repos = mount.path("repos")
    os.mkdir(repos / "made")
    assert (repos / "made" / "HEAD").read_text() == "ref: refs/heads/main\n"
    assert errno_of(os.mkdir, repos / "made") == errno.EEXIST
    assert errno_of(os.mkdir, repos / "bad!id") == errno.EINVAL
    assert errno_of(os.mkdir, repos / ".hidden") == errno.EINVAL
    (a,) = commits(mount, "made", 1)
    write_file(repos / "made" / "refs" / "heads" / "main", f"{a}\n".encode())
    for plumbing in ("HEAD", "config", "objects/info/alternates"):  # while refs remain
        assert errno_of(os.unlink, repos / "made" / plumbing) == errno.EPERM
    assert errno_of(os.rmdir, repos / "made" / "objects") == errno.EPERM
    assert errno_of(os.rmdir, repos / "made") == errno.ENOTEMPTY
    assert (repos / "made" / "refs" / "heads" / "main").read_text() == f"{a}\n"

    os.unlink(repos / "made" / "refs" / "heads" / "main")
    for plumbing in ("HEAD", "config"):  # no ref left: the plumbing no longer refuses
        os.unlink(repos / "made" / plumbing)
    os.rmdir(repos / "made")
    assert not (repos / "made").exists()
    assert os.listdir(repos) == []

    # a loose object under another name: EIO, and the daemon keeps serving
    os.mkdir(repos / "again")
    data = canonical("blob", b"x\n")
    oid = object_id("blob", b"x\n")
    fan = repos / "again" / "objects" / oid[:2]
    fd = os.open(fan / "tmp_obj_bad", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o444)
    os.write(fd, zlib.compress(data + b"!"))
    os.close(fd)
    assert errno_of(os.link, fan / "tmp_obj_bad", fan / oid[2:]) == errno.EIO
    os.unlink(fan / "tmp_obj_bad")
    assert git("--git-dir", repos / "again", "fsck", "--full").returncode == 0
    assert sorted(os.listdir(repos / "again")) == [
        "HEAD",
        "config",
        "objects",
        "packed-refs",
        "refs",
    ]
    assert mount.tracebacks() == []
