"""Generated workloads for crash exploration, and the ledger of what they were told.

A workload is a seeded, random sequence of steps (accept, an attempt that delivers,
fails and defers, an attempt left open across later steps, checkpoint, clock advance,
hold, release, delete, retry-now, operator calls with bad arguments, outcome
acknowledgements in random order, a clean reopen with other options) run single-threaded
against a spool on a ``RecordingFS``. Every acknowledged API call is entered in a
``Ledger`` with the length of the I/O trace when it began and when it returned, so that
for a crash after any prefix of the trace we know exactly which calls had been
acknowledged and which had merely been issued. Different seeds give different orders of
operations (a rollover before or after a checkpoint, a deletion right after a finish or
much later), which is the point: a fixed order can hide a missing fsync.

Reopens vary the options the way operators and embedders do: naming nothing (the spool's
recorded settings apply, as for every CLI command), naming outcome tracking, turning the
archive on or off, changing the retry classes. Observers (``contract.observe``) open
naming no setting at all, so a setting the spool forgot would show.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import attrs

from spool import Attempt, Spool
from spool.errors import SpoolMisuse, UnknownMessage
from spool.testing import FakeClock
from spool.testing.crashsim import RecordingFS, Trace

# The spool's settings for every workload: small segments (rollovers and deletions happen
# after a few messages), small inline bodies (body files appear). Recorded in the spool.
RETRY = (60.0, 600.0)
RETRY_OTHER = (30.0, 300.0, 900.0)
SETTINGS: dict[str, Any] = {
    "segment_size": 3000,
    "inline_body_max": 900,
    "retry_intervals": RETRY,
    "max_lifetime": 10**7,
}
# This process's tuning: no background timers (the trace must be deterministic: the
# workload calls checkpoint() itself). Never recorded: every opener names it.
TUNING: dict[str, Any] = {
    "sync_every": 10**9,
    "sync_interval": 10**9,
    "checkpoint_interval": 10**9,
    "checkpoint_every": 10**9,
    # One sector of zeros written ahead (writer W6), not a megabyte cut at the segment
    # size: the same states of zeros past the log's end, overwritten, capped and cut, with
    # a sixth of the pending sectors to choose among.
    "write_ahead": 512,
}
OPTIONS: dict[str, Any] = {**SETTINGS, **TUNING}
START_TIME = 1_800_000_000.0
ARCHIVE = "../archive"  # relative to the spool directory: inside the recorded tree


@attrs.frozen
class Call:
    """One acknowledged-or-not API call: ``begin``/``end`` are trace lengths."""

    kind: str  # "accept", "settle" or "ack" (an outcome acknowledgement)
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

    def outcomes_acked(self, prefix: int) -> set[str]:
        """Messages whose outcome acknowledgement returned before the crash."""
        return {c.msg_id for c in self.calls if c.kind == "ack" and c.end <= prefix}

    def outcomes_ack_issued(self, prefix: int) -> set[str]:
        """Messages whose outcome acknowledgement had begun (it may be durable)."""
        return {c.msg_id for c in self.calls if c.kind == "ack" and c.begin < prefix}


@attrs.define
class Recorded:
    """A finished workload: its trace, its ledger, and how to reopen its spool."""

    trace: Trace
    ledger: Ledger
    name: str
    seed: int
    steps: list[str]
    outcomes: bool = False


STEPS = (
    "accept",
    "accept",
    "accept",
    "attempt",
    "attempt",
    "open-attempt",
    "finish-open",
    "checkpoint",
    "advance",
    "hold",
    "release",
    "delete",
    "bounce",
    "retry",
    "bad-operator",
    "outcomes",
    "reopen",
)


# Named workloads: the seed picks one (seed % len), so every exploration mixes them. The
# flag says whether the workload tracks outcomes (opened with outcomes=True once).
MENUS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("accept-only", ("accept",), False),
    ("accept-deliver-defer", ("accept", "accept", "attempt", "attempt", "advance"), False),
    (
        "rollover-checkpoint-delete",
        ("accept", "attempt", "attempt", "advance", "checkpoint"),
        False,
    ),
    (
        "operator-and-restart",
        (
            "accept",
            "attempt",
            "hold",
            "release",
            "delete",
            "bounce",
            "retry",
            "reopen",
            "bad-operator",
        ),
        False,
    ),
    (
        "attempts-open-across-checkpoints",
        ("accept", "accept", "open-attempt", "finish-open", "attempt", "checkpoint", "advance"),
        False,
    ),
    (
        "outcomes-and-reopens",
        ("accept", "attempt", "attempt", "outcomes", "reopen", "checkpoint", "open-attempt"),
        True,
    ),
    ("everything", STEPS, False),
    ("everything-with-outcomes", STEPS, True),
)


# Scripted workloads: a fixed order of steps that reaches a state the menus reach only
# rarely (the seed still picks recipients and what an open attempt reports).
# "slow-attempt-across-rollover": a message (its body in a file, so no inline body pins
# its segment) is deferred; later mail fills its segment, rolls the log over and is
# delivered; then its retry starts, in a later segment, and stays open across
# checkpoints: the garbage front must keep the segment of the envelope that attempt
# started from (G1), though everything else in it is done (retired segments are
# archived here, so the menus' deletions and this script's archiving both occur).
# "acknowledged-out-of-order": with outcome tracking, the newer of two outcomes is
# acknowledged, the older not; after a restart the outcome reader reads past the
# acknowledged one while the older holds the outcome front back, and a checkpoint and
# another restart follow: the acknowledged outcome must never come back.
# "held-after-a-deferral": a small message (its body inline) is deferred once its first
# segment is full, so its replacement, in the next segment, names the body in the first;
# it is then held, which copies the body to a file (a promotion) and frees the first
# segment, which a checkpoint deletes. Damage to the hold's envelope (the flipped-byte
# layer) must leave a message that a release can deliver: the repair names the copy.
SCRIPTS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    (
        "held-after-a-deferral",
        (
            "accept-small",
            *("accept-medium",) * 3,
            "defer",
            *("deliver",) * 3,
            "hold",
            "checkpoint",
            *("accept-medium", "deliver") * 2,
            "checkpoint",
            "release",
            "advance-all",
            "attempt",
        ),
        False,
    ),
    (
        "acknowledged-out-of-order",
        (
            *("accept", "deliver") * 2,
            "ack-newest",
            "reopen",
            "peek-outcomes",
            "checkpoint",
            "accept",
            "deliver",
            "checkpoint",
            "reopen",
            "peek-outcomes",
        ),
        True,
    ),
    (
        "slow-attempt-across-rollover",
        (
            "accept-large",
            "defer",
            "reopen-archive",
            *("accept-large", "deliver") * 4,
            "checkpoint",
            "advance-all",
            "open-attempt",
            *("accept-large", "deliver") * 2,
            "checkpoint",
            "finish-open",
            "checkpoint",
        ),
        False,
    ),
)


def run_named(base: str, seed: int, n_steps: int) -> Recorded:
    """Run the named workload that ``seed`` picks (a menu of ``n_steps``, or a script)."""
    pick = seed % (len(MENUS) + len(SCRIPTS))
    if pick >= len(MENUS):
        name, script, outcomes = SCRIPTS[pick - len(MENUS)]
        recorded = run_workload(base, seed, len(script), script=script, outcomes=outcomes)
    else:
        name, menu, outcomes = MENUS[pick]
        recorded = run_workload(base, seed, n_steps, menu=menu, outcomes=outcomes)
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
        elif op.kind == "rename" and name.endswith("settings"):
            features.add("settings replaced")
        elif op.kind == "unlink" and name.endswith(".seg"):
            features.add("segment deleted")
        elif op.kind == "rename" and "archive" in name:
            features.add("segment archived")
        elif op.kind == "create" and "/incoming/" in name:
            features.add("body file written")
        elif op.kind == "rename" and "/bodies/" in name:
            features.add("body file moved to bodies/")
        elif op.kind == "unlink" and ("/bodies/" in name or "/incoming/" in name):
            features.add("body file deleted")
    return features


def reopen_options(rng: random.Random, outcomes: bool) -> dict[str, Any]:
    """The settings a reopen names: often none (the recorded ones apply)."""
    choice = rng.choice(
        ["inherit", "inherit", "outcomes", "archive", "no-archive", "other-retry", "retry"]
    )
    return {
        "inherit": {},
        "outcomes": {"outcomes": outcomes},  # named, unchanged: on stays on, off stays off
        "archive": {"archive_dir": ARCHIVE},
        "no-archive": {"archive_dir": None},
        "other-retry": {"retry_intervals": RETRY_OTHER},
        "retry": {"retry_intervals": RETRY},
    }[choice]


BAD_OPERATOR_CALLS: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("hold", (5,)),
    ("hold", (None,)),
    ("hold", ("",)),
    ("hold", ("x" * 5000,)),
    ("hold", ("bad\ud800text",)),
    ("delete", (b"gone",)),
    ("delete", ("€" * 2000,)),
    ("bounce", (None,)),
    ("release", ()),
)


class _Workload:
    """The state of one running workload (module docstring)."""

    def __init__(self, base: str, seed: int, outcomes: bool) -> None:
        self.rng = random.Random(seed)
        # Its own stream, so that the choices of ``rng`` (and the states each seed reaches,
        # which the broken spools' favoured seeds rely on) are as before it was added.
        self.crash_rng = random.Random(seed ^ 0x5EED)
        self.fs = RecordingFS(base)
        self.trace = self.fs.trace
        self.ledger = Ledger()
        self.clock = FakeClock(START_TIME)
        self.root = os.path.join(base, "spool")
        self.outcomes = outcomes
        self.sp = Spool.open(self.root, fs=self.fs, clock=self.clock, outcomes=outcomes, **OPTIONS)
        self.open: list[tuple[Attempt, set[str]]] = []  # with the recipients reported
        self.n_msg = 0

    def call(
        self, kind: str, msg: str, rcpts: tuple[str, ...], fn: Callable[..., Any], *args: Any
    ) -> Any:
        begin = len(self.trace)
        result = fn(*args)
        self.ledger.calls.append(Call(kind, msg or str(result), rcpts, begin, len(self.trace)))
        return result

    def step(self, step: str) -> None:
        getattr(self, "do_" + step.replace("-", "_"))()

    def do_accept(self) -> None:
        self._accept(self.rng.choice((40, 300, 1200)))

    def do_accept_small(self) -> None:
        self._accept(40)

    def do_accept_medium(self) -> None:
        """An accept whose body is inline and fills about a third of a segment."""
        self._accept(800)

    def do_accept_large(self) -> None:
        """An accept whose body goes to a file (over ``inline_body_max``)."""
        self._accept(1200)

    def _accept(self, size: int) -> None:
        self.n_msg += 1
        n = self.n_msg
        rcpts = tuple(f"r{i}@d{n % 3}.example" for i in range(self.rng.randint(1, 3)))
        data = bytes([65 + n % 26]) * size
        self.call("accept", "", rcpts, self.sp.accept, "s@example.org", rcpts, data)

    def report(self, attempt: Attempt, rcpts: tuple[str, ...], only: str | None = None) -> set[str]:
        """Report each of ``rcpts`` delivered, failed, deferred or not at all (or each
        ``only`` so); the reported."""
        done = set()
        for r in rcpts:
            what = only or self.rng.choice(("delivered", "failed", "deferred", "deferred", "skip"))
            if what == "delivered":
                self.call("settle", attempt.msg_id, (r,), attempt.delivered, [r], "250 ok")
            elif what == "failed":
                self.call("settle", attempt.msg_id, (r,), attempt.failed, [r], "550 5.1.1 no")
            elif what == "deferred":
                attempt.deferred([r], "451 4.3.0 later")
            if what != "skip":
                done.add(r)
        return done

    def do_attempt(self) -> None:
        attempt = self.sp.claim()
        if attempt is None:
            return
        attempt.read_data()
        self.report(attempt, attempt.envelope.recipients)
        self.close(attempt)

    def do_deliver(self) -> None:
        """An attempt that delivers every recipient."""
        self._attempt_all("delivered")

    def do_defer(self) -> None:
        """An attempt that defers every recipient (the message moves to a retry class)."""
        self._attempt_all("deferred")

    def _attempt_all(self, what: str) -> None:
        attempt = self.sp.claim()
        if attempt is None:
            return
        self.report(attempt, attempt.envelope.recipients, what)
        self.close(attempt)

    def do_open_attempt(self) -> None:
        """Claim and report some recipients, but leave the attempt open for later steps."""
        attempt = self.sp.claim()
        if attempt is None:
            return
        rcpts = attempt.envelope.recipients
        reported = self.report(attempt, rcpts[: self.rng.randint(0, len(rcpts) - 1)])
        self.open.append((attempt, reported))

    def do_finish_open(self) -> None:
        if not self.open:
            return
        attempt, reported = self.open.pop(self.rng.randrange(len(self.open)))
        self.report(attempt, tuple(r for r in attempt.envelope.recipients if r not in reported))
        self.close(attempt)

    def close(self, attempt: Attempt) -> None:
        """Close an attempt; one in four as if its worker process had died
        (``close_crashed``: a crash count, and a crash-loop hold at the limit)."""
        if self.crash_rng.random() < 0.25:
            attempt.close_crashed()
        else:
            attempt.close()

    def do_checkpoint(self) -> None:
        self.sp.checkpoint()

    def do_advance_all(self) -> None:
        """Move the clock past every retry interval: all deferred mail is due."""
        self.clock.advance(self.sp.options.longest_interval + 1)

    def do_advance(self) -> None:
        self.clock.advance(self.rng.choice(self.sp.options.retry_intervals) + 1)

    def _entry(self) -> Any:
        entries = list(self.sp.list())
        return self.rng.choice(entries) if entries else None

    def do_hold(self) -> None:
        if (entry := self._entry()) is not None:
            self.sp.hold(entry.msg_id, self.rng.choice(["held", "€ quarantine " * 30]))

    def do_release(self) -> None:
        entry = self._entry()
        if entry is not None and entry.held is not None:
            self.sp.release(entry.msg_id)

    def do_retry(self) -> None:
        if (entry := self._entry()) is not None:
            self.sp.retry_now(entry.msg_id)

    def do_delete(self) -> None:
        self._end(self.sp.delete)

    def do_bounce(self) -> None:
        self._end(self.sp.bounce)

    def _end(self, action: Any) -> None:
        """An operator delete or bounce: the pending recipients are settled (deleted or
        failed) when it returns, in flight too (a control record recovery applies)."""
        entry = self._entry()
        if entry is None:
            return
        self.call("settle", entry.msg_id, entry.recipients, action, entry.msg_id)

    def do_bad_operator(self) -> None:
        """Operator calls with bad arguments: a typed error, and not one operation traced."""
        entry = self._entry()
        action, args = self.rng.choice(BAD_OPERATOR_CALLS)
        msg_id: Any = entry.msg_id if entry is not None else "0000000000000000"
        if action == "release":
            msg_id = self.rng.choice([5, None, b"6B49D20054D06D28"])
        before = len(self.trace)
        try:
            getattr(self.sp, action)(msg_id, *args)
        except (SpoolMisuse, UnknownMessage):
            pass
        else:
            raise AssertionError(f"{action}({msg_id!r}, {args!r}) was accepted")
        assert len(self.trace) == before, f"a refused {action} wrote to the disk"

    def do_ack_newest(self) -> None:
        """Take the outcomes handed out and acknowledge only the newest (out of order)."""
        handed = self._take_outcomes()
        if handed:
            self.call("ack", handed[-1], (), self.sp.ack_outcome, handed[-1])

    def do_peek_outcomes(self) -> None:
        """Take the outcomes handed out (reading past the acknowledged) and acknowledge none."""
        self._take_outcomes()

    def _take_outcomes(self) -> list[str]:
        handed: list[str] = []
        if self.sp.options.outcomes:
            while (outcome := self.sp.next_outcome(timeout=0)) is not None:
                handed.append(outcome.msg_id)
        return handed

    def do_outcomes(self) -> None:
        """Take the outcomes handed out and acknowledge some, in random order."""
        if not self.sp.options.outcomes:
            return
        handed = self._take_outcomes()
        self.rng.shuffle(handed)
        for msg_id in handed[: self.rng.randint(0, len(handed))]:
            self.call("ack", msg_id, (), self.sp.ack_outcome, msg_id)

    def do_reopen_archive(self) -> None:
        """Reopen with retired segments going to an archive instead of being deleted."""
        self.shut()
        self.sp = Spool.open(self.root, fs=self.fs, clock=self.clock, **TUNING, archive_dir=ARCHIVE)

    def do_reopen(self) -> None:
        self.shut()
        options = reopen_options(self.rng, self.outcomes)
        self.sp = Spool.open(self.root, fs=self.fs, clock=self.clock, **TUNING, **options)

    def shut(self) -> None:
        """Close the spool: open attempts are closed (deferred)."""
        self.sp.close()
        self.open.clear()


def run_workload(
    base: str,
    seed: int,
    n_steps: int,
    *,
    menu: tuple[str, ...] = STEPS,
    outcomes: bool = False,
    script: tuple[str, ...] | None = None,
) -> Recorded:
    """Run a generated workload in ``base`` (empty) and return its trace and ledger: steps
    drawn from ``menu``, or those of ``script`` in order."""
    work = _Workload(base, seed, outcomes)
    steps: list[str] = []
    for k in range(n_steps):
        step = script[k] if script is not None else work.rng.choice(menu)
        steps.append(step)
        work.step(step)
    work.shut()
    return Recorded(work.trace, work.ledger, f"seed{seed}", seed, steps, outcomes)
