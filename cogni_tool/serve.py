"""``cogni-tool serve``: the run's in-sandbox services, started by gatewayd at run start.

Two listeners on 127.0.0.1 inside the run's own network namespace (nothing outside the
run can reach them, and they reach nothing but the run's gateway sockets):

* an OpenAI-compatible endpoint (``--openai-port``): ``POST /v1/chat/completions`` becomes
  a ``model.chat`` call on the gateway socket, and the answer an OpenAI chat completion
  (or its server-sent-events stream when ``stream`` is true), so an unmodified agent
  using the ``openai`` SDK works with ``OPENAI_BASE_URL`` pointing here and any key; the
  key it sends is ignored (gatewayd holds the real one, on the host). ``GET /v1/models``
  lists the aliases the run's policy grants (``--models``) and the apps it may call. An
  app is prompted like a model: a chat completion whose ``model`` is an app's tool
  (``app_note_taker``) becomes a call of that tool, its prompt the conversation, and the
  app's answer the completion (``finish_reason`` ``length`` when a limit stopped it).
* an egress bridge (``--proxy-port``): every TCP connection accepted is relayed, bytes
  unchanged, to gatewayd's per-run egress proxy socket (``--egress-socket``), which does
  the HTTP proxying, the allowlist and the audit. ``HTTP_PROXY``/``HTTPS_PROXY`` point here.

The OpenAI listener also serves MCP's streamable HTTP transport at ``/mcp``
(:mod:`cogni_tool.mcp_http`): the run's tools for an MCP client, as ``cogni-tool mcp``
offers them over stdio.

Prints ``ready`` on stdout once both listen; gatewayd waits for that line before the
run's first command. Standard library only, Python 3.8+ (any sandbox root runs it).

With a command after ``--`` (the egress bridge only: a process tool's call granted
network, in a network namespace of its own), it listens, leaves the bridge to a child
process (stdio on /dev/null, so the tool's stdout and stderr stay the tool's alone), and
execs the command in its own place: the tool keeps this process's id, stdin, stdout and
exit status, and the bridge already listens when it starts. Nothing is printed. The
bridge goes with the tool's sandbox (its pid namespace ends with the tool).

Trust: this process runs as the run's uid, so the run's own commands can kill it or
race it for the port; neither gives them anything: every decision is gatewayd's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cogni_tool.client import CallTimedOut, Client, CogniToolError, ToolError
from cogni_tool.mcp_http import MCP_PATH, McpHttpEndpoint
from cogni_tool.mcp_server import DEFAULT_CALL_TIMEOUT_S

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from cogni_tool.mcp_http import HttpAnswer

USAGE = """\
usage: cogni-tool serve [--openai-port PORT --models A,B] [--proxy-port PORT --egress-socket PATH]
       cogni-tool serve --proxy-port PORT --egress-socket PATH -- COMMAND [ARG...]

