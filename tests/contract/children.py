"""Programs the contract tests run as real processes (``python -m tests.contract.children``).

``serve``: a fork server. It imports the spool once, then reads commands on standard
input, one a line, and runs each in a forked child process, so that a kill test pays the
interpreter start once rather than at every kill:

    ``load DIR ACKS SEED``  fork a child running ``load``; print ``pid N``
    ``kill``                SIGKILL that child (it is still unreaped, so its pid cannot
                            have been reused), reap it, print ``exit N STATUS``
    ``status``              print ``alive N``, ``exit N STATUS`` (reaped) or ``none``

A ``load`` while a child lives is refused (``refused N is alive``), and the server kills
its child when its standard input closes, so no child outlives a failed test. Every fork
and kill is logged to standard error.

The server is single-threaded, so forking it is safe. Children print ``opening`` just
before ``Spool.open`` and ``running SECONDS`` once it returned. A child starts only once
the server has printed its ``pid`` line (it waits on a pipe the server closes after that),
so a fast child's lines can never come before the ``pid`` line that the reader waits for
and be passed over. An open that takes over a minute dumps every thread's stack to
standard error, so a hung open names where it hangs.

``load`` owns the spool and runs accept and delivery threads flat out. Every line it
appends to ACKS is written with one ``write`` to an ``O_APPEND`` file and fdatasynced:

    ``A MSG R1,R2``  ``accept`` returned MSG for these recipients
    ``I MSG R S``    about to report R of MSG with status S (D, F or R for deferred):
                     written before the call, so a kill between a delivery and its durable
                     record shows up as an intent without an acknowledgement
    ``D MSG R``      ``delivered([R])`` returned;  ``F MSG R``: ``failed([R])`` returned
    ``X MSG why``    the child saw something wrong (body data that is not what was sent)

``traffic DIR``: real traffic on a small-segment spool (several segments, body files,
deferred, delivered and in-flight mail, records after the last restart positions), then
exit without closing, as a crash would. Prints the accepted ids, one a line.

``hold-open DIR``: open the spool, print ``open``, and wait to be killed (a second owner
for the lock tests).

``operate DIR ACKS SEED``: like ``load``, with outcome tracking, an operator thread
(hold, release, delete, bounce, retry, and the bulk ``act``) on recent mail, and an
outcome thread that acknowledges every outcome. Prints ``running`` once open. Its ACKS
lines (one ``write`` and an fdatasync each; lower case: written before the call):

    ``A MSG R1,R2``  accepted          ``C MSG R1,R2``  claimed with these pending
    ``I MSG R S``    about to report   ``D MSG R`` / ``F MSG R``  delivered / failed returned
    ``H MSG``        hold returned     ``l MSG`` ``L MSG``  release (``*``: of every held)
    ``x MSG`` ``X MSG``  delete        ``b MSG`` ``B MSG``  bounce
    ``N MSG R:S,..``  an outcome handed out (recipient:status)   ``O MSG``  acknowledged
"""

from __future__ import annotations

import faulthandler
import itertools
import os
import random
import signal
import sys
import threading
import time
import zlib
from typing import Any

from spool import OperatorAction, Spool, SpoolMisuse, UnknownMessage

TORTURE_OPTIONS: dict[str, Any] = {
    "retry_intervals": [0.02, 0.05],
    "segment_size": 64 * 1024,
    "checkpoint_interval": 0.05,
    "inline_body_max": 4096,
    "sync_interval": 0.05,
}


def emit(line: str) -> None:
    """One line to standard output in one write (atomic on a pipe)."""
    os.write(1, (line + "\n").encode())


def make_body(rng: random.Random) -> bytes:
    """A body whose first 8 bytes are the CRC of the rest, so readers can verify it."""
    size = rng.choice(
        [rng.randrange(20, 600), rng.randrange(600, 3000), rng.randrange(5000, 20000)]
    )
    payload = rng.randbytes(size)
    return b"%08x" % zlib.crc32(payload) + payload


def body_is_intact(data: bytes) -> bool:
    return len(data) >= 8 and data[:8] == b"%08x" % zlib.crc32(data[8:])


