"""MCP's streamable HTTP transport at ``cogni-tool serve``'s ``/mcp``, over real sockets.

The real HTTP server of ``cogni-tool serve`` (its handler and cogni_tool.mcp_http) on an
ephemeral loopback port, against the scripted gateway of test_cogni_tool_mcp; requests
are raw ``http.client`` ones, so every header and status is the test's choice. The
protocol inside the messages is test_cogni_tool_mcp's; the official SDK clients' view is
tests/integration/test_mcp_clients_sandbox.py. The last test starts the real
``cogni-tool serve`` process.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cogni_tool import mcp_protocol as mcp
from cogni_tool.mcp_http import (
    MAX_BODY_BYTES,
    SESSION_HEADER,
    VERSION_HEADER,
    McpHttpEndpoint,
    accepts,
    loopback_host,
    loopback_origin,
)
from cogni_tool.mcp_server import MAX_LINE_BYTES
from cogni_tool.serve import _ChatHandler, _ChatServer
from tests.unit.test_cogni_tool_client import RUN_ID, fake_gateway
from tests.unit.test_cogni_tool_mcp import LISTED, Gateway

REPO_ROOT = Path(__file__).resolve().parents[2]
JSON_AND_SSE = "application/json, text/event-stream"


class Answer:
    def __init__(self, response: http.client.HTTPResponse) -> None:
        self.status = response.status
        self.headers = response.headers
        self.raw = response.read()

    @property
    def json(self) -> Any:
        assert self.headers["Content-Type"] == "application/json", self.headers
        return json.loads(self.raw)

    @property
    def error(self) -> tuple[int, str]:
        """The JSON-RPC error of the body: its code and message."""
        error = self.json["error"]
        return error["code"], error["message"]

    @property
    def events(self) -> list[Any]:
        """The messages of an SSE body, in order."""
        assert self.headers["Content-Type"] == "text/event-stream", self.headers
        out = []
        for block in self.raw.decode().split("\n\n"):
            if block:
                fields = dict(line.split(": ", 1) for line in block.splitlines())
                assert fields["event"] == "message"
                out.append(json.loads(fields["data"]))
        return out


class Server:
    """``cogni-tool serve``'s listener in this process, with /mcp over ``gateway``."""

    def __init__(self, gateway: Gateway, **limits: Any) -> None:
        self.gateway = gateway
        self.http = _ChatServer(("127.0.0.1", 0), _ChatHandler)
        self.port = self.http.server_address[1]
        self.http.mcp = McpHttpEndpoint(gateway.connect, port=self.port, **limits)
        self.thread = threading.Thread(
            target=self.http.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.gateway.release.set()
        self.http.shutdown()
        self.http.server_close()
        assert self.http.mcp is not None
        self.http.mcp.close()

    def request(
        self,
        method: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        *,
        raw: bytes | None = None,
        path: str = "/mcp",
    ) -> Answer:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        sent = {"Accept": JSON_AND_SSE, "Content-Type": "application/json"}
        sent.update(headers or {})
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        try:
            conn.request(method, path, body=data, headers={k: v for k, v in sent.items() if v})
            return Answer(conn.getresponse())
        finally:
            conn.close()

    def initialize(self, version: str = mcp.LATEST_VERSION) -> str:
        params = {"protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "t"}}
        answer = self.request("POST", rpc("initialize", params, 0))
        assert answer.status == 200 and answer.json["result"]["protocolVersion"] == version
        session_id = answer.headers[SESSION_HEADER]
        note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        assert self.request("POST", note, {SESSION_HEADER: session_id}).status == 202
        return str(session_id)

    def in_session(
        self,
        session_id: str,
        message: Any,
        version: str | None = mcp.LATEST_VERSION,
        **headers: str,
    ) -> Answer:
        sent = {SESSION_HEADER: session_id, **headers}
        if version is not None:
            sent[VERSION_HEADER] = version
        return self.request("POST", message, sent)


def rpc(method: str, params: dict[str, Any] | None = None, rid: Any = 1) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
    if params is not None:
        message["params"] = params
    return message


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server(Gateway())
    yield s
    s.close()


# --- the exchange as it should go -----------------------------------------------------


def test_initialize_opens_a_session_that_lists_and_calls_with_json_answers(
    server: Server,
) -> None:
    session_id = server.initialize()
    assert 32 <= len(session_id) <= 64
    assert all(0x21 <= ord(c) <= 0x7E for c in session_id)  # visible ASCII, as MCP says
    listed = server.in_session(session_id, rpc("tools/list", {}, 1))
    assert listed.status == 200
    assert [t["name"] for t in listed.json["result"]["tools"]] == LISTED
    called = server.in_session(session_id, rpc("tools/call", {"name": "x.y", "arguments": {}}))
    assert called.json["result"]["structuredContent"] == {"tool": "x.y", "args": {}}
    refused = server.in_session(
        session_id,
        rpc(
            "tools/call", {"name": "fail", "arguments": {"code": "policy_denied", "message": "no"}}
        ),
    )
    assert refused.status == 200 and refused.json["result"]["isError"] is True
    assert refused.json["result"]["content"][0]["text"] == "policy_denied: no"
    # Another initialize opens another session, with another id.
    assert server.initialize() != session_id


def test_a_call_asking_for_progress_is_answered_as_an_event_stream(server: Server) -> None:
    session_id = server.initialize()
    params = {"name": "x.y", "arguments": {}, "_meta": {"progressToken": "p1"}}
    answer = server.in_session(session_id, rpc("tools/call", params, 5))
    assert answer.status == 200
    first, second, result = answer.events
    assert first["method"] == second["method"] == "notifications/progress"
    assert [first["params"]["progress"], second["params"]["progress"]] == [0, 1]
    assert result["id"] == 5 and result["result"]["isError"] is False


def test_a_client_accepting_only_event_streams_gets_one(server: Server) -> None:
    session_id = server.initialize()
    answer = server.in_session(session_id, rpc("ping"), Accept="text/event-stream")
    assert answer.events == [{"jsonrpc": "2.0", "id": 1, "result": {}}]


def test_a_client_accepting_only_json_gets_no_progress_but_its_answer(server: Server) -> None:
    session_id = server.initialize()
    params = {"name": "x.y", "_meta": {"progressToken": 1}}
    answer = server.in_session(session_id, rpc("tools/call", params), Accept="application/json")
    assert answer.json["result"]["isError"] is False


def test_notifications_and_responses_are_accepted_with_202_and_no_body(server: Server) -> None:
    session_id = server.initialize()
    note = {"jsonrpc": "2.0", "method": "notifications/roots/list_changed"}
    response = {"jsonrpc": "2.0", "id": 9, "result": {}}
    for message in (note, response):
        answer = server.in_session(session_id, message)
        assert (answer.status, answer.raw) == (202, b"")


def test_a_cancelled_call_gets_no_answer_and_the_session_goes_on(server: Server) -> None:
    session_id = server.initialize()
    server.gateway.release.clear()
    answers: list[Answer] = []
    waiting = threading.Thread(
        target=lambda: answers.append(
            server.in_session(session_id, rpc("tools/call", {"name": "block"}, 3))
        )
    )
    waiting.start()
    assert server.gateway.entered.acquire(timeout=5)
    cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 3}}
    assert server.in_session(session_id, cancel).status == 202
    server.gateway.release.set()
    waiting.join(10)
    assert [(a.status, a.raw) for a in answers] == [(202, b"")]
    assert server.in_session(session_id, rpc("ping")).json["result"] == {}


