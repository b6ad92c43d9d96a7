"""The git views over a real mount: /git/<format> as an object directory (paged fan-out
listings, the loose form served by arithmetic), /repos/<id> as a bare repository that git
reads directly, /pins as symbolic links, and objects leaving the views after a sweep.

Each test mounts a store filled once per module through the library before any daemon
starts: two imported repositories (sha1 with a multi-block kv blob, a
large-tier blob and the empty blob; sha256), loose git blobs no ref reaches, plain objects
that no git view may show, and pins. A second store holds enough objects that every
fan-out directory is listed in several pages.
"""

from __future__ import annotations

import os
import random
import stat
import subprocess
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import git, git_out

from alkfs.app import Alkfs
from alkfs.git.importer import import_repo
from alkfs.git.objects import canonical, encode_loose, loose_size
from alkfs.keys import Algorithm, Key
from alkfs.store import Store
from alkfsd.nodes.loose import FIRST_PAGE

# These tests check the loose views (the fan-out listings, the loose form, paging), so
# their daemons serve no derived packs; tests/daemon/test_packs_mount.py covers packs.
LOOSE_ONLY = {"ALKFS_PACKS": "off"}
EXTRA_BLOBS = 300  # loose git blobs no repository references
CROWDED = 20_000  # ~78 objects per prefix: most fan-out listings take more than one query
TWO_BLOCKS = 100_000  # a kv object framed in two stored deflate blocks
LARGE = 300_000  # over the default threshold: the large tier


def run(*args: str | os.PathLike[str]) -> str:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, check=True, timeout=120
    ).stdout


def make_repo(path: Path, object_format: str) -> Path:
    rnd = random.Random(object_format)
    git("init", "-q", "-b", "main", f"--object-format={object_format}", path)

    def commit(message: str, files: dict[str, bytes]) -> None:
        for name, data in files.items():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_bytes(data)
        git("add", "-A", cwd=path)
        git("commit", "-q", "-m", message, cwd=path)

    commit("root", {"README": b"hello\n", "src/deep/a.txt": b"a\n", "empty": b""})
    commit(
        "blobs", {"two-blocks.bin": rnd.randbytes(TWO_BLOCKS), "large.bin": rnd.randbytes(LARGE)}
    )
    git("checkout", "-q", "-b", "feature/x", cwd=path)
    commit("on feature/x", {"src/deep/b.txt": b"b\n"})
    git("checkout", "-q", "main", cwd=path)
    git("tag", "-a", "-m", "release", "v1", cwd=path)
    git("tag", "light", "feature/x", cwd=path)
    return path / ".git"


def objects_of(gitdir: Path) -> dict[str, str]:
    """oid -> type of every object of a repository."""
    out = git_out(f"--git-dir={gitdir}", "cat-file", "--batch-all-objects", "--batch-check")
    return {oid: kind for oid, kind, _size in (line.split() for line in out.splitlines())}


def canonical_of(gitdir: Path, oid: str) -> bytes:
    kind = git_out(f"--git-dir={gitdir}", "cat-file", "-t", oid).strip()
    body = subprocess.run(
        ["git", f"--git-dir={gitdir}", "cat-file", kind, oid], capture_output=True, check=True
    ).stdout
    return canonical(kind, body)


@dataclass
class Stored:
    """The module's store, filled once; each test mounts it afresh."""

    path: Path
    src: Path  # sha1 source git dir (repository "one")
    src256: Path  # sha256 source git dir (repository "two")
    git_keys: dict[Algorithm, set[str]]  # every stored git object's hex, per format
    dead: Key  # a git blob nothing keeps alive
    pins: dict[str, Key]


