"""A sweep deleting a large repository's objects, many take batches of them, publishes one
set without them all: once per sweep, not once per batch (it used to publish a new set at
each batch whose keys the published set held: a rebuild, then a drop, ...)."""

from __future__ import annotations

from pathlib import Path

from helpers import git, git_out

from alkfs.app import Alkfs
from alkfs.gc import sweep as gc_sweep
from alkfs.git import packs
from alkfs.git.importer import import_repo
from alkfs.git.refs import RefUpdate
from alkfs.keys import Algorithm

COMMITS = 700  # a commit, a root tree, a subtree and a blob each: ~2,800 objects
BATCH = 500  # the sweep's take batch here: its deletions span at least 3 batches


def bare_repo(path: Path, name: str, commits: int) -> Path:
    """A bare repository: `commits` commits on main, each adding a file under d/."""
    git("init", "-q", "--bare", "-b", "main", path)
    out = []
    for i in range(commits):
        out.append("commit refs/heads/main\n")
        out.append(f"committer C O Mitter <c@example.com> {1700000000 + i} +0000\n")
        msg = f"{name} {i}"
        out.append(f"data {len(msg)}\n{msg}\n")
        data = f"{name}: file {i}\n" * 3
        out.append(f"M 100644 inline d/f{i}.txt\ndata {len(data)}\n{data}\n")
    git(f"--git-dir={path}", "fast-import", "--quiet", input="".join(out).encode())
    return path


def ids(gitdir: Path) -> set[bytes]:
    out = git_out(f"--git-dir={gitdir}", "cat-file", "--batch-all-objects", "--batch-check")
    return {bytes.fromhex(line.split()[0]) for line in out.splitlines()}


def published(d: packs.Derived) -> set[bytes]:
    gen = d.current()
    assert gen is not None
    return gen.digests()


def test_a_sweep_deleting_many_batches_publishes_one_set_without_them_all(tmp_path):
    big = bare_repo(tmp_path / "big.git", "big", COMMITS)
    small = bare_repo(tmp_path / "small.git", "small", 5)
    with Alkfs.open(tmp_path / "store", window_s=0) as app:
        store = app.store
        import_repo(app, str(small), "small", progress=False)
        import_repo(app, str(big), "big", progress=False)
        d = packs.derived_for(store, "sha1")
        assert d is not None
        d.build()  # (one consolidated set of both)
        doomed = ids(big) - ids(small)
        kept = ids(small)
        assert len(doomed) >= 3 * BATCH and doomed | kept <= published(d)
        main = git_out(f"--git-dir={big}", "rev-parse", "main").strip()
        [out] = app.refs.update("big", [RefUpdate("refs/heads/main", None, main)])
        assert out.ok

        first = gc_sweep.sweep(store, 0, batch=BATCH)
        assert first.aborted is None and first.deleted == 0
        assert first.candidates_staged == len(doomed)
        before = d.current()
        assert before is not None
        on_disk = set(d.generations_on_disk())
        numbers: list[int] = []
        d.on_publish.append(lambda old, new: numbers.append(0 if new is None else new.number))

        second = gc_sweep.sweep(store, 0, batch=BATCH)
        assert second.aborted is None, second
        assert second.taken == len(doomed) and second.deleted == len(doomed)
        assert -(-second.taken // BATCH) >= 3  # (it took them in at least 3 batches)
        # one set published by the deleting sweep, and nothing else on disk is new
        assert len(numbers) == 1, numbers
        after = d.current()
        assert after is not None and numbers == [after.number] and after.number > before.number
        assert set(d.generations_on_disk()) - on_disk == {after.number}
        assert (d.root / "CURRENT").read_text() == f"{after.number}\n"
        # it lists none of what the sweep deleted, and all that is still stored
        assert doomed.isdisjoint(published(d))
        stored = {raw[1:] for raw in store.iter_keys() if raw[0] == Algorithm.GIT_SHA1.value}
        assert stored == kept == published(d)
        assert not any(store.has_raw(bytes([Algorithm.GIT_SHA1.value]) + x) for x in doomed)
