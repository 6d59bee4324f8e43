"""gatewayd.files: writing a whole buffer, syncing a directory, replacing a file atomically,
and the one C library handle."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from gatewayd import files
from gatewayd.files import LIBC, fsync_dir, fsync_dir_fd, write_all, write_atomically


def _short_writes(limit: int) -> Callable[[int, bytes], int]:
    real = os.write

    def write(fd: int, data: bytes) -> int:
        return real(fd, bytes(data[:limit]))

    return write


@pytest.mark.parametrize(
    ("data", "per_write"),
    [
        (b"", 1),
        (b"x", 1),
        (b"abcdefghij", 3),  # the last write is shorter than the others
        (b"abcdefghij", 10),
        (bytes(range(256)) * 64, 4096),
    ],
)
def test_write_all_writes_everything_however_short_each_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes, per_write: int
) -> None:
    monkeypatch.setattr(files.os, "write", _short_writes(per_write))
    path = tmp_path / "out"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)
    assert path.read_bytes() == data


def test_write_all_stops_with_eio_when_a_write_makes_no_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files.os, "write", lambda fd, data: 0)
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError, match="no progress") as caught:
            write_all(fd, b"data")
    finally:
        os.close(fd)
    assert caught.value.errno == errno.EIO


def test_write_all_reports_a_closed_descriptor(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)
    with pytest.raises(OSError) as caught:
        write_all(fd, b"data")
    assert caught.value.errno == errno.EBADF


@pytest.mark.parametrize(("follow", "works"), [(True, True), (False, False)])
def test_fsync_dir_follows_a_symlink_only_when_asked(
    tmp_path: Path, follow: bool, works: bool
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    fsync_dir(real, follow_symlinks=follow)  # a real directory always works
    if works:
        fsync_dir(link, follow_symlinks=follow)
    else:
        with pytest.raises(OSError) as caught:
            fsync_dir(link, follow_symlinks=follow)
        assert caught.value.errno in (errno.ELOOP, errno.ENOTDIR)


def test_fsync_dir_refuses_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        fsync_dir(tmp_path / "file")


@pytest.mark.parametrize("flags", [os.O_RDONLY | os.O_DIRECTORY, os.O_PATH | os.O_DIRECTORY])
def test_fsync_dir_fd_takes_a_readable_or_a_path_only_descriptor(
    tmp_path: Path, flags: int
) -> None:
    fd = os.open(tmp_path, flags | os.O_CLOEXEC)
    try:
        fsync_dir_fd(fd)
    finally:
        os.close(fd)


def test_fsync_dir_fd_leaves_no_descriptor_open(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        before = set(os.listdir("/proc/self/fd"))
        fsync_dir_fd(fd)
        assert set(os.listdir("/proc/self/fd")) == before
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("old", "mode", "expected_mode"),
    [
        (None, 0o600, 0o600),  # a new file takes the mode given
        (None, 0o640, 0o640),
        (b"old content", 0o600, 0o600),
        (b"", 0o640, 0o640),
    ],
)
def test_write_atomically_replaces_the_content_and_leaves_no_temporary_file(
    tmp_path: Path, old: bytes | None, mode: int, expected_mode: int
) -> None:
    path = tmp_path / "state.json"
    if old is not None:
        path.write_bytes(old)
    old_umask = os.umask(0)
    try:
        write_atomically(path, b'{"new": true}', mode)
    finally:
        os.umask(old_umask)
    assert path.read_bytes() == b'{"new": true}'
    assert stat.S_IMODE(path.stat().st_mode) == expected_mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_write_atomically_never_writes_through_a_symlinked_temporary_name(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(b"old")
    target = tmp_path / "elsewhere"
    target.write_bytes(b"untouched")
    (tmp_path / f".state.json.{os.getpid()}.tmp").symlink_to(target)
    with pytest.raises(OSError) as caught:
        write_atomically(path, b"new")
    assert caught.value.errno == errno.ELOOP
    assert (path.read_bytes(), target.read_bytes()) == (b"old", b"untouched")


def test_the_libc_handle_reports_errno() -> None:
    # syncfs on a descriptor that is not open: -1 and EBADF, read through use_errno.
    fd = os.open("/", os.O_RDONLY | os.O_CLOEXEC)
    os.close(fd)
    assert LIBC.syncfs(fd) == -1
    assert ctypes.get_errno() == errno.EBADF


def test_the_libc_syscall_prototype_returns_a_long() -> None:
    # SYS_getpid (x86_64: 39) through syscall(2): a long, not a truncated int.
    assert LIBC.syscall.restype is ctypes.c_long
    assert LIBC.syscall(39) == os.getpid()