def load(spool_dir: str, acks_path: str, seed: int) -> None:
    emit("opening")
    started = time.monotonic()
    faulthandler.dump_traceback_later(60.0)
    sp = Spool.open(spool_dir, **TORTURE_OPTIONS)
    faulthandler.cancel_dump_traceback_later()
    emit(f"running {time.monotonic() - started:.6f}")
    acks = os.open(acks_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def ack(line: str) -> None:
        os.write(acks, (line + "\n").encode())
        os.fdatasync(acks)

    def producer(k: int) -> None:
        rng = random.Random(seed * 100 + k)
        n = 0
        while True:
            rcpts = [f"p{seed}-{k}-{n}-{j}@example.net" for j in range(1 + rng.randrange(3))]
            msg_id = sp.accept("a@example.org", rcpts, make_body(rng))
            ack(f"A {msg_id} {','.join(rcpts)}")
            n += 1

    def worker(k: int) -> None:
        rng = random.Random(seed * 100 + 50 + k)
        while True:
            attempt = sp.claim(timeout=0.02)
            if attempt is None:
                continue
            with attempt:
                msg_id = attempt.msg_id
                if rng.random() < 0.2 and not body_is_intact(attempt.read_data()):
                    ack(f"X {msg_id} body-data-differs")
                pending = list(attempt.envelope.recipients)
                if rng.random() < 0.3:
                    for r in pending:
                        ack(f"I {msg_id} {r} D")
                    attempt.delivered(pending, "250 2.0.0 ok")
                    for r in pending:
                        ack(f"D {msg_id} {r}")
                    continue
                for r in pending:
                    roll = rng.random()
                    if roll < 0.6:
                        ack(f"I {msg_id} {r} D")
                        attempt.delivered([r], "250 2.0.0 ok")
                        ack(f"D {msg_id} {r}")
                    elif roll < 0.7:
                        ack(f"I {msg_id} {r} F")
                        attempt.failed([r], "550 5.1.1 no such user")
                        ack(f"F {msg_id} {r}")
                    elif roll < 0.9:
                        ack(f"I {msg_id} {r} R")
                        attempt.deferred([r], "451 4.3.0 try later")
                    # else: left unreported; closing the attempt defers it

    threads = [threading.Thread(target=producer, args=(k,), daemon=True) for k in range(3)]
    threads += [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def serve() -> None:
    """The fork server's loop. At most one child lives at a time; none outlives the server."""
    child = 0

    def log(text: str) -> None:
        os.write(2, f"serve: {text}\n".encode())

    try:
        for line in sys.stdin:
            command, *args = line.split()
            if command == "load":
                if child:
                    # Two owners would make the next failure impossible to read.
                    emit(f"refused {child} is alive")
                    continue
                go_read, go_write = os.pipe()
                pid = os.fork()
                if pid == 0:
                    code = 0
                    try:
                        os.close(go_write)
                        os.read(go_read, 1)  # EOF once the server printed ``pid``
                        os.close(go_read)
                        signal.signal(signal.SIGINT, signal.SIG_DFL)
                        load(args[0], args[1], int(args[2]))
                    except BaseException as exc:
                        os.write(2, f"load child failed: {exc!r}\n".encode())
                        code = 70
                    finally:
                        os._exit(code)
                os.close(go_read)
                child = pid
                log(f"forked {pid}")
                emit(f"pid {pid}")
                os.close(go_write)  # now the child may start
            elif command == "kill":
                if not child:
                    emit("none")
                    continue
                os.kill(child, signal.SIGKILL)
                _, status = os.waitpid(child, 0)
                log(f"killed {child}")
                emit(f"exit {child} {status}")
                child = 0
            elif command == "status":
                if child:
                    pid, status = os.waitpid(child, os.WNOHANG)
                    if pid:
                        emit(f"exit {child} {status}")
                        child = 0
                    else:
                        emit(f"alive {child}")
                else:
                    emit("none")
            else:
                emit(f"unknown {line.strip()}")
    finally:
        if child:  # the parent went away (or failed): take the child with us
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            log(f"killed {child} at exit")


TRAFFIC_OPTIONS: dict[str, Any] = {
    "retry_intervals": [60.0, 600.0],
    "segment_size": 8 * 1024,
    "inline_body_max": 2048,
    "checkpoint_interval": 3600.0,
}


def traffic(spool_dir: str) -> None:
    sp = Spool.open(spool_dir, **TRAFFIC_OPTIONS)
    rng = random.Random(5)
    ids = []
    for i in range(80):
        if i == 60:
            sp.checkpoint()  # what follows lies after the restart positions' durable end
        rcpts = [f"t{i}-{j}@example.net" for j in range(1 + i % 3)]
        ids.append(sp.accept("a@example.org", rcpts, make_body(rng)))
        if i % 4 == 3:
            attempt = sp.claim()
            assert attempt is not None
            head, *rest = attempt.envelope.recipients
            if i < 70 or i % 8 == 3:
                with attempt:
                    attempt.delivered([head], "250 2.0.0 ok")
                    if rest:
                        attempt.deferred(rest, "451 4.3.0 later")
            else:
                attempt.delivered([head], "250 2.0.0 ok")  # left in flight
    sp.sync()
    for msg_id in ids:
        emit(msg_id)
    os._exit(0)


def hold_open(spool_dir: str) -> None:
    Spool.open(spool_dir)
    emit("open")
    while True:
        time.sleep(60)


OPERATE_OPTIONS: dict[str, Any] = {
    **TORTURE_OPTIONS,
    "segment_size": 32 * 1024,
    "inline_body_max": 2048,
    "outcomes": True,
    "crash_limit": 1000,  # the breaker's holds would blur the operator's
}


def operate(spool_dir: str, acks_path: str, seed: int) -> None:
    sp = Spool.open(spool_dir, **OPERATE_OPTIONS)
    acks = os.open(acks_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    recent: list[str] = []

    def ack(line: str) -> None:
        os.write(acks, (line + "\n").encode())
        os.fdatasync(acks)

    def producer(k: int) -> None:
        rng = random.Random(seed * 100 + k)
        for n in itertools.count():
            rcpts = [f"o{seed}-{k}-{n}-{j}@example.net" for j in range(1 + rng.randrange(3))]
            msg_id = sp.accept("a@example.org", rcpts, rng.randbytes(rng.choice([100, 3000])))
            ack(f"A {msg_id} {','.join(rcpts)}")
            recent.append(msg_id)
            del recent[:-50]
            time.sleep(rng.random() * 0.01)

    def worker(k: int) -> None:
        rng = random.Random(seed * 100 + 50 + k)
        while True:
            attempt = sp.claim(timeout=0.02)
            if attempt is None:
                continue
            with attempt:
                msg_id, pending = attempt.msg_id, list(attempt.envelope.recipients)
                ack(f"C {msg_id} {','.join(pending)}")
                for r in pending:
                    roll = rng.random()
                    if roll < 0.4:
                        ack(f"I {msg_id} {r} D")
                        attempt.delivered([r], "250 2.0.0 ok")
                        ack(f"D {msg_id} {r}")
                    elif roll < 0.5:
                        ack(f"I {msg_id} {r} F")
                        attempt.failed([r], "550 5.1.1 no such user")
                        ack(f"F {msg_id} {r}")
                    elif roll < 0.8:
                        attempt.deferred([r], "451 4.3.0 try later")
                    if rng.random() < 0.2:
                        time.sleep(0.01)  # let the operator reach it in flight

    def operator() -> None:
        rng = random.Random(seed * 100 + 90)
        while True:
            time.sleep(rng.random() * 0.02)
            if not recent:
                continue
            msg_id, roll = rng.choice(recent[-50:]), rng.random()
            try:
                if roll < 0.35:
                    sp.hold(msg_id)
                    ack(f"H {msg_id}")
                elif roll < 0.65:
                    ack(f"l {msg_id}")
                    sp.release(msg_id)
                    ack(f"L {msg_id}")
                elif roll < 0.75:
                    ack(f"x {msg_id}")
                    sp.delete(msg_id)
                    ack(f"X {msg_id}")
                elif roll < 0.8:
                    ack(f"b {msg_id}")
                    sp.bounce(msg_id)
                    ack(f"B {msg_id}")
                elif roll < 0.9:
                    sp.retry_now(msg_id)
                elif roll < 0.905:
                    ack("l *")
                    sp.act(OperatorAction.RELEASE, where=lambda e: e.held is not None)
                    ack("L *")
                else:
                    result = sp.act(OperatorAction.HOLD, where=lambda e: rng.random() < 0.1)
                    for held in result.changed:
                        ack(f"H {held}")
            except (UnknownMessage, SpoolMisuse):
                pass  # finished meanwhile, or not held

    def outcomes() -> None:
        while True:
            outcome = sp.next_outcome(timeout=0.05)
            if outcome is None:
                continue
            ack(
                f"N {outcome.msg_id} "
                + ",".join(f"{r.recipient}:{r.status}" for r in outcome.recipients)
            )
            sp.ack_outcome(outcome.msg_id)
            ack(f"O {outcome.msg_id}")

    threads = [threading.Thread(target=producer, args=(k,), daemon=True) for k in range(2)]
    threads += [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(3)]
    threads += [threading.Thread(target=f, daemon=True) for f in (operator, outcomes)]
    for t in threads:
        t.start()
    emit("running")
    for t in threads:
        t.join()


if __name__ == "__main__":
    name, *rest = sys.argv[1:]
    if name == "serve":
        serve()
    elif name == "traffic":
        traffic(rest[0])
    elif name == "hold-open":
        hold_open(rest[0])
    elif name == "operate":
        operate(rest[0], rest[1], int(rest[2]))
    else:
        raise SystemExit(f"unknown program {name}")
