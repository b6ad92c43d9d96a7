"""Sweep counts against a model: any sequence of puts, pin releases, liveness changes and
window-0 sweeps gives exactly the counts and the survivors the contract says."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from .conftest import SetSource, open_column, patterned, sha256_key

CONTENTS = [patterned(n, 101 + i) for i, n in enumerate((3, 700, 1024, 1025, 2500, 4000))]
KEYS = [sha256_key(c) for c in CONTENTS]


class SweepModel(RuleBasedStateMachine):
    kind = "dual-tier"

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="alkfs-model-"))
        self.col = open_column(self.kind, self.tmp)
        self.store = self.col.store
        self.source = SetSource()
        self.store.register_source(self.source)
        self.clock = 0  # model time: one tick per write and per sweep
        self.present: dict[int, int] = {}  # content index -> tick of its last write
        self.pins: dict[int, list] = {}  # content index -> pins held
        self.live: set[int] = set()
        self.staged: dict[int, int] = {}  # content index -> tick of the staging sweep

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    @rule(i=st.integers(0, len(CONTENTS) - 1), keep_pin=st.booleans())
    def put(self, i: int, keep_pin: bool) -> None:
        if not self.col.accepts_large:
            i %= 3  # kv-only refuses over-threshold content: keep to what it accepts
        result = self.store.put(CONTENTS[i])
        assert result.key == KEYS[i]
        assert result.created is (i not in self.present)
        self.present[i] = self.tick()
        if keep_pin:
            self.pins.setdefault(i, []).append(result.pin)
        else:
            result.pin.release()

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def release(self, data) -> None:
        i = data.draw(st.sampled_from(sorted(i for i, p in self.pins.items() if p)))
        self.pins[i].pop().release()

    @rule(i=st.integers(0, len(CONTENTS) - 1))
    def make_live(self, i: int) -> None:
        self.source.add(KEYS[i])
        self.live.add(i)

    @rule(i=st.integers(0, len(CONTENTS) - 1))
    def make_dead(self, i: int) -> None:
        self.source.remove(KEYS[i])
        self.live.discard(i)

    @rule()
    def sweep(self) -> None:
        now = self.tick()
        protected = self.live | {i for i, p in self.pins.items() if p}
        # Execute: every staged candidate is due (window 0) and re-arbitrated.
        cancelled = deleted = 0
        for i, staged_at in self.staged.items():
            if i in protected or self.present.get(i, 0) > staged_at:
                cancelled += 1
            else:
                deleted += 1
                self.present.pop(i, None)
        taken = len(self.staged)
        # Mark and stage: whatever is stored and neither live nor pinned.
        self.staged = {i: now for i in self.present if i not in protected}

        report = self.store.sweep(window_s=0)
        assert report.aborted is None
        assert (report.taken, report.deleted, report.cancelled_by_arbitration) == (
            taken,
            deleted,
            cancelled,
        )
        assert report.candidates_staged == len(self.staged)
        assert (report.scanned, report.live) == (
            len(self.present),
            len(self.present) - len(self.staged),
        )
        assert report.bytes_freed <= sum(len(c) for c in CONTENTS)

    @invariant()
    def the_store_holds_exactly_the_model(self) -> None:
        stored = {s.key for s in self.store.list()}
        assert stored == {KEYS[i] for i in self.present}
        for i in self.present:
            if i in self.live or self.pins.get(i):
                assert self.store.get(KEYS[i]) == CONTENTS[i]
        assert self.col.window_rows() == len(self.staged)


MODEL_SETTINGS = settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("kind", ["dual-tier", "kv-only", "mem"])
def test_sweep_counts_and_survivors_match_the_model_for_any_sequence(kind: str) -> None:
    machine = type(f"SweepModel_{kind}", (SweepModel,), {"kind": kind})
    run_state_machine_as_test(machine, settings=MODEL_SETTINGS)
