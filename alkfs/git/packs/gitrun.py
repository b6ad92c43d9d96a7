"""`Derived`'s methods that run git (in its own process group, killed when the store
stops) and write its input: undeltified raw packs and loose objects."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ...errors import Interrupted, StoreIO
from ..gitenv import git_env, kill_group
from .sets import STOP_POLL_S, TYPE_CODES, _hash

if TYPE_CHECKING:
    from ...store import Store

log = logging.getLogger("alkfs.packs")


class GitRun:
    """A mixin of `Derived` (builder.py): git and the files it is fed. Needs only the
    store (its stop) and the format."""

    store: Store
    fmt: str

    def _index_files(self, repo: Path, out: Path, graph: list[bytes], if_not: str) -> None:
        """The set's multi-pack-index, and a split commit-graph layer of `graph`'s
        commits (when it fails, `if_not` is logged: a set without a new layer is still
        whole; git reads those commits from the packs)."""
        self._git(repo, "multi-pack-index", "write", objdir=out)
        if graph:
            listing = b"".join(c.hex().encode() + b"\n" for c in graph)
            self._graph_layer(repo, out, "--stdin-commits", listing, if_not)
        else:
            self._graph_layer(repo, out, "", b"", if_not)

    def _graph_layer(self, repo: Path, out: Path, how: str, listing: bytes, if_not: str) -> None:
        """`git commit-graph write --split <how>` of `listing` into `out` (`how` empty:
        none written); when it fails, `if_not` is logged and the layers stay as they were.
        Stale locks are removed either way."""
        graphs = out / "info" / "commit-graphs"
        if how:
            had = set(os.listdir(graphs)) if graphs.is_dir() else None
            chain = graphs / "commit-graph-chain"
            chain_text = chain.read_bytes() if had and chain.name in had else None
            try:
                self._git(
                    repo,
                    "commit-graph",
                    "write",
                    "--split",
                    how,
                    "--no-progress",
                    objdir=out,
                    input=listing,
                )
            except StoreIO as exc:
                log.error("derived %s: %s: %s", self.fmt, if_not, exc)
                self._graphs_as_they_were(graphs, had, chain_text)
        if graphs.is_dir():
            for stale in graphs.glob("*.lock"):
                stale.unlink()

    @staticmethod
    def _graphs_as_they_were(graphs: Path, had: set[str] | None, chain: bytes | None) -> None:
        """After a failed `commit-graph write`: the layers as they were before it (what
        it left, a temporary graph file for one, would fail the set's check)."""
        if had is None:
            shutil.rmtree(graphs, ignore_errors=True)
            return
        for name in os.listdir(graphs):
            if name not in had:
                (graphs / name).unlink()
        path = graphs / "commit-graph-chain"
        if chain is not None and (not path.is_file() or path.read_bytes() != chain):
            path.write_bytes(chain)

    def _pack_objects(
        self, repo: Path, out: Path, order: Iterable[tuple[bytes, bytes]], *args: str
    ) -> str:
        """`git pack-objects` in `repo` of `order` ((digest, path) pairs, in git's input
        order: the paths give its deltas) into a new pack in out/pack; its idx's name."""
        listing = b"".join(d.hex().encode() + (b" " + p if p else b"") + b"\n" for d, p in order)
        name = self._git(
            repo,
            "pack-objects",
            "-q",
            "--delta-base-offset",
            *args,
            str(out / "pack" / "pack"),
            input=listing,
        )
        return f"pack-{name.decode().strip()}.idx"  # (git prints the pack's checksum)

    def _git(
        self,
        repo: Path,
        *args: str,
        objdir: Path | None = None,
        input: bytes | None = None,
    ) -> bytes:
        env = git_env(repo, objdir)
        cmd = ["git", "-c", "core.fsync=none", "-c", "gc.auto=0", *args]
        if shutil.which("nice"):
            cmd = ["nice", "-n", "10", *cmd]
        t0 = time.monotonic()
        # its own process group, looked at every STOP_POLL_S: when the store's owner
        # stops (SIGTERM, unmount), git and its children are killed and the build ends
        # Interrupted (what it left in tmp-* is removed at the next open). Its input is
        # read from an unlinked file, not a pipe: `communicate` cannot go on feeding a
        # pipe after a timeout (given the input again it raises ValueError; without it,
        # it never writes the rest), and pack-objects, fed every build's object list,
        # often outlasts one look.
        with contextlib.ExitStack() as stack:
            stdin: int | IO[bytes] = subprocess.DEVNULL
            if input is not None:
                where = repo if repo.is_dir() else None  # (on the store's disk: the build's)
                stdin = stack.enter_context(tempfile.TemporaryFile(dir=where))
                stdin.write(input)
                stdin.seek(0)
            proc = subprocess.Popen(
                cmd,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
        while True:
            try:
                out, err = proc.communicate(timeout=STOP_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if self.store.stopping.is_set():
                    kill_group(proc)
                    raise Interrupted(f"git {args[0]} stopped: the store is closing") from None
            except BaseException:  # (the caller ends: a signal's exception, say)
                kill_group(proc)
                raise
        log.debug("derived %s: git %s took %.3f s", self.fmt, args[0], time.monotonic() - t0)
        if proc.returncode != 0:
            raise StoreIO(
                f"git {args[0]} failed ({proc.returncode}): "
                + err.decode(errors="replace").strip()[-500:]
            )
        return out

    def _write_raw_pack(self, path: Path, items: Iterable[tuple[bytes, bytes]]) -> int:
        """An undeltified pack of (digest, canonical) items; returns the object count."""
        h = _hash(self.fmt)()
        n = 0
        with open(path, "wb") as f:
            f.write(b"PACK\x00\x00\x00\x02\x00\x00\x00\x00")  # count patched below
            for _d, data in items:
                nul = data.find(b"\0")
                kind = data[: data.find(b" ")]
                body = memoryview(data)[nul + 1 :]
                size = len(body)
                byte = (TYPE_CODES[kind] << 4) | (size & 0x0F)
                size >>= 4
                head = bytearray()
                while size:
                    head.append(byte | 0x80)
                    byte = size & 0x7F
                    size >>= 7
                head.append(byte)
                f.write(head)
                f.write(zlib.compress(body, 1))
                n += 1
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(n.to_bytes(4, "big"))
            f.seek(0)
            while chunk := f.read(1 << 20):
                h.update(chunk)
            f.write(h.digest())
        return n

    def _write_loose(self, objdir: Path, items: Iterable[tuple[bytes, bytes]]) -> int:
        n = 0
        made: set[str] = set()
        for d, data in items:
            self.store.check_stopping(n)
            hx = d.hex()
            sub = objdir / hx[:2]
            if hx[:2] not in made:
                sub.mkdir(exist_ok=True)
                made.add(hx[:2])
            (sub / hx[2:]).write_bytes(zlib.compress(data, 1))
            n += 1
        return n
