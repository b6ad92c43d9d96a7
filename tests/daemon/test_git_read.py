"""git reads straight out of a real mount: /repos/<id> as a bare repository, and /git/<format>
as an alternate object directory. The sources (a generated history with merges and tags in
both object formats, and this project's own history) are imported through the library before
the daemon starts; every git output through the mount must equal the source's."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import git, git_out

from alkfs.app import Alkfs
from alkfs.git.importer import import_repo

PROJECT = Path(__file__).resolve().parents[2]
LARGE = 150_000  # a blob over the default threshold: served from the large tier


def at(minute: int = 0) -> dict[str, str]:
    """The environment that dates a commit or tag `minute` minutes past a fixed clock."""
    stamp = f"{1_767_000_000 + 60 * minute} +0000"
    return {"GIT_AUTHOR_DATE": stamp, "GIT_COMMITTER_DATE": stamp}


def make_history(path: Path, object_format: str) -> Path:
    """A history with branches, a two-parent and an octopus merge, an empty commit, an
    executable, a symlink, a large blob, lightweight and annotated tags and a tag of a tag."""
    git_out("init", "-q", "-b", "main", f"--object-format={object_format}", path)
    n = iter(range(1, 1000))

    def commit(message: str, *files: tuple[str, bytes]) -> None:
        for name, data in files:
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_bytes(data)
        git_out("add", "-A", cwd=path)
        git_out("commit", "-q", "--allow-empty", "-m", message, cwd=path, env=at(next(n)))

    commit("root", ("README", b"hello\n"), ("src/a.py", b"print('a')\n"))
    commit("large blob", ("data/big.bin", bytes(range(256)) * (LARGE // 256)))
    git_out("checkout", "-q", "-b", "feature", "HEAD~1", cwd=path)
    commit("feature one", ("src/b.py", b"print('b')\n"))
    (path / "run.sh").write_text("#!/bin/sh\necho run\n")
    os.chmod(path / "run.sh", 0o755)
    os.symlink("src/a.py", path / "link")
    commit("feature two: executable and symlink")
    git_out("checkout", "-q", "-b", "fix", "main", cwd=path)
    commit("fix", ("README", b"hello, fixed\n"))
    git_out("checkout", "-q", "-b", "docs", "main", cwd=path)
    commit("docs", ("docs/index.md", b"# docs\n"))
    git_out("checkout", "-q", "main", cwd=path)
    git_out("merge", "-q", "--no-ff", "-m", "merge feature", "feature", cwd=path, env=at(next(n)))
    git_out("tag", "light", cwd=path)
    git_out("merge", "-q", "--no-ff", "-m", "octopus", "fix", "docs", cwd=path, env=at(next(n)))
    commit("empty")
    git_out("tag", "-a", "-m", "release one", "v1", cwd=path, env=at(next(n)))
    git_out("tag", "-a", "-m", "signed-off release", "v1-outer", "v1", cwd=path, env=at(next(n)))
    git_out("checkout", "-q", "-b", "topic", "feature", cwd=path)
    commit("unmerged topic", ("src/c.py", b"print('c')\n"))
    git_out("checkout", "-q", "main", cwd=path)
    return path / ".git"


@dataclass
class Served:
    m: object  # the conftest's Mount
    sources: dict[str, tuple[str, Path]]  # repo id -> (object format, source git dir)

    def repo(self, repo_id: str) -> Path:
        return self.m.mnt / "repos" / repo_id


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, tuple[str, Path]]:
    """The source repositories (made once per module; tests only read them)."""
    top = tmp_path_factory.mktemp("sources")
    git_out("clone", "-q", "--mirror", PROJECT / ".git", top / "self.git")
    return {
        "gen": ("sha1", make_history(top / "gen", "sha1")),
        "gen256": ("sha256", make_history(top / "gen256", "sha256")),
        "self": ("sha1", top / "self.git"),
    }


@pytest.fixture
def served(start_mount, sources, tmp_path: Path):
    store = tmp_path / "store"
    with Alkfs.open(store) as app:
        for repo_id, (_, gitdir) in sources.items():
            import_repo(app, str(gitdir), repo_id, progress=False)
    m = start_mount(store, "--window", "1h")
    yield Served(m, sources)
    assert m.tracebacks() == []


REPOS = ["gen", "gen256", "self"]
LOG = ("log", "--all", "--topo-order", "--format=%H %T %P%n%an %ae %at%n%cn %ce %ct%n%B")


@pytest.mark.parametrize("repo_id", REPOS)
def test_git_log_through_the_mounted_repository_equals_the_source(served, repo_id):
    _, src = served.sources[repo_id]
    mnt_repo = served.repo(repo_id)
    assert git_out(f"--git-dir={mnt_repo}", *LOG) == git_out(f"--git-dir={src}", *LOG)
    stat = ("log", "--all", "--stat", "--summary", "--format=%H")
    assert git_out(f"--git-dir={mnt_repo}", *stat) == git_out(f"--git-dir={src}", *stat)
    refs = ("for-each-ref", "--format=%(objectname) %(objecttype) %(refname) %(*objectname)")
    assert git_out(f"--git-dir={mnt_repo}", *refs) == git_out(f"--git-dir={src}", *refs)
    assert git_out(f"--git-dir={mnt_repo}", "symbolic-ref", "HEAD") == git_out(
        f"--git-dir={src}", "symbolic-ref", "HEAD"
    )


@pytest.mark.parametrize("repo_id", REPOS)
def test_git_fsck_full_through_the_mounted_repository_is_clean(served, repo_id):
    _, src = served.sources[repo_id]
    args = ("fsck", "--full", "--strict", "--no-dangling", "--no-progress")
    assert git_out(f"--git-dir={served.repo(repo_id)}", *args) == git_out(f"--git-dir={src}", *args)


@pytest.mark.parametrize("repo_id", REPOS)
def test_git_clone_of_the_mounted_repository_gives_the_source_history(served, repo_id, tmp_path):
    _, src = served.sources[repo_id]
    mirror = tmp_path / "mirror.git"
    git_out("clone", "-q", "--no-local", "--mirror", served.repo(repo_id), mirror)
    fsck = ("fsck", "--full", "--strict", "--no-dangling", "--no-progress")
    for args in (LOG, ("for-each-ref",), fsck):
        assert git_out(f"--git-dir={mirror}", *args) == git_out(f"--git-dir={src}", *args)
    work = tmp_path / "work"
    git_out("clone", "-q", served.repo(repo_id), work)  # a local clone, with a checkout
    index = git_out("ls-files", "-s", cwd=work)
    tree_format = "--format=%(objectmode) %(objectname) 0\t%(path)"
    assert index == git_out(f"--git-dir={src}", "ls-tree", "-r", tree_format, "HEAD")
    assert git_out("status", "--porcelain", cwd=work) == ""


def every_object(gitdir: Path) -> list[str]:
    out = git_out(f"--git-dir={gitdir}", "cat-file", "--batch-all-objects", "--batch-check")
    return out.splitlines()


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_a_repository_with_the_git_view_as_alternate_sees_every_object(served, fmt, tmp_path):
    alt = tmp_path / f"alt-{fmt}.git"
    git_out("init", "-q", "--bare", f"--object-format={fmt}", alt)
    (alt / "objects" / "info" / "alternates").write_text(f"{served.m.mnt}/git/{fmt}\n")
    expected: set[str] = set()
    for object_format, gitdir in served.sources.values():
        if object_format == fmt:
            expected |= set(every_object(gitdir))
    listed = every_object(alt)
    assert len(listed) == len(expected)
    assert sorted(listed) == sorted(expected)  # "<oid> <type> <size>", each exactly once
    gen = served.sources["gen" if fmt == "sha1" else "gen256"][1]
    oids = "".join(line.split()[0] + "\n" for line in every_object(gen))
    assert cat_batch(alt, oids) == cat_batch(gen, oids)  # every object's exact content


def cat_batch(gitdir: Path, oids: str) -> bytes:
    return git("cat-file", "--batch", gitdir=gitdir, input=oids.encode()).stdout
