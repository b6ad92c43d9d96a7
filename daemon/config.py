"""alkfsd's command line and config file (TOML, the same keys): `settings(argv)`, and
`hide_password` (a database password given on the command line leaves it)."""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from typing import Any, TypeAlias

from alkfs import __version__
from alkfs.db.uri import check as check_uri
from alkfs.db.uri import has_password
from alkfs.durations import parse_duration, parse_window
from alkfs.errors import AlkfsError
from alkfs.settings import DATABASE_ENV
from alkfs.settings import settings as knobs

from .services import parse_owner

# The daemon's settings: the --config file's keys, overridden by the command line's. The
# file's values come as TOML gave them (not checked here; each is used as the option's
# type says), so their type is not known: this module is exempt from
# disallow_any_explicit (pyproject.toml), and this alias is the one place that says Any.
Settings: TypeAlias = dict[str, Any]

CONFIG_KEYS = {
    "store",
    "database",
    "mountpoint",
    "threshold",
    "window",
    "kv_only",
    "sweep_every",
    "push_grace",
    "read_only",
    "allow_other",
    "owner",
    "demo",
    "create",
    "log_level",
    "metrics_listen",
}

DEFAULT_SWEEP_EVERY = "1h"
LOG_LEVELS = ("debug", "info", "warning", "error")


class Usage(Exception):
    pass


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="alkfsd",
        description="Mount an alkfs store with FUSE.",
        epilog="example: alkfsd --create /srv/alkfs/main /mnt/alk --window 1h",
    )
    p.add_argument("--version", action="version", version=f"alkfsd {__version__}")
    p.add_argument("store", nargs="?", help="the store directory (see --create)")
    p.add_argument("mountpoint", nargs="?", help="where to mount it")
    p.add_argument("--threshold", type=int, help="kv/large threshold in bytes (at creation)")
    p.add_argument("--window", help="sweep delete window, e.g. 0, 15m, 1h (default 1h)")
    p.add_argument("--kv-only", action="store_true", default=None, help="sqlite only")
    p.add_argument(
        "--sweep-every",
        help=f"run a sweep periodically, e.g. 15m (default {DEFAULT_SWEEP_EVERY}; 0: never)",
    )
    p.add_argument(
        "--create",
        action="store_true",
        default=None,
        help="make the store if STORE holds none (without it a missing store is refused)",
    )
    p.add_argument(
        "--log-level", choices=LOG_LEVELS, help="the least severe lines logged (default info)"
    )
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve the Prometheus metrics over HTTP there (off by default), e.g. 127.0.0.1:9108",
    )
    p.add_argument(
        "--push-grace", help="pins of a push with no ref write go after this (max(10m, window))"
    )
    p.add_argument("--read-only", action="store_true", default=None, help="refuse every change")
    p.add_argument("--allow-other", action="store_true", default=None, help="let other users in")
    p.add_argument(
        "--owner",
        metavar="USER[:GROUP]",
        help="the tree belongs to USER, who may push, write refs and pin as root can",
    )
    p.add_argument(
        "--database",
        metavar="URI",
        help="keep the store's database in PostgreSQL (postgresql://...; default: "
        "$ALKFS_DATABASE); the large tier stays in STORE",
    )
    p.add_argument("--config", help="TOML file with the same keys")
    p.add_argument("--demo", action="store_true", default=None, help="fill a fresh store")
    return p


def settings(argv: list[str] | None) -> Settings:
    args = parser().parse_args(argv)
    out: Settings = {}
    if args.config:
        try:
            with open(args.config, "rb") as f:
                raw = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise Usage(f"cannot read the config {args.config}: {exc}") from None
        for k, v in raw.items():
            key = k.replace("-", "_")
            if key == "mount":
                key = "mountpoint"
            if key not in CONFIG_KEYS:
                raise Usage(f"unknown key {k!r} in {args.config}")
            out[key] = v
        if has_password(str(out.get("database", ""))) and _readable_by_others(args.config):
            raise Usage(
                f"{args.config} holds a database password and others may read it: "
                f"chmod 600 {args.config}"
            )
    for key in CONFIG_KEYS:
        v = getattr(args, key)
        if v is not None:
            out[key] = v
    if out.get("database") is None and knobs().database:
        out["database"] = knobs().database
    if out.get("database") is not None:
        try:
            check_uri(str(out["database"]))
        except AlkfsError as exc:
            raise Usage(str(exc)) from None
    if not out.get("store") or not out.get("mountpoint"):
        raise Usage("STORE and MOUNTPOINT are required (on the command line or in --config)")
    try:
        for key in ("window", "sweep_every", "push_grace"):
            if out.get(key) is not None:
                parse = parse_window if key == "window" else parse_duration
                out[key] = parse(str(out[key]))
    except ValueError as exc:
        raise Usage(str(exc)) from None
    out.setdefault("sweep_every", parse_duration(DEFAULT_SWEEP_EVERY))
    level = str(out.get("log_level") or "info").lower()
    if level not in LOG_LEVELS:
        raise Usage(f"log_level must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
    out["log_level"] = level
    listen = out.get("metrics_listen")
    if listen is not None:
        host, sep, port = str(listen).rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise Usage(f"--metrics-listen takes HOST:PORT, not {str(listen)[:80]!r}")
    if out.get("threshold") is not None and int(out["threshold"]) <= 0:
        raise Usage("--threshold must be positive")
    if out.get("owner") is not None:
        try:
            out["owner"] = parse_owner(str(out["owner"]))
        except ValueError as exc:
            raise Usage(str(exc)) from None
    return out


def _readable_by_others(path: str) -> bool:
    try:
        return bool(os.stat(path).st_mode & 0o077)
    except OSError:
        return False


def hide_password(argv: list[str]) -> None:
    """A password given with --database on the command line would show in `ps` (the
    process title is the command line): start again with the URI in the environment
    (/proc/PID/environ is the owner's alone) and the option left out."""
    out: list[str] = []
    uri: str | None = None
    it = iter(argv)
    for arg in it:
        if arg == "--database":
            uri = next(it, "")
        elif arg.startswith("--database="):
            uri = arg.split("=", 1)[1]
        else:
            out.append(arg)
    if uri is None or not has_password(uri):
        return
    env = {**os.environ, DATABASE_ENV: uri}
    os.execve(sys.executable, [sys.executable, "-m", "alkfsd.main", *out], env)