def test_a_2025_03_26_session_takes_a_batch_in_one_post(server: Server) -> None:
    session_id = server.initialize("2025-03-26")
    batch = [rpc("ping", None, 1), rpc("tools/call", {"name": "x.y"}, 2)]
    answer = server.in_session(session_id, batch, "2025-03-26")
    assert sorted(a["id"] for a in answer.json) == [1, 2]


def test_without_the_version_header_the_negotiated_version_holds(server: Server) -> None:
    session_id = server.initialize("2025-03-26")
    answer = server.in_session(session_id, rpc("tools/call", {"name": "x.y"}), version=None)
    # 2025-03-26 has no structuredContent: the session's version, not the newest.
    assert answer.status == 200 and "structuredContent" not in answer.json["result"]


def test_delete_ends_the_session(server: Server) -> None:
    session_id = server.initialize()
    ended = server.request("DELETE", None, {SESSION_HEADER: session_id})
    assert (ended.status, ended.raw) == (204, b"")
    after = server.in_session(session_id, rpc("ping"))
    assert after.status == 404
    assert "initialize again" in after.error[1]


# --- refusals: the status, and a message that says what to do ----------------------------


def test_a_request_without_a_session_id_is_400_saying_to_initialize_first(
    server: Server,
) -> None:
    answer = server.request("POST", rpc("tools/list"))
    assert answer.status == 400
    code, message = answer.error
    assert code == mcp.INVALID_REQUEST
    assert f"no {SESSION_HEADER} header: send initialize first" in message


