"""An admin's first day, as fourteen rows (test_row_N is row N), every row redone with the
INSTALLED binaries: `make install` into a temporary prefix (tests/install_fixture.py, the
session's one install, shared with tests/test_install.py), then `alkfs` and `alkfsd` run as
an admin runs them, bare names found on a PATH that starts with PREFIX/bin, in an
environment without the checkout's PYTHON* or ALKFS_* variables.

Rows 1 and 2 are tests/test_install.py's:
  1. bare `alkfs`/`alkfsd` on PATH after install: test_installed_commands_run_from_the_install;
  2. `mount -t fuse.alkfs STORE MNT` and an fstab line mount, detach, and umount ends the
     daemon: test_mount_t_fuse_alkfs_mounts_detached_and_logs_to_syslog_at_each_lines_priority,
     test_an_fstab_line_mounts_by_its_mountpoint,
     test_the_helper_as_mount_calls_it_mounts_and_umount_ends_the_daemon.
Rows 3 to 14 are here, one test each. Daemons run in the foreground (their stderr to a
file) unless the row is about the detached one; every daemon is ended by PID and every
mount cleared in teardown. The files written into the mount are root's (owner and group
of pins are another change's). Root and /dev/fuse are needed; ALKFS_SKIP_INSTALL_TEST=1
skips the module, as it does tests/test_install.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest
from helpers import git_out, sha
from install_fixture import (
    MARKS,
    Install,
    Mounts,
    alive,
    daemons_of,
    gone_within,
    is_mounted,
    loggers_of,
)

from alkfs import __version__

# the session's one install and `mounts` (shared with tests/test_install.py)
pytest_plugins = ["install_fixture"]

pytestmark = MARKS

MOUNT_WITHIN_S = 30.0
STOP_WITHIN_S = 10.0
TREE = ["git", "lfs", "objects", "pins", "repos", "roots"]
UNPINNED = (
    "alkfs: {key} is not pinned: nothing keeps it, so a sweep deletes it once the window has "
    "passed (alkfs pin NAME KEY, or put --pin NAME)"
)


# -- an admin's shell -----------------------------------------------------------------------


@dataclass
class Shell:
    """Commands as an admin types them: bare names on PATH (PREFIX/bin first)."""

    inst: Install
    env: dict[str, str]

    def __call__(
        self,
        *args: str | os.PathLike[str],
        input: str | None = None,
        cwd: Path | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(a) for a in args],
            input=input,
            cwd=cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def ok(self, *args: str | os.PathLike[str], **kw) -> str:
        """stdout of a command that must succeed with nothing on stderr."""
        done = self(*args, **kw)
        assert (done.returncode, done.stderr) == (0, ""), (args, done.stderr)
        return done.stdout

    def git(self, *args: str | os.PathLike[str], cwd: Path | None = None) -> str:
        """git in the shell's environment (helpers.git_out: GIT_ENV over it)."""
        return git_out(*args, cwd=cwd, environ=self.env, timeout=120)


@pytest.fixture
def sh(installed: Install) -> Shell:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "ALKFS_"))
        and k not in ("NOTIFY_SOCKET", "JOURNAL_STREAM", "VIRTUAL_ENV")
    }
    env["PATH"] = f"{installed.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    shell = Shell(installed, env)
    for name in ("alkfs", "alkfsd"):  # (the install's, not the checkout's venv's)
        assert shutil.which(name, path=env["PATH"]) == str(installed.bin / name)
    return shell


