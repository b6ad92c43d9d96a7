"""`alkfs`, the command line: the same commands on a running mount (`--mount`) or on a
store no daemon holds (`--store`).

Through a mount every command uses only the mount's files (objects, extended attributes,
pin symlinks, repository directories, the control and status files), so it works for any
user the mount lets in. On a store it opens the library directly and holds the store lock
for the command's duration, so it never races a daemon.

Exit status: 0 done, 1 refused or failed (one line on stderr saying why), 2 bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, NoReturn, Protocol

from . import __version__
from .durations import format_duration, parse_duration, parse_window
from .errors import (
    AlkfsError,
    Busy,
    Corrupt,
    Exists,
    Invalid,
    Missing,
    NoSpace,
    NotEmpty,
    Refused,
    Stale,
    StoreIO,
    StoreLocked,
)
from .keys import Algorithm, Key

CHUNK = 1 << 20
PIN_XATTR = "user.alkfs.pin."
ALGO_LABELS = [a.label for a in Algorithm]
CREATING = {"put", "repo create", "git import"}  # the commands that may create a store


class Usage(Exception):
    """Bad usage found after parsing (exit 2)."""


# -- one place that turns failures into one line --------------------------------------

_ERRNO_CLASS: dict[int, type[AlkfsError]] = {
    errno.ENOENT: Missing,
    errno.EEXIST: Exists,
    errno.EINVAL: Invalid,
    errno.EPERM: Refused,
    errno.EACCES: Refused,
    errno.EROFS: Refused,
    errno.ENOTSUP: Refused,
    errno.ENOTEMPTY: NotEmpty,
    errno.EAGAIN: Stale,
    errno.EIO: StoreIO,
    errno.ENOSPC: NoSpace,
    errno.EDQUOT: NoSpace,
    errno.EBUSY: Busy,
}


@contextlib.contextmanager
def through(what: str, **meanings: str) -> Iterator[None]:
    """Turn an OSError from the mount into the library's family, with the errno's name.

    `meanings` words an expected errno in full, as the library would (ENOENT="no pin 'x'");
    any other errno reads `<what>: <strerror>`.
    """
    try:
        yield
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        cls = _ERRNO_CLASS.get(exc.errno or 0, StoreIO)
        raise cls(f"{meanings.get(name) or f'{what}: {exc.strerror}'} ({name})") from exc


def explain(exc: BaseException) -> str:
    """The one line a failure gets on stderr."""
    if isinstance(exc, StoreLocked):
        text = f"{exc}; work through its mount with --mount"
    elif isinstance(exc, AlkfsError):
        text = str(exc)
    elif isinstance(exc, OSError):
        where = exc.filename if exc.filename is not None else ""
        text = f"{where}: {exc.strerror}" if where else str(exc.strerror or exc)
    else:
        text = f"unexpected {type(exc).__name__}: {exc}"
    return " ".join(text.split())


# -- small shared helpers -----------------------------------------------------------------


def _number(x: float) -> int | float:
    """Whole numbers print as integers in JSON, as the daemon's status does."""
    return int(x) if float(x).is_integer() else x


