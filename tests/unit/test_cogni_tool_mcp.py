"""``cogni-tool mcp``'s protocol handling: lines in, lines out, against a fake gateway.

The session (cogni_tool.mcp_server.McpSession) is fed lines and its written lines are
read back; the gateway is a Python object with ``call``/``close``, scripted per test.
The last tests start the real ``cogni-tool mcp`` process against the fake gateway socket
of test_cogni_tool_client. The official SDK client's view is in
tests/integration/test_mcp_stdio_sandbox.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cogni_tool import __version__
from cogni_tool import mcp_protocol as mcp
from cogni_tool.client import ConnectionFailed, ToolError
from cogni_tool.mcp_server import MAX_LINE_BYTES, McpSession, Workers
from gatewayd import protocol
from gatewayd.tools import builtin_tools
from tests.hypothesis_counts import examples
from tests.unit.test_cogni_tool_client import RUN_ID, FakeGateway, fake_gateway

REPO_ROOT = Path(__file__).resolve().parents[2]
WIRE_CODES = [code.value for code in protocol.ErrorCode]
MANIFESTS: list[dict[str, Any]] = [
    {"name": "tools.list", "summary": "List the tools.", "argsSchema": {"type": "object"}},
    *(msgspec.to_builtins(tool.manifest) for tool in builtin_tools().values()),
]
LISTED = [m["name"] for m in MANIFESTS if m["name"] != "tools.list"]


class FakeClient:
    """A gateway connection: answers from ``gateway.answer(tool, args)``."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.closed = False

    def call(self, tool: str, args: dict[str, Any] | None = None) -> Any:
        return self.gateway.answer(tool, args or {})

    def close(self) -> None:
        self.closed = True


class Gateway:
    """The run's gateway as the session sees it: tools.list, echo, and scripted errors."""

    def __init__(self, manifests: list[dict[str, Any]] = MANIFESTS) -> None:
        self.manifests = manifests
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.clients: list[FakeClient] = []
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Semaphore(0)
        self.lock = threading.Lock()

    def connect(self) -> FakeClient:
        client = FakeClient(self)
        with self.lock:
            self.clients.append(client)
        return client

    def answer(self, tool: str, args: dict[str, Any]) -> Any:
        with self.lock:
            self.calls.append((tool, args))
        if tool == "tools.list":
            return self.manifests
        if tool == "block":
            self.entered.release()
            self.release.wait(10)
            return {"unblocked": True}
        if tool == "fail":
            raise ToolError(args["code"], args["message"], "1-1")
        if tool == "gone":
            raise ConnectionFailed("the gateway at /run/cogni/gateway.sock went away")
        if tool == "boom":
            raise RuntimeError("a bug")
        if tool == "scalar":
            return 42
        return {"tool": tool, "args": args}


class Peer:
    """The MCP client's side: send lines, read what the session wrote."""

    def __init__(self, gateway: Gateway | None = None, **options: Any) -> None:
        self.gateway = gateway or Gateway()
        self.lines: list[bytes] = []
        self.cond = threading.Condition()
        self.session = McpSession(self.gateway.connect, self._write, **options)

    def _write(self, data: bytes) -> None:
        assert data.endswith(b"\n") and data.count(b"\n") == 1  # one message, one line
        with self.cond:
            self.lines.append(data)
            self.cond.notify_all()

    def send(self, obj: Any) -> None:
        self.session.receive_line(json.dumps(obj).encode() + b"\n")

    def raw(self, line: bytes) -> None:
        self.session.receive_line(line)

    def messages(self) -> list[Any]:
        with self.cond:
            return [json.loads(line) for line in self.lines]

    def take(self, count: int = 1, seconds: float = 5.0) -> list[Any]:
        """The next ``count`` messages written (waiting for them)."""
        deadline = time.monotonic() + seconds
        with self.cond:
            while len(self.lines) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"wanted {count} messages, got {self.lines}")
                self.cond.wait(left)
            taken, self.lines = self.lines[:count], self.lines[count:]
        return [json.loads(line) for line in taken]

    def request(self, method: str, params: dict[str, Any] | None = None, rid: Any = 1) -> Any:
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)
        (answer,) = self.take()
        return answer

    def initialize(self, version: str = mcp.LATEST_VERSION) -> Any:
        answer = self.request("initialize", {"protocolVersion": version, "capabilities": {}})
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return answer

    def call(self, name: str, arguments: Any = None, rid: Any = 7, **params: Any) -> Any:
        body: dict[str, Any] = {"name": name, **params}
        if arguments is not None:
            body["arguments"] = arguments
        return self.request("tools/call", body, rid)


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    yield p
    assert p.session.wait(5)
    p.session.close()


