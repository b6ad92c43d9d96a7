"""The daemon's derived packs: what /git/<format>/pack and info/ serve, and when sets are built.

`served(ctx)` is the mount's view of the library's derived sets (alkfs/git/packs/):
the published generation of each format, a count of open handles per generation, and
the removal of a retired generation once its last handle is released (in a thread).
Publishing (by the intake task, `repack_now`, or a sweep's guard in its own thread) calls
`Served._published`, which tells the views (gitview registers one per object directory)
so that they drop the kernel's entries of the names that changed.

`run(ctx)` is the background task: at start it finds what the fan-out listings of the
published sets need (before git's first listing asks), re-verifies the sets (one that
fails is withdrawn: its objects are served loose until the rebuild), builds a first set
when there is none,
then every `ALKFS_PACK_POLL` seconds (default 5) counts the objects stored since the
published set was built and builds a new set when `ALKFS_PACK_OBJECTS` (20,000) have
arrived, or any have and `ALKFS_PACK_EVERY` (60 s) passed since the last build, and
right after a sweep staged objects the published set holds (the new set leaves them out,
so the sweep that deletes them finds nothing to rebuild), and when the set has more than
MAX_PACKS packs (pushes kept as packs: one pack each) — consolidated into one. While a
sweep runs it looks at nothing (what the sweep writes back loose before deleting it is no
arrival; what it stages counts once it ends). A build is one thread running git (`nice -n 10`); reads and writes go on meanwhile.
`ALKFS_PACKS=off` serves and builds no derived packs at all (the loose views only).
"""

from __future__ import annotations

import calendar
import collections
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypedDict, TypeVar

import trio

from alkfs.errors import AlkfsError, Interrupted, log_failure
from alkfs.git.packs import FORMATS, MAX_PACKS, Derived, Generation, derived_for
from alkfs.keys import Key
from alkfs.settings import settings
from alkfs.store import ObjectStat

from . import listings

if TYPE_CHECKING:
    from .context import Context
    from .services import Services


class PackFigures(TypedDict):
    """One format's derived packs in the status (`Served.status`)."""

    generation: int | None
    objects: int
    packs: int
    bytes: int
    built_at: str | None
    last_error: str | None
    primary: bool
    drained: int


K = TypeVar("K")
V = TypeVar("V")

log = logging.getLogger("alkfsd")

View = Callable[[str, Generation | None, Generation | None], None]
# A retired generation (docs/gc.md, "Readers and retired packs"): for its grace
# (ALKFS_PACK_RETIRE_GRACE, 300 s) its names still resolve (git lists pack/ and opens what
# it listed later) and it stays on disk; an open handle keeps it up to its hold
# (ALKFS_PACK_RETIRE_HOLD, 3600 s) after it was retired; at most ALKFS_PACK_RETIRED_MAX (3)
# of a format stay on disk, whatever readers hold. Handles of one that goes read EIO.
# (All three: alkfs/settings.py.)


class Revocable(Protocol):
    number: int  # the generation it holds

    def revoke(self) -> None: ...

    def shared_rel(self) -> str | None:
        """Its file's path in a set, if another set can have the same file (hard-linked:
        a pack, an idx, a graph layer); None for a name every set has anew."""
        ...


def _names(path: str) -> list[str]:
    """The names in a directory; none when it does not exist."""
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def retire_grace() -> float:
    return settings().pack_retire_grace_s


def retire_hold() -> float:
    return settings().pack_retire_hold_s


def retired_max() -> int:
    return settings().pack_retired_max


