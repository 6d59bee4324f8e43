"""The Model Context Protocol's messages, as ``cogni-tool mcp`` speaks them (pure: no I/O).

JSON-RPC 2.0 objects in, JSON-RPC 2.0 objects out: this module checks what a client sent
(:func:`parse_message`), negotiates the protocol version, and shapes the gateway's tools
and answers into MCP results. It reads no stream and calls no gateway, so every rule is
tested with plain values; :mod:`cogni_tool.mcp_server` moves the bytes and makes the calls.

Written with the standard library, not the official ``mcp`` SDK: cogni-tool runs on any
bare ``python3`` in any sandbox image, and the SDK pulls in pydantic, anyio, starlette and
more (tens of megabytes, and a second of import time). Conformance is proven instead by
running the official SDK's client against this server inside a real sandbox
(tests/integration/test_mcp_stdio_sandbox.py).

The revisions followed are those the official SDKs negotiate through ``initialize``:
2024-11-05, 2025-03-26, 2025-06-18 and 2025-11-25. Where they differ, the negotiated one
decides: JSON-RPC batches only in 2025-03-26 (added there, removed in 2025-06-18),
``structuredContent`` from 2025-06-18, tool annotations and a progress ``message`` from
2025-03-26.
"""

from __future__ import annotations

from cogni_tool.json_codec import decode as _decode_json
from cogni_tool.json_codec import encode as _encode_json

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final, TypeAlias

    RequestId: TypeAlias = "str | int"
    Json: TypeAlias = "dict[str, Any]"

JSONRPC_VERSION: Final = "2.0"

# JSON-RPC 2.0's error codes (section 5.1), the only ones this server sends.
PARSE_ERROR: Final = -32700
INVALID_REQUEST: Final = -32600
METHOD_NOT_FOUND: Final = -32601
INVALID_PARAMS: Final = -32602
INTERNAL_ERROR: Final = -32603

# Oldest to newest: the revisions reachable through ``initialize`` in the official SDKs.
SUPPORTED_VERSIONS: Final = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
LATEST_VERSION: Final = SUPPORTED_VERSIONS[-1]
# 2025-03-26 made receiving batches a MUST; 2025-06-18 removed batching from the protocol.
BATCH_VERSIONS: Final = frozenset({"2025-03-26"})
# CallToolResult.structuredContent (a JSON object) exists from 2025-06-18.
STRUCTURED_CONTENT_VERSIONS: Final = frozenset({"2025-06-18", "2025-11-25"})
# ProgressNotification.message and Tool.annotations exist from 2025-03-26.
PROGRESS_MESSAGE_VERSIONS: Final = frozenset({"2025-03-26", "2025-06-18", "2025-11-25"})
ANNOTATION_VERSIONS: Final = PROGRESS_MESSAGE_VERSIONS

# The gateway's own tool: the MCP client lists tools through tools/list instead.
GATEWAY_LIST_TOOL: Final = "tools.list"

# A cursor is a page's offset in decimal; more digits than this cannot be a real offset
# (and int() of a huge digit string costs time): refuse it as a bad cursor.
MAX_CURSOR_DIGITS: Final = 9

# The methods this server answers (besides notifications), named in -32601's message.
METHODS: Final = ("initialize", "ping", "tools/list", "tools/call")

# MCP servers SHOULD say how they are meant to be used; a client may show this to its model.
INSTRUCTIONS: Final = (
    "These are the tools of the gatewayd run this sandbox belongs to. Every call goes "
    "through the gateway, which checks it against the run's policy, may have it reviewed, "
    "and writes it to an audit log; a refused call comes back as a tool error whose text "
    "says what was refused and what is allowed."
)


