"""Pins written through a real mount: `cp`, `cp -r`, `rsync` and `dd` into /pins store and
pin on close (the entry is then a regular file of the pin: its object's bytes, the mode and
time it was given), `ln -s`, `rm` and `mv` pin, unpin and rename, setfattr/getfattr pin and
unpin (EEXIST for a name taken, EINVAL for a name outside the xattr form's pattern, ENODATA
for no such pin, EPERM for a read-only attribute), and a sweep loop racing writers never
loses a pinned object. (Directories of pins: test_pins_tree.py.)"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import helpers
import pytest
from helpers import os_errno, sha, sweep, write_close

SMALL = b"pin me, a small file\n"
LARGE = bytes(range(256)) * 800  # 204800 bytes: the large tier
STREAMED = bytes(range(251)) * 12_000  # ~3 MiB: streamed into the put
OTHER = b"another object\n"
PIN_X = b"user.alkfs.pin."


def run(*args: str | os.PathLike[str], cwd: Path | None = None) -> str:
    return helpers.run(*args, cwd=cwd, timeout=300)


def link_of(data: bytes) -> str:
    """How `pins` shows a pin made by `ln -s` or setfattr: its link's target."""
    return f"../objects/sha256/{sha(data)}"


def file_of(data: bytes) -> str:
    """How `pins` shows a pin written as a file: its key."""
    return f"file sha256/{sha(data)}"


def pins(m) -> dict[str, str]:
    """name -> a link's target, or `file <key>` for a regular file (its size that of its
    object, its key in user.alkfs.key)."""
    out = {}
    for name in sorted(os.listdir(m.path("pins"))):
        path = m.path("pins", name)
        if path.is_symlink():
            out[name] = os.readlink(path)
            continue
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode), f"{name}: {st}"
        key = os.getxattr(path, "user.alkfs.key").decode()
        assert st.st_size == int(os.getxattr(m.path("objects", key), "user.alkfs.size"))
        out[name] = f"file {key}"
    return out


def serves(m, data: bytes) -> None:
    """The daemon serves normally: an object reads back exactly."""
    assert m.path("objects", "sha256", sha(data)).read_bytes() == data


def store_object(m, data: bytes) -> Path:
    write_close(m.path("objects", "sha256", f"new-{os.urandom(4).hex()}"), data)
    return m.path("objects", "sha256", sha(data))


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir(mode=0o755)
    src.chmod(0o755)  # rsync -a / cp -a copy the directory's mode onto /pins (0755)
    (src / "small.txt").write_bytes(SMALL)
    (src / "large.bin").write_bytes(LARGE)
    (src / "streamed.bin").write_bytes(STREAMED)
    return src


EXPECTED = {
    "large.bin": file_of(LARGE),
    "small.txt": file_of(SMALL),
    "streamed.bin": file_of(STREAMED),
}


def check_pinned_files(m, names: list[str]) -> None:
    out = run("sha256sum", *(m.path("pins", n) for n in names))
    data = {"small.txt": SMALL, "large.bin": LARGE, "streamed.bin": STREAMED}
    assert out == "".join(f"{sha(data[n])}  {m.path('pins', n)}\n" for n in names)


# -- writing files into /pins ------------------------------------------------------------------


def test_cp_into_pins_stores_and_pins_and_the_entry_is_the_pinned_file(mount, sources):
    m = mount
    data = {"small.txt": SMALL, "large.bin": LARGE, "streamed.bin": STREAMED}
    for name in ("small.txt", "large.bin", "streamed.bin"):
        run("cp", sources / name, m.path("pins", name))
        # the entry of the file just written is the pin's: a regular file of its size
        line = run("ls", "-l", m.path("pins", name))
        assert line.startswith("-rw-r--r-- 1 "), line
        assert f" {len(data[name])} " in line and line.rstrip("\n").endswith(name), line
    assert pins(m) == EXPECTED
    check_pinned_files(m, ["large.bin", "small.txt", "streamed.bin"])
    obj = m.path("objects", "sha256", sha(STREAMED))
    assert os.getxattr(obj, "user.alkfs.pins") == b"streamed.bin"
    assert m.tracebacks() == []


