"""Fleet faults at length: two daemons on one PostgreSQL store (fleet TTL 2 s,
`--window 0`); member 2 is SIGSTOPped and continued at random moments (pauses of 0.2 to 6 s:
many past the TTL) while member 1 writes pins, pushes and sweeps, and member 2, when it
runs, writes pins too.

What must hold: no write through member 1 waits longer than the TTL plus WRITE_BOUND_S;
every write whose `close` returned (through either member) reads back byte-identical
through both afterwards; every push that returned success is whole (`git fsck --full` of
a `--no-local` clone through member 2, the branch at the pushed commit).

30 s in `make test`; `make soak` runs it for ALKFS_SOAK_S seconds (600 by default).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from functools import partial

import helpers
import pytest
from crash_helpers import SOAK
from helpers import GIT_ENV, sweep

TTL_S = 2.0
FLEET_ENV = {"ALKFS_FLEET_TTL": "2"}
WRITE_BOUND_S = 10.0  # beyond the TTL: a write of the live member waits at most this more
DURATION_S = float(os.environ.get("ALKFS_SOAK_S", "600")) if SOAK else 30.0
GIT_TIMEOUT_S = 120.0

pytestmark = pytest.mark.timeout(int(DURATION_S) + 900)


# helpers.git with GIT_TIMEOUT_S: a git stuck on a stopped daemon fails in two minutes
git = partial(helpers.git, timeout=GIT_TIMEOUT_S)


def write_pin(m, name: str, data: bytes) -> float:
    """Write MNT/pins/<name>; seconds until its close returned."""
    t0 = time.monotonic()
    with open(m.path("pins", name), "wb") as f:
        f.write(data)
    return time.monotonic() - t0


def test_a_member_stopped_at_random_never_stalls_the_other_and_nothing_acknowledged_is_lost(
    start_pg_mount, tmp_path
):
    store = tmp_path / "store"
    m1 = start_pg_mount(store, "--window", "0", mnt=tmp_path / "mnt1", env=FLEET_ENV)
    m2 = start_pg_mount(store, "--window", "0", mnt=tmp_path / "mnt2", env=FLEET_ENV)
    rnd = random.Random(int(os.environ.get("ALKFS_SOAK_SEED", "40")))
    src = tmp_path / "src"
    git("init", "-q", "-b", "main", src)
    os.mkdir(m1.path("repos", "r"))

    stop = threading.Event()
    pauses: list[float] = []
    acked: dict[str, tuple[object, bytes]] = {}  # pin name -> (mount, content)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def stopper() -> None:
        try:
            while not stop.wait(rnd.uniform(0.5, 4.0)):
                pause = rnd.uniform(0.2, 6.0)
                os.kill(m2.pid, signal.SIGSTOP)
                try:
                    stop.wait(pause)
                finally:
                    os.kill(m2.pid, signal.SIGCONT)
                pauses.append(pause)
        except BaseException as exc:
            errors.append(exc)

    def member2_writer() -> None:
        n = 0
        try:
            while not stop.wait(0.3):
                data = os.urandom(rnd.randrange(1, 200_000))
                name = f"two-{n}"
                try:
                    write_pin(m2, name, data)
                except OSError:
                    continue  # (refused: EAGAIN after a lapse; not acknowledged)
                with lock:
                    acked[name] = (m2, data)
                n += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=stopper), threading.Thread(target=member2_writer)]
    for t in threads:
        t.start()
    waits: list[float] = []
    pushed: str | None = None
    rounds = 0
    deadline = time.monotonic() + DURATION_S
    try:
        while time.monotonic() < deadline:
            rounds += 1
            data = os.urandom(rnd.randrange(1, 300_000))
            name = f"one-{rounds}"
            waits.append(write_pin(m1, name, data))
            with lock:
                acked[name] = (m1, data)
            if rounds % 5 == 0:
                (src / f"f{rounds % 7}.txt").write_text(f"round {rounds} {rnd.random()}\n" * 50)
                git("-C", src, "add", ".")
                git("-C", src, "commit", "-q", "-m", f"round {rounds}")
                done = git("-C", src, "push", "-q", m1.path("repos", "r"), "main", check=False)
                if done.returncode == 0:
                    pushed = git("-C", src, "rev-parse", "main").stdout.decode().strip()
            if rounds % 3 == 0:
                t0 = time.monotonic()
                assert sweep(m1) is not None
                waits.append(time.monotonic() - t0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        os.kill(m2.pid, signal.SIGCONT)
    assert not errors, errors
    print(
        f"{rounds} rounds in {DURATION_S:.0f} s, {len(pauses)} pauses of member 2 "
        f"(longest {max(pauses, default=0):.1f} s), {len(acked)} acknowledged writes, "
        f"longest wait of member 1 {max(waits):.2f} s"
    )
    assert len(pauses) >= 3
    assert max(waits) <= TTL_S + WRITE_BOUND_S, sorted(waits)[-5:]
    for _ in range(2):
        sweep(m1)
    lost = [
        (name, str(m.mnt))
        for name, (_writer, data) in sorted(acked.items())
        for m in (m1, m2)
        if m.path("pins", name).read_bytes() != data
    ]
    assert lost == []
    assert pushed is not None
    assert m2.path("repos", "r", "refs", "heads", "main").read_text().strip() == pushed
    clone = tmp_path / "clone"
    git("clone", "-q", "--no-local", m2.path("repos", "r"), clone)
    fsck = subprocess.run(
        ["git", "-C", str(clone), "fsck", "--full", "--no-dangling"],
        capture_output=True,
        env={**os.environ, **GIT_ENV},
        timeout=GIT_TIMEOUT_S,
    )
    assert fsck.returncode == 0, fsck.stderr
    assert git("-C", clone, "rev-parse", "HEAD").stdout.decode().strip() == pushed
    for m in (m1, m2):
        assert m.tracebacks() == [], m.all_logs()[-3000:]
