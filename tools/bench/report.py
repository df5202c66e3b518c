"""From raw trial results to the table: medians, min–max, ratios, targets, markdown.

The ratio column is always spool's median divided by the row's median, so the same
column reads "spool is N times this peer" for peers and "spool reaches this fraction of
the disk" for the raw limits. Targets are the project's performance goals, each with
the measured value and met/missed.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# Which raw rows each workload is compared with (trials of the raw rows are shared).
RAW_ROWS = {
    "accept-1": ("raw-fdatasync", "raw-overwrite"),
    "accept-32": ("raw-bandwidth",),
    "lifecycle-1": (),
    "lifecycle-32": ("raw-bandwidth",),
}
PEERS = ("file-per-message", "sqlite-wal", "persist-queue")
SPOOL = "spool"
MIB = 1024


@dataclass(frozen=True)
class Cell:
    """One table row's numbers: rate median/min/max over the repetitions, sync calls."""

    median: float
    low: float
    high: float
    runs: int
    fsyncs_per_msg: float | None  # counted in process if the system can, else by strace
    strace_per_msg: float | None  # counted by strace around one more trial
    cpu_us_per_msg: float | None = None  # the trial process's CPU (user + system) a message


def trial_workload(workload: str, system: str) -> str:
    """Where a system's trials are stored: raw rows are run once, shared by workloads."""
    return "raw" if system.startswith("raw-") else workload


def summarize(
    trials: Iterable[dict[str, Any]], fsyncs: dict[str, float]
) -> dict[tuple[str, int, str], Cell]:
    """Group trials by (workload, body, system); ``fsyncs`` maps the same key, joined
    with ``|``, to sync calls per message counted from outside (strace).

    The sync count a target is judged on is the one counted in process during the timed
    trials (spool through its file-system seam, the file spool and the raw loops by
    their own calls): it describes the runs the rates come from, unperturbed by a
    tracer. SQLite syncs inside C, so its systems have only the strace count."""
    rates: dict[tuple[str, int, str], list[float]] = {}
    inproc: dict[tuple[str, int, str], list[float]] = {}
    cpu: dict[tuple[str, int, str], list[float]] = {}
    for t in trials:
        key = (t["workload"], int(t["body"]), t["system"])
        rates.setdefault(key, []).append(t["messages"] / t["seconds"])
        if t.get("fsyncs") is not None and t["messages"]:
            inproc.setdefault(key, []).append(t["fsyncs"] / t["messages"])
        if t.get("cpu_seconds") is not None and t["messages"]:
            cpu.setdefault(key, []).append(1e6 * t["cpu_seconds"] / t["messages"])
    cells = {}
    for key, values in rates.items():
        traced = fsyncs.get("|".join(map(str, key)))
        counted = statistics.median(inproc[key]) if key in inproc else traced
        cells[key] = Cell(
            statistics.median(values),
            min(values),
            max(values),
            len(values),
            counted,
            traced,
            statistics.median(cpu[key]) if key in cpu else None,
        )
    return cells


def _syncs(c: Cell) -> str:
    """The sync column: the in-process count, with strace's in parentheses if it differs."""
    if c.fsyncs_per_msg is None:
        return "n/a"
    text = f"{c.fsyncs_per_msg:.3f}"
    if c.strace_per_msg is not None and c.strace_per_msg != c.fsyncs_per_msg:
        text += f" ({c.strace_per_msg:.3f})"
    return text


def _cpu(c: Cell) -> str:
    """CPU microseconds a message (user and system time of the whole trial process, so a
    system's fsyncs count too), or n/a for the raw loops and older results."""
    return "n/a" if c.cpu_us_per_msg is None else f"{c.cpu_us_per_msg:,.0f}"


def _rate(x: float) -> str:
    return f"{x:,.0f}"


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def ratio(
    cells: dict[tuple[str, int, str], Cell], workload: str, body: int, other: str
) -> float | None:
    """spool's median rate over ``other``'s for one workload and body size."""
    mine = cells.get((workload, body, SPOOL))
    theirs = cells.get((trial_workload(workload, other), body, other))
    if mine is None or theirs is None or theirs.median == 0:
        return None
    return mine.median / theirs.median


