"""Write benchmark: `cp` into an alkfs mount against `cp` into a plain directory on the same disk.

Run as root from the repository with the project's venv (needs /dev/fuse):

    .venv/bin/python bench/mount_write.py            # full sizes
    .venv/bin/python bench/mount_write.py --quick    # smaller sizes, same scenarios
    .venv/bin/python bench/mount_write.py --check    # exit 1 if a target fails

The script starts its own `alkfsd` on a fresh store under a temporary directory (next to
the plain destination, so both write to the same disk) and always stops it by PID
(SIGTERM, then SIGKILL) and unmounts it (`fusermount3 -u`, then `-uz`).

Scenarios (full / --quick sizes):

1. One 1 GiB (128 MiB) file: `cp SRC MNT/pins/NAME` (stored, fsynced, pinned by the time
   `cp` returns) against `cp SRC PLAIN/NAME` (page cache only). A `cp` + `sync` of the
   plain file is printed for reference.
2. 10,000 (1,000) small files of 1-4 KiB: `cp -r SRC/. MNT/pins/` and
   `cp -r SRC/. MNT/objects/sha256/` against `cp -r SRC/. PLAIN/run-N/`, each into a
   directory that exists before the timed cp (cp does not stat each file it writes into
   a directory it made itself, coreutils' `new_dst`: one FUSE request a file fewer than
   alkfs's existing destinations pay). The floor copying into a directory cp makes is
   printed for reference.

Each time is the median of several runs. The small files' runs are interleaved (each
round runs every side once: alkfs, the floor, plain), so a drift of this VM's speed falls
on all of them alike; the large file's are not (see run()). Every run writes fresh names. The large file
starts from the same state on both sides: what the previous run wrote is removed,
untimed (the plain copy deleted; the pin removed and the object deleted by two sweeps,
the daemon running with --window 0), so neither side stores into memory the other side
reuses. For small files alkfs frees each run's objects the same way, while the plain
trees are removed after the last run (see drop_dir). (On a VM
whose balloon takes freed memory back, the first touch of a page costs ~3 us: 0.1 s per
128 MiB, more than the plain copy itself.)

The floor: the same writes into bench/nullfs.py, a pyfuse3 file system that keeps names
and throws the bytes away, are printed for each scenario. It answers the same FUSE
requests as alkfs and does nothing else, so its ratio bounds what any pyfuse3 file
system can reach on this machine. Ratios are throughput ratios (baseline time /
alkfs time). The targets are against the floor (measured in the same run): the large
file >= 0.6x, small files >= 0.5x; the ratio to plain is printed too. The CPU seconds of
the median run (the tool's, the daemon's) are printed too: on a busy machine the wall
ratio mostly measures how long each FUSE round trip waits for a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import OUT, Mount


@dataclass(frozen=True)
class Sizes:
    large_mib: int
    small_count: int
    runs: int


LARGE_TARGET = 0.6  # of the floor's throughput (alkfs also hashes, writes, fsyncs)
SMALL_TARGET = 0.5

FULL = Sizes(large_mib=1024, small_count=10_000, runs=3)
QUICK = Sizes(large_mib=128, small_count=1_000, runs=5)


DAEMON_PID = [0]


def daemon_cpu() -> float:
    """alkfsd's user+system CPU seconds so far (0 when no daemon runs)."""
    if not DAEMON_PID[0]:
        return 0.0
    with open(f"/proc/{DAEMON_PID[0]}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(argv: list[str]) -> tuple[float, float, float]:
    """(wall, the tool's CPU, the daemon's CPU) of one run."""
    r0, d0 = resource.getrusage(resource.RUSAGE_CHILDREN), daemon_cpu()
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - t0
    r1, d1 = resource.getrusage(resource.RUSAGE_CHILDREN), daemon_cpu()
    tool = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return wall, tool, d1 - d0


Case = tuple[Callable[[int], list[str]], Callable[[int], None]]  # (argv of run i, after it)


def interleaved(cases: dict[str, Case], runs: int) -> dict[str, tuple[float, float, float]]:
    """Each case once per round, in order, `runs` rounds: a drift of the machine (its
    CPU steal, the disk's writeback) falls on every side alike. Returns each case's
    median run: (wall, the tool's CPU, the daemon's CPU)."""
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in cases}
    for i in range(runs):
        for name, (make, after) in cases.items():
            results[name].append(timed(make(i)))
            after(i)
    return {name: sorted(r)[len(r) // 2] for name, r in results.items()}


@dataclass
class Report:
    rows: list[dict] = field(default_factory=list)

    def line(
        self,
        scenario: str,
        times: dict[str, float],
        target: float,
        nbytes: int | None = None,
        cpu: dict[str, float] | None = None,
    ) -> None:
        """`times`: alkfs, plain and floor (nullfs). The verdict is against the floor:
        what any pyfuse3 file system reaches here; the ratio to plain is printed too."""
        ratio, ok = common.verdict(scenario, times, "floor", target, nbytes, width=36)
        plain = times["plain"] / times["alkfs"]
        print(
            f"  {'':<36} alkfs vs plain: {plain:.2f}x; the floor (bench/nullfs.py, a pyfuse3 "
            f"fs that stores nothing) vs plain: {times['plain'] / times['floor']:.2f}x"
        )
        if cpu:
            print(
                f"  {'':<36} cpu s: "
                + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
                + f" (load average {os.getloadavg()[0]:.1f})",
                flush=True,
            )
        self.rows.append(
            {
                "scenario": scenario,
                "times_s": {k: round(v, 4) for k, v in times.items()},
                "ratio_to_floor": round(ratio, 3),
                "ratio_to_plain": round(plain, 3),
                "target_to_floor": target,
                "pass": ok,
                "cpu_s": {k: round(v, 3) for k, v in (cpu or {}).items()},
            }
        )

    @property
    def failed(self) -> list[str]:
        return [r["scenario"] for r in self.rows if not r["pass"]]


def write_source(path: Path, mib: int) -> None:
    """A deterministic, incompressible file: a seeded random MiB, each block numbered."""
    base = random.Random(1).randbytes(1 << 20)
    with open(path, "wb") as f:
        for i in range(mib):
            f.write(i.to_bytes(8, "big") + base[8:])


def small_sources(root: Path, count: int) -> None:
    rng = random.Random(2)
    root.mkdir(mode=0o755)
    for i in range(count):
        (root / f"f{i:05d}.txt").write_bytes(rng.randbytes(rng.randint(1024, 4096)))


def copy_into(src: Path, dest: Path) -> list[str]:
    """`cp -r SRC/. DEST` into a DEST made now (before the timed cp), as alkfs's
    destinations exist."""
    dest.mkdir()
    return ["cp", "-r", f"{src}/.", str(dest)]


def clear_pins(mnt: Path) -> None:
    for name in os.listdir(mnt / "pins"):
        os.unlink(mnt / "pins" / name)


def free_objects(mnt: Path) -> None:
    """Delete every unreferenced object now (window 0: stage, then delete), then sync."""
    for _ in range(2):
        (mnt / ".alkfs" / "control").write_text("sweep\n")
    os.sync()


def drop_dir(path: Path) -> None:
    """Remove a plain run's tree, after all of them: on a file system mounted with online
    discard (ext4 `discard`, as here) deleting 10,000 files then syncing slowed the next
    timed `cp -r` from ~0.4 s to as much as 3.9 s."""
    shutil.rmtree(path, ignore_errors=True)
    os.sync()


def run(sizes: Sizes, work: Path, daemon: Mount, null: Mount, report: Report) -> None:
    mnt, plain, nmnt = daemon.mnt, work / "plain", null.mnt
    plain.mkdir()
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cpus")

    big = work / "big.bin"
    write_source(big, sizes.large_mib)
    nbytes = big.stat().st_size
    subprocess.run(["cat", str(big)], stdout=subprocess.DEVNULL, check=True)  # warm
    print(f"1. one {sizes.large_mib} MiB file with cp")
    os.sync()
    # One side after the other (not interleaved): a 1 GiB delete on this disk (online
    # discard) slows the writes that follow it for seconds, so each side's runs follow
    # only its own deletes.
    cases: dict[str, Case] = {
        "alkfs": (
            lambda i: ["cp", str(big), str(mnt / "pins" / f"big-{i}")],
            lambda i: (os.unlink(mnt / "pins" / f"big-{i}"), free_objects(mnt)),
        ),
        "floor": (lambda i: ["cp", str(big), str(nmnt / f"big-{i}")], lambda i: None),
        "plain": (
            lambda i: ["cp", str(big), str(plain / f"big-{i}")],
            lambda i: (os.unlink(plain / f"big-{i}"), os.sync()),
        ),
        "sync": (
            lambda i: ["bash", "-c", f"cp {big} {plain}/big-s{i} && sync {plain}/big-s{i}"],
            lambda i: (os.unlink(plain / f"big-s{i}"), os.sync()),
        ),
    }
    got = {}
    for name, case in cases.items():
        got |= interleaved({name: case}, sizes.runs)
    times = {k: got[k][0] for k in ("alkfs", "plain", "floor")}
    cpu = {"alkfs cp": got["alkfs"][1], "alkfsd": got["alkfs"][2], "plain cp": got["plain"][1]}
    report.line("cp 1 file -> /pins", times, LARGE_TARGET, nbytes, cpu)
    print(f"  {'':<36} (for reference: plain cp + sync {got['sync'][0]:.3f}s)")
    big.unlink()

    src = work / "small"
    small_sources(src, sizes.small_count)
    print(f"2. {sizes.small_count:,} small files with cp -r")
    os.sync()
    got = interleaved(
        {
            "pins": (
                lambda i: ["cp", "-r", f"{src}/.", str(mnt / "pins")],
                lambda i: (clear_pins(mnt), free_objects(mnt)),
            ),
            "objects": (
                lambda i: ["cp", "-r", f"{src}/.", str(mnt / "objects" / "sha256")],
                lambda i: free_objects(mnt),
            ),
            # Into a directory that exists before the timed cp, as /pins and
            # /objects/sha256 do: cp skips its stat of each file in a directory it made
            # itself (coreutils' new_dst), one FUSE LOOKUP a file fewer than alkfs's
            # cases pay. That floor is printed for reference ("floor, new dir").
            "floor": (lambda i: copy_into(src, nmnt / f"run-{i}"), lambda i: None),
            "floor, new dir": (
                lambda i: ["cp", "-r", f"{src}/.", str(nmnt / f"new-{i}")],
                lambda i: None,
            ),
            # (the plain trees are removed after the last run: see drop_dir)
            "plain": (lambda i: copy_into(src, plain / f"run-{i}"), lambda i: None),
        },
        sizes.runs,
    )
    for i in range(sizes.runs):
        drop_dir(plain / f"run-{i}")
    label = f"cp -r {sizes.small_count} files"
    for name, where in (("pins", "/pins"), ("objects", "/objects/sha256")):
        times = {"alkfs": got[name][0], "plain": got["plain"][0], "floor": got["floor"][0]}
        cpu = {"alkfs cp": got[name][1], "alkfsd": got[name][2], "plain cp": got["plain"][1]}
        report.line(f"{label} -> {where}", times, SMALL_TARGET, cpu=cpu)
    fresh = got["floor, new dir"][0]
    print(
        f"  {'':<36} (for reference: the floor copying into a directory cp makes itself, "
        f"no stat a file: {fresh:.3f}s; alkfs /pins vs it {fresh / got['pins'][0]:.2f}x)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target fails")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    a = ap.parse_args()
    sizes = QUICK if a.quick else FULL
    if os.geteuid() != 0:
        print("bench/mount_write.py needs root (FUSE mounts)", file=sys.stderr)
        return 2
    OUT.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="alkfs-bench-write-", dir=OUT))
    daemon = common.alkfsd(work / "store", work / "mnt", work / "alkfsd.log")
    daemon.argv += ["--window", "0"]  # free_objects: two sweeps delete what a run left
    null = common.nullfs(work / "null", work / "nullfs.log")
    report = Report()
    try:
        daemon.start()
        null.start()
        assert daemon.proc is not None
        DAEMON_PID[0] = daemon.proc.pid
        run(sizes, work, daemon, null, report)
    finally:
        for m in (null, daemon):
            with contextlib.suppress(Exception):
                m.stop()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    name = "mount-write-quick.json" if a.quick else "mount-write.json"
    figures = [
        common.figure(
            r["scenario"],
            r["times_s"]["alkfs"],
            "s",
            baseline="the floor (bench/nullfs.py), throughput",
            baseline_value=r["times_s"]["floor"],
            ratio=r["ratio_to_floor"],
            target=f">= {r['target_to_floor']}x",
            passed=r["pass"],
            note=f"plain {r['times_s']['plain']} s ({r['ratio_to_plain']}x)",
        )
        for r in report.rows
    ]
    return common.finish(report.rows, report.failed, name, a.check, figures, quick=a.quick)


if __name__ == "__main__":
    sys.exit(main())
