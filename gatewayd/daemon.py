"""The composition root: :func:`open_daemon` opens this daemon's entry in the host's
registry of daemons, its audit log, the run registry, the metrics, the reviewer and the
rule book, the dispatcher, the run manager, the rule desk and (for `gatewayd serve`) the
control server, wires them together, and owns the nursery every run is served in.

Used by `gatewayd serve` (with the control socket), `gatewayd run` and
`gatewayd agent run` (one run, then exit). What each part does lives in its own module:
the run lifecycle in :mod:`gatewayd.runs`, the chokepoint in :mod:`gatewayd.dispatch`,
the rule desk in :mod:`gatewayd.review.ruledesk`, the control API in
:mod:`gatewayd.control`.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import structlog
import trio

from gatewayd import libraries
from gatewayd.agent.workdir import sweep_leftovers
from gatewayd.approvals import Approvals
from gatewayd.apps.admintools import APP_RULES_TOOL, INSTALL_APP_TOOL
from gatewayd.apps.invoke import Apps
from gatewayd.apps.ruledesk import AppRuleDesk
from gatewayd.audit import AuditEvent, AuditLog, open_audit_log
from gatewayd.audit.checkpointer import Checkpointer, load_checkpoint_key
from gatewayd.audit.note import Signer
from gatewayd.config import GatewaydConfig
from gatewayd.dialer import Resolver, resolve_host
from gatewayd.dispatch import Dispatcher
from gatewayd.mcp.approval import Approval
from gatewayd.mcp.pins import PinStore
from gatewayd.mcp.servers import McpServers
from gatewayd.mcp.tools import McpTools
from gatewayd.metrics import METRICS, GatewayMetrics
from gatewayd.policy import tool_allowed
from gatewayd.policyfile import PolicyLoader
from gatewayd.review.reviewer import Reviewer
from gatewayd.review.rulebook import RuleBook
from gatewayd.review.ruledesk import RuleDesk
from gatewayd.runners.folders import (
    NO_TOOL_FOLDERS,
    ToolFolders,
    load_tool_dirs,
    manifest_defaults,
)
from gatewayd.runners.manifest import MIB, Problem
from gatewayd.runners.spec import FolderTool
from gatewayd.runners.tools import ToolUnavailable, folder_tool
from gatewayd.runs import Run, RunRegistry
from gatewayd.runs.lifecycle import RunManager
from gatewayd.runs.services import CallEgressProxies
from gatewayd.runs.startup import prepare_host, raise_open_file_limit
from gatewayd.sandbox.daemons import DaemonShare, Registration, register_daemon
from gatewayd.sandbox.uids import UidPool
from gatewayd.secrets import Scrubber
from gatewayd.tools import builtin_tools
from gatewayd.tools.manifest import RunnerKind
from gatewayd.tools.registry import CallEgress, DuplicateToolError, ToolRegistry
from gatewayd.tracing import Tracer, open_tracer
from gatewayd.workspace.store import EXPIRY_INTERVAL_S, WorkspaceStore, audit_recorder

if TYPE_CHECKING:
    # What only some daemons use is imported where it is used: the control server and
    # the metrics server (`gatewayd serve`), the witnesses' client, the Temporal
    # submission, and wasmtime, through the engine of a daemon with a wasm tool.
    from gatewayd.control import ControlServer
    from gatewayd.runners.wasm import WasmEngine
    from gatewayd.scaleout.submission import TemporalTarget

log = structlog.get_logger("gatewayd.daemon")
# A refusal names the log and the command that shows the divergence: a few hundred
# characters; an audit entry is no place for more.
MAX_CHECKPOINT_REASON_CHARS: Final = 1000
# What a run reaches the network with, http.fetch and its egress proxy (one of a process
# tool's call too), loads at its first use: the HTTP libraries and the proxy itself.
NETWORK_LIBRARIES: Final = (*libraries.HTTP, "gatewayd.egress")
# The tools that load a library at their first call, by name: http.fetch (the HTTP
# libraries and its pinned connection backend; the egress proxy is a run's network's,
# NETWORK_LIBRARIES), and the app tools, which read an app's manifest.
TOOL_LIBRARIES: Final = {
    "http.fetch": (*libraries.HTTP, "gatewayd.pinned_backend"),
    APP_RULES_TOOL: libraries.MARKDOWN,
    INSTALL_APP_TOOL: libraries.MARKDOWN,
}


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Daemon:
    """One running gatewayd's parts, as :func:`open_daemon` wired them; it holds them and
    does nothing of its own (:func:`open_daemon` closes them)."""

    audit: AuditLog
    registry: RunRegistry
    metrics: GatewayMetrics
    reviewer: Reviewer
    # The review rules every reviewed call reads; the rule desk changes them.
    rules: RuleBook
    dispatcher: Dispatcher
    runs: RunManager
    rule_desk: RuleDesk
    # The apps' rules: changed by the app_rules tool and the operator, on confirmation.
    app_rule_desk: AppRuleDesk
    # The control socket this daemon serves (None: none).
    control_socket: Path | None
    # The declared MCP servers' instances, and their pinned tools as the runs' tools.
    mcp_servers: McpServers
    mcp_tools: McpTools
    # The tool folders' tools registered at start (in the dispatcher's registry), the
    # folders skipped and why, and the wasm engine of their wasm tools (None: none).
    tool_folders: ToolFolders = NO_TOOL_FOLDERS
    # Every run's workspace session, kept after the run until committed or discarded.
    workspaces: WorkspaceStore
    # Calls waiting for the operator's approval (answered on the control socket).
    approvals: Approvals | None = None
    wasm: WasmEngine | None = None
    # Signs the audit tree's checkpoints (None: no key configured, or the tree is off);
    # its on_checkpoint hooks are told of each one.
    checkpointer: Checkpointer | None = None

    @property
    def config(self) -> GatewaydConfig:
        """The configuration in force: the run manager's (a reload changes its models)."""
        return self.runs.config


