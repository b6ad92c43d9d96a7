"""Git layer benchmark: import rate and closure walk, each against git itself in the same run.

    .venv/bin/python bench/git.py [--commits N]

Builds (once, cached under bench/out/) a repository of at least 50,000 objects
with `git fast-import`, then measures
  import   alkfs import_repo into a fresh dual-tier store (git's pack kept: pack-objects
           piped into index-pack --strict, a multi-pack-index, a commit-graph layer)
           vs `git clone --mirror --no-local` (index-pack too)       target <= 3x
           (the >= 1M-object target, <= 2x, is bench/scale.py's: here, at ~55k
           objects, the store's fixed costs weigh more)
  closure  a cold ref-closure walk over the imported refs
           vs `git rev-list --objects --all > /dev/null`               target <= 3x
Each figure is the best of a few runs. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402  (bench/ is sys.path[0]: the script runs as bench/git.py)

from alkfs.app import Alkfs  # noqa: E402
from alkfs.git.closure import RefClosure  # noqa: E402
from alkfs.git.importer import (  # noqa: E402
    import_repo,
)

OUT = ROOT / "bench" / "out"
TARGET = 3.0
ENV = {
    **os.environ,
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}


def generate(path: Path, commits: int) -> None:
    """A linear-ish history: each commit changes one file three directories deep, with
    branches every 500 commits and tags (lightweight and annotated) every 1000."""
    tmp = path.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(tmp)], check=True, env=ENV)
    lines: list[bytes] = []
    for i in range(commits):
        path_i = f"d{i % 16:02}/e{(i // 16) % 16:02}/f{i % 40:02}.txt"
        content = f"file {path_i} at commit {i}\n".encode() * (1 + i % 7)
        message = f"commit {i}\n".encode()
        lines.append(b"commit refs/heads/main\n")
        lines.append(b"mark :%d\n" % (i + 1))
        lines.append(b"committer Bench <bench@example.com> %d +0000\n" % (1_600_000_000 + i))
        lines.append(b"data %d\n%s" % (len(message), message))
        if i:
            lines.append(b"from :%d\n" % i)
        lines.append(
            b"M 100644 inline %s\ndata %d\n%s\n" % (path_i.encode(), len(content), content)
        )
        if i % 500 == 499:
            lines.append(b"reset refs/heads/b%d\nfrom :%d\n\n" % (i, i + 1))
        if i % 1000 == 999:
            lines.append(b"reset refs/tags/light-%d\nfrom :%d\n\n" % (i, i + 1))
            msg = b"release %d\n" % i
            lines.append(
                b"tag v%d\nfrom :%d\ntagger Bench <bench@example.com> %d +0000\ndata %d\n%s\n"
                % (i, i + 1, 1_600_000_000 + i, len(msg), msg)
            )
    subprocess.run(
        ["git", f"--git-dir={tmp}", "fast-import", "--quiet"],
        input=b"".join(lines),
        check=True,
        env=ENV,
    )
    subprocess.run(["git", f"--git-dir={tmp}", "repack", "-adq"], check=True, env=ENV)
    tmp.rename(path)


def _cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Timer:
    """Wall and CPU seconds (this process, its threads and its waited-for children)."""

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), _cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = _cpu() - self.cpu


def best(fn, runs: int) -> tuple[float, float]:
    walls, cpus = [], []
    for _ in range(runs):
        with Timer() as t:
            fn()
        walls.append(t.wall)
        cpus.append(t.cpu)
    return min(walls), min(cpus)


def git_to_devnull(gitdir: Path, *args: str) -> None:
    with open(os.devnull, "wb") as null:
        subprocess.run(["git", f"--git-dir={gitdir}", *args], stdout=null, check=True, env=ENV)


def clone_mirror(repo: Path) -> None:
    """`git clone --mirror --no-local` of `repo` into a directory removed afterwards."""
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        subprocess.run(
            ["git", "clone", "-q", "--mirror", "--no-local", str(repo), f"{tmp}/m.git"],
            check=True,
            env=ENV,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=11_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    OUT.mkdir(parents=True, exist_ok=True)
    repo = OUT / f"git-bench-{args.commits}.git"
    if not repo.exists():
        t0 = time.perf_counter()
        generate(repo, args.commits)
        print(f"generated {repo} in {time.perf_counter() - t0:.1f}s")
    count = subprocess.run(
        ["git", f"--git-dir={repo}", "count-objects", "-v"], capture_output=True, check=True
    ).stdout.decode()
    objects = sum(
        int(line.split()[1])
        for line in count.splitlines()
        if line.startswith(("count:", "in-pack:"))
    )
    print(f"repository: {objects} objects, {args.commits} commits")
    if objects < 50_000:
        print("FAIL: fewer than 50,000 objects; raise --commits")
        return 1

    git_import = best(lambda: clone_mirror(repo), args.runs)
    git_walk = best(lambda: git_to_devnull(repo, "rev-list", "--objects", "--all"), args.runs)

    imports: list[tuple[float, float]] = []
    walks: list[tuple[float, float]] = []
    reruns: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(dir=OUT) as scratch:
        for run in range(args.runs):
            app = Alkfs.open(Path(scratch) / f"store{run}", window_s=0)
            try:
                with Timer() as t:
                    result = import_repo(app, str(repo), "bench", progress=False)
                imports.append((t.wall, t.cpu))
                assert result.stored == objects, (result.stored, objects)
                for _ in range(args.runs):
                    cold = RefClosure(app.store, app.refs)  # a fresh memo: a full walk
                    with Timer() as t:
                        live = cold.live_keys()
                    walks.append((t.wall, t.cpu))
                assert len(live) == objects, (len(live), objects)
                with Timer() as t:
                    rerun = import_repo(app, str(repo), "bench", progress=False)
                reruns.append((t.wall, t.cpu))
                assert rerun.stored == 0
            finally:
                app.close()

    def low(pairs: list[tuple[float, float]]) -> tuple[float, float]:
        return min(w for w, _ in pairs), min(c for _, c in pairs)

    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus; best of {args.runs}")
    failed = False
    figures = []
    for label, ours, theirs, baseline in (
        ("import", low(imports), git_import, "git clone --mirror --no-local"),
        ("closure", low(walks), git_walk, "git rev-list --objects --all"),
    ):
        ratio = ours[0] / theirs[0]
        cpu_ratio = ours[1] / theirs[1]
        verdict = "PASS" if ratio <= TARGET else "FAIL"
        failed |= ratio > TARGET
        figures.append(
            common.figure(
                f"{label} of {objects:,} objects",
                ours[0],
                "s",
                baseline=baseline,
                baseline_value=theirs[0],
                ratio=ratio,
                target=f"<= {TARGET:.0f}x",
                passed=ratio <= TARGET,
                note=f"cpu {cpu_ratio:.2f}x",
            )
        )
        print(
            f"{label:8} alkfs {ours[0]:6.3f}s wall {ours[1]:6.3f}s cpu ({objects / ours[0]:7.0f} obj/s)"
            f" | {baseline}: {theirs[0]:6.3f}s wall {theirs[1]:6.3f}s cpu"
            f" | ratio {ratio:5.2f}x wall {cpu_ratio:5.2f}x cpu | target <= {TARGET:.0f}x {verdict}"
        )
    rerun = low(reruns)
    print(f"rerun    alkfs {rerun[0]:6.3f}s wall {rerun[1]:6.3f}s cpu (every object present)")
    common.record(figures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
