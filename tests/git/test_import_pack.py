"""An import keeps git's packs: git packs the source's objects, `index-pack --strict`
checks them, the pack joins the published set; nothing passes through the kv."""

from __future__ import annotations

import os

import pytest
from helpers import git_objects, git_out

from alkfs.errors import Verification
from alkfs.git import packs
from alkfs.git.importer import import_repo
from alkfs.git.packs.drain import PRIMARY
from alkfs.keys import Algorithm, Key

from .scenarios import everything


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_an_import_writes_no_kv_row_and_reads_back_every_object(app, make_repo, fmt):
    src = make_repo(fmt)
    everything(src)
    algo = Algorithm.GIT_SHA1 if fmt == "sha1" else Algorithm.GIT_SHA256
    top = app.store.kv.high_water()
    result = import_repo(app, src.gitdir, "r", progress=False)
    objects = git_objects(src.gitdir)
    assert (result.objects, result.stored, result.present) == (len(objects), len(objects), 0)
    assert app.store.kv.high_water() == top  # (not one row inserted, not even for a while)
    d = packs.derived_for(app.store, fmt)
    gen = d.current()
    assert gen.meta["mode"] == "adopt" and (d.root / PRIMARY).exists()
    assert {d.hex() for d in gen.digests()} == set(objects)
    for hexid, data in objects.items():
        key = Key.from_hex(algo, hexid)
        assert app.store.get(key) == data and app.store.stat(key).tier == "packs"
    assert app.refs.refs("r") == src.for_each_ref()


def dot_git_tree(src) -> str:
    """A commit on `main` whose tree names an entry `.git` (git's fsck: hasDotgit)."""
    blob = src.git("hash-object", "-w", "--stdin", input=b"not a repository\n").strip()
    tree = src.git("mktree", input=f"100644 blob {blob}\t.git\n".encode()).strip()
    commit = src.git("commit-tree", tree, "-m", "a tree git refuses to check out").strip()
    src.git("update-ref", "refs/heads/main", commit)
    return commit


def test_an_import_git_refuses_to_check_changes_nothing(app, make_repo):
    fine = make_repo(name="fine")
    everything(fine)
    import_repo(app, fine.gitdir, "fine", progress=False)
    d = packs.derived_for(app.store, "sha1")
    before = d.current()
    top = app.store.kv.high_water()
    bad = make_repo(name="bad")
    dot_git_tree(bad)
    with pytest.raises(Verification) as e:
        import_repo(app, bad.gitdir, "bad", progress=False)
    assert "hasDotgit" in str(e.value) and len(str(e.value)) < 1000
    assert d.current().number == before.number
    assert sorted(p.name for p in d.root.iterdir()) == sorted(
        ["CURRENT", PRIMARY, f"gen-{before.number}"]
    )  # (no build cut short left behind)
    assert app.store.kv.high_water() == top
    assert [r.id for r in app.refs.repos()] == ["fine"]
    assert app.store.sweep(0).deleted == 0 and app.store.sweep(0).deleted == 0
    for hexid, data in git_objects(fine.gitdir).items():
        assert app.store.get(Key.from_hex(Algorithm.GIT_SHA1, hexid)) == data


def test_an_old_history_with_zero_padded_tree_modes_imports(app, make_repo):
    """What git's own fsck only warns about (old tools wrote `040000` for trees) is let
    through; packs/adopt.py STRICT lists it."""
    src = make_repo()
    blob = src.git("hash-object", "-w", "--stdin", input=b"inside\n").strip()
    inner = src.git("mktree", input=f"100644 blob {blob}\tf.txt\n".encode()).strip()
    body = b"040000 dir\0" + bytes.fromhex(inner)
    tree = src.git("hash-object", "-w", "-t", "tree", "--literally", "--stdin", input=body)
    commit = src.git("commit-tree", tree.strip(), "-m", "old").strip()
    src.git("update-ref", "refs/heads/main", commit)
    result = import_repo(app, src.gitdir, "old", progress=False)
    assert (result.stored, app.refs.refs("old")) == (4, {"refs/heads/main": commit})
    assert app.store.get(Key.from_hex(Algorithm.GIT_SHA1, tree.strip()))[:5] == b"tree "


