"""Background work logs a failure of ours (the database away, the disk full) as one short
line, and anything unexpected with its traceback (`alkfs.errors.log_failure`)."""

from __future__ import annotations

import logging

import pytest

from alkfs.errors import StoreIO, log_failure


def _fail(exc: BaseException, caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    log = logging.getLogger("alkfs-test-log-failure")
    with caplog.at_level(logging.INFO, logger=log.name):
        try:
            raise exc
        except Exception:
            log_failure(log, "derived %s: the intake build failed", "sha1")
    (record,) = [r for r in caplog.records if r.name == log.name]
    return record


def test_an_error_of_ours_is_one_line_without_a_traceback(caplog):
    record = _fail(StoreIO("postgresql: the server's connection limit " + "x" * 1000), caplog)
    assert record.levelno == logging.ERROR
    assert record.exc_info is None
    text = record.getMessage()
    assert text.startswith("derived sha1: the intake build failed: postgresql: the server's")
    assert len(text) == len("derived sha1: the intake build failed: ") + 300


def test_anything_else_keeps_its_traceback(caplog):
    record = _fail(ValueError("a bug"), caplog)
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None and record.exc_info[0] is ValueError
    assert record.getMessage() == "derived sha1: the intake build failed"
