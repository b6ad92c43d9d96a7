"""A daemon that dies with its FUSE connection still held open (daemon/deathguard.py).

The hang this guards against: a daemon SIGKILLed while its invalidator thread waits in
the kernel for a directory lock that a client's request holds cannot finish dying (the
thread waits for the lock, the request for the dead daemon's reply), so the connection
stays open and everything on the mount waits forever. The test builds the same state
without the race: it takes a copy of the daemon's /dev/fuse descriptor (pidfd_getfd),
so the connection outlives the killed daemon, then checks that the mount answers
ECONNABORTED within a bound (the guard aborted the connection) instead of hanging, and that
a new daemon mounts at the same place."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
from pathlib import Path

import pytest
from crash_helpers import start, wait_until
from helpers import fuse_fds, open_fds, write_close

SYS_PIDFD_GETFD = 438  # (x86-64 and arm64 alike)
STAT_TIMEOUT_S = 20.0  # a hung mount makes `stat -f` wait until this kills it


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def guards(pid: int) -> list[int]:
    """The daemon's guard processes (its children running deathguard.py)."""
    return [c for c in children(pid) if b"deathguard" in Path(f"/proc/{c}/cmdline").read_bytes()]


def guard_of(pid: int) -> int:
    """The daemon's one guard process."""
    found = guards(pid)
    assert len(found) == 1, found
    return found[0]


def take_fuse_fd(pid: int) -> int:
    """A copy, in this process, of the daemon's /dev/fuse descriptor."""
    (target,) = fuse_fds(pid)
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, target, 0)
    finally:
        os.close(pidfd)
    if fd < 0:
        pytest.skip(f"pidfd_getfd: {os.strerror(ctypes.get_errno())}")
    return fd


def statfs(mnt: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["stat", "-f", str(mnt)], capture_output=True, text=True, timeout=STAT_TIMEOUT_S
    )


def test_a_killed_daemon_s_connection_is_aborted_even_if_held_open(start_mount):
    m = start_mount()
    write_close(m.path("pins", "kept"), b"pinned before the crash\n")
    guard = guards(m.pid)  # (asserted below: first what a user sees)
    held = take_fuse_fd(m.pid)
    try:
        m.stop(signal.SIGKILL)  # (exits: the held copy keeps only the connection)
        # without the guard this stat waits for a reply nobody sends (until the timeout)
        done = statfs(m.mnt)
        assert done.returncode == 1, done
        # (ECONNABORTED: what an aborted connection answers, not ENOTCONN)
        assert "Software caused connection abort" in done.stderr, done.stderr
        lines = [line for line in m.log().splitlines() if "aborting FUSE connection" in line]
        assert len(lines) == 1, m.log()
        assert f"alkfsd[{m.pid}] died and its mount takes requests nobody answers" in lines[0]
        # it ended with its work (then reaped by init: it was orphaned)
        assert len(guard) == 1, guard
        assert wait_until(lambda: not Path(f"/proc/{guard[0]}").exists(), 10)
    finally:
        os.close(held)
    start(m)  # the dead mount is cleared; the store was not locked by a zombie
    assert m.path("pins", "kept").read_bytes() == b"pinned before the crash\n"


def test_a_clean_stop_aborts_nothing_and_leaves_no_guard(start_mount):
    m = start_mount()
    guard = guard_of(m.pid)
    assert m.stop() == 0
    assert not Path(f"/proc/{guard}").exists()  # killed and reaped by the daemon
    assert "aborting FUSE connection" not in m.log()
    assert "no death guard" not in m.log()
    assert not m.mounted()


def fd_targets(pid: int) -> list[str]:
    """What the process's open files are (helpers.open_fds)."""
    return list(open_fds(pid).values())


def guard_ready(guard: int) -> bool:
    """The guard has opened its connection's fusectl files."""
    return any(t.endswith("/abort") for t in fd_targets(guard))


def test_the_guard_never_holds_the_fuse_device(start_mount):
    """(a guard with a copy of /dev/fuse would itself keep a dead daemon's connection)"""
    m = start_mount()
    guard = guard_of(m.pid)
    targets = fd_targets(guard)  # while it starts
    assert "/dev/fuse" not in targets, targets
    assert wait_until(lambda: guard_ready(guard), 10)
    targets = fd_targets(guard)  # and once it holds the fusectl files
    assert "/dev/fuse" not in targets, targets
    assert not any(t.endswith("alkfs.lock") for t in targets), targets
    assert os_errno_of_statfs(m.mnt) == 0


def os_errno_of_statfs(mnt: Path) -> int:
    try:
        os.statvfs(mnt)
    except OSError as exc:
        return exc.errno or errno.EIO
    return 0


def test_an_external_unmount_ends_the_daemon_once_its_guard_is_ready(start_mount):
    """`fusermount3 -u` from outside, after the guard has opened its fusectl files: the
    daemon exits 0. (A guard that mounted fusectl in a private namespace and stayed there
    kept a copy of the daemon's mount in it: the connection outlived the host's unmount
    and the daemon never saw its end.)"""
    m = start_mount()
    guard = guard_of(m.pid)
    assert wait_until(lambda: guard_ready(guard), 10)
    own = os.readlink(f"/proc/{m.pid}/ns/mnt")
    assert os.readlink(f"/proc/{guard}/ns/mnt") == own  # back in the daemon's namespace
    done = subprocess.run(["fusermount3", "-u", str(m.mnt)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert m.proc.wait(timeout=20) == 0
    assert not Path(f"/proc/{guard}").exists()
    assert "aborting FUSE connection" not in m.log()


def test_the_guards_pair_of_files_is_opened_whole_or_not_at_all(tmp_path: Path) -> None:
    """`open_pair` (the connection's abort and waiting files): when the second cannot be
    opened the first is closed again, so a guard that gives up leaks no descriptor."""
    from alkfsd.deathguard import open_pair

    conn = tmp_path / "42"
    conn.mkdir()
    (conn / "abort").write_bytes(b"")
    before = open_fds(os.getpid())
    with pytest.raises(FileNotFoundError):
        open_pair(str(conn))  # (no `waiting`)
    assert open_fds(os.getpid()) == before
    (conn / "waiting").write_bytes(b"0\n")
    abort, waiting = open_pair(str(conn))
    try:
        assert os.readlink(f"/proc/self/fd/{abort}") == str(conn / "abort")
        assert os.read(waiting, 8) == b"0\n"
    finally:
        os.close(abort)
        os.close(waiting)
    assert open_fds(os.getpid()) == before
