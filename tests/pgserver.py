"""A throwaway PostgreSQL server for the tests: its own cluster (initdb) in a temp dir (in
/dev/shm when it has room), reached only over a unix socket in that dir, trust auth for the
superuser `postgres`, test-only speed settings (fsync, full_page_writes, synchronous_commit
off) and max_connections=200.

    server = PgServer()
    server.start()                   # initdb on the first start
    uri = server.create_database()   # postgresql://postgres@/test_1?host=/dev/shm/alkfs-pg-…
    server.stop_now(); server.start_again()    # the server goes away and comes back: same URI
    server.cleanup()                 # stop it and remove the temp dir

Nothing outlives the test process. cleanup() is registered with atexit, and a watchdog
process (this file run as a script) holds a pipe from the test process: when the pipe closes
(the test process ended in any way, SIGKILL and os._exit included) it stops the server by the
PID in postmaster.pid and removes the temp dir. Nothing is ever killed by process name.

Run as root, initdb and pg_ctl run as the `postgres` user (initdb refuses root).
"""

from __future__ import annotations

import atexit
import glob
import itertools
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

TOOLS = ("initdb", "pg_ctl", "postgres")
SETTINGS = {  # appended to postgresql.conf; unix_socket_directories and port are added per server
    "listen_addresses": "''",
    "fsync": "off",
    "full_page_writes": "off",
    "synchronous_commit": "off",
    "max_connections": "200",
}


class PgNotInstalled(RuntimeError):
    """No PostgreSQL server binaries, or no `postgres` user to run them as root."""


def find_bindir() -> Path:
    """The folder holding initdb, pg_ctl and postgres: `pg_config --bindir`, else the newest
    /usr/lib/postgresql/*/bin, else the folder of `initdb` on PATH. PgNotInstalled if none."""
    candidates: list[Path] = []
    if pg_config := shutil.which("pg_config"):
        done = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=30)
        if done.returncode == 0 and done.stdout.strip():
            candidates.append(Path(done.stdout.strip()))
    versioned = glob.glob("/usr/lib/postgresql/*/bin")
    versioned.sort(key=lambda p: [int(x) for x in Path(p).parent.name.split(".") if x.isdigit()])
    candidates += [Path(p) for p in reversed(versioned)]
    if initdb := shutil.which("initdb"):
        candidates.append(Path(initdb).resolve().parent)
    for bindir in candidates:
        if all(os.access(bindir / tool, os.X_OK) for tool in TOOLS):
            return bindir
    raise PgNotInstalled(
        "no PostgreSQL server binaries (initdb, pg_ctl, postgres) in `pg_config --bindir`, "
        "/usr/lib/postgresql/*/bin or PATH; install the Debian package `postgresql` (`make apt`)"
    )


def require_bindir() -> Path:
    """find_bindir() for a test: without PostgreSQL the test is skipped, but under CI (the CI
    environment variable set, e.g. CI=true) that is an error, never a silent skip."""
    try:
        return find_bindir()
    except PgNotInstalled as e:
        if os.environ.get("CI", "").strip().lower() in ("", "0", "false", "no"):
            import pytest

            pytest.skip(str(e))
        raise PgNotInstalled(f"{e} (CI is set: PostgreSQL tests must run, not skip)") from None


