"""Prometheus metrics of a running owner (``spool serve --metrics HOST:PORT``).

Served by ``prometheus-client`` (text exposition, never hand-written) from a collector that
reads the owner at each scrape: the spool's counters (cheap, under its lock), the workers,
the recovery of this start, and the queue by state and retry class. The queue figures come
from a walk of the live log (``Spool.list``), so they are refreshed at most every
``QUEUE_EVERY`` seconds whatever the scrape interval: a scrape never costs more than one
walk per half minute.

Names follow Prometheus conventions: ``_total`` counters, ``_seconds`` and ``_bytes`` units,
labels for states, classes and outcomes (docs/serve.md lists them).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Final

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from spool.errors import CannotListen
from spool.histogram import BATCH_RECORDS_BOUNDS, FSYNC_SECONDS_BOUNDS, cumulative
from spool.smtp_tally import CLASSES, COMMANDS
from spool.spool import Spool

QUEUE_EVERY: Final = 30.0  # seconds between walks of the live queue
STATES: Final = ("incoming", "deferred", "active", "held")


class QueueFigures:
    """Messages and recipients by (state, class), and the oldest accepted time, cached."""

    def __init__(self, spool: Spool, every: float = QUEUE_EVERY) -> None:
        self.spool = spool
        self.every = every
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._figures: tuple[Counter[tuple[str, int]], Counter[tuple[str, int]], float | None]
        self._figures = (Counter(), Counter(), None)

    def get(self) -> tuple[Counter[tuple[str, int]], Counter[tuple[str, int]], float | None]:
        with self._lock:
            if time.monotonic() - self._at >= self.every:
                messages: Counter[tuple[str, int]] = Counter()
                recipients: Counter[tuple[str, int]] = Counter()
                oldest: float | None = None
                for entry in self.spool.list():
                    messages[entry.state, entry.klass] += 1
                    recipients[entry.state, entry.klass] += len(entry.recipients)
                    if oldest is None or entry.accepted_at < oldest:
                        oldest = entry.accepted_at
                self._figures = (messages, recipients, oldest)
                self._at = time.monotonic()
            return self._figures


class SpoolCollector(Collector):
    def __init__(self, spool: Spool, owner_info: Callable[[], dict[str, Any]]) -> None:
        self.spool = spool
        self.owner_info = owner_info
        self.queue = QueueFigures(spool)

    def collect(self) -> Iterator[Any]:
        s = self.spool.statistics()
        outcomes = CounterMetricFamily(
            "spool_recipients", "Recipients reported, by outcome, since start.", labels=["outcome"]
        )
        for outcome, value in (
            ("delivered", s.delivered),
            ("deferred", s.deferred),
            ("failed", s.failed),
            ("expired", s.expired),
            ("deleted", s.deleted),
        ):
            outcomes.add_metric([outcome], value)
        yield outcomes
        for name, doc, value in (
            ("spool_messages_accepted", "Messages accepted since start.", s.accepted),
            ("spool_fsyncs", "fdatasync calls of the log writer since start.", s.fsyncs),
            ("spool_log_batches", "Group-commit batches written since start.", s.batches),
            ("spool_log_records", "Records written to the log since start.", s.frames),
            ("spool_log_written_bytes", "Bytes written to the log since start.", s.bytes_written),
            ("spool_checkpoints", "Restart positions written since start.", s.checkpoints),
            ("spool_bodies_promoted", "Inline bodies moved to files.", s.bodies_promoted),
            ("spool_leases_expired", "Attempts closed past their lease.", s.leases_expired),
            ("spool_segments_deleted", "Log segments freed since start.", s.segments_deleted),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "spool_records_per_fsync", "Mean records made durable by one fsync since start.",
            value=s.frames_per_fsync_mean,
        )  # fmt: skip
        yield HistogramMetricFamily(
            "spool_fsync_seconds", "Latency of the log writer's fdatasync calls.",
            buckets=cumulative(FSYNC_SECONDS_BOUNDS, s.fsync_seconds),
            sum_value=s.fsync_seconds_sum,
        )  # fmt: skip
        yield HistogramMetricFamily(
            "spool_log_batch_records", "Records made durable by one group-commit batch.",
            buckets=cumulative(BATCH_RECORDS_BOUNDS, s.batch_records), sum_value=s.frames,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "spool_attempts_in_flight", "Delivery attempts open now.", value=s.in_flight
        )
        yield GaugeMetricFamily("spool_log_segments", "Log segment files now.", value=s.segments)
        yield from self._queue()
        yield from self._owner()

    def _queue(self) -> Iterator[Any]:
        messages, recipients, oldest = self.queue.get()
        for name, doc, figures in (
            ("spool_queued_messages", "Live messages by state and retry class.", messages),
            ("spool_queued_recipients", "Pending recipients by state and retry class.", recipients),
        ):
            family = GaugeMetricFamily(name, doc, labels=["state", "class"])
            present = {state for state, _ in figures}
            for state in STATES:
                if state not in present:  # every state shows, at zero when empty
                    family.add_metric([state, "0"], 0)
            for (state, klass), value in sorted(figures.items()):
                family.add_metric([state, str(klass)], value)
            yield family
        age = 0.0 if oldest is None else max(0.0, time.time() - oldest)
        yield GaugeMetricFamily(
            "spool_oldest_queued_seconds", "Age of the oldest live message.", value=age
        )

    def _owner(self) -> Iterator[Any]:
        info = self.owner_info()
        r = self.spool.recovery
        yield GaugeMetricFamily("spool_uptime_seconds", "Seconds since the owner started.",
                                value=info["uptime"])  # fmt: skip
        yield GaugeMetricFamily(
            "spool_workers_running", "Worker processes running now.",
            value=sum(1 for w in info["workers"] if w["pid"] is not None),
        )  # fmt: skip
        yield CounterMetricFamily("spool_worker_restarts", "Workers replaced since start.",
                                  value=info["worker_restarts"])  # fmt: skip
        yield CounterMetricFamily("spool_worker_lease_kills", "Workers killed at their lease.",
                                  value=info["lease_kills"])  # fmt: skip
        yield from _smtp(info.get("smtp"))
        for name, doc, value in (
            ("spool_recovery_seconds", "How long this start's recovery took.", r.seconds),
            ("spool_recovery_records_scanned", "Records recovery read.", r.records_scanned),
            ("spool_recovery_in_flight_found", "Attempts recovery found open.", r.working_found),
            ("spool_recovery_torn_bytes", "Torn bytes recovery cut.", r.torn_bytes_cut),
        ):
            yield GaugeMetricFamily(name, doc, value=value)


def _smtp(counts: dict[str, int] | None) -> Iterator[Any]:
    """The SMTP front end's figures (smtp_tally.py), when the owner serves SMTP."""
    if counts is None:
        return
    yield CounterMetricFamily(
        "spool_smtp_connections", "SMTP connections since start.", value=counts["connections"]
    )
    replies = CounterMetricFamily(
        "spool_smtp_replies",
        "Replies of the relay's policy to MAIL, RCPT and DATA, by command and class.",
        labels=["command", "class"],
    )
    for command in COMMANDS:
        for klass in CLASSES:
            replies.add_metric([command.upper(), klass], counts[f"{command}_{klass}"])
    yield replies
    yield CounterMetricFamily(
        "spool_smtp_accepted_bytes", "Bytes of the messages accepted over SMTP since start.",
        value=counts["accepted_bytes"],
    )  # fmt: skip


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9100`` for IPv6) as (host, port); ValueError if it is not."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"give the metrics address as HOST:PORT, not {text!r}")
    return host.strip("[]"), int(port)


def serve_metrics(
    spool: Spool, owner_info: Callable[[], dict[str, Any]], host: str, port: int
) -> Callable[[], None]:
    """Serve ``/metrics`` on ``host:port`` in a thread; return the function that stops it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SpoolCollector(spool, owner_info))
    try:
        server, thread = start_http_server(port, host, registry=registry)
    except OSError as e:
        raise CannotListen("--metrics", host, port, e) from None

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop
