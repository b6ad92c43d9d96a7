"""The names of pins: the xattr form's (`valid_pin_name`) and the paths of /pins, any file
name as text (`path_text`, `path_bytes`: see alkfs/pins/__init__.py), and the path helpers
the tree's queries use (`parent_of`, `below`)."""

from __future__ import annotations

import re

from ..errors import Invalid

PIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
COMPONENT_MAX = 255  # bytes of one component of a path in /pins
PATH_MAX = 4096  # bytes of a whole path in /pins (its components and the `/` between)
_ESCAPED = 0xF700  # a byte escaped in a name is this + the byte (U+F780..U+F7FF)


class TooLong(Invalid):
    """A path in /pins longer than PATH_MAX bytes (the mount answers ENAMETOOLONG)."""


def valid_pin_name(name: str) -> bool:
    return isinstance(name, str) and PIN_NAME.match(name) is not None


def path_text(raw: bytes) -> str:
    """A path's bytes as a pin name (see the package's docstring; `path_bytes` inverts it)."""
    if raw.isascii():
        return raw.decode("ascii")
    text = raw.decode("utf-8", "surrogateescape")
    out: list[str] = []
    for ch in text:
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:  # (a byte that is not UTF-8: surrogateescape's)
            out.append(chr(_ESCAPED + o - 0xDC00))
        elif 0xF780 <= o <= 0xF7FF:  # (a character that escapes: its bytes escaped)
            out.extend(chr(_ESCAPED + b) for b in ch.encode())
        else:
            out.append(ch)
    return "".join(out)


def path_bytes(name: str) -> bytes:
    """The bytes of the path a pin name is (`path_text`'s inverse)."""
    if name.isascii():
        return name.encode("ascii")
    out = bytearray()
    for ch in name:
        o = ord(ch)
        if 0xF780 <= o <= 0xF7FF:
            out.append(o - _ESCAPED)
        else:
            out += ch.encode("utf-8", "surrogatepass")
    return bytes(out)


def path_ok(name: str) -> bool:
    """Whether `name` is a pin's path in /pins: components of 1-255 bytes but `.` and
    `..`, no NUL, at most PATH_MAX bytes in all (and in `path_text`'s form)."""
    if not isinstance(name, str) or not name:
        return False
    raw = path_bytes(name)
    if len(raw) > PATH_MAX or b"\0" in raw or path_text(raw) != name:
        return False
    return all(
        0 < len(part) <= COMPONENT_MAX and part not in (b".", b"..") for part in raw.split(b"/")
    )


def parent_of(name: str) -> str | None:
    """The directory a path is in (None: the top of /pins)."""
    cut = name.rfind("/")
    return None if cut < 0 else name[:cut]


def below(prefix: str) -> str:
    """The upper bound of the names starting with `prefix` (which ends with `/`)."""
    return prefix[:-1] + "0"  # ("0" follows "/")
