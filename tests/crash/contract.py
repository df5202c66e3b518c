"""The contract checker: open a crash state, observe it, and judge it against the ledger.

``observe`` opens the spool (that is recovery), lists the queue, closes, runs the spool's
own consistency check, walks the log independently of the queue view to find every live
envelope (two live envelopes of one message would mean a double delivery), reopens and
lists again. ``judge`` compares the observation with what the workload had been told
before the crash:

- every acknowledged accept is present: queued, or every recipient settled;
- an acknowledged delivered/failed recipient is never pending again;
- no recipient is lost (a recipient missing from a present message was being settled);
- no message appears that was never accepted, and none is live twice;
- ``spool.check`` finds no problem, and a second open sees the same queue.
"""

from __future__ import annotations

import attrs

from spool import Spool
from spool import records as rec
from spool.check import check_spool
from spool.fs import FileSystem
from spool.queue_view import walk
from spool.records import Position
from spool.testing import FakeClock
from tests.crash.workload import OPTIONS, RETRY, START_TIME, Ledger

LiveQueue = dict[str, tuple[tuple[str, ...], bool]]


@attrs.frozen
class Observation:
    """What a crash state looks like after recovery (or the error that stopped it)."""

    error: str | None
    queue: LiveQueue
    reopened: LiveQueue
    log_live: dict[str, int]
    problems: tuple[str, ...]
    handed_out: list[tuple[str, tuple[str, ...]]] | None


def _queue(sp: Spool) -> LiveQueue:
    return {e.msg_id: (tuple(sorted(e.recipients)), e.held is not None) for e in sp.list()}


def live_envelopes(root: str) -> dict[str, int]:
    """Count, per message, envelopes that nothing later in the log supersedes."""
    envelopes: dict[Position, str] = {}
    superseded: set[Position] = set()
    finished: set[str] = set()
    for pos, record, _frame in walk(FileSystem(), root):
        if isinstance(record, rec.Envelope):
            envelopes[pos] = record.msg_id
            if record.supersedes is not None:
                superseded.add(record.supersedes)
        elif isinstance(record, rec.Start):
            superseded.add(record.envelope_at)
        elif isinstance(record, rec.Finish):
            finished.add(record.msg_id)
    counts: dict[str, int] = {}
    for pos, msg in envelopes.items():
        if pos not in superseded:
            counts[msg] = counts.get(msg, 0) + 1
    return counts


def observe(root: str, *, second_open: bool = True) -> Observation:
    """Recover the spool at ``root`` and describe it; failures become part of the result."""
    clock = FakeClock(START_TIME + 10**6)
    try:
        with Spool.open(root, clock=clock, **OPTIONS) as sp:
            queue = _queue(sp)
        report = check_spool(root)
        problems = tuple(f"{p.path}:{p.offset}: {p.what}" for p in report.problems)
        log_live = live_envelopes(root)
        reopened, handed_out = queue, None
        if second_open:
            with Spool.open(root, clock=clock, **OPTIONS) as sp:
                reopened = _queue(sp)
                clock.advance(max(RETRY) + 1)  # recovery's replacements come due too
                handed_out = _claim_all(sp)
    except Exception as exc:  # every failure is an observation; judge() says which are bad
        return Observation(f"{type(exc).__name__}: {exc}", {}, {}, {}, (), None)
    return Observation(None, queue, reopened, log_live, problems, handed_out)


def _claim_all(sp: Spool) -> list[tuple[str, tuple[str, ...]]]:
    """Claim everything due (the clock is past every retry interval) and read each body.

    Attempts stay open until nothing more is handed out, so a message with two live
    envelopes would come out twice; closing them at the end defers every recipient.
    """
    attempts = []
    while (attempt := sp.claim()) is not None:
        attempt.read_data()
        attempts.append(attempt)
    out = [(a.msg_id, tuple(sorted(a.envelope.recipients))) for a in attempts]
    for a in attempts:
        a.close()
    return out


def judge(obs: Observation, ledger: Ledger, prefix: int) -> list[str]:
    """Every way ``obs`` breaks the contract for a crash after ``prefix`` trace ops."""
    if obs.error is not None:
        return [f"recovery failed: {obs.error}"]
    bad: list[str] = [f"spool check: {p}" for p in obs.problems]
    accepted = ledger.accepted(prefix)
    issued = ledger.issued(prefix)
    acked = ledger.settled_acked(prefix)
    settling = ledger.settled_issued(prefix)
    if obs.reopened != obs.queue:
        bad.append(f"a second open sees another queue: {obs.queue} then {obs.reopened}")
    if obs.handed_out is not None:
        due = {m: p for m, (p, held) in obs.queue.items() if not held}
        got = dict(obs.handed_out)
        if len(got) != len(obs.handed_out):
            bad.append(f"a message was handed out twice at once: {obs.handed_out}")
        if got != due:
            bad.append(f"claim hands out {got}, but the queue holds {due} (stuck or extra mail)")
    for msg, n in obs.log_live.items():
        if n > 1:
            bad.append(f"{msg} has {n} live envelopes (would be attempted twice)")
    if set(obs.log_live) != set(obs.queue):
        bad.append(f"queue view {sorted(obs.queue)} != live envelopes {sorted(obs.log_live)}")
    for msg, (pending, _held) in obs.queue.items():
        if msg not in issued:
            bad.append(f"{msg} is queued but was never accepted")
            continue
        for r in pending:
            if (msg, r) in acked:
                bad.append(f"{msg} {r} was acknowledged settled but is pending again")
            if r not in issued[msg]:
                bad.append(f"{msg} {r} is pending but was never a recipient")
        for r in issued[msg]:
            if r not in pending and (msg, r) not in settling:
                bad.append(f"{msg} {r} was lost (not pending, never settled)")
    for msg, rcpts in accepted.items():
        if msg in obs.queue:
            continue
        lost = [r for r in rcpts if (msg, r) not in settling]
        if lost:
            bad.append(f"acknowledged message {msg} is gone with {lost} never settled")
    return bad


def judge_damaged(obs: Observation, ledger: Ledger, prefix: int) -> list[str]:
    """A state with a flipped durable byte: the damage must be reported (CorruptSpool from
    recovery or a later read, or a problem from the check), or be harmless (the contract
    holds as if nothing happened). Anything else is damage silently swallowed."""
    if obs.error is not None:
        if obs.error.startswith("CorruptSpool"):
            return []
        return [f"damage raised something other than CorruptSpool: {obs.error}"]
    if obs.problems:
        return []
    return judge(obs, ledger, prefix)