def test_a_probe_for_an_unknown_method_before_a_session_is_method_not_found(
    server: Server,
) -> None:
    # The SDK clients probe server/discover first and fall back to initialize on this.
    answer = server.request("POST", rpc("server/discover", {}, 4))
    assert answer.status == 400
    assert answer.json["id"] == 4
    code, message = answer.error
    assert code == mcp.METHOD_NOT_FOUND and "'server/discover'" in message
    assert "initialize" in message


@pytest.mark.parametrize("session_id", ["no-such-session", "", "x" * 300])
def test_an_unknown_session_id_is_404_saying_to_initialize_again(
    server: Server, session_id: str
) -> None:
    server.initialize()
    answer = server.request(
        "POST", rpc("ping"), {SESSION_HEADER: session_id or " ", VERSION_HEADER: ""}
    )
    assert answer.status == 404
    code, message = answer.error
    assert code == mcp.INVALID_REQUEST
    assert "is not open here" in message and f"without {SESSION_HEADER}" in message


@pytest.mark.parametrize(
    ("version", "fragment"),
    [
        ("2024-10-07", "is not a version this server speaks (2024-11-05, "),
        ("2025-03-26", "is not this session's: it negotiated 2025-11-25"),
        ("2024-11-05", "is not this session's: it negotiated 2025-11-25"),
        ("latest", "is not a version this server speaks"),
    ],
)
def test_a_wrong_or_old_protocol_version_header_is_400_naming_the_right_one(
    server: Server, version: str, fragment: str
) -> None:
    session_id = server.initialize()
    answer = server.in_session(session_id, rpc("tools/list"), version)
    assert answer.status == 400
    code, message = answer.error
    assert code == mcp.INVALID_REQUEST
    assert message.startswith(f"{VERSION_HEADER} {version!r} ") and fragment in message
    assert "send '2025-11-25' or no header" in message
    assert server.gateway.calls == []  # refused before the gateway was asked anything


@pytest.mark.parametrize(
    "origin",
    [
        "http://evil.example",
        "https://evil.example:8443",
        "http://127.0.0.1.evil.example",
        "http://localhost.evil.example:11411",
        "http://user@127.0.0.1",
        "null",
        "file://",
        "ftp://127.0.0.1",
        "http://127.0.0.1:notaport",
        "http://[::1",
        "http://10.0.0.1",
    ],
)
def test_an_origin_off_the_loopback_is_403_naming_dns_rebinding(
    server: Server, origin: str
) -> None:
    answer = server.request(
        "POST", rpc("initialize", {"protocolVersion": "2025-11-25"}), {"Origin": origin}
    )
    assert answer.status == 403
    assert answer.headers["Connection"] == "close"
    code, message = answer.error
    assert code == mcp.INVALID_REQUEST
    assert f"Origin {origin!r} is refused" in message and "DNS rebinding" in message
    assert SESSION_HEADER not in answer.headers


