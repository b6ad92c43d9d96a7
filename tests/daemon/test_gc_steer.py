"""GC an admin can see and steer through a mount (docs/gc.md): `sweep --dry-run`
stages nothing and leaves what it would stage in /.alkfs/dry-run; /.alkfs/staged lists
the staged candidates with sizes and deadlines; `sweep --expire-now` deletes them at
once, each still re-arbitrated; status and metrics show the staged count and bytes and
the next periodic sweep; `alkfs --mount` does the same, and `unpin` prints the key."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from datetime import datetime

from helpers import os_errno, put, sha, status, write_close

CLI = [sys.executable, "-m", "alkfs.cli"]


def control(m, line: str) -> None:
    m.path(".alkfs", "control").write_text(line + "\n")


def alkfs(m, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "--mount", str(m.mnt), *args], capture_output=True, text=True, timeout=120
    )


def test_a_dry_run_stages_nothing_and_says_what_it_would(start_mount):
    m = start_mount(None, "--window", "1h")
    orphan = put(m, b"an orphan\n")
    write_close(m.path("pins", "kept"), b"kept by its pin\n")
    assert json.loads(m.path(".alkfs", "dry-run").read_text()) is None
    control(m, "sweep --dry-run")
    out = json.loads(m.path(".alkfs", "dry-run").read_text())
    assert (out["dry_run"], out["aborted"], out["would_stage"], out["more"]) == (True, None, 1, 0)
    assert out["candidates"] == [{"key": f"sha256/{orphan}", "size": 10, "why": "no pin names it"}]
    assert status(m)["last_sweep"] is None  # (a dry run is not a sweep)
    assert status(m)["staged"]["count"] == 0
    assert m.path(".alkfs", "staged").read_text() == ""
    for bad in ("sweep --dry-run 1h", "sweep --bogus", "sweep --dry-run --expire-now"):
        assert os_errno(control, m, bad) == errno.EINVAL, bad


def test_staged_lists_candidates_and_expire_now_deletes_them_through_the_mount(start_mount):
    m = start_mount(None, "--window", "1h")
    a = put(m, b"staged a\n")
    b = put(m, b"staged b, a little longer\n")
    before = time.time()
    control(m, "sweep")
    assert status(m)["last_sweep"]["candidates_staged"] == 2
    lines = m.path(".alkfs", "staged").read_text().splitlines()
    assert [line.split()[:2] for line in lines] == sorted(
        [[f"sha256/{a}", "9"], [f"sha256/{b}", "26"]]
    )
    for line in lines:
        deadline = datetime.fromisoformat(line.split()[2]).timestamp()
        assert before + 3600 - 1 <= deadline <= time.time() + 3600 + 1
    st = status(m)["staged"]
    assert (st["count"], st["bytes"]) == (2, 35)
    metrics = m.path(".alkfs", "metrics").read_text()
    assert "alkfs_staged_objects 2.0" in metrics and "alkfs_staged_bytes 35.0" in metrics
    assert alkfs(m, "staged").stdout.splitlines() == lines
    control(m, "sweep")  # (not due for an hour: nothing goes)
    assert status(m)["last_sweep"]["deleted"] == 0
    os.symlink(f"../objects/sha256/{a}", m.path("pins", "saved"))  # (re-arbitrated: kept)
    done = alkfs(m, "sweep", "--expire-now")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["taken"], report["deleted"], report["cancelled_by_arbitration"]) == (2, 1, 1)
    assert m.path(".alkfs", "staged").read_text() == ""
    assert m.path("objects", "sha256", a).read_bytes() == b"staged a\n"
    assert os_errno(os.stat, m.path("objects", "sha256", b)) == errno.ENOENT
    assert status(m)["staged"] == {"count": 0, "bytes": 0, "next_deadline": None}


def test_the_cli_through_a_mount_dry_runs_unpins_with_the_key_and_warns_at_put(
    start_mount, tmp_path
):
    m = start_mount(None, "--window", "1h")
    f = tmp_path / "f"
    f.write_bytes(b"put without a pin\n")
    done = alkfs(m, "put", str(f))
    assert done.returncode == 0
    assert done.stdout == f"sha256/{sha(f.read_bytes())}\n"
    assert done.stderr.startswith(f"alkfs: sha256/{sha(f.read_bytes())} is not pinned")
    done = alkfs(m, "sweep", "--dry-run")
    assert done.returncode == 0 and json.loads(done.stdout)["would_stage"] == 1
    done = alkfs(m, "put", "--pin", "mine", str(f))
    assert (done.returncode, done.stderr) == (0, "")
    done = alkfs(m, "unpin", "mine")
    assert (done.returncode, done.stdout) == (0, f"sha256/{sha(f.read_bytes())}\n")


def test_status_shows_when_the_next_periodic_sweep_runs(start_mount):
    m = start_mount(None, "--window", "1h", "--sweep-every", "1h")
    before = time.time()
    st = status(m)
    assert st["next_sweep"] is not None
    assert before + 3600 - 5 <= datetime.fromisoformat(st["next_sweep"]).timestamp()
    assert datetime.fromisoformat(st["next_sweep"]).timestamp() <= time.time() + 3600 + 1
    assert "alkfs_next_sweep_timestamp_seconds" in m.path(".alkfs", "metrics").read_text()
    m.stop()
    m.args = ("--window", "1h", "--sweep-every", "0")
    m.start()
    assert status(m)["next_sweep"] is None
