"""Test support that ships with the package, for the spool's tests and embedders' own.

``doubles``: a controllable clock (``FakeClock``) and file-system seams that count
(``CountingFS``), fail on cue (``FaultFS``) or run out of room (``SmallDiskFS``), with
``tree_snapshot`` and ``deliver_all``. ``crashsim``: the recording file system and the
crash simulator the crash explorer builds every crash state with.

No production module imports this package (``tests/unit/test_layering.py`` checks it).
"""

from spool.testing.doubles import (
    CountingFS,
    FakeClock,
    FaultFS,
    SmallDiskFS,
    deliver_all,
    tree_snapshot,
)

__all__ = [
    "CountingFS",
    "FakeClock",
    "FaultFS",
    "SmallDiskFS",
    "deliver_all",
    "tree_snapshot",
]
