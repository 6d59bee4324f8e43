"""A tool folder's tool as dispatch sees it: a :class:`~gatewayd.tools.registry.Tool`
whose arguments are checked against the manifest's ``input_schema``, whose every call
requests the manifest's required needs, and whose runner is the wasm or the process
runner.

The arguments are validated with ``jsonschema`` with its regular expressions bounded in
time (:mod:`gatewayd.mcp.schemas`: the schema is the operator's, the arguments the
agent's, and one catastrophic pattern must not stall gatewayd's event loop), by the
decoder the MCP tools use too (:func:`gatewayd.mcp.schemas.arguments_decoder`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gatewayd.errors import GatewayError
from gatewayd.mcp.schemas import arguments_decoder, bounded_validator
from gatewayd.runners.process import ProcessToolRunner
from gatewayd.runners.rights import required_request
from gatewayd.runners.spec import FolderTool
from gatewayd.tools.manifest import RunnerKind
from gatewayd.tools.registry import CallEgress, Tool, ToolRunner

if TYPE_CHECKING:
    import jsonschema.protocols

    # wasmtime (through the wasm runner) is loaded only by a daemon that has a wasm
    # tool: it made the engine, and a wasm tool's runner is made from it.
    from gatewayd.runners.wasm import WasmEngine


class ToolUnavailable(ValueError):
    """This gatewayd cannot run the tool (no wasm engine, or no OS sandbox for a
    process tool); ``str()`` says why."""


def folder_tool(
    tool: FolderTool,
    *,
    wasm: WasmEngine | None,
    process_ok: bool,
    runner: ToolRunner[dict[str, Any]] | None = None,
    call_egress: CallEgress | None = None,
) -> Tool[dict[str, Any]]:
    """``tool`` as a Tool: decode = its ``input_schema`` (bounded), requests = its
    required needs (:func:`gatewayd.runners.rights.required_request`), runner = the
    wasm runner on ``wasm`` or the process runner (``runner`` replaces it: tests), and
    each allowed call's audit entry names the folder and the manifest's and module's
    digests, so a reviewer knows which build ran. ``call_egress``: how a process tool's
    call granted network domains gets its own egress proxy (None: such a call gets no
    network; see :mod:`gatewayd.runners.process`).

    Error handling: ToolUnavailable for a wasm tool without an engine, or a process
    tool when ``process_ok`` is False (no OS sandbox to run it in).
    """
    # The schema's library (jsonschema, referencing) is loaded only by a daemon with a
    # folder tool, when it builds them (in a worker thread at its start: open_daemon).
    from referencing import Registry

    if runner is None:
        runner = _runner_for(tool, wasm, process_ok=process_ok, call_egress=call_egress)
    request = required_request(tool)
    return Tool(
        manifest=tool.manifest,
        decode=decoder(
            tool.name, bounded_validator(tool.manifest.args_schema, registry=Registry())
        ),
        requests=lambda _args: request,
        runner=runner,
        audit_detail={
            "folder": tool.folder,
            "manifestDigest": tool.manifest_digest,
            "entryDigest": tool.entry_digest,
        },
    )


def _runner_for(
    tool: FolderTool, wasm: WasmEngine | None, *, process_ok: bool, call_egress: CallEgress | None
) -> ToolRunner[dict[str, Any]]:
    if tool.runner is RunnerKind.WASM:
        if wasm is None:
            raise ToolUnavailable(f"{tool.name}: a wasm tool, and this gatewayd has no wasm engine")
        from gatewayd.runners.wasm import WasmToolRunner  # its engine has loaded it

        return WasmToolRunner(tool, wasm)
    if not process_ok:
        raise ToolUnavailable(
            f"{tool.name}: a process tool runs each call in an OS sandbox, and this gatewayd "
            "has none (os_sandbox: false)"
        )
    return ProcessToolRunner(tool, egress=call_egress)


def decoder(
    name: str, validator: jsonschema.protocols.Validator
) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """The ``decode`` of the tool ``name``: its arguments, checked against its schema.

    Error handling: ArgumentsRejected with the path and the reason of the complaint
    jsonschema judges most relevant (and how many there were); a schema that cannot
    be applied to them (a ``$ref`` outside it) is the tool's fault, ``internal``."""

    def unusable(exc: Exception) -> GatewayError:
        return GatewayError(
            f"the input schema of {name} cannot be applied ({type(exc).__name__}); "
            "its manifest is at fault: tell the operator"
        )

    return arguments_decoder(validator, unusable)
