"""Git objects read from their packs: pack v2 files with their idx v2 files, in either object
format ("sha1": 20-byte ids, "sha256": 32-byte ids), self-contained (no git process, nothing
of alkfs but its errors).

What is checked, and when:

* At open (`PackFile`), what git checks when it loads a pack: the idx's magic and version
  2, a fan-out that never decreases, an idx size that is exactly what its object count
  takes (the names, CRCs and 4-byte offsets, one 8-byte offset per 4-byte entry with its
  top bit set, and the two trailing checksums), the pack's `PACK` signature, its version
  (2, or 3 which git reads the same), its object count equal to the idx's, and its
  trailing checksum equal to the idx's copy of it. Either file otherwise: `Corrupt`
  naming it. Neither file's own checksum is recomputed (the store checks trailers).
* At every `read`: the entry's header (type, size varint, the delta base's offset or id),
  its zlib stream inflated by a decompressobj that may not give more than the header's
  size and must give exactly it, every delta applied by git's rules (the source size
  equal to the base's, each copy inside the base, the target size exact), delta chains
  of at most DELTA_DEPTH_MAX links (a REF_DELTA cycle ends there), and the object as
  inflated hashed as git names it (`<type> <size>\\0<body>`) and compared with the id it
  was asked for. Any failure, a zlib error, a bad delta, an entry or a stream running past
  the pack's data, a REF_DELTA base in no pack, is `Corrupt` naming the pack file and the
  object's id (hex): a wrong byte is reported, never served. `PackSet.check(ids)` gives
  the ids among those given whose read fails so (what a damaged pack affects). Delta
  bases, named by offset rather than id, are not verified on their own: a wrong one can
  only make the objects built on it fail their own check.
* `stat` reads headers only (the object's, then down its delta chain to the type), and
  for a delta the first bytes of the delta (its target size): it inflates no body and so
  verifies nothing but the headers' shape.

REF_DELTA bases are looked up in the same pack, then through the `resolve` callback a
`PackFile` was given (a `PackSet` gives each of its packs one that reads from the whole
set: a base in another pack). Cross-pack resolution nests at most CROSS_PACK_MAX deep.

Threads: a pack and its idx are memory-mapped read-only and only sliced (no file
position is shared), and the one shared mutable thing, the base cache, is locked; any
number of threads may read one `PackFile` or `PackSet` at once. `close()` must wait for
them.

Memory: the maps are paged by the kernel; a read holds its object, the delta and base
of the link it is applying, the offsets of its chain, at most CHUNK of compressed input,
and the cache of inflated delta bases: least recently used first out, at most
CACHE_BYTES of bodies per cache (a `PackSet`'s packs share one), never one over
CACHE_ITEM_MAX.
"""

from __future__ import annotations

import hashlib
import itertools
import mmap
import os
import sys
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from ..errors import Corrupt, Invalid
from .packdelta import CACHE_BYTES, BaseCache, Object, apply_delta, delta_sizes
from .packdelta import CACHE_ITEM_MAX as CACHE_ITEM_MAX

HASH_LEN = {"sha1": 20, "sha256": 32}
TYPE_NAMES = {1: b"commit", 2: b"tree", 3: b"blob", 4: b"tag"}
OFS_DELTA = 6
REF_DELTA = 7
DELTA_DEPTH_MAX = 10_000  # links of one delta chain (git writes 50 by default, 4095 at most)
CROSS_PACK_MAX = 64  # REF_DELTA bases read from another pack, nested
CHUNK = 1 << 20  # compressed input sliced from the pack at a time, at most

IDX_MAGIC = b"\xfftOc"
PACK_MAGIC = b"PACK"
PACK_HEADER = 12
_FANOUT_AT = 8
_NAMES_AT = 8 + 256 * 4
_LOW_BYTES = bytes(range(0x80))
_MAX_LENGTH = sys.maxsize - 1

Resolve = Callable[[bytes], "Object | None"]
ResolveStat = Callable[[bytes], "tuple[bytes, int] | None"]

_T = TypeVar("_T")
_serials = itertools.count(1)
_nesting = threading.local()  # .depth: cross-pack resolutions in progress on this thread


def git_hash(fmt: str, type_name: bytes, body: bytes) -> bytes:
    """The id git gives an object of that type and body."""
    h = hashlib.sha1() if fmt == "sha1" else hashlib.sha256()
    h.update(b"%s %d\0" % (type_name, len(body)))
    h.update(body)
    return h.digest()


