"""A mount several users can share, on the daemon's own permission decisions (no
`default_permissions` on a shared mount: docs/operations.md, "Sharing the mount").

- With `--allow-other`, another user reads objects and freshens them (a staged delete is
  cancelled), and cannot write the control file, move refs, pin, unpin, create
  repositories or write objects (EACCES); cloning works (with docs/operations.md's
  `safe.directory` line when git asks).
- As the `--owner` user: the tree is theirs (st_uid), they push, update refs and pin; the
  control file stays root's.
- No one, root included, writes a repository's `config`, `hooks/` or `info/` (EPERM).
- A user past the per-user bounds gets EMFILE (write handles) / ENOSPC (bytes) while root
  keeps working.

Real mounts and real accounts: alkfsd runs as a subprocess; each user is made here with
useradd and removed with userdel -r, whatever happens; their commands run with runuser.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import git, git_out, pin_target

MOUNT_TIMEOUT_S = 20.0
EACCES, EPERM = errno.errorcode[errno.EACCES], errno.errorcode[errno.EPERM]
ORPHAN = b"an object nothing references: staged by one sweep, deleted by the next\n"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0
    or not os.path.exists("/dev/fuse")
    or shutil.which("useradd") is None
    or shutil.which("git") is None,
    reason="needs root, /dev/fuse, useradd and git",
)


# -- the daemon and the users --------------------------------------------------------------
def is_mounted(mnt: Path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(
            len(p) >= 3 and p[1] == str(mnt) and p[2].startswith("fuse")
            for p in (line.split() for line in f)
        )


class Daemon:
    def __init__(self, store: Path, mnt: Path, log: Path, args: list[str], env: dict) -> None:
        self.store, self.mnt, self.log_path, self.args, self.env = store, mnt, log, args, env
        self.proc: subprocess.Popen | None = None

    def start(self) -> Daemon:
        self.mnt.mkdir(exist_ok=True)
        argv = [sys.executable, "-X", "dev", "-bb", "-m", "alkfsd.main"]
        with open(self.log_path, "wb") as err:
            self.proc = subprocess.Popen(
                [*argv, str(self.store), str(self.mnt), "--window", "0", "--create", *self.args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env={**os.environ, **self.env},
            )
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not (is_mounted(self.mnt) and os.statvfs(self.mnt)):
            if self.proc.poll() is not None:
                raise RuntimeError(f"alkfsd exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"alkfsd did not mount {self.mnt}:\n{self.log()}")
            time.sleep(0.02)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def cleanup(self) -> None:
        """End the process by its PID and leave no mount behind, whatever happened."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
        finally:
            for flags in ("-u", "-uz"):
                if is_mounted(self.mnt):
                    subprocess.run(["fusermount3", flags, str(self.mnt)], capture_output=True)


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory every user can traverse (pytest's tmp_path is under a 0700 one)."""
    path = Path(tempfile.mkdtemp(prefix="alkfs-shared-", dir="/tmp"))
    try:
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon(base: Path) -> Iterator:
    started: list[Daemon] = []

    def start(*args: str, env: dict | None = None) -> Daemon:
        n = len(started)
        d = Daemon(
            base / f"store{n}", base / f"mnt{n}", base / f"alkfsd-{n}.log", list(args), env or {}
        )
        started.append(d)
        return d.start()

    try:
        yield start
    finally:
        for d in started:
            d.cleanup()


@pytest.fixture
def users() -> Iterator:
    """make() -> a new unprivileged account (home made); all removed with userdel -r."""
    made: list[str] = []

    def make() -> pwd.struct_passwd:
        name = f"alkfs-s{secrets.token_hex(3)}"
        r = subprocess.run(
            ["useradd", "--create-home", "--shell", "/bin/sh", name],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        made.append(name)
        return pwd.getpwnam(name)

    try:
        yield make
    finally:
        for name in made:
            gone = subprocess.run(["userdel", "-r", name], capture_output=True, text=True)
            assert gone.returncode == 0, gone.stderr
            with pytest.raises(KeyError):
                pwd.getpwnam(name)


GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
    "GIT_CONFIG_NOSYSTEM": "1",
}


def as_user(user: pwd.struct_passwd, *cmd: str, cwd: str | None = None, **kw):
    """Run `cmd` as `user` (runuser gives it its own HOME)."""
    return subprocess.run(
        ["runuser", "-u", user.pw_name, "--", "env", *(f"{k}={v}" for k, v in GIT_ENV.items())]
        + list(cmd),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd or user.pw_dir,
        **kw,
    )


# One probe process per user and batch: each step's outcome is "ok" (or a value) or the
# errno's name.
PROBE = r"""
import errno, json, os, sys
out = []
for step in json.loads(sys.argv[1]):
    op, args = step[0], step[1:]
    try:
        if op == "read":
            with open(args[0], "rb") as f:
                r = len(f.read())
        elif op == "touch":
            os.utime(args[0]); r = "ok"
        elif op == "write":
            fd = os.open(args[0], os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(fd, args[1].encode())
            finally:
                os.close(fd)
            r = "ok"
        elif op == "create":
            fd = os.open(args[0], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, args[1].encode())
            finally:
                os.close(fd)
            r = "ok"
        elif op == "mkdir":
            os.mkdir(args[0]); r = "ok"
        elif op == "setxattr":
            os.setxattr(args[0], args[1], args[2].encode()); r = "ok"
        elif op == "removexattr":
            os.removexattr(args[0], args[1]); r = "ok"
        elif op == "unlink":
            os.unlink(args[0]); r = "ok"
        elif op == "symlink":
            os.symlink(args[0], args[1]); r = "ok"
        elif op == "rename":
            os.rename(args[0], args[1]); r = "ok"
        elif op == "chmod":
            os.chmod(args[0], int(args[1], 8)); r = "ok"
        elif op == "stat":
            st = os.stat(args[0]); r = [st.st_uid, st.st_gid, oct(st.st_mode)]
        elif op == "access_w":
            r = os.access(args[0], os.W_OK)
        else:
            r = "unknown op"
    except OSError as exc:
        r = errno.errorcode.get(exc.errno, str(exc.errno))
    out.append(r)
print(json.dumps(out))
"""


def probe(user: pwd.struct_passwd | None, *steps: tuple) -> list:
    cmd = ["/usr/bin/python3", "-c", PROBE, json.dumps(steps)]
    r = (
        as_user(user, *cmd)
        if user is not None
        else subprocess.run(cmd, capture_output=True, text=True)
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def control(mnt: Path, command: str) -> None:
    with open(mnt / ".alkfs" / "control", "w") as f:
        f.write(command + "\n")


def last_sweep(mnt: Path) -> dict:
    return json.loads((mnt / ".alkfs" / "status").read_bytes())["last_sweep"]


def put(mnt: Path, data: bytes) -> Path:
    """Store `data` through the mount (as root); its object path."""
    tmp = mnt / "objects" / "sha256" / f"new-{secrets.token_hex(4)}"
    with open(tmp, "wb") as f:
        f.write(data)
    path = mnt / "objects" / "sha256" / hashlib.sha256(data).hexdigest()
    assert path.is_file()
    return path


def small_repo(path: Path, user: pwd.struct_passwd | None = None) -> str:
    """A two-commit repository at `path` (made by `user`, or root); the head's oid."""
    steps = [
        ["git", "init", "-q", "-b", "main", str(path)],
        ["sh", "-c", f"echo one > {path}/a && git -C {path} add a && git -C {path} commit -qm one"],
        ["sh", "-c", f"echo two > {path}/b && git -C {path} add b && git -C {path} commit -qm two"],
    ]
    for cmd in steps:
        if user is None:
            r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **GIT_ENV})
        else:
            r = as_user(user, *cmd)
        assert r.returncode == 0, (cmd, r.stderr)
    if user is None:
        return git_out("-C", str(path), "rev-parse", "HEAD").strip()
    return as_user(user, "git", "-C", str(path), "rev-parse", "HEAD").stdout.strip()


