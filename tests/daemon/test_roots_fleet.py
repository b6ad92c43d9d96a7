"""Borrowers (docs/gc.md, "Clones that borrow") on a store kept in PostgreSQL, with one
daemon and with a fleet.

A local clone of MNT/repos/r borrows the store's objects through its alternates; once
registered under MNT/roots it keeps alive everything it reaches, here the commits of a
branch the server deleted that only the clone still has. The registration is a row of the
store's database: it survives a restart, it is seen (and removed) through every daemon of
a fleet, and a sweep through any daemon keeps what it reaches. A root registered on
another machine is read only there (a sweep asks that machine's daemon) and never dropped
from elsewhere: missing, or with no daemon there to read it, a sweep ends `protect-failed`
naming it.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import git, status, sweep

SUBJECTS = ["topic 2", "topic 1", "main 2", "main 1", "main 0"]  # git log topic
LISTING_BOUND_S = 5.0  # /roots entries and listings are cached ~1 s by the kernel
PIN_ROWS_BOUND_S = 5.0
ASK_TIMEOUT = "ALKFS_ROOTS_ASK_TIMEOUT"  # (seconds: a sweep waits for another machine's read)


def out(*args) -> str:
    return git(*args).stdout.decode().strip()


def tour_repo(path: Path) -> Path:
    """A real repository: three commits on main, two more on topic (each a file of its
    own, so topic's commits, trees and blobs are reachable from nothing else)."""
    git("init", "-q", "-b", "main", path)
    for i in range(3):
        (path / f"main{i}.txt").write_text(f"main file {i}\n" * (i + 5))
        git("-C", path, "add", ".")
        git("-C", path, "commit", "-q", "-m", f"main {i}")
    git("-C", path, "checkout", "-q", "-b", "topic")
    for i in (1, 2):
        (path / f"topic{i}.txt").write_text(f"only on topic {i}\n" * (i + 7))
        git("-C", path, "add", ".")
        git("-C", path, "commit", "-q", "-m", f"topic {i}")
    git("-C", path, "checkout", "-q", "main")
    return path


def only_topic(src: Path) -> list[str]:
    """The ids of the objects reachable from topic and not from main."""
    lines = out("-C", src, "rev-list", "--objects", "topic", "^main").splitlines()
    return [line.split()[0] for line in lines]


def borrow(m, src: Path, work: Path) -> None:
    """A borrowing clone's tour up to its registration: push main and topic into
    MNT/repos/r, clone it locally (the clone borrows through its alternates), check topic
    out, delete topic on the server, gc the clone twice (it keeps none of what the store
    holds)."""
    repo = m.path("repos", "r")
    os.mkdir(repo)
    git("-C", src, "push", "-q", repo, "main", "topic")
    git("clone", "-q", repo, work)
    alternates = (work / ".git" / "objects" / "info" / "alternates").read_text().splitlines()
    assert alternates and all(a.startswith(f"{m.mnt}/") for a in alternates), alternates
    git("-C", work, "checkout", "-q", "-b", "topic", "origin/topic")
    git("-C", work, "push", "-q", "origin", "--delete", "topic")
    assert out(f"--git-dir={repo}", "for-each-ref", "--format=%(refname)") == "refs/heads/main"
    for _ in range(2):
        git("-C", work, "gc", "-q", "--prune=now")


def fsck(work: Path) -> subprocess.CompletedProcess:
    return git("-C", work, "fsck", "--full", check=False)


def topic_log(repo: Path) -> list[str]:
    """`git log topic`, a line (id, subject) a commit."""
    return out("-C", repo, "log", "--format=%H %s", "topic").splitlines()


def ls_l(path: Path) -> str:
    done = subprocess.run(["ls", "-l", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def listed(m) -> list[str]:
    return sorted(os.listdir(m.path("roots")))


def wait_listed(m, names: list[str]) -> float:
    """Poll the mount's /roots until it lists `names`; the seconds it took."""
    t0 = time.monotonic()
    while (now := listed(m)) != names:
        assert time.monotonic() - t0 < LISTING_BOUND_S, (now, names)
        time.sleep(0.05)
    return time.monotonic() - t0


def wait_unlinked(m, name: str) -> float:
    """Poll until the mount's /roots/NAME is ENOENT (a looked-up entry is kept ~1 s by
    the kernel, and reads its target as when it was looked up); the seconds it took."""
    t0 = time.monotonic()
    while True:
        try:
            target = os.readlink(m.path("roots", name))
        except OSError as exc:
            assert exc.errno == errno.ENOENT, exc
            return time.monotonic() - t0
        assert time.monotonic() - t0 < LISTING_BOUND_S, (name, target)
        time.sleep(0.05)


def pin_rows(m) -> int:
    """The fleet pin rows (in-process pins other daemons see) this daemon holds."""
    return next(n["pins"] for n in status(m)["fleet"]["nodes"] if n["self"])


def wait_no_pin_rows(*ms) -> None:
    """Until each daemon's in-process pins (its reads, deleted lazily by its heartbeat)
    are gone: until then they keep what git read through it."""
    for m in ms:
        t0 = time.monotonic()
        while pin_rows(m) != 0:
            assert time.monotonic() - t0 < PIN_ROWS_BOUND_S, status(m)["fleet"]
            time.sleep(0.05)


def in_store(m, oid: str) -> bool:
    return (
        git(f"--git-dir={m.path('repos', 'r')}", "cat-file", "-e", oid, check=False).returncode == 0
    )


@pytest.fixture
def start_fleet(start_pg_mount, tmp_path):
    """start_fleet(env1=None, env2=None) -> (m1, m2): two daemons, `--window 0`, on one
    database and the same STORE directory, each with its own extra environment."""
    started = []

    def start(env1: dict[str, str] | None = None, env2: dict[str, str] | None = None):
        store = tmp_path / "store"
        m1 = start_pg_mount(store, "--window", "0", mnt=tmp_path / "mnt1", env=env1)
        m2 = start_pg_mount(store, "--window", "0", mnt=tmp_path / "mnt2", env=env2)
        started.extend((m1, m2))
        return m1, m2

    yield start
    for m in started:
        assert m.tracebacks() == [], m.all_logs()


# -- 1. one daemon: a borrowing clone's tour ---------------------------------------------------
def test_a_registered_local_clone_keeps_a_deleted_branch_through_sweeps_and_restarts(
    pg_mount, tmp_path
):
    m = pg_mount
    src = tour_repo(tmp_path / "src")
    work = tmp_path / "work"
    topic = only_topic(src)
    borrow(m, src, work)
    os.symlink(work, m.path("roots", "work"))
    assert os.readlink(m.path("roots", "work")) == str(work)
    assert status(m)["roots"] == 1
    wait_no_pin_rows(m)  # (what git read through the mount is not kept by that)
    reports = [sweep(m) for _ in range(3)]
    print(reports)
    for report in reports:
        assert report["aborted"] is None, report
        assert "detail" not in report, report
        assert (report["candidates_staged"], report["deleted"]) == (0, 0), report
    assert fsck(work).returncode == 0, fsck(work).stderr
    assert topic_log(work) == topic_log(src)
    assert [line.split(" ", 1)[1] for line in topic_log(work)] == SUBJECTS
    assert all(in_store(m, oid) for oid in topic)

    m.restart()
    assert listed(m) == ["work"]
    assert os.readlink(m.path("roots", "work")) == str(work)
    line = [x for x in ls_l(m.path("roots")).splitlines() if x.startswith("l")]
    assert len(line) == 1 and line[0].endswith(f" work -> {work}"), line
    assert status(m)["roots"] == 1
    for _ in range(2):
        report = sweep(m)
        assert report["aborted"] is None, report
        assert (report["candidates_staged"], report["deleted"]) == (0, 0), report
    assert fsck(work).returncode == 0
    assert topic_log(work) == topic_log(src)
    assert m.tracebacks() == []


# -- 2. a fleet: registered through one daemon, swept through the other ----------------------
def test_a_root_registered_through_mount_1_protects_against_sweeps_through_mount_2(
    start_fleet, tmp_path
):
    m1, m2 = start_fleet()
    src = tour_repo(tmp_path / "src")
    work = tmp_path / "work"
    topic = only_topic(src)
    borrow(m1, src, work)
    os.symlink(work, m1.path("roots", "work"))
    assert listed(m2) == ["work"]
    assert os.readlink(m2.path("roots", "work")) == str(work)
    wait_no_pin_rows(m1, m2)
    reports = [sweep(m2) for _ in range(3)]
    print(reports)
    for report in reports:
        assert report["aborted"] is None, report
        assert (report["candidates_staged"], report["deleted"]) == (0, 0), report
    assert fsck(work).returncode == 0
    assert topic_log(work) == topic_log(src)
    assert all(in_store(m2, oid) for oid in topic)

    # unregistered through mount 2: gone from mount 1's listing too
    os.unlink(m2.path("roots", "work"))
    print(f"unregistered: mount 1's listing followed in {wait_listed(m1, []):.2f} s")
    print(f"and its entry in {wait_unlinked(m1, 'work'):.2f} s")
    assert status(m1)["roots"] == 0

    # and now the danger is real: two sweeps delete what only the clone reached
    wait_no_pin_rows(m1, m2)
    reports = [sweep(m2) for _ in range(2)]
    print(reports)
    assert all(r["aborted"] is None for r in reports), reports
    assert [r["deleted"] for r in reports] == [0, len(topic)], reports
    assert not any(in_store(m2, oid) for oid in topic)
    broken = fsck(work)
    assert broken.returncode != 0
    tip = out("-C", src, "rev-parse", "topic")
    assert f"refs/heads/topic: invalid sha1 pointer {tip}" in broken.stderr.decode(), broken
    assert git("-C", work, "log", "--oneline", "topic", check=False).returncode != 0


# -- 3. two machine identities -----------------------------------------------------------------
def test_a_root_of_another_machine_is_read_there_and_never_dropped_from_here(start_fleet, tmp_path):
    """machine-a's root, swept through machine-b's daemon (grace 0): read by machine-a's
    daemon when asked (so it protects), and when it is missing, or machine-a has no
    daemon, the sweep ends protect-failed naming it and it stays registered."""
    m1, m2 = start_fleet(
        {"ALKFS_MACHINE_ID": "machine-a"},
        {"ALKFS_MACHINE_ID": "machine-b", "ALKFS_ROOTS_GRACE": "0", ASK_TIMEOUT: "3"},
    )
    src = tour_repo(tmp_path / "src")
    work, other = tmp_path / "work", tmp_path / "other"
    topic = only_topic(src)
    borrow(m1, src, work)
    git("clone", "-q", m2.path("repos", "r"), other)
    os.symlink(work, m1.path("roots", "work"))  # machine-a's
    os.symlink(other, m2.path("roots", "other"))  # machine-b's
    assert listed(m1) == listed(m2) == ["other", "work"]

    # present: machine-a's daemon reads it for machine-b's sweeps
    wait_no_pin_rows(m1, m2)
    for _ in range(3):
        report = sweep(m2)
        print(report)
        assert report["aborted"] is None, report
        assert (report["candidates_staged"], report["deleted"]) == (0, 0), report
    assert fsck(work).returncode == 0
    assert topic_log(work) == topic_log(src)
    assert all(in_store(m2, oid) for oid in topic)

    shutil.rmtree(work)
    shutil.rmtree(other)
    # machine-b: its own missing root dropped at once (grace 0), never machine-a's
    for _ in range(2):
        report = sweep(m2)
        print(report)
        assert report["aborted"] == "protect-failed", report
        assert report["deleted"] == 0, report
        assert "'work'" in report["detail"] and "machine-a" in report["detail"], report
        assert "'other'" not in report["detail"], report
    assert "root other dropped" in m2.log()
    assert "root work dropped" not in m2.log()
    wait_listed(m2, ["work"])
    wait_listed(m1, ["work"])
    assert os.readlink(m2.path("roots", "work")) == str(work)

    # machine-a: missing, but within the default grace of 7 days
    for _ in range(2):
        report = sweep(m1)
        print(report)
        assert report["aborted"] == "protect-failed", report
        assert report["deleted"] == 0, report
        assert "'work'" in report["detail"] and "is missing" in report["detail"], report
    assert "root work dropped" not in m1.all_logs()
    assert listed(m1) == listed(m2) == ["work"]

    # no daemon on machine-a (it left the fleet): still never read nor dropped here
    assert m1.stop() == 0
    report = sweep(m2)
    print(report)
    assert report["aborted"] == "protect-failed", report
    assert report["deleted"] == 0, report
    assert "'work'" in report["detail"] and "machine-a" in report["detail"], report
    # machine-a's daemon killed (its session not expired yet): no answer in time
    m1.restart()
    m1.stop(signal.SIGKILL)
    report = sweep(m2)
    print(report)
    assert report["aborted"] == "protect-failed", report
    assert report["deleted"] == 0, report
    assert report["duration_s"] >= 3.0, report
    assert "'work'" in report["detail"] and "answered within" in report["detail"], report
    assert "root work dropped" not in m2.log()
    assert listed(m2) == ["work"]
    assert os.readlink(m2.path("roots", "work")) == str(work)
    assert all(in_store(m2, oid) for oid in topic)
