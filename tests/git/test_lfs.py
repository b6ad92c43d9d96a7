"""Git LFS in the library (docs/lfs.md): pointers recognized, recorded as rows by a resumable
scan, media stored by import and kept alive by the pointer blobs the sweep finds live."""

from __future__ import annotations

import hashlib
import os

import pytest

from alkfs.app import Alkfs
from alkfs.git import lfs
from alkfs.git.importer import import_repo
from alkfs.git.lfs_pointer import media_of, pointer_oid, pointer_text
from alkfs.git.refs import RefUpdate
from alkfs.keys import Algorithm, Key

OID = "4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393"
V1 = b"version https://git-lfs.github.com/spec/v1\n"


@pytest.mark.parametrize(
    ("text", "oid"),
    [
        (V1 + b"oid sha256:%s\nsize 12345\n" % OID.encode(), OID),
        (V1 + b"oid sha256:%s\nsize 0\n" % OID.encode(), OID),
        (
            V1 + b"ext-0-foo sha256:%s\noid sha256:%s\nsize 7\n" % (b"a" * 64, OID.encode()),
            OID,
        ),
        (b"version https://hawser.github.com/spec/v1\noid sha256:%s\nsize 1\n" % OID.encode(), OID),
        (V1 + b"oid sha256:%s\nsize 12345" % OID.encode(), None),  # no final newline
        (V1 + b"oid sha256:%s\nsize 12345\n" % OID.upper().encode(), None),
        (V1 + b"oid sha256:%s\nsize 012\n" % OID.encode(), None),
        (V1 + b"oid sha1:%s\nsize 1\n" % OID[:40].encode(), None),
        (V1 + b"size 1\noid sha256:%s\n" % OID.encode(), None),  # keys out of order
        (V1 + b"oid sha256:%s\nsize 1\nextra\n" % OID.encode(), None),
        (b"version https://example.com/v1\noid sha256:%s\nsize 1\n" % OID.encode(), None),
        (V1 + b"oid sha256:%s\nsize 1\n" % OID.encode() + b"#" * 1024, None),
        (b"hello\n", None),
    ],
)
def test_a_pointer_is_recognized_by_its_exact_shape(text, oid):
    assert pointer_oid(text) == oid


def test_a_stored_pointer_blob_names_its_media_key():
    body = pointer_text(OID, 5)
    stored = b"blob %d\0" % len(body) + body
    assert media_of(stored) == bytes([Algorithm.SHA256.value]) + bytes.fromhex(OID)
    assert media_of(b"tree %d\0" % len(body) + body) is None


def _lfs_repo(make_repo, media: dict[str, bytes], absent: dict[str, bytes] | None = None):
    """A repository whose files are git-lfs pointers (written as git-lfs writes them),
    with the media of `media` in its .git/lfs/objects and those of `absent` nowhere."""
    repo = make_repo()
    for name, content in {**media, **(absent or {})}.items():
        oid = hashlib.sha256(content).hexdigest()
        repo.write(name, pointer_text(oid, len(content)))
        if name in media:
            d = repo.path / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4]
            d.mkdir(parents=True, exist_ok=True)
            (d / oid).write_bytes(content)
    repo.write("README", "plain\n")
    repo.commit("media")
    return repo


def _key(content: bytes) -> Key:
    return Key.from_hex(Algorithm.SHA256, hashlib.sha256(content).hexdigest())


def test_import_stores_the_media_records_the_pointers_and_names_what_is_absent(
    make_repo, app: Alkfs
):
    one, two, gone = os.urandom(5000), os.urandom(70_000), b"never stored\n"
    repo = _lfs_repo(make_repo, {"a.bin": one, "b.bin": two}, {"c.bin": gone})
    r = import_repo(app, repo.gitdir, "r")
    assert (r.media_stored, r.media_present, r.media_missing) == (
        2,
        0,
        [hashlib.sha256(gone).hexdigest()],
    )
    assert "LFS media: 3 named by pointers (2 stored, 0 already present, 1 absent" in r.summary()
    assert app.store.get(_key(one)) == one and app.store.get(_key(two)) == two
    assert not app.store.has(_key(gone))
    assert sorted(m for _b, m in app.lfs.rows()) == sorted(_key(x).raw for x in (one, two, gone))
    again = import_repo(app, repo.gitdir, "r2")
    assert (again.media_stored, again.media_present) == (0, 2)