# -- another user, with --allow-other ----------------------------------------------------------
def test_another_user_reads_and_freshens_and_changes_nothing(base: Path, daemon, users):
    d = daemon("--allow-other")
    mnt = d.mnt
    other = users()
    src = base / "src"
    head = small_repo(src)
    (mnt / "repos" / "r").mkdir()
    git("push", "-q", str(mnt / "repos" / "r"), "main", cwd=src)
    orphan = put(mnt, ORPHAN)
    pinned = put(mnt, b"pinned by root\n")
    os.setxattr(pinned, "user.alkfs.pin.keep", b"")

    # reads: objects, the loose git view, a repository's plumbing; mode bits truthful
    loose = mnt / "git" / "sha1" / head[:2] / head[2:]
    repo_loose = mnt / "repos" / "r" / "objects" / head[:2] / head[2:]
    st_orphan, st_control = probe(
        other, ("stat", str(orphan)), ("stat", str(mnt / ".alkfs" / "control"))
    )
    assert st_orphan == [0, 0, oct(0o100444)]
    assert st_control == [0, 0, oct(0o100600)]
    got = probe(
        other,
        ("read", str(orphan)),
        ("read", str(loose)),
        ("read", str(mnt / "repos" / "r" / "refs" / "heads" / "main")),
        ("read", str(mnt / ".alkfs" / "status")),
        ("read", str(mnt / ".alkfs" / "control")),
        ("access_w", str(orphan)),
        ("access_w", str(mnt / "repos")),
    )
    assert got[:4] == [len(ORPHAN), os.stat(loose).st_size, 41, got[3]]
    assert got[4:] == [EACCES, False, False]

    # a staged delete is cancelled by the other user's touch
    control(mnt, "sweep")
    assert last_sweep(mnt)["candidates_staged"] >= 1
    assert probe(
        other, ("touch", str(orphan)), ("touch", str(loose)), ("touch", str(repo_loose))
    ) == [
        "ok",
        "ok",
        "ok",
    ]
    touched = as_user(other, "touch", str(orphan))  # coreutils' touch: open fails, utime works
    assert touched.returncode == 0, touched.stderr
    control(mnt, "sweep")
    report = last_sweep(mnt)
    assert report["cancelled_by_arbitration"] >= 1, report
    assert orphan.read_bytes() == ORPHAN

    # and nothing else: control, refs, pins, repositories, objects (EACCES)
    ref = mnt / "repos" / "r" / "refs" / "heads" / "main"
    first = git_out("-C", str(src), "rev-parse", "HEAD~1").strip()
    sha = hashlib.sha256(b"x").hexdigest()
    got = probe(
        other,
        ("write", str(mnt / ".alkfs" / "control"), "sweep\n"),
        ("write", str(ref), first + "\n"),
        ("create", str(mnt / "repos" / "r" / "refs" / "heads" / "other"), head + "\n"),
        ("create", str(mnt / "repos" / "r" / "refs" / "heads" / "main.lock"), first + "\n"),
        ("unlink", str(ref)),
        ("setxattr", str(orphan), "user.alkfs.pin.mine", ""),
        ("removexattr", str(pinned), "user.alkfs.pin.keep"),
        ("unlink", str(mnt / "pins" / "keep")),
        ("symlink", f"../objects/sha256/{orphan.name}", str(mnt / "pins" / "mine")),
        ("create", str(mnt / "pins" / "backup"), "keep me\n"),
        ("mkdir", str(mnt / "repos" / "mine")),
        ("unlink", str(mnt / "repos" / "r" / "HEAD")),
        ("create", str(mnt / "objects" / "sha256" / "new"), "x"),
        ("create", str(mnt / "objects" / "sha256" / sha), "x"),
        ("create", str(mnt / "git" / "sha1" / "tmp_obj_x"), "x"),
        ("create", str(mnt / "repos" / "r" / "objects" / "tmp_obj_x"), "x"),
        ("chmod", str(orphan), "644"),
        ("write", str(mnt / "repos" / "r" / "config"), "[core]\n"),
    )
    assert got == [EACCES] * len(got), got
    update = as_user(
        other, "git", f"--git-dir={mnt}/repos/r", "update-ref", "refs/heads/main", first
    )
    assert update.returncode != 0
    assert git_out("--git-dir", str(mnt / "repos" / "r"), "rev-parse", "main").strip() == head
    assert os.getxattr(pinned, "user.alkfs.pins") == b"keep"
    assert not (mnt / "repos" / "mine").exists()

    # cloning: git may ask for safe.directory (the repository is root's); the README's line
    dest = Path(other.pw_dir) / "clone"
    clone = as_user(other, "git", "clone", "-q", str(mnt / "repos" / "r"), str(dest))
    if clone.returncode != 0:
        assert "dubious ownership" in clone.stderr, clone.stderr
        line = as_user(
            other, "git", "config", "--global", "--add", "safe.directory", str(mnt / "repos" / "r")
        )
        assert line.returncode == 0, line.stderr
        clone = as_user(other, "git", "clone", "-q", str(mnt / "repos" / "r"), str(dest))
    assert clone.returncode == 0, clone.stderr
    log = as_user(other, "git", "-C", str(dest), "log", "--format=%H")
    assert log.stdout.split() == [head, first]
    assert "Traceback" not in d.log()


