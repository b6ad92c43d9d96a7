"""Repositories and their refs: compare-and-swap updates over co-tenant tables in store.db.

A ref may only point at an object that is in the store: each update pins its
new object (waiting out an in-flight delete), checks it is present, commits,
bumps `write_counter`, and only then releases the pins, all so that a sweep
never sees the new object as neither pinned nor possibly live.
"""

from __future__ import annotations

import enum
import hashlib
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..db import now_ns
from ..errors import Exists, Invalid, Missing, NotEmpty, Verification
from ..keys import Algorithm, Key, is_hex
from ..schema import REFS, REPOS
from .objects import FORMATS, parse_header, parse_tag
from .tables import Tables

if TYPE_CHECKING:
    from ..store import Store

REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")
DEFAULT_HEAD = "refs/heads/main"
MAX_REF_NAME = 1024  # bytes of UTF-8: a ref name longer than this is refused (git has no cap)
MAX_REF_PART = 255  # bytes: a component is a file name in the mount
PEEL_DEPTH = 8  # tags of tags followed when peeling


class _Any(enum.Enum):
    ANY = "ANY"

    def __repr__(self) -> str:
        return "ANY"


ANY = _Any.ANY
"""RefUpdate.old when the update applies whatever the ref holds now."""
Expected = str | None | _Any  # RefUpdate.old: the value, none (must not exist), or ANY


@dataclass(frozen=True)
class Repo:
    id: str
    object_format: str  # "sha1" | "sha256"
    created_ns: int

    @property
    def algo(self) -> Algorithm:
        return algo_of(self.object_format)


@dataclass
class RefUpdate:
    """One CAS: `old=None` means must not exist, `old=ANY` means whatever; `new=None` deletes."""

    name: str
    new: str | None
    old: str | None | _Any = ANY


class Refusal(enum.StrEnum):
    """Why a ref update was denied (Outcome.reason); the daemon maps each to one errno."""

    STALE = "stale"  # the ref does not hold the expected old value
    EXISTS = "exists"  # must-not-exist, but it does (or a D/F conflict)
    MISSING_REF = "missing-ref"  # an old value was expected, but there is no such ref
    MISSING_OBJECT = "missing-object"  # the new id is malformed or not in the store
    NOT_A_COMMIT = "not-a-commit"  # refs/heads/ only point at commits (as git requires)
    INVALID_NAME = "invalid-name"
    ATOMIC_SIBLING_FAILED = "atomic-sibling-failed"


LOST_RACE = frozenset(
    {Refusal.STALE, Refusal.EXISTS, Refusal.MISSING_REF, Refusal.ATOMIC_SIBLING_FAILED}
)
"""Refusals that mean another writer got there first (EAGAIN), not bad input (EINVAL)."""


@dataclass
class Outcome:
    name: str
    ok: bool
    reason: Refusal | None


def algo_of(object_format: str) -> Algorithm:
    if object_format == "sha1":
        return Algorithm.GIT_SHA1
    if object_format == "sha256":
        return Algorithm.GIT_SHA256
    raise Invalid(f"unknown object format {object_format!r}")


def oid_key(oid: str) -> Key | None:
    """The store key of a hex object id (40 digits: git-sha1, 64: git-sha256); None if malformed."""
    if is_hex(oid, 40):
        return Key.from_hex(Algorithm.GIT_SHA1, oid)
    if is_hex(oid, 64):
        return Key.from_hex(Algorithm.GIT_SHA256, oid)
    return None


_BAD_REF_CHARS = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")


def valid_ref_name(name: str) -> bool:
    """Whether `git check-ref-format` accepts `name` (at least two components), within
    this store's length limits (MAX_REF_NAME in all, MAX_REF_PART per component)."""
    if not name or name == "@" or "/" not in name:
        return False
    if len(name.encode("utf-8", "surrogatepass")) > MAX_REF_NAME:
        return False
    if any(len(part.encode("utf-8", "surrogatepass")) > MAX_REF_PART for part in name.split("/")):
        return False
    if _BAD_REF_CHARS.search(name) or ".." in name or "@{" in name:
        return False
    if name.endswith(".") or name.endswith("/") or name.startswith("/"):
        return False
    for part in name.split("/"):
        if not part or part.startswith(".") or part.endswith(".lock"):
            return False
    return True


