"""Starting the daemon the way an admin does: `--version`; a mistyped STORE is refused
unless `--create` (so it never becomes a new empty store), a MOUNTPOINT that is missing or a
file is refused, each in one line with exit 1 and nothing made; the start-up line says
whether sweeps run and how borrowing clones are kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from alkfs import __version__

ALKFSD = [sys.executable, "-m", "alkfsd.main"]


def alkfsd(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ALKFSD, *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )


def test_version_prints_the_version():
    done = alkfsd("--version")
    assert (done.returncode, done.stdout.strip()) == (0, f"alkfsd {__version__}")


def test_a_missing_store_without_create_is_refused_in_one_line_and_nothing_is_made(tmp_path):
    (tmp_path / "mnt").mkdir()
    done = alkfsd(tmp_path / "typo", tmp_path / "mnt")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"alkfsd: no store at {tmp_path / 'typo'}: give --create to make one there"
    ]
    assert not (tmp_path / "typo").exists()
    empty = tmp_path / "empty"  # (an existing directory that holds no store: the same)
    empty.mkdir()
    done = alkfsd(empty, tmp_path / "mnt")
    assert done.returncode == 1 and "give --create" in done.stderr
    assert list(empty.iterdir()) == []


def test_a_mountpoint_missing_or_not_a_directory_is_refused_in_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a directory\n")
    for mnt, what in ((tmp_path / "nope", "does not exist"), (afile, "is not a directory")):
        done = alkfsd(tmp_path / "store", mnt, "--create")
        assert done.returncode == 1, done.stderr
        assert done.stderr.splitlines() == [
            f"alkfsd: the mountpoint {mnt} {what} (make it with mkdir -p)"
        ]
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "nope").exists() and not (tmp_path / "store").exists()
    assert afile.read_text() == "not a directory\n"


def test_create_makes_a_store_once_and_the_start_up_line_says_how_it_sweeps(start_mount, tmp_path):
    store = tmp_path / "store"
    m = start_mount(store, "--window", "0", "--sweep-every", "1h")  # (it passes --create)
    first = m.log()
    assert "a sweep every 1h" in first
    assert f"register it (ln -s /path/to/clone {m.mnt}/roots/NAME)" in first
    (m.mnt / "pins").joinpath("kept").write_bytes(b"kept across --create\n")
    m.stop()
    m.args = ("--window", "0", "--sweep-every", "0")
    m.start()  # --create again on the existing store: nothing is made anew
    assert (m.mnt / "pins" / "kept").read_bytes() == b"kept across --create\n"
    assert "no periodic sweeps" in m.log()
    assert "register it" not in m.log()
