"""Moving a store's database between its sqlite file and a PostgreSQL database.

`to_postgresql(root, uri)` copies every table of `alkfs/schema.py` from `STORE/store.db`
into the PostgreSQL database `uri`; `to_sqlite(root, uri)` copies them back into a fresh
`STORE/store.db`. The large tier (`STORE/large`) is the directory's and stays as it is.

The steps, each safe to interrupt:

1. take the store's lock (the one `Store.open` takes) and, on the PostgreSQL side, the
   database's store lock: no daemon or CLI may hold either;
2. copy table by table, `BATCH` rows per transaction, with idempotent inserts: a
   migration stopped midway and run again resumes and finishes (rows already there are
   brought up to date; rows the source no longer has are removed from the copy);
3. verify the copy: per table the row count and an order-independent digest of every
   row equal the source's, and every kv value of the copy hashes to its key;
4. only then switch: write the binding `STORE/database` and rename the sqlite file to
   `store.db.migrated-<UTC time>` (to PostgreSQL), or rename the new file to
   `store.db` and remove the binding (back to sqlite; the PostgreSQL database is left
   as it was). The source is not changed before this step.

The kv tier's arrival numbers (sqlite's rowid, PostgreSQL's seq) are copied too, so
derived packs built before the move keep knowing what arrived since.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from . import schema
from .binding import DB_NAME, read_binding, remove_binding, settle, write_binding
from .db import Database
from .db.sqlite import SqliteDatabase
from .db.uri import check, redact
from .errors import Invalid, Missing, StoreIO
from .keys import Key
from .tiers.local import fsync_dir

BATCH = 5000
PARTIAL = DB_NAME + ".partial"  # the sqlite copy while `to_sqlite` builds it
MIGRATED = DB_NAME + ".migrated-"  # + UTC time: the sqlite file after `to_postgresql`
_MOD = 1 << 128

Progress = Callable[[int, int], None]


class _Spec:
    """How one table is copied: its columns (with the kv tier's arrival number)."""

    def __init__(self, table: schema.Table) -> None:
        self.table = table
        self.name = table.name
        self.columns = [c.name for c in table.columns]
        self.primary = list(table.primary)
        self.arrival = table is schema.BLOBS

    def select(self, db: Database) -> str:
        cols = ", ".join(self.columns)
        if self.arrival:
            return f"SELECT {db.arrival}, {cols} FROM {self.name} ORDER BY {db.arrival}"
        return f"SELECT {cols} FROM {self.name}"

    def insert(self, db: Database) -> str:
        cols = self.columns if not self.arrival else [db.arrival, *self.columns]
        marks = ", ".join("?" for _ in cols)
        # Rows already in the copy (a resumed migration) are brought up to date; a kv
        # value is its key's content, so it is never rewritten.
        fixed = set(self.primary)
        if self.arrival:  # (a sqlite rowid moved onto another row's could collide)
            fixed |= {"value", "size"} | ({db.arrival} if db.engine == "sqlite" else set())
        changing = [c for c in cols if c not in fixed]
        conflict = ", ".join(self.primary)
        sets = ", ".join(f"{c} = excluded.{c}" for c in changing)
        differs = " OR ".join(f"{self.name}.{c} IS DISTINCT FROM excluded.{c}" for c in changing)
        sql = (
            f"INSERT INTO {self.name} ({', '.join(cols)}) VALUES ({marks}) "
            f"ON CONFLICT ({conflict}) DO UPDATE SET {sets} WHERE {differs}"
        )
        if self.arrival and db.engine == "sqlite":
            # (a rowid taken by another key: the row is left out, the count check
            # finds it, and a rerun, with the stale row gone, copies it)
            sql += " ON CONFLICT DO NOTHING"
        return sql

    def key_of(self, row: tuple) -> tuple:
        """The primary key's values of a row as `select` returns it."""
        offset = 1 if self.arrival else 0
        return tuple(row[offset + self.columns.index(c)] for c in self.primary)


SPECS = [_Spec(t) for t in schema.TABLES if {"sqlite", "postgresql"} <= t.engines]
# (the fleet tables hold only live daemons' state: nothing to move)


def _row_digest(row: tuple) -> int:
    h = hashlib.blake2b(digest_size=16)
    for v in row:
        if isinstance(v, memoryview):
            v = bytes(v)
        if isinstance(v, bytes):
            h.update(b"b%d:" % len(v))
            h.update(v)
        elif isinstance(v, int):
            h.update(b"i%d;" % v)
        elif v is None:
            h.update(b"n;")
        else:
            text = str(v).encode()
            h.update(b"s%d:" % len(text))
            h.update(text)
    return int.from_bytes(h.digest())


def _count(db: Database, table: str) -> int:
    return int(db.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


def _copy(
    src: Database, dst: Database, progress: Progress | None
) -> tuple[dict[str, int], dict[str, int]]:
    """Every table from `src` into `dst`; the rows copied and each table's digest."""
    totals = {s.name: _count(src, s.name) for s in SPECS}
    total = sum(totals.values())
    done = 0
    copied: dict[str, int] = {}
    digests: dict[str, int] = {}
    if progress is not None:
        progress(0, total)
    if dst.engine == "sqlite":  # rows keep their copied numbers (see the triggers)
        _arrival_triggers(dst, on=False)
    for spec in SPECS:
        sql = spec.insert(dst)
        n, digest = 0, 0
        batch: list[tuple] = []
        for row in src.stream(spec.select(src), batch=BATCH):
            row = tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)
            digest = (digest + _row_digest(row)) % _MOD
            batch.append(row)
            n += 1
            if len(batch) >= BATCH:
                done = _write(dst, sql, batch, done, total, progress)
                batch = []
        if batch:
            done = _write(dst, sql, batch, done, total, progress)
        if _count(dst, spec.name) != n:
            _drop_extras(src, dst, spec)
        copied[spec.name], digests[spec.name] = n, digest
    if dst.engine == "sqlite":
        _arrival_triggers(dst, on=True)
    if dst.engine == "postgresql":  # new rows' seq continue after the copied ones
        dst.execute(
            "SELECT setval(pg_get_serial_sequence('blobs', 'seq'), "
            "(SELECT coalesce(max(seq), 0) + 1 FROM blobs), false)"
        ).fetchall()
    return copied, digests


def _arrival_triggers(dst: Database, on: bool) -> None:
    """sqlite's arrival triggers (alkfs/schema.py) off while rows are copied with their
    numbers (a copied `arrival_high` would renumber a copied row below it onto the next
    one's number), back on once they are in."""
    with dst.tx() as conn:
        if on:
            for statement in schema.ARRIVAL_TRIGGERS:
                conn.execute(statement)
        else:
            conn.execute("DROP TRIGGER IF EXISTS blobs_arrival_high")
            conn.execute("DROP TRIGGER IF EXISTS blobs_arrive_above")


def _write(
    dst: Database, sql: str, batch: list[tuple], done: int, total: int, progress: Progress | None
) -> int:
    """One batch in one transaction; the rows done so far."""
    with dst.tx() as conn:
        conn.executemany(sql, batch)
    done += len(batch)
    if progress is not None:
        progress(done, total)
    return done


def _drop_extras(src: Database, dst: Database, spec: _Spec) -> None:
    """Delete the rows of `dst` the source does not have (a resumed migration whose
    source changed in between: a swept object, a deleted ref)."""
    pk = ", ".join(spec.primary)
    one = "(" + ", ".join("?" for _ in spec.primary) + ")"
    keys = [tuple(r) for r in dst.stream(f"SELECT {pk} FROM {spec.name}", batch=BATCH)]
    gone: list[tuple] = []
    for start in range(0, len(keys), BATCH):
        part = keys[start : start + BATCH]
        values = ", ".join(one for _ in part)
        found = src.execute(
            f"SELECT {pk} FROM {spec.name} WHERE ({pk}) IN (VALUES {values})",
            [v for k in part for v in k],
        ).fetchall()
        have = {tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in found}
        gone += [k for k in part if k not in have]
    where = " AND ".join(f"{c} = ?" for c in spec.primary)
    for start in range(0, len(gone), BATCH):
        with dst.tx() as conn:
            conn.executemany(f"DELETE FROM {spec.name} WHERE {where}", gone[start : start + BATCH])


def _verify(dst: Database, copied: dict[str, int], digests: dict[str, int]) -> None:
    """The copy holds exactly the source's rows, and every kv value hashes to its key."""
    for spec in SPECS:
        n, digest = 0, 0
        for row in dst.stream(spec.select(dst), batch=BATCH):
            row = tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)
            digest = (digest + _row_digest(row)) % _MOD
            n += 1
            if spec.arrival:
                key, value = Key(row[1]), row[4]
                if Key.derive(key.algo, value) != key or len(value) != row[2]:
                    raise StoreIO(
                        f"migration not verified: {key} does not hash to its key in the copy"
                    )
        if n != copied[spec.name]:
            raise StoreIO(
                f"migration not verified: the copy's {spec.name} has {n} rows, "
                f"the source {copied[spec.name]}"
            )
        if digest != digests[spec.name]:
            raise StoreIO(f"migration not verified: the copy's {spec.name} rows differ")


