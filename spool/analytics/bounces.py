"""Bounce classes: a failure's or deferral's category from its enhanced status code and
reply text, by the rules in ``bounce_rules.json`` (first match wins), as a Spark column
(no Python function per row) and, for tests and tools, as plain Python."""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources
from typing import Any

from pyspark.sql import Column
from pyspark.sql import functions as F

RULES_FILE = "bounce_rules.json"


@cache
def load_rules() -> tuple[list[dict[str, str]], str]:
    """The rules and the default class, from the package's ``bounce_rules.json``."""
    raw: dict[str, Any] = json.loads(
        resources.files("spool.analytics").joinpath(RULES_FILE).read_text()
    )
    rules = [dict(r) for r in raw["rules"]]
    for rule in rules:  # a broken rule fails here, not in a Spark task
        re.compile(rule["status"] or "x^")
        re.compile(rule["text"] or "x^")
    return rules, str(raw["default"])


def classify(enhanced_status: str | None, reply: str | None) -> str:
    """The class of one reply (the same rules as ``bounce_class``)."""
    rules, default = load_rules()
    for rule in rules:
        if rule["status"] and enhanced_status and re.fullmatch(rule["status"], enhanced_status):
            return rule["class"]
        if rule["text"] and reply and re.search(rule["text"], reply.lower()):
            return rule["class"]
    return default


def bounce_class(enhanced_status: Column, reply: Column) -> Column:
    """``classify`` as a Spark column expression."""
    rules, default = load_rules()
    text = F.lower(reply)
    result: Column | None = None
    for rule in rules:
        tests = []
        if rule["status"]:
            tests.append(F.coalesce(enhanced_status.rlike(f"^(?:{rule['status']})$"), F.lit(False)))
        if rule["text"]:
            tests.append(F.coalesce(text.rlike(rule["text"]), F.lit(False)))
        test = tests[0] if len(tests) == 1 else tests[0] | tests[1]
        result = F.when(test, rule["class"]) if result is None else result.when(test, rule["class"])
    assert result is not None
    return result.otherwise(default)
