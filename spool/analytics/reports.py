"""The reports: small tables computed by Spark from ``events`` and ``recipients``.

Each report is a function of the two tables returning a DataFrame small enough to collect
(rows per domain, hour, reason, ...); ``REPORTS`` lists them in the order the HTML page
shows them. Figures follow the spool's records, not a log parser's guesses:

- *received* counts accepted messages, *recipients* their accepted recipients;
- *delivered*, *bounced* (failed for any reason but age), *expired*, *deleted*, *queued*
  and *unknown* count recipients by their final status (*unknown*: the message finished
  with no record of the recipient's outcome, lost to disk damage; see ``tables``);
  *deferrals* counts deferral events;
- delays are from acceptance to the final outcome, in seconds; the delay split follows
  Postfix's ``delays=a/b/c``: before the first attempt, waiting between attempts, inside
  attempts;
- queue depth is reconstructed from the records: recipients accepted and not yet final at
  the end of each hour;
- the accountability check lists every recipient with more than one final outcome, or
  with none although its message finished (the spool's contract is exactly one, or none
  while queued).
"""

from __future__ import annotations

from collections.abc import Callable

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from spool.analytics.bounces import bounce_class
from spool.analytics.tables import UNKNOWN

Report = Callable[[DataFrame, DataFrame], DataFrame]

# Delay buckets: (upper bound in seconds, label); the last is open.
DELAY_BUCKETS = (
    (60, "under 1 min"),
    (300, "1-5 min"),
    (900, "5-15 min"),
    (3600, "15-60 min"),
    (4 * 3600, "1-4 h"),
    (24 * 3600, "4-24 h"),
    (None, "over 1 day"),
)
TOP = 20
TOP_REASONS = 5  # reasons shown per domain (``reasons``)


def _count(condition: Column) -> Column:
    return F.coalesce(F.sum(F.when(condition, 1).otherwise(0)), F.lit(0))


def _status(name: str) -> Column:
    return F.col("final_status") == name


def _pct(part: Column, whole: Column) -> Column:
    return F.round(F.when(whole > 0, part * 100.0 / whole), 1)


def _delays(column: str = "delay") -> list[Column]:
    delivered = F.when(_status("delivered"), F.col(column))
    # One exact percentile aggregate for the three (each holds every value of its group).
    p50, p95, p99 = _percentiles(delivered, 0.5, 0.95, 0.99)
    return [
        p50.alias("delay_p50"),
        p95.alias("delay_p95"),
        p99.alias("delay_p99"),
        F.max(delivered).alias("delay_max"),
    ]


def _percentiles(column: Column | str, *fractions: float) -> list[Column]:
    """Exact percentiles of ``column`` (as ``F.percentile``), from one aggregate."""
    found = F.percentile(column, list(fractions))
    return [found.getItem(n) for n in range(len(fractions))]


def _outcome_counts(events: DataFrame) -> DataFrame:
    """Per server: the event counts the totals need beyond the recipients table."""
    held = F.when(F.col("kind") == "held", F.col("msg_id"))
    return events.groupBy("server").agg(
        _count(F.col("kind") == "deferred").alias("deferrals"),
        F.countDistinct(held).alias("holds"),  # messages held at least once
    )


def _figures(recipients: DataFrame) -> list[Column]:
    return [
        F.countDistinct("server", "msg_id").alias("received"),
        F.count("*").alias("recipients"),
        _count(_status("delivered")).alias("delivered"),
        _count(_status("failed")).alias("bounced"),
        _count(_status("expired")).alias("expired"),
        _count(_status("deleted")).alias("deleted"),
        _count(_status("queued")).alias("queued"),
        _count(_status(UNKNOWN)).alias("unknown"),
        _count(F.col("deferrals") > 0).alias("deferred_recipients"),
        F.countDistinct("sender").alias("senders"),
        F.countDistinct("recipient").alias("recipient_addresses"),
        F.countDistinct("recipient_domain").alias("recipient_domains"),
    ]


def _bytes(recipients: DataFrame, *by: str) -> DataFrame:
    messages = recipients.dropDuplicates(["server", "msg_id"])
    return messages.groupBy(*by).agg(F.sum("body_size").alias("bytes"))


