"""The model test of the whole API, with power cuts (Hypothesis stateful testing).

Goal: the spool keeps matching a plain in-memory model of a mail queue when, at any step,
the machine loses power: recipients reported delivered or failed stay settled, every other
recipient of every accepted message is still queued, nothing appears twice.

Method: ``SpoolMatchesModel`` (tests/property) runs random accept / claim / deliver /
fail / defer / hold / release / delete / retry-now / advance-clock / reopen steps against
the spool and the model. Here the spool runs on a recording file system, and one more
rule, ``crash_and_reopen``, builds the state a power cut leaves at that instant
(``spool.testing.crashsim``: un-synced writes dropped, kept, or torn, as drawn), opens the spool on
that state (recovery), and tells the model what a crash means: open attempts end, their
unreported recipients stay queued. When a message comes due again after a crash depends on
which bookkeeping records survived (a lost start record means the old envelope is due;
a lost replacement means recovery writes one), so the model adopts the spool's retry
times and holds after a crash, never its recipients. An operator action on a message in
flight is applied when the attempt ends; a crash before that loses it (docs/design.md).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from spool import Spool
from spool.testing.crashsim import CrashSimulator, RecordingFS
from tests.crash.explore import scratch_base
from tests.property.test_model import INTERVALS, SpoolMatchesModel


class SpoolSurvivesPowerCuts(SpoolMatchesModel):
    def __init__(self) -> None:
        self.base = tempfile.mkdtemp(prefix="spool-model-crash-", dir=scratch_base())
        self.crashes = 0
        super().__init__()

    def _open(self) -> Spool:
        if not self.dir.endswith(os.sep + "spool"):
            os.rmdir(self.dir)  # the parent class's own directory, not used here
        self.dir = os.path.join(self.base, "spool")
        self.fs = RecordingFS(self.base)
        return Spool.open(
            self.dir,
            clock=self.clock,
            retry_intervals=INTERVALS,
            checkpoint_interval=3600,
            sync_interval=3600,
            fs=self.fs,
        )

    def teardown(self) -> None:
        super().teardown()
        shutil.rmtree(self.base, ignore_errors=True)

    @rule(keep=st.sampled_from(["none", "all", "some"]), seed=st.integers(0, 2**16))
    def crash_and_reopen(self, keep: str, seed: int) -> None:
        sim = CrashSimulator(self.fs.trace)
        prefix = len(self.fs.trace)
        pending = sim.pending(prefix)
        rng = random.Random(seed)
        chosen = {
            "none": [],
            "all": pending,
            "some": [u for u in pending if rng.random() < 0.5],
        }[keep]
        state = sim.build(prefix, chosen)
        # The old spool and its directory are abandoned as they are at the cut: whatever
        # it does from here on happens on a machine that has lost power.
        self.open.clear()
        self.sp.close()
        shutil.rmtree(self.base, ignore_errors=True)
        self.base = tempfile.mkdtemp(prefix="spool-model-crash-", dir=scratch_base())
        os.rmdir(self.base)
        state.write(self.base)
        self.sp = self._open()
        self.crashes += 1
        live = {e.msg_id: e for e in self.sp.list()}
        for msg_id, model in self.model.items():
            if model.in_flight and model.delete_on_close:
                # An operator's delete of a message in flight was durable when it returned
                # (a control record): recovery ends the rest of its recipients.
                model.failed |= model.pending
                model.pending.clear()
            held_in_flight = model.in_flight and model.hold_on_close
            model.in_flight = model.hold_on_close = model.delete_on_close = False
            entry = live.get(msg_id)
            if entry is not None:
                assert entry.held is not None or not held_in_flight, "a hold in flight was lost"
                model.due = entry.next_attempt_at
                model.held = entry.held is not None
                model.attempts = entry.attempts
        SpoolMatchesModel.the_spool_queue_matches_the_model(self)

    @invariant()
    def the_spool_queue_matches_the_model(self) -> None:
        """Checked right after each crash instead: ``list()`` syncs the log, so checking
        it after every step would make every step durable and hide what a cut loses."""


SpoolSurvivesPowerCuts.TestCase.settings = settings(
    max_examples=int(os.environ.get("SPOOL_CRASH_MODEL_EXAMPLES", "300")),
    stateful_step_count=30,
    deadline=None,
)
test_spool_survives_power_cuts = SpoolSurvivesPowerCuts.TestCase
