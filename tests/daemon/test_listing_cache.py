"""Listings the kernel caches (daemon/listings.py) through a real mount: a fan-out
directory of /git/<format> and /git/<format>/pack are listed again after every change that
matters, whoever made it — a loose object git writes, an intake pack that takes it in, a
sweep that deletes it, a directory handle that was open across the change — and never as
a listing cached before. /repos/<id>/objects/<xx> lists nothing throughout.

The decisions themselves (which open may keep the kernel's cached listing, which may fill
it) are checked on `Listings` directly, with a stand-in node."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pyfuse3
from helpers import git, git_out, sweep

from alkfs.app import Alkfs
from alkfs.git.importer import import_repo
from alkfsd.listings import Listings

WAIT_S = 60.0  # bound of the polls below (never a timing assertion)
NO_INTAKE = {"ALKFS_PACK_EVERY": "86400", "ALKFS_PACK_OBJECTS": "1000000"}
FAST_INTAKE = {"ALKFS_PACK_EVERY": "0", "ALKFS_PACK_POLL": "0.2"}


def imported_store(tmp_path: Path) -> Path:
    """A store holding a small packed history (the import publishes a derived set)."""
    src = tmp_path / "src.git"
    git("init", "-q", "--bare", "-b", "main", src)
    out = []
    for i in range(6):
        data = "".join(f"line {k}, version {i}\n" for k in range(30))
        out.append(
            f"commit refs/heads/main\ncommitter C <c@example.com> {1700000000 + i} +0000\n"
            f"data 3\nc{i}\nM 100644 inline f{i % 2}.txt\ndata {len(data)}\n{data}\n"
        )
    git(f"--git-dir={src}", "fast-import", "--quiet", input="".join(out).encode())
    store = tmp_path / "store"
    with Alkfs.open(store, window_s=0) as app:
        import_repo(app, str(src), "r", progress=False)
    return store


def put_loose(mnt: Path, content: bytes) -> str:
    """git writes one loose object into /git/sha1 itself."""
    return git_out(
        "hash-object",
        "-w",
        "--stdin",
        env={"GIT_OBJECT_DIRECTORY": f"{mnt}/git/sha1", "GIT_DIR": str(mnt / "repos" / "r")},
        input=content,
    ).strip()


def fresh_blob(mnt: Path, tag: str) -> tuple[bytes, str]:
    """Content whose id is not stored yet, and that id (computed outside the mount)."""
    content = f"listing cache {tag} {time.time_ns()}\n".encode()
    oid = git_out("hash-object", "--stdin", input=content).strip()
    return content, oid


def ls(path: Path) -> list[str]:
    return sorted(os.listdir(path))


def pack_ids(mnt: Path) -> set[str]:
    """Every id in the indexes `pack/` lists now (read through the mount)."""
    out: set[str] = set()
    pack = mnt / "git" / "sha1" / "pack"
    for name in ls(pack):
        if name.endswith(".idx"):
            with open(pack / name, "rb") as f:
                text = subprocess.run(
                    ["git", "show-index"], stdin=f, capture_output=True, check=True
                ).stdout.decode()
            out.update(line.split()[1] for line in text.splitlines())
    return out


def wait_for(what: str, condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def test_a_fanout_lists_a_new_loose_object_at_once_and_drops_it_once_packed(start_mount, tmp_path):
    m = start_mount(imported_store(tmp_path), "--window", "1h", env=FAST_INTAKE)
    content, oid = fresh_blob(m.mnt, "intake")
    fan = m.mnt / "git" / "sha1" / oid[:2]
    repo_fan = m.mnt / "repos" / "r" / "objects" / oid[:2]
    assert ls(fan) == [] and ls(fan) == []  # everything is packed; listed twice: cached
    assert ls(repo_fan) == [] and ls(repo_fan) == []
    packs_before = ls(m.mnt / "git" / "sha1" / "pack")
    assert ls(m.mnt / "git" / "sha1" / "pack") == packs_before

    assert put_loose(m.mnt, content) == oid
    assert ls(fan) == [oid[2:]]  # not the cached empty listing
    assert ls(fan) == [oid[2:]]
    assert ls(repo_fan) == []

    wait_for("the intake pack", lambda: oid in pack_ids(m.mnt))
    assert ls(fan) == []  # the set that holds it is published: it is no longer loose
    assert ls(repo_fan) == []
    packs_after = ls(m.mnt / "git" / "sha1" / "pack")
    assert packs_after != packs_before
    assert ls(m.mnt / "git" / "sha1" / "pack") == packs_after
    assert (fan / oid[2:]).stat().st_size > 0  # (still resolved by name)


def test_a_fanout_listing_follows_objects_stored_and_swept(start_mount, tmp_path):
    m = start_mount(imported_store(tmp_path), "--window", "0", env=NO_INTAKE)
    content, oid = fresh_blob(m.mnt, "sweep")
    fan = m.mnt / "git" / "sha1" / oid[:2]
    assert ls(fan) == [] and ls(fan) == []
    assert put_loose(m.mnt, content) == oid
    assert ls(fan) == [oid[2:]] and ls(fan) == [oid[2:]]
    assert sweep(m)["candidates_staged"] == 1  # unreferenced, unpinned: staged, then
    assert ls(fan) == [oid[2:]]
    assert sweep(m)["deleted"] == 1  # deleted (window 0)
    assert ls(fan) == []
    assert not (fan / oid[2:]).exists()


def test_a_cached_empty_listing_shows_an_object_stored_through_another_directory(
    start_mount, tmp_path
):
    """The kernel sees no change in /git/sha1/<xx> (the object is written through
    /repos/r/objects, another directory) and its cached empty listing has no pages to
    drop: only the daemon's check at open lists it."""
    m = start_mount(imported_store(tmp_path), "--window", "1h", env=NO_INTAKE)
    content, oid = fresh_blob(m.mnt, "elsewhere")
    fan = m.mnt / "git" / "sha1" / oid[:2]
    assert ls(fan) == [] and ls(fan) == []
    got = git_out(
        "hash-object",
        "-w",
        "--stdin",
        env={"GIT_DIR": str(m.mnt / "repos" / "r")},
        input=content,
    ).strip()
    assert got == oid
    assert ls(m.mnt / "repos" / "r" / "objects" / oid[:2]) == []
    assert ls(fan) == [oid[2:]]
    assert ls(fan) == [oid[2:]]


