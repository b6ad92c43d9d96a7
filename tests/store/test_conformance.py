"""The store contract as executable rows, run against every column the row applies to.

Sweep counts read against the durable schedule: with window 0 a sweep stages the
dead set and the *next* sweep executes it (deleted + cancelled == what it took).
"""

from __future__ import annotations

import hashlib
import io
import threading

import pytest

from alkfs.errors import StoreIO, TooLarge, Verification
from alkfs.gc.sweep import AbortCause
from alkfs.keys import Algorithm, Key
from alkfs.store import DEFAULT_THRESHOLD, LARGE_DIR, ObjectStat

from .conftest import (
    TUNED_THRESHOLD,
    Column,
    FailingStream,
    SetProtect,
    SetSource,
    chunked,
    failing_chunks,
    open_column,
    patterned,
    register,
    sha256_key,
)


def counts3(report) -> tuple[int, int, int]:
    return (report.candidates_staged, report.deleted, report.cancelled_by_arbitration)


def expected_media(col: Column, lengths: list[int]) -> tuple[int, int]:
    """Where objects of these lengths must live: (kv rows, large files)."""
    if not col.has_large_tier:
        return len(lengths), 0
    large = sum(1 for n in lengths if n > col.threshold)
    return len(lengths) - large, large


# -- round trip ---------------------------------------------------------------------


def test_puts_round_trip_byte_identical_through_every_input_shape(column: Column) -> None:
    store = column.store
    t = column.threshold
    lengths = [0, 1, t - 1, t]
    if column.accepts_large:
        lengths += [t + 1, 4 * t + 9]
    for n, length in enumerate(lengths):
        content = patterned(length, 151 + 2 * n)
        key = sha256_key(content)
        shapes = [
            ("bytes, known length", content, length),
            ("stream, known length", io.BytesIO(content), length),
            ("stream, unknown length", io.BytesIO(content), None),
            ("chunk iterable, unknown length", chunked(content), None),
        ]
        for shape, source, declared in shapes:
            result = store.put(source, length=declared)
            assert result.key == key, shape
            assert result.created is (shape == "bytes, known length"), shape
            assert store.get(key) == content, shape
            assert store.read_range(key, 0, length) == (
                content,
                hashlib.sha256(content).hexdigest(),
            )
            result.pin.release()
    assert column.media() == expected_media(column, lengths)


@pytest.mark.parametrize(
    ("algo", "content"),
    [
        (Algorithm.SHA256, b"plain sha256 content"),
        (Algorithm.BLAKE3, b"content named by blake3"),
        (Algorithm.GIT_SHA1, b"blob 11\0hello world"),
        (Algorithm.GIT_SHA256, b"blob 11\0hello world"),
    ],
)
def test_every_algorithm_names_the_stored_bytes_by_their_digest(
    column: Column, algo: Algorithm, content: bytes
) -> None:
    key = column.store.add(content, algo=algo)
    assert key == Key.derive(algo, content)
    assert key.algo is algo
    assert column.store.get(key) == content
    assert Key.derive(algo, column.store.get(key)) == key


def test_a_git_put_whose_bytes_are_not_one_git_object_stores_nothing(column: Column) -> None:
    with pytest.raises(Verification) as caught:
        column.store.put(b"blob 99\0short", algo=Algorithm.GIT_SHA1)
    assert type(caught.value) is Verification
    assert column.media() == (0, 0)


def test_a_put_that_does_not_hash_to_the_expected_key_stores_nothing(column: Column) -> None:
    wanted = sha256_key(b"what the caller named")
    with pytest.raises(Verification) as caught:
        column.store.put(b"what the caller sent", expect=wanted)
    assert type(caught.value) is Verification
    assert column.media() == (0, 0)
    ok = column.store.put(b"what the caller named", expect=wanted)
    assert ok.key == wanted
    ok.pin.release()


# -- dedup --------------------------------------------------------------------------