Started by gatewayd inside a run's sandbox at run start; not for interactive use.
"""

LISTEN_HOST = "127.0.0.1"
# One request body: a long conversation, well under the gateway's frame limit.
MAX_BODY_BYTES = 8 * 1024 * 1024
# A model answer may take long; gatewayd's own model.chat timeout (120 s) ends it first.
CHAT_CALL_TIMEOUT_S = 180.0
# An app's invocation lasts up to the run's call timeout (at most an hour); gatewayd's
# own limit ends it first.
APP_CALL_TIMEOUT_S = 3660.0
# Tools whose names start so are apps: prompted through the chat endpoint like a model.
APP_PREFIX = "app_"
# In-flight requests and relayed connections at once; gatewayd has its own caps, these
# only bound this process's threads.
MAX_CHAT_REQUESTS = 32
MAX_RELAYS = 256
RELAY_CHUNK = 64 * 1024
# Threads only relay bytes or wait on a socket: a small stack keeps many of them cheap
# where memory is limited per address space (RLIMIT_AS) rather than by cgroup.
THREAD_STACK_BYTES = 512 * 1024
# prctl(2): have a signal sent when the parent ends (the egress bridge beside a command).
PR_SET_PDEATHSIG = 1

# The gateway's error code -> the HTTP status and OpenAI error type the SDK expects.
_STATUS = {
    "bad_request": (400, "invalid_request_error"),
    "too_large": (413, "invalid_request_error"),
    "invalid_args": (400, "invalid_request_error"),
    "unknown_tool": (403, "permission_denied"),
    "authz_denied": (403, "permission_denied"),
    "policy_denied": (403, "permission_denied"),
    "review_denied": (403, "permission_denied"),
    "rate_limited": (429, "rate_limit_exceeded"),
    "timeout": (504, "timeout"),
    "tool_failed": (502, "upstream_error"),
    "confirmation_required": (403, "permission_denied"),
    # Not 429: SDKs retry a 429, and a spent fuel or memory budget stays spent.
    "limit_exceeded": (403, "permission_denied"),
    # Not retried by an SDK: only the operator's answer changes it.
    "approval_denied": (403, "permission_denied"),
}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Parameters model.chat does not take; accepted and ignored, so an SDK's defaults pass.
IGNORED_PARAMETERS = frozenset(
    {
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "stop",
        "seed",
        "user",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "metadata",
        "store",
        "parallel_tool_calls",
        "service_tier",
        "stream_options",
    }
)


class BadChatRequest(Exception):
    """The request is not one this endpoint can forward; the message says why."""


def chat_arguments(body: Any) -> tuple[dict[str, Any], bool, bool]:
    """``model.chat``'s arguments for an OpenAI chat-completions body, whether it wants
    a stream, and whether the stream should end with a usage chunk.

    Error handling: :class:`BadChatRequest` for what model.chat cannot express (tool
    calls, several choices, non-text content), naming the field.
    """
    if not isinstance(body, dict):
        raise BadChatRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadChatRequest("'model' must be the name of a model alias this run may use")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise BadChatRequest("'messages' must be a non-empty list of messages")
    messages = [_message(i, m) for i, m in enumerate(raw_messages)]
    for name in ("tools", "functions", "tool_choice", "function_call"):
        if body.get(name):
            raise BadChatRequest(
                f"'{name}': tool calling is not available through the gateway's model.chat; "
                "send plain messages"
            )
    n = body.get("n")
    if n not in (None, 1):
        raise BadChatRequest("'n': the gateway returns one choice; leave n unset or 1")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise BadChatRequest("'response_format': only plain text answers are available")
    args: dict[str, Any] = {"model": model, "messages": messages}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        args["max_tokens"] = max_tokens
    if body.get("temperature") is not None:
        args["temperature"] = body["temperature"]
    unknown = sorted(
        set(body)
        - IGNORED_PARAMETERS
        - {"model", "messages", "max_tokens", "max_completion_tokens", "temperature"}
        - {"stream", "n", "response_format", "tools", "functions", "tool_choice"}
        - {"function_call"}
    )
    if unknown:
        raise BadChatRequest(f"unsupported parameter {unknown[0]!r}")
    stream = body.get("stream") is True
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    return args, stream, include_usage


def _message(index: int, message: Any) -> dict[str, str]:
    where = f"'messages[{index}]'"
    if not isinstance(message, dict):
        raise BadChatRequest(f"{where} must be an object with 'role' and 'content'")
    role = _ROLES.get(message.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise BadChatRequest(
            f"{where}: role {message.get('role')!r} is not available; use system, "
            "developer, user or assistant (tool messages need tool calling, which the "
            "gateway does not offer)"
        )
    content = message.get("content")
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise BadChatRequest(f"{where}: only text content parts are available")
            text = part.get("text")
            if not isinstance(text, str):
                raise BadChatRequest(f"{where}: a text part needs a string 'text'")
            parts.append(text)
        content = "".join(parts)
    if not isinstance(content, str):
        raise BadChatRequest(f"{where}: 'content' must be text")
    return {"role": role, "content": content}


def completion(result: Any, stream_id: str, created: int) -> dict[str, Any]:
    """The OpenAI chat completion for a ``model.chat`` result."""
    usage = _usage(result)
    return {
        "id": stream_id,
        "object": "chat.completion",
        "created": created,
        "model": result.get("model"),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.get("content", "")},
                "logprobs": None,
                "finish_reason": result.get("finishReason", "stop"),
            }
        ],
        "usage": usage,
    }


def completion_chunks(
    result: Any, stream_id: str, created: int, include_usage: bool
) -> list[dict[str, Any]]:
    """The same answer as a stream: the whole text in one delta, then the finish (the
    gateway's model.chat answers at once; a stream keeps streaming clients working)."""
    base = {"id": stream_id, "object": "chat.completion.chunk", "created": created}
    base["model"] = result.get("model")
    delta = {"role": "assistant", "content": result.get("content", "")}
    chunks = [
        dict(base, choices=[{"index": 0, "delta": delta, "finish_reason": None}]),
        dict(
            base,
            choices=[
                {"index": 0, "delta": {}, "finish_reason": result.get("finishReason", "stop")}
            ],
        ),
    ]
    if include_usage:
        chunks.append(dict(base, choices=[], usage=_usage(result)))
    return chunks


def _usage(result: Any) -> dict[str, int]:
    usage = result.get("usage") or {}
    prompt = usage.get("promptTokens") or 0
    answer = usage.get("completionTokens") or 0
    return {"prompt_tokens": prompt, "completion_tokens": answer, "total_tokens": prompt + answer}


def error_body(message: str, kind: str, code: str | None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "code": code}}).encode()


