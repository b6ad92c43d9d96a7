"""Long work shows progress on a terminal and ends with one summary line; without a
terminal it adds nothing (before: `git import` of a large repository showed a bar, then
42 s of silence and no summary; `verify --mount` showed nothing at all).

The real `alkfs` runs with stdout and stderr on a pseudo-terminal (120 columns: tqdm draws
nothing on a terminal of width 0) or on plain pipes, on a real store and through a real
mount, with a repository of 6,000 objects made by the real git (fast-import).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
from helpers import git, status

ALKFS = str(Path(sys.executable).with_name("alkfs"))
COMMITS = 1500  # each a blob, a tree, a subtree and the commit: 6,000 objects
OBJECTS = 4 * COMMITS
RUN_TIMEOUT_S = 60.0
# an import into a store of one process keeps git's pack; a PostgreSQL store's does not
AS_PACK = os.environ.get("ALKFS_TEST_DATABASE", "") != "postgresql"

# the real-mount fixtures of tests/daemon/conftest.py (not a package: loaded by path, as
# tests/reliability/conftest.py does, under the same name)
_NAME = "alkfs_tests_daemon_conftest"
if _NAME not in sys.modules:
    _spec = importlib.util.spec_from_file_location(
        _NAME, Path(__file__).resolve().parent / "daemon" / "conftest.py"
    )
    assert _spec is not None and _spec.loader is not None
    sys.modules[_NAME] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[_NAME])
start_mount = sys.modules[_NAME].start_mount
populate_fixture = sys.modules[_NAME].populate_fixture


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A bare repository of OBJECTS objects on one branch, made by git fast-import."""
    path = tmp_path_factory.mktemp("progress") / "src.git"
    git("init", "-q", "--bare", path)
    stream = []
    for i in range(COMMITS):
        data = f"file {i}\n".encode() * 3
        stream.append(b"blob\nmark :%d\ndata %d\n%s\n" % (i + 1, len(data), data))
    for i in range(COMMITS):
        msg = f"commit {i}\n".encode()
        stream.append(
            b"commit refs/heads/main\nmark :%d\ncommitter C <c@example.com> %d +0000\n"
            b"data %d\n%s" % (COMMITS + i + 1, 1_700_000_000 + i, len(msg), msg)
        )
        if i:
            stream.append(b"from :%d\n" % (COMMITS + i))
        stream.append(b"M 100644 :%d d%d/f%d.txt\n\n" % (i + 1, i % 30, i))
    git(f"--git-dir={path}", "fast-import", "--quiet", input=b"".join(stream))
    git(f"--git-dir={path}", "symbolic-ref", "HEAD", "refs/heads/main")
    listed = git(f"--git-dir={path}", "cat-file", "--batch-all-objects", "--batch-check")
    assert listed.stdout.count(b"\n") == OBJECTS
    return path


def environment(store_database, args: tuple) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALKFS_")}
    if "--store" in args:
        database = store_database(args[args.index("--store") + 1])
        if database is not None:
            env["ALKFS_DATABASE"] = database
    return env


def on_terminal(store_database, *args) -> tuple[int, str]:
    """`alkfs ARGS` with stdout and stderr on a pseudo-terminal: (exit status, all that
    the terminal was sent)."""
    args = tuple(map(str, args))
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    try:
        proc = subprocess.Popen(
            [ALKFS, *args],
            stdin=subprocess.DEVNULL,
            stdout=slave,
            stderr=slave,
            env=environment(store_database, args),
        )
    finally:
        os.close(slave)
    got = bytearray()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while True:
            assert time.monotonic() < deadline, f"alkfs {args} ran too long:\n{got.decode()}"
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                continue
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer of the terminal has gone
                break
            if not data:
                break
            got += data
        status_ = proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return status_, got.decode(errors="replace")


