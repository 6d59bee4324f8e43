"""The control socket: JSON over HTTP/1.1 on a root-only unix socket.

    curl --unix-socket /var/lib/gatewayd/control.sock http://gatewayd/v1/runs

Routes: ``GET /v1/health``, ``GET /v1/runs``, ``POST /v1/runs`` (a RunRequest),
``GET /v1/runs/{id}``, ``DELETE /v1/runs/{id}``, ``POST /v1/runs/{id}/exec`` (run a
command in the run's sandbox and wait for its result), ``POST /v1/runs/attach`` (an
attached `gatewayd run`: the connection switches to gatewayd/control_attach.py's
exchange), ``GET /v1/metrics`` (Prometheus
text format, docs/metrics.md), the review rules (``/v1/rules``...) and the apps' rules
(``POST /v1/apps/rules``, ``GET /v1/apps/rules/pending``,
``POST /v1/apps/rules/pending/{id}/confirm``, ``DELETE /v1/apps/rules/pending/{id}``),
the MCP servers' pins (``GET /v1/mcp/servers``, ``GET|POST
/v1/mcp/servers/{server}/pins``, ``GET /v1/mcp/servers/{server}/diff``), and the calls
waiting for approval (``GET /v1/approvals``, ``POST /v1/approvals/{id}/approve|deny``),
and the runs' workspace sessions (``GET /v1/workspaces``, ``GET /v1/workspaces/{runId}``,
``GET /v1/workspaces/{runId}/diff``, ``POST /v1/workspaces/{runId}/commit|discard``),
and agent runs on Temporal when ``temporal_address`` is set (``POST /v1/agent-runs``,
``GET|DELETE /v1/agent-runs/{workflowId}``, ``GET /v1/agent-runs/{workflowId}/result``;
docs/scale-out.md).
HTTP parsing is h11's (sans-IO); this module only routes. No run socket can reach it:
it lives in the state directory, which no sandbox sees, and it refuses peers other than
root or the daemon's own user. A query parameter a route does not take, or one given twice, is
refused (400), never ignored.

The socket's path is its own: a start refuses a path where something listens (another
gatewayd's socket, a run's) or that is not a socket (an audit log, any file), and
replaces only a socket nobody listens on (a crashed daemon's); a stop removes the
path only while it is still the socket this server bound. A listening socket systemd
passed (gatewayd.socket, gatewayd.sdlisten) is served as it is and never removed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import socket
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, TypeVar
from urllib.parse import parse_qsl

import h11
import pydantic
import structlog
import trio

from gatewayd import strictjson
from gatewayd.approvals import (
    MAX_DECISION_REASON_CHARS,
    ApprovalNotPending,
    Approvals,
    Operator,
    check_operator_text,
)
from gatewayd.apps.ruledesk import AppliedAppRule, AppRuleDesk
from gatewayd.audit import AuditWriteError, Peer
from gatewayd.control_attach import (
    ATTACH_PROTOCOL,
    ATTACH_TARGET,
    AttachRequest,
    asks_to_attach,
    check_command,
    serve_attached,
)
from gatewayd.errors import GatewayError, InvalidArguments, PolicyViolation, ToolFailed
from gatewayd.mcp.approval import Approval, ApprovalError
from gatewayd.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gatewayd.metrics import GatewayMetrics
from gatewayd.policy import PolicyError
from gatewayd.policy.network import MAX_COMMAND_DOMAINS
from gatewayd.policy.package_managers import package_manager_names
from gatewayd.policy.paths import MAX_PATH_BYTES
from gatewayd.policy.rule_action import RuleAction
from gatewayd.protocol import ErrorCode, Fault
from gatewayd.review.rulebook import Applied, Pending, RuleChangeError
from gatewayd.review.ruledesk import RuleDesk
from gatewayd.runs import MAX_PATH_CHARS, RunRegistry, RunRequest, format_validation_error
from gatewayd.runs.lifecycle import RunManager
from gatewayd.sandbox.launch import ResultForm, exec_result_json
from gatewayd.sandbox.session import SandboxUnavailable
from gatewayd.scaleout.submission import (
    AgentRunsError,
    AgentSubmission,
    ErrorKind,
    check_workflow_id,
)
from gatewayd.server import open_unix_listener, peer_credentials
from gatewayd.tools.exec import MAX_ENV_VALUE_CHARS, MAX_ENV_VARS, ExecOptions
from gatewayd.workspace.store import (
    WorkspaceBusy,
    WorkspaceConflict,
    WorkspaceNotFound,
    WorkspaceStore,
    diff_json,
)

if TYPE_CHECKING:
    # Only the type: the Temporal SDK is imported by a daemon that submits agent runs.
    from gatewayd.scaleout.client import AgentRunsService

log = structlog.get_logger("gatewayd.control")

# A run request is a few hundred bytes; anything near this is not one.
MAX_BODY_BYTES: Final = 1 << 20
# An operator's curl finishes in milliseconds; a stuck client is dropped.
REQUEST_TIMEOUT_S: Final = 30.0
RECV_CHUNK: Final = 64 * 1024
_RUN_PATH: Final = re.compile(r"/v1/runs/([0-9a-f]{32})")
_EXEC_PATH: Final = re.compile(r"/v1/runs/([0-9a-f]{32})/exec")
_M = TypeVar("_M", bound=pydantic.BaseModel)
# HTTP status of a refused request, by whose fault its error code says it was.
_STATUS: Final[Mapping[Fault, int]] = {
    Fault.CALLER: 400,
    Fault.POLICY: 403,
    Fault.GATEWAYD: 500,
    Fault.UPSTREAM: 502,
}
# The longest argv an exec may carry (ARG_MAX-like; more is not a command but a payload).
MAX_EXEC_ARGS: Final = 4096
# The query parameters each route takes; any other, or one given twice, is refused (a
# parameter silently dropped would be a request answered as if it said something else).
_QUERY_PARAMETERS: Final[dict[tuple[str, str], frozenset[str]]] = {
    ("GET", "/v1/rules"): frozenset({"policy"}),
}
# No route takes more than one parameter; a longer query is refused before it is
# parsed further.
MAX_QUERY_FIELDS: Final = 16
# Whether something listens on a control socket path is asked with one connect(): a
# live listener accepts at once (or its backlog is full: EAGAIN); nobody there is
# ECONNREFUSED at once. This long without an answer counts as someone there.
CONTROL_PROBE_TIMEOUT_S: Final = 2.0


_PENDING_PATH: Final = re.compile(r"/v1/rules/pending/([0-9a-f]{32})(/confirm)?")
_APP_PENDING_PATH: Final = re.compile(r"/v1/apps/rules/pending/([0-9a-f]{32})(/confirm)?")
# A call waiting for approval, and the operator's answer to it.
_APPROVAL_PATH: Final = re.compile(r"/v1/approvals/([0-9a-f]{32})/(approve|deny)")
# A run's workspace session, its diff, its commit and discard.
_WORKSPACE_PATH: Final = re.compile(r"/v1/workspaces/([0-9a-f]{32})(?:/(diff|commit|discard))?")
_WORKSPACE_ROUTES: Final = frozenset(
    {("GET", None), ("GET", "diff"), ("POST", "commit"), ("POST", "discard")}
)
# A declared MCP server's pins and their diff (the name's shape: gatewayd.mcp.pinset).
_MCP_PATH: Final = re.compile(r"/v1/mcp/servers/([a-z][a-z0-9_]{0,31})/(pins|diff)")
# An exec request's option strings, bounded before they are audited: a host name is at
# most 253 characters (the DNS's limit); a package manager set's name and a variable's
# name are short words (the sets' own names, the policy's env.allow names).
MAX_EXEC_DOMAIN_CHARS: Final = 253
MAX_EXEC_MANAGER_NAME_CHARS: Final = 32
MAX_EXEC_ENV_NAME_CHARS: Final = 256
# The MCP tools one pin request may name: a server's pinned tools are capped lower.
MAX_PIN_TOOLS: Final = 1024
# An agent run on Temporal: its status, its result, its cancellation (the id's own
# shape is checked by gatewayd.scaleout.submission, so a wrong one is told why).
_AGENT_RUN_PATH: Final = re.compile(r"/v1/agent-runs/([^/]{1,200})(/result)?")
# Whose fault a failed agent-run request was, as the wire's error codes say it.
_AGENT_RUNS_CODE: Final[Mapping[ErrorKind, ErrorCode]] = {
    ErrorKind.BAD_REQUEST: ErrorCode.BAD_REQUEST,
    ErrorKind.NOT_FOUND: ErrorCode.BAD_REQUEST,
    ErrorKind.CONFLICT: ErrorCode.BAD_REQUEST,
    ErrorKind.UNREACHABLE: ErrorCode.TOOL_FAILED,
    ErrorKind.TIMEOUT: ErrorCode.TIMEOUT,
}
# Who an operator says they are: the review desk's addedBy bound.
MAX_OPERATOR_NAME_CHARS: Final = 200


class RuleRequest(pydantic.BaseModel):
    """``POST /v1/rules``: one change to a policy's plain-language review rules."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)

    # A policy's name (a path is refused when it is looked up).
    policy: str = pydantic.Field(min_length=1, max_length=MAX_PATH_CHARS)
    action: Literal["add_deny", "remove_allow", "add_allow", "remove_deny"]
    rule: str = pydantic.Field(min_length=1, max_length=2000)
    addedBy: str | None = pydantic.Field(default=None, max_length=200)


