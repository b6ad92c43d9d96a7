"""A large object's catalog row (recorded size, a digest per 1 MiB chunk): ranged reads
check only the chunks they cover, stat shows the recorded size, and an object stored
before the catalog is verified whole at its first read, which records its row."""

from __future__ import annotations

import os
import time
from pathlib import Path

import blake3
import pytest

from alkfs.catalog import CHUNK_SIZE
from alkfs.errors import Corrupt
from alkfs.keys import Key
from alkfs.store import Store

from .conftest import oracle_connect, register

MIB = 1 << 20
SIZE = 5 * MIB
BAD_CHUNK = 2


@pytest.fixture
def store(tmp_path: Path):
    s = Store.open(tmp_path / "store", window_s=0)
    yield s
    s.close()


def content(size: int = SIZE) -> bytes:
    """Deterministic, and no two chunks alike (251 is prime: no chunk starts in phase)."""
    return (bytes(range(251)) * (size // 251 + 1))[:size]


def row(store: Store, key: Key) -> tuple | None:
    """The catalog row as a separate connection sees it (the medium oracle)."""
    conn = oracle_connect(store.path)
    try:
        return conn.execute(
            "SELECT size, chunk_size, chunk_algo, chunks, stored_ns FROM catalog WHERE key = ?",
            (key.raw,),
        ).fetchone()
    finally:
        conn.close()


def drop_row(store: Store, key: Key) -> None:
    """Make the object look stored before the catalog existed."""
    conn = oracle_connect(store.path)
    try:
        assert conn.execute("DELETE FROM catalog WHERE key = ?", (key.raw,)).rowcount == 1
    finally:
        conn.close()


def flip_byte(store: Store, key: Key, at: int) -> None:
    path = store.large_path(key)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x55]))
    os.chmod(path, 0o444)


def chunk_digests(data: bytes) -> bytes:
    return b"".join(
        blake3.blake3(data[i : i + CHUNK_SIZE]).digest() for i in range(0, len(data), CHUNK_SIZE)
    )


def test_a_large_put_records_its_size_and_a_blake3_digest_per_mib_chunk(store: Store) -> None:
    data = content(SIZE + 3)  # six chunks, the last of 3 bytes
    key = store.add(data)
    size, chunk_size, algo, chunks, stored_ns = row(store, key)
    assert (size, chunk_size, algo) == (SIZE + 3, MIB, 2)
    assert bytes(chunks) == chunk_digests(data)
    assert len(chunks) == 6 * 32
    assert stored_ns == store.stat(key).stored_ns
    # a streamed put of unknown length, in odd pieces, records the same row
    drop_row(store, key)
    store.delete(key)
    pieces = (data[i : i + 77_777] for i in range(0, len(data), 77_777))
    result = store.put(pieces)
    result.pin.release()
    assert result.key == key
    assert row(store, key)[:4] == (SIZE + 3, MIB, 2, chunks)


def test_a_small_object_gets_no_catalog_row(store: Store) -> None:
    key = store.add(b"small")
    assert row(store, key) is None


