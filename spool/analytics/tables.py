"""The ``events`` and ``recipients`` tables, derived from the data source's rows.

``events``: one row per record and recipient that means something to an operator, with
the kinds accepted, started, delivered, deferred, failed, expired, deleted, held, released
and finished; the sender and body size of the message on every row, domains split off,
the reply's code and enhanced status code parsed out, the attempt number counted.
A replacement envelope is bookkeeping unless it holds or releases the message: those
become ``held`` and ``released``; others are dropped.

``recipients``: one row per message and recipient whose acceptance is in the data:
accepted and final times, the final status, attempts, delay, the last reply, and the
accountability figure ``finals`` (final outcomes recorded: exactly one, or none while
queued, is the spool's contract). The final status is ``queued`` while the message has
no finish in the data, and ``unknown`` for a recipient of a finished message whose outcome
no record names: recovery finishes a message with the outcomes it can still read when
disk damage took the ones that named them (docs/design.md, R5 and R6), and says so in the
finish's reason (``lost_why``).
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

FINAL_KINDS = ("delivered", "failed", "expired", "deleted")
# The final status of a recipient whose message finished with no record of its outcome.
UNKNOWN = "unknown"
ATTEMPT_KINDS = ("delivered", "failed", "deferred")
_POSITION = ("segment", "offset")


def domain_of(address: Column) -> Column:
    """The domain of an address, lower-cased ("" for the null sender)."""
    return F.lower(F.substring_index(address, "@", -1))


def events_table(raw: DataFrame) -> DataFrame:
    """``events`` from the data source's rows (module docstring)."""
    per_message = Window.partitionBy("server", "msg_id")
    per_recipient = Window.partitionBy("server", "msg_id", "recipient").orderBy(*_POSITION)
    in_order = per_message.orderBy(*_POSITION).rowsBetween(Window.unboundedPreceding, 0)
    rows = raw.where(F.col("record") != "control").where(F.col("record") != "damage")
    rows = rows.withColumn("previous_held", F.lag("held").over(per_recipient))
    requeued = F.col("kind") == "requeued"
    kind = (
        F.when(requeued & F.col("held").isNotNull() & F.col("previous_held").isNull(), "held")
        .when(requeued & F.col("held").isNull() & F.col("previous_held").isNotNull(), "released")
        .when(requeued, None)
        .when(F.col("record") == "delta", F.col("kind"))
        .otherwise(F.col("kind"))
    )
    rows = rows.withColumn("kind", kind).where(F.col("kind").isNotNull())
    rows = (
        rows.withColumn("sender", F.max("sender").over(per_message))
        .withColumn("body_size", F.max("body_size").over(per_message))
        .withColumn(
            "attempt",
            F.sum(F.when(F.col("kind") == "started", 1).otherwise(0)).over(in_order),
        )
        .withColumn(
            "attempt_started_at",
            F.max(F.when(F.col("kind") == "started", F.col("time"))).over(in_order),
        )
    )
    return (
        rows.select(
            "server",
            F.to_date(F.timestamp_seconds("time")).alias("day"),
            "segment",
            "offset",
            F.timestamp_seconds("time").alias("time"),
            "msg_id",
            "kind",
            "status",
            "sender",
            domain_of(F.col("sender")).alias("sender_domain"),
            "recipient",
            domain_of(F.col("recipient")).alias("recipient_domain"),
            "attempt",
            F.col("klass").alias("retry_class"),
            F.regexp_extract("reply", r"^([2-5][0-9][0-9])", 1).alias("reply_code"),
            F.regexp_extract(
                "reply", r"^[2-5][0-9][0-9][ -]([245]\.[0-9]{1,3}\.[0-9]{1,3})", 1
            ).alias("enhanced_status"),
            "reply",
            "body_size",
            F.when(
                F.col("kind").isin(*ATTEMPT_KINDS) & F.col("attempt_started_at").isNotNull(),
                F.col("time") - F.col("attempt_started_at"),
            ).alias("in_attempt"),
        )
        .withColumn("reply_code", F.nullif("reply_code", F.lit("")))
        .withColumn("enhanced_status", F.nullif("enhanced_status", F.lit("")))
    )


