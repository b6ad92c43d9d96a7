"""The layers import one way: every import in alkfs/ and daemon/ (module level and inside
functions; `if TYPE_CHECKING:` blocks excepted) goes to a layer at or below its own.

    alkfs  0 errors, durations    1 keys, schema      2 db, privacy, reserve
           3 tiers, catalog, git.objects               4 gc, binding, fleet
           5 store    6 git.tables, git.refs, git.closure, git.packs, pins
           7 git.importer, app    8 cli, migrate
    alkfsd 9 (the daemon) — and the library never imports alkfsd, trio or pyfuse3.
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
    "alkfs.schema": 1,
    "alkfs.db": 2,
    "alkfs.privacy": 2,
    "alkfs.reserve": 2,
    "alkfs.tiers": 3,
    "alkfs.catalog": 3,
    "alkfs.git.objects": 3,
    "alkfs.gc": 4,
    "alkfs.binding": 4,
    "alkfs.fleet": 4,
    "alkfs.store": 5,
    "alkfs.git.tables": 6,
    "alkfs.git.refs": 6,
    "alkfs.git.closure": 6,
    "alkfs.git.packs": 6,
    "alkfs.git": 6,
    "alkfs.pins": 6,
    "alkfs.git.importer": 7,
    "alkfs.app": 7,
    "alkfs.cli": 8,
    "alkfs.migrate": 8,
    "alkfsd": 9,
}
DAEMON_ONLY = ("trio", "pyfuse3", "alkfsd")


def rank(module: str) -> int | None:
    """The rank of a module: its own entry, else its nearest package's."""
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


def imports(path: Path, name: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every runtime import in the file of module `name`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None or node.level and not node.module:
                # `from . import x`: each name may be a module
                out += [(node.lineno, f"{target}.{a.name}".strip(".")) for a in node.names]
            else:
                out.append((node.lineno, target))
    return out


def violations(path: Path, me: str | None = None) -> list[str]:
    me = me or module_name(path)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    mine = rank(me)
    assert mine is not None, f"{me} has no layer: add it to RANKS"
    bad = []
    for line, target in imports(path, me):
        if me.split(".")[0] == "alkfs" and target.split(".")[0] in DAEMON_ONLY:
            bad.append(f"{where}:{line} imports {target} (the library is FUSE-free)")
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
