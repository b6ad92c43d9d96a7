"""Direct calls into alkfsd's Operations, without the kernel: exact errnos, inodes, lookup
counts, paged listings, verified reads, xattrs and the control file."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pyfuse3
import pytest
from helpers import RecordingInvalidator

from alkfs import errors as lib
from alkfs.app import Alkfs
from alkfs.keys import Algorithm, Key
from alkfsd.context import Context, Options
from alkfsd.errors import errno_of
from alkfsd.fs import Operations
from alkfsd.nodes import objects as objects_mod

ROOT = pyfuse3.ROOT_INODE
LARGE = 200_000


def fields(**set_: bool) -> SimpleNamespace:
    names = ("atime", "mtime", "ctime", "mode", "uid", "gid", "size")
    return SimpleNamespace(**{f"update_{n}": set_.get(n, False) for n in names})


class Harness:
    def __init__(self, app: Alkfs, read_only: bool = False) -> None:
        self.app = app
        self.ctx = Context(
            app.store, app=app, options=Options(read_only=read_only), kernel=RecordingInvalidator()
        )
        self.reply = pyfuse3.readdir_reply  # (each listing below sets its own)
        self.ops = Operations(self.ctx, readdir_reply=lambda *a: self.reply(*a))

    async def walk(self, path: str) -> pyfuse3.EntryAttributes:
        ino = ROOT
        attr = await self.ops.getattr(ROOT, None)
        for part in path.strip("/").split("/"):
            if part:
                attr = await self.ops.lookup(ino, part.encode(), None)
                ino = attr.st_ino
        return attr

    async def ino(self, path: str) -> int:
        return (await self.walk(path)).st_ino

    async def listdir(self, path: str, accept: int | None = None, start: int = 0):
        """[(name, ino, next_id)] of one readdir call; `accept` limits the kernel's buffer."""
        fh = await self.ops.opendir(await self.ino(path), None)
        got: list[tuple[bytes, int, int]] = []

        def reply(token, name, attr, next_id):
            if accept is not None and len(got) >= accept:
                return False
            got.append((name, attr.st_ino, next_id))
            return True

        self.reply = reply
        await self.ops.readdir(fh, start, None)
        await self.ops.releasedir(fh)
        return got

    async def listall(self, path: str, batch: int) -> list[bytes]:
        """A whole listing as the kernel reads it: one readdir per batch, resuming."""
        fh = await self.ops.opendir(await self.ino(path), None)
        names: list[bytes] = []
        start = 0
        while True:
            got: list[tuple[bytes, int]] = []

            def reply(token, name, attr, next_id, got=got):
                if len(got) >= batch:
                    return False
                got.append((name, next_id))
                return True

            self.reply = reply
            await self.ops.readdir(fh, start, None)
            if not got:
                break
            names += [n for n, _ in got]
            start = got[-1][1]
        await self.ops.releasedir(fh)
        return names

    async def read_all(self, path: str, chunk: int = 131072) -> bytes:
        fi = await self.ops.open(await self.ino(path), os.O_RDONLY, None)
        try:
            out = bytearray()
            while data := await self.ops.read(fi.fh, len(out), chunk):
                out += data
            return bytes(out)
        finally:
            await self.ops.release(fi.fh)


async def fails(errno_: int, coro) -> None:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await coro
    assert e.value.errno == errno_, errno.errorcode.get(e.value.errno)


@pytest.fixture
def app(tmp_path: Path):
    a = Alkfs.open(tmp_path / "store", window_s=0)
    yield a
    a.close()


@pytest.fixture
def keys(app: Alkfs) -> dict[str, Key]:
    s = app.store
    k = {
        "small": s.add(b"hello\n"),
        "large": s.add(b"L" * LARGE),
        "blake3": s.add(b"blake\n", algo=Algorithm.BLAKE3),
        "commit": s.add(b"commit 3\0abc", algo=Algorithm.GIT_SHA1),
        "tree256": s.add(b"tree 0\0", algo=Algorithm.GIT_SHA256),
    }
    app.pins.pin("keep", k["small"])
    return k


@pytest.fixture
def h(app: Alkfs, keys) -> Harness:
    harness = Harness(app)
    yield harness
    harness.ctx.close()


def opath(key: Key) -> str:
    return f"/objects/{key.algo.label}/{key.hex}"