@pytest.mark.parametrize(
    "origin",
    ["http://127.0.0.1", "http://localhost:3000", "https://[::1]:8443", "http://127.0.0.1/"],
)
def test_an_origin_on_the_loopback_is_served(server: Server, origin: str) -> None:
    answer = server.request(
        "POST", rpc("initialize", {"protocolVersion": "2025-11-25"}), {"Origin": origin}
    )
    assert answer.status == 200 and answer.headers[SESSION_HEADER]


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1:1", "x:y"])
def test_a_host_that_is_not_this_listener_is_421(server: Server, host: str) -> None:
    host = host.format(port=server.port)
    answer = server.request("POST", rpc("ping"), {"Host": host})
    assert answer.status == 421
    _, message = answer.error
    assert f"Host {host!r} is refused" in message and f"on port {server.port}" in message


def test_an_oversized_body_is_413_unread_and_the_connection_closed() -> None:
    server = Server(Gateway(), max_body=300)
    try:
        session_id = server.initialize()
        big = json.dumps(rpc("ping", {"x": "a" * 300})).encode()
        answer = server.request(
            "POST", raw=big, headers={SESSION_HEADER: session_id, VERSION_HEADER: "2025-11-25"}
        )
    finally:
        server.close()
    assert answer.status == 413 and answer.headers["Connection"] == "close"
    code, message = answer.error
    assert code == mcp.INVALID_REQUEST
    assert "at most 300 bytes (one JSON-RPC message)" in message
    assert repr(str(len(big))) in message


def test_the_body_limit_is_one_stdio_line() -> None:
    assert MAX_BODY_BYTES == MAX_LINE_BYTES


def test_a_claimed_length_beyond_the_limit_is_refused_before_reading(server: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.putrequest("POST", "/mcp")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(1 << 40))
    conn.endheaders()  # and no body at all: the server must not wait for it
    response = conn.getresponse()
    assert response.status == 413
    conn.close()


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b'{"jsonrpc": "2.0", "id": 1', "parse error: the body is not UTF-8 JSON"),
        (b"\xff\xfe", "parse error: the body is not UTF-8 JSON"),
        (b'{"x": NaN}', "parse error"),
        (b"", "parse error"),
    ],
)
def test_a_body_that_is_not_json_is_400_parse_error(
    server: Server, raw: bytes, fragment: str
) -> None:
    answer = server.request("POST", raw=raw)
    assert answer.status == 400
    code, message = answer.error
    assert code == mcp.PARSE_ERROR and fragment in message


def test_a_malformed_notification_is_400_with_the_json_rpc_error(server: Server) -> None:
    session_id = server.initialize()
    answer = server.in_session(session_id, {"jsonrpc": "1.0", "method": "notifications/x"})
    assert answer.status == 400
    code, message = answer.error
    assert code == mcp.INVALID_REQUEST and '"jsonrpc" must be "2.0"' in message


@pytest.mark.parametrize(
    ("headers", "status", "fragment"),
    [
        ({"Content-Type": "text/plain"}, 415, "Content-Type 'text/plain' is refused"),
        ({"Content-Type": ""}, 415, "Content-Type 'none' is refused"),
        ({"Accept": "text/html"}, 406, "allows neither application/json nor text/event-stream"),
        ({"Transfer-Encoding": "chunked"}, 411, "send the body with a Content-Length"),
    ],
)
def test_a_post_the_transport_cannot_take_says_why(
    server: Server, headers: dict[str, str], status: int, fragment: str
) -> None:
    body = b"5\r\nhello\r\n0\r\n\r\n" if "Transfer-Encoding" in headers else b"{}"
    answer = server.request("POST", raw=body, headers=headers)
    assert answer.status == status
    assert fragment in answer.error[1]


