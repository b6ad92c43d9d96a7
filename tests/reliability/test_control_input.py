"""Bounded input (docs/decisions.md, "Rules for bad input"): the control file runs a command
only as a complete line (buffered per open; an unterminated last line runs at close, and its
refusal is close()'s), takes at most 4 lines a write and 4 KiB an open (E2BIG beyond,
nothing run); extended attribute values over 4 KiB are E2BIG and change nothing."""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest
from helpers import os_errno, sha, write_close

PIN_X = "user.alkfs.pin."


def sweeps(m) -> int:
    """How many sweeps this daemon has run (one log line each)."""
    return m.log().count("INFO sweep {")


def control(m) -> int:
    return os.open(m.path(".alkfs", "control"), os.O_WRONLY | os.O_TRUNC)


def test_a_command_split_over_two_writes_runs_once_when_its_line_is_complete(mount):
    m = mount
    fd = control(m)
    try:
        assert os.write(fd, b"swe") == 3
        assert sweeps(m) == 0
        assert os.write(fd, b"ep 0\nver") == 8
        assert sweeps(m) == 1
        assert os.write(fd, b"ify\n") == 4
        assert m.log().count("INFO verify:") == 1
    finally:
        os.close(fd)
    assert sweeps(m) == 1
    assert json.loads(m.path(".alkfs", "status").read_text())["last_sweep"]["aborted"] is None


def test_an_unterminated_last_line_runs_at_close_and_its_refusal_is_closes(mount):
    m = mount
    done = subprocess.run(
        ["sh", "-c", f"printf sweep > {m.path('.alkfs', 'control')}"], capture_output=True
    )
    assert done.returncode == 0, done.stderr
    assert sweeps(m) == 1
    for start in (b"verif", b"sweep 1hh", b"sweep 1h "):  # could still become a command
        fd = control(m)
        assert os.write(fd, start) == len(start)  # not a line yet: nothing run
        if start == b"sweep 1h ":
            os.close(fd)  # a complete command: it runs at close
        else:
            assert os_errno(os.close, fd) == errno.EINVAL
    assert sweeps(m) == 2


def test_an_unterminated_line_that_cannot_become_a_command_fails_at_its_write(mount):
    m = mount
    fd = control(m)
    try:
        assert os.write(fd, b"swe") == 3
        assert os_errno(os.write, fd, b"x") == errno.EINVAL  # "swex": never a command
        assert os_errno(os.write, fd, "\u00e9".encode()) == errno.EINVAL
        assert os.write(fd, b"ep 0\n") == 5  # the buffer is as before the refused writes
        assert sweeps(m) == 1
    finally:
        os.close(fd)
    # a shell's builtin echo ignores errors at close: this one is refused at the write
    done = subprocess.run(
        ["bash", "-c", f"echo -n bogus > {m.path('.alkfs', 'control')}"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "Invalid argument" in done.stderr, done
    assert sweeps(m) == 1


def test_one_write_runs_at_most_4_lines_and_a_bigger_one_runs_nothing(mount):
    m = mount
    fd = control(m)
    try:
        assert os.write(fd, b"sweep\n" * 4) == 24
        assert sweeps(m) == 4
        assert os_errno(os.write, fd, b"sweep\n" * 5) == errno.E2BIG
        assert sweeps(m) == 4
        # a bad line anywhere: nothing of the write runs
        assert os_errno(os.write, fd, b"sweep\nbogus\n") == errno.EINVAL
        assert sweeps(m) == 4
    finally:
        os.close(fd)
    fd = control(m)
    try:  # a 1 MiB write of commands: one refusal, no sweep
        assert os_errno(os.write, fd, b"sweep\n" * 174_763) == errno.E2BIG
    finally:
        os.close(fd)
    assert sweeps(m) == 4


def test_one_open_takes_at_most_4_kib(mount):
    m = mount
    fd = control(m)
    try:
        assert os.write(fd, b" " * 4090 + b"sweep\n") == 4096
        assert sweeps(m) == 1
        assert os_errno(os.write, fd, b"\n") == errno.E2BIG
        assert os_errno(os.write, fd, b"verify\n") == errno.E2BIG
    finally:
        os.close(fd)
    fd = control(m)
    try:  # an endless unterminated line is refused too, before it runs
        assert os_errno(os.write, fd, b"x" * 5000) == errno.E2BIG
    finally:
        os.close(fd)
    assert sweeps(m) == 1
    assert m.tracebacks() == []


@pytest.mark.parametrize("size", [4097, 64 * 1024, 65 * 1024])
def test_an_xattr_value_over_4_kib_is_e2big_and_pins_nothing(mount, size):
    m = mount
    write_close(m.path("objects", "sha256", "new"), b"an object\n")
    obj = m.path("objects", "sha256", sha(b"an object\n"))
    assert os_errno(os.setxattr, obj, PIN_X + "big", b"v" * size) == errno.E2BIG
    assert os_errno(os.getxattr, obj, PIN_X + "big") == errno.ENODATA
    assert os.listdir(m.path("pins")) == []
    assert os_errno(os.setxattr, m.path("pins"), "user.alkfs.x", b"v" * size) == errno.E2BIG
    os.setxattr(obj, PIN_X + "small", b"v" * 4096)  # up to 4 KiB: as before (ignored)
    assert os.listdir(m.path("pins")) == ["small"]
