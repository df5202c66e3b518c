"""The awaitable in-process calls (``AsyncSpool``): durable on return like the blocking
forms, sharing one group commit, and never blocking the event loop on an fsync."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from pathlib import Path

import pytest

from spool import AsyncSpool, Spool, SpoolFailed
from spool.fs import FileSystem
from spool.testing import FaultFS
from spool.testing.crashsim import CrashSimulator, RecordingFS

BODY = b"Subject: hello\r\n\r\nhi\r\n"


def test_every_accept_that_returned_survives_a_power_cut_right_after(tmp_path: Path) -> None:
    # Concurrent accepts on one loop; the power is cut the moment the last returned: the
    # state keeps only what was durable, and every returned id must be in it.
    fs = RecordingFS(str(tmp_path / "w"))

    async def run() -> tuple[list[str], int]:
        sp = await AsyncSpool.open(tmp_path / "w" / "spool", fs=fs, inline_body_max=1000)
        ids = await asyncio.gather(
            *(sp.accept("a@example.org", [f"r{i}@example.net"], BODY + b"x" * (i * 20))
              for i in range(100))
        )  # fmt: skip
        cut = len(fs.trace)  # power cut here: before close writes anything more
        await sp.close()
        return ids, cut

    ids, cut = asyncio.run(run())
    CrashSimulator(fs.trace).build(cut, []).write(str(tmp_path / "state"))
    with Spool.open(tmp_path / "state" / "spool") as sp:
        assert {e.msg_id for e in sp.list()} == set(ids)


def test_concurrent_accepts_share_fsyncs(tmp_path: Path) -> None:
    async def run() -> tuple[int, int]:
        async with await AsyncSpool.open(tmp_path / "spool") as sp:
            await asyncio.gather(
                *(sp.accept("a@example.org", ["b@example.net"], BODY) for _ in range(200))
            )
            s = await sp.statistics()
            return s.accepted, s.batches

    accepted, batches = asyncio.run(run())
    assert accepted == 200 and batches < 200


class SlowSyncFS(FileSystem):
    """fdatasync takes a quarter of a second: a loop that blocked on it would stall."""

    def fdatasync(self, fd: int) -> None:
        super().fdatasync(fd)
        time.sleep(0.25)


def test_waiting_for_the_disk_never_blocks_the_event_loop(tmp_path: Path) -> None:
    async def run() -> int:
        sp = await AsyncSpool.open(tmp_path / "spool", fs=SlowSyncFS())
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = ticks
        await sp.accept("a@example.org", ["b@example.net"], BODY)
        ran = ticks - before
        done.set()
        await task
        await sp.close()
        return ran

    # A quarter of a second of fsync: the ticker ran meanwhile (a blocked loop: 0 ticks).
    assert asyncio.run(run()) >= 5


def test_a_message_is_claimed_delivered_failed_and_deferred_awaitably(tmp_path: Path) -> None:
    async def run() -> None:
        sp = await AsyncSpool.open(tmp_path / "spool", retry_intervals=(3600.0,))
        assert await sp.claim() is None
        msg = await sp.accept("a@example.org", ["b@x.example", "c@x.example", "d@x.example"], BODY)
        attempt = await sp.claim(timeout=5)
        assert attempt is not None and attempt.msg_id == msg
        async with attempt:
            assert await attempt.read_data() == BODY
            await attempt.delivered(["b@x.example"], "250 ok")
            await attempt.failed(["c@x.example"], "550 5.1.1 no such user")
            await attempt.deferred(["d@x.example"], "451 4.4.1 later")
        assert await sp.claim() is None  # deferred for an hour
        (entry,) = await sp.list()
        assert entry.recipients == ("d@x.example",)
        await sp.close()

    asyncio.run(run())
    with Spool.open(tmp_path / "spool") as sp:  # what was reported is durable
        (entry,) = sp.list()
        assert entry.recipients == ("d@x.example",) and entry.attempts == 1


def test_a_waiting_claim_gets_mail_accepted_meanwhile_and_a_body_file(tmp_path: Path) -> None:
    async def run() -> None:
        sp = await AsyncSpool.open(tmp_path / "spool", inline_body_max=100)
        started = asyncio.get_running_loop().time()
        assert await sp.claim(timeout=0.2) is None
        assert asyncio.get_running_loop().time() - started >= 0.2
        big = b"y" * 5000  # its own file: written in a thread

        async def later() -> str:
            await asyncio.sleep(0.1)
            return await sp.accept("a@example.org", ["b@example.net"], big)

        accepting = asyncio.create_task(later())
        attempt = await sp.claim(timeout=10)
        assert attempt is not None and attempt.msg_id == await accepting
        async with attempt:
            assert await attempt.read_data() == big
            await attempt.delivered(["b@example.net"], "250 ok")
        await sp.close()

    asyncio.run(run())
    with Spool.open(tmp_path / "spool") as sp:
        assert list(sp.list()) == []


def test_a_failed_write_fails_the_awaiting_accept(tmp_path: Path) -> None:
    fs = FaultFS()

    async def run() -> None:
        sp = await AsyncSpool.open(tmp_path / "spool", fs=fs)
        await sp.accept("a@example.org", ["b@example.net"], BODY)
        fs.fail("fdatasync", err=errno.EIO)
        with pytest.raises(SpoolFailed):
            await sp.accept("a@example.org", ["c@example.net"], BODY)
        with pytest.raises(SpoolFailed):  # sticky, as in process
            await sp.accept("a@example.org", ["d@example.net"], BODY)

    asyncio.run(run())


def test_operator_actions_and_bad_input_awaitably(tmp_path: Path) -> None:
    from spool import InvalidAddress

    async def run() -> None:
        async with await AsyncSpool.open(tmp_path / "spool") as sp:
            with pytest.raises(InvalidAddress):
                await sp.accept("a@example.org", ["not an address"], BODY)
            msg = await sp.accept("a@example.org", ["b@example.net"], BODY)
            await sp.hold(msg, "looks odd")
            assert [e.held for e in await sp.list()] == ["looks odd"]
            await sp.release(msg)
            await sp.delete(msg)
            assert await sp.list() == []
            await sp.sync()

    asyncio.run(run())


def test_cancelled_waiters_leave_the_writer_and_every_other_caller_working(
    tmp_path: Path,
) -> None:
    # Found by an adversarial review: a cancelled await (a timeout, a client gone) left a
    # cancelled future in the writer's list; completing it raised InvalidStateError in the
    # flusher thread, which died: other waiters hung, a blocking accept raised, close too.
    import threading

    async def run() -> None:
        sp = await AsyncSpool.open(tmp_path / "spool", fs=SlowSyncFS())
        waiting = asyncio.create_task(sp.accept("a@example.org", ["b@example.net"], BODY))
        for i in range(5):  # each cancelled while its fsync runs
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(
                    sp.accept("a@example.org", [f"c{i}@example.net"], BODY), 0.01
                )
        assert await asyncio.wait_for(waiting, 10)
        assert sp.spool._state.writer._flusher.is_alive()
        blocking: list[str] = []
        thread = threading.Thread(
            target=lambda: blocking.append(sp.spool.accept("a@example.org", ["d@x.example"], BODY))
        )
        thread.start()
        await asyncio.wait_for(sp.accept("a@example.org", ["e@example.net"], BODY), 10)
        await asyncio.to_thread(thread.join, 10)
        assert len(blocking) == 1
        await sp.close()

    asyncio.run(run())
    with Spool.open(tmp_path / "spool") as sp:  # the cancelled accepts were staged: kept
        assert len(list(sp.list())) == 8


def test_a_waiting_claim_is_woken_by_the_spool_not_by_a_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The spool's condition wakes the loop (a listener), so an awaited claim needs no
    # thread and no polling: with the longest look between wakes set to a minute, mail
    # accepted by another thread is still handed out at once, and a claim that waits
    # for nothing holds no thread.
    import threading

    from spool import async_spool

    monkeypatch.setattr(async_spool, "CLAIM_LOOK_MAX", 60.0)

    async def run() -> tuple[str | None, str, int, int]:
        async with await AsyncSpool.open(tmp_path / "spool") as sp:
            assert await sp.claim(timeout=0.1) is None  # registers the loop's listener
            threads = threading.active_count()
            waiting = asyncio.ensure_future(sp.claim(timeout=30))
            await asyncio.sleep(0.3)
            during = threading.active_count()
            msg_id = await asyncio.to_thread(sp.spool.accept, "a@example.org", ["b@e.net"], BODY)
            attempt = await asyncio.wait_for(waiting, 20)
            got = None if attempt is None else attempt.msg_id
            if attempt is not None:
                await attempt.close()
            return got, msg_id, threads, during

    got, msg_id, before, during = asyncio.run(run())
    assert got == msg_id
    assert during == before, "a waiting claim started a thread"


def test_loops_that_are_done_leave_no_listener_behind(tmp_path: Path) -> None:
    # Found by review: each loop an AsyncSpool claimed on left a listener on the spool's
    # condition for good (a new loop per call: thousands, each called on every batch).
    async def one(sp: AsyncSpool) -> None:
        await sp.accept("a@example.org", ["b@example.net"], BODY)
        attempt = await sp.claim(timeout=1)
        assert attempt is not None
        await attempt.delivered(["b@example.net"], "250 ok")
        await attempt.close()
        assert await sp.claim(timeout=0.05) is None

    spool = Spool.open(tmp_path / "spool")
    try:
        shared = AsyncSpool(spool)
        for _ in range(30):
            asyncio.run(one(shared))
        assert spool._state.cond.listeners == []
    finally:
        spool.close()


def test_a_claim_waiting_when_the_spool_closes_ends_with_spool_closed(tmp_path: Path) -> None:
    # The close wakes the loop's waiting claims; each ends with SpoolClosed and the last
    # takes the loop's listener away.
    from spool import SpoolClosed

    async def run() -> None:
        sp = await AsyncSpool.open(tmp_path / "spool")
        waiting = [asyncio.ensure_future(sp.claim(timeout=30)) for _ in range(3)]
        await asyncio.sleep(0.2)
        await sp.close()
        for claim in waiting:
            with pytest.raises(SpoolClosed):
                await asyncio.wait_for(claim, 10)
        assert sp.spool._state.cond.listeners == []

    asyncio.run(run())


class HeldBodyFS(FileSystem):
    """Opening a body file in ``incoming/`` waits (once ``hold`` is set) until ``go``:
    a large accept's worker thread held while its task is cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.hold, self.held, self.go = threading.Event(), threading.Event(), threading.Event()

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        if self.hold.is_set() and f"{os.sep}incoming{os.sep}" in path:
            self.held.set()
            assert self.go.wait(30)
        return super().open(path, flags, mode)