def error_of(answer: Any, rid: Any = 1) -> tuple[int, str]:
    assert answer["jsonrpc"] == "2.0" and answer["id"] == rid, answer
    assert "result" not in answer, answer
    return answer["error"]["code"], answer["error"]["message"]


# --- the handshake -----------------------------------------------------------------------


@pytest.mark.parametrize("version", mcp.SUPPORTED_VERSIONS)
def test_initialize_answers_the_clients_version_when_supported(peer: Peer, version: str) -> None:
    answer = peer.initialize(version)
    assert answer["id"] == 1
    result = answer["result"]
    assert result["protocolVersion"] == version
    assert result["capabilities"] == {"tools": {"listChanged": False}}
    assert result["serverInfo"] == {"name": "cogni-tool", "version": __version__}
    assert "gateway" in result["instructions"]
    assert peer.session.version == version and peer.session.initialized


@pytest.mark.parametrize("version", ["2024-10-07", "1.0", "2099-01-01", ""])
def test_initialize_answers_the_latest_version_for_one_it_does_not_speak(
    peer: Peer, version: str
) -> None:
    assert peer.initialize(version)["result"]["protocolVersion"] == mcp.LATEST_VERSION


@pytest.mark.parametrize("params", [{}, {"protocolVersion": 20250618}, {"protocolVersion": None}])
def test_initialize_without_a_string_version_is_invalid_params_naming_the_versions(
    peer: Peer, params: dict[str, Any]
) -> None:
    code, message = error_of(peer.request("initialize", params))
    assert code == mcp.INVALID_PARAMS
    assert "protocolVersion" in message and "2025-06-18" in message
    assert peer.session.version is None


def test_a_second_initialize_is_refused_and_keeps_the_first_version(peer: Peer) -> None:
    peer.initialize("2025-03-26")
    code, message = error_of(peer.request("initialize", {"protocolVersion": "2025-06-18"}))
    assert code == mcp.INVALID_REQUEST and "already initialized" in message
    assert peer.session.version == "2025-03-26"


@pytest.mark.parametrize("method", ["tools/list", "tools/call"])
def test_requests_before_initialize_are_refused_but_ping_is_answered(
    peer: Peer, method: str
) -> None:
    code, message = error_of(peer.request(method, {"name": "time.now"}))
    assert code == mcp.INVALID_REQUEST and "send initialize first" in message
    assert peer.request("ping", rid="p") == {"jsonrpc": "2.0", "id": "p", "result": {}}
    assert peer.gateway.calls == []


@pytest.mark.parametrize("method", ["server/discover", "resources/list"])
def test_an_unknown_method_before_initialize_is_method_not_found(peer: Peer, method: str) -> None:
    # The SDK's default client probes server/discover first, then falls back to initialize.
    code, message = error_of(peer.request(method, {}))
    assert code == mcp.METHOD_NOT_FOUND and method in message
    assert peer.initialize()["result"]["protocolVersion"] == mcp.LATEST_VERSION


def test_ping_after_initialize_is_an_empty_result(peer: Peer) -> None:
    peer.initialize()
    assert peer.request("ping", rid=9)["result"] == {}


# --- tools/list ----------------------------------------------------------------------------


def test_tools_list_is_the_gateways_list_without_tools_list_with_summaries(peer: Peer) -> None:
    peer.initialize()
    answer = peer.request("tools/list", rid=2)
    tools = answer["result"]["tools"]
    assert [t["name"] for t in tools] == LISTED
    assert "nextCursor" not in answer["result"]
    by_name = {m["name"]: m for m in MANIFESTS}
    for tool in tools:
        assert tool["description"] == by_name[tool["name"]]["summary"]
    assert peer.gateway.calls == [("tools.list", {})]


def test_every_builtin_schema_becomes_an_object_schema_the_gateway_would_accept(
    peer: Peer,
) -> None:
    peer.initialize()
    tools = {t["name"]: t for t in peer.request("tools/list")["result"]["tools"]}
    for name, tool in tools.items():
        schema = tool["inputSchema"]
        assert schema["type"] == "object", name
        assert "$ref" not in schema, name  # hoisted: the top is the object itself
        assert "properties" in schema, name
    assert "path" in tools["fs.read"]["inputSchema"]["properties"]
    assert "path" in tools["fs.read"]["inputSchema"]["required"]


