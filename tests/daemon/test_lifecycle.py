"""The daemon's life cycle on a real mount (signals, a crash and a restart, the store lock),
and the `alkfs` command line working through a live mount (`--mount`)."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import git, git_out, pin_target

from alkfs.app import Alkfs
from alkfs.git.importer import import_repo
from alkfs.keys import Algorithm, Key

BIN = Path(sys.executable).parent
LARGE = 200_000
SMALL_DATA = b"hello, life cycle\n"
LARGE_DATA = bytes(range(256)) * (LARGE // 256)
ORPHAN_DATA = b"nobody keeps me\n"


def make_repo(path: Path) -> Path:
    git("init", "-q", "-b", "main", path)
    for i in range(3):
        (path / f"f{i}.txt").write_text(f"file {i}\n")
        git("add", ".", cwd=path)
        git("commit", "-q", "-m", f"commit {i}", cwd=path)
    git("tag", "-a", "-m", "tagged", "v1", cwd=path)
    return path / ".git"


# store_database (tests/conftest.py) for this test: `alkfs --store DIR` is given DIR's
# PostgreSQL database as $ALKFS_DATABASE under ALKFS_TEST_DATABASE=postgresql
database_for = None


@pytest.fixture(autouse=True)
def _store_databases(store_database):
    global database_for
    database_for = store_database
    yield
    database_for = None


def alkfs(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALKFS_")}
    words = list(map(str, args))
    if "--store" in words[:-1] and database_for is not None:
        database = database_for(words[words.index("--store") + 1])
        if database is not None:
            env["ALKFS_DATABASE"] = database
    return subprocess.run(
        [str(BIN / "alkfs"), *map(str, args)], capture_output=True, env=env, timeout=120
    )


UNPINNED = re.compile(rb"alkfs: \S+ is not pinned: nothing keeps it, [^\n]*\n")


def ok(*args: str | os.PathLike[str]) -> str:
    """stdout of a command that must succeed quietly (but `put`'s warning a file put
    without --pin: nothing keeps it)."""
    done = alkfs(*args)
    err = done.stderr
    if "put" in args and "--pin" not in args:
        assert len(UNPINNED.findall(err)) == done.stdout.count(b"\n"), err
        err = UNPINNED.sub(b"", err)
    assert (done.returncode, err) == (0, b""), done.stderr
    return done.stdout.decode()


def refused(*args: str | os.PathLike[str]) -> str:
    done = alkfs(*args)
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert done.stdout == b""
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


class World:
    """A store populated through the library: a small and a large sha256 object (pinned),
    a blake3 object, an orphan, and an imported repository."""

    def __init__(self, tmp_path: Path, database: str | None = None) -> None:
        self.store = tmp_path / "store"
        self.database = database
        self.src = make_repo(tmp_path / "src")
        with Alkfs.open(self.store, database=database) as app:
            self.small = app.store.add(SMALL_DATA)
            self.large = app.store.add(LARGE_DATA)
            self.blake = app.store.add(b"blake three\n", Algorithm.BLAKE3)
            self.orphan = app.store.add(ORPHAN_DATA)
            app.pins.pin("small", self.small)
            app.pins.pin("large", self.large)
            app.pins.pin("blake", self.blake)
            self.imported = import_repo(app, str(self.src), "src", progress=False)
        self.objects = 4 + self.imported.objects

    def backing(self, key: Key) -> Path:
        return self.store / "large" / key.algo.label / key.hex[:2] / key.hex


@pytest.fixture
def world(tmp_path: Path, store_database) -> World:
    return World(tmp_path, store_database(tmp_path / "store"))


@pytest.fixture
def live(world: World, start_mount):
    m = start_mount(world.store, "--window", "1h")
    yield world, m
    assert m.tracebacks() == []


# -- life cycle ------------------------------------------------------------------------------


def test_sigterm_with_a_file_held_open_in_the_mount_still_exits_0_and_leaves_no_mount(live):
    world, m = live
    fd = os.open(m.path("objects", "sha256", world.large.hex), os.O_RDONLY)
    try:
        assert os.read(fd, 10) == LARGE_DATA[:10]
        assert m.stop(signal.SIGTERM) == 0
        assert not m.mounted()  # detached although busy: no dead mount left behind
    finally:
        try:
            os.close(fd)
        except OSError as exc:  # the kernel's flush to a daemon that is gone
            assert exc.errno == errno.ENOTCONN
    assert not m.mounted()


def test_after_sigkill_a_restart_on_the_same_mountpoint_serves_every_view(live):
    world, m = live
    before = ok("--mount", m.mnt, "status")
    m.restart(kill=True)
    assert m.mounted()
    assert m.path("objects", "sha256", world.small.hex).read_bytes() == SMALL_DATA
    assert m.path("objects", "sha256", world.large.hex).read_bytes() == LARGE_DATA
    assert m.path("pins", "blake").read_bytes() == b"blake three\n"
    log = ("log", "--all", "--format=%H %T %P %s")
    assert git_out(f"--git-dir={m.path('repos', 'src')}", *log) == git_out(
        f"--git-dir={world.src}", *log
    )
    alt = m.mnt.parent / "alt.git"
    git("init", "-q", "--bare", alt)
    (alt / "objects" / "info" / "alternates").write_text(f"{m.mnt}/git/sha1\n")
    listed = git_out(f"--git-dir={alt}", "cat-file", "--batch-all-objects", "--batch-check")
    assert len(listed.splitlines()) == world.imported.objects
    after = json.loads(ok("--mount", m.mnt, "status"))
    before = json.loads(before)
    for key in ("objects", "pins", "repos", "store", "corrupt"):
        assert after[key] == before[key], key


@pytest.mark.not_on_postgres("the sqlite store's exclusive lock: a PostgreSQL store admits a fleet")
def test_a_second_daemon_on_the_same_store_is_refused_naming_the_lock(live, tmp_path):
    world, m = live
    other = tmp_path / "other"
    other.mkdir()
    try:
        done = subprocess.run(
            [str(BIN / "alkfsd"), str(world.store), str(other)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode != 0
        assert not m.is_mounted(other)
        assert str(world.store / "alkfs.lock") in done.stderr
        assert f"pid {m.pid}" in done.stderr
    finally:
        m.unmount(other)
    assert m.path("objects", "sha256", world.small.hex).read_bytes() == SMALL_DATA


@pytest.mark.not_on_postgres("the sqlite store's exclusive lock: a PostgreSQL store admits a fleet")
def test_the_cli_refuses_the_store_of_a_running_daemon_naming_the_lock(live):
    world, m = live
    line = refused("--store", world.store, "pins")
    assert line == (
        f"alkfs pins: the store {world.store} is held by another process (pid {m.pid}); "
        f"lock {world.store / 'alkfs.lock'}; work through its mount with --mount"
    )


# -- the command line through the mount: reads --------------------------------------------------


def test_cli_reads_through_the_mount_match_the_same_commands_on_the_store(world, start_mount):
    """Everything `--store` says before the daemon starts, `--mount` says through it."""
    commands = [
        ("stat", str(world.small)),
        ("stat", str(world.large)),
        ("stat", str(world.blake)),
        ("stat", world.imported.refs["refs/heads/main"]),  # a bare 40-hex is git-sha1
        ("pins",),
        ("repo", "list"),
    ]
    expected = {c: ok("--store", world.store, *c) for c in commands}
    store_status = json.loads(ok("--store", world.store, "status"))
    m = start_mount(world.store, "--window", "1h")
    for c in commands:
        assert ok("--mount", m.mnt, *c) == expected[c], c
    status = json.loads(ok("--mount", m.mnt, "status"))
    for key in ("version", "store", "objects", "pins", "repos", "sweeping", "corrupt"):
        assert status[key] == store_status[key], key
    assert status["last_sweep"] is None
    assert m.tracebacks() == []


def test_cli_get_through_the_mount_gives_exact_bytes_and_names_a_missing_key(live, tmp_path):
    world, m = live
    assert alkfs("--mount", m.mnt, "get", str(world.small)).stdout == SMALL_DATA
    out = tmp_path / "large.out"
    assert ok("--mount", m.mnt, "get", world.large.hex, "-o", out) == ""
    assert out.read_bytes() == LARGE_DATA
    missing = "sha256/" + "e" * 64
    line = refused("--mount", m.mnt, "get", missing)
    assert line == f"alkfs get: {missing}: no such object (ENOENT)"


def test_cli_sweep_through_the_mount_stages_then_deletes_the_orphan(live):
    world, m = live
    first = json.loads(ok("--mount", m.mnt, "sweep", "--window", "0"))
    assert first["aborted"] is None
    assert (first["scanned"], first["live"]) == (world.objects, world.objects - 1)
    assert (first["candidates_staged"], first["deleted"]) == (1, 0)
    second = json.loads(ok("--mount", m.mnt, "sweep", "--window", "0"))
    assert (second["candidates_staged"], second["deleted"]) == (0, 1)
    assert second["bytes_freed"] == len(ORPHAN_DATA)
    assert json.loads(ok("--mount", m.mnt, "status"))["last_sweep"] == second
    line = refused("--mount", m.mnt, "get", str(world.orphan))
    assert line == f"alkfs get: {world.orphan}: no such object (ENOENT)"


def test_cli_verify_through_the_mount_reports_a_corrupted_large_object(live):
    world, m = live
    assert json.loads(ok("--mount", m.mnt, "verify")) == {"corrupt": []}
    backing = world.backing(world.large)
    backing.write_bytes(b"\xff" + backing.read_bytes()[1:])
    done = alkfs("--mount", m.mnt, "verify")
    assert done.returncode == 1
    assert json.loads(done.stdout) == {"corrupt": [str(world.large)]}
    assert done.stderr == b"alkfs verify: 1 corrupt object\n"
    assert json.loads(ok("--mount", m.mnt, "status"))["corrupt"] == [str(world.large)]


# -- the command line through the mount: writes (objects, refs, attributes, pins) ----------------


def test_cli_put_through_the_mount_stores_under_each_algorithm(live, tmp_path):
    world, m = live
    f = tmp_path / "new.bin"
    f.write_bytes(os.urandom(LARGE))
    for algo in ("sha256", "blake3"):
        key = ok("--mount", m.mnt, "put", "--algo", algo, f).strip()
        assert key == str(Key.derive(Algorithm.from_label(algo), f.read_bytes()))
        assert m.path("objects", *key.split("/")).read_bytes() == f.read_bytes()
    names = os.listdir(m.path("objects", "sha256"))
    assert not [n for n in names if n.startswith(".")]  # the temporary name is gone


def test_cli_put_with_pin_through_the_mount_stores_and_pins(live, tmp_path):
    world, m = live
    f = tmp_path / "keep.txt"
    f.write_bytes(b"keep me through the mount\n")
    key = ok("--mount", m.mnt, "put", "--pin", "keep", f).strip()
    assert pin_target(m.path("pins", "keep")) == f"../objects/sha256/{key.split('/')[1]}"
    blake = ok("--mount", m.mnt, "put", "--algo", "blake3", "--pin", "keep-b3", f).strip()
    assert f"keep-b3 {blake}\n" in ok("--mount", m.mnt, "pins")


def test_cli_pin_and_unpin_through_the_mount(live):
    world, m = live
    assert ok("--mount", m.mnt, "pin", "again", str(world.orphan)) == ""
    assert json.loads(ok("--mount", m.mnt, "stat", str(world.orphan)))["pins"] == ["again"]
    line = refused("--mount", m.mnt, "pin", "again", str(world.small))
    assert line == "alkfs pin: the pin 'again' names another object (EEXIST)"
    assert ok("--mount", m.mnt, "unpin", "again") == f"{world.orphan}\n"  # (the key it kept)
    assert json.loads(ok("--mount", m.mnt, "stat", str(world.orphan)))["pins"] == []
    assert refused("--mount", m.mnt, "unpin", "again") == "alkfs unpin: no pin 'again' (ENOENT)"


def test_cli_repo_create_and_rm_through_the_mount(live):
    world, m = live
    assert ok("--mount", m.mnt, "repo", "create", "fresh") == ""
    assert ok("--mount", m.mnt, "repo", "list") == "fresh sha1\nsrc sha1\n"
    line = refused("--mount", m.mnt, "repo", "create", "fresh")
    assert line == "alkfs repo create: repository 'fresh' exists (EEXIST)"
    assert ok("--mount", m.mnt, "repo", "rm", "src") == ""  # refs first, then the directory
    assert ok("--mount", m.mnt, "repo", "list") == "fresh sha1\n"
    assert refused("--mount", m.mnt, "repo", "rm", "src") == (
        "alkfs repo rm: no repository 'src' (ENOENT)"
    )


def test_cli_repo_create_sha256_through_the_mount(live):
    world, m = live
    assert ok("--mount", m.mnt, "repo", "create", "r256", "--object-format", "sha256") == ""
    assert ok("--mount", m.mnt, "repo", "list") == "r256 sha256\nsrc sha1\n"
    gitdir = m.mnt / "repos" / "r256"
    assert os.getxattr(gitdir, "user.alkfs.object-format") == b"sha256"
    fmt = subprocess.run(
        ["git", f"--git-dir={gitdir}", "rev-parse", "--show-object-format"],
        capture_output=True,
        check=True,
    )
    assert fmt.stdout == b"sha256\n"
    line = refused("--mount", m.mnt, "repo", "create", "r256", "--object-format", "sha256")
    assert line == "alkfs repo create: repository 'r256' exists (EEXIST)"
    assert ok("--mount", m.mnt, "repo", "list") == "r256 sha256\nsrc sha1\n"


def test_cli_git_import_through_the_mount_pushes_every_ref(live, tmp_path):
    world, m = live
    other = make_repo(tmp_path / "other")
    (tmp_path / "other" / "more.txt").write_text("more\n")
    git("add", ".", cwd=tmp_path / "other")
    git("commit", "-q", "-m", "more", cwd=tmp_path / "other")
    said = ok("--mount", m.mnt, "git", "import", other, "--repo", "other")
    n = len(git_out(f"--git-dir={other}", "for-each-ref").splitlines())
    assert re.fullmatch(
        rf"imported {re.escape(str(other))} as other: {n} refs pushed through the mount "
        r"in \d+\.\d s\n",
        said,
    ), said
    refs = ("for-each-ref", "--format=%(objectname) %(refname)")
    assert git_out(f"--git-dir={m.path('repos', 'other')}", *refs) == git_out(
        f"--git-dir={other}", *refs
    )
    log = ("log", "--all", "--format=%H %T %P %s")
    assert git_out(f"--git-dir={m.path('repos', 'other')}", *log) == git_out(
        f"--git-dir={other}", *log
    )


def test_cli_git_import_of_a_holed_repository_is_refused_before_any_push(live, tmp_path):
    """`git import` runs git's connectivity check first: exit 1, one line naming the
    object and a ref; no repository created, on the mount as on a store."""
    world, m = live
    other = make_repo(tmp_path / "holed")
    blob = git_out(f"--git-dir={other}", "rev-parse", "HEAD:f1.txt").strip()
    (other / "objects" / blob[:2] / blob[2:]).unlink()  # (a fresh commit's objects are loose)
    line = refused("--mount", m.mnt, "git", "import", other, "--repo", "holed")
    assert line == (
        f"alkfs git import: {other} lacks object {blob} (reached from HEAD); nothing imported"
    ), line
    assert ok("--mount", m.mnt, "repo", "list") == "src sha1\n"
    store = tmp_path / "plain-store"
    line = refused("--store", store, "git", "import", other, "--repo", "holed")
    assert f"lacks object {blob} (reached from HEAD)" in line