def test_a_failed_initialize_opens_no_session(server: Server) -> None:
    answer = server.request("POST", rpc("initialize", {"capabilities": {}}))
    assert answer.status == 200 and SESSION_HEADER not in answer.headers
    code, message = answer.error
    assert code == mcp.INVALID_PARAMS and "protocolVersion" in message


def test_get_is_405_saying_there_is_no_server_stream(server: Server) -> None:
    session_id = server.initialize()
    answer = server.request(
        "GET", None, {SESSION_HEADER: session_id, "Accept": "text/event-stream"}
    )
    assert answer.status == 405 and answer.headers["Allow"] == "POST, DELETE"
    assert "sends nothing unasked" in answer.error[1]


@pytest.mark.parametrize(
    ("session_id", "status", "fragment"),
    [
        (None, 400, "DELETE /mcp ends the session it names"),
        ("no-such-session", 404, "is not open here"),
    ],
)
def test_delete_without_a_known_session_says_so(
    server: Server, session_id: str | None, status: int, fragment: str
) -> None:
    answer = server.request("DELETE", None, {SESSION_HEADER: session_id} if session_id else {})
    assert answer.status == status and fragment in answer.error[1]


def test_the_chat_routes_stay_and_the_404_names_mcp(server: Server) -> None:
    answer = server.request("POST", {}, path="/v2/nothing")
    assert answer.status == 404
    assert "MCP at /mcp" in json.loads(answer.raw)["error"]["message"]


# --- limits ----------------------------------------------------------------------------


def test_past_the_session_limit_the_least_recently_used_idle_session_ends() -> None:
    server = Server(Gateway(), max_sessions=2)
    try:
        first, second = server.initialize(), server.initialize()
        assert server.in_session(first, rpc("ping")).status == 200  # second is now the oldest
        third = server.initialize()
        assert server.in_session(second, rpc("ping")).status == 404
        for alive in (first, third):
            assert server.in_session(alive, rpc("ping")).status == 200
    finally:
        server.close()


def test_when_every_session_is_busy_a_new_one_is_503() -> None:
    server = Server(Gateway(), max_sessions=1)
    try:
        busy = server.initialize()
        server.gateway.release.clear()
        waiting = threading.Thread(
            target=server.in_session, args=(busy, rpc("tools/call", {"name": "block"}))
        )
        waiting.start()
        assert server.gateway.entered.acquire(timeout=5)
        answer = server.request("POST", rpc("initialize", {"protocolVersion": "2025-11-25"}))
        assert answer.status == 503
        assert "all 1 sessions this server holds are answering requests" in answer.error[1]
        server.gateway.release.set()
        waiting.join(10)
    finally:
        server.close()


def test_past_the_open_post_limit_a_request_is_503_and_served_again_after() -> None:
    server = Server(Gateway(), max_posts=1)
    try:
        session_id = server.initialize()
        server.gateway.release.clear()
        waiting = threading.Thread(
            target=server.in_session, args=(session_id, rpc("tools/call", {"name": "block"}, 2))
        )
        waiting.start()
        assert server.gateway.entered.acquire(timeout=5)
        refused = server.in_session(session_id, rpc("ping", None, 3))
        assert refused.status == 503
        assert "1 requests are already waiting for answers here" in refused.error[1]
        server.gateway.release.set()
        waiting.join(10)
        assert server.in_session(session_id, rpc("ping", None, 4)).status == 200
    finally:
        server.close()


def test_sessions_share_one_pool_of_gateway_connections(server: Server) -> None:
    sessions = [server.initialize() for _ in range(5)]
    for session_id in sessions:
        assert server.in_session(session_id, rpc("tools/call", {"name": "x.y"})).status == 200
    # One connection, reused by every session: their number does not multiply the run's.
    assert len(server.gateway.clients) == 1