# -- the tree --------------------------------------------------------------------------------
async def test_root_lists_objects_and_alkfs_with_offsets_above_2(h):
    got = await h.listdir("/")
    names = [n for n, _, _ in got]
    assert names[0] == b"objects" and names[-1] == b".alkfs"  # the registry's order
    assert all(off > 2 for _, _, off in got)
    assert [n for n, _, _ in await h.listdir("/objects")] == [
        b"sha256",
        b"blake3",
        b"git-sha1",
        b"git-sha256",
    ]
    assert [n for n, _, _ in await h.listdir("/.alkfs")] == [
        b"control",
        b"status",
        b"metrics",
        b"staged",
        b"dry-run",
    ]


async def test_dot_and_dotdot_resolve(h):
    sha = await h.ino("/objects/sha256")
    assert (await h.ops.lookup(sha, b".", None)).st_ino == sha
    assert (await h.ops.lookup(sha, b"..", None)).st_ino == await h.ino("/objects")


async def test_missing_and_malformed_names_are_enoent(h, keys):
    sha = await h.ino("/objects/sha256")
    hexd = keys["small"].hex
    for name in (
        hexd.upper(),
        hexd[:-1],
        hexd + "0",
        "0" * 64,
        "g" * 64,
        keys["commit"].hex,
    ):
        await fails(errno.ENOENT, h.ops.lookup(sha, name.encode(), None))
    await fails(errno.ENOENT, h.ops.lookup(sha, b"\xff" * 64, None))
    await fails(errno.ENOENT, h.ops.lookup(ROOT, b"git-sha1", None))
    await fails(errno.ENOENT, h.ops.getattr(123456789, None))


async def test_object_attributes_are_exact_and_the_inode_stable(h, keys, app):
    for key in keys.values():
        attr = await h.walk(opath(key))
        st = app.store.stat(key)
        assert stat.S_ISREG(attr.st_mode) and stat.S_IMODE(attr.st_mode) == 0o444
        assert attr.st_size == st.size
        assert attr.st_mtime_ns == st.stored_ns
        assert attr.entry_timeout == attr.attr_timeout == 3600
        assert (await h.ops.getattr(attr.st_ino, None)).st_size == st.size
    ino = await h.ino(opath(keys["large"]))
    n = h.ops.inodes.lookups(ino)
    await h.ops.forget([(ino, n)])
    assert h.ops.inodes.get(ino) is None
    assert await h.ino(opath(keys["large"])) == ino  # the same number after forget


async def test_lookup_counts_follow_lookups_accepted_readdir_entries_and_forget(h, keys):
    sha = await h.ino("/objects/sha256")
    attr = await h.ops.lookup(sha, keys["small"].hex.encode(), None)
    assert h.ops.inodes.lookups(attr.st_ino) == 1
    got = await h.listdir("/objects/sha256", accept=1)
    assert len(got) == 1
    first, second = sorted([keys["small"], keys["large"]])
    assert got[0][0] == first.hex.encode()
    first_ino = got[0][1]
    assert h.ops.inodes.lookups(first_ino) == (2 if first == keys["small"] else 1)
    second_ino = (await h.walk(opath(second))).st_ino
    await h.ops.forget([(second_ino, 1)])
    assert h.ops.inodes.lookups(second_ino) == (1 if second == keys["small"] else 0)


async def test_listing_is_paged_resumes_from_the_last_key_and_repeats_nothing(h, app, monkeypatch):
    monkeypatch.setattr(objects_mod, "PAGE", 7)
    for i in range(60):
        app.store.add(f"object {i}\n".encode())
    expected = sorted(
        k.hex.encode() for k in (s.key for s in app.store.list(limit=10_000, algo=Algorithm.SHA256))
    )
    assert len(expected) == 62
    for batch in (1, 5, 7, 8, 61, 1000):
        assert await h.listall("/objects/sha256", batch) == expected


async def test_offsets_are_stable_and_a_fresh_handle_resumes_from_any_offset(h, app, monkeypatch):
    monkeypatch.setattr(objects_mod, "PAGE", 4)
    for i in range(20):
        app.store.add(f"o{i}".encode(), algo=Algorithm.BLAKE3)
    whole = await h.listdir("/objects/blake3")
    assert whole == await h.listdir("/objects/blake3")
    assert all(off > 2 for _, _, off in whole)
    assert [off for *_, off in whole] == sorted(off for *_, off in whole)
    for i in (0, 3, 10, len(whole) - 1):
        rest = await h.listdir("/objects/blake3", start=whole[i][2])
        assert rest == whole[i + 1 :]
    assert await h.listdir("/objects/blake3", start=(1 << 63) - 1) == []  # past the end


