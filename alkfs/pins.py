"""Durable named pins (SPEC 3.5), and the liveness source they form.

A pin names exactly one object and survives restarts. A pin on a git object
keeps its whole closure (as a ref would); a pin on any other object keeps that
object. `contains` answers from an in-memory memo (never I/O under the
arbitration lock): live when the memo is cold, when the memo holds the key, or when
a pin written after the memo was built names it or is a git object (whose closure
would need a walk: conservatively live). Only `pin` can make an object live, so only
it moves `write_counter`; unpins and renames cannot, and a sweep under a steady
stream of new pins of plain objects still collects what none of them names.

The tree of /pins (SPEC 3.5): there a pin's name is its path (`backups/2026-11/My
File.pdf`: any file names, `path_ok`), each directory is a row of its own (`PinDir`:
an empty key, its mode and time), and a pin written as a file carries its mode, time and
size (`FileAttrs`). Both keep an owner and a group (`uid`, `gid`; None: the mount's owner,
as every entry shows until a chown), set at creation, kept by a rename and changed by
`set_attrs`. A directory's entries are the names in the range [`dir/`, `dir0`)
that hold no further `/` (`children`: a subdirectory's own entries are skipped over in
one step each), so a listing or a lookup is an index range or probe whatever the count.
The names are text: a path's bytes as UTF-8, any byte that is not (and each byte of a
character U+F780..U+F7FF) as the character U+F700 + the byte (`path_text`,
`path_bytes`: one-to-one, and `/` stays `/`).
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import dataclasses
import functools
import hashlib
import logging
import re
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .db import now_ns
from .errors import Exists, Invalid, Missing, NotEmpty
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
COMPONENT_MAX = 255  # bytes of one component of a path in /pins
PATH_MAX = 4096  # bytes of a whole path in /pins (its components and the `/` between)
DIR_KEY = b""  # the key column of a directory's row
_ESCAPED = 0xF700  # a byte escaped in a name is this + the byte (U+F780..U+F7FF)
_COLUMNS = "name, key, created_ns, mode, mtime_ns, size, uid, gid"


class TooLong(Invalid):
    """A path in /pins longer than PATH_MAX bytes (the mount answers ENAMETOOLONG)."""


@dataclass(frozen=True)
class FileAttrs:
    """What a pin written as a file shows: its st_mode (S_IFREG and the permission
    bits), modification time and size (its object's), its owner and group (None: the
    mount's owner's)."""

    mode: int
    mtime_ns: int
    size: int
    uid: int | None = None
    gid: int | None = None


@dataclass(frozen=True)
class PinRecord:
    name: str
    key: Key
    created_ns: int
    mode: int | None = None  # a pin written as a file: its st_mode (None: a link's pin)
    mtime_ns: int | None = None
    size: int | None = None
    uid: int | None = None  # a file's owner and group (None: the mount's owner's)
    gid: int | None = None

    @property
    def attrs(self) -> FileAttrs | None:
        """A file's attributes (None: a pin made by `ln -s`, setfattr or the CLI)."""
        if self.mode is None:
            return None
        mtime = self.created_ns if self.mtime_ns is None else self.mtime_ns
        size = 0 if self.size is None else self.size
        return FileAttrs(self.mode, mtime, size, self.uid, self.gid)


@dataclass(frozen=True)
class PinDir:
    """A directory of pins in /pins (a row of its own: kept when empty)."""

    name: str
    created_ns: int
    mode: int
    mtime_ns: int
    uid: int | None = None  # its owner and group (None: the mount's owner's)
    gid: int | None = None


Entry = PinRecord | PinDir


def _entry(row: Sequence) -> Entry:
    """A row of _COLUMNS as its record."""
    name, key, created, mode, mtime, size, uid, gid = row
    key = bytes(key)
    if key == DIR_KEY:
        return PinDir(
            name,
            created,
            mode if mode is not None else stat.S_IFDIR | 0o755,
            mtime if mtime is not None else created,
            uid,
            gid,
        )
    return PinRecord(name, Key(key), created, mode, mtime, size, uid, gid)


def valid_pin_name(name: str) -> bool:
    return isinstance(name, str) and PIN_NAME.match(name) is not None


