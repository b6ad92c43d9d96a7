"""Directory listings the kernel caches (FOPEN_CACHE_DIR), checked at every open.

git lists all 256 fan-out directories of `/git/<format>` (and of `/repos/<id>/objects`)
in every process that abbreviates an id or enumerates objects; most are empty. A node
whose class sets `caches_listing = True` has its listing cached by the kernel, so a
repeated listing costs an OPENDIR and a RELEASEDIR but no READDIR.

A stale listing is never served, whoever changed the directory (this daemon, another
process on the store, a peer of the fleet): every OPENDIR computes the listing as a
READDIR would (the node's own `readdir`, into a snapshot that this open's READDIRs are
then served from) and compares it with every listing that may be in the kernel's cache:
the ones opens have filled it with since it was last dropped, and the snapshot of every
open handle that may still fill it. When they differ the cache is dropped before the reply:
the directory's mtime moves on (`mtime_ns`, which the node reports) and its attributes are
invalidated (`pyfuse3.invalidate_inode`, attributes only, through the invalidator,
awaited), so the getdents that follows fetches the attributes, sees another mtime and
resets the cache (fs/fuse/readdir.c, fuse_readdir_cached) — the only way to drop a cached
empty listing, which has no pages to invalidate; the reply also lacks FOPEN_KEEP_CACHE.
While an open handle holds another listing than the current one, a new open is not cached
at all (no FOPEN_CACHE_DIR: its READDIRs come here), so a reply still in flight for an
older listing cannot be read back by it; if the invalidation does not reach the kernel in
time, the open is not cached either.

Needs the `FileInfo.cache_readdir` of third_party/pyfuse3-noflush.patch; with a pyfuse3
that lacks it (CACHE_READDIR false) directories are opened as before (a plain handle).

Why not FUSE_NO_OPENDIR_SUPPORT (OPENDIR answered ENOSYS, no OPENDIR/RELEASEDIR at all):
the kernel then opens every directory of the mount with FOPEN_KEEP_CACHE|FOPEN_CACHE_DIR
and fh 0 (fs/fuse/file.c, fuse_file_open), so pyfuse3's readdir (given only fh) cannot
tell directories apart, no listing could be checked at open, and every directory of the
mount (refs, /objects, scratch directories) would need exact invalidation instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyfuse3

if TYPE_CHECKING:
    from collections.abc import Callable

    from .context import Context
    from .nodes.base import DirHandle, Node

CACHE_READDIR = hasattr(pyfuse3.FileInfo(), "cache_readdir")
DROP_WAIT_S = 5.0  # bound on the kernel taking an attribute invalidation (then: uncached)

Entry = tuple[bytes, "Node", int]  # (name, node, next offset), as a node's readdir emits
Print = tuple[tuple[bytes, int, bool], ...]  # what the kernel caches of a listing


def fingerprint(entries: list[Entry]) -> Print:
    return tuple((name, off, node.is_dir) for name, node, off in entries)


@dataclass
class _Inode:
    cached: set[Print] = field(default_factory=set)  # may be in the kernel's cache
    open: dict[int, Print] = field(default_factory=dict)  # fh -> snapshot of a caching open


@dataclass
class Snapshot:
    """One caching open: the listing its READDIRs are served from."""

    ino: int
    entries: list[Entry]
    mark: Print
    index: dict[int, int]  # next offset -> position after that entry


class Listings:
    """The per-open decision, the snapshots and the listings' mtimes (trio thread only,
    but `mtime_ns`). One per mount: `of(ctx)`."""

    def __init__(self, ctx: Context | None, kernel: bool = True) -> None:
        self.ctx = ctx
        self.kernel = kernel and CACHE_READDIR and ctx is not None
        self._inodes: dict[int, _Inode] = {}
        self._mtimes: dict[int, int] = {}  # ino -> when its listing was last seen to change
        self.snapshots: dict[int, Snapshot] = {}  # fh -> snapshot

    def mtime_ns(self, ino: int, default: int) -> int:
        return self._mtimes.get(ino, default)

    async def _drop(self, ino: int) -> bool:
        """Make the kernel reset its cached listing of `ino` at the next getdents."""
        ctx = self.ctx
        assert ctx is not None
        self._mtimes[ino] = max(time.time_ns(), self._mtimes.get(ino, 0) + 1)
        seq = ctx.invalidator.submit_inode(ino)
        return await ctx.invalidator.wait(seq, DROP_WAIT_S)  # (a trio wait: no thread)

    async def open(self, ino: int, fh: int, node: Node, dh: DirHandle) -> pyfuse3.FileInfo | int:
        """The reply to an OPENDIR of `node` (inode `ino`, handle `fh`, the node's `dh`)."""
        if not (self.kernel and node.caches_listing):
            return fh
        entries: list[Entry] = []

        def collect(name: bytes, child: Node, off: int) -> bool:
            entries.append((name, child, off))
            return True

        await node.readdir(dh, 0, collect)
        mark = fingerprint(entries)
        st = self._inodes.setdefault(ino, _Inode())
        others = set(st.open.values())
        if st.cached <= {mark} and others <= {mark}:
            keep = cache = True
        else:
            keep = False
            cache = others <= {mark} and await self._drop(ino)
            others = set(st.open.values())  # (the await: others may have opened)
            cache = cache and others <= {mark}
            if cache:
                st.cached = set()  # dropped: this open fills it
            else:  # an open handle may still fill the cache with another listing
                st.cached |= others
        fi = pyfuse3.FileInfo(fh=fh, keep_cache=keep)
        setattr(fi, "cache_readdir", cache)  # (not in a stock pyfuse3's stubs)  # noqa: B010
        if cache:
            st.open[fh] = mark
            index = {off: i + 1 for i, (_, _, off) in enumerate(entries)}
            self.snapshots[fh] = Snapshot(ino, entries, mark, index)
        return fi

    def filling(self, snap: Snapshot) -> None:
        """A READDIR from the start: the kernel may cache this snapshot's listing."""
        st = self._inodes.get(snap.ino)
        if st is not None:
            st.cached.add(snap.mark)

    def release(self, fh: int) -> None:
        snap = self.snapshots.pop(fh, None)
        if snap is None:
            return
        st = self._inodes.get(snap.ino)
        if st is not None:
            st.open.pop(fh, None)

    def entries_after(self, snap: Snapshot, start: int) -> list[Entry] | None:
        """The snapshot's entries after offset `start` (None: not an offset it gave)."""
        if start == 0:
            return snap.entries
        i = snap.index.get(start)
        return None if i is None else snap.entries[i:]

    def replay(self, fh: int, start: int, emit: Callable[[bytes, Node, int], bool]) -> bool:
        """Serve a READDIR of the open `fh` from the snapshot its OPENDIR took: False when
        there is none (or `start` is not an offset it gave), and the node lists itself."""
        snap = self.snapshots.get(fh) if self.snapshots else None
        entries = self.entries_after(snap, start) if snap is not None else None
        if snap is None or entries is None:
            return False
        if start == 0:
            self.filling(snap)
        for name, node, next_id in entries:
            if not emit(name, node, next_id):
                break
        return True


def of(ctx: Context) -> Listings:
    """The mount's Listings (`ctx.listings`: made at first use; without a kernel session,
    never caching)."""
    return ctx.listings
