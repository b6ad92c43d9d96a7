"""The refs' closure computed by git, in bounded memory: the sweep's mark at any size.

`git_closure(store, algo, tips)` runs `git rev-list --objects --missing=print` from the
tips over the published derived set of the format (its packs, multi-pack-index and
commit-graph: git's own fast walk) plus, as loose objects of a private object directory,
the objects the set does not hold: those stored since it was built, those it left out or
withheld (recorded in its alkfs.json; on PostgreSQL, where no record is trusted, a scan of
the format's keys), and the non-blob objects of the large tier (the large tier's blobs
stay out: git reports them missing, and they are live as named). Its output goes through
`sort -u` (bounded memory, spilling to disk) into a `SortedKeys`: ~21 bytes a live object
in Python, whatever the history's size, where a walk in Python holds every tree.

The result is exactly the walk's closure (alkfs/git/closure.py) where git can give it:
gitlinks are not followed, a tag's target is, and an object no one holds is in the result
as named (a `?` line) and counted missing. It is None — the caller walks in Python — when
the answer could be short of the truth or the work too large:

- no derived set of the format, or more than LOOSE_MAX objects outside it;
- git fails (git 2.39 stops at a missing or unreadable commit: "Failed to traverse
  parents"; a pack that went away while it ran);
- git calls missing an object the store holds that is not a blob (the objects below it
  were not walked).

The store's stop (SIGTERM, unmount) kills git and raises Interrupted, as a build does.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import AlkfsError, Interrupted
from ..keys import Algorithm, Key
from ..keyset import SortedKeys
from ..tiers.sql import SqlTier
from .gitenv import git_env, kill_group
from .objects import MAX_HEADER, parse_header
from .packs import DERIVED_DIR, Derived, Generation, derived_for

if TYPE_CHECKING:
    from ..store import Store

log = logging.getLogger("alkfs.mark")

LOOSE_MAX = 200_000  # objects outside the published set written loose for git, at most
SORT_MEMORY = "64M"  # sort's buffer; the rest spills to its temporary files
STOP_POLL_S = 0.25
_FMT = {Algorithm.GIT_SHA1: "sha1", Algorithm.GIT_SHA256: "sha256"}


class _Unusable(Exception):
    """git's answer cannot be trusted to be whole: walk in Python instead."""


def git_closure(
    store: Store, algo: Algorithm, tips: Iterable[bytes]
) -> tuple[SortedKeys, set[bytes], int] | None:
    """(the closure's keys git listed, the keys named but held by no pack or loose file
    git saw, how many of those the store does not hold) from these tip digests; None
    when git's answer cannot be had or trusted (see the module docstring)."""
    fmt = _FMT.get(algo)
    if fmt is None or store.path is None or not isinstance(store.kv, SqlTier):
        return None
    if not (store.path / DERIVED_DIR / fmt).is_dir():
        return None
    d = derived_for(store, fmt)
    if d is None:
        return None
    d.refresh()
    gen = d.current()
    if gen is None or gen.objects == 0:
        return None
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="tmp-mark-", dir=d.root) as tmp:
            result = _run(store, d, gen, algo, list(tips), Path(tmp))
    except _Unusable as exc:
        log.info("mark %s: walking in Python: %s", fmt, exc)
        return None
    except OSError as exc:  # (a full disk for the loose objects, no git)
        log.warning("mark %s: git could not run (%s): walking in Python", fmt, exc)
        return None
    keys, named, missing = result
    log.info(
        "mark %s: %d objects live by git rev-list over generation %d in %.1f s",
        fmt,
        len(keys) + len(named),
        gen.number,
        time.monotonic() - t0,
    )
    return result


def _outside(store: Store, d: Derived, gen: Generation) -> list[bytes]:
    """Digests of the format's kv objects the set does not hold."""
    left = d.left_out(gen)
    withheld = gen.withheld()
    if left is None or withheld is None:  # (no record: every key of the format is looked at)
        kv = store.kv
        assert isinstance(kv, SqlTier)
        lo, hi = bytes([d.algo.value]), bytes([d.algo.value + 1])
        out = []
        for n, key in enumerate(kv.arrived(lo, hi, 0)):
            store.check_stopping(n)
            if key[1:] not in gen:
                out.append(key[1:])
                if len(out) > LOOSE_MAX:
                    break
        return out
    after = int(gen.meta.get("max_rowid", 0))
    return list(dict.fromkeys([*d.arrived(after), *left, *withheld]))


def _large_objects(store: Store, algo: Algorithm) -> tuple[set[bytes], list[tuple[bytes, bytes]]]:
    """The format's large-tier objects: (the blobs' digests, (digest, verified bytes) of
    the others, to be written loose)."""
    blobs: set[bytes] = set()
    others: list[tuple[bytes, bytes]] = []
    if store.large is None:
        return blobs, others
    tag = algo.value
    for n, raw in enumerate(store.large.iter_keys()):
        store.check_stopping(n)
        if raw[0] != tag:
            continue
        path = store.large_path(Key(raw))
        if path is None:
            continue
        try:
            with open(path, "rb") as f:
                kind, _size, _hlen = parse_header(f.read(MAX_HEADER))
        except (OSError, AlkfsError):
            continue  # (gone or unreadable: git reports it missing; checked there)
        if kind == "blob":
            blobs.add(raw[1:])
            continue
        try:
            data = store.get(Key(raw))
        except AlkfsError:
            data = None
        if data is not None:
            others.append((raw[1:], data))
    return blobs, others


