"""``AuditLog.flush_soon``: entries recorded now and waited for only after other work
(a run's start makes its tools meanwhile; its end deletes its directory) are flushed
at once, not when the wait begins, nor after ``RESULT_SYNC_DELAY_S`` (never, in these
tests); and asking never raises for a log that cannot write, whose later wait does.

Real files in tmp_path, a real flusher thread.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from gatewayd.audit import AuditEvent, AuditLog, AuditWriteError, open_audit_log, read_entries

# No entry is ever due during a test: only a waiter, flush_soon or close makes the
# flusher write.
NEVER_DUE_S = 3600.0
# A bound on "soon" for what takes milliseconds: generous for a loaded CI box.
PATIENCE_S = 20.0


async def durable_without_waiting(log: AuditLog, seq: int) -> None:
    """Poll (never wait on the log, which would ask for the flush) until ``seq`` is
    durable."""
    with trio.fail_after(PATIENCE_S):
        while log.durable_seq < seq:
            await trio.sleep(0.001)


async def test_an_entry_asked_for_is_flushed_with_no_waiter(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=True, sync_delay_s=NEVER_DUE_S) as log:
        first = log.record("event", event=AuditEvent.RUN_CREATED, runId="r1")
        second = log.record("event", event=AuditEvent.WORKSPACE_OPENED, runId="r1")
        syncs = log.fsync_count
        log.flush_soon(second)
        # Nobody waits, and the entries are never due: only the ask can flush them.
        await durable_without_waiting(log, second)
        assert log.fsync_count == syncs + 1  # both in one flush
        assert [e["seq"] for e in read_entries(path)][-2:] == [first, second]
        # Asking again, or for an entry durable already, flushes nothing more.
        log.flush_soon(first)
        log.flush_soon(second)
        await log.durable(second)
        assert log.fsync_count == syncs + 1


async def test_an_entry_recorded_alone_stays_queued_until_it_is_asked_for(
    tmp_path: Path,
) -> None:
    # The counterpart: without the ask, the entry waits (for a waiter, or the delay).
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=True, sync_delay_s=NEVER_DUE_S) as log:
        seq = log.record("event", event=AuditEvent.RUN_CREATED, runId="r1")
        await trio.sleep(0.05)
        assert log.durable_seq < seq
        log.flush_soon(seq)
        await durable_without_waiting(log, seq)


async def test_asking_for_a_seq_never_recorded_is_a_value_error(tmp_path: Path) -> None:
    async with open_audit_log(tmp_path / "audit.jsonl", sync_delay_s=NEVER_DUE_S) as log:
        with pytest.raises(ValueError, match="never recorded"):
            log.flush_soon(log.last_seq + 1)


async def test_a_flush_asked_for_that_fails_fails_the_log_and_later_asks_stay_quiet(
    tmp_path: Path,
) -> None:
    """A real ENOSPC: the log's descriptor is pointed at /dev/full underneath it."""
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=True, sync_delay_s=NEVER_DUE_S) as log:
        full = os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
        os.dup2(full, log.fileno())
        os.close(full)
        seq = log.record("event", event=AuditEvent.RUN_CREATED, runId="r1")
        log.flush_soon(seq)  # the flusher writes it with nobody waiting, and fails
        with trio.fail_after(PATIENCE_S):
            while not log.failed:
                await trio.sleep(0.001)
        later = log.record("event", event=AuditEvent.RUN_ENDED, runId="r1")
        log.flush_soon(later)  # never raises: the wait is where the failure is said
        for wanted in (seq, later):
            with pytest.raises(AuditWriteError) as failed:
                await log.durable(wanted)
            assert "No space left on device" in failed.value.detail
