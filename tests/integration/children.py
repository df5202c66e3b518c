"""Programs run as real subprocesses by the crash tests (``python -m tests.integration.children``).

``fill DIR N INFLIGHT``: accept N messages, claim INFLIGHT of them, checkpoint, then exit
without closing (a crash as far as the spool can tell).
``crash-on DIR``: claim one message and die in the middle of its attempt.
``load DIR ACKS ARCHIVE [INLINE_MAX]``: accept and deliver flat out from several threads,
appending every acknowledgement to ACKS (an O_APPEND file: a line per call that returned)
until killed; bodies over INLINE_MAX bytes go to body files.
"""

from __future__ import annotations

import os
import random
import sys
import threading
from typing import Any

from spool import Spool, SpoolError


def fill(path: str, n: int, in_flight: int) -> None:
    sp = Spool.open(path, checkpoint_interval=3600)
    for i in range(n):
        sp.accept("a@example.org", [f"r{i}@example.net", f"s{i}@example.org"], b"x" * 200)
    attempts = [sp.claim() for _ in range(in_flight)]
    assert all(a is not None for a in attempts)
    sp.checkpoint()
    os._exit(0)


def crash_on(path: str) -> None:
    sp = Spool.open(path, retry_intervals=[0.001])
    attempt = sp.claim(timeout=5)
    print(attempt.msg_id if attempt else "-", flush=True)
    sp.sync()
    os._exit(0)


LOAD_OPTIONS: dict[str, Any] = {
    "retry_intervals": [0.05, 0.1],
    "checkpoint_interval": 0.2,
    "segment_size": 256 * 1024,
}


def load(path: str, acks_path: str, archive: str, inline_max: int | None = None) -> None:
    options = dict(LOAD_OPTIONS)
    if inline_max is not None:
        options["inline_body_max"] = inline_max
    sp = Spool.open(path, archive_dir=archive, **options)
    acks = os.open(acks_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def ack(line: str) -> None:
        os.write(acks, (line + "\n").encode())

    def producer(seed: int) -> None:
        rng = random.Random(seed)
        n = 0
        while True:
            rcpts = [f"p{seed}-{n}-{k}@example.net" for k in range(1 + rng.randrange(3))]
            msg_id = sp.accept("a@example.org", rcpts, os.urandom(rng.randrange(50, 3000)))
            ack(f"A {msg_id} {','.join(rcpts)}")
            n += 1

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while True:
            attempt = sp.claim(timeout=0.05)
            if attempt is None:
                continue
            with attempt:
                for rcpt in attempt.envelope.recipients:
                    roll = rng.random()
                    if roll < 0.6:
                        attempt.delivered([rcpt], "250 ok")
                        ack(f"D {attempt.msg_id} {rcpt}")
                    elif roll < 0.7:
                        attempt.failed([rcpt], "550 no")
                        ack(f"F {attempt.msg_id} {rcpt}")
                    elif roll < 0.9:
                        attempt.deferred([rcpt], "451 later")

    threads = [threading.Thread(target=producer, args=(i,), daemon=True) for i in range(4)]
    threads += [threading.Thread(target=worker, args=(100 + i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    print("running", flush=True)
    try:
        for t in threads:
            t.join()
    except SpoolError:
        os._exit(1)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "fill":
        fill(args[0], int(args[1]), int(args[2]))
    elif command == "crash-on":
        crash_on(args[0])
    elif command == "load":
        load(args[0], args[1], args[2], int(args[3]) if len(args) > 3 else None)
    else:
        raise SystemExit(f"unknown command {command}")
