"""`--metrics-listen HOST:PORT` (docs/operations.md, "Metrics and status"): the metrics
over HTTP, scraped with a real HTTP client while the mount works: FUSE requests and their
latencies by operation, bytes read and written, errors by errno, objects by tier, staged
candidates."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import urllib.request

from helpers import os_errno, sha, write_close


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def value(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # (as exposed)
    pattern = r"(?m)^" + re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "")
    pattern += r" (\S+)$"
    m = re.search(pattern, text)
    assert m is not None, f"{name}{{{want}}} not in the scrape"
    return float(m.group(1))


def test_the_metrics_scraped_over_http_count_what_the_mount_did(start_mount):
    port = free_port()
    m = start_mount(None, "--window", "1h", "--metrics-listen", f"127.0.0.1:{port}")
    assert f"metrics: http://127.0.0.1:{port}/metrics" in m.log()
    before = scrape(port)
    assert value(before, "alkfs_fuse_written_bytes_total") == 0
    data = [os.urandom(1000), os.urandom(200_000)]  # (one kv object, one large)
    for i, d in enumerate(data):
        write_close(m.path("objects", "sha256", f"new{i}"), d)
    for d in data:
        assert m.path("objects", "sha256", sha(d)).read_bytes() == d
    assert os_errno(os.stat, m.path("objects", "sha256", "0" * 64)) == 2  # ENOENT
    m.path(".alkfs", "control").write_text("sweep\n")  # (both unpinned: staged)
    text = scrape(port)
    assert value(text, "alkfs_fuse_written_bytes_total") == 201_000 + len("sweep\n")
    # (a small object's pages are handed over at its open: no READ reaches Python for it)
    assert value(text, "alkfs_fuse_read_bytes_total") >= 200_000
    assert value(text, "alkfs_fuse_request_seconds_count", op="write") >= 3
    assert value(text, "alkfs_fuse_request_seconds_count", op="create") == 2
    assert value(text, "alkfs_fuse_request_seconds_bucket", le="+Inf", op="create") == 2
    assert value(text, "alkfs_fuse_request_seconds_sum", op="create") > 0
    assert value(text, "alkfs_fuse_errors_total", op="lookup", errno="ENOENT") >= 1
    assert value(text, "alkfs_objects", algo="sha256", tier="kv") == 1
    assert value(text, "alkfs_objects", algo="sha256", tier="large") == 1
    assert value(text, "alkfs_object_bytes", algo="sha256") == 201_000
    assert value(text, "alkfs_staged_objects") == 2
    assert value(text, "alkfs_staged_bytes") == 201_000
    assert value(text, "alkfs_last_sweep_candidates_staged") == 2
    # bytes on disk by part: the large object's file, the database's, the packs' (none)
    assert value(text, "alkfs_disk_bytes", part="large") == 200_000
    assert value(text, "alkfs_disk_bytes", part="database") > 1000
    assert value(text, "alkfs_disk_bytes", part="packs") == 0
    assert value(text, "alkfs_pack_objects", format="sha1") == 0
    assert value(text, "alkfs_pack_generation", format="sha1") >= 0
    # the file says the same
    assert value(m.path(".alkfs", "metrics").read_text(), "alkfs_staged_bytes") == 201_000
    m.stop()
    with socket.socket() as s:  # (the listener went with the daemon)
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_a_bad_listen_address_is_a_usage_error(tmp_path):
    (tmp_path / "mnt").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "alkfsd.main", str(tmp_path / "s"), str(tmp_path / "mnt")]
        + ["--create", "--metrics-listen", "nowhere"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["alkfsd: --metrics-listen takes HOST:PORT, not 'nowhere'"]
