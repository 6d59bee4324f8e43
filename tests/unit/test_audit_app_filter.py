"""`gatewayd audit show|export|stats|tail --app ID`: everything a log holds about one app,
through cli.main, on a log the real writer made and rotated into several segments.

An app's invocation is a child run of its own: the caller's ``app_invoked`` entry names
it (``childRunId``) before the child's ``run_created`` (``detail.app``) is written, and
the child's calls are ordinary call/result pairs whose review carries the app's id. A
second app whose id starts with the first one's, and a skipped folder that only looks
like it, must never be shown.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd import cli
from gatewayd.audit import open_audit_log
from gatewayd.audit.query import (
    EntryFilter,
    Record,
    RunFacts,
    index_runs,
    read_log,
    run_index,
)
from gatewayd.audit.segments import list_segments

CALLER = "c" * 32
CHILD = "1" * 32  # note-taker, named by app_invoked and by its run_created
OTHER = "2" * 32  # note-taker-2: an id that starts with note-taker's
LATE = "3" * 32  # note-taker, whose run_created does not say so (app_invoked does)
ORPHAN = "4" * 32  # note-taker, whose app_invoked is not in the log (run_created says so)
PEER = {"pid": 10, "uid": 1000, "gid": 1000}
BASE_S = 1_795_000_000


async def _write_app_log(path: Path) -> None:
    tick = iter(range(10_000))

    def clock() -> int:
        return (BASE_S + next(tick)) * 1_000_000_000  # one second per entry

    async with open_audit_log(path, fsync=False, clock=clock, max_bytes=1500) as log:

        def event(name: str, run: str | None, **detail: Any) -> None:
            fields: dict[str, Any] = {"event": name, "detail": detail}
            if run is not None:
                fields["runId"] = run
            log.record("event", **fields)

        def call(run: str, n: int, tool: str, *, app: str | None, deny: bool = False) -> None:
            fields: dict[str, Any] = {
                "runId": run,
                "toolCallId": f"{run[:2]}-{n}",
                "tool": tool,
                "decision": "deny" if deny else "allow",
                "peer": PEER,
            }
            if app is not None:
                verdict = "deny" if deny else "allow"
                fields["review"] = {"app": app, "verdict": verdict, "source": "model"}
            if deny:
                fields |= {"errorCode": "review_denied", "safeMessage": "a rule denies it"}
            log.record("call", **fields)
            result: dict[str, Any] = {"runId": run, "toolCallId": f"{run[:2]}-{n}", "tool": tool}
            result |= {"errorCode": "review_denied"} if deny else {"outputBytes": 3}
            log.record("result", **result, durationMs=1.0)

        def invoke(app: str, child: str, n: int, *, says_app: bool = True) -> None:
            tool = "app_" + app.replace("-", "_")
            log.record(
                "call",
                runId=CALLER,
                toolCallId=f"cc-{n}",
                tool=tool,
                decision="allow",
                peer=PEER,
            )
            event(
                "app_invoked",
                CALLER,
                app=app,
                tool=tool,
                callerRunId=CALLER,
                childRunId=child,
                promptDigest="sha256:" + "0" * 64,
                promptBytes=12,
                attachments=[],
            )
            created = {"parentRunId": CALLER, "actorId": "alice"}
            event("run_created", child, **({"app": app} | created if says_app else created))
            call(child, 1, "fs.write", app=app)
            call(child, 2, "fs.write", app=app, deny=True)
            event("run_ended", child, reason="app_answered")
            event(
                "app_result",
                CALLER,
                app=app,
                callerRunId=CALLER,
                childRunId=child,
                ok=True,
                errorCode=None,
                turns=2,
                toolCalls=2,
                tokens=100,
                answerDigest="sha256:" + "1" * 64,
                changed=["data/n.md"],
            )
            log.record("result", runId=CALLER, toolCallId=f"cc-{n}", tool=tool, outputBytes=5)

        event("run_created", CALLER, actorId="alice", tenantId="t1")
        event("app_skipped", CALLER, file="apps/note-taker/APP.md", line=3, field="title")
        event("app_skipped", CALLER, file="apps/note-taker-2", line=None, field="name")
        event("app_skipped", CALLER, file="apps/note-takerx/APP.md", line=1, field=None)
        event("app_installed", CALLER, app="note-taker", tool="app_note_taker", replaced=False)
        event("app_installed", CALLER, app="note-taker-2", tool="app_note_taker_2")
        invoke("note-taker", CHILD, 1)
        invoke("note-taker-2", OTHER, 2)
        call(CALLER, 3, "fs.read", app=None)
        event("app_rule_changed", None, app="note-taker", action="add_deny", rule="No exec")
        invoke("note-taker", LATE, 4, says_app=False)
        # A child run whose app_invoked is not in the log (older segments deleted):
        # its run_created still names the app.
        event("run_created", ORPHAN, app="note-taker", parentRunId=CALLER)
        call(ORPHAN, 1, "fs.list", app="note-taker")
        await log.durable(log.last_seq)


@pytest.fixture(scope="module")
def written_app_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The log, written once for the module's tests, which only read it."""
    path = tmp_path_factory.mktemp("app-log") / "audit" / "audit.jsonl"
    trio.run(_write_app_log, path)
    assert len(list_segments(path)) >= 3  # the filter reads across segments
    return path


