"""What the delete window holds, as people ask for it: the staged candidates page by
page with their sizes and deadlines (`alkfs staged`, `/.alkfs/staged`), and their totals
(status, metrics)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

from ..keys import Key
from .needs import WindowStore
from .window import SqlWindow

PAGE = 1000


@dataclass(frozen=True)
class Staged:
    key: Key
    size: int | None  # (None: no longer stored)
    visible_after_ns: int  # deletable from then on (a later sweep deletes it)


def page(store: WindowStore, after: bytes = b"", limit: int = PAGE) -> list[Staged]:
    """Up to `limit` staged candidates in key order after the raw key `after`."""
    out = []
    for raw, visible in store.window.page(after, limit):
        st = store.stat(Key(raw))
        out.append(Staged(Key(raw), None if st is None else st.size, visible))
    return out


def line(row: Staged) -> str:
    """`KEY SIZE DEADLINE` (size `-` when no longer stored; the deadline in UTC)."""
    when = datetime.fromtimestamp(row.visible_after_ns / 1e9, UTC).isoformat(timespec="seconds")
    return f"{row.key} {'-' if row.size is None else row.size} {when}"


def lines(store: WindowStore, limit: int | None = None) -> Iterator[str]:
    """`line` of every staged candidate in key order (the first `limit` of them)."""
    after, listed = b"", 0
    while limit is None or listed < limit:
        rows = page(store, after, PAGE if limit is None else min(PAGE, limit - listed))
        if not rows:
            return
        yield from map(line, rows)
        listed += len(rows)
        after = rows[-1].key.raw


def totals(store: WindowStore) -> dict[str, int | None]:
    """{"count", "bytes", "first_deadline_ns"} of the staged candidates."""
    window = store.window
    if isinstance(window, SqlWindow):
        count, size, first = window.totals()
    else:  # (a memory store: small by nature)
        count = size = 0
        first = None
        after = b""
        while rows := page(store, after, PAGE):
            for row in rows:
                count += 1
                size += row.size or 0
                v = row.visible_after_ns
                first = v if first is None else min(first, v)
            after = rows[-1].key.raw
    return {"count": count, "bytes": size, "first_deadline_ns": first}
