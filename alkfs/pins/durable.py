"""`Pins`: the durable named pins (pin, put and pin, unpin, read) and the liveness source
they form (`live_keys`: a pin of a git object keeps its closure, walked; `contains`); the
tree of /pins is `PinTree`'s (alkfs/pins/tree.py)."""

from __future__ import annotations

import builtins
import collections
import functools
import hashlib
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..db import now_ns
from ..errors import Exists, Invalid, Missing
from ..git.closure import Walker
from ..git.tables import Tables
from ..keys import Algorithm, Key
from ..schema import PINS
from .misses import Misses
from .paths import PATH_MAX, TooLong, path_bytes, path_ok, valid_pin_name
from .records import (
    _COLUMNS,
    DIR_KEY,
    FileAttrs,
    PinDir,
    PinRecord,
    PinsAhead,
    _attr_values,
    _entry,
    from_intent,
)
from .tree import PinTree

log = logging.getLogger("alkfs")

if TYPE_CHECKING:
    from ..gc.arbiter import Pin
    from ..git.closure import RefClosure
    from ..store import PutResult, Source, Store

PRIME_MAX = 2_000_000  # pins beyond which `prime` loads no filter (lookups query)
ADDED_MAX = 100_000  # pins remembered for `contains` between two memos
GIT_ALGOS = frozenset(a.value for a in Algorithm if a.is_git)


