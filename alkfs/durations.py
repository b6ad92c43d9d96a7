"""Durations as people type them: `0`, `90s`, `15m`, `1h`, `2d`, `1h30m`.

Shared by the command line (`alkfs sweep --window`) and the daemon
(`--window`, `--sweep-every`, the config file), so both accept the same text.
"""

from __future__ import annotations

import re

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")


def parse_duration(text: str) -> float:
    """Seconds in `text`: numbers with a unit (s, m, h, d, w), summed; a bare number is seconds.

    Raises ValueError, naming the text, for anything else (empty, negative, unknown unit).
    """
    s = text.strip().lower()
    pos = 0
    total = 0.0
    units: list[str] = []
    while pos < len(s):
        m = _PART.match(s, pos)
        if m is None:
            break
        number, unit = m.groups()
        if not unit and m.end() != len(s):
            break  # a bare number is only allowed alone or last ("1h30" is ambiguous)
        if unit and unit in units:
            break
        units.append(unit)
        total += float(number) * UNITS.get(unit, 1)
        pos = m.end()
    if not s or pos != len(s) or (len(units) > 1 and "" in units):
        raise ValueError(f"not a duration: {text!r} (use e.g. 0, 90s, 15m, 1h, 2d)")
    return total


MAX_WINDOW_S = 10 * 365 * 86400
"""The longest delete window: ten years. A staged deadline is never later."""


def parse_window(text: str) -> float:
    """A delete window: `parse_duration`, and ValueError past MAX_WINDOW_S."""
    seconds = parse_duration(text)
    if not seconds <= MAX_WINDOW_S:  # (also refuses inf and nan)
        raise ValueError(f"a window over 10 years: {text[:40]!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """The shortest text parse_duration reads back as `seconds` (whole seconds in units)."""
    if seconds == 0:
        return "0"
    if seconds != int(seconds):
        return f"{seconds}s"
    rest = int(seconds)
    out = []
    for unit in ("w", "d", "h", "m", "s"):
        n, rest = divmod(rest, UNITS[unit])
        if n:
            out.append(f"{n}{unit}")
    return "".join(out)
