"""The nine ways to lose, duplicate or wedge mail that trying the spool as an operator found.

Goal: each defect of that review (docs/reliability.md, "Violations found and fixed") stays
fixed. Each test reproduces its defect through the public API, the installed ``spool``
command or a real child process, exactly as it was reported, and failed before the fix.
The crash explorer covers each class more widely (tests/crash); these are the examples.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spool import Spool, SpoolError, SpoolLocked
from spool import format as fmt
from spool.check import check_spool
from spool.crashsim import CrashSimulator, RecordingFS
from spool.errors import InvalidMessage, MessageTooLarge, SpoolMisuse
from spool.options import RECIPIENTS_LIMIT
from spool.testing import FakeClock, deliver_all, tree_snapshot
from tests.crash.contract import judge, observe
from tests.crash.workload import OPTIONS, START_TIME, Call, Ledger

ROOT = Path(__file__).resolve().parents[2]
SPOOL_CMD = [sys.executable, "-m", "spool.cli"]


def run_spool(*args: str) -> subprocess.CompletedProcess[str]:
    """The ``spool`` command in a real process, as an operator runs it."""
    return subprocess.run([*SPOOL_CMD, *args], capture_output=True, text=True, cwd=ROOT)


def run_child(script: str) -> None:
    """Run ``script`` in a child interpreter that ends with ``os._exit`` (a crash)."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr


# --- 1: an open attempt's envelope segment must not be deleted ---------------------------


@pytest.mark.parametrize("body", ["file", "promoted"])
def test_a_checkpoint_during_a_slow_attempt_keeps_the_envelope_it_started_from(
    tmp_path: Path, body: str
) -> None:
    # Before: the garbage front counted the attempt's start record, not its envelope, so
    # a checkpoint deleted the envelope's segment; after a crash every open failed with
    # "segment file is missing" and `spool check` called the live body an orphan.
    root = tmp_path / "spool"
    run_child(
        f"""
        import os
        from spool import Spool
        from spool.testing import FakeClock
        sp = Spool.open({str(root)!r}, clock=FakeClock(), segment_size=4096,
                        inline_body_max=100, checkpoint_interval=1e9)
        if {body!r} == "file":
            slow = sp.accept("a@example.org", ["slow@example.net"], b"x" * 500)
        else:
            slow = sp.accept("a@example.org", ["slow@example.net"], b"x" * 50)
            sp.hold(slow)          # a held body is promoted to a file
            sp.release(slow)
        for i in range(40):        # fill several segments before the slow claim
            sp.accept("a@example.org", [f"r{{i}}@example.net"], b"y" * 50)
        sp.sync()
        attempt = sp.claim()
        assert attempt.msg_id == slow
        while (other := sp.claim()) is not None:
            other.delivered(other.envelope.recipients, "250 ok")
            other.close()
        sp.checkpoint()            # the attempt on `slow` is still open
        os._exit(0)                # crash
        """
    )
    report = check_spool(str(root))
    assert report.clean, report.problems
    assert not report.orphan_bodies, "the body of a message in flight was called an orphan"
    with Spool.open(root) as sp:
        assert [e.recipients for e in sp.list()] == [("slow@example.net",)]


# --- 2: kill -9, recovery, power cut -----------------------------------------------------


