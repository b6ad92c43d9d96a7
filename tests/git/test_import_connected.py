"""An import checks connectivity as git's fetch does: a repository with a hole is refused
before anything is stored, naming the missing object, a ref that reaches it and, for a
partial clone, saying so."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from alkfs.errors import Missing
from alkfs.git.importer import import_repo

from .conftest import GIT_ENV, Repo, stored_keys


def _loose(repo: Repo) -> Path:
    """Unpack every object of `repo` loose (so one can be removed) and return .git/objects."""
    objects = Path(repo.gitdir) / "objects"
    repo.git("repack", "-adq")
    packs = list((objects / "pack").glob("*.pack"))
    moved = []
    for pack in packs:
        dest = pack.parent.parent / pack.name
        shutil.move(pack, dest)
        moved.append(dest)
        for ext in (".idx", ".rev"):
            pack.with_suffix(ext).unlink(missing_ok=True)
    for dest in moved:
        with dest.open("rb") as f:
            repo.git("unpack-objects", "-q", input=f.read())
        dest.unlink()
    return objects


def _remove(objects: Path, oid: str) -> None:
    (objects / oid[:2] / oid[2:]).unlink()


def _history(repo: Repo) -> dict[str, str]:
    repo.write("a.txt", "one\n")
    repo.write("dir/b.txt", "two\n")
    first = repo.commit("first")
    repo.write("a.txt", "one\nmore\n")
    second = repo.commit("second")
    repo.git("branch", "side", first)
    repo.write("c.txt", "three\n")
    third = repo.commit("third")
    return {"first": first, "second": second, "third": third}


def test_a_missing_blob_refuses_the_import_naming_it_and_a_ref_and_storing_nothing(app, make_repo):
    src = make_repo()
    revs = _history(src)
    blob = src.rev(f"{revs['first']}:dir/b.txt")
    objects = _loose(src)
    _remove(objects, blob)
    with pytest.raises(Missing) as e:
        import_repo(app, src.gitdir, "holed", progress=False)
    text = str(e.value)
    assert f"lacks object {blob}" in text
    assert "(reached from HEAD)" in text and "partial clone" not in text
    assert stored_keys(app) == set()
    assert [r.id for r in app.refs.repos()] == []


def test_a_missing_commit_deep_in_history_is_named(app, make_repo):
    src = make_repo()
    revs = _history(src)
    objects = _loose(src)
    _remove(objects, revs["second"])
    with pytest.raises(Missing, match=f"lacks object {revs['second']}"):
        import_repo(app, src.gitdir, "holed", progress=False)
    assert stored_keys(app) == set()


def test_a_hole_only_one_branch_reaches_names_that_branch(app, make_repo):
    src = make_repo()
    src.write("x", "base\n")
    src.commit("base")
    src.git("checkout", "-q", "-b", "topic")
    src.write("only-topic.txt", "topic\n")
    src.commit("on topic")
    src.git("checkout", "-q", "main")
    blob = src.rev("topic:only-topic.txt")
    objects = _loose(src)
    _remove(objects, blob)
    with pytest.raises(Missing, match=f"lacks object {blob} \\(reached from refs/heads/topic\\)"):
        import_repo(app, src.gitdir, "holed", progress=False)


def test_a_partial_clone_is_named_as_such_and_nothing_is_fetched(app, make_repo, tmp_path):
    src = make_repo()
    _history(src)
    src.git("config", "uploadpack.allowFilter", "true")
    partial = tmp_path / "partial.git"
    env = {**os.environ, **GIT_ENV}
    subprocess.run(
        ["git", "clone", "-q", "--bare", "--filter=blob:none", f"file://{src.path}", str(partial)],
        check=True,
        env=env,
    )
    assert list((partial / "objects" / "pack").glob("*.promisor"))

    def present() -> int:
        out = subprocess.run(
            ["git", f"--git-dir={partial}", "cat-file", "--batch-all-objects", "--batch-check"],
            capture_output=True,
            check=True,
        ).stdout
        return len(out.splitlines())

    before = present()
    with pytest.raises(Missing) as e:
        import_repo(app, str(partial), "partial", progress=False)
    assert "the source is a partial clone" in str(e.value)
    assert present() == before  # the check fetched nothing from the promisor remote
    assert stored_keys(app) == set()
    assert [r.id for r in app.refs.repos()] == []


def test_a_whole_repository_still_imports(app, make_repo):
    src = make_repo()
    _history(src)
    _loose(src)
    result = import_repo(app, src.gitdir, "whole", progress=False)
    assert result.objects == len(src.all_object_keys()) == result.stored
    assert set(result.refs) == {"refs/heads/main", "refs/heads/side"}


def test_a_ref_naming_a_missing_object_is_named_with_that_ref(app, make_repo):
    src = make_repo()
    revs = _history(src)
    objects = _loose(src)
    src.git("update-ref", "refs/heads/gone", revs["third"])
    src.write("d.txt", "four\n")
    fourth = src.commit("fourth")
    src.git("update-ref", "refs/heads/gone", fourth)
    src.git("reset", "-q", "--hard", revs["third"])
    _remove(objects, fourth)
    with pytest.raises(Missing, match=f"lacks object {fourth} \\(reached from refs/heads/gone\\)"):
        import_repo(app, src.gitdir, "holed", progress=False)
    assert stored_keys(app) == set()