def test_a_hoisted_schema_keeps_its_defs_when_it_refers_into_them() -> None:
    nested = {
        "$ref": "#/$defs/Outer",
        "$defs": {
            "Outer": {"type": "object", "properties": {"in": {"$ref": "#/$defs/Inner"}}},
            "Inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
    schema = mcp.input_schema(nested)
    assert schema["type"] == "object" and schema["properties"]["in"] == {"$ref": "#/$defs/Inner"}
    assert schema["$defs"]["Inner"]["properties"] == {"x": {"type": "integer"}}
    flat = mcp.input_schema({"$ref": "#/$defs/A", "$defs": {"A": {"type": "object"}}})
    assert flat == {"type": "object"}


@pytest.mark.parametrize(
    ("args_schema", "expected"),
    [
        (None, {"type": "object"}),
        ([], {"type": "object"}),
        ({}, {"type": "object"}),
        ({"properties": {"a": {}}}, {"properties": {"a": {}}, "type": "object"}),
        ({"type": "array"}, {"type": "object"}),
        ({"$ref": "#/$defs/Missing", "$defs": {}}, {"$ref": "#/$defs/Missing", "$defs": {}}),
        ({"anyOf": [{"type": "object"}]}, {"anyOf": [{"type": "object"}], "type": "object"}),
    ],
)
def test_every_input_schema_has_type_object_at_the_top(args_schema: Any, expected: Any) -> None:
    schema = mcp.input_schema(args_schema)
    assert schema["type"] == "object"
    if expected.get("$ref"):
        expected = {**expected, "type": "object"}
    assert schema == expected


def test_side_effect_free_tools_are_read_only_where_the_version_has_annotations(
    peer: Peer,
) -> None:
    peer.initialize("2025-06-18")
    tools = {t["name"]: t for t in peer.request("tools/list")["result"]["tools"]}
    assert tools["fs.read"]["annotations"] == {"readOnlyHint": True}
    assert "annotations" not in tools["fs.write"]
    old = Peer()
    old.initialize("2024-11-05")
    assert all("annotations" not in t for t in old.request("tools/list")["result"]["tools"])


def test_tools_list_pages_follow_the_cursor_to_the_end() -> None:
    peer = Peer(page_size=3)
    peer.initialize()
    names: list[str] = []
    cursor = None
    pages = 0
    while True:
        answer = peer.request("tools/list", {} if cursor is None else {"cursor": cursor})
        names += [t["name"] for t in answer["result"]["tools"]]
        pages += 1
        cursor = answer["result"].get("nextCursor")
        if cursor is None:
            break
        assert isinstance(cursor, str)
    assert names == LISTED and pages == -(-len(LISTED) // 3)


@pytest.mark.parametrize(
    "cursor", ["abc", "-1", "0", "99", "", "1" * 30, "\u00b2", "3.0", " 3", 3, None, ["3"], True]
)
def test_a_cursor_this_server_never_gave_is_invalid_params(peer: Peer, cursor: Any) -> None:
    peer.initialize()
    answer = peer.request("tools/list", {"cursor": cursor})
    if cursor is None:  # null is no cursor: the first page
        assert answer["result"]["tools"]
        return
    code, message = error_of(answer)
    assert code == mcp.INVALID_PARAMS
    assert "cursor" in message and "list again without a cursor" in message


@pytest.mark.parametrize(
    ("error", "fragment"),
    [
        (ToolError("rate_limited", "the run's call budget is spent", None), "rate_limited"),
        (ConnectionFailed("no gateway socket"), "no gateway socket"),
    ],
)
def test_tools_list_the_gateway_cannot_answer_is_an_internal_error_saying_why(
    error: Exception, fragment: str
) -> None:
    gateway = Gateway()

    def refuse(tool: str, args: dict[str, Any]) -> Any:
        raise error

    gateway.answer = refuse  # type: ignore[method-assign]
    peer = Peer(gateway)
    peer.initialize()
    code, message = error_of(peer.request("tools/list"))
    assert code == mcp.INTERNAL_ERROR and fragment in message and "list this run's tools" in message


@pytest.mark.parametrize("listing", [{"tools": []}, [1, 2], [{"summary": "no name"}], None])
def test_a_garbled_tools_list_answer_is_an_internal_error(listing: Any) -> None:
    peer = Peer(Gateway(manifests=listing))
    peer.initialize()
    code, message = error_of(peer.request("tools/list"))
    assert code == mcp.INTERNAL_ERROR and "tool manifests" in message


# --- tools/call ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["2025-06-18", "2025-11-25"])
def test_a_call_answers_the_gateways_value_as_text_and_structured_content(
    peer: Peer, version: str
) -> None:
    peer.initialize(version)
    answer = peer.call("fs.read", {"path": "notes.md"})
    result = answer["result"]
    assert answer["id"] == 7 and result["isError"] is False
    value = {"tool": "fs.read", "args": {"path": "notes.md"}}
    assert result["content"] == [{"type": "text", "text": json.dumps(value, separators=(",", ":"))}]
    assert result["structuredContent"] == value
    assert peer.gateway.calls == [("fs.read", {"path": "notes.md"})]


@pytest.mark.parametrize("version", ["2024-11-05", "2025-03-26"])
def test_versions_without_structured_content_get_only_the_text(peer: Peer, version: str) -> None:
    peer.initialize(version)
    result = peer.call("time.now", {})["result"]
    assert "structuredContent" not in result
    assert json.loads(result["content"][0]["text"]) == {"tool": "time.now", "args": {}}


def test_a_value_that_is_not_an_object_is_text_only(peer: Peer) -> None:
    peer.initialize("2025-06-18")
    result = peer.call("scalar")["result"]
    assert result["content"][0]["text"] == "42" and "structuredContent" not in result


def test_a_call_without_arguments_sends_an_empty_object(peer: Peer) -> None:
    peer.initialize()
    peer.call("time.now")
    peer.call("time.now", rid=8, arguments=None)
    assert peer.gateway.calls == [("time.now", {}), ("time.now", {})]


@pytest.mark.parametrize("code", WIRE_CODES)
def test_every_gateway_refusal_is_a_tool_error_with_the_gateways_message(
    peer: Peer, code: str
) -> None:
    peer.initialize()
    message = f"{code} happened: writable paths are /workspace/out"
    answer = peer.call("fail", {"code": code, "message": message})
    assert "error" not in answer  # never a protocol error
    result = answer["result"]
    assert result["isError"] is True
    assert result["content"] == [{"type": "text", "text": f"{code}: {message}"}]


def test_a_gateway_that_cannot_be_reached_is_a_tool_error_too(peer: Peer) -> None:
    peer.initialize()
    result = peer.call("gone")["result"]
    assert result["isError"] is True
    assert result["content"][0]["text"].startswith("connection_failed: the gateway at")


def test_a_bug_answering_is_an_internal_error_not_a_hang(peer: Peer) -> None:
    peer.initialize()
    code, message = error_of(peer.call("boom"), rid=7)
    assert code == mcp.INTERNAL_ERROR and "RuntimeError: a bug" in message


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({}, "needs name"),
        ({"name": ""}, "needs name"),
        ({"name": 5}, "needs name"),
        ({"name": "fs.read", "arguments": ["notes.md"]}, "must be a JSON object, got an array"),
        ({"name": "fs.read", "arguments": "notes.md"}, "must be a JSON object, got str"),
    ],
)
def test_a_malformed_call_is_invalid_params_and_reaches_no_gateway(
    peer: Peer, params: dict[str, Any], fragment: str
) -> None:
    peer.initialize()
    code, message = error_of(peer.request("tools/call", params, rid=3), rid=3)
    assert code == mcp.INVALID_PARAMS and fragment in message
    assert peer.gateway.calls == []


# --- progress and cancellation ---------------------------------------------------------------


@pytest.mark.parametrize("token", ["tok-1", 17])
def test_a_progress_token_gets_a_start_and_an_end_before_the_answer(peer: Peer, token: Any) -> None:
    peer.initialize("2025-06-18")
    peer.send(
        {
            "jsonrpc": "2.0",
            "id": 5,
            "method": "tools/call",
            "params": {"name": "time.now", "_meta": {"progressToken": token}},
        }
    )
    start, end, answer = peer.take(3)
    for note, done in ((start, 0), (end, 1)):
        assert note["method"] == "notifications/progress" and "id" not in note
        assert note["params"]["progressToken"] == token
        assert (note["params"]["progress"], note["params"]["total"]) == (done, 1)
        assert note["params"]["message"].startswith("time.now: ")
    assert answer["id"] == 5 and answer["result"]["isError"] is False


def test_progress_in_2024_11_05_has_no_message(peer: Peer) -> None:
    peer.initialize("2024-11-05")
    peer.send(
        {
            "jsonrpc": "2.0",
            "id": 5,
            "method": "tools/call",
            "params": {"name": "time.now", "_meta": {"progressToken": "t"}},
        }
    )
    start, end, _ = peer.take(3)
    assert "message" not in start["params"] and "message" not in end["params"]


@pytest.mark.parametrize("meta", [None, {}, {"progressToken": None}, {"progressToken": True}])
def test_no_progress_without_a_usable_token(peer: Peer, meta: Any) -> None:
    peer.initialize()
    params: dict[str, Any] = {"name": "time.now"}
    if meta is not None:
        params["_meta"] = meta
    answer = peer.request("tools/call", params, rid=4)
    assert answer["id"] == 4 and answer["result"]["isError"] is False
    assert peer.messages() == []


def test_a_cancelled_call_is_never_answered_while_others_are(peer: Peer) -> None:
    peer.initialize()
    peer.gateway.release.clear()
    peer.send(
        {
            "jsonrpc": "2.0",
            "id": "slow",
            "method": "tools/call",
            "params": {"name": "block", "_meta": {"progressToken": "p"}},
        }
    )
    assert peer.gateway.entered.acquire(timeout=5)  # the call is at the gateway
    (start,) = peer.take()
    assert start["params"]["progress"] == 0
    # The reader is not blocked by the call: ping is answered meanwhile.
    assert peer.request("ping", rid="p1")["result"] == {}
    peer.send(
        {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": "slow", "reason": "the user gave up"},
        }
    )
    peer.gateway.release.set()
    assert peer.session.wait(5)
    assert peer.messages() == []  # neither the end of progress nor the answer
    assert peer.call("time.now", rid="slow")["result"]["isError"] is False  # id free again


def test_a_call_cancelled_while_waiting_for_a_connection_never_reaches_the_gateway() -> None:
    peer = Peer(max_calls=1)
    peer.initialize()
    peer.gateway.release.clear()
    peer.send({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "block"}})
    assert peer.gateway.entered.acquire(timeout=5)
    peer.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "queued"}})
    peer.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 2}})
    peer.gateway.release.set()
    assert peer.session.wait(5)
    answers = peer.messages()
    assert [a["id"] for a in answers] == [1]
    assert [tool for tool, _ in peer.gateway.calls] == ["block"]


