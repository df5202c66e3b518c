"""The workloads: what one timed trial does to one system.

Each workload runs for a fixed time rather than a fixed count, so a slow peer does not
stretch the whole benchmark; the rate is messages completed divided by elapsed time.

* ``accept``: ``threads`` producers accept the same message durably in a loop.
* ``lifecycle``: ``threads`` workers each accept a message and claim one, deliver two
  recipients and defer the third; when time is up the first attempts are drained, the
  clock moves past the retry interval, and the deferred recipients are delivered. The
  rate counts whole lifecycles (accept to finish) over the whole time, drain included.
* ``enqueue_then_drain``: one thread accepts for the trial's time, then claims every
  message in turn, delivers two recipients and defers the third; the clock moves past the
  retry interval and the retries are delivered. Rate as for ``lifecycle``.
* ``raw_fdatasync``: the raw limit of one durable appender: ``write`` a record of the
  message's size and ``fdatasync``, in a loop, one thread.
* ``raw_bandwidth``: sequential buffered appends of the same records with one
  ``fdatasync`` at the end: the rate no durable queue on this disk can beat.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from spool.testing import FakeClock
from tools.bench.systems import RETRY_INTERVAL, Message, QueueSystem


@dataclass(frozen=True)
class TrialResult:
    """What one trial measured: messages completed, seconds, sync calls counted in process."""

    messages: int
    seconds: float
    fsyncs: int | None
    # The trial process's CPU (user and system, all threads) over the workload, from
    # ``time.process_time``: set by the child around the whole workload call.
    cpu_seconds: float | None = None

    @property
    def rate(self) -> float:
        """Messages per second."""
        return self.messages / self.seconds if self.seconds > 0 else 0.0


def _run_threads(threads: int, target: Callable[[int], None]) -> float:
    """Run ``target(i)`` in ``threads`` threads started together; return elapsed seconds.

    An exception in any thread is re-raised here, so a broken system fails the trial
    instead of looking fast.
    """
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads + 1)

    def body(i: int) -> None:
        barrier.wait()
        try:
            target(i)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    barrier.wait()
    started = time.perf_counter()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return elapsed


def accept(system: QueueSystem, msg: Message, threads: int, seconds: float) -> TrialResult:
    """Durable accept from ``threads`` producers for about ``seconds``."""
    counts = [0] * threads
    fsyncs_before = system.counted_fsyncs()
    deadline = time.perf_counter() + seconds

    def producer(i: int) -> None:
        n = 0
        while time.perf_counter() < deadline:
            system.accept(msg)
            n += 1
        counts[i] = n

    elapsed = _run_threads(threads, producer)
    return TrialResult(sum(counts), elapsed, _fsyncs_since(system, fsyncs_before))


def _fsyncs_since(system: QueueSystem, before: int | None) -> int | None:
    after = system.counted_fsyncs()
    return None if after is None or before is None else after - before


def _split(pending: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The scripted remote MTA: all but the last pending recipient are delivered on the
    first attempt, the last is deferred; a lone recipient is delivered."""
    if len(pending) > 1:
        return list(pending[:-1]), list(pending[-1:])
    return list(pending), []


def lifecycle(
    system: QueueSystem, clock: FakeClock, msg: Message, threads: int, seconds: float
) -> TrialResult:
    """The full lifecycle with ``threads`` workers (see the module docstring)."""
    accepted = [0] * threads
    finished = [0] * threads
    fsyncs_before = system.counted_fsyncs()
    deadline = time.perf_counter() + seconds

    def attempt_one(i: int) -> bool:
        claimed = system.claim()
        if claimed is None:
            return False
        delivered, deferred = _split(claimed.recipients)
        system.end_attempt(claimed, delivered, deferred)
        if not deferred:
            finished[i] += 1
        return True

    def worker(i: int) -> None:
        while time.perf_counter() < deadline:
            system.accept(msg)
            accepted[i] += 1
            attempt_one(i)

    def drain(i: int) -> None:
        while attempt_one(i):
            pass

    elapsed = _run_threads(threads, worker)
    elapsed += _run_threads(threads, drain)  # first attempts left over
    clock.advance(RETRY_INTERVAL + 1.0)
    elapsed += _run_threads(threads, drain)  # the retries, now due
    if sum(finished) != sum(accepted):
        raise RuntimeError(f"{system.name}: {sum(accepted)} accepted but {sum(finished)} finished")
    return TrialResult(sum(accepted), elapsed, _fsyncs_since(system, fsyncs_before))


