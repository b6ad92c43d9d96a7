"""When the daemon dies, abort its FUSE connection, so that nothing waits on it forever.

A daemon killed (SIGKILL, the OOM killer) while its invalidator thread is inside
`pyfuse3.invalidate_entry` cannot finish dying: the kernel call waits, uninterruptibly,
for the directory's inode lock; a client's request on that directory (a rename in
/pins, say) holds the lock and waits for the reply of a daemon that will never send it;
and the kernel ends the connection (which would fail the request) only once the last
thread of the daemon has exited. The daemon stays a zombie, its clients hang, the store
stays locked, and a new daemon's `statvfs` of the mountpoint hangs too. Only an abort of
the connection (`/sys/fs/fuse/connections/<id>/abort`, the fusectl file system) breaks
the cycle; a reboot is the other way out.

So the daemon starts this guard once it is mounted: a small process (this file run by
the same Python, standard library only) that asks the kernel for a signal when the
daemon's main thread exits (`PR_SET_PDEATHSIG`) and opens the connection's fusectl files
first (when fusectl is not mounted: in a private mount namespace it leaves again at once,
so the host's mount table does not change, and no copy of the daemon's mount outlives an
unmount in the host: a copy kept by the guard's namespace would keep the connection up
after `fusermount3 -u`, and the daemon would never see its end). At that signal, if the mount is still up, it asks it for
a statvfs: a connection the kernel ended as the daemon exited answers at once (ENOTCONN)
and nothing more is done; if nothing answers within ANSWER_WITHIN_S, the guard aborts
the connection: the stuck request fails with ECONNABORTED, the daemon's last thread
returns and exits, and the mount is a dead one that the next daemon clears at start. On
a clean exit the daemon unmounts first and then kills the guard (`stop`).

The guard holds the fusectl files open from the start: a file of a connection that has
ended reaches no connection, so a later mount that gets the same id is never touched.
Without root (no private namespace) and no fusectl mounted, there is no guard: one line
says so and the daemon serves on.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import sys
import threading

CONNECTIONS = "/sys/fs/fuse/connections"
PR_SET_PDEATHSIG = 1
CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
DEATH = signal.SIGUSR2
# a dying daemon's last threads end within this (an fsync, say); then its connection
# ends with it and a statvfs answers at once
ANSWER_WITHIN_S = 2.0


def unescape(field: str) -> str:
    """/proc/self/mounts (and mountinfo) escape space, tab, newline and backslash as
    octal."""
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and all(c in "01234567" for c in code):
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def connection_id(mnt: str, mountinfo: str = "/proc/self/mountinfo") -> int | None:
    """The fusectl id of the topmost mount at `mnt` (the minor of its anonymous device,
    read from mountinfo: a stat of our own mountpoint would wait for our own reply)."""
    found = None
    with open(mountinfo) as f:
        for line in f:
            parts = line.split()
            if len(parts) > 4 and unescape(parts[4]) == mnt:
                major, _, minor = parts[2].partition(":")
                found = int(minor) if major == "0" and minor.isdigit() else None
    return found


def start(mnt: str) -> subprocess.Popen | None:
    """Start the guard of the mount at `mnt` (call it from the main thread, once mounted:
    the death signal follows the thread that forks). None when the mount has no id."""
    conn = connection_id(mnt)
    if conn is None:
        return None
    return subprocess.Popen(
        [sys.executable, "-I", "-S", __file__, str(os.getpid()), str(conn), mnt],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        close_fds=True,  # (never /dev/fuse: a guard holding it would keep the connection)
    )


def stop(guard: subprocess.Popen | None) -> None:
    """The clean exit (after the unmount): end the guard by its PID and reap it."""
    if guard is not None and guard.poll() is None:
        guard.kill()
        guard.wait()


def _open(conn: int) -> tuple[int, int]:
    """(abort, waiting) of the connection, opened. When fusectl is not mounted here: in a
    private mount namespace that mounts it, then back in this one (the open files keep
    that fusectl mount; the private namespace, and its copy of every other mount, goes
    as the guard leaves it). The caller is single-threaded (setns of a mount namespace
    requires it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    base = f"{CONNECTIONS}/{conn}"
    if os.path.isdir(base):
        return open_pair(base)
    home = os.open("/proc/self/ns/mnt", os.O_RDONLY)
    try:
        if (
            libc.unshare(CLONE_NEWNS) != 0
            or libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0
            or libc.mount(b"fusectl", CONNECTIONS.encode(), b"fusectl", 0, None) != 0
        ):
            err = ctypes.get_errno()
            raise OSError(err, f"cannot mount fusectl: {os.strerror(err)}")
        try:
            files = open_pair(base)
        except BaseException:
            _back(libc, home)
            raise
        try:
            _back(libc, home)
        except OSError:
            for fd in files:
                os.close(fd)
            raise
        return files
    finally:
        os.close(home)


def _back(libc: ctypes.CDLL, home: int) -> None:
    """Back into the mount namespace `home` (never keep a copy of the mounts)."""
    if libc.setns(home, CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot return to the mount namespace: {os.strerror(err)}")


def open_pair(base: str) -> tuple[int, int]:
    """`base`/abort (to write) and `base`/waiting (to read), opened; neither is left open
    when the second cannot be."""
    abort = os.open(f"{base}/abort", os.O_WRONLY)
    try:
        return abort, os.open(f"{base}/waiting", os.O_RDONLY)
    except BaseException:
        os.close(abort)
        raise


def answers(mnt: str, within: float) -> bool:
    """Whether a statvfs of `mnt` returns (with any result) within `within` seconds: a
    connection the kernel ended answers at once, one still held open and unread never."""
    done = threading.Event()

    def ask() -> None:
        try:
            os.statvfs(mnt)
        except OSError:
            pass
        done.set()

    threading.Thread(target=ask, daemon=True).start()  # (released by the abort, if any)
    return done.wait(within)


def guard(parent: int, conn: int, mnt: str) -> int:
    """(the guard process) Wait for the daemon's death; then abort its connection if its
    mount is still up and nothing answers there."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a terminal's ^C is the daemon's)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (systemd's stop is the daemon's)
    signal.pthread_sigmask(signal.SIG_BLOCK, {DEATH})
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(DEATH), 0, 0, 0) != 0:
        print(f"alkfsd[{parent}] no death guard: prctl failed", file=sys.stderr)
        return 1
    try:
        abort, waiting = _open(conn)
    except OSError as exc:
        if exc.errno == errno.ENOENT:  # the connection ended before the guard began: a
            return 0  # clean stop right after the mount (nothing left to guard)
        print(f"alkfsd[{parent}] no death guard for connection {conn}: {exc}", file=sys.stderr)
        return 1
    if os.getppid() == parent:  # (else it died before the signal was asked for)
        signal.sigwait({DEATH})
    if not os.read(waiting, 64):  # an ended connection's file reads empty: unmounted
        return 0
    if answers(mnt, ANSWER_WITHIN_S):  # the daemon's exit ended the connection
        return 0
    print(
        f"alkfsd[{parent}] died and its mount takes requests nobody answers: aborting FUSE"
        f" connection {conn} (requests on it fail with ECONNABORTED; the next alkfsd clears"
        " the mount)",
        file=sys.stderr,
    )
    os.write(abort, b"1")
    return 0


if __name__ == "__main__":
    sys.exit(guard(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
