"""The Spark data source ``spool`` on a real local Spark: batch, SQL and streaming."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

from spool import Spool
from spool.analytics.events import plan_segments, segment_rows
from spool.analytics.source import PARTITION_BYTES, SpoolStreamReader, collector_paused, pack
from spool.testing import FakeClock, deliver_all


def test_spark_reads_what_the_plain_decoder_reads(spark: Any, fleet: tuple[Path, Any]) -> None:
    out, _ = fleet
    sources = [str(out / "mx1"), str(out / "mx2")]
    plain = sorted(tuple(row) for s in plan_segments(sources) for row in segment_rows(s))
    df = spark.read.format("spool").load(",".join(sources))
    assert df.rdd.getNumPartitions() == len(pack(plan_segments(sources)))
    assert sorted(tuple(r) for r in df.collect()) == plain


def test_small_segments_are_packed_into_partitions(fleet: tuple[Path, Any]) -> None:
    out, _ = fleet
    plan = plan_segments([str(out / "mx1")])
    parts = pack(plan)
    assert [s for p in parts for s in p.sources] == plan  # each once, in order
    assert 1 <= len(parts) < len(plan)  # the simulator's segments are small
    big = [s for s in plan if s.segment == plan[0].segment]
    assert len(pack(big * 3)) == 1 and PARTITION_BYTES > 3 * 256 * 1024


def test_a_temporary_view_over_a_spool(spark: Any, fleet: tuple[Path, Any]) -> None:
    out, truth = fleet
    spark.sql(
        f"CREATE OR REPLACE TEMPORARY VIEW mx1_log USING spool OPTIONS (path '{out / 'mx1'}')"
    )
    [row] = spark.sql(
        "SELECT count(DISTINCT msg_id) AS n FROM mx1_log WHERE kind = 'accepted'"
    ).collect()
    assert row.n == len({t["msg_id"] for t in truth if t["server"] == "mx1"})


def test_a_stream_follows_a_live_spool(spark: Any, tmp_path: Path) -> None:
    root = tmp_path / "live"
    clock = FakeClock()
    sp = Spool.open(root, clock=clock)
    try:
        first = [sp.accept("a@example.org", ["b@example.net"], b"one %d" % n) for n in range(3)]
        sink = tmp_path / "sink"
        checkpoint = tmp_path / "checkpoint"

        def run() -> None:
            query = (
                spark.readStream.format("spool")
                .load(str(root))
                .writeStream.format("parquet")
                .option("path", str(sink))
                .option("checkpointLocation", str(checkpoint))
                .trigger(availableNow=True)
                .start()
            )
            query.awaitTermination(120)

        sp.sync()
        run()
        seen = spark.read.parquet(str(sink)).where("kind = 'accepted'").select("msg_id").collect()
        assert sorted(r.msg_id for r in seen) == sorted(first)
        second = [sp.accept("a@example.org", ["b@example.net"], b"two %d" % n) for n in range(2)]
        deliver_all(sp)
        sp.sync()
        run()  # from the checkpoint: only what was written since
        rows = spark.read.parquet(str(sink))
        accepted = [r.msg_id for r in rows.where("kind = 'accepted'").collect()]
        assert sorted(accepted) == sorted(first + second)  # each once
        assert rows.where("kind = 'delivered'").count() == 5
    finally:
        sp.close()


def test_the_stream_reader_keeps_complete_segments_and_follows_a_rollover(tmp_path: Path) -> None:
    # A complete segment's end is looked for once; the newest, looked at each time, grows
    # and, rolled over, is read to its end. Every accept is read once over three looks.
    root = tmp_path / "live"
    reader = SpoolStreamReader([str(root)], "error")
    accepted: list[str] = []
    offsets: dict[str, int] = {}
    read: list[str] = []
    with Spool.open(root, clock=FakeClock(), segment_size=4096) as sp:
        for round_ in range(3):
            accepted += [
                sp.accept("a@example.org", ["b@example.net"], b"%d %d" % (round_, n) * 40)
                for n in range(12)
            ]
            sp.sync()
            latest = reader.latestOffset(offsets)
            for partition in reader.partitions(offsets, latest):
                for batch in reader.read(partition):
                    rows = batch.to_pylist()
                    read += [r["msg_id"] for r in rows if r["kind"] == "accepted"]
            offsets = latest
    assert len(offsets) > 3  # it rolled over
    assert sorted(read) == sorted(accepted)
    newest = max(offsets, key=lambda k: int(k.split("|")[1]))
    assert set(reader._final) == set(offsets) - {newest}


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_for_a_batch_and_left_as_it_was(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(ZeroDivisionError), collector_paused():
            1 / 0  # noqa: B018
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
