"""The tool registry and tool manifests: names are registered once, lookups are by name,
every built-in tool has a valid manifest whose schema is its argument Struct's, and a
manifest refuses what no runner kind could honour."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest

import gatewayd
from gatewayd.errors import ArgumentsRejected
from gatewayd.policy.capabilities import (
    ANY,
    EVERY_PATH,
    Capabilities,
    CapabilityRequest,
    FileCapability,
)
from gatewayd.policy.paths import PathMode
from gatewayd.tools import builtin_tools
from gatewayd.tools.builtin import BUILTIN_VERSION, TOOLS_LIST_MANIFEST, builtin_tool
from gatewayd.tools.clock import NowArgs
from gatewayd.tools.exec import ExecArgs
from gatewayd.tools.fs.listing import ListArgs, StatArgs
from gatewayd.tools.fs.read import ReadArgs
from gatewayd.tools.fs.write import EditArgs, WriteArgs
from gatewayd.tools.http import FetchArgs
from gatewayd.tools.manifest import RunnerKind, ToolLimits, ToolManifest
from gatewayd.tools.model import ChatArgs
from gatewayd.tools.query import QueryArgs
from gatewayd.tools.registry import (
    TOOLS_LIST,
    DuplicateToolError,
    Tool,
    ToolContext,
    ToolRegistry,
)
from gatewayd.tools.usage import UsageArgs

REPO_ROOT: Final = Path(__file__).resolve().parents[2]
READS: Final = Capabilities(files=(FileCapability(path=EVERY_PATH, mode=PathMode.RO),))
WRITES: Final = Capabilities(files=(FileCapability(path=EVERY_PATH, mode=PathMode.RW),))

# name -> (argument Struct, declared capabilities, side effects, one valid call's
# arguments, and what that call requests)
BUILTINS: Final[dict[str, tuple[type[msgspec.Struct], Capabilities, bool, Any, Any]]] = {
    "time.now": (NowArgs, Capabilities(), False, {}, CapabilityRequest()),
    "fs.read": (ReadArgs, READS, False, {"path": "a.md"}, {"paths": ["a.md read"]}),
    "fs.write": (
        WriteArgs,
        WRITES,
        True,
        {"path": "a.md", "content": ""},
        {"paths": ["a.md write"]},
    ),
    "fs.edit": (
        EditArgs,
        WRITES,
        True,
        {"path": "a.md", "old": "x", "new": "y"},
        {"paths": ["a.md read", "a.md write"]},
    ),
    "fs.list": (ListArgs, READS, False, {}, {"paths": [". read"]}),
    "fs.stat": (StatArgs, READS, False, {"path": "d"}, {"paths": ["d read"]}),
    "model.chat": (
        ChatArgs,
        Capabilities(model_access=(ANY,)),
        True,
        {"model": "assistant", "messages": [{"role": "user", "content": "hi"}]},
        CapabilityRequest(models=("assistant",)),
    ),
    "http.fetch": (
        FetchArgs,
        Capabilities(network=(ANY,)),
        True,
        {"url": "https://Example.ORG./x"},
        CapabilityRequest(domains=("example.org",)),
    ),
    "sandbox.exec": (
        ExecArgs,
        Capabilities(exec=True),
        True,
        {"command": "true"},
        CapabilityRequest(exec=True),
    ),
    # Answers about paths without asking for them: a path outside is an answer, not a
    # refusal (gatewayd/tools/query.py).
    "sandbox.query": (
        QueryArgs,
        READS,
        False,
        {"op": "can_read", "path": "/etc/passwd"},
        CapabilityRequest(),
    ),
    "sandbox.usage": (UsageArgs, Capabilities(), False, {}, CapabilityRequest()),
}


class NoArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


async def nothing(_args: NoArgs, _ctx: ToolContext) -> Any:
    return None


def a_tool(name: str, runner: RunnerKind = RunnerKind.BUILTIN) -> Tool[NoArgs]:
    tool = builtin_tool(name=name, summary="a tool", args_type=NoArgs, run=nothing)
    manifest = msgspec.structs.replace(tool.manifest, runner=runner)
    return Tool(manifest=manifest, decode=tool.decode, requests=tool.requests, runner=tool.runner)


def request_of(tool: str, args: dict[str, Any]) -> CapabilityRequest:
    spec = builtin_tools()[tool]
    return spec.requests(spec.decode(args))


# --- the registry ------------------------------------------------------------------------


def test_tools_are_looked_up_by_name_in_registration_order() -> None:
    first, second = a_tool("test.one"), a_tool("test.two")
    registry = ToolRegistry((first, second))
    assert list(registry) == ["test.one", "test.two"] and len(registry) == 2
    assert registry["test.two"] is second and registry.get("test.one") is first
    assert registry.get("test.none") is None and "test.none" not in registry
    assert registry.manifests() == (first.manifest, second.manifest)
    with pytest.raises(KeyError):
        registry["test.none"]


@pytest.mark.parametrize(
    ("first", "second", "says"),
    [
        (RunnerKind.BUILTIN, RunnerKind.BUILTIN, "(runner builtin); a second one (runner builtin)"),
        (RunnerKind.BUILTIN, RunnerKind.WASM, "(runner builtin); a second one (runner wasm)"),
        (RunnerKind.MCP, RunnerKind.APP, "(runner mcp); a second one (runner app)"),
    ],
)
def test_a_second_tool_of_a_name_is_refused_whatever_its_kind(
    first: RunnerKind, second: RunnerKind, says: str
) -> None:
    registry = ToolRegistry((a_tool("test.same", first),))
    with pytest.raises(DuplicateToolError, match=re.escape(says)):
        registry.register(a_tool("test.same", second))
    assert registry["test.same"].manifest.runner is first


def test_no_tool_takes_the_name_of_tools_list() -> None:
    with pytest.raises(DuplicateToolError, match="dispatch's own"):
        ToolRegistry((a_tool(TOOLS_LIST),))


def test_builtin_tools_gives_a_fresh_registry_each_time() -> None:
    one = builtin_tools()
    one.register(a_tool("test.extra"))
    assert "test.extra" not in builtin_tools()


# --- the built-in tools' manifests -------------------------------------------------------


def test_the_builtin_registry_holds_exactly_the_builtin_tools() -> None:
    assert set(builtin_tools()) == set(BUILTINS)


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_each_builtin_manifest_is_valid_and_its_schema_is_its_arguments(name: str) -> None:
    args_type, capabilities, side_effects, _, _ = BUILTINS[name]
    manifest = builtin_tools()[name].manifest
    assert manifest.name == name
    assert manifest.version == BUILTIN_VERSION == gatewayd.__version__
    assert manifest.runner is RunnerKind.BUILTIN
    assert manifest.args_schema == msgspec.json.schema(args_type)
    assert manifest.capabilities == capabilities
    assert manifest.side_effects is side_effects
    assert manifest.limits == ToolLimits()
    # The manifest survives the wire: what tools.list shows decodes back to it.
    assert msgspec.json.decode(msgspec.json.encode(manifest), type=ToolManifest) == manifest


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_each_builtin_decodes_into_its_struct_and_refuses_unknown_fields(name: str) -> None:
    args_type, _, _, valid, _ = BUILTINS[name]
    tool = builtin_tools()[name]
    assert isinstance(tool.decode(valid), args_type)
    with pytest.raises(ArgumentsRejected, match="unknown field `nonsense`"):
        tool.decode({**valid, "nonsense": 1})


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_each_builtin_requests_what_a_call_uses_within_its_declaration(name: str) -> None:
    _, _, _, valid, expected = BUILTINS[name]
    request = request_of(name, valid)
    if isinstance(expected, dict):
        assert [f"{p.path} {p.access}" for p in request.paths] == expected["paths"]
        assert (request.domains, request.models, request.env, request.exec) == ((), (), (), False)
    else:
        assert request == expected


@pytest.mark.parametrize(
    "url", ["not a url at all", "/relative/path", "https:///no-host", "http://[::1"]
)
def test_a_fetch_url_without_a_host_asks_for_nothing_and_the_runner_refuses_it(url: str) -> None:
    assert request_of("http.fetch", {"url": url}) == CapabilityRequest()


def test_tools_list_has_a_manifest_like_any_tool() -> None:
    assert TOOLS_LIST_MANIFEST.name == TOOLS_LIST
    assert TOOLS_LIST_MANIFEST.side_effects is False
    assert TOOLS_LIST_MANIFEST.capabilities == Capabilities()
    assert TOOLS_LIST_MANIFEST.args_schema["additionalProperties"] is False


def test_the_manifest_on_the_wire_names_every_field_in_camel_case() -> None:
    manifest = builtin_tools()["model.chat"].manifest
    shown = msgspec.json.decode(msgspec.json.encode(manifest))
    assert list(shown) == [
        "name",
        "version",
        "summary",
        "argsSchema",
        "runner",
        "capabilities",
        "limits",
        "sideEffects",
    ]
    assert shown["capabilities"]["modelAccess"] == ["*"]
    assert shown["limits"] == {"timeoutSeconds": None, "memoryBytes": None, "fuel": None}


def test_gatewayd_version_is_the_project_version() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert gatewayd.__version__ == project["version"]


# --- what a manifest refuses -------------------------------------------------------------


def manifest(**fields: Any) -> ToolManifest:
    base: dict[str, Any] = {
        "name": "test.tool",
        "version": "1.0.0",
        "summary": "a tool",
        "args_schema": {"type": "object"},
        "runner": RunnerKind.WASM,
    }
    return ToolManifest(**{**base, **fields})


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"name": "Bad Name"}, "dotted lowercase name"),
        ({"name": "fs."}, "dotted lowercase name"),
        ({"name": "a" * 129}, "at most 128 characters"),
        ({"version": ""}, "a version is 1-64 characters"),
        ({"summary": ""}, "a summary is 1-1000 characters"),
        ({"limits": ToolLimits(fuel=1000), "runner": RunnerKind.PROCESS}, "only a wasm tool"),
    ],
)
def test_a_manifest_refuses_what_no_tool_can_be(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        manifest(**fields)


@pytest.mark.parametrize(
    "limits",
    [{"timeout_s": 0}, {"timeout_s": -1.0}, {"memory_bytes": 0}, {"fuel": -5}],
)
def test_limits_are_more_than_zero(limits: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be more than 0"):
        ToolLimits(**limits)


def test_a_wasm_manifest_carries_every_limit() -> None:
    limits = ToolLimits(timeout_s=2.5, memory_bytes=64 << 20, fuel=10_000_000)
    assert manifest(limits=limits).limits == limits