@dataclass
class Served(Stored):
    m: Any = None  # the conftest's Mount

    @property
    def mnt(self) -> Path:
        return self.m.mnt


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Stored:
    base = tmp_path_factory.mktemp("views")
    src, src256 = make_repo(base / "one", "sha1"), make_repo(base / "two", "sha256")
    store = base / "store"
    with Alkfs.open(store) as app:
        import_repo(app, str(src), "one", progress=False)
        import_repo(app, str(src256), "two", progress=False)
        blobs = [canonical("blob", b"extra %d\n" % i) for i in range(EXTRA_BLOBS)]
        for result in app.store.put_many([(b, Algorithm.GIT_SHA1, None) for b in blobs]):
            result.pin.release()
        dead = app.store.add(canonical("blob", b"nobody keeps me\n"), algo=Algorithm.GIT_SHA1)
        plain = app.store.add(b"plain sha256 object\n")
        app.store.add(b"a blake3 object\n", algo=Algorithm.BLAKE3)
        head = Key.parse("git-sha1/" + git_out(f"--git-dir={src}", "rev-parse", "main").strip())
        pins = {"keep-plain": plain, "release-1": head}
        for key in (Key.derive(Algorithm.GIT_SHA1, b) for b in blobs[:3]):
            pins[f"extra-{key.hex[:8]}"] = key
        for name, key in pins.items():
            app.pins.pin(name, key)
        git_keys = {
            algo: {st.key.hex for st in app.store.list(limit=10**6, algo=algo)}
            for algo in (Algorithm.GIT_SHA1, Algorithm.GIT_SHA256)
        }
    return Stored(store, src, src256, git_keys, dead, pins)


@pytest.fixture
def served(stored: Stored, start_mount) -> Iterator[Served]:
    """A daemon over the module's store (`--window 1h`: no sweep deletes anything here)."""
    m = start_mount(stored.path, "--window", "1h", env=LOOSE_ONLY)
    yield Served(**vars(stored), m=m)
    assert m.tracebacks() == []


# -- /git/<format> ----------------------------------------------------------------------------


def test_each_format_lists_256_fanout_dirs_then_empty_info_and_pack(served):
    for fmt in ("sha1", "sha256"):
        top = served.mnt / "git" / fmt
        fan = [f"{i:02x}" for i in range(256)]
        assert os.listdir(top) == [*fan, "info", "pack"]
        assert os.listdir(top / "info") == []
        assert os.listdir(top / "pack") == []
        assert stat.S_ISDIR(os.stat(top / "00").st_mode)
    assert sorted(os.listdir(served.mnt / "git")) == ["sha1", "sha256"]


@pytest.mark.parametrize(
    ("fmt", "algo"), [("sha1", Algorithm.GIT_SHA1), ("sha256", Algorithm.GIT_SHA256)]
)
def test_the_fanout_dirs_list_exactly_the_objects_of_their_format_and_prefix(served, fmt, algo):
    assert_listing(served.mnt / "git" / fmt, algo, served.git_keys[algo])


def assert_listing(top: Path, algo: Algorithm, expected: set[str]) -> None:
    listed = []
    for xx in (f"{i:02x}" for i in range(256)):
        names = os.listdir(top / xx)  # readdir order, every page
        assert names == sorted(names)  # key order
        assert all(len(n) == algo.hex_len - 2 for n in names)
        listed += [xx + n for n in names]
    assert len(listed) == len(expected)
    assert set(listed) == expected
    found = run("find", top, "-type", "f").split()
    assert sorted(found) == sorted(f"{top}/{h[:2]}/{h[2:]}" for h in expected)


def test_crowded_fanout_dirs_list_every_object_once_across_pages(start_mount, tmp_path):
    blobs = [canonical("blob", b"crowd %d\n" % i) for i in range(CROWDED)]
    store = tmp_path / "store"
    with Alkfs.open(store) as app:
        for result in app.store.put_many([(b, Algorithm.GIT_SHA1, None) for b in blobs]):
            result.pin.release()
    m = start_mount(store, "--window", "1h", env=LOOSE_ONLY)
    expected = {Key.derive(Algorithm.GIT_SHA1, b).hex for b in blobs}
    per_prefix = Counter(h[:2] for h in expected)
    assert sum(1 for n in per_prefix.values() if n > FIRST_PAGE) == 242  # more than one query
    assert_listing(m.mnt / "git" / "sha1", Algorithm.GIT_SHA1, expected)
    assert m.tracebacks() == []


