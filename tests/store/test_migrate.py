"""`alkfs migrate`: a store's database from its sqlite file into PostgreSQL and back.

Real sqlite files, a real PostgreSQL database (`pg_uri`), real git repositories, the real
CLI (`alkfs.cli.main`). Every object (bytes through the store's verified reads), ref,
repository, pin and delete-window row must survive the round trip exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import git

from alkfs import migrate
from alkfs.app import Alkfs
from alkfs.binding import BINDING_NAME, read_binding
from alkfs.cli import main
from alkfs.db.postgres import PostgresDatabase
from alkfs.errors import Invalid, StoreLocked
from alkfs.git.importer import import_repo
from alkfs.git.refs import RefUpdate
from alkfs.keys import Key
from alkfs.schema import TABLES as ALL_TABLES
from alkfs.store import DB_NAME, Store

# the tables a migration moves (the fleet's hold only live daemons' state)
TABLES = [t for t in ALL_TABLES if {"sqlite", "postgresql"} <= t.engines]

THRESHOLD = 1024
SMALL, LARGE = 12, 3  # pinned objects of each tier
SECRET = "s3cret-pw"


def with_password(uri: str) -> str:
    return uri.replace("postgres@", f"postgres:{SECRET}@", 1)


def git_repo(path: Path) -> Path:
    path.mkdir()
    git("init", "-q", "-b", "main", cwd=path)
    for i in range(3):
        (path / f"f{i}.txt").write_bytes(f"file {i}\n".encode() * (1 + i * 400))
        git("add", "-A", cwd=path)
        git("commit", "-q", "-m", f"commit {i}", cwd=path)
    git("tag", "v1", cwd=path)
    git("branch", "side", "HEAD~1", cwd=path)
    return path / ".git"


def build(root: Path, tmp_path: Path) -> None:
    """A sqlite store with both tiers, a git import, a hand-made repository, pins and one
    staged window row."""
    app = Alkfs.open(root, threshold=THRESHOLD, window_s=0)
    try:
        store = app.store
        for i in range(SMALL + LARGE):
            size = 100 + i if i < SMALL else 3 * THRESHOLD + i * 1000
            result = store.put(bytes((i * 7 + j) % 251 for j in range(size)))
            result.pin.release()
            app.pins.pin(f"pin{i}", result.key)
        orphan = store.put(b"nobody keeps me")
        orphan.pin.release()
        import_repo(app, str(git_repo(tmp_path / "src")), "imported")
        app.roots.add("clone", str(tmp_path / "src"))  # (a borrower's registration)
        app.refs.create_repo("hand", "sha1")
        blob = store.put(b"blob 5\x00hello", algo=Key.parse("0" * 40).algo)
        blob.pin.release()
        head = app.refs.get("imported", "refs/heads/main")
        assert head is not None
        outcomes = app.refs.update("hand", [RefUpdate("refs/heads/main", head, None)])
        assert all(o.ok for o in outcomes), outcomes
        app.refs.set_head("hand", "refs/heads/main")
        report = store.sweep(window_s=3600)  # the orphan and the loose blob: staged
        assert report.candidates_staged == 2, report
    finally:
        app.close()


def state(app: Alkfs) -> dict[str, Any]:
    """Everything a migration must keep, read through the library."""
    store = app.store
    assert store.db is not None
    objects = {}
    for raw in store.iter_keys():
        key = Key(raw)
        stat = store.stat(key)
        assert stat is not None
        objects[raw] = (stat.tier, store.get(key))
    repos = {}
    for repo in app.refs.repos():
        repos[repo.id] = (repo, app.refs.head(repo.id), app.refs.refs(repo.id))
    tables = {
        t.name: sorted(
            tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)
            for row in store.db.execute(f"SELECT * FROM {t.name}").fetchall()
        )
        for t in TABLES
        if t.name not in ("blobs",)
    }
    tables["blobs"] = sorted(
        (bytes(k), n) for k, n in store.db.execute("SELECT key, size FROM blobs").fetchall()
    )
    return {
        "objects": objects,
        "repos": repos,
        "pins": sorted((p.name, p.key, p.created_ns) for p in app.pins.list()),
        "tables": tables,
    }


def counts(tables: dict[str, list]) -> dict[str, int]:
    return {name: len(rows) for name, rows in tables.items()}


def pg_rows(uri: str) -> dict[str, int]:
    """Rows per table of the PostgreSQL database (an absent table: -1)."""
    out = {}
    with psycopg.connect(uri) as pg:
        for t in TABLES:
            there = pg.execute("SELECT to_regclass(%s)", (t.name,)).fetchone()
            if there is None or there[0] is None:
                out[t.name] = -1
            else:
                row = pg.execute(f"SELECT count(*) FROM {t.name}").fetchone()
                assert row is not None
                out[t.name] = row[0]
    return out


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_file())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "store"
    build(r, tmp_path)
    return r


def test_round_trip_sqlite_postgresql_sqlite(
    root: Path, pg_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    app = Alkfs.open(root)
    before = state(app)
    app.close()
    n = counts(before["tables"])
    packed = {raw: data for raw, (tier, data) in before["objects"].items() if tier == "packs"}
    assert len(packed) == 9  # the imported git objects, large ones too: in their pack alone
    assert len(before["objects"]) == n["blobs"] + n["catalog"] + len(packed)
    assert n == {
        # mode, threshold, schema_version, store_id, lfs_scanned
        "meta": 5,
        "blobs": 14,  # 12 pinned, the orphan, the loose git blob
        "gc_window": 2,  # the orphan and the loose blob, staged
        "catalog": 3,  # the pinned large objects
        "git_repos": 2,
        "git_refs": 4,  # imported: main, side, v1; hand: main
        "pins": 15,
        "roots": 1,
        "lfs_pointers": 0,
    }
    assert sum(1 for tier, _ in before["objects"].values() if tier == "large") == LARGE

    # what PostgreSQL holds: the packed objects written back into the kv first (a
    # PostgreSQL store's fleet keeps the kv's copies), every other thing as it was
    moved = {
        **before,
        "objects": {
            raw: ("kv" if tier == "packs" else tier, data)
            for raw, (tier, data) in before["objects"].items()
        },
        "tables": {
            **before["tables"],
            "blobs": sorted(
                [*before["tables"]["blobs"], *((k, len(v)) for k, v in packed.items())]
            ),
        },
    }
    n = {**n, "blobs": n["blobs"] + len(packed)}
    uri = with_password(pg_uri)
    code, out, err = cli(capsys, "--store", str(root), "--database", uri, "migrate")
    assert (code, err) == (0, "")
    assert out.count("\n") == 1 and SECRET not in out
    summary = json.loads(out)
    assert summary["rows"] == n and summary["written_back"] == 9
    assert summary["database"] == pg_uri
    assert not (root / DB_NAME).exists()
    migrated = [f for f in files(root) if f.startswith(DB_NAME + ".migrated-")]
    assert migrated == [Path(summary["sqlite_file"]).name]
    assert not any(f.endswith(("-wal", "-shm")) for f in files(root))
    binding = read_binding(root)
    assert binding is not None and SECRET not in (root / BINDING_NAME).read_text()
    assert pg_rows(pg_uri) == n

    with pytest.raises(Invalid, match="start it with --database"):
        Store.open(root)
    code, out, err = cli(capsys, "--store", str(root), "status")
    assert code == 1 and "--database" in err and out == ""
    app = Alkfs.open(root, database=uri)
    try:
        assert state(app) == moved
        added = app.store.put(b"written after the move")
        added.pin.release()
        app.pins.pin("after", added.key)
    finally:
        app.close()

    code, out, err = cli(capsys, "--store", str(root), "--database", uri, "migrate", "--to-sqlite")
    assert (code, err) == (0, "")
    summary = json.loads(out)
    assert SECRET not in out and "left as it was" in summary["postgresql"]
    assert summary["rows"] == {**n, "blobs": n["blobs"] + 1, "pins": n["pins"] + 1}
    assert read_binding(root) is None and (root / DB_NAME).is_file()
    assert pg_rows(pg_uri) == summary["rows"]  # the PostgreSQL database is left as it was
    app = Alkfs.open(root)
    try:
        after = state(app)
        assert after["objects"].pop(added.key.raw) == ("kv", b"written after the move")
        assert ("after", added.key) == after["pins"].pop(0)[:2]
        for name in ("blobs", "pins"):
            after["tables"][name] = moved["tables"][name]
        assert after == moved
        # the arrival order kept going: a new row arrives after every copied one
        assert app.store.kv.high_water() >= n["blobs"] + 1  # type: ignore[union-attr]
    finally:
        app.close()


def test_a_drained_postgresql_store_moves_back_to_sqlite_with_every_git_object(
    root: Path, pg_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A PostgreSQL store's fleet drains too: its sets are then the only copy of the git
    objects they hold, and they are named in the database, which a sqlite store does
    not read. The move back writes them into the kv first; every object reads back."""
    from alkfs.git import packs

    uri = with_password(pg_uri)
    code, _out, err = cli(capsys, "--store", str(root), "--database", uri, "migrate")
    assert (code, err) == (0, "")
    app = Alkfs.open(root, database=uri)
    try:
        before = {raw: data for raw, (_tier, data) in state(app)["objects"].items()}
        d = packs.derived_for(app.store, "sha1")
        assert d is not None and d.shared is not None  # (a fleet's member)
        packs.build(app.store, "sha1")
        assert d.drain(0.0) == 9  # the imported objects (the loose blob is staged)
        assert d.primary
        tiers = {raw: tier for raw, (tier, _data) in state(app)["objects"].items()}
        assert sorted(tiers.values()).count("packs") == 9
        assert {raw: data for raw, (_t, data) in state(app)["objects"].items()} == before
    finally:
        app.close()
    code, out, err = cli(capsys, "--store", str(root), "--database", uri, "migrate", "--to-sqlite")
    assert (code, err) == (0, "")
    assert json.loads(out)["written_back"] == 9
    app = Alkfs.open(root)
    try:
        after = state(app)["objects"]
        assert {raw: data for raw, (_tier, data) in after.items()} == before
        assert {tier for _tier, _d in after.values() for tier in [_tier]} <= {"kv", "large"}
    finally:
        app.close()


