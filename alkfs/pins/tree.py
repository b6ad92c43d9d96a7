"""The tree of /pins: `PinTree`, the part of `Pins` that renames and moves
entries, lists a directory's entries, makes and removes directories and sets attributes
(alkfs/pins/__init__.py says how the tree is kept in the table)."""

from __future__ import annotations

import dataclasses
import stat
from typing import TYPE_CHECKING

from ..errors import Exists, Invalid, Missing, NotEmpty
from .paths import PATH_MAX, TooLong, below, parent_of, path_bytes
from .records import _COLUMNS, DIR_KEY, Entry, PinDir, PinRecord, PinsAhead, _entry

if TYPE_CHECKING:
    from ..db import Conn
    from ..git.tables import Tables
    from ..keys import Key
    from ..store import Store
    from .misses import Misses


class PinTree:
    """The tree operations of `Pins` (alkfs/pins/durable.py), which this is mixed into."""

    if TYPE_CHECKING:  # (Pins's)
        store: Store
        tables: Tables
        misses: Misses
        ahead: PinsAhead | None

        def _check_name(self, name: str, tree: bool = False) -> None: ...

        def _stamps(self, n: int = 1) -> int: ...

    @staticmethod
    def _parent_there(conn: Conn, name: str) -> None:
        """(in a transaction) Missing unless the directory `name` is in exists."""
        parent = parent_of(name)
        if parent is None:
            return
        row = conn.execute("SELECT key FROM pins WHERE name = ?", (parent,)).fetchone()
        if row is None or bytes(row[0]) != DIR_KEY:
            raise Missing(f"no directory {parent!r} in /pins")

    def _before_change(self, name: str | None = None) -> None:
        """Before a change of the pin `name` (None: of any entry, e.g. a directory's):
        what is pending ahead of its commit for it is applied first (best effort: what
        fails to apply stays pending and acknowledged)."""
        ahead = self.ahead
        if ahead is not None and ahead.count and (name is None or ahead.pinned(name)):
            ahead.settle()

    def _ahead_pin(self, name: str) -> PinRecord | None:
        """The pin `name` pending ahead of its commit (None: none)."""
        ahead = self.ahead
        return None if ahead is None or not ahead.count else ahead.pinned(name)

    def _ahead_below(self, prefix: str) -> list[PinRecord]:
        """The pins pending ahead of their commit whose names start with `prefix` ("":
        all), in name order."""
        ahead = self.ahead
        return [] if ahead is None or not ahead.count else ahead.pinned_below(prefix)

    # -- renames -----------------------------------------------------------------------
    def rename(self, old: str, new: str, replace: bool = False) -> None:
        """Rename a pin (Missing: no `old`); a pin `new` is Exists, or with `replace`
        is dropped in the same transaction (what `mv` expects). (`move`: in /pins.)"""
        self._check_name(new)
        self._before_change()
        self._move(old, new, replace, tree=False)

    def move(self, old: str, new: str, replace: bool = False) -> Entry:
        """Rename an entry of /pins (a pin, or a directory with everything below it) to
        the path `new`, as rename(2) does: Missing (no `old`, or no directory `new`
        would be in); `new` taken: Exists, or with `replace` it is replaced in the same
        transaction if it is of the same kind (Invalid: a directory over a pin or a
        pin over a directory; NotEmpty: a directory that is not empty; Invalid: a
        directory into itself; TooLong: a path below it would be too long)."""
        self._check_name(new, tree=True)
        self._before_change()
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

    def _moves_fit(self, conn: Conn, old: str, new: str) -> None:
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
        name `misses` knows was never there); a pin pending ahead of its commit is
        found (`ahead`)."""
        pending = self._ahead_pin(name)
        if pending is not None:
            return pending
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
        pending = self._ahead_below(prefix)
        if pending:
            there = {e.name for e in out}
            more = [
                r
                for r in pending
                if "/" not in r.name[len(prefix) :]
                and (after is None or r.name > after)
                and r.name not in there
            ]
            if more:
                out = sorted([*out, *more], key=lambda e: e.name)[:limit]
        return out

    def has_below(self, prefix: str) -> bool:
        """Whether any name starts with `prefix` (a directory's name and `/`): one probe."""
        if self._ahead_below(prefix):
            return True
        return bool(
            self.tables.read(
                "SELECT 1 FROM pins WHERE name >= ? AND name < ? LIMIT 1", (prefix, below(prefix))
            )
        )

    @staticmethod
    def _has_below(conn: Conn, prefix: str) -> bool:
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
        self._before_change(name)
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
        self._before_change()
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
        created_ns: int | None,
        mode: int | None = None,
        mtime_ns: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        key: Key | None = None,
    ) -> Entry:
        """Set the permission bits (of `mode`), the time, the owner and the group of the
        file or directory `name` made at `created_ns` (None: whenever; each other None:
        as it is; Missing:
        gone, replaced, or a link's pin; `key`: a file pin that no longer names that
        object is gone too). One transaction. Who may change an owner is the caller's
        rule."""
        self._before_change(name)
        with self.tables.tx() as conn:
            row = conn.execute(f"SELECT {_COLUMNS} FROM pins WHERE name = ?", (name,)).fetchone()
            there = None if row is None else _entry(row)
            if (
                there is None
                or (created_ns is not None and there.created_ns != created_ns)
                or there.mode is None
                or (key is not None and not (isinstance(there, PinRecord) and there.key == key))
            ):
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
                there,
                mode=new_mode,
                mtime_ns=new_mtime or there.created_ns,
                uid=new_uid,
                gid=new_gid,
            )
        return dataclasses.replace(
            there, mode=new_mode, mtime_ns=new_mtime, uid=new_uid, gid=new_gid
        )
