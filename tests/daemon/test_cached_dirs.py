"""Directory opens answered inside pyfuse3 (third_party/pyfuse3-cacheddirs.patch,
daemon/listings.py), through a real mount: once an open found the kernel's cached
listing of a fan-out directory current, the next opens of it never reach the daemon's
Python (`status.listings.opened_here` stays put), yet every change the kernel cannot see
for itself — an object stored through another path, a set published, an object a
sweep deletes — is listed at the next open. (A user the mount keeps out is still
refused: tests/security/test_shared_mount.py.)"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import helpers
from helpers import git, git_out, sweep

from alkfs.app import Alkfs
from alkfs.git.importer import import_repo

NO_INTAKE = {"ALKFS_PACK_EVERY": "86400", "ALKFS_PACK_OBJECTS": "1000000"}


def opened_here(m) -> int:
    return helpers.status(m)["listings"]["opened_here"]


def blob_with_prefix(prefix: str, tag: str) -> tuple[bytes, str]:
    """(raw git object, id) of a blob whose id starts with `prefix`."""
    for n in range(100_000):
        content = f"cached dirs {tag} {n}\n".encode()
        raw = b"blob %d\0" % len(content) + content
        oid = hashlib.sha1(raw).hexdigest()
        if oid.startswith(prefix):
            return raw, oid
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
    before = opened_here(m)
    for _ in range(5):
        for d in fans + repo_fans:
            assert os.listdir(d) == []
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            os.close(fd)
    st = helpers.status(m)["listings"]
    assert st["in_c"] is True
    assert st["answered_in_c"] >= 32
    assert st["opened_here"] == before  # 320 opens, none decided in Python


def test_a_repositorys_fanout_directories_are_opened_and_listed_without_python(
    start_mount, tmp_path
):
    """/repos/<id>/objects/<xx> lists nothing, always: from the first open after the mount
    started, each of the 256 is opened, read and closed inside pyfuse3."""
    m = start_mount(imported_store(tmp_path), "--window", "0", env=NO_INTAKE)
    before = helpers.status(m)["listings"]
    for i in range(256):
        assert os.listdir(m.mnt / "repos" / "r" / "objects" / f"{i:02x}") == []
    after = helpers.status(m)["listings"]
    assert after["opened_here"] == before["opened_here"]
    assert after["read_here"] == before["read_here"]
    assert after["answered_in_c"] >= 256
    blob = git_out(f"--git-dir={m.mnt / 'repos' / 'r'}", "rev-parse", "main:f.txt").strip()
    assert (m.mnt / "repos" / "r" / "objects" / blob[:2] / blob[2:]).is_file()  # resolves


def test_an_object_stored_through_objects_is_listed_at_the_next_open(start_mount, tmp_path):
    """`cp` into /objects/git-sha1 stores a git object the kernel never sees arrive in
    /git/sha1/<xx>: its cached empty listing must not be kept."""
    m = start_mount(imported_store(tmp_path), "--window", "0", env=NO_INTAKE)
    raw, oid = blob_with_prefix("5e", "objects")
    fan = m.mnt / "git" / "sha1" / "5e"
    assert os.listdir(fan) == [] and os.listdir(fan) == []
    held = os.open(fan, os.O_RDONLY | os.O_DIRECTORY)  # opened in C, held across the put
    (m.mnt / "objects" / "git-sha1" / "incoming").write_bytes(raw)
    assert (m.mnt / "objects" / "git-sha1" / oid).read_bytes() == raw
    assert os.listdir(fan) == [oid[2:]]
    assert os.listdir(fan) == [oid[2:]]
    assert os.listdir(held) == [oid[2:]]  # (a READDIR of the handle opened in C)
    os.close(held)
    st = helpers.status(m)["listings"]
    assert st["answered_in_c"] >= 1


def test_a_published_set_and_a_sweep_are_listed_at_the_next_open(start_mount, tmp_path):
    m = start_mount(imported_store(tmp_path), "--window", "0", env=NO_INTAKE)
    raw, oid = blob_with_prefix("a7", "publish")
    fan = m.mnt / "git" / "sha1" / "a7"
    (m.mnt / "objects" / "git-sha1" / "x").write_bytes(raw)
    assert os.listdir(fan) == [oid[2:]] and os.listdir(fan) == [oid[2:]]
    before = opened_here(m)
    assert os.listdir(fan) == [oid[2:]]
    assert opened_here(m) == before  # answered in C

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


def drop_dentries() -> None:
    """Have the kernel forget every unused dentry and inode (it sends FORGETs)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("2\n")


def test_fanout_lookups_answered_in_c_are_counted_and_given_back_when_forgotten(
    start_mount, tmp_path
):
    """A repository's 256 `objects/<xx>` are looked up in C once `objects/` is known; when
    the kernel forgets `objects/` they go (their lookups counted back into the daemon's
    inode table, which drops them only once the kernel forgot them too), and after any
    number of such rounds every object still resolves through them."""
    m = start_mount(imported_store(tmp_path), "--window", "0", env=NO_INTAKE)
    repo = m.mnt / "repos" / "r"
    blob = git_out(f"--git-dir={repo}", "rev-parse", "main:f.txt").strip()
    want = "".join(f"line {k}\n" for k in range(20)).encode()
    git_fans = 256  # /git/sha1's, held for the mount's life
    for _ in range(3):
        for i in range(256):
            assert os.listdir(repo / "objects" / f"{i:02x}") == []
        assert helpers.status(m)["listings"]["entries_in_c"] == git_fans + 256
        assert git_out(f"--git-dir={repo}", "cat-file", "blob", blob).encode() == want
        assert (repo / "objects" / blob[:2] / blob[2:]).stat().st_size > 0
        deadline = time.monotonic() + 30
        while helpers.status(m)["listings"]["entries_in_c"] != git_fans:
            assert time.monotonic() < deadline, "the kernel never forgot objects/"
            drop_dentries()
            time.sleep(0.1)
    assert m.tracebacks() == []


def test_right_after_the_mount_every_empty_fanout_is_answered_in_c(start_mount, tmp_path):
    """The published set is opened and the 256 fan-out listings of /git/sha1 found before
    the mount is made (daemon/packs.py, prepare): git's first process after a mount has
    every LOOKUP, OPENDIR, READDIR and RELEASEDIR of an empty fan-out directory answered
    in C, none in the daemon's Python."""
    m = start_mount(imported_store(tmp_path), "--window", "0", env=NO_INTAKE)
    for i in range(256):
        assert os.listdir(m.mnt / "git" / "sha1" / f"{i:02x}") == []
    st = helpers.status(m)["listings"]
    assert st["opened_here"] == 0
    assert st["read_here"] == 0
    assert st["looked_up_here"] == 0  # (/git/sha1's 256 names: looked up in C)
    assert st["entries_in_c"] >= 256