def test_cancelling_an_unknown_or_finished_request_changes_nothing(peer: Peer) -> None:
    peer.initialize()
    for request_id in ("nope", 7, None, {"x": 1}):
        peer.send(
            {
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": request_id},
            }
        )
    assert peer.call("time.now")["result"]["isError"] is False


def test_an_id_in_use_by_a_call_in_flight_is_refused(peer: Peer) -> None:
    peer.initialize()
    peer.gateway.release.clear()
    peer.send({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "block"}})
    assert peer.gateway.entered.acquire(timeout=5)
    code, message = error_of(peer.call("time.now", rid=3), rid=3)
    assert code == mcp.INVALID_REQUEST and "already in use" in message
    peer.gateway.release.set()
    (answer,) = peer.take()
    assert answer["result"]["structuredContent"] == {"unblocked": True}


def test_requests_beyond_the_pending_limit_are_refused_at_once() -> None:
    peer = Peer(max_pending=2)
    peer.initialize()
    peer.gateway.release.clear()
    for rid in (1, 2):
        peer.send(
            {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {"name": "block"}}
        )
    assert peer.gateway.entered.acquire(timeout=5)
    code, message = error_of(peer.call("time.now", rid=3), rid=3)
    assert code == mcp.INTERNAL_ERROR and "limit is 2" in message
    peer.gateway.release.set()
    assert sorted(a["id"] for a in peer.take(2)) == [1, 2]
    assert peer.session.wait(5)