def test_identical_content_is_one_pool_entry_and_every_re_put_pin_protects(
    column: Column,
) -> None:
    store = column.store
    register(store)
    for content in (b"deduplicated content", patterned(column.big(3), 157)):
        canonical = sha256_key(content)
        media = expected_media(column, [len(content)])

        first = store.put(content, length=len(content))
        second = store.put(content, length=len(content))
        assert (first.key, second.key) == (canonical, canonical)
        assert (first.created, second.created) == (True, False)
        assert counts3(store.sweep()) == (0, 0, 0)
        assert column.media() == media
        first.pin.release()
        assert counts3(store.sweep()) == (0, 0, 0), "the re-put's pin protects as a fresh one"
        second.pin.release()
        assert counts3(store.sweep()) == (1, 0, 0), "exactly one entry, staged not executed"
        assert counts3(store.sweep()) == (0, 1, 0), "the executing sweep deleted exactly it"
        assert not store.has(canonical)
        assert column.media() == (0, 0)

        # Across the two put paths, released in the other order.
        first = store.put(io.BytesIO(content), length=len(content))
        second = store.put(chunked(content), length=None)
        assert (first.key, second.key) == (canonical, canonical)
        assert column.media() == media
        assert counts3(store.sweep()) == (0, 0, 0)
        second.pin.release()
        assert counts3(store.sweep()) == (0, 0, 0)
        first.pin.release()
        assert counts3(store.sweep()) == (1, 0, 0)
        assert counts3(store.sweep()) == (0, 1, 0)
        assert not store.has(canonical)


# -- stage hygiene ------------------------------------------------------------------


