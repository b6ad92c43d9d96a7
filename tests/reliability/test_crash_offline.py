"""The crash matrix of the offline command line (tests/reliability/test_crash_matrix.py
kills the daemon; these kill `alkfs --store STORE ...`): the process is SIGKILLed at a
seeded point, then the crash image is checked, the command is completed, and the store is
checked offline and through a real mount.

- `git import` as a pack: a generated repository (about 3,000 objects, 300 commits each
  editing nested files, so that the pack has deltas) imported into a store that holds
  another repository already;
- `sweep` deleting the objects of a removed fork that an import packed alone (the sweep
  publishes the set without that pack: mode "drop-packs").

The git processes the command line runs (pack-objects, index-pack, multi-pack-index,
commit-graph) are started in sessions of their own, so killing the command's process
group does not reach them. A round either kills the whole process tree at one instant
(every process stopped first, then all killed: a crash) or kills only the command's
group and lets its gits run on as orphans until they end (the OOM killer's kill), before
anything is checked. The delay is drawn over the measured duration of an uninterrupted
run; most draws land past the interpreter's start and the store's open (their duration
is measured too), where the command works.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from crash_helpers import (
    SOAK,
    alkfs_cli,
    check_derived_image,
    git,
    integrity_check,
    iterations,
    seeded,
    wait_until,
)

pytestmark = pytest.mark.timeout(4 * 3600 if SOAK else 600)


# -- repositories ---------------------------------------------------------------------------------


def source_repo(path: Path, rng, commits: int, tag: str) -> Path:
    """A bare repository made by git fast-import: a first commit of 288 files (30 lines
    each) in TAG/d*/e*/, then `commits - 1` commits each changing one line of two of
    them (deltas), a branch every 50 commits, an annotated and a lightweight tag."""
    git("init", "-q", "--bare", "-b", "main", str(path))
    files = {
        f"{tag}/d{a}/e{b}/f{c}.txt": [
            f"{tag} line {k} of d{a}/e{b}/f{c} {rng.random()}\n" for k in range(30)
        ]
        for a in range(6)
        for b in range(4)
        for c in range(12)
    }
    names = sorted(files)
    out = []

    def commit(i: int, paths: list[str]) -> None:
        msg = f"{tag} commit {i}\n"
        out.append(f"commit refs/heads/main\nmark :{i + 1}\n")
        out.append(f"committer C O Mitter <c@example.com> {1700000000 + i} +0000\n")
        out.append(f"data {len(msg)}\n{msg}")
        for p in paths:
            data = "".join(files[p])
            out.append(f"M 100644 inline {p}\ndata {len(data.encode())}\n{data}\n")

    commit(0, names)
    for i in range(1, commits):
        paths = rng.sample(names, 2)
        for p in paths:
            files[p][rng.randrange(30)] = f"{tag} edit {i} {rng.random()}\n"
        commit(i, paths)
        if i % 50 == 25:
            out.append(f"reset refs/heads/b{i}\nfrom :{i + 1}\n\n")
    out.append(f"tag v1\nfrom :{commits // 2}\n")
    out.append("tagger T <t@example.com> 1700000000 +0000\ndata 4\nv1!\n")
    out.append(f"reset refs/tags/light\nfrom :{commits // 3}\n\n")
    git(f"--git-dir={path}", "fast-import", "--quiet", input="".join(out).encode())
    return path


def ref_values(git_dir: Path) -> dict[str, str]:
    out = git("--git-dir", str(git_dir), "for-each-ref", "--format=%(refname) %(objectname)")
    return dict(line.split(" ") for line in out.splitlines())


def store_repos(store: Path) -> dict[str, dict[str, str]]:
    """{repository: {ref: oid}} of STORE/store.db, read-only (no process holds it)."""
    con = sqlite3.connect(f"file:{store / 'store.db'}?mode=ro", uri=True)
    try:
        out: dict[str, dict[str, str]] = {
            r: {} for (r,) in con.execute("SELECT id FROM git_repos").fetchall()
        }
        for repo, name, oid in con.execute("SELECT repo, name, oid FROM git_refs"):
            out[repo][name] = oid
    finally:
        con.close()
    return out


def packed_objects(store: Path) -> set[str]:
    """Every object id the published set's packs hold (git verify-pack -v of each idx)."""
    root = store / "derived" / "sha1"
    gen = root / f"gen-{int((root / 'CURRENT').read_text())}"
    out: set[str] = set()
    for idx in gen.rglob("*.idx"):
        for line in git("verify-pack", "-v", str(idx)).splitlines():
            word = line.split(" ", 1)[0]
            if len(word) == 40 and all(c in "0123456789abcdef" for c in word):
                out.add(word)
    return out


