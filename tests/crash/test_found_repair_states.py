"""A state the crash-state explorer found once (2026-11-27): a repair of damage that touched
only padding must name and hold no mail.

Workload ``everything-with-outcomes`` (seed 7), crashed after trace op 139 with the
second sector of a torn batch kept and its first lost; then a burst over the length field
of a PAD frame in segment 4 and one more byte of it (the ``_pad_header_burst`` layer).
``damage._burst_padding_end`` allowed a damaged PAD one burst, not two, so the scan
resynced through the lost sector into the torn one, took the whole stretch for damaged
records, and the repair held the three queued messages after it (a fourth, held before,
stayed held): no mail was lost, but none was delivered until an operator released it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from spool import format as fmt
from spool.check import repair_spool
from spool.testing.crashsim import CrashSimulator, TreeState
from tests.crash import workload
from tests.crash.workload import run_named

PREFIX = 139
LAST_OPS = [
    "dirsync spool/incoming",
    "write ino18 [1024, +1024)",
    "fsync ino18",
    "write ino18 [2048, +1024)",
]
# The pending writes kept: #10 (the settings file's first six bytes) and the second sector
# of #138 (bytes 512-1024 of a write at 2048 of segment 4), by trace op and first byte.
KEPT = ((10, 0), (138, 512))


def _state(monkeypatch: pytest.MonkeyPatch) -> TreeState:
    # The workload takes one of two traces for this seed (message ids start from a
    # random counter, and a reopen starts another): run it until it takes the one found.
    # It was found before the log writer wrote zeros ahead (W6): none, for that trace.
    monkeypatch.setitem(workload.TUNING, "write_ahead", 0)
    monkeypatch.setitem(workload.OPTIONS, "write_ahead", 0)
    for _ in range(40):
        base = tempfile.mkdtemp(prefix="spool-gap-")
        try:
            recorded = run_named(base, 7, 30)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        sim = CrashSimulator(recorded.trace)
        if [op.describe() for op in sim.trace.ops[PREFIX - 4 : PREFIX]] == LAST_OPS:
            kept = [u for u in sim.pending(PREFIX) if (u.op_index, u.lo) in KEPT]
            if len(kept) != 2:
                pytest.fail(f"the pending writes to keep are not those found: {kept}")
            return sim.build(PREFIX, tuple(kept))
    pytest.fail("the workload never took the trace the state was found in")


def test_a_pad_hit_twice_before_a_torn_batch_holds_no_mail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state(monkeypatch)
    files = dict(state.files)
    segment = os.path.join("spool", fmt.LOG_DIR, fmt.segment_name(4))
    data = bytearray(files[segment])
    if data[1737 + 8] != fmt.T_PAD:  # the PAD frame at 1737: its length at 1741-1744
        pytest.fail("no PAD frame at 1737 of segment 4: the state is not the one found")
    for at in (1741, 1742, 1743, 1744, 1756):
        data[at] ^= 0x01
    files[segment] = bytes(data)
    TreeState(state.dirs, tuple(sorted(files.items()))).write(str(tmp_path))
    report = repair_spool(str(tmp_path / "spool"))
    named = {msg_id for msg_id, _ in report.fates} | {a.msg_id for a in report.before.affected}
    assert named == set()
