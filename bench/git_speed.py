"""git through the mount with derived packs, against a native packed clone.

    python bench/git_speed.py [--commits 4000] [--runs 7] [--quick] [--versus DIR]

A generated history of realistic shape (deep directories, files edited a few lines at a
time, one long file edited by many commits; ~14 objects a commit) is imported into a fresh
store by the library (which leaves it packed), the store is mounted, and each command runs
warm against three sides, interleaved, medians of paired runs:

    N  the native bare clone, after `git gc` (pack, bitmap, commit-graph)
    A  a bare repository whose objects/info/alternates is MNT/git/sha1 (refs copied)
    R  MNT/repos/ID used as the repository (--git-dir)

Before anything is timed, the mount is brought to the state its own pipeline reaches
(`steady_state`): a push of 200 new commits into R, timed until every object of it is in
a listed (intake) pack; a consolidation (`echo repack > MNT/.alkfs/control`); then the
pushed branch deleted and a sweep, timed until the set the sweep publishes lists none of
the pushed objects outside the staged pack the set keeps them in (the daemon runs with
`--push-grace 1s`, so the push's pins are gone by then, and `--window 1h`: they are
staged, not deleted). `clone --no-local --bare`
clones each side (N and A by their paths, R as MNT/repos/ID) into a fresh directory
next to the native repository.

It prints the ratios A/N and R/N, the pack count and sizes of both sides, and the time
the import and the packing took. Commands under 50 ms native get at least 21 runs.

Then each command once more per side, `--first` rounds (default 3), as the first git run
after a mount: before each run of A or R the mount is stopped, the page cache dropped
(`sync; echo 3 > /proc/sys/vm/drop_caches`) and the mount started again (what a start
does, such as checking the published packs' trailers, is part of it); before each run of
N the page cache is dropped. Medians of the per-round ratios.

`--versus DIR` also mounts a copy of the store with the daemon found on DIR (put first
on PYTHONPATH: e.g. `mkdir -p /tmp/old && git archive HEAD~3 alkfs daemon | tar -x -C
/tmp/old && ln -s daemon /tmp/old/alkfsd`) and times its A and R in the same rounds
(columns A0/N, R0/N): a before/after comparison under the same load. `--versus-env
NAME=VALUE` (repeatable) sets that daemon's environment: `PYFUSE3_NEXT_WAIT_NS=0` turns
off the fast-read patch's short wait for the next request, so an older tree (which does
not use pyfuse3-cacheddirs.patch either) runs as it did before both.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
from common import BIN, Mount

ROOT = Path(__file__).resolve().parents[1]
CLONES = Path(tempfile.gettempdir())  # (set under the run's directory by main)
PUSH_GRACE_S = 1  # the daemon's --push-grace: the steady state's sweep reaches a push
GIT_ENV = {
    **os.environ,
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_PAGER": "cat",
}


def git(*args: str, input: bytes | None = None) -> bytes:
    return subprocess.run(
        ["git", *args], input=input, capture_output=True, check=True, env=GIT_ENV
    ).stdout


def generate(path: Path, commits: int, seed: int = 7) -> None:
    """A bare repository: `commits` commits over ~600 files in 3-4 levels of directories."""
    rng = random.Random(seed)
    git("init", "-q", "--bare", "-b", "main", str(path))
    dirs = [f"pkg{a}/sub{b}/mod{c}" for a in range(6) for b in range(5) for c in range(4)]
    files = {f"{d}/file{k}.py": None for d in dirs for k in range(5)}
    names = list(files)
    content = {n: [f"# {n} line {i}\n" for i in range(rng.randint(20, 120))] for n in names}
    long_name = "docs/LONG.txt"
    content[long_name] = [f"long line {i}\n" for i in range(3000)]
    out = []
    for i in range(commits):
        out.append(b"commit refs/heads/main\n")
        out.append(f"committer C O Mitter <c@example.com> {1600000000 + 60 * i} +0000\n".encode())
        msg = f"change {i}\n".encode()
        out.append(b"data %d\n%s" % (len(msg), msg))
        touched = rng.sample(names, 3) if i else [*names, long_name]
        if i and i % 5 == 0:
            touched.append(long_name)
        for n in touched:
            lines = content[n]
            if i:
                for _ in range(rng.randint(1, 4)):
                    lines[rng.randrange(len(lines))] = f"# edit {i} {rng.random()}\n"
                if rng.random() < 0.3:
                    lines.insert(rng.randrange(len(lines)), f"# added in {i}\n")
            data = "".join(lines).encode()
            out.append(b"M 100644 inline %s\ndata %d\n%s\n" % (n.encode(), len(data), data))
    git("-C", str(path), "fast-import", "--quiet", input=b"".join(out))


COMMANDS = {
    "log --oneline": ["log", "--oneline"],
    "log -p -n 200": ["log", "-p", "-n", "200"],
    "log --stat -n 2000": ["log", "--stat", "-n", "2000"],
    "rev-list --objects --all": ["rev-list", "--objects", "--all"],
    "cat-file --batch-all-objects --batch-check": [
        "cat-file",
        "--batch-all-objects",
        "--batch-check",
    ],
    "blame docs/LONG.txt": ["blame", "main", "--", "docs/LONG.txt"],
    "fsck --connectivity-only": ["fsck", "--connectivity-only"],
    # (no --git-dir: SIDE is the source; DEST a fresh directory, removed after each run)
    "clone --no-local --bare": ["clone", "-q", "--no-local", "--bare", "{side}", "{dest}"],
}


def timed(gitdir: Path, args: list[str]) -> float:
    """Seconds of one `git --git-dir=GITDIR ARGS`, or, when ARGS name `{side}`, of `git
    ARGS` with `{side}` the repository and `{dest}` a new directory (removed untimed)."""
    dest = None
    if "{side}" in args:
        dest = Path(tempfile.mkdtemp(prefix="clone-", dir=CLONES)) / "dest.git"
        argv = [str(gitdir) if a == "{side}" else str(dest) if a == "{dest}" else a for a in args]
        argv = ["git", *argv]
    else:
        argv = ["git", f"--git-dir={gitdir}", *args]
    t0 = time.perf_counter()
    subprocess.run(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=GIT_ENV
    )
    took = time.perf_counter() - t0
    if dest is not None:
        shutil.rmtree(dest.parent)
    return took


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def first_runs(mount: Mount, sides: dict[str, Path], rounds: int) -> dict:
    """Each command, `rounds` times per side, as the first run after a (re)mount with the
    page cache dropped (see the module docstring): {command: {N_ms, A, R, A_ms, R_ms}}."""
    out: dict = {}
    others = [k for k in sides if k != "N"]
    print(f"first run after mount, caches dropped ({rounds} rounds); columns as above")
    for name, cmd in COMMANDS.items():
        t: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(rounds):
            for k, side in sides.items():
                if k != "N":
                    mount.stop()
                drop_caches()
                if k != "N":
                    mount.start()
                t[k].append(timed(side, cmd))
        med = {k: statistics.median(v) for k, v in t.items()}
        ratio = {
            k: statistics.median(x / n for x, n in zip(t[k], t["N"], strict=True)) for k in others
        }
        out[name] = {
            "native_ms": med["N"] * 1e3,
            **ratio,
            **{f"{k}_ms": med[k] * 1e3 for k in others},
        }
        print(
            f"{name:45} {med['N'] * 1e3:10.1f} "
            + " ".join(f"{ratio[k]:6.2f}" for k in others)
            + " "
            + " ".join(f"{med[k] * 1e3:8.1f}" for k in others)
        )
    return out


def packs_of(objdir: Path) -> tuple[int, int]:
    pack = objdir / "pack"
    names = [n for n in os.listdir(pack) if n.endswith(".pack")]
    return len(names), sum((pack / n).stat().st_size for n in names)


def listed_packs(mnt: Path) -> dict[str, set[str]]:
    """Each listed idx's object ids (`git show-index`)."""
    out: dict[str, set[str]] = {}
    pack = mnt / "git" / "sha1" / "pack"
    for name in os.listdir(pack):
        if name.endswith(".idx"):
            try:
                with open(pack / name, "rb") as f:
                    text = subprocess.run(
                        ["git", "show-index"], stdin=f, capture_output=True, check=True
                    ).stdout.decode()
            except FileNotFoundError:
                continue
            out[name] = {line.split()[1] for line in text.splitlines()}
    return out


