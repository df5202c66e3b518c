"""The file-system seam: every byte the spool reads or writes goes through ``FileSystem``.

Thin on purpose: one method per system call the spool uses. Tests substitute a subclass
that counts calls, records an I/O trace, injects errors, or drops un-fsynced writes
(``spool.testing``), the way LevelDB's ``Env`` lets its fault-injection tests work.

Crash safety:
    Nothing here decides ordering; callers do, and argue it where they call. ``pwrite``
    writes all of ``data`` or raises; a short write is retried, never silently accepted.

Errors:
    ``OSError`` propagates unchanged; the writer turns it into ``SpoolFailed``.
"""

from __future__ import annotations

import contextlib
import os
import stat


class FileSystem:
    """Real POSIX file operations. Thread-safe (each call is one system call)."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        """os.open; new files get ``mode`` (0600: mail is private). Never blocks: a FIFO
        (or a device) put where the spool expects a file opens at once (``O_NONBLOCK``,
        which regular files ignore); reading it then fails, or ``is_file`` tells."""
        return os.open(path, flags | os.O_CLOEXEC | os.O_NONBLOCK, mode)

    def is_file(self, fd: int) -> bool:
        """Whether ``fd`` is a regular file (not a directory, FIFO, device or socket)."""
        return stat.S_ISREG(os.fstat(fd).st_mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwrite(self, fd: int, data: bytes, offset: int) -> None:
        """Write all of ``data`` at ``offset``."""
        view = memoryview(data)
        while view:
            written = os.pwrite(fd, view, offset)
            if written <= 0:
                raise OSError(f"pwrite wrote {written} bytes")
            view = view[written:]
            offset += written

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        """Read up to ``size`` bytes at ``offset`` (fewer only at end of file)."""
        return os.pread(fd, size, offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fsync_dir(self, path: str) -> None:
        """Make the directory entries of ``path`` (creates, renames, unlinks) durable."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def mkdir(self, path: str, mode: int = 0o700) -> None:
        os.mkdir(path, mode)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def file_size(self, path: str) -> int:
        return os.stat(path).st_size

    def stat(self, path: str) -> os.stat_result:
        return os.stat(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def lexists(self, path: str) -> bool:
        """Whether ``path`` names anything, a broken or looping link too."""
        return os.path.lexists(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def is_link(self, path: str) -> bool:
        """Whether ``path`` is a symbolic link (dangling or not)."""
        return os.path.islink(path)

    def is_regular(self, path: str) -> bool:
        """Whether ``path`` is a regular file (through links; a dangling link is not)."""
        return os.path.isfile(path)

    def access(self, path: str, mode: int) -> bool:
        """os.access: whether this user may ``mode`` (os.W_OK, ...) ``path``."""
        return os.access(path, mode)

    def makedirs(self, path: str, mode: int) -> None:
        """Make ``path`` and its missing parents (outside a spool: its parent directories)."""
        os.makedirs(path, mode=mode, exist_ok=True)

    def free_bytes(self, path: str) -> int:
        """Bytes available to this user on the file system holding ``path``."""
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize


def read_file(fs: FileSystem, path: str, offset: int = 0) -> bytes:
    """The bytes of ``path`` from ``offset`` to its end, read through the seam."""
    fd = fs.open(path, os.O_RDONLY)
    try:
        return fs.pread(fd, max(fs.size(fd) - offset, 0), offset)
    finally:
        fs.close(fd)


def write_file_durably(fs: FileSystem, path: str, data: bytes) -> None:
    """Create (or truncate) ``path`` holding ``data``, fdatasynced on return.

    The one recipe for the spool's durable copies (damage set aside in ``corrupt/``, a
    segment archived across devices, a repaired segment's temporary file). The caller
    fsyncs the directory, and argues what a crash before that leaves. A failure removes
    what was written (a full disk leaves no partial copy behind) and raises.
    """
    fd = fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        fs.pwrite(fd, data, 0)
        fs.fdatasync(fd)
    except OSError:
        fs.close(fd)
        with contextlib.suppress(OSError):
            fs.unlink(path)
        raise
    fs.close(fd)
