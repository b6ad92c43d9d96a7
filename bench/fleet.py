"""Fleet benchmark: two alkfsd daemons on one PostgreSQL store against one alone.

Run as root from the repository with the project's venv (needs /dev/fuse, git, PostgreSQL
server binaries):

    .venv/bin/python bench/fleet.py            # full sizes
    .venv/bin/python bench/fleet.py --quick    # smaller sizes, same scenarios
    .venv/bin/python bench/fleet.py --check    # exit 1 if a target fails
    .venv/bin/python bench/fleet.py --sweep 20000   # another number of dead objects

Only public tools touch the mounts: `cp`, `cat` (through `xargs`), `git`, the control file
(`echo sweep > MNT/.alkfs/control`, here a write of "sweep\\n") and the status file, plus
`stat` of a path (the deletion poll). The database is a throwaway server of
tests/pgserver.py (its test settings: the cluster in /dev/shm, fsync off: what is
compared is the daemons' own costs, not the disk's). Every daemon is started here under a
temporary directory, and always stopped by PID and unmounted (bench/common.py).

Setups: "single" is one daemon on its own database and STORE; "fleet" is two daemons on
another database (same server) sharing one STORE directory (mount 1 measured, mount 2
running; a PostgreSQL store is always a fleet member, so "single" runs the fleet code
too, alone). All three run at once and the two setups are measured in turns (medians
of the runs), so a changing machine load falls on both alike; "single" is stopped
before scenarios 2 and 3.

1. Cost per operation, fleet against single (target: fleet <= 1.3x single's time):
   - small put: `cp -r` of N files of 4 KiB into MNT/objects/sha256 (per file);
   - 4 KiB read: `xargs cat` of those N objects, first read (per object);
   - ref update: `git update-ref refs/heads/main NEW OLD` in MNT/repos/ID (per call);
   - sweep of S dead objects: the two sweeps (window 0: the first stages, the second
     deletes) through the control file (wall time, and the reports' duration_s).
2. Two mounts at once: the put+read job run through mount 1 and mount 2 at the same time
   against it through mount 1 alone: per-mount slowdown and aggregate throughput.
3. Cross-mount deletion delay: R times, one object written and looked at through mount 1,
   made dead, swept through mount 2; the time until `stat` on mount 1 says ENOENT, from
   the end of the deleting sweep (and from its start: an upper bound), p50/p99 against
   the 2 s promise.

Figures go to bench/out/fleet[-quick].json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import common

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.pgserver import PgServer  # noqa: E402

GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@example.com",
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@example.com",
}
PROMISE_S = 2.0
COST_TARGET = 1.3


@dataclass
class Sizes:
    files: int  # 4 KiB objects per put/read run
    refs: int  # git update-ref calls per run
    sweep: int  # dead objects per sweep run
    delays: int  # cross-mount deletion samples
    runs: int


FULL = Sizes(files=2000, refs=200, sweep=100_000, delays=60, runs=5)
QUICK = Sizes(files=500, refs=50, sweep=5000, delays=20, runs=4)


def run(*argv: str | os.PathLike[str], cwd=None, timeout: float = 3600) -> str:
    done = subprocess.run(
        [str(a) for a in argv],
        cwd=cwd,
        env={**os.environ, **GIT_ENV},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{argv}: {done.stderr.strip()}")
    return done.stdout


def status(mnt: Path) -> dict:
    return json.loads((mnt / ".alkfs" / "status").read_text())


def sweep(mnt: Path) -> dict:
    (mnt / ".alkfs" / "control").write_text("sweep\n")
    return status(mnt)["last_sweep"]


def wait_no_pin_rows(mnt: Path, timeout: float = 30.0) -> None:
    """The in-process pins of this mount's writes are released lazily (their fleet rows
    go with its next heartbeat flush, alkfs/fleet.py): wait until it holds none."""
    deadline = time.monotonic() + timeout
    while True:
        mine = [n for n in status(mnt)["fleet"]["nodes"] if n["self"]]
        if mine and mine[0]["pins"] == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{mnt}: pin rows still held after {timeout} s")
        time.sleep(0.05)


def daemon(store: Path, mnt: Path, uri: str, log: Path) -> common.Mount:
    m = common.alkfsd(store, mnt, log)
    m.argv += ["--window", "0", "--database", uri]
    m.name = f"alkfsd {mnt.name}"
    return m


def make_files(d: Path, n: int, tag: str, size: int = 4096) -> Path:
    """n files of `size` bytes, each unique (the tag and the index in its first line)."""
    d.mkdir(parents=True)
    filler = os.urandom(size)
    for i in range(n):
        head = f"{tag} {i}\n".encode()
        (d / f"f{i:06d}").write_bytes(head + filler[len(head) :])
    return d


def hexes(d: Path) -> list[str]:
    import hashlib

    return sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir())


def put_and_read(mnt: Path, work: Path, tag: str, n: int) -> tuple[float, float]:
    """`cp -r` of n new 4 KiB files into MNT/objects/sha256, then a first `xargs cat` of
    them through the mount: (put seconds, read seconds)."""
    src = make_files(work / f"src-{tag}", n, tag)
    names = hexes(src)
    t0 = time.perf_counter()
    run("cp", "-r", f"{src}/.", mnt / "objects" / "sha256")
    t_put = time.perf_counter() - t0
    listing = work / f"list-{tag}"
    listing.write_text("".join(f"{mnt}/objects/sha256/{h}\n" for h in names))
    t0 = time.perf_counter()
    out = subprocess.run(
        f"xargs -d '\\n' cat < {listing} | wc -c", shell=True, capture_output=True, text=True
    )
    t_read = time.perf_counter() - t0
    if int(out.stdout.strip() or 0) != 4096 * n:
        raise RuntimeError(f"read back {out.stdout.strip()} bytes, not {4096 * n}: {out.stderr}")
    shutil.rmtree(src)
    return t_put, t_read


DEAD = """
import sys
from alkfs.keys import Algorithm
from alkfs.store import Store
root, uri, n, tag = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with Store.open(root, database=uri) as store:
    for i in range(0, n, 10000):
        items = [(f"{tag} {j}\\n".encode().ljust(64, b"."), Algorithm.SHA256, None)
                 for j in range(i, min(n, i + 10000))]
        for result in store.put_many(items):
            result.pin.release()