def published_meta(store: Path) -> dict:
    root = store / "derived" / "sha1"
    return json.loads(
        (root / f"gen-{int((root / 'CURRENT').read_text())}" / "alkfs.json").read_text()
    )


# -- the command line, killed --------------------------------------------------------------------


def cli_ok(*args: str) -> str:
    done = alkfs_cli(*map(str, args))
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


def timed(*args: str) -> float:
    t0 = time.monotonic()
    cli_ok(*args)
    return time.monotonic() - t0


def start_cli(log: Path, *args: str) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "alkfs.cli", *map(str, args)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def descendants(pid: int) -> set[int]:
    """The processes below `pid` (any session), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def ended(pid: int) -> bool:
    try:
        state = Path("/proc", str(pid), "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill_cli(proc: subprocess.Popen, delay: float, orphans: bool) -> dict:
    """SIGKILL the command `delay` seconds after it started (or once it ended). Its group
    is stopped first, then every process below it (its gits run in sessions of their
    own), until no new one appears. Then either everything is killed at once, or (with
    `orphans`) only the command's group, its gits left to run on until they end. Returns
    what the kill met, for the round's line."""
    wait_until(lambda: proc.poll() is not None, delay)
    mid = proc.poll() is None
    try:
        os.killpg(proc.pid, signal.SIGSTOP)
    except ProcessLookupError:
        pass
    below: set[int] = set()
    while True:
        new = descendants(proc.pid) - below
        if not new:
            break
        for pid in new:
            signal_pid(pid, signal.SIGSTOP)
        below |= new
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    rc = proc.wait(timeout=30)
    gits = sorted(below)
    for pid in gits:
        signal_pid(pid, signal.SIGCONT if orphans else signal.SIGKILL)
    assert wait_until(lambda: all(ended(p) for p in gits), 120), gits
    return {"mid": mid, "rc": rc, "children": len(gits), "orphans": orphans}


def kill_delay(rng, t_open: float, t_run: float) -> float:
    """A quarter of the draws over the whole run, the rest past 90% of the store's open."""
    if rng.random() < 0.25:
        return rng.uniform(0.0, t_run)
    return rng.uniform(min(0.9 * t_open, t_run), t_run)


# -- offline and mounted checks -------------------------------------------------------------------


def verify_offline(store: Path) -> None:
    done = alkfs_cli("--store", str(store), "verify")
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert json.loads(done.stdout) == {"corrupt": []}


def stale_tmp(store: Path) -> list[str]:
    root = store / "derived" / "sha1"
    return sorted(p.name for p in root.iterdir() if p.name.startswith("tmp-"))


def check_through_mount(
    start_mount, store: Path, work: Path, want: dict[str, dict], gone: set[str] = frozenset()
) -> None:
    """Mount the store; `git clone --mirror --no-local` each repository of `want` (every
    object through the mount, upload-pack's walk), stop the daemon (exit 0, no traceback);
    then `git fsck --full --strict` of each clone and its refs exactly as wanted. The
    objects `gone` are not in the store (MNT/objects/git-sha1/HEX)."""
    m = start_mount(store)
    try:
        assert sorted(os.listdir(m.path("repos"))) == sorted(want)
        there = [h for h in sorted(gone) if os.path.lexists(m.path("objects", "git-sha1", h))]
        assert there == []
        for refs in want.values():  # (the same look finds what the store holds)
            assert os.path.lexists(m.path("objects", "git-sha1", refs["refs/heads/main"]))
        for repo in want:
            git("clone", "-q", "--mirror", "--no-local", str(m.path("repos", repo)), work / repo)
    finally:
        assert m.stop() == 0, m.log()
    assert m.tracebacks() == [], m.log()
    for repo, refs in want.items():
        git("--git-dir", str(work / repo), "fsck", "--full", "--strict", "--no-dangling")
        assert ref_values(work / repo) == refs, repo
        assert git("--git-dir", str(work / repo), "symbolic-ref", "HEAD").strip() == (
            "refs/heads/main"
        )


