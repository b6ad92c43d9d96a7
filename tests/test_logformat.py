"""The daemon's log format (docs/operations.md, "Logs"): `TIME alkfsd[PID] LEVEL message`
on a plain stderr; `<PRIORITY>LEVEL message` (no time of our own) when stderr is the
journal, i.e. JOURNAL_STREAM names stderr's DEV:INO, or when its reader asks for that
form with ALKFS_LOG_PRIORITIES=1 (the mount helper, whose `logger --prio-prefix` reads
it). One physical line per event either way, bounded.

The handler is built by the daemon's own `log_handler` on a file whose DEV:INO stands in
for journald's stream; then a real alkfsd is started with JOURNAL_STREAM matching its
stderr file, or with ALKFS_LOG_PRIORITIES=1 (ended by PID, its mount cleared, in
teardown).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from alkfsd.errors import LOG_LINE_MAX
from alkfsd.main import LOG_PRIORITIES_ENV, log_handler, mounted_at

TIMESTAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} alkfsd\[\d+\] [A-Z]+ ")
A_TIME = re.compile(r"\d\d:\d\d:\d\d")
PRIORITY = re.compile(r"^<[0-7]>")
DAEMON = [sys.executable, "-X", "dev", "-bb", "-m", "alkfsd.main"]
DAEMON_ARGS = ["--create", "--window", "0", "--sweep-every", "0", "--log-level", "debug"]


def dev_ino(path: Path) -> str:
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}"


def emit(tmp_path: Path, environ: dict[str, str], *, use_env_of: Path | None = None) -> list[str]:
    """Log a fixed set of records through log_handler(FILE, environ) and return FILE's
    lines; JOURNAL_STREAM is set to the DEV:INO of `use_env_of` when given."""
    out = tmp_path / "stderr"
    with open(out, "w") as stream:
        env = dict(environ)
        if use_env_of is not None:
            env["JOURNAL_STREAM"] = dev_ino(use_env_of)
        handler = log_handler(stream, env)
        logger = logging.getLogger("alkfsd.test_logformat")
        logger.propagate = False
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)
        try:
            logger.debug("probe %s", "/objects/x")
            logger.info("ready: %s serves %s", "/mnt/alk", "/srv/alk")
            logger.warning("setattr %s: errno=%s", "/pins/a", "EPERM")
            logger.error("metrics: cannot listen on %s", "127.0.0.1:1")
            logger.critical("critical")
            logger.info("two\nlines\r\nin one")
            logger.info("x" * (3 * LOG_LINE_MAX))
            try:
                raise ValueError("boom")
            except ValueError:
                logger.exception("unexpected")
        finally:
            logger.removeHandler(handler)
    return out.read_text().splitlines()


def test_journal_stream_matching_stderr_gives_priorities_and_no_timestamp(tmp_path: Path):
    lines = emit(tmp_path, {}, use_env_of=tmp_path / "stderr")
    assert lines[:7] == [
        "<7>DEBUG probe /objects/x",
        "<6>INFO ready: /mnt/alk serves /srv/alk",
        "<4>WARNING setattr /pins/a: errno=EPERM",
        "<3>ERROR metrics: cannot listen on 127.0.0.1:1",
        "<2>CRITICAL critical",
        "<6>INFO two\\nlines\\r\\nin one",  # one physical line per event
        f"<6>INFO {'x' * (LOG_LINE_MAX - 5)}...[{2 * LOG_LINE_MAX + 5} more chars]",
    ]
    # a traceback: every physical line keeps the record's priority
    assert lines[7] == "<3>ERROR unexpected"
    assert lines[8] == "<3>Traceback (most recent call last):"
    assert lines[-1] == "<3>ValueError: boom"
    assert all(line.startswith("<3>") for line in lines[7:])
    assert not any(A_TIME.search(line) for line in lines)


@pytest.mark.parametrize("value", ["1", "yes", "on", "true", " 1 "])
def test_priorities_asked_for_give_the_journals_form_on_any_stream(tmp_path: Path, value: str):
    """ALKFS_LOG_PRIORITIES=1 (the mount helper's): the journal's lines on a stream that is
    not the journal (a file here, the helper's pipe to logger there), JOURNAL_STREAM of
    another file or none."""
    assert LOG_PRIORITIES_ENV == "ALKFS_LOG_PRIORITIES"
    other = tmp_path / "journal"
    other.write_text("")
    for journal in (None, other):
        lines = emit(tmp_path, {LOG_PRIORITIES_ENV: value}, use_env_of=journal)
        assert lines[:5] == [
            "<7>DEBUG probe /objects/x",
            "<6>INFO ready: /mnt/alk serves /srv/alk",
            "<4>WARNING setattr /pins/a: errno=EPERM",
            "<3>ERROR metrics: cannot listen on 127.0.0.1:1",
            "<2>CRITICAL critical",
        ]
        assert lines[-1] == "<3>ValueError: boom"
        assert all(PRIORITY.match(line) for line in lines)
        assert not any(A_TIME.search(line) for line in lines)


@pytest.mark.parametrize("value", ["", "0", "no", "off", "false"])
def test_priorities_not_asked_for_keep_the_timestamped_format(tmp_path: Path, value: str):
    lines = emit(tmp_path, {LOG_PRIORITIES_ENV: value})
    assert TIMESTAMPED.match(lines[0]) and lines[0].endswith(" DEBUG probe /objects/x")
    assert not any(PRIORITY.match(line) for line in lines)
    # (and the journal's own stream is the journal whatever the variable says)
    lines = emit(tmp_path, {LOG_PRIORITIES_ENV: value}, use_env_of=tmp_path / "stderr")
    assert lines[0] == "<7>DEBUG probe /objects/x"


def test_plain_stderr_keeps_the_timestamped_format(tmp_path: Path):
    lines = emit(tmp_path, {})
    assert TIMESTAMPED.match(lines[0]) and lines[0].endswith(" DEBUG probe /objects/x")
    assert TIMESTAMPED.match(lines[1])
    assert lines[1].endswith(f" alkfsd[{os.getpid()}] INFO ready: /mnt/alk serves /srv/alk")
    assert lines[5].endswith(" INFO two\\nlines\\r\\nin one")
    assert len(lines[6]) <= LOG_LINE_MAX + 30 and lines[6].endswith(" more chars]")
    assert all(TIMESTAMPED.match(line) for line in lines[:8])
    assert lines[-1] == "ValueError: boom"
    assert not any(PRIORITY.match(line) for line in lines)


@pytest.mark.parametrize("value", ["", "garbage", "12:", ":34", "1:2:3", "-1:5"])
def test_a_malformed_journal_stream_is_not_the_journal(tmp_path: Path, value: str):
    lines = emit(tmp_path, {"JOURNAL_STREAM": value})
    assert TIMESTAMPED.match(lines[0]), lines[0]


def test_a_journal_stream_of_another_file_is_not_ours(tmp_path: Path):
    """A child whose stderr is a pipe or a file inherits JOURNAL_STREAM, not the stream."""
    other = tmp_path / "journal"
    other.write_text("")
    lines = emit(tmp_path, {}, use_env_of=other)
    assert TIMESTAMPED.match(lines[0]), lines[0]
    assert not any(PRIORITY.match(line) for line in lines)


def test_a_stream_without_a_descriptor_is_not_the_journal():
    class NoFileno:
        def write(self, text: str) -> int:
            return len(text)

        def flush(self) -> None:
            pass

        def fileno(self) -> int:
            raise OSError("no descriptor")

    handler = log_handler(NoFileno(), {"JOURNAL_STREAM": "1:2"})  # type: ignore[arg-type]
    record = logging.LogRecord("alkfsd", logging.INFO, __file__, 1, "hello", None, None)
    assert TIMESTAMPED.match(handler.format(record))


# -- a real daemon -----------------------------------------------------------------------


def _unmount(mnt: Path) -> None:
    for _ in range(50):
        if mounted_at(str(mnt)) is None:
            return
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True, check=False)
        time.sleep(0.1)


@pytest.fixture(params=["JOURNAL_STREAM", LOG_PRIORITIES_ENV])
def daemon_in_journal(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[subprocess.Popen, Path, Path]]:
    """alkfsd on a fresh store, its stderr a file named by JOURNAL_STREAM, or with
    ALKFS_LOG_PRIORITIES=1 (and no JOURNAL_STREAM)."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("a real mount needs root and /dev/fuse")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "alkfsd.log"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ALKFS_DATABASE", "NOTIFY_SOCKET", "JOURNAL_STREAM", LOG_PRIORITIES_ENV)
    }
    with open(log, "wb") as err:
        if request.param == "JOURNAL_STREAM":
            env["JOURNAL_STREAM"] = dev_ino(log)
        else:
            env[LOG_PRIORITIES_ENV] = "1"
        proc = subprocess.Popen(
            [*DAEMON, str(tmp_path / "store"), str(mnt), *DAEMON_ARGS],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
        )
    try:
        deadline = time.monotonic() + 20
        while "ready: " not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.05)
        yield proc, mnt, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        _unmount(mnt)


@pytest.mark.mount
def test_a_daemon_whose_stderr_is_the_journal_or_asked_logs_priorities(daemon_in_journal):
    proc, mnt, log = daemon_in_journal
    assert not (mnt / "objects" / "no-such-name").exists()  # a quiet refusal: debug
    with pytest.raises(OSError):
        (mnt / "no-such-dir" / "x").write_bytes(b"")  # (ENOENT too)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    lines = log.read_text(errors="replace").splitlines()
    assert lines, "the daemon logged nothing"
    assert all(PRIORITY.match(line) for line in lines), lines
    assert not any(A_TIME.search(line) or "alkfsd[" in line for line in lines), lines
    ready = [line for line in lines if line.startswith("<6>INFO ready: ")]
    assert ready == [f"<6>INFO ready: {mnt} serves {mnt.parent / 'store'}"], lines
    assert any(line.startswith("<7>DEBUG lookup ") for line in lines), lines
    assert lines[-1] == f"<6>INFO unmounted {mnt}", lines