"""


class Costs:
    """The four operations on one mount, measured a run at a time (`one_run`,
    `sweep_run`), so that two setups can be measured in turns."""

    def __init__(
        self, mnt: Path, work: Path, label: str, sizes: Sizes, store: Path, database: str
    ) -> None:
        self.mnt, self.work, self.label, self.sizes = mnt, work, label, sizes
        self.store, self.database = store, database
        self.samples: dict[str, list[float]] = {}
        self.runs = 0
        # a repository with two commits to move main between
        src = work / f"repo-{label}"
        run("git", "init", "-q", "-b", "main", src)
        for i in range(2):
            (src / "f").write_text(f"{i}\n")
            run("git", "-C", src, "add", ".")
            run("git", "-C", src, "commit", "-q", "-m", str(i))
        self.a = run("git", "-C", src, "rev-parse", "main~1").strip()
        self.b = run("git", "-C", src, "rev-parse", "main").strip()
        self.repo = mnt / "repos" / f"bench-{label}"
        self.repo.mkdir()
        run("git", "-C", src, "push", "-q", self.repo, "main")

    def add(self, op: str, value: float) -> None:
        self.samples.setdefault(op, []).append(value)

    def one_run(self) -> None:
        n, r = self.sizes.files, self.runs
        self.runs += 1
        t_put, t_read = put_and_read(self.mnt, self.work, f"{self.label}-{r}", n)
        self.add("small put (cp, per 4 KiB file)", t_put / n)
        self.add("4 KiB read (cat, per object)", t_read / n)
        cur, nxt = self.b, self.a
        t0 = time.perf_counter()
        for _ in range(self.sizes.refs):
            run("git", f"--git-dir={self.repo}", "update-ref", "refs/heads/main", nxt, cur)
            cur, nxt = nxt, cur
        self.add("ref update (git update-ref)", (time.perf_counter() - t0) / self.sizes.refs)
        if cur != self.b:  # (an odd count: main back where it was)
            run("git", f"--git-dir={self.repo}", "update-ref", "refs/heads/main", self.b, cur)

    def sweep_run(self) -> None:
        """Everything written so far is dead; add `sweep` dead objects, then the two
        sweeps (the first stages, the second deletes)."""
        n, r = self.sizes.sweep, self.runs
        self.runs += 1
        # stored by a member of its own (the library, in batches): `cp -r` of 100,000
        # files through the mount took 9 minutes here, and how they were stored does not
        # change what the sweep does
        tag = f"dead {self.label} {r}"
        run(sys.executable, "-c", DEAD, self.store, self.database, str(n), tag)
        wait_no_pin_rows(self.mnt)
        t0 = time.perf_counter()
        first = sweep(self.mnt)
        second = sweep(self.mnt)
        self.add(f"sweep of {n} dead objects (wall)", time.perf_counter() - t0)
        self.add(f"sweep of {n} dead objects (reports)", first["duration_s"] + second["duration_s"])
        if second["aborted"] or second["deleted"] < n:
            raise RuntimeError(f"{self.label}: the sweep did not delete the dead objects: {second}")

    def medians(self) -> dict[str, float]:
        return {op: statistics.median(xs) for op, xs in self.samples.items()}


def together(m1: Path, m2: Path, work: Path, sizes: Sizes) -> dict[str, float]:
    """The put+read job through mount 1 alone, then through both at once."""
    alone, both = [], []
    for r in range(sizes.runs):
        t0 = time.perf_counter()
        put_and_read(m1, work, f"alone-{r}", sizes.files)
        alone.append(time.perf_counter() - t0)
        errors: list[BaseException] = []
        go = threading.Barrier(2)

        def job(mnt: Path, tag: str, go: threading.Barrier = go, errors: list = errors) -> None:
            try:
                go.wait()
                put_and_read(mnt, work, tag, sizes.files)
            except BaseException as exc:
                errors.append(exc)

        threads = [
            threading.Thread(target=job, args=(m, f"both-{r}-{n}")) for n, m in enumerate((m1, m2))
        ]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        both.append(time.perf_counter() - t0)
        if errors:
            raise errors[0]
    t1, t2 = statistics.median(alone), statistics.median(both)
    return {"alone_s": t1, "both_s": t2, "slowdown": t2 / t1, "aggregate": 2 * t1 / t2}


def deletion_delays(m1: Path, m2: Path, work: Path, sizes: Sizes) -> dict[str, list[float]]:
    from_end, from_start, took = [], [], []
    wait_no_pin_rows(m1)
    sweep(m2)  # what the scenarios before left: gone before the first sample
    sweep(m2)
    for i in range(sizes.delays):
        src = work / f"del-{i}"
        src.write_bytes(
            f"deleted through mount 2, seen through mount 1: {i} {time.time()}\n".encode()
        )
        (name,) = hexes_of_file(src)
        run("cp", src, m1 / "objects" / "sha256" / "x")
        path = m1 / "objects" / "sha256" / name
        run("cat", path)  # looked at through mount 1: its kernel has the entry
        os.stat(m2 / "objects" / "sha256" / name)
        wait_no_pin_rows(m1)
        sweep(m2)
        t_start = time.perf_counter()
        report = sweep(m2)
        t_end = time.perf_counter()
        if report["deleted"] < 1:
            raise RuntimeError(f"the sweep through mount 2 deleted nothing: {report}")
        while True:
            try:
                os.stat(path)
            except FileNotFoundError:
                now = time.perf_counter()
                break
            if time.perf_counter() - t_end > 30:
                raise RuntimeError(f"{path} still there 30 s after its deletion")
            time.sleep(0.001)
        from_end.append(now - t_end)
        from_start.append(now - t_start)
        took.append(report["duration_s"])
    return {"from_end": from_end, "from_start": from_start, "sweep_s": took}


def hexes_of_file(p: Path) -> list[str]:
    import hashlib

    return [hashlib.sha256(p.read_bytes()).hexdigest()]


def pct(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, round(q / 100 * (len(ys) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target fails")
    ap.add_argument("--sweep", type=int, help="dead objects per sweep run (default 100,000)")
    args = ap.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.sweep:
        sizes = Sizes(**{**sizes.__dict__, "sweep": args.sweep})
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        print("bench/fleet.py needs root and /dev/fuse", file=sys.stderr)
        return 2
    common.OUT.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="alkfs-bench-fleet-"))
    server = PgServer()
    mounts: list[common.Mount] = []
    failed: list[str] = []
    rows: dict = {"sizes": sizes.__dict__}
    try:
        server.start()
        print(f"sizes: {sizes}", flush=True)

        # all three daemons run throughout; the two setups are measured in turns, so
        # that a machine's changing load falls on both alike
        single_uri = server.create_database()
        single = daemon(tmp / "store-single", tmp / "mnt-single", single_uri, tmp / "single.log")
        uri = server.create_database()
        store = tmp / "store-fleet"
        f1 = daemon(store, tmp / "mnt1", uri, tmp / "fleet1.log")
        f2 = daemon(store, tmp / "mnt2", uri, tmp / "fleet2.log")
        for m in (single, f1, f2):
            mounts.append(m)
            m.start()
        nodes = status(f1.mnt)["fleet"]["nodes"]
        if len(nodes) != 2:
            raise RuntimeError(f"the fleet has {len(nodes)} daemons, not 2: {nodes}")
        work = tmp / "work"
        work.mkdir()
        c_single = Costs(single.mnt, work, "single", sizes, tmp / "store-single", single_uri)
        c_fleet = Costs(f1.mnt, work, "fleet", sizes, store, uri)
        print("per-operation costs, single and fleet (mount 1) in turns ...", flush=True)
        for r in range(sizes.runs):
            for c in (c_single, c_fleet) if r % 2 == 0 else (c_fleet, c_single):
                c.one_run()
        for r in range(max(1, sizes.runs - 1)):
            for c in (c_single, c_fleet) if r % 2 == 0 else (c_fleet, c_single):
                c.sweep_run()
        cost_single, cost_fleet = c_single.medians(), c_fleet.medians()
        single.stop()

        print("\n1. cost per operation: fleet daemon (two running) / single daemon")
        width = max(map(len, cost_single))
        rows["cost"] = {}
        for op, t_single in cost_single.items():
            t_fleet = cost_fleet[op]
            ratio = t_fleet / t_single
            ok = ratio <= COST_TARGET
            unit, scale = ("s", 1) if "sweep" in op else ("ms", 1e3)
            print(
                f"  {op:<{width}}  single {t_single * scale:8.3f} {unit}  fleet "
                f"{t_fleet * scale:8.3f} {unit}  {ratio:5.2f}x (target <= {COST_TARGET}x) "
                f"{'PASS' if ok else 'FAIL'}",
                flush=True,
            )
            rows["cost"][op] = {"single": t_single, "fleet": t_fleet, "ratio": ratio}
            if not ok:
                failed.append(op)

        print("\n2. put+read job: through both mounts at once / through mount 1 alone")
        tog = together(f1.mnt, f2.mnt, work, sizes)
        rows["together"] = tog
        print(
            f"  {sizes.files} x (cp 4 KiB + cat): alone {tog['alone_s']:.3f} s, both at once "
            f"{tog['both_s']:.3f} s: per-mount slowdown {tog['slowdown']:.2f}x, "
            f"aggregate throughput {tog['aggregate']:.2f}x one mount's",
            flush=True,
        )

        print(f"\n3. cross-mount deletion delay ({sizes.delays} samples)")
        d = deletion_delays(f1.mnt, f2.mnt, work, sizes)
        rows["deletion_delay"] = {}
        labels = {
            "from_end": "ENOENT on mount 1, from the end of the deleting sweep",
            "from_start": "ENOENT on mount 1, from the start of the deleting sweep",
            "sweep_s": "the deleting sweep itself (its report's duration_s)",
        }
        for key, xs in d.items():
            p50, p99, mx = pct(xs, 50), pct(xs, 99), max(xs)
            rows["deletion_delay"][key] = {"p50": p50, "p99": p99, "max": mx, "samples": xs}
            line = f"  {labels[key]}: p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max "
            line += f"{mx * 1e3:.1f} ms"
            if key == "from_end":  # (the notice's delay; the others include the sweep)
                ok = p99 <= PROMISE_S
                line += f" (promise {PROMISE_S:.0f} s) {'PASS' if ok else 'FAIL'}"
                if not ok:
                    failed.append("cross-mount deletion delay")
            print(line, flush=True)
        for m in (f1, f2):
            text = m.log.read_text(errors="replace")
            if "Traceback" in text:
                print(f"  ! tracebacks in {m.log.name}")
                failed.append(f"tracebacks in {m.name}")
    finally:
        for m in mounts:
            with contextlib.suppress(Exception):
                m.stop()
        server.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    return common.finish(
        [rows],
        failed,
        "fleet-quick.json" if args.quick else "fleet.json",
        args.check,
        figures(rows),
        quick=args.quick,
    )


def figures(rows: dict) -> list[dict]:
    """The report's figures for bench/results/: each operation's cost, the job through both
    mounts, the cross-mount deletion delay."""
    out = [
        common.figure(
            f"fleet member vs lone daemon: {op}",
            c["fleet"],
            "s",
            baseline="a lone PostgreSQL daemon",
            baseline_value=c["single"],
            ratio=c["ratio"],
            target=f"<= {COST_TARGET}x",
            passed=c["ratio"] <= COST_TARGET,
        )
        for op, c in rows.get("cost", {}).items()
    ]
    if "together" in rows:
        t = rows["together"]
        out.append(
            common.figure(
                "put+read job through both mounts at once: per-mount slowdown",
                t["both_s"],
                "s",
                baseline="mount 1 alone",
                baseline_value=t["alone_s"],
                ratio=t["slowdown"],
                note=f"aggregate throughput {t['aggregate']:.2f}x one mount's",
            )
        )
    d = rows.get("deletion_delay", {}).get("from_end")
    if d:
        out.append(
            common.figure(
                "object deleted through one mount, until ENOENT through the other (p99)",
                d["p99"] * 1e3,
                "ms",
                target=f"<= {PROMISE_S:.0f} s",
                passed=d["p99"] <= PROMISE_S,
                note=f"p50 {d['p50'] * 1e3:.1f} ms, max {d['max'] * 1e3:.1f} ms",
            )
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
