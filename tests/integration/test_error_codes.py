"""Every error code this slice can produce, over a real unix socket, from the real
cogni-tool client (or raw bytes where the client would refuse to send them), each
checked for its code, a helpful message, and its audit entries.

review_denied is the rule review's: tests/integration/test_review.py; approval_denied's
operator, timeout and restart paths: tests/integration/test_approvals*.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from cogni_tool.client import Client, ToolError
from gatewayd.errors import ToolFailed
from gatewayd.tools import builtin_tools
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.registry import ToolContext, ToolRegistry
from tests.conftest import Gateway, frame, make_gateway, raw_exchange, read_frame, request


async def call(
    run: Any, tool: str, args: dict[str, Any] | None = None, run_id: str | None = None
) -> Any:
    """One call through the real client, in a thread (it is a blocking client)."""

    def go() -> Any:
        with Client(str(run.socket_path), run_id or run.run_id) as client:
            return client.call(tool, args or {})

    return await trio.to_thread.run_sync(go)


async def expect_error(
    run: Any, tool: str, args: dict[str, Any] | None = None, **kw: Any
) -> ToolError:
    with pytest.raises(ToolError) as info:
        await call(run, tool, args, **kw)
    return info.value


async def audited(gw: Gateway, code: str) -> list[dict[str, Any]]:
    return [e for e in (await gw.audit_entries()) if e.get("errorCode") == code]


async def test_bad_request_for_malformed_json_is_answered_and_audited(
    gateway: Gateway, workspace: Path
) -> None:
    run = await gateway.create_run(workspace)
    [resp] = await raw_exchange(run.socket_path, frame(b"{not json"))
    assert resp["ok"] is False and resp["errorCode"] == "bad_request"
    assert "not valid JSON" in resp["safeMessage"]
    assert {e["kind"] for e in await audited(gateway, "bad_request")} == {"call", "result"}


async def test_bad_request_keeps_the_connection_and_echoes_the_call_id(
    gateway: Gateway, workspace: Path
) -> None:
    run = await gateway.create_run(workspace)
    bad = {"v": 1, "runId": run.run_id, "toolCallId": "x1", "tool": "time.now", "args": []}
    good = request(run, "time.now", tcid="x2")
    first, second = await raw_exchange(run.socket_path, frame(bad) + frame(good), expect=2)
    assert first["toolCallId"] == "x1" and first["errorCode"] == "bad_request"
    assert "args" in first["safeMessage"]
    assert second["toolCallId"] == "x2" and second["ok"] is True


async def test_too_large_frame_gets_error_and_connection_closes(
    gateway: Gateway, workspace: Path
) -> None:
    run = await gateway.create_run(workspace)
    header_only = (2 << 20).to_bytes(4, "big")
    responses = await raw_exchange(run.socket_path, header_only + b"x" * 100, expect=2)
    assert len(responses) == 1, "the server must close after too_large"
    [resp] = responses
    assert resp["errorCode"] == "too_large" and resp["toolCallId"] is None
    assert str(1 << 20) in resp["safeMessage"]
    assert await audited(gateway, "too_large")


async def test_run_mismatch_for_another_runs_id_is_audited(
    gateway: Gateway, workspace: Path
) -> None:
    run = await gateway.create_run(workspace)
    other = await gateway.create_run(workspace)
    err = await expect_error(run, "time.now", run_id=other.run_id)
    assert err.code == "run_mismatch"
    assert "COGNI_RUN_ID" in str(err)
    entries = await audited(gateway, "run_mismatch")
    assert entries and all(e["runId"] == run.run_id for e in entries)


async def test_authz_denied_when_the_grant_lacks_allow_sandbox_and_refusal_is_audited(
    gateway: Gateway, workspace: Path
) -> None:
    from gatewayd.errors import AuthzDenied

    with pytest.raises(AuthzDenied, match="allowSandbox"):
        await gateway.create_run(workspace, allow_sandbox=False)
    [refusal] = [e for e in (await gateway.audit_entries()) if e.get("event") == "run_refused"]
    assert refusal["errorCode"] == "authz_denied"
    assert refusal["detail"]["allowSandbox"] is False
    assert not list((gateway.daemon.registry.runs_dir).iterdir()), "no run directory made"


async def test_unknown_tool_names_the_tools_that_exist(gateway: Gateway, workspace: Path) -> None:
    run = await gateway.create_run(workspace)
    err = await expect_error(run, "shell.exec", {"cmd": "id"})
    assert err.code == "unknown_tool"
    assert "shell.exec" in str(err) and "fs.read" in str(err)
    assert await audited(gateway, "unknown_tool")


async def test_policy_denied_for_a_tool_off_the_run_allowlist(
    gateway: Gateway, workspace: Path
) -> None:
    run = await gateway.create_run(workspace, tool_ids=("time.now",))
    err = await expect_error(run, "fs.read", {"path": "notes.md"})
    assert err.code == "policy_denied"
    assert "not allowed" in str(err) and "time.now" in str(err)


async def test_policy_denied_for_a_path_outside_lists_the_readable_paths(
    gateway: Gateway, workspace: Path
) -> None:
    run = await gateway.create_run(workspace)
    err = await expect_error(run, "fs.read", {"path": "/etc/passwd"})
    assert err.code == "policy_denied"
    assert "/workspace" in str(err) and "Readable paths" in str(err)
    [entry] = [e for e in await audited(gateway, "policy_denied") if e["kind"] == "call"]
    assert entry["decision"] == "deny" and entry["argsSummary"] == {"path": "/etc/passwd"}


async def test_invalid_args_says_which_field_is_wrong(gateway: Gateway, workspace: Path) -> None:
    run = await gateway.create_run(workspace)
    err = await expect_error(run, "fs.read", {"path": "notes.md", "limit": "all"})
    assert err.code == "invalid_args"
    assert "limit" in str(err) and "tools.list" in str(err)
    assert await audited(gateway, "invalid_args")


async def test_rate_limited_when_the_run_exceeds_its_call_rate(
    gateway: Gateway, workspace: Path
) -> None:
    policy = """
    version: 1
    name: slow
    tools: {allow: [time.now]}
    limits: {calls_per_second: 0.01, burst: 1}
    """
    run = await gateway.create_run(workspace, policy)
    await call(run, "time.now")
    err = await expect_error(run, "time.now")
    assert err.code == "rate_limited"
    assert "retry after" in str(err)
    assert await audited(gateway, "rate_limited")


async def test_approval_denied_when_nobody_can_be_asked_and_nothing_ran(
    gateway: Gateway, workspace: Path
) -> None:
    # This gateway serves no control socket, so a call its policy marks for approval is
    # denied at once; the operator's answers and the timeout: test_approvals.py.
    policy = """
    version: 1
    name: approve
    tools: {allow: [fs.write]}
    filesystem: {paths: {workspace: {root: ., mode: rw}}}
    approvals: {required: [{tool: fs.write}]}
    """
    run = await gateway.create_run(workspace, policy)
    err = await expect_error(run, "fs.write", {"path": "new.md", "content": "x"})
    assert err.code == "approval_denied"
    assert "needs the operator's approval (approvals.required entry 1" in err.safe_message
    assert "gatewayd serve" in err.safe_message
    assert {e["kind"] for e in await audited(gateway, "approval_denied")} == {"call", "result"}


async def test_tool_failed_for_a_missing_file(gateway: Gateway, workspace: Path) -> None:
    run = await gateway.create_run(workspace)
    err = await expect_error(run, "fs.read", {"path": "missing.md"})
    assert err.code == "tool_failed"
    assert "missing.md" in str(err)
    assert str(workspace) not in str(err), "host paths must not leak"
    assert await audited(gateway, "tool_failed")


class _Empty(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


async def _sleep_forever(_a: _Empty, _c: ToolContext) -> Any:
    await trio.sleep_forever()


async def _crash(_a: _Empty, _c: ToolContext) -> Any:
    raise RuntimeError("secret host detail /root/.ssh/id_rsa")


async def _fail(_a: _Empty, _c: ToolContext) -> Any:
    raise ToolFailed("upstream said no")


async def _unencodable(_a: _Empty, _c: ToolContext) -> Any:
    return {"set": {object()}}  # no JSON for it: gatewayd's bug, never the caller's


# Deliberately slow / crashing tools: the only way to reach the timeout and internal
# paths with tools that are otherwise correct.
TEST_TOOLS = ToolRegistry(
    (
        *builtin_tools().values(),
        builtin_tool(name="test.sleep", summary="sleeps", args_type=_Empty, run=_sleep_forever),
        builtin_tool(name="test.crash", summary="crashes", args_type=_Empty, run=_crash),
        builtin_tool(name="test.fail", summary="fails", args_type=_Empty, run=_fail),
        builtin_tool(
            name="test.unencodable",
            summary="answers what JSON cannot hold",
            args_type=_Empty,
            run=_unencodable,
        ),
    )
)
TEST_POLICY = """
version: 1
name: test-tools
tools: {allow: ["test.*", time.now]}
limits: {call_timeout_s: 0.2}
"""


async def test_timeout_stops_the_call_and_the_daemon_keeps_serving(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp, TEST_TOOLS) as gw:
        run = await gw.create_run(workspace, TEST_POLICY)
        err = await expect_error(run, "test.sleep")
        assert err.code == "timeout"
        assert "0.2 s" in str(err) and "call_timeout_s" in str(err)
        assert (await call(run, "time.now"))["iso"]
        assert await audited(gw, "timeout")


async def test_internal_error_hides_details_and_is_audited(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp, TEST_TOOLS) as gw:
        run = await gw.create_run(workspace, TEST_POLICY)
        err = await expect_error(run, "test.crash")
        assert err.code == "internal"
        assert "/root" not in str(err) and "operator" in str(err)
        assert await audited(gw, "internal")
        err = await expect_error(run, "test.fail")
        assert err.code == "tool_failed" and "upstream said no" in str(err)


async def test_a_value_gatewayd_cannot_encode_is_internal_audited_and_the_connection_goes_on(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp, TEST_TOOLS) as gw:
        run = await gw.create_run(workspace, TEST_POLICY)
        stream = await trio.open_unix_socket(str(run.socket_path))
        async with stream:
            await stream.send_all(
                frame(request(run, "test.unencodable", tcid="bad"))
                + frame(request(run, "time.now", tcid="after"))
            )
            buf = bytearray()
            with trio.fail_after(10):
                answers = {}
                while len(answers) < 2:
                    message = await read_frame(stream, buf)
                    assert message is not None, answers
                    answers[message["toolCallId"]] = message
        assert answers["bad"]["errorCode"] == "internal"
        assert "failed inside gatewayd" in answers["bad"]["safeMessage"]
        assert answers["after"]["ok"] is True
        entries = await gw.audit_entries()
        results = [e for e in entries if e["kind"] == "result" and e.get("toolCallId") == "bad"]
        assert [e["errorCode"] for e in results] == ["internal"]
