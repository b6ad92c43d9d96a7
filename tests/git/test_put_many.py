"""Store.put_many: batched puts with the same promises as put."""

from __future__ import annotations

import pytest

from alkfs.errors import TooLarge, Verification
from alkfs.git.objects import canonical
from alkfs.keys import Algorithm, Key
from alkfs.store import Store


@pytest.fixture(params=["dual-tier", "kv-only", "mem"])
def store(request, tmp_path):
    if request.param == "mem":
        s = Store.memory(threshold=64)
    else:
        s = Store.open(tmp_path / "s", mode=request.param, threshold=64, window_s=0)
    yield s
    s.close()


def test_each_item_is_stored_under_its_digest_pinned_until_released(store):
    items = [(canonical("blob", b"%d\n" % i), Algorithm.GIT_SHA1, None) for i in range(5)]
    items.append((b"plain bytes", Algorithm.SHA256, None))
    results = store.put_many(items)
    assert [r.key for r in results] == [Key.derive(a, d) for d, a, _ in items]
    assert all(r.created for r in results)
    assert all(store.arbiter.pin_count(r.key) == 1 for r in results)
    for (data, _, _), r in zip(items, results, strict=True):
        assert store.get(r.key) == data
        r.pin.release()
    assert store.arbiter.pinned_keys() == set()


def test_a_second_put_of_the_same_content_is_dedup_not_created(store):
    data = canonical("blob", b"same\n")
    first = store.put_many([(data, Algorithm.GIT_SHA1, None)])
    again = store.put_many(
        [(data, Algorithm.GIT_SHA1, None), (canonical("blob", b"new\n"), Algorithm.GIT_SHA1, None)]
    )
    assert [r.created for r in first + again] == [True, False, True]
    for r in first + again:
        r.pin.release()


def test_a_wrong_expected_key_or_a_non_canonical_git_object_stores_nothing(store):
    good = canonical("blob", b"good\n")
    wrong = Key.derive(Algorithm.GIT_SHA1, b"something else")
    with pytest.raises(Verification):
        store.put_many([(good, Algorithm.GIT_SHA1, None), (good, Algorithm.GIT_SHA1, wrong)])
    for bad in (b"blob 9\0short", b"nonsense", b"blob 01\0x", b"blub 1\0x"):
        with pytest.raises(Verification):
            store.put_many([(good, Algorithm.GIT_SHA1, None), (bad, Algorithm.GIT_SHA1, None)])
    assert list(store.iter_keys()) == []
    assert store.arbiter.pinned_keys() == set()


def test_objects_over_the_threshold_follow_the_mode(store):
    big = canonical("blob", b"x" * 100)
    small = canonical("blob", b"y\n")
    if store.mode == "kv-only":
        with pytest.raises(TooLarge):
            store.put_many([(small, Algorithm.GIT_SHA1, None), (big, Algorithm.GIT_SHA1, None)])
        assert store.arbiter.pinned_keys() == set()
        assert list(store.iter_keys()) == []
        return
    results = store.put_many([(small, Algorithm.GIT_SHA1, None), (big, Algorithm.GIT_SHA1, None)])
    tiers = [store.stat(r.key).tier for r in results]
    assert tiers == (["kv", "large"] if store.mode == "dual-tier" else ["mem", "mem"])
    assert store.get(results[1].key) == big
    for r in results:
        r.pin.release()


def test_an_expected_key_may_be_given_as_raw_bytes(store):
    data = canonical("blob", b"raw\n")
    key = Key.derive(Algorithm.GIT_SHA1, data)
    (result,) = store.put_many([(data, Algorithm.GIT_SHA1, key.raw)])
    assert result.key == key
    assert result.key.algo is Algorithm.GIT_SHA1
    result.pin.release()
    with pytest.raises(Verification):
        store.put_many([(canonical("blob", b"other\n"), Algorithm.GIT_SHA1, key.raw)])
