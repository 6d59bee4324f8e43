"""sandbox.query and sandbox.usage: what a run may do and what it has used, asked through
the real chokepoint (an in-process daemon on real sockets), and from inside a real
sandbox with cogni-tool. The query's agreement with the file tools on every path of the
traversal corpus is tests/integration/test_query_agreement.py's."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from gatewayd.runs import Run
from gatewayd.tools.query import MAX_LISTED
from tests.conftest import Gateway, frame, raw_exchange, request
from tests.integration.test_run_sandbox import Sandboxed, _unavailable, base, sb  # noqa: F401

QUERY_POLICY = """
version: 1
name: query
tools:
  allow: ["fs.*", "sandbox.query", "sandbox.usage", time.now]
filesystem:
  paths:
    workspace: {root: ., mode: rw, suffixes: [.md, .txt], max_file_bytes: 1000}
    docs: {root: docs, mode: ro}
network:
  allow_domains: [api.example.com, "*.pypi.org"]
model_access:
  max_requests: 7
  max_tokens: 900
env:
  allow: [LANG_EXTRA]
workspace: {mode: overlay, on_end: discard}
limits:
  call_timeout_s: 5
  calls_per_second: 100000
  burst: 100000
"""


async def call(run: Run, tool: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    [resp] = await raw_exchange(run.socket_path, frame(request(run, tool, args)))
    return resp


async def value(run: Run, tool: str, args: dict[str, Any] | None = None) -> Any:
    resp = await call(run, tool, args)
    assert resp["ok"], resp
    return resp["value"]


# --- sandbox.query ---------------------------------------------------------------


async def test_can_read_and_can_write_answer_with_the_grant_the_type_and_the_tools(
    gateway: Gateway, workspace: Path
) -> None:
    run = await gateway.create_run(workspace, QUERY_POLICY)
    answer = await value(run, "sandbox.query", {"op": "can_read", "path": "notes.md"})
    assert answer == {
        "op": "can_read",
        "allowed": True,
        "path": "/workspace/notes.md",
        "type": "file",
        "grant": {"path": "/workspace", "mode": "rw"},
        "tools": ["fs.list", "fs.read", "fs.stat"],
    }
    docs = await value(run, "sandbox.query", {"op": "can_write", "path": "docs/guide.md"})
    assert docs["allowed"] is False
    assert docs["errorCode"] == "policy_denied"
    assert docs["reason"].startswith("Cannot write to 'docs/guide.md': path is read-only.")
    assert "Writable paths: /workspace (except /workspace/docs)" in docs["reason"]
    new = await value(run, "sandbox.query", {"op": "can_write", "path": "a/b/new.md"})
    assert new["allowed"] is True and new["type"] is None and "note" not in new
    assert new["tools"] == ["fs.edit", "fs.write"]
    missing = await value(run, "sandbox.query", {"op": "can_read", "path": "gone.md"})
    assert missing["allowed"] is True and missing["type"] is None
    assert missing["note"] == "'/workspace/gone.md' does not exist; fs.list shows what is there"


async def test_can_write_says_when_a_file_is_in_the_way_of_the_directories_to_make(
    gateway: Gateway, workspace: Path
) -> None:
    run = await gateway.create_run(workspace, QUERY_POLICY)
    deep = "notes.md/" + "/".join(["d"] * 40) + "/x.md"
    answer = await value(run, "sandbox.query", {"op": "can_write", "path": deep})
    assert answer["allowed"] is True  # not refused: the write fails on the file instead
    assert (
        "'/workspace/notes.md' already exists as something that is not a directory"
        in (answer["note"])
    )
    written = await call(run, "fs.write", {"path": deep, "content": "x"})
    assert written["errorCode"] == "tool_failed"


async def test_resolve_gives_the_normalized_path_and_where_a_symlink_inside_leads(
    gateway: Gateway, workspace: Path
) -> None:
    (workspace / "docs" / "link.md").symlink_to("guide.md")
    (workspace / "out.md").symlink_to("/etc/passwd")
    run = await gateway.create_run(workspace, QUERY_POLICY)
    answer = await value(run, "sandbox.query", {"op": "resolve", "path": "x/../docs/link.md"})
    assert answer["allowed"] is True
    assert answer["path"] == "/workspace/docs/link.md"
    assert answer["grant"] == {"path": "/workspace/docs", "mode": "ro"}
    assert answer["target"] == "/workspace/docs/guide.md"
    outside = await value(run, "sandbox.query", {"op": "resolve", "path": "out.md"})
    assert outside["target"] is None
    # The workspace holds another grant (docs), so no symlink is followed beneath it.
    assert outside["targetRefused"]["errorCode"] == "policy_denied"
    assert "is a symlink" in outside["targetRefused"]["reason"]
    assert str(workspace) not in json.dumps(outside)  # never a host path
    refused = await value(run, "sandbox.query", {"op": "resolve", "path": "../../etc"})
    assert refused["allowed"] is False
    assert refused["reason"].startswith("Cannot read '../../etc': path is outside the readable")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"op": "can_read"}, "op 'can_read' asks about a path: add 'path'"),
        ({"op": "resolve"}, "op 'resolve' asks about a path: add 'path'"),
        ({"op": "boundaries", "path": "x.md"}, "op 'boundaries' takes no path"),
        ({"op": "can_delete", "path": "x.md"}, "Invalid enum value 'can_delete' - at `$.op`"),
        ({"op": "can_read", "path": "x.md", "extra": 1}, "unknown field `extra`"),
        ({"op": "can_read", "path": ""}, "Expected `str` of length >= 1"),
    ],
)
async def test_malformed_queries_are_invalid_args_saying_what_to_send(
    gateway: Gateway, workspace: Path, args: dict[str, Any], message: str
) -> None:
    run = await gateway.create_run(workspace, QUERY_POLICY)
    resp = await call(run, "sandbox.query", args)
    assert resp["errorCode"] == "invalid_args"
    assert message in resp["safeMessage"], resp["safeMessage"]


async def test_the_query_is_a_tool_like_any_other_refused_when_the_policy_lacks_it(
    gateway: Gateway, workspace: Path
) -> None:
    run = await gateway.create_run(workspace, QUERY_POLICY.replace('"sandbox.query", ', ""))
    resp = await call(run, "sandbox.query", {"op": "boundaries"})
    assert resp["errorCode"] == "policy_denied"
    assert "tool 'sandbox.query' is not allowed for this run" in resp["safeMessage"]
    entries = await gateway.audit_entries()
    calls = [e for e in entries if e["kind"] == "call" and e["tool"] == "sandbox.query"]
    assert [e["decision"] for e in calls] == ["deny"]


async def test_boundaries_tell_paths_network_models_tools_limits_and_workspace(
    gateway: Gateway, workspace: Path
) -> None:
    run = await gateway.create_run(workspace, QUERY_POLICY)
    answer = await value(run, "sandbox.query", {"op": "boundaries"})
    assert answer["paths"] == [
        {
            "path": "/workspace",
            "mode": "rw",
            "suffixes": [".md", ".txt"],
            "maxFileBytes": 1000,
        },
        {"path": "/workspace/docs", "mode": "ro", "suffixes": None, "maxFileBytes": None},
    ]
    assert answer["tools"] == [
        "fs.edit",
        "fs.list",
        "fs.read",
        "fs.stat",
        "fs.write",
        "sandbox.query",
        "sandbox.usage",
        "time.now",
    ]
    assert answer["network"]["allowDomains"] == ["api.example.com", "*.pypi.org"]
    assert answer["network"]["packageManagers"] == []
    assert answer["network"]["proxy"] is False
    assert answer["models"] == {"aliases": [], "maxRequests": 7, "maxTokens": 900}
    assert answer["env"] == ["LANG_EXTRA"]
    assert answer["limits"]["callTimeoutSec"] == 5
    assert answer["limits"]["maxRuntimeSec"] == 3600
    assert answer["sandbox"]["osSandbox"] is False
    assert answer["sandbox"]["degraded"]
    assert answer["workspace"] == {"mode": "overlay", "onEnd": "discard"}
    assert answer["truncated"] == []
    assert str(workspace) not in json.dumps(answer)  # visible paths only


async def test_boundaries_of_a_huge_policy_stay_bounded_and_say_what_was_cut(
    gateway: Gateway, workspace: Path
) -> None:
    count = MAX_LISTED + 50
    for index in range(count):
        (workspace / f"d{index}").mkdir()
    paths = "".join(f"    d{i}: {{root: d{i}, mode: ro}}\n" for i in range(count))
    domains = ", ".join(f"h{i}.example.com" for i in range(count))
    policy = (
        QUERY_POLICY.replace("    docs: {root: docs, mode: ro}\n", paths)
        .replace('[api.example.com, "*.pypi.org"]', f"[{domains}]")
        .replace("[LANG_EXTRA]", "[" + ", ".join(f"E{i}" for i in range(count)) + "]")
    )
    run = await gateway.create_run(workspace, policy)
    resp = await call(run, "sandbox.query", {"op": "boundaries"})
    answer = resp["value"]
    assert len(answer["paths"]) == MAX_LISTED
    assert len(answer["network"]["allowDomains"]) == MAX_LISTED
    assert len(answer["env"]) == MAX_LISTED
    assert answer["truncated"] == ["paths", "network.allowDomains", "env"]
    assert len(json.dumps(answer)) < 64 << 10


async def test_queries_leave_no_descriptor_open_whatever_they_meet(
    gateway: Gateway, workspace: Path
) -> None:
    (workspace / "link.md").symlink_to("/etc/passwd")
    (workspace / "notes-dir.md").mkdir()
    os.mkfifo(workspace / "pipe.md")
    run = await gateway.create_run(workspace, QUERY_POLICY)
    asked = [
        {"op": op, "path": path}
        for op in ("can_read", "can_write", "resolve")
        for path in (
            "notes.md",
            "link.md",
            "notes-dir.md",
            "pipe.md",
            "gone.md",
            "notes.md/x/y.md",
            "a/b/c/d.md",
            "docs",
            "../x",
            "",
        )
    ]

    async def ask_all() -> None:
        for args in asked:
            await call(run, "sandbox.query", args)

    await ask_all()  # the worker threads and the audit log's files are open from here on
    before = descriptors_but_the_audit_tree()
    for _ in range(3):
        await ask_all()
    assert descriptors_but_the_audit_tree() == before


def descriptors_but_the_audit_tree() -> int:
    """This process's open descriptors, less the audit log's Merkle tree levels: one
    more opens each time the log's size passes a power of two, whatever the calls do."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own, closed by now
            if ".tree/level-" in os.readlink(f"/proc/self/fd/{fd}"):
                continue
            count += 1
    return count