def test_a_power_cut_after_recovery_from_a_kill_keeps_what_recovery_read(
    tmp_path: Path,
) -> None:
    # Before: recovery read the dead owner's un-synced tail from the page cache (start,
    # deferred delta, replacement), wrote positions saying everything before them was
    # durable, and never synced that tail. A power cut then lost the replacement while the
    # positions said the envelope was superseded: the accepted message was never handed
    # out again.
    base = tmp_path / "w"
    fs = RecordingFS(str(base))
    ledger = Ledger()
    sp = Spool.open(str(base / "spool"), fs=fs, clock=FakeClock(START_TIME), **OPTIONS)
    begin = len(fs.trace)
    msg = sp.accept("s@example.org", ["r@example.net"], b"x" * 40)
    ledger.calls.append(Call("accept", msg, ("r@example.net",), begin, len(fs.trace)))
    sp.checkpoint()
    attempt = sp.claim()
    assert attempt is not None
    attempt.deferred(["r@example.net"], "451 later")
    attempt.close()  # start, delta and replacement: bookkeeping, not waited for
    sp.sync()
    # kill -9 between the write of that tail and its fdatasync: the page cache keeps it.
    killed_at = max(i for i, op in enumerate(fs.trace.ops) if op.kind == "write") + 1
    assert fs.trace.ops[killed_at].kind == "sync"

    after = RecordingFS.after_process_crash(fs.trace, killed_at, str(tmp_path / "k"))
    Spool.open(
        str(tmp_path / "k" / "spool"), fs=after, clock=FakeClock(START_TIME + 5), **OPTIONS
    ).close()
    sim = CrashSimulator(after.trace)
    # Power is lost after recovery finished: everything still pending is lost.
    state = sim.build(len(after.trace), [])
    state.write(str(tmp_path / "state"))
    problems = judge(observe(str(tmp_path / "state" / "spool")), ledger, killed_at)
    assert not problems, problems


# --- 3 and 4: outcomes -------------------------------------------------------------------


def _finished(sp: Spool, n: int) -> list[str]:
    ids = [sp.accept("s@example.org", [f"r{i}@example.net"], b"body") for i in range(n)]
    for _ in ids:
        attempt = sp.claim()
        assert attempt is not None
        attempt.failed(attempt.envelope.recipients, "550 5.1.1 no such user")
        attempt.close()
    return ids


def _drain_outcomes(sp: Spool) -> list[str]:
    got = []
    while (outcome := sp.next_outcome(timeout=0.1)) is not None:
        got.append(outcome.msg_id)
    return got


def test_an_acknowledged_outcome_never_comes_back(tmp_path: Path) -> None:
    # Before: reading past an acknowledged finish forgot the acknowledgement, so the next
    # positions dropped it while an earlier outcome was still unacknowledged.
    root = tmp_path / "spool"
    with Spool.open(root, outcomes=True) as sp:
        a, b = _finished(sp, 2)
        assert _drain_outcomes(sp) == [a, b]
        sp.ack_outcome(b)
    for _ in range(3):
        with Spool.open(root, outcomes=True) as sp:
            assert _drain_outcomes(sp) == [a]


def test_opening_without_the_outcomes_option_keeps_unacknowledged_outcomes(
    tmp_path: Path,
) -> None:
    # Before: every open without outcomes=True (every CLI command, a plain embedder)
    # moved the outcome front to the head: the bounce was never handed out.
    root = tmp_path / "spool"
    with Spool.open(root, outcomes=True) as sp:
        (a,) = _finished(sp, 1)
    done = run_spool("checkpoint", str(root))
    assert done.returncode == 0, done.stderr
    Spool.open(root).close()
    with Spool.open(root) as sp:  # tracking is a property of the spool on disk
        assert _drain_outcomes(sp) == [a]
    with Spool.open(root, outcomes=False):  # turned off only explicitly
        pass
    with Spool.open(root) as sp, pytest.raises(SpoolError, match="outcomes are not tracked"):
        sp.next_outcome()


# --- 5 and 6: repair -----------------------------------------------------------------


def _flip_in_body(root: Path, marker: bytes) -> None:
    log = root / fmt.LOG_DIR
    for seg in sorted(log.iterdir()):
        data = bytearray(seg.read_bytes())
        at = data.find(marker)
        if at >= 0:
            data[at + 3] ^= 0x01
            seg.write_bytes(bytes(data))
            return
    raise AssertionError(f"{marker!r} not found")


