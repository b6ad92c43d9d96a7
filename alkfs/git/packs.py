"""Derived packs: the store's git objects of one format as real git packs, built by git.

Layout (private to the store, never reached through the mount's own files)::

    STORE/derived/<fmt>/CURRENT          "<N>\\n": the published generation (0: none)
    STORE/derived/<fmt>/gen-<N>/         one published set, immutable once renamed here
        pack/pack-<h>.pack .idx .keep    pack v2 + idx v2 (sha256 forms for git-sha256)
        pack/multi-pack-index            MIDX v1 over the set's packs
        info/commit-graphs/              a split commit-graph (chain + graph-<h>.graph)
        alkfs.json                       what the set covers (not served): its highest
                                         row id, and the kv objects of the format it
                                         left out (`left_out`, hex, up to LEFT_OUT_MAX;
                                         sqlite only: see Derived._records_left_out),
                                         and those it left out of every pack because
                                         they were staged or being deleted (`withheld`)
    STORE/derived/<fmt>/tmp-*            a build in progress (removed at open)

A build reads verified objects straight from the store's kv table (large-tier objects
stay out: git reads them loose), orders them as `git rev-list --objects` would (commits
newest first, each followed by its trees and blobs with their paths, which is what gives
`git pack-objects` good deltas), and has git write the pack: objects new since the
previous generation go in as loose files of a private bare repository whose alternate
is the previous generation (so its deltas are reused and the new objects are deltified
against everything); a first build (or one where most objects are new) writes them as one
undeltified pack that `git index-pack` checks, and `pack-objects --no-reuse-object`
deltifies. Then `.keep`, `git multi-pack-index write` and `git commit-graph write --split`;
every file's trailer checksum is verified before the set is renamed into place and CURRENT
is replaced atomically (write, fsync, rename, fsync the directory).

Intake (`build()` with nothing to exclude): objects stored since the previous set was
built (by row id), and those it withheld that are still stored and no longer staged (a
candidate whose deletion arbitration cancelled: live again), go into one small pack
beside the previous set's packs, which the new generation shares as hard links, with a
new multi-pack-index and one more commit-graph layer. That layer names only new commits
whose every ancestor a layer names already or a main pack of the set holds (checked
down to the layers: git reads an ancestor no layer names from the packs, and fails the
layer if one is in none of them), so none names a staged commit. A failed `commit-graph
write` leaves the layers as they were (logged: the set is whole without the new one).
The set is consolidated into one pack instead (the full or incremental build above) when
the intake packs would hold more than half as many objects as its largest pack
(geometric, factor 2), when it has MAX_PACKS packs, when a pack other than its staged
pack holds an object now staged for deletion, when the set recorded no `withheld` (too
many), or when objects must be excluded (a sweep's guard).

Objects staged for deletion: a full or incremental build leaves them out of its main
pack and writes them into a pack of their own (the set's staged pack, named in
alkfs.json), so that for their window they stay packed, and off the fan-out listings,
while one that is made live again needs nothing. No commit-graph layer names them.

Publishing never changes a file: a new set gets a new generation directory. A retired
generation stays on disk until `prune` is told nobody holds it (the daemon counts its open
handles; a process without a mount prunes at once).

Deletion safety: `guard_deletes` is held by the sweep once, around all of its deletions
(every candidate due when it starts, taken and deleted batch by batch under it, each
re-arbitrated at its delete). If any of those keys is in the published set, one set
without them all is published first, once a sweep however many batches it takes:
when the staged pack is the only pack that holds any of them (and no commit-graph layer
names one), the set without that pack (hard links and a new multi-pack-index: the sweep
waits for no pack rewrite; what else it held is served loose); otherwise a set built
without them (and with everything else staged in a staged pack). Builds take the same
lock, so no set published after the deletes can list a deleted object. What it left out
is withheld: one whose deletion arbitration cancels is packed again by the next intake.
If that build fails (a full disk), the packs are withdrawn (an empty generation is
published) and every object is served loose.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ..errors import Interrupted, NoSpace, StoreIO
from ..keys import Algorithm
from ..tiers.local import fsync_dir
from ..tiers.sql import SqlTier
from .shared_packs import SharedPacks

if TYPE_CHECKING:
    from ..store import Store

log = logging.getLogger("alkfs.packs")

DERIVED_DIR = "derived"
CURRENT = "CURRENT"
FORMATS = {"sha1": Algorithm.GIT_SHA1, "sha256": Algorithm.GIT_SHA256}
TYPE_CODES = {b"commit": 1, b"tree": 2, b"blob": 3, b"tag": 4}
STOP_POLL_S = 0.25  # how often a running git is looked at for the store's stop
LOOSE_NEW_MAX = 20_000  # new objects written loose for an incremental build (else a raw pack)
MAX_PACKS = 12  # packs in a set before an intake consolidates them into one
# A set records the kv objects (row id <= its max_rowid) it left out, so that the mount's
# fan-out listings need not compare every stored key with the set to find them (O(store)
# at the first listing of every generation); past this many it records none (null).
LEFT_OUT_MAX = 50_000
# commits an intake reads from the store to decide whether its new commits may go into a
# commit-graph layer (old ones packed without a layer, between them and the layers)
GRAPH_WALK_MAX = 100_000
KEEP_TEXT = b"alkfs: derived pack, owned by the store's daemon\n"
_GEN = re.compile(r"gen-(\d+)")


def format_of(algo: Algorithm) -> str:
    return "sha1" if algo is Algorithm.GIT_SHA1 else "sha256"


def _hash(fmt: str):
    return hashlib.sha1 if fmt == "sha1" else hashlib.sha256


# -- reading published files ----------------------------------------------------------------
def _bisect(buf, base: int, lo: int, hi: int, h: int, digest: bytes) -> bool:
    """Whether `digest` is among the names [lo, hi) of the sorted table of `h`-byte names
    at `base` in `buf` (an idx's or a commit-graph's, within one fan-out bucket)."""
    while lo < hi:
        mid = (lo + hi) // 2
        probe = buf[base + mid * h : base + mid * h + h]
        if probe < digest:
            lo = mid + 1
        elif probe > digest:
            hi = mid
        else:
            return True
    return False


class PackIndex:
    """One idx v2 file: its object ids (sorted), found by fan-out and bisection."""

    def __init__(self, path: Path, fmt: str) -> None:
        self.path = path
        self.hlen = FORMATS[fmt].digest_len
        data = path.read_bytes()
        if data[:8] != b"\xfftOc\x00\x00\x00\x02":
            raise StoreIO(f"{path}: not an idx v2 file")
        self.fanout = [int.from_bytes(data[8 + 4 * i : 12 + 4 * i], "big") for i in range(256)]
        self.count = self.fanout[255]
        start = 8 + 1024
        self._names = data[start : start + self.count * self.hlen]
        self.pack_checksum = data[-2 * self.hlen : -self.hlen]
        self._data = data

    def offsets(self) -> list[int]:
        """Each object's offset in its pack, in the idx's (id) order."""
        n, data = self.count, self._data
        at = 8 + 1024 + n * self.hlen + 4 * n
        small = [int.from_bytes(data[at + 4 * i : at + 4 * i + 4], "big") for i in range(n)]
        big_at = at + 4 * n
        return [
            o
            if not o & 0x80000000
            else int.from_bytes(
                data[big_at + 8 * (o & 0x7FFFFFFF) : big_at + 8 * (o & 0x7FFFFFFF) + 8], "big"
            )
            for o in small
        ]

    def _name(self, i: int) -> bytes:
        h = self.hlen
        return self._names[i * h : (i + 1) * h]

    def __contains__(self, digest: bytes) -> bool:
        b = digest[0]
        lo = self.fanout[b - 1] if b else 0
        return _bisect(self._names, 0, lo, self.fanout[b], self.hlen, digest)

    def digests(self) -> Iterator[bytes]:
        for i in range(self.count):
            yield self._name(i)


@dataclass
class Generation:
    """One published set: its files (path relative to the generation's directory, size)."""

    fmt: str
    number: int
    root: Path
    files: dict[str, int] = field(default_factory=dict)  # "pack/x.pack" -> size
    mtimes: dict[str, int] = field(default_factory=dict)  # "pack/x.pack" -> mtime (ns)
    indexes: list[PackIndex] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @classmethod
    def load(cls, fmt: str, number: int, root: Path) -> Generation:
        gen = cls(fmt, number, root)
        for top, _dirs, names in os.walk(root):
            for name in names:
                p = Path(top) / name
                rel = p.relative_to(root).as_posix()
                if rel == "alkfs.json":
                    continue
                st = p.stat()
                gen.files[rel] = st.st_size
                gen.mtimes[rel] = st.st_mtime_ns
        for rel in sorted(gen.files):
            if rel.startswith("pack/") and rel.endswith(".idx"):
                gen.indexes.append(PackIndex(root / rel, fmt))
        meta = root / "alkfs.json"
        if meta.exists():
            gen.meta = json.loads(meta.read_text())
        return gen

    def __contains__(self, digest: bytes) -> bool:
        return any(digest in idx for idx in self.indexes)

    @functools.cached_property
    def staged_index(self) -> PackIndex | None:
        """The set's pack of objects staged for deletion when it was built (its idx is
        named in alkfs.json, `staged_pack`), or None: see Derived._pack_staged. (Read
        once: a published set never changes.)"""
        name = self.meta.get("staged_pack")
        for idx in self.indexes:
            if name and idx.path.name == Path(str(name)).name:
                return idx
        return None

    def main_holds(self, digest: bytes) -> bool:
        """Whether a pack other than the staged one holds `digest`."""
        staged = self.staged_index
        return any(digest in idx for idx in self.indexes if idx is not staged)

    def graph_commits(self) -> set[bytes]:
        """Every commit a commit-graph layer of the set names (its OID lookup chunks)."""
        out: set[bytes] = set()
        for rel in self.files:
            if rel.startswith("info/commit-graphs/") and rel.endswith(".graph"):
                out |= _graph_oids(self.root / rel, FORMATS[self.fmt].digest_len)
        return out

    @property
    def objects(self) -> int:
        return sum(i.count for i in self.indexes)

    def names_in(self, directory: str) -> list[str]:
        """The file and directory names directly in `directory` ("pack", "info", ...)."""
        prefix = directory + "/"
        out = set()
        for rel in self.files:
            if rel.startswith(prefix):
                out.add(rel[len(prefix) :].split("/", 1)[0])
        return sorted(out)

    def digests(self) -> set[bytes]:
        out: set[bytes] = set()
        for idx in self.indexes:
            out.update(idx.digests())
        return out

    def left_out(self) -> list[bytes] | None:
        """The kv objects (row id <= meta max_rowid) the set left out, as it recorded
        them; None when it recorded none (too many, a set built before it recorded them,
        or a record that does not parse): then only a scan finds them."""
        return _digests_of(self.meta.get("left_out"), FORMATS[self.fmt].digest_len)

    def withheld(self) -> list[bytes] | None:
        """The kv objects the set left out of every pack of its own because they were
        staged for deletion or being deleted (`withheld` in alkfs.json); None when it
        recorded none (too many, a set built before sets recorded them, or a record that
        does not parse): then only a consolidation packs those that turned live again."""
        return _digests_of(self.meta.get("withheld"), FORMATS[self.fmt].digest_len)

    def pack_order(self) -> list[bytes]:
        """Every object, pack by pack, in the order the packs hold them (git's write order)."""
        out: list[bytes] = []
        for idx in self.indexes:
            pairs = sorted(zip(idx.offsets(), idx.digests(), strict=True))
            out.extend(d for _o, d in pairs)
        return out


def _digests_of(recorded: object, n: int) -> list[bytes] | None:
    """A record of digests (a list of hex) as bytes; None if it is not one."""
    if not isinstance(recorded, list):
        return None
    try:
        out = [bytes.fromhex(h) for h in recorded]
    except (TypeError, ValueError):
        return None
    return out if all(len(d) == n for d in out) else None


def _graph_chunks(data: bytes | mmap.mmap, path: Path, hlen: int) -> tuple[int, int, int]:
    """(offset of the OID fan-out chunk, offset of the OID lookup chunk, commits) of the
    bytes (or mmap) of one commit-graph file."""
    if data[:4] != b"CGPH" or len(data) < 8:
        raise StoreIO(f"{path}: not a commit-graph file")
    chunks = data[6]
    table: dict[bytes, int] = {}
    for i in range(chunks + 1):
        at = 8 + 12 * i
        table[data[at : at + 4]] = int.from_bytes(data[at + 4 : at + 12], "big")
    fanout, names = table.get(b"OIDF"), table.get(b"OIDL")
    if fanout is None or names is None:
        raise StoreIO(f"{path}: no OID chunks")
    count = int.from_bytes(data[fanout + 4 * 255 : fanout + 4 * 256], "big")
    if names + count * hlen > len(data):
        raise StoreIO(f"{path}: its OID lookup chunk is cut short")
    return fanout, names, count


def _graph_oids(path: Path, hlen: int) -> set[bytes]:
    """The commit ids one commit-graph file names (its OIDF/OIDL chunks)."""
    data = path.read_bytes()
    _fanout, names, count = _graph_chunks(data, path, hlen)
    return {data[names + i * hlen : names + (i + 1) * hlen] for i in range(count)}


class GraphLookup:
    """Whether a commit-graph layer of a set names a commit, found by fan-out and
    bisection in each layer's mapped file (nothing is loaded: a set of a million commits
    is looked up as cheaply as one of ten). A context manager: `close` unmaps them."""

    def __init__(self, gen: Generation) -> None:
        self.hlen = FORMATS[gen.fmt].digest_len
        self._layers: list[tuple[mmap.mmap, int, int]] = []
        graphs = "info/commit-graphs/"
        rels = [r for r in sorted(gen.files) if r.startswith(graphs) and r.endswith(".graph")]
        if graphs + "commit-graph-chain" in gen.files:  # (the layers git reads: the chain's)
            chain = (gen.root / graphs / "commit-graph-chain").read_text().split()
            rels = [f"{graphs}graph-{h}.graph" for h in chain]
        try:
            for rel in rels:
                path = gen.root / rel
                with open(path, "rb") as f:
                    data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                try:
                    fanout, names, _count = _graph_chunks(data, path, self.hlen)
                except BaseException:
                    data.close()
                    raise
                self._layers.append((data, fanout, names))
        except BaseException:
            self.close()
            raise

    def __contains__(self, digest: bytes) -> bool:
        h = self.hlen
        b = digest[0]
        for data, fanout, names in self._layers:
            lo = int.from_bytes(data[fanout + 4 * (b - 1) : fanout + 4 * b], "big") if b else 0
            hi = int.from_bytes(data[fanout + 4 * b : fanout + 4 * b + 4], "big")
            if _bisect(data, names, lo, hi, h, digest):
                return True
        return False

    def close(self) -> None:
        for data, _f, _n in self._layers:
            data.close()
        self._layers = []

    def __enter__(self) -> GraphLookup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _left_out_record(digests: set[bytes]) -> list[str] | None:
    return sorted(d.hex() for d in digests) if len(digests) <= LEFT_OUT_MAX else None


def verify_trailer(path: Path, fmt: str) -> bytes:
    """Check that the file's last hash-length bytes are the hash of the rest; returns it."""
    h = _hash(fmt)()
    n = h.digest_size
    size = path.stat().st_size
    if size < n:
        raise StoreIO(f"{path}: too short for a checksum")
    with open(path, "rb") as f:
        left = size - n
        while left:
            chunk = f.read(min(1 << 20, left))
            if not chunk:
                raise StoreIO(f"{path}: shorter than it was")
            h.update(chunk)
            left -= len(chunk)
        trailer = f.read(n)
    if h.digest() != trailer:
        raise StoreIO(f"{path}: its trailer checksum does not match its content")
    return trailer


# -- the object list ------------------------------------------------------------------------
_TREE_ENTRY = {n: re.compile(rb"([0-7]{5,6}) ([^\0]+)\0(.{%d})" % n, re.DOTALL) for n in (20, 32)}


def _commit_info(body: bytes, hexlen: int) -> tuple[bytes | None, list[bytes], int]:
    """(tree hex, parent hexes, committer time) of a commit's body."""
    tree = None
    parents = []
    when = 0
    pos = 0
    if body.startswith(b"tree "):
        tree = body[5 : 5 + hexlen]
        pos = 6 + hexlen
    while body.startswith(b"parent ", pos):
        parents.append(body[pos + 7 : pos + 7 + hexlen])
        pos += 8 + hexlen
    c = body.find(b"\ncommitter ")
    if c >= 0:
        end = body.find(b"\n", c + 1)
        line = body[c + 1 : end if end >= 0 else len(body)]
        parts = line.rsplit(b" ", 2)
        if len(parts) == 3 and parts[1].isdigit():
            when = int(parts[1])
    return tree, parents, when


def ordered_objects(
    objects: dict[bytes, bytes], blobs: Iterable[bytes], fmt: str
) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """The pack-objects input: (digest, path) for every given object, in `rev-list
    --objects` order (tags, then commits newest first each followed by its new trees and
    blobs with their paths), then whatever no commit reaches; and the commits whose every
    ancestor is in the set (what the commit-graph may hold).

    `objects` maps digest -> canonical bytes of every non-blob; `blobs` are the blob
    digests."""
    n = FORMATS[fmt].digest_len
    hexlen = 2 * n
    entry = _TREE_ENTRY[n]
    blob_set = set(blobs)
    commits: dict[bytes, tuple[bytes | None, list[bytes], int]] = {}
    tags: list[bytes] = []
    for digest, data in objects.items():
        nul = data.find(b"\0")
        if data.startswith(b"commit "):
            tree, parents, when = _commit_info(data[nul + 1 :], hexlen)
            try:
                commits[digest] = (
                    bytes.fromhex(tree.decode()) if tree else None,
                    [bytes.fromhex(p.decode()) for p in parents],
                    when,
                )
            except ValueError:
                commits[digest] = (None, [], when)
        elif data.startswith(b"tag "):
            tags.append(digest)
    out: list[tuple[bytes, bytes]] = [(t, b"") for t in sorted(tags)]
    seen: set[bytes] = set(tags)
    order = sorted(commits, key=lambda d: (-commits[d][2], d))
    for c in order:
        out.append((c, b""))
        seen.add(c)
    for c in order:
        tree = commits[c][0]
        if tree is None or tree in seen or tree not in objects:
            continue
        _walk(tree, objects, blob_set, seen, out, entry)
    for d in sorted(objects.keys() - seen):
        out.append((d, b""))
    for d in sorted(blob_set - seen):
        out.append((d, b""))
    return out, _graphable(commits)


def _parse_commits(
    objects: dict[bytes, bytes], hexlen: int
) -> dict[bytes, tuple[bytes | None, list[bytes], int]]:
    commits: dict[bytes, tuple[bytes | None, list[bytes], int]] = {}
    for digest, data in objects.items():
        if data.startswith(b"commit "):
            nul = data.find(b"\0")
            tree, parents, when = _commit_info(data[nul + 1 :], hexlen)
            try:
                commits[digest] = (
                    bytes.fromhex(tree.decode()) if tree else None,
                    [bytes.fromhex(p.decode()) for p in parents],
                    when,
                )
            except ValueError:
                commits[digest] = (None, [], when)
    return commits


def _walk(
    tree: bytes,
    trees: dict[bytes, bytes],
    blobs: set[bytes],
    seen: set[bytes],
    out: list[tuple[bytes, bytes]],
    entry: re.Pattern[bytes],
) -> None:
    """Append `tree` and what it reaches among `trees` and `blobs` (depth first, with paths,
    as rev-list does), skipping what is `seen`."""
    stack = [(tree, b"")]
    while stack:
        oid, path = stack.pop()
        if oid in seen:
            continue
        seen.add(oid)
        out.append((oid, path))
        data = trees.get(oid)
        if data is None or not data.startswith(b"tree "):
            continue
        nul = data.find(b"\0")
        subtrees = []
        for mode, name, child in entry.findall(data, nul + 1):
            if mode == b"160000" or child in seen:
                continue
            full = path + b"/" + name if path else name
            if mode.lstrip(b"0") == b"40000":
                if child in trees:
                    subtrees.append((child, full))
            elif child in blobs:
                seen.add(child)
                out.append((child, full))
        stack.extend(reversed(subtrees))


def ordered_incremental(
    kinds: dict[bytes, bytes],
    fetched: dict[bytes, bytes],
    previous: list[bytes],
    fmt: str,
) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """The pack-objects input when most objects are in the previous set: `kinds` maps every
    object of the new set to the first two bytes of its type; `fetched` holds the verified
    bytes of every commit and of every new tree and tag; `previous` is the previous set's
    write order. Tags, then commits newest first, then the new trees and blobs with their
    paths (walking the new trees from the new commits), then the previous set's other
    objects in its order, then what is left. Also the commits the graph may hold."""
    n = FORMATS[fmt].digest_len
    entry = _TREE_ENTRY[n]
    commits = _parse_commits(fetched, 2 * n)
    prev = set(previous)
    out: list[tuple[bytes, bytes]] = [
        (d, b"") for d in sorted(d for d, k in kinds.items() if k == b"ta")
    ]
    seen = {d for d, _p in out}
    order = sorted(commits, key=lambda d: (-commits[d][2], d))
    for c in order:
        out.append((c, b""))
        seen.add(c)
    new_trees = {d: fetched[d] for d in kinds if d not in prev and d in fetched}
    new_blobs = {d for d, k in kinds.items() if k == b"bl" and d not in prev}
    for c in order:
        tree = commits[c][0]
        if c not in prev and tree is not None and tree in new_trees:
            _walk(tree, new_trees, new_blobs, seen, out, entry)
    for d in previous:
        if d in kinds and d not in seen:
            seen.add(d)
            out.append((d, b""))
    for d in sorted(kinds.keys() - seen):
        out.append((d, b""))
    return out, _graphable(commits)


def _graphable(
    commits: dict[bytes, tuple[bytes | None, list[bytes], int]],
    known: dict[bytes, bool] | None = None,
) -> list[bytes]:
    """The commits whose ancestors are all here (else `commit-graph write` refuses);
    `known`: commits already decided (True: in the set with all its ancestors)."""
    ok: dict[bytes, bool] = dict(known or {})
    for c in commits:
        stack = [c]
        while stack:
            x = stack[-1]
            if x in ok:
                stack.pop()
                continue
            info = commits.get(x)
            if info is None:
                ok[x] = False
                stack.pop()
                continue
            pending = [p for p in info[1] if p not in ok]
            if pending:
                stack.extend(pending)
                continue
            ok[x] = all(ok[p] for p in info[1])
            stack.pop()
    return sorted(c for c in commits if ok.get(c))


# -- the builder ----------------------------------------------------------------------------
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


class Derived:
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
        self._current: Generation | None = None
        self._swap = threading.Lock()  # (the published generation changes under it)
        self.last_build: BuildResult | None = None
        self.last_error: str | None = None
        fleet = getattr(store, "fleet", None)
        # a fleet's members share the sets: published in the database (shared_packs.py)
        self.shared = None if fleet is None else SharedPacks(fleet, fmt)
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
                log.error(
                    "derived %s: generation %d is unreadable (%s): withdrawn", self.fmt, number, exc
                )
                self._current = None
        if not self.store.holds_lock:
            return  # beside the lock holder (Store.open(lock=False)): its files, not ours
        keep = {CURRENT}
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

    # -- the store's objects -------------------------------------------------------------
    def _kv(self) -> SqlTier:
        kv = self.store.kv
        if not isinstance(kv, SqlTier):
            raise StoreIO("derived packs need a store on disk")
        return kv

    def _range(self) -> tuple[bytes, bytes]:
        return bytes([self.algo.value]), bytes([self.algo.value + 1])

    @property
    def _records_left_out(self) -> bool:
        """Whether a set's record of what it left out is the whole truth: on sqlite,
        whose single writer numbers rows in commit order, so no row committed after the
        build's snapshot has a number at or below its max_rowid. PostgreSQL numbers rows
        (`seq`) when they are inserted, not when they commit: a row whose transaction was
        still open at the snapshot has a lower number than rows it saw, so only a scan
        finds it. There no set records it (and none is trusted)."""
        return self._kv().db.engine == "sqlite"

    def left_out(self, gen: Generation) -> list[bytes] | None:
        """What `gen` recorded it left out; None where only a scan tells."""
        return gen.left_out() if self._records_left_out else None

    def max_rowid(self) -> int:
        return self._kv().high_water()

    def new_since(self, gen: Generation | None) -> int:
        """How many kv objects of the format arrived after `gen` was built."""
        lo, hi = self._range()
        after = 0 if gen is None else int(gen.meta.get("max_rowid", 0))
        return self._kv().count_arrived(lo, hi, after)

    def arrived(self, after: int, upto: int | None = None) -> list[bytes]:
        """The digests of the format's kv objects whose row ids are in (after, upto]."""
        lo, hi = self._range()
        return [k[1:] for k in self._kv().arrived(lo, hi, after, upto=upto)]

    def _scan(self) -> tuple[dict[bytes, bytes], list[bytes], list[bytes], int]:
        """Every non-blob of the format (verified, digest -> bytes), the blob digests, the
        corrupt ones (logged), and the highest row id seen (read in the same transaction)."""
        lo, hi = self._range()
        kv = self._kv()
        digest = _hash(self.fmt)
        objects: dict[bytes, bytes] = {}
        blobs: list[bytes] = []
        corrupt: list[bytes] = []
        with kv.db.snapshot() as conn:
            top = kv.high_water(conn)
            for key, value in kv.git_range(lo, hi, conn):
                d = key[1:]
                if value is None:
                    blobs.append(d)
                elif digest(value).digest() == d:
                    objects[d] = value
                else:
                    log.error("derived %s: corrupt object %s left out", self.fmt, d.hex())
                    corrupt.append(d)
        return objects, blobs, corrupt, top

    def _scan_kinds(self) -> tuple[dict[bytes, bytes], int]:
        """digest -> the first two bytes of the type ("co", "tr", "bl", "ta") of every kv
        object of the format, and the highest row id, read in one transaction."""
        lo, hi = self._range()
        kv = self._kv()
        kinds: dict[bytes, bytes] = {}
        with kv.db.snapshot() as conn:
            top = kv.high_water(conn)
            for key, kind in kv.kinds_range(lo, hi, conn):
                kinds[key[1:]] = kind
        return kinds, top

    def _read_many(self, digests: list[bytes]) -> Iterator[tuple[bytes, bytes]]:
        """(digest, verified canonical bytes) for these kv objects (corrupt/absent skipped)."""
        prefix = bytes([self.algo.value])
        digest = _hash(self.fmt)
        for n, (key, value) in enumerate(self._kv().values([prefix + d for d in digests])):
            self.store.check_stopping(n)
            d = key[1:]
            if digest(value).digest() == d:
                yield d, value
            else:
                log.error("derived %s: corrupt object %s left out", self.fmt, d.hex())

    # -- git ---------------------------------------------------------------------------
    def _index_files(self, repo: Path, out: Path, graph: list[bytes], if_not: str) -> None:
        """The set's multi-pack-index, and a split commit-graph layer of `graph`'s
        commits (when it fails, `if_not` is logged: a set without a new layer is still
        whole; git reads those commits from the packs)."""
        self._git(repo, "multi-pack-index", "write", objdir=out)
        graphs = out / "info" / "commit-graphs"
        if graph:
            had = set(os.listdir(graphs)) if graphs.is_dir() else None
            chain = graphs / "commit-graph-chain"
            chain_text = chain.read_bytes() if had and chain.name in had else None
            try:
                self._git(
                    repo,
                    "commit-graph",
                    "write",
                    "--split",
                    "--stdin-commits",
                    "--no-progress",
                    objdir=out,
                    input=b"".join(c.hex().encode() + b"\n" for c in graph),
                )
            except StoreIO as exc:
                log.error("derived %s: %s: %s", self.fmt, if_not, exc)
                self._graphs_as_they_were(graphs, had, chain_text)
        if graphs.is_dir():
            for stale in graphs.glob("*.lock"):
                stale.unlink()

    @staticmethod
    def _graphs_as_they_were(graphs: Path, had: set[str] | None, chain: bytes | None) -> None:
        """After a failed `commit-graph write`: the layers as they were before it (what
        it left, a temporary graph file for one, would fail the set's check)."""
        if had is None:
            shutil.rmtree(graphs, ignore_errors=True)
            return
        for name in os.listdir(graphs):
            if name not in had:
                (graphs / name).unlink()
        path = graphs / "commit-graph-chain"
        if chain is not None and (not path.is_file() or path.read_bytes() != chain):
            path.write_bytes(chain)

    def _pack_objects(
        self, repo: Path, out: Path, order: Iterable[tuple[bytes, bytes]], *args: str
    ) -> str:
        """`git pack-objects` in `repo` of `order` ((digest, path) pairs, in git's input
        order: the paths give its deltas) into a new pack in out/pack; its idx's name."""
        listing = b"".join(d.hex().encode() + (b" " + p if p else b"") + b"\n" for d, p in order)
        name = self._git(
            repo,
            "pack-objects",
            "-q",
            "--delta-base-offset",
            *args,
            str(out / "pack" / "pack"),
            input=listing,
        )
        return f"pack-{name.decode().strip()}.idx"  # (git prints the pack's checksum)

    def _git(
        self,
        repo: Path,
        *args: str,
        objdir: Path | None = None,
        input: bytes | None = None,
    ) -> bytes:
        env = {
            **os.environ,
            "GIT_DIR": str(repo),
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_TERMINAL_PROMPT": "0",
        }
        env.pop("GIT_ALTERNATE_OBJECT_DIRECTORIES", None)
        env.pop("GIT_WORK_TREE", None)
        if objdir is not None:
            env["GIT_OBJECT_DIRECTORY"] = str(objdir)
        else:
            env.pop("GIT_OBJECT_DIRECTORY", None)
        cmd = ["git", "-c", "core.fsync=none", "-c", "gc.auto=0", *args]
        if shutil.which("nice"):
            cmd = ["nice", "-n", "10", *cmd]
        t0 = time.monotonic()
        # its own process group, looked at every STOP_POLL_S: when the store's owner
        # stops (SIGTERM, unmount), git and its children are killed and the build ends
        # Interrupted (what it left in tmp-* is removed at the next open). Its input is
        # read from an unlinked file, not a pipe: `communicate` cannot go on feeding a
        # pipe after a timeout (given the input again it raises ValueError; without it,
        # it never writes the rest), and pack-objects, fed every build's object list,
        # often outlasts one look.
        with contextlib.ExitStack() as stack:
            stdin: int | IO[bytes] = subprocess.DEVNULL
            if input is not None:
                where = repo if repo.is_dir() else None  # (on the store's disk: the build's)
                stdin = stack.enter_context(tempfile.TemporaryFile(dir=where))
                stdin.write(input)
                stdin.seek(0)
            proc = subprocess.Popen(
                cmd,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
        while True:
            try:
                out, err = proc.communicate(timeout=STOP_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if self.store.stopping.is_set():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate()
                    raise Interrupted(f"git {args[0]} stopped: the store is closing") from None
        log.debug("derived %s: git %s took %.3f s", self.fmt, args[0], time.monotonic() - t0)
        if proc.returncode != 0:
            raise StoreIO(
                f"git {args[0]} failed ({proc.returncode}): "
                + err.decode(errors="replace").strip()[-500:]
            )
        return out

    def _write_raw_pack(self, path: Path, items: Iterable[tuple[bytes, bytes]]) -> int:
        """An undeltified pack of (digest, canonical) items; returns the object count."""
        h = _hash(self.fmt)()
        n = 0
        with open(path, "wb") as f:
            f.write(b"PACK\x00\x00\x00\x02\x00\x00\x00\x00")  # count patched below
            for _d, data in items:
                nul = data.find(b"\0")
                kind = data[: data.find(b" ")]
                body = memoryview(data)[nul + 1 :]
                size = len(body)
                byte = (TYPE_CODES[kind] << 4) | (size & 0x0F)
                size >>= 4
                head = bytearray()
                while size:
                    head.append(byte | 0x80)
                    byte = size & 0x7F
                    size >>= 7
                head.append(byte)
                f.write(head)
                f.write(zlib.compress(body, 1))
                n += 1
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(n.to_bytes(4, "big"))
            f.seek(0)
            while chunk := f.read(1 << 20):
                h.update(chunk)
            f.write(h.digest())
        return n

    def _write_loose(self, objdir: Path, items: Iterable[tuple[bytes, bytes]]) -> int:
        n = 0
        made: set[str] = set()
        for d, data in items:
            self.store.check_stopping(n)
            hx = d.hex()
            sub = objdir / hx[:2]
            if hx[:2] not in made:
                sub.mkdir(exist_ok=True)
                made.add(hx[:2])
            (sub / hx[2:]).write_bytes(zlib.compress(data, 1))
            n += 1
        return n

    # -- building and publishing ---------------------------------------------------------
    def build(
        self, exclude: Iterable[bytes] = (), *, prune: bool = False, wait: bool = True
    ) -> BuildResult | None:
        """Build and publish a new set of every kv object of the format except `exclude`
        (digests) and anything staged for deletion. `prune`: remove the retired
        generation at once (no reader can hold it: no mount). In a fleet, only its one
        builder builds: None when another is and `wait` was not asked."""
        reserve = self.store.reserve
        if reserve is not None and reserve.full:  # (derived data went first: see shed)
            raise NoSpace("the disk is full: derived packs are built again once it is not")
        with self.lock, self._builder(wait) as building:
            if not building:
                return None
            self.refresh()  # (a fleet member builds on the latest published set)
            t0 = time.monotonic()
            try:
                result = self._build(set(exclude))
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

    def _builder(self, wait: bool) -> contextlib.AbstractContextManager[bool]:
        if self.shared is None:
            return contextlib.nullcontext(True)
        return self.shared.builder(wait)

    def staged_in_current(self) -> int:
        """How many objects staged for deletion the published set holds in its main packs
        (a build moves them into its staged pack: publish it before their window ends, so
        the sweep that deletes them only drops that pack)."""
        gen = self._current
        if gen is None or not gen.indexes:
            return 0
        return sum(1 for d in self._staged() if gen.main_holds(d))

    def _staged(self) -> set[bytes]:
        prefix = self.algo.value
        return {bytes(k[1:]) for k in self.store.window.staged_keys() if k[0] == prefix}

    def _plan(
        self, prev: Generation | None, skip: set[bytes]
    ) -> tuple[list[tuple[bytes, bytes]], list[bytes], int, list[bytes] | None, set[bytes]]:
        """(pack-objects input, graph commits, top row id, new objects or None for a full
        build, every kv object of the format the scan saw). Mostly old objects: only the
        commits and the new objects are read."""
        if prev is not None and prev.indexes:
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

    def _intake_plan(
        self, prev: Generation
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

    def _build(self, exclude: set[bytes]) -> BuildResult:
        prev = self._current
        if not exclude and prev is not None:
            plan = self._intake_plan(prev)
            if plan is not None:
                return self._build_intake(prev, *plan)
        if exclude and prev is not None and self._only_staged(prev, exclude):
            # (what it withheld stays withheld: none of it is packed by this set either)
            held = prev.withheld()
            top = int(prev.meta.get("max_rowid", 0))
            return self._build_intake(prev, {}, top, [], held, True)
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

    def _build_intake(
        self,
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
            before = self.left_out(prev)
            if before:  # (those deleted since drop out of the record)
                tag = bytes([self.algo.value])
                have = self._kv().present([tag + d for d in before])
                before = [d for d in before if tag + d in have]
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
        self, prev: Generation, commits: dict[bytes, tuple[bytes | None, list[bytes], int]]
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
            log.warning(
                "derived %s: cannot read the commit-graph (%s): no new layer", self.fmt, exc
            )
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

    def verify(self, gen: Generation | None = None) -> str | None:
        """Re-check every file of `gen` (default: the published set): trailer checksums,
        each idx's copy of its pack's, sizes. None if sound, else what is wrong."""
        gen = self._current if gen is None else gen
        if gen is None:
            return None
        try:
            for rel, size in gen.files.items():
                if (gen.root / rel).stat().st_size != size:
                    raise StoreIO(f"{gen.root / rel}: its size changed")
            self._check(gen.root)
        except (OSError, StoreIO) as exc:
            return str(exc)
        return None

    def withdraw_if_corrupt(self) -> str | None:
        """`verify` the published set; one that fails is withdrawn (logged, and left in
        `last_error` for status until the next build rebuilds it). What was wrong, or None
        (also when another check withdrew or a build replaced that set meanwhile: two
        checks at once, the mount's start and a `verify`, withdraw it once). The reads run
        outside the set's lock; `withdraw(only=...)` decides under it."""
        gen = self._current
        if gen is None:
            return None
        problem = self.verify(gen)
        if problem is None or not self.withdraw(only=gen):
            return None
        log.error("derived %s: the published set is corrupt, withdrawn: %s", self.fmt, problem)
        self.last_error = f"withdrawn at verify: {problem}"
        return problem

    def withdraw(self, wait: bool = True, only: Generation | None = None) -> bool:
        """Publish an empty set (every object is served loose until the next build).
        In a fleet, with `wait` False: nothing (False) while another member builds.
        `only`: nothing (False) unless that generation is still the published one."""
        with self.lock, self._builder(wait) as building:
            if not building or (only is not None and self._current is not only):
                return False
            number = self._next_number()
            self._make_root()
            final = self.root / f"gen-{number}"
            final.mkdir()
            fsync_dir(self.root)
            self._publish(Generation(self.fmt, number, final))
            log.warning("derived %s: packs withdrawn (generation %d is empty)", self.fmt, number)
            return True


# -- one instance per store and format ------------------------------------------------------
_REGISTRY: weakref.WeakKeyDictionary[Store, dict[str, Derived]] = weakref.WeakKeyDictionary()
_REGISTRY_LOCK = threading.Lock()


def derived_for(store: Store, fmt: str) -> Derived | None:
    """The store's derived packs of `fmt`: None for a store without a directory, and for
    one opened beside its lock holder (`Store.open(lock=False)`): the sets are the lock
    holder's alone (it builds, publishes and removes them). A fleet's members share
    theirs (alkfs/git/shared_packs.py)."""
    if store.path is None or not isinstance(store.kv, SqlTier):
        return None
    fleet = getattr(store, "fleet", None)
    if not store.holds_lock and fleet is None:
        return None  # (beside the lock holder)
    with _REGISTRY_LOCK:
        per = _REGISTRY.setdefault(store, {})
        d = per.get(fmt)
        if d is None:
            d = per[fmt] = Derived(store, fmt)
            if fleet is not None:
                fleet.on_packs.append(d.refresh)
        return d


def build(store: Store, fmt: str | None = None, *, prune: bool = True) -> list[BuildResult]:
    """Build and publish the set of `fmt` (default: each format the store holds objects of,
    or has a set of)."""
    out = []
    for f in [fmt] if fmt else list(FORMATS):
        d = derived_for(store, f)
        if d is None:
            continue
        if fmt is None and d.current() is None and not d.new_since(None):
            continue
        result = d.build(prune=prune)
        if result is not None:
            out.append(result)
    return out


def shed(store: Store) -> int:
    """The reserve's shedder on a full disk (alkfs/reserve.py): derived data goes first.
    Each published set that holds files is withdrawn (its objects are served loose,
    `status` shows it, and the intake builds again once the disk is no longer full);
    its files go once nobody holds them: at once in a process without a mount, after a
    mount's retire grace and last handle otherwise. Never waits: a format being built
    here or by another member of a fleet is left to that build (it meets the full disk
    itself). Returns the bytes of the sets withdrawn."""
    out = 0
    for fmt in FORMATS:
        with _REGISTRY_LOCK:
            d = _REGISTRY.get(store, {}).get(fmt)
        if d is None or not d.lock.acquire(blocking=False):
            continue
        try:
            gen = d.current()
            if gen is None or not gen.files:
                continue
            size = sum(gen.files.values())
            if not d.withdraw(wait=False):
                continue
            d.last_error = "withdrawn: the disk is full"
            if not d.on_publish:  # (no mount serves it: nobody holds its files)
                d.prune()
            out += size
        except Exception as exc:
            log.error("derived %s: could not be dropped on a full disk: %s", fmt, exc)
        finally:
            d.lock.release()
    return out


def verify_sets(store: Store) -> list[str]:
    """Re-check every file of each published set (`verify`); one that fails is withdrawn
    (its objects are served loose), logged and left in `last_error` (status) until the
    next build rebuilds it. The formats withdrawn."""
    out = []
    for fmt in FORMATS:
        d = derived_for(store, fmt)
        if d is None:
            continue
        if d.withdraw_if_corrupt() is not None:
            out.append(fmt)
    return out


@contextlib.contextmanager
def guard_deletes(store: Store, raws: Iterable[bytes]) -> Iterator[set[bytes]]:
    """Held around the deletion of these keys (raw): afterwards no published set lists
    them (see the module docstring). The sweep holds it once around all of its deletions,
    with every candidate it will take: one set is published without them all, not one
    a batch (a set published meanwhile would wait for the lock). Yields the keys to keep
    instead: in a fleet, those a member still serves in an older set after SERVE_WAIT_S
    (shared_packs.py)."""
    keep: set[bytes] = set()
    if store.path is None or not (store.path / DERIVED_DIR).exists():
        yield keep
        return
    if not store.holds_lock and store.fleet is None:
        log.warning("a sweep beside the store's lock holder: its derived packs are not guarded")
        yield keep
        return
    by_fmt: dict[str, list[bytes]] = {}
    for raw in raws:
        if raw[0] in (Algorithm.GIT_SHA1.value, Algorithm.GIT_SHA256.value):
            by_fmt.setdefault(format_of(Algorithm(raw[0])), []).append(bytes(raw[1:]))
    with contextlib.ExitStack() as stack:
        for fmt, digests in by_fmt.items():
            d = derived_for(store, fmt)
            if d is None:
                continue
            stack.enter_context(d.lock)
            stack.enter_context(d._builder(True))  # (a fleet's: waits for its builder)
            d.refresh()
            gen = d.current()
            if gen is not None and any(x in gen for x in digests):
                try:
                    d.build(digests)  # all of them: one not packed yet must not be now
                except Exception as exc:
                    log.error("derived %s: rebuild before deleting failed (%s)", fmt, exc)
                    d.withdraw()
            if d.shared is not None:
                keep |= _served_elsewhere(d, digests)
        yield keep


def _served_elsewhere(d: Derived, digests: list[bytes]) -> set[bytes]:
    """The keys of `digests` another live member still serves in an older set once the
    wait is over (their deletion waits for a later sweep)."""
    assert d.shared is not None
    cur = d.current()
    sets: dict[int, Generation | None] = {}

    def holding(number: int) -> set[bytes]:
        if number not in sets:
            try:
                sets[number] = Generation.load(d.fmt, number, d.root / f"gen-{number}")
            except (OSError, StoreIO, ValueError):
                sets[number] = None  # (unreadable: assume it holds them all)
        gen = sets[number]
        return {x for x in digests if gen is None or x in gen}

    held = d.shared.await_served(0 if cur is None else cur.number, holding)
    if held:
        log.warning(
            "derived %s: another daemon still serves an older set: %d objects kept for a "
            "later sweep",
            d.fmt,
            len(held),
        )
    tag = bytes([d.algo.value])
    return {tag + x for x in held}
