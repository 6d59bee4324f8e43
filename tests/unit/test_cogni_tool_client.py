"""cogni_tool.client against a real unix socket served by a scripted fake gateway.

The fake gateway (also used by the CLI tests) speaks the wire framing from threads of a
stdlib ``socketserver``; each test scripts what it does with a handler function. Where
frames are checked for agreement with the real server side, gatewayd.protocol is used.
"""

from __future__ import annotations

import itertools
import json
import pickle
import re
import socket
import socketserver
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cogni_tool
import cogni_tool.client as client_module
from cogni_tool.client import (
    MAX_RESPONSE_FRAME_BYTES,
    CallTimedOut,
    Client,
    ClientError,
    CogniToolError,
    ConnectionFailed,
    FrameReader,
    NotConfigured,
    ProtocolError,
    Reply,
    RequestTooLarge,
    ToolError,
    decode_response,
    encode_request,
)
from gatewayd import protocol
from tests.hypothesis_counts import examples

HEADER = struct.Struct(">I")
RUN_ID = "run-test-1"
WIRE_CODES = [code.value for code in protocol.ErrorCode]
TOOL_CALL_ID_RE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")

# --- the fake gateway ------------------------------------------------------------------


class Conn:
    """One accepted connection, seen from the fake gateway's side."""

    def __init__(self, sock: socket.socket, gateway: FakeGateway) -> None:
        self.sock = sock
        self.gateway = gateway
        self._buf = b""

    def _recv_exactly(self, n: int) -> bytes | None:
        while len(self._buf) < n:
            try:
                chunk = self.sock.recv(1 << 20)
            except OSError:
                return None
            if not chunk:
                return None
            self._buf += chunk
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def read_request(self) -> dict[str, Any] | None:
        """The next request (recorded on the gateway), or None when the client closed."""
        header = self._recv_exactly(HEADER.size)
        if header is None:
            return None
        body = self._recv_exactly(HEADER.unpack(header)[0])
        if body is None:
            return None
        request: dict[str, Any] = json.loads(body)
        with self.gateway.lock:
            self.gateway.requests.append(request)
        return request

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_frame(self, body: bytes) -> None:
        self.send_raw(HEADER.pack(len(body)) + body)

    def send(self, obj: object) -> None:
        self.send_frame(json.dumps(obj).encode())

    def ok(self, request: dict[str, Any], value: Any) -> None:
        self.send({"v": 1, "toolCallId": request["toolCallId"], "ok": True, "value": value})

    def error(self, tool_call_id: str | None, code: str, message: str) -> None:
        self.send(
            {
                "v": 1,
                "toolCallId": tool_call_id,
                "ok": False,
                "errorCode": code,
                "safeMessage": message,
            }
        )


Handler = Callable[[Conn], None]

TOOLS = [
    {"name": "fs.read", "summary": "Read a file in the workspace.", "argsSchema": {}},
    {"name": "time.now", "summary": "The current time.", "argsSchema": {}},
]


