"""Nothing lost in /pins (issue 12): a file whose name would never be pinned is refused
at create (EINVAL), so `cp`, `cp -r` and `rsync -a` fail loudly and nothing is listed or
stored; rsync's temporaries of valid names still work; and one name has one writer: a
second writer of a new pin fails instead of silently replacing the first."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import os_errno, sha, write_close

DATA = b"keep me\n"
OTHER = b"the second writer\n"

BAD_NAMES = [
    b"with space",
    b"a+b",
    "caf\u00e9".encode(),  # non-ASCII (valid UTF-8)
    b"_leading-underscore",
    b"x" * 129,  # one byte over a pin name
    b"bad\xff\xfeutf8",  # not UTF-8
]


def link_of(data: bytes) -> str:
    return f"../objects/sha256/{sha(data)}"


def listing(m) -> list[bytes]:
    return sorted(os.listdir(os.fsencode(m.path("pins"))))


def stored(m) -> int:
    status = json.loads(m.path(".alkfs", "status").read_text())
    return status["objects"]["sha256"]["count"]


def tool(*args: str | os.PathLike[str] | bytes) -> subprocess.CompletedProcess:
    return subprocess.run([os.fsencode(a) for a in args], capture_output=True, timeout=120)


@pytest.fixture
def bad_sources(tmp_path: Path) -> Path:
    src = tmp_path / "bad"
    src.mkdir()
    for i, name in enumerate(BAD_NAMES):
        with open(os.path.join(os.fsencode(src), name), "wb") as f:
            f.write(b"bad %d\n" % i)
    return src


def test_a_create_under_a_name_that_is_no_pin_name_is_einval_and_stores_nothing(mount):
    m = mount
    pins = os.fsencode(m.path("pins"))
    for name in BAD_NAMES:
        path = os.path.join(pins, name)
        assert os_errno(write_close, path, DATA) == errno.EINVAL, name
        assert os_errno(os.open, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) == errno.EINVAL
        # nor a temporary of such a name
        assert os_errno(write_close, os.path.join(pins, b"." + name + b".a1B2c3"), DATA) == (
            errno.EINVAL
        )
    assert listing(m) == []
    assert stored(m) == 0
    assert m.tracebacks() == []


def test_cp_of_a_bad_name_fails_loudly_and_nothing_is_listed(mount, bad_sources):
    m = mount
    for name in BAD_NAMES:
        done = tool("cp", os.path.join(os.fsencode(bad_sources), name), m.path("pins"))
        assert done.returncode == 1, name
        assert b"Invalid argument" in done.stderr, done.stderr
    assert listing(m) == []
    assert stored(m) == 0


def test_cp_r_and_rsync_a_of_bad_names_fail_loudly_and_pin_only_the_good_ones(mount, bad_sources):
    m = mount
    (bad_sources / "good.txt").write_bytes(DATA)
    done = tool("cp", "-r", f"{bad_sources}/.", m.path("pins"))
    assert done.returncode == 1
    assert done.stderr.count(b"Invalid argument") == len(BAD_NAMES), done.stderr
    assert listing(m) == [b"good.txt"]
    assert os.readlink(m.path("pins", "good.txt")) == link_of(DATA)
    os.unlink(m.path("pins", "good.txt"))

    done = tool("rsync", "-a", f"{bad_sources}/", m.path("pins"))
    assert done.returncode == 23, done.stderr  # rsync: "some files could not be transferred"
    assert b"Invalid argument" in done.stderr
    assert listing(m) == [b"good.txt"]
    assert os.readlink(m.path("pins", "good.txt")) == link_of(DATA)
    assert stored(m) == 1  # only good.txt's object: nothing of the bad names was stored


def test_rsync_a_of_valid_names_still_pins_through_its_temporaries(mount, tmp_path):
    m = mount
    src = tmp_path / "good"
    src.mkdir()
    names = ["a", "b.tar.gz", "Release-1.0_final", "x" * 128]
    for name in names:
        (src / name).write_bytes(name.encode() + b"\n")
    done = tool("rsync", "-a", f"{src}/", m.path("pins"))
    assert done.returncode == 0, done.stderr
    assert listing(m) == sorted(n.encode() for n in names)  # no temporary left behind
    for name in names:
        assert os.readlink(m.path("pins", name)) == link_of(name.encode() + b"\n")
    # a temporary cannot be renamed to a name that is not a pin name
    tmp = m.path("pins", ".c.x1Y2z3")
    write_close(tmp, DATA)
    assert os_errno(os.rename, tmp, m.path("pins", "bad name")) == errno.EINVAL
    assert os_errno(os.rename, tmp, m.path("pins", "_c")) == errno.EINVAL
    os.rename(tmp, m.path("pins", "c"))
    assert os.readlink(m.path("pins", "c")) == link_of(DATA)


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
    assert os.readlink(path) == link_of(DATA)
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
    assert os.readlink(path) == link_of(DATA)
    assert path.read_bytes() == DATA
    # once pinned, a write open reaches the object through the link: EPERM (README)
    assert os_errno(os.open, path, os.O_WRONLY | os.O_TRUNC) == errno.EPERM
    assert m.tracebacks() == []
