"""Push benchmark: `git push` of a 50,000-object repository into MNT/repos/ID against the
same push into a plain bare repository on the same disk.

Run as root from the repository with the project's venv (needs /dev/fuse and git):

    .venv/bin/python bench/mount_push.py              # 50,000 objects
    .venv/bin/python bench/mount_push.py --objects 5000
    .venv/bin/python bench/mount_push.py --check      # exit 1 if the target fails

The source repository is generated with `git fast-import` (cached under bench/out/). Both
targets have the config the mount's repositories have (no reflogs, no auto-gc or
maintenance; git's default unpack limit, so a push this size arrives as one pack, which
git indexes in the push's quarantine: on the mount that pack is scratch, and its objects
are verified and stored one by one when git moves the index out of the quarantine); the
plain target is an ordinary bare repository in a directory on the same disk as the store.
The script starts its own `alkfsd` (default window) on a fresh store under a temporary
directory, and always stops it by PID (SIGTERM, then SIGKILL) and unmounts it
(`fusermount3 -u`, then `-uz`).

Each push goes into a fresh, empty target; the time is the median of --runs pushes per side
(a fresh store and daemon per run on the mount: objects the store already holds would make
git's index-pack read each one back through the mount for its collision check). After the pushes, `git fsck --full` of the last
mounted repository must be clean and its refs equal the source's. Printed: both medians,
the ratio mount/plain, and PASS/FAIL against the target (ratio <= 5).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import OUT, Mount

TARGET = 5.0
GIT_ENV = {
    **os.environ,
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_COMMITTER_NAME": "Bench",
    "GIT_COMMITTER_EMAIL": "bench@example.com",
    "GIT_COMMITTER_DATE": "1700000000 +0000",
}
FILES_PER_COMMIT = 46  # + root tree + 2 subtrees + commit: ~50 objects a commit


def git(*args, input: bytes | None = None, cwd: Path | None = None) -> str:
    done = subprocess.run(
        ["git", *map(str, args)], input=input, cwd=cwd, env=GIT_ENV, capture_output=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {args}: {done.stderr.decode(errors='replace')}")
    return done.stdout.decode()


def source(objects: int) -> Path:
    """A bare repository of at least `objects` objects (cached)."""
    path = OUT / f"push-src-{objects}.git"
    if (path / "done").exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    git("init", "-q", "--bare", "-b", "main", path)
    commits = -(-objects // (FILES_PER_COMMIT + 4))
    stream = []
    for i in range(commits):
        stream.append("commit refs/heads/main\n")
        stream.append(f"committer B <b@example.com> {1700000000 + i} +0000\n")
        stream.append(f"data {len(f'c{i}')}\nc{i}")
        stream.append("\n")
        for j in range(FILES_PER_COMMIT):
            data = f"commit {i} file {j}\n" + "x" * (j * 37 % 700) + "\n"
            stream.append(f"M 100644 inline d{i % 16}/s{j % 4}/f{i}-{j}\ndata {len(data)}\n")
            stream.append(data + "\n")
    git(f"--git-dir={path}", "fast-import", "--quiet", input="".join(stream).encode())
    git(f"--git-dir={path}", "tag", "-a", "-m", "bench", "v1", "main")
    (path / "done").write_text("")
    return path


def count_objects(gitdir: Path) -> int:
    return len(git(f"--git-dir={gitdir}", "rev-list", "--objects", "--all").splitlines())


def plain_target(path: Path) -> Path:
    git("init", "-q", "--bare", "-b", "main", path)
    for key, value in (
        ("core.logAllRefUpdates", "false"),
        ("gc.auto", "0"),
        ("maintenance.auto", "false"),
        ("receive.autogc", "false"),
    ):
        git(f"--git-dir={path}", "config", key, value)
    return path


def push(src: Path, target: Path) -> float:
    t0 = time.perf_counter()
    git(f"--git-dir={src}", "push", "-q", str(target), "main", "v1")
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, default=50_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--check", action="store_true", help="exit 1 if the target fails")
    a = p.parse_args()
    OUT.mkdir(exist_ok=True)
    src = source(a.objects)
    n = count_objects(src)
    work = Path(tempfile.mkdtemp(prefix="alkfs-push-", dir=OUT))
    daemon: Mount | None = None
    try:
        plain, mount = [], []
        for run in range(a.runs):
            target = plain_target(work / f"plain-{run}.git")
            plain.append(push(src, target))
            shutil.rmtree(target)
            # a fresh store each run, as the plain side pushes into an empty repository
            # (objects already stored would be re-read by git's collision check)
            daemon = common.alkfsd(work / f"store-{run}", work / "mnt", work / "alkfsd.log")
            daemon.start()
            repo = daemon.mnt / "repos" / "bench"
            os.mkdir(repo)
            mount.append(push(src, repo))
            print(f"run {run + 1}: plain {plain[-1]:.2f} s, mount {mount[-1]:.2f} s", flush=True)
            if run == a.runs - 1:
                git(f"--git-dir={repo}", "fsck", "--full", "--no-dangling")
                refs = "for-each-ref", "--format=%(objectname) %(refname)"
                assert git(f"--git-dir={repo}", *refs) == git(f"--git-dir={src}", *refs)
            daemon.stop()
            shutil.rmtree(work / f"store-{run}")
        tp, tm = statistics.median(plain), statistics.median(mount)
        ratio = tm / tp
        ok = ratio <= TARGET
        print(
            f"objects pushed: {n}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus"
        )
        print(f"plain bare repository: {tp:.2f} s (median of {a.runs})")
        print(f"alkfs MNT/repos/ID:    {tm:.2f} s (median of {a.runs})")
        print(
            f"ratio mount/plain: {ratio:.2f}x  target <= {TARGET:.0f}x  {'PASS' if ok else 'FAIL'}"
        )
        figure = common.figure(
            f"git push of {n:,} objects into MNT/repos/ID",
            tm,
            "s",
            baseline="a plain bare repository",
            baseline_value=tp,
            ratio=ratio,
            target=f"<= {TARGET:.0f}x",
            passed=ok,
        )
        common.record([figure], quick=a.objects != 50_000)
        return 0 if ok or not a.check else 1
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
