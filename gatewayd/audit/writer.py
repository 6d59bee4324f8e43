"""The audit log writer: append-only, hash-chained, durable before the call's effect.

``record()`` seals the next entry synchronously (trio is single-threaded, so entries
recorded from many tasks still form one ordered chain) and queues its line.
``durable(seq)`` returns once that line is written and fdatasync'd. Group commit: the
first waiter that finds no flush in progress becomes the leader, writes and syncs
every queued line in one worker-thread call, and wakes the others; waiters for later
entries loop and one of them leads the next flush. No background task is needed.

Resource handling: ``open_audit_log`` owns two file descriptors (the log, opened
O_APPEND, and its head file) and an exclusive flock on the log, so a second gatewayd
cannot interleave its own chain. They are released when the context exits, after an
``audit_close`` entry is durable.

Error handling: a failed write or sync is never swallowed. The log becomes *failed*:
every ``durable()``/``append()`` from then on raises :class:`AuditWriteError`, so no
call runs without its audit entry (fail closed). A flush runs in a shielded cancel
scope: cancelling the leader cannot leave an entry half-accounted (written twice, or
lost while reported queued).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import stat
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Unpack

import trio

from gatewayd.audit.chain import GENESIS, Chain
from gatewayd.audit.entry import MAX_LINE_BYTES, AuditEvent, EntryFields, EntryKind
from gatewayd.audit.head import (
    HeadFormatError,
    HeadRecord,
    encode_head,
    head_path,
    read_head,
)
from gatewayd.audit.tail import ChainEnd, TailError, TailWindow, anchor_at_head, last_valid, walk
from gatewayd.errors import GatewayError
from gatewayd.protocol import ErrorCode

# One flush writes at most this much, so a crash mid-write tears at most one batch;
# that bounds how far back ``open_audit_log`` must look for the end of the chain.
MAX_BATCH_BYTES: Final = 4 * 1024 * 1024
# How much of the tail open will read: a torn batch plus the line before it. Beyond
# this the file was not left by a crash of this writer, and open refuses.
MAX_TAIL_SCAN_BYTES: Final = 2 * MAX_BATCH_BYTES + 2 * MAX_LINE_BYTES
# Counting lines without a head file reads the whole log once, in chunks of this.
_COUNT_CHUNK_BYTES: Final = 1024 * 1024
# A file that holds no entry at all is only resumed if it starts like our first line.
_FIRST_LINE_PREFIX: Final = b'{"seq":1,"time":"'
_DIR_MODE: Final = 0o700
_FILE_MODE: Final = 0o600

_SAFE_WRITE_MESSAGE: Final = (
    "the audit log cannot be written, so no call can run; the operator must fix the "
    "audit log and restart gatewayd"
)


class AuditWriteError(GatewayError):
    """The audit log cannot be written: refuse the call (fail closed).

    ``str(exc)`` is safe to show to the sandbox; ``detail`` names the file and the
    OS error for the daemon log and the operator.
    """

    code = ErrorCode.INTERNAL

    def __init__(self, detail: str) -> None:
        super().__init__(_SAFE_WRITE_MESSAGE)
        self.detail = detail


class AuditOpenError(Exception):
    """The log cannot be continued safely (locked, truncated, rewritten, not a log).

    The message names the file, what is wrong and what the operator can do.
    """


@dataclass(frozen=True, slots=True)
class _Opened:
    fd: int
    head_fd: int
    chain_end: ChainEnd
    lines: int  # lines up to chain_end.end
    head: HeadRecord | None
    torn_terminated: bool  # a newline was written to end a torn region


class AuditLog:
    """An open audit log. Made by :func:`open_audit_log`; see the module docstring."""

    def __init__(
        self,
        path: Path,
        opened: _Opened,
        *,
        fsync: bool,
        clock: Callable[[], int],
    ) -> None:
        self.path = path
        self.fsync_count = 0  # fdatasync calls made, for tests and benchmarks
        self._fd = opened.fd
        self._head_fd = opened.head_fd
        self._fsync = fsync
        self._chain = Chain(opened.chain_end.position, clock)
        self._durable_seq = opened.chain_end.position.seq
        self._taken_seq = self._durable_seq  # last seq handed to a flush
        # The file's size: we are its only writer (the flock), so we can count it.
        torn = opened.chain_end.torn + (b"\n" if opened.torn_terminated else b"")
        self._end = opened.chain_end.end + len(torn)
        self._lines = opened.lines + torn.count(b"\n")
        self._pending: list[tuple[bytes, str]] = []
        self._flushing = False
        self._flush_done = trio.Event()
        self._failure: str | None = None
        self._closing = False
        self._closed = False

    # -- state ---------------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        """The seq of the last recorded entry (durable or not)."""
        return self._chain.position.seq

    @property
    def durable_seq(self) -> int:
        """The seq up to which every entry is written (and synced, with fsync=True)."""
        return self._durable_seq

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def fileno(self) -> int:
        """The log's file descriptor (O_APPEND, write-only)."""
        return self._fd

    # -- the hot path --------------------------------------------------------------

    def record(self, kind: str, **fields: Unpack[EntryFields]) -> int:
        """Seal the next entry and queue it; returns its seq. Never awaits.

        The entry is written by the next ``durable()``/``append()`` from any task (or
        at close). On a failed or closed log the entry is not queued and
        ``durable(seq)`` raises AuditWriteError.

        Error handling: ValueError for a bad field, naming it and what it may hold;
        nothing is recorded then.
        """
        seq, digest, line = self._chain.append(kind, fields)
        if self._failure is None and not self._closing:
            self._pending.append((line, digest))
        return seq

    async def durable(self, seq: int) -> None:
        """Return once every entry up to ``seq`` is written and synced.

        Error handling: AuditWriteError if the log has failed (now or before) or is
        closed; ValueError for a seq that was never recorded.
        """
        if not 0 <= seq <= self._chain.position.seq:
            raise ValueError(f"seq {seq} was never recorded (last is {self.last_seq})")
        while True:
            # Cancellation is honoured between flushes, never inside one (shielded).
            await trio.lowlevel.checkpoint_if_cancelled()
            if self._failure is not None:
                raise AuditWriteError(self._failure)
            if self._durable_seq >= seq:
                return
            if self._flushing:
                await self._flush_done.wait()
            elif self._closed or not self._pending:
                # Recorded after close started (or after a failure): never written.
                raise AuditWriteError(f"{self.path}: entry {seq} was recorded after close")
            else:
                await self._lead_flush()

    async def append(self, kind: str, **fields: Unpack[EntryFields]) -> int:
        """``record`` then ``durable``: returns the seq once the entry is durable."""
        seq = self.record(kind, **fields)
        await self.durable(seq)
        return seq

    # -- group commit --------------------------------------------------------------

    def _take_batch(self) -> tuple[bytes, int, str]:
        size, count = 0, 0
        for line, _ in self._pending:
            if count and size + len(line) > MAX_BATCH_BYTES:
                break
            size += len(line)
            count += 1
        taken = self._pending[:count]
        del self._pending[:count]
        return b"".join(line for line, _ in taken), count, taken[-1][1]

    async def _lead_flush(self) -> None:
        self._flushing = True
        done = self._flush_done = trio.Event()
        try:
            batch, count, last_hash = self._take_batch()
            last_seq = self._taken_seq + count
            self._taken_seq = last_seq
            head = HeadRecord(
                seq=last_seq, hash=last_hash, end=self._end + len(batch), lines=self._lines + count
            )
            # Shielded: once the batch is taken it must end up written or the log
            # failed; a cancelled leader must not leave that undecided.
            with trio.CancelScope(shield=True):
                synced = await trio.to_thread.run_sync(
                    self._write_batch, batch, head, abandon_on_cancel=False
                )
            self._end, self._lines = head.end, head.lines
            self._durable_seq = last_seq
            self.fsync_count += synced
        except OSError as exc:
            self._fail(f"writing the audit log {self.path} failed: {exc}")
            raise AuditWriteError(self._failure or "") from exc
        except BaseException as exc:
            self._fail(f"writing the audit log {self.path} was interrupted: {exc!r}")
            raise
        finally:
            self._flushing = False
            done.set()

    def _write_batch(self, batch: bytes, head: HeadRecord) -> bool:
        """Worker thread: append, sync, then move the head. Returns whether it synced."""
        view = memoryview(batch)
        while view:
            written = os.write(self._fd, view)
            if written <= 0:
                raise OSError(errno.EIO, "write made no progress")
            view = view[written:]
        if self._fsync:
            os.fdatasync(self._fd)
        # Written after the sync, so the head never claims more than is durable. It
        # is not synced itself: after a power cut it may lag, which is safe.
        os.pwrite(self._head_fd, encode_head(head), 0)
        return self._fsync

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
        self._pending.clear()  # never to be written; the log is failed

    # -- close ---------------------------------------------------------------------

    async def aclose(self) -> None:
        """Record ``audit_close``, make everything durable, close the files.

        Runs shielded (it is called while cancelling). Error handling: raises
        AuditWriteError if the final write fails; a log that had already failed is
        closed without raising again.
        """
        if self._closed:
            return
        with trio.CancelScope(shield=True):
            try:
                if self._failure is None and not self._closing:
                    seq = self.record(
                        EntryKind.EVENT,
                        event=AuditEvent.AUDIT_CLOSE,
                        detail={"pid": os.getpid()},
                    )
                    self._closing = True
                    await self.durable(seq)
                    if self._fsync:
                        await trio.to_thread.run_sync(os.fsync, self._head_fd)
            finally:
                self._closed = True
                self._closing = True
                self._pending.clear()
                os.close(self._fd)
                os.close(self._head_fd)


