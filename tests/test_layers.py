"""The layers import one way: every import in alkfs/ and daemon/ (module level and inside
functions; `if TYPE_CHECKING:` blocks excepted) goes to a layer at or below its own.

    alkfs  0 errors, durations    1 keys, schema, machine      2 db, privacy, reserve
           3 tiers, catalog, git.objects, git.borrower  4 gc, binding, fleet
           5 store    6 git.tables, git.refs, git.closure, git.packs, pins, roots
           7 git.importer, app    8 cli, migrate
    and the library never imports alkfsd, trio or pyfuse3.

The daemon's modules rank by layer (daemon/__init__.py states the rule), each listed by
its own name (a daemon module missing here fails):

    framework    10 errors, inodes, invalidate, deathguard, requests_stats    11 nodes.handles, nodes.base
                 12 nodes.listing, nodes.policy, nodes.root, listings, workers,
                    access    13 fs
    write state  20 staging.spool, staging.writes, packs    21 staging.writer, staging.scratch
                 22 staging.staged, staging.overlay, staging.ingest    25 context
    views        30 status, nodes.pinning, nodes.largefile    31 nodes.objfile, nodes.control,
                    nodes.pintree
                 32 nodes.objects, nodes.loose, nodes.pins, nodes.roots    33 nodes.gitview, nodes.refwrites
                 34 nodes.refdir, nodes.repoobjects    35 nodes.repos
    main         40 config, main

A daemon module also never imports a daemon module inside a function: that is how an
import cycle hides from module-level checks (a name needed for types only goes under
`if TYPE_CHECKING:`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RANKS = {
    "alkfs.errors": 0,
    "alkfs.durations": 0,
    "alkfs": 0,  # (the package: __version__)
    "alkfs.keys": 1,
    "alkfs.keyset": 1,
    "alkfs.schema": 1,
    "alkfs.machine": 1,
    "alkfs.db": 2,
    "alkfs.privacy": 2,
    "alkfs.reserve": 2,
    "alkfs.tiers": 3,
    "alkfs.catalog": 3,
    "alkfs.git.objects": 3,
    "alkfs.git.borrower": 3,
    "alkfs.git.packread": 3,
    "alkfs.git.packdelta": 3,
    "alkfs.git.lfs_pointer": 2,
    "alkfs.git.lfs": 6,
    "alkfs.gc": 4,
    "alkfs.gc.needs": 4,  # (what gc and fleet need of a store: below it)
    "alkfs.binding": 4,
    "alkfs.fleet": 4,
    "alkfs.store": 5,
    "alkfs.store.state": 5,
    "alkfs.store.core": 5,
    "alkfs.store.puts": 5,
    "alkfs.store.batches": 5,
    "alkfs.store.listing": 5,
    "alkfs.store.reads": 5,
    "alkfs.store.deletes": 5,
    "alkfs.git.tables": 6,
    "alkfs.git.refs": 6,
    "alkfs.git.closure": 6,
    "alkfs.git.revmark": 6,
    "alkfs.git.packed": 6,
    "alkfs.git.packs": 6,
    "alkfs.git.packs.sets": 6,
    "alkfs.git.packs.order": 6,
    "alkfs.git.packs.kvread": 6,
    "alkfs.git.packs.gitrun": 6,
    "alkfs.git.packs.intake": 6,
    "alkfs.git.packs.builder": 6,
    "alkfs.git.packs.guard": 6,
    "alkfs.git.packs.drain": 6,
    "alkfs.git.packs.adopt": 6,
    "alkfs.git.packs.drop": 6,
    "alkfs.git.packs.verify": 6,
    "alkfs.git": 6,
    "alkfs.pins": 6,
    "alkfs.pins.paths": 6,
    "alkfs.pins.records": 6,
    "alkfs.pins.misses": 6,
    "alkfs.pins.tree": 6,
    "alkfs.pins.durable": 6,
    "alkfs.roots": 6,
    "alkfs.intents": 7,
    "alkfs.git.importer": 7,
    "alkfs.git.importing": 7,
    "alkfs.git.import_pack": 7,
    "alkfs.git.connected": 6,
    "alkfs.app": 7,
    "alkfs.cli": 8,
    "alkfs.migrate": 8,
}
DAEMON_RANKS = {
    # framework
    "alkfsd": 10,  # (the package: the rule)
    "alkfsd.errors": 10,
    "alkfsd.inodes": 10,
    "alkfsd.invalidate": 10,
    "alkfsd.deathguard": 10,
    "alkfsd.nodes.handles": 11,
    "alkfsd.nodes.base": 11,
    "alkfsd.nodes.listing": 12,
    "alkfsd.nodes.policy": 12,
    "alkfsd.nodes.root": 12,
    "alkfsd.listings": 12,
    "alkfsd.workers": 12,
    "alkfsd.access": 12,
    "alkfsd.requests": 12,
    "alkfsd.requests_stats": 10,
    "alkfsd.fs": 13,
    # write state
    "alkfsd.staging": 20,  # (the package)
    "alkfsd.staging.spool": 20,
    "alkfsd.staging.writes": 20,
    "alkfsd.packs": 20,
    "alkfsd.staging.pending": 20,
    "alkfsd.staging.writer": 21,
    "alkfsd.staging.staged": 22,
    "alkfsd.staging.scratch": 21,
    "alkfsd.staging.overlay": 22,
    "alkfsd.staging.ingest": 22,
    "alkfsd.context": 25,
    # views
    "alkfsd.status": 30,
    "alkfsd.nodes.pinning": 30,
    "alkfsd.nodes.largefile": 30,
    "alkfsd.nodes.objfile": 31,
    "alkfsd.nodes.control": 31,
    "alkfsd.nodes.objects": 32,
    "alkfsd.nodes.loose": 32,
    "alkfsd.nodes.lfs": 32,
    "alkfsd.nodes.pintree": 31,
    "alkfsd.nodes.pins": 32,
    "alkfsd.nodes.roots": 32,
    "alkfsd.nodes.gitview": 33,
    "alkfsd.nodes.refwrites": 33,
    "alkfsd.nodes.refdir": 34,
    "alkfsd.nodes.repoobjects": 34,
    "alkfsd.nodes.repos": 35,
    # the command line and the mount's assembly
    "alkfsd.config": 40,
    "alkfsd.main": 40,
}
DAEMON_ONLY = ("trio", "pyfuse3", "alkfsd")


def rank(module: str) -> int | None:
    """The rank of a module: its own entry, else its nearest package's (a daemon module:
    its own entry only)."""
    if module.split(".")[0] == "alkfsd":
        return DAEMON_RANKS.get(module)
    parts = module.split(".")
    while parts:
        found = RANKS.get(".".join(parts))
        if found is not None:
            return found
        parts.pop()
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "daemon":
        parts[0] = "alkfsd"
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of the imports inside `if TYPE_CHECKING:` blocks."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    out.add(inner.lineno)
    return out


def _function_lines(tree: ast.Module) -> set[int]:
    """Line numbers of the imports inside a function (or a method)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    out.add(inner.lineno)
    return out


