"""The two push pins test_write_git.py leaves out, on real mounts with `--window 0`: the
grace period (`alkfsd --push-grace`), counted from the writer's exit, after which the
objects a writer stored through /repos/<id>/objects go although no ref write of it ever
committed (a live writer keeps them however long it takes), and the pin a push
takes on an object it finds already stored and only touches (unpack-objects freshening
it through the alternate), held until the push's ref commits.

Timing is never asserted: the grace's end is observed through the daemon's own log line,
waited for with a bounded poll.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from helpers import GIT_ENV, git, git_out, sweep

from alkfs.git.objects import canonical, object_id

GRACE = "3s"
GRACE_S = 3.0
WAIT_S = 60.0  # bound of every poll here
RELEASED = "after the grace period"

# A writer that stays alive: stores one loose object through a repository's objects/
# the way git does (temporary file, link to its name, unlink), says so, then waits for
# its stdin to close.
WRITER = """
import os, sys, zlib
fan, name, data = sys.argv[1], sys.argv[2], sys.argv[3].encode()
tmp = os.path.join(fan, "tmp_obj_alive1")
fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o444)
os.write(fd, zlib.compress(b"blob %d\\0" % len(data) + data))
os.close(fd)
os.link(tmp, os.path.join(fan, name))
os.unlink(tmp)
print("stored", flush=True)
sys.stdin.read()
"""


def loose(mount, oid: str) -> Path:
    return mount.path("git", "sha1", oid[:2], oid[2:])


def store_unpinned(mount, path: Path) -> str:
    """`git hash-object -w` into the git view (an alternates user's write): stored,
    pinned by nothing (the window, 0 here, is all that protects it)."""
    plain = path.parent / "plain.git"
    if not plain.exists():
        git("init", "-q", "--bare", plain)
    view = str(mount.path("git", "sha1"))
    return git_out(
        f"--git-dir={plain}", "hash-object", "-w", path, env={"GIT_OBJECT_DIRECTORY": view}
    ).strip()


def wait_for(what, why: str, *procs: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT_S
    while not what():
        for p in procs:
            assert p.poll() is None, f"{p.args!r} exited with {p.returncode} before {why}"
        assert time.monotonic() < deadline, f"no {why} after {WAIT_S}s"
        time.sleep(0.05)


def test_pins_without_a_ref_write_go_after_the_push_grace_counted_from_the_writers_exit(
    start_mount, tmp_path
):
    mount = start_mount(None, "--window", "0", "--push-grace", GRACE)
    os.mkdir(mount.path("repos", "g"))
    gitdir = mount.path("repos", "g")
    (tmp_path / "by-git").write_bytes(b"written by git hash-object, which exits\n")
    (tmp_path / "free").write_bytes(b"written through the git view: not pinned\n")
    alive_data = "written by a process that stays alive\n"
    alive = object_id("blob", alive_data.encode())

    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, gitdir / "objects" / alive[:2], alive[2:], alive_data],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "stored\n"
        by_git = git_out(f"--git-dir={gitdir}", "hash-object", "-w", tmp_path / "by-git").strip()
        free = store_unpinned(mount, tmp_path / "free")
        sweep(mount)
        sweep(mount)  # window 0: staged by the first, deleted by the second unless kept
        kept = [loose(mount, oid).exists() for oid in (alive, by_git)]
        if RELEASED in mount.log():  # only on a machine too slow to sweep twice in 3s
            pytest.skip("the grace period passed before the two sweeps were done")
        assert kept == [True, True]
        assert not loose(mount, free).exists()

        # No ref write ever commits in g. git hash-object has exited: its session goes
        # after the grace. The writer is still there: its pins stay however long it lives.
        wait_for(lambda: RELEASED in mount.log(), "release of git's session", writer)
        time.sleep(3 * GRACE_S)  # several expiry rounds past the grace (not a timing assert)
        assert mount.log().count(RELEASED) == 1
        sweep(mount)
        sweep(mount)
        assert not loose(mount, by_git).exists()
        assert loose(mount, alive).exists()  # a live writer's object outlives the grace
        assert writer.poll() is None
        # once the writer exits, the grace counts from there and its pins go
        assert writer.stdin is not None
        writer.stdin.close()
        writer.wait(timeout=10)
        wait_for(lambda: mount.log().count(RELEASED) >= 2, "release of the writer's session")
        assert "releasing 1 pin(s) of repository g after the grace period" in mount.log()
        sweep(mount)
        sweep(mount)
        assert not loose(mount, alive).exists()
    finally:
        if writer.stdin is not None and not writer.stdin.closed:
            writer.stdin.close()
        try:
            writer.wait(timeout=10)
        except subprocess.TimeoutExpired:
            writer.kill()
            writer.wait(timeout=10)
        if writer.stdout is not None:
            writer.stdout.close()
    assert mount.tracebacks() == []
    assert "Warning" not in mount.all_logs()


def test_an_object_a_push_only_touches_is_held_until_its_ref_commits(mount, tmp_path):
    """The push sends a blob the store already has (unpinned): unpack-objects finds it
    through the quarantine's alternate and only freshens it (utime of
    /repos/<id>/objects/xx/<hex>). A pre-receive hook holds the push after that, before
    its ref is written, while two sweeps run."""
    shared = b"an object the store already has\n"
    (tmp_path / "shared").write_bytes(shared)
    (tmp_path / "control").write_bytes(b"stored the same way, touched by no push\n")
    blob = store_unpinned(mount, tmp_path / "shared")
    control = store_unpinned(mount, tmp_path / "control")
    assert blob == object_id("blob", shared)

    work = tmp_path / "work"
    git("init", "-q", "-b", "main", work)
    (work / "file").write_bytes(shared)
    git("-C", work, "add", "file")
    git("-C", work, "commit", "-q", "-m", "one commit, one tree, the shared blob")

    hooks = tmp_path / "hooks"
    hooks.mkdir()
    ready, go = tmp_path / "ready", tmp_path / "go"
    hook = hooks / "pre-receive"
    hook.write_text(
        "#!/bin/sh\n"
        f": > '{ready}'\n"
        "i=0\n"
        f"while [ ! -e '{go}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done\n"
        f"[ -e '{go}' ]\n"
    )
    hook.chmod(0o755)
    os.mkdir(mount.path("repos", "t"))
    target = mount.path("repos", "t")
    push = subprocess.Popen(
        [
            "git",
            "-C",
            str(work),
            "push",
            "-q",
            f"--receive-pack=git -c core.hooksPath={hooks} receive-pack",
            str(target),
            "main",
        ],
        env={**os.environ, **GIT_ENV},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(ready.exists, "pre-receive hook", push)
        # the push unpacked (3 objects: unpack-objects, not a pack) and waits in its
        # hook: the blob is in its quarantine only as a touch of the stored one
        sweep(mount)
        sweep(mount)
        assert loose(mount, blob).exists()
        assert not loose(mount, control).exists()
        go.touch()
        out, err = push.communicate(timeout=120)
        assert push.returncode == 0, err.decode(errors="replace")
    finally:
        go.touch()
        if push.poll() is None:
            push.kill()
            push.communicate(timeout=10)

    # the ref committed: the pin went, and the ref keeps the blob now
    sweep(mount)
    sweep(mount)
    assert loose(mount, blob).exists()
    tip = git_out("-C", work, "rev-parse", "main").strip()
    assert (target / "refs" / "heads" / "main").read_text() == f"{tip}\n"
    git(f"--git-dir={target}", "fsck", "--full", "--no-dangling")
    assert zlib.decompress(loose(mount, blob).read_bytes()) == canonical("blob", shared)
    assert mount.tracebacks() == []
    assert "Warning" not in mount.all_logs()
