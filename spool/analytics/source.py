"""The Spark data source ``spool``: the records of spool logs as a DataFrame.

    spark.dataSource.register(SpoolDataSource)
    spark.read.format("spool").load("mx1=/var/spool/mx1,/var/spool/mx2")
    CREATE TEMPORARY VIEW log USING spool OPTIONS (path '/var/spool/mx1')

``path`` is a comma-separated list of sources, each a spool directory or an archive
directory, optionally named (``NAME=PATH``; the server name defaults to the directory's
name). One partition per segment (small segments packed together up to 32 MiB); each
yields Arrow record batches of the rows
``events.segment_rows`` decodes (the columns of ``events.COLUMNS``). The option
``on_damage`` is ``error`` (the default: damage fails the query, naming file and offset)
or ``skip`` (one row of kind ``damaged`` per damaged segment, the rest of it skipped).
The stream reader follows live spools: its offsets are byte offsets of frames per
segment (log positions), so a query restarted from a checkpoint reads on where it stopped.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import ReadLimit
from pyspark.sql.types import StructType

from spool import format as fmt
from spool.analytics.events import (
    COLUMNS,
    SCHEMA,
    SegmentSource,
    plan_segments,
    readable_end,
    segment_rows,
)

BATCH_ROWS = 8192
_ARROW_TYPES = {
    "string": pa.string(),
    "long": pa.int64(),
    "double": pa.float64(),
    "int": pa.int32(),
}
ARROW_SCHEMA = pa.schema([(name, _ARROW_TYPES[kind]) for name, kind in COLUMNS])
_ROW = pa.struct(list(ARROW_SCHEMA))  # a row of the source, as Arrow converts tuples
ON_DAMAGE = ("error", "skip")


class SegmentPartition(InputPartition):
    """Segments to read in one task (``events.SegmentSource``): the frames of each from
    byte ``start`` to ``stop`` (whole segments by default; a stream reads a slice of one)."""

    def __init__(
        self, sources: list[SegmentSource], start: int = 0, stop: int | None = None
    ) -> None:
        super().__init__([(s.server, s.segment) for s in sources])
        self.sources = sources
        self.start = start
        self.stop = stop


# Segments are read one partition each, small ones packed together up to this size: a
# Spark task costs tens of milliseconds, a whole 64 MiB segment (the default) seconds.
PARTITION_BYTES = 32 * 1024 * 1024


def pack(plan: list[SegmentSource]) -> list[SegmentPartition]:
    """``plan`` in partitions: consecutive segments up to ``PARTITION_BYTES`` of files."""
    parts: list[SegmentPartition] = []
    group: list[SegmentSource] = []
    size = 0
    for source in plan:
        try:
            length = os.path.getsize(os.path.join(source.log_dir, fmt.segment_name(source.segment)))
        except OSError:
            length = 0
        if group and size + length > PARTITION_BYTES:
            parts.append(SegmentPartition(group))
            group, size = [], 0
        group.append(source)
        size += length
    if group:
        parts.append(SegmentPartition(group))
    return parts


class SpoolDataSource(DataSource):
    """``format("spool")``: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return "spool"

    def schema(self) -> str:
        return SCHEMA

    def _sources(self) -> list[str]:
        raw = self.options.get("path") or self.options.get("paths")
        if not raw:
            raise ValueError("spool data source: give the spool directories as load(PATH) or path")
        if raw.startswith("["):  # load([...]) may pass a JSON list
            return [str(p) for p in json.loads(raw)]
        return [p for p in raw.split(",") if p.strip()]

    def _on_damage(self) -> str:
        value = self.options.get("on_damage", "error")
        if value not in ON_DAMAGE:
            raise ValueError(
                f"spool data source: on_damage must be one of {ON_DAMAGE}, not {value!r}"
            )
        return str(value)

    def reader(self, schema: StructType) -> DataSourceReader:
        return SpoolReader(plan_segments(self._sources()), self._on_damage())

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return SpoolStreamReader(self._sources(), self._on_damage())


class SpoolReader(DataSourceReader):
    """A batch read: every segment of the sources, as planned on the driver."""

    def __init__(self, plan: list[SegmentSource], on_damage: str) -> None:
        self.plan = plan
        self.on_damage = on_damage

    def partitions(self) -> Sequence[InputPartition]:
        return pack(self.plan)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SegmentPartition)
        yield from arrow_batches(partition, self.on_damage)


def arrow_batches(partition: SegmentPartition, on_damage: str) -> Iterator[pa.RecordBatch]:
    """The rows of one partition in Arrow batches of ``BATCH_ROWS`` (a batch may hold
    the rows of several segments)."""
    rows = itertools.chain.from_iterable(
        segment_rows(source, on_damage=on_damage, start=partition.start, stop=partition.stop)
        for source in partition.sources
    )
    while True:
        with collector_paused():  # (a batch's rows, then its Arrow arrays: no cycles)
            rows_taken = list(itertools.islice(rows, BATCH_ROWS))
            batch = _batch(rows_taken) if rows_taken else None
        if batch is None:
            return
        yield batch


def _batch(rows: list[tuple[Any, ...]]) -> pa.RecordBatch:
    # The rows as one struct array, converted by Arrow in one pass, then its fields as
    # the columns: 0.47 µs a row, against 0.78 µs for a transpose into one list a column.
    return pa.RecordBatch.from_struct_array(pa.array(rows, type=_ROW))


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused for the ``with`` block, then left as it was
    found (a caller that had paused it keeps it paused). For taking a batch of rows and
    making its Arrow batch: rows are tuples of text and numbers and none of it makes
    cycles, but a collector that runs every 700 new objects while a batch holds thousands
    cost a tenth of the data source's time (docs/performance.md). Never held while the
    caller has the batch."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


class SpoolStreamReader(DataSourceStreamReader):
    """Follows live spools. An offset maps ``server|segment`` to the byte offset of the
    next unread frame: each micro-batch reads the whole frames written since (a segment
    only grows; a retired one is read on from its archive, under the same number).

    Only a source's newest segment grows: one that was not the newest when looked at is
    complete (the writer starts a segment once the one before is synced), so its end is
    looked for once and kept (``_final``), and a micro-batch opens the newest segments
    only, not every segment of the archives again."""

    def __init__(self, sources: list[str], on_damage: str) -> None:
        self.sources = sources
        self.on_damage = on_damage
        self._final: dict[str, int] = {}  # the end of each complete segment looked at

    def initialOffset(self) -> dict[str, int]:
        return {}

    def latestOffset(
        self, start: dict[str, int] | None = None, limit: ReadLimit | None = None
    ) -> dict[str, int]:
        """Every segment's end of whole frames, looked for from ``start`` on (so a look
        costs what was written since the last one, not the whole log)."""
        start = start or {}
        latest = dict(start)
        for source in plan_segments(self.sources):
            key = _key(source)
            if key in self._final:
                latest[key] = self._final[key]
                continue
            latest[key] = readable_end(source, start.get(key, 0))
            if source.newest != source.segment:
                self._final[key] = latest[key]
        return latest

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        by_key = {_key(s): s for s in plan_segments(self.sources)}
        return [
            SegmentPartition([by_key[key]], start.get(key, 0), stop)
            for key, stop in sorted(end.items())
            if key in by_key and stop > start.get(key, 0)
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SegmentPartition)
        yield from arrow_batches(partition, self.on_damage)

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to release: the spool is only read."""


def _key(source: SegmentSource) -> str:
    # The server and the segment number: an archived segment keeps its key.
    return f"{source.server}|{source.segment}"
