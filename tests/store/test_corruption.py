"""Bytes changed behind the store's back are never served: reads fail with Corrupt."""

from __future__ import annotations

import os

import pytest

from alkfs.errors import Corrupt, Verification
from alkfs.keys import Algorithm, Key

from .conftest import Column, oracle_connect, patterned


def assert_refused_as_corrupt(col: Column, key: Key, length: int) -> None:
    store = col.store
    with pytest.raises(Corrupt) as caught:
        store.get(key)
    assert type(caught.value) is Corrupt
    assert isinstance(caught.value, Verification)
    for offset, size in ((0, length), (0, 1), (length - 1, 1)):
        with pytest.raises(Corrupt):
            store.read_range(key, offset, size)
    assert key.raw in store.corrupt
    # Still known to exist (stat and has read no content), just never served.
    assert store.has(key) is True
    assert store.stat(key).size == length
    assert store.verify() == [key]


def edit_kv_row(col: Column, key: Key, value: bytes) -> None:
    """Rewrite the row's value through a separate connection to the store's database."""
    if col.database is not None:
        import psycopg

        with psycopg.connect(col.database) as pg:
            cur = pg.execute("UPDATE blobs SET value = %s WHERE key = %s", (value, key.raw))
            assert cur.rowcount == 1
        return
    conn = oracle_connect(col.root)
    try:
        conn.execute("UPDATE blobs SET value = ? WHERE key = ?", (value, key.raw))
        assert conn.total_changes == 1
    finally:
        conn.close()


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def test_a_kv_row_changed_behind_the_store_fails_every_read_with_corrupt(
    sqlite_column: Column,
) -> None:
    store = sqlite_column.store
    content = patterned(sqlite_column.threshold - 1, 211)
    key = store.add(content)
    assert store.get(key) == content  # served and verified once
    edit_kv_row(sqlite_column, key, flip(content, 500))
    assert_refused_as_corrupt(sqlite_column, key, len(content))


def test_a_truncated_kv_row_is_never_served(sqlite_column: Column) -> None:
    store = sqlite_column.store
    content = patterned(300, 199)
    key = store.add(content)
    edit_kv_row(sqlite_column, key, content[:-1])
    with pytest.raises(Corrupt):
        store.get(key)
    with pytest.raises(Corrupt):
        store.read_range(key, 0, 10)
    assert store.corrupt == {key.raw}


def edit_large_file(col: Column, key: Key, at: int, keep_times: bool) -> None:
    path = col.store.large_path(key)
    before = os.stat(path)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x80]))
    os.chmod(path, 0o444)
    if keep_times:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert after.st_size == before.st_size


@pytest.mark.parametrize("keep_times", [False, True], ids=["touched", "times-restored"])
def test_a_large_file_changed_on_disk_fails_every_read_with_corrupt(
    dual: Column, keep_times: bool
) -> None:
    store = dual.store
    content = patterned(5 * dual.threshold + 3, 223)
    key = store.add(content)
    # Served and verified first, so a remembered verification must not outlive the edit.
    assert store.get(key) == content
    assert store.read_range(key, 0, 8)[0] == content[:8]
    edit_large_file(dual, key, at=4 * dual.threshold, keep_times=keep_times)
    assert_refused_as_corrupt(dual, key, len(content))


def test_a_truncated_large_file_is_never_served(dual: Column) -> None:
    store = dual.store
    content = patterned(3 * dual.threshold, 227)
    key = store.add(content)
    path = store.large_path(key)
    os.truncate(path, len(content) - 1)
    with pytest.raises(Corrupt):
        store.get(key)
    with pytest.raises(Corrupt):
        store.read_range(key, 0, 16)
    assert key.raw in store.corrupt


def test_a_memory_object_changed_behind_the_store_fails_every_read_with_corrupt(
    tmp_path,
) -> None:
    from .conftest import open_column

    col = open_column("mem", tmp_path)
    content = patterned(700, 229)
    key = col.store.add(content)
    kv = col.store.kv  # (a memory engine has no file to edit: its bytes change in place)
    with kv._lock:
        kv._data[key.raw] = (flip(content, 3), kv._data[key.raw][1])
    assert_refused_as_corrupt(col, key, len(content))


def test_only_the_changed_object_is_reported_and_the_others_still_serve(dual: Column) -> None:
    store = dual.store
    small = [patterned(100 + i, 233 - i) for i in range(3)]
    large = [patterned(3 * dual.threshold + i, 239 - i) for i in range(3)]
    keys = [store.add(c) for c in small + large]
    edit_kv_row(dual, keys[1], flip(small[1], 0))
    edit_large_file(dual, keys[4], at=10, keep_times=False)
    assert store.verify() == sorted([keys[1], keys[4]])
    assert store.corrupt == {keys[1].raw, keys[4].raw}
    for key, content in zip(keys, small + large, strict=True):
        if key in (keys[1], keys[4]):
            continue
        assert store.get(key) == content


def test_a_verified_re_put_repairs_a_known_corrupt_kv_object(sqlite_column: Column) -> None:
    store = sqlite_column.store
    content = patterned(300, 181)
    key = store.add(content)
    edit_kv_row(sqlite_column, key, flip(content, 10))
    with pytest.raises(Corrupt):
        store.get(key)
    result = store.put(content)
    result.pin.release()
    assert (result.key, result.created) == (key, True)
    assert store.get(key) == content
    assert key.raw not in store.corrupt
    assert sqlite_column.pool_rows() == 1


def test_a_verified_re_put_repairs_a_known_corrupt_large_object(dual: Column) -> None:
    store = dual.store
    content = patterned(3 * dual.threshold + 5, 179)
    key = store.add(content)
    edit_large_file(dual, key, at=2 * dual.threshold, keep_times=False)
    with pytest.raises(Corrupt):
        store.get(key)
    result = store.put(content)
    result.pin.release()
    assert (result.key, result.created) == (key, True)
    assert store.get(key) == content
    assert store.read_range(key, 0, 9)[0] == content[:9]
    assert key.raw not in store.corrupt
    assert dual.large_files() == 1


@pytest.mark.parametrize("algo", list(Algorithm), ids=lambda a: a.label)
def test_the_read_check_of_every_algorithm_refuses_one_changed_byte(algo: Algorithm) -> None:
    """Key.matches (the verified get's check): the key's own algorithm, every byte."""
    data = bytes(range(256)) * 4
    key = Key.derive(algo, data)
    assert key.matches(data) and key.matches(memoryview(data))
    for i in (0, 511, len(data) - 1):
        changed = bytearray(data)
        changed[i] ^= 1
        assert not key.matches(bytes(changed))
    assert not key.matches(data[:-1]) and not key.matches(data + b"\0")
