"""`Store.backfill`: the database's log written into its file beside the commits (the
write-behind runs it every BACKFILL_COMMITS small puts it applies: alkfs/writebehind.py)."""

from __future__ import annotations

import os

import pysqlite3.dbapi2 as sqlite3

from alkfs.store import DB_NAME

from .conftest import open_column


def test_a_backfill_writes_the_log_into_the_file_while_a_writer_holds_the_lock(tmp_path):
    """A PASSIVE checkpoint: the pages the commits left in the WAL reach the database file,
    and a writer holding sqlite's write lock meanwhile is not waited for."""
    col = open_column("kv-only", tmp_path, threshold=1 << 17)
    try:
        store = col.store
        store.put(b"the first put looks at the disk\n").pin.release()
        with store.tx():  # (one transaction: no autocheckpoint copies them meanwhile)
            for i in range(200):
                store.put(os.urandom(3000) + b"%d" % i).pin.release()
        path = col.root / DB_NAME
        before = os.path.getsize(path)
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            store.db.backfill()
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert os.path.getsize(path) >= before + 200 * 3000
        assert store.counts()["sha256"]["count"] == 201
    finally:
        col.store.close()
