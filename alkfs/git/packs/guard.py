"""One `Derived` per store and format (`derived_for`), and what the store calls: `build`,
`shed` (a full disk), `verify_sets`, and `guard_deletes` around a sweep's deletions."""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from ...errors import StoreIO
from ...keys import Algorithm
from ...tiers.sql import SqlTier
from .builder import BuildResult, Derived
from .sets import DERIVED_DIR, FORMATS, Generation, format_of

if TYPE_CHECKING:
    from ...store import Store

log = logging.getLogger("alkfs.packs")

_REGISTRY: weakref.WeakKeyDictionary[Store, dict[str, Derived]] = weakref.WeakKeyDictionary()
_REGISTRY_LOCK = threading.Lock()


def derived_for(store: Store, fmt: str) -> Derived | None:
    """The store's derived packs of `fmt`: None for a store without a directory, and for
    one opened beside its lock holder (`Store.open(lock=False)`): the sets are the lock
    holder's alone (it builds, publishes and removes them). A fleet's members share
    theirs (alkfs/git/shared_packs.py)."""
    if store.path is None or not isinstance(store.kv, SqlTier):
        return None
    fleet = getattr(store, "fleet", None)
    if not store.holds_lock and fleet is None:
        return None  # (beside the lock holder)
    with _REGISTRY_LOCK:
        per = _REGISTRY.setdefault(store, {})
        d = per.get(fmt)
        if d is None:
            d = per[fmt] = Derived(store, fmt)
            if fleet is not None:
                fleet.on_packs.append(d.refresh)
        return d


def build(store: Store, fmt: str | None = None, *, prune: bool = True) -> list[BuildResult]:
    """Build and publish the set of `fmt` (default: each format the store holds objects of,
    or has a set of)."""
    out = []
    for f in [fmt] if fmt else list(FORMATS):
        d = derived_for(store, f)
        if d is None:
            continue
        if fmt is None and d.current() is None and not d.new_since(None):
            continue
        result = d.build(prune=prune)
        if result is not None:
            out.append(result)
    return out


def shed(store: Store) -> int:
    """The reserve's shedder on a full disk (alkfs/reserve.py): derived data goes first.
    Each published set that holds files is withdrawn (its objects are served loose,
    `status` shows it, and the intake builds again once the disk is no longer full);
    its files go once nobody holds them: at once in a process without a mount, after a
    mount's retire grace and last handle otherwise. Never waits: a format being built
    here or by another member of a fleet is left to that build (it meets the full disk
    itself). Returns the bytes of the sets withdrawn."""
    out = 0
    for fmt in FORMATS:
        with _REGISTRY_LOCK:
            d = _REGISTRY.get(store, {}).get(fmt)
        if d is None or not d.lock.acquire(blocking=False):
            continue
        try:
            gen = d.current()
            if gen is None or not gen.files or d.primary:  # (the only copy: kept)
                continue
            size = sum(gen.files.values())
            if not d.withdraw(blocking=False):
                continue
            d.last_error = "withdrawn: the disk is full"
            if not d.mounted:  # (no mount serves it: nobody holds its files)
                d.prune()
            out += size
        except Exception as exc:
            log.error("derived %s: could not be dropped on a full disk: %s", fmt, exc)
        finally:
            d.lock.release()
    return out


def verify_sets(store: Store) -> list[str]:
    """Re-check every file of each published set (`verify`); one that fails is withdrawn
    (its objects are served loose), logged and left in `last_error` (status) until the
    next build rebuilds it. The formats withdrawn."""
    out = []
    for fmt in FORMATS:
        d = derived_for(store, fmt)
        if d is None:
            continue
        if d.withdraw_if_corrupt() is not None:
            out.append(fmt)
    return out


@contextlib.contextmanager
def guard_deletes(store: Store, raws: Iterable[bytes]) -> Iterator[set[bytes]]:
    """Held around the deletion of these keys (raw): afterwards no published set lists
    them (see the module docstring). The sweep holds it once around all of its deletions,
    with every candidate it will take: one set is published without them all, not one
    a batch (a set published meanwhile would wait for the lock). Yields the keys to keep
    instead: in a fleet, those a member still serves in an older set after SERVE_WAIT_S
    (shared_packs.py)."""
    keep: set[bytes] = set()
    if store.path is None or not (store.path / DERIVED_DIR).exists():
        yield keep
        return
    if not store.holds_lock and store.fleet is None:
        log.warning("a sweep beside the store's lock holder: its derived packs are not guarded")
        yield keep
        return
    by_fmt: dict[str, list[bytes]] = {}
    for raw in raws:
        if raw[0] in (Algorithm.GIT_SHA1.value, Algorithm.GIT_SHA256.value):
            by_fmt.setdefault(format_of(Algorithm(raw[0])), []).append(bytes(raw[1:]))
    rebuilt: list[Derived] = []
    with contextlib.ExitStack() as stack:
        for fmt, digests in by_fmt.items():
            d = derived_for(store, fmt)
            if d is None:
                continue
            stack.enter_context(d.lock)
            stack.enter_context(d._builder(True))  # (a fleet's: waits for its builder)
            d.refresh()
            gen = d.current()
            if gen is not None and any(x in gen for x in digests):
                try:
                    d.build(digests)  # all of them: one not packed yet must not be now
                    rebuilt.append(d)
                except Exception as exc:
                    log.error("derived %s: rebuild before deleting failed (%s)", fmt, exc)
                    if d.primary:  # (never withdrawn: these deletions wait for a later sweep)
                        tag = bytes([d.algo.value])
                        keep |= {tag + x for x in digests}
                    else:
                        d.withdraw()
            if d.shared is not None:
                keep |= _served_elsewhere(d, digests)
        yield keep
        for d in rebuilt:
            if not d.mounted:  # (no mount serves it: nobody holds the retired set)
                d.prune()


def _served_elsewhere(d: Derived, digests: list[bytes]) -> set[bytes]:
    """The keys of `digests` another live member still serves in an older set once the
    wait is over (their deletion waits for a later sweep)."""
    assert d.shared is not None
    cur = d.current()
    sets: dict[int, Generation | None] = {}

    def holding(number: int) -> set[bytes]:
        if number not in sets:
            try:
                sets[number] = Generation.load(d.fmt, number, d.root / f"gen-{number}")
            except (OSError, StoreIO, ValueError):
                sets[number] = None  # (unreadable: assume it holds them all)
        gen = sets[number]
        return {x for x in digests if gen is None or x in gen}

    held = d.shared.await_served(0 if cur is None else cur.number, holding)
    if held:
        log.warning(
            "derived %s: another daemon still serves an older set: %d objects kept for a "
            "later sweep",
            d.fmt,
            len(held),
        )
    tag = bytes([d.algo.value])
    return {tag + x for x in held}
