"""Opening an audit log's files and finding where its chain ends (the writer,
:mod:`gatewayd.audit.writer`, goes on from there).

The log and its head file are created (the directory 0700, the files 0600) or opened,
and each is locked for this process alone (``flock``): two writers would fork the chain.
Only the tail is read (:mod:`gatewayd.audit.tail` decides, from those bytes, where the
chain ends), starting where the head file says the last durable entry ends; without a
head file, backwards from the end. A rotation interrupted by a crash is recognised from
the last closed segment. A torn tail is ended with a newline, so the next entry starts
clean, and described for the ``torn_tail_recovered`` event; nothing is ever dropped.

Error handling: :class:`AuditOpenError` when the log cannot be continued safely; the
message says what the operator can do.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gatewayd.audit.chain import GENESIS, ChainPosition, SealedEntry
from gatewayd.audit.head import HeadFormatError, HeadRecord, head_path, read_head
from gatewayd.audit.line import MAX_LINE_BYTES
from gatewayd.audit.segments import list_segments
from gatewayd.audit.tail import ChainEnd, TailError, TailWindow, anchor_at_head, last_valid, walk
from gatewayd.files import fsync_dir

# One flush writes at most this much, so a crash mid-write tears at most one batch;
# that bounds how far back ``open_audit_log`` must look for the end of the chain.
MAX_BATCH_BYTES: Final = 4 * 1024 * 1024
# How much of the tail open will read: a torn batch plus the line before it. Beyond
# this the file was not left by a crash of this writer, and open refuses.
MAX_TAIL_SCAN_BYTES: Final = 2 * MAX_BATCH_BYTES + 2 * MAX_LINE_BYTES
# Counting lines without a head file reads the whole log once, in chunks of this.
_COUNT_CHUNK_BYTES: Final = 1024 * 1024
# A file that holds no entry at all is only resumed if it starts like our first line
# (or, after a rotation, like any line).
_FIRST_LINE_PREFIX: Final = b'{"seq":1,"time":"'
_ANY_LINE_PREFIX: Final = b'{"seq":'
# The log tells what every run did: it is gatewayd's alone, and so is a directory it makes.
_DIR_MODE: Final = 0o700
FILE_MODE: Final = 0o600


class AuditOpenError(Exception):
    """The log cannot be continued safely (locked, truncated, rewritten, not a log).

    The message names the file, what is wrong and what the operator can do.
    """


@dataclass(frozen=True, slots=True)
class OpenedLog:
    """The log's open files (the log O_APPEND, its head file), both locked, and where
    the chain in the log ends; the writer takes them over."""

    fd: int
    head_fd: int
    chain_end: ChainEnd
    lines: int  # lines up to chain_end.end
    head: HeadRecord | None
    torn_terminated: bool  # a newline was written to end a torn region
    last_segment: int  # the highest closed segment number found (0: none)
    # The active file holds no entry yet but continues a chain: the last closed
    # segment's name (None when it is gone), so open records ``segment_open`` first.
    continues_segment: str | None
    continues: bool


def _pread_all(fd: int, start: int, end: int) -> bytes:
    chunks: list[bytes] = []
    while start < end:
        chunk = os.pread(fd, end - start, start)
        if not chunk:
            break  # the file shrank under us; what we have is the tail
        chunks.append(chunk)
        start += len(chunk)
    return b"".join(chunks)


def _count_lines(fd: int, end: int) -> int:
    count, offset = 0, 0
    while offset < end:
        chunk = os.pread(fd, min(_COUNT_CHUNK_BYTES, end - offset), offset)
        if not chunk:
            break
        count += chunk.count(b"\n")
        offset += len(chunk)
    return count


def _end_at_head(rfd: int, size: int, head: HeadRecord) -> tuple[ChainEnd, int]:
    if size - head.end > MAX_TAIL_SCAN_BYTES:
        raise TailError(
            f"{size - head.end} bytes follow the last durable entry (seq {head.seq}); "
            f"a crash leaves at most {MAX_TAIL_SCAN_BYTES}: something else wrote the log"
        )
    start = max(0, head.end - MAX_LINE_BYTES - 1)
    window = TailWindow(_pread_all(rfd, start, size), start)
    chain_end = walk(window, head.end, anchor_at_head(window, head))
    return chain_end, head.lines + chain_end.walked


def _end_after(rfd: int, size: int, position: ChainPosition) -> tuple[ChainEnd, int]:
    """A fresh active file that continues the chain from ``position`` (a closed
    segment's last entry): follow it from its first byte."""
    if size > MAX_TAIL_SCAN_BYTES:
        raise TailError(f"its {size} bytes do not continue the last closed segment")
    chain_end = walk(TailWindow(_pread_all(rfd, 0, size), 0), 0, position)
    return chain_end, chain_end.walked


def _segment_end(segment: Path) -> tuple[SealedEntry, int] | None:
    """The last entry of a closed segment and the offset just past it."""
    with segment.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        start = max(0, size - 2 * MAX_LINE_BYTES)
        file.seek(start)
        return last_valid(TailWindow(file.read(), start))


def _find_chain_end(
    rfd: int, size: int, head: HeadRecord | None, segment: Path | None
) -> tuple[ChainEnd, int]:
    """Where the chain in the file ends, and how many lines come before that point.

    ``segment`` is the last closed segment, if any: a rotation interrupted between the
    rename and the head's move leaves the head describing it, and a new (empty, or
    torn) active file, or none, that continues from its last entry.
    """
    if head is not None:
        try:
            return _end_at_head(rfd, size, head)
        except TailError:
            if segment is None or head.end == 0:
                raise
            found = _segment_end(segment)
            if (
                found is None
                or found[1] != head.end
                or found[1] != segment.stat().st_size
                or found[0].position != ChainPosition(head.seq, head.hash)
            ):
                raise
            return _end_after(rfd, size, found[0].position)
    if segment is not None and size <= MAX_TAIL_SCAN_BYTES:
        data = _pread_all(rfd, 0, size)
        if last_valid(TailWindow(data, 0)) is None and (
            not data or data.startswith(_ANY_LINE_PREFIX)
        ):
            found = _segment_end(segment)
            if found is None:
                raise TailError(f"its last closed segment {segment.name} holds no entry")
            return _end_after(rfd, size, found[0].position)
    if size == 0:
        return ChainEnd(GENESIS, 0, 0, b""), 0
    span = min(size, 2 * MAX_LINE_BYTES)
    while True:
        window = TailWindow(_pread_all(rfd, size - span, size), size - span)
        found = last_valid(window)
        if found is not None:
            sealed, end = found
            torn = window.data[end - window.start :]
            return ChainEnd(sealed.position, end, 0, torn), _count_lines(rfd, end)
        if window.start == 0:
            if window.data.startswith(_FIRST_LINE_PREFIX):
                return ChainEnd(GENESIS, 0, 0, window.data), 0  # the first write was torn
            raise TailError("it holds no audit entry and does not start like an audit log")
        if span >= MAX_TAIL_SCAN_BYTES:
            raise TailError(f"there is no valid entry in its last {span} bytes")
        span = min(size, span * 2)


def open_files(path: Path, fsync: bool) -> OpenedLog:
    """Worker thread: create/open the files, lock, find the chain end, end a torn tail."""
    created: list[Path] = []
    if not path.parent.exists():
        path.parent.mkdir(mode=_DIR_MODE, parents=True)
        created.append(path.parent)
    hpath = head_path(path)
    if not os.path.lexists(path):
        created.append(path)
    flags = os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | flags, FILE_MODE)
    fds = [fd]
    try:
        lock_log(fd, path)
        try:
            head = read_head(path)
        except HeadFormatError as exc:
            raise AuditOpenError(
                f"the head file {hpath} is damaged ({exc}); check the log with "
                f"'gatewayd audit verify {path}', then move the head file aside to continue"
            ) from None
        if not os.path.lexists(hpath):
            created.append(hpath)
        head_fd = os.open(hpath, os.O_RDWR | os.O_CREAT | flags, FILE_MODE)
        fds.append(head_fd)
        lock_log(head_fd, hpath)
        segments = list_segments(path)
        last = segments[-1] if segments else None
        rfd = os.open(path, os.O_RDONLY | flags)
        try:
            size = os.fstat(rfd).st_size
            chain_end, lines = _find_chain_end(rfd, size, head, last[1] if last else None)
        except TailError as exc:
            raise AuditOpenError(
                f"audit log {path} cannot be continued: {exc}. Run 'gatewayd audit verify "
                f"{path}'; to start a new log, move {path.name} and {hpath.name} aside together"
            ) from None
        finally:
            os.close(rfd)
        terminated = False
        if chain_end.torn and not chain_end.torn.endswith(b"\n"):
            os.write(fd, b"\n")  # end the torn line, so the next entry starts clean
            terminated = True
        if fsync:
            if terminated:
                os.fdatasync(fd)
            if created:
                fsync_dir(path.parent)
        continues = chain_end.end == 0 and chain_end.position.seq > 0
        return OpenedLog(
            fd,
            head_fd,
            chain_end,
            lines,
            head,
            terminated,
            last_segment=last[0] if last else 0,
            continues_segment=last[1].name if continues and last else None,
            continues=continues,
        )
    except BaseException:
        for each in fds:
            os.close(each)
        raise


def lock_log(fd: int, path: Path) -> None:
    """Take the log (or its head file) for this process alone: two writers would fork
    the chain."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise AuditOpenError(f"audit log {path} is not a regular file")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise AuditOpenError(
            f"audit log {path} is locked by another process (another gatewayd?); "
            "one daemon writes one log"
        ) from None


def torn_detail(opened: OpenedLog) -> dict[str, object]:
    """The ``torn_tail_recovered`` event's detail: where the torn bytes start, how many
    lines and bytes they are, and their sha256."""
    torn = opened.chain_end.torn
    if torn.endswith(b"\n"):
        torn = torn[:-1]  # the bytes as found, without the newline that ends the region
    detail: dict[str, object] = {
        "line": opened.lines + 1,
        "lines": torn.count(b"\n") + 1,
        "bytes": len(torn),
        "sha256": hashlib.sha256(torn).hexdigest(),
    }
    if opened.head is not None:
        detail["headSeq"] = opened.head.seq
    return detail
