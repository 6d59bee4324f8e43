"""Group commit as wide as the load: the waiters of one pass of trio's scheduler share one
flush (the ringer rings after them), a flush wakes only the waiters it released, and
under load the Merkle tree takes the leaves of several flushes in one append; a write
failure loses none of those held leaves of durable entries, and a Ctrl-C in the middle
of a ring loses no ring. (The tree's lag under steady load is measured in
tests/integration/test_audit_tree_lag.py.)

Real files in tmp_path, a real flusher thread; a test that must hold the flusher in the
middle of a flush gates its fdatasync on a threading.Event.
"""

from __future__ import annotations

import errno
import hashlib
import inspect
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import trio
import trio.testing

from gatewayd.audit import AuditWriteError, open_audit_log, read_entries, verify_file, writer
from gatewayd.audit.treestore import open_tree

# No entry is ever due during a test: only waiters (or close) make the flusher write.
NEVER_DUE_S = 3600.0
# A bound on "soon" for things that take milliseconds: generous for a loaded CI box.
PATIENCE_S = 20.0
TASKS = 20
# How long each call's stand-in system call blocks: long enough for a woken flusher to
# take the interpreter (and a batch) during it.
SYSCALL_S = 0.001


def call_fields(i: int) -> dict[str, Any]:
    return {
        "runId": "run-0123456789abcdef",
        "toolCallId": f"call-{i}",
        "tool": "time.now",
        "argsDigest": "sha256:" + hashlib.sha256(str(i).encode()).hexdigest(),
        "decision": "allow",
        "peer": {"pid": 4242, "uid": 1000, "gid": 1000},
    }


async def test_the_waiters_of_one_scheduler_pass_share_one_flush(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=True, sync_delay_s=NEVER_DUE_S) as log:
        # The flusher asleep first: one still busy with the open's flush takes whatever
        # is wanted when it looks again, without a ring (group commit as it should be),
        # which would split the calls below across two flushes.
        await wait_until(lambda: log._idle)
        await trio.testing.wait_all_tasks_blocked()
        start = log.fsync_count

        async def call(i: int) -> None:
            # A system call that waits a little between calls, as a server's read or
            # the rules file's stat may: the trio thread lets go of the interpreter
            # there, and a flusher rung by the first call would take its entries alone.
            time.sleep(SYSCALL_S)
            log.record("call", **call_fields(i))
            await log.durable(log.record("result", runId="run-0123456789abcdef"))

        async with trio.open_nursery() as nursery:
            for i in range(TASKS):
                nursery.start_soon(call, i)
        assert log.fsync_count - start == 1
    assert verify_file(path).ok


class GatedSync:
    """os.fdatasync that holds the flusher inside each of the next syncs asked for
    (:meth:`hold`) until that sync's gate is opened: "a flush is under way", made to
    last."""

    def __init__(self) -> None:
        self.real: Callable[[int], None] = os.fdatasync
        self.held: list[tuple[threading.Event, threading.Event, bool]] = []

    def hold(self, *, fail: bool = False) -> tuple[threading.Event, threading.Event]:
        """Hold the next sync not held yet: (set once it is entered, its gate). With
        ``fail``, it fails with EIO once its gate opens: "the disk failed"."""
        entered, gate = threading.Event(), threading.Event()
        self.held.append((entered, gate, fail))
        return entered, gate

    def __call__(self, fd: int) -> None:
        if self.held:
            entered, gate, fail = self.held.pop(0)
            entered.set()
            gate.wait(PATIENCE_S)
            if fail:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        self.real(fd)


async def wait_until(done: Callable[[], bool]) -> None:
    with trio.fail_after(PATIENCE_S):
        while not done():
            await trio.sleep(0.001)


@pytest.mark.parametrize(
    ("cap", "appends"),
    [
        pytest.param(writer.TREE_BATCH_LEAVES, [2], id="held-for-the-next-flush"),
        pytest.param(1, [1, 1], id="at-the-cap-appended-at-once"),
    ],
)
async def test_a_flush_wakes_only_its_waiters_and_the_tree_takes_busy_flushes_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap: int, appends: list[int]
) -> None:
    path = tmp_path / "audit.jsonl"
    monkeypatch.setattr(writer, "TREE_BATCH_LEAVES", cap)
    sync = GatedSync()
    monkeypatch.setattr(os, "fdatasync", sync)
    async with open_audit_log(path, fsync=True, sync_delay_s=NEVER_DUE_S) as log:
        tree = log.tree
        assert tree is not None
        await wait_until(lambda: tree.size == log.durable_seq)  # open's own entries
        appended: list[int] = []
        real_append = tree.append

        def counting_append(hashes: Sequence[bytes]) -> None:
            appended.append(len(hashes))
            real_append(hashes)

        monkeypatch.setattr(tree, "append", counting_append)
        done: list[str] = []

        async def waiter(name: str, seq: int) -> None:
            await log.durable(seq)
            done.append(name)

        first_entered, first_gate = sync.hold()
        second_entered, second_gate = sync.hold()
        async with trio.open_nursery() as nursery:
            first = log.record("call", **call_fields(1))
            nursery.start_soon(waiter, "first", first)
            await wait_until(first_entered.is_set)  # the first flush is syncing
            second = log.record("call", **call_fields(2))
            nursery.start_soon(waiter, "second", second)
            await trio.testing.wait_all_tasks_blocked()
            first_gate.set()
            await wait_until(lambda: done == ["first"] and second_entered.is_set())
            # The first flush released its own waiter and woke no other: the second
            # still waits on an event nobody has set, while its flush syncs.
            [(seq, event)] = log._waits
            assert seq == second and not event.is_set()
            # The second waiter had asked while the first flush was under way: the
            # first flush's leaf is held for the next flush's (unless that fills the cap).
            assert appended == appends[:-1]
            second_gate.set()
        assert done == ["first", "second"]
        await wait_until(lambda: tree.size >= second)
        assert appended == appends
    entries = list(read_entries(path))
    store = open_tree(path, writable=False)
    try:
        assert store.size == len(entries)  # what close wrote joined the tree too
    finally:
        store.close()


