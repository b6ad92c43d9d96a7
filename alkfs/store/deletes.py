"""The store's deletions and GC entry points: delete, the sweep's delete_staged,
engine_delete, the sweep itself and its stop (check_stopping), inert catalog rows.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..db import now_ns
from ..durations import MAX_WINDOW_S
from ..errors import AlkfsError, Interrupted, Refused
from ..gc.arbiter import LivenessSource, ProtectCallback
from ..gc.sweep import SweepProgress, SweepReport, sweep
from ..keys import Key
from ..tiers.sql import SqlTier
from .state import StoreState

INERT_GRACE_NS = 3600 * 10**9  # a catalog row without its file is removed once this old


class StoreDeletes(StoreState):
    """`Store`'s deletions and GC entry points."""

    if TYPE_CHECKING:  # (defined by the other parts of `Store`)

        def written_since(self, key: bytes, since_ns: int) -> bool: ...

    # -- GC -------------------------------------------------------------------------
    def register_source(self, source: LivenessSource) -> int:
        return self.arbiter.register_source(source)

    def register_protect(self, callback: ProtectCallback) -> int:
        return self.arbiter.register_protect(callback)

    def unregister(self, token: int) -> bool:
        return self.arbiter.unregister(token)

    def sweep(
        self,
        window_s: float | None = None,
        *,
        expire_now: bool = False,
        progress: SweepProgress | None = None,
    ) -> SweepReport:
        """One sweep (alkfs/gc/sweep.py); `progress` is told how far it got, and
        `sweep_progress` shows it meanwhile."""
        tracked = False
        if self.ahead is not None:  # (what was acknowledged is in the database before the mark)
            self.ahead.settle()

        def track(phase: str, report: SweepReport) -> None:
            nonlocal tracked
            tracked = True
            self.sweep_progress = {
                "phase": phase,
                "scanned": report.scanned,
                "staged": report.candidates_staged,
                "taken": report.taken,
                "deleted": report.deleted,
            }
            if progress is not None:
                try:
                    progress(phase, report)
                except Exception as exc:  # (a display never changes the sweep)
                    self.log.debug("sweep: the progress callback failed: %s", exc)

        try:
            if window_s is not None:  # (a staged deadline is never beyond 10 years)
                window_s = max(0.0, min(window_s, MAX_WINDOW_S))
            report = sweep(
                self,  # type: ignore[arg-type]  # (self: always a Store, of which this is a part)
                None if window_s is None else int(window_s * 1e9),
                expire_now=expire_now,
                progress=track,
            )
            if tracked:
                track("finishing", report)  # (inert rows, free pages given back)
            if report.aborted is None:
                try:
                    self.reap_inert_rows()
                except AlkfsError as exc:  # (the next sweep tries again)
                    self.log.warning("sweep: inert catalog rows not looked at: %s", exc)
            if report.deleted and self.db is not None:
                try:  # the pages the deleted rows held go back to the filesystem
                    self.db.give_back(self.stopping.is_set)
                except AlkfsError as exc:  # (the next sweep's deletions try again)
                    self.log.warning("sweep: the database kept its free pages: %s", exc)
            return report
        finally:
            if tracked:  # (not another sweep's: a refused one told nothing)
                self.sweep_progress = None
            if self.reserve is not None:
                self.reserve.recheck(reclaim=True)  # (what it freed may end a full disk)

    def reap_inert_rows(self, now: int | None = None) -> int:
        """Remove the catalog rows without their file (a large put cut short between
        its row's commit and its link) stored more than INERT_GRACE_NS ago, each checked
        again under its row lock (a put of the same content waits, then records afresh).
        Incremental: each row's stored time is looked at once (per process) after the
        grace; a file without a row is never removed (an object stored before the
        catalog). How many went."""
        if self.catalog is None or self.large is None or self.db is None:
            return 0
        upto = (now_ns() if now is None else now) - INERT_GRACE_NS
        if upto <= self._inert_upto:
            return 0
        gone = 0
        for key in self.catalog.stored_between(self._inert_upto, upto):
            if os.path.exists(self.large.path(key)):
                continue
            with self.db.tx():
                self.catalog.lock(key)
                if not os.path.exists(self.large.path(key)):
                    gone += self.catalog.delete_stored_by(key, upto)
        self._inert_upto = upto
        if gone:
            self.log.info("sweep: removed %d catalog rows whose files were never linked", gone)
        return gone

    def engine_delete(self, key: bytes) -> int | None:
        """Remove from whichever tier holds it: bytes freed, or None if it was absent."""
        freed = self.kv.delete(key)
        if freed is None and self.large is not None:
            freed = self.large.delete(key)
            if self.catalog is not None:
                # After the file: a visible object never lacks its row (a crash between
                # leaves an inert row, replaced by the next put of the same content).
                self.catalog.delete(key)
        return freed

    def delete_staged(
        self, key: bytes, staged_ns: int, keep: Callable[[bytes], bool] | None = None
    ) -> int | None | bool:
        """The sweep's delete of a candidate staged at `staged_ns` (its delete marker
        held): the bytes freed, None if it was absent, False if it was written since
        (kept; also when `keep` says so). A kv row is decided and deleted under its row
        lock."""
        if isinstance(self.kv, SqlTier):
            freed = self.kv.delete_unwritten(key, staged_ns, keep)
            if freed is not None:
                return freed
        elif self.kv.stat(key) is not None:
            if self.written_since(key, staged_ns):
                return False
            return self.kv.delete(key)
        if self.catalog is not None:
            self.catalog.lock(key)  # (a put of it waits for this transaction)
        if self.written_since(key, staged_ns) or (keep is not None and keep(key)):
            return False
        return self.engine_delete(key)

    def on_deleted(self, key: bytes) -> None:
        with self._vlock:
            self._verified.pop(key, None)
            self.corrupt.discard(key)
        for changed in self.changed_hooks:
            changed()
        for hook in self.deleted_hooks:
            try:
                hook(key)
            except Exception:
                self.log.exception("a deletion hook failed for %s", Key(key))

    def delete(self, key: Key) -> bool:
        """Delete now, unless something protects it (Refused). False if it was absent."""
        try:
            protected = {
                k.raw if isinstance(k, Key) else bytes(k)
                for cb in self.arbiter.protects()
                for k in cb()
            }
        except Exception as exc:
            raise Refused(f"{key}: a protect source failed; not deleted") from exc
        if not self.arbiter.arbitrate(key, protected):
            raise Refused(f"{key} is protected (pinned or live)")
        try:
            freed = self.engine_delete(key.raw)
        finally:
            self.arbiter.conclude(key)
        if freed is not None:
            self.on_deleted(key.raw)
            if self.reserve is not None:
                self.reserve.recheck()
        return freed is not None

    def check_stopping(self, n: int = 0) -> None:
        """Interrupted once the store's owner stops (checked every 256th call with `n`)."""
        if not n & 0xFF and self.stopping.is_set():
            raise Interrupted("the store is closing: stopped at a safe point")
