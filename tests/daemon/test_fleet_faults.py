"""Two daemons on one store (a fleet: docs/operations.md), one of them faulted mid-push:
real mounts, one real PostgreSQL database (`pg_uri`), the same STORE directory,
`--window 0`, and a fleet TTL of 2 s for both daemons (`ALKFS_FLEET_TTL=2`).

- A daemon SIGSTOPped past its TTL in the middle of a push, then continued: its push
  fails or re-stores; it never leaves a ref to an object that is gone (through the
  other mount), and a push through it later works again.
- A daemon SIGKILLed mid-push: the other daemon (sweeping every 200 ms) collects what it
  never published once its session expired (TTL) and the window (0) passed, removes its
  in-flight directory under STORE/nodes/<its id>, and nothing it had published is lost.

The "mid-push" of the deterministic tests is git's own object writes through
MNT1/repos/<id>/objects: `git unpack-objects` fed a pack through a pipe that is kept
open, so its objects are stored and pinned (for that live writer) while no ref names
them yet.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import helpers
import pytest
from helpers import GIT_ENV, pin_target, status, sweep

TTL_S = 2.0
FLEET_ENV = {"ALKFS_FLEET_TTL": "2"}
PAUSE_S = 7.0  # > 2 x TTL (+ a beat): the session expired and was reaped by the sweeper
SWEEP_EVERY_S = 0.2
COLLECT_BOUND_S = 15.0
GIT_TIMEOUT_S = 60.0


# helpers.git with GIT_TIMEOUT_S: a git stuck on a stopped daemon fails in a minute, not five
git = partial(helpers.git, timeout=GIT_TIMEOUT_S)


def out(*args) -> str:
    return git(*args).stdout.decode().strip()


def object_count(m) -> int:
    return sum(c["count"] for c in status(m)["objects"].values())


def node_row(m, node: str) -> dict | None:
    return next((n for n in status(m)["fleet"]["nodes"] if n["id"] == node), None)


def own_pins(m) -> int:
    return next(n["pins"] for n in status(m)["fleet"]["nodes"] if n["self"])


def repo_with_history(path: Path, commits: int, seed: int) -> Path:
    """A real repository made by git: `commits` commits touching a few text files, a
    200 kB random file (above the large threshold) every 4th commit, a tag."""
    git("init", "-q", "-b", "main", path)
    rnd = random.Random(seed)
    for i in range(commits):
        for j in range(3):
            lines = [
                f"seed {seed} commit {i} file {j} line {k} {rnd.random()}\n" for k in range(40)
            ]
            (path / f"f{j}.txt").write_text("".join(lines))
        if i % 4 == 0:
            (path / "big.bin").write_bytes(rnd.randbytes(200_000))
        git("-C", path, "add", ".")
        git("-C", path, "commit", "-q", "-m", f"commit {i}")
    git("-C", path, "tag", "-a", "-m", "a tag", "v1", "HEAD~1")
    return path


def pack_of(src: Path, revs: str) -> bytes:
    """A pack (no deltas: unpack-objects writes each object as it reads it) of `revs`."""
    objs = git("-C", src, "rev-list", "--objects", *revs.split()).stdout
    return git("-C", src, "pack-objects", "--stdout", "--window=0", "--depth=0", input=objs).stdout


def new_objects(src: Path, revs: str) -> list[str]:
    return [
        line.split()[0]
        for line in out("-C", src, "rev-list", "--objects", *revs.split()).splitlines()
    ]


def assert_no_ref_to_a_missing_object(m, repo: str) -> dict[str, str]:
    """Every ref of MNT/repos/<repo> (HEAD too) names an object the mount has, whole
    history included; returns the refs but HEAD."""
    gitdir = m.path("repos", repo)
    listed = git("ls-remote", gitdir).stdout.decode().split("\n")
    refs = {name: oid for oid, name in (line.split("\t") for line in listed if line)}
    for name, oid in refs.items():
        done = git(f"--git-dir={gitdir}", "cat-file", "-e", oid, check=False)
        assert done.returncode == 0, f"{name} names {oid}, which {m.mnt} cannot find"
    if refs:
        git(f"--git-dir={gitdir}", "rev-list", "--objects", "--all", "--quiet")
    return {name: oid for name, oid in refs.items() if name != "HEAD"}


@contextmanager
def sweeping(m) -> Iterator[list[dict]]:
    """`echo sweep > MNT/.alkfs/control` every 200 ms in a thread; the reports."""
    stop = threading.Event()
    reports: list[dict] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.wait(SWEEP_EVERY_S):
                reports.append(sweep(m))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield reports
    finally:
        stop.set()
        t.join(timeout=60)
    assert not errors, errors


@contextmanager
def stopped(m) -> Iterator[None]:
    """The daemon SIGSTOPped, and always continued."""
    os.kill(m.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(m.pid, signal.SIGCONT)


@contextmanager
def writer(m, repo: str, pack: bytes) -> Iterator[subprocess.Popen]:
    """`git unpack-objects` into MNT/repos/<repo>, fed all of `pack` but its last byte
    through a pipe left open: its objects are stored while it lives, no ref names them."""
    p = subprocess.Popen(
        ["git", f"--git-dir={m.path('repos', repo)}", "unpack-objects", "-q"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, **GIT_ENV},
    )
    try:
        assert p.stdin is not None
        p.stdin.write(pack[:-1])
        p.stdin.flush()
        yield p
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def settled_count(m, quiet_s: float = 0.6) -> int:
    """The object count once it has not moved for `quiet_s` (a writer may still be at it)."""
    last, since = object_count(m), time.monotonic()
    while time.monotonic() - since < quiet_s:
        time.sleep(0.1)
        now = object_count(m)
        if now != last:
            last, since = now, time.monotonic()
    return last


def wait_for(what: str, cond, bound: float = COLLECT_BOUND_S, every: float = 0.05) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < bound, f"not within {bound} s: {what}"
        time.sleep(every)
    return time.monotonic() - t0


@pytest.fixture
def fleet(start_pg_mount, tmp_path):
    """Two daemons, `--window 0`, fleet TTL 2 s, one database, the same STORE directory;
    mount 1 releases the pins of a push that never wrote a ref 2 s after its writer exited."""
    store = tmp_path / "store"
    m1 = start_pg_mount(
        store, "--window", "0", "--push-grace", "2s", mnt=tmp_path / "mnt1", env=FLEET_ENV
    )
    m2 = start_pg_mount(store, "--window", "0", mnt=tmp_path / "mnt2", env=FLEET_ENV)
    return m1, m2


# -- SIGSTOP past the TTL ----------------------------------------------------------------------
def test_a_real_push_with_its_daemon_stopped_past_the_ttl_fails_or_lands_whole(fleet, tmp_path):
    """git push into MNT1 while mount 2 sweeps every 200 ms; daemon 1 is SIGSTOPped once
    the push is under way (its quarantine or pins show), for 7 s, then continued."""
    m1, m2 = fleet
    src = repo_with_history(tmp_path / "src", commits=24, seed=1)
    os.mkdir(m1.path("repos", "r1"))
    node1 = status(m1)["fleet"]["self"]
    log = tmp_path / "push.log"
    with sweeping(m2) as reports, open(log, "wb") as err:
        push = subprocess.Popen(
            ["git", "-C", str(src), "push", "-q", str(m1.path("repos", "r1")), "main", "--tags"],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, **GIT_ENV},
        )
        try:
            objects = m1.path("repos", "r1", "objects")
            seen = ""
            t0 = time.monotonic()
            while push.poll() is None and time.monotonic() - t0 < GIT_TIMEOUT_S:
                if any(n.startswith("tmp_objdir") for n in os.listdir(objects)):
                    seen = "quarantine"
                    break
                time.sleep(0.002)
            assert push.poll() is None, "the push was over before the daemon could be stopped"
            with stopped(m1):
                time.sleep(PAUSE_S)
                row = node_row(m2, node1)
                assert row is None or not row["live"], row  # its session is over
            rc = push.wait(timeout=GIT_TIMEOUT_S)
        finally:
            if push.poll() is None:
                push.kill()
                push.wait(timeout=10)
    print(
        f"stopped at: {seen}; push exit {rc}; {len(reports)} sweeps deleted "
        f"{sum(r['deleted'] for r in reports)}; {log.read_text(errors='replace')!r}"
    )
    time.sleep(1.0)  # (refs' timeouts)
    refs = assert_no_ref_to_a_missing_object(m2, "r1")
    if rc == 0:
        assert refs.get("refs/heads/main") == out("-C", src, "rev-parse", "main")
        clone = tmp_path / "clone"
        git("clone", "-q", "--no-local", m2.path("repos", "r1"), clone)
        git("-C", clone, "fsck", "--full")


def test_objects_written_before_the_pause_and_swept_meanwhile_refuse_the_ref(fleet, tmp_path):
    """Deterministic mid-push: git writes the push's objects through MNT1 (still running),
    daemon 1 is SIGSTOPped for 7 s while mount 2 sweeps them away, continued; the ref
    naming them is refused (EAGAIN), none shows through mount 2, and once those pins
    are gone a push through mount 1 stores them again and lands."""
    m1, m2 = fleet
    src = repo_with_history(tmp_path / "src", commits=8, seed=2)
    head = out("-C", src, "rev-parse", "main")
    os.mkdir(m1.path("repos", "r1"))
    node1 = status(m1)["fleet"]["self"]
    before = object_count(m2)
    wanted = new_objects(src, "main")
    with writer(m1, "r1", pack_of(src, "main")) as w:
        wait_for("objects stored", lambda: object_count(m2) - before >= len(wanted) - 2)
        assert own_pins(m1) >= len(wanted) - 2
        stored = settled_count(m2) - before
        with sweeping(m2) as reports, stopped(m1):
            wait_for(
                "mount 2 swept the objects of the stopped daemon",
                lambda: object_count(m2) == before,
                bound=PAUSE_S + 5,
                every=0.2,
            )
            wait_for("its session reaped", lambda: node_row(m2, node1) is None, every=0.2)
        deleted = sum(r["deleted"] for r in reports)
        print(f"{stored} objects stored, {deleted} deleted by {len(reports)} sweeps meanwhile")
        assert deleted >= stored
        # daemon 1 continued: its heartbeat finds its session over and joins again
        wait_for("daemon 1 rejoined", lambda: (node_row(m2, node1) or {}).get("live"), bound=5)
        refused = git(
            f"--git-dir={m1.path('repos', 'r1')}",
            "update-ref",
            "refs/heads/main",
            head,
            check=False,
        )
        assert refused.returncode != 0, "a ref to swept objects was published"
        assert w.poll() is None
        # only what depends on the lost objects is refused: while the
        # taint lasts (its writer still runs), an unrelated pin and an unrelated push
        # through mount 1 land at once
        (m1.path("pins", "unrelated")).write_bytes(b"written while the taint lasts\n")
        assert pin_target(m2.path("pins", "unrelated")).startswith("../objects/sha256/")
        other = repo_with_history(tmp_path / "other", commits=2, seed=9)
        os.mkdir(m1.path("repos", "r2"))
        git("-C", other, "push", "-q", m1.path("repos", "r2"), "main")
        pushed = m2.path("repos", "r2", "refs", "heads", "main").read_text().strip()
        assert pushed == out("-C", other, "rev-parse", "main")
        again = git(
            f"--git-dir={m1.path('repos', 'r1')}", "update-ref", "refs/heads/x", head, check=False
        )
        assert again.returncode != 0, "a ref to swept objects was published"
        assert w.poll() is None
    time.sleep(1.0)
    assert assert_no_ref_to_a_missing_object(m2, "r1") == {}
    assert assert_no_ref_to_a_missing_object(m1, "r1") == {}
    # the writer has exited: its pins go after the grace (2 s), and the taint with them
    assert w.returncode is not None
    # (a push through mount 1 then: test_a_daemon_stopped_past_the_ttl_serves_pushes_again)
    with sweeping(m2):
        time.sleep(1.0)
    assert assert_no_ref_to_a_missing_object(m2, "r1") == {}


def test_a_daemon_stopped_past_the_ttl_serves_pushes_again(fleet, tmp_path):
    """The lease holder removed the paused member's directories as a dead member's;
    once it joined again, its scratch directory comes back at the next push."""
    m1, m2 = fleet
    src = repo_with_history(tmp_path / "src", commits=24, seed=4)
    os.mkdir(m1.path("repos", "r1"))
    node1 = status(m1)["fleet"]["self"]
    inflight = m1.store_path / "nodes" / node1
    with sweeping(m2), stopped(m1):
        wait_for("its session reaped", lambda: node_row(m2, node1) is None, every=0.2)
    wait_for("daemon 1 rejoined", lambda: (node_row(m2, node1) or {}).get("live"), bound=5)
    big = tmp_path / "big"
    big.write_bytes(os.urandom(300_000))
    put = subprocess.run(
        ["cp", str(big), str(m1.path("objects", "sha256", "new"))],
        capture_output=True,
        text=True,
        timeout=GIT_TIMEOUT_S,
    )
    print(
        f"after the lapse: {inflight.name} exists: {inflight.exists()}, scratch: "
        f"{(inflight / 'scratch').exists()}; a 300 kB put through mount 1: {put.returncode} "
        f"{put.stderr.strip()!r}"
    )
    git("-C", src, "push", "-q", m1.path("repos", "r1"), "main", "--tags")
    clone = tmp_path / "clone"
    git("clone", "-q", "--no-local", m2.path("repos", "r1"), clone)
    git("-C", clone, "fsck", "--full")
    assert out("-C", clone, "rev-parse", "HEAD") == out("-C", src, "rev-parse", "main")
    assert put.returncode == 0, put.stderr


# -- SIGKILL mid-push ------------------------------------------------------------------------
def test_a_daemon_killed_mid_push_is_collected_and_what_it_published_stays(fleet, tmp_path):
    m1, m2 = fleet
    src = repo_with_history(tmp_path / "src", commits=12, seed=3)
    published = out("-C", src, "rev-parse", "main~6")
    os.mkdir(m1.path("repos", "r1"))
    git("-C", src, "push", "-q", m1.path("repos", "r1"), f"{published}:refs/heads/main")
    node1 = status(m1)["fleet"]["self"]
    inflight = m1.store_path / "nodes" / node1
    assert inflight.is_dir()
    assert node_row(m2, node1)["live"]
    wait_for("mount 1's pin rows released", lambda: own_pins(m1) == 0, bound=5)
    sweep(m2)
    baseline = object_count(m2)
    unpublished = new_objects(src, f"main ^{published}")
    with writer(m1, "r1", pack_of(src, f"main ^{published}")) as w:
        wait_for(
            "the unpublished objects stored",
            lambda: object_count(m2) - baseline >= len(unpublished) - 2,
        )
        stored = settled_count(m2) - baseline
        sweep(m2)  # (pinned by a live daemon: kept)
        assert object_count(m2) - baseline == stored
        m1.proc.kill()
        m1.proc.wait(timeout=10)
        w.kill()
    subprocess.run(["fusermount3", "-uz", str(m1.mnt)], capture_output=True, check=False)
    t_kill = time.monotonic()
    with sweeping(m2):
        collected = wait_for(
            "the unpublished objects collected", lambda: object_count(m2) == baseline
        )
        reaped = wait_for(
            "the dead daemon reaped",
            lambda: node_row(m2, node1) is None and not inflight.exists(),
        )
    print(
        f"{stored} unpublished objects stored; collected {collected:.1f} s and the session "
        f"and {inflight.name}'s files reaped {reaped:.1f} s after the kill "
        f"({time.monotonic() - t_kill:.1f} s in all; TTL {TTL_S} s)"
    )
    gitdir = m2.path("repos", "r1")
    for oid in unpublished:
        assert git(f"--git-dir={gitdir}", "cat-file", "-e", oid, check=False).returncode != 0
    assert assert_no_ref_to_a_missing_object(m2, "r1") == {"refs/heads/main": published}
    clone = tmp_path / "clone"
    git("clone", "-q", "--no-local", gitdir, clone)
    git("-C", clone, "fsck", "--full")
    assert out("-C", clone, "rev-parse", "HEAD") == published
    assert out("-C", clone, "rev-list", "--count", "HEAD") == "6"
    assert m2.tracebacks() == [], m2.all_logs()


# -- a member stopped while it holds the store's write lock ------------------------------------
WRITER_LOCK = 0x616C6B66_73777274  # (alkfs/db/postgres.py)


def test_a_member_stopped_holding_the_write_lock_blocks_the_others_no_longer_than_its_ttl(
    start_pg_mount, tmp_path
):
    """Member B writes without pause and is SIGSTOPped at a moment its session holds the
    write lock (pg_locks says so); a write through member A then lands within the bound
    (the server ends B's statement or idle transaction after the TTL, 3 s here), where it
    used to hang until B was continued."""
    import psycopg

    store, env = tmp_path / "store", {"ALKFS_FLEET_TTL": "3"}
    a = start_pg_mount(store, "--window", "1h", mnt=tmp_path / "a", env=env)
    b = start_pg_mount(store, "--window", "1h", mnt=tmp_path / "b", env=env)
    src = tmp_path / "files"
    src.mkdir()
    for i in range(40):
        (src / f"f{i}").write_bytes(os.urandom(2000) + b"%d" % i)
    loop = subprocess.Popen(  # B's writes: pins of new content, without end
        [
            "sh",
            "-c",
            f"i=0; while :; do i=$((i+1)); for f in {src}/f*; do "
            f'printf "$i" | cat "$f" - > {b.mnt}/pins/w-$i-$(basename $f); done; done',
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # (caught waiting for its own client's data: a COPY FROM STDIN, which hears no
    # statement_timeout, the hardest case; idle in its transaction is the other)
    holder_sql = (
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity s USING (pid) "
        "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s AND l.objid = %s "
        "AND s.application_name = %s AND s.wait_event = 'ClientRead' "
        "AND s.query ILIKE 'COPY%%'"
    )
    lock_args = (WRITER_LOCK >> 32, WRITER_LOCK & 0xFFFFFFFF, f"alkfs[{b.pid}]")
    caught = False
    try:
        with psycopg.connect(start_pg_mount.uri, autocommit=True) as conn:
            deadline = time.monotonic() + 120
            rng = random.Random(3)
            while not caught and time.monotonic() < deadline:
                time.sleep(rng.random() * 0.02)
                os.kill(b.pid, signal.SIGSTOP)
                if conn.execute(holder_sql, lock_args).fetchone()[0]:
                    caught = True
                    break
                os.kill(b.pid, signal.SIGCONT)
        assert caught, "B never caught holding the write lock"
        t0 = time.monotonic()
        cp = subprocess.Popen(["cp", str(src / "f0"), str(a.mnt / "pins" / "from-a")])
        with contextlib.suppress(subprocess.TimeoutExpired):
            cp.wait(timeout=25)  # (a cp blocked in the kernel cannot be killed: waited)
        took = time.monotonic() - t0
    finally:
        if caught:
            os.kill(b.pid, signal.SIGCONT)
        loop.kill()
        loop.wait(timeout=60)
    assert cp.wait(timeout=60) == 0
    assert took < 3 * 2 + 5, took  # (within twice the TTL and a beat)
    assert (a.mnt / "pins" / "from-a").read_bytes() == (src / "f0").read_bytes()
    # B, continued, finds its session ended and writes again
    wait_for(
        "B to write again",
        lambda: (
            subprocess.run(
                ["cp", str(src / "f1"), str(b.mnt / "pins" / "after")], capture_output=True
            ).returncode
            == 0
        ),
        bound=60,
        every=0.5,
    )
