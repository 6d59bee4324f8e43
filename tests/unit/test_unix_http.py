"""gatewayd/cli/unix_http.py, the control client's HTTP/1.1 exchange, against a real unix
socket: the request it writes, the answers it reads, and every answer it refuses (with
an OSError that says why, as the commands report a daemon they cannot reach)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote

import h11
import pytest

from gatewayd.cli.control_client import control_request
from gatewayd.cli.unix_http import MAX_HEAD_BYTES, HttpAnswerError, exchange, upgrade


@dataclass
class Server:
    """One connection at a time on a unix socket: the request read (as h11 parses it),
    then ``answer`` sent as given, then the connection closed."""

    path: Path
    answer: bytes = b""
    requests: list[tuple[h11.Request, bytes]] = field(default_factory=list)

    def serve(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                parser = h11.Connection(h11.SERVER)
                request, body = None, b""
                while True:
                    event = parser.next_event()
                    if event is h11.NEED_DATA:
                        parser.receive_data(conn.recv(65536))
                    elif isinstance(event, h11.Request):
                        request = event
                    elif isinstance(event, h11.Data):
                        body += event.data
                    else:
                        break
                assert request is not None
                self.requests.append((request, body))
                conn.sendall(self.answer)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    path = tmp_path / "control.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    srv = Server(path)
    thread = threading.Thread(target=srv.serve, args=(listener,), daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(timeout=10)


def ok(body: bytes, *headers: str) -> bytes:
    head = ["HTTP/1.1 200 OK", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def test_one_request_with_its_body_and_connection_close(server: Server) -> None:
    server.answer = ok(b'{"ok": true}', "Content-Type: application/json")
    assert exchange(str(server.path), "POST", "/v1/runs/x/exec", b'{"a": 1}') == (
        200,
        b'{"ok": true}',
    )
    [(request, body)] = server.requests
    assert (request.method, request.target, body) == (b"POST", b"/v1/runs/x/exec", b'{"a": 1}')
    headers = dict(request.headers)
    assert headers[b"host"] == b"gatewayd"
    assert headers[b"connection"] == b"close"
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"content-length"] == b"8"


def test_a_post_without_a_body_says_its_length_is_zero_a_get_says_nothing(
    server: Server,
) -> None:
    server.answer = ok(b"{}")
    exchange(str(server.path), "POST", "/v1/rules/pending/1/confirm")
    exchange(str(server.path), "GET", "/v1/rules/pending")
    (post, _), (get, _) = server.requests
    assert dict(post.headers)[b"content-length"] == b"0"
    assert b"content-length" not in dict(get.headers)


def test_a_large_body_arrives_whole(server: Server) -> None:
    body = bytes(range(256)) * 8192  # 2 MiB: many reads
    server.answer = ok(body)
    assert exchange(str(server.path), "GET", "/big") == (200, body)


def test_a_body_without_a_length_runs_to_the_close(server: Server) -> None:
    server.answer = b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\n\r\nno route"
    assert exchange(str(server.path), "GET", "/nope") == (404, b"no route")


def test_control_request_decodes_json_and_keeps_a_non_json_answer_as_its_message(
    server: Server,
) -> None:
    server.answer = ok(b'{"ok": true, "pending": []}')
    assert control_request(server.path, "GET", "/v1/rules/pending") == (
        200,
        {"ok": True, "pending": []},
    )
    server.answer = ok(b"not json")
    assert control_request(server.path, "GET", "/x") == (200, {"ok": False, "message": "not json"})


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (b"", "Remote end closed connection without response"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n", "ended inside its head"),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 100 Continue\r\n\r\n", "status 100 is not a final answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab", "ended after 2 of its 5 bytes"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nab", "runs 1 bytes past its body"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "a bad or repeated Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: \xd9\xa3\r\n\r\n", "not ASCII"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\na",
            "a bad or repeated Content-Length",
        ),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "chunked body"),
        (b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n", "not a header line"),
        (b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", "not a header line"),
        (
            b"HTTP/1.1 200 OK\r\nX: a\nContent-Length: 9\r\nContent-Length: 2\r\n\r\n{}",
            "a control character in the header line",
        ),
        (b"HTTP/1.1 200 OK\r\nX: a\rb\r\nContent-Length: 0\r\n\r\n", "a control character"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n", "head is over"),
    ],
)
def test_an_answer_it_does_not_read_is_an_oserror_saying_why(
    server: Server, answer: bytes, why: str
) -> None:
    server.answer = answer
    with pytest.raises(HttpAnswerError, match=why) as caught:
        exchange(str(server.path), "GET", "/v1/rules/pending")
    assert isinstance(caught.value, OSError)  # the commands' "cannot reach gatewayd"


def test_no_server_is_the_system_s_own_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        exchange(str(tmp_path / "absent.sock"), "GET", "/")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(tmp_path / "dead.sock"))
    dead.close()  # bound, never listening: refused
    with pytest.raises(ConnectionRefusedError):
        exchange(str(tmp_path / "dead.sock"), "GET", "/")


@pytest.mark.parametrize(
    ("method", "target"),
    [
        ("GET /x HTTP/1.1\r\nX-Injected: 1\r\n", "/"),  # a request smuggled in the method
        ("", "/"),
        ("GET", "/v1/runs/a b/exec"),  # a space would end the target
        ("GET", "/v1/runs/x\r\nX-Injected: 1"),
        ("GET", "/v1/\x00"),
        ("GET", "v1/runs"),  # not origin-form
        # Printable but not ASCII: refused as a target, never a UnicodeEncodeError.
        ("GET", "/v1/runs/" + "\u00e9" * 32 + "/exec"),
        ("POST", "/v1/approvals/\u0661\u0662/approve"),  # Arabic-Indic digits
    ],
)
def test_a_method_or_target_that_cannot_go_on_the_request_line_is_refused_before_sending(
    server: Server, method: str, target: str
) -> None:
    with pytest.raises(ValueError, match=r"not an HTTP method|not a request target"):
        exchange(str(server.path), method, target)
    assert server.requests == []


@pytest.mark.parametrize("segment", ["a b", "../x", "%2e%2e", "\u00e9" * 32, "x\ty", "x\r\ny"])
def test_a_quoted_segment_goes_on_the_request_line_as_one_segment(
    server: Server, segment: str
) -> None:
    # What the commands do with a user-given id (the docstring's contract): quoted
    # whole, it reaches the server as one ASCII segment, byte for byte.
    server.answer = ok(b"{}")
    target = f"/v1/runs/{quote(segment, safe='')}/exec"
    assert exchange(str(server.path), "POST", target) == (200, b"{}")
    [(request, _)] = server.requests
    sent = request.target.decode("ascii")
    assert sent == target and sent.count("/") == 4
    assert unquote(sent.split("/")[3]) == segment


def test_an_upgrade_asks_to_switch_and_hands_over_the_socket_with_what_came_after(
    server: Server,
) -> None:
    server.answer = b"HTTP/1.1 101 \r\nUpgrade: p/1\r\nConnection: upgrade\r\n\r\nfirst"
    status, early, sock = upgrade(str(server.path), "/v1/runs/attach", b"{}", "p/1")
    assert sock is not None
    try:
        assert (status, early) == (101, b"first")
        assert sock.recv(10) == b""  # open until the server closed it: the caller's
    finally:
        sock.close()
    ((request, body),) = server.requests
    headers = dict(request.headers)
    assert (request.method, request.target, body) == (b"POST", b"/v1/runs/attach", b"{}")
    assert (headers[b"connection"], headers[b"upgrade"]) == (b"Upgrade", b"p/1")


def test_an_upgrade_answered_as_http_gives_its_status_and_body(server: Server) -> None:
    server.answer = b"HTTP/1.1 400 Bad\r\nContent-Length: 4\r\n\r\nnope"
    assert upgrade(str(server.path), "/x", b"{}", "p/1") == (400, b"nope", None)


@pytest.mark.parametrize(
    "answer",
    [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 102 Processing\r\n\r\n"],
    ids=["100", "102"],
)
def test_an_upgrade_answered_with_another_informational_status_is_refused(
    server: Server, answer: bytes
) -> None:
    server.answer = answer
    with pytest.raises(HttpAnswerError, match="is not a final answer"):
        upgrade(str(server.path), "/x", b"{}", "p/1")


def test_a_plain_exchange_still_refuses_a_101(server: Server) -> None:
    server.answer = b"HTTP/1.1 101 \r\nUpgrade: p/1\r\n\r\n"
    with pytest.raises(HttpAnswerError, match="status 101 is not a final answer"):
        exchange(str(server.path), "GET", "/x")