def route(conn: Conn) -> None:
    """The default fake gateway: what it does depends on the tool called."""
    while (request := conn.read_request()) is not None:
        tool, args, tcid = request["tool"], request["args"], request["toolCallId"]
        if tool == "echo":
            conn.ok(request, args)
        elif tool == "null":
            conn.send({"v": 1, "toolCallId": tcid, "ok": True})  # value omitted, as msgspec does
        elif tool == "fail":
            conn.error(tcid, args["code"], args.get("message", f"fake {args['code']} message"))
        elif tool == "tools.list":
            conn.ok(request, conn.gateway.tools)
        elif tool == "sleep":
            time.sleep(args["seconds"])
            conn.ok(request, "slept")
        elif tool == "garbage":
            conn.send_frame(b"<html>not json</html>")
        elif tool == "oversize":
            conn.send_raw(HEADER.pack(100 << 20))  # announce 100 MiB, send nothing
            time.sleep(2)
            return
        elif tool == "midframe":
            conn.send_raw(HEADER.pack(100) + b'{"v":1,"toolC')
            return
        elif tool == "hangup":
            return
        elif tool == "conn_error":
            conn.error(None, "too_large", "frame of 9999999 bytes exceeds the limit")
            return
        elif tool == "wrong_id":
            conn.send({"v": 1, "toolCallId": "not-yours", "ok": True, "value": 1})
        elif tool == "twice":
            # Both answers in one write, so they reach the client together: a second
            # answer arriving after the call has returned is stray bytes on an idle
            # connection instead (see test_idle_connection_with_stray_bytes_...).
            frames = [
                json.dumps({"v": 1, "toolCallId": tcid, "ok": True, "value": n}).encode()
                for n in (1, 2)
            ]
            conn.send_raw(b"".join(HEADER.pack(len(frame)) + frame for frame in frames))
        elif tool == "v2":
            conn.send({"v": 2, "toolCallId": tcid, "ok": True, "value": 1})
        elif tool == "answer_then_close":
            conn.ok(request, "bye")
            return
        else:
            conn.error(tcid, "unknown_tool", f"no tool {tool!r}; the tools are echo, fail")


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False
    gateway: FakeGateway

    def shutdown_request(self, request: Any) -> None:
        # socketserver closes the socket here, after handle() has returned. Counting the
        # close any earlier (in handle) leaves a window in which the count says closed
        # while the client can still write to the connection and be answered with EOF.
        super().shutdown_request(request)
        with self.gateway.lock:
            self.gateway.closed += 1


class _RequestHandler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        gateway = self.server.gateway
        with gateway.lock:
            gateway.connections += 1
        with suppress(OSError):  # the client went away mid-script: fine for a fake
            gateway.handler(Conn(self.request, gateway))


class FakeGateway:
    """A scripted gateway on a real unix socket; ``handler`` runs once per connection."""

    def __init__(self, path: Path, handler: Handler = route) -> None:
        self.path = path
        self.handler = handler
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        self.connections = 0
        self.closed = 0  # connections whose socket the gateway has really closed
        self.payload = b""  # for handlers that send test-chosen bytes
        self.tools: Any = TOOLS  # what tools.list answers
        self._server = _Server(str(path), _RequestHandler)
        self._server.gateway = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )

    def __enter__(self) -> FakeGateway:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def tools_called(self) -> list[str]:
        with self.lock:
            return [r["tool"] for r in self.requests]


@contextmanager
def fake_gateway(tmp_path: Path, handler: Handler = route) -> Iterator[FakeGateway]:
    with FakeGateway(tmp_path / "gw.sock", handler) as gateway:
        yield gateway


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[FakeGateway]:
    with fake_gateway(tmp_path) as gw:
        yield gw


