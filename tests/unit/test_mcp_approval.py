"""The operator's pinning (gatewayd/mcp/approval.py) against the contract's fake
supervisor and a real audit log and pin store: every refusal with its code and message,
what a pin records, and how a pin file that fails its checks is replaced."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path
from typing import Any

import pytest

from gatewayd.errors import ToolTimedOut
from gatewayd.mcp.approval import Approval, ApprovalError
from gatewayd.mcp.remote import RemoteTool
from gatewayd.protocol import ErrorCode
from tests.unit.test_mcp_tools import GET_TIME, Setup, setup

__all__ = ["setup"]  # the fixture, shared


def approval(s: Setup) -> Approval:
    return Approval(s.mcp)


async def refused(coro: Any) -> ApprovalError:
    with pytest.raises(ApprovalError) as caught:
        await coro
    return caught.value


async def test_pinning_records_the_pins_and_who_pinned_what_in_the_audit_log(
    setup: Setup,
) -> None:
    answer = await approval(setup).pin("time", tools=None, by="ops (uid 0)")
    assert answer["added"] == ["convert_time", "get_current_time", "not_pinned"]
    assert (answer["changed"], answer["removed"]) == ([], [])
    assert [t["gatewayName"] for t in answer["tools"]] == [
        "mcp.time.convert_time",
        "mcp.time.get_current_time",
        "mcp.time.not_pinned",
    ]
    (event,) = await setup.events("mcp_tools_pinned")
    assert event["detail"]["server"] == "time"
    assert event["detail"]["pinnedBy"] == "ops (uid 0)"
    assert {t["mcpName"] for t in event["detail"]["tools"]} == {
        "convert_time",
        "get_current_time",
        "not_pinned",
    }
    shown = await approval(setup).show("time")
    assert [t["pinnedBy"] for t in shown["tools"]] == ["ops (uid 0)"] * 3


async def test_re_pinning_a_changed_tool_says_it_changed_and_a_dropped_one_removed(
    setup: Setup,
) -> None:
    await approval(setup).pin("time", tools=None, by="ops")
    setup.servers.offered["time"] = [dataclasses.replace(GET_TIME, description="New words.")]
    answer = await approval(setup).pin("time", tools=None, by="ops")
    assert answer["changed"] == ["get_current_time"]
    assert answer["removed"] == ["convert_time", "not_pinned"]


@pytest.mark.parametrize("verb", ["show", "diff", "pin"])
async def test_a_server_not_declared_is_bad_request_naming_the_declared(
    setup: Setup, verb: str
) -> None:
    call = getattr(approval(setup), verb)
    exc = await refused(call("nope", tools=None, by="x") if verb == "pin" else call("nope"))
    assert exc.code is ErrorCode.BAD_REQUEST
    assert exc.message == "no MCP server named 'nope' is declared; declared: git, time"


async def test_a_tool_the_server_does_not_offer_is_bad_request(setup: Setup) -> None:
    exc = await refused(approval(setup).pin("time", tools=("nope",), by="x"))
    assert exc.code is ErrorCode.BAD_REQUEST
    assert "server time does not offer 'nope'; it offers" in exc.message


async def test_names_that_clash_are_bad_request_naming_both(setup: Setup) -> None:
    setup.servers.offered["time"] = [
        RemoteTool(name="get-time", description="a", input_schema={}),
        RemoteTool(name="get_time", description="b", input_schema={}),
    ]
    exc = await refused(approval(setup).pin("time", tools=None, by="x"))
    assert exc.code is ErrorCode.BAD_REQUEST
    assert "'get-time' and 'get_time' both map to mcp.time.get_time" in exc.message
    assert setup.store.load("time") is None  # nothing pinned


async def test_a_schema_jsonschema_cannot_apply_is_not_pinned(setup: Setup) -> None:
    setup.servers.offered["time"] = [
        RemoteTool(name="bad", description="x", input_schema={"type": "no-such-type"})
    ]
    exc = await refused(approval(setup).pin("time", tools=None, by="x"))
    assert exc.code is ErrorCode.BAD_REQUEST
    assert "a tool of server time has an input schema that cannot be applied" in exc.message
    assert await setup.events("mcp_tools_pinned") == []


async def test_a_server_that_cannot_list_its_tools_gives_its_own_code(setup: Setup) -> None:
    async def hung(*_args: Any, **_kwargs: Any) -> Any:
        raise ToolTimedOut("the MCP server time did not answer tools/list within 5 s")

    setup.servers.list_tools = hung  # type: ignore[method-assign]
    exc = await refused(approval(setup).diff("time"))
    assert exc.code is ErrorCode.TIMEOUT
    assert exc.message == (
        "the MCP server time could not list its tools: the MCP server time did not answer "
        "tools/list within 5 s"
    )


async def test_a_pin_file_that_fails_its_checks_is_replaced_only_by_pinning_every_tool(
    setup: Setup,
) -> None:
    await approval(setup).pin("time", tools=None, by="ops")
    path = setup.store.path("time")
    path.write_bytes(path.read_bytes().replace(b"Convert a time.", b"Convert it, quietly."))
    exc = await refused(approval(setup).pin("time", tools=("convert_time",), by="ops"))
    assert exc.code is ErrorCode.BAD_REQUEST
    assert "does not match" in exc.message
    assert "Pin every tool (without --tool) to replace the file" in exc.message
    listed = await approval(setup).servers()
    (time_entry,) = [e for e in listed["servers"] if e["server"] == "time"]
    assert "does not match" in time_entry["pinProblem"]
    answer = await approval(setup).pin("time", tools=None, by="ops")
    assert "does not match" in (answer["replacedUnusableFile"] or "")
    assert setup.store.load("time") is not None


async def test_a_pin_file_that_cannot_be_written_is_internal_and_the_pins_stay(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    await approval(setup).pin("time", tools=("get_current_time",), by="ops")

    def disk_full(_path: Path, _data: bytes, mode: int = 0o600) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # A full disk cannot be made on demand here: the write itself fails as one would.
    monkeypatch.setattr("gatewayd.mcp.pins.write_atomically", disk_full)
    exc = await refused(approval(setup).pin("time", tools=None, by="ops"))
    assert exc.code is ErrorCode.INTERNAL
    assert exc.message.startswith(
        "the pin file of server time could not be written (No space left on device); "
        "the pins did not change"
    )
    pins = setup.store.load("time")
    assert pins is not None and [p.mcp_name for p in pins.tools] == ["get_current_time"]


async def test_list_says_whether_the_pins_match_the_tools_last_seen(setup: Setup) -> None:
    listed = await approval(setup).servers()
    assert [(e["server"], e["pinned"], e["live"]) for e in listed["servers"]] == [
        ("git", 0, "not seen since gatewayd started"),
        ("time", 0, "not seen since gatewayd started"),
    ]
    await approval(setup).pin("time", tools=None, by="ops")
    listed = await approval(setup).servers()
    assert ("time", 3, "pins current") in [
        (e["server"], e["pinned"], e["live"]) for e in listed["servers"]
    ]
    setup.servers.offered["time"] = [dataclasses.replace(GET_TIME, description="Other.")]
    await approval(setup).diff("time")
    listed = await approval(setup).servers()
    assert ("time", 3, "3 difference(s)") in [
        (e["server"], e["pinned"], e["live"]) for e in listed["servers"]
    ]
