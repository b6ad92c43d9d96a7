"""Borrowers (docs/gc.md): repositories outside the store registered as roots, and the
liveness source they form.

A root is a name (the rules of a pin name) and the absolute path of a git repository
that reads the store's objects through its alternates (a local clone of
`/repos/<id>`, a `--shared` or `--reference` clone). Registrations are rows of the
store's database (`roots`: both engines, so a fleet shares them), each with the
machine it was registered on and the path's device: a root is read only on its own
machine (a path names nothing elsewhere).

At every sweep, before anything is deleted, each root of this machine is read anew
(`git/borrower.py`: refs, reflogs, indexes, worktrees, pseudo-refs and the borrower's
own objects) and the closure of what it names is walked in the store. Outcomes:

- read: everything it reaches is live;
- its path is gone: recorded (`missing_since_ns`); past `ALKFS_ROOTS_GRACE` (default
  7 days) the root is dropped with a log line and the sweep goes on; before that the
  sweep ends `protect-failed` naming it (a home directory briefly unmounted must not
  lose what its clones borrow);
- it cannot be read or is not a git repository: the sweep ends `protect-failed`
  naming it, deleting nothing.

A root of another machine (a fleet spanning machines) is read there: the sweep bumps
the root's `asked` counter and NOTIFYs `alkfs_roots`; a daemon of that machine reads
it and leaves the ids it names in `root_tips` (or why it could not, in `answer`) with
`answered` set to the request's number; the sweep walks those ids here. No live daemon
on that machine, or no answer within `ALKFS_ROOTS_ASK_TIMEOUT` (60 s): `protect-failed`
naming it; it is never dropped from another machine.

`contains` (arbitration at delete time, under the lock, no I/O) answers from the set
computed at the start of the same sweep — the execute step runs after it, so a
borrower's ref moved between the sweep that staged a candidate and the one that
deletes it keeps what it reaches — and answers live for everything while a root was
added since that set was made, or before any was made.
"""

from __future__ import annotations

import builtins
import logging
import os
import threading
import time
from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .db import now_ns
from .durations import format_duration
from .errors import Exists, Invalid, Missing, SourceFailed, log_failure
from .git import borrower
from .git.closure import RefClosure, Walker
from .git.tables import Tables
from .keys import Algorithm, Key
from .machine import machine_id
from .pins import valid_pin_name
from .schema import ROOTS
from .settings import settings

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("alkfs")

_ALGO = {"sha1": Algorithm.GIT_SHA1, "sha256": Algorithm.GIT_SHA256}


def ask_timeout_s() -> float:
    """How long a sweep waits for another machine's daemon to read its roots
    (`ALKFS_ROOTS_ASK_TIMEOUT`, a duration of at most an hour; default 60 s)."""
    return settings().roots_ask_timeout_s


def _keys(found: borrower.Reach) -> list[Key]:
    """The git objects it names, then the LFS media its own pointers name (sha256)."""
    prefix = bytes([_ALGO[found.object_format].value])
    return [Key(prefix + x) for x in found.ids] + [Key(m) for m in found.media]


def grace_s() -> float:
    """How long a registered path may be missing before its root is dropped
    (`ALKFS_ROOTS_GRACE`, a duration; default 7 days)."""
    return settings().roots_grace_s


@dataclass(frozen=True)
class RootRecord:
    name: str
    path: str
    machine: str
    device: int
    created_ns: int
    missing_since_ns: int | None = None


def _record(row: tuple) -> RootRecord:
    return RootRecord(row[0], row[1], row[2], int(row[3]), int(row[4]), row[5])


_COLUMNS = "name, path, machine, device, created_ns, missing_since_ns"


