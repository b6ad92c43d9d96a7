"""Durable named pins, and the liveness source they form.

A pin names exactly one object and survives restarts. A pin on a git object
keeps its whole closure (as a ref would); a pin on any other object keeps that
object. `contains` answers from an in-memory memo (never I/O under the
arbitration lock): live when the memo is cold, when the memo holds the key, or when
a pin written after the memo was built names it or is a git object (whose closure
would need a walk: conservatively live). Only `pin` can make an object live, so only
it moves `write_counter`; unpins and renames cannot, and a sweep under a steady
stream of new pins of plain objects still collects what none of them names.

The tree of /pins: there a pin's name is its path (`backups/2026-11/My
File.pdf`: any file names, `path_ok`), each directory is a row of its own (`PinDir`:
an empty key, its mode and time), and a pin written as a file carries its mode, time and
size (`FileAttrs`). Both keep an owner and a group (`uid`, `gid`; None: the mount's owner,
as every entry shows until a chown), set at creation, kept by a rename and changed by
`set_attrs`. A directory's entries are the names in the range [`dir/`, `dir0`)
that hold no further `/` (`children`: a subdirectory's own entries are skipped over in
one step each), so a listing or a lookup is an index range or probe whatever the count.
The names are text: a path's bytes as UTF-8, any byte that is not (and each byte of a
character U+F780..U+F7FF) as the character U+F700 + the byte (`path_text`,
`path_bytes`: one-to-one, and `/` stays `/`).
"""

from .durable import ADDED_MAX, GIT_ALGOS, PRIME_MAX, Pins
from .misses import Misses, NameFilter
from .paths import (
    COMPONENT_MAX,
    PATH_MAX,
    PIN_NAME,
    TooLong,
    below,
    parent_of,
    path_bytes,
    path_ok,
    path_text,
    valid_pin_name,
)
from .records import DIR_KEY, Entry, FileAttrs, PinDir, PinRecord, from_intent, intent_name

# (a constant read at call time is read in its own module: patch it there, e.g.
# alkfs.pins.durable.PRIME_MAX; a patch of the name here would change nothing)
__all__ = [
    "ADDED_MAX",
    "COMPONENT_MAX",
    "DIR_KEY",
    "GIT_ALGOS",
    "PATH_MAX",
    "PIN_NAME",
    "PRIME_MAX",
    "Entry",
    "FileAttrs",
    "Misses",
    "NameFilter",
    "PinDir",
    "PinRecord",
    "Pins",
    "TooLong",
    "below",
    "from_intent",
    "intent_name",
    "parent_of",
    "path_bytes",
    "path_ok",
    "path_text",
    "valid_pin_name",
]
