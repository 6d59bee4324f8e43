"""The MCP runner kind: each pinned tool of a declared MCP server is a gateway tool,
``mcp.<server>.<tool>``, of every run that starts after it was pinned.

When a run starts (:meth:`McpTools.tools_for_run`, part of the run manager's hook), the
pins of every declared server are read (:class:`~gatewayd.mcp.pins.PinStore`, cached by
the files' modification times) and each pinned tool becomes a tool of that run
(``Dispatcher.set_run_tools(..., source="mcp")``, beside the run's apps); the run's
policy allows them or not like any tool (``tools: {allow: [mcp.time.*]}``). A tool the
server offers but nobody pinned is no tool at all: a call of it is ``unknown_tool``
with a hint to pin it. A call:

1. passes dispatch like any call; its arguments are validated against the pinned input
   schema with ``jsonschema`` (the maintained JSON Schema implementation; ``$ref`` to
   anything outside the schema is never fetched), so a bad one is ``invalid_args`` with
   where and why, before anything reaches the server;
2. compares the server's live tool (``McpServers.list_tools``, cached by the
   supervisor) with its pin: a changed description or schema is ``policy_denied``,
   recorded as ``mcp_tool_changed`` with what differs (the caller is told which parts
   changed, never the new text: that text is what a rug pull would use to instruct the
   model); a tool the server no longer offers is ``tool_failed``;
3. is one ``tools/call`` (``McpServers.call_tool``, in the server's own sandbox); an
   answer with ``isError`` is ``tool_failed`` carrying the server's text, any other is
   the call's value: ``{"content": [...], "structuredContent": {...}}``.

Dispatch audits the call like any other (the ``call`` entry's ``detail`` adds the
runner kind, the server, the tool's MCP name and the pin's digest) and scrubs host
secrets from the value and the messages.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

import structlog
import trio

from gatewayd.audit import AuditEvent, AuditLog
from gatewayd.dispatch import Dispatcher
from gatewayd.errors import GatewayError, PolicyViolation, ToolFailed
from gatewayd.mcp.pins import PinStore
from gatewayd.mcp.pinset import (
    GATEWAY_PREFIX,
    PinError,
    PinFileError,
    PinnedTool,
    PinSet,
    changes_of,
)
from gatewayd.mcp.remote import RemoteResult, RemoteTool
from gatewayd.mcp.schemas import SchemaRefused, arguments_decoder, bounded_validator
from gatewayd.policy.capabilities import CapabilityRequest
from gatewayd.runs import Run
from gatewayd.tools.manifest import MAX_SUMMARY_CHARS, RunnerKind, ToolLimits, ToolManifest
from gatewayd.tools.registry import Tool, ToolContext, ToolRegistry

if TYPE_CHECKING:
    import jsonschema.protocols

log = structlog.get_logger("gatewayd.mcp")

# The run manager's source name for these tools (Dispatcher.set_run_tools).
SOURCE: Final = "mcp"
# A server's own tools/call limit when its declaration names none (the declaration's
# default too).
DEFAULT_CALL_TIMEOUT_S: Final = 30.0
# Dispatch's limit for a call runs this much past the server's own, so a hung server is
# answered by the supervisor (which kills and restarts it), not cut off around it.
TIMEOUT_MARGIN_S: Final = 1.0
# The least time a call is given when the run's own limit is shorter than the margin.
MIN_CALL_TIMEOUT_S: Final = 0.1
# How much of an error answer's text the caller reads (an error is a sentence or two;
# more is output, and output goes in a normal answer).
MAX_ERROR_TEXT_CHARS: Final = 2000


class McpServerSource(Protocol):
    """What this module needs of the supervisor (gatewayd.mcp.servers.McpServers)."""

    def declared(self) -> Mapping[str, Any]: ...

    async def list_tools(self, server: str, *, caller: Run | None) -> tuple[RemoteTool, ...]: ...

    async def call_tool(
        self,
        server: str,
        tool: str,
        arguments: Mapping[str, Any],
        *,
        caller: Run,
        timeout_s: float,
    ) -> RemoteResult: ...


def schema_validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    """A validator of ``schema`` (its own ``$schema`` draft, else 2020-12) whose regular
    expressions are bounded in time (:mod:`gatewayd.mcp.schemas`: a pinned pattern and
    an agent's argument must not stall the event loop).

    Error handling: SchemaRefused saying what is wrong with the schema.
    """
    return bounded_validator(schema)  # no $schema: 2020-12, the draft MCP specifies


def decoder(
    name: str, validator: jsonschema.protocols.Validator
) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """The ``decode`` of the tool ``name``: its arguments, checked against its pinned
    schema. Error handling: ArgumentsRejected with the path and the reason of the most
    relevant complaint (and how many there were); a schema that cannot be applied to
    them (a ``$ref`` outside it) is gatewayd's problem, ``internal``."""

    def unusable(exc: Exception) -> GatewayError:
        log.warning("mcp_schema_unusable", tool=name, error=repr(exc)[:200])
        return GatewayError(
            f"the pinned input schema of {name} cannot be applied ({type(exc).__name__}); "
            "tell the operator"
        )

    return arguments_decoder(validator, unusable)


def _no_capabilities(_args: dict[str, Any]) -> CapabilityRequest:
    # What the server may touch is its sandbox's (its declaration, within the caller's
    # workspace grants), set up by the supervisor; the call itself asks for nothing.
    return CapabilityRequest()


def summary_of(server: str, pin: PinnedTool) -> str:
    """The manifest's summary: the pinned description, bounded; a tool without one is
    named for what it is."""
    text = " ".join(pin.description.split())
    if not text:
        return f"{pin.mcp_name} (a tool of the MCP server {server})"
    if len(text) > MAX_SUMMARY_CHARS:
        text = text[: MAX_SUMMARY_CHARS - 1] + "…"
    return text


@dataclass(frozen=True, slots=True, kw_only=True)
class McpToolRunner:
    """Runs the calls of one pinned tool."""

    tools: McpTools
    server: str
    pin: PinnedTool
    timeout_s: float

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> Any:
        return await self.tools.call(self, args, ctx)


class McpTools:
    """The MCP runner kind of one daemon: the pinned tools of its declared servers as
    tools of each run, and their calls."""

    def __init__(
        self,
        servers: McpServerSource,
        pins: PinStore,
        *,
        dispatcher: Dispatcher,
        lookup_run: Callable[[str], Run | None],
        audit: AuditLog,
    ) -> None:
        self.servers = servers
        self.pins = pins
        self.dispatcher = dispatcher
        self.lookup_run = lookup_run
        self.audit = audit
        # Each server's tools, made once per pin set (PinStore returns the same PinSet
        # while its file is unchanged).
        self._made: dict[str, tuple[PinSet, tuple[Tool[Any], ...]]] = {}
        # Each server's tools as this daemon last saw them (a call, a pin, a diff), for
        # `gatewayd mcp list` (which starts nothing).
        self._seen: dict[str, tuple[RemoteTool, ...]] = {}
        dispatcher.unknown_tool_hints.append(self.unknown_hint)

    # -- the servers' live tools -------------------------------------------------------

    async def list_live(self, server: str, *, caller: Run | None = None) -> tuple[RemoteTool, ...]:
        """``server``'s tools now (the supervisor starts it if need be, sandboxed).
        Error handling: the supervisor's GatewayErrors pass through."""
        live = await self.servers.list_tools(server, caller=caller)
        self._seen[server] = live
        return live

    def last_live(self, server: str) -> tuple[RemoteTool, ...] | None:
        """``server``'s tools as last seen; None: not seen since this daemon started."""
        return self._seen.get(server)

    # -- the tools of a run ------------------------------------------------------------

    def tools(self) -> tuple[ToolRegistry, dict[str, str]]:
        """Every declared server's pinned tools, as they are pinned now, and the
        servers whose pin file was refused (server: why)."""
        registry = ToolRegistry()
        refused: dict[str, str] = {}
        for server in sorted(self.servers.declared()):
            try:
                pins = self.pins.load(server)
            except (PinFileError, PinError) as exc:
                refused[server] = str(exc)
                continue
            if pins is None:
                continue
            for tool in self._tools_of(server, pins):
                registry.register(tool)
        return registry, refused

    def tool_names(self) -> tuple[str, ...]:
        """The gateway names of every pinned tool of a declared server (what a run
        starting now will have), sorted."""
        registry, _ = self.tools()
        return tuple(sorted(registry))

    async def tools_for_run(self, run: Run) -> None:
        """Give ``run`` the pinned tools (its policy decides which it may call); a
        refused pin file is audited (``mcp_pins_refused``) and its server's tools left
        out, never the run refused."""
        if self.servers.declared():
            registry, refused = await trio.to_thread.run_sync(self.tools)
        else:
            # No server, no pin file to read: no worker thread either (its hand-off there
            # and back cost every run's start about 0.3 ms for nothing).
            registry, refused = ToolRegistry(), {}
        for server, reason in refused.items():
            log.error("mcp_pins_refused", run_id=run.run_id, server=server, reason=reason)
            await self.audit.append(
                "event",
                event=AuditEvent.MCP_PINS_REFUSED,
                runId=run.run_id,
                detail={"server": server, "reason": reason},
            )
        self.dispatcher.set_run_tools(run.run_id, registry, source=SOURCE)

    def unknown_hint(self, name: str) -> str | None:
        """What a caller of an ``mcp.*`` name no tool has should know."""
        prefix, _, rest = name.partition(".")
        server, _, tool = rest.partition(".")
        if prefix != GATEWAY_PREFIX or not server or not tool:
            return None
        if server not in self.servers.declared():
            return f"No MCP server named {server!r} is declared in gatewayd's configuration."
        return (
            f"It is not a pinned tool of the MCP server {server} for this run: a tool the "
            "server offers becomes a gateway tool once the operator approves it "
            f"(gatewayd mcp pin {server}), for the runs that start after that."
        )

    def _tools_of(self, server: str, pins: PinSet) -> tuple[Tool[Any], ...]:
        made = self._made.get(server)
        if made is not None and made[0] is pins:
            return made[1]
        declaration = self.servers.declared().get(server)
        own_s = float(getattr(declaration, "call_timeout_s", DEFAULT_CALL_TIMEOUT_S))
        tools: list[Tool[Any]] = []
        for pin in pins.tools:
            try:
                tools.append(self._tool(server, pin, own_s))
            except (SchemaRefused, ValueError) as exc:
                # The pin step checked the schema: only a gatewayd that reads schemas
                # differently from the one that pinned gets here. Leave it out, loudly.
                log.error("mcp_tool_unusable", server=server, tool=pin.mcp_name, error=str(exc))
        self._made[server] = (pins, tuple(tools))
        return tuple(tools)

    def _tool(self, server: str, pin: PinnedTool, own_s: float) -> Tool[dict[str, Any]]:
        validator = schema_validator(pin.input_schema)
        manifest = ToolManifest(
            name=pin.gateway_name,
            version=f"pin-{pin.digest.removeprefix('sha256:')[:12]}",
            summary=summary_of(server, pin),
            args_schema=pin.input_schema,
            runner=RunnerKind.MCP,
            limits=ToolLimits(timeout_s=own_s + TIMEOUT_MARGIN_S),
            side_effects=True,
        )
        return Tool(
            manifest=manifest,
            decode=decoder(pin.gateway_name, validator),
            requests=_no_capabilities,
            runner=McpToolRunner(tools=self, server=server, pin=pin, timeout_s=own_s),
            audit_detail={
                "runner": str(RunnerKind.MCP),
                "server": server,
                "mcpTool": pin.mcp_name,
                "pinDigest": pin.digest,
            },
        )

    # -- a call ------------------------------------------------------------------------

    async def call(self, runner: McpToolRunner, args: dict[str, Any], ctx: ToolContext) -> Any:
        """One call (the module doc's steps 2 and 3). Error handling: PolicyViolation for
        a tool changed since it was pinned; ToolFailed for one no longer offered and for
        an error answer; the supervisor's own errors (``timeout``, a crash) pass
        through."""
        server, pin = runner.server, runner.pin
        caller = self.lookup_run(ctx.run_id)
        if caller is None:  # its own call is in flight: it cannot have ended
            raise ToolFailed(f"run {ctx.run_id} is ending; {pin.gateway_name} was not called")
        live = await self.list_live(server, caller=caller)
        current = next((tool for tool in live if tool.name == pin.mcp_name), None)
        if current is None:
            raise ToolFailed(
                f"the MCP server {server} no longer offers the tool {pin.mcp_name!r} "
                f"({pin.gateway_name}); the operator can compare its tools with their pins "
                f"(gatewayd mcp diff {server})"
            )
        changes = changes_of(pin, current)
        if changes:
            await self.audit.append(
                "event",
                event=AuditEvent.MCP_TOOL_CHANGED,
                runId=ctx.run_id,
                toolCallId=ctx.tool_call_id,
                detail={
                    "server": server,
                    "tool": pin.mcp_name,
                    "gatewayName": pin.gateway_name,
                    "pinDigest": pin.digest,
                    "changes": [change.to_json() for change in changes],
                },
            )
            what = " and ".join(str(change.kind) for change in changes)
            raise PolicyViolation(
                f"{pin.gateway_name} is refused: the MCP server {server} changed this tool's "
                f"{what} since the operator pinned it. Its calls are refused until the "
                f"operator approves the change (gatewayd mcp diff {server}; gatewayd mcp "
                f"pin {server} --tool {pin.mcp_name})"
            )
        # The server's own limit, within the run's (less the margin, so the
        # supervisor's answer comes before dispatch's cut).
        run_s = caller.spec.policy.limits.call_timeout_s - TIMEOUT_MARGIN_S
        timeout_s = max(min(runner.timeout_s, run_s), MIN_CALL_TIMEOUT_S)
        result = await self.servers.call_tool(
            server, pin.mcp_name, args, caller=caller, timeout_s=timeout_s
        )
        if result.is_error:
            raise ToolFailed(
                f"{pin.gateway_name}: the MCP server {server} answered with an error: "
                + (error_text(result) or "(no text)")
            )
        value: dict[str, Any] = {"content": result.content}
        if result.structured is not None:
            value["structuredContent"] = result.structured
        return value


def error_text(result: RemoteResult) -> str:
    """The text of an error answer, bounded: its text blocks (else its structured content
    as JSON)."""
    texts = [
        str(block.get("text", ""))
        for block in result.content
        if isinstance(block, Mapping) and block.get("type") == "text"
    ]
    text = "\n".join(t for t in texts if t)
    if not text and result.structured is not None:
        text = json.dumps(result.structured, ensure_ascii=False)[: MAX_ERROR_TEXT_CHARS + 1]
    if len(text) > MAX_ERROR_TEXT_CHARS:
        text = text[:MAX_ERROR_TEXT_CHARS] + f"…[{len(text)} chars]"
    return text
