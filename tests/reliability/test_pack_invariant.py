"""The fan-out invariant of /git/sha1 under a mixed workload on one real mount: every object
reachable from a ref of a repository under MNT/repos is, at every moment, either in a pack
of the published derived set (MNT/git/sha1/pack) or listed in its fan-out directory
(MNT/git/sha1/<xx>/). git relies on it: `git fsck --full` through alternates calls a
reachable object it neither finds in a pack nor in a listing "missing", `git show
<abbrev>` cannot expand an abbreviation, `cat-file --batch-all-objects` omits it.

Workload (threads, randomized, seeded: the seed is printed and ALKFS_SOAK_SEED replays it),
for ALKFS_SOAK_S seconds (default 40 in `make test`; `make soak` sets 600):

- one pusher per repository (two repositories): new commits (a few files edited, new
  files in nested directories, now and then one removed) pushed to several branches,
  branch deletions, resurrections (an old, deleted commit pushed back to a branch, after
  its objects may have been staged or deleted), rewinds (a branch forced back to an
  ancestor);
- sweeps (the daemon's window: WINDOW_S) and `repack` commands through the control file;
- two git readers through repositories whose `objects/info/alternates` names MNT/git/sha1
  (`git log`, `git show <abbrev>`, `cat-file --batch-all-objects`), no refs of their own;
- the derived packs' intake at its fastest (a set published whenever objects arrived).

The checker samples the invariant all along: the refs of every repository (read through the
mount), the objects reachable from them (`git rev-list --objects` in the pusher's local
repository, which holds every commit it ever pushed), the ids of the published packs (`git
show-index` over pack/*.idx, cached by name: a pack's name is its checksum) before and after
the 256 fan-out listings. An object reachable when a sample starts cannot be deleted before
the window has passed, and a sample takes far less (slower ones are not counted). Reading
the packs before and after the listings covers a set published meanwhile; when the pack
listings differ a missing object is looked for again before the sample counts as broken.
A broken sample records each missing object's row id and staged state (the store's sqlite,
read-only) and the published set's alkfs.json. At the end, `git fsck --full --strict`
through alternates over every ref is clean.

What it found (daemon/listings.py): the kernel kept serving a fan-out directory's cached
listing after objects arrived in it, until a new set packed them (ALKFS_PACK_EVERY, 60 s
by default) or the daemon restarted. After a drop of the kernel's cached listing, `Listings`
forgot every listing it knew might be cached, counting on the dropping open's READDIR to
tell it what got cached next; but a second open dropping at once wiped the listing the
first open's READDIR had just filled (under the new mtime: the second open's getdents was
served from it, no READDIR came), and an empty listing registered with pyfuse3 was filled
by READDIRs answered in C, never recorded. With nothing known as cached, every later open
kept the kernel's copy. The two races are replayed on `Listings` itself below. At soak
length its `repack`s also met builds failing under load (EIO: a build's git fed on stdin
that outlasted one look at the store's stop, c2cc447, tests/daemon/test_stop_midsweep.py).
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
import threading
import time
import traceback
from pathlib import Path

import pyfuse3
import pytest
import trio
import trio.lowlevel
from helpers import git, git_out

from alkfs.keys import Algorithm
from alkfsd import listings
from alkfsd.listings import Listings

SOAK = os.environ.get("ALKFS_SOAK") == "1"
SOAK_S = float(os.environ.get("ALKFS_SOAK_S") or (600 if SOAK else 40))
SEED = int(os.environ.get("ALKFS_SOAK_SEED") or time.time_ns() % 1_000_000)
WINDOW_S = 20  # the daemon's window: longer than a sample may take (SAMPLE_MAX_S)
SAMPLE_MAX_S = 10.0  # a slower sample is not counted (the window could have passed)
REPOS = ("r1", "r2")
BRANCHES = ("main", "b1", "b2", "b3", "b4", "b5")
PACK_ENV = {
    # a set whenever objects arrived (and a consolidation of small ones often)
    "ALKFS_PACK_EVERY": "1",
    "ALKFS_PACK_POLL": "0.2",
    "ALKFS_PACK_OBJECTS": "40",
}

pytestmark = pytest.mark.timeout(int(SOAK_S) + 600)


# -- the workload ------------------------------------------------------------------------------
class Pusher:
    """One repository's history: commits made in a local bare repository (fast-import),
    pushed to MNT/repos/<name>; deleted branch tips kept for resurrection."""

    def __init__(self, name: str, local: Path, remote: Path, rng: random.Random) -> None:
        self.name = name
        self.local = local
        self.remote = remote
        self.rng = rng
        self.tips: dict[str, str] = {}  # branch -> the commit pushed to it
        self.files: dict[str, tuple[str, ...]] = {}  # commit -> its paths
        self.parents: dict[str, str | None] = {}
        self.graveyard: list[str] = []  # tips of deleted branches (and rewound commits)
        self.clock = 1_700_000_000
        self.counts: dict[str, int] = {}
        git("init", "-q", "--bare", "-b", "main", local)
        git(f"--git-dir={local}", "config", "gc.auto", "0")
        os.mkdir(remote)

    def _content(self, path: str) -> str:
        n = self.rng.randint(3, 40)
        return "".join(f"{path} {self.rng.getrandbits(48):012x}\n" for _ in range(n))

    def commit(self, parent: str | None, extra: int = 0) -> str:
        """A commit on `parent` editing a few files, adding new ones in nested
        directories, now and then removing one; its id (stored locally only)."""
        rng = self.rng
        paths = list(self.files[parent]) if parent is not None else []
        edits: list[str] = []
        changed = rng.sample(paths, min(len(paths), rng.randint(1, 3)))
        news = [
            "/".join(f"d{rng.randint(0, 3)}" for _ in range(rng.randint(0, 3)))
            + f"/f{rng.getrandbits(32):08x}.txt"
            for _ in range(rng.randint(0 if paths else 2, 2) + extra)
        ]
        news = [p.lstrip("/") for p in news]
        removed = []
        if len(paths) > 12 and rng.random() < 0.2:
            removed = [rng.choice([p for p in paths if p not in changed] or paths)]
        self.clock += rng.randint(1, 100)
        message = f"{self.name} commit at {self.clock} {rng.getrandbits(32):08x}\n"
        out = [
            *(["reset refs/heads/scratch\n"] if parent is None else []),
            "commit refs/heads/scratch\n",
            f"committer C O Mitter <c@example.com> {self.clock} +0000\n",
            f"data {len(message)}\n{message}",
        ]
        if parent is not None:
            out.append(f"from {parent}\n")
        else:
            out.append("deleteall\n")
        for path in [*changed, *news]:
            data = self._content(path)
            out.append(f"M 100644 inline {path}\ndata {len(data.encode())}\n{data}\n")
            edits.append(path)
        for path in removed:
            out.append(f"D {path}\n")
        out.append("\n")
        git(
            f"--git-dir={self.local}",
            "fast-import",
            "--quiet",
            "--force",
            input="".join(out).encode(),
        )
        oid = git_out(f"--git-dir={self.local}", "rev-parse", "refs/heads/scratch").strip()
        self.files[oid] = tuple(sorted((set(paths) | set(news)) - set(removed)))
        self.parents[oid] = parent
        return oid

    def push(self, oid: str, branch: str) -> None:
        git(
            f"--git-dir={self.local}",
            "push",
            "-q",
            "--force",
            self.remote,
            f"{oid}:refs/heads/{branch}",
            timeout=300,
        )
        self.tips[branch] = oid

    def delete(self, branch: str) -> None:
        git(f"--git-dir={self.local}", "push", "-q", self.remote, f":refs/heads/{branch}")
        self.graveyard.append(self.tips.pop(branch))

    def seed_history(self, n: int) -> None:
        tip = None
        for _ in range(n):
            tip = self.commit(tip, extra=1)
        assert tip is not None
        self.push(tip, "main")

    def step(self) -> str:
        """One random operation; its name."""
        rng = self.rng
        r = rng.random()
        live = sorted(self.tips)
        if r < 0.12 and len(live) > 1:
            branch = rng.choice([b for b in live if b != "main"])
            self.delete(branch)
            op = "delete"
        elif r < 0.24 and self.graveyard:
            old = rng.choice(self.graveyard[-30:])
            branch = rng.choice(BRANCHES[1:])
            if branch in self.tips and self.tips[branch] != old:
                self.graveyard.append(self.tips[branch])
            self.push(old, branch)
            op = "resurrect"
        elif r < 0.30:
            branch = rng.choice(live)
            tip = self.tips[branch]
            back = tip
            for _ in range(rng.randint(1, 3)):
                parent = self.parents.get(back)
                if parent is None:
                    break
                back = parent
            if back == tip:
                return "nothing"
            self.graveyard.append(tip)
            self.push(back, branch)
            op = "rewind"
        else:
            branch = rng.choice(BRANCHES)
            base = self.tips.get(branch) or self.tips[rng.choice(live)]
            tip = base
            for _ in range(rng.choice((1, 1, 1, 2, 3))):
                tip = self.commit(tip)
            self.push(tip, branch)
            op = "commit"
        self.counts[op] = self.counts.get(op, 0) + 1
        return op


def control(mnt: Path, command: str) -> None:
    (mnt / ".alkfs" / "control").write_text(command + "\n")


# -- what the mount shows ------------------------------------------------------------------------
class Packs:
    """The ids of the idx files listed in MNT/git/sha1/pack (each read once: a pack's name
    is its checksum)."""

    def __init__(self, mnt: Path) -> None:
        self.dir = mnt / "git" / "sha1" / "pack"
        self.ids: dict[str, frozenset[str]] = {}

    def read(self) -> tuple[tuple[str, ...], set[str]]:
        """(the idx names listed, the ids they hold); once more if a name listed went."""
        for attempt in (0, 1):
            names = tuple(sorted(n for n in os.listdir(self.dir) if n.endswith(".idx")))
            try:
                out: set[str] = set()
                for name in names:
                    if name not in self.ids:
                        self.ids[name] = self._show_index(name)
                    out |= self.ids[name]
                return names, out
            except FileNotFoundError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _show_index(self, name: str) -> frozenset[str]:
        with open(self.dir / name, "rb") as f:
            done = subprocess.run(["git", "show-index"], stdin=f, capture_output=True)
        if done.returncode != 0:  # (its file went between the open and the read)
            raise FileNotFoundError(f"{name}: {done.stderr.decode(errors='replace')}")
        return frozenset(line.split()[1] for line in done.stdout.decode().splitlines())


def fanout(mnt: Path) -> set[str]:
    top = mnt / "git" / "sha1"
    out = set()
    for i in range(256):
        xx = f"{i:02x}"
        out.update(xx + rest for rest in os.listdir(top / xx) if len(rest) == 38)
    return out


def generation(store: Path) -> int:
    """The published sha1 generation's number (0: none)."""
    try:
        return int((store / "derived" / "sha1" / "CURRENT").read_text())
    except (OSError, ValueError):
        return 0


