"""Real mounts for the daemon tests: alkfsd runs as a subprocess, is waited for with a
bounded poll of /proc/self/mounts, and is ALWAYS unmounted and killed (by PID) in teardown.

(tests/daemon is not a package — `daemon` is the daemon's source folder — so everything
here is reached through fixtures, not imports.)

Use:
    def test_x(mount):                        # a fresh store, `--window 0`
        data = (mount.mnt / "objects").iterdir()

    def test_y(start_mount, populate, tmp_path):   # your own store and flags
        store = tmp_path / "store"
        keys = populate(store, [b"hello", (b"x" * 200_000, Algorithm.SHA256)])
        m = start_mount(store, "--window", "0", "--kv-only")
        m.restart()                            # SIGTERM, wait, start again (same flags)
        m.restart(kill=True)                   # SIGKILL: leaves a dead mount to clear
        m.stop()                               # -> exit code

    def test_z(pg_mount):                     # a fresh store kept in PostgreSQL (pg_uri)
        pg_mount.database                      # its URI (`--database` is in its args)

    def test_w(start_pg_mount, pg_server):    # your own store and flags, on PostgreSQL
        m = start_pg_mount(store, "--window", "0")   # database=pg_uri unless given

Under ALKFS_TEST_DATABASE=postgresql (tests/conftest.py) every daemon that start_mount starts
without its own `--database` is given `store_database(STORE)`: one fresh PostgreSQL database
per STORE directory, shared by all mounts and restarts of it in the test, and `populate`
fills it there too. A test opening a store through the library itself passes
`database=store_database(store)` (None normally: the sqlite file).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from alkfs.keys import Algorithm, Key
from alkfsd.main import mounted_at

MOUNT_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 20.0
DEFAULT_ARGS = ("--window", "0")
NO_SWEEPS = ("--sweep-every", "0")  # (sweeps run every hour by default: a test runs its own)


def mount_entry(mnt: str | os.PathLike[str]) -> tuple[str, str] | None:
    """(source, fstype) of the topmost mount at `mnt`, or None (the daemon's own reader
    of /proc/self/mounts, which it uses to refuse a live mountpoint)."""
    return mounted_at(os.path.abspath(mnt))


def is_mounted(mnt: str | os.PathLike[str]) -> bool:
    entry = mount_entry(mnt)
    return entry is not None and entry[1].startswith("fuse")


def unmount(mnt: str | os.PathLike[str]) -> None:
    """fusermount3 -u, then -uz for a busy or dead mount; quiet when nothing is mounted."""
    if not is_mounted(mnt):
        return
    subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, check=False)
    if is_mounted(mnt):
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True, check=False)


def populate(
    store: str | os.PathLike[str],
    items: Iterable[bytes | tuple[bytes, Algorithm]] = (),
    *,
    pins: dict[str, int] | None = None,
    threshold: int | None = None,
    kv_only: bool = False,
    database: str | None = None,
) -> list[Key]:
    """Fill a store (created if needed) through the library, before mounting it.

    `items` are bytes (sha256) or (bytes, Algorithm); `pins` maps a pin name to the
    index of the item it pins. Returns the keys in the order given.
    """
    from alkfs.app import Alkfs

    mode = "kv-only" if kv_only else None
    with Alkfs.open(store, mode=mode, threshold=threshold, database=database) as app:
        keys = []
        for item in items:
            data, algo = (item, Algorithm.SHA256) if isinstance(item, bytes) else item
            keys.append(app.store.add(data, algo=algo))
        for name, index in (pins or {}).items():
            app.pins.pin(name, keys[index])
    return keys


@dataclass
class Mount:
    """One alkfsd process serving `store_path` at `mnt`."""

    store_path: Path
    mnt: Path
    args: tuple[str, ...]
    log_dir: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] | None = None  # extra environment for the daemon
    db: str | None = None  # `--database` given after `args` (kept across restarts with new args)
    starts: int = 0
    logs: list[Path] = field(default_factory=list)

    @property
    def database(self) -> str | None:
        """The `--database` URI the daemon was started with, if any."""
        args = list(self.full_args())
        for i, arg in enumerate(args):
            if arg == "--database" and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith("--database="):
                return arg.split("=", 1)[1]
        return None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def full_args(self) -> tuple[str, ...]:
        """`args`, and `--database db` when `db` is set and `args` name no database."""
        given = any(a == "--database" or a.startswith("--database=") for a in self.args)
        return self.args if self.db is None or given else (*self.args, "--database", self.db)

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-X",
            "dev",
            "-bb",
            "-m",
            "alkfsd.main",
            str(self.store_path),
            str(self.mnt),
            "--create",  # (the tests make their stores; a daemon refuses a missing one)
            *(() if any(a.startswith("--sweep-every") for a in self.args) else NO_SWEEPS),
            *self.full_args(),
        ]

    def start(self) -> Mount:
        self.starts += 1
        log = self.log_dir / f"alkfsd-{self.mnt.name}-{self.starts}.log"
        self.logs.append(log)
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=None if self.env is None else {**os.environ, **self.env},
            )
        self.wait_mounted()
        return self

    def wait_mounted(self) -> None:
        """Bounded poll: the mount entry is there, answers statvfs and is a mount point (a
        dead mount left by a killed daemon is also listed, but answers ENOTCONN (ECONNABORTED once aborted) until it
        is replaced)."""
        assert self.proc is not None
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"alkfsd exited with {self.proc.returncode}:\n{self.log()}")
            if is_mounted(self.mnt):
                try:
                    os.statvfs(self.mnt)
                    # a mount point, not the bare directory a cleared dead mount leaves
                    # for a moment before the new daemon mounts (its entry may still be
                    # listed when /proc/self/mounts is read)
                    if os.stat(self.mnt).st_dev != os.stat(self.mnt.parent).st_dev:
                        return
                except OSError as exc:
                    if exc.errno not in (errno.ENOTCONN, errno.ECONNABORTED):
                        raise
            if time.monotonic() > deadline:
                raise RuntimeError(f"alkfsd did not mount {self.mnt}:\n{self.log()}")
            time.sleep(0.02)

    # the module's helpers, reachable from tests through the fixture
    is_mounted = staticmethod(is_mounted)
    mount_entry = staticmethod(mount_entry)
    unmount = staticmethod(unmount)

    def mounted(self) -> bool:
        return is_mounted(self.mnt)

    def entry(self) -> tuple[str, str] | None:
        return mount_entry(self.mnt)

    def log(self) -> str:
        """stderr of the current (last started) process."""
        return self.logs[-1].read_text(errors="replace") if self.logs else ""

    def all_logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.logs)

    def tracebacks(self) -> list[str]:
        """Log lines of unexpected errors (any process of this mount)."""
        return [
            line
            for line in self.all_logs().splitlines()
            if "Traceback" in line or "unexpected error" in line
        ]

    def path(self, *parts: str) -> Path:
        return self.mnt.joinpath(*parts)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Signal the daemon and wait for it; returns its exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"alkfsd did not exit after {sig!r}:\n{self.log()}") from None

    def restart(self, *args: str, kill: bool = False) -> Mount:
        """Stop (SIGTERM, or SIGKILL with kill=True) and start again at the same mountpoint;
        new `args` replace the old ones when given."""
        self.stop(signal.SIGKILL if kill else signal.SIGTERM)
        if args:
            self.args = tuple(args)
        return self.start()

    def cleanup(self) -> None:
        """Teardown: end the process by PID and leave no mount behind, whatever happened."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
        finally:
            unmount(self.mnt)