@asynccontextmanager
async def open_daemon(
    config: GatewaydConfig,
    *,
    preload: bool,
    control_socket: Path | None = None,
    control_listener: socket.socket | None = None,
    tools: ToolRegistry | None = None,
    resolver: Resolver | None = None,
) -> AsyncIterator[Daemon]:
    """A running daemon; on exit the control server stops, every run is ended and the
    audit log closed.

    Error handling: DaemonClash (gatewayd.sandbox.daemons) when another live daemon on
    this host has this one's state directory, namespace prefix, sandbox uids, a file of
    its audit log or its control socket, and
    DaemonRegistryError when the host's registry of daemons cannot be used; raised
    before anything is opened or swept. ControlSocketInUse (gatewayd.control) when
    something else holds ``control_socket``.

    ``control_socket``: the control socket this daemon serves (``gatewayd serve``; None,
    the default: none), registered so that no second daemon binds it or a file of this
    one's audit log, and never lent to a run. ``control_listener``: the listening socket
    at ``control_socket`` systemd passed (socket activation, gatewayd.sdlisten), served
    instead of binding the path, which then stays at stop. ``tools`` replaces the
    built-in tool registry (tests add deliberately slow or failing tools to reach the
    timeout and internal paths). ``resolver``: how http.fetch and the egress proxy
    resolve names (tests map names to loopback); None: the host's resolver.
    ``preload`` (no default: each caller chooses): True for a daemon that serves calls
    (`gatewayd serve`, `gatewayd agent run`, the worker): load the libraries its tools
    and runs may need (gatewayd.libraries) in a worker thread beside the start, and wait
    for them before any run can start, so no call imports one on the event loop, and
    import the model client (litellm) in one when models are configured. False for a
    one-shot command (`gatewayd run`, `gatewayd tools run`, a client command answered
    in this process): nothing is loaded at the start; the caller loads what its run can
    reach with :func:`load_for_run` before the run's first call, and the model client is
    imported in a worker thread by the first call or review that needs it.
    """
    raise_open_file_limit()
    config = config.with_real_dirs()
    # The MCP servers' secrets too: handed to their servers, never to be seen in a result.
    scrubber = Scrubber.for_config(config.models, config.scrubbed_secret_env)
    # The tool folders' tools join the built-in ones (or those a test gives).
    registry_of_tools = builtin_tools() if tools is None else tools
    # Before the log is opened: a key that cannot be used (inside the audit directory,
    # readable by others) stops the start with the reason (CheckpointKeyError).
    checkpoint_key = load_checkpoint_key(config.audit_checkpoint_key, config.resolved_audit_path)
    async with (
        _registered(config.host_share(control_socket=control_socket)),
        # Left last: every run's span has ended when what is queued is exported.
        _tracing(config) as tracer,
        open_audit_log(
            config.resolved_audit_path,
            fsync=config.audit_fsync,
            scrubber=scrubber,
            max_bytes=config.audit_max_bytes,
        ) as audit,
        trio.open_nursery() as nursery,
        _folder_tools(
            config,
            registry_of_tools,
            # A process tool call granted network domains (and a sandbox.exec narrowed
            # to some) gets an egress proxy of its own, narrowed to them, audited like
            # the run's.
            call_egress := CallEgressProxies(
                audit=audit,
                resolve=resolver or resolve_host,
                reply_after_result=config.audit_reply_after_result,
            ),
        ) as (folders, wasm),
    ):
        libraries_loaded = trio.Event()
        if preload:
            nursery.start_soon(_load_libraries, _libraries_of(config), libraries_loaded)
        else:
            libraries_loaded.set()
        policies = PolicyLoader(config.policy_dirs)
        registry = RunRegistry(config.state_dir, policy_loader=policies)
        metrics = METRICS  # process-wide: see gatewayd/metrics.py
        metrics.count_runs_with(lambda: len(registry.all()))
        first_seq = audit.last_seq  # gatewayd_audit_entries_total counts from here
        metrics.audit_entries.function = lambda: audit.last_seq - first_seq
        checkpointer = await _start_checkpointer(config, audit, checkpoint_key, nursery)
        _start_witnesses(config, audit, checkpointer, nursery)
        reviewer = Reviewer(config.models, metrics=metrics)
        rules = RuleBook()
        # Only a daemon with a control socket has someone to ask; calls a dead daemon
        # left waiting are denied before any run starts.
        approvals = Approvals(audit, config.state_dir, answerable=control_socket is not None)
        await approvals.recover()
        dispatcher = Dispatcher(
            audit,
            registry_of_tools,
            reviewer=reviewer,
            rules=rules,
            metrics=metrics,
            models=config.models,
            scrubber=scrubber,
            resolve=resolver,
            reply_after_result=config.audit_reply_after_result,
            call_egress=call_egress,
            approvals=approvals,
        )
        uid_pool = UidPool(config.resolved_sandbox_uids)
        metrics.count_uids_with(lambda: uid_pool.in_use)
        if config.models and preload:
            # litellm takes seconds to import: a serving daemon pays it now, beside the
            # start, not in the first review's time budget. A one-shot one does not (its
            # run may ask no model, and its exit would wait for the import): the reviewer
            # and model_client.complete import it in a worker thread at the first use.
            nursery.start_soon(_preload_models)
        host = await prepare_host(
            config,
            runs_dir=registry.runs_dir,
            uid_pool=uid_pool,
            audit=audit,
            sweeps={"agentDirs": functools.partial(sweep_leftovers, config.resolved_agent_dir)},
        )
        # Sessions a crash left are finished or kept before any run starts; kept ones
        # past their time are discarded every minute.
        # In agent_dir, not the state directory: a run's sandbox binds its session's
        # view, and no bind source may lie in the state directory (sandbox/plan.py).
        workspaces = WorkspaceStore(config.resolved_agent_dir, record=audit_recorder(audit))
        for line in await trio.to_thread.run_sync(workspaces.recover):
            log.warning("workspace_recovered", what=line)
        nursery.start_soon(_expire_workspaces, workspaces)
        runs = RunManager(
            config,
            audit=audit,
            registry=registry,
            dispatcher=dispatcher,
            nursery=nursery,
            host=host,
            uid_pool=uid_pool,
            metrics=metrics,
            resolver=resolver,
            control_socket=control_socket,
            workspaces=workspaces,
        )
        # The app runner kind: each run's workspace's apps become tools of that run.
        app_rule_desk = AppRuleDesk(audit=audit)
        apps = Apps(runs=runs, dispatcher=dispatcher, rule_desk=app_rule_desk)
        # The MCP runner kind: each declared server in a sandbox of its own, its pinned
        # tools the tools of every run that starts after they were pinned.
        mcp_servers = McpServers(
            config.mcp_servers,
            runs=runs,
            nursery=nursery,
            scrubber=scrubber,
            shared_dir=config.state_dir / "mcp" / "shared",
        )
        mcp_tools = McpTools(
            mcp_servers,
            PinStore(config.state_dir),
            dispatcher=dispatcher,
            lookup_run=registry.get,
            audit=audit,
        )

        async def run_tools(run: Run) -> None:
            await apps.tools_for_run(run)
            await mcp_tools.tools_for_run(run)

        runs.run_tools = run_tools
        runs.run_ending = mcp_servers.end_run
        dispatcher.tracer = runs.tracer = tracer
        rule_desk = RuleDesk(rules, policies=policies, audit=audit)
        # No run starts (no control request, no caller's) before they are in.
        await libraries_loaded.wait()
        # The control server stops before the runs end: no request starts a run then.
        control = trio.CancelScope()
        control_stopped = trio.Event()
        try:
            if control_socket is not None:
                from gatewayd.control import ControlServer

                server = ControlServer(
                    runs=runs,
                    rules=rule_desk,
                    registry=registry,
                    metrics=metrics,
                    app_rules=app_rule_desk,
                    mcp=Approval(mcp_tools),
                    approvals=approvals,
                    workspaces=workspaces,
                )
                await nursery.start(
                    functools.partial(
                        _serve_control,
                        server,
                        control_socket,
                        control,
                        control_stopped,
                        passed=control_listener,
                        temporal=_temporal_target(config),
                    )
                )
            else:
                control_stopped.set()
            if control_socket is not None and config.metrics_listen is not None:
                # Beside the control socket, for `gatewayd serve` only: a one-run
                # `gatewayd run` would take a serving daemon's port. Started once the
                # control server has (a failure here stops that one the usual way).
                from gatewayd.metrics_server import parse_listen_address, serve_metrics

                await nursery.start(
                    serve_metrics, parse_listen_address(config.metrics_listen), metrics
                )
            yield Daemon(
                audit=audit,
                registry=registry,
                metrics=metrics,
                reviewer=reviewer,
                rules=rules,
                dispatcher=dispatcher,
                runs=runs,
                rule_desk=rule_desk,
                app_rule_desk=app_rule_desk,
                control_socket=control_socket,
                mcp_servers=mcp_servers,
                mcp_tools=mcp_tools,
                tool_folders=folders,
                wasm=wasm,
                approvals=approvals,
                workspaces=workspaces,
                checkpointer=checkpointer,
            )
        finally:
            with trio.CancelScope(shield=True):
                control.cancel()
                await control_stopped.wait()
                # No server instance starts once the runs are ending; then the runs end.
                await mcp_servers.aclose()
                await runs.end_all()
            nursery.cancel_scope.cancel()


