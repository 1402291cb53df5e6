"""Files and folders a run writes to.

- :func:`atomic_write` writes through a temporary file beside the target and renames it over the target, so
  a crash or a full disk never leaves a broken file and the previous one stays intact until the new one is
  complete; the file gets the mode a plain ``open(path, "w")`` would give it.
- :func:`check_writable_folder` and :func:`check_writable_file` fail before any work starts when the output
  cannot be written.
- :class:`FolderLock` lets one training run at a time use an output folder.

Every failure here is an :class:`OutputError`: one sentence naming the path, what went wrong and what to do.
"""

import errno
import os
import re
import socket
import stat
import tempfile

import filelock

TEMPORARY_PREFIX, TEMPORARY_SUFFIX = ".tmp-", ".partial"
# The names tempfile.mkstemp gives atomic_write's files: the prefix, 8 random letters, digits or underscores, the
# suffix (a user's own file, such as .tmp-pretrained.pth or .tmp-snapshot, is not one).
_TEMPORARY_NAME = re.compile(re.escape(TEMPORARY_PREFIX) + r"[a-z0-9_]{8}" + re.escape(TEMPORARY_SUFFIX))
LOCK_NAME = ".lock"

SAFETENSORS_NAME = "model.safetensors"  # the weights of a Hub folder


class OutputError(OSError):
    """An output that cannot be written; ``str()`` is one sentence."""


def _reason(error):
    """The system's words for an OSError (``No space left on device``)."""
    return error.strerror or type(error).__name__


def _os_error(error):
    """The OSError behind ``error``: itself, or one that it was raised while handling (``torch.save`` raises its
    writer's RuntimeError on top of the file's OSError when a disk is full)."""
    while error is not None and not isinstance(error, OSError):
        error = error.__cause__ or error.__context__
    return error


def atomic_write(path, write):
    """Write a file through ``write(binary_file)`` into a temporary file beside ``path``, then rename it over
    ``path``. As a plain write would: where ``path`` is a link, the file it points to is written; an existing
    file keeps its mode; a new one gets the mode the umask gives."""
    target = os.path.realpath(path)
    directory = os.path.dirname(target)
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=TEMPORARY_PREFIX, suffix=TEMPORARY_SUFFIX)
    except OSError as e:
        raise OutputError(
            f"Cannot write {path}: {_reason(e)} in {directory}; choose a folder you can write to."
        ) from None
    try:
        os.chmod(tmp, _plain_write_mode(target))  # mkstemp makes files private to the owner
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        failed = _os_error(e)
        if failed is not None and not isinstance(failed, OutputError):
            kept = "the previous file is intact" if os.path.exists(path) else "nothing was written"
            advice = "free some space" if failed.errno in (errno.ENOSPC, errno.EDQUOT) else "check the folder"
            raise OutputError(f"Writing {path} failed ({_reason(failed)}); {kept}: {advice} and run again.") from None
        raise


def _plain_write_mode(path):
    """The mode ``open(path, "w")`` leaves ``path`` with: an existing file's own, else what the umask gives."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def check_writable_folder(path, what="OUTPUT_DIR"):
    """Create ``path`` if needed and make sure a file can be written in it; else an :class:`OutputError`."""
    why = _unwritable(path)
    if why:
        raise OutputError(f"{what} {path} cannot be written ({why}); choose a folder you can write to.")


def check_writable_file(path, what="The output", source=None):
    """Make sure ``path`` can be written (its folder is writable, and it is not a folder) before the work that
    produces it starts, and that it is not ``source``, the file the work reads (by another name or a link too; a Hub
    folder's weights file), which writing it would lose."""
    if source and os.path.isdir(source):  # a Hub folder: the work reads its weights file
        source = os.path.join(source, SAFETENSORS_NAME)
    if source and os.path.exists(path) and os.path.exists(source) and os.path.samefile(path, source):
        raise OutputError(f"{what} {path} is the file it is made from, {source}; choose another path for it.")
    why = "it is a folder" if os.path.isdir(path) else _unwritable(os.path.dirname(os.path.abspath(path)))
    if why:
        raise OutputError(f"{what} {path} cannot be written ({why}); choose a path you can write to.")


def not_a_folder(path):
    """Why ``path`` is not a folder to read from ("does not exist", "is a file, not a folder"), or None when it is."""
    if os.path.isdir(path):
        return None
    return "is a file, not a folder" if os.path.exists(path) else "does not exist"


def _unwritable(folder):
    """Why no file can be written in ``folder`` (created if missing), or None when one can."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        return "it is a file, not a folder"
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=TEMPORARY_PREFIX, suffix=TEMPORARY_SUFFIX)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return _reason(e)
    return None


def remove_temporaries(folder):
    """Remove the temporary files that interrupted writes left in ``folder``; returns their names. Only for a
    folder whose :class:`FolderLock` this process holds (another run may be writing them)."""
    names = sorted(n for n in os.listdir(folder) if _TEMPORARY_NAME.fullmatch(n))
    for name in names:
        os.remove(os.path.join(folder, name))
    return names


_HELD = set()  # the held locks: filelock releases one that is garbage-collected, FolderLock's last until released


class FolderLock:
    """An exclusive lock on a folder (``filelock``'s, on every system), held until :meth:`release` or the end of the
    process (however it ends: the operating system drops the lock with the process). A second holder is refused in
    one sentence that names the process holding it, where the system lets it read the holder's note."""

    def __init__(self, folder, what="OUTPUT_DIR"):
        path = os.path.join(folder, LOCK_NAME)
        self._lock = filelock.FileLock(path, timeout=0)
        try:
            self._lock.acquire()
        except filelock.Timeout:
            raise OutputError(
                f"{what} {folder} is in use by another run ({_holder(path)}); wait for it to end or choose another "
                f"{what}."
            ) from None
        _HELD.add(self._lock)
        try:  # a note for a refused second holder; Windows locks the bytes, so there it stays unwritten
            with open(path, "w") as note:
                note.write(f"process {os.getpid()} on {socket.gethostname()}")
        except OSError:
            pass

    def release(self):
        if self._lock is not None:
            self._lock.release()
            _HELD.discard(self._lock)
            self._lock = None


def _holder(path):
    """The note the holder of a lock wrote into its file, or "another process"."""
    try:
        with open(path) as note:
            return note.read(256).strip() or "another process"
    except OSError:
        return "another process"
