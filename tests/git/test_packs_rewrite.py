"""A set that only loses objects is written from the previous set alone (Derived._plan_rewrite):
no scan of the kv, no commit read; the new set is the previous one without what goes,
and what it withheld that is live again is packed anew."""

from __future__ import annotations

import pytest

from alkfs.app import Alkfs
from alkfs.git import packs
from alkfs.git.importer import import_repo
from alkfs.git.objects import canonical
from alkfs.git.packs.builder import Derived
from alkfs.git.refs import RefUpdate
from alkfs.keys import Algorithm

from .conftest import stored_keys
from .scenarios import everything, side_branch


def _digests(gen) -> set[bytes]:
    return set(gen.digests())


@pytest.fixture
def no_scan(monkeypatch):
    """arm(): from then on any build that scans the kv fails (the rewrite never does).
    A store whose kv keeps every object (not drained): where the packs are the only copy,
    a sweep's candidates are written back loose, and the build scans the kv, which then
    holds little (test_drain.py)."""
    monkeypatch.setenv("ALKFS_DRAIN", "0")
    calls: list[str] = []

    def scan(self):
        calls.append(self.fmt)
        raise AssertionError("the kv was scanned")

    def arm() -> list[str]:
        monkeypatch.setattr(Derived, "_scan_kinds", scan)
        monkeypatch.setattr(Derived, "_scan", scan)
        return calls

    return arm


def _imported(tmp_path, make_repo):
    src = make_repo()
    everything(src)
    side_branch(src, "gone", "only on the branch that goes\n")
    app = Alkfs.open(tmp_path / "store", window_s=3600)
    import_repo(app, src.gitdir, "r", progress=False)
    return app, src


def test_staging_moves_objects_out_of_the_main_pack_without_a_scan(tmp_path, make_repo, no_scan):
    app, src = _imported(tmp_path, make_repo)
    scans = no_scan()
    try:
        d = packs.derived_for(app.store, "sha1")
        before = d.current()
        assert before is not None
        gone = src.rev("refs/heads/gone")
        only = {
            x[1:] for x in src.rev_list_keys(gone, "--not", "--exclude=refs/heads/gone", "--all")
        }
        assert len(only) == 3
        app.refs.update("r", [RefUpdate("refs/heads/gone", None, gone)])
        report = app.store.sweep()  # (a one-hour window: staged, not deleted)
        assert report.candidates_staged == 3
        result = d.build()
        assert result is not None and result.mode == "incremental" and scans == []
        after = d.current()
        assert after is not None and after.number > before.number
        assert _digests(after) == _digests(before)  # (the three are in its staged pack)
        assert after.staged_index is not None and set(after.staged_index.digests()) == only
        assert not any(after.main_holds(x) for x in only)
        now = app.store.sweep(expire_now=True)
        assert (now.aborted, now.deleted) == (None, 3)
        assert _digests(d.current()) == _digests(before) - only
        assert stored_keys(app) == src.rev_list_keys("--exclude=refs/heads/gone", "--all")
    finally:
        app.close()


def test_what_a_set_withheld_and_is_live_again_is_packed_anew(tmp_path, make_repo, no_scan):
    app, src = _imported(tmp_path, make_repo)
    scans = no_scan()
    try:
        d = packs.derived_for(app.store, "sha1")
        first = d.current()
        x = bytes.fromhex(src.rev("refs/heads/gone"))
        y = bytes.fromhex(src.rev("refs/heads/gone^{tree}"))
        d.build([x])  # (a guard's set without x: x withheld)
        second = d.current()
        assert x not in second and second.withheld() == [x]
        d.build([y])  # x is not left out any more: packed again, from the kv
        third = d.current()
        assert x in third and y not in third
        assert _digests(third) == _digests(first) - {y}
        assert third.withheld() == [y] and scans == []
    finally:
        app.close()


def test_anything_stored_since_the_set_means_a_scan(tmp_path, make_repo, monkeypatch):
    app, src = _imported(tmp_path, make_repo)
    try:
        d = packs.derived_for(app.store, "sha1")
        scans = []
        real = Derived._scan_kinds

        def counted(self):
            scans.append(1)
            return real(self)

        monkeypatch.setattr(Derived, "_scan_kinds", counted)
        new = app.store.add(canonical("blob", b"stored after the set\n"), Algorithm.GIT_SHA1)
        y = bytes.fromhex(src.rev("refs/heads/gone^{tree}"))
        d.build([y])
        assert scans == [1]
        assert new.digest in d.current() and y not in d.current()
    finally:
        app.close()
