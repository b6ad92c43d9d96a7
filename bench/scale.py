"""The store at the size servers have: a generated history against native git, same run.

    python bench/scale.py [--objects 1000000] [--quick] [--keep DIR] [--seed 7]

A bare repository of realistic shape is generated with `git fast-import` (streamed, so
memory stays flat): ~3,000 files in four levels of directories, commits editing a few
lines of one to four files, a topic branch merged back every 40 commits, ~100 branches
and a tag every 500 commits, until the repository holds `--objects` objects (`--quick`:
55,000, trio's size). A fork holding ~5 % more objects of its own is made beside it.
Then, each figure with its wall time and peak RSS (the process tree's resident memory
summed, sampled every 0.1 s — children included — and the largest single process from
wait4), side by side:

  import    `git clone --mirror --no-local` (index-pack and git's connectivity check)
            against `alkfs --store S git import` of the same repository, then of the fork
  disk      the whole store directory (database, WAL, large tier, packs) against the
            `objects/` of the mirror after `git gc` (no bitmap)
  sweep     the first sweep of a daemon just started, through the control file, against
            `git rev-list --objects --all` on that mirror (commit-graph, no bitmap); the
            daemon's RSS before, at peak (with its children) and after
  repo rm   `alkfs repo rm` of the fork, then two sweeps with `--window 0`, against
            `git repack -adk` of the rest; the packs' size after against `git gc`'s;
            the store's bytes on disk before and after (what `df` gets back)

The targets (import <= 2x and RSS <= 1.25x the clone's; disk <= 1.3x; first sweep <= 3x
rev-list, RSS <= 1.25x, <= 200 MB above the idle daemon once it ends; the two sweeps after
repo rm <= 3x `repack -adk`, packs <= 1.3x gc) are printed with PASS/FAIL beside each
figure. Everything is written under a temporary directory (or `--keep DIR`) and removed at
the end unless `--keep` is given; bench/out/scale.json gets the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import common
from common import BIN, OUT, Mount

GIT_ENV = {
    **os.environ,
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_PAGER": "cat",
}
CLEAN_ENV = {k: v for k, v in GIT_ENV.items() if not k.startswith("ALKFS_")}


# -- measuring ---------------------------------------------------------------------------
def _tree_rss(root: int) -> int:
    """Resident bytes of `root` and every descendant, now."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(name)
        parents[pid] = int(fields[1])
        rss[pid] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in rss:
        p = pid
        while p > 1 and p != root:
            p = parents.get(p, 0)
        if p == root:
            total += rss[pid]
    return total


class Peak:
    """The peak of a process tree's summed RSS, sampled in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _tree_rss(self.pid))
            self._stop.wait(0.1)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run(name: str, argv: list[str], env: dict | None = None) -> dict:
    """Run a command to its end: wall time, peak tree RSS, largest process's max RSS."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv, env=env or GIT_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    peak = Peak(proc.pid)
    out = proc.stdout.read() if proc.stdout else b""  # (rev-list's ids: ~60 MB at 1M)
    err = proc.stderr.read() if proc.stderr else b""
    _pid, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    took = time.monotonic() - t0
    tree = peak.stop()
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}: {err.decode(errors='replace')[-2000:]}")
    largest = usage.ru_maxrss * 1000
    # (the sampler can miss a process shorter than its period: the larger of the two)
    fig = {"s": round(took, 2), "rss_mb": round(max(tree, largest) / 1e6)}
    print(
        f"  {name:<34} {took:9.1f} s  tree RSS {tree / 1e6:8.0f} MB  "
        f"largest {usage.ru_maxrss / 1000:8.0f} MB  {out.decode().strip()[:80] if len(out) < 400 else ''}",
        flush=True,
    )
    return fig


