"""The venv's pyfuse3 is the Makefile's patched build: opens can skip FLUSH, directory
opens can ask the kernel to cache the listing."""

from __future__ import annotations

import pyfuse3
from alkfsd import listings, requests
from alkfsd.nodes.handles import BytesHandle
from alkfsd.staging.staged import StagedHandle


def test_the_venvs_pyfuse3_is_built_with_fileinfo_noflush() -> None:
    assert requests.NOFLUSH is True
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
    assert listings.CACHE_READDIR is True, "pyfuse3 predates the patch: run `make setup`"
    fi = pyfuse3.FileInfo(fh=8, keep_cache=False, cache_readdir=True)
    assert (fi.fh, fi.keep_cache, fi.cache_readdir, fi.noflush) == (8, False, True, False)
    assert pyfuse3.FileInfo().cache_readdir is False
