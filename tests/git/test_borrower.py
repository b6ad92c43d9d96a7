"""Borrowers (docs/gc.md, "Clones that borrow"): what a git repository outside the store
keeps alive.

Everything runs on real repositories built by the git binary and real sqlite stores:
`alkfs/git/borrower.py` (the ids a borrower names, read as files), `alkfs/roots.py` (the
registry and the liveness source it forms), the sweep keeping or letting go what a
registered borrower reaches, and `alkfs roots` on --store.

A borrower's own objects all count as live, so a check of its refs, logs and indexes is
only meaningful on a repository whose objects are elsewhere: `hollow()` moves every
object of a repository into a directory its alternates name, which is what a borrower
of the store looks like (its own object directory empty).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import GIT_ENV, git, git_out

from alkfs.app import Alkfs
from alkfs.errors import Exists, Invalid, Missing
from alkfs.gc.sweep import sweep
from alkfs.git.borrower import Gone, Unreadable, index_ids, locate, tips
from alkfs.git.importer import import_repo
from alkfs.git.refs import RefUpdate
from alkfs.keys import Algorithm, Key
from alkfs.roots import machine_id

from .conftest import stored_keys

ALKFS = str(Path(sys.executable).with_name("alkfs"))
EMPTY_BLOB = "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch):
    """No machine id or grace from the caller's environment."""
    monkeypatch.delenv("ALKFS_MACHINE_ID", raising=False)
    monkeypatch.delenv("ALKFS_ROOTS_GRACE", raising=False)


def init(path: Path, *extra: str) -> Path:
    path.mkdir(parents=True)
    git("init", "-q", "-b", "main", *extra, cwd=path)
    return path


def write(repo: Path, name: str, text: str) -> None:
    p = repo / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def commit(repo: Path, message: str, **files: str) -> str:
    """Write `files` (name=text; `__` in a name is a `/`), add everything, commit; the id."""
    for name, text in files.items():
        write(repo, name.replace("__", "/"), text)
    git("add", "-A", cwd=repo)
    git("commit", "-q", "--allow-empty", "-m", message, cwd=repo)
    return rev(repo, "HEAD")


def rev(repo: Path, what: str) -> str:
    return git_out("rev-parse", what, cwd=repo).strip()


def raw(hexes) -> set[bytes]:
    return {bytes.fromhex(h) for h in hexes}


def ids_of(out: str) -> set[str]:
    """The first word of every line (an object id) of a git listing."""
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def ls_files_ids(worktree: Path) -> set[str]:
    return {line.split()[1] for line in git_out("ls-files", "-s", cwd=worktree).splitlines()}


def closure(repo: Path, ids: set[bytes]) -> set[str]:
    """Everything git reaches from `ids` (commits, trees, blobs, tags) in `repo`."""
    stdin = "".join(x.hex() + "\n" for x in ids).encode()
    return ids_of(git_out("rev-list", "--objects", "--stdin", input=stdin, cwd=repo))


def hollow(repo: Path) -> Path:
    """Move every object of `repo` into a directory beside it that its alternates name
    (its own object directory is left empty, as a borrower's is); that directory."""
    objects = repo / ".git" / "objects" if (repo / ".git").is_dir() else repo / "objects"
    alt = repo.parent / f"{repo.name}.objects"
    alt.mkdir()
    for entry in os.listdir(objects):
        if entry != "info":
            shutil.move(objects / entry, alt / entry)
    (objects / "info").mkdir(exist_ok=True)
    (objects / "info" / "alternates").write_text(f"{alt}\n")
    assert git_out("count-objects", "-v", cwd=repo).splitlines()[:3] == [
        "count: 0",
        "size: 0",
        "in-pack: 0",
    ]
    return alt


def count_objects(repo: Path) -> int:
    """Loose plus packed objects, as `git count-objects -v` counts them."""
    fields = dict(
        line.split(": ", 1) for line in git_out("count-objects", "-v", cwd=repo).splitlines()
    )
    return int(fields["count"]) + int(fields["in-pack"])


def git_key(hexid: str) -> Key:
    return Key(bytes([Algorithm.GIT_SHA1.value]) + bytes.fromhex(hexid))


# -- index_ids on indexes git wrote ---------------------------------------------------------
def index_repo(tmp_path: Path) -> Path:
    """A repository whose index has paths of every length mod 8 (every NUL padding), nested
    directories (cache-tree subtrees) and shared path prefixes (index v4's compression)."""
    repo = init(tmp_path / "ix")
    files = {f"{'n' * k}": f"len {k}\n" for k in range(1, 11)}
    files |= {
        "dir__sub__deep.txt": "deep\n",
        "dir__sub__deeper.txt": "deeper\n",
        "dir__other.txt": "other\n",
        "dir2__x": "x\n",
    }
    commit(repo, "files", **files)
    return repo


