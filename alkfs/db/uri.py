"""Database URIs: which engine one names, and how to show one without its password."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit

from ..errors import Invalid

SCHEMES = ("postgresql", "postgres")
_SECRET_PARAMS = {"password", "sslpassword"}
_KV_SECRET = re.compile(r"(\b(?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.I)


def is_postgresql(uri: str) -> bool:
    return urlsplit(uri).scheme in SCHEMES


def check(uri: str) -> str:
    """The URI if it names a PostgreSQL database (Invalid otherwise, without echoing it)."""
    if not isinstance(uri, str) or not is_postgresql(uri):
        raise Invalid("--database takes a postgresql:// URI")
    return uri


def redact(uri: str) -> str:
    """The URI with any password removed (user, host, port, database and other
    parameters kept): what every message, log line and status shows."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<an unreadable database URI>"
    if parts.scheme not in SCHEMES:  # a libpq key=value string
        return _KV_SECRET.sub(r"\1***", uri)
    netloc = parts.netloc
    if "@" in netloc:
        auth, host = netloc.rsplit("@", 1)
        user = auth.split(":", 1)[0]
        netloc = f"{user}@{host}"
    query = urlencode(
        [(k, "***" if k.lower() in _SECRET_PARAMS else v) for k, v in parse_qsl(parts.query)],
        safe="/",
    )
    # (not urlunsplit: it drops the "//" of an empty host, postgresql:///db?host=/run/pg)
    out = f"{parts.scheme}://{netloc}{parts.path}"
    return out + (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")


def has_password(uri: str) -> bool:
    try:
        parts = urlsplit(uri)
    except ValueError:
        return True  # (unreadable: assume the worst)
    if parts.scheme not in SCHEMES:
        return _KV_SECRET.search(uri) is not None
    return parts.password is not None or any(
        k.lower() in _SECRET_PARAMS for k, _ in parse_qsl(parts.query)
    )