def test_interrupted_migration_resumes(
    root: Path, pg_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrate, "BATCH", 7)
    calls: list[tuple[int, int]] = []

    def stop_after_three(done: int, total: int) -> None:
        calls.append((done, total))
        if len(calls) == 4:  # (0, total), then three committed batches
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        migrate.to_postgresql(root, pg_uri, progress=stop_after_three)
    assert calls[1:] == [(5, calls[0][1]), (12, calls[0][1]), (19, calls[0][1])]
    rows = pg_rows(pg_uri)
    assert (rows["meta"], rows["blobs"], rows["pins"]) == (5, 14, 0)
    assert (root / DB_NAME).is_file() and read_binding(root) is None

    # the source stays usable, and changes made before the rerun are carried over
    app = Alkfs.open(root)
    try:
        app.pins.unpin("pin0")
        app.refs.update("imported", [RefUpdate("refs/heads/side", None)])
        before = state(app)
    finally:
        app.close()
    summary = migrate.to_postgresql(root, pg_uri)
    assert summary["rows"] == counts(before["tables"])
    assert pg_rows(pg_uri) == counts(before["tables"])
    with Alkfs.open(root, database=pg_uri) as app:
        assert state(app) == before


def test_interrupted_return_resumes(
    root: Path, pg_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    migrate.to_postgresql(root, pg_uri)
    with Alkfs.open(root, database=pg_uri) as app:
        before = state(app)
    monkeypatch.setattr(migrate, "BATCH", 5)

    def stop(done: int, total: int) -> None:
        if done > 12:
            raise RuntimeError("stopped")

    with pytest.raises(RuntimeError):
        migrate.to_sqlite(root, pg_uri, progress=stop)
    assert not (root / DB_NAME).exists() and (root / migrate.PARTIAL).is_file()
    with Alkfs.open(root, database=pg_uri) as app:  # still the PostgreSQL store
        assert state(app) == before
    migrate.to_sqlite(root, pg_uri)
    assert not (root / migrate.PARTIAL).exists()
    with Alkfs.open(root) as app:
        assert state(app) == before


def _unchanged(root: Path, uri: str, pg_before: dict[str, int], names: list[str]) -> None:
    assert files(root) == names
    assert pg_rows(uri) == pg_before


def test_refusals(
    root: Path, pg_uri: str, pg_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = files(root)
    empty = {t.name: -1 for t in TABLES}
    uri = with_password(pg_uri)

    # the store held by a daemon (its lock)
    holder = Alkfs.open(root)
    try:
        with pytest.raises(StoreLocked):
            migrate.to_postgresql(root, uri)
        code, out, err = cli(capsys, "--store", str(root), "--database", uri, "migrate")
        assert code == 1 and out == "" and "held by another process" in err
        assert err.count("\n") == 1 and SECRET not in err
    finally:
        holder.close()
    _unchanged(root, pg_uri, empty, names)

    # the PostgreSQL database held by another process
    held = PostgresDatabase(pg_uri, lock=True)
    try:
        with pytest.raises(StoreLocked, match="held by another alkfs process"):
            migrate.to_postgresql(root, uri)
    finally:
        held.close()
    _unchanged(root, pg_uri, empty, names)

    # --to-sqlite on a sqlite store
    code, out, err = cli(capsys, "--store", str(root), "--database", uri, "migrate", "--to-sqlite")
    assert code == 1 and "not kept in PostgreSQL" in err and out == ""
    _unchanged(root, pg_uri, empty, names)

    # no --database; --mount
    with pytest.raises(SystemExit) as exc:
        main(["--store", str(root), "migrate"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["--mount", str(tmp_path), "migrate"])
    assert exc.value.code == 2
    assert "--store" in capsys.readouterr().err
    _unchanged(root, pg_uri, empty, names)

    # a database that holds another store
    other = pg_server.create_database()
    Alkfs.open(tmp_path / "other", database=other).close()
    other_rows = pg_rows(other)
    code, out, err = cli(capsys, "--store", str(root), "--database", other, "migrate")
    assert code == 1 and "holds another store" in err and out == ""
    _unchanged(root, other, other_rows, names)

    # migrate on a store already in PostgreSQL
    migrate.to_postgresql(root, uri)
    moved = files(root)
    pg_after = pg_rows(pg_uri)
    code, out, err = cli(capsys, "--store", str(root), "--database", uri, "migrate")
    assert code == 1 and "already kept in PostgreSQL" in err
    _unchanged(root, pg_uri, pg_after, moved)

    # back to sqlite while a store.db is in the way; while the database is held
    (root / DB_NAME).write_bytes(b"")
    code, out, err = cli(capsys, "--store", str(root), "--database", uri, "migrate", "--to-sqlite")
    assert code == 1 and "exists" in err
    (root / DB_NAME).unlink()
    held = PostgresDatabase(pg_uri, lock=True)
    try:
        with pytest.raises(StoreLocked):
            migrate.to_sqlite(root, uri)
    finally:
        held.close()
    # back to sqlite from a database that is not the store's
    with pytest.raises(Invalid, match="does not hold the store"):
        migrate.to_sqlite(root, other)
    _unchanged(root, pg_uri, pg_after, moved)
    assert pg_rows(other) == other_rows
