"""/pins as a backup target, through real mounts and real tools: `mkdir` makes directories
of pins, any file name is a name there (spaces, dot names such as rsync's temporaries, names
that are not UTF-8, 255 bytes), a file written there is a regular file with the mode and
time its writer gave, and `tar -x`, `cp -r`, `rsync -a` keep every file, byte for byte,
across restarts and sweeps; a second `rsync -a` of the same tree transfers nothing, also of
a tree whose files belong to other users (pins keep their owner and group: root gives any, a
file's owner only its own groups); `rm -r` unpins all; renames follow rename(2); a path over
4,096 bytes is ENAMETOOLONG with nothing changed."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import helpers
import pytest
from helpers import os_errno, sha, status, sweep, write_close

from alkfs.app import Alkfs
from alkfs.pins import FileAttrs

SMALL = b"a small file\n"
LARGE = bytes(range(256)) * 800  # 204,800 bytes: the large tier
STREAMED = bytes(range(251)) * 12_000  # ~3 MiB: streamed into the put
LONG = b"n" * 255  # the longest name a component may have
LATIN = b"caf\xe9 \xe0 la cr\xe8me.txt"  # (not UTF-8)
T0 = 1_600_000_000_123_456_789  # a time with nanoseconds


def run(*args: str | os.PathLike[str], cwd: Path | None = None) -> str:
    return helpers.run(*args, cwd=cwd, timeout=300)


def make_tree(root: Path) -> dict[bytes, bytes]:
    """A tree to back up: subdirectories (one empty), odd names, both tiers, modes and
    times of every kind; its files' relative paths -> contents."""
    files = {
        b"My File.pdf": SMALL,
        b".bashrc": b"export PS1='$ '\n",
        LONG: b"a name of 255 bytes\n",
        LATIN: b"latin-1\n",
        b"docs/2026-11/report final.txt": b"the report\n" * 100,
        b"docs/2026-11/large.bin": LARGE,
        b"docs/streamed.bin": STREAMED,
        b".config/app/.x.ABCDEF": b"looks like rsync's temporary\n",
        b".config/app/empty": b"",
        b"bin/run.sh": b"#!/bin/sh\necho run\n",
    }
    broot = os.fsencode(root)
    os.makedirs(os.path.join(broot, b"empty dir"))
    for rel, data in files.items():
        path = os.path.join(broot, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    os.chmod(os.path.join(broot, b"bin/run.sh"), 0o755)
    os.chmod(os.path.join(broot, b".bashrc"), 0o600)
    for i, rel in enumerate(sorted(files)):
        t = T0 + i * 1_000_000_007
        os.utime(os.path.join(broot, rel), ns=(t, t))
    dirs = [b"docs/2026-11", b"docs", b".config/app", b".config", b"bin", b"empty dir", b""]
    for i, rel in enumerate(dirs):
        path = os.path.join(broot, rel) if rel else broot
        os.chmod(path, 0o700 if rel == b".config" else 0o755)
        t = T0 - (i + 1) * 86_400 * 10**9
        os.utime(path, ns=(t, t))
    return files


def snapshot(
    root: Path, times: bool = True, modes: bool = True, owners: bool = False
) -> dict[bytes, tuple]:
    """Every entry below `root`: its kind, content (files), mode, time and owner and
    group (as asked)."""
    out: dict[bytes, tuple] = {}
    broot = os.fsencode(root)
    for top, dirs, names in os.walk(broot):
        for name in dirs + names:
            path = os.path.join(top, name)
            rel = os.path.relpath(path, broot)
            st = os.lstat(path)
            kind = "d" if stat.S_ISDIR(st.st_mode) else "f" if stat.S_ISREG(st.st_mode) else "?"
            entry: tuple = (kind,)
            if kind == "f":
                with open(path, "rb") as f:
                    entry += (f.read(),)
            if modes:
                entry += (oct(stat.S_IMODE(st.st_mode)),)
            if times:
                entry += (st.st_mtime_ns,)
            if owners:
                entry += (st.st_uid, st.st_gid)
            out[rel] = entry
    return out


def objects(m) -> int:
    return status(m)["objects"]["sha256"]["count"]


def renameat2(old: Path, new: Path, flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd = -100
    if libc.renameat2(at_fdcwd, os.fsencode(old), at_fdcwd, os.fsencode(new), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@pytest.fixture
def src(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    root.mkdir()
    make_tree(root)
    return root


# -- the tools -------------------------------------------------------------------------------


def test_tar_x_into_pins_keeps_every_file_byte_identical_with_its_mode_and_time(
    mount, src, tmp_path
):
    m = mount
    tarball = tmp_path / "t.tar"
    run("tar", "-C", src, "--format=posix", "-cf", tarball, ".")
    run("tar", "-xf", tarball, "-C", m.path("pins"))
    want = snapshot(src)
    got = snapshot(m.path("pins"))
    assert got == want
    # each file is the pin of its object: a regular file, its key in user.alkfs.key
    report = m.path("pins", "docs", "2026-11", "report final.txt")
    key = os.getxattr(report, "user.alkfs.key").decode()
    assert key == "sha256/" + sha((src / "docs/2026-11/report final.txt").read_bytes())
    assert os.getxattr(m.path("objects", key), "user.alkfs.pins").decode() == (
        "docs/2026-11/report final.txt"
    )
    assert stat.S_ISREG(os.lstat(m.path("pins", "My File.pdf")).st_mode)
    assert m.tracebacks() == []


def test_cp_r_and_cp_a_of_a_tree_keep_every_file(mount, src):
    m = mount
    run("cp", "-r", src, m.path("pins", "plain"))
    assert snapshot(m.path("pins", "plain"), times=False, modes=False) == snapshot(
        src, times=False, modes=False
    )
    run("cp", "-a", src, m.path("pins", "archive"))
    assert snapshot(m.path("pins", "archive")) == snapshot(src)
    assert sorted(os.listdir(m.path("pins"))) == ["archive", "plain"]
    assert m.tracebacks() == []


def test_a_second_rsync_transfers_nothing_and_the_tree_survives_restarts_and_sweeps(mount, src):
    m = mount
    dest = f"{m.path('pins', 'backup')}/"
    run("rsync", "-a", f"{src}/", dest)
    assert snapshot(m.path("pins", "backup")) == snapshot(src)
    stored = objects(m)

    def again() -> str:
        out = run("rsync", "-a", "--itemize-changes", "--stats", f"{src}/", dest)
        assert "Total transferred file size: 0 bytes" in out, out
        assert "Number of regular files transferred: 0" in out, out
        return out.split("Number of files:")[0].strip()  # (what it itemized)

    assert again() == ""
    m.restart()
    for _ in range(2):
        assert sweep(m)["deleted"] == 0
    assert snapshot(m.path("pins", "backup")) == snapshot(src)
    assert again() == ""
    assert objects(m) == stored

    # a changed file: rsync's temporary `.NAME.XXXXXX` renamed over the pin replaces it
    changed = src / "docs" / "2026-11" / "report final.txt"
    changed.write_bytes(b"the report, second draft\n")
    out = run("rsync", "-a", "--itemize-changes", f"{src}/", dest)
    assert ">f" in out and "report final.txt" in out, out
    assert snapshot(m.path("pins", "backup")) == snapshot(src)
    assert not [n for n in os.listdir(m.path("pins", "backup", "docs", "2026-11")) if ".rep" in n]
    sweep(m)
    assert sweep(m)["deleted"] == 1  # the first draft: nothing pins it now
    assert again() == ""
    assert m.tracebacks() == []


def test_rm_r_unpins_everything_below_and_two_sweeps_delete_the_content(mount, src):
    m = mount
    run("rsync", "-a", f"{src}/", f"{m.path('pins', 'backup')}/")
    write_close(m.path("pins", "kept"), b"kept\n")
    stored = objects(m)
    run("rm", "-r", m.path("pins", "backup"))
    assert os.listdir(m.path("pins")) == ["kept"]
    assert status(m)["pins"] == 1
    sweep(m)
    assert sweep(m)["deleted"] == stored - 1
    assert objects(m) == 1 and m.path("pins", "kept").read_bytes() == b"kept\n"
    assert m.tracebacks() == []


def test_a_dot_name_is_an_ordinary_durable_pin_across_a_restart_and_sweeps(mount):
    """`.profile.backup` looks like rsync's temporary of `profile`: it was listed, then
    dropped at the next start and its content swept."""
    m = mount
    names = {".profile.backup": b"profile\n", ".x.ABCDEF": b"x\n", " lead space": b"sp\n"}
    os.mkdir(m.path("pins", ".dot dir"))
    for name, data in names.items():
        write_close(m.path("pins", name), data)
        write_close(m.path("pins", ".dot dir", name), data + data)
    m.restart()
    for _ in range(2):
        sweep(m)
    for name, data in names.items():
        assert m.path("pins", name).read_bytes() == data
        assert m.path("pins", ".dot dir", name).read_bytes() == data + data
    assert sorted(os.listdir(m.path("pins"))) == sorted([*names, ".dot dir"])
    assert objects(m) == 2 * len(names)


# -- names and paths ---------------------------------------------------------------------------


def test_a_path_of_more_than_4096_bytes_is_enametoolong_and_changes_nothing(mount):
    m = mount
    comp = "d" * 255
    top = os.open(m.path("pins"), os.O_RDONLY | os.O_DIRECTORY)
    fds = [top]
    try:
        os.mkdir("a", dir_fd=top)
        fds.append(os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=top))
        for _ in range(15):  # "a/ddd.../ddd": 1 + 15 * 256 = 3,841 bytes
            os.mkdir(comp, dir_fd=fds[-1])
            fds.append(os.open(comp, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
        deep = fds[-1]
        fits, over = "f" * 254, "g" * 255  # 4,096 and 4,097 bytes
        fd = os.open(fits, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=deep)
        os.write(fd, b"deepest\n")
        os.close(fd)
        pins, stored = status(m)["pins"], objects(m)

        def refused(fn, *args, **kw) -> int:
            try:
                fn(*args, **kw)
            except OSError as exc:
                return exc.errno
            return 0

        key = "sha256/" + sha(b"deepest\n")
        assert refused(os.open, over, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=deep) == (
            errno.ENAMETOOLONG
        )
        assert refused(os.mkdir, over, dir_fd=deep) == errno.ENAMETOOLONG
        assert refused(os.symlink, f"{'../' * 17}objects/{key}", over, dir_fd=deep) == (
            errno.ENAMETOOLONG
        )
        assert refused(os.rename, fits, over, src_dir_fd=deep, dst_dir_fd=deep) == (
            errno.ENAMETOOLONG
        )
        # a directory renamed longer: the deepest path below it would be 4,097 bytes
        assert refused(os.rename, "a", "ab", src_dir_fd=top, dst_dir_fd=top) == (errno.ENAMETOOLONG)
        assert os.listdir(deep) == [fits]
        assert (status(m)["pins"], objects(m)) == (pins, stored)
        assert os.listdir(m.path("pins")) == ["a"]
        with open(os.open(fits, os.O_RDONLY, dir_fd=deep), "rb") as f:
            assert f.read() == b"deepest\n"
    finally:
        for fd in reversed(fds):
            os.close(fd)
    m.restart()
    assert run("find", m.path("pins"), "-type", "f").count("\n") == 1
    assert m.tracebacks() == []


def test_names_that_are_not_utf8_are_kept_as_they_are(mount):
    m = mount
    pins = os.fsencode(m.path("pins"))
    os.mkdir(os.path.join(pins, b"r\xe9pertoire"))
    for name in (LATIN, b"\xff\xfe", "\uf7e9".encode(), b"\xe9"):
        write_close(os.path.join(pins, b"r\xe9pertoire", name), name)
    m.restart()
    listed = sorted(os.listdir(os.path.join(pins, b"r\xe9pertoire")))
    assert listed == sorted([LATIN, b"\xff\xfe", "\uf7e9".encode(), b"\xe9"])
    for name in listed:
        with open(os.path.join(pins, b"r\xe9pertoire", name), "rb") as f:
            assert f.read() == name


# -- renames, removals, links ------------------------------------------------------------------


def test_renames_and_removals_follow_the_rules_of_rename_and_rmdir(mount):
    m = mount
    p = m.path("pins")
    os.makedirs(p / "a" / "sub")
    os.mkdir(p / "empty")
    os.mkdir(p / "full")
    write_close(p / "a" / "sub" / "f", b"f\n")
    write_close(p / "full" / "g", b"g\n")
    write_close(p / "file", b"file\n")
    held = os.open(p / "a" / "sub", os.O_RDONLY | os.O_DIRECTORY)  # (a cwd inside)
    try:
        os.rename(p / "a", p / "b")  # a directory with everything below it
        assert sorted(os.listdir(p)) == ["b", "empty", "file", "full"]
        assert (p / "b" / "sub" / "f").read_bytes() == b"f\n"
        assert os.listdir(held) == ["f"]  # the inode the kernel kept is the new path
        write_close(Path(f"/proc/self/fd/{held}") / "h", b"h\n")
        assert sorted(os.listdir(p / "b" / "sub")) == ["f", "h"]
    finally:
        os.close(held)
    os.rename(p / "b" / "sub" / "h", p / "h moved")  # a pin across directories
    assert (p / "h moved").read_bytes() == b"h\n"
    os.rename(p / "b", p / "empty")  # over an empty directory
    assert sorted(os.listdir(p)) == ["empty", "file", "full", "h moved"]
    assert os_errno(os.rename, p / "empty", p / "full") == errno.ENOTEMPTY
    assert os_errno(os.rename, p / "file", p / "full") == errno.EISDIR
    assert os_errno(os.rename, p / "full", p / "file") == errno.ENOTDIR
    assert os_errno(os.rename, p / "full", p / "full" / "into") == errno.EINVAL
    assert os_errno(os.rmdir, p / "full") == errno.ENOTEMPTY
    assert os_errno(os.unlink, p / "full") in (errno.EISDIR, errno.EPERM)
    assert os_errno(os.rmdir, p / "file") == errno.ENOTDIR
    assert os_errno(renameat2, p / "file", p / "h moved", 2) == errno.EINVAL  # EXCHANGE
    assert os_errno(renameat2, p / "file", p / "w", 4) == errno.EINVAL  # WHITEOUT
    assert os_errno(renameat2, p / "file", p / "h moved", 1) == errno.EEXIST  # NOREPLACE
    renameat2(p / "file", p / "file 2", 1)
    os.rename(p / "file 2", p / "h moved")  # a pin over a pin replaces it
    assert (p / "h moved").read_bytes() == b"file\n"
    os.unlink(p / "full" / "g")
    os.rmdir(p / "full")
    assert sorted(os.listdir(p)) == ["empty", "h moved"]
    m.restart()
    assert sorted(os.listdir(p)) == ["empty", "h moved"]
    assert (p / "empty" / "sub" / "f").read_bytes() == b"f\n"
    sweep(m)
    assert sweep(m)["deleted"] == 2  # g's and h's content
    assert m.tracebacks() == []


def test_links_in_directories_name_the_object_one_level_up_each(mount):
    m = mount
    write_close(m.path("objects", "sha256", "new"), SMALL)
    hexd = sha(SMALL)
    os.makedirs(m.path("pins", "x", "y"))
    run("ln", "-s", f"../../../objects/sha256/{hexd}", m.path("pins", "x", "y", "link"))
    link = m.path("pins", "x", "y", "link")
    assert os.readlink(link) == f"../../../objects/sha256/{hexd}"
    assert link.read_bytes() == SMALL
    os.rename(m.path("pins", "x", "y"), m.path("pins", "y"))  # one level up: one `../` less
    assert os.readlink(m.path("pins", "y", "link")) == f"../../objects/sha256/{hexd}"
    # setfattr still pins at the top, as a link
    os.setxattr(m.path("objects", "sha256", hexd), "user.alkfs.pin.release-1", b"")
    assert os.readlink(m.path("pins", "release-1")) == f"../objects/sha256/{hexd}"
    # ln of a pin written as a file: the same object under another name (tar's hard links)
    write_close(m.path("pins", "x", "file"), OTHER := b"other\n")
    os.link(m.path("pins", "x", "file"), m.path("pins", "y", "hard"))
    assert m.path("pins", "y", "hard").read_bytes() == OTHER
    assert sorted(
        os.getxattr(m.path("objects", "sha256", sha(OTHER)), "user.alkfs.pins").split(b",")
    ) == [b"x/file", b"y/hard"]
    assert m.tracebacks() == []


def test_chmod_and_times_of_pins_and_directories_are_kept_across_a_restart(mount):
    m = mount
    d = m.path("pins", "dir")
    os.mkdir(d, 0o700)
    write_close(d / "f", SMALL)
    os.chmod(d / "f", 0o640)
    os.utime(d / "f", ns=(T0, T0))
    os.chmod(d, 0o751)
    os.utime(d, ns=(T0 + 1, T0 + 1))
    run("touch", "-m", "-d", "@1500000000.5", m.path("pins", "dir"))
    want = {
        "f": (0o100640, T0, len(SMALL)),
        "": (0o40751, 1_500_000_000_500_000_000, None),
    }

    def seen() -> dict[str, tuple]:
        out = {}
        for rel in ("f", ""):
            st = os.lstat(d / rel if rel else d)
            out[rel] = (st.st_mode, st.st_mtime_ns, st.st_size if rel else None)
        return out

    assert seen() == want
    assert os_errno(os.truncate, d / "f", 1) == errno.EPERM  # (a pin's content is fixed)
    m.restart()
    assert seen() == want
    assert (d / "f").read_bytes() == SMALL


# -- listing many -------------------------------------------------------------------------------


def test_a_directory_of_many_pins_lists_every_one_a_page_at_a_time(
    start_mount, store_database, tmp_path
):
    store = tmp_path / "store"
    attrs = FileAttrs(stat.S_IFREG | 0o644, T0, 0)
    with Alkfs.open(store, database=store_database(store)) as app:
        key = app.store.add(b"")
        pins = app.pins
        pins.mkdir("big", 0o755)
        pins.mkdir("big/sub", 0o755)
        for i in range(700):
            pins.pin(f"big/sub/s{i:04d}", key, attrs=attrs, tree=True)
        for i in range(1500):
            pins.pin(f"big/f{i:04d} {'x' * (i % 40)}", key, attrs=attrs, tree=True)
        for i in range(300):
            pins.pin(f"top{i:03d}", key)
    m = start_mount(store)
    big = os.listdir(m.path("pins", "big"))
    assert len(big) == 1501 and len(set(big)) == 1501 and "sub" in big
    assert len(os.listdir(m.path("pins", "big", "sub"))) == 700
    top = os.listdir(m.path("pins"))
    assert len(top) == 301 and "big" in top
    out = subprocess.run(
        ["ls", "-l", m.path("pins", "big")], capture_output=True, text=True, check=True
    ).stdout
    assert out.count("\n-rw-r--r-- ") == 1500 and out.count("\ndrwxr-xr-x ") == 1
    assert json.loads(m.path(".alkfs", "status").read_text())["pins"] == 2500
    assert m.tracebacks() == []


# -- the intents log ----------------------------------------------------------------------------


@pytest.mark.skipif(
    os.environ.get("ALKFS_TEST_DATABASE", "") == "postgresql",
    reason="the intents log is a sqlite store's (a PostgreSQL store commits each close)",
)
def test_a_file_acknowledged_ahead_of_its_commit_keeps_its_mode_and_time(start_mount, tmp_path):
    """cp -p sets the mode and times on the open file before its close; the close is
    acknowledged once its intent is logged, and the intent carries them."""
    m = start_mount(env={"ALKFS_INTENTS_GATHER_S": "60"})
    m.path("pins", "warm-up").write_bytes(b"warm-up\n")  # (the first put looks at the disk)
    os.mkdir(m.path("pins", "d"))
    source = tmp_path / "f"
    source.write_bytes(b"acknowledged\n")
    source.chmod(0o600)
    os.utime(source, ns=(T0, T0))
    run("cp", "-p", source, m.path("pins", "d", "f"))
    assert status(m)["intents"]["applied"] >= 1  # (the status waited for the commit)
    st = os.lstat(m.path("pins", "d", "f"))
    assert (st.st_mode, st.st_mtime_ns) == (0o100600, T0)
    m.restart()
    st = os.lstat(m.path("pins", "d", "f"))
    assert (st.st_mode, st.st_mtime_ns) == (0o100600, T0)
    assert m.path("pins", "d", "f").read_bytes() == b"acknowledged\n"


def test_an_object_pinned_by_many_paths_keeps_readable_bounded_xattrs(mount):
    """The empty file of a backup tree, pinned under hundreds of long paths: its xattrs
    list and read within the kernel's 64 KiB (cp -a, rsync -X, getfattr -d), naming the
    first pins, xattr-form names only in the list."""
    m = mount
    d = m.path("pins", "backup dir with a long name " + "x" * 100)
    os.mkdir(d)
    for i in range(400):
        (d / (f"an empty file with a long name number {i:04d} " + "y" * 120)).write_bytes(b"")
    (m.path("pins", "a-plain-name")).write_bytes(b"")
    obj = m.path("objects", "sha256", sha(b""))
    # (a file never written is stored at its release, which the kernel sends after the
    # close returned: a PostgreSQL store's commit may still be under way)
    deadline = time.monotonic() + 10
    while True:
        names = os.listxattr(obj)  # (E2BIG if the list were over 64 KiB)
        if "user.alkfs.pin.a-plain-name" in names or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert "user.alkfs.pin.a-plain-name" in names
    assert not any("/" in n for n in names)
    value = os.getxattr(obj, "user.alkfs.pins")
    assert len(value) <= 16 << 10 and value.endswith(b",...")
    assert subprocess.run(["getfattr", "-d", str(obj)], capture_output=True).returncode == 0


# -- owners and groups ---------------------------------------------------------------------------

OWNERS = ((1234, 5678), (65534, 65534), (0, 5678), (0, 0))  # (uid, gid): users of no account


def make_owned_tree(root: Path) -> dict[bytes, tuple[int, int]]:
    """`make_tree`, its files and directories (and `root`) given the owners and groups of
    OWNERS in turn: relative path (b"": `root`) -> (uid, gid)."""
    make_tree(root)
    broot = os.fsencode(root)
    rels = [b""]
    for top, dirs, names in os.walk(broot):
        rels += [os.path.relpath(os.path.join(top, n), broot) for n in dirs + names]
    owned = {rel: OWNERS[i % len(OWNERS)] for i, rel in enumerate(sorted(rels))}
    for rel, (uid, gid) in owned.items():
        os.lchown(os.path.join(broot, rel) if rel else broot, uid, gid)  # (times kept)
    assert os.stat(root).st_uid == 1234 and len(set(owned.values())) == len(OWNERS)
    return owned


def owner_of(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_uid, st.st_gid


def test_rsync_a_as_root_of_a_tree_owned_by_others_keeps_owners_and_sends_nothing_again(
    mount, tmp_path
):
    """rsync -a run as root sets every file's and directory's owner and group (its
    temporary's, then renamed; a directory's after its files): exit 0, and a second run,
    after a restart too, itemizes nothing and transfers nothing; tar -xp --same-owner
    (owners set on the open file) keeps them too."""
    m = mount
    src = tmp_path / "owned"
    src.mkdir()
    make_owned_tree(src)
    dest = m.path("pins", "backup")
    rsync = ("rsync", "-a", "--itemize-changes", "--stats", f"{src}/", f"{dest}/")
    run(*rsync)
    want = snapshot(src, owners=True)

    def same() -> None:
        assert snapshot(dest, owners=True) == want
        assert owner_of(dest) == owner_of(src) == OWNERS[0]
        assert owner_of(dest / "docs" / "2026-11" / "large.bin") == owner_of(
            src / "docs" / "2026-11" / "large.bin"
        )

    def again() -> None:
        out = run(*rsync)
        assert "Number of regular files transferred: 0" in out, out
        assert "Total transferred file size: 0 bytes" in out, out
        assert out.split("Number of files:")[0].strip() == "", out  # (nothing itemized)

    same()
    again()
    m.restart()
    same()
    again()
    assert sweep(m)["deleted"] == 0

    tarball = tmp_path / "owned.tar"
    run("tar", "-C", src, "--format=posix", "--numeric-owner", "-cpf", tarball, ".")
    os.mkdir(m.path("pins", "t"))
    run("tar", "-xpf", tarball, "--same-owner", "--numeric-owner", "-C", m.path("pins", "t"))
    assert snapshot(m.path("pins", "t"), owners=True) == want
    assert owner_of(m.path("pins", "t")) == OWNERS[0]
    m.restart()
    assert snapshot(m.path("pins", "t"), owners=True) == want
    assert m.tracebacks() == []


def test_an_owner_given_to_a_file_before_its_close_is_kept_by_its_intent(start_mount, tmp_path):
    """tar -xp sets the owner on the open file, before the close; the close is then
    acknowledged once its intent is logged (a sqlite store), and the intent carries the
    owner and group as it does the mode and time."""
    if os.environ.get("ALKFS_TEST_DATABASE", "") == "postgresql":
        pytest.skip("the intents log is a sqlite store's (a PostgreSQL store commits each close)")
    m = start_mount(env={"ALKFS_INTENTS_GATHER_S": "60"})
    m.path("pins", "warm-up").write_bytes(b"warm-up\n")  # (the first put looks at the disk)
    fd = os.open(m.path("pins", "f"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, b"acknowledged\n")
        os.fchown(fd, 1234, 5678)
        assert os.fstat(fd).st_uid == 1234
    finally:
        os.close(fd)
    assert owner_of(m.path("pins", "f")) == (1234, 5678)
    assert status(m)["intents"]["applied"] >= 1  # (the status waited for the commit)
    assert owner_of(m.path("pins", "f")) == (1234, 5678)
    m.restart()
    assert owner_of(m.path("pins", "f")) == (1234, 5678)
    assert m.path("pins", "f").read_bytes() == b"acknowledged\n"


# One process of another user: each step's outcome ("ok" or the errno's name), then the
# owner and group of each entry.
OWNER_PROBE = r"""
import errno, json, os, sys
pins, steps = sys.argv[1], json.loads(sys.argv[2])
out = []
fd = None
for op, name, uid, gid in steps:
    path = os.path.join(pins, name)
    try:
        if op == "chown":
            os.chown(path, uid, gid)
        elif op == "create":
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, b"being written\n")
        elif op == "fchown":
            os.fchown(fd, uid, gid)
        elif op == "close":
            os.close(fd)
        out.append("ok")
    except OSError as exc:
        out.append(errno.errorcode.get(exc.errno, str(exc.errno)))
print(json.dumps(out))
"""


@pytest.fixture
def open_base() -> Iterator[Path]:
    """A directory every user can traverse (pytest's tmp_path is under a 0700 one); a test
    names it before `start_mount`, whose mounts in it are then gone before it is."""
    path = Path(tempfile.mkdtemp(prefix="alkfs-owners-", dir="/tmp"))
    try:
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def as_1234(pins: Path, groups: str, *steps: tuple) -> list[str]:
    """Run `steps` (op, name, uid, gid) as uid 1234, gid 1234 and `groups` (setpriv's
    --groups, or "" for none) in one process; their outcomes."""
    ids = ["--reuid=1234", "--regid=1234"]
    ids.append(f"--groups={groups}" if groups else "--clear-groups")
    done = subprocess.run(
        ["setpriv", *ids, "/usr/bin/python3", "-c", OWNER_PROBE, str(pins), json.dumps(steps)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_a_user_but_root_changes_no_owner_and_only_to_its_own_groups(open_base, start_mount):
    """As uid 1234, the mount's `--owner` (its pins show 1234:1234): a chown to another
    owner is EPERM (a pin, a directory of pins, a file being written), a chgrp to a group
    it is not in or of a pin it does not own too; a chgrp of its own to one of its
    groups (its gid, a supplementary one) is kept, and a chown to what it is is a no-op."""
    m = start_mount(
        None, "--window", "0", "--owner", "1234:1234", "--allow-other", mnt=open_base / "mnt"
    )
    pins = m.path("pins")
    write_close(pins / "mine", b"mine\n")
    os.mkdir(pins / "mydir")
    write_close(pins / "theirs", b"theirs\n")
    os.chown(pins / "theirs", 65534, 65534)  # (root: any owner)
    assert [owner_of(pins / n) for n in ("mine", "mydir", "theirs")] == [
        (1234, 1234),
        (1234, 1234),
        (65534, 65534),
    ]
    got = as_1234(
        pins,
        "5678",
        ("chown", "mine", 0, -1),
        ("chown", "mine", 65534, 1234),
        ("chown", "mine", 1234, 1234),  # (what it is: a no-op)
        ("chown", "mine", -1, 4321),  # (a group it is not in)
        ("chown", "mine", -1, 5678),  # (a supplementary group)
        ("chown", "mydir", 0, -1),
        ("chown", "mydir", -1, 5678),
        ("chown", "theirs", -1, 5678),  # (not its own)
        ("chown", "theirs", 1234, -1),
        ("create", "writing", -1, -1),
        ("fchown", "writing", 0, -1),
        ("fchown", "writing", -1, 5678),
        ("close", "writing", -1, -1),
    )
    assert got == [
        "EPERM",
        "EPERM",
        "ok",
        "EPERM",
        "ok",
        "EPERM",
        "ok",
        "EPERM",
        "EPERM",
        "ok",
        "EPERM",
        "ok",
        "ok",
    ]
    shown = {n: owner_of(pins / n) for n in ("mine", "mydir", "theirs", "writing")}
    assert shown == {
        "mine": (1234, 5678),
        "mydir": (1234, 5678),
        "theirs": (65534, 65534),
        "writing": (1234, 5678),
    }
    # without supplementary groups: back to its own gid, not to 5678 again
    assert as_1234(pins, "", ("chown", "mine", -1, 1234), ("chown", "mine", -1, 5678)) == [
        "ok",
        "EPERM",
    ]
    m.restart()
    shown["mine"] = (1234, 1234)
    assert {n: owner_of(pins / n) for n in shown} == shown
    assert m.tracebacks() == []