def _map(path: Path) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size == 0:
            raise Corrupt(f"{path}: empty")
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


def _failing(read: Callable[[bytes], object], digests: Iterable[bytes]) -> set[bytes]:
    """The ids among `digests` whose `read` raises Corrupt."""
    bad = set()
    for d in digests:
        try:
            read(d)
        except Corrupt:
            bad.add(d)
    return bad


class PackFile:
    """One pack and its idx, checked at open (see the module's docstring); objects read by
    id. `resolve(id) -> (type, body) | None` finds a REF_DELTA base this pack does not
    hold (`resolve_stat(id) -> (type, size) | None` its type for `stat`; without it,
    `resolve`). `cache` may be shared with other packs (a `PackSet`'s)."""

    def __init__(
        self,
        pack_path: str | os.PathLike[str],
        idx_path: str | os.PathLike[str],
        fmt: str,
        resolve: Resolve | None = None,
        *,
        resolve_stat: ResolveStat | None = None,
        cache: BaseCache | None = None,
    ) -> None:
        if fmt not in HASH_LEN:
            raise Invalid(f"unknown object format {fmt!r}")
        self.pack_path = Path(pack_path)
        self.idx_path = Path(idx_path)
        self.fmt = fmt
        self.hlen = HASH_LEN[fmt]
        self._resolve = resolve
        self._resolve_stat = resolve_stat
        self.cache = cache if cache is not None else BaseCache()
        self._serial = next(_serials)
        self._closed = False
        self._idx = _map(self.idx_path)
        try:
            self._pack = _map(self.pack_path)
            try:
                self._load()
            except BaseException:
                self._pack.close()
                raise
        except BaseException:
            self._idx.close()
            raise

    def _load(self) -> None:
        idx, pack, h = self._idx, self._pack, self.hlen
        where = self.idx_path
        size = len(idx)
        if size < _NAMES_AT + 2 * h:
            raise Corrupt(f"{where}: {size} bytes, too small for an idx file")
        if idx[:4] != IDX_MAGIC:
            raise Corrupt(f"{where}: not an idx v2 file (no magic)")
        version = int.from_bytes(idx[4:8], "big")
        if version != 2:
            raise Corrupt(f"{where}: idx version {version}, not 2")
        raw = idx[_FANOUT_AT:_NAMES_AT]
        fanout = [int.from_bytes(raw[i : i + 4], "big") for i in range(0, 1024, 4)]
        if any(b < a for a, b in itertools.pairwise(fanout)):
            raise Corrupt(f"{where}: its fan-out table decreases")
        n = fanout[255]
        least = _NAMES_AT + n * (h + 8) + 2 * h
        if size < least:
            raise Corrupt(f"{where}: {size} bytes, too small for its {n} objects")
        small_at = _NAMES_AT + n * (h + 4)
        top_bytes = idx[small_at : small_at + 4 * n : 4]
        large = len(top_bytes.translate(None, _LOW_BYTES))  # those with the top bit set
        if size != least + 8 * large:
            raise Corrupt(
                f"{where}: {size} bytes, not the {least + 8 * large} its {n} objects "
                f"({large} with 64-bit offsets) take"
            )
        where = self.pack_path
        psize = len(pack)
        if psize < PACK_HEADER + h:
            raise Corrupt(f"{where}: {psize} bytes, too small for a pack")
        if pack[:4] != PACK_MAGIC:
            raise Corrupt(f"{where}: not a pack (no PACK signature)")
        version = int.from_bytes(pack[4:8], "big")
        if version not in (2, 3):
            raise Corrupt(f"{where}: pack version {version}, not 2")
        count = int.from_bytes(pack[8:12], "big")
        if count != n:
            raise Corrupt(f"{where}: holds {count} objects, its idx {self.idx_path.name} {n}")
        if pack[psize - h :] != idx[size - 2 * h : size - h]:
            raise Corrupt(f"{where}: its trailer is not the one its idx {self.idx_path.name} has")
        self.count = n
        self._fanout = fanout
        self._small_at = small_at
        self._large_at = small_at + 4 * n
        self._large = large
        self._end = psize - h  # where the entries end and the trailer begins

    # -- the idx ----------------------------------------------------------------------------
    def offset_of(self, digest: bytes) -> int | None:
        """Where the object is in the pack, or None if the idx does not list it."""
        h = self.hlen
        if len(digest) != h:
            raise Invalid(f"a {self.fmt} object id is {h} bytes, not {len(digest)}")
        self._open()
        b = digest[0]
        lo = self._fanout[b - 1] if b else 0
        hi = self._fanout[b]
        idx = self._idx
        while lo < hi:
            mid = (lo + hi) // 2
            at = _NAMES_AT + mid * h
            probe = idx[at : at + h]
            if probe < digest:
                lo = mid + 1
            elif probe > digest:
                hi = mid
            else:
                return self._offset(mid)
        return None

    def _offset(self, i: int) -> int:
        idx = self._idx
        at = self._small_at + 4 * i
        off = int.from_bytes(idx[at : at + 4], "big")
        if off & 0x80000000:
            j = off & 0x7FFFFFFF
            if j >= self._large:
                raise Corrupt(f"{self.idx_path}: a 64-bit offset index {j} past its table")
            at = self._large_at + 8 * j
            off = int.from_bytes(idx[at : at + 8], "big")
        return off

    def __contains__(self, digest: bytes) -> bool:
        return self.offset_of(digest) is not None

    def digests(self) -> Iterator[bytes]:
        """The ids the idx lists, in order."""
        h = self.hlen
        for i in range(self.count):
            self._open()
            at = _NAMES_AT + i * h
            yield self._idx[at : at + h]

    def __len__(self) -> int:
        return self.count

    # -- reading ----------------------------------------------------------------------------
    def read(self, digest: bytes) -> Object | None:
        """(type name, body) of the object, verified against its id; None if this pack does
        not list it. `Corrupt` when its bytes (or a base's) do not give it."""
        off = self.offset_of(digest)
        return None if off is None else self._read_found(digest, off)

    def _read_found(self, digest: bytes, off: int) -> Object:
        try:
            obj = self._object_at(off)
        except Corrupt as e:
            raise Corrupt(f"{self.pack_path}: object {digest.hex()}: {e}") from None
        got = git_hash(self.fmt, obj[0], obj[1])
        if got != digest:
            raise Corrupt(
                f"{self.pack_path}: object {digest.hex()}: its entry at {off} inflates to "
                f"a {obj[0].decode()} of {len(obj[1])} bytes named {got.hex()}"
            )
        return obj

    def stat(self, digest: bytes) -> tuple[bytes, int] | None:
        """(type name, size) of the object from headers only; None if not listed here."""
        off = self.offset_of(digest)
        return None if off is None else self._stat_found(digest, off)

    def _stat_found(self, digest: bytes, off: int) -> tuple[bytes, int]:
        try:
            return self._stat_at(off)
        except Corrupt as e:
            raise Corrupt(f"{self.pack_path}: object {digest.hex()}: {e}") from None

    def check(self, digests: Iterable[bytes]) -> set[bytes]:
        """The ids among `digests` this pack lists whose read raises `Corrupt`."""
        return _failing(self.read, digests)

    def _open(self) -> None:
        if self._closed:
            raise ValueError(f"{self.pack_path}: read after close")

    def _header(self, off: int) -> tuple[int, int, int, int, bytes]:
        """(type code, size, where its zlib stream starts, its base's offset (OFS_DELTA)
        or -1, its base's id (REF_DELTA) or b"") of the entry at `off`."""
        if not PACK_HEADER <= off < self._end:
            raise Corrupt(f"an entry at {off}, outside the pack's {self._end} bytes of entries")
        buf = self._pack[off : min(off + 20 + self.hlen, self._end)]
        c = buf[0]
        kind = (c >> 4) & 7
        size = c & 15
        shift = 4
        i = 1
        while c & 0x80:
            if i >= len(buf) or i >= 10:
                raise Corrupt(f"a bad entry header at {off}")
            c = buf[i]
            i += 1
            size |= (c & 0x7F) << shift
            shift += 7
        if kind == OFS_DELTA:
            if i >= len(buf):
                raise Corrupt(f"an entry at {off} cut short")
            c = buf[i]
            i += 1
            rel = c & 0x7F
            while c & 0x80:
                if i >= len(buf) or rel >= 1 << 56:
                    raise Corrupt(f"a bad delta base offset at {off}")
                c = buf[i]
                i += 1
                rel = ((rel + 1) << 7) | (c & 0x7F)
            base = off - rel
            if rel == 0 or base < PACK_HEADER:
                raise Corrupt(f"the delta at {off} names a base {rel} bytes before it")
            return kind, size, off + i, base, b""
        if kind == REF_DELTA:
            ref = buf[i : i + self.hlen]
            if len(ref) != self.hlen:
                raise Corrupt(f"an entry at {off} cut short")
            return kind, size, off + i + self.hlen, -1, ref
        if kind not in TYPE_NAMES:
            raise Corrupt(f"an entry of unknown type {kind} at {off}")
        return kind, size, off + i, -1, b""

    def _inflate(self, pos: int, size: int) -> bytes:
        """The zlib stream at `pos`, which must inflate to exactly `size` bytes."""
        d = zlib.decompressobj()
        pieces: list[bytes] = []
        got = 0
        want = min(size + (size >> 8) + 64, CHUNK)  # a stream is rarely longer than that
        tail = b""
        while True:
            if not tail:
                if pos >= self._end:
                    raise Corrupt("a zlib stream runs past the pack's entries")
                tail = self._pack[pos : min(pos + want, self._end)]
                pos += len(tail)
                want = CHUNK
            try:
                piece = d.decompress(tail, min(size - got, _MAX_LENGTH) + 1)
            except zlib.error as e:
                raise Corrupt(f"zlib: {e}") from None
            tail = d.unconsumed_tail
            got += len(piece)
            if got > size:
                raise Corrupt(f"inflates to more than the {size} bytes its header says")
            if piece:
                pieces.append(piece)
            if d.eof:
                break
        if got != size:
            raise Corrupt(f"inflates to {got} bytes, its header says {size}")
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _delta_target(self, pos: int) -> int:
        """The target size in the header of the delta whose zlib stream is at `pos`,
        inflating only its first bytes."""
        d = zlib.decompressobj()
        head = b""
        tail = b""
        while len(head) < 20 and not d.eof:
            if not tail:
                if pos >= self._end:
                    raise Corrupt("a zlib stream runs past the pack's entries")
                tail = self._pack[pos : min(pos + 256, self._end)]
                pos += len(tail)
            try:
                head += d.decompress(tail, 20 - len(head))
            except zlib.error as e:
                raise Corrupt(f"zlib: {e}") from None
            tail = d.unconsumed_tail
        return delta_sizes(head)[1]

    def _object_at(self, off: int) -> Object:
        """The object whose entry is at `off`, through its delta chain (not verified)."""
        cache, serial = self.cache, self._serial
        chain: list[tuple[int, int, int]] = []  # (offset, stream, delta size), outermost first
        at = off
        while True:
            hit = cache.get((serial, at))
            if hit is not None:
                base = hit
                break
            kind, size, data, base_off, base_id = self._header(at)
            if kind in TYPE_NAMES:
                base = (TYPE_NAMES[kind], self._inflate(data, size))
                if chain:
                    cache.put((serial, at), base)
                break
            chain.append((at, data, size))
            if len(chain) > DELTA_DEPTH_MAX:
                raise Corrupt(f"a delta chain longer than {DELTA_DEPTH_MAX} links (a cycle?)")
            if kind == OFS_DELTA:
                at = base_off
                continue
            found = self.offset_of(base_id)
            if found is None:
                base = self._outside(base_id)
                break
            at = found
        for i in range(len(chain) - 1, -1, -1):
            at, data, size = chain[i]
            base = (base[0], apply_delta(base[1], self._inflate(data, size)))
            if i:
                cache.put((serial, at), base)
        return base

    def _stat_at(self, off: int) -> tuple[bytes, int]:
        kind, size, data, base_off, base_id = self._header(off)
        if kind in TYPE_NAMES:
            return TYPE_NAMES[kind], size
        hit = self.cache.get((self._serial, off))
        if hit is not None:
            return hit[0], len(hit[1])
        target = self._delta_target(data)
        links = 0
        while kind not in TYPE_NAMES:
            links += 1
            if links > DELTA_DEPTH_MAX:
                raise Corrupt(f"a delta chain longer than {DELTA_DEPTH_MAX} links (a cycle?)")
            if kind == OFS_DELTA:
                at = base_off
            else:
                found = self.offset_of(base_id)
                if found is None:
                    return self._outside_stat(base_id), target
                at = found
            hit = self.cache.get((self._serial, at))
            if hit is not None:
                return hit[0], target
            kind, _, _, base_off, base_id = self._header(at)
        return TYPE_NAMES[kind], target

    def _outside(self, base_id: bytes) -> Object:
        """A REF_DELTA base this pack does not hold, through `resolve`."""
        if self._resolve is None:
            raise Corrupt(f"its delta base {base_id.hex()} is not in the pack")
        got = _nested(self._resolve, base_id)
        if got is None:
            raise Corrupt(f"its delta base {base_id.hex()} is in no pack")
        return got

    def _outside_stat(self, base_id: bytes) -> bytes:
        """The type of a REF_DELTA base this pack does not hold."""
        if self._resolve_stat is None:
            return self._outside(base_id)[0]
        got = _nested(self._resolve_stat, base_id)
        if got is None:
            raise Corrupt(f"its delta base {base_id.hex()} is in no pack")
        return got[0]

    def close(self) -> None:
        """Unmap both files (after every reader is done)."""
        if not self._closed:
            self._closed = True
            self._pack.close()
            self._idx.close()

    def __enter__(self) -> PackFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PackFile({str(self.pack_path)!r}, {self.fmt!r})"