def valid_repo_id(repo_id: str) -> bool:
    return isinstance(repo_id, str) and REPO_ID.match(repo_id) is not None


class _Rollback(Exception):
    pass


class Refs:
    """Every repository's refs; each change is one transaction of the store's database."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.tables = Tables(store, (REPOS, REFS))
        self.write_counter = 0
        self._versions: dict[str, int] = {}
        self._all_versions = 0
        self._counter_lock = threading.Lock()
        self._peeled: dict[str, str | None] = {}  # tag oid -> peeled oid (objects never change)

    def _bump(self, repo_id: str | None = None) -> None:
        with self._counter_lock:
            self.write_counter += 1
            if repo_id is not None:
                self._versions[repo_id] = self._versions.get(repo_id, 0) + 1

    def changed_elsewhere(self, repo_id: str | None) -> None:
        """Another daemon of the fleet changed this repository's refs (None: perhaps
        any repository's): views of them are made again."""
        with self._counter_lock:
            self.write_counter += 1
            if repo_id is None:
                self._all_versions += 1
            else:
                self._versions[repo_id] = self._versions.get(repo_id, 0) + 1

    def _notify(self, conn, repo_id: str) -> None:
        if self.store.fleet is not None:
            self.store.fleet.refs_changed(conn, repo_id)

    def version(self, repo_id: str) -> int:
        """A number that moves with every change of this repository's refs made through
        this Refs (a cache key for views of them, e.g. a packed-refs generation)."""
        return self._versions.get(repo_id, 0) + self._all_versions

    # -- repositories -----------------------------------------------------------
    def create_repo(self, repo_id: str, object_format: str = "sha1") -> Repo:
        if not valid_repo_id(repo_id):
            raise Invalid(f"invalid repository id {repo_id!r}")
        if object_format not in FORMATS:
            raise Invalid(f"unknown object format {object_format!r}")
        repo = Repo(repo_id, object_format, now_ns())
        with self.tables.tx() as conn:
            cur = conn.execute(
                "INSERT INTO git_repos (id, object_format, head, created_ns) "
                "VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (repo.id, repo.object_format, DEFAULT_HEAD, repo.created_ns),
            )
            if cur.rowcount != 1:
                raise Exists(f"repository {repo_id!r} exists")
        return repo

    def set_object_format(self, repo_id: str, object_format: str) -> Repo:
        """Change the object format of a repository that holds no ref yet, in one
        transaction (NotEmpty once it has refs): how a sha256 repository is made through
        a mount (`mkdir`, then the `user.alkfs.object-format` attribute)."""
        if object_format not in FORMATS:
            raise Invalid(f"unknown object format {object_format!r}")
        with self.tables.tx() as conn:
            if conn.execute("SELECT 1 FROM git_refs WHERE repo = ? LIMIT 1", (repo_id,)).fetchone():
                raise NotEmpty(f"repository {repo_id!r} has refs: its object format is fixed")
            cur = conn.execute(
                "UPDATE git_repos SET object_format = ? WHERE id = ?", (object_format, repo_id)
            )
            if cur.rowcount != 1:
                raise Missing(f"no repository {repo_id!r}")
        self._bump(repo_id)
        return self.repo(repo_id)

    def delete_repo(self, repo_id: str) -> None:
        """Delete the repository and its refs (what they kept becomes sweep candidates)."""
        with self.tables.tx() as conn:
            cur = conn.execute("DELETE FROM git_repos WHERE id = ?", (repo_id,))
            if cur.rowcount != 1:
                raise Missing(f"no repository {repo_id!r}")
            conn.execute("DELETE FROM git_refs WHERE repo = ?", (repo_id,))
            self._notify(conn, repo_id)
        self._bump(repo_id)

    def delete_all_refs(self, repo_id: str) -> int:
        """Delete every ref of the repository in one transaction (what they kept becomes
        sweep candidates); returns how many went. `rm packed-refs` in the mount, which is
        where all of a repository's refs are listed."""
        with self.tables.tx() as conn:
            if conn.execute("SELECT 1 FROM git_repos WHERE id = ?", (repo_id,)).fetchone() is None:
                raise Missing(f"no repository {repo_id!r}")
            n = conn.execute("DELETE FROM git_refs WHERE repo = ?", (repo_id,)).rowcount
            self._notify(conn, repo_id)
        self._bump(repo_id)
        return n

    def delete_repo_if_empty(self, repo_id: str) -> None:
        """Delete the repository only if it holds no ref, in one transaction (NotEmpty
        otherwise): `rmdir` of a repository directory."""
        with self.tables.tx() as conn:
            if conn.execute("SELECT 1 FROM git_refs WHERE repo = ? LIMIT 1", (repo_id,)).fetchone():
                raise NotEmpty(f"repository {repo_id!r} still has refs")
            cur = conn.execute("DELETE FROM git_repos WHERE id = ?", (repo_id,))
            if cur.rowcount != 1:
                raise Missing(f"no repository {repo_id!r}")
        self._bump(repo_id)

    def repos(self) -> list[Repo]:
        rows = self.tables.read("SELECT id, object_format, created_ns FROM git_repos ORDER BY id")
        return [Repo(*row) for row in rows]

    def repo(self, repo_id: str) -> Repo:
        rows = self.tables.read(
            "SELECT id, object_format, created_ns FROM git_repos WHERE id = ?", (repo_id,)
        )
        if not rows:
            raise Missing(f"no repository {repo_id!r}")
        return Repo(*rows[0])

    def head(self, repo_id: str) -> str:
        rows = self.tables.read("SELECT head FROM git_repos WHERE id = ?", (repo_id,))
        if not rows:
            raise Missing(f"no repository {repo_id!r}")
        return rows[0][0]

    def set_head(self, repo_id: str, target: str) -> None:
        """Point the symbolic HEAD at `target` (a ref name under refs/, which may be unborn)."""
        if not valid_ref_name(target) or not target.startswith("refs/"):
            raise Invalid(f"invalid HEAD target {target!r}")
        with self.tables.tx() as conn:
            cur = conn.execute("UPDATE git_repos SET head = ? WHERE id = ?", (target, repo_id))
            if cur.rowcount != 1:
                raise Missing(f"no repository {repo_id!r}")

    # -- refs ---------------------------------------------------------------------
    def refs(self, repo_id: str, prefix: str = "") -> dict[str, str]:
        """name -> lowercase hex oid, sorted by name, of the refs starting with `prefix`."""
        self.repo(repo_id)
        if prefix and ord(prefix[-1]) < 0x10FFFF:
            # [prefix, its successor): a range of the primary key (code point order is
            # the UTF-8 byte order sqlite compares in)
            upper = prefix[:-1] + chr(ord(prefix[-1]) + 1)
            rows = self.tables.read(
                "SELECT name, oid FROM git_refs WHERE repo = ? AND name >= ? AND name < ? "
                "ORDER BY name",
                (repo_id, prefix, upper),
            )
        elif prefix:
            rows = self.tables.read(
                "SELECT name, oid FROM git_refs WHERE repo = ? AND substr(name, 1, ?) = ? "
                "ORDER BY name",
                (repo_id, len(prefix), prefix),
            )
        else:
            rows = self.tables.read(
                "SELECT name, oid FROM git_refs WHERE repo = ? ORDER BY name", (repo_id,)
            )
        return dict(rows)

    def has_below(self, repo_id: str, prefix: str) -> bool:
        """Whether any ref name starts with `prefix` (one index probe, whatever the count)."""
        if not prefix or ord(prefix[-1]) >= 0x10FFFF:
            return bool(self.refs(repo_id, prefix))
        upper = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        rows = self.tables.read(
            "SELECT 1 FROM git_refs WHERE repo = ? AND name >= ? AND name < ? LIMIT 1",
            (repo_id, prefix, upper),
        )
        return bool(rows)

    def packed(self, repo_id: str) -> tuple[int, list[tuple[str, str, str | None]]]:
        """(version, [(name, oid, peeled or None)]) of every ref, in byte order of the
        names, as git's `packed-refs` lists them: the version is read before the refs, so
        a change the list misses always moves it. Every ref that points at an annotated
        tag carries the id it peels to (the first non-tag object): git's "fully-peeled"."""
        version = self.version(repo_id)
        self.repo(repo_id)
        rows = self.tables.read(
            "SELECT name, oid FROM git_refs WHERE repo = ? ORDER BY name", (repo_id,)
        )
        return version, [(name, oid, self.peel(oid)) for name, oid in rows]

    def peel(self, oid: str) -> str | None:
        """The id an annotated tag finally points at (None if `oid` is not a tag or is
        not readable); remembered per id, as objects never change."""
        if oid in self._peeled:
            return self._peeled[oid]
        out: str | None = None
        cur = oid
        for _ in range(PEEL_DEPTH):
            key = oid_key(cur)
            data = None if key is None else self.store.get(key)
            if data is None:
                break
            try:
                kind, _size, hlen = parse_header(data)
                if kind != "tag":
                    break
                cur, _ = parse_tag(data[hlen:])
            except (Verification, ValueError):
                break
            out = cur
        if len(self._peeled) > 1_000_000:
            self._peeled.clear()
        self._peeled[oid] = out
        return out

    def get(self, repo_id: str, name: str) -> str | None:
        rows = self.tables.read(
            "SELECT oid FROM git_refs WHERE repo = ? AND name = ?", (repo_id, name)
        )
        if rows:
            return rows[0][0]
        self.repo(repo_id)
        return None

    def snapshot(self) -> tuple[list[tuple[str, str, str]], str]:
        """Every (repo, name, oid) ordered by repo then name, and a fingerprint of exactly that."""
        rows = self.tables.read("SELECT repo, name, oid FROM git_refs ORDER BY repo, name")
        h = hashlib.sha256()
        for repo, name, oid in rows:
            h.update(f"{repo}\0{name}\0{oid}\n".encode())
        return [tuple(r) for r in rows], h.hexdigest()

    def update(
        self,
        repo_id: str,
        updates: list[RefUpdate],
        atomic: bool = True,
        *,
        heads_are_commits: bool = False,
    ) -> list[Outcome]:
        """Apply compare-and-swap updates in order, in one transaction.

        heads_are_commits: refuse (not-a-commit) a new value under refs/heads/ that is not
        a commit, as git does (the mount asks for this; the library's own callers, e.g.
        tests building odd shapes, may point a branch anywhere).

        atomic: any denial leaves every ref as it was (the others are denied with
        "atomic-sibling-failed"); otherwise the good updates apply. Missing if the
        repository does not exist."""
        repo = self.repo(repo_id)
        algo = repo.algo
        outcomes: list[Outcome | None] = [None] * len(updates)
        store = self.store
        held = store.arbiter.batch()
        committed = False
        try:
            for i, u in enumerate(updates):
                if not valid_ref_name(u.name) or not u.name.startswith("refs/"):
                    outcomes[i] = Outcome(u.name, False, Refusal.INVALID_NAME)
                elif u.new is not None:
                    if not is_hex(u.new, algo.hex_len):
                        outcomes[i] = Outcome(u.name, False, Refusal.MISSING_OBJECT)
                        continue
                    key = Key.from_hex(algo, u.new)
                    held.add(store.pin(key))  # pin, then look: a delete cannot slip between
                    if not store.has(key):
                        outcomes[i] = Outcome(u.name, False, Refusal.MISSING_OBJECT)
                    elif (
                        heads_are_commits
                        and u.name.startswith("refs/heads/")
                        and not self._is_commit(key)
                    ):
                        outcomes[i] = Outcome(u.name, False, Refusal.NOT_A_COMMIT)
            if atomic and any(o is not None for o in outcomes):
                return _atomic_fail(updates, outcomes)
            try:
                with self.tables.tx() as conn:
                    row = conn.execute(
                        "SELECT object_format, created_ns FROM git_repos WHERE id = ?", (repo_id,)
                    ).fetchone()
                    if row is None:
                        raise Missing(f"no repository {repo_id!r}")
                    # The ids were checked against the format read above: a repository
                    # made again, or whose format changed since, is a lost race.
                    changed = tuple(row) != (repo.object_format, repo.created_ns)
                    for i, u in enumerate(updates):
                        if outcomes[i] is not None:
                            continue
                        reason = Refusal.STALE if changed else _apply(conn, repo_id, u)
                        outcomes[i] = Outcome(u.name, reason is None, reason)
                        if reason is not None and atomic:
                            raise _Rollback
                    committed = any(o is not None and o.ok for o in outcomes)
                    fleet = store.fleet
                    if committed and fleet is not None:
                        # (several daemons: this session is live, what it names stored)
                        news = [
                            Key.from_hex(algo, u.new).raw
                            for u, o in zip(updates, outcomes, strict=True)
                            if o is not None and o.ok and u.new is not None
                        ]
                        fleet.guard_publish(conn, news)
                        fleet.refs_changed(conn, repo_id)
            except _Rollback:
                return _atomic_fail(updates, outcomes)
        finally:
            # The counter moves after the commit and before the pins go, in one locked step.
            held.release((lambda: self._bump(repo_id)) if committed else None)
        return [o for o in outcomes if o is not None]

    def _is_commit(self, key: Key) -> bool:
        data = self.store.get(key)
        if data is None:
            return False
        try:
            return parse_header(data[:64])[0] == "commit"
        except Verification:
            return False


