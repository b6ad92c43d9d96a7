"""The builder: `Derived`, the derived packs of one format of one store: its state on
disk, its full and incremental builds, publishing, verify and withdraw. Parts of it live
beside it: the store's objects it reads (kvread.py), git (gitrun.py), the intake
(intake.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import NoSpace, StoreIO
from ...tiers.local import fsync_dir
from ..shared_packs import SharedPacks
from . import adopt as _adopt
from . import drop as _drop
from . import intake
from .drain import PRIMARY, Drain
from .gitrun import GitRun
from .kvread import KvRead
from .order import _graphable, _parse_commits, ordered_incremental, ordered_objects
from .sets import (
    _GEN,
    CURRENT,
    DERIVED_DIR,
    FORMATS,
    KEEP_TEXT,
    LOOSE_NEW_MAX,
    Generation,
    GraphLookup,
    PackIndex,
    _left_out_record,
    verify_trailer,
)
from .verify import Verify

if TYPE_CHECKING:
    from ...store import Store

log = logging.getLogger("alkfs.packs")


@dataclass
class BuildResult:
    fmt: str
    generation: int
    objects: int
    packs: int
    bytes: int
    new_objects: int
    mode: str
    seconds: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _fsync_tree(root: Path) -> None:
    for top, _dirs, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(top, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(top))


class Derived(Verify, Drain, KvRead, GitRun):
    """The derived packs of one format of one store (one instance per store and format:
    `derived_for`). Thread-safe; `lock` serializes builds, publishing and guarded deletes."""

    def __init__(self, store: Store, fmt: str) -> None:
        assert store.path is not None
        self.store = store
        self.fmt = fmt
        self.algo = FORMATS[fmt]
        self.root = store.path.absolute() / DERIVED_DIR / fmt  # (written into alternates)
        self.lock = threading.RLock()
        self.on_publish: list[Callable[[Generation | None, Generation | None], None]] = []
        # a mount serves the sets (daemon/packs.py): its readers hold retired ones, and
        # it prunes them; False: nobody holds a retired set, it goes at once
        self.mounted = False
        self._current: Generation | None = None
        self._swap = threading.Lock()  # (the published generation changes under it)
        self.last_build: BuildResult | None = None
        self.last_error: str | None = None
        self.broken: str | None = None  # a primary set that cannot be read (never replaced)
        self.drained = 0
        self.drain_owed = False  # (drain.py: a fleet's drain waits for a member)
        self.packs_verified: set[bytes] = set()  # (drain.py: their checksums)
        fleet = getattr(store, "fleet", None)
        # a fleet's members share the sets: published in the database (shared_packs.py)
        self.shared = None if fleet is None else SharedPacks(fleet, fmt)
        self.looked = fleet is None  # (a fleet's member: the published set, read once)
        self._who = str(os.getpid()) if fleet is None else fleet.node
        self._open()

    # -- state on disk -----------------------------------------------------------------
    def _read_current(self) -> int:
        if self.shared is not None:
            return self.shared.published()
        try:
            text = (self.root / CURRENT).read_text().strip()
            return int(text)
        except (FileNotFoundError, ValueError):
            return 0

    def _open(self) -> None:
        """Load the published generation; remove every other file (orphans, builds cut
        short, retired generations: nobody in this process can hold them yet)."""
        if self.shared is not None:
            return  # (read at the first refresh, in a thread; nothing removed: the fleet's)
        if not self.root.exists():
            return
        number = self._read_current()
        if number:
            try:
                gen = Generation.load(self.fmt, number, self.root / f"gen-{number}")
                if not gen.files and not (self.root / f"gen-{number}").is_dir():
                    raise FileNotFoundError(gen.root)
                self._current = gen
            except (OSError, StoreIO, ValueError) as exc:
                self._current = None
                if self.primary:  # (its packs are the only copy: kept, nothing built over it)
                    self.broken = f"generation {number} is unreadable ({exc})"
                    self.last_error = self.broken
                    log.error("derived %s: %s: kept, no set is built", self.fmt, self.broken)
                    return
                log.error(
                    "derived %s: generation %d is unreadable (%s): withdrawn", self.fmt, number, exc
                )
        if not self.store.holds_lock:
            return  # beside the lock holder (Store.open(lock=False)): its files, not ours
        keep = {CURRENT, PRIMARY}
        if self._current is not None:
            keep.add(f"gen-{self._current.number}")
        for child in self.root.iterdir():
            if child.name in keep:
                continue
            log.info("derived %s: removing %s (not published)", self.fmt, child.name)
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    child.unlink()

    def current(self) -> Generation | None:
        return self._current

    def _make_root(self) -> None:
        """STORE/derived/<fmt>, both 0700 as every directory of the store (alkfs/privacy.py:
        the next open's tighten then never walks into the sets git writes 0444/0755)."""
        self.root.parent.mkdir(mode=0o700, exist_ok=True)
        self.root.mkdir(mode=0o700, exist_ok=True)

    def refresh(self, what: str | None = None) -> None:
        """A fleet member: serve the generation published for the fleet, if it changed
        (the listener's `alkfs_packs` notice, a reconnect, before a build or a guard)."""
        if self.shared is None or what not in (None, self.fmt):
            return
        with self._swap:
            self._refresh()
            self.looked = True

    def _refresh(self) -> None:
        assert self.shared is not None
        for _ in range(5):
            number = self.shared.published()
            cur = self._current
            if number == (0 if cur is None else cur.number):
                return
            self.shared.will_serve(number)  # (before the second look: see shared_packs)
            if self.shared.published() != number:
                continue
            try:
                gen = None
                if number:
                    where = self.root / f"gen-{number}"
                    if not where.is_dir():
                        raise FileNotFoundError(f"{where} is not there")
                    gen = Generation.load(self.fmt, number, where)
            except (OSError, StoreIO, ValueError) as exc:
                log.error("derived %s: generation %d is unreadable: %s", self.fmt, number, exc)
                return
            self._current = gen
            self.shared.serve_only(number)
            self._tell(cur, gen)
            return

    def _tell(self, old: Generation | None, new: Generation | None) -> None:
        for callback in list(self.on_publish):
            try:
                callback(old, new)
            except Exception:
                log.exception("derived %s: a publish callback failed", self.fmt)

    def _next_number(self) -> int:
        on_disk = self.generations_on_disk()
        if self.shared is not None:
            return self.shared.new_number(on_disk)
        return max([*on_disk, self._read_current(), 0]) + 1

    def generations_on_disk(self) -> list[int]:
        if not self.root.exists():
            return []
        out = []
        for child in self.root.iterdir():
            m = _GEN.fullmatch(child.name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def prune(self, held: Iterable[int] = (), mine: Iterable[int] | None = None) -> list[int]:
        """Remove retired generations nobody holds; returns their numbers. In a fleet,
        `mine` (default `held`) are the generations this process has files of open, and
        a generation goes only when no live member holds it."""
        if self.shared is not None:
            cur = self._current
            serving = 0 if cur is None else cur.number
            self.shared.sync(set(held if mine is None else mine), serving)
            gone = []
            for number in self.shared.removable(self.generations_on_disk()):
                shutil.rmtree(self.root / f"gen-{number}", ignore_errors=True)
                gone.append(number)
            return gone
        keep = set(held)
        cur = self._current
        if cur is not None:
            keep.add(cur.number)
        gone = []
        for number in self.generations_on_disk():
            if number not in keep and number != self._read_current():
                shutil.rmtree(self.root / f"gen-{number}", ignore_errors=True)
                gone.append(number)
        return gone

    # (the store's objects: KvRead, kvread.py; git: GitRun, gitrun.py)

    # -- building and publishing ---------------------------------------------------------
    def build(
        self, exclude: Iterable[bytes] = (), *, prune: bool = False, blocking: bool = True
    ) -> BuildResult | None:
        """Build and publish a new set of every kv object of the format except `exclude`
        (digests) and anything staged for deletion. `prune`: remove the retired
        generation at once (no reader can hold it: no mount). In a fleet, only its one
        builder builds: None when another is and `blocking` was not asked."""
        if self.broken is not None:
            raise StoreIO(
                f"derived {self.fmt}: {self.broken}: not rebuilt (its packs are the "
                "only copy of their objects)"
            )
        reserve = self.store.reserve
        if reserve is not None and reserve.full:  # (derived data went first: see shed)
            raise NoSpace("the disk is full: derived packs are built again once it is not")
        with self.lock, self._builder(blocking) as building:
            if not building:
                return None
            self.refresh()  # (a fleet member builds on the latest published set)
            t0 = time.monotonic()
            exclude = set(exclude)
            try:
                # (where the packs are their only copy, what goes is stored loose again
                # first: one whose deletion is cancelled stays, and is packed again)
                self.restore(sorted(exclude))
                result = self._build(exclude)
            except BaseException as exc:
                self.last_error = str(exc)
                if self.shared is not None:
                    self.shared.building.clear()  # (its directory, if any, is pruned)
                raise
            result.seconds = round(time.monotonic() - t0, 3)
            self.last_build = result
            self.last_error = None
            if prune:
                self.prune()
            log.info("derived %s: published %s", self.fmt, json.dumps(result.to_dict()))
            return result

    def _builder(self, blocking: bool) -> contextlib.AbstractContextManager[bool]:
        if self.shared is None:
            return contextlib.nullcontext(True)
        return self.shared.builder(blocking)

    def staged_in_current(self) -> int:
        """How many objects staged for deletion the published set holds in its main packs
        (a build moves them into its staged pack: publish it before their window ends, so
        the sweep that deletes them only drops that pack). 0 when they are exactly
        what some main packs hold (a repository removed whose objects were imported on
        their own): that sweep drops those packs whole, nothing needs rebuilding first."""
        gen = self._current
        if gen is None or not gen.indexes:
            return 0
        staged = self._staged()
        held = sum(1 for d in staged if gen.main_holds(d))
        if held and len(gen.indexes) > 1 and _drop.whole_packs(gen, staged) is not None:
            return 0
        return held

    def _staged(self) -> set[bytes]:
        prefix = self.algo.value
        return {bytes(k[1:]) for k in self.store.window.staged_keys() if k[0] == prefix}

    def _plan(
        self, prev: Generation | None, skip: set[bytes]
    ) -> tuple[list[tuple[bytes, bytes]], list[bytes], int, list[bytes] | None, set[bytes]]:
        """(pack-objects input, graph commits, top row id, new objects or None for a full
        build, every kv object of the format the scan saw). Mostly old objects: only the
        commits and the new objects are read. Nothing stored since `prev`: the kv is not
        scanned at all (`_plan_rewrite`)."""
        if prev is not None and prev.indexes:
            rewrite = self._plan_rewrite(prev, skip)
            if rewrite is not None:
                return rewrite
            if self.primary:
                return self._plan_carry(prev, skip)
            kinds, top = self._scan_kinds()
            seen = set(kinds)
            for d in skip:
                kinds.pop(d, None)
            previous = prev.pack_order()
            known = set(previous)
            fresh = [d for d in kinds if d not in known]
            if len(fresh) <= max(LOOSE_NEW_MAX, len(kinds) // 4):
                wanted = [
                    d for d, k in kinds.items() if k == b"co" or (d not in known and k != b"bl")
                ]
                fetched = dict(self._read_many(wanted))
                for d in wanted:  # corrupt (logged) or gone since the scan: left out
                    if d not in fetched:
                        kinds.pop(d, None)
                fresh = [d for d in fresh if d in kinds]
                order, graph = ordered_incremental(kinds, fetched, previous, self.fmt)
                return order, graph, top, fresh, seen
        objects, blobs, corrupt, top = self._scan()
        seen = {*objects, *blobs, *corrupt}
        if skip:
            for d in skip:
                objects.pop(d, None)
            blobs = [b for b in blobs if b not in skip]
        order, graph = ordered_objects(objects, blobs, self.fmt)
        return order, graph, top, None, seen

    def _plan_rewrite(
        self, prev: Generation, skip: set[bytes]
    ) -> tuple[list[tuple[bytes, bytes]], list[bytes], int, list[bytes], set[bytes]] | None:
        """`_plan` for a set that only loses objects (a sweep's staged or deleted ones):
        nothing was stored since `prev` was built and its record of what it left out is
        the truth (sqlite), so the kv objects of the format are `prev`'s and those it left
        out (looked up: one deleted since goes), and the new set is `prev`'s objects in
        its write order without `skip` (pack-objects reuses their deltas from `prev`,
        its alternate), its commit-graph `prev`'s commits without `skip`, plus what `prev`
        withheld that is no longer skipped (live again: read from the kv, packed anew).
        The kv is never scanned and no commit is read. None when that does not hold."""
        recorded = self.left_out(prev)
        withheld = prev.withheld()
        if recorded is None or withheld is None or self.new_since(prev):
            return None
        top = int(prev.meta.get("max_rowid", 0))
        previous = prev.pack_order()
        outside = list(dict.fromkeys([*recorded, *withheld]))
        prefix = bytes([self.algo.value])
        present = {k[1:] for k, _v in self._kv().values([prefix + d for d in outside])}
        seen = set(previous)
        seen.update(present)
        order = [(d, b"") for d in previous if d not in skip]
        fresh = [d for d in withheld if d in present and d not in skip]
        graph = [c for c in prev.graph_commits() if c not in skip]
        order += [(d, b"") for d in fresh if d not in prev]
        return order, graph, top, fresh, seen

    def _plan_carry(
        self, prev: Generation, skip: set[bytes]
    ) -> tuple[list[tuple[bytes, bytes]], list[bytes], int, list[bytes], set[bytes]]:
        """`_plan` when the sets are the only copy of what they hold (drain.py): every
        object of `prev` but `skip`, in its write order (pack-objects reuses their deltas
        from `prev`, its alternate), then the kv objects `prev` lacks but `skip` in
        rev-list order (written loose); its commit-graph `prev`'s commits but `skip`, and
        the new commits whose ancestors all are in it. The kv holds what is not packed
        yet, so its scan is short."""
        kinds, top = self._scan_kinds()
        previous = list(dict.fromkeys(prev.pack_order()))
        known = set(previous)
        seen = set(kinds)
        seen.update(known)
        fresh_kinds = {d: k for d, k in kinds.items() if d not in known and d not in skip}
        wanted = [d for d, k in fresh_kinds.items() if k != b"bl"]
        fetched = dict(self._read_many(wanted))
        blobs = [d for d, k in fresh_kinds.items() if k == b"bl"]
        new_order, _graph = ordered_objects(fetched, blobs, self.fmt)
        old_graph = prev.graph_commits() - skip
        commits = _parse_commits(fetched, 2 * self.algo.digest_len)
        graph = sorted(old_graph | set(_graphable(commits, dict.fromkeys(old_graph, True))))
        order = [(d, b"") for d in previous if d not in skip] + new_order
        return order, graph, top, [d for d, _p in new_order], seen

    # an import's pack, beside the previous set's (adopt.py)
    can_adopt = _adopt.can_adopt
    adopt = _adopt.adopt
    keep_pack = _adopt.keep_pack

    # the intake, a pack beside the previous set's (intake.py)
    _intake_plan = intake._intake_plan
    _build_intake = intake._build_intake
    _intake_graph = intake._intake_graph

    def _build(self, exclude: set[bytes]) -> BuildResult:
        prev = self._current
        if not exclude and prev is not None:
            plan = self._intake_plan(prev)
            if plan is not None:
                return self._build_intake(prev, *plan)
        if exclude and prev is not None and self._only_staged(prev, exclude):
            # (what it withheld stays withheld: none of it is packed by this set either;
            # where the packs are the only copy, what else the dropped pack holds, staged
            # for later, is written back loose first: served loose, as elsewhere)
            assert prev.staged_index is not None
            self.restore(list(prev.staged_index.digests()))
            held = prev.withheld()
            top = int(prev.meta.get("max_rowid", 0))
            return self._build_intake(prev, {}, top, [], held, True)
        if exclude and prev is not None and len(prev.indexes) > 1:
            whole = _drop.whole_packs(prev, exclude)
            if whole is not None:  # (exactly what some packs hold: those packs go)
                return _drop.drop_packs(self, prev, *whole)
        staged = self._staged()
        order, graph_commits, top, fresh, seen = self._plan(prev, exclude | staged)
        number = self._next_number()
        self._make_root()
        tmp = self.root / f"tmp-{self._who}-{number}-{uuid.uuid4().hex[:8]}"
        try:
            repo = tmp / "repo"
            out = tmp / "gen"
            (out / "pack").mkdir(parents=True)
            (out / "info").mkdir()
            self._git(repo, "init", "-q", "--bare", f"--object-format={self.fmt}", str(repo))
            odb = repo / "objects"
            mode = "empty"
            new = 0
            if order:
                new = len(order) if fresh is None else len(fresh)
                if fresh is not None and prev is not None:
                    mode = "incremental"
                    (odb / "info" / "alternates").write_text(f"{prev.root}\n")
                    self._write_loose(odb, self._read_many(fresh))
                    pack_args = []
                else:
                    mode = "full"
                    raw = odb / "pack" / "tmp-raw.pack"
                    self._write_raw_pack(raw, self._read_many([d for d, _p in order]))
                    self._git(repo, "index-pack", str(raw))
                    pack_args = ["--no-reuse-object"]
                self._pack_objects(repo, out, order, *pack_args)
            in_staged, staged_idx = self._pack_staged(tmp, out, sorted((staged - exclude) & seen))
            if order or in_staged:
                for p in (out / "pack").glob("*.idx"):
                    p.with_suffix(".keep").write_bytes(KEEP_TEXT)
                self._index_files(repo, out, graph_commits, "no commit-graph in this set")
            self._check(out)
            left = None
            if self._records_left_out:
                left = _left_out_record(seen.difference(d for d, _p in order) - in_staged)
            objects = len(order) + len(in_staged)
            # (staged objects are in its staged pack; what it left out for a sweep about
            # to delete it is withheld: one whose deletion is cancelled is packed again)
            withheld = _left_out_record(exclude & seen)
            return self._finish(out, number, top, objects, mode, left, new, staged_idx, withheld)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _only_staged(self, prev: Generation, exclude: set[bytes]) -> bool:
        """Whether leaving out `exclude` is dropping the set's staged pack: none of them
        is in another pack, and no commit-graph layer names one (an intake's layer could
        name a staged commit that a new child had made live again for a while)."""
        if prev.staged_index is None or len(prev.indexes) < 2:
            return False  # (nothing but staged objects: the build publishes an empty set)
        if any(prev.main_holds(d) for d in exclude):
            return False
        try:
            with GraphLookup(prev) as named:
                return not any(d in named for d in exclude)
        except (OSError, StoreIO, ValueError) as exc:
            log.warning("derived %s: cannot read the commit-graph (%s): rebuilding", self.fmt, exc)
            return False

    def _pack_staged(self, tmp: Path, out: Path, digests: list[bytes]) -> tuple[set[bytes], str]:
        """A pack of its own in `out` for the kv objects staged for deletion (verified;
        one gone or corrupt meanwhile is left out): they stay packed, and so off the
        fan-out listings, for their window, yet none is in a main pack, so the sweep that
        deletes them publishes the set without this pack (`_build_intake` with `drop`:
        links and a multi-pack-index) instead of rewriting one. No commit-graph layer names them
        (a build's graph leaves staged commits out; an intake's leaves out commits with an
        ancestor in this pack: _intake_graph). Returns (what it holds, its idx's name) or
        (empty, "")."""
        if not digests:
            return set(), ""
        repo = tmp / "staged"
        self._git(repo, "init", "-q", "--bare", f"--object-format={self.fmt}", str(repo))
        held: list[bytes] = []

        def kept() -> Iterator[tuple[bytes, bytes]]:
            for d, data in self._read_many(digests):
                held.append(d)
                yield d, data

        self._write_loose(repo / "objects", kept())
        if not held:
            return set(), ""
        made = self._pack_objects(repo, out, [(d, b"") for d in held])
        if not (out / "pack" / made).is_file():
            raise StoreIO(f"derived {self.fmt}: the staged objects' pack was not written")
        return set(held), made

    def _finish(
        self,
        out: Path,
        number: int,
        top: int,
        objects: int,
        mode: str,
        left_out: list[str] | None,
        new: int,
        staged_pack: str = "",
        withheld: list[str] | None = None,
    ) -> BuildResult:
        """Record what the checked set in `out` covers, rename it into place as
        generation `number` (durably), check it holds `objects`, and publish it.
        `staged_pack`: the idx name of its pack of staged objects (see _pack_staged);
        `withheld`: see Generation.withheld (None: not recorded, too many)."""
        meta = {
            "generation": number,
            "max_rowid": top,
            "objects": objects,
            "mode": mode,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "left_out": left_out,
            "staged_pack": staged_pack or None,
            "withheld": withheld,
        }
        (out / "alkfs.json").write_text(json.dumps(meta) + "\n")
        _fsync_tree(out)
        final = self.root / f"gen-{number}"
        os.rename(out, final)
        fsync_dir(self.root)
        gen = Generation.load(self.fmt, number, final)
        if gen.objects != objects:
            raise StoreIO(
                f"derived {self.fmt}: the packs hold {gen.objects} objects, not {objects}"
            )
        self._publish(gen)
        size = sum(gen.files.values())
        return BuildResult(self.fmt, number, gen.objects, len(gen.indexes), size, new, mode, 0.0)

    def _check(self, out: Path, skip: set[Path] = frozenset()) -> None:  # type: ignore[assignment]
        """Every file's trailer checksum, and each idx's copy of its pack's checksum
        (`skip`: files of the previous set, verified when it was built)."""
        for p in sorted(out.rglob("*")):
            if p.is_dir() or p.suffix == ".keep" or p.name.endswith("-chain") or p in skip:
                continue
            if p.name == "alkfs.json" and p.parent == out:
                continue
            trailer = verify_trailer(p, self.fmt)
            if p.suffix == ".idx":
                pack = p.with_suffix(".pack")
                if PackIndex(p, self.fmt).pack_checksum != verify_trailer(pack, self.fmt):
                    raise StoreIO(f"{p}: its pack checksum is not its pack's")
            del trailer

    def _publish(self, gen: Generation | None) -> None:
        number = 0 if gen is None else gen.number
        if self.shared is not None:
            with self._swap:
                if not self.shared.publish(number):
                    raise StoreIO(f"derived {self.fmt}: generation {number} was overtaken")
                old, self._current = self._current, gen
            self._tell(old, gen)
            return
        tmp = self.root / f"{CURRENT}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{number}\n")
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, self.root / CURRENT)
        fsync_dir(self.root)
        old, self._current = self._current, gen
        self._tell(old, gen)
