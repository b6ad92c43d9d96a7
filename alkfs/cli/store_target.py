"""`StoreTarget`: the library on a store directory no daemon holds, holding its lock."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ..errors import (
    Corrupt,
    Missing,
)
from ..keys import Algorithm, Key
from .show import CHUNK, Progress, iso, open_input, progress_bar, sweep_shown
from .target import ObjectFigures

if TYPE_CHECKING:
    from ..app import Status
    from ..gc.sweep import SweepFigures, SweepReport


class StoreTarget:
    """The library on a store directory, holding its lock."""

    def __init__(self, path: str, create: bool, database: str | None = None) -> None:
        from ..app import Alkfs, store_exists

        root = Path(path)
        if not create and not store_exists(root):
            raise Missing(f"no store at {root}")
        self.root = root
        self.app = Alkfs.open(root, database=database)
        self.store = self.app.store

    def close(self) -> None:
        self.app.close()

    def _stat(self, key: Key):
        st = self.store.stat(key)
        if st is None:
            raise Missing(f"{key}: no such object")
        return st

    def put(self, path: str, algo: Algorithm, pin: str | None) -> Key:
        with open_input(path) as f:
            result = self.store.put(f, algo=algo)
        try:
            if pin is not None:
                self.app.pins.pin(pin, result.key)
        finally:
            result.pin.release()
        return result.key

    def get(self, key: Key, out: IO[bytes]) -> None:
        st = self._stat(key)
        if st.tier != "large":
            data = self.store.get(key)
            if data is None:
                raise Missing(f"{key}: no such object")
            out.write(data)
            return
        path = self.store.large_path(key)
        assert path is not None
        try:
            self.store.verify_file(key, path)  # streams the hash; Corrupt on a mismatch
            with open(path, "rb") as f:
                if not self.store.is_verified(key, os.fstat(f.fileno())):
                    raise Corrupt(f"{key}: the file changed while it was read")
                shutil.copyfileobj(f, out, CHUNK)
        except FileNotFoundError:
            raise Missing(f"{key}: no such object") from None

    def stat(self, key: Key) -> ObjectFigures:
        st = self._stat(key)
        return {
            "key": str(key),
            "algorithm": key.algo.label,
            "size": st.size,
            "tier": st.tier,
            "stored_at": iso(st.stored_ns),
            "pins": sorted(self.app.pins.names_for(key)),
        }

    def pin(self, name: str, key: Key) -> None:
        self._stat(key)
        self.app.pins.pin(name, key)

    def unpin(self, name: str) -> Key:
        rec = self.app.pins.get(name)
        if rec is None:
            raise Missing(f"no pin {name!r}")
        self.app.pins.unpin(name)
        return rec.key

    def pins(self) -> list[tuple[str, Key]]:
        return sorted((p.name, p.key) for p in self.app.pins.list())

    def roots_add(self, name: str, path: str) -> None:
        self.app.roots.add(name, path)

    def roots_rm(self, name: str) -> None:
        self.app.roots.remove(name)

    def roots(self) -> list[tuple[str, str]]:
        return [(r.name, r.path) for r in self.app.roots.list()]

    def repo_create(self, repo_id: str, object_format: str) -> None:
        self.app.refs.create_repo(repo_id, object_format)

    def repo_rm(self, repo_id: str) -> None:
        self.app.refs.delete_repo(repo_id)

    def repo_list(self) -> list[tuple[str, str]]:
        return sorted((r.id, r.object_format) for r in self.app.refs.repos())

    def git_import(self, gitdir: str, repo_id: str) -> str:
        from ..git.importer import import_repo

        r = import_repo(self.app, gitdir, repo_id)  # its own progress bar, on a terminal only
        return r.summary()

    def sweep(self, window_s: float | None, expire_now: bool = False) -> SweepFigures:
        with Progress("sweep") as shown:

            def progress(phase: str, report: SweepReport) -> None:
                line = sweep_shown(self.store.sweep_progress)
                if line is not None:
                    shown.show(*line)

            report = self.store.sweep(
                window_s,
                expire_now=expire_now,
                progress=progress if shown.bar is not None else None,
            )
        return report.to_dict()

    def dry_run(self) -> dict[str, object]:
        from ..gc.sweep import dry_run

        with Progress("sweep --dry-run"):
            return dry_run(self.store)

    def staged(self) -> Iterator[str]:
        from ..gc import staged

        return staged.lines(self.store)

    def verify(self) -> tuple[list[str], int]:
        total = sum(c["count"] for c in self.store.counts().values())
        seen = 0

        def progress(n: int) -> None:
            nonlocal seen
            seen += 1
            bar.update(n - bar.n)

        with progress_bar("verify", total) as bar:
            bad = self.store.verify(progress=progress)
        return [str(k) for k in bad], seen

    def status(self) -> Status:
        return self.app.status()
