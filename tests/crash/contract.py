"""The contract checker: open a crash state, observe it, and judge it against the ledger.

``observe`` opens the spool (that is recovery) naming no setting (the recorded ones must
apply, as for every CLI command), lists the queue, closes, runs the spool's own
consistency check, walks the log independently of the queue view to find every live
envelope (two live envelopes of one message would mean a double delivery), reopens,
lists again, claims everything due (reading each body), reads the body of every held
message (a release would hand it out) and takes every outcome handed out. ``judge``
compares the observation with what the workload had been told before the crash:

- every acknowledged accept is present: queued, or every recipient settled;
- an acknowledged delivered/failed recipient is never pending again;
- no recipient is lost (a recipient missing from a present message was being settled);
- no message appears that was never accepted, and none is live twice;
- ``spool.check`` finds no problem and no orphan body file (recovery removes those), and a
  second open sees the same queue;
- with outcomes tracked: no acknowledged outcome is handed out again, and every message
  that finished has its outcome handed out unless its acknowledgement had begun.

``observe_repaired`` and ``judge_repaired`` do the same for a state with a flipped
durable byte after ``spool check --repair``: the repair must leave a clean spool that
opens, keep every message it does not name exactly as the contract says, name only the
owner of the damaged frame when that frame was a body or padding, and never hand out a
message it names with an acknowledged recipient pending.
"""

from __future__ import annotations

import os
from collections import Counter

import attrs

from spool import Spool
from spool import format as fmt
from spool import records as rec
from spool.bodies import read_body
from spool.check import check_spool, repair_spool
from spool.damage import UNKNOWN_CHAR, fits_any
from spool.framing import Frame, parse_frame
from spool.fs import FileSystem
from spool.options import load_settings
from spool.positions import load_positions
from spool.queue_view import walk
from spool.reader import read_frame_at
from spool.records import Position
from spool.recovery import resolve_body
from spool.segment_header import check_segment_header, segment_salt
from spool.testing import FakeClock, deliver_all
from tests.crash.workload import START_TIME, TUNING, Ledger


def id_fits(partial: str, msg_id: str) -> bool:
    """Whether ``msg_id`` reads as ``partial`` wherever ``partial`` is not unknown (the
    repair's own test, ``damage.fits_any``)."""
    return fits_any({msg_id})(partial)


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
    outcomes: list[str] | None = None  # handed out after the reopen (outcomes tracked)
    orphans: tuple[str, ...] = ()  # body files no message names, after recovery and a close


def _queue(sp: Spool) -> LiveQueue:
    return {e.msg_id: (tuple(sorted(e.recipients)), e.held is not None) for e in sp.list()}


def live_envelopes(root: str) -> dict[str, int]:
    """Count, per message, envelopes that nothing later in the log supersedes."""
    envelopes: dict[Position, str] = {}
    superseded: set[Position] = set()
    for pos, record, _frame in walk(FileSystem(), root):
        if isinstance(record, rec.Envelope):
            envelopes[pos] = record.msg_id
            if record.supersedes is not None:
                superseded.add(record.supersedes)
        elif isinstance(record, rec.Start):
            superseded.add(record.envelope_at)
        elif isinstance(record, rec.Control) and record.action in (rec.DAMAGED, rec.USED_UP):
            superseded.update(record.sup)  # a repair recorded a lost start
    counts: dict[str, int] = {}
    for pos, msg in envelopes.items():
        if pos not in superseded:
            counts[msg] = counts.get(msg, 0) + 1
    return counts


def observe(root: str, *, second_open: bool = True) -> Observation:
    """Recover the spool at ``root`` and describe it; failures become part of the result."""
    clock = FakeClock(START_TIME + 10**6)
    try:
        with Spool.open(root, clock=clock, **TUNING) as sp:
            queue = _queue(sp)
        report = check_spool(root)
        problems = tuple(f"{p.path}:{p.offset}: {p.what}" for p in report.problems)
        orphans = report.orphan_bodies
        log_live = live_envelopes(root)
        reopened, handed_out, outcomes = queue, None, None
        if second_open:
            recorded = load_settings(FileSystem(), root).get("outcomes", False)
            with Spool.open(root, clock=clock, **TUNING) as sp:
                if recorded and not sp.options.outcomes:
                    raise AssertionError(
                        "the spool records outcomes=True, but an open that names no options "
                        "turned outcome tracking off"
                    )
                reopened = _queue(sp)
                clock.advance(sp.options.longest_interval + 1)  # recovery's come due too
                handed_out = _claim_all(sp)
                _read_held_bodies(sp)
                outcomes = _all_outcomes(sp) if sp.options.outcomes else None
    except Exception as exc:  # every failure is an observation; judge() says which are bad
        return Observation(f"{type(exc).__name__}: {exc}", {}, {}, {}, (), None)
    return Observation(None, queue, reopened, log_live, problems, handed_out, outcomes, orphans)


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