def throughput_table(
    cells: dict[tuple[str, int, str], Cell], workloads: Sequence[str], bodies: Sequence[int]
) -> list[str]:
    """The main table, one row per workload, body size and system (markdown lines)."""
    out = [
        "| workload | body | system | msg/s (median) | min–max | runs | fsync/msg "
        "| CPU µs/msg | spool ÷ row |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for workload in workloads:
        for body in bodies:
            for system in (*RAW_ROWS[workload], *PEERS, SPOOL):
                c = cells.get((trial_workload(workload, system), body, system))
                if c is None:
                    continue
                fs = _syncs(c)
                r = "—" if system == SPOOL else _ratio(ratio(cells, workload, body, system))
                out.append(
                    f"| {workload} | {body // 1024} KiB | {system} | {_rate(c.median)} "
                    f"| {_rate(c.low)}–{_rate(c.high)} | {c.runs} | {fs} | {_cpu(c)} | {r} |"
                )
    return out


@dataclass(frozen=True)
class Target:
    """One performance goal: what is needed, what was measured, and whether it was met."""

    name: str
    needed: str
    measured: str
    met: bool | None  # None: could not be measured in this run


def _at_least(name: str, value: float | None, bound: float) -> Target:
    if value is None:
        return Target(name, f"≥ {bound:g}x", "not measured", None)
    return Target(name, f"≥ {bound:g}x", f"{value:.2f}x", value >= bound)


def _at_most(name: str, value: float | None, bound: float, unit: str = "") -> Target:
    if value is None:
        return Target(name, f"≤ {bound:g}{unit}", "not measured", None)
    return Target(name, f"≤ {bound:g}{unit}", f"{value:.3g}{unit}", value <= bound)


def targets(
    cells: dict[tuple[str, int, str], Cell],
    bodies: Sequence[int],
    restart: Sequence[dict[str, Any]],
) -> list[Target]:
    """Evaluate every goal, for each body size measured."""
    out: list[Target] = []
    for body in bodies:
        kib = f"{body // 1024} KiB"
        out.append(
            _at_least(
                f"accept, 1 producer, vs raw write+fdatasync ({kib})",
                ratio(cells, "accept-1", body, "raw-fdatasync"),
                0.9,
            )
        )
        for workload, bound in (("accept-1", 1.2), ("lifecycle-1", 1.5)):
            out.append(
                _at_least(
                    f"{workload} vs SQLite ({kib})",
                    ratio(cells, workload, body, "sqlite-wal"),
                    bound,
                )
            )
        for workload, max_fsyncs in (("accept-32", 0.1), ("lifecycle-32", 0.2)):
            out.append(
                _at_least(
                    f"{workload} vs SQLite ({kib})",
                    ratio(cells, workload, body, "sqlite-wal"),
                    3,
                )
            )
            out.append(
                _at_least(
                    f"{workload} vs file per message ({kib})",
                    ratio(cells, workload, body, "file-per-message"),
                    10,
                )
            )
            c = cells.get((workload, body, SPOOL))
            out.append(
                _at_most(
                    f"{workload} fsync per message ({kib})",
                    None if c is None else c.fsyncs_per_msg,
                    max_fsyncs,
                )
            )
    out.extend(restart_targets(restart))
    return out


def restart_medians(rows: Sequence[dict[str, Any]], system: str) -> dict[int, dict[str, float]]:
    """Per queue size: medians of the restart measurements of ``system``."""
    by_size: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        if r["system"] == system:
            by_size.setdefault(int(r["queued"]), []).append(r)
    return {
        n: {
            k: statistics.median(float(x[k]) for x in rs)
            for k in ("open_s", "first_claim_s", "peak_rss_kib", "records_scanned")
        }
        for n, rs in sorted(by_size.items())
    }


def restart_targets(rows: Sequence[dict[str, Any]]) -> list[Target]:
    """First claim at the largest queue within 1.5x of the smallest; RSS within 10 MiB."""
    med = restart_medians(rows, SPOOL)
    if len(med) < 2:
        return [
            Target("restart: first claim, largest vs smallest queue", "≤ 1.5x", "not run", None),
            Target("memory: peak RSS, largest minus smallest queue", "≤ 10 MiB", "not run", None),
        ]
    small, large = min(med), max(med)
    sizes = f"{large:,} vs {small:,} queued"
    growth = med[large]["first_claim_s"] / med[small]["first_claim_s"]
    rss = (med[large]["peak_rss_kib"] - med[small]["peak_rss_kib"]) / MIB
    return [
        _at_most(f"restart: time to first claim, {sizes}", growth, 1.5, "x"),
        _at_most(f"memory: peak RSS growth, {sizes}", rss, 10, " MiB"),
    ]


def targets_table(items: Sequence[Target]) -> list[str]:
    """The targets as markdown lines."""
    out = ["| target | needed | measured | verdict |", "|---|---|---:|---|"]
    for t in items:
        verdict = {True: "met", False: "**missed**", None: "not measured"}[t.met]
        out.append(f"| {t.name} | {t.needed} | {t.measured} | {verdict} |")
    return out


def restart_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Restart: open time, time to first claim, what was scanned, peak RSS (markdown)."""
    out = [
        "| system | queued | open ms (median, min–max) | first claim ms (median, min–max)"
        " | records scanned | bytes scanned | peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["system"], int(r["queued"])), []).append(r)
    for (system, queued), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] != SPOOL, kv[0])):

        def span(key: str, rs: list[dict[str, Any]] = rs) -> str:
            ms = [float(x[key]) * 1000 for x in rs]
            return f"{statistics.median(ms):,.1f} ({min(ms):,.1f}–{max(ms):,.1f})"

        rec = statistics.median(int(x["records_scanned"]) for x in rs)
        byt = statistics.median(int(x["bytes_scanned"]) for x in rs)
        rss = statistics.median(int(x["peak_rss_kib"]) for x in rs) / MIB
        out.append(
            f"| {system} | {queued:,} | {span('open_s')} | {span('first_claim_s')} "
            f"| {rec:,.0f} | {byt:,.0f} | {rss:.1f} |"
        )
    return out


def labels_table(labels: dict[str, str]) -> list[str]:
    """What each system name in the tables stands for."""
    return ["| system | what it is |", "|---|---|"] + [
        f"| {name} | {label} |" for name, label in labels.items()
    ]


def replace_generated(path: str, begin: str, end: str, text: str) -> None:
    """Replace the block of ``path`` between the markers ``begin`` and ``end`` with
    ``text`` (written to a temporary file, then renamed over it); refuses a file without
    the markers rather than guessing where the block goes."""
    with open(path) as f:
        doc = f.read()
    start, stop = doc.find(begin), doc.find(end)
    if start < 0 or stop < start:
        raise SystemExit(f"{path}: the markers {begin!r} and {end!r} not found; not updated")
    doc = doc[: start + len(begin)] + "\n\n" + text + "\n" + doc[stop:]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(doc)
    os.replace(tmp, path)
