"""Load benchmark: N client processes reading and writing 4 KiB objects through the mount
while a sweep runs every second, against the same processes on plain files.

Run as root from the repository with the project's venv (needs /dev/fuse):

    .venv/bin/python bench/load.py                 # 16 clients, 60 s on alkfs (+ 60 s plain)
    .venv/bin/python bench/load.py --quick         # 8 clients, 10 s
    .venv/bin/python bench/load.py --clients 4 --duration 5 --objects 500

The store (`--window 0`) is populated through the library before the daemon starts: the
read set (`--objects` random 4 KiB sha256 objects, each pinned as `r-<i>`) and as many
unpinned ones for the first sweeps to delete; a plain directory gets the same files at
the same paths (`objects/sha256/<hex>`). The clients are separate processes (this script
with `client`): a quarter of them (at least one) write, the others read. A reader opens,
reads and closes a random object of the read set and checks its bytes against its name; a
writer alternately writes a new 4 KiB file into `pins/<name>` (stored and pinned at
close) and into `objects/sha256/` (stored, pinned by nothing: the sweeps delete it two
sweeps later). The run is cut into slices (`--slice`, 5 s) taken in turns by alkfs and the
plain directory, all clients on the same side at once, so a changing machine load falls on
both; during the alkfs slices this process writes `sweep` into `.alkfs/control` every
second (window 0: an orphan is staged by one sweep and deleted by the next; a sweep
keeps a candidate when a pin changed since it computed what is live, which under steady
pinning is most of them: "kept by arbitration").

Printed: p50/p99 latency of a 4 KiB read (open, read, close) and of a write, read and
write throughput (ops/s over all clients), each alkfs against plain as a ratio (plain
time / alkfs time: above 1 means alkfs is faster); the sweeps (count, p50 duration,
objects deleted); every errno any client met, per side and operation. None is expected:
the readers read only pinned objects, the writers write new names. Afterwards every pin
must read byte-identical, the store must hold exactly the pinned objects after two more
sweeps, and `verify` (control file, then `alkfs verify --store` once the daemon is
stopped) must find nothing corrupt; any failure exits 1. The report is written to
bench/out/load.json (load-quick.json).

tests/reliability/test_load.py runs the same clients (`client`, alkfs only) and checks.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SIZE = 4096
SWEEP_EVERY_S = 1.0


# -- the client (a process of its own) ----------------------------------------------------------


def errname(code: int | None) -> str:
    return errno.errorcode.get(code or 0, str(code))


def client(config: dict[str, Any]) -> dict[str, Any]:
    """Run one client on the schedule in `config`; its counts, errnos and pins.

    config: roots (side -> directory), order (the sides in turn), ready (a file this
    client makes once it is set up), go (a file holding the start, CLOCK_MONOTONIC, which
    every process shares: it appears once every client is ready), slice_s, slices, role
    (read/write), objects (hex of the read set), id, seed, lat (a path prefix: latencies in
    µs, one array file per side and op).
    """
    roots = {side: Path(p) for side, p in config["roots"].items()}
    order: list[str] = config["order"]
    Path(config["ready"]).touch()
    while not os.path.exists(config["go"]):
        time.sleep(0.01)
    start = float(Path(config["go"]).read_text())
    slice_s, slices = config["slice_s"], config["slices"]
    end = start + slice_s * slices
    rng = random.Random(config["seed"])
    objects: list[str] = config["objects"]
    me = config["id"]
    ops = {side: {"read": 0, "write": 0} for side in roots}
    errors: dict[str, dict[str, dict[str, int]]] = {side: {} for side in roots}
    lat = {side: {"read": array("d"), "write": array("d")} for side in roots}
    pinned: list[list[str]] = []  # [name, hex] of the pins written through alkfs
    n = 0

    def failed(side: str, op: str, what: str) -> None:
        per = errors[side].setdefault(op, {})
        per[what] = per.get(what, 0) + 1

    while True:
        now = time.monotonic()
        if now < start:
            time.sleep(start - now)
            continue
        if now >= end:
            break
        side = order[int((now - start) // slice_s) % len(order)]
        root = roots[side]
        if config["role"] == "read":
            hexd = rng.choice(objects)
            path = os.path.join(root, "objects", "sha256", hexd)
            t0 = time.perf_counter()
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    data = os.read(fd, 2 * SIZE)
                finally:
                    os.close(fd)
            except OSError as exc:
                failed(side, "read", errname(exc.errno))
                continue
            lat[side]["read"].append((time.perf_counter() - t0) * 1e6)
            ops[side]["read"] += 1
            if len(data) != SIZE or hashlib.sha256(data).hexdigest() != hexd:
                failed(side, "read", "wrong-bytes")
        else:
            data = rng.randbytes(SIZE)
            n += 1
            keep = n % 2 == 1
            name = f"load-{me}-{n}"
            op = "pin" if keep else "put"
            where = ("pins", name) if keep else ("objects", "sha256", f"new-{name}")
            t0 = time.perf_counter()
            try:
                fd = os.open(
                    os.path.join(root, *where), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644
                )
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
            except OSError as exc:
                failed(side, op, errname(exc.errno))
                continue
            lat[side]["write"].append((time.perf_counter() - t0) * 1e6)
            ops[side]["write"] += 1
            if keep and side == "alkfs":
                pinned.append([name, hashlib.sha256(data).hexdigest()])
    for side, per in lat.items():
        for op, values in per.items():
            with open(f"{config['lat']}-{side}-{op}", "wb") as f:
                values.tofile(f)
    return {"id": me, "role": config["role"], "ops": ops, "errors": errors, "pinned": pinned}


# -- the coordinator: start clients, sweep, collect ---------------------------------------------


def run_clients(
    roots: dict[str, Path],
    objects: list[str],
    *,
    clients: int,
    writers: int,
    slice_s: float,
    slices: int,
    work: Path,
    control: Path | None,
    seed: int = 1,
    sweep_every: float = SWEEP_EVERY_S,
) -> dict[str, Any]:
    """Run `clients` client processes (`writers` of them writing) over `slices` slices of
    `slice_s` seconds, the sides of `roots` in turn; while on "alkfs", write `sweep` into
    `control` every `sweep_every` seconds (a sweep longer than that: the next at once),
    from the moment every client is ready. The merged figures: ops, errors, latencies (µs,
    sorted), pinned ([name, hex]), clients (each one's id, role and ops), sweeps (each
    sweep's report with "s", its time through the control file, or {"errno"})."""
    order = list(roots)
    go = work / "go"
    procs = []
    objects_file = work / "objects.json"
    objects_file.write_text(json.dumps(objects))
    for i in range(clients):
        config = {
            "roots": {side: str(p) for side, p in roots.items()},
            "order": order,
            "ready": str(work / f"ready-{i}"),
            "go": str(go),
            "slice_s": slice_s,
            "slices": slices,
            "role": "write" if i < writers else "read",
            "objects": str(objects_file),
            "id": i,
            "seed": seed * 1000 + i,
            "lat": str(work / f"lat-{i}"),
        }
        path = work / f"client-{i}.json"
        path.write_text(json.dumps(config))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "client", str(path)],
                stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
            )
        )
    sweeps: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 120
        while not all((work / f"ready-{i}").exists() for i in range(clients)):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                raise RuntimeError("a client exited or was not ready within 120 s")
            time.sleep(0.01)
        start = time.monotonic() + 0.1
        (work / "go.tmp").write_text(repr(start))
        os.rename(work / "go.tmp", go)
        end = start + slice_s * slices
        next_sweep = start
        while (now := time.monotonic()) < end:
            if now < next_sweep:
                time.sleep(min(next_sweep, end) - now)
                continue
            next_sweep = max(next_sweep + sweep_every, now)
            side = order[int((now - start) // slice_s) % len(order)]
            if control is None or not sweep_every or side != "alkfs":
                continue
            t0 = time.perf_counter()
            try:
                with open(control, "w") as f:
                    f.write("sweep\n")
            except OSError as exc:
                sweeps.append({"errno": errname(exc.errno)})
                continue
            took = time.perf_counter() - t0
            report = json.loads((control.parent / "status").read_text())["last_sweep"]
            sweeps.append({"s": took, **report})
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=120 + slice_s * slices)
            if p.returncode != 0:
                raise RuntimeError(f"a client exited {p.returncode}")
            results.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    merged: dict[str, Any] = {
        "ops": {s: {"read": 0, "write": 0} for s in roots},
        "errors": {s: {} for s in roots},
        "lat": {s: {"read": [], "write": []} for s in roots},
        "pinned": [],
        "clients": [{"id": r["id"], "role": r["role"], "ops": r["ops"]} for r in results],
        "sweeps": sweeps,
        "time_s": {s: slice_s * len(range(order.index(s), slices, len(order))) for s in roots},
    }
    for r in results:
        merged["pinned"] += r["pinned"]
        for side in roots:
            for op in ("read", "write"):
                merged["ops"][side][op] += r["ops"][side][op]
                values = array("d")
                lat_path = work / f"lat-{r['id']}-{side}-{op}"
                with open(lat_path, "rb") as f:
                    values.frombytes(f.read())
                lat_path.unlink()
                merged["lat"][side][op].extend(values)
            for op, per in r["errors"][side].items():
                into = merged["errors"][side].setdefault(op, {})
                for what, count in per.items():
                    into[what] = into.get(what, 0) + count
    for per in merged["lat"].values():
        for values in per.values():
            values.sort()
    return merged


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


# -- the benchmark ----------------------------------------------------------------------------------


def populate(store: Path, plain: Path, count: int) -> list[str]:
    """The read set (pinned r-<i>) and as many unpinned objects; the same files in plain/."""
    sys.path.insert(0, str(HERE.parent))
    from alkfs.app import Alkfs
    from alkfs.keys import Algorithm

    rng = random.Random(7)
    (plain / "objects" / "sha256").mkdir(parents=True)
    (plain / "pins").mkdir()
    objects = []
    with Alkfs.open(store) as app:
        for start in range(0, 2 * count, 1000):
            batch = [(rng.randbytes(SIZE), Algorithm.SHA256, None) for _ in range(1000)]
            batch = batch[: 2 * count - start]
            for i, (result, (data, _, _)) in enumerate(
                zip(app.store.put_many(batch), batch, strict=True)
            ):
                (plain / "objects" / "sha256" / result.key.hex).write_bytes(data)
                if start + i < count:
                    app.pins.pin(f"r-{start + i}", result.key)
                    objects.append(result.key.hex)
                result.pin.release()
    return objects


def check_after(mnt: Path, objects: list[str], pinned: list[list[str]]) -> tuple[list[str], int]:
    """Every pin reads byte-identical, two sweeps leave exactly the pinned objects, verify
    finds nothing corrupt: the problems found, and what those two sweeps deleted."""
    problems = []
    for i, hexd in enumerate(objects):
        data = (mnt / "pins" / f"r-{i}").read_bytes()
        if hashlib.sha256(data).hexdigest() != hexd:
            problems.append(f"pin r-{i} does not read {hexd}")
    for name, hexd in pinned:
        path = mnt / "pins" / name
        # (a pin written as a file is a file with its key in user.alkfs.key; one made as a
        # link points at its object)
        if path.is_symlink():
            named = os.readlink(path).removeprefix("../objects/")
        else:
            named = os.getxattr(path, "user.alkfs.key").decode()
        data = path.read_bytes()
        if named != f"sha256/{hexd}" or hashlib.sha256(data).hexdigest() != hexd:
            problems.append(f"pin {name} names {named}, does not read {hexd}")
    control = mnt / ".alkfs" / "control"
    deleted = 0
    for _ in range(2):
        control.write_text("sweep\n")
        deleted += json.loads((mnt / ".alkfs" / "status").read_text())["last_sweep"]["deleted"]
    control.write_text("verify\n")
    status = json.loads((mnt / ".alkfs" / "status").read_text())
    want = len(objects) + len(pinned)
    if status["pins"] != want or status["objects"]["sha256"]["count"] != want:
        problems.append(
            f"{status['pins']} pins and {status['objects']['sha256']['count']} objects, "
            f"not {want} of each"
        )
    if status["corrupt"]:
        problems.append(f"corrupt: {status['corrupt']}")
    return problems, deleted


def bench(a: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="alkfs-bench-load-"))
    store, plain, mnt = work / "store", work / "plain", work / "mnt"
    mnt.mkdir()
    if str(HERE) not in sys.path:  # (bench/common.py: the benches' daemon runner)
        sys.path.insert(0, str(HERE))
    import common

    daemon = common.alkfsd(store, mnt, work / "alkfsd.log")
    daemon.argv += ["--window", "0"]
    log = daemon.log
    try:
        t0 = time.perf_counter()
        objects = populate(store, plain, a.objects)
        print(f"  populated {2 * a.objects:,} objects in {time.perf_counter() - t0:.1f}s")
        daemon.start()
        slices = 2 * max(1, round(a.duration / a.slice))
        writers = a.writers if a.writers is not None else max(1, a.clients // 4)
        load0 = os.getloadavg()[0]
        got = run_clients(
            {"alkfs": mnt, "plain": plain},
            objects,
            clients=a.clients,
            writers=writers,
            slice_s=a.slice,
            slices=slices,
            work=work,
            control=mnt / ".alkfs" / "control",
            sweep_every=a.sweep_every,
        )
        load1 = os.getloadavg()[0]
        problems, _ = check_after(mnt, objects, got["pinned"])
        daemon.stop()
        done = subprocess.run(
            [str(Path(sys.executable).parent / "alkfs"), "--store", str(store), "verify"],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            problems.append(f"alkfs verify exited {done.returncode}: {done.stderr.strip()}")
        if "Traceback" in log.read_text(errors="replace"):
            problems.append("a traceback in the daemon's log")
        return report(a, got, problems, writers, (load0, load1))
    finally:
        daemon.stop()  # (and unmounted; nothing when stopped already)
        shutil.rmtree(work, ignore_errors=True)


def report(a, got: dict[str, Any], problems: list[str], writers: int, load) -> int:
    import common  # (bench() put bench/ on sys.path)

    rows: dict[str, Any] = {
        "clients": a.clients,
        "writers": writers,
        "duration_s": got["time_s"],
        "objects": a.objects,
        "sweep_every_s": a.sweep_every,
        "load_average": load,
    }
    print(
        f"bench/load.py: {a.clients} clients ({writers} writing), {got['time_s']['alkfs']:.0f} s "
        f"on each side in {a.slice:g} s turns, {a.objects:,} pinned objects of 4 KiB read; "
        f"{os.cpu_count()} CPUs, load average {load[0]:.1f} before, {load[1]:.1f} after"
    )
    results: list[dict] = []  # (bench/results/)
    for op in ("read", "write"):
        figures = {}
        for side in ("alkfs", "plain"):
            values = got["lat"][side][op]
            figures[side] = {
                "ops_s": got["ops"][side][op] / got["time_s"][side],
                "p50_ms": pct(values, 0.50) / 1e3,
                "p99_ms": pct(values, 0.99) / 1e3,
            }
        al, pl = figures["alkfs"], figures["plain"]
        ratio = {
            "ops_s": al["ops_s"] / pl["ops_s"],
            "p50": pl["p50_ms"] / al["p50_ms"],
            "p99": pl["p99_ms"] / al["p99_ms"],
        }
        rows[op] = {**figures, "ratio": ratio}
        results.append(
            common.figure(
                f"4 KiB {op}s, {a.clients} clients ({writers} writing)",
                al["ops_s"],
                "ops/s",
                baseline="plain files",
                baseline_value=pl["ops_s"],
                ratio=ratio["ops_s"],
                note=f"p50 {al['p50_ms']:.1f} ms, p99 {al['p99_ms']:.1f} ms",
            )
        )
        print(
            f"  4 KiB {op:<5}  alkfs {al['ops_s']:8,.0f} ops/s  p50 {al['p50_ms']:.3f} ms  "
            f"p99 {al['p99_ms']:.3f} ms | plain {pl['ops_s']:8,.0f} ops/s  "
            f"p50 {pl['p50_ms']:.3f} ms  p99 {pl['p99_ms']:.3f} ms"
        )
        print(
            f"  {'':<11}  alkfs vs plain: throughput {ratio['ops_s']:.2f}x, "
            f"p50 {ratio['p50']:.2g}x, p99 {ratio['p99']:.2g}x"
        )
    sweeps = got["sweeps"]
    ran = [s for s in sweeps if "s" in s]
    rows["sweeps"] = {
        "count": len(sweeps),
        "p50_s": statistics.median(s["s"] for s in ran) if ran else None,
        "deleted": sum(s["deleted"] for s in ran),
        "cancelled": sum(s["cancelled_by_arbitration"] for s in ran),
        "p99_s": pct(sorted(s["s"] for s in ran), 0.99) if ran else None,
        "aborted": [s["aborted"] for s in ran if s["aborted"]],
        "errors": [s["errno"] for s in sweeps if "errno" in s],
    }
    sw = rows["sweeps"]
    took = f"p50 {sw['p50_s'] * 1e3:.0f} ms, p99 {sw['p99_s'] * 1e3:.0f} ms" if ran else "-"
    print(
        f"  sweeps: {sw['count']} in {got['time_s']['alkfs']:.0f} s ({took}), {sw['deleted']:,} objects deleted, "
        f"{sw['cancelled']:,} kept by arbitration, aborted {sw['aborted'] or 'none'}, "
        f"errors {sw['errors'] or 'none'}"
    )
    rows["errors"] = got["errors"]
    rows["pinned_written"] = len(got["pinned"])
    errs = {side: e for side, e in got["errors"].items() if e}
    print(f"  errnos: {errs or 'none'}; {len(got['pinned']):,} pins written, all checked")
    if errs.get("alkfs") or sw["errors"] or sw["aborted"]:
        problems.append("errors under load")
    rows["problems"] = problems
    for p in problems:
        print(f"  PROBLEM: {p}")
    print("all checks PASS" if not problems else "FAILED")
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    name = ("load-quick" if a.quick else "load") + ("" if a.sweep_every else "-nosweep") + ".json"
    (out / name).write_text(json.dumps(rows, indent=2) + "\n")
    results.append(
        common.figure(
            "sweeps under the load",
            sw["count"],
            "sweeps",
            note=f"{sw['deleted']:,} objects deleted, {sw['cancelled']:,} kept by arbitration",
        )
    )
    results.append(
        common.figure(
            "errno, aborted sweeps, pins lost under the load",
            passed=not problems,
            note="; ".join(problems) or "none",
        )
    )
    common.record(results, quick=a.quick, variant="" if a.sweep_every else "nosweep")
    return 1 if problems else 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "client":
        config = json.loads(Path(sys.argv[2]).read_text())
        config["objects"] = json.loads(Path(config["objects"]).read_text())
        with contextlib.redirect_stdout(sys.stderr):
            result = client(config)
        print(json.dumps(result))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 clients, 10 s, 2,000 objects")
    ap.add_argument("--clients", type=int, default=None, help="client processes (16)")
    ap.add_argument("--writers", type=int, default=None, help="of them writing (a quarter)")
    ap.add_argument("--duration", type=float, default=None, help="seconds on alkfs (60)")
    ap.add_argument("--slice", type=float, default=5.0, help="seconds a turn (5)")
    ap.add_argument("--sweep-every", type=float, default=SWEEP_EVERY_S, help="s (1; 0: none)")
    ap.add_argument("--objects", type=int, default=None, help="pinned objects read (20,000)")
    a = ap.parse_args()
    a.clients = a.clients or (8 if a.quick else 16)
    a.duration = a.duration or (10.0 if a.quick else 60.0)
    a.objects = a.objects or (2_000 if a.quick else 20_000)
    if os.geteuid() != 0:
        print("bench/load.py needs root (FUSE mounts)", file=sys.stderr)
        return 2
    return bench(a)


if __name__ == "__main__":
    sys.exit(main())