def _read_held_bodies(sp: Spool) -> None:
    """Read the body of every held message, as a release and a claim would: a held
    message whose body cannot be read is mail that no release can deliver (it raises)."""
    for entry in sp.list():
        if entry.held is None:
            continue
        frame = read_frame_at(FileSystem(), os.path.join(sp.path, fmt.LOG_DIR), entry.envelope_at)
        env = rec.decode(frame.type, frame.payload)
        assert isinstance(env, rec.Envelope)
        read_body(
            FileSystem(), sp.path, env.msg_id, resolve_body(env, entry.envelope_at, frame.size)
        )


def _all_outcomes(sp: Spool) -> list[str]:
    got = []
    while (outcome := sp.next_outcome(timeout=0)) is not None:
        got.append(outcome.msg_id)
    return got


def judge(
    obs: Observation,
    ledger: Ledger,
    prefix: int,
    exempt: frozenset[str] = frozenset(),
    repaired: bool = False,
    untraced: frozenset[str] = frozenset(),
) -> list[str]:
    """Every way ``obs`` breaks the contract for a crash after ``prefix`` trace ops.

    Messages in ``exempt`` (named by a repair) are left to ``judge_repaired``. Recovery
    removes orphan body files itself, unless damage a repair set aside may have held the
    envelope naming one (``repaired``). Messages in ``untraced`` lost records without a
    trace (a segment cut at a batch's start): nothing is asked of them, not even that the
    queue view and the claims agree on them (a finish gone leaves a start that the restart
    positions say was closed)."""
    if obs.error is not None:
        return [f"recovery failed: {obs.error}"]
    bad: list[str] = [f"spool check: {p}" for p in obs.problems]
    if obs.orphans and not repaired:
        bad.append(f"orphan body files left after recovery and a close: {list(obs.orphans)}")
    accepted = ledger.accepted(prefix)
    issued = ledger.issued(prefix)
    acked = ledger.settled_acked(prefix)
    settling = ledger.settled_issued(prefix)
    if obs.reopened != obs.queue:
        bad.append(f"a second open sees another queue: {obs.queue} then {obs.reopened}")
    if obs.handed_out is not None:
        due = {m: p for m, (p, held) in obs.queue.items() if not held and m not in untraced}
        got = {m: p for m, p in obs.handed_out if m not in untraced}
        if len({m for m, _ in obs.handed_out}) != len(obs.handed_out):
            bad.append(f"a message was handed out twice at once: {obs.handed_out}")
        if got != due:
            bad.append(f"claim hands out {got}, but the queue holds {due} (stuck or extra mail)")
    for msg, n in obs.log_live.items():
        if n > 1:
            bad.append(f"{msg} has {n} live envelopes (would be attempted twice)")
    if set(obs.log_live) - untraced != set(obs.queue) - untraced:
        bad.append(f"queue view {sorted(obs.queue)} != live envelopes {sorted(obs.log_live)}")
    for msg, (pending, _held) in obs.queue.items():
        if msg in exempt:
            continue
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
        if msg in obs.queue or msg in exempt:
            continue
        lost = [r for r in rcpts if (msg, r) not in settling]
        if lost:
            bad.append(f"acknowledged message {msg} is gone with {lost} never settled")
    if obs.outcomes is not None:
        bad.extend(_judge_outcomes(obs, ledger, prefix, exempt))
    return bad


