"""Derived packs in a fleet (docs/git.md, "In a fleet"): two daemons on one PostgreSQL store
and the same STORE directory. A set is built once for the fleet and served by both mounts; a
sweep through one daemon publishes a set without what it deletes before it deletes, and
neither mount lists a pack holding a deleted object afterwards; a retired set stays on disk
while a daemon still has one of its files open, and goes once the last is closed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psycopg
import pytest
from helpers import git_out as git
from helpers import status
from test_packs_mount import idx_ids, last_sweep, listing, source_repo, wait_for

from alkfs.keys import Algorithm

FAST_INTAKE = {"ALKFS_PACK_EVERY": "0", "ALKFS_PACK_POLL": "0.2"}


@pytest.fixture
def fleet(start_pg_mount, tmp_path):
    """Two daemons (`--window 0`, fast intake) on one database and STORE directory, and a
    repository `r` pushed through mount 1."""
    store = tmp_path / "store"
    m1 = start_pg_mount(store, "--window", "0", mnt=tmp_path / "mnt1", env=FAST_INTAKE)
    m2 = start_pg_mount(store, "--window", "0", mnt=tmp_path / "mnt2", env=FAST_INTAKE)
    src = source_repo(tmp_path / "src.git", "sha1")
    os.mkdir(m1.path("repos", "r"))
    git(f"--git-dir={src}", "push", "-q", m1.path("repos", "r"), "main", "side", "--tags")
    yield m1, m2, src
    for m in (m1, m2):
        assert m.tracebacks() == [], m.all_logs()[-3000:]


def generation(m) -> int | None:
    return status(m)["packs"].get("sha1", {}).get("generation")


def rows(uri: str, sql: str) -> list[tuple]:
    with psycopg.connect(uri, autocommit=True) as conn:
        return conn.execute(sql).fetchall()


def both_serve_one_set(m1, m2, src) -> int:
    """Wait until both mounts list the same set holding all of `src`'s objects; its number."""
    want = set(git(f"--git-dir={src}", "rev-list", "--objects", "--all").split()[::2])
    want = {x for x in want if len(x) == 40}
    wait_for(
        "one set holding the push, served by both mounts",
        lambda: (
            (g := generation(m1)) is not None
            and g == generation(m2)
            and listing(m1.mnt, "sha1") == listing(m2.mnt, "sha1")
            and want <= idx_ids(m2.mnt, "sha1")
        ),
    )
    return generation(m1)


def test_a_set_built_once_is_served_by_both_daemons(fleet, tmp_path):
    m1, m2, src = fleet
    number = both_serve_one_set(m1, m2, src)
    assert rows(m1.database, "SELECT fmt, generation FROM fleet_packs WHERE fmt = 'sha1'") == [
        ("sha1", number)
    ]
    serving = rows(
        m1.database,
        "SELECT node, generation FROM fleet_pack_holds WHERE fmt = 'sha1' AND serving = 1",
    )
    assert sorted(g for _n, g in serving) == [number, number]
    assert len({n for n, _g in serving}) == 2
    # one directory for the fleet: every file each mount lists is that generation's
    gen_dir = m1.store_path / "derived" / "sha1" / f"gen-{number}" / "pack"
    assert listing(m2.mnt, "sha1") == sorted(os.listdir(gen_dir))
    # (no record of what it left out: PostgreSQL's arrival order is not commit order,
    # so only a scan would tell, and no listing trusts one: Derived._records_left_out)
    meta = json.loads((gen_dir.parent / "alkfs.json").read_text())
    assert meta["max_rowid"] > 0 and meta["left_out"] is None
    for m in (m1, m2):
        for name in listing(m.mnt, "sha1"):
            if name.endswith(".pack"):
                git("verify-pack", m.path("git", "sha1", "pack", name.replace(".pack", ".idx")))
        git("multi-pack-index", f"--object-dir={m.mnt}/git/sha1", "verify")
        git(f"--git-dir={m.path('repos', 'r')}", "fsck", "--full", "--strict", "--no-dangling")
    clone = tmp_path / "clone"
    git("clone", "-q", "--no-local", "--mirror", m2.path("repos", "r"), clone)
    assert git(f"--git-dir={clone}", "rev-parse", "main") == git(
        f"--git-dir={src}", "rev-parse", "main"
    )


