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
_BAD_REF = re.compile(rb"bad object (\S+)")
# no lazy fetch from a promisor remote (git >= 2.44 reads this; --missing suffices before)
_ENV = {**os.environ, "GIT_NO_LAZY_FETCH": "1", "GIT_TERMINAL_PROMPT": "0"}


def _walk(gitdir: str, *tips: str, want: bytes | None = None) -> tuple[bytes | None, str]:
    """The first missing object the walk from `tips` meets (hex; with `want`, `want` if
    the walk meets it, else None), and git's error text. The output is read as it comes
    and the walk stopped at the answer: a partial clone lacks many objects."""
    proc = subprocess.Popen(
        ["git", f"--git-dir={gitdir}", "rev-list", "--objects", "--missing=print", "--quiet"]
        + list(tips),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=_ENV,
    )
    assert proc.stdout is not None and proc.stderr is not None
    found: bytes | None = None
    try:
        for line in proc.stdout:
            if line.startswith(b"?") and (want is None or line[1:].strip() == want):
                found = line[1:].strip()
                break
    finally:
        if found is not None:
            proc.kill()
        err = proc.stderr.read(64 << 10)
        proc.stdout.close()
        proc.stderr.close()
        proc.wait()
    if found is not None:
        return found, ""
    text = err.decode(errors="replace").strip()
    if proc.returncode != 0:
        m = _OID.search(err)
        if m:
            return m.group(1), text
        bad = _BAD_REF.search(err)  # a ref naming an object that is not there
        if bad:
            oid = _resolve(gitdir, bad.group(1).decode(errors="replace"))
            return (oid or b""), text
        return b"", text
    return None, text


def _resolve(gitdir: str, ref: str) -> bytes | None:
    """The id a ref names, read without looking the object up."""
    proc = subprocess.run(
        ["git", f"--git-dir={gitdir}", "for-each-ref", "--format=%(objectname)", ref],
        capture_output=True,
        check=False,
    )
    out = proc.stdout.split()
    return out[0] if out else None


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
        last = err.splitlines()[-1] if err else "no reason given"
        raise StoreIO(f"git rev-list could not walk {gitdir}: {last[:200]}")
    oid = missing.decode()
    refs = _refs(gitdir)
    reached = next(
        (r for r in refs[:REFS_ASKED] if _walk(gitdir, r, want=missing)[0] == missing), None
    )
    via = f" (reached from {reached})" if reached else ""
    why = (
        "; the source is a partial clone: fetch what it lacks first "
        "(e.g. `git fetch --refetch`, or clone without --filter)"
        if is_partial_clone(gitdir)
        else ""
    )
    raise Missing(f"{gitdir} lacks object {oid}{via}{why}; nothing imported")
