"""Writing through /objects/<algo>/ on a real mount: plain tools store files under their
digest, the created name disappears, a digest name the content does not match fails with EIO
and stores nothing, existing objects refuse write-opens and unlinks (EPERM), and touch/utime
freshen while no-op chmod/chown succeed (cp -p, cp -a)."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
from pathlib import Path

import blake3
import pytest
from helpers import os_errno, run, sha, sweep, write_close

SMALL = b"a small object, kept in sqlite\n"
LARGE = bytes(range(256)) * 800  # 204800 bytes: over the default threshold, the large tier
STREAMED = bytes(range(251)) * 12_000  # ~3 MiB: past the in-memory limit, streamed into a put
OTHER = b"something else entirely\n"


def refused(*args: str | os.PathLike[str]) -> str:
    """Run a tool that must fail; its stderr."""
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, (args, done.stdout)
    return done.stderr


def listing(m, algo: str = "sha256") -> list[str]:
    return sorted(os.listdir(m.path("objects", algo)))


def serves(m, key_hex: str, data: bytes) -> None:
    """The daemon still serves normally: a read of a stored object gives its bytes."""
    assert m.path("objects", "sha256", key_hex).read_bytes() == data


def leftovers(m) -> list[str]:
    """Spool and staging files in the store (none once every writer closed): STORE/spool and
    large/.staging, or a fleet member's (a PostgreSQL store) nodes/<id>/spool and
    large/.staging/<id>/."""
    found = []
    dirs = [m.store_path / "spool", m.store_path / "large" / ".staging"]
    for d in [*dirs, *m.store_path.glob("nodes/*/spool")]:
        for root, subdirs, names in os.walk(d):
            here = Path(root).relative_to(m.store_path)
            found += [str(here / n) for n in names]
            if d == dirs[0] or d.parent.parent.name == "nodes":
                found += [str(here / n) for n in subdirs]
    return sorted(found)


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir(mode=0o755)
    src.chmod(0o755)  # as the mount's directories: cp -a copies a directory's mode
    (src / "small.txt").write_bytes(SMALL)
    (src / "large.bin").write_bytes(LARGE)
    (src / "streamed.bin").write_bytes(STREAMED)
    return src


def test_cp_stores_each_file_under_its_digest_and_the_created_name_disappears(mount, sources):
    m = mount
    for name in ("small.txt", "large.bin", "streamed.bin"):
        run("cp", sources / name, m.path("objects", "sha256"))
        assert not m.path("objects", "sha256", name).exists()
    hexes = sorted(sha(d) for d in (SMALL, LARGE, STREAMED))
    assert listing(m) == hexes
    out = run("sha256sum", *(m.path("objects", "sha256", h) for h in hexes))
    assert out == "".join(f"{h}  {m.path('objects', 'sha256', h)}\n" for h in hexes)
    tiers = {
        h: os.getxattr(m.path("objects", "sha256", h), "user.alkfs.tier").decode() for h in hexes
    }
    assert tiers == {sha(SMALL): "kv", sha(LARGE): "large", sha(STREAMED): "large"}
    assert m.path("objects", "sha256", sha(STREAMED)).read_bytes() == STREAMED
    assert leftovers(m) == []
    assert m.tracebacks() == []


def test_cp_r_into_objects_stores_every_file_of_a_tree_under_each_algorithm(mount, sources):
    m = mount
    run("cp", "-r", f"{sources}/.", m.path("objects", "sha256"))
    run("cp", "-r", f"{sources}/.", m.path("objects", "blake3"))
    datas = (SMALL, LARGE, STREAMED)
    assert listing(m, "sha256") == sorted(sha(d) for d in datas)
    assert listing(m, "blake3") == sorted(blake3.blake3(d).hexdigest() for d in datas)
    out = run("sha256sum", *(m.path("objects", "sha256", sha(d)) for d in datas))
    assert [line.split()[0] for line in out.splitlines()] == [sha(d) for d in datas]
    for d in datas:
        assert m.path("objects", "blake3", blake3.blake3(d).hexdigest()).read_bytes() == d


def test_cp_p_and_cp_a_keep_working_chmod_chown_and_times_on_the_new_file(mount, sources):
    m = mount
    os.chmod(sources / "small.txt", 0o600)
    run("cp", "-p", sources / "small.txt", m.path("objects", "sha256"))
    run("cp", "-a", f"{sources}/.", m.path("objects", "sha256"))  # the directory too
    run("cp", "-rp", f"{sources}/.", m.path("objects", "sha256"))
    assert listing(m) == sorted(sha(d) for d in (SMALL, LARGE, STREAMED))


def test_git_objects_can_be_written_under_the_git_algorithms(mount):
    m = mount
    blob = b"blob 6\0hello\n"
    write_close(m.path("objects", "git-sha1", "new"), blob)
    oid = hashlib.sha1(blob).hexdigest()
    assert listing(m, "git-sha1") == [oid]
    assert os.getxattr(m.path("objects", "git-sha1", oid), "user.alkfs.git.type") == b"blob"


def test_a_digest_name_the_content_does_not_match_fails_with_eio_and_stores_nothing(mount):
    m = mount
    write_close(m.path("objects", "sha256", "keep"), SMALL)
    wrong = sha(OTHER)
    for data in (SMALL + b"!", LARGE, STREAMED):
        assert os_errno(write_close, m.path("objects", "sha256", wrong), data) == errno.EIO
        assert listing(m) == [sha(SMALL)]
        assert not m.path("objects", "sha256", wrong).exists()
        serves(m, sha(SMALL), SMALL)
    err = refused("cp", Path("/etc/hostname"), m.path("objects", "sha256", wrong))
    assert "Input/output error" in err
    assert listing(m) == [sha(SMALL)]
    assert leftovers(m) == []


def test_a_digest_name_the_content_matches_stores_it(mount):
    m = mount
    for data in (SMALL, STREAMED):
        write_close(m.path("objects", "sha256", sha(data)), data)
    assert listing(m) == sorted([sha(SMALL), sha(STREAMED)])
    assert m.path("objects", "sha256", sha(STREAMED)).read_bytes() == STREAMED


def test_opening_an_existing_object_for_writing_is_eperm(mount):
    m = mount
    write_close(m.path("objects", "sha256", "x"), SMALL)
    path = m.path("objects", "sha256", sha(SMALL))
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_APPEND, os.O_WRONLY | os.O_TRUNC):
        assert os_errno(os.open, path, flags) == errno.EPERM
        serves(m, sha(SMALL), SMALL)
    assert "Operation not permitted" in refused("cp", "/etc/hostname", path)
    serves(m, sha(SMALL), SMALL)


def test_rm_of_an_object_is_eperm_and_it_stays(mount):
    m = mount
    write_close(m.path("objects", "sha256", "x"), SMALL)
    path = m.path("objects", "sha256", sha(SMALL))
    assert os_errno(os.unlink, path) == errno.EPERM
    assert "Operation not permitted" in refused("rm", "-f", path)
    serves(m, sha(SMALL), SMALL)
    assert os_errno(os.unlink, m.path("objects", "sha256", sha(OTHER))) == errno.ENOENT


def test_a_file_removed_while_being_written_stores_nothing(mount):
    m = mount
    path = m.path("objects", "sha256", "scratch")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, STREAMED)
        os.unlink(path)
    finally:
        os.close(fd)
    assert listing(m) == []


def test_writes_that_go_back_are_stored_as_the_final_content(mount):
    """A writer that seeks back (a header patched at the end) and reads what it wrote."""
    m = mount
    expected = bytearray(STREAMED) + b"tail"
    expected[10:16] = b"PATCH!"
    with open(m.path("objects", "sha256", "patched"), "w+b") as f:
        f.write(STREAMED)
        f.seek(10)
        f.write(b"PATCH!")
        f.seek(0, os.SEEK_END)
        f.write(b"tail")
        f.seek(8)
        assert f.read(10) == bytes(expected[8:18])
    assert sha(bytes(expected)) in listing(m)
    assert m.path("objects", "sha256", sha(bytes(expected))).read_bytes() == expected


def test_the_streamed_part_of_a_file_that_goes_back_is_left_to_the_sweep(mount):
    """What was streamed before a write went back is stored as an object of its own and
    left unreferenced, not deleted at once: the same bytes may have been stored and named
    by another writer meanwhile (their put dedups into it)."""
    m = mount
    sweep(m)  # the ref closure is known: liveness says "dead" for unreferenced bytes
    with open(m.path("objects", "sha256", "back"), "w+b") as f:
        f.write(STREAMED)
        f.flush()  # streamed to the store
        f.seek(0)
        f.write(b"X")  # goes back: the streamed part becomes an object, writes spool
    final = b"X" + STREAMED[1:]
    assert sha(STREAMED) in listing(m) and sha(final) in listing(m)
    assert m.path("objects", "sha256", sha(STREAMED)).read_bytes() == STREAMED
    assert m.path("objects", "sha256", sha(final)).read_bytes() == final
    assert leftovers(m) == []


def test_touch_freshens_an_object_so_a_staged_delete_of_it_is_cancelled(mount):
    m = mount
    write_close(m.path("objects", "sha256", "orphan"), SMALL)
    path = m.path("objects", "sha256", sha(SMALL))
    first = sweep(m)
    assert (first["candidates_staged"], first["deleted"]) == (1, 0)
    run("touch", path)
    second = sweep(m)
    assert (second["deleted"], second["cancelled_by_arbitration"]) == (0, 1)
    serves(m, sha(SMALL), SMALL)
    os.utime(path, (1_000_000, 1_000_000))  # utime with explicit times: also a freshen
    third = sweep(m)
    assert (third["deleted"], third["cancelled_by_arbitration"]) == (0, 1)
    fourth = sweep(m)  # not freshened since it was staged again: deleted now
    assert (fourth["deleted"], fourth["cancelled_by_arbitration"]) == (1, 0)
    assert not path.exists()


def test_chmod_chown_truncate_to_the_current_value_succeed_and_any_change_is_eperm(mount):
    m = mount
    write_close(m.path("objects", "sha256", "x"), SMALL)
    path = m.path("objects", "sha256", sha(SMALL))
    run("chmod", "444", path)
    run("chown", f"{os.getuid()}:{os.getgid()}", path)
    os.truncate(path, len(SMALL))  # (truncate(1) opens for writing: EPERM, as any write-open)
    assert os_errno(os.chmod, path, 0o644) == errno.EPERM
    assert os_errno(os.chown, path, os.getuid() + 1, -1) == errno.EPERM
    assert os_errno(os.truncate, path, 1) == errno.EPERM
    st = os.stat(path)
    assert (st.st_mode & 0o7777, st.st_size) == (0o444, len(SMALL))
    serves(m, sha(SMALL), SMALL)
    run("touch", m.path("objects", "sha256"))  # the directories accept times (cp -rp)
    assert os_errno(os.chmod, m.path("objects", "sha256"), 0o700) == errno.EPERM


@pytest.mark.not_on_postgres("STORE/spool is a single daemon's: a fleet member's is new each start")
def test_a_stale_spool_file_is_removed_at_start(start_mount, tmp_path):
    store = tmp_path / "store"
    (store / "spool").mkdir(parents=True)
    (store / "spool" / "w-left-by-a-crash").write_bytes(b"x" * 1000)
    m = start_mount(store, "--window", "0")
    assert os.listdir(store / "spool") == []
    write_close(m.path("objects", "sha256", "x"), SMALL)
    serves(m, sha(SMALL), SMALL)


def test_a_put_over_the_kv_only_threshold_is_efbig_and_stores_nothing(start_mount, tmp_path):
    m = start_mount(tmp_path / "kv", "--window", "0", "--kv-only")
    assert os_errno(write_close, m.path("objects", "sha256", "big"), STREAMED) == errno.EFBIG
    assert listing(m) == []
    write_close(m.path("objects", "sha256", "small"), SMALL)
    serves(m, sha(SMALL), SMALL)
