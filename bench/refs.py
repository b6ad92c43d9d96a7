"""Refs at local speed: git's ref commands on a repository with many refs, through
`MNT/repos/<id>`, against a native bare repository whose refs are packed (`git pack-refs
--all`), in the same run.

    python bench/refs.py [--refs 10000] [--commits 12000] [--runs 20] [--big 100000] [--check]

A generated repository (`--commits` commits over a deep tree: ~5 objects a commit, so
≥ 50,000 objects by default) gets `--refs` refs (`refs/pull/<n>/head` over its commits,
as a GitHub mirror has) and is imported into a fresh store (`alkfs git import`), which an
alkfsd mounts. Each figure is the median of `--runs` paired, interleaved runs (native,
then the mount, alternating which goes first):

- `git for-each-ref` and `git ls-remote` (target <= 1.5x native);
- a one-commit `git push` by path, and through `git daemon --enable=receive-pack`
  serving MNT/repos and the native parent directory (target <= 5x);
- an incremental `git fetch` of that commit into a second clone (target <= 5x);
- the cost of one more ref: `for-each-ref` on a second repository with `--big` refs over
  the same objects, (t_big - t_small) / (big - refs) per ref, on both sides.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

GIT_ENV = {
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@example.com",
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@example.com",
    "GIT_CONFIG_NOSYSTEM": "1",
    "HOME": "/nonexistent",
}


def git(*args, cwd: Path | None = None, input: bytes | None = None) -> bytes:
    done = subprocess.run(
        ["git", *map(str, args)],
        cwd=cwd,
        input=input,
        capture_output=True,
        env={**os.environ, **GIT_ENV},
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {args}: {done.stderr.decode(errors='replace')[-2000:]}")
    return done.stdout


def generate(path: Path, commits: int) -> list[str]:
    """A repository of `commits` commits, each editing one file of a 3-level tree (fast-
    import: a commit, a blob and three trees a commit). Returns the commit ids, oldest first."""
    git("init", "-q", "--bare", path)
    lines = []
    for i in range(commits):
        a, b = i % 7, (i // 7) % 11
        body = f"file {i % 50} revision {i}\n" + "line\n" * (i % 40)
        data = body.encode()
        lines.append(b"commit refs/heads/main\n")
        lines.append(f"mark :{i + 1}\n".encode())
        lines.append(f"committer bench <b@e> {1_600_000_000 + i * 60} +0000\n".encode())
        msg = f"change {i}\n".encode()
        lines.append(b"data %d\n%s" % (len(msg), msg))
        if i:
            lines.append(f"from :{i}\n".encode())
        lines.append(f"M 100644 inline d{a}/e{b}/f{i % 50}.txt\n".encode())
        lines.append(b"data %d\n%s\n" % (len(data), data))
    git("fast-import", "--quiet", cwd=path, input=b"".join(lines))
    return git("rev-list", "--reverse", "main", cwd=path).decode().split()


def add_refs(path: Path, commits: list[str], n: int, tag: bool = True) -> None:
    step = max(1, len(commits) // max(n, 1))
    batch = "".join(
        f"create refs/pull/{k}/head {commits[(k * step) % len(commits)]}\n" for k in range(n)
    )
    git("update-ref", "--stdin", cwd=path, input=batch.encode())
    if tag:
        git("tag", "-a", "-m", "release", "v1", commits[len(commits) // 2], cwd=path)


def timed(argv: list[str], cwd: Path | None = None) -> float:
    t = time.perf_counter()
    done = subprocess.run(
        argv, cwd=cwd, capture_output=True, env={**os.environ, **GIT_ENV}, timeout=600
    )
    dt = time.perf_counter() - t
    if done.returncode != 0:
        raise RuntimeError(f"{argv}: {done.stderr.decode(errors='replace')[-2000:]}")
    return dt


def paired(name: str, native, mount, runs: int) -> tuple[float, float]:
    """Medians of `runs` interleaved runs; `native()`/`mount()` return seconds."""
    a, b = [], []
    for i in range(runs):
        if i % 2:
            b.append(mount())
            a.append(native())
        else:
            a.append(native())
            b.append(mount())
    return statistics.median(a), statistics.median(b)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def git_daemon(base: Path, port: int, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                "git",
                "daemon",
                "--reuseaddr",
                "--export-all",
                "--enable=receive-pack",
                f"--base-path={base}",
                "--listen=127.0.0.1",
                f"--port={port}",
                str(base),
            ],
            stdout=out,
            stderr=out,
            env={**os.environ, **GIT_ENV},
            start_new_session=True,
        )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("git daemon did not listen")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refs", type=int, default=10_000)
    ap.add_argument("--big", type=int, default=100_000)
    ap.add_argument("--commits", type=int, default=12_000)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="alkfs-bench-refs-"))
    daemon = None
    gitds: list[subprocess.Popen] = []
    failed: list[str] = []
    rows: list[dict] = []
    figures: list[dict] = []  # (bench/results/refs.json)
    try:
        native_base = work / "native"
        native_base.mkdir()
        src = native_base / "big.git"
        t0 = time.perf_counter()
        commits = generate(src, args.commits)
        add_refs(src, commits, args.refs)
        git("pack-refs", "--all", "--prune", cwd=src)
        git("gc", "-q", cwd=src)  # a packed native side, with a commit-graph as gc leaves it
        git("config", "receive.denyCurrentBranch", "ignore", cwd=src)
        many = native_base / "many.git"
        git("clone", "-q", "--bare", "--no-local", src, many)
        add_refs(many, commits, args.big, tag=False)
        git("pack-refs", "--all", "--prune", cwd=many)
        nobj = int(git("count-objects", "-v", cwd=src).decode().split("in-pack: ")[1].split()[0])
        print(
            f"source: {len(commits)} commits, {nobj} objects, {args.refs} refs "
            f"(+{args.big} in the second repository); made in {time.perf_counter() - t0:.1f}s",
            flush=True,
        )

        store, mnt = work / "store", work / "mnt"
        t0 = time.perf_counter()
        for repo_id, gitdir in (("big", src), ("many", many)):
            subprocess.run(
                [
                    str(common.BIN / "alkfs"),
                    "--store",
                    str(store),
                    "git",
                    "import",
                    str(gitdir),
                    "--repo",
                    repo_id,
                ],
                check=True,
                capture_output=True,
            )
        print(f"imported into the store in {time.perf_counter() - t0:.1f}s", flush=True)
        daemon = common.alkfsd(store, mnt, work / "alkfsd.log")
        daemon.argv += ["--window", "1h"]
        daemon.start()
        mrepo = mnt / "repos" / "big"

        def report(name: str, n: float, m: float, target: float) -> None:
            """Print one figure (native and mount medians, their ratio) and record it."""
            ratio = m / n
            ok = ratio <= target
            print(
                f"  {name:<34} native {n * 1e3:8.1f} ms | mount {m * 1e3:8.1f} ms | "
                f"{ratio:5.2f}x (target <= {target}x) {'PASS' if ok else 'FAIL'}",
                flush=True,
            )
            rows.append({"name": name, "native_s": n, "mount_s": m, "ratio": ratio})
            figures.append(
                common.figure(
                    name,
                    m * 1e3,
                    "ms",
                    baseline="native, packed refs",
                    baseline_value=n * 1e3,
                    ratio=ratio,
                    target=f"<= {target}x",
                    passed=ok,
                )
            )
            if not ok:
                failed.append(name)

        def pair(name, native_argv, mount_argv, target, cwd=None, runs=args.runs):
            n, m = paired(
                name,
                lambda: timed(native_argv, cwd),
                lambda: timed(mount_argv, cwd),
                runs,
            )
            report(name, n, m, target)
            return n, m

        print(f"{args.refs} refs, medians of {args.runs} paired interleaved runs:")
        fer = ["git", "for-each-ref", "--format=%(objectname) %(refname)"]
        pair(
            "for-each-ref",
            [*fer[:1], f"--git-dir={src}", *fer[1:]],
            [*fer[:1], f"--git-dir={mrepo}", *fer[1:]],
            1.5,
        )
        pair("ls-remote", ["git", "ls-remote", str(src)], ["git", "ls-remote", str(mrepo)], 1.5)
        big_n, big_m = pair(
            f"for-each-ref ({args.big} refs)",
            [*fer[:1], f"--git-dir={many}", *fer[1:]],
            [*fer[:1], f"--git-dir={mnt / 'repos' / 'many'}", *fer[1:]],
            1.5,
            runs=max(5, args.runs // 4),
        )
        small_n, small_m = rows[0]["native_s"], rows[0]["mount_s"]
        extra = args.big - args.refs
        print(
            f"  one more ref costs for-each-ref: native {(big_n - small_n) / extra * 1e6:.2f} us"
            f" | mount {(big_m - small_m) / extra * 1e6:.2f} us",
            flush=True,
        )

        # pushes and fetches: a client commits (untimed), pushes to both, a second clone fetches
        client, reader = work / "client", work / "reader"
        git("clone", "-q", "--no-local", src, client)
        git("clone", "-q", "--no-local", src, reader)
        port_n, port_m = free_port(), free_port()
        gitds.append(git_daemon(native_base, port_n, work / "gitd-native.log"))
        gitds.append(git_daemon(mnt / "repos", port_m, work / "gitd-mount.log"))
        counter = [0]

        def new_commit() -> None:
            counter[0] += 1
            (client / "bench.txt").write_text(f"{counter[0]}\n")
            git("add", "-A", cwd=client)
            git("commit", "-q", "-m", f"bench {counter[0]}", cwd=client)

        def push(target: str, ref: str) -> float:
            return timed(["git", "push", "-q", target, f"HEAD:{ref}"], cwd=client)

        for label, native_url, mount_url in (
            ("push by path", str(src), str(mrepo)),
            (
                "push via git daemon",
                f"git://127.0.0.1:{port_n}/big.git",
                f"git://127.0.0.1:{port_m}/big",
            ),
        ):
            a, b, fa, fb = [], [], [], []
            ref = f"refs/heads/bench-{label.split()[-1]}"
            for i in range(args.runs):
                new_commit()
                order = ((a, native_url), (b, mount_url))
                for out, url in order if i % 2 == 0 else reversed(order):
                    out.append(push(url, ref))
                forder = ((fa, native_url), (fb, mount_url))
                for out, url in forder if i % 2 == 0 else reversed(forder):
                    out.append(timed(["git", "fetch", "-q", url, ref], cwd=reader))
            for name, xs, ys in ((label, a, b), (f"fetch after {label}", fa, fb)):
                report(name, statistics.median(xs), statistics.median(ys), 5)
    finally:
        for proc in gitds:
            proc.terminate()
            proc.wait(10)
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    common.OUT.mkdir(exist_ok=True)
    return common.finish(rows, failed, "refs.json", args.check, figures)


if __name__ == "__main__":
    sys.exit(main())
