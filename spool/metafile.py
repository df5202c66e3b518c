"""Small metadata files (``positions``, ``settings``): one recipe to write and read them.

Each is text: a JSON object on one line, then a line ``crc32c <hex>`` over that JSON line,
so an operator can read it with ``cat`` and a damaged file is never mistaken for a good
one (Kafka's checkpoint files, with a checksum added).

Crash safety:
    Replaced atomically: write ``<name>.tmp``, fdatasync it, rename it over ``<name>``,
    fsync the directory. A crash before the rename leaves the old file (and a stray temp
    file, truncated and rewritten next time); after the rename and before the directory
    fsync, either file (fault model 3 and 4); after it, the new one.

Errors:
    ``decode_metafile`` returns None for anything damaged; callers decide what a damaged
    file means (positions: scan more; settings: ``CorruptSpool``). ``OSError`` from the
    writes propagates.
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any

from crc32c import crc32c

from spool.fs import FileSystem

METAFILE_MAX = 1 << 24  # a larger file is not one of ours


def encode_metafile(obj: dict[str, Any]) -> bytes:
    """The bytes of a metadata file holding ``obj`` (keys sorted, no spaces)."""
    line = json.dumps(obj, separators=(",", ":"), sort_keys=True)
    return f"{line}\ncrc32c {crc32c(line.encode()):08x}\n".encode()


def decode_metafile(raw: bytes) -> dict[str, Any] | None:
    """The object in a metadata file, or None if the file is damaged in any way."""
    try:
        text = raw.decode("ascii")
        line, crc_line, rest = text.split("\n", 2)
        if rest or not crc_line.startswith("crc32c "):
            return None
        if int(crc_line[7:], 16) != crc32c(line.encode()):
            return None
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def read_metafile(fs: FileSystem, root: str, name: str) -> bytes | None:
    """The raw bytes of ``<root>/<name>``, or None when there is no such file. Anything
    there that is not a regular file (a directory, FIFO, socket, looping link) reads as
    no bytes: a damaged file, which the callers treat as such."""
    try:
        fd = fs.open(os.path.join(root, name), os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.ELOOP):
            return b""
        raise
    try:
        return fs.pread(fd, METAFILE_MAX, 0) if fs.is_file(fd) else b""
    finally:
        fs.close(fd)


def replace_metafile(fs: FileSystem, root: str, name: str, obj: dict[str, Any]) -> None:
    """Atomically replace ``<root>/<name>`` with a file holding ``obj`` (module docstring)."""
    path = os.path.join(root, name)
    tmp = path + ".tmp"
    fd = fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        # A crash here leaves a partial temp file; the real file is untouched.
        fs.pwrite(fd, encode_metafile(obj), 0)
        fs.fdatasync(fd)
    finally:
        fs.close(fd)
    # Atomic same-directory rename: either the old or the new file is seen after a crash.
    fs.rename(tmp, path)
    # Until this returns the rename may be undone by a crash: the old file remains.
    fs.fsync_dir(root)
