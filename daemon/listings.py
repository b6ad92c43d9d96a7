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
Every fill is recorded with when it came (`_filled`: a READDIR from the start, or an empty
listing whose READDIRs pyfuse3 answers), and a drop forgets only what was filled before
it began: a fill while it was on its way (two opens dropping at once) is of the new mtime.
While an open handle holds another listing than the current one, a new open is not cached
at all (no FOPEN_CACHE_DIR: its READDIRs come here), so a reply still in flight for an
older listing cannot be read back by it; if the invalidation does not reach the kernel in
time, the open is not cached either.

Needs the `FileInfo.cache_readdir` of third_party/pyfuse3-noflush.patch (alkfsd refuses
to start with a pyfuse3 built without the patches: pyfuse3_patches).

Answered in C (third_party/pyfuse3-cacheddirs.patch): once an open found the
kernel's cached listing current (FOPEN_KEEP_CACHE), the next OPENDIRs of that inode are
answered inside pyfuse3 with the same reply and no call into Python, and so are their
RELEASEDIRs (git's 256 fan-out directories of each object directory then cost it no
round trip into the daemon's Python). Their LOOKUPs too: once a directory whose
`entries_in_c` names its children (/git/<format>, /repos/<id>/objects) is handed to the
kernel, pyfuse3 answers the lookup of each of those names with the attributes they had
(`enter`; replaced before an mtime moves, `_drop`), counts it, and gives the count back
at FORGET (`taken`); the children are held in the inode table until the kernel forgets
the parent (`leave`). That holds only while nothing a listing shows can
have changed: every put that ends, every deletion (`Store.changed_hooks`) and every
published set (packs.Served) forgets them all (`changed`), an open's check that raced such
a change adds nothing (the epoch), and a store that other processes change too (a fleet's
member) never has them. An inode the kernel learns at a lookup (so it holds no cached
listing of it) is answered in C from its first open. A READDIR of such a handle (the
kernel's cache was never filled, or evicted) lists the directory now (`cached_readdir`);
if that listing is not the one this module knew may be cached, the inode goes back to
Python. Only the callers that may read every such directory are answered in C (root, the
daemon's user, the owner; anyone on a mount shared with --allow-other, where they are
0555 to all); the others' opens come here, where access is decided.

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

from .nodes.handles import DirHandle

if TYPE_CHECKING:
    from collections.abc import Callable

    from .inodes import InodeTable
    from .nodes.base import Node
    from .services import Services

# the fh bit of a C-answered open (getattr: this module is imported before alkfsd's main
# refuses a pyfuse3 without the patches, and must not fail first)
CACHED_FH: int = getattr(pyfuse3, "CACHED_DIR_FH", 0)
DROP_WAIT_S = 5.0  # bound on the kernel taking an attribute invalidation (then: uncached)

Entry = tuple[bytes, "Node", int]  # (name, node, next offset), as a node's readdir emits
Print = tuple[tuple[bytes, int, bool], ...]  # what the kernel caches of a listing
UNKNOWN: Print = ((b"/", -1, False),)  # a listing pieced together: no listing is it


def fingerprint(entries: list[Entry]) -> Print:
    return tuple((name, off, node.is_dir) for name, node, off in entries)


@dataclass
class _Inode:
    cached: set[Print] = field(default_factory=set)  # may be in the kernel's cache
    open: dict[int, Print] = field(default_factory=dict)  # fh -> snapshot of a caching open
    # each listing the kernel's cache may have been filled with since the last drop, and
    # when (Listings.fills): a drop keeps those filled after it began (see `open`)
    filled: dict[Print, int] = field(default_factory=dict)


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

    def __init__(self, ctx: Services | None, kernel: bool = True) -> None:
        self.ctx = ctx
        self.kernel = kernel and ctx is not None
        self._inodes: dict[int, _Inode] = {}
        self._mtimes: dict[int, int] = {}  # ino -> when its listing was last seen to change
        self.snapshots: dict[int, Snapshot] = {}  # fh -> snapshot
        # opens answered in C (see the module docstring): only a sole writer's listings
        # change solely through what `changed` hears of
        store = getattr(ctx, "store", None)  # (none: a test's stand-in context)
        self.in_c = self.kernel and store is not None and store.sole_writer
        self._read: dict[int, Snapshot] = {}  # ino -> last listing a C-answered open read
        self.opens = 0  # OPENDIRs of caching nodes decided here (not in C)
        # LOOKUPs answered in C: parent inode -> the children it holds entries of, and
        # each child's (parent inode, name)
        self._held: dict[int, list[int]] = {}
        self._entry_of: dict[int, tuple[int, bytes]] = {}
        self.reads = 0  # READDIRs of opens answered in C, served here
        self.fills = 0  # listings recorded as filled into the kernel's cache (`_filled`)
        self.lookups = 0  # LOOKUPs of caching nodes answered here (not in C)
        if self.in_c:
            assert ctx is not None and store is not None
            pyfuse3.cached_dirs_reset()
            o = ctx.options
            everyone = o.allow_other or not o.shared
            callers = {0, ctx.daemon_uid} | ({o.owner_uid} if o.owner_uid is not None else set())
            pyfuse3.cached_dirs_callers(None if everyone else callers)
            store.changed_hooks.append(changed)

    def close(self) -> None:
        """At the mount's end: nothing is answered in C any more."""
        if self.in_c:
            assert self.ctx is not None
            self.in_c = False
            pyfuse3.cached_dirs_reset()
            for parent, name in self._entry_of.values():
                pyfuse3.cached_entries_discard(parent, name)
            self._entry_of.clear()
            self._held.clear()
            try:
                self.ctx.store.changed_hooks.remove(changed)
            except ValueError:
                pass

    def mtime_ns(self, ino: int, default: int) -> int:
        return self._mtimes.get(ino, default)

    async def _drop(self, ino: int, node: Node) -> bool:
        """Make the kernel reset its cached listing of `ino` at the next getdents."""
        ctx = self.ctx
        assert ctx is not None
        held = self._entry_of.get(ino)
        if held is not None:  # (a LOOKUP answered in C must never bring the old mtime back)
            pyfuse3.cached_entries_discard(*held)
        self._mtimes[ino] = max(time.time_ns(), self._mtimes.get(ino, 0) + 1)
        if held is not None:
            pyfuse3.cached_entries_add(*held, node.attr())
        seq = ctx.invalidator.submit_inode(ino)
        return await ctx.invalidator.wait(seq, DROP_WAIT_S)  # (a trio wait: no thread)

    async def open(self, ino: int, fh: int, node: Node, dh: DirHandle) -> pyfuse3.FileInfo | int:
        """The reply to an OPENDIR of `node` (inode `ino`, handle `fh`, the node's `dh`)."""
        if not (self.kernel and node.caches_listing):
            return fh
        epoch = pyfuse3.cached_dirs_epoch() if self.in_c else 0
        self.opens += 1
        entries = await _listing(node, dh)
        mark = fingerprint(entries)
        st = self._inodes.setdefault(ino, _Inode())
        others = set(st.open.values())
        if st.cached <= {mark} and others <= {mark}:
            keep = cache = True
        else:
            keep = False
            since = self.fills
            cache = others <= {mark} and await self._drop(ino, node)
            others = set(st.open.values())  # (the await: others may have opened)
            cache = cache and others <= {mark}
            if cache:
                # Dropped: this open fills it, unless the cache was filled again while
                # the drop was on its way (another open's READDIR, after the mtime
                # moved): the kernel then serves that listing to this open and no
                # READDIR comes, so what was filled since the drop began stays known as
                # cached (forgotten, every later open kept that listing, whatever the
                # directory came to hold)
                st.filled = {m: n for m, n in st.filled.items() if n > since}
                st.cached = set(st.filled)
            else:  # an open handle may still fill the cache with another listing
                st.cached |= others
        fi = pyfuse3.FileInfo(fh=fh, keep_cache=keep)
        setattr(fi, "cache_readdir", cache)  # (not in a stock pyfuse3's stubs)  # noqa: B010
        if cache:
            st.open[fh] = mark
            self.snapshots[fh] = _snapshot(ino, entries, mark)
        if keep and self.in_c:  # the same answer, until something changes: given in C
            if pyfuse3.cached_dirs_add(ino, epoch, not entries) and not entries:
                # (the READDIRs pyfuse3 answers fill the kernel's cache with it, unheard
                # here: after a drop, nothing else would say it may be cached)
                self._filled(st, ())
        return fi

    def looked_up(self, ino: int, node: Node, epoch: int) -> None:
        """A LOOKUP of a caching node answered here (counted) handed the kernel `ino`."""
        self.lookups += 1
        self.learnt(ino, node, epoch)

    def learnt(self, ino: int, node: Node, epoch: int) -> None:
        """A lookup handed the kernel `ino`: if no listing of it can be in the kernel's
        cache (none was ever served, or the kernel forgot the inode since), its opens can
        be answered in C at once. `epoch` is `pyfuse3.cached_dirs_epoch()` from before
        the lookup's first await."""
        if not (self.in_c and node.caches_listing):
            return
        st = self._inodes.get(ino)
        if st is None:
            st = self._inodes[ino] = _Inode()
        elif st.cached or st.open:
            return
        empty = node.listing_known_empty()
        if pyfuse3.cached_dirs_add(ino, epoch, empty) and empty:
            self._filled(st, ())  # (the READDIRs pyfuse3 answers fill the kernel's cache)

    def status(self) -> dict[str, int | bool]:
        """`status.listings`: whether opens are answered in C, how many directories are
        now, how many opens of cached listings were decided here, how many READDIRs of
        opens answered in C were served here (not answered empty in C), and how many
        LOOKUPs of such directories were answered here (not in C)."""
        answered = pyfuse3.cached_dirs_count() if self.in_c else 0
        return {
            "in_c": self.in_c,
            "answered_in_c": answered,
            "entries_in_c": len(self._entry_of),
            "opened_here": self.opens,
            "read_here": self.reads,
            "looked_up_here": self.lookups,
        }

    def enter(self, parent_ino: int, parent: Node, inodes: InodeTable) -> None:
        """`parent` was handed to the kernel: the LOOKUPs of its `entries_in_c` children
        are answered in C from now on, each child held in the inode table meanwhile (and
        its opens answered in C too when no listing of it can be cached)."""
        if not self.in_c or parent_ino in self._held:
            return
        kids = parent.entries_in_c()
        if not kids:
            return
        epoch = pyfuse3.cached_dirs_epoch()
        held = self._held[parent_ino] = []
        for name, node in kids:
            node = inodes.remember(node)  # (the entry's hold)
            pyfuse3.cached_entries_add(parent_ino, name, node.attr())
            self._entry_of[node.ino] = (parent_ino, name)
            held.append(node.ino)
            self.learnt(node.ino, node, epoch)

    def taken(self, ino: int, n: int) -> int:
        """Of `n` lookups of `ino` the kernel forgets, how many C gave (not counted in the
        inode table)."""
        return pyfuse3.cached_entries_take(ino, n) if self._entry_of else 0

    def leave(self, parent_ino: int, inodes: InodeTable) -> None:
        """The kernel forgot `parent_ino`: its children's entries go; what C gave of them is
        counted in the inode table, then the holds are released."""
        for ino in self._held.pop(parent_ino, ()):
            held = self._entry_of.pop(ino, None)
            if held is not None:
                pyfuse3.cached_entries_discard(*held)
            inodes.add(ino, pyfuse3.cached_entries_take(ino, 1 << 62))
            inodes.forget(ino, 1)
            if not inodes.lookups(ino):
                self.forgotten(ino)

    def epoch(self) -> int:
        return pyfuse3.cached_dirs_epoch() if self.in_c else 0

    def forgotten(self, ino: int) -> None:
        """The kernel dropped `ino` (and any listing it cached)."""
        if self.in_c:
            pyfuse3.cached_dirs_discard(ino)
            self._read.pop(ino, None)
            self._inodes.pop(ino, None)  # (its cached listing went with it)

    async def cached_readdir(
        self, ino: int, node: Node, start: int, emit: Callable[[bytes, Node, int], bool]
    ) -> None:
        """A READDIR of an open answered in C: from offset 0 the listing now (recorded as
        one the kernel may cache; a listing other than the one known to be cached sends
        the inode's opens back here), further on the one that read began with."""
        self.reads += 1
        snap = self._read.get(ino)
        st = self._inodes.setdefault(ino, _Inode())
        if start != 0:
            entries = self.entries_after(snap, start) if snap is not None else None
            if entries is None:  # an offset no listing here gave: the node lists itself
                pyfuse3.cached_dirs_discard(ino)
                self._filled(st, UNKNOWN)
                await node.readdir(DirHandle(node), start, emit)
                return
        else:
            entries = await _listing(node, DirHandle(node))
            snap = self._read[ino] = _snapshot(ino, entries, fingerprint(entries))
            if not st.cached <= {snap.mark}:
                pyfuse3.cached_dirs_discard(ino)
            self._filled(st, snap.mark)
        for name, child, next_id in entries:
            if not emit(name, child, next_id):
                break

    def filling(self, snap: Snapshot) -> None:
        """A READDIR from the start: the kernel may cache this snapshot's listing."""
        st = self._inodes.get(snap.ino)
        if st is not None:
            self._filled(st, snap.mark)

    def _filled(self, st: _Inode, mark: Print) -> None:
        """The kernel's cache of `st`'s inode may hold `mark` from now on."""
        self.fills += 1
        st.cached.add(mark)
        st.filled[mark] = self.fills

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


def changed() -> None:
    """Something a cached listing shows may have changed (any thread): no open is answered
    in C until an open has checked its listing again."""
    pyfuse3.cached_dirs_reset()


async def _listing(node: Node, dh: DirHandle) -> list[Entry]:
    """The node's whole listing now, as its readdir emits it from offset 0."""
    entries: list[Entry] = []

    def collect(name: bytes, child: Node, off: int) -> bool:
        entries.append((name, child, off))
        return True

    await node.readdir(dh, 0, collect)
    return entries


def _snapshot(ino: int, entries: list[Entry], mark: Print) -> Snapshot:
    return Snapshot(ino, entries, mark, {off: i + 1 for i, (_, _, off) in enumerate(entries)})


def of(ctx: Services) -> Listings:
    """The mount's Listings (`ctx.listings`: made at first use; without a kernel session,
    never caching)."""
    return ctx.listings
