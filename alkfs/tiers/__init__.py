"""Storage engines: plain content-addressed rows, nothing else. They never verify or decide.

Each engine stores unverified bytes under raw key bytes; the store facade hashes,
routes, verifies and arbitrates.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Entry:
    """What an engine knows of one object without loading it."""

    key: bytes
    size: int
    stored_ns: int
