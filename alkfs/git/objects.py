"""Git's object format: canonical bytes `"<type> <len>\\0<body>"`."""

from __future__ import annotations

from ..errors import Verification

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