async def test_a_write_failure_still_puts_the_held_leaves_of_durable_entries_in_the_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "audit.jsonl"
    sync = GatedSync()
    monkeypatch.setattr(os, "fdatasync", sync)
    at_close: list[tuple[int, int]] = []  # (tree size, durable seq) seen by close's hook
    async with open_audit_log(path, fsync=True, sync_delay_s=NEVER_DUE_S) as log:
        tree = log.tree
        assert tree is not None
        await wait_until(lambda: tree.size == log.durable_seq)  # open's own entries
        # As the last checkpoint does: close's hooks read the tree.
        log.after_close.append(lambda: at_close.append((tree.size, log.durable_seq)))
        done: dict[str, str] = {}

        async def waiter(name: str, seq: int) -> None:
            try:
                await log.durable(seq)
            except AuditWriteError:
                done[name] = "failed"
            else:
                done[name] = "durable"

        first_entered, first_gate = sync.hold()
        second_entered, second_gate = sync.hold(fail=True)
        async with trio.open_nursery() as nursery:
            first = log.record("call", **call_fields(1))
            nursery.start_soon(waiter, "first", first)
            await wait_until(first_entered.is_set)  # the first flush is syncing
            # Asked while it syncs: the first flush's leaf is held for the next flush's.
            nursery.start_soon(waiter, "second", log.record("call", **call_fields(2)))
            await trio.testing.wait_all_tasks_blocked()
            first_gate.set()
            await wait_until(lambda: done == {"first": "durable"} and second_entered.is_set())
            assert tree.size == first - 1  # held, while the second flush syncs...
            second_gate.set()  # ...and fails
        assert done == {"first": "durable", "second": "failed"}
        assert log.durable_seq == first
    # The entry reported durable joined the tree before close's hooks ran (and the one
    # whose sync failed did not), in the tree on disk as well.
    assert at_close == [(first, first)]
    store = open_tree(path, writable=False)
    try:
        assert store.size == first
    finally:
        store.close()


def test_a_ctrl_c_inside_ring_soon_loses_no_ring(tmp_path: Path) -> None:
    """A Ctrl-C arrives while _ring_soon has taken the parked ringer but not yet woken
    it. Unprotected, trio raises KeyboardInterrupt right there: the ringer stays parked
    with nobody to wake it, every later ring is skipped as already scheduled, and an
    idle flusher is never woken again. Protected, trio delivers it at the next
    checkpoint instead, and the log goes on.

    A sync test running its own trio.run: trio's SIGINT handler (installed by trio.run)
    delivers the Ctrl-C to the main task, here the test's own code rather than pytest's.
    """
    path = tmp_path / "audit.jsonl"
    ring_soon = inspect.unwrap(writer.AuditLog._ring_soon).__code__
    source, first_line = inspect.getsourcelines(ring_soon)
    # The line that wakes the ringer: a Ctrl-C on it comes after the ringer was taken.
    [wake] = [first_line + i for i, text in enumerate(source) if "reschedule(ringer)" in text]
    armed = False

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        if frame.f_code is not ring_soon:
            return None

        def on_line(frame: FrameType, event: str, arg: object) -> Any:
            nonlocal armed
            if armed and event == "line" and frame.f_lineno == wake:
                armed = False
                signal.raise_signal(signal.SIGINT)  # a real Ctrl-C: trio's handler runs now
            return on_line

        return on_line

    async def main() -> tuple[bool, bool]:
        nonlocal armed
        async with open_audit_log(path, fsync=True, sync_delay_s=NEVER_DUE_S) as log:
            await trio.testing.wait_all_tasks_blocked()  # the flusher idle, the ringer parked
            interrupted = False
            previous = sys.gettrace()
            armed = True
            sys.settrace(trace)
            try:
                # Protected, the Ctrl-C comes at the next checkpoint: wait for it.
                with trio.move_on_after(PATIENCE_S):
                    await log.append("call", **call_fields(1))
                    await trio.sleep_forever()
            except KeyboardInterrupt:
                interrupted = True
            finally:
                sys.settrace(previous)
            # No entry is ever due: only a ring makes the flusher write this one.
            with trio.move_on_after(PATIENCE_S) as waiting:
                await log.append("call", **call_fields(2))
            return interrupted, not waiting.cancelled_caught

    # trio.run installs its handler only over Python's default one.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupted, flushed = trio.run(main)
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped trio.run")
    finally:
        signal.signal(signal.SIGINT, handler)
    assert not armed, f"_ring_soon never reached line {wake}"
    assert interrupted, "the Ctrl-C never arrived"
    assert flushed, "an entry appended after the Ctrl-C was never made durable"