def wait_until(predicate: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


def make_client(gw: FakeGateway, **kwargs: Any) -> Client:
    return Client(str(gw.path), RUN_ID, **kwargs)


# --- calls that succeed ----------------------------------------------------------------


def test_call_sends_a_v1_request_and_returns_the_value(gateway: FakeGateway) -> None:
    with make_client(gateway) as client:
        value = client.call("echo", {"path": "notes.txt", "n": [1, 2.5, None, True]})
    assert value == {"path": "notes.txt", "n": [1, 2.5, None, True]}
    (request,) = gateway.requests
    assert set(request) == {"v", "runId", "toolCallId", "tool", "args"}
    assert request["v"] == 1
    assert request["runId"] == RUN_ID
    assert request["tool"] == "echo"
    assert TOOL_CALL_ID_RE.fullmatch(request["toolCallId"])


def test_call_without_args_sends_an_empty_object(gateway: FakeGateway) -> None:
    with make_client(gateway) as client:
        assert client.call("echo") == {}


def test_ok_response_without_value_means_null(gateway: FakeGateway) -> None:
    with make_client(gateway) as client:
        assert client.call("null") is None


def test_non_ascii_values_round_trip(gateway: FakeGateway) -> None:
    with make_client(gateway) as client:
        assert client.call("echo", {"text": "grüße 日本 🎉"}) == {"text": "grüße 日本 🎉"}


def test_connection_is_reused_across_calls_with_fresh_tool_call_ids(
    gateway: FakeGateway,
) -> None:
    with make_client(gateway) as client:
        for i in range(5):
            assert client.call("echo", {"i": i}) == {"i": i}
    assert gateway.connections == 1
    ids = [r["toolCallId"] for r in gateway.requests]
    assert len(set(ids)) == 5


def test_leaving_the_with_block_closes_the_connection(gateway: FakeGateway) -> None:
    with make_client(gateway) as client:
        client.call("echo")
        assert gateway.closed == 0
    wait_until(lambda: gateway.closed == 1)
    client.close()  # idempotent


def test_defaults_come_from_the_environment(
    gateway: FakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COGNI_GATEWAY_SOCK", str(gateway.path))
    monkeypatch.setenv("COGNI_RUN_ID", "run-from-env")
    with Client() as client:
        client.call("echo")
    assert gateway.requests[0]["runId"] == "run-from-env"


def test_package_reexports_the_client_api_lazily() -> None:
    assert cogni_tool.Client is Client
    assert cogni_tool.ToolError is ToolError
    assert cogni_tool.EXIT_CODES is client_module.EXIT_CODES
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = cogni_tool.nope


# --- errors answered by the gateway ----------------------------------------------------


@pytest.mark.parametrize("code", WIRE_CODES)
def test_each_wire_error_code_raises_tool_error_with_code_message_and_id(
    gateway: FakeGateway, code: str
) -> None:
    with make_client(gateway) as client, pytest.raises(ToolError) as caught:
        client.call("fail", {"code": code, "message": "readable paths: /workspace"})
    error = caught.value
    assert error.code == code
    assert error.message == "readable paths: /workspace"
    assert error.tool_call_id == gateway.requests[0]["toolCallId"]
    assert str(error) == f"{code}: readable paths: /workspace"


def test_error_code_unknown_to_this_client_is_passed_through(gateway: FakeGateway) -> None:
    with make_client(gateway) as client, pytest.raises(ToolError) as caught:
        client.call("fail", {"code": "quota_exceeded_v9"})
    assert caught.value.code == "quota_exceeded_v9"
    assert client_module.exit_code_for(caught.value) == 22


def test_tool_error_does_not_spoil_the_connection(gateway: FakeGateway) -> None:
    with make_client(gateway) as client:
        with pytest.raises(ToolError):
            client.call("fail", {"code": "policy_denied"})
        assert client.call("echo", {"a": 1}) == {"a": 1}
    assert gateway.connections == 1


def test_tool_error_survives_pickling() -> None:
    error = ToolError("policy_denied", "writable paths: /workspace/out", "7-3")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.code, copy.message, copy.tool_call_id) == ("policy_denied", error.message, "7-3")


# --- pipelining ------------------------------------------------------------------------


def answer_in_reverse(batch: int) -> Handler:
    """Read ``batch`` requests before answering any, then answer them last-first."""

    def handler(conn: Conn) -> None:
        requests = [conn.read_request() for _ in range(batch)]
        for request in reversed(requests):
            assert request is not None
            if request["tool"] == "fail":
                conn.error(request["toolCallId"], "policy_denied", "not on the allowlist")
            else:
                conn.ok(request, request["args"])
        route(conn)

    return handler


def test_call_many_matches_out_of_order_responses_by_tool_call_id(tmp_path: Path) -> None:
    with fake_gateway(tmp_path, answer_in_reverse(4)) as gw, make_client(gw, timeout=5) as c:
        results = c.call_many(
            [("echo", {"i": 0}), ("fail", {}), ("echo", {"i": 2}), ("echo", {"i": 3})]
        )
        assert results[0] == {"i": 0}
        assert isinstance(results[1], ToolError)
        assert results[1].code == "policy_denied"
        assert results[1].tool_call_id == gw.requests[1]["toolCallId"]
        assert results[2:] == [{"i": 2}, {"i": 3}]
        # The same connection goes on serving single calls.
        assert c.call("echo", {"after": True}) == {"after": True}
    assert gw.connections == 1


def test_call_many_of_nothing_sends_nothing(gateway: FakeGateway) -> None:
    with make_client(gateway) as client:
        assert client.call_many([]) == []
    assert gateway.connections == 0


def test_pipelining_big_requests_and_answers_does_not_deadlock(tmp_path: Path) -> None:
    # The gateway answers each request as soon as it has read it, with an answer twice
    # its size, and does not read on while it writes. A client that wrote all requests
    # before reading would fill both socket buffers and hang until its timeout.
    def big_answers(conn: Conn) -> None:
        while (request := conn.read_request()) is not None:
            conn.ok(request, request["args"]["blob"] * 2)

    blob = "x" * 100_000
    with fake_gateway(tmp_path, big_answers) as gw, make_client(gw, timeout=10) as client:
        results = client.call_many([("echo", {"blob": blob})] * 40)
    assert results == [blob * 2] * 40


def test_batch_larger_than_the_socket_buffer_to_a_gateway_that_stops_reading_times_out(
    tmp_path: Path,
) -> None:
    # The requests cannot all be written; the client must still give up at its deadline.
    def read_one_then_stall(conn: Conn) -> None:
        conn.read_request()
        time.sleep(3)

    blob = "x" * 200_000
    with fake_gateway(tmp_path, read_one_then_stall) as gw, make_client(gw, timeout=0.5) as c:
        started = time.monotonic()
        with pytest.raises(CallTimedOut, match="within the client's timeout"):
            c.call_many([("echo", {"blob": blob})] * 30)
        assert time.monotonic() - started < 2.5


# --- connection handling ---------------------------------------------------------------


def test_idle_connection_closed_by_gateway_is_replaced_for_the_next_call(
    gateway: FakeGateway,
) -> None:
    with make_client(gateway) as client:
        assert client.call("answer_then_close") == "bye"
        # closed counts a socket only once it is really closed: on a unix socket the
        # client's idle check then sees the end of the stream, every time.
        wait_until(lambda: gateway.closed == 1)
        assert client.call("echo", {"n": 2}) == {"n": 2}
    assert gateway.connections == 2
    assert gateway.tools_called() == ["answer_then_close", "echo"]


def test_idle_connection_with_stray_bytes_is_replaced_for_the_next_call(tmp_path: Path) -> None:
    # Half a frame header nobody asked for, sent while the connection sits idle: reusing
    # the connection would read it as the start of the next answer.
    def answer_then_stray(conn: Conn) -> None:
        request = conn.read_request()
        assert request is not None
        conn.ok(request, "first")
        time.sleep(0.05)
        conn.send_raw(b"\x00\x00")
        with conn.gateway.lock:
            conn.gateway.payload = b"sent"
        route(conn)

    with fake_gateway(tmp_path, answer_then_stray) as gw, make_client(gw, timeout=5) as client:
        assert client.call("echo") == "first"
        wait_until(lambda: gw.payload == b"sent")
        time.sleep(0.05)  # the bytes are on their way through the socket
        assert client.call("echo", {"n": 2}) == "first"  # a new connection, a new script
    assert gw.connections == 2


def test_request_refused_by_a_connection_closing_in_the_race_is_sent_once_more(
    gateway: FakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The gateway closes the idle connection just after the client checked it: the write
    # fails before any byte of the request was taken, so resending cannot run it twice.
    monkeypatch.setattr(client_module, "_closed_while_idle", lambda sock: False)
    with make_client(gateway) as client:
        client.call("answer_then_close")
        wait_until(lambda: gateway.closed == 1)
        assert client.call("echo", {"n": 2}) == {"n": 2}
    assert gateway.tools_called() == ["answer_then_close", "echo"]
    assert gateway.connections == 2


def test_call_that_reached_the_gateway_is_never_resent(gateway: FakeGateway) -> None:
    with make_client(gateway) as client:
        client.call("echo")  # the connection is now a reused one
        with pytest.raises(ConnectionFailed) as caught:
            client.call("hangup")
    assert "closed the connection before answering 1 call(s)" in str(caught.value)
    assert "may or may not have run" in str(caught.value)
    assert str(gateway.path) in str(caught.value)
    assert gateway.tools_called() == ["echo", "hangup"]


def test_request_written_whole_as_the_gateway_closes_the_idle_connection_is_not_resent(
    tmp_path: Path,
) -> None:
    # The race the idle check cannot win: the gateway closes the connection just after
    # the check found it open, and the whole request was already written. The gateway
    # might have read it, so the client must fail and never send it again.
    def close_once_the_next_request_is_in(conn: Conn) -> None:
        first = conn.read_request()
        assert first is not None
        conn.ok(first, "first")
        conn.sock.recv(1, socket.MSG_PEEK)  # blocks until the next request has arrived
        # Returning closes the connection with the request unread.

    with fake_gateway(tmp_path, close_once_the_next_request_is_in) as gw:
        with make_client(gw, timeout=5) as client:
            assert client.call("echo") == "first"
            with pytest.raises(ConnectionFailed) as caught:
                client.call("echo", {"n": 2})
            assert "before answering 1 call(s)" in str(caught.value)
            assert "may or may not have run" in str(caught.value)
            assert gw.connections == 1  # not resent on a new connection
            # The broken connection was dropped: the next call starts a new one.
            assert client.call("echo", {"n": 3}) == "first"
        assert gw.connections == 2
        assert [r["args"] for r in gw.requests] == [{}, {"n": 3}]


def test_close_in_the_middle_of_a_frame_is_a_failed_connection(gateway: FakeGateway) -> None:
    with make_client(gateway) as client, pytest.raises(ConnectionFailed, match="mid-frame"):
        client.call("midframe")


def test_connection_level_error_is_given_to_every_waiting_call(tmp_path: Path) -> None:
    def handler(conn: Conn) -> None:
        if conn.gateway.connections > 1:
            route(conn)
            return
        first = conn.read_request()
        assert first is not None
        conn.read_request()
        conn.read_request()
        conn.ok(first, "first")
        conn.error(None, "too_large", "frame of 2000000 bytes exceeds the limit of 1048576")

    with fake_gateway(tmp_path, handler) as gw, make_client(gw, timeout=5) as client:
        results = client.call_many([("echo", {}), ("echo", {}), ("echo", {})])
        assert results[0] == "first"
        for result in results[1:]:
            assert isinstance(result, ToolError)
            assert result.code == "too_large"
            assert result.tool_call_id is None
            assert "exceeds the limit" in result.message
        # The client dropped that connection; the next call gets a new one.
        assert client.call("echo", {"again": 1}) == {"again": 1}
    assert gw.connections == 2


def test_single_call_raises_a_connection_level_error(gateway: FakeGateway) -> None:
    with make_client(gateway) as client, pytest.raises(ToolError) as caught:
        client.call("conn_error")
    assert caught.value.code == "too_large"
    assert caught.value.tool_call_id is None


def test_missing_socket_is_a_failed_connection_naming_path_and_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "absent.sock"
    monkeypatch.setenv("COGNI_GATEWAY_SOCK", str(path))
    monkeypatch.setenv("COGNI_RUN_ID", RUN_ID)
    with Client() as client, pytest.raises(ConnectionFailed) as caught:
        client.call("echo")
    assert str(path) in str(caught.value)
    assert "$COGNI_GATEWAY_SOCK" in str(caught.value)
    assert "inside a gatewayd run" in str(caught.value)


def test_socket_nobody_listens_on_is_a_refused_connection(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens: what a dead gatewayd leaves behind
    with Client(str(path), RUN_ID) as client, pytest.raises(ConnectionFailed) as caught:
        client.call("echo")
    assert "refuses connections" in str(caught.value)
    assert "the socket_path argument" in str(caught.value)


def test_socket_path_too_long_for_a_unix_socket_is_a_failed_connection(tmp_path: Path) -> None:
    path = tmp_path / ("d" * 200) / "gw.sock"
    with Client(str(path), RUN_ID) as client, pytest.raises(ConnectionFailed) as caught:
        client.call("echo")
    assert str(path) in str(caught.value)


# --- timeouts --------------------------------------------------------------------------


def test_slow_answer_raises_call_timed_out_and_next_call_uses_a_new_connection(
    gateway: FakeGateway,
) -> None:
    with make_client(gateway, timeout=0.2) as client:
        started = time.monotonic()
        with pytest.raises(CallTimedOut) as caught:
            client.call("sleep", {"seconds": 1.0})
        assert time.monotonic() - started < 0.9
        assert "may still run" in str(caught.value)
        assert caught.value.code == "timeout"
        assert client.call("echo", {"k": 1}) == {"k": 1}
    assert gateway.connections == 2


def test_timeout_none_waits_for_a_slow_answer(gateway: FakeGateway) -> None:
    with make_client(gateway, timeout=None) as client:
        assert client.call("sleep", {"seconds": 0.3}) == "slept"


# --- garbage from the gateway ----------------------------------------------------------


@pytest.mark.parametrize(
    ("tool", "expected"),
    [
        ("garbage", "not UTF-8 JSON"),
        ("wrong_id", "never sent"),
        ("twice", "already answered"),
        ("v2", "protocol version 2"),
    ],
)
def test_garbage_from_the_gateway_is_a_protocol_error_and_drops_the_connection(
    gateway: FakeGateway, tool: str, expected: str
) -> None:
    with make_client(gateway) as client:
        with pytest.raises(ProtocolError, match=expected):
            client.call(tool)
        assert client.call("echo", {"x": 1}) == {"x": 1}
    assert gateway.connections == 2


def test_response_for_an_unknown_tool_call_id_names_it(gateway: FakeGateway) -> None:
    with make_client(gateway) as client, pytest.raises(ProtocolError) as caught:
        client.call("wrong_id")
    assert "'not-yours'" in str(caught.value)


def test_oversize_response_length_fails_at_once_without_reading_the_body(
    gateway: FakeGateway,
) -> None:
    with make_client(gateway, timeout=5) as client:
        started = time.monotonic()
        with pytest.raises(ProtocolError) as caught:
            client.call("oversize")
        assert time.monotonic() - started < 1.5
    assert f"at most {MAX_RESPONSE_FRAME_BYTES} bytes" in str(caught.value)
    assert str(100 << 20) in str(caught.value)


def test_any_bytes_from_the_gateway_end_in_a_value_or_a_cogni_tool_error(
    tmp_path: Path,
) -> None:
    def send_payload(conn: Conn) -> None:
        if conn.read_request() is not None:
            conn.send_raw(conn.gateway.payload)

    frames = st.builds(
        lambda body: HEADER.pack(len(body)) + body,
        st.one_of(
            st.binary(max_size=64),
            st.builds(lambda obj: json.dumps(obj).encode(), json_values()),
        ),
    )
    with fake_gateway(tmp_path, send_payload) as gw:

        @settings(max_examples=examples(150), deadline=None)
        @given(
            st.one_of(st.binary(max_size=64), frames, st.lists(frames, max_size=3).map(b"".join))
        )
        def check(payload: bytes) -> None:
            gw.payload = payload
            # Any exception that is not a CogniToolError fails the test.
            with make_client(gw, timeout=5) as client, suppress(CogniToolError):
                client.call("echo")

        check()


# --- refused before sending ------------------------------------------------------------


def test_request_over_the_frame_limit_is_refused_locally_and_nothing_is_sent(
    gateway: FakeGateway,
) -> None:
    with make_client(gateway, max_frame_bytes=1000) as client:
        with pytest.raises(RequestTooLarge) as caught:
            client.call("echo", {"blob": "x" * 1000})
        message = str(caught.value)
        assert "at most 1000 bytes" in message
        assert "nothing was sent" in message
        assert caught.value.code == "too_large"
        # One oversize call in a batch stops the whole batch before anything is sent.
        with pytest.raises(RequestTooLarge):
            client.call_many([("echo", {}), ("echo", {"blob": "x" * 1000})])
    assert gateway.requests == []
    assert gateway.connections == 0


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["not", "a", "dict"], "must be a JSON object"),
        ({"data": b"bytes"}, "cannot be sent as JSON"),
        ({"n": float("nan")}, "finite numbers"),
        ({"s": "\ud800"}, "cannot be sent as JSON"),
    ],
)
def test_args_that_are_not_a_json_object_are_refused_locally(
    gateway: FakeGateway, args: Any, expected: str
) -> None:
    with make_client(gateway) as client, pytest.raises(ClientError, match=expected):
        client.call("echo", args)
    assert gateway.connections == 0


