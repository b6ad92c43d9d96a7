"""Helpers shared by the mount benchmarks (bench/mount.py, mount_write.py, mount_push.py).

The scripts run as `python bench/X.py`, so this directory is on sys.path and they
`import common`. A FUSE process started here is always stopped by PID (SIGTERM, then
SIGKILL) and unmounted (`fusermount3 -u`, then `-uz`).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
BIN = Path(sys.executable).parent


def mounted(mnt: Path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == str(mnt) for line in f)


@dataclass
class Mount:
    """One FUSE process (`alkfsd`, `bindfs -f`) serving `mnt`, logging to `log`."""

    name: str
    argv: list[str]
    mnt: Path
    log: Path
    proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> None:
        self.mnt.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while not mounted(self.mnt):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited {self.proc.returncode} before mounting: "
                    + self.log.read_text(errors="replace")[-2000:]
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not mount {self.mnt} within {timeout}s")
            time.sleep(0.05)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for flags in ("-u", "-uz"):
            if not mounted(self.mnt):
                break
            subprocess.run(["fusermount3", flags, str(self.mnt)], capture_output=True)

    def restart(self) -> None:
        self.stop()
        self.start()


def alkfsd(store: Path, mnt: Path, log: Path) -> Mount:
    """An alkfsd (not started yet) serving `store` at `mnt` with the default flags."""
    return Mount("alkfsd", [str(BIN / "alkfsd"), str(store), str(mnt), "--create"], mnt, log)


def nullfs(mnt: Path, log: Path) -> Mount:
    """bench/nullfs.py (not started yet): a pyfuse3 file system that stores nothing."""
    return Mount("nullfs", [sys.executable, str(HERE / "nullfs.py"), str(mnt)], mnt, log)


def bindfs(src: Path, mnt: Path, log: Path) -> Mount:
    """A `bindfs -f` (not started yet) serving the directory `src` at `mnt`."""
    return Mount(f"bindfs {src.name}", ["bindfs", "-f", str(src), str(mnt)], mnt, log)


def verdict(
    scenario: str,
    times: dict[str, float],
    versus: str,
    target: float,
    nbytes: int | None = None,
    *,
    width: int,
    note: str = "",
) -> tuple[float, bool]:
    """Print a scenario's times (and rates) and its throughput ratio against `versus`
    (baseline time / alkfs time) with PASS/FAIL against `target`; (ratio, passed)."""
    ratio = times[versus] / times["alkfs"]
    ok = ratio >= target
    parts = []
    for name, t in times.items():
        rate = f" {nbytes / t / 1e6:,.0f} MB/s" if nbytes else ""
        parts.append(f"{name} {t:.3f}s{rate}")
    print(f"  {scenario:<{width}} " + " | ".join(parts))
    print(
        f"  {'':<{width}} alkfs vs {versus}: {ratio:.2f}x (target >= {target:.2g}x) "
        f"{'PASS' if ok else 'FAIL'}{'  ' + note if note else ''}",
        flush=True,
    )
    return ratio, ok


def finish(rows: list[dict], failed: list[str], name: str, check: bool) -> int:
    """Write the report to bench/out/`name`, print the verdict, return the exit code."""
    (OUT / name).write_text(json.dumps(rows, indent=2) + "\n")
    if failed:
        print(f"FAILED targets: {', '.join(failed)}")
    else:
        print("all targets PASS")
    return 1 if check and failed else 0
