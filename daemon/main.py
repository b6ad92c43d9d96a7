"""alkfsd: mount a store and serve it until unmounted, SIGINT or SIGTERM (then exit 0).

    alkfsd STORE MNT [--threshold N] [--window 1h] [--kv-only] [--sweep-every 15m]
                     [--push-grace 10m] [--read-only] [--allow-other] [--owner USER[:GROUP]]
                     [--config FILE] [--demo]

`--push-grace` is how long the objects a push (or any git write through
/repos/<id>/objects) stored stay pinned when no ref write of it commits (default
max(10 min, the window); see daemon/staging/scratch.py). The config file (TOML) takes the same
keys (`store`, `mountpoint`, `threshold`, `window`, `kv_only`, `sweep_every`,
`push_grace`, `read_only`, `allow_other`, `owner`, `demo`); flags on the command line win.
Readiness is reported to systemd (`READY=1` on $NOTIFY_SOCKET) once the mount answers.

A mountpoint where a live FUSE mount already answers is refused (one line, exit 1):
mounting over it would hide it without a word. A dead one (ENOTCONN or ECONNABORTED,
its daemon gone) is cleared at start; daemon/deathguard.py makes sure a killed daemon's
mount dies with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import gc
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING

import pyfuse3
import trio

from alkfs.app import Alkfs, store_exists
from alkfs.durations import format_duration
from alkfs.errors import AlkfsError, StoreLocked, log_failure
from alkfs.settings import LOG_PRIORITIES_ENV as LOG_PRIORITIES_ENV
from alkfs.settings import log_priorities
from alkfs.store import Store

from . import deathguard, packs, pyfuse3_patches
from .config import Settings, Usage, hide_password, settings
from .context import Context, Options
from .deathguard import unescape
from .errors import ClipFormatter
from .fs import Operations
from .invalidate import Invalidator
from .staging.spool import clear_spool, spool_dir
from .status import serve_metrics

if TYPE_CHECKING:
    import threading
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger("alkfsd")

# One line per event: `TIME alkfsd[PID] LEVEL message`; in the journal, which stamps
# each line with its own time, pid and identifier, `<PRIORITY>LEVEL message`; the same
# when LOG_PRIORITIES_ENV (ALKFS_LOG_PRIORITIES, alkfs/settings.py) is 1 (the mount
# helper's logger stamps them so).
LOG_FORMAT = "%(asctime)s alkfsd[%(process)d] %(levelname)s %(message)s"
JOURNAL_FORMAT = "%(levelname)s %(message)s"

MAX_TASKS = 64
FD_LIMIT_MAX = 1 << 20  # (raise_fd_limit)
# what a mount whose daemon is gone answers (ECONNABORTED: its connection was aborted,
# by fusectl or our death guard, daemon/deathguard.py)
DEAD_MOUNT = (errno.ENOTCONN, errno.ECONNABORTED)
READ_AHEAD_KB = 1024  # the kernel's default for a FUSE mount is 128 (one request per 128 KiB)
# glibc's malloc: every 1 MiB WRITE's bytes from the heap, and freed memory kept for the
# next ones instead of given back at once (docs/architecture.md, "Large writes")
MMAP_THRESHOLD = 4 << 20
TRIM_THRESHOLD = 32 << 20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def sd_notify(message: str) -> None:
    """Tell systemd (Type=notify) something; silent when not run by systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(message.encode())
    except OSError as exc:
        log.warning("sd_notify to %s failed: %s", addr, exc)


def mounted_at(mnt: str) -> tuple[str, str] | None:
    """(source, fstype) of the topmost mount at `mnt`, or None."""
    found = None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and unescape(parts[1]) == mnt:
                    found = (unescape(parts[0]), parts[2])
    except OSError:
        return None
    return found


class MountpointBusy(Exception):
    pass


def refuse_live_mount(mnt: str) -> None:
    """MountpointBusy when a FUSE mount that answers is at `mnt` (a dead one answers
    ENOTCONN or ECONNABORTED and is left to clear_stale_mount)."""
    entry = mounted_at(mnt)
    if entry is None or not entry[1].startswith("fuse"):
        return
    try:
        os.statvfs(mnt)
    except OSError:
        return
    source, fstype = entry
    raise MountpointBusy(
        f"cannot mount at {mnt}: a live mount is there ({fstype}, {source}); "
        f"unmount it first (fusermount3 -u {mnt})"
    )


