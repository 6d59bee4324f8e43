"""A run's in-sandbox services: ``cogni-tool serve`` inside the sandbox (the OpenAI
endpoint for model.chat, the egress bridge) and, on the host, the run's egress proxy
socket it forwards to.

Both live in the nursery that serves the run's socket: when the run ends they stop, and a
service that dies on its own is audited (``services_exited``), once.

Also a process tool call's own egress proxy (:class:`CallEgressProxies`), which lives
as long as the call.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import AsyncIterator, Container, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import structlog
import trio

from gatewayd.apps.manifest import TOOL_NAME_PREFIX
from gatewayd.audit import AuditEvent, AuditLog
from gatewayd.dialer import Resolver
from gatewayd.policy import RunRules, tool_allowed
from gatewayd.policy.model import NetworkSection
from gatewayd.runs.model import Run
from gatewayd.sandbox.launch import ExecResult, ResultForm, exec_result_json
from gatewayd.sandbox.plan import (
    COGNI_TOOL_VISIBLE_DIR,
    EGRESS_PROXY_PORT,
    EGRESS_SOCKET_NAME,
    MODEL_ENDPOINT_PORT,
    SANDBOX_EGRESS_SOCKET,
    Services,
)
from gatewayd.sandbox.session import RunSandbox, SandboxUnavailable
from gatewayd.tools.registry import ToolContext

log = structlog.get_logger("gatewayd.runs.services")

# cogni-tool serve: how long its start may take (a cold python3 and two listeners), and
# how long it outlives the run's maximum runtime (the run's end stops it first anyway).
SERVICE_READY_TIMEOUT_S = 10.0
SERVICE_GRACE_S = 60.0
# How much of its stderr gatewayd's log takes, per run (the rest is dropped, said once).
SERVICE_STDERR_LOG_BYTES = 16 * 1024
# What cogni-tool serve prints on stdout is one word ("ready"); more is not read.
SERVICE_STDOUT_READ_BYTES = 64
# The tail of a failed start's stderr that its refusal quotes.
SERVICE_FAILURE_TAIL_BYTES = 1024
SANDBOX_COGNI_TOOL = f"{COGNI_TOOL_VISIBLE_DIR}/cogni-tool"


def may_call_apps(rules: RunRules) -> bool:
    """Whether the run's tools.allow (and toolIds, when given) may allow an app's tool:
    its apps are found when it starts, after its services are planned, so this looks at
    the patterns (``app_*``, ``app_x``, ``*``), not at the apps."""
    patterns = any(p == "*" or p.startswith(TOOL_NAME_PREFIX) for p in rules.tool_patterns)
    ids = rules.run_tool_ids
    return patterns and (ids is None or any(t.startswith(TOOL_NAME_PREFIX) for t in ids))


def services_for(run: Run, tools: Container[str]) -> Services:
    """Which in-sandbox services the run gets: the OpenAI endpoint when it may call
    model.chat with at least one alias (and this gatewayd has model.chat among ``tools``)
    or may call apps (prompted there like models), the egress proxy when its policy turns
    the proxy on and allows at least one domain."""
    policy = run.spec.policy
    network = policy.network
    return Services(
        model_endpoint=(
            bool(policy.model_access.models)
            and tool_allowed("model.chat", run.spec.rules)
            and "model.chat" in tools
        )
        or may_call_apps(run.spec.rules),
        egress_proxy=network.proxy_enabled,
    )


async def start_services(
    run: Run,
    nursery: trio.Nursery,
    *,
    lifetime_s: float,
    audit: AuditLog,
    resolve: Resolver,
    models: Mapping[str, object],
    reply_after_result: bool,
) -> None:
    """Start the run's egress proxy socket and its ``cogni-tool serve`` in ``nursery``,
    and wait until that listens: the run's first command finds its endpoints up.
    ``models``: the configured model aliases (the endpoint offers those the run's policy
    grants); ``resolve``: how the egress proxy resolves names.

    Error handling: SandboxUnavailable when the services do not come up (the run
    then ends: a run without the endpoints its policy promises is not started).
    """
    sandbox = run.sandbox
    if sandbox is None or sandbox.services == Services():
        return
    services = sandbox.services
    command = [f"{SANDBOX_COGNI_TOOL}", "serve"]
    if services.egress_proxy:
        # The proxy and its HTTP libraries load with the first run that has one (a
        # serving daemon loads them at its start: gatewayd.libraries).
        from gatewayd.egress import EgressProxy, serve_egress

        proxy = EgressProxy(
            run_id=run.run_id,
            network=run.spec.policy.network,
            audit=audit,
            resolve=resolve,
            reply_after_result=reply_after_result,
        )
        run.egress = proxy  # a policy reload updates its allowlist
        await nursery.start(
            functools.partial(
                serve_egress,
                run.directory / EGRESS_SOCKET_NAME,
                proxy,
                group=sandbox.user.gid,
                owns_peer=sandbox.owns_peer,
            )
        )
        command += ["--proxy-port", str(EGRESS_PROXY_PORT)]
        command += ["--egress-socket", SANDBOX_EGRESS_SOCKET]
    if services.model_endpoint:
        granted = [m for m in run.spec.policy.model_access.models if m in models]
        command += ["--openai-port", str(MODEL_ENDPOINT_PORT), "--models", ",".join(granted)]
    ready = trio.Event()
    lines = bytearray()

    def out(data: bytes) -> None:
        if len(lines) < SERVICE_STDOUT_READ_BYTES:
            lines.extend(data[:SERVICE_STDOUT_READ_BYTES])
        if b"ready\n" in lines:
            ready.set()

    logged = 0

    def err(data: bytes) -> None:
        # The process is the run's: what it prints is bounded per run, so a run
        # cannot fill gatewayd's log.
        nonlocal logged
        if logged < SERVICE_STDERR_LOG_BYTES:
            text = data[: SERVICE_STDERR_LOG_BYTES - logged].decode("utf-8", "replace")
            log.warning("sandbox_services_stderr", run_id=run.run_id, text=text)
            if logged + len(data) >= SERVICE_STDERR_LOG_BYTES:
                log.warning("sandbox_services_stderr_capped", run_id=run.run_id)
        logged += len(data)

    outcome: list[ExecResult | BaseException] = []

    async def keep_serving() -> None:
        try:
            result = await sandbox.exec(
                command,
                echo=(out, err),
                limits=sandbox.limits.for_services(lifetime_s + SERVICE_GRACE_S),
            )
        except Exception as exc:
            outcome.append(exc)
            ready.set()
            return
        outcome.append(result)
        ready.set()
        if not run.cancel_scope.cancel_called:
            # Killed from inside (the run's own uid can) or crashed: the endpoints
            # are gone for the rest of the run; said once, loudly.
            detail = exec_result_json(result, ResultForm.EXIT)
            log.warning("sandbox_services_exited", run_id=run.run_id, **detail)
            await audit.append(
                "event", event=AuditEvent.SERVICES_EXITED, runId=run.run_id, detail=detail
            )

    nursery.start_soon(keep_serving)
    with trio.move_on_after(SERVICE_READY_TIMEOUT_S):
        await ready.wait()
    if outcome or not ready.is_set():
        why = (
            f"it did not say ready within {SERVICE_READY_TIMEOUT_S:.0f} s"
            if not outcome
            else _service_failure(outcome[0])
        )
        run.end_reason = "services_failed"
        raise SandboxUnavailable(
            f"run {run.run_id}'s in-sandbox services (cogni-tool serve: "
            f"{_describe_services(services)}) did not start: {why}"
        )
    await audit.append(
        "event",
        event=AuditEvent.SERVICES_STARTED,
        runId=run.run_id,
        detail={
            "modelEndpoint": f"127.0.0.1:{MODEL_ENDPOINT_PORT}"
            if services.model_endpoint
            else None,
            "egressProxy": f"127.0.0.1:{EGRESS_PROXY_PORT}" if services.egress_proxy else None,
        },
    )


def _service_failure(outcome: ExecResult | BaseException) -> str:
    if isinstance(outcome, BaseException):
        return str(outcome)
    text = outcome.stderr[-SERVICE_FAILURE_TAIL_BYTES:].decode("utf-8", "replace").strip()
    return f"it exited ({outcome.exitCode or outcome.signal}): {text or 'no message'}"


def _describe_services(services: Services) -> str:
    names = [
        name
        for name, on in (
            ("the OpenAI endpoint", services.model_endpoint),
            ("the egress bridge", services.egress_proxy),
        )
        if on
    ]
    return " and ".join(names)


class CallEgressProxies:
    """Process tool calls' own egress proxies (a
    :class:`~gatewayd.runners.process.CallEgress`, given to the process runner by the
    daemon's wiring).

    One call's proxy is the run's proxy code (:class:`~gatewayd.egress.EgressProxy`,
    same checks, limits and audit entries, in the same audit log) with the section the
    runner narrowed: the run's, its domains those the tool declares and the run allows.
    Its entries name the tool and the call (``tool``, ``toolCallId`` in their detail).
    It serves its socket to the run sandbox's processes outside the run's own network
    namespace (the call's sandbox has one of its own), mode 0660 to the run's group as
    the run's proxy socket is; it stops, its open connections closed and audited, and
    its socket file is removed when the call ends.
    """

    def __init__(self, *, audit: AuditLog, resolve: Resolver, reply_after_result: bool) -> None:
        self._audit = audit
        self._resolve = resolve
        self._reply_after_result = reply_after_result

    def __call__(
        self, *, ctx: ToolContext, tool: str, network: NetworkSection, socket: Path
    ) -> AbstractAsyncContextManager[None]:
        if ctx.sandbox is None:  # the runner refuses such a call before; never served
            raise SandboxUnavailable(f"run {ctx.run_id} has no OS sandbox")
        return self.serve(
            run_id=ctx.run_id,
            sandbox=ctx.sandbox,
            network=network,
            socket=socket,
            tags={"tool": tool, "toolCallId": ctx.tool_call_id or ""},
        )

    @asynccontextmanager
    async def serve(
        self,
        *,
        run_id: str,
        sandbox: RunSandbox,
        network: NetworkSection,
        socket: Path,
        tags: Mapping[str, str],
    ) -> AsyncIterator[None]:
        """One command's own proxy for run ``run_id``, whoever asked for it (a tool's
        call, or an operator's exec on the control socket): ``tags`` name them in
        every audit entry of its connections."""
        from gatewayd.egress import EgressProxy, serve_egress  # loaded: see start_services

        proxy = EgressProxy(
            run_id=run_id,
            network=network,
            audit=self._audit,
            resolve=self._resolve,
            reply_after_result=self._reply_after_result,
            tags=tags,
        )
        failed: Exception | None = None
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(
                    functools.partial(
                        serve_egress,
                        socket,
                        proxy,
                        group=sandbox.user.gid,
                        owns_peer=functools.partial(_in_call_sandbox, sandbox),
                    )
                )
                try:
                    yield
                except Exception as exc:
                    # The call's own error, raised as it is below rather than in the
                    # nursery's exception group: the runner's errors map to their codes.
                    failed = exc
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with contextlib.suppress(FileNotFoundError):
                socket.unlink()
        if failed is not None:
            raise failed


def _in_call_sandbox(sandbox: RunSandbox, pid: int) -> bool:
    """Is ``pid`` one of the run sandbox's processes (its uid) outside the run's own
    network namespace (a call's sandbox, with a namespace of its own)? The socket is
    seen by nothing else of the run: only that call's sandbox has it bound."""
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return False  # gone already, or not visible: not ours to serve
    return owner == sandbox.user.uid and not sandbox.owns_peer(pid)