def test_without_allow_other_another_user_gets_nothing(base: Path, daemon, users):
    """--owner alone: the kernel lets every user in (allow_other), the daemon only the owner."""
    owner, other = users(), users()
    d = daemon("--owner", owner.pw_name)
    obj = put(d.mnt, b"hello\n")
    r = as_user(other, "cat", str(obj))
    assert r.returncode != 0 and "Permission denied" in r.stderr
    r = as_user(other, "ls", str(d.mnt))
    assert r.returncode != 0
    assert probe(owner, ("read", str(obj))) == [6]


def test_with_owner_alone_nothing_the_kernel_cached_shows_to_another_user(
    base: Path, daemon, users
):
    """The owner's lookups leave the kernel entries and attributes (an object's for
    3,600 s); another user's stat of the same paths is still EACCES, and so is a listing;
    root and the owner see the owner's bits only."""
    owner, other = users(), users()
    d = daemon("--owner", owner.pw_name)
    obj = put(d.mnt, b"cached for an hour\n")
    os.symlink(f"../objects/sha256/{obj.name}", d.mnt / "pins" / "p")
    paths = [obj, d.mnt / "pins" / "p", d.mnt / "objects" / "sha256"]
    got = probe(owner, *(("stat", str(p)) for p in paths), ("read", str(obj)))
    assert all(isinstance(g, list) and g[0] == owner.pw_uid for g in got[:-1]), got
    assert got[-1] == len(b"cached for an hour\n")
    eacces = errno.errorcode[errno.EACCES]
    assert probe(other, *(("stat", str(p)) for p in paths)) == [eacces] * len(paths)
    assert probe(other, ("read", str(obj))) == [eacces]
    r = as_user(other, "ls", str(d.mnt / "pins"))
    assert r.returncode != 0 and "Permission denied" in r.stderr
    st = os.stat(obj)
    assert (st.st_uid, st.st_mode & 0o777) == (owner.pw_uid, 0o400)
    assert os.stat(d.mnt).st_mode & 0o077 == 0
    # `cp -a`/`rsync -a` of a tree set the modes it has (0755, 0444): still no-ops
    assert probe(owner, ("chmod", str(d.mnt / "pins"), "755"), ("chmod", str(obj), "444")) == [
        "ok",
        "ok",
    ]
    r = as_user(owner, "rsync", "-a", "/etc/hostname", str(d.mnt / "pins" / "host"))
    assert r.returncode == 0, r.stderr