def test_a_changed_byte_fails_only_the_reads_of_its_chunk(store: Store) -> None:
    data = content()
    key = store.add(data)
    flip_byte(store, key, BAD_CHUNK * MIB + 12_345)
    for chunk in (0, 1, 3, 4):
        got, _ = store.read_range(key, chunk * MIB + 100, 4096)
        assert got == data[chunk * MIB + 100 : chunk * MIB + 4196]
    assert store.corrupt == set()
    for offset, length in ((BAD_CHUNK * MIB + 12_345, 1), (MIB + MIB // 2, MIB), (0, SIZE)):
        with pytest.raises(Corrupt):
            store.read_range(key, offset, length)
    assert store.corrupt == {key.raw}
    with pytest.raises(Corrupt):
        store.get(key)
    assert store.verify() == [key]
    # the chunks around it still serve, verified
    assert store.read_range(key, 4 * MIB, MIB)[0] == data[4 * MIB :]


def test_a_truncated_file_keeps_its_recorded_size_and_fails_the_missing_range(
    store: Store,
) -> None:
    data = content()
    key = store.add(data)
    os.truncate(store.large_path(key), 3 * MIB + 5)
    assert store.stat(key).size == SIZE
    assert [(s.key, s.size) for s in store.list()] == [(key, SIZE)]
    assert store.counts()["sha256"]["bytes"] == SIZE
    assert store.read_range(key, 0, 4096)[0] == data[:4096]
    assert store.corrupt == set()
    for offset in (3 * MIB, 4 * MIB + 7):
        with pytest.raises(Corrupt):
            store.read_range(key, offset, 10)
    assert store.corrupt == {key.raw}
    with pytest.raises(Corrupt):
        store.get(key)


def test_an_extended_file_keeps_its_recorded_size_and_fails_its_last_chunk(store: Store) -> None:
    data = content()
    key = store.add(data)
    path = store.large_path(key)
    os.chmod(path, 0o644)
    with open(path, "ab") as f:
        f.write(b"tail")
    assert store.stat(key).size == SIZE
    assert store.read_range(key, MIB, 100)[0] == data[MIB : MIB + 100]
    assert store.corrupt == set()
    with pytest.raises(Corrupt):
        store.read_range(key, SIZE - 10, 10)
    assert store.corrupt == {key.raw}
    with pytest.raises(Corrupt):
        store.get(key)
    assert store.verify() == [key]


def test_an_object_without_a_row_is_verified_whole_at_its_first_read_and_gets_its_row(
    store: Store, tmp_path: Path
) -> None:
    data = content()
    key = store.add(data)
    recorded = row(store, key)
    drop_row(store, key)
    store.close()
    with Store.open(tmp_path / "store", window_s=0) as again:  # nothing remembered
        assert again.stat(key).size == SIZE  # the file's size: all there is
        assert again.read_range(key, 10, 20)[0] == data[10:30]
        assert row(again, key)[:4] == recorded[:4]
        assert row(again, key)[4] == again.stat(key).stored_ns


def test_an_object_without_a_row_and_a_changed_chunk_fails_a_read_of_another_chunk(
    store: Store,
) -> None:
    data = content()
    key = store.add(data)
    drop_row(store, key)
    flip_byte(store, key, 4 * MIB + 1)
    with pytest.raises(Corrupt):
        store.read_range(key, 0, 4096)  # verified whole: the change is found
    assert store.corrupt == {key.raw}
    assert row(store, key) is None  # no row is recorded from bytes that do not hash


def test_verify_records_the_row_of_an_object_stored_before_the_catalog(store: Store) -> None:
    data = content()
    key = store.add(data)
    recorded = row(store, key)
    drop_row(store, key)
    assert store.verify() == []
    assert row(store, key)[:4] == recorded[:4]


def test_verify_corrects_a_row_that_does_not_match_the_verified_bytes(store: Store) -> None:
    data = content()
    key = store.add(data)
    recorded = row(store, key)
    conn = oracle_connect(store.path)
    try:
        conn.execute("UPDATE catalog SET chunks = ? WHERE key = ?", (bytes(5 * 32), key.raw))
    finally:
        conn.close()
    assert store.verify() == []
    assert row(store, key)[:4] == recorded[:4]
    assert store.read_range(key, 2 * MIB, 10)[0] == data[2 * MIB : 2 * MIB + 10]


def test_a_re_put_of_an_object_stored_before_the_catalog_records_its_row(store: Store) -> None:
    data = content()
    key = store.add(data)
    recorded = row(store, key)
    drop_row(store, key)
    result = store.put(data)
    result.pin.release()
    assert result.created is False
    assert row(store, key)[:4] == recorded[:4]


def test_the_sweep_deletes_the_row_with_the_object(store: Store) -> None:
    kept_data, dead_data = content(), content(3 * MIB + 1)[::-1]
    kept = store.add(kept_data)
    dead = store.add(dead_data)
    register(store, [kept])
    store.sweep()  # stages the dead one
    assert row(store, dead) is not None
    report = store.sweep()  # executes
    assert report.deleted == 1
    assert store.stat(dead) is None
    assert row(store, dead) is None
    assert row(store, kept) is not None
    conn = oracle_connect(store.path)
    try:
        assert conn.execute("SELECT count(*) FROM catalog").fetchone()[0] == 1
    finally:
        conn.close()


def test_a_row_left_without_its_file_is_inert_and_replaced_by_the_next_put(
    store: Store,
) -> None:
    """A crash between the row's commit and the link leaves a row without a file."""
    data = content()
    key = store.add(data)
    path = store.large_path(key)
    os.chmod(path, 0o644)
    os.unlink(path)
    assert store.stat(key) is None and store.has(key) is False
    assert store.get(key) is None
    result = store.put(data)
    result.pin.release()
    assert result.created is True
    assert store.read_range(key, 3 * MIB, 5)[0] == data[3 * MIB : 3 * MIB + 5]
    assert row(store, key)[0] == SIZE


@pytest.fixture(params=["dual-tier", "pg-dual-tier"])
def large_column(request: pytest.FixtureRequest, tmp_path: Path):
    from .conftest import _open

    col = _open(request, tmp_path)
    yield col
    col.store.close()


def test_a_row_whose_file_was_never_linked_is_removed_by_a_sweep_once_past_its_grace(
    large_column, monkeypatch
) -> None:
    """A large put cut short between its row's commit and its link leaves a row without a
    file: a sweep removes it once it is INERT_GRACE_NS old (not before), re-checked under
    its row lock; a row with its file, and a file without a row, stay."""
    from alkfs.store import INERT_GRACE_NS

    store = large_column.store
    kept = store.put(content(2 * MIB)).key
    cut = store.put(content(3 * MIB)).key
    young = store.put(content(3 * MIB + 7)).key
    rowless = store.put(content(2 * MIB + 5)).key
    for key in (kept, cut, young, rowless):
        assert store.pin(key) is not None  # (live: a sweep collects none of them)
    for key in (cut, young):  # the crash: their files never linked
        os.unlink(store.large_path(key))
    store.db.execute("DELETE FROM catalog WHERE key = ?", (rowless.raw,))
    base = time.time_ns() - 10 * INERT_GRACE_NS  # (stored times in the past)
    set_stored = "UPDATE catalog SET stored_ns = ? WHERE key = ?"
    store.db.execute(set_stored, (base, cut.raw))
    store.db.execute(set_stored, (base + 2 * 10**9, young.raw))
    now = base + INERT_GRACE_NS + 1
    assert store.reap_inert_rows(now) == 1
    assert store.record(cut) is None
    assert store.record(young) is not None and store.record(kept) is not None
    assert store.get(rowless) == content(2 * MIB + 5)  # (verified whole: its row again)
    assert store.get(kept) == content(2 * MIB)
    assert store.reap_inert_rows(now) == 0  # (looked at once)
    assert store.reap_inert_rows(now + 3 * 10**9) == 1  # the young one, past its grace now
    assert store.record(young) is None
    # a sweep reaps too (here with no grace)
    again = store.put(content(2 * MIB + 9)).key
    os.unlink(store.large_path(again))
    monkeypatch.setattr("alkfs.store.deletes.INERT_GRACE_NS", 0)
    register(store, [kept, cut, young, rowless, again])
    assert store.sweep().aborted is None
    assert store.record(again) is None and store.record(kept) is not None