def published(store: Path) -> dict:
    """The published sha1 set's alkfs.json (less its long lists)."""
    root = store / "derived" / "sha1"
    try:
        number = int((root / "CURRENT").read_text())
        meta = json.loads((root / f"gen-{number}" / "alkfs.json").read_text())
    except (OSError, ValueError) as exc:
        return {"unreadable": str(exc)}
    for key in ("left_out", "withheld"):
        if isinstance(meta.get(key), list):
            meta[key] = f"{len(meta[key])} id(s)"
    return meta


def store_rows(store: Path, oids: list[str]) -> dict[str, dict]:
    """Each object's row id, size and staged state, from the store's sqlite (read-only)."""
    out: dict[str, dict] = {}
    try:
        db = sqlite3.connect(f"file:{store / 'store.db'}?mode=ro", uri=True, timeout=10)
    except sqlite3.Error as exc:
        return {"error": {"sqlite": str(exc)}}
    try:
        top = db.execute("SELECT coalesce(max(rowid), 0) FROM blobs").fetchone()[0]
        high = db.execute("SELECT value FROM meta WHERE name = 'arrival_high'").fetchone()
        out["(store)"] = {"max_rowid": top, "arrival_high": high[0] if high else None}
        for oid in oids:
            key = bytes([Algorithm.GIT_SHA1.value]) + bytes.fromhex(oid)
            row = db.execute("SELECT rowid, size FROM blobs WHERE key = ?", (key,)).fetchone()
            staged = db.execute(
                "SELECT visible_after, staged_ns FROM gc_window WHERE key = ?", (key,)
            ).fetchone()
            out[oid] = {
                "rowid": None if row is None else row[0],
                "stored": row is not None,
                "staged": staged is not None,
            }
    except sqlite3.Error as exc:
        out["error"] = {"sqlite": str(exc)}
    finally:
        db.close()
    return out


