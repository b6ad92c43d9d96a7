"""This machine's identity: what a borrower's registration records (alkfs/roots.py) and
what each fleet member announces (alkfs/fleet.py), so that a path is only ever read on
the machine where it names something."""

from __future__ import annotations

import socket

from .settings import settings


def machine_id() -> str:
    """`ALKFS_MACHINE_ID`, else systemd's machine id, else the host name."""
    env = settings().machine_id
    if env:
        return env
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            return text[:200]
    return socket.gethostname()
