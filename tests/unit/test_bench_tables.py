"""The benchmarks' tables: the relay's (tools/bench/relay.py: the time from the last 250
to the last message at the sink, and the line that checks the target), and the generated
blocks of docs/performance.md, replaced between their markers."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest

from tools.bench.relay import POSTFIX, Trial, render
from tools.bench.report import replace_generated, summarize, throughput_table

ARGS = Namespace(repeats=1, messages=1000, size=4096, max_use=1000)


def trial(system: str, sessions: int, accept_s: float, relay_s: float, fsyncs: int | None) -> Trial:
    return Trial(system, sessions, 1000, 4096, 1, accept_s=accept_s, relay_s=relay_s,
                 fsyncs=fsyncs)  # fmt: skip


def test_a_missed_target_says_by_how_much_and_the_tail_is_a_column() -> None:
    trials = [trial(POSTFIX, 20, 1.5, 2.0, None), trial("spool w2", 20, 3.0, 4.0, 20)]
    table = render(trials, [POSTFIX, "spool w2"], [20], ARGS)
    assert "last 250 to last at sink, s" in table
    assert "| 20 | spool w2 | 333 (333–333) | 250 (250–250) | 1.00 |" in table
    assert "| 20 | postfix | 667 (667–667) | 500 (500–500) | 0.50 |" in table
    assert table.endswith("**missed**; the best, spool w2: 0.50x Postfix, 3.0 times too slow.")


def test_the_target_is_met_only_with_few_fsyncs_too() -> None:
    fast = [trial(POSTFIX, 20, 1.5, 2.0, None), trial("spool w4", 20, 1.0, 1.2, 50)]
    met = render(fast, [POSTFIX, "spool w4"], [20], ARGS)
    assert met.endswith("**met** by spool w4 (1.67x, 0.05 fsync/msg).")
    fast[1].fsyncs = 500
    assert render(fast, [POSTFIX, "spool w4"], [20], ARGS).endswith(
        "**missed**; the best, spool w4: 0.50 fsync/msg."
    )
    unmeasured = render(fast[:1], [POSTFIX], [20], ARGS)
    assert unmeasured.endswith("not measured (run with 20 among --sessions).")


def test_a_generated_block_is_replaced_between_its_markers_only(tmp_path: Path) -> None:
    doc = tmp_path / "performance.md"
    doc.write_text("intro\n<!-- x:begin -->\nold table\n<!-- x:end -->\noutro\n")
    replace_generated(str(doc), "<!-- x:begin -->", "<!-- x:end -->", "new table")
    assert doc.read_text() == "intro\n<!-- x:begin -->\n\nnew table\n<!-- x:end -->\noutro\n"
    doc.write_text("no markers\n")
    with pytest.raises(SystemExit, match="not found; not updated"):
        replace_generated(str(doc), "<!-- x:begin -->", "<!-- x:end -->", "new table")
    assert doc.read_text() == "no markers\n"


def test_the_throughput_table_gives_each_systems_cpu_a_message() -> None:
    def run(system: str, messages: int, cpu: float | None) -> dict[str, object]:
        return {"workload": "accept-1", "body": 4096, "system": system, "messages": messages,
                "seconds": 1.0, "fsyncs": messages, "cpu_seconds": cpu}  # fmt: skip

    trials = [run("spool", 4000, 0.8), run("spool", 5000, 1.5), run("sqlite-wal", 5000, None)]
    cells = summarize(trials, {})
    assert cells["accept-1", 4096, "spool"].cpu_us_per_msg == pytest.approx(250.0)
    rows = throughput_table(cells, ["accept-1"], [4096])
    assert "CPU µs/msg" in rows[0]
    assert rows[2].startswith("| accept-1 | 4 KiB | sqlite-wal | 5,000 |")
    assert "| 1.000 | n/a | 0.90x |" in rows[2]  # no CPU figure from an older trial
    assert rows[3].startswith(
        "| accept-1 | 4 KiB | spool | 4,500 | 4,000–5,000 | 2 | 1.000 | 250 |"
    )
