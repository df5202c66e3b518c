"""Process kill under load: SIGKILL an owner that accepts and delivers flat out, many times.

Goal: contract items 1-4 across hundreds of kills at random instants, some of them while
the owner is still recovering from the previous kill.

Method: a child process (``tests/contract/children.py``, forked from a fork server so a
kill costs no interpreter start) owns one spool and runs three accepting and three
delivering threads. It appends each acknowledgement to a side file, fdatasynced, after
the call returned (``A`` accepted, ``D``/``F`` delivered/failed), and an intent line
before each report (``I``). The parent kills it after a seeded random delay; for a fifth
of the kills it starts a second child at once and kills that one while it is opening the
spool (recovering). Then the parent walks the log as the kill left it, reopens the spool
(recovery) with a clock far ahead so that all deferred mail is due, and checks:

* every acknowledged recipient is exactly once either queued or recorded as delivered or
  failed in the log (nothing lost, nothing twice);
* no recipient acknowledged or logged as settled is queued again, handed out again to
  the parent, or reported about again by a later child;
* claiming everything due hands out each queued recipient once, after which nothing is
  queued, and ``spool.check`` finds no problem.

The parent delivers everything it claims, so the spool stays small and the next child
starts on the same spool. Recipients intent-logged but not acknowledged and then handed
out again are counted (a delivery whose durable record a crash lost: SMTP's inherent
duplicate), as are durable accepts and deliveries whose acknowledgement the kill cut.

``SPOOL_TORTURE_KILLS`` (default 200) sets the number of kills; the figures are printed
and, if ``SPOOL_REPORT_DIR`` is set, written to ``torture.json`` there.
"""

from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import IO

import attrs

from spool import Spool
from spool import records as rec
from spool.check import check_spool
from spool.fs import FileSystem
from spool.queue_view import walk
from spool.testing import FakeClock
from tests.contract.children import TORTURE_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
CLOCK_AHEAD = 100_000.0  # the checker's clock: every retry interval has passed


class ForkServer:
    """The parent's end of ``children.py serve``."""

    def __init__(self, stderr: IO[bytes]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.contract.children", "serve"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        self._buf = b""

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()

    def line(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._fd], [], [], max(0.0, left))
            if not ready:
                raise AssertionError("the child program did not answer in time")
            chunk = os.read(self._fd, 65536)
            if not chunk:
                raise AssertionError("the fork server exited")
            self._buf += chunk
        head, self._buf = self._buf.split(b"\n", 1)
        return head.decode()

    def wait_for(self, prefix: str) -> str:
        while True:
            text = self.line()
            if text.startswith(prefix):
                return text
            if text.startswith("exit "):
                raise AssertionError(f"the child died on its own: {text}")

    def kill(self) -> bool:
        """SIGKILL the child; True if it had not printed ``running`` yet."""
        self.send("kill")
        running = False
        while True:
            text = self.line()
            if text.startswith("running"):
                running = True
            elif text.startswith("exit "):
                status = int(text.split()[2])
                assert os.WIFSIGNALED(status), f"the child exited by itself: {text}"
                return not running

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@attrs.define
class Model:
    """What the acknowledgements say, folded over all kills so far."""

    accepted: dict[str, tuple[str, ...]] = attrs.field(factory=dict)
    settled: dict[tuple[str, str], str] = attrs.field(factory=dict)  # -> how we know
    intents: set[tuple[str, str]] = attrs.field(factory=set)  # D/F intent, no ack yet
    violations: list[str] = attrs.field(factory=list)
    figures: Counter[str] = attrs.field(factory=Counter)
    acks_read: int = 0

    def settle(self, key: tuple[str, str], how: str, where: str) -> None:
        if key in self.settled:
            self.violations.append(f"{where}: {key} settled again (was {self.settled[key]})")
        self.settled[key] = how

    def read_acks(self, path: Path) -> None:
        """Fold in the lines the last child wrote; drop a line the kill cut short."""
        with open(path, "r+b") as f:
            f.seek(self.acks_read)
            data = f.read()
            whole = data[: data.rfind(b"\n") + 1]
            f.truncate(self.acks_read + len(whole))
        self.acks_read += len(whole)
        for line in whole.decode().splitlines():
            kind, msg_id, *rest = line.split(" ")
            if kind == "A":
                if msg_id in self.accepted:
                    self.violations.append(f"accept returned a known id {msg_id}")
                self.accepted[msg_id] = tuple(rest[0].split(","))
            elif kind == "I":
                key = (msg_id, rest[0])
                if key in self.settled:
                    self.violations.append(
                        f"child handed out {key} again (settled: {self.settled[key]})"
                    )
                if rest[1] in "DF":
                    self.intents.add(key)
            elif kind in "DF":
                key = (msg_id, rest[0])
                self.settle(key, "ack", "child")
                self.intents.discard(key)
            else:
                self.violations.append(f"child reported: {line}")


def logged_settlements(spool_dir: str) -> tuple[set[tuple[str, str]], list[str]]:
    """(message, recipient) of every delivered/failed delta in the log as a kill left it."""
    seen: set[tuple[str, str]] = set()
    twice: list[str] = []
    for _pos, record, _frame in walk(FileSystem(), spool_dir):
        if isinstance(record, rec.Delta) and record.status != rec.DEFERRED:
            for r in record.recipients:
                key = (record.msg_id, r)
                if key in seen:
                    twice.append(f"{key} recorded as settled twice in the log")
                seen.add(key)
    return seen, twice


