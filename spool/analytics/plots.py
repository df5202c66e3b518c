"""The report's plots (matplotlib, no display): one PNG each where a picture reads better
than a table."""

from __future__ import annotations

import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

Rows = list[dict[str, Any]]


def write_plots(results: dict[str, Rows], directory: str) -> dict[str, str]:
    """Write the plots; their file names (relative to the page) by report name."""
    os.makedirs(directory, exist_ok=True)
    made: dict[str, str] = {}
    for name, draw in PLOTS.items():
        rows = results.get(name) or []
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(9, 3.6), dpi=100)
        try:
            draw(ax, rows)
            fig.tight_layout()
            path = os.path.join(directory, f"{name}.png")
            fig.savefig(path)
        finally:
            plt.close(fig)
        made[name] = os.path.join(os.path.basename(directory), f"{name}.png")
    return made


def _traffic(ax: Any, rows: Rows) -> None:
    hours = [r["hour"] for r in rows]
    labels = {
        "received": "messages received",
        "delivered": "recipients delivered",
        "deferred": "deferrals",
        "bounced": "recipients bounced",
        "expired": "recipients expired",
    }
    for key, label in labels.items():
        ax.plot(hours, [r[key] for r in rows], label=label)
    ax.set_title("traffic per hour (UTC)")
    ax.legend(loc="upper left", fontsize="small")


def _queue(ax: Any, rows: Rows) -> None:
    for server in sorted({r["server"] for r in rows}):
        mine = [r for r in rows if r["server"] == server]
        ax.step(
            [r["hour_end"] for r in mine], [r["queued"] for r in mine], where="post", label=server
        )
    ax.set_title("queue depth (recipients queued at the end of each hour)")
    ax.legend(loc="upper left", fontsize="small")


def _delays(ax: Any, rows: Rows) -> None:
    ax.bar([r["bucket"] for r in rows], [r["recipients"] for r in rows])
    ax.set_title("delivered recipients by delay (acceptance to delivery)")


def _domains(ax: Any, rows: Rows) -> None:
    names = [r["recipient_domain"] for r in rows][:15]
    bottom = [0] * len(names)
    for key in ("delivered", "bounced", "expired", "deleted", "queued"):
        values = [r[key] for r in rows][:15]
        ax.bar(names, values, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_title("recipients per domain, by final status")
    ax.tick_params(axis="x", labelrotation=30, labelsize="small")
    ax.legend(fontsize="small")


def _classes(ax: Any, rows: Rows) -> None:
    ax.barh([r["bounce_class"] for r in rows], [r["failures"] for r in rows], label="failures")
    ax.barh(
        [r["bounce_class"] for r in rows],
        [r["deferrals"] for r in rows],
        left=[r["failures"] for r in rows],
        label="deferrals",
    )
    ax.set_title("bounce classes")
    ax.legend(fontsize="small")


PLOTS = {
    "traffic_per_hour": _traffic,
    "queue_depth": _queue,
    "delay_distribution": _delays,
    "per_domain": _domains,
    "bounce_classes": _classes,
}
