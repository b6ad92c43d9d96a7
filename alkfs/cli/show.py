"""How the command line speaks: failures as one line, progress on a terminal, one summary
line at the end; and the argument readers and small helpers the commands share."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ..durations import parse_duration, parse_window
from ..errors import (
    AlkfsError,
    Busy,
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
from ..keys import Algorithm, Key

if TYPE_CHECKING:
    from collections.abc import Mapping

    from tqdm import tqdm  # (untyped: its bars are what it makes)

    from ..gc.sweep import SweepProgressFigures

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


def progress_bar(desc: str, total: int | None = None) -> tqdm:
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
        self.bar: tqdm | None = None
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


def sweep_shown(figures: SweepProgressFigures | None) -> Shown | None:
    """A running sweep's progress line from its figures (Store.sweep_progress, the
    status's `sweep_progress`); None when none runs."""
    if not figures:
        return None
    text = SWEEP_PHASES.get(figures.get("phase", ""), "sweep: {phase}")
    try:
        return text.format(**figures), None, None
    except (KeyError, ValueError):
        return f"sweep: {figures.get('phase')}", None, None


def sweep_summary(report: Mapping[str, object], seconds: float) -> str:
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
    return sys.stdin.buffer if name == "-" else open(name, "rb")


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