async def test_listing_replies_carry_the_lookup_attributes(h, keys):
    got = await h.listdir("/objects/git-sha1")
    assert [n for n, _, _ in got] == [keys["commit"].hex.encode()]
    assert got[0][1] == await h.ino(opath(keys["commit"]))


# -- reads ------------------------------------------------------------------------------------
async def test_reads_give_the_stored_bytes_from_both_tiers(h, keys):
    assert await h.read_all(opath(keys["small"])) == b"hello\n"
    assert await h.read_all(opath(keys["large"])) == b"L" * LARGE
    assert await h.read_all(opath(keys["large"]), chunk=4096) == b"L" * LARGE
    assert await h.read_all(opath(keys["tree256"])) == b"tree 0\0"


async def test_object_opens_keep_the_kernel_cache(h, keys):
    for key in (keys["small"], keys["large"]):
        fi = await h.ops.open(await h.ino(opath(key)), os.O_RDONLY, None)
        assert fi.keep_cache and not fi.direct_io
        await h.ops.release(fi.fh)


async def test_a_verified_large_file_is_not_hashed_again(h, keys, app):
    ino = await h.ino(opath(keys["large"]))
    fi = await h.ops.open(ino, os.O_RDONLY, None)
    assert h.ops.handles[fi.fh].verified is False
    await h.ops.release(fi.fh)
    assert await h.read_all(opath(keys["large"])) == b"L" * LARGE
    fi = await h.ops.open(ino, os.O_RDONLY, None)
    assert h.ops.handles[fi.fh].verified is True
    assert await h.ops.read(fi.fh, LARGE - 10, 100) == b"L" * 10
    await h.ops.release(fi.fh)


async def test_a_read_of_a_corrupt_large_objects_chunk_fails_eio_and_marks_it(h, keys, app):
    # the object is one verified chunk (1 MiB): a read of any part of it checks all of it
    key = keys["large"]
    path = app.store.large_path(key)
    with open(path, "r+b") as f:  # noqa: ASYNC230 (the test's set-up: nothing else runs)
        f.seek(LARGE - 1)
        f.write(b"M")
    ino = await h.ino(opath(key))
    fi = await h.ops.open(ino, os.O_RDONLY, None)
    await fails(errno.EIO, h.ops.read(fi.fh, 0, 131072))  # the changed byte is in its chunk
    assert app.store.corrupt == {key.raw}
    await h.ops.release(fi.fh)
    await fails(errno.EIO, h.ops.open(ino, os.O_RDONLY, None))  # known corrupt: refused
    status = json.loads(await h.read_all("/.alkfs/status"))
    assert status["corrupt"] == [str(key)]


async def test_a_corrupt_kv_object_read_fails_eio_and_marks_it(h, keys, app):
    key = keys["blake3"]
    app.store.db.execute("UPDATE blobs SET value = ? WHERE key = ?", (b"bleak\n", key.raw))
    fi = await h.ops.open(await h.ino(opath(key)), os.O_RDONLY, None)
    await fails(errno.EIO, h.ops.read(fi.fh, 0, 4096))
    await h.ops.release(fi.fh)
    assert app.store.corrupt == {key.raw}


