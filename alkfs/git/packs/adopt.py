"""Adopting a repository's objects as a pack: the import's path where the sets are the
store's copy of git objects (drain.py). git packs what the published set lacks straight
from the source's own packs (`pack-objects`, its deltas reused, as a fetch's server
does), `index-pack --strict` checks every object and every link as a fetch with
`transfer.fsckObjects` does, and the pack joins the published set beside its packs (hard
links) with a new multi-pack-index and a commit-graph layer of its commits. No object
goes through the kv, and Python never holds an object's bytes. A push's received pack
is kept the same way (`keep_pack`). Methods of `Derived` (builder.py), written here as
functions of it (as intake.py)."""

from __future__ import annotations

import binascii
import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ...errors import Interrupted, NoSpace, StoreIO, Verification
from ..gitenv import git_env, kill_group
from .drain import drain_enabled
from .sets import FORMATS, KEEP_TEXT, MAX_PACKS, STOP_POLL_S, PackIndex, _left_out_record

if TYPE_CHECKING:
    from .builder import BuildResult, Derived
    from .sets import Generation

log = logging.getLogger("alkfs.packs")

ERR_MAX = 64 << 10  # bytes of git's stderr kept (the end of it is shown)
# What `index-pack --strict` lets through: the oddities git's own fsck only warns about
# and old histories carry (zero-padded tree modes, a NUL in a commit message, an empty
# or full path name, a null id in a tree). Every other fsck finding refuses the import,
# the tree names git cannot check out safely (`.`, `..`, `.git`, .gitmodules) included.
STRICT = (
    "--strict=zeroPaddedFilemode=ignore,nulInCommit=ignore,emptyName=ignore,"
    "fullPathname=ignore,nullSha1=ignore"
)
# A push's objects: each checked (git fsck's errors refuse it, its warnings do not); their
# links were checked by the receive-pack that wrote the pack, through the mount, where
# the objects they name may still be loose (in the kv) and so not in any pack.
FSCK = "--fsck-objects"
# Objects a received pack holds for it to be kept as a pack (git's receive.unpackLimit:
# a smaller push arrives loose anyway, unless a user configured otherwise).
KEEP_MIN = 100


def can_adopt(self: Derived) -> bool:
    """Whether an import may keep its objects in a pack of their own: the sets are (or
    become) the only copy of what they hold (a store of one process, drained, whose
    published set reads)."""
    return self.shared is None and drain_enabled() and self.store.holds_lock and self.broken is None


def adopt(self: Derived, gitdir: str, hexes: Sequence[bytes]) -> tuple[int, int]:
    """Pack the objects of the repository at `gitdir` named by `hexes` (ascii hex ids,
    the caller holds their pins) that no main pack of the published set holds, check
    them with `index-pack --strict` (Verification: a broken object or link, nothing
    published), and publish the set with that pack beside its own. (objects packed,
    bytes of the pack)."""
    reserve = self.store.reserve
    if reserve is not None and reserve.full:
        raise NoSpace("the disk is full: nothing is imported until it is not")
    prev = self._current
    if prev is not None and prev.indexes:
        wanted = [x for x in hexes if not prev.main_holds(binascii.unhexlify(x))]
    else:
        wanted = list(hexes)
    if not wanted:
        return 0, 0
    self._make_root()
    tmp = self.root / f"tmp-{self._who}-adopt-{uuid.uuid4().hex[:8]}"
    try:
        repo = tmp / "repo"
        self._git(repo, "init", "-q", "--bare", f"--object-format={self.fmt}", str(repo))
        if prev is not None:  # (links to objects the set holds resolve there)
            (repo / "objects" / "info" / "alternates").write_text(f"{prev.root}\n")
        shallow = Path(gitdir, "shallow")
        if shallow.is_file():  # (a shallow clone: its boundary commits' parents are absent)
            shutil.copyfile(shallow, repo / "shallow")
        with tempfile.TemporaryFile(dir=repo) as listing:
            _recency_order(self, gitdir, prev, listing)
            listing.write(b"\n".join(wanted) + b"\n")  # (the rest: pack-objects skips repeats)
            listing.seek(0)
            name = _pack_and_index(self, gitdir, repo, listing, STRICT)
        pack_dir = repo / "objects" / "pack"
        idx = PackIndex(pack_dir / f"pack-{name}.idx", self.fmt)
        if idx.count != len(set(wanted)):
            raise StoreIO(
                f"derived {self.fmt}: the import's pack holds {idx.count} objects, "
                f"not the {len(set(wanted))} asked for"
            )
        size = (pack_dir / f"pack-{name}.pack").stat().st_size
        with self.lock:
            _publish_with(self, tmp, pack_dir, name, idx.count)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if unbalanced(self):
        self.build()  # (one pack of the set's objects, their deltas reused)
    return idx.count, size


