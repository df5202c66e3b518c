"""Every report figure of a simulated fleet against the simulator's own truth."""

from __future__ import annotations

import collections
import datetime as dt
import json
import statistics
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from spool.analytics.bounces import classify
from spool.analytics.pipeline import run_report
from spool.analytics.reports import (
    DELAY_BUCKETS,
    TOP,
    accountability,
    reasons,
    traffic_per_day,
)
from spool.analytics.tables import recipients_table
from spool.recovery import FINISH_LOST_REASON

Fleet = tuple[Path, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def report(spark: Any, fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, _ = fleet
    target = tmp_path_factory.mktemp("report") / "out"
    run_report(spark, [str(out / "mx1"), str(out / "mx2")], str(target))
    return target


def _table(report: Path, name: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = pq.read_table(report / "reports" / f"{name}.parquet").to_pylist()
    return rows


def test_the_totals_are_the_truth(report: Path, fleet: Fleet) -> None:
    _, truth = fleet
    status = collections.Counter(t["status"] for t in truth)
    [totals] = _table(report, "totals")
    assert totals["received"] == len({(t["server"], t["msg_id"]) for t in truth})
    assert totals["recipients"] == len(truth)
    for name, key in [
        ("delivered", "delivered"),
        ("failed", "bounced"),
        ("expired", "expired"),
        ("deleted", "deleted"),
        ("queued", "queued"),
    ]:
        assert totals[key] == status[name], key
    messages = {(t["server"], t["msg_id"]): t["size"] for t in truth}
    assert totals["bytes"] == sum(messages.values())
    assert totals["senders"] == len({t["sender"] for t in truth})
    assert totals["recipient_domains"] == len({t["domain"] for t in truth})
    # The simulator defers: every attempt it did not end (expiry needs no attempt).
    ended = {"delivered", "failed"}
    deferrals = sum(t["attempts"] - (t["status"] in ended) for t in truth)
    assert totals["deferrals"] == deferrals
    assert totals["violations"] == 0
    summary = json.loads((report / "summary.json").read_text())
    assert summary["delivered"] == status["delivered"]
    assert summary["accountability_violations"] == []


def test_per_domain_figures_are_the_truth(report: Path, fleet: Fleet) -> None:
    _, truth = fleet
    rows = {r["recipient_domain"]: r for r in _table(report, "per_domain")}
    for domain in {t["domain"] for t in truth}:
        mine = [t for t in truth if t["domain"] == domain]
        count = collections.Counter(t["status"] for t in mine)
        row = rows[domain]
        assert row["recipients"] == len(mine)
        assert row["delivered"] == count["delivered"]
        assert row["bounced"] == count["failed"]
        assert row["expired"] == count["expired"]
        assert row["queued"] == count["queued"]
        delays = [t["final_at"] - t["accepted_at"] for t in mine if t["status"] == "delivered"]
        if delays:
            assert row["delay_max"] == max(delays)
            assert row["delay_p50"] == pytest.approx(statistics.median(delays))
    assert rows["blackhole.example"]["delivered"] == 0
    assert rows["fast.example"]["bounced"] == 0


def test_attempts_and_queue_depth_are_the_truth(report: Path, fleet: Fleet) -> None:
    _, truth = fleet
    attempts = {r["attempts"]: r["recipients"] for r in _table(report, "attempts_per_recipient")}
    assert attempts == dict(collections.Counter(t["attempts"] for t in truth))
    depth = _table(report, "queue_depth")
    for server in ("mx1", "mx2"):
        last = [r for r in depth if r["server"] == server][-1]
        queued = sum(1 for t in truth if t["server"] == server and t["status"] == "queued")
        assert last["queued"] == queued


def _day(epoch: float) -> dt.date:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).date()


def test_traffic_per_day_is_the_truth(report: Path, fleet: Fleet) -> None:
    # pflogsumm's per-day summary: what came in on each UTC day, and what ended on it.
    _, truth = fleet
    rows = {r["day"]: r for r in _table(report, "traffic_per_day")}
    messages = {(t["server"], t["msg_id"]): t for t in truth}
    received = collections.Counter(_day(t["accepted_at"]) for t in messages.values())
    assert {d: r["received"] for d, r in rows.items()} == dict(received)
    sizes: collections.Counter[dt.date] = collections.Counter()
    for t in messages.values():
        sizes[_day(t["accepted_at"])] += t["size"]
    assert {d: r["bytes_received"] for d, r in rows.items()} == dict(sizes)
    for status, column in [("delivered", "delivered"), ("failed", "bounced")]:
        ended = collections.Counter(_day(t["final_at"]) for t in truth if t["status"] == status)
        assert {d: r[column] for d, r in rows.items() if r[column]} == dict(ended), column
    expired = sum(1 for t in truth if t["status"] == "expired")
    assert sum(r["expired"] for r in rows.values()) == expired
    [totals] = _table(report, "totals")
    assert sum(r["deferred"] for r in rows.values()) == totals["deferrals"]


def _epoch(value: dt.datetime) -> float:
    """A timestamp read back from Parquet as seconds (naive ones are UTC: the session's
    time zone)."""
    return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).timestamp()


def _hour(epoch: float) -> float:
    return epoch - epoch % 3600


def test_traffic_per_hour_is_the_truth(report: Path, fleet: Fleet) -> None:
    _, truth = fleet
    rows = {_epoch(r["hour"]): r for r in _table(report, "traffic_per_hour")}
    messages = {(t["server"], t["msg_id"]): t for t in truth}
    received = collections.Counter(_hour(t["accepted_at"]) for t in messages.values())
    assert {h: r["received"] for h, r in rows.items() if r["received"]} == dict(received)
    kinds = [("delivered", "delivered"), ("failed", "bounced"), ("expired", "expired")]
    for status, column in kinds:
        ended = collections.Counter(_hour(t["final_at"]) for t in truth if t["status"] == status)
        assert {h: r[column] for h, r in rows.items() if r[column]} == dict(ended), column


def _percentile(values: list[float], q: int) -> float:
    """Spark's ``percentile``: exact, interpolated linearly between the closest ranks."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def test_delays_and_their_distribution_are_the_truth(report: Path, fleet: Fleet) -> None:
    _, truth = fleet
    delivered = [t for t in truth if t["status"] == "delivered"]
    per_domain = {r["recipient_domain"]: r for r in _table(report, "per_domain")}
    split = {r["recipient_domain"]: r for r in _table(report, "delay_split")}
    for domain in {t["domain"] for t in delivered}:
        mine = [t for t in delivered if t["domain"] == domain]
        delays = [t["final_at"] - t["accepted_at"] for t in mine]
        before = [t["first_attempt_at"] - t["accepted_at"] for t in mine]
        # Attempts take no simulated time: all the rest is waiting between attempts.
        between = [d - b for d, b in zip(delays, before, strict=True)]
        for q in (95, 99):
            assert per_domain[domain][f"delay_p{q}"] == pytest.approx(_percentile(delays, q))
        for name, values in [("before_first_attempt", before), ("between", between)]:
            for q in (50, 95):
                assert split[domain][f"{name}_p{q}"] == pytest.approx(_percentile(values, q))
        assert split[domain]["in_attempts_p95"] == 0
    buckets = collections.Counter()
    for t in delivered:
        delay = t["final_at"] - t["accepted_at"]
        upper = [label for bound, label in DELAY_BUCKETS if bound is None or delay < bound]
        buckets[upper[0]] += 1
    histogram = {r["bucket"]: r["recipients"] for r in _table(report, "delay_distribution")}
    assert histogram == {label: buckets[label] for _bound, label in DELAY_BUCKETS}
    assert sum(histogram.values()) == len(delivered)


def test_top_senders_sender_domains_and_holds_are_the_truth(report: Path, fleet: Fleet) -> None:
    _, truth = fleet
    for table, key in [("top_senders", "sender"), ("top_sender_domains", "sender_domain")]:
        expected: dict[str, dict[str, Any]] = {}
        for t in truth:
            name = t["sender"] if key == "sender" else t["sender"].split("@")[1]
            row = expected.setdefault(name, {"messages": set(), "recipients": 0, "bad": 0})
            row["messages"].add((t["server"], t["msg_id"], t["size"]))
            row["recipients"] += 1
            row["bad"] += t["status"] in ("failed", "expired")
        got = {r[key]: r for r in _table(report, table)}
        assert set(got) == set(expected)  # fewer than the top 20 in the fleet
        for name, e in expected.items():
            assert got[name]["messages"] == len(e["messages"]), name
            assert got[name]["bytes"] == sum(size for _s, _m, size in e["messages"]), name
            assert got[name]["recipients"] == e["recipients"], name
            assert got[name]["bounced_pct"] == round(e["bad"] * 100.0 / e["recipients"], 1)
    [totals] = _table(report, "totals")
    assert totals["holds"] == len({(t["server"], t["msg_id"]) for t in truth if t["held"]}) > 0


def test_queue_depth_over_time_is_the_truth(report: Path, fleet: Fleet) -> None:
    # At the end of each hour: recipients accepted before it and not yet final (delivered,
    # bounced, expired or deleted) before it, per server, hour after hour.
    _, truth = fleet
    depth = _table(report, "queue_depth")
    assert len(depth) > 40  # two servers, a day
    for row in depth:
        end = _epoch(row["hour_end"])
        mine = [t for t in truth if t["server"] == row["server"]]
        accepted = sum(1 for t in mine if t["accepted_at"] < end)
        ended = sum(1 for t in mine if t["final_at"] is not None and t["final_at"] < end)
        assert row["queued"] == accepted - ended, (row["server"], row["hour_end"])


def test_a_window_counts_what_was_accepted_in_it_and_its_outcomes_in_it(
    spark: Any, fleet: Fleet, tmp_path: Path
) -> None:
    out, truth = fleet
    start = min(t["accepted_at"] for t in truth)
    since, until = start + 6 * 3600, start + 18 * 3600
    summary = run_report(
        spark,
        [str(out / "mx1"), str(out / "mx2")],
        str(tmp_path / "r"),
        since=dt.datetime.fromtimestamp(since, dt.UTC),
        until=dt.datetime.fromtimestamp(until, dt.UTC),
    )
    inside = [t for t in truth if since <= t["accepted_at"] < until]
    assert summary["received"] == len({(t["server"], t["msg_id"]) for t in inside})
    assert summary["recipients"] == len(inside)
    ended_inside = [t for t in inside if t["final_at"] is not None and t["final_at"] < until]
    status = collections.Counter(t["status"] for t in ended_inside)
    for name, key in [("delivered", "delivered"), ("failed", "bounced"), ("expired", "expired")]:
        assert summary[key] == status[name], key
    assert summary["deleted"] == status["deleted"]
    assert summary["queued"] == len(inside) - len(ended_inside)
    assert summary["window"] == [
        dt.datetime.fromtimestamp(since, dt.UTC).isoformat(),
        dt.datetime.fromtimestamp(until, dt.UTC).isoformat(),
    ]


def test_traffic_per_day_splits_at_utc_midnight(spark: Any) -> None:
    # A message accepted before midnight and delivered after it: received on the first
    # day, delivered on the second; a retry the day after counts there.
    columns = "server string, msg_id string, kind string, recipient string, time timestamp, "
    columns += "body_size long"
    late = dt.datetime(2026, 11, 1, 23, 59, 30, tzinfo=dt.UTC)
    early = dt.datetime(2026, 11, 2, 0, 0, 30, tzinfo=dt.UTC)
    rows = [
        ("mx", "M1", "accepted", "b@x", late, 100),
        ("mx", "M1", "accepted", "c@x", late, 100),  # one message, two recipients
        ("mx", "M1", "deferred", "c@x", late, 100),
        ("mx", "M1", "delivered", "b@x", early, 100),
        ("mx", "M1", "failed", "c@x", early, 100),
        ("mx", "M2", "accepted", "b@x", early, 7),
    ]
    events = spark.createDataFrame(rows, columns)
    found = [r.asDict() for r in traffic_per_day(events, events).collect()]
    assert found == [
        {
            "day": dt.date(2026, 11, 1),
            "received": 1,
            "delivered": 0,
            "deferred": 1,
            "bounced": 0,
            "expired": 0,
            "bytes_received": 100,
        },
        {
            "day": dt.date(2026, 11, 2),
            "received": 1,
            "delivered": 1,
            "deferred": 0,
            "bounced": 1,
            "expired": 0,
            "bytes_received": 7,
        },
    ]


def test_top_recipients_are_the_truth(report: Path, fleet: Fleet) -> None:
    _, truth = fleet
    mine: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for t in truth:
        mine[t["recipient"]].append(t)
    expected = sorted(
        (
            {
                "recipient": rcpt,
                "messages": len(ts),
                "bytes": sum(t["size"] for t in ts),
                "delivered": sum(t["status"] == "delivered" for t in ts),
                "bounced": sum(t["status"] in ("failed", "expired") for t in ts),
                "queued": sum(t["status"] == "queued" for t in ts),
            }
            for rcpt, ts in mine.items()
        ),
        key=lambda r: (-r["messages"], -r["bytes"], r["recipient"]),
    )[:20]
    rows = _table(report, "top_recipients")
    assert [{k: r[k] for k in expected[0]} for r in rows] == expected
    assert expected[0]["messages"] > 1  # some addresses get more than one message


def test_bounce_classes_follow_the_domains(report: Path, fleet: Fleet) -> None:
    _, truth = fleet
    classes = {r["bounce_class"]: r for r in _table(report, "bounce_classes")}
    status = collections.Counter((t["domain"], t["status"]) for t in truth)
    assert classes["invalid recipient"]["failures"] == status[("strict.example", "failed")]
    assert classes["spam content"]["failures"] == status[("spamcheck.example", "failed")]
    expired = sum(n for (_, s), n in status.items() if s == "expired")
    assert classes["message expired"]["failures"] == expired
    assert classes["no answer from host"]["deferrals"] > 0
    assert classes["policy"]["deferrals"] > 0  # greylisting


def test_reasons_read_the_same_across_messages(report: Path) -> None:
    reasons = _table(report, "reasons")
    unknown = [r for r in reasons if r["enhanced_status"] == "5.1.1"]
    assert len(unknown) == 1  # one reason, whatever the addresses in the replies
    assert unknown[0]["reason"] == "<address>: Recipient address rejected: User unknown"
    spam = [r for r in reasons if r["bounce_class"] == "spam content"]
    assert [r["reason"] for r in spam] == ["Message # rejected as spam"]


def test_reasons_are_ranked_within_each_domain(spark: Any) -> None:
    # One domain fails for 25 reasons, ten times each; another once, for its own reason.
    # Ranked across all domains, the top 20 would be the big one's alone.
    columns = "server string, msg_id string, kind string, recipient string, "
    columns += "recipient_domain string, status string, reply string, enhanced_status string"
    rows = [
        ("mx", f"M{r}-{n}", "failed", f"u{n}@big.example", "big.example", "failed",
         f"550 5.7.1 policy rule {chr(65 + r)} says no", "5.7.1")
        for r in range(25) for n in range(10)
    ]  # fmt: skip
    rows.append(
        ("mx", "S", "failed", "x@small.example", "small.example", "failed",
         "550 5.1.1 <x@small.example>: no such user", "5.1.1")
    )  # fmt: skip
    rows += [
        ("mx", f"D{d}", "deferred", f"y@d{d}.example", f"d{d}.example", "deferred",
         "451 4.7.1 try later", "4.7.1")
        for d in range(TOP + 5)
    ]  # fmt: skip
    found = [r.asDict() for r in reasons(spark.createDataFrame(rows, columns), None).collect()]
    failed = [r for r in found if r["kind"] == "failed"]
    assert [(r["recipient_domain"], r["count"]) for r in failed] == [("big.example", 10)] * 5 + [
        ("small.example", 1)
    ]
    assert [r["reason"] for r in failed[:2]] == ["policy rule A says no", "policy rule B says no"]
    assert failed[0]["domain_count"] == 250 and failed[-1]["domain_count"] == 1
    assert failed[-1]["example_msg_id"] == "S"
    deferred = [r["recipient_domain"] for r in found if r["kind"] == "deferred"]
    assert deferred == sorted(f"d{d}.example" for d in range(TOP + 5))[:TOP]


def test_the_page_ties_the_reports_and_plots_together(report: Path) -> None:
    page = (report / "index.html").read_text()
    for name in ("totals", "per_domain", "queue_depth", "accountability"):
        assert f"reports/{name}.parquet" in page
        assert (report / "reports" / f"{name}.parquet").exists()
    for plot in ("traffic_per_hour", "queue_depth", "delay_distribution"):
        assert (report / "plots" / f"{plot}.png").stat().st_size > 1000
        assert f"plots/{plot}.png" in page
    assert "every accepted recipient has exactly one final outcome" in page
    assert list((report / "tables" / "events").glob("server=mx1/day=*/*.parquet"))
    assert list((report / "tables" / "recipients").glob("server=mx2/day=*/*.parquet"))


def test_accountability_lists_a_recipient_delivered_twice(spark: Any) -> None:
    # The spool never writes this (its contract); the check must still see it if it did.
    columns = "server string, msg_id string, kind string, recipient string, time timestamp, "
    columns += "sender string, sender_domain string, recipient_domain string, body_size long, "
    columns += "status string, reply string, segment long, offset long, in_attempt double"
    at = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    ok = "250 ok"
    rows = [
        ("mx", "M1", "accepted", "b@x", at, "a@y", "y", "x", 10, None, None, 1, 10, None),
        ("mx", "M1", "delivered", "b@x", at, None, None, "x", 10, "delivered", ok, 1, 20, 0.0),
        ("mx", "M1", "delivered", "b@x", at, None, None, "x", 10, "delivered", ok, 1, 30, 0.0),
        ("mx", "M2", "accepted", "c@x", at, "a@y", "y", "x", 10, None, None, 1, 40, None),
    ]
    events = spark.createDataFrame(rows, columns)
    found = accountability(events, recipients_table(events)).collect()
    assert [(r.msg_id, r.recipient, r.finals) for r in found] == [("M1", "b@x", 2)]


@pytest.mark.parametrize(
    ("status", "reply", "expected"),
    [
        ("5.1.1", "550 5.1.1 <x@y>: User unknown", "invalid recipient"),
        (
            "5.7.1",
            "550 5.7.1 Service unavailable; client host blocked using Spamhaus",
            "spam block",
        ),
        ("5.2.2", "552 5.2.2 Mailbox full", "quota"),
        ("4.4.1", "451 4.4.1 no answer from host", "no answer from host"),
        ("5.4.7", "554 5.4.7 message expired: too long in the queue", "message expired"),
        ("5.7.26", "550 5.7.26 Unauthenticated email is not accepted (DMARC)", "authentication"),
        (None, "550 Host not found", "dns failure"),
        ("5.0.0", "550 5.0.0 something else", "uncategorised"),
    ],
)
def test_the_bounce_rules_classify_what_providers_say(
    status: str | None, reply: str, expected: str
) -> None:
    assert classify(status, reply) == expected


def test_an_empty_spool_reports_zeros(spark: Any, tmp_path: Path) -> None:
    from spool import Spool

    Spool.open(tmp_path / "empty").close()
    summary = run_report(spark, [str(tmp_path / "empty")], str(tmp_path / "r"))
    assert summary["received"] == summary["delivered"] == summary["deferrals"] == 0
    assert summary["bytes"] == 0 and summary["accountability_violations"] == []
    assert (tmp_path / "r" / "index.html").is_file()
    # A second run replaces the first whole and leaves nothing beside it.
    run_report(spark, [str(tmp_path / "empty")], str(tmp_path / "r"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "r"]


@pytest.mark.parametrize("lost", ["delta and finish", "finish"])
def test_a_finish_that_damage_took_leaves_its_recipients_out_of_the_queue(
    spark: Any, tmp_path: Path, lost: str
) -> None:
    # Recovery writes a finish naming no recipient when damage took the one that named
    # them and an acknowledgement of its outcome survived (docs/design.md, R6). The
    # message left the queue: a recipient whose failed delta survived is bounced; one whose
    # outcome no record names any more is "unknown" and listed by the accountability check,
    # never counted as queued for ever.
    from spool import records as rec
    from spool.check import repair_spool
    from tests.contract.test_repair_acknowledged_finish import (
        damage_records,
        finished_and_acknowledged,
    )

    root = tmp_path / "spool"
    m = finished_and_acknowledged(root, b"m" * 500, deliver=False)
    damage_records(root, m, (rec.Delta, rec.Finish) if lost != "finish" else (rec.Finish,))
    assert repair_spool(str(root)).after.clean
    summary = run_report(spark, [str(root)], str(tmp_path / "r"))
    out = tmp_path / "r"
    mine = {
        r["recipient"]: r for r in _table_rows(out / "tables" / "recipients") if r["msg_id"] == m
    }
    assert set(mine) == {"bob@x.net", "carol@x.net"}
    assert not any(r["still_queued"] for r in mine.values())
    if lost == "finish":
        assert {r["final_status"] for r in mine.values()} == {"failed"}
        assert summary["bounced"] == 2 and summary["unknown"] == 0
        assert summary["accountability_violations"] == []
        return
    assert {r["final_status"] for r in mine.values()} == {"unknown"}
    assert summary["bounced"] == 0 and summary["unknown"] == 2 and summary["queued"] == 1
    assert summary["violations"] == 2
    assert summary["accountability_violations"] == [
        f"spool {m} {r}: finished with no outcome recorded: {FINISH_LOST_REASON}"
        for r in ("bob@x.net", "carol@x.net")
    ]
    assert "with none although their message finished" in (out / "index.html").read_text()


def _table_rows(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
    return rows
