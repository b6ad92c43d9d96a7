"""Deleting whole packs: when what a sweep deletes is exactly what some main packs hold
(a repository removed whose objects an import packed on their own), the new set is the
previous one without those packs and without the top commit-graph layers that name only
their commits: hard links, a new multi-pack-index, nothing rewritten (geometric layering:
a small deletion never rewrites the history). Methods of `Derived` (builder.py),
written here as functions of it (as intake.py)."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import StoreIO
from .sets import FORMATS, Generation, PackIndex, _graph_oids, _left_out_record

if TYPE_CHECKING:
    from .builder import BuildResult, Derived

log = logging.getLogger("alkfs.packs")

GRAPHS = "info/commit-graphs/"
CHAIN = GRAPHS + "commit-graph-chain"


def whole_packs(prev: Generation, exclude: set[bytes]) -> tuple[list[PackIndex], list[str]] | None:
    """The main packs of `prev` that hold only objects of `exclude` and the top layers
    of its commit-graph chain that name only commits of `exclude`, when dropping them
    leaves a set that lists none of `exclude` and whose layers name only commits it
    holds; None otherwise (the set is rewritten instead)."""
    staged = prev.staged_index
    main = [idx for idx in prev.indexes if idx is not staged]
    gone = [idx for idx in main if idx.count and all(d in exclude for d in idx.digests())]
    if not gone:
        return None
    rest = [idx for idx in main if idx not in gone]
    if not rest:
        return None  # (an empty set: the rewrite publishes it)
    if staged is not None and any(d in staged for d in exclude):
        return None
    if any(d in idx for d in exclude for idx in rest):
        return None
    chain: list[str] = []
    if CHAIN in prev.files:
        chain = (prev.root / CHAIN).read_text().split()
    elif any(r.startswith(GRAPHS) for r in prev.files):
        return None  # (a graph outside a chain: not what a set is made of)
    hlen = FORMATS[prev.fmt].digest_len
    layers = [_graph_oids(prev.root / f"{GRAPHS}graph-{h}.graph", hlen) for h in chain]
    dropped: list[str] = []
    while layers and layers[-1] <= exclude:
        layers.pop()
        dropped.append(chain.pop())
    if any(not names.isdisjoint(exclude) for names in layers):
        return None
    return gone, dropped


def drop_packs(
    self: Derived, prev: Generation, gone: list[PackIndex], layers: list[str]
) -> BuildResult:
    """Publish `prev` without the packs `gone` and the top commit-graph `layers` (see
    `whole_packs`); what they held is withheld (a deletion arbitration cancels is
    packed again by the next intake)."""
    number = self._next_number()
    tmp = self.root / f"tmp-{self._who}-{number}-{uuid.uuid4().hex[:8]}"
    stems = {"pack/" + idx.path.stem for idx in gone}
    files = {f"{GRAPHS}graph-{h}.graph" for h in layers}
    held_before = prev.withheld()
    dropped: set[bytes] = set()
    for idx in gone:
        dropped.update(idx.digests())
    linked: set[Path] = set()
    try:
        out = tmp / "gen"
        (out / "pack").mkdir(parents=True)
        (out / "info").mkdir()
        for rel in prev.files:
            if rel == "pack/multi-pack-index" or rel in files or rel == CHAIN:
                continue
            if rel.rsplit(".", 1)[0] in stems:
                continue
            src, dst = prev.root / rel, out / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dst)
            linked.add(dst)
        if CHAIN in prev.files:
            chain = (prev.root / CHAIN).read_text().split()
            kept = chain[: len(chain) - len(layers)]
            if kept:
                (out / CHAIN).write_text("".join(h + "\n" for h in kept))
        repo = tmp / "repo"
        self._git(repo, "init", "-q", "--bare", f"--object-format={self.fmt}", str(repo))
        self._git(repo, "multi-pack-index", "write", objdir=out)
        self._check(out, skip=linked)
        top = int(prev.meta.get("max_rowid", 0))
        before = self.still_left_out(prev)
        record = None if before is None else _left_out_record(set(before))
        held = None if held_before is None else _left_out_record({*held_before, *dropped})
        objects = prev.objects - sum(idx.count for idx in gone)
        kept_staged = "" if prev.staged_index is None else prev.staged_index.path.name
        result: BuildResult = self._finish(
            out, number, top, objects, "drop-packs", record, 0, kept_staged, held
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "derived %s: %d pack(s) of %d objects dropped whole, %d commit-graph layer(s) with them",
        self.fmt,
        len(gone),
        len(dropped),
        len(layers),
    )
    if result.objects != objects:
        raise StoreIO(f"derived {self.fmt}: the set holds {result.objects}, not {objects}")
    return result
