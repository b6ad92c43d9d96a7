#!/usr/bin/env python3
"""mount.fuse.alkfs: mount(8)'s helper for alkfs, so that a store mounts as other FUSE
filesystems do:

    mount -t fuse.alkfs /srv/alk /mnt/alk -o create,window=1h,allow_other
    /etc/fstab:   /srv/alk  /mnt/alk  fuse.alkfs  defaults,_netdev,window=1h  0 0

mount(8) runs `mount.fuse.alkfs STORE MNT [-sfnv] [-N NS] [-o OPTIONS] [-t fuse.alkfs]`.
Every alkfsd flag is an -o key with the flag's name (`window=1h` is `--window 1h`,
`allow_other` is `--allow-other`, `ro` is `--read-only`); the generic mount options
(`rw`, `defaults`, `_netdev`, `nofail`, `noauto`, `x-systemd.*`, ...) are taken and
dropped; any other key is refused (one line, exit 1, nothing started) unless -s (sloppy)
is given. `mount_timeout=SECONDS` (default 60) is the helper's own: how long the daemon
may take to mount. -f (fake) checks the options and starts nothing; -v says what it runs.

alkfsd is started detached (a session of its own, stdin /dev/null, cwd /), its output
read here until the mount answers (a new fuse.alkfs mount at MNT in /proc/self/mountinfo
that answers statvfs); then this exits 0 and the daemon's lines go to syslog/journald
through logger(1) (`alkfsd` is their tag; the first lines too), each at its own priority
with facility daemon: the daemon is asked (ALKFS_LOG_PRIORITIES=1) for a `<N>` prefix per
line and no time of its own, which `logger --prio-prefix` reads. A line of the daemon's
without one (a refusal before the mount) is daemon.err; after the mount, logger gives
such a line (a crash's traceback) the priority of the line before it. If the daemon
exits first, its error is printed as one line and this exits 1. `umount MNT` ends the
daemon (it exits when its mount goes away).

The standard library and the daemon's own mount-table reader (alkfsd.deathguard, which
imports nothing else): `make install` puts it in the install's venv, run by that venv's
Python, and starts the alkfsd beside it.
"""

from __future__ import annotations

import errno
import getopt
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

# (the daemon's reader of mount tables: the helper runs in the venv alkfsd is installed in)
from alkfsd.deathguard import unescape

PROG = "mount.fuse.alkfs"
USAGE = f"usage: {PROG} STORE MOUNTPOINT [-sfnv] [-o OPTIONS] [-t fuse.alkfs]"
FSTYPE = "fuse.alkfs"
# alkfsd's flags without a value, and with one (the -o key is the flag's name with _)
FLAGS = ("create", "allow_other", "read_only", "kv_only", "demo")
VALUED = (
    "window",
    "sweep_every",
    "push_grace",
    "database",
    "owner",
    "log_level",
    "metrics_listen",
    "config",
    "threshold",
)
ALIASES = {"ro": "read_only"}
# mount(8)'s generic options: taken and dropped (mount itself acts on them, or they
# mean nothing to a FUSE daemon); `owner` without a value is mount's, with one alkfsd's
GENERIC = frozenset(
    "rw defaults _netdev nofail noauto auto user nouser users group owner dev nodev suid "
    "nosuid exec noexec relatime norelatime noatime atime strictatime nostrictatime "
    "diratime nodiratime lazytime nolazytime async silent loud".split()
)
MOUNT_TIMEOUT_S = 60.0
STOP_WITHIN_S = 10.0
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
KEEP_BYTES = 1 << 20  # of the daemon's output before the mount answers
# the daemon's lines: `<N>LEVEL message` (N its syslog priority, 0-7), no time of its own
PRIORITIES_ENV = "ALKFS_LOG_PRIORITIES"  # (alkfsd.main.LOG_PRIORITIES_ENV)
PRIORITY = re.compile(r"<([0-9]{1,3})>")
# a line without a prefix: written by the daemon outside its log (a refusal, a traceback);
# logger(1) gives it this priority only at the start or after a bad prefix, else the
# priority of the line before (util-linux); the relay below, this one always
UNPREFIXED = "daemon.err"
# when logger(1) is missing: the same, by Python's syslog module (a valid prefix, PRI up
# to 191, is taken off the line and gives its priority; facility daemon unless it names one)
RELAY = (
    "import re, sys, syslog\n"
    "syslog.openlog(sys.argv[1], 0, syslog.LOG_DAEMON)\n"
    "for line in sys.stdin.buffer:\n"
    "    text = line.decode(errors='replace').rstrip()\n"
    "    m = re.match(r'<([0-9]{1,3})>', text)\n"
    "    if m and int(m[1]) <= 191:\n"
    "        syslog.syslog(int(m[1]), text[m.end():])\n"
    "    elif text:\n"
    "        syslog.syslog(syslog.LOG_ERR, text)\n"
)


