"""Record payloads: every type round-trips; malformed payloads raise RecordError."""

from __future__ import annotations

import contextlib

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from spool import format as fmt
from spool import records as rec
from spool.records import Position

positions = st.builds(Position, st.integers(1, 10**6), st.integers(0, 2**40))
addresses = st.from_regex(r"[a-z]{1,10}@[a-z]{1,10}\.(org|net)", fullmatch=True)
times = st.floats(0, 4e9, allow_nan=False)
bodies = st.one_of(
    st.builds(rec.BodyRef, st.just(rec.BODY_INLINE), st.integers(0, 10**6), st.none() | positions),
    st.builds(rec.BodyRef, st.just(rec.BODY_FILE), st.integers(0, 10**8)),
)
outcomes = st.builds(
    rec.Outcome, addresses, st.sampled_from([rec.DELIVERED, rec.FAILED]), st.text(), times
)
envelopes = st.builds(
    rec.Envelope,
    msg_id=st.text(min_size=1),
    sender=addresses | st.just(""),
    recipients=st.lists(addresses, min_size=1, max_size=5, unique=True).map(tuple),
    accepted_at=times,
    written_at=times,
    body=bodies,
    attempts=st.integers(0, 100),
    klass=st.integers(0, 10),
    held=st.none() | st.text(),
    crashes=st.integers(0, 5),
    supersedes=st.none() | positions,
    outcomes=st.lists(outcomes, max_size=3).map(tuple),
    last_reply=st.none() | st.text(),
    promoted_from=st.none() | positions,
)
records = st.one_of(
    envelopes,
    st.builds(rec.Start, st.text(min_size=1), positions, st.integers(0, 10), times),
    st.builds(
        rec.Delta,
        st.text(min_size=1),
        st.sampled_from(sorted(rec.STATUSES)),
        st.lists(addresses, min_size=1, max_size=3).map(tuple),
        st.text(),
        times,
    ),
    st.builds(
        rec.Finish, st.text(min_size=1), times, bodies, st.lists(outcomes).map(tuple), st.text()
    ),
    st.builds(rec.Control, st.sampled_from(sorted(rec.CONTROL_ACTIONS)), st.text(), times),
)


@given(records)
def test_every_record_round_trips(record: rec.Record) -> None:
    ftype, payload = rec.encode(record)
    assert rec.decode(ftype, payload) == record


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xff", cbor2.dumps([1, 2]), cbor2.dumps({"id": 1}), cbor2.dumps({"id": "x"})],
)
@pytest.mark.parametrize("ftype", [fmt.T_ENVELOPE, fmt.T_START, fmt.T_DELTA, fmt.T_FINISH])
def test_malformed_payloads_raise_record_error(ftype: int, payload: bytes) -> None:
    with pytest.raises(rec.RecordError):
        rec.decode(ftype, payload)


@given(st.binary(max_size=200), st.sampled_from(sorted(fmt.FRAME_TYPES)))
def test_decoder_never_raises_anything_but_record_error(payload: bytes, ftype: int) -> None:
    with contextlib.suppress(rec.RecordError):
        rec.decode(ftype, payload)


@pytest.mark.parametrize(
    ("ftype", "obj"),
    [
        (fmt.T_START, {"id": "x", "env": [1, 2], "cls": 0, "ts": 10**400}),
        (
            fmt.T_FINISH,
            {
                "id": "x",
                "ts": 1.0,
                "body": {"k": "inline", "n": 1},
                "out": [["a", "failed", "", 10**400]],
            },
        ),
    ],
)
def test_a_time_beyond_any_float_is_a_record_error(ftype: int, obj: dict[str, object]) -> None:
    """CBOR has integers of any size: one where a time is was an OverflowError, which
    nothing above the codec expects (recovery would have died of it, not named it)."""
    with pytest.raises(rec.RecordError, match="OverflowError"):
        rec.decode(ftype, cbor2.dumps(obj))


def test_body_payload_carries_its_message_id() -> None:
    payload = rec.encode_body("0123456789ABCDEF", b"data")
    assert rec.decode_body(payload) == ("0123456789ABCDEF", b"data")