def recipients_table(events: DataFrame) -> DataFrame:
    """``recipients`` from ``events`` (module docstring)."""
    key = ["server", "msg_id", "recipient"]
    accepted = (
        events.where(F.col("kind") == "accepted")
        .groupBy(*key)
        .agg(
            F.min("time").alias("accepted_at"),
            F.first("sender").alias("sender"),
            F.first("sender_domain").alias("sender_domain"),
            F.first("recipient_domain").alias("recipient_domain"),
            F.first("body_size").alias("body_size"),
        )
    )
    # A final outcome is a delta's; a finish repeats it (or, for a message ended by the
    # operator or by recovery, is the only record of it).
    deltas = events.where(F.col("kind").isin(*FINAL_KINDS, "deferred"))
    final_deltas = deltas.where(F.col("kind").isin(*FINAL_KINDS))
    by_delta = final_deltas.groupBy(*key).agg(
        F.count("*").alias("finals"),
        F.min_by("kind", F.struct(*_POSITION)).alias("final_status"),
        F.min("time").alias("final_at"),
    )
    by_finish = (
        events.where((F.col("kind") == "finished") & F.col("status").isin(*FINAL_KINDS))
        .groupBy(*key)
        .agg(
            F.min_by("status", F.struct(*_POSITION)).alias("finish_status"),
            F.min("time").alias("finish_at"),
        )
    )
    attempts = deltas.groupBy(*key).agg(
        F.sum(F.when(F.col("kind").isin(*ATTEMPT_KINDS), 1).otherwise(0)).alias("attempts"),
        F.max_by("reply", F.struct(*_POSITION)).alias("last_reply"),
        F.sum(F.when(F.col("kind") == "deferred", 1).otherwise(0)).alias("deferrals"),
        F.sum("in_attempt").alias("in_attempts"),
    )
    # The message's end: any finish, with or without outcomes (one naming none is a row
    # with no recipient, its reason in ``reply``).
    ended = (
        events.where(F.col("kind") == "finished")
        .groupBy("server", "msg_id")
        .agg(
            F.min("time").alias("ended_at"),
            F.max(F.when(F.col("recipient").isNull(), F.col("reply"))).alias("ended_why"),
        )
    )
    first_start = (
        events.where(F.col("kind") == "started")
        .groupBy("server", "msg_id")
        .agg(F.min("time").alias("first_attempt_at"))
    )
    out = (
        accepted.join(by_delta, key, "left")
        .join(by_finish, key, "left")
        .join(attempts, key, "left")
        .join(first_start, ["server", "msg_id"], "left")
        .join(ended, ["server", "msg_id"], "left")
    )
    unknown = F.when(F.col("ended_at").isNotNull(), F.lit(UNKNOWN))
    final_status = F.coalesce("final_status", "finish_status", unknown)
    final_at = F.coalesce("final_at", "finish_at", "ended_at")
    return out.select(
        *key,
        "sender",
        "sender_domain",
        "recipient_domain",
        "body_size",
        "accepted_at",
        final_at.alias("final_at"),
        F.coalesce(final_status, F.lit("queued")).alias("final_status"),
        F.coalesce("attempts", F.lit(0)).alias("attempts"),
        F.coalesce("deferrals", F.lit(0)).alias("deferrals"),
        "last_reply",
        F.coalesce("in_attempts", F.lit(0.0)).alias("in_attempts"),
        (final_at.cast("double") - F.col("accepted_at").cast("double")).alias("delay"),
        (F.col("first_attempt_at").cast("double") - F.col("accepted_at").cast("double")).alias(
            "before_first_attempt"
        ),
        F.coalesce("finals", F.when(F.col("finish_status").isNotNull(), 1).otherwise(0)).alias(
            "finals"
        ),
        final_status.isNull().alias("still_queued"),
        F.when(final_status == UNKNOWN, F.coalesce("ended_why", F.lit(""))).alias("lost_why"),
    )
