"""The report's HTML page: the headline, each report as a table, the plots. One file, no
scripts, nothing fetched: it opens from a file system or a web server alike."""

from __future__ import annotations

import html
from typing import Any

from spool.analytics.reports import REPORTS

ROWS_SHOWN = 50

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; }
th { background: #f3f3f3; } td.text { text-align: left; }
.bad { color: #a00; font-weight: bold; } .good { color: #070; }
"""


def write_page(
    results: dict[str, list[dict[str, Any]]],
    summary: dict[str, Any],
    plots: dict[str, str],
    path: str,
) -> None:
    """Write the page to ``path``."""
    parts = ["<!doctype html><meta charset=utf-8><title>spool report</title>"]
    parts.append(f"<style>{STYLE}</style><h1>spool report</h1>")
    since, until = summary.get("window") or (None, None)
    span = f"from {since or 'the oldest record'} to {until or 'the newest'}"
    parts.append(
        f"<p>Sources: {html.escape(', '.join(summary.get('sources') or []))}; records {span} "
        f"(figures of recipients: those accepted in that window; of events: those in it). "
        f"Generated {html.escape(str(summary.get('generated_at', '')))}. Times are UTC; "
        "delays and durations in seconds; <i>holds</i> counts messages held at least once; "
        "bounce-class failures include expired recipients.</p>"
    )
    violations = summary.get("accountability_violations") or []
    verdict = (
        f'<p class="bad">accountability: {len(violations)} recipient(s) with more than one '
        "final outcome, or with none although their message finished (listed below)</p>"
        if violations
        else '<p class="good">accountability: every accepted recipient has exactly one final '
        "outcome or is still queued</p>"
    )
    parts.append(verdict)
    for line in summary.get("damaged_segments") or []:
        parts.append(f'<p class="bad">damaged, skipped: {html.escape(line)}</p>')
    for name in REPORTS:
        rows = results.get(name, [])
        parts.append(f"<h2>{html.escape(name.replace('_', ' '))}</h2>")
        if name in plots:
            parts.append(f'<img src="{html.escape(plots[name])}" alt="{html.escape(name)}">')
        parts.append(_table(rows))
        parts.append(f'<p><a href="reports/{name}.parquet">{name}.parquet</a></p>')
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p>(none)</p>"
    columns = list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for row in rows[:ROWS_SHOWN]:
        cells = []
        for c in columns:
            value = row[c]
            css = ' class="text"' if isinstance(value, str) else ""
            cells.append(f"<td{css}>{html.escape(_show(value))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    more = (
        f"<p>({len(rows) - ROWS_SHOWN} more rows in the Parquet file)</p>"
        if len(rows) > ROWS_SHOWN
        else ""
    )
    return f"<table><tr>{head}</tr>{''.join(body)}</table>{more}"


def _show(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