def test_opens_answered_in_c_let_in_no_user_the_mount_keeps_out(base: Path, daemon, users):
    """--owner alone: once root's opens of a fan-out directory are answered inside pyfuse3
    (pyfuse3-cacheddirs.patch), the owner's are too, and another user's still come to the
    daemon and are refused."""
    owner, other = users(), users()
    d = daemon("--owner", owner.pw_name)
    fan = d.mnt / "git" / "sha1" / "00"
    assert os.listdir(fan) == [] and os.listdir(fan) == []
    assert as_user(owner, "ls", str(fan)).returncode == 0
    r = as_user(other, "ls", str(fan))
    assert r.returncode != 0 and "Permission denied" in r.stderr
    r = as_user(other, "ls", str(fan))  # (again: nothing was remembered for it)
    assert r.returncode != 0 and "Permission denied" in r.stderr


# -- the --owner user ------------------------------------------------------------------------------
def test_the_owner_pushes_updates_refs_and_pins_but_not_the_control_file(base: Path, daemon, users):
    owner = users()
    d = daemon("--owner", owner.pw_name, "--allow-other")
    mnt = d.mnt
    uid, gid = owner.pw_uid, owner.pw_gid
    got = probe(
        owner,
        ("stat", str(mnt)),
        ("stat", str(mnt / "repos")),
        ("stat", str(mnt / ".alkfs" / "control")),
        ("mkdir", str(mnt / "repos" / "r")),
        ("stat", str(mnt / "repos" / "r")),
    )
    assert got == [
        [uid, gid, oct(0o40755)],
        [uid, gid, oct(0o40755)],
        [0, 0, oct(0o100600)],
        "ok",
        [uid, gid, oct(0o40755)],
    ]
    src = Path(owner.pw_dir) / "src"
    head = small_repo(src, owner)
    # no safe.directory: the repository is the owner's
    push = as_user(owner, "git", "-C", str(src), "push", "-q", str(mnt / "repos" / "r"), "main")
    assert push.returncode == 0, push.stderr
    assert (
        git_out(
            "-c", "safe.directory=*", "--git-dir", str(mnt / "repos" / "r"), "rev-parse", "main"
        ).strip()
        == head
    )
    first = as_user(owner, "git", "-C", str(src), "rev-parse", "HEAD~1").stdout.strip()
    upd = as_user(owner, "git", f"--git-dir={mnt}/repos/r", "update-ref", "refs/heads/old", first)
    assert upd.returncode == 0, upd.stderr
    assert (mnt / "repos" / "r" / "refs" / "heads" / "old").read_text() == first + "\n"
    obj = put(mnt, b"the owner pins this\n")
    got = probe(
        owner,
        ("write", str(mnt / "repos" / "r" / "refs" / "heads" / "old"), head + "\n"),
        ("setxattr", str(obj), "user.alkfs.pin.owners", ""),
        ("create", str(mnt / "pins" / "file"), "kept by a pin\n"),
        ("removexattr", str(obj), "user.alkfs.pin.owners"),
        ("create", str(mnt / "objects" / "sha256" / "new"), "written by the owner\n"),
        ("touch", str(obj)),
        ("write", str(mnt / ".alkfs" / "control"), "sweep\n"),
        ("access_w", str(mnt / ".alkfs" / "control")),
        ("read", str(mnt / ".alkfs" / "control")),
        # nobody writes config, hooks/ or info/
        ("write", str(mnt / "repos" / "r" / "config"), "[core]\n"),
        ("mkdir", str(mnt / "repos" / "r" / "hooks")),
        ("mkdir", str(mnt / "repos" / "r" / "info")),
        ("create", str(mnt / "repos" / "r" / "hooks" / "post-update"), "#!/bin/sh\n"),
        ("create", str(mnt / "repos" / "r" / "config.lock"), "[core]\n"),
        ("symlink", "/tmp", str(mnt / "repos" / "r" / "hooks")),
    )
    assert got == [
        "ok",
        "ok",
        "ok",
        "ok",
        "ok",
        "ok",
        EACCES,
        False,
        EACCES,
        EPERM,
        EPERM,
        EPERM,
        errno.errorcode[errno.ENOENT],
        EPERM,
        EPERM,
    ], got
    assert (mnt / "repos" / "r" / "refs" / "heads" / "old").read_text() == head + "\n"
    assert pin_target(mnt / "pins" / "file").startswith("../objects/sha256/")
    assert os.getxattr(obj, "user.alkfs.pins") == b""
    assert (
        mnt / "objects" / "sha256" / hashlib.sha256(b"written by the owner\n").hexdigest()
    ).is_file()
    # clone as the owner: no dubious ownership
    clone = as_user(
        owner, "git", "clone", "-q", str(mnt / "repos" / "r"), str(Path(owner.pw_dir) / "clone")
    )
    assert clone.returncode == 0, clone.stderr
    assert "Traceback" not in d.log()


