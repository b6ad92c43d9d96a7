"""Plain helpers shared by test files that cannot import each other (tests/daemon is not a
package: `daemon` is the daemon's source folder). tests/ is on sys.path (pytest prepends
the folder of the rootless tests/conftest.py), so a test file does `from helpers import ...`.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

# a fixed identity and clock, and no user or system config, for every git the tests run
GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "A U Thor",
    "GIT_AUTHOR_EMAIL": "author@example.com",
    "GIT_AUTHOR_DATE": "1700000000 +0000",
    "GIT_COMMITTER_NAME": "C O Mitter",
    "GIT_COMMITTER_EMAIL": "committer@example.com",
    "GIT_COMMITTER_DATE": "1700000000 +0000",
}


def run(*args: str | os.PathLike[str], cwd: Path | None = None, timeout: float = 120) -> str:
    """Run a tool that must succeed; its stdout."""
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, (args, done.stderr)
    return done.stdout


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def os_errno(fn, *args) -> int:
    """The errno of the OSError `fn(*args)` must raise."""
    with pytest.raises(OSError) as caught:
        fn(*args)
    return caught.value.errno


def write_close(path: Path, data: bytes, *, replace: bool = False) -> None:
    """open(O_CREAT|O_EXCL), or O_CREAT|O_TRUNC with `replace`, write, close: the close
    reports whether it was stored."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if replace else os.O_EXCL), 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def status(m) -> dict:
    """The mount `m`'s /.alkfs/status."""
    return json.loads(m.path(".alkfs", "status").read_text())


def sweep(m) -> dict:
    """Run a sweep through the mount `m`'s control file; the status's report of it."""
    m.path(".alkfs", "control").write_text("sweep\n")
    return status(m)["last_sweep"]


def git(
    *args: str | os.PathLike[str],
    cwd: str | os.PathLike[str] | None = None,
    gitdir: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    check: bool = True,
    input: bytes | None = None,
    timeout: float = 300.0,
) -> subprocess.CompletedProcess[bytes]:
    """The real git (the one helper every test runs git with): `git [--git-dir=GITDIR]
    ARGS...` in `cwd`, its stdout and stderr captured as bytes. Its environment: `environ`
    (default os.environ; pass a cleaned copy to keep the test's own variables from git and
    what it runs), GIT_ENV over it, `env` over both. Asserts success unless `check` is
    False; `input` is its stdin; killed after `timeout` seconds."""
    done = subprocess.run(
        ["git", *([f"--git-dir={gitdir}"] if gitdir is not None else []), *map(str, args)],
        cwd=cwd,
        env={**(os.environ if environ is None else environ), **GIT_ENV, **(env or {})},
        capture_output=True,
        input=input,
        timeout=timeout,
    )
    if check:
        assert done.returncode == 0, (args, done.stderr.decode(errors="replace"))
    return done


def git_out(*args: str | os.PathLike[str], **kw) -> str:
    """git(*args, **kw)'s stdout as str (not stripped)."""
    return git(*args, **kw).stdout.decode()


def git_objects(gitdir: str | os.PathLike[str]) -> dict[str, bytes]:
    """Every object of the repository at `gitdir`: hex id -> its canonical bytes
    (`<type> <size>\\0<body>`, as the store keeps git objects), from one `cat-file --batch`."""
    ids = git_out("cat-file", "--batch-all-objects", "--batch-check", gitdir=gitdir)
    names = [line.split()[0] for line in ids.splitlines()]
    out = git(
        "cat-file", "--batch", gitdir=gitdir, input="".join(n + "\n" for n in names).encode()
    ).stdout
    objects, pos = {}, 0
    for hexid in names:
        nl = out.index(b"\n", pos)
        got, kind, size = out[pos:nl].split()
        assert got.decode() == hexid
        body = out[nl + 1 : nl + 1 + int(size)]
        objects[hexid] = b"%s %d\0" % (kind, len(body)) + body
        pos = nl + 2 + int(size)
    return objects


