"""Repositories and compare-and-swap ref updates."""

from __future__ import annotations

import pytest

from alkfs.app import Alkfs
from alkfs.errors import Exists, Invalid, Missing, NotEmpty
from alkfs.git.objects import canonical
from alkfs.git.refs import ANY, Outcome, RefUpdate, valid_ref_name
from alkfs.keys import Algorithm


@pytest.fixture
def blobs(app):
    app.refs.create_repo("r")
    return [app.store.add(canonical("blob", b"%d\n" % i), Algorithm.GIT_SHA1).hex for i in range(3)]


def test_a_new_repository_has_a_symbolic_head_to_main_and_no_refs(app):
    repo = app.refs.create_repo("foo")
    assert (repo.id, repo.object_format) == ("foo", "sha1")
    assert app.refs.head("foo") == "refs/heads/main"
    assert app.refs.refs("foo") == {}
    assert app.refs.get("foo", "refs/heads/main") is None
    assert app.refs.repos() == [repo]
    assert app.refs.repo("foo") == repo


@pytest.mark.parametrize(
    "bad", ["", ".hidden", "-dash", "a/b", "a b", "x" * 101, "é", "a\nb", "..", "_under"]
)
def test_invalid_repository_ids_are_refused(app, bad):
    with pytest.raises(Invalid):
        app.refs.create_repo(bad)
    assert app.refs.repos() == []


def test_repository_ids_at_the_edges_of_the_pattern_are_accepted(app):
    for good in ["a", "A.b_c-d", "9" + "z" * 99]:
        app.refs.create_repo(good)
    assert [r.id for r in app.refs.repos()] == sorted(["a", "A.b_c-d", "9" + "z" * 99])


def test_a_taken_id_or_an_unknown_format_is_refused(app):
    app.refs.create_repo("foo")
    with pytest.raises(Exists):
        app.refs.create_repo("foo", "sha256")
    with pytest.raises(Invalid):
        app.refs.create_repo("bar", "md5")
    assert [r.id for r in app.refs.repos()] == ["foo"]


def test_missing_repositories_raise_missing(app):
    for call in (
        lambda: app.refs.repo("nope"),
        lambda: app.refs.head("nope"),
        lambda: app.refs.refs("nope"),
        lambda: app.refs.get("nope", "refs/heads/main"),
        lambda: app.refs.delete_repo("nope"),
        lambda: app.refs.set_head("nope", "refs/heads/x"),
        lambda: app.refs.update("nope", [RefUpdate("refs/heads/x", None)]),
    ):
        with pytest.raises(Missing):
            call()


def test_head_can_be_pointed_at_another_branch_but_not_outside_refs(app):
    app.refs.create_repo("foo")
    app.refs.set_head("foo", "refs/heads/dev")
    assert app.refs.head("foo") == "refs/heads/dev"
    for bad in ["HEAD", "main", "refs/heads/a..b", "other/thing"]:
        with pytest.raises(Invalid):
            app.refs.set_head("foo", bad)
    assert app.refs.head("foo") == "refs/heads/dev"


def test_create_update_and_delete_with_the_right_expectations(app, blobs):
    a, b, _ = blobs
    ok = Outcome("refs/heads/main", True, None)
    assert app.refs.update("r", [RefUpdate("refs/heads/main", a, None)]) == [ok]
    assert app.refs.update("r", [RefUpdate("refs/heads/main", b, a)]) == [ok]
    assert app.refs.get("r", "refs/heads/main") == b
    assert app.refs.update("r", [RefUpdate("refs/heads/main", a, ANY)]) == [ok]
    assert app.refs.update("r", [RefUpdate("refs/heads/main", None, a)]) == [ok]
    assert app.refs.refs("r") == {}


def test_a_stale_expected_value_is_denied_and_changes_nothing(app, blobs):
    a, b, c = blobs
    app.refs.update("r", [RefUpdate("refs/heads/main", a, None)])
    assert app.refs.update("r", [RefUpdate("refs/heads/main", c, b)]) == [
        Outcome("refs/heads/main", False, "stale")
    ]
    assert app.refs.get("r", "refs/heads/main") == a