def test_a_loose_file_is_read_only_with_the_loose_size_and_inflates_to_the_object(served):
    for oid in objects_of(served.src):
        data = canonical_of(served.src, oid)
        path = served.mnt / "git" / "sha1" / oid[:2] / oid[2:]
        st = os.stat(path)
        assert (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode)) == (stat.S_IFREG, 0o444)
        assert st.st_size == loose_size(len(data))
        raw = subprocess.run(["cat", path], capture_output=True, check=True).stdout
        assert raw == encode_loose(data)
        assert zlib.decompress(raw) == data


def test_ranges_of_multi_block_large_and_empty_loose_files_are_the_encoded_bytes(served):
    sizes = {len(b"blob 0\0"), len(b"blob %d\0" % TWO_BLOCKS) + TWO_BLOCKS}
    sizes.add(len(b"blob %d\0" % LARGE) + LARGE)
    oids = [
        oid
        for oid, kind in objects_of(served.src).items()
        if kind == "blob" and len(canonical_of(served.src, oid)) in sizes
    ]
    assert len(oids) == 3
    rnd = random.Random(7)
    for oid in oids:
        want = encode_loose(canonical_of(served.src, oid))
        fd = os.open(served.mnt / "git" / "sha1" / oid[:2] / oid[2:], os.O_RDONLY)
        try:
            # stored-block boundaries (every 65540 bytes after the 2-byte header), the
            # trailer, past the end, then random ranges; the kernel rounds reads to pages
            edges = [0, 1, 2, 6, 7, 65541, 65542, 65547, len(want) - 4, len(want) - 1]
            ranges = [(e, 9) for e in edges] + [(len(want), 10), (len(want) + 5, 1)]
            ranges += [(rnd.randrange(len(want)), rnd.randrange(1, 70_000)) for _ in range(20)]
            for off, size in ranges:
                assert os.pread(fd, size, off) == want[off : off + size], (oid, off, size)
        finally:
            os.close(fd)


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_an_alternate_on_the_git_view_reads_every_object_of_its_format(served, fmt, tmp_path):
    src = served.src if fmt == "sha1" else served.src256
    alt = tmp_path / "alt.git"
    git("init", "-q", "--bare", f"--object-format={fmt}", alt)
    (alt / "objects" / "info" / "alternates").write_text(f"{served.mnt}/git/{fmt}\n")
    count = run(
        "sh", "-c", f"git --git-dir={alt} cat-file --batch-all-objects --batch-check | wc -l"
    )
    assert int(count) == len(
        served.git_keys[Algorithm.GIT_SHA1 if fmt == "sha1" else Algorithm.GIT_SHA256]
    )
    refs = git_out(f"--git-dir={src}", "for-each-ref", "--format=update %(refname) %(objectname)")
    subprocess.run(
        ["git", f"--git-dir={alt}", "update-ref", "--stdin"], input=refs, text=True, check=True
    )
    for args in (("rev-list", "--objects", "--all"), ("log", "--stat", "--all", "--format=%H %s")):
        assert git_out(f"--git-dir={alt}", *args) == git_out(f"--git-dir={src}", *args)
    assert git_out(f"--git-dir={alt}", "fsck", "--full", "--no-dangling", "--no-progress") == ""


# -- /repos -------------------------------------------------------------------------------------


def test_repos_lists_each_repository_and_its_plumbing(served):
    repos = served.mnt / "repos"
    assert os.listdir(repos) == ["one", "two"]
    for repo_id in ("one", "two"):
        repo = repos / repo_id
        assert os.listdir(repo) == ["packed-refs", "refs", "HEAD", "config", "objects"]
        assert (repo / "HEAD").read_text() == "ref: refs/heads/main\n"
        assert os.listdir(repo / "objects") == ["info", "pack"]
        assert os.listdir(repo / "objects" / "pack") == []
        assert os.listdir(repo / "objects" / "info") == ["alternates"]
        fmt = "sha1" if repo_id == "one" else "sha256"
        assert (repo / "objects/info/alternates").read_text() == f"{served.mnt}/git/{fmt}\n"
        for absent in ("description", "info", "shallow", "logs", "HEAD.lock"):
            assert not os.path.lexists(repo / absent)
        assert not os.path.lexists(repo / "objects" / "info" / "packs")
        assert not os.path.lexists(repo / "objects" / "xy")