# -- git import as a pack ---------------------------------------------------------------------------


def test_crash_during_git_import_as_a_pack(start_mount, tmp_path):
    """`alkfs --store STORE git import SRC --repo src` (300 commits, ~3,000 objects) into a
    copy of a store holding the repository `first`, killed at a seeded delay. The crash
    image: store.db's integrity, the published set verifies, `first`'s refs unchanged,
    `src`'s refs none or all the source's. Then the import run again exits 0 with every
    ref the source's, `verify` is clean, no build directory is left, and through a mount
    both repositories clone whole (fsck --full --strict) with their refs."""
    first = source_repo(tmp_path / "first.git", seeded("import", -1), 60, "first")
    src = source_repo(tmp_path / "src.git", seeded("import", -2), 300, "src")
    first_refs, src_refs = ref_values(first), ref_values(src)
    assert len(src_refs) == 9 and len(first_refs) == 4
    template = tmp_path / "template"
    cli_ok("--store", template, "git", "import", first, "--repo", "first")
    assert store_repos(template) == {"first": first_refs}

    measured = tmp_path / "measured"
    shutil.copytree(template, measured, symlinks=True)
    t_open = timed("--store", measured, "staged")
    t_run = timed("--store", measured, "git", "import", src, "--repo", "src")
    assert store_repos(measured) == {"first": first_refs, "src": src_refs}
    assert published_meta(measured)["mode"] == "adopt"
    print(f"import: store open {t_open:.2f} s, whole import {t_run:.2f} s")
    shutil.rmtree(measured)

    for i in range(iterations()):
        rng = seeded("import", i)
        store = tmp_path / f"store-{i}"
        shutil.copytree(template, store, symlinks=True)
        delay = kill_delay(rng, t_open, t_run)
        proc = start_cli(
            tmp_path / f"import-{i}.log", "--store", store, "git", "import", src, "--repo", "src"
        )
        kill = kill_cli(proc, delay, orphans=rng.random() < 0.3)
        integrity_check(store)
        check_derived_image(store)
        repos = store_repos(store)
        assert repos["first"] == first_refs
        assert repos.get("src", {}) in ({}, src_refs), repos.get("src")
        print(
            f"import {i}: killed at {delay:.3f} s {kill}, src refs: "
            f"{'none' if 'src' not in repos else len(repos['src'])}, "
            f"left: {stale_tmp(store) if (store / 'derived' / 'sha1').exists() else '-'}"
        )
        cli_ok("--store", store, "git", "import", src, "--repo", "src")
        assert store_repos(store) == {"first": first_refs, "src": src_refs}
        check_derived_image(store)
        assert stale_tmp(store) == []
        verify_offline(store)
        integrity_check(store)
        check_through_mount(
            start_mount, store, tmp_path / f"clones-{i}", {"first": first_refs, "src": src_refs}
        )
        shutil.rmtree(store)
        shutil.rmtree(tmp_path / f"clones-{i}")


# -- repository removal and the sweep that drops its pack --------------------------------------------