def check_and_drain(spool_dir: str, model: Model, cycle: int) -> None:
    """Reopen (recover), check the queue against the model, claim and deliver everything."""
    where = f"kill cycle {cycle}"
    logged, twice = logged_settlements(spool_dir)
    model.violations += [f"{where}: {t}" for t in twice]
    clock = FakeClock(time.time() + CLOCK_AHEAD)
    with Spool.open(spool_dir, clock=clock, **TORTURE_OPTIONS) as sp:
        clock.advance(CLOCK_AHEAD)  # what recovery deferred is due now
        model.figures["torn_bytes_cut"] += sp.recovery.torn_bytes_cut
        model.figures["recovered_in_flight"] += sp.recovery.working_found
        live: dict[str, tuple[str, ...]] = {}
        for entry in sp.list():
            if entry.msg_id in live or len(set(entry.recipients)) != len(entry.recipients):
                model.violations.append(f"{where}: {entry.msg_id} listed twice")
            live[entry.msg_id] = entry.recipients
            if entry.held is not None:
                sp.release(entry.msg_id)
                model.figures["released_held"] += 1
        for msg_id, rcpts in live.items():
            if msg_id not in model.accepted:
                # Durable, but the kill came before the child wrote its acknowledgement.
                model.accepted[msg_id] = rcpts
                model.figures["accepts_durable_unacknowledged"] += 1
        for msg_id, rcpts in model.accepted.items():
            queued = live.get(msg_id, ())
            for r in rcpts:
                key = (msg_id, r)
                if key in model.settled:
                    if r in queued:
                        model.violations.append(f"{where}: settled {key} is queued again")
                    continue
                places = (r in queued) + (key in logged)
                if places != 1:
                    model.violations.append(f"{where}: {key} is in {places} places")
                elif key in logged:
                    if key not in model.intents:
                        model.violations.append(f"{where}: {key} settled with no intent")
                    model.settle(key, "log", where)
                    model.figures["settlements_durable_unacknowledged"] += 1
        handed: set[tuple[str, str]] = set()
        while (attempt := sp.claim()) is not None:
            with attempt:
                for r in attempt.envelope.recipients:
                    key = (attempt.msg_id, r)
                    if key in model.settled or key in handed:
                        model.violations.append(f"{where}: {key} handed out again")
                    if key in model.intents:
                        model.figures["attempted_twice"] += 1
                    if r not in model.accepted.get(attempt.msg_id, ()):
                        model.violations.append(f"{where}: {key} was never accepted")
                    handed.add(key)
                attempt.delivered(attempt.envelope.recipients, "250 2.0.0 ok")
        for key in handed:
            model.settle(key, "checker", where)
        model.intents.clear()
        left = list(sp.list())
        if left:
            model.violations.append(f"{where}: queued but not handed out: {left[:3]}")
    unsettled = sum(
        1 for m, rcpts in model.accepted.items() for r in rcpts if (m, r) not in model.settled
    )
    if unsettled:
        model.violations.append(f"{where}: {unsettled} accepted recipients are nowhere")
    report = check_spool(spool_dir)
    if not report.clean:
        model.violations.append(f"{where}: spool check: {report.problems}")


def run_torture(tmp_path: Path, kills: int, seed: int, recovery_share: float) -> Model:
    spool_dir, acks = str(tmp_path / "spool"), tmp_path / "acks"
    acks.touch()
    rng = random.Random(seed)
    model = Model()
    open_times: list[float] = [0.01]
    with open(tmp_path / "children.stderr", "wb") as stderr:
        server = ForkServer(stderr)
        try:
            done = cycle = 0
            while done < kills and not model.violations:
                cycle += 1
                server.send(f"load {spool_dir} {acks} {rng.randrange(10**9)}")
                server.wait_for("pid ")
                opened = server.wait_for("running")
                open_times.append(float(opened.split()[1]))
                time.sleep(rng.uniform(0.01, 0.2))
                server.kill()
                done += 1
                model.figures["kills"] += 1
                if done < kills and rng.random() < recovery_share:
                    # Kill the next owner while it is still recovering from that kill.
                    server.send(f"load {spool_dir} {acks} {rng.randrange(10**9)}")
                    server.wait_for("opening")
                    typical = sorted(open_times)[len(open_times) // 2]
                    time.sleep(rng.uniform(0.0, typical))
                    during = server.kill()
                    done += 1
                    model.figures["kills"] += 1
                    model.figures["kills_during_recovery"] += during
                model.read_acks(acks)
                check_and_drain(spool_dir, model, cycle)
        finally:
            server.close()
    model.figures["messages_checked"] = len(model.accepted)
    model.figures["recipients_checked"] = sum(len(r) for r in model.accepted.values())
    model.figures["violations"] = len(model.violations)
    stderr_text = (tmp_path / "children.stderr").read_text()
    assert "load child failed" not in stderr_text, stderr_text
    return model


def test_kills_under_load_lose_nothing_and_never_repeat_a_settled_recipient(
    tmp_path: Path,
) -> None:
    kills = int(os.environ.get("SPOOL_TORTURE_KILLS", "200"))
    model = run_torture(tmp_path, kills, seed=20240611, recovery_share=0.2)
    figures = dict(sorted(model.figures.items()))
    print(f"\ntorture: {json.dumps(figures)}")
    report_dir = os.environ.get("SPOOL_REPORT_DIR")
    if report_dir:
        Path(report_dir).mkdir(parents=True, exist_ok=True)
        Path(report_dir, "torture.json").write_text(json.dumps(figures, indent=2) + "\n")
    assert not model.violations, model.violations[:20]
    assert model.figures["kills"] >= kills
    assert model.figures["recipients_checked"] > kills, "the child did too little work to check"