def test_no_one_writes_config_hooks_or_info_root_included(base: Path, daemon):
    d = daemon("--allow-other")
    repo = d.mnt / "repos" / "r"
    repo.mkdir()
    config = (repo / "config").read_bytes()
    got = probe(
        None,
        ("write", str(repo / "config"), "[core]\n\tfsmonitor = /tmp/x\n"),
        ("create", str(repo / "config.lock"), "[core]\n"),
        ("mkdir", str(repo / "hooks")),
        ("mkdir", str(repo / "info")),
        ("symlink", "/tmp", str(repo / "hooks")),
        ("symlink", "/tmp", str(repo / "info")),
        ("create", str(repo / "hooks" / "pre-receive"), "#!/bin/sh\n"),
        ("create", str(repo / "info" / "attributes"), "* filter=x\n"),
        ("rename", str(repo / "HEAD"), str(repo / "config")),
        ("chmod", str(repo / "config"), "644"),
    )
    enoent = errno.errorcode[errno.ENOENT]
    assert got == [EPERM] * 6 + [enoent, enoent, EPERM, EPERM], got
    assert (repo / "config").read_bytes() == config
    assert sorted(os.listdir(repo)) == ["HEAD", "config", "objects", "packed-refs", "refs"]


# -- per-user bounds -----------------------------------------------------------------------------------
HOG = r"""
import errno, os, sys
d = sys.argv[1]
fds, out = [], []
for i in range(int(sys.argv[2]) + 1):
    try:
        fds.append(os.open(f"{d}/hog-{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        out.append("ok")
    except OSError as exc:
        out.append(errno.errorcode[exc.errno])
print(" ".join(out), flush=True)
sys.stdin.readline()  # hold the handles until told
# bytes: one file written past the bound
try:
    for _ in range(64):
        os.write(fds[0], b"x" * 65536)
    print("wrote", flush=True)
except OSError as exc:
    print(errno.errorcode[exc.errno], flush=True)
for fd in fds:
    try:
        os.close(fd)
    except OSError:
        pass
"""