def test_args_nested_deeper_than_python_can_encode_are_refused_locally(
    gateway: FakeGateway,
) -> None:
    deep: dict[str, Any] = {}
    for _ in range(sys.getrecursionlimit() + 100):
        deep = {"d": deep}
    with make_client(gateway) as client, pytest.raises(ClientError) as caught:
        client.call("echo", deep)
    assert "cannot be sent as JSON" in str(caught.value)
    assert "use only objects, arrays" in str(caught.value)
    assert gateway.connections == 0


def test_non_string_tool_is_refused_locally(gateway: FakeGateway) -> None:
    with make_client(gateway) as client, pytest.raises(ClientError, match="tool must be a string"):
        client.call(42, {})  # type: ignore[arg-type]


# --- configuration ---------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["COGNI_GATEWAY_SOCK", "COGNI_RUN_ID"])
def test_missing_environment_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    monkeypatch.setenv("COGNI_GATEWAY_SOCK", "/run/cogni/gateway.sock")
    monkeypatch.setenv("COGNI_RUN_ID", RUN_ID)
    monkeypatch.delenv(missing)
    with pytest.raises(NotConfigured) as caught:
        Client()
    assert f"{missing} is not set" in str(caught.value)
    assert "only works inside a gatewayd run" in str(caught.value)
    assert isinstance(caught.value, ClientError)