def test_a_sweep_leaves_no_deleted_object_in_any_set_either_daemon_lists(fleet):
    m1, m2, src = fleet
    both_serve_one_set(m1, m2, src)
    # The push through mount 1 pinned its objects in daemon 1 until its refs committed;
    # a released pin's row goes at daemon 1's next unpin flush (alkfs/fleet.py,
    # UNPIN_EVERY_S), and a sweep before it keeps what the row names (pinned elsewhere).
    # Without this wait all five sweeps below could run inside that half second (they
    # take ~20 ms each) and delete nothing: the flake of 2026-12-02/03.
    wait_for(
        "daemon 1's released pin rows to go",
        lambda: rows(m1.database, "SELECT count(*) FROM fleet_pins") == [(0,)],
    )
    side = git(f"--git-dir={src}", "rev-parse", "side").strip()
    side_blob = git(f"--git-dir={src}", "rev-parse", "side:side.txt").strip()
    assert {side, side_blob} <= idx_ids(m1.mnt, "sha1") & idx_ids(m2.mnt, "sha1")
    os.unlink(m2.path("repos", "r", "refs", "heads", "side"))
    control = m2.path(".alkfs", "control")
    control.write_text("sweep\n")  # stages them
    assert last_sweep(m2.mnt)["candidates_staged"] == 3  # the side commit, its tree, its blob
    deleted = 0
    seen = []
    for _ in range(5):  # (a sweep keeps all when a ref or pin moved since it marked: again)
        control.write_text("sweep\n")
        report = last_sweep(m2.mnt)
        seen.append(report)
        assert report["aborted"] is None, report
        deleted += report["deleted"]
        if deleted == 3:
            break
    assert deleted == 3, seen
    for m in (m2, m1):  # (mount 1 learns the new set by its notice: read at once after)
        wait_for("the new set on both", lambda m=m: generation(m) == generation(m2))
        assert {side, side_blob}.isdisjoint(idx_ids(m.mnt, "sha1")), m.mnt
        git(f"--git-dir={m.path('repos', 'r')}", "fsck", "--full", "--strict", "--no-dangling")
    wait_for(
        "mount 1 to drop the deleted objects",
        lambda: not os.path.exists(m1.path("git", "sha1", side[:2], side[2:])),
    )


def test_a_retired_set_stays_while_a_daemon_holds_its_files_and_goes_after(fleet):
    m1, m2, src = fleet
    old = both_serve_one_set(m1, m2, src)
    [name] = [n for n in listing(m2.mnt, "sha1") if n.endswith(".pack")][:1]
    backing = m1.store_path / "derived" / "sha1" / f"gen-{old}" / "pack" / name
    expected = backing.read_bytes()
    fd = os.open(m2.path("git", "sha1", "pack", name), os.O_RDONLY)  # held by daemon 2
    try:
        new = git(
            "hash-object",
            "-w",
            "--stdin",
            env={"GIT_OBJECT_DIRECTORY": f"{m1.mnt}/git/sha1", "GIT_DIR": m1.path("repos", "r")},
            input=b"a new object: the next set is built through mount 1\n",
        ).strip()
        m1.path(".alkfs", "control").write_text("repack\n")
        wait_for(
            "the new set on both",
            lambda: (generation(m1) or 0) > old and generation(m2) == generation(m1),
        )
        assert new in idx_ids(m2.mnt, "sha1")
        node2 = next(n["id"] for n in status(m2)["fleet"]["nodes"] if n["self"])

        def holders() -> set[str]:
            sql = f"SELECT node FROM fleet_pack_holds WHERE fmt = 'sha1' AND generation = {old}"
            return {node for (node,) in rows(m1.database, sql)}

        # daemon 1 lets go of it after its grace; daemon 2's open file keeps it
        wait_for("only daemon 2 to hold the retired set", lambda: holders() == {node2})
        assert backing.parent.parent.is_dir() and backing.read_bytes() == expected
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read reaches daemon 2
        assert os.pread(fd, len(expected) + 10, 0) == expected
    finally:
        os.close(fd)
    wait_for("the retired set to go", lambda: not backing.parent.parent.exists())
    done = subprocess.run(["cat", m2.path("git", "sha1", "pack", "multi-pack-index")])
    assert done.returncode == 0, (
        status(m2)["packs"],
        status(m1)["packs"],
        sorted(os.listdir(m1.store_path / "derived" / "sha1")),
        listing(m2.mnt, "sha1"),
        rows(m1.database, "SELECT * FROM fleet_pack_holds"),
        rows(m1.database, "SELECT * FROM fleet_packs"),
        m2.log()[-3000:],
    )


