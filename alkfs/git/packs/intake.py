"""The intake: a pack of what arrived since the published set was built, beside that
set's packs (hard links), with a new multi-pack-index and one more commit-graph layer;
and the set without its pack of staged objects (`drop`). Methods of `Derived`
(builder.py), written here as functions of it (they use its other methods throughout)."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import StoreIO
from .order import _TREE_ENTRY, _graphable, _parse_commits, _walk
from .sets import (
    FORMATS,
    GRAPH_WALK_MAX,
    KEEP_TEXT,
    LOOSE_NEW_MAX,
    MAX_PACKS,
    Generation,
    GraphLookup,
    _hash,
    _left_out_record,
)

if TYPE_CHECKING:
    from .builder import BuildResult, Derived

log = logging.getLogger("alkfs.packs")


def _intake_plan(
    self: Derived, prev: Generation
) -> tuple[dict[bytes, bytes], int, list[bytes], list[bytes]] | None:
    """The objects an intake pack beside the previous set's packs would hold (verified
    bytes), the top row id, the arrivals it leaves out (staged or corrupt) and what
    it withholds (see Generation.withheld); None when the set must be consolidated
    instead: it holds objects now staged for deletion, it has MAX_PACKS packs, the
    intake packs would hold more than half as many objects as the largest
    (geometric, factor 2), or it recorded no `withheld`.

    The objects it holds are the arrivals since the previous set was built, and what
    that set withheld that is still stored and staged no more: a candidate a sweep
    left out (or dropped with the staged pack) whose deletion arbitration then
    cancelled (made live again), packed by the next intake, not left loose for good."""
    if not prev.indexes or len(prev.indexes) >= MAX_PACKS:
        return None
    withheld = prev.withheld()
    if withheld is None:
        return None
    staged = self._staged()
    if any(prev.main_holds(d) for d in staged):
        return None
    lo, hi = self._range()
    kv = self._kv()
    digest = _hash(self.fmt)
    after = int(prev.meta.get("max_rowid", 0))
    new: dict[bytes, bytes] = {}
    left: list[bytes] = []
    still: list[bytes] = []  # withheld: staged (or arrived staged)
    if withheld:
        tag = bytes([self.algo.value])
        have = kv.present([tag + d for d in withheld])
        back: list[bytes] = []
        for d in withheld:
            if tag + d not in have or d in prev:
                continue  # (deleted since, or packed again)
            (still if d in staged else back).append(d)
        if len(back) > LOOSE_NEW_MAX:
            return None
        new.update(self._read_many(back))  # (one corrupt or gone meanwhile: logged, out)
    with kv.db.snapshot() as conn:
        top = kv.high_water(conn)
        for key, value in kv.arrived_values(lo, hi, after, conn):
            d = key[1:]
            if d in prev or d in new:
                continue
            if d in staged:
                left.append(d)
                still.append(d)
                continue
            if digest(value).digest() != d:
                log.error("derived %s: corrupt object %s left out", self.fmt, d.hex())
                left.append(d)
                continue
            new[d] = value
            if len(new) > LOOSE_NEW_MAX:
                return None
    counts = sorted(idx.count for idx in prev.indexes if idx is not prev.staged_index)
    if not counts or 2 * (sum(counts[:-1]) + len(new)) > counts[-1]:
        return None
    return new, top, left, sorted(set(still))


def _build_intake(
    self: Derived,
    prev: Generation,
    new: dict[bytes, bytes],
    top: int,
    left: list[bytes],
    withheld: list[bytes] | None,
    drop: bool = False,
) -> BuildResult:
    """A set of the previous set's files (hard links: the same immutable files) plus
    one intake pack of `new`, a new multi-pack-index and one more commit-graph layer.
    It leaves out what the previous set did and `left` (none recorded if that did not
    record its own), less what `new` packs again, and withholds `withheld` (None: it
    records none). `drop`: without the previous set's pack of staged objects (a
    sweep deletes them: see _pack_staged); what it held is served loose, and withheld
    (a deletion arbitration cancels is packed by the next intake)."""
    n = FORMATS[self.fmt].digest_len
    number = self._next_number()
    tmp = self.root / f"tmp-{self._who}-{number}-{uuid.uuid4().hex[:8]}"
    linked: set[Path] = set()
    staged = prev.staged_index
    dropped: set[bytes] = set()
    gone = ""  # (the dropped pack's files: pack/<name>.{idx,pack,keep})
    if drop and staged is not None:
        dropped = set(staged.digests())
        gone = "pack/" + staged.path.stem
    try:
        repo = tmp / "repo"
        out = tmp / "gen"
        (out / "pack").mkdir(parents=True)
        (out / "info").mkdir()
        for rel in prev.files:
            src, dst = prev.root / rel, out / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if rel == "pack/multi-pack-index":
                continue  # written anew below
            if gone and rel.rsplit(".", 1)[0] == gone:
                continue
            if rel.endswith("-chain"):
                shutil.copyfile(src, dst)  # git replaces it: never share it
            else:
                os.link(src, dst)
                linked.add(dst)
        if new:
            self._git(repo, "init", "-q", "--bare", f"--object-format={self.fmt}", str(repo))
            self._write_loose(repo / "objects", new.items())
            commits = _parse_commits(new, 2 * n)
            seen: set[bytes] = set()
            order: list[tuple[bytes, bytes]] = []
            for d in sorted(d for d, v in new.items() if v.startswith(b"tag ")):
                seen.add(d)
                order.append((d, b""))
            dated = sorted(commits, key=lambda d: (-commits[d][2], d))
            for c in dated:
                seen.add(c)
                order.append((c, b""))
            trees = {d: v for d, v in new.items() if v.startswith(b"tree ")}
            blobs = {d for d, v in new.items() if v.startswith(b"blob ")}
            for c in dated:
                tree = commits[c][0]
                if tree is not None and tree in trees:
                    _walk(tree, trees, blobs, seen, order, _TREE_ENTRY[n])
            order += [(d, b"") for d in sorted(new.keys() - seen)]
            self._pack_objects(repo, out, order)
            for p in (out / "pack").glob("*.idx"):
                if p not in linked:
                    p.with_suffix(".keep").write_bytes(KEEP_TEXT)
            graph = self._intake_graph(prev, commits)
            self._index_files(repo, out, graph, "the commit-graph keeps its layers")
        else:
            self._git(repo, "init", "-q", "--bare", f"--object-format={self.fmt}", str(repo))
            self._git(repo, "multi-pack-index", "write", objdir=out)
        self._check(out, skip=linked)
        before = self.still_left_out(prev)
        record = None
        if before is not None:
            record = _left_out_record({*before, *left, *dropped}.difference(new))
        held = None if withheld is None else _left_out_record({*withheld, *dropped})
        objects = prev.objects + len(new) - len(dropped)
        mode = "drop" if drop else "intake"
        kept = "" if drop or staged is None else staged.path.name
        return self._finish(out, number, top, objects, mode, record, len(new), kept, held)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _intake_graph(
    self: Derived, prev: Generation, commits: dict[bytes, tuple[bytes | None, list[bytes], int]]
) -> list[bytes]:
    """The new `commits` an intake's commit-graph layer may hold: those whose every
    ancestor is named by a layer of `prev`, or is a new commit, or is in a main pack
    of `prev` (not its staged pack: see _pack_staged) with the same holding for its
    own parents. `git commit-graph write --split` adds an ancestor no layer names
    by reading it from the set's packs, and refuses the whole layer when one is not
    there ("could not read"): a commit packed without a layer (an ancestor of it was
    staged, or in no pack) must not let its children in. Such old commits are read
    from the store (up to GRAPH_WALK_MAX; past that, the rest count as missing)."""
    try:
        layers = GraphLookup(prev)
    except (OSError, StoreIO, ValueError) as exc:
        log.warning("derived %s: cannot read the commit-graph (%s): no new layer", self.fmt, exc)
        return []
    known: dict[bytes, bool] = {}
    walked: dict[bytes, tuple[bytes | None, list[bytes], int]] = dict(commits)
    budget = GRAPH_WALK_MAX
    n = FORMATS[self.fmt].digest_len
    with layers:
        todo = {p for info in commits.values() for p in info[1]}
        while todo:
            read: list[bytes] = []
            for p in todo:
                if p in walked or p in known:
                    continue
                if p in layers:
                    known[p] = True
                elif budget > 0 and prev.main_holds(p):
                    read.append(p)
                    budget -= 1
                else:
                    known[p] = False
            todo = set()
            if not read:
                break
            fetched = dict(self._read_many(read))
            for p in read:
                if p not in fetched:  # (corrupt, logged, or gone)
                    known[p] = False
            found = _parse_commits(fetched, 2 * n)
            for p in read:
                if p in fetched and p not in found:  # (not a commit)
                    known[p] = False
            walked.update(found)
            todo = {q for info in found.values() for q in info[1]}
    ok = set(_graphable(walked, known))
    return sorted(c for c in commits if c in ok)