def _meta(db: Database) -> dict[str, str]:
    try:
        return {name: value for name, value in db.execute("SELECT name, value FROM meta")}
    except Exception as exc:
        err = db.translate(exc)
        if err is not None:
            raise err from None
        return {}  # (no meta table: a database no alkfs store was ever kept in)


@contextlib.contextmanager
def _store_lock(root: Path) -> Iterator[None]:
    from .store import Store

    fd = Store._take_lock(root)
    try:
        yield
    finally:
        os.close(fd)


def _rename_sqlite(old: Path, new: Path) -> None:
    """The file and any -wal/-shm left beside it (so it stays readable under its name)."""
    for suffix in ("-wal", "-shm"):
        side = old.with_name(old.name + suffix)
        if side.exists():
            os.replace(side, new.with_name(new.name + suffix))
    os.replace(old, new)


def _close_sqlite(db: SqliteDatabase) -> None:
    """Checkpoint the WAL into the file and close it."""
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    db.close()


def to_postgresql(
    root: str | os.PathLike[str], uri: str, progress: Progress | None = None
) -> dict[str, object]:
    """Move the sqlite store at `root` into the PostgreSQL database `uri`."""
    from .db.postgres import PostgresDatabase

    root = Path(root)
    check(uri)
    if read_binding(root) is not None:
        raise Invalid(f"the store {root} is already kept in PostgreSQL ({root / 'database'})")
    if not (root / DB_NAME).is_file():
        raise Missing(f"no sqlite store at {root} ({root / DB_NAME} is missing)")
    started = time.monotonic()
    written_back = _undrain(root)
    with _store_lock(root):
        if _drained(root):  # (alkfs/git/packs/drain.py: undrain)
            raise Invalid(
                f"the store {root} keeps git objects in its packs alone: `alkfs migrate` "
                "writes them back first (run it again)"
            )
        src = SqliteDatabase(root / DB_NAME)
        try:
            meta = settle(src, root, None, None, _default_threshold())
            store_id = meta["store_id"]
            dst = PostgresDatabase(uri, lock=True)
            try:
                there = _meta(dst).get("store_id")
                if there is not None and there != store_id:
                    raise Invalid(
                        f"the database {redact(uri)} holds another store ({there}); "
                        "migrate into an empty database"
                    )
                dst.create(schema.statements(dst.engine))
                copied, digests = _copy(src, dst, progress)
                _verify(dst, copied, digests)
                write_binding(root, store_id, uri)
            finally:
                dst.close()
        except BaseException:
            src.close()
            raise
        _close_sqlite(src)
        old = root / (MIGRATED + datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ"))
        _rename_sqlite(root / DB_NAME, old)
        fsync_dir(root)
    return {
        "migrated": "sqlite -> postgresql",
        "store": str(root),
        "store_id": store_id,
        "rows": copied,
        "database": redact(uri),
        "sqlite_file": str(old),
        "written_back": written_back,
        "seconds": round(time.monotonic() - started, 3),
    }


def _drained(root: Path) -> bool:
    """Whether some git objects of the store are kept in its packs alone."""
    from .git.packs import DERIVED_DIR
    from .git.packs.drain import PRIMARY

    return any(root.glob(f"{DERIVED_DIR}/*/{PRIMARY}"))


def _undrain(root: Path, uri: str | None = None) -> int:
    """Before a move between engines: the git objects kept in packs alone are written
    back into the kv, as it was before drains (a sqlite store names its published sets
    in files, a fleet in its database: the other engine's store would find none; its
    daemons build and drain again: alkfs/git/packs/drain.py). How many."""
    from .app import Alkfs
    from .git import packs

    if not _drained(root):
        return 0
    written = 0
    with Alkfs.open(root, database=uri) as app:
        for fmt in packs.FORMATS:
            d = packs.derived_for(app.store, fmt)
            if d is not None and d.primary:
                written += d.undrain()
    return written


def to_sqlite(
    root: str | os.PathLike[str], uri: str, progress: Progress | None = None
) -> dict[str, object]:
    """Move the PostgreSQL store at `root` (its database `uri`) back into STORE/store.db;
    the PostgreSQL database is left as it was."""
    from .db.postgres import PostgresDatabase

    root = Path(root)
    check(uri)
    binding = read_binding(root)
    if binding is None:
        raise Invalid(f"the store {root} is not kept in PostgreSQL: nothing to move back")
    if (root / DB_NAME).exists():
        raise Invalid(f"{root / DB_NAME} exists: move it away before migrating back to sqlite")
    started = time.monotonic()
    written_back = _undrain(root, uri)
    with _store_lock(root):
        if _drained(root):
            raise Invalid(
                f"the store {root} keeps git objects in its packs alone: `alkfs migrate` "
                "writes them back first (run it again)"
            )
        src = PostgresDatabase(uri, lock=True)
        try:
            meta = _meta(src)
            if meta.get("store_id") != binding["store_id"]:
                raise Invalid(
                    f"the database {redact(uri)} does not hold the store {root} "
                    f"(store id {binding['store_id']}, in {binding['database']})"
                )
            if int(meta.get("schema_version", "1")) > schema.SCHEMA_VERSION:
                raise StoreIO(
                    f"the store has schema version {meta['schema_version']}, newer than this "
                    f"alkfs ({schema.SCHEMA_VERSION}): use a newer alkfs"
                )
            if int(meta.get("schema_version", "1")) < schema.SCHEMA_VERSION:
                # (an older store is brought up to date first, as an open would: its rows
                # are read with this version's columns)
                meta = settle(src, root, None, None, _default_threshold())
            partial = root / PARTIAL
            dst = SqliteDatabase(partial)
            try:
                there = _meta(dst).get("store_id")
                if there is not None and there != binding["store_id"]:
                    raise Invalid(f"{partial} holds another store ({there}): remove it")
                dst.create(schema.statements(dst.engine))
                copied, digests = _copy(src, dst, progress)
                _verify(dst, copied, digests)
                _close_sqlite(dst)
            except BaseException:
                dst.close()
                raise
        finally:
            src.close()
        _rename_sqlite(partial, root / DB_NAME)
        fsync_dir(root)
        remove_binding(root)
        fsync_dir(root)
    return {
        "migrated": "postgresql -> sqlite",
        "store": str(root),
        "store_id": binding["store_id"],
        "rows": copied,
        "database": str(root / DB_NAME),
        "postgresql": f"{redact(uri)} left as it was (drop it when no longer needed)",
        "written_back": written_back,
        "seconds": round(time.monotonic() - started, 3),
    }


def _default_threshold() -> int:
    from .store import DEFAULT_THRESHOLD

    return DEFAULT_THRESHOLD
