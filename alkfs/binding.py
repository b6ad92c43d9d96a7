"""Which database a store directory is kept in, and the identity that ties the two.

A store's database is its sqlite file (`STORE/store.db`) unless it was made with, or
moved to, a PostgreSQL database (`--database URI`). Both sides record the store's
identity: the database in `meta.store_id`, the directory in `STORE/database` (a small
JSON file naming the engine, the id and the URI without its password). Opening checks
they agree, because the large tier lives in the directory whatever the database: a
fresh sqlite database over a PostgreSQL store's large tier would see every large
object as unreferenced and sweep it away.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from .db import Database
from .db.sqlite import SqliteDatabase
from .db.uri import check, redact
from .errors import Invalid, StoreIO
from .schema import MIGRATIONS, SCHEMA_VERSION, statements
from .tiers.local import fsync_dir

BINDING_NAME = "database"
DB_NAME = "store.db"


def read_binding(root: Path) -> dict[str, str] | None:
    """STORE/database, or None for a store kept in its sqlite file."""
    try:
        text = (root / BINDING_NAME).read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreIO(f"cannot read {root / BINDING_NAME}: {exc.strerror}") from None
    try:
        data = json.loads(text)
        if data["engine"] != "postgresql" or not isinstance(data["store_id"], str):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise StoreIO(f"{root / BINDING_NAME} is damaged (not the binding alkfs writes)") from None
    return data


def write_binding(root: Path, store_id: str, uri: str) -> None:
    """Record (durably: write, fsync, rename, fsync the directory) that the store is kept
    in the PostgreSQL database `uri` (stored without its password)."""
    body = json.dumps({"engine": "postgresql", "store_id": store_id, "database": redact(uri)})
    tmp = root / f".{BINDING_NAME}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, body.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, root / BINDING_NAME)
    fsync_dir(root)


def remove_binding(root: Path) -> None:
    (root / BINDING_NAME).unlink(missing_ok=True)


def open_database(root: Path, database: str | None, *, lock: bool | str) -> Database:
    """The database of the store at `root`, checked against the directory's binding."""
    binding = read_binding(root)
    if database is None:
        if binding is not None:
            raise Invalid(
                f"the store {root} is kept in the PostgreSQL database {binding['database']}: "
                "start it with --database URI"
            )
        return SqliteDatabase(root / DB_NAME)
    check(database)
    if binding is None and (root / DB_NAME).exists():
        raise Invalid(
            f"the store {root} is kept in its sqlite file {root / DB_NAME}; to move it to "
            f"PostgreSQL: alkfs --store {root} migrate --database URI"
        )
    from .db.postgres import PostgresDatabase  # (psycopg only for PostgreSQL stores)

    return PostgresDatabase(database, lock=lock)


def settle(
    db: Database, root: Path | None, mode: str | None, threshold: int | None, default_threshold: int
) -> dict[str, str]:
    """Create the tables if missing, check the schema version and the identity, and
    return the store's settings (`meta`): made at the first open, fixed after."""
    db.create(statements(db.engine))
    with db.tx() as conn:
        rows = {name: value for name, value in conn.execute("SELECT name, value FROM meta")}
        fresh = "mode" not in rows
        if fresh:
            rows = {
                "mode": mode or "dual-tier",
                "threshold": str(threshold or default_threshold),
            }
            if rows["mode"] not in ("dual-tier", "kv-only"):
                raise Invalid(f"unknown mode {rows['mode']!r}")
        # (a new store's tables were made just now, at SCHEMA_VERSION: nothing to migrate)
        version = SCHEMA_VERSION if fresh else int(rows.get("schema_version", "1"))
        if version > SCHEMA_VERSION:
            raise StoreIO(
                f"the store {db.describe()} has schema version {version}, newer than this "
                f"alkfs ({SCHEMA_VERSION}): use a newer alkfs"
            )
        for v in range(version + 1, SCHEMA_VERSION + 1):
            for sql in MIGRATIONS.get(v, ()):
                conn.execute(sql)
        new = {"schema_version": str(SCHEMA_VERSION)}
        if "store_id" not in rows:
            new["store_id"] = _identity(db, root)
        if fresh:
            new.update(rows)
        for name, value in new.items():
            conn.execute(
                "INSERT INTO meta (name, value) VALUES (?, ?) "
                "ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                (name, value),
            )
        rows.update(new)
        if db.engine == "postgresql":
            # (before the commit: a crash between leaves a binding and an empty database,
            # which the next open adopts while the large tier holds nothing)
            assert root is not None
            _check_identity(db, root, rows["store_id"], made="store_id" in new)
    return rows


def _identity(db: Database, root: Path | None) -> str:
    """The id a database without one takes: a new one; for a PostgreSQL store, the
    directory's when its binding names this database and its large tier is empty (a
    crash after the binding was written), refused otherwise (another database than
    the one the store was made in)."""
    if db.engine == "postgresql" and root is not None:
        binding = read_binding(root)
        if binding is not None:
            if binding["database"] == db.describe() and _only_fresh_files(root):
                return binding["store_id"]
            raise Invalid(
                f"the store {root} was made in the database {binding['database']} "
                f"(store id {binding['store_id']}), and {db.describe()} does not hold it"
            )
    return str(uuid.uuid4())


def _check_identity(db: Database, root: Path, store_id: str, made: bool) -> None:
    binding = read_binding(root)
    if binding is None:
        if not made:
            raise Invalid(
                f"the database {db.describe()} holds the store {store_id}, and {root} is "
                "not its directory"
            )
        write_binding(root, store_id, getattr(db, "uri", db.describe()))
        return
    if binding["store_id"] != store_id:
        raise Invalid(
            f"the database {db.describe()} holds the store {store_id}, and {root} belongs "
            f"to the store {binding['store_id']} (in {binding['database']})"
        )


def _only_fresh_files(root: Path) -> bool:
    """Whether the store's large tier holds no object."""
    large = root / "large"
    for top, dirs, files in os.walk(large):
        if Path(top) == large:
            dirs[:] = [d for d in dirs if d != ".staging"]
        if files:
            return False
    return True