def test_empty_environment_variable_counts_as_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COGNI_GATEWAY_SOCK", "")
    monkeypatch.setenv("COGNI_RUN_ID", RUN_ID)
    with pytest.raises(NotConfigured, match="COGNI_GATEWAY_SOCK is empty"):
        Client()


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"timeout": 0}, "timeout must be a positive number of seconds up to 604800"),
        ({"timeout": float("inf")}, "or None to wait forever"),
        ({"timeout": -1.0}, "timeout must be a positive"),
        ({"timeout": float("nan")}, "timeout must be a positive"),
        ({"max_frame_bytes": 10}, "max_frame_bytes must be at least 64"),
    ],
)
def test_bad_client_settings_are_refused(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ClientError, match=expected):
        Client("/run/cogni/gateway.sock", RUN_ID, **kwargs)


# --- framing agrees with gatewayd.protocol ---------------------------------------------


def json_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**63 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(st.characters(codec="utf-8")),
    )
    return st.recursive(
        scalars,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.dictionaries(st.text(max_size=8), children, max_size=4),
        ),
        max_leaves=12,
    )


@settings(max_examples=examples(200), deadline=None)
@given(
    args=st.dictionaries(st.text(max_size=8), json_values(), max_size=5),
    tool=st.sampled_from(["fs.read", "time.now", "model.chat", "git.log"]),
    counter=st.integers(min_value=1, max_value=10**12),
)
def test_client_request_frames_decode_in_gatewayd_to_the_same_request(
    args: dict[str, Any], tool: str, counter: int
) -> None:
    tool_call_id = f"4242-{counter}"
    frame = encode_request(RUN_ID, tool_call_id, tool, args, 1 << 20)
    decoder = protocol.FrameDecoder()
    decoder.receive_data(frame)
    event = decoder.next_event()
    assert isinstance(event, protocol.RequestReceived), event
    assert event.request.runId == RUN_ID
    assert event.request.toolCallId == tool_call_id
    assert event.request.tool == tool
    assert event.request.args == args
    assert decoder.next_event() is protocol.NEED_DATA


