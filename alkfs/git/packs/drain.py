"""The drain: once a set is published, the kv rows of the git objects its main packs hold
are deleted, so that a packed object is kept once, in its pack (git objects are kept as
git keeps them: in packs; docs/git.md). A mixin of `Derived` (builder.py).

From the first drain on, the format's sets are the only copy of what they hold: the
store's directory then has `derived/<fmt>/PRIMARY`, written (durably) before the first
row is deleted. While it is there:

- a build carries every object of the previous set over (less what it must exclude),
  instead of building from the kv alone (`_plan_carry`), and reads what the kv lacks
  from the previous set (`_read_many`, kvread.py);
- a set is never withdrawn (not on a failed verify, a full disk, nor a failed rebuild
  before a sweep's deletions: those deletions wait instead); an unreadable published
  set is kept on disk, reported, and no build replaces it;
- a sweep's candidates are written back into the kv before the set without them is
  published (`restore`, called by the delete guard, guard.py), stored at time 0 so
  they count as written before they were staged (a put since keeps its own time), so
  that one whose deletion arbitration cancels is still stored and packed again.

Rows the drain skips: objects staged for deletion (they stay loose for their window),
those in the set's staged pack only, and all those of a set with a main pack that does
not verify (`git index-pack --verify` hashes every object of a pack again, once a pack
a process: logged, in `last_error`; the rows stay, the next drain looks again).

A fleet's members share the sets: there, the drain runs under the fleet's builder lock
and waits until every other live member serves the published set or a newer one (every
newer set carries what the drained one holds), so that no member looks for a drained
object in a set that lacks it (alkfs/git/shared_packs.py). Nothing drains with
`ALKFS_DRAIN=0`."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import AlkfsError, StoreIO
from ...keys import Key
from ...settings import settings
from ...tiers.local import fsync_dir
from ...tiers.sql import SqlTier
from ..packread import PackSet
from ..shared_packs import SERVE_WAIT_S
from .sets import Generation

if TYPE_CHECKING:
    from ...keys import Algorithm
    from ...store import Store
    from ..shared_packs import SharedPacks

log = logging.getLogger("alkfs.packs")

PRIMARY = "PRIMARY"
PRIMARY_TEXT = b"alkfs: these sets are the only copy of the git objects they hold\n"
DRAIN_PAGE = 8192  # kv rows looked at (and deleted) a transaction (one commit each)
GIT_READS_FROM = 256  # objects read from the packs by git rather than here, from this many
_HASHES = {"sha1": hashlib.sha1, "sha256": hashlib.sha256}


def drain_enabled() -> bool:
    return settings().drain


def open_packs(gen: Generation) -> PackSet:
    """A set's packs, opened for reading (close it)."""
    return PackSet([idx.path.with_suffix(".pack") for idx in gen.indexes], gen.fmt)