def test_an_object_one_member_stores_is_listed_by_the_other(start_pg_mount, tmp_path):
    """Both members serve a published set and pack nothing new (no intake): an object
    stored through mount 2 is in its fan-out listing at once, and in mount 1's as soon
    as its row is committed (each listing reads the newest row; polled here only for
    the kernel's and the test's own timing)."""
    no_intake = {"ALKFS_PACK_EVERY": "86400", "ALKFS_PACK_OBJECTS": "1000000"}
    store = tmp_path / "store"
    m1 = start_pg_mount(store, "--window", "0", mnt=tmp_path / "mnt1", env=no_intake)
    src = source_repo(tmp_path / "src.git", "sha1")
    os.mkdir(m1.path("repos", "r"))
    git(f"--git-dir={src}", "push", "-q", m1.path("repos", "r"), "main")
    (m1.mnt / ".alkfs" / "control").write_text("repack\n")  # a set holding the push
    m2 = start_pg_mount(store, "--window", "0", mnt=tmp_path / "mnt2", env=no_intake)
    wait_for("both to serve it", lambda: generation(m1) is not None)
    wait_for("both to serve it", lambda: generation(m2) == generation(m1))
    env = {"GIT_OBJECT_DIRECTORY": m2.path("git", "sha1"), "GIT_DIR": m2.path("repos", "r")}
    oid = git("hash-object", "-w", "--stdin", env=env, input=b"stored through mount 2\n").strip()
    assert oid not in idx_ids(m2.mnt, "sha1") | idx_ids(m1.mnt, "sha1")
    assert oid[2:] in os.listdir(m2.path("git", "sha1", oid[:2]))
    wait_for("mount 1 to list it", lambda: oid[2:] in os.listdir(m1.path("git", "sha1", oid[:2])))
    for m in (m1, m2):
        assert m.tracebacks() == [], m.all_logs()[-3000:]


