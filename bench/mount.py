"""Mount benchmark: alkfs through FUSE against plain files and against bindfs over the same files.

Run as root from the repository with the project's venv (needs /dev/fuse, bindfs, git):

    .venv/bin/python bench/mount.py            # full sizes
    .venv/bin/python bench/mount.py --quick    # smaller sizes, same scenarios
    .venv/bin/python bench/mount.py --check    # exit 1 if a target fails
    .venv/bin/python bench/mount.py --only 2,3 # some scenarios only
    .venv/bin/python bench/mount.py --fresh    # rebuild the cached store and files

Only public tools are driven: `cat`, `find | xargs cat`, `ls -l`, `git`. bindfs (Debian's)
is the peer FUSE filesystem: it serves the very same bytes from a plain directory, so
"alkfs vs bindfs" isolates what alkfs adds over a minimal pass-through FUSE filesystem.

The store is populated through the library (Store.put / put_many, git.importer) before the
daemon starts; it and the plain copies of its bytes are cached under bench/out/mount-data-*
(the daemon only reads them; --fresh rebuilds them). The script starts its own `alkfsd` and
`bindfs -f` under a temporary directory and always stops them by PID (SIGTERM, then SIGKILL)
and unmounts them (`fusermount3 -u`, then `-uz`), whatever happens.

Scenarios (full / --quick sizes):

1. Sequential read of one 1 GiB (128 MiB) object with `cat`: the alkfs object file, a plain
   file with the same bytes, and that file through bindfs. "First read" drops the page cache
   first (`echo 3 > /proc/sys/vm/drop_caches`, or, where that is not permitted, remounts and
   evicts the backing files with posix_fadvise); "repeated" reads a warm file.
2. 20,000 (2,000) objects of 4 KiB read with `find DIR -type f -print0 | xargs -0 cat`: the
   store's blake3 directory (holding exactly these objects) against the same files in a plain
   directory and through bindfs; cold and warm.
3. `ls -l` of the 100,000 (10,000)-entry /objects/sha256 directory against a plain directory
   of the same names and sizes; the first listing after the cache drop, and repeated.
4. git over a generated repository of at least 50,000 (5,000) objects (git fast-import,
   cached under bench/out/): `git rev-list --objects --all` and `git log --stat -n 2000`
   in a repository with no objects of its own whose objects/info/alternates names
   MNT/git/sha1, against the same repository packed natively, and against the same objects
   loose in a plain object directory served by bindfs (again through alternates). The
   outputs are checked identical before anything is timed.
5. Writes: bench/mount_write.py (`cp` of a 1 GiB (128 MiB) file into /pins and `cp -r` of
   10,000 (1,000) small files into /pins and /objects/sha256, against the same into a
   plain directory, with a pyfuse3 floor), run as a child with --check.
6. `git push` of a 50,000 (5,000)-object repository into MNT/repos/ID against a push
   into a plain bare repository: bench/mount_push.py, run as a child with --check.

Each time is the median of several runs. Ratios are throughput ratios (baseline time /
alkfs time: above 1 means alkfs is faster). Targets: repeated large reads >= 0.9x plain;
first large reads >= 0.5x bindfs; small objects and git through alternates no slower than
bindfs over the same loose files (>= 1.0x); `ls -l` at most 3x the plain directory's time
(>= 0.33x).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import common  # noqa: E402
from common import OUT, Mount  # noqa: E402

from alkfs.app import Alkfs  # noqa: E402
from alkfs.git.importer import import_repo  # noqa: E402
from alkfs.keys import Algorithm, Key  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    large_mib: int
    small_count: int
    ls_count: int
    git_commits: int  # ~8 objects per commit
    runs: int


FULL = Sizes(large_mib=1024, small_count=20_000, ls_count=100_000, git_commits=6_600, runs=3)
QUICK = Sizes(large_mib=128, small_count=2_000, ls_count=10_000, git_commits=700, runs=3)


# -- mounts, always cleaned up ------------------------------------------------------------


class Mounts:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.all: list[Mount] = []

    def alkfsd(self, store: Path, mnt: Path) -> Mount:
        return self._add(common.alkfsd(store, mnt, self.work / "alkfsd.log"))

    def bindfs(self, src: Path, mnt: Path) -> Mount:
        return self._add(common.bindfs(src, mnt, self.work / "bindfs.log"))

    def _add(self, m: Mount) -> Mount:
        self.all.append(m)
        m.start()
        return m

    def stop_all(self) -> None:
        for m in reversed(self.all):
            with contextlib.suppress(Exception):
                m.stop()


# -- caches and timing -------------------------------------------------------------------------


def can_drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict(path: Path) -> None:
    """Drop one file's pages from the page cache (works without privileges)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Cache:
    def __init__(self, mounts: Mounts, backing: list[Path]) -> None:
        self.mounts = mounts
        self.backing = backing  # big files to evict when drop_caches is not ours
        self.drop = can_drop_caches()

    def cold(self) -> None:
        os.sync()
        if self.drop:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return
        for m in self.mounts.all:
            m.restart()
        for p in self.backing:
            evict(p)