class Drain:
    """A mixin of `Derived`: the drain, the carried build's reads, `restore`."""

    store: Store
    fmt: str
    algo: Algorithm
    root: Path
    lock: threading.RLock
    shared: SharedPacks | None
    _current: Generation | None
    broken: str | None
    drained: int  # rows deleted by this process's drains (status)
    drain_owed: bool  # a fleet's drain waits for a member serving an older set
    packs_verified: set[bytes]  # the checksums of the packs git verified (_verified)
    last_error: str | None

    if TYPE_CHECKING:

        def _kv(self) -> SqlTier: ...
        def _range(self) -> tuple[bytes, bytes]: ...
        def _builder(self, blocking: bool) -> contextlib.AbstractContextManager[bool]: ...
        def refresh(self, what: str | None = None) -> None: ...
        def _git(
            self,
            repo: Path,
            *args: str,
            objdir: Path | None = None,
            input: bytes | None = None,
        ) -> bytes: ...

    @property
    def primary(self) -> bool:
        """Whether the sets are the only copy of some objects (PRIMARY is there)."""
        return (self.root / PRIMARY).exists()

    def _make_primary(self) -> None:
        if self.primary:
            return
        tmp = self.root / f"{PRIMARY}.tmp"
        with open(tmp, "wb") as f:
            f.write(PRIMARY_TEXT)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, self.root / PRIMARY)
        fsync_dir(self.root)

    def drain(self, wait_s: float = SERVE_WAIT_S) -> int:
        """Delete the kv rows of the objects the published set's main packs hold (the
        packs verified by git first), page by page under the set's lock; how many. Stops
        at the store's stop (the next drain goes on).

        In a fleet, under the fleet's builder lock all along (no member builds from the
        kv meanwhile), and only once every other live member serves the published set or
        a newer one (waited for up to `wait_s`); otherwise nothing, and `drain_owed` is
        set (the daemon's intake tries again)."""
        if not drain_enabled():
            return 0
        if self.shared is None:
            return self._drain() if self.store.holds_lock else 0
        with self.lock, self._builder(True):
            self.refresh()
            gen = self._current
            if gen is None or not gen.indexes:
                self.drain_owed = False
                return 0
            if not self.shared.all_serve(gen.number, wait_s):
                if not self.drain_owed:
                    log.info(
                        "derived %s: another daemon still serves a set older than %d: "
                        "its objects stay in the kv too until it serves that one",
                        self.fmt,
                        gen.number,
                    )
                self.drain_owed = True
                return 0
            self.drain_owed = False
            return self._drain()

    def _drain(self) -> int:
        for hook in self.store.before_drain:
            hook()
        kv = self._kv()
        lo, hi = self._range()
        after = lo
        total = 0
        try:
            while True:
                self.store.check_stopping()
                with self.lock:
                    gen = self._current
                    if gen is None or not gen.indexes:
                        return total
                    page = kv.scan(after, hi, DRAIN_PAGE)
                    if not page:
                        return total
                    after = page[-1].key
                    staged = self.store.window.staged_between(page[0].key, page[-1].key)
                    gone = [
                        e.key for e in page if e.key not in staged and gen.main_holds(e.key[1:])
                    ]
                    if not gone or not self._verified(gen):
                        continue
                    self._make_primary()
                    n = 0
                    if len(gone) == len(page):  # (the whole page: one range)
                        n = kv.delete_range(page[0].key, page[-1].key, len(page))
                    if not n:
                        n = kv.delete_many(gone)
                    total += n
                    self.drained += n
        finally:
            if total:
                log.info("derived %s: %d objects now kept in their packs alone", self.fmt, total)
                db = self.store.db
                if db is not None:  # the rows' pages go back to the filesystem
                    try:
                        db.give_back(self.store.stopping.is_set)
                    except AlkfsError as exc:  # (the next drain or sweep tries again)
                        log.warning(
                            "derived %s: the database kept its free pages: %s", self.fmt, exc
                        )

    def _verified(self, gen: Generation) -> bool:
        """Whether every main pack of `gen` verifies: `git index-pack --verify` hashes
        each object again and compares the index (once a pack, by its checksum, in this
        process: an intake's set shares the previous set's files). A pack that fails is
        logged and nothing it holds is drained."""
        done = self.packs_verified
        for idx in gen.indexes:
            if idx is gen.staged_index or idx.pack_checksum in done:
                continue
            pack = idx.path.with_suffix(".pack")
            try:
                self._git(
                    gen.root, "index-pack", f"--object-format={self.fmt}", "--verify", str(pack)
                )
            except (OSError, AlkfsError) as exc:
                log.error(
                    "derived %s: %s does not verify, nothing drained: %s", self.fmt, pack.name, exc
                )
                self.last_error = f"{pack.name} does not verify: {str(exc)[:500]}"
                return False
            done.add(idx.pack_checksum)
        return True

    def packed_values(self, digests: list[bytes]) -> Iterator[tuple[bytes, bytes]]:
        """(digest, canonical bytes) of those of `digests` the published set holds, read
        from its packs and verified (one that does not verify: logged, left out). Many
        are read by git (`cat-file --batch`, a page at a time), hashed here."""
        gen = self._current
        if gen is None or not gen.indexes or not digests:
            return
        if len(digests) > GIT_READS_FROM:
            for i in range(0, len(digests), DRAIN_PAGE):
                page = digests[i : i + DRAIN_PAGE]
                try:
                    found = list(self._git_values(gen, page))
                except StoreIO as exc:  # (git stops at a damaged object: each is read here)
                    log.warning("derived %s: git could not read a page: %s", self.fmt, exc)
                    found = list(self._read_here(gen, page))
                yield from found
            return
        yield from self._read_here(gen, digests)

    def _read_here(self, gen: Generation, digests: list[bytes]) -> Iterator[tuple[bytes, bytes]]:
        with open_packs(gen) as packs:
            for n, d in enumerate(digests):
                self.store.check_stopping(n)
                try:
                    found = packs.read(d)
                except (OSError, AlkfsError) as exc:
                    log.error(
                        "derived %s: %s cannot be read from its pack: %s", self.fmt, d.hex(), exc
                    )
                    continue
                if found is not None:
                    kind, body = found
                    yield d, b"%s %d\0" % (kind, len(body)) + body

    def _git_values(self, gen: Generation, digests: list[bytes]) -> Iterator[tuple[bytes, bytes]]:
        """`packed_values` of one page, read by `git cat-file --batch` from the set's packs
        (one it does not hold, `missing`, is left out) and hashed against its name."""
        held = [d for d in digests if d in gen]
        if not held:
            return
        with tempfile.TemporaryDirectory(dir=self.root, prefix="tmp-read-") as tmp:
            repo = Path(tmp) / "repo"
            self._git(repo, "init", "-q", "--bare", f"--object-format={self.fmt}", str(repo))
            out = self._git(
                repo,
                "cat-file",
                "--batch",
                objdir=gen.root,
                input=b"".join(d.hex().encode() + b"\n" for d in held),
            )
        hasher = _HASHES[self.fmt]
        pos = 0
        for n, d in enumerate(held):
            self.store.check_stopping(n)
            nl = out.index(b"\n", pos)
            words = out[pos:nl].split()
            if len(words) != 3:  # (`<oid> missing`: gone meanwhile)
                pos = nl + 1
                continue
            size = int(words[2])
            data = b"%s %d\0" % (words[1], size) + out[nl + 1 : nl + 1 + size]
            pos = nl + 1 + size + 1
            if hasher(data).digest() != d:
                log.error("derived %s: %s does not read back from its pack", self.fmt, d.hex())
                continue
            yield d, data

    def restore(self, digests: list[bytes]) -> int:
        """Write back into the kv those of `digests` (a sweep's candidates) that only the
        published set holds, stored at time 0 (before any staging: a put since keeps
        its own time). Call it under the set's lock, before a set without them is
        published. How many were written."""
        if not self.primary or not digests:
            return 0
        kv = self._kv()
        tag = bytes([self.algo.value])
        have = kv.present([tag + d for d in digests])
        missing = [d for d in digests if tag + d not in have]
        written = 0
        raws: list[bytes] = []
        datas: list[bytes] = []
        for d, data in self.packed_values(missing):
            raws.append(tag + d)
            datas.append(data)
            if len(raws) >= DRAIN_PAGE:
                written += kv.insert_absent(raws, datas, 0)
                raws, datas = [], []
        if raws:
            written += kv.insert_absent(raws, datas, 0)
        if written:
            log.info(
                "derived %s: %d candidates written back loose before a rewrite", self.fmt, written
            )
        return written

    def undrain(self) -> int:
        """Write every object the published set alone holds back into the kv (stored at
        its packs' time), then remove PRIMARY: the kv holds every object again (before
        a move to PostgreSQL, whose files may move with it: its daemons drain again).
        How many."""
        if not self.primary:
            return 0
        kv = self._kv()
        tag = bytes([self.algo.value])
        written = 0
        with self.lock, self._builder(True):
            self.refresh()  # (a fleet's member: the set published for the fleet)
            gen = self._current
            if self.broken is not None:
                raise StoreIO(f"derived {self.fmt}: {self.broken}: its objects cannot be read")
            if gen is not None and gen.indexes:
                stamp = min(gen.mtimes.values(), default=1)
                for idx in gen.indexes:
                    digests = list(idx.digests())
                    for i in range(0, len(digests), DRAIN_PAGE):
                        self.store.check_stopping()
                        part = digests[i : i + DRAIN_PAGE]
                        have = kv.present([tag + d for d in part])
                        missing = [d for d in part if tag + d not in have]
                        found = list(self.packed_values(missing))
                        if len(found) != len(missing):
                            raise StoreIO(
                                f"derived {self.fmt}: {len(missing) - len(found)} objects "
                                "of the published set do not read back (see the log)"
                            )
                        if found:
                            written += kv.insert_absent(
                                [tag + d for d, _ in found], [v for _, v in found], stamp
                            )
            (self.root / PRIMARY).unlink()
            fsync_dir(self.root)
        log.info("derived %s: %d objects written back into the kv", self.fmt, written)
        return written

    def report_affected(self, gen: Generation) -> int:
        """Read every object of a set whose files do not verify: those that do not read
        back (the damaged delta chains) are listed in `status.corrupt`; the rest are
        still served. How many."""
        tag = bytes([self.algo.value])
        bad: set[bytes] = set()
        try:
            with open_packs(gen) as packs:
                for idx in gen.indexes:
                    bad |= packs.check(idx.digests())
        except (OSError, AlkfsError) as exc:
            log.error("derived %s: the set cannot be read at all: %s", self.fmt, exc)
            return 0
        for d in sorted(bad):
            self.store.mark_corrupt(Key(tag + d))
        return len(bad)

    def refuse_withdraw(self, why: str) -> bool:
        """A primary set is never withdrawn: True (and logged) when that is refused."""
        if not self.primary:
            return False
        log.error(
            "derived %s: the packs are the only copy of their objects: not withdrawn (%s)",
            self.fmt,
            why,
        )
        return True
