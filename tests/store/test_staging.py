"""The large tier's staging writer: bytes land in order, errors surface, nothing hangs."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import random
import subprocess
from pathlib import Path

import pytest

from alkfs.tiers import staging
from alkfs.tiers.staging import (
    ALIGN,
    DIRECT_BUFFER,
    DIRECT_BUFFERS,
    POOL_MAX,
    WRITEBACK_STEP,
    StagingWriter,
)


def test_chunks_land_in_order_and_are_on_disk_after_finish(tmp_path: Path) -> None:
    path = tmp_path / "staging"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
    writer = StagingWriter(path, fd)
    chunks = [bytes([i]) * (1 << 20) for i in range(20)]  # 20 MiB: past two writeback steps
    assert sum(map(len, chunks)) > 2 * WRITEBACK_STEP
    for chunk in chunks:
        writer.write(chunk)
    writer.finish()
    writer.close()
    writer.close()  # idempotent
    assert writer.fd == -1
    assert path.read_bytes() == b"".join(chunks)


def test_a_write_error_surfaces_at_finish_and_close_does_not_hang(tmp_path: Path) -> None:
    path = tmp_path / "staging"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)  # every write fails with EBADF
    writer = StagingWriter(path, fd)
    with pytest.raises(OSError) as caught:
        for _ in range(64):  # more than the queue holds: the thread keeps draining
            writer.write(b"x" * 4096)
        writer.finish()
    assert caught.value.errno == errno.EBADF
    writer.close()
    assert writer.fd == -1
    assert path.read_bytes() == b""


def test_a_writer_that_cannot_start_its_thread_leaves_no_staging_file(tmp_path, monkeypatch):
    from alkfs.store import Store

    with Store.open(tmp_path / "store", threshold=1024) as store:
        staging = tmp_path / "store" / "large" / ".staging"
        fds = len(os.listdir("/proc/self/fd"))

        def refuse(self):
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr("threading.Thread.start", refuse)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            store.put(iter([b"a" * 4096, b"b" * 4096]))
        monkeypatch.undo()
        assert os.listdir(staging) == []
        assert len(os.listdir("/proc/self/fd")) == fds
        assert store.list() == []


def cached_bytes(path: Path) -> int:
    """How many bytes of `path` the page cache holds (util-linux fincore)."""
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip())


def new_staging(tmp_path: Path) -> tuple[Path, int]:
    path = tmp_path / "staging"
    return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)


def needs_direct(where: Path) -> None:
    """Skip where the test's file system refuses O_DIRECT (some tmpfs): the writer then
    takes the buffered path, which the tests above cover."""
    probe = where / "direct-probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if not staging.set_direct(fd, True):
            pytest.skip(f"{where}: the file system refuses O_DIRECT")
    finally:
        os.close(fd)
        probe.unlink()


def test_a_large_file_is_written_with_o_direct_in_order(tmp_path: Path) -> None:
    """O_DIRECT where the file system takes it (this test's does): 16 MiB and an
    unaligned tail, in chunks of odd sizes, land in order; the digester saw every byte."""
    needs_direct(tmp_path)
    path, fd = new_staging(tmp_path)
    writer = StagingWriter(path, fd)
    assert writer.direct
    assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    rng = random.Random(5)
    chunks = [rng.randbytes((1 << 20) + 4097 * (i % 3)) for i in range(16)]
    for chunk in chunks:
        writer.write(chunk)
    writer.finish()
    writer.close()
    data = b"".join(chunks)
    assert len(data) % ALIGN != 0 and len(data) > 3 * DIRECT_BUFFER
    assert path.read_bytes() == data
    assert writer.digester.size == len(data)


def test_the_direct_write_leaves_nothing_but_the_tail_cached(tmp_path: Path) -> None:
    """Written through the page cache, all 16 MiB stay cached after the fsync: the pages a
    1 GiB put through the mount filled one by one (README, "Large writes")."""
    needs_direct(tmp_path)
    path, fd = new_staging(tmp_path)
    writer = StagingWriter(path, fd)
    size = 16 * (1 << 20) + 100
    for i in range(16):
        writer.write(bytes([i]) * (1 << 20))
    writer.write(b"t" * 100)
    writer.finish()
    writer.close()
    assert path.stat().st_size == size
    assert cached_bytes(path) <= ALIGN  # (the tail's page only)
    assert path.read_bytes() == b"".join(bytes([i]) * (1 << 20) for i in range(16)) + b"t" * 100


def test_a_direct_write_the_kernel_refuses_is_made_through_the_page_cache(tmp_path) -> None:
    """EINVAL from a real O_DIRECT write (here: a buffer at an unaligned address, as a
    file system with a larger block would refuse an aligned one): the bytes are written
    buffered, in place, and so is the rest of the file."""
    needs_direct(tmp_path)
    path, fd = new_staging(tmp_path)
    writer = StagingWriter(path, fd)
    assert writer.direct
    buf = mmap.mmap(-1, 3 * ALIGN)
    buf[:] = bytes(range(256)) * (3 * ALIGN // 256)
    with memoryview(buf) as view:
        writer._write_direct(view[1 : 1 + 2 * ALIGN])  # (unaligned: EINVAL, then buffered)
    assert not writer.direct
    assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    writer.write(b"rest")
    writer.finish()
    writer.close()
    assert path.read_bytes() == bytes(buf[1 : 1 + 2 * ALIGN]) + b"rest"
    buf.close()


def test_a_direct_write_error_surfaces_and_a_writer_never_waits_for_a_buffer(tmp_path) -> None:
    """Every write of the thread fails (EBADF: a read-only descriptor): write() goes on
    past the writer's buffers (they come back after a failed write too), finish raises
    the error, close gives the buffers back."""
    needs_direct(tmp_path)
    path = tmp_path / "staging"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    writer = StagingWriter(path, fd)
    assert writer.direct
    buffers = list(writer._buffers)
    assert len(buffers) == DIRECT_BUFFERS
    with pytest.raises(OSError) as caught:
        for _ in range(8 * DIRECT_BUFFERS):  # (4 MiB each: far more than its buffers)
            writer.write(b"x" * DIRECT_BUFFER)
        writer.finish()
    assert caught.value.errno == errno.EBADF
    writer.close()
    assert writer.fd == -1 and path.read_bytes() == b""
    # every buffer came back to the pool, for the next writer
    assert writer._buffers == [] and all(any(b is p for p in staging._pool) for b in buffers)


def test_writers_at_once_each_get_their_own_buffers(tmp_path: Path) -> None:
    writers = []
    for i in range(3):
        path = tmp_path / f"s{i}"
        writers.append(StagingWriter(path, os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)))
    for round_ in range(5):
        for i, w in enumerate(writers):
            w.write(bytes([i * 16 + round_]) * (3 << 20))
    for w in writers:
        w.finish()
        w.close()
    for i, w in enumerate(writers):
        assert w.path.read_bytes() == b"".join(bytes([i * 16 + r]) * (3 << 20) for r in range(5))
    assert len(staging._pool) <= POOL_MAX