class _ChatServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that resets mid-request is its own business, not gatewayd's log

    models: tuple[str, ...] = ()
    slots = threading.BoundedSemaphore(MAX_CHAT_REQUESTS)
    # MCP's streamable HTTP transport at /mcp (cogni_tool.mcp_http), set by main().
    mcp: McpHttpEndpoint | None = None


class _ChatHandler(BaseHTTPRequestHandler):
    """One HTTP/1.1 connection from an agent (keep-alive, as the SDK's client expects)."""

    protocol_version = "HTTP/1.1"
    # Headers and body are two writes: with Nagle on, the body waits for the client's
    # delayed ACK of the headers (40 ms a request on Linux loopback).
    disable_nagle_algorithm = True
    server_version = "cogni-tool"
    sys_version = ""
    server: _ChatServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # gatewayd audits every call; the agent's requests are not logged twice

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == MCP_PATH:
            self._mcp()
            return
        models = self.server.models
        if path == "/v1/models" or path.startswith("/v1/models/"):
            models = (*models, *_apps())
        if path == "/v1/models":
            data = [_model_entry(name) for name in models]
            self._json(200, {"object": "list", "data": data})
        elif path.startswith("/v1/models/") and path[len("/v1/models/") :] in models:
            self._json(200, _model_entry(path[len("/v1/models/") :]))
        elif path.startswith("/v1/models/"):
            name = path[len("/v1/models/") :]
            message = f"model {name!r} is not granted to this run; granted: {', '.join(models)}"
            self._error(404, message, "invalid_request_error", "model_not_found")
        else:
            self._not_found()

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == MCP_PATH:
            self._mcp()
            return
        if path != "/v1/chat/completions":
            self._drain_body()
            self._not_found()
            return
        body = self._read_json()
        if body is None:
            return
        try:
            args, stream, include_usage = chat_arguments(body)
        except BadChatRequest as exc:
            self._error(400, str(exc), "invalid_request_error", None)
            return
        if not self.server.slots.acquire(blocking=False):
            self._error(503, "too many requests in flight; retry", "server_error", None)
            return
        try:
            call = _call_app if args["model"].startswith(APP_PREFIX) else _call_chat
            result = call(args)
        except ToolError as exc:
            status, kind = _STATUS.get(exc.code, (500, "server_error"))
            self._error(status, exc.safe_message, kind, exc.code)
            return
        except CallTimedOut as exc:
            self._error(504, str(exc), "timeout", "timeout")
            return
        except CogniToolError as exc:
            self._error(503, f"the gateway is unreachable: {exc}", "server_error", exc.code)
            return
        finally:
            self.server.slots.release()
        stream_id = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())
        if stream:
            self._stream(completion_chunks(result, stream_id, created, include_usage))
        else:
            self._json(200, completion(result, stream_id, created))

    def do_DELETE(self) -> None:
        if self.path.split("?", 1)[0].rstrip("/") == MCP_PATH:
            self._mcp()
        else:
            self._drain_body()
            self._not_found()

    # -- MCP --

    def _mcp(self) -> None:
        endpoint = self.server.mcp
        if endpoint is None:
            self._drain_body()
            self._not_found()
            return
        self._write_mcp(endpoint.handle(self.command, self.headers, self.rfile.read))

    def _write_mcp(self, answer: HttpAnswer) -> None:
        self.send_response(answer.status)
        for name, value in answer.headers.items():
            self.send_header(name, value)
        if answer.content_type is not None:
            self.send_header("Content-Type", answer.content_type)
        if answer.events is not None:
            # Closed however the writing ends (a client gone too): its slot comes back.
            with contextlib.closing(answer.events):
                # The end of the stream is the end of the body: no length to say first.
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                for event in answer.events:
                    self.wfile.write(event)
                    self.wfile.flush()
            return
        if answer.close:
            self.close_connection = True
            self.send_header("Connection", "close")
        if answer.status != 204:
            self.send_header("Content-Length", str(len(answer.body)))
        self.end_headers()
        self.wfile.write(answer.body)

    # -- helpers --

    def _read_json(self) -> Any:
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            self._error(411, "send the body with a Content-Length", "invalid_request_error", None)
            return None
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True
            self._error(
                413,
                f"the body must be 0..{MAX_BODY_BYTES} bytes with a Content-Length",
                "invalid_request_error",
                None,
            )
            return None
        raw = self.rfile.read(length)
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            self._error(400, f"the body is not JSON: {exc}", "invalid_request_error", None)
            return None

    def _drain_body(self) -> None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = 0
        if 0 < length <= MAX_BODY_BYTES:
            self.rfile.read(length)
        elif length:
            self.close_connection = True

    def _not_found(self) -> None:
        self._error(
            404,
            f"no route {self.command} {self.path}; this endpoint serves POST "
            f"/v1/chat/completions, GET /v1/models and MCP at {MCP_PATH}",
            "invalid_request_error",
            "not_found",
        )

    def _json(self, status: int, value: Any) -> None:
        self._send(status, json.dumps(value).encode(), "application/json")

    def _error(self, status: int, message: str, kind: str, code: str | None) -> None:
        self._send(status, error_body(message, kind, code), "application/json", retry=False)

    def _send(self, status: int, payload: bytes, content_type: str, retry: bool = True) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        if not retry:
            # The openai SDK retries 429 and 5xx by default; gatewayd never retries a
            # model call (a spent budget or a denial stays so), so tell it not to.
            self.send_header("x-should-retry", "false")
        self.end_headers()
        self.wfile.write(payload)

    def _stream(self, chunks: list[dict[str, Any]]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the end of the stream is the end of the body
        self.end_headers()
        self.close_connection = True
        for chunk in chunks:
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def _model_entry(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "cogni-gateway"}


def _call_chat(args: dict[str, Any]) -> Any:
    with Client(timeout=CHAT_CALL_TIMEOUT_S) as client:
        return client.call("model.chat", args)


def app_prompt(messages: list[dict[str, Any]]) -> str:
    """What an app is asked: the one user message, or the whole conversation as a
    transcript (an app is called afresh each time; the transcript is its context)."""
    said = [m for m in messages if m["role"] != "system"]
    if len(said) == 1 and said[0]["role"] == "user":
        return str(said[0]["content"])
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in messages)


