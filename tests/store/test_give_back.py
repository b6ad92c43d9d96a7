"""The space a sweep's deletions free goes back to the filesystem: a new sqlite file gives
its free pages back after the sweep (auto_vacuum = INCREMENTAL, `give_back`); a file made
before that keeps them for new rows until `alkfs compact` rewrites it."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from alkfs.app import Alkfs

N, SIZE = 1500, 20_000  # 30 MB of small objects, all in the sqlite file


def fill_and_collect(store: Path) -> tuple[int, int, dict]:
    """Put N unpinned objects, then two sweeps with window 0: (file size with them, after
    the sweeps, the status's disk figures)."""
    with Alkfs.open(store, window_s=0) as app:
        for i in range(N):
            app.store.add(os.urandom(SIZE - 8) + i.to_bytes(8, "big"))
        app.store.db.reclaim()
        full = (store / "store.db").stat().st_size
        first = app.store.sweep(0)
        second = app.store.sweep(0)
        assert (first.candidates_staged, second.deleted) == (N, N)
        after = (store / "store.db").stat().st_size
        disk = app.status()["disk"]
    return full, after, disk


def test_a_sweeps_deletions_give_the_sqlite_files_pages_back(tmp_path):
    full, after, disk = fill_and_collect(tmp_path / "store")
    assert full > N * SIZE
    assert after < full // 10, (full, after)
    assert disk["database_free"] < 1 << 20 and disk["database"] < full // 10


def test_a_file_made_before_auto_vacuum_shrinks_with_compact(tmp_path):
    store = tmp_path / "store"
    Alkfs.open(store, window_s=0).close()
    with sqlite3.connect(store / "store.db") as conn:  # as a store made before this release
        conn.execute("PRAGMA auto_vacuum = NONE")
        conn.execute("VACUUM")
        assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
    full, after, disk = fill_and_collect(store)
    assert after > full * 0.9  # (its pages stay in the file, for new rows)
    assert disk["database_free"] > N * SIZE * 0.9
    alkfs = Path(sys.executable).parent / "alkfs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALKFS_")}
    done = subprocess.run(
        [str(alkfs), "--store", str(store), "compact"], capture_output=True, env=env, check=False
    )
    assert (done.returncode, done.stderr) == (0, b"")
    assert done.stdout.decode().startswith(f"compacted {store / 'store.db'}: ")
    assert (store / "store.db").stat().st_size < full // 10
    with sqlite3.connect(store / "store.db") as conn:
        assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # from now on: incremental
    with Alkfs.open(store, window_s=0) as app:
        assert app.store.verify() == []