def fork_of(upstream: Path, fork: Path, commits: int) -> set[str]:
    """A mirror of `upstream` with `commits` own commits on main (a few new files each);
    the ids of the objects only the fork has."""
    git("clone", "-q", "--mirror", "--no-local", str(upstream), str(fork))
    out = []
    for i in range(commits):
        msg = f"fork {i}\n"
        out.append("commit refs/heads/main\n")
        out.append(f"committer C O Mitter <c@example.com> {1800000000 + i} +0000\n")
        out.append(f"data {len(msg)}\n{msg}")
        if i == 0:
            out.append("from refs/heads/main^0\n")
        for f in range(3):
            data = f"the fork's own file {i}/{f}\n" * (f + 1)
            out.append(f"M 100644 inline own/c{i}/f{f}.txt\ndata {len(data)}\n{data}\n")
    git(f"--git-dir={fork}", "fast-import", "--quiet", input="".join(out).encode())
    upstream_main = ref_values(upstream)["refs/heads/main"]
    listed = git("--git-dir", str(fork), "rev-list", "--objects", "main", f"^{upstream_main}")
    return {line.split(" ", 1)[0] for line in listed.splitlines()}


def test_crash_during_the_sweep_that_drops_a_removed_forks_pack(start_mount, tmp_path):
    """A store holding `upstream` and its fork (imported after it: the fork's own objects
    are a pack of their own); `repo rm fork`, `sweep --window 0` (stages them), then the
    second sweep (deletes them, publishing the set without that pack: "drop-packs") is
    killed at a seeded delay, in a fresh copy of the store each round. The crash image:
    integrity, the published set verifies, upstream's refs unchanged. Then two sweeps exit
    0 and leave none of the fork's own objects in a pack, `verify` is clean, and through a
    mount upstream clones whole (fsck --full --strict) with its refs."""
    upstream = source_repo(tmp_path / "upstream.git", seeded("drop", -1), 150, "up")
    up_refs = ref_values(upstream)
    fork = tmp_path / "fork.git"
    own = fork_of(upstream, fork, 3)
    assert len(own) == 3 * 7  # a commit, its root tree, own/, own/cN and three blobs
    template = tmp_path / "template"
    cli_ok("--store", template, "git", "import", upstream, "--repo", "upstream")
    cli_ok("--store", template, "git", "import", fork, "--repo", "fork")
    assert own <= packed_objects(template)
    cli_ok("--store", template, "repo", "rm", "fork")
    staged = json.loads(cli_ok("--store", template, "sweep", "--window", "0"))
    assert (staged["aborted"], staged["candidates_staged"]) == (None, len(own))
    assert store_repos(template) == {"upstream": up_refs}

    measured = tmp_path / "measured"
    shutil.copytree(template, measured, symlinks=True)
    t_open = timed("--store", measured, "staged")
    t0 = time.monotonic()
    report = json.loads(cli_ok("--store", measured, "sweep", "--window", "0"))
    t_run = time.monotonic() - t0
    assert (report["aborted"], report["deleted"]) == (None, len(own))
    assert published_meta(measured)["mode"] == "drop-packs"
    assert packed_objects(measured) & own == set()
    print(f"drop: store open {t_open:.2f} s, whole sweep {t_run:.2f} s")
    shutil.rmtree(measured)

    for i in range(iterations()):
        rng = seeded("drop", i)
        store = tmp_path / f"store-{i}"
        shutil.copytree(template, store, symlinks=True)
        delay = kill_delay(rng, t_open, t_run)
        proc = start_cli(tmp_path / f"sweep-{i}.log", "--store", store, "sweep", "--window", "0")
        kill = kill_cli(proc, delay, orphans=rng.random() < 0.3)
        integrity_check(store)
        check_derived_image(store)
        assert store_repos(store) == {"upstream": up_refs}
        mode = published_meta(store)["mode"]
        print(f"drop {i}: killed at {delay:.3f} s {kill}, published mode {mode}")
        deleted = 0
        for _ in range(2):
            report = json.loads(cli_ok("--store", store, "sweep", "--window", "0"))
            assert report["aborted"] is None, report
            deleted += report["deleted"]
        assert deleted <= len(own)
        assert packed_objects(store) & own == set()
        check_derived_image(store)
        assert stale_tmp(store) == []
        verify_offline(store)
        integrity_check(store)
        check_through_mount(
            start_mount, store, tmp_path / f"clones-{i}", {"upstream": up_refs}, gone=own
        )
        shutil.rmtree(store)
        shutil.rmtree(tmp_path / f"clones-{i}")