def test_connections_are_pooled_and_closed_at_the_end(peer: Peer) -> None:
    peer.initialize()
    for rid in range(5):
        peer.call("time.now", rid=rid)
    assert len(peer.gateway.clients) == 1  # one call at a time: one connection reused
    peer.session.close()
    assert all(client.closed for client in peer.gateway.clients)


# --- JSON-RPC errors -------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["resources/list", "prompts/list", "logging/setLevel", "x"])
def test_unknown_methods_are_method_not_found_naming_what_is_offered(
    peer: Peer, method: str
) -> None:
    peer.initialize()
    code, message = error_of(peer.request(method, {}, rid="m"), rid="m")
    assert code == mcp.METHOD_NOT_FOUND and method in message and "tools/call" in message


@pytest.mark.parametrize(
    "line",
    [b"{", b"not json", b'{"jsonrpc": "2.0", "id": 1,}', b"\xff\xfe{}", b"NaN", b'{"a": Infinity}'],
)
def test_malformed_json_is_a_parse_error_with_a_null_id(peer: Peer, line: bytes) -> None:
    peer.raw(line + b"\n")
    (answer,) = peer.take()
    assert answer["id"] is None and answer["error"]["code"] == mcp.PARSE_ERROR
    assert "not UTF-8 JSON" in answer["error"]["message"]


