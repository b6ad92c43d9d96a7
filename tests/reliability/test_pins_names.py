"""Nothing lost in /pins (docs/decisions.md, "Names in /pins"): inside /pins any file name
is a pin's name (spaces, `+`, non-ASCII and non-UTF-8 bytes, a leading underscore or dot, up
to 255 bytes), so a create, `cp`, `cp -r` and `rsync -a` keep every file (its temporaries
included) and it survives a restart; the xattr form `user.alkfs.pin.<name>` keeps the narrow
pattern and refuses those names (EINVAL), storing nothing. And one name has one writer: a
second writer of a new pin fails instead of silently replacing the first."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import os_errno, pin_key, pin_target, sha, write_close

DATA = b"keep me\n"
OTHER = b"the second writer\n"
PIN_X = b"user.alkfs.pin."

# file names that are pin names inside /pins and not through the xattr form
WIDE_NAMES = [
    b"with space",
    b"a+b",
    "caf\u00e9".encode(),  # non-ASCII (valid UTF-8)
    b"_leading-underscore",
    b"x" * 129,  # one byte over a pin name of the xattr form
    b"bad\xff\xfeutf8",  # not UTF-8
]


def link_of(data: bytes) -> str:
    return f"../objects/sha256/{sha(data)}"


def content(i: int) -> bytes:
    return b"wide %d\n" % i


def listing(m) -> list[bytes]:
    return sorted(os.listdir(os.fsencode(m.path("pins"))))


def stored(m) -> int:
    status = json.loads(m.path(".alkfs", "status").read_text())
    return status["objects"]["sha256"]["count"]


def tool(*args: str | os.PathLike[str] | bytes) -> subprocess.CompletedProcess:
    return subprocess.run([os.fsencode(a) for a in args], capture_output=True, timeout=120)


def pinned_as_file(path: bytes, data: bytes) -> None:
    """`path` is a pin written as a file: a regular file of its object's size, its key in
    user.alkfs.key, its bytes those written."""
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_size == len(data), (path, st)
    assert pin_key(path) == f"sha256/{sha(data)}", path
    assert pin_target(path) == link_of(data), path
    with open(path, "rb") as f:
        assert f.read() == data, path


def xattr_form_refuses(m, obj: Path) -> None:
    """Each of WIDE_NAMES through `setxattr user.alkfs.pin.<name>`: EINVAL, nothing pinned."""
    before = listing(m)
    for name in WIDE_NAMES:
        assert os_errno(os.setxattr, obj, PIN_X + name, b"") == errno.EINVAL, name
    assert listing(m) == before


@pytest.fixture
def wide_sources(tmp_path: Path) -> Path:
    src = tmp_path / "wide"
    src.mkdir()
    for i, name in enumerate(WIDE_NAMES):
        with open(os.path.join(os.fsencode(src), name), "wb") as f:
            f.write(content(i))
    return src


def test_a_create_under_any_file_name_is_kept_and_the_xattr_form_refuses_it(mount):
    m = mount
    pins = os.fsencode(m.path("pins"))
    temporaries = []
    for i, name in enumerate(WIDE_NAMES):
        write_close(os.path.join(pins, name), content(i))
        pinned_as_file(os.path.join(pins, name), content(i))
        # a second create of it (O_EXCL) finds it taken; a write open of the pin is EPERM
        assert os_errno(write_close, os.path.join(pins, name), OTHER) == errno.EEXIST
        path = os.path.join(pins, name)
        assert os_errno(os.open, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) == errno.EPERM
        # and rsync's temporary of such a name is a name like any other
        temporaries.append(b"." + name + b".a1B2c3")
        write_close(os.path.join(pins, temporaries[-1]), DATA)
    everything = sorted(WIDE_NAMES + temporaries)
    assert listing(m) == everything
    assert stored(m) == len(WIDE_NAMES) + 1
    xattr_form_refuses(m, m.path("objects", "sha256", sha(DATA)))
    m.restart()  # durable
    assert listing(m) == everything
    for i, name in enumerate(WIDE_NAMES):
        pinned_as_file(os.path.join(pins, name), content(i))
    for name in temporaries:
        pinned_as_file(os.path.join(pins, name), DATA)
    assert stored(m) == len(WIDE_NAMES) + 1
    assert m.tracebacks() == []


def test_cp_of_any_file_name_keeps_it(mount, wide_sources):
    m = mount
    for name in WIDE_NAMES:
        done = tool("cp", os.path.join(os.fsencode(wide_sources), name), m.path("pins"))
        assert done.returncode == 0, (name, done.stderr)
    assert listing(m) == sorted(WIDE_NAMES)
    for i, name in enumerate(WIDE_NAMES):
        pinned_as_file(os.path.join(os.fsencode(m.path("pins")), name), content(i))
    assert stored(m) == len(WIDE_NAMES)


def test_cp_r_and_rsync_a_keep_every_file(mount, wide_sources):
    m = mount
    pins = os.fsencode(m.path("pins"))
    (wide_sources / "good.txt").write_bytes(DATA)
    every = sorted([*WIDE_NAMES, b"good.txt"])

    def kept() -> None:
        assert listing(m) == every  # (no temporary left behind)
        pinned_as_file(os.path.join(pins, b"good.txt"), DATA)
        for i, name in enumerate(WIDE_NAMES):
            pinned_as_file(os.path.join(pins, name), content(i))

    done = tool("cp", "-r", f"{wide_sources}/.", m.path("pins"))
    assert done.returncode == 0, done.stderr
    kept()
    for name in every:
        os.unlink(os.path.join(pins, name))
    assert listing(m) == []

    done = tool("rsync", "-a", f"{wide_sources}/", m.path("pins"))
    assert done.returncode == 0, done.stderr
    kept()
    assert stored(m) == len(WIDE_NAMES) + 1
    xattr_form_refuses(m, m.path("objects", "sha256", sha(DATA)))
    assert m.tracebacks() == []


def test_rsync_a_of_valid_names_still_pins_through_its_temporaries(mount, tmp_path):
    m = mount
    src = tmp_path / "good"
    src.mkdir()
    names = ["a", "b.tar.gz", "Release-1.0_final", "x" * 128, "x" * 255]
    for name in names:
        (src / name).write_bytes(name.encode() + b"\n")
    done = tool("rsync", "-a", f"{src}/", m.path("pins"))
    assert done.returncode == 0, done.stderr
    assert listing(m) == sorted(n.encode() for n in names)  # no temporary left behind
    for name in names:
        assert pin_target(m.path("pins", name)) == link_of(name.encode() + b"\n")
    # a temporary renamed to any file name is kept under it: the xattr form's narrow
    # pattern does not apply inside /pins
    tmp = m.path("pins", ".c.x1Y2z3")
    write_close(tmp, DATA)
    os.rename(tmp, m.path("pins", "bad name"))
    assert pin_target(m.path("pins", "bad name")) == link_of(DATA)
    os.rename(m.path("pins", "bad name"), m.path("pins", "_c"))
    assert pin_target(m.path("pins", "_c")) == link_of(DATA)
    os.rename(m.path("pins", "_c"), m.path("pins", "c"))
    assert pin_target(m.path("pins", "c")) == link_of(DATA)
    assert listing(m) == sorted([*(n.encode() for n in names), b"c"])
    obj = m.path("objects", "sha256", sha(DATA))
    for name in (b"bad name", b"_c"):
        assert os_errno(os.setxattr, obj, PIN_X + name, b"") == errno.EINVAL, name


def test_a_second_exclusive_create_of_a_new_pin_is_eexist_while_open_and_once_pinned(mount):
    m = mount
    path = m.path("pins", "one")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, DATA)
        assert os_errno(write_close, path, OTHER) == errno.EEXIST
    finally:
        os.close(fd)
    assert os_errno(write_close, path, OTHER) == errno.EEXIST
    assert pin_target(path) == link_of(DATA)
    assert path.read_bytes() == DATA


HOLDER = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(fd, sys.argv[2].encode())
print("open", flush=True)
sys.stdin.read()
os.close(fd)
"""


