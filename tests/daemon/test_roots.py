"""Borrowers (docs/gc.md, "Clones that borrow") through a real mount: a local clone of
`/repos/<id>` reads its objects through alternates into `/git/<format>`, and `git gc` in it
drops its own copies of what the store has. Registered under `/roots` (or with
`alkfs roots add`), every sweep keeps what it reaches: its branches, packed refs, reflogs,
index, stash, worktrees, detached HEAD, pseudo-refs and what its own unpushed objects name.
Unregistered, the objects of a branch the server deleted are collected from under it. A root
that is gone is dropped after `ALKFS_ROOTS_GRACE`; one that cannot be read, or was
registered on another machine, ends every sweep `protect-failed` and deletes nothing.

Every git here runs with GIT_ENV's fixed dates (2023): `git gc` then expires every reflog
entry they write, so what keeps an object alive in a borrower is exactly what a test set
up; a test that needs a reflog entry gc keeps writes it with the clock's date (`fresh`).
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import GIT_ENV, os_errno, put, status, sweep

ALKFS = str(Path(sys.executable).with_name("alkfs"))


@pytest.fixture
def new_mount(start_mount, populate, tmp_path):
    """new_mount(store=None, mnt=None, env=None) -> Mount: start_mount (`--window 0`) on
    `store`, made beforehand through the library when not given."""
    count = itertools.count(1)

    def start(store: Path | None = None, mnt: Path | None = None, env: dict | None = None):
        if store is None:
            store = tmp_path / f"store-{next(count)}"
            populate(store)
        return start_mount(store, mnt=mnt, env=env)

    return start


@pytest.fixture
def mount(new_mount):
    """A daemon with `--window 0` on a fresh store (made first: whether the daemon makes a
    missing store itself is not what these tests are about)."""
    return new_mount()


# -- git -------------------------------------------------------------------------------------
def g(
    *args, cwd=None, check=True, fresh=False, env=None, stdin=None, input=None
) -> subprocess.CompletedProcess:
    """git with GIT_ENV; `fresh`: with the clock's dates (reflog entries `git gc` keeps)."""
    full = {**os.environ, **GIT_ENV, **(env or {})}
    if fresh:
        del full["GIT_AUTHOR_DATE"], full["GIT_COMMITTER_DATE"]
    done = subprocess.run(
        ["git", *map(str, args)],
        cwd=cwd,
        env=full,
        stdin=stdin,
        input=input,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check:
        assert done.returncode == 0, (args, done.stderr)
    return done


def out(*args, **kw) -> str:
    return g(*args, **kw).stdout.strip()


def commit(work: Path, name: str, text: str, **kw) -> str:
    """A commit in `work` writing `text` into `name`; its id."""
    (work / name).write_text(text)
    g("-C", work, "add", name, **kw)
    g("-C", work, "commit", "-q", "-m", f"{name}: {text.strip()}", **kw)
    return out("-C", work, "rev-parse", "HEAD")


def serve(m, tmp_path: Path, repo: str = "r", fmt: str = "sha1") -> Path:
    """MNT/repos/<repo> with main (two commits), pushed from a plain repository (which it
    returns: it owns its objects and can push more)."""
    src = tmp_path / f"src-{repo}"
    g("init", "-q", "-b", "main", f"--object-format={fmt}", src)
    commit(src, "a.txt", "alpha\n")
    commit(src, "b.txt", "beta\n")
    os.mkdir(m.path("repos", repo))
    if fmt != "sha1":
        os.setxattr(m.path("repos", repo), "user.alkfs.object-format", fmt.encode())
    g("-C", src, "push", "-q", m.path("repos", repo), "main")
    g("-C", src, "remote", "add", "origin", m.path("repos", repo))
    return src


def borrow(m, dest: Path, repo: str = "r", fmt: str = "sha1") -> Path:
    """A local clone of MNT/repos/<repo>: it borrows (its alternates name the mount)."""
    g("clone", "-q", m.path("repos", repo), dest)
    alternates = (dest / ".git" / "objects" / "info" / "alternates").read_text().split()
    assert alternates == [str(m.path("git", fmt))]
    return dest


def repack(m) -> None:
    """Publish the store's derived packs now: `git gc` in a borrower then drops its loose
    copies of every object the store has (prune-packed sees them in the alternates' packs)."""
    m.path(".alkfs", "control").write_text("repack\n")


def gc(work: Path) -> None:
    g("-C", work, "gc", "-q", "--prune=now")


def strand(m, work: Path, branch: str = "topic", name: str = "t.txt") -> str:
    """In the borrower `work`: a commit on a new `branch` off main, pushed, then the branch
    deleted on the server (and with it origin/<branch>); work is back on main, and its
    local `branch` is what still names the commit. Returns the commit."""
    g("-C", work, "switch", "-q", "-c", branch, "main")
    tip = commit(work, name, f"{branch} only\n")
    g("-C", work, "push", "-q", "origin", branch)
    g("-C", work, "push", "-q", "origin", "--delete", branch)
    g("-C", work, "switch", "-q", "main")
    assert not m.path("repos", "r", "refs", "heads", branch).exists()
    repack(m)
    return tip


def new_objects(work: Path, tip: str, *exclude: str) -> list[str]:
    """Every object `tip` reaches and `exclude` (default main) do not."""
    listed = out("-C", work, "rev-list", "--objects", tip, "--not", *(exclude or ("main",)))
    return [line.split()[0] for line in listed.splitlines()]


def local_ids(work: Path) -> set[str]:
    """Ids of the objects the repository holds itself (loose and packed), not through its
    alternates."""
    objects = work / ".git" / "objects"
    ids = set()
    for fan in objects.iterdir():
        if re.fullmatch(r"[0-9a-f]{2}", fan.name):
            ids |= {fan.name + f.name for f in fan.iterdir() if not f.name.startswith("tmp")}
    for idx in (objects / "pack").glob("*.idx"):
        with open(idx, "rb") as f:
            listed = out("-C", work, "show-index", stdin=f)
        ids |= {line.split()[1] for line in listed.splitlines()}
    return ids


def stored(m, oid: str) -> bool:
    return m.path("objects", "git-sha256" if len(oid) == 64 else "git-sha1", oid).exists()


def fsck_clean(work: Path) -> None:
    done = g("-C", work, "fsck", "--full", "--no-dangling", check=False)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    assert "missing" not in text and "Could not read" not in text and "error" not in text, text


def register(m, name: str, path: Path) -> None:
    os.symlink(str(path), m.path("roots", name))
    assert os.readlink(m.path("roots", name)) == str(path)


def sweeps(m, n: int = 3) -> list[dict]:
    """`n` sweeps, none aborted."""
    reports = [sweep(m) for _ in range(n)]
    for report in reports:
        assert report["aborted"] is None, report
        assert "detail" not in report, report
    return reports


def orphan(m) -> str:
    """An object nothing names (a sweep stages it, the next deletes it); its sha256 hex."""
    return put(m, b"an orphan " + os.urandom(16) + b"\n")


def orphan_stored(m, hexid: str) -> bool:
    return m.path("objects", "sha256", hexid).exists()


def roots_listed(m) -> dict[str, str]:
    return {
        name: os.readlink(m.path("roots", name)) for name in sorted(os.listdir(m.path("roots")))
    }


# -- the tour: registered, the clone stays whole; unregistered, it loses the branch -------------
@pytest.mark.parametrize("registered", [True, False], ids=["registered", "unregistered"])
def test_a_borrowing_clone_keeps_a_server_deleted_branch_only_when_registered(
    mount, tmp_path, registered
):
    serve(mount, tmp_path)
    work = borrow(mount, tmp_path / "work")
    g("-C", work, "switch", "-q", "-c", "topic")
    tip = commit(work, "t.txt", "topic\n")
    g("-C", work, "push", "-q", "origin", "topic")
    g("-C", work, "push", "-q", "origin", "--delete", "topic")
    g("-C", work, "switch", "-q", "main")
    gc(work)
    repack(mount)  # (the derived packs hold the pushed objects now)
    gc(work)
    counts = dict(line.split(": ") for line in out("-C", work, "count-objects", "-v").splitlines())
    assert (counts["count"], counts["in-pack"]) == ("0", "0"), counts
    assert local_ids(work) == set()
    held = new_objects(work, tip)
    assert len(held) == 3 and all(stored(mount, oid) for oid in held)  # commit, tree, blob
    if registered:
        register(mount, "work", work)
    extra = orphan(mount)
    reports = sweeps(mount)
    assert not orphan_stored(mount, extra)  # the sweeps collect
    if registered:
        assert sum(r["deleted"] for r in reports) == 1, reports
        assert all(stored(mount, oid) for oid in held)
        fsck_clean(work)
        assert out("-C", work, "log", "--format=%H", "topic").splitlines()[0] == tip
        assert status(mount)["roots"] == 1
    else:
        assert sum(r["deleted"] for r in reports) == 1 + len(held), reports
        assert not any(stored(mount, oid) for oid in held)
        done = g("-C", work, "fsck", "--full", check=False)
        assert done.returncode != 0 and f"Could not read {tip}" in done.stderr, done.stderr
        done = g("-C", work, "log", "topic", check=False)
        assert done.returncode != 0 and "bad object topic" in done.stderr, done.stderr
    assert mount.tracebacks() == []


# -- the main case: an unpushed commit on top of a branch the server deleted -------------------
@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_an_unpushed_commit_keeps_the_whole_history_of_a_server_deleted_branch(
    mount, tmp_path, fmt
):
    src = serve(mount, tmp_path, fmt=fmt)
    g("-C", src, "switch", "-q", "-c", "feature")
    f1 = commit(src, "f1.txt", "feature one\n")
    f2 = commit(src, "f2.txt", "feature two\n")
    g("-C", src, "push", "-q", "origin", "feature")
    work = borrow(mount, tmp_path / "work", fmt=fmt)
    g("-C", work, "switch", "-q", "feature")
    assert out("-C", work, "rev-parse", "HEAD") == f2
    mine = commit(work, "mine.txt", "not pushed\n")
    g("-C", src, "push", "-q", "origin", "--delete", "feature")  # (from another repository)
    g("-C", work, "fetch", "-q", "--prune")
    assert out("-C", work, "for-each-ref", "--format=%(refname)") == "\n".join(
        ["refs/heads/feature", "refs/heads/main", "refs/remotes/origin/HEAD"]
        + ["refs/remotes/origin/main"]
    )
    repack(mount)
    gc(work)
    feature = new_objects(work, f2)
    assert len(feature) == 6  # two commits, two trees, two blobs
    assert {len(oid) for oid in feature} == {40 if fmt == "sha1" else 64}
    own = local_ids(work)
    assert set(new_objects(work, mine, f2)) <= own  # the unpushed commit is the clone's
    assert not own & set(feature)  # the feature's history is the store's alone
    register(mount, "work", work)
    extra = orphan(mount)
    reports = sweeps(mount)
    assert sum(r["deleted"] for r in reports) == 1 and not orphan_stored(mount, extra), reports
    assert all(stored(mount, oid) for oid in feature)
    fsck_clean(work)
    log = out("-C", work, "log", "--format=%H", "feature").splitlines()
    assert log[:3] == [mine, f2, f1] and len(log) == 5
    assert mount.tracebacks() == []


# -- each kind of root ------------------------------------------------------------------------
def kind_branch(work: Path, tip: str) -> Callable[[], None]:
    return lambda: g("-C", work, "branch", "-q", "-D", "topic")


def kind_packed_ref(work: Path, tip: str) -> Callable[[], None]:
    g("-C", work, "pack-refs", "--all")
    assert not (work / ".git" / "refs" / "heads" / "topic").exists()
    assert f"{tip} refs/heads/topic" in (work / ".git" / "packed-refs").read_text()
    return lambda: g("-C", work, "branch", "-q", "-D", "topic")


def kind_reflog(work: Path, tip: str) -> Callable[[], None]:
    g("-C", work, "branch", "-q", "-D", "topic")
    g("-C", work, "checkout", "-q", "--detach", tip, fresh=True)
    g("-C", work, "checkout", "-q", "main", fresh=True)
    assert tip in (work / ".git" / "logs" / "HEAD").read_text()
    return lambda: g(
        "-C", work, "reflog", "expire", "--expire=now", "--expire-unreachable=now", "--all"
    )


def kind_index(work: Path, tip: str) -> Callable[[], None]:
    blob = out("-C", work, "rev-parse", f"{tip}:t.txt")
    g("-C", work, "branch", "-q", "-D", "topic")
    (work / "copy.txt").write_text("topic only\n")  # the blob only the store has
    g("-C", work, "add", "copy.txt")
    assert out("-C", work, "ls-files", "-s", "copy.txt").split()[1] == blob
    return lambda: g("-C", work, "reset", "-q")


def kind_index_v4(work: Path, tip: str) -> Callable[[], None]:
    undo = kind_index(work, tip)
    g("-C", work, "update-index", "--index-version", "4")
    assert (work / ".git" / "index").read_bytes()[:8] == b"DIRC\0\0\0\4"
    return undo


def kind_split_index(work: Path, tip: str) -> Callable[[], None]:
    kind_index(work, tip)
    g("-C", work, "update-index", "--split-index")
    assert list((work / ".git").glob("sharedindex.*"))

    def undo() -> None:
        g("-C", work, "update-index", "--no-split-index")
        g("-C", work, "reset", "-q")
        # (git leaves the shared part for splitIndex.sharedIndexExpire, two weeks, and the
        # borrower keeps what it names meanwhile: expire it now)
        for shared in (work / ".git").glob("sharedindex.*"):
            shared.unlink()

    return undo


def kind_resolve_undo(work: Path, tip: str) -> Callable[[], None]:
    """A conflict resolved with `git add`: the index's resolve-undo extension (REUC) keeps
    the conflicting stages' blobs, and `git gc` keeps them (`git checkout -m` restores
    the conflict from them)."""
    blob = out("-C", work, "rev-parse", f"{tip}:t.txt")
    g("-C", work, "branch", "-q", "-D", "topic")
    info = f"100644 {blob} 1\tc.txt\n100644 {blob} 2\tc.txt\n"
    g("-C", work, "update-index", "--index-info", input=info)
    (work / "c.txt").write_text("resolved\n")
    g("-C", work, "add", "c.txt")
    assert blob in out("-C", work, "ls-files", "--resolve-undo")

    def undo() -> None:  # (a reset keeps the resolve-undo records: they are cleared)
        g("-C", work, "update-index", "--clear-resolve-undo")
        g("-C", work, "reset", "-q")

    return undo


def kind_stash(work: Path, tip: str) -> Callable[[], None]:
    g("-C", work, "switch", "-q", "topic")
    (work / "t.txt").write_text("changed, stashed\n")
    g("-C", work, "stash", "-q", fresh=True)  # (a stash is its reflog: gc must keep it)
    # (its `reset --hard` wrote ORIG_HEAD and a fresh entry into HEAD's reflog: other kinds)
    g("-C", work, "reflog", "expire", "--expire=now", "--expire-unreachable=now", "HEAD")
    (work / ".git" / "ORIG_HEAD").unlink()
    g("-C", work, "switch", "-q", "main")
    g("-C", work, "branch", "-q", "-D", "topic")
    assert out("-C", work, "rev-parse", "stash^1") == tip
    return lambda: g("-C", work, "stash", "drop", "-q")


def kind_worktree_head(work: Path, tip: str) -> Callable[[], None]:
    wt = work.parent / "wt"
    g("-C", work, "worktree", "add", "-q", "--detach", wt, tip)
    g("-C", work, "branch", "-q", "-D", "topic")
    assert (wt / ".git").is_file()
    return lambda: g("-C", work, "worktree", "remove", "--force", wt)


def kind_detached_head(work: Path, tip: str) -> Callable[[], None]:
    g("-C", work, "checkout", "-q", "--detach", tip)
    g("-C", work, "read-tree", "main")  # (the index names main's tree: HEAD alone holds tip)
    g("-C", work, "branch", "-q", "-D", "topic")
    assert (work / ".git" / "HEAD").read_text() == f"{tip}\n"
    return lambda: g("-C", work, "checkout", "-q", "-f", "main")


def kind_orig_head(work: Path, tip: str) -> Callable[[], None]:
    g("-C", work, "reset", "-q", "--hard", tip)
    g("-C", work, "reset", "-q", "--hard", "main@{1}")
    g("-C", work, "branch", "-q", "-D", "topic")
    assert (work / ".git" / "ORIG_HEAD").read_text() == f"{tip}\n"
    return lambda: (work / ".git" / "ORIG_HEAD").unlink()


KINDS = {
    "branch": kind_branch,
    "packed-ref": kind_packed_ref,
    "reflog": kind_reflog,
    "index": kind_index,
    "index-v4": kind_index_v4,
    "split-index": kind_split_index,
    "resolve-undo": kind_resolve_undo,
    "stash": kind_stash,
    "worktree-head": kind_worktree_head,
    "detached-head": kind_detached_head,
    "orig-head": kind_orig_head,
}


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_root_keeps_what_only_the_store_has_and_only_while_it_names_it(
    mount, tmp_path, kind
):
    serve(mount, tmp_path)
    work = borrow(mount, tmp_path / "work")
    tip = strand(mount, work)
    objects = new_objects(work, tip)
    assert len(objects) == 3
    blob = out("-C", work, "rev-parse", f"{tip}:t.txt")
    held = [blob] if kind.startswith(("index", "split-index", "resolve-undo")) else objects
    undo = KINDS[kind](work, tip)
    gc(work)
    assert not set(objects) & local_ids(work), "the clone still has its own copies"
    register(mount, "work", work)
    extra = orphan(mount)
    reports = sweeps(mount)
    fsck_clean(work)
    assert not orphan_stored(mount, extra)
    assert sum(r["deleted"] for r in reports) == 1 + len(objects) - len(held), reports
    assert all(stored(mount, oid) for oid in held)
    assert out("-C", work, "cat-file", "-t", held[0]) in ("commit", "blob")

    # without it, the same objects are collected: it was what kept them
    undo()
    gc(work)
    reports = sweeps(mount, 2)
    assert sum(r["deleted"] for r in reports) == len(held), reports
    assert not any(stored(mount, oid) for oid in held)
    fsck_clean(work)
    assert mount.tracebacks() == []


# -- many refs --------------------------------------------------------------------------------
def test_a_borrower_with_100000_refs_is_read_at_every_sweep(mount, tmp_path):
    serve(mount, tmp_path)
    work = borrow(mount, tmp_path / "work")
    tip = strand(mount, work)
    g("-C", work, "branch", "-q", "-D", "topic")
    gc(work)
    main = out("-C", work, "rev-parse", "main")
    packed = work / ".git" / "packed-refs"
    lines = [x for x in packed.read_text().splitlines(keepends=True) if x[0] not in "#^"]
    assert any(x.endswith(" refs/heads/main\n") for x in lines)  # (gc packed them)
    lines += [f"{main} refs/heads/many/{i:06d}\n" for i in range(100_000 - 1)]
    lines.append(f"{tip} refs/heads/keep\n")  # (what only the store has)
    lines.sort(key=lambda line: line.split()[1])
    with open(packed, "w") as f:
        f.write("# pack-refs with: peeled fully-peeled sorted \n")
        f.writelines(lines)
    for i in range(100):
        (work / ".git" / "refs" / "heads" / f"loose-{i:03d}").write_text(f"{main}\n")
    assert out("-C", work, "rev-parse", "refs/heads/many/099998") == main
    assert out("-C", work, "rev-parse", "keep") == tip
    register(mount, "work", work)
    extra = orphan(mount)
    reports = sweeps(mount, 2)
    for report in reports:
        print(f"a sweep with a borrower of 100,100 refs: {report['duration_s']:.3f} s")
    assert sum(r["deleted"] for r in reports) == 1 and not orphan_stored(mount, extra)
    assert all(stored(mount, oid) for oid in new_objects(work, tip))
    fsck_clean(work)


# -- a borrower that is gone ------------------------------------------------------------------
def test_a_deleted_borrower_is_dropped_at_once_with_no_grace(new_mount, tmp_path):
    m = new_mount(env={"ALKFS_ROOTS_GRACE": "0"})
    serve(m, tmp_path)
    work = borrow(m, tmp_path / "work")
    register(m, "gone", work)
    register(m, "stays", borrow(m, tmp_path / "other"))
    shutil.rmtree(work)
    report = sweep(m)
    assert report["aborted"] is None and "detail" not in report, report
    assert roots_listed(m) == {"stays": str(tmp_path / "other")}
    lines = [line for line in m.log().splitlines() if "root gone dropped" in line]
    assert len(lines) == 1 and "WARNING" in lines[0] and str(work) in lines[0], m.log()
    assert status(m)["roots"] == 1
    assert m.tracebacks() == []


def test_a_missing_borrower_stops_sweeps_for_the_grace_then_is_dropped(new_mount, tmp_path):
    m = new_mount(env={"ALKFS_ROOTS_GRACE": "3s"})
    serve(m, tmp_path)
    work = borrow(m, tmp_path / "work")
    tip = strand(m, work)
    gc(work)
    register(m, "away", work)
    extra = orphan(m)
    away = tmp_path / "elsewhere"
    os.rename(work, away)  # (a home directory unmounted for a while)
    started = time.monotonic()
    for _ in range(2):
        report = sweep(m)
        assert report["aborted"] == "protect-failed", report
        assert "'away'" in report["detail"] and "missing" in report["detail"], report
    assert time.monotonic() - started < 3, "the grace passed already: too slow a machine"
    assert roots_listed(m) == {"away": str(work)}
    assert orphan_stored(m, extra)
    assert "sweep: protect-failed, nothing deleted: root 'away'" in m.log()
    os.rename(away, work)  # back within the grace: forgotten as missing
    sweeps(m)
    assert not orphan_stored(m, extra)
    assert all(stored(m, oid) for oid in new_objects(work, tip))
    os.rename(work, away)
    report = sweep(m)
    assert report["aborted"] == "protect-failed", report  # missing anew: the grace again
    time.sleep(3.2)
    report = sweep(m)
    assert report["aborted"] is None and "detail" not in report, report
    assert roots_listed(m) == {}
    assert "root away dropped" in m.log()


@pytest.mark.parametrize("grace", [None, "soon"], ids=["unset", "not-a-duration"])
def test_with_the_default_grace_a_deleted_borrower_stops_sweeps_and_stays(
    new_mount, tmp_path, grace
):
    mount = new_mount(env=None if grace is None else {"ALKFS_ROOTS_GRACE": grace})
    serve(mount, tmp_path)
    work = borrow(mount, tmp_path / "work")
    register(mount, "deleted", work)
    extra = orphan(mount)
    shutil.rmtree(work)
    for _ in range(2):
        report = sweep(mount)
        assert report["aborted"] == "protect-failed", report
        assert report["detail"].startswith(f"root 'deleted': {work} is missing (for "), report
        assert report["detail"].endswith("; dropped once missing for 1w)"), report
    assert roots_listed(mount) == {"deleted": str(work)}
    assert orphan_stored(mount, extra)
    assert "dropped" not in mount.log().replace("dropped once missing", "")
    warned = "ALKFS_ROOTS_GRACE='soon' is not a duration: using 7d" in mount.log()
    assert warned == (grace is not None)
    os.unlink(mount.path("roots", "deleted"))  # what its owner does: sweeps go on
    sweeps(mount, 2)
    assert not orphan_stored(mount, extra)


def test_a_borrower_whose_file_system_is_not_mounted_counts_as_missing(mount, tmp_path):
    """An empty directory on another device where the clone was (its home directory not
    mounted): missing, within the grace, not unreadable; mounted again, read again."""
    serve(mount, tmp_path)
    work = borrow(mount, tmp_path / "work")
    tip = strand(mount, work)
    g("-C", work, "branch", "-q", "-D", "topic")
    g("-C", work, "update-ref", "refs/heads/kept", tip)
    gc(work)
    register(mount, "home", work)
    extra = orphan(mount)
    done = subprocess.run(["mount", "-t", "tmpfs", "alkfs-test", str(work)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr!r}")
    try:
        assert os.listdir(work) == []
        for _ in range(2):
            report = sweep(mount)
            assert report["aborted"] == "protect-failed", report
            assert report["detail"].startswith(f"root 'home': {work} is missing"), report
        assert orphan_stored(mount, extra) and roots_listed(mount) == {"home": str(work)}
    finally:
        subprocess.run(["umount", str(work)], check=True)
    sweeps(mount)
    assert not orphan_stored(mount, extra)
    assert all(stored(mount, oid) for oid in new_objects(work, tip))
    fsck_clean(work)


def test_a_linked_worktree_registered_by_its_path_keeps_what_its_repository_names(mount, tmp_path):
    serve(mount, tmp_path)
    work = borrow(mount, tmp_path / "work")
    tip = strand(mount, work)
    wt = tmp_path / "wt"
    g("-C", work, "worktree", "add", "-q", wt, "main~1")  # (a new branch `wt` there)
    assert (wt / ".git").read_text().startswith("gitdir: ")
    gc(work)
    register(mount, "wt", wt)
    sweeps(mount)
    objects = new_objects(work, tip)
    assert all(stored(mount, oid) for oid in objects)  # (the main work tree's branch)
    fsck_clean(wt)
    assert out("-C", wt, "log", "--format=%H", "topic").splitlines()[0] == tip
    g("-C", work, "branch", "-q", "-D", "topic")
    gc(work)
    reports = sweeps(mount, 2)
    assert sum(r["deleted"] for r in reports) == len(objects), reports
    fsck_clean(wt)


# -- a borrower that cannot be read -----------------------------------------------------------
def break_garbage_ref(work: Path) -> None:
    (work / ".git" / "refs" / "heads" / "broken").write_text("xyz\n")


def break_no_head(work: Path) -> None:
    (work / ".git" / "HEAD").unlink()


def break_not_a_repository(work: Path) -> None:
    shutil.rmtree(work / ".git")


def break_packed_refs(work: Path) -> None:
    with open(work / ".git" / "packed-refs", "a") as f:
        f.write("not a ref at all\n")


def break_index(work: Path) -> None:
    (work / ".git" / "index").write_bytes(b"DIRC\0\0\0\2\0\0\0\3" + b"\xff" * 30)


def break_own_object(work: Path) -> None:
    fan = work / ".git" / "objects" / "ab"
    fan.mkdir()
    (fan / ("c" * 38)).write_bytes(b"not a zlib stream")  # (a loose object git cannot read)


BREAKS = {
    "garbage-ref": break_garbage_ref,
    "no-HEAD": break_no_head,
    "not-a-repository": break_not_a_repository,
    "garbage-packed-refs": break_packed_refs,
    "damaged-index": break_index,
    "corrupt-own-object": break_own_object,
}


@pytest.mark.parametrize("breakage", list(BREAKS))
def test_an_unreadable_borrower_stops_sweeps_and_nothing_is_deleted(mount, tmp_path, breakage):
    serve(mount, tmp_path)
    work = borrow(mount, tmp_path / "work")
    g("-C", work, "pack-refs", "--all")
    register(mount, "bad", work)
    extra = orphan(mount)
    BREAKS[breakage](work)
    for _ in range(2):
        report = sweep(mount)
        assert report["aborted"] == "protect-failed", report
        assert report["detail"].startswith("root 'bad': "), report
        assert report["deleted"] == report["candidates_staged"] == 0, report
    assert orphan_stored(mount, extra)
    assert roots_listed(mount) == {"bad": str(work)}
    assert "sweep: protect-failed, nothing deleted: root 'bad'" in mount.log()
    os.unlink(mount.path("roots", "bad"))
    sweeps(mount, 2)
    assert not orphan_stored(mount, extra)
    assert mount.tracebacks() == []


# -- a borrower that names a staged object before it is deleted --------------------------------
@pytest.mark.parametrize("late", ["ref", "registration"])
def test_a_staged_object_a_borrower_names_since_is_not_deleted(mount, tmp_path, late):
    serve(mount, tmp_path)
    work = borrow(mount, tmp_path / "work")
    tip = strand(mount, work)
    objects = new_objects(work, tip)
    if late == "ref":
        g("-C", work, "branch", "-q", "-D", "topic")
        register(mount, "work", work)
    gc(work)
    assert not set(objects) & local_ids(work)
    first = sweep(mount)
    assert first["aborted"] is None and first["candidates_staged"] == len(objects), first
    if late == "ref":
        g("-C", work, "update-ref", "refs/heads/x", tip)  # (read through the mount)
    else:
        register(mount, "work", work)
    second = sweep(mount)
    assert second["aborted"] is None, second
    assert second["taken"] == second["cancelled_by_arbitration"] == len(objects), second
    assert second["deleted"] == 0, second
    third = sweep(mount)
    assert (third["aborted"], third["taken"], third["deleted"]) == (None, 0, 0), third
    assert all(stored(mount, oid) for oid in objects)
    fsck_clean(work)
    ref = "x" if late == "ref" else "topic"
    assert out("-C", work, "log", "--format=%H", ref).splitlines()[0] == tip


# -- machines ---------------------------------------------------------------------------------
def test_a_root_of_another_machine_is_never_read_nor_dropped(new_mount, populate, tmp_path):
    store = tmp_path / "store"
    populate(store)
    a = new_mount(store, mnt=tmp_path / "mnt-a", env={"ALKFS_MACHINE_ID": "machine-a"})
    serve(a, tmp_path)
    work = borrow(a, tmp_path / "work")
    tip = strand(a, work)
    gc(work)
    register(a, "theirs", work)
    assert sweep(a)["aborted"] is None
    assert a.stop() == 0
    env = {"ALKFS_MACHINE_ID": "machine-b", "ALKFS_ROOTS_GRACE": "0"}
    b = new_mount(store, mnt=tmp_path / "mnt-b", env=env)
    extra = orphan(b)
    for _ in range(2):
        report = sweep(b)
        assert report["aborted"] == "protect-failed", report
        assert "'theirs'" in report["detail"] and "machine-a" in report["detail"], report
    shutil.rmtree(work)  # (gone, but on a machine b cannot look at)
    report = sweep(b)
    assert report["aborted"] == "protect-failed" and "machine-a" in report["detail"], report
    assert roots_listed(b) == {"theirs": str(work)}
    assert orphan_stored(b, extra)
    assert stored(b, tip)
    assert "dropped" not in b.log()
    assert b.tracebacks() == []

    # on its own machine, a daemon reads it: gone, so dropped (no grace there either)
    assert b.stop() == 0
    env = {"ALKFS_MACHINE_ID": "machine-a", "ALKFS_ROOTS_GRACE": "0"}
    a2 = new_mount(store, mnt=tmp_path / "mnt-a2", env=env)
    report = sweep(a2)
    assert report["aborted"] is None and "detail" not in report, report
    assert roots_listed(a2) == {}
    assert "root theirs dropped" in a2.log()


# -- registrations ----------------------------------------------------------------------------
def test_bad_registrations_are_refused_and_change_nothing(mount, tmp_path):
    serve(mount, tmp_path)
    work = borrow(mount, tmp_path / "work")
    plain = tmp_path / "plain"
    plain.mkdir()
    register(mount, "ok", work)
    roots = mount.path("roots")
    refused = {
        "relative": ("rel", "work"),
        "missing": ("missing", str(tmp_path / "nothing-here")),
        "not a repository": ("plain", str(plain)),
        "in the mount": ("inside", str(mount.path("repos", "r"))),
        "the mount": ("mnt", str(mount.mnt)),
        "in the mount, by ..": ("dots", f"{tmp_path}/work/../{mount.mnt.name}/repos/r"),
        "a space": ("a b", str(work)),
        "a dot": (".x", str(work)),
        "a dash": ("-x", str(work)),
    }
    for why, (name, target) in refused.items():
        assert os_errno(os.symlink, target, roots / name) == errno.EINVAL, why
    assert os_errno(os.symlink, str(plain), roots / "ok") == errno.EEXIST
    assert os_errno(os.symlink, str(tmp_path / "nothing"), roots / "ok") == errno.EEXIST
    assert os_errno(os.unlink, roots / "none") == errno.ENOENT
    assert roots_listed(mount) == {"ok": str(work)}
    assert status(mount)["roots"] == 1

    # what is accepted: a git dir, a path with a trailing slash or `..` (kept normalized),
    # a bare clone, a repository with no commit yet
    register(mount, "gitdir", work / ".git")
    os.symlink(f"{tmp_path}/plain/../work/", roots / "dotted")
    bare = tmp_path / "bare.git"
    g("clone", "-q", "--bare", mount.path("repos", "r"), bare)
    assert (bare / "objects" / "info" / "alternates").is_file()
    register(mount, "bare", bare)
    g("init", "-q", tmp_path / "empty")
    register(mount, "empty", tmp_path / "empty")
    assert roots_listed(mount) == {
        "bare": str(bare),
        "dotted": str(work),
        "empty": str(tmp_path / "empty"),
        "gitdir": str(work / ".git"),
        "ok": str(work),
    }
    assert status(mount)["roots"] == 5
    sweeps(mount, 1)
    for name in ("bare", "dotted", "empty", "gitdir"):
        os.unlink(roots / name)
    assert roots_listed(mount) == {"ok": str(work)}
    os.unlink(roots / "ok")  # (and the name is free for another path at once)
    assert os_errno(os.readlink, roots / "ok") == errno.ENOENT
    register(mount, "ok", work / ".git")
    assert roots_listed(mount) == {"ok": str(work / ".git")}


def test_registrations_survive_a_restart(mount, tmp_path):
    serve(mount, tmp_path)
    work = borrow(mount, tmp_path / "work")
    tip = strand(mount, work)
    gc(work)
    register(mount, "work", work)
    mount.restart()
    assert roots_listed(mount) == {"work": str(work)}
    sweeps(mount)
    assert all(stored(mount, oid) for oid in new_objects(work, tip))
    fsck_clean(work)


# -- the command line -------------------------------------------------------------------------
def alkfs(*args, cwd=None, env=None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ALKFS_")}
    return subprocess.run(
        [ALKFS, *map(str, args)],
        cwd=cwd,
        env={**full, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_command_line_adds_lists_and_removes_roots(mount, tmp_path, store_database):
    serve(mount, tmp_path)
    work = borrow(mount, tmp_path / "work")
    tip = strand(mount, work)
    gc(work)
    mnt = mount.mnt
    done = alkfs("--mount", mnt, "roots", "add", "w", "work", cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert roots_listed(mount) == {"w": str(work)}  # made absolute
    done = alkfs("--mount", mnt, "roots", "add", "g", "./work/.git/", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = alkfs("--mount", mnt, "roots")
    assert (done.returncode, done.stdout) == (0, f"g {work / '.git'}\nw {work}\n"), done.stderr

    done = alkfs("--mount", mnt, "roots", "add", "w", "work/.git", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr == "alkfs roots add: the root 'w' is another path's (EEXIST)\n"
    assert len(done.stderr.splitlines()) == 1
    done = alkfs("--mount", mnt, "roots", "add", "p", "src-r/.git/objects", cwd=tmp_path)
    assert done.returncode == 1 and "not a git repository" in done.stderr, done.stderr
    done = alkfs("--mount", mnt, "roots", "rm", "none")
    assert done.returncode == 1 and "no root 'none'" in done.stderr, done.stderr

    done = alkfs("--mount", mnt, "roots", "rm", "g")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert alkfs("--mount", mnt, "roots").stdout == f"w {work}\n"

    # a store no daemon holds: the library's registry, the same rows
    extra = orphan(mount)
    assert mount.stop() == 0
    store = mount.store_path
    db = store_database(store)
    env = {} if db is None else {"ALKFS_DATABASE": db}
    done = alkfs("--store", store, "roots", env=env)
    assert (done.returncode, done.stdout) == (0, f"w {work}\n"), done.stderr
    for _ in range(2):  # (the same name and path again: a no-op)
        done = alkfs("--store", store, "roots", "add", "again", "work", cwd=tmp_path, env=env)
        assert (done.returncode, done.stderr) == (0, "")
    done = alkfs("--store", store, "roots", "rm", "w", env=env)
    assert done.returncode == 0, done.stderr
    assert alkfs("--store", store, "roots", env=env).stdout == f"again {work}\n"
    # ... and its sweep reads the borrower too, with no mount behind its alternates
    deleted = 0
    for _ in range(2):
        done = alkfs("--store", store, "sweep", "--window", "0", env=env)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["aborted"] is None, report
        deleted += report["deleted"]
    assert deleted == 1  # (the orphan)
    mount.start()
    assert roots_listed(mount) == {"again": str(work)}
    assert not orphan_stored(mount, extra)
    assert all(stored(mount, oid) for oid in new_objects(work, tip))
    fsck_clean(work)


def test_the_command_line_adding_the_same_root_again_through_a_mount_is_a_no_op(mount, tmp_path):
    serve(mount, tmp_path)
    work = borrow(mount, tmp_path / "work")
    for _ in range(2):
        done = alkfs("--mount", mount.mnt, "roots", "add", "w", work)
        assert (done.returncode, done.stderr) == (0, "")
    assert roots_listed(mount) == {"w": str(work)}


def test_a_rewound_listing_of_roots_lists_them_again(mount, tmp_path):
    """A second listing of one open directory (rewinddir: os.listdir of a descriptor
    rewinds it) reads the roots again, as the first one did."""
    repo = tmp_path / "repo"
    g("init", "-q", repo)
    register(mount, "one", repo)
    fd = os.open(mount.path("roots"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert os.listdir(fd) == ["one"]
        register(mount, "two", repo)
        assert sorted(os.listdir(fd)) == ["one", "two"]
    finally:
        os.close(fd)