def test_a_handle_open_across_a_change_never_brings_the_old_listing_back(start_mount, tmp_path):
    m = start_mount(imported_store(tmp_path), "--window", "1h", env=NO_INTAKE)
    content, oid = fresh_blob(m.mnt, "open")
    fan = m.mnt / "git" / "sha1" / oid[:2]
    assert ls(fan) == []
    with os.scandir(fan) as old:  # opened (its listing taken) before the object arrives
        assert put_loose(m.mnt, content) == oid
        assert ls(fan) == [oid[2:]]
        assert sorted(e.name for e in old) in ([], [oid[2:]])  # may fill the kernel's cache
        assert ls(fan) == [oid[2:]]
    assert ls(fan) == [oid[2:]]
    assert ls(fan) == [oid[2:]]


# -- the decisions, on Listings itself ------------------------------------------------------
class FakeDir:
    """A node whose listing is whatever `names` holds now."""

    caches_listing = True
    is_dir = True

    def __init__(self) -> None:
        self.names: list[bytes] = []

    async def readdir(self, dh, start, emit) -> None:
        for i, name in enumerate(self.names):
            if not emit(name, FakeFile(), i + 3):
                return


class FakeFile:
    is_dir = False


class FakeInvalidator:
    def __init__(self, taken: bool = True) -> None:
        self.inodes: list[int] = []
        self.taken = taken

    def submit_inode(self, ino: int) -> int:
        self.inodes.append(ino)
        return len(self.inodes)

    async def wait(self, seq: int, timeout: float) -> bool:  # noqa: ASYNC109 (as Invalidator.wait)
        return self.taken


