"""A tool folder's tool as dispatch sees it (gatewayd/runners/tools.py): arguments
checked against the manifest's schema (bounded), each call requesting the manifest's
required needs, the runner of its kind, and the folder and digests in its audit detail."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from gatewayd.errors import ArgumentsRejected, GatewayError
from gatewayd.mcp.schemas import MAX_COMPLAINT_CHARS
from gatewayd.runners.manifest import parse_manifest
from gatewayd.runners.process import ProcessToolRunner
from gatewayd.runners.rights import required_request
from gatewayd.runners.spec import FolderTool
from gatewayd.runners.tools import ToolUnavailable, folder_tool
from gatewayd.runners.wasm import WasmEngine, WasmToolRunner
from gatewayd.tools.registry import ToolContext


class StandIn:
    async def run(self, args: dict[str, Any], ctx: ToolContext) -> Any:
        return args


def tool(runtime: str = "wasm", schema: dict[str, Any] | None = None) -> FolderTool:
    made = parse_manifest(
        {
            "name": "text.count",
            "version": "1",
            "description": "Counts.",
            "input_schema": schema
            or {
                "type": "object",
                "properties": {
                    "text": {"type": "string", "maxLength": 10},
                    "mode": {"enum": ["words", "lines"]},
                    "tag": {"type": "string", "pattern": "^(a|aa)+$"},
                },
                "required": ["text"],
                "additionalProperties": False,
            },
            "runtime": runtime,
            "entry": "t.wasm" if runtime == "wasm" else ["/tool/t"],
            "capabilities": {"filesystem": [{"path": "src", "access": "read"}]},
        },
        file="/t/manifest.json",
        folder="/t",
    )
    return msgspec.structs.replace(made, manifest_digest="sha256:m", entry_digest="sha256:e")


def test_the_tool_requests_the_required_needs_and_audits_its_build() -> None:
    spec = tool()
    made = folder_tool(spec, wasm=None, process_ok=True, runner=StandIn())
    assert made.manifest is spec.manifest
    assert made.requests(made.decode({"text": "a b"})) == required_request(spec)
    assert made.audit_detail == {
        "folder": "/t",
        "manifestDigest": "sha256:m",
        "entryDigest": "sha256:e",
    }


@pytest.mark.parametrize(
    ("args", "where", "reason"),
    [
        ({}, "$", "'text' is a required property"),
        ({"text": 3}, "$.text", "is not of type 'string'"),
        ({"text": "x" * 11}, "$.text", "is too long"),
        ({"text": "a", "mode": "chars"}, "$.mode", "is not one of ['words', 'lines']"),
        ({"text": "a", "extra": 1}, "$", "Additional properties are not allowed"),
    ],
)
def test_arguments_that_do_not_fit_the_schema_are_rejected_naming_the_field(
    args: dict[str, Any], where: str, reason: str
) -> None:
    made = folder_tool(tool(), wasm=None, process_ok=True, runner=StandIn())
    with pytest.raises(ArgumentsRejected) as caught:
        made.decode(args)
    assert str(caught.value).startswith(f"at {where}: ")
    assert reason in str(caught.value)


def test_a_complaint_quoting_a_long_argument_is_cut_and_counts_the_others() -> None:
    made = folder_tool(tool(), wasm=None, process_ok=True, runner=StandIn())
    with pytest.raises(ArgumentsRejected) as caught:
        made.decode({"text": "x" * 10_000, "mode": "pages"})
    message = str(caught.value)
    assert message.startswith("at $.") and message.endswith("… (1 more problem(s))")
    assert len(message) < MAX_COMPLAINT_CHARS + 50  # not the 10,000 characters


def test_a_catastrophic_pattern_is_cut_off_not_run_for_hours() -> None:
    made = folder_tool(tool(), wasm=None, process_ok=True, runner=StandIn())
    with pytest.raises(ArgumentsRejected, match="took longer than"):
        made.decode({"text": "a", "tag": "a" * 5000 + "!"})


def test_a_schema_ref_outside_it_is_never_fetched_and_is_the_tools_fault() -> None:
    schema = {
        "type": "object",
        "properties": {"x": {"$ref": "https://example.org/schema.json"}},
    }
    made = folder_tool(tool(schema=schema), wasm=None, process_ok=True, runner=StandIn())
    with pytest.raises(GatewayError, match="its manifest is at fault") as caught:
        made.decode({"x": 1})
    assert not isinstance(caught.value, ArgumentsRejected)


def test_each_kind_gets_its_runner(tmp_path: Path) -> None:
    with WasmEngine(tmp_path / "cache") as engine:
        assert isinstance(folder_tool(tool(), wasm=engine, process_ok=True).runner, WasmToolRunner)
    made = folder_tool(tool("process"), wasm=None, process_ok=True)
    assert isinstance(made.runner, ProcessToolRunner)


def test_a_tool_this_gatewayd_cannot_run_is_unavailable() -> None:
    with pytest.raises(ToolUnavailable, match="no wasm engine"):
        folder_tool(tool(), wasm=None, process_ok=True)
    with pytest.raises(ToolUnavailable, match="os_sandbox: false"):
        folder_tool(tool("process"), wasm=None, process_ok=False)
