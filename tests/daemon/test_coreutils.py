"""Plain tools over a real mount: `ls -l`, `stat`, `cat`, `sha256sum`, `find`, `du` and
`getfattr` over /objects, /git, /repos and /pins give exactly what is stored: each object's
bytes, size, mode, mtime and attributes, loose files of the git view, bare repositories'
plumbing and refs, and pins as symlinks to their objects."""

from __future__ import annotations

import hashlib
import os
import subprocess
import zlib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
from helpers import git, git_out

from alkfs.app import Alkfs
from alkfs.git.importer import import_repo
from alkfs.git.objects import loose_size, parse_header
from alkfs.keys import Algorithm, Key

LARGE = 200_000  # over the default threshold (131072): the large tier


def run(*args: str | os.PathLike[str], cwd: Path | None = None) -> str:
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, check=True, timeout=60
    ).stdout


def make_repo(path: Path, object_format: str) -> Path:
    """Two commits on main (one with a large blob), a side branch and an annotated tag."""
    git("init", "-q", "-b", "main", f"--object-format={object_format}", str(path))
    (path / "a.txt").write_text("first\n")
    git("add", ".", cwd=path)
    git("commit", "-q", "-m", "first", cwd=path)
    git("branch", "side", cwd=path)
    (path / "sub").mkdir()
    (path / "sub" / "big.bin").write_bytes(bytes(range(256)) * (LARGE // 256 + 1))
    git("add", ".", cwd=path)
    git("commit", "-q", "-m", "second", cwd=path)
    git("tag", "-a", "-m", "release one", "v1", cwd=path)
    return path / ".git"


@dataclass(frozen=True)
class Obj:
    key: Key
    size: int
    tier: str
    stored_ns: int
    data: bytes

    @property
    def rel(self) -> str:
        return f"objects/{self.key.algo.label}/{self.key.hex}"


@dataclass
class Served:
    m: object  # the conftest's Mount
    objects: dict[Key, Obj]
    pins: dict[str, tuple[Key, int]]  # name -> (key, created_ns)
    repos: dict[str, tuple[str, Path]]  # id -> (object format, source git dir)

    @property
    def mnt(self) -> Path:
        return self.m.mnt

    def of(self, algo: Algorithm) -> list[Obj]:
        return sorted((o for o in self.objects.values() if o.key.algo is algo), key=lambda o: o.key)


@pytest.fixture
def served(start_mount, tmp_path: Path):
    """A store with objects of every algorithm in both tiers, two pins and two imported
    repositories (sha1 and sha256), mounted."""
    store = tmp_path / "store"
    sources = {
        "one": ("sha1", make_repo(tmp_path / "one", "sha1")),
        "two": ("sha256", make_repo(tmp_path / "two", "sha256")),
    }
    with Alkfs.open(store) as app:
        small = app.store.add(b"hello, coreutils\n")
        big = app.store.add(os.urandom(LARGE))
        app.store.add(b"a blake3 object\n", Algorithm.BLAKE3)
        app.store.add(b"B" * LARGE, Algorithm.BLAKE3)
        for repo_id, (_, gitdir) in sources.items():
            import_repo(app, str(gitdir), repo_id, progress=False)
        app.pins.pin("hello", small)
        app.pins.pin("big.blob-1", big)
        objects = {}
        for algo in Algorithm:
            after = None
            while page := app.store.list(after=after, limit=500, algo=algo):
                for st in page:
                    data = app.store.get(st.key)
                    objects[st.key] = Obj(st.key, st.size, st.tier, st.stored_ns, data)
                after = page[-1].key
        pins = {p.name: (p.key, p.created_ns) for p in app.pins.list()}
    m = start_mount(store, "--window", "1h", env={"ALKFS_PACKS": "off"})  # the loose views
    yield Served(m, objects, pins, sources)
    assert m.tracebacks() == []


# -- /objects ---------------------------------------------------------------------------------


def test_ls_l_of_each_algorithm_lists_every_object_read_only_with_its_exact_size(served):
    for algo in Algorithm:
        lines = run("ls", "-l", served.mnt / "objects" / algo.label).splitlines()
        assert lines[0].startswith("total ")
        listed = {}
        for line in lines[1:]:
            mode, _links, owner, group, size, *_date, name = line.split()
            assert (mode, owner, group) == ("-r--r--r--", "root", "root")
            listed[name] = int(size)
        assert listed == {o.key.hex: o.size for o in served.of(algo)}


def test_stat_gives_size_mode_type_stored_mtime_and_a_stable_inode(served):
    paths = [served.mnt / o.rel for o in served.objects.values()]
    fmt = "%n|%s|%a|%F|%.9Y|%i"
    first = run("stat", "-c", fmt, *paths).splitlines()
    again = run("stat", "-c", fmt, *paths).splitlines()
    assert first == again  # the inode too: stable for the life of the mount
    for line, obj in zip(first, served.objects.values(), strict=True):
        name, size, mode, kind, mtime, inode = line.split("|")
        assert (name, int(size), mode, kind) == (
            str(served.mnt / obj.rel),
            obj.size,
            "444",
            "regular file",
        )
        assert mtime == f"{obj.stored_ns // 10**9}.{obj.stored_ns % 10**9:09d}"
    inodes = [line.split("|")[-1] for line in first]
    assert len(set(inodes)) == len(inodes)


def test_cat_gives_the_stored_bytes_of_every_object(served):
    for obj in served.objects.values():
        out = subprocess.run(["cat", served.mnt / obj.rel], capture_output=True, check=True)
        assert out.stdout == obj.data


@pytest.mark.parametrize(
    ("tool", "algos"),
    [("sha256sum", ("sha256", "git-sha256")), ("sha1sum", ("git-sha1",))],
)
def test_checksum_tools_print_each_object_next_to_its_own_name(served, tool, algos):
    for label in algos:
        listing = run("bash", "-c", f"{tool} *", cwd=served.mnt / "objects" / label)
        lines = listing.splitlines()
        assert len(lines) == len(served.of(Algorithm.from_label(label)))
        for line in lines:
            digest, name = line.split("  ")
            assert digest == name


def test_find_lists_exactly_every_object_file(served):
    found = run("find", served.mnt / "objects", "-type", "f").splitlines()
    assert sorted(found) == sorted(str(served.mnt / o.rel) for o in served.objects.values())
    dirs = run("find", served.mnt / "objects", "-mindepth", "1", "-type", "d").splitlines()
    assert sorted(dirs) == sorted(str(served.mnt / "objects" / a.label) for a in Algorithm)


def test_du_apparent_sizes_are_the_exact_object_sizes(served):
    for algo in Algorithm:
        top = served.mnt / "objects" / algo.label
        lines = run("du", "-ab", top).splitlines()
        sizes = {path: int(n) for n, path in (line.split("\t") for line in lines)}
        dir_size = sizes.pop(str(top))
        expected = {str(served.mnt / o.rel): o.size for o in served.of(algo)}
        assert sizes == expected
        assert dir_size == sum(expected.values()) + os.stat(top).st_size


def getfattr_dump(path: Path) -> dict[str, str]:
    out = run("getfattr", "--absolute-names", "-d", "-m", "-", path).splitlines()
    assert out[0] == f"# file: {path}"
    attrs = {}
    for line in out[1:]:
        if line:
            name, _, value = line.partition("=")
            assert value.startswith('"') and value.endswith('"'), line
            attrs[name] = value[1:-1]
    return attrs


def test_getfattr_dumps_every_attribute_of_objects_of_every_algorithm_and_both_tiers(served):
    tiers = {(o.key.algo, o.tier) for o in served.objects.values()}
    # (an import keeps git objects of any size in the pack git made of them: git.md)
    kept = {a: ("packs",) if a.is_git else ("kv", "large") for a in Algorithm}
    assert tiers == {(a, t) for a in Algorithm for t in kept[a]}
    names_of = {}
    for name, (key, _) in served.pins.items():
        names_of.setdefault(key, []).append(name)
    for obj in served.objects.values():
        attrs = getfattr_dump(served.mnt / obj.rel)
        pins = sorted(names_of.get(obj.key, []))
        expected = {
            "user.alkfs.algorithm": obj.key.algo.label,
            "user.alkfs.size": str(obj.size),
            "user.alkfs.tier": obj.tier,
            "user.alkfs.pins": ",".join(pins),
        }
        if obj.key.algo.is_git:
            expected["user.alkfs.git.type"] = parse_header(obj.data)[0]
        for name in pins:
            stamp = attrs.pop(f"user.alkfs.pin.{name}")
            created_ns = served.pins[name][1]
            seen = datetime.fromisoformat(stamp).timestamp()
            assert abs(seen - created_ns / 1e9) < 1.0, (stamp, created_ns)
        assert attrs == expected, obj.rel


# -- /git -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "algo"), [("sha1", Algorithm.GIT_SHA1), ("sha256", Algorithm.GIT_SHA256)]
)
def test_find_over_the_git_view_lists_every_object_as_a_loose_file(served, fmt, algo):
    top = served.mnt / "git" / fmt
    objs = served.of(algo)
    expected = {str(top / o.key.hex[:2] / o.key.hex[2:]): o for o in objs}
    assert sorted(run("find", top, "-type", "f").splitlines()) == sorted(expected)
    assert os.listdir(top / "pack") == []
    assert os.listdir(top / "info") == []
    sizes = dict(
        (path, int(n))
        for n, path in (line.split("\t") for line in run("du", "-ab", top).splitlines())
    )
    for path, obj in expected.items():
        assert sizes[path] == loose_size(obj.size)
        raw = subprocess.run(["cat", path], capture_output=True, check=True).stdout
        assert len(raw) == loose_size(obj.size)
        assert zlib.decompress(raw) == obj.data


@pytest.mark.parametrize(
    ("fmt", "algo"), [("sha1", Algorithm.GIT_SHA1), ("sha256", Algorithm.GIT_SHA256)]
)
def test_stat_of_a_loose_file_is_read_only_with_the_loose_size(served, fmt, algo):
    obj = served.of(algo)[0]
    path = served.mnt / "git" / fmt / obj.key.hex[:2] / obj.key.hex[2:]
    out = run("stat", "-c", "%s|%a|%F", path).strip()
    assert out == f"{loose_size(obj.size)}|444|regular file"


# -- /repos -----------------------------------------------------------------------------------


def test_ls_of_repos_lists_each_repository_as_a_bare_git_layout(served):
    assert run("ls", served.mnt / "repos").split() == sorted(served.repos)
    for repo_id, (fmt, _) in served.repos.items():
        repo = served.mnt / "repos" / repo_id
        assert run("ls", "-A", repo).split() == ["HEAD", "config", "objects", "packed-refs", "refs"]
        assert run("cat", repo / "HEAD") == "ref: refs/heads/main\n"
        assert run("ls", "-A", repo / "objects").split() == ["info", "pack"]
        assert run("cat", repo / "objects" / "info" / "alternates") == f"{served.mnt}/git/{fmt}\n"


def source_refs(gitdir: Path) -> dict[str, str]:
    out = git_out(f"--git-dir={gitdir}", "for-each-ref", "--format=%(refname) %(objectname)")
    return dict(line.split() for line in out.splitlines())


def test_find_over_repos_shows_plumbing_and_refs_only_and_cat_gives_each_oid(served):
    files = run("find", served.mnt / "repos", "-type", "f").splitlines()
    expected = set()
    for repo_id, (_, gitdir) in served.repos.items():
        repo = served.mnt / "repos" / repo_id
        plumbing = ("HEAD", "config", "packed-refs", "objects/info/alternates")
        expected |= {str(repo / n) for n in plumbing}
        for ref, oid in source_refs(gitdir).items():  # listed in packed-refs, resolved by path
            assert run("cat", repo / ref) == f"{oid}\n"
            assert f"{oid} {ref}\n" in run("cat", repo / "packed-refs")
    assert sorted(files) == sorted(expected)  # never a walk of the store's objects
    du = run("du", "-ab", served.mnt / "repos").splitlines()
    assert {line.split("\t")[1] for line in du} >= expected


def test_ls_r_of_refs_shows_heads_and_tags_and_packed_refs_lists_every_ref(served):
    repo = served.mnt / "repos" / "one"
    out = run("ls", "-R", repo / "refs")
    # refs are listed in packed-refs: the directories show refs/heads and refs/tags only
    refs = repo / "refs"
    assert out == f"{refs}:\nheads\ntags\n\n{refs}/heads:\n\n{refs}/tags:\n"
    assert run("cat", repo / "refs" / "heads" / "side").strip() in run("cat", repo / "packed-refs")


# -- /pins ------------------------------------------------------------------------------------


def test_ls_l_of_pins_shows_symlinks_to_their_objects(served):
    lines = run("ls", "-l", served.mnt / "pins").splitlines()[1:]
    links = {}
    for line in lines:
        mode, *_rest, name, arrow, target = line.split()
        assert (mode, arrow) == ("lrwxrwxrwx", "->")
        links[name] = target
    assert links == {
        name: f"../objects/{key.algo.label}/{key.hex}" for name, (key, _) in served.pins.items()
    }
    found = run("find", served.mnt / "pins", "-type", "l").splitlines()
    assert sorted(found) == sorted(str(served.mnt / "pins" / n) for n in served.pins)


def test_cat_and_sha256sum_of_a_pin_follow_it_to_the_object(served):
    for name, (key, _) in served.pins.items():
        path = served.mnt / "pins" / name
        assert os.readlink(path) == f"../objects/sha256/{key.hex}"
        data = subprocess.run(["cat", path], capture_output=True, check=True).stdout
        assert data == served.objects[key].data
        assert hashlib.sha256(data).hexdigest() == key.hex
        assert run("sha256sum", path) == f"{key.hex}  {path}\n"
        assert run("stat", "-L", "-c", "%s|%a", path) == f"{served.objects[key].size}|444\n"