def totals(events: DataFrame, recipients: DataFrame) -> DataFrame:
    """One row: the headline figures of the whole data."""
    figures = recipients.agg(*_figures(recipients), F.countDistinct("server").alias("servers"))
    counts = _outcome_counts(events).agg(
        F.coalesce(F.sum("deferrals"), F.lit(0)).alias("deferrals"),
        F.coalesce(F.sum("holds"), F.lit(0)).alias("holds"),
    )
    bytes_ = _bytes(recipients).select(F.coalesce("bytes", F.lit(0)).alias("bytes"))
    violations = accountability(events, recipients).agg(F.count("*").alias("violations"))
    return figures.crossJoin(counts).crossJoin(bytes_).crossJoin(violations)


def per_server(events: DataFrame, recipients: DataFrame) -> DataFrame:
    """The headline figures per server, to compare the members of a fleet."""
    # The delays apart from the distinct counts: in one aggregate, each distinct count
    # expands the rows once more, and the percentiles then held every copy (twice as slow).
    figures = recipients.groupBy("server").agg(*_figures(recipients))
    delays = recipients.groupBy("server").agg(*_delays())
    return (
        figures.join(delays, "server")
        .join(_outcome_counts(events), "server", "left")
        .join(_bytes(recipients, "server"), "server", "left")
        .orderBy("server")
    )


def traffic_per_hour(events: DataFrame, recipients: DataFrame) -> DataFrame:
    """Per hour: messages received; recipients delivered, deferred, bounced, expired."""
    return _traffic(events, "hour", F.date_trunc("hour", "time"))


def traffic_per_day(events: DataFrame, recipients: DataFrame) -> DataFrame:
    """pflogsumm's per-day traffic summary: per UTC day, messages received and bytes
    received; recipients delivered, deferred, bounced, expired."""
    day = F.to_date("time")
    received = events.where(F.col("kind") == "accepted").dropDuplicates(["server", "msg_id"])
    bytes_ = received.groupBy(day.alias("day")).agg(F.sum("body_size").alias("bytes_received"))
    return _traffic(events, "day", day).join(bytes_, "day", "left").orderBy("day")


def _traffic(events: DataFrame, name: str, unit: Column) -> DataFrame:
    """Per ``unit`` of time (named ``name``): messages received; recipients delivered,
    deferred, bounced, expired."""
    kind = F.col("kind")
    return (
        events.groupBy(unit.alias(name))
        .agg(
            F.countDistinct(F.when(kind == "accepted", F.concat_ws("|", "server", "msg_id"))).alias(
                "received"
            ),
            _count(kind == "delivered").alias("delivered"),
            _count(kind == "deferred").alias("deferred"),
            _count(kind == "failed").alias("bounced"),
            _count(kind == "expired").alias("expired"),
        )
        .orderBy(name)
    )


def per_domain(events: DataFrame, recipients: DataFrame) -> DataFrame:
    """Per recipient domain: volume, delivered and bounce rates, deferrals, delays."""
    r = recipients
    grouped = r.groupBy("recipient_domain").agg(
        F.count("*").alias("recipients"),
        _count(_status("delivered")).alias("delivered"),
        F.sum("deferrals").alias("deferrals"),
        _count(_status("failed")).alias("bounced"),
        _count(_status("expired")).alias("expired"),
        _count(_status("deleted")).alias("deleted"),
        _count(_status("queued")).alias("queued"),
        _count(_status(UNKNOWN)).alias("unknown"),
        *_delays(),
    )
    return grouped.select(
        "recipient_domain",
        "recipients",
        "delivered",
        _pct(F.col("delivered"), F.col("recipients")).alias("delivered_pct"),
        "deferrals",
        "bounced",
        _pct(F.col("bounced"), F.col("recipients")).alias("bounced_pct"),
        "expired",
        "deleted",
        "queued",
        "unknown",
        "delay_p50",
        "delay_p95",
        "delay_p99",
        "delay_max",
    ).orderBy(F.desc("recipients"), "recipient_domain")


def normalised_reply(reply: Column) -> Column:
    """The reply text with its codes cut off and addresses, ids and numbers replaced, so
    that the same reason from different messages reads the same."""
    text = F.regexp_replace(reply, r"^[2-5][0-9][0-9][ -]([245]\.[0-9]{1,3}\.[0-9]{1,3} )?", "")
    text = F.regexp_replace(text, r"<[^>]*>|[^\s<>]+@[^\s<>]+", "<address>")
    text = F.regexp_replace(text, r"\b[0-9A-Fa-f]*[0-9][0-9A-Fa-f]*\b", "#")
    return F.trim(text)


def _failures(events: DataFrame) -> DataFrame:
    kinds = F.col("kind").isin("deferred", "failed", "expired")
    return events.where(kinds).withColumn(
        "bounce_class", bounce_class(F.col("enhanced_status"), F.col("reply"))
    )


