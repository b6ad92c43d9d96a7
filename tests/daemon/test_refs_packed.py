"""Refs as a git repository whose refs are packed (docs/git.md): `packed-refs` lists every
ref (git's format, tags peeled), the refs directories list only refs/heads and refs/tags,
every ref resolves by path, and git's own ref protocol (packed-refs.lock + packed-refs.new,
pack-refs, gc, deletions of every kind) changes exactly what it should — over real mounts
with the real git binary. Also `rm -r` of a repository.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
from helpers import GIT_ENV, git, git_out, pin_target

from alkfs.app import Alkfs
from alkfs.git.importer import import_repo

MANY = 10_000  # refs of the big repository (a GitHub mirror's refs/pull/* shape)


def errno_of(fn, *args) -> int | None:
    try:
        fn(*args)
    except OSError as e:
        return e.errno
    return None


def make_source(path: Path, pulls: int) -> Path:
    """A repository with branches, nested branches, annotated and light tags, a tag of a
    tag, and `pulls` refs/pull/<n>/head refs over a few commits."""
    git("init", "-q", "-b", "main", path)
    for i in range(4):
        (path / f"f{i}").write_text(f"{i}\n")
        git("add", "-A", cwd=path)
        git("commit", "-q", "-m", f"c{i}", cwd=path)
    git("branch", "feature/x", "HEAD~1", cwd=path)
    git("branch", "side", "HEAD~2", cwd=path)
    git("tag", "-a", "-m", "release", "v1", "HEAD~1", cwd=path)
    git("tag", "-a", "-m", "tag of a tag", "v1-signed", "v1", cwd=path)
    git("tag", "light", "HEAD", cwd=path)
    commits = git_out("rev-list", "HEAD", cwd=path).split()
    lines = "".join(f"create refs/pull/{n}/head {commits[n % 4]}\n" for n in range(pulls))
    git("update-ref", "--stdin", cwd=path, input=lines.encode())
    return path / ".git"


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    base = tmp_path_factory.mktemp("refs")
    small, big = make_source(base / "small", 3), make_source(base / "big", MANY)
    store = base / "store"
    with Alkfs.open(store) as app:
        import_repo(app, str(small), "small", progress=False)
        import_repo(app, str(big), "big", progress=False)
    return store, small, big


@pytest.fixture
def served(stored, start_mount, tmp_path):
    """A fresh copy of the module's store, mounted (tests here change refs)."""
    store, small, big = stored
    copy = tmp_path / "store"
    subprocess.run(["cp", "-a", str(store), str(copy)], check=True)
    m = start_mount(copy, "--window", "1h")
    yield m, small, big
    assert m.tracebacks() == []


def refs_of(gitdir) -> str:
    return git_out(f"--git-dir={gitdir}", "for-each-ref", "--format=%(objectname) %(refname)")


def test_packed_refs_is_what_git_pack_refs_writes_and_every_ref_resolves_by_path(served, tmp_path):
    m, small, _ = served
    repo = m.mnt / "repos" / "small"
    # what git itself writes for the same refs
    native = tmp_path / "native.git"
    git("clone", "-q", "--mirror", small, native)
    git(f"--git-dir={native}", "pack-refs", "--all", "--prune")
    want = (native / "packed-refs").read_text().splitlines()[1:]
    got = (repo / "packed-refs").read_text().splitlines()
    assert got[0] == "# pack-refs with: peeled fully-peeled sorted "
    assert got[1:] == want  # every ref, sorted, annotated tags peeled (tag of a tag too)
    assert any(line.startswith("^") for line in got)
    for line in got[1:]:
        if not line.startswith("^"):
            oid, name = line.split()
            assert (repo / name).read_text() == f"{oid}\n"
    assert refs_of(repo) == refs_of(small)
    assert os.listdir(repo / "refs") == ["heads", "tags"]
    assert os.listdir(repo / "refs" / "heads") == []
    assert (repo / "refs" / "heads" / "feature").is_dir()
    assert (repo / "refs" / "pull" / "2").is_dir()
    assert not (repo / "refs" / "pull" / "3").exists()
    assert errno_of(os.stat, repo / "refs" / "heads" / "nope") == errno.ENOENT


