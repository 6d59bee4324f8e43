"""``gatewayd audit verify`` and ``show``: every kind of damage is found and named.

Logs are written by the real writer into tmp_path, then damaged on disk the way an
attacker or a crash would.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gatewayd.audit import (
    ProblemKind,
    VerifyReport,
    format_table,
    head_path,
    open_audit_log,
    read_entries,
    verify_file,
)
from gatewayd.audit.line import seal

RUN_A = "run-aaaa1111bbbb2222"
RUN_B = "run-cccc3333dddd4444"


async def make_log(path: Path, calls: int = 4) -> list[bytes]:
    """A log of audit_open, ``calls`` call/result pairs, audit_close; returns its lines."""
    async with open_audit_log(path, fsync=False) as log:
        for i in range(calls):
            run = RUN_A if i % 2 == 0 else RUN_B
            denied = i == 1
            log.record(
                "call",
                runId=run,
                toolCallId=f"call-{i}",
                tool="fs.write" if denied else "fs.read",
                argsDigest="sha256:" + hashlib.sha256(str(i).encode()).hexdigest(),
                argsSummary={"path": f"/workspace/{i}.txt"},
                decision="deny" if denied else "allow",
                errorCode="policy_denied" if denied else None,
                safeMessage="/workspace is read-only; writable: /workspace/out" if denied else None,
                peer={"pid": 10, "uid": 1000, "gid": 1000},
            )
            await log.append(
                "result",
                runId=run,
                toolCallId=f"call-{i}",
                tool="fs.read",
                errorCode="policy_denied" if denied else None,
                durationMs=1.25 * i,
                outputDigest=None if denied else "sha256:" + "0" * 64,
                outputBytes=None if denied else 100 + i,
            )
    return path.read_bytes().splitlines(keepends=True)


def only_problem(report: VerifyReport) -> tuple[int, ProblemKind, str]:
    assert not report.ok
    assert len(report.problems) == 1, report.render()
    problem = report.problems[0]
    return problem.line, problem.kind, problem.message


async def test_intact_log_verifies_and_says_how_many_entries_and_the_last_hash(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    lines = await make_log(path)
    report = verify_file(path)
    assert report.ok
    assert report.entries == len(lines) == 10
    last_hash = json.loads(lines[-1])["hash"]
    assert report.last_hash == last_hash
    assert report.render().startswith(f"OK: 10 entries, chain intact, last hash {last_hash}")
    assert report.problems == ()
    assert report.warnings == ()


def flip_each_byte(path: Path, masks: tuple[int, ...]) -> Iterator[tuple[int, int]]:
    """Flip each byte of ``path`` in place, one at a time, yielding while it is flipped.

    In place (pwrite), not by rewriting the file: truncate-and-rewrite makes ext4
    flush on close, which would make this test take seconds.
    """
    original = path.read_bytes()
    fd = os.open(path, os.O_RDWR)
    try:
        for i, byte in enumerate(original):
            for mask in masks:
                os.pwrite(fd, bytes([byte ^ mask]), i)
                yield i, mask
            os.pwrite(fd, bytes([byte]), i)
    finally:
        os.close(fd)
    assert path.read_bytes() == original


async def test_flipping_any_byte_of_the_log_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await make_log(path, calls=2)
    undetected = [flip for flip in flip_each_byte(path, (0x01, 0x80)) if verify_file(path).ok]
    assert undetected == []
    assert verify_file(path).ok


async def test_flipping_any_byte_of_the_head_file_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await make_log(path, calls=1)
    for i, _ in flip_each_byte(head_path(path), (0x01,)):
        report = verify_file(path)
        assert not report.ok, f"flip at head byte {i} went unnoticed"
        assert {p.kind for p in report.problems} <= {
            ProblemKind.HEAD,
            ProblemKind.TRUNCATED,
            ProblemKind.TAMPERED,
        }


async def test_edited_entry_is_reported_as_tampered_with_its_line_and_seq(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    lines = await make_log(path)
    lines[3] = lines[3].replace(b'"decision":"deny"', b'"decision":"allow"')
    path.write_bytes(b"".join(lines))
    line, kind, message = only_problem(verify_file(path))
    assert (line, kind) == (4, ProblemKind.TAMPERED)
    assert "line 4 (seq 4) was altered after it was written" in message


async def test_entry_replaced_with_a_freshly_hashed_forgery_breaks_the_next_link(
    tmp_path: Path,
) -> None:
    """An attacker who knows the recipe rehashes the edited line; the next prev exposes it."""
    path = tmp_path / "audit.jsonl"
    lines = await make_log(path)
    entry = json.loads(lines[3])
    body = lines[3][: lines[3].rindex(b',"hash":')] + b"}"
    forged, _ = seal(body.replace(b'"decision":"deny"', b'"decision":"allow"'))
    assert json.loads(forged)["hash"] != entry["hash"]
    lines[3] = forged
    path.write_bytes(b"".join(lines))
    line, kind, message = only_problem(verify_file(path))
    assert (line, kind) == (5, ProblemKind.MISSING)
    assert "removed or replaced" in message


async def test_deleted_middle_line_is_reported_as_missing_entries(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    lines = await make_log(path)
    del lines[4]
    path.write_bytes(b"".join(lines))
    line, kind, message = only_problem(verify_file(path))
    assert (line, kind) == (5, ProblemKind.MISSING)
    assert "holds seq 6 where seq 5 was expected: seq 5 (1 entries) were removed" in message


async def test_swapped_lines_are_reported_as_reordered(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    lines = await make_log(path)
    lines[3], lines[4] = lines[4], lines[3]
    path.write_bytes(b"".join(lines))
    line, kind, message = only_problem(verify_file(path))
    assert (line, kind) == (4, ProblemKind.REORDERED)
    assert "seq 4 is at line 5: entries were moved" in message


async def test_line_moved_back_is_reported_as_reordered(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    lines = await make_log(path)
    lines.insert(6, lines[2])
    path.write_bytes(b"".join(lines))
    line, kind, message = only_problem(verify_file(path))
    assert (line, kind) == (7, ProblemKind.REORDERED)
    assert "holds seq 3, but the chain had already reached seq 6" in message


async def test_duplicated_line_is_reported_as_duplicated(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    lines = await make_log(path)
    lines.insert(3, lines[2])
    path.write_bytes(b"".join(lines))
    line, kind, message = only_problem(verify_file(path))
    assert (line, kind) == (4, ProblemKind.DUPLICATED)
    assert message == "line 4 repeats line 3 (seq 3)"


async def test_line_that_is_not_an_entry_is_reported_as_broken(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    lines = await make_log(path)
    lines.insert(2, b"hello\n")
    path.write_bytes(b"".join(lines))
    line, kind, message = only_problem(verify_file(path))
    assert (line, kind) == (3, ProblemKind.BROKEN)
    assert "line 3 is not a valid audit entry" in message


def resealed(line: bytes, old: bytes, new: bytes) -> bytes:
    """``line`` with ``old`` replaced by ``new`` and sealed again, as one who knows the
    recipe would: its hash matches its bytes."""
    body = line[: line.rindex(b',"hash":')] + b"}"
    forged, _ = seal(body.replace(old, new))
    return forged


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        # Not UTF-8: msgspec raised UnicodeDecodeError here, a traceback of `audit verify`.
        (b'"path":"/workspace/', b'"path":"/w\xff/', "not UTF-8 text"),
        (b'"path":"/workspace/', b'"path":"\\ud800/', "lone UTF-16 surrogate"),
        (b'"outputBytes":100', b'"outputBytes":1e400', "out of range"),
    ],
)
async def test_a_resealed_line_that_is_no_text_or_no_number_is_broken_not_a_crash(
    tmp_path: Path, old: bytes, new: bytes, why: str
) -> None:
    path = tmp_path / "audit.jsonl"
    lines = await make_log(path)
    index = next(i for i, line in enumerate(lines) if old in line)
    lines[index] = resealed(lines[index], old, new)
    path.write_bytes(b"".join(lines))
    line, kind, message = only_problem(verify_file(path))
    assert (line, kind) == (index + 1, ProblemKind.BROKEN)
    assert why in message
    # And the table shows the line as broken (it raised there too, or printed a
    # string no terminal encoding can write).
    assert list(read_entries(path))[index] == {
        "line": index + 1,
        "broken": "not a JSON object (run 'gatewayd audit verify')",
    }


async def test_overlong_line_is_reported_as_broken(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    lines = await make_log(path)
    lines.insert(2, b"{" + b"x" * 100_000 + b"}\n")
    path.write_bytes(b"".join(lines))
    line, kind, message = only_problem(verify_file(path))
    assert (line, kind) == (3, ProblemKind.BROKEN)
    assert "longer than the 65536-byte maximum" in message


async def test_log_cut_mid_line_is_reported_torn_and_truncated(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    lines = await make_log(path)
    path.write_bytes(b"".join(lines[:-1]) + lines[-1][:40])
    report = verify_file(path)
    assert not report.ok
    assert [(p.line, p.kind) for p in report.problems] == [
        (10, ProblemKind.TORN),
        (11, ProblemKind.TRUNCATED),
    ]
    assert report.problems[0].message.startswith(
        "line 10 is torn: the daemon probably crashed while writing it"
    )
    assert report.entries == 9


async def test_torn_last_line_without_head_file_is_still_a_failure(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    lines = await make_log(path)
    head_path(path).unlink()
    path.write_bytes(b"".join(lines) + b'{"seq":11,"ti')
    line, kind, _ = only_problem(verify_file(path))
    assert (line, kind) == (11, ProblemKind.TORN)


async def test_trailing_entries_cut_off_are_found_through_the_head_file(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    lines = await make_log(path)
    path.write_bytes(b"".join(lines[:-3]))
    line, kind, message = only_problem(verify_file(path))
    assert (line, kind) == (8, ProblemKind.TRUNCATED)
    assert message == (
        "the log ends at seq 7, but its head file says seq 10 was written: "
        "3 entries were cut off the end"
    )
    assert "FAILED" in verify_file(path).render()


async def test_without_head_file_trailing_truncation_is_undetectable_and_warned_about(
    tmp_path: Path,
) -> None:
    """The documented limit: no head file, no way to know entries were cut off the end."""
    path = tmp_path / "audit.jsonl"
    lines = await make_log(path)
    head_path(path).unlink()
    path.write_bytes(b"".join(lines[:-3]))
    report = verify_file(path)
    assert report.ok
    assert [w.kind for w in report.warnings] == [ProblemKind.NO_HEAD]
    assert "could not be detected" in report.render()


async def test_whole_log_rewritten_consistently_is_caught_by_the_head_hash(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    await make_log(path)
    head = head_path(path).read_bytes()
    head_path(path).unlink()
    await make_log(path.with_name("other.jsonl"))  # a second, self-consistent history
    path.write_bytes(path.with_name("other.jsonl").read_bytes())
    head_path(path).write_bytes(head)
    line, kind, message = only_problem(verify_file(path))
    assert (line, kind) == (10, ProblemKind.TAMPERED)
    assert "the log was rewritten" in message


async def test_damaged_head_file_is_a_problem(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await make_log(path)
    head_path(path).write_bytes(b"not a head")
    line, kind, message = only_problem(verify_file(path))
    assert (line, kind) == (0, ProblemKind.HEAD)
    assert "is damaged" in message


async def test_recovered_torn_write_is_a_warning_not_a_failure(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await make_log(path, calls=1)
    with path.open("ab") as f:
        f.write(b'{"seq":5,"time":"2026')
    async with open_audit_log(path, fsync=False):
        pass
    report = verify_file(path)
    assert report.ok, report.render()
    assert [(w.line, w.kind) for w in report.warnings] == [(5, ProblemKind.RECOVERED)]
    assert "torn write the daemon recovered from at restart" in report.render()


async def test_torn_bytes_altered_after_recovery_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await make_log(path, calls=1)
    with path.open("ab") as f:
        f.write(b'{"seq":5,"time":"2026')
    async with open_audit_log(path, fsync=False):
        pass
    path.write_bytes(
        path.read_bytes().replace(b'{"seq":5,"time":"2026\n', b'{"seq":5,"time":"2027\n')
    )
    line, kind, message = only_problem(verify_file(path))
    assert (line, kind) == (6, ProblemKind.TAMPERED)
    assert "recovered at line 5" in message


async def test_empty_log_verifies_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b"")
    report = verify_file(path)
    assert report.ok
    assert ProblemKind.EMPTY in [w.kind for w in report.warnings]


def test_missing_log_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        verify_file(tmp_path / "nope.jsonl")


# --- show ---------------------------------------------------------------------------


async def test_table_lists_every_entry_with_readable_columns(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await make_log(path)
    table = format_table(read_entries(path)).splitlines()
    assert table[0].split() == [
        "SEQ",
        "TIME",
        "(UTC)",
        "RUN",
        "TOOL",
        "WHAT",
        "ERROR",
        "MS",
        "MESSAGE",
    ]
    assert table[-1] == "10 of 10 entries shown"
    rows = table[2:-1]
    assert len(rows) == 10
    assert "audit_open" in rows[0]
    denied_call = rows[3]
    assert denied_call.startswith("      4 2026-")
    for text in ("run-cccc3333", "fs.write", "deny", "policy_denied", "/workspace is read-only"):
        assert text in denied_call
    assert "run-cccc3333dddd4444" not in denied_call  # the run id is shortened
    assert "2.5" in rows[6]  # durationMs of the third result
    widths = {len(row.split("  ")[0]) for row in rows}
    assert len(widths) == 1  # fixed-width seq column


async def test_table_filters_denied_entries_and_runs_by_id_prefix(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await make_log(path)
    denied = format_table(read_entries(path), denied_only=True).splitlines()
    assert denied[-1] == "2 of 10 entries shown"
    assert all("policy_denied" in row for row in denied[2:-1])
    only_b = format_table(read_entries(path), run_id="run-cccc").splitlines()
    assert only_b[-1] == "4 of 10 entries shown"
    assert all("run-cccc3333" in row for row in only_b[2:-1])
    both = format_table(read_entries(path), run_id=RUN_B, denied_only=True)
    assert both.splitlines()[-1] == "2 of 10 entries shown"


async def test_table_shows_broken_lines_instead_of_hiding_them(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    lines = await make_log(path)
    lines.insert(1, b"garbage\n")
    path.write_bytes(b"".join(lines))
    read = list(read_entries(path))
    assert read[1] == {"line": 2, "broken": "not a JSON object (run 'gatewayd audit verify')"}
    table = format_table(read, run_id=RUN_A, denied_only=True)
    assert "BROKEN" in table
    assert "line 2: not a JSON object" in table


def test_table_escapes_control_characters_and_truncates_long_messages() -> None:
    entry: dict[str, Any] = {
        "seq": 1,
        "time": "2026-11-22T13:40:01.123456Z",
        "kind": "result",
        "runId": RUN_A,
        "tool": "fs.read",
        "errorCode": "tool_failed",
        "safeMessage": "\x1b[2J\x1b]0;pwned\x07" + "m" * 200,
    }
    table = format_table([entry])
    row = table.splitlines()[2]
    assert "\x1b" not in table
    assert "\x07" not in table
    assert "\\x1b[2J" in row
    assert row.endswith("…")
    assert "2026-11-22 13:40:01.123 " in row
