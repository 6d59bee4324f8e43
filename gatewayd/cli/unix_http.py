"""One HTTP/1.1 exchange over a unix socket: the control client's transport.

Written here rather than taken from ``http.client``: that module loads ``email`` (its
header parser) and ``ssl``, which cost a `gatewayd exec` or `gatewayd rules` more than
the rest of its start (docs/performance.md, "CLI start"), and a client of one known
server needs none of it. What it speaks is narrow on purpose, and strict: one request
with ``Connection: close``, then one response whose status line, headers and body are
checked (``Content-Length`` when given, else the body runs to the end of the stream, as
HTTP/1.1 allows a response that closes its connection; a chunked or otherwise encoded
body, an informational 1xx answer, a malformed or oversized head are refused).
gatewayd's control server (h11, gatewayd/control.py) answers every request with a
``Content-Length``. tests/unit/test_unix_http.py holds it to that against a real socket.
"""

from __future__ import annotations

# The C module: socket.py's enums of every constant cost more to build than this
# exchange takes (cogni_tool/client.py does the same).
import _socket

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final

# The status line and headers of an answer: gatewayd's are a few hundred bytes; the
# server's own request limit (gatewayd/control.py) is 16 KiB.
MAX_HEAD_BYTES: Final = 64 * 1024
# How much is read at a time: a large exec result arrives in a few reads.
READ_BYTES: Final = 256 * 1024
# The methods http.client sends ``Content-Length: 0`` for when they carry no body: the
# server then knows the (empty) body has ended without waiting for the close.
_METHODS_WITH_BODY: Final = frozenset({"POST", "PUT", "PATCH"})
_TOKEN_CHARS: Final = frozenset(
    "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)


class HttpAnswerError(ConnectionError):
    """The server's answer is not one HTTP/1.1 response this client reads (or there is
    none): an OSError, as a connection that fails is, so the commands report it the
    same way ("cannot reach gatewayd at ...")."""


def exchange(
    path: str,
    method: str,
    target: str,
    body: bytes | None = None,
    *,
    content_type: str = "application/json",
) -> tuple[int, bytes]:
    """Send one request to the HTTP server on the unix socket at ``path``; its answer's
    (status, body).

    Error handling: OSError when the socket cannot be reached or fails;
    :class:`HttpAnswerError` (an OSError) when the server closes without answering or
    answers with something this client does not read; ValueError for a ``method`` or
    ``target`` that cannot go on a request line (a space, a control character, a
    character that is not ASCII). The caller quotes what it puts in ``target``: a
    user-given path segment as ``urllib.parse.quote(segment, safe="")``, so that any
    id reaches the server as one segment and is refused there by name, never here.
    """
    request = _request(method, target, body, content_type)
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        sock.connect(path)
        sock.sendall(request)
        return _read_response(sock)
    finally:
        sock.close()


def upgrade(
    path: str, target: str, body: bytes, protocol: str
) -> tuple[int, bytes, _socket.socket | None]:
    """POST ``body`` to ``target`` on the unix socket at ``path``, asking to switch the
    connection to ``protocol``. When the server switches: (101, the bytes it sent after
    its answer's head, the connected socket, now the caller's to close); when it answers
    as HTTP instead: (status, body, None).

    Error handling: as :func:`exchange`; an informational answer other than 101 is
    refused (:class:`HttpAnswerError`).
    """
    request = _request(
        "POST", target, body, "application/json", connection=f"Upgrade\r\nUpgrade: {protocol}"
    )
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        sock.connect(path)
        sock.sendall(request)
        buffer = _read_head(sock)
        end = buffer.find(b"\r\n\r\n")
        status, length = _parse_head(bytes(buffer[:end]), switching=True)
        if status == 101:
            return 101, bytes(buffer[end + 4 :]), sock
        answer = _read_body(sock, buffer[end + 4 :], length)
    except BaseException:
        sock.close()
        raise
    sock.close()
    return status, answer, None


def _request(
    method: str,
    target: str,
    body: bytes | None,
    content_type: str,
    *,
    connection: str = "close",
) -> bytes:
    if not method or not set(method) <= _TOKEN_CHARS:
        raise ValueError(f"not an HTTP method: {method!r}")
    if (
        not target.startswith("/")
        or not target.isascii()
        or not target.isprintable()
        or " " in target
    ):
        raise ValueError(f"not a request target: {target!r}")
    lines = [f"{method} {target} HTTP/1.1", "Host: gatewayd", f"Connection: {connection}"]
    if body is not None:
        lines += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
    elif method in _METHODS_WITH_BODY:
        lines.append("Content-Length: 0")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
    return head + (body or b"")


def _read_response(sock: _socket.socket) -> tuple[int, bytes]:
    buffer = _read_head(sock)
    end = buffer.find(b"\r\n\r\n")
    status, length = _parse_head(bytes(buffer[:end]))
    return status, _read_body(sock, buffer[end + 4 :], length)


def _read_head(sock: _socket.socket) -> bytearray:
    """What the server sent up to the end of its answer's head (and maybe beyond)."""
    buffer = bytearray()
    while (end := buffer.find(b"\r\n\r\n")) < 0:
        if len(buffer) > MAX_HEAD_BYTES:
            raise HttpAnswerError(f"the answer's head is over {MAX_HEAD_BYTES} bytes")
        chunk = sock.recv(READ_BYTES)
        if not chunk:
            # http.client's words for the same thing.
            raise HttpAnswerError(
                "Remote end closed connection without response"
                if not buffer
                else "the answer ended inside its head"
            )
        buffer += chunk
    if end > MAX_HEAD_BYTES:
        raise HttpAnswerError(f"the answer's head is over {MAX_HEAD_BYTES} bytes")
    return buffer


def _read_body(sock: _socket.socket, body: bytearray, length: int | None) -> bytes:
    """The answer's body: ``length`` bytes, or to the end of the stream without one;
    ``body`` holds what came with the head."""
    while length is None or len(body) < length:
        chunk = sock.recv(READ_BYTES)
        if not chunk:
            if length is not None:
                raise HttpAnswerError(
                    f"the answer's body ended after {len(body)} of its {length} bytes"
                )
            break
        body += chunk
    if length is not None and len(body) > length:
        raise HttpAnswerError(f"the answer runs {len(body) - length} bytes past its body")
    return bytes(body)


def _parse_head(head: bytes, *, switching: bool = False) -> tuple[int, int | None]:
    """(status, Content-Length or None) of a response head (the status line and the
    header lines, without the blank line); ``switching``: 101 is an answer too."""
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise HttpAnswerError("the answer's head is not ASCII") from None
    status_line, *header_lines = text.split("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest[:3]
    if version != "HTTP/1.1" or len(code) != 3 or not code.isdigit() or rest[3:4] not in ("", " "):
        raise HttpAnswerError(f"not an HTTP/1.1 status line: {status_line[:100]!r}")
    status = int(code)
    if not (200 <= status <= 599 or (switching and status == 101)):
        raise HttpAnswerError(f"status {status} is not a final answer")
    length: int | None = None
    for line in header_lines:
        name, colon, value = line.partition(":")
        if not colon or not name or not set(name) <= _TOKEN_CHARS:
            raise HttpAnswerError(f"not a header line: {line[:100]!r}")
        name, value = name.lower(), value.strip(" \t")
        if any((char < " " and char != "\t") or char == "\x7f" for char in value):
            # A bare CR or LF (or another control) is no field value: it would hide a
            # header inside another's line, which a reader that splits on LF would see.
            raise HttpAnswerError(f"a control character in the header line: {line[:100]!r}")
        if name == "transfer-encoding":
            raise HttpAnswerError(f"a {value} body is not read here")
        if name == "content-length":
            if not value.isdigit() or not value.isascii() or length is not None:
                raise HttpAnswerError(f"a bad or repeated Content-Length: {value[:100]!r}")
            length = int(value)
    return status, length
