"""Store benchmark: put/get throughput per tier and the sweep, against plain baselines.

Run from the repository with the project's venv:

    .venv/bin/python bench/store.py            # full sizes (1,000,000-object sweep)
    .venv/bin/python bench/store.py --quick    # smoke run (100,000-object sweep, fewer objects)
    .venv/bin/python bench/store.py --check    # exit 1 if a target fails

Only the standard library and the project are used. The plain sqlite baseline uses
the same sqlite build as the store (alkfs.db's module) with the same pragmas
(journal_mode=WAL, synchronous=NORMAL), one autocommit transaction per insert, as
the store's put does.

What is measured, per object size:

* put: the store's `put(bytes)` (hash, route, write, publish; the pin released)
  with unique content, so dedup never short-cuts a put. Baselines: a plain file
  write of the same bytes to a new file and a plain sqlite row insert. The large
  tier fsyncs every object (staging file fsync, link, directory fsync), so the
  16 MiB file baseline fsyncs too (write + fsync + close); the kv tier's commit
  does not fsync (WAL with synchronous=NORMAL), so the 1 KiB / 64 KiB file
  baseline does not either. The output says which.
* get: the store's verified `get(key)` against a plain read of the same bytes
  (open + read + close of the baseline file; sqlite SELECT by integer id). All
  data is in the page cache on both sides. For a large object the store remembers
  a file it has verified (same inode, size, mtime, ctime) and skips re-hashing it,
  so the first get (hashes 16 MiB) and repeated gets (no hash) are reported
  separately; the target compares the repeated get.

Puts and first gets are medians over several repetitions, each with fresh
objects; repeated gets are medians over interleaved rounds, each reading every
object stored so far once per implementation (rotating which goes first), which
keeps outside load from favouring one side. Ratios are ours / baseline
throughput (above 1 means the store is faster).

The sweep: a store's kv table is populated with N objects directly (one
executemany into the store's `blobs` table in a single transaction, with correct
keys `0x01 || sha256(payload)` and sizes, for small random payloads) rather than
through N puts, which would only measure puts. A liveness source holds 90% of the
keys; the first sweep must stage exactly the other 10% (asserted). The sweep runs
in a child process that does nothing else; its peak resident memory is the
child's VmHWM (the ru_maxrss high-water mark where /proc is missing; on Linux
ru_maxrss also carries the parent's peak over fork and exec) and includes the
interpreter and the liveness source's 0.9 N keys. The sweep is repeated 5 times,
the window emptied in between so that each is a first sweep, alternating with a
plain `SELECT key FROM blobs` scan of the same table iterated in Python (the
baseline, after one warm-up scan); the ratio is of the medians.

Targets: 16 MiB repeated verified get >= 0.7x a plain file read; the first
sweep (mark + stage) <= 4x the plain scan, with peak memory under 1 GiB.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import common

from alkfs.db import now_ns, sqlite3
from alkfs.keys import Key
from alkfs.store import DEFAULT_THRESHOLD, Store

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

GET_TARGET = 0.7
SWEEP_TARGET = 4.0
PG_SWEEP_TARGET = 3.0
PG_GET_TARGET = 0.8
PG_TWIN = {"pg-dual": "dual-tier", "pg-kvonly": "kv-only"}  # each PostgreSQL store's sqlite twin
MEMORY_TARGET = 1 * GiB

_serial = itertools.count(1)
T = TypeVar("T")


# -- content -------------------------------------------------------------------------
def payloads(size: int, n: int) -> list[bytes]:
    """`n` distinct objects of `size` bytes: one random body, a unique 16-byte prefix each."""
    body = os.urandom(max(size - 16, 0))
    out = []
    for _ in range(n):
        prefix = struct.pack(">QQ", os.getpid(), next(_serial))
        out.append((prefix + body)[:size])
    return out


def human(n: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if n >= scale:
            return f"{n / scale:7.1f} {unit}"
    return f"{n:7.1f} B/s"


def label(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def timed(fn: Callable[..., T], *args: object) -> tuple[float, T]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


# -- baselines -------------------------------------------------------------------------
class PlainFiles:
    """One file per object: write (+ fsync when the tier under test fsyncs), read back."""

    def __init__(self, root: Path, fsync: bool) -> None:
        self.root = root
        self.fsync = fsync
        root.mkdir(parents=True, exist_ok=True)

    def write_all(self, objs: list[bytes]) -> list[Path]:
        paths = []
        for data in objs:
            path = self.root / str(next(_serial))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if self.fsync:
                os.fsync(fd)
            os.close(fd)
            paths.append(path)
        return paths

    @staticmethod
    def read_all(paths: list[Path]) -> None:
        for path in paths:
            with open(path, "rb") as f:
                f.read()


class PlainSqlite:
    """A table of (integer id, blob) rows with the store's pragmas; one transaction a row."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None)
        assert self.conn.execute("PRAGMA journal_mode = WAL").fetchone()[0] == "wal"
        self.conn.execute("PRAGMA synchronous = NORMAL")
        self.conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, value BLOB NOT NULL)")

    def insert_all(self, objs: list[bytes]) -> list[int]:
        ids = []
        ex = self.conn.execute
        for data in objs:
            ids.append(ex("INSERT INTO t (value) VALUES (?)", (data,)).lastrowid)
        return ids

    def select_all(self, ids: list[int]) -> None:
        ex = self.conn.execute
        for i in ids:
            row = ex("SELECT value FROM t WHERE id = ?", (i,)).fetchone()
            assert row is not None

    def close(self) -> None:
        self.conn.close()