# --- sandbox.usage ---------------------------------------------------------------


async def test_usage_counts_the_runs_calls_by_outcome_and_tells_time_and_model_budget(
    gateway: Gateway, workspace: Path
) -> None:
    run = await gateway.create_run(workspace, QUERY_POLICY)
    await value(run, "time.now")
    assert (await call(run, "fs.read", {"path": "/etc/passwd"}))["errorCode"] == "policy_denied"
    assert (await call(run, "fs.read", {"path": "gone.md"}))["errorCode"] == "tool_failed"
    assert (await call(run, "http.fetch", {"url": "x"}))["errorCode"] == "policy_denied"
    usage = await value(run, "sandbox.usage")
    assert usage["calls"] == {
        "total": 4,
        "allowed": 1,
        "denied": 3,
        "deniedByCode": {"policy_denied": 2, "tool_failed": 1},
    }
    time = usage["time"]
    assert time["maxRuntimeSec"] == 3600
    assert 0 <= time["elapsedSec"] < 60
    assert 3540 < time["remainingSec"] <= 3600
    assert usage["model"] == {
        "requests": 0,
        "maxRequests": 7,
        "requestsLeft": 7,
        "tokens": 0,
        "maxTokens": 900,
        "tokensLeft": 900,
    }
    again = await value(run, "sandbox.usage")
    assert again["calls"]["total"] == 5  # the first usage call, answered, counts now
    assert again["time"]["remainingSec"] <= time["remainingSec"]