@settings(max_examples=examples(200), deadline=None)
@given(
    value=json_values(),
    code=st.sampled_from(list(protocol.ErrorCode)),
    message=st.text(min_size=1, max_size=40),
    ok=st.booleans(),
)
def test_gatewayd_response_frames_decode_in_the_client(
    value: Any, code: protocol.ErrorCode, message: str, ok: bool
) -> None:
    response = (
        protocol.ok_response("1-1", value) if ok else protocol.error_response("1-1", code, message)
    )
    (body,) = FrameReader().feed(protocol.encode_response(response))
    reply = decode_response(body)
    assert reply.tool_call_id == "1-1"
    assert reply.ok is ok
    if ok:
        assert reply.value == value
    else:
        assert (reply.error_code, reply.safe_message) == (code.value, message)


def test_gatewayd_connection_level_error_decodes_with_a_null_id() -> None:
    frame = protocol.encode_response(
        protocol.error_response(None, protocol.ErrorCode.TOO_LARGE, "too big")
    )
    (body,) = FrameReader().feed(frame)
    reply = decode_response(body)
    assert reply.tool_call_id is None
    error = reply.to_error()
    assert (error.code, error.message, error.tool_call_id) == ("too_large", "too big", None)


@settings(max_examples=examples(200), deadline=None)
@given(
    bodies=st.lists(st.binary(max_size=300), max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=8),
)
def test_frame_reader_yields_the_same_bodies_however_the_stream_is_cut(
    bodies: list[bytes], cuts: list[int]
) -> None:
    stream = b"".join(HEADER.pack(len(body)) + body for body in bodies)
    points = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    reader = FrameReader()
    seen: list[bytes] = []
    for start, end in itertools.pairwise(points):
        seen.extend(reader.feed(stream[start:end]))
    assert seen == bodies
    assert reader.buffered == 0