def _libraries_of(config: GatewaydConfig) -> tuple[str, ...]:
    """What a daemon's tools and runs may load (gatewayd.libraries): the network's
    (http.fetch is a built-in of every daemon), markdown-it (a workspace's apps, the app
    tools), the schemas' library when MCP servers or tool folders are configured, and
    the MCP client with its SDK when MCP servers are (a server starts at its first call,
    on the event loop; a wasm tool's engine is loaded where it is made, in
    :func:`_folder_tools`)."""
    names = [*NETWORK_LIBRARIES, *libraries.MARKDOWN]
    if config.mcp_servers or config.tool_dirs:
        names += libraries.JSON_SCHEMA
    if config.mcp_servers:
        names += libraries.MCP
    return tuple(names)


async def _load_libraries(names: tuple[str, ...], done: trio.Event) -> None:
    await libraries.load_off_loop(names)
    done.set()


async def load_for_run(run: Run) -> None:
    """Load, off the event loop, the libraries of what ``run`` can reach (for a daemon
    opened with ``preload=False``; a no-op for what is loaded): the network's when its
    policy lets it reach a host (its egress proxy, a process tool's call), the HTTP
    libraries when it allows http.fetch, markdown-it when it allows an app tool. Call it
    before the run's first call (`gatewayd run`: before its command starts;
    `gatewayd tools run`: before its one call). What a run's apps and tool folders need
    is loaded when they are read, at the daemon's or the run's start; an MCP server's
    client where the server first starts.
    """
    names: list[str] = []
    if run.spec.policy.network.reachable_domains:
        names += NETWORK_LIBRARIES
    for tool, needed in TOOL_LIBRARIES.items():
        if tool_allowed(tool, run.spec.rules):
            names += needed
    await libraries.load_off_loop(names)


