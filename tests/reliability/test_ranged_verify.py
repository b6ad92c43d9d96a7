"""Every byte served through the mount is verified, whole or ranged: a READ checks the
1 MiB chunks it covers against the object's catalog row, `stat` shows the recorded size,
and an object stored before the catalog is verified whole at its first read."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pysqlite3.dbapi2 as sqlite3  # the store's own sqlite library (see tests/store)
import pytest
from helpers import RecordingInvalidator

from alkfs.keys import Key
from alkfs.store import Store
from alkfsd.context import Context
from alkfsd.nodes.objfile import LargeHandle, ObjectFile

MIB = 1 << 20
SIZE = 5 * MIB
BAD = 2  # the chunk whose byte is changed


def content(size: int = SIZE) -> bytes:
    """Deterministic, and no two chunks alike (251 is prime: no chunk starts in phase)."""
    return (bytes(range(251)) * (size // 251 + 1))[:size]


def backing(store: Path, key: Key) -> Path:
    return store / "large" / key.algo.label / key.hex[:2] / key.hex


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:  # (root: the file's 0400/0444 mode does not stop us)
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x5A]))


def oracle(store: Path) -> sqlite3.Connection:
    return sqlite3.connect(store / "store.db", isolation_level=None)


def catalog_row(store: Path, key: Key) -> tuple | None:
    conn = oracle(store)
    try:
        row = conn.execute(
            "SELECT size, chunk_size, chunk_algo, chunks FROM catalog WHERE key = ?", (key.raw,)
        ).fetchone()
        return None if row is None else (row[0], row[1], row[2], bytes(row[3]))
    finally:
        conn.close()


def drop_row(store: Path, key: Key) -> None:
    conn = oracle(store)
    try:
        assert conn.execute("DELETE FROM catalog WHERE key = ?", (key.raw,)).rowcount == 1
    finally:
        conn.close()


def corrupt_list(m) -> list[str]:
    return json.loads(m.path(".alkfs", "status").read_text())["corrupt"]


def head(path: Path, n: int) -> subprocess.CompletedProcess:
    return subprocess.run(["head", "-c", str(n), str(path)], capture_output=True, timeout=60)


def dd_chunk(path: Path, chunk: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["dd", f"if={path}", "bs=1M", f"skip={chunk}", "count=1", "status=none"],
        capture_output=True,
        timeout=60,
    )


def assert_eio(done: subprocess.CompletedProcess) -> None:
    assert done.returncode != 0
    assert b"Input/output error" in done.stderr


@pytest.fixture
def stored(tmp_path: Path, populate):
    """A store holding one 5 MiB object (sha256), not mounted yet: (store, key, data)."""
    store = tmp_path / "store"
    data = content()
    [key] = populate(store, [data])
    return store, key, data


def test_a_changed_byte_fails_only_the_reads_touching_its_chunk(stored, start_mount) -> None:
    store, key, data = stored
    flip(backing(store, key), BAD * MIB + 777)
    m = start_mount(store)
    obj = m.path("objects", "sha256", key.hex)
    assert os.stat(obj).st_size == SIZE
    done = head(obj, 4096)
    assert (done.returncode, done.stdout) == (0, data[:4096])
    done = dd_chunk(obj, 4)
    assert (done.returncode, done.stdout) == (0, data[4 * MIB :])
    assert corrupt_list(m) == []
    assert_eio(dd_chunk(obj, BAD))
    assert corrupt_list(m) == [f"sha256/{key.hex}"]
    with pytest.raises(OSError) as caught:  # known corrupt: later opens fail
        os.open(obj, os.O_RDONLY)
    assert caught.value.errno == errno.EIO


def test_a_pread_touching_the_changed_chunk_is_eio_and_others_serve(stored, start_mount) -> None:
    store, key, data = stored
    flip(backing(store, key), BAD * MIB + 5)
    m = start_mount(store)
    fd = os.open(m.path("objects", "sha256", key.hex), os.O_RDONLY)
    try:
        assert os.pread(fd, 100, 4 * MIB + 9) == data[4 * MIB + 9 : 4 * MIB + 109]
        assert corrupt_list(m) == []
        with pytest.raises(OSError) as caught:
            os.pread(fd, 10, BAD * MIB)
        assert caught.value.errno == errno.EIO
        assert corrupt_list(m) == [f"sha256/{key.hex}"]
        # a chunk this descriptor verified is still served, verified
        assert os.pread(fd, 100, 4 * MIB + 500) == data[4 * MIB + 500 : 4 * MIB + 600]
    finally:
        os.close(fd)


def test_a_truncated_file_shows_the_recorded_size_and_its_missing_range_is_eio(
    stored, start_mount
) -> None:
    store, key, data = stored
    os.truncate(backing(store, key), 3 * MIB + 5)
    m = start_mount(store)
    obj = m.path("objects", "sha256", key.hex)
    assert os.stat(obj).st_size == SIZE
    assert os.getxattr(obj, "user.alkfs.size") == str(SIZE).encode()
    done = head(obj, 4096)
    assert (done.returncode, done.stdout) == (0, data[:4096])
    assert corrupt_list(m) == []
    assert_eio(dd_chunk(obj, 4))
    assert corrupt_list(m) == [f"sha256/{key.hex}"]


def test_an_extended_file_shows_the_recorded_size_and_its_last_chunk_is_eio(
    stored, start_mount
) -> None:
    store, key, data = stored
    with open(backing(store, key), "ab") as f:
        f.write(b"more bytes")
    m = start_mount(store)
    obj = m.path("objects", "sha256", key.hex)
    assert os.stat(obj).st_size == SIZE
    done = head(obj, 4096)
    assert (done.returncode, done.stdout) == (0, data[:4096])
    assert corrupt_list(m) == []
    assert_eio(dd_chunk(obj, 4))
    assert corrupt_list(m) == [f"sha256/{key.hex}"]


def test_an_object_without_a_row_is_verified_whole_at_its_first_read_and_gets_its_row(
    stored, start_mount
) -> None:
    store, key, data = stored
    recorded = catalog_row(store, key)
    assert recorded is not None and recorded[:3] == (SIZE, MIB, 2)
    drop_row(store, key)
    m = start_mount(store)
    done = head(m.path("objects", "sha256", key.hex), 4096)
    assert (done.returncode, done.stdout) == (0, data[:4096])
    assert catalog_row(store, key) == recorded
    assert corrupt_list(m) == []


def test_an_object_without_a_row_fails_its_first_read_if_any_chunk_changed(
    stored, start_mount
) -> None:
    store, key, _ = stored
    drop_row(store, key)
    flip(backing(store, key), 4 * MIB + 3)
    m = start_mount(store)
    assert_eio(head(m.path("objects", "sha256", key.hex), 4096))
    assert corrupt_list(m) == [f"sha256/{key.hex}"]
    assert catalog_row(store, key) is None


def test_verify_through_the_mount_records_a_missing_row(stored, start_mount) -> None:
    store, key, _ = stored
    recorded = catalog_row(store, key)
    drop_row(store, key)
    m = start_mount(store)
    m.path(".alkfs", "control").write_text("verify\n")
    assert corrupt_list(m) == []
    assert catalog_row(store, key) == recorded


def test_the_sweep_through_the_mount_removes_the_row_with_the_object(stored, start_mount) -> None:
    store, key, _ = stored  # unpinned, unreferenced: dead
    m = start_mount(store)
    for _ in range(2):  # window 0: the first sweep stages, the second deletes
        m.path(".alkfs", "control").write_text("sweep\n")
    assert not backing(store, key).exists()
    assert catalog_row(store, key) is None
    assert not m.path("objects", "sha256", key.hex).exists()


def test_open_rdonly_with_o_append_reads_an_object(tmp_path, populate, start_mount) -> None:
    store = tmp_path / "store"
    small, large = b"a small object\n", content(300_000)
    keys = populate(store, [small, large])
    m = start_mount(store)
    for key, data in zip(keys, (small, large), strict=True):
        path = m.path("objects", "sha256", key.hex)
        fd = os.open(path, os.O_RDONLY | os.O_APPEND)
        try:
            assert os.read(fd, len(data) + 10) == data
        finally:
            os.close(fd)
        for flags in (os.O_WRONLY | os.O_APPEND, os.O_RDWR | os.O_APPEND):
            with pytest.raises(OSError) as caught:
                os.open(path, flags)
            assert caught.value.errno == errno.EPERM


async def test_a_handle_hashes_each_chunk_once_and_the_file_once_whole(tmp_path) -> None:
    """The handle's own record of what it verified (no kernel: direct calls)."""
    data = content()
    with Store.open(tmp_path / "store", window_s=0) as store:
        key = store.add(data)
        ctx = Context(store, kernel=RecordingInvalidator())
        try:
            node = ObjectFile(ctx, None, store.stat(key))  # type: ignore[arg-type]
            h = await node.open(os.O_RDONLY, None)
            assert isinstance(h, LargeHandle)
            assert (h.verified, h.size, bytes(h.good)) == (False, SIZE, bytes(5))
            assert await h.read(MIB + 10, 4096) == data[MIB + 10 : MIB + 4106]
            assert (bytes(h.good), h.left) == (b"\0\1\0\0\0", 4)
            assert await h.read(MIB + 9000, 4096) == data[MIB + 9000 : MIB + 13096]
            assert await h.read(2 * MIB - 10, 20) == data[2 * MIB - 10 : 2 * MIB + 10]
            assert (bytes(h.good), h.left) == (b"\0\1\1\0\0", 3)
            assert store.is_verified(key, os.fstat(h.fd)) is False
            for off in range(0, SIZE, 128 * 1024):
                assert await h.read(off, 128 * 1024) == data[off : off + 128 * 1024]
            assert (h.verified, h.left) == (True, 0)
            assert store.is_verified(key, os.fstat(h.fd)) is True  # later opens hash nothing
            await h.release()
            again = await node.open(os.O_RDONLY, None)
            assert again.verified is True
            await again.release()
        finally:
            ctx.close()
