"""The names a model calls a conversation's extra tools by (gatewayd/conversation.py):
what providers accept as a function name ([a-zA-Z0-9_-], at most 64), one to one with
the gateway names (mcp.<server>.<tool> has dots; an app's app_<id> has none)."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatewayd.conversation import MAX_FUNCTION_NAME_CHARS, function_name, tool_definitions
from gatewayd.protocol import MAX_ID_CHARS, TOOL_NAME_RE
from gatewayd.tools import builtin_tools
from gatewayd.tools.manifest import RunnerKind, ToolManifest

PROVIDER_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
SEGMENT = st.from_regex(r"[a-z][a-z0-9_]{0,40}", fullmatch=True)
GATEWAY_NAMES = (
    st.lists(SEGMENT, min_size=1, max_size=4)
    .map(".".join)
    .filter(lambda name: len(name) <= MAX_ID_CHARS)
)


@pytest.mark.parametrize(
    ("tool", "name"),
    [
        ("app_note_taker", "app_note_taker"),
        ("mcp.time.get_current_time", "mcp-time-get_current_time"),
    ],
)
def test_a_dotted_name_has_hyphens_for_the_model_and_an_app_keeps_its_own(
    tool: str, name: str
) -> None:
    assert function_name(tool) == name


@given(GATEWAY_NAMES)
def test_every_gateway_name_becomes_a_name_providers_accept(tool: str) -> None:
    assert TOOL_NAME_RE.fullmatch(tool)
    assert PROVIDER_NAME.fullmatch(function_name(tool))


@given(GATEWAY_NAMES, GATEWAY_NAMES)
def test_two_gateway_names_never_share_a_function_name(a: str, b: str) -> None:
    if a != b:
        assert function_name(a) != function_name(b)


def test_a_long_name_is_cut_and_ends_in_a_digest_of_the_whole() -> None:
    long = "mcp." + "s" * 32 + "." + "t" * 80
    cut = function_name(long)
    assert len(cut) == MAX_FUNCTION_NAME_CHARS
    assert cut != function_name(long[:-1] + "u")


def manifest(name: str, **changes: Any) -> ToolManifest:
    fields: dict[str, Any] = {
        "name": name,
        "version": "pin-0123456789ab",
        "summary": "Echo the text back.",
        "argsSchema": {"type": "object", "properties": {"text": {"type": "string"}}},
        "runner": "mcp",
        **changes,
    }
    return msgspec.convert(fields, ToolManifest)


def test_an_mcp_tool_is_offered_with_its_summary_and_its_pinned_schema() -> None:
    tools = tool_definitions(builtin_tools(), [manifest("mcp.misc.echo")])
    assert [t["function"]["name"] for t in tools] == [
        "read",
        "write",
        "edit",
        "list",
        "exec",
        "mcp-misc-echo",
    ]
    echo = tools[-1]["function"]
    assert echo["description"] == "Echo the text back."
    assert echo["parameters"] == {"type": "object", "properties": {"text": {"type": "string"}}}
    assert manifest("mcp.misc.echo").runner is RunnerKind.MCP