class Pins(PinTree):
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
        self._last_stamp = 0
        # (one opened beside the lock holder sees another process's changes)
        self.misses = Misses(on=store.sole_writer)
        # pins acknowledged and not in the database yet (alkfs/writebehind.py registers
        # its index): lookups and listings see them (tree.py)
        self.ahead: PinsAhead | None = None

    def _stamps(self, n: int = 1) -> int:
        """The first of `n` creation times no other row of this process has: a file's or
        a directory's node in the mount is known by it (and its key), across renames."""
        with self._lock:
            first = max(now_ns(), self._last_stamp + 1)
            self._last_stamp = first + n - 1
            return first

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

    def _check_name(self, name: str, tree: bool = False) -> None:
        """A name the xattr form and the CLI may give; `tree`: any path in /pins."""
        if tree:
            if not path_ok(name):
                if isinstance(name, str) and name and len(path_bytes(name)) > PATH_MAX:
                    raise TooLong(f"a path of {len(path_bytes(name))} bytes (at most {PATH_MAX})")
                raise Invalid(f"invalid pin path {name!r}")
        elif not valid_pin_name(name):
            raise Invalid(f"invalid pin name {name!r}")

    # -- the names -----------------------------------------------------------------
    def pin(
        self,
        name: str,
        key: Key,
        replace: bool | Key = False,
        attrs: FileAttrs | None = None,
        tree: bool = False,
    ) -> PinRecord:
        """Pin `key` as `name`: Missing if the object is absent, Exists if the name is
        taken by another object; pinning the same object again is a no-op. `replace`
        lets the name move to `key` in the same transaction: from any object (True) or
        only from that one (a Key). `attrs`: a file written into /pins (its row says so);
        `tree`: `name` is a path there (its directory must exist: Missing)."""
        self._check_name(name, tree)
        self._before_change(name)
        ahead = self.store.ahead
        if ahead is not None and ahead.stat(key.raw) is not None:
            ahead.settle()  # (the object's row before its pin's)
        held = self.store.pin(key)  # waits out an in-flight delete of this key
        wrote = False
        try:
            if not self.store.has(key):
                raise Missing(f"{key} is not in the store")
            with self.misses.changing():
                record, wrote = self._write(name, key, replace, attrs, tree)
            return record
        finally:
            self._settle(held, wrote)

    def put_pinned(
        self,
        name: str,
        source: Source,
        algo: Algorithm = Algorithm.SHA256,
        replace: bool | Key = False,
        attrs: FileAttrs | None = None,
        tree: bool = False,
    ) -> tuple[PutResult, PinRecord]:
        """Store `source` and pin it as `name` (as `pin` does, Exists included): for an
        object of the kv tier in one transaction, so that a refused name stores
        nothing. The put's pin is released once the pin row has committed (it is not
        held in the returned result)."""
        self._check_name(name, tree)
        self._before_change(name)
        box: list[tuple[PinRecord, bool]] = []
        with self.misses.changing():  # (the put's transaction commits inside)
            result = self.store.put(
                source,
                algo=algo,
                within=lambda key: box.append(self._write(name, key, replace, attrs, tree)),
            )
        record, wrote = box[0]
        self._settle(result.pin, wrote)
        return result, record

    def put_pinned_many(
        self,
        items: Sequence[tuple[str | None, Key, bytes]],
        stamps: Mapping[str, int] | None = None,
    ) -> None:
        """Store many small (name or None, key of the content computed by this process
        from it, content) in one transaction (not hashed again), each named
        object pinned as its name (alkfs/intents.py: a worker thread, it may wait; a
        name made by `intent_name` is a file written into /pins). A name pinned to
        another object keeps it: that content is stored unpinned and the refusal logged
        (the daemon refuses such a name before it acknowledges). `stamps`: the creation
        time a new pin takes, by name (the write-behind's, which showed it pending: taken
        from `_stamps` when it was acknowledged); any other takes a new one."""
        if not items:
            return
        store = self.store
        named = [
            (None, None) if name is None else from_intent(name, len(data))
            for name, _, data in items
        ]
        wrote: dict[int, bool] = {}  # the results whose name was pinned: row written?
        with self.misses.changing():  # noqa: SIM117 (one with would re-indent the block)
            with store.tx():
                results = store.put_many(
                    [(data, key.algo, key) for _, key, data in items], hashed=True
                )
                try:
                    inserted = self._insert_new(
                        [
                            (name, r.key, attrs)
                            for (name, attrs), r in zip(named, results, strict=True)
                        ],
                        stamps or {},
                    )
                    for n, ((name, attrs), result) in enumerate(zip(named, results, strict=True)):
                        if name is None:
                            continue
                        if name in inserted:
                            wrote[n] = True
                            continue
                        try:  # (a name taken already: the same object, or refused)
                            wrote[n] = self._write(name, result.key, False, attrs)[1]
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

    _ROWS = 200  # pin rows an INSERT of `_insert_new` takes (8 parameters each)

    def _insert_new(
        self,
        rows: Sequence[tuple[str | None, Key, FileAttrs | None]],
        stamps: Mapping[str, int],
    ) -> set[str]:
        """Pin rows for the names not taken yet, a few statements for all (the caller
        is inside a transaction and `misses.changing()`, holding every key's pin): the
        names whose row was written. A fleet's member writes each with `_write`."""
        named = [(name, key, attrs) for name, key, attrs in rows if name is not None]
        if not named or self.store.fleet is not None:
            return set()
        stamp = self._stamps(len(named))
        done: set[str] = set()
        with self.tables.tx() as conn:
            for j in range(0, len(named), self._ROWS):
                part = named[j : j + self._ROWS]
                self.misses.adding_many([name for name, _, _ in part])
                params: list[object] = []
                for i, (name, key, attrs) in enumerate(part):
                    created = stamps.get(name, stamp + j + i)
                    params += (name, key.raw, created, *_attr_values(attrs))
                done.update(
                    row[0]
                    for row in conn.execute(
                        f"INSERT INTO pins ({_COLUMNS}) VALUES "
                        + ",".join(["(?,?,?,?,?,?,?,?)"] * len(part))
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

    def _write(
        self,
        name: str,
        key: Key,
        replace: bool | Key,
        attrs: FileAttrs | None = None,
        tree: bool = False,
    ) -> tuple[PinRecord, bool]:
        """The pin row (the caller holds `key`'s pin and is inside `misses.changing()`):
        (the record, whether it was written). The same object pinned again under its
        name takes the file attributes given (a file written and closed again), its
        owner and group included."""
        self.misses.adding(name)
        with self.tables.tx() as conn:
            if tree:
                self._parent_there(conn, name)
            record = PinRecord(name, key, self._stamps(), *_attr_values(attrs))
            new = (name, key.raw, record.created_ns, *_attr_values(attrs))
            insert = f"INSERT INTO pins ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            # a new name (as nearly always) in one statement; a taken one is looked at
            if conn.execute(insert + " ON CONFLICT (name) DO NOTHING", new).rowcount != 1:
                row = conn.execute(
                    f"SELECT {_COLUMNS} FROM pins WHERE name = ?", (name,)
                ).fetchone()
                if row is not None:
                    there = _entry(row)
                    if isinstance(there, PinDir):
                        raise Exists(f"{name!r} is a directory of pins")
                    if there.key == key:
                        if attrs is None or there.attrs == attrs:
                            return there, False
                        conn.execute(
                            "UPDATE pins SET mode = ?, mtime_ns = ?, size = ?, uid = ?, gid = ?"
                            " WHERE name = ?",
                            (*_attr_values(attrs), name),
                        )
                        return PinRecord(name, key, there.created_ns, *_attr_values(attrs)), False
                    if replace is not True and (replace is False or replace != there.key):
                        raise Exists(f"the pin {name!r} names another object")
                    conn.execute("DELETE FROM pins WHERE name = ?", (name,))
                conn.execute(insert, new)
            if self.store.fleet is not None:  # (several daemons: see alkfs/fleet.py)
                self.store.fleet.guard_publish(conn, [key.raw])
        return record, True

    def unpin(self, name: str, key: Key | None = None) -> None:
        """Remove the pin `name` (Missing: no such pin, or with `key` none on that
        object; a directory is no pin): one statement."""
        self._before_change(name)
        sql, params = "DELETE FROM pins WHERE name = ? AND key <> ?", (name, DIR_KEY)
        if key is not None:
            sql, params = "DELETE FROM pins WHERE name = ? AND key = ?", (name, key.raw)
        with self.misses.changing(), self.tables.tx() as conn:
            if conn.execute(sql, params).rowcount != 1:
                raise Missing(f"no pin {name!r}" + (f" on {key}" if key is not None else ""))
        # (no counter move: an unpin makes nothing live)

    # -- reading -------------------------------------------------------------------------
    def prime(self) -> bool:
        """Load every pin name into `misses`' filter, so that a name never pinned is
        answered without a query (a mount does this once at start, before it serves).
        False when it did not (`misses` off, or a change ran meanwhile)."""

        def scan() -> list[str] | None:  # (one scan: at most PRIME_MAX + 1 names held)
            rows = self.tables.read("SELECT name FROM pins LIMIT ?", (PRIME_MAX + 1,))
            return None if len(rows) > PRIME_MAX else [n for (n,) in rows]

        return self.misses.prime(scan)

    def list(self) -> list[PinRecord]:
        """Every pin (the directories of /pins are none), in name order (those pending
        ahead of their commit too)."""
        rows = self.tables.read(
            f"SELECT {_COLUMNS} FROM pins WHERE key <> ? ORDER BY name", (DIR_KEY,)
        )
        out = [PinRecord(n, Key(bytes(k)), t, m, mt, sz, u, g) for n, k, t, m, mt, sz, u, g in rows]
        pending = self._ahead_below("")
        if pending:
            there = {r.name for r in out}
            more = [r for r in pending if r.name not in there]
            if more:
                out = sorted(out + more, key=lambda r: r.name)
        return out

    def get(self, name: str) -> PinRecord | None:
        """The pin `name` (None: none; a directory of /pins is no pin)."""
        found = self.entry(name)
        return found if isinstance(found, PinRecord) else None

    def names_for(self, key: Key, limit: int | None = None) -> builtins.list[str]:
        """The names of the pins of `key`, in name order (the first `limit` of them)."""
        sql = "SELECT name FROM pins WHERE key = ? ORDER BY name"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        names = [n for (n,) in self.tables.read(sql, (key.raw,))]
        more = [r.name for r in self._ahead_below("") if r.key == key]
        if more:  # (pins pending ahead of their commit)
            names = sorted(set(names) | set(more))[:limit]
        return names

    def __len__(self) -> int:
        return self.tables.read("SELECT count(*) FROM pins WHERE key <> ?", (DIR_KEY,))[0][0]

    # -- the liveness source --------------------------------------------------------------
    def live_keys(self) -> set[bytes]:
        counter = self.write_counter  # before the read: a write that the read misses moves it
        keys = sorted(
            k
            for k in (bytes(k) for (k,) in self.tables.read("SELECT DISTINCT key FROM pins"))
            if k != DIR_KEY
        )
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
