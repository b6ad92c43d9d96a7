"""The venv's pyfuse3 is the Makefile's patched build: opens can skip FLUSH."""

from __future__ import annotations

import pyfuse3
from alkfsd import fs
from alkfsd.handles import StagedHandle
from alkfsd.nodes.base import BytesHandle


def test_the_venvs_pyfuse3_is_built_with_fileinfo_noflush() -> None:
    assert fs.NOFLUSH is True
    fi = pyfuse3.FileInfo(fh=7, noflush=True)
    assert (fi.fh, fi.noflush, fi.keep_cache) == (7, True, True)


def test_only_handles_with_nothing_to_flush_skip_it() -> None:
    read_only = fs._file_info(3, BytesHandle.__new__(BytesHandle))
    staged = fs._file_info(4, StagedHandle.__new__(StagedHandle))
    assert (read_only.fh, read_only.noflush) == (3, True)
    assert (staged.fh, staged.noflush) == (4, False)
