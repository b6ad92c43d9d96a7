"""Importing real repositories: objects verified, refs exact, nothing collected that refs reach."""

from __future__ import annotations

import hashlib
import subprocess
import threading
from pathlib import Path

import pytest
from helpers import git_out

from alkfs.errors import Invalid, Missing, Stale
from alkfs.git.importer import import_repo
from alkfs.git.objects import canonical, split
from alkfs.git.refs import RefUpdate
from alkfs.keys import Algorithm, Key

from .conftest import GIT_ENV, stored_keys
from .scenarios import everything
from .test_closure import WriteBlocker

PROJECT_GIT = Path(__file__).resolve().parents[2] / ".git"


@pytest.fixture(scope="module")
def project_mirror(tmp_path_factory) -> Path:
    """A mirror of this project's own repository (only what its refs reach)."""
    dest = tmp_path_factory.mktemp("mirror") / "alkfs.git"
    subprocess.run(
        ["git", "clone", "-q", "--mirror", "--no-local", str(PROJECT_GIT), str(dest)],
        check=True,
        env={**GIT_ENV, "PATH": "/usr/bin:/bin"},
    )
    return dest


def test_the_project_repository_imports_verified_with_exact_refs_and_survives_two_sweeps(
    app, project_mirror
):
    result = import_repo(app, str(project_mirror), "alkfs", progress=False)
    # every object's id and type as git gives them (one cat-file for all of them: one per
    # object took most of this test's time)
    listing = git_out(
        "cat-file",
        "--batch-all-objects",
        "--batch-check=%(objectname) %(objecttype)",
        gitdir=project_mirror,
    )
    types = dict(line.split() for line in listing.splitlines())
    ids = list(types)
    assert (result.objects, result.stored, result.present) == (len(ids), len(ids), 0)
    assert stored_keys(app) == {Key.from_hex(Algorithm.GIT_SHA1, x).raw for x in ids}
    for raw in app.store.iter_keys():
        data = app.store.get(Key(raw))
        assert hashlib.sha1(data).digest() == raw[1:]
        kind, body = split(data)
        assert types[raw[1:].hex()] == kind
    refs = dict(
        line.split(" ", 1)
        for line in git_out(
            "for-each-ref", "--format=%(refname) %(objectname)", gitdir=project_mirror
        )
        .strip()
        .splitlines()
    )
    assert app.refs.refs("alkfs") == refs
    assert result.refs == refs
    assert app.refs.head("alkfs") == git_out("symbolic-ref", "HEAD", gitdir=project_mirror).strip()
    first, second = app.store.sweep(0), app.store.sweep(0)
    assert (first.aborted, first.candidates_staged, first.deleted) == (None, 0, 0)
    assert (second.aborted, second.candidates_staged, second.deleted) == (None, 0, 0)
    assert len(stored_keys(app)) == len(ids)


def test_a_rerun_stores_nothing_and_changes_no_ref(app, project_mirror):
    first = import_repo(app, str(project_mirror), "alkfs", progress=False)
    counter = app.refs.write_counter
    again = import_repo(app, str(project_mirror), "alkfs", progress=False)
    assert (again.stored, again.present, again.bytes) == (0, first.objects, 0)
    assert again.outcomes == []
    assert app.refs.write_counter == counter


def test_a_reimport_after_new_commits_stores_only_them_and_moves_the_refs(app, make_repo):
    src = make_repo()
    src.write("f", "1\n")
    src.commit("one")
    import_repo(app, src.gitdir, "r", progress=False)
    before = src.all_object_keys()
    src.write("f", "2\n")
    src.commit("two")
    src.git("tag", "v2")
    result = import_repo(app, src.gitdir, "r", progress=False)
    assert result.stored == len(src.all_object_keys() - before) == 3
    assert app.refs.refs("r") == src.for_each_ref()
    assert [o.ok for o in result.outcomes] == [True, True]


def test_a_sha256_repository_imports_with_its_format(app, make_repo):
    src = make_repo("sha256")
    everything(src)
    result = import_repo(app, src.gitdir, "s", progress=False)
    assert result.object_format == "sha256"
    assert app.refs.repo("s").object_format == "sha256"
    assert stored_keys(app) == src.all_object_keys()
    assert all(Key(k).algo is Algorithm.GIT_SHA256 for k in stored_keys(app))
    assert app.refs.refs("s") == src.for_each_ref()
    assert set(app.closure.live_keys()) == src.rev_list_keys()


def test_importing_into_a_repository_of_the_other_format_is_refused(app, make_repo):
    src = make_repo("sha256")
    src.commit("x")
    app.refs.create_repo("r", "sha1")
    with pytest.raises(Invalid):
        import_repo(app, src.gitdir, "r", progress=False)
    assert stored_keys(app) == set()


