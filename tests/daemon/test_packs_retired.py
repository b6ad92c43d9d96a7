"""Retired pack generations (daemon/packs.py): a name git listed before a publish still
opens, for the grace, with the same bytes; and no reader can keep retired generations on
disk without bound: past ALKFS_PACK_RETIRED_MAX of them, or ALKFS_PACK_RETIRE_HOLD after
retirement, the daemon revokes the handles (reads: EIO) and the files go."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from helpers import git_out as git
from test_packs_mount import (
    PAIR_INTAKE,
    idx_ids,
    imported_store,
    listing,
    pack_holding,
    put_loose,
    wait_for,
)

FAST_INTAKE = {"ALKFS_PACK_EVERY": "0", "ALKFS_PACK_POLL": "0.2"}


def current(store: Path) -> int:
    return int((store / "derived" / "sha1" / "CURRENT").read_text())


def generations(store: Path) -> set[int]:
    return {int(p.name[4:]) for p in (store / "derived" / "sha1").glob("gen-*")}


def daemon_fds_under(pid: int, root: Path) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(root)):
            out.append(target)
    return out


def test_names_listed_before_a_publish_still_open_with_their_bytes(start_mount, tmp_path):
    """A git-like reader lists pack/, a set is published that drops those names (a sweep
    staged an object of the intake pack: the set is consolidated), then the reader opens
    what it listed: every file opens, reads its retired bytes, and git verifies the pack."""
    store, _src = imported_store(tmp_path)
    env = {**PAIR_INTAKE, "ALKFS_PACK_RETIRE_GRACE": "120"}
    m = start_mount(store, "--window", "1h", env=env)
    mnt = m.mnt
    oid = put_loose(mnt, "sha1", b"in an intake pack, then staged\n")
    kept = put_loose(mnt, "sha1", b"in the same intake pack, pinned\n")
    os.symlink(f"../objects/git-sha1/{kept}", mnt / "pins" / "kept")
    wait_for("the intake pack", lambda: {oid, kept} <= idx_ids(mnt, "sha1"))
    intake = pack_holding(mnt, oid)
    listed = [n for n in listing(mnt, "sha1") if n.endswith((".idx", ".pack"))]
    gen = store / "derived" / "sha1" / f"gen-{current(store)}"
    expected = {n: (gen / "pack" / n).read_bytes() for n in listed}
    (mnt / ".alkfs" / "control").write_text("sweep\n")  # stages oid: a set without it
    wait_for("a consolidated set", lambda: intake not in listing(mnt, "sha1"))
    assert not set(listed) <= set(listing(mnt, "sha1"))  # (names the new set lacks)
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in listed:  # opened only now, after the publish
        data = (mnt / "git" / "sha1" / "pack" / name).read_bytes()
        assert data == expected[name], name
        (copy / name).write_bytes(data)
    for name in listed:
        if name.endswith(".pack"):
            out = git("verify-pack", "-v", copy / name)
            assert out.count(" commit ") + out.count(" tree ") + out.count(" blob ") >= 1
    assert oid in git("verify-pack", "-v", copy / intake)


def test_readers_holding_retired_sets_cannot_keep_more_than_the_bound(start_mount, tmp_path):
    """A reader opens each published multi-pack-index and holds it while six more sets are
    published: at most ALKFS_PACK_RETIRED_MAX (2) retired generations stay on disk; the
    handles of the ones that went read EIO and the daemon holds none of their files."""
    store, _src = imported_store(tmp_path)
    env = {
        **FAST_INTAKE,
        "ALKFS_PACK_RETIRE_GRACE": "0.5",
        "ALKFS_PACK_RETIRED_MAX": "2",
        "ALKFS_PACK_RETIRE_HOLD": "3600",
    }
    m = start_mount(store, env=env)
    mnt = m.mnt
    midx = mnt / "git" / "sha1" / "pack" / "multi-pack-index"
    held: list[tuple[int, int, bytes]] = []  # (generation, fd, its bytes)
    # and the main pack, opened in the first set: every intake keeps it (hard-linked),
    # so its handle moves to the published set and keeps reading
    packs = [n for n in listing(mnt, "sha1") if n.endswith(".pack")]
    main = max(packs, key=lambda n: os.stat(mnt / "git" / "sha1" / "pack" / n).st_size)
    main_fd = os.open(mnt / "git" / "sha1" / "pack" / main, os.O_RDONLY)
    try:
        for i in range(7):
            wait_for("no build in flight", lambda: current(store) == max(generations(store)))
            number = current(store)
            fd = os.open(midx, os.O_RDONLY)
            held.append(
                (
                    number,
                    fd,
                    (store / f"derived/sha1/gen-{number}/pack/multi-pack-index").read_bytes(),
                )
            )
            if i < 6:
                put_loose(mnt, "sha1", f"object {i} of the churn\n".encode())
                wait_for("the next set", lambda n=number: current(store) > n)
        last = current(store)
        kept = {n for n, _fd, _b in held[-3:-1]}  # the two newest retired ones
        wait_for("the bound", lambda: generations(store) == kept | {last})
        for number, fd, data in held:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # reads reach the daemon
            if number in kept or number == last:
                assert os.pread(fd, len(data) + 10, 0) == data, number
            else:
                with pytest.raises(OSError) as e:
                    os.pread(fd, 4096, 0)
                assert e.value.errno == errno.EIO, number
        gone = [f"{store}/derived/sha1/gen-{n}/" for n, _fd, _b in held[:-3]]
        held_gone = [
            t
            for t in daemon_fds_under(m.pid, store)
            if t.startswith(tuple(gone)) and f"/pack/{main}" not in t  # (its inode lives on)
        ]
        assert held_gone == [], held_gone
        assert main in listing(mnt, "sha1")
        data = (store / f"derived/sha1/gen-{last}/pack/{main}").read_bytes()
        os.posix_fadvise(main_fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(main_fd, len(data) + 10, 0) == data
    finally:
        os.close(main_fd)
        for _number, fd, _data in held:
            os.close(fd)
    wait_for("the released ones to go", lambda: generations(store) == {current(store)})


def test_a_held_retired_set_goes_when_its_hold_ends(start_mount, tmp_path):
    store, _src = imported_store(tmp_path)
    env = {**FAST_INTAKE, "ALKFS_PACK_RETIRE_GRACE": "0.5", "ALKFS_PACK_RETIRE_HOLD": "6"}
    m = start_mount(store, env=env)
    mnt = m.mnt
    number = current(store)
    fd = os.open(mnt / "git" / "sha1" / "pack" / "multi-pack-index", os.O_RDONLY)
    try:
        assert os.pread(fd, 12, 0)[:4] == b"MIDX"
        put_loose(mnt, "sha1", b"one more object\n")
        wait_for("the next set", lambda: current(store) > number)
        assert number in generations(store)  # held: kept past the grace
        wait_for("the hold to end", lambda: number not in generations(store))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with pytest.raises(OSError) as e:
            os.pread(fd, 4096, 0)
        assert e.value.errno == errno.EIO
    finally:
        os.close(fd)
    log = m.logs[-1].read_text()
    assert "revoked" in log and "ALKFS_PACK_RETIRE_HOLD" in log
