"""The store is private to the daemon's user (docs/operations.md, "Who can read the store"):
directories 0700, files 0600 (large objects 0400) whatever the umask; a loose store is
tightened at open; a store directory another user can write or owns is refused; another user
can neither lock nor read anything of the store.

Real processes throughout: the `alkfs` CLI and `alkfsd` run as subprocesses (under
umask 000 where it matters), the daemon mounts for real, and the other user is a real
account made here with useradd and removed with userdel -r, whatever happens.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
SMALL = b"a small object: a row of store.db\n"
LARGE = bytes(range(256)) * 1200  # 307200 bytes: over the 131072 threshold, a large file
SPOOLED = bytes(reversed(range(256))) * 8192  # 2 MiB under its own digest: spooled
MOUNT_TIMEOUT_S = 20.0
LOOSE = 0o077

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse") or shutil.which("useradd") is None,
    reason="needs root, /dev/fuse and useradd",
)


# -- instruments ---------------------------------------------------------------------------
def modes(root: Path) -> dict[str, int]:
    """Every entry under `root` (itself as '.'), by relative path: its permission bits."""
    out = {".": stat.S_IMODE(os.lstat(root).st_mode)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            path = Path(dirpath, name)
            out[str(path.relative_to(root))] = stat.S_IMODE(os.lstat(path).st_mode)
    return out


def loose(found: dict[str, int]) -> dict[str, str]:
    """The entries that give group or others any bit (octal, for a readable failure)."""
    return {path: oct(mode) for path, mode in found.items() if mode & LOOSE}


def alkfs(*args: str | os.PathLike[str], umask: int = -1) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALKFS_")}
    return subprocess.run(
        [str(BIN / "alkfs"), *map(str, args)],
        capture_output=True,
        env=env,
        timeout=120,
        umask=umask,
    )


def alkfsd_argv(store: Path, mnt: Path) -> list[str]:
    return [sys.executable, "-X", "dev", "-bb", "-m", "alkfsd.main", str(store), str(mnt)] + [
        "--create",
        "--sweep-every",
        "0",
    ]


def is_mounted(mnt: Path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(
            len(p) >= 3 and p[1] == str(mnt) and p[2].startswith("fuse")
            for p in (line.split() for line in f)
        )


class Daemon:
    """One alkfsd serving `store` at `mnt`, started under `umask` (-1: the test's own)."""

    def __init__(self, store: Path, mnt: Path, log: Path, umask: int = -1) -> None:
        self.store, self.mnt, self.log_path, self.umask = store, mnt, log, umask
        self.proc: subprocess.Popen | None = None

    def start(self) -> Daemon:
        self.mnt.mkdir(exist_ok=True)
        with open(self.log_path, "wb") as err:
            self.proc = subprocess.Popen(
                [*alkfsd_argv(self.store, self.mnt), "--window", "0"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                umask=self.umask,
            )
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not (is_mounted(self.mnt) and os.statvfs(self.mnt)):
            if self.proc.poll() is not None:
                raise RuntimeError(f"alkfsd exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"alkfsd did not mount {self.mnt}:\n{self.log()}")
            time.sleep(0.02)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=20)

    def cleanup(self) -> None:
        """End the process by its PID and leave no mount behind, whatever happened."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
        finally:
            for flags in ("-u", "-uz"):
                if is_mounted(self.mnt):
                    subprocess.run(["fusermount3", flags, str(self.mnt)], capture_output=True)


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory any user can traverse (0755), unlike pytest's tmp_path (under a 0700
    directory): what stops another user must be the store's own modes."""
    path = Path(tempfile.mkdtemp(prefix="alkfs-private-", dir="/tmp"))
    try:
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemons(base: Path) -> Iterator:
    started: list[Daemon] = []

    def start(store: Path, name: str = "mnt", umask: int = -1) -> Daemon:
        d = Daemon(store, base / name, base / f"alkfsd-{len(started)}.log", umask)
        started.append(d)
        return d.start()

    try:
        yield start
    finally:
        for d in started:
            d.cleanup()


@pytest.fixture
def other_user() -> Iterator[pwd.struct_passwd]:
    """An unprivileged account made for this test, removed (with its home) in teardown."""
    name = f"alkfs-t{secrets.token_hex(4)}"
    made = subprocess.run(
        ["useradd", "--create-home", "--shell", "/bin/sh", name], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    try:
        yield pwd.getpwnam(name)
    finally:
        gone = subprocess.run(["userdel", "-r", name], capture_output=True, text=True)
        assert gone.returncode == 0, gone.stderr
        with pytest.raises(KeyError):
            pwd.getpwnam(name)


def write_through(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        assert os.write(fd, data) == len(data)
    finally:
        os.close(fd)


def inputs(base: Path) -> tuple[Path, Path]:
    small, large = base / "small.in", base / "large.in"
    small.write_bytes(SMALL)
    large.write_bytes(LARGE)
    return small, large


def large_rel(data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    return f"large/sha256/{digest[:2]}/{digest}"


# -- created under umask 000 ---------------------------------------------------------------
def test_store_created_by_the_cli_under_umask_000_has_no_group_or_other_bits(base: Path):
    store = base / "store"
    small, large = inputs(base)
    done = alkfs("--store", store, "put", small, large, umask=0)
    assert done.returncode == 0, done.stderr
    found = modes(store)
    assert loose(found) == {}
    obj = large_rel(LARGE)
    expected = {
        ".": 0o700,
        "store.db": 0o600,
        "alkfs.lock": 0o600,
        "large": 0o700,
        "large/.staging": 0o700,
        "large/sha256": 0o700,
        str(Path(obj).parent): 0o700,
        obj: 0o400,
    }
    assert {path: found.get(path) for path in expected} == expected


def test_store_created_by_the_daemon_under_umask_000_has_no_group_or_other_bits(
    base: Path, daemons
):
    store = base / "store"
    d = daemons(store, umask=0)
    mnt = d.mnt
    write_through(mnt / "pins" / "small-one", SMALL)
    write_through(mnt / "pins" / "large-one", LARGE)
    spooled_hex = hashlib.sha256(SPOOLED).hexdigest()
    write_through(mnt / "objects" / "sha256" / spooled_hex, SPOOLED)  # by its digest: spooled
    # a git temporary file, open: its bytes are a file in STORE/scratch
    tmp = mnt / "git" / "sha1" / "ab" / "tmp_obj_private"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        os.write(fd, b"x" * 4096)
        live = modes(store)
    finally:
        os.close(fd)
    os.unlink(tmp)
    assert (mnt / "objects" / "sha256" / spooled_hex).read_bytes() == SPOOLED
    assert d.stop() == 0
    after = modes(store)

    assert loose(live) == {}
    assert loose(after) == {}
    expected = {
        ".": 0o700,
        "store.db": 0o600,
        "store.db-wal": 0o600,
        "store.db-shm": 0o600,
        "alkfs.lock": 0o600,
        "large": 0o700,
        "large/.staging": 0o700,
        "large/sha256": 0o700,
        large_rel(LARGE): 0o400,
        large_rel(SPOOLED): 0o400,
        "spool": 0o700,
        "scratch": 0o700,
    }
    assert {path: live.get(path) for path in expected} == expected
    scratch_files = [p for p in live if p.startswith("scratch/")]
    assert scratch_files and {live[p] for p in scratch_files} == {0o600}


# -- another user ----------------------------------------------------------------------------
PROBE = r"""
import errno, fcntl, json, os, sys

store, large = sys.argv[1], sys.argv[2]


def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]


def lock_shm():  # one byte, shared: what would stall every write of the daemon
    fd = os.open(os.path.join(store, "store.db-shm"), os.O_RDONLY)
    fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, 120)


def lock_store():  # the store lock: what would keep every daemon from starting
    fd = os.open(os.path.join(store, "alkfs.lock"), os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)


def read(name):
    return lambda: open(os.path.join(store, name), "rb").read(1)


print(json.dumps({
    "lock store.db-shm": attempt(lock_shm),
    "lock alkfs.lock": attempt(lock_store),
    "read store.db": attempt(read("store.db")),
    "read store.db-wal": attempt(read("store.db-wal")),
    "read a large object": attempt(read(large)),
    "list the store": attempt(lambda: os.listdir(store)),
}))
"""


def test_another_user_can_neither_lock_nor_read_the_store(base: Path, daemons, other_user):
    store = base / "store"
    d = daemons(store)
    write_through(d.mnt / "pins" / "small-one", SMALL)
    write_through(d.mnt / "pins" / "large-one", LARGE)
    for name in ("store.db", "store.db-wal", "store.db-shm", "alkfs.lock", large_rel(LARGE)):
        assert (store / name).is_file(), name  # (as root): each probe below has a target
    probe = subprocess.run(
        ["runuser", "-u", other_user.pw_name, "--", "/usr/bin/python3", "-c", PROBE, str(store)]
        + [large_rel(LARGE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    eacces = errno.errorcode[errno.EACCES]
    assert json.loads(probe.stdout) == {
        "lock store.db-shm": eacces,
        "lock alkfs.lock": eacces,
        "read store.db": eacces,
        "read store.db-wal": eacces,
        "read a large object": eacces,
        "list the store": eacces,
    }
    # the daemon never noticed: it still writes
    write_through(d.mnt / "pins" / "after-probe", b"still writable\n")
    assert (d.mnt / "pins" / "after-probe").read_bytes() == b"still writable\n"
    assert d.stop() == 0


# -- refused stores ------------------------------------------------------------------------------
def refusals(base: Path, store: Path) -> tuple[subprocess.CompletedProcess, ...]:
    """`alkfs --store STORE status` and `alkfsd STORE MNT`, both expected to refuse."""
    cli = alkfs("--store", store, "status")
    mnt = base / "mnt"
    mnt.mkdir(exist_ok=True)
    argv = alkfsd_argv(store, mnt)
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # it mounted and serves (a failure): stop it by PID
            proc.send_signal(signal.SIGTERM)
            try:
                out, err = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
        finally:
            mounted = is_mounted(mnt)
            if mounted:
                subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)
    assert not mounted
    return cli, subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_store_directory_others_can_write_is_refused(base: Path, mode: int):
    store = base / "store"
    small, _ = inputs(base)
    assert alkfs("--store", store, "put", small).returncode == 0
    store.chmod(mode)
    before = modes(store)
    why = f"the store directory {store} is writable by other users (mode {mode:04o}): refused;"
    why += f" chmod 700 {store}"

    cli, daemon = refusals(base, store)

    assert (cli.returncode, cli.stdout, cli.stderr.decode()) == (1, b"", f"alkfs status: {why}\n")
    assert (daemon.returncode, daemon.stderr) == (
        1,
        f"alkfsd: cannot open the store {store}: {why}\n",
    )
    assert modes(store) == before  # refused before anything was touched


def test_a_store_directory_of_another_user_is_refused(base: Path, other_user):
    store = base / "store"
    small, _ = inputs(base)
    assert alkfs("--store", store, "put", small).returncode == 0
    os.chown(store, other_user.pw_uid, other_user.pw_gid)
    assert stat.S_IMODE(os.stat(store).st_mode) == 0o700
    me = os.geteuid()
    why = (
        f"the store directory {store} belongs to uid {other_user.pw_uid}, not to uid {me}"
        f" that opens it: refused (its owner could change the store); chown {me} {store}"
    )

    cli, daemon = refusals(base, store)

    assert (cli.returncode, cli.stdout, cli.stderr.decode()) == (1, b"", f"alkfs status: {why}\n")
    assert (daemon.returncode, daemon.stderr) == (
        1,
        f"alkfsd: cannot open the store {store}: {why}\n",
    )
    os.chown(store, me, os.getegid())  # the rest of the store is still the test's to remove


# -- an existing loose store ------------------------------------------------------------------
def loosen(root: Path) -> int:
    """What a store made before stores became private (umask 022) looks like: 0755 and 0644."""
    n = 0
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
        n += 1
    return n


def tightened_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "tightened" in line]


def test_a_loose_store_is_tightened_at_open_with_one_log_line(base: Path, daemons):
    store = base / "store"
    small, large = inputs(base)
    assert alkfs("--store", store, "put", small, large).returncode == 0
    count = loosen(store)
    assert count >= 8 and set(modes(store).values()) == {0o755, 0o644}

    first = daemons(store)
    live = modes(store)
    assert first.stop() == 0
    lines = tightened_lines(first.log())
    assert len(lines) == 1, first.log()
    assert lines[0].endswith(
        f" WARNING tightened {count} entries of the store {store} to owner-only access"
        " (group and other permission bits removed)"
    )
    assert loose(live) == {}
    # the owner's bits stay as they were: only group and others lose theirs
    assert (live["."], live["store.db"], live["alkfs.lock"], live[large_rel(LARGE)]) == (
        0o700,
        0o600,
        0o600,
        0o600,
    )

    second = daemons(store)  # tight now: nothing to do, nothing said
    assert second.stop() == 0
    assert tightened_lines(second.log()) == []
    assert loose(modes(store)) == {}

    # the command line tightens too (its log is silent unless ALKFS_DEBUG is set)
    (store / "store.db").chmod(0o644)
    assert alkfs("--store", store, "status").returncode == 0
    assert stat.S_IMODE(os.stat(store / "store.db").st_mode) == 0o600


def test_a_daemon_the_store_lock_refuses_changes_no_mode_of_the_store(base: Path, daemons):
    """A second alkfsd on a held store is refused before it touches anything: a loose
    entry of the holder's stays as the holder left it (the holder's next open tightens)."""
    store = base / "store"
    first = daemons(store)
    write_through(first.mnt / "pins" / "one", SMALL)
    (store / "store.db").chmod(0o644)  # loose, as stores were before they became private
    (base / "mnt2").mkdir()
    second = subprocess.run(
        [*alkfsd_argv(store, base / "mnt2"), "--window", "0"], capture_output=True, timeout=60
    )
    assert second.returncode == 1
    assert b"is held by another process" in second.stderr
    assert tightened_lines(second.stderr.decode()) == []
    assert stat.S_IMODE(os.stat(store / "store.db").st_mode) == 0o644
    assert not is_mounted(base / "mnt2")
    assert first.stop() == 0


def test_derived_packs_leave_nothing_for_the_next_open_to_tighten(base: Path, daemons):
    """git writes a pack set's files 0444 and its directories by the umask: they live
    under STORE/derived, made 0700, so the store stays tight and the next open says
    nothing (before, every restart after a build tightened them again)."""
    src = base / "src"
    env = {**os.environ, "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@b"}
    env |= {"GIT_COMMITTER_NAME": "a", "GIT_COMMITTER_EMAIL": "a@b"}
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    for i in range(3):
        (src / f"f{i}").write_text(f"file {i}\n")
        subprocess.run(["git", "-C", str(src), "add", "."], check=True)
        subprocess.run(["git", "-C", str(src), "commit", "-qm", f"c{i}"], check=True, env=env)
    store = base / "store"
    done = alkfs("--store", store, "git", "import", "--repo", "r", src / ".git", umask=0o022)
    assert done.returncode == 0, done.stderr
    found = modes(store)
    assert (found["derived"], found["derived/sha1"]) == (0o700, 0o700)
    assert any(p.endswith(".pack") for p in found)  # a set was built
    assert {p: m for p, m in loose(found).items() if not p.startswith("derived/")} == {}
    d = daemons(store)
    assert d.stop() == 0
    assert tightened_lines(d.log()) == []
