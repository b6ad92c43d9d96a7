"""Every packed object of a repository read through alkfs.git.packread.PackSet, against one
`git cat-file --batch` process reading the same ids.

    python bench/packread.py [REPO] [--objects 50000] [--keep]

REPO is a bare repository (or a work tree's .git); without it a history of about
--objects objects is generated with `git fast-import` (text files edited a few lines per
commit in a tree of directories) and packed by `git repack -adf`, in a temporary
directory (kept with --keep). The ids are those the packs list (sorted, each once); both
sides read them in that order. Prints both wall times, the ratio, the bytes each read
(they must agree) and the peak RSS of this process after the PackSet pass
(resource.getrusage: the maps' pages that were touched count), and before it.
"""

from __future__ import annotations

import argparse
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402  (bench/ is sys.path[0]: the script runs as bench/packread.py)

from alkfs.git.packread import PackSet  # noqa: E402

ENV = {
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_NOSYSTEM": "1",
    "PATH": "/usr/local/bin:/usr/bin:/bin",
}


def git(*args: str | Path, cwd: Path, input: bytes | None = None) -> bytes:
    done = subprocess.run(
        ["git", *map(str, args)], cwd=cwd, env=ENV, input=input, capture_output=True
    )
    if done.returncode:
        sys.exit(f"git {' '.join(map(str, args))}: {done.stderr.decode(errors='replace')}")
    return done.stdout


def generate(dest: Path, objects: int) -> Path:
    """A bare repository of about `objects` objects: 20 directories of 10 files, each
    commit editing 3 files a few lines (a commit, a root tree, <= 3 subtrees, 3 blobs)."""
    rng = random.Random(1)
    words = "store pack delta object tree mount verify read index write sweep pin".split()
    files = {
        f"d{d:02}/f{f}.txt": [
            " ".join(rng.choices(words, k=rng.randint(4, 14))) + "\n" for _ in range(60)
        ]
        for d in range(20)
        for f in range(10)
    }
    names = sorted(files)
    stream = dest / "stream"
    with open(stream, "wb") as out:  # (on disk: the stream would count in the peak RSS)

        def data(b: bytes) -> None:
            out.write(b"data %d\n%s\n" % (len(b), b))

        commits = max(1, (objects - 200 - 20) // 8)
        for i in range(1, commits + 1):
            out.write(b"commit refs/heads/main\nmark :%d\n" % i)
            out.write(b"committer B <b@example.com> %d +0000\n" % (1700000000 + i))
            data(b"commit %d\n" % i)
            if i > 1:
                out.write(b"from :%d\n" % (i - 1))
            touched = names if i == 1 else rng.sample(names, 3)
            for name in touched:
                lines = files[name]
                if i > 1:
                    for _ in range(rng.randint(1, 3)):
                        lines[rng.randrange(len(lines))] = (
                            " ".join(rng.choices(words, k=rng.randint(4, 14))) + f" {i}\n"
                        )
                out.write(b"M 100644 inline %s\n" % name.encode())
                data("".join(lines).encode())
    repo = dest / "gen.git"
    git("init", "-q", "--bare", "-b", "main", repo, cwd=dest)
    with open(stream, "rb") as f:
        done = subprocess.run(["git", "fast-import", "--quiet"], cwd=repo, env=ENV, stdin=f)
    if done.returncode:
        sys.exit("git fast-import failed")
    stream.unlink()
    git("repack", "-adf", cwd=repo)
    return repo


def pack_dir_of(repo: Path) -> Path:
    for d in (repo / "objects" / "pack", repo / ".git" / "objects" / "pack"):
        if d.is_dir():
            return d
    sys.exit(f"{repo}: no objects/pack")


def through_packset(pack_dir: Path, fmt: str, ids: list[bytes]) -> tuple[float, int]:
    t = time.perf_counter()
    total = 0
    with PackSet.of_directory(pack_dir, fmt) as ps:
        for d in ids:
            got = ps.read(d)
            assert got is not None
            total += len(got[1])
    return time.perf_counter() - t, total


def through_cat_file(repo: Path, ids: list[bytes]) -> tuple[float, int]:
    t = time.perf_counter()
    proc = subprocess.Popen(
        ["git", "cat-file", "--batch"],
        cwd=repo,
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    stdin = proc.stdin

    def feed() -> None:
        stdin.write(b"".join(d.hex().encode() + b"\n" for d in ids))
        stdin.close()

    writer = threading.Thread(target=feed)
    writer.start()
    total = 0
    out = proc.stdout
    for _ in ids:
        _, _, size = out.readline().split()
        body = out.read(int(size) + 1)
        total += len(body) - 1
    writer.join()
    proc.wait()
    return time.perf_counter() - t, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo", nargs="?", type=Path)
    ap.add_argument("--objects", type=int, default=50_000)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="alkfs-packread-"))
    try:
        if args.repo is None:
            t = time.perf_counter()
            repo = generate(tmp, args.objects)
            print(f"generated {repo} in {time.perf_counter() - t:.1f}s")
        else:
            repo = args.repo.resolve()
        fmt = git("rev-parse", "--show-object-format", cwd=repo).decode().strip()
        pack_dir = pack_dir_of(repo)
        with PackSet.of_directory(pack_dir, fmt) as ps:
            ids = sorted(set(ps.digests()))
            packs = len(ps.packs)
        size = sum(p.stat().st_size for p in pack_dir.glob("pack-*.pack"))
        print(f"{repo}: {len(ids)} objects in {packs} packs ({size / 2**20:.1f} MiB), {fmt}")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        ours, ours_bytes = through_packset(pack_dir, fmt, ids)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        theirs, their_bytes = through_cat_file(repo, ids)
        assert ours_bytes == their_bytes, (ours_bytes, their_bytes)
        print(f"PackSet          {ours:8.2f} s  {len(ids) / ours:9.0f} objects/s")
        print(f"git cat-file     {theirs:8.2f} s  {len(ids) / theirs:9.0f} objects/s")
        print(f"ratio PackSet/cat-file  {ours / theirs:.2f}")
        print(f"bytes read       {ours_bytes / 2**20:.1f} MiB (both)")
        print(
            f"peak RSS         {rss / 1024:.1f} MiB after the PackSet pass ({before / 1024:.1f} before)"
        )
        read = f"read every object of {len(ids):,} in {packs} packs"
        figure = common.figure(
            read, ours, "s", baseline="git cat-file", baseline_value=theirs, ratio=ours / theirs
        )
        common.record([figure])
    finally:
        if args.keep and args.repo is None:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