class Refused(Exception):
    """A bad command line or option: one line, exit 1, nothing started."""


@dataclass
class Request:
    store: str
    mnt: str
    args: list[str] = field(default_factory=list)  # alkfsd's, after STORE MNT
    timeout_s: float = MOUNT_TIMEOUT_S
    fake: bool = False
    verbose: bool = False


def split_options(text: str) -> list[str]:
    """`a,b=1,c="x,y"` -> ['a', 'b=1', 'c=x,y'] (libmount's quoting)."""
    out: list[str] = []
    cur: list[str] = []
    quoted = False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        elif ch == "," and not quoted:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return [o for o in out if o]


def daemon_flags(options: list[str], sloppy: bool) -> tuple[list[str], float]:
    """alkfsd's flags for mount's -o options, and the mount timeout."""
    args: list[str] = []
    timeout = MOUNT_TIMEOUT_S
    for opt in options:
        raw_key, has_value, value = opt.partition("=")
        key = raw_key.strip().replace("-", "_")
        key = ALIASES.get(key, key)
        if key == "mount_timeout":
            try:
                timeout = float(value)
            except ValueError:
                timeout = -1.0
            if not has_value or not 0 < timeout < 86400:
                raise Refused(f"mount_timeout takes a number of seconds, not {opt!r}")
        elif key in FLAGS:
            if has_value:
                raise Refused(f"option {raw_key!r} takes no value (given {opt!r})")
            args.append("--" + key.replace("_", "-"))
        elif key in VALUED and has_value:
            if not value:
                raise Refused(f"option {raw_key!r} needs a value ({raw_key}=...)")
            if key == "config":
                value = os.path.abspath(value)  # (the daemon runs in /)
            args += ["--" + key.replace("_", "-"), value]
        elif (key in GENERIC and not has_value) or key.startswith("x_") or key == "comment":
            continue
        elif key in VALUED:
            raise Refused(f"option {raw_key!r} needs a value ({raw_key}=...)")
        elif sloppy:
            print(f"{PROG}: ignoring the unknown option {opt!r} (-s)", file=sys.stderr)
        else:
            known = ", ".join([*FLAGS, "ro", *(f"{k}=..." for k in VALUED), "mount_timeout=S"])
            raise Refused(f"unknown option {opt!r} (alkfsd's are: {known})")
    return args, timeout


def parse(argv: list[str]) -> Request:
    try:
        opts, rest = getopt.gnu_getopt(argv, "sfnvhN:o:t:", ["help"])
    except getopt.GetoptError as exc:
        raise Refused(f"{exc} ({USAGE})") from None
    options: list[str] = []
    seen = {o for o, _ in opts}
    if seen & {"-h", "--help"}:
        print(USAGE)
        print(__doc__.split("\n\n", 1)[1].split("\n\nStandard library")[0])
        raise SystemExit(0)
    for o, v in opts:
        if o == "-o":
            options += split_options(v)
        elif o == "-t" and v not in (FSTYPE, "alkfs"):
            raise Refused(f"-t {v}: this helper mounts {FSTYPE} only")
        elif o == "-N":
            raise Refused("-N (mounting in another namespace) is not supported")
    if len(rest) != 2:
        raise Refused(f"STORE and MOUNTPOINT are required ({USAGE})")
    store, mnt = rest
    # `alkfs:/srv/alk`, as the mount's source shows in the mount table: an fstab line
    # written so is found mounted by `mount -a`, which then leaves it alone
    store = store.removeprefix("alkfs:")
    args, timeout = daemon_flags(options, sloppy="-s" in seen)
    return Request(
        store=os.path.abspath(store),
        mnt=os.path.realpath(mnt),
        args=args,
        timeout_s=timeout,
        fake="-f" in seen,
        verbose="-v" in seen,
    )


