"""The analytics' decoding shortcut against the record codec: ``lean_rows`` gives the
rows of the codec's record or None (the codec decides), never rows for a map the codec
refuses, and takes every record the spool writes but control records."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spool import format as fmt
from spool import records as rec
from spool.analytics.events import _cursor, plan_segments, record_rows
from spool.analytics.lean_rows import lean_rows
from spool.fs import FileSystem

SERVER, SEG, OFF = "mx1", 3, 4096


def _same(a: Any, b: Any) -> bool:
    """Equal, a NaN equal to a NaN (a time may be one: the codec takes it)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _verdicts(ftype: int, payload: bytes) -> tuple[list[Any] | None, list[Any] | None]:
    """(the shortcut's rows or None, the codec's rows or None if it refuses)."""
    obj = rec.record_map(payload)
    lean = None if obj is None else lean_rows(SERVER, SEG, OFF, ftype, obj)
    try:
        record = rec.decode(ftype, payload)
    except rec.RecordError:
        return lean, None
    return lean, record_rows(SERVER, SEG, OFF, record)


def _check(ftype: int, payload: bytes) -> list[Any] | None:
    lean, coded = _verdicts(ftype, payload)
    if lean is not None:
        assert coded is not None, f"the shortcut took a record the codec refuses: {payload!r}"
        assert _same(lean, coded), (lean, coded)
    return lean


# --- maps of every field right, wrong, near or missing ---------------------------------

texts = st.text(max_size=12)
times = st.floats(allow_nan=True, allow_infinity=True)
counts = st.integers(min_value=0, max_value=2**70)
position = st.lists(st.integers(min_value=-2, max_value=2**65), min_size=2, max_size=2)
near = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=10**308, max_value=10**400),  # beyond any float
    st.floats(),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(), max_size=3),
    st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)
status = st.sampled_from([*sorted(rec.STATUSES), "expired", ""])
final_status = st.sampled_from([*sorted(rec.FINAL_STATUSES), "deferred"])
reply = st.one_of(texts, st.just("554 5.4.7 message expired after 5 days"))
outcome = st.one_of(
    st.tuples(texts, final_status, reply, times).map(list),
    st.lists(near, max_size=5),
)
body = st.fixed_dictionaries(
    {"k": st.one_of(st.sampled_from(["inline", "file"]), near), "n": st.one_of(counts, near)},
    optional={"at": st.one_of(position, near)},
)

FIELDS: dict[int, dict[str, st.SearchStrategy[Any]]] = {
    fmt.T_ENVELOPE: {
        "id": texts, "from": texts, "to": st.lists(texts, max_size=3), "acc": times,
        "ts": times, "body": body, "att": counts, "cls": counts, "held": st.none() | texts,
        "crash": counts, "sup": position, "out": st.lists(outcome, max_size=3),
        "reply": st.none() | reply, "prom": position,
    },
    fmt.T_START: {"id": texts, "env": position, "cls": counts, "ts": times},
    fmt.T_DELTA: {
        "id": texts, "st": status, "to": st.lists(texts, max_size=3), "reply": reply, "ts": times
    },
    fmt.T_FINISH: {
        "id": texts, "ts": times, "body": body, "out": st.lists(outcome, max_size=3),
        "why": texts, "from": texts, "acc": times, "prom": position,
    },
    fmt.T_CONTROL: {"act": st.sampled_from(sorted(rec.CONTROL_ACTIONS)), "tgt": texts, "ts": times},
}  # fmt: skip


@st.composite
def record_maps(draw: st.DrawFn) -> tuple[int, dict[str, Any]]:
    ftype = draw(st.sampled_from(sorted(FIELDS)))
    obj: dict[str, Any] = {}
    for name, right in FIELDS[ftype].items():
        choice = draw(st.sampled_from(["right"] * 6 + ["near", "missing"]))
        if choice != "missing":
            obj[name] = draw(right if choice == "right" else near)
    if draw(st.booleans()):
        obj[draw(st.text(max_size=3))] = draw(near)  # a key the codec does not know
    return ftype, obj


@settings(max_examples=3000, deadline=None)
@given(record_maps())
def test_the_shortcut_gives_the_codecs_rows_or_leaves_the_record_to_it(
    case: tuple[int, dict[str, Any]],
) -> None:
    ftype, obj = case
    _check(ftype, cbor2.dumps(obj))


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(sorted(FIELDS)), st.binary(max_size=64))
def test_bytes_that_are_no_map_are_left_to_the_codec(ftype: int, payload: bytes) -> None:
    _check(ftype, payload)


# --- what the spool writes ---------------------------------------------------------------


def _fleet_payloads(root: Path) -> list[tuple[int, bytes]]:
    found = []
    for source in plan_segments([str(p) for p in sorted(root.glob("mx?"))]):
        path = os.path.join(source.log_dir, fmt.segment_name(source.segment))
        cursor = _cursor(FileSystem(), source, 0)
        try:
            found.extend((t, p) for _, t, p in cursor.segment_frames(os.path.getsize(path)))
        finally:
            cursor.close()
    return found


@pytest.fixture(scope="module")
def payloads(fleet: tuple[Path, list[dict[str, Any]]]) -> list[tuple[int, bytes]]:
    return _fleet_payloads(fleet[0])


def test_the_shortcut_takes_every_record_the_spool_writes_but_control_records(
    payloads: list[tuple[int, bytes]],
) -> None:
    kinds = {t for t, _ in payloads}
    assert {fmt.T_ENVELOPE, fmt.T_START, fmt.T_DELTA, fmt.T_FINISH} <= kinds
    for ftype, payload in payloads:
        lean = _check(ftype, payload)
        assert (lean is None) == (ftype == fmt.T_CONTROL), rec.decode(ftype, payload)


def test_mutated_payloads_of_the_spool_get_the_codecs_verdict(
    payloads: list[tuple[int, bytes]],
) -> None:
    rng = random.Random(43)
    taken = refused = 0
    for _ in range(20_000):
        ftype, payload = rng.choice(payloads)
        mutated = bytearray(payload)
        for _ in range(rng.randint(1, 3)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        lean, coded = _verdicts(ftype, bytes(mutated))
        _check(ftype, bytes(mutated))
        taken += lean is not None
        refused += coded is None
    assert taken and refused  # both kinds of verdict were reached