@pytest.mark.parametrize(
    ("message", "rid", "fragment"),
    [
        (5, None, "a JSON int"),
        ("ping", None, "a JSON str"),
        (None, None, "a JSON NoneType"),
        ({"id": 1, "method": "ping"}, 1, '"jsonrpc" must be "2.0"'),
        ({"jsonrpc": "1.0", "id": 1, "method": "ping"}, 1, '"jsonrpc" must be "2.0"'),
        ({"jsonrpc": "2.0", "id": True, "method": "ping"}, None, "id must be a string"),
        ({"jsonrpc": "2.0", "id": None, "method": "ping"}, None, "id must be a string"),
        ({"jsonrpc": "2.0", "id": 1.5, "method": "ping"}, None, "id must be a string"),
        ({"jsonrpc": "2.0", "id": [1], "method": "ping"}, None, "id must be a string"),
        ({"jsonrpc": "2.0", "id": 1, "method": 3}, 1, '"method" must be a string'),
        ({"jsonrpc": "2.0", "id": 1}, 1, 'no "method"'),
        ({"jsonrpc": "2.0", "id": 1, "method": ""}, 1, '"method" must be a string'),
    ],
)
def test_what_is_not_a_jsonrpc_message_is_an_invalid_request(
    peer: Peer, message: Any, rid: Any, fragment: str
) -> None:
    code, text = error_of(_answer(peer, message), rid=rid)
    assert code == mcp.INVALID_REQUEST and fragment in text


def _answer(peer: Peer, message: Any) -> Any:
    peer.send(message)
    (answer,) = peer.take()
    return answer


@pytest.mark.parametrize("params", [[1, 2], "x", 3])
def test_params_that_are_not_an_object_are_invalid_params(peer: Peer, params: Any) -> None:
    code, message = error_of(
        _answer(peer, {"jsonrpc": "2.0", "id": 1, "method": "ping", "params": params})
    )
    assert code == mcp.INVALID_PARAMS and "params as a JSON object" in message


def test_notifications_and_responses_are_never_answered(peer: Peer) -> None:
    peer.initialize()
    for message in (
        {"jsonrpc": "2.0", "method": "notifications/roots/list_changed"},
        {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progressToken": 1}},
        {"jsonrpc": "2.0", "method": "anything/else"},
        {"jsonrpc": "2.0", "id": 99, "result": {}},
        {"jsonrpc": "2.0", "id": 98, "error": {"code": -1, "message": "no"}},
    ):
        peer.send(message)
    peer.raw(b"\n")
    peer.raw(b"   \r\n")
    assert peer.messages() == []


@settings(max_examples=examples(300), deadline=None)
@given(
    st.one_of(
        st.binary(max_size=64),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=8),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(
                    st.sampled_from(["jsonrpc", "id", "method", "params", "result", "name"]),
                    inner,
                    max_size=4,
                )
            ),
            max_leaves=8,
        ).map(lambda v: json.dumps(v).encode()),
    )
)
def test_garbage_is_answered_by_at_most_one_jsonrpc_message_and_never_raises(
    line: bytes,
) -> None:
    peer = Peer()
    peer.initialize("2025-03-26")  # batches allowed: the widest surface
    peer.raw(line.replace(b"\n", b" ") + b"\n")
    assert peer.session.wait(5)
    answers = peer.messages()
    assert len(answers) <= 1
    for answer in answers:
        for one in answer if isinstance(answer, list) else [answer]:
            assert one["jsonrpc"] == "2.0" and "id" in one
            assert ("result" in one) != ("error" in one)


# --- batches ---------------------------------------------------------------------------------


def test_a_batch_in_2025_03_26_is_answered_with_one_array(peer: Peer) -> None:
    peer.initialize("2025-03-26")
    peer.send(
        [
            {"jsonrpc": "2.0", "id": "a", "method": "ping"},
            {"jsonrpc": "2.0", "method": "notifications/progress", "params": {}},
            {"jsonrpc": "2.0", "id": "b", "method": "tools/call", "params": {"name": "time.now"}},
            {"jsonrpc": "2.0", "id": "c", "method": "nope"},
            {"jsonrpc": "2.0", "id": "d", "method": "initialize", "params": {}},
            7,
        ]
    )
    (answers,) = peer.take()
    assert isinstance(answers, list)
    by_id = {a["id"]: a for a in answers}
    assert by_id["a"]["result"] == {}
    assert by_id["b"]["result"]["isError"] is False
    assert by_id["c"]["error"]["code"] == mcp.METHOD_NOT_FOUND
    assert by_id["d"]["error"]["code"] == mcp.INVALID_REQUEST
    assert "must not be part of a batch" in by_id["d"]["error"]["message"]
    assert by_id[None]["error"]["code"] == mcp.INVALID_REQUEST
    assert len(answers) == 5


