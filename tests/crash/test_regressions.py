"""One crash state each for the violations the explorer found, pinned as regression tests.

Each test runs a short scripted workload on the recording file system, picks the exact
crash state that broke the contract before the fix (a trace prefix and which pending
writes survive), and checks it with the same contract checker as the explorer.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from spool import Spool
from spool import format as fmt
from spool.testing import FakeClock
from spool.testing.crashsim import CrashSimulator, RecordingFS, TreeState, Unit
from tests.crash.contract import judge, judge_repaired, observe, observe_repaired
from tests.crash.workload import OPTIONS, START_TIME, Call, Ledger, run_named


def record(
    base: Path, script: Callable[[Spool, Ledger, RecordingFS], None]
) -> tuple[RecordingFS, Ledger]:
    fs = RecordingFS(str(base))
    ledger = Ledger()
    sp = Spool.open(str(base / "spool"), fs=fs, clock=FakeClock(START_TIME), **OPTIONS)
    script(sp, ledger, fs)
    sp.close()
    return fs, ledger


def accept(
    sp: Spool, ledger: Ledger, fs: RecordingFS, rcpts: tuple[str, ...], size: int = 40
) -> str:
    begin = len(fs.trace)
    msg = sp.accept("s@example.org", rcpts, b"x" * size)
    ledger.calls.append(Call("accept", msg, rcpts, begin, len(fs.trace)))
    return msg


def check_state(tmp: Path, fs: RecordingFS, ledger: Ledger, prefix: int, keep: list[Unit]) -> None:
    state = CrashSimulator(fs.trace).build(prefix, keep)
    dest = tmp / "state"
    state.write(str(dest))
    problems = judge(observe(str(dest / "spool")), ledger, prefix)
    assert not problems, problems


def first_op(fs: RecordingFS, kind: str, suffix: str = "", after: int = 0) -> int:
    for i, op in enumerate(fs.trace.ops):
        name = op.dst if op.kind == "rename" else op.path
        if i >= after and op.kind == kind and name.endswith(suffix):
            return i
    raise AssertionError(f"no {kind} {suffix} in the trace")


def test_a_new_spool_directory_is_fsynced_into_its_parent(tmp_path: Path) -> None:
    # Before: the spool's own directory entry was never made durable, so a power cut
    # could take every acknowledged message with it.
    fs, _ = record(tmp_path / "w", lambda sp, ledger, fs: None)
    mkdir = first_op(fs, "mkdir", "spool")
    assert fs.trace.ops[mkdir + 1].kind == "dirsync" and fs.trace.ops[mkdir + 1].path == "."


def test_a_removed_torn_segment_leaves_no_gap_in_the_numbers(tmp_path: Path) -> None:
    # Before: recovery removed a newest segment whose header never became durable and
    # then started the next number, so the following open refused the gap.
    def script(sp: Spool, ledger: Ledger, fs: RecordingFS) -> None:
        for i in range(8):  # past segment_size: the log rolls over
            accept(sp, ledger, fs, (f"r{i}@example.net",), 900)

    fs, ledger = record(tmp_path / "w", script)
    created = first_op(fs, "create", "00000000000000000002.seg")
    sim = CrashSimulator(fs.trace)
    keep = [u for u in sim.pending(created + 1) if u.op_index == created]
    check_state(tmp_path, fs, ledger, created + 1, keep)


def test_an_interrupted_segment_deletion_is_finished_not_refused(tmp_path: Path) -> None:
    # Before: a crash that kept a later unlink and lost an earlier one left a gap below
    # the garbage front, and recovery refused to open.
    def script(sp: Spool, ledger: Ledger, fs: RecordingFS) -> None:
        for i in range(10):
            accept(sp, ledger, fs, (f"r{i}@example.net",), 900)
        while (attempt := sp.claim()) is not None:
            begin = len(fs.trace)
            attempt.delivered(attempt.envelope.recipients, "250 ok")
            ledger.calls.append(
                Call("settle", attempt.msg_id, attempt.envelope.recipients, begin, len(fs.trace))
            )
            attempt.close()
        sp.checkpoint()

    fs, ledger = record(tmp_path / "w", script)
    unlinks = [
        i for i, op in enumerate(fs.trace.ops) if op.kind == "unlink" and op.path.endswith(".seg")
    ]
    assert len(unlinks) >= 2
    prefix = unlinks[1] + 1
    keep = [u for u in CrashSimulator(fs.trace).pending(prefix) if u.op_index == unlinks[1]]
    check_state(tmp_path, fs, ledger, prefix, keep)


def test_a_tear_that_keeps_an_envelope_but_not_its_body_cuts_both(tmp_path: Path) -> None:
    # Before: the envelope survived as a live message whose body frame was torn, and the
    # body read failed when the message was attempted.
    def script(sp: Spool, ledger: Ledger, fs: RecordingFS) -> None:
        accept(sp, ledger, fs, ("a@example.net",), 40)
        accept(sp, ledger, fs, ("b@example.net",), 700)  # envelope + body span two sectors

    fs, ledger = record(tmp_path / "w", script)
    write = ledger.calls[1].begin
    assert fs.trace.ops[write].kind == "write" and len(fs.trace.ops[write].data) > 512
    sim = CrashSimulator(fs.trace)
    first_sector = [u for u in sim.pending(write + 1) if u.op_index == write][:1]
    check_state(tmp_path, fs, ledger, write + 1, first_sector)


def test_deleting_a_message_in_flight_is_durable_when_its_attempt_ends(tmp_path: Path) -> None:
    # Before: the records an operator delete wrote at the end of the attempt were not
    # waited for, so a crash right after could bring the message back.
    def script(sp: Spool, ledger: Ledger, fs: RecordingFS) -> None:
        msg = accept(sp, ledger, fs, ("a@example.net", "b@example.net"))
        attempt = sp.claim()
        assert attempt is not None
        begin = len(fs.trace)
        sp.delete(msg)
        attempt.close()
        ledger.calls.append(
            Call("settle", msg, ("a@example.net", "b@example.net"), begin, len(fs.trace))
        )

    fs, ledger = record(tmp_path / "w", script)
    end = ledger.calls[-1].end
    check_state(tmp_path, fs, ledger, end, [])  # nothing un-synced survives the cut
    with Spool.open(str(tmp_path / "state" / "spool"), **OPTIONS) as sp:
        assert list(sp.list()) == [], "the deleted message came back"


def test_an_operator_action_on_a_message_in_flight_is_durable_on_return(tmp_path: Path) -> None:
    # Before: a delete or a hold of a message in flight lived in memory until its attempt
    # ended; a crash first brought the message back, due and not held.
    marks: dict[str, object] = {}

    def script(sp: Spool, ledger: Ledger, fs: RecordingFS) -> None:
        gone = accept(sp, ledger, fs, ("a@example.net", "b@example.net"))
        kept = accept(sp, ledger, fs, ("c@example.net",))
        first, second = sp.claim(), sp.claim()
        assert first is not None and second is not None
        attempts = {a.msg_id: a for a in (first, second)}
        assert set(attempts) == {gone, kept}
        begin = len(fs.trace)
        attempts[gone].delivered(["a@example.net"], "250 ok")
        sp.delete(gone)
        ledger.calls.append(
            Call("settle", gone, ("a@example.net", "b@example.net"), begin, len(fs.trace))
        )
        sp.hold(kept, "quarantined by the operator")
        marks.update(end=len(fs.trace), gone=gone, kept=kept)

    fs, ledger = record(tmp_path / "w", script)
    end = marks["end"]
    assert isinstance(end, int)
    check_state(tmp_path, fs, ledger, end, [])  # the attempts never ended
    with Spool.open(str(tmp_path / "state" / "spool"), **OPTIONS) as sp:
        queue = {e.msg_id: e for e in sp.list()}
    assert marks["gone"] not in queue, "the deleted message came back"
    assert queue[str(marks["kept"])].held == "quarantined by the operator"


def test_recovery_removes_the_body_file_of_an_accept_a_crash_cut_short(tmp_path: Path) -> None:
    # Before: a crash between a body file and its envelope left an orphan that only
    # `spool check --repair` moved away (about 0.8 a kill in the torture run). Every crash
    # state of accepts with body files, a checkpoint between them (which moves the first
    # file to bodies/) and a finish: the contract holds and no orphan is left.
    def script(sp: Spool, ledger: Ledger, fs: RecordingFS) -> None:
        first = accept(sp, ledger, fs, ("a@example.net",), 3000)
        sp.checkpoint()
        accept(sp, ledger, fs, ("b@example.net",), 3000)
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == first
        begin = len(fs.trace)
        attempt.delivered(["a@example.net"], "250 ok")
        ledger.calls.append(Call("settle", first, ("a@example.net",), begin, len(fs.trace)))
        attempt.close()
        sp.checkpoint()

    fs, ledger = record(tmp_path / "w", script)
    sim = CrashSimulator(fs.trace)
    for prefix in range(len(fs.trace) + 1):
        for keep in ([], sim.pending(prefix)):
            shutil.rmtree(tmp_path / "state", ignore_errors=True)
            check_state(tmp_path, fs, ledger, prefix, keep)


def test_a_damaged_delta_and_finish_of_a_message_whose_body_file_is_gone(tmp_path: Path) -> None:
    # Found by the crash pieces on e868221 (older than them: b7667fd fails the same way).
    # Mended by reading an outcome acknowledgement as the proof of its message's finish
    # (tests/contract/test_repair_acknowledged_finish.py).
    # Workload everything-with-outcomes, seed 21149, crash after trace op 119: a burst
    # over a delivered delta (segment 3, bytes 589-592) and a bit of the finish (byte
    # 745) of the same message, whose body file the finish had let go. The repair's open
    # rebuilt the attempt from what was left and queued the message again, held, naming a
    # body file that is gone: recovery then refuses the spool ("body file is missing").
    recorded = run_named(str(tmp_path / "w"), 21149, 30)
    state = CrashSimulator(recorded.trace).build(119, ())
    files = dict(state.files)
    seg = next(p for p in files if p.endswith(fmt.segment_name(3)))
    data = bytearray(files[seg])
    data[589:593] = b"\xa5\x5a\x0f\xf0"
    data[745] ^= 0x10
    files[seg] = bytes(data)
    damaged = TreeState(state.dirs, tuple(sorted(files.items())))
    damaged.write(str(tmp_path / "state"))
    obs = observe_repaired(str(tmp_path / "state" / "spool"))
    owners = (("delta", ""), ("finish", ""))
    assert not judge_repaired(obs, recorded.ledger, 119, owners)