def index_expectation(repo: Path, tree: str) -> set[bytes]:
    """`git ls-files -s` ids plus `tree` and every tree below it."""
    trees = {tree} | ids_of(
        git_out("ls-tree", "-r", "-t", "-d", "--format=%(objectname)", tree, cwd=repo)
    )
    return raw(ls_files_ids(repo) | trees)


def index_version(repo: Path) -> int:
    return int.from_bytes((repo / ".git" / "index").read_bytes()[4:8], "big")


def test_index_ids_of_a_version_2_index_are_its_entries_and_its_cache_tree(tmp_path):
    repo = index_repo(tmp_path)
    # (the cache-tree is valid: written by the commit)
    tree = git_out("write-tree", cwd=repo).strip()
    assert index_version(repo) == 2
    got = index_ids((repo / ".git" / "index").read_bytes(), 20)
    assert got == index_expectation(repo, tree)
    assert bytes.fromhex(tree) in got and bytes.fromhex(rev(repo, "HEAD:dir/sub")) in got


def test_index_ids_of_a_version_3_index_with_extended_flags(tmp_path):
    repo = index_repo(tmp_path)
    git("update-index", "--index-version", "3", cwd=repo)
    # extended flags; cache-tree still valid
    git("update-index", "--skip-worktree", "nnn", cwd=repo)
    tree = git_out("write-tree", cwd=repo).strip()
    data = (repo / ".git" / "index").read_bytes()
    assert index_version(repo) == 3
    assert index_ids(data, 20) == index_expectation(repo, tree)

    # An intent-to-add entry (extended flag, the empty blob): its directories' trees are no
    # longer valid in the cache-tree, the others still are.
    write(repo, "dir/new.txt", "not added yet\n")
    git("add", "-N", "dir/new.txt", cwd=repo)
    assert index_version(repo) == 3
    git("write-tree", cwd=repo)
    got = index_ids((repo / ".git" / "index").read_bytes(), 20)
    assert raw(ls_files_ids(repo)) <= got
    assert bytes.fromhex(EMPTY_BLOB) in got
    assert bytes.fromhex(rev(repo, "HEAD:dir/sub")) in got  # a subtree the entry left valid
    assert got <= index_expectation(repo, tree) | raw([EMPTY_BLOB])


def test_index_ids_of_a_version_4_index_with_prefix_compressed_paths(tmp_path):
    repo = index_repo(tmp_path)
    git("update-index", "--index-version", "4", cwd=repo)
    write(repo, "dir/sub/deepest.txt", "deepest\n")
    git("add", "dir/sub/deepest.txt", cwd=repo)
    tree = git_out("write-tree", cwd=repo).strip()
    assert index_version(repo) == 4
    got = index_ids((repo / ".git" / "index").read_bytes(), 20)
    assert got == index_expectation(repo, tree)
    assert bytes.fromhex(rev(repo, ":dir/sub/deepest.txt")) in got


def test_a_file_that_is_not_an_index_is_a_value_error(tmp_path):
    repo = index_repo(tmp_path)
    data = (repo / ".git" / "index").read_bytes()
    for bad in (
        b"",
        b"not an index at all, but long enough to have a header\n",
        b"DIRC" + (9).to_bytes(4, "big") + data[8:],  # an unknown version
        data[:-200],  # its entries cut short
    ):
        with pytest.raises(ValueError):  # noqa: PT011 (any: a cut may fall inside a name)
            index_ids(bad, 20)


def test_tips_reads_the_blobs_only_a_split_index_s_shared_part_records(tmp_path):
    repo = init(tmp_path / "split")
    for i in range(20):
        write(repo, f"f{i}", f"shared {i}\n")
        os.utime(repo / f"f{i}", (1_600_000_000, 1_600_000_000))  # not racy: not replaced
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "base", cwd=repo)
    git("update-index", "--split-index", cwd=repo)
    write(repo, "f20", "own\n")
    git("update-index", "--add", "f20", cwd=repo)
    shared = list((repo / ".git").glob("sharedindex.*"))
    assert len(shared) == 1
    only_shared = raw(ls_files_ids(repo)) - index_ids((repo / ".git" / "index").read_bytes(), 20)
    assert only_shared == raw(rev(repo, f"HEAD:f{i}") for i in range(20))
    assert index_ids(shared[0].read_bytes(), 20) >= only_shared

    hollow(repo)  # (its own objects would name them otherwise)
    found = tips(repo)
    assert found.own_objects == 0
    assert raw(ls_files_ids(repo)) <= found.ids
    assert only_shared <= found.ids