# -- put / get -------------------------------------------------------------------------
def store_put_all(store: Store, objs: list[bytes]) -> list:
    keys = []
    for data in objs:
        result = store.put(data)
        result.pin.release()
        assert result.created, "dedup hit: content was not unique"
        keys.append(result.key)
    return keys


def store_get_all(store: Store, keys: list) -> None:
    for key in keys:
        assert store.get(key) is not None


def bench_size(
    work: Path, size: int, n: int, reps: int, stores: dict[str, Store], large: bool, rounds: int
) -> dict[str, list[float]]:
    """Per-rep throughputs (bytes/s) for every (operation, implementation) at one size."""
    res: dict[str, list[float]] = {}
    files = PlainFiles(work / f"plain-{size}", fsync=large)
    plain = None if large else PlainSqlite(work / f"plain-{size}.db")

    def add(name: str, objects: int, fn: Callable[..., T], *args: object) -> T:
        seconds, out = timed(fn, *args)
        res.setdefault(name, []).append(size * objects / seconds)
        return out

    # Puts and first reads: fresh objects every repetition.
    reads: dict[str, tuple[Callable[..., None], object, list]] = {}
    for _ in range(reps):
        for name, store in stores.items():
            keys = add(f"put {name}", n, store_put_all, store, payloads(size, n))
            add(f"get-first {name}", n, store_get_all, store, keys)
            reads.setdefault(name, (store_get_all, store, []))[2].extend(keys)
        objs = payloads(size, n)
        paths = add("put file", n, files.write_all, objs)
        add("get-first file", n, files.read_all, paths)
        reads.setdefault("file", (PlainFiles.read_all, None, []))[2].extend(paths)
        if plain is not None:
            ids = add("put sqlite", n, plain.insert_all, objs)
            add("get-first sqlite", n, plain.select_all, ids)
            reads.setdefault("sqlite", (plain.select_all, None, []))[2].extend(ids)
        del objs
    # Repeated reads of everything stored above: rounds that read every object once
    # per implementation, in rotating order, so that outside load hits all alike.
    names = list(reads)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, store, items = reads[name]
            args = (items,) if store is None else (store, items)
            add(f"get {name}", len(items), fn, *args)
    if plain is not None:
        plain.close()
    return res


