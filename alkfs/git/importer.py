"""Import a git repository: its objects, then all its refs in one atomic CAS batch.

Objects come from `git cat-file --batch`, each verified against its id as it is
stored. Objects already in the store are skipped, so a rerun reads no content.
Every object of the source stays pinned (in-process) from before it is looked up
or stored until the refs that reach it have committed, so a sweep running during
the import can never delete what the new refs will reference.

The stream is parsed from large reads of git's pipe; each batch is hashed by the
store (`Store.digest_git`) on this thread, compared with the ids git named, and
written by one writer thread (sqlite releases the GIL while it inserts), so git,
the parsing and hashing, and sqlite run at once.
"""

from __future__ import annotations

import binascii
import collections
import concurrent.futures
import contextlib
import fcntl
import itertools
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import Exists, Invalid, Missing, Refused, Stale, StoreIO, Verification
from ..keys import Algorithm, Key
from ..tiers.sql import SqlTier
from . import lfs
from .connected import check_connected
from .objects import FORMATS, MAX_HEADER
from .refs import Outcome, RefUpdate, algo_of, valid_ref_name, valid_repo_id

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from ..app import Alkfs
    from ..store import Store
    from .packs import Derived

PUT_BATCH_ITEMS = 8192
PUT_BATCH_BYTES = 16 << 20
MAX_INFLIGHT = 2
SAMPLE = 256  # ids looked up first: none present means a first import
READ = 1 << 20  # bytes a read of git's pipe
PIPE_SIZE = 1 << 20  # git's pipe, enlarged where the system allows
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
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


def _prepare(store: Store) -> None:
    """The writer thread's own sqlite connection, opened and given the import's pragmas
    (once a connection: each statement hands the GIL back and forth with the parser): a
    page cache large enough to keep the key index warm across a whole import, and a
    checkpoint every WRITER_CHECKPOINT_PAGES of WAL (synchronous stays NORMAL). At
    sqlite's default 1000 every batch's commit checkpoints, recopying the whole key
    index each time; with no checkpoint until the end, the next commit (the main
    thread's, the refs) copies the whole import at once, serially (about 90 ms here).
    In between, they happen here, while the main thread parses the next batch."""
    if store.db is not None:
        store.db.tune_bulk_writer()


def _put(store: Store, batch: Store.Digested) -> list[bool]:
    """put_digested on the writer thread."""
    _prepare(store)
    return store.put_digested(batch)


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


def _present(
    store: Store, raws: list[bytes], sizes: Callable[[list[int]], list[int]] | None = None
) -> list[bool]:
    """Which keys (raw) the store holds: batched kv lookups, then the large tier for those
    the kv lacks that `sizes` (of the indexes the kv lacks) says are large; without
    `sizes`, the kv only."""
    kv = store.kv
    if not isinstance(kv, SqlTier):
        return [store.has(Key(raw)) for raw in raws]
    have = kv.present(raws)
    out = [raw in have for raw in raws]
    large = store.large
    rest = [i for i, p in enumerate(out) if not p]
    if large is not None and sizes is not None and rest:
        over = store.threshold - MAX_HEADER
        for i, size in zip(rest, sizes(rest), strict=True):
            if size > over:
                out[i] = large.stat(raws[i]) is not None
    packed = store.packed
    if packed is not None:  # (kept in their packs alone: alkfs/git/packs/drain.py)
        for i in [i for i, p in enumerate(out) if not p]:
            out[i] = packed.holds(raws[i])
    return out


def _sizes(gitdir: str, hexes: list[bytes]) -> list[int]:
    """The sizes of these objects (hex ids), in order."""
    proc = subprocess.run(
        ["git", f"--git-dir={gitdir}", "cat-file", "--batch-check=%(objectsize)", "--buffer"],
        input=b"\n".join(hexes) + b"\n",
        capture_output=True,
        check=False,
    )
    out = proc.stdout.split(b"\n")[: len(hexes)]
    try:
        return [int(x) for x in out]
    except ValueError:
        bad = next(h for h, x in zip(hexes, out, strict=False) if not x.isdigit())
        raise Missing(f"the source lost object {bad.decode(errors='replace')}") from None