async def test_usage_takes_no_arguments(gateway: Gateway, workspace: Path) -> None:
    run = await gateway.create_run(workspace, QUERY_POLICY)
    resp = await call(run, "sandbox.usage", {"calls": 1})
    assert resp["errorCode"] == "invalid_args"
    assert "unknown field `calls`" in resp["safeMessage"]


# --- from inside a real sandbox ----------------------------------------------------

SANDBOX_POLICY = """
version: 1
name: query-sandbox
tools:
  allow: [fs.read, fs.write, sandbox.query, sandbox.usage]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
"""


@pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))
async def test_an_agent_in_the_sandbox_asks_first_and_the_answer_holds(sb: Sandboxed) -> None:  # noqa: F811
    run = await sb.run(SANDBOX_POLICY)
    script = (
        'cogni-tool exec sandbox.query \'{"op": "can_read", "path": "notes.md"}\''
        ' && cogni-tool exec fs.read \'{"path": "notes.md"}\''
        ' && cogni-tool exec sandbox.query \'{"op": "can_write", "path": "/etc/x"}\''
        ' && cogni-tool exec sandbox.query \'{"op": "boundaries"}\''
        " && cogni-tool exec sandbox.usage"
    )
    result = await sb.daemon.runs.exec(run.run_id, ["sh", "-c", script])
    assert result.exitCode == 0, result.stderr
    readable, read, writable, bounds, usage = map(json.loads, result.stdout.decode().splitlines())
    assert readable["allowed"] is True and readable["type"] == "file"
    assert read["content"] == "hello\n"
    assert writable["allowed"] is False and writable["errorCode"] == "policy_denied"
    assert "Writable paths: /workspace" in writable["reason"]
    assert bounds["sandbox"]["osSandbox"] is True
    assert bounds["tools"] == ["fs.read", "fs.write", "sandbox.query", "sandbox.usage"]
    assert usage["calls"]["total"] == 4
