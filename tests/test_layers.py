"""The layers import one way: every import in alkfs/ and daemon/ (module level and inside
functions; `if TYPE_CHECKING:` blocks excepted) goes to a layer at or below its own. The
layers, and the rule's details, are declared once, in layers.toml at the repository root.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS = ROOT / "layers.toml"


def _ranks(table: dict[str, list[str]]) -> dict[str, int]:
    """module -> rank, from a table of `rank = [modules]` lines (a module listed twice is an
    error in the declaration)."""
    out: dict[str, int] = {}
    for rank_, modules in table.items():
        for module in modules:
            assert module not in out, f"layers.toml lists {module} twice"
            out[module] = int(rank_)
    return out


_DECLARED = tomllib.loads(LAYERS.read_text())
RANKS = _ranks(_DECLARED["alkfs"])
DAEMON_RANKS = _ranks(_DECLARED["alkfsd"])
DAEMON_ONLY = tuple(_DECLARED["fuse-free"])


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


def violations(path: Path, me: str | None = None, where: str | None = None) -> list[str]:
    """What is wrong with the imports of the file at `path`, module `me` (default: from its
    place under ROOT), each line naming it as `where` (default: its path under ROOT)."""
    me = me or module_name(path)
    where = where or (path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name)
    mine = rank(me)
    assert mine is not None, f"{me} has no layer: add it to layers.toml"
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
    inside a function, is reported with its line. (The probe is written under tmp_path,
    not into alkfs/: a test, ruff or mypy running meanwhile never meets it.)"""
    fake = tmp_path / "_layer_probe.py"
    fake.write_text(
        "def f():\n    from ..app import Alkfs\n    import trio\n    return Alkfs, trio\n"
    )
    found = violations(fake, "alkfs.tiers._layer_probe", "alkfs/tiers/_layer_probe.py")
    assert found == [
        "alkfs/tiers/_layer_probe.py:2: alkfs.tiers._layer_probe (3) imports alkfs.app (7)",
        "alkfs/tiers/_layer_probe.py:3 imports trio (the library is FUSE-free)",
    ]


def test_every_daemon_module_has_a_layer() -> None:
    """A new daemon module is placed in a layer (layers.toml's [alkfsd]) when it is made."""
    names = {module_name(p) for p in ROOT.joinpath("daemon").rglob("*.py")}
    assert sorted(n for n in names if n not in DAEMON_RANKS) == []


def test_an_upward_daemon_import_is_found(tmp_path: Path) -> None:
    """The check on the daemon: a framework module importing a view, or the write state
    importing the context, at module level, and a view importing another inside a
    function (a cycle dodged), are each reported with its line. (The probe is under
    tmp_path: test_every_daemon_module_has_a_layer, running meanwhile, never lists it.)"""
    fake = tmp_path / "_layer_probe.py"
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
        found = violations(fake, "alkfsd.staging._layer_probe", "daemon/staging/_layer_probe.py")
    finally:
        del DAEMON_RANKS["alkfsd.staging._layer_probe"]
    assert found == [
        "daemon/staging/_layer_probe.py:1: alkfsd.staging._layer_probe (21) imports "
        "alkfsd.nodes.repos (35)",
        "daemon/staging/_layer_probe.py:2: alkfsd.staging._layer_probe (21) imports "
        "alkfsd.context (25)",
        "daemon/staging/_layer_probe.py:7: alkfsd.staging._layer_probe imports "
        "alkfsd.nodes.base inside a function",
    ]
