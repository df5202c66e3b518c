"""``python:MODULE:CALLABLE``: an embedder's own agent, imported by the worker.

The callable is called as ``callable(envelope, data)`` (a ``spool.MessageEnvelope`` and the
message bytes) and returns ``{recipient: reply}`` (the reply's first digit decides: 2
delivered, 4 deferred, 5 failed; a recipient left out is deferred). An exception it raises
defers every recipient of that message with the exception in the reply. If ``CALLABLE``
names a class, it is instantiated once per delivery loop and must have ``deliver`` and
``close``. The module is imported as ``python -m`` would import it: from the current
directory and ``PYTHONPATH`` (the owner and its workers share both).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from spool.agents import Replies
from spool.attempts import MessageEnvelope
from spool.errors import SpoolMisuse


class CallableAgent:
    def __init__(self, deliver: Callable[[MessageEnvelope, bytes], Replies]) -> None:
        self._deliver = deliver

    def deliver(self, envelope: MessageEnvelope, data: bytes) -> Replies:
        return self._deliver(envelope, data)

    def close(self) -> None:
        pass


def make(argument: str) -> Any:
    module_name, _, name = argument.partition(":")
    if not module_name or not name:
        raise SpoolMisuse("give the agent as python:MODULE:CALLABLE")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as ``python -m`` (the workers) sees it
    try:
        target = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise SpoolMisuse(f"cannot load {argument}: {e}") from None
    if isinstance(target, type):
        return target()
    return CallableAgent(target)
