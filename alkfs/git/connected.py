"""Whether a repository about to be imported is whole: git's own connectivity check.

`git fetch` refuses a pack whose refs reach an object it lacks (`check_connected`,
`rev-list --objects ... --quiet`); an import does the same before it stores anything,
so that a repository with a hole never becomes refs whose history is incomplete:
`git rev-list --objects --all --missing=print --quiet` walks the source in git's own
bounded memory and prints only the missing objects (`?<oid>`); a missing commit ends
the walk (exit 128, "Could not read <oid>"). The refusal names the first missing
object, a ref that reaches it and, for a partial clone (a `.promisor` pack or a
promisor remote), says that the source is one.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from ..errors import Missing, StoreIO

REFS_ASKED = 64  # refs walked one by one to name one that reaches the missing object
_OID = re.compile(rb"\b([0-9a-f]{64}|[0-9a-f]{40})\b")
# no lazy fetch from a promisor remote (git >= 2.44 reads this; --missing suffices before)
_ENV = {**os.environ, "GIT_NO_LAZY_FETCH": "1", "GIT_TERMINAL_PROMPT": "0"}


def _walk(gitdir: str, *tips: str) -> tuple[bytes | None, str]:
    """The first missing object the walk from `tips` meets (hex), and git's error text."""
    proc = subprocess.run(
        ["git", f"--git-dir={gitdir}", "rev-list", "--objects", "--missing=print", "--quiet"]
        + list(tips),
        capture_output=True,
        stdin=subprocess.DEVNULL,
        env=_ENV,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(b"?"):
            return line[1:].strip(), ""
    err = proc.stderr.decode(errors="replace").strip()
    if proc.returncode != 0:
        m = _OID.search(proc.stderr)
        return (m.group(1) if m else b""), err
    return None, err


def _refs(gitdir: str) -> list[str]:
    proc = subprocess.run(
        ["git", f"--git-dir={gitdir}", "for-each-ref", "--format=%(refname)"],
        capture_output=True,
        check=False,
    )
    names = proc.stdout.decode(errors="replace").split()
    return ["HEAD", *names]


def is_partial_clone(gitdir: str) -> bool:
    """A partial clone: a promisor pack, or a remote git may fetch missing objects from."""
    if any(Path(gitdir, "objects", "pack").glob("*.promisor")):
        return True
    proc = subprocess.run(
        [
            "git",
            f"--git-dir={gitdir}",
            "config",
            "--get-regexp",
            r"^(extensions\.partialclone|remote\..*\.promisor)$",
        ],
        capture_output=True,
        check=False,
    )
    return bool(proc.stdout.strip())


def check_connected(gitdir: str) -> None:
    """Missing (one line) if an object some ref of `gitdir` reaches is not there."""
    missing, err = _walk(gitdir, "--all")
    if missing is None:
        return
    if not missing:
        raise StoreIO(f"git rev-list could not walk {gitdir}: {err.splitlines()[-1:]}")
    oid = missing.decode()
    refs = _refs(gitdir)
    reached = next((r for r in refs[:REFS_ASKED] if _walk(gitdir, r)[0] == missing), None)
    via = f" (reached from {reached})" if reached else ""
    why = (
        "; the source is a partial clone: fetch what it lacks first "
        "(e.g. `git fetch --refetch`, or clone without --filter)"
        if is_partial_clone(gitdir)
        else ""
    )
    raise Missing(f"{gitdir} lacks object {oid}{via}{why}; nothing imported")
