"""Generated workloads for crash exploration, and the ledger of what they were told.

A workload is a seeded, random sequence of steps (accept, an attempt that delivers,
fails and defers, checkpoint, clock advance, hold, release, delete, retry-now, a clean
reopen) run single-threaded against a spool on a ``RecordingFS``. Every API call is
entered in a ``Ledger`` with the length of the I/O trace when it began and when it
returned, so that for a crash after any prefix of the trace we know exactly which calls
had been acknowledged and which had merely been issued. Different seeds give different
orders of operations (a rollover before or after a checkpoint, a deletion right after a
finish or much later), which is the point: a fixed order can hide a missing fsync.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import attrs

from spool import Spool
from spool.crashsim import RecordingFS, Trace
from spool.testing import FakeClock

# Spool options for every workload: small segments (rollovers and deletions happen after a
# few messages), small inline bodies (body files appear), no background timers (the trace
# must be deterministic: the workload calls checkpoint() itself).
RETRY = (60.0, 600.0)
OPTIONS: dict[str, Any] = {
    "segment_size": 3000,
    "inline_body_max": 900,
    "retry_intervals": RETRY,
    "max_lifetime": 10**7,
    "sync_every": 10**9,
    "sync_interval": 10**9,
    "checkpoint_interval": 10**9,
    "checkpoint_every": 10**9,
}
START_TIME = 1_800_000_000.0


@attrs.frozen
class Call:
    """One acknowledged-or-not API call: ``begin``/``end`` are trace lengths."""

    kind: str  # "accept" or "settle"
    msg_id: str
    recipients: tuple[str, ...]
    begin: int
    end: int


@attrs.define
class Ledger:
    """What the workload asked and was told, positioned in the trace."""

    calls: list[Call] = attrs.Factory(list)

    def accepted(self, prefix: int) -> dict[str, tuple[str, ...]]:
        """Messages whose accept returned before the crash (id -> recipients)."""
        return {
            c.msg_id: c.recipients for c in self.calls if c.kind == "accept" and c.end <= prefix
        }

    def issued(self, prefix: int) -> dict[str, tuple[str, ...]]:
        """Messages whose accept had begun (its writes may be on disk)."""
        return {
            c.msg_id: c.recipients for c in self.calls if c.kind == "accept" and c.begin < prefix
        }

    def settled_acked(self, prefix: int) -> set[tuple[str, str]]:
        """(msg, rcpt) reported delivered/failed, the call having returned."""
        return {
            (c.msg_id, r)
            for c in self.calls
            if c.kind == "settle" and c.end <= prefix
            for r in c.recipients
        }

    def settled_issued(self, prefix: int) -> set[tuple[str, str]]:
        """(msg, rcpt) whose delivered/failed report (or deletion) had begun."""
        return {
            (c.msg_id, r)
            for c in self.calls
            if c.kind == "settle" and c.begin <= prefix
            for r in c.recipients
        }


@attrs.define
class Recorded:
    """A finished workload: its trace, its ledger, and how to reopen its spool."""

    trace: Trace
    ledger: Ledger
    name: str
    seed: int
    steps: list[str]


STEPS = (
    "accept",
    "accept",
    "accept",
    "attempt",
    "attempt",
    "checkpoint",
    "advance",
    "hold",
    "release",
    "delete",
    "retry",
    "reopen",
)


# Named workloads: the seed picks one (seed % len), so every exploration mixes them.
MENUS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("accept-only", ("accept",)),
    ("accept-deliver-defer", ("accept", "accept", "attempt", "attempt", "advance")),
    ("rollover-checkpoint-delete", ("accept", "attempt", "attempt", "advance", "checkpoint")),
    ("operator-and-restart", ("accept", "attempt", "hold", "release", "delete", "retry", "reopen")),
    ("everything", STEPS),
)


def run_named(base: str, seed: int, n_steps: int) -> Recorded:
    """Run the named workload that ``seed`` picks."""
    name, menu = MENUS[seed % len(MENUS)]
    recorded = run_workload(base, seed, n_steps, menu=menu)
    recorded.name = name
    return recorded


def trace_features(trace: Trace) -> set[str]:
    """What a trace exercises, for the explorer's report (it must cover each of these)."""
    features = set()
    for op in trace.ops:
        name = op.path if op.kind != "rename" else op.dst
        if op.kind == "create" and name.endswith(".seg"):
            features.add("segment created")
        elif op.kind == "rename" and name.endswith("positions"):
            features.add("restart positions replaced")
        elif op.kind == "unlink" and name.endswith(".seg"):
            features.add("segment deleted")
        elif op.kind == "create" and "/bodies/" in name:
            features.add("body file written")
        elif op.kind == "unlink" and "/bodies/" in name:
            features.add("body file deleted")
    return features


def run_workload(base: str, seed: int, n_steps: int, *, menu: tuple[str, ...] = STEPS) -> Recorded:
    """Run a generated workload in ``base`` (empty) and return its trace and ledger."""
    rng = random.Random(seed)
    fs = RecordingFS(base)
    trace = fs.trace
    ledger = Ledger()
    clock = FakeClock(START_TIME)
    root = os.path.join(base, "spool")
    sp = Spool.open(root, fs=fs, clock=clock, **OPTIONS)
    steps: list[str] = []
    n_msg = 0

    def call(
        kind: str, msg: str, rcpts: tuple[str, ...], fn: Callable[..., Any], *args: Any
    ) -> Any:
        begin = len(trace)
        result = fn(*args)
        ledger.calls.append(Call(kind, msg or str(result), rcpts, begin, len(trace)))
        return result

    def live() -> list[Any]:
        return list(sp.list())

    for _ in range(n_steps):
        step = rng.choice(menu)
        steps.append(step)
        if step == "accept":
            n_msg += 1
            rcpts = tuple(f"r{i}@d{n_msg % 3}.example" for i in range(rng.randint(1, 3)))
            size = rng.choice((40, 300, 1200))
            data = bytes([65 + n_msg % 26]) * size
            call("accept", "", rcpts, sp.accept, "s@example.org", rcpts, data)
        elif step == "attempt":
            attempt = sp.claim()
            if attempt is None:
                continue
            with attempt:
                attempt.read_data()
                for r in attempt.envelope.recipients:
                    what = rng.choice(("delivered", "failed", "deferred", "deferred", "skip"))
                    if what == "delivered":
                        call("settle", attempt.msg_id, (r,), attempt.delivered, [r], "250 ok")
                    elif what == "failed":
                        call("settle", attempt.msg_id, (r,), attempt.failed, [r], "550 no")
                    elif what == "deferred":
                        attempt.deferred([r], "451 later")
        elif step == "checkpoint":
            sp.checkpoint()
        elif step == "advance":
            clock.advance(rng.choice(RETRY) + 1)
        elif step in ("hold", "release", "delete", "retry"):
            entries = live()
            if not entries:
                continue
            entry = rng.choice(entries)
            if step == "hold":
                sp.hold(entry.msg_id)
            elif step == "release":
                if entry.held is not None:
                    sp.release(entry.msg_id)
            elif step == "retry":
                sp.retry_now(entry.msg_id)
            else:
                call("settle", entry.msg_id, entry.recipients, sp.delete, entry.msg_id)
        elif step == "reopen":
            sp.close()
            sp = Spool.open(root, fs=fs, clock=clock, **OPTIONS)
    sp.close()
    return Recorded(trace, ledger, f"seed{seed}", seed, steps)
