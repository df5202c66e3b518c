"""What every ``spool`` command shares: argument types, output formats, error handling, and
the way to the spool (read from disk, opened here, or asked of its running owner)."""

from __future__ import annotations

import contextlib
import enum
import itertools
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import attrs
import click

from spool import format as fmt
from spool.client import Client, connect, socket_path
from spool.directory import user_name
from spool.errors import OwnerUnreachable, SpoolError
from spool.fs import FileSystem
from spool.options import SpoolOptions, load_settings, resolve_options
from spool.records import Position
from spool.spool import Spool
from spool.version import __version__

VERSION = __version__

F = TypeVar("F", bound=Callable[..., Any])
DISK = FileSystem()  # every look at the disk goes through the seam, as in the package
DIR = click.argument("directory", type=click.Path(file_okay=False))
JSON = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
SIGPIPE_EXIT = 128 + 13  # the status of a command that SIGPIPE ended
SIGINT_EXIT = 128 + 2  # the status of a command that Ctrl-C (SIGINT) ended


# --- values in and out -----------------------------------------------------------------


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def human_age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def human_time(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 message``, ``2 messages`` (``many`` for irregular plurals)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def parse_duration(text: str) -> float:
    """'90s', '15m', '2h', '3d' or plain seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise click.BadParameter(f"{text!r} is not a duration like 30m, 2h or 3d")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


if TYPE_CHECKING:  # click's ParamType is generic only in its newer versions
    FloatParam = click.ParamType[float]
    PatternParam = click.ParamType[re.Pattern[str]]
else:
    FloatParam = PatternParam = click.ParamType


class Duration(FloatParam):
    """A duration option (``30m``, ``2h``, ``3d`` or seconds); shown as ``AGE``."""

    name = "age"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, float | int):
            return float(value)
        try:
            return parse_duration(value)
        except click.BadParameter as exc:
            self.fail(exc.message, param, ctx)


class Regex(PatternParam):
    """A regular expression option (Python syntax, matched anywhere, case-insensitive)."""

    name = "regex"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, re.Pattern):
            return value
        try:
            return re.compile(value, re.IGNORECASE)
        except re.error as exc:
            self.fail(f"{value!r} is not a regular expression: {exc}", param, ctx)


AGE = Duration()
REGEX = Regex()


def parse_position(text: str) -> Position:
    m = re.fullmatch(r"(\d+):(\d+)", text)
    if not m:
        raise click.BadParameter(f"{text!r} is not a position SEGMENT:OFFSET")
    return Position(int(m.group(1)), int(m.group(2)))


def message_id(text: str) -> str:
    """An id as the operator typed it: ids are upper-case hex, matched case-insensitively."""
    return text.strip().upper()


def to_jsonable(obj: Any) -> Any:
    if isinstance(obj, Position):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if attrs.has(type(obj)):
        return {k: to_jsonable(v) for k, v in attrs.asdict(obj, recurse=False).items()}
    if isinstance(obj, tuple | list | set | frozenset):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    return obj


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(to_jsonable(obj), sort_keys=True))


# --- errors and signals ------------------------------------------------------------------


class Failure(Exception):
    """An expected failure: print one line, exit 1."""


def fail(message: str) -> NoReturn:
    raise Failure(message)


def handle_errors(func: F) -> F:
    """Turn spool errors into one line and exit 1 (``--debug``: the traceback too); a
    closed pipe ends the command quietly (141), Ctrl-C without a traceback (130)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        try:
            return func(*args, **kwargs)
        except BrokenPipeError:
            # The reader went away (`spool dump DIR | head`): stop quietly, as a command
            # killed by SIGPIPE does. Standard output points at /dev/null from here, so
            # that flushing it at exit raises nothing more.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            ctx.exit(SIGPIPE_EXIT)
        except KeyboardInterrupt:
            # Ctrl-C: what was asked for is either done (durable) or not; nothing is left
            # half-written that the next open would not recover. Exit as SIGINT does.
            if ctx.find_root().params.get("debug"):
                raise
            ctx.exit(SIGINT_EXIT)
        except (SpoolError, Failure, OSError, KeyError, ValueError) as exc:
            if ctx.find_root().params.get("debug"):
                raise
            text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            click.echo(f"spool: {text}", err=True)
            ctx.exit(1)

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    return wrapper  # type: ignore[return-value]


# --- the way to the spool ----------------------------------------------------------------


def require_spool(directory: str) -> None:
    """Fail with what is wrong when ``directory`` is not a spool this user can read."""
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        fail(f"{directory} does not exist")
    except PermissionError:
        fail(f"cannot reach {directory}: permission denied on a directory above it")
    if not os.path.isdir(directory):
        fail(f"{directory} is not a directory")
    log_dir = os.path.join(directory, fmt.LOG_DIR)
    try:
        os.listdir(log_dir)
    except FileNotFoundError:
        fail(f"{directory} is not a spool (no {fmt.LOG_DIR}/ directory)")
    except NotADirectoryError:
        fail(f"{directory} is not a spool ({fmt.LOG_DIR} is not a directory)")
    except PermissionError:
        owner = user_name(st.st_uid)
        fail(
            f"cannot read {directory}: permission denied; it belongs to {owner}: "
            f"run the command as {owner} (for example: sudo -u {owner} spool ...)"
        )


def recorded_options(directory: str) -> SpoolOptions:
    """The owner's options as the spool recorded them (its settings; tuning left default)."""
    return resolve_options(load_settings(DISK, directory), {})


def open_spool(directory: str) -> Spool:
    """Open (and so recover) the spool; it keeps the settings its owner recorded."""
    require_spool(directory)
    return Spool.open(directory)


def running_owner(directory: str) -> Client | None:
    """A connection to the owner serving ``directory``, or None when none answers (then
    the command opens the spool itself; a live owner that does not answer makes that open
    fail with ``SpoolLocked``, naming its pid)."""
    if not os.path.exists(socket_path(directory)):
        return None
    try:
        return connect(directory)
    except OwnerUnreachable:
        return None


def spool_or_owner(directory: str) -> Spool | Client:
    """The running owner if there is one, else the spool opened here."""
    require_spool(directory)
    client = running_owner(directory)
    return client if client is not None else open_spool(directory)


@contextlib.contextmanager
def working(label: str) -> Iterator[None]:
    """An elapsed-time spinner on a terminal (standard error) while a walk runs elsewhere
    (inside the spool or its owner, where no bar can follow it); nothing when piped."""
    if not sys.stderr.isatty():
        yield
        return
    done = threading.Event()
    started = time.monotonic()

    def spin() -> None:
        for frame in itertools.cycle("|/-\\"):
            if done.wait(0.2):
                return
            sys.stderr.write(f"\r{label} {frame} {time.monotonic() - started:.0f}s")
            sys.stderr.flush()

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        yield
    finally:
        done.set()
        spinner.join()
        sys.stderr.write("\r\033[K")  # the line cleared: the summary follows alone
        sys.stderr.flush()


def segment_count(directory: str) -> int:
    return len(DISK.listdir(os.path.join(directory, fmt.LOG_DIR)))


@contextlib.contextmanager
def segment_progress(directory: str, label: str, quiet: bool) -> Iterator[Callable[[int], None]]:
    """A progress bar over the log's segments on a terminal (standard error), nothing when
    the output is piped or ``quiet``: yields the callback a walk calls per segment."""
    if quiet or not sys.stderr.isatty():
        yield lambda _n: None
        return
    with click.progressbar(length=segment_count(directory), label=label, file=sys.stderr) as bar:
        yield bar.update
