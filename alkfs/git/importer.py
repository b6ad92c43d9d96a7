"""Import a git repository: its objects, then all its refs in one atomic CAS batch.

Objects come from `git cat-file --batch`, each verified against its id as it is
stored. Objects already in the store are skipped, so a rerun reads no content.
Every object of the source stays pinned (in-process, one Batch) from before it
is looked up or stored until the refs that reach it have committed, so a sweep
running during the import can never delete what the new refs will reference.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import Exists, Invalid, Missing, Refused, Stale, StoreIO, Verification
from ..keys import Algorithm, Key
from ..tiers.sqlite import SqliteTier
from .objects import FORMATS, MAX_HEADER
from .refs import Outcome, RefUpdate, algo_of, valid_ref_name, valid_repo_id

if TYPE_CHECKING:
    from ..app import Alkfs
    from ..gc.arbiter import Batch
    from ..store import Store

PUT_BATCH_ITEMS = 16384
PUT_BATCH_BYTES = 32 << 20
MAX_INFLIGHT = 2
WRITER_CACHE_KIB = 65536
CHECK_BATCH = 500
SAMPLE = 256  # ids looked up first: none present means a first import


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


_WRITER: concurrent.futures.ThreadPoolExecutor | None = None
_WRITER_LOCK = threading.Lock()


def _writer() -> concurrent.futures.ThreadPoolExecutor:
    """The one writer thread, kept for the process (so a store gets at most one extra
    sqlite connection from imports, closed with the store)."""
    global _WRITER
    with _WRITER_LOCK:
        if _WRITER is None:
            _WRITER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="alkfs-import")
        return _WRITER


def _put(store: Store, items: list) -> list:
    """put_many on the writer thread, whose own sqlite connection gets a page cache
    large enough to keep the key index warm across a whole import."""
    if store.db is not None:
        store.db.conn().execute(f"PRAGMA cache_size = -{WRITER_CACHE_KIB}")
    return store.put_many(items)


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


def _present(store: Store, algo: Algorithm, ids: list[bytes], sizes: list[int]) -> list[bool]:
    """Which ids the store holds (batched kv lookups; the large tier only for large objects)."""
    prefix = bytes([algo.value])
    have: set[bytes] = set()
    kv = store.kv
    if isinstance(kv, SqliteTier):
        conn = kv.db.conn()
        for i in range(0, len(ids), CHECK_BATCH):
            chunk = [prefix + x for x in ids[i : i + CHECK_BATCH]]
            marks = ",".join("?" * len(chunk))
            have.update(
                bytes(k)
                for (k,) in conn.execute(f"SELECT key FROM blobs WHERE key IN ({marks})", chunk)
            )
        out = []
        for x, size in zip(ids, sizes, strict=True):
            k = prefix + x
            if k in have:
                out.append(True)
            elif size + MAX_HEADER > store.threshold and store.large is not None:
                out.append(store.large.stat(k) is not None)
            else:
                out.append(False)
        return out
    return [store.has(Key(prefix + x)) for x in ids]


def _progress(progress: bool | None, total: int, desc: str):
    enabled = sys.stderr.isatty() if progress is None else progress
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="obj", desc=desc, file=sys.stderr, leave=False)


def import_repo(
    app: Alkfs, gitdir: str, repo_id: str, progress: bool | None = None
) -> ImportResult:
    """Import every object and ref of the git repository at `gitdir` as repository `repo_id`.

    The repository is created with the source's object format if missing (only once
    the objects are in, so a failed import leaves no empty repository behind); an
    existing one must have the same format. Every source ref is set in one atomic CAS
    batch against the values read just before (Stale if they moved, Refused if a ref
    is refused: then no ref changes); refs the source does not have are left alone.
    The source's symbolic HEAD becomes the repository's."""
    gitdir = resolve_gitdir(gitdir)
    fmt = object_format(gitdir)
    if not valid_repo_id(repo_id):
        raise Invalid(f"invalid repository id {repo_id!r}")
    _check_format(app, repo_id, fmt)
    algo = algo_of(fmt)
    store = app.store
    prefix = bytes([algo.value])

    listing = _git(
        gitdir,
        "cat-file",
        "--batch-all-objects",
        "--unordered",
        "--batch-check=%(objectname) %(objectsize)",
    ).stdout.split()
    ids = [bytes.fromhex(x.decode()) for x in listing[0::2]]
    sizes = [int(x) for x in listing[1::2]]
    result = ImportResult(repo_id, fmt, len(ids), 0, 0, 0)

    held = store.arbiter.batch()
    try:
        sample = ids[:: max(1, len(ids) // SAMPLE)]
        if not any(_present(store, algo, sample, sizes[:: max(1, len(ids) // SAMPLE)])):
            # A first import: store everything in git's own order. Whatever is present
            # after all is deduplicated (and freshened) by the put, which pins it too.
            _store_objects(store, gitdir, algo, ids, True, result, progress, held)
            result.present = len(ids) - result.stored
        else:
            # Pin every id, then look: nothing skipped can be deleted before the refs
            # commit (pinning an id that is missing is harmless; its put pins it too).
            for pin in store.pin_many([prefix + x for x in ids]):
                held.add(pin)
            present = _present(store, algo, ids, sizes)
            missing = [x for x, p in zip(ids, present, strict=True) if not p]
            result.present = len(ids) - len(missing)
            if missing:
                _store_objects(
                    store, gitdir, algo, missing, len(missing) == len(ids), result, progress, held
                )
        if not _check_format(app, repo_id, fmt):
            try:
                app.refs.create_repo(repo_id, fmt)
            except Exists:  # created meanwhile
                _check_format(app, repo_id, fmt)
        _import_refs(app, gitdir, repo_id, result)
    finally:
        held.release()
    return result


def _check_format(app: Alkfs, repo_id: str, fmt: str) -> bool:
    """Whether the repository exists; Invalid if it has another object format."""
    try:
        repo = app.refs.repo(repo_id)
    except Missing:
        return False
    if repo.object_format != fmt:
        raise Invalid(f"repository {repo_id!r} is {repo.object_format}, the source is {fmt}")
    return True


def _store_objects(
    store: Store,
    gitdir: str,
    algo: Algorithm,
    missing: list[bytes],
    everything: bool,
    result: ImportResult,
    progress: bool | None,
    held: Batch,
) -> None:
    args = ["git", f"--git-dir={gitdir}", "cat-file", "--batch"]
    if everything:
        args += ["--batch-all-objects", "--unordered"]
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL if everything else subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=1 << 20,
    )
    feeder = None
    if not everything:
        assert proc.stdin is not None
        stdin = proc.stdin

        def feed() -> None:
            try:
                stdin.write(b"".join(x.hex().encode() + b"\n" for x in missing))
            except BrokenPipeError:
                pass
            finally:
                stdin.close()

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
    bar = _progress(progress, len(missing), "objects")
    wanted = set(missing)
    prefix = bytes([algo.value])
    assert proc.stdout is not None
    out = proc.stdout
    pending: list[tuple[bytes, Algorithm, Key | bytes | None]] = []
    pending_bytes = 0
    received = 0

    # Puts run on one long-lived writer thread (sqlite releases the GIL while it works),
    # overlapping with the parsing here; at most MAX_INFLIGHT batches are in flight.
    inflight: collections.deque[tuple[list, concurrent.futures.Future]] = collections.deque()

    def collect() -> None:
        nonlocal received
        batch, future = inflight.popleft()
        for (data, _, _), r in zip(batch, future.result(), strict=True):
            held.add(r.pin)  # kept until the refs commit
            if r.created:
                result.stored += 1
                result.bytes += len(data)
            received += 1
        if bar is not None:
            bar.update(len(batch))

    def flush() -> None:
        nonlocal pending, pending_bytes
        while len(inflight) >= MAX_INFLIGHT:
            collect()
        inflight.append((pending, _writer().submit(_put, store, pending)))
        pending = []
        pending_bytes = 0

    try:
        while line := out.readline():
            oid, kind, size = line.split()
            if size == b"missing" or kind == b"missing":
                raise Missing(f"the source lost object {oid.decode()}")
            n = int(size)
            body = out.read(n)
            out.read(1)
            raw = bytes.fromhex(oid.decode())
            if raw not in wanted:
                raise Verification(f"git sent an object that was not asked for: {oid.decode()}")
            data = b"%s %d\0%s" % (kind, n, body)
            pending.append((data, algo, prefix + raw))  # verified against its id
            pending_bytes += len(data)
            if len(pending) >= PUT_BATCH_ITEMS or pending_bytes >= PUT_BATCH_BYTES:
                flush()
        if pending:
            flush()
        while inflight:
            collect()
    finally:
        while inflight:  # after a failure: wait for the writer, release what it pinned
            batch, future = inflight.popleft()
            try:
                for r in future.result():
                    r.pin.release()
            except Exception:
                pass
        if bar is not None:
            bar.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if feeder is not None:
            feeder.join()
        out.close()
        assert proc.stderr is not None
        err = proc.stderr.read().decode(errors="replace")
        proc.stderr.close()
    if received != len(missing):
        raise StoreIO(f"git cat-file gave {received} of {len(missing)} objects {err}".strip())


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