# -- the test -----------------------------------------------------------------------------------
def test_every_reachable_object_is_packed_or_listed(start_mount, tmp_path: Path) -> None:
    print(f"\nseed {SEED} (ALKFS_SOAK_SEED={SEED} replays it), {SOAK_S:g} s")
    store = tmp_path / "store"
    m = start_mount(store, "--window", f"{WINDOW_S}s", env=PACK_ENV)
    mnt = m.mnt
    pushers = [
        Pusher(name, tmp_path / f"local-{name}.git", mnt / "repos" / name, random.Random(SEED + i))
        for i, name in enumerate(REPOS)
    ]
    for p in pushers:
        p.seed_history(20)
    control(mnt, "repack")

    stop = threading.Event()
    errors: list[str] = []  # a worker's failure (each ends the run)
    reader_failures: list[str] = []
    counts: dict[str, int] = {"sweep": 0, "repack": 0, "read": 0}

    def worker(name: str, body) -> threading.Thread:
        def loop() -> None:
            try:
                while not stop.is_set():
                    body()
            except Exception:
                errors.append(f"{name}: {traceback.format_exc()}")
                stop.set()

        return threading.Thread(target=loop, name=name, daemon=True)

    def pusher_body(p: Pusher):
        def body() -> None:
            p.step()
            stop.wait(p.rng.uniform(0.0, 0.3))

        return body

    admin_rng = random.Random(SEED + 100)

    def sweeper() -> None:
        stop.wait(admin_rng.uniform(1.0, 4.0))
        if not stop.is_set():
            control(mnt, "sweep" if admin_rng.random() < 0.7 else f"sweep {WINDOW_S}s")
            counts["sweep"] += 1

    repack_rng = random.Random(SEED + 200)

    def repacker() -> None:
        stop.wait(repack_rng.uniform(2.0, 8.0))
        if not stop.is_set():
            control(mnt, "repack")
            counts["repack"] += 1

    def reader_body(k: int):
        rng = random.Random(SEED + 300 + k)
        user = tmp_path / f"reader{k}.git"
        git("init", "-q", "--bare", user)
        (user / "objects" / "info" / "alternates").write_text(f"{mnt}/git/sha1\n")

        def body() -> None:
            p = rng.choice(pushers)
            refs = git_out(
                f"--git-dir={p.remote}", "for-each-ref", "--format=%(objectname)"
            ).split()
            if not refs:
                return
            tip = rng.choice(refs)
            for args in (
                ("log", "--format=%H %T", "-n", "40", tip),
                ("show", "--stat", "--format=%H", tip[:12]),
                ("rev-parse", "--verify", f"{tip[:10]}^{{tree}}"),
                ("cat-file", "--batch-all-objects", "--batch-check=%(objectname)"),
            ):
                if args[0] == "cat-file" and rng.random() < 0.7:
                    continue
                done = git(f"--git-dir={user}", *args, check=False)
                counts["read"] += 1
                if done.returncode != 0:
                    reader_failures.append(
                        f"{time.strftime('%H:%M:%S')} reader{k} git {' '.join(args)}: "
                        + done.stderr.decode(errors="replace").strip()[:500]
                    )
            stop.wait(rng.uniform(0.0, 0.5))

        return body

    threads = [worker(f"pusher-{p.name}", pusher_body(p)) for p in pushers]
    threads += [worker("sweeper", sweeper), worker("repacker", repacker)]
    threads += [worker(f"reader{k}", reader_body(k)) for k in range(2)]

    packs = Packs(mnt)
    samples = slow = raced = 0
    broken: list[dict] = []
    durations: list[float] = []
    missing_for: dict[str, list[float]] = {}  # object -> [first, last] broken sample (s)

    def sample() -> None:
        nonlocal samples, slow, raced
        t0 = time.monotonic()
        reachable: set[str] = set()
        for p in pushers:
            tips = git_out(
                f"--git-dir={p.remote}", "for-each-ref", "--format=%(objectname)"
            ).split()
            if tips:
                listed = git_out(f"--git-dir={p.local}", "rev-list", "--objects", *tips)
                reachable.update(line[:40] for line in listed.splitlines())
        gen1 = generation(store)
        names1, packed1 = packs.read()
        listed = fanout(mnt)
        names2, packed2 = packs.read()
        gen2 = generation(store)
        missing = reachable - packed1 - listed - packed2
        took = time.monotonic() - t0
        if took > SAMPLE_MAX_S:
            slow += 1
            return
        durations.append(took)
        samples += 1
        if not missing:
            return
        if names1 != names2:  # a set was published during the sample: look again
            _names, packed3 = packs.read()
            again = missing - fanout(mnt) - packed3
            if not again:
                raced += 1
                return
            missing = again
        oids = sorted(missing)
        for oid in oids:
            missing_for.setdefault(oid, [t0 - start, t0 - start])[1] = t0 - start
        broken.append(
            {
                "at_s": round(t0 - start, 1),
                "generations": (gen1, gen2, generation(store)),
                "reachable": len(reachable),
                "missing": len(oids),
                "examples": store_rows(store, oids[:5]),
                "published": published(store),
                "packs_listed": len(names2),
                "resolves": [(mnt / "git" / "sha1" / o[:2] / o[2:]).exists() for o in oids[:5]],
            }
        )

    start = time.monotonic()
    for t in threads:
        t.start()
    try:
        while time.monotonic() - start < SOAK_S and not stop.is_set():
            sample()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=600)
    elapsed = time.monotonic() - start

    summary = (
        f"seed {SEED}: {samples} samples in {elapsed:.0f} s ({len(broken)} broke the invariant, "
        f"{raced} raced a publish and were clean on a second look, {slow} too slow to count; "
        f"sample {min(durations, default=0):.2f}..{max(durations, default=0):.2f} s; "
        f"{len(missing_for)} object(s) missing, for up to "
        f"{max((b - a for a, b in missing_for.values()), default=0):.1f} s), "
        f"pushes {[p.counts for p in pushers]}, {counts}"
    )
    print(summary)
    assert errors == [], "\n".join(errors)
    first = json.dumps(broken[:3], indent=1, default=str)
    assert broken == [], (
        f"{len(broken)} of {samples} samples found reachable objects neither packed nor "
        f"listed in the fan-out; {summary}; the first: {first}"
    )
    assert reader_failures == [], f"{len(reader_failures)} reader failures: {reader_failures[:10]}"
    assert samples >= 5, summary

    # at the end, through alternates: every ref's history is whole and git-clean
    user = tmp_path / "final.git"
    git("init", "-q", "--bare", user)
    (user / "objects" / "info" / "alternates").write_text(f"{mnt}/git/sha1\n")
    for p in pushers:
        refs = git_out(f"--git-dir={p.remote}", "for-each-ref", "--format=%(objectname) %(refname)")
        for line in refs.splitlines():
            oid, ref = line.split()
            git(f"--git-dir={user}", "update-ref", f"refs/{p.name}/{ref[5:]}", oid)
    git(f"--git-dir={user}", "fsck", "--full", "--strict", "--no-dangling", timeout=600)
    packs_status = json.loads((mnt / ".alkfs" / "status").read_text())["packs"]["sha1"]
    assert packs_status["last_error"] is None, packs_status
    assert m.tracebacks() == [], m.all_logs()[-3000:]


