"""Shared pieces of the crash matrix (tests/reliability/test_crash_matrix.py).

A *client* is a real process (sys.executable, its own session) that runs a list of
operations one by one (a command line, or an open/write/close of one file) and appends
the index of each operation to a log file once it has succeeded (the command exited 0,
the close returned 0); it stops at the first failure. The test kills the daemon at a
point chosen by `random.Random(seed)`, so after the crash exactly ops[:done] are known
to have succeeded and only ops[done] may have been in flight.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from helpers import GIT_ENV
from helpers import git_out as git  # (stdout str; test_crash_matrix.py imports it from here)

SOAK = os.environ.get("ALKFS_SOAK") == "1"


def iterations(default: int = 5, soak: int = 50) -> int:
    """Iterations per case: `default` for make test, `soak` with ALKFS_SOAK=1."""
    return soak if SOAK else default


def seeded(case: str, i: int) -> random.Random:
    """The fixed seed of iteration `i` of `case` (a str seed hashes the same every run)."""
    return random.Random(f"crash-matrix:{case}:{i}")


CLIENT = r"""
import json, os, subprocess, sys
ops = json.load(open(sys.argv[1]))
log = open(sys.argv[2], "a")
env = {**os.environ, **json.loads(sys.argv[3])}
for i, op in enumerate(ops):
    kind = op[0]
    try:
        if kind == "run":
            done = subprocess.run(op[1], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, env=env, cwd=op[2] if len(op) > 2 else None)
            if done.returncode != 0:
                sys.stderr.write(f"op {i} {op[1]!r}: exit {done.returncode}: "
                                 f"{done.stderr.decode(errors='replace')[-500:]}\n")
                sys.exit(1)
        elif kind == "write":
            with open(op[1], "rb") as f:
                data = f.read()
            fd = os.open(op[2], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view[: 1 << 20]):]
            finally:
                os.close(fd)
        else:
            raise ValueError(kind)
    except OSError as exc:
        sys.stderr.write(f"op {i} {op!r}: {exc}\n")
        sys.exit(1)
    log.write(f"{i}\n")
    log.flush()
"""


class Client:
    """One run of `ops` (see the module docstring); always reaped by PID."""

    def __init__(self, work: Path, ops: list, env: dict[str, str] | None = None) -> None:
        self.ops = ops
        self.mid_op: bool | None = None
        work.mkdir(parents=True, exist_ok=True)
        self.ops_path = work / "ops.json"
        self.log_path = work / "done.log"
        self.err_path = work / "client.err"
        self.ops_path.write_text(json.dumps(ops))
        self.log_path.write_text("")
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    CLIENT,
                    str(self.ops_path),
                    str(self.log_path),
                    json.dumps({**GIT_ENV, **(env or {})}),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )

    def done(self) -> int:
        """How many ops have succeeded (the log holds 0, 1, ... done-1, in order)."""
        lines = self.log_path.read_text().split("\n")
        complete = [int(x) for x in lines[:-1]]  # the last piece may be a partial line
        assert complete == list(range(len(complete))), complete
        return len(complete)

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float = 60.0) -> int:
        """Wait for the client (its ops fail once the daemon is gone); then end its whole
        session (its cp, git, ...) by its process group id."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if rc is None:
            rc = self.proc.wait(timeout=10)
        return rc

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")


def wait_until(pred, timeout: float) -> bool:
    """Poll `pred` (1 ms steps) until true or `timeout`: True if it became true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.001)
    return pred()


def kill_now(m, client: Client) -> None:
    """SIGKILL the daemon; remember whether the client was still at work (a crash mid-op,
    not after the last one), for the round's summary line."""
    client.mid_op = client.running()
    m.stop(signal.SIGKILL)


def kill_at_op(m, client: Client, op: int, delay: float) -> None:
    """SIGKILL the daemon `delay` seconds after op `op` has started (once ops[:op] are
    logged), or when the client ends."""
    wait_until(lambda: not client.running() or client.done() >= op, 120)
    wait_until(lambda: not client.running(), delay)
    kill_now(m, client)


def kill_after(m, client: Client, delay: float) -> None:
    """SIGKILL the daemon `delay` seconds after the client started (or when it ends)."""
    wait_until(lambda: not client.running(), delay)
    kill_now(m, client)


def integrity_check(store: Path) -> None:
    """PRAGMA integrity_check of STORE/store.db opened read-only (no daemon holds it)."""
    con = sqlite3.connect(f"file:{store / 'store.db'}?mode=ro", uri=True)
    try:
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        con.close()