def test_repair_keeps_every_intact_message_and_resurrects_nothing(tmp_path: Path) -> None:
    # Before: one flipped byte in one message's body made `check --repair` cut the
    # segment there: the intact messages after it were gone, a message delivered after
    # the damage was queued again, and the command exited 0 naming no message.
    root = tmp_path / "spool"
    clock = FakeClock()
    with Spool.open(root, clock=clock) as sp:
        ids = [
            sp.accept("s@example.org", [f"r{i}@example.net"], f"message {i} ".encode() * 20)
            for i in range(6)
        ]
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == ids[0]
        attempt.delivered(attempt.envelope.recipients, "250 ok")  # start/finish after
        attempt.close()
    _flip_in_body(root, b"message 2 ")
    repaired = run_spool("check", "--repair", str(root))
    assert repaired.returncode == 1, "mail was affected: the exit status must say so"
    assert ids[2] in repaired.stdout, repaired.stdout
    for other in (ids[1], ids[3], ids[4], ids[5]):
        assert other not in repaired.stdout, f"{other} is intact but named"
    with Spool.open(root, clock=clock) as sp:
        queued = {e.msg_id for e in sp.list()}
        assert queued == {ids[1], ids[3], ids[4], ids[5]}, queued
        assert deliver_all(sp) and not list(sp.list())
    assert check_spool(str(root)).clean
    assert any(n.endswith(".bad") for n in os.listdir(root / fmt.CORRUPT_DIR))


def test_a_repaired_spool_opens_and_delivers_after_operator_actions(tmp_path: Path) -> None:
    # Before: the same damage after hold, retry --all and checkpoint made delivering the
    # remaining mail raise KeyError in the body-pin accounting, and from then on every
    # open failed while `spool check` said clean.
    root = tmp_path / "spool"
    clock = FakeClock()
    with Spool.open(root, clock=clock) as sp:
        ids = [
            sp.accept("s@example.org", [f"r{i}@example.net"], f"message {i} ".encode() * 20)
            for i in range(6)
        ]
        for _ in range(3):
            attempt = sp.claim()
            assert attempt is not None
            attempt.deferred(attempt.envelope.recipients, "451 later")
            attempt.close()
        sp.hold(ids[4])
    assert run_spool("retry", "--all", str(root)).returncode == 0
    assert run_spool("checkpoint", str(root)).returncode == 0
    _flip_in_body(root, b"message 1 ")
    assert run_spool("check", "--repair", str(root)).returncode == 1
    with Spool.open(root, clock=clock) as sp:
        sp.release(ids[4])
        clock.advance(10**6)
        deliver_all(sp)
        assert not list(sp.list())
    report = check_spool(str(root))
    assert report.clean, report.problems
    assert run_spool("recover", str(root)).returncode == 0
    Spool.open(root).close()


# --- 7: oversized or mistyped input never reaches the log --------------------------------


def test_replies_are_limited_in_bytes_and_a_refused_report_changes_nothing(
    tmp_path: Path,
) -> None:
    # Before: 1,000 recipients failed with 4,096 "€" each made a 12 MB finish record: close
    # raised AssertionError, kept the lock, and every later open failed.
    root = tmp_path / "spool"
    rcpts = [f"r{i}@example.net" for i in range(1000)]
    with Spool.open(root) as sp:
        sp.accept("s@example.org", rcpts, b"x")
        attempt = sp.claim()
        assert attempt is not None
        sp.sync()
        before = tree_snapshot(str(root))
        with pytest.raises(SpoolMisuse, match="bytes"):
            attempt.failed(rcpts, "€" * 4096)
        sp.sync()
        assert tree_snapshot(str(root)) == before
        attempt.failed(rcpts, "5" + "€" * 1365)  # 4,096 bytes: the most a reply may hold
    with Spool.open(root) as sp:
        assert list(sp.list()) == []


