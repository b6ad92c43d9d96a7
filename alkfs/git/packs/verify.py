"""Checking a published set again, and withdrawing one that fails where the kv still
keeps its objects: a mixin of `Derived` (builder.py)."""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import StoreIO
from ...tiers.local import fsync_dir
from .sets import Generation

log = logging.getLogger("alkfs.packs")


class Verify:
    """A mixin of `Derived`: verify, withdraw_if_corrupt, withdraw."""

    fmt: str
    root: Path
    lock: threading.RLock
    _current: Generation | None
    last_error: str | None

    if TYPE_CHECKING:

        @property
        def primary(self) -> bool: ...
        def _check(self, out: Path, skip: set[Path] = ...) -> None: ...
        def report_affected(self, gen: Generation) -> int: ...
        def refuse_withdraw(self, why: str) -> bool: ...
        def _builder(self, blocking: bool) -> contextlib.AbstractContextManager[bool]: ...
        def _next_number(self) -> int: ...
        def _make_root(self) -> None: ...
        def _publish(self, gen: Generation | None) -> None: ...

    def verify(self, gen: Generation | None = None) -> str | None:
        """Re-check every file of `gen` (default: the published set): trailer checksums,
        each idx's copy of its pack's, sizes. None if sound, else what is wrong."""
        gen = self._current if gen is None else gen
        if gen is None:
            return None
        try:
            for rel, size in gen.files.items():
                if (gen.root / rel).stat().st_size != size:
                    raise StoreIO(f"{gen.root / rel}: its size changed")
            self._check(gen.root)
        except (OSError, StoreIO) as exc:
            return str(exc)
        return None

    def withdraw_if_corrupt(self) -> str | None:
        """`verify` the published set; one that fails is withdrawn (logged, and left in
        `last_error` for status until the next build rebuilds it). What was wrong, or None
        (also when another check withdrew or a build replaced that set meanwhile: two
        checks at once, the mount's start and a `verify`, withdraw it once). The reads run
        outside the set's lock; `withdraw(only=...)` decides under it."""
        gen = self._current
        if gen is None:
            return None
        problem = self.verify(gen)
        if problem is not None and self.primary:  # (the only copy: reported, kept)
            log.error("derived %s: the published set is corrupt: %s", self.fmt, problem)
            self.report_affected(gen)  # (listed in status.corrupt before the error shows)
            self.last_error = f"corrupt at verify: {problem}"
            return problem
        if problem is None or not self.withdraw(only=gen):
            return None
        log.error("derived %s: the published set is corrupt, withdrawn: %s", self.fmt, problem)
        self.last_error = f"withdrawn at verify: {problem}"
        return problem

    def withdraw(self, blocking: bool = True, only: Generation | None = None) -> bool:
        """Publish an empty set (every object is served loose until the next build).
        In a fleet, with `blocking` False: nothing (False) while another member builds.
        `only`: nothing (False) unless that generation is still the published one."""
        with self.lock, self._builder(blocking) as building:
            if not building or (only is not None and self._current is not only):
                return False
            if self.refuse_withdraw("asked to withdraw"):
                return False
            number = self._next_number()
            self._make_root()
            final = self.root / f"gen-{number}"
            final.mkdir()
            fsync_dir(self.root)
            self._publish(Generation(self.fmt, number, final))
            log.warning("derived %s: packs withdrawn (generation %d is empty)", self.fmt, number)
            return True