# --- open ---------------------------------------------------------------------------


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


def _find_chain_end(rfd: int, size: int, head: HeadRecord | None) -> tuple[ChainEnd, int]:
    """Where the chain in the file ends, and how many lines come before that point."""
    if head is not None:
        if size - head.end > MAX_TAIL_SCAN_BYTES:
            raise TailError(
                f"{size - head.end} bytes follow the last durable entry (seq {head.seq}); "
                f"a crash leaves at most {MAX_TAIL_SCAN_BYTES}: something else wrote the log"
            )
        start = max(0, head.end - MAX_LINE_BYTES - 1)
        window = TailWindow(_pread_all(rfd, start, size), start)
        chain_end = walk(window, head.end, anchor_at_head(window, head))
        return chain_end, head.lines + chain_end.walked
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


def _open_files(path: Path, fsync: bool) -> _Opened:
    """Worker thread: create/open the files, lock, find the chain end, end a torn tail."""
    created: list[Path] = []
    if not path.parent.exists():
        path.parent.mkdir(mode=_DIR_MODE, parents=True)
        created.append(path.parent)
    hpath = head_path(path)
    if not os.path.lexists(path):
        created.append(path)
    flags = os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | flags, _FILE_MODE)
    fds = [fd]
    try:
        _lock(fd, path)
        try:
            head = read_head(path)
        except HeadFormatError as exc:
            raise AuditOpenError(
                f"the head file {hpath} is damaged ({exc}); check the log with "
                f"'gatewayd audit verify {path}', then move the head file aside to continue"
            ) from None
        if not os.path.lexists(hpath):
            created.append(hpath)
        head_fd = os.open(hpath, os.O_RDWR | os.O_CREAT | flags, _FILE_MODE)
        fds.append(head_fd)
        rfd = os.open(path, os.O_RDONLY | flags)
        try:
            size = os.fstat(rfd).st_size
            chain_end, lines = _find_chain_end(rfd, size, head)
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
                _sync_dir(path.parent)
        return _Opened(fd, head_fd, chain_end, lines, head, terminated)
    except BaseException:
        for each in fds:
            os.close(each)
        raise