def imports(path: Path, name: str) -> list[tuple[int, str, bool]]:
    """(line, absolute module, inside a function) of every runtime import in the file of
    module `name`. `from X import y` counts as an import of X.y when that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    inside = _function_lines(tree)
    out: list[tuple[int, str, bool]] = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, node.lineno in inside) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}".strip(".")
                if node.module is None or _is_module(sub):
                    out.append((node.lineno, sub, node.lineno in inside))
                else:
                    out.append((node.lineno, target, node.lineno in inside))
    return sorted(set(out))


def _is_module(module: str) -> bool:
    """Whether `module` names a file or package of alkfs/ or daemon/."""
    parts = module.split(".")
    if parts[0] == "alkfsd":
        parts[0] = "daemon"
    elif parts[0] != "alkfs":
        return False
    rel = ROOT.joinpath(*parts)
    return rel.with_suffix(".py").is_file() or (rel / "__init__.py").is_file()


def violations(path: Path, me: str | None = None) -> list[str]:
    me = me or module_name(path)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    mine = rank(me)
    assert mine is not None, f"{me} has no layer: add it to RANKS"
    bad = []
    for line, target, in_function in imports(path, me):
        if me.split(".")[0] == "alkfs" and target.split(".")[0] in DAEMON_ONLY:
            bad.append(f"{where}:{line} imports {target} (the library is FUSE-free)")
            continue
        if me.split(".")[0] == "alkfsd" and target.split(".")[0] == "alkfsd" and in_function:
            bad.append(f"{where}:{line}: {me} imports {target} inside a function")
            continue
        theirs = rank(target)
        if theirs is not None and theirs > mine:
            bad.append(f"{where}:{line}: {me} ({mine}) imports {target} ({theirs})")
    return bad


SOURCES = sorted([*(ROOT / "alkfs").rglob("*.py"), *(ROOT / "daemon").rglob("*.py")])


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_import_goes_to_a_layer_at_or_below_its_own(path: Path) -> None:
    assert violations(path) == []


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    """The check itself: a store module importing the app, or the library importing trio,
    inside a function, is reported with its line."""
    fake = ROOT / "alkfs" / "tiers" / "_layer_probe.py"
    fake.write_text(
        "def f():\n    from ..app import Alkfs\n    import trio\n    return Alkfs, trio\n"
    )
    try:
        found = violations(fake)
    finally:
        fake.unlink()
    assert found == [
        "alkfs/tiers/_layer_probe.py:2: alkfs.tiers._layer_probe (3) imports alkfs.app (7)",
        "alkfs/tiers/_layer_probe.py:3 imports trio (the library is FUSE-free)",
    ]


def test_every_daemon_module_has_a_layer() -> None:
    """A new daemon module is placed in a layer (DAEMON_RANKS) when it is made."""
    names = {module_name(p) for p in ROOT.joinpath("daemon").rglob("*.py")}
    assert sorted(n for n in names if n not in DAEMON_RANKS) == []


def test_an_upward_daemon_import_is_found() -> None:
    """The check on the daemon: a framework module importing a view, or the write state
    importing the context, at module level, and a view importing another inside a
    function (a cycle dodged), are each reported with its line."""
    fake = ROOT / "daemon" / "staging" / "_layer_probe.py"
    fake.write_text(
        "from ..nodes.repos import ReposDir\n"
        "from .. import context\n"
        "from . import writes\n"
        "\n\n"
        "def f():\n"
        "    from ..nodes import base\n"
        "    return ReposDir, context, writes, base\n"
    )
    DAEMON_RANKS["alkfsd.staging._layer_probe"] = 21
    try:
        found = violations(fake)
    finally:
        fake.unlink()
        del DAEMON_RANKS["alkfsd.staging._layer_probe"]
    assert found == [
        "daemon/staging/_layer_probe.py:1: alkfsd.staging._layer_probe (21) imports "
        "alkfsd.nodes.repos (35)",
        "daemon/staging/_layer_probe.py:2: alkfsd.staging._layer_probe (21) imports "
        "alkfsd.context (25)",
        "daemon/staging/_layer_probe.py:7: alkfsd.staging._layer_probe imports "
        "alkfsd.nodes.base inside a function",
    ]
