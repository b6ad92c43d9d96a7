"""What both ways of importing a git repository share (importer.py: the objects through
the kv; import_pack.py: the objects as git's pack): the result and its summary line, git
run on the source, the phases shown on a terminal, the repository's format check, and
the refs set in one atomic CAS batch."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import Exists, Invalid, Missing, Refused, Stale, StoreIO
from . import lfs
from .objects import FORMATS
from .refs import Outcome, RefUpdate, valid_ref_name

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tqdm import tqdm  # (untyped: its bars are what it makes)

    from ..app import Alkfs
    from ..gc.arbiter import Pin

TICK_S = 0.5  # a phase's elapsed time is redrawn this often


@dataclass
class ImportResult:
    repo_id: str
    object_format: str
    objects: int  # objects in the source
    stored: int  # newly stored by this import
    present: int  # already in the store, skipped
    bytes: int  # canonical bytes newly stored
    refs: dict[str, str] = field(default_factory=dict)  # the source's refs, as imported
    head: str | None = None  # the symbolic HEAD's target, if the source had one
    outcomes: list[Outcome] = field(default_factory=list)
    media_stored: int = 0  # LFS media newly stored from the source's lfs/objects
    media_present: int = 0  # LFS media its pointers name that the store already held
    media_missing: list[str] = field(default_factory=list)  # named, found nowhere (oids)

    def summary(self) -> str:
        """One line for the command line."""
        line = (
            f"{len(self.refs)} refs, {self.objects} objects ({self.stored} stored, "
            f"{self.present} already present)"
        )
        line += lfs.media_summary(self.media_stored, self.media_present, self.media_missing)
        return line


def _git(gitdir: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    proc = subprocess.run(["git", f"--git-dir={gitdir}", *args], capture_output=True, check=False)
    if check and proc.returncode != 0:
        raise StoreIO(
            f"git {' '.join(args)} failed: {proc.stderr.decode(errors='replace').strip()}"
        )
    return proc


def resolve_gitdir(path: str | os.PathLike[str]) -> str:
    """The git directory of a repository path: a bare repository (or a .git directory)
    itself, or the repository of a work tree. A plain directory is Missing, even one
    inside some other repository's work tree."""
    root = Path(path)
    if (root / "HEAD").is_file() and (root / "objects").is_dir():
        return str(root.resolve())
    if (root / ".git").exists():
        proc = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--absolute-git-dir"],
            capture_output=True,
            check=False,
        )
        if proc.returncode == 0:
            return proc.stdout.decode().strip()
    raise Missing(f"not a git repository: {root}")


def object_format(gitdir: str) -> str:
    proc = _git(gitdir, "config", "--get", "extensions.objectformat", check=False)
    fmt = proc.stdout.decode().strip().lower() or "sha1"
    if fmt not in FORMATS:
        raise Invalid(f"unknown object format {fmt!r} in {gitdir}")
    return fmt


def _progress(progress: bool | None, total: int | None, desc: str, **kw: str) -> tqdm | None:
    """A tqdm bar on stderr, when `progress` says (None: when stderr is a terminal)."""
    enabled = sys.stderr.isatty() if progress is None else progress
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="obj", desc=desc, file=sys.stderr, leave=False, **kw)


@contextlib.contextmanager
def _phase(progress: bool | None, desc: str) -> Iterator[None]:
    """While the block runs, a line naming the phase and its elapsed time, redrawn from a
    thread (when `progress` says, as _progress); cleared when it ends."""
    bar = _progress(progress, None, desc, bar_format="{desc} [{elapsed}]")
    if bar is None:
        yield
        return
    done = threading.Event()

    def tick() -> None:
        while not done.wait(TICK_S):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="alkfs-import-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()


def _check_format(app: Alkfs, repo_id: str, fmt: str) -> bool:
    """Whether the repository exists; Invalid if it has another object format."""
    try:
        repo = app.refs.repo(repo_id)
    except Missing:
        return False
    if repo.object_format != fmt:
        raise Invalid(f"repository {repo_id!r} is {repo.object_format}, the source is {fmt}")
    return True


def _import_refs(app: Alkfs, gitdir: str, repo_id: str, result: ImportResult) -> None:
    lines = _git(gitdir, "for-each-ref", "--format=%(objectname) %(refname)").stdout.splitlines()
    source: dict[str, str] = {}
    for line in lines:
        oid, _, name = line.decode(errors="surrogateescape").partition(" ")
        if valid_ref_name(name) and name.startswith("refs/"):
            source[name] = oid
    result.refs = dict(sorted(source.items()))
    current = app.refs.refs(repo_id)
    updates = [
        RefUpdate(name, oid, current.get(name))
        for name, oid in result.refs.items()
        if current.get(name) != oid
    ]
    if updates:
        result.outcomes = app.refs.update(repo_id, updates, atomic=True)
        failed = [o for o in result.outcomes if not o.ok and o.reason != "atomic-sibling-failed"]
        if failed:
            text = ", ".join(f"{o.name}: {o.reason}" for o in failed)
            if all(o.reason in ("stale", "exists", "missing-ref") for o in failed):
                raise Stale(f"refs moved during the import, none changed ({text})")
            raise Refused(f"the refs were refused, none changed ({text})")
    head = _git(gitdir, "symbolic-ref", "-q", "HEAD", check=False).stdout.decode().strip()
    if head and valid_ref_name(head) and head.startswith("refs/"):
        app.refs.set_head(repo_id, head)
        result.head = head


def media_and_refs(
    app: Alkfs,
    gitdir: str,
    repo_id: str,
    fmt: str,
    result: ImportResult,
    held: list[Pin],
    progress: bool | None,
    pointers: dict[str, list[str]] | None = None,
) -> None:
    """The tail both imports share: the LFS media the source's pointers name (their pins
    appended to `held`, for the caller to release once the refs committed), then the
    repository (created with the source's format if missing) and its refs."""
    with _phase(progress, "LFS media"):
        n_stored, n_present, absent, media_pins = lfs.import_media(app.store, gitdir, pointers)
    held.extend(media_pins)
    result.media_stored, result.media_present = n_stored, n_present
    result.media_missing = absent
    with _phase(progress, "refs"):
        if not _check_format(app, repo_id, fmt):
            try:
                app.refs.create_repo(repo_id, fmt)
            except Exists:  # created meanwhile
                _check_format(app, repo_id, fmt)
        _import_refs(app, gitdir, repo_id, result)