def clear_stale_mount(mnt: str) -> None:
    """A mount left by a dead daemon answers ENOTCONN (ECONNABORTED once its connection
    was aborted); detach it so we can mount again.
    (statvfs, not stat: the kernel may answer stat from its attribute cache.)"""
    try:
        os.statvfs(mnt)
    except FileNotFoundError:
        return  # (refuse_paths says so: a missing mountpoint is never made)
    except OSError as exc:
        if exc.errno not in DEAD_MOUNT:
            raise
        log.warning("clearing a stale mount at %s (errno=%s)", mnt, errno.errorcode[exc.errno])
        subprocess.run(["fusermount3", "-uz", mnt], check=False, capture_output=True)


def refuse_paths(store: str, mnt: str, create: bool) -> str | None:
    """Why STORE or MOUNTPOINT is surely a mistake (a typo), or None: a mountpoint that
    is missing or not a directory; a STORE that holds no store, without --create."""
    if not os.path.isdir(mnt):
        what = "is not a directory" if os.path.lexists(mnt) else "does not exist"
        return f"the mountpoint {mnt} {what} (make it with mkdir -p)"
    if not create and not store_exists(store):
        return f"no store at {store}: give --create to make one there"
    return None


def open_app(store: str, conf: Settings) -> tuple[Alkfs, Store]:
    app = Alkfs.open(
        store,
        mode="kv-only" if conf.get("kv_only") else None,
        threshold=conf.get("threshold"),
        window_s=conf.get("window"),
        database=conf.get("database"),
    )
    return app, app.store


def demo(app: Alkfs, store: Store) -> None:
    """Fill a fresh store with a few samples, a pin, and this directory's git history."""
    from alkfs.keys import Algorithm

    if any(c["count"] for c in store.counts().values()):
        log.info("demo: the store is not empty; adding nothing")
        return
    welcome = store.add(b"Welcome to alkfs: every file here is named by the hash of its content.\n")
    store.add(b"the same idea, another hash: blake3\n", algo=Algorithm.BLAKE3)
    if store.mode == "dual-tier":
        store.add(b"a large object lives as a file of its own.\n" * (store.threshold // 40 + 100))
    log.info("demo: stored samples; welcome is sha256/%s", welcome.hex)
    app.pins.pin("welcome", welcome)
    log.info("demo: pinned sha256/%s as welcome", welcome.hex)
    from alkfs.git.importer import import_repo

    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
        ).stdout.strip()
        result = import_repo(app, top, "alkfs", progress=False)
        log.info(
            "demo: imported %s as repository alkfs: %d objects (%d stored, %d present), %d refs",
            top,
            result.objects,
            result.stored,
            result.present,
            len(result.refs),
        )
    except Exception as exc:
        log.info("demo: no git history imported (%s)", exc)


async def serve(ctx: Context, mnt: str, sweep_every: float | None, ops: Operations) -> None:
    """Serve the mount until the session ends. Every background task of the mount starts
    here, under this nursery, and stops here (workers.py)."""
    workers = ctx.workers
    workers.add("alkfsd signals", _signals, ctx)
    workers.add("alkfsd ready", _ready, ctx, mnt)
    invalidator = ctx.invalidator
    assert isinstance(invalidator, Invalidator)  # (a mount's: a kernel session takes it)
    workers.add("alkfsd invalidator", invalidator.run)
    workers.add("alkfsd pin expiry", ctx.writes.run_expiry)
    workers.add("alkfsd intents", ctx.pending.run)
    workers.add("alkfsd derived packs", packs.run, ctx)  # first set, then intake
    workers.add("alkfsd refusal counts", _log_counts, ops)
    if sweep_every:
        workers.add("alkfsd sweeper", _sweeper, ctx, sweep_every)
    async with trio.open_nursery() as nursery:
        await nursery.start(workers.run)
        await pyfuse3.main(min_tasks=1, max_tasks=MAX_TASKS)
        ctx.store.stopping.set()  # (unmounted: a sweep or verify still running ends now)
        nursery.cancel_scope.cancel()


async def _signals(ctx: Context) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("%s: unmounting", signal.Signals(signum).name)
            sd_notify("STOPPING=1")
            ctx.store.stopping.set()  # (a sweep or verify ends at its next safe point)
            pyfuse3.terminate()


async def _ready(ctx: Context, mnt: str) -> None:
    # Answered by our own loop: the mount works. Abandoned if we stop first, so a
    # request the loop will never answer cannot hold the shutdown.
    st = await trio.to_thread.run_sync(os.stat, mnt, abandon_on_cancel=True)
    set_read_ahead(st.st_dev)
    sd_notify("READY=1\nSTATUS=serving " + mnt)
    log.info("ready: %s serves %s", mnt, ctx.store.path)


def set_read_ahead(dev: int, kb: int = READ_AHEAD_KB) -> None:
    """Let the kernel read ahead 1 MiB at a time on this mount: first reads of large objects
    take a quarter of the requests (measured ~2x faster cold). Best effort."""
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kb))
        log.info("read-ahead of the mount set to %d KiB (%s)", kb, path)
    except OSError as exc:
        log.info("read-ahead of the mount left as it is (%s: %s)", path, exc)


