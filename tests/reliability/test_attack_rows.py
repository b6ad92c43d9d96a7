"""Findings of an attack on the mount that are small enough to stand alone: a sweep window
is a duration of at most ten years (EINVAL beyond, no traceback, never a deadline later than
that), a `--read-only` mount says so to `mount` and `statvfs`, and a rename asking for a
whiteout is EINVAL."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import subprocess
import sys
import time

import pytest
from helpers import os_errno, pin_target, sha, write_close

from alkfs.app import Alkfs
from alkfs.durations import MAX_WINDOW_S

CLI = [sys.executable, "-m", "alkfs.cli"]
RENAME_WHITEOUT = 4
AT_FDCWD = -100


def control_errno(m, line: bytes) -> int:
    """The errno of writing `line` to the control file (0: it ran)."""
    fd = os.open(m.path(".alkfs", "control"), os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, line)
        os.close(fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.close(fd)
        return exc.errno or 0
    return 0


@pytest.mark.parametrize(
    "window", [b"99999999999999999999d", b"50000d", b"-1h", b"522w", b"inf", b"nan"]
)
def test_a_sweep_window_over_ten_years_or_negative_is_einval_and_runs_nothing(mount, window):
    m = mount
    write_close(m.path("objects", "sha256", "new"), b"an orphan\n")
    assert control_errno(m, b"sweep " + window + b"\n") == errno.EINVAL
    assert "INFO sweep {" not in m.log()
    assert "Traceback" not in m.log() and "OverflowError" not in m.log()
    assert json.loads(m.path(".alkfs", "status").read_text())["last_sweep"] is None
    assert control_errno(m, b"sweep 520w\n") == 0  # (9.97 years: a window still)
    report = json.loads(m.path(".alkfs", "status").read_text())["last_sweep"]
    assert report["candidates_staged"] == 1


def test_the_cli_and_the_daemon_refuse_a_window_over_ten_years_in_one_line(tmp_path):
    store = tmp_path / "store"
    Alkfs.open(store).close()
    done = subprocess.run(
        [*CLI, "--store", str(store), "sweep", "--window", "50000d"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "10 years" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "mnt").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "alkfsd.main", str(store), str(tmp_path / "mnt")]
        + ["--window", "99999999999999999999d"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "10 years" in done.stderr


def test_a_library_sweep_never_stages_a_deadline_beyond_ten_years(tmp_path):
    with Alkfs.open(tmp_path / "store") as app:
        app.store.put(b"an orphan\n").pin.release()
        before = time.time_ns()
        report = app.store.sweep(window_s=1e30)
        assert (report.aborted, report.candidates_staged) == (None, 1)
        ((visible,),) = app.store.db.execute("SELECT visible_after FROM gc_window").fetchall()
        assert before < visible <= time.time_ns() + int(MAX_WINDOW_S * 1e9)
        assert visible >= before + int(MAX_WINDOW_S * 1e9)


def test_a_read_only_mount_shows_ro_to_mount_and_st_rdonly_to_statvfs(start_mount, tmp_path):
    store = tmp_path / "store"
    m = start_mount(store)
    m.stop()
    m = start_mount(store, "--read-only")
    with open("/proc/self/mounts") as f:
        (line,) = [x for x in f if x.split()[1] == str(m.mnt)]
    assert "ro" in line.split()[3].split(",")
    assert os.statvfs(m.mnt).f_flag & os.ST_RDONLY
    assert os_errno(write_close, m.path("objects", "sha256", "new"), b"x") == errno.EROFS


def _renameat2(old: str, new: str, flags: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.renameat2(AT_FDCWD, old.encode(), AT_FDCWD, new.encode(), flags)
    return 0 if rc == 0 else ctypes.get_errno()


def test_a_rename_asking_for_a_whiteout_is_einval_and_changes_nothing(mount):
    m = mount
    write_close(m.path("pins", "a"), b"pinned as a\n")
    got = _renameat2(str(m.path("pins", "a")), str(m.path("pins", "b")), RENAME_WHITEOUT)
    assert got == errno.EINVAL
    assert sorted(os.listdir(m.path("pins"))) == ["a"]
    assert pin_target(m.path("pins", "a")) == "../objects/sha256/" + sha(b"pinned as a\n")
    assert _renameat2(str(m.path("pins", "a")), str(m.path("pins", "b")), 0) == 0
    assert sorted(os.listdir(m.path("pins"))) == ["b"]
