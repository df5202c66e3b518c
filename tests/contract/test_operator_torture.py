"""Kills of an owner while an operator and a bounce agent work on its queue.

The kill torture (test_torture.py) delivers; this one adds what an operator and a bounce
agent do at the same time: holds, releases, deletes and bounces of recent mail (in flight
or queued, one at a time and in bulk), retries, and the acknowledgement of every outcome.
A real owner process (``python -m tests.contract.children operate``) is killed with
``SIGKILL`` again and again, some kills while it recovers; then the queue is drained and
the acknowledgement log judged against the contract:

- a recipient reported delivered or failed (the call returned) is never handed out again,
  and its outcome says so;
- every accepted message ends with one outcome naming each of its recipients, and the
  outcomes handed out for one message never disagree;
- an acknowledged outcome is never handed out again;
- a message whose hold returned, with no release or ending asked for since, is still
  held when the kills stop;
- with the queue drained, every outcome acknowledged and the spool reopened, the log is
  back to at most two segments (space is given back).

``SPOOL_OPERATOR_KILLS`` (default 30) sets the effort.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from spool import OperatorAction, Spool
from spool import format as fmt
from spool.check import check_spool
from spool.fs import FileSystem
from spool.reader import list_segments
from tests.contract.children import OPERATE_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
KILLS = int(os.environ.get("SPOOL_OPERATOR_KILLS", "30"))


def run_owner(spool_dir: str, acks: str, seed: int, rng: random.Random) -> None:
    """Start an owner and kill it: a fifth of the time while it may still be recovering."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.contract.children", "operate", spool_dir, acks, str(seed)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdout is not None
    if rng.random() < 0.2:
        time.sleep(rng.random() * 0.4)
    else:
        line = child.stdout.readline()
        assert line == b"running\n", (line, child.stderr.read() if child.stderr else b"")
        time.sleep(0.05 + rng.random() * 0.5)
    child.send_signal(signal.SIGKILL)
    _, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, err.decode()[-3000:]


def drain(spool_dir: str, acks: str) -> list[str]:
    """Release what is held, deliver everything, acknowledge every outcome; append what it
    saw to ``acks`` in the child's notation. Returns the ids held when the kills stopped."""
    lines: list[str] = ["--- drain"]
    with Spool.open(spool_dir, **OPERATE_OPTIONS) as sp:
        held = [e.msg_id for e in sp.list() if e.held is not None]
        for _ in range(1000):
            sp.act(OperatorAction.RELEASE, where=lambda e: e.held is not None)
            sp.retry_now()
            while (attempt := sp.claim(timeout=0.05)) is not None:
                with attempt:
                    pending = attempt.envelope.recipients
                    lines.append(f"C {attempt.msg_id} {','.join(pending)}")
                    attempt.delivered(pending, "250 2.0.0 ok")
                    lines += [f"D {attempt.msg_id} {r}" for r in pending]
            while (outcome := sp.next_outcome(timeout=0)) is not None:
                statuses = ",".join(f"{r.recipient}:{r.status}" for r in outcome.recipients)
                lines.append(f"N {outcome.msg_id} {statuses}")
                sp.ack_outcome(outcome.msg_id)
                lines.append(f"O {outcome.msg_id}")
            if not list(sp.list()):
                break
    with Spool.open(spool_dir, **OPERATE_OPTIONS) as sp:  # a quiet open: space comes back
        sp.claim(timeout=0)
        lines.append(f"N? {sp.next_outcome(timeout=0)}")
    with open(acks, "a") as f:
        f.write("".join(line + "\n" for line in lines))
    return held


