"""Writing files durably, and the C library handle for calls the os module lacks.

One copy of each: writing a whole buffer to a descriptor (:mod:`gatewayd.fdwrite`'s,
re-exported here), making a directory's entries durable (fsync of the directory, after a
create or a rename in it), replacing a small file atomically (by its path, or by its
directory's descriptor), and :data:`LIBC`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

from gatewayd.fdwrite import write_all

__all__ = [
    "LIBC",
    "RENAME_EXCHANGE",
    "RENAME_NOREPLACE",
    "fsync_dir",
    "fsync_dir_fd",
    "rename_at",
    "write_all",
    "write_atomically",
    "write_atomically_at",
]

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final

# The process's C library (dlopen(NULL)), with errno kept for ctypes.get_errno(): mount,
# umount2, syncfs, setns, unshare, prctl and syscall (openat2, open_tree, move_mount).
# One handle, so each prototype below is set once, not by whichever module imports first.
LIBC: Final = ctypes.CDLL(None, use_errno=True)
# syscall(2) returns a long: a descriptor, or -1 with errno.
LIBC.syscall.restype = ctypes.c_long
# mount(source, target, filesystemtype, mountflags, data): flags are an unsigned long, and
# data is opaque (None or option text).
LIBC.mount.argtypes = (
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
)

# renameat2(olddirfd, oldpath, newdirfd, newpath, flags): glibc 2.28+ wraps it.
LIBC.renameat2.argtypes = (
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_uint,
)
# From <linux/fs.h>: refuse to replace an existing target; swap two names atomically.
RENAME_NOREPLACE: Final = 1 << 0
RENAME_EXCHANGE: Final = 1 << 1

# Opening a directory only to fsync it: reading is the least a descriptor fsync accepts.
_SYNC_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def fsync_dir(path: Path, *, follow_symlinks: bool = True) -> None:
    """Make the entries of directory ``path`` durable (a file created, renamed or removed
    in it). ``follow_symlinks=False`` refuses a symlink at ``path`` (``ELOOP``/``ENOTDIR``).

    Error handling: OSError as the system reports it.
    """
    flags = _SYNC_DIR_FLAGS if follow_symlinks else _SYNC_DIR_FLAGS | os.O_NOFOLLOW
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir_fd(dir_fd: int) -> None:
    """Make the entries of the directory open as ``dir_fd`` durable. The directory is
    opened again for reading, so ``dir_fd`` may be an ``O_PATH`` descriptor.

    Error handling: OSError as the system reports it.
    """
    fd = os.open(".", _SYNC_DIR_FLAGS, dir_fd=dir_fd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes, mode: int = 0o600, *, sync_dir: bool = True) -> None:
    """Make ``path`` hold ``data`` (with ``mode`` if it is new), durably and atomically:
    a temporary file beside it, fsync, rename over it, fsync of the directory, so a crash
    leaves either the old content or the new, never a mix.

    ``sync_dir=False`` leaves the directory's fsync to the caller (one for several files
    of one directory, or none where losing the name to a power cut is harmless): the
    content is still whole whenever the name is there.

    Error handling: OSError as the system reports it; the old file is then untouched
    (a stale temporary file may stay beside it and is replaced by the next write).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)


def write_atomically_at(dir_fd: int, name: str, data: bytes, mode: int) -> None:
    """:func:`write_atomically` of ``name`` in the directory open as ``dir_fd``: for a
    file in a tree someone else may rename or link, reached by descriptor, never by a
    path. The temporary file is made new (``O_EXCL``, never through a link) with a name
    of its own, and removed if anything fails.

    Error handling: OSError as the system reports it; the old file is then untouched.
    """
    tmp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, mode, dir_fd=dir_fd)
    try:
        try:
            write_all(fd, data)
            os.fchmod(fd, mode)  # the umask may have taken bits off
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    fsync_dir_fd(dir_fd)


def rename_at(src_dir_fd: int, src: str, dst_dir_fd: int, dst: str, flags: int) -> None:
    """``renameat2(2)``: ``flags`` :data:`RENAME_NOREPLACE` (fail with ``EEXIST`` if
    ``dst`` exists) or :data:`RENAME_EXCHANGE` (swap the two names, both must exist), each
    in one atomic step the os module cannot take.

    Error handling: OSError with the call's errno (``EINVAL`` where the file system
    does not support the flag).
    """
    if LIBC.renameat2(src_dir_fd, os.fsencode(src), dst_dir_fd, os.fsencode(dst), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), f"{src} -> {dst}")