def piped(store_database, *args) -> subprocess.CompletedProcess:
    """`alkfs ARGS` with plain pipes (no terminal)."""
    args = tuple(map(str, args))
    return subprocess.run(
        [ALKFS, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env=environment(store_database, args),
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


def screen(out: str) -> list[str]:
    """The lines the terminal shows at the end: each line's text after its last carriage
    return (what a bar left behind was overwritten), blank ones left out."""
    lines = (line.rsplit("\r", 1)[-1].rstrip() for line in out.replace("\r\n", "\n").split("\n"))
    return [line for line in lines if line]


def ends_with_summary(out: str, pattern: str) -> str:
    """The terminal's last line matches `pattern` and nothing was sent after it."""
    last = screen(out)[-1]
    assert re.fullmatch(pattern, last), (last, out[-2000:])
    assert out.rstrip("\r\n").endswith(last), out[-2000:]
    return last


def shows(out: str, *labels: str) -> None:
    for label in labels:
        assert label in out, (label, out[-3000:])


IMPORT_SUMMARY = (
    r"imported \S+ as {repo}: 1 refs, 6000 objects \({stored} stored, {present} already "
    r"present\) in \d+\.\d s"
)


def test_on_a_store_each_phase_shows_on_a_terminal_and_one_summary_line_ends_it(
    tmp_path, source, store_database
):
    store = tmp_path / "store"
    t = ("--store", store)
    code, out = on_terminal(store_database, *t, "git", "import", source, "--repo", "r")
    assert code == 0, out
    if AS_PACK:  # (git's pack joins the set: docs/git.md#import)
        first = ("objects: listing [", "objects: git packs and checks them [")
        shows(out, "connectivity check [", *first, "LFS media [", "refs [", "packs: the kv's")
    else:  # (a PostgreSQL store's fleet keeps its git objects in the kv)
        shows(
            out,
            "connectivity check [",
            "objects:   0%|",
            f"/{OBJECTS} [",
            "LFS media [",
            "refs [",
            "LFS pointers [",
            "packs: building the derived packs [",
        )
    ends_with_summary(out, IMPORT_SUMMARY.format(repo="r", stored=OBJECTS, present=0))

    code, out = on_terminal(store_database, *t, "git", "import", source, "--repo", "r2")
    assert code == 0, out
    if AS_PACK:
        shows(out, "connectivity check [", "objects: git packs and checks them [", "packs:")
    else:
        shows(out, "connectivity check [", "objects: looking up what the store holds [", "packs:")
    ends_with_summary(out, IMPORT_SUMMARY.format(repo="r2", stored=0, present=OBJECTS))

    code, out = on_terminal(store_database, *t, "verify")
    assert code == 0, out
    shows(out, "verify:", f"/{OBJECTS} [", '"corrupt": []')
    ends_with_summary(out, r"verify: 6,000 objects verified, 0 corrupt in \d+\.\d s")

    # nothing reaches the objects any more: a sweep stages them, the next deletes them
    for repo in ("r", "r2"):
        assert piped(store_database, *t, "repo", "rm", repo).returncode == 0
    code, out = on_terminal(store_database, *t, "sweep", "--window", "0")
    assert code == 0, out
    shows(
        out,
        "sweep: finding what is live [",
        "sweep: executing, 0 deleted of 0 taken [",
        "sweep: marking, 6,000 objects scanned [",
        "sweep: staging, 6,000 staged [",
        "sweep: finishing [",
    )
    ends_with_summary(
        out,
        r"sweep: 6,000 objects scanned, 0 live, 6,000 staged, 0 deleted \(0 bytes freed\), "
        r"0 kept by arbitration in \d+\.\d s",
    )
    code, out = on_terminal(store_database, *t, "sweep", "--window", "0")
    assert code == 0, out
    shows(out, "sweep: executing, 6,000 deleted of 6,000 taken [", "sweep: marking, 0 objects")
    ends_with_summary(
        out,
        r"sweep: 0 objects scanned, 0 live, 0 staged, 6,000 deleted \([\d,]+ bytes freed\), "
        r"0 kept by arbitration in \d+\.\d s",
    )
    code, out = on_terminal(store_database, *t, "sweep", "--dry-run")
    assert code == 0, out
    shows(out, "sweep --dry-run [")
    ends_with_summary(
        out, r"sweep --dry-run: 0 objects scanned, 0 would be staged \(0 bytes\) in \d+\.\d s"
    )


def test_on_a_store_without_a_terminal_nothing_is_added(tmp_path, source, store_database):
    t = ("--store", tmp_path / "store")
    done = piped(store_database, *t, "git", "import", source, "--repo", "r")
    assert (done.returncode, done.stderr) == (0, b""), done.stderr
    (line,) = done.stdout.decode().splitlines()
    assert re.fullmatch(IMPORT_SUMMARY.format(repo="r", stored=OBJECTS, present=0), line), line
    done = piped(store_database, *t, "git", "import", source, "--repo", "r")
    assert (done.returncode, done.stderr) == (0, b""), done.stderr
    done = piped(store_database, *t, "verify")
    assert (done.returncode, done.stderr) == (0, b""), done.stderr
    assert json.loads(done.stdout) == {"corrupt": []}
    for args in (("sweep",), ("sweep", "--dry-run")):
        done = piped(store_database, *t, *args)
        assert (done.returncode, done.stderr) == (0, b""), done.stderr
        assert json.loads(done.stdout)["scanned"] == OBJECTS


def slow_root(tmp_path: Path, sleep: float) -> tuple[dict[str, str], Path]:
    """A daemon environment whose git sleeps `sleep` s before each `cat-file` in the
    borrower returned (registered as a root, the sweep's liveness reads its objects with
    git cat-file: that phase then lasts as long)."""
    root = tmp_path / "slow-borrower"
    git("init", "-q", "-b", "main", root)
    (root / "f").write_text("a file\n")
    git("-C", root, "add", "f")
    git("-C", root, "commit", "-q", "-m", "one")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "git"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *slow-borrower*cat-file*) sleep {sleep};; esac\n'
        f'exec {shutil.which("git")} "$@"\n'
    )
    wrapper.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}, root


