"""Directory opens answered inside pyfuse3 (third_party/pyfuse3-cacheddirs.patch,
daemon/listings.py), through a real mount: once an open found the kernel's cached
listing of a fan-out directory current, the next opens of it never reach the daemon's
Python (`status.listings.opened_here` stays put), yet every change the kernel cannot see
for itself — an object stored through another path, a set published, an object a
sweep deletes — is listed at the next open. (A user the mount keeps out is still
refused: tests/security/test_shared_mount.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from alkfsd import listings
from helpers import GIT_ENV, sweep

from alkfs.app import Alkfs
from alkfs.git.importer import import_repo

pytestmark = pytest.mark.skipif(
    not listings.CACHED_DIRS, reason="pyfuse3 without pyfuse3-cacheddirs.patch"
)
NO_INTAKE = {"ALKFS_PACK_EVERY": "86400", "ALKFS_PACK_OBJECTS": "1000000"}


def git(*args, input: bytes | None = None) -> str:
    done = subprocess.run(
        ["git", *map(str, args)],
        env={**os.environ, **GIT_ENV},
        capture_output=True,
        input=input,
        timeout=120,
    )
    assert done.returncode == 0, (args, done.stderr.decode(errors="replace"))
    return done.stdout.decode()


def status(mnt: Path) -> dict:
    return json.loads((mnt / ".alkfs" / "status").read_bytes())


def opened_here(mnt: Path) -> int:
    return status(mnt)["listings"]["opened_here"]


def git_object(content: bytes) -> tuple[bytes, str]:
    """A blob as git stores it (header and content) and its id."""
    raw = b"blob %d\0" % len(content) + content
    return raw, git("hash-object", "--stdin", input=content).strip()


def blob_with_prefix(prefix: str, tag: str) -> tuple[bytes, bytes, str]:
    """(content, raw git object, id) of a blob whose id starts with `prefix`."""
    for n in range(100_000):
        content = f"cached dirs {tag} {n}\n".encode()
        raw = b"blob %d\0" % len(content) + content

        oid = hashlib.sha1(raw).hexdigest()
        if oid.startswith(prefix):
            return content, raw, oid
    raise AssertionError("no such blob")


def imported_store(tmp_path: Path) -> Path:
    src = tmp_path / "src.git"
    git("init", "-q", "--bare", "-b", "main", src)
    data = "".join(f"line {k}\n" for k in range(20))
    stream = (
        "commit refs/heads/main\ncommitter C <c@example.com> 1700000000 +0000\n"
        f"data 2\nc\nM 100644 inline f.txt\ndata {len(data)}\n{data}\n"
    )
    git(f"--git-dir={src}", "fast-import", "--quiet", input=stream.encode())
    store = tmp_path / "store"
    with Alkfs.open(store, window_s=0) as app:
        import_repo(app, str(src), "r", progress=False)
    return store


def test_repeated_opens_of_a_fanout_directory_never_reach_python(start_mount, tmp_path):
    m = start_mount(imported_store(tmp_path), "--window", "0", env=NO_INTAKE)
    fans = [m.mnt / "git" / "sha1" / f"{i:02x}" for i in range(16)]
    repo_fans = [m.mnt / "repos" / "r" / "objects" / f"{i:02x}" for i in range(16)]
    for d in fans + repo_fans:  # everything is packed: nothing listed loose
        assert os.listdir(d) == []
    before = opened_here(m.mnt)
    for _ in range(5):
        for d in fans + repo_fans:
            assert os.listdir(d) == []
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            os.close(fd)
    st = status(m.mnt)["listings"]
    assert st["in_c"] is True
    assert st["answered_in_c"] >= 32
    assert st["opened_here"] == before  # 320 opens, none decided in Python


def test_a_repositorys_fanout_directories_are_opened_and_listed_without_python(
    start_mount, tmp_path
):
    """/repos/<id>/objects/<xx> lists nothing, always: from the first open after the mount
    started, each of the 256 is opened, read and closed inside pyfuse3."""
    m = start_mount(imported_store(tmp_path), "--window", "0", env=NO_INTAKE)
    before = status(m.mnt)["listings"]
    for i in range(256):
        assert os.listdir(m.mnt / "repos" / "r" / "objects" / f"{i:02x}") == []
    after = status(m.mnt)["listings"]
    assert after["opened_here"] == before["opened_here"]
    assert after["read_here"] == before["read_here"]
    assert after["answered_in_c"] >= 256
    blob = git(f"--git-dir={m.mnt / 'repos' / 'r'}", "rev-parse", "main:f.txt").strip()
    assert (m.mnt / "repos" / "r" / "objects" / blob[:2] / blob[2:]).is_file()  # resolves


def test_an_object_stored_through_objects_is_listed_at_the_next_open(start_mount, tmp_path):
    """`cp` into /objects/git-sha1 stores a git object the kernel never sees arrive in
    /git/sha1/<xx>: its cached empty listing must not be kept."""
    m = start_mount(imported_store(tmp_path), "--window", "0", env=NO_INTAKE)
    content, raw, oid = blob_with_prefix("5e", "objects")
    fan = m.mnt / "git" / "sha1" / "5e"
    assert os.listdir(fan) == [] and os.listdir(fan) == []
    held = os.open(fan, os.O_RDONLY | os.O_DIRECTORY)  # opened in C, held across the put
    (m.mnt / "objects" / "git-sha1" / "incoming").write_bytes(raw)
    assert (m.mnt / "objects" / "git-sha1" / oid).read_bytes() == raw
    assert os.listdir(fan) == [oid[2:]]
    assert os.listdir(fan) == [oid[2:]]
    assert os.listdir(held) == [oid[2:]]  # (a READDIR of the handle opened in C)
    os.close(held)
    st = status(m.mnt)["listings"]
    assert st["answered_in_c"] >= 1


def test_a_published_set_and_a_sweep_are_listed_at_the_next_open(start_mount, tmp_path):
    m = start_mount(imported_store(tmp_path), "--window", "0", env=NO_INTAKE)
    content, raw, oid = blob_with_prefix("a7", "publish")
    fan = m.mnt / "git" / "sha1" / "a7"
    (m.mnt / "pins" / "keep").write_bytes(b"unrelated\n")
    (m.mnt / "objects" / "git-sha1" / "x").write_bytes(raw)
    assert os.listdir(fan) == [oid[2:]] and os.listdir(fan) == [oid[2:]]
    before = opened_here(m.mnt)
    assert os.listdir(fan) == [oid[2:]]
    assert opened_here(m.mnt) == before  # answered in C

    (m.mnt / ".alkfs" / "control").write_text("repack\n")  # published in the daemon
    assert os.listdir(fan) == []  # packed now: not the cached listing
    assert os.listdir(fan) == []

    # unreferenced and unpinned: two sweeps (window 0) stage it, then delete it; the
    # set published without it lists it nowhere
    sweep(m)
    sweep(m)
    assert not (m.mnt / "objects" / "git-sha1" / oid).exists()
    assert os.listdir(fan) == []
    (m.mnt / "objects" / "git-sha1" / "y").write_bytes(raw)  # stored again: loose
    assert os.listdir(fan) == [oid[2:]]