def reasons(events: DataFrame, recipients: DataFrame) -> DataFrame:
    """The top deferral and bounce reasons within each recipient domain, by enhanced
    status code and normalised text, with their class and one message that met each:
    for each kind (deferred, failed, expired), the ``TOP`` domains with the most such
    events, and the ``TOP_REASONS`` commonest reasons of each (a domain with a handful of
    failures still shows why, however many a larger one has)."""
    rows = _failures(events).withColumn("reason", normalised_reply(F.col("reply")))
    grouped = rows.groupBy(
        "kind", "recipient_domain", "enhanced_status", "reason", "bounce_class"
    ).agg(F.count("*").alias("count"), F.min("msg_id").alias("example_msg_id"))
    domain = Window.partitionBy("kind", "recipient_domain")
    within = domain.orderBy(F.desc("count"), "reason", "enhanced_status")
    ranked = grouped.withColumn("reason_rank", F.row_number().over(within)).withColumn(
        "domain_count", F.sum("count").over(domain)
    )
    # A domain's rank within its kind: a dense rank over its rows, which all share its
    # count (one pass over ``ranked``; a join of its distinct domains read it twice).
    by_domain = Window.partitionBy("kind").orderBy(F.desc("domain_count"), "recipient_domain")
    return (
        ranked.withColumn("domain_rank", F.dense_rank().over(by_domain))
        .where((F.col("reason_rank") <= TOP_REASONS) & (F.col("domain_rank") <= TOP))
        .orderBy("kind", "domain_rank", "reason_rank")
        .select(
            "kind",
            "recipient_domain",
            "domain_count",
            "enhanced_status",
            "reason",
            "bounce_class",
            "count",
            "example_msg_id",
        )
    )


def bounce_classes(events: DataFrame, recipients: DataFrame) -> DataFrame:
    """Per bounce class: failures (bounced and expired recipients) and deferrals."""
    return (
        _failures(events)
        .groupBy("bounce_class")
        .agg(
            _count(F.col("kind").isin("failed", "expired")).alias("failures"),
            _count(F.col("kind") == "deferred").alias("deferrals"),
        )
        .orderBy(F.desc("failures"), F.desc("deferrals"), "bounce_class")
    )


def delay_distribution(events: DataFrame, recipients: DataFrame) -> DataFrame:
    """Delivered recipients per delay bucket (acceptance to delivery)."""
    bucket: Column | None = None
    for order, (upper, label) in enumerate(DELAY_BUCKETS):
        value = F.struct(F.lit(order).alias("order"), F.lit(label).alias("bucket"))
        if upper is None:
            assert bucket is not None
            bucket = bucket.otherwise(value)
        else:
            test = F.col("delay") < upper
            bucket = F.when(test, value) if bucket is None else bucket.when(test, value)
    assert bucket is not None
    counted = (
        recipients.where(_status("delivered"))
        .select(bucket.alias("b"))
        .groupBy("b.order", "b.bucket")
        .agg(F.count("*").alias("recipients"))
    )
    every = recipients.sparkSession.createDataFrame(
        [(order, label) for order, (_, label) in enumerate(DELAY_BUCKETS)],
        "order int, bucket string",
    )  # empty buckets too: the histogram's axis never skips one
    return (
        every.join(counted, ["order", "bucket"], "left")
        .select("order", "bucket", F.coalesce("recipients", F.lit(0)).alias("recipients"))
        .orderBy("order")
        .drop("order")
    )


def attempts_per_recipient(events: DataFrame, recipients: DataFrame) -> DataFrame:
    """Recipients by the number of attempts that reported them (final or deferred)."""
    return (
        recipients.groupBy("attempts")
        .agg(F.count("*").alias("recipients"), _count(_status("delivered")).alias("delivered"))
        .orderBy("attempts")
    )


def delay_split(events: DataFrame, recipients: DataFrame) -> DataFrame:
    """Per recipient domain, for delivered recipients, Postfix's ``delays=a/b/c`` as
    medians and 95th percentiles: before the first attempt, waiting between attempts,
    inside attempts (seconds)."""
    delivered = recipients.where(_status("delivered")).withColumn(
        "between", F.col("delay") - F.col("before_first_attempt") - F.col("in_attempts")
    )
    cols = []
    for name in ("before_first_attempt", "between", "in_attempts"):
        p50, p95 = _percentiles(name, 0.5, 0.95)
        cols += [p50.alias(f"{name}_p50"), p95.alias(f"{name}_p95")]
    return delivered.groupBy("recipient_domain").agg(*cols).orderBy("recipient_domain")