def du(path: Path) -> int:
    """Bytes on disk under `path`, each inode once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for top, _dirs, names in os.walk(path):
        for n in names:
            try:
                st = os.lstat(os.path.join(top, n))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


FIGURES: list[dict] = []  # every verdict's figure, for bench/results/scale.json


def verdict(
    what: str,
    ratio: float,
    target: float,
    value: float | None = None,
    unit: str | None = None,
    baseline: str | None = None,
    baseline_value: float | None = None,
) -> bool:
    ok = ratio <= target
    print(f"  {what:<60} {ratio:6.2f}x (target <= {target}x) {'PASS' if ok else 'FAIL'}")
    FIGURES.append(
        common.figure(
            what,
            value,
            unit,
            baseline=baseline,
            baseline_value=baseline_value,
            ratio=ratio,
            target=f"<= {target}x",
            passed=ok,
        )
    )
    return ok


# -- the history ---------------------------------------------------------------------------
def count_objects(gitdir: Path) -> int:
    out = subprocess.run(
        ["git", f"--git-dir={gitdir}", "count-objects", "-v"],
        capture_output=True,
        check=True,
        env=GIT_ENV,
    ).stdout.decode()
    fields = dict(line.split(": ") for line in out.splitlines())
    return int(fields["count"]) + int(fields["in-pack"])


def generate(path: Path, objects: int, seed: int, base: Path | None = None) -> None:
    """A bare repository of `objects` objects or more (see the module docstring); with
    `base`, a fork: `base`'s refs plus a branch of its own adding `objects` more."""
    rng = random.Random(seed)
    if base is None:
        subprocess.run(
            ["git", "init", "-q", "--bare", "-b", "main", str(path)], check=True, env=GIT_ENV
        )
    else:
        subprocess.run(
            ["git", "clone", "-q", "--bare", "--no-local", str(base), str(path)],
            check=True,
            env=GIT_ENV,
        )
    dirs = [f"src/p{a}/m{b}/c{c}" for a in range(8) for b in range(8) for c in range(6)]
    names = [f"{d}/f{k}.py" for d in dirs for k in range(8)]
    words = "def class return self value index items result yield import for in if".split()

    def line(i: int) -> str:
        return (
            "    " * rng.randint(0, 3)
            + " ".join(rng.choices(words, k=rng.randint(2, 9)))
            + f"  # {i}\n"
        )

    content = {n: [line(i) for i in range(rng.randint(30, 200))] for n in names}
    fi = subprocess.Popen(
        ["git", f"--git-dir={path}", "fast-import", "--quiet", "--done"],
        stdin=subprocess.PIPE,
        env=GIT_ENV,
    )
    assert fi.stdin is not None
    w = fi.stdin.write
    per_commit = 13  # (a commit, its blobs and the trees above them: about)
    commits = max(1, objects // per_commit)
    branch = "fork" if base is not None else "main"
    t = 1_500_000_000 + (10**7 if base else 0)
    mark = 0

    def commit(ref: str, parents: list[str], edits: int) -> str:
        nonlocal t, mark
        t += 60
        mark += 1
        w(f"commit refs/heads/{ref}\nmark :{mark}\n".encode())
        w(f"committer Dev {mark % 40} <d{mark % 40}@example.com> {t} +0000\n".encode())
        msg = f"change {mark}: {rng.choice(words)} {rng.choice(words)}\n".encode()
        w(b"data %d\n%s" % (len(msg), msg))
        for i, p in enumerate(parents):
            w(f"{'from' if i == 0 else 'merge'} {p}\n".encode())
        for n in rng.sample(names, edits) if mark > 1 or base else names:
            lines = content[n]
            for _ in range(rng.randint(1, 4)):
                lines[rng.randrange(len(lines))] = line(mark)
            if rng.random() < 0.3:
                lines.insert(rng.randrange(len(lines)), line(mark))
            data = "".join(lines).encode()
            w(b"M 100644 inline %s\ndata %d\n%s\n" % (n.encode(), len(data), data))
        return f":{mark}"

    tip = "refs/heads/main" if base is not None else ""
    head = commit(branch, [tip] if tip else [], 3)
    done = 1
    while done < commits:
        if done % 40 == 0:  # a topic branch of a few commits, merged back
            topic = f"topic/{done}"
            t_tip = head
            for _ in range(rng.randint(2, 5)):
                t_tip = commit(topic, [t_tip], rng.randint(1, 3))
                done += 1
            head = commit(branch, [head, t_tip], 0)
            if rng.random() > 100 / max(1, commits / 40):  # keep ~100 topic branches
                w(
                    f"reset refs/heads/{topic}\nfrom 0000000000000000000000000000000000000000\n\n".encode()
                )
        else:
            head = commit(branch, [head], rng.randint(1, 4))
        done += 1
        if done % 500 == 0:
            w(
                f"tag v{done}\nfrom {head}\ntagger Rel <r@example.com> {t} +0000\ndata 4\nrel\n".encode()
            )
    w(b"done\n")
    fi.stdin.close()
    if fi.wait() != 0:
        raise SystemExit("fast-import failed")


# -- the daemon ----------------------------------------------------------------------------
def daemon(store: Path, mnt: Path, log: Path, *args: str) -> Mount:
    m = Mount(
        "alkfsd",
        [str(BIN / "alkfsd"), str(store), str(mnt), "--sweep-every", "0", "--window", "0", *args],
        mnt,
        log,
    )
    m.start(timeout=600)
    return m


def control(mnt: Path, line: str) -> dict:
    (mnt / ".alkfs" / "control").write_text(line + "\n")
    return json.loads((mnt / ".alkfs" / "status").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--quick", action="store_true", help="trio's size: 55,000 objects")
    ap.add_argument("--keep", type=Path, help="work (and leave everything) in this directory")
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    objects = 55_000 if a.quick else a.objects
    # retired pack sets go 5 s after a publish here (300 s by default), so that the disk
    # figures after the sweeps show what they gave back
    os.environ["ALKFS_PACK_RETIRE_GRACE"] = "5"
    work = a.keep or Path(tempfile.mkdtemp(prefix="alkfs-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    src, fork = work / "src.git", work / "fork.git"
    fig: dict = {"objects_asked": objects}
    ok: list[bool] = []
    try:
        if not src.exists():
            t0 = time.monotonic()
            generate(src, objects, a.seed)
            generate(fork, objects // 20, a.seed + 1, base=src)
            print(f"generated in {time.monotonic() - t0:.0f} s", flush=True)
        n_src, n_fork = count_objects(src), count_objects(fork)
        fig.update(objects=n_src, fork_objects=n_fork)
        print(f"history: {n_src:,} objects; fork: {n_fork:,} ({n_fork - n_src:,} its own)")

        print("import")
        mirror = work / "mirror.git"
        shutil.rmtree(mirror, ignore_errors=True)
        fig["clone"] = run(
            "git clone --mirror --no-local",
            ["git", "clone", "-q", "--mirror", "--no-local", str(src), str(mirror)],
        )
        store = work / "store"
        shutil.rmtree(store, ignore_errors=True)
        alkfs = str(BIN / "alkfs")
        fig["import"] = run(
            "alkfs git import",
            [alkfs, "--store", str(store), "git", "import", str(src), "--repo", "main"],
            env=CLEAN_ENV,
        )
        ok.append(
            verdict(
                "import time vs clone",
                fig["import"]["s"] / fig["clone"]["s"],
                2,
                fig["import"]["s"],
                "s",
                "git clone --mirror --no-local",
                fig["clone"]["s"],
            )
        )
        ok.append(
            verdict(
                "import tree RSS vs clone",
                fig["import"]["rss_mb"] / max(1, fig["clone"]["rss_mb"]),
                1.25,
            )
        )
        fig["import_fork"] = run(
            "alkfs git import (fork)",
            [alkfs, "--store", str(store), "git", "import", str(fork), "--repo", "fork"],
            env=CLEAN_ENV,
        )

        print("disk")
        fig["gc"] = run(
            "git gc (no bitmap)",
            ["git", f"--git-dir={mirror}", "-c", "repack.writeBitmaps=false", "gc", "-q"],
        )
        fork_mirror = work / "fork-mirror.git"
        shutil.rmtree(fork_mirror, ignore_errors=True)
        subprocess.run(
            ["git", "clone", "-q", "--mirror", "--no-local", str(fork), str(fork_mirror)],
            check=True,
            env=GIT_ENV,
        )
        subprocess.run(
            ["git", f"--git-dir={fork_mirror}", "-c", "repack.writeBitmaps=false", "gc", "-q"],
            check=True,
            env=GIT_ENV,
        )
        fig["disk_git"] = du(fork_mirror / "objects")
        fig["disk_store"] = du(store)
        print(
            f"  git gc'd objects/ {fig['disk_git'] / 1e6:,.0f} MB   store {fig['disk_store'] / 1e6:,.0f} MB"
        )
        ok.append(
            verdict(
                "store disk vs git gc (main and fork)",
                fig["disk_store"] / fig["disk_git"],
                1.3,
                fig["disk_store"] / 1e6,
                "MB",
                "a git gc'd mirror's objects/",
                fig["disk_git"] / 1e6,
            )
        )

        print("first sweep after a start")
        fig["rev_list"] = run(
            "git rev-list --objects --all",
            ["git", f"--git-dir={mirror}", "rev-list", "--objects", "--all"],
        )
        mnt = work / "mnt"
        mnt.mkdir(exist_ok=True)
        m = daemon(store, mnt, work / "alkfsd.log", "--window", "1h")
        try:
            time.sleep(5)  # (the start's own work: listings, a first intake if any)
            assert m.proc is not None
            idle = _tree_rss(m.proc.pid)
            peak = Peak(m.proc.pid)
            t0 = time.monotonic()
            status = control(mnt, "sweep")
            took = time.monotonic() - t0
            top = peak.stop()
            after = _tree_rss(m.proc.pid)
            fig["sweep"] = {
                "s": round(took, 2),
                "idle_mb": round(idle / 1e6),
                "peak_mb": round(top / 1e6),
                "after_mb": round(after / 1e6),
                "report": status.get("last_sweep"),
            }
            print(
                f"  first sweep {took:.1f} s; daemon RSS idle {idle / 1e6:.0f} MB, peak "
                f"{top / 1e6:.0f} MB, after {after / 1e6:.0f} MB"
            )
            ok.append(
                verdict(
                    "first sweep vs rev-list",
                    took / fig["rev_list"]["s"],
                    3,
                    took,
                    "s",
                    "git rev-list --objects --all",
                    fig["rev_list"]["s"],
                )
            )
            ok.append(
                verdict(
                    "sweep peak RSS vs rev-list",
                    top / 1e6 / max(1, fig["rev_list"]["rss_mb"]),
                    1.25,
                )
            )
            ok.append(after - idle <= 200e6)
            FIGURES.append(
                common.figure(
                    "daemon RSS after the sweep, over idle",
                    (after - idle) / 1e6,
                    "MB",
                    target="<= 200 MB",
                    passed=ok[-1],
                )
            )
            print(
                f"  after the sweep {(after - idle) / 1e6:+.0f} MB over idle (target <= 200 MB) "
                f"{'PASS' if ok[-1] else 'FAIL'}"
            )

            print("repo rm of the fork, two sweeps with --window 0")
            before = du(store)
            subprocess.run(
                [alkfs, "--mount", str(mnt), "repo", "rm", "fork"], check=True, env=CLEAN_ENV
            )
            times = []
            for _ in range(2):
                t0 = time.monotonic()
                report = control(mnt, "sweep 0")["last_sweep"]
                times.append(time.monotonic() - t0)
                print(
                    f"  sweep {times[-1]:.1f} s: staged {report['candidates_staged']:,}, "
                    f"deleted {report['deleted']:,}"
                )
            time.sleep(8)  # (the retired sets' grace, then their removal)
            status = json.loads((mnt / ".alkfs" / "status").read_text())
            after_rm = du(store)
            fig["repo_rm"] = {
                "sweeps_s": [round(x, 2) for x in times],
                "disk_before": before,
                "disk_after": after_rm,
                "packs": status["disk"]["packs"],
            }
        finally:
            m.stop()
        rest = work / "rest.git"
        shutil.rmtree(rest, ignore_errors=True)
        shutil.copytree(fork_mirror, rest, symlinks=True)
        subprocess.run(
            ["git", f"--git-dir={rest}", "update-ref", "-d", "refs/heads/fork"],
            check=True,
            env=GIT_ENV,
        )
        fig["repack_rest"] = run(
            "git repack -adk (the rest)",
            ["git", f"--git-dir={rest}", "-c", "repack.writeBitmaps=false", "repack", "-adkq"],
        )
        ok.append(
            verdict(
                "two sweeps vs repack -adk",
                sum(times) / fig["repack_rest"]["s"],
                3,
                sum(times),
                "s",
                "git repack -adk of the rest",
                fig["repack_rest"]["s"],
            )
        )
        subprocess.run(
            ["git", f"--git-dir={mirror}", "-c", "repack.writeBitmaps=false", "gc", "-q"],
            check=True,
            env=GIT_ENV,
        )
        gc_rest = du(mirror / "objects")
        ok.append(
            verdict("packs after vs git gc of the rest", fig["repo_rm"]["packs"] / gc_rest, 1.3)
        )
        print(f"  store on disk {before / 1e6:,.0f} MB -> {after_rm / 1e6:,.0f} MB")
    finally:
        OUT.mkdir(exist_ok=True)
        (OUT / "scale.json").write_text(json.dumps(fig, indent=2) + "\n")
        common.record(FIGURES, quick=a.quick)
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print("all targets PASS" if all(ok) else f"{ok.count(False)} target(s) FAIL")
    return 0


if __name__ == "__main__":
    sys.exit(main())
