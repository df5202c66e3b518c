"""The options of a spool: their defaults, their limits, and which ones the spool records.

Two kinds of option (docs/api.md lists them all):

* **settings** belong to the spool and are recorded in ``<spool>/settings``: the retry
  classes, the lifetime, the crash-loop limit, outcome tracking, the archive, and the size
  limits. Every open that does not name a setting uses the recorded value, so the CLI, a
  worker or a plain ``Spool.open(path)`` behave as the owner does: an open without
  ``outcomes`` cannot silently drop unacknowledged bounces, and a checkpoint run from the
  CLI archives instead of deleting when the owner archives. An open that names a setting
  changes it, and the new value is recorded (``outcomes=False`` is how tracking is turned
  off).
* **tuning** belongs to one process and is never recorded: how often to sync, checkpoint,
  and how many attempts may be in flight.

Every value is checked here, before anything is opened (``SpoolMisuse`` says what is
wrong), so that no option can hang a thread or fail an assertion later.

Crash safety:
    The settings file is replaced atomically (``metafile.replace_metafile``) under the
    owner lock, before recovery. A crash before the rename keeps the old settings: the
    open that wanted new ones never returned, so nobody relied on them.

Errors:
    ``SpoolMisuse`` for an invalid option; ``CorruptSpool`` for a damaged settings file
    (``spool check --repair`` sets it aside; the defaults apply after that).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable
from typing import Any, Final, Literal

import attrs

from spool import format as fmt
from spool.errors import CorruptSpool, SpoolMisuse
from spool.fs import FileSystem
from spool.metafile import decode_metafile, read_metafile, replace_metafile
from spool.positions import load_positions
from spool.writer import DEFAULT_WRITE_AHEAD

MINUTE: Final = 60.0
HOUR: Final = 3600.0
DAY: Final = 86400.0

# Retry classes after the first attempt: 5 min, 15 min, 30 min, 1 h, 2 h, then every 4 h
# until max_lifetime. Close to Postfix (300 s doubling to 4000 s) and Exim's default
# (15 min for 2 h, then growing to 6 h). docs/design.md, "Retry classes".
DEFAULT_RETRY_INTERVALS: Final = (5 * MINUTE, 15 * MINUTE, 30 * MINUTE, HOUR, 2 * HOUR, 4 * HOUR)
DEFAULT_MAX_LIFETIME: Final = 5 * DAY
DEFAULT_SEGMENT_SIZE: Final = 64 * 1024 * 1024
DEFAULT_INLINE_BODY_MAX: Final = 1024 * 1024
DEFAULT_MAX_MESSAGE_SIZE: Final = 50 * 1024 * 1024
DEFAULT_MAX_RECIPIENTS: Final = 1000
# Generous: an SMTP delivery's stages time out within minutes (Postfix: 300 s per command,
# 600 s after the data), so an hour-long attempt is a hung worker.
DEFAULT_ATTEMPT_TIMEOUT: Final = HOUR
# This process's tuning (``Spool.open`` takes these defaults from here).
DEFAULT_MAX_IN_FLIGHT: Final = 10_000
DEFAULT_SYNC_EVERY: Final = 1000
DEFAULT_SYNC_INTERVAL: Final = 1.0
DEFAULT_CHECKPOINT_INTERVAL: Final = 30.0
DEFAULT_CHECKPOINT_EVERY: Final = 100_000
# The zeros written ahead of the log (writer invariant W6) are ``writer.DEFAULT_WRITE_AHEAD``.
# More gains nothing (one file-size change per 8 MiB of log is rare already), and a reader
# that stops at the end of the log reads the zeros after it: a restart reads up to this.
WRITE_AHEAD_MAX: Final = 8 << 20

# A BODY frame holds the message id and the data: the largest body that fits one frame.
INLINE_BODY_LIMIT: Final = fmt.FRAME_PAYLOAD_MAX - fmt.MSG_ID_LENGTH
# Every text a caller gives that reaches a record (a server's reply, an operator's
# reason) is at most this many bytes of UTF-8. SMTP reply lines are at most 512 octets
# (RFC 5321 4.5.3.1.5); 4 KiB keeps a multi-line reply.
TEXT_MAX: Final = 4096
# Addresses are at most 256 octets (RFC 5321 4.5.3.1.3, enforced by addresses.py).
ADDRESS_MAX: Final = 256
# The largest record a message can need is its finish record, or a replacement envelope,
# with one entry per recipient: an outcome [address, status, reply, time] at most
# ADDRESS_MAX + TEXT_MAX + 26 bytes of CBOR, plus fixed fields (id, sender, times, body
# reference, held reason, last reply, positions) well under 16 KiB. The recipient limit
# is what keeps the worst case inside one frame (tests/unit/test_options.py encodes it).
OUTCOME_BYTES_MAX: Final = ADDRESS_MAX + TEXT_MAX + 26
RECORD_FIXED_BYTES_MAX: Final = 16 * 1024
RECIPIENTS_LIMIT: Final = 1900
assert RECIPIENTS_LIMIT * OUTCOME_BYTES_MAX + RECORD_FIXED_BYTES_MAX <= fmt.FRAME_PAYLOAD_MAX

SEGMENT_SIZE_MIN: Final = fmt.SECTOR  # a header and part of a batch; rolls over often
SIZE_MAX: Final = 1 << 40  # sizes above a terabyte are a mistake, not a configuration
RETRY_CLASSES_MAX: Final = 64

SETTINGS_VERSION: Final = 1


class _Recorded(enum.Enum):
    """The default of every setting in ``Spool.open``: "as recorded in the spool"."""

    RECORDED = "as recorded"


RECORDED: Final = _Recorded.RECORDED
Recorded = Literal[_Recorded.RECORDED]


def _whole(low: int, high: int) -> Any:
    def check(inst: object, attribute: attrs.Attribute[int], value: object) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise SpoolMisuse(
                f"{attribute.name} must be a whole number from {low} to {high}, not {value!r}"
            )

    return check


SECONDS_MAX: Final = 1e9  # about 31 years: beyond it, a duration is a mistake


def _seconds(inst: object, attribute: attrs.Attribute[float], value: object) -> None:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not 0 < value <= SECONDS_MAX
    ):
        raise SpoolMisuse(
            f"{attribute.name} must be a number of seconds above 0 and at most "
            f"{SECONDS_MAX:.0e}, not {value!r}"
        )


def _intervals(value: object) -> tuple[float, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise SpoolMisuse(f"retry_intervals must be a list of seconds, not {value!r}")
    out = tuple(value)
    if not 1 <= len(out) <= RETRY_CLASSES_MAX or not all(
        isinstance(i, int | float) and not isinstance(i, bool) and 0 < i <= SECONDS_MAX for i in out
    ):
        raise SpoolMisuse(
            f"retry_intervals must be 1 to {RETRY_CLASSES_MAX} positive numbers of seconds, "
            f"not {value!r}"
        )
    return tuple(float(i) for i in out)


def _archive(value: object) -> str | None:
    """A path, kept as given: a relative one is relative to the spool directory (not to
    the opener's working directory, which differs between the owner and the CLI)."""
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike):
        raise SpoolMisuse(f"archive_dir must be a path or None, not {value!r}")
    path = os.fspath(value)
    if not isinstance(path, str) or not path or "\x00" in path:
        raise SpoolMisuse(f"archive_dir must be a non-empty path without NUL, not {value!r}")
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        raise SpoolMisuse(f"archive_dir is not a path this system can name: {value!r}") from None
    return os.path.normpath(path)