# -- the two races of daemon/listings.py, on Listings itself ---------------------------------
class FakeFile:
    is_dir = False


class FakeDir:
    """A node whose listing is whatever `names` holds now."""

    caches_listing = True
    is_dir = True

    def __init__(self, names: list[bytes]) -> None:
        self.names = names

    async def readdir(self, dh, start, emit) -> None:
        for i, name in enumerate(self.names):
            if not emit(name, FakeFile(), i + 3):
                return


class HeldInvalidator:
    """While `held`, each drop's invalidation reaches the kernel when the test lets it
    (`let`); then at once."""

    def __init__(self) -> None:
        self.taken: dict[int, trio.Event] = {}
        self.held = True

    def submit_inode(self, ino: int) -> int:
        seq = len(self.taken) + 1
        self.taken[seq] = trio.Event()
        return seq

    async def wait(self, seq: int, timeout: float) -> bool:  # noqa: ASYNC109 (as Invalidator.wait)
        if self.held:
            await self.taken[seq].wait()
        return True

    def let(self, seq: int) -> None:
        self.taken[seq].set()


class FakeCtx:
    """What Listings reads of a mount's context (`in_c`: a sole writer's store, root)."""

    def __init__(self) -> None:
        self.invalidator = HeldInvalidator()
        self.store = type("S", (), {"sole_writer": True, "changed_hooks": []})()
        self.options = type("O", (), {"allow_other": False, "shared": False, "owner_uid": None})()
        self.daemon_uid = 0


