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