async def _sweeper(ctx: Context, every: float) -> None:
    while True:
        ctx.next_sweep_ts = time.time() + every  # (status: next_sweep)
        await trio.sleep(every)
        try:
            await ctx.sweep(scheduled=True)
        except Exception:
            log_failure(log, "periodic sweep failed")


async def _log_counts(ops: Operations) -> None:
    """Log the counts of rate-limited refusals once their second is over (errors.py)."""
    while True:
        await trio.sleep(1.0)
        ops.log_limit.flush()


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to serve allocations up to MMAP_THRESHOLD from its heaps and
    keep up to TRIM_THRESHOLD of freed memory in each. By default a 1 MiB buffer is
    mapped afresh, or given back when freed, and each of its pages is faulted in again:
    a 1 GiB cp into /pins made ~100,000 page faults in the daemon without this, ~300
    with it (after the first, ~11,000; the daemon keeps ~30 MB more). False (nothing
    changed) off glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def raise_fd_limit() -> None:
    """The soft descriptor limit up to the hard one (at most FD_LIMIT_MAX): every open
    large object or pack holds one of the daemon's (the users' bounds: access.py)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_LIMIT_MAX if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT_MAX)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def to_journal(stream: IO[str], environ: Mapping[str, str]) -> bool:
    """Whether `stream` is journald's: systemd sets JOURNAL_STREAM=DEV:INO (decimal) for a
    service whose stderr or stdout it connected to the journal (systemd.exec(5)); it is
    ours only if `stream` is that very file (a child whose stderr is a pipe or a file
    inherits the variable, not the stream)."""
    dev, sep, ino = environ.get("JOURNAL_STREAM", "").partition(":")
    if not (sep and dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):  # (no descriptor: a test's capture)
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


def priorities_asked(environ: Mapping[str, str]) -> bool:
    """Whether whoever reads stderr asked for the journal's form (LOG_PRIORITIES_ENV=1): a
    syslog priority prefix per line and no time of ours. mount.fuse.alkfs asks, its
    `logger --prio-prefix` giving each line its priority and syslog its time."""
    return log_priorities(environ)


def log_handler(
    stream: IO[str] | None = None, environ: Mapping[str, str] | None = None
) -> logging.Handler:
    """The daemon's one log handler, on `stream` (stderr): LOG_FORMAT, or JOURNAL_FORMAT
    with a syslog priority prefix per line when `stream` is the journal (to_journal) or
    the reader asked for it (priorities_asked)."""
    stream = sys.stderr if stream is None else stream
    environ = os.environ if environ is None else environ
    journal = priorities_asked(environ) or to_journal(stream, environ)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        ClipFormatter(JOURNAL_FORMAT, journal=True) if journal else ClipFormatter(LOG_FORMAT)
    )
    return handler


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()
    raise_fd_limit()
    logging.basicConfig(level=logging.INFO, handlers=[log_handler()])
    logging.getLogger("pyfuse3").setLevel(logging.WARNING)
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)  # (its retries: one line each)
    if argv is None:
        hide_password(sys.argv[1:])
    try:
        conf = settings(argv)
    except Usage as exc:
        print(f"alkfsd: {exc}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(conf["log_level"].upper())
    unpatched = pyfuse3_patches.refusal(pyfuse3)
    if unpatched is not None:
        print(f"alkfsd: {unpatched}", file=sys.stderr)
        return 1
    store_path = os.path.abspath(str(conf["store"]))
    mnt = os.path.abspath(str(conf["mountpoint"]))
    try:
        refuse_live_mount(mnt)
        clear_stale_mount(mnt)
    except MountpointBusy as exc:
        print(f"alkfsd: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"alkfsd: cannot use the mountpoint {mnt}: {exc}", file=sys.stderr)
        return 1
    refusal = refuse_paths(store_path, mnt, bool(conf.get("create")))
    if refusal is not None:
        print(f"alkfsd: {refusal}", file=sys.stderr)
        return 1
    try:
        app, store = open_app(store_path, conf)
    except StoreLocked as exc:
        print(f"alkfsd: {exc}", file=sys.stderr)
        return 1
    except AlkfsError as exc:
        print(f"alkfsd: cannot open the store {store_path}: {exc}", file=sys.stderr)
        return 1
    ctx: Context | None = None
    ops: Operations | None = None
    metrics_server: tuple[WSGIServer, threading.Thread] | None = None
    mounted = False
    guard = None
    try:
        if clear_spool(store):
            log.info("removed what earlier writes left in %s", spool_dir(store))
        if conf.get("demo"):
            demo(app, store)
        options = Options(
            read_only=bool(conf.get("read_only")),
            allow_other=bool(conf.get("allow_other")),
            push_grace_s=conf.get("push_grace"),
            owner_uid=conf["owner"][0] if conf.get("owner") else None,
            owner_gid=conf["owner"][1] if conf.get("owner") else None,
        )
        # every pin name into an in-memory filter: a new name's lookups then cost no
        # query (alkfs/pins/, Misses; only where this process makes every change)
        app.pins.prime()
        ctx = Context(store, app=app, options=options)
        ctx.mountpoint = mnt
        ctx.prepare()  # its scratch dir emptied now: nothing of a previous daemon is used
        ops = Operations(ctx)
        try:  # (before the mount: the first git process then waits for none of it)
            trio.run(packs.prepare, ctx)
        except Exception:
            log.exception("derived packs: not prepared before the mount")
        # What start-up made (the published sets' indexes, the pin filter, the listings
        # found) lives as long as the mount: out of the collector's reach, so that no
        # full collection over it lands in the middle of the first requests.
        gc.collect()
        gc.freeze()
        fuse_options = set(pyfuse3.default_options)
        fuse_options |= {"fsname=alkfs:" + store_path.replace(",", "_"), "subtype=alkfs"}
        # The daemon decides who may do what (access.py), never the kernel: with
        # default_permissions the kernel would also drop the directory's attributes at
        # every create and ask for them again (one GETATTR more per new file).
        fuse_options.discard("default_permissions")
        if options.shared:  # other users reach it
            fuse_options.add("allow_other")
        if options.owner_only:
            # ... but with --owner alone the kernel keeps every other user out itself,
            # cached entries included: the tree's modes show the owner's bits only
            # (Context.mode_mask), checked by the kernel (one GETATTR more per create)
            fuse_options.add("default_permissions")
        if options.read_only:  # (`mount` shows ro; statvfs has ST_RDONLY)
            fuse_options.add("ro")
        try:
            pyfuse3.init(ops, mnt, fuse_options)
        except RuntimeError as exc:
            print(f"alkfsd: cannot mount at {mnt}: {exc}", file=sys.stderr)
            return 1
        mounted = True
        guard = deathguard.start(mnt)  # (from this, the main thread: deathguard.py)
        every = conf.get("sweep_every")
        log.info(
            "mounted %s at %s (database %s, mode %s, threshold %d, window %s, %s%s)",
            store_path,
            mnt,
            "sqlite" if store.db is None else store.db.describe(),
            store.mode,
            store.threshold,
            format_duration(store.window_ns / 1e9),
            f"a sweep every {format_duration(every)}" if every else "no periodic sweeps",
            ", read-only" if options.read_only else "",
        )
        if every and not options.read_only:
            log.info(
                "sweeps delete what nothing keeps alive: a clone of %s/repos/ID made without "
                "--no-local borrows its objects; register it (ln -s /path/to/clone %s/roots/NAME)",
                mnt,
                mnt,
            )
        if conf.get("metrics_listen"):
            try:
                metrics_server = serve_metrics(ctx, str(conf["metrics_listen"]))
                log.info("metrics: http://%s/metrics", conf["metrics_listen"])
            except OSError as exc:
                log.error("metrics: cannot listen on %s: %s", conf["metrics_listen"], exc)
        trio.run(serve, ctx, mnt, conf.get("sweep_every"), ops)
    finally:
        if metrics_server is not None:
            metrics_server[0].shutdown()
            metrics_server[0].server_close()
        if ops is not None:
            ops.log_limit.flush(force=True)
        if mounted:
            pyfuse3.close(unmount=True)
            log.info("unmounted %s", mnt)
        deathguard.stop(guard)
        if ctx is not None:
            ctx.close()  # (push sessions' pins released, scratch bytes removed)
        app.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
