"""Every tuning knob of the library and the daemon, read from the environment in one place.

`Settings` has one field per `ALKFS_*` variable; `Settings.from_env(environ)` parses them
(a value it cannot read: the default, and one warning line naming the variable), and
`settings()` is what the modules use: the settings of `os.environ`, parsed at first use
and again whenever an `ALKFS_*` variable of the process changed since (a test's
`monkeypatch.setenv`; a daemon reads its environment as it starts). No other module reads
an `ALKFS_*` variable (tests/store/test_settings.py checks).

Three are the command lines' defaults rather than knobs: `ALKFS_STORE` and `ALKFS_MOUNT`,
the target of `alkfs` (alkfs/cli/parser.py) when neither `--store` nor `--mount` is given,
and `ALKFS_DATABASE`, the default of `--database` for `alkfs --store` and for alkfsd
(daemon/config.py, which also moves a URI with a password from its command line into this
variable and starts again). alkfsd's `--config` file and flags (daemon/config.py, parsed
there) set none of the knobs: they set the store, the window, the sweeps and the mount's
options. docs/operations.md lists the variables as here.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from .durations import parse_duration

log = logging.getLogger("alkfs")

PREFIX = "ALKFS_"
LOG_PRIORITIES_ENV = "ALKFS_LOG_PRIORITIES"
DATABASE_ENV = "ALKFS_DATABASE"  # (alkfsd sets it to move a password off its command line)
MAX_ASK_TIMEOUT_S = 3600.0  # ALKFS_ROOTS_ASK_TIMEOUT's ceiling
MACHINE_ID_MAX = 200  # characters of ALKFS_MACHINE_ID kept

_OFF = ("0", "off", "no")  # (ALKFS_PACKS, ALKFS_INTENTS: any case)
_ON = ("", "1", "on", "yes", "true")
_TRUE = ("1", "yes", "true", "on")  # (ALKFS_LOG_PRIORITIES: any case, spaces around)
_FALSE = ("", "0", "no", "false", "off")


@dataclass(frozen=True)
class Settings:
    """The knobs, each: the field, its variable, its default, what it sets."""

    # derived packs (daemon/packs.py, docs/git.md)
    packs: bool = True  # ALKFS_PACKS: off/0/no serves and builds no derived packs
    pack_every_s: float = 60.0  # ALKFS_PACK_EVERY: a new set once any objects and this long
    pack_objects: float = 20_000  # ALKFS_PACK_OBJECTS: a new set once this many objects
    pack_poll_s: float | None = None  # ALKFS_PACK_POLL: the count's period; None: min(every, 5)
    pack_retire_grace_s: float = 300.0  # ALKFS_PACK_RETIRE_GRACE: a retired set's names resolve
    pack_retire_hold_s: float = 3600.0  # ALKFS_PACK_RETIRE_HOLD: a handle keeps one that long
    pack_retired_max: int = 3  # ALKFS_PACK_RETIRED_MAX: retired sets of a format kept at most
    drain: bool = True  # ALKFS_DRAIN: 0 keeps packed git objects in the kv too (packs/drain.py)
    # writes (alkfs/writebehind.py, daemon/staging/pending.py)
    intents: bool = True  # ALKFS_INTENTS: off/0/no: a small file's close commits at once
    intents_gather_s: float = 0.05  # ALKFS_INTENTS_GATHER_S: the pause of closes before apply
    max_write_handles: int = 64  # ALKFS_MAX_WRITE_HANDLES: a shared mount's per-uid bound
    max_spool_bytes: int = 1 << 30  # ALKFS_MAX_SPOOL_BYTES: per uid, written and not released
    max_read_handles: int = 1024  # ALKFS_MAX_READ_HANDLES: per uid, open read handles
    # liveness and the fleet (alkfs/roots.py, alkfs/git/closure.py, alkfs/fleet.py)
    roots_grace_s: float = 7 * 86400.0  # ALKFS_ROOTS_GRACE: a missing root's path, then dropped
    roots_ask_timeout_s: float = 60.0  # ALKFS_ROOTS_ASK_TIMEOUT: wait for another machine's read
    machine_id: str = ""  # ALKFS_MACHINE_ID: this machine; "": /etc/machine-id, the host name
    mark: str = "git"  # ALKFS_MARK: python walks the ref closure in Python, not by git
    fleet_ttl_s: float = 60.0  # ALKFS_FLEET_TTL: a fleet member's session
    # logs
    debug: bool = False  # ALKFS_DEBUG: any value: `alkfs` logs, and shows a bug's traceback
    log_priorities: bool = False  # ALKFS_LOG_PRIORITIES: 1/yes/true/on: alkfsd's journal form
    # the command lines' defaults (alkfs/cli/parser.py, daemon/config.py)
    store: str = ""  # ALKFS_STORE: alkfs's target when no --store or --mount is given
    mount: str = ""  # ALKFS_MOUNT: the same, a mount (both set: alkfs asks to choose)
    database: str = field(default="", repr=False)  # ALKFS_DATABASE: --database's default

    @property
    def pack_poll_interval_s(self) -> float:
        """ALKFS_PACK_POLL, else min(ALKFS_PACK_EVERY, 5 s)."""
        return min(self.pack_every_s, 5.0) if self.pack_poll_s is None else self.pack_poll_s

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """The settings `environ` gives (a bad value: the default, and a warning)."""
        d, r = cls(), _Reader(environ)
        return cls(
            packs=r.switch("ALKFS_PACKS", d.packs, off=_OFF, on=_ON),
            pack_every_s=r.number("ALKFS_PACK_EVERY", d.pack_every_s),
            pack_objects=r.number("ALKFS_PACK_OBJECTS", d.pack_objects),
            pack_poll_s=r.number_or_none("ALKFS_PACK_POLL", d.pack_poll_s),
            pack_retire_grace_s=r.number("ALKFS_PACK_RETIRE_GRACE", d.pack_retire_grace_s),
            pack_retire_hold_s=r.number("ALKFS_PACK_RETIRE_HOLD", d.pack_retire_hold_s),
            pack_retired_max=r.count("ALKFS_PACK_RETIRED_MAX", d.pack_retired_max),
            drain=r.switch("ALKFS_DRAIN", d.drain, off=("0",), on=("", "1"), fold=False),
            intents=r.switch("ALKFS_INTENTS", d.intents, off=_OFF, on=_ON),
            intents_gather_s=r.number("ALKFS_INTENTS_GATHER_S", d.intents_gather_s),
            max_write_handles=r.integer("ALKFS_MAX_WRITE_HANDLES", d.max_write_handles),
            max_spool_bytes=r.integer("ALKFS_MAX_SPOOL_BYTES", d.max_spool_bytes),
            max_read_handles=r.integer("ALKFS_MAX_READ_HANDLES", d.max_read_handles),
            roots_grace_s=r.duration("ALKFS_ROOTS_GRACE", d.roots_grace_s, "7d"),
            roots_ask_timeout_s=r.duration(
                "ALKFS_ROOTS_ASK_TIMEOUT", d.roots_ask_timeout_s, "60s", most=MAX_ASK_TIMEOUT_S
            ),
            machine_id=environ.get("ALKFS_MACHINE_ID", "").strip()[:MACHINE_ID_MAX],
            mark=r.choice("ALKFS_MARK", d.mark, ("git", "python")),
            fleet_ttl_s=r.number("ALKFS_FLEET_TTL", d.fleet_ttl_s, empty_default=True),
            debug=bool(environ.get("ALKFS_DEBUG")),
            log_priorities=log_priorities(environ, warn=True),
            store=environ.get("ALKFS_STORE", ""),
            mount=environ.get("ALKFS_MOUNT", ""),
            database=environ.get(DATABASE_ENV, ""),
        )


def log_priorities(environ: Mapping[str, str], *, warn: bool = False) -> bool:
    """ALKFS_LOG_PRIORITIES of `environ` (alkfsd reads it as it sets its log up, before
    anything else, hence on its own; `warn`: a bad value is logged)."""
    return _Reader(environ, warn=warn).switch(
        LOG_PRIORITIES_ENV, False, off=_FALSE, on=_TRUE, strip=True
    )


class _Reader:
    """Parses the variables of one environment; a bad value: the default, and a warning."""

    def __init__(self, environ: Mapping[str, str], *, warn: bool = True) -> None:
        self.environ = environ
        self.warn = warn

    def _bad(self, name: str, text: str, what: str, default: str) -> None:
        if self.warn:
            log.warning("%s=%.40r is not %s: using %s", name, text, what, default)

    def number(self, name: str, default: float, *, empty_default: bool = False) -> float:
        """float(value); `empty_default`: an empty value is the default, not a bad one."""
        text = self.environ.get(name)
        if text is None or (empty_default and not text):
            return default
        try:
            return float(text)
        except ValueError:
            self._bad(name, text, "a number", f"{default:g}")
            return default

    def number_or_none(self, name: str, default: float | None) -> float | None:
        text = self.environ.get(name)
        if text is None:
            return default
        try:
            return float(text)
        except ValueError:
            self._bad(name, text, "a number", "the default")
            return default

    def integer(self, name: str, default: int) -> int:
        """int(value); empty: the default."""
        text = self.environ.get(name, "")
        if not text:
            return default
        try:
            return int(text)
        except ValueError:
            self._bad(name, text, "an integer", str(default))
            return default

    def count(self, name: str, default: int) -> int:
        """A number, made a whole one, at least 0 (ALKFS_PACK_RETIRED_MAX)."""
        text = self.environ.get(name)
        if text is None:
            return default
        try:
            return max(0, int(float(text)))
        except (ValueError, OverflowError):
            self._bad(name, text, "a number", str(default))
            return default

    def duration(self, name: str, default: float, shown: str, most: float | None = None) -> float:
        """A duration (alkfs/durations.py), up to `most` seconds; empty: the default."""
        text = self.environ.get(name, "").strip()
        if not text:
            return default
        try:
            seconds = parse_duration(text)
        except ValueError:
            seconds = -1.0
        if seconds < 0 or (most is not None and not seconds <= most):
            upto = "" if most is None else " up to 1h"
            self._bad(name, text, f"a duration{upto}", shown)
            return default
        return seconds

    def switch(
        self,
        name: str,
        default: bool,
        *,
        off: tuple[str, ...],
        on: tuple[str, ...],
        fold: bool = True,
        strip: bool = False,
    ) -> bool:
        """False for a value of `off`, True for one of `on` (`fold`: in any case;
        `strip`: spaces around ignored); anything else: the default."""
        raw = self.environ.get(name)
        if raw is None:
            return default
        text = raw.strip() if strip else raw
        text = text.lower() if fold else text
        if text in off:
            return False
        if text in on:
            return True
        what = "one of " + "/".join(x for x in off + on if x)
        self._bad(name, raw, what, "on" if default else "off")
        return default

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        text = self.environ.get(name)
        if text is None or text == "":
            return default
        if text in choices:
            return text
        self._bad(name, text, " or ".join(choices), default)
        return default


_lock = threading.Lock()
_cached: tuple[tuple[tuple[str, str], ...], Settings] | None = None


def _ours(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The `ALKFS_*` variables of `environ`, in its order (a new order: parsed again)."""
    return tuple((k, environ[k]) for k in environ if k.startswith(PREFIX))


def settings() -> Settings:
    """The settings of this process's environment: parsed at first use, and again after
    an `ALKFS_*` variable changed (so each bad value warns once per change)."""
    global _cached
    key = _ours(os.environ)
    cached = _cached
    if cached is not None and cached[0] == key:
        return cached[1]
    with _lock:
        cached = _cached
        if cached is None or cached[0] != key:
            cached = (key, Settings.from_env(dict(key)))
            _cached = cached
        return cached[1]
