"""Git LFS media kept alive by the pointers that name them (docs/lfs.md).

A git-lfs pointer is a small blob (under POINTER_MAX bytes) of this exact shape:

    version https://git-lfs.github.com/spec/v1
    oid sha256:<64 lowercase hex>
    size <decimal>

(git-lfs's extension lines, `ext-<n>-<name> sha256:<hex>`, may come between version and
oid; every line ends with a newline, keys after `version` in order). The media itself is
stored by its sha256, which is this store's default key: `oid sha256:X` names the
object `/objects/sha256/X`.

`LfsMedia` is the liveness source of the media:

- **Rows, not a walk.** The table `lfs_pointers` holds (pointer blob, media) for every
  pointer blob stored: `record`, a put hook of the store, writes them with every kv put
  of a pointer blob (new or already stored) and moves `pointer_writes` before and after.
  `scan` reads the kv tier in arrival order from where the last scan stopped
  (`meta.lfs_scanned`): the backfill of a store made before the table (resumable page
  by page) and the safety net of a put whose process ended before its row.
- **The mark** (`live_from`, run by the sweep after every other source): the media of
  every row whose pointer blob is live (refs, pins, borrowers) or pinned now (a push in
  flight). One media named by many pointers is one key; a row whose blob is gone goes.
  Borrowers' own pointer blobs (commits not pushed) are not in the store: `Roots` adds
  the media they name itself (alkfs/git/borrower.py reads them).
- **Arbitration** (`contains`, at each delete): a media key the mark found live is live;
  one it did not find is live anyway when a pointer was put, or a ref or a root changed,
  since the mark (the refs' and roots' own sources answer the same for every key); the
  media of pointers a scan found since the mark are protected (`protect`). In a fleet a
  pointer put moves the fleet's epoch, which every delete batch compares.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable, Container, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ..errors import Verification
from ..keys import Algorithm, Key
from ..keyset import KeyUnion
from ..schema import LFS_POINTERS
from .lfs_pointer import POINTER_MAX, SHA256_TAG, STORED_MAX, media_of, pointer_oid
from .tables import Tables

if TYPE_CHECKING:
    from ..db import Conn
    from ..gc.arbiter import Pin
    from ..store import Store
    from ..tiers.memory import MemoryTier

log = logging.getLogger("alkfs")

SCAN_PAGE = 50_000  # arrival numbers a scan reads per transaction
SCANNED = "lfs_scanned"
_SHA256 = SHA256_TAG
_GIT_LO = bytes([Algorithm.GIT_SHA1.value])
_GIT_HI = bytes([Algorithm.GIT_SHA256.value + 1])


def _insert_rows(conn: Conn, rows: Iterable[tuple[bytes, bytes]]) -> None:
    for row in rows:
        conn.execute(
            "INSERT INTO lfs_pointers (blob, media) VALUES (?, ?) ON CONFLICT (blob) DO NOTHING",
            row,
        )


def _media_file(dirs: list[Path], oid: str) -> Path | None:
    """Where git-lfs keeps the medium `oid` in one of `dirs` (None: in none of them)."""
    return next((p for d in dirs if (p := d / oid[:2] / oid[2:4] / oid).is_file()), None)


class LfsMedia:
    """The media liveness source (see the module docstring). Register it with
    `store.register_source` and its `protect` with `store.register_protect`; the sweep
    calls `live_from` after the other sources."""

    def __init__(self, store: Store, counters: Iterable[Callable[[], int]] = ()) -> None:
        self.store = store
        self.tables = Tables(store, (LFS_POINTERS,))
        self.counters = tuple(counters)  # the refs' and roots' write counters
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()
        self._memo: tuple[tuple[int, ...], set[bytes]] | None = None
        self._since_mark: set[bytes] = set()
        self._mem_seen: set[bytes] = set()  # (a memory store: the kv keys already scanned)
        self.pointer_writes = 0  # moved by every put of a pointer blob, new or not
        store.put_hooks.append(self.record)
        if store.threshold < STORED_MAX and store.mode != "mem":
            log.warning(
                "the store's threshold (%d bytes) keeps git-lfs pointer blobs as files: "
                "they do not keep their media alive (docs/lfs.md)",
                store.threshold,
            )

    # -- rows written with the pointer blob ------------------------------------------------
    def record(self, raws: Sequence[bytes], datas: Sequence[bytes]) -> None:
        """A put hook: the pointer blobs among a put's objects, new or already stored,
        get their rows (in the put's transaction where it has one), and the pointer
        counter moves before and after them: a sweep's delete in between answers live
        for media its mark did not find (`contains`). In a fleet the epoch moves too
        (every member's delete batch then re-checks)."""
        found = [
            (raw, media)
            for raw, data in zip(raws, datas, strict=True)
            if len(data) <= STORED_MAX
            and data[:5] == b"blob "
            and _GIT_LO <= raw[:1] < _GIT_HI
            and (media := media_of(bytes(data))) is not None
        ]
        self.record_pairs(found)

    def record_pairs(self, found: Sequence[tuple[bytes, bytes]]) -> None:
        """`record` for (pointer blob key, media key) pairs already read (raw keys): an
        import whose objects go into a pack without passing through a put."""
        if not found:
            return
        with self._lock:
            self.pointer_writes += 1
        with self.tables.tx() as conn:
            _insert_rows(conn, found)
            if self.store.fleet is not None:
                self.store.fleet.bump_epoch(conn)
        with self._lock:
            self.pointer_writes += 1
            self._since_mark.update(media for _blob, media in found)

    # -- rows -------------------------------------------------------------------------
    def scan(self) -> set[bytes]:
        """Record the pointer blobs that arrived since the last scan (a store made before
        the rows, a put the process did not end); returns the media they name, which are
        also protected until the next mark."""
        with self._scan_lock:
            found = self._scan_memory() if self.store.db is None else self._scan_db()
        media = {m for _blob, m in found}
        if media:
            with self._lock:
                self._since_mark |= media
        return media

    def _scan_db(self) -> list[tuple[bytes, bytes]]:
        store = self.store
        db = store.db
        assert db is not None
        a = db.arrival
        top = store.kv.high_water()  # type: ignore[union-attr]
        found: list[tuple[bytes, bytes]] = []
        pos = min(self._position(), top)  # (rows deleted from the top, or a migrated
        # store's arrival numbers: a position past the top would skip what comes next)
        while pos < top:
            store.check_stopping()
            end = min(top, pos + SCAN_PAGE)
            rows = db.execute(
                f"SELECT key, value FROM blobs WHERE {a} > ? AND {a} <= ? AND size <= ? "
                "AND key >= ? AND key < ? AND substr(value, 1, 5) = ? "  # (blobs only)
                # (not a packed object written back loose for a sweep, stored at time 0:
                # alkfs/git/packs/drain.py; its row was recorded when it arrived)
                "AND stored_ns != 0",
                (pos, end, STORED_MAX, _GIT_LO, _GIT_HI, b"blob "),
            ).fetchall()
            page: list[tuple[bytes, bytes]] = []
            for key, value in rows:
                media = media_of(bytes(value))
                if media is not None:
                    page.append((bytes(key), media))
            with self.tables.tx() as conn:
                _insert_rows(conn, page)
                conn.execute(
                    "INSERT INTO meta (name, value) VALUES (?, ?) ON CONFLICT (name) "
                    "DO UPDATE SET value = excluded.value",
                    (SCANNED, str(end)),
                )
            found += page
            pos = end
        return found

    def _position(self) -> int:
        rows = self.tables.read("SELECT value FROM meta WHERE name = ?", (SCANNED,))
        try:
            return int(rows[0][0]) if rows else 0
        except (TypeError, ValueError):
            return 0

    def _scan_memory(self) -> list[tuple[bytes, bytes]]:
        kv = cast("MemoryTier", self.store.kv)  # (a store without a database: memory)
        found: list[tuple[bytes, bytes]] = []
        for key in kv.keys():  # noqa: SIM118 (a KV store's scan, not a dict)
            if key in self._mem_seen or not _GIT_LO <= key[:1] < _GIT_HI:
                continue
            self._mem_seen.add(key)
            value = kv.read(key)
            media = None if value is None else media_of(value)
            if media is not None:
                found.append((key, media))
        if found:
            with self.tables.tx() as conn:
                _insert_rows(conn, found)
        return found

    def rows(self) -> list[tuple[bytes, bytes]]:
        return [
            (bytes(b), bytes(m))
            for b, m in self.tables.read("SELECT blob, media FROM lfs_pointers")
        ]

    def _drop_gone(self, rows: list[tuple[bytes, bytes]], live: Container[bytes]) -> None:
        """Rows whose pointer blob is no longer stored go (after the sweep deleted it)."""
        has = self.store.has_raw
        gone = [blob for blob, _media in rows if blob not in live and not has(blob)]
        if gone:
            # (in the transaction: a blob stored again meanwhile keeps its row)
            absent = (
                ""
                if self.store.db is None
                else (" AND NOT EXISTS (SELECT 1 FROM blobs WHERE key = ?)")
            )
            with self.tables.tx() as conn:
                for blob in gone:
                    conn.execute(
                        f"DELETE FROM lfs_pointers WHERE blob = ?{absent}",
                        (blob, blob) if absent else (blob,),
                    )
            self._mem_seen.difference_update(gone)

    # -- the liveness source ------------------------------------------------------------
    def _epoch(self) -> tuple[int, ...]:
        return (self.pointer_writes, *(c() for c in self.counters))

    def live_keys(self) -> set[bytes]:
        return set()  # (the media follow the other sources: see `live_from`)

    def live_from(self, live: Container[bytes]) -> set[bytes]:
        """The media named by the pointer blobs in `live` (the other sources' keys)."""
        epoch = self._epoch()  # (before the rows: a later change moves it)
        with self._lock:
            self._since_mark = set()
        self.scan()
        rows = self.rows()
        keys = {media for blob, media in rows if blob in live}
        # a pointer blob pinned now (a push in flight, until its ref commits) keeps its
        # media too: the ref that will name it may come after this mark
        rest = [blob for blob, media in rows if media not in keys]
        pinned = self.store.arbiter.pinned_keys()
        held = {blob for blob in rest if blob in pinned}
        fleet = self.store.fleet
        if fleet is not None and rest:
            held |= fleet.pinned_elsewhere(rest)
        keys |= {media for blob, media in rows if blob in held}
        self._drop_gone(rows, KeyUnion([live], held))
        with self._lock:
            self._memo = (epoch, keys)
        return keys

    def protect(self) -> set[bytes]:
        """The media of every pointer blob that arrived since the mark (live or not)."""
        self.scan()
        with self._lock:
            return set(self._since_mark)

    def contains(self, key: bytes) -> bool:
        if key[:1] != _SHA256:
            return False
        memo = self._memo
        if memo is None or key in memo[1]:
            return True
        return self._epoch() != memo[0]


# -- import: the media a source repository holds ------------------------------------------
def source_pointers(gitdir: str) -> dict[str, list[str]]:
    """{media oid: [pointer blob ids]} of every pointer blob among the objects of the git
    repository at `gitdir` (git reads them: every blob under POINTER_MAX bytes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    check = subprocess.run(
        [
            "git",
            f"--git-dir={gitdir}",
            "cat-file",
            "--batch-all-objects",
            "--unordered",
            "--batch-check=%(objectname) %(objecttype) %(objectsize)",
        ],
        capture_output=True,
        check=True,
        env=env,
    ).stdout
    small = [
        oid
        for oid, kind, size in (line.split() for line in check.splitlines())
        if kind == b"blob" and int(size) < POINTER_MAX
    ]
    found: dict[str, list[str]] = {}
    if not small:
        return found
    with tempfile.TemporaryFile() as ids:  # (git's input from a file: no pipe to deadlock)
        ids.write(b"\n".join(small) + b"\n")
        ids.seek(0)
        out = subprocess.run(
            ["git", f"--git-dir={gitdir}", "cat-file", "--batch"],
            stdin=ids,
            capture_output=True,
            check=True,
            env=env,
        ).stdout
    pos = 0
    while pos < len(out):
        nl = out.index(b"\n", pos)
        oid, _kind, size = out[pos:nl].split()
        body = out[nl + 1 : nl + 1 + int(size)]
        pos = nl + 1 + int(size) + 1
        media = pointer_oid(body)
        if media is not None:
            found.setdefault(media, []).append(oid.decode())
    return found


def media_dirs(gitdir: str) -> list[Path]:
    """Where git-lfs keeps the media of the repository at `gitdir`: `lfs/objects` in its
    git dir, and `lfs.storage`'s `objects` when that is configured."""
    dirs = [Path(gitdir, "lfs", "objects")]
    proc = subprocess.run(
        ["git", f"--git-dir={gitdir}", "config", "--get", "lfs.storage"],
        capture_output=True,
        check=False,
    )
    storage = proc.stdout.decode(errors="replace").strip()
    if storage:
        dirs.append(Path(gitdir, storage, "objects"))  # (an absolute path stays itself)
    return dirs


def import_media(
    store: Store, gitdir: str, pointers: dict[str, list[str]] | None = None
) -> tuple[int, int, list[str], list[Pin]]:
    """Store the media the source's pointers name (`pointers`: source_pointers', if read
    already) from its own LFS storage, each checked against its oid: (stored, already
    present, oids of media found nowhere, the pins of what was stored, for the caller to
    release once the refs commit)."""
    stored, present = 0, 0
    missing: list[str] = []
    pins: list[Pin] = []
    dirs = media_dirs(gitdir)
    for oid in sorted(source_pointers(gitdir) if pointers is None else pointers):
        key = Key.from_hex(Algorithm.SHA256, oid)
        pin = store.pin(key)  # (what is present stays so until the refs commit)
        if store.has(key):
            pins.append(pin)
            present += 1
            continue
        pin.release()
        path = _media_file(dirs, oid)
        if path is None:
            missing.append(oid)
            continue
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                result = store.put(f, size, Algorithm.SHA256, expect=key)
        except Verification:  # (a damaged file: its media is as good as absent)
            missing.append(oid)
            continue
        pins.append(result.pin)
        stored += 1
    return stored, present, missing, pins


def media_summary(stored: int, present: int, missing: list[str]) -> str:
    """The import summary's LFS part ('' when the source names no media)."""
    if not stored + present + len(missing):
        return ""
    line = (
        f"; LFS media: {stored + present + len(missing)} named by pointers ({stored} "
        f"stored, {present} already present"
    )
    if missing:
        more = len(missing) - 3
        line += (
            f", {len(missing)} absent from the source and the store: "
            f"{', '.join(missing[:3])}{f' and {more} more' if more > 0 else ''}"
        )
    return line + ")"


def copy_media_into(mount: Path, repo_id: str, gitdir: str) -> tuple[int, int, list[str]]:
    """`import_media` through a mount: each medium the source holds is written the way
    git-lfs writes it (a temporary file in /repos/<id>/lfs/tmp, renamed to its oid, which
    the daemon checks and stores): (stored, already present, oids found nowhere)."""
    stored, present, missing = 0, 0, []
    dirs = media_dirs(gitdir)
    lfs_dir = mount / "repos" / repo_id / "lfs"
    for oid in sorted(source_pointers(gitdir)):
        # (looked up in the repository's lfs view, as git-lfs does: the daemon keeps a
        # medium it finds staged for deletion until the push grace after we exit)
        if (lfs_dir / "objects" / oid[:2] / oid[2:4] / oid).exists():
            present += 1
            continue
        path = _media_file(dirs, oid)
        if path is None:
            missing.append(oid)
            continue
        tmp = lfs_dir / "tmp" / f"import-{os.getpid()}-{oid[:16]}"
        try:
            with open(path, "rb") as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.rename(tmp, lfs_dir / "objects" / oid[:2] / oid[2:4] / oid)
        except OSError:  # (EIO: the file does not hash to its name: as good as absent)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            missing.append(oid)
            continue
        stored += 1
    return stored, present, missing
