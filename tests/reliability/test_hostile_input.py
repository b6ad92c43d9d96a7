"""Hostile input: every byte value as a name in /pins (where any file name is a pin's; the
xattr form keeps the narrow pattern), /objects/sha256, /repos and refs/heads; 255- and
256-byte names; `.` and `..`; huge and partial writes into every writable file; extended
attribute values up to 64 KiB and beyond; every open flag combination on every view. Each
gets the errno docs/decisions.md ("Rules for bad input") gives it, nothing changes (pins,
refs, HEAD, the status counts), the daemon serves on and its log holds no traceback."""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers import git_out, os_errno, pin_target, sha, write_close

PIN_RE = re.compile(rb"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
REPO_RE = re.compile(rb"[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")
PIN_X = "user.alkfs.pin."
REPO = "setup-repo"  # longer than any name the byte loop makes
OBJECT = b"the hostile-input object\n"
PINNED = b"pinned by the hostile-input test\n"


def git_accepts_ref(name: bytes) -> bool:
    done = subprocess.run([b"git", b"check-ref-format", b"refs/heads/" + name])
    return done.returncode == 0


def setup(m) -> dict[str, str]:
    """A repository REPO with refs/heads/main at a commit, a pin `keep`, an object."""
    os.mkdir(m.path("repos", REPO))
    env = {"GIT_DIR": str(m.path("repos", REPO))}
    blob = git_out("hash-object", "-w", "--stdin", env=env, input=b"a blob\n").strip()
    tree = git_out("mktree", env=env, input=f"100644 blob {blob}\tf\n".encode()).strip()
    commit = git_out("commit-tree", "-m", "one", tree, env=env, input=b"").strip()
    write_close(m.path("repos", REPO, "refs", "heads", "main"), f"{commit}\n".encode())
    write_close(m.path("pins", "keep"), PINNED)
    write_close(m.path("objects", "sha256", "new"), OBJECT)
    return {"commit": commit, "object": sha(OBJECT), "pinned": sha(PINNED)}


def snapshot(m) -> dict:
    """What no refusal may change."""
    pins = sorted(os.listdir(os.fsencode(m.path("pins"))))
    status = json.loads(m.path(".alkfs", "status").read_text())
    refs = {}
    for repo in sorted(os.listdir(m.path("repos"))):
        root = m.path("repos", repo)  # packed-refs lists every ref (README "Refs are shown packed")
        refs[repo] = ((root / "packed-refs").read_bytes(), (root / "HEAD").read_bytes())
    return {
        "pins": {p: pin_target(os.path.join(os.fsencode(m.path("pins")), p)) for p in pins},
        "repos": sorted(os.listdir(os.fsencode(m.path("repos")))),
        "refs": refs,
        "objects": {a: o["count"] for a, o in status["objects"].items()},
        "counts": (status["pins"], status["repos"]),
    }


def serves_on(m) -> None:
    assert m.proc.poll() is None, m.log()
    assert os.statvfs(m.mnt).f_namemax == 255
    assert m.path("pins", "keep").read_bytes() == PINNED
    assert m.tracebacks() == []


def outcome(fn, *args) -> str:
    try:
        fn(*args)
    except OSError as exc:
        return errno.errorcode[exc.errno]
    return "ok"


# -- names --------------------------------------------------------------------------
def hostile_names() -> list[bytes]:
    names = []
    for b in range(1, 256):
        if b == ord("/"):
            continue
        byte = bytes([b])
        names += [n for n in (byte, b"a" + byte + b"b", byte + b"ab") if n not in (b".", b"..")]
    return names


NAMES = hostile_names()


def test_every_byte_as_a_name_gets_its_documented_answer_and_changes_nothing(mount):
    m = mount
    ids = setup(m)
    before = snapshot(m)
    commit_line = f"{ids['commit']}\n".encode()
    pins = os.fsencode(m.path("pins"))
    objects = os.fsencode(m.path("objects", "sha256"))
    repos = os.fsencode(m.path("repos"))
    heads = os.fsencode(m.path("repos", REPO, "refs", "heads"))
    wrong = []
    link = f"../objects/sha256/{ids['object']}"
    obj = os.fsencode(m.path("objects", "sha256", ids["object"]))
    for name in NAMES:
        got, want = {}, {}
        # /pins: any file name is a pin's there: stored and pinned (then
        # removed), and so for every way to name a pin inside /pins: ln -s, mv
        path = os.path.join(pins, name)
        got["pins"] = outcome(write_close, path, PINNED)
        want["pins"] = "ok"
        if got["pins"] == "ok":
            os.unlink(path)
        got["ln -s"] = outcome(os.symlink, link.encode(), path)
        want["ln -s"] = "ok"
        if got["ln -s"] == "ok":
            os.unlink(path)
        got["mv"] = outcome(os.rename, os.path.join(pins, b"keep"), path)
        want["mv"] = "ok"
        if got["mv"] == "ok":
            os.rename(path, os.path.join(pins, b"keep"))
        # ... but the xattr form keeps the narrow pattern: a pin name, else EINVAL
        got["setfattr"] = outcome(os.setxattr, obj, PIN_X.encode() + name, b"")
        want["setfattr"] = "ok" if PIN_RE.match(name) else "EINVAL"
        if got["setfattr"] == "ok":
            os.removexattr(obj, PIN_X.encode() + name)
        # /objects/sha256: any new name stores the content under its digest; the name goes
        path = os.path.join(objects, name)
        got["objects"] = (outcome(write_close, path, OBJECT), outcome(os.lstat, path))
        want["objects"] = ("ok", "ENOENT")
        # /repos: a repository id, else EINVAL
        path = os.path.join(repos, name)
        got["repos"] = outcome(os.mkdir, path)
        want["repos"] = "ok" if REPO_RE.match(name) else "EINVAL"
        if got["repos"] == "ok":
            os.rmdir(path)
        # refs/heads: what git check-ref-format accepts and is UTF-8 (README "Refs through
        # files"), else EINVAL
        path = os.path.join(heads, name)
        got["ref"] = outcome(write_close, path, commit_line)
        want["ref"] = "ok" if utf8(name) and git_accepts_ref(name) else "EINVAL"
        if got["ref"] == "ok":
            assert Path(os.fsdecode(path)).read_bytes() == commit_line
            os.unlink(path)
        got["ref mkdir"] = outcome(os.mkdir, path)
        want["ref mkdir"] = want["ref"]
        if got["ref mkdir"] == "ok":
            os.rmdir(path)
        # lookups of every such name: plainly absent
        for d in (pins, objects, repos, heads):
            got[f"lookup {d[-5:]!r}"] = outcome(os.lstat, os.path.join(d, name))
            want[f"lookup {d[-5:]!r}"] = "ENOENT"
        if got != want:
            wrong.append((name, got, want))
    assert wrong == []
    assert snapshot(m) == before
    serves_on(m)


def utf8(name: bytes) -> bool:
    try:
        name.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_names_of_255_and_256_bytes(mount):
    m = mount
    ids = setup(m)
    before = snapshot(m)
    line = f"{ids['commit']}\n".encode()
    n255, n256 = "n" * 255, "n" * 256
    # 255 bytes: a file name, so a pin's inside /pins; longer than a repository
    # id (100): EINVAL there (and than a pin name of the xattr form: below)
    write_close(m.path("pins", n255), PINNED)
    assert pin_target(m.path("pins", n255)) == f"../objects/sha256/{ids['pinned']}"
    os.unlink(m.path("pins", n255))
    assert os_errno(os.mkdir, m.path("repos", n255)) == errno.EINVAL
    write_close(m.path("objects", "sha256", n255), OBJECT)  # any name: stored, name gone
    assert os_errno(os.lstat, m.path("objects", "sha256", n255)) == errno.ENOENT
    assert git_accepts_ref(n255.encode())
    ref = m.path("repos", REPO, "refs", "heads", n255)
    write_close(ref, line)
    assert ref.read_bytes() == line
    os.unlink(ref)
    # 128 bytes is the longest pin name of the xattr form (inside /pins 129 is one like
    # any other), 100 the longest repository id
    obj = m.path("objects", "sha256", ids["object"])
    os.setxattr(obj, PIN_X + "p" * 128, b"")
    os.removexattr(obj, PIN_X + "p" * 128)
    assert os_errno(os.setxattr, obj, PIN_X + "p" * 129, b"") == errno.EINVAL
    write_close(m.path("pins", "p" * 129), PINNED)
    os.unlink(m.path("pins", "p" * 129))
    os.mkdir(m.path("repos", "r" * 100))
    os.rmdir(m.path("repos", "r" * 100))
    assert os_errno(os.mkdir, m.path("repos", "r" * 101)) == errno.EINVAL
    # 256 bytes: ENAMETOOLONG everywhere, whatever the operation
    for d in ("pins", "objects/sha256", "repos", f"repos/{REPO}/refs/heads"):
        where = m.path(d)
        assert os_errno(write_close, where / n256, line) == errno.ENAMETOOLONG, d
        assert os_errno(os.mkdir, where / n256) == errno.ENAMETOOLONG, d
        assert os_errno(os.lstat, where / n256) == errno.ENAMETOOLONG, d
        assert os_errno(os.symlink, f"../objects/sha256/{ids['object']}", where / n256) == (
            errno.ENAMETOOLONG
        )
    assert os_errno(os.rename, m.path("pins", "keep"), m.path("pins", n256)) == (errno.ENAMETOOLONG)
    assert snapshot(m) == before
    serves_on(m)


def test_dot_and_dotdot_get_the_kernels_answers_and_change_nothing(mount):
    m = mount
    ids = setup(m)
    before = snapshot(m)
    link = f"../objects/sha256/{ids['object']}"
    for d in ("pins", "objects/sha256", "repos", f"repos/{REPO}/refs/heads"):
        for dot in (".", ".."):
            p = os.path.join(m.path(d), dot)  # (pathlib would drop a "."))
            got = {
                "mkdir": outcome(os.mkdir, p),
                "rmdir": outcome(os.rmdir, p),
                "unlink": outcome(os.unlink, p),
                "create": outcome(write_close, p, OBJECT),
                "symlink": outcome(os.symlink, link, p),
                "rename from": outcome(os.rename, p, os.path.join(m.path(d), "zz")),
                "rename to": outcome(os.rename, m.path("pins", "keep"), p),
            }
            assert got == {
                "mkdir": "EEXIST",
                "rmdir": "EINVAL" if dot == "." else "ENOTEMPTY",
                "unlink": "EISDIR",
                "create": "EEXIST",
                "symlink": "EEXIST",
                "rename from": "EBUSY",
                "rename to": "EBUSY",
            }, (d, dot)
    # a leading dot: a file name, so a pin's inside /pins, kept; no repository id
    for name in ("...", ".x", ".x."):
        write_close(m.path("pins", name), PINNED)
        assert pin_target(m.path("pins", name)) == f"../objects/sha256/{ids['pinned']}", name
        os.unlink(m.path("pins", name))
        assert os_errno(os.mkdir, m.path("repos", name)) == errno.EINVAL, name
    assert snapshot(m) == before
    serves_on(m)


# -- writes -------------------------------------------------------------------------
def write_chunks(path, chunks, flags=os.O_TRUNC) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
    try:
        for chunk in chunks:
            assert os.write(fd, chunk) == len(chunk)
    finally:
        os.close(fd)


def pwrite_close(path, data: bytes, off: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        assert os.pwrite(fd, data, off) == len(data)
    finally:
        os.close(fd)


def test_huge_and_partial_writes_into_refs_head_and_control_change_nothing(mount):
    m = mount
    ids = setup(m)
    c = ids["commit"].encode()
    ref = m.path("repos", REPO, "refs", "heads", "main")
    head = m.path("repos", REPO, "HEAD")
    control = m.path(".alkfs", "control")
    before = snapshot(m)
    refused = {
        "ref: 2 MiB of junk": (ref, [b"x" * (2 << 20)]),
        "ref: 50,000 lines": (ref, [c + b"\n"] * 50_000),
        "ref: half an oid": (ref, [c[:20]]),
        "ref: two lines": (ref, [c + b"\n" + c + b"\n"]),
        "ref: 40 zeros": (ref, [b"0" * 40 + b"\n"]),
        "ref: uppercase": (ref, [c.upper() + b"\n"]),
        "ref: an oid not in the store": (ref, [b"1" * 40 + b"\n"]),
        "HEAD: an oid": (head, [c + b"\n"]),
        "HEAD: half a line": (head, [b"ref: "]),
        "HEAD: no newline": (head, [b"ref: refs/heads/x"]),
        "HEAD: not refs/": (head, [b"ref: HEAD\n"]),
        "control: half a command": (control, [b"swee"]),
    }
    got = {what: outcome(write_chunks, path, chunks) for what, (path, chunks) in refused.items()}
    got["control: 1 MiB"] = outcome(write_chunks, control, [b"sweep\n" * 174_763])
    got["ref: the oid at offset 100"] = outcome(pwrite_close, ref, c + b"\n", 100)
    # git's lockfile: a lock's write is capped as the file's; its rename checks the value
    for lock in (f"{ref}.lock", f"{head}.lock"):
        got[f"{lock[-9:]}: 2 MiB"] = outcome(write_chunks, lock, [b"y" * (2 << 20)], os.O_EXCL)
        os.unlink(lock)
        write_chunks(lock, [b"y" * 100], os.O_EXCL)
        got[f"rename {lock[-9:]}"] = outcome(os.rename, lock, lock[:-5])
        os.unlink(lock)
    got["HEAD: a 2 MiB name"] = outcome(
        write_chunks, head, [b"ref: refs/heads/" + b"x" * (2 << 20)]
    )
    # README: a ref file takes at most 256 bytes, HEAD `ref: ` + 1,024 bytes of name
    # (EINVAL / ENAMETOOLONG at the write), the control file 4 KiB an open (E2BIG)
    want = dict.fromkeys(got, "EINVAL") | {
        "control: 1 MiB": "E2BIG",
        "HEAD.lock: 2 MiB": "ENAMETOOLONG",
        "HEAD: a 2 MiB name": "ENAMETOOLONG",
    }
    assert got == want
    assert snapshot(m) == before
    assert json.loads(m.path(".alkfs", "status").read_text())["last_sweep"] is None
    # partial writes that complete a line are applied, once
    write_chunks(ref, [c[:7], c[7:30], c[30:], b"\n"])
    assert ref.read_bytes() == c + b"\n"
    write_chunks(head, [b"ref: refs/", b"heads/topic", b"\n"])
    assert head.read_bytes() == b"ref: refs/heads/topic\n"
    write_chunks(head, [b"ref: refs/heads/main\n"])
    write_chunks(ref, [c])  # an unterminated oid is applied at close (README)
    assert snapshot(m) == before
    serves_on(m)


def test_huge_partial_and_backward_writes_of_a_pin_store_exactly_the_bytes(mount):
    m = mount
    setup(m)
    size = 3 << 20  # past the 1 MiB that stays in memory: streamed, then spooled
    data = bytes(range(256)) * (size // 256)
    path = m.path("pins", "big")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        step = 1 << 19
        for off in range(0, size, step):  # forward, then back over every piece
            assert os.pwrite(fd, b"\0" * step, off) == step
        for off in reversed(range(0, size, step)):
            assert os.pwrite(fd, data[off : off + step], off) == step
    finally:
        os.close(fd)
    assert pin_target(path) == f"../objects/sha256/{sha(data)}"
    assert path.read_bytes() == data
    hole = m.path("pins", "holes")
    fd = os.open(hole, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        assert os.pwrite(fd, b"end", 5000) == 3  # a hole before it reads as zeros
    finally:
        os.close(fd)
    assert hole.read_bytes() == b"\0" * 5000 + b"end"
    serves_on(m)


# -- extended attributes -----------------------------------------------------------
@pytest.mark.parametrize("view", ["object", "pin", "loose"])
def test_xattr_values_up_to_64_kib_and_beyond(mount, view):
    m = mount
    ids = setup(m)
    c = ids["commit"]
    if view == "pin":  # a pin made by ln -s (`keep`, written as a file, is a regular file)
        os.symlink(f"../objects/sha256/{ids['pinned']}", m.path("pins", "keep-link"))
    path = {
        "object": m.path("objects", "sha256", ids["object"]),
        "pin": m.path("pins", "keep-link"),  # setxattr follows the link to the object
        "loose": m.path("git", "sha1", c[:2], c[2:]),
    }[view]
    before = snapshot(m)
    for size in (4097, 65535, 65536, 65537, 1 << 20):
        assert os_errno(os.setxattr, path, PIN_X + "big", b"v" * size) == errno.E2BIG, size
    bad = {
        "user.alkfs.size": errno.EPERM,  # read-only attributes
        "user.alkfs.pins": errno.EPERM,
        "user.alkfs.nope": errno.ENOTSUP,  # unknown names
        "security.x": errno.ENOTSUP,
        "trusted.x": errno.ENOTSUP,
        PIN_X: errno.EINVAL,  # no pin name
        PIN_X + "bad name": errno.EINVAL,
        PIN_X + "x" * 129: errno.EINVAL,
        PIN_X + "keep": errno.EEXIST if view != "pin" else None,  # taken by another object
    }
    for name, want in bad.items():
        if want is not None:
            assert os_errno(os.setxattr, path, name, b"1") == want, name
    assert snapshot(m) == before
    for size in (0, 1, 4096):  # up to 4 KiB: the value is taken (and ignored)
        os.setxattr(path, PIN_X + f"v{size}", b"v" * size)
    listed = sorted(n for n in os.listdir(m.path("pins")) if n.startswith("v"))
    assert listed == ["v0", "v1", "v4096"]
    serves_on(m)


# -- open flags ----------------------------------------------------------------------
ACCESS = {"R": os.O_RDONLY, "W": os.O_WRONLY, "RW": os.O_RDWR}
MODIFIERS = {
    "A": os.O_APPEND,
    "T": os.O_TRUNC,
    "C": os.O_CREAT,
    "X": os.O_EXCL,
    "D": os.O_DIRECT,
    "N": os.O_NOATIME,
    "P": os.O_PATH,
}
WRITABLE = {"ref", "HEAD", "control"}


def expected_open(view: str, access: str, mods: tuple[str, ...]) -> str:
    if "P" in mods:
        return "ok"  # O_PATH: the kernel opens nothing and ignores the other flags
    if "C" in mods and "X" in mods:
        return "EEXIST"
    if view in WRITABLE:
        return "ok"  # opening writes nothing: the update is the written line
    if access != "R" or "T" in mods:
        return "EPERM"  # read-only views (objects, config, packed-refs, derived packs)
    return "ok"  # O_RDONLY|O_APPEND reads (its writes fail EBADF)


def open_close(path: str, flags: int) -> None:
    fd = os.open(path, flags, 0o644)
    os.close(fd)


def test_every_open_flag_combination_on_every_view(mount):
    m = mount
    ids = setup(m)
    c = ids["commit"]
    views = {
        "object": m.path("objects", "sha256", ids["object"]),
        "pin": m.path("pins", "keep"),
        "ref": m.path("repos", REPO, "refs", "heads", "main"),
        "HEAD": m.path("repos", REPO, "HEAD"),
        "config": m.path("repos", REPO, "config"),
        "packed-refs": m.path("repos", REPO, "packed-refs"),
        "alternates": m.path("repos", REPO, "objects", "info", "alternates"),
        "loose": m.path("git", "sha1", c[:2], c[2:]),
        "control": m.path(".alkfs", "control"),
        "status": m.path(".alkfs", "status"),
        "metrics": m.path(".alkfs", "metrics"),
    }
    contents = {
        v: p.read_bytes() for v, p in views.items() if v not in ("packed-refs", "status", "metrics")
    }
    before = snapshot(m)
    wrong = []
    combos = 0
    for view, path in views.items():
        for access, aflag in ACCESS.items():
            for r in range(len(MODIFIERS) + 1):
                for mods in itertools.combinations(MODIFIERS, r):
                    flags = aflag
                    for k in mods:
                        flags |= MODIFIERS[k]
                    got = outcome(open_close, str(path), flags)
                    want = expected_open(view, access, mods)
                    combos += 1
                    if got != want:
                        wrong.append((view, access + "".join(mods), got, want))
    assert combos == 11 * 3 * 128
    assert wrong == []
    assert {v: views[v].read_bytes() for v in contents} == contents
    assert snapshot(m) == before
    assert json.loads(m.path(".alkfs", "status").read_text())["last_sweep"] is None
    serves_on(m)


@pytest.mark.parametrize("view", ["ref", "HEAD"])
def test_a_ref_opened_read_write_reads_its_value(mount, view):
    m = mount
    setup(m)
    path = m.path("repos", REPO, *(("refs", "heads", "main") if view == "ref" else ("HEAD",)))
    value = path.read_bytes()
    fd = os.open(path, os.O_RDWR)
    try:
        assert (os.fstat(fd).st_size, os.read(fd, 4096)) == (len(value), value)
    finally:
        os.close(fd)
