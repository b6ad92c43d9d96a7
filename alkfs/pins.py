"""Durable named pins (SPEC 3.5), and the liveness source they form.

A pin names exactly one object and survives restarts. A pin on a git object
keeps its whole closure (as a ref would); a pin on any other object keeps that
object. `contains` answers from an in-memory memo (never I/O under the
arbitration lock): live when the memo is cold, when the memo holds the key, or when
a pin written after the memo was built names it or is a git object (whose closure
would need a walk: conservatively live). Only `pin` can make an object live, so only
it moves `write_counter`; unpins and renames cannot, and a sweep under a steady
stream of new pins of plain objects still collects what none of them names.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import functools
import hashlib
import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .db import now_ns
from .errors import Exists, Invalid, Missing
from .git.closure import Walker
from .git.tables import Tables
from .keys import Algorithm, Key
from .schema import PINS

log = logging.getLogger("alkfs")

if TYPE_CHECKING:
    from .gc.arbiter import Pin
    from .git.closure import RefClosure
    from .store import PutResult, Source, Store

PRIME_MAX = 2_000_000  # pins beyond which `prime` loads no filter (lookups query)
ADDED_MAX = 100_000  # pins remembered for `contains` between two memos
GIT_ALGOS = frozenset(a.value for a in Algorithm if a.is_git)
PIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")


@dataclass(frozen=True)
class PinRecord:
    name: str
    key: Key
    created_ns: int


def valid_pin_name(name: str) -> bool:
    return isinstance(name, str) and PIN_NAME.match(name) is not None


class NameFilter:
    """A Bloom filter of pin names: `maybe(name)` is False only for a name never added
    (16 bits a name, 6 of them set: ~1 name in 1,000 never added is a maybe). It holds up
    to `capacity` names; `add` past that is False (the caller drops the filter)."""

    BITS_PER_NAME = 16
    SPOTS = 6
    MIN_NAMES = 1 << 20  # (2 MiB)

    def __init__(self, names: int) -> None:
        self.capacity = max(self.MIN_NAMES, 2 * names)
        self.size = self.capacity * self.BITS_PER_NAME
        self.bits = bytearray(self.size // 8)
        self.count = 0

    def add(self, name: str) -> bool:
        """Add `name`: False when the filter is full. A name already in (every spot set:
        a re-pin, a replace) changes nothing and is not counted again."""
        return self.add_many((name,))

    def add_many(self, names: Iterable[str]) -> bool:
        """`add` each of `names` (False once the filter is full: the rest are not added)."""
        bits, size, spots_ = self.bits, self.size, range(self.SPOTS)
        for name in names:
            h = hash(name)
            a, b = h & 0xFFFFFFFF, ((h >> 32) & 0xFFFFFFFF) | 1
            new = False
            for i in spots_:
                spot = (a + i * b) % size
                byte, bit = spot >> 3, 1 << (spot & 7)
                if not bits[byte] & bit:
                    if not new:
                        if self.count >= self.capacity:
                            return False
                        self.count += 1
                        new = True
                    bits[byte] |= bit
        return True

    def maybe(self, name: str) -> bool:
        # (add_many's arithmetic, stopping at the first clear bit: a new name's lookup
        # asks this three times, and in a filter mostly clear the first spot answers)
        h = hash(name)
        a, b = h & 0xFFFFFFFF, ((h >> 32) & 0xFFFFFFFF) | 1
        size, bits = self.size, self.bits
        for i in range(self.SPOTS):
            spot = (a + i * b) % size
            if not bits[spot >> 3] >> (spot & 7) & 1:
                return False
        return True


class Misses:
    """Names known to be unpinned, answered without a query: those `Pins.get` found
    unpinned, until any pin changes (a mount looks a new name up three times before it
    is written: cp's stat, the kernel's O_EXCL lookup, the create's check), and, once
    `prime` has loaded every pin name into a `NameFilter`, every name it says was never
    pinned (so a new name costs no query at all). Only where every change to the table
    passes through this process's `Pins` (`on`: not a fleet's store, nor one opened
    beside its lock holder).

    Every change runs inside `changing()`, which encloses its commit: it forgets every
    name found unpinned when it starts, and no query that overlapped it may add one
    (`epoch`); a change that names a pin adds the name to the filter first (`adding`)."""

    LIMIT = 4096

    def __init__(self, on: bool) -> None:
        self.on = on
        self._lock = threading.Lock()
        self._names: set[str] = set()
        self._epoch = 0
        self._writing = 0
        self.filter: NameFilter | None = None

    def known(self, name: str) -> bool:
        if name in self._names:
            return True
        f = self.filter
        return f is not None and not f.maybe(name)

    def prime(self, scan: Callable[[], Iterable[str] | None]) -> bool:
        """Build the filter from `scan()` (every pin name; None: too many to hold). False
        (no filter) then, or when a change was under way or ran meanwhile."""
        if not self.on:
            return False
        with self._lock:
            if self._writing:
                return False
            epoch = self._epoch
        scanned = scan()
        if scanned is None:
            return False
        names = list(scanned)
        f = NameFilter(len(names))
        f.add_many(names)
        with self._lock:
            if epoch != self._epoch:
                return False
            self.filter = f
        return True

    def adding(self, name: str) -> None:
        """(inside `changing()`, before its commit) `name` is about to be pinned."""
        self.adding_many((name,))

    def adding_many(self, names: Iterable[str]) -> None:
        """`adding` for each of `names`, in one locked step."""
        with self._lock:
            f = self.filter
            if f is not None and not f.add_many(names):
                self.filter = None  # (full: lookups query again, as before `prime`)

    def before_query(self) -> int:
        return self._epoch

    def steady(self, epoch: int) -> bool:
        """No change to the pins ran or began since `before_query()` said `epoch` (a
        caller's own memo of what it found since then holds); never where another
        process changes pins too (`on` false)."""
        return self.on and epoch == self._epoch and not self._writing

    def missed(self, name: str, epoch: int) -> None:
        """The query begun at `epoch` found no pin `name`."""
        if not self.on:
            return
        with self._lock:
            if epoch != self._epoch or self._writing:
                return
            if len(self._names) >= self.LIMIT:
                self._names.clear()
            self._names.add(name)

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        with self._lock:
            self._writing += 1
            self._epoch += 1
            self._names.clear()
        try:
            yield
        finally:
            with self._lock:
                self._writing -= 1
                self._epoch += 1


class Pins:
    """The store's named pins; a liveness source (register it with `store.register_source`)."""

    def __init__(self, store: Store, closure: RefClosure | Walker | None = None) -> None:
        self.store = store
        self.tables = Tables(store, (PINS,))
        if closure is None:
            self.walker = Walker(store)
        elif isinstance(closure, Walker):
            self.walker = closure
        else:
            self.walker = closure.walker
        self.write_counter = 0
        # (counter after the pin, its key) of the pins written since the memo's counter;
        # `_lost` is the highest counter whose entry was dropped (the log's cap)
        self._added: collections.deque[tuple[int, bytes]] = collections.deque()
        self._lost = 0
        self.builds = 0
        self._memo: tuple[str | None, int, set[bytes]] | None = None
        self._lock = threading.Lock()
        # (one opened beside the lock holder sees another process's changes)
        self.misses = Misses(on=store.sole_writer)

    def _bump(self, key: bytes) -> None:
        self._bump_many((key,))

    def _bump_many(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        with self._lock:
            first = self.write_counter + 1
            self.write_counter += len(keys)
            added = self._added
            added.extend(zip(range(first, first + len(keys)), keys, strict=True))
            while len(added) > ADDED_MAX:  # (a deque: a list's del [0] moves 100,000)
                self._lost = added.popleft()[0]

    def _check_name(self, name: str) -> None:
        if not valid_pin_name(name):
            raise Invalid(f"invalid pin name {name!r}")

    # -- the names -----------------------------------------------------------------
    def pin(self, name: str, key: Key, replace: bool | Key = False) -> PinRecord:
        """Pin `key` as `name`: Missing if the object is absent, Exists if the name is
        taken by another object; pinning the same object again is a no-op. `replace`
        lets the name move to `key` in the same transaction: from any object (True) or
        only from that one (a Key)."""
        self._check_name(name)
        held = self.store.pin(key)  # waits out an in-flight delete of this key
        wrote = False
        try:
            if not self.store.has(key):
                raise Missing(f"{key} is not in the store")
            with self.misses.changing():
                record, wrote = self._write(name, key, replace)
            return record
        finally:
            self._settle(held, wrote)

    def put_pinned(
        self,
        name: str,
        source: Source,
        algo: Algorithm = Algorithm.SHA256,
        replace: bool | Key = False,
        wait: bool = True,
    ) -> tuple[PutResult, PinRecord]:
        """Store `source` and pin it as `name` (as `pin` does, Exists included): for an
        object of the kv tier in one transaction, so that a refused name stores
        nothing. The put's pin is released once the pin row has committed (it is not
        held in the returned result). `wait=False`: as `Store.put`'s."""
        self._check_name(name)
        box: list[tuple[PinRecord, bool]] = []
        with self.misses.changing():  # (the put's transaction commits inside)
            result = self.store.put(
                source,
                algo=algo,
                within=lambda key: box.append(self._write(name, key, replace)),
                wait=wait,
            )
        record, wrote = box[0]
        self._settle(result.pin, wrote)
        return result, record

    def put_pinned_many(self, items: Sequence[tuple[str | None, Key, bytes]]) -> None:
        """Store many small (name or None, key of the content computed by this process
        from it, content) in one transaction (not hashed again), each named
        object pinned as its name (alkfs/intents.py: a worker thread, it may wait). A
        name pinned to another object keeps it: that content is stored unpinned and
        the refusal logged (the daemon refuses such a name before it acknowledges)."""
        if not items:
            return
        store = self.store
        wrote: dict[int, bool] = {}  # the results whose name was pinned: row written?
        with self.misses.changing():
            with store.tx():
                results = store.put_many(
                    [(data, key.algo, key) for _, key, data in items], hashed=True
                )
                try:
                    inserted = self._insert_new(
                        [(name, r.key) for (name, _, _), r in zip(items, results, strict=True)]
                    )
                    for n, ((name, _, _), result) in enumerate(zip(items, results, strict=True)):
                        if name is None:
                            continue
                        if name in inserted:
                            wrote[n] = True
                            continue
                        try:  # (a name taken already: the same object, or refused)
                            wrote[n] = self._write(name, result.key, False)[1]
                        except Exists:
                            log.warning(
                                "the pin %r names another object: %s stored unpinned",
                                name,
                                result.key,
                            )
                except BaseException:
                    for r in results:
                        r.pin.release()
                    raise
        # the pins held over the rows go, and the counter moves for the rows written, in
        # one locked step (as `_settle` does for one)
        written = [results[n].pin.key for n, w in wrote.items() if w]

        def bump() -> None:
            self._bump_many(written)

        store.arbiter.convert_many([r.pin for r in results], bump)
        for hook in store.changed_hooks:  # (committed now: listings may be made anew)
            hook()

    _ROWS = 300  # pin rows an INSERT of `_insert_new` takes (3 parameters each)

    def _insert_new(self, pairs: Sequence[tuple[str | None, Key]]) -> set[str]:
        """Pin rows for the names not taken yet, a few statements for all (the caller
        is inside a transaction and `misses.changing()`, holding every key's pin): the
        names whose row was written. A fleet's member writes each with `_write`."""
        named = [(name, key) for name, key in pairs if name is not None]
        if not named or self.store.fleet is not None:
            return set()
        stamp = now_ns()
        done: set[str] = set()
        with self.tables.tx() as conn:
            for j in range(0, len(named), self._ROWS):
                part = named[j : j + self._ROWS]
                self.misses.adding_many([name for name, _ in part])
                params: list[object] = [stamp] * (3 * len(part))
                params[0::3] = [name for name, _ in part]
                params[1::3] = [key.raw for _, key in part]
                done.update(
                    row[0]
                    for row in conn.execute(
                        "INSERT INTO pins (name, key, created_ns) VALUES "
                        + ",".join(["(?,?,?)"] * len(part))
                        + " ON CONFLICT (name) DO NOTHING RETURNING name",
                        params,
                    ).fetchall()
                )
        return done

    def _settle(self, held: Pin, wrote: bool) -> None:
        """Drop the in-process pin held over a pin write; the counter moves after the
        commit (if a row was written), in the same locked step that drops the pin."""
        bump = functools.partial(self._bump, held.key) if wrote else lambda: None
        self.store.arbiter.convert(held, bump)

    def _write(self, name: str, key: Key, replace: bool | Key) -> tuple[PinRecord, bool]:
        """The pin row (the caller holds `key`'s pin and is inside `misses.changing()`):
        (the record, whether it was written)."""
        self.misses.adding(name)
        with self.tables.tx() as conn:
            record = PinRecord(name, key, now_ns())
            new = (name, key.raw, record.created_ns)
            insert = "INSERT INTO pins (name, key, created_ns) VALUES (?, ?, ?)"
            # a new name (as nearly always) in one statement; a taken one is looked at
            if conn.execute(insert + " ON CONFLICT (name) DO NOTHING", new).rowcount != 1:
                row = conn.execute(
                    "SELECT key, created_ns FROM pins WHERE name = ?", (name,)
                ).fetchone()
                if row is not None:
                    if bytes(row[0]) == key.raw:
                        return PinRecord(name, key, row[1]), False
                    if replace is not True and (replace is False or replace.raw != bytes(row[0])):
                        raise Exists(f"the pin {name!r} names another object")
                    conn.execute("DELETE FROM pins WHERE name = ?", (name,))
                conn.execute(insert, new)
            if self.store.fleet is not None:  # (several daemons: see alkfs/fleet.py)
                self.store.fleet.guard_publish(conn, [key.raw])
        return record, True

    def unpin(self, name: str) -> None:
        with self.misses.changing(), self.tables.tx() as conn:
            if conn.execute("DELETE FROM pins WHERE name = ?", (name,)).rowcount != 1:
                raise Missing(f"no pin {name!r}")
        # (no counter move: an unpin makes nothing live)

    def rename(self, old: str, new: str, replace: bool = False) -> None:
        """Rename a pin (Missing: no `old`); a pin `new` is Exists, or with `replace`
        is dropped in the same transaction (what `mv` expects)."""
        self._check_name(new)
        with self.misses.changing(), self.tables.tx() as conn:
            if conn.execute("SELECT 1 FROM pins WHERE name = ?", (old,)).fetchone() is None:
                raise Missing(f"no pin {old!r}")
            if old == new:
                return
            if conn.execute("SELECT 1 FROM pins WHERE name = ?", (new,)).fetchone() is not None:
                if not replace:
                    raise Exists(f"the pin {new!r} exists")
                conn.execute("DELETE FROM pins WHERE name = ?", (new,))
            self.misses.adding(new)
            conn.execute("UPDATE pins SET name = ? WHERE name = ?", (new, old))
        # (no counter move: the same objects stay pinned)

    def prime(self) -> bool:
        """Load every pin name into `misses`' filter, so that a name never pinned is
        answered without a query (a mount does this once at start, before it serves).
        False when it did not (`misses` off, or a change ran meanwhile)."""

        def scan() -> list[str] | None:  # (one scan: at most PRIME_MAX + 1 names held)
            rows = self.tables.read("SELECT name FROM pins LIMIT ?", (PRIME_MAX + 1,))
            return None if len(rows) > PRIME_MAX else [n for (n,) in rows]

        return self.misses.prime(scan)

    def list(self) -> list[PinRecord]:
        rows = self.tables.read("SELECT name, key, created_ns FROM pins ORDER BY name")
        return [PinRecord(n, Key(bytes(k)), t) for n, k, t in rows]

    def get(self, name: str) -> PinRecord | None:
        misses = self.misses
        if misses.known(name):
            return None
        epoch = misses.before_query()
        rows = self.tables.read("SELECT name, key, created_ns FROM pins WHERE name = ?", (name,))
        if not rows:
            misses.missed(name, epoch)
            return None
        return PinRecord(rows[0][0], Key(bytes(rows[0][1])), rows[0][2])

    def names_for(self, key: Key) -> builtins.list[str]:
        rows = self.tables.read("SELECT name FROM pins WHERE key = ? ORDER BY name", (key.raw,))
        return [n for (n,) in rows]

    def __len__(self) -> int:
        return self.tables.read("SELECT count(*) FROM pins")[0][0]

    # -- the liveness source --------------------------------------------------------------
    def live_keys(self) -> set[bytes]:
        counter = self.write_counter  # before the read: a write that the read misses moves it
        keys = sorted({bytes(k) for (k,) in self.tables.read("SELECT DISTINCT key FROM pins")})
        fingerprint = hashlib.sha256(b"".join(keys)).hexdigest()
        with self._lock:
            memo = self._memo
            if memo is not None and memo[0] == fingerprint:
                self._memo = (fingerprint, counter, memo[2])
                return memo[2]
        git = [Key(k) for k in keys if Key(k).algo.is_git]
        live = {k for k in keys if not Key(k).algo.is_git}
        reached, missing = self.walker.walk(git)
        live |= reached
        with self._lock:
            self.builds += 1
            self._memo = (fingerprint if missing == 0 else None, counter, live)
            self._added = collections.deque((c, k) for c, k in self._added if c > counter)
        return live

    def contains(self, key: bytes) -> bool:
        memo = self._memo
        if memo is None or key in memo[2]:
            return True
        with self._lock:
            since = memo[1]
            if self.write_counter == since:
                return False
            if self._lost > since:
                return True  # (more pins since than the log keeps)
            for counter, added in reversed(self._added):
                if counter <= since:
                    break
                if added == key or added[0] in GIT_ALGOS:
                    return True
            return False
