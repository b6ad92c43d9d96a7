"""The store's verified reads: get, a large file's chunks checked against its catalog
row, read_range, and verify (every object re-hashed).
"""

from __future__ import annotations

import builtins
import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from ..catalog import ChunkDigester, Record
from ..errors import AlkfsError, Corrupt, Invalid
from ..keys import Key
from .state import CHUNK, StoreState


class StoreReads(StoreState):
    """`Store`'s verified reads."""

    if TYPE_CHECKING:  # (defined by the other parts of `Store`)

        def record(self, key: Key) -> Record | None: ...

        def iter_keys(self) -> Iterator[bytes]: ...

        def check_stopping(self, n: int = 0) -> None: ...

        def _packed(self, key: Key) -> bytes | None: ...

    # -- verified reads -----------------------------------------------------------
    def _check(self, key: Key, data: bytes) -> bytes:
        if not key.matches(data):
            self._mark_corrupt(key)
            raise Corrupt(f"{key}: stored bytes do not hash to the key")
        return data

    def mark_corrupt(self, key: Key) -> None:
        """Report the object in `status.corrupt` (until a verified re-put or read clears it)."""
        if key.raw not in self.corrupt:
            self.log.error("corrupt object %s: stored bytes do not hash to the key", key)
        self.corrupt.add(key.raw)

    _mark_corrupt = mark_corrupt

    def large_path(self, key: Key) -> Path | None:
        if self.large is None:
            return None
        return self.large.path(key.raw)

    def kv_value(self, key: Key) -> bytes | None:
        """The kv tier's bytes for `key`, unverified (callers verify): a pending small
        object's too (`ahead`)."""
        data = self.kv.read(key.raw)
        if data is None and self.ahead is not None:
            return self.ahead.read(key.raw)
        return data

    def get(self, key: Key) -> bytes | None:
        """The object's bytes, verified; None when absent; Corrupt when they do not hash."""
        data = self.kv_value(key)
        if data is not None:
            return self._check(key, data)
        if self.large is None:
            return self._packed(key)
        path = self.large.path(key.raw)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read()
                # Served unhashed only if this very file was verified before and did
                # not change while it was read (an edit changes its ctime).
                if self.is_verified(key, st) and self.is_verified(key, os.fstat(f.fileno())):
                    return data
        except FileNotFoundError:
            return self._packed(key)
        self._check_large(key, data, st)
        self.remember_verified(key, st)
        return data

    def _check_large(self, key: Key, data: bytes, st: os.stat_result) -> None:
        """A whole large file's bytes against its catalog row (its size, every chunk), or,
        without a row, against its key, recording the row then; Corrupt (marked) if not."""
        rec = self.record(key)
        if rec is not None:
            view = memoryview(data)
            ok = len(data) == rec.size and all(
                rec.matches(i, view[slice(*rec.span(i))]) for i in range(rec.count)
            )
            if not ok:
                self._mark_corrupt(key)
                raise Corrupt(f"{key}: stored bytes do not hash to the key")
            return
        self._check(key, data)
        digester = ChunkDigester()
        digester.update(data)
        self._record_verified(key, digester, st)

    def _record_verified(self, key: Key, digester: ChunkDigester, st: os.stat_result) -> None:
        """Record the row of a large file just verified whole against its key (an object
        stored before the catalog, or one whose row was lost or wrong)."""
        assert self.catalog is not None
        new = digester.record(key.raw, st.st_mtime_ns)
        old = self.catalog.get(key.raw)
        if old is not None:
            if (old.size, old.chunk_size, old.chunk_algo, old.chunks) == (
                new.size,
                new.chunk_size,
                new.chunk_algo,
                new.chunks,
            ):
                return
            self.log.warning("%s: its catalog row did not match its verified bytes", key)
            new = Record(
                new.key,
                new.size,
                max(old.stored_ns, new.stored_ns),
                new.chunk_size,
                new.chunk_algo,
                new.chunks,
            )
        self.catalog.put(new)

    @staticmethod
    def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def is_verified(self, key: Key, st: os.stat_result) -> bool:
        """Whether this very file (same inode, size, mtime and ctime) was already verified."""
        return self._verified.get(key.raw) == self._identity(st)

    def remember_verified(
        self, key: Key, st: os.stat_result, now: os.stat_result | None = None
    ) -> None:
        """The file `st` describes passed its check: later opens of this very file hash
        nothing (`is_verified`). `now`: the file as it is after the check (a reader's
        fstat); nothing is remembered unless it is still the same file."""
        if now is not None and self._identity(now) != self._identity(st):
            return
        with self._vlock:
            self._verified[key.raw] = self._identity(st)
            self.corrupt.discard(key.raw)

    def verify_file(self, key: Key, path: Path) -> None:
        """Verify a whole large-tier file in one streaming pass; Corrupt on mismatch."""
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if self.is_verified(key, st):
                return
            self._stream_large(key, f.fileno(), st)

    def verify_open(self, key: Key, fd: int, st: os.stat_result) -> Record | None:
        """Verify the whole open large file `fd` (fstat `st`) in one pass, against its row
        or, without one, against its key (recording the row): its row afterwards.
        Corrupt (marked) on a mismatch."""
        self._stream_large(key, fd, st)
        return self.record(key)

    def read_chunk(self, key: Key, fd: int, rec: Record, i: int) -> bytes:
        """Chunk i of the open large file `fd`, verified against its row: Corrupt (and
        marked) unless the file holds exactly that chunk there (no byte changed, not cut
        short, and for the last one nothing after it)."""
        start, end = rec.span(i)
        extra = 1 if i == rec.count - 1 else 0  # a byte past the size: the file grew
        data = os.pread(fd, end - start + extra, start)
        if not rec.matches(i, data):
            self.log.warning("%s: bytes %d-%d are not its recorded chunk %d", key, start, end, i)
            self._mark_corrupt(key)
            raise Corrupt(f"{key}: stored bytes do not hash to the key")
        return data

    def _stream_large(
        self,
        key: Key,
        fd: int,
        st: os.stat_result,
        *,
        full: bool = False,
        offset: int = 0,
        length: int = 0,
    ) -> bytes:
        """One pass over a whole large file, keeping bytes [offset, offset+length) of it.
        Checked against its catalog row (every chunk, nothing past its size) or, without
        a row or when `full` (verify), against its key, the row being recorded (or
        corrected) from the same pass. Corrupt (marked) on any mismatch."""
        rec = None if full else self.record(key)
        parts: builtins.list[bytes] = []
        end = offset + length

        def keep(pos: int, chunk: bytes) -> None:
            lo, hi = max(offset, pos), min(end, pos + len(chunk))
            if lo < hi:
                parts.append(chunk[lo - pos : hi - pos])

        if rec is not None:
            for i in range(rec.count):
                keep(rec.span(i)[0], self.read_chunk(key, fd, rec, i))
            if rec.count == 0 and os.pread(fd, 1, 0):
                self._mark_corrupt(key)
                raise Corrupt(f"{key}: stored bytes do not hash to the key")
        else:
            h = key.algo.hasher()
            digester = ChunkDigester()
            pos = 0
            while chunk := os.pread(fd, CHUNK, pos):
                h.update(chunk)
                digester.update(chunk)
                keep(pos, chunk)
                pos += len(chunk)
            if h.digest() != key.digest:
                self._mark_corrupt(key)
                raise Corrupt(f"{key}: stored bytes do not hash to the key")
            self._record_verified(key, digester, st)
        self.remember_verified(key, st)
        return b"".join(parts)

    def read_range(self, key: Key, offset: int, length: int) -> tuple[bytes, str] | None:
        """A verified slice and the SHA-256 hex of exactly that slice; None when absent."""
        if offset < 0 or length < 0:
            raise Invalid("negative offset or length")
        data = self.kv_value(key)
        if data is not None:
            piece = self._check(key, data)[offset : offset + length]
        else:
            path = self.large_path(key)
            try:
                if path is None:
                    raise FileNotFoundError
                with open(path, "rb") as f:
                    piece = self._large_slice(key, f, offset, length)
            except FileNotFoundError:
                whole = self._packed(key)
                if whole is None:
                    return None
                piece = whole[offset : offset + length]
        return piece, hashlib.sha256(piece).hexdigest()

    def _large_slice(self, key: Key, f: BinaryIO, offset: int, length: int) -> bytes:
        """A slice of an open large-tier file, never unverified bytes.

        Fast path: the file was verified whole before and is unchanged across the pread.
        With a catalog row, only the chunks the slice covers are read and checked. An
        object without a row is verified whole (its row recorded) in one streaming pass
        that keeps the slice, so a freshen racing the read is no error."""
        fd = f.fileno()
        st = os.fstat(fd)
        if self.is_verified(key, st):
            piece = os.pread(fd, length, offset)
            if self.is_verified(key, os.fstat(fd)):
                return piece
            st = os.fstat(fd)
        rec = self.record(key)
        if rec is None:
            return self._stream_large(key, fd, st, offset=offset, length=length)
        parts: builtins.list[bytes] = []
        for i in rec.covering(offset, length):
            start, end = rec.span(i)
            chunk = self.read_chunk(key, fd, rec, i)
            lo, hi = max(offset, start), min(offset + length, end)
            parts.append(chunk[lo - start : hi - start])
        return b"".join(parts)

    def verify(self, progress: Callable[[int], None] | None = None) -> builtins.list[Key]:
        """Re-hash every object against its key (ignoring what was remembered); a large
        object's catalog row is recorded or corrected from the same pass. Returns the
        corrupt ones."""
        self._verified.clear()
        bad: builtins.list[Key] = []
        self.verifying = 0
        try:
            for n, raw in enumerate(self.iter_keys(), 1):
                self.check_stopping(n)
                self.verifying = n
                key = Key(raw)
                try:
                    if not self._verify_one(key):
                        continue
                except Corrupt:
                    bad.append(key)
                if progress is not None:
                    progress(n)
            for hook in list(self.verify_hooks):  # e.g. the derived packs (alkfs/git/packs.py)
                try:
                    hook()
                except AlkfsError as exc:
                    self.log.error("verify: %s", exc)
        finally:
            self.verifying = None
        return sorted(bad)

    def _verify_one(self, key: Key) -> bool:
        """Verify one object fully; False if it is absent."""
        if self.large is None or self.kv.stat(key.raw) is not None:
            return self.get(key) is not None
        try:
            with open(self.large.path(key.raw), "rb") as f:
                self._stream_large(key, f.fileno(), os.fstat(f.fileno()), full=True)
        except FileNotFoundError:
            return self.get(key) is not None  # (deleted meanwhile, or moved tier: none)
        return True