def since_built(last_built: float | None, gen: Generation | None) -> float:
    """Seconds since a format's last build: this daemon's (`last_built`, monotonic), else
    the published set's `built_at` (a set imported a minute before the mount started is
    a minute old, not as old as the machine's uptime); unknown: very old."""
    if last_built is not None:
        return time.monotonic() - last_built
    stamp = gen.meta.get("built_at") if gen is not None else None
    try:
        built = calendar.timegm(time.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return float("inf")
    return max(0.0, time.time() - built)


Version = tuple[int, int | None]  # (the kv table's highest row id, Served._mark())


class Served:
    """The derived sets one mount serves (thread-safe where noted)."""

    def __init__(self, ctx: Services) -> None:
        self.ctx = ctx
        self.derived: dict[str, Derived] = {}
        self.views: list[View] = []
        self._holds: collections.Counter[tuple[str, int]] = collections.Counter()
        self._removing: set[tuple[str, int]] = set()
        self._retired: dict[tuple[str, int], float] = {}  # retired when (monotonic)
        self._retired_gens: dict[tuple[str, int], Generation] = {}
        self._handles: dict[tuple[str, int], set[Revocable]] = collections.defaultdict(set)
        self._lock = threading.Lock()
        self.building = trio.Lock()
        self.last_built: dict[str, float] = {}
        self._base: dict[str, tuple[int, dict[int, list[bytes]]]] = {}
        self._new: dict[str, tuple[int, Version, dict[int, list[bytes]]]] = {}
        self._memo: dict[tuple[str, int], tuple[tuple[int, Version], list[bytes]]] = {}
        # (generation, mark) at which a prefix listed nothing: most do, in a packed store,
        # and an empty listing can only fill with a put of ours (a deletion empties)
        self._none: dict[tuple[str, int], tuple[int, int]] = {}
        # (Store.puts, value) of the kv table's highest row id per format and of the large
        # tier's prefix directories: see `_mark`
        self._tops: dict[str, tuple[int, int]] = {}
        self._large: dict[tuple[str, int], tuple[int, list[str]]] = {}
        self._large_dirs: dict[str, tuple[int, frozenset[str]]] = {}
        for fmt in FORMATS if settings().packs else ():
            try:
                d = derived_for(ctx.store, fmt)
            except Exception:
                log_failure(log, "derived %s: cannot open the derived packs", fmt)
                d = None
            if d is not None:
                self.derived[fmt] = d
                d.on_publish.append(functools.partial(self._published, fmt))
                d.mounted = True

    def current(self, fmt: str) -> Generation | None:
        d = self.derived.get(fmt)
        return None if d is None else d.current()

    def packed(self, fmt: str) -> Generation | None:
        """The published set, if it holds any object (for the fan-out listings)."""
        gen = self.current(fmt)
        return gen if gen is not None and gen.indexes else None

    # -- the fan-out listings: what no published pack holds --------------------------------
    async def unpacked(self, fmt: str, prefix: int) -> list[ObjectStat] | None:
        """The stored objects of `fmt` whose first byte is `prefix` and that the published
        set lacks, in key order; None when no set holding objects is published. (Objects
        staged for deletion are listed too: one may be live again before a sweep takes
        it from the window, and `git fsck --full` calls a reachable object it neither
        finds in a pack nor in a listing "missing".)

        Kept cheap for git, which lists all 256 directories to abbreviate one id: the kv
        objects the set left out are found once per generation (in a thread), those
        stored since it was built by row id (refreshed when the table's highest row id
        moves), large-tier ones by listing that prefix's directory; each is stat'ed, so
        a deleted one is not listed."""
        gen = self.packed(fmt)
        if gen is None:
            return None
        mark = self._mark()
        if self._listed_empty(fmt, prefix, gen, mark):
            return []  # (listed empty at this set and mark: only a put of ours adds one)
        d = self.derived[fmt]
        base = self._base.get(fmt)
        if base is None or base[0] != gen.number:
            base = (gen.number, await self.ctx.run_sync(self._left_out, d, gen))
            self._base[fmt] = base
        version: Version = (await self._top(fmt, d, mark), mark)
        new = self._new.get(fmt)
        if new is None or new[0] != gen.number or new[1] != version:
            new = (gen.number, version, await self.ctx.run_sync(self._stored_since, d, gen))
            self._new[fmt] = new
        # the kv candidates of one prefix, sorted, while the set and the highest row stay
        memo = self._memo.get((fmt, prefix))
        if memo is None or memo[0] != (gen.number, version):
            kv = set(base[1].get(prefix, ())) | set(new[2].get(prefix, ()))
            memo = ((gen.number, version), sorted(kv))
            self._memo[(fmt, prefix)] = memo
        ordered = memo[1]
        store = self.ctx.store
        algo = d.algo
        if store.large is not None:  # large/<algo>/<xx>/<hex> (alkfs/tiers/local.py)
            names = self._large_names(f"{store.large.root}/{algo.label}", prefix, mark)
            extra = set()
            for name in names:
                try:
                    digest = bytes.fromhex(name)
                except ValueError:
                    continue
                if len(digest) == algo.digest_len and digest[0] == prefix and digest not in gen:
                    extra.add(digest)
            if extra:
                ordered = sorted(extra.union(ordered))
        out = []
        tag = bytes([algo.value])
        for digest in ordered:  # each stat'ed: one deleted since is not listed
            st = store.stat(Key(tag + digest))
            if st is not None:
                out.append(st)
        if not out and mark is not None and mark == self._mark():  # (no put ended meanwhile)
            self._none[(fmt, prefix)] = (gen.number, mark)
        return out

    def known_empty(self, fmt: str, prefix: int) -> bool:
        """`unpacked(fmt, prefix)` listed nothing at the published set and the mark now
        (so it would list nothing again: see `_none`)."""
        gen = self.packed(fmt)
        return gen is not None and self._listed_empty(fmt, prefix, gen, self._mark())

    def _listed_empty(self, fmt: str, prefix: int, gen: Generation, mark: int | None) -> bool:
        return mark is not None and self._none.get((fmt, prefix)) == (gen.number, mark)

    def _mark(self) -> int | None:
        """`Store.puts` where this process makes every change to the store
        (`Store.sole_writer`), else None. What a listing depends on then grows only with
        a put of ours: while the mark stays, the highest row id and the large tier's
        prefix directories are not read again (git lists all 256 fan-out directories to
        abbreviate one id). A deletion meanwhile is caught by the stat of each candidate."""
        store = self.ctx.store
        return store.puts if store.sole_writer else None

    async def _top(self, fmt: str, d: Derived, mark: int | None) -> int:
        """The kv table's highest row id: kept while the mark stays (a sole writer: read
        inline, one index seek in sqlite), else read for each listing, in a thread (a
        fleet's member on PostgreSQL: a round trip; `git fsck --full` calls an object
        another member just stored "missing" if a listing misses it)."""
        if mark is None:
            return await self.ctx.run_sync(d.max_rowid)
        return self._while_mark(self._tops, fmt, mark, d.max_rowid)

    def _large_names(self, root: str, prefix: int, mark: int | None) -> list[str]:
        xx = f"{prefix:02x}"
        if xx not in self._large_prefixes(root, mark):
            return []  # (one listing of ROOT tells, not one failed listing a prefix)
        return self._while_mark(self._large, (root, prefix), mark, lambda: _names(f"{root}/{xx}"))

    def _large_prefixes(self, root: str, mark: int | None) -> frozenset[str]:
        """The prefix directories the large tier has for this format (none at all when
        it never stored a large git object)."""
        return self._while_mark(self._large_dirs, root, mark, lambda: frozenset(_names(root)))

    def _while_mark(
        self, memo: dict[K, tuple[int, V]], key: K, mark: int | None, read: Callable[[], V]
    ) -> V:
        """`read()`, kept in `memo[key]` while the mark stays (see `_mark`)."""
        seen = memo.get(key)
        if mark is not None and seen is not None and seen[0] == mark:
            return seen[1]
        value = read()
        if mark is not None and mark == self._mark():  # (no put ended meanwhile)
            memo[key] = (mark, value)
        return value

    @staticmethod
    def _by_prefix(digests) -> dict[int, list[bytes]]:
        out: dict[int, list[bytes]] = {}
        for digest in digests:
            out.setdefault(digest[0], []).append(digest)
        return out

    def _left_out(self, d: Derived, gen: Generation) -> dict[int, list[bytes]]:
        """kv objects stored when `gen` was built that it does not hold (a thread): as
        the set recorded them, else found by comparing every stored key with it."""
        recorded = d.left_out(gen)
        if recorded is not None:
            return self._by_prefix(recorded)
        built = d.arrived(0, upto=int(gen.meta.get("max_rowid", 0)))
        return self._by_prefix(digest for digest in built if digest not in gen)

    def _stored_since(self, d: Derived, gen: Generation) -> dict[int, list[bytes]]:
        return self._by_prefix(d.arrived(int(gen.meta.get("max_rowid", 0))))

    # -- handles (trio thread and the publishing thread) ----------------------------------
    def acquire(self, fmt: str, number: int, handle: Revocable | None = None) -> bool:
        with self._lock:
            if (fmt, number) in self._removing:
                return False
            self._holds[(fmt, number)] += 1
            if handle is not None:
                self._handles[(fmt, number)].add(handle)
            return True

    async def release(self, fmt: str, number: int, handle: Revocable | None = None) -> None:
        with self._lock:
            if handle is not None:
                self._handles.get((fmt, number), set()).discard(handle)
            self._holds[(fmt, number)] -= 1
            if self._holds[(fmt, number)] > 0:
                return
            del self._holds[(fmt, number)]
            self._handles.pop((fmt, number), None)
        gen = self.current(fmt)
        if gen is None or gen.number != number:
            await trio.to_thread.run_sync(self.prune, fmt)

    def retired(self, fmt: str) -> list[Generation]:
        """The retired generations of `fmt` whose names still resolve, newest first."""
        grace = retire_grace()
        now = time.monotonic()
        with self._lock:
            out = [
                (at, self._retired_gens[key])
                for key, at in self._retired.items()
                if key[0] == fmt
                and now - at < grace
                and key not in self._removing
                and key in self._retired_gens
            ]
        return [gen for _at, gen in sorted(out, key=lambda x: x[0], reverse=True)]

    def _keep(self, fmt: str, now: float) -> tuple[set[int], set[int]]:
        """(kept, revoked) of the retired and held generations of `fmt` (under the lock):
        within the grace, or held and within the hold, and no more than retired_max()."""
        grace, hold, most = retire_grace(), retire_hold(), retired_max()
        retired = sorted(
            ((at, n) for (f, n), at in self._retired.items() if f == fmt), reverse=True
        )
        keep: set[int] = set()
        for i, (at, n) in enumerate(retired):
            age = now - at
            held = self._holds.get((fmt, n), 0) > 0
            if i < most and (age < grace or (held and age < hold)):
                keep.add(n)
        known = {n for _at, n in retired}
        # held, but not retired by this process (one a fleet's member published; one the
        # daemon found at start): kept while held, as before
        keep |= {n for (f, n) in self._holds if f == fmt and n not in known}
        revoked = {n for (f, n) in self._holds if f == fmt and n in known and n not in keep}
        return keep, revoked

    def prune(self, fmt: str) -> None:
        """Remove the retired generations of `fmt` that `_keep` lets go (any thread),
        revoking the handles that still hold one (their reads fail with EIO). A lookup
        answered just before a publish can leave the kernel an entry of a reused name
        (multi-pack-index) that the publish's invalidation missed; it lives for
        the dynamic entry timeout (1 s) at most, far below the grace."""
        d = self.derived[fmt]
        with self._lock:
            keep, revoked = self._keep(fmt, time.monotonic())
            cur = d.current()
            # (only older than the published set: a newer one may be on its way in, or
            # published by another member and not seen here yet)
            newest = 0 if cur is None else cur.number
            handles = self._move_to(fmt, cur, revoked)
            revoked = {n for n in revoked if self._holds.get((fmt, n), 0) > 0}
            doomed = {n for n in d.generations_on_disk() if n < newest and n not in keep}
            self._removing |= {(fmt, n) for n in doomed}
        for handle in handles:
            handle.revoke()
        if handles:
            log.warning(
                "derived %s: %d open handle(s) of retired generation(s) %s revoked "
                "(held past ALKFS_PACK_RETIRE_HOLD or beyond ALKFS_PACK_RETIRED_MAX)",
                fmt,
                len(handles),
                " ".join(map(str, sorted(revoked))),
            )
        try:
            on_disk = set(d.generations_on_disk())
            # only these: one retired since is not counted (a fleet's member: `held` are
            # its own holds, and the fleet's decide: alkfs/git/shared_packs.py)
            mine = (keep | {n for (f, n) in self._holds if f == fmt}) - revoked
            gone = d.prune(on_disk - doomed, mine=mine)
            if gone:
                log.info(
                    "derived %s: removed retired generation(s) %s",
                    fmt,
                    " ".join(map(str, sorted(gone))),
                )
            left = set(d.generations_on_disk())
            with self._lock:  # (in a fleet another member may have removed them)
                for key in [k for k in self._retired if k[0] == fmt and k[1] not in left]:
                    self._retired.pop(key, None)
                    self._retired_gens.pop(key, None)
                    self._removing.discard(key)
        except OSError as exc:
            log.warning("derived %s: could not remove retired generations: %s", fmt, exc)

    def _move_to(self, fmt: str, cur: Generation | None, revoked: set[int]) -> list[Revocable]:
        """(under the lock) The handles of `revoked` generations whose file the published
        set `cur` has too (the same inode: an intake hard-links the packs it keeps) now
        hold `cur` instead; the others are returned, to be revoked."""
        out: list[Revocable] = []
        for n in revoked:
            for handle in self._handles.pop((fmt, n), set()):
                rel = handle.shared_rel()
                if cur is not None and rel is not None and rel in cur.files:
                    self._holds[(fmt, n)] -= 1
                    if self._holds[(fmt, n)] <= 0:
                        del self._holds[(fmt, n)]
                    self._holds[(fmt, cur.number)] += 1
                    self._handles[(fmt, cur.number)].add(handle)
                    handle.number = cur.number
                else:
                    out.append(handle)
        return out

    def grace_over(self, grace_s: float | None = None) -> set[str]:
        """The formats with a retired generation kept longer than `grace_s` (default:
        the grace; a held one is looked at again until its hold ends)."""
        grace = retire_grace() if grace_s is None else grace_s
        now = time.monotonic()
        with self._lock:
            return {f for (f, _n), at in self._retired.items() if now - at >= grace}

    def held(self) -> dict[str, int]:
        with self._lock:
            return {f"{f}/gen-{n}": c for (f, n), c in self._holds.items()}

    # -- publishing (any thread) ------------------------------------------------------------
    def _published(self, fmt: str, old: Generation | None, new: Generation | None) -> None:
        listings.changed()  # (the fan-out listings and pack/ show another set now)
        if old is not None and (new is None or new.number != old.number):
            with self._lock:
                self._retired[(fmt, old.number)] = time.monotonic()
                self._retired_gens[(fmt, old.number)] = old
        for view in list(self.views):
            try:
                view(fmt, old, new)
            except Exception:
                log.exception("derived %s: a view failed to drop retired names", fmt)
        self.prune(fmt)

    async def build(self, fmt: str, blocking: bool = True) -> dict[str, object]:
        """Build and publish a set now; in a fleet, if another daemon is building it and
        not `blocking`, nothing (that daemon publishes it for every member)."""
        d = self.derived[fmt]
        async with self.building:
            result = await self.ctx.run_sync(functools.partial(d.build, blocking=blocking))
            if result is not None:  # what it packed is kept there alone (drain.py)
                await self.ctx.run_sync(d.drain)
        if result is None:
            return {"built": False, "why": "another daemon of the fleet is building"}
        self.last_built[fmt] = time.monotonic()
        return result.to_dict()

    def status(self) -> dict[str, PackFigures]:
        out: dict[str, PackFigures] = {}
        for fmt, d in self.derived.items():
            gen = d.current()
            out[fmt] = {
                "generation": None if gen is None else gen.number,
                "objects": 0 if gen is None else gen.objects,
                "packs": 0 if gen is None else len(gen.indexes),
                "bytes": 0 if gen is None else sum(gen.files.values()),
                "built_at": None if gen is None else gen.meta.get("built_at"),
                "last_error": d.last_error,
                "primary": d.primary,  # (its packs are the only copy of what they hold)
                "drained": d.drained,
            }
        return out


def served(ctx: Context) -> Served:
    """The mount's Served (made at first use, on the trio thread)."""
    return ctx.packs


async def repack_now(ctx: Context) -> dict[str, object]:
    """Build and publish a new set of every format that has objects (or a set) now."""
    s = served(ctx)
    out: dict[str, object] = {}
    if ctx.read_only:
        return out
    for fmt, d in s.derived.items():
        if d.current() is None and not await ctx.run_sync(d.new_since, None):
            continue
        out[fmt] = await s.build(fmt)
    return out


async def prepare(ctx: Context) -> None:
    """What the first git process after a mount would otherwise wait for, done before
    the mount is made (main) and again, cheaply, when `run` starts: the published sets
    opened (a fleet's member: the set published for the fleet) and every fan-out
    listing found (which are empty: their READDIRs are then answered in C)."""
    s = served(ctx)
    for d in s.derived.values():
        await ctx.run_sync(d.refresh)
    for fmt in s.derived:
        try:
            for prefix in range(256):
                await s.unpacked(fmt, prefix)
        except AlkfsError as exc:
            log.warning("derived %s: cannot list the fan-out yet (%s)", fmt, exc)


async def run(ctx: Context) -> None:
    """The background task (see the module docstring)."""
    s = served(ctx)
    await prepare(ctx)
    if not s.derived or ctx.read_only:
        return
    for d in s.derived.values():  # a set that no longer verifies is withdrawn, rebuilt
        await ctx.run_sync(d.withdraw_if_corrupt)
    for fmt, d in s.derived.items():  # a store written before drains: its rows go now
        try:
            async with s.building:
                await ctx.run_sync(d.drain)
        except Interrupted:
            return
        except Exception:
            log_failure(log, "derived %s: the drain failed (again after the next build)", fmt)
    knobs = settings()
    every, batch, poll = knobs.pack_every_s, knobs.pack_objects, knobs.pack_poll_interval_s
    window_rows = 0
    while True:
        if ctx.store.sweep_progress is not None:
            # a sweep runs: what it writes back loose before a rewrite (restore) is not an
            # arrival to pack (its deletions follow), and what it stages is counted once it
            # ends; building now rewrote the whole set after a repository's removal
            await trio.sleep(poll)
            continue
        try:
            rows = await ctx.run_sync(ctx.store.window.rows)
        except AlkfsError as exc:  # the database is away (StoreIO): the mount lives on
            log.warning("derived packs: cannot read the window (%s); again in %gs", exc, poll)
            await trio.sleep(poll)
            continue
        staging, window_rows = rows > window_rows, rows  # a sweep staged candidates
        reserve = ctx.store.reserve
        full = reserve is not None and reserve.full  # (the packs went first: packs.shed)
        for fmt, d in [] if full else s.derived.items():
            try:
                if d.drain_owed:  # (a fleet's drain waited for a member: look again)
                    async with s.building:
                        await ctx.run_sync(functools.partial(d.drain, 0.0))
                gen = d.current()
                if staging and bool(await ctx.run_sync(d.staged_in_current)):
                    # a set without them, published before their window ends, so that
                    # the sweep that deletes them need not rebuild
                    await s.build(fmt, blocking=False)
                    continue
                new = await ctx.run_sync(d.new_since, gen)
                if not new:
                    many = gen is not None and len(gen.indexes) > MAX_PACKS
                    if many and since_built(s.last_built.get(fmt), gen) >= every:
                        await s.build(fmt, blocking=False)  # (pushes kept as packs: one pack)
                    continue
                since = since_built(s.last_built.get(fmt), gen)
                if gen is None or new >= batch or since >= every:
                    await s.build(fmt, blocking=False)
            except Interrupted:
                log.info("derived %s: the build in progress stopped (the daemon stops)", fmt)
                return
            except Exception:
                log_failure(log, "derived %s: the intake build failed", fmt)
                s.last_built[fmt] = time.monotonic()  # not again before `every`
        for fmt in s.grace_over():  # retired sets past their grace: removable, if let go
            await ctx.run_sync(s.prune, fmt)
        await trio.sleep(min(poll, retire_grace()) if s.grace_over(0.0) else poll)
