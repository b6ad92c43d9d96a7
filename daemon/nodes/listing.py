"""Listing helpers shared by the views: readdir offsets of key-ordered listings, the
snapshot listing of a small changing directory, names as text."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from alkfs.keys import Algorithm, Key

from .base import FIRST_OFFSET, Emit, Node
from .handles import DirHandle

PAGE = 512  # objects fetched per listing query
Entries = list[tuple[bytes, Node]]


def cookie(key: Key) -> int:
    """The readdir offset after `key`: 62 bits of its digest, so it is stable and ordered."""
    return (int.from_bytes(key.raw[1:9], "big") >> 2) + FIRST_OFFSET


def after_cookie(algo: Algorithm, offset: int) -> Key:
    """The greatest key whose cookie is `offset` (resume point when the exact key is unknown)."""
    top = min(((offset - FIRST_OFFSET) << 2) | 3, (1 << 64) - 1)  # a made-up offset: the end
    rest = algo.digest_len - 8
    return Key(bytes([algo.value]) + top.to_bytes(8, "big") + b"\xff" * rest)


async def readdir_snapshot(
    dh: DirHandle, start: int, emit: Emit, entries: Callable[[], Entries]
) -> None:
    """List a small changing directory: the entries are taken once per open directory
    (when listing starts), so offsets (index + FIRST_OFFSET) stay stable for it."""
    if start < FIRST_OFFSET or "entries" not in dh.state:
        dh.state["entries"] = entries()
    listed = cast(Entries, dh.state["entries"])
    first = 0 if start < FIRST_OFFSET else start - FIRST_OFFSET + 1
    for i in range(first, len(listed)):
        name, node = listed[i]
        if not emit(name, node, i + FIRST_OFFSET):
            return


def text_of(name: bytes) -> str | None:
    """A name as UTF-8 text, or None when it is not."""
    try:
        return name.decode("utf-8")
    except UnicodeDecodeError:
        return None
