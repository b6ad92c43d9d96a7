"""The crash matrix: alkfsd SIGKILLed at seeded random points during each kind of write,
then restarted on the same store and mountpoint and checked.

Each case runs `iterations()` rounds (5 by default, 50 with ALKFS_SOAK=1: `make soak`).
A round starts a client (crash_helpers.Client: real cp, rsync, git, ln, mv, setfattr, one
op after the other, logging each op once it has succeeded), kills the daemon at a point
`random.Random(seed)` chose (a delay, or a byte count of a large write's staging file),
and then checks:

- the crash image: `PRAGMA integrity_check` of store.db (read-only, no daemon) is ok;
- after the restart: no staging, spool or scratch file left, `verify` through the
  control file finds nothing corrupt;
- every op the client logged is there (pins byte-identical to their sources, refs at
  their new values, pushed commits with their whole closure), and what the op in flight
  touched is old or new, never anything else;
- at the end of the case (the daemon stopped cleanly): `alkfs --store STORE verify`
  exits 0 with nothing corrupt, integrity_check is ok, no residue. (While the daemon
  runs, `alkfs --store` is refused: checked once per case.)
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from crash_helpers import (
    SOAK,
    Client,
    alkfs_cli,
    assert_cli_refused_while_mounted,
    check_derived_image,
    control,
    crash_restart,
    git,
    integrity_check,
    iterations,
    kill_after,
    kill_at_op,
    kill_now,
    make_commits,
    objects_of,
    offline_checks,
    seeded,
    start,
    wait_until,
)
from helpers import pin_target

pytestmark = pytest.mark.timeout(4 * 3600 if SOAK else 600)

MIB = 1 << 20
DEAD = 2500  # dead kv objects staged for each round of the sweep case
HEX40 = re.compile("[0-9a-f]{40}")
RSYNC_TEMP = re.compile(r"\.(.+)\.[A-Za-z0-9]{6}\Z")  # rsync's temporary of a file NAME


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pin_listing(m) -> dict[str, str]:
    """/pins as {name: the sha256 hex it names} (a link's target, or a file's key)."""
    out = {}
    for name in os.listdir(m.path("pins")):
        target = pin_target(m.path("pins", name))
        assert target.startswith("../objects/sha256/"), (name, target)
        out[name] = target.rsplit("/", 1)[1]
    return out


class PinWrites:
    """The expected /pins of the cases that create pins by writing files: every op is a
    group of (name, bytes); after a crash the pins of ops[:done] are all there, those of
    ops[done] each there or not, nothing else; each one there is byte-identical. A file
    rsync closed (acknowledged) before the crash and had not renamed yet stays as its
    temporary `.NAME.XXXXXX`, a pin like any other (any file name in /pins is a pin's): of
    ops[done] only, it holds NAME's bytes whole."""

    def __init__(self) -> None:
        self.kept: dict[str, str] = {}  # name -> digest, of every op known done

    def check(self, m, groups: list[list[tuple[str, bytes]]], done: int) -> None:
        listing = pin_listing(m)
        maybe = dict(groups[done]) if done < len(groups) else {}
        ongoing = set(maybe)  # the names of the op under way
        for group in groups[:done]:
            for name, data in group:
                self.kept[name] = sha(data)
        assert set(self.kept) <= set(listing), sorted(set(self.kept) - set(listing))
        extra = set(listing) - set(self.kept)
        for name in extra:
            temp = RSYNC_TEMP.match(name)
            if temp is not None and temp[1] in ongoing:
                maybe[name] = maybe[temp[1]]
        assert extra <= set(maybe), sorted(extra - set(maybe))
        for name in extra:
            self.kept[name] = sha(maybe[name])  # a new pin: it must stay
            if name not in ongoing:  # (a temporary: read back here)
                assert listing[name] == sha(maybe[name]), name
                assert m.path("pins", name).read_bytes() == maybe[name], name
        current = {n for g in groups for n, _ in g} & set(listing)
        for group in groups:
            for name, data in group:
                if name in current:
                    assert listing[name] == sha(data), name
                    assert m.path("pins", name).read_bytes() == data, name

    def check_all(self, m) -> None:
        """Every pin of every round, read back whole (once, at the end of the case)."""
        assert pin_listing(m) == self.kept
        for name, digest in self.kept.items():
            assert hashlib.sha256(m.path("pins", name).read_bytes()).hexdigest() == digest


def staging_reached(store: Path, size: int) -> bool:
    d = store / "large" / ".staging"
    try:
        for name in os.listdir(d):
            try:
                if os.stat(d / name).st_size >= size:
                    return True
            except FileNotFoundError:
                pass
    except FileNotFoundError:
        pass
    return False


# -- writes into /pins ------------------------------------------------------------------------


def test_crash_during_large_writes(start_mount, tmp_path):
    """cp of 5 MiB files into /pins, killed once the staging file of the j-th cp holds a
    seeded number of bytes (or between two cps)."""
    m = start_mount(tmp_path / "store")
    assert_cli_refused_while_mounted(m)
    pins = PinWrites()
    for i in range(iterations()):
        rng = seeded("large", i)
        work = tmp_path / f"large-{i}"
        work.mkdir()
        groups, ops = [], []
        for k in range(3):
            data = rng.randbytes(5 * MIB)
            src = work / f"src-{k}"
            src.write_bytes(data)
            name = f"big-{i}-{k}"
            groups.append([(name, data)])
            ops.append(["run", ["cp", str(src), str(m.path("pins", name))]])
        j, size = rng.randrange(3), rng.randrange(5 * MIB)
        client = Client(work, ops)

        def reached(client=client, j=j, size=size) -> bool:
            if not client.running() or client.done() > j:
                return True
            return client.done() == j and staging_reached(m.store_path, size)

        wait_until(reached, 60)
        kill_now(m, client)
        done = crash_restart(m, client)
        pins.check(m, groups, done)
        shutil.rmtree(work)
    pins.check_all(m)
    offline_checks(m)
    assert m.tracebacks() == []


def small_files(rng, work: Path, prefix: str, count: int) -> list[tuple[str, bytes]]:
    work.mkdir(parents=True)
    out = []
    for k in range(count):
        name = f"{prefix}-{k}"
        data = f"{name} ".encode() + rng.randbytes(rng.randrange(0, 3000))
        (work / name).write_bytes(data)
        out.append((name, data))
    return out


def test_crash_during_small_writes(start_mount, tmp_path):
    """25 small files written one by one into /pins (open, write, close: each logged once
    its close returned 0), then cp -r of 200 small files; killed at a seeded op, a seeded
    delay after it started."""
    m = start_mount(tmp_path / "store")
    assert_cli_refused_while_mounted(m)
    pins = PinWrites()
    for i in range(iterations()):
        rng = seeded("small", i)
        work = tmp_path / f"small-{i}"
        groups, ops = [], []
        for name, data in small_files(rng, work / "one", f"o{i}", 25):
            groups.append([(name, data)])
            ops.append(["write", str(work / "one" / name), str(m.path("pins", name))])
        groups.append(small_files(rng, work / "tree", f"t{i}", 200))
        ops.append(["run", ["cp", "-r", f"{work / 'tree'}/.", str(m.path("pins")) + "/"]])
        client = Client(work, ops)
        op = rng.randrange(len(ops))  # a write (killed within 20 ms of its start) or the cp -r
        kill_at_op(m, client, op, rng.uniform(0.0, 0.02 if op < len(ops) - 1 else 2.0))
        done = crash_restart(m, client)
        pins.check(m, groups, done)
        shutil.rmtree(work)
    pins.check_all(m)
    offline_checks(m)
    assert m.tracebacks() == []


def test_crash_during_rsync(start_mount, tmp_path):
    """rsync -a of small trees (40 files, one of them past the kv threshold) into /pins,
    three rounds; killed after a seeded delay."""
    m = start_mount(tmp_path / "store")
    assert_cli_refused_while_mounted(m)
    pins = PinWrites()
    for i in range(iterations()):
        rng = seeded("rsync", i)
        work = tmp_path / f"rsync-{i}"
        groups, ops = [], []
        for r in range(3):
            tree = work / f"t{r}"
            files = small_files(rng, tree, f"r{i}-{r}", 39)
            big = (f"r{i}-{r}-big", rng.randbytes(300_000))
            (tree / big[0]).write_bytes(big[1])
            groups.append([*files, big])
            ops.append(["run", ["rsync", "-a", f"{tree}/", str(m.path("pins")) + "/"]])
        client = Client(work, ops)
        kill_after(m, client, rng.uniform(0.0, 2.0))
        done = crash_restart(m, client)
        pins.check(m, groups, done)
        shutil.rmtree(work)
    pins.check_all(m)
    offline_checks(m)
    assert m.tracebacks() == []


# -- git ----------------------------------------------------------------------------------------


def ref_values(git_dir: Path) -> dict[str, str]:
    out = git("--git-dir", str(git_dir), "for-each-ref", "--format=%(refname) %(objectname)")
    return dict(line.split(" ") for line in out.splitlines())


def check_pushed(m, repo: str, local: Path, allowed: set[str | None]) -> str | None:
    """refs/heads/main of MNT/repos/REPO is one of `allowed` and has its whole closure;
    the repository's objects/ lists only info and pack (no quarantine left)."""
    git_dir = m.path("repos", repo)
    value = ref_values(git_dir).get("refs/heads/main")
    assert value in allowed, (value, allowed)
    if value is not None:
        assert objects_of(git_dir, value) == objects_of(None, value, cwd=local)
    assert sorted(os.listdir(git_dir / "objects")) == ["info", "pack"]
    return value


def push_rounds(m, tmp_path: Path, case: str, after_kill=None) -> None:
    repo = "r"
    os.mkdir(m.path("repos", repo))
    local = tmp_path / "local"
    value = None
    for i in range(iterations()):
        rng = seeded(case, i)
        commits = make_commits(local, rng, 3, f"{case}{i}")
        ops = [
            [
                "run",
                ["git", "push", "-q", str(m.path("repos", repo)), f"{c}:refs/heads/main"],
                str(local),
            ]
            for c in commits
        ]
        client = Client(tmp_path / f"{case}-{i}", ops)
        kill_after(m, client, rng.uniform(0.0, 3.0))
        if after_kill is not None:
            after_kill(m)
        done = crash_restart(m, client)
        before = value if done == 0 else commits[done - 1]
        allowed = {before} | ({commits[done]} if done < len(commits) else set())
        value = check_pushed(m, repo, local, allowed)
    offline_checks(m)
    assert m.tracebacks() == []


def test_crash_during_git_push(start_mount, tmp_path):
    """git push of new commits (a few loose objects, or a pack past unpackLimit) into
    MNT/repos/r; killed after a seeded delay."""
    m = start_mount(tmp_path / "store", "--window", "0", env={"ALKFS_PACKS": "off"})
    assert_cli_refused_while_mounted(m)
    push_rounds(m, tmp_path, "push")


def test_crash_during_ref_updates(start_mount, tmp_path):
    """`git update-ref NEW OLD` (create, update, delete: compare-and-swap) loops in
    GIT_DIR=MNT/repos/r; after the kill every ref is as after ops[:done] or
    ops[:done+1]."""
    m = start_mount(tmp_path / "store", "--window", "0", env={"ALKFS_PACKS": "off"})
    assert_cli_refused_while_mounted(m)
    git_dir = m.path("repos", "r")
    os.mkdir(git_dir)
    local = tmp_path / "local"
    commits = make_commits(local, seeded("refs", -1), 6, "base")
    git("push", "-q", str(git_dir), f"{commits[-1]}:refs/heads/base", cwd=local)
    model = ref_values(git_dir)
    assert model == {"refs/heads/base": commits[-1]}
    zero = "0" * 40
    for i in range(iterations()):
        rng = seeded("refs", i)
        states, ops = [dict(model)], []
        for _ in range(60):
            state = dict(states[-1])
            ref = f"refs/heads/r{rng.randrange(5)}"
            old = state.get(ref)
            if old is not None and rng.random() < 0.25:
                ops.append(["run", ["git", "update-ref", "-d", ref, old]])
                del state[ref]
            else:
                new = rng.choice([c for c in commits if c != old])
                ops.append(["run", ["git", "update-ref", ref, new, old or zero]])
                state[ref] = new
            states.append(state)
        client = Client(tmp_path / f"refs-{i}", ops, env={"GIT_DIR": str(git_dir)})
        kill_after(m, client, rng.uniform(0.0, 1.5))
        done = crash_restart(m, client)
        model = ref_values(git_dir)
        allowed = states[done : done + 2]
        assert model in allowed, (done, model, allowed)
        heads = os.listdir(git_dir / "refs" / "heads")
        assert not [h for h in heads if h.endswith(".lock")], heads
    offline_checks(m)
    assert m.tracebacks() == []


# -- pins by link, rm, mv and xattr -----------------------------------------------------------


def test_crash_during_pin_changes(start_mount, populate, tmp_path):
    """ln -s, rm, mv (onto a new name or over a pin) in /pins and setfattr -n/-x
    user.alkfs.pin.NAME on objects; after the kill /pins is as after ops[:done] or
    ops[:done+1]."""
    store = tmp_path / "store"
    rng0 = seeded("pins", -1)
    blobs = [f"object {k} ".encode() * rng0.randrange(1, 50) for k in range(20)]
    blobs += [rng0.randbytes(200_000), rng0.randbytes(300_000)]  # two large ones
    keys = [k.hex for k in populate(store, blobs)]
    m = start_mount(store)
    assert_cli_refused_while_mounted(m)
    names = [f"p{k}" for k in range(12)]
    model: dict[str, str] = {}
    for i in range(iterations()):
        rng = seeded("pins", i)
        states, ops = [dict(model)], []
        for _ in range(50):
            state = dict(states[-1])
            free = [n for n in names if n not in state]
            used = sorted(state)
            kinds = (["ln", "xattr"] if free else []) + (["rm", "xattr-x", "mv"] if used else [])
            kind = rng.choice(kinds)
            if kind == "ln":
                name, key = rng.choice(free), rng.choice(keys)
                ops.append(
                    ["run", ["ln", "-s", f"../objects/sha256/{key}", str(m.path("pins", name))]]
                )
                state[name] = key
            elif kind == "xattr":
                name, key = rng.choice(free), rng.choice(keys)
                obj = str(m.path("objects", "sha256", key))
                ops.append(["run", ["setfattr", "-n", f"user.alkfs.pin.{name}", obj]])
                state[name] = key
            elif kind == "rm":
                name = rng.choice(used)
                ops.append(["run", ["rm", str(m.path("pins", name))]])
                del state[name]
            elif kind == "xattr-x":
                name = rng.choice(used)
                obj = str(m.path("objects", "sha256", state[name]))
                ops.append(["run", ["setfattr", "-x", f"user.alkfs.pin.{name}", obj]])
                del state[name]
            else:
                a = rng.choice(used)
                b = rng.choice([n for n in names if n != a])  # new, or over a pin
                ops.append(["run", ["mv", "-T", str(m.path("pins", a)), str(m.path("pins", b))]])
                state[b] = state.pop(a)
            states.append(state)
        client = Client(tmp_path / f"pins-{i}", ops)
        kill_after(m, client, rng.uniform(0.0, 1.0))
        done = crash_restart(m, client)
        model = pin_listing(m)
        allowed = states[done : done + 2]
        assert model in allowed, (done, model, allowed)
        for name, key in model.items():
            assert m.path("pins", name).read_bytes() == blobs[keys.index(key)]
    offline_checks(m)
    assert m.tracebacks() == []


# -- the sweep's execute phase -----------------------------------------------------------------


def test_crash_during_sweep_execute(start_mount, tmp_path):
    """Each round: with the daemon stopped, 2000 dead objects and a repository's worth of
    dead git objects (in the published derived pack, so the sweep must publish a set
    without them before deleting) are staged with window 0 next to pinned and referenced
    live ones; then `echo sweep > control` (execute) is killed after a seeded delay.
    After the restart every live object is whole, and two more sweeps leave exactly the
    live objects (what the crash cut short is staged again, never lost or kept)."""
    from alkfs.app import Alkfs
    from alkfs.git.importer import import_repo

    store = tmp_path / "store"
    keep = tmp_path / "keep"
    keep_commits = make_commits(keep, seeded("sweep", -1), 3, "keep")
    done = alkfs_cli("--store", str(store), "git", "import", str(keep), "--repo", "keep")
    assert done.returncode == 0, done.stderr
    keep_objects = {line.split()[0] for line in objects_of(None, keep_commits[-1], cwd=keep)}
    live: dict[str, bytes] = {}  # pin name -> bytes
    m = None
    for i in range(iterations()):
        rng = seeded("sweep", i)
        doomed = tmp_path / f"doomed-{i}"
        make_commits(doomed, rng, 2, f"doomed{i}")
        with Alkfs.open(store, window_s=0) as app:
            import_repo(app, str(doomed), "doomed")  # and builds a set that holds them
            app.refs.delete_repo("doomed")
            for k in range(DEAD):
                app.store.add(f"dead {i} {k} ".encode() + rng.randbytes(rng.randrange(50, 400)))
            for k in range(5):
                data = f"live {i} {k} ".encode() + rng.randbytes(rng.randrange(50, 200_000))
                app.pins.pin(f"live-{i}-{k}", app.store.add(data))
                live[f"live-{i}-{k}"] = data
            report = app.store.sweep(window_s=0)
            assert report.aborted is None
            assert report.candidates_staged >= DEAD
        if m is None:
            m = start_mount(store)
            assert_cli_refused_while_mounted(m)
        else:
            start(m)
        client = Client(
            tmp_path / f"sweep-{i}",
            [["run", ["sh", "-c", 'echo sweep > "$0"', str(m.path(".alkfs", "control"))]]],
        )
        kill_after(m, client, rng.uniform(0.0, 0.6))
        crash_restart(m, client)
        assert pin_listing(m) == {n: sha(d) for n, d in live.items()}
        for name, data in live.items():
            assert m.path("pins", name).read_bytes() == data
        assert objects_of(m.path("repos", "keep"), "refs/heads/main") == objects_of(
            None, keep_commits[-1], cwd=keep
        )
        control(m, "sweep")
        control(m, "sweep")
        assert sorted(os.listdir(m.path("objects", "sha256"))) == sorted(
            sha(d) for d in live.values()
        )
        assert set(os.listdir(m.path("objects", "git-sha1"))) == keep_objects
        packed = set()
        for idx in m.path("git", "sha1", "pack").glob("*.idx"):
            out = git("verify-pack", "-v", str(idx))
            packed |= {w[0] for w in map(str.split, out.splitlines()) if HEX40.fullmatch(w[0])}
        assert packed <= keep_objects, sorted(packed - keep_objects)[:5]
        offline_checks(m, cli=i == iterations() - 1)
    assert m is not None and m.tracebacks() == []


# -- derived packs -------------------------------------------------------------------------------


def test_crash_during_derived_pack_intake(start_mount, tmp_path):
    """Pushes while the intake task builds and publishes derived packs (built whenever
    anything new arrived: ALKFS_PACK_EVERY=0, polled every 0.1 s); killed after a seeded
    delay. The crash image's published set verifies, and the pushes are old-or-new."""
    env = {"ALKFS_PACK_EVERY": "0", "ALKFS_PACK_POLL": "0.1"}
    m = start_mount(tmp_path / "store", "--window", "0", env=env)
    assert_cli_refused_while_mounted(m)
    push_rounds(m, tmp_path, "intake", after_kill=lambda m: check_derived_image(m.store_path))
    check_derived_image(m.store_path)


def test_crash_during_repack_command(start_mount, tmp_path):
    """`echo repack > MNT/.alkfs/control`, where the control file has that command."""
    m = start_mount(tmp_path / "store")
    try:
        control(m, "repack")
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        pytest.skip(
            "no `repack` command in MNT/.alkfs/control (it takes sweep and verify only); "
            "derived-pack building and publishing is covered by "
            "test_crash_during_derived_pack_intake and test_crash_during_sweep_execute"
        )
    local = tmp_path / "local"
    os.mkdir(m.path("repos", "r"))
    for i in range(iterations()):
        rng = seeded("repack", i)
        commits = make_commits(local, rng, 4, f"repack{i}")
        git("push", "-q", str(m.path("repos", "r")), f"{commits[-1]}:refs/heads/main", cwd=local)
        ctl = str(m.path(".alkfs", "control"))
        client = Client(
            tmp_path / f"repack-{i}", [["run", ["sh", "-c", 'echo repack > "$0"', ctl]]]
        )
        kill_after(m, client, rng.uniform(0.0, 0.4))  # a small store's repack is quick
        m_store = m.store_path
        check_derived_image(m_store)
        crash_restart(m, client)
        check_pushed(m, "r", local, {commits[-1]})
    offline_checks(m)
    integrity_check(m.store_path)
    assert m.tracebacks() == []


def test_iterations_follow_alkfs_soak():
    """ALKFS_SOAK=1 raises every case to 50 rounds; make test runs 5."""
    code = "import crash_helpers as c; print(c.iterations())"
    here = str(Path(__file__).parent)
    for soak, want in (("1", "50"), ("", "5")):
        env = {**os.environ, "ALKFS_SOAK": soak, "PYTHONPATH": f"{here}:{Path(here).parent}"}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.stdout.strip() == want, out.stderr