def test_index_ids_cover_what_git_keeps_for_an_index_resolve_undo(tmp_path):
    repo = init(tmp_path / "reuc")
    commit(repo, "base", f="base\n")
    git("checkout", "-q", "-b", "x", cwd=repo)
    picked = commit(repo, "x", f="x side\n")
    git("checkout", "-q", "main", cwd=repo)
    commit(repo, "main", f="main side\n")
    done = subprocess.run(
        ["git", "cherry-pick", picked],
        cwd=repo,
        env={**os.environ, **GIT_ENV},
        capture_output=True,
        check=False,
    )
    assert done.returncode != 0  # a conflict
    write(repo, "f", "resolved\n")
    git("add", "f", cwd=repo)  # the index records stages 1-3 as resolve-undo
    git("-c", "core.editor=true", "cherry-pick", "--continue", cwd=repo)
    indexed = ids_of(git_out("rev-list", "--objects", "--indexed-objects", cwd=repo))
    assert rev(repo, f"{picked}:f") in indexed  # git keeps the picked side's blob
    assert raw(indexed) <= index_ids((repo / ".git" / "index").read_bytes(), 20)


# -- tips of a busy repository ----------------------------------------------------------------
def busy_repo(tmp_path: Path) -> dict:
    """A repository using every kind of root git has: loose and packed refs, an annotated
    tag (packed, peeled), reflog-only commits, ORIG_HEAD, FETCH_HEAD, two stash entries, a
    linked worktree with its own branch, staged blob and reflog, a detached worktree with
    its own commit, and a main index whose cache-tree names a tree no commit has."""
    r = init(tmp_path / "busy")
    out: dict = {"repo": r}
    commit(r, "one", a="a1\n")
    commit(r, "two", dir__b="b1\n")
    git("repack", "-qd", cwd=r)  # some objects packed, the rest loose
    git("checkout", "-q", "-b", "feat", cwd=r)
    commit(r, "feat", dir__c="c1\n")
    git("checkout", "-q", "-b", "tmp", cwd=r)
    out["tagged"] = commit(r, "only the tag", t="tagged\n")
    git("tag", "-a", "-m", "annotated", "ann", cwd=r)
    git("checkout", "-q", "main", cwd=r)
    git("branch", "-q", "-D", "tmp", cwd=r)
    git("tag", "light", "main~1", cwd=r)
    git("pack-refs", "--all", cwd=r)
    commit(r, "three", a="a2\n")  # main now loose over its packed value
    write(r, "a", "stash 1\n")
    git("stash", "-q", cwd=r)
    write(r, "a", "stash 2\n")
    git("stash", "-q", cwd=r)
    out["dropped"] = commit(r, "dropped", a="a3\n")
    git("reset", "-q", "--hard", "HEAD~1", cwd=r)  # only the reflogs and ORIG_HEAD name it
    other = init(tmp_path / "other")
    out["fetched"] = commit(other, "elsewhere", o="fetched\n")
    git("fetch", "-q", str(other), "main", cwd=r)
    git("worktree", "add", "-q", "-b", "wtb", str(tmp_path / "wt1"), "main", cwd=r)
    wt1 = out["wt1"] = tmp_path / "wt1"
    commit(wt1, "in wt1", w="w1\n")
    write(wt1, "staged", "staged in wt1 only\n")
    git("add", "staged", cwd=wt1)
    git("worktree", "add", "-q", "--detach", str(tmp_path / "wt2"), "feat", cwd=r)
    wt2 = out["wt2"] = tmp_path / "wt2"
    out["detached"] = commit(wt2, "detached", d="detached\n")
    write(r, "dir/b", "staged in main\n")
    git("add", "dir/b", cwd=r)
    out["cache_tree"] = git_out("write-tree", cwd=r).strip()  # a tree only the cache-tree names
    return out


def git_reachable(worktree: Path) -> set[str]:
    """What git itself keeps locally: every ref, every reflog entry, every worktree's HEAD
    and index."""
    return ids_of(
        git_out("rev-list", "--objects", "--all", "--reflog", "--indexed-objects", cwd=worktree)
    )