def test_config_is_a_minimal_bare_config_that_keeps_git_from_gc_and_maintenance(served):
    for repo_id, version, extensions in (
        ("one", "0", []),
        ("two", "1", ["extensions.objectformat=sha256"]),
    ):
        config = served.mnt / "repos" / repo_id / "config"
        listed = git_out("config", "--file", config, "--list").splitlines()
        assert listed == [
            f"core.repositoryformatversion={version}",
            "core.filemode=true",
            "core.bare=true",
            "core.logallrefupdates=false",
            *extensions,
            "gc.auto=0",
            "gc.packrefs=false",
            "gc.reflogexpire=never",
            "gc.reflogexpireunreachable=never",
            "gc.writecommitgraph=false",
            "maintenance.auto=false",
            "receive.autogc=false",
        ]
        assert (
            git_out(f"--git-dir={config.parent}", "rev-parse", "--is-bare-repository") == "true\n"
        )


def test_objects_resolves_every_object_of_the_format_but_lists_none(served):
    one = served.mnt / "repos" / "one" / "objects"
    for hexdigest in sorted(served.git_keys[Algorithm.GIT_SHA1])[:50] + [served.dead.hex]:
        view = served.mnt / "git" / "sha1" / hexdigest[:2] / hexdigest[2:]
        path = one / hexdigest[:2] / hexdigest[2:]
        assert path.read_bytes() == view.read_bytes()
        assert os.stat(path).st_ino == os.stat(view).st_ino  # one inode, one page cache
    assert os.listdir(one / served.dead.hex[:2]) == []
    some256 = next(iter(served.git_keys[Algorithm.GIT_SHA256]))
    assert not os.path.lexists(one / some256[:2] / some256[2:])  # another format
    two = served.mnt / "repos" / "two" / "objects"
    assert os.path.isfile(two / some256[:2] / some256[2:])
    assert not os.path.lexists(two / served.dead.hex[:2] / served.dead.hex[2:])


def test_ls_r_of_refs_nests_them_by_path_components(served):
    refs = served.mnt / "repos" / "one" / "refs"
    # every ref is in packed-refs; the directories list only refs/heads and refs/tags
    assert run("ls", "-R", refs) == f"{refs}:\nheads\ntags\n\n{refs}/heads:\n\n{refs}/tags:\n"
    assert (refs / "heads" / "feature").is_dir()
    for name, oid in (
        line.split()
        for line in git_out(
            f"--git-dir={served.src}", "for-each-ref", "--format=%(refname) %(objectname)"
        ).splitlines()
    ):
        assert (served.mnt / "repos" / "one" / name).read_text() == f"{oid}\n"
    assert not os.path.lexists(refs / "heads" / "nope")
    assert not os.path.lexists(refs / "remotes")


@pytest.mark.parametrize("repo_id", ["one", "two"])
def test_git_reads_the_mounted_repository_as_it_reads_the_source(served, repo_id, tmp_path):
    src = served.src if repo_id == "one" else served.src256
    repo = served.mnt / "repos" / repo_id
    for args in (
        ("log", "--format=%H", "--all"),
        ("for-each-ref",),
        ("symbolic-ref", "HEAD"),
        ("log", "-p", "-n", "3", "--format=%H %P %s"),
        ("cat-file", "--batch-all-objects", "--batch-check"),
    ):
        out = git_out(f"--git-dir={repo}", *args)
        if args[0] == "cat-file":  # the alternate shows the whole store of this format
            assert set(git_out(f"--git-dir={src}", *args).splitlines()) <= set(out.splitlines())
        else:
            assert out == git_out(f"--git-dir={src}", *args), args
    fsck = ("fsck", "--full", "--strict", "--no-dangling", "--no-progress")
    assert git_out(f"--git-dir={repo}", *fsck) == ""
    for how, flags in (("local", ()), ("transport", ("--no-local",))):
        work = tmp_path / how
        git("clone", "-q", *flags, repo, work)
        all_commits = sorted(git_out("rev-list", "--all", cwd=work).split())  # origin/* and main
        assert all_commits == sorted(git_out(f"--git-dir={src}", "rev-list", "--all").split())
        assert git_out("rev-parse", "HEAD^{tree}", cwd=work) == git_out(
            f"--git-dir={src}", "rev-parse", "HEAD^{tree}"
        )
        assert git_out("status", "--porcelain", cwd=work) == ""


