"""Storing what git wrote into scratch files: a loose object linked or renamed to its name,
a pushed pack once its index arrives, and the pins a push's freshens take."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from alkfs.errors import Verification
from alkfs.git.import_pack import keep_pushed
from alkfs.git.objects import decode_loose
from alkfs.git.packs.adopt import KEEP_MIN
from alkfs.keys import Algorithm, Key
from alkfs.store import ObjectStat, PutResult

from ..errors import fail

if TYPE_CHECKING:
    from alkfs.gc.arbiter import Pin
    from alkfs.git.packs import Derived
    from alkfs.git.refs import Repo

    from ..context import Context
    from .scratch import ScratchFile
    from .writes import RepoKey

log = logging.getLogger("alkfsd")


def ingest_blocking(ctx: Context, data: bytes, algo: Algorithm, key: Key) -> PutResult:
    """Store a loose object's inflated content under `key` (Verification on any mismatch:
    not zlib, not one canonical object, another digest). Returns the PutResult."""
    canonical = decode_loose(data)
    return ctx.store.put(canonical, len(canonical), algo=algo, expect=key)


async def ingest(
    ctx: Context, node: ScratchFile, algo: Algorithm, hexname: str, repo: RepoKey | None, pid: int
) -> ObjectStat:
    """A scratch file named `hexname` in a fan-out directory: verify and store it; pinned
    for `repo`'s session when it came through a repository, released at once otherwise."""
    key = Key.from_hex(algo, hexname)
    data = node.read_all()
    # Always off the trio thread: the put writes sqlite and may wait out a sweep's delete.
    result = await ctx.run_sync(ingest_blocking, ctx, data, algo, key)
    if repo is not None:
        ctx.writes.hold(repo, pid, result.pin)
    else:
        result.pin.release()
    st = ctx.store.stat(key)
    if st is None:  # swept between the put and now: cannot happen while pinned
        fail(errno.EIO, f"{key} vanished after it was stored")
    return st


PACK_BATCH = 8192  # objects a put_many batch when a pushed pack is ingested
GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "LC_ALL": "C"}


def ingest_pack_blocking(
    ctx: Context, pack: Path, idx: Path, object_format: str, algo: Algorithm
) -> list[PutResult]:
    """Every object of a pack git indexed (a push's pack, migrated out of its
    quarantine), verified and stored; returns the PutResults (their pins are the
    caller's). git itself reads the pack (`cat-file --batch-all-objects`) from a
    throwaway repository in the scratch area holding links to the two files."""
    results: list[PutResult] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")} | GIT_ENV
    with tempfile.TemporaryDirectory(dir=ctx.writes.area.root, prefix="pack-") as tmp:
        gitdir = Path(tmp) / "repo.git"
        subprocess.run(
            ["git", "init", "-q", "--bare", f"--object-format={object_format}", str(gitdir)],
            env=env,
            check=True,
            capture_output=True,
            umask=0o077,  # its files are the daemon's alone, whatever the daemon's umask
        )
        os.link(pack, gitdir / "objects" / "pack" / "pack-pushed.pack")
        os.link(idx, gitdir / "objects" / "pack" / "pack-pushed.idx")
        cat = ["git", f"--git-dir={gitdir}", "cat-file", "--batch-all-objects", "--batch"]
        with subprocess.Popen(
            [*cat, "--unordered"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        ) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            items: list[tuple[bytes, Algorithm, bytes]] = []
            tag = bytes([algo.value])
            try:
                while line := proc.stdout.readline():
                    oid, kind, size = line.split()
                    n = int(size)
                    body = proc.stdout.read(n + 1)
                    if len(body) != n + 1:
                        raise Verification(f"git cat-file ended inside {oid.decode()}")
                    canonical = kind + b" " + size + b"\0" + body[:n]
                    items.append((canonical, algo, tag + bytes.fromhex(oid.decode())))
                    if len(items) >= PACK_BATCH:
                        results += ctx.store.put_many(items)
                        items = []
                if items:
                    results += ctx.store.put_many(items)
                err = proc.stderr.read()
                if proc.wait() != 0:
                    why = err.decode(errors="replace").strip()
                    raise Verification(f"git could not read the pushed pack: {why}")
            except BaseException:
                proc.kill()
                for r in results:
                    r.pin.release()
                raise
    return results


def _pack_count(idx: Path) -> int:
    """The object count an idx v2 file claims (its fan-out's last entry; 0 if it is not
    one): only to choose the path, never trusted beyond that."""
    with idx.open("rb") as f:
        head = f.read(8 + 256 * 4)
    if len(head) < 8 + 256 * 4 or head[:8] != b"\377tOc\0\0\0\2":
        return 0
    return int.from_bytes(head[-4:], "big")


def store_pack_blocking(
    ctx: Context, derived: Derived | None, pack: Path, idx: Path, repo: Repo, pins: list[Pin]
) -> bool:
    """Store a push's pack (see `ingest_pack`), its objects' pins put in `pins` as they
    are taken (before the set that holds them is published). Whether it was kept as a
    pack."""
    if derived is not None and derived.can_adopt() and _pack_count(idx) >= KEEP_MIN:
        keep_pushed(ctx.app, derived, pack, pins.extend)
        return True
    results = ingest_pack_blocking(ctx, pack, idx, repo.object_format, repo.algo)
    pins.extend(r.pin for r in results)
    return False


async def ingest_pack(
    ctx: Context, pack: ScratchFile, idx: ScratchFile, repo: Repo, pid: int
) -> int:
    """A push's pack arrived in /repos/<id>/objects/pack: kept as a pack of the set when
    the sets hold git objects alone (a store of one process, drained) and it holds at
    least KEEP_MIN objects (git's receive.unpackLimit: a push of fewer arrives loose),
    else every object in it stored in the kv; pinned for the push's session either way.
    Returns how many objects it held."""
    derived = ctx.packs.derived.get(repo.object_format)
    pins: list[Pin] = []
    try:
        kept = await ctx.run_sync(
            store_pack_blocking, ctx, derived, pack.disk, idx.disk, repo, pins
        )
    except BaseException:
        for pin in pins:
            pin.release()
        raise
    w = ctx.writes
    for pin in pins:
        w.hold((repo.id, repo.created_ns), pid, pin)
    how = "kept as a pack" if kept else "stored"
    log.info("repository %s: %s %d object(s) of a pushed pack", repo.id, how, len(pins))
    return len(pins)


async def freshened(ctx: Context, key: Key, pid: int) -> None:
    """A loose file was touched: if the toucher works for a push, pin the object for it
    (in a worker thread: the pin waits out an in-flight delete of the key)."""
    w = ctx.writes
    owner = w.push_of(pid)
    if owner is not None:
        w.hold(owner[0], owner[1], await ctx.run_sync(ctx.store.pin, key))