def test_ten_thousand_refs_list_read_and_move_like_the_source(served, tmp_path):
    m, _, big = served
    repo = m.mnt / "repos" / "big"
    listed = refs_of(repo)
    assert listed == refs_of(big)
    assert len(listed.splitlines()) == MANY + 6
    assert git_out("ls-remote", repo) == git_out("ls-remote", big)
    assert (repo / "refs" / "pull" / "9999" / "head").read_text().strip() == listed.split()[
        listed.split().index("refs/pull/9999/head") - 1
    ]
    # a one-commit push by path and an incremental fetch
    work = tmp_path / "work"
    git("clone", "-q", big, work)
    (work / "new").write_text("new\n")
    git("add", "-A", cwd=work)
    git("commit", "-q", "-m", "one more", cwd=work)
    git("push", "-q", repo, "HEAD:refs/heads/main", cwd=work)
    head = git_out("rev-parse", "HEAD", cwd=work).strip()
    assert (repo / "refs" / "heads" / "main").read_text() == f"{head}\n"
    assert f"{head} refs/heads/main\n" in (repo / "packed-refs").read_text()
    git("fetch", "-q", repo, "refs/heads/main:refs/remotes/mnt/main", cwd=work)
    assert git_out("rev-parse", "refs/remotes/mnt/main", cwd=work).strip() == head


def test_git_pack_refs_and_gc_inside_the_repository_keep_every_ref(served):
    m, small, _ = served
    repo = m.mnt / "repos" / "small"
    env = {"GIT_DIR": str(repo)}
    # a ref written the loose way just before (git's lock + rename), then packed
    main = git_out("rev-parse", "refs/heads/main", env=env).strip()
    git("update-ref", "refs/heads/fresh", main, env=env)
    before = refs_of(repo)
    assert "refs/heads/fresh" in before
    git("pack-refs", "--all", "--prune", env=env)
    assert refs_of(repo) == before
    git("gc", "-q", env=env)
    assert refs_of(repo) == before
    assert (repo / "refs" / "heads" / "fresh").read_text() == f"{main}\n"
    assert sorted(os.listdir(repo)) == ["HEAD", "config", "objects", "packed-refs", "refs"]


def test_a_pack_git_repack_writes_in_a_repository_is_stored_and_no_longer_listed(served, tmp_path):
    m, small, _ = served
    repo = m.mnt / "repos" / "small"
    env = {"GIT_DIR": str(repo)}
    before = refs_of(repo)
    git("repack", "-adf", "-q", env=env)  # a pack of every object, moved into objects/pack
    assert os.listdir(repo / "objects" / "pack") == []
    assert refs_of(repo) == before
    # a local clone copies no pack of the store (its objects stay reachable in the mount)
    clone = tmp_path / "clone"
    git("clone", "-q", "--bare", repo, clone)
    assert not [p for p in os.listdir(clone / "objects" / "pack") if p.endswith(".pack")]
    check = subprocess.run(
        ["git", "--git-dir", str(clone), "fsck", "--connectivity-only"],
        capture_output=True,
        env={**os.environ, **GIT_ENV},
    )
    assert check.returncode == 0, check.stderr


