"""A git-lfs pointer recognized (docs/lfs.md): a small blob of this exact shape

    version https://git-lfs.github.com/spec/v1
    oid sha256:<64 lowercase hex>
    size <decimal>

(git-lfs's extension lines, `ext-<n>-<name> sha256:<hex>`, may come between version and
oid; every line ends with a newline). The oid names the media's sha256 object."""

from __future__ import annotations

import re

from ..keys import Algorithm

POINTER_MAX = 1024  # git-lfs's own limit: a blob larger than this is never a pointer
STORED_MAX = POINTER_MAX + 16  # "blob <n>\0" before it
_VERSIONS = (
    b"https://git-lfs.github.com/spec/v1",
    b"https://hawser.github.com/spec/v1",  # (what git-lfs still reads)
)
_OID = re.compile(rb"oid sha256:([0-9a-f]{64})\n")
_SIZE = re.compile(rb"size (0|[1-9][0-9]{0,18})\n")
_EXT = re.compile(rb"ext-[0-9]-[a-z0-9]+ sha256:[0-9a-f]{64}\n")
SHA256_TAG = bytes([Algorithm.SHA256.value])


def pointer_oid(content: bytes) -> str | None:
    """The sha256 hex a git-lfs pointer's content names, or None if it is not one."""
    if len(content) >= POINTER_MAX or not content.startswith(b"version "):
        return None
    nl = content.find(b"\n")
    if nl < 0 or content[8:nl] not in _VERSIONS:
        return None
    pos = nl + 1
    while (m := _EXT.match(content, pos)) is not None:
        pos = m.end()
    oid = _OID.match(content, pos)
    if oid is None:
        return None
    size = _SIZE.match(content, oid.end())
    if size is None or size.end() != len(content):
        return None
    return oid.group(1).decode()


def media_of(stored: bytes) -> bytes | None:
    """The media key (raw) a stored git object names, if it is a pointer blob."""
    if len(stored) > STORED_MAX or not stored.startswith(b"blob "):
        return None
    nul = stored.find(b"\0", 5, 16)
    if nul < 0:
        return None
    oid = pointer_oid(stored[nul + 1 :])
    return None if oid is None else SHA256_TAG + bytes.fromhex(oid)


def pointer_text(oid: str, size: int) -> bytes:
    """The pointer git-lfs writes for media `oid` of `size` bytes."""
    return b"version %s\noid sha256:%s\nsize %d\n" % (_VERSIONS[0], oid.encode(), size)