def cp(src: Path, dst: Path) -> None:
    done = subprocess.run(["cp", str(src), str(dst)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def cat(path: Path) -> bytes:
    done = subprocess.run(["cat", str(path)], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def put(m, data: bytes) -> str:
    """A new object through MNT/objects/sha256 (stored at close, named by nothing); its hex."""
    tmp = m.path("objects", "sha256", f"new-{time.monotonic_ns()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return sha(data)


PIN_KEY_XATTR = "user.alkfs.key"


def pin_key(path: str | bytes | os.PathLike) -> str:
    """The key (`<algo>/<hex>`) of the pin at `path` under a mount's /pins, of either kind:
    a symlink made by `ln -s`/setfattr/the CLI names it by its target, a pin written as a
    file (a regular file) holds it in `user.alkfs.key`."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        algo, hexd = os.fsdecode(os.readlink(path)).split("/")[-2:]
        return f"{algo}/{hexd}"
    assert stat.S_ISREG(st.st_mode), f"{path!r} is no pin: {st}"
    return os.getxattr(path, PIN_KEY_XATTR).decode()


def pin_target(path: str | bytes | os.PathLike) -> str:
    """What the pin at `path` names as a link target, for either kind: a symlink's own
    target (`os.readlink`), or for a pin written as a file the target a link in its place
    would have, built from `user.alkfs.key`: `../objects/<algo>/<hex>` with one `../` more
    per directory of pins it is in."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return os.fsdecode(os.readlink(path))
    return "../" * _depth_in_pins(path) + "../objects/" + pin_key(path)


def _depth_in_pins(path: str | bytes | os.PathLike) -> int:
    """How many directories of pins hold `path` (0 for MNT/pins/<name>): the levels up to
    the `pins` directory at the root of a mount."""
    here = os.path.dirname(os.path.abspath(os.fsdecode(path)))
    depth = 0
    while not (os.path.basename(here) == "pins" and os.path.ismount(os.path.dirname(here))):
        up = os.path.dirname(here)
        assert up != here, f"{path!r} is not under a mount's /pins"
        here, depth = up, depth + 1
    return depth


def open_fds(pid: int) -> dict[int, str]:
    """The process's open descriptors and what each is, skipping one closed while they
    are listed (a daemon's guard opens a namespace handle and closes it as it starts)."""
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
        except FileNotFoundError:
            continue
    return out


def fuse_fds(pid: int) -> list[int]:
    """The process's descriptors of /dev/fuse."""
    return [fd for fd, target in open_fds(pid).items() if target == "/dev/fuse"]


class RecordingInvalidator:
    """The kernel channel (daemon/invalidate.py's KernelChannel) of a Context made for
    direct calls of Operations, where no kernel session takes the requests:
    `Context(store, kernel=RecordingInvalidator())`. Each request is recorded in
    `recorded`, as (parent inode, name, deleted inode), name None for an inode's
    attributes, and counts as taken at once (`wait` never waits). With no session, the
    context caches no listing, pushes no page and acknowledges no small file ahead."""

    session = False

    def __init__(self) -> None:
        self.recorded: list[tuple[int, bytes | None, int]] = []
        self._lock = threading.Lock()  # (submit runs in any thread: a sweep's deletions)

    def submit(self, parent_ino: int, name: bytes | None, deleted_ino: int = 0) -> int:
        with self._lock:
            self.recorded.append((parent_ino, name, deleted_ino))
            return len(self.recorded)

    def submit_inode(self, ino: int) -> int:
        return self.submit(ino, None)

    @property
    def submitted(self) -> int:
        with self._lock:
            return len(self.recorded)

    async def wait(self, seq: int, timeout: float) -> bool:  # noqa: ASYNC109 (as Invalidator.wait)
        return seq <= self.submitted


# -- make check: the tests that need no FUSE mount and no PostgreSQL server -----------------
# Hooks of a pytest plugin, used only when this module is loaded as one (`PYTHONPATH=tests
# pytest -p helpers`, as `make check` does); an ordinary run never calls them.
MOUNT_FIXTURES = frozenset({"mount", "start_mount", "pg_mount", "start_pg_mount"})
POSTGRES_FIXTURES = frozenset({"pg_server", "pg_uri", "pg_mount", "start_pg_mount"})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "postgres: needs the session's PostgreSQL server")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks `mount` each test that takes a mount fixture and `postgres` each that takes a
    PostgreSQL one (for -m "not mount and not postgres")."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & MOUNT_FIXTURES:
            item.add_marker(pytest.mark.mount)
        if names & POSTGRES_FIXTURES:
            item.add_marker(pytest.mark.postgres)


SKIPPED_FIXTURES = {"pg_server": "no PostgreSQL server", "start_mount": "no FUSE mount"}


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> None:
    """A test that asks for a server or a mount at run time (request.getfixturevalue: the
    PostgreSQL columns of tests/store, ALKFS_TEST_DATABASE=postgresql) is skipped instead."""
    why = SKIPPED_FIXTURES.get(fixturedef.argname)
    if why is None:
        return
    try:
        pytest.skip(f"make check: {why}")
    except pytest.skip.Exception as e:  # cached as pytest caches a fixture's own skip
        fixturedef.cached_result = (None, fixturedef.cache_key(request), (e, e.__traceback__))
        raise


def flip_pack_byte(pack: Path) -> None:
    """Flip a byte in the middle of a pack file, in place (its trailer no longer matches:
    a set that fails its checksums)."""
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pack.chmod(0o644)
    pack.write_bytes(bytes(data))


def damage_pack_objects(pack: Path) -> None:
    """Flip a byte of a sha1 pack's object data and write its checksums anew (the pack's
    trailer, the idx's copy of it and the idx's own): a set whose files verify and whose
    objects do not, which only a hash of each object catches."""
    data = bytearray(pack.read_bytes())
    data[12 + (len(data) - 32) // 2] ^= 0x5A  # (past the header, before the trailer)
    data[-20:] = hashlib.sha1(data[:-20]).digest()
    idx_path = pack.with_suffix(".idx")
    idx = bytearray(idx_path.read_bytes())
    idx[-40:-20] = data[-20:]
    idx[-20:] = hashlib.sha1(idx[:-20]).digest()
    for path, content in ((pack, data), (idx_path, idx)):
        path.chmod(0o644)
        path.write_bytes(bytes(content))
