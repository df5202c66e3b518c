"""Crash simulation: record a workload's file-system trace, then rebuild what a power cut
could leave on disk at any point of it.

``RecordingFS`` is a ``FileSystem`` that performs every operation for real and appends
it to a ``Trace``: writes with their offset and bytes, truncations, fdatasync/fsync,
directory fsyncs, creations, renames, unlinks and mkdirs, each tagged with the inode it
touches. ``CrashSimulator`` replays a prefix of the trace against the persistence model
of docs/fault-model.md and hands out the *pending* units at that instant:

- a write not yet covered by an fsync of its file, cut into its 512-byte sectors, each of
  which may or may not have reached the disk (assumption 5: torn, lost, or out of order);
- a truncation not yet covered by an fsync of its file;
- a creation, rename, unlink or mkdir not yet covered by an fsync of its directory, which
  may or may not have happened (assumption 4), independently of everything else.

``build(prefix, choice)`` gives the resulting tree (``TreeState.write`` puts it in a
directory): durable state, plus the chosen pending units applied in trace order (absent
sectors of a file that grew read back as zeros). The explorer in ``tests/crash`` drives
it; nothing here knows the spool.

What it does not generate (known limits): a file whose size reached the disk while the
data of its last write did not (the "zero-filled tail" of some file systems; the reader
treats zero sectors as a tear, so the outcome would match a lost write; the zeros the log
writer writes ahead, which are synced before any frame overwrites them, give such states
in any case); bytes that a
*failed* write left behind (operations that raise are not recorded); files made outside
the seam (``os.makedirs`` of a missing parent or of ``archive_dir``). A rename between two
directories counts as durable once either directory is fsynced, as on journaling file
systems.

Crash safety:
    Not applicable: this module is the crash. It writes only the scratch trees it is told
    to build.

Errors:
    ``TraceError`` for a trace the model cannot replay (a bug in the recorder).
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import threading
from collections.abc import Iterator, Sequence

import attrs

from spool.fs import FileSystem

SECTOR = 512


class TraceError(RuntimeError):
    """The trace contradicts itself (a recorder bug, never a spool bug)."""


@attrs.frozen
class Op:
    """One recorded file-system operation. Paths are relative to the trace's base.

    ``kind`` is one of: ``create`` (new inode ``ino`` named ``path``), ``mkdir``,
    ``write`` (``data`` at ``offset`` of ``ino``), ``trunc`` (``ino`` to ``size``),
    ``sync`` (fsync or fdatasync of ``ino``), ``dirsync`` (directory ``path``),
    ``rename`` (``path`` to ``dst``), ``unlink`` (``path``).
    """

    kind: str
    path: str = ""
    ino: int = 0
    offset: int = 0
    data: bytes = b""
    size: int = 0
    dst: str = ""

    def describe(self) -> str:
        if self.kind == "write":
            return f"write ino{self.ino} [{self.offset}, +{len(self.data)})"
        if self.kind == "trunc":
            return f"trunc ino{self.ino} to {self.size}"
        if self.kind == "sync":
            return f"fsync ino{self.ino}"
        if self.kind == "rename":
            return f"rename {self.path} -> {self.dst}"
        if self.kind == "create":
            return f"create {self.path} (ino{self.ino})"
        return f"{self.kind} {self.path}"


@attrs.define
class Trace:
    """The operations of a workload, in the order they happened, and the tree it began on.

    ``initial`` maps relative file paths to their content (durable); ``initial_dirs`` the
    directories that existed. Workloads mark their own events by ``len(trace.ops)``.
    """

    initial: dict[str, bytes] = attrs.Factory(dict)
    initial_dirs: set[str] = attrs.Factory(set)
    ops: list[Op] = attrs.Factory(list)

    def __len__(self) -> int:
        return len(self.ops)


def snapshot_tree(base: str) -> tuple[dict[str, bytes], set[str]]:
    """Files (relative path -> bytes) and directories under ``base``."""
    files: dict[str, bytes] = {}
    dirs: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(base):
        rel_dir = os.path.relpath(dirpath, base)
        for d in dirnames:
            dirs.add(os.path.normpath(os.path.join(rel_dir, d)))
        for name in filenames:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                files[os.path.normpath(os.path.join(rel_dir, name))] = f.read()
    return files, dirs


class RecordingFS(FileSystem):
    """Performs every operation for real under ``base`` and records it. Thread-safe.

    The recorder keeps its own map of names to inodes so that writes through a file
    descriptor are attributed to the file, whatever it is later renamed to.
    """

    def __init__(self, base: str, trace: Trace | None = None) -> None:
        self.base = os.path.abspath(base)
        if trace is None:
            files, dirs = snapshot_tree(self.base)
            trace = Trace(initial=files, initial_dirs=dirs)
        self.trace = trace
        self._lock = threading.RLock()
        self._next_ino = 1
        self._names: dict[str, int] = {}
        for path in sorted(trace.initial):
            self._names[path] = self._new_ino()
        self._fds: dict[int, int] = {}

    @classmethod
    def after_process_crash(cls, trace: Trace, prefix: int, base: str) -> RecordingFS:
        """A recorder that continues ``trace`` after a process crash (``kill -9``) that
        came after its first ``prefix`` operations.

        A process crash keeps the page cache: every one of those operations has happened,
        but the ones not yet covered by an fsync are still *pending*, and a power cut
        later may yet lose them, unless something syncs them first. So the tree written
        under ``base`` (which must be empty) holds all of them, and the recorder's trace is
        the old prefix followed by whatever runs next (recovery): a ``CrashSimulator`` of
        that trace keeps the dead process's un-synced writes pending until a sync of the
        new run covers them (docs/fault-model.md, assumption 7).
        """
        sim = CrashSimulator(trace)
        sim.build(prefix, sim.pending(prefix)).write(base)
        continued = Trace(
            initial=dict(trace.initial),
            initial_dirs=set(trace.initial_dirs),
            ops=list(trace.ops[:prefix]),
        )
        fs = cls(base, continued)
        # Name the files as the dead process left them: replay creations, renames and
        # unlinks of the prefix over the initial files (numbered as in __init__).
        for op in continued.ops:
            if op.kind == "create":
                fs._names[op.path] = op.ino
                fs._next_ino = max(fs._next_ino, op.ino + 1)
            elif op.kind == "rename" and op.path in fs._names:
                fs._names[op.dst] = fs._names.pop(op.path)
            elif op.kind == "unlink":
                fs._names.pop(op.path, None)
        return fs

    def _new_ino(self) -> int:
        ino = self._next_ino
        self._next_ino += 1
        return ino

    def _rel(self, path: str) -> str:
        full = os.path.abspath(path)
        rel = os.path.relpath(full, self.base)
        if rel.startswith(".."):
            raise TraceError(f"{path} is outside the recorded tree")
        return os.path.normpath(rel)

    def _record(self, op: Op) -> None:
        self.trace.ops.append(op)

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        with self._lock:
            rel = self._rel(path)
            existed = os.path.exists(path)
            fd = super().open(path, flags, mode)
            if not existed:
                self._names[rel] = self._new_ino()
                self._record(Op("create", path=rel, ino=self._names[rel]))
            ino = self._names.get(rel)
            if ino is None:
                super().close(fd)
                raise TraceError(f"{rel} was made outside the recorded file system")
            if existed and flags & os.O_TRUNC:
                self._record(Op("trunc", ino=ino, size=0))
            self._fds[fd] = ino
            return fd

    def close(self, fd: int) -> None:
        with self._lock:
            self._fds.pop(fd, None)
            super().close(fd)

    def pwrite(self, fd: int, data: bytes, offset: int) -> None:
        with self._lock:
            super().pwrite(fd, data, offset)
            self._record(Op("write", ino=self._fds[fd], offset=offset, data=bytes(data)))

    def fdatasync(self, fd: int) -> None:
        with self._lock:
            super().fdatasync(fd)
            self._record(Op("sync", ino=self._fds[fd]))

    def fsync(self, fd: int) -> None:
        with self._lock:
            super().fsync(fd)
            self._record(Op("sync", ino=self._fds[fd]))

    def fsync_dir(self, path: str) -> None:
        with self._lock:
            super().fsync_dir(path)
            self._record(Op("dirsync", path=self._rel(path)))

    def ftruncate(self, fd: int, size: int) -> None:
        with self._lock:
            super().ftruncate(fd, size)
            self._record(Op("trunc", ino=self._fds[fd], size=size))

    def rename(self, src: str, dst: str) -> None:
        with self._lock:
            super().rename(src, dst)
            rel_src, rel_dst = self._rel(src), self._rel(dst)
            self._names[rel_dst] = self._names.pop(rel_src)
            self._record(Op("rename", path=rel_src, dst=rel_dst))

    def unlink(self, path: str) -> None:
        with self._lock:
            super().unlink(path)
            rel = self._rel(path)
            self._names.pop(rel, None)
            self._record(Op("unlink", path=rel))

    def mkdir(self, path: str, mode: int = 0o700) -> None:
        with self._lock:
            super().mkdir(path, mode)
            self._record(Op("mkdir", path=self._rel(path)))


# --- the persistence model ---------------------------------------------------------------


@attrs.frozen
class Unit:
    """One thing that may or may not have reached the disk at the crash.

    ``op_index`` is its operation in the trace; for a write, ``lo``/``hi`` bound the
    sector-aligned piece of it this unit stands for.
    """

    op_index: int
    lo: int = 0
    hi: int = 0

    def describe(self, trace: Trace) -> str:
        op = trace.ops[self.op_index]
        if op.kind == "write":
            return f"#{self.op_index} {op.describe()} bytes [{self.lo}, {self.hi})"
        return f"#{self.op_index} {op.describe()}"


@functools.lru_cache(maxsize=4096)
def _parent(path: str) -> str:
    parent = os.path.dirname(path)
    return parent or "."


@attrs.frozen
class TreeState:
    """A crash state: the directories and files (relative path -> content) it holds."""

    dirs: frozenset[str]
    files: tuple[tuple[str, bytes], ...]

    def digest(self) -> bytes:
        """A fingerprint, so that states reached by different choices are checked once."""
        h = hashlib.blake2b(digest_size=16)
        for d in sorted(self.dirs):
            h.update(b"d" + d.encode() + b"\0")
        for path, data in self.files:
            h.update(b"f" + path.encode() + b"\0" + len(data).to_bytes(8, "little"))
            h.update(data)
        return h.digest()

    def write(self, dest: str) -> None:
        """Create the tree under ``dest`` (which must not hold anything yet)."""
        os.makedirs(dest, exist_ok=True)
        for d in sorted(self.dirs):
            os.makedirs(os.path.join(dest, d), mode=0o700, exist_ok=True)
        for path, data in self.files:
            fd = os.open(os.path.join(dest, path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)


class CrashSimulator:
    """Rebuilds crash states of ``trace``.

    ``pending(prefix)`` lists the units not yet durable when the machine stops after the
    first ``prefix`` operations; ``build(prefix, chosen)`` returns the tree with the
    durable operations and the ``chosen`` pending units applied.
    """

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        # For each op index: the index of the sync that covers it (or None if none in the
        # whole trace). Computed once; pending(prefix) compares against the prefix.
        self._covered_at: list[int | None] = self._coverage()
        self._content_before = [0]
        for op in trace.ops:
            changes = op.kind not in ("sync", "dirsync")
            self._content_before.append(self._content_before[-1] + changes)

    def _coverage(self) -> list[int | None]:
        ops = self.trace.ops
        covered: list[int | None] = [None] * len(ops)
        open_data: dict[int, list[int]] = {}
        open_dir: dict[str, list[int]] = {}
        for i, op in enumerate(ops):
            if op.kind in ("write", "trunc"):
                open_data.setdefault(op.ino, []).append(i)
            elif op.kind == "sync":
                for j in open_data.pop(op.ino, []):
                    covered[j] = i
            elif op.kind in ("create", "mkdir", "unlink"):
                open_dir.setdefault(_parent(op.path), []).append(i)
            elif op.kind == "rename":
                open_dir.setdefault(_parent(op.path), []).append(i)
                if _parent(op.dst) != _parent(op.path):
                    open_dir.setdefault(_parent(op.dst), []).append(i)
            elif op.kind == "dirsync":
                for j in open_dir.pop(op.path, []):
                    if covered[j] is None:
                        covered[j] = i
            else:  # pragma: no cover - the recorder writes only the kinds above
                raise TraceError(f"unknown op kind {op.kind}")
        return covered

    def durable(self, index: int, prefix: int) -> bool:
        """Whether op ``index`` is durable once the first ``prefix`` ops have happened."""
        c = self._covered_at[index]
        return c is not None and c < prefix

    def pending(self, prefix: int) -> list[Unit]:
        """The units of the first ``prefix`` ops that a crash may or may not keep."""
        units: list[Unit] = []
        for i in range(prefix):
            if self.durable(i, prefix):
                continue
            op = self.trace.ops[i]
            if op.kind == "write":
                units.extend(Unit(i, lo, hi) for lo, hi in sector_pieces(op.offset, len(op.data)))
            elif op.kind in ("trunc", "create", "mkdir", "unlink", "rename"):
                units.append(Unit(i))
        return units

    def build(self, prefix: int, chosen: Sequence[Unit]) -> TreeState:
        """The tree a crash after the first ``prefix`` ops leaves, keeping ``chosen``."""
        picked_ops: set[int] = set()
        pieces: dict[int, list[tuple[int, int]]] = {}
        for u in chosen:
            if self.trace.ops[u.op_index].kind == "write":
                pieces.setdefault(u.op_index, []).append((u.lo, u.hi))
            else:
                picked_ops.add(u.op_index)
        names: dict[str, int] = {}
        dirs = set(self.trace.initial_dirs)
        contents: dict[int, bytearray] = {}
        # The recorder numbers the initial files 1, 2, ... in sorted order, as here.
        for ino, path in enumerate(sorted(self.trace.initial), start=1):
            names[path] = ino
            contents[ino] = bytearray(self.trace.initial[path])
        for i in range(prefix):
            op = self.trace.ops[i]
            keep = self.durable(i, prefix) or i in picked_ops
            if op.kind == "create":
                contents.setdefault(op.ino, bytearray())
                if keep and _parent(op.path) in dirs | {"."}:
                    names[op.path] = op.ino
            elif op.kind == "mkdir":
                if keep and _parent(op.path) in dirs | {"."}:
                    dirs.add(op.path)
            elif op.kind == "unlink":
                if keep:
                    names.pop(op.path, None)
            elif op.kind == "rename":
                if keep and op.path in names and _parent(op.dst) in dirs | {"."}:
                    names[op.dst] = names.pop(op.path)
            elif op.kind == "trunc":
                if keep:
                    buf = contents.setdefault(op.ino, bytearray())
                    del buf[op.size :]
                    buf.extend(bytes(op.size - len(buf)))
            elif op.kind == "write":
                buf = contents.setdefault(op.ino, bytearray())
                if self.durable(i, prefix):
                    _apply(buf, op.offset, op.data, 0, len(op.data))
                else:
                    for lo, hi in pieces.get(i, ()):
                        _apply(buf, op.offset, op.data, lo, hi)
        live_dirs = frozenset(d for d in dirs if _reachable(d, dirs))
        files = tuple(
            (path, bytes(contents.get(file_ino, b"")))
            for path, file_ino in sorted(names.items())
            if _parent(path) == "." or _parent(path) in live_dirs
        )
        return TreeState(live_dirs, files)

    def key(
        self, prefix: int, chosen: Sequence[Unit], pending: Sequence[Unit] | None = None
    ) -> tuple[int, frozenset[Unit]]:
        """A cheap identity of ``build(prefix, chosen)``: how many content-changing ops
        precede the crash and which pending units the state leaves out. Equal keys give
        equal trees, so a caller can skip the build. ``pending`` saves recomputing it."""
        units = self.pending(prefix) if pending is None else pending
        return self._content_before[prefix], frozenset(units) - frozenset(chosen)

    def states(
        self, prefix: int, *, exhaustive_max: int, samples: int, rng: random.Random
    ) -> Iterator[tuple[Unit, ...]]:
        """Choices of pending units at ``prefix``: every subset when there are at most
        ``exhaustive_max`` units, else all, none, each one dropped alone, every prefix (in
        trace and sector order), and ``samples`` seeded random subsets."""
        units = self.pending(prefix)
        if len(units) <= exhaustive_max:
            for mask in range(1 << len(units)):
                yield tuple(u for b, u in enumerate(units) if mask >> b & 1)
            return
        yield tuple(units)
        yield ()
        for k in range(len(units)):
            yield tuple(units[:k] + units[k + 1 :])
        for k in range(1, len(units)):
            # The commonest real tear: everything up to some sector reached the disk.
            yield tuple(units[:k])
        for _ in range(samples):
            yield tuple(u for u in units if rng.random() < 0.5)


def _reachable(d: str, dirs: set[str]) -> bool:
    parent = _parent(d)
    return parent == "." or (parent in dirs and _reachable(parent, dirs))


def _apply(buf: bytearray, offset: int, data: bytes, lo: int, hi: int) -> None:
    """Put ``data[lo:hi]`` at ``offset + lo`` of ``buf``, growing it with zeros."""
    start = offset + lo
    if len(buf) < start:
        buf.extend(bytes(start - len(buf)))
    buf[start : start + (hi - lo)] = data[lo:hi]


def sector_pieces(offset: int, length: int) -> list[tuple[int, int]]:
    """Split a write of ``length`` bytes at ``offset`` at the 512-byte sector boundaries of
    the file, as (lo, hi) ranges relative to the write."""
    pieces = []
    lo = 0
    while lo < length:
        boundary = (offset + lo) // SECTOR * SECTOR + SECTOR
        hi = min(length, boundary - offset)
        pieces.append((lo, hi))
        lo = hi
    return pieces