async def test_a_truncated_large_file_fails_eio(h, keys, app):
    key = keys["large"]
    ino = await h.ino(opath(key))
    os.truncate(app.store.large_path(key), LARGE // 2)
    fi = await h.ops.open(ino, os.O_RDONLY, None)
    await fails(errno.EIO, h.ops.read(fi.fh, 0, LARGE))
    await h.ops.release(fi.fh)
    assert key.raw in app.store.corrupt


async def test_objects_refuse_write_opens_unlink_rename_and_resizing(h, keys):
    ino = await h.ino(opath(keys["small"]))
    sha = await h.ino("/objects/sha256")
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_APPEND):
        await fails(errno.EPERM, h.ops.open(ino, flags, None))
    name = keys["small"].hex.encode()
    await fails(errno.EPERM, h.ops.unlink(sha, name, None))
    await fails(errno.ENOENT, h.ops.unlink(sha, b"0" * 64, None))
    await fails(errno.EPERM, h.ops.rename(sha, name, sha, b"x", 0, None))
    await fails(errno.EPERM, h.ops.setattr(ino, None, fields(size=True), None, None))
    await fails(errno.EPERM, h.ops.setattr(ino, None, fields(mode=True), None, None))
    await fails(errno.ENOTDIR, h.ops.rmdir(sha, name, None))
    await fails(errno.EPERM, h.ops.mkdir(sha, b"d", 0o755, None))
    await fails(errno.EPERM, h.ops.rmdir(ROOT, b"objects", None))
    await fails(errno.EISDIR, h.ops.unlink(ROOT, b"objects", None))
    await fails(errno.EPERM, h.ops.symlink(ROOT, b"l", b"objects", None))
    await fails(errno.EINVAL, h.ops.readlink(ino, None))
    await fails(errno.ENOTDIR, h.ops.lookup(ino, b"x", None))
    await fails(errno.ENOTDIR, h.ops.opendir(ino, None))


async def test_touch_freshens_the_object(h, keys, app):
    key = keys["blake3"]
    ino = await h.ino(opath(key))
    before = app.store.stat(key).stored_ns
    attr = await h.ops.setattr(ino, None, fields(atime=True, mtime=True), None, None)
    after = app.store.stat(key).stored_ns
    assert after > before
    assert attr.st_mtime_ns == after


async def test_a_read_only_mount_refuses_changes_with_erofs(app, keys):
    h = Harness(app, read_only=True)
    try:
        ino = await h.ino(opath(keys["small"]))
        await fails(errno.EROFS, h.ops.mkdir(ROOT, b"d", 0o755, None))
        await fails(errno.EROFS, h.ops.setxattr(ino, b"user.alkfs.pin.x", b"", None))
        await fails(errno.EROFS, h.ops.setattr(ino, None, fields(mtime=True), None, None))
        await fails(errno.EROFS, h.ops.open(ino, os.O_WRONLY, None))
        assert await h.read_all(opath(keys["small"])) == b"hello\n"
        control = await h.ino("/.alkfs/control")
        fi = await h.ops.open(control, os.O_WRONLY, None)
        await fails(errno.EROFS, h.ops.write(fi.fh, 0, b"sweep\n"))
        assert await h.ops.write(fi.fh, 0, b"verify\n") == 7
        await h.ops.release(fi.fh)
    finally:
        h.ctx.close()


# -- extended attributes --------------------------------------------------------------------------
async def test_listxattr_lists_what_applies_to_each_object(h, keys):
    base = [b"user.alkfs.algorithm", b"user.alkfs.size", b"user.alkfs.tier"]
    assert await h.ops.listxattr(await h.ino(opath(keys["small"])), None) == base + [
        b"user.alkfs.pins",
        b"user.alkfs.pin.keep",
    ]
    assert await h.ops.listxattr(await h.ino(opath(keys["commit"])), None) == base + [
        b"user.alkfs.git.type",
        b"user.alkfs.pins",
    ]