def test_a_failed_put_leaves_zero_residue_on_both_paths_and_both_failure_modes(
    column: Column,
) -> None:
    store = column.store
    register(store)
    for content in (patterned(200, 167), patterned(column.big(100), 173)):
        canonical = sha256_key(content)
        n = len(content)
        # Fail after the bytes crossed the threshold where there is one: the
        # large put's staging file existed when the stream failed.
        fail_at = n - 50

        with pytest.raises(StoreIO) as caught:
            store.put(FailingStream(content, fail_at), length=n)
        assert type(caught.value) is StoreIO
        with pytest.raises(StoreIO) as caught:
            store.put(failing_chunks(content, fail_at), length=None)
        assert type(caught.value) is StoreIO
        with pytest.raises(Verification) as caught:
            store.put(content, length=n // 2)
        assert type(caught.value) is Verification, "over-fed: more bytes than declared"
        with pytest.raises(Verification) as caught:
            store.put(io.BytesIO(content), length=n + 1)
        assert type(caught.value) is Verification, "under-fed: fewer bytes than declared"

        assert not store.has(canonical)
        assert column.media() == (0, 0)
        assert column.staging_files() == 0
        report = store.sweep()
        assert report.aborted is None
        assert counts3(report) == (0, 0, 0)

        for source, declared in ((io.BytesIO(content), n), (chunked(content), None)):
            result = store.put(source, length=declared)
            assert result.key == canonical
            assert column.media() == expected_media(column, [n])
            assert column.staging_files() == 0
            result.pin.release()
            assert counts3(store.sweep()) == (1, 0, 0)
            assert counts3(store.sweep()) == (0, 1, 0)
            assert not store.has(canonical)
            assert column.media() == (0, 0)


# -- exact counts over the full protection set ---------------------------------------


def test_two_sweeps_count_exactly_over_the_full_protection_set(column: Column) -> None:
    store = column.store
    t = column.threshold
    source = register(store)
    protect = SetProtect()
    store.register_protect(protect)

    source_live = patterned(t - 1, 191)
    key_live = store.add(source_live)
    source.add(key_live)
    pinned = patterned(column.big(7), 173)
    held = store.put(chunked(pinned))
    protected = patterned(column.big(11), 167)
    key_protected = store.add(io.BytesIO(protected))
    protect.keys = [key_protected]
    dead_kv = patterned(t - 3, 149)
    key_dead_kv = store.add(dead_kv)
    dead_large = patterned(column.big(13), 151)
    key_dead_large = store.add(chunked(dead_large))

    lengths = [len(c) for c in (source_live, pinned, protected, dead_kv, dead_large)]
    assert column.media() == expected_media(column, lengths)

    first = store.sweep()
    assert first.aborted is None
    assert counts3(first) == (2, 0, 0), "staging is not executing"
    assert (first.scanned, first.live, first.taken) == (5, 3, 0)
    assert column.window_rows() == 2
    for key, content in (
        (key_live, source_live),
        (held.key, pinned),
        (key_protected, protected),
        (key_dead_kv, dead_kv),
        (key_dead_large, dead_large),
    ):
        assert store.get(key) == content

    second = store.sweep()
    assert second.aborted is None
    assert second.taken == 2
    assert counts3(second) == (0, 2, 0)
    assert second.bytes_freed == len(dead_kv) + len(dead_large)
    assert not store.has(key_dead_kv)
    assert not store.has(key_dead_large)
    assert column.media() == expected_media(column, lengths[:3])
    assert column.window_rows() == 0
    for key, content in ((key_live, source_live), (held.key, pinned), (key_protected, protected)):
        assert store.get(key) == content

    held.pin.release()
    assert counts3(store.sweep()) == (1, 0, 0)
    assert counts3(store.sweep()) == (0, 1, 0)
    assert not store.has(held.key)
    assert store.get(key_live) == source_live
    assert store.get(key_protected) == protected
    assert column.media() == expected_media(column, [lengths[0], lengths[2]])


# -- the put-during-window race -----------------------------------------------------


def test_a_put_landing_during_the_window_survives_the_executing_sweep(column: Column) -> None:
    store = column.store
    register(store)
    rounds = [
        ("the kv twin, known-length re-put", patterned(column.threshold - 1, 191), True),
        ("the large twin, unknown-length re-put", patterned(column.big(5), 173), False),
    ]
    for index, (tag, content, known) in enumerate(rounds):
        n = len(content)
        twin = sha256_key(content)
        witness = f"the dead witness of round {index}".encode()
        witness_key = sha256_key(witness)

        assert store.add(io.BytesIO(content) if known else chunked(content)) == twin
        assert store.add(chunked(witness)) == witness_key
        staged = store.sweep()
        assert (staged.aborted, *counts3(staged)) == (None, 2, 0, 0), tag

        # The put lands during the window: it dedups into the staged twin and
        # its pin is minted before it publishes.
        reput = store.put(io.BytesIO(content) if known else chunked(content), n if known else None)
        assert reput.created is False, tag
        executed = store.sweep()
        assert executed.aborted is None, tag
        assert executed.taken == 2, tag
        assert counts3(executed) == (0, 1, 1), tag
        assert not store.has(witness_key), tag
        assert store.get(twin) == content, tag
        reput.pin.release()

        assert counts3(store.sweep()) == (1, 0, 0), f"{tag}: the twin re-stages"
        assert counts3(store.sweep()) == (0, 1, 0), f"{tag}: and executes exactly once"
        assert not store.has(twin)
        assert column.window_rows() == 0
        assert column.media() == (0, 0)


def test_an_unpinned_write_again_after_staging_cancels_the_staged_delete(column: Column) -> None:
    store = column.store
    register(store)
    small = patterned(column.threshold, 181)
    large = patterned(column.big(9), 179)
    keys = [store.add(small), store.add(chunked(large))]
    assert counts3(store.sweep()) == (2, 0, 0)
    assert store.add(small) == keys[0]  # written again, pin already gone
    assert store.freshen(keys[1]) is True  # a touch counts as a write
    executed = store.sweep()
    assert executed.taken == 2
    assert counts3(executed) == (2, 0, 2), "both cancelled, and re-staged as still dead"
    assert store.get(keys[0]) == small
    assert store.get(keys[1]) == large
    # Not written again since the re-stage: now they execute.
    assert counts3(store.sweep()) == (0, 2, 0)
    assert store.freshen(keys[0]) is False, "freshening an absent object is a no-op"


# -- aborts as report data ----------------------------------------------------------


def test_a_sweep_without_liveness_sources_aborts_and_deletes_nothing(column: Column) -> None:
    store = column.store
    key = store.add(b"dead, but nobody can say so")
    for _ in range(2):
        report = store.sweep()
        assert report.aborted == AbortCause.NO_LIVENESS_SOURCES == "no-liveness-sources"
        assert counts3(report) == (0, 0, 0)
        assert report.taken == 0
        assert store.has(key)
    assert column.window_rows() == 0

    # A candidate staged while a source was registered is not executed either.
    token = store.register_source(SetSource())
    assert counts3(store.sweep()) == (1, 0, 0)
    assert store.unregister(token) is True
    assert store.unregister(token) is False
    report = store.sweep()
    assert report.aborted == "no-liveness-sources"
    assert (report.taken, *counts3(report)) == (0, 0, 0, 0)
    assert column.window_rows() == 1
    assert store.has(key)
    assert report.to_dict()["aborted"] == "no-liveness-sources"


def test_a_sweep_with_a_failed_protect_callback_aborts_and_deletes_nothing(
    column: Column,
) -> None:
    store = column.store
    register(store)
    key = store.add(b"dead, staged before the callback broke")
    assert counts3(store.sweep()) == (1, 0, 0)

    def broken() -> list[Key]:
        raise RuntimeError("the protect backend is down")

    token = store.register_protect(broken)
    report = store.sweep()
    assert report.aborted == AbortCause.PROTECT_FAILED == "protect-failed"
    assert (report.taken, *counts3(report)) == (0, 0, 0, 0)
    assert store.has(key)
    assert column.window_rows() == 1
    store.unregister(token)
    assert counts3(store.sweep()) == (0, 1, 0)


def test_a_sweep_with_a_failing_liveness_source_aborts_and_deletes_nothing(
    column: Column,
) -> None:
    store = column.store

    class Broken:
        def live_keys(self) -> list[bytes]:
            raise OSError("the refs table is unreadable")

        def contains(self, key: bytes) -> bool:
            return False

    key = store.add(b"dead, but the source cannot say so")
    store.register_source(Broken())
    report = store.sweep()
    assert report.aborted == "protect-failed"
    assert (report.taken, *counts3(report)) == (0, 0, 0, 0)
    assert store.has(key)
    assert column.window_rows() == 0


def test_the_contended_second_sweeper_aborts_as_data_and_the_holder_stages_only(
    column: Column,
) -> None:
    store = column.store
    register(store)
    entered = threading.Event()
    release = threading.Event()

    def latch() -> list[Key]:
        entered.set()
        assert release.wait(30), "the test never released the holder"
        return []

    store.register_protect(latch)
    key = store.add(patterned(column.threshold - 1, 167))

    reports = []
    holder = threading.Thread(target=lambda: reports.append(store.sweep()))
    holder.start()
    assert entered.wait(30)
    assert store.arbiter.sweeping is True
    second = store.sweep()
    assert second.aborted == AbortCause.SWEEPER_LOCK == "sweeper-lock"
    assert (second.taken, *counts3(second)) == (0, 0, 0, 0)
    assert store.has(key)
    assert column.window_rows() == 0
    release.set()
    holder.join()

    (report,) = reports
    assert report.aborted is None
    assert counts3(report) == (1, 0, 0), "the holder stages; it does not execute"
    assert column.window_rows() == 1
    assert store.has(key)
    assert counts3(store.sweep()) == (0, 1, 0)
    assert not store.has(key)


# -- list correctness through sweep outcomes -----------------------------------------


def test_list_correctness_shows_in_exact_sweep_outcomes(column: Column) -> None:
    store = column.store
    source = register(store)
    contents = [
        b"kept live by the source, entry one",
        b"kept live by the source, entry two",
        patterned(column.big(1), 139),  # dead, on the large tier where there is one
        b"dead at the first staging, entry four",
        patterned(column.big(2), 137),
    ]
    keys = [store.add(io.BytesIO(c) if i % 2 == 0 else chunked(c)) for i, c in enumerate(contents)]
    source.add(keys[0])
    source.add(keys[1])

    first = store.sweep()
    assert (first.scanned, first.live) == (5, 2)
    assert counts3(first) == (3, 0, 0)
    assert all(store.has(k) for k in keys)
    assert column.window_rows() == 3
    assert counts3(store.sweep()) == (0, 3, 0)
    assert [store.has(k) for k in keys] == [True, True, False, False, False]

    source.remove(keys[1])
    assert counts3(store.sweep()) == (1, 0, 0)
    assert counts3(store.sweep()) == (0, 1, 0)
    assert [store.has(k) for k in keys[:2]] == [True, False]
    source.remove(keys[0])
    assert counts3(store.sweep()) == (1, 0, 0)
    assert counts3(store.sweep()) == (0, 1, 0)
    assert store.list() == []


def test_list_pages_in_key_order_across_both_tiers(column: Column) -> None:
    store = column.store
    contents = [patterned(column.big(i) if i % 2 else 10 + i, 131 + i) for i in range(9)]
    keys = sorted(store.add(c) for c in contents)
    git_key = store.add(b"blob 3\0abc", algo=Algorithm.GIT_SHA1)

    listed = store.list()
    assert [s.key for s in listed] == sorted(keys + [git_key])
    assert [s.key for s in store.list(algo=Algorithm.SHA256)] == keys
    assert [s.key for s in store.list(algo=Algorithm.GIT_SHA1)] == [git_key]
    assert store.list(algo=Algorithm.BLAKE3) == []

    pages: list[Key] = []
    after = None
    while page := store.list(after=after, limit=2, algo=Algorithm.SHA256):
        assert len(page) <= 2
        pages += [s.key for s in page]
        after = page[-1].key
    assert pages == keys
    by_key = {sha256_key(c): len(c) for c in contents}
    assert {s.key: s.size for s in store.list(algo=Algorithm.SHA256)} == by_key


# -- stat ---------------------------------------------------------------------------


def test_stat_reports_size_algorithm_and_tier_without_reading_content(column: Column) -> None:
    store = column.store
    small = patterned(column.threshold - 1, 163)
    large = patterned(column.big(17), 157)
    blake = b"stat of a blake3 object"
    for content, algo in ((small, Algorithm.SHA256), (large, Algorithm.SHA256), (blake, None)):
        key = store.add(content, algo=algo or Algorithm.BLAKE3)
        if column.engine == "sqlite":  # (sqlite's statement trace)
            statements: list[str] = []
            conn = store.db.conn()
            conn.set_trace_callback(statements.append)
            try:
                found = store.stat(key)
            finally:
                conn.set_trace_callback(None)
            assert statements, "stat consulted the kv tier"
            assert all("value" not in s.split("FROM")[0] for s in statements), statements
        else:
            found = store.stat(key)
        assert isinstance(found, ObjectStat)
        assert (found.key, found.size, found.key.algo) == (
            key,
            len(content),
            algo or Algorithm.BLAKE3,
        )
        if column.mode == "mem":
            assert found.tier == "mem"
        elif column.has_large_tier and len(content) > column.threshold:
            assert found.tier == "large"
        else:
            assert found.tier == "kv"
        assert found.stored_ns > 0


# -- virgin store -------------------------------------------------------------------


def test_reads_of_a_virgin_store_are_no_ops(column: Column) -> None:
    store = column.store
    absent = sha256_key(b"nothing was ever put")
    assert store.list() == []
    assert store.get(absent) is None
    assert store.stat(absent) is None
    assert store.has(absent) is False
    assert store.read_range(absent, 0, 4) is None
    assert store.freshen(absent) is False
    assert store.verify() == []
    assert all(set(c.values()) == {0} and len(c) == 6 for c in store.counts().values())
    assert (column.pool_rows(), column.window_rows(), column.large_files()) == (0, 0, 0)
    register(store)
    report = store.sweep()
    assert report.aborted is None
    assert (report.scanned, report.live, report.taken, *counts3(report)) == (0, 0, 0, 0, 0, 0)


def test_reopening_a_virgin_store_file_is_still_a_no_op(sqlite_column: Column) -> None:
    sqlite_column.store.close()
    col = sqlite_column.reopen()
    try:
        assert col.store.mode == sqlite_column.mode
        assert col.store.list() == []
        assert col.store.get(sha256_key(b"x")) is None
        assert (col.pool_rows(), col.window_rows(), col.large_files()) == (0, 0, 0)
    finally:
        col.store.close()


# -- kv-only rejection --------------------------------------------------------------


class CountingStream(io.BytesIO):
    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.reads = 0

    def read(self, n: int | None = -1) -> bytes:
        self.reads += 1
        return super().read(n)


def test_kv_only_mode_rejects_over_threshold_puts_at_put_time(kv_only: Column) -> None:
    store = kv_only.store
    t = kv_only.threshold
    register(store)
    accepted = []
    for length, modulus in ((t - 1, 191), (t, 173)):
        content = patterned(length, modulus)
        for declared in (length, None):
            accepted.append(store.add(io.BytesIO(content)) if declared else store.add(content))
    assert kv_only.pool_rows() == 2

    for length in (t + 1, 3 * t):
        content = patterned(length, 167)
        declared = CountingStream(content)
        with pytest.raises(TooLarge) as caught:
            store.put(declared, length=length)
        assert type(caught.value) is TooLarge
        assert declared.reads == 0, "a declared over-threshold length is refused before reading"
        with pytest.raises(TooLarge):
            store.put(chunked(content, 64), length=None)
        with pytest.raises(TooLarge):
            store.put(content)
        assert not store.has(sha256_key(content))
    assert kv_only.pool_rows() == 2
    assert not (kv_only.root / LARGE_DIR).exists(), "kv-only has no large tier to leave residue in"
    assert counts3(store.sweep()) == (2, 0, 0)
    assert counts3(store.sweep()) == (0, 2, 0)
    assert kv_only.pool_rows() == 0


# -- routing by length --------------------------------------------------------------


def test_routing_is_a_pure_function_of_length_across_put_paths_and_re_puts(dual: Column) -> None:
    store = dual.store
    t = dual.threshold
    register(store)
    for content in (
        patterned(t - 1, 191),
        patterned(t, 173),
        patterned(t + 1, 167),
        patterned(4 * t + 9, 151),
    ):
        n = len(content)
        canonical = sha256_key(content)
        placed = (0, 1) if n > t else (1, 0)
        for source, declared in ((io.BytesIO(content), n), (chunked(content), None)):
            result = store.put(source, length=declared)
            assert result.key == canonical
            assert dual.media() == placed, f"length {n} never moves or duplicates"
            assert dual.staging_files() == 0
            assert store.stat(canonical).tier == ("large" if n > t else "kv")
            assert store.get(canonical) == content
            result.pin.release()
        assert counts3(store.sweep()) == (1, 0, 0)
        assert counts3(store.sweep()) == (0, 1, 0)
        assert dual.media() == (0, 0)


@pytest.mark.parametrize("threshold", [1024, DEFAULT_THRESHOLD], ids=["tuned", "default"])
def test_threshold_boundary_lengths_route_deterministically(tmp_path, threshold: int) -> None:
    col = open_column("dual-tier", tmp_path, threshold=threshold)
    store = col.store
    try:
        register(store)
        assert store.threshold == threshold
        rows = files = 0
        for length, modulus, lands_large in (
            (threshold - 1, 191, False),
            (threshold, 173, False),
            (threshold, 167, False),
            (threshold + 1, 151, True),
            (threshold + 1, 139, True),
        ):
            content = patterned(length, modulus)
            for declared in (length, None):
                source = io.BytesIO(content) if declared else chunked(content, 4096)
                result = store.put(source, length=declared)
                assert result.key == sha256_key(content)
                assert col.media() == (rows + (not lands_large), files + lands_large)
                result.pin.release()
            rows += not lands_large
            files += lands_large

        at_default = patterned(DEFAULT_THRESHOLD, 199)
        lands_large = threshold < DEFAULT_THRESHOLD
        result = store.put(at_default, length=DEFAULT_THRESHOLD)
        assert result.key == sha256_key(at_default)
        assert col.media() == (rows + (not lands_large), files + lands_large)
        result.pin.release()

        assert counts3(store.sweep()) == (6, 0, 0)
        assert counts3(store.sweep()) == (0, 6, 0)
        assert col.media() == (0, 0)
    finally:
        store.close()


def test_a_store_opened_without_a_threshold_routes_at_the_default(tmp_path) -> None:
    from alkfs.store import Store

    with Store.open(tmp_path / "s", window_s=0) as store:
        assert (store.mode, store.threshold) == ("dual-tier", DEFAULT_THRESHOLD)
        at = store.add(patterned(DEFAULT_THRESHOLD, 97))
        over = store.add(patterned(DEFAULT_THRESHOLD + 1, 89))
        assert (store.stat(at).tier, store.stat(over).tier) == ("kv", "large")


# -- fall-through reads and the miss shapes ------------------------------------------


def test_kv_misses_fall_through_to_the_large_tier_per_op(dual: Column) -> None:
    store = dual.store
    t = dual.threshold
    register(store)
    for content, declared in (
        (patterned(3 * t + 41, 181), 3 * t + 41),
        (patterned(3 * t + 43, 197), None),
    ):
        n = len(content)
        result = store.put(io.BytesIO(content), length=declared)
        key = result.key
        assert dual.media() == (0, 1), "the kv tier misses; the large tier holds it"
        assert store.kv_value(key) is None
        assert store.get(key) == content
        assert store.stat(key) == ObjectStat(key, n, "large", store.stat(key).stored_ns)
        assert store.has(key) is True
        mid = n // 2
        piece, digest = store.read_range(key, mid, 17)
        assert piece == content[mid : mid + 17]
        assert digest == hashlib.sha256(piece).hexdigest()
        assert store.read_range(key, n - 5, 100) == (
            content[n - 5 :],
            hashlib.sha256(content[n - 5 :]).hexdigest(),
        )
        assert store.read_range(key, n + 10, 4) == (b"", hashlib.sha256(b"").hexdigest())

        result.pin.release()
        assert counts3(store.sweep()) == (1, 0, 0)
        assert counts3(store.sweep()) == (0, 1, 0)
        assert_miss_shapes(store, key)

    small = patterned(t - 1, 149)
    key = store.add(small)
    assert dual.media() == (1, 0), "the kv tier is the first consult"
    assert store.get(key) == small
    assert store.read_range(key, 3, 5) == (small[3:8], hashlib.sha256(small[3:8]).hexdigest())


def assert_miss_shapes(store, key: Key) -> None:
    assert store.get(key) is None
    assert store.stat(key) is None
    assert store.has(key) is False
    assert store.read_range(key, 0, 4) is None


def test_a_both_tier_miss_has_the_same_shape_per_op_in_every_mode(column: Column) -> None:
    store = column.store
    register(store)
    assert_miss_shapes(store, sha256_key(b"never put here"))
    for content in (patterned(column.threshold, 113), patterned(column.big(3), 109)):
        key = store.add(content)
        assert counts3(store.sweep()) == (1, 0, 0)
        assert counts3(store.sweep()) == (0, 1, 0)
        assert_miss_shapes(store, key)


# -- fresh, isolated opens ------------------------------------------------------------


def test_every_open_is_a_fresh_isolated_store(tmp_path) -> None:
    a = open_column("dual-tier", tmp_path / "a")
    b = open_column("dual-tier", tmp_path / "b")
    try:
        content_a = patterned(2 * TUNED_THRESHOLD + 5, 167)
        content_b = patterned(TUNED_THRESHOLD - 5, 191)
        key_a = a.store.add(io.BytesIO(content_a))
        key_b = b.store.add(chunked(content_b))
        assert (a.store.has(key_a), a.store.has(key_b)) == (True, False)
        assert (b.store.has(key_a), b.store.has(key_b)) == (False, True)
        assert a.media() == (0, 1)
        assert b.media() == (1, 0)
        c = open_column("dual-tier", tmp_path / "c")
        try:
            assert c.media() == (0, 0)
            assert not c.store.has(key_a) and not c.store.has(key_b)
        finally:
            c.store.close()
    finally:
        a.store.close()
        b.store.close()