def test_through_a_mount_each_phase_shows_on_a_terminal_and_nothing_without_one(
    start_mount, tmp_path, source, store_database
):
    env, root = slow_root(tmp_path, 1.5)
    m = start_mount(tmp_path / "store", "--window", "0", env=env)
    t = ("--mount", m.mnt)
    code, out = on_terminal(store_database, *t, "git", "import", source, "--repo", "r")
    assert code == 0, out
    shows(
        out,
        "connectivity check [",
        "LFS media [",
        f"Writing objects: 100% ({OBJECTS}/{OBJECTS})",  # (git's own)
        "packs: the mount builds the derived packs [",
    )
    ends_with_summary(out, r"imported \S+ as r: 1 refs pushed through the mount in \d+\.\d s")

    code, out = on_terminal(store_database, *t, "verify")
    assert code == 0, out
    shows(out, "verify [", '"corrupt": []')
    ends_with_summary(out, r"verify: 6,000 objects verified, 0 corrupt in \d+\.\d s")

    # a sweep whose liveness phase lasts 1.5 s (a registered borrower read slowly): the
    # command shows the phase the daemon's status reports while the sweep runs
    os.symlink(root, m.path("roots", "slow"))
    code, out = on_terminal(store_database, *t, "sweep")
    assert code == 0, out
    shows(out, "sweep [", "sweep: finding what is live [")
    summary = ends_with_summary(
        out,
        r"sweep: 6,\d{3} objects scanned, 6,\d{3} live, 0 staged, 0 deleted \(0 bytes freed\), "
        r"0 kept by arbitration in \d+\.\d s",
    )
    report = status(m)["last_sweep"]
    assert f"{report['scanned']:,} objects scanned" in summary
    assert status(m)["sweep_progress"] is None and status(m)["verifying"] is None

    # without a terminal: the output alone, nothing on stderr
    done = piped(store_database, *t, "git", "import", source, "--repo", "r2")
    assert (done.returncode, done.stderr) == (0, b""), done.stderr
    assert done.stdout.decode().startswith("imported ")
    assert done.stdout.count(b"\n") == 1
    done = piped(store_database, *t, "verify")
    assert (done.returncode, done.stderr) == (0, b""), done.stderr
    assert json.loads(done.stdout) == {"corrupt": []}
    os.unlink(m.path("roots", "slow"))
    done = piped(store_database, *t, "sweep")
    assert (done.returncode, done.stderr) == (0, b""), done.stderr
    assert json.loads(done.stdout)["aborted"] is None
    assert not m.tracebacks()


def test_the_mount_status_shows_a_running_verify_and_sweep(start_mount, tmp_path, populate):
    """`verifying` ({done, total}) while a verify runs, `sweep_progress` (the phase and its
    figures) while a sweep runs; null otherwise."""
    store = tmp_path / "store"
    populate(store, [os.urandom(1 << 20) * 24 + bytes([i]) for i in range(8)])  # 192 MiB
    env, root = slow_root(tmp_path, 1.0)
    m = start_mount(store, "--window", "0", env=env)
    idle = status(m)
    assert (idle["verifying"], idle["sweep_progress"]) == (None, None)

    def seen_while(command: str, key: str) -> list:
        seen: list = []
        writer = threading.Thread(
            target=m.path(".alkfs", "control").write_text, args=(f"{command}\n",), daemon=True
        )
        writer.start()
        while writer.is_alive():
            value = status(m)[key]
            if value is not None:
                seen.append(value)
        writer.join()
        return seen

    seen = seen_while("verify", "verifying")
    assert seen, "no verify figure while it ran"
    assert all(0 <= v["done"] <= v["total"] and v["total"] >= 8 for v in seen), seen

    os.symlink(root, m.path("roots", "slow"))
    seen = seen_while("sweep", "sweep_progress")
    assert seen and seen[0]["phase"] == "live", seen
    assert set(seen[0]) == {"phase", "scanned", "staged", "taken", "deleted"}
    after = status(m)
    assert (after["verifying"], after["sweep_progress"]) == (None, None)
    assert after["last_sweep"]["scanned"] == 8
    assert not m.tracebacks()