def test_initialize_inside_an_open_session_is_refused_by_the_session(server: Server) -> None:
    session_id = server.initialize()
    again = server.in_session(session_id, rpc("initialize", {"protocolVersion": "2025-11-25"}))
    assert again.status == 200 and SESSION_HEADER not in again.headers
    code, message = again.error
    assert code == mcp.INVALID_REQUEST and "already initialized" in message
    assert "POST initialize without Mcp-Session-Id" in message


def test_a_client_leaving_an_event_stream_gives_its_slot_back() -> None:
    server = Server(Gateway(), max_posts=1)
    try:
        session_id = server.initialize()
        server.gateway.release.clear()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        params = {"name": "block", "_meta": {"progressToken": 1}}
        headers = {
            "Content-Type": "application/json",
            "Accept": JSON_AND_SSE,
            SESSION_HEADER: session_id,
        }
        conn.request("POST", "/mcp", json.dumps(rpc("tools/call", params, 2)), headers)
        response = conn.getresponse()
        assert response.headers["Content-Type"] == "text/event-stream"
        assert b"notifications/progress" in response.readline() + response.readline()
        response.close()  # the client leaves mid-stream (the stream holds the socket)
        conn.close()
        server.gateway.release.set()  # the answer meets a closed connection
        deadline = time.monotonic() + 5
        while server.in_session(session_id, rpc("ping", None, 3)).status == 503:
            assert time.monotonic() < deadline, "the stream's slot never came back"
            time.sleep(0.01)
    finally:
        server.close()


# --- the pure checks -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, (True, True)),
        ("*/*", (True, True)),
        ("application/json", (True, False)),
        ("text/event-stream;q=0.5", (False, True)),
        ("Application/JSON , TEXT/EVENT-STREAM", (True, True)),
        ("text/html", (False, False)),
    ],
)
def test_accepts(header: str | None, expected: tuple[bool, bool]) -> None:
    assert accepts(header) == expected


def test_loopback_host_and_origin_take_only_loopback_names() -> None:
    assert loopback_host("127.0.0.1:80", 80) and loopback_host("localhost", 80)
    assert loopback_host("[::1]:80", 80)
    assert not loopback_host("127.0.0.2:80", 80) and not loopback_host("a@127.0.0.1", 80)
    assert loopback_origin("http://[::1]:1") and not loopback_origin("http://127.0.0.1/x")


# --- the process -----------------------------------------------------------------------


def test_the_serve_process_offers_mcp_next_to_its_chat_endpoint(tmp_path: Path) -> None:
    """The real ``cogni-tool serve`` on a free port, its gateway the fake one."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with fake_gateway(tmp_path) as gateway:
        env = {
            "PATH": "/usr/bin",
            "COGNI_GATEWAY_SOCK": str(gateway.path),
            "COGNI_RUN_ID": RUN_ID,
            "PYTHONPATH": str(REPO_ROOT),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "cogni_tool", "serve", "--openai-port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            init = rpc("initialize", {"protocolVersion": "2025-06-18"}, 0)
            headers = {"Content-Type": "application/json", "Accept": JSON_AND_SSE}
            conn.request("POST", "/mcp", json.dumps(init), headers)
            response = conn.getresponse()
            assert response.status == 200, response.read()
            response.read()
            headers[SESSION_HEADER] = response.headers[SESSION_HEADER]
            conn.request("POST", "/mcp", json.dumps(rpc("tools/list", {}, 1)), headers)
            listed = json.loads(conn.getresponse().read())
            conn.close()
        finally:
            proc.terminate()
            proc.wait(10)
    assert [t["name"] for t in listed["result"]["tools"]] == ["fs.read", "time.now"]
    assert [r["runId"] for r in gateway.requests] == [RUN_ID]
    assert os.environ.get("COGNI_GATEWAY_SOCK") != str(gateway.path)