def listed_ids(mnt: Path) -> set[str]:
    return set().union(*listed_packs(mnt).values())


def in_a_pack_of_their_own(mnt: Path, ids: set[str]) -> bool:
    """Whether one listed pack holds every one of `ids` and no other pack holds any: the
    staged pack a set keeps objects staged for deletion in (alkfs/git/packs/)."""
    holding = [got for got in listed_packs(mnt).values() if got & ids]
    return len(holding) == 1 and ids <= holding[0]


def alternates_user(path: Path, mnt: Path, refs: bytes) -> Path:
    """A bare repository whose objects/info/alternates is MNT/git/sha1, with `refs`."""
    git("init", "-q", "--bare", "-b", "main", str(path))
    (path / "objects" / "info" / "alternates").write_text(f"{mnt}/git/sha1\n")
    git(f"--git-dir={path}", "update-ref", "--stdin", input=refs)
    return path


def control(mnt: Path, command: str) -> None:
    """One command through MNT/.alkfs/control (returns when it has run)."""
    with open(mnt / ".alkfs" / "control", "w") as f:
        f.write(command + "\n")


def wait_for(pred, what: str, timeout: float = 300) -> float:
    """Seconds until `pred()` holds (polled every 50 ms); inf after `timeout`."""
    t0 = time.perf_counter()
    while not pred():
        time.sleep(0.05)
        if time.perf_counter() - t0 > timeout:
            print(f"{what}: not within {timeout:.0f} s")
            return float("inf")
    took = time.perf_counter() - t0
    print(f"{what}: {took:.2f} s")
    return took


def steady_state(src: Path, repo: Path, mnt: Path) -> dict:
    """Bring the mount to the state the daemon's own pipeline reaches, not the import's
    first set: push 200 new commits into MNT/repos/ID and time until every object of it
    is in a listed pack (the intake; the daemon runs with ALKFS_PACK_EVERY=1), run a
    consolidation (`repack`), then delete the pushed branch and sweep: the sweep stages
    its objects and a set with them in a pack of their own is published (a rewrite of
    the packs that held them; the sweep that deletes them only drops that pack), timed
    until one listed pack holds all of them and no other any. The sides then have the
    same refs."""
    work = src.parent / f"push-{mnt.name}.git"
    git("clone", "-q", "--bare", str(src), str(work))
    out = []
    for i in range(200):
        out.append(b"commit refs/heads/pushed\n")
        out.append(b"committer C O Mitter <c@example.com> 1700000000 +0000\n")
        msg = b"pushed %d\n" % i
        out.append(b"data %d\n%s" % (len(msg), msg))
        if i == 0:
            out.append(b"from refs/heads/main\n")
        data = b"pushed file %d\n" % i * 20
        out.append(b"M 100644 inline pushed/f%d.txt\ndata %d\n%s\n" % (i % 10, len(data), data))
    git("-C", str(work), "fast-import", "--quiet", input=b"".join(out))
    new = set(git(f"--git-dir={work}", "rev-list", "--objects", "pushed", "^main").decode().split())
    new = {x for x in new if len(x) == 40}
    git(f"--git-dir={work}", "push", "-q", str(repo), "pushed")
    took: dict = {"pushed_objects": len(new)}
    took["time_to_packed_s"] = wait_for(
        lambda: new <= listed_ids(mnt), f"a push of {len(new)} objects packed after it returned"
    )
    t0 = time.perf_counter()
    control(mnt, "repack")
    took["consolidation_s"] = time.perf_counter() - t0
    print(f"consolidation (repack): {took['consolidation_s']:.2f} s")
    git(f"--git-dir={repo}", "update-ref", "-d", "refs/heads/pushed")
    time.sleep(PUSH_GRACE_S + 0.5)  # (the push's pins go after the grace)
    t0 = time.perf_counter()
    control(mnt, "sweep")
    waited = wait_for(
        lambda: in_a_pack_of_their_own(mnt, new),
        "after the sweep returned, a set with them in a pack of their own",
    )
    took["sweep_to_rewritten_s"] = waited if waited == float("inf") else time.perf_counter() - t0
    print(
        "sweep to a set with the pushed objects in a pack of their own: "
        f"{took['sweep_to_rewritten_s']:.2f} s"
    )
    return took