def _recency_order(self: Derived, gitdir: str, prev: Generation | None, out: IO[bytes]) -> None:
    """Write the source's reachable objects the set lacks into `out` as `rev-list
    --objects --all` gives them: recency order, each with its path, as a fetch's server
    hands them to `pack-objects`. The pack is then laid out as git's own (commits
    together, each delta family together): git reads it as fast as a clone's. Listed in
    the source's pack order instead, a history written by fast-import is read 3-4 times
    slower (cat-file --batch-all-objects, log's first run: docs/performance.md). A
    missing object is left to index-pack's check; a rev-list that fails orders nothing."""
    held = prev.main_holds if prev is not None and prev.indexes else None
    hexlen = 2 * FORMATS[self.fmt].digest_len
    with tempfile.TemporaryFile() as err:
        lister = subprocess.Popen(
            ["git", "rev-list", "--objects", "--all", "--missing=allow-any"],
            stdout=subprocess.PIPE,
            stderr=err,
            env=git_env(gitdir),
            start_new_session=True,
        )
        assert lister.stdout is not None
        try:
            for n, line in enumerate(lister.stdout):
                if n % 65536 == 0:
                    self.store.check_stopping()
                if held is None or not held(binascii.unhexlify(line[:hexlen])):
                    out.write(line)
        except BaseException:
            kill_group(lister)
            raise
        lister.stdout.close()
        if lister.wait() != 0:
            err.seek(0)
            log.info(
                "derived %s: the import's objects go in the source's order (rev-list: %s)",
                self.fmt,
                err.read(500).decode(errors="replace").strip(),
            )


def keep_pack(
    self: Derived, pack: Path, before: Callable[[str, list[bytes]], None]
) -> tuple[int, int]:
    """Keep a pack git received (a push's: complete, since receive-pack's `index-pack
    --fix-thin` appended the bases it lacked) as a pack of the set: indexed anew here
    with `index-pack --fsck-objects` (every id from the bytes, every object checked;
    Verification: nothing published), then `before(gitdir, raw keys)` runs (the caller
    pins the objects and reads what it needs from the bare repository at `gitdir`), then
    the set is published with the pack beside its own, byte for byte as received, or,
    when the set's main packs already hold some of its objects, with a pack of the rest
    (`pack-objects` from it, its deltas reused). No consolidation runs here (the daemon's
    intake consolidates a set of more than MAX_PACKS packs). (objects published, bytes
    of their pack)."""
    reserve = self.store.reserve
    if reserve is not None and reserve.full:
        raise NoSpace("the disk is full: the pushed pack is not kept until it is not")
    self._make_root()
    tmp = self.root / f"tmp-{self._who}-keep-{uuid.uuid4().hex[:8]}"
    try:
        repo = tmp / "repo"
        self._git(repo, "init", "-q", "--bare", f"--object-format={self.fmt}", str(repo))
        with pack.open("rb") as received:
            name = _pack_and_index(self, None, repo, received, FSCK)
        pack_dir = repo / "objects" / "pack"
        idx = PackIndex(pack_dir / f"pack-{name}.idx", self.fmt)
        digests = list(idx.digests())
        tag = bytes([self.algo.value])
        before(str(repo), [tag + d for d in digests])
        prev = self._current
        wanted = digests if prev is None else [d for d in digests if not prev.main_holds(d)]
        if len(wanted) < len(digests):
            if not wanted:
                return 0, 0
            out = tmp / "rest"
            self._git(out, "init", "-q", "--bare", f"--object-format={self.fmt}", str(out))
            with tempfile.TemporaryFile(dir=tmp) as listing:
                listing.write(b"".join(binascii.hexlify(d) + b"\n" for d in wanted))
                listing.seek(0)
                name = _pack_and_index(self, str(repo), out, listing, FSCK)
            pack_dir = out / "objects" / "pack"
            idx = PackIndex(pack_dir / f"pack-{name}.idx", self.fmt)
            if idx.count != len(wanted):
                raise StoreIO(
                    f"derived {self.fmt}: the pushed pack's rest holds {idx.count} objects, "
                    f"not the {len(wanted)} asked for"
                )
        size = (pack_dir / f"pack-{name}.pack").stat().st_size
        with self.lock:
            _publish_with(self, tmp, pack_dir, name, idx.count, "keep")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return idx.count, size


def unbalanced(self: Derived) -> bool:
    """Whether the set's main packs call for a consolidation, by the intake's rule
    (geometric, factor 2): MAX_PACKS of them, or all but the largest holding more than
    half as many objects as it does."""
    gen = self._current
    if gen is None:
        return False
    counts = sorted(i.count for i in gen.indexes if i is not gen.staged_index)
    return len(counts) >= MAX_PACKS or 2 * sum(counts[:-1]) > counts[-1]