def test_a_batch_of_notifications_only_gets_no_answer(peer: Peer) -> None:
    peer.initialize("2025-03-26")
    peer.send([{"jsonrpc": "2.0", "method": "notifications/initialized"}])
    assert peer.session.wait(5) and peer.messages() == []


def test_an_empty_batch_is_an_invalid_request(peer: Peer) -> None:
    peer.initialize("2025-03-26")
    code, message = error_of(_answer(peer, []), rid=None)
    assert code == mcp.INVALID_REQUEST and "empty batch" in message


@pytest.mark.parametrize("version", ["2024-11-05", "2025-06-18", "2025-11-25", None])
def test_batches_are_refused_where_the_version_has_none(peer: Peer, version: str | None) -> None:
    if version is not None:
        peer.initialize(version)
    code, message = error_of(
        _answer(peer, [{"jsonrpc": "2.0", "id": 1, "method": "ping"}]), rid=None
    )
    assert code == mcp.INVALID_REQUEST and "send each message on its own line" in message
    assert (version or "send initialize first") in message


# --- the real process ------------------------------------------------------------------------


def start_mcp(env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-S", "-E", "-c", "from cogni_tool.cli import main; main()", "mcp", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO_ROOT,
        env=env,
    )


def gateway_env(gateway: FakeGateway) -> dict[str, str]:
    return {"COGNI_GATEWAY_SOCK": str(gateway.path), "COGNI_RUN_ID": RUN_ID, "PATH": "/usr/bin"}


def lines(*messages: Any) -> bytes:
    return b"".join(json.dumps(m).encode() + b"\n" for m in messages)


def test_the_process_answers_every_request_even_when_stdin_ends_right_after(
    tmp_path: Path,
) -> None:
    with fake_gateway(tmp_path) as gateway:
        proc = start_mcp(gateway_env(gateway))
        out, err = proc.communicate(
            lines(
                {
                    "jsonrpc": "2.0",
                    "id": 0,
                    "method": "initialize",
                    "params": {"protocolVersion": "2025-06-18", "capabilities": {}},
                },
                {"jsonrpc": "2.0", "method": "notifications/initialized"},
                {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                {
                    "jsonrpc": "2.0",
                    "id": 2,
                    "method": "tools/call",
                    "params": {"name": "echo", "arguments": {"a": "ü"}},
                },
                {
                    "jsonrpc": "2.0",
                    "id": 3,
                    "method": "tools/call",
                    "params": {
                        "name": "fail",
                        "arguments": {"code": "policy_denied", "message": "not on the allowlist"},
                    },
                },
            ),
            timeout=30,
        )
    assert proc.returncode == 0, err
    answers = {a["id"]: a for a in map(json.loads, out.splitlines())}
    assert answers[0]["result"]["protocolVersion"] == "2025-06-18"
    assert [t["name"] for t in answers[1]["result"]["tools"]] == ["fs.read", "time.now"]
    assert answers[2]["result"]["structuredContent"] == {"a": "ü"}
    assert answers[3]["result"] == {
        "content": [{"type": "text", "text": "policy_denied: not on the allowlist"}],
        "isError": True,
    }
    assert [r["runId"] for r in gateway.requests] == [RUN_ID] * 3


def test_the_process_skips_an_oversized_line_and_keeps_serving(tmp_path: Path) -> None:
    with fake_gateway(tmp_path) as gateway:
        proc = start_mcp(gateway_env(gateway))
        big = (
            b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "x": "'
            + b"a" * MAX_LINE_BYTES
            + b'"}\n'
        )
        out, err = proc.communicate(
            big + lines({"jsonrpc": "2.0", "id": 2, "method": "ping"}), timeout=30
        )
    assert proc.returncode == 0, err
    first, second = map(json.loads, out.splitlines())
    assert first["id"] is None and first["error"]["code"] == mcp.INVALID_REQUEST
    assert f"limit of {MAX_LINE_BYTES} bytes" in first["error"]["message"]
    assert second == {"jsonrpc": "2.0", "id": 2, "result": {}}


def test_outside_a_run_the_process_says_so_on_stderr_and_exits_3() -> None:
    proc = start_mcp({"PATH": "/usr/bin"})
    out, err = proc.communicate(b"", timeout=30)
    assert proc.returncode == 3 and out == b""
    assert b"cogni-tool: not_configured: COGNI_GATEWAY_SOCK is not set" in err


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--frob"], b"unknown option '--frob'; cogni-tool mcp takes only --timeout"),
        (["--timeout"], b"--timeout needs a number of seconds"),
        (["--timeout=-1"], b"--timeout takes a number of seconds"),
        (["--timeout", "soon"], b"--timeout takes a number of seconds"),
    ],
)
def test_a_bad_command_line_exits_2_saying_what_is_wrong(
    tmp_path: Path, args: list[str], fragment: bytes
) -> None:
    proc = start_mcp({"PATH": "/usr/bin"}, *args)
    _, err = proc.communicate(b"", timeout=30)
    assert proc.returncode == 2 and err.startswith(b"cogni-tool: usage: ") and fragment in err


