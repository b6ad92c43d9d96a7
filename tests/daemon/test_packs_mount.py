"""Derived packs through a real mount: /git/<format>/pack and info/ serve the published set
(git's own verifiers pass on the served files), fan-out directories list only what no pack
holds but resolve everything, intake packs new objects, a retired pack stays readable for
an open handle, a sweep never leaves a deleted object in a listed pack, freshening goes
through the loose path, and git's gc/repack/prune in /repos/<id> delete nothing."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import trio
from helpers import RecordingInvalidator, git, git_out

from alkfs.app import Alkfs
from alkfs.git.importer import import_repo
from alkfs.git.packs import Generation
from alkfsd.packs import since_built

FAST_INTAKE = {"ALKFS_PACK_EVERY": "0", "ALKFS_PACK_POLL": "0.2"}
# an intake of two objects at once: neither lands alone in a pack of its own
PAIR_INTAKE = {"ALKFS_PACK_EVERY": "3600", "ALKFS_PACK_OBJECTS": "2", "ALKFS_PACK_POLL": "0.2"}
WAIT_S = 60.0  # bound of the polls below (never a timing assertion)


def source_repo(path: Path, fmt: str) -> Path:
    """A bare repository: main with 12 commits editing nested files, a side branch, a tag."""
    git("init", "-q", "--bare", f"--object-format={fmt}", "-b", "main", path)
    out = []
    for i in range(12):
        out.append("commit refs/heads/main\n")
        out.append(f"committer C O Mitter <c@example.com> {1700000000 + i} +0000\n")
        out.append(f"data 10\ncommit {i:02d}\n")
        for j in range(4):
            data = "".join(f"line {k} of file {j}, version {i}\n" for k in range(40))
            out.append(f"M 100644 inline src/d{j % 2}/f{j}.txt\ndata {len(data)}\n{data}\n")
    out.append("commit refs/heads/side\n")
    out.append("committer C O Mitter <c@example.com> 1700000100 +0000\n")
    out.append("data 5\nside\nfrom refs/heads/main\nM 100644 inline side.txt\ndata 5\nside\n\n")
    git(f"--git-dir={path}", "fast-import", "--quiet", input="".join(out).encode())
    git(f"--git-dir={path}", "tag", "-a", "-m", "one", "v1", "main~2")
    return path


def imported_store(tmp_path: Path, fmt: str = "sha1") -> tuple[Path, Path]:
    src = source_repo(tmp_path / f"src-{fmt}.git", fmt)
    store = tmp_path / "store"
    with Alkfs.open(store, window_s=0) as app:
        import_repo(app, str(src), "r", progress=False)  # leaves the objects packed
    return store, src


def listing(mnt: Path, fmt: str, sub: str = "pack") -> list[str]:
    return sorted(os.listdir(mnt / "git" / fmt / sub))


def idx_ids(mnt: Path, fmt: str) -> set[str]:
    """Every id in the indexes listed now, read through the mount by `git show-index` (again
    if a set was retired between the listing and the reads: its files go)."""
    for _ in range(20):
        try:
            return _idx_ids(mnt, fmt)
        except FileNotFoundError:
            time.sleep(0.05)
    return _idx_ids(mnt, fmt)


def _idx_ids(mnt: Path, fmt: str) -> set[str]:
    out: set[str] = set()
    for name in listing(mnt, fmt):
        if name.endswith(".idx"):
            with open(mnt / "git" / fmt / "pack" / name, "rb") as f:
                text = subprocess.run(
                    ["git", "show-index", f"--object-format={fmt}"],
                    stdin=f,
                    capture_output=True,
                    check=True,
                ).stdout.decode()
            out.update(line.split()[1] for line in text.splitlines())
    return out


def fanout_listed(mnt: Path, fmt: str) -> set[str]:
    top = mnt / "git" / fmt
    return {xx + rest for xx in (f"{i:02x}" for i in range(256)) for rest in os.listdir(top / xx)}


def wait_for(what, condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def alternates_user(tmp_path: Path, mnt: Path, fmt: str, src: Path, name: str = "user") -> Path:
    user = tmp_path / name
    git("init", "-q", "--bare", f"--object-format={fmt}", user)
    (user / "objects" / "info" / "alternates").write_text(f"{mnt}/git/{fmt}\n")
    for line in git_out(
        f"--git-dir={src}", "for-each-ref", "--format=%(objectname) %(refname)"
    ).split("\n"):
        if line:
            oid, ref = line.split()
            git(f"--git-dir={user}", "update-ref", ref, oid)
    return user


def put_loose(mnt: Path, fmt: str, content: bytes) -> str:
    """git writes one object into /git/<fmt> itself (not pinned: the window protects it)."""
    return git_out(
        "hash-object",
        "-w",
        "--stdin",
        env={"GIT_OBJECT_DIRECTORY": f"{mnt}/git/{fmt}", "GIT_DIR": str(mnt / "repos" / "r")},
        input=content,
    ).strip()


def assert_packs_hold_all_of(src: Path, mnt: Path, tmp_path: Path) -> None:
    """The listed sha1 packs hold every object of `src`, and a repository with alternates
    into the mount is fsck-clean."""
    everything = set(
        git_out(
            f"--git-dir={src}", "cat-file", "--batch-all-objects", "--batch-check=%(objectname)"
        ).split()
    )
    assert idx_ids(mnt, "sha1") == everything
    user = alternates_user(tmp_path, mnt, "sha1", src)
    git(f"--git-dir={user}", "fsck", "--full", "--strict", "--no-dangling")


def last_sweep(mnt: Path) -> dict:
    return json.loads((mnt / ".alkfs" / "status").read_text())["last_sweep"]


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_the_served_set_passes_gits_verifiers_and_fanouts_list_only_unpacked(
    start_mount, tmp_path, fmt
):
    store, src = imported_store(tmp_path, fmt)
    from alkfs.git.objects import canonical
    from alkfs.keys import Algorithm

    algo = Algorithm.GIT_SHA1 if fmt == "sha1" else Algorithm.GIT_SHA256
    with Alkfs.open(store, window_s=0) as app:  # a large-tier object: never packed
        large = app.store.add(canonical("blob", b"L" * 300_000), algo=algo)
        assert app.store.stat(large).tier == "large"
    gen = (store / "derived" / fmt / "CURRENT").read_text().strip()
    backing = store / "derived" / fmt / f"gen-{gen}"
    m = start_mount(store, "--window", "0")
    mnt = m.mnt
    names = listing(mnt, fmt)
    assert names == sorted(os.listdir(backing / "pack"))
    assert [n.rsplit(".", 1)[1] for n in names if n.startswith("pack-")] == ["idx", "keep", "pack"]
    assert "multi-pack-index" in names
    assert listing(mnt, fmt, "info") == ["commit-graphs"]
    assert listing(mnt, fmt, "info/commit-graphs") == sorted(
        os.listdir(backing / "info" / "commit-graphs")
    )
    for name in names:
        assert (mnt / "git" / fmt / "pack" / name).read_bytes() == (
            backing / "pack" / name
        ).read_bytes()
    user = alternates_user(tmp_path, mnt, fmt, src)
    idx = next(mnt / "git" / fmt / "pack" / n for n in names if n.endswith(".idx"))
    assert git_out(f"--git-dir={user}", "verify-pack", "-v", idx).rstrip().endswith(": ok")
    git(f"--git-dir={user}", "multi-pack-index", f"--object-dir={mnt}/git/{fmt}", "verify")
    git(f"--git-dir={user}", "commit-graph", "verify", f"--object-dir={mnt}/git/{fmt}")
    git(f"--git-dir={user}", "fsck", "--full", "--strict", "--no-dangling")
    everything = set(
        git_out(
            f"--git-dir={src}", "cat-file", "--batch-all-objects", "--batch-check=%(objectname)"
        ).split()
    )
    assert idx_ids(mnt, fmt) == everything
    assert fanout_listed(mnt, fmt) == {large.hex}  # all else packed: listed loose
    for oid in sorted(everything)[:20]:  # yet each resolves by name, in both views
        for top in (mnt / "git" / fmt, mnt / "repos" / "r" / "objects"):
            assert (top / oid[:2] / oid[2:]).stat().st_size > 0
    assert git_out(f"--git-dir={mnt}/repos/r", "rev-list", "--objects", "--all") == git_out(
        f"--git-dir={src}", "rev-list", "--objects", "--all"
    )
    for path in [mnt / "git" / fmt / "pack" / n for n in names] + [
        mnt / "git" / fmt / "info" / "commit-graphs" / n
        for n in listing(mnt, fmt, "info/commit-graphs")
    ]:
        with pytest.raises(PermissionError):
            os.utime(path)
        with pytest.raises(PermissionError):
            open(path, "ab").close()
    assert m.tracebacks() == []


def test_a_new_object_is_loose_at_once_then_inside_a_pack_after_intake(start_mount, tmp_path):
    store, src = imported_store(tmp_path)
    m = start_mount(store, "--window", "1h", env=FAST_INTAKE)
    mnt = m.mnt
    before = listing(mnt, "sha1")
    oid = put_loose(mnt, "sha1", b"written after the pack set\n")
    assert (
        git_out(f"--git-dir={mnt}/repos/r", "cat-file", "-p", oid) == "written after the pack set\n"
    )
    wait_for("the intake pack", lambda: oid in idx_ids(mnt, "sha1"))

    def figures() -> dict:
        return json.loads((mnt / ".alkfs" / "status").read_text())

    # its kv row goes once its pack is published: the packs hold it alone (the drain)
    wait_for("the drain", lambda: figures()["packs"]["sha1"]["drained"] == 1)
    assert figures()["objects"]["git-sha1"]["kv"] == 0
    after = listing(mnt, "sha1")
    assert set(before) < set(after)  # an intake pack beside the first one
    assert len([n for n in after if n.endswith(".pack")]) == 2
    assert oid not in fanout_listed(mnt, "sha1")
    assert (mnt / "git" / "sha1" / oid[:2] / oid[2:]).exists()
    user = alternates_user(tmp_path, mnt, "sha1", src)
    git(f"--git-dir={user}", "multi-pack-index", f"--object-dir={mnt}/git/sha1", "verify")
    git(f"--git-dir={user}", "fsck", "--full", "--strict", "--no-dangling")
    assert git_out(f"--git-dir={user}", "cat-file", "-p", oid) == "written after the pack set\n"
    retired = store / "derived" / "sha1" / "gen-1"
    wait_for("the retired generation to go", lambda: not retired.exists())


def pack_holding(mnt: Path, oid: str) -> str:
    """The name of the listed pack whose index holds `oid`."""
    for name in listing(mnt, "sha1"):
        if name.endswith(".idx"):
            with open(mnt / "git" / "sha1" / "pack" / name, "rb") as f:
                text = subprocess.run(
                    ["git", "show-index"], stdin=f, capture_output=True, check=True
                ).stdout.decode()
            if any(line.split()[1] == oid for line in text.splitlines()):
                return name[:-4] + ".pack"
    raise AssertionError(f"no listed pack holds {oid}")


def test_the_intake_counts_its_every_from_the_published_sets_build_not_from_boot(tmp_path):
    # a daemon that has built nothing yet: the set `git import` published a moment ago is
    # a moment old (before, its age was the machine's uptime: ALKFS_PACK_EVERY=3600 on a
    # machine up for an hour packed the first loose object alone at once)
    store, _src = imported_store(tmp_path)
    number = int((store / "derived/sha1/CURRENT").read_text())
    gen = Generation.load("sha1", number, store / "derived" / "sha1" / f"gen-{number}")
    assert "built_at" in gen.meta
    assert 0.0 <= since_built(None, gen) < 3600.0
    assert since_built(None, None) == float("inf")  # no set: the first object is packed
    gen.meta["built_at"] = "1970-01-02T00:00:00Z"
    assert since_built(None, gen) > 3600.0
    assert since_built(time.monotonic() - 7200.0, gen) >= 7200.0  # its own build first


def test_an_open_handle_on_a_retired_pack_keeps_reading_the_same_bytes(start_mount, tmp_path):
    store, _src = imported_store(tmp_path)
    m = start_mount(store, "--window", "1h", env=PAIR_INTAKE)
    mnt = m.mnt
    oid = put_loose(mnt, "sha1", b"in an intake pack, then staged\n")
    # (and a pinned one beside it: the staged pack, of oid alone, is not the intake pack
    # again under the same name)
    kept = put_loose(mnt, "sha1", b"in the same intake pack, pinned\n")
    os.symlink(f"../objects/git-sha1/{kept}", mnt / "pins" / "kept")
    wait_for("the intake pack", lambda: {oid, kept} <= idx_ids(mnt, "sha1"))
    intake = pack_holding(mnt, oid)
    assert pack_holding(mnt, kept) == intake
    # (the generation it retired stays for its grace: daemon/packs.py)
    gen = store / "derived" / "sha1" / f"gen-{int((store / 'derived/sha1/CURRENT').read_text())}"
    backing = gen / "pack" / intake
    expected = backing.read_bytes()
    fd = os.open(mnt / "git" / "sha1" / "pack" / intake, os.O_RDONLY)
    midx_fd = os.open(mnt / "git" / "sha1" / "pack" / "multi-pack-index", os.O_RDONLY)
    midx_backing = gen / "pack" / "multi-pack-index"
    midx = midx_backing.read_bytes()
    try:
        assert os.pread(fd, 4096, 0) == expected[:4096]
        (mnt / ".alkfs" / "control").write_text("sweep\n")  # stages oid: a set without it
        wait_for("a consolidated set", lambda: intake not in listing(mnt, "sha1"))
        assert pack_holding(mnt, oid) != pack_holding(mnt, kept)  # (oid: in the staged pack)
        assert backing.exists()  # held by the handle
        for f in (fd, midx_fd):
            os.posix_fadvise(f, 0, 0, os.POSIX_FADV_DONTNEED)  # the reads reach the daemon
        assert os.pread(fd, len(expected) + 10, 0) == expected
        assert os.pread(midx_fd, len(midx) + 10, 0) == midx
        assert (mnt / "git" / "sha1" / "pack" / "multi-pack-index").read_bytes() != midx
    finally:
        os.close(fd)
        os.close(midx_fd)
    gens = store / "derived" / "sha1"
    wait_for("the released generation to go", lambda: len(list(gens.glob("gen-*"))) == 1)
    assert not backing.exists()


def test_no_pack_listed_after_a_sweep_holds_an_object_it_deleted(start_mount, tmp_path):
    store, src = imported_store(tmp_path)
    m = start_mount(store, "--window", "0", env=FAST_INTAKE)
    mnt = m.mnt
    loose = put_loose(mnt, "sha1", b"dead once packed\n")
    wait_for("the intake pack", lambda: loose in idx_ids(mnt, "sha1"))
    side = git_out(f"--git-dir={src}", "rev-parse", "side").strip()
    side_blob = git_out(f"--git-dir={src}", "rev-parse", "side:side.txt").strip()
    assert {loose, side, side_blob} <= idx_ids(mnt, "sha1")
    os.unlink(mnt / "repos" / "r" / "refs" / "heads" / "side")  # the side commit dies
    control = mnt / ".alkfs" / "control"
    control.write_text("sweep\n")
    assert last_sweep(mnt)["candidates_staged"] == 4  # loose blob, side commit, tree, blob
    control.write_text("sweep\n")
    assert last_sweep(mnt)["deleted"] == 4
    ids = idx_ids(mnt, "sha1")
    assert {loose, side, side_blob}.isdisjoint(ids)
    for oid in (loose, side, side_blob):
        assert not (mnt / "git" / "sha1" / oid[:2] / oid[2:]).exists()
    user = tmp_path / "after"
    git("init", "-q", "--bare", user)
    (user / "objects" / "info" / "alternates").write_text(f"{mnt}/git/sha1\n")
    git(
        f"--git-dir={user}",
        "update-ref",
        "refs/heads/main",
        git_out(f"--git-dir={src}", "rev-parse", "main").strip(),
    )
    git(f"--git-dir={user}", "fsck", "--full", "--strict", "--no-dangling")
    git(f"--git-dir={user}", "commit-graph", "verify", f"--object-dir={mnt}/git/sha1")
    git(f"--git-dir={user}", "multi-pack-index", f"--object-dir={mnt}/git/sha1", "verify")
    assert m.tracebacks() == []


def test_git_freshens_a_packed_object_through_its_loose_path(start_mount, tmp_path):
    store, src = imported_store(tmp_path)
    m = start_mount(store, "--window", "0", env=FAST_INTAKE)
    mnt = m.mnt
    content = b"staged, then written again by a user of the alternate\n"
    oid = put_loose(mnt, "sha1", content)
    wait_for("the intake pack", lambda: oid in idx_ids(mnt, "sha1"))
    control = mnt / ".alkfs" / "control"
    control.write_text("sweep\n")
    assert last_sweep(mnt)["candidates_staged"] == 1
    user = alternates_user(tmp_path, mnt, "sha1", src)
    # git finds it in a pack, utime()s the pack (EPERM), then the loose path: freshened
    assert (
        git_out(f"--git-dir={user}", "hash-object", "-w", "--stdin", input=content).strip() == oid
    )
    assert git_out(f"--git-dir={user}", "count-objects").startswith("0 objects")  # nothing copied
    control.write_text("sweep\n")
    report = last_sweep(mnt)
    assert (report["deleted"], report["cancelled_by_arbitration"]) == (0, 1)
    assert git_out(f"--git-dir={user}", "cat-file", "-p", oid).encode() == content
    git(f"--git-dir={user}", "fsck", "--full", "--strict", "--no-dangling")


def test_git_gc_repack_and_prune_in_a_repository_delete_nothing(start_mount, tmp_path):
    store, src = imported_store(tmp_path)
    m = start_mount(store, "--window", "0")
    mnt = m.mnt
    gen_dir = store / "derived" / "sha1" / "gen-1"
    files = {p: p.read_bytes() for p in gen_dir.rglob("*") if p.is_file()}
    served = listing(mnt, "sha1")
    count = json.loads((mnt / ".alkfs" / "status").read_text())["objects"]["git-sha1"]["count"]
    repo = mnt / "repos" / "r"
    for args in (["gc"], ["gc", "--prune=now"], ["repack", "-adf"], ["prune", "--expire=now"]):
        git(f"--git-dir={repo}", *args, check=False)
    assert listing(mnt, "sha1") == served
    assert {p: p.read_bytes() for p in gen_dir.rglob("*") if p.is_file()} == files
    status = json.loads((mnt / ".alkfs" / "status").read_text())
    assert status["objects"]["git-sha1"]["count"] == count
    everything = git_out(
        f"--git-dir={src}", "cat-file", "--batch-all-objects", "--batch-check=%(objectname)"
    ).split()
    for oid in everything:
        assert (mnt / "git" / "sha1" / oid[:2] / oid[2:]).exists()
    assert errno.EPERM  # (utime of a pack: see the first test)


@contextlib.contextmanager
def direct(tmp_path: Path):
    """An imported store opened in-process with a mount's Context and Operations (no
    kernel): (app, ctx, the derived sets it serves)."""
    from alkfsd.context import Context
    from alkfsd.fs import Operations
    from alkfsd.packs import served

    store_path, _src = imported_store(tmp_path)
    app = Alkfs.open(store_path, window_s=0)
    ctx = Context(app.store, app=app, kernel=RecordingInvalidator())
    try:
        Operations(ctx)
        yield app, ctx, served(ctx)
    finally:
        ctx.close()
        app.close()


async def test_repack_now_publishes_a_set_and_drops_the_old_names(tmp_path):
    """Direct calls (no kernel): repack_now builds a set of every format with objects, and
    the view queues the invalidation of every name of the retired set."""
    from alkfs.git.objects import canonical
    from alkfs.keys import Algorithm
    from alkfsd.packs import repack_now, retire_grace

    with direct(tmp_path) as (app, ctx, s):
        old = s.current("sha1")
        assert old is not None and old.number == 1
        key = app.store.add(canonical("blob", b"repacked now\n"), algo=Algorithm.GIT_SHA1)
        assert await s.unpacked("sha1", key.digest[0]) == [app.store.stat(key)]
        report = await repack_now(ctx)
        assert list(report) == ["sha1"]
        assert (report["sha1"]["generation"], report["sha1"]["objects"]) == (2, old.objects + 1)
        new = s.current("sha1")
        assert key.digest in new and await s.unpacked("sha1", key.digest[0]) == []
        dropped = {name for _parent, name, _ino in ctx.invalidator.recorded}
        # info/commit-graphs' own entries are dropped only once the kernel looked it up
        # an intake: the pack stays (same file, same inode), the reused names go
        assert report["sha1"]["mode"] == "intake" and report["sha1"]["packs"] == 2
        assert dropped == {b"multi-pack-index", b"commit-graphs"}
        # nobody holds it: it goes once its grace passed (tests: 2 s; git may open a name
        # it listed before the publish)
        assert old.root.exists()
        await trio.sleep(retire_grace())
        await trio.to_thread.run_sync(s.prune, "sha1")
        assert not old.root.exists()


async def test_fanout_listings_read_the_table_again_only_after_a_put(tmp_path):
    """Direct calls: on a store this process alone changes, listing the fan-out
    directories again (git lists all 256 per process) reads nothing from sqlite until a
    put ends; an object put meanwhile is listed at once."""
    from alkfs.git.objects import canonical
    from alkfs.keys import Algorithm

    with direct(tmp_path) as (app, _ctx, s):
        for prefix in range(256):
            await s.unpacked("sha1", prefix)
        queried: list[str] = []
        conn = app.store.db.conn()
        conn.set_trace_callback(queried.append)
        try:
            for prefix in range(256):
                await s.unpacked("sha1", prefix)
            assert queried == []
            key = app.store.add(canonical("blob", b"listed at once\n"), algo=Algorithm.GIT_SHA1)
            assert await s.unpacked("sha1", key.digest[0]) == [app.store.stat(key)]
            assert any("max(" in q for q in queried)  # (the put moved the mark)
        finally:
            conn.set_trace_callback(None)


async def test_an_empty_fanout_listing_is_answered_again_without_a_look(tmp_path):
    """Direct calls: a prefix that listed nothing lists nothing again without a look at
    the set's records, the table's top or the large tier, while the set and the mark stay
    (most of git's 256 listings a process, in a packed store); a put ends that."""
    from alkfs.git.objects import canonical
    from alkfs.keys import Algorithm

    with direct(tmp_path) as (app, _ctx, s):
        listed = {prefix: await s.unpacked("sha1", prefix) for prefix in range(256)}
        empty = [prefix for prefix, out in listed.items() if out == []]
        assert len(empty) == 256
        looks: list[str] = []
        top = s._top

        async def counted_top(*args):
            looks.append("top")
            return await top(*args)

        s._top = counted_top
        for prefix in empty:
            assert await s.unpacked("sha1", prefix) == []
        assert looks == []
        key = app.store.add(
            canonical("blob", b"after the empty listings\n"), algo=Algorithm.GIT_SHA1
        )
        assert await s.unpacked("sha1", key.digest[0]) == [app.store.stat(key)]
        assert looks == ["top"]


async def test_a_large_object_stored_after_the_listings_is_listed_at_once(tmp_path):
    """Direct calls: the large tier's prefix directories are known from one listing of
    its format's directory (none exist here until the put), read again after a put."""
    from alkfs.git.objects import canonical
    from alkfs.keys import Algorithm

    with direct(tmp_path) as (app, _ctx, s):
        for prefix in range(256):
            assert await s.unpacked("sha1", prefix) == []
        key = app.store.add(canonical("blob", b"L" * 300_000), algo=Algorithm.GIT_SHA1)
        assert app.store.stat(key).tier == "large"
        assert await s.unpacked("sha1", key.digest[0]) == [app.store.stat(key)]
        assert await s.unpacked("sha1", (key.digest[0] + 1) % 256) == []


async def test_what_a_set_left_out_is_read_from_its_record_not_found_by_a_scan(tmp_path):
    """Direct calls: the first listing of a generation takes the objects it left out
    from the set's own record (no comparison of every stored key with the set); a set
    without a record (built before sets kept one) is scanned as before."""
    from alkfs.git.objects import canonical
    from alkfs.keys import Algorithm

    with direct(tmp_path) as (app, _ctx, s):
        key = app.store.add(canonical("blob", b"left out\n"), algo=Algorithm.GIT_SHA1)
        assert app.store.sweep(0).candidates_staged == 1
        d = s.derived["sha1"]
        await trio.to_thread.run_sync(d.build)
        gen = s.current("sha1")
        assert key.digest not in gen and gen.left_out() == [key.digest]
        found = {key.digest[0]: [key.digest]}
        assert s._left_out(d, gen) == found
        gen.meta["left_out"] = []  # (what the listing believes is the record)
        assert s._left_out(d, gen) == {}
        gen.meta["left_out"] = None  # none recorded: the scan finds it
        assert s._left_out(d, gen) == found


def test_a_set_corrupted_on_disk_is_withdrawn_at_start_and_rebuilt(
    start_mount, tmp_path, monkeypatch
):
    # (a store whose kv keeps every object: a set that is their only copy is reported,
    # never withdrawn: tests/git/test_drain.py)
    monkeypatch.setenv("ALKFS_DRAIN", "0")
    store, src = imported_store(tmp_path)
    pack = next((store / "derived" / "sha1" / "gen-1" / "pack").glob("*.pack"))
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF  # in place: same size, same name
    pack.write_bytes(bytes(data))
    m = start_mount(store, "--window", "1h", env=FAST_INTAKE)
    mnt = m.mnt
    current = store / "derived" / "sha1" / "CURRENT"
    wait_for("a rebuilt set", lambda: int(current.read_text()) >= 3 and listing(mnt, "sha1"))
    wait_for("gen-1 to go", lambda: not pack.exists())  # the new set may rebuild the name
    [served] = [n for n in listing(mnt, "sha1") if n.endswith(".pack")]
    rebuilt = (mnt / "git" / "sha1" / "pack" / served).read_bytes()
    assert rebuilt != bytes(data)
    assert rebuilt == next((store / "derived" / "sha1").glob("gen-*/pack/*.pack")).read_bytes()
    assert_packs_hold_all_of(src, mnt, tmp_path)
    assert "the published set is corrupt, withdrawn" in m.log()


def staged_pack(store: Path) -> str | None:
    """The published sha1 set's pack of staged objects (alkfs.json), as a .pack name."""
    d = store / "derived" / "sha1"
    meta = json.loads((d / f"gen-{int((d / 'CURRENT').read_text())}" / "alkfs.json").read_text())
    name = meta.get("staged_pack")
    return name[: -len(".idx")] + ".pack" if name else None


def test_staged_objects_move_into_a_pack_of_their_own_before_their_window_ends(
    start_mount, tmp_path
):
    """A sweep stages an object an intake packed: the next set holds it in its staged
    pack (so the sweep that deletes it only drops that pack), still packed, so off the
    fan-out listing, and still read. (Packed with a pinned object: an intake pack of
    staged objects alone is dropped whole by the sweep that deletes them, not rebuilt
    before: test_import_pack.py's repository removal.)"""
    store, _src = imported_store(tmp_path)
    m = start_mount(store, "--window", "1h", env=PAIR_INTAKE)
    mnt = m.mnt
    oid = put_loose(mnt, "sha1", b"staged for an hour\n")
    kept = put_loose(mnt, "sha1", b"pinned for good\n")
    os.symlink(f"../objects/git-sha1/{kept}", mnt / "pins" / "kept")
    wait_for("the intake pack", lambda: {oid, kept} <= idx_ids(mnt, "sha1"))
    assert staged_pack(store) is None
    (mnt / ".alkfs" / "control").write_text("sweep\n")
    assert last_sweep(mnt)["candidates_staged"] == 1
    wait_for("a set with a staged pack", lambda: staged_pack(store) is not None)
    wait_for("the mount to serve it", lambda: staged_pack(store) in listing(mnt, "sha1"))
    assert pack_holding(mnt, oid) == staged_pack(store)
    assert (mnt / "git" / "sha1" / oid[:2] / oid[2:]).exists()  # resolved by name
    assert oid not in fanout_listed(mnt, "sha1")
    assert git_out(f"--git-dir={mnt}/repos/r", "cat-file", "-p", oid) == "staged for an hour\n"
    assert m.tracebacks() == []


def test_a_staged_commit_a_ref_names_again_is_packed_and_fsck_finds_it(start_mount, tmp_path):
    """A branch deleted, its objects staged by a sweep and moved into the next set's
    staged pack, then the branch set again to its commit before any sweep takes them:
    they are live, packed, and `git fsck --full` finds every one (it calls a reachable
    object it neither enumerated nor finds in a pack "missing"); the next sweep cancels
    their deletion and they stay packed."""
    store, src = imported_store(tmp_path)
    m = start_mount(store, "--window", "1h", env=FAST_INTAKE)
    mnt = m.mnt
    repo = f"--git-dir={mnt}/repos/r"
    side = git_out(f"--git-dir={src}", "rev-parse", "side").strip()
    wait_for("the side commit in a pack", lambda: side in idx_ids(mnt, "sha1"))
    git(repo, "update-ref", "-d", "refs/heads/side")
    (mnt / ".alkfs" / "control").write_text("sweep\n")
    assert last_sweep(mnt)["candidates_staged"] == 3  # the side commit, its tree, its blob
    wait_for("a set with a staged pack", lambda: staged_pack(store) is not None)
    wait_for("the mount to serve it", lambda: staged_pack(store) in listing(mnt, "sha1"))
    assert pack_holding(mnt, side) == staged_pack(store)
    git(repo, "update-ref", "refs/heads/side", side)  # live again, still staged
    assert side not in fanout_listed(mnt, "sha1")
    git(repo, "fsck", "--full", "--strict", "--no-dangling")
    (mnt / ".alkfs" / "control").write_text("sweep\n")
    assert last_sweep(mnt)["deleted"] == 0
    assert side in idx_ids(mnt, "sha1")
    git(repo, "fsck", "--full", "--strict", "--no-dangling")
    assert m.tracebacks() == []


def test_verify_withdraws_a_set_corrupted_while_mounted_and_the_intake_rebuilds_it(
    start_mount, tmp_path, monkeypatch
):
    monkeypatch.setenv("ALKFS_DRAIN", "0")  # (as above)
    store, src = imported_store(tmp_path)
    m = start_mount(store, "--window", "1h", env=FAST_INTAKE)
    mnt = m.mnt
    current = store / "derived" / "sha1" / "CURRENT"
    number = int(current.read_text())
    pack = next((store / "derived" / "sha1" / f"gen-{number}" / "pack").glob("*.pack"))
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF  # in place, behind the daemon's back
    pack.chmod(0o644)
    pack.write_bytes(bytes(data))
    (mnt / ".alkfs" / "control").write_text("verify\n")
    assert "the published set is corrupt, withdrawn" in m.log()

    def served() -> dict:
        return json.loads((mnt / ".alkfs" / "status").read_text())["packs"]["sha1"]

    # (CURRENT is renamed into place a moment before the daemon serves what it names:
    # wait for what the daemon serves, not for the file)
    wait_for("a rebuilt set served", lambda: (served()["generation"] or 0) >= number + 2)
    assert int(current.read_text()) >= number + 2
    assert served()["objects"] > 0
    assert_packs_hold_all_of(src, mnt, tmp_path)
    for name in listing(mnt, "sha1"):
        if name.endswith(".idx"):
            git("verify-pack", mnt / "git" / "sha1" / "pack" / name)
    assert m.tracebacks() == []


def test_a_removed_fork_imported_alone_goes_with_its_pack_and_nothing_is_rewritten(
    start_mount, tmp_path
):
    """A fork imported after its upstream is a pack of its own; its refs removed, the two
    sweeps drop that pack whole (drop-packs) and the intake rewrites nothing meanwhile or
    after: the objects the deleting sweep writes back loose before it deletes them are no
    arrivals (it polled every 10 ms here, and rewrote the whole set after the sweep)."""
    src = source_repo(tmp_path / "up.git", "sha1")
    fork = tmp_path / "fork.git"
    git("clone", "-q", "--mirror", src, fork)
    out = ["commit refs/heads/fork\n", "committer F <f@example.com> 1700000000 +0000\n"]
    out.append("data 5\nfork\nfrom refs/heads/main\n")
    for j in range(3000):  # (enough rows that the deleting sweep takes a while)
        data = f"the fork's file {j}\n" * (1 + j % 5)
        out.append(f"M 100644 inline fork/{j % 40}/f{j}.txt\ndata {len(data)}\n{data}\n")
    git(f"--git-dir={fork}", "fast-import", "--quiet", input="".join(out).encode())
    store = tmp_path / "store"
    with Alkfs.open(store, window_s=0) as app:
        import_repo(app, str(src), "up", progress=False)
        import_repo(app, str(fork), "fork", progress=False)
        app.refs.delete_repo("fork")
    m = start_mount(store, "--window", "1h", env={**FAST_INTAKE, "ALKFS_PACK_POLL": "0.01"})
    mnt = m.mnt
    for _ in range(2):
        (mnt / ".alkfs" / "control").write_text("sweep 0\n")
    # (its blobs, the 40 directories under fork/, fork/ itself, the root tree, the commit)
    assert last_sweep(mnt)["deleted"] == 3000 + 40 + 3
    meta = json.loads(
        (
            store
            / "derived"
            / "sha1"
            / f"gen-{int((store / 'derived' / 'sha1' / 'CURRENT').read_text())}"
            / "alkfs.json"
        ).read_text()
    )
    assert meta["mode"] == "drop-packs"
    time.sleep(1.0)  # (a hundred polls of the intake)
    published = [line for line in m.log().splitlines() if "derived sha1: published" in line]
    assert '"mode": "drop-packs"' in published[-1], published[-3:]
    assert m.tracebacks() == []
