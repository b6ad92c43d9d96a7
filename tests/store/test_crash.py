"""A writer SIGKILLed mid-put leaves a store that opens cleanly, whole and without residue.

The writer is a real process (sys.executable) putting in a loop and printing each
returned key, flushed. The test kills it while a put is mid-stream (a slow
generator source holds the put open after its first bytes, past the threshold
for a large put so its staging file exists), or at an arbitrary point of a
tight loop, then reopens the store and checks every reported object.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pysqlite3.dbapi2 as sqlite3
import pytest

from alkfs.keys import Algorithm, Key
from alkfs.store import DB_NAME, LARGE_DIR, Store

THRESHOLD = 1024
MID_STREAM = (0, 2048)  # the staging file's size mid-stream (O_DIRECT: 0, buffered: 2048)

CONTENT_SRC = """
def content(kind, i):
    if kind == "large" or (kind == "tight" and i % 2):
        size = 3 * 1024 + 37 * i
    else:
        size = 200 + 11 * i
    seed = f"{kind}:{i}:".encode()
    return (seed * (size // len(seed) + 1))[:size]
"""
namespace: dict = {}
exec(CONTENT_SRC, namespace)
content = namespace["content"]

WRITER = (
    CONTENT_SRC
    + """
import sys, time
from alkfs.store import Store

root, kind, stop_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = Store.open(root, mode="dual-tier", threshold=1024, window_s=0)

def say(line):
    # one write of the whole line: print() writes each piece on its own where stdout
    # is unbuffered (PYTHONUNBUFFERED), and a kill between two would cut the line
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()

def slow(i, data):
    # Past the threshold first (a large put has spilled to its staging file), then
    # say so, then hold the put open mid-stream.
    first = 2048 if len(data) > 1024 else len(data) // 2
    for start in range(0, first, 512):
        yield data[start : min(start + 512, first)]
    say(f"mid {i}")
    if i >= stop_at:
        time.sleep(120)
    yield data[first:]

i = 0
while True:
    data = content(kind, i)
    if kind == "tight":
        result = store.put(data, length=len(data))
    else:
        result = store.put(slow(i, data), length=len(data) if i % 2 else None)
    result.pin.release()
    say(f"key {i} {result.key.hex}")
    i += 1
"""
)


def wait_for_staging(root: Path, sizes: tuple[int, ...], timeout: float = 30.0) -> None:
    """Until the put in flight has its staging file, of one of these sizes (its writer
    thread writes what the put has hashed a moment later: with O_DIRECT, only once a
    4 MiB buffer is full, so 0 bytes here)."""
    staging = root / LARGE_DIR / ".staging"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [os.path.getsize(staging / n) for n in os.listdir(staging)]
        if len(found) == 1 and found[0] in sizes:
            return
        time.sleep(0.01)
    raise AssertionError(f"no staging file of {sizes} bytes within {timeout}s")


def run_writer(root: Path, kind: str, stop_at: int) -> dict[int, str]:
    """Run the writer; SIGKILL it once it has reported `stop_at` keys (and, for the slow
    kinds, once put number `stop_at` is mid-stream). Returns every key it reported."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root), kind, str(stop_at)],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    reported: dict[int, str] = {}
    try:
        while True:
            line = proc.stdout.readline()
            assert line, f"the writer died before the kill (rc={proc.poll()})"
            tag, index, *rest = line.decode().split()
            if tag == "key":
                reported[int(index)] = rest[0]
                if kind == "tight" and len(reported) == stop_at:
                    break
            elif tag == "mid" and int(index) == stop_at:
                if kind == "large":
                    wait_for_staging(root, MID_STREAM)
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    for line in proc.stdout.read().decode().splitlines(keepends=True):  # before the kill
        if not line.endswith("\n"):
            continue  # (cut by the kill: its put's key was never reported)
        tag, index, *rest = line.split()
        if tag == "key":
            reported[int(index)] = rest[0]
    proc.stdout.close()
    return reported


def check_reopened(root: Path, kind: str, reported: dict[int, str]) -> set[Key]:
    """Reopen and check: whole objects only, every reported one byte-identical, no residue.
    Returns the keys stored but never reported (at most the one put in flight)."""
    with Store.open(root) as store:
        assert os.listdir(root / LARGE_DIR / ".staging") == []
        for i, hexdigest in reported.items():
            key = Key.from_hex(Algorithm.SHA256, hexdigest)
            assert key == Key.derive(Algorithm.SHA256, content(kind, i))
            assert store.get(key) == content(kind, i)
        assert store.verify() == []
        stored = {s.key for s in store.list(limit=10_000)}
        reported_keys = {Key.from_hex(Algorithm.SHA256, h) for h in reported.values()}
        assert reported_keys <= stored
        assert store.counts()["sha256"]["count"] == len(stored)
    conn = sqlite3.connect(root / DB_NAME)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        conn.close()
    return stored - reported_keys


def test_a_writer_killed_mid_stream_of_a_large_put_leaves_the_reported_objects_and_no_staging(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    reported = run_writer(root, "large", stop_at=6)
    assert sorted(reported) == list(range(6))
    # The kill landed mid-stream: the in-flight put had its staging file (its 2048 bytes
    # written, or still in its O_DIRECT buffer).
    staging = os.listdir(root / LARGE_DIR / ".staging")
    assert len(staging) == 1
    assert os.path.getsize(root / LARGE_DIR / ".staging" / staging[0]) in MID_STREAM
    assert check_reopened(root, "large", reported) == set()


def test_a_writer_killed_mid_stream_of_a_small_put_leaves_the_reported_objects_only(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    reported = run_writer(root, "small", stop_at=9)
    assert sorted(reported) == list(range(9))
    assert check_reopened(root, "small", reported) == set()


@pytest.mark.parametrize("stop_at", [20, 33, 40, 47, 61])
def test_a_writer_killed_anywhere_in_a_tight_loop_of_mixed_puts_leaves_whole_objects(
    tmp_path: Path, stop_at: int
) -> None:
    root = tmp_path / "store"
    reported = run_writer(root, "tight", stop_at=stop_at)
    n = len(reported)
    assert sorted(reported) == list(range(n))
    unreported = check_reopened(root, "tight", reported)
    # At most the put in flight, and then whole: it is exactly the next content.
    assert unreported <= {Key.derive(Algorithm.SHA256, content("tight", n))}


def test_a_killed_writer_releases_the_store_lock_and_a_second_run_appends(tmp_path: Path) -> None:
    root = tmp_path / "store"
    first = run_writer(root, "small", stop_at=3)
    assert not Store.is_locked(root)
    second = run_writer(root, "small", stop_at=5)
    # The second run re-puts the first run's contents (dedup) and goes on.
    assert {first[i] for i in first} <= set(second.values())
    assert check_reopened(root, "small", second) == set()


def test_opening_the_store_beside_its_holder_leaves_the_holders_staging_alone(
    tmp_path: Path,
) -> None:
    """Only the lock holder clears staging: a second, lock-free open (a tool working beside
    the daemon) must not pull the staging file out from under a put in flight."""
    import threading

    root = tmp_path / "store"
    data = bytes(range(256)) * 40
    spilled = threading.Event()
    resume = threading.Event()

    def slow():
        yield data[:4096]  # past the threshold: the put has its staging file now
        spilled.set()
        assert resume.wait(30)
        yield data[4096:]

    results: list = []
    with Store.open(root, threshold=THRESHOLD, window_s=0) as holder:
        writer = threading.Thread(target=lambda: results.append(holder.put(slow())))
        writer.start()
        try:
            assert spilled.wait(30)
            assert len(os.listdir(root / LARGE_DIR / ".staging")) == 1
            with Store.open(root, lock=False) as beside:
                assert beside.list() == []
            assert len(os.listdir(root / LARGE_DIR / ".staging")) == 1
        finally:
            resume.set()
            writer.join()
        (result,) = results
        result.pin.release()
        assert holder.get(result.key) == data
    with Store.open(root) as reopened:
        assert reopened.get(result.key) == data
        assert os.listdir(root / LARGE_DIR / ".staging") == []
