"""The reviewer's tools over a known log: filters (show), export, stats and a run's
result bundle, through `gatewayd audit ...` (cli.main) on a log the real writer made,
rotated into several segments."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd import cli
from gatewayd.audit import open_audit_log
from gatewayd.audit.chain import read_line
from gatewayd.audit.export import CSV_COLUMNS
from gatewayd.audit.query import read_file, read_log
from gatewayd.audit.segments import list_segments

RUN_A = "a" * 32
RUN_B = "b" * 32
RUN_C = "c" * 31 + "d"
BASE_S = 1_795_000_000  # 2026-11-18T07:06:40Z
PEER = {"pid": 10, "uid": 1000, "gid": 1000}


def _iso(seconds: int) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def _write_known_log(path: Path) -> None:
    tick = iter(range(10_000))

    def clock() -> int:
        return (BASE_S + next(tick)) * 1_000_000_000  # one second per entry

    async with open_audit_log(path, fsync=False, clock=clock, max_bytes=1500) as log:
        # seq 1 audit_open (t=0)

        def created(run: str, actor: str, tenant: str) -> None:
            log.record(
                "event",
                event="run_created",
                runId=run,
                detail={"actorId": actor, "tenantId": tenant, "policy": "p"},
            )

        def call(run: str, n: int, tool: str, decision: str, code: str | None) -> None:
            fields: dict[str, Any] = {
                "runId": run,
                "toolCallId": f"{run[:4]}-{n}",
                "tool": tool,
                "decision": decision,
                "peer": PEER,
            }
            if decision == "deny":
                fields |= {"errorCode": code, "safeMessage": "=HYPERLINK(evil) not allowed"}
            else:
                fields |= {"argsSummary": {"path": f"/workspace/{n}"}}
            log.record("call", **fields)
            result: dict[str, Any] = {"runId": run, "toolCallId": f"{run[:4]}-{n}", "tool": tool}
            if code is None:
                result |= {"durationMs": 1.5, "outputBytes": 10}
            else:
                result |= {"errorCode": code, "durationMs": 0.5}
            log.record("result", **result)

        created(RUN_A, "alice", "t1")  # t=1
        call(RUN_A, 1, "fs.read", "allow", None)  # t=2,3
        call(RUN_A, 2, "fs.write", "deny", "policy_denied")  # t=4,5
        call(RUN_A, 3, "fs.read", "allow", "tool_failed")  # t=6,7
        log.record("event", event="exec_started", runId=RUN_A, detail={"command": ["make"]})
        log.record(
            "event",
            event="exec_ended",
            runId=RUN_A,
            durationMs=12.0,
            detail={"exitCode": 0, "signal": None, "stdoutBytes": 5, "stderrBytes": 0},
        )  # t=9
        log.record(
            "event",
            event="run_ended",
            runId=RUN_A,
            detail={"reason": "command_exited", "calls": 3},
        )  # t=10
        created(RUN_B, "bob", "t2")  # t=11
        call(RUN_B, 1, "http.fetch", "allow", None)  # t=12,13
        call(RUN_B, 2, "fs.read", "deny", "policy_denied")  # t=14,15
        log.record("event", event="exec_started", runId=RUN_B, detail={"command": ["sleep"]})
        log.record(
            "event",
            event="exec_ended",
            runId=RUN_B,
            durationMs=5000.0,
            detail={"exitCode": None, "signal": 9, "errorCode": "timeout"},
        )  # t=17
        log.record(
            "event",
            event="run_ended",
            runId=RUN_B,
            detail={"reason": "max_runtime_exceeded"},
        )  # t=18
        log.record(
            "event",
            event="run_refused",
            errorCode="authz_denied",
            safeMessage="no grant",
            detail={"actorId": "mallory", "tenantId": "t1"},
        )  # t=19
        created(RUN_C, "alice", "t2")  # t=20
        call(RUN_C, 1, "fs.read", "allow", None)  # t=21,22
        await log.durable(log.last_seq)
    # then audit_close (t=23)


@pytest.fixture
def known_log(tmp_path: Path) -> Path:
    path = tmp_path / "audit" / "audit.jsonl"
    trio.run(_write_known_log, path)
    assert len(list_segments(path)) >= 3  # the tools read across segments
    return path


def gatewayd(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def label(entry: dict[str, Any]) -> str:
    """``kind:toolCallId`` for calls and results, ``event:run letter`` for events."""
    if entry["kind"] == "event":
        return f"{entry['event']}:{entry.get('runId', '-')[:1]}"
    return f"{entry['kind']}:{entry['toolCallId']}"


def by_seq(path: Path) -> dict[int, dict[str, Any]]:
    return {r.entry["seq"]: r.entry for r in read_log(path) if r.entry is not None}


def time_of(path: Path, wanted: str) -> str:
    return next(e["time"] for e in by_seq(path).values() if label(e) == wanted)


def shown(out: str, path: Path) -> list[str]:
    rows = out.splitlines()[2:-1]  # header, rule ... "N of M entries shown"
    entries = by_seq(path)
    return [label(entries[int(row.split()[0])]) for row in rows]


# --- show -----------------------------------------------------------------------------

A1, A2, A3 = "aaaa-1", "aaaa-2", "aaaa-3"
B1, B2, C1 = "bbbb-1", "bbbb-2", "cccc-1"


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            ["--run", RUN_B[:6]],
            [
                "run_created:b",
                f"call:{B1}",
                f"result:{B1}",
                f"call:{B2}",
                f"result:{B2}",
                "exec_started:b",
                "exec_ended:b",
                "run_ended:b",
            ],
        ),
        (
            ["--tool", "fs.*", "--kind", "call"],
            [f"call:{A1}", f"call:{A2}", f"call:{A3}", f"call:{B2}", f"call:{C1}"],
        ),
        (["--tool", "http.fetch"], [f"call:{B1}", f"result:{B1}"]),
        (["--decision", "deny"], [f"call:{A2}", f"call:{B2}"]),
        (
            ["--error-code", "policy_denied"],
            [f"call:{A2}", f"result:{A2}", f"call:{B2}", f"result:{B2}"],
        ),
        (["--error-code", "timeout"], ["exec_ended:b"]),  # exec_ended keeps it in detail
        (["--event", "run_ended"], ["run_ended:a", "run_ended:b"]),
        (
            ["--actor", "alice", "--kind", "result"],
            [f"result:{A1}", f"result:{A2}", f"result:{A3}", f"result:{C1}"],
        ),
        (
            ["--tenant", "t1", "--kind", "event"],  # run A's events and the refused run's
            ["run_created:a", "exec_started:a", "exec_ended:a", "run_ended:a", "run_refused:-"],
        ),
        (
            ["--actor", "alice", "--tenant", "t2"],
            ["run_created:c", f"call:{C1}", f"result:{C1}"],
        ),
        (["--denied", "--run", RUN_A], [f"call:{A2}", f"result:{A2}", f"result:{A3}"]),
    ],
)
def test_show_filters_keep_exactly_the_matching_entries_across_segments(
    known_log: Path, capsys: pytest.CaptureFixture[str], options: list[str], expected: list[str]
) -> None:
    status, out, _ = gatewayd(capsys, "audit", "show", *options, str(known_log))
    assert status == 0
    assert shown(out, known_log) == expected
    total = sum(1 for _ in read_log(known_log))
    assert out.splitlines()[-1] == f"{len(expected)} of {total} entries shown"


def test_show_time_range_is_since_inclusive_until_exclusive(
    known_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    since, until = time_of(known_log, "run_created:b"), time_of(known_log, f"call:{B2}")
    _, out, _ = gatewayd(
        capsys, "audit", "show", "--run", "b", "--since", since, "--until", until, str(known_log)
    )
    assert shown(out, known_log) == ["run_created:b", f"call:{B1}", f"result:{B1}"]


def test_show_with_a_time_zone_compares_in_utc(
    known_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    utc = time_of(known_log, "run_created:b")  # e.g. 2026-11-18T07:06:52.000000Z
    hour = int(utc[11:13])
    local = f"{utc[:11]}{hour + 1:02d}{utc[13:19]}+01:00"
    _, out, _ = gatewayd(capsys, "audit", "show", "--since", local, "--run", "b", str(known_log))
    assert shown(out, known_log)[0] == "run_created:b"


@pytest.mark.parametrize("bad", ["yesterday", "2026-13-01", "12:00"])
def test_a_bad_time_is_a_usage_error_that_shows_the_accepted_forms(
    known_log: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["audit", "show", "--since", bad, str(known_log)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"not an ISO 8601 time: {bad!r}" in err and "2026-11-22T13:40:00Z" in err


# --- export ---------------------------------------------------------------------------


def test_export_jsonl_writes_the_lines_exactly_as_written_so_hashes_still_check(
    known_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = gatewayd(capsys, "audit", "export", "--run", RUN_A, str(known_log))
    assert status == 0
    lines = out.encode().splitlines()
    raw = [r.raw for r in read_log(known_log) if r.entry and r.entry.get("runId") == RUN_A]
    assert lines == raw and len(lines) == 10
    for line in lines:
        read_line(line)  # raises if the bytes no longer match the hash


def test_export_csv_has_the_documented_columns_json_cells_and_defused_formulas(
    known_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = gatewayd(
        capsys, "audit", "export", "--format", "csv", "--kind", "call", str(known_log)
    )
    assert status == 0
    rows = list(csv.reader(io.StringIO(out)))
    assert tuple(rows[0]) == CSV_COLUMNS
    body = [dict(zip(CSV_COLUMNS, row, strict=True)) for row in rows[1:]]
    calls = [f"call:{r['toolCallId']}" for r in body]
    assert calls == [f"call:{i}" for i in (A1, A2, A3, B1, B2, C1)]
    assert json.loads(body[0]["peer"]) == PEER
    assert json.loads(body[0]["argsSummary"]) == {"path": "/workspace/1"}
    denied = body[1]
    assert denied["errorCode"] == "policy_denied"
    assert denied["safeMessage"] == "'=HYPERLINK(evil) not allowed"  # not a formula
    assert denied["segment"].startswith("audit.jsonl") and int(denied["line"]) >= 1


def test_export_keeps_a_broken_line_as_a_record_of_its_own(
    known_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    segment = list_segments(known_log)[0][1]
    segment.write_bytes(segment.read_bytes() + b"not json\n")
    _, out, _ = gatewayd(capsys, "audit", "export", "--kind", "result", str(known_log))
    broken = [json.loads(line) for line in out.splitlines() if "broken" in line]
    assert broken == [
        {
            "segment": segment.name,
            "line": broken[0]["line"],
            "broken": "not a JSON object (run 'gatewayd audit verify')",
        }
    ]


# --- stats ----------------------------------------------------------------------------


def test_stats_count_calls_denials_tools_and_runs_like_the_daemon_does(
    known_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = gatewayd(capsys, "audit", "stats", "--json", str(known_log))
    assert status == 0
    figures = json.loads(out)
    assert figures["calls"] == 6 and figures["allowed"] == 3 and figures["denied"] == 3
    assert figures["deniedByCode"] == {"policy_denied": 2, "tool_failed": 1}
    assert figures["decisions"] == {"allow": 4, "deny": 2}
    assert figures["topTools"] == [
        {"tool": "fs.read", "calls": 4, "denied": 2},
        {"tool": "fs.write", "calls": 1, "denied": 1},
        {"tool": "http.fetch", "calls": 1, "denied": 0},
    ]
    runs = {run["runId"]: run for run in figures["runs"]}
    a, b, c = runs[RUN_A], runs[RUN_B], runs[RUN_C]
    assert (a["actor"], a["tenant"], a["calls"], a["denied"]) == ("alice", "t1", 3, 2)
    took = _seconds(known_log, "run_created:a", "run_ended:a")
    assert a["durationMs"] == took * 1000 and a["endReason"] == "command_exited"
    assert (b["calls"], b["denied"], b["deniedByCode"]) == (2, 1, {"policy_denied": 1})
    took = _seconds(known_log, "run_created:b", "run_ended:b")
    assert b["durationMs"] == took * 1000 and b["endReason"] == "max_runtime_exceeded"
    assert c["durationMs"] is None and c["ended"] is None
    assert figures["events"]["segment_open"] == len(list_segments(known_log))


def _seconds(path: Path, start: str, end: str) -> float:
    import datetime as dt

    def parse(text: str) -> dt.datetime:
        return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ")

    return (parse(time_of(path, end)) - parse(time_of(path, start))).total_seconds()


def test_stats_text_and_filters(known_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = gatewayd(capsys, "audit", "stats", "--tenant", "t2", str(known_log))
    assert status == 0
    assert "calls 3: 2 allowed, 1 denied" in out
    assert "policy_denied" in out and "tool_failed" not in out
    assert RUN_A not in out and RUN_B in out and RUN_C in out
    assert "not ended in these entries" in out


# --- the run result bundle ---------------------------------------------------------------


def test_run_bundle_of_a_run_that_ended_cleanly_is_ok_with_its_entries_and_command_log(
    known_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = gatewayd(capsys, "audit", "run", RUN_A[:8], str(known_log))
    assert status == 0
    bundle = json.loads(out)
    assert bundle["runId"] == RUN_A and bundle["ok"] is True and "errorCode" not in bundle
    mine = [e for e in by_seq(known_log).values() if e.get("runId") == RUN_A]
    assert bundle["auditLog"] == mine and len(mine) == 10
    assert bundle["logs"].splitlines()[0].endswith('exec_started ["make"] (timeout None s)')
    assert "exec_ended exit 0, 12.0 ms, stdout 5 bytes, stderr 0 bytes" in bundle["logs"]


def test_run_bundle_maps_a_run_out_of_time_to_timeout(
    known_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = gatewayd(capsys, "audit", "run", RUN_B, str(known_log))
    bundle = json.loads(out)
    assert (bundle["ok"], bundle["errorCode"], bundle["ended"]) == (False, "timeout", True)


def test_run_bundle_of_a_live_run_is_not_ok_and_says_it_has_not_ended(
    known_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = gatewayd(capsys, "audit", "run", RUN_C, str(known_log))
    bundle = json.loads(out)
    assert (bundle["ok"], bundle["ended"], bundle["logs"]) == (False, False, "")
    assert "errorCode" not in bundle


@pytest.mark.parametrize(
    ("run", "message"),
    [
        ("f" * 32, "no run 'ffffffffffffffffffffffffffffffff' in it"),
        ("", "no run '' in it"),
    ],
)
def test_run_bundle_of_an_unknown_run_fails_with_how_to_list_runs(
    known_log: Path, capsys: pytest.CaptureFixture[str], run: str, message: str
) -> None:
    status, out, err = gatewayd(capsys, "audit", "run", run, str(known_log))
    assert (status, out) == (1, "")
    assert message in err and "gatewayd audit stats" in err


def test_run_bundle_of_an_ambiguous_prefix_lists_the_candidates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "audit.jsonl"

    async def two_runs() -> None:
        async with open_audit_log(path, fsync=False) as log:
            for run in ("ab" + "0" * 30, "ab" + "1" * 30):
                log.record("event", event="run_created", runId=run, detail={})

    trio.run(two_runs)
    status, _, err = gatewayd(capsys, "audit", "run", "ab", str(path))
    assert status == 1
    assert "2 runs start with 'ab'" in err and "give more of the id" in err


def test_read_log_since_a_seq_skips_the_closed_segments_wholly_before_it(
    known_log: Path,
) -> None:
    every = list(read_log(known_log))
    seqs = [r.entry["seq"] for r in every if r.entry is not None]
    last = seqs[-1]
    recent = [r.entry["seq"] for r in read_log(known_log, since_seq=last) if r.entry]
    # Only the active file is read: it starts at or before the last seq, and every seq
    # from there on is there, in order.
    assert recent == seqs[seqs.index(recent[0]) :] and last in recent
    assert len(recent) < len(seqs)
    # A seq at or before the first, or none, reads everything.
    assert [r.raw for r in read_log(known_log, since_seq=1)] == [r.raw for r in every]
    assert [r.raw for r in read_log(known_log, since_seq=0)] == [r.raw for r in every]
    # Each segment is read from its start: a seq inside the second segment starts there.
    segments = list_segments(known_log)
    second_first = next(r.entry["seq"] for r in read_file(segments[1][1]) if r.entry is not None)
    from_second = [r.entry["seq"] for r in read_log(known_log, since_seq=second_first) if r.entry]
    assert from_second[0] == second_first and from_second == seqs[seqs.index(second_first) :]