def test_sweeps_keep_media_while_a_ref_reaches_its_pointer_and_drop_it_after(make_repo, app: Alkfs):
    shared, own = os.urandom(3000), os.urandom(4000)
    a = _lfs_repo(make_repo, {"shared.bin": shared, "own.bin": own})
    b = _lfs_repo(make_repo, {"shared.bin": shared})
    import_repo(app, a.gitdir, "a")
    import_repo(app, b.gitdir, "b")
    for _ in range(3):
        app.store.sweep(0)
    assert app.store.has(_key(shared)) and app.store.has(_key(own))
    head = app.refs.get("a", "refs/heads/main")
    assert head is not None
    app.refs.update("a", [RefUpdate("refs/heads/main", None, head)])
    app.store.sweep(0)  # (stages: the pointer blob and the media are unreferenced now)
    assert app.store.has(_key(own))
    app.store.sweep(0)
    assert not app.store.has(_key(own))  # gone after two sweeps
    assert app.store.get(_key(shared)) == shared  # another repository's pointer keeps it
    app.store.sweep(0)
    # the rows of the deleted pointer blobs went at the next mark
    assert {m for _b, m in app.lfs.rows()} == {_key(shared).raw}


def test_media_is_not_deleted_when_its_pointer_arrives_between_mark_and_delete(
    make_repo, app: Alkfs
):
    media = os.urandom(2000)
    key = app.store.add(media)  # uploaded first (as git-lfs does), nothing names it yet
    app.store.sweep(0)  # staged
    repo = _lfs_repo(make_repo, {"m.bin": media})
    fired = []

    def push_now():  # a push landing after the mark, before the delete
        if not fired:
            fired.append(import_repo(app, repo.gitdir, "late"))
        return ()

    token = app.store.arbiter.register_protect(push_now)
    try:
        report = app.store.sweep(0)
    finally:
        app.store.unregister(token)
    assert fired and report.cancelled_by_arbitration >= 1
    assert app.store.get(key) == media
    for _ in range(3):
        app.store.sweep(0)
    assert app.store.get(key) == media


def test_the_scan_is_a_resumable_backfill_of_a_store_made_before_the_table(
    make_repo, tmp_path, monkeypatch
):
    monkeypatch.setenv("ALKFS_DRAIN", "0")  # (a store made before the table: never drained)
    media = {f"f{i}.bin": os.urandom(100 + i) for i in range(5)}
    repo = _lfs_repo(make_repo, media)
    with Alkfs.open(tmp_path / "s", window_s=0) as app:
        import_repo(app, repo.gitdir, "r")
        # as a store made before the table: no rows, no position
        with app.lfs.tables.tx() as conn:
            conn.execute("DELETE FROM lfs_pointers")
            conn.execute("DELETE FROM meta WHERE name = ?", (lfs.SCANNED,))
    monkeypatch.setattr(lfs, "SCAN_PAGE", 3)  # many pages: resumed page by page
    with Alkfs.open(tmp_path / "s", window_s=0) as app:
        calls = []
        real = app.lfs.tables.tx

        def failing_tx():
            calls.append(1)
            if len(calls) == 3:
                raise OSError("the disk went away")
            return real()

        monkeypatch.setattr(app.lfs.tables, "tx", failing_tx)
        with pytest.raises(OSError):
            app.lfs.scan()
        monkeypatch.setattr(app.lfs.tables, "tx", real)
        done = app.lfs._position()
        assert done == 6  # two pages of three arrivals committed before the failure
        app.lfs.scan()
        assert sorted(m for _b, m in app.lfs.rows()) == sorted(_key(c).raw for c in media.values())
        for _ in range(3):
            app.store.sweep(0)
        for content in media.values():
            assert app.store.get(_key(content)) == content


