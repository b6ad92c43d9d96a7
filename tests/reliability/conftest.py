"""The real-mount fixtures of tests/daemon/conftest.py (`mount`, `start_mount`, `populate`),
reused here. tests/daemon is not a package (`daemon` is the daemon's source folder), so its
conftest is loaded by path under a name of its own and its fixtures re-exported."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "daemon" / "conftest.py"
_NAME = "alkfs_tests_daemon_conftest"


def _load():
    mod = sys.modules.get(_NAME)
    if mod is None:
        spec = importlib.util.spec_from_file_location(_NAME, _PATH)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = mod
        spec.loader.exec_module(mod)
    return mod


_daemon = _load()

Mount = _daemon.Mount
is_mounted = _daemon.is_mounted
mount_entry = _daemon.mount_entry
unmount = _daemon.unmount
start_mount = _daemon.start_mount
start_pg_mount = _daemon.start_pg_mount
mount = _daemon.mount
populate_fixture = _daemon.populate_fixture
pytest_collection_modifyitems = _daemon.pytest_collection_modifyitems