def iso(ns: int) -> str:
    """UTC ISO 8601 to the microsecond, computed exactly from nanoseconds."""
    whole = datetime.fromtimestamp(ns // 10**9, UTC)
    return whole.replace(microsecond=ns // 1000 % 10**6).isoformat(timespec="microseconds")


def progress_bar(desc: str, total: int | None = None) -> Any:
    """A tqdm bar on a terminal; silent (and free) otherwise."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="obj", disable=not sys.stderr.isatty(), leave=False)


SPINNER = "{desc} [{elapsed}]"  # a phase without a count: its name and elapsed time
TICK_S = 0.5  # the progress line is redrawn this often
FIRST_POLL_S = 0.2  # a running command's progress is first asked for after this
POLL_S = 1.0  # and then this often (through a mount: a read of /.alkfs/status)

Shown = tuple[str, int | None, int | None]  # what a progress line shows: (label, done, total)


class Progress:
    """While long work runs, on a terminal only (nothing, and free, otherwise): one line on
    stderr with its label and elapsed time, redrawn from a thread, and a bar once a total
    is known. How far it got comes from `show` (any thread) or from `poll`, called from
    the thread (an exception from it is ignored: the line stays as it was)."""

    def __init__(self, label: str, poll: Callable[[], Shown | None] | None = None) -> None:
        self.label = label
        self.poll = poll
        self.bar: Any = None
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc=self.label, unit="obj", leave=False, bar_format=SPINNER)
            self.thread = threading.Thread(target=self._tick, name="alkfs-progress", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join(POLL_S + TICK_S)  # (a status read that hangs is left behind)
        with self.lock:
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    def show(self, label: str, done: int | None = None, total: int | None = None) -> None:
        with self.lock:
            bar = self.bar
            if bar is None:
                return
            bar.set_description_str(label, refresh=False)
            if total:  # a bar
                bar.bar_format = None
                bar.total = total
                bar.n = min(done or 0, total)
            else:
                bar.bar_format = SPINNER
                bar.total = None
            bar.refresh()

    def _tick(self) -> None:
        next_poll = time.monotonic() + FIRST_POLL_S
        while not self.done.wait(TICK_S if self.poll is None else min(TICK_S, FIRST_POLL_S)):
            if self.poll is not None and time.monotonic() >= next_poll:
                try:
                    shown = self.poll()
                except Exception:
                    shown = None
                next_poll = time.monotonic() + POLL_S
                if shown is not None and not self.done.is_set():
                    self.show(*shown)
                    continue
            with self.lock:
                if self.bar is not None:
                    self.bar.refresh()


def summary(line: str) -> None:
    """The last line of long work on a terminal (on stderr, after what stdout got)."""
    if sys.stderr.isatty():
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)


SWEEP_PHASES = {
    "live": "sweep: finding what is live",
    "executing": "sweep: executing, {deleted:,} deleted of {taken:,} taken",
    "marking": "sweep: marking, {scanned:,} objects scanned",
    "staging": "sweep: staging, {staged:,} staged",
    "finishing": "sweep: finishing",
}


def sweep_shown(figures: dict[str, Any] | None) -> Shown | None:
    """A running sweep's progress line from its figures (Store.sweep_progress, the
    status's `sweep_progress`); None when none runs."""
    if not figures:
        return None
    text = SWEEP_PHASES.get(figures.get("phase", ""), "sweep: {phase}")
    try:
        return text.format(**figures), None, None
    except (KeyError, ValueError):
        return f"sweep: {figures.get('phase')}", None, None


def sweep_summary(report: dict[str, Any], seconds: float) -> str:
    """The one line that ends a sweep on a terminal."""
    if report.get("dry_run"):
        return (
            f"sweep --dry-run: {report.get('scanned', 0):,} objects scanned, "
            f"{report.get('would_stage', 0):,} would be staged "
            f"({report.get('would_stage_bytes', 0):,} bytes) in {seconds:.1f} s"
        )
    line = (
        f"sweep: {report.get('scanned', 0):,} objects scanned, {report.get('live', 0):,} live, "
        f"{report.get('candidates_staged', 0):,} staged, {report.get('deleted', 0):,} deleted "
        f"({report.get('bytes_freed', 0):,} bytes freed), "
        f"{report.get('cancelled_by_arbitration', 0):,} kept by arbitration in {seconds:.1f} s"
    )
    if report.get("aborted"):
        line += f"; aborted: {report['aborted']}"
    return line


def open_input(name: str) -> IO[bytes]:
    return sys.stdin.buffer if name == "-" else open(name, "rb")  # noqa: SIM115


@contextlib.contextmanager
def output(path: str | None) -> Iterator[IO[bytes]]:
    """stdout, or a file that appears under its name only once complete."""
    if path is None or path == "-":
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def key_arg(text: str) -> Key:
    try:
        return Key.parse(text)
    except Invalid:
        raise argparse.ArgumentTypeError(
            f"not a key: {text!r} (use <algo>/<hex> or a bare sha256 or git-sha1 hex)"
        ) from None


def duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def window_arg(text: str) -> float:
    try:
        return parse_window(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def pin_key(path: Path) -> Key:
    """The key a pin under MNT/pins names: a symbolic link's target, or a pin written as a
    file's `user.alkfs.key` (`<algo>/<hex>`)."""
    if path.is_symlink():
        return key_from_link(os.readlink(path))
    return key_from_link(os.getxattr(path, "user.alkfs.key").decode())


def key_from_link(target: str) -> Key:
    """The key a pin symlink (`../objects/<algo>/<hex>`) points at."""
    parts = target.rstrip("/").split("/")
    if len(parts) < 2:
        raise StoreIO(f"unexpected pin link {target!r}")
    return Key.from_hex(Algorithm.from_label(parts[-2]), parts[-1])


# -- the two targets --------------------------------------------------------------------


class Target(Protocol):
    def put(self, path: str, algo: Algorithm, pin: str | None) -> Key: ...
    def get(self, key: Key, out: IO[bytes]) -> None: ...
    def stat(self, key: Key) -> dict[str, Any]: ...
    def pin(self, name: str, key: Key) -> None: ...
    def unpin(self, name: str) -> Key: ...
    def pins(self) -> list[tuple[str, Key]]: ...
    def roots_add(self, name: str, path: str) -> None: ...
    def roots_rm(self, name: str) -> None: ...
    def roots(self) -> list[tuple[str, str]]: ...
    def repo_create(self, repo_id: str, object_format: str) -> None: ...
    def repo_rm(self, repo_id: str) -> None: ...
    def repo_list(self) -> list[tuple[str, str]]: ...
    def git_import(self, gitdir: str, repo_id: str) -> str: ...
    def sweep(self, window_s: float | None, expire_now: bool = False) -> dict[str, Any]: ...
    def dry_run(self) -> dict[str, Any]: ...
    def staged(self) -> Iterator[str]: ...
    def verify(self) -> tuple[list[str], int]: ...
    def status(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class StoreTarget:
    """The library on a store directory, holding its lock."""

    def __init__(self, path: str, create: bool, database: str | None = None) -> None:
        from .app import Alkfs, store_exists

        root = Path(path)
        if not create and not store_exists(root):
            raise Missing(f"no store at {root}")
        self.root = root
        self.app = Alkfs.open(root, database=database)
        self.store = self.app.store

    def close(self) -> None:
        self.app.close()

    def _stat(self, key: Key):  # noqa: ANN202 - ObjectStat
        st = self.store.stat(key)
        if st is None:
            raise Missing(f"{key}: no such object")
        return st

    def put(self, path: str, algo: Algorithm, pin: str | None) -> Key:
        with open_input(path) as f:
            result = self.store.put(f, algo=algo)
        try:
            if pin is not None:
                self.app.pins.pin(pin, result.key)
        finally:
            result.pin.release()
        return result.key

    def get(self, key: Key, out: IO[bytes]) -> None:
        st = self._stat(key)
        if st.tier != "large":
            data = self.store.get(key)
            if data is None:
                raise Missing(f"{key}: no such object")
            out.write(data)
            return
        path = self.store.large_path(key)
        assert path is not None
        try:
            self.store.verify_file(key, path)  # streams the hash; Corrupt on a mismatch
            with open(path, "rb") as f:
                if not self.store.is_verified(key, os.fstat(f.fileno())):
                    raise Corrupt(f"{key}: the file changed while it was read")
                shutil.copyfileobj(f, out, CHUNK)
        except FileNotFoundError:
            raise Missing(f"{key}: no such object") from None

    def stat(self, key: Key) -> dict[str, Any]:
        st = self._stat(key)
        return {
            "key": str(key),
            "algorithm": key.algo.label,
            "size": st.size,
            "tier": st.tier,
            "stored_at": iso(st.stored_ns),
            "pins": sorted(self.app.pins.names_for(key)),
        }

    def pin(self, name: str, key: Key) -> None:
        self._stat(key)
        self.app.pins.pin(name, key)

    def unpin(self, name: str) -> Key:
        rec = self.app.pins.get(name)
        if rec is None:
            raise Missing(f"no pin {name!r}")
        self.app.pins.unpin(name)
        return rec.key

    def pins(self) -> list[tuple[str, Key]]:
        return sorted((p.name, p.key) for p in self.app.pins.list())

    def roots_add(self, name: str, path: str) -> None:
        self.app.roots.add(name, path)

    def roots_rm(self, name: str) -> None:
        self.app.roots.remove(name)

    def roots(self) -> list[tuple[str, str]]:
        return [(r.name, r.path) for r in self.app.roots.list()]

    def repo_create(self, repo_id: str, object_format: str) -> None:
        self.app.refs.create_repo(repo_id, object_format)

    def repo_rm(self, repo_id: str) -> None:
        self.app.refs.delete_repo(repo_id)

    def repo_list(self) -> list[tuple[str, str]]:
        return sorted((r.id, r.object_format) for r in self.app.refs.repos())

    def git_import(self, gitdir: str, repo_id: str) -> str:
        from .git.importer import import_repo

        r = import_repo(self.app, gitdir, repo_id)  # its own progress bar, on a terminal only
        return r.summary()

    def sweep(self, window_s: float | None, expire_now: bool = False) -> dict[str, Any]:
        with Progress("sweep") as shown:

            def progress(phase: str, report: Any) -> None:
                line = sweep_shown(self.store.sweep_progress)
                if line is not None:
                    shown.show(*line)

            report = self.store.sweep(
                window_s,
                expire_now=expire_now,
                progress=progress if shown.bar is not None else None,
            )
        return report.to_dict()

    def dry_run(self) -> dict[str, Any]:
        from .gc.sweep import dry_run

        with Progress("sweep --dry-run"):
            return dry_run(self.store)

    def staged(self) -> Iterator[str]:
        from .gc import staged

        return staged.lines(self.store)

    def verify(self) -> tuple[list[str], int]:
        total = sum(c["count"] for c in self.store.counts().values())
        seen = 0

        def progress(n: int) -> None:
            nonlocal seen
            seen += 1
            bar.update(n - bar.n)

        with progress_bar("verify", total) as bar:
            bad = self.store.verify(progress=progress)
        return [str(k) for k in bad], seen

    def status(self) -> dict[str, Any]:
        return self.app.status()


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

    def stat(self, key: Key) -> dict[str, Any]:
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
            # every ref is listed in packed-refs (SPEC 3.3): removing it removes them all
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
        from .git.connected import check_connected
        from .git.importer import resolve_gitdir

        with Progress("connectivity check"):
            check_connected(resolve_gitdir(gitdir))
        repo = self.root / "repos" / repo_id
        if not repo.is_dir():
            src_format = _git(gitdir, "rev-parse", "--show-object-format").strip()
            self.repo_create(repo_id, src_format)
        from .git import lfs  # the media first, as git-lfs's pre-push does

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
        # the import returns with its objects served from derived packs (SPEC 3.2)
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
            EACCES="only the mount's owner may write its control file",
        ):
            fd = os.open(self.root / ".alkfs" / "control", os.O_WRONLY)
            try:
                os.write(fd, f"{command}\n".encode())
            finally:
                os.close(fd)

    def sweep(self, window_s: float | None, expire_now: bool = False) -> dict[str, Any]:
        words = ["sweep"] + (["--expire-now"] if expire_now else [])
        if window_s is not None:
            words.append(format_duration(window_s))
        with Progress("sweep", lambda: sweep_shown(self.status().get("sweep_progress"))):
            self.control(" ".join(words))  # (returns once the sweep is done)
        report = self.status().get("last_sweep")
        if report is None:
            raise StoreIO("sweep: the daemon reported no sweep")
        return report

    def dry_run(self) -> dict[str, Any]:
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

    def status(self) -> dict[str, Any]:
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


# -- the commands ---------------------------------------------------------------------------


def emit_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


def check_usage(a: argparse.Namespace) -> None:
    """What argparse cannot say, checked before any target is touched."""
    if a.command == "put" and a.pin is not None and len(a.files) > 1:
        raise Usage("--pin names one object: give one FILE with it")


def cmd_put(t: Target, a: argparse.Namespace) -> int:
    for name in a.files:
        try:
            key = t.put(name, Algorithm.from_label(a.algo), a.pin)
        except AlkfsError as exc:
            raise type(exc)(f"{name}: {exc}") from exc  # which of the files failed
        print(key, flush=True)
        if a.pin is None:
            print(
                f"alkfs: {key} is not pinned: nothing keeps it, so a sweep deletes it once "
                "the window has passed (alkfs pin NAME KEY, or put --pin NAME)",
                file=sys.stderr,
            )
    return 0


def cmd_get(t: Target, a: argparse.Namespace) -> int:
    with output(a.output) as out:
        t.get(a.key, out)
    return 0


Handler = Callable[[Target, argparse.Namespace], int]


def calls(method: str, *fields: str) -> Handler:
    """A command that calls the target's `method` with the parsed `fields` and prints
    nothing (pin, unpin, repo create, repo rm)."""

    def handler(t: Target, a: argparse.Namespace) -> int:
        getattr(t, method)(*(getattr(a, f) for f in fields))
        return 0

    return handler


def shows(method: str, *fields: str) -> Handler:
    """A command that prints what the target's `method` returns as JSON (stat, sweep,
    status)."""

    def handler(t: Target, a: argparse.Namespace) -> int:
        emit_json(getattr(t, method)(*(getattr(a, f) for f in fields)))
        return 0

    return handler


def lists(method: str) -> Handler:
    """A command that prints the pairs the target's `method` returns, one `A B` a line
    (pins, repo list)."""

    def handler(t: Target, a: argparse.Namespace) -> int:
        for left, right in getattr(t, method)():
            print(f"{left} {right}")
        return 0

    return handler


cmd_stat = shows("stat", "key")
cmd_pin = calls("pin", "name", "key")


def cmd_unpin(t: Target, a: argparse.Namespace) -> int:
    """Prints the key it released (pin it again with `alkfs pin NAME KEY`)."""
    print(t.unpin(a.name))
    return 0


def cmd_staged(t: Target, a: argparse.Namespace) -> int:
    for line in t.staged():
        print(line)
    return 0


cmd_pins = lists("pins")
cmd_roots = lists("roots")
cmd_roots_rm = calls("roots_rm", "name")


def cmd_roots_add(t: Target, a: argparse.Namespace) -> int:
    t.roots_add(a.name, os.path.abspath(a.path))
    return 0


cmd_repo_create = calls("repo_create", "id", "object_format")
cmd_repo_rm = calls("repo_rm", "id")
cmd_repo_list = lists("repo_list")


def cmd_git_import(t: Target, a: argparse.Namespace) -> int:
    if not Path(a.gitdir).is_dir():
        raise Missing(f"{a.gitdir}: no such directory")
    t0 = time.monotonic()
    what = t.git_import(a.gitdir, a.repo)
    print(f"imported {a.gitdir} as {a.repo}: {what} in {time.monotonic() - t0:.1f} s")
    return 0


def cmd_sweep(t: Target, a: argparse.Namespace) -> int:
    t0 = time.monotonic()
    if a.dry_run:
        if a.window is not None or a.expire_now:
            raise Invalid("sweep --dry-run takes neither --window nor --expire-now")
        report = t.dry_run()
    else:
        report = t.sweep(a.window, a.expire_now)
    emit_json(report)
    summary(sweep_summary(report, time.monotonic() - t0))
    return 0


class VerifyFailed(AlkfsError):
    """verify found corrupt objects (already listed on stdout)."""


def cmd_verify(t: Target, a: argparse.Namespace) -> int:
    t0 = time.monotonic()
    bad, checked = t.verify()
    emit_json({"corrupt": bad})
    summary(
        f"verify: {checked:,} object{'s' if checked != 1 else ''} verified, {len(bad):,} "
        f"corrupt in {time.monotonic() - t0:.1f} s"
    )
    if bad:
        raise VerifyFailed(f"{len(bad)} corrupt object{'s' if len(bad) != 1 else ''}")
    return 0


cmd_status = shows("status")


def cmd_migrate(t: Target, a: argparse.Namespace) -> int:
    raise Usage("migrate works on a store directory: give --store DIR")  # (see main)


def cmd_compact(t: Target, a: argparse.Namespace) -> int:
    if not isinstance(t, StoreTarget):
        raise Usage("compact works on a store no daemon holds: give --store DIR, not --mount")
    db = t.store.db
    if db is None or db.engine != "sqlite":
        print("nothing to compact: the database is PostgreSQL's (its autovacuum reuses space)")
        return 0
    t0 = time.monotonic()
    shrunk = db.compact()
    print(
        f"compacted {t.root / 'store.db'}: {max(0, shrunk):,} bytes given back "
        f"in {time.monotonic() - t0:.1f} s"
    )
    return 0


def run_migrate(path: str, database: str | None, a: argparse.Namespace) -> int:
    """`migrate`: sqlite -> PostgreSQL (`--database URI`), or back (`--to-sqlite`)."""
    from . import migrate

    if database is None:
        raise Usage("migrate needs --database URI (or $ALKFS_DATABASE)")
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = progress_bar("migrate", total)
            bar.unit = "row"
        bar.n = done
        bar.refresh()

    step = migrate.to_sqlite if a.to_sqlite else migrate.to_postgresql
    try:
        summary = step(path, database, progress if sys.stderr.isatty() else None)
    finally:
        if bar is not None:
            bar.close()
    print(json.dumps(summary), flush=True)
    return 0


# -- parsing --------------------------------------------------------------------------------


KEY_FORMATS = (
    "KEY is <algo>/<hex> (sha256, blake3, git-sha1, git-sha256) or a bare hex (sha256, or\n"
    "git-sha1 for 40 digits); DURATION is 0, 90s, 15m, 1h, 2d; the target is --mount MNT\n"
    "or --store DIR ($ALKFS_MOUNT, $ALKFS_STORE)."
)
EXAMPLES = {
    "put": "alkfs --mount /mnt/alk put --pin backup-2026-11 backup.tar",
    "get": "alkfs --mount /mnt/alk get sha256/5f3c... -o copy.tar",
    "stat": "alkfs --mount /mnt/alk stat sha256/5f3c...",
    "pin": "alkfs --mount /mnt/alk pin release-1 sha256/5f3c...",
    "unpin": "alkfs --mount /mnt/alk unpin release-1",
    "pins": "alkfs --mount /mnt/alk pins",
    "roots": "alkfs --mount /mnt/alk roots",
    "roots add": "alkfs --mount /mnt/alk roots add me-work /home/me/work",
    "roots rm": "alkfs --mount /mnt/alk roots rm me-work",
    "repo create": "alkfs --mount /mnt/alk repo create myproj --object-format sha256",
    "repo rm": "alkfs --mount /mnt/alk repo rm myproj",
    "repo list": "alkfs --mount /mnt/alk repo list",
    "git import": "alkfs --store /srv/alk git import /srv/git/myproj.git --repo myproj",
    "staged": "alkfs --mount /mnt/alk staged",
    "sweep": "alkfs --mount /mnt/alk sweep --dry-run",
    "migrate": "alkfs --store /srv/alk migrate --database postgresql://alkfs@db/alkfs",
    "verify": "alkfs --store /srv/alk verify",
    "compact": "alkfs --store /srv/alk compact",
    "status": "alkfs --mount /mnt/alk status",
}


def build_parser() -> argparse.ArgumentParser:
    target = argparse.ArgumentParser(add_help=False)
    group = target.add_argument_group("target (default: $ALKFS_MOUNT or $ALKFS_STORE)")
    group.add_argument(
        "--mount", metavar="MNT", default=argparse.SUPPRESS, help="work through a running mount"
    )
    group.add_argument(
        "--store",
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="work on a store no daemon holds",
    )
    group.add_argument(
        "--database",
        metavar="URI",
        default=argparse.SUPPRESS,
        help="with --store: the store's PostgreSQL database (default: $ALKFS_DATABASE)",
    )

    p = argparse.ArgumentParser(
        prog="alkfs", description="The alkfs command line.", parents=[target]
    )
    p.add_argument("--version", action="version", version=f"alkfs {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(parent: Any, name: str, handler: Callable[..., int], help: str) -> Any:
        prefix = getattr(parent, "_prog_prefix", "alkfs")  # ("alkfs", "alkfs repo", ...)
        full = f"{prefix} {name}".removeprefix("alkfs").strip()
        example = EXAMPLES.get(full)
        c = parent.add_parser(
            name,
            parents=[target],
            help=help,
            description=help,
            epilog=None if example is None else f"example:\n  {example}\n\n{KEY_FORMATS}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        c.set_defaults(handler=handler)
        return c

    c = command(sub, "put", cmd_put, "store files; print <algo>/<hex> for each")
    c.add_argument("--algo", choices=ALGO_LABELS, default="sha256")
    c.add_argument("--pin", metavar="NAME", help="pin the (one) stored object as NAME")
    c.add_argument("files", nargs="+", metavar="FILE", help="a file, or - for stdin")

    c = command(sub, "get", cmd_get, "write an object's bytes (verified)")
    c.add_argument("key", type=key_arg, metavar="KEY")
    c.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")

    c = command(sub, "stat", cmd_stat, "an object's metadata as JSON")
    c.add_argument("key", type=key_arg, metavar="KEY")

    c = command(sub, "pin", cmd_pin, "pin an object under a name")
    c.add_argument("name", metavar="NAME")
    c.add_argument("key", type=key_arg, metavar="KEY")

    c = command(sub, "unpin", cmd_unpin, "remove a pin; print the key it kept")
    c.add_argument("name", metavar="NAME")

    command(sub, "pins", cmd_pins, "list pins: NAME KEY per line")

    roots = command(
        sub, "roots", cmd_roots, "borrowers kept alive by sweeps: list them (NAME PATH per line)"
    ).add_subparsers(dest="roots_command", metavar="ACTION", required=False)
    c = command(roots, "add", cmd_roots_add, "register a repository that borrows from the store")
    c.add_argument("name", metavar="NAME")
    c.add_argument("path", metavar="PATH", help="its work tree or git dir")
    c = command(roots, "rm", cmd_roots_rm, "unregister a borrower")
    c.add_argument("name", metavar="NAME")

    repo = sub.add_parser("repo", help="repositories").add_subparsers(
        dest="repo_command", metavar="ACTION", required=True
    )
    c = command(repo, "create", cmd_repo_create, "create a repository")
    c.add_argument("id", metavar="ID")
    c.add_argument("--object-format", choices=["sha1", "sha256"], default="sha1")
    c = command(repo, "rm", cmd_repo_rm, "delete a repository and its refs")
    c.add_argument("id", metavar="ID")
    command(repo, "list", cmd_repo_list, "list repositories: ID FORMAT per line")

    git = sub.add_parser("git", help="git").add_subparsers(
        dest="git_command", metavar="ACTION", required=True
    )
    c = command(git, "import", cmd_git_import, "import a git repository's objects and refs")
    c.add_argument("gitdir", metavar="GITDIR")
    c.add_argument("--repo", required=True, metavar="ID")

    command(sub, "staged", cmd_staged, "list staged candidates: KEY SIZE DEADLINE (UTC) per line")
    c = command(sub, "sweep", cmd_sweep, "run a sweep; print its report as JSON")
    c.add_argument(
        "--dry-run",
        action="store_true",
        help="stage and delete nothing: list what would be staged (key, size, why)",
    )
    c.add_argument(
        "--expire-now",
        action="store_true",
        help="delete every staged candidate now, whatever its deadline (each re-checked)",
    )
    c.add_argument(
        "--window", type=window_arg, metavar="DURATION", help="e.g. 0, 90s, 1h (at most 10 years)"
    )

    c = command(
        sub,
        "migrate",
        cmd_migrate,
        "move the store's database into PostgreSQL (--database URI), or back (--to-sqlite)",
    )
    c.add_argument(
        "--to-sqlite",
        action="store_true",
        help="move a PostgreSQL-backed store back into its sqlite file STORE/store.db",
    )

    command(sub, "verify", cmd_verify, "re-hash every object; list corrupt ones")
    command(
        sub,
        "compact",
        cmd_compact,
        "rewrite the sqlite file to give all its free space back (the daemon stopped)",
    )
    command(sub, "status", cmd_status, "the store's status as JSON")
    return p


def command_name(a: argparse.Namespace) -> str:
    sub = (
        getattr(a, "repo_command", None)
        or getattr(a, "git_command", None)
        or getattr(a, "roots_command", None)
    )
    return f"{a.command} {sub}" if sub else a.command


def resolve_target(a: argparse.Namespace) -> tuple[str, str]:
    """("mount" | "store", path) from the options, else the environment."""
    mount = getattr(a, "mount", None)
    store = getattr(a, "store", None)
    if mount is not None and store is not None:
        raise Usage("give --mount or --store, not both")
    if mount is not None:
        return "mount", mount
    if store is not None:
        return "store", store
    env_mount, env_store = os.environ.get("ALKFS_MOUNT"), os.environ.get("ALKFS_STORE")
    if env_mount and env_store:
        raise Usage("both ALKFS_MOUNT and ALKFS_STORE are set: choose with --mount or --store")
    if env_mount:
        return "mount", env_mount
    if env_store:
        return "store", env_store
    raise Usage("no target: give --mount MNT or --store DIR (or set ALKFS_MOUNT / ALKFS_STORE)")


def _fail(prog: str, message: str, status: int) -> int:
    print(f"{prog}: {message}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)  # exits 2 on bad usage
    name = command_name(a)

    def usage(message: str) -> NoReturn:
        parser.error(f"{name}: {message}")

    logging.basicConfig(  # the library's log lines would break the one-line rule
        level=logging.DEBUG if os.environ.get("ALKFS_DEBUG") else logging.CRITICAL + 1,
        format="alkfs: %(name)s: %(message)s",
    )
    try:
        check_usage(a)
        kind, path = resolve_target(a)
        if kind == "mount" and getattr(a, "database", None):
            raise Usage("--database goes with --store (a mount's daemon has its own)")
        if kind == "mount" and a.command in ("migrate", "compact"):
            raise Usage(
                f"{a.command} works on a store no daemon holds: give --store DIR, not --mount"
            )
    except Usage as exc:
        usage(str(exc))
    target: Target | None = None
    try:
        if kind == "mount":
            target = MountTarget(path)
        else:
            database = getattr(a, "database", None) or os.environ.get("ALKFS_DATABASE") or None
            if a.command == "migrate":  # (opens the store itself, holding its lock)
                return run_migrate(path, database, a)
            target = StoreTarget(path, create=name in CREATING, database=database)
        return a.handler(target, a)
    except Usage as exc:
        usage(str(exc))
    except KeyboardInterrupt:
        return _fail(f"alkfs {name}", "interrupted", 130)
    except BrokenPipeError:
        # The reader went away (`alkfs get KEY | head`): not our failure to report.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (AlkfsError, OSError) as exc:
        return _fail(f"alkfs {name}", explain(exc), 1)
    except Exception as exc:  # a bug: still one line, the traceback on request
        if os.environ.get("ALKFS_DEBUG"):
            raise
        return _fail(f"alkfs {name}", explain(exc) + " (set ALKFS_DEBUG=1 for the traceback)", 1)
    finally:
        if target is not None:
            target.close()


if __name__ == "__main__":
    sys.exit(main())
