"""The trio audit writer: files, group commit, restarts, torn tails, failures, cancellation.

Real files in tmp_path, real trio, a real flusher thread, real OS errors (/dev/full, a
full tmpfs, a pipe whose reader goes away). Tests that count flushes stretch the
result sync delay (``sync_delay_s``) so that only waiters make the flusher write.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from gatewayd.audit import (
    AuditOpenError,
    AuditWriteError,
    ProblemKind,
    head_path,
    open_audit_log,
    read_entries,
    read_head,
    verify_file,
)
from gatewayd.audit.opening import MAX_BATCH_BYTES
from gatewayd.audit.writer import RESULT_SYNC_DELAY_S
from gatewayd.protocol import ErrorCode
from tests.hypothesis_counts import examples

PEER = {"pid": 4242, "uid": 1000, "gid": 1000}
# Long enough that no entry is ever flushed for being due during a test: only a waiter
# (or close) makes the flusher write, so flush counts are exact.
NEVER_DUE_S = 3600.0
# A bound on "soon" for things that take milliseconds: generous for a loaded CI box.
PATIENCE_S = 20.0


def call_fields(i: int) -> dict[str, Any]:
    return {
        "runId": "run-0123456789abcdef",
        "toolCallId": f"call-{i}",
        "tool": "fs.read",
        "argsDigest": "sha256:" + hashlib.sha256(str(i).encode()).hexdigest(),
        "argsSummary": {"path": f"/workspace/file-{i}.txt"},
        "decision": "allow",
        "peer": PEER,
    }


def entries(path: Path) -> list[dict[str, Any]]:
    return list(read_entries(path))


def seqs(path: Path) -> list[int]:
    return [e["seq"] for e in entries(path)]


def flusher_threads(path: Path) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"audit-flusher {path}"]


async def write_log(path: Path, calls: int, *, fsync: bool = False) -> None:
    async with open_audit_log(path, fsync=fsync) as log:
        for i in range(calls):
            await log.append("call", **call_fields(i))


# --- files --------------------------------------------------------------------------


async def test_open_creates_private_directory_and_files_and_records_open_and_close(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state" / "audit" / "audit.jsonl"
    async with open_audit_log(path) as log:
        assert log.durable_seq == 1  # audit_open is durable before we get the log
        flags = fcntl.fcntl(log.fileno(), fcntl.F_GETFL)
        assert flags & os.O_APPEND
        assert flags & os.O_ACCMODE == os.O_WRONLY
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(head_path(path).stat().st_mode) == 0o600
    written = entries(path)
    assert [(e["seq"], e["kind"], e["event"]) for e in written] == [
        (1, "event", "audit_open"),
        (2, "event", "audit_close"),
    ]
    assert written[0]["detail"]["continuesSeq"] == 0
    assert written[0]["detail"]["headFile"] == "missing"
    assert verify_file(path).ok


async def test_record_is_synchronous_and_entries_land_in_seq_order(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=False) as log:
        recorded = [log.record("call", **call_fields(i)) for i in range(5)]
        assert recorded == [2, 3, 4, 5, 6]
        assert log.durable_seq == 1  # queued, not yet written
        await log.durable(recorded[-1])
        assert log.durable_seq == 6
    assert seqs(path) == list(range(1, 8))
    assert [e.get("toolCallId") for e in entries(path)[1:6]] == [f"call-{i}" for i in range(5)]


async def test_entries_are_durable_on_disk_when_durable_returns(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path) as log:
        seq = await log.append("call", **call_fields(0))
        # Another reader sees the entry and the head already, before close.
        assert seqs(path) == [1, 2]
        head = read_head(path)
        assert head is not None
        assert (head.seq, head.end, head.lines) == (seq, path.stat().st_size, 2)
        assert log.fsync_count == 2  # audit_open, then this entry


async def test_fsync_false_still_writes_but_never_syncs(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=False) as log:
        for i in range(10):
            await log.append("call", **call_fields(i))
        assert log.fsync_count == 0
    assert seqs(path) == list(range(1, 13))


async def test_symlinked_log_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere.jsonl"
    real.write_bytes(b"")
    link = tmp_path / "audit.jsonl"
    link.symlink_to(real)
    with pytest.raises(OSError) as info:
        async with open_audit_log(link, fsync=False):
            pass
    assert info.value.errno == errno.ELOOP
    assert real.read_bytes() == b""


async def test_second_writer_on_the_same_log_is_refused_while_the_first_holds_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=False):
        with pytest.raises(AuditOpenError, match="locked by another process"):
            async with open_audit_log(path, fsync=False):
                pass
    async with open_audit_log(path, fsync=False):
        pass  # free again once the first one closed
    assert verify_file(path).ok


# --- group commit -------------------------------------------------------------------


async def test_a_waiter_makes_the_flusher_write_at_once_without_waiting_for_the_delay(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=True, sync_delay_s=NEVER_DUE_S) as log:
        result = log.record("result", runId="run-0123456789abcdef", toolCallId="c", durationMs=1.0)
        await trio.sleep(0.05)  # the flusher is asleep again: that entry is due in an hour
        assert (seqs(path), log.durable_seq) == ([1], 1)
        with trio.fail_after(PATIENCE_S):  # without the waiter's wake-up: an hour
            seq = await log.append("call", **call_fields(0))
        assert seqs(path) == [1, result, seq]
        assert log.fsync_count == 2  # audit_open, then both entries in one flush


async def test_results_nobody_waits_for_become_durable_within_the_delay(tmp_path: Path) -> None:
    """The flusher's own timer writes entries nobody awaits (results, denials)."""
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=True) as log:
        seq = log.record("result", runId="run-0123456789abcdef", toolCallId="c", durationMs=1.0)
        with trio.fail_after(PATIENCE_S):
            while seqs(path) != [1, seq]:
                await trio.sleep(RESULT_SYNC_DELAY_S)
            while log.durable_seq != seq:  # and trio is told
                await trio.sleep(RESULT_SYNC_DELAY_S)
        assert log.fsync_count == 2
        head = read_head(path)
        assert head is not None
        assert (head.seq, head.end) == (seq, path.stat().st_size)