class PgServer:
    """One throwaway PostgreSQL server. `base` is its temp dir: the socket dir, with the
    cluster in base/data and the server log in base/log."""

    def __init__(self, bindir: Path | None = None, port: int = 5432) -> None:
        self.bindir = bindir or require_bindir()
        self.port = port
        self.base: Path | None = None
        self.running = False
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._names = itertools.count(1)

    @property
    def socket_dir(self) -> Path:
        """The temp dir, which is the unix socket dir (libpq's host=)."""
        assert self.base is not None, "the server was never started"
        return self.base

    @property
    def datadir(self) -> Path:
        return self.socket_dir / "data"

    @property
    def log(self) -> Path:
        return self.socket_dir / "log"

    def start(self) -> None:
        """Start the server, making the cluster on the first call; returns once it accepts
        connections. Does nothing if it runs."""
        if self.running:
            return
        if self.base is None:
            self._make_cluster()
        self._pg("pg_ctl", "start", "-w", "-s", "-t", "60", "-D", self.datadir, "-l", self.log)
        self.running = True

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (pg_ctl -m fast: cut the clients, checkpoint, exit); the cluster stays
        for start(). Does nothing if it is stopped."""
        if not self.running:
            return
        self._pg("pg_ctl", "stop", "-w", "-s", "-t", "60", "-m", mode, "-D", self.datadir)
        self.running = False

    def restart(self) -> None:
        """stop() then start(): same socket, port, URIs and data."""
        self.stop()
        self.start()

    def stop_now(self, mode: str = "fast") -> None:
        """Mid-test: the server goes away (open connections break, new ones are refused) until
        start_again(). mode="immediate" is a crash (no checkpoint, recovery on start_again);
        with synchronous_commit=off its last fraction of a second of commits may be lost,
        unless the committing session did SET synchronous_commit = on."""
        self.stop(mode)

    def start_again(self) -> None:
        """Mid-test: bring the server back after stop_now(), on the same socket and data."""
        self.start()

    def uri(self, dbname: str = "postgres") -> str:
        """The URI of database `dbname` over the unix socket, as superuser `postgres`."""
        host = quote(str(self.socket_dir), safe="/")
        return f"postgresql://postgres@/{quote(dbname)}?host={host}&port={self.port}"

    def create_database(self, name: str | None = None) -> str:
        """Create an empty database (a fresh name test_<n> unless given); its URI."""
        from psycopg import sql

        name = name or f"test_{next(self._names)}"
        self._admin(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))
        return self.uri(name)

    def drop_database(self, name: str) -> None:
        """Drop database `name` if it exists, cutting its connections (WITH (FORCE))."""
        from psycopg import sql

        self._admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def terminate(self, dbname: str) -> int:
        """Kill every other backend connected to `dbname` (pg_terminate_backend, waiting up to
        5 s for each to exit) so that its client's next query fails; how many were killed."""
        row = self._admin(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname,),
        )
        return int(row[0])

    def cleanup(self) -> None:
        """Stop the server (killing it by its postmaster.pid if pg_ctl fails) and remove the
        temp dir. Registered with atexit; safe to call twice."""
        atexit.unregister(self.cleanup)
        if self.base is None:
            return
        for pidfile in self.base.glob("bouncer-*/pgbouncer.pid"):
            _kill_pidfile(pidfile, b"pgbouncer")
        try:
            self.stop()
        except (OSError, RuntimeError, subprocess.SubprocessError):
            pass
        self.running = False
        _kill_postmaster(self.datadir)  # a server pg_ctl lost track of; a no-op when none
        shutil.rmtree(self.base, ignore_errors=True)
        self.base = None
        if self._watchdog is not None:
            self._watchdog.stdin.close()  # type: ignore[union-attr]
            self._watchdog.wait(timeout=30)
            self._watchdog = None

    def _make_cluster(self) -> None:
        """The temp dir (owned by postgres when root), its watchdog, initdb, the settings."""
        owner = None
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                raise PgNotInstalled("running as root but there is no `postgres` user") from None
        self.base = Path(tempfile.mkdtemp(prefix="alkfs-pg-", dir=_tempdir()))
        os.chmod(self.base, 0o700)
        if owner is not None:
            os.chown(self.base, owner.pw_uid, owner.pw_gid)
        atexit.register(self.cleanup)
        self._watchdog = subprocess.Popen(
            [sys.executable, "-I", __file__, str(self.base)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C of the test run does not reach it
        )
        self._pg("initdb", "-D", self.datadir, "-A", "trust", "-U", "postgres", "-E", "UTF8")
        settings = {**SETTINGS, "unix_socket_directories": f"'{self.base}'", "port": self.port}
        with open(self.datadir / "postgresql.conf", "a") as conf:
            conf.write("".join(f"{k} = {v}\n" for k, v in settings.items()))

    def _pg(self, tool: str, *args: str | Path) -> None:
        """Run a PostgreSQL tool (as `postgres` when root) that must succeed."""
        cmd = [str(self.bindir / tool), *map(str, args)]
        if tool == "initdb":
            cmd += ["--locale=C", "--no-sync", "--no-instructions"]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(
            cmd,
            cwd=self.base,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,  # the postmaster pg_ctl starts: no terminal signals
        )
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(
                f"{tool} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}"
                + (f"\nserver log ({self.log}), last lines:\n{log}" if log else "")
            )

    def _admin(self, query: Any, params: tuple[Any, ...] | None = None) -> Any:
        """Run one statement in database `postgres` with autocommit; its first row, if any."""
        import psycopg

        with psycopg.connect(self.uri("postgres"), autocommit=True, connect_timeout=10) as conn:
            cur = conn.execute(query, params)
            return cur.fetchone() if cur.description else None


class PgBouncer:
    """A PgBouncer in front of `server` (its own dir under the server's temp dir, a unix socket
    only, trust auth), in `mode` ("transaction", "session"): uri(dbname) reaches the server's
    database through it. Started by start(), stopped by stop() (by the PID in its pidfile);
    the server's watchdog stops it too (the test process ended in any way). Run as `postgres`
    when root (PgBouncer refuses root). PgNotInstalled when there is no pgbouncer."""

    def __init__(self, server: PgServer, mode: str, port: int = 6432) -> None:
        self.binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not os.access(self.binary, os.X_OK):
            raise PgNotInstalled("no pgbouncer (Debian's `pgbouncer` package; make apt)")
        self.server = server
        self.mode = mode
        self.port = port
        self.dir = Path(tempfile.mkdtemp(prefix=f"bouncer-{mode}-", dir=server.socket_dir))

    def uri(self, dbname: str) -> str:
        host = quote(str(self.dir), safe="/")
        return f"postgresql://postgres@/{quote(dbname)}?host={host}&port={self.port}"

    def start(self) -> None:
        (self.dir / "users.txt").write_text('"postgres" ""\n')
        (self.dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={self.server.socket_dir} port={self.server.port}\n"
            "[pgbouncer]\n"
            "listen_addr =\n"
            f"listen_port = {self.port}\n"
            f"unix_socket_dir = {self.dir}\n"
            "auth_type = trust\n"
            f"auth_file = {self.dir / 'users.txt'}\n"
            f"pool_mode = {self.mode}\n"
            "max_client_conn = 200\n"
            "default_pool_size = 40\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n"
            f"pidfile = {self.dir / 'pgbouncer.pid'}\n"
        )
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            for f in (self.dir, *self.dir.iterdir()):
                os.chown(f, owner.pw_uid, owner.pw_gid)
        cmd = [self.binary, "-d", "-q", str(self.dir / "pgbouncer.ini")]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, timeout=60)
        deadline = time.monotonic() + 30
        while not (self.dir / f".s.PGSQL.{self.port}").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"pgbouncer did not start: {self.dir / 'pgbouncer.log'}")
            time.sleep(0.05)

    def stop(self) -> None:
        _kill_pidfile(self.dir / "pgbouncer.pid", b"pgbouncer")