def _judge_outcomes(
    obs: Observation, ledger: Ledger, prefix: int, exempt: frozenset[str]
) -> list[str]:
    assert obs.outcomes is not None
    bad = []
    if len(set(obs.outcomes)) != len(obs.outcomes):
        bad.append(f"an outcome was handed out twice: {obs.outcomes}")
    again = sorted(ledger.outcomes_acked(prefix) & set(obs.outcomes) - exempt)
    if again:
        bad.append(f"acknowledged outcomes handed out again: {again}")
    begun = ledger.outcomes_ack_issued(prefix)
    for msg in ledger.accepted(prefix):
        finished = msg not in obs.queue
        if finished and msg not in begun and msg not in obs.outcomes and msg not in exempt:
            bad.append(f"{msg} finished but its outcome is never handed out (a lost bounce)")
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


# --- repaired states -------------------------------------------------------------------


@attrs.frozen
class RepairedObservation:
    """A damaged state after ``spool check --repair``, observed, then worked on again."""

    error: str | None
    named: frozenset[str]
    fates: tuple[tuple[str, str], ...]
    problems_after: tuple[str, ...]
    observed: Observation | None
    problems_at_end: tuple[str, ...]
    # (message, statuses its finish gave) of each message whose body the repair lost
    lost_body_endings: tuple[tuple[str, tuple[str, ...]], ...] = ()


# The pin oracle (``pin_mismatches``) on every repaired state, after its more work: on
# since the million states of the long run passed with it (docs/reliability.md);
# SPOOL_CRASH_PIN_ORACLE=0 turns it off (tests/contract/test_repair_pins.py pins the class).
PIN_ORACLE = os.environ.get("SPOOL_CRASH_PIN_ORACLE", "1") != "0"


def observe_repaired(root: str) -> RepairedObservation:
    """Repair, observe (open, list, check, reopen, claim), then deliver everything due in
    a third open and check once more: the repair must hold up under more work."""
    try:
        report = repair_spool(root)
    except Exception as exc:
        return RepairedObservation(
            f"repair: {type(exc).__name__}: {exc}", frozenset(), (), (), None, ()
        )
    named = frozenset(m for m, _ in report.fates) | {a.msg_id for a in report.before.affected}
    after = tuple(f"{p.path}:{p.offset}: {p.what}" for p in report.after.problems)
    lost = {m for m, fate in report.fates if fate.startswith("its body was lost")}
    endings = _endings(root, lost) if lost else ()
    obs = observe(root)
    try:
        clock = FakeClock(START_TIME + 10**7)
        with Spool.open(root, clock=clock, **TUNING) as sp:
            deliver_all(sp)
        end = tuple(f"{p.path}:{p.offset}: {p.what}" for p in check_spool(root).problems)
        Spool.open(root, **TUNING).close()
        if PIN_ORACLE:
            end += tuple(
                f"segment {seg} pinned {pinned} times, its live inline bodies need {needed}"
                for seg, (pinned, needed) in pin_mismatches(root).items()
            )
    except Exception as exc:
        end = (f"after more work: {type(exc).__name__}: {exc}",)
    return RepairedObservation(None, named, report.fates, after, obs, end, endings)


