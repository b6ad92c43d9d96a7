"""Bounded logs (docs/operations.md, "Logs"): a refusal quotes at most a few hundred bytes
of any value it carries, and repeated identical refusals are counted instead of logged one
by one (at most 10 lines per (op, errno) and second, then one "... and K more" line)."""

from __future__ import annotations

import errno
import os
import re

from helpers import os_errno, sha, write_close

LINE_MAX = 1024  # what a log line may be, whatever the request carried


def longest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


def test_a_refusal_carrying_a_huge_value_logs_a_line_of_bounded_length(mount):
    m = mount
    huge_name = b"n" * 1020  # FUSE passes names up to 1024 bytes to the daemon
    assert os_errno(os.mkdir, os.path.join(os.fsencode(m.path("objects")), huge_name)) in (
        errno.EPERM,
        errno.ENAMETOOLONG,
    )
    target = "../objects/sha256/" + "f" * 4000  # a symlink target up to PATH_MAX
    assert os_errno(os.symlink, target, m.path("pins", "big-link")) == errno.EINVAL
    os.mkdir(m.path("repos", "r"))
    ref = m.path("repos", "r", "refs", "heads", "main")
    assert os_errno(write_close, ref, b"x" * (2 << 20)) in (errno.EINVAL, errno.E2BIG)
    assert m.stop() == 0
    log = m.log()
    assert re.search(r"WARNING (lookup|mkdir) /objects/n{100}", log)
    assert "symlink /pins/big-link: errno=EINVAL" in log
    assert re.search(r"/repos/r/refs/heads/main: errno=(EINVAL|E2BIG)", log)
    assert longest(log) <= LINE_MAX, longest(log)


def test_repeated_identical_refusals_are_counted_not_logged_one_by_one(mount):
    m = mount
    write_close(m.path("objects", "sha256", "new"), b"an object\n")
    obj = m.path("objects", "sha256", sha(b"an object\n"))
    n = 1000
    for _ in range(n):
        assert os_errno(os.open, obj, os.O_WRONLY) == errno.EPERM
    assert m.stop() == 0  # the counts still due are logged at exit
    log = m.log()
    one_by_one = len(re.findall(r"WARNING open sha256/\S+: errno=EPERM", log))
    counted = sum(
        int(k) for k in re.findall(r"WARNING open: \.\.\. and (\d+) more errno=EPERM", log)
    )
    assert one_by_one + counted == n, (one_by_one, counted)
    assert one_by_one <= n // 10, one_by_one  # 10 a second: 1000 opens take far less than 100 s
    assert longest(log) <= LINE_MAX


def test_an_xattr_refusal_names_the_attribute_as_text_not_as_a_python_bytes_repr(mount):
    m = mount
    key = sha(b"an object to pin\n")
    write_close(m.path("objects", "sha256", "new"), b"an object to pin\n")
    obj = m.path("objects", "sha256", key)
    bad = "user.alkfs.pin.no spaces allowed"
    assert os_errno(os.setxattr, obj, bad, b"") == errno.EINVAL
    assert m.stop() == 0
    line = next(x for x in m.log().splitlines() if "setxattr" in x and "errno=EINVAL" in x)
    assert f"sha256/{key} [{bad}]: errno=EINVAL" in line, line
    assert "b'" not in line, line
