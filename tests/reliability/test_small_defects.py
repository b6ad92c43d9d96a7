"""Smaller rules for bad input (docs/decisions.md): names over 255 bytes are ENAMETOOLONG
everywhere, `.alkfs/status` and `.alkfs/metrics` stat the size a read gives (so rsync copies
them whole), and a second alkfsd on a mountpoint a live mount answers is refused."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys

import pytest
from helpers import os_errno, sha, write_close

LONG = "n" * 256
MAX = "m" * 255


def test_names_over_255_bytes_are_enametoolong_for_every_operation(mount):
    m = mount
    write_close(m.path("objects", "sha256", "new"), b"an object\n")
    link = "../objects/sha256/" + sha(b"an object\n")
    obj = m.path("objects", "sha256", sha(b"an object\n"))
    os.mkdir(m.path("repos", "r"))
    write_close(m.path("pins", "short"), b"pinned\n")
    for where in ("", "objects", "objects/sha256", "pins", "repos", "repos/r/refs/heads"):
        d = m.path(where) if where else m.mnt
        assert os_errno(os.stat, d / LONG) == errno.ENAMETOOLONG, where
        assert os_errno(os.lstat, d / MAX) == errno.ENOENT, where  # 255 bytes: just absent
        assert os_errno(write_close, d / LONG, b"x") == errno.ENAMETOOLONG, where
        assert os_errno(os.mkdir, d / LONG) == errno.ENAMETOOLONG, where
        assert os_errno(os.symlink, link, d / LONG) == errno.ENAMETOOLONG, where
        assert os_errno(os.link, obj, d / LONG) == errno.ENAMETOOLONG, where
        assert os_errno(os.mkfifo, d / LONG) == errno.ENAMETOOLONG, where
    assert os_errno(os.rename, m.path("pins", "short"), m.path("pins", LONG)) == (
        errno.ENAMETOOLONG
    )
    assert os_errno(os.rename, m.path("pins", LONG), m.path("pins", "x")) == errno.ENAMETOOLONG
    assert sorted(os.listdir(m.path("pins"))) == ["short"]
    assert sorted(os.listdir(m.path("repos"))) == ["r"]
    assert os.statvfs(m.mnt).f_namemax == 255
    assert m.tracebacks() == []


@pytest.mark.parametrize("name", ["status", "metrics"])
def test_status_and_metrics_stat_the_size_a_read_gives(mount, name):
    m = mount
    write_close(m.path("pins", "keep"), b"pinned\n")
    path = m.path(".alkfs", name)
    assert os.stat(path).st_size > 0
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read()
    assert size == len(data) > 0


def test_rsync_and_cp_of_status_to_a_plain_directory_give_valid_json(mount, tmp_path):
    m = mount
    write_close(m.path("pins", "keep"), b"pinned\n")
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(
        ["rsync", "-a", str(m.path(".alkfs", "status")), str(m.path(".alkfs", "metrics")), out],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    status = json.loads((out / "status").read_text())
    assert status["pins"] == 1 and status["objects"]["sha256"]["count"] == 1
    assert "alkfs_pins 1.0" in (out / "metrics").read_text().splitlines()
    done = subprocess.run(
        ["cp", "--sparse=always", str(m.path(".alkfs", "status")), out / "cp-status"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "cp-status").read_text())["pins"] == 1


def test_a_second_daemon_on_a_live_mountpoint_is_refused_and_the_first_keeps_serving(
    start_mount, tmp_path
):
    first = start_mount(tmp_path / "store-a")
    write_close(first.path("pins", "keep"), b"first mount\n")
    before = first.entry()
    second = subprocess.Popen(
        [sys.executable, "-m", "alkfsd.main", str(tmp_path / "store-b"), str(first.mnt)]
        + ["--create"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = second.communicate(timeout=20)
    except subprocess.TimeoutExpired:  # it mounted over the first one: undo that
        second.send_signal(signal.SIGTERM)
        second.communicate(timeout=20)
        pytest.fail("a second alkfsd mounted over a live mount")
    finally:
        if second.poll() is None:
            second.kill()
            second.wait(timeout=10)
    assert second.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("alkfsd: "), err
    assert lines[0].startswith(f"alkfsd: cannot mount at {first.mnt}: a live mount is there")
    assert first.entry() == before
    assert first.path("pins", "keep").read_bytes() == b"first mount\n"
    assert not (tmp_path / "store-b").exists()  # refused before anything was created


def test_a_dead_mount_is_still_cleared_at_start(start_mount, tmp_path):
    m = start_mount(tmp_path / "store")
    write_close(m.path("pins", "keep"), b"kept\n")
    m.stop(signal.SIGKILL)
    assert m.mounted()  # the dead mount is left behind
    assert os_errno(os.statvfs, m.mnt) in (errno.ENOTCONN, errno.ECONNABORTED)  # (dead)
    m.start()
    assert m.path("pins", "keep").read_bytes() == b"kept\n"


def test_o_rdonly_o_append_reads_an_object_on_a_read_only_mount_too(
    start_mount, populate, tmp_path
):
    store = tmp_path / "ro-store"
    (key,) = populate(store, [b"read with O_APPEND\n"])
    m = start_mount(store, "--read-only")
    path = m.mnt / "objects" / "sha256" / key.hex
    fd = os.open(path, os.O_RDONLY | os.O_APPEND)
    try:
        assert os.read(fd, 100) == b"read with O_APPEND\n"
    finally:
        os.close(fd)
    assert os_errno(os.open, path, os.O_WRONLY | os.O_APPEND) == errno.EROFS
    assert m.tracebacks() == []
