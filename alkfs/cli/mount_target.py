"""`MountTarget`: the commands through a running mount's files only (objects, extended
attributes, pin files, repository directories, the control and status files), so they work
for any user the mount lets in."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ..durations import format_duration
from ..errors import (
    Invalid,
    Missing,
    StoreIO,
)
from ..keys import Algorithm, Key
from .show import CHUNK, PIN_XATTR, Progress, Shown, iso, open_input, pin_key, sweep_shown, through
from .target import MountStatus, ObjectFigures

if TYPE_CHECKING:
    from ..gc.sweep import SweepFigures


class MountTarget:
    """A running mount, through its files only."""

    def __init__(self, path: str) -> None:
        self.root = Path(path)
        if not (self.root / ".alkfs" / "status").is_file():
            raise Missing(f"{self.root} is not an alkfs mount (no .alkfs/status)")

    def close(self) -> None:
        pass

    def obj(self, key: Key) -> Path:
        return self.root / "objects" / key.algo.label / key.hex

    def put(self, path: str, algo: Algorithm, pin: str | None) -> Key:
        hasher = algo.hasher()
        if pin is not None and algo is Algorithm.SHA256:
            # A new file under /pins stores (sha256) and pins in one step: no unpinned moment.
            dest = self.root / "pins" / pin
        else:
            dest = self.root / "objects" / algo.label / f".put-{os.getpid()}-{os.urandom(6).hex()}"
        with (
            open_input(path) as src,
            through(
                str(dest.relative_to(self.root)),
                EEXIST=f"the pin {pin!r} exists",
                EINVAL=f"invalid pin name {pin!r}",
                EIO="the mount refused the content",
            ),
        ):
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
            try:
                while chunk := src.read(CHUNK):
                    hasher.update(chunk)
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
            finally:
                os.close(fd)  # the object is stored (or refused) here
        key = Key.of(algo, hasher.digest())
        with through(str(key), ENOENT=f"{key}: the mount did not store the object"):
            os.stat(self.obj(key))
        if pin is not None and algo is not Algorithm.SHA256:
            self.pin(pin, key)
        return key

    def get(self, key: Key, out: IO[bytes]) -> None:
        with (
            through(
                str(key),
                ENOENT=f"{key}: no such object",
                EIO=f"{key}: the object is corrupt (see alkfs status)",
            ),
            open(self.obj(key), "rb") as f,
        ):
            shutil.copyfileobj(f, out, CHUNK)

    def stat(self, key: Key) -> ObjectFigures:
        path = self.obj(key)
        with through(str(key), ENOENT=f"{key}: no such object"):
            st = os.stat(path)
            tier = os.getxattr(path, "user.alkfs.tier").decode()
            pins = os.getxattr(path, "user.alkfs.pins").decode()
        return {
            "key": str(key),
            "algorithm": key.algo.label,
            "size": st.st_size,
            "tier": tier,
            "stored_at": iso(st.st_mtime_ns),
            "pins": sorted(p for p in pins.split(",") if p),
        }

    def pin(self, name: str, key: Key) -> None:
        with through(
            f"pin {name}",
            ENOENT=f"{key}: no such object",
            EEXIST=f"the pin {name!r} names another object",
            ENOTSUP=f"invalid pin name {name!r}",
            EINVAL=f"invalid pin name {name!r}",
        ):
            os.setxattr(self.obj(key), PIN_XATTR + name, b"")

    def unpin(self, name: str) -> Key:
        with through(f"unpin {name}", ENOENT=f"no pin {name!r}"):
            key = pin_key(self.root / "pins" / name)
            os.unlink(self.root / "pins" / name)
        return key

    def pins(self) -> list[tuple[str, Key]]:
        """Every pin, by its path under /pins (directories of pins walked)."""
        pins_dir = self.root / "pins"
        out = []
        with through("pins"):
            os.listdir(pins_dir)
        for top, _dirs, names in os.walk(pins_dir):  # (symbolic links are not followed)
            for leaf in names:
                path = Path(top, leaf)
                try:
                    key = pin_key(path)
                except FileNotFoundError:
                    continue  # unpinned while we listed
                except OSError as exc:
                    with through(f"pins/{path.relative_to(pins_dir)}"):
                        raise exc
                out.append((str(path.relative_to(pins_dir)), key))
        return sorted(out)

    def roots_add(self, name: str, path: str) -> None:
        with contextlib.suppress(OSError):
            if os.readlink(self.root / "roots" / name) == os.path.normpath(path):
                return  # (the same name and path again: as on an unheld store)
        with through(
            f"roots add {name}",
            EEXIST=f"the root {name!r} is another path's",
            EINVAL=f"{path}: not a git repository outside the mount, or {name!r} is not a valid name",
        ):
            os.symlink(path, self.root / "roots" / name)

    def roots_rm(self, name: str) -> None:
        with through(f"roots rm {name}", ENOENT=f"no root {name!r}"):
            os.unlink(self.root / "roots" / name)

    def roots(self) -> list[tuple[str, str]]:
        roots_dir = self.root / "roots"
        out = []
        with through("roots"):
            names = os.listdir(roots_dir)
        for name in names:
            try:
                out.append((name, os.readlink(roots_dir / name)))
            except FileNotFoundError:
                continue  # unregistered while we listed
        return sorted(out)

    def repo_create(self, repo_id: str, object_format: str) -> None:
        repo = self.root / "repos" / repo_id
        with through(
            f"repo {repo_id}",
            EEXIST=f"repository {repo_id!r} exists",
            EINVAL=f"invalid repository id {repo_id!r}",
        ):
            os.mkdir(repo)
        if object_format == "sha1":
            return
        # mkdir makes sha1 repositories; the format is set before anything can use it,
        # and a failure takes the new repository away again
        try:
            with through(f"repo {repo_id}"):
                os.setxattr(repo, "user.alkfs.object-format", object_format.encode())
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(repo)
            raise

    def repo_rm(self, repo_id: str) -> None:
        repo = self.root / "repos" / repo_id
        with through(f"repo {repo_id}", ENOENT=f"no repository {repo_id!r}"):
            os.stat(repo)
            # every ref is listed in packed-refs (docs/git.md): removing it removes them all
            os.unlink(repo / "packed-refs")
        with through(
            f"repo {repo_id}",
            ENOTEMPTY=f"repository {repo_id!r}: refs were written while it was removed",
        ):
            os.rmdir(repo)

    def repo_list(self) -> list[tuple[str, str]]:
        repos = self.root / "repos"
        out = []
        with through("repos"):
            names = os.listdir(repos)
        for name in names:
            try:
                config = (repos / name / "config").read_text()
            except FileNotFoundError:
                continue  # removed while we listed
            m = re.search(r"^\s*objectformat\s*=\s*(\S+)", config, re.IGNORECASE | re.MULTILINE)
            out.append((name, m.group(1).lower() if m else "sha1"))
        return sorted(out)

    def git_import(self, gitdir: str, repo_id: str) -> str:
        """git itself pushes every ref (with its objects) into the mounted repository,
        once git's connectivity check found the source whole (as the library's import)."""
        from ..git.connected import check_connected
        from ..git.importer import resolve_gitdir

        with Progress("connectivity check"):
            check_connected(resolve_gitdir(gitdir))
        repo = self.root / "repos" / repo_id
        if not repo.is_dir():
            src_format = _git(gitdir, "rev-parse", "--show-object-format").strip()
            self.repo_create(repo_id, src_format)
        from ..git import lfs  # the media first, as git-lfs's pre-push does

        with Progress("LFS media"):
            media = lfs.copy_media_into(self.root, repo_id, resolve_gitdir(gitdir))
        # (--no-verify: the source's hooks are not run; a git-lfs pre-push would refuse the
        # bare path, and its media are already in)
        cmd = [
            "git",
            f"--git-dir={gitdir}",
            "push",
            "--no-verify",
            "--quiet",
            "--mirror",
            str(repo),
        ]
        if sys.stderr.isatty():
            cmd.insert(4, "--progress")
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        if done.returncode != 0:
            raise StoreIO(f"git import: git push into {repo} failed (exit {done.returncode})")
        head = _git(gitdir, "symbolic-ref", "-q", "HEAD", check=False).strip()
        if head:
            with through(f"repos/{repo_id}/HEAD"):
                (repo / "HEAD").write_text(f"ref: {head}\n")
        # the import returns with its objects served from derived packs (docs/git.md)
        with (
            Progress("packs: the mount builds the derived packs"),
            through("the control file's repack"),
        ):
            (self.root / ".alkfs" / "control").write_text("repack\n")
        refs = _git(gitdir, "for-each-ref", "--format=%(refname)", check=False).split()
        return f"{len(refs)} refs pushed through the mount" + lfs.media_summary(*media)

    def control(self, command: str) -> None:
        with through(
            f"control {command.split()[0]}",
            EINVAL=f"the daemon refused the command {command!r}",
            EACCES="only root (or the daemon's user) may write the mount's control file",
        ):
            fd = os.open(self.root / ".alkfs" / "control", os.O_WRONLY)
            try:
                os.write(fd, f"{command}\n".encode())
            finally:
                os.close(fd)

    def sweep(self, window_s: float | None, expire_now: bool = False) -> SweepFigures:
        words = ["sweep"] + (["--expire-now"] if expire_now else [])
        if window_s is not None:
            words.append(format_duration(window_s))
        with Progress("sweep", lambda: sweep_shown(self.status().get("sweep_progress"))):
            self.control(" ".join(words))  # (returns once the sweep is done)
        report = self.status().get("last_sweep")
        if report is None:
            raise StoreIO("sweep: the daemon reported no sweep")
        return report

    def dry_run(self) -> dict[str, object]:
        with Progress("sweep --dry-run"):
            self.control("sweep --dry-run")
        with through("dry-run"):
            text = (self.root / ".alkfs" / "dry-run").read_text()
        try:
            return json.loads(text)
        except ValueError as exc:
            raise StoreIO(f"dry-run: the daemon's answer is not JSON: {exc}") from exc

    def staged(self) -> Iterator[str]:
        with through("staged"), open(self.root / ".alkfs" / "staged") as f:
            for line in f:
                yield line.rstrip("\n")

    def verify(self) -> tuple[list[str], int]:
        def poll() -> Shown | None:
            running = self.status().get("verifying")
            return None if not running else ("verify", running["done"], running["total"])

        with Progress("verify", poll):
            self.control("verify")  # (returns once the daemon's verify is done)
        status = self.status()
        checked = sum(c.get("count", 0) for c in status.get("objects", {}).values())
        return list(status.get("corrupt", [])), checked

    def status(self) -> MountStatus:
        with through("status"):
            text = (self.root / ".alkfs" / "status").read_text()
        try:
            return json.loads(text)
        except ValueError as exc:
            raise StoreIO(f"status: the daemon's status is not JSON: {exc}") from exc


def _git(gitdir: str, *args: str, check: bool = True) -> str:
    done = subprocess.run(
        ["git", f"--git-dir={gitdir}", *args], capture_output=True, text=True, check=False
    )
    if check and done.returncode != 0:
        raise Invalid(f"{gitdir}: not a git repository ({done.stderr.strip() or 'git failed'})")
    return done.stdout