def test_a_shallow_clone_imports_with_its_history_cut_where_git_cut_it(app, make_repo, tmp_path):
    src = make_repo()
    everything(src)
    shallow = tmp_path / "shallow.git"
    git_out("clone", "-q", "--bare", "--depth", "1", f"file://{src.gitdir}", str(shallow))
    objects = git_objects(shallow)
    result = import_repo(app, str(shallow), "cut", progress=False)
    assert (result.objects, result.stored) == (len(objects), len(objects))
    listed = git_out(f"--git-dir={shallow}", "for-each-ref", "--format=%(refname) %(objectname)")
    assert app.refs.refs("cut") == dict(line.split() for line in listed.splitlines())
    assert (shallow / "shallow").is_file() and len(listed.splitlines()) >= 1
    first, second = app.store.sweep(0), app.store.sweep(0)
    assert (first.aborted, first.deleted, second.deleted) == (None, 0, 0)
    for hexid, data in objects.items():
        assert app.store.get(Key.from_hex(Algorithm.GIT_SHA1, hexid)) == data


def test_unreachable_objects_loose_packed_and_lent_are_imported_too(app, make_repo):
    """Every object `cat-file --batch-all-objects` lists is packed, reachable or not,
    loose, packed or an alternate's."""
    src = make_repo()
    everything(src)
    packed = src.git("hash-object", "-w", "--stdin", input=b"unreachable, packed\n").strip()
    src.git("repack", "-a", "-d", "-k", "-q")
    loose = src.git("hash-object", "-w", "--stdin", input=b"unreachable, loose\n").strip()
    objects = git_objects(src.gitdir)
    assert {packed, loose} <= set(objects)
    result = import_repo(app, src.gitdir, "r", progress=False)
    assert result.stored == len(objects)
    for hexid in (packed, loose):
        assert app.store.get(Key.from_hex(Algorithm.GIT_SHA1, hexid)) == objects[hexid]
    # an unreachable object of an alternate
    lender = make_repo(name="lender")
    lent = lender.git("hash-object", "-w", "--stdin", input=b"unreachable, lent\n").strip()
    lender.git("repack", "-a", "-d", "-k", "-q")
    other = make_repo(name="other")
    other.write("own.txt", "only in the other repository\n")
    other.commit("its own")
    alternates = other.path / ".git" / "objects" / "info" / "alternates"
    alternates.write_text(f"{lender.path / '.git' / 'objects'}\n")
    assert lent in git_objects(other.gitdir)
    import_repo(app, other.gitdir, "other", progress=False)
    assert app.store.get(Key.from_hex(Algorithm.GIT_SHA1, lent)) == b"blob 18\0unreachable, lent\n"