@given(st.binary(max_size=200))
def test_decode_response_either_decodes_or_raises_protocol_error(body: bytes) -> None:
    with suppress(ProtocolError):  # any other exception fails the test
        assert isinstance(decode_response(body), Reply)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"[1, 2]", "JSON list where a response object belongs"),
        (b'{"v": 1, "toolCallId": 5, "ok": true}', "non-string toolCallId"),
        (b'{"v": 1, "toolCallId": "a", "ok": "yes"}', "without a boolean 'ok'"),
        (b'{"v": 1, "toolCallId": "a", "ok": false}', "without a string errorCode"),
        (b'{"v": true, "toolCallId": "a", "ok": true}', "protocol version True"),
        (b"\xff\xfe", "not UTF-8 JSON"),
        (b'{"v": 1, "toolCallId": "a", "ok": true, "value": NaN}', "NaN is not JSON"),
        (b'{"v": 1, "toolCallId": "a", "ok": true, "value": [1, 2}', "Expecting ',' delimiter"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ],
)
def test_malformed_response_bodies_say_what_is_wrong(body: bytes, expected: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(expected)):
        decode_response(body)


def test_frame_reader_refuses_a_length_over_its_cap_before_the_body_arrives() -> None:
    reader = FrameReader(max_frame_bytes=10)
    with pytest.raises(ProtocolError, match="11-byte response frame"):
        reader.feed(HEADER.pack(11))