def _fuse_usable() -> bool:
    return os.geteuid() == 0 and os.path.exists("/dev/fuse")


@pytest.fixture
def start_mount(tmp_path: Path, store_database) -> Iterator:
    """A factory: start_mount(store=None, *args, mnt=None, env=None) -> Mount, started and
    mounted (always cleaned up). Without args the daemon gets `--window 0`; under
    ALKFS_TEST_DATABASE=postgresql also `--database store_database(store)` unless args name
    a database."""
    if not _fuse_usable():
        pytest.skip("real mounts need root and /dev/fuse")
    mounts: list[Mount] = []
    counter = iter(range(1, 1000))

    def start(store: str | os.PathLike[str] | None = None, *args: str, mnt=None, env=None) -> Mount:
        n = next(counter)
        store_path = Path(store) if store is not None else tmp_path / f"store{n}"
        mnt_path = Path(mnt) if mnt is not None else tmp_path / f"mnt{n}"
        mnt_path.mkdir(parents=True, exist_ok=True)
        m = Mount(
            store_path,
            mnt_path,
            tuple(args) if args else DEFAULT_ARGS,
            tmp_path,
            env=env,
            db=store_database(store_path),
        )
        mounts.append(m)
        return m.start()

    try:
        yield start
    finally:
        for m in mounts:
            m.cleanup()


@pytest.fixture(name="populate")
def populate_fixture(store_database):
    """`populate(store, items, pins=, threshold=, kv_only=) -> [Key]` (see `populate`), into
    `store_database(store)` unless a database is given."""

    def fill(store, items=(), **kw) -> list[Key]:
        kw.setdefault("database", store_database(store))
        return populate(store, items, **kw)

    return fill


@pytest.fixture
def mount(start_mount) -> Mount:
    """A daemon on a fresh store in tmp_path with `--window 0`."""
    return start_mount()


@pytest.fixture
def start_pg_mount(pg_uri: str, start_mount):
    """start_mount for a store kept in PostgreSQL: start_pg_mount(store=None, *args, mnt=None,
    env=None, database=None) -> Mount, the daemon given `--database` (this test's fresh
    database `pg_uri` unless `database` is given) after `args` (`--window 0` without args).
    The URI is also `start_pg_mount.uri`. (pg_uri is set up before start_mount, so the
    daemons are stopped before their database is dropped.)"""

    def start(
        store: str | os.PathLike[str] | None = None,
        *args: str,
        mnt=None,
        env=None,
        database: str | None = None,
    ) -> Mount:
        uri = database if database is not None else pg_uri
        return start_mount(store, *(args or DEFAULT_ARGS), "--database", uri, mnt=mnt, env=env)

    start.uri = pg_uri  # type: ignore[attr-defined]
    return start


@pytest.fixture
def pg_mount(start_pg_mount) -> Mount:
    """A daemon on a fresh store kept in this test's fresh PostgreSQL database, `--window 0`."""
    return start_pg_mount()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if {"mount", "start_mount", "pg_mount", "start_pg_mount"} & set(
            getattr(item, "fixturenames", ())
        ):
            item.add_marker(pytest.mark.mount)
