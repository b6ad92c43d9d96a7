"""The commands: one handler per subcommand, each on a `Target`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from ..errors import (
    AlkfsError,
    Invalid,
    Missing,
)
from ..keys import Algorithm
from .show import Usage, output, progress_bar, summary, sweep_summary
from .store_target import StoreTarget
from .target import Target

# -- the commands ---------------------------------------------------------------------------


def emit_json(obj: object) -> None:
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
        report: Mapping[str, object] = t.dry_run()
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
    from .. import migrate

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
