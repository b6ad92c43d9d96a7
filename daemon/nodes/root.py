"""The mount's root directory and the registry of its top-level entries."""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

from .base import Node, StaticDir

if TYPE_CHECKING:
    from ..context import Context

log = logging.getLogger("alkfsd")

# ---------------------------------------------------------------------------------
# TOP-LEVEL REGISTRY — one line per top-level entry: name -> "module:Class".
# The class is constructed as Cls(ctx, parent) and must be a Node (see base.py).
# Other engineers: add your line here (e.g. b"git": "alkfsd.nodes.gitview:GitDir").
# Listing order is this order.
TOP_LEVEL: dict[bytes, str] = {
    b"objects": "alkfsd.nodes.objects:ObjectsDir",
    b"git": "alkfsd.nodes.gitview:GitDir",
    b"repos": "alkfsd.nodes.repos:ReposDir",
    b"lfs": "alkfsd.nodes.lfs:LfsDir",
    b"pins": "alkfsd.nodes.pins:PinsDir",
    b"roots": "alkfsd.nodes.roots:RootsDir",
    b".alkfs": "alkfsd.nodes.control:AlkfsDir",
}
# ---------------------------------------------------------------------------------


def resolve(spec: str) -> type[Node]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


class Root(StaticDir):
    __slots__ = ()

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx, ("root",), None, b"")

    def describe(self) -> str:
        return "/"

    def children(self) -> list[tuple[bytes, Node]]:
        out = []
        for name, spec in TOP_LEVEL.items():
            cls = resolve(spec)
            out.append((name, cls(self.ctx, self)))  # type: ignore[call-arg,arg-type]
        return out

    def register_permanent(self) -> None:
        """The top-level directories keep their inode and instance for the mount's life."""
        for _, node in self._entries():
            self.ctx.inodes.remember(node, permanent=True)