def _atomic_fail(updates: list[RefUpdate], outcomes: list[Outcome | None]) -> list[Outcome]:
    return [
        o if o is not None and not o.ok else Outcome(u.name, False, Refusal.ATOMIC_SIBLING_FAILED)
        for u, o in zip(updates, outcomes, strict=True)
    ]


def _apply(conn, repo_id: str, u: RefUpdate) -> Refusal | None:
    row = conn.execute(
        "SELECT oid FROM git_refs WHERE repo = ? AND name = ?", (repo_id, u.name)
    ).fetchone()
    current = None if row is None else row[0]
    if current is None:
        if isinstance(u.old, str) or u.new is None:
            return Refusal.MISSING_REF
        if _conflicts(conn, repo_id, u.name):
            return Refusal.EXISTS
        conn.execute(
            "INSERT INTO git_refs (repo, name, oid) VALUES (?, ?, ?)", (repo_id, u.name, u.new)
        )
        return None
    if u.old is None:
        return Refusal.EXISTS
    if isinstance(u.old, str) and u.old != current:
        return Refusal.STALE
    if u.new is None:
        conn.execute("DELETE FROM git_refs WHERE repo = ? AND name = ?", (repo_id, u.name))
    else:
        conn.execute(
            "UPDATE git_refs SET oid = ? WHERE repo = ? AND name = ?", (u.new, repo_id, u.name)
        )
    return None


def _conflicts(conn, repo_id: str, name: str) -> bool:
    """A ref that is a directory of `name`, or below it (git's D/F conflict)."""
    parts = name.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts))]
    marks = ",".join("?" * len(prefixes))
    if conn.execute(
        f"SELECT 1 FROM git_refs WHERE repo = ? AND name IN ({marks}) LIMIT 1",
        (repo_id, *prefixes),
    ).fetchone():
        return True
    below = name + "/"
    return (
        conn.execute(
            "SELECT 1 FROM git_refs WHERE repo = ? AND name > ? AND name < ? LIMIT 1",
            (repo_id, below, name + "0"),
        ).fetchone()
        is not None
    )
