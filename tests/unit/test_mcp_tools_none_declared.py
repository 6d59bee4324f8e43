"""A daemon that declares no MCP server gives each run no MCP tool, and asks no worker
thread for pin files to get there (gatewayd/mcp/tools.py ``tools_for_run``: its
hand-off was most of what it cost every run's start); a pin file left from a server no
longer declared gives nothing, as before."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.audit import open_audit_log, verify_file
from gatewayd.dispatch import Dispatcher
from gatewayd.mcp.pins import PinStore
from gatewayd.mcp.pinset import make_pins
from gatewayd.mcp.tools import SOURCE, McpTools
from gatewayd.metrics import GatewayMetrics
from gatewayd.tools import builtin_tools
from tests.unit.test_mcp_tools import GET_TIME, FakeServers, make_run


class NoServers(FakeServers):
    """The supervisor of a daemon whose configuration declares no MCP server."""

    def declared(self) -> Mapping[str, Any]:
        return {}


async def test_no_server_declared_gives_a_run_no_mcp_tool_without_a_hand_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    audit_path = tmp_path / "audit.jsonl"
    store = PinStore(tmp_path / "state")
    # Pinned while a server "time" was declared; the configuration declares none now.
    store.save(make_pins("time", [GET_TIME], only=None, previous=None, at="t", by="tester"))
    handed: list[Callable[..., Any]] = []
    real_run_sync = trio.to_thread.run_sync

    async def run_sync(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        handed.append(fn)
        return await real_run_sync(fn, *args, **kwargs)

    async with open_audit_log(audit_path, fsync=False) as audit:
        dispatcher = Dispatcher(audit, builtin_tools(), metrics=GatewayMetrics())
        run = make_run(tmp_path)
        mcp = McpTools(
            NoServers(),
            store,
            dispatcher=dispatcher,
            lookup_run=lambda run_id: run if run_id == run.run_id else None,
            audit=audit,
        )
        monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)
        await mcp.tools_for_run(run)
        monkeypatch.undo()
        assert handed == []
        given = dispatcher.run_tools(run.run_id, source=SOURCE)
        assert given is not None and list(given) == []
    assert verify_file(audit_path).ok