def test_a_second_writer_of_a_new_pin_fails_with_eexist_and_the_first_is_kept(mount):
    """`cat a > pins/x` while another `cat b > pins/x` is still writing: the second open
    is refused (EEXIST) instead of truncating the first writer's bytes and pinning its own.
    (The first writer is a process of its own: a descriptor of this process would be
    closed, and the file stored, by the fork of any tool it starts.)"""
    m = mount
    path = m.path("pins", "shared")
    first = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), DATA.decode()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout is not None and first.stdout.readline() == "open\n"
        for flags in (os.O_CREAT | os.O_TRUNC, os.O_APPEND, 0):
            assert os_errno(os.open, path, os.O_WRONLY | flags) == errno.EEXIST
        done = subprocess.run(["sh", "-c", f"echo second > {path}"], capture_output=True)
        assert done.returncode != 0 and b"File exists" in done.stderr, done
        done = tool("cp", os.devnull, path)
        assert done.returncode == 1 and b"File exists" in done.stderr, done
        with open(path, "rb") as reader:  # reading it while it is written is fine
            assert reader.read() == DATA
    finally:
        first.communicate("", timeout=30)
    assert first.returncode == 0
    assert pin_target(path) == link_of(DATA)
    assert path.read_bytes() == DATA
    # once pinned, a write open of the pin (a file: immutable) is EPERM (README)
    assert os_errno(os.open, path, os.O_WRONLY | os.O_TRUNC) == errno.EPERM
    assert m.tracebacks() == []