class FakeCtx:
    def __init__(self, taken: bool = True) -> None:
        self.invalidator = FakeInvalidator(taken)

    async def run_sync(self, fn, *args):
        return fn(*args)


def flags(reply) -> tuple[bool, bool]:
    return (reply.keep_cache, reply.cache_readdir)


async def test_an_open_keeps_the_kernels_listing_only_while_it_is_the_listing():
    ctx = FakeCtx()
    ls_, node = Listings(ctx), FakeDir()  # type: ignore[arg-type]
    first = 1
    assert flags(await ls_.open(9, first, node, None)) == (True, True)  # nothing cached yet
    ls_.filling(ls_.snapshots[first])
    ls_.release(first)
    assert flags(await ls_.open(9, 2, node, None)) == (True, True)
    ls_.release(2)
    assert ctx.invalidator.inodes == [] and ls_.mtime_ns(9, 77) == 77

    node.names = [b"a"]  # changed: the kernel's copy is dropped first, this open refills it
    changed = 3
    assert flags(await ls_.open(9, changed, node, None)) == (False, True)
    assert ctx.invalidator.inodes == [9]
    moved = ls_.mtime_ns(9, 77)
    assert moved > 77
    assert [e[0] for e in ls_.entries_after(ls_.snapshots[changed], 0)] == [b"a"]
    assert ls_.entries_after(ls_.snapshots[changed], 3) == []
    ls_.filling(ls_.snapshots[changed])
    ls_.release(changed)
    assert flags(await ls_.open(9, 4, node, None)) == (True, True)
    ls_.release(4)
    assert ctx.invalidator.inodes == [9] and ls_.mtime_ns(9, 77) == moved
    assert ls_.snapshots == {}


async def test_while_a_handle_holds_an_older_listing_a_new_open_is_not_cached():
    ctx = FakeCtx()
    ls_, node = Listings(ctx), FakeDir()  # type: ignore[arg-type]
    old = 1
    assert flags(await ls_.open(9, old, node, None)) == (True, True)
    node.names = [b"b"]
    assert flags(await ls_.open(9, 2, node, None)) == (False, False)  # uncached: exact
    assert 2 not in ls_.snapshots
    ls_.release(2)
    ls_.filling(ls_.snapshots[old])  # the old handle reads now: the kernel may cache that
    ls_.release(old)
    assert flags(await ls_.open(9, 3, node, None)) == (False, True)  # so dropped first
    assert ctx.invalidator.inodes == [9]
    ls_.filling(ls_.snapshots[3])
    ls_.release(3)
    assert flags(await ls_.open(9, 4, node, None)) == (True, True)


async def test_an_open_is_not_cached_when_the_kernel_did_not_take_the_drop_in_time():
    ctx = FakeCtx(taken=False)
    ls_, node = Listings(ctx), FakeDir()  # type: ignore[arg-type]
    assert flags(await ls_.open(9, 1, node, None)) == (True, True)
    ls_.filling(ls_.snapshots[1])
    ls_.release(1)
    node.names = [b"c"]
    assert flags(await ls_.open(9, 2, node, None)) == (False, False)
    ls_.release(2)
    ctx.invalidator.taken = True
    assert flags(await ls_.open(9, 3, node, None)) == (False, True)  # dropped at last
    assert ctx.invalidator.inodes == [9, 9]


async def test_without_a_kernel_or_for_other_nodes_an_open_is_a_plain_handle():
    node = FakeDir()
    assert await Listings(FakeCtx(), kernel=False).open(9, 5, node, None) == 5  # type: ignore[arg-type]
    assert await Listings(None).open(9, 5, node, None) == 5
    node.caches_listing = False
    assert await Listings(FakeCtx()).open(9, 6, node, None) == 6  # type: ignore[arg-type]
    got = await Listings(FakeCtx()).open(9, 7, FakeDir(), None)  # type: ignore[arg-type]
    assert isinstance(got, pyfuse3.FileInfo)
