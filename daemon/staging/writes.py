"""The write state of one mount: the scratch area on disk and what git's writes leave in
memory (scratch names, a push's pin sessions, quarantines, ref locks, made ref
directories). The context owns one `Writes` (`ctx.writes`); the nodes that change it live
in scratch.py, ingest.py and the views. See scratch.py for the protocol.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio
from pyfuse3 import RequestContext

from .spool import inflight_root

if TYPE_CHECKING:
    from alkfs.gc.arbiter import Batch, Pin
    from alkfs.git.refs import Repo

    from ..nodes.base import Node
    from ..services import Services
    from .scratch import ScratchDir

log = logging.getLogger("alkfsd")

SCRATCH_DIR = "scratch"
GRACE_MIN_S = 600.0  # pins of a push that never writes a ref go after this (or the window)
EXPIRE_EVERY_S = 30.0
EXPIRE_MIN_S = 0.5  # the expiry loop's shortest period (a grace of a few seconds)
RepoKey = tuple[str, int]  # (repository id, creation time): a re-created id is another repo


def repo_key(repo: Repo) -> RepoKey:
    return (repo.id, repo.created_ns)


# -- the area on disk -----------------------------------------------------------------------
def clean(root: Path) -> None:
    """Empty (or create) a scratch directory: nothing in it survives a daemon."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)


def scratch_root(store: object) -> Path | None:
    """STORE/scratch, or a fleet member's own STORE/nodes/<node>/scratch (emptied at start:
    another daemon's is never touched); None for a memory store (a temporary directory)."""
    root = inflight_root(store)
    return None if root is None else root / SCRATCH_DIR


class ScratchArea:
    """One directory of scratch files, each under a serial number."""

    def __init__(self, root: Path | None) -> None:
        self.temporary = root is None
        self.root = Path(tempfile.mkdtemp(prefix="alkfs-scratch-")) if root is None else root
        clean(self.root)
        self.serial = 0

    def new_file(self) -> tuple[int, Path]:
        self.serial += 1
        path = self.root / f"{self.serial:016x}"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:
            # a fleet member paused past its session's end: the lease holder removed its
            # directories as a dead member's (alkfs/fleet.py); it joined again, they come back
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, flags, 0o600)
        os.close(fd)
        return self.serial, path

    def next_serial(self) -> int:
        self.serial += 1
        return self.serial

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        if not self.temporary:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)


# -- processes --------------------------------------------------------------------------------
def pid_of(req: RequestContext) -> int:
    return int(getattr(req, "pid", 0) or 0)


def alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


# -- per-mount write state --------------------------------------------------------------------
@dataclass
class Session:
    """The pins one process took in one repository, released together."""

    batch: Batch
    since: float = field(default_factory=time.monotonic)


class Writes:
    """What git's writes leave in the daemon's memory for one mount."""

    def __init__(self, ctx: Services) -> None:
        self.ctx = ctx
        self.area = ScratchArea(scratch_root(ctx.store))
        self.overlays: dict[tuple, dict[bytes, Node]] = {}
        self.sessions: dict[tuple[RepoKey, int], Session] = {}
        self.quarantines: dict[int, ScratchDir] = {}  # serial -> a scratch dir made in objects/
        self.locks: dict[tuple[RepoKey, str], Node] = {}  # git's .lock files, by ref
        self.ref_dirs: dict[RepoKey, set[str]] = {}  # mkdir'ed ref directories holding no ref
        configured = ctx.options.push_grace_s  # alkfsd --push-grace
        self.grace_s = (
            max(GRACE_MIN_S, ctx.store.window_ns / 1e9) if configured is None else configured
        )
        # looked at often enough for a short grace to mean what it says
        self.expire_every_s = min(EXPIRE_EVERY_S, max(EXPIRE_MIN_S, self.grace_s / 2))

    # -- scratch names inside store-backed directories ------------------------------------
    def overlay(self, host: Node) -> dict[bytes, Node]:
        found = self.overlays.get(host.ident)
        if found is None:
            found = self.overlays[host.ident] = {}
        return found

    def peek(self, host: Node, name: bytes) -> Node | None:
        names = self.overlays.get(host.ident)
        return None if not names else names.get(name)

    # -- pins -----------------------------------------------------------------------------
    def hold(self, repo: RepoKey, pid: int, pin: Pin) -> None:
        """Keep `pin` until the process `pid` (or anyone, once it is gone) commits a ref
        in `repo`, or the grace period passes."""
        s = self.sessions.get((repo, pid))
        if s is None:
            s = self.sessions[(repo, pid)] = Session(self.ctx.store.arbiter.batch())
        s.batch.add(pin)

    def committed(self, repo: RepoKey, pid: int) -> int:
        """A ref write by `pid` in `repo` committed: release that process's pins there and
        those of processes that have exited. Returns how many sessions went."""
        gone = [k for k in self.sessions if k[0] == repo and (k[1] == pid or not alive(k[1]))]
        for k in gone:
            self.sessions.pop(k).batch.release()
        return len(gone)

    def forget_repo(self, repo: RepoKey) -> None:
        """The repository is gone: its pins, locks, ref directories and scratch go too."""
        for k in [k for k in self.sessions if k[0] == repo]:
            self.sessions.pop(k).batch.release()
        for lk in [lk for lk in self.locks if lk[0] == repo]:
            del self.locks[lk]
        self.ref_dirs.pop(repo, None)
        for serial, q in list(self.quarantines.items()):
            if q.repo == repo:
                q.drop_from_host()
                del self.quarantines[serial]

    def pinned(self, repo: RepoKey | None = None) -> int:
        return sum(len(s.batch) for k, s in self.sessions.items() if repo is None or k[0] == repo)

    def push_of(self, pid: int) -> tuple[RepoKey, int] | None:
        """The (repository, receive-pack pid) of the push `pid` works for: it created a
        quarantine directory, or its parent did."""
        if not self.quarantines or pid <= 0:
            return None
        creators = {q.creator: q.repo for q in self.quarantines.values() if q.repo is not None}
        if pid in creators:
            return creators[pid], pid
        parent = parent_of(pid)
        if parent in creators:
            return creators[parent], parent
        return None

    def expire(self, now: float | None = None) -> None:
        """Release sessions older than the grace period; drop quarantines whose creator
        has exited (git removes its own; these are a killed push's)."""
        now = time.monotonic() if now is None else now
        for k, session in list(self.sessions.items()):
            if alive(k[1]):
                # a writer that is still there (a push slower than any grace, a hung
                # `git hash-object`) keeps its pins: the grace counts from its exit
                session.since = now
            elif now - session.since > self.grace_s:
                log.info(
                    "releasing %d pin(s) of repository %s after the grace period",
                    len(session.batch),
                    k[0][0],
                )
                self.sessions.pop(k).batch.release()
        for serial, q in list(self.quarantines.items()):
            if not alive(q.creator):
                q.drop_from_host()
                self.quarantines.pop(serial, None)

    async def run_expiry(self) -> None:
        """The mount's pin-expiry worker (workers.py): `expire` every `expire_every_s`.
        Without a mount (direct calls) nothing runs it: expired lazily (`mkdir_in`)."""
        while True:
            await trio.sleep(self.expire_every_s)
            try:
                self.expire()
            except Exception:
                log.exception("scratch expiry failed")

    def close(self) -> None:
        for s in self.sessions.values():
            s.batch.release()
        self.sessions.clear()
        self.area.close()
