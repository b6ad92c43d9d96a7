"""Load on one real mount: client processes (bench/load.py's `client`) read pinned 4 KiB
objects (verifying their bytes against their names) and write new ones into /pins and
/objects/sha256 while a sweep runs every second (window 0), then nothing pinned is lost.

`make test`: 4 clients (1 writing) for 5 s over 300 pinned objects; ALKFS_SOAK=1
(`make soak`): 16 clients (4 writing) for 60 s over 2,000. No errno is expected anywhere:
the readers read only pinned objects, the writers write names nobody else uses. Timings
are bench/load.py's, never asserted here.
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

from helpers import sha, status

_PATH = Path(__file__).resolve().parents[2] / "bench" / "load.py"
_spec = importlib.util.spec_from_file_location("alkfs_bench_load", _PATH)
assert _spec is not None and _spec.loader is not None
load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(load)

SOAK = os.environ.get("ALKFS_SOAK") == "1"
CLIENTS, WRITERS, DURATION_S, OBJECTS = (16, 4, 60.0, 2000) if SOAK else (4, 1, 5.0, 300)


def test_clients_under_sweeps_lose_nothing(start_mount, populate, tmp_path: Path) -> None:
    rng = random.Random(12)
    data = [rng.randbytes(load.SIZE) for _ in range(2 * OBJECTS)]
    store = tmp_path / "store"
    # the read set pinned as r-<i>, as many unpinned objects for the first sweeps to delete
    populate(store, data, pins={f"r-{i}": i for i in range(OBJECTS)})
    objects = [sha(d) for d in data[:OBJECTS]]
    m = start_mount(store, "--window", "0")
    work = tmp_path / "load"
    work.mkdir()

    got = load.run_clients(
        {"alkfs": m.mnt},
        objects,
        clients=CLIENTS,
        writers=WRITERS,
        slice_s=DURATION_S,
        slices=1,
        work=work,
        control=m.path(".alkfs", "control"),
    )

    # No client met an errno, no read gave other bytes, every sweep ran (none refused,
    # none aborted), and every client did work.
    assert got["errors"] == {"alkfs": {}}, got["errors"]
    sweeps = got["sweeps"]
    assert len(sweeps) >= 1, sweeps
    assert [s for s in sweeps if "errno" in s or s["aborted"] is not None] == []
    reads, writes = got["ops"]["alkfs"]["read"], got["ops"]["alkfs"]["write"]
    assert reads >= CLIENTS - WRITERS and writes >= 2 * WRITERS, got["ops"]
    assert len(got["lat"]["alkfs"]["read"]) == reads
    pinned = got["pinned"]
    # a writer's odd writes went to /pins, its even ones to /objects/sha256
    each = [c["ops"]["alkfs"]["write"] for c in got["clients"] if c["role"] == "write"]
    assert len(each) == WRITERS and min(each) >= 2, got["clients"]
    assert len(pinned) == sum((n + 1) // 2 for n in each)
    assert len({name for name, _ in pinned}) == len(pinned)

    # Afterwards: every pin reads its bytes; two sweeps leave exactly the pinned objects,
    # having deleted (with the sweeps under load) every unpinned object ever stored.
    problems, deleted = load.check_after(m.mnt, objects, pinned)
    assert problems == []
    deleted += sum(s["deleted"] for s in sweeps)
    assert deleted == OBJECTS + (writes - len(pinned))
    st = status(m)
    assert st["pins"] == OBJECTS + len(pinned)
    assert st["objects"]["sha256"]["count"] == OBJECTS + len(pinned)
    assert st["corrupt"] == []
    assert sorted(os.listdir(m.path("pins"))) == sorted(
        [f"r-{i}" for i in range(OBJECTS)] + [name for name, _ in pinned]
    )
    assert m.tracebacks() == [], "\n".join(m.tracebacks())

    # and the store verifies clean with the daemon stopped
    assert m.stop() == 0
    done = subprocess.run(
        [sys.executable, "-m", "alkfs.cli", "--store", str(store), "verify"],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k not in ("ALKFS_MOUNT", "ALKFS_STORE")},
    )
    assert done.returncode == 0, done.stderr