def _call_app(args: dict[str, Any]) -> Any:
    """The app named by ``model``, prompted with the conversation; its answer shaped as
    model.chat's (a limit's stop is a ``length`` finish, its partial answer the text)."""
    name = args["model"]
    with Client(timeout=APP_CALL_TIMEOUT_S) as client:
        value = client.call(name, {"prompt": app_prompt(args["messages"])})
    if not isinstance(value, dict):
        value = {}
    if not value.get("ok", False) and not value.get("limit"):
        # The app failed (not a limit): an error, with gatewayd's message.
        raise ToolError("tool_failed", str(value.get("message", "the app failed")), None)
    return {
        "model": name,
        "content": value.get("answer", ""),
        "usage": {"promptTokens": value.get("tokens", 0), "completionTokens": 0},
        "finishReason": "stop" if value.get("ok") else "length",
    }


def _apps() -> tuple[str, ...]:
    """The apps this run may call (tools.list), for GET /v1/models; none when the
    gateway does not answer (the models list is still served)."""
    try:
        with Client(timeout=CHAT_CALL_TIMEOUT_S) as client:
            tools = client.call("tools.list", {})
    except CogniToolError:
        return ()
    return tuple(
        t["name"]
        for t in tools
        if isinstance(t, dict) and str(t.get("name", "")).startswith(APP_PREFIX)
    )


