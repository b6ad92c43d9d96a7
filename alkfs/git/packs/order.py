"""The object list a derived pack is built from: the objects in `git rev-list --objects`
order (what gives `git pack-objects` good deltas), and the commits a commit-graph may
hold."""

from __future__ import annotations

import re
from collections.abc import Iterable

from .sets import FORMATS

_TREE_ENTRY = {n: re.compile(rb"([0-7]{5,6}) ([^\0]+)\0(.{%d})" % n, re.DOTALL) for n in (20, 32)}


def _commit_info(body: bytes, hexlen: int) -> tuple[bytes | None, list[bytes], int]:
    """(tree hex, parent hexes, committer time) of a commit's body."""
    tree = None
    parents = []
    when = 0
    pos = 0
    if body.startswith(b"tree "):
        tree = body[5 : 5 + hexlen]
        pos = 6 + hexlen
    while body.startswith(b"parent ", pos):
        parents.append(body[pos + 7 : pos + 7 + hexlen])
        pos += 8 + hexlen
    c = body.find(b"\ncommitter ")
    if c >= 0:
        end = body.find(b"\n", c + 1)
        line = body[c + 1 : end if end >= 0 else len(body)]
        parts = line.rsplit(b" ", 2)
        if len(parts) == 3 and parts[1].isdigit():
            when = int(parts[1])
    return tree, parents, when


def ordered_objects(
    objects: dict[bytes, bytes], blobs: Iterable[bytes], fmt: str
) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """The pack-objects input: (digest, path) for every given object, in `rev-list
    --objects` order (tags, then commits newest first each followed by its new trees and
    blobs with their paths), then whatever no commit reaches; and the commits whose every
    ancestor is in the set (what the commit-graph may hold).

    `objects` maps digest -> canonical bytes of every non-blob; `blobs` are the blob
    digests."""
    n = FORMATS[fmt].digest_len
    hexlen = 2 * n
    entry = _TREE_ENTRY[n]
    blob_set = set(blobs)
    commits: dict[bytes, tuple[bytes | None, list[bytes], int]] = {}
    tags: list[bytes] = []
    for digest, data in objects.items():
        nul = data.find(b"\0")
        if data.startswith(b"commit "):
            tree, parents, when = _commit_info(data[nul + 1 :], hexlen)
            try:
                commits[digest] = (
                    bytes.fromhex(tree.decode()) if tree else None,
                    [bytes.fromhex(p.decode()) for p in parents],
                    when,
                )
            except ValueError:
                commits[digest] = (None, [], when)
        elif data.startswith(b"tag "):
            tags.append(digest)
    out: list[tuple[bytes, bytes]] = [(t, b"") for t in sorted(tags)]
    seen: set[bytes] = set(tags)
    order = sorted(commits, key=lambda d: (-commits[d][2], d))
    for c in order:
        out.append((c, b""))
        seen.add(c)
    for c in order:
        tree = commits[c][0]
        if tree is None or tree in seen or tree not in objects:
            continue
        _walk(tree, objects, blob_set, seen, out, entry)
    for d in sorted(objects.keys() - seen):
        out.append((d, b""))
    for d in sorted(blob_set - seen):
        out.append((d, b""))
    return out, _graphable(commits)


def _parse_commits(
    objects: dict[bytes, bytes], hexlen: int
) -> dict[bytes, tuple[bytes | None, list[bytes], int]]:
    commits: dict[bytes, tuple[bytes | None, list[bytes], int]] = {}
    for digest, data in objects.items():
        if data.startswith(b"commit "):
            nul = data.find(b"\0")
            tree, parents, when = _commit_info(data[nul + 1 :], hexlen)
            try:
                commits[digest] = (
                    bytes.fromhex(tree.decode()) if tree else None,
                    [bytes.fromhex(p.decode()) for p in parents],
                    when,
                )
            except ValueError:
                commits[digest] = (None, [], when)
    return commits


def _walk(
    tree: bytes,
    trees: dict[bytes, bytes],
    blobs: set[bytes],
    seen: set[bytes],
    out: list[tuple[bytes, bytes]],
    entry: re.Pattern[bytes],
) -> None:
    """Append `tree` and what it reaches among `trees` and `blobs` (depth first, with paths,
    as rev-list does), skipping what is `seen`."""
    stack = [(tree, b"")]
    while stack:
        oid, path = stack.pop()
        if oid in seen:
            continue
        seen.add(oid)
        out.append((oid, path))
        data = trees.get(oid)
        if data is None or not data.startswith(b"tree "):
            continue
        nul = data.find(b"\0")
        subtrees = []
        for mode, name, child in entry.findall(data, nul + 1):
            if mode == b"160000" or child in seen:
                continue
            full = path + b"/" + name if path else name
            if mode.lstrip(b"0") == b"40000":
                if child in trees:
                    subtrees.append((child, full))
            elif child in blobs:
                seen.add(child)
                out.append((child, full))
        stack.extend(reversed(subtrees))


def ordered_incremental(
    kinds: dict[bytes, bytes],
    fetched: dict[bytes, bytes],
    previous: list[bytes],
    fmt: str,
) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """The pack-objects input when most objects are in the previous set: `kinds` maps every
    object of the new set to the first two bytes of its type; `fetched` holds the verified
    bytes of every commit and of every new tree and tag; `previous` is the previous set's
    write order. Tags, then commits newest first, then the new trees and blobs with their
    paths (walking the new trees from the new commits), then the previous set's other
    objects in its order, then what is left. Also the commits the graph may hold."""
    n = FORMATS[fmt].digest_len
    entry = _TREE_ENTRY[n]
    commits = _parse_commits(fetched, 2 * n)
    prev = set(previous)
    out: list[tuple[bytes, bytes]] = [
        (d, b"") for d in sorted(d for d, k in kinds.items() if k == b"ta")
    ]
    seen = {d for d, _p in out}
    order = sorted(commits, key=lambda d: (-commits[d][2], d))
    for c in order:
        out.append((c, b""))
        seen.add(c)
    new_trees = {d: fetched[d] for d in kinds if d not in prev and d in fetched}
    new_blobs = {d for d, k in kinds.items() if k == b"bl" and d not in prev}
    for c in order:
        tree = commits[c][0]
        if c not in prev and tree is not None and tree in new_trees:
            _walk(tree, new_trees, new_blobs, seen, out, entry)
    for d in previous:
        if d in kinds and d not in seen:
            seen.add(d)
            out.append((d, b""))
    for d in sorted(kinds.keys() - seen):
        out.append((d, b""))
    return out, _graphable(commits)


def _graphable(
    commits: dict[bytes, tuple[bytes | None, list[bytes], int]],
    known: dict[bytes, bool] | None = None,
) -> list[bytes]:
    """The commits whose ancestors are all here (else `commit-graph write` refuses);
    `known`: commits already decided (True: in the set with all its ancestors)."""
    ok: dict[bytes, bool] = dict(known or {})
    for c in commits:
        stack = [c]
        while stack:
            x = stack[-1]
            if x in ok:
                stack.pop()
                continue
            info = commits.get(x)
            if info is None:
                ok[x] = False
                stack.pop()
                continue
            pending = [p for p in info[1] if p not in ok]
            if pending:
                stack.extend(pending)
                continue
            ok[x] = all(ok[p] for p in info[1])
            stack.pop()
    return sorted(c for c in commits if ok.get(c))
