"""Push benchmark: `git push` of a 50,000-object repository into MNT/repos/ID against the
same push into a plain bare repository on the same disk.

Run as root from the repository with the project's venv (needs /dev/fuse and git):

    .venv/bin/python bench/mount_push.py              # 50,000 objects
    .venv/bin/python bench/mount_push.py --objects 5000
    .venv/bin/python bench/mount_push.py --check      # exit 1 if the target fails

The source repository is generated with `git fast-import` (cached under bench/out/). Both
targets get the same config the mount's repositories have (pushes arrive loose:
receive.unpackLimit above the object count, no auto-gc, no reflogs), so both sides run
git's unpack-objects and write one loose object per object; the plain side writes them to
the same disk the store lives on. The script starts its own `alkfsd` (default window) on a
fresh store under a temporary directory, and always stops it by PID (SIGTERM, then SIGKILL)
and unmounts it (`fusermount3 -u`, then `-uz`).

Each push goes into a fresh, empty target; the time is the median of --runs pushes per side
(a fresh repository id per run on the mount). After the pushes, `git fsck --full` of the last
mounted repository must be clean and its refs equal the source's. Printed: both medians,
the ratio mount/plain, and PASS/FAIL against the target (ratio <= 5).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
BIN = Path(sys.executable).parent
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


def mounted(mnt: Path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == str(mnt) for line in f)


class Daemon:
    def __init__(self, store: Path, mnt: Path, log: Path) -> None:
        self.store, self.mnt, self.log = store, mnt, log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> None:
        self.mnt.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(BIN / "alkfsd"), str(self.store), str(self.mnt)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not mounted(self.mnt):
            if self.proc.poll() is not None:
                raise RuntimeError("alkfsd exited: " + self.log.read_text(errors="replace"))
            if time.monotonic() > deadline:
                raise RuntimeError(f"alkfsd did not mount {self.mnt}")
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


def plain_target(path: Path) -> Path:
    git("init", "-q", "--bare", "-b", "main", path)
    for key, value in (
        ("core.logAllRefUpdates", "false"),
        ("gc.auto", "0"),
        ("receive.unpackLimit", "100000"),
        ("receive.autogc", "false"),
        ("transfer.unpackLimit", "100000"),
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
    daemon = Daemon(work / "store", work / "mnt", work / "alkfsd.log")
    try:
        plain, mount = [], []
        daemon.start()
        for run in range(a.runs):
            target = plain_target(work / f"plain-{run}.git")
            plain.append(push(src, target))
            shutil.rmtree(target)
            repo = daemon.mnt / "repos" / f"bench{run}"
            os.mkdir(repo)
            mount.append(push(src, repo))
            print(f"run {run + 1}: plain {plain[-1]:.2f} s, mount {mount[-1]:.2f} s", flush=True)
        last = daemon.mnt / "repos" / f"bench{a.runs - 1}"
        git(f"--git-dir={last}", "fsck", "--full", "--no-dangling")
        refs = "for-each-ref", "--format=%(objectname) %(refname)"
        assert git(f"--git-dir={last}", *refs) == git(f"--git-dir={src}", *refs)
        tp, tm = statistics.median(plain), statistics.median(mount)
        ratio = tm / tp
        ok = ratio <= TARGET
        print(f"objects pushed: {n}")
        print(f"plain bare repository: {tp:.2f} s (median of {a.runs})")
        print(f"alkfs MNT/repos/ID:    {tm:.2f} s (median of {a.runs})")
        print(
            f"ratio mount/plain: {ratio:.2f}x  target <= {TARGET:.0f}x  {'PASS' if ok else 'FAIL'}"
        )
        return 0 if ok or not a.check else 1
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
