"""`make install` and the mount helper, for real: one install per session into a temporary
OPT and PREFIX (a venv with the patched pyfuse3 and the project, ~1 min), its commands
run, stores mounted through mount(8) (`mount -t fuse.alkfs`, an fstab line) and through
the helper called as mount(8) calls it, then `make uninstall`.

mount(8) finds helpers in /sbin only, so the helper is installed at /sbin/mount.fuse.alkfs
for the session when nothing is there (and removed at the end; the mount(8) cases are
skipped when one is there already). The daemon's lines go to syslog: where this machine
has no /dev/log, the tests listen there themselves for the while.

ALKFS_SKIP_INSTALL_TEST=1 skips the module. Every mount is undone and every daemon ended
(by PID) in teardown.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SYS_HELPER = Path("/sbin/mount.fuse.alkfs")
TREE = ["git", "lfs", "objects", "pins", "repos", "roots"]
VERSION = "0.1.0"
GONE_WITHIN_S = 10.0

pytestmark = [
    pytest.mark.mount,
    pytest.mark.skipif(
        os.environ.get("ALKFS_SKIP_INSTALL_TEST") == "1", reason="ALKFS_SKIP_INSTALL_TEST=1"
    ),
    pytest.mark.skipif(
        os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"
    ),
]


@dataclass
class Install:
    base: Path
    opt: Path
    prefix: Path
    sbin: Path
    real_sbin: bool  # the helper is at /sbin, where mount(8) finds it

    @property
    def make_vars(self) -> list[str]:
        return [f"OPT={self.opt}", f"PREFIX={self.prefix}", f"SBIN={self.sbin}"]

    @property
    def paths(self) -> list[Path]:
        return [
            self.prefix / "bin" / "alkfs",
            self.prefix / "bin" / "alkfsd",
            self.sbin / "mount.fuse.alkfs",
            self.opt,
        ]

    def make(self, target: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["make", "-C", str(ROOT), target, *self.make_vars, *extra],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Install]:
    base = tmp_path_factory.mktemp("install")
    real_sbin = not os.path.lexists(SYS_HELPER)
    inst = Install(
        base=base,
        opt=base / "opt",
        prefix=base / "prefix",
        sbin=SYS_HELPER.parent if real_sbin else base / "sbin",
        real_sbin=real_sbin,
    )
    try:
        done = inst.make("install")
        assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
        yield inst
    finally:
        if inst.opt.exists():  # (the uninstall test did not run)
            inst.make("uninstall")
        if real_sbin and SYS_HELPER.is_symlink():
            if os.readlink(SYS_HELPER).startswith(str(base)):
                SYS_HELPER.unlink()


@dataclass
class Mounts:
    """Mountpoints to clear and daemons to end after a test."""

    inst: Install
    mnts: list[Path]

    def new(self, tmp_path: Path, name: str = "mnt") -> Path:
        mnt = tmp_path / name
        mnt.mkdir()
        self.mnts.append(mnt)
        return mnt

    def daemons(self, mnt: Path) -> list[int]:
        return daemons_of(self.inst, mnt)


def is_mounted(mnt: Path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == str(mnt) for line in f)


def fstype(mnt: Path) -> str | None:
    found = None
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if parts[1] == str(mnt):
                found = parts[2]
    return found


def visible(mnt: Path) -> list[str]:
    """What `ls MNT` shows."""
    return sorted(n for n in os.listdir(mnt) if not n.startswith("."))


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """A process that has not exited (a zombie has: its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def daemons_of(inst: Install, mnt: Path) -> list[int]:
    """The installed alkfsd processes serving `mnt` (argv: python, alkfsd, STORE, MNT...)."""
    alkfsd = str(inst.opt / "bin" / "alkfsd")
    return [
        p for p in pids() if (argv := cmdline(p))[1:2] == [alkfsd] and str(mnt) in argv and alive(p)
    ]


def loggers_of(pid: int) -> list[int]:
    return [p for p in pids() if f"--id={pid}" in cmdline(p) and alive(p)]


def gone_within(pids_: list[int], seconds: float = GONE_WITHIN_S) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not any(alive(p) for p in pids_):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def mounts(installed: Install) -> Iterator[Mounts]:
    m = Mounts(installed, [])
    yield m
    for mnt in m.mnts:
        left = m.daemons(mnt)
        for flags in ("-u", "-uz"):
            if is_mounted(mnt):
                subprocess.run(["fusermount3", flags, str(mnt)], capture_output=True, check=False)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if not gone_within(left):
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


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


def run(*args: str | os.PathLike[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, check=False
    )


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
    "opts, says",
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
    installed: Install, mounts: Mounts, tmp_path: Path
) -> None:
    mnt = mounts.new(tmp_path)
    store = tmp_path / "nostore"
    if installed.real_sbin:
        done = run("mount", "-t", "fuse.alkfs", store, mnt, "-o", "window=0")
    else:
        done = run(installed.sbin / "mount.fuse.alkfs", store, mnt, "-o", "window=0")
    assert done.returncode != 0
    assert done.stderr.splitlines() == [
        f"alkfsd: no store at {store}: give --create to make one there"
    ]
    assert not is_mounted(mnt)
    assert mounts.daemons(mnt) == []
    assert not store.exists()


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


def test_mount_t_fuse_alkfs_mounts_detached_and_logs_to_syslog(
    installed: Install, mounts: Mounts, syslog: Syslog, tmp_path: Path
) -> None:
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
    if syslog.sock is not None:  # the start-up lines (read by the helper), then the rest
        mounted = syslog.wait_for(f"INFO mounted {store} at {mnt}")
        assert mounted is not None and f" alkfsd[{pid}]: " in mounted, syslog.lines
        assert syslog.wait_for(f"INFO ready: {mnt} serves {store}") is not None, syslog.lines
    unmount_ends_daemon(mnt, pid)
    if syslog.sock is not None:
        assert syslog.wait_for(f"INFO unmounted {mnt}") is not None, syslog.lines
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


def test_make_uninstall_removes_what_install_made(installed: Install) -> None:
    """(The module's last test: the install is gone after it.)"""
    assert all(os.path.lexists(p) for p in installed.paths)
    done = installed.make("uninstall")
    assert done.returncode == 0, done.stderr
    assert [p for p in installed.paths if os.path.lexists(p)] == []
    assert not (installed.real_sbin and os.path.lexists(SYS_HELPER))