def test_records_at_every_limit_fit_one_frame(tmp_path: Path) -> None:
    # The largest replacement envelope (half the recipients settled with the longest
    # replies, carried as outcomes) and the largest finish record must fit one frame.
    root = tmp_path / "spool"
    with Spool.open(root, max_recipients=RECIPIENTS_LIMIT) as sp:
        n = sp.options.max_recipients
        rcpts = [f"{'x' * 59}{i:04d}@{'d' * 63}.{'e' * 63}.{'f' * 50}.example" for i in range(n)]
        assert all(len(r) <= 256 for r in rcpts)
        longest = "4" + "€" * 1365
        sp.accept("s@example.org", rcpts, b"x")
        attempt = sp.claim()
        assert attempt is not None
        attempt.delivered(rcpts[: n // 2], longest.replace("4", "2", 1))
        attempt.deferred(rcpts[n // 2 :], longest)
        attempt.close()
        sp.retry_now()
        attempt = sp.claim()
        assert attempt is not None
        attempt.failed(rcpts[n // 2 :], longest.replace("4", "5", 1))
        attempt.close()
    with Spool.open(root) as sp:
        assert list(sp.list()) == []


@pytest.mark.parametrize(
    ("action", "reason"),
    [
        ("hold", 5),
        ("hold", None),
        ("hold", ""),
        ("hold", "x" * 9_000_000),
        ("hold", "bad\ud800surrogate"),
        ("delete", b"gone"),
        ("delete", "x" * 9_000_000),
    ],
)
def test_a_refused_operator_action_changes_nothing(
    tmp_path: Path, action: str, reason: object
) -> None:
    # Before: hold(reason=5) or delete(reason=b"gone") wrote records that made every later
    # open fail; hold(reason=None) returned success without holding; a 9 MB reason raised
    # AssertionError after the envelope was superseded and its body pin released.
    root = tmp_path / "spool"
    with Spool.open(root, inline_body_max=10) as sp:
        msg = sp.accept("s@example.org", ["a@example.net"], b"x" * 100)
        sp.sync()
        before = tree_snapshot(str(root))
        with pytest.raises(SpoolMisuse):
            getattr(sp, action)(msg, reason)
        sp.sync()
        assert tree_snapshot(str(root)) == before
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == msg
        assert attempt.read_data() == b"x" * 100
        attempt.close()
    with Spool.open(root) as sp:
        assert [e.msg_id for e in sp.list()] == [msg]


# --- 8: fork after open ----------------------------------------------------------------


def test_a_forked_child_cannot_use_its_parents_spool(tmp_path: Path) -> None:
    # Before: parent and child appended at the same offset with the same id counter; the
    # child's acknowledged accept was silently overwritten.
    root = tmp_path / "spool"
    sp = Spool.open(root)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(read)
        try:
            sp.accept("s@example.org", ["child@example.net"], b"c")
            verdict = b"accepted"
        except SpoolMisuse as exc:
            verdict = b"refused: " + str(exc).encode()
        sp.close()  # must neither write nor unlock the parent's spool
        os.write(write, verdict)
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    verdict = os.read(read, 4096).decode()
    os.close(read)
    assert verdict.startswith("refused: "), verdict
    assert "fork" in verdict and str(os.getpid()) in verdict
    with pytest.raises(SpoolLocked):
        Spool.open(root).close()  # the parent still owns it
    parent = sp.accept("s@example.org", ["parent@example.net"], b"p")
    sp.close()
    with Spool.open(root) as sp:
        assert [(e.msg_id, e.recipients) for e in sp.list()] == [(parent, ("parent@example.net",))]


# --- 9: a refused accept leaves nothing --------------------------------------------------


def test_an_accept_refused_for_its_size_leaves_no_body_file(tmp_path: Path) -> None:
    # Before: with max_recipients=100,000 an envelope could outgrow a frame, and the body
    # file was written before the envelope was found too large. Now a limit that lets a
    # record outgrow a frame is refused at open, and every refusal comes before any write.
    root = tmp_path / "spool"
    with pytest.raises(SpoolMisuse, match="max_recipients"):
        Spool.open(root, inline_body_max=10, max_recipients=100_000)
    with Spool.open(root, inline_body_max=10, max_message_size=1000) as sp:
        sp.sync()
        before = tree_snapshot(str(root))
        n = sp.options.max_recipients
        with pytest.raises(MessageTooLarge):
            sp.accept("s@example.org", [f"r{i}@example.net" for i in range(n + 1)], b"x" * 100)
        with pytest.raises(MessageTooLarge):
            sp.accept("s@example.org", ["r@example.net"], b"x" * 1001)
        with pytest.raises(InvalidMessage):
            sp.accept("s@example.org", ["r@example.net", "r@EXAMPLE.net"], b"x" * 100)
        sp.sync()
        assert tree_snapshot(str(root)) == before
        assert os.listdir(root / fmt.BODY_DIR) == []
