"""Inode numbers and lookup counts.

An inode number is derived from the node's identity (`Node.ident`, a hashable
tuple naming what it is: `("object", raw_key)`, `("dir", "/objects/sha256")`),
so the same object gets the same number whenever the kernel asks for it again
during the mount's life, even after a `forget` dropped our record of it. A
collision with a different live identity (astronomically rare with 62 bits)
probes to the next free number; only then can a re-lookup after `forget` give
another number.

The table holds the nodes the kernel knows (lookup count > 0) plus permanent
ones (the root and the fixed top-level directories). Every entry handed to the
kernel (lookup, create, mkdir, symlink, link, accepted readdirplus entries)
counts one; `forget` subtracts and drops the record at zero.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyfuse3

if TYPE_CHECKING:
    from .nodes.base import Node

MASK = (1 << 62) - 1
FIRST_DERIVED = 1 << 16  # below: reserved (ROOT_INODE is 1)


def derive(ident: tuple) -> int:
    """A 62-bit number from an identity (stable across runs: blake2b of its repr)."""
    h = hashlib.blake2b(repr(ident).encode("utf-8", "surrogateescape"), digest_size=8)
    return int.from_bytes(h.digest(), "big") & MASK


@dataclass(slots=True)
class _Entry:
    node: Node
    lookups: int
    permanent: bool


class InodeTable:
    def __init__(self) -> None:
        self._by_ino: dict[int, _Entry] = {}
        self._by_ident: dict[tuple, int] = {}

    def __len__(self) -> int:
        return len(self._by_ino)

    # -- numbers ----------------------------------------------------------------
    def ino_for(self, node: Node) -> int:
        """The number `node` has, or would get now (assigns `node.ino`; counts nothing)."""
        ident = node.ident
        known = self._by_ident.get(ident)
        if known is not None:
            node.ino = known
            return known
        if ident == ("root",):
            node.ino = pyfuse3.ROOT_INODE
            return node.ino
        ino = node.ino_seed() & MASK
        while ino < FIRST_DERIVED or ino in self._by_ino:
            ino = (ino + 1) & MASK
        node.ino = ino
        return ino

    # -- counts -------------------------------------------------------------------
    def remember(self, node: Node, permanent: bool = False) -> Node:
        """Count one more kernel reference to `node`. The newest instance replaces an
        equal one the table knew (its attributes are the freshest); permanent ones stay."""
        ino = self.ino_for(node)
        entry = self._by_ino.get(ino)
        if entry is not None:
            entry.lookups += 1
            if permanent:
                entry.permanent = True
            if not entry.permanent:
                entry.node = node
            return entry.node
        self._by_ino[ino] = _Entry(node, 1, permanent)
        self._by_ident[node.ident] = ino
        return node

    def count(self, node: Node) -> None:
        """`remember` for a node whose number `ino_for` assigned just now (no await since):
        the readdirplus fast path."""
        ino = node.ino
        entry = self._by_ino.get(ino)
        if entry is None:
            self._by_ino[ino] = _Entry(node, 1, False)
            self._by_ident[node.ident] = ino
        else:
            entry.lookups += 1
            if not entry.permanent:
                entry.node = node

    def add(self, ino: int, n: int) -> None:
        """Count `n` more kernel references to a known `ino` (lookups answered elsewhere:
        listings.py's, in C)."""
        entry = self._by_ino.get(ino)
        if entry is not None:
            entry.lookups += n

    def forget(self, ino: int, n: int) -> None:
        entry = self._by_ino.get(ino)
        if entry is None:
            return
        entry.lookups -= n
        if entry.lookups <= 0 and not entry.permanent:
            del self._by_ino[ino]
            self._by_ident.pop(entry.node.ident, None)

    def get(self, ino: int) -> Node | None:
        entry = self._by_ino.get(ino)
        return None if entry is None else entry.node

    def nodes(self) -> list[Node]:
        """Every node the kernel holds now (a copy: safe across awaits)."""
        return [entry.node for entry in self._by_ino.values()]

    def known(self, ident: tuple) -> Node | None:
        ino = self._by_ident.get(ident)
        return None if ino is None else self._by_ino[ino].node

    def lookups(self, ino: int) -> int:
        entry = self._by_ino.get(ino)
        return 0 if entry is None else entry.lookups
