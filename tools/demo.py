"""The demonstration behind ``make run``: the system at work, one command, no configuration.

It starts ``spool serve DIR --workers 2 --agent demo`` (the owner and two delivery worker
processes; the demo agent plays a remote MTA that delivers most recipients, defers some
with 4xx and refuses a few with 5xx), feeds it generated mail from producer threads over
the control socket (``spool.connect``), prints live progress, waits for the deferred mail
to come back and go (retry intervals of seconds here), stops the owner with SIGTERM and
prints a summary, including fsyncs per accepted message: the number group commit keeps far
below one. Ctrl-C stops it early, cleanly.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import threading
import time

import click

from spool import Spool, SpoolError, connect
from spool.client import Client
from spool.stop_signals import StopSignals

DOMAINS = ("example.net", "example.com", "example.org", "mail.example")


def _message(rng: random.Random, n: int) -> tuple[str, list[str], bytes]:
    rcpts = [f"user{rng.randrange(10_000)}.{i}@{rng.choice(DOMAINS)}" for i in range(1 + n % 3)]
    body = f"Subject: demo message {n}\r\n\r\n".encode() + b"x" * rng.randrange(200, 4000)
    return "demo@example.org", rcpts, body


def _producer(client: Client, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    n = 0
    while not stop.is_set():
        try:
            client.accept(*_message(rng, n))
        except SpoolError:
            return
        n += 1
        time.sleep(rng.random() * 0.002)


def _start_owner(directory: str, workers: int) -> subprocess.Popen[bytes]:
    owner = subprocess.Popen(
        [sys.executable, "-m", "spool.cli", "serve", directory,
         "--workers", str(workers), "--agent", "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # Ctrl-C reaches the demo, which stops the owner itself
    )  # fmt: skip
    assert owner.stdout is not None
    ready, _, _ = select.select([owner.stdout], [], [], 30)
    line = owner.stdout.readline().decode().strip() if ready else ""
    if "ready" not in line:
        owner.kill()
        raise click.ClickException(f"the owner did not start: {line or 'no answer'}")
    click.echo(line)
    return owner


@click.command()
@click.argument("directory", default="var/spool")
@click.option("--seconds", default=8.0, show_default=True, help="How long to accept mail.")
@click.option("--producers", default=8, show_default=True, help="Accepting threads.")
@click.option("--workers", default=2, show_default=True, help="Delivery worker processes.")
def main(directory: str, seconds: float, producers: int, workers: int) -> None:
    """Run the demo on DIRECTORY (created if missing; an existing spool is recovered)."""
    # Short retry intervals, so that deferred mail comes back while the demo runs.
    Spool.open(directory, retry_intervals=[1, 2, 4]).close()
    owner = _start_owner(directory, workers)
    interrupted = StopSignals()  # a handler that set an Event could hang: see its module
    interrupted.install([signal.SIGINT])
    stop = threading.Event()
    clients = [connect(directory) for _ in range(producers)]
    threads = [threading.Thread(target=_producer, args=(c, stop, i)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    monitor = connect(directory)
    start = time.monotonic()
    tty = sys.stdout.isatty()
    try:
        while not interrupted.stopped:
            elapsed = time.monotonic() - start
            if elapsed >= seconds:
                stop.set()
            s = monitor.statistics()
            line = (
                f"{elapsed:5.1f}s accepted {s.accepted:6d}  delivered {s.delivered:6d}  "
                f"deferred {s.deferred:5d}  failed {s.failed:4d}  in flight {s.in_flight:3d}  "
                f"fsyncs {s.fsyncs:5d}"
            )
            click.echo(("\r" + line) if tty else line, nl=not tty)
            drained = elapsed >= seconds and not list(monitor.list())
            if drained or elapsed >= seconds + 30:
                break
            interrupted.wait(0.5 if tty else 1.0)
    finally:
        stop.set()
        for t in threads:
            t.join()
        s = monitor.statistics()
        for c in [*clients, monitor]:
            c.close()
        owner.send_signal(signal.SIGTERM)
        owner.wait()
    if tty:
        click.echo()
    per_msg = s.fsyncs / s.accepted if s.accepted else 0.0
    click.echo(
        f"summary: accepted {s.accepted}, delivered {s.delivered}, deferred {s.deferred}, "
        f"failed {s.failed} (recipients); {s.fsyncs} fsyncs = {per_msg:.3f} per message, "
        f"{s.frames_per_fsync_mean:.1f} records per fsync; owner stopped "
        f"(status {owner.returncode})"
    )
    if interrupted.stopped:
        sys.exit(130)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