def _pack_and_index(
    self: Derived, gitdir: str | None, repo: Path, source: IO[bytes], check: str
) -> str:
    """`git index-pack <check> --stdin` in `repo` of the pack `git pack-objects --stdout`
    makes of the ids listed in `source` in the repository at `gitdir` — or, with no
    `gitdir`, of the pack `source` itself. Both gits in their own process groups, killed
    at the store's stop (Interrupted); the new pack's name."""
    with contextlib.ExitStack() as stack:
        errs = [stack.enter_context(tempfile.TemporaryFile(dir=repo)) for _ in range(2)]
        base = ["git", "-c", "core.fsync=none", "-c", "gc.auto=0"]
        t0 = time.monotonic()
        packer: subprocess.Popen[bytes] | None = None
        if gitdir is not None:
            packer = subprocess.Popen(
                [*base, "pack-objects", "--stdout", "-q", "--delta-base-offset"],
                stdin=source,
                stdout=subprocess.PIPE,
                stderr=errs[0],
                env=git_env(gitdir),
                start_new_session=True,
            )
            assert packer.stdout is not None
        try:
            indexer = subprocess.Popen(
                [*base, "index-pack", check, "--stdin"],
                stdin=source if packer is None else packer.stdout,
                stdout=subprocess.PIPE,
                stderr=errs[1],
                env=git_env(repo),
                start_new_session=True,
            )
        except BaseException:
            if packer is not None:
                kill_group(packer)
            raise
        finally:
            if packer is not None and packer.stdout is not None:
                packer.stdout.close()
        out = b""
        while True:
            try:
                out, _ = indexer.communicate(timeout=STOP_POLL_S)
                break
            except BaseException as exc:  # (a look at the stop, or the caller ends)
                stop = isinstance(exc, subprocess.TimeoutExpired)
                if stop and not self.store.stopping.is_set():
                    continue
                for proc in (packer, indexer):
                    if proc is not None:
                        kill_group(proc)
                if stop:
                    raise Interrupted("a pack's indexing stopped: the store is closing") from None
                raise
        if packer is not None:
            packer.wait()
        log.debug(
            "derived %s: pack-objects | index-pack took %.3f s", self.fmt, time.monotonic() - t0
        )
        texts = []
        for f in errs:
            f.seek(max(0, os.fstat(f.fileno()).st_size - ERR_MAX))
            text = f.read().decode(errors="replace").strip()[-500:]
            texts.append("; ".join(line.strip() for line in text.splitlines() if line.strip()))
        if any("No space left" in t for t in texts):
            raise NoSpace(f"the disk is full: a pack was not written ({texts[1]})")
        if indexer.returncode != 0:
            # (the packer dies of the closed pipe then: the indexer's words are the cause)
            flag = check.partition("=")[0]
            raise Verification(f"git index-pack {flag} refused the objects: {texts[1] or texts[0]}")
        if packer is not None and packer.returncode != 0:
            raise StoreIO(f"git pack-objects failed ({packer.returncode}): {texts[0]}")
    words = out.split()
    if len(words) != 2 or words[0] not in (b"pack", b"keep"):
        raise StoreIO(f"git index-pack said {out[:200]!r}")
    return words[1].decode()


def _publish_with(
    self: Derived, tmp: Path, pack_dir: Path, name: str, count: int, mode: str = "adopt"
) -> None:
    """Publish the published set's files (hard links) plus the pack `name` of `pack_dir`
    (under the set's lock), with a new multi-pack-index and a commit-graph layer of the
    pack's commits; the sets are the only copy of its objects from then on (PRIMARY,
    written first)."""
    prev = self._current
    number = self._next_number()
    out = tmp / "gen"
    (out / "pack").mkdir(parents=True)
    (out / "info").mkdir()
    linked: set[Path] = set()
    if prev is not None:
        for rel in prev.files:
            src, dst = prev.root / rel, out / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if rel == "pack/multi-pack-index":
                continue  # written anew below
            if rel.endswith("-chain"):
                shutil.copyfile(src, dst)  # git replaces it: never share it
            else:
                os.link(src, dst)
                linked.add(dst)
    for suffix in (".pack", ".idx"):
        os.rename(pack_dir / f"pack-{name}{suffix}", out / "pack" / f"pack-{name}{suffix}")
    (out / "pack" / f"pack-{name}.keep").write_bytes(KEEP_TEXT)
    repo = tmp / "repo"
    self._git(repo, "multi-pack-index", "write", objdir=out)
    # (a layer of the pack's commits: git adds their ancestors no layer names)
    listing = f"pack-{name}.idx\n".encode()
    self._graph_layer(repo, out, "--stdin-packs", listing, "no layer for the imported pack")
    self._check(out, skip=linked)
    top, kept = 0, ""
    record: list[str] | None = []
    held: list[str] | None = []
    if prev is not None:
        top = int(prev.meta.get("max_rowid", 0))
        before = self.still_left_out(prev)
        record = None if before is None else _left_out_record(set(before))
        withheld = prev.withheld()
        held = None if withheld is None else _left_out_record(set(withheld))
        kept = "" if prev.staged_index is None else prev.staged_index.path.name
    objects = (0 if prev is None else prev.objects) + count
    self._make_primary()  # (before the set: its new pack is the only copy of its objects)
    result: BuildResult = self._finish(out, number, top, objects, mode, record, count, kept, held)
    self.last_build = result
    what = "imported" if mode == "adopt" else "pushed"
    log.info(
        "derived %s: kept a pack of %d %s objects (generation %d)", self.fmt, count, what, number
    )
