"""The venv's pyfuse3 is the Makefile's patched build: opens can skip FLUSH, directory
opens can ask the kernel to cache the listing, and a worker reads a queued request
without waiting for the device first (third_party/pyfuse3-fastread.patch). alkfsd
refuses to start with a pyfuse3 built without the patches (pyfuse3_patches)."""

from __future__ import annotations

import hashlib
import os
import random
import threading
import types

import pyfuse3
from helpers import fuse_fds

from alkfsd import pyfuse3_patches, requests
from alkfsd.nodes.handles import BytesHandle
from alkfsd.staging.staged import StagedHandle


def test_the_venvs_pyfuse3_has_every_patch() -> None:
    assert pyfuse3_patches.missing(pyfuse3) == [], "run `make setup`"
    assert pyfuse3_patches.refusal(pyfuse3) is None


class _StockFileInfo:
    """A stock pyfuse3's FileInfo: no noflush, no cache_readdir."""

    fh = 0
    keep_cache = True
    direct_io = False


def test_a_pyfuse3_without_the_patches_is_refused_in_one_line() -> None:
    stock = types.SimpleNamespace(__name__="pyfuse3", FileInfo=_StockFileInfo)
    assert pyfuse3_patches.missing(stock) == list(pyfuse3_patches.PATCHES)
    why = pyfuse3_patches.refusal(stock)
    assert why is not None and "\n" not in why
    assert "pyfuse3-noflush.patch" in why and "make setup" in why
    # the patched build's features, one patch left out: only that one is named
    patched = types.SimpleNamespace(
        FileInfo=pyfuse3.FileInfo,
        NEXT_WAIT_NS=200_000,
        CACHED_DIR_FH=1 << 63,
        cached_dirs_add=pyfuse3.cached_dirs_add,
    )
    assert pyfuse3_patches.missing(patched) == ["pyfuse3-nogilcopy.patch"]


def test_the_venvs_pyfuse3_is_built_with_fileinfo_noflush() -> None:
    fi = pyfuse3.FileInfo(fh=7, noflush=True)
    assert (fi.fh, fi.noflush, fi.keep_cache) == (7, True, True)


def test_only_handles_with_nothing_to_flush_skip_it() -> None:
    read_only = requests.file_info(3, BytesHandle.__new__(BytesHandle))
    staged = requests.file_info(4, StagedHandle.__new__(StagedHandle))
    assert (read_only.fh, read_only.noflush) == (3, True)
    assert (staged.fh, staged.noflush) == (4, False)


def test_the_venvs_pyfuse3_lets_opendir_ask_for_a_cached_listing() -> None:
    """FileInfo.cache_readdir (the same patch): without it the daemon opens directories
    as before, so a venv built before the patch had it must be rebuilt (`make setup`)."""
    fi = pyfuse3.FileInfo(fh=8, keep_cache=False, cache_readdir=True)
    assert (fi.fh, fi.keep_cache, fi.cache_readdir, fi.noflush) == (8, False, True, False)
    assert pyfuse3.FileInfo().cache_readdir is False


def test_the_venvs_pyfuse3_reads_the_device_without_blocking(start_mount) -> None:
    """The fast-read patch is in the build (FAST_READS) and the daemon's /dev/fuse is
    non-blocking (a stock pyfuse3 leaves it blocking and waits for the fd before every
    read). (That a worker yields after FAST_READS requests in a row is not observed.)"""
    assert getattr(pyfuse3, "FAST_READS", None) == 16, "pyfuse3 predates the patch: make setup"
    m = start_mount()
    fds = fuse_fds(m.pid)
    assert len(fds) == 1, fds
    with open(f"/proc/{m.pid}/fdinfo/{fds[0]}") as f:
        flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
    assert flags & os.O_NONBLOCK


def test_the_venvs_pyfuse3_waits_briefly_for_the_next_request_and_answers_cached_dirs():
    """The fast-read patch's short wait after each answer (NEXT_WAIT_NS, 200 us unless
    PYFUSE3_NEXT_WAIT_NS says otherwise) and the cacheddirs patch (cached_dirs_*:
    an added inode is refused after a reset, the count follows) are in the build."""
    expected = int(os.environ.get("PYFUSE3_NEXT_WAIT_NS", "200000"))
    assert getattr(pyfuse3, "NEXT_WAIT_NS", None) == expected, "run `make setup`"
    old = pyfuse3.cached_dirs_epoch()
    pyfuse3.cached_dirs_reset()
    assert pyfuse3.cached_dirs_count() == 0
    assert pyfuse3.cached_dirs_add(77, old) is False  # a check older than the reset
    assert pyfuse3.cached_dirs_add(77, pyfuse3.cached_dirs_epoch(), True) is True
    assert pyfuse3.cached_dirs_count() == 1
    pyfuse3.cached_dirs_discard(77)
    assert pyfuse3.cached_dirs_count() == 0
    assert pyfuse3.CACHED_DIR_FH == 1 << 63


def test_the_venvs_pyfuse3_copies_large_writes_without_the_gil(start_mount) -> None:
    """The nogilcopy patch is in the build (NOGIL_COPY_MIN: a WRITE's data of 64 KiB or
    more is copied into its bytes object with the GIL released), and writes on both sides
    of that size, and across it within one file, arrive byte for byte."""
    assert getattr(pyfuse3, "NOGIL_COPY_MIN", None) == 65536, "run `make setup`"
    m = start_mount()
    rng = random.Random(9)
    sizes = [1, 4096, 65535, 65536, 65537, 1 << 20, (1 << 20) + 7]
    body = rng.randbytes(sum(sizes))
    path = m.mnt / "pins" / "nogil-copy"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        off = 0
        for n in sizes:  # one write() each: the kernel passes each as one WRITE (<= 1 MiB)
            assert os.write(fd, body[off : off + n]) == n
            off += n
    finally:
        os.close(fd)
    assert path.read_bytes() == body
    digest = hashlib.sha256(body).hexdigest()
    assert (m.mnt / "objects" / "sha256" / digest).read_bytes() == body


def test_requests_from_many_threads_at_once_are_all_answered(start_mount) -> None:
    """Eight threads open, list and stat the fan-out directories at once (requests queue
    up, so workers read them back to back): every call succeeds, and the mount still
    takes a write and reads it back afterwards. A guard of the patched read loop (a lost
    or unanswered request fails it); a stock pyfuse3 passes it too."""
    m = start_mount()
    base = m.mnt / "git" / "sha1"
    errors: list[BaseException] = []
    done = [0] * 8

    def hammer(k: int) -> None:
        try:
            for i in range(300):
                d = base / f"{(k * 300 + i) % 256:02x}"
                fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
                os.close(fd)
                assert os.listdir(d) == []
                assert os.stat(d).st_mode & 0o040000
                done[k] += 1
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert done == [300] * 8
    (m.mnt / "pins" / "after").write_bytes(b"still answering\n")
    assert (m.mnt / "pins" / "after").read_bytes() == b"still answering\n"
