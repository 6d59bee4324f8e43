"""The operator's side of pinning: list the declared servers, show a server's pins,
compare its live tools with them, and pin them (``gatewayd mcp list|show|diff|pin``).

The daemon owns the servers, so these run in the daemon: through its control socket when
one serves it (``/v1/mcp/...``, :mod:`gatewayd.control`), else in a daemon the command
opens for the purpose (as ``gatewayd run`` does). Each answer is a JSON-able dict, the
same both ways; a refusal is :class:`ApprovalError` with the control API's error code.

Pinning lists the server's live tools in its own sandbox (never on the host), checks
every chosen tool (its name maps to a gateway name no other takes, its schema is one
jsonschema can apply, its description and schema within their caps), records who
pinned what as ``mcp_tools_pinned`` (durable before the file is written), then writes
the pin file. Re-pinning after a change is how the operator approves the change.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import trio

from gatewayd.audit import AuditEvent
from gatewayd.errors import GatewayError
from gatewayd.mcp.pinset import (
    ChangeKind,
    PinError,
    PinFileError,
    PinnedTool,
    PinSet,
    diff,
    make_pins,
)
from gatewayd.mcp.remote import RemoteTool
from gatewayd.mcp.schemas import SchemaRefused
from gatewayd.mcp.tools import McpTools, schema_validator
from gatewayd.protocol import ErrorCode


class ApprovalError(Exception):
    """A request the operator must change: ``code`` (bad_request: no such server, a
    tool that cannot be pinned; internal: the pin file cannot be written; the server's
    own code when it could not be listed) and a message saying what to do."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Approval:
    """The operator's operations on the pins of one daemon's declared servers."""

    mcp: McpTools

    def _declared(self, server: str) -> None:
        """Error handling: ApprovalError (bad_request) for a server not declared."""
        declared = self.mcp.servers.declared()
        if server not in declared:
            names = ", ".join(sorted(declared)) or "none (mcp_servers in gatewayd's configuration)"
            raise ApprovalError(
                ErrorCode.BAD_REQUEST,
                f"no MCP server named {server[:64]!r} is declared; declared: {names}",
            )

    async def _live(self, server: str) -> tuple[RemoteTool, ...]:
        try:
            return await self.mcp.list_live(server)
        except GatewayError as exc:
            raise ApprovalError(
                exc.code, f"the MCP server {server} could not list its tools: {exc.safe_message}"
            ) from None

    async def servers(self) -> dict[str, Any]:
        """Every declared server: how it runs, how it is shared, its pins, and whether
        they match its tools as last seen (nothing is started to find out)."""
        out = []
        for name, declaration in sorted(self.mcp.servers.declared().items()):
            entry: dict[str, Any] = {
                "server": name,
                "transport": "http" if getattr(declaration, "url", None) else "stdio",
                "share": str(getattr(declaration, "share", "per_run")),
                "pinned": 0,
                "pinProblem": None,
                "live": "not seen since gatewayd started",
            }
            try:
                pins = await trio.to_thread.run_sync(self.mcp.pins.load, name)
            except (PinFileError, PinError) as exc:
                entry["pinProblem"] = str(exc)
                pins = None
            entry["pinned"] = 0 if pins is None else len(pins.tools)
            seen = self.mcp.last_live(name)
            if seen is not None:
                changes = diff(name, pins, seen)
                entry["live"] = "pins current" if not changes else f"{len(changes)} difference(s)"
            out.append(entry)
        return {"ok": True, "servers": out}

    async def show(self, server: str) -> dict[str, Any]:
        """``server``'s pins as recorded."""
        self._declared(server)
        pins = await self._pins(server)
        return {
            "ok": True,
            "server": server,
            "path": str(self.mcp.pins.path(server)),
            "tools": [] if pins is None else [_pin_json(pin) for pin in pins.tools],
        }

    async def diff(self, server: str) -> dict[str, Any]:
        """How ``server``'s live tools differ from its pins (starting it, sandboxed)."""
        self._declared(server)
        pins = await self._pins(server)
        live = await self._live(server)
        return {
            "ok": True,
            "server": server,
            "pinned": 0 if pins is None else len(pins.tools),
            "offered": len(live),
            "changes": [change.to_json() for change in diff(server, pins, live)],
        }

    async def pin(self, server: str, *, tools: tuple[str, ...] | None, by: str) -> dict[str, Any]:
        """Pin ``server``'s live tools (``tools``: those MCP names alone, the other pins
        kept), as ``by``. The answer lists the pins and what was added, changed,
        removed."""
        self._declared(server)
        replaced_problem: str | None = None
        try:
            previous = await trio.to_thread.run_sync(self.mcp.pins.load, server)
        except PinFileError as exc:
            if tools is not None:
                raise ApprovalError(
                    ErrorCode.BAD_REQUEST,
                    f"{exc}. Pin every tool (without --tool) to replace the file",
                ) from None
            previous, replaced_problem = None, str(exc)
        live = await self._live(server)
        pinned_now = set(tools) if tools is not None else {tool.name for tool in live}
        try:
            pins = make_pins(server, live, only=tools, previous=previous, at=_now_iso(), by=by)
            for pin in pins.tools:
                if pin.mcp_name in pinned_now:
                    schema_validator(pin.input_schema)
        except SchemaRefused as exc:
            raise ApprovalError(
                ErrorCode.BAD_REQUEST,
                f"a tool of server {server} has an input schema that cannot be applied: {exc}",
            ) from None
        except PinError as exc:
            raise ApprovalError(ErrorCode.BAD_REQUEST, str(exc)) from None
        changes = diff(server, previous, live) if previous is not None else ()
        before = set() if previous is None else set(previous.by_mcp_name())
        after = set(pins.by_mcp_name())
        summary = {
            "added": sorted(pinned_now - before),
            "changed": sorted(
                {
                    c.mcp_name
                    for c in changes
                    if c.kind in (ChangeKind.DESCRIPTION, ChangeKind.INPUT_SCHEMA)
                    and c.mcp_name in pinned_now
                }
            ),
            "removed": sorted(before - after),
        }
        await self.mcp.audit.append(
            "event",
            event=AuditEvent.MCP_TOOLS_PINNED,
            detail={
                "server": server,
                "pinnedBy": by,
                "tools": [
                    {"mcpName": p.mcp_name, "gatewayName": p.gateway_name, "digest": p.digest}
                    for p in pins.tools
                ],
                **summary,
                "replacedUnusableFile": replaced_problem,
            },
        )
        try:
            path = await trio.to_thread.run_sync(self.mcp.pins.save, pins)
        except OSError as exc:
            raise ApprovalError(
                ErrorCode.INTERNAL,
                f"the pin file of server {server} could not be written ({exc.strerror}); "
                "the pins did not change (the audit log's mcp_tools_pinned entry records "
                "the attempt)",
            ) from None
        return {
            "ok": True,
            "server": server,
            "path": str(path),
            "tools": [_pin_json(pin) for pin in pins.tools],
            **summary,
            "replacedUnusableFile": replaced_problem,
        }

    async def _pins(self, server: str) -> PinSet | None:
        try:
            return await trio.to_thread.run_sync(self.mcp.pins.load, server)
        except (PinFileError, PinError) as exc:
            raise ApprovalError(ErrorCode.BAD_REQUEST, str(exc)) from None


def _pin_json(pin: PinnedTool) -> dict[str, Any]:
    return {
        "gatewayName": pin.gateway_name,
        "mcpName": pin.mcp_name,
        "description": pin.description,
        "digest": pin.digest,
        "pinnedAt": pin.pinned_at,
        "pinnedBy": pin.pinned_by,
    }


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
