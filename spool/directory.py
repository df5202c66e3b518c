"""The spool directory: creating and checking it, the archive directory, archiving.

A spool directory is private to its owner (0700, owned by this user, nobody else may
write it) and holds ``log/``, ``bodies/`` and ``incoming/`` (docs/format.md). Every
directory made here is fsynced into its parent before anything is written inside it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat

from spool import format as fmt
from spool.errors import BadSpoolDirectory
from spool.fs import FileSystem, read_file, write_file_durably


def user_name(uid: int) -> str:
    """The name of user ``uid`` (``uid N`` when it has none)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def prepare_directory(fs: FileSystem, path: str) -> None:
    """Create the spool directory (0700) or check an existing one is ours and private."""
    try:
        st = fs.stat(path)
    except NotADirectoryError:
        raise BadSpoolDirectory(path, "a component of the path is not a directory") from None
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        try:
            fs.makedirs(parent, 0o755)
            # A crash after this mkdir leaves an empty directory: a valid empty spool.
            # The new name is durable only once its parent directory is fsynced (fault
            # model 4); until then nothing is written inside, so a crash loses nothing
            # acknowledged.
            with contextlib.suppress(FileExistsError):  # another opener made it first
                fs.mkdir(path, 0o700)
            fs.fsync_dir(parent)
        except OSError as exc:
            raise BadSpoolDirectory(path, f"cannot create it: {exc.strerror or exc}") from exc
        st = fs.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise BadSpoolDirectory(path, "exists and is not a directory")
    if st.st_uid != os.geteuid():
        owner, me = user_name(st.st_uid), user_name(os.geteuid())
        raise BadSpoolDirectory(
            path,
            f"owned by {owner}, not by this user ({me}): run the command as {owner} "
            f"(for example: sudo -u {owner} spool ...); a spool is used by one user",
        )
    if st.st_mode & 0o022:
        raise BadSpoolDirectory(
            path, f"mode {stat.S_IMODE(st.st_mode):04o} lets others write; chmod 700 it"
        )
    if not fs.access(path, os.W_OK | os.X_OK):
        raise BadSpoolDirectory(path, "not writable by this user (read-only file system?)")
    check_layout(fs, path)
    for sub in (fmt.LOG_DIR, fmt.BODY_DIR, fmt.INCOMING_DIR):
        sub_path = os.path.join(path, sub)
        if not fs.is_dir(sub_path):
            # A crash before the fsync below may lose the new directory; the next open
            # creates it again. Nothing is written into it before this fsync returns.
            try:
                with contextlib.suppress(FileExistsError):  # a racing opener made it
                    fs.mkdir(sub_path, 0o700)
                fs.fsync_dir(path)
            except OSError as exc:
                raise BadSpoolDirectory(
                    path, f"cannot create {sub}/: {exc.strerror or exc}"
                ) from exc


# The entries of a spool directory and what each must be when present (docs/format.md):
# a directory, a regular file, or (the control socket, which an owner replaces) anything
# but a directory.
_DIRECTORY, _FILE, _NOT_DIRECTORY = "directory", "file", "not a directory"
_LAYOUT = (
    (fmt.LOG_DIR, _DIRECTORY),
    (fmt.BODY_DIR, _DIRECTORY),
    (fmt.INCOMING_DIR, _DIRECTORY),
    (fmt.CORRUPT_DIR, _DIRECTORY),
    (fmt.LOCK_NAME, _FILE),
    (fmt.REPAIRING_NAME, _FILE),
    (fmt.SOCKET_NAME, _NOT_DIRECTORY),
)


def check_layout(fs: FileSystem, path: str) -> None:
    """Refuse, with ``BadSpoolDirectory`` and before anything is written, a spool in which
    an entry the spool itself makes is of another kind: a file where ``log/``,
    ``bodies/``, ``incoming/`` or ``corrupt/`` belongs, a directory (a FIFO, a dangling
    link) where the ``lock`` or ``repairing`` file belongs, or a directory named as the
    control socket (which ``spool serve`` replaces when it is anything else). The spool
    never makes such an entry and cannot use one: an open, a check or a repair would stop
    half way on an ``OSError``. What the check and the repair set right themselves (the
    positions, the settings, the entries inside ``log/``, ``bodies/``, ``incoming/``) is
    left to them."""
    for name, want in _LAYOUT:
        entry = os.path.join(path, name)
        try:
            mode = fs.stat(entry).st_mode
        except FileNotFoundError:
            if not fs.is_link(entry):
                # Absent: made when needed (or made just now by a racing opener, which
                # makes only entries of the right kind).
                continue
            mode = 0  # a link to nothing
        except OSError as exc:
            raise BadSpoolDirectory(path, f"cannot look at {name}: {exc.strerror or exc}") from exc
        if want == _NOT_DIRECTORY and stat.S_ISDIR(mode):
            raise BadSpoolDirectory(
                path,
                f"{name} is a directory where the owner's control socket belongs: the "
                "spool never makes one; move it out of the spool directory and run the "
                "command again",
            )
        if want == _DIRECTORY and not stat.S_ISDIR(mode):
            raise BadSpoolDirectory(
                path,
                f"{name} is {_kind(mode)} where the directory {name}/ belongs: the spool "
                "never makes one; move it out of the spool directory and run the command again",
            )
        if want == _FILE and not stat.S_ISREG(mode):
            raise BadSpoolDirectory(
                path,
                f"{name} is {_kind(mode)} where the spool keeps its {name} file: the spool "
                "never makes one; move it out of the spool directory and run the command again",
            )


def _kind(mode: int) -> str:
    """What an entry is, in an error message."""
    if mode == 0:
        return "a link to nothing"
    for test, what in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "a device"


def prepare_archive(fs: FileSystem, archive_dir: str) -> None:
    """Create the archive directory (and its parents) if it does not exist yet."""
    if fs.is_dir(archive_dir):
        if not fs.access(archive_dir, os.W_OK | os.X_OK):
            raise BadSpoolDirectory(archive_dir, "the archive directory is not writable")
        return
    if fs.exists(archive_dir):
        raise BadSpoolDirectory(archive_dir, "the archive path exists and is not a directory")
    parent = os.path.dirname(os.path.abspath(archive_dir))
    try:
        fs.makedirs(parent, 0o700)
        # Nothing is archived into it before this returns; a crash before the parent's
        # fsync may lose the new directory, and the next open creates it again.
        fs.mkdir(archive_dir, 0o700)
        fs.fsync_dir(parent)
    except OSError as exc:
        raise BadSpoolDirectory(
            archive_dir, f"cannot create the archive directory: {exc.strerror or exc}"
        ) from exc


def archive_file(fs: FileSystem, path: str, archive_dir: str) -> None:
    """Move a retired segment into ``archive_dir`` (rename, or copy+unlink across devices).

    A crash midway leaves the segment in the log directory (retired, archived again by the
    next checkpoint) and possibly a complete or partial copy in the archive, overwritten
    then: the archive copy is fsynced before the original is unlinked.
    """
    target = os.path.join(archive_dir, os.path.basename(path))
    try:
        fs.rename(path, target)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        write_file_durably(fs, target, read_file(fs, path))
        fs.unlink(path)
    fs.fsync_dir(archive_dir)