@pytest.fixture
def app_log(written_app_log: Path) -> Iterator[Path]:
    """The shared log, and a check that the test left it as it found it."""

    def contents() -> dict[str, bytes]:
        files = (p for p in written_app_log.parent.rglob("*") if p.is_file())
        return {str(p): p.read_bytes() for p in files}

    before = contents()
    yield written_app_log
    assert contents() == before, "a test changed the log the others read"


def gatewayd(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def entries(path: Path) -> dict[int, dict[str, Any]]:
    return {r.entry["seq"]: r.entry for r in read_log(path) if r.entry is not None}


def label(entry: dict[str, Any]) -> str:
    run = str(entry.get("runId", "-"))[:1]
    if entry["kind"] == "event":
        detail = entry.get("detail") or {}
        what = detail.get("app") or detail.get("file") or ""
        return f"{entry['event']}:{run}:{what}" if what else f"{entry['event']}:{run}"
    return f"{entry['kind']}:{entry['toolCallId']}:{entry['tool']}"


def shown(out: str, path: Path) -> list[str]:
    by_seq = entries(path)
    return [label(by_seq[int(row.split()[0])]) for row in out.splitlines()[2:-1]]


def app_seqs(path: Path) -> set[int]:
    """The seqs of note-taker's entries, found by their labels (unique but for the
    app_result events, which are all note-taker's)."""
    wanted = set(NOTE_TAKER)
    return {seq for seq, entry in entries(path).items() if label(entry) in wanted}


def invocation(app: str, child: str, n: int, *, says_app: bool = True) -> list[str]:
    tool = "app_" + app.replace("-", "_")
    c = child[:1]
    return [
        f"call:cc-{n}:{tool}",
        f"app_invoked:c:{app}",
        f"run_created:{c}:{app}" if says_app else f"run_created:{c}",
        f"call:{child[:2]}-1:fs.write",
        f"result:{child[:2]}-1:fs.write",
        f"call:{child[:2]}-2:fs.write",
        f"result:{child[:2]}-2:fs.write",
        f"run_ended:{c}",
        f"app_result:c:{app}",
        f"result:cc-{n}:{tool}",
    ]


NOTE_TAKER = [
    "app_skipped:c:apps/note-taker/APP.md",
    "app_installed:c:note-taker",
    *invocation("note-taker", CHILD, 1),
    "app_rule_changed:-:note-taker",
    *invocation("note-taker", LATE, 4, says_app=False),
    "run_created:4:note-taker",
    "call:44-1:fs.list",
    "result:44-1:fs.list",
]


def test_show_app_keeps_its_events_its_tool_calls_and_every_entry_of_its_child_runs(
    app_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = gatewayd(capsys, "audit", "show", "--app", "note-taker", str(app_log))
    assert status == 0
    assert shown(out, app_log) == NOTE_TAKER
    total = sum(1 for _ in read_log(app_log))
    assert out.splitlines()[-1] == f"{len(NOTE_TAKER)} of {total} entries shown"


def test_an_app_whose_id_starts_with_another_is_its_own(
    app_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = gatewayd(capsys, "audit", "show", "--app", "note-taker-2", str(app_log))
    assert shown(out, app_log) == [
        "app_skipped:c:apps/note-taker-2",
        "app_installed:c:note-taker-2",
        *invocation("note-taker-2", OTHER, 2),
    ]
    # An id is matched whole, never as a prefix: "note" is no app of this log.
    _, out, _ = gatewayd(capsys, "audit", "show", "--app", "note", str(app_log))
    assert shown(out, app_log) == []


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--denied"], [e for e in NOTE_TAKER if e.endswith("-2:fs.write")]),
        (["--run", LATE[:6]], invocation("note-taker", LATE, 4, says_app=False)[2:-2]),
        (["--run", CALLER], [e for e in NOTE_TAKER if e.split(":")[1] in ("c", "cc-1", "cc-4")]),
        (["--kind", "event", "--event", "app_result"], ["app_result:c:note-taker"] * 2),
        (["--tool", "fs.list"], ["call:44-1:fs.list", "result:44-1:fs.list"]),
        (
            ["--actor", "alice", "--kind", "event", "--event", "run_created"],
            ["run_created:1:note-taker", "run_created:3"],  # the orphan's names no actor
        ),
    ],
)
def test_app_combines_with_the_other_filters_by_and(
    app_log: Path, capsys: pytest.CaptureFixture[str], options: list[str], expected: list[str]
) -> None:
    _, out, _ = gatewayd(capsys, "audit", "show", "--app", "note-taker", *options, str(app_log))
    assert shown(out, app_log) == expected


def test_app_with_a_time_range(app_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    by_label = {label(e): e["time"] for e in entries(app_log).values()}
    since, until = by_label["app_rule_changed:-:note-taker"], by_label["run_created:4:note-taker"]
    _, out, _ = gatewayd(
        capsys,
        "audit",
        "show",
        "--app",
        "note-taker",
        "--since",
        since,
        "--until",
        until,
        str(app_log),
    )
    assert (
        shown(out, app_log) == NOTE_TAKER[NOTE_TAKER.index("app_rule_changed:-:note-taker") :][:-3]
    )


def test_export_and_stats_and_tail_take_the_same_filter(
    app_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = gatewayd(capsys, "audit", "export", "--app", "note-taker", str(app_log))
    assert status == 0
    exported = [json.loads(line) for line in out.splitlines()]
    assert [label(e) for e in exported] == NOTE_TAKER
    raw = {r.entry["seq"]: r.raw for r in read_log(app_log) if r.entry is not None}
    assert out.encode().splitlines() == [raw[e["seq"]] for e in exported]  # as written

    status, out, _ = gatewayd(
        capsys, "audit", "stats", "--json", "--app", "note-taker", str(app_log)
    )
    figures = json.loads(out)
    assert status == 0
    # A call is a result entry: the caller's two calls of app_note_taker, and the
    # children's 2 + 2 + 1, of which one per invocation was denied by its review.
    assert (figures["calls"], figures["denied"]) == (7, 2)
    assert {run["runId"] for run in figures["runs"]} == {CALLER, CHILD, LATE, ORPHAN}

    status, out, _ = gatewayd(
        capsys, "audit", "tail", "-n", "5", "--json", "--app", "note-taker", str(app_log)
    )
    assert status == 0
    # Of the last 5 lines (the orphan's entries among them, audit_close, perhaps a
    # segment_open), only the app's are printed.
    last = [r.entry for r in read_log(app_log)][-5:]
    expected = [label(e) for e in last if e is not None and e["seq"] in app_seqs(app_log)]
    assert expected[-3:] == NOTE_TAKER[-3:] and len(expected) < 5
    assert [label(json.loads(line)) for line in out.splitlines()] == expected


BAD_IDS = [
    # (given, what the message says besides the rule)
    ("Note-Taker", "is not an app id (did you mean 'note-taker'?)"),
    ("note_taker", "is not an app id (did you mean 'note-taker'?)"),
    ("app_note_taker", "is not an app id (did you mean 'app-note-taker'?)"),
    ("../note-taker", "is not an app id:"),
    ("apps/note-taker", "is not an app id:"),
    ("note-", "is not an app id (did you mean 'note'?)"),
    ("1note", "is not an app id:"),
    ("", "is not an app id:"),
    ("a" * 64, "has 64 characters"),
    ("note-taker\x1b[2J", "is not an app id"),
]


@pytest.mark.parametrize("command", ["show", "export", "stats", "tail"])
@pytest.mark.parametrize(("bad", "says"), BAD_IDS)
def test_a_malformed_app_id_is_a_usage_error_that_says_what_an_id_is(
    app_log: Path, capsys: pytest.CaptureFixture[str], command: str, bad: str, says: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["audit", command, "--app", bad, str(app_log)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --app:" in err and says in err
    assert "an app id is 1-63 lowercase letters, digits and single hyphens" in err
    assert "\x1b" not in err  # quoted with repr: a bad id cannot drive the terminal


def test_an_app_invoked_before_its_run_created_names_the_child_either_way() -> None:
    # tail -f indexes each entry as it comes: the app survives a run_created that
    # does not name it, whichever of the two comes first.
    runs: dict[str, RunFacts] = {}
    invoked: dict[str, Any] = {"kind": "event", "event": "app_invoked", "runId": CALLER}
    invoked["detail"] = {"app": "note-taker", "childRunId": LATE}
    created: dict[str, Any] = {"kind": "event", "event": "run_created", "runId": LATE}
    created["detail"] = {"actorId": "alice", "parentRunId": CALLER}
    for entry in (invoked, created):
        index_runs(runs, [_record(entry)])
    assert runs[LATE].app == "note-taker" and runs[LATE].actor == "alice"
    reverse = run_index([_record(created), _record(invoked)])
    assert reverse[LATE] == runs[LATE]
    keep = EntryFilter(app="note-taker")
    assert keep.needs_runs
    assert keep.keeps({"kind": "result", "runId": LATE, "tool": "fs.read"}, runs)
    assert not keep.keeps({"kind": "result", "runId": CALLER, "tool": "fs.read"}, runs)


def _record(entry: dict[str, Any]) -> Record:
    return Record("audit.jsonl", 1, json.dumps(entry).encode(), entry)
