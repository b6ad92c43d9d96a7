"""The store's puts: one object from bytes or a stream, with its pin, and freshening."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Concatenate, ParamSpec, TypeVar

from ..catalog import ChunkDigester
from ..db import now_ns
from ..errors import AlkfsError, Invalid, NoSpace, StoreIO, TooLarge, Verification
from ..gc.arbiter import Pin
from ..git.objects import MAX_HEADER, check_canonical
from ..keys import Algorithm, Key
from ..reserve import is_no_space
from ..tiers.staging import StagingWriter
from .state import CHUNK, StoreState

BEHIND_PUT_MAX = 65536  # the write-behind takes bytes up to this (hashed in ~40 us)

Source = bytes | bytearray | memoryview | BinaryIO | Iterable[bytes]


@dataclass(slots=True)
class PutResult:
    """The stored key and the in-process pin that protects it until its name is published."""

    key: Key
    pin: Pin
    created: bool


def _chunks(source: Source) -> Iterator[bytes]:
    """The input as chunks; a failing input surfaces as StoreIO."""
    if isinstance(source, bytes | bytearray | memoryview):
        yield bytes(source)
        return
    try:
        if hasattr(source, "read"):
            while chunk := source.read(CHUNK):
                yield chunk
        else:
            yield from source
    except AlkfsError:
        raise
    except Exception as exc:
        raise StoreIO(f"the input stream failed: {exc}") from exc


S = TypeVar("S", bound=StoreState)
P = ParamSpec("P")
R = TypeVar("R")


def _counted(fn: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """A Store method that may add objects: `Store.puts` moves when it ends."""

    @functools.wraps(fn)
    def counted(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.puts += 1
            for hook in self.changed_hooks:
                hook()

    return counted


class StorePuts(StoreState):
    """`Store`'s single puts."""

    if TYPE_CHECKING:  # (defined by the other parts of `Store`)

        def engine_delete(self, key: bytes) -> int | None: ...

        def on_deleted(self, key: bytes) -> None: ...

        def _put_done(self, raws: Sequence[bytes], datas: Sequence[bytes | bytearray]) -> None: ...

        def _packed(self, key: Key) -> bytes | None: ...

    # -- puts -----------------------------------------------------------------
    @_counted
    def put(
        self,
        source: Source,
        length: int | None = None,
        algo: Algorithm = Algorithm.SHA256,
        expect: Key | None = None,
        within: Callable[[Key], None] | None = None,
    ) -> PutResult:
        """Store a stream; returns the key and a pin the caller releases once the
        object's name is published. Nothing is left behind when it fails; on a full
        disk that is NoSpace (and, while the disk stays full, before reading anything).

        `within(key)` names the object in the same transaction: for an object of the
        kv tier it runs inside the transaction that inserts it (one commit; if it
        raises, nothing is stored), for a large one in a transaction right after the
        file is published. The returned pin is held throughout either way."""
        reserve = self.reserve
        if reserve is None:
            return self._put(source, length, algo, expect, within)
        reserve.admit()
        try:
            return self._put(source, length, algo, expect, within)
        except NoSpace:
            reserve.hit()  # (now that the staging file is gone)
            raise

    def _put(
        self,
        source: Source,
        length: int | None,
        algo: Algorithm,
        expect: Key | None,
        within: Callable[[Key], None] | None = None,
    ) -> PutResult:
        if expect is not None and expect.algo is not algo:
            raise Invalid("the expected key has another algorithm")
        spill = self.mode == "dual-tier"
        if length is not None and length > self.threshold and self.mode == "kv-only":
            raise TooLarge(f"{length} bytes is over the kv-only threshold {self.threshold}")
        hasher = algo.hasher()
        buf = bytearray()
        head = b""
        total = 0
        staging: Path | None = None
        writer: StagingWriter | None = None
        try:
            for chunk in _chunks(source):
                if not chunk:
                    continue
                total += len(chunk)
                if length is not None and total > length:
                    raise Verification(f"more bytes than the declared length {length}")
                if len(head) < MAX_HEADER:
                    head += chunk[: MAX_HEADER - len(head)]
                if writer is not None:
                    writer.write(chunk)  # written by its thread while this one hashes
                hasher.update(chunk)
                if writer is None:
                    buf += chunk
                    if len(buf) > self.threshold:
                        if self.mode == "kv-only":
                            raise TooLarge(f"over the kv-only threshold {self.threshold}")
                        if spill:
                            assert self.large is not None
                            writer = self.large.new_writer()
                            staging = writer.path
                            writer.write(buf)
                            buf = bytearray()
            if length is not None and total != length:
                raise Verification(f"{total} bytes where {length} were declared")
            if algo.is_git:
                check_canonical(head, total)
            key = Key.of(algo, hasher.digest())
            if expect is not None and key != expect:
                raise Verification(f"the content hashes to {key}, not {expect}")
            if writer is not None:
                writer.finish()  # every byte written and fsynced
                writer.close()
            pin = self.arbiter.acquire(key)  # pin before publish
            try:
                if key.raw in self.corrupt:
                    # Known-bad stored bytes: these good ones replace them (under our pin,
                    # so no sweep can act on the key meanwhile) instead of deduping into them.
                    self.log.warning("repairing corrupt object %s with a verified re-put", key)
                    self.engine_delete(key.raw)
                    self.on_deleted(key.raw)
                stamp = now_ns()
                if staging is not None:
                    assert self.large is not None and writer is not None
                    created = self._publish_large(key, staging, writer.digester, stamp)
                    staging = None
                    if within is not None:
                        with self.tx():
                            within(key)
                elif within is not None:
                    with self.tx():
                        created = self.kv.put(key.raw, bytes(buf), stamp)
                        self._put_done((key.raw,), (buf,))
                        if within is not None:
                            within(key)
                else:
                    created = self.kv.put(key.raw, bytes(buf), stamp)
                    self._put_done((key.raw,), (buf,))
            except BaseException:
                pin.release()
                raise
            return PutResult(key, pin, created)
        except OSError as exc:
            if is_no_space(exc):
                raise NoSpace(f"no space left on the device holding the store: {exc}") from exc
            raise StoreIO(f"the large tier failed: {exc}") from exc
        finally:
            if writer is not None:
                writer.close()
            if staging is not None and self.large is not None:
                self.large.discard(staging)

    def tx(self) -> AbstractContextManager[object]:
        """The database's write transaction, to join several changes into one commit (a
        memory store has none: nothing to join)."""
        return self.db.tx() if self.db is not None else contextlib.nullcontext()

    def _publish_large(self, key: Key, staging: Path, digester: ChunkDigester, stamp: int) -> bool:
        """Record the object's catalog row, then link its staging file into place (the
        caller holds the key's pin: no delete of it runs meanwhile). The row comes first,
        so every visible object a put made has its row; a crash between the two leaves a
        row without a file, which is inert (see alkfs/catalog.py). A row this put added
        is removed again if the link fails. False: the object existed (freshened)."""
        assert self.large is not None and self.catalog is not None
        rec = digester.record(key.raw, stamp)
        had = self.catalog.get(key.raw) is not None
        self.catalog.put(rec)
        try:
            return self.large.publish(key.raw, staging, stamp)
        except BaseException:
            if not had:
                self.catalog.delete(key.raw)
            raise

    def add(self, data: Source, algo: Algorithm = Algorithm.SHA256) -> Key:
        """Store and release the pin at once: the object lives while something keeps it."""
        result = self.put(data, algo=algo)
        result.pin.release()
        return result.key

    def pin(self, key: Key) -> Pin:
        """An in-process pin (waits out an in-flight delete of this key)."""
        return self.arbiter.acquire(key)

    def freshen(self, key: Key) -> bool:
        """Count the object as written now (a staged delete of it will be cancelled).

        Done under a pin: a delete already in flight finishes first (then this says
        False, and the caller writes the object again), and none can start meanwhile.
        A git object kept in its pack alone is written back into the kv, stored now."""
        with self.arbiter.acquire(key):
            stamp = now_ns()
            if self.kv.freshen(key.raw, stamp):
                return True
            if self.large is None or not self.large.freshen(key.raw, stamp):
                data = self._packed(key)  # (None: not a git object, or in no pack)
                if data is None:
                    return False
                self.kv.put(key.raw, data, stamp)
                return True
            assert self.catalog is not None
            self.catalog.freshen(key.raw, stamp)
            return True