async def test_getxattr_values(h, keys, app):
    async def get(key: Key, name: str) -> bytes:
        return await h.ops.getxattr(await h.ino(opath(key)), name.encode(), None)

    assert await get(keys["large"], "user.alkfs.algorithm") == b"sha256"
    assert await get(keys["large"], "user.alkfs.size") == str(LARGE).encode()
    assert await get(keys["large"], "user.alkfs.tier") == b"large"
    assert await get(keys["blake3"], "user.alkfs.tier") == b"kv"
    assert await get(keys["commit"], "user.alkfs.git.type") == b"commit"
    assert await get(keys["tree256"], "user.alkfs.git.type") == b"tree"
    assert await get(keys["small"], "user.alkfs.pins") == b"keep"
    assert await get(keys["large"], "user.alkfs.pins") == b""
    created = app.pins.get("keep").created_ns
    from datetime import UTC, datetime

    text = (await get(keys["small"], "user.alkfs.pin.keep")).decode()
    assert datetime.fromisoformat(text) == datetime.fromtimestamp(created / 1e9, UTC).replace(
        microsecond=(created // 1_000_000 % 1000) * 1000
    )


async def test_xattr_errors_are_enodata_eperm_enotsup(h, keys):
    ino = await h.ino(opath(keys["small"]))
    blake = await h.ino(opath(keys["blake3"]))
    for name in (b"user.alkfs.nothing", b"user.alkfs.pin.other", b"user.other"):
        await fails(errno.ENODATA, h.ops.getxattr(ino, name, None))
    for name in (b"security.selinux", b"system.posix_acl_access", b"trusted.x"):
        await fails(errno.EOPNOTSUPP, h.ops.getxattr(ino, name, None))
        await fails(errno.EOPNOTSUPP, h.ops.setxattr(ino, name, b"x", None))
        await fails(errno.EOPNOTSUPP, h.ops.removexattr(ino, name, None))
    await fails(errno.ENODATA, h.ops.getxattr(blake, b"user.alkfs.git.type", None))
    for name in (
        b"user.alkfs.algorithm",
        b"user.alkfs.size",
        b"user.alkfs.tier",
        b"user.alkfs.pins",
    ):
        await fails(errno.EPERM, h.ops.setxattr(ino, name, b"x", None))
        await fails(errno.EPERM, h.ops.removexattr(ino, name, None))
    await fails(errno.ENOTSUP, h.ops.setxattr(ino, b"user.other", b"x", None))
    await fails(errno.ENOTSUP, h.ops.setxattr(ino, b"trusted.x", b"x", None))
    await fails(errno.ENODATA, h.ops.removexattr(ino, b"user.other", None))
    root_dir = await h.ino("/objects")
    assert await h.ops.listxattr(root_dir, None) == []
    await fails(errno.ENODATA, h.ops.getxattr(root_dir, b"user.alkfs.size", None))
    await fails(errno.ENOTSUP, h.ops.setxattr(root_dir, b"user.alkfs.pin.x", b"", None))


async def test_pin_and_unpin_through_xattrs(h, keys, app):
    ino = await h.ino(opath(keys["large"]))
    await h.ops.setxattr(ino, b"user.alkfs.pin.big", b"", None)
    assert app.pins.get("big").key == keys["large"]
    assert await h.ops.getxattr(ino, b"user.alkfs.pins", None) == b"big"
    other = await h.ino(opath(keys["blake3"]))
    await fails(errno.EEXIST, h.ops.setxattr(other, b"user.alkfs.pin.big", b"", None))
    await fails(errno.EINVAL, h.ops.setxattr(other, b"user.alkfs.pin.-bad", b"", None))
    await fails(errno.ENODATA, h.ops.removexattr(other, b"user.alkfs.pin.big", None))
    await h.ops.removexattr(ino, b"user.alkfs.pin.big", None)
    assert app.pins.get("big") is None


# -- control, status, metrics ------------------------------------------------------------------------
async def write_control(h: Harness, data: bytes) -> int:
    fi = await h.ops.open(await h.ino("/.alkfs/control"), os.O_WRONLY | os.O_TRUNC, None)
    try:
        return await h.ops.write(fi.fh, 0, data)
    finally:
        await h.ops.release(fi.fh)


async def test_control_file_is_0600_direct_io_and_truncatable(h):
    attr = await h.walk("/.alkfs/control")
    assert stat.S_IMODE(attr.st_mode) == 0o600 and attr.st_uid == os.getuid()
    ino = attr.st_ino
    await h.ops.setattr(ino, SimpleNamespace(st_size=0), fields(size=True), None, None)
    fi = await h.ops.open(ino, os.O_WRONLY, None)
    assert fi.direct_io
    await h.ops.release(fi.fh)


async def test_control_commands_and_einval_for_anything_else(h, app):
    for bad in (b"bogus\n", b"sweep soon\n", b"sweep 1 2\n", b"verify all\n", b"\n", b"\xff\n"):
        await fails(errno.EINVAL, write_control(h, bad))
    assert app.store.last_sweep is None
    assert await write_control(h, b"sweep\n") == 6
    assert app.store.last_sweep.aborted is None
    assert await write_control(h, b"sweep 1h\n") == 9
    assert await write_control(h, b"verify\n") == 7


async def test_two_sweeps_delete_orphans_and_invalidate_their_entries(h, keys, app):
    orphan = keys["blake3"]
    ino = await h.ino(opath(orphan))
    parent = await h.ino("/objects/blake3")
    await write_control(h, b"sweep 0\n")
    assert h.ctx.invalidator.recorded == []
    await write_control(h, b"sweep 0\n")
    assert app.store.stat(orphan) is None
    algo_dirs = {await h.ino(f"/objects/{a.label}") for a in Algorithm}
    recorded = [r for r in h.ctx.invalidator.recorded if r[0] in algo_dirs]
    # all but the pinned one went; the kernel is told of the one entry it looked up (it
    # never held one of the others, and no absence is cached)
    assert app.store.last_sweep.deleted == 4
    assert recorded == [(parent, orphan.hex.encode(), ino)]
    await fails(errno.ENOENT, h.ops.lookup(parent, orphan.hex.encode(), None))
    fi = await h.ops.open(ino, os.O_RDONLY, None)  # a stale inode: the read says it is gone
    await fails(errno.ENOENT, h.ops.read(fi.fh, 0, 4096))
    await h.ops.release(fi.fh)


async def test_status_has_the_documented_shape(h, keys, app, tmp_path):
    status = json.loads(await h.read_all("/.alkfs/status"))
    assert status["version"] == "0.1.0"
    assert status["store"] == {
        "path": str(tmp_path / "store"),
        "mode": "dual-tier",
        "threshold": 131072,
        "window_s": 0,
    }
    assert status["objects"]["sha256"] == {
        "count": 2,
        "bytes": 6 + LARGE,
        "kv": 1,
        "large": 1,
        "kv_bytes": 6,
        "large_bytes": LARGE,
    }
    assert status["objects"]["git-sha256"] == {
        "count": 1,
        "bytes": 7,
        "kv": 1,
        "large": 0,
        "kv_bytes": 7,
        "large_bytes": 0,
    }
    assert (status["pins"], status["repos"], status["sweeping"]) == (1, 0, False)
    assert (status["last_sweep"], status["corrupt"]) == (None, [])
    fi = await h.ops.open(await h.ino("/.alkfs/status"), os.O_RDONLY, None)
    assert fi.direct_io and not fi.keep_cache
    await h.ops.release(fi.fh)
    await write_control(h, b"sweep\n")
    after = json.loads(await h.read_all("/.alkfs/status"))
    assert after["last_sweep"] == app.store.last_sweep.to_dict()


async def test_metrics_are_prometheus_text(h):
    text = (await h.read_all("/.alkfs/metrics")).decode()
    lines = set(text.splitlines())
    assert 'alkfs_objects{algo="sha256",tier="large"} 1.0' in lines
    assert f'alkfs_object_bytes{{algo="sha256"}} {float(6 + LARGE)}' in lines
    assert "alkfs_pins 1.0" in lines
    assert "alkfs_repos 0.0" in lines
    await fails(errno.ENOENT, h.ops.lookup(ROOT, b"nothing", None))
    text = (await h.read_all("/.alkfs/metrics")).decode()
    assert 'alkfs_fuse_errors_total{errno="ENOENT",op="lookup"} 1.0' in text


# -- the wrapper ---------------------------------------------------------------------------------------
def test_library_errors_map_to_one_errno_each():
    assert {
        cls.__name__: errno_of(cls("x"))
        for cls in (
            lib.Missing,
            lib.Corrupt,
            lib.Verification,
            lib.TooLarge,
            lib.Refused,
            lib.Invalid,
            lib.Exists,
            lib.Stale,
            lib.NotEmpty,
            lib.StoreIO,
            lib.StoreLocked,
        )
    } == {
        "Missing": errno.ENOENT,
        "Corrupt": errno.EIO,
        "Verification": errno.EIO,
        "TooLarge": errno.EFBIG,
        "Refused": errno.EPERM,
        "Invalid": errno.EINVAL,
        "Exists": errno.EEXIST,
        "Stale": errno.EAGAIN,
        "NotEmpty": errno.ENOTEMPTY,
        "StoreIO": errno.EIO,
        "StoreLocked": errno.EBUSY,
    }
    assert errno_of(FileNotFoundError(errno.ENOENT, "x")) == errno.ENOENT
    assert errno_of(RuntimeError("bug")) is None


async def test_an_unexpected_exception_is_eio_with_a_logged_traceback(h, keys, monkeypatch, caplog):
    def boom(self):
        raise RuntimeError("a bug")

    monkeypatch.setattr(objects_mod.ObjectFile, "_pin_names", boom)
    ino = await h.ino(opath(keys["small"]))
    with caplog.at_level(logging.ERROR, logger="alkfsd"):
        await fails(errno.EIO, h.ops.listxattr(ino, None))
    record = caplog.records[-1]
    assert "unexpected error" in record.getMessage() and str(keys["small"]) in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0] is RuntimeError
    assert await h.ops.getxattr(ino, b"user.alkfs.size", None) == b"6"  # the mount goes on