@dataclass
class Daemon:
    """`alkfsd STORE MNT ...` in the foreground, its stderr in a file."""

    proc: subprocess.Popen[bytes]
    store: Path
    mnt: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def path(self, *parts: str) -> Path:
        return self.mnt.joinpath(*parts)

    def stop(self) -> int:
        """SIGTERM (as systemd stops it): the daemon unmounts and exits."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(STOP_WITHIN_S)


@dataclass
class Daemons:
    sh: Shell
    tmp_path: Path
    started: list[Daemon] = field(default_factory=list)

    def start(self, store: Path, mnt: Path, *args: str) -> Daemon:
        log = self.tmp_path / f"alkfsd-{len(self.started)}.log"
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                ["alkfsd", str(store), str(mnt), *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=self.sh.env,
            )
        d = Daemon(proc, store, mnt, log)
        self.started.append(d)
        deadline = time.monotonic() + MOUNT_WITHIN_S
        while not (is_mounted(mnt) and os.stat(mnt).st_dev != os.stat(mnt.parent).st_dev):
            assert proc.poll() is None, f"alkfsd exited with {proc.returncode}:\n{d.log()}"
            assert time.monotonic() < deadline, f"alkfsd did not mount {mnt}:\n{d.log()}"
            time.sleep(0.02)
        return d

    def cleanup(self) -> None:
        for d in self.started:
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
                try:
                    d.proc.wait(15)
                except subprocess.TimeoutExpired:
                    d.proc.kill()
                    d.proc.wait(10)
            for flags in ("-u", "-uz"):
                if is_mounted(d.mnt):
                    subprocess.run(["fusermount3", flags, str(d.mnt)], capture_output=True)


@pytest.fixture
def daemons(sh: Shell, tmp_path: Path) -> Iterator[Daemons]:
    ds = Daemons(sh, tmp_path)
    try:
        yield ds
    finally:
        ds.cleanup()


def new_mnt(tmp_path: Path, name: str = "mnt") -> Path:
    mnt = tmp_path / name
    mnt.mkdir()
    return mnt


def mounted_line(log: str) -> str:
    (line,) = [s for s in log.splitlines() if " INFO mounted " in s]
    return line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the rows ---------------------------------------------------------------------------------


def test_row_3_a_file_as_mountpoint_is_one_line_and_nothing_is_mounted(
    sh: Shell, tmp_path: Path
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a directory\n")
    store = tmp_path / "store"
    for create in ((), ("--create",)):
        done = sh("alkfsd", store, afile, "--window", "1h", *create)
        assert done.returncode == 1, done.stderr
        assert done.stdout == ""
        assert done.stderr.splitlines() == [
            f"alkfsd: the mountpoint {afile} is not a directory (make it with mkdir -p)"
        ]
    assert not is_mounted(afile)
    assert afile.read_text() == "not a directory\n"
    assert not store.exists()


def test_row_4_a_typo_is_refused_without_create_and_create_is_idempotent(
    sh: Shell, daemons: Daemons, tmp_path: Path
) -> None:
    mnt = new_mnt(tmp_path)
    store = tmp_path / "store"
    typo = tmp_path / "stroe"
    done = sh("alkfsd", typo, mnt)  # a typo in STORE
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.splitlines() == [
        f"alkfsd: no store at {typo}: give --create to make one there"
    ]
    assert not typo.exists() and not is_mounted(mnt)
    mtn = tmp_path / "mtn"  # a typo in MNT: refused even with --create
    done = sh("alkfsd", store, mtn, "--create")
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.splitlines() == [
        f"alkfsd: the mountpoint {mtn} does not exist (make it with mkdir -p)"
    ]
    assert not mtn.exists() and not store.exists()
    done = sh("alkfs", "--store", typo, "pins")  # (the command line: the same)
    assert (done.returncode, done.stdout) == (1, "")
    assert len(done.stderr.splitlines()) == 1 and f"no store at {typo}" in done.stderr
    assert not typo.exists()

    d = daemons.start(store, mnt, "--create", "--window", "1h", "--sweep-every", "0")
    (mnt / "pins" / "kept").write_bytes(b"kept across --create\n")
    assert d.stop() == 0
    made = sorted(p.name for p in store.iterdir())
    d = daemons.start(store, mnt, "--create", "--window", "1h", "--sweep-every", "0")
    assert (mnt / "pins" / "kept").read_bytes() == b"kept across --create\n"
    assert sorted(os.listdir(mnt / "pins")) == ["kept"]
    assert d.stop() == 0
    assert sorted(p.name for p in store.iterdir()) == made


def test_row_5_the_start_up_line_says_sweeps_run_every_hour_by_default(
    sh: Shell, daemons: Daemons, tmp_path: Path
) -> None:
    mnt = new_mnt(tmp_path)
    store = tmp_path / "store"
    d = daemons.start(store, mnt, "--create", "--window", "1h")  # (no sweep flag)
    assert re.fullmatch(
        rf"\S+ \S+ alkfsd\[{d.proc.pid}\] INFO mounted {re.escape(str(store))} at "
        rf"{re.escape(str(mnt))} \(database .*, window 1h, a sweep every 1h\)",
        mounted_line(d.log()),
    ), d.log()
    assert f"register it (ln -s /path/to/clone {mnt}/roots/NAME)" in d.log()
    assert d.stop() == 0
    d = daemons.start(store, mnt, "--window", "1h", "--sweep-every", "0")
    assert mounted_line(d.log()).endswith(", window 1h, no periodic sweeps)"), d.log()
    assert "register it" not in d.log()
    assert d.stop() == 0


def test_row_6_put_without_pin_warns_on_stderr(sh: Shell, daemons: Daemons, tmp_path: Path) -> None:
    d = daemons.start(tmp_path / "store", new_mnt(tmp_path), "--create", "--window", "1h")
    f = tmp_path / "backup.tar"
    f.write_bytes(b"a backup put without a pin\n")
    key = f"sha256/{sha(f.read_bytes())}"
    done = sh("alkfs", "--mount", d.mnt, "put", f)
    assert (done.returncode, done.stdout) == (0, f"{key}\n")
    assert done.stderr.splitlines() == [UNPINNED.format(key=key)]
    done = sh("alkfs", "--mount", d.mnt, "put", "--pin", "backup", f)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{key}\n", "")
    assert sh.ok("alkfs", "--mount", d.mnt, "pins") == f"backup {key}\n"


def test_row_7_unpin_sweep_then_expire_now_deletes_the_staged_candidate_now(
    sh: Shell, daemons: Daemons, tmp_path: Path
) -> None:
    d = daemons.start(
        tmp_path / "store", new_mnt(tmp_path), "--create", "--window", "1h", "--sweep-every", "0"
    )
    f = tmp_path / "old.tar"
    f.write_bytes(b"an old backup\n")
    t = ("alkfs", "--mount", d.mnt)
    key = sh.ok(*t, "put", "--pin", "old", f).strip()
    assert sh.ok(*t, "unpin", "old") == f"{key}\n"
    report = json.loads(sh.ok(*t, "sweep"))
    assert (report["candidates_staged"], report["deleted"]) == (1, 0)  # (due in an hour)
    assert d.path("objects", key).read_bytes() == b"an old backup\n"
    report = json.loads(sh.ok(*t, "sweep", "--expire-now"))
    assert (report["taken"], report["deleted"], report["cancelled_by_arbitration"]) == (1, 1, 0)
    assert not d.path("objects", key).exists()
    assert sh.ok(*t, "staged") == ""


def test_row_8_staged_lists_deadline_and_size_unpin_prints_the_key_dry_run_changes_nothing(
    sh: Shell, daemons: Daemons, tmp_path: Path
) -> None:
    d = daemons.start(
        tmp_path / "store", new_mnt(tmp_path), "--create", "--window", "1h", "--sweep-every", "0"
    )
    f = tmp_path / "f"
    f.write_bytes(b"twenty-one bytes ...\n")
    t = ("alkfs", "--mount", d.mnt)
    key = sh.ok(*t, "put", "--pin", "f", f).strip()
    assert key == f"sha256/{sha(f.read_bytes())}"
    assert sh.ok(*t, "unpin", "f") == f"{key}\n"  # (the key it released)
    dry = json.loads(sh.ok(*t, "sweep", "--dry-run"))
    assert (dry["dry_run"], dry["would_stage"], dry["more"]) == (True, 1, 0)
    assert dry["candidates"] == [{"key": key, "size": 21, "why": "no pin names it"}]
    assert sh.ok(*t, "staged") == ""  # (the dry run staged nothing)
    assert json.loads(sh.ok(*t, "status"))["last_sweep"] is None
    assert d.path("objects", key).read_bytes() == f.read_bytes()
    before = time.time()
    assert json.loads(sh.ok(*t, "sweep"))["candidates_staged"] == 1
    (line,) = sh.ok(*t, "staged").splitlines()
    staged_key, size, deadline = line.split()
    assert (staged_key, size) == (key, "21")
    due = datetime.fromisoformat(deadline).timestamp()
    assert before + 3600 - 1 <= due <= time.time() + 3600 + 1


def test_row_9_sigterm_to_the_daemon_unmounts_within_10_s(
    installed: Install, mounts: Mounts, tmp_path: Path
) -> None:
    """The detached daemon of `mount -t fuse.alkfs` (its helper, as mount(8) runs it):
    `kill PID` unmounts, and the daemon and its logger are gone, within 10 s."""
    mnt = mounts.new(tmp_path)
    done = subprocess.run(
        [str(installed.helper), str(tmp_path / "store"), str(mnt), "-o", "create,window=0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (pid,) = daemons_of(installed, mnt)
    logger = loggers_of(pid)
    assert len(logger) == 1
    assert sorted(n for n in os.listdir(mnt) if not n.startswith(".")) == TREE
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    assert gone_within([pid, *logger], STOP_WITHIN_S), "alkfsd still runs 10 s after SIGTERM"
    while is_mounted(mnt):
        assert time.monotonic() - t0 < STOP_WITHIN_S, f"{mnt} still mounted 10 s after SIGTERM"
        time.sleep(0.05)
    assert not alive(pid) and os.listdir(mnt) == []


def small_repo(sh: Shell, path: Path) -> int:
    """A repository of two commits on main, a branch and an annotated tag; its object count."""
    sh.git("init", "-q", "-b", "main", path)
    (path / "a.txt").write_text("one\n")
    sh.git("-C", path, "add", "a.txt")
    sh.git("-C", path, "commit", "-q", "-m", "first")
    (path / "d").mkdir()
    (path / "d" / "b.txt").write_text("two\n")
    sh.git("-C", path, "add", "d")
    sh.git("-C", path, "commit", "-q", "-m", "second")
    sh.git("-C", path, "branch", "side", "HEAD~1")
    sh.git("-C", path, "tag", "-a", "-m", "v1", "v1")
    listing = sh.git("-C", path, "cat-file", "--batch-all-objects", "--batch-check")
    return len(listing.splitlines())


def test_row_10_git_import_ends_with_a_summary_line(
    sh: Shell, daemons: Daemons, tmp_path: Path
) -> None:
    count = small_repo(sh, tmp_path / "src")
    src = tmp_path / "src" / ".git"
    store = tmp_path / "store"
    said = sh.ok("alkfs", "--store", store, "git", "import", src, "--repo", "src")
    assert re.fullmatch(
        rf"imported {re.escape(str(src))} as src: 3 refs, {count} objects \({count} stored, "
        r"0 already present\) in \d+\.\d s\n",
        said,
    ), said
    # through the mount of that store: another repository, the same objects
    d = daemons.start(store, new_mnt(tmp_path), "--window", "1h", "--sweep-every", "0")
    said = sh.ok("alkfs", "--mount", d.mnt, "git", "import", src, "--repo", "again")
    *_, last = said.splitlines()
    assert re.fullmatch(
        rf"imported {re.escape(str(src))} as again: 3 refs pushed through the mount in \d+\.\d s",
        last,
    ), said
    assert sh.ok("alkfs", "--mount", d.mnt, "repo", "list") == "again sha1\nsrc sha1\n"


def test_row_11_git_gc_in_a_borrowing_clone_logs_no_warning_at_log_level_debug(
    sh: Shell, daemons: Daemons, tmp_path: Path
) -> None:
    d = daemons.start(
        tmp_path / "store",
        new_mnt(tmp_path),
        *("--create", "--window", "0", "--sweep-every", "0", "--log-level", "debug"),
    )
    src = tmp_path / "src"
    small_repo(sh, src)
    os.mkdir(d.path("repos", "r"))
    sh.git("-C", src, "push", "-q", d.path("repos", "r"), "main")
    work = tmp_path / "work"
    sh.git("clone", "-q", d.path("repos", "r"), work)
    alternates = (work / ".git" / "objects" / "info" / "alternates").read_text().split()
    assert alternates == [str(d.path("git", "sha1"))]
    d.path(".alkfs", "control").write_text("repack\n")
    (work / "c.txt").write_text("three\n")
    sh.git("-C", work, "add", "c.txt")
    sh.git("-C", work, "commit", "-q", "-m", "third")
    sh.git("-C", work, "gc", "-q", "--prune=now")
    sh.git("-C", work, "fsck", "--full", "--no-dangling")
    assert sh.git("-C", work, "log", "--format=%s") == "third\nsecond\nfirst\n"
    log = d.log()
    assert re.search(r"(?m)^\S+ \S+ alkfsd\[\d+\] DEBUG ", log), log  # (debug is on)
    assert [s for s in log.splitlines() if " WARNING " in s or " ERROR " in s] == []
    assert d.stop() == 0
    assert "WARNING" not in d.log() and "Traceback" not in d.log()


def test_row_12_metrics_listen_serves_the_metrics_over_http_while_the_mount_works(
    sh: Shell, daemons: Daemons, tmp_path: Path
) -> None:
    port = free_port()
    d = daemons.start(
        tmp_path / "store",
        new_mnt(tmp_path),
        *("--create", "--window", "1h", "--sweep-every", "0"),
        *("--metrics-listen", f"127.0.0.1:{port}"),
    )
    assert f"INFO metrics: http://127.0.0.1:{port}/metrics" in d.log()
    data = os.urandom(1000)
    f = tmp_path / "f"
    f.write_bytes(data)
    key = sh.ok("alkfs", "--mount", d.mnt, "put", "--pin", "m", f).strip()
    assert d.path("objects", key).read_bytes() == data
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    assert re.search(r'(?m)^alkfs_objects\{algo="sha256",tier="kv"\} 1\.0$', text), text
    assert re.search(r"(?m)^alkfs_fuse_written_bytes_total 1000\.0$", text), text
    assert re.search(r'(?m)^alkfs_fuse_request_seconds_count\{op="create"\} 1\.0$', text), text
    assert d.stop() == 0
    with socket.socket() as s:  # (the listener went with the daemon)
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_row_13_a_second_rsync_transfers_nothing_and_tar_x_into_pins_works(
    sh: Shell, daemons: Daemons, tmp_path: Path
) -> None:
    d = daemons.start(
        tmp_path / "store", new_mnt(tmp_path), "--create", "--window", "1h", "--sweep-every", "0"
    )
    src = tmp_path / "src"
    files = {
        "a.txt": b"alpha\n",
        "sub/b.txt": b"beta\n" * 100,
        "sub/deeper/c.bin": os.urandom(300_000),  # (a large object)
    }
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    dest = f"{d.path('pins', 'x')}/"
    first = sh.ok("rsync", "-a", "--stats", f"{src}/", dest)
    assert "Number of regular files transferred: 3" in first, first
    second = sh.ok("rsync", "-a", "--stats", f"{src}/", dest)
    assert "Number of regular files transferred: 0" in second, second
    assert "Total transferred file size: 0 bytes" in second, second
    for name, data in files.items():
        assert d.path("pins", "x", name).read_bytes() == data
    tarball = tmp_path / "t.tar"
    sh.ok("tar", "-C", src, "-cf", tarball, "sub")
    sh.ok("tar", "-xf", tarball, "-C", d.path("pins"))
    assert sorted(os.listdir(d.path("pins"))) == ["sub", "x"]
    assert sorted(os.listdir(d.path("pins", "sub"))) == ["b.txt", "deeper"]
    assert d.path("pins", "sub", "b.txt").read_bytes() == files["sub/b.txt"]
    assert d.path("pins", "sub", "deeper", "c.bin").read_bytes() == files["sub/deeper/c.bin"]
    assert "Traceback" not in d.log()


def test_row_14_versions_man_pages_and_completions_are_installed(
    sh: Shell, installed: Install
) -> None:
    for name in ("alkfs", "alkfsd"):
        assert sh.ok(name, "--version") == f"{name} {__version__}\n"
    man = installed.prefix / "share" / "man"
    env = {**sh.env, "MANPAGER": "cat", "PAGER": "cat", "MANWIDTH": "80", "MANOPT": ""}
    for section, name, says in (
        ("1", "alkfs", "the alkfs command line"),
        ("8", "alkfsd", "mount an alkfs store with FUSE"),
    ):
        page = man / f"man{section}" / f"{name}.{section}"
        assert page.is_file()
        done = subprocess.run(
            ["man", "-M", str(man), section, name], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[0] == f"{name.upper()}({section})", done.stdout[:200]
        assert f"{name} - {says}" in done.stdout, done.stdout[:400]
        assert "SYNOPSIS" in done.stdout and __version__ in done.stdout
    completions = installed.prefix / "share" / "bash-completion" / "completions"
    for name in ("alkfs", "alkfsd"):
        done = subprocess.run(
            ["bash", "-c", f"source {completions / name} && complete -p {name}"],
            capture_output=True,
            text=True,
        )
        assert (done.returncode, done.stdout.strip()) == (
            0,
            f"complete -o default -F _{name} {name}",
        ), done.stderr
    script = (
        f"source {completions / 'alkfs'}\n"
        'COMP_WORDS=(alkfs sweep --e); COMP_CWORD=2; _alkfs; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "--expire-now\n"), done.stderr