def test_a_claim_waiting_sees_the_message_of_a_cancelled_large_accept(tmp_path: Path) -> None:
    """Review of the flusher left asleep: an accept of a body in a file of its own stages
    in a worker thread; cancelled there (aiosmtpd cancels the DATA handler when the client
    hangs up), the thread queued the envelope anyway, nobody waited for it and the flusher
    was not woken: a claim already waiting saw the message only at its timeout (5 s)."""
    fs = HeldBodyFS()

    async def run() -> float:
        sp = await AsyncSpool.open(tmp_path / "spool", fs=fs, sync_interval=0.05,
                                   inline_body_max=1000)  # fmt: skip
        claimed: list[object] = []
        took: list[float] = []

        def claimer() -> None:
            started = time.monotonic()
            claimed.append(sp.spool.claim(timeout=5.0))
            took.append(time.monotonic() - started)

        thread = threading.Thread(target=claimer)
        thread.start()
        await asyncio.sleep(0.2)  # the claim waits: nothing is queued
        fs.hold.set()
        task = asyncio.create_task(sp.accept("a@example.org", ["b@example.net"], b"x" * 4096))
        await asyncio.to_thread(fs.held.wait, 30)  # the body is being written in a thread
        task.cancel()
        fs.go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.to_thread(thread.join, 30)
        assert claimed and claimed[0] is not None
        claimed[0].close()  # type: ignore[attr-defined]
        await sp.close()
        return took[0]

    took = asyncio.run(run())
    # 0.05-0.1 s here; the idle flusher's look (IDLE_LOOK, 1 s) alone would be later.
    assert took < 0.9, f"the waiting claim saw the message only after {took:.2f} s"
