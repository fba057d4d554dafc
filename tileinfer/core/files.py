"""Atomic writes with one-line errors: every file this project writes goes through here.

A result is either complete under its final name or absent: the content goes to a temporary file
beside the target, which is renamed over it (``os.replace``, atomic on POSIX) only once written. On
any failure the temporary file is removed, and an operating-system failure (no space left, a
read-only file system, permission denied) becomes a :class:`~tileinfer.core.errors.UserError`
naming the path, so commands print one line instead of a traceback.

A file that several jobs of a sweep may need at once (a base reply, a dequantized checkpoint, a
download) is made under :func:`locked`: the first job makes it, the others wait, then read it.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock

from tileinfer.core.errors import UserError

# Libraries that write files themselves (safetensors' Rust writer) report an OS failure as their own
# exception type whose message ends in "(os error N)".
_OS_ERROR_IN_TEXT = re.compile(r"os error (\d+)")
# The errors of a place that cannot take a write: full disk or quota, file too large, read-only, not allowed.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM})


def os_error_line(path: Path | str, e: BaseException) -> str:
    """``cannot write PATH: No space left on device`` for an OS error (or a library error that wraps
    one); ``''`` when ``e`` is not an OS failure."""
    code = e.errno if isinstance(e, OSError) else None
    if code is None:
        m = _OS_ERROR_IN_TEXT.search(str(e))
        code = int(m.group(1)) if m else None
    if code is None:
        return ""
    return f"cannot write {path}: {os.strerror(code)}"


def make_dir(path: Path | str) -> Path:
    """``mkdir -p`` that raises :class:`UserError` (one line naming the path) on an OS failure."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # exist_ok covers folders only: a file (or a link to one) is in the way
        raise UserError(f"cannot write {path}: it exists and is not a folder") from None
    except OSError as e:
        raise UserError(os_error_line(path, e)) from None
    return path


def check_writable(folder: Path | str) -> Path:
    """Create ``folder`` if needed and prove that a file can be created in it (``mkdir`` alone succeeds
    on an existing folder of a read-only file system or without write permission).

    Raises:
        UserError: one line naming the folder.
    """
    folder = make_dir(folder)
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".write-check.", suffix=".tmp")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise UserError(os_error_line(folder, e)) from None
    return folder


@contextmanager
def atomic_path(path: Path | str, mode: int = 0o644, folder: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block ends without error, the temporary file
    (or folder) becomes ``path``.

    Args:
        path: the final file or folder; its parent folders are created.
        mode: permission bits of a file result (``mkstemp`` makes files owner-only); a folder gets
            the usual mode under the umask.
        folder: yield an empty temporary folder instead of a file (an existing ``path`` folder is
            replaced only once the new one is complete).

    Raises:
        UserError: an OS failure while writing or renaming (the temporary file is removed).
        Exception: any other error of the block, re-raised after removing the temporary file.
    """
    path = Path(path)
    make_dir(path.parent)
    try:
        if folder:
            name = tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        else:
            fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            os.close(fd)
    except OSError as e:
        raise UserError(os_error_line(path, e)) from None
    tmp = Path(name)
    try:
        yield tmp
        if folder:
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it owner-only
            _replace_folder(tmp, path)
        else:
            os.chmod(tmp, mode)
            os.replace(tmp, path)
    except BaseException as e:
        _remove(tmp)
        if isinstance(e, UserError):  # from a write inside the block: name the result, not the temporary
            if str(tmp) in str(e):
                raise UserError(str(e).replace(str(tmp), str(path))) from None
            raise
        line = os_error_line(path, e) if isinstance(e, Exception) else ""
        if line:
            raise UserError(line) from None
        raise


def _replace_folder(tmp: Path, path: Path) -> None:
    """Rename folder ``tmp`` to ``path``; an existing ``path`` (which ``os.replace`` cannot replace
    unless empty) is moved aside first and put back if the rename fails."""
    if not path.exists():
        os.replace(tmp, path)
        return
    old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
    try:
        os.replace(path, old / path.name)
    except BaseException:
        shutil.rmtree(old, ignore_errors=True)  # still empty
        raise
    try:
        os.replace(tmp, path)
    except BaseException:
        try:
            os.replace(old / path.name, path)  # put the previous folder back
        except OSError:
            pass  # it stays in the side folder: never delete it
        else:
            shutil.rmtree(old, ignore_errors=True)  # empty again
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def locked(path: Path | str) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` for the block, so that of several processes about to make
    the same shared file one makes it and the others, waiting here, then find it made: check for the
    file again inside the block. The lock is the file ``PATH.lock`` beside it (on the same file
    system, so that jobs on several hosts of a shared one see it), taken with ``flock`` through the
    ``filelock`` package: the operating system frees it when its holder exits, even when killed. The
    holder deletes the lock file when the block ends, leaving no trace; a process that arrives just
    then may take a new lock file and recompute, which costs time but never a wrong copy (results are
    written atomically).

    Raises:
        UserError: the lock file cannot be created (one line naming ``path``).
    """
    lock_file = Path(f"{path}.lock")
    make_dir(lock_file.parent)
    lock = FileLock(lock_file)
    try:
        lock.acquire()
    except OSError as e:
        raise UserError(os_error_line(path, e) or f"cannot lock {path}: {e}") from None
    try:
        yield
    finally:
        lock_file.unlink(missing_ok=True)
        lock.release()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_bytes(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # a full disk can surface only here


def write_text(path: Path | str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_path`)."""
    write_bytes(path, text.encode())


def _remove(tmp: Path) -> None:
    """Delete a temporary file or folder; a failure here must not hide the error that led to it."""
    try:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    except OSError:
        pass