class Roots:
    """The registered borrowers; a liveness source (register it with
    `store.register_source`)."""

    def __init__(self, store: Store, closure: RefClosure | None = None) -> None:
        self.store = store
        self.tables = Tables(store, (ROOTS,))
        self.closure = closure  # (the refs' closure: a borrower's walk stops at it)
        self.walker = closure.walker if closure is not None else Walker(store)
        self.write_counter = 0  # moved by every registration (after its commit)
        self._memo: tuple[int, set[bytes]] | None = None
        self._lock = threading.Lock()
        self._answering = threading.Lock()  # (one read of the asked roots at a time)

    # -- registrations --------------------------------------------------------------------
    def add(self, name: str, path: str) -> RootRecord:
        """Register the repository at `path` (absolute; a work tree or a git dir) as
        `name`. Invalid: a bad name, a relative path, not a git repository; Exists:
        the name is another path's. The same name and path again is a no-op."""
        if not valid_pin_name(name):
            raise Invalid(f"invalid root name {name!r} ([A-Za-z0-9][A-Za-z0-9._-]{{0,127}})")
        if not isinstance(path, str) or not os.path.isabs(path) or "\0" in path:
            raise Invalid(f"a root's path must be absolute: {path!r}")
        path = os.path.normpath(path)
        try:
            borrower.locate(path)
            device = os.stat(path).st_dev
        except borrower.Gone:
            raise Invalid(f"{path}: no such repository") from None
        except borrower.Unreadable as exc:
            raise Invalid(str(exc)) from None
        record = RootRecord(name, path, machine_id(), device, now_ns())
        with self.tables.tx() as conn:
            row = conn.execute(f"SELECT {_COLUMNS} FROM roots WHERE name = ?", (name,)).fetchone()
            if row is not None:
                old = _record(row)
                if old.path == path and old.machine == record.machine:
                    return old
                raise Exists(f"the root {name!r} is {old.path}")
            conn.execute(
                f"INSERT INTO roots ({_COLUMNS}, asked, answered) VALUES (?, ?, ?, ?, ?, NULL, 0, 0)",
                (name, path, record.machine, device, record.created_ns),
            )
            if self.store.fleet is not None:  # (a sweep elsewhere computed without it)
                self.store.fleet.guard_publish(conn)
        with self._lock:
            self.write_counter += 1
        log.info("root %s registered: %s", name, path)
        return record

    def remove(self, name: str) -> None:
        with self.tables.tx() as conn:
            if conn.execute("DELETE FROM roots WHERE name = ?", (name,)).rowcount != 1:
                raise Missing(f"no root {name!r}")
        log.info("root %s unregistered", name)

    def list(self) -> builtins.list[RootRecord]:
        rows = self.tables.read(f"SELECT {_COLUMNS} FROM roots ORDER BY name")
        return [_record(r) for r in rows]

    def get(self, name: str) -> RootRecord | None:
        rows = self.tables.read(f"SELECT {_COLUMNS} FROM roots WHERE name = ?", (name,))
        return _record(rows[0]) if rows else None

    def __len__(self) -> int:
        return int(self.tables.read("SELECT count(*) FROM roots")[0][0])

    # -- the liveness source --------------------------------------------------------------
    def live_keys(self) -> set[bytes]:
        """Everything the roots reach (see the module docstring); SourceFailed naming
        each root that could not be judged."""
        with self._lock:
            counter = self.write_counter
        records = self.list()
        me = machine_id()
        problems: list[str] = []
        tips: list[Key] = []
        here = [rec for rec in records if rec.machine == me]
        elsewhere = [rec for rec in records if rec.machine != me]
        asked = self._ask(elsewhere, problems)  # (their machines read while this one does)
        for rec in here:
            found = self._read(rec, problems)
            if found is not None:
                tips += _keys(found)
        tips += self._answers(asked, problems)
        if problems:
            raise SourceFailed("; ".join(problems))
        media = {k.raw for k in tips if k.algo is Algorithm.SHA256}  # (LFS: not walked)
        tips = [k for k in tips if k.algo is not Algorithm.SHA256]
        known = self.known() if tips else None
        live, _missing = self.walker.walk(tips, known) if tips else (set(), 0)
        live |= media
        with self._lock:
            self._memo = (counter, live)
        return live

    def known(self) -> Container[bytes] | None:
        """What the refs keep, as this sweep computed it before us (the sources run in
        order: refs, pins, roots): closed under reachability, so a borrower's walk stops
        there; None when not at hand (the walk then covers everything)."""
        return None if self.closure is None else self.closure.last_live()

    # -- roots of other machines (a fleet) ------------------------------------------------
    def _ask(self, records: builtins.list[RootRecord], problems: builtins.list[str]) -> dict:
        """Ask the daemons of the machines of `records` to read them now: {name: the
        (request's number, machine)} for those whose machine has a live daemon."""
        fleet = self.store.fleet
        asked: dict[str, tuple[int, str]] = {}
        for rec in records:
            if fleet is None or not fleet.machine_live(rec.machine):
                problems.append(
                    f"root {rec.name!r} ({rec.path}) is on machine {rec.machine}, "
                    "where no daemon of this store runs: only one there can read it"
                )
                continue
            with self.tables.tx() as conn:
                row = conn.execute(
                    "UPDATE roots SET asked = asked + 1 WHERE name = ? RETURNING asked",
                    (rec.name,),
                ).fetchone()
            if row is not None:
                asked[rec.name] = (int(row[0]), rec.machine)
        if asked:
            assert fleet is not None
            fleet.ask_roots()
        return asked

    def _answers(
        self, asked: dict[str, tuple[int, str]], problems: builtins.list[str]
    ) -> builtins.list[Key]:
        """Wait (up to ALKFS_ROOTS_ASK_TIMEOUT, 60 s) for the reads asked by `_ask`."""
        out: list[Key] = []
        if not asked:
            return out
        waiting = dict(asked)
        deadline = time.monotonic() + ask_timeout_s()
        while waiting:
            self.store.check_stopping()  # (a SIGTERM does not wait out the answer)
            for name, (n, _machine) in list(waiting.items()):
                rows = self.tables.read(
                    "SELECT machine, answered, answer FROM roots WHERE name = ?", (name,)
                )
                if not rows:  # (unregistered meanwhile, or dropped by its machine)
                    del waiting[name]
                    continue
                machine, answered, answer = rows[0]
                if int(answered) < n:
                    continue
                del waiting[name]
                if answer is not None:
                    problems.append(f"{answer} (read on machine {machine})")
                    continue
                keys = self.tables.read("SELECT key FROM root_tips WHERE name = ?", (name,))
                out += (Key(bytes(k)) for (k,) in keys)
            if not waiting:
                break
            if time.monotonic() > deadline:
                for name, (_n, machine) in waiting.items():
                    problems.append(
                        f"root {name!r}: no daemon of its machine {machine} answered within "
                        f"{format_duration(ask_timeout_s())}"
                    )
                break
            time.sleep(0.1)
        return out

    def answer(self) -> int:
        """Read the roots of this machine that a sweep elsewhere asked for, and leave what
        each names (or why it could not be read) in the database (a fleet's daemons run
        this when told). How many were answered."""
        if self.store.fleet is None:
            return 0
        with self._answering:
            rows = self.tables.read(
                f"SELECT {_COLUMNS}, asked FROM roots WHERE machine = ? AND asked > answered",
                (machine_id(),),
            )
            for row in rows:
                rec, n = _record(row[:6]), int(row[6])
                problems: list[str] = []
                found = self._read(rec, problems)
                keys = [] if found is None else [k.raw for k in _keys(found)]
                db = self.store.db
                assert db is not None  # (a fleet's store is a database's)
                with self.tables.tx() as conn:
                    conn.execute("DELETE FROM root_tips WHERE name = ?", (rec.name,))
                    db.insert_rows(
                        conn,
                        "INSERT INTO root_tips (name, key)",
                        ("text", "key"),
                        [(rec.name, k) for k in keys],
                        "ON CONFLICT DO NOTHING",
                    )
                    conn.execute(
                        "UPDATE roots SET answered = ?, answer = ? WHERE name = ?",
                        (n, "; ".join(problems)[:2000] if problems else None, rec.name),
                    )
            return len(rows)

    def asked(self, _what: str | None = None) -> None:
        """A fleet's notice that a sweep asks for reads: answered on a thread of its own
        (the notice's listener must not wait for git)."""
        threading.Thread(target=self._answer_logged, name="alkfs-roots", daemon=True).start()

    def _answer_logged(self) -> None:
        try:
            self.answer()
        except Exception:
            log_failure(log, "roots: answering a sweep's read failed")

    def _read(self, rec: RootRecord, problems: builtins.list[str]) -> borrower.Reach | None:
        try:
            found = borrower.tips(rec.path, self.store.stopping)
        except borrower.Gone:
            self._missing(rec, problems)
            return None
        except borrower.Unreadable as exc:
            if self._unmounted(rec):
                self._missing(rec, problems)
            else:
                problems.append(f"root {rec.name!r}: {exc}")
            return None
        if rec.missing_since_ns is not None:
            with self.tables.tx() as conn:
                conn.execute("UPDATE roots SET missing_since_ns = NULL WHERE name = ?", (rec.name,))
        return found

    @staticmethod
    def _unmounted(rec: RootRecord) -> bool:
        """An empty directory on another device where the repository was: the file
        system that held it is not mounted (a home directory), as if gone."""
        try:
            st = os.stat(rec.path)
            return st.st_dev != rec.device and not os.listdir(rec.path)
        except OSError:
            return False

    def _missing(self, rec: RootRecord, problems: builtins.list[str]) -> None:
        now = now_ns()
        since = rec.missing_since_ns
        if since is None:
            since = now
            with self.tables.tx() as conn:
                conn.execute(
                    "UPDATE roots SET missing_since_ns = ? WHERE name = ? "
                    "AND missing_since_ns IS NULL",
                    (now, rec.name),
                )
        grace = grace_s()
        gone_s = (now - since) / 1e9
        if gone_s >= grace:
            with self.tables.tx() as conn:
                conn.execute(
                    "DELETE FROM roots WHERE name = ? AND missing_since_ns = ?", (rec.name, since)
                )
            log.warning(
                "root %s dropped: %s has been missing for %s (more than ALKFS_ROOTS_GRACE=%s)",
                rec.name,
                rec.path,
                format_duration(int(gone_s)),
                format_duration(grace),
            )
            return
        problems.append(
            f"root {rec.name!r}: {rec.path} is missing (for "
            f"{format_duration(max(1, int(gone_s)))}; dropped once missing for "
            f"{format_duration(grace) if grace else '0s'})"
        )

    def contains(self, key: bytes) -> bool:
        memo = self._memo
        if memo is None or key in memo[1]:
            return True
        return self.write_counter != memo[0]
