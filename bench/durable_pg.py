"""A throwaway PostgreSQL server for the store benchmark, with durability on.

tests/pgserver.py's PgServer is for tests: it puts the cluster in /dev/shm (RAM, where
an fsync costs nothing) and turns fsync, full_page_writes and synchronous_commit off.
Benchmark figures against that would flatter PostgreSQL, so this starter keeps the
server defaults for durability (fsync, full_page_writes, synchronous_commit all on) and
puts the cluster on a disk: a temp dir beside the benchmark's work dir. It reuses
PgServer's helpers (finding the binaries, killing a postmaster by its postmaster.pid)
and its watchdog script: if the benchmark dies in any way, the watchdog stops the
server by PID and removes the temp dir. Nothing is ever killed by name.
"""

from __future__ import annotations

import atexit
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import pgserver  # noqa: E402  (find_bindir, _kill_postmaster, the watchdog)

PgNotInstalled = pgserver.PgNotInstalled
SETTINGS = {  # everything else (fsync, synchronous_commit, full_page_writes, ...) is default
    "listen_addresses": "''",
    "max_connections": "100",
}


class DurablePg:
    """initdb'd in a temp dir under `near` (its socket dir), started by `start()`."""

    def __init__(self, near: Path) -> None:
        self.bindir = pgserver.find_bindir()  # PgNotInstalled without binaries
        self.owner = None
        if os.geteuid() == 0:
            try:
                self.owner = pwd.getpwnam("postgres")
            except KeyError:
                raise PgNotInstalled("running as root but there is no `postgres` user") from None
        parent = str(near) if len(str(near)) < 60 else "/tmp"
        self.base = Path(tempfile.mkdtemp(prefix="alkfs-bench-pg-", dir=parent))
        os.chmod(self.base, 0o700)
        if self.owner is not None:
            os.chown(self.base, self.owner.pw_uid, self.owner.pw_gid)
        self.datadir = self.base / "data"
        self.log = self.base / "log"
        self.running = False
        atexit.register(self.cleanup)
        self._watchdog = subprocess.Popen(
            [sys.executable, "-I", pgserver.__file__, str(self.base)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _run(self, tool: str, *args: str | Path) -> None:
        cmd = [str(self.bindir / tool), *map(str, args)]
        if self.owner is not None:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(
            cmd,
            cwd=self.base,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,
        )
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{tool} failed: {(done.stderr or done.stdout).strip()}\n{log}")

    def start(self) -> None:
        self._run("initdb", "-D", self.datadir, "-A", "trust", "-U", "postgres", "-E", "UTF8")
        settings = {**SETTINGS, "unix_socket_directories": f"'{self.base}'", "port": "5432"}
        with open(self.datadir / "postgresql.conf", "a") as conf:
            conf.write("".join(f"{k} = {v}\n" for k, v in settings.items()))
        self._run("pg_ctl", "start", "-w", "-s", "-t", "60", "-D", self.datadir, "-l", self.log)
        self.running = True

    def uri(self, dbname: str = "postgres") -> str:
        host = quote(str(self.base), safe="/")
        return f"postgresql://postgres@/{quote(dbname)}?host={host}&port=5432"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.uri(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
        return self.uri(name)

    def settings(self) -> dict[str, str]:
        import psycopg

        names = ("server_version", "fsync", "synchronous_commit", "full_page_writes")
        names += ("shared_buffers", "wal_sync_method")
        with psycopg.connect(self.uri(), autocommit=True) as conn:
            return {n: conn.execute(f"SHOW {n}").fetchone()[0] for n in names}

    def cleanup(self) -> None:
        atexit.unregister(self.cleanup)
        if self.running:
            try:
                self._run(
                    "pg_ctl", "stop", "-w", "-s", "-t", "60", "-m", "fast", "-D", self.datadir
                )
            except (OSError, RuntimeError, subprocess.SubprocessError):
                pass
            self.running = False
        pgserver._kill_postmaster(self.datadir)  # by its postmaster.pid; a no-op when gone
        shutil.rmtree(self.base, ignore_errors=True)
        if self._watchdog is not None:
            self._watchdog.stdin.close()  # type: ignore[union-attr]
            self._watchdog.wait(timeout=30)
            self._watchdog = None