async def test_concurrent_appends_share_fsyncs_and_keep_one_contiguous_chain(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    returned: list[int] = []
    async with open_audit_log(path, fsync=True) as log:
        start = log.fsync_count

        async def task(t: int) -> None:
            for i in range(4):
                returned.append(await log.append("call", **call_fields(t * 4 + i)))

        async with trio.open_nursery() as nursery:
            for t in range(50):
                nursery.start_soon(task, t)
        fsyncs = log.fsync_count - start
    assert sorted(returned) == list(range(2, 202))
    assert fsyncs < 25, f"200 appends took {fsyncs} fsyncs: group commit is not sharing them"
    report = verify_file(path)
    assert report.ok, report.render()
    assert report.entries == 202
    assert seqs(path) == list(range(1, 203))


async def test_a_batch_larger_than_the_flush_cap_is_written_in_several_flushes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    summary = {"blob": "x" * 7000}
    async with open_audit_log(path, fsync=True, sync_delay_s=NEVER_DUE_S) as log:
        for i in range(700):  # ~5 MB, over MAX_BATCH_BYTES
            log.record("call", **{**call_fields(i), "argsSummary": summary})
        start = log.fsync_count
        with trio.fail_after(PATIENCE_S):
            await log.durable(log.last_seq)
        assert log.fsync_count - start == 2
    assert path.stat().st_size > MAX_BATCH_BYTES
    assert verify_file(path).ok


# --- restarts -----------------------------------------------------------------------


async def test_chain_continues_across_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await write_log(path, 3)
    await write_log(path, 2)
    written = entries(path)
    assert [e["seq"] for e in written] == list(range(1, 10))
    second_open = written[5]
    assert second_open["event"] == "audit_open"
    assert second_open["detail"]["continuesSeq"] == 5
    assert second_open["detail"]["headFile"] == "found"
    assert second_open["prev"] == written[4]["hash"]
    report = verify_file(path)
    assert report.ok, report.render()
    assert report.warnings == ()


async def test_log_without_head_file_is_continued_and_gets_a_head_again(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await write_log(path, 3)
    head_path(path).unlink()
    async with open_audit_log(path, fsync=False) as log:
        assert log.last_seq == 6
    assert entries(path)[5]["detail"]["headFile"] == "missing"
    head = read_head(path)
    assert head is not None
    assert (head.seq, head.lines, head.end) == (7, 7, path.stat().st_size)
    assert verify_file(path).ok


@pytest.mark.parametrize(
    ("torn", "lines"),
    [
        pytest.param(b'{"seq":6,"time":"2026-11-22T13:4', 1, id="partial-line-no-newline"),
        pytest.param(b"\x00" * 300, 1, id="zeros-after-power-loss"),
        pytest.param(b'{"seq":6,"garbage"}\n', 1, id="complete-line-not-an-entry"),
        pytest.param(b'{"seq":6,"ti\n{"seq":7,"time"', 2, id="two-torn-lines"),
    ],
)
async def test_torn_tail_found_at_open_is_terminated_and_recorded_not_dropped(
    tmp_path: Path, torn: bytes, lines: int
) -> None:
    path = tmp_path / "audit.jsonl"
    await write_log(path, 3)
    clean = path.read_bytes()
    with path.open("ab") as f:
        f.write(torn)
    async with open_audit_log(path, fsync=False) as log:
        assert log.last_seq == 7  # torn_tail_recovered (6), audit_open (7)
    data = path.read_bytes()
    assert data.startswith(clean + torn.rstrip(b"\n") + b"\n")  # kept, newline-terminated
    written = entries(path)
    recovered = next(e for e in written if e.get("event") == "torn_tail_recovered")
    torn_bytes = torn[:-1] if torn.endswith(b"\n") else torn
    assert recovered["detail"] == {
        "line": 6,
        "lines": lines,
        "bytes": len(torn_bytes),
        "sha256": hashlib.sha256(torn_bytes).hexdigest(),
        "headSeq": 5,
    }
    assert recovered["seq"] == 6
    assert recovered["prev"] == written[4]["hash"]  # chained to the last valid entry
    report = verify_file(path)
    assert report.ok, report.render()
    assert [w.kind for w in report.warnings] == [ProblemKind.RECOVERED]
    assert report.warnings[0].line == 6
    assert "crashed" in report.warnings[0].message


async def test_torn_region_holding_a_valid_line_that_does_not_chain_is_recovered_whole(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    await write_log(path, 2)
    stray = path.read_bytes().splitlines(keepends=True)[1]  # a valid entry, out of place
    with path.open("ab") as f:
        f.write(b"\x00" * 10 + b"\n" + stray)
    async with open_audit_log(path, fsync=False):
        pass
    recovered = next(e for e in entries(path) if e.get("event") == "torn_tail_recovered")
    assert recovered["detail"]["lines"] == 2
    report = verify_file(path)
    assert report.ok, report.render()


async def test_torn_first_write_of_a_new_log_restarts_the_chain_at_seq_1(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b'{"seq":1,"time":"2026-11-22T13:40:01.1')
    async with open_audit_log(path, fsync=False):
        pass
    written = entries(path)
    assert written[0].get("broken")
    assert [e["event"] for e in written[1:]] == ["torn_tail_recovered", "audit_open", "audit_close"]
    assert written[1]["seq"] == 1
    assert written[1]["prev"] == "0" * 64
    assert "headSeq" not in written[1]["detail"]
    report = verify_file(path)
    assert report.ok, report.render()


async def test_open_refuses_a_log_cut_shorter_than_its_head_says(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await write_log(path, 4)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-2]))
    with pytest.raises(AuditOpenError) as info:
        async with open_audit_log(path, fsync=False):
            pass
    message = str(info.value)
    assert "cut off the end" in message
    assert "gatewayd audit verify" in message
    assert "aside together" in message  # what the operator can do
    assert path.read_bytes() == b"".join(lines[:-2])  # nothing written to it


async def test_open_refuses_a_log_whose_last_durable_entry_was_rewritten(tmp_path: Path) -> None:
    """Without this, editing the last line and restarting would launder it as 'torn'."""
    path = tmp_path / "audit.jsonl"
    await write_log(path, 2)
    data = path.read_bytes()
    path.write_bytes(data[:-40] + bytes([data[-40] ^ 1]) + data[-39:])
    with pytest.raises(AuditOpenError, match="rewritten"):
        async with open_audit_log(path, fsync=False):
            pass


async def test_open_refuses_a_damaged_head_file(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await write_log(path, 1)
    head_path(path).write_bytes(b"garbage")
    with pytest.raises(AuditOpenError, match=r"head file .* is damaged.*move the head file aside"):
        async with open_audit_log(path, fsync=False):
            pass


async def test_open_refuses_a_file_that_is_not_an_audit_log(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(AuditOpenError, match="does not start like an audit log"):
        async with open_audit_log(path, fsync=False):
            pass
    assert path.read_bytes() == b"root:x:0:0:root:/root:/bin/bash\n"


# --- failures -----------------------------------------------------------------------


async def test_write_error_fails_the_log_for_every_waiter_and_every_later_call(
    tmp_path: Path,
) -> None:
    """A real ENOSPC: the log's descriptor is pointed at /dev/full underneath it."""
    path = tmp_path / "audit.jsonl"
    failures: list[AuditWriteError] = []
    async with open_audit_log(path, fsync=True) as log:
        full = os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
        os.dup2(full, log.fileno())
        os.close(full)

        async def caller(i: int) -> None:
            try:
                await log.append("call", **call_fields(i))
            except AuditWriteError as exc:
                failures.append(exc)

        with trio.fail_after(PATIENCE_S):  # a waiter nobody wakes fails, not hangs
            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(caller, i)
        assert len(failures) == 20
        assert log.failed
        with pytest.raises(AuditWriteError):
            await log.append("call", **call_fields(99))
        seq = log.record("call", **call_fields(100))  # queues nothing, raises nothing
        with pytest.raises(AuditWriteError):
            await log.durable(seq)
    exc = failures[0]
    assert exc.code is ErrorCode.INTERNAL
    assert "no call can run" in str(exc)
    assert str(path) not in str(exc)  # the safe message names no host path
    assert "No space left on device" in exc.detail
    assert str(path) in exc.detail
    assert seqs(path) == [1]  # only audit_open reached the file


async def test_failed_write_wakes_every_waiter_blocked_on_it_with_audit_write_error(
    tmp_path: Path,
) -> None:
    """The flusher is held in a real blocking write (a full pipe), then the write fails.

    Every waiter is already asleep when it fails, for entries in the failing batch and
    after it; each one raises, and nothing is written after the failure.
    """
    path = tmp_path / "audit.jsonl"
    failures: list[AuditWriteError] = []
    summary = {"blob": "p" * 7000}
    async with open_audit_log(path, fsync=False, sync_delay_s=NEVER_DUE_S) as log:
        size_before = path.stat().st_size
        read_end, write_end = os.pipe()
        os.dup2(write_end, log.fileno())
        os.close(write_end)
        recorded = [
            log.record("call", **{**call_fields(i), "argsSummary": summary}) for i in range(30)
        ]  # ~220 KB: more than a pipe holds, so the write blocks

        async def waiter(seq: int) -> None:
            try:
                await log.durable(seq)
            except AuditWriteError as exc:
                failures.append(exc)

        with trio.fail_after(PATIENCE_S):  # a waiter nobody wakes fails, not hangs
            async with trio.open_nursery() as nursery:
                for seq in recorded:
                    nursery.start_soon(waiter, seq)
                await trio.testing.wait_all_tasks_blocked()
                assert failures == []  # the flusher is stuck in write(), nobody is woken yet
                late = log.record("call", **call_fields(99))  # queued behind the stuck batch
                nursery.start_soon(waiter, late)
                await trio.testing.wait_all_tasks_blocked()
                os.close(read_end)  # the reader goes away: the blocked write fails (EPIPE)
        assert len(failures) == 31
        assert log.failed
        assert all("Broken pipe" in exc.detail for exc in failures)
        assert log.durable_seq == 1
    assert path.stat().st_size == size_before  # nothing reached the file, not even close
    assert seqs(path) == [1]


async def test_failed_flush_that_nobody_waited_for_fails_the_log_for_later_callers(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=True) as log:
        full = os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
        os.dup2(full, log.fileno())
        os.close(full)
        log.record("result", runId="run-0123456789abcdef", toolCallId="c", durationMs=1.0)
        with trio.fail_after(PATIENCE_S):  # the flusher's timer writes it, and fails
            while not log.failed:
                await trio.sleep(RESULT_SYNC_DELAY_S)
        with pytest.raises(AuditWriteError, match="no call can run") as info:
            await log.append("call", **call_fields(1))
        assert "No space left on device" in info.value.detail
    assert seqs(path) == [1]


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 64 KiB tmpfs: the disk fills up for real. Needs root (CAP_SYS_ADMIN)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


async def test_full_disk_fails_closed_then_restart_recovers_the_torn_write(
    small_tmpfs: Path,
) -> None:
    path = small_tmpfs / "audit" / "audit.jsonl"
    summary = {"blob": "y" * 6000}
    durable: list[int] = []

    async def fill_the_disk() -> None:
        async with open_audit_log(path, fsync=True) as log:
            for i in range(40):  # ~250 KB into 64 KiB
                fields = {**call_fields(i), "argsSummary": summary}
                durable.append(await log.append("call", **fields))

    with pytest.raises(AuditWriteError) as info, trio.fail_after(PATIENCE_S):
        await fill_the_disk()
    assert "No space left on device" in info.value.detail
    assert durable  # some entries fit before the disk filled
    subprocess.run(["mount", "-o", "remount,size=1m", str(small_tmpfs)], check=True)
    async with open_audit_log(path, fsync=True):
        pass
    written = [e for e in entries(path) if "seq" in e]
    assert [e["seq"] for e in written][: len(durable) + 1] == list(range(1, len(durable) + 2))
    report = verify_file(path)
    assert report.ok, report.render()
    assert [w.kind for w in report.warnings] == [ProblemKind.RECOVERED]


async def test_bad_fields_raise_and_record_nothing(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=False) as log:
        before = log.last_seq
        with pytest.raises(ValueError, match="errorCode"):
            log.record("result", errorCode="oops")
        with pytest.raises(ValueError, match="unknown field `color`"):
            log.record("call", color="red")  # type: ignore[call-arg]
        assert log.last_seq == before
        with pytest.raises(ValueError, match="never recorded"):
            await log.durable(before + 1)
    assert verify_file(path).ok


async def test_close_stops_and_joins_the_flusher_thread(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=False) as log:
        running = flusher_threads(path)
        assert len(running) == 1
        assert running[0].is_alive()
        log.record("result", runId="run-0123456789abcdef", toolCallId="c", durationMs=1.0)
    assert not running[0].is_alive()
    assert flusher_threads(path) == []
    assert seqs(path) == [1, 2, 3]  # the queued result was written before close


async def test_close_of_a_failed_log_still_joins_the_flusher(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=False) as log:
        running = flusher_threads(path)
        full = os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
        os.dup2(full, log.fileno())
        os.close(full)
        with pytest.raises(AuditWriteError), trio.fail_after(PATIENCE_S):
            await log.append("call", **call_fields(0))
    assert len(running) == 1
    assert not running[0].is_alive()


@pytest.mark.parametrize("delay", [-1.0, float("nan"), threading.TIMEOUT_MAX * 2])
async def test_sync_delay_a_thread_cannot_wait_is_refused_before_anything_is_opened(
    tmp_path: Path, delay: float
) -> None:
    path = tmp_path / "audit.jsonl"
    with pytest.raises(ValueError, match=r"sync_delay_s must be 0 to \S+ seconds, not"):
        async with open_audit_log(path, sync_delay_s=delay):
            pass
    assert not path.exists()


async def test_entry_recorded_after_close_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=False) as log:
        pass
    seq = log.record("call", **call_fields(0))
    with pytest.raises(AuditWriteError, match="no call can run"):
        await log.durable(seq)
    assert seqs(path) == [1, 2]


# --- cancellation -------------------------------------------------------------------


async def test_cancelling_a_waiter_mid_flush_loses_and_duplicates_nothing(
    tmp_path: Path,
) -> None:
    """The flusher owns the flush: the waiter goes away, every wanted entry still lands."""
    path = tmp_path / "audit.jsonl"
    summary = {"blob": "z" * 7000}
    async with open_audit_log(path, fsync=True, sync_delay_s=NEVER_DUE_S) as log:
        for i in range(1500):  # ~11 MB: three flushes of at most MAX_BATCH_BYTES
            log.record("call", **{**call_fields(i), "argsSummary": summary})
        last = log.last_seq
        scope = trio.CancelScope()

        async def waiter() -> None:
            with scope:
                await log.durable(last)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()  # the flusher is writing
            scope.cancel()
        assert scope.cancelled_caught
        assert log.durable_seq < last  # cancelled while the flushes were under way
        with trio.fail_after(PATIENCE_S):  # nobody waits now and nothing is due: the
            while log.durable_seq != last:  # flusher finishes what was wanted anyway
                await trio.sleep(0.01)
        assert not log.failed
        assert log.fsync_count - 1 == 3
    written = seqs(path)
    assert written == list(range(1, last + 2))  # every entry once, in order, plus close
    assert verify_file(path).ok


async def test_entry_of_a_caller_cancelled_before_its_flush_is_still_written(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=False, sync_delay_s=NEVER_DUE_S) as log:
        with trio.CancelScope() as scope:
            scope.cancel()
            await log.append("call", **call_fields(0))
        assert scope.cancelled_caught
        assert log.durable_seq == 1  # nobody wanted it and it is not due: still queued
    assert [e.get("toolCallId") for e in entries(path)] == [None, "call-0", None]
    assert verify_file(path).ok


# One step of a random workload: record some entries, then wait for the last of them,
# or wait and cancel the wait after some checkpoints, or wait for nothing; then let
# other tasks run for a few checkpoints before the next step.
_STEPS = st.lists(
    st.tuples(
        st.integers(min_value=1, max_value=4),
        st.sampled_from(["wait", "cancel", "none"]),
        st.integers(min_value=0, max_value=3),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=examples(40), deadline=None)
@given(steps=_STEPS, delay=st.sampled_from([0.0, RESULT_SYNC_DELAY_S, NEVER_DUE_S]))
async def test_any_mix_of_waiters_and_cancellations_writes_every_entry_once_in_order(
    steps: list[tuple[int, str, int]], delay: float
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "audit.jsonl"
        async with open_audit_log(path, fsync=False, sync_delay_s=delay) as log:

            async def waiter(seq: int, cancel_after: int | None) -> None:
                with trio.CancelScope() as scope:
                    if cancel_after is not None:

                        async def cancel_later() -> None:
                            for _ in range(cancel_after):
                                await trio.lowlevel.checkpoint()
                            scope.cancel()

                        nursery.start_soon(cancel_later)
                    await log.durable(seq)
                    # Returned: the entry is on disk already, before close.
                    assert seqs(path)[-1] >= seq
                    assert log.durable_seq >= seq

            with trio.fail_after(PATIENCE_S):
                async with trio.open_nursery() as nursery:
                    for i, (count, kind, pause) in enumerate(steps):
                        for j in range(count):
                            last = log.record("call", **call_fields(i * 10 + j))
                        if kind != "none":
                            nursery.start_soon(waiter, last, pause if kind == "cancel" else None)
                        for _ in range(pause):
                            await trio.lowlevel.checkpoint()
            last = log.last_seq
        assert seqs(path) == list(range(1, last + 2))
        assert verify_file(path).ok
