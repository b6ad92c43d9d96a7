"""Helpers shared by the mount benchmarks (bench/mount.py, mount_write.py, mount_push.py).

The scripts run as `python bench/X.py`, so this directory is on sys.path and they
`import common`. A FUSE process started here is always stopped by PID (SIGTERM, then
SIGKILL) and unmounted (`fusermount3 -u`, then `-uz`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import resource
import shlex
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


def finish(
    rows: list[dict],
    failed: list[str],
    name: str,
    check: bool,
    figures: list[dict],
    *,
    quick: bool = False,
) -> int:
    """Write the report to bench/out/`name` and the figures to bench/results/ (record()),
    print the verdict, return the exit code."""
    (OUT / name).write_text(json.dumps(rows, indent=2) + "\n")
    record(figures, quick=quick)
    if failed:
        print(f"FAILED targets: {', '.join(failed)}")
    else:
        print("all targets PASS")
    return 1 if check and failed else 0


# --- Results as data ------------------------------------------------------------------
#
# Every script ends with record(): its figures, with the command, the commit and the
# machine, go to bench/results/<script>.json (<script>-quick.json for a --quick run),
# replacing the previous run's; git keeps the history. bench/render.py makes the table of
# docs/performance.md from them.

RESULTS = HERE / "results"
SCHEMA = 1


def figure(
    name: str,
    value: float | None = None,
    unit: str | None = None,
    *,
    baseline: str | None = None,
    baseline_value: float | None = None,
    ratio: float | None = None,
    target: str | None = None,
    passed: bool | None = None,
    note: str | None = None,
) -> dict:
    """One measured figure: alkfs's `value` in `unit`; against `baseline` (what it is
    compared with, `baseline_value` in the same unit), `ratio` as the script prints it,
    `target` as text (e.g. ">= 0.6x"), `passed` its verdict. None fields are left out."""
    row = {
        "name": name,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "baseline_value": baseline_value,
        "ratio": ratio,
        "target": target,
        "pass": passed,
        "note": note,
    }
    return {
        k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if v is not None
    }


def _git(*args: str) -> str | None:
    done = subprocess.run(["git", "-C", str(HERE.parent), *args], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def machine() -> dict:
    """Cores, RAM, CPU model, kernel, Python and the load average now."""
    facts: dict = {"cores": os.cpu_count(), "kernel": platform.release()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                facts["ram_mb"] = int(line.split()[1]) // 1024
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
    facts["python"] = platform.python_version()
    facts["load"] = [round(x, 2) for x in os.getloadavg()]
    return facts


def peak_rss_mb() -> dict:
    """Peak RSS of this process and of its largest waited-for child (daemons, git), MB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"self": round(own / 1024, 1), "children": round(children / 1024, 1)}


def record(figures: list[dict], *, quick: bool = False, variant: str = "") -> Path:
    """Write this run's figures (figure()s) to bench/results/<script>[-quick][-variant].json,
    overwriting the last such run's, and return the path. A --quick run (smaller sizes)
    has a file of its own: bench/render.py leaves it out of the table unless asked."""
    script = Path(sys.argv[0]).stem
    verdicts = [f["pass"] for f in figures if "pass" in f]
    status = _git("status", "--porcelain", "--untracked-files=no")
    doc = {
        "schema": SCHEMA,
        "script": script,
        "source": "run",
        "command": " ".join(
            [f"bench/{Path(sys.argv[0]).name}", *(shlex.quote(a) for a in sys.argv[1:])]
        ),
        "quick": quick,
        "variant": variant or None,
        "utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "machine": machine(),
        "peak_rss_mb": peak_rss_mb(),
        "passed": all(verdicts) if verdicts else None,
        "figures": figures,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{script}{'-quick' if quick else ''}{'-' + variant if variant else ''}.json"
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    print(f"figures: {path.relative_to(HERE.parent)}")
    return path
