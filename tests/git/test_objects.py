"""The object codec matches git byte for byte, in both object formats."""

from __future__ import annotations

import subprocess

import pytest

from alkfs.errors import Verification
from alkfs.git.objects import (
    TreeEntry,
    canonical,
    decode_loose,
    encode_loose,
    loose_size,
    object_id,
    parse_commit,
    parse_tag,
    parse_tree,
    split,
)

from .scenarios import everything


def _body(src, oid: str) -> tuple[str, bytes]:
    kind = src.git("cat-file", "-t", oid).strip()
    proc = subprocess.run(
        ["git", "cat-file", kind, oid], cwd=src.path, capture_output=True, check=True
    )
    return kind, proc.stdout


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_every_object_round_trips_and_parses_as_git_reads_it(make_repo, fmt):
    src = make_repo(fmt)
    everything(src)
    ids = src.git("cat-file", "--batch-all-objects", "--batch-check=%(objectname)").split()
    seen = set()
    for oid in ids:
        kind, body = _body(src, oid)
        seen.add(kind)
        data = canonical(kind, body)
        assert object_id(kind, body, fmt) == oid
        assert split(data) == (kind, body)
        assert decode_loose(encode_loose(data)) == data
        assert len(encode_loose(data)) == loose_size(len(data))
        if kind == "tree":
            listing = src.git("ls-tree", "-z", oid).split("\0")[:-1]
            expected = []
            for line in listing:
                meta, name = line.split("\t", 1)
                mode, _type, child = meta.split()
                expected.append(TreeEntry(mode, name.encode(), child))
            assert parse_tree(body, fmt) == expected
        elif kind == "commit":
            parents = src.git("rev-parse", f"{oid}^@").split()
            assert parse_commit(body) == (src.rev(f"{oid}^{{tree}}"), parents)
        elif kind == "tag":
            target = src.git("cat-file", "-p", oid).split("\n")
            assert parse_tag(body) == (target[0].split()[1], target[1].split()[1])
            assert src.git("cat-file", "-t", target[0].split()[1]).strip() == target[1].split()[1]
    assert seen == {"blob", "tree", "commit", "tag"}


def test_tree_modes_are_the_five_git_writes(make_repo):
    src = make_repo()
    everything(src)
    modes = set()
    for oid in src.git("cat-file", "--batch-all-objects", "--batch-check=%(objectname)").split():
        kind, body = _body(src, oid)
        if kind == "tree":
            modes.update(e.mode for e in parse_tree(body, "sha1"))
    assert modes == {"040000", "100644", "100755", "120000", "160000"}


def test_malformed_objects_are_refused():
    with pytest.raises(Verification):
        parse_tree(b"100644 name-without-nul", "sha1")
    with pytest.raises(Verification):
        parse_tree(b"100644 a\0" + b"\1" * 19, "sha1")  # a short id
    with pytest.raises(Verification):
        parse_commit(b"author x\n\nno tree\n")
    with pytest.raises(Verification):
        parse_tag(b"object " + b"a" * 40 + b"\n\nno type\n")
    with pytest.raises(Verification):
        split(b"blob 3\0four")
    assert parse_tree(b"", "sha1") == []