def test_a_user_past_the_per_user_bounds_is_refused_while_root_keeps_working(
    base: Path, daemon, users
):
    owner = users()
    cap = 4
    d = daemon(
        "--owner",
        owner.pw_name,
        "--allow-other",
        env={"ALKFS_MAX_WRITE_HANDLES": str(cap), "ALKFS_MAX_SPOOL_BYTES": str(1 << 20)},
    )
    hog = subprocess.Popen(
        [
            "runuser",
            "-u",
            owner.pw_name,
            "--",
            "/usr/bin/python3",
            "-c",
            HOG,
            str(d.mnt / "pins"),
            str(cap),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert hog.stdout is not None and hog.stdin is not None
        line = hog.stdout.readline().split()
        assert line == ["ok"] * cap + ["EMFILE"], (line, hog.stderr.read() if hog.poll() else "")
        # while the owner holds its bound, root writes as many as it likes
        for i in range(cap + 2):
            with open(d.mnt / "pins" / f"root-{i}", "wb") as f:
                f.write(b"root %d\n" % i)
        assert len([n for n in os.listdir(d.mnt / "pins") if n.startswith("root-")]) == cap + 2
        hog.stdin.write("\n")
        hog.stdin.flush()
        assert hog.stdout.readline().split() == ["ENOSPC"]
        big = put(d.mnt, b"y" * (4 << 20))  # root: no bound on bytes
        assert big.stat().st_size == 4 << 20
        assert hog.wait(timeout=60) == 0, hog.stderr.read()
    finally:
        if hog.poll() is None:
            hog.kill()
            hog.wait(timeout=10)
    # the handles are counted back: the owner writes again
    assert probe(owner, ("create", str(d.mnt / "pins" / "after"), "again\n")) == ["ok"]
    assert "Traceback" not in d.log()


READ_HOG = r"""
import errno, os, sys
path, n = sys.argv[1], int(sys.argv[2])
fds, out = [], []
for i in range(n):
    try:
        fds.append(os.open(path, os.O_RDONLY))
        out.append("ok")
    except OSError as exc:
        out.append(errno.errorcode[exc.errno])
print(" ".join(out), flush=True)
sys.stdin.readline()  # hold the handles until told
for fd in fds:
    os.close(fd)
"""


def hold_reads(user: pwd.struct_passwd, path: Path, n: int) -> tuple[subprocess.Popen, list]:
    """`user` opens `path` for reading `n` times and holds what it got; its outcomes."""
    hog = subprocess.Popen(
        [
            "runuser",
            "-u",
            user.pw_name,
            "--",
            "/usr/bin/python3",
            "-c",
            READ_HOG,
            str(path),
            str(n),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert hog.stdout is not None
    return hog, hog.stdout.readline().split()


def test_read_handles_are_bounded_per_user_and_others_share_half_the_daemons_descriptors(
    base: Path, daemon, users
):
    """A user holding read handles gets EMFILE past ALKFS_MAX_READ_HANDLES (the others and
    root go on); users other than root and the owner together hold at most half the daemon's
    descriptor limit."""
    first, second, owner = users(), users(), users()
    cap = 6
    d = daemon("--allow-other", "--owner", owner.pw_name, env={"ALKFS_MAX_READ_HANDLES": str(cap)})
    big = put(d.mnt, os.urandom(300_000))  # (a large object: each open holds a descriptor)
    hogs = []
    try:
        hog, got = hold_reads(first, big, cap + 2)
        hogs.append(hog)
        assert got == ["ok"] * cap + ["EMFILE"] * 2, got
        hog, got = hold_reads(second, big, cap)  # another user: its own bound
        hogs.append(hog)
        assert got == ["ok"] * cap, got
        fds = [os.open(big, os.O_RDONLY) for _ in range(cap * 4)]  # root: no per-user bound
        try:
            assert all(len(os.pread(fd, 100, 0)) == 100 for fd in fds)
        finally:
            for fd in fds:
                os.close(fd)
        assert probe(owner, ("read", str(big))) == [300_000]
    finally:
        for hog in hogs:
            assert hog.stdin is not None
            hog.stdin.write("\n")
            hog.stdin.flush()
            assert hog.wait(timeout=60) == 0, hog.stderr.read() if hog.stderr else ""
    # released: counted back (RELEASE reaches the daemon after the process exits: a
    # bounded wait for it)
    deadline = time.monotonic() + 20
    while True:
        hog, got = hold_reads(first, big, cap)
        assert hog.stdin is not None
        hog.stdin.write("\n")
        hog.stdin.flush()
        assert hog.wait(timeout=60) == 0
        if got == ["ok"] * cap or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == ["ok"] * cap, got
    log = d.log()
    assert f"holds {cap} open read handles (the per-user bound)" in log and "Traceback" not in log


def test_users_other_than_root_and_the_owner_share_half_the_descriptors(base: Path, daemon, users):
    first, second, owner = users(), users(), users()
    d = daemon("--allow-other", "--owner", owner.pw_name, env={"ALKFS_MAX_READ_HANDLES": "80"})
    big = put(d.mnt, os.urandom(300_000))
    assert d.proc is not None  # (its descriptor limit made 200: the others' half is 100)
    subprocess.run(["prlimit", f"--pid={d.proc.pid}", "--nofile=200:200"], check=True)
    hogs = []
    try:
        hog, got = hold_reads(first, big, 80)
        hogs.append(hog)
        assert got == ["ok"] * 80, got
        hog, got = hold_reads(second, big, 30)
        hogs.append(hog)
        assert got == ["ok"] * 20 + ["EMFILE"] * 10, got
        hog, got = hold_reads(owner, big, 40)  # the owner's room is not the others'
        hogs.append(hog)
        assert got == ["ok"] * 40, got
        with open(big, "rb") as f:  # nor root's
            assert len(f.read()) == 300_000
    finally:
        for hog in hogs:
            assert hog.stdin is not None
            hog.stdin.write("\n")
            hog.stdin.flush()
            hog.wait(timeout=60)


def test_nothing_the_owner_makes_resolves_outside_the_mount(base: Path, daemon, users):
    owner = users()
    d = daemon("--owner", owner.pw_name)
    mnt = d.mnt
    (mnt / "repos" / "r").mkdir()
    einval = errno.errorcode[errno.EINVAL]
    got = probe(
        owner,
        ("symlink", "/etc/passwd", str(mnt / "pins" / "out")),
        ("symlink", "../../etc/passwd", str(mnt / "pins" / "up")),
        ("symlink", "/tmp", str(mnt / "repos" / "r" / "objects" / "tmp_link")),
        ("symlink", "/tmp", str(mnt / "repos" / "r" / "refs" / "heads" / "x")),
        ("symlink", "/tmp", str(mnt / "objects" / "sha256" / "x")),
    )
    assert got == [einval, einval, EPERM, EPERM, EPERM], got
    for dirpath, dirnames, filenames in os.walk(mnt / "pins"):
        for name in (*dirnames, *filenames):
            path = Path(dirpath, name)
            if path.is_symlink():
                assert path.resolve().is_relative_to(mnt), path


def test_an_unknown_owner_is_a_usage_error(base: Path):
    r = subprocess.run(
        [sys.executable, "-m", "alkfsd.main", str(base / "s"), str(base / "m")]
        + ["--owner", "no-such-user-alkfs"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "--owner: no user 'no-such-user-alkfs'" in r.stderr
    assert not (base / "s").exists()


def test_roots_are_registered_by_root_and_the_owner_only(base: Path, daemon, users):
    """/roots is writable by root and the mount's owner only; a clone another user owns is
    read by the daemon's sweeps (git's ownership check does not stop it)."""
    owner, other = users(), users()
    d = daemon("--owner", owner.pw_name, "--allow-other")
    mnt = d.mnt
    mine = Path(owner.pw_dir) / "clone"
    small_repo(mine, owner)
    theirs = Path(other.pw_dir) / "clone"
    small_repo(theirs, other)
    roots = mnt / "roots"
    got = probe(other, ("symlink", str(theirs), str(roots / "theirs")))
    assert got == [EACCES]
    assert probe(owner, ("symlink", str(mine), str(roots / "mine"))) == ["ok"]
    assert probe(other, ("unlink", str(roots / "mine"))) == [EACCES]
    assert sorted(os.listdir(roots)) == ["mine"]
    assert os.readlink(roots / "mine") == str(mine)
    control(mnt, "sweep")
    report = last_sweep(mnt)
    assert report["aborted"] is None, report  # (the owner's clone read by root's sweep)
    assert probe(owner, ("unlink", str(roots / "mine"))) == ["ok"]
    assert os.listdir(roots) == []
