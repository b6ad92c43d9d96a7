"""Derived packs shared by a fleet (alkfs/fleet.py): one builder at a time, the published
generation in the database, every daemon's holds, and a sweep that waits for every daemon
to serve a set without what it deletes. `Derived` (alkfs/git/packs/) uses it when its
store has a fleet; the files stay in STORE/derived/<fmt>/, a directory every daemon sees.

- **Publishing**: the generation of each format is a row of `fleet_packs`, changed in one
  transaction with its builder's holds and `NOTIFY alkfs_packs`; it only ever moves up
  (a build overtaken by a newer one is dropped). Every daemon's listener then loads it
  (`Derived.refresh`).
- **One builder at a time** (`builder`), per format: a session advisory lock on a
  connection of its own, tried by the intake (another daemon builds: skip this round),
  waited for by a sweep's guard, `repack` and a withdrawal. A new generation's number is taken under it,
  above every generation published, held or on disk, and held before its directory is
  made.
- **Holds** (`fleet_pack_holds`): each daemon lists the generations it serves (serving =
  1) or still has files of open (0). A daemon switching to a published generation marks
  it served *before* it reads the published number again, and a publisher reads the
  holds only after its publish committed, so neither a removal nor a sweep can miss a
  daemon about to serve a generation. A directory is removed when it is neither
  published nor held by a live session (or being built).
- **Draining** (`all_serve`): the kv rows of what a published set holds are deleted only
  once every other live daemon serves that set or a newer one (a newer one carries
  everything the drained set holds: alkfs/git/packs/drain.py), under the builder lock.
- **Deleting** (`await_served`): before a sweep deletes objects a published set holds, the
  guard publishes a set without them, then waits up to SERVE_WAIT_S until no other live
  daemon serves a generation holding any of them; what a slower daemon still serves is
  kept by this sweep (it stays staged, for the next one).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..db import Conn
    from ..fleet import Fleet

PACKS_LOCK = 0x616C6B66_7061636B  # "alkfspack": the fleet's one builder holds PACKS_LOCK + i
LOCK_OFFSET = {"sha1": 0, "sha256": 1}  # (one lock a format: a sweep's guard holds both)
SERVE_WAIT_S = 5.0
POLL_S = 0.05
NOW = "(extract(epoch from clock_timestamp()) * 1000000000)::bigint"


class SharedPacks:
    """The fleet's side of one format's derived packs (see the module docstring)."""

    def __init__(self, fleet: Fleet, fmt: str) -> None:
        self.fleet = fleet
        self.db = fleet.db
        self.fmt = fmt
        self.lock_key = PACKS_LOCK + LOCK_OFFSET[fmt]
        self.building: set[int] = set()  # numbers taken by this process, not yet published
        self._depth = threading.local()  # how deep this thread holds the builder lock

    @property
    def node(self) -> str:
        return self.fleet.node

    def published(self) -> int:
        """The generation published for the fleet (0: none)."""
        row = self.db.execute(
            "SELECT generation FROM fleet_packs WHERE fmt = ?", (self.fmt,)
        ).fetchone()
        return 0 if row is None else int(row[0])

    @contextlib.contextmanager
    def builder(self, blocking: bool) -> Iterator[bool]:
        """True while this process is the fleet's builder (False: another one is and
        `blocking` was not asked). Reentrant within a thread."""
        depth = getattr(self._depth, "n", 0)
        if depth:
            self._depth.n = depth + 1
            try:
                yield True
            finally:
                self._depth.n = depth
            return
        with self.db.dedicated() as conn:
            if blocking:
                conn.execute("SELECT pg_advisory_lock(%s)", (self.lock_key,))
            else:
                row = conn.execute("SELECT pg_try_advisory_lock(%s)", (self.lock_key,)).fetchone()
                if not row or not row[0]:
                    yield False
                    return
            self._depth.n = 1
            try:
                yield True
            finally:
                self._depth.n = 0
                with contextlib.suppress(Exception):
                    conn.execute("SELECT pg_advisory_unlock(%s)", (self.lock_key,))

    def new_number(self, on_disk: Iterable[int]) -> int:
        """A number for a new generation (the builder's), held before its directory is made."""
        row = self.db.execute(
            "SELECT coalesce(max(generation), 0) FROM fleet_pack_holds WHERE fmt = ?",
            (self.fmt,),
        ).fetchone()
        number = max([self.published(), int(row[0]), *on_disk, *self.building, 0]) + 1
        self.building.add(number)
        self._hold(number, serving=0)
        return number

    def _hold(self, number: int, serving: int) -> None:
        self.db.execute(
            "INSERT INTO fleet_pack_holds (node, fmt, generation, serving) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (node, fmt, generation) DO UPDATE SET serving = excluded.serving",
            (self.node, self.fmt, number, serving),
        )

    def publish(self, number: int) -> bool:
        """Publish `number` for the fleet and serve it; False if a newer one was published
        meanwhile (this build is then dropped)."""
        with self.db.tx() as conn:
            cur = conn.execute(
                "INSERT INTO fleet_packs (fmt, generation, published_ns) "
                f"VALUES (?, ?, {NOW}) ON CONFLICT (fmt) DO UPDATE SET "
                "generation = excluded.generation, published_ns = excluded.published_ns "
                "WHERE fleet_packs.generation < excluded.generation",
                (self.fmt, number),
            )
            if cur.rowcount != 1:
                self.building.discard(number)
                return False
            self._serve_only(conn, number)
            conn.execute("SELECT pg_notify('alkfs_packs', ?)", (self.fmt,))
        self.building.discard(number)
        return True

    def _serve_only(self, conn: Conn, number: int) -> None:
        conn.execute(
            "INSERT INTO fleet_pack_holds (node, fmt, generation, serving) VALUES (?, ?, ?, 1) "
            "ON CONFLICT (node, fmt, generation) DO UPDATE SET serving = 1",
            (self.node, self.fmt, number),
        )
        conn.execute(
            "UPDATE fleet_pack_holds SET serving = 0 "
            "WHERE node = ? AND fmt = ? AND generation <> ? AND serving = 1",
            (self.node, self.fmt, number),
        )

    def will_serve(self, number: int) -> None:
        """Mark `number` served (beside what is served now) before switching to it."""
        self._hold(number, serving=1)

    def serve_only(self, number: int) -> None:
        with self.db.tx() as conn:
            self._serve_only(conn, number)

    def sync(self, held: set[int], serving: int) -> None:
        """This process's holds are exactly `held`, `serving`, and what it is building."""
        keep = sorted(held | {serving} | self.building)
        with self.db.tx() as conn:
            conn.execute(
                "DELETE FROM fleet_pack_holds WHERE node = ? AND fmt = ? "
                "AND NOT (generation = ANY(?))",
                (self.node, self.fmt, keep),
            )
            for number in keep:
                conn.execute(
                    "INSERT INTO fleet_pack_holds (node, fmt, generation, serving) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT (node, fmt, generation) DO UPDATE "
                    "SET serving = excluded.serving",
                    (self.node, self.fmt, number, int(number == serving)),
                )

    def removable(self, on_disk: Iterable[int]) -> list[int]:
        """The generations on disk that nobody may need: not published, not held by a
        live session, not being built here. (Read after any publish of this process.)"""
        rows = self.db.execute(
            "SELECT DISTINCT h.generation FROM fleet_pack_holds h JOIN fleet_nodes n "
            f"ON n.id = h.node WHERE h.fmt = ? AND n.expiry_ns > {NOW}",
            (self.fmt,),
        ).fetchall()
        keep = {int(r[0]) for r in rows} | self.building | {self.published()}
        return [n for n in on_disk if n not in keep]

    def served_elsewhere(self) -> set[int]:
        """The generations the other live daemons serve."""
        rows = self.db.execute(
            "SELECT DISTINCT h.generation FROM fleet_pack_holds h JOIN fleet_nodes n "
            f"ON n.id = h.node WHERE h.fmt = ? AND h.serving = 1 AND h.node <> ? "
            f"AND n.expiry_ns > {NOW}",
            (self.fmt, self.node),
        ).fetchall()
        return {int(r[0]) for r in rows}

    def all_serve(self, number: int, timeout_s: float = SERVE_WAIT_S) -> bool:
        """Whether every other live daemon serves `number` or a newer generation, within
        `timeout_s` (0: look once). A daemon switching serves both for a moment: it is
        waited for until it serves the new one alone."""
        return _until(lambda: all(g >= number for g in self.served_elsewhere()), timeout_s)

    def await_served(
        self,
        number: int,
        holding: Callable[[int], set[bytes]],
        timeout_s: float = SERVE_WAIT_S,
    ) -> set[bytes]:
        """Wait until no other live daemon serves a generation (other than `number`) for
        which `holding(generation)` is not empty; then nothing, or after `timeout_s`
        what those generations still hold (the caller keeps it)."""
        held: set[bytes] = set()

        def clear() -> bool:
            held.clear()
            for gen in self.served_elsewhere() - {number}:
                held.update(holding(gen))
            return not held

        _until(clear, timeout_s)
        return held


def _until(done: Callable[[], bool], timeout_s: float) -> bool:
    """Look at `done` every POLL_S until it is true (True) or `timeout_s` passed (False;
    0: look once)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True