async def _start_checkpointer(
    config: GatewaydConfig, audit: AuditLog, key: Signer | None, nursery: trio.Nursery
) -> Checkpointer | None:
    """Start signing the audit tree's checkpoints (the first one before this returns),
    or say in the daemon log why there are none."""
    if audit.tree is None:
        log.error("audit_tree_off", reason=audit.tree_failure or "disabled")
        return None
    if key is None:
        log.info(
            "audit_checkpoints_off",
            reason="no audit_checkpoint_key and no credential audit-checkpoint-key",
        )
        return None
    checkpointer = Checkpointer(audit, key, fsync=config.audit_fsync)

    def report(message: str) -> None:
        # Once per distinct reason (the checkpointer's own rule): the entry this writes
        # makes the next attempt, which fails for the same reason and is not reported.
        log.error("audit_checkpoint_failed", reason=message)
        if not audit.failed:
            audit.record(
                "event",
                event=AuditEvent.AUDIT_CHECKPOINT_FAILED,
                detail={"reason": message[:MAX_CHECKPOINT_REASON_CHARS]},
            )

    await nursery.start(checkpointer.run, report)
    return checkpointer


def _start_witnesses(
    config: GatewaydConfig,
    audit: AuditLog,
    checkpointer: Checkpointer | None,
    nursery: trio.Nursery,
) -> None:
    """Send every checkpoint to the configured witnesses (a task of its own: never in
    a call's way), starting with the latest one, signed before the hook was attached."""
    if not config.audit_witnesses:
        return
    if checkpointer is None:
        log.error("audit_witnesses_off", reason="no checkpoints are signed, so none is witnessed")
        return
    # The witness client (and its HTTP library): loaded only by a daemon that has one.
    from gatewayd.audit.cosignature import CosignatureVerifier
    from gatewayd.audit.witnessing import WitnessClient, WitnessEndpoint

    client = WitnessClient(
        [
            WitnessEndpoint(w.name, w.url, CosignatureVerifier.from_string(w.verifier_key))
            for w in config.audit_witnesses
        ],
        log_path=audit.path,
        prove=checkpointer.consistency_proof,
        audit=audit,
    )
    checkpointer.on_checkpoint.append(client.on_checkpoint)
    if checkpointer.latest is not None:
        client.on_checkpoint(checkpointer.latest.note, checkpointer.latest.checkpoint)
    nursery.start_soon(client.run)


