"""The package's import layering: a lower module never imports a higher one.

Layers, bottom up (docs/design.md, "The pieces"): the foundation (format, errors, the
file-system seam); the codecs; the files (log reader and writer, positions, the lock, the
directory); what reads the log or the settings; the pieces of an open spool; the
``Spool`` facade; the server (control socket, client, workers, agents); the commands
(check, cli). A module may import its own layer and those
below. ``spool.testing`` is test support: no production module imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "spool"

LAYERS: list[set[str]] = [
    {"format", "errors", "fs", "logs", "version", "stop_signals"},
    {
        "framing",
        "records",
        "metafile",
        "addresses",
        "clock",
        "segment_header",
        "protocol",
        "delivery_log",
        "histogram",
    },
    {"reader", "writer", "positions", "lock", "directory", "segment_files"},
    {
        "options",
        "arguments",
        "bodies",
        "damage",
        "runners",
        "outcomes",
        "queue_view",
        "recovery",
    },
    {
        "state",
        "scheduling",
        "body_keeping",
        "attempts",
        "checkpoints",
        "operator",
        "outcome_desk",
        "opening",
        "accepting",
        "statistics",
        "polling",
        "dsn",
    },
    {"spool"},
    {
        "client",
        "control",
        "owner",
        "supervisor",
        "serving",
        "worker",
        "agents",
        "metrics",
        "async_client",
        "async_spool",
        "smtp_in",
        "smtp_process",
        "bouncing",
        "delay_warnings",
        "background",
        "smtp_tally",
    },
    {"__init__"},
    {"check", "cli", "__main__", "analytics"},
]


def spool_imports(source: str) -> set[str]:
    """The ``spool`` modules a module's source imports (at any depth of its body)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "spool":
                continue
            if len(parts) > 1:
                found.add(".".join(parts[1:]))
            else:  # from spool import records, ...
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "spool" and len(parts) > 1:
                    found.add(".".join(parts[1:]))
    return found


def layer_of(module: str) -> int | None:
    top = module.split(".")[0]
    for level, names in enumerate(LAYERS):
        if top in names:
            return level
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a higher layer (or of test support) by a production module."""
    found = []
    for module, deps in sorted(graph.items()):
        level = layer_of(module)
        for dep in sorted(deps):
            if dep.split(".")[0] == "testing":
                found.append(f"{module} imports test support spool.{dep}")
                continue
            dep_level = layer_of(dep)
            if level is not None and dep_level is not None and dep_level > level:
                found.append(f"{module} (layer {level}) imports {dep} (layer {dep_level})")
    return found


def production_graph() -> dict[str, set[str]]:
    graph = {
        path.stem: spool_imports(path.read_text())
        for path in PACKAGE.glob("*.py")  # spool/testing/ is not production code
    }
    # The analytics (the top layer, with the commands): nothing below may import them, so
    # the core runs without Spark.
    for package in ("analytics", "cli"):
        for path in (PACKAGE / package).glob("*.py"):
            graph[f"{package}.{path.stem}"] = spool_imports(path.read_text())
    return graph


def test_every_production_module_has_a_layer() -> None:
    unplaced = sorted(m for m in production_graph() if layer_of(m) is None)
    assert not unplaced, f"place these modules in LAYERS (and docs/design.md): {unplaced}"


def test_no_module_imports_a_higher_layer_or_test_support() -> None:
    assert upward_imports(production_graph()) == []


def test_the_layering_check_finds_an_upward_import_and_test_support() -> None:
    graph = {"records": {"format", "spool"}, "writer": {"testing.doubles", "fs"}}
    assert upward_imports(graph) == [
        "records (layer 1) imports spool (layer 5)",
        "writer imports test support spool.testing.doubles",
    ]


def test_the_import_parser_sees_function_level_and_package_imports() -> None:
    source = "from spool import records as rec, fs\ndef f():\n    from spool.cli import main\n"
    assert spool_imports(source) == {"records", "fs", "cli"}