def enqueue_then_drain(
    system: QueueSystem, clock: FakeClock, msg: Message, seconds: float
) -> TrialResult:
    """One thread: accept for ``seconds``, then drain the first attempts, then the retries."""
    fsyncs_before = system.counted_fsyncs()
    accepted = finished = 0
    started = time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        system.accept(msg)
        accepted += 1
    for retries in (False, True):
        if retries:
            clock.advance(RETRY_INTERVAL + 1.0)
        while (claimed := system.claim()) is not None:
            delivered, deferred = _split(claimed.recipients)
            system.end_attempt(claimed, delivered, deferred)
            finished += not deferred
    elapsed = time.perf_counter() - started
    if finished != accepted:
        raise RuntimeError(f"{system.name}: {accepted} accepted but {finished} finished")
    return TrialResult(accepted, elapsed, _fsyncs_since(system, fsyncs_before))


def raw_fdatasync(directory: str, record: bytes, seconds: float) -> TrialResult:
    """``write`` + ``fdatasync`` of ``record`` in a loop, appending to one file."""
    path = os.path.join(directory, "raw-sync")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    n = 0
    try:
        started = time.perf_counter()
        deadline = started + seconds
        while time.perf_counter() < deadline:
            os.write(fd, record)
            os.fdatasync(fd)
            n += 1
        elapsed = time.perf_counter() - started
    finally:
        os.close(fd)
        os.unlink(path)
    return TrialResult(n, elapsed, n)


def raw_bandwidth(directory: str, record: bytes, seconds: float) -> TrialResult:
    """Buffered sequential appends of ``record`` for ``seconds``, then one fdatasync."""
    path = os.path.join(directory, "raw-bandwidth")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    batch = record * max(1, (1 << 20) // len(record))  # about 1 MiB per write call
    per_batch = len(batch) // len(record)
    n = 0
    try:
        started = time.perf_counter()
        deadline = started + seconds
        while time.perf_counter() < deadline:
            os.write(fd, batch)
            n += per_batch
        os.fdatasync(fd)
        elapsed = time.perf_counter() - started
    finally:
        os.close(fd)
        os.unlink(path)
    return TrialResult(n, elapsed, 1)


def raw_overwrite(directory: str, record: bytes, seconds: float) -> TrialResult:
    """``pwrite`` + ``fdatasync`` of ``record`` into a file written in advance.

    Not the issue's raw limit (that one appends, as a log does) but the one SQLite's WAL
    and recycled log segments enjoy: overwriting blocks that already exist needs no file
    size or extent change, so ``fdatasync`` need not wait for a journal commit.
    """
    path = os.path.join(directory, "raw-overwrite")
    size = 64 << 20
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    n = 0
    try:
        zeros = bytes(1 << 20)
        for off in range(0, size, len(zeros)):
            os.pwrite(fd, zeros, off)
        os.fsync(fd)
        started = time.perf_counter()
        deadline = started + seconds
        offset = 0
        while time.perf_counter() < deadline:
            if offset + len(record) > size:
                offset = 0
            os.pwrite(fd, record, offset)
            os.fdatasync(fd)
            offset += len(record)
            n += 1
        elapsed = time.perf_counter() - started
    finally:
        os.close(fd)
        os.unlink(path)
    return TrialResult(n, elapsed, n)