def figures(results: dict) -> list[dict]:
    """bench/results/ figures: each command, warm and first run, per side against N. The
    script judges nothing (the targets are docs/performance.md's)."""
    out = []
    for when, table in (("warm", results), ("first run", results.get("first_run", {}))):
        for name in COMMANDS:
            row = table.get(name)
            if not isinstance(row, dict):
                continue
            for k in row:
                if k.endswith("_ms") and k != "native_ms":
                    side = k.removesuffix("_ms")
                    out.append(
                        common.figure(
                            f"{name}, {when}, {side}",
                            row[k],
                            "ms",
                            baseline="N, a native packed clone",
                            baseline_value=row["native_ms"],
                            ratio=row.get(side),
                        )
                    )
    for key, what in (
        ("time_to_packed_s", "a push into R until it is in a listed pack"),
        ("sweep_to_rewritten_s", "a sweep until the set with its staged pack is listed"),
    ):
        if key in results:
            out.append(common.figure(what, results[key], "s"))
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--commits", type=int, default=4000)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--first", type=int, default=3, help="first-run rounds (0: none)")
    p.add_argument("--versus", type=Path, help="a source tree to compare with (A0, R0)")
    p.add_argument(
        "--versus-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="the versus daemon's environment (e.g. PYFUSE3_NEXT_WAIT_NS=0)",
    )
    args = p.parse_args()
    if args.quick:
        args.commits, args.runs, args.first = 400, 3, 1
    tmp = Path(tempfile.mkdtemp(prefix="alkfs-git-speed-"))
    global CLONES
    CLONES = tmp / "clones"  # (on the native side's disk)
    CLONES.mkdir()
    mount = versus = None
    try:
        src = tmp / "src.git"
        t0 = time.perf_counter()
        generate(src, args.commits)
        native = tmp / "native.git"
        git("clone", "-q", "--bare", "--no-local", str(src), str(native))
        git(f"--git-dir={native}", "gc", "-q")
        total = len(git(f"--git-dir={native}", "rev-list", "--objects", "--all").splitlines())
        print(
            f"history: {total} objects, {args.commits} commits ({time.perf_counter() - t0:.1f} s)"
        )
        sys.path.insert(0, str(ROOT))
        from alkfs.app import Alkfs
        from alkfs.git.importer import import_repo
        from alkfs.git.packs import derived_for

        store = tmp / "store"
        with Alkfs.open(store, window_s=3600) as app:
            t0 = time.perf_counter()
            import_repo(app, str(src), "bench", progress=False)
            took = time.perf_counter() - t0
            d = derived_for(app.store, "sha1")
            build = d.last_build
            print(
                f"import incl. packing: {took:.2f} s; packing alone {build.seconds:.2f} s "
                f"({build.objects} objects, mode {build.mode})"
            )
        mnt = tmp / "mnt"
        os.environ["ALKFS_PACK_EVERY"] = "1"  # the intake pack of the push below
        refs = git(f"--git-dir={src}", "for-each-ref", "--format=update %(refname) %(objectname)")
        sides = {"N": native}
        if args.versus is not None:
            shutil.copytree(store, tmp / "store0", symlinks=True)
            versus = Mount(
                "alkfsd (versus)",
                [
                    "env",
                    f"PYTHONPATH={args.versus.resolve()}",
                    *args.versus_env,
                    str(BIN / "python"),
                    "-m",
                    "alkfsd.main",
                    str(tmp / "store0"),
                    str(tmp / "mnt0"),
                    "--create",
                    "--window",
                    "1h",
                    "--push-grace",
                    f"{PUSH_GRACE_S}s",
                ],
                tmp / "mnt0",
                tmp / "alkfsd0.log",
            )
            versus.start()
            sides["A0"] = alternates_user(tmp / "alt0.git", tmp / "mnt0", refs)
            sides["R0"] = tmp / "mnt0" / "repos" / "bench"
            print("versus:")
            steady_state(src, sides["R0"], tmp / "mnt0")
        mount = Mount(
            "alkfsd",
            [
                str(BIN / "python"),
                "-m",
                "alkfsd.main",
                str(store),
                str(mnt),
                "--create",
                "--window",
                "1h",
                "--push-grace",
                f"{PUSH_GRACE_S}s",
            ],
            mnt,
            tmp / "alkfsd.log",
        )
        mount.start()
        alt = alternates_user(tmp / "alt.git", mnt, refs)
        repo = mnt / "repos" / "bench"
        sides["A"], sides["R"] = alt, repo
        steady = steady_state(src, repo, mnt)
        n_packs, n_bytes = packs_of(native / "objects")
        m_packs, m_bytes = packs_of(mnt / "git" / "sha1")
        print(
            f"native: {n_packs} pack(s), {n_bytes / 1e6:.1f} MB, bitmap "
            f"{'yes' if list((native / 'objects/pack').glob('*.bitmap')) else 'no'}, "
            f"commit-graph {'yes' if (native / 'objects/info/commit-graph').exists() else 'no'}"
        )
        print(
            f"mount:  {m_packs} pack(s), {m_bytes / 1e6:.1f} MB, bitmap no, commit-graph "
            f"{'yes (split chain)' if (mnt / 'git/sha1/info/commit-graphs').exists() else 'no'}"
        )
        results: dict = {"load": os.getloadavg()[0], "packs": [m_packs, m_bytes, n_packs, n_bytes]}
        others = [k for k in sides if k != "N"]
        print(
            f"{'command':45} {'native ms':>10} "
            + " ".join(f"{k + '/N':>6}" for k in others)
            + " "
            + " ".join(f"{k + ' ms':>8}" for k in others)
        )
        for name, cmd in COMMANDS.items():
            for side in sides.values():  # warm every side first
                timed(side, cmd)
            base = timed(native, cmd)
            runs = max(args.runs, 21 if base < 0.05 else args.runs)
            t: dict[str, list[float]] = {k: [] for k in sides}
            for _ in range(runs):
                for k, side in sides.items():
                    t[k].append(timed(side, cmd))
            med = {k: statistics.median(v) for k, v in t.items()}
            ratio = {
                k: statistics.median(x / n for x, n in zip(t[k], t["N"], strict=True))
                for k in others
            }
            results[name] = {
                "native_ms": med["N"] * 1e3,
                **ratio,
                **{f"{k}_ms": med[k] * 1e3 for k in others},
                "runs": runs,
            }
            print(
                f"{name:45} {med['N'] * 1e3:10.1f} "
                + " ".join(f"{ratio[k]:6.2f}" for k in others)
                + " "
                + " ".join(f"{med[k] * 1e3:8.1f}" for k in others)
            )
        results["load_after"] = os.getloadavg()[0]
        print(f"load average {results['load']:.1f} before, {results['load_after']:.1f} after")
        if args.first:
            cold = {"N": native, "A": alt, "R": repo}  # (not the --versus sides)
            results["first_run"] = first_runs(mount, cold, args.first)
            if versus is not None:  # the same rounds of the versus daemon (A0, R0)
                cold0 = {"N": native, "A0": sides["A0"], "R0": sides["R0"]}
                results["first_run_versus"] = first_runs(versus, cold0, args.first)
        results.update(steady)
        out = ROOT / "bench" / "out" / ("git-speed-quick.json" if args.quick else "git-speed.json")
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
        # (a history of a million objects or more has a results file of its own, so the
        # table shows both sizes)
        variant = "million" if total >= 1_000_000 else ""
        common.record(figures(results), quick=args.quick, variant=variant)
        return 0
    finally:
        for m in (mount, versus):
            if m is not None:
                m.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