def test_tips_of_a_busy_repository_name_everything_git_keeps(tmp_path):
    b = busy_repo(tmp_path)
    r, wt1, wt2 = b["repo"], b["wt1"], b["wt2"]
    own = tips(r)
    assert own.own_objects == count_objects(r)  # (no alternates: every object is its own)
    every = ids_of(git_out("cat-file", "--batch-all-objects", "--batch-check=%(objectname)", cwd=r))
    assert raw(every) <= own.ids
    before = git_reachable(r)

    hollow(r)
    found = tips(r)
    assert found.object_format == "sha1" and found.own_objects == 0
    assert all(len(x) == 20 for x in found.ids)
    refs = git_out("for-each-ref", "--format=%(objectname)", cwd=r).split()
    assert found.refs >= len(refs)
    assert raw(refs) <= found.ids
    assert raw(
        git_out("for-each-ref", "--format=%(*objectname)", "refs/tags/ann", cwd=r).split()
    ) == {bytes.fromhex(b["tagged"])}
    assert bytes.fromhex(b["tagged"]) in found.ids  # the packed tag's peeled line
    stash = git_out("stash", "list", "--format=%H", cwd=r).split()
    assert len(stash) == 2 and raw(stash) <= found.ids
    reflog = git_out("rev-list", "--reflog", "--no-walk", cwd=r).split()
    assert b["dropped"] in reflog and raw(reflog) <= found.ids
    pseudo = [rev(r, "FETCH_HEAD"), rev(r, "ORIG_HEAD")]
    assert pseudo == [b["fetched"], b["dropped"]] and raw(pseudo) <= found.ids
    heads = {rev(w, "HEAD") for w in (r, wt1, wt2)}
    assert b["detached"] in heads and raw(heads) <= found.ids
    for w in (r, wt1, wt2):
        assert raw(ls_files_ids(w)) <= found.ids, w
    assert bytes.fromhex(b["cache_tree"]) in found.ids
    assert bytes.fromhex(rev(wt1, ":staged")) in found.ids

    # Walked by git, the tips reach everything git itself keeps (and nothing it cannot read).
    reached = closure(r, found.ids)
    assert git_reachable(r) == before
    assert before <= reached
    assert {b["fetched"], b["dropped"], b["detached"], b["cache_tree"]} <= reached
    assert reached <= every

    # From a linked worktree, or the git dir itself, it is the same repository.
    for where in (wt1, wt2, r / ".git"):
        again = tips(where)
        assert (again.ids, again.refs, again.own_objects) == (found.ids, found.refs, 0), where
    assert locate(wt1).common == locate(r).common == (r / ".git").resolve()
    assert locate(wt1).git_dir == (r / ".git" / "worktrees" / "wt1").resolve()


# -- a borrower with alternates ---------------------------------------------------------------
def test_a_shared_clone_owns_nothing_but_what_it_made(tmp_path):
    src = init(tmp_path / "src")
    commit(src, "one", a="a\n")
    parent = commit(src, "two", b="b\n")
    dangling = git_out(
        "hash-object", "-w", "--stdin", input=b"only src has this\n", cwd=src
    ).strip()
    git("clone", "-q", "--shared", str(src), "b", cwd=tmp_path)
    b = tmp_path / "b"
    found = tips(b)
    assert found.own_objects == 0
    assert bytes.fromhex(dangling) not in found.ids  # the alternates are never read
    assert bytes.fromhex(parent) in found.ids

    mine = commit(b, "local", new="a file src never saw\n")
    assert count_objects(b) == 3
    found = tips(b)
    assert found.own_objects == 3  # the commit, its tree, the new blob
    assert raw([mine, rev(b, "HEAD^{tree}"), rev(b, "HEAD:new")]) <= found.ids
    assert bytes.fromhex(parent) in found.ids  # named by the local commit; only src has it
    assert bytes.fromhex(dangling) not in found.ids
    assert set(closure(b, found.ids)) >= git_reachable(b)


def test_a_tree_of_its_own_names_every_blob_whatever_the_entry_names(tmp_path):
    src = init(tmp_path / "src")
    commit(src, "one", a="a\n")
    blob = git_out("hash-object", "-w", "--stdin", input=b"only in src\n", cwd=src).strip()
    git("clone", "-q", "--shared", "--bare", str(src), "b.git", cwd=tmp_path)
    b = tmp_path / "b.git"
    tree = git_out("mktree", input=f"100644 blob {blob}\tv1.160000 final\n".encode(), cwd=b).strip()
    local = git_out("commit-tree", tree, "-p", rev(src, "HEAD"), "-m", "local", cwd=b).strip()
    git("update-ref", "refs/heads/local", local, cwd=b)
    found = tips(b)
    assert found.own_objects == 2  # the tree and the commit: the blob is src's
    assert bytes.fromhex(tree) in found.ids
    assert bytes.fromhex(blob) in found.ids