def test_creating_over_an_existing_ref_is_denied(app, blobs):
    a, b, _ = blobs
    app.refs.update("r", [RefUpdate("refs/heads/main", a, None)])
    assert app.refs.update("r", [RefUpdate("refs/heads/main", b, None)]) == [
        Outcome("refs/heads/main", False, "exists")
    ]
    assert app.refs.get("r", "refs/heads/main") == a


def test_deleting_or_expecting_a_missing_ref_is_denied(app, blobs):
    a, b, _ = blobs
    assert app.refs.update("r", [RefUpdate("refs/heads/gone", None)]) == [
        Outcome("refs/heads/gone", False, "missing-ref")
    ]
    assert app.refs.update("r", [RefUpdate("refs/heads/gone", None, a)]) == [
        Outcome("refs/heads/gone", False, "missing-ref")
    ]
    assert app.refs.update("r", [RefUpdate("refs/heads/gone", b, a)]) == [
        Outcome("refs/heads/gone", False, "missing-ref")
    ]
    assert app.refs.refs("r") == {}


def test_a_ref_may_only_point_at_a_stored_object_of_the_repository_format(app, blobs):
    absent = "ab" * 20
    sha256_like = "ab" * 32
    upper = blobs[0].upper()
    outcomes = app.refs.update(
        "r",
        [
            RefUpdate("refs/heads/a", absent, None),
            RefUpdate("refs/heads/b", sha256_like, None),
            RefUpdate("refs/heads/c", upper, None),
            RefUpdate("refs/heads/d", "not hex", None),
        ],
        atomic=False,
    )
    assert [o.reason for o in outcomes] == ["missing-object"] * 4
    assert app.refs.refs("r") == {}


def test_an_atomic_batch_with_one_bad_update_changes_nothing(app, blobs):
    a, b, c = blobs
    app.refs.update("r", [RefUpdate("refs/heads/main", a, None)])
    counter = app.refs.write_counter
    outcomes = app.refs.update(
        "r",
        [
            RefUpdate("refs/heads/main", b, a),
            RefUpdate("refs/heads/new", c, None),
            RefUpdate("refs/heads/main2", c, b),  # stale: it does not exist
            RefUpdate("refs/tags/v1", a, None),
        ],
    )
    assert outcomes == [
        Outcome("refs/heads/main", False, "atomic-sibling-failed"),
        Outcome("refs/heads/new", False, "atomic-sibling-failed"),
        Outcome("refs/heads/main2", False, "missing-ref"),
        Outcome("refs/tags/v1", False, "atomic-sibling-failed"),
    ]
    assert app.refs.refs("r") == {"refs/heads/main": a}
    assert app.refs.write_counter == counter


def test_an_atomic_batch_with_an_invalid_name_or_object_changes_nothing(app, blobs):
    a, b, _ = blobs
    outcomes = app.refs.update(
        "r",
        [
            RefUpdate("refs/heads/ok", a, None),
            RefUpdate("refs/heads/bad..name", a, None),
            RefUpdate("refs/heads/absent", "cd" * 20, None),
        ],
    )
    assert [(o.ok, o.reason) for o in outcomes] == [
        (False, "atomic-sibling-failed"),
        (False, "invalid-name"),
        (False, "missing-object"),
    ]
    assert app.refs.refs("r") == {}