def test_removing_a_repository_an_import_packed_alone_drops_its_pack_whole(
    app, make_repo, tmp_path
):
    """A fork imported after its upstream is a pack of its own objects; `repo rm` of the
    fork and two sweeps publish the set without that pack and its commit-graph layer:
    nothing rewritten, the upstream's pack the same file."""
    upstream = make_repo(name="upstream")
    everything(upstream)
    for i in range(6):
        upstream.write(f"lib/m{i}.txt", f"module {i}\n" * 40)
        upstream.commit(f"upstream {i}")
    import_repo(app, upstream.gitdir, "upstream", progress=False)
    fork = make_repo(name="fork")
    fork.git("fetch", "-q", "--update-head-ok", upstream.gitdir, "+refs/*:refs/*")
    fork.git("reset", "-q", "--hard", "HEAD")
    fork.write("fork/own.txt", "the fork's own file\n")
    fork.commit("the fork's own commit")
    assert fork.rev("HEAD^") == upstream.rev("HEAD")
    import_repo(app, fork.gitdir, "fork", progress=False)
    d = packs.derived_for(app.store, "sha1")
    before = d.current()
    assert len(before.indexes) == 2
    [base] = [i for i in before.indexes if i.count > 4]
    base_ino = os.stat(base.path).st_ino
    own = {
        bytes.fromhex(x)
        for x in fork.git("rev-list", "--objects", "HEAD^..HEAD").split()
        if len(x) == 40
    }
    assert len(own) == 4  # the commit, its tree, the new tree fork/ and its blob
    assert sorted(i.count for i in before.indexes)[0] == 4  # (the fork's own pack)
    app.refs.delete_repo("fork")
    first = app.store.sweep(0)
    assert first.candidates_staged == 4
    # the daemon's intake rebuilds a set before a sweep deletes what it holds: not here,
    # where the deletion drops a pack whole (that rebuild rewrote the history between sweeps)
    assert d.staged_in_current() == 0
    second = app.store.sweep(0)
    assert second.deleted == 4
    after = d.current()
    # (no mount serves the sets: the retired one goes at once, not at the next open)
    assert sorted(p.name for p in after.root.parent.glob("gen-*")) == [after.root.name]
    assert after.meta["mode"] == "drop-packs" and len(after.indexes) == 1
    assert os.stat(after.indexes[0].path).st_ino == base_ino  # (a link)
    assert set(after.digests()) == set(before.digests()) - own
    user = tmp_path / "user.git"
    git_out("init", "-q", "--bare", str(user))
    (user / "objects" / "info" / "alternates").write_text(f"{after.root}\n")
    git_out(f"--git-dir={user}", "update-ref", "refs/heads/main", upstream.rev("HEAD"))
    git_out(f"--git-dir={user}", "fsck", "--full", "--strict", "--no-dangling")
    git_out(f"--git-dir={user}", "commit-graph", "verify", f"--object-dir={after.root}")
    git_out(f"--git-dir={user}", "multi-pack-index", f"--object-dir={after.root}", "verify")
    for hexid, data in git_objects(upstream.gitdir).items():
        assert app.store.get(Key.from_hex(Algorithm.GIT_SHA1, hexid)) == data
    for d_ in own:
        assert not app.store.has(Key(bytes([Algorithm.GIT_SHA1.value]) + d_))


KINDS = ("commit", "tree", "blob")


def test_an_imported_pack_is_laid_out_as_git_lays_out_a_fetch(app, make_repo):
    """A history written by fast-import has its commits spread among their trees and
    blobs; the import packs it in recency order (`rev-list --objects --all`), as a
    fetch's server does: every commit before any tree or blob, so `log` reads one
    stretch of the pack (read in the source's pack order, git read such an import 3-4
    times slower than a clone)."""
    src = make_repo()
    stream = []
    for i in range(30):
        stream.append("commit refs/heads/main\n")
        stream.append(f"committer C O Mitter <c@example.com> {1700000000 + i} +0000\n")
        stream.append(f"data 4\nc{i:02d}\n")
        data = "".join(f"line {k} of version {i}\n" for k in range(30))
        stream.append(f"M 100644 inline d{i % 3}/f.txt\ndata {len(data)}\n{data}\n")
    src.git("fast-import", "--quiet", input="".join(stream).encode())
    [source_idx] = (src.path / ".git" / "objects" / "pack").glob("*.idx")

    def kinds(idx) -> list[str]:  # (verify-pack -v: in the pack's order)
        rows = git_out("verify-pack", "-v", str(idx)).splitlines()
        return [w[1] for w in map(str.split, rows) if len(w) >= 5 and w[1] in KINDS]

    before = kinds(source_idx)
    last_blob = len(before) - 1 - before[::-1].index("blob")
    assert before.index("blob") < before.index("commit") < last_blob  # (commits among blobs)
    result = import_repo(app, src.gitdir, "r", progress=False)
    assert result.stored == len(before) == 30 + 30 + 60  # (commits, blobs, trees)
    gen = packs.derived_for(app.store, "sha1").current()
    [idx] = [i.path for i in gen.indexes]
    after = kinds(idx)
    assert after[:30] == ["commit"] * 30 and "commit" not in after[30:]