def _lock(fd: int, path: Path) -> None:
    """Take the log for this process alone: two writers would fork the chain."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise AuditOpenError(f"audit log {path} is not a regular file")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise AuditOpenError(
            f"audit log {path} is locked by another process (another gatewayd?); "
            "one daemon writes one log"
        ) from None


def _sync_dir(directory: Path) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _torn_detail(opened: _Opened) -> dict[str, object]:
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


@asynccontextmanager
async def open_audit_log(
    path: Path, *, fsync: bool = True, clock: Callable[[], int] = time.time_ns
) -> AsyncIterator[AuditLog]:
    """Open (or create) the audit log at ``path`` and continue its chain.

    Creates the parent directory (0700) and the file (0600) if missing. Reads only the
    tail to find the last entry (the head file says where it is), so the chain
    continues across restarts. A torn tail left by a crash is terminated and recorded
    as a ``torn_tail_recovered`` event (line, size and sha256 of the torn bytes), never
    dropped. Then an ``audit_open`` entry is made durable. On exit ``audit_close`` is
    made durable and the files are closed. ``fsync=False`` writes without syncing
    (tests and benchmarks only). ``clock`` returns ns since the epoch.

    Error handling: AuditOpenError when the log is locked by another process, shorter
    than its head file says, rewritten, or not an audit log (the message says what to
    do); AuditWriteError when the first entries cannot be written; OSError from
    creating the files passes through.
    """
    opened = await trio.to_thread.run_sync(_open_files, path, fsync)
    log = AuditLog(path, opened, fsync=fsync, clock=clock)
    try:
        if opened.chain_end.torn:
            log.record(
                EntryKind.EVENT,
                event=AuditEvent.TORN_TAIL_RECOVERED,
                detail=_torn_detail(opened),
            )
        seq = log.record(
            EntryKind.EVENT,
            event=AuditEvent.AUDIT_OPEN,
            detail={
                "pid": os.getpid(),
                "continuesSeq": opened.chain_end.position.seq,
                "headFile": "found" if opened.head is not None else "missing",
                "fsync": fsync,
            },
        )
        await log.durable(seq)
        yield log
    finally:
        await log.aclose()