async def _open(ls_: Listings, fh: int, node: FakeDir, out: dict) -> None:
    out[fh] = await ls_.open(9, fh, node, None)  # type: ignore[arg-type]


async def _until(cond) -> None:
    with trio.fail_after(10):
        while not cond():
            await trio.lowlevel.checkpoint()


async def test_a_listing_filled_while_a_second_open_drops_stays_known_as_cached():
    ctx = FakeCtx()
    ls_, node = Listings(ctx), FakeDir([b"old"])  # type: ignore[arg-type]
    try:
        got: dict[int, pyfuse3.FileInfo] = {}
        await _open(ls_, 1, node, got)
        ls_.filling(ls_.snapshots[1])  # the kernel caches [old]
        ls_.release(1)
        node.names = []  # (packed by a new set)
        async with trio.open_nursery() as nursery:  # two opens at once: both drop
            nursery.start_soon(_open, ls_, 2, node, got)
            await _until(lambda: 1 in ctx.invalidator.taken)
            nursery.start_soon(_open, ls_, 3, node, got)
            await _until(lambda: 2 in ctx.invalidator.taken)
            ctx.invalidator.let(1)
            await _until(lambda: 2 in got)
            ls_.filling(ls_.snapshots[2])  # its READDIR: the kernel caches [] (new mtime)
            ls_.release(2)
            ctx.invalidator.let(2)
        assert not got[3].keep_cache
        ls_.release(3)  # (its getdents was served the cached [], no READDIR came)
        ctx.invalidator.held = False
        node.names = [b"new"]  # an object arrives: the kernel's [] must not be kept
        await _open(ls_, 4, node, got)
        assert not got[4].keep_cache, "the kernel's cached [] was kept: [new] is not listed"
    finally:
        ls_.close()