def test_deleting_a_ref_uncovers_exactly_what_only_it_reached(app, make_repo):
    src = make_repo()
    everything(src)
    src.git("checkout", "-q", "-b", "doomed", "s-linear")
    src.write("doomed.txt", "only the doomed branch has me\n")
    src.write("src/a/deep.txt", "changed on doomed\n")
    src.commit("doomed work")
    src.write("doomed.txt", "twice\n")
    src.commit("more doomed work")
    src.git("checkout", "-q", "main")
    import_repo(app, src.gitdir, "r", progress=False)
    others = [n for n in src.for_each_ref() if n != "refs/heads/doomed"]
    only_doomed = src.rev_list_keys() - src.rev_list_keys(*others)
    assert len(only_doomed) == 9  # 2 commits, 3 + 1 trees, 2 + 1 blobs
    doomed = src.rev("doomed")
    assert app.refs.update("r", [RefUpdate("refs/heads/doomed", None, doomed)])[0].ok
    first = app.store.sweep(0)
    assert (first.candidates_staged, first.deleted) == (len(only_doomed), 0)
    second = app.store.sweep(0)
    assert (second.deleted, second.candidates_staged) == (len(only_doomed), 0)
    assert stored_keys(app) == src.all_object_keys() - only_doomed
    assert set(app.closure.live_keys()) == src.rev_list_keys(*others)


def test_deleting_a_repository_uncovers_what_no_other_repository_reaches(app, make_repo):
    base = make_repo(name="base")
    base.write("shared.txt", "shared\n")
    base.commit("shared")
    fork = make_repo(name="fork")
    fork.git("fetch", "-q", str(base.path), "main")
    fork.git("reset", "-q", "--hard", "FETCH_HEAD")
    fork.write("mine.txt", "the fork's own\n")
    fork.commit("fork work")
    import_repo(app, base.gitdir, "base", progress=False)
    import_repo(app, fork.gitdir, "fork", progress=False)
    only_fork = fork.rev_list_keys() - base.rev_list_keys()
    assert len(only_fork) == 3
    app.refs.delete_repo("fork")
    assert app.store.sweep(0).candidates_staged == 3
    assert app.store.sweep(0).deleted == 3
    assert stored_keys(app) == base.all_object_keys()


def test_every_source_object_stays_pinned_until_the_refs_commit(app, make_repo):
    src = make_repo()
    everything(src)
    import_repo(app, src.gitdir, "first", progress=False)  # the objects are present already
    app.refs.create_repo("second")
    keys = [Key(k) for k in src.all_object_keys()]
    tip = Key.from_hex(Algorithm.GIT_SHA1, src.rev("main"))
    blocker = WriteBlocker(app)
    result: list = []
    worker = threading.Thread(
        target=lambda: result.append(import_repo(app, src.gitdir, "second", progress=False))
    )
    worker.start()
    while app.store.arbiter.pin_count(tip) < 2:  # the import's pin and the ref update's own
        assert worker.is_alive()
        threading.Event().wait(0.001)
    assert all(app.store.arbiter.pin_count(k) >= 1 for k in keys)  # the ref CAS is in flight
    assert app.refs.refs("second") == {}
    blocker.release()
    worker.join()
    assert app.refs.refs("second") == src.for_each_ref()
    assert app.store.arbiter.pinned_keys() == set()
    assert result[0].present == len(keys)


def test_a_work_tree_a_bare_repository_and_a_plain_directory(app, make_repo, tmp_path):
    src = make_repo()
    src.write("f", "f\n")
    src.commit("one")
    assert import_repo(app, str(src.path), "from-work-tree", progress=False).objects == 3
    bare = tmp_path / "bare.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(src.path), str(bare)], check=True)
    assert import_repo(app, str(bare), "from-bare", progress=False).present == 3
    inside = src.path / "plain"
    inside.mkdir()
    with pytest.raises(Missing):
        import_repo(app, str(inside), "nope", progress=False)
    with pytest.raises(Missing):
        app.refs.repo("nope")
    assert app.refs.refs("from-bare") == app.refs.refs("from-work-tree") == src.for_each_ref()


def test_a_refused_ref_batch_changes_no_ref_and_releases_the_objects_to_the_sweep(app, make_repo):
    src = make_repo()
    src.write("f", "f\n")
    src.commit("one")
    src.git("branch", "feature/x")
    app.refs.create_repo("r")
    kept = app.store.add(canonical("blob", b"already referenced\n"), Algorithm.GIT_SHA1)
    app.refs.update("r", [RefUpdate("refs/heads/feature", kept.hex, None)])
    with pytest.raises(Stale):
        import_repo(app, src.gitdir, "r", progress=False)  # feature/x: a D/F conflict
    assert app.refs.refs("r") == {"refs/heads/feature": kept.hex}
    assert app.store.arbiter.pinned_keys() == set()
    assert stored_keys(app) == src.all_object_keys() | {kept.raw}
    assert app.store.sweep(0).candidates_staged == 3
    assert app.store.sweep(0).deleted == 3
    assert stored_keys(app) == {kept.raw}


def test_an_empty_repository_imports_as_a_repository_without_refs(app, make_repo):
    src = make_repo()
    src.git("symbolic-ref", "HEAD", "refs/heads/trunk")
    result = import_repo(app, src.gitdir, "empty", progress=False)
    assert (result.objects, result.stored, result.refs, result.head) == (
        0,
        0,
        {},
        "refs/heads/trunk",
    )
    assert app.refs.refs("empty") == {}
    assert app.refs.head("empty") == "refs/heads/trunk"


def test_an_invalid_repository_id_is_refused_before_anything_is_stored(app, make_repo):
    src = make_repo()
    src.commit("x")
    with pytest.raises(Invalid):
        import_repo(app, src.gitdir, "bad/id", progress=False)
    assert stored_keys(app) == set()
    assert app.refs.repos() == []