def test_refs_and_head_are_read_fresh_when_they_change(served, tmp_path):
    ref = served.mnt / "repos" / "one" / "refs" / "heads" / "main"
    main = ref.read_text().strip()
    feature = git_out(f"--git-dir={served.src}", "rev-parse", "feature/x").strip()
    new_ref = served.mnt / "repos" / "one" / "refs" / "heads" / "later"
    assert not os.path.lexists(new_ref)
    # the daemon holds the store's lock; refs change beside it, as a second writer would
    store = Store.open(served.m.store_path, lock=False)
    try:
        app = Alkfs(store)
        from alkfs.git.refs import RefUpdate

        outcomes = app.refs.update(
            "one",
            [
                RefUpdate("refs/heads/main", feature, main),
                RefUpdate("refs/heads/later", main, None),
            ],
        )
        assert all(o.ok for o in outcomes)
        try:
            assert ref.read_text() == f"{feature}\n"
            assert new_ref.read_text() == f"{main}\n"
            assert git_out(f"--git-dir={ref.parents[2]}", "rev-parse", "main") == f"{feature}\n"
        finally:
            app.refs.update(
                "one",
                [
                    RefUpdate("refs/heads/main", main, feature),
                    RefUpdate("refs/heads/later", None, main),
                ],
            )
    finally:
        store.close()


# -- /pins ----------------------------------------------------------------------------------------


def test_pins_are_symlinks_to_their_objects(served):
    pins = served.mnt / "pins"
    assert os.listdir(pins) == sorted(served.pins)
    for name, key in served.pins.items():
        path = pins / name
        st = os.lstat(path)
        assert stat.S_ISLNK(st.st_mode)
        target = f"../objects/{key.algo.label}/{key.hex}"
        assert os.readlink(path) == target
        assert st.st_size == len(target)
        assert os.path.realpath(path) == str(served.mnt / "objects" / key.algo.label / key.hex)
        assert (
            os.stat(path).st_ino
            == os.stat(served.mnt / "objects" / key.algo.label / key.hex).st_ino
        )
    assert not os.path.lexists(pins / "no-such-pin")


# -- deletion ------------------------------------------------------------------------------------


def test_a_swept_object_leaves_the_git_view_and_the_repositories(start_mount, tmp_path):
    store = tmp_path / "store"
    src = make_repo(tmp_path / "src", "sha1")
    dead_data = canonical("blob", b"nobody keeps me\n")
    with Alkfs.open(store) as app:
        import_repo(app, str(src), "one", progress=False)
        dead = app.store.add(dead_data, algo=Algorithm.GIT_SHA1)
    m = start_mount(store, "--window", "0", env=LOOSE_ONLY)
    hexdigest = dead.hex
    view = m.mnt / "git" / "sha1" / hexdigest[:2] / hexdigest[2:]
    in_repo = m.mnt / "repos" / "one" / "objects" / hexdigest[:2] / hexdigest[2:]
    assert zlib.decompress(view.read_bytes()) == dead_data
    assert in_repo.is_file()  # both entries are now in the kernel's cache
    control = m.mnt / ".alkfs" / "control"
    for _ in range(2):  # window 0: the first sweep stages, the second deletes
        control.write_text("sweep\n")
    assert not os.path.lexists(view)
    assert not os.path.lexists(in_repo)
    assert hexdigest[2:] not in os.listdir(view.parent)
    alive = objects_of(src)
    found = run("find", m.mnt / "git" / "sha1", "-type", "f").split()
    assert sorted(found) == sorted(f"{m.mnt}/git/sha1/{h[:2]}/{h[2:]}" for h in alive)
    assert git_out(
        f"--git-dir={m.mnt / 'repos' / 'one'}", "log", "--format=%H", "--all"
    ) == git_out(f"--git-dir={src}", "log", "--format=%H", "--all")
    assert m.tracebacks() == []
