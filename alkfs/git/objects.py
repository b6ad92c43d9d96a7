"""Git's object format: canonical bytes `"<type> <len>\\0<body>"`."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from ..errors import Invalid, Verification

TYPES = (b"blob", b"tree", b"commit", b"tag")
MAX_HEADER = 32


def parse_header(data: bytes) -> tuple[str, int, int]:
    """(type, body length, header length) of canonical object bytes; Verification if malformed."""
    nul = data.find(b"\0", 0, MAX_HEADER)
    if nul < 0:
        raise Verification("not a git object: no header")
    kind, sep, size = data[:nul].partition(b" ")
    if not sep or kind not in TYPES or not size.isdigit() or (size[:1] == b"0" and size != b"0"):
        raise Verification("not a git object: malformed header")
    return kind.decode(), int(size), nul + 1


def check_canonical(head: bytes, total: int) -> str:
    """Check that `total` bytes starting with `head` form one git object; returns its type."""
    kind, size, hlen = parse_header(head)
    if hlen + size != total:
        raise Verification("not a git object: header length does not match the content")
    return kind


# -- the loose-object file form -------------------------------------------------
# Served loose objects are zlib streams made of *stored* (uncompressed) deflate
# blocks: git inflates any valid zlib stream, and this form's size is a pure
# function of the object's length, so the mount can answer `stat` without
# compressing anything and serve any byte range by arithmetic.

BLOCK = 65535
_ZHEADER = b"\x78\x01"


def loose_size(n: int) -> int:
    """Byte length of the served loose file for an object of `n` canonical bytes."""
    blocks = max(1, -(-n // BLOCK))
    return len(_ZHEADER) + n + 5 * blocks + 4


def encode_loose(canonical: bytes) -> bytes:
    """The served loose file: a zlib stream of stored blocks (see loose_size)."""
    import zlib

    n = len(canonical)
    out = bytearray(_ZHEADER)
    starts = range(0, n, BLOCK) if n else [0]
    last = starts[-1]
    for start in starts:
        chunk = canonical[start : start + BLOCK]
        size = len(chunk)
        out += bytes([1 if start == last else 0])
        out += size.to_bytes(2, "little") + (size ^ 0xFFFF).to_bytes(2, "little")
        out += chunk
    out += zlib.adler32(canonical).to_bytes(4, "big")
    return bytes(out)


def decode_loose(data: bytes) -> bytes:
    """Canonical bytes of any zlib-deflated loose object (git's own, or ours)."""
    import zlib

    try:
        return zlib.decompress(data)
    except zlib.error as exc:
        raise Verification(f"not a zlib stream: {exc}") from exc


# -- the codec: canonical form and the parsers the closure and the daemon need ------
# Object formats: "sha1" (20-byte ids) and "sha256" (32-byte ids).

FORMATS = {"sha1": 20, "sha256": 32}
TREE_MODES = ("040000", "100644", "100755", "120000", "160000")
GITLINK = "160000"
TREE = "040000"

# One tree entry: `<octal mode> <name>\0<raw id>`; entries are contiguous, so
# successive matches consume the body exactly when it is well formed.
_ENTRY = {
    fmt: re.compile(rb"([0-7]{5,6}) ([^\0]+)\0(.{%d})" % n, re.DOTALL) for fmt, n in FORMATS.items()
}

# The same, without capturing the name: the closure walk's parser.
WALK_ENTRY = {
    fmt: re.compile(rb"([0-7]{5,6}) [^\0]+\0(.{%d})" % n, re.DOTALL) for fmt, n in FORMATS.items()
}

# Only the ids, every entry consumed: the walk's parser for trees without gitlinks.
ID_ONLY = {
    fmt: re.compile(rb"[0-7]{5,6} [^\0]+\0(.{%d})" % n, re.DOTALL) for fmt, n in FORMATS.items()
}


@dataclass(frozen=True, slots=True)
class TreeEntry:
    mode: str  # six digits: 040000, 100644, 100755, 120000, 160000
    name: bytes
    oid: str  # lowercase hex


def id_len(fmt: str) -> int:
    """Raw id length of an object format; Invalid for an unknown one."""
    try:
        return FORMATS[fmt]
    except KeyError:
        raise Invalid(f"unknown object format {fmt!r}") from None


def canonical(kind: str, body: bytes) -> bytes:
    """The stored bytes of a git object: `"<type> <len>\\0<body>"`."""
    if kind.encode() not in TYPES:
        raise Invalid(f"not a git object type: {kind!r}")
    return b"%s %d\0%s" % (kind.encode(), len(body), body)


def object_id(kind: str, body: bytes, fmt: str = "sha1") -> str:
    """The hex object id of a git object in the given format."""
    h = hashlib.sha1() if id_len(fmt) == 20 else hashlib.sha256()
    h.update(canonical(kind, body))
    return h.hexdigest()


def split(data: bytes) -> tuple[str, bytes]:
    """(type, body) of canonical object bytes, checking the header's length."""
    kind, size, hlen = parse_header(data)
    if hlen + size != len(data):
        raise Verification("not a git object: header length does not match the content")
    return kind, data[hlen:]


def parse_tree(body: bytes, fmt: str) -> list[TreeEntry]:
    """Every entry of a tree body; Verification if it is not a well-formed tree."""
    id_len(fmt)
    out: list[TreeEntry] = []
    pos = 0
    end = len(body)
    pattern = _ENTRY[fmt]
    while pos < end:
        m = pattern.match(body, pos)
        if m is None:
            raise Verification(f"malformed tree entry at byte {pos}")
        mode, name, oid = m.groups()
        out.append(TreeEntry(mode.decode().rjust(6, "0"), name, oid.hex()))
        pos = m.end()
    return out


def tree_ids(body: bytes, fmt: str) -> list[tuple[bytes, bytes]]:
    """(mode, raw id) of every entry, fast: the walk's parser (names are not needed)."""
    return WALK_ENTRY[fmt].findall(body)


def _headers(body: bytes) -> list[tuple[bytes, bytes]]:
    head = body.split(b"\n\n", 1)[0]
    out = []
    for line in head.split(b"\n"):
        if line[:1] == b" ":  # continuation of a multi-line header (gpgsig, mergetag)
            continue
        name, _, value = line.partition(b" ")
        out.append((name, value))
    return out


def _hex_id(value: bytes) -> str:
    text = value.decode("ascii", "replace")
    if len(text) not in (40, 64) or not all(c in "0123456789abcdef" for c in text):
        raise Verification(f"not an object id: {text!r}")
    return text


def parse_commit(body: bytes) -> tuple[str, list[str]]:
    """(tree id, [parent ids]) of a commit body."""
    tree: str | None = None
    parents: list[str] = []
    for name, value in _headers(body):
        if name == b"tree" and tree is None:
            tree = _hex_id(value)
        elif name == b"parent":
            parents.append(_hex_id(value))
        elif name in (b"author", b"committer"):
            break  # git writes tree and parents first
    if tree is None:
        raise Verification("a commit without a tree")
    return tree, parents


def parse_tag(body: bytes) -> tuple[str, str]:
    """(target id, target type) of an annotated tag body."""
    target: str | None = None
    kind: str | None = None
    for name, value in _headers(body):
        if name == b"object":
            target = _hex_id(value)
        elif name == b"type":
            kind = value.decode("ascii", "replace")
        if target is not None and kind is not None:
            break
    if target is None or kind is None or kind.encode() not in TYPES:
        raise Verification("a tag without an object or a type")
    return target, kind
