"""`echo repack > MNT/.alkfs/control` builds and publishes the git views' derived packs
now: an object stored loose is inside a listed pack when the write returns."""

from __future__ import annotations

import json
import os
import subprocess

from helpers import GIT_ENV


def test_repack_through_the_control_file_packs_a_loose_object_at_once(mount):
    view = mount.mnt / "git" / "sha1"
    env = {**os.environ, **GIT_ENV, "GIT_OBJECT_DIRECTORY": str(view)}
    oid = (
        subprocess.run(
            ["git", "hash-object", "-w", "--stdin"],
            input=b"packed by the control file\n",
            env=env,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .strip()
    )
    fan = view / oid[:2]
    assert oid[2:] in os.listdir(fan)  # readable at once, listed loose
    (mount.mnt / ".alkfs" / "control").write_text("repack\n")
    idx = [p for p in os.listdir(view / "pack") if p.endswith(".idx")]
    assert idx
    listed = subprocess.run(
        ["git", "verify-pack", "-v", *(str(view / "pack" / p) for p in idx)],
        capture_output=True,
        check=True,
        text=True,
    ).stdout
    assert any(line.startswith(oid + " ") for line in listed.splitlines())
    assert oid[2:] not in os.listdir(fan)  # a packed object is no longer listed loose
    assert (fan / oid[2:]).exists()  # but still resolves by name
    packs = json.loads((mount.mnt / ".alkfs" / "status").read_text())["packs"]
    assert packs["sha1"]["objects"] == 1 and packs["sha1"]["packs"] >= 1
    assert packs["sha1"]["generation"] is not None and packs["sha1"]["last_error"] is None
    assert mount.tracebacks() == []
