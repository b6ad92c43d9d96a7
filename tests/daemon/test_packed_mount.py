"""Git objects held only in the store's packs, read through a real mount: `/objects/git-sha1`,
the loose view `/git/sha1/xx/` and git in `/repos/ID` give git's bytes; the tier says
`packs`; a byte flipped in a pack fails (EIO) exactly the objects it affects, which
`status` lists corrupt, while the rest are served."""

from __future__ import annotations

import errno
import json
import os
import time
import zlib
from pathlib import Path

import pytest
from helpers import damage_pack_objects, flip_pack_byte, git, git_objects, git_out

from alkfs.app import Alkfs
from alkfs.git import packs
from alkfs.git.importer import import_repo
from alkfs.git.packread import PackSet
from alkfs.keys import Algorithm, Key

pytestmark = pytest.mark.mount


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    git("init", "-q", "-b", "main", str(src))
    for i in range(12):
        (src / f"d{i % 3}").mkdir(exist_ok=True)
        (src / f"d{i % 3}" / "f.txt").write_text("".join(f"line {j} of {i}\n" for j in range(40)))
        (src / "top.txt").write_text(f"round {i}\n" * (i + 1))
        git("add", "-A", cwd=src)
        git("commit", "-q", "-m", f"c{i}", cwd=src)
    git("repack", "-adq", cwd=src)
    return src


def _packed_store(tmp_path: Path, src: Path) -> Path:
    """A store holding `src`'s objects in its packs only (the import drained their kv rows)."""
    store = tmp_path / "store"
    with Alkfs.open(store) as app:
        import_repo(app, str(src / ".git"), "r", progress=False)
        gen = packs.derived_for(app.store, "sha1").current()
        assert gen is not None
        for hexid in git_objects(src / ".git"):
            key = Key.from_hex(Algorithm.GIT_SHA1, hexid)
            assert key.digest in gen
            assert app.store.kv.read(key.raw) is None
    return store


def test_packed_objects_read_through_every_view(tmp_path, start_mount):
    src = _source(tmp_path)
    objects = git_objects(src / ".git")
    m = start_mount(_packed_store(tmp_path, src))
    for hexid, canonical in objects.items():
        obj = m.path("objects", "git-sha1", hexid)
        assert obj.read_bytes() == canonical
        assert os.getxattr(obj, "user.alkfs.tier") == b"packs"
        assert os.getxattr(obj, "user.alkfs.size") == str(len(canonical)).encode()
        kind = canonical.split(b" ", 1)[0]
        assert os.getxattr(obj, "user.alkfs.git.type") == kind
        loose = m.path("git", "sha1", hexid[:2], hexid[2:])
        assert zlib.decompress(loose.read_bytes()) == canonical
    repo = m.path("repos", "r")
    git("--git-dir", str(repo), "fsck", "--full", "--strict")
    assert git_out("--git-dir", str(repo), "rev-parse", "main") == git_out(
        "rev-parse", "main", cwd=src
    )
    assert json.loads(m.path(".alkfs", "status").read_text())["corrupt"] == []
    lines = m.path(".alkfs", "metrics").read_text().splitlines()  # (counted by tier)
    assert f'alkfs_objects{{algo="git-sha1",tier="packs"}} {float(len(objects))}' in lines
    assert 'alkfs_objects{algo="git-sha1",tier="kv"} 0.0' in lines


def test_a_flipped_byte_in_a_pack_fails_only_what_it_affects(tmp_path, start_mount):
    src = _source(tmp_path)
    objects = git_objects(src / ".git")
    store = _packed_store(tmp_path, src)
    gen_dirs = sorted((store / "derived" / "sha1").glob("gen-*"))
    pack = max(gen_dirs[-1].glob("pack/*.pack"), key=lambda p: p.stat().st_size)
    damage_pack_objects(pack)
    affected = {d.hex() for d in PackSet([pack], "sha1").check([bytes.fromhex(h) for h in objects])}
    assert affected and len(affected) < len(objects)
    m = start_mount(store)
    failed = set()
    for hexid, canonical in objects.items():
        try:
            got = m.path("objects", "git-sha1", hexid).read_bytes()
        except OSError as exc:
            assert exc.errno == errno.EIO
            failed.add(hexid)
            continue
        assert got == canonical
    assert failed == affected
    corrupt = json.loads(m.path(".alkfs", "status").read_text())["corrupt"]
    assert {c.split("/")[-1] for c in corrupt} == affected


def test_a_set_that_fails_its_checksums_at_start_is_kept_and_reported(tmp_path, start_mount):
    """The packs are the only copy (the import drained the kv): a set whose pack no longer
    matches its trailer is not withdrawn at start; every object it affects is listed in
    `status.corrupt` before anything reads it, and the rest are served."""
    src = _source(tmp_path)
    objects = git_objects(src / ".git")
    store = _packed_store(tmp_path, src)
    current = store / "derived" / "sha1" / "CURRENT"
    number = current.read_text()
    [gen_dir] = sorted((store / "derived" / "sha1").glob("gen-*"))
    pack = max(gen_dir.glob("pack/*.pack"), key=lambda p: p.stat().st_size)
    flip_pack_byte(pack)  # (its trailer left as it was)
    affected = {d.hex() for d in PackSet([pack], "sha1").check([bytes.fromhex(h) for h in objects])}
    assert affected and len(affected) < len(objects)
    m = start_mount(store, "--window", "1h")

    def status() -> dict:
        return json.loads(m.path(".alkfs", "status").read_text())

    deadline = time.monotonic() + 30  # (the start's check runs in the background)
    while not status()["packs"]["sha1"]["last_error"]:
        assert time.monotonic() < deadline, "no check of the set within 30 s"
        time.sleep(0.05)
    st = status()
    assert {c.split("/")[-1] for c in st["corrupt"]} == affected
    assert "corrupt at verify" in st["packs"]["sha1"]["last_error"]
    assert st["packs"]["sha1"]["primary"] is True
    assert current.read_text() == number and pack.exists()  # (not withdrawn)
    for hexid, canonical in objects.items():
        if hexid not in affected:
            assert m.path("objects", "git-sha1", hexid).read_bytes() == canonical
    with pytest.raises(OSError) as exc:
        m.path("objects", "git-sha1", sorted(affected)[0]).read_bytes()
    assert exc.value.errno == errno.EIO