def timed(cmd: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(["bash", "-c", cmd], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def median_time(cmd: str, runs: int, before: Callable[[], None] | None = None) -> float:
    times = []
    for _ in range(runs):
        if before is not None:
            before()
        times.append(timed(cmd))
    return statistics.median(times)


# -- reporting --------------------------------------------------------------------------------


@dataclass
class Report:
    rows: list[dict] = field(default_factory=list)

    def line(
        self,
        scenario: str,
        times: dict[str, float],
        versus: str,
        target: float,
        nbytes: int | None = None,
        note: str = "",
    ) -> None:
        ratio, ok = common.verdict(scenario, times, versus, target, nbytes, width=34, note=note)
        self.rows.append(
            {
                "scenario": scenario,
                "times_s": times,
                "versus": versus,
                "ratio": round(ratio, 3),
                "target": target,
                "pass": ok,
            }
        )

    @property
    def failed(self) -> list[str]:
        return [str(r["scenario"]) for r in self.rows if not r["pass"]]


# -- populating -------------------------------------------------------------------------------


def write_random(path: Path, nbytes: int) -> None:
    chunk = 64 << 20
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(chunk, left)
            f.write(os.urandom(n))
            left -= n


def small_payloads(count: int, size: int, seed: int) -> Iterator[bytes]:
    rng = random.Random(seed)
    for _ in range(count):
        yield rng.randbytes(size)


def put_files(app: Alkfs, plain: Path, algo: Algorithm, payloads: Iterator[bytes]) -> int:
    """Store every payload under `algo` and write the same bytes to plain/<hex>."""
    plain.mkdir(parents=True, exist_ok=True)
    n = 0
    batch: list[tuple[bytes, Algorithm, None]] = []

    def flush() -> None:
        for result, (data, _, _) in zip(app.store.put_many(batch), batch, strict=True):
            result.pin.release()
            (plain / result.key.hex).write_bytes(data)
        batch.clear()

    for data in payloads:
        batch.append((data, algo, None))
        n += 1
        if len(batch) >= 2000:
            flush()
    flush()
    return n


# -- the git repository -------------------------------------------------------------------------

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
    "sigma tau upsilon phi chi psi omega store object tree blob commit mount fuse sweep pin"
).split()


def fast_import_stream(commits: int, dirs: int = 100, files: int = 40, touched: int = 3) -> bytes:
    """A linear history (with a branch merged back every 500 commits and a tag every 250)
    where each commit rewrites `touched` files in distinct directories."""
    rng = random.Random(42)
    out = bytearray()

    def data(b: bytes) -> None:
        out.extend(b"data %d\n" % len(b) + b + b"\n")

    for c in range(1, commits + 1):
        branch = "side" if c % 500 in range(490, 500) else "main"
        out += b"commit refs/heads/%s\nmark :%d\n" % (branch.encode(), c)
        out += b"committer Bench <bench@example.com> %d +0000\n" % (1_700_000_000 + 60 * c)
        data(f"change {c}\n\n{' '.join(rng.choices(WORDS, k=12))}\n".encode())
        if c == 1:
            pass
        elif c % 500 == 490:
            out += b"from :%d\n" % (c - 1)  # the side branch forks from main
        elif c % 500 == 0:
            out += b"from :%d\nmerge :%d\n" % (c - 11, c - 1)  # main merges the side branch
        else:
            out += b"from :%d\n" % (c - 1)
        for d in rng.sample(range(dirs), touched):
            path = f"d{d:03d}/f{rng.randrange(files):02d}.txt"
            lines = (
                " ".join(rng.choices(WORDS, k=rng.randrange(4, 14)))
                for _ in range(rng.randrange(10, 60))
            )
            body = f"{path} at {c}\n" + "\n".join(lines) + "\n"
            out += f"M 100644 inline {path}\n".encode()
            data(body.encode())
        if c % 250 == 0:
            out += b"tag v%d\nfrom :%d\n" % (c // 250, c)
            out += b"tagger Bench <bench@example.com> %d +0000\n" % (1_700_000_000 + 60 * c)
            data(b"release %d\n" % (c // 250))
    return bytes(out)


def git(*args: str, **kw) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True, **kw).stdout


def build_git(commits: int) -> tuple[Path, Path, int]:
    """(packed source, loose object copy, object count), cached under bench/out/."""
    base = OUT / f"git-{commits}"
    src, loose, done = base / "src.git", base / "loose.git", base / "done"
    if not done.exists():
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        git("init", "-q", "--bare", "-b", "main", str(src))
        subprocess.run(
            ["git", f"--git-dir={src}", "fast-import", "--quiet"],
            input=fast_import_stream(commits),
            check=True,
        )
        git(f"--git-dir={src}", "repack", "-a", "-d", "-f", "-q")
        git(f"--git-dir={src}", "pack-refs", "--all")
        git("init", "-q", "--bare", "-b", "main", str(loose))
        for pack in (src / "objects" / "pack").glob("*.pack"):
            with open(pack, "rb") as f:
                subprocess.run(
                    ["git", f"--git-dir={loose}", "unpack-objects", "-q"], stdin=f, check=True
                )
        done.write_text("ok\n")
    count = (
        len(git(f"--git-dir={src}", "cat-file", "--batch-all-objects", "--batch-check").split("\n"))
        - 1
    )
    return src, loose, count


def alternates_repo(path: Path, src: Path, objects: Path) -> Path:
    """A bare repository with src's refs, no objects, and `objects` as its alternate."""
    shutil.rmtree(path, ignore_errors=True)
    git("init", "-q", "--bare", "-b", "main", str(path))
    shutil.copy(src / "packed-refs", path / "packed-refs")
    (path / "objects" / "info" / "alternates").write_text(f"{objects}\n")
    return path


# -- the scenarios ----------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target fails")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--fresh", action="store_true", help="rebuild the cached store and files")
    ap.add_argument("--only", default="1,2,3,4,5,6", help="scenarios to run, e.g. 2,3")
    a = ap.parse_args()
    if set(a.only.split(",")) - set(SCENARIOS):
        ap.error(f"--only takes a comma-separated subset of {','.join(SCENARIOS)}")
    if os.geteuid() != 0:
        print("bench/mount.py needs root (FUSE mounts, drop_caches)", file=sys.stderr)
        return 2
    for tool in ("bindfs", "fusermount3", "git"):
        if shutil.which(tool) is None:
            print(f"bench/mount.py needs {tool}", file=sys.stderr)
            return 2

    OUT.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="alkfs-bench-mount-"))
    mounts = Mounts(work)
    report = Report()
    try:
        run(a, work, mounts, report)
    finally:
        mounts.stop_all()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    name = "mount-quick.json" if a.quick else "mount.json"
    return common.finish(report.rows, report.failed, name, a.check, figures(report), quick=a.quick)


def figures(report: Report) -> list[dict]:
    """The rows as bench/results/ figures (a child script's row: its exit status)."""
    out = []
    for r in report.rows:
        if "times_s" not in r:
            note = r.get("error") or f"exit {r.get('exit')}"
            out.append(common.figure(str(r["scenario"]), passed=r["pass"], note=note))
            continue
        versus = r["versus"]
        out.append(
            common.figure(
                str(r["scenario"]),
                r["times_s"]["alkfs"],
                "s",
                baseline=f"{versus}, throughput",
                baseline_value=r["times_s"][versus],
                ratio=r["ratio"],
                target=f">= {r['target']:.2g}x",
                passed=r["pass"],
            )
        )
    return out


@dataclass
class Data:
    """The populated store and the plain copies of its bytes (cached under bench/out/)."""

    store: Path
    plain: Path
    large_key: Key
    git_src: Path
    git_loose: Path
    git_objects: int


def populate(sizes: Sizes, quick: bool, fresh: bool) -> Data:
    base = OUT / f"mount-data-{'quick' if quick else 'full'}"
    store, plain, done = base / "store", base / "plain", base / "done.json"
    src, loose, git_objects = build_git(sizes.git_commits)
    if fresh or not done.exists():
        shutil.rmtree(base, ignore_errors=True)
        plain.mkdir(parents=True)
        t0 = time.perf_counter()
        large_plain = plain / "large.bin"
        write_random(large_plain, sizes.large_mib << 20)
        with Alkfs.open(store) as app:
            with open(large_plain, "rb") as f:
                result = app.store.put(f)
            result.pin.release()
            # /objects/sha256 holds exactly ls_count entries: the large object and the ls set
            ls_plain = plain / "ls"
            put_files(app, ls_plain, Algorithm.SHA256, small_payloads(sizes.ls_count - 1, 100, 1))
            os.link(large_plain, ls_plain / result.key.hex)
            # /objects/blake3 holds exactly the small-read set
            small = small_payloads(sizes.small_count, 4096, 2)
            put_files(app, plain / "small", Algorithm.BLAKE3, small)
            imported = import_repo(app, str(src), "bench", progress=False)
        assert imported.objects == git_objects, (imported.objects, git_objects)
        done.write_text(json.dumps({"large_key": str(result.key)}) + "\n")
        print(f"  populated in {time.perf_counter() - t0:.1f}s (cached in {base})", flush=True)
    large_key = Key.parse(json.loads(done.read_text())["large_key"])
    print(
        f"  data: a {sizes.large_mib} MiB object, {sizes.ls_count:,} sha256 objects, "
        f"{sizes.small_count:,} blake3 objects of 4 KiB, {git_objects:,} git objects",
        flush=True,
    )
    return Data(store, plain, large_key, src, loose, git_objects)


class Bench:
    def __init__(self, sizes: Sizes, data: Data, work: Path, mounts: Mounts, report: Report):
        self.sizes, self.data, self.work, self.report = sizes, data, work, report
        self.runs = sizes.runs
        self.mnt = mounts.alkfsd(data.store, work / "mnt").mnt
        self.bind = mounts.bindfs(data.plain, work / "bind").mnt
        self.bind_objects = mounts.bindfs(data.git_loose / "objects", work / "bindobj").mnt
        self.cache = Cache(mounts, [data.plain / "large.bin", data.store / "large"])
        how = "drop_caches" if self.cache.drop else "remount + fadvise"
        print(f"  page cache dropped with {how}", flush=True)

    def large(self) -> None:
        sizes, data, runs = self.sizes, self.data, self.runs
        nbytes = sizes.large_mib << 20
        print(f"[1] sequential read of a {sizes.large_mib} MiB object (cat)", flush=True)
        paths = {
            "plain": data.plain / "large.bin",
            "bindfs": self.bind / "large.bin",
            "alkfs": self.mnt / "objects" / "sha256" / data.large_key.hex,
        }
        first = {n: median_time(f"cat '{p}'", runs, self.cache.cold) for n, p in paths.items()}
        self.report.line("first read", first, "bindfs", 0.5, nbytes)
        warm = {}
        for n, p in paths.items():
            timed(f"cat '{p}'")
            warm[n] = median_time(f"cat '{p}'", runs)
        self.report.line("repeated read", warm, "plain", 0.9, nbytes)

    def small(self) -> None:
        print(f"[2] {self.sizes.small_count:,} objects of 4 KiB (find | xargs cat)", flush=True)
        dirs = {
            "plain": self.data.plain / "small",
            "bindfs": self.bind / "small",
            "alkfs": self.mnt / "objects" / "blake3",
        }
        cmd = "find '{}' -type f -print0 | xargs -0 cat"
        cold = {n: median_time(cmd.format(d), self.runs, self.cache.cold) for n, d in dirs.items()}
        self.report.line("cold", cold, "bindfs", 1.0)
        warm = {n: median_time(cmd.format(d), self.runs) for n, d in dirs.items()}
        self.report.line("warm", warm, "bindfs", 1.0)

    def listing(self) -> None:
        print(f"[3] ls -l of a {self.sizes.ls_count:,}-entry directory", flush=True)
        dirs = {"plain": self.data.plain / "ls", "alkfs": self.mnt / "objects" / "sha256"}
        listed = {n: len(os.listdir(d)) for n, d in dirs.items()}
        assert listed["plain"] == listed["alkfs"] == self.sizes.ls_count, listed
        cmd = "LC_ALL=C ls -l '{}'"
        first = {n: median_time(cmd.format(d), self.runs, self.cache.cold) for n, d in dirs.items()}
        self.report.line("first listing", first, "plain", 1 / 3)
        warm = {n: median_time(cmd.format(d), self.runs) for n, d in dirs.items()}
        self.report.line("repeated listing", warm, "plain", 1 / 3)

    def git(self) -> None:
        data = self.data
        print(f"[4] git over {data.git_objects:,} objects", flush=True)
        repos = {
            "native": data.git_src,
            "bindfs": alternates_repo(
                self.work / "alt-bindfs.git", data.git_src, self.bind_objects
            ),
            "alkfs": alternates_repo(
                self.work / "alt-alkfs.git", data.git_src, self.mnt / "git" / "sha1"
            ),
        }
        # a fixed abbreviation: git sizes it from its object-count estimate (packs vs loose)
        base = ("-c", "core.abbrev=12")
        for args in ("rev-list --objects --all", "log --stat -n 2000"):
            digests = {
                n: hashlib.sha256(git(*base, f"--git-dir={r}", *args.split()).encode()).hexdigest()
                for n, r in repos.items()
            }
            if len(set(digests.values())) != 1:
                raise RuntimeError(f"git {args}: outputs differ: {digests}")
            cmd = "git " + " ".join(base) + " --git-dir='{}' " + args
            cold = {
                n: median_time(cmd.format(r), self.runs, self.cache.cold) for n, r in repos.items()
            }
            self.report.line(f"{args} (cold)", cold, "bindfs", 1.0)
            warm = {n: median_time(cmd.format(r), self.runs) for n, r in repos.items()}
            self.report.line(f"{args} (warm)", warm, "bindfs", 1.0)

    # -- writes: the two write benchmarks, run from here so one run covers the mount -----
    def writes(self) -> None:
        print("[5] writes into the mount (bench/mount_write.py)", flush=True)
        quick = ["--quick"] if self.sizes is QUICK else []
        self.child("writes (bench/mount_write.py)", [HERE / "mount_write.py", *quick])

    def push(self) -> None:
        print("[6] git push into the mount (bench/mount_push.py)", flush=True)
        quick = ["--objects", "5000"] if self.sizes is QUICK else []
        self.child("git push (bench/mount_push.py)", [HERE / "mount_push.py", *quick])

    def child(self, label: str, argv: list) -> None:
        """Run a benchmark script with --check; its targets pass if it exits 0."""
        done = subprocess.run([sys.executable, *map(str, argv), "--check"])
        self.report.rows.append(
            {"scenario": label, "exit": done.returncode, "pass": not done.returncode}
        )


SCENARIOS = {
    "1": Bench.large,
    "2": Bench.small,
    "3": Bench.listing,
    "4": Bench.git,
    "5": Bench.writes,
    "6": Bench.push,
}


def run(a: argparse.Namespace, work: Path, mounts: Mounts, report: Report) -> None:
    sizes = QUICK if a.quick else FULL
    print(
        f"bench/mount.py ({'quick' if a.quick else 'full'}): {os.cpu_count()} CPUs, "
        f"{subprocess.run(['uname', '-r'], capture_output=True, text=True).stdout.strip()}, "
        f"load average {os.getloadavg()[0]:.1f}, median of {sizes.runs} runs",
        flush=True,
    )
    data = populate(sizes, a.quick, a.fresh)
    bench = Bench(sizes, data, work, mounts, report)
    for name in a.only.split(","):
        try:
            SCENARIOS[name](bench)
        except Exception as exc:  # one broken scenario must not hide the others
            print(f"  scenario {name} FAILED: {type(exc).__name__}: {exc}", flush=True)
            report.rows.append({"scenario": name, "error": str(exc), "pass": False})


if __name__ == "__main__":
    sys.exit(main())