def kv_git_rows(uri: str, ids: set[str]) -> int:
    """How many of the git-sha1 objects `ids` (hex) the kv tier holds as rows."""
    keys = [bytes([Algorithm.GIT_SHA1.value]) + bytes.fromhex(x) for x in ids]
    with psycopg.connect(uri, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM blobs WHERE key = ANY(%s)", (keys,)).fetchone()
    assert row is not None
    return int(row[0])


def src_ids(src) -> set[str]:
    out = git(f"--git-dir={src}", "rev-list", "--objects", "--all").split()[::2]
    return {x for x in out if len(x) == 40}


def test_a_fleet_keeps_packed_git_objects_in_their_packs_alone(fleet, tmp_path):
    """Once both members serve the set holding a push, the builder drains: the kv holds
    none of its objects (each is kept once, in the fleet's packs), and each mount, and
    a command line run beside them, still serves every object, byte for byte."""
    m1, m2, src = fleet
    number = both_serve_one_set(m1, m2, src)
    ids = src_ids(src)
    wait_for("the drain", lambda: kv_git_rows(m1.database, ids) == 0)
    assert (m1.store_path / "derived" / "sha1" / "PRIMARY").is_file()
    figures = [status(m)["packs"]["sha1"] for m in (m1, m2)]
    assert [f["primary"] for f in figures] == [True, True]
    assert [f["generation"] for f in figures] == [number, number]
    assert sum(f["drained"] for f in figures) >= len(ids)
    blob = git(f"--git-dir={src}", "rev-parse", "main:src/d0/f0.txt").strip()
    want = subprocess.run(
        ["git", f"--git-dir={src}", "cat-file", "blob", blob], capture_output=True, check=True
    ).stdout
    for n, m in enumerate((m1, m2)):
        raw = m.path("objects", "git-sha1", blob).read_bytes()
        assert raw == b"blob %d\0" % len(want) + want
        clone = tmp_path / f"clone{n}"
        git("clone", "-q", "--no-local", "--mirror", m.path("repos", "r"), clone)
        git(f"--git-dir={clone}", "fsck", "--full", "--strict", "--no-dangling")
        assert git(f"--git-dir={clone}", "for-each-ref") == git(f"--git-dir={src}", "for-each-ref")
    # a push through mount 2 after the drain: the next set carries the drained objects
    # over (from the previous set: the kv lacks them) and the new ones are drained too
    more = "commit refs/heads/main\ncommitter C <c@example.com> 1700000200 +0000\ndata 4\nmore"
    more += "\nfrom refs/heads/main^0\nM 100644 inline more.txt\ndata 5\nmore\n\n"
    git(f"--git-dir={src}", "fast-import", "--quiet", input=more.encode())
    git(f"--git-dir={src}", "push", "-q", m2.path("repos", "r"), "main")
    ids = src_ids(src)
    wait_for(
        "a newer set holding the push on both",
        lambda: (
            (generation(m1) or 0) > number
            and generation(m2) == generation(m1)
            and ids <= idx_ids(m1.mnt, "sha1")
        ),
    )
    wait_for("the drain of the push", lambda: kv_git_rows(m1.database, ids) == 0)
    for m in (m1, m2):
        git(f"--git-dir={m.path('repos', 'r')}", "fsck", "--full", "--strict", "--no-dangling")
    out = tmp_path / "got"
    cli = [sys.executable, "-m", "alkfs.cli", "--store", str(m1.store_path)]
    cli += ["--database", str(m1.database)]
    done = subprocess.run(
        [*cli, "get", f"git-sha1/{blob}", "-o", str(out)], capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == b"blob %d\0" % len(want) + want


def test_a_fleets_drain_waits_for_a_member_serving_an_older_set(start_pg_mount, tmp_path):
    """A live member that still serves an older set (one without the push) keeps the
    kv's copies: nothing is drained until it serves the new set, then all of it is."""
    store = tmp_path / "store"
    m1 = start_pg_mount(store, "--window", "0", mnt=tmp_path / "mnt1", env=FAST_INTAKE)
    wait_for("daemon 1 to join", lambda: len(status(m1)["fleet"]["nodes"]) == 1)
    with psycopg.connect(m1.database, autocommit=True) as conn:  # a member serving set 1
        conn.execute(
            "INSERT INTO fleet_nodes (id, host, pid, started_ns, expiry_ns, sweeping) "
            "VALUES ('slow', 'elsewhere', 1, 0, 9223372036854775807, 0)"
        )
        conn.execute(
            "INSERT INTO fleet_pack_holds (node, fmt, generation, serving) "
            "VALUES ('slow', 'sha1', 1, 1)"
        )
    src = source_repo(tmp_path / "src.git", "sha1")
    os.mkdir(m1.path("repos", "r"))
    git(f"--git-dir={src}", "push", "-q", m1.path("repos", "r"), "main", "side", "--tags")
    ids = src_ids(src)
    wait_for("a set holding the push", lambda: ids <= idx_ids(m1.mnt, "sha1"))
    number = generation(m1)
    assert number is not None and number > 1
    held = "another daemon still serves a set older than"
    wait_for("the drain held back", lambda: held in m1.log())  # (it looked, and waited)
    assert kv_git_rows(m1.database, ids) == len(ids)
    assert not (m1.store_path / "derived" / "sha1" / "PRIMARY").exists()
    with psycopg.connect(m1.database, autocommit=True) as conn:  # it serves the new set
        conn.execute("UPDATE fleet_pack_holds SET generation = %s WHERE node = 'slow'", (number,))
    wait_for("the drain", lambda: kv_git_rows(m1.database, ids) == 0)
    assert status(m1)["packs"]["sha1"]["primary"] is True
    git(f"--git-dir={m1.path('repos', 'r')}", "fsck", "--full", "--strict", "--no-dangling")
    with psycopg.connect(m1.database, autocommit=True) as conn:
        conn.execute("DELETE FROM fleet_pack_holds WHERE node = 'slow'")
        conn.execute("DELETE FROM fleet_nodes WHERE id = 'slow'")
    assert m1.tracebacks() == [], m1.all_logs()[-3000:]