def test_a_per_ref_batch_applies_the_good_updates(app, blobs):
    a, b, c = blobs
    app.refs.update("r", [RefUpdate("refs/heads/main", a, None)])
    outcomes = app.refs.update(
        "r",
        [
            RefUpdate("refs/heads/main", b, c),  # stale
            RefUpdate("refs/heads/new", c, None),
            RefUpdate("HEAD", a, None),  # not under refs/
            RefUpdate("refs/tags/v1", a, None),
        ],
        atomic=False,
    )
    assert [(o.name, o.ok, o.reason) for o in outcomes] == [
        ("refs/heads/main", False, "stale"),
        ("refs/heads/new", True, None),
        ("HEAD", False, "invalid-name"),
        ("refs/tags/v1", True, None),
    ]
    assert app.refs.refs("r") == {"refs/heads/main": a, "refs/heads/new": c, "refs/tags/v1": a}
    assert app.refs.refs("r", "refs/tags/") == {"refs/tags/v1": a}


def test_a_ref_cannot_be_both_a_file_and_a_directory(app, blobs):
    a, _, _ = blobs
    app.refs.update("r", [RefUpdate("refs/heads/dir/leaf", a, None)])
    outcomes = app.refs.update(
        "r",
        [RefUpdate("refs/heads/dir", a, None), RefUpdate("refs/heads/dir/leaf/deeper", a, None)],
        atomic=False,
    )
    assert [o.reason for o in outcomes] == ["exists", "exists"]
    assert app.refs.refs("r") == {"refs/heads/dir/leaf": a}


@pytest.mark.parametrize(
    "name",
    [
        "refs/heads/main",
        "refs/tags/v1.0",
        "refs/pull/12/head",
        "refs/heads/feature/x-y_z",
        "refs/heads/ünï",
        "refs/heads/a.b",
    ],
)
def test_names_git_accepts_are_valid(name, tmp_path):
    assert valid_ref_name(name) is True
    assert _git_check_ref_format(name) is True


@pytest.mark.parametrize(
    "name",
    [
        "",
        "main",
        "refs/heads/",
        "/refs/heads/x",
        "refs//heads",
        "refs/heads/.hidden",
        "refs/heads/x.lock",
        "refs/heads/a..b",
        "refs/heads/a b",
        "refs/heads/a~1",
        "refs/heads/a^",
        "refs/heads/a:b",
        "refs/heads/a?",
        "refs/heads/a*",
        "refs/heads/a[",
        "refs/heads/a\\b",
        "refs/heads/a@{1}",
        "refs/heads/end.",
        "refs/heads/\x7f",
        "refs/heads/tab\t",
        "@",
    ],
)
def test_names_git_refuses_are_invalid(name):
    assert valid_ref_name(name) is False
    assert _git_check_ref_format(name) is False


def _git_check_ref_format(name: str) -> bool:
    import subprocess

    if "\0" in name:
        return False
    return subprocess.run(["git", "check-ref-format", name], capture_output=True).returncode == 0


def test_invalid_ref_names_are_refused_by_update(app, blobs):
    outcomes = app.refs.update("r", [RefUpdate("refs/heads/a..b", blobs[0], None)], atomic=False)
    assert outcomes == [Outcome("refs/heads/a..b", False, "invalid-name")]


def test_deleting_a_repository_deletes_its_refs_and_only_its_own(app, blobs):
    a, b, _ = blobs
    app.refs.create_repo("other")
    app.refs.update("r", [RefUpdate("refs/heads/main", a, None)])
    app.refs.update("other", [RefUpdate("refs/heads/main", b, None)])
    app.refs.delete_repo("r")
    assert [r.id for r in app.refs.repos()] == ["other"]
    assert app.refs.snapshot()[0] == [("other", "refs/heads/main", b)]
    app.refs.create_repo("r")
    assert app.refs.refs("r") == {}


def test_the_snapshot_is_ordered_and_its_fingerprint_follows_the_rows(app, blobs):
    a, b, _ = blobs
    app.refs.create_repo("a-first")
    empty = app.refs.snapshot()
    app.refs.update("r", [RefUpdate("refs/heads/z", a, None), RefUpdate("refs/heads/m", b, None)])
    app.refs.update("a-first", [RefUpdate("refs/heads/main", a, None)])
    rows, fp = app.refs.snapshot()
    assert rows == [
        ("a-first", "refs/heads/main", a),
        ("r", "refs/heads/m", b),
        ("r", "refs/heads/z", a),
    ]
    assert fp != empty[1]
    assert app.refs.snapshot() == (rows, fp)
    app.refs.update("r", [RefUpdate("refs/heads/z", b, a)])
    assert app.refs.snapshot()[1] != fp