def test_every_kind_of_git_deletion_deletes_exactly_its_ref(served, tmp_path):
    m, small, _ = served
    repo = m.mnt / "repos" / "small"
    env = {"GIT_DIR": str(repo)}
    start = dict(reversed(line.split()) for line in refs_of(repo).splitlines())

    def gone(*names: str) -> None:
        now = dict(reversed(line.split()) for line in refs_of(repo).splitlines())
        assert now == {k: v for k, v in start.items() if k not in names}
        for name in names:
            assert not (repo / name).exists()
            assert f" {name}\n" not in (repo / "packed-refs").read_text()

    git("update-ref", "-d", "refs/pull/0/head", env=env)
    gone("refs/pull/0/head")
    git("branch", "-D", "side", env=env)
    gone("refs/pull/0/head", "refs/heads/side")
    git("tag", "-d", "light", env=env)
    gone("refs/pull/0/head", "refs/heads/side", "refs/tags/light")
    git(f"--git-dir={small}", "push", "-q", repo, "--delete", "refs/heads/feature/x")
    gone("refs/pull/0/head", "refs/heads/side", "refs/tags/light", "refs/heads/feature/x")
    assert not (repo / "refs" / "heads" / "feature").exists()
    os.unlink(repo / "refs" / "pull" / "1" / "head")  # a user's rm
    gone(
        "refs/pull/0/head",
        "refs/heads/side",
        "refs/tags/light",
        "refs/heads/feature/x",
        "refs/pull/1/head",
    )
    # a stale expected value deletes nothing
    wrong = start["refs/heads/main"]
    other = start["refs/tags/v1"]
    assert wrong != other
    failed = subprocess.run(
        ["git", "update-ref", "-d", "refs/heads/main", other],
        env={**os.environ, **GIT_ENV, **env},
        capture_output=True,
    )
    assert failed.returncode != 0
    assert (repo / "refs" / "heads" / "main").read_text() == f"{wrong}\n"


