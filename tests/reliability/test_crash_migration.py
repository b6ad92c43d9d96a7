"""The migration of a store written before the drain (alkfs/git/packs/drain.py): its git
objects are rows of the kv, and the daemon's background task (daemon/packs.py `run`)
moves them into packs (a build when there is no set yet) and deletes the rows, PRIMARY
written before the first deletion. These tests interrupt that, and an import:

- SIGKILL of the daemon and its git children (the gits run in sessions of their own: the
  whole tree is stopped first, then killed; the death guard is left to do its work) at a
  seeded delay within the migration of ~6,000 objects, of a store with a set already
  built (the drain alone) or of one with none (a build, then the drain). The crash
  image: integrity, the published set verifies, every object is in the kv or in that
  set, PRIMARY is there once a row has gone. Then a restart completes the migration and
  the repository clones whole through the mount (clone --mirror --no-local, fsck --full
  --strict) with the source's refs; the daemon stops with 0 and `verify` is clean.
- SIGTERM during a long migration (~100,000 objects): the daemon exits 0 within 10 s,
  the mountpoint is gone, no process it started is left; a restart completes it.
- SIGTERM of `alkfs --store S git import`: it ends within 10 s with one line and exit 143,
  no git of it left running, no ref set, and a rerun completes.

Stores "of older code" are made with ALKFS_DRAIN=0 (the import keeps every object in the
kv, as tests/git/test_drain.py does); a store from before derived sets has its derived/
removed. Generated repositories: tests/reliability/test_crash_offline.py `source_repo`.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from crash_helpers import (
    SOAK,
    check_derived_image,
    git,
    integrity_check,
    iterations,
    seeded,
    start,
    status,
    wait_until,
)
from test_crash_offline import (
    descendants,
    ended,
    packed_objects,
    ref_values,
    signal_pid,
    source_repo,
    store_repos,
    verify_offline,
)

from alkfs.keys import Algorithm

pytestmark = pytest.mark.timeout(4 * 3600 if SOAK else 900)

BOUND_S = 10.0
DRAIN_ON = {"ALKFS_DRAIN": "1"}
TAG = bytes([Algorithm.GIT_SHA1.value])


# -- stores ---------------------------------------------------------------------------------------


def cli(*args, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "alkfs.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def old_store(store: Path, src: Path, repo: str) -> None:
    """`git import` with ALKFS_DRAIN=0: every object stays a kv row (a set is built too)."""
    done = cli("--store", store, "git", "import", src, "--repo", repo, env={"ALKFS_DRAIN": "0"})
    assert done.returncode == 0, (done.stdout, done.stderr)


def without_sets(store: Path) -> Path:
    """The store as written before derived sets: no derived/ at all."""
    shutil.rmtree(store / "derived")
    return store


def kv_oids(store: Path) -> set[str]:
    """The git-sha1 objects kept as kv rows (store.db read-only: no process holds it)."""
    con = sqlite3.connect(f"file:{store / 'store.db'}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT key FROM blobs WHERE key >= ? AND key < ?", (TAG, bytes([TAG[0] + 1]))
        ).fetchall()
    finally:
        con.close()
    return {k[1:].hex() for (k,) in rows}


def all_oids(src: Path) -> set[str]:
    out = git("--git-dir", str(src), "cat-file", "--batch-all-objects", "--batch-check")
    return {line.split(" ", 1)[0] for line in out.splitlines()}


def primary(store: Path) -> bool:
    return (store / "derived" / "sha1" / "PRIMARY").is_file()


def published(store: Path) -> int:
    current = store / "derived" / "sha1" / "CURRENT"
    return int(current.read_text()) if current.exists() else 0


# -- the daemon -----------------------------------------------------------------------------------


def migrated(m) -> bool:
    """The kv holds no git object and the packs say they are the only copy."""
    try:
        st = status(m)
    except (OSError, ValueError):
        return False
    return st["objects"]["git-sha1"]["kv"] == 0 and st["packs"]["sha1"]["primary"] is True


def wait_migrated(m, timeout: float = 120.0) -> float:
    """Poll .alkfs/status (every 10 ms) until migrated; seconds taken."""
    t0 = time.monotonic()
    while not migrated(m):
        assert m.proc.poll() is None, m.log()
        assert time.monotonic() - t0 < timeout, m.log()
        time.sleep(0.01)
    return time.monotonic() - t0


def start_time(pid: int) -> str | None:
    """/proc/PID/stat's start time (a PID reused by a later process has another)."""
    try:
        return Path("/proc", str(pid), "stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def cmdline(pid: int) -> str:
    try:
        return Path("/proc", str(pid), "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def is_guard(pid: int) -> bool:
    return "deathguard" in cmdline(pid)


class Watch:
    """A thread recording every process below `pid` (its start time and command line)
    every 2 ms, until `stop()`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: dict[int, tuple[str | None, str]] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            for child in descendants(self.pid):
                if child not in self.seen:
                    self.seen[child] = (start_time(child), cmdline(child))
            time.sleep(0.002)

    def saw(self, word: str) -> bool:
        return any(word in line for _t, line in list(self.seen.values()))

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=10)

    def left_running(self) -> list[str]:
        """Those recorded that still run (same PID, same start time, not a zombie)."""
        return [
            cmdline(pid) or line  # (one seen between fork and exec: its command now)
            for pid, (t, line) in sorted(self.seen.items())
            if not ended(pid) and start_time(pid) == t
        ]


def kill_tree(pid: int) -> int:
    """SIGKILL the process `pid` and every process below it but the death guard: all
    stopped first (until no new one appears), then killed at once; the guard goes on (it
    ends once its daemon is dead). How many children were killed."""
    signal_pid(pid, signal.SIGSTOP)
    below: set[int] = set()
    while True:
        new = descendants(pid) - below
        if not new:
            break
        for child in new:
            signal_pid(child, signal.SIGSTOP)
        below |= new
    guards = {p for p in below if is_guard(p)}
    killed = sorted(below - guards)
    signal_pid(pid, signal.SIGKILL)
    for child in killed:
        signal_pid(child, signal.SIGKILL)
    for guard in guards:
        signal_pid(guard, signal.SIGCONT)
    assert wait_until(lambda: all(ended(p) for p in killed), 30), killed
    return len(killed)


def clone_check(m, repo: str, dest: Path, refs: dict[str, str]) -> None:
    """`git clone --mirror --no-local` of MNT/repos/REPO (every object through the mount),
    `fsck --full --strict` of the clone, its refs exactly `refs`."""
    git("clone", "-q", "--mirror", "--no-local", str(m.path("repos", repo)), str(dest))
    git("--git-dir", str(dest), "fsck", "--full", "--strict", "--no-dangling")
    assert ref_values(dest) == refs


def finish(m, repo: str, dest: Path, refs: dict[str, str]) -> float:
    """A (re)started daemon completes the migration; the repository clones whole; the
    daemon stops with 0, no traceback; offline verify is clean, integrity ok. Returns how
    long the migration took from the call."""
    took = wait_migrated(m)
    st = status(m)
    assert st["packs"]["sha1"]["last_error"] is None, st["packs"]
    assert primary(m.store_path)
    assert kv_oids(m.store_path) == set()
    clone_check(m, repo, dest, refs)
    assert m.stop() == 0, m.log()
    assert [line for line in m.log().splitlines() if "Traceback" in line] == [], m.log()
    assert not m.mounted()
    verify_offline(m.store_path)
    integrity_check(m.store_path)
    check_derived_image(m.store_path)
    return took


def use_store(m, store: Path) -> None:
    """The next start of `m` serves `store` (same mountpoint, same flags)."""
    m.store_path = store


# -- SIGKILL during the migration -------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_source(tmp_path_factory) -> Path:
    """~16,000 objects (two pages of the drain): 1,800 commits of nested dirs, two small
    edits each, 39 refs."""
    return source_repo(tmp_path_factory.mktemp("small") / "src.git", seeded("mig", -1), 1800, "m")


@pytest.fixture(scope="module")
def big_source(tmp_path_factory) -> Path:
    """~106,000 objects: 12,000 commits as above, 243 refs."""
    return source_repo(tmp_path_factory.mktemp("big") / "big.git", seeded("mig", -2), 12000, "b")


def test_sigkill_during_the_migration_of_a_kv_store(start_mount, tmp_path, small_source):
    src = small_source
    refs, oids = ref_values(src), all_oids(src)
    assert len(refs) == 39 and len(oids) > 8192  # (two pages of the drain)
    templates = {"drain": tmp_path / "template-drain", "build": tmp_path / "template-build"}
    old_store(templates["drain"], src, "src")
    assert kv_oids(templates["drain"]) == oids and not primary(templates["drain"])
    assert published(templates["drain"]) == 1
    shutil.copytree(templates["drain"], templates["build"], symlinks=True)
    without_sets(templates["build"])

    # uninterrupted: how long after the mount answers the migration takes
    measured: dict[str, float] = {}
    m = None
    for kind, template in templates.items():
        store = tmp_path / f"measured-{kind}"
        shutil.copytree(template, store, symlinks=True)
        if m is None:
            m = start_mount(store, "--window", "0", env=DRAIN_ON)
        else:
            use_store(m, store)
            start(m)
        measured[kind] = finish(m, "src", tmp_path / f"measured-clone-{kind}", refs)
        assert published(store) == 1  # (the import's set; or the first one built)
        shutil.rmtree(store)
    print(f"migration after the mount: {', '.join(f'{k} {t:.2f} s' for k, t in measured.items())}")

    # (4 rounds in make test, two of each kind; 100 at soak length)
    for i in range(iterations(4, 100)):
        rng = seeded("migration", i)
        kind = "drain" if i % 2 == 0 else "build"
        store = tmp_path / f"store-{i}"
        shutil.copytree(templates[kind], store, symlinks=True)
        use_store(m, store)
        start(m)
        delay = rng.uniform(0.0, 1.1 * measured[kind])
        time.sleep(delay)
        children = kill_tree(m.proc.pid)
        assert m.proc.wait(timeout=30) == -signal.SIGKILL
        # the crash image
        integrity_check(store)
        check_derived_image(store)
        left = kv_oids(store)
        gen = published(store)
        held = packed_objects(store) if gen else set()
        assert oids <= left | held, len(oids - left - held)
        assert left <= oids
        if left != oids:  # (PRIMARY is written, durably, before the first row goes)
            assert primary(store) and gen > 0
        assert store_repos(store) == {"src": refs}
        print(
            f"{kind} {i}: killed {delay:.3f} s after the mount with {children} children, "
            f"kv rows left {len(left)}/{len(oids)}, generation {gen}, primary {primary(store)}"
        )
        start(m)
        finish(m, "src", tmp_path / f"clone-{i}", refs)
        shutil.rmtree(store)
        shutil.rmtree(tmp_path / f"clone-{i}")


# -- SIGTERM during a long migration --------------------------------------------------------------


def test_sigterm_during_a_long_migration_unmounts_promptly(start_mount, tmp_path, big_source):
    """Three rounds, a fresh copy each: SIGTERM while the drain's `git index-pack
    --verify` runs, while its rows are being deleted (kv count between all and none), and
    while the first set of a store without sets is built (pack-objects runs)."""
    src = big_source
    refs, oids = ref_values(src), all_oids(src)
    assert len(oids) > 100_000
    template = tmp_path / "template"
    t0 = time.monotonic()
    old_store(template, src, "big")
    print(f"old-style store of {len(oids)} objects made in {time.monotonic() - t0:.1f} s")
    bare = tmp_path / "template-build"
    shutil.copytree(template, bare, symlinks=True)
    without_sets(bare)

    store = tmp_path / "measured"
    shutil.copytree(template, store, symlinks=True)
    m = start_mount(store, "--window", "0", env=DRAIN_ON)
    took = finish(m, "big", tmp_path / "measured-clone", refs)
    print(f"the drain of {len(oids)} kv rows: {took:.2f} s after the mount")
    assert took > 1.0  # (long enough for the rounds' points to be met)
    shutil.rmtree(store)

    def rows_between() -> bool:
        try:
            kv = status(m)["objects"]["git-sha1"]["kv"]
        except (OSError, ValueError):
            return False
        return 0 < kv < len(oids)

    rounds = [
        ("verify", template, lambda w: w.saw("index-pack")),
        ("delete", template, lambda w: rows_between()),
        ("build", bare, lambda w: w.saw("pack-objects")),
    ]
    for name, source, point in rounds:
        store = tmp_path / f"store-{name}"
        shutil.copytree(source, store, symlinks=True)
        use_store(m, store)
        start(m)
        watch = Watch(m.proc.pid)
        deadline = time.monotonic() + 120
        while not point(watch) and m.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert m.proc.poll() is None and point(watch), (name, m.log())
        t0 = time.monotonic()
        m.proc.send_signal(signal.SIGTERM)
        try:
            rc = m.proc.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - t0
        time.sleep(0.2)  # (a child outliving the daemon would show now)
        watch.stop()
        kv_then = len(kv_oids(store))
        print(
            f"{name}: SIGTERM, {kv_then} kv rows left: exit {rc} in {took:.2f} s, "
            f"children seen: {sorted({line.split(' ')[0] for _t, line in watch.seen.values()})}"
        )
        assert rc == 0, (name, m.log())
        assert took < BOUND_S
        with open("/proc/self/mounts") as f:
            assert str(m.mnt) not in f.read()
        assert watch.left_running() == [], name
        assert "unmounted" in m.log() and "Traceback" not in m.log()
        integrity_check(store)
        check_derived_image(store)
        start(m)
        finish(m, "big", tmp_path / f"clone-{name}", refs)
        shutil.rmtree(store)
        shutil.rmtree(tmp_path / f"clone-{name}")


# -- SIGTERM during an import ------------------------------------------------------------------------


class SigtermNotHandled(Exception):
    """What SIGTERM must do to `alkfs` and did not: end it with one line and exit 143,
    its gits (pack-objects, index-pack, in sessions of their own) killed with it."""


def test_sigterm_during_a_git_import(tmp_path, big_source):
    src = big_source
    refs = ref_values(src)
    measured = tmp_path / "measured"
    t0 = time.monotonic()
    done = cli("--store", measured, "git", "import", src, "--repo", "big", env=DRAIN_ON)
    t_run = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    assert store_repos(measured) == {"big": refs}
    print(f"import: {t_run:.2f} s uninterrupted")
    assert t_run > 1.0
    shutil.rmtree(measured)

    problems: list[str] = []
    for i in range(iterations(2)):  # (2 rounds in make test, 50 at soak length)
        rng = seeded("import-term", i)
        store = tmp_path / f"store-{i}"
        err = tmp_path / f"import-{i}.err"
        with open(err, "wb") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "alkfs.cli", "--store", str(store), "git", "import"]
                + [str(src), "--repo", "big"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=f,
                start_new_session=True,
                env={**os.environ, **DRAIN_ON},
            )
        watch = Watch(proc.pid)
        delay = rng.uniform(0.3 * t_run, 0.8 * t_run)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            pass
        assert proc.poll() is None, f"the import ended before {delay:.2f} s"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - t0
        time.sleep(0.2)
        watch.stop()
        orphans = watch.left_running()
        stderr = err.read_text(errors="replace")
        print(
            f"import {i}: SIGTERM at {delay:.2f} s: exit {rc} in {took:.2f} s, "
            f"stderr {stderr.strip()!r}, left running: {[o[:60] for o in orphans]}"
        )
        # (the orphans end on their own: their input is gone, or they finish their pack)
        assert wait_until(lambda w=watch: w.left_running() == [], 60), watch.left_running()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        assert rc is not None and took < BOUND_S, (rc, took)
        integrity_check(store)
        check_derived_image(store)
        assert store_repos(store).get("big", {}) == {}
        done = cli("--store", store, "git", "import", src, "--repo", "big", env=DRAIN_ON)
        assert done.returncode == 0, done.stderr
        assert store_repos(store) == {"big": refs}
        verify_offline(store)
        integrity_check(store)
        check_derived_image(store)
        shutil.rmtree(store)
        if rc != 128 + signal.SIGTERM:
            problems.append(f"round {i}: exit {rc}")
        lines = stderr.strip().splitlines()
        if (
            len(lines) != 1
            or not lines[0].startswith("alkfs git import: ")
            or "Traceback" in stderr
        ):
            problems.append(f"round {i}: stderr {stderr!r}")
        if orphans:
            problems.append(f"round {i}: left running {orphans}")
    if problems:
        raise SigtermNotHandled("; ".join(problems))
