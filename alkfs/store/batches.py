"""The store's batched puts: many small objects in one transaction (`put_many`), and
the git import's fast path (`digest_git`, `put_digested`); pins on many keys at once.
"""

from __future__ import annotations

import builtins
import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from ..db import now_ns
from ..errors import Invalid, TooLarge, Verification
from ..gc.arbiter import Pin
from ..git.objects import MAX_HEADER, check_canonical
from ..keys import HASH_OF, Algorithm, Key
from ..tiers.sql import SqlTier
from .puts import PutResult, Source, _counted
from .state import StoreState


class StoreBatches(StoreState):
    """`Store`'s batched puts."""

    if TYPE_CHECKING:  # (defined by the other parts of `Store`)

        def put(
            self,
            source: Source,
            length: int | None = None,
            algo: Algorithm = Algorithm.SHA256,
            expect: Key | None = None,
            within: Callable[[Key], None] | None = None,
        ) -> PutResult: ...

    # -- batched puts (many small objects in one transaction) -----------------------
    @_counted
    def put_many(
        self,
        items: Sequence[tuple[bytes, Algorithm, Key | bytes | None]],
        hashed: bool = False,
    ) -> builtins.list[PutResult]:
        """Store many (content, algo, expected key) at once, each like `put`: the small
        ones share one kv transaction. Every item is checked before anything is stored
        (a bad one raises and stores nothing of the small ones); each result carries
        its own pin, to release once the object's name is published. An expected key
        may be given as a Key or as its raw bytes (algorithm byte + digest).

        `hashed`: every item has its expected key, computed from these very bytes by
        this process (alkfs/intents.py: an Intent is made from its content's digest,
        and a logged one is checked against it when read back), so none is hashed
        again."""
        from ..git.objects import TYPES as GIT_TYPES

        def made(raw: bytes) -> Key:  # a key built from a digest just computed: valid
            key = object.__new__(Key)
            object.__setattr__(key, "raw", raw)
            return key

        if self.reserve is not None:
            self.reserve.admit()  # (a full disk: nothing of the batch is stored)
        checked: builtins.list[tuple[bytes, bytes, int]] = []  # (raw key, data, index)
        keys: builtins.list[Key | None] = [None] * len(items)
        big: builtins.list[int] = []
        limit = self.threshold if self.mode != "mem" else None
        tags = {a: bytes([a.value]) for a in Algorithm}
        hashers = {a: HASH_OF[a.value] for a in Algorithm}
        last: Algorithm | None = None
        for i, (data, algo, expect) in enumerate(items):
            if algo is not last:  # (Enum hashing is slow; batches are mostly one algorithm)
                last, tag, hasher = algo, tags[algo], hashers[algo]
            want = None if expect is None else expect.raw if isinstance(expect, Key) else expect
            if want is not None and want[:1] != tag:
                raise Invalid("the expected key has another algorithm")
            if limit is not None and len(data) > limit:
                if self.mode == "kv-only":
                    raise TooLarge(f"{len(data)} bytes is over the kv-only threshold {limit}")
                big.append(i)
                continue
            if algo is Algorithm.GIT_SHA1 or algo is Algorithm.GIT_SHA256:
                # the common case checked inline; check_canonical says what is wrong
                nul = data.find(b"\0", 0, MAX_HEADER)
                sp = data.find(b" ", 0, nul)
                if (
                    nul < 0
                    or data[:sp] not in GIT_TYPES
                    or data[sp + 1 : nul] != b"%d" % (len(data) - nul - 1)
                ):
                    check_canonical(data[:MAX_HEADER], len(data))
            raw = want if hashed and want is not None else tag + hasher(data).digest()
            if want is not None and want != raw:
                raise Verification(f"the content hashes to {made(raw)}, not {Key(bytes(want))}")
            key = expect if isinstance(expect, Key) else made(raw)
            keys[i] = key
            checked.append((raw, bytes(data), i))
        checked.sort()  # key order: the kv index is written where it is already warm
        pins = self.pin_many([raw for raw, _, _ in checked])  # pin before publish
        results: builtins.list[PutResult | None] = [None] * len(items)
        try:
            created = self._kv_insert(
                [raw for raw, _, _ in checked], [data for _, data, _ in checked], now_ns()
            )
            for (_, _, i), pin, was_made in zip(checked, pins, created, strict=True):
                k = keys[i]
                assert k is not None
                results[i] = PutResult(k, pin, was_made)
            for i in big:
                data, algo, expect = items[i]
                if expect is not None and not isinstance(expect, Key):
                    expect = Key(bytes(expect))
                results[i] = self.put(data, algo=algo, expect=expect)
        except BaseException:
            for pin in pins:
                pin.release()
            for r in results:
                if r is not None and r.pin is not None:
                    r.pin.release()
            raise
        return [r for r in results if r is not None]

    def _kv_insert(
        self, raws: Sequence[bytes], datas: Sequence[bytes], stamp: int
    ) -> builtins.list[bool]:
        """Insert (key, content) rows in one kv transaction, in the order given; rows
        already present keep their bytes and count as written now. Which rows created
        their entry (of identical keys, only the first). The caller has pinned every key."""
        kv = self.kv
        if isinstance(kv, SqlTier):
            created = kv.insert_many(raws, datas, stamp)
        else:
            created = [kv.put(raw, data, stamp) for raw, data in zip(raws, datas, strict=True)]
        if len(raws) != len(set(raws)):  # identical items: the first one created the entry
            seen: set[bytes] = set()
            first = []
            for raw, c in zip(raws, created, strict=True):
                first.append(c and raw not in seen)
                seen.add(raw)
            created = first
        self._put_done(raws, datas)
        return created

    def _put_done(self, raws: Sequence[bytes], datas: Sequence[bytes | bytearray]) -> None:
        for hook in self.put_hooks:
            hook(raws, datas)  # type: ignore[arg-type]  # (read, never kept)

    def pin_many(self, raws: builtins.list[bytes]) -> builtins.list[Pin]:
        """In-process pins on many keys (raw bytes) in one locked step: `pin` for each,
        with the same waits for in-flight deletes and the same counts."""
        self.pin_raws(raws)
        arbiter = self.arbiter
        return [Pin(arbiter, raw) for raw in raws]

    def pin_raws(self, raws: Iterable[bytes]) -> None:
        """pin_many without a Pin object each; give them back with `unpin_raws`."""
        self.arbiter.acquire_counts(raws)

    def unpin_raws(self, raws: builtins.list[bytes]) -> None:
        self.arbiter.release_counts(raws)

    # -- the git import's fast path: hashed on the caller's thread, stored on another ----
    class Digested:
        """Git objects with the keys `digest_git` derived from their bytes, for
        `put_digested`, which stores them under these keys without hashing again.
        Only `digest_git` makes one; it holds immutable bytes only, so a key can never
        be paired with content other than the content that hashed to it."""

        __slots__ = ("algo", "raws", "datas", "big")
        algo: Algorithm
        raws: tuple[bytes, ...]
        datas: tuple[bytes, ...]
        big: tuple[int, ...]

        def __init__(
            self, algo: Algorithm, raws: tuple[bytes, ...], datas: tuple[bytes, ...], big: tuple
        ) -> None:
            for name, value in (("algo", algo), ("raws", raws), ("datas", datas), ("big", big)):
                object.__setattr__(self, name, value)

        def __setattr__(self, name: str, value: object) -> None:
            raise AttributeError("a digested batch is immutable")

    def digest_git(
        self, algo: Algorithm, kinds: builtins.list[bytes], bodies: Sequence[bytes | bytearray]
    ) -> Digested:
        """The canonical git objects of (kind, body) pairs, "<kind> <size>\\0<body>",
        each hashed here. The caller compares `.raws` (algorithm byte + digest, in input
        order) with the ids it expects; `put_digested` stores them under exactly these."""
        from ..git.objects import TYPES as GIT_TYPES

        if algo is Algorithm.GIT_SHA1:
            hasher = hashlib.sha1
        elif algo is Algorithm.GIT_SHA256:
            hasher = hashlib.sha256
        else:
            raise Invalid(f"{algo.label} is not a git object format")
        if len(kinds) != len(bodies):
            raise Invalid("one kind per body")
        if not frozenset(GIT_TYPES).issuperset(kinds):
            bad = next(k for k in kinds if k not in GIT_TYPES)
            raise Verification(f"not a git object type: {bad[:16]!r}")
        datas = tuple(
            [b"%s %d\0%s" % kb for kb in zip(kinds, map(len, bodies), bodies, strict=True)]
        )
        tag = bytes([algo.value])
        raws = tuple([tag + hasher(data).digest() for data in datas])
        big: tuple[int, ...] = ()
        if self.mode != "mem":
            limit = self.threshold
            big = tuple(i for i, data in enumerate(datas) if len(data) > limit)
            if big and self.mode == "kv-only":
                raise TooLarge(f"{len(datas[big[0]])} bytes is over the kv-only threshold {limit}")
        return StoreBatches.Digested(algo, raws, datas, big)

    @_counted
    def put_digested(self, batch: Digested) -> builtins.list[bool]:
        """Store a `digest_git` batch under its keys (small objects in one kv transaction,
        in the batch's order), each pinned before it is published: which ones were
        created, in the batch's order. The pins stay until the caller's `unpin_raws(batch.raws)`
        (released here if this fails)."""
        if type(batch) is not StoreBatches.Digested:
            raise Invalid("not a batch hashed by digest_git")
        raws, datas = batch.raws, batch.datas
        if self.reserve is not None:
            self.reserve.admit()
        self.pin_raws(raws)  # pin before publish
        try:
            if batch.big:
                skip = set(batch.big)
                small = [i for i in range(len(raws)) if i not in skip]
                done = self._kv_insert(
                    [raws[i] for i in small], [datas[i] for i in small], now_ns()
                )
                created = [False] * len(raws)
                for i, c in zip(small, done, strict=True):
                    created[i] = c
            else:
                # in the source's order: git's pack order keeps what is read together
                # together (sorting by key measured no faster with the importer's cache)
                created = self._kv_insert(raws, datas, now_ns())
            for i in batch.big:
                r = self.put(datas[i], algo=batch.algo, expect=Key(raws[i]))
                r.pin.release()  # the batch's pin holds it
                created[i] = r.created
        except BaseException:
            self.unpin_raws(list(raws))
            raise
        return created