def _kill_pidfile(pidfile: Path, name: bytes, timeout: float = 10.0) -> None:
    """SIGTERM the process whose PID `pidfile` holds if its command line names `name` (a
    reused PID is not mistaken for it), waiting for it to exit; SIGKILL after `timeout`."""
    try:
        pid = int(pidfile.read_text().split()[0])
        if name not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while Path(f"/proc/{pid}").exists():
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.05)
    except (OSError, ValueError, IndexError):
        pass


def _tempdir() -> str:
    """Where the temp dir goes: /dev/shm if it has 1 GiB free (RAM: on a disk-backed /tmp,
    CREATE DATABASE measured ~10x slower, fsync off or not), else the usual temp dir, or /tmp
    if that path is long (a unix socket path has at most 107 bytes)."""
    try:
        shm = os.statvfs("/dev/shm")
        if shm.f_bavail * shm.f_frsize >= 1 << 30 and os.access("/dev/shm", os.W_OK | os.X_OK):
            return "/dev/shm"
    except OSError:
        pass
    return tempfile.gettempdir() if len(tempfile.gettempdir()) < 60 else "/tmp"


def _postmaster_pid(datadir: Path) -> int | None:
    """The PID in datadir/postmaster.pid, if that process lives and is the postmaster of
    datadir (its command line names datadir: a reused PID is not mistaken for it)."""
    try:
        pid = int((datadir / "postmaster.pid").read_text().split("\n", 1)[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if str(datadir).encode() in cmdline else None


def _kill_postmaster(datadir: Path, timeout: float = 10.0) -> None:
    """Immediate shutdown (SIGQUIT) of the postmaster of datadir by its postmaster.pid, waiting
    for it to exit; SIGKILL if it has not within `timeout`."""
    pid = _postmaster_pid(datadir)
    if pid is None:
        return
    deadline = time.monotonic() + timeout
    try:
        os.kill(pid, signal.SIGQUIT)
        while _postmaster_pid(datadir) == pid:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.05)
    except ProcessLookupError:
        pass


def _watch(base: Path) -> None:
    """The watchdog: block until the test process closes its end of our stdin (cleanup() did,
    or the process ended), then make sure the server is gone and remove the temp dir."""
    sys.stdin.buffer.read()
    for pidfile in base.glob("bouncer-*/pgbouncer.pid"):
        _kill_pidfile(pidfile, b"pgbouncer")
    _kill_postmaster(base / "data")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    _watch(Path(sys.argv[1]))
