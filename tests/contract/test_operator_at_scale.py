"""Operator commands at scale, and commands that change nothing (issue: robust core).

Goal: a bulk action (``retry --all``, ids from standard input, filters) walks the log once
whatever the number of messages; a command that is refused, or finds nothing to do, leaves
every file as it was (the lock file, which records who holds the lock, aside). Both failed
before: ``retry_now()`` walked the log once per message, and every open created a segment
and rewrote the positions.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spool import CorruptSpool, OperatorAction, Spool
from spool import format as fmt
from spool import records as rec
from spool.check import repair_spool
from spool.operator import OperatorDesk
from spool.records import Position
from spool.testing import CountingFS, FakeClock, tree_snapshot

ROOT = Path(__file__).resolve().parents[2]
DATA = b"Subject: bulk\r\n\r\n" + b"x" * 2000 + b"\r\n"
OPTIONS = {"retry_intervals": (300.0,), "segment_size": 64 * 1024, "checkpoint_interval": 10**6}


def spool_cmd(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spool.cli", *args],
        capture_output=True,
        text=True,
        input=stdin,
        cwd=ROOT,
    )


def deferred_spool(root: Path, count: int) -> list[str]:
    """A spool with ``count`` deferred messages over many segments; their ids."""
    clock = FakeClock()
    with Spool.open(root, clock=clock, **OPTIONS) as sp:  # type: ignore[arg-type]
        ids = [
            sp.accept("from@example.org", [f"r{i}@example.net", "x@other.example"], DATA)
            for i in range(count)
        ]
        while (attempt := sp.claim(timeout=0)) is not None:
            with attempt:
                attempt.deferred(attempt.envelope.recipients, "451 4.3.0 try later")
    return ids


def log_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in (root / fmt.LOG_DIR).iterdir())


@pytest.mark.parametrize("count", [60, 240])
def test_a_bulk_action_walks_the_log_once(tmp_path: Path, count: int) -> None:
    root = tmp_path / "spool"
    ids = deferred_spool(root, count)
    fs = CountingFS()
    with Spool.open(root, fs=fs, **OPTIONS) as sp:  # type: ignore[arg-type]
        size = log_bytes(root)
        before, syncs = fs.calls["bytes_read"], fs.calls["fdatasync"]
        assert sp.retry_now() == count
        # One walk reads the log once, plus each envelope it acts on; a walk per message
        # read it count times. One fdatasync covers every record written.
        assert fs.calls["bytes_read"] - before <= 2 * size
        assert fs.calls["fdatasync"] - syncs <= 3
        size = log_bytes(root)
        before = fs.calls["bytes_read"]
        result = sp.act(OperatorAction.HOLD, ids[::2], reason="held in bulk")
        assert result.changed == tuple(ids[::2])
        assert fs.calls["bytes_read"] - before <= 2 * size
        held = {e.msg_id for e in sp.list() if e.held == "held in bulk"}
        assert held == set(ids[::2])


def test_a_repair_that_holds_many_messages_walks_the_log_once_per_reason(
    tmp_path: Path,
) -> None:
    # A burst near the log's end: "records possibly lost" for every message queued before
    # it, each held. Held one by one, each hold walked the whole queue: with 400 messages
    # the repair read the log 520 times (23 s); with 3,000 it ran for over ten minutes.
    count = 120
    root = tmp_path / "spool"
    deferred_spool(root, count)
    newest = max((root / fmt.LOG_DIR).iterdir())
    data = bytearray(newest.read_bytes())
    at = len(data) * 99 // 100
    data[at : at + 40] = b"\xa5" * 40
    newest.write_bytes(bytes(data))
    fs = CountingFS()
    report = repair_spool(str(root), fs)
    held = [m for m, fate in report.fates if "records possibly lost" in fate and "held" in fate]
    assert len(held) >= count // 2, report.fates
    # Three checks and recovery read the log about ten times; a walk per hold, count times.
    assert fs.calls["bytes_read"] <= 20 * log_bytes(root)
    with Spool.open(root, **OPTIONS) as sp:  # type: ignore[arg-type]
        queued = {e.msg_id: e.held for e in sp.list()}
    assert all("may have been lost to disk damage" in (queued[m] or "") for m in held)


def test_a_bulk_bounce_that_fails_half_way_names_what_it_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by the review of the bulk repair: two bodies lost, one bounce for both; the
    # second envelope could not be read (a read error, injected: a checked spool gives no
    # such envelope) after the first message's recipients had failed. Settled again one by
    # one, the first was "no longer queued (settled meanwhile)": the report hid that the
    # repair itself had failed its recipients (a bounce goes to its sender).
    root = tmp_path / "spool"
    with Spool.open(root, segment_size=4096, clock=FakeClock()) as sp:
        msgs = [sp.accept("a@example.org", [f"r{i}@example.net"], b"x" * 100) for i in range(3)]
    newest = max((root / fmt.LOG_DIR).iterdir())
    data = bytearray(newest.read_bytes())
    for msg in msgs[:2]:  # a burst in each of two inline bodies
        body = data.index(bytes([fmt.T_BODY]) + msg.encode())
        data[body + 40 : body + 44] = b"\xde\xad\xbe\xef"
    newest.write_bytes(bytes(data))
    reads: list[object] = []
    real = OperatorDesk._read_envelope

    def second_read_fails(desk: OperatorDesk, pos: Position) -> tuple[rec.Envelope, int]:
        reads.append(pos)
        if len(reads) == 2:
            raise CorruptSpool(str(newest), pos.offset, "injected: envelope unreadable")
        return real(desk, pos)

    monkeypatch.setattr(OperatorDesk, "_read_envelope", second_read_fails)
    report = repair_spool(str(root))
    fates = dict(report.fates)
    assert all("its pending recipients failed" in fates[m] for m in msgs[:2]), fates
    assert msgs[2] not in fates
    monkeypatch.undo()
    with Spool.open(root, clock=FakeClock()) as sp:
        assert [e.msg_id for e in sp.list()] == [msgs[2]]


def test_act_reports_what_it_did_to_each_message(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    ids = deferred_spool(root, 5)
    with Spool.open(root, **OPTIONS) as sp:  # type: ignore[arg-type]
        result = sp.act(OperatorAction.RELEASE, [ids[0], "FFFFFFFFFFFFFFFF"])
        assert result.unknown == ("FFFFFFFFFFFFFFFF",)
        assert ids[0] in result.refused and "not held" in result.refused[ids[0]]
        assert result.changed == ()
        # Not named, a message the action does not apply to is merely unchanged.
        result = sp.act(OperatorAction.RELEASE)
        assert result.unchanged == tuple(ids) and not result.refused
        result = sp.act(OperatorAction.HOLD, where=lambda e: e.recipients[0] == "r3@example.net")
        assert result.changed == (ids[3],)
        again = sp.act(OperatorAction.HOLD, [ids[3]])
        assert again.unchanged == (ids[3],)


def test_the_cli_acts_on_ids_from_standard_input_on_all_and_on_filters(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    ids = deferred_spool(root, 6)
    out = spool_cmd("hold", str(root), "-", stdin="\n".join(ids[:3]) + "\n")
    assert out.returncode == 0 and "3 messages held" in out.stdout, out.stderr
    out = spool_cmd("release", str(root), "--held")
    assert out.returncode == 0 and "3 messages released" in out.stdout, out.stderr
    out = spool_cmd("delete", str(root), "--recipient", "r5@", "--reason", "550 spam run")
    assert out.returncode == 0 and "1 message deleted" in out.stdout, out.stderr
    out = spool_cmd("bounce", str(root), ids[4], "--reason", "554 5.7.1 stopped")
    assert out.returncode == 0 and "1 message returned" in out.stdout, out.stderr
    out = spool_cmd("retry", str(root), "--all")
    assert out.returncode == 0 and "1 message due now" in out.stdout, out.stderr
    out = spool_cmd("retry", str(root))
    assert out.returncode == 2 and "--all" in out.stderr


def without_lock(snapshot: dict[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in snapshot.items() if name != fmt.LOCK_NAME}


def test_refused_and_idle_commands_write_nothing(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    ids = deferred_spool(root, 3)
    before = without_lock(tree_snapshot(str(root)))
    for _ in range(5):
        assert spool_cmd("retry", str(root), "FFFFFFFFFFFFFFFF").returncode == 1
        assert spool_cmd("release", str(root), ids[0]).returncode == 0  # not held: a no-op
        assert spool_cmd("hold", str(root), "--sender", "nobody@").returncode == 0
        refused = spool_cmd("accept", str(root), "-f", "bad address", "to@example.net", stdin="x")
        assert refused.returncode == 1
        assert spool_cmd("checkpoint", str(root)).returncode == 0
    with Spool.open(root, **OPTIONS):  # type: ignore[arg-type]
        pass
    # Before: each of these runs left a new segment file and rewrote the positions.
    assert without_lock(tree_snapshot(str(root))) == before
