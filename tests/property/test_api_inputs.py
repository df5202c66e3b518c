"""Every call of the public API, over its whole input space: it succeeds, or it raises a
documented error and writes nothing (contract item 7).

Goal: no argument, of any type, size, character set or value at and past every limit,
reaches the log unchecked, fails an assertion, or escapes as a bare TypeError or KeyError.
Method: Hypothesis draws the arguments (well-formed values near the limits mixed with
values of the wrong type, lone surrogates, NUL and control characters, oversized texts in
multi-byte characters); each call runs on a real spool; a refused call must raise one of
the spool's documented errors, and a snapshot of the directory (after a sync) must be
unchanged. At the end of each example the spool must still open and check clean.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spool import (
    BadSpoolDirectory,
    DiskFull,
    InvalidAddress,
    InvalidMessage,
    MessageTooLarge,
    Spool,
    SpoolClosed,
    SpoolMisuse,
    UnknownMessage,
    options,
)
from spool.check import check_spool
from spool.options import RECIPIENTS_LIMIT, TEXT_MAX
from spool.testing import FakeClock, tree_snapshot

DOCUMENTED = (
    InvalidAddress,
    InvalidMessage,
    MessageTooLarge,
    SpoolMisuse,
    UnknownMessage,
    DiskFull,
    SpoolClosed,
)
EXAMPLES = int(os.environ.get("SPOOL_INPUT_EXAMPLES", "60"))

odd_texts = st.sampled_from(
    [
        "",
        "\x00",
        "bad\ud800surrogate",
        "\r\n",
        "€" * (TEXT_MAX // 3 + 1),  # 4,098 bytes in 1,366 characters
        "5" + "€" * ((TEXT_MAX - 1) // 3),  # exactly at the limit
        "x" * (TEXT_MAX + 1),
        "250 2.0.0 ok",
        "ünïcödé réply",
    ]
)
anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=50),
    odd_texts,
    st.binary(max_size=40),
    st.lists(st.text(max_size=20), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
labels = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=63)
addresses = st.one_of(
    st.builds(lambda local, dom: f"{local}@{dom}.example", labels, labels),
    st.builds(lambda n: "a" * n + "@example.net", st.integers(60, 70)),
    st.builds(lambda n: "b@" + "d" * n + ".example", st.integers(60, 260)),
    st.text(max_size=40),
    odd_texts,
    anything,
)
recipient_lists = st.one_of(
    st.lists(addresses, max_size=4),
    st.builds(
        lambda n: [f"r{i}@example.net" for i in range(n)], st.integers(0, RECIPIENTS_LIMIT + 2)
    ),
    st.builds(lambda a: [a, a.upper()], st.just("x@example.net")),
    anything,
)
bodies = st.one_of(
    st.binary(max_size=2000),
    st.builds(bytes, st.sampled_from([0, 900, 901, 4096])),
    anything,
)
ids = st.one_of(st.just("REAL"), st.just("0000000000000000"), st.text(max_size=20), anything)


@contextmanager
def spool_with_traffic() -> Iterator[tuple[Spool, str, Any]]:
    """A spool holding one queued message and one attempt in flight; the spool, the queued
    message's id, and the attempt."""
    root = tempfile.mkdtemp(prefix="spool-inputs-")
    sp = Spool.open(
        os.path.join(root, "spool"),
        clock=FakeClock(),
        max_message_size=4096,
        inline_body_max=900,
        max_recipients=RECIPIENTS_LIMIT,
        outcomes=True,
        checkpoint_interval=10**6,
    )
    try:
        flying = sp.accept("a@example.org", ["f1@example.net", "f2@example.net"], b"fly")
        queued = sp.accept("a@example.org", ["q@example.net"], b"queued")
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == flying
        yield sp, queued, attempt
    finally:
        if not sp.closed:
            sp.close()
        path = os.path.join(root, "spool")
        assert check_spool(path).clean, check_spool(path).problems
        Spool.open(path).close()
        shutil.rmtree(root, ignore_errors=True)


