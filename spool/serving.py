"""``spool serve``: open the spool, serve its control socket, run its workers, until a signal.

Start-up: the spool opens (recovery), the control socket is bound (``owner.py``), the
workers start (``supervisor.py``), and one line says the owner is ready. SIGTERM or SIGINT
stops it cleanly: no new connections, workers get SIGTERM and a grace period to settle the
message in hand, connections are dropped (their attempts closed: unreported recipients
deferred), the spool closes (positions written) and the socket is removed. A second signal
during that stop is ignored (the stop is bounded); SIGKILL at any point is just a crash,
recovered by the next start. SIGUSR1 writes every thread's stack to standard error
(``faulthandler``) and changes nothing: for an owner that seems stuck.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from spool.agents import LISTENERS_ENV, listeners_text
from spool.bouncing import Bouncer
from spool.delay_warnings import DelayWarner
from spool.options import RECORDED
from spool.owner import ControlServer
from spool.spool import Spool
from spool.statistics import SpoolStatistics
from spool.stop_signals import StopSignals
from spool.supervisor import Supervisor

log = logging.getLogger("spool")
SIGNAL_POLL: Final = 0.2  # seconds


def serve(
    directory: str,
    *,
    workers: int,
    agent: str,
    max_use: int,
    attempt_timeout: float,
    concurrency: int = 4,
    metrics: tuple[str, int] | None = None,
    smtp: Sequence[tuple[str, int]] = (),
    smtp_hostname: str | None = None,
    mynetworks: Sequence[str] | None = None,
    relay_domains: Sequence[str] = (),
    smtp_processes: int = 0,
    bounces: bool = False,
    delay_warning: float | None = None,
    tls: tuple[str, str] | None = None,
    ready: Any = None,
) -> int:
    """Run the owner until SIGTERM/SIGINT; return the signal's number (the command exits
    130 after Ctrl-C, 0 after SIGTERM). ``ready`` is called with the ready line. ``smtp``
    listeners accept mail over SMTP in this process (``smtp_in.py``), or in
    ``smtp_processes`` processes of their own (``smtp_process.py``); ``bounces`` turns
    outcome tracking on (recorded), and a spool that tracks outcomes gets its bounces sent
    (``bouncing.py``); with ``delay_warning`` seconds, the senders of messages queued
    longer get one warning each (``delay_warnings.py``)."""
    stop = StopSignals()
    stop.install()
    try:
        sp = Spool.open(
            directory, attempt_timeout=attempt_timeout, outcomes=True if bounces else RECORDED
        )
    except BaseException:
        stop.restore()
        raise
    started_wall, started = time.time(), time.monotonic()
    # Written by the C handler, whatever the threads hold (a stuck owner's locks included).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    r = sp.recovery
    log.info(
        "recovered %s: %d records in %.1f ms, %d in flight, %d torn bytes cut",
        directory, r.records_scanned, r.seconds * 1000, r.working_found, r.torn_bytes_cut,
    )  # fmt: skip
    supervisor: Supervisor | None = None

    def owner_info() -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "path": os.path.abspath(directory),
            "started_at": started_wall,
            "uptime": time.monotonic() - started,
            "agent": agent,
            "workers": [] if supervisor is None else supervisor.workers(),
            "smtp_processes": front.pids() if hasattr(front, "pids") else [],
            "worker_restarts": 0 if supervisor is None else supervisor.restarts,
            "lease_kills": 0 if supervisor is None else supervisor.lease_kills,
            "smtp": server.tallies.total() if smtp else None,  # smtp_tally.py
        }

    server = ControlServer(sp, owner_info)
    supervisor = Supervisor(
        directory, agent, workers, max_use, attempt_timeout, server, concurrency
    )
    stop_metrics: Callable[[], None] | None = None
    front: Any = None
    bouncer: Bouncer | None = None
    warner: DelayWarner | None = None
    stats: list[SpoolStatistics] = []
    try:
        if metrics is not None:
            from spool.metrics import serve_metrics

            stop_metrics = serve_metrics(sp, owner_info, *metrics)
            log.info("metrics on http://%s:%d/metrics", *metrics)
        server.start()
        if smtp:  # the workers' agents know this relay by it (mail that would loop)
            os.environ[LISTENERS_ENV] = listeners_text(smtp)
        supervisor.start()
        if smtp and smtp_processes:
            from spool.smtp_in import LOOPBACK
            from spool.smtp_process import SmtpProcesses

            front = SmtpProcesses(
                directory,
                smtp,
                smtp_processes,
                hostname=smtp_hostname or socket.getfqdn(),
                max_recipients=sp.options.max_recipients,
                max_message_size=sp.options.max_message_size,
                mynetworks=LOOPBACK if mynetworks is None else mynetworks,
                relay_domains=relay_domains,
                tls=tls,
            )
            front.start()
        elif smtp:
            from spool.async_spool import AsyncSpool
            from spool.smtp_in import LOOPBACK, SmtpFrontEnd, tls_context

            front = SmtpFrontEnd(
                AsyncSpool(sp),
                smtp,
                hostname=smtp_hostname,
                mynetworks=LOOPBACK if mynetworks is None else mynetworks,
                relay_domains=relay_domains,
                tls=None if tls is None else tls_context(*tls),
            )
            server.tallies.own = front.handler.tally
            front.start()
        if sp.options.outcomes:
            bouncer = Bouncer(sp, smtp_hostname or socket.getfqdn())
            bouncer.start()
        if delay_warning is not None:
            warner = DelayWarner(sp, directory, smtp_hostname or socket.getfqdn(), delay_warning)
            warner.start()
        listening = "".join(f", smtp {host}:{port}" for host, port in smtp)
        if smtp and smtp_processes:
            listening += f" ({smtp_processes} process{'' if smtp_processes == 1 else 'es'})"
        line = (
            f"spool serve: ready, pid {os.getpid()}, socket {server.path}, "
            f"{workers} worker{'' if workers == 1 else 's'} ({agent or 'no agent'}){listening}"
        )
        log.info(line.removeprefix("spool serve: "))
        if ready is not None:
            ready(line)
        # Poll rather than wait for good: the kernel may hand SIGTERM to another thread,
        # which does not wake a blocked main thread, and Python runs handlers only there.
        while not stop.wait(SIGNAL_POLL):
            pass
        log.info("stopping")
        stop.ignore()
    finally:
        # Each step runs even if one before it failed: a stop that skipped the rest would
        # leave workers delivering under an owner that no longer answers its signals.
        _all_of(
            [
                *([front.stop] if front is not None else []),  # first: no new mail
                *([bouncer.stop] if bouncer is not None else []),
                *([warner.stop] if warner is not None else []),
                *([stop_metrics] if stop_metrics is not None else []),
                server.stopping,  # before the workers go: their ends are not crashes
                supervisor.stop,
                server.stop,
                lambda: stats.append(sp.statistics()),
                sp.close,
                stop.restore,
                functools.partial(faulthandler.unregister, signal.SIGUSR1),
            ]
        )
    accepted, delivered, deferred, failed = (
        (stats[0].accepted, stats[0].delivered, stats[0].deferred, stats[0].failed)
        if stats
        else (0, 0, 0, 0)
    )
    log.info(
        "stopped after %.0f s: accepted %d, delivered %d, deferred %d, failed %d (recipients)",
        time.monotonic() - started, accepted, delivered, deferred, failed,
    )  # fmt: skip
    return stop.received[0] if stop.received else signal.SIGTERM


def _all_of(steps: list[Callable[[], object]]) -> None:
    """Run every step; a step that raises is logged and the rest still run; then the
    first error is raised again."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as exc:  # kept, and raised once every step ran
            log.error("while stopping: %r", exc)
            first = first or exc
    if first is not None:
        raise first