# --- the egress bridge ------------------------------------------------------------------


def serve_bridge(listener: socket.socket, egress_socket: str) -> None:
    """Accept forever; relay each connection to ``egress_socket``."""
    slots = threading.BoundedSemaphore(MAX_RELAYS)
    while True:
        conn, _ = listener.accept()
        if not slots.acquire(blocking=False):
            _refuse(conn, b"503 Service Unavailable", b"too many proxy connections at once\n")
            continue
        threading.Thread(target=_relay, args=(conn, egress_socket, slots), daemon=True).start()


def _relay(client: socket.socket, egress_socket: str, slots: threading.BoundedSemaphore) -> None:
    try:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(egress_socket)
        except OSError as exc:
            upstream.close()
            message = f"gatewayd's egress proxy is unreachable: {exc.strerror}\n".encode()
            _refuse(client, b"502 Bad Gateway", message)
            return
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join()
        upstream.close()
        client.close()
    finally:
        slots.release()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy ``source`` to ``sink`` until end of file, then pass the end on."""
    try:
        while True:
            data = source.recv(RELAY_CHUNK)
            if not data:
                break
            sink.sendall(data)
    except OSError:
        pass  # either side reset: the other direction sees it too
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def _refuse(conn: socket.socket, status: bytes, body: bytes) -> None:
    try:
        head = b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain\r\nConnection: close\r\n"
        conn.sendall(head + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    except OSError:
        pass
    conn.close()


# --- the command --------------------------------------------------------------------------


class ServeOptions:
    __slots__ = ("command", "egress_socket", "models", "openai_port", "proxy_port")

    def __init__(self) -> None:
        self.openai_port: int | None = None
        self.models: tuple[str, ...] = ()
        self.proxy_port: int | None = None
        self.egress_socket: str | None = None
        # After "--": the command run with the bridge beside it (egress bridge only).
        self.command: tuple[str, ...] = ()


def parse_serve_args(words: list[str]) -> ServeOptions:
    """Parse ``serve``'s options (ValueError with the reason)."""
    options = ServeOptions()
    if "--" in words:
        cut = words.index("--")
        words, options.command = words[:cut], tuple(words[cut + 1 :])
        if not options.command:
            raise ValueError("-- needs a command after it")
    values: dict[str, str] = {}
    i = 0
    while i < len(words):
        name = words[i]
        if name not in ("--openai-port", "--models", "--proxy-port", "--egress-socket"):
            raise ValueError(f"unknown option {name!r}; see cogni-tool serve --help")
        if i + 1 >= len(words):
            raise ValueError(f"{name} needs a value")
        values[name] = words[i + 1]
        i += 2
    if "--openai-port" in values:
        options.openai_port = _port(values["--openai-port"])
        options.models = tuple(m for m in values.get("--models", "").split(",") if m)
    if "--proxy-port" in values:
        options.proxy_port = _port(values["--proxy-port"])
        if "--egress-socket" not in values:
            raise ValueError("--proxy-port needs --egress-socket")
        options.egress_socket = values["--egress-socket"]
    if options.openai_port is None and options.proxy_port is None:
        raise ValueError("nothing to serve: give --openai-port and/or --proxy-port")
    if options.command and (options.openai_port is not None or options.proxy_port is None):
        raise ValueError(
            "a command after -- runs beside the egress bridge alone: give "
            "--proxy-port and --egress-socket, and no --openai-port"
        )
    return options


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"a port is 1-65535, got {text!r}")
    return int(text)