def test_a_packed_refs_rewrite_deletes_only_what_it_left_out_and_never_a_ref_that_moved(served):
    m, _, _ = served
    repo = m.mnt / "repos" / "small"
    heads = repo / "refs" / "heads"
    main, side = (heads / "main").read_text().strip(), (heads / "side").read_text().strip()
    snapshot = (repo / "packed-refs").read_bytes()

    def rewrite(content: bytes) -> int | None:
        lock = os.open(repo / "packed-refs.lock", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            new = os.open(repo / "packed-refs.new", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            os.write(new, content)
            os.close(new)
            return errno_of(os.rename, repo / "packed-refs.new", repo / "packed-refs")
        finally:
            os.close(lock)
            if (repo / "packed-refs.new").exists():
                os.unlink(repo / "packed-refs.new")
            os.unlink(repo / "packed-refs.lock")

    without_side = b"".join(
        line for line in snapshot.splitlines(keepends=True) if b" refs/heads/side\n" not in line
    )
    # the rewrite races a move of refs/heads/side: it is refused, nothing changes
    lock = os.open(repo / "packed-refs.lock", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    (heads / "side").write_text(f"{main}\n")  # side moves after the lock was taken
    new = os.open(repo / "packed-refs.new", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    os.write(new, without_side)
    os.close(new)
    assert errno_of(os.rename, repo / "packed-refs.new", repo / "packed-refs") == errno.EAGAIN
    os.close(lock)
    os.unlink(repo / "packed-refs.new")
    os.unlink(repo / "packed-refs.lock")
    assert (heads / "side").read_text() == f"{main}\n"
    # a ref created after the lock and absent from the new file is not deleted either
    assert rewrite(snapshot) is None
    assert (heads / "side").read_text() == f"{main}\n"
    # with no race: exactly the left-out ref goes, and a value the file changes is ignored
    current = (repo / "packed-refs").read_bytes()
    edited = current.replace(f"{main} refs/heads/side\n".encode(), b"").replace(
        f"{main} refs/heads/main\n".encode(), f"{side} refs/heads/main\n".encode()
    )
    assert rewrite(edited) is None
    assert not (heads / "side").exists()
    assert (heads / "main").read_text() == f"{main}\n"
    # a ref deleted by someone else after the lock, and left out: the rewrite succeeds
    tag = repo / "refs" / "tags" / "light"
    snap = (repo / "packed-refs").read_bytes()
    lock = os.open(repo / "packed-refs.lock", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    os.unlink(tag)
    new = os.open(repo / "packed-refs.new", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    os.write(new, b"".join(x for x in snap.splitlines(True) if b" refs/tags/light\n" not in x))
    os.close(new)
    assert errno_of(os.rename, repo / "packed-refs.new", repo / "packed-refs") is None
    os.close(lock)
    os.unlink(repo / "packed-refs.lock")
    assert not tag.exists()
    assert rewrite(b"not a packed-refs line\n") == errno.EINVAL
    assert (heads / "main").read_text() == f"{main}\n"


def test_an_open_packed_refs_never_changes_and_the_next_open_sees_a_move_at_once(served):
    m, _, _ = served
    repo = m.mnt / "repos" / "small"
    heads = repo / "refs" / "heads"
    main, side = (heads / "main").read_text().strip(), (heads / "side").read_text().strip()
    with open(repo / "packed-refs", "rb") as old:
        first = old.read()
        ino = os.fstat(old.fileno()).st_ino
        (heads / "main").write_text(f"{side}\n")
        old.seek(0)
        assert old.read() == first
        assert os.fstat(old.fileno()).st_size == len(first)
    now = (repo / "packed-refs").read_bytes()
    assert f"{side} refs/heads/main\n".encode() in now
    assert f"{main} refs/heads/main\n".encode() in first
    assert os.stat(repo / "packed-refs").st_ino != ino


def test_a_ref_is_never_emptied_by_a_truncate_or_an_empty_write(served):
    m, _, _ = served
    repo = m.mnt / "repos" / "small"
    heads = repo / "refs" / "heads"
    main, side = (heads / "main").read_text(), (heads / "side").read_text()
    # coreutils truncate: open(O_WRONLY|O_CREAT), ftruncate(fd, 0), close
    done = subprocess.run(["truncate", "-s", "0", heads / "main"], capture_output=True)
    assert done.returncode == 1 and b"Invalid argument" in done.stderr
    fd = os.open(heads / "main", os.O_WRONLY | os.O_TRUNC)  # `: > REF`: O_TRUNC as any `>`
    os.close(fd)  # nothing written: nothing changed (test_hostile_input's open-flag table)
    fd = os.open(heads / "main", os.O_WRONLY)
    os.ftruncate(fd, 0)
    assert errno_of(os.write, fd, b"not an id\n") == errno.EINVAL
    os.close(fd)  # (the refused write had its errno)
    assert errno_of(os.truncate, heads / "main", 0) == errno.EINVAL
    fd = os.open(heads / "main", os.O_WRONLY)
    assert errno_of(os.ftruncate, fd, 5) == errno.EINVAL  # only to 0, then a new value
    os.close(fd)  # nothing written, not emptied: no change and no error
    done = subprocess.run(["truncate", "-s", "0", repo / "HEAD"], capture_output=True)
    assert done.returncode == 1 and b"Invalid argument" in done.stderr
    assert (heads / "main").read_text() == main
    # a truncate to 0 then a new line is a write of that line (as `>` with O_TRUNC is)
    fd = os.open(heads / "main", os.O_WRONLY)
    os.ftruncate(fd, 0)
    os.write(fd, side.encode())
    os.close(fd)
    assert (heads / "main").read_text() == side
    subprocess.run(["sh", "-c", 'printf "%s" "$2" > "$1"', "sh", heads / "main", main], check=True)
    assert (heads / "main").read_text() == main
    new = heads / "fresh"
    fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # a create: no value
    os.close(fd)  # held nothing before, holds nothing now (as `touch` of a new ref)
    assert not new.exists()
    assert (repo / "HEAD").read_text() == "ref: refs/heads/main\n"
    assert m.tracebacks() == []


def test_bad_ref_writes_get_their_errno_and_change_nothing(served):
    m, _, _ = served
    repo = m.mnt / "repos" / "small"
    heads = repo / "refs" / "heads"
    main = (heads / "main").read_text()
    tree = git_out(f"--git-dir={repo}", "rev-parse", "main^{tree}").strip()
    with pytest.raises(OSError) as caught:
        (heads / "tree").write_text(f"{tree}\n")  # git refuses non-commits under refs/heads
    assert caught.value.errno == errno.EINVAL
    assert not (heads / "tree").exists()
    (repo / "refs" / "tags" / "tree").write_text(f"{tree}\n")  # a tag may name a tree
    bad = os.fsencode(str(heads)) + b"/\xff\xfe"
    assert errno_of(os.open, bad, os.O_WRONLY | os.O_CREAT, 0o644) == errno.EINVAL
    assert errno_of(os.truncate, heads / "main", 0) == errno.EINVAL
    assert (heads / "main").read_text() == main
    fd = os.open(heads / "main", os.O_WRONLY)
    try:
        assert errno_of(os.write, fd, b"0" * (1 << 20)) == errno.EINVAL  # bounded buffer
    finally:
        os.close(fd)
    assert (heads / "main").read_text() == main
    fd = os.open(repo / "HEAD", os.O_WRONLY | os.O_TRUNC)
    long_name = b"ref: refs/heads/" + b"x" * (10 << 20) + b"\n"
    assert errno_of(os.write, fd, long_name) == errno.ENAMETOOLONG
    os.close(fd)  # (the refused write had its errno; the close changes nothing)
    assert (repo / "HEAD").read_text() == "ref: refs/heads/main\n"
    log = m.log()
    assert max(len(line) for line in log.splitlines()) < 2000  # no value quoted whole


def test_rm_r_of_a_repository_removes_it_and_two_sweeps_collect_what_only_it_kept(
    start_mount, tmp_path, populate
):
    src_a = make_source(tmp_path / "a", 2)
    src_b = tmp_path / "b"
    git("clone", "-q", src_a.parent, src_b)
    (src_b / "only-b").write_text("kept by nothing but repository b\n")
    git("add", "-A", cwd=src_b)
    git("commit", "-q", "-m", "b only", cwd=src_b)
    store = tmp_path / "store"
    with Alkfs.open(store) as app:
        import_repo(app, str(src_a), "a", progress=False)
        import_repo(app, str(src_b / ".git"), "b", progress=False)
    only_b = git_out("rev-parse", "HEAD", cwd=src_b).strip()
    blob_b = git_out("rev-parse", "HEAD:only-b", cwd=src_b).strip()
    shared = git_out("rev-parse", "HEAD~1", cwd=src_b).strip()
    m = start_mount(store, "--window", "0")
    mnt = m.mnt
    pinned = mnt / "pins" / "keep"
    pinned.write_bytes(b"a pinned object\n")
    pinned_target = pin_target(pinned)

    subprocess.run(["rm", "-r", str(mnt / "repos" / "b")], check=True, timeout=120)
    assert not (mnt / "repos" / "b").exists()
    assert os.listdir(mnt / "repos") == ["a"]
    for _ in range(2):
        (mnt / ".alkfs" / "control").write_text("sweep\n")
    loose = mnt / "git" / "sha1"
    assert not (loose / only_b[:2] / only_b[2:]).exists()
    assert not (loose / blob_b[:2] / blob_b[2:]).exists()
    assert (loose / shared[:2] / shared[2:]).exists()  # repository a still keeps it
    assert pin_target(pinned) == pinned_target
    assert pinned.read_bytes() == b"a pinned object\n"
    check = subprocess.run(
        ["git", "--git-dir", str(mnt / "repos" / "a"), "fsck", "--full"],
        capture_output=True,
        env={**os.environ, **GIT_ENV},
    )
    assert check.returncode == 0, check.stderr
    assert m.tracebacks() == []
