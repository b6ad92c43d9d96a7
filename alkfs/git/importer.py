"""Import a git repository: its objects, then all its refs in one atomic CAS batch.

Where the packs are the store's copy of git objects, the objects go in as git's own
pack (import_pack.py). Otherwise (a fleet, ALKFS_DRAIN=0), as follows (a fleet then drains what it
packed: packs/drain.py): objects come
from `git cat-file --batch`, each verified against its id as it is
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
import fcntl
import itertools
import os
import subprocess
import threading
from typing import TYPE_CHECKING

from ..errors import Invalid, Missing, StoreIO, Verification
from ..keys import Algorithm, Key
from ..tiers.sql import SqlTier
from .connected import check_connected
from .import_pack import derived_of, import_as_pack
from .importing import (
    ImportResult,
    _check_format,
    _git,
    _phase,
    _progress,
    media_and_refs,
    object_format,
    resolve_gitdir,
)
from .objects import MAX_HEADER
from .refs import algo_of, valid_repo_id

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..app import Alkfs
    from ..gc.arbiter import Pin
    from ..store import Store

PUT_BATCH_ITEMS = 8192
PUT_BATCH_BYTES = 16 << 20
MAX_INFLIGHT = 2
SAMPLE = 256  # ids looked up first: none present means a first import
READ = 1 << 20  # bytes a read of git's pipe
PIPE_SIZE = 1 << 20  # git's pipe, enlarged where the system allows
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


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
    derived = derived_of(store, fmt)
    if derived is not None and derived.can_adopt():
        return import_as_pack(app, derived, gitdir, repo_id, fmt, progress)
    prefix = bytes([algo.value])

    # git starts streaming every object at once, and the parsing with it, while the ids
    # are listed and sampled (on another thread); a first import goes on with the stream,
    # otherwise it is stopped before anything of it was stored
    stream: subprocess.Popen[bytes] | None = _cat_file(gitdir, True)
    lister: threading.Thread | None = None
    pinned: list[list[bytes]] = []  # keys pinned by this import, released once the refs commit
    held: list[Pin] = []  # the pins of the LFS media it stored, likewise
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
        media_and_refs(app, gitdir, repo_id, fmt, result, held, progress)
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


def _pack(store: Store, fmt: str) -> None:
    """Leave the imported objects packed (derived packs: alkfs/git/packs/), and kept in
    their packs alone (drain.py). A failed build is logged: the objects are in the store
    and served loose meanwhile."""
    derived = derived_of(store, fmt)
    if derived is None:
        return
    try:
        derived.build(prune=True)
        derived.drain()  # (what the set holds is kept there alone)
    except (StoreIO, OSError) as exc:
        store.log.error("import: the derived packs were not rebuilt: %s", exc)


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