@asynccontextmanager
async def _folder_tools(
    config: GatewaydConfig, registry: ToolRegistry, call_egress: CallEgress
) -> AsyncIterator[tuple[ToolFolders, WasmEngine | None]]:
    """Read the configured tool directories and register each valid tool in
    ``registry``; a folder that is invalid, whose name is taken, or that this gatewayd
    cannot run is logged and skipped (the daemon starts without it). Yields the tools
    registered with the problems, and the wasm engine (made when a wasm tool is
    there), which is closed on exit: after the runs have ended, so no call runs."""
    if not config.tool_dirs:
        yield NO_TOOL_FOLDERS, None
        return
    folders = await trio.to_thread.run_sync(
        functools.partial(
            load_tool_dirs,
            config.tool_dirs,
            defaults=manifest_defaults(config),
            taken=frozenset(registry),
        )
    )
    # Their schemas' library, and a wasm tool's engine, in a worker thread: each tool's
    # validator (and runner) is made below, on the event loop.
    has_wasm = any(tool.runner is RunnerKind.WASM for tool in folders.tools)
    await libraries.load_off_loop(
        (*libraries.JSON_SCHEMA, *libraries.WASM, "gatewayd.runners.wasm")
        if has_wasm
        else libraries.JSON_SCHEMA
    )
    wasm = None
    if has_wasm:
        from gatewayd.runners.wasm import WasmEngine

        wasm = WasmEngine(
            config.resolved_tool_cache_dir, default_memory_bytes=config.tool_memory_mb * MIB
        )
    try:
        yield (
            _register(
                folders, registry, wasm, process_ok=config.os_sandbox, call_egress=call_egress
            ),
            wasm,
        )
    finally:
        if wasm is not None:
            wasm.close()


