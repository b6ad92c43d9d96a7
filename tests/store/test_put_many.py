"""The batched put: each item as a single put would store it, pins included."""

from __future__ import annotations

import pytest

from alkfs.errors import Verification
from alkfs.keys import Algorithm, Key

from .conftest import Column, patterned, register, sha256_key


def items_for(col: Column) -> list[tuple[bytes, Algorithm, Key | None]]:
    small = [patterned(10 + i, 61 + i) for i in range(4)]
    items = [(c, Algorithm.SHA256, None) for c in small]
    items.append((b"blob 5\0hello", Algorithm.GIT_SHA1, None))
    items.append((small[0] + b"!", Algorithm.BLAKE3, Key.derive(Algorithm.BLAKE3, small[0] + b"!")))
    if col.accepts_large:
        items += [
            (patterned(col.threshold + 1 + i, 71 + i), Algorithm.SHA256, None) for i in range(2)
        ]
    return items


def test_a_batch_put_stores_each_item_as_a_single_put_would(column: Column) -> None:
    store = column.store
    register(store)
    items = items_for(column)
    results = store.put_many(items)
    assert [r.key for r in results] == [Key.derive(a, d) for d, a, _ in items]
    assert [r.created for r in results] == [True] * len(items)
    for (data, _, _), r in zip(items, results, strict=True):
        assert store.get(r.key) == data
    lengths = [len(d) for d, _, _ in items]
    large = sum(1 for n in lengths if n > column.threshold) if column.has_large_tier else 0
    assert column.media() == (len(items) - large, large)

    # Each result's pin protects its object until released.
    assert store.sweep().candidates_staged == 0
    again = store.put_many(items)
    assert [r.created for r in again] == [False] * len(items)
    for r in results + again:
        r.pin.release()
    assert store.arbiter.pinned_keys() == set()
    assert store.sweep().candidates_staged == len(items)
    report = store.sweep()
    assert (report.taken, report.deleted) == (len(items), len(items))
    assert column.media() == (0, 0)


def test_a_batch_with_a_bad_small_item_stores_none_of_its_small_items(column: Column) -> None:
    store = column.store
    good = [(patterned(20 + i, 53 + i), Algorithm.SHA256, None) for i in range(3)]
    bad = (b"these bytes", Algorithm.SHA256, sha256_key(b"other bytes"))
    with pytest.raises(Verification) as caught:
        store.put_many(good[:2] + [bad] + good[2:])
    assert type(caught.value) is Verification
    assert column.media() == (0, 0)
    assert store.arbiter.pinned_keys() == set()
    with pytest.raises(Verification):
        store.put_many([(b"blob 9\0short", Algorithm.GIT_SHA1, None)] + good)
    assert column.media() == (0, 0)


def test_identical_items_in_one_batch_are_one_entry(column: Column) -> None:
    store = column.store
    register(store)
    data = patterned(40, 47)
    results = store.put_many([(data, Algorithm.SHA256, None)] * 3)
    assert {r.key for r in results} == {sha256_key(data)}
    assert [r.created for r in results] == [True, False, False], "the first writer created it"
    assert column.media() == (1, 0)
    for r in results:
        r.pin.release()
    assert store.sweep().candidates_staged == 1
    assert store.sweep().deleted == 1