def alkfs_mounts(mnt: str) -> set[str]:
    """The ids of the fuse.alkfs mounts at `mnt` (/proc/self/mountinfo)."""
    found: set[str] = set()
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                parts, tail = left.split(), right.split()
                if len(parts) >= 5 and tail and tail[0] == FSTYPE and unescape(parts[4]) == mnt:
                    found.add(parts[0])
    except OSError:
        pass
    return found


class Answers:
    """statvfs of the mountpoint in a thread of its own: it waits for the daemon's
    answer, while the main thread keeps reading what the daemon writes (a full pipe
    would otherwise stop both)."""

    def __init__(self, mnt: str) -> None:
        self.ok = False
        self.thread = threading.Thread(target=self._probe, args=(mnt,), daemon=True)
        self.thread.start()

    def _probe(self, mnt: str) -> None:
        try:
            os.statvfs(mnt)
            self.ok = True
        except OSError:
            pass

    def done(self) -> bool:
        return not self.thread.is_alive()


class Interrupted(Exception):
    pass


def _interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signal.Signals(signum).name)


def read_some(fd: int, into: bytearray, wait_s: float) -> bool:
    """Read what the daemon wrote (waiting up to wait_s); False at end of file."""
    ready, _, _ = select.select([fd], [], [], wait_s)
    if not ready:
        return True
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return True
    if len(into) < KEEP_BYTES:
        into += chunk[: KEEP_BYTES - len(into)]
    return bool(chunk)


def wait_mounted(
    proc: subprocess.Popen[bytes], fd: int, mnt: str, before: set[str], timeout_s: float
) -> tuple[str, bytearray]:
    """'mounted', 'exited' or 'timeout', and what the daemon wrote meanwhile."""
    out = bytearray()
    deadline = time.monotonic() + timeout_s
    probe: Answers | None = None
    open_ = True
    while True:
        if open_:
            open_ = read_some(fd, out, 0.05)
        else:
            time.sleep(0.05)
        if proc.poll() is not None:
            return "exited", out
        if probe is None and alkfs_mounts(mnt) - before:
            probe = Answers(mnt)
        if probe is not None and probe.done():
            if probe.ok:
                return "mounted", out
            probe = None  # (not yet: asked again)
        if time.monotonic() > deadline:
            return "timeout", out


def drain(fd: int, into: bytearray, within_s: float = 1.0) -> None:
    """What the daemon wrote before it ended (a process it left may keep the pipe open)."""
    os.set_blocking(fd, False)
    end = time.monotonic() + within_s
    while time.monotonic() < end and read_some(fd, into, 0.05):
        pass


def unprefixed(line: str) -> str:
    """A line of the daemon without its priority prefix."""
    m = PRIORITY.match(line)
    return line[m.end() :] if m else line


def one_line(out: bytes | bytearray, status: int | None) -> str:
    """The daemon's error: its own refusal line (`alkfsd: ...`), else its last error."""
    lines = [unprefixed(s).strip() for s in out.decode(errors="replace").splitlines()]
    lines = [s for s in lines if s]
    for pick in (
        lambda s: s.startswith("alkfsd: "),
        lambda s: s.startswith(("ERROR ", "CRITICAL ")) or " ERROR " in s or " CRITICAL " in s,
        lambda s: True,
    ):
        picked = [s for s in lines if pick(s)]
        if picked:
            line = picked[-1]
            return line if line.startswith("alkfsd") else f"alkfsd: {line}"
    return f"alkfsd: exited with status {status} before the mount answered"


def logger_cmd(pid: int) -> list[str]:
    """What sends the daemon's lines to syslog (journald takes /dev/log where it runs),
    each at the priority its prefix gives."""
    logger = shutil.which("logger")
    if logger:
        return [
            logger,
            "-t",
            "alkfsd",
            f"--id={pid}",
            "-p",
            UNPREFIXED,
            "--prio-prefix",
            "--socket-errors=off",
        ]
    return [sys.executable, "-I", "-S", "-c", RELAY, f"alkfsd[{pid}]"]


def prefixed(lines: bytes) -> bytes:
    """The daemon's lines read before the mount answered, each with a priority prefix
    (`<3>`, error, where it has none: logger(1) would give such a line the priority of the
    line before it)."""
    out = bytearray()
    for line in lines.splitlines():
        m = PRIORITY.match(line.decode(errors="replace"))
        if line.strip():
            out += (line if m and int(m[1]) <= 191 else b"<3>" + line) + b"\n"
    return bytes(out)


