"""The audit log writer: append-only, hash-chained, durable before the call's effect.

``record()`` seals the next entry synchronously on the trio thread (trio runs one task
at a time, so entries recorded from many tasks still form one ordered chain) and
queues its line. ``durable(seq)`` returns once that line is written and fdatasync'd.

Group commit, pipelined: one dedicated OS thread per open log (the *flusher*) owns
every write. It sleeps until there is work, then takes *all* queued lines (up to
``MAX_BATCH_BYTES``), writes them, fdatasyncs, moves the head file, and publishes the
new durable seq to trio (``TrioToken.run_sync_soon``), which wakes the waiters. If
more lines are wanted by then it flushes again at once, without a round trip through
trio: while calls keep arriving, the disk stays busy.

The flusher flushes when a ``durable()`` waiter wants an entry it has not taken yet,
or when the oldest queued entry has waited ``RESULT_SYNC_DELAY_S``: an entry nobody
waits for (an event; a call's ``result`` when the dispatcher does not wait for it,
``audit_reply_after_result: false``) is durable within that delay anyway, usually
riding along with the next flush someone waits for.

Thread boundary: the chain (sealing, hashing) lives on the trio thread; only the
sealed ``(line, digest)`` pairs and the wanted seq cross to the flusher, under one
``threading.Lock``. The trio side wakes the flusher with a *doorbell* (a second lock,
released to ring), not a ``threading.Condition``: ringing is one futex wake, half
the cost of a notify measured here, and it is paid on the trio thread, the daemon's
bottleneck. The doorbell is rung by the *ringer*, a task of the log's that trio runs
after every task runnable when a waiter asked (see ``_run_ringer``): the calls of one
pass of trio's scheduler share one flush, one ring and one hand-off back to trio,
instead of the first call's entries leaving alone at the trio thread's next system
call. The file offsets and line count (for the head record) are the flusher's alone.
The durable seq, the failure and the waiters' events are trio's, changed only by
callbacks the flusher schedules; a flush wakes only the waiters whose entries it
made durable (one event per seq waited for), not those the next flush will release.

Rotation (``max_bytes``): when an entry would take the active file past the limit,
``record()`` seals a ``segment_open`` event first and queues a *rotate* marker before
it. The flusher writes and syncs everything before the marker and the head file,
renames the active file to the next closed segment (``audit.jsonl.000001``...),
creates a new active file, syncs the directory, points the head file at the new file
(``end=0``, the last entry's seq and hash) and goes on with ``segment_open``: seq and
hash continue, so
the chain runs across segments. The crash states this can leave, and why each one
is recovered at the next open without losing or repeating an entry, are in
docs/audit.md ("Rotation").

Opening (creating or finding the files, locking them, finding where the chain ends,
ending a torn tail) is :mod:`gatewayd.audit.opening`'s; the writer goes on from there.

The Merkle tree (:mod:`gatewayd.audit.treestore`): once a batch is written and synced,
the flusher appends its lines (without their newlines) to the tree as leaves, off the
trio thread; under load, when the next flush is already wanted, the leaves of several
batches go in one append (``TREE_BATCH_LEAVES``); rotation changes nothing for the tree
(leaf index = seq - 1). The tree is
derived from the log, so a tree that cannot be opened or written is switched off
(``tree_failure`` says why) and the log goes on: no call is refused for it, and the
next open rebuilds the tree from the log.

Resource handling: ``open_audit_log`` owns two file descriptors (the log, opened
O_APPEND, and its head file), an exclusive flock on both (the log's inode changes at
each rotation; the head file's does not), so a second gatewayd cannot interleave its
own chain, the flusher thread and the ringer (a trio system task, cancelled at close,
which rings at once for whoever asked before). They are released when the
context exits, after an ``audit_close`` entry is durable: the flusher is stopped and
joined before the descriptors are closed.

Error handling: a failed write or sync is never swallowed. The flusher marks the log
*failed*, wakes every waiter and stops: nothing is written after that, and every
``durable()``/``append()`` raises :class:`AuditWriteError`, so no call runs without
its audit entry (fail closed). Cancelling a waiter only stops the wait: the flusher
owns the batch, so an entry is never half-accounted (written twice, or lost while
reported queued).
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import functools
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Unpack

import trio

from gatewayd.audit.chain import NO_SECRETS, Chain, ChainPosition
from gatewayd.audit.entry import EntryFields, EntryKind
from gatewayd.audit.events import REGISTERED_EVENTS, AuditEvent
from gatewayd.audit.head import HeadRecord, encode_head
from gatewayd.audit.merkle import leaf_hash
from gatewayd.audit.opening import (
    FILE_MODE,
    MAX_BATCH_BYTES,
    OpenedLog,
    lock_log,
    open_files,
    torn_detail,
)
from gatewayd.audit.segments import segment_path
from gatewayd.audit.treestore import TreeError, TreeStore, open_tree
from gatewayd.errors import GatewayError
from gatewayd.files import fsync_dir, write_all
from gatewayd.metrics import METRICS
from gatewayd.protocol import ErrorCode
from gatewayd.secrets import Scrubber

# An entry nobody waits for (an event; a result when the dispatcher's opt-out does not
# wait for it) is flushed at most this long after it was queued. Short enough that a
# crash loses at most ~2 ms of such entries; long enough that under load it rides
# along with the next flush someone waits for instead of costing an fdatasync of its
# own.
RESULT_SYNC_DELAY_S: Final = 0.002

# Under load (the next flush already wanted), the flusher appends the leaves of several
# flushes to the Merkle tree at once, up to this many: each append is a write per tree
# level (five or so per flush at 8 connections), and the tree may lag the log (it is
# derived; a checkpoint waits for it, bounded). 256 leaves is about 128 calls, 8 KiB of
# hashes held.
TREE_BATCH_LEAVES: Final = 256
# ...and holds no leaf longer than this: with few callers each flush carries one or two
# entries, and on a slow disk 256 of them would keep the tree seconds behind the log,
# past a run-end checkpoint's wait for it (checkpointer.py).
TREE_HOLD_S: Final = 0.02

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


def _wait_seq(wait: tuple[int, trio.Event]) -> int:
    return wait[0]


@dataclass(frozen=True, slots=True)
class _Rotate:
    """Queued before a ``segment_open`` line: close the active file as segment
    ``number``, whose last entry is ``after``, and start a new one."""

    number: int
    after: ChainPosition


_Pending = tuple[bytes, str] | _Rotate


class AuditLog:
    """An open audit log. Made by :func:`open_audit_log`; see the module docstring."""

    def __init__(
        self,
        path: Path,
        opened: OpenedLog,
        *,
        fsync: bool,
        clock: Callable[[], int],
        sync_delay_s: float = RESULT_SYNC_DELAY_S,
        scrubber: Scrubber = NO_SECRETS,
        tree: TreeStore | None = None,
    ) -> None:
        self.path = path
        # The Merkle tree over the entries (None: off, and tree_failure says why when
        # it failed). Appended to by the flusher only; its reads are thread-safe.
        self.tree = tree
        self.tree_failure: str | None = None
        # Told the seq of every run_ended entry as it is recorded (the checkpointer:
        # a checkpoint at every run's end). Called on the trio thread; must not block.
        self.on_run_ended: Callable[[int], None] | None = None
        # Called (in a worker thread) once the flusher has written audit_close and
        # stopped, before the tree is closed: the final checkpoint at stop.
        self.after_close: list[Callable[[], None]] = []
        self.fsync_count = 0  # fdatasync calls made, for tests and benchmarks
        self._fd = opened.fd
        self._head_fd = opened.head_fd
        self._fsync = fsync
        self._sync_delay_s = sync_delay_s
        self._chain = Chain(opened.chain_end.position, clock, scrubber)
        # Rotation (trio's): the limit is set by open_audit_log once its own entries
        # are queued; the bytes the active file will hold once everything queued is
        # written; the number the active file gets when it is closed.
        self._max_bytes = 0
        self._next_segment = opened.last_segment + 1
        # -- trio's: changed on the trio thread only --
        self._durable_seq = opened.chain_end.position.seq
        self._queued_seq = self._durable_seq  # last seq handed to the flusher
        # The waiters, by the seq each waits for, in ascending order: one event per seq
        # waited for, set by the first flush that makes it durable (or a failure), so
        # a flush wakes only the tasks it released, not those whose entries the next
        # flush takes (under load, about half of them).
        self._waits: list[tuple[int, trio.Event]] = []
        self._failure: str | None = None
        self._closing = False
        self._closed = False
        self._thread: threading.Thread | None = None
        # -- shared: only under self._lock --
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._pending_since = 0.0  # monotonic time the oldest pending line was queued
        self._wanted_seq = self._durable_seq  # the highest seq a waiter waits for
        self._taken_seq = self._durable_seq  # the last seq the flusher took
        self._idle = False  # the flusher sleeps with nothing pending (needs a ring)
        self._stopping = False
        # Wakes the flusher: released = rung. One futex wake, and no lock hand-over as
        # with a Condition (notify under the lock, then the woken thread waits for it).
        self._doorbell = threading.Lock()
        self._doorbell.acquire()
        # The ringer task, parked until a ring is due (None: not running, ring at once),
        # and whether it has been woken to ring (trio's; see _run_ringer).
        self._ringer: trio.lowlevel.Task | None = None
        self._ring_scheduled = False
        self._ringer_scope: trio.CancelScope | None = None
        # -- the flusher's alone once it runs (aclose reads them after joining it): the
        # file's size and line count (we are its only writer, the flock, so we can
        # count them), the last seq written, and why writing stopped --
        self._written_seq = self._durable_seq
        self._write_failure: str | None = None
        self._leaves: list[bytes] = []  # leaf hashes of written lines not in the tree yet
        self._held_since = 0.0  # monotonic time the oldest held leaf was written
        torn = opened.chain_end.torn + (b"\n" if opened.torn_terminated else b"")
        self._end = opened.chain_end.end + len(torn)
        self._lines = opened.lines + torn.count(b"\n")
        self._queued_end = self._end  # trio's

    # -- state ---------------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        """The seq of the last recorded entry (durable or not)."""
        return self._chain.seq

    @property
    def durable_seq(self) -> int:
        """The seq up to which every entry is written (and synced, with fsync=True)."""
        return self._durable_seq

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def fileno(self) -> int:
        """The active file's descriptor (O_APPEND, write-only); a rotation replaces it."""
        return self._fd

    # -- the hot path (trio thread) ------------------------------------------------

    def record(self, kind: str, *, checked: bool = True, **fields: Unpack[EntryFields]) -> int:
        """Seal the next entry and queue it; returns its seq. Never awaits.

        The entry is written when a ``durable()``/``append()`` from any task wants it
        or a later entry, or at most ``RESULT_SYNC_DELAY_S`` after it was queued (or
        at close). On a failed or closed log the entry is not queued and
        ``durable(seq)`` raises AuditWriteError.

        ``checked=False``: every field was built by gatewayd itself from typed values
        (the dispatcher's call and result entries), so their types and bounds are not
        checked again (``build_body``); the message's length and the caps still are.

        Error handling: ValueError for a bad field, naming it and what it may hold,
        or for an event name that is not an ``AuditEvent``; nothing is recorded then.
        """
        event = fields.get("event")
        if event is not None and (not isinstance(event, str) or event not in REGISTERED_EVENTS):
            raise ValueError(f"invalid audit entry: event {event!r} is not an AuditEvent")
        seq, digest, line = self._chain.append(kind, fields, checked=checked)
        if self._failure is not None or self._closing:
            return seq
        if event == AuditEvent.RUN_ENDED and self.on_run_ended is not None:
            self.on_run_ended(seq)
        if self._max_bytes and self._queued_end and self._queued_end + len(line) > self._max_bytes:
            # It would overflow the active segment: seal segment_open in its place,
            # queue the rotation before it, then seal the entry again after it. The
            # first sealing was never queued, so nothing outside saw it.
            before = self._chain.position_before_last
            self._chain.rewind(before)
            number = self._next_segment
            self._next_segment += 1
            opener_seq, opener_digest, opener = self._chain.append(
                EntryKind.EVENT,
                {
                    "event": AuditEvent.SEGMENT_OPEN,
                    "detail": {
                        "previousSegment": segment_path(self.path, number).name,
                        "previousSeq": before.seq,
                        "previousHash": before.hash,
                        "maxBytes": self._max_bytes,
                    },
                },
            )
            self._queue(_Rotate(number, before), None)
            self._queued_end = 0
            self._queue((opener, opener_digest), opener_seq)
            seq, digest, line = self._chain.append(kind, fields, checked=checked)
        self._queue((line, digest), seq)
        return seq

    def _queue(self, item: _Pending, seq: int | None) -> None:
        with self._lock:
            ring = not self._pending and self._idle  # to start the flusher's timer
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.append(item)
        if seq is not None:
            self._queued_seq = seq
            self._queued_end += len(item[0]) if isinstance(item, tuple) else 0
        if ring:
            self._ring_soon()

    async def durable(self, seq: int) -> None:
        """Return once every entry up to ``seq`` is written and synced.

        Cancellable at any point: the flusher owns the write, so a cancelled waiter
        loses nothing and the entry is still written.

        Error handling: AuditWriteError if the log has failed (now or before) or is
        closed; ValueError for a seq that was never recorded.
        """
        if not 0 <= seq <= self._chain.seq:
            raise ValueError(f"seq {seq} was never recorded (last is {self.last_seq})")
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._failure is not None:
                raise AuditWriteError(self._failure)
            if self._durable_seq >= seq:
                return
            if seq > self._queued_seq:
                # Recorded after close started (or after a failure): never written.
                raise AuditWriteError(f"{self.path}: entry {seq} was recorded after close")
            with self._lock:
                ring = seq > self._wanted_seq
                if ring:
                    self._wanted_seq = seq
            if ring:
                self._ring_soon()
            await self._wait_for(seq).wait()

    def flush_soon(self, seq: int) -> None:
        """Have every entry up to ``seq`` written and synced now, without waiting: for
        entries the caller waits for (``durable``) only after other work, so their
        flush runs meanwhile in the flusher thread. Recorded alone, an entry waits for
        a waiter or for ``RESULT_SYNC_DELAY_S`` before its flush even starts. Never
        awaits. Error handling: ValueError for a seq that was never recorded; a failed
        or closed log is left for the later ``durable()`` to report."""
        if not 0 <= seq <= self._chain.seq:
            raise ValueError(f"seq {seq} was never recorded (last is {self.last_seq})")
        if self._failure is not None or not self._durable_seq < seq <= self._queued_seq:
            return
        # As durable() asks (kept inline there: it is on every call's path).
        with self._lock:
            ring = seq > self._wanted_seq
            if ring:
                self._wanted_seq = seq
        if ring:
            self._ring_soon()

    async def append(self, kind: str, **fields: Unpack[EntryFields]) -> int:
        """``record`` then ``durable``: returns the seq once the entry is durable."""
        seq = self.record(kind, **fields)
        await self.durable(seq)
        return seq

    # -- the doorbell ------------------------------------------------------------------

    @trio.lowlevel.enable_ki_protection
    def _ring_soon(self) -> None:
        """Trio thread: ring the doorbell once every task runnable now has run (the
        ringer's turn comes after them), or at once when there is no ringer."""
        if self._ring_scheduled:
            return
        ringer = self._ringer
        if ringer is None:
            self._ring()
            return
        self._ringer = None
        self._ring_scheduled = True
        trio.lowlevel.reschedule(ringer)

    async def _run_ringer(self) -> None:
        """The ringer (a system task, from open until close): rings the doorbell for
        the waiters and queued entries of one pass of trio's scheduler together.

        Why: a woken flusher takes its batch as soon as the trio thread lets go of the
        interpreter, at its next system call, which is often the next call's read or
        reply; rung at once by the first waiter, it would flush that call's entries
        alone and the next calls' at the next fdatasync. Rung after every task runnable
        now has run, it takes all their entries in one batch (group commit as wide as
        the load): one flush, one hand-off to trio, fewer wakes per call.
        """

        def abort(_: object) -> trio.lowlevel.Abort:
            self._ringer = None
            return trio.lowlevel.Abort.SUCCEEDED

        if self._closing:  # closed before this task's first turn
            return
        with trio.CancelScope() as self._ringer_scope:
            try:
                while True:
                    self._ringer = trio.lowlevel.current_task()
                    await trio.lowlevel.wait_task_rescheduled(abort)
                    self._ring_scheduled = False
                    self._ring()
            finally:
                self._ringer = None
                if self._ring_scheduled:  # cancelled after a waiter asked: ring now
                    self._ring_scheduled = False
                    self._ring()

    # -- the flusher thread ----------------------------------------------------------

    def _ring(self) -> None:
        # try/except, not contextlib.suppress: this is on every call's path, and a try
        # costs nothing when nothing is raised.
        try:  # noqa: SIM105 (see above)
            self._doorbell.release()
        except RuntimeError:  # already rung, not yet answered
            pass

    def _start_flusher(self) -> None:
        # A system task: it outlives no log (aclose cancels it) and a nursery here
        # would wrap the errors of every `async with open_audit_log()` body in a group.
        trio.lowlevel.spawn_system_task(self._run_ringer, name=f"audit-ringer {self.path}")
        token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(
            target=self._flush_loop, args=(token,), name=f"audit-flusher {self.path}", daemon=True
        )
        self._thread.start()

    def _flush_loop(self, token: trio.lowlevel.TrioToken) -> None:
        """Flusher thread: flush whatever is wanted or due until stopped or failed."""
        try:
            while (work := self._next_batch()) is not None:
                if isinstance(work, _Rotate):
                    self._rotate(work)
                    continue
                batch, head, taken = work
                self._write_batch(batch, head)
                self._end, self._lines, self._written_seq = head.end, head.lines, head.seq
                # Asked before trio hears of this flush: so not by a waiter this flush
                # releases, nor by anything that waiter does next.
                with self._lock:
                    busy = self._wanted_seq > self._taken_seq
                token.run_sync_soon(self._on_flushed, head.seq, self._fsync)
                if not self._leaves:
                    self._held_since = time.monotonic()
                self._leaves.extend(leaf_hash(line[:-1]) for line, _ in taken)
                if (
                    not busy
                    or len(self._leaves) >= TREE_BATCH_LEAVES
                    or time.monotonic() - self._held_since >= TREE_HOLD_S
                ):
                    self._grow_tree()
        except OSError as exc:
            self._write_failure = f"writing the audit log {self.path} failed: {exc}"
        except BaseException as exc:  # a bug must fail the log, not hang its waiters
            self._write_failure = f"writing the audit log {self.path} was interrupted: {exc!r}"
        # Stopped or failed: the held leaves are of durable lines, so they join the tree
        # either way, before close's hooks (the last checkpoint) read it.
        try:
            self._grow_tree()
        except BaseException as exc:  # a bug must fail the log, not hang its waiters
            self._write_failure = self._write_failure or f"growing the tree failed: {exc!r}"
        if self._write_failure is not None:
            with contextlib.suppress(trio.RunFinishedError):  # nobody is left to tell
                token.run_sync_soon(self._on_failed, self._write_failure)

    def _next_batch(
        self,
    ) -> tuple[bytes, HeadRecord, list[tuple[bytes, str]]] | _Rotate | None:
        """Flusher thread: sleep until a batch is wanted or due, then take it.

        A rotation marker at the front of the queue is returned alone (the lines
        before it were written by the previous batch). Returns None once stopped with
        nothing left to write.
        """
        while True:
            with self._lock:
                self._idle = False
                if self._pending:
                    due_in = self._pending_since + self._sync_delay_s - time.monotonic()
                    if self._stopping or self._wanted_seq > self._taken_seq or due_in <= 0:
                        first = self._pending[0]
                        if isinstance(first, _Rotate):
                            # The rest keeps the old _pending_since: it is due at once.
                            del self._pending[0]
                            return first
                        taken = self._take_lines()
                        break
                elif self._stopping:
                    return None
                else:
                    self._idle = True
                    due_in = -1  # no timeout: record() rings
            # A ring between the unlock and here is not lost: the doorbell stays open.
            self._doorbell.acquire(timeout=due_in)
        # Joined outside the lock: record() on the trio thread never waits for this.
        batch = b"".join(line for line, _ in taken)
        head = HeadRecord(
            seq=self._taken_seq,
            hash=taken[-1][1],
            end=self._end + len(batch),
            lines=self._lines + len(taken),
        )
        return batch, head, taken

    def _take_lines(self) -> list[tuple[bytes, str]]:
        """Flusher thread, under the lock: take the queued lines, at most a batch,
        and never past a rotation marker."""
        size = 0
        taken: list[tuple[bytes, str]] = []
        for item in self._pending:
            if isinstance(item, _Rotate) or (taken and size + len(item[0]) > MAX_BATCH_BYTES):
                break
            size += len(item[0])
            taken.append(item)
        # The rest keeps the old _pending_since: it is due at once.
        del self._pending[: len(taken)]
        self._taken_seq += len(taken)
        return taken

    def _write_batch(self, batch: bytes, head: HeadRecord) -> None:
        """Flusher thread: append, sync, then move the head."""
        write_all(self._fd, batch)
        if self._fsync:
            synced = time.perf_counter()
            os.fdatasync(self._fd)
            METRICS.audit_fsync.observe(time.perf_counter() - synced)
        # Written after the sync, so the head never claims more than is durable. It
        # is not synced itself: after a power cut it may lag, which is safe.
        os.pwrite(self._head_fd, encode_head(head), 0)

    def _grow_tree(self) -> None:
        """Flusher thread: the leaves of the lines written so far join the tree.

        After their batches are durable (the tree never holds an entry the log may
        lose), and after trio was told (the waiters do not wait for the tree). Called
        after each flush, except while the next flush is already wanted then: under
        load the leaves of several flushes are appended together, up to
        TREE_BATCH_LEAVES (a write per tree level each time). A flush nobody was
        waiting behind appends at once, so a tree write's failure is seen before the
        next flush's waiters are released. A failure switches the tree off; the log
        goes on.
        """
        leaves, self._leaves = self._leaves, []
        tree = self.tree
        if tree is None or not leaves:
            return
        try:
            tree.append(leaves)
        except (OSError, TreeError) as exc:
            self.tree = None
            self.tree_failure = f"writing the Merkle tree {tree.directory} failed: {exc}"
            with contextlib.suppress(OSError):
                tree.close()

    def _rotate(self, rotate: _Rotate) -> None:
        """Flusher thread: close the active file as a segment and start a new one.

        Every line before the marker is written and synced (the batch before it). The
        order makes each crash state recoverable (docs/audit.md, "Rotation"): sync the
        head, rename, create, sync the directory, and only then point the head at the
        new file.
        """
        if rotate.after.seq != self._written_seq:
            raise RuntimeError(
                f"rotation after seq {rotate.after.seq}, but seq {self._written_seq} was "
                "the last written"
            )
        segment = segment_path(self.path, rotate.number)
        if os.path.lexists(segment):
            raise OSError(errno.EEXIST, f"cannot rotate: segment {segment} already exists")
        if self._fsync:
            # The head is not synced per batch (it may lag); here it must not: after a
            # power cut it has to name the segment's last entry at its very end.
            os.fsync(self._head_fd)
        os.rename(self.path, segment)
        fd = os.open(
            self.path,
            os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
            FILE_MODE,
        )
        try:
            lock_log(fd, self.path)
            if os.fstat(fd).st_size:
                raise OSError(errno.EEXIST, f"{self.path} was created by someone else")
            if self._fsync:
                fsync_dir(self.path.parent)
            head = HeadRecord(seq=rotate.after.seq, hash=rotate.after.hash, end=0, lines=0)
            os.pwrite(self._head_fd, encode_head(head), 0)
        except BaseException:
            os.close(fd)
            raise
        old, self._fd = self._fd, fd
        os.close(old)
        self._end = self._lines = 0

    # -- what the flusher tells trio (run on the trio thread) -------------------------

    def _wait_for(self, seq: int) -> trio.Event:
        """Trio thread: the event set once ``seq`` is durable (or the log failed)."""
        waits = self._waits
        if not waits or waits[-1][0] < seq:  # the usual case: the latest entry
            event = trio.Event()
            waits.append((seq, event))
            return event
        at = bisect.bisect_left(waits, seq, key=_wait_seq)
        if waits[at][0] == seq:
            return waits[at][1]
        event = trio.Event()
        waits.insert(at, (seq, event))
        return event

    def _wake_waiters(self, durable_seq: int | None = None) -> None:
        """Wake the waiters for entries up to ``durable_seq`` (None: every waiter)."""
        waits = self._waits
        upto = (
            len(waits)
            if durable_seq is None
            else bisect.bisect_right(waits, durable_seq, key=_wait_seq)
        )
        for _, event in waits[:upto]:
            event.set()
        del waits[:upto]

    def _on_flushed(self, seq: int, synced: bool) -> None:
        self._durable_seq = seq
        self.fsync_count += synced
        self._wake_waiters(seq)

    def _on_failed(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
        with self._lock:
            self._pending.clear()  # never to be written; the flusher has stopped
        self._wake_waiters()

    # -- close ---------------------------------------------------------------------

    async def aclose(self) -> None:
        """Record ``audit_close``, make everything durable, stop the flusher, close.

        Runs shielded (it is called while cancelling). Error handling: raises
        AuditWriteError if the final write fails; a log that had already failed is
        closed without raising again.
        """
        if self._closed:
            return
        with trio.CancelScope(shield=True):
            try:
                seq: int | None = None
                if self._failure is None and not self._closing and self._thread is not None:
                    seq = self.record(
                        EntryKind.EVENT,
                        event=AuditEvent.AUDIT_CLOSE,
                        detail={"pid": os.getpid()},
                    )
                self._closing = True
                await self._join_flusher()  # it writes everything queued, then exits
                if seq is not None:
                    # Read after the join: the flusher's last word, whatever trio's
                    # callbacks have seen so far.
                    if self._write_failure is not None or self._written_seq < seq:
                        raise AuditWriteError(
                            self._write_failure or f"{self.path}: audit_close was not written"
                        )
                    if self._fsync:
                        await trio.to_thread.run_sync(os.fsync, self._head_fd)
                for hook in self.after_close:
                    await trio.to_thread.run_sync(hook)
            finally:
                self._closed = True
                self._closing = True
                if self._ringer_scope is not None:
                    self._ringer_scope.cancel()
                os.close(self._fd)
                os.close(self._head_fd)
                if self.tree is not None:
                    self.tree.close()

    async def _join_flusher(self) -> None:
        """Stop the flusher once the queue is written (or writing failed); join it."""
        thread = self._thread
        if thread is None:
            return
        with self._lock:
            self._stopping = True
        self._ring()
        await trio.to_thread.run_sync(thread.join)
        with self._lock:
            self._pending.clear()


@asynccontextmanager
async def open_audit_log(
    path: Path,
    *,
    fsync: bool = True,
    clock: Callable[[], int] = time.time_ns,
    sync_delay_s: float = RESULT_SYNC_DELAY_S,
    scrubber: Scrubber = NO_SECRETS,
    max_bytes: int = 0,
    tree: bool = True,
) -> AsyncIterator[AuditLog]:
    """Open (or create) the audit log at ``path`` and continue its chain.

    Creates the parent directory (0700) and the file (0600) if missing. Reads only the
    tail to find the last entry (the head file says where it is), so the chain
    continues across restarts. A torn tail left by a crash is terminated and recorded
    as a ``torn_tail_recovered`` event (line, size and sha256 of the torn bytes), never
    dropped. Then the flusher thread starts and an ``audit_open`` entry is made
    durable. On exit ``audit_close`` is made durable, the flusher is joined and the
    files are closed. ``fsync=False`` writes without syncing (tests and benchmarks
    only). ``clock`` returns ns since the epoch. ``sync_delay_s`` is how long an entry
    nobody waits for may stay queued (tests stretch it to make flushes predictable).
    ``scrubber``: the secrets no entry may hold, in any field (see ``Chain``); the
    default scrubs nothing. ``max_bytes``: rotate the active file before an entry
    would take it past this size (0, the default here, never rotates; a segment
    always takes at least one entry besides its ``segment_open``). An active file
    that holds no entry of its own yet but continues a closed segment (a rotation
    was interrupted) starts with a ``segment_open`` event naming that segment.
    ``tree``: keep the Merkle tree beside the log (``<log>.tree/``), brought up to the
    log's last entry first (the whole log is read once if there is no tree yet); a
    tree that cannot be opened is switched off (``AuditLog.tree_failure``), never the
    log.

    Error handling: AuditOpenError when the log is locked by another process, shorter
    than its head file says, rewritten, or not an audit log (the message says what to
    do); AuditWriteError when the first entries cannot be written; OSError from
    creating the files passes through; ValueError for a ``sync_delay_s`` below 0 or
    beyond what a thread can wait (``threading.TIMEOUT_MAX``), or a negative
    ``max_bytes``.
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be 0 (never rotate) or more, not {max_bytes}")
    if not 0 <= sync_delay_s <= threading.TIMEOUT_MAX:
        raise ValueError(
            f"sync_delay_s must be 0 to {threading.TIMEOUT_MAX:g} seconds, not {sync_delay_s}"
        )
    opened = await trio.to_thread.run_sync(open_files, path, fsync)
    store: TreeStore | None = None
    tree_failure: str | None = None
    if tree:
        try:
            store = await trio.to_thread.run_sync(
                functools.partial(open_tree, path, last_seq=opened.chain_end.position.seq)
            )
        except (OSError, TreeError) as exc:
            tree_failure = f"the Merkle tree of {path} cannot be used: {exc}"
    log = AuditLog(
        path,
        opened,
        fsync=fsync,
        clock=clock,
        sync_delay_s=sync_delay_s,
        scrubber=scrubber,
        tree=store,
    )
    log.tree_failure = tree_failure
    try:
        log._start_flusher()
        if opened.chain_end.torn:
            log.record(
                EntryKind.EVENT,
                event=AuditEvent.TORN_TAIL_RECOVERED,
                detail=torn_detail(opened),
            )
        if opened.continues:
            position = opened.chain_end.position
            log.record(
                EntryKind.EVENT,
                event=AuditEvent.SEGMENT_OPEN,
                detail={
                    "previousSegment": opened.continues_segment,
                    "previousSeq": position.seq,
                    "previousHash": position.hash,
                    "maxBytes": max_bytes,
                    "recovered": True,
                },
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
        log._max_bytes = max_bytes  # from here on; open's own entries stay together
        yield log
    finally:
        await log.aclose()
