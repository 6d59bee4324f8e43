"""A run's in-sandbox services: ``cogni-tool serve`` inside the sandbox (the OpenAI
endpoint for model.chat, the egress bridge) and, on the host, the run's egress proxy
socket it forwards to.

Both live in the nursery that serves the run's socket: when the run ends they stop, and a
service that dies on its own is audited (``services_exited``), once.
"""

from __future__ import annotations

import functools
from collections.abc import Container, Mapping

import structlog
import trio

from gatewayd.apps.manifest import TOOL_NAME_PREFIX
from gatewayd.audit import AuditEvent, AuditLog
from gatewayd.dialer import Resolver
from gatewayd.egress import EgressProxy, serve_egress
from gatewayd.policy import RunRules, tool_allowed
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
from gatewayd.sandbox.session import SandboxUnavailable

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
