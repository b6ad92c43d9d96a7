"""The environment the store runs git in: the repository it names (GIT_DIR), none of the
machine's or the user's configuration, no prompt, no lazy fetch of a promisor remote,
and none of the caller's object-directory overrides (an alternates or object directory
set around the store would change what git reads)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

DROPPED = ("GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_OBJECT_DIRECTORY", "GIT_WORK_TREE")


def git_env(gitdir: str | Path, objdir: str | Path | None = None, **extra: str) -> dict[str, str]:
    """os.environ for a git of the store in the repository at `gitdir` (objects read
    from and written to `objdir` when given), with `extra` variables over it."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED}
    env |= {
        "GIT_DIR": str(gitdir),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_NO_LAZY_FETCH": "1",
    }
    if objdir is not None:
        env["GIT_OBJECT_DIRECTORY"] = str(objdir)
    return env | extra


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill a git started in a session of its own (its children too) and reap it: at the
    store's stop, or when the caller ends for any reason (a SIGTERM of the command line)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    # (a `communicate` an exception cut short may have closed a pipe: read none then)
    with contextlib.suppress(ValueError, OSError):
        proc.communicate()
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