def refused_or_done(sp: Spool, call: Callable[[], object]) -> None:
    """Run ``call``: success, or a documented error and an unchanged directory."""
    sp.sync()
    before = tree_snapshot(sp.path)
    try:
        call()
    except DOCUMENTED:
        sp.sync()
        after = tree_snapshot(sp.path)
        assert after == before, f"a refused call changed {set(after) ^ set(before) or 'files'}"


SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@SETTINGS
@given(sender=addresses, recipients=recipient_lists, data=bodies)
def test_accept_succeeds_or_refuses_cleanly(sender: Any, recipients: Any, data: Any) -> None:
    with spool_with_traffic() as (sp, _queued, _attempt):
        refused_or_done(sp, lambda: sp.accept(sender, recipients, data))


@SETTINGS
@given(
    kind=st.sampled_from(["delivered", "failed", "deferred"]),
    recipients=st.one_of(st.just(["f1@example.net"]), recipient_lists),
    reply=st.one_of(odd_texts, anything),
)
def test_reports_succeed_or_refuse_cleanly(kind: str, recipients: Any, reply: Any) -> None:
    with spool_with_traffic() as (sp, _queued, attempt):
        refused_or_done(sp, lambda: getattr(attempt, kind)(recipients, reply))


@SETTINGS
@given(
    action=st.sampled_from(["hold", "release", "delete", "retry_now", "show", "ack_outcome"]),
    msg_id=ids,
    reason=st.one_of(odd_texts, anything),
    with_reason=st.booleans(),
)
def test_operator_calls_succeed_or_refuse_cleanly(
    action: str, msg_id: Any, reason: Any, with_reason: bool
) -> None:
    with spool_with_traffic() as (sp, queued, _attempt):
        target = queued if msg_id == "REAL" else msg_id
        args = (target, reason) if with_reason and action in ("hold", "delete") else (target,)
        refused_or_done(sp, lambda: getattr(sp, action)(*args))


timeouts = st.one_of(
    st.none(),
    st.floats(min_value=0, max_value=0.05),
    st.floats(max_value=-1e-9),
    st.just(float("nan")),
    st.booleans(),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.lists(st.integers(), max_size=2),
)


@SETTINGS
@given(timeout=timeouts)
def test_waiting_calls_take_only_a_number_of_seconds(timeout: Any) -> None:
    with spool_with_traffic() as (sp, _queued, _attempt):
        for call in (sp.claim, sp.next_outcome):
            refused_or_done(sp, lambda call=call: call(timeout=timeout))  # type: ignore[misc]


def test_a_wait_longer_than_any_float_is_as_long_as_infinity() -> None:
    with spool_with_traffic() as (sp, _queued, _attempt):
        for timeout in (10**400, float("inf"), 1e308):
            attempt = sp.claim(timeout=timeout)  # a message is due: no wait at all
            assert attempt is not None
            attempt.delivered(attempt.envelope.recipients, "250 ok")
            attempt.close()
            sp.accept("a@example.org", ["q@example.net"], b"due now")


@SETTINGS
@given(
    option=st.sampled_from([*options.SETTINGS, *options.TUNING, "clock"]),
    value=anything,
)
def test_every_option_value_opens_or_is_refused_before_the_directory_is_touched(
    option: str, value: Any
) -> None:
    root = tempfile.mkdtemp(prefix="spool-options-")
    path = os.path.join(root, "spool")
    if option == "archive_dir" and isinstance(value, str) and value:
        value = os.path.join(root, "archive", os.path.basename(value) or "a")
    try:
        try:
            sp = Spool.open(path, **{option: value})
        except (SpoolMisuse, BadSpoolDirectory):  # BadSpoolDirectory: an archive it cannot make
            assert not os.path.exists(path)
            return
        sp.close()
        assert check_spool(path).clean
    finally:
        shutil.rmtree(root, ignore_errors=True)
