"""The large tier's staging writer: bytes land in order, errors surface, nothing hangs."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from alkfs.tiers.staging import WRITEBACK_STEP, StagingWriter


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
