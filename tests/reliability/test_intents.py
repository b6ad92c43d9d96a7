"""Small files acknowledged once their intent is logged (daemon/staging/pending.py,
alkfs/intents.py), on real mounts.

`ALKFS_INTENTS_GATHER_S=60` holds what a close acknowledged in the log for a minute, so
each test sees the state between the close and the commit: the file's pin is not in the
database yet, and every request sees it all the same (the library's write-behind answers
for what is pending: alkfs/writebehind.py); the status file waits for the commit.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import pin_target

HOLD = {"ALKFS_INTENTS_GATHER_S": "60"}


pytestmark = pytest.mark.skipif(
    os.environ.get("ALKFS_TEST_DATABASE", "") == "postgresql",
    reason="the intents log is a sqlite store's (a PostgreSQL store commits each close)",
)


def held(start_mount, env=HOLD):
    """A mount holding intents; its first small file written (the first put of a store
    looks at the disk's free space first, so it commits at its close) and the
    directories the tests write in looked up."""
    m = start_mount(env=env)
    m.path("pins", "warm-up").write_bytes(b"warm-up\n")
    os.stat(m.path("objects", "sha256"))  # (a lookup in the root would wait for commits)
    return m


def db_pins(store: Path, prefix: str) -> int:
    return db_count(store, "SELECT count(*) FROM pins WHERE name LIKE ?", prefix + "%")


def db_count(store: Path, sql: str, *params: object) -> int:
    """A read-only look at the database (the daemon's commits are visible once made)."""
    con = sqlite3.connect(f"file:{store / 'store.db'}?mode=ro", uri=True)
    try:
        return con.execute(sql, params).fetchone()[0]
    finally:
        con.close()


def log_size(store: Path) -> int:
    return (store / "intents.log").stat().st_size


def files(n: int, tag: str) -> dict[str, bytes]:
    return {f"{tag}{i:03d}.txt": f"{tag} {i} ".encode() * (50 + i) for i in range(n)}


def write_all(d: Path, contents: dict[str, bytes]) -> None:
    for name, data in contents.items():
        (d / name).write_bytes(data)


def sha256_name(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_close_is_answered_once_logged_and_listed_before_its_commit(start_mount):
    m = held(start_mount)
    contents = files(20, "a")
    write_all(m.path("pins"), contents)
    # every close returned: logged, not committed
    assert log_size(m.store_path) > sum(map(len, contents.values()))
    assert db_pins(m.store_path, "a") == 0
    # a listing shows them all, from the pending index: nothing waited for the commit
    assert sorted(n for n in os.listdir(m.path("pins")) if n.startswith("a")) == sorted(contents)
    for name, data in contents.items():
        assert m.path("pins", name).read_bytes() == data
    assert db_pins(m.store_path, "a") == 0
    # the status waits for it (its counts are the database's)
    intents = json.loads(m.path(".alkfs", "status").read_text())["intents"]
    assert intents == {"pending": 0, "applied": 20, "log_bytes": 0}
    assert db_pins(m.store_path, "a") == 20
    assert log_size(m.store_path) == 0
    for name, data in contents.items():
        assert m.path("pins", name).read_bytes() == data
    assert m.tracebacks() == []


def listed(d: Path, name: str) -> None:
    assert name in os.listdir(d)


@pytest.mark.parametrize(
    ("look", "waits"),
    [
        (lambda m, name, data: pin_target(m.path("pins", name)), False),  # lstat, its key
        (lambda m, name, data: m.path("pins", name).read_bytes(), False),
        (lambda m, name, data: m.path("objects", "sha256", sha256_name(data)).read_bytes(), False),
        (lambda m, name, data: listed(m.path("objects", "sha256"), sha256_name(data)), False),
        (lambda m, name, data: m.path(".alkfs", "status").read_bytes(), True),
    ],
    ids=["key", "cat", "object", "objects-listing", "status"],
)
def test_a_pending_file_is_seen_before_its_commit(start_mount, look, waits):
    """Every view answers for a pending file from the write-behind's index; only the
    status (the database's counts) waits for its commit."""
    m = held(start_mount)
    data = b"pending content\n" * 10
    m.path("pins", "p.txt").write_bytes(data)
    assert db_pins(m.store_path, "p") == 0
    look(m, "p.txt", data)
    assert db_pins(m.store_path, "p") == (1 if waits else 0)
    assert pin_target(m.path("pins", "p.txt")) == f"../objects/sha256/{sha256_name(data)}"
    assert m.path("pins", "p.txt").read_bytes() == data


def test_a_pending_name_is_taken_and_its_unlink_and_sweeps_see_it(start_mount):
    m = held(start_mount)
    m.path("pins", "x.txt").write_bytes(b"first\n")
    assert db_pins(m.store_path, "x") == 0
    # a second create of the same name, before the commit: refused as an existing pin is
    with pytest.raises(OSError) as caught:
        os.open(m.path("pins", "x.txt"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    assert caught.value.errno == errno.EEXIST
    assert db_pins(m.store_path, "x") == 0  # (the create's lookup found it pending)
    # an unlink right after the close removes the pin, for good
    m.path("pins", "y.txt").write_bytes(b"gone\n")
    os.unlink(m.path("pins", "y.txt"))
    assert not os.path.lexists(m.path("pins", "y.txt"))
    # two sweeps (window 0) right after a close keep what it pinned
    keep = b"kept across sweeps\n"
    m.path("pins", "z.txt").write_bytes(keep)
    for _ in range(2):
        with open(m.path(".alkfs", "control"), "w") as f:
            f.write("sweep\n")
    m.restart()
    assert m.path("pins", "z.txt").read_bytes() == keep
    assert m.path("pins", "x.txt").read_bytes() == b"first\n"
    assert not os.path.lexists(m.path("pins", "y.txt"))
    assert log_size(m.store_path) == 0
    assert m.tracebacks() == []


def test_a_daemon_killed_with_intents_pending_loses_none(start_mount):
    m = held(start_mount)
    blobs = db_count(m.store_path, "SELECT count(*) FROM blobs")
    pinned = files(30, "k")
    write_all(m.path("pins"), pinned)
    loose = {sha256_name(d): d for d in files(10, "o").values()}
    write_all(m.path("objects", "sha256"), loose)
    assert db_pins(m.store_path, "k") == 0
    assert db_count(m.store_path, "SELECT count(*) FROM blobs") == blobs
    assert m.stop(signal.SIGKILL) == -signal.SIGKILL
    m.unmount(m.mnt)
    # the command line opens the store with its lock: it applies the log first
    done = subprocess.run(
        [sys.executable, "-m", "alkfs.cli", "--store", str(m.store_path), "pins"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.splitlines()]
    assert sorted(n for n in listed if n.startswith("k")) == sorted(pinned)
    assert db_count(m.store_path, "SELECT count(*) FROM blobs") == blobs + 40
    assert log_size(m.store_path) == 0
    done = subprocess.run(
        [sys.executable, "-m", "alkfs.cli", "--store", str(m.store_path), "verify"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and '"corrupt": []' in done.stdout, done
    m.start()
    for name, data in pinned.items():
        assert m.path("pins", name).read_bytes() == data
    for name, data in loose.items():
        assert m.path("objects", "sha256", name).read_bytes() == data


def test_the_daemon_applies_a_log_left_by_a_killed_one_when_it_starts(start_mount):
    m = held(start_mount)
    pinned = files(5, "r")
    write_all(m.path("pins"), pinned)
    assert log_size(m.store_path) > 0
    assert db_pins(m.store_path, "r") == 0
    m.restart(kill=True)
    assert log_size(m.store_path) == 0
    assert db_pins(m.store_path, "r") == 5
    for name, data in pinned.items():
        assert m.path("pins", name).read_bytes() == data


def test_a_torn_record_at_the_end_of_the_log_is_dropped(start_mount):
    """A record cut short (its write never returned) is not applied; the whole ones are."""
    m = held(start_mount)
    pinned = files(3, "t")
    write_all(m.path("pins"), pinned)
    m.stop(signal.SIGKILL)
    m.unmount(m.mnt)
    log = m.store_path / "intents.log"
    whole = log.read_bytes()
    log.write_bytes(whole + whole[: len(whole) // 3 + 5])  # a torn copy of the first ones
    m.start()
    assert sorted(n for n in os.listdir(m.path("pins")) if n.startswith("t")) == sorted(pinned)
    for name, data in pinned.items():
        assert m.path("pins", name).read_bytes() == data
    assert log_size(m.store_path) == 0


def test_with_the_log_off_each_close_commits(start_mount):
    m = held(start_mount, {**HOLD, "ALKFS_INTENTS": "off"})
    m.path("pins", "direct.txt").write_bytes(b"direct\n")
    assert db_pins(m.store_path, "direct") == 1
    assert not (m.store_path / "intents.log").exists()


def test_an_apply_that_fails_loses_nothing_and_the_mount_serves_on(start_mount):
    """sqlite's write lock held elsewhere past its busy timeout (5 s) makes every apply
    fail: a listing shows the pending file meanwhile, from the write-behind's index
    (alkfs/writebehind.py), as reads do; the worker applies it once the lock goes, and
    the log is emptied."""
    m = held(start_mount, {"ALKFS_INTENTS_GATHER_S": "2"})
    data = b"waits for the lock\n" * 20
    m.path("pins", "w.txt").write_bytes(data)
    other = sqlite3.connect(m.store_path / "store.db", isolation_level=None, timeout=30)
    other.execute("BEGIN IMMEDIATE")
    try:
        deadline = time.monotonic() + 60
        while "intents: 1 small put(s) not applied yet" not in m.log():  # (~7 s)
            assert time.monotonic() < deadline, m.log()
            time.sleep(0.5)
        listed = os.listdir(m.path("pins"))
        assert "w.txt" in listed and "warm-up" in listed
        assert m.path("pins", "w.txt").read_bytes() == data
        assert log_size(m.store_path) > len(data)  # (still logged: nothing lost)
    finally:
        other.execute("ROLLBACK")
        other.close()
    deadline = time.monotonic() + 60
    while db_pins(m.store_path, "w.txt") == 0:  # the worker's retries
        assert time.monotonic() < deadline, m.log()
        time.sleep(0.5)
    assert m.path("pins", "w.txt").read_bytes() == data
    assert log_size(m.store_path) == 0
    assert "intents: applied after" in m.log()
    assert m.tracebacks() == []


def test_a_stream_of_closes_is_applied_once_it_pauses(start_mount):
    """The worker applies once closes pause for the gather time (1 s here), not a gather
    time after the first close: of a close every 0.1 s for 2.5 s, the worker applies
    nothing meanwhile (without the pause rule it applied every second: 20 of the 25
    were in the database when the stream ended); after the pause, all of it."""
    m = held(start_mount, {"ALKFS_INTENTS_GATHER_S": "1"})
    contents = files(25, "s")
    started = time.monotonic()
    committed = []  # in the database after each close
    for name, data in contents.items():
        (m.path("pins") / name).write_bytes(data)
        committed.append(db_pins(m.store_path, "s"))
        time.sleep(0.1)
    assert time.monotonic() - started < 4.5, "the stream must end before the 5 s hold"
    # (a close commits its own file when the disk's free space is due for a look: about
    # one a second; the worker applied none of the others during the stream)
    assert committed[-1] <= 5, str(committed)
    assert log_size(m.store_path) > sum(map(len, contents.values())) // 2
    deadline = time.monotonic() + 30
    while db_pins(m.store_path, "s") < len(contents):
        assert time.monotonic() < deadline, m.log()
        time.sleep(0.1)
    assert db_pins(m.store_path, "s") == len(contents)
    for name, data in contents.items():
        assert (m.path("pins") / name).read_bytes() == data
    assert m.tracebacks() == []
