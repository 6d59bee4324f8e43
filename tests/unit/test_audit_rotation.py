"""Size-based rotation of the audit log: the chain runs across segments, verify reads
them all, and every state a crash in the middle of a rotation can leave is recovered
at the next open without losing or repeating an entry."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.audit import AuditEvent, AuditOpenError, ProblemKind, open_audit_log, verify_file
from gatewayd.audit.head import HeadRecord, encode_head, head_path, read_head
from gatewayd.audit.query import read_log
from gatewayd.audit.segments import list_segments, log_files, segment_path

# Small enough that a few dozen entries rotate several times.
SEGMENT_BYTES = 2048
# The test's own entries: a registered event the log never writes by itself (_KILLER
# names it too).
MARK = AuditEvent.EGRESS


def entries(path: Path) -> list[dict[str, Any]]:
    return [r.entry for r in read_log(path) if r.entry is not None]


def marks(path: Path) -> list[int]:
    """The ``detail.i`` of every test entry, in log order."""
    return [e["detail"]["i"] for e in entries(path) if e.get("event") == MARK]


async def write_marks(path: Path, start: int, count: int, max_bytes: int = SEGMENT_BYTES) -> None:
    async with open_audit_log(path, fsync=False, max_bytes=max_bytes) as log:
        for i in range(start, start + count):
            await log.append("event", event=MARK, detail={"i": i, "pad": "x" * 40})


async def test_concurrent_appends_rotate_into_segments_that_verify_as_one_chain(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit" / "audit.jsonl"
    async with (
        open_audit_log(path, fsync=True, max_bytes=SEGMENT_BYTES) as log,
        trio.open_nursery() as nursery,
    ):
        for i in range(120):
            nursery.start_soon(
                lambda i=i: log.append("event", event=MARK, detail={"i": i, "pad": "y" * 30})
            )
    segments = list_segments(path)
    assert len(segments) >= 5
    assert [n for n, _ in segments] == list(range(1, len(segments) + 1))
    for _, segment in segments:
        assert segment.stat().st_size <= SEGMENT_BYTES
        assert os.stat(segment).st_mode & 0o777 == 0o600
    assert sorted(marks(path)) == list(range(120))  # every entry once
    seqs = [e["seq"] for e in entries(path)]
    assert seqs == list(range(1, len(seqs) + 1))
    report = verify_file(path)
    assert report.ok, report.render()
    assert report.segments == len(segments) + 1 and report.entries == len(seqs)
    assert f"in {len(segments) + 1} segments" in report.render()


async def test_each_new_segment_starts_with_segment_open_naming_the_one_before(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    await write_marks(path, 0, 40)
    files = log_files(path)
    assert len(files) >= 3
    for before, after in itertools.pairwise(files):
        first_of_after = next(r.entry for r in _file_records(after))
        last_of_before = [r.entry for r in _file_records(before)][-1]
        assert first_of_after is not None and last_of_before is not None
        assert first_of_after["event"] == "segment_open"
        assert first_of_after["detail"]["previousSegment"] == before.name
        assert first_of_after["detail"]["previousSeq"] == last_of_before["seq"]
        assert first_of_after["prev"] == last_of_before["hash"]
        assert first_of_after["seq"] == last_of_before["seq"] + 1


def _file_records(path: Path) -> list[Any]:
    from gatewayd.audit.query import read_file

    return list(read_file(path))


async def test_chain_and_numbering_continue_across_reopen_with_rotation(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await write_marks(path, 0, 30)
    first = len(list_segments(path))
    await write_marks(path, 30, 30)
    assert len(list_segments(path)) > first
    assert marks(path) == list(range(60))
    assert verify_file(path).ok


async def test_zero_max_bytes_never_rotates_and_a_negative_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await write_marks(path, 0, 60, max_bytes=0)
    assert list_segments(path) == []
    with pytest.raises(ValueError, match="max_bytes"):
        async with open_audit_log(path, max_bytes=-1):
            pass  # pragma: no cover


async def test_an_entry_larger_than_the_limit_still_gets_a_segment_of_its_own(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=False, max_bytes=300) as log:
        for i in range(3):
            await log.append("event", event=MARK, detail={"i": i, "pad": "z" * 400})
    assert marks(path) == [0, 1, 2]
    assert verify_file(path).ok


# --- verify over segments ------------------------------------------------------------


async def test_deleted_middle_segment_is_reported_by_name_and_the_rest_still_checked(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    await write_marks(path, 0, 60)
    segments = list_segments(path)
    assert len(segments) >= 4
    gone = segments[1][1]
    gone.unlink()
    report = verify_file(path)
    assert not report.ok
    [problem] = report.problems
    assert problem.kind is ProblemKind.MISSING
    assert f"segment {gone.name} is missing" in problem.message
    assert problem.segment == segments[2][1].name and problem.line == 1
    # Everything after the gap was still checked.
    assert report.last_seq == entries(path)[-1]["seq"]


async def test_deleted_last_closed_segment_is_named_from_the_segment_open_event(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    await write_marks(path, 0, 40)
    gone = list_segments(path)[-1][1]
    gone.unlink()
    [problem] = verify_file(path).problems
    assert f"segment {gone.name} is missing" in problem.message
    assert problem.segment == path.name


async def test_deleted_oldest_segments_make_a_partial_report_not_a_failure(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    await write_marks(path, 0, 40)
    segments = list_segments(path)
    for _, segment in segments[:2]:
        segment.unlink()
    report = verify_file(path)
    assert report.ok and report.problems == ()
    first = next(r.entry for r in read_log(path))
    assert first is not None and report.partial_from == first["seq"] > 1
    [warning] = [w for w in report.warnings if w.kind is ProblemKind.PARTIAL]
    assert segments[1][1].name in warning.message
    assert report.render().startswith(f"PARTIAL: the log starts at seq {first['seq']}")


async def test_a_log_whose_first_lines_were_cut_is_still_a_missing_failure(
    tmp_path: Path,
) -> None:
    # Not a segment boundary (no segment_open): entries removed from the start.
    path = tmp_path / "audit.jsonl"
    await write_marks(path, 0, 10, max_bytes=0)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[3:]))
    head_path(path).unlink()
    report = verify_file(path)
    assert not report.ok and report.partial_from is None
    assert report.problems[0].kind is ProblemKind.MISSING


async def test_tampered_entry_in_a_closed_segment_is_reported_with_its_segment(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    await write_marks(path, 0, 40)
    victim = list_segments(path)[1][1]
    data = victim.read_bytes()
    victim.write_bytes(data.replace(b'"pad":"xxxx', b'"pad":"XXXX', 1))
    [problem] = verify_file(path).problems
    assert problem.kind is ProblemKind.TAMPERED and problem.segment == victim.name


async def test_active_file_cut_off_after_a_rotation_is_truncated(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await write_marks(path, 0, 40)
    path.unlink()  # the head still names the last durable entry
    report = verify_file(path)
    assert not report.ok
    assert {p.kind for p in report.problems} == {ProblemKind.TRUNCATED}
    assert any(w.kind is ProblemKind.NO_ACTIVE for w in report.warnings)


# --- crash states of a rotation --------------------------------------------------------


def _tail_entry(path: Path) -> dict[str, Any]:
    return [r.entry for r in read_log(path) if r.entry is not None][-1]


async def _closed_log(path: Path) -> HeadRecord:
    """A one-file log (never rotated) and its head."""
    await write_marks(path, 0, 12, max_bytes=0)
    head = read_head(path)
    assert head is not None
    return head


@pytest.mark.parametrize(
    "state",
    ["renamed", "created", "head_moved", "segment_open_torn"],
)
async def test_every_crash_state_of_a_rotation_is_recovered_at_open(
    tmp_path: Path, state: str
) -> None:
    path = tmp_path / "audit.jsonl"
    head = await _closed_log(path)
    last = _tail_entry(path)
    # What the flusher does, step by step, stopped after `state`.
    os.rename(path, segment_path(path, 1))
    if state != "renamed":
        path.touch(mode=0o600)
    if state in ("head_moved", "segment_open_torn"):
        moved = HeadRecord(seq=head.seq, hash=head.hash, end=0, lines=0)
        head_path(path).write_bytes(encode_head(moved))
    if state == "segment_open_torn":
        path.write_bytes(b'{"seq":%d,"time":"2026-11-22T1' % (head.seq + 1))

    await write_marks(path, 12, 5)

    assert marks(path) == list(range(17))  # nothing lost, nothing twice
    report = verify_file(path)
    assert report.ok, report.render()
    follower = next(e for e in entries(path) if e["seq"] == last["seq"] + 1)
    assert follower["prev"] == last["hash"]
    torn = state == "segment_open_torn"
    assert follower["event"] == ("torn_tail_recovered" if torn else "segment_open")
    opener = next(e for e in entries(path) if e.get("event") == "segment_open")
    assert opener["detail"]["previousSegment"] == segment_path(path, 1).name
    assert opener["detail"]["recovered"] is True
    kinds = {w.kind for w in report.warnings}
    assert (ProblemKind.RECOVERED in kinds) == (state == "segment_open_torn")


async def test_an_active_file_cut_short_after_a_rotation_is_still_refused(
    tmp_path: Path,
) -> None:
    # The interrupted-rotation rule must not excuse a cut active file.
    path = tmp_path / "audit.jsonl"
    await write_marks(path, 0, 40)
    assert list_segments(path)
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(AuditOpenError, match="cannot be continued"):
        await write_marks(path, 40, 1)


async def test_a_second_writer_is_refused_after_the_first_rotated(tmp_path: Path) -> None:
    # The active file's inode changes at each rotation: the new one is locked as well.
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=False, max_bytes=SEGMENT_BYTES) as log:
        for i in range(30):
            await log.append("event", event=MARK, detail={"i": i, "pad": "x" * 40})
        assert list_segments(path)
        with pytest.raises(AuditOpenError, match="locked by another process"):
            async with open_audit_log(path, fsync=False):
                pass  # pragma: no cover


_KILLER = textwrap.dedent(
    """
    import os, sys, trio
    from pathlib import Path
    from gatewayd.audit import AuditEvent, open_audit_log

    where = sys.argv[2]
    real_rename, real_pwrite = os.rename, os.pwrite

    def rename(src, dst):
        real_rename(src, dst)
        if where == "rename":
            os._exit(9)

    def pwrite(fd, data, offset):
        real_pwrite(fd, data, offset)
        if where == "head" and b" end=00000000000000000000 " in data:
            os._exit(9)

    os.rename, os.pwrite = rename, pwrite

    async def main():
        async with open_audit_log(Path(sys.argv[1]), fsync=True, max_bytes=2048) as log:
            for i in range(1000):
                await log.append("event", event=AuditEvent.EGRESS, detail={"i": i, "pad": "x" * 40})
                print(i, flush=True)  # durable

    trio.run(main)
    """
)


@pytest.mark.parametrize("where", ["rename", "head"])
def test_writer_killed_at_the_rotation_point_loses_nothing_on_reopen(
    tmp_path: Path, where: str
) -> None:
    path = tmp_path / "audit.jsonl"
    proc = subprocess.run(
        [sys.executable, "-c", _KILLER, str(path), where],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 9, proc.stderr
    durable = [int(x) for x in proc.stdout.split()]
    assert durable, "the writer died before its first rotation"
    trio.run(write_marks, path, 1000, 3)
    found = marks(path)
    # Every entry reported durable is there once; at most the one in flight besides.
    assert found[: len(durable)] == durable
    assert found[len(durable) :][:-3] in ([], [len(durable)])
    assert found[-3:] == [1000, 1001, 1002]
    report = verify_file(path)
    assert report.ok, report.render()
