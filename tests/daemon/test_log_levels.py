"""Logs an admin can read (docs/operations.md, "Logs"): `--log-level` sets the least
severe lines written, and the refusal git meets at every gc (its freshening utime on a
derived pack: EPERM) is logged at debug, not as a warning."""

from __future__ import annotations

import errno
import os
import subprocess

from helpers import GIT_ENV, os_errno


def a_pack(m) -> str:
    """The path of a derived pack of the mount's git view (an object stored, repacked)."""
    view = m.mnt / "git" / "sha1"
    env = {**os.environ, **GIT_ENV, "GIT_OBJECT_DIRECTORY": str(view)}
    subprocess.run(["git", "hash-object", "-w", "--stdin"], input=b"packed\n", env=env, check=True)
    (m.mnt / ".alkfs" / "control").write_text("repack\n")
    (pack,) = [p for p in os.listdir(view / "pack") if p.endswith(".pack")]
    return str(view / "pack" / pack)


def test_git_freshening_a_pack_is_eperm_logged_at_debug_only(start_mount):
    m = start_mount(None, "--window", "0", "--log-level", "debug")
    pack = a_pack(m)
    for _ in range(20):  # (git gc's freshening: one utime a pack)
        assert os_errno(os.utime, pack, None) == errno.EPERM
    log = m.log()
    assert "WARNING setattr" not in log
    assert log.count("DEBUG setattr ") == 20 and "is a derived file" in log
    assert os_errno(os.chmod, pack, 0o600) == errno.EPERM  # (not a freshening: a warning)
    assert "WARNING setattr" in m.log()


def test_log_level_warning_leaves_out_the_info_lines(start_mount):
    m = start_mount(None, "--window", "0", "--log-level", "warning")
    m.path(".alkfs", "control").write_text("sweep\n")
    assert os_errno(os.chmod, m.path("objects"), 0o700) == errno.EPERM
    log = m.log()
    assert "INFO" not in log and "DEBUG" not in log
    assert "WARNING setattr /objects: errno=EPERM" in log
    m.stop()
    assert "INFO" not in m.log()
