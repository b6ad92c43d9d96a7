"""The import where the packs are the store's copy of git objects (packs/drain.py): git
packs what the published set lacks from the source's packs and checks it with
`index-pack --strict` (packs/adopt.py); the pack joins the set and no object passes
through the kv."""

from __future__ import annotations

import binascii
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import StoreIO
from . import lfs
from .importing import ImportResult, _git, _phase, media_and_refs
from .refs import algo_of

if TYPE_CHECKING:
    from ..app import Alkfs
    from ..gc.arbiter import Pin
    from ..store import Store
    from .packs import Derived


def derived_of(store: Store, fmt: str) -> Derived | None:
    from .packs import derived_for

    return derived_for(store, fmt)


def import_as_pack(
    app: Alkfs, derived: Derived, gitdir: str, repo_id: str, fmt: str, progress: bool | None
) -> ImportResult:
    """The import where the packs are the store's copy of git objects (drain.py): git
    packs what the published set lacks from the source's packs and checks it with
    `index-pack --strict` (packs/adopt.py); the pack joins the set, no object passes
    through the kv. Every id is pinned first, until the refs commit."""
    store = app.store
    prefix = bytes([algo_of(fmt).value])
    result = ImportResult(repo_id, fmt, 0, 0, 0, 0)
    with _phase(progress, "objects: listing"):
        hexes = _git(
            gitdir, "cat-file", "--batch-all-objects", "--unordered", "--batch-check=%(objectname)"
        ).stdout.split()
    raws = [prefix + x for x in map(binascii.unhexlify, hexes)]
    store.pin_raws(raws)
    held: list[Pin] = []
    try:
        with _phase(progress, "objects: git packs and checks them"):
            result.stored, result.bytes = derived.adopt(gitdir, hexes)
        result.objects = len(hexes)
        result.present = result.objects - result.stored
        del hexes
        with _phase(progress, "LFS pointers"):
            pointers = record_pointers(app, gitdir, prefix)
        media_and_refs(app, gitdir, repo_id, fmt, result, held, progress, pointers)
    finally:
        store.unpin_raws(raws)
        for pin in held:
            pin.release()
    with _phase(progress, "packs: the kv's copies of what the set holds go"):
        try:
            derived.drain()
            derived.prune()
        except (StoreIO, OSError) as exc:
            store.log.error("import: the kv's copies of packed objects stay: %s", exc)
    return result


def record_pointers(app: Alkfs, gitdir: str, prefix: bytes) -> dict[str, list[str]]:
    """The rows of the LFS pointer blobs among the objects of the repository at `gitdir`,
    as a put of them writes (they keep their media alive); {media: [pointer blobs]}."""
    pointers = lfs.source_pointers(gitdir)
    app.lfs.record_pairs(
        [
            (prefix + binascii.unhexlify(blob), lfs.SHA256_TAG + bytes.fromhex(media))
            for media, blobs in pointers.items()
            for blob in blobs
        ]
    )
    return pointers


def keep_pushed(
    app: Alkfs, derived: Derived, pack: Path, pins: Callable[[list[Pin]], None]
) -> None:
    """A push's received pack kept as a pack of the set (Derived.keep_pack): its objects
    pinned (`pins` takes the Pins, before anything is published; the caller releases
    them when the push's refs are written) and its LFS pointers recorded, then the set
    published with it."""
    prefix = bytes([derived.algo.value])

    def before(gitdir: str, raws: list[bytes]) -> None:
        pins(app.store.pin_many(raws))
        record_pointers(app, gitdir, prefix)

    derived.keep_pack(pack, before)