def print_size(size: int, n: int, res: dict[str, list[float]], large: bool) -> float | None:
    """Print one size's table; returns the repeated-get ratio of the large tier."""
    med = {k: statistics.median(v) for k, v in res.items()}
    fs = "write+fsync+close" if large else "write+close, no fsync (like the kv commit)"
    tier = "large tier, files" if large else "kv tier, sqlite"
    print(f"\n== {label(size)} objects ({tier}), {n} a repetition")
    print(f"   baseline file put: {fs}; file get: open+read+close (1st read, then repeated)")
    if not large:
        print("   baseline sqlite: INSERT autocommit / SELECT by id, WAL + synchronous=NORMAL")
    bases = ["file"] if large else ["file", "sqlite"]
    ratio_repeat = None
    for op in ("put", "get-first", "get"):
        for impl in [k.split(" ", 1)[1] for k in med if k.split(" ", 1)[0] == op]:
            if impl in bases:
                continue
            ours = med[f"{op} {impl}"]
            what = {
                "put": "put",
                "get-first": "get, 1st after put"
                + (" (hashes 16 MiB)" if large else " (verified)"),
                "get": "get, repeated" + (" (remembered: no re-hash)" if large else " (verified)"),
            }[op]
            parts = []
            for b in bases:
                r = ours / med[f"{op} {b}"]
                parts.append(f"{r:5.2f}x {b} ({human(med[f'{op} {b}']).strip()})")
                if large and op == "get" and b == "file" and impl == "dual-tier":
                    ratio_repeat = r
            twin = PG_TWIN.get(impl)
            if twin is not None and f"{op} {twin}" in med:
                parts.insert(0, f"{ours / med[f'{op} {twin}']:5.2f}x sqlite {twin}")
            print(f"   {what:<43} {impl:<10} {human(ours)}   ratio: " + ", ".join(parts))
    return ratio_repeat


# -- the sweep -------------------------------------------------------------------------
def sweep_rows(n: int) -> list[tuple[bytes, bytes]]:
    """N (key, payload) kv rows: keys 0x01 || sha256(24-byte payload)."""
    noise = os.urandom(16 * n)
    sha = hashlib.sha256
    rows = []
    for i in range(n):
        payload = i.to_bytes(8, "big") + noise[16 * i : 16 * i + 16]
        rows.append((b"\x01" + sha(payload).digest(), payload))
    return rows


def populate(root: Path, n: int, database: str | None = None) -> float:
    """N kv objects put straight into the store's blobs table: sqlite, one executemany in
    one transaction; PostgreSQL, the kv tier's insert_many in batches of 100,000."""
    t0 = time.perf_counter()
    store = Store.open(root, mode="dual-tier", database=database)
    try:
        stamp = now_ns()
        rows = sweep_rows(n)
        if database is None:
            with store.db.tx() as conn:
                conn.executemany(
                    "INSERT INTO blobs (key, size, stored_ns, value) VALUES (?, ?, ?, ?)",
                    [(k, len(v), stamp, v) for k, v in rows],
                )
        else:
            for i in range(0, n, 100_000):
                part = rows[i : i + 100_000]
                made = store.kv.insert_many([k for k, _ in part], [v for _, v in part], stamp)
                assert all(made)
            store.db.execute("VACUUM ANALYZE blobs")  # hint bits, visibility map, statistics
        del rows
        assert store.kv.rows() == n
    finally:
        store.close()
    return time.perf_counter() - t0


class SetSource:
    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def live_keys(self) -> set[bytes]:
        return self.keys

    def contains(self, key: bytes) -> bool:
        return key in self.keys


def plain_scan(db: Path | str) -> tuple[float, float, int]:
    """The baseline: `SELECT key FROM blobs` on a plain connection, iterated in Python.
    `db` is the sqlite file, or a PostgreSQL URI: then one psycopg connection and a
    server-side cursor fetched 8192 rows at a time (as the store's stream does).

    Returns (wall seconds, CPU seconds of this process, rows)."""
    if isinstance(db, str):
        import psycopg

        conn = psycopg.connect(db)
        t0, c0 = time.perf_counter(), time.process_time()
        n = 0
        with conn.transaction(), conn.cursor(name="plain_scan") as cur:
            cur.itersize = 8192
            cur.execute("SELECT key FROM blobs")
            while rows := cur.fetchmany(8192):
                for (_k,) in rows:
                    n += 1
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        conn.close()
        return dt, dc, n
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for (_k,) in conn.execute("SELECT key FROM blobs"):
        n += 1
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    conn.close()
    return dt, dc, n


