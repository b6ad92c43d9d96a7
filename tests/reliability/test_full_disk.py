"""A full disk: ENOSPC for writes, deletions and sweeps still work, and writes come back.

The store lives on a small tmpfs made by the test (`mount -t tmpfs -o size=64m`, always
unmounted in teardown), so sqlite and the large tier hit ENOSPC as they would on a real
full disk. The disk is filled through the store itself (no resizing, no filler file):
what frees it again is deleting what was stored, and sweeping.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

FS_SIZE = "64m"
FILE_SIZE = 3 << 20  # each a large object (past the threshold and the mount's memory)
MAX_FILES = 200  # far more than fit: the loop ends at the first ENOSPC

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs, unmounted (lazily if something still holds it) whatever happened."""
    where = tmp_path / "small-fs"
    where.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={FS_SIZE},mode=0700", "tmpfs", str(where)],
        check=True,
        capture_output=True,
    )
    try:
        yield where
    finally:
        done = subprocess.run(["umount", str(where)], capture_output=True, check=False)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def content(i: int) -> bytes:
    """FILE_SIZE bytes no other i shares (so nothing dedups)."""
    seed = hashlib.sha256(b"full-disk %d" % i).digest()
    return (seed * (FILE_SIZE // len(seed) + 1))[:FILE_SIZE]


def write_file(path: Path, data: bytes) -> None:
    """open, write in 1 MiB pieces, close: the errno of whichever step refused."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for off in range(0, len(data), 1 << 20):
            os.write(fd, data[off : off + (1 << 20)])
    finally:
        os.close(fd)


def control(mnt: Path, line: str) -> None:
    with open(mnt / ".alkfs" / "control", "w") as f:
        f.write(line + "\n")


def status(mnt: Path) -> dict:
    return json.loads((mnt / ".alkfs" / "status").read_text())


def fill(pins: Path, prefix: str) -> tuple[list[str], OSError]:
    """Write large files into `pins` until one is refused: the names stored, the refusal."""
    names: list[str] = []
    for i in range(MAX_FILES):
        name = f"{prefix}-{i}"
        try:
            write_file(pins / name, content(i))
        except OSError as exc:
            return names, exc
        names.append(name)
    raise AssertionError(f"{MAX_FILES} files of {FILE_SIZE} bytes fit in {FS_SIZE}")


def test_full_disk_through_the_mount(small_fs: Path, start_mount) -> None:
    store = small_fs / "store"
    m = start_mount(store, "--window", "0")
    pins = m.path("pins")
    # Before the disk fills: a small object pinned by an extended attribute.
    (m.path("objects", "sha256") / "x").write_bytes(b"pinned by an xattr\n")
    small = hashlib.sha256(b"pinned by an xattr\n").hexdigest()
    small_path = m.path("objects", "sha256", small)
    os.setxattr(small_path, "user.alkfs.pin.keep", b"")

    names, refused = fill(pins, "fill")
    assert refused.errno == errno.ENOSPC, refused
    assert len(names) >= 3
    failed = f"fill-{len(names)}"

    # Nothing partial: the refused file is neither pinned nor stored, nothing is corrupt.
    listed = set(os.listdir(pins))
    assert failed not in listed
    assert set(names) <= listed
    half = hashlib.sha256(content(len(names))).hexdigest()
    assert not os.path.exists(m.path("objects", "sha256", half))
    control(m.mnt, "verify")
    assert status(m.mnt)["corrupt"] == []
    assert os.listdir(store / "large" / ".staging") == []

    # Reads of what is stored are unaffected.
    for i in (0, len(names) - 1):
        assert (pins / f"fill-{i}").read_bytes() == content(i)
    assert small_path.read_bytes() == b"pinned by an xattr\n"

    # While the disk is full, new objects are refused up front, with the same errno.
    for name, data in (("again", content(9999)), ("tiny", b"a few bytes\n")):
        with pytest.raises(OSError) as caught:
            write_file(pins / name, data)
        assert caught.value.errno == errno.ENOSPC
        assert name not in os.listdir(pins)

    # A restart does not wedge it: the store reopens still full, and deleting works.
    m.restart()
    with pytest.raises(OSError) as caught:
        write_file(pins / "after-restart", content(5000))
    assert caught.value.errno == errno.ENOSPC

    # What a full disk leaves possible: removing an xattr pin, making and removing a
    # repository, unpinning, sweeping.
    os.removexattr(small_path, "user.alkfs.pin.keep")
    os.mkdir(m.path("repos", "scratch-repo"))
    os.rmdir(m.path("repos", "scratch-repo"))
    for name in names:
        os.unlink(pins / name)
    assert os.listdir(pins) == []
    control(m.mnt, "sweep")  # stages the unreferenced objects (window 0)
    control(m.mnt, "sweep")  # deletes them
    assert status(m.mnt)["last_sweep"]["deleted"] >= len(names)

    # Space is back (nothing was resized): writes succeed again.
    write_file(pins / "back", content(7000))
    assert (pins / "back").read_bytes() == content(7000)
    more, refused_again = fill(pins, "refill")
    assert refused_again.errno == errno.ENOSPC
    assert len(more) >= 2

    log = m.all_logs()
    assert log.count("disk full:") >= 2, log
    assert "disk no longer full:" in log, log
    assert m.tracebacks() == [], "\n".join(m.tracebacks())
    assert "database or disk is full" not in "".join(
        line for line in log.splitlines() if "unexpected" in line
    )


def cli(store: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-X", "dev", "-bb", "-m", "alkfs.cli", "--store", str(store), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in ("ALKFS_MOUNT", "ALKFS_STORE")},
    )


def test_cli_put_on_a_full_disk(small_fs: Path, tmp_path: Path) -> None:
    store = small_fs / "store"
    files = tmp_path / "files"
    files.mkdir()
    pinned: list[str] = []
    refusal = None
    for i in range(MAX_FILES):
        src = files / f"f{i}"
        src.write_bytes(content(i))
        done = cli(store, "put", "--pin", f"p{i}", str(src))
        src.unlink()
        if done.returncode != 0:
            refusal = done
            break
        pinned.append(f"p{i}")
    assert refusal is not None, f"{MAX_FILES} files of {FILE_SIZE} bytes fit in {FS_SIZE}"
    assert len(pinned) >= 3

    small = files / "small"
    small.write_bytes(b"a small object, for the kv tier\n")
    big = files / "big"
    big.write_bytes(content(12345))
    for done in (refusal, cli(store, "put", str(big)), cli(store, "put", str(small))):
        lines = done.stderr.splitlines()
        assert done.returncode == 1, done
        assert len(lines) == 1, done.stderr
        assert "no space" in lines[0].lower(), lines[0]
        assert "unexpected" not in lines[0] and "Traceback" not in done.stderr, lines[0]
        assert done.stdout == ""

    # Deleting works on the full disk, and frees it.
    for name in pinned:
        done = cli(store, "unpin", name)
        assert done.returncode == 0, done.stderr
    for _ in range(2):
        done = cli(store, "sweep", "--window", "0")
        assert done.returncode == 0, done.stderr
    done = cli(store, "put", str(big))
    assert done.returncode == 0, done.stderr
    done = cli(store, "verify")
    assert done.returncode == 0, done.stderr


def test_kv_only_store_fills_and_recovers(small_fs: Path) -> None:
    """Small objects fill the sqlite file itself: SQLITE_FULL is NoSpace, deleting and
    sweeping work, and the pages they free inside store.db count as space again."""
    from alkfs.app import Alkfs
    from alkfs.errors import NoSpace

    store = small_fs / "store"
    size = 100_000  # under the kv-only threshold
    names: list[str] = []
    with Alkfs.open(store, mode="kv-only", window_s=0) as app:
        with pytest.raises(NoSpace):
            for i in range(2000):
                data = hashlib.sha256(b"kv %d" % i).digest() * (size // 32)
                result = app.store.put(data)
                try:
                    app.pins.pin(f"kv-{i}", result.key)
                finally:
                    result.pin.release()
                names.append(f"kv-{i}")
        assert len(names) >= 10
        with pytest.raises(NoSpace):  # refused up front while the disk is full
            app.store.add(b"a few bytes")
        for name in names:
            app.pins.unpin(name)
        app.store.sweep()
        report = app.store.sweep()
        assert report.aborted is None and report.deleted >= len(names)
        key = app.store.add(b"stored again after the sweep")
        assert app.store.get(key) == b"stored again after the sweep"
        for i in range(5):  # the freed pages take new small objects
            app.store.add(hashlib.sha256(b"again %d" % i).digest() * (size // 32))
        assert app.store.verify() == []


def test_a_locked_database_is_ebusy_in_one_line(start_mount, tmp_path: Path) -> None:
    """sqlite's "database is locked" (another connection holds the write lock past the
    5 s busy timeout) is EBUSY with one log line, not EIO with a traceback."""
    import pysqlite3.dbapi2 as sqlite3

    m = start_mount(tmp_path / "store", "--window", "0")
    obj = m.path("objects", "sha256") / "x"
    obj.write_bytes(b"to be pinned\n")
    target = m.path("objects", "sha256", hashlib.sha256(b"to be pinned\n").hexdigest())
    holder = sqlite3.connect(tmp_path / "store" / "store.db", isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(OSError) as caught:
            os.setxattr(target, "user.alkfs.pin.held", b"")
        assert caught.value.errno == errno.EBUSY
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    os.setxattr(target, "user.alkfs.pin.held", b"")  # and it works once the lock is gone
    assert "held" in os.listdir(m.path("pins"))
    lines = [line for line in m.log().splitlines() if "errno=EBUSY" in line]
    assert len(lines) == 1 and "database is locked" in lines[0], m.log()
    assert m.tracebacks() == [], "\n".join(m.tracebacks())


def metrics(mnt: Path) -> dict[str, float]:
    """The unlabelled samples of MNT/.alkfs/metrics."""
    out = {}
    for line in (mnt / ".alkfs" / "metrics").read_text().splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


def test_disk_full_in_status_and_metrics(small_fs: Path, start_mount) -> None:
    """`disk_full` and `reserve` in /.alkfs/status, alkfs_disk_full and alkfs_reserve_bytes
    in /.alkfs/metrics: false with the reserve held, true once a write found the disk full
    (the reserve given back), false again with the reserve back once a sweep freed space."""
    from alkfs.reserve import reserve_size

    fs = os.statvfs(small_fs)
    size = reserve_size(fs.f_blocks * fs.f_frsize)
    assert size == 8 << 20  # (64 MiB: the 8 MiB floor)
    m = start_mount(small_fs / "store", "--window", "0")
    st = status(m.mnt)
    assert st["disk_full"] is False
    assert st["reserve"]["size"] == size and st["reserve"]["held"] is True
    assert st["reserve"]["free_bytes"] > 2 * size
    assert metrics(m.mnt)["alkfs_disk_full"] == 0
    assert metrics(m.mnt)["alkfs_reserve_bytes"] == size

    names, refused = fill(m.path("pins"), "fill")
    assert refused.errno == errno.ENOSPC
    for _ in range(2):  # and it stays so: a refused write changes nothing
        st = status(m.mnt)
        assert st["disk_full"] is True, st
        assert (st["reserve"]["size"], st["reserve"]["held"]) == (size, False)
        assert st["reserve"]["free_bytes"] < 2 * size
        got = metrics(m.mnt)
        assert (got["alkfs_disk_full"], got["alkfs_reserve_bytes"]) == (1, 0)
        with pytest.raises(OSError) as caught:
            write_file(m.path("pins", "tiny"), b"a few bytes\n")
        assert caught.value.errno == errno.ENOSPC
    assert m.log().count("disk full:") == 1, m.log()

    for name in names:
        os.unlink(m.path("pins", name))
    control(m.mnt, "sweep")  # stages (window 0)
    control(m.mnt, "sweep")  # deletes: the reserve is made again
    assert status(m.mnt)["last_sweep"]["deleted"] == len(names)
    st = status(m.mnt)
    assert st["disk_full"] is False, st
    assert st["reserve"]["size"] == size and st["reserve"]["held"] is True
    assert st["reserve"]["free_bytes"] >= size
    got = metrics(m.mnt)
    assert (got["alkfs_disk_full"], got["alkfs_reserve_bytes"]) == (0, size)
    assert m.log().count("disk no longer full:") == 1, m.log()
    write_file(m.path("pins", "back"), b"stored again\n")
    assert (m.path("pins", "back")).read_bytes() == b"stored again\n"
    assert m.tracebacks() == [], "\n".join(m.tracebacks())


def write_until_refused(fd: int, start: int = 0) -> OSError:
    """Write 1 MiB pieces from `start` until a write (or the close) is refused."""
    piece = os.urandom(1 << 20)
    for i in range(200):  # (far more than the 64 MiB disk holds)
        try:
            os.pwrite(fd, piece, start + i * len(piece))
        except OSError as exc:
            return exc
    raise AssertionError("200 MiB fit on a 64 MiB disk")


@pytest.mark.parametrize("where", ["scratch", "spool"])
def test_scratch_and_spool_writes_are_enospc_and_give_the_reserve_back(
    small_fs: Path, start_mount, where: str
) -> None:
    """A git scratch file (tmp_obj_* in /git/sha1) and a /pins file rewritten (its bytes
    go to the spool file) filling the disk: ENOSPC (not EIO), the store's reserve given
    back (`disk_full`), and once the file is gone a sweep ends the state."""
    m = start_mount(small_fs / "store", "--window", "0")
    before = status(m.mnt)
    assert before["disk_full"] is False and before["reserve"]["held"] is True
    if where == "scratch":
        path = m.path("git", "sha1", "tmp_obj_fill")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        refused = write_until_refused(fd)
    else:
        path = m.path("pins", "rewritten")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.pwrite(fd, b"x" * (2 << 20), 0)  # past the writer's memory: streamed to a put
        os.pwrite(fd, b"y" * (1 << 20), 0)  # written again: the spool file holds it now
        refused = write_until_refused(fd, 2 << 20)
    try:
        os.close(fd)
    except OSError as exc:  # (the spool's refusal may come at the close)
        refused = exc
    assert refused.errno == errno.ENOSPC, refused
    assert m.log().count("disk full:") == 1, m.log()[-3000:]  # (the reserve given back)
    if where == "scratch":
        assert status(m.mnt)["disk_full"] is True  # (until the file goes and a sweep looks)
        os.unlink(path)
    else:  # (the close's put was refused, which looked again: the spool file was gone)
        assert "rewritten" not in os.listdir(m.path("pins"))  # (nothing partial stored)
    control(m.mnt, "sweep")
    after = status(m.mnt)
    assert after["disk_full"] is False and after["reserve"]["held"] is True
    (m.path("pins") / "after").write_bytes(b"writes work again\n")
    assert (m.path("pins") / "after").read_bytes() == b"writes work again\n"
    assert m.tracebacks() == []


def test_a_full_disk_drops_the_derived_packs_first(small_fs: Path, start_mount, tmp_path) -> None:
    """Derived data goes first (docs/operations.md, "A full disk"): the write that finds the
    disk full withdraws the published packs (their objects are served loose, git keeps
    reading them), their files go once nobody holds them, no build runs while the disk is
    full, and once space is back `repack` publishes a set again. (A store whose kv keeps
    every object, ALKFS_DRAIN=0: packs that are the only copy of their objects are not
    dropped, tests/git/test_drain.py.)"""
    from helpers import git

    src = tmp_path / "src.git"
    git("init", "-q", "--bare", "-b", "main", str(src))
    out = []
    for i in range(20):
        out.append("commit refs/heads/main\n")
        out.append(f"committer C O Mitter <c@example.com> {1700000000 + i} +0000\n")
        out.append(f"data 10\ncommit {i:02d}\n")
        data = "".join(f"line {k}, version {i}\n" for k in range(200))
        out.append(f"M 100644 inline f{i % 3}.txt\ndata {len(data)}\n{data}\n")
    git(f"--git-dir={src}", "fast-import", "--quiet", input="".join(out).encode())

    def all_objects(git_dir: Path) -> list[str]:
        listed = git(f"--git-dir={git_dir}", "rev-list", "--objects", "--all").stdout
        return sorted(line.split()[0] for line in listed.decode().splitlines())

    objects = all_objects(src)

    store = small_fs / "store"
    # (the intake looks every 0.2 s and builds whatever is new after 0.5 s: while the
    # disk is full it must not)
    m = start_mount(
        store,
        "--window",
        "0",
        env={"ALKFS_PACK_POLL": "0.2", "ALKFS_PACK_EVERY": "0.5", "ALKFS_DRAIN": "0"},
    )
    os.mkdir(m.path("repos", "r"))
    git(f"--git-dir={src}", "push", "-q", str(m.path("repos", "r")), "main")
    control(m.mnt, "repack")
    packs = status(m.mnt)["packs"]["sha1"]
    assert packs["objects"] == len(objects)
    gen_dir = store / "derived" / "sha1" / f"gen-{packs['generation']}"
    assert list((gen_dir / "pack").glob("*.pack"))

    names, refused = fill(m.path("pins"), "fill")
    assert refused.errno == errno.ENOSPC, refused

    packs = status(m.mnt)["packs"]["sha1"]
    assert (packs["objects"], packs["packs"]) == (0, 0), packs
    assert "disk is full" in packs["last_error"]
    deadline = time.monotonic() + 60  # (a bounded wait: the retire grace, then a poll)
    while gen_dir.exists():
        assert time.monotonic() < deadline, f"{gen_dir} was not removed"
        time.sleep(0.1)
    # git reads every object, now loose, through the mount
    assert all_objects(m.path("repos", "r")) == objects
    assert "packs withdrawn" in m.all_logs()
    # no build while the disk is full (the intake would have tried twice by now)
    time.sleep(1.5)
    packs = status(m.mnt)["packs"]["sha1"]
    assert packs["objects"] == 0 and "disk is full" in packs["last_error"], packs

    for name in names:
        os.unlink(m.path("pins", name))
    control(m.mnt, "sweep")
    control(m.mnt, "sweep")
    assert not status(m.mnt)["disk_full"]
    control(m.mnt, "repack")
    packs = status(m.mnt)["packs"]["sha1"]
    assert packs["objects"] > 0 and packs["last_error"] is None, packs
    assert m.tracebacks() == [], "\n".join(m.tracebacks())