def main(words: list[str]) -> int:
    """Listen, say ``ready``, serve until killed."""
    if any(w in ("-h", "--help") for w in words):
        sys.stdout.write(USAGE)
        return 0
    try:
        options = parse_serve_args(words)
    except ValueError as exc:
        sys.stderr.write(f"cogni-tool: usage: {exc}\n")
        return 2
    if options.command:
        return bridge_then_exec(options)
    threading.stack_size(THREAD_STACK_BYTES)
    workers: list[threading.Thread] = []
    try:
        if options.openai_port is not None:
            server = _ChatServer((LISTEN_HOST, options.openai_port), _ChatHandler)
            server.models = options.models
            server.mcp = McpHttpEndpoint(
                lambda: Client(timeout=DEFAULT_CALL_TIMEOUT_S), port=options.openai_port
            )
            workers.append(threading.Thread(target=server.serve_forever, daemon=True))
        if options.proxy_port is not None:
            assert options.egress_socket is not None
            listener = socket.create_server((LISTEN_HOST, options.proxy_port), backlog=128)
            workers.append(
                threading.Thread(
                    target=serve_bridge, args=(listener, options.egress_socket), daemon=True
                )
            )
    except OSError as exc:
        sys.stderr.write(f"cogni-tool: serve: cannot listen on {LISTEN_HOST}: {exc}\n")
        return 1
    for worker in workers:
        worker.start()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for worker in workers:
        worker.join()
    return 0


def bridge_then_exec(options: ServeOptions) -> int:
    """Listen on the bridge's port, leave the bridge to a child, exec the command.

    The listener is made before the fork, so a connection the command makes at once
    waits in its backlog rather than being refused. Returns only when the command cannot
    be run (127, as a shell says; the bridge child is then stopped)."""
    if options.proxy_port is None or options.egress_socket is None:
        # The command line allows no command without both (parse_serve_args).
        sys.stderr.write("cogni-tool: serve: a command needs --proxy-port and --egress-socket\n")
        return 2
    try:
        listener = socket.create_server((LISTEN_HOST, options.proxy_port), backlog=128)
    except OSError as exc:
        sys.stderr.write(f"cogni-tool: serve: cannot listen on {LISTEN_HOST}: {exc}\n")
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    child = os.fork()
    if child == 0:  # the bridge: never returns into the command's code
        try:
            _die_with_parent(parent)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            threading.stack_size(THREAD_STACK_BYTES)
            serve_bridge(listener, options.egress_socket)
        finally:
            os._exit(0)
    listener.close()
    try:
        # The tool's own argv, from its manifest, as the sandbox runs any command.
        os.execvp(options.command[0], list(options.command))  # noqa: S606
    except OSError as exc:
        sys.stderr.write(f"cogni-tool: serve: cannot run {options.command[0]!r}: {exc}\n")
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        return 127


def _die_with_parent(parent: int) -> None:
    """Be killed when the command (the parent, after its exec) ends: in the sandbox its
    pid namespace ends with it anyway; this holds wherever it runs. Linux only; where
    prctl is missing, the namespace alone ends the bridge."""
    try:
        import ctypes  # here: only the bridge child needs it

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent ended before the call took effect
        os._exit(0)