def _run(
    store: Store, d: Derived, gen: Generation, algo: Algorithm, tips: list[bytes], tmp: Path
) -> tuple[SortedKeys, set[bytes], int]:
    repo = tmp / "repo"
    objdir = repo / "objects"
    (objdir / "info").mkdir(parents=True)
    (objdir / "pack").mkdir()
    (repo / "refs").mkdir()
    (repo / "HEAD").write_text("ref: refs/heads/main\n")
    config = "[core]\n\trepositoryformatversion = 1\n\tbare = true\n\tcommitGraph = true\n"
    config += f"[extensions]\n\tobjectFormat = {d.fmt}\n"
    (repo / "config").write_text(config)
    (objdir / "info" / "alternates").write_text(f"{gen.root}\n")

    outside = _outside(store, d, gen)
    if len(outside) > LOOSE_MAX:
        raise _Unusable(f"more than {LOOSE_MAX:,} objects are not in the published set")
    prefix = bytes([algo.value])
    loose: set[bytes] = set()

    def written(items: Iterable[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, bytes]]:
        for digest, data in items:
            loose.add(digest)
            yield digest, data

    # the kv's verified (a corrupt one is left out: missing to git), then the large tier's
    d._write_loose(objdir, written(d._read_many(outside)))
    large_blobs, large_others = _large_objects(store, algo)
    d._write_loose(objdir, written(large_others))

    # tips git would refuse (`fatal: bad object`): held by nothing it can see
    given: list[bytes] = []
    absent: set[bytes] = set()
    blob_tips: set[bytes] = set()
    for x in dict.fromkeys(tips):
        if x in gen or x in loose:
            given.append(x)
        elif x in large_blobs:
            blob_tips.add(prefix + x)  # (a ref to a large blob: live as named)
        else:
            absent.add(x)
    tips_file = tmp / "tips"
    tips_file.write_text("".join(x.hex() + "\n" for x in given))
    out_file, err_file = tmp / "live", tmp / "err"
    # (git's caches bounded: by default it keeps up to 96 MiB of delta bases and maps
    # whole pack windows of 1 GiB, whose pages it touches count in its RSS; at 944k
    # objects these limits took its peak from 540 to 176 MB at the same time)
    git = (
        "git -c core.fsync=none -c gc.auto=0 -c core.deltaBaseCacheLimit=16m"
        " -c core.packedGitWindowSize=16m -c core.packedGitLimit=64m"
        " rev-list --objects --no-object-names"
    )
    git += " --missing=print --stdin"
    if shutil.which("nice"):
        git = "nice -n 10 " + git
    q = shlex.quote
    script = (
        f"set -o pipefail; {git} < {q(str(tips_file))} 2> {q(str(err_file))}"
        f" | LC_ALL=C sort -u -S {SORT_MEMORY} -T {q(str(tmp))} > {q(str(out_file))}"
    )
    env = git_env(repo, LC_ALL="C")
    if given:
        proc = subprocess.Popen(
            ["bash", "-c", script], stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        while True:
            try:
                rc = proc.wait(timeout=STOP_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if store.stopping.is_set():
                    kill_group(proc)
                    raise Interrupted(
                        "the mark's git rev-list stopped: the store is closing"
                    ) from None
            except BaseException:  # (the caller ends: a signal's exception, say)
                kill_group(proc)
                raise
        if rc != 0:
            err = err_file.read_text(errors="replace").strip()[-300:]
            raise _Unusable(f"git rev-list failed ({rc}): {err}")
    else:
        out_file.write_bytes(b"")

    builder = SortedKeys.Builder(1 + algo.digest_len)
    named: set[bytes] = set()  # (`?` lines: named, held by nothing git saw)
    with open(out_file, "rb") as f:
        for n, line in enumerate(f):
            store.check_stopping(n)
            text = line.rstrip(b"\n")
            if text.startswith(b"?"):
                named.add(prefix + bytes.fromhex(text[1:].decode()))
            else:
                builder.add(prefix + bytes.fromhex(text.decode()))
    missing = 0
    for raw in list(named):
        digest = raw[1:]
        if digest in large_blobs:
            continue
        if not store.has_raw(raw):
            missing += 1  # (no one holds it: live as named, as the walk counts it)
            continue
        try:
            data = store.get(Key(raw))
        except AlkfsError:
            data = None
        if data is None or not data.startswith(b"blob "):
            raise _Unusable(f"git did not read {Key(raw)}, which the store holds")
    for x in absent:
        raw = prefix + x
        if store.has_raw(raw):
            raise _Unusable(f"the tip {Key(raw)} is stored but not where git looks")
        named.add(raw)
        missing += 1
    return builder.done(), named | blob_tips, missing