def to_syslog(lines: bytes, pid: int) -> None:
    if not lines:
        return
    try:
        subprocess.run(
            logger_cmd(pid),
            input=prefixed(lines),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        pass


def stop(proc: subprocess.Popen[bytes], mnt: str, before: set[str]) -> None:
    """End a daemon that did not mount in time (SIGTERM: it unmounts; then SIGKILL), and
    clear a dead mount it left."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if alkfs_mounts(mnt) - before:
        subprocess.run(["fusermount3", "-uz", mnt], capture_output=True, check=False)


def find_alkfsd() -> str:
    """The alkfsd beside this Python (the install's venv), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "alkfsd")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("alkfsd")
    if not found:
        raise Refused("alkfsd not found (make install puts it in /usr/local/bin)")
    return found


def mount(req: Request) -> int:
    try:
        alkfsd = find_alkfsd()
    except Refused:
        if not req.fake:
            raise
        alkfsd = "alkfsd"  # (-f: what would run)
    cmd = [alkfsd, req.store, req.mnt, *req.args]
    if req.verbose:
        print(f"{PROG}: running {' '.join(hide_password(cmd))}", file=sys.stderr)
    if req.fake:
        return 0
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)  # (the daemon is no service's main process here)
    for key in [k for k in env if k.startswith("PYTHON")]:
        del env[key]  # (PYTHONPATH: the installed daemon runs the installed code)
    env.setdefault("PATH", DEFAULT_PATH)
    env[PRIORITIES_ENV] = "1"  # (its lines: logger_cmd)
    before = alkfs_mounts(req.mnt)
    rfd, wfd = os.pipe()
    old = {s: signal.signal(s, _interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    proc: subprocess.Popen[bytes] | None = None
    try:
        with open(os.devnull, "rb") as null:
            proc = subprocess.Popen(
                cmd, stdin=null, stdout=wfd, stderr=wfd, cwd="/", env=env, start_new_session=True
            )
        os.close(wfd)
        wfd = -1
        outcome, out = wait_mounted(proc, rfd, req.mnt, before, req.timeout_s)
    except Interrupted as exc:
        outcome, out = f"interrupted ({exc})", bytearray()
    finally:
        if wfd >= 0:
            os.close(wfd)
        for s, handler in old.items():
            signal.signal(s, handler)
    if proc is None:
        os.close(rfd)
        print(f"{PROG}: {outcome}", file=sys.stderr)
        return 1
    if outcome == "mounted":
        to_syslog(bytes(out), proc.pid)
        # the rest of the daemon's lines: read by a logger of its own session, which ends
        # when the daemon does
        with open(os.devnull, "wb") as null:
            subprocess.Popen(
                logger_cmd(proc.pid),
                stdin=rfd,
                stdout=null,
                stderr=null,
                cwd="/",
                start_new_session=True,
            )
        os.close(rfd)
        if req.verbose:
            print(f"{PROG}: {req.store} mounted at {req.mnt} by alkfsd (pid {proc.pid})")
        proc.returncode = 0  # (detached: not waited for, and not warned about)
        return 0
    if outcome != "exited":
        stop(proc, req.mnt, before)
    drain(rfd, out)
    os.close(rfd)
    to_syslog(bytes(out), proc.pid)
    if outcome == "exited":
        print(one_line(out, proc.returncode), file=sys.stderr)
    elif outcome == "timeout":
        print(
            f"{PROG}: alkfsd did not mount {req.store} at {req.mnt} within "
            f"{req.timeout_s:g} s (mount_timeout=SECONDS); stopped it (its lines: syslog)",
            file=sys.stderr,
        )
    else:
        print(f"{PROG}: {outcome}: stopped alkfsd", file=sys.stderr)
    return 1


def hide_password(cmd: list[str]) -> list[str]:
    """A database URI's password left out of what -v prints."""
    out = []
    for arg in cmd:
        arg = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", arg)
        out.append(re.sub(r"(password=)[^ &]*", r"\1***", arg))
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        req = parse(sys.argv[1:] if argv is None else argv)
        return mount(req)
    except Refused as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.errno == errno.ENOENT and exc.filename:
            print(f"{PROG}: {exc.filename}: not found", file=sys.stderr)
        else:
            print(f"{PROG}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