async def test_an_empty_listing_answered_in_c_after_a_drop_is_known_as_cached():
    ctx = FakeCtx()
    ls_, node = Listings(ctx), FakeDir([b"old"])  # type: ignore[arg-type]
    assert ls_.in_c
    try:
        got: dict[int, pyfuse3.FileInfo] = {}
        await _open(ls_, 1, node, got)
        ls_.filling(ls_.snapshots[1])  # the kernel caches [old]
        ls_.release(1)
        node.names = []
        listings.changed()  # (a new set packed it)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_open, ls_, 2, node, got)  # drops; its READDIR comes later
            await _until(lambda: 1 in ctx.invalidator.taken)
            ctx.invalidator.let(1)
        assert not got[2].keep_cache
        await _open(ls_, 3, node, got)  # [] while 2 holds []: kept, answered in C
        assert got[3].keep_cache
        # an open answered in C, and its READDIR answered empty in C: the kernel caches []
        # (under the new mtime), so 2's getdents is served from it and no READDIR comes
        ls_.release(2)
        ls_.release(3)
        ctx.invalidator.held = False
        node.names = [b"new"]
        listings.changed()  # (an object arrives)
        await _open(ls_, 4, node, got)
        assert not got[4].keep_cache, "the kernel's cached [] was kept: [new] is not listed"
    finally:
        ls_.close()
