"""Fixed-bucket histograms of the log writer: fsync latency and group-commit batch size.

Kept as plain counts per bucket (not cumulative) and a sum, so that a snapshot is a tuple
that crosses the control socket as it is and ``spool.metrics`` turns into Prometheus
histograms (cumulative ``le`` buckets) at a scrape. Observing costs a bisect: the writer
records one latency per fdatasync and one size per batch, never per record.
"""

from __future__ import annotations

import bisect
from typing import Final

# Upper bounds (inclusive, as Prometheus's ``le``); one bucket more counts what lies above.
FSYNC_SECONDS_BOUNDS: Final = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
BATCH_RECORDS_BOUNDS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class Histogram:
    """Counts per bucket of ``bounds`` (the last bucket: above every bound) and their sum.
    Not thread-safe: the writer observes and reads it under its lock."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> tuple[int, ...]:
        return tuple(self.counts)


def cumulative(bounds: tuple[float, ...], counts: tuple[int, ...]) -> list[tuple[str, int]]:
    """Prometheus buckets (``le``, count of observations at or below it), ``+Inf`` last."""
    out, total = [], 0
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        total += count
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    return out