def test_a_small_file_closed_while_sqlite_is_locked_elsewhere_waits_off_the_loop(start_mount):
    """A small file's commit the write-behind does not take runs in a worker thread:
    with sqlite's write lock held by another connection it waits the lock out, the
    mount answers other requests meanwhile, and the pin lands. (Without the intents log:
    with it, a close waits for no commit at all; tests/reliability/test_intents.py has
    the log's own tests.)"""
    m = start_mount(env={"ALKFS_INTENTS": "off"})
    if m.database is not None:
        pytest.skip("a sqlite store's write lock (a PostgreSQL store never commits inline)")
    import pysqlite3.dbapi2 as sqlite3

    write_close(m.path("pins", "first.txt"), OTHER)  # (the first put looks at the disk)
    other = sqlite3.connect(m.store_path / "store.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    done: list[BaseException | None] = []

    def writer() -> None:
        try:
            write_close(m.path("pins", "locked.txt"), SMALL)
            done.append(None)
        except BaseException as exc:
            done.append(exc)

    t = threading.Thread(target=writer)
    try:
        t.start()
        deadline = time.monotonic() + 30
        while "locked.txt" not in os.listdir(m.path("pins")):  # created, being closed
            assert time.monotonic() < deadline and not done, done
            time.sleep(0.01)
        # the mount answers while the close waits for the lock (in a worker thread),
        # and the close reports no error
        assert m.path("pins", "first.txt").read_bytes() == OTHER
        assert os_errno(os.lstat, m.path("pins", "absent.txt")) == errno.ENOENT
        assert done == []  # the close cannot have committed: the lock is still held
    finally:
        other.execute("ROLLBACK")
        other.close()
        t.join(60)
    assert done == [None]
    assert pins(m)["locked.txt"] == file_of(SMALL)
    assert m.path("pins", "locked.txt").read_bytes() == SMALL
    assert m.tracebacks() == []


def test_cp_r_into_pins_pins_every_file(mount, sources):
    m = mount
    run("cp", "-r", f"{sources}/.", m.path("pins"))
    assert pins(m) == EXPECTED
    check_pinned_files(m, sorted(EXPECTED))


def test_small_files_written_into_pins_are_backfilled_into_the_database_file(mount, tmp_path):
    """The write-behind applies small files many to a transaction and, every
    BACKFILL_COMMITS of them, copies the WAL into the database file beside them
    (alkfs/writebehind.py, alkfs/db/sqlite.py): without it nothing would have
    checkpointed yet, and store.db would keep its first size."""
    m = mount
    if m.database is not None:
        pytest.skip("PostgreSQL: the server checkpoints its own log")
    db = m.store_path / "store.db"
    src = tmp_path / "many"
    src.mkdir()
    rng = random.Random(7)
    for i in range(300):
        (src / f"f{i:03d}").write_bytes(rng.randbytes(2048))
    before = db.stat().st_size
    run("cp", "-r", f"{src}/.", m.path("pins"))
    deadline = time.monotonic() + 30
    while db.stat().st_size < before + 256 * 2048 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert db.stat().st_size >= before + 256 * 2048, (before, db.stat().st_size)
    assert len([p for p in os.listdir(m.path("pins")) if p.startswith("f")]) == 300


def _getxattr_refusals(m) -> int:
    text = m.path(".alkfs", "metrics").read_text()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("alkfs_fuse_errors_total{") and 'op="getxattr"' in line
    )


def test_writes_into_pins_and_objects_cost_no_xattr_round_trip(mount, tmp_path):
    """A write-only open of a file being written uses direct I/O: the kernel's cached
    write path asks for security.capability before every write (answered EOPNOTSUPP,
    counted in the metrics), one request more per small file than the floor pays."""
    m = mount
    src = tmp_path / "many"
    src.mkdir()
    for i in range(20):
        (src / f"f{i:02d}").write_bytes(b"file %d\n" % i * (i + 1))
    before = _getxattr_refusals(m)
    run("cp", "-r", f"{src}/.", m.path("pins"))
    run("cp", "-r", f"{src}/.", m.path("objects", "sha256"))
    with open(m.path("pins", "several-writes"), "wb") as f:
        for i in range(5):
            f.write(b"chunk %d\n" % i)
            f.flush()
    assert _getxattr_refusals(m) == before
    assert sorted(p for p in os.listdir(m.path("pins")) if p.startswith("f")) == [
        f"f{i:02d}" for i in range(20)
    ]
    assert m.path("pins", "several-writes").read_bytes() == b"".join(
        b"chunk %d\n" % i for i in range(5)
    )


def test_the_kernel_is_not_given_default_permissions_so_a_create_keeps_the_dir_attrs(mount):
    """The daemon makes every permission decision (access.py), shared mount or not:
    with default_permissions the kernel dropped the directory's attributes at every
    create and asked for them again before the next name (one GETATTR a new file)."""
    m = mount
    mnt = os.path.abspath(m.mnt)
    options = [
        line.split()[3].split(",")
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if line.split()[1] == mnt
    ]
    assert options and "default_permissions" not in options[-1], options
    # root still may do what the nodes allow, and only that
    write_close(m.path("pins", "mine.txt"), SMALL)
    assert os.access(m.path("pins", "mine.txt"), os.R_OK)
    assert os_errno(os.open, m.path("objects", "sha256", sha(SMALL)), os.O_WRONLY) == errno.EPERM
    assert m.tracebacks() == []


def test_a_file_opened_read_write_can_be_written_through_a_shared_mapping(mount):
    """Only write-only opens bypass the page cache: a direct-I/O file cannot be mapped
    shared (ENODEV), and a program writing through mmap opens read-write."""
    import mmap

    m = mount
    data = bytes(range(256)) * 16
    fd = os.open(m.path("pins", "mapped"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, len(data))
        with mmap.mmap(fd, len(data), flags=mmap.MAP_SHARED) as mapped:
            mapped[:] = data
            mapped.flush()
    finally:
        os.close(fd)
    assert pins(m) == {"mapped": file_of(data)}
    assert m.path("pins", "mapped").read_bytes() == data


def test_rsync_into_pins_writes_a_temporary_name_then_renames_it_to_the_pin(mount, sources):
    m = mount
    run("rsync", "-a", f"{sources}/", m.path("pins"))
    assert pins(m) == EXPECTED  # no temporary left behind
    check_pinned_files(m, sorted(EXPECTED))
    (sources / "small.txt").write_bytes(OTHER)  # an update replaces the pin
    run("rsync", "-a", f"{sources}/", m.path("pins"))
    assert pins(m) == {**EXPECTED, "small.txt": file_of(OTHER)}
    assert m.path("pins", "small.txt").read_bytes() == OTHER


def test_dd_through_pins_pins_the_written_bytes(mount):
    m = mount
    payload = STREAMED + LARGE
    done = subprocess.run(
        ["dd", f"of={m.path('pins', 'dd.bin')}", "bs=64k", "status=none"],
        input=payload,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert pins(m) == {"dd.bin": file_of(payload)}
    assert run("sha256sum", m.path("pins", "dd.bin")).split()[0] == sha(payload)


def test_a_temporary_renamed_to_a_name_is_pinned_and_one_unlinked_keeps_nothing(mount):
    """The rsync pattern by hand: `.NAME.XXXXXX` written and closed is a pin like any
    other, with the mode and times rsync gives it; renamed to NAME it is the pin NAME;
    unlinked it leaves no pin, and the object goes with the next sweeps."""
    m = mount
    tmp = m.path("pins", ".kept.a1B2c3")
    write_close(tmp, SMALL)
    st = os.lstat(tmp)
    assert (oct(st.st_mode & 0o170000), st.st_size) == (oct(0o100000), len(SMALL))
    assert tmp.read_bytes() == SMALL
    os.chmod(tmp, 0o600)  # rsync sets the mode and times of its temporary
    os.utime(tmp, (1_000_000, 1_000_000))
    assert os.listdir(m.path("pins")) == [".kept.a1B2c3"]
    os.rename(tmp, m.path("pins", "kept"))
    assert pins(m) == {"kept": file_of(SMALL)}
    st = os.lstat(m.path("pins", "kept"))
    assert (stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (0o600, 1_000_000 * 10**9)

    dropped = m.path("pins", ".dropped.x9Y8z7")
    write_close(dropped, OTHER)
    os.unlink(dropped)
    assert pins(m) == {"kept": file_of(SMALL)}
    assert sweep(m)["candidates_staged"] == 1  # OTHER, nothing keeps it
    assert sweep(m)["deleted"] == 1
    assert not m.path("objects", "sha256", sha(OTHER)).exists()
    serves(m, SMALL)


def test_a_temporary_renamed_over_a_pin_replaces_it(mount):
    m = mount
    write_close(m.path("pins", "doc"), SMALL)
    write_close(m.path("pins", ".doc.tmp"), OTHER)
    os.rename(m.path("pins", ".doc.tmp"), m.path("pins", "doc"))
    assert pins(m) == {"doc": file_of(OTHER)}
    assert m.path("pins", "doc").read_bytes() == OTHER


def test_a_name_in_pins_is_written_once(mount):
    """A pin is not a file to overwrite: `cp` onto it is a write open of it (EPERM), an
    exclusive create is EEXIST; `rm` first, then write."""
    m = mount
    write_close(m.path("pins", "once"), SMALL)
    assert os_errno(write_close, m.path("pins", "once"), OTHER) == errno.EEXIST
    assert os_errno(os.open, m.path("pins", "once"), os.O_WRONLY | os.O_TRUNC) == errno.EPERM
    os.unlink(m.path("pins", "once"))
    write_close(m.path("pins", "once"), OTHER)
    assert pins(m) == {"once": file_of(OTHER)}


def test_a_new_file_whose_name_was_pinned_meanwhile_fails_with_eexist(mount):
    m = mount
    obj = store_object(m, OTHER)
    fd = os.open(m.path("pins", "race"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, SMALL)
        os.setxattr(obj, PIN_X + b"race", b"")
    finally:
        with pytest.raises(OSError) as caught:
            os.close(fd)
    assert caught.value.errno == errno.EEXIST
    assert pins(m) == {"race": link_of(OTHER)}
    # the refused content and its pin are one transaction: nothing of it was stored
    assert not m.path("objects", "sha256", sha(SMALL)).exists()


# -- ln -s, rm, mv ------------------------------------------------------------------------------


def test_ln_s_pins_an_object_and_refuses_bad_targets_names_and_taken_names(mount):
    m = mount
    store_object(m, SMALL)
    run("ln", "-s", link_of(SMALL), m.path("pins", "linked"))
    assert pins(m) == {"linked": link_of(SMALL)}
    absolute = str(m.path("objects", "sha256", sha(SMALL)))
    os.symlink(absolute, m.path("pins", "absolute"))  # the same object, through this mount
    assert pins(m)["absolute"] == link_of(SMALL)
    cases = [
        (link_of(OTHER), "missing", errno.EINVAL),  # an object not stored
        ("/etc/passwd", "outside", errno.EINVAL),  # not an object path
        ("../objects/sha256/abc", "short", errno.EINVAL),
        ("../objects/nope/" + sha(SMALL), "algo", errno.EINVAL),
        ("../objects/sha256/" + sha(SMALL) + "/x", "deeper", errno.EINVAL),
        (link_of(SMALL), "linked", errno.EEXIST),
    ]
    for target, name, code in cases:
        assert os_errno(os.symlink, target, m.path("pins", name)) == code, name
        serves(m, SMALL)
    assert sorted(pins(m)) == ["absolute", "linked"]


def test_rm_unpins_and_a_missing_pin_is_enoent(mount):
    m = mount
    write_close(m.path("pins", "gone"), SMALL)
    run("rm", m.path("pins", "gone"))
    assert pins(m) == {}
    assert os.getxattr(m.path("objects", "sha256", sha(SMALL)), "user.alkfs.pins") == b""
    assert os_errno(os.unlink, m.path("pins", "gone")) == errno.ENOENT
    serves(m, SMALL)


def test_mv_renames_a_pin_and_over_an_existing_pin_replaces_it(mount):
    m = mount
    write_close(m.path("pins", "a"), SMALL)
    write_close(m.path("pins", "b"), OTHER)
    run("mv", m.path("pins", "a"), m.path("pins", "c"))
    assert pins(m) == {"b": file_of(OTHER), "c": file_of(SMALL)}
    assert m.path("pins", "c").read_bytes() == SMALL  # the moved entry resolves at once
    run("mv", m.path("pins", "c"), m.path("pins", "b"))
    assert pins(m) == {"b": file_of(SMALL)}
    assert m.path("pins", "b").read_bytes() == SMALL
    run("mv", m.path("pins", "b"), m.path("pins", ".hidden b"))  # (any file name)
    assert os_errno(os.rename, m.path("pins", "nope"), m.path("pins", "x")) == errno.ENOENT
    outside = m.path("objects", "sha256", "x")
    assert os_errno(os.rename, m.path("pins", ".hidden b"), outside) == errno.EXDEV
    assert pins(m) == {".hidden b": file_of(SMALL)}
    serves(m, SMALL)


# -- extended attributes ------------------------------------------------------------------------


def test_setfattr_pins_and_unpins_with_the_errnos_of_the_spec(mount):
    m = mount
    obj = store_object(m, SMALL)
    other = store_object(m, OTHER)
    run("setfattr", "-n", "user.alkfs.pin.release-1", obj)
    assert pins(m) == {"release-1": link_of(SMALL)}
    assert os.getxattr(obj, "user.alkfs.pins") == b"release-1"
    assert os.getxattr(obj, "user.alkfs.pin.release-1").endswith(b"+00:00")
    assert "user.alkfs.pin.release-1" in os.listxattr(obj)
    refusals = [
        (os.setxattr, (other, "user.alkfs.pin.release-1", b""), errno.EEXIST),
        (os.setxattr, (obj, "user.alkfs.pin..bad", b""), errno.EINVAL),
        (os.setxattr, (obj, "user.alkfs.pin.", b""), errno.EINVAL),
        (os.setxattr, (obj, "user.alkfs.pin." + "x" * 129, b""), errno.EINVAL),
        (os.removexattr, (other, "user.alkfs.pin.release-1"), errno.ENODATA),
        (os.removexattr, (obj, "user.alkfs.pin.never"), errno.ENODATA),
        (os.getxattr, (other, "user.alkfs.pin.release-1"), errno.ENODATA),
        (os.setxattr, (obj, "user.alkfs.size", b"1"), errno.EPERM),
        (os.setxattr, (obj, "user.alkfs.pins", b"x"), errno.EPERM),
        (os.setxattr, (obj, "user.alkfs.algorithm", b"x"), errno.EPERM),
        (os.removexattr, (obj, "user.alkfs.tier"), errno.EPERM),
        (os.setxattr, (obj, "user.other", b"x"), errno.ENOTSUP),
        (os.setxattr, (obj, "user.alkfs.unknown", b"x"), errno.ENOTSUP),
        (os.getxattr, (obj, "user.alkfs.unknown"), errno.ENODATA),
    ]
    for fn, args, code in refusals:
        assert os_errno(fn, *args) == code, (fn.__name__, args[1:])
        serves(m, SMALL)
    run("setfattr", "-n", "user.alkfs.pin.release-1", obj)  # the same object again: no-op
    run("setfattr", "-x", "user.alkfs.pin.release-1", obj)
    assert pins(m) == {}
    assert os_errno(os.removexattr, obj, "user.alkfs.pin.release-1") == errno.ENODATA
    serves(m, OTHER)
    assert m.tracebacks() == []


def test_the_cli_puts_pins_and_unpins_through_the_mount(mount, tmp_path):
    m = mount
    alkfs = Path(sys.executable).parent / "alkfs"
    f = tmp_path / "file"
    f.write_bytes(SMALL)
    key = run(alkfs, "--mount", m.mnt, "put", "--pin", "by-cli", f).strip()
    assert key == f"sha256/{sha(SMALL)}"
    assert pins(m) == {"by-cli": file_of(SMALL)}  # (written as a file into /pins)
    f.write_bytes(OTHER)
    key = run(alkfs, "--mount", m.mnt, "put", f).strip()
    run(alkfs, "--mount", m.mnt, "pin", "again", key)
    assert pins(m) == {"again": link_of(OTHER), "by-cli": file_of(SMALL)}
    run(alkfs, "--mount", m.mnt, "unpin", "again")
    assert pins(m) == {"by-cli": file_of(SMALL)}


def test_the_cli_unpins_and_lists_a_pin_written_as_a_file_through_the_mount(mount, tmp_path):
    m = mount
    alkfs = Path(sys.executable).parent / "alkfs"
    f = tmp_path / "file"
    f.write_bytes(SMALL)
    key = run(alkfs, "--mount", m.mnt, "put", "--pin", "by-cli", f).strip()
    os.mkdir(m.path("pins", "dir"))
    (m.path("pins", "dir", "My File")).write_bytes(SMALL)  # a pin in a directory of pins
    listed = run(alkfs, "--mount", m.mnt, "pins")
    assert listed == f"by-cli {key}\ndir/My File {key}\n", listed
    assert run(alkfs, "--mount", m.mnt, "unpin", "by-cli").strip().endswith(key)
    assert run(alkfs, "--mount", m.mnt, "unpin", "dir/My File").strip().endswith(key)
    os.rmdir(m.path("pins", "dir"))  # (now empty)
    assert pins(m) == {}


# -- 2 GiB through dd ---------------------------------------------------------------------------

BLOCK = 1 << 20


def blocks(n: int):
    """A deterministic stream of `n` MiB: a seeded random MiB, each block numbered."""
    base = random.Random(0).randbytes(BLOCK)
    for i in range(n):
        yield i.to_bytes(8, "big") + base[8:]


@pytest.mark.slow
def test_a_2_gib_file_written_with_dd_through_pins_reads_back_byte_identical(mount):
    m = mount
    n = 2048
    dest = m.path("pins", "two-gib")
    dd = subprocess.Popen(
        ["dd", f"of={dest}", "bs=1M", "iflag=fullblock", "status=none"],
        stdin=subprocess.PIPE,
    )
    h = hashlib.sha256()
    assert dd.stdin is not None
    for block in blocks(n):
        h.update(block)
        dd.stdin.write(block)
    dd.stdin.close()
    assert dd.wait(timeout=300) == 0
    expected = h.hexdigest()
    assert pins(m) == {"two-gib": f"file sha256/{expected}"}
    assert os.stat(dest).st_size == n * BLOCK
    assert run("sha256sum", dest) == f"{expected}  {dest}\n"


# -- a sweep loop racing writers ----------------------------------------------------------------

RACE_S = 10.0


def test_a_sweep_loop_racing_writers_of_objects_and_pins_loses_no_pinned_object(mount):
    """With --window 0 every sweep deletes what the previous one staged. Writers store
    objects and pin them every way there is (a file in /pins, ln -s, setfattr, the
    rsync pattern) while sweeps run back to back; afterwards every pin names an object
    that is present and byte-identical. A pin of an object written unpinned may find it
    swept first (ENOENT/EINVAL): then it simply was not pinned."""
    m = mount
    deadline = time.monotonic() + RACE_S
    pinned: dict[str, bytes] = {}
    shown: dict[str, str] = {}
    errors: list[BaseException] = []
    sweeps = [0]
    lock = threading.Lock()

    def sweeper() -> None:
        try:
            while time.monotonic() < deadline:
                m.path(".alkfs", "control").write_text("sweep\n")
                sweeps[0] += 1
        except BaseException as exc:
            errors.append(exc)

    def writer(wid: int) -> None:
        rng = random.Random(wid)
        i = 0
        try:
            while time.monotonic() < deadline:
                i += 1
                size = rng.choice([17, 4096, 150_000, 1_500_000])
                data = f"writer {wid} item {i} ".encode() + rng.randbytes(size)
                name = f"w{wid}-{i}"
                way = i % 4
                if way == 0:  # a new file in /pins
                    write_close(m.path("pins", name), data)
                elif way == 1:  # the rsync pattern
                    tmp = m.path("pins", f".{name}.XXXXXX")
                    write_close(tmp, data)
                    os.rename(tmp, m.path("pins", name))
                else:  # an unpinned object, pinned afterwards (it may be swept first)
                    obj = store_object(m, data)
                    try:
                        if way == 2:
                            os.symlink(link_of(data), m.path("pins", name))
                        else:
                            os.setxattr(obj, PIN_X + name.encode(), b"")
                    except OSError as exc:
                        if exc.errno not in (errno.EINVAL, errno.ENOENT):
                            raise
                        continue
                with lock:
                    pinned[name] = data
                    shown[name] = file_of(data) if way < 2 else link_of(data)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=sweeper)]
    threads += [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=RACE_S + 120)
    assert errors == []
    assert sweeps[0] >= 2 and len(pinned) >= 8, (sweeps[0], len(pinned))
    sweep(m)
    sweep(m)
    assert pins(m) == shown
    for name, data in pinned.items():
        assert m.path("pins", name).read_bytes() == data, name
    out = run("sha256sum", *(m.path("pins", n) for n in sorted(pinned)))
    assert out == "".join(f"{sha(pinned[n])}  {m.path('pins', n)}\n" for n in sorted(pinned))
    assert m.tracebacks() == []