def test_a_borrowers_own_pointer_keeps_media_not_pushed(make_repo, app: Alkfs):
    media = os.urandom(3000)
    key = app.store.add(media)  # written to MNT/lfs by `git add` (lfs.storage)
    borrower = _lfs_repo(make_repo, {})  # its commit, not pushed: pointer in its own objects
    oid = hashlib.sha256(media).hexdigest()
    borrower.write("m.bin", pointer_text(oid, len(media)))
    borrower.commit("not pushed")
    app.roots.add("b", str(borrower.path))
    for _ in range(3):
        app.store.sweep(0)
    assert app.store.get(key) == media
    app.roots.remove("b")
    app.store.sweep(0)
    app.store.sweep(0)
    assert not app.store.has(key)


def _pointer_object(content: bytes) -> bytes:
    body = pointer_text(hashlib.sha256(content).hexdigest(), len(content))
    return b"blob %d\0" % len(body) + body


def test_a_pointer_blob_pinned_by_a_push_in_flight_keeps_its_media(app: Alkfs):
    """The push's pointer blob is stored and pinned, its ref not written yet, when the
    sweep that would delete the (staged) media runs."""
    media = os.urandom(3000)
    key = app.store.add(media)
    app.store.sweep(0)  # staged
    result = app.store.put(_pointer_object(media), algo=Algorithm.GIT_SHA1)  # held
    try:
        for _ in range(3):
            app.store.sweep(0)
        assert app.store.get(key) == media
    finally:
        result.pin.release()


def test_a_staged_pointer_blob_sent_again_keeps_its_media(app: Alkfs):
    """A branch deleted (pointer and media staged together), then pushed again while a
    sweep runs: the pointer blob is put again (a dedup) and pinned; the media stay."""
    media = os.urandom(3000)
    key = app.store.add(media)
    pointer = app.store.add(_pointer_object(media), algo=Algorithm.GIT_SHA1)
    staged = app.store.window.visible_after
    for _ in range(3):  # until both are staged (an arrival's media wait one sweep more)
        if staged(key.raw) is not None and staged(pointer.raw) is not None:
            break
        app.store.sweep(3600)
    assert staged(key.raw) is not None and staged(pointer.raw) is not None
    fired = []
    calls = []

    def push_again():  # at the delete batch, after the mark: the same pointer again
        calls.append(1)
        if len(calls) == 2:  # (the first call is the mark's)
            fired.append(app.store.put(_pointer_object(media), algo=Algorithm.GIT_SHA1))
        return ()

    token = app.store.arbiter.register_protect(push_again)
    try:
        app.store.sweep(0, expire_now=True)  # both due now
    finally:
        app.store.unregister(token)
    try:
        assert fired and app.store.has(pointer) and app.store.get(key) == media
    finally:
        fired[0].pin.release()


def test_a_pointer_stored_inside_a_delete_batch_keeps_its_media(app: Alkfs, monkeypatch):
    """A pointer stored after the batch's protect snapshot, just before the media's
    arbitration: the media stay, the other (non-sha256) candidates of the batch go."""
    media = os.urandom(3000)
    others = [app.store.add(os.urandom(100), algo=Algorithm.BLAKE3) for _ in range(3)]
    key = app.store.add(media)
    app.store.sweep(0)
    held = []
    arbiter = app.store.arbiter
    real = arbiter.arbitrate

    def arbitrate(raw, protected=None):
        if raw == key.raw and not held:
            held.append(app.store.put(_pointer_object(media), algo=Algorithm.GIT_SHA1))
        return real(raw, protected)

    monkeypatch.setattr(arbiter, "arbitrate", arbitrate)
    app.store.sweep(0)
    try:
        assert held and app.store.get(key) == media
        assert not any(app.store.has(k) for k in others)
    finally:
        held[0].pin.release()
