"""The restart backoff of ``ProcessGroup`` (supervisor.py), with real child processes and
the look's clock given by the test: a child that dies is restarted after 1 s, then 2, 4,
... up to 60 s; one that lived a minute starts the count again; one that exits 0 (its
``max_use`` done) is replaced at once."""

from __future__ import annotations

import sys

from spool.supervisor import BACKOFF_FIRST, STABLE_AFTER, ProcessGroup, Slot


class Children(ProcessGroup):
    kind = "child"

    def __init__(self) -> None:
        super().__init__(1)
        self.status = 3

    def _command(self) -> list[str]:
        return [sys.executable, "-c", f"raise SystemExit({self.status})"]


def _exited(slot: Slot) -> None:
    assert slot.process is not None
    slot.process.wait(timeout=30)


def _started(group: Children, slot: Slot, now: float) -> bool:
    before = slot.process
    group._tend(slot, now)
    return slot.process is not None and slot.process is not before


def test_a_child_that_dies_is_restarted_after_a_doubling_backoff_up_to_a_minute() -> None:
    group = Children()
    [slot] = group.slots
    now = 0.0
    assert _started(group, slot, now)
    waits = []
    for _ in range(9):
        _exited(slot)
        group._tend(slot, now)  # the look that finds it dead
        wait = slot.next_start - now
        waits.append(wait)
        assert not _started(group, slot, now + wait - 0.01)
        now += wait
        assert _started(group, slot, now)
    assert waits == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert group.restarts == slot.restarts == 9
    _exited(slot)
    # One that lived a minute before it died starts the count again.
    group._tend(slot, slot.started + STABLE_AFTER)
    assert slot.next_start - (slot.started + STABLE_AFTER) == BACKOFF_FIRST


def test_a_child_that_exits_0_is_replaced_at_once_and_resets_the_backoff() -> None:
    group = Children()
    [slot] = group.slots
    assert _started(group, slot, 0.0)
    _exited(slot)
    group._tend(slot, 0.0)
    assert slot.backoff == 2 * BACKOFF_FIRST  # one death
    group.status = 0  # the next child does its work and leaves
    assert _started(group, slot, 1.0)
    _exited(slot)
    group._tend(slot, 1.5)  # replaced in the same look that found it gone, backoff reset
    assert slot.process is not None and slot.started == 1.5
    assert slot.backoff == BACKOFF_FIRST and slot.restarts == 2
    _exited(slot)
