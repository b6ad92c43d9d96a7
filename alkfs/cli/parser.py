"""The parser (every subcommand with its example and the key formats) and `main`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import NoReturn

from .. import __version__
from ..errors import (
    AlkfsError,
)
from ..settings import settings
from .commands import (
    Handler,
    check_usage,
    cmd_compact,
    cmd_get,
    cmd_git_import,
    cmd_migrate,
    cmd_pin,
    cmd_pins,
    cmd_put,
    cmd_repo_create,
    cmd_repo_list,
    cmd_repo_rm,
    cmd_roots,
    cmd_roots_add,
    cmd_roots_rm,
    cmd_staged,
    cmd_stat,
    cmd_status,
    cmd_sweep,
    cmd_unpin,
    cmd_verify,
    run_migrate,
)
from .mount_target import MountTarget
from .show import ALGO_LABELS, CREATING, Usage, explain, key_arg, window_arg
from .store_target import StoreTarget
from .target import Target

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

    def command(
        parent: argparse._SubParsersAction[argparse.ArgumentParser],
        name: str,
        handler: Handler,
        help: str,
    ) -> argparse.ArgumentParser:
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
    env_mount, env_store = settings().mount, settings().store
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


class Terminated(BaseException):
    """SIGTERM reached the command: it ends as an interrupted one does (a transaction in
    progress rolls back, the gits it runs are killed), with one line and exit 143."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    """The command line: `_main`, with SIGTERM ending it as Terminated (in the main
    thread; the handler before it is back once it returns)."""
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    before = signal.signal(signal.SIGTERM, _terminated)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, before)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)  # exits 2 on bad usage
    name = command_name(a)

    def usage(message: str) -> NoReturn:
        parser.error(f"{name}: {message}")

    logging.basicConfig(  # the library's log lines would break the one-line rule
        level=logging.DEBUG if settings().debug else logging.CRITICAL + 1,
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
            database = getattr(a, "database", None) or settings().database or None
            if a.command == "migrate":  # (opens the store itself, holding its lock)
                return run_migrate(path, database, a)
            target = StoreTarget(path, create=name in CREATING, database=database)
        return a.handler(target, a)
    except Usage as exc:
        usage(str(exc))
    except KeyboardInterrupt:
        return _fail(f"alkfs {name}", "interrupted", 130)
    except Terminated:
        return _fail(f"alkfs {name}", "stopped (SIGTERM)", 128 + signal.SIGTERM)
    except BrokenPipeError:
        # The reader went away (`alkfs get KEY | head`): not our failure to report.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (AlkfsError, OSError) as exc:
        return _fail(f"alkfs {name}", explain(exc), 1)
    except Exception as exc:  # a bug: still one line, the traceback on request
        if settings().debug:
            raise
        return _fail(f"alkfs {name}", explain(exc) + " (set ALKFS_DEBUG=1 for the traceback)", 1)
    finally:
        if target is not None:
            target.close()