def queue_depth(events: DataFrame, recipients: DataFrame) -> DataFrame:
    """Per server and hour: recipients accepted and not yet final at the end of the hour."""
    hours = F.date_trunc("hour", F.col("at")) + F.expr("INTERVAL 1 HOUR")
    changes = (
        recipients.select("server", F.col("accepted_at").alias("at"), F.lit(1).alias("change"))
        .unionByName(
            recipients.where(F.col("final_at").isNotNull()).select(
                "server", F.col("final_at").alias("at"), F.lit(-1).alias("change")
            )
        )
        .groupBy("server", hours.alias("hour_end"))
        .agg(F.sum("change").alias("change"))
    )
    running = (
        Window.partitionBy("server").orderBy("hour_end").rowsBetween(Window.unboundedPreceding, 0)
    )
    return (
        changes.withColumn("queued", F.sum("change").over(running))
        .select("server", "hour_end", "queued")
        .orderBy("server", "hour_end")
    )


def top_senders(events: DataFrame, recipients: DataFrame) -> DataFrame:
    """The senders with the most messages, with their recipients, bytes and bounce rate."""
    return _senders(recipients, "sender")


def top_sender_domains(events: DataFrame, recipients: DataFrame) -> DataFrame:
    """The sender domains with the most messages."""
    return _senders(recipients, "sender_domain")


def top_recipients(events: DataFrame, recipients: DataFrame) -> DataFrame:
    """pflogsumm's recipients by message count: the addresses sent the most messages, with
    their bytes, how many were delivered, bounced and are still queued, and the deferrals
    they met."""
    return (
        recipients.groupBy("recipient")
        .agg(
            F.count("*").alias("messages"),
            F.sum("body_size").alias("bytes"),
            _count(_status("delivered")).alias("delivered"),
            _count(_status("failed") | _status("expired")).alias("bounced"),
            _count(_status("queued")).alias("queued"),
            F.sum("deferrals").alias("deferrals"),
        )
        .orderBy(F.desc("messages"), F.desc("bytes"), "recipient")
        .limit(TOP)
    )


def _senders(recipients: DataFrame, by: str) -> DataFrame:
    messages = (
        _bytes(recipients, by, "server", "msg_id")
        .groupBy(by)
        .agg(F.count("*").alias("messages"), F.sum("bytes").alias("bytes"))
    )
    rcpts = recipients.groupBy(by).agg(
        F.count("*").alias("recipients"),
        _pct(_count(_status("failed") | _status("expired")), F.count("*")).alias("bounced_pct"),
    )
    return messages.join(rcpts, by).orderBy(F.desc("messages"), by).limit(TOP)


def accountability(events: DataFrame, recipients: DataFrame) -> DataFrame:
    """Every accepted recipient with more than one final outcome (a duplicate delivery or
    a contradiction), or with none although its message finished (its outcome lost to disk
    damage: the finish's reason says so), by message id, with the problem in words: empty
    when the spool kept its contract."""
    twice = F.col("finals") > 1
    problem = F.when(twice, F.concat(F.col("finals").cast("string"), F.lit(" final outcomes")))
    # (R5's finish names the recipients whose deltas survived and says why in its reason,
    # which their rows do not carry: a recipient it leaves out has no reason to quote.)
    why = F.when(F.col("lost_why") != "", F.concat(F.lit(": "), F.col("lost_why")))
    lost = F.concat(F.lit("finished with no outcome recorded"), F.coalesce(why, F.lit("")))
    return (
        recipients.where(twice | _status(UNKNOWN))
        .select(
            "server",
            "msg_id",
            "recipient",
            "finals",
            "final_status",
            F.coalesce(problem, lost).alias("problem"),
        )
        .orderBy("server", "msg_id", "recipient")
    )


REPORTS: dict[str, Report] = {
    "totals": totals,
    "per_server": per_server,
    "traffic_per_hour": traffic_per_hour,
    "traffic_per_day": traffic_per_day,
    "per_domain": per_domain,
    "reasons": reasons,
    "bounce_classes": bounce_classes,
    "delay_distribution": delay_distribution,
    "delay_split": delay_split,
    "attempts_per_recipient": attempts_per_recipient,
    "queue_depth": queue_depth,
    "top_senders": top_senders,
    "top_sender_domains": top_sender_domains,
    "top_recipients": top_recipients,
    "accountability": accountability,
}