class AppRuleRequest(pydantic.BaseModel):
    """``POST /v1/apps/rules``: the operator's own change to an app's rules, applied at
    once whichever way it goes (the operator is the one who confirms)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)

    # The workspace's host path: absolute, since the daemon's working directory is not
    # the operator's.
    workspace: str = pydantic.Field(min_length=1, max_length=MAX_PATH_CHARS)
    app: str = pydantic.Field(min_length=1, max_length=200)
    action: Literal["add_deny", "remove_allow", "add_allow", "remove_deny"]
    rule: str = pydantic.Field(min_length=1, max_length=2000)
    addedBy: str | None = pydantic.Field(default=None, max_length=MAX_OPERATOR_NAME_CHARS)

    @pydantic.field_validator("workspace")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/") or "\0" in value:
            raise ValueError("the workspace is an absolute host path")
        return value


class PinRequest(pydantic.BaseModel):
    """``POST /v1/mcp/servers/{server}/pins``: pin the server's live tools (``tools``:
    these MCP names alone; null: every one), as ``pinnedBy``."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)

    tools: tuple[str, ...] | None = pydantic.Field(default=None, max_length=MAX_PIN_TOOLS)
    pinnedBy: str = pydantic.Field(min_length=1, max_length=MAX_OPERATOR_NAME_CHARS)