def test_help_names_the_command_and_its_option() -> None:
    proc = start_mcp({"PATH": "/usr/bin"}, "--help")
    out, _ = proc.communicate(b"", timeout=30)
    assert proc.returncode == 0 and out.startswith(b"usage: cogni-tool mcp [--timeout SECONDS]")


def test_a_lone_surrogate_from_the_gateway_stays_escaped_on_one_line(peer: Peer) -> None:
    peer.initialize("2025-06-18")
    peer.gateway.answer = lambda tool, args: {"text": "bad \ud800 half"}  # type: ignore[method-assign]
    peer.send({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "x"}})
    with peer.cond:
        assert peer.cond.wait_for(lambda: peer.lines, 5)
        (line,) = peer.lines
    assert line.isascii() and b"\\ud800" in line
    assert json.loads(line)["result"]["structuredContent"] == {"text": "bad \ud800 half"}


def test_cogni_tool_help_lists_the_mcp_command() -> None:
    from cogni_tool.cli import USAGE

    assert "cogni-tool mcp [--timeout SECONDS]" in USAGE
    assert "mcp                 serve the run's tools to an MCP client over stdio" in USAGE


# -- the worker threads --


def _run_and_wait(workers: Workers, job_count: int, together: bool = False) -> set[int]:
    """Submit ``job_count`` jobs and wait for them all; the idents of the threads that
    ran them. ``together``: each job waits until all of them run at once."""
    seen: set[int] = set()
    done = threading.Semaphore(0)
    lock = threading.Lock()
    barrier = threading.Barrier(job_count)

    def job() -> None:
        if together:
            barrier.wait(10)
        with lock:
            seen.add(threading.get_ident())
        done.release()

    for _ in range(job_count):
        workers.submit(job)
    for _ in range(job_count):
        assert done.acquire(timeout=10)
    return seen


def _until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.001)


def test_calls_one_after_another_reuse_one_worker_thread() -> None:
    workers = Workers()
    first = _run_and_wait(workers, 1)
    for _ in range(20):
        _until(lambda: workers.idle == 1)  # the worker is back waiting
        assert _run_and_wait(workers, 1) == first


def test_concurrent_calls_each_get_a_worker_and_none_waits_for_another() -> None:
    workers = Workers()
    # Every job waits until all of them run: only a thread each lets them.
    assert len(_run_and_wait(workers, 8, together=True)) == 8
    # All eight wait for work now: eight more run on them, no new thread.
    _until(lambda: workers.idle == 8)
    before = threading.active_count()
    assert len(_run_and_wait(workers, 8, together=True)) == 8
    assert threading.active_count() == before


def test_an_idle_worker_ends_and_a_later_call_gets_a_new_one() -> None:
    workers = Workers(idle_s=0.05)
    before = threading.active_count()
    assert len(_run_and_wait(workers, 3, together=True)) == 3
    _until(lambda: threading.active_count() == before)
    assert workers.idle == 0
    assert len(_run_and_wait(workers, 1)) == 1


def test_wait_returns_once_every_answer_is_written_by_the_reused_workers(peer: Peer) -> None:
    peer.initialize()
    for round_number in range(3):
        ids = [f"r{round_number}-{n}" for n in range(5)]
        for request_id in ids:
            body = {"name": "time.now", "arguments": {}}
            peer.send({"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": body})
        # No sleep, no take: wait alone must see every answer written.
        assert peer.session.wait(5)
        answered = {message["id"] for message in peer.messages()}
        assert set(ids) <= answered