def path_text(raw: bytes) -> str:
    """A path's bytes as a pin name (see the module docstring; `path_bytes` inverts it)."""
    if raw.isascii():
        return raw.decode("ascii")
    text = raw.decode("utf-8", "surrogateescape")
    out: list[str] = []
    for ch in text:
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:  # (a byte that is not UTF-8: surrogateescape's)
            out.append(chr(_ESCAPED + o - 0xDC00))
        elif 0xF780 <= o <= 0xF7FF:  # (a character that escapes: its bytes escaped)
            out.extend(chr(_ESCAPED + b) for b in ch.encode())
        else:
            out.append(ch)
    return "".join(out)


def path_bytes(name: str) -> bytes:
    """The bytes of the path a pin name is (`path_text`'s inverse)."""
    if name.isascii():
        return name.encode("ascii")
    out = bytearray()
    for ch in name:
        o = ord(ch)
        if 0xF780 <= o <= 0xF7FF:
            out.append(o - _ESCAPED)
        else:
            out += ch.encode("utf-8", "surrogatepass")
    return bytes(out)


def path_ok(name: str) -> bool:
    """Whether `name` is a pin's path in /pins: components of 1-255 bytes but `.` and
    `..`, no NUL, at most PATH_MAX bytes in all (and in `path_text`'s form)."""
    if not isinstance(name, str) or not name:
        return False
    raw = path_bytes(name)
    if len(raw) > PATH_MAX or b"\0" in raw or path_text(raw) != name:
        return False
    return all(
        0 < len(part) <= COMPONENT_MAX and part not in (b".", b"..") for part in raw.split(b"/")
    )


def parent_of(name: str) -> str | None:
    """The directory a path is in (None: the top of /pins)."""
    cut = name.rfind("/")
    return None if cut < 0 else name[:cut]


def below(prefix: str) -> str:
    """The upper bound of the names starting with `prefix` (which ends with `/`)."""
    return prefix[:-1] + "0"  # ("0" follows "/")


def intent_name(name: str, attrs: FileAttrs) -> str:
    """The name an intent (alkfs/intents.py) of a file written into /pins carries: the
    path and the file's mode and time after a NUL each (no name holds a NUL), then, for
    a file given an owner or a group, both (each empty for None) after a NUL each."""
    text = f"{name}\0{attrs.mode}\0{attrs.mtime_ns}"
    if attrs.uid is None and attrs.gid is None:
        return text  # (the form before owners: what an older daemon logged)
    return f"{text}\0{_id_text(attrs.uid)}\0{_id_text(attrs.gid)}"


def from_intent(name: str, size: int) -> tuple[str, FileAttrs | None]:
    """(the pin name, the file's attributes or None) of an intent's name (either form
    `intent_name` writes)."""
    if "\0" not in name:
        return name, None
    path, mode, mtime, *owner = name.split("\0")
    uid, gid = (_id_of(owner[0]), _id_of(owner[1])) if owner else (None, None)
    return path, FileAttrs(int(mode), int(mtime), size, uid, gid)


def _id_text(n: int | None) -> str:
    return "" if n is None else str(n)