class ConfirmRequest(pydantic.BaseModel):
    """``POST /v1/apps/rules/pending/{id}/confirm``: who confirms (for the record)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)

    by: str | None = pydantic.Field(default=None, max_length=MAX_OPERATOR_NAME_CHARS)


class WorkspaceAction(pydantic.BaseModel):
    """``POST /v1/workspaces/{runId}/commit|discard``: who asks (recorded in the audit
    entry beside the peer's uid)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)

    by: str | None = pydantic.Field(default=None, min_length=1, max_length=MAX_OPERATOR_NAME_CHARS)


class ApprovalAnswer(pydantic.BaseModel):
    """``POST /v1/approvals/{id}/approve|deny``: who answers (a name, recorded beside the
    peer's uid) and why (a denial's reason is relayed to the agent)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)

    by: str | None = pydantic.Field(default=None, max_length=MAX_OPERATOR_NAME_CHARS)
    reason: str | None = pydantic.Field(default=None, max_length=MAX_DECISION_REASON_CHARS)

    @pydantic.field_validator("by", "reason")
    @classmethod
    def _one_line(cls, value: str | None, info: pydantic.ValidationInfo) -> str | None:
        return check_operator_text(value, info.field_name or "it", MAX_DECISION_REASON_CHARS)


def _parse(model: type[_M], body: bytes, what: str = "request") -> _M:
    """A request body as ``model``: one JSON discipline (gatewayd/strictjson.py: no key
    twice, bounded depth, no NaN), then strict types (``"yes"`` is not ``true``)."""
    try:
        strictjson.check(body or b"null")
    except strictjson.JsonInputError as exc:
        raise HttpError(400, ErrorCode.BAD_REQUEST, f"body is not acceptable JSON: {exc}") from None
    try:
        return model.model_validate_json(body or b"null", strict=True)
    except pydantic.ValidationError as exc:
        raise HttpError(
            400, ErrorCode.BAD_REQUEST, f"bad {what}: {format_validation_error(exc)}"
        ) from None


def _applied(applied: Applied) -> dict[str, Any]:
    return {
        **applied.change.describe(),
        "rulesetBefore": applied.before,
        "rulesetAfter": applied.after,
    }


class ExecRequest(pydantic.BaseModel):
    """``POST /v1/runs/{id}/exec``: a command to run in the run's sandbox."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)

    command: tuple[str, ...] = pydantic.Field(min_length=1, max_length=MAX_EXEC_ARGS)
    stdin: str | None = None
    timeoutSec: float | None = pydantic.Field(default=None, gt=0, allow_inf_nan=False)
    # sandbox.exec's options (gatewayd/tools/exec.py checks them the same way for both).
    # Bounded here as the tool's arguments are: they are audited before they are checked.
    cwd: str | None = pydantic.Field(default=None, max_length=MAX_PATH_BYTES)
    env: (
        dict[
            Annotated[str, pydantic.Field(max_length=MAX_EXEC_ENV_NAME_CHARS)],
            Annotated[str, pydantic.Field(max_length=MAX_ENV_VALUE_CHARS)],
        ]
        | None
    ) = pydantic.Field(default=None, max_length=MAX_ENV_VARS)
    allowedDomains: (
        tuple[Annotated[str, pydantic.Field(max_length=MAX_EXEC_DOMAIN_CHARS)], ...] | None
    ) = pydantic.Field(default=None, max_length=MAX_COMMAND_DOMAINS)
    packageManagers: (
        tuple[Annotated[str, pydantic.Field(max_length=MAX_EXEC_MANAGER_NAME_CHARS)], ...] | None
    ) = pydantic.Field(default=None, max_length=len(package_manager_names()))

    def options(self) -> ExecOptions | None:
        """The request's options; None when it gives none (the command runs as ever)."""
        given = (self.cwd, self.env, self.allowedDomains, self.packageManagers)
        if all(value is None for value in given):
            return None
        return ExecOptions(
            cwd=self.cwd,
            env=self.env or {},
            allowed_domains=self.allowedDomains,
            package_managers=self.packageManagers,
        )

    @pydantic.field_validator("command")
    @classmethod
    def _no_nul(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return check_command(value)


class HttpError(Exception):
    def __init__(self, status: int, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class _Text(str):
    """A response body sent as it is (the metrics), not as JSON."""


class ControlSocketInUse(Exception):
    """The control socket's path is not this daemon's to take: something listens there,
    or it is not a socket. ``str(exc)`` says what is there and what to change; nothing
    was touched."""


_CHANGE_SOCKET = "give this daemon another --control-socket (control_socket)"


def control_socket_problem(path: Path) -> str | None:
    """Why a new control socket may not be bound at ``path`` (taken as its real path),
    or None: nothing is there, or a socket nobody listens on (a crashed daemon's, which
    :meth:`ControlServer.serve` replaces). Blocking (one connect)."""
    real = Path(os.path.realpath(path))
    shown = f"{path}" if real == path else f"{path} (really {real})"
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"the control socket path {shown} cannot be read ({exc.strerror}): {_CHANGE_SOCKET}"
    if not stat.S_ISSOCK(st.st_mode):
        return (
            f"the control socket path {shown} is {_kind(st.st_mode)}, not a socket, and "
            "gatewayd replaces nothing there but a socket nobody listens on (this may be "
            f"another daemon's audit log or any file of the host's): {_CHANGE_SOCKET}"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(CONTROL_PROBE_TIMEOUT_S)
    try:
        probe.connect(os.fspath(real))
    except (ConnectionRefusedError, FileNotFoundError):
        return None  # nobody listens: a crashed daemon's socket
    except OSError as exc:
        why = exc.strerror or type(exc).__name__  # a full backlog, a timeout, EACCES
        return (
            f"the control socket {shown} could not be asked whether something listens "
            f"there ({why}), so it is not taken: {_CHANGE_SOCKET}, or remove it once "
            "nothing uses it"
        )
    finally:
        probe.close()
    return (
        f"something listens on the control socket {shown} (another gatewayd, or a "
        f"run's socket); it is not taken from it: {_CHANGE_SOCKET}, or stop what listens "
        f"there (`ss -xlp | grep {real}` names it)"
    )


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a device, a pipe or another special file"


def _error_body(code: ErrorCode, message: str) -> dict[str, Any]:
    return {"ok": False, "errorCode": str(code), "message": message}


def _query_parameters(method: str, target: str, query: str) -> dict[str, str]:
    """The query of a request to ``target``: each parameter the route takes, at most
    once. HttpError (400) for a malformed query, a parameter the route does not take,
    or one given twice."""
    try:
        fields = parse_qsl(
            query,
            keep_blank_values=True,
            strict_parsing=True,
            max_num_fields=MAX_QUERY_FIELDS,
            errors="strict",
        )
    except ValueError as exc:  # UnicodeDecodeError too
        raise HttpError(400, ErrorCode.BAD_REQUEST, f"malformed query string: {exc}") from None
    takes = _QUERY_PARAMETERS.get((method, target), frozenset())
    params: dict[str, str] = {}
    for name, value in fields:
        if name not in takes:
            allowed = ", ".join(sorted(takes)) or "no query parameters"
            raise HttpError(
                400,
                ErrorCode.BAD_REQUEST,
                f"unknown query parameter {name[:100]!r} for {method} {target}; it takes: "
                f"{allowed}",
            )
        if name in params:
            raise HttpError(
                400,
                ErrorCode.BAD_REQUEST,
                f"query parameter {name!r} is given more than once; give it once",
            )
        params[name] = value
    return params


class ControlServer:
    """Serves the control API for one daemon: its runs (``registry``, started, ended and
    run in through ``runs``), its review rules (``rules``) and its ``metrics``."""

    def __init__(
        self,
        *,
        runs: RunManager,
        rules: RuleDesk,
        registry: RunRegistry,
        metrics: GatewayMetrics,
        app_rules: AppRuleDesk | None = None,
        mcp: Approval | None = None,
        approvals: Approvals | None = None,
        workspaces: WorkspaceStore | None = None,
        agent_runs: AgentRunsService | None = None,
    ) -> None:
        self.runs = runs
        # None: no Temporal configured; the agent-run routes answer 404 saying so.
        self.agent_runs = agent_runs
        # None: this server answers no workspace route (its routes answer 404).
        self.workspaces = workspaces
        # None: this server answers no approvals (its routes answer 404).
        self.approvals = approvals
        # None: this server pins no MCP server's tools (its routes answer 404).
        self.mcp = mcp
        self.rules = rules
        self.registry = registry
        self.metrics = metrics
        # None: this server changes no app's rules (its routes answer 404).
        self.app_rules = app_rules

    async def serve(
        self,
        path: Path,
        *,
        passed: socket.socket | None = None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``path`` (its real path) until cancelled. A socket nobody listens on
        there is replaced; at the end the path is removed if it is still this socket.
        ``passed``: the listening socket at ``path`` systemd holds (gatewayd.sdlisten),
        served as it is; its path is systemd's and is never removed.

        Error handling: ControlSocketInUse (:func:`control_socket_problem`) when
        something listens there or it is not a socket; nothing is touched then.
        """
        if passed is not None:
            listener = trio.SocketListener(trio.socket.from_stdlib_socket(passed))
            await self._serve_on(listener, task_status=task_status)
            return
        path = Path(os.path.realpath(path))
        problem = await trio.to_thread.run_sync(control_socket_problem, path)
        if problem is not None:
            raise ControlSocketInUse(problem)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                path.unlink()  # nobody listens on it: a crashed daemon's
        listener = await open_unix_listener(path, mode=0o600)
        bound = os.lstat(path)
        try:
            await self._serve_on(listener, task_status=task_status)
        finally:
            # Only our own socket: whatever took the path since is not ours to remove.
            with contextlib.suppress(OSError):
                now = os.lstat(path)
                if (now.st_dev, now.st_ino) == (bound.st_dev, bound.st_ino):
                    path.unlink()

    async def _serve_on(
        self,
        listener: trio.SocketListener,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async with listener, trio.open_nursery() as nursery:
            task_status.started()
            while True:
                stream = await listener.accept()
                nursery.start_soon(self._connection, stream)

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=16 * 1024)
        try:
            peer = peer_credentials(stream.socket)
            allowed = peer.uid in (0, os.geteuid())
            while True:
                # The request is read even from a refused peer: answering before it is
                # consumed and then closing would reset the connection, and the client
                # would see a failed connect instead of the 403.
                with trio.fail_after(REQUEST_TIMEOUT_S):
                    request, body = await self._read_request(stream, conn)
                if request is None:
                    return
                if not allowed:
                    log.warning("control_peer_refused", uid=peer.uid, pid=peer.pid)
                    refusal = "the control socket is for root only"
                    await self._send(
                        stream, conn, 403, _error_body(ErrorCode.AUTHZ_DENIED, refusal)
                    )
                    return
                # A line logged for this request carries no run id of an earlier one.
                structlog.contextvars.clear_contextvars()
                if request.target.partition(b"?")[0].rstrip(b"/") == ATTACH_TARGET.encode():
                    await self._attach(stream, conn, request, body)
                    return
                status, payload = await self._route(request, body, peer)
                await self._send(stream, conn, status, payload)
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
            pass
        except HttpError as exc:  # refused while reading: answer, then close
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                with contextlib.suppress(trio.BrokenResourceError, h11.LocalProtocolError):
                    await self._send(stream, conn, exc.status, _error_body(exc.code, exc.message))
        except h11.RemoteProtocolError as exc:
            log.info("control_bad_http", error=str(exc))
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                with contextlib.suppress(trio.BrokenResourceError, h11.LocalProtocolError):
                    await self._send(
                        stream,
                        conn,
                        400,
                        _error_body(ErrorCode.BAD_REQUEST, f"malformed HTTP: {exc}"),
                    )
        except Exception:
            log.exception("control_connection_failed")
        finally:
            await trio.aclose_forcefully(stream)

    async def _read_request(
        self, stream: trio.SocketStream, conn: h11.Connection
    ) -> tuple[h11.Request | None, bytes]:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(RECV_CHUNK)
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY_BYTES:
                    raise HttpError(
                        413, ErrorCode.BAD_REQUEST, f"request body over {MAX_BODY_BYTES} bytes"
                    )
            elif isinstance(event, h11.EndOfMessage):
                return request, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                return None, b""

    async def _route(
        self, request: h11.Request, body: bytes, peer: Peer | None = None
    ) -> tuple[int, Any]:
        method = request.method.decode()
        path, _, query = request.target.decode().partition("?")
        target = path.rstrip("/")
        try:
            params = _query_parameters(method, target, query)
            if target == "/v1/health" and method == "GET":
                return 200, {"ok": True, "runs": len(self.registry.all())}
            if target == "/v1/metrics" and method == "GET":
                return 200, _Text(self.metrics.render())
            if target == "/v1/runs" and method == "GET":
                return 200, {"ok": True, "runs": [r.summary() for r in self.registry.all()]}
            if target == "/v1/runs" and method == "POST":
                return await self._create(body)
            if target.startswith("/v1/rules"):
                return await self._rules(method, target, params, body)
            if target.startswith("/v1/apps/rules") and self.app_rules is not None:
                return await self._app_rules(self.app_rules, method, target, body)
            if target.startswith("/v1/mcp/") and self.mcp is not None:
                return await self._mcp(self.mcp, method, target, body)
            if target.startswith("/v1/workspaces") and self.workspaces is not None:
                return await self._workspaces(self.workspaces, method, target, body, peer)
            if target == "/v1/agent-runs" or target.startswith("/v1/agent-runs/"):
                return await self._agent_runs(method, target, body)
            if target.startswith("/v1/approvals") and self.approvals is not None:
                return await self._approvals(self.approvals, method, target, body, peer)
            exec_match = _EXEC_PATH.fullmatch(target)
            if exec_match and method == "POST":
                return await self._exec(exec_match.group(1), body)
            match = _RUN_PATH.fullmatch(target)
            if match and method == "GET":
                run = self.registry.get(match.group(1))
                if run is None:
                    raise HttpError(404, ErrorCode.BAD_REQUEST, "no such run")
                return 200, {"ok": True, "run": run.summary()}
            if match and method == "DELETE":
                summary = await self.runs.end(match.group(1), reason="ended_by_operator")
                if summary is None:
                    raise HttpError(404, ErrorCode.BAD_REQUEST, "no such run")
                return 200, {"ok": True, "run": summary}
            raise HttpError(
                404,
                ErrorCode.BAD_REQUEST,
                f"no route {method} {target}; routes: GET /v1/health, GET /v1/metrics, "
                "GET|POST /v1/runs, POST /v1/runs/attach (an Upgrade), "
                "GET|DELETE /v1/runs/{runId}, POST /v1/runs/{runId}/exec, GET|POST /v1/rules, "
                "GET /v1/rules/pending, POST /v1/rules/pending/{id}/confirm, "
                "DELETE /v1/rules/pending/{id}, POST /v1/apps/rules, "
                "GET /v1/apps/rules/pending, POST /v1/apps/rules/pending/{id}/confirm, "
                "DELETE /v1/apps/rules/pending/{id}, GET /v1/mcp/servers, "
                "GET|POST /v1/mcp/servers/{server}/pins, GET /v1/mcp/servers/{server}/diff, "
                "GET /v1/approvals, POST /v1/approvals/{id}/approve|deny, "
                "GET /v1/workspaces, GET /v1/workspaces/{runId}, "
                "GET /v1/workspaces/{runId}/diff, POST /v1/workspaces/{runId}/commit|discard, "
                "POST /v1/agent-runs, GET|DELETE /v1/agent-runs/{workflowId}, "
                "GET /v1/agent-runs/{workflowId}/result",
            )
        except HttpError as exc:
            return exc.status, _error_body(exc.code, exc.message)
        except Exception:
            # gatewayd's fault: the operator still gets an answer, and the connection
            # (and every other request) goes on.
            log.exception("control_request_failed", method=method, target=target[:200])
            return 500, _error_body(
                ErrorCode.INTERNAL,
                "gatewayd failed on this request; its log (control_request_failed) has details",
            )

    async def _create(self, body: bytes) -> tuple[int, Any]:
        request = _parse(RunRequest, body, "run request")
        try:
            run = await self.runs.start(request)
        except GatewayError as exc:  # AuthzDenied, PolicyViolation, SandboxUnavailable
            raise HttpError(_STATUS[exc.code.fault], exc.code, str(exc)) from None
        except (PolicyError, ValueError) as exc:
            raise HttpError(400, ErrorCode.BAD_REQUEST, str(exc)) from None
        except OSError as exc:
            log.exception("run_create_failed")
            raise HttpError(
                500, ErrorCode.INTERNAL, f"gatewayd could not create the run: {exc.strerror}"
            ) from None
        return 201, {"ok": True, "run": run.summary()}

    async def _rules(
        self, method: str, target: str, params: dict[str, str], body: bytes
    ) -> tuple[int, Any]:
        """Review rules: read them, change them (tightening at once, loosening pending),
        confirm or cancel a pending change. Only here: no run socket reaches rules."""
        desk = self.rules
        try:
            if target == "/v1/rules" and method == "GET":
                ref = params.get("policy", "")
                if not ref:
                    raise HttpError(400, ErrorCode.BAD_REQUEST, "name the policy: ?policy=NAME")
                source, section, rules = desk.current(ref)
                return 200, {
                    "ok": True,
                    "policy": os.path.realpath(source),
                    "allow": [rule.text for rule in section.rules.allow],
                    "deny": [rule.text for rule in section.rules.deny],
                    "ruleset": rules.digest,
                }
            if target == "/v1/rules" and method == "POST":
                asked = _parse(RuleRequest, body)
                outcome = await desk.change(
                    asked.policy, RuleAction(asked.action), asked.rule, asked.addedBy
                )
                if isinstance(outcome, Pending):
                    return 202, {
                        "ok": True,
                        "pending": {
                            "confirmationId": outcome.confirmation_id,
                            "change": outcome.change.describe(),
                            "confirm": f"POST /v1/rules/pending/{outcome.confirmation_id}/confirm",
                        },
                    }
                return 200, {"ok": True, "applied": _applied(outcome)}
            if target == "/v1/rules/pending" and method == "GET":
                return 200, {
                    "ok": True,
                    "pending": [
                        {"confirmationId": cid, "change": change.describe()}
                        for cid, change in desk.pending().items()
                    ],
                }
            match = _PENDING_PATH.fullmatch(target)
            if match and match.group(2) == "/confirm" and method == "POST":
                return 200, {
                    "ok": True,
                    "applied": _applied(await desk.confirm(match.group(1))),
                }
            if match and not match.group(2) and method == "DELETE":
                cancelled = await desk.cancel(match.group(1))
                return 200, {"ok": True, "cancelled": cancelled.describe()}
        except (RuleChangeError, PolicyError) as exc:
            raise HttpError(400, ErrorCode.BAD_REQUEST, str(exc)) from None
        raise HttpError(404, ErrorCode.BAD_REQUEST, f"no route {method} {target}")

    async def _app_rules(
        self, desk: AppRuleDesk, method: str, target: str, body: bytes
    ) -> tuple[int, Any]:
        """Apps' rules: the operator's own change (applied at once, both ways), and the
        loosening changes runs asked for: list, confirm, cancel. Only here: no run
        socket reaches a confirmation."""
        try:
            if target == "/v1/apps/rules" and method == "POST":
                asked = _parse(AppRuleRequest, body)
                applied = await desk.change(
                    Path(asked.workspace),
                    asked.app,
                    RuleAction(asked.action),
                    asked.rule,
                    asked.addedBy,
                    None,
                    by_operator=True,
                )
                if not isinstance(applied, AppliedAppRule):  # by_operator never parks
                    raise HttpError(500, ErrorCode.INTERNAL, "the change was not applied")
                return 200, {"ok": True, "applied": applied.describe()}
            if target == "/v1/apps/rules/pending" and method == "GET":
                return 200, {
                    "ok": True,
                    "pending": [pending.describe() for pending in desk.pending().values()],
                }
            match = _APP_PENDING_PATH.fullmatch(target)
            if match and match.group(2) == "/confirm" and method == "POST":
                confirm = _parse(ConfirmRequest, body or b"{}")
                applied = await desk.confirm(match.group(1), confirm.by)
                return 200, {"ok": True, "applied": applied.describe()}
            if match and not match.group(2) and method == "DELETE":
                cancelled = await desk.cancel(match.group(1))
                return 200, {"ok": True, "cancelled": cancelled.describe()}
        except GatewayError as exc:
            # The change's own code: invalid_args (the rule, the app), bad_request (an
            # unknown confirmation id), tool_failed (APP.md unreadable or unwritable),
            # internal (the audit log); the status follows whose fault it is.
            raise HttpError(_STATUS[exc.code.fault], exc.code, str(exc)) from None
        raise HttpError(
            404,
            ErrorCode.BAD_REQUEST,
            f"no route {method} {target}; apps' rules: POST /v1/apps/rules, GET "
            "/v1/apps/rules/pending, POST /v1/apps/rules/pending/{id}/confirm, DELETE "
            "/v1/apps/rules/pending/{id}",
        )

    async def _mcp(
        self, approval: Approval, method: str, target: str, body: bytes
    ) -> tuple[int, Any]:
        """MCP servers' pins: list the servers, show, diff and pin one (the operator's
        approval: only here, never from a run's socket)."""
        try:
            if target == "/v1/mcp/servers" and method == "GET":
                return 200, await approval.servers()
            match = _MCP_PATH.fullmatch(target)
            if match and match.group(2) == "pins" and method == "GET":
                return 200, await approval.show(match.group(1))
            if match and match.group(2) == "diff" and method == "GET":
                return 200, await approval.diff(match.group(1))
            if match and match.group(2) == "pins" and method == "POST":
                asked = _parse(PinRequest, body, "pin request")
                server = match.group(1)
                return 200, await approval.pin(server, tools=asked.tools, by=asked.pinnedBy)
        except ApprovalError as exc:
            raise HttpError(_STATUS[exc.code.fault], exc.code, exc.message) from None
        raise HttpError(
            404,
            ErrorCode.BAD_REQUEST,
            f"no route {method} {target}; MCP servers: GET /v1/mcp/servers, "
            "GET|POST /v1/mcp/servers/{server}/pins, GET /v1/mcp/servers/{server}/diff",
        )

    async def _workspaces(
        self, store: WorkspaceStore, method: str, target: str, body: bytes, peer: Peer | None
    ) -> tuple[int, Any]:
        """The runs' workspace sessions: list them (kept ones past their time expire
        first), show one, its diff, commit or discard it. The store's lock makes this
        safe beside a `gatewayd workspace` command working on the same state directory."""
        if target == "/v1/workspaces" and method == "GET":
            await trio.to_thread.run_sync(store.expire)
            sessions = await trio.to_thread.run_sync(store.list)
            return 200, {"ok": True, "workspaces": [info.to_json() for info in sessions]}
        match = _WORKSPACE_PATH.fullmatch(target)
        action = match.group(2) if match else None
        if match is None or (method, action) not in _WORKSPACE_ROUTES:
            raise HttpError(
                404,
                ErrorCode.BAD_REQUEST,
                f"no route {method} {target}; workspaces: GET /v1/workspaces, "
                "GET /v1/workspaces/{runId}, GET /v1/workspaces/{runId}/diff, "
                "POST /v1/workspaces/{runId}/commit, POST /v1/workspaces/{runId}/discard",
            )
        run_id = match.group(1)
        try:
            if action is None:
                info = await trio.to_thread.run_sync(store.info, run_id)
                return 200, {"ok": True, "workspace": info.to_json()}
            if action == "diff":
                # The mode says how to read it: in mode host the git metadata is in the base.
                mode = (await trio.to_thread.run_sync(store.info, run_id)).mode
                diff = await trio.to_thread.run_sync(store.diff, run_id)
                return 200, {"ok": True, "runId": run_id, "mode": mode, "diff": diff_json(diff)}
            asked = _parse(WorkspaceAction, body or b"{}", f"{action} request")
            who = peer or Peer(pid=0, uid=os.geteuid(), gid=os.getegid())
            by = f"{asked.by or 'control socket'} (uid {who.uid})"
            if action == "commit":
                diff = await trio.to_thread.run_sync(functools.partial(store.commit, run_id, by=by))
                return 200, {"ok": True, "runId": run_id, "committed": diff_json(diff)}
            await trio.to_thread.run_sync(functools.partial(store.discard, run_id, by=by))
            return 200, {"ok": True, "runId": run_id, "discarded": True}
        except WorkspaceNotFound as exc:
            raise HttpError(404, exc.code, str(exc)) from None
        except (WorkspaceBusy, WorkspaceConflict) as exc:
            raise HttpError(409, exc.code, str(exc)) from None
        except GatewayError as exc:
            raise HttpError(_STATUS[exc.code.fault], exc.code, str(exc)) from None

    async def _agent_runs(self, method: str, target: str, body: bytes) -> tuple[int, Any]:
        """Agent runs on Temporal (gatewayd.scaleout): submit one, read its status or
        result, cancel it. Any gatewayd worker polling the task queue runs it, this
        host's or another's; nothing here starts a run on this daemon."""
        service = self.agent_runs
        if service is None:
            raise HttpError(
                404,
                ErrorCode.BAD_REQUEST,
                "this gatewayd submits no agent runs to Temporal: set temporal_address "
                "(GATEWAYD_TEMPORAL_ADDRESS) in its configuration and restart it "
                "(docs/scale-out.md), or use `gatewayd agent submit --temporal ADDRESS`",
            )
        match = _AGENT_RUN_PATH.fullmatch(target)
        try:
            if target == "/v1/agent-runs" and method == "POST":
                submission = _parse(AgentSubmission, body, "agent run submission")
                workflow_id = await service.submit(submission)
                return 201, {
                    "ok": True,
                    "workflowId": workflow_id,
                    "status": f"/v1/agent-runs/{workflow_id}",
                    "result": f"/v1/agent-runs/{workflow_id}/result",
                }
            if match and method == "GET" and match.group(2):
                return 200, await service.result(check_workflow_id(match.group(1)))
            if match and method == "GET":
                return 200, await service.status(check_workflow_id(match.group(1)))
            if match and method == "DELETE" and not match.group(2):
                return 202, await service.cancel(check_workflow_id(match.group(1)))
        except AgentRunsError as exc:
            raise HttpError(exc.kind.value, _AGENT_RUNS_CODE[exc.kind], exc.message) from None
        raise HttpError(
            404,
            ErrorCode.BAD_REQUEST,
            f"no route {method} {target}; agent runs: POST /v1/agent-runs, GET|DELETE "
            "/v1/agent-runs/{workflowId}, GET /v1/agent-runs/{workflowId}/result",
        )

    async def _approvals(
        self, approvals: Approvals, method: str, target: str, body: bytes, peer: Peer | None
    ) -> tuple[int, Any]:
        """Calls waiting for approval: list them, approve or deny one (only here: no run
        socket reaches an answer). The answer records the peer's uid and pid."""
        if target == "/v1/approvals" and method == "GET":
            return 200, {"ok": True, "approvals": approvals.pending()}
        match = _APPROVAL_PATH.fullmatch(target)
        if match and method == "POST":
            answer = _parse(ApprovalAnswer, body or b"{}", "approval answer")
            who = peer or Peer(pid=0, uid=os.geteuid(), gid=os.getegid())
            try:
                decided = await approvals.decide(
                    match.group(1),
                    approve=match.group(2) == "approve",
                    by=Operator(uid=who.uid, pid=who.pid, name=answer.by),
                    reason=answer.reason,
                )
            except ApprovalNotPending as exc:
                status = 409 if exc.already else 404
                raise HttpError(status, ErrorCode.BAD_REQUEST, exc.message) from None
            except AuditWriteError:
                raise HttpError(
                    500,
                    ErrorCode.INTERNAL,
                    "the audit log cannot be written, so the answer is not on the record "
                    "and the call does not run; fix the audit log and restart gatewayd",
                ) from None
            return 200, {"ok": True, "decided": decided}
        raise HttpError(
            404,
            ErrorCode.BAD_REQUEST,
            f"no route {method} {target}; approvals: GET /v1/approvals, POST "
            "/v1/approvals/{id}/approve, POST /v1/approvals/{id}/deny (id: 32 hex digits)",
        )

    async def _exec(self, run_id: str, body: bytes) -> tuple[int, Any]:
        request = _parse(ExecRequest, body, "exec request")
        stdin = None if request.stdin is None else request.stdin.encode()
        try:
            result, hint = await self.runs.exec_explained(
                run_id,
                list(request.command),
                stdin=stdin,
                timeout_s=request.timeoutSec,
                options=request.options(),
            )
        except LookupError:
            raise HttpError(404, ErrorCode.BAD_REQUEST, f"no such run {run_id}") from None
        except (PolicyViolation, InvalidArguments, ToolFailed) as exc:
            # The options were refused (audited); nothing ran. A cwd that is missing or
            # not a directory (tool_failed) is the request's mistake here, not upstream's.
            status = 400 if isinstance(exc, ToolFailed) else _STATUS[exc.code.fault]
            raise HttpError(status, exc.code, exc.safe_message) from None
        except SandboxUnavailable as exc:
            raise HttpError(409, exc.code, str(exc)) from None
        except AuditWriteError as exc:
            # The command ran (or failed to start) and its end is not on the record:
            # its result is withheld, as a call's value is.
            log.error("exec_end_not_audited", run_id=run_id, error=exc.detail)
            raise HttpError(
                500,
                ErrorCode.INTERNAL,
                "the audit log cannot be written, so the command's result is withheld; "
                "gatewayd's log (exec_end_not_audited) says why: fix the audit log and "
                "restart gatewayd",
            ) from None
        except GatewayError as exc:  # the plan or bwrap failed: gatewayd's or the host's fault
            log.exception("exec_failed", run_id=run_id)
            raise HttpError(
                500, ErrorCode.INTERNAL, f"the sandbox could not start: {exc}"
            ) from None
        return 200, {"ok": True, "result": exec_result_json(result, ResultForm.CONTROL, hint=hint)}

    async def _attach(
        self, stream: trio.SocketStream, conn: h11.Connection, request: h11.Request, body: bytes
    ) -> None:
        """``POST /v1/runs/attach`` (gatewayd/control_attach.py): refused as any request
        is when it is not one; else the connection switches and serves the run."""
        refusal: HttpError | None = None
        if request.method != b"POST":
            refusal = HttpError(
                405, ErrorCode.BAD_REQUEST, f"{ATTACH_TARGET} takes POST (gatewayd run sends it)"
            )
        elif not asks_to_attach(request):
            refusal = HttpError(
                400,
                ErrorCode.BAD_REQUEST,
                f"{ATTACH_TARGET} switches its connection: send Connection: Upgrade and "
                f"Upgrade: {ATTACH_PROTOCOL} (gatewayd run does)",
            )
        else:
            try:
                attach = _parse(AttachRequest, body, "attach request")
            except HttpError as exc:
                refusal = exc
        if refusal is not None:
            await self._send(
                stream, conn, refusal.status, _error_body(refusal.code, refusal.message)
            )
            return
        await serve_attached(stream, conn, attach, self.runs)

    async def _send(
        self, stream: trio.SocketStream, conn: h11.Connection, status: int, payload: Any
    ) -> None:
        if isinstance(payload, _Text):
            data, kind = payload.encode(), METRICS_CONTENT_TYPE
        else:
            data, kind = json.dumps(payload).encode() + b"\n", "application/json"
        headers = [("content-type", kind), ("content-length", str(len(data)))]
        out = conn.send(h11.Response(status_code=status, headers=headers))
        out += conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage())
        await stream.send_all(out)