def test_refs_and_repositories_survive_a_reopen(tmp_path, blobs, app):
    a, _, _ = blobs
    app.refs.update("r", [RefUpdate("refs/heads/main", a, None)])
    app.refs.set_head("r", "refs/heads/trunk")
    app.close()
    again = Alkfs.open(tmp_path / "store")
    try:
        assert [r.id for r in again.refs.repos()] == ["r"]
        assert again.refs.refs("r") == {"refs/heads/main": a}
        assert again.refs.head("r") == "refs/heads/trunk"
    finally:
        again.close()


def test_a_sha256_repository_takes_sha256_object_ids(app):
    app.refs.create_repo("s", "sha256")
    key = app.store.add(canonical("blob", b"x\n"), Algorithm.GIT_SHA256)
    short = app.store.add(canonical("blob", b"x\n"), Algorithm.GIT_SHA1)
    outcomes = app.refs.update(
        "s",
        [RefUpdate("refs/heads/main", key.hex, None), RefUpdate("refs/heads/s1", short.hex, None)],
        atomic=False,
    )
    assert [o.reason for o in outcomes] == [None, "missing-object"]
    assert app.refs.refs("s") == {"refs/heads/main": key.hex}


def test_refs_under_a_prefix_are_exactly_those_starting_with_it(app, blobs):
    a, _, _ = blobs
    names = [
        "refs/heads/a",
        "refs/heads/a/b",
        "refs/heads/a-b",
        "refs/heads/a0",
        "refs/heads/b",
        "refs/heads/ä",
        "refs/headsx/y",
        "refs/tags/v1",
    ]
    app.refs.update("r", [RefUpdate(n, a, None) for n in names if n != "refs/heads/a"])
    for prefix in [
        "",
        "refs/",
        "refs/heads/",
        "refs/heads/a",
        "refs/heads/a/",
        "refs/heads/ä",
        "x",
    ]:
        expected = {n: a for n in sorted(names) if n.startswith(prefix) and n != "refs/heads/a"}
        assert app.refs.refs("r", prefix) == expected
        assert list(app.refs.refs("r", prefix)) == sorted(expected)


def test_the_object_format_changes_only_while_no_ref_exists(app, blobs):
    app.refs.create_repo("empty")
    assert app.refs.set_object_format("empty", "sha256").object_format == "sha256"
    assert app.refs.repo("empty").object_format == "sha256"
    assert app.refs.set_object_format("empty", "sha1").object_format == "sha1"
    with pytest.raises(Invalid):
        app.refs.set_object_format("empty", "md5")
    with pytest.raises(Missing):
        app.refs.set_object_format("nope", "sha256")
    app.refs.update("r", [RefUpdate("refs/heads/main", blobs[0], None)])
    with pytest.raises(NotEmpty):
        app.refs.set_object_format("r", "sha256")
    assert [(r.id, r.object_format) for r in app.refs.repos()] == [("empty", "sha1"), ("r", "sha1")]


def test_a_format_change_between_the_check_and_the_commit_is_a_lost_race(app, blobs, monkeypatch):
    app.refs.create_repo("x")
    real = app.refs.repo

    def read_then_change(repo_id):
        repo = real(repo_id)  # what update checks the ids against: sha1
        monkeypatch.undo()
        app.refs.set_object_format(repo_id, "sha256")  # commits before update's transaction
        return repo

    monkeypatch.setattr(app.refs, "repo", read_then_change)
    out = app.refs.update("x", [RefUpdate("refs/heads/main", blobs[0], None)])
    assert out == [Outcome("refs/heads/main", False, "stale")]
    assert app.refs.refs("x") == {}
    assert app.refs.repo("x").object_format == "sha256"