class RpcError(Exception):
    """A JSON-RPC error answer: ``code``, the message (``str(error)``) and the id it
    answers (None when the request's id could not be read)."""

    def __init__(self, code: int, message: str, request_id: RequestId | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id

    def to_response(self) -> Json:
        """The JSON-RPC error response for this error."""
        return error_response(self.request_id, self.code, str(self))


class Request:
    """A JSON-RPC request: it has an id and wants exactly one answer."""

    __slots__ = ("id", "method", "params")

    def __init__(self, request_id: RequestId, method: str, params: Json) -> None:
        self.id = request_id
        self.method = method
        self.params = params


class Notification:
    """A JSON-RPC notification: no id, never answered."""

    __slots__ = ("method", "params")

    def __init__(self, method: str, params: Json) -> None:
        self.method = method
        self.params = params


# --- decoding ----------------------------------------------------------------------------


def decode_line(line: bytes) -> Any:
    """The JSON value of one line, or :class:`RpcError` (-32700) saying why it is not JSON."""
    try:
        return _decode_json(line.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise RpcError(PARSE_ERROR, f"parse error: the line is not UTF-8 JSON ({exc})") from None


def _is_request_id(value: Any) -> bool:
    # MCP: a request id is a string or an integer, never null (and a bool is no integer).
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def parse_message(obj: Any) -> Request | Notification | None:
    """What one JSON-RPC message asks for; None for a response (this server sends no
    requests, so a response from the client answers nothing and is ignored).

    Error handling: :class:`RpcError` -32600 for what is not a JSON-RPC 2.0 message, with
    the request's id when it has a usable one; -32602 when params is not an object.
    """
    if not isinstance(obj, dict):
        kind = "an array" if isinstance(obj, list) else f"a JSON {type(obj).__name__}"
        raise RpcError(INVALID_REQUEST, f"invalid request: got {kind}, not a JSON-RPC object")
    has_id = "id" in obj
    request_id = obj.get("id")
    if has_id and not _is_request_id(request_id):
        raise RpcError(
            INVALID_REQUEST,
            f"invalid request: id must be a string or an integer, got {request_id!r}",
        )
    answer_to = request_id if has_id else None
    if obj.get("jsonrpc") != JSONRPC_VERSION:
        raise RpcError(
            INVALID_REQUEST,
            f'invalid request: "jsonrpc" must be "2.0", got {obj.get("jsonrpc")!r}',
            answer_to,
        )
    if "method" not in obj:
        if has_id and ("result" in obj or "error" in obj):
            return None
        raise RpcError(INVALID_REQUEST, 'invalid request: no "method"', answer_to)
    method = obj["method"]
    if not isinstance(method, str) or not method:
        raise RpcError(
            INVALID_REQUEST,
            f'invalid request: "method" must be a string, got {method!r}',
            answer_to,
        )
    params = obj.get("params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise RpcError(
            INVALID_PARAMS,
            f"invalid params: {method} takes params as a JSON object, got "
            f"{'an array' if isinstance(params, list) else type(params).__name__}",
            answer_to,
        )
    if has_id:
        return Request(request_id, method, params)  # type: ignore[arg-type]  # checked above
    return Notification(method, params)


# --- encoding ----------------------------------------------------------------------------


def encode_message(obj: Any) -> bytes:
    """One message as a line: compact JSON (never a raw newline inside) and ``\\n``."""
    try:
        text = _encode_json(obj, ensure_ascii=False, allow_nan=False)
        return text.encode("utf-8") + b"\n"
    except UnicodeEncodeError:
        # A lone surrogate (legal in a JSON escape, not in UTF-8): keep it escaped.
        return _encode_json(obj, ensure_ascii=True, allow_nan=False).encode("ascii") + b"\n"


def result_response(request_id: RequestId, result: Json) -> Json:
    return {"jsonrpc": JSONRPC_VERSION, "id": request_id, "result": result}


def error_response(request_id: RequestId | None, code: int, message: str) -> Json:
    return {
        "jsonrpc": JSONRPC_VERSION,
        "id": request_id,
        "error": {"code": code, "message": message},
    }


def notification(method: str, params: Json) -> Json:
    return {"jsonrpc": JSONRPC_VERSION, "method": method, "params": params}


# --- the handshake -------------------------------------------------------------------------


def negotiate(requested: Any) -> str:
    """The version to answer: the client's when supported, else the latest supported (the
    client then decides whether it can speak that, or disconnects)."""
    return requested if requested in SUPPORTED_VERSIONS else LATEST_VERSION


def initialize_result(params: Json, server_version: str) -> tuple[str, Json]:
    """The negotiated version and the ``initialize`` result for the client's ``params``.

    Error handling: :class:`RpcError` -32602 when protocolVersion is not a string.
    """
    requested = params.get("protocolVersion")
    if not isinstance(requested, str):
        raise RpcError(
            INVALID_PARAMS,
            "invalid params: initialize needs protocolVersion, a string such as "
            f"{LATEST_VERSION!r}; this server speaks {', '.join(SUPPORTED_VERSIONS)}",
        )
    version = negotiate(requested)
    return version, {
        "protocolVersion": version,
        # The run's tools are fixed while this process lives (a policy reload shows at the
        # next tools/list, but no notification is sent).
        "capabilities": {"tools": {"listChanged": False}},
        "serverInfo": {"name": "cogni-tool", "version": server_version},
        "instructions": INSTRUCTIONS,
    }


# --- tools ---------------------------------------------------------------------------------

_DEFS_PREFIX: Final = "#/$defs/"


def input_schema(args_schema: Any) -> Json:
    """An MCP ``inputSchema`` (``type: object`` at the top) for a gateway ``argsSchema``.

    The gateway's schemas are msgspec's: ``{"$ref": "#/$defs/ReadArgs", "$defs": {…}}``.
    MCP clients require ``"type": "object"`` at the top, so the referenced definition is
    hoisted there, keeping ``$defs`` beside it for nested references. Arguments are always
    an object on the gateway's wire, so a schema of another shape can only be
    ``{"type": "object"}`` here (the gateway still checks every call against its own).
    """
    if not isinstance(args_schema, dict):
        return {"type": "object"}
    schema = dict(args_schema)
    ref = schema.get("$ref")
    defs = schema.get("$defs")
    if isinstance(ref, str) and ref.startswith(_DEFS_PREFIX) and isinstance(defs, dict):
        target = defs.get(ref[len(_DEFS_PREFIX) :])
        if isinstance(target, dict):
            rest = {k: v for k, v in schema.items() if k not in ("$ref", "$defs")}
            schema = dict(target)
            schema.update(rest)
            if _has_ref(schema):
                schema["$defs"] = defs  # the target's own references point into them
    kind = schema.get("type")
    if kind is None:
        schema["type"] = "object"
    elif kind != "object":
        return {"type": "object"}
    return schema


def _has_ref(value: Any) -> bool:
    if isinstance(value, dict):
        return "$ref" in value or any(_has_ref(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_ref(v) for v in value)
    return False


def mcp_tools(manifests: Any) -> list[Json]:
    """The MCP tool entries for the gateway's ``tools.list`` answer, in its order, without
    ``tools.list`` itself.

    Error handling: :class:`RpcError` -32603 when the answer is not a list of manifests.
    """
    if not isinstance(manifests, list) or not all(
        isinstance(m, dict) and isinstance(m.get("name"), str) for m in manifests
    ):
        raise RpcError(
            INTERNAL_ERROR,
            "the gateway's tools.list answered with something other than a list of tool "
            "manifests; is cogni-tool older than gatewayd?",
        )
    return [_tool_entry(m) for m in manifests if m["name"] != GATEWAY_LIST_TOOL]


def _tool_entry(manifest: Json) -> Json:
    entry: Json = {"name": manifest["name"]}
    summary = manifest.get("summary")
    if isinstance(summary, str) and summary:
        entry["description"] = summary
    entry["inputSchema"] = input_schema(manifest.get("argsSchema"))
    if manifest.get("sideEffects") is False:
        entry["annotations"] = {"readOnlyHint": True}
    return entry


def tools_for_version(tools: list[Json], version: str) -> list[Json]:
    """``tools`` as ``version`` has them (2024-11-05 has no tool annotations)."""
    if version in ANNOTATION_VERSIONS:
        return tools
    return [{k: v for k, v in tool.items() if k != "annotations"} for tool in tools]


def page(tools: list[Json], cursor: Any, page_size: int) -> tuple[list[Json], str | None]:
    """One page of ``tools`` from ``cursor`` (None: the first) and the next page's cursor.

    A cursor is the offset of its page, as this server handed it out. Error handling:
    :class:`RpcError` -32602 for a cursor this server never gave (or one the list has
    since shrunk below).
    """
    start = 0
    if cursor is not None:
        if not (
            isinstance(cursor, str)
            and 0 < len(cursor) <= MAX_CURSOR_DIGITS
            and cursor.isascii()
            and cursor.isdigit()
            and 0 < int(cursor) < len(tools)
        ):
            raise RpcError(
                INVALID_PARAMS,
                f"invalid params: cursor {cursor!r} is not one this server gave out (or the "
                f"run's tool list has changed since); list again without a cursor",
            )
        start = int(cursor)
    end = start + page_size
    return tools[start:end], (str(end) if end < len(tools) else None)


def call_target(params: Json) -> tuple[str, Json]:
    """The tool name and arguments of a ``tools/call``.

    Error handling: :class:`RpcError` -32602 when ``name`` is not a non-empty string or
    ``arguments`` is neither absent nor an object.
    """
    name = params.get("name")
    if not isinstance(name, str) or not name:
        raise RpcError(
            INVALID_PARAMS,
            f"invalid params: tools/call needs name, a tool's name from tools/list; got {name!r}",
        )
    arguments = params.get("arguments")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise RpcError(
            INVALID_PARAMS,
            f"invalid params: arguments for {name!r} must be a JSON object, got "
            f"{'an array' if isinstance(arguments, list) else type(arguments).__name__}",
        )
    return name, arguments


def progress_token(params: Json) -> RequestId | None:
    """The request's ``_meta.progressToken``, or None when the client asked for no progress."""
    meta = params.get("_meta")
    token = meta.get("progressToken") if isinstance(meta, dict) else None
    return token if _is_request_id(token) else None


def progress(token: RequestId, done: int, total: int, message: str, version: str) -> Json:
    """A ``notifications/progress`` message (its ``message`` only where ``version`` has it)."""
    params: Json = {"progressToken": token, "progress": done, "total": total}
    if version in PROGRESS_MESSAGE_VERSIONS:
        params["message"] = message
    return notification("notifications/progress", params)


def call_result(value: Any, version: str) -> Json:
    """The ``tools/call`` result for the gateway's answer ``value``: its JSON as text, and
    as ``structuredContent`` too where ``version`` has it and the value is an object."""
    text = encode_message(value).decode("utf-8").rstrip("\n")
    result: Json = {"content": [{"type": "text", "text": text}], "isError": False}
    if version in STRUCTURED_CONTENT_VERSIONS and isinstance(value, dict):
        result["structuredContent"] = value
    return result


def tool_error_result(code: str, message: str) -> Json:
    """A refused or failed call as a tool error: ``isError`` and the gateway's words, the
    error code first (``policy_denied: …``) so a model can tell a denial from a failure."""
    return {"content": [{"type": "text", "text": f"{code}: {message}"}], "isError": True}


def method_not_found(request: Request) -> RpcError:
    return RpcError(
        METHOD_NOT_FOUND,
        f"method not found: {request.method!r}; this server offers {', '.join(METHODS)}",
        request.id,
    )
