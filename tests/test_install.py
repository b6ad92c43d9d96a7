"""`make install` and the mount helper, for real: one install per session into a temporary
OPT and PREFIX (a venv with the patched pyfuse3 and the project, ~1 min), its commands
run, stores mounted through mount(8) (`mount -t fuse.alkfs`, an fstab line) and through
the helper called as mount(8) calls it, then `make uninstall` (the install itself:
tests/install_fixture.py, one per session, shared with tests/test_first_day.py).

mount(8) finds helpers in /sbin only, so the helper is installed at /sbin/mount.fuse.alkfs
for the session when nothing is there (and removed at the end; the mount(8) cases are
skipped when one is there already). The daemon's lines go to syslog, each at its own
priority (facility daemon) and with syslog's time only: where this machine has no
/dev/log, the tests listen there themselves for the while.

ALKFS_SKIP_INSTALL_TEST=1 skips the module. Every mount is undone and every daemon ended
(by PID) in teardown.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from install_fixture import (
    MARKS,
    SYS_HELPER,
    Install,
    Mounts,
    cmdline,
    fstype,
    gone_within,
    is_mounted,
    loggers_of,
    run,
)

# the session's one install and `mounts` (shared with tests/test_first_day.py)
pytest_plugins = ["install_fixture"]

TREE = ["git", "lfs", "objects", "pins", "repos", "roots"]
VERSION = "0.1.0"
A_TIME = re.compile(r"\d\d:\d\d:\d\d")

pytestmark = MARKS


def visible(mnt: Path) -> list[str]:
    """What `ls MNT` shows."""
    return sorted(n for n in os.listdir(mnt) if not n.startswith("."))


class Syslog:
    """What arrives at /dev/log, when the test could listen there (no syslog daemon)."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.lines: list[str] = []

    def wait_for(self, text: str, seconds: float = 5.0) -> str | None:
        if self.sock is None:
            return None
        end = time.monotonic() + seconds
        while True:
            found = next((s for s in self.lines if text in s), None)
            if found is not None or time.monotonic() > end:
                return found
            self.sock.settimeout(max(0.01, end - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                self.lines.append(self.sock.recv(65536).decode(errors="replace"))


# a datagram of the local syslog protocol (logger(1), glibc's syslog): `<PRI>TIME TAG: MSG`
DATAGRAM = re.compile(r"<(\d+)>([A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d) alkfsd\[(\d+)\]: (.*)", re.S)


def pri_and_message(datagram: str | None, pid: int) -> tuple[int, str]:
    """(PRI, MSG) of a datagram tagged alkfsd[pid]; MSG carries no time (syslog's header
    has the one)."""
    assert datagram is not None
    m = DATAGRAM.fullmatch(datagram)
    assert m is not None, datagram
    assert int(m[3]) == pid, datagram
    assert not A_TIME.search(m[4]), datagram
    return int(m[1]), m[4]


@pytest.fixture
def syslog() -> Iterator[Syslog]:
    """Listens at /dev/log while the test runs if nothing is there (this container has
    no syslog daemon or journald); removed afterwards. With a real one there, the
    messages go to it and are not looked at."""
    log = Syslog()
    if os.path.lexists("/dev/log"):
        yield log
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind("/dev/log")
        log.sock = sock
        yield log
    finally:
        sock.close()
        if log.sock is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink("/dev/log")


def need_real_sbin(inst: Install) -> None:
    if not inst.real_sbin:
        pytest.skip(f"{SYS_HELPER} was there before: mount(8) would run that one")


def assert_detached(pid: int) -> None:
    """A daemon of its own session (no terminal, no parent of ours), stdin /dev/null, its
    output to a pipe that a logger reads."""
    assert os.getsid(pid) == pid
    with open(f"/proc/{pid}/stat") as f:
        ppid = int(f.read().rpartition(")")[2].split()[1])
    assert ppid != os.getpid()
    assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
    assert os.readlink(f"/proc/{pid}/fd/2").startswith("pipe:")
    readers = loggers_of(pid)
    assert len(readers) == 1, readers
    assert os.getsid(readers[0]) == readers[0]
    assert os.readlink(f"/proc/{readers[0]}/fd/0") == os.readlink(f"/proc/{pid}/fd/2")


def unmount_ends_daemon(mnt: Path, pid: int) -> None:
    logger = loggers_of(pid)
    done = run("umount", mnt)
    assert done.returncode == 0, done.stderr
    assert not is_mounted(mnt)
    assert gone_within([pid, *logger]), f"alkfsd {pid} (or its logger) still runs after umount"


def test_installed_commands_run_from_the_install(installed: Install) -> None:
    """alkfs and alkfsd on PATH are links into the venv at OPT, print the version, and
    run the installed package (not the checkout) over the patched pyfuse3, in a venv of
    the system's Python; make install again builds nothing (its stamps)."""
    bindir = installed.prefix / "bin"
    for name in ("alkfs", "alkfsd"):
        assert os.readlink(bindir / name) == str(installed.opt / "bin" / name)
        done = run(bindir / name, "--version")
        assert (done.returncode, done.stdout.strip()) == (0, f"{name} {VERSION}"), done.stderr
    helper = installed.sbin / "mount.fuse.alkfs"
    assert os.readlink(helper) == str(installed.opt / "bin" / "mount.fuse.alkfs")
    assert os.access(helper, os.X_OK)
    with open(helper) as f:
        assert f.readline() == f"#!{installed.opt}/bin/python -I\n"
    done = run(
        installed.opt / "bin" / "python",
        "-I",
        "-c",
        "import alkfs, alkfsd, pyfuse3; print(alkfs.__file__, alkfsd.__file__, "
        "pyfuse3.FAST_READS, pyfuse3.NOGIL_COPY_MIN)",
    )
    site = str(installed.opt / "lib")
    a, d, fast, nogil = done.stdout.split()
    assert a.startswith(site) and d.startswith(site), done.stdout
    assert (fast, nogil) == ("16", "65536")
    with open(installed.opt / "pyvenv.cfg") as f:
        assert "home = /usr/bin\n" in f.read()  # (the system's Python, not a user's)
    # (the project is installed again only if its sources changed since)
    again = installed.make("install", "-n")
    assert again.returncode == 0
    assert "-m venv" not in again.stdout and "pip download" not in again.stdout, again.stdout


def test_helper_maps_options_to_daemon_flags(installed: Install, tmp_path: Path) -> None:
    """-f (fake) -v: the daemon's command line for every key, generic options dropped;
    nothing started, nothing made."""
    helper = installed.sbin / "mount.fuse.alkfs"
    opts = (
        "rw,defaults,_netdev,nofail,noauto,auto,user,nouser,x-systemd.automount,"
        "comment=x,dev,suid,exec,nodev,nosuid,noexec,relatime,noatime,atime,"
        "create,window=1h,sweep_every=0,allow_other,ro,read_only,kv_only,threshold=4096,"
        "push_grace=10m,owner=0:0,log_level=debug,metrics_listen=127.0.0.1:9101,"
        'config=conf.toml,"database=postgresql:'
        '//u:secret@db/alk?host=/run/pg,x",demo'
    )
    done = run(helper, "alkfs:store", tmp_path, "-f", "-v", "-n", "-o", opts, "-t", "fuse.alkfs")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"mount.fuse.alkfs: running {installed.opt}/bin/alkfsd {os.getcwd()}/store {tmp_path} "
        "--create --window 1h --sweep-every 0 --allow-other --read-only --read-only --kv-only "
        f"--threshold 4096 --push-grace 10m --owner 0:0 --log-level debug "
        f"--metrics-listen 127.0.0.1:9101 --config {os.getcwd()}/conf.toml --database postgresql://u:***@db/alk?host=/run/pg,x "
        "--demo"
    ]
    assert not (Path.cwd() / "store").exists()


@pytest.mark.parametrize(
    ("opts", "says"),
    [
        ("create,bogus=1", "unknown option 'bogus=1'"),
        ("create=yes", "option 'create' takes no value"),
        ("window", "option 'window' needs a value"),
        ("mount_timeout=soon", "mount_timeout takes a number of seconds"),
    ],
)
def test_a_bad_option_is_refused_and_nothing_starts(
    installed: Install, mounts: Mounts, tmp_path: Path, opts: str, says: str
) -> None:
    """Through mount(8) when it can find the helper (else the helper as mount runs it):
    exit non-zero, one line naming the option, nothing mounted, no daemon, no store."""
    mnt = mounts.new(tmp_path)
    store = tmp_path / "store"
    if installed.real_sbin:
        done = run("mount", "-t", "fuse.alkfs", store, mnt, "-o", opts)
    else:
        done = run(installed.sbin / "mount.fuse.alkfs", store, mnt, "-o", opts)
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mount.fuse.alkfs: ") and says in lines[0]
    assert not is_mounted(mnt)
    assert mounts.daemons(mnt) == []
    assert not store.exists()


def test_a_missing_store_without_create_gives_the_daemons_line(
    installed: Install, mounts: Mounts, syslog: Syslog, tmp_path: Path
) -> None:
    """The daemon's refusal (a line outside its log: no priority prefix) on the terminal,
    and in syslog as daemon.err (<27>)."""
    mnt = mounts.new(tmp_path)
    store = tmp_path / "nostore"
    if installed.real_sbin:
        done = run("mount", "-t", "fuse.alkfs", store, mnt, "-o", "window=0")
    else:
        done = run(installed.sbin / "mount.fuse.alkfs", store, mnt, "-o", "window=0")
    assert done.returncode != 0
    line = f"alkfsd: no store at {store}: give --create to make one there"
    assert done.stderr.splitlines() == [line]
    assert not is_mounted(mnt)
    assert mounts.daemons(mnt) == []
    assert not store.exists()
    if syslog.sock is not None:
        said = syslog.wait_for(line)
        assert said is not None, syslog.lines
        assert DATAGRAM.fullmatch(said) is not None and said.startswith("<27>"), said


def test_a_daemon_that_does_not_mount_in_time_is_stopped(
    installed: Install, mounts: Mounts, tmp_path: Path
) -> None:
    """mount_timeout=0.01: the helper gives up, ends the daemon and clears what it left;
    one line, exit 1."""
    mnt = mounts.new(tmp_path)
    helper = installed.sbin / "mount.fuse.alkfs"
    done = run(helper, tmp_path / "store", mnt, "-o", "create,mount_timeout=0.01")
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "alkfsd did not mount" in lines[0], lines
    assert not is_mounted(mnt)
    assert mounts.daemons(mnt) == []


def test_the_helper_as_mount_calls_it_mounts_and_umount_ends_the_daemon(
    installed: Install, mounts: Mounts, tmp_path: Path
) -> None:
    """`mount.fuse.alkfs STORE MNT -n -v -o ...`: returns once the mount answers, with the
    daemon detached; umount ends it. A second mount at the same place is refused with the
    daemon's line and leaves the first alone."""
    mnt = mounts.new(tmp_path)
    store = tmp_path / "store"
    helper = installed.sbin / "mount.fuse.alkfs"
    done = run(helper, store, mnt, "-n", "-v", "-o", "rw,_netdev,create,window=0,sweep_every=0")
    assert done.returncode == 0, done.stderr
    assert fstype(mnt) == "fuse.alkfs"
    assert visible(mnt) == TREE  # (at once: no waiting)
    (pid,) = mounts.daemons(mnt)
    assert (
        done.stdout.strip() == f"mount.fuse.alkfs: {store} mounted at {mnt} by alkfsd (pid {pid})"
    )
    assert_detached(pid)
    again = run(helper, store, mnt, "-o", "window=0")
    assert again.returncode == 1
    assert again.stderr.startswith(f"alkfsd: cannot mount at {mnt}: a live mount is there")
    assert len(again.stderr.splitlines()) == 1
    assert mounts.daemons(mnt) == [pid]
    assert visible(mnt) == TREE
    unmount_ends_daemon(mnt, pid)


def test_mount_t_fuse_alkfs_mounts_detached_and_logs_to_syslog_at_each_lines_priority(
    installed: Install, mounts: Mounts, syslog: Syslog, tmp_path: Path
) -> None:
    """The daemon's lines reach syslog tagged alkfsd[PID], an info line as daemon.info
    (<30>), a warning as daemon.warning (<28>), with syslog's time only (not the daemon's
    too); before the mount answered (read by the helper) and after (its logger)."""
    need_real_sbin(installed)
    mnt = mounts.new(tmp_path)
    store = tmp_path / "store"
    done = run("mount", "-t", "fuse.alkfs", store, mnt, "-o", "create,window=0,sweep_every=0")
    assert done.returncode == 0, done.stderr
    assert fstype(mnt) == "fuse.alkfs"
    assert os.statvfs(mnt).f_bsize > 0
    assert visible(mnt) == TREE
    (pid,) = mounts.daemons(mnt)
    assert_detached(pid)
    with pytest.raises(PermissionError):
        os.chmod(mnt / "objects", 0o700)  # (a refusal logged as a warning: EPERM)
    if syslog.sock is not None:  # the start-up lines (read by the helper), then the rest
        pri, said = pri_and_message(syslog.wait_for(f"INFO mounted {store} at {mnt}"), pid)
        assert pri == 30 and said.startswith(f"INFO mounted {store} at {mnt} (database ")
        ready = syslog.wait_for(f"INFO ready: {mnt} serves {store}")
        assert pri_and_message(ready, pid) == (30, f"INFO ready: {mnt} serves {store}")
        warned = syslog.wait_for("WARNING setattr /objects")
        pri, said = pri_and_message(warned, pid)
        assert pri == 28 and said.startswith("WARNING setattr /objects: errno=EPERM"), said
        ours = [d for d in syslog.lines if f" alkfsd[{pid}]: " in d]
        assert all(pri_and_message(d, pid) for d in ours), ours
    unmount_ends_daemon(mnt, pid)
    if syslog.sock is not None:
        unmounted = syslog.wait_for(f"INFO unmounted {mnt}")
        assert pri_and_message(unmounted, pid) == (30, f"INFO unmounted {mnt}")
    done = run("mount", "-r", "-t", "fuse.alkfs", store, mnt)  # -r: ro, --read-only
    assert done.returncode == 0, done.stderr
    (pid,) = mounts.daemons(mnt)
    assert "--read-only" in cmdline(pid)
    assert os.statvfs(mnt).f_flag & os.ST_RDONLY
    unmount_ends_daemon(mnt, pid)


def test_an_fstab_line_mounts_by_its_mountpoint(
    installed: Install, mounts: Mounts, tmp_path: Path
) -> None:
    """`mount -T FILE MNT` for a noauto line (which `mount -a` passes over); and a line whose
    source is `alkfs:STORE`, as the mount table shows it: `mount -a` mounts it once, and
    again finds it mounted."""
    need_real_sbin(installed)
    mnt, mnt2 = mounts.new(tmp_path), mounts.new(tmp_path, "mnt2")
    store, store2 = tmp_path / "store", tmp_path / "store2"
    fstab = tmp_path / "fstab"
    fstab.write_text(
        f"# alkfs\n{store} {mnt} fuse.alkfs "
        "noauto,_netdev,x-systemd.automount,create,window=1h 0 0\n"
    )
    done = run("mount", "-a", "-T", fstab)
    assert done.returncode == 0, done.stderr
    assert not is_mounted(mnt)
    done = run("mount", "-T", fstab, mnt)
    assert done.returncode == 0, done.stderr
    assert fstype(mnt) == "fuse.alkfs"
    assert visible(mnt) == TREE
    (pid,) = mounts.daemons(mnt)
    assert cmdline(pid)[2:] == [str(store), str(mnt), "--create", "--window", "1h"]
    unmount_ends_daemon(mnt, pid)

    fstab.write_text(f"alkfs:{store2} {mnt2} fuse.alkfs defaults,_netdev,create,window=0 0 0\n")
    for _ in range(2):
        done = run("mount", "-a", "-T", fstab)
        assert done.returncode == 0, done.stderr
    (pid,) = mounts.daemons(mnt2)
    assert visible(mnt2) == TREE
    unmount_ends_daemon(mnt2, pid)


def load_helper(inst: Install, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The installed mount.fuse.alkfs as a module (its functions called here; in
    sys.modules for the test, as its dataclasses need)."""
    path = str(inst.opt / "bin" / "mount.fuse.alkfs")
    loader = importlib.machinery.SourceFileLoader("installed_mount_helper", path)
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, loader.name, module)
    loader.exec_module(module)
    return module


@pytest.mark.parametrize("relay", ["logger", "python"])
def test_each_relay_gives_each_line_its_priority(
    installed: Install, syslog: Syslog, monkeypatch: pytest.MonkeyPatch, relay: str
) -> None:
    """logger(1) --prio-prefix, or Python's syslog module where logger is missing: a
    line's `<N>` prefix is its priority (facility daemon) and is not in the message; a
    line without one (the daemon's refusal) is daemon.err."""
    if syslog.sock is None:
        pytest.skip("a syslog daemon has /dev/log here")
    helper = load_helper(installed, monkeypatch)
    if relay == "python":
        monkeypatch.setattr(helper.shutil, "which", lambda name: None)
        assert helper.logger_cmd(4242)[:2] == [sys.executable, "-I"]
    else:
        assert helper.logger_cmd(4242)[0] == shutil.which("logger")
    helper.to_syslog(
        b"<4>WARNING setattr /x: errno=EPERM\n<6>INFO ready\nalkfsd: no store at /s\n\n"
        b"<7>DEBUG probe\n<2>CRITICAL gone\n",
        4242,
    )
    assert syslog.wait_for("CRITICAL gone") is not None, syslog.lines
    ours = [d for d in syslog.lines if " alkfsd[4242]: " in d]
    assert [pri_and_message(d, 4242) for d in ours] == [
        (28, "WARNING setattr /x: errno=EPERM"),
        (30, "INFO ready"),
        (27, "alkfsd: no store at /s"),
        (31, "DEBUG probe"),
        (26, "CRITICAL gone"),
    ]


def test_make_uninstall_removes_what_install_made(installed: Install) -> None:
    """Then the install is put back as it was (OPT from a copy of hard links, the links
    and pages by make install, which builds nothing): the session's other modules
    (tests/test_first_day.py) use it after this one."""
    assert all(os.path.lexists(p) for p in installed.paths)
    kept = installed.base / "opt.kept"
    subprocess.run(["cp", "-al", str(installed.opt), str(kept)], check=True)
    try:
        done = installed.make("uninstall")
        assert done.returncode == 0, done.stderr
        assert [p for p in installed.paths if os.path.lexists(p)] == []
        assert not (installed.real_sbin and os.path.lexists(SYS_HELPER))
        assert not (installed.prefix / "share" / "man" / "man1" / "alkfs.1").exists()
    finally:
        if installed.opt.exists():
            shutil.rmtree(kept)
        else:
            kept.rename(installed.opt)
        again = installed.make("install")
        assert again.returncode == 0, again.stderr
        # (the venv as it was: not made again)
        assert "-m venv" not in again.stdout and "pip download" not in again.stdout
    assert all(os.path.lexists(p) for p in installed.paths)