def _boolean(inst: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise SpoolMisuse(f"{attribute.name} must be True or False, not {value!r}")


def _default_reserve(options: SpoolOptions) -> int:
    """1.5 times ``max_message_size`` (0 while that is invalid: its validator says so)."""
    size = options.max_message_size
    return size * 3 // 2 if isinstance(size, int) and not isinstance(size, bool) else 0


@attrs.frozen(kw_only=True)
class SpoolOptions:
    """Every option of an open spool, checked. ``Spool.options`` is the one in use.

    Sizes are in bytes, times in seconds. The first group are the spool's recorded
    settings (module docstring); the second this process's tuning.
    """

    retry_intervals: tuple[float, ...] = attrs.field(
        default=DEFAULT_RETRY_INTERVALS, converter=_intervals
    )
    max_lifetime: float = attrs.field(default=DEFAULT_MAX_LIFETIME, validator=_seconds)
    crash_limit: int = attrs.field(default=3, validator=_whole(1, 1000))
    outcomes: bool = attrs.field(default=False, validator=_boolean)
    # Relative to the spool directory when relative (``Spool.archive_path``).
    archive_dir: str | None = attrs.field(default=None, converter=_archive)
    segment_size: int = attrs.field(
        default=DEFAULT_SEGMENT_SIZE, validator=_whole(SEGMENT_SIZE_MIN, SIZE_MAX)
    )
    inline_body_max: int = attrs.field(
        default=DEFAULT_INLINE_BODY_MAX, validator=_whole(0, INLINE_BODY_LIMIT)
    )
    max_message_size: int = attrs.field(
        default=DEFAULT_MAX_MESSAGE_SIZE, validator=_whole(1, SIZE_MAX)
    )
    max_recipients: int = attrs.field(
        default=DEFAULT_MAX_RECIPIENTS, validator=_whole(1, RECIPIENTS_LIMIT)
    )
    # New mail is refused (DiskFull, SMTP 452) before free space would fall under this;
    # what is left is the reserve deliveries and their records use. The default, as
    # Postfix's (queue_minfree: 1.5 times message_size_limit), leaves room for one more
    # message of the largest size; 0 turns the check off.
    min_free_bytes: int = attrs.field(
        default=attrs.Factory(_default_reserve, takes_self=True),
        validator=_whole(0, SIZE_MAX),
    )

    max_in_flight: int = attrs.field(default=DEFAULT_MAX_IN_FLIGHT, validator=_whole(1, 10**9))
    sync_every: int = attrs.field(default=DEFAULT_SYNC_EVERY, validator=_whole(1, 10**12))
    sync_interval: float = attrs.field(default=DEFAULT_SYNC_INTERVAL, validator=_seconds)
    checkpoint_interval: float = attrs.field(
        default=DEFAULT_CHECKPOINT_INTERVAL, validator=_seconds
    )
    checkpoint_every: int = attrs.field(
        default=DEFAULT_CHECKPOINT_EVERY, validator=_whole(1, 10**12)
    )
    # How long one attempt may stay open: past it the spool closes it as deferred, so a
    # worker that hangs cannot pin the log (docs/design.md, "Attempt leases").
    attempt_timeout: float = attrs.field(default=DEFAULT_ATTEMPT_TIMEOUT, validator=_seconds)
    # 0 turns it off: on a copy-on-write file system (btrfs, ZFS) an overwrite is no cheaper
    # than an append, and the zeros would be written for nothing.
    write_ahead: int = attrs.field(
        default=DEFAULT_WRITE_AHEAD, validator=_whole(0, WRITE_AHEAD_MAX)
    )

    # --- the retry policy ------------------------------------------------------------

    @property
    def last_class(self) -> int:
        """The highest retry class (it also takes any higher class a record names)."""
        return len(self.retry_intervals)

    @property
    def longest_interval(self) -> float:
        return max(self.retry_intervals)

    def class_for_attempts(self, attempts: int) -> int:
        """The retry class of a message after ``attempts`` attempts (0: due at once)."""
        return min(attempts, self.last_class)

    def class_intervals(self) -> tuple[float, ...]:
        """Every class's interval, class 0 (due at once) first."""
        return (0.0, *self.retry_intervals)

    def interval(self, klass: int) -> float:
        """How long an envelope of retry class ``klass`` waits (class 0: not at all)."""
        klass = min(klass, self.last_class)
        return 0.0 if klass == 0 else self.retry_intervals[klass - 1]

    # --- what the spool records ----------------------------------------------------------

    def settings(self) -> dict[str, Any]:
        """The recorded part, as stored in the settings file."""
        return {name: getattr(self, name) for name in SETTINGS}


SETTINGS: Final = (
    "retry_intervals",
    "max_lifetime",
    "crash_limit",
    "outcomes",
    "archive_dir",
    "segment_size",
    "inline_body_max",
    "max_message_size",
    "max_recipients",
    "min_free_bytes",
)
TUNING: Final = (
    "max_in_flight",
    "sync_every",
    "sync_interval",
    "checkpoint_interval",
    "checkpoint_every",
    "attempt_timeout",
    "write_ahead",
)
OPTION_NAMES: Final = SETTINGS + TUNING
assert set(OPTION_NAMES) == {a.name for a in attrs.fields(SpoolOptions)}


def resolve_options(recorded: dict[str, Any], given: dict[str, Any]) -> SpoolOptions:
    """The options of an open: what the caller named, else what the spool recorded, else
    the defaults. ``given`` maps option names to values or ``RECORDED``."""
    values = {k: v for k, v in recorded.items() if k in SETTINGS}
    values.update({k: v for k, v in given.items() if v is not RECORDED})
    unknown = set(values) - set(SETTINGS) - set(TUNING)
    if unknown:
        raise SpoolMisuse(f"unknown options: {', '.join(sorted(unknown))}")
    return SpoolOptions(**values)


def options_for_open(fs: FileSystem, root: str, given: dict[str, Any]) -> tuple[SpoolOptions, bool]:
    """The options of an open of the spool at ``root`` (the owner's lock held), and whether
    its settings must be recorded: there is no settings file yet, or ``given`` changes one.
    Writes nothing: the caller records them once everything they need (an archive
    directory) is known to work, so a refused open changes nothing."""
    recorded = load_settings(fs, root)
    options = resolve_options(recorded, given)
    has_file = fs.exists(os.path.join(root, fmt.SETTINGS_NAME))
    changed = not has_file or resolve_options(recorded, {}).settings() != options.settings()
    return options, changed


def archive_path(root: str, options: SpoolOptions) -> str | None:
    """Where retired segments of the spool at ``root`` go (None: they are deleted)."""
    if options.archive_dir is None:
        return None
    return os.path.normpath(os.path.join(root, options.archive_dir))


def load_settings(fs: FileSystem, root: str) -> dict[str, Any]:
    """The settings recorded in ``<root>/settings`` ({} when there is none).

    A spool made before settings were recorded has none; its restart positions carry the
    retry intervals, which are taken from there. A damaged file is ``CorruptSpool``:
    without it the spool cannot know, for instance, that its outcomes are tracked.
    """
    raw = read_metafile(fs, root, fmt.SETTINGS_NAME)
    if raw is None:
        return _settings_from_positions(fs, root)
    obj = decode_metafile(raw)
    path = os.path.join(root, fmt.SETTINGS_NAME)
    if obj is None or obj.get("version") != SETTINGS_VERSION:
        raise CorruptSpool(path, 0, "the settings file is damaged or of another version")
    settings = {k: v for k, v in obj.items() if k in SETTINGS}
    if "retry_intervals" in settings and isinstance(settings["retry_intervals"], list):
        settings["retry_intervals"] = tuple(settings["retry_intervals"])
    try:
        SpoolOptions(**settings)
    except SpoolMisuse as exc:
        raise CorruptSpool(path, 0, f"the settings file holds an invalid value: {exc}") from None
    return settings


def _settings_from_positions(fs: FileSystem, root: str) -> dict[str, Any]:
    positions = load_positions(fs, root)
    if positions is not None and positions.retry_intervals:
        return {"retry_intervals": positions.retry_intervals}
    return {}


def store_settings(fs: FileSystem, root: str, options: SpoolOptions) -> None:
    """Record ``options``' settings in ``<root>/settings`` (atomically; module docstring)."""
    obj = {"version": SETTINGS_VERSION, **options.settings()}
    obj["retry_intervals"] = list(options.retry_intervals)
    replace_metafile(fs, root, fmt.SETTINGS_NAME, obj)
