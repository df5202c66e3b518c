"""The crash-state explorer: every prefix of a trace, every way its pending writes land.

For each prefix of a recorded workload's trace, ``CrashSimulator`` lists what was not yet
durable; the explorer enumerates every subset of it when it is small and a seeded sample
when it is not, builds each state, skips states already seen (by content digest), and
hands each new one to the contract checker. Four more layers build on that:

- *crashes during recovery*: a sample of the states is recovered under recording and the
  crash states of recovery's own writes are explored in turn (a power cut during
  recovery, then recovery again);
- *a kill, recovery, then a power cut*: at a sample of prefixes the owner is killed
  (``kill -9``: the page cache survives, so its un-synced writes are on disk but not yet
  durable), recovery runs on that, and power is then lost at every point of recovery's own
  writes and after it, with the dead owner's writes still pending unless recovery synced
  them (``RecordingFS.after_process_crash``);
- *flipped durable bytes*: a sample of states gets one flipped bit in the durable log,
  which must be reported, never cut or skipped;
- *repair*: those damaged states are then repaired (``spool check --repair``), observed,
  worked on and checked again (``contract.judge_repaired``).

Violations carry a reproducer.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator

import attrs
from crc32c import crc32c

from spool import Spool
from spool import format as fmt
from spool import records as rec
from spool.damage import _solve
from spool.framing import Frame, parse_frame
from spool.positions import decode_positions
from spool.records import Position
from spool.segment_header import segment_salt
from spool.testing import FakeClock
from spool.testing.crashsim import CrashSimulator, RecordingFS, TreeState, Unit
from tests.crash.contract import (
    frame_owner,
    judge,
    judge_damaged,
    judge_repaired,
    observe,
    observe_repaired,
)
from tests.crash.workload import START_TIME, TUNING, Ledger, Recorded, trace_features


@attrs.define
class Violation:
    """One crash state that breaks the contract, with what it takes to reproduce it."""

    workload: str
    seed: int
    steps: list[str]
    prefix: int
    last_ops: list[str]
    kept: list[str]
    problems: list[str]
    during: str = ""  # "a crash during recovery of ", "a power cut after a kill of ", ...

    def __str__(self) -> str:
        where = self.during
        return (
            f"{where}workload {self.workload} (seed {self.seed}, steps {self.steps}), "
            f"crash after trace op {self.prefix}; last ops {self.last_ops}; "
            f"pending units kept {self.kept}:\n  " + "\n  ".join(self.problems)
        )


@attrs.define
class ExploreReport:
    """What an exploration covered and found."""

    states: int = 0
    recovery_states: int = 0
    kill_states: int = 0
    damaged_states: int = 0
    repaired_states: int = 0
    features: set[str] = attrs.Factory(set)
    prefixes: int = 0
    violations: list[Violation] = attrs.Factory(list)


def scratch_base() -> str:
    """Where states are built: tmpfs when the machine has one (its fsyncs are real system
    calls, and cheap, which is what lets the suite check tens of thousands of states)."""
    return (
        "/dev/shm"
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
        else tempfile.gettempdir()
    )


@attrs.define
class Explorer:
    """Explores crash states of workloads; shares one 'seen' set across them."""

    seed: int
    exhaustive_max: int = 8
    samples: int = 24
    recovery_every: int = 0  # explore recovery's crashes for every n-th new state (0: never)
    kill_every: int = 0  # kill, recover, cut the power at about one prefix in n (0: never)
    damage_every: int = 0  # also check a copy with one flipped durable byte (0: never)
    repair: bool = False  # and repair each such copy, then check it again
    max_states: int | None = None
    stop_at_first: bool = False
    report: ExploreReport = attrs.Factory(ExploreReport)
    _seen: set[bytes] = attrs.Factory(set)
    # Aims one flipped-bit copy in four at a message id (its own stream: the other draws,
    # and so the states explored, are those of the explorer without it).
    _aim: random.Random = attrs.Factory(
        lambda self: random.Random(self.seed ^ 0xA1D), takes_self=True
    )

    def _states(
        self,
        sim: CrashSimulator,
        rng: random.Random,
        prefixes: range,
        exhaustive_max: int,
        samples: int,
    ) -> Iterator[tuple[int, tuple[Unit, ...], TreeState]]:
        """New crash states of ``sim`` at ``prefixes``: cheap key first, then content."""
        keys: set[tuple[int, frozenset[Unit]]] = set()
        for prefix in prefixes:
            self.report.prefixes += 1
            pending = sim.pending(prefix)
            for chosen in sim.states(
                prefix, exhaustive_max=exhaustive_max, samples=samples, rng=rng
            ):
                key = sim.key(prefix, chosen, pending)
                if key in keys:
                    continue
                keys.add(key)
                state = sim.build(prefix, chosen)
                digest = state.digest()
                if digest in self._seen:
                    continue
                self._seen.add(digest)
                yield prefix, chosen, state

    def _done(self) -> bool:
        if self.stop_at_first and self.report.violations:
            return True
        r = self.report
        total = r.states + r.recovery_states + r.kill_states  # damaged copies come on top
        return self.max_states is not None and total >= self.max_states

    def explore(self, recorded: Recorded) -> ExploreReport:
        """Check every new crash state of ``recorded`` against its ledger."""
        rng = random.Random(self.seed ^ recorded.seed)
        sim = CrashSimulator(recorded.trace)
        self.report.features |= trace_features(recorded.trace) | {f"workload {recorded.name}"}
        self.report.features |= {f"step {step}" for step in recorded.steps}
        work = tempfile.mkdtemp(prefix="spool-crash-", dir=scratch_base())
        try:
            everywhere = range(len(sim.trace) + 1)
            states = self._states(sim, rng, everywhere, self.exhaustive_max, self.samples)
            for n, (prefix, chosen, state) in enumerate(states):
                if self._done():
                    break
                self.report.states += 1
                problems = self._check(state, work, recorded.ledger, prefix)
                if problems:
                    self._violation(recorded, sim, prefix, chosen, problems)
                    continue
                if self.recovery_every and n % self.recovery_every == 0:
                    self._explore_recovery(recorded, state, work, prefix, rng)
                if self.damage_every and n % self.damage_every == 0:
                    self._check_damaged(recorded, sim, prefix, chosen, state, work, rng)
            if self.kill_every:
                for prefix in everywhere:
                    if self._done():
                        break
                    if rng.randrange(self.kill_every) == 0 and sim.pending(prefix):
                        self._explore_kill(recorded, prefix, work, rng)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return self.report

    def _check(
        self, state: TreeState, work: str, ledger: Ledger, prefix: int, *, damaged: bool = False
    ) -> list[str]:
        dest = os.path.join(work, "state")
        shutil.rmtree(dest, ignore_errors=True)
        state.write(dest)
        try:
            obs = observe(os.path.join(dest, "spool"))
            return judge_damaged(obs, ledger, prefix) if damaged else judge(obs, ledger, prefix)
        finally:
            shutil.rmtree(dest, ignore_errors=True)

    def _check_damaged(
        self,
        recorded: Recorded,
        sim: CrashSimulator,
        prefix: int,
        chosen: tuple[Unit, ...],
        state: TreeState,
        work: str,
        rng: random.Random,
    ) -> None:
        """Flip one byte of the durable log (media damage, not a crash): recovery and the
        tools must report it (CorruptSpool, or a problem from the check), never cut it as
        a torn tail or lose what is behind it."""

        def synced() -> dict[str, int]:
            # Built only for the one layer that needs it (the PAD headers): a second
            # state per damaged copy otherwise. It consumes no random numbers.
            durable = dict(sim.build(prefix, ()).files)
            return {
                path: len(data)
                for path, data in state.files
                if path in durable and data.startswith(durable[path])
            }

        if self.repair and self._aim.random() < CUT_SHARE:
            self._check_cut(recorded, sim, prefix, chosen, state, work)
            return
        damaged = flip_durable_byte(state, rng, self._aim, synced)
        if damaged is None:
            return
        flipped, path, offsets = damaged
        where = f"{path} byte{'s' if len(offsets) > 1 else ''} {', '.join(map(str, offsets))}"
        digest = flipped.digest()
        if digest in self._seen:
            return
        self._seen.add(digest)
        self.report.damaged_states += 1
        problems = self._check(flipped, work, recorded.ledger, prefix, damaged=True)
        if problems:
            self._violation(recorded, sim, prefix, chosen, [f"after flipping {where}", *problems])
            return
        if self.repair:
            # The second bit may land in the next frame: every frame hit counts.
            data = dict(state.files)[path]
            owners = tuple(dict.fromkeys(frame_owner(data, offset) for offset in offsets))
            problems = self._check_repair(flipped, work, recorded.ledger, prefix, owners)
            self.report.repaired_states += 1
            if problems:
                self._violation(
                    recorded,
                    sim,
                    prefix,
                    chosen,
                    [
                        f"after flipping {where} "
                        f"({'; '.join(f'{k} of {m or chr(45)}' for k, m in owners)})",
                        *problems,
                    ],
                    "spool check --repair of ",
                )

    def _check_cut(
        self,
        recorded: Recorded,
        sim: CrashSimulator,
        prefix: int,
        chosen: tuple[Unit, ...],
        state: TreeState,
        work: str,
    ) -> None:
        """A segment before the newest cut short or gone (``cut_durable_segment``): the
        repair must leave a spool that opens, is clean and stays so under more work, and
        keeps the contract for every message none of whose frames were in the lost
        bytes."""
        cut = cut_durable_segment(state, self._aim)
        if cut is None:
            return
        damaged, where, lost = cut
        digest = damaged.digest()
        if digest in self._seen:
            return
        self._seen.add(digest)
        self.report.features.add("segment cut short or missing")
        self.report.damaged_states += 1
        self.report.repaired_states += 1
        problems = self._check_repair(damaged, work, recorded.ledger, prefix, (("cut", ""),), lost)
        if problems:
            self._violation(
                recorded, sim, prefix, chosen, [where, *problems], "spool check --repair of "
            )

    def _check_repair(
        self,
        state: TreeState,
        work: str,
        ledger: Ledger,
        prefix: int,
        owners: tuple[tuple[str, str], ...],
        lost: frozenset[str] = frozenset(),
    ) -> list[str]:
        dest = os.path.join(work, "repair")
        shutil.rmtree(dest, ignore_errors=True)
        state.write(dest)
        try:
            obs = observe_repaired(os.path.join(dest, "spool"))
            return judge_repaired(obs, ledger, prefix, owners, lost)
        finally:
            shutil.rmtree(dest, ignore_errors=True)

    def _violation(
        self,
        recorded: Recorded,
        sim: CrashSimulator,
        prefix: int,
        chosen: tuple[Unit, ...],
        problems: list[str],
        during: str = "",
    ) -> None:
        ops = sim.trace.ops[max(0, prefix - 4) : prefix]
        self.report.violations.append(
            Violation(
                recorded.name,
                recorded.seed,
                recorded.steps,
                prefix,
                [op.describe() for op in ops],
                [u.describe(sim.trace) for u in chosen],
                problems,
                during,
            )
        )

    def _explore_recovery(
        self, recorded: Recorded, state: TreeState, work: str, prefix: int, rng: random.Random
    ) -> None:
        """Crash recovery itself: record an open of ``state``, explore that trace."""
        base = os.path.join(work, "recovering")
        shutil.rmtree(base, ignore_errors=True)
        state.write(base)
        fs = RecordingFS(base)
        try:
            with Spool.open(
                os.path.join(base, "spool"), fs=fs, clock=FakeClock(START_TIME + 10**6), **TUNING
            ):
                pass
        finally:
            shutil.rmtree(base, ignore_errors=True)
        sim = CrashSimulator(fs.trace)
        if any(op.kind == "write" for op in fs.trace.ops):
            self.report.features.add("recovery interrupted")
        for p, chosen, sub in self._states(sim, rng, range(1, len(fs.trace)), 4, 2):
            if self._done():
                return
            self.report.recovery_states += 1
            problems = self._check(sub, work, recorded.ledger, prefix)
            if problems:
                self._violation(recorded, sim, p, chosen, problems, "a crash during recovery of ")

    def _explore_kill(self, recorded: Recorded, prefix: int, work: str, rng: random.Random) -> None:
        """Kill the owner after ``prefix`` ops, recover, then cut the power at every point
        of recovery's writes and after it (the dead owner's writes still pending)."""
        base = os.path.join(work, "killed")
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(base)
        fs = RecordingFS.after_process_crash(recorded.trace, prefix, base)
        sim = CrashSimulator(fs.trace)
        try:
            with Spool.open(
                os.path.join(base, "spool"), fs=fs, clock=FakeClock(START_TIME + 10**6), **TUNING
            ):
                pass
        except Exception as exc:
            problem = f"recovery after a kill failed: {type(exc).__name__}: {exc}"
            self._violation(recorded, sim, prefix, (), [problem], "a kill of ")
            return
        finally:
            shutil.rmtree(base, ignore_errors=True)
        sim = CrashSimulator(fs.trace)
        self.report.features.add("kill, recovery, power cut")
        for p, chosen, sub in self._states(sim, rng, range(prefix, len(fs.trace) + 1), 4, 2):
            if self._done():
                return
            self.report.kill_states += 1
            problems = self._check(sub, work, recorded.ledger, prefix)
            if problems:
                during = "a power cut after recovery from a kill of "
                self._violation(recorded, sim, p, chosen, problems, during)


# The share of damaged copies whose damage is a segment cut short or gone instead: 0
# unless SPOOL_CRASH_CUT_SHARE says (docs/reliability.md: the repair does not yet keep the
# contract for every such copy; the layer measures how far it does).
CUT_SHARE = float(os.environ.get("SPOOL_CRASH_CUT_SHARE", "0"))


def cut_durable_segment(
    state: TreeState, rng: random.Random
) -> tuple[TreeState, str, frozenset[str]] | None:
    """A copy of ``state`` with a durable segment before the newest one cut short (at a
    frame's start, where nothing in the file shows the cut, or anywhere) or gone: what the
    fault model does not make (a synced file keeps its length), but a failed copy of a
    spool or a file system check can. The copy, what was done, and the messages a frame
    in the lost bytes belonged to: a cut at a batch's start that no later record names
    leaves no trace (no record says how long a segment was), so their records may be
    lost without a word; None if no such segment is durable."""
    files = dict(state.files)
    raw = files.get(os.path.join("spool", fmt.POSITIONS_NAME))
    positions = decode_positions(raw) if raw is not None else None
    if positions is None:
        return None
    log = os.path.join("spool", fmt.LOG_DIR, "")
    segments = sorted(
        p
        for p in files
        if p.startswith(log)
        and int(os.path.basename(p).split(".")[0]) < positions.consistent.segment
    )
    if not segments:
        return None
    path = rng.choice(segments)
    data = files[path]
    salt = segment_salt(data)
    frames: list[tuple[int, Frame]] = []
    pos = fmt.SEGMENT_HEADER_SIZE
    while pos < len(data) and isinstance(frame := parse_frame(data, pos, salt), Frame):
        frames.append((pos, frame))
        pos += frame.size
    how = rng.randrange(3)
    if how == 0 or not frames:
        cut, what = 0, f"deleted {path}"
        del files[path]
    else:
        cut = (
            rng.choice(frames)[0] if how == 1 else rng.randrange(fmt.SEGMENT_HEADER_SIZE, len(data))
        )
        what = f"cut {path} to {cut} of its {len(data)} bytes"
        files[path] = data[:cut]
    lost = {frame_owner(data, at)[1] for at, frame in frames if at + frame.size > cut}
    return TreeState(state.dirs, tuple(sorted(files.items()))), what, frozenset(lost - {""})


def _header_burst(data: bytes, limit: int, aim: random.Random) -> tuple[bytes, list[int]] | None:
    """A burst of four bytes over a durable segment header's last fields: (the damaged
    segment, the offsets it changed), or None if the header is not durable.

    One in four is random bytes anywhere from the segment number to the first frame's
    CRC (with a fresh segment's padding alone after it, the burst reaches into that PAD:
    a repair once read such a segment as unreadable records), half the time with a second
    burst over the open's padding that begins the segment. Two are the bursts that fit
    worst: the CRC field, or the salt field, set to the value that leaves the header one
    flipped bit (of another field) from consistent with a wrong salt, which a repair once
    took at its word, making every frame of the segment foreign. The last sets the salt
    or CRC field to all zeros or all ones, half the time with a bit of the first frame
    hit too: a guessable salt a repair once confirmed by any frame found further on."""
    if limit < fmt.SEGMENT_HEADER_SIZE + 4:
        return None
    out = bytearray(data)
    kind = aim.randrange(4)
    if kind == 3:
        # The bursts a bad sector leaves most: all zeros or all ones, over the salt or the
        # CRC field; half the time a bit of the first frame as well (a second place).
        field = aim.choice((24, 28))
        out[field : field + 4] = aim.choice((b"\0" * 4, b"\xff" * 4))
        if aim.random() < 0.5:
            at = aim.randrange(fmt.SEGMENT_HEADER_SIZE, min(limit, fmt.SEGMENT_HEADER_SIZE + 64))
            out[at] ^= 1 << aim.randrange(8)
    elif kind == 0:
        start = aim.randrange(16, fmt.SEGMENT_HEADER_SIZE + 1)
        for at in range(start, start + 4):
            out[at] = aim.randrange(256)
        first_type = fmt.SEGMENT_HEADER_SIZE + 8
        if aim.random() < 0.5 and limit >= fmt.SECTOR and data[first_type] == fmt.T_PAD:
            # And a second burst over the open's padding (its CRC, length, type or zeros):
            # a repair once named all the segment's mail for it, or took a forged salt.
            at = aim.randrange(fmt.SEGMENT_HEADER_SIZE, fmt.SECTOR - 3)
            out[at : at + 4] = aim.choice((b"\0" * 4, b"\xff" * 4, aim.randbytes(4)))
    elif kind == 1:
        head = bytearray(data[:28])
        bit = aim.randrange(28 * 8)
        head[bit // 8] ^= 1 << bit % 8
        out[28:32] = crc32c(bytes(head)).to_bytes(4, "little")
    else:
        head = bytearray(data[:24])
        bit = aim.randrange(24 * 8)
        head[bit // 8] ^= 1 << bit % 8
        crc = int.from_bytes(data[28:32], "little")
        salt = _solve(lambda x: crc32c(bytes(head) + x.to_bytes(4, "little")), crc)
        if salt is None:
            return None
        out[24:28] = salt.to_bytes(4, "little")
    offsets = [at for at in range(min(len(data), fmt.SECTOR)) if out[at] != data[at]]
    return (bytes(out), offsets) if offsets else None


# A message id in a record: CBOR text of 16 (0x70), 16 upper-case hex digits.
_ID_TEXT = re.compile(rb"\x70[0-9A-F]{16}")


def flip_durable_byte(
    state: TreeState,
    rng: random.Random,
    aim: random.Random | None = None,
    synced: Callable[[], dict[str, int]] | None = None,
) -> tuple[TreeState, str, tuple[int, ...]] | None:
    """A copy of ``state`` with one bit of a segment flipped inside the durable log (before
    the restart positions' ``consistent`` end), and half the time a second one a few bytes
    on; the file and the offsets flipped; None if nothing is durable.

    With ``aim``, one copy in four has its bits in a message id instead (the CBOR length
    byte before it, or its characters): the bytes by which a repair names what the damage
    cost, which a flip at random hits once in hundreds of copies; half of those, where the
    id has a second copy after it (its BODY frame's), a burst over the first and a byte of
    the second; one in sixteen an id left
    legible as no id at all (``_id_made_no_id``); one in sixteen two bits of a record's CRC
    (``_record_frames``); one in sixteen a burst of four damaged bytes in a row; and one in
    sixteen a START made unreadable with a frame after it hit too (``_start_and_after``):
    where a repair must note that a lost start used its envelope up, whatever the damage
    after it (a tiny body, padding, another record); and one in sixteen a burst over a
    PAD frame's header (``_pad_header_burst``), the one layer that also damages bytes
    synced after the positions (``synced`` gives each segment's synced length); and one
    in sixteen a burst over the segment header's salt and CRC (``_header_burst``); and one
    in sixteen bursts over two or three records of one message (``_one_messages_records``);
    and one in sixteen a burst in the synced zeros written ahead after the end of the
    newest segment's log (``_zeros_ahead_burst``), which once held every queued message."""
    files = dict(state.files)
    raw = files.get(os.path.join("spool", fmt.POSITIONS_NAME))
    positions = decode_positions(raw) if raw is not None else None
    if positions is None:
        return None
    end = positions.consistent
    candidates = []
    for path, data in state.files:
        if not path.startswith(os.path.join("spool", fmt.LOG_DIR, "")):
            continue
        seg = int(os.path.basename(path).split(".")[0])
        if seg < end.segment:
            limit = len(data)
        elif seg == end.segment:
            limit = min(len(data), end.offset)
        else:
            limit = 0
        if limit > 0:
            candidates.append((path, limit))
    if not candidates:
        return None
    path, limit = rng.choice(candidates)
    offset = rng.randrange(limit)
    bits = [rng.randrange(8)]
    offsets = [offset]
    if rng.random() < 0.5:
        # A second bit nearby (usually in the same frame, sometimes in the next): damage
        # no single bit explains, so the repair cannot simply set it right.
        offsets.append(min(limit - 1, offset + rng.randrange(1, 16)))
        bits.append(rng.randrange(8))
    aimed = aim.random() if aim is not None else 1.0
    if aim is not None and aimed < 0.25:
        ids = [m.start() for m in _ID_TEXT.finditer(files[path], 0, limit)]
        if ids:
            start = aim.choice(ids)  # the length byte; the id's 16 characters follow it
            offsets = sorted({start + aim.randrange(2), start + aim.randrange(1, 17)})
            text = files[path][start + 1 : start + 17]
            twin = files[path].find(text, start + 17, limit)  # its BODY frame's copy
            if twin != -1 and aim.random() < 0.5:
                # Every copy of the id hit: a burst over the record's, a byte of the
                # other's (a message once vanished unnamed, no copy of its id left whole).
                burst = start + 1 + aim.randrange(13)
                offsets = [*range(burst, burst + 4), twin + aim.randrange(16)]
            bits = [aim.randrange(8) for _ in offsets]
    elif aim is not None and aimed < 0.3125:
        # An id the damage left legible as no id at all (a NUL, a "/", a lower-case
        # letter; or empty, the record still decoding): what a repair may make a path of.
        ids = [m.start() for m in _ID_TEXT.finditer(files[path], 0, limit)]
        if ids:
            return _id_made_no_id(state, files, path, aim.choice(ids), aim)
    elif aim is not None and aimed < 0.375:
        # Two bits of a record's CRC, its payload intact: a record that still decodes but
        # checks with nothing (an operator's action in flight, a hold of queued mail).
        frames = _record_frames(files[path], limit)
        if frames:
            start = aim.choice(frames)
            offsets = sorted({start + aim.randrange(4), start + aim.randrange(4)})
            if len(offsets) == 1:
                offsets.append(start + (offsets[0] - start + 1) % 4)
            bits = [aim.randrange(8) for _ in offsets]
    elif aim is not None and aimed < 0.4375 and limit > 4:
        # A burst: one bit in each of four bytes in a row (a bad sector's worth of damage
        # in small), often across the boundary of two frames, which no one bit explains.
        start = aim.randrange(limit - 3)
        offsets = list(range(start, start + 4))
        bits = [aim.randrange(8) for _ in offsets]
    elif aim is not None and aimed < 0.5:
        found = _start_and_after(files[path], limit, aim)
        if found is not None:
            offsets, bits = found
    elif aim is not None and aimed < 0.5625:
        found = _pad_header_burst(files, end, synced() if synced else {}, aim)
        if found is not None:
            path, offsets, zeroed = found
            data = bytearray(files[path])
            for at in offsets:
                data[at] = 0 if zeroed else data[at] ^ 1 << aim.randrange(8)
            files[path] = bytes(data)
            return TreeState(state.dirs, tuple(sorted(files.items()))), path, tuple(offsets)
    elif aim is not None and aimed < 0.625:
        burst = _header_burst(files[path], limit, aim)
        if burst is not None:
            files[path], offsets = burst
            return TreeState(state.dirs, tuple(sorted(files.items()))), path, tuple(offsets)
    elif aim is not None and aimed < 0.6875:
        hit = _one_messages_records(files[path], limit, aim)
        if hit is not None:
            offsets = hit
            bits = [aim.randrange(8) for _ in offsets]
    elif aim is not None and aimed < 0.75:
        zeros = _zeros_ahead_burst(files, synced() if synced else {}, aim)
        if zeros is not None:
            path, offsets = zeros
            bits = [aim.randrange(8) for _ in offsets]
    data = bytearray(files[path])
    for at, bit in zip(offsets, bits, strict=True):
        data[at] ^= 1 << bit
    files[path] = bytes(data)
    return TreeState(state.dirs, tuple(sorted(files.items()))), path, tuple(offsets)


def _zeros_ahead_burst(
    files: dict[str, bytes], synced: dict[str, int], aim: random.Random
) -> tuple[str, list[int]] | None:
    """A run of one to four damaged bytes in the first sector of synced zeros after the
    last sector of the newest segment that holds anything (zeros written ahead, writer
    W6): (the segment, the offsets), or None if it has no such sector synced."""
    segments = sorted(p for p in files if p.startswith(os.path.join("spool", fmt.LOG_DIR, "")))
    if not segments:
        return None
    path = segments[-1]
    data = files[path][: synced.get(path, 0)]
    end = len(data.rstrip(b"\0"))
    end += -end % fmt.SECTOR
    if end == 0 or len(data) < end + fmt.SECTOR:
        return None
    first = end + aim.randrange(fmt.SECTOR - 3)
    return path, list(range(first, first + aim.randrange(1, 5)))


def _pad_header_burst(
    files: dict[str, bytes], end: Position, synced: dict[str, int], aim: random.Random
) -> tuple[str, list[int], bool] | None:
    """A burst of four bytes over a durable PAD frame's header: (the segment, the offsets,
    whether the bytes are zeroed rather than flipped), or None if no PAD is durable.

    A PAD header is durable before the positions' consistent end, or in bytes synced
    since (its whole batch was). Half the bursts zero their bytes, ending at the type
    byte: over a widened PAD (its header crossing into a sector of nothing else) that
    leaves a whole sector of zeros with valid frames after it, which recovery once cut
    as a torn tail. The rest flip a bit in each byte anywhere in the header (CRC and
    length hit together), which a repair once read as records, holding live mail; half
    of those with a second place in the same PAD frame, a bit or a burst of four bytes
    anywhere in it (two places in one PAD once held every message before it)."""
    pads = []
    for path, data in sorted(files.items()):
        if not path.startswith(os.path.join("spool", fmt.LOG_DIR, "")):
            continue
        seg = int(os.path.basename(path).split(".")[0])
        before = len(data) if seg < end.segment else end.offset if seg == end.segment else 0
        limit = min(len(data), max(before, synced.get(path, 0)))
        pads += [
            (path, pos, min(pos + size, limit))
            for pos, ftype, size in _frames(data, limit)
            if ftype == fmt.T_PAD and pos + fmt.FRAME_HEADER_SIZE <= limit
        ]
    if not pads:
        return None
    path, pos, pad_end = aim.choice(pads)
    zeroed = aim.random() < 0.5
    first = pos + fmt.FRAME_HEADER_SIZE - 4 if zeroed else pos + aim.randrange(6)
    offsets = list(range(first, first + 4))
    if not zeroed and aim.random() < 0.5:
        at = aim.randrange(pos, pad_end)
        offsets += range(at, min(at + aim.choice((1, 4)), pad_end))
    return path, sorted(set(offsets)), zeroed


# Bytes no id holds, for ``_id_made_no_id``: a NUL, a path separator, a lower-case letter.
_NO_ID_BYTES = b"\x00/g"


def _id_made_no_id(
    state: TreeState, files: dict[str, bytes], path: str, start: int, aim: random.Random
) -> tuple[TreeState, str, tuple[int, ...]]:
    """A copy of ``state`` in which the id whose CBOR length byte is at ``start`` reads as
    no id, the record around it still decoding: one character replaced by a byte no id
    holds; or, in a record whose map begins with it (``{"id": ...``), the id made empty
    and its 16 characters an extra entry of the same length (the map one entry longer)."""
    data = bytearray(files[path])
    header = start - 4
    empty = aim.random() < 0.5 and header >= 0 and data[header + 1 : start] == b"bid"
    if empty and 0xA0 <= data[header] < 0xB7:
        data[header] += 1
        data[start : start + 17] = b"\x60\x61x\x6d" + bytes(data[start + 1 : start + 14])
        files[path] = bytes(data)
        return TreeState(state.dirs, tuple(sorted(files.items()))), path, (header, start)
    at = start + 1 + aim.randrange(16)
    data[at] = aim.choice(_NO_ID_BYTES)
    files[path] = bytes(data)
    return TreeState(state.dirs, tuple(sorted(files.items()))), path, (at,)


def _record_frames(data: bytes, limit: int) -> list[int]:
    """Where the record frames (not padding, not bodies) of a segment start, before
    ``limit``; none if its header does not read."""
    return [pos for pos, ftype, _ in _frames(data, limit) if ftype not in (fmt.T_PAD, fmt.T_BODY)]


def _frames(data: bytes, limit: int) -> list[tuple[int, int, int]]:
    """(offset, type, size) of every whole frame of a segment before ``limit``; none if
    its header does not read."""
    if len(data) < fmt.SEGMENT_HEADER_SIZE:
        return []
    salt = segment_salt(data)
    found, pos = [], fmt.SEGMENT_HEADER_SIZE
    while pos < limit:
        frame = parse_frame(data, pos, salt)
        if not isinstance(frame, Frame) or pos + frame.size > limit:
            break
        found.append((pos, frame.type, frame.size))
        pos += frame.size
    return found


def _one_messages_records(data: bytes, limit: int, aim: random.Random) -> list[int] | None:
    """Offsets of a burst of four bytes over each of two or three record frames of one
    message (its envelope, start, deltas, finish, an operator's action, its outcome's
    acknowledgement), all at their CRC field (the payloads still decode), their middle,
    or near their end; None if no message has two records before ``limit``. What the
    reviews found repairs mishandle, a burst and a bit being too little: an acknowledged
    message's start and finish (a pin kept for ever), or its envelope, start and finish
    (restored held with its delivered recipients pending)."""
    if len(data) < fmt.SEGMENT_HEADER_SIZE:
        return None
    salt = segment_salt(data)
    frames: dict[str, list[tuple[int, int]]] = {}
    pos = fmt.SEGMENT_HEADER_SIZE
    while pos < limit:
        frame = parse_frame(data, pos, salt)
        if not isinstance(frame, Frame) or pos + frame.size > limit:
            break
        if frame.type not in (fmt.T_PAD, fmt.T_BODY):
            try:
                record = rec.decode(frame.type, frame.payload)
            except rec.RecordError:
                record = None
            if record is not None:
                owner = record.target if isinstance(record, rec.Control) else record.msg_id
                frames.setdefault(owner, []).append((pos, frame.size))
        pos += frame.size
    owners = sorted(m for m, found in frames.items() if m and len(found) >= 2)
    if not owners:
        return None
    mine = frames[aim.choice(owners)]
    hit = sorted(aim.sample(mine, min(len(mine), aim.choice((2, 3)))))
    where = aim.choice(("crc", "middle", "end"))
    offsets: list[int] = []
    for at, size in hit:
        start = at + {"crc": 0, "middle": size // 2, "end": max(0, size - 8)}[where]
        offsets += [o for o in range(start, start + 4) if o < min(at + size, limit)]
    return offsets


def _start_and_after(
    data: bytes, limit: int, aim: random.Random
) -> tuple[list[int], list[int]] | None:
    """Offsets and bits that make a START frame unreadable (bits of its length) and hit
    two bytes of one frame after it (a body, padding or a record, whatever is there)."""
    frames = _frames(data, limit)
    starts = [i for i, (_, ftype, _) in enumerate(frames) if ftype == fmt.T_START]
    if not starts:
        return None
    i = aim.choice(starts)
    at = frames[i][0]
    offsets, bits = [at + 4], [aim.choice((3, 4))]  # the length: no frame of that size fits
    if i + 1 < len(frames):
        pos, _, size = aim.choice(frames[i + 1 :])
        hit = sorted({pos + aim.randrange(size), pos + aim.randrange(size)})
        offsets += hit
        bits += [aim.randrange(8) for _ in hit]
    return offsets, bits