# -- what cannot be read ----------------------------------------------------------------------
def test_a_missing_path_is_gone_and_a_plain_directory_is_not_a_repository(tmp_path):
    with pytest.raises(Gone):
        tips(tmp_path / "nothing")
    with pytest.raises(Gone):
        locate(tmp_path / "nothing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(Unreadable, match="not a git repository"):
        tips(tmp_path / "plain")
    (tmp_path / "file").write_text("x\n")
    with pytest.raises(Unreadable):
        tips(tmp_path / "file")


def test_a_garbage_ref_or_packed_refs_line_is_unreadable_naming_the_file(tmp_path):
    repo = init(tmp_path / "r")
    head = commit(repo, "one", a="a\n")
    bad = repo / ".git" / "refs" / "heads" / "torn"
    bad.write_text(head[:20])  # a half-written ref
    with pytest.raises(Unreadable, match=str(bad)):
        tips(repo)
    bad.unlink()
    git("pack-refs", "--all", cwd=repo)
    packed = repo / ".git" / "packed-refs"
    packed.write_text(packed.read_text() + "not a ref line\n")
    with pytest.raises(Unreadable, match="packed-refs"):
        tips(repo)


def test_a_corrupt_index_is_unreadable_naming_it(tmp_path):
    repo = init(tmp_path / "r")
    commit(repo, "one", a="a\n", b="b\n")
    index = repo / ".git" / "index"
    data = index.read_bytes()
    for bad in (b"DIRC" + b"\xff" * 40, b"garbage" * 10, data[: len(data) // 2]):
        index.write_bytes(bad)
        with pytest.raises(Unreadable, match=str(index)):
            tips(repo)
    index.write_bytes(data)
    assert tips(repo).own_objects == count_objects(repo) == 4


def test_a_sha256_repository_gives_32_byte_ids(tmp_path):
    repo = init(tmp_path / "r256", "--object-format=sha256")
    head = commit(repo, "one", a="a\n", d__b="b\n")
    git("tag", "-a", "-m", "t", "v1", cwd=repo)
    git("pack-refs", "--all", cwd=repo)
    assert locate(repo).object_format == "sha256"
    found = tips(repo)
    assert found.object_format == "sha256"
    assert found.own_objects == count_objects(repo) == 6
    assert found.ids and all(len(x) == 32 for x in found.ids)
    assert bytes.fromhex(head) in found.ids and len(head) == 64
    hollow(repo)
    found = tips(repo)
    assert found.own_objects == 0
    assert {bytes.fromhex(head), bytes.fromhex(rev(repo, "v1"))} <= found.ids
    assert raw(ls_files_ids(repo)) <= found.ids
    assert closure(repo, found.ids) >= git_reachable(repo)


# -- the registry -----------------------------------------------------------------------------
def test_roots_register_list_get_and_remove_and_survive_a_reopen(tmp_path):
    a_repo = init(tmp_path / "a")
    b_repo = init(tmp_path / "b")
    (tmp_path / "plain").mkdir()
    app = Alkfs.open(tmp_path / "store", window_s=0)
    try:
        roots = app.roots
        for bad in ("", "a b", "a/b", ".x", "-x", "x" * 129):
            with pytest.raises(Invalid):
                roots.add(bad, str(a_repo))
        with pytest.raises(Invalid):
            roots.add("rel", "a")
        with pytest.raises(Invalid):
            roots.add("plain", str(tmp_path / "plain"))
        with pytest.raises(Invalid):
            roots.add("gone", str(tmp_path / "nothing"))
        assert roots.list() == [] and len(roots) == 0

        zb = roots.add("zb", str(b_repo))
        first = roots.add("a1", str(a_repo) + "/")  # (normalized)
        assert (first.name, first.path, first.machine) == ("a1", str(a_repo), machine_id())
        assert first.missing_since_ns is None
        assert roots.add("a1", str(a_repo)) == first  # the same again: a no-op
        with pytest.raises(Exists):
            roots.add("a1", str(b_repo))
        roots.add("m", str(a_repo / ".git"))  # a git dir; a path may have several names
        assert [r.name for r in roots.list()] == ["a1", "m", "zb"]
        assert roots.get("zb") == zb and roots.get("nope") is None
        roots.remove("m")
        with pytest.raises(Missing):
            roots.remove("m")
    finally:
        app.close()
    app = Alkfs.open(tmp_path / "store", window_s=0)
    try:
        assert app.roots.list() == [first, zb]
        assert app.status()["roots"] == 2
    finally:
        app.close()


# -- sweeps with a registered borrower --------------------------------------------------------
def side_store(tmp_path: Path, app: Alkfs) -> tuple[Path, set[bytes], str]:
    """SRC: main (3 commits) and side (2 more), imported as repository "r"; then side is
    deleted in the store. The store keys only side reached, and side's tip."""
    src = init(tmp_path / "src")
    for i in range(3):
        commit(src, f"main {i}", **{f"m{i}": f"main {i}\n"})
    git("checkout", "-q", "-b", "side", cwd=src)
    for i in range(2):
        commit(src, f"side {i}", **{f"s{i}": f"side {i}\n"})
    tip = rev(src, "side")
    git("checkout", "-q", "main", cwd=src)
    only_side = {
        git_key(h).raw for h in ids_of(git_out("rev-list", "--objects", "side", "^main", cwd=src))
    }
    assert len(only_side) == 6  # 2 commits, their 2 trees, 2 blobs
    import_repo(app, str(src), "r")
    assert {git_key(h).raw for h in ids_of(git_out("rev-list", "--objects", "--all", cwd=src))} <= (
        stored_keys(app)
    )
    [out] = app.refs.update("r", [RefUpdate("refs/heads/side", None, tip)])
    assert out.ok
    assert app.refs.refs("r") == {"refs/heads/main": rev(src, "main")}
    return src, only_side, tip


def sweeps(app: Alkfs, n: int) -> list:
    reports = [sweep(app.store, 0) for _ in range(n)]
    assert [r.aborted for r in reports] == [None] * n, reports
    return reports


def test_a_registered_borrower_keeps_what_its_refs_reach_until_unregistered(tmp_path, app):
    src, only_side, tip = side_store(tmp_path, app)
    git("clone", "-q", "--shared", "--bare", str(src), "b.git", cwd=tmp_path)
    b = tmp_path / "b.git"
    assert tips(b).own_objects == 0 and git_out("rev-parse", "side", cwd=b).strip() == tip
    app.roots.add("b", str(b))
    orphan = app.store.add(b"nobody keeps this\n")  # (the sweeps do delete)

    reports = sweeps(app, 3)
    assert not app.store.has(orphan)
    assert all(app.store.has(Key(k)) for k in only_side)
    assert sum(r.deleted for r in reports) == 1

    app.roots.remove("b")
    first, second = sweeps(app, 2)
    assert first.candidates_staged == len(only_side) and first.deleted == 0
    assert second.deleted == len(only_side)
    assert not any(app.store.has(Key(k)) for k in only_side)
    assert (stored_keys(app) - only_side) and all(
        app.store.has(git_key(h)) for h in ids_of(git_out("rev-list", "--objects", "main", cwd=src))
    )


def test_an_unpushed_commit_on_a_deleted_branch_keeps_its_history(tmp_path, app):
    src, only_side, tip = side_store(tmp_path, app)
    git("clone", "-q", "--shared", "--bare", str(src), "b.git", cwd=tmp_path)
    b = tmp_path / "b.git"
    blob = git_out("hash-object", "-w", "--stdin", input=b"unpushed\n", cwd=b).strip()
    tree = git_out("mktree", input=f"100644 blob {blob}\tlocal.txt\n".encode(), cwd=b).strip()
    local = git_out("commit-tree", tree, "-p", tip, "-m", "unpushed", cwd=b).strip()
    git("update-ref", "refs/heads/feature", local, cwd=b)
    git("update-ref", "-d", "refs/heads/side", cwd=b)
    assert git_out("for-each-ref", "--format=%(refname)", cwd=b).split() == [
        "refs/heads/feature",
        "refs/heads/main",
    ]
    found = tips(b)
    assert found.own_objects == 3 and bytes.fromhex(tip) in found.ids
    app.roots.add("b", str(b))
    sweeps(app, 3)
    assert all(app.store.has(Key(k)) for k in only_side)
    assert app.roots.live_keys() >= only_side

    app.roots.remove("b")
    sweeps(app, 2)
    assert not any(app.store.has(Key(k)) for k in only_side)


def test_a_borrowers_walk_stops_where_the_refs_closure_already_reaches(tmp_path, app):
    """What the refs keep is closed under reachability: the borrower's walk stops there,
    so a clone of a big history re-walks only what nothing else keeps (here: side)."""
    src, only_side, tip = side_store(tmp_path, app)
    git("clone", "-q", "--shared", "--bare", str(src), "b.git", cwd=tmp_path)
    b = tmp_path / "b.git"
    app.roots.add("b", str(b))
    sweeps(app, 1)
    main_only = {git_key(h).raw for h in ids_of(git_out("rev-list", "--objects", "main", cwd=src))}
    assert app.roots._memo is not None and app.roots._memo[1] == only_side  # (not main's)
    assert all(app.roots.contains(k) for k in only_side)
    [out] = app.refs.update("r", [RefUpdate("refs/heads/main", None, rev(src, "main"))])
    assert out.ok  # (now only the borrower keeps main's history: its walk covers it all)
    sweeps(app, 2)
    assert app.roots._memo[1] == only_side | main_only
    assert all(app.store.has(Key(k)) for k in only_side | main_only)


def test_an_unreadable_borrower_stops_the_sweep_and_nothing_is_deleted(tmp_path, app):
    src, only_side, tip = side_store(tmp_path, app)
    git("clone", "-q", "--shared", "--bare", str(src), "b.git", cwd=tmp_path)
    b = tmp_path / "b.git"
    app.roots.add("broken", str(b))
    (b / "refs" / "heads" / "torn").write_text("d34d\n")
    orphan = app.store.add(b"an orphan\n")
    before = stored_keys(app)
    for _ in range(3):
        report = sweep(app.store, 0)
        assert report.aborted == "protect-failed"
        assert "root 'broken'" in report.detail and "torn" in report.detail
        assert report.deleted == 0 and report.candidates_staged == 0
    assert stored_keys(app) == before and app.store.has(orphan)
    assert app.roots.get("broken").missing_since_ns is None  # unreadable is not missing

    (b / "refs" / "heads" / "torn").unlink()
    sweeps(app, 2)
    assert not app.store.has(orphan)
    assert all(app.store.has(Key(k)) for k in only_side)


# -- a borrower that went away ----------------------------------------------------------------
def test_a_missing_borrower_stops_sweeps_until_its_grace_ends_then_is_dropped(
    tmp_path, app, monkeypatch, caplog
):
    caplog.set_level(logging.WARNING, logger="alkfs")
    src, only_side, tip = side_store(tmp_path, app)
    git("clone", "-q", "--shared", "--bare", str(src), "b.git", cwd=tmp_path)
    b = tmp_path / "b.git"
    app.roots.add("away", str(b))
    shutil.rmtree(b)

    report = sweep(app.store, 0)
    assert report.aborted == "protect-failed" and report.deleted == 0
    assert "root 'away'" in report.detail and str(b) in report.detail
    since = app.roots.get("away").missing_since_ns
    assert since is not None
    monkeypatch.setenv("ALKFS_ROOTS_GRACE", "1h")
    assert sweep(app.store, 0).aborted == "protect-failed"
    assert app.roots.get("away").missing_since_ns == since  # (from when it was first missed)
    assert not any("root away dropped" in r.getMessage() for r in caplog.records)

    monkeypatch.setenv("ALKFS_ROOTS_GRACE", "0")
    first = sweep(app.store, 0)
    assert first.aborted is None and app.roots.list() == []
    dropped = [r for r in caplog.records if "root away dropped" in r.getMessage()]
    assert len(dropped) == 1
    assert (dropped[0].name, dropped[0].levelno) == ("alkfs", logging.WARNING)
    assert dropped[0].getMessage().startswith("root away dropped")
    assert str(b) in dropped[0].getMessage()
    assert first.candidates_staged == len(only_side)
    assert sweep(app.store, 0).deleted == len(only_side)


def test_a_borrower_back_before_its_grace_ends_is_no_longer_missing(tmp_path, app, monkeypatch):
    src, only_side, tip = side_store(tmp_path, app)
    git("clone", "-q", "--shared", "--bare", str(src), "b.git", cwd=tmp_path)
    b = tmp_path / "b.git"
    app.roots.add("back", str(b))
    b.rename(tmp_path / "elsewhere")
    report = sweep(app.store, 0)
    assert report.aborted == "protect-failed" and "root 'back'" in report.detail
    assert app.roots.get("back").missing_since_ns is not None

    (tmp_path / "elsewhere").rename(b)
    sweeps(app, 3)
    assert app.roots.get("back").missing_since_ns is None
    assert all(app.store.has(Key(k)) for k in only_side)
    monkeypatch.setenv("ALKFS_ROOTS_GRACE", "0")  # (nothing is missing: nothing is dropped)
    sweeps(app, 2)
    assert [r.name for r in app.roots.list()] == ["back"]
    assert all(app.store.has(Key(k)) for k in only_side)


def test_a_root_of_another_machine_stops_sweeps_and_is_never_dropped(tmp_path, app, monkeypatch):
    src, only_side, tip = side_store(tmp_path, app)
    git("clone", "-q", "--shared", "--bare", str(src), "b.git", cwd=tmp_path)
    b = tmp_path / "b.git"
    monkeypatch.setenv("ALKFS_MACHINE_ID", "a")
    assert app.roots.add("theirs", str(b)).machine == "a"
    orphan = app.store.add(b"an orphan\n")

    monkeypatch.setenv("ALKFS_MACHINE_ID", "b")
    monkeypatch.setenv("ALKFS_ROOTS_GRACE", "0")
    shutil.rmtree(b)  # (what it names here says nothing of the machine it is on)
    for _ in range(3):
        report = sweep(app.store, 0)
        assert report.aborted == "protect-failed" and report.deleted == 0
        assert "root 'theirs'" in report.detail and "machine a" in report.detail
    assert [r.name for r in app.roots.list()] == ["theirs"]
    assert app.roots.get("theirs").missing_since_ns is None
    assert app.store.has(orphan) and all(app.store.has(Key(k)) for k in only_side)
    with pytest.raises(Exists):  # (the name is taken, whichever machine asks)
        app.roots.add("theirs", str(src))


def test_contains_answers_from_the_last_reading_and_is_live_after_a_registration(tmp_path, app):
    src, only_side, tip = side_store(tmp_path, app)
    git("clone", "-q", "--shared", "--bare", str(src), "b.git", cwd=tmp_path)
    b = tmp_path / "b.git"
    app.roots.add("b", str(b))
    unknown = Key.derive(Algorithm.SHA256, b"never stored").raw
    main_only = git_key(rev(src, "main~2:m0")).raw
    roots = app.roots
    assert roots.contains(unknown) and roots.contains(main_only)  # cold: everything is live

    live = roots.live_keys()
    assert live >= only_side and main_only in live  # (b.git has main too)
    assert all(roots.contains(k) for k in only_side)
    assert not roots.contains(unknown)

    other = init(tmp_path / "other")
    roots.add("other", str(other))
    assert roots.contains(unknown)  # registered since the reading: live until the next
    roots.live_keys()
    assert not roots.contains(unknown)
    assert roots.contains(git_key(tip).raw)
    roots.add("other", str(other))  # a no-op: the reading still holds
    assert not roots.contains(unknown)


# -- the command line -------------------------------------------------------------------------
def alkfs(cwd: Path, *args: str, database: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALKFS_")}
    if database is not None:
        env["ALKFS_DATABASE"] = database
    return subprocess.run(
        [ALKFS, *args], cwd=cwd, env=env, capture_output=True, timeout=60, check=False
    )


def test_the_roots_commands_on_a_store(tmp_path, store_database):
    store = tmp_path / "store"
    database = store_database(store)
    init(tmp_path / "b")
    init(tmp_path / "c")
    (tmp_path / "plain").mkdir()
    Alkfs.open(store, database=database).close()  # (roots commands create no store)

    def ok(*args: str) -> str:
        done = alkfs(tmp_path, "--store", "store", *args, database=database)
        assert (done.returncode, done.stderr) == (0, b""), done.stderr.decode()
        return done.stdout.decode()

    def refused(*args: str) -> str:
        done = alkfs(tmp_path, "--store", "store", *args, database=database)
        assert done.returncode == 1, (done.returncode, done.stderr)
        assert done.stdout == b""
        lines = done.stderr.decode().splitlines()
        assert len(lines) == 1 and "Traceback" not in lines[0], lines
        return lines[0]

    assert ok("roots", "add", "b", "b") == ""  # relative: made absolute
    assert ok("roots", "add", "c", str(tmp_path / "c" / ".git")) == ""
    assert ok("roots") == f"b {tmp_path / 'b'}\nc {tmp_path / 'c' / '.git'}\n"
    assert ok("roots", "add", "b", "b") == ""  # the same again
    assert "a b" in refused("roots", "add", "a b", "b")
    assert "not a git repository" in refused("roots", "add", "p", "plain")
    assert "no such repository" in refused("roots", "add", "n", "nothing")
    assert str(tmp_path / "c" / ".git") in refused("roots", "add", "c", "b")  # c: another path
    ok("roots", "rm", "c")
    assert "no root 'c'" in refused("roots", "rm", "c")
    assert ok("roots") == f"b {tmp_path / 'b'}\n"
    done = alkfs(tmp_path, "--store", "store", "roots", "add", "x", database=database)
    assert done.returncode == 2  # usage

    app = Alkfs.open(store, database=database)
    try:
        assert [(r.name, r.path) for r in app.roots.list()] == [("b", str(tmp_path / "b"))]
    finally:
        app.close()


def test_a_long_input_reaches_git_whole_however_slowly_it_reads(tmp_path):
    """git cat-file fed 8 MB of ids (more than a pipe takes before the first look at the
    stop event): every id gets its line back, in bounded time (before: the rest of the
    input was never written, and the read hung until its 600 s timeout)."""
    import threading as _threading

    from alkfs.git.borrower import Layout, _cat_file, _git_env

    repo = tmp_path / "r"
    subprocess.run(["git", "init", "-q", "--bare", str(repo)], check=True)
    home = tmp_path / "home"
    (home / "objects").mkdir(parents=True)
    env = _git_env(home)
    ids = b"".join(b"%040x\n" % i for i in range(200_000))
    out: list[bytes] = []
    t = _threading.Thread(
        target=lambda: out.append(_cat_file(Layout(repo, repo), env, ["--batch-check"], ids)),
        daemon=True,
    )
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the read hung"
    assert out[0].count(b" missing\n") == 200_000