def _nested(call: Callable[[bytes], _T], base_id: bytes) -> _T:
    """`call(base_id)`, counted against CROSS_PACK_MAX on this thread."""
    depth = getattr(_nesting, "depth", 0)
    if depth >= CROSS_PACK_MAX:
        raise Corrupt(f"delta bases across packs nest deeper than {CROSS_PACK_MAX} (a cycle?)")
    _nesting.depth = depth + 1
    try:
        return call(base_id)
    finally:
        _nesting.depth = depth


class PackSet:
    """Several packs of one object format read as one: an object is read from the first
    pack (in the given order) whose idx lists it (a damaged entry there is reported, not
    skipped for another pack's copy), a REF_DELTA base from any of them. The
    packs share one base cache of `cache_bytes`. `paths` are the `.pack` files, each with
    its `.idx` beside it."""

    def __init__(
        self,
        paths: Iterable[str | os.PathLike[str]],
        fmt: str,
        *,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self.fmt = fmt
        self.cache = BaseCache(cache_bytes)
        self.packs: list[PackFile] = []
        try:
            for p in paths:
                path = Path(p)
                self.packs.append(
                    PackFile(
                        path,
                        path.with_suffix(".idx"),
                        fmt,
                        self.read,
                        resolve_stat=self.stat,
                        cache=self.cache,
                    )
                )
        except BaseException:
            self.close()
            raise

    @classmethod
    def of_directory(cls, pack_dir: str | os.PathLike[str], fmt: str, **kw: int) -> PackSet:
        """The packs of a directory (a generation's pack/, a repository's objects/pack/):
        each `pack-*.idx` with its `.pack`, in name order."""
        d = Path(pack_dir)
        paths = [
            idx.with_suffix(".pack")
            for idx in sorted(d.glob("pack-*.idx"))
            if idx.with_suffix(".pack").is_file()
        ]
        return cls(paths, fmt, **kw)

    def _find(self, digest: bytes) -> tuple[PackFile, int] | None:
        for pack in self.packs:
            off = pack.offset_of(digest)
            if off is not None:
                return pack, off
        return None

    def read(self, digest: bytes) -> Object | None:
        """(type name, body), verified; None if no pack lists it; `Corrupt` (naming the
        pack and the id) if the pack that does cannot give it."""
        found = self._find(digest)
        return None if found is None else found[0]._read_found(digest, found[1])

    def stat(self, digest: bytes) -> tuple[bytes, int] | None:
        """(type name, size) from headers only; None if no pack lists it."""
        found = self._find(digest)
        return None if found is None else found[0]._stat_found(digest, found[1])

    def __contains__(self, digest: bytes) -> bool:
        return self._find(digest) is not None

    def digests(self) -> Iterator[bytes]:
        """Every id of every pack (one listed by two packs, twice)."""
        for pack in self.packs:
            yield from pack.digests()

    def check(self, digests: Iterable[bytes]) -> set[bytes]:
        """The ids among `digests` whose read raises `Corrupt`: what a damaged pack
        affects (an id no pack lists is not among them)."""
        return _failing(self.read, digests)

    def close(self) -> None:
        for pack in self.packs:
            pack.close()

    def __enter__(self) -> PackSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
