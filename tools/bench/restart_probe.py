"""The restart benchmark's building blocks: build big queues, leave work in flight, reopen.

Two queues are compared, each with N messages queued and ``IN_FLIGHT`` in flight at a
crash:

* spool: a child opens the spool, claims ``IN_FLIGHT`` attempts, syncs so their start
  records are durable, and is killed with SIGKILL. Opening is then recovery.
* file per message (Exim-style queue run): a child moves ``IN_FLIGHT`` queue files from
  ``incoming/`` to ``active/`` (Postfix's qmgr does this) and is killed. Opening moves
  ``active/`` back (rename each, fsync the directory) and lists ``incoming/`` to learn
  what is queued; the first claim then reads the first queue file.

The builds are not measured, so they skip syncs and end with one ``os.sync()``: what is
timed is the reopen, on a queue that is fully on disk (and, being just written, in the
page cache: these are warm restarts). The spool build claims one message (and defers it)
every ``CLAIM_EVERY`` accepts, as a live spool's workers would, so that the queue
runners keep up with the log the way they do in service.

Every spool here is opened with one retry interval (``RETRY_INTERVALS``), so two queue
runners: the restart cost measured is recovery, and one runner per extra retry class
would only add to the build (an idle runner reads every record the first claim after a
long accept-only period; see docs/performance.md).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from spool import Spool
from spool.fs import FileSystem
from tools.bench.systems import DEFERRED_REPLY, Message, parse_queue_file, render_queue_file

IN_FLIGHT = 100
RETRY_INTERVALS = (300.0,)
CLAIM_EVERY = 1000
WORK_AFTER_OPEN = 1000  # attempts run after the first claim, before peak RSS is read


class BuildFS(FileSystem):
    """The real file system without syncs: for building a big spool fast (one os.sync()
    at the end makes it durable). Never used for anything measured."""

    def fdatasync(self, fd: int) -> None:
        pass

    def fsync(self, fd: int) -> None:
        pass

    def fsync_dir(self, path: str) -> None:
        pass


def peak_rss_kib() -> int:
    """This process's peak resident set size (VmHWM), in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


# --- building -------------------------------------------------------------------------


def grow_spool(path: str, have: int, want: int, msg: Message) -> None:
    """Accept ``want - have`` more messages into the spool at ``path``."""
    sp = Spool.open(path, fs=BuildFS(), retry_intervals=RETRY_INTERVALS, checkpoint_interval=3600.0)
    try:
        for i in range(want - have):
            sp.accept(msg.sender, msg.recipients, msg.body)
            if i % CLAIM_EVERY == CLAIM_EVERY - 1:
                attempt = sp.claim()
                if attempt is not None:
                    attempt.close()  # deferred: the queue keeps its size
    finally:
        sp.close()
    os.sync()


def grow_files(path: str, have: int, want: int, msg: Message) -> None:
    """Write queue files ``have`` .. ``want - 1`` into ``path/incoming``."""
    incoming = os.path.join(path, "incoming")
    os.makedirs(incoming, exist_ok=True)
    os.makedirs(os.path.join(path, "active"), exist_ok=True)
    data = render_queue_file(msg)
    for i in range(have, want):
        fd = os.open(os.path.join(incoming, f"{i:012d}"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    os.sync()


# --- children: in flight at a crash -------------------------------------------------------


def _ready_and_wait() -> None:
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:  # the parent kills us with SIGKILL
        signal.pause()


def spool_hold(path: str, n: int) -> None:
    """Claim ``n`` attempts, make their start records durable, and wait to be killed."""
    sp = Spool.open(path, retry_intervals=RETRY_INTERVALS)
    held = [sp.claim() for _ in range(n)]
    if any(a is None for a in held):
        raise RuntimeError(f"fewer than {n} messages due in {path}")
    sp.sync()
    _ready_and_wait()


def files_hold(path: str, n: int) -> None:
    """Move ``n`` queue files into ``active/`` (being delivered) and wait to be killed."""
    incoming, active = os.path.join(path, "incoming"), os.path.join(path, "active")
    moved = 0
    with os.scandir(incoming) as it:
        for entry in it:
            if moved == n:
                break
            os.rename(entry.path, os.path.join(active, entry.name))
            moved += 1
    _ready_and_wait()


# --- children: reopen ----------------------------------------------------------------


def spool_open(path: str, work: int) -> dict[str, Any]:
    """Time recovery and the first claim; then run ``work`` attempts and read peak RSS."""
    started = time.perf_counter()
    sp = Spool.open(path, retry_intervals=RETRY_INTERVALS)
    opened = time.perf_counter()
    first = sp.claim()
    claimed = time.perf_counter()
    if first is None:
        raise RuntimeError(f"nothing to claim in {path}")
    rep = sp.recovery
    attempt = first
    for _ in range(work):
        attempt.deferred(attempt.envelope.recipients, DEFERRED_REPLY)
        attempt.close()
        nxt = sp.claim()
        if nxt is None:
            break
        attempt = nxt
    attempt.close()
    rss = peak_rss_kib()
    sp.close()
    return {
        "open_s": opened - started,
        "first_claim_s": claimed - started,
        "records_scanned": rep.records_scanned,
        "bytes_scanned": rep.bytes_scanned,
        "working_found": rep.working_found,
        "peak_rss_kib": rss,
    }


def files_open(path: str, work: int) -> dict[str, Any]:
    """Recover ``active/``, list ``incoming/``, read the first message; then ``work`` more."""
    incoming, active = os.path.join(path, "incoming"), os.path.join(path, "active")
    started = time.perf_counter()
    recovered = 0
    with os.scandir(active) as it:
        for entry in it:
            os.rename(entry.path, os.path.join(incoming, entry.name))
            recovered += 1
    if recovered:
        fd = os.open(incoming, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    names = os.listdir(incoming)
    opened = time.perf_counter()

    def read(name: str) -> tuple[str, ...]:
        with open(os.path.join(incoming, name), "rb") as f:
            pending, _body = parse_queue_file(f.read())
        return tuple(pending)

    if not names or not read(names[0]):
        raise RuntimeError(f"nothing to claim in {incoming}")
    claimed = time.perf_counter()
    for name in names[1 : work + 1]:
        read(name)
    rss = peak_rss_kib()
    return {
        "open_s": opened - started,
        "first_claim_s": claimed - started,
        "records_scanned": len(names),
        "bytes_scanned": os.stat(incoming).st_size + os.stat(active).st_size,
        "working_found": recovered,
        "peak_rss_kib": rss,
    }
