"""SIGTERM and SIGINT end the daemon within seconds even while a long sweep runs (issue
38 row 9: the sweep went on for 10+ minutes with the mount unanswered): the sweep ends
at its next safe point, `aborted: "interrupted"`, the mount goes and the daemon exits 0.

The long sweep is a real one: a registered borrower whose own object directory holds a
FIFO where a loose object should be, so the `git cat-file` that reads it blocks (until
its 600 s timeout)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers import git, status

BOUND_S = 10.0


def stalled_borrower(path: Path) -> Path:
    """A repository whose first loose object is a FIFO: reading it blocks."""
    git("init", "-q", "-b", "main", path)
    (path / "f").write_text("a file\n")
    git("-C", path, "add", "f")
    git("-C", path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    loose = sorted(p for p in (path / ".git" / "objects").glob("??/*") if p.is_file())[0]
    loose.unlink()
    os.mkfifo(loose)
    return path


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_a_long_sweep_and_the_daemon_within_seconds(start_mount, tmp_path, sig):
    m = start_mount(None, "--window", "0")
    os.symlink(stalled_borrower(tmp_path / "stalled"), m.path("roots", "stalled"))
    errors: list[BaseException] = []

    def sweep() -> None:
        try:
            m.path(".alkfs", "control").write_text("sweep\n")
        except OSError as exc:
            errors.append(exc)

    sweeper = threading.Thread(target=sweep, daemon=True)
    sweeper.start()
    deadline = time.monotonic() + BOUND_S
    while not status(m)["sweeping"]:
        assert time.monotonic() < deadline, "the sweep never started"
        time.sleep(0.05)
    time.sleep(1.0)  # (well inside the borrower's git, which waits on the FIFO)
    assert status(m)["sweeping"] and sweeper.is_alive()
    t0 = time.monotonic()
    assert m.stop(sig, timeout=BOUND_S) == 0
    took = time.monotonic() - t0
    print(f"{signal.Signals(sig).name} during a sweep: the daemon exited in {took:.2f} s")
    assert took < BOUND_S
    sweeper.join(timeout=BOUND_S)
    assert not sweeper.is_alive()
    log = m.log()
    assert "sweep: stopped at a safe point, the store is closing" in log
    assert '"aborted": "interrupted"' in log
    assert "unmounted" in log and "Traceback" not in log
    with open("/proc/self/mounts") as f:
        assert str(m.mnt) not in f.read()
    stray = subprocess.run(
        ["pgrep", "-f", f"--git-dir {tmp_path / 'stalled' / '.git'}"], capture_output=True
    )
    assert stray.stdout == b"", "the borrower's git outlived the sweep"


SLOW_GIT = """#!/bin/sh
# git, but a pack-objects (the derived packs' build) first waits: a long build
for a in "$@"; do
  if [ "$a" = pack-objects ]; then
    touch "{marker}"
    sleep {sleep}
    break
  fi
done
exec {git} "$@"
"""


def _running_with(path: Path) -> list[int]:
    """The processes whose environment names `path` (the slow git's PATH)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if str(path).encode() in f.read():
                    out.append(int(pid))
        except OSError:
            continue
    return out


def slow_git_mount(start_mount, tmp_path: Path, sleep: int):
    """A mount whose daemon finds on its PATH a git whose pack-objects touches a marker
    and waits `sleep` s first, holding a pushed repository of 3 commits (9 objects):
    (mount, the wrapper's directory, the marker)."""
    import shutil

    bin_dir, marker = tmp_path / "bin", tmp_path / "pack-objects-started"
    bin_dir.mkdir()
    wrapper = bin_dir / "git"
    wrapper.write_text(SLOW_GIT.format(marker=marker, git=shutil.which("git"), sleep=sleep))
    wrapper.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "ALKFS_PACK_EVERY": "3600"}
    m = start_mount(None, "--window", "1h", env=env)
    src = tmp_path / "src"
    git("init", "-q", "-b", "main", src)
    for i in range(3):
        (src / f"f{i}").write_text(f"file {i}\n" * 50)
        git("-C", src, "add", ".")
        git("-C", src, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", f"{i}")
    m.path("repos", "r").mkdir()
    git("-C", src, "push", "-q", m.path("repos", "r"), "main")
    return m, bin_dir, marker


def test_sigterm_ends_a_long_pack_build_and_the_daemon_within_seconds(start_mount, tmp_path):
    """A pack build whose git runs long (a `git` on the daemon's PATH whose pack-objects
    waits 300 s first): SIGTERM kills that git and its process group, the build ends, the
    daemon exits 0 within the bound; the next daemon builds the set."""
    m, bin_dir, marker = slow_git_mount(start_mount, tmp_path, 300)
    errors: list[BaseException] = []

    def repack() -> None:
        try:
            m.path(".alkfs", "control").write_text("repack\n")
        except OSError as exc:
            errors.append(exc)

    builder = threading.Thread(target=repack, daemon=True)
    builder.start()
    deadline = time.monotonic() + BOUND_S * 3
    while not marker.exists():
        assert time.monotonic() < deadline, "the build never reached pack-objects"
        time.sleep(0.05)
    t0 = time.monotonic()
    assert m.stop(signal.SIGTERM, timeout=BOUND_S) == 0
    took = time.monotonic() - t0
    print(f"SIGTERM during a pack build: the daemon exited in {took:.2f} s")
    assert took < BOUND_S
    builder.join(timeout=BOUND_S)
    assert not builder.is_alive()
    assert not _running_with(bin_dir), "the build's git outlived the daemon"
    assert "Traceback" not in m.log()
    m.env = None  # (the real git from here)
    m.start()
    m.path(".alkfs", "control").write_text("repack\n")
    st = status(m)["packs"]["sha1"]
    assert st["objects"] >= 9 and st["last_error"] is None, st


def test_a_build_whose_git_outlasts_a_look_at_the_stop_still_gets_its_input(start_mount, tmp_path):
    """pack-objects reads the build's object list on stdin and here starts a second late
    (longer than the 0.25 s between two looks at the store's stop): the build succeeds."""
    m, _bin_dir, marker = slow_git_mount(start_mount, tmp_path, 1)
    m.path(".alkfs", "control").write_text("repack\n")
    assert marker.exists()
    st = status(m)["packs"]["sha1"]
    assert st["objects"] >= 9 and st["last_error"] is None, st
    assert "Traceback" not in m.log()