def _id_of(text: str) -> int | None:
    return None if text == "" else int(text)


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

    def drop_filter(self) -> None:
        """(inside `changing()`) Too many names change at once: lookups query again."""
        with self._lock:
            self.filter = None

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
        self._last_stamp = 0
        # (one opened beside the lock holder sees another process's changes)
        self.misses = Misses(on=store.sole_writer)

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

    @staticmethod
    def _parent_there(conn: Any, name: str) -> None:
        """(in a transaction) Missing unless the directory `name` is in exists."""
        parent = parent_of(name)
        if parent is None:
            return
        row = conn.execute("SELECT key FROM pins WHERE name = ?", (parent,)).fetchone()
        if row is None or bytes(row[0]) != DIR_KEY:
            raise Missing(f"no directory {parent!r} in /pins")

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
        wait: bool = True,
        attrs: FileAttrs | None = None,
        tree: bool = False,
    ) -> tuple[PutResult, PinRecord]:
        """Store `source` and pin it as `name` (as `pin` does, Exists included): for an
        object of the kv tier in one transaction, so that a refused name stores
        nothing. The put's pin is released once the pin row has committed (it is not
        held in the returned result). `wait=False`: as `Store.put`'s."""
        self._check_name(name, tree)
        box: list[tuple[PinRecord, bool]] = []
        with self.misses.changing():  # (the put's transaction commits inside)
            result = self.store.put(
                source,
                algo=algo,
                within=lambda key: box.append(self._write(name, key, replace, attrs, tree)),
                wait=wait,
            )
        record, wrote = box[0]
        self._settle(result.pin, wrote)
        return result, record

    def put_pinned_many(self, items: Sequence[tuple[str | None, Key, bytes]]) -> None:
        """Store many small (name or None, key of the content computed by this process
        from it, content) in one transaction (not hashed again), each named
        object pinned as its name (alkfs/intents.py: a worker thread, it may wait; a
        name made by `intent_name` is a file written into /pins). A name pinned to
        another object keeps it: that content is stored unpinned and the refusal logged
        (the daemon refuses such a name before it acknowledges)."""
        if not items:
            return
        store = self.store
        named = [
            (None, None) if name is None else from_intent(name, len(data))
            for name, _, data in items
        ]
        wrote: dict[int, bool] = {}  # the results whose name was pinned: row written?
        with self.misses.changing():
            with store.tx():
                results = store.put_many(
                    [(data, key.algo, key) for _, key, data in items], hashed=True
                )
                try:
                    inserted = self._insert_new(
                        [
                            (name, r.key, attrs)
                            for (name, attrs), r in zip(named, results, strict=True)
                        ]
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

    def _insert_new(self, rows: Sequence[tuple[str | None, Key, FileAttrs | None]]) -> set[str]:
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
                    params += (name, key.raw, stamp + j + i, *_attr_values(attrs))
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

    def unpin(self, name: str) -> None:
        """Remove the pin `name` (Missing: no such pin; a directory is no pin)."""
        with self.misses.changing(), self.tables.tx() as conn:
            if (
                conn.execute(
                    "DELETE FROM pins WHERE name = ? AND key <> ?", (name, DIR_KEY)
                ).rowcount
                != 1
            ):
                raise Missing(f"no pin {name!r}")
        # (no counter move: an unpin makes nothing live)

    def rename(self, old: str, new: str, replace: bool = False) -> None:
        """Rename a pin (Missing: no `old`); a pin `new` is Exists, or with `replace`
        is dropped in the same transaction (what `mv` expects). (`move`: in /pins.)"""
        self._check_name(new)
        self._move(old, new, replace, tree=False)

    def move(self, old: str, new: str, replace: bool = False) -> Entry:
        """Rename an entry of /pins (a pin, or a directory with everything below it) to
        the path `new`, as rename(2) does: Missing (no `old`, or no directory `new`
        would be in); `new` taken: Exists, or with `replace` it is replaced in the same
        transaction if it is of the same kind (Invalid: a directory over a pin or a
        pin over a directory; NotEmpty: a directory that is not empty; Invalid: a
        directory into itself; TooLong: a path below it would be too long)."""
        self._check_name(new, tree=True)
        return self._move(old, new, replace, tree=True)

    def _move(self, old: str, new: str, replace: bool, tree: bool) -> Entry:
        with self.misses.changing(), self.tables.tx() as conn:
            row = conn.execute(f"SELECT {_COLUMNS} FROM pins WHERE name = ?", (old,)).fetchone()
            if row is None:
                raise Missing(f"no pin {old!r}")
            moved = _entry(row)
            is_dir = isinstance(moved, PinDir)
            if is_dir and not tree:
                raise Missing(f"no pin {old!r} ({old!r} is a directory of pins)")
            if old == new:
                return moved
            if tree:
                self._parent_there(conn, new)
            row = conn.execute("SELECT key FROM pins WHERE name = ?", (new,)).fetchone()
            if row is not None:
                if not replace:
                    raise Exists(f"the pin {new!r} exists")
                over_dir = bytes(row[0]) == DIR_KEY
                if over_dir != is_dir:
                    raise Invalid(
                        f"{new!r} is a directory of pins" if over_dir else f"{new!r} is a pin"
                    )
                if over_dir and self._has_below(conn, new + "/"):
                    raise NotEmpty(f"the directory {new!r} is not empty")
                conn.execute("DELETE FROM pins WHERE name = ?", (new,))
            self.misses.adding(new)
            if is_dir:
                if new.startswith(old + "/"):
                    raise Invalid(f"{old!r} cannot move into itself")
                self._moves_fit(conn, old, new)
                conn.execute(
                    "UPDATE pins SET name = ? || substr(name, ?) WHERE name >= ? AND name < ?",
                    (new + "/", len(old) + 2, old + "/", below(old + "/")),
                )
                if self.misses.filter is not None:  # (the names below it are new names)
                    names = conn.execute(
                        "SELECT name FROM pins WHERE name >= ? AND name < ? LIMIT ?",
                        (new + "/", below(new + "/"), self.MOVED_NAMES + 1),
                    ).fetchall()
                    if len(names) > self.MOVED_NAMES:
                        self.misses.drop_filter()
                    else:
                        self.misses.adding_many(n for (n,) in names)
            conn.execute("UPDATE pins SET name = ? WHERE name = ?", (new, old))
        # (no counter move: the same objects stay pinned; the row keeps all else, its
        # owner and group included)
        return dataclasses.replace(moved, name=new)

    MOVED_NAMES = 100_000  # names below a moved directory added to the filter (more: dropped)

    def _moves_fit(self, conn: Any, old: str, new: str) -> None:
        """TooLong unless every path below `old` fits under `new` (PATH_MAX bytes)."""
        grows = len(path_bytes(new)) - len(path_bytes(old))
        if grows <= 0:
            return
        lo, hi = old + "/", below(old + "/")
        # (a bound first: a name's UTF-8 is at least as long as the path it is)
        octets = (
            "octet_length(name)"
            if self._engine() == "postgresql"
            else ("length(CAST(name AS BLOB))")
        )
        bound = conn.execute(
            f"SELECT max({octets}) FROM pins WHERE name >= ? AND name < ?", (lo, hi)
        ).fetchone()[0]
        if bound is None or bound + grows <= PATH_MAX:
            return
        for (name,) in conn.execute(
            "SELECT name FROM pins WHERE name >= ? AND name < ?", (lo, hi)
        ).fetchall():
            if len(path_bytes(name)) + grows > PATH_MAX:
                raise TooLong(f"{new + name[len(old) :]!r} would be longer than {PATH_MAX} bytes")

    def _engine(self) -> str:
        db = self.store.db
        return "sqlite" if db is None else db.engine

    # -- the tree of /pins -------------------------------------------------------------
    def entry(self, name: str) -> Entry | None:
        """The pin or directory named `name` (one probe of the primary key, or none for a
        name `misses` knows was never there)."""
        misses = self.misses
        if misses.known(name):
            return None
        epoch = misses.before_query()
        rows = self.tables.read(f"SELECT {_COLUMNS} FROM pins WHERE name = ?", (name,))
        if not rows:
            misses.missed(name, epoch)
            return None
        return _entry(rows[0])

    def children(self, prefix: str, after: str | None = None, limit: int = 256) -> list[Entry]:
        """Up to `limit` entries of the directory whose names start with `prefix` (`""`:
        the top of /pins; else a directory's name and `/`), in name order, after the
        name `after` if given. A subdirectory's own entries, which follow it in name
        order, are stepped over with one more query each."""
        upper = below(prefix) if prefix else None
        lower, strict = (prefix, False) if after is None else (after, True)
        out: list[Entry] = []
        while len(out) < limit:
            sql = f"SELECT {_COLUMNS} FROM pins WHERE name {'>' if strict else '>='} ?"
            params: list[object] = [lower]
            if upper is not None:
                sql += " AND name < ?"
                params.append(upper)
            rows = self.tables.read(sql + " ORDER BY name LIMIT ?", (*params, limit))
            jumped = False
            for row in rows:
                name = row[0]
                cut = name.find("/", len(prefix))
                if cut >= 0:  # below a subdirectory: on after its last name
                    lower, strict, jumped = below(name[: cut + 1]), False, True
                    break
                out.append(_entry(row))
                lower, strict = name, True
                if len(out) == limit:
                    break
            if not jumped and len(rows) < limit:
                break
        return out

    def has_below(self, prefix: str) -> bool:
        """Whether any name starts with `prefix` (a directory's name and `/`): one probe."""
        return bool(
            self.tables.read(
                "SELECT 1 FROM pins WHERE name >= ? AND name < ? LIMIT 1", (prefix, below(prefix))
            )
        )

    @staticmethod
    def _has_below(conn: Any, prefix: str) -> bool:
        return (
            conn.execute(
                "SELECT 1 FROM pins WHERE name >= ? AND name < ? LIMIT 1", (prefix, below(prefix))
            ).fetchone()
            is not None
        )

    def mkdir(
        self,
        name: str,
        mode: int,
        mtime_ns: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
    ) -> PinDir:
        """Make the directory `name` in /pins (Exists: the name is taken; Missing: the
        directory it would be in does not exist); `uid`, `gid`: its owner and group
        (None: the mount's owner's)."""
        self._check_name(name, tree=True)
        stamp = self._stamps()
        made = PinDir(name, stamp, stat.S_IFDIR | stat.S_IMODE(mode), mtime_ns or stamp, uid, gid)
        with self.misses.changing(), self.tables.tx() as conn:
            self.misses.adding(name)
            self._parent_there(conn, name)
            inserted = conn.execute(
                f"INSERT INTO pins ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, NULL, ?, ?)"
                " ON CONFLICT (name) DO NOTHING",
                (name, DIR_KEY, stamp, made.mode, made.mtime_ns, uid, gid),
            ).rowcount
            if inserted != 1:
                raise Exists(f"{name!r} exists in /pins")
        return made

    def rmdir(self, name: str) -> None:
        """Remove the empty directory `name` (Missing: no such directory; NotEmpty)."""
        with self.misses.changing(), self.tables.tx() as conn:
            row = conn.execute("SELECT key FROM pins WHERE name = ?", (name,)).fetchone()
            if row is None or bytes(row[0]) != DIR_KEY:
                raise Missing(f"no directory {name!r} in /pins")
            if self._has_below(conn, name + "/"):
                raise NotEmpty(f"the directory {name!r} is not empty")
            conn.execute("DELETE FROM pins WHERE name = ?", (name,))

    def set_attrs(
        self,
        name: str,
        created_ns: int,
        mode: int | None = None,
        mtime_ns: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
    ) -> Entry:
        """Set the permission bits (of `mode`), the time, the owner and the group of the
        file or directory `name` made at `created_ns` (each None: as it is; Missing:
        gone, replaced, or a link's pin). Who may change an owner is the caller's rule."""
        with self.tables.tx() as conn:
            row = conn.execute(f"SELECT {_COLUMNS} FROM pins WHERE name = ?", (name,)).fetchone()
            there = None if row is None else _entry(row)
            if there is None or there.created_ns != created_ns or there.mode is None:
                raise Missing(f"{name!r} is gone from /pins")
            new_mode = there.mode if mode is None else stat.S_IFMT(there.mode) | stat.S_IMODE(mode)
            new_mtime = there.mtime_ns if mtime_ns is None else mtime_ns
            new_uid = there.uid if uid is None else uid
            new_gid = there.gid if gid is None else gid
            conn.execute(
                "UPDATE pins SET mode = ?, mtime_ns = ?, uid = ?, gid = ? WHERE name = ?",
                (new_mode, new_mtime, new_uid, new_gid, name),
            )
        if isinstance(there, PinDir):
            return dataclasses.replace(
                there, mode=new_mode, mtime_ns=new_mtime or created_ns, uid=new_uid, gid=new_gid
            )
        return dataclasses.replace(
            there, mode=new_mode, mtime_ns=new_mtime, uid=new_uid, gid=new_gid
        )

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
        """Every pin (the directories of /pins are none), in name order."""
        rows = self.tables.read(
            f"SELECT {_COLUMNS} FROM pins WHERE key <> ? ORDER BY name", (DIR_KEY,)
        )
        return [
            PinRecord(n, Key(bytes(k)), t, m, mt, sz, u, g) for n, k, t, m, mt, sz, u, g in rows
        ]

    def get(self, name: str) -> PinRecord | None:
        """The pin `name` (None: none; a directory of /pins is no pin)."""
        found = self.entry(name)
        return found if isinstance(found, PinRecord) else None

    def names_for(self, key: Key, limit: int | None = None) -> builtins.list[str]:
        """The names of the pins of `key`, in name order (the first `limit` of them)."""
        sql = "SELECT name FROM pins WHERE key = ? ORDER BY name"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        rows = self.tables.read(sql, (key.raw,))
        return [n for (n,) in rows]

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


def _attr_values(
    attrs: FileAttrs | None,
) -> tuple[int | None, int | None, int | None, int | None, int | None]:
    """A file's (mode, mtime_ns, size, uid, gid) columns (NULLs: a link's pin)."""
    if attrs is None:
        return (None, None, None, None, None)
    return (attrs.mode, attrs.mtime_ns, attrs.size, attrs.uid, attrs.gid)