def _endings(root: str, msg_ids: set[str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The statuses each finish record of ``msg_ids`` gives its recipients."""
    found: list[tuple[str, tuple[str, ...]]] = []
    try:
        for _pos, record, _frame in walk(FileSystem(), root):
            if isinstance(record, rec.Finish) and record.msg_id in msg_ids:
                found.append((record.msg_id, tuple(o.status for o in record.outcomes)))
    except Exception as exc:
        found.append(("(walk)", (f"{type(exc).__name__}: {exc}",)))
    return tuple(found)


def judge_repaired(
    obs: RepairedObservation,
    ledger: Ledger,
    prefix: int,
    damaged: tuple[tuple[str, str], ...],
    lost: frozenset[str] = frozenset(),
) -> list[str]:
    """``damaged`` is (kind, message) of each frame the flipped bits hit, in the undamaged
    state (two bits a few bytes apart may hit two frames). ``lost``: messages whose every
    trace may be gone (a segment cut short or missing): exempt."""
    if obs.error is not None:
        return [obs.error]
    bad = [f"not clean after repair: {p}" for p in obs.problems_after]
    bad += [f"not clean after repair and more work: {p}" for p in obs.problems_at_end]
    kinds = {kind for kind, _ in damaged}
    bodies = {owner for kind, owner in damaged if kind == "body"}
    if kinds <= {"pad", "header"} and obs.named:
        what = "/".join(sorted(kinds))
        bad.append(f"damaged {what} touched no mail, but the repair named {sorted(obs.named)}")
    if kinds <= {"pad", "header", "body"} and bodies and not obs.named <= bodies:
        bad.append(f"a damaged body of {sorted(bodies)}, but the repair named {sorted(obs.named)}")
    for msg, statuses in obs.lost_body_endings:
        if rec.DELETED in statuses or not statuses:
            bad.append(
                f"{msg}: its body was lost and it ended {statuses}: no bounce tells its sender"
            )
    assert obs.observed is not None
    seen = obs.observed
    # A message whose every copy of its id was hit is named as its id reads ("?" where a
    # character may be wrong): it names each message whose frames the damage hit that it
    # fits (never one the damage did not touch: such a name may fit those too).
    partial = [m for m in obs.named if UNKNOWN_CHAR in m]
    owners = {owner for _kind, owner in damaged if owner}
    named = obs.named | {m for m in owners if any(id_fits(p, m) for p in partial)}
    exempt = named | lost | {owner for kind, owner in damaged if kind == "control"}
    bad += judge(seen, ledger, prefix, exempt=frozenset(exempt), repaired=True, untraced=lost)
    acked = ledger.settled_acked(prefix)
    for msg, rcpts in seen.handed_out or []:
        if msg in named and any((msg, r) in acked for r in rcpts):
            bad.append(f"{msg} (named by the repair) handed out with a settled recipient")
    return bad


def frame_owner(data: bytes, offset: int) -> tuple[str, str]:
    """(kind, message) of what lies at ``offset`` of a segment's bytes: ``header``, ``pad``,
    ``body`` or a record kind (``envelope``, ``start``, ...), and its message id."""
    number = int.from_bytes(data[16:24], "little")
    if offset < fmt.SEGMENT_HEADER_SIZE or check_segment_header(data, number, "") is not None:
        return "header", ""
    salt = segment_salt(data)
    pos = fmt.SEGMENT_HEADER_SIZE
    while pos < len(data):
        frame = parse_frame(data, pos, salt)
        if not isinstance(frame, Frame):
            return "unknown", ""
        if pos <= offset < pos + frame.size:
            if frame.type == fmt.T_PAD:
                return "pad", ""
            if frame.type == fmt.T_BODY:
                return "body", rec.decode_body(frame.payload)[0]
            record = rec.decode(frame.type, frame.payload)
            target = record.target if isinstance(record, rec.Control) else record.msg_id
            return fmt.TYPE_NAMES[frame.type], target
        pos += frame.size
    return "unknown", ""


def pin_mismatches(root: str) -> dict[int, tuple[int, int]]:
    """Segments whose body pin in the restart positions differs from what the live mail
    needs, as (pinned, needed): each live message whose envelope names an inline body
    needs one pin on the segment that holds it (its finish or promotion releases it). An
    undercount lets a checkpoint delete a live body's segment; an overcount keeps that
    segment, and every one after it, for ever. Meant for a spool closed cleanly (its
    positions written at the close, no attempt in flight)."""
    fs = FileSystem()
    positions = load_positions(fs, root)
    pinned = {seg: n for seg, n in (positions.body_refs if positions else {}).items() if n}
    bodies: dict[str, int] = {}
    for pos, record, frame in walk(fs, root):
        if isinstance(record, rec.Envelope):
            assert frame is not None
            body = resolve_body(record, pos, frame.size)
            if body.kind == rec.BODY_INLINE and body.at is not None:
                bodies[record.msg_id] = body.at.segment
            else:
                bodies.pop(record.msg_id, None)
        elif isinstance(record, rec.Finish):
            bodies.pop(record.msg_id, None)
        elif isinstance(record, rec.Control) and record.action == rec.OUTCOME_ACK:
            bodies.pop(record.target, None)  # (its finish was lost: R6 writes it again)
    needed = Counter(bodies.values())
    return {
        seg: (pinned.get(seg, 0), needed.get(seg, 0))
        for seg in sorted(set(pinned) | set(needed))
        if pinned.get(seg, 0) != needed.get(seg, 0)
    }