def assert_no_residue(store: Path) -> None:
    """No staging, spool or scratch file left (the daemon clears them when it starts)."""
    for rel in ("large/.staging", "spool", "scratch"):
        d = store / rel
        left = sorted(os.listdir(d)) if d.exists() else []
        assert left == [], (rel, left)


def control(m, command: str) -> None:
    """One command through MNT/.alkfs/control (the write returns when it has run)."""
    with open(m.path(".alkfs", "control"), "w") as f:
        f.write(command + "\n")


def status(m) -> dict:
    return json.loads(m.path(".alkfs", "status").read_text())


def verify_through_mount(m) -> None:
    control(m, "verify")
    assert status(m)["corrupt"] == []


def alkfs_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "alkfs.cli", *args], capture_output=True, text=True, timeout=300
    )


def assert_cli_refused_while_mounted(m) -> None:
    """`alkfs --store STORE` is refused while the daemon holds the store (exit 1, one line
    naming the lock)."""
    done = alkfs_cli("--store", str(m.store_path), "verify")
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "alkfs.lock" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def offline_checks(m, cli: bool = True) -> None:
    """Stop the daemon cleanly, then: `alkfs --store STORE verify` exits 0 with nothing
    corrupt (unless `cli` is false), store.db passes integrity_check, no residue. The
    daemon stays stopped."""
    assert m.stop() == 0, m.log()
    if cli:
        done = alkfs_cli("--store", str(m.store_path), "verify")
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert json.loads(done.stdout) == {"corrupt": []}
    integrity_check(m.store_path)
    assert_no_residue(m.store_path)


def start(m) -> None:
    """Start the daemon and wait until *it* answers at the mountpoint.

    (Mount.wait_mounted can return early after a crash: it may read the dead mount in
    /proc/self/mounts just before the new daemon clears it, then statvfs the bare
    directory. So wait until .alkfs/status names the new daemon's pid.)"""
    m.start()

    def answers() -> bool:
        try:
            return status(m)["mount"]["pid"] == m.proc.pid
        except (OSError, ValueError, KeyError):
            return False

    assert wait_until(answers, 30), m.log()


def crash_restart(m, client: Client) -> int:
    """After the daemon was SIGKILLed: reap the client, check the crash image (sqlite
    integrity), start the daemon again (same store, same mountpoint), check that no
    residue is left and that every object verifies. Returns how many ops succeeded."""
    assert m.proc.poll() is not None
    client.wait()
    done = client.done()
    # (shown with -s: where the kills landed)
    print(f"crash: {done}/{len(client.ops)} ops done, killed mid-op: {client.mid_op}")
    integrity_check(m.store_path)
    start(m)
    assert_no_residue(m.store_path)
    verify_through_mount(m)
    return done


def make_commits(work: Path, rng: random.Random, count: int, tag: str) -> list[str]:
    """`count` new commits on the local repository `work` (made if needed): each adds a
    few files, or past git's unpackLimit (100 objects) so that its push is a pack."""
    if not (work / ".git").exists():
        work.mkdir(parents=True, exist_ok=True)
        git("init", "-q", "-b", "main", cwd=work)
    out = []
    for c in range(count):
        files = rng.choice([2, 3, 5, 130])
        d = work / f"{tag}-{c}"
        d.mkdir()
        for f in range(files):
            (d / f"f{f}.txt").write_bytes(f"{tag} {c} {f} {rng.random()}\n".encode() * 3)
        git("add", "-A", cwd=work)
        git("commit", "-q", "-m", f"{tag} {c}", cwd=work)
        out.append(git("rev-parse", "HEAD", cwd=work).strip())
    return out


def objects_of(git_dir: Path | None, rev: str, cwd: Path | None = None) -> list[str]:
    """`git rev-list --objects REV` (sorted lines) in a repository."""
    args = ["rev-list", "--objects", rev]
    if git_dir is not None:
        args = ["--git-dir", str(git_dir), *args]
    return sorted(git(*args, cwd=cwd).splitlines())


def check_derived_image(store: Path) -> None:
    """The crash image's published derived set (if any) is whole: CURRENT names a
    generation whose every idx verifies against its pack (git verify-pack)."""
    root = store / "derived" / "sha1"
    if not (root / "CURRENT").exists():
        return
    number = int((root / "CURRENT").read_text())
    if number == 0:
        return
    gen = root / f"gen-{number}"
    assert gen.is_dir(), sorted(os.listdir(root))
    idxs = sorted(gen.rglob("*.idx"))
    assert idxs, sorted(p.name for p in gen.rglob("*"))
    for idx in idxs:
        git("verify-pack", str(idx))