def judge(lines: list[str], held_at_end: set[str]) -> list[str]:
    """The contract's verdict on an acknowledgement log (the module docstring's list)."""
    bad: list[str] = []
    accepted: dict[str, list[str]] = {}
    settled: dict[tuple[str, str], str] = {}  # (msg, rcpt) -> "delivered" / "failed"
    acked: set[str] = set()
    outcome: dict[str, dict[str, str]] = {}
    asked: dict[str, str] = {}  # the last operator request per message, before the drain
    draining = False
    for n, line in enumerate(lines):
        kind, _, rest = line.partition(" ")
        words = rest.split(" ")
        if kind == "---":
            draining = True
        elif kind == "A":
            accepted[words[0]] = words[1].split(",")
        elif kind == "C":
            for r in filter(None, words[1].split(",") if len(words) > 1 else []):
                if (words[0], r) in settled:
                    bad.append(f"line {n}: {words[0]} {r} handed out after it was settled")
        elif kind in ("D", "F"):
            settled[(words[0], words[1])] = "delivered" if kind == "D" else "failed"
        elif kind == "N":
            if words[0] in acked:
                bad.append(f"line {n}: the outcome of {words[0]} came back after its ack")
            statuses = dict(item.rsplit(":", 1) for item in words[1].split(","))
            if outcome.setdefault(words[0], statuses) != statuses:
                bad.append(f"line {n}: the outcome of {words[0]} changed to {statuses}")
        elif kind == "O":
            acked.add(words[0])
        elif kind == "N?" and rest != "None":
            bad.append(f"line {n}: an outcome after the drain: {rest}")
        elif not draining and kind in ("H", "l", "x", "b"):
            if words[0] == "*":
                asked = {m: ("l" if a == "H" else a) for m, a in asked.items()}
            else:
                asked[words[0]] = kind
    for (msg, r), status in settled.items():
        if msg in outcome and outcome[msg].get(r) != status:
            bad.append(f"{msg} {r} was {status}, its outcome says {outcome[msg].get(r)}")
    for msg, rcpts in accepted.items():
        if msg not in outcome:
            bad.append(f"{msg} was accepted and has no outcome")
        elif sorted(outcome[msg]) != sorted(rcpts):
            bad.append(f"{msg}: its outcome names {sorted(outcome[msg])}, not {sorted(rcpts)}")
    finished_before = {
        line.split(" ")[1] for line in lines[: lines.index("--- drain")] if line.startswith("N ")
    }
    for msg, last in asked.items():
        if last == "H" and msg not in finished_before and msg not in held_at_end:
            bad.append(f"{msg}: its hold returned and nothing undid it, yet it is not held")
    return bad


def test_kills_beside_an_operator_and_a_bounce_agent_keep_the_contract(tmp_path: Path) -> None:
    spool_dir, acks = str(tmp_path / "spool"), str(tmp_path / "acks")
    rng = random.Random(KILLS)
    for kill in range(KILLS):
        run_owner(spool_dir, acks, 1000 + kill, rng)
    held = drain(spool_dir, acks)
    lines = Path(acks).read_text().splitlines()
    violations = judge(lines, set(held))
    assert not violations, "\n".join(violations[:10])
    counts = {k: sum(1 for line in lines if line.startswith(k + " ")) for k in "AHLXBO"}
    assert counts["A"] > KILLS and counts["H"] and counts["X"] and counts["O"], counts
    assert check_spool(spool_dir).clean
    segments = list_segments(FileSystem(), os.path.join(spool_dir, fmt.LOG_DIR))
    assert len(segments) <= 2, f"{len(segments)} segments kept with nothing queued"


def test_the_judge_catches_each_kind_of_violation() -> None:
    """The verdicts above can fail: each line below breaks one rule."""
    log = [
        "A m1 r1,r2",
        "A m2 r3",
        "A m3 r4",
        "A m4 r5",
        "C m1 r1,r2",
        "D m1 r1",
        "C m1 r1",  # handed out after it was settled
        "H m3",  # held, never released, and not held at the end
        "N m1 r1:deleted,r2:failed",  # delivered, but the outcome says deleted
        "O m1",
        "N m1 r1:deleted,r2:failed",  # came back after its ack
        "N m2 r3:failed",
        "N m2 r3:delivered",  # changed
        "--- drain",
        "N m3 r4:delivered",
        "N? <an outcome>",  # m4 has none at all
    ]
    found = judge(log, held_at_end=set())
    for words in (
        "handed out after",
        "its outcome says",
        "came back",
        "changed",
        "not held",
        "m4 was accepted and has no outcome",
        "an outcome after the drain",
    ):
        assert any(words in v for v in found), (words, found)