async def test_a_refusal_logs_one_line_with_the_key_and_errno(h, keys, caplog):
    ino = await h.ino(opath(keys["small"]))
    with caplog.at_level(logging.WARNING, logger="alkfsd"):
        await fails(errno.EPERM, h.ops.open(ino, os.O_WRONLY, None))
    (record,) = [r for r in caplog.records if r.name == "alkfsd"]
    msg = record.getMessage()
    assert str(keys["small"]) in msg and "errno=EPERM" in msg


def test_the_example_config_and_flags_make_the_daemon_settings():
    from alkfsd.main import settings

    example = Path(__file__).parents[2] / "systemd" / "example.toml"
    assert settings(["--config", str(example)]) == {
        "store": "/srv/alkfs/main",
        "create": True,
        "mountpoint": "/mnt/alk",
        "window": 3600.0,
        "sweep_every": 3600.0,
        "log_level": "info",
    }
    assert settings(["S", "M", "--window", "0", "--kv-only", "--threshold", "9"]) == {
        "store": "S",
        "mountpoint": "M",
        "window": 0.0,
        "kv_only": True,
        "threshold": 9,
        "sweep_every": 3600.0,  # (sweeps every hour unless told otherwise)
        "log_level": "info",
    }
    assert settings(["S", "M", "--sweep-every", "0", "--log-level", "debug"]) == {
        "store": "S",
        "mountpoint": "M",
        "sweep_every": 0.0,
        "log_level": "debug",
    }


