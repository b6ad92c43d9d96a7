"""Derived packs: their layout and tunables, and a published set's files read (idx v2,
commit-graph, trailer checksums). The design: alkfs/git/packs/__init__.py."""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import StoreIO
from ...keys import Algorithm

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

    def names_after(self, digest: bytes, limit: int) -> list[bytes]:
        """Up to `limit` ids after `digest`, in order (b"": from the first)."""
        lo, hi = 0, self.count
        while lo < hi:
            mid = (lo + hi) // 2
            if self._name(mid) <= digest:
                lo = mid + 1
            else:
                hi = mid
        return [self._name(i) for i in range(lo, min(self.count, lo + limit))]


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