def _register(
    folders: ToolFolders,
    registry: ToolRegistry,
    wasm: WasmEngine | None,
    *,
    process_ok: bool,
    call_egress: CallEgress,
) -> ToolFolders:
    """Each of ``folders``' tools in ``registry``; what could not be, logged with the
    folders' own problems."""
    registered: list[FolderTool] = []
    problems = list(folders.problems)
    for tool in folders.tools:
        try:
            registry.register(
                folder_tool(tool, wasm=wasm, process_ok=process_ok, call_egress=call_egress)
            )
        except (ToolUnavailable, DuplicateToolError) as exc:
            problems.append(Problem(tool.manifest_path, "", str(exc)))
            continue
        registered.append(tool)
    for problem in problems:
        log.warning(
            "tool_folder_skipped", file=problem.file, field=problem.field, reason=problem.reason
        )
    log.info("tool_folders_loaded", tools=[tool.name for tool in registered])
    return ToolFolders(tuple(registered), tuple(problems))


async def _serve_control(
    server: ControlServer,
    path: Path,
    scope: trio.CancelScope,
    stopped: trio.Event,
    *,
    passed: socket.socket | None = None,
    temporal: TemporalTarget | None = None,
    task_status: trio.TaskStatus[None],
) -> None:
    """The control server at ``path`` until ``scope`` is cancelled; ``stopped`` is set
    once it has stopped (its socket removed), whether it started or not. ``temporal``:
    where its agent-run routes submit (None: they answer 404); the connection's thread
    lives as long as the server."""
    try:
        with scope:
            if temporal is None:
                await server.serve(path, passed=passed, task_status=task_status)
                return
            # The Temporal SDK is imported only by a daemon configured to use it.
            from gatewayd.scaleout.client import open_agent_runs

            async with open_agent_runs(temporal) as agent_runs:
                server.agent_runs = agent_runs
                await server.serve(path, passed=passed, task_status=task_status)
    finally:
        stopped.set()


def _temporal_target(config: GatewaydConfig) -> TemporalTarget | None:
    if config.temporal_address is None:
        return None
    from gatewayd.scaleout.submission import TemporalTarget

    return TemporalTarget(
        address=config.temporal_address,
        namespace=config.temporal_namespace,
        task_queue=config.temporal_task_queue,
    )


async def _expire_workspaces(workspaces: WorkspaceStore) -> None:
    """Discard kept workspace sessions past their keep time, every minute, for as long
    as the daemon runs (each one audited as ``workspace_expired``)."""
    while True:
        await trio.sleep(EXPIRY_INTERVAL_S)
        try:
            expired = await trio.to_thread.run_sync(workspaces.expire)
        except Exception:
            # The audit log failing, most likely: tried again next round, never the
            # daemon's end (the store skips and logs a session it cannot discard).
            log.exception("workspace_expiry_failed")
            continue
        for run_id in expired:
            log.info("workspace_expired", run_id=run_id)


def _load_model_client() -> None:
    """litellm and gatewayd's model client, imported in this (worker) thread."""
    from gatewayd import model_client

    model_client.preload()


async def _preload_models() -> None:
    try:
        await trio.to_thread.run_sync(_load_model_client)
    except Exception:  # the first call will say what is wrong
        log.exception("model_client_preload_failed")


@asynccontextmanager
async def _tracing(config: GatewaydConfig) -> AsyncIterator[Tracer | None]:
    """The tracer of this daemon's runs and calls (None: no collector configured, and
    nothing of OpenTelemetry loaded); at the end, what is queued is exported, in a
    worker thread (the SDK blocks up to its export timeout, OTEL_EXPORTER_OTLP_TIMEOUT).

    Error handling: TracingError (gatewayd.tracing) for an endpoint in the environment
    that is not an http(s) URL, raised before the audit log is opened or anything swept."""
    tracer = open_tracer(config.otel_endpoint, os.environ)
    try:
        yield tracer
    finally:
        if tracer is not None:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(tracer.shutdown)


@asynccontextmanager
async def _registered(share: DaemonShare) -> AsyncIterator[Registration]:
    """This daemon's entry in the host's registry of daemons, held for its whole life.
    Taken before the audit log is opened or anything swept: a daemon that would clash
    with a live one (DaemonClash) is refused having touched nothing."""
    registration = await trio.to_thread.run_sync(register_daemon, share)
    try:
        if registration.stale:
            log.warning(
                "dead_daemons_unregistered", daemons=[s.to_json() for s in registration.stale]
            )
        yield registration
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(registration.release)