async def test_a_key_found_absent_is_answered_again_until_a_put_ends(h, app):
    """/objects/<algo> remembers a key its lookup found absent (a new file's name is
    looked up three times before it is written) only while no put has ended since, and
    for at most ABSENT_TTL_S: an object stored by any path is found at once."""
    data = b"stored after its name was looked up\n"
    key = Key.of(Algorithm.SHA256, hashlib.sha256(data).digest())
    where = f"/objects/sha256/{key.hex}"
    with pytest.raises(pyfuse3.FUSEError) as e:
        await h.walk(where)
    assert e.value.errno == errno.ENOENT
    node = h.ops.node(await h.ino("/objects/sha256"))
    absent = node.absent
    assert absent.on and key.raw in absent.keys  # the next lookups cost no query
    queried: list[str] = []
    app.store.db.conn().set_trace_callback(queried.append)
    try:
        with pytest.raises(pyfuse3.FUSEError):
            await h.walk(where)
        assert queried == []
        app.store.add(data)  # (not through this directory: a push, the command line)
        assert (await h.walk(where)).st_size == len(data)
    finally:
        app.store.db.conn().set_trace_callback(None)
    # the time bound: a memo older than ABSENT_TTL_S is asked again
    other = Key.of(Algorithm.SHA256, bytes(32))
    assert absent.stat(other) is None and other.raw in absent.keys
    puts, _ = absent.keys[other.raw]
    absent.keys[other.raw] = (puts, 0.0)
    assert absent.stat(other) is None and absent.keys[other.raw][1] > 0.0


async def test_the_repos_view_keeps_a_repositorys_packed_refs_until_it_is_deleted(h):
    """/repos keeps each repository's rendered packed-refs in its view (one per mount, on
    the permanent /repos node): a second read while no ref moved reuses it, and an rmdir
    of the repository leaves nothing of it there."""
    repos_ino = await h.ino("/repos")
    repos = h.ctx.inodes.get(repos_ino)
    await h.ops.mkdir(repos_ino, b"r1", 0o755, None)
    first = await h.walk("/repos/r1/packed-refs")
    again = await h.walk("/repos/r1/packed-refs")
    assert again.st_ino == first.st_ino  # (the same generation: nothing rendered again)
    assert [k[0] for k in repos.view.packed_refs] == ["r1"]
    await h.ops.rmdir(repos_ino, b"r1", None)
    assert repos.view.packed_refs == {} and repos.view.ingested_packs == {}
