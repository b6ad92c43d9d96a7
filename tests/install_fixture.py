"""`make install` for real, once per pytest session, shared by tests/test_install.py and
tests/test_first_day.py (each names this module in `pytest_plugins`, so its fixtures are
one plugin's: the session-scoped `installed` runs once however many modules use it).

The install goes into a temporary OPT and PREFIX (a venv with the patched pyfuse3 and the
project, ~1 min); the helper into /sbin when nothing is there (mount(8) finds helpers in
/sbin only; removed at the end), else into a temporary SBIN. `make uninstall` at the end
of the session. `mounts` clears, after a test, every mountpoint it made and ends (by PID)
the installed daemons serving them.

(PYTEST_DONT_REWRITE: the test modules import their helpers from here before pytest
loads it as their plugin, too late to rewrite its asserts; the one there says its own.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SYS_HELPER = Path("/sbin/mount.fuse.alkfs")
GONE_WITHIN_S = 10.0

# the marks of every test that uses the install
MARKS = [
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

    @property
    def bin(self) -> Path:
        """PREFIX/bin, where the admin's alkfs and alkfsd are."""
        return self.prefix / "bin"

    @property
    def helper(self) -> Path:
        return self.sbin / "mount.fuse.alkfs"

    def make(self, target: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["make", "-C", str(ROOT), target, *self.make_vars, *extra],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )


@pytest.fixture(scope="session")
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
        if inst.opt.exists():
            inst.make("uninstall")
        if real_sbin and SYS_HELPER.is_symlink():
            if os.readlink(SYS_HELPER).startswith(str(base)):
                SYS_HELPER.unlink()


# -- processes and mounts ------------------------------------------------------------------


def run(*args: str | os.PathLike[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, check=False
    )


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
