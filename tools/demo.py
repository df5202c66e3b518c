"""The demonstration behind ``make run``: generated mail in, a demo agent delivering it.

Producer threads accept generated messages; worker threads claim them and play a remote
MTA that delivers most recipients, defers some (4xx) and fails a few (5xx). Retry
intervals are seconds here, so deferred mail comes back while the demo runs. It prints a
live progress line and a summary, including fsyncs per accepted message: the number group
commit keeps far below one.
"""

from __future__ import annotations

import random
import sys
import threading
import time

import click

from spool import Spool, SpoolError

DOMAINS = ("example.net", "example.com", "example.org", "mail.example")


def _message(rng: random.Random, n: int) -> tuple[str, list[str], bytes]:
    rcpts = [f"user{rng.randrange(10_000)}.{i}@{rng.choice(DOMAINS)}" for i in range(1 + n % 3)]
    body = f"Subject: demo message {n}\r\n\r\n".encode() + b"x" * rng.randrange(200, 4000)
    return "demo@example.org", rcpts, body


def _agent(sp: Spool, stop: threading.Event, seed: int) -> None:
    """A worker loop: claim, 'deliver', report per recipient."""
    rng = random.Random(seed)
    while not stop.is_set():
        try:
            attempt = sp.claim(timeout=0.1)
        except SpoolError:
            return
        if attempt is None:
            continue
        # One SMTP transaction per message: the final reply settles each recipient, and
        # the agent reports them grouped by outcome (one record, one shared fsync each).
        outcome: dict[str, list[str]] = {"delivered": [], "deferred": [], "failed": []}
        for rcpt in attempt.envelope.recipients:
            roll = rng.random()
            kind = "delivered" if roll < 0.75 else "deferred" if roll < 0.93 else "failed"
            outcome[kind].append(rcpt)
        with attempt:
            if outcome["delivered"]:
                attempt.delivered(outcome["delivered"], "250 2.0.0 ok: queued as demo")
            if outcome["deferred"]:
                attempt.deferred(outcome["deferred"], "451 4.7.1 greylisted, try again later")
            if outcome["failed"]:
                attempt.failed(outcome["failed"], "550 5.1.1 no such user")


def _producer(sp: Spool, stop: threading.Event, seed: int, counter: list[int]) -> None:
    rng = random.Random(seed)
    n = 0
    while not stop.is_set():
        try:
            sp.accept(*_message(rng, n))
        except SpoolError:
            return
        n += 1
        counter[seed] = n
        time.sleep(rng.random() * 0.002)


@click.command()
@click.argument("directory", default="var/spool")
@click.option("--seconds", default=8.0, show_default=True, help="How long to accept mail.")
@click.option("--producers", default=16, show_default=True, help="Accepting threads.")
@click.option("--workers", default=8, show_default=True, help="Delivering threads.")
def main(directory: str, seconds: float, producers: int, workers: int) -> None:
    """Run the demo on DIRECTORY (created if missing; an existing spool is recovered)."""
    sp = Spool.open(directory, retry_intervals=[1, 2, 4], checkpoint_interval=2)
    r = sp.recovery
    click.echo(
        f"opened {directory}: recovery scanned {r.records_scanned} records in "
        f"{r.seconds * 1000:.1f} ms, {r.working_found} in flight, {r.torn_bytes_cut} torn bytes"
    )
    stop_accepting, stop_workers = threading.Event(), threading.Event()
    counts = [0] * producers
    threads = [
        threading.Thread(target=_producer, args=(sp, stop_accepting, i, counts))
        for i in range(producers)
    ] + [threading.Thread(target=_agent, args=(sp, stop_workers, 1000 + i)) for i in range(workers)]
    for t in threads:
        t.start()
    start = time.monotonic()
    tty = sys.stdout.isatty()
    try:
        while True:
            elapsed = time.monotonic() - start
            if elapsed >= seconds:
                stop_accepting.set()
            s = sp.statistics()
            line = (
                f"{elapsed:5.1f}s accepted {s.accepted:6d}  delivered {s.delivered:6d}  "
                f"deferred {s.deferred:5d}  failed {s.failed:4d}  in flight {s.in_flight:3d}  "
                f"fsyncs {s.fsyncs:5d}"
            )
            click.echo(("\r" + line) if tty else line, nl=not tty)
            if elapsed >= seconds + 30 or (elapsed >= seconds and s.in_flight == 0 and idle(sp)):
                break
            time.sleep(0.5 if tty else 1.0)
    finally:
        stop_accepting.set()
        stop_workers.set()
        for t in threads:
            t.join()
        s = sp.statistics()
        sp.close()
    if tty:
        click.echo()
    per_msg = s.fsyncs / s.accepted if s.accepted else 0.0
    click.echo(
        f"summary: accepted {s.accepted}, delivered {s.delivered}, deferred {s.deferred}, "
        f"failed {s.failed} (recipients); {s.fsyncs} fsyncs = {per_msg:.3f} per message, "
        f"{s.frames_per_fsync_mean:.1f} records per fsync"
    )


def idle(sp: Spool) -> bool:
    """True when nothing is due right now (deferred mail may still be waiting)."""
    attempt = sp.claim()
    if attempt is None:
        return True
    attempt.close()
    return False


if __name__ == "__main__":
    main()