def _progress(progress: bool | None, total: int | None, desc: str, **kw: Any):
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
    with _phase(progress, "connectivity check"):
        check_connected(gitdir)  # as git's fetch does: a hole refuses the import
    algo = algo_of(fmt)
    store = app.store
    derived = _derived(store, fmt)
    if derived is not None and derived.can_adopt():
        return _import_as_pack(app, derived, gitdir, repo_id, fmt, progress)
    prefix = bytes([algo.value])

    # git starts streaming every object at once, and the parsing with it, while the ids
    # are listed and sampled (on another thread); a first import goes on with the stream,
    # otherwise it is stopped before anything of it was stored
    stream: subprocess.Popen[bytes] | None = _cat_file(gitdir, True)
    lister: threading.Thread | None = None
    pinned: list[list[bytes]] = []  # keys pinned by this import, released once the refs commit
    held: list[Any] = []  # the pins of the LFS media it stored, likewise
    result = ImportResult(repo_id, fmt, 0, 0, 0, 0)
    try:
        listing: concurrent.futures.Future[list[bytes]] = concurrent.futures.Future()

        def list_ids() -> None:
            # the ids only: their sizes cost git more than the ids, and only those the
            # kv lacks are needed (to look for them in the large tier)
            try:
                listing.set_result(
                    _git(
                        gitdir,
                        "cat-file",
                        "--batch-all-objects",
                        "--unordered",
                        "--batch-check=%(objectname)",
                    ).stdout.split()  # ids as git spells them (ascii hex)
                )
            except BaseException as exc:
                listing.set_exception(exc)

        lister = threading.Thread(target=list_ids, name="alkfs-import-ids", daemon=True)
        lister.start()
        first: list[bool] = []  # the decision, once made

        def first_import() -> list[bytes] | None:
            """The ids, if this is a first import: none of a sample of them is present."""
            hexes = listing.result()
            sample = [
                prefix + binascii.unhexlify(x) for x in hexes[:: max(1, len(hexes) // SAMPLE)]
            ]
            first.append(not any(_present(store, sample)))  # (the kv only: large objects are few)
            return hexes if first[0] else None

        proc, stream = stream, None
        assert proc is not None
        try:
            # A first import: store everything in git's own order. Whatever is present
            # after all is deduplicated (and freshened) by the put, which pins it too.
            _store_objects(
                store, proc, algo, first_import, True, result, progress, pinned, listing.done
            )
        except _NotFirst:
            pass
        hexes = listing.result()
        count = result.objects = len(hexes)
        if first[0]:
            result.present = count - result.stored
        else:
            # Pin every id, then look: nothing skipped can be deleted before the refs
            # commit (pinning an id that is missing is harmless; its put pins it too).
            raws = [prefix + x for x in map(binascii.unhexlify, hexes)]
            store.pin_raws(raws)
            pinned.append(raws)
            with _phase(progress, "objects: looking up what the store holds"):
                present = _present(
                    store, raws, lambda rest: _sizes(gitdir, [hexes[i] for i in rest])
                )
            missing = [x for x, p in zip(hexes, present, strict=True) if not p]
            result.present = count - len(missing)
            if missing:
                everything = len(missing) == count
                proc = _cat_file(gitdir, everything)
                _store_objects(store, proc, algo, missing, everything, result, progress, pinned)
        with _phase(progress, "LFS media"):
            n_stored, n_present, absent, media_pins = lfs.import_media(store, gitdir)
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
    finally:
        if stream is not None:
            _stop(stream)
        if lister is not None:
            lister.join()
        for raws in pinned:
            store.unpin_raws(raws)
        for pin in held:
            pin.release()
    with _phase(progress, "LFS pointers"):
        app.lfs.scan()  # (its pointers recorded now, not at the next sweep)
    with _phase(progress, "packs: building the derived packs"):
        _pack(store, fmt)
    return result


def _derived(store: Store, fmt: str) -> Derived | None:
    from .packs import derived_for

    return derived_for(store, fmt)


def _import_as_pack(
    app: Alkfs, derived: Derived, gitdir: str, repo_id: str, fmt: str, progress: bool | None
) -> ImportResult:
    """The import where the packs are the store's copy of git objects (drain.py): git
    packs what the published set lacks from the source's packs and checks it with
    `index-pack --strict` (packs/adopt.py); the pack joins the set, no object passes
    through the kv. Every id is pinned first, until the refs commit."""
    store = app.store
    prefix = bytes([algo_of(fmt).value])
    result = ImportResult(repo_id, fmt, 0, 0, 0, 0)
    with _phase(progress, "objects: listing"):
        hexes = _git(
            gitdir, "cat-file", "--batch-all-objects", "--unordered", "--batch-check=%(objectname)"
        ).stdout.split()
    raws = [prefix + x for x in map(binascii.unhexlify, hexes)]
    store.pin_raws(raws)
    held: list[Any] = []
    try:
        with _phase(progress, "objects: git packs and checks them"):
            result.stored, result.bytes = derived.adopt(gitdir, hexes)
        result.objects = len(hexes)
        result.present = result.objects - result.stored
        del hexes
        with _phase(progress, "LFS media"):
            pointers = lfs.source_pointers(gitdir)
            # (the pointer blobs' rows, as a put of them writes: they keep their media)
            app.lfs.record_pairs(
                [
                    (prefix + binascii.unhexlify(blob), lfs.SHA256_TAG + bytes.fromhex(media))
                    for media, blobs in pointers.items()
                    for blob in blobs
                ]
            )
            n_stored, n_present, absent, media_pins = lfs.import_media(store, gitdir, pointers)
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
    finally:
        store.unpin_raws(raws)
        for pin in held:
            pin.release()
    with _phase(progress, "packs: the kv's copies of what the set holds go"):
        try:
            derived.drain()
            derived.prune()
        except (StoreIO, OSError) as exc:
            store.log.error("import: the kv's copies of packed objects stay: %s", exc)
    return result


def _pack(store: Store, fmt: str) -> None:
    """Leave the imported objects packed (derived packs: alkfs/git/packs/), and kept in
    their packs alone (drain.py). A failed build is logged: the objects are in the store
    and served loose meanwhile."""
    from .packs import derived_for

    derived = derived_for(store, fmt)
    if derived is None:
        return
    try:
        derived.build(prune=True)
        derived.drain()  # (what the set holds is kept there alone)
    except (StoreIO, OSError) as exc:
        store.log.error("import: the derived packs were not rebuilt: %s", exc)


def _check_format(app: Alkfs, repo_id: str, fmt: str) -> bool:
    """Whether the repository exists; Invalid if it has another object format."""
    try:
        repo = app.refs.repo(repo_id)
    except Missing:
        return False
    if repo.object_format != fmt:
        raise Invalid(f"repository {repo_id!r} is {repo.object_format}, the source is {fmt}")
    return True


def _read_body(stdout, head: bytes, n: int) -> bytearray:
    """An object's n-byte body read to its end at once: `head` is its start, already
    read; the rest and the newline after it come from the pipe."""
    out = bytearray(n + 1)
    out[: len(head)] = head
    got = len(head)
    with memoryview(out) as view:
        while got <= n:
            k = stdout.readinto(view[got:])
            if not k:
                raise StoreIO(f"git cat-file ended inside an object ({got} of {n} bytes)")
            got += k
    if out[n] != 10:
        raise StoreIO("git cat-file framed an object badly")
    del out[n]
    return out


class _NotFirst(Exception):
    """Not a first import after all: the speculative stream of every object is dropped."""


def _cat_file(gitdir: str, everything: bool) -> subprocess.Popen[bytes]:
    """`git cat-file --batch`: every object (in pack order), or the ids given on stdin."""
    args = ["git", f"--git-dir={gitdir}", "cat-file", "--batch", "--buffer"]
    if everything:
        args += ["--batch-all-objects", "--unordered"]
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL if everything else subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
    )
    assert proc.stdout is not None
    try:
        fcntl.fcntl(proc.stdout.fileno(), F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:
        pass  # the default pipe size: more, smaller reads
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _store_objects(
    store: Store,
    proc: subprocess.Popen[bytes],
    algo: Algorithm,
    wanted_hex: list[bytes] | Callable[[], list[bytes] | None],
    everything: bool,
    result: ImportResult,
    progress: bool | None,
    pinned: list[list[bytes]],
    ready: Callable[[], bool] | None = None,
) -> None:
    """Stream the wanted objects (hex ids) out of `proc` (from `_cat_file`, which this
    stops) into the store; every key stored is added to `pinned` (pinned until the
    caller releases it). `wanted_hex` may be a function, called before the first
    batch is stored, or as soon as `ready()` says it would not wait: None from it
    stops the stream (_NotFirst) with nothing stored."""
    assert proc.stdout is not None
    stdout = proc.stdout
    fd = stdout.fileno()
    resolved: list[bytes] = []
    wanted: frozenset[bytes] = frozenset()
    bar = None
    pending_ids = callable(wanted_hex)  # the ids are not known yet

    def resolve() -> None:
        nonlocal resolved, wanted, bar, pending_ids
        got = wanted_hex() if callable(wanted_hex) else wanted_hex
        if got is None:
            raise _NotFirst
        resolved, wanted, pending_ids = got, frozenset(got), False
        bar = _progress(progress, len(resolved), "objects")

    if not pending_ids:
        resolve()
    feeder = None
    if not everything:
        assert proc.stdin is not None
        stdin = proc.stdin

        def feed() -> None:
            try:
                stdin.write(b"\n".join(resolved) + b"\n")
            except BrokenPipeError:
                pass
            finally:
                stdin.close()

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
    prefix = bytes([algo.value])
    unhex = binascii.unhexlify
    received = 0
    _writer().submit(_prepare, store)  # while the first batch is parsed

    # Puts run on one long-lived writer thread (sqlite releases the GIL while it works),
    # overlapping with the parsing and hashing here; at most MAX_INFLIGHT batches in flight.
    inflight: collections.deque[tuple[Store.Digested, concurrent.futures.Future]] = (
        collections.deque()
    )

    def collect() -> None:
        batch, future = inflight.popleft()
        created = future.result()
        pinned.append(list(batch.raws))  # kept until the refs commit
        result.stored += sum(created)
        result.bytes += sum(map(len, itertools.compress(batch.datas, created)))
        if bar is not None:
            bar.update(len(created))

    # the batch being parsed (reused: digest_git copies what it keeps)
    oids: list[bytes] = []
    kinds: list[bytes] = []
    bodies: list[bytes | bytearray] = []
    add_oid, add_kind, add_body = oids.append, kinds.append, bodies.append

    def flush() -> None:
        nonlocal received
        if pending_ids:
            resolve()
        if not wanted.issuperset(oids):
            extra = next(x for x in oids if x not in wanted)
            raise Verification(f"git sent an object that was not asked for: {extra.decode()}")
        batch = store.digest_git(algo, kinds, bodies)
        expected = [prefix + x for x in map(unhex, oids)]
        if list(batch.raws) != expected:
            oid, got = next(
                (o, r) for o, r, e in zip(oids, batch.raws, expected, strict=True) if r != e
            )
            raise Verification(f"git's object {oid.decode()} hashes to {got[1:].hex()}")
        received += len(oids)
        while len(inflight) >= MAX_INFLIGHT:
            collect()
        inflight.append((batch, _writer().submit(_put, store, batch)))
        del oids[:], kinds[:], bodies[:]

    def bad_header(line: bytes) -> Exception:
        if line.endswith(b" missing"):
            return Missing(f"the source lost object {line.split()[0].decode(errors='replace')}")
        return StoreIO(f"git cat-file sent a malformed header {line[:100]!r}")

    try:
        buf = b""
        pos = 0
        items, limit = PUT_BATCH_ITEMS, PUT_BATCH_BYTES
        left, room = items, limit  # what the current batch may still take
        while chunk := os.read(fd, READ):
            if pending_ids and ready is not None and ready():
                resolve()  # (not a first import: parse no further)
            buf = buf[pos:] + chunk if pos < len(buf) else chunk
            pos = 0
            size = len(buf)
            find = buf.find
            while (nl := find(b"\n", pos)) >= 0:
                try:
                    oid, kind, n = buf[pos:nl].split(b" ")
                    end = nl + 1 + int(n)
                except ValueError:
                    raise bad_header(buf[pos:nl]) from None
                if end >= size:
                    if end + 1 - size <= READ:
                        break  # the rest arrives with the next reads
                    # a large object: read to its end at once (not re-buffered read by read)
                    add_body(_read_body(stdout, buf[nl + 1 :], end - nl - 1))
                    buf, pos, size = b"", 0, 0
                else:
                    if buf[end] != 10:
                        raise StoreIO(f"git cat-file framed object {oid.decode()} badly")
                    add_body(buf[nl + 1 : end])
                    pos = end + 1
                add_oid(oid)
                add_kind(kind)
                left -= 1
                room -= end - nl
                if left <= 0 or room <= 0:
                    flush()
                    left, room = items, limit
                if not size:
                    break
        if pos < len(buf):
            raise StoreIO(f"git cat-file ended inside an object ({len(buf) - pos} bytes left)")
        if oids:
            flush()
        elif pending_ids:
            resolve()
        while inflight:
            collect()
    finally:
        while inflight:  # after a failure: wait for the writer, release what it pinned
            batch, future = inflight.popleft()
            try:
                future.result()
                store.unpin_raws(list(batch.raws))
            except Exception:
                pass  # a failed put released its own pins
        if bar is not None:
            bar.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if feeder is not None:
            feeder.join()
        assert proc.stderr is not None
        err = proc.stderr.read().decode(errors="replace")
        _stop(proc)
    if received != len(resolved):
        raise StoreIO(f"git cat-file gave {received} of {len(resolved)} objects {err}".strip())


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
