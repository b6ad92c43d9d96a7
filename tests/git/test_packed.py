"""Git objects the store holds only in its packs (alkfs/git/packed.py, `Store.packed`):
read through the library byte-identical to git, verified, and a damaged pack failing
exactly the objects it affects, which are listed corrupt while the rest are served."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from helpers import git_objects

from alkfs.app import Alkfs
from alkfs.errors import Corrupt
from alkfs.git import packs
from alkfs.git.importer import import_repo
from alkfs.git.packread import PackSet
from alkfs.keys import Algorithm, Key

from .scenarios import everything

ALGO = {"sha1": Algorithm.GIT_SHA1, "sha256": Algorithm.GIT_SHA256}


def _packed_only(app: Alkfs, src, fmt: str) -> dict[Key, bytes]:
    """Import `src`: the import leaves its objects in the packs alone, no kv row (the
    drain): {key: git's canonical bytes}."""
    import_repo(app, src.gitdir, "r", progress=False)
    d = packs.derived_for(app.store, fmt)
    assert d is not None and d.current() is not None
    algo = ALGO[fmt]
    out = {}
    for hexid, canonical in git_objects(src.gitdir).items():
        key = Key.from_hex(algo, hexid)
        assert key.digest in d.current()
        out[key] = canonical
        assert app.store.kv.read(key.raw) is None
    return out


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_packed_objects_read_as_git_has_them(app, make_repo, fmt):
    src = make_repo(fmt)
    everything(src)
    objects = _packed_only(app, src, fmt)
    assert len(objects) > 30
    for key, canonical in objects.items():
        assert app.store.has(key)
        st = app.store.stat(key)
        assert st is not None and (st.tier, st.size) == ("packs", len(canonical))
        assert app.store.get(key) == canonical
        piece, digest = app.store.read_range(key, 3, 9) or (b"", "")
        assert piece == canonical[3:12]
        assert digest == hashlib.sha256(canonical[3:12]).hexdigest()
    assert not app.store.corrupt
    absent = Key.from_hex(ALGO[fmt], "ab" * (20 if fmt == "sha1" else 32))
    assert app.store.get(absent) is None and not app.store.has(absent)


def test_a_damaged_pack_fails_exactly_the_objects_it_affects(app, make_repo):
    src = make_repo()
    everything(src)
    objects = _packed_only(app, src, "sha1")
    gen = packs.derived_for(app.store, "sha1").current()
    assert gen is not None
    pack = max(
        (Path(idx.path).with_suffix(".pack") for idx in gen.indexes), key=lambda p: p.stat().st_size
    )
    # a byte in the middle of the largest pack's object data (past its 12-byte header)
    data = bytearray(pack.read_bytes())
    at = 12 + (len(data) - 12 - 20) // 2  # (between the header and the trailer)
    pack.chmod(0o644)
    data[at] ^= 0x5A
    pack.write_bytes(bytes(data))
    # what the reader itself calls affected, from a fresh look at the damaged pack
    with_damage = PackSet([Path(i.path).with_suffix(".pack") for i in gen.indexes], "sha1")
    affected = {Key(b"\x03" + d) for d in with_damage.check([k.digest for k in objects])}
    assert affected and len(affected) < len(objects)
    failed = set()
    for key, canonical in objects.items():
        try:
            got = app.store.get(key)
        except Corrupt as exc:
            assert key.hex in str(exc)
            failed.add(key)
            continue
        assert got == canonical
    assert failed == affected
    assert {Key(raw) for raw in app.store.corrupt} == affected
