"""Every table of a store's database, column by column, for both engines.

One definition renders the DDL of the sqlite file and of a PostgreSQL database (a
`key`-typed column is `BLOB` / `bytea`, an `int` one `INTEGER` / `bigint`). Tables are
created at open when missing; `SCHEMA_VERSION` is recorded in `meta` and checked there:
a store written by a newer alkfs is refused, an older one is migrated by `MIGRATIONS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEMA_VERSION = 1
"""The version of the tables below. Version 1 is every store made before the version was
recorded (the tables are the same), so such a store only gets the row."""


@dataclass(frozen=True)
class Column:
    name: str
    type: str  # "key" (bytes), "int" (64-bit), "text"
    doc: str
    null: bool = False


@dataclass(frozen=True)
class Table:
    name: str
    doc: str
    columns: tuple[Column, ...]
    primary: tuple[str, ...]
    indexes: tuple[tuple[str, tuple[str, ...]], ...] = ()
    rowid: bool = True  # sqlite: a rowid table (False: WITHOUT ROWID)
    engines: frozenset[str] = field(default=frozenset({"sqlite", "postgresql"}))


_TYPES = {
    "sqlite": {"key": "BLOB", "int": "INTEGER", "text": "TEXT"},
    "postgresql": {"key": "bytea", "int": "bigint", "text": "text"},
}

META = Table(
    "meta",
    "The store's settings, fixed at creation, and its identity.",
    (
        Column("name", "text", "mode | threshold | schema_version | store_id"),
        Column("value", "text", "its value, as text", null=True),
    ),
    ("name",),
)

BLOBS = Table(
    "blobs",
    "The kv tier: small objects as rows. `size` sits before `value`, so metadata reads "
    "never touch the blob.",
    (
        Column("key", "key", "the algorithm byte followed by the digest"),
        Column("size", "int", "len(value)"),
        Column("stored_ns", "int", "written or last freshened (ns since the epoch)"),
        Column("value", "key", "the object's bytes (unverified: every read checks them)"),
    ),
    ("key",),
)

ARRIVALS = "seq"
"""PostgreSQL's blobs carry `seq`, the order rows arrived in (sqlite's rowid plays it):
derived packs build from what arrived since their last build."""

WINDOW = Table(
    "gc_window",
    "The delete window: staged candidates and when each becomes deletable.",
    (
        Column("key", "key", "the candidate"),
        Column("visible_after", "int", "deletable from this instant (ns); only moves later"),
        Column("staged_ns", "int", "the mark's start: a write after it cancels the delete"),
    ),
    ("key",),
    indexes=(("gc_window_visible", ("visible_after",)),),
    rowid=False,
)

CATALOG = Table(
    "catalog",
    "One row per large object: its recorded size and chunk digests (alkfs/catalog.py).",
    (
        Column("key", "key", "the object's key (as blobs.key)"),
        Column("size", "int", "its exact length, what stat shows and reads are checked by"),
        Column("stored_ns", "int", "the put's stamp, moved forward by a freshen"),
        Column("chunk_size", "int", "bytes per chunk (1 MiB)"),
        Column("chunk_algo", "int", "the algorithm byte of the chunk digests (2 = BLAKE3)"),
        Column("chunks", "key", "the chunks' digests, 32 bytes each, in chunk order"),
    ),
    ("key",),
)

REPOS = Table(
    "git_repos",
    "Repositories (their refs are the garbage collector's roots).",
    (
        Column("id", "text", "the repository's name: [A-Za-z0-9][A-Za-z0-9._-]{0,99}"),
        Column("object_format", "text", "sha1 | sha256"),
        Column("head", "text", "the symbolic HEAD's target, a ref name under refs/"),
        Column("created_ns", "int", "when it was made (a re-made repository differs)"),
    ),
    ("id",),
)

REFS = Table(
    "git_refs",
    "Refs: each names one object of the store, changed only by compare-and-swap.",
    (
        Column("repo", "text", "git_repos.id"),
        Column("name", "text", "the full ref name, refs/..."),
        Column("oid", "text", "lowercase hex object id"),
    ),
    ("repo", "name"),
    rowid=False,
)

PINS = Table(
    "pins",
    "Durable named pins (SPEC 3.5): each keeps one object (and a git object's closure).",
    (
        Column("name", "text", "the pin's name: [A-Za-z0-9][A-Za-z0-9._-]{0,127}"),
        Column("key", "key", "the object it keeps"),
        Column("created_ns", "int", "when it was set"),
    ),
    ("name",),
    indexes=(("pins_key", ("key",)),),
)

TABLES = (META, BLOBS, WINDOW, CATALOG, REPOS, REFS, PINS)

MIGRATIONS: dict[int, tuple[str, ...]] = {}
"""version -> statements that bring a store of the version before it up to it."""


def ddl(table: Table, engine: str) -> list[str]:
    """CREATE statements (IF NOT EXISTS) of one table for one engine."""
    types = _TYPES[engine]
    cols = [f"{c.name} {types[c.type]}{'' if c.null else ' NOT NULL'}" for c in table.columns]
    if table is BLOBS and engine == "postgresql":
        cols.append(f"{ARRIVALS} bigint GENERATED BY DEFAULT AS IDENTITY")
    cols.append(f"PRIMARY KEY ({', '.join(table.primary)})")
    tail = " WITHOUT ROWID" if engine == "sqlite" and not table.rowid else ""
    out = [f"CREATE TABLE IF NOT EXISTS {table.name} ({', '.join(cols)}){tail}"]
    for name, columns in table.indexes:
        out.append(f"CREATE INDEX IF NOT EXISTS {name} ON {table.name} ({', '.join(columns)})")
    if table is BLOBS and engine == "postgresql":
        out.append(f"CREATE INDEX IF NOT EXISTS blobs_{ARRIVALS} ON blobs ({ARRIVALS})")
    return out


def statements(engine: str) -> list[str]:
    """Every table's DDL for `engine`, in dependency order."""
    return [s for t in TABLES for s in ddl(t, engine)]