def maxrss() -> int:
    """This process's peak resident set size in bytes.

    VmHWM of /proc/self/status where there is one: unlike ru_maxrss, which Linux
    carries over from the parent through fork and exec, it counts only this
    process's own memory since exec.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * KiB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB  # Linux: KiB


def empty_window(store: Store) -> None:
    """Back to the state of a first sweep: an empty window (and an empty sqlite WAL, or a
    vacuumed PostgreSQL window table)."""
    with store.db.tx() as conn:
        conn.execute("DELETE FROM gc_window")
    if store.db.engine == "sqlite":
        store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    else:
        store.db.execute("VACUUM gc_window")


def sweep_child(root: Path, n: int, reps: int, database: str | None = None) -> None:
    """In a fresh process: first sweeps over `root` (timed, peak memory) between plain scans,
    then the execute phase.

    Between repetitions the window is emptied (DELETE FROM gc_window, then a WAL
    checkpoint), so every timed sweep is a first sweep staging the same 10%. Scans and sweeps alternate
    so that load from elsewhere on the machine hits both sides alike.

    The execute phase, after them: the window emptied, a sweep with window 0 stages the
    10% dead as deletable at once; the next sweep (window 0) deletes them all (timed), and
    one more sweep (nothing to execute, nothing dead) times the mark scan alone, which
    is subtracted to give the execute time.
    """
    db: Path | str = root / "store.db" if database is None else database
    plain_scan(db)  # warm-up: both sides start with the table in the page cache
    store = Store.open(root, database=database)
    live: set[bytes] = set()
    for i, (k,) in enumerate(store.db.stream("SELECT key FROM blobs ORDER BY key")):
        if i % 10:
            live.add(bytes(k))  # every tenth key in key order is dead: exactly n // 10
    dead = n - len(live)
    store.register_source(SetSource(live))
    rss0 = maxrss()
    sweeps, scans, reports, sweeps_cpu, scans_cpu = [], [], [], [], []
    for rep in range(reps):
        dt, dc, rows = plain_scan(db)
        assert rows == n
        scans.append(dt)
        scans_cpu.append(dc)
        if rep:  # back to the state of the first sweep: an empty window, an empty WAL
            empty_window(store)
        t0, c0 = time.perf_counter(), time.process_time()
        report = store.sweep()
        sweeps.append(time.perf_counter() - t0)
        sweeps_cpu.append(time.process_time() - c0)
        assert report.aborted is None, report
        assert report.candidates_staged == dead, report
        assert report.scanned == n and report.live == n - dead, report
        reports.append(report.to_dict())
    rss1 = maxrss()
    dt, dc, rows = plain_scan(db)
    scans.append(dt)
    scans_cpu.append(dc)
    # The execute phase.
    empty_window(store)
    staging = store.sweep(window_s=0)
    assert staging.aborted is None and staging.candidates_staged == dead, staging
    t0 = time.perf_counter()
    executing = store.sweep(window_s=0)
    exec_sweep = time.perf_counter() - t0
    assert executing.aborted is None and executing.deleted == dead, executing
    assert executing.candidates_staged == 0, executing
    t0 = time.perf_counter()
    marking = store.sweep(window_s=0)
    mark_only = time.perf_counter() - t0
    assert marking.aborted is None and marking.deleted == 0 and marking.scanned == n - dead
    assert store.kv.rows() == n - dead
    store.close()
    out = {"sweeps": sweeps, "scans": scans, "reports": reports}
    out.update(sweeps_cpu=sweeps_cpu, scans_cpu=scans_cpu)
    out.update(rss_before=rss0, rss_peak=rss1)
    out.update(deleted=executing.deleted, exec_sweep=exec_sweep, mark_only=mark_only)
    print(json.dumps(out))


def bench_sweep(work: Path, n: int, reps: int, database: str | None = None) -> dict:
    """The sweep section on one engine; returns the child's figures plus `ratio` (median
    sweep / median scan), `peak` (peak RSS of the child) and `exec_rate` (deletes/s)."""
    engine = "sqlite" if database is None else "PostgreSQL"
    root = work / ("sweep-store" if database is None else "sweep-store-pg")
    how = (
        "one executemany into the store's blobs table"
        if database is None
        else "the kv tier's insert_many, batches of 100,000 (then VACUUM ANALYZE blobs)"
    )
    print(f"\n== sweep over {n:,} kv objects, 10% dead ({engine})")
    print(
        f"   populated by {how} (keys = 0x01||sha256(24-byte payload)): "
        f"{populate(root, n, database):.1f} s"
    )
    argv = [sys.executable, os.path.abspath(__file__), "--sweep-child", str(root), str(n)]
    argv += [str(reps), database or ""]
    out = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    rep = r["reports"][0]
    sweep_s = statistics.median(r["sweeps"])
    scan_s = statistics.median(r["scans"])
    ratio = sweep_s / scan_s
    peak = r["rss_peak"]
    target = SWEEP_TARGET if database is None else PG_SWEEP_TARGET
    fmt = ", ".join(f"{x:.3f}" for x in r["sweeps"])
    print(
        f"   first sweep (mark + stage; nothing due to execute), window emptied between "
        f"repetitions: median {sweep_s:.3f} s of [{fmt}]"
    )
    print(
        f"   each staged {rep['candidates_staged']:,} (== {n // 10:,}, asserted), "
        f"live {rep['live']:,}, scanned {rep['scanned']:,}"
    )
    fmt = ", ".join(f"{x:.3f}" for x in r["scans"])
    cursor = "" if database is None else " (psycopg, server-side cursor, 8192 a fetch)"
    print(f"   plain `SELECT key FROM blobs` scan{cursor}: median {scan_s:.3f} s of [{fmt}]")
    print(f"   ratio sweep / scan: {ratio:.2f}x (lower is better; target <= {target}x)")
    cpu = statistics.median(r["sweeps_cpu"]) / statistics.median(r["scans_cpu"])
    print(f"   the same in CPU time of the process (less sensitive to other load): {cpu:.2f}x")
    print(
        f"   peak RSS of the sweep's child process (VmHWM): {peak / MiB:.0f} MiB "
        f"(before sweeping, interpreter + {n - n // 10:,}-key liveness set: "
        f"{r['rss_before'] / MiB:.0f} MiB; the sweeps added {(peak - r['rss_before']) / MiB:.0f} MiB)"
    )
    execute = r["exec_sweep"] - r["mark_only"]
    rate = r["deleted"] / execute
    print(
        f"   execute phase (staged with window 0, then a sweep): {r['deleted']:,} deleted; "
        f"that sweep {r['exec_sweep']:.3f} s - a mark-only sweep of the {n - r['deleted']:,} "
        f"left {r['mark_only']:.3f} s = {execute:.3f} s: {rate:,.0f} deletes/s"
    )
    r.update(ratio=ratio, peak=peak, exec_rate=rate)
    return r


def bench_pg_gets(uri: str, root: Path, n: int, chunk: int = 250) -> tuple[float, float, float]:
    """1 KiB gets of keys not read before: the store (verified `get`, through its pool)
    against a bare psycopg `SELECT value FROM blobs WHERE key = %s` on one plain
    connection, same database. Each key is read once, by one side; chunks alternate
    sides (rotating which goes first). Returns (store gets/s, unverified kv reads/s,
    bare gets/s)."""
    import random

    import psycopg

    store = Store.open(root, mode="kv-only", database=uri)
    try:
        objs = payloads(KiB, 3 * n)
        keys = [b"\x01" + hashlib.sha256(o).digest() for o in objs]
        for i in range(0, len(keys), 10_000):
            store.kv.insert_many(keys[i : i + 10_000], objs[i : i + 10_000], now_ns())
        del objs
        store.db.execute("VACUUM ANALYZE blobs")
        random.shuffle(keys)
        ours, unverified, bare = keys[:n], keys[n : 2 * n], keys[2 * n :]
        conn = psycopg.connect(uri, autocommit=True)
        sql = "SELECT value FROM blobs WHERE key = %s"

        def store_gets(part: list[bytes]) -> None:
            for raw in part:
                assert store.get(Key(raw)) is not None

        def kv_reads(part: list[bytes]) -> None:
            for raw in part:
                assert store.kv.read(raw) is not None

        def bare_gets(part: list[bytes]) -> None:
            ex = conn.execute
            for raw in part:
                assert ex(sql, (raw,)).fetchone() is not None

        sides = [(store_gets, ours), (kv_reads, unverified), (bare_gets, bare)]
        spent = [0.0, 0.0, 0.0]
        for j, i in enumerate(range(0, n, chunk)):
            order = [(j + s) % 3 for s in range(3)]
            for s in order:
                fn, items = sides[s]
                spent[s] += timed(fn, items[i : i + chunk])[0]
        conn.close()
    finally:
        store.close()
    return n / spent[0], n / spent[1], n / spent[2]


# -- main -------------------------------------------------------------------------------
def start_pg(work: Path, wanted: bool):
    """The benchmark's PostgreSQL server (durable settings), or None with a message."""
    if not wanted:
        print("PostgreSQL column: skipped (--no-pg)")
        return None
    try:
        import psycopg
        import psycopg_pool  # noqa: F401
        from durable_pg import DurablePg, PgNotInstalled
    except ImportError as e:
        print(f"PostgreSQL column: skipped (no psycopg / psycopg_pool: {e})")
        return None
    try:
        server = DurablePg(work.parent)
    except PgNotInstalled as e:
        print(f"PostgreSQL column: skipped ({e})")
        return None
    try:
        server.start()
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        server.cleanup()
        print(f"PostgreSQL column: skipped (the server did not start: {e})")
        return None
    s = server.settings()
    print(
        f"PostgreSQL column: server {s['server_version']} on a unix socket, cluster on disk "
        f"in {server.base} (not tmpfs), durable: fsync={s['fsync']}, "
        f"synchronous_commit={s['synchronous_commit']}, full_page_writes={s['full_page_writes']}"
        f", wal_sync_method={s['wal_sync_method']}, shared_buffers={s['shared_buffers']} "
        "(defaults); psycopg "
        f"{psycopg.__version__} ({psycopg.pq.__impl__}); pg-* stores are the sqlite ones' "
        "twins with `database=` a PostgreSQL URI; ratios `x sqlite <twin>` are pg / sqlite"
    )
    return server


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for smoke runs")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target fails")
    ap.add_argument("--dir", help="work directory (default: a fresh temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--no-pg", action="store_true", help="skip the PostgreSQL column")
    ap.add_argument(
        "--only-sweep", action="store_true", help="only the sweep sections (no puts/gets)"
    )
    ap.add_argument("--sweep-n", type=int, help="objects in the sweep (default 1M, quick 100k)")
    ap.add_argument("--sweep-child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sweep_child:
        root, n, reps, database = args.sweep_child
        sweep_child(Path(root), int(n), int(reps), database or None)
        return 0

    quick = args.quick
    reps = 3 if quick else 5
    rounds = 9
    counts = {
        KiB: 500 if quick else 2000,
        64 * KiB: 100 if quick else 400,
        16 * MiB: 4 if quick else 8,
    }
    gets_n = 5000 if quick else 20000
    sweep_n = args.sweep_n or (100_000 if quick else 1_000_000)
    work = Path(args.dir or tempfile.mkdtemp(prefix="alkfs-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"alkfs store benchmark ({'quick' if quick else 'full'}): python {sys.version.split()[0]}, "
        f"sqlite {sqlite3.sqlite_version}, {os.cpu_count()} cpus, work dir {work}"
    )
    print(
        f"puts and first gets: medians of {reps} repetitions, fresh unique content each "
        f"(no dedup); repeated gets: medians of {rounds} interleaved rounds reading every "
        f"stored object; ratio = ours / baseline throughput (higher is better); "
        f"dual-tier threshold {DEFAULT_THRESHOLD}"
    )
    results: list[dict] = []  # common.figure()s
    pg = None
    try:
        pg = start_pg(work, not args.no_pg)
        if not args.only_sweep:
            dual = Store.open(work / "dual", mode="dual-tier")
            kvonly = Store.open(work / "kvonly", mode="kv-only")
            pg_stores: dict[str, Store] = {}
            try:
                if pg is not None:
                    pg_stores["pg-dual"] = Store.open(
                        work / "pgdual", mode="dual-tier", database=pg.create_database("dual")
                    )
                    pg_stores["pg-kvonly"] = Store.open(
                        work / "pgkvonly", mode="kv-only", database=pg.create_database("kvonly")
                    )
                for size in (KiB, 64 * KiB):
                    stores = {"dual-tier": dual, "kv-only": kvonly, **pg_stores}
                    res = bench_size(work, size, counts[size], reps, stores, False, rounds)
                    print_size(size, counts[size], res, False)
                size = 16 * MiB
                stores = {"dual-tier": dual}
                if pg is not None:
                    stores["pg-dual"] = pg_stores["pg-dual"]
                res = bench_size(work, size, counts[size], reps, stores, True, rounds)
                ratio = print_size(size, counts[size], res, True)
            finally:
                dual.close()
                kvonly.close()
                for s in pg_stores.values():
                    s.close()
            assert ratio is not None
            results.append(
                common.figure(
                    "16 MiB repeated verified get",
                    baseline="a plain file read, throughput",
                    ratio=ratio,
                    target=f">= {GET_TARGET}x",
                    passed=ratio >= GET_TARGET,
                )
            )
        sq = bench_sweep(work, sweep_n, 5)
        results.append(
            common.figure(
                f"sweep mark+stage of {sweep_n:,} kv objects (sqlite)",
                baseline="a plain key scan, time",
                ratio=sq["ratio"],
                target=f"<= {SWEEP_TARGET}x",
                passed=sq["ratio"] <= SWEEP_TARGET,
            )
        )
        results.append(
            common.figure(
                "sweep peak memory (sqlite)",
                sq["peak"] / MiB,
                "MiB",
                target="< 1 GiB",
                passed=sq["peak"] < MEMORY_TARGET,
            )
        )
        if pg is not None:
            r = bench_sweep(work, sweep_n, 5, pg.create_database("sweep"))
            print(
                f"   execute rate vs the sqlite column: {r['exec_rate'] / sq['exec_rate']:.3f}x "
                f"({r['exec_rate']:,.0f} vs {sq['exec_rate']:,.0f} deletes/s; up to 512 "
                "deletes a transaction, a durable commit on PostgreSQL, a WAL commit without "
                "fsync (synchronous=NORMAL) on sqlite; PostgreSQL's also checks the fleet's "
                "pin rows and logs what it deleted)"
            )
            results.append(
                common.figure(
                    f"sweep mark+stage of {sweep_n:,} kv objects (PostgreSQL)",
                    baseline="a plain psycopg key scan, time",
                    ratio=r["ratio"],
                    target=f"<= {PG_SWEEP_TARGET}x",
                    passed=r["ratio"] <= PG_SWEEP_TARGET,
                    note=f"execute {r['exec_rate']:,.0f} deletions/s (sqlite {sq['exec_rate']:,.0f})",
                )
            )
            results.append(
                common.figure(
                    "sweep peak memory (PostgreSQL)",
                    r["peak"] / MiB,
                    "MiB",
                    target="< 1 GiB",
                    passed=r["peak"] < MEMORY_TARGET,
                )
            )
            if not args.only_sweep:
                print(f"\n== 1 KiB gets of keys not read before, PostgreSQL, {gets_n:,} a side")
                ours, kv, bare = bench_pg_gets(pg.create_database("gets"), work / "pggets", gets_n)
                print(
                    "   (a kv-only store over a table of 3x that many rows; each key read once; "
                    "chunks of 250 alternate the sides)"
                )
                print(f"   store get (verified, via the pool):      {ours:9,.0f} gets/s")
                print(f"   store kv.read (unverified, via the pool): {kv:9,.0f} gets/s")
                print(f"   bare psycopg SELECT, one connection:      {bare:9,.0f} gets/s")
                print(
                    f"   ratio store / bare: {ours / bare:.2f}x (target >= {PG_GET_TARGET}x); "
                    f"unverified read / bare: {kv / bare:.2f}x"
                )
                results.append(
                    common.figure(
                        "PostgreSQL 1 KiB gets of keys not read before",
                        ours,
                        "gets/s",
                        baseline="a bare psycopg SELECT, one connection",
                        baseline_value=bare,
                        ratio=ours / bare,
                        target=f">= {PG_GET_TARGET}x",
                        passed=ours / bare >= PG_GET_TARGET,
                    )
                )
    finally:
        if pg is not None:
            pg.cleanup()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("\n== targets")
    for f in results:
        got = f"{f['ratio']:.2f}x" if "ratio" in f else f"{f['value']:.0f} {f['unit']}"
        print(f"   {'PASS' if f['pass'] else 'FAIL'}  {f['name']} {f['target']}: {got}")
    common.record(results, quick=args.quick)
    failed = [f["name"] for f in results if not f["pass"]]
    if args.check and failed:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
