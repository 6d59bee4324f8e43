"""The daemon: one audit log, one run registry, one dispatcher, and a nursery that owns
every run's listener. Used by `gatewayd serve` (with the control socket) and by
`gatewayd run` (one run, then exit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import resource
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import structlog
import trio

from gatewayd import model_client
from gatewayd.audit import AuditEvent, AuditLog, AuditWriteError, open_audit_log
from gatewayd.config import GatewaydConfig
from gatewayd.dialer import Resolver, resolve_host
from gatewayd.dispatch import Dispatcher
from gatewayd.egress import EgressProxy, serve_egress
from gatewayd.errors import GatewayError, PolicyViolation
from gatewayd.metrics import METRICS
from gatewayd.policy import Policy, PolicyError, SandboxSection, tool_allowed
from gatewayd.policy.paths import PathMode
from gatewayd.policy.rate import TokenBucket
from gatewayd.protocol import ErrorCode
from gatewayd.review.reviewer import Reviewer
from gatewayd.review.rulebook import (
    Applied,
    Pending,
    Planned,
    RuleAction,
    RuleBook,
    RuleChange,
    RuleChangeError,
)
from gatewayd.runs import PolicyLoader, Run, RunRegistry, RunRequest, RunState
from gatewayd.sandbox.cgroup import probe_cgroups, remove_empty_leftovers
from gatewayd.sandbox.daemons import (
    DaemonShare,
    Registration,
    register_daemon,
)
from gatewayd.sandbox.launch import Echo, ExecResult, ResultForm, exec_result_json
from gatewayd.sandbox.lendable import (
    LendableRoots,
)
from gatewayd.sandbox.limits import HostUser
from gatewayd.sandbox.plan import (
    COGNI_TOOL_VISIBLE_DIR,
    EGRESS_PROXY_PORT,
    EGRESS_SOCKET_NAME,
    MODEL_ENDPOINT_PORT,
    SANDBOX_EGRESS_SOCKET,
    Services,
    probe_host_layout,
)
from gatewayd.sandbox.session import (
    CommandLimits,
    RunSandbox,
    SandboxSettings,
    SandboxUnavailable,
    clean_leftovers,
    install_cogni_tool,
)
from gatewayd.sandbox.support import SandboxSupport, probe_os_sandbox
from gatewayd.sandbox.uids import UidPool
from gatewayd.secrets import Scrubber
from gatewayd.server import serve_run
from gatewayd.tools import builtin_tools
from gatewayd.tools.registry import ToolRegistry

log = structlog.get_logger("gatewayd.daemon")

# cogni-tool serve: how long its start may take (a cold python3 and two listeners), and
# how long it outlives the run's maximum runtime (the run's end stops it first anyway).
SERVICE_READY_TIMEOUT_S = 10.0
SERVICE_GRACE_S = 60.0
# How much of its stderr gatewayd's log takes, per run (the rest is dropped, said once).
SERVICE_STDERR_LOG_BYTES = 16 * 1024
SANDBOX_COGNI_TOOL = f"{COGNI_TOOL_VISIBLE_DIR}/cogni-tool"


class Daemon:
    """Creates, serves and ends runs. Every run's listener lives in ``self._nursery``."""

    def __init__(
        self,
        config: GatewaydConfig,
        audit: AuditLog,
        nursery: trio.Nursery,
        *,
        tools: ToolRegistry | None = None,
        scrubber: Scrubber | None = None,
        resolver: Resolver | None = None,
        control_socket: Path | None = None,
    ) -> None:
        self.config = config
        # How http.fetch and the egress proxy resolve names (None: the host's resolver).
        self._resolver = resolver
        # The control socket this daemon serves (None: none), never lent to a run.
        self.control_socket = control_socket
        self.audit = audit
        self.registry = RunRegistry(
            config.state_dir, policy_loader=PolicyLoader(config.policy_dirs)
        )
        # Sandboxes are made one at a time: the check that no live run holds a workspace
        # and the lease that then takes it must not interleave with another start.
        self._isolating = trio.Lock()
        # Trees of runs whose give-back failed: still (partly) a sandbox uid's, so no
        # other run may take them until the next start returns them.
        self._stuck_trees: list[Path] = []
        self.metrics = METRICS  # process-wide: see gatewayd/metrics.py
        self.metrics.runs_active.function = lambda: len(self.registry.all())
        first_seq = audit.last_seq  # gatewayd_audit_entries_total counts from here
        self.metrics.audit_entries.function = lambda: audit.last_seq - first_seq
        self.reviewer = Reviewer(config.models, metrics=self.metrics)
        self.rules = RuleBook()
        self.dispatcher = Dispatcher(
            audit,
            builtin_tools() if tools is None else tools,
            reviewer=self.reviewer,
            rules=self.rules,
            metrics=self.metrics,
            models=config.models,
            scrubber=scrubber or Scrubber.for_config(config.models, config.secret_env),
            resolve=resolver,
            reply_after_result=config.audit_reply_after_result,
        )
        self._nursery = nursery
        self.uid_pool = UidPool(config.resolved_sandbox_uids)
        self.support = SandboxSupport(False, "not probed yet")
        self.sandbox_settings: SandboxSettings | None = None

    async def prepare_sandbox(self) -> None:
        """At start: remove what a crashed daemon left, probe the OS sandbox, install the
        client copy. Audited; a host without the sandbox is logged loudly, not fatal
        (runs whose policy requires it are refused, with the reason)."""
        config = self.config
        leftovers = await trio.to_thread.run_sync(
            _clean_leftovers_quietly,
            self.registry.runs_dir,
            config.resolved_netns_prefix if config.os_sandbox else None,
        )
        agent_dirs = await trio.to_thread.run_sync(_remove_agent_leftovers, config)
        if agent_dirs:
            leftovers["agentDirs"] = agent_dirs
        if any(leftovers.values()):
            log.warning("leftovers_removed", **leftovers)
            await self.audit.append("event", event=AuditEvent.LEFTOVERS_REMOVED, detail=leftovers)
        if not config.os_sandbox:
            self.support = SandboxSupport(
                False,
                "the OS sandbox is turned off in gatewayd's configuration (os_sandbox: false, "
                "from --no-os-sandbox, GATEWAYD_OS_SANDBOX or the configuration file)",
            )
        else:
            probe_user = self.uid_pool.acquire()
            try:
                self.support = await trio.to_thread.run_sync(
                    probe_os_sandbox, config.bwrap, probe_user, config.resolved_netns_prefix
                )
            finally:
                self.uid_pool.release(probe_user)
            if self.support.available:
                self.support = _state_dir_reachable(config.state_dir)
        detail: dict[str, Any] = {
            "available": self.support.available,
            "reason": self.support.reason,
        }
        if self.support.available:
            cgroups = await trio.to_thread.run_sync(probe_cgroups)
            if not cgroups.available:
                log.warning("cgroups_unavailable", reason=cgroups.reason, fallback="rlimits")
            else:
                swept = await trio.to_thread.run_sync(
                    remove_empty_leftovers, cgroups, leftovers.get("runDirs", [])
                )
                if swept:
                    log.warning("leftover_cgroups_removed", cgroups=swept)
                    detail["leftoverCgroups"] = swept
            detail["cgroups"] = cgroups.available
            detail["cgroupsReason"] = cgroups.reason or None
            self.sandbox_settings = SandboxSettings(
                bwrap=config.bwrap,
                netns_prefix=config.resolved_netns_prefix,
                state_dir=config.state_dir,
                cogni_tool_dir=install_cogni_tool(config.state_dir),
                layout=probe_host_layout(),
                cgroups=cgroups if cgroups.available else None,
            )
        else:
            log.warning("os_sandbox_unavailable", reason=self.support.reason)
        await self.audit.append("event", event=AuditEvent.SANDBOX_SUPPORT, detail=detail)

    async def start_run(
        self,
        request: RunRequest,
        *,
        sandbox_user: HostUser | None = None,
        lend_workspace: bool = True,
        policy_paths: bool = False,
        own_root: Path | None = None,
    ) -> Run:
        """Create a run and start serving its socket. Refusals are audited, then raised.
        ``sandbox_user`` and ``lend_workspace``: see :meth:`RunSandbox.open` (an agent
        run's overlay workspace is made the run uid's before the run starts).
        ``own_root``: a directory gatewayd made for this run alone (an agent run's work
        directory), beneath which its trees may lie besides the lendable roots.
        ``policy_paths``: the request may name its policy by a file's path (gatewayd's own
        command line); otherwise only by name, from the configured policy directories.

        Error handling: AuthzDenied (no sandbox grant), PolicyError (bad policy),
        ValueError (bad workspace), NotLendable (a workspace or rw path under no lendable
        root), OSError (gatewayd could not make the run's files); each is recorded as a
        ``run_refused`` event with the matching code.
        """
        roots = LendableRoots(
            configured=self.config.lendable_roots,
            own=(own_root,) if own_root else (),
            reserved=self.config.own_directories(control_socket=self.control_socket),
        )
        try:
            run = self.registry.create(request, policy_paths=policy_paths)
            structlog.contextvars.bind_contextvars(run_id=run.run_id)  # this task's lines
            try:
                # Every run, sandboxed or degraded (whose host-side tools write as
                # gatewayd), before anything of it is touched.
                _require_lendable(run, roots)
                await self._isolate(run, roots, sandbox_user, lend_workspace)
            except BaseException:
                self.registry.remove(run)
                raise
        except Exception as exc:
            self.metrics.runs_refused.inc((str(_refusal_code(exc)),))
            await self.audit.append(
                "event",
                event=AuditEvent.RUN_REFUSED,
                errorCode=str(_refusal_code(exc)),
                safeMessage=str(exc),
                detail={
                    "actorId": request.actorId,
                    "tenantId": request.tenantId,
                    "policy": request.policy,
                    "workspacePath": request.workspacePath,
                    "allowSandbox": request.grant.allowSandbox,
                },
            )
            raise
        await self.audit.append(
            "event",
            event=AuditEvent.RUN_CREATED,
            runId=run.run_id,
            detail={
                "actorId": request.actorId,
                "tenantId": request.tenantId,
                "policy": run.spec.policy.name,
                "policySource": run.spec.policy_source,
                "workspace": str(run.spec.workspace),
                "toolIds": list(request.toolIds) if request.toolIds is not None else None,
                "sandbox": _sandbox_detail(run),
            },
        )
        try:
            await self._nursery.start(self._serve, run)
        except BaseException:
            # _serve's own cleanup (_finish) has ended the run already, sandbox and all.
            if run.state is not RunState.ENDED:
                run.move_to(RunState.FAILED)
                self.registry.remove(run)
            raise
        self.metrics.runs_started.inc()
        log.info("run_started", run_id=run.run_id, policy=run.spec.policy.name)
        return run

    async def _isolate(
        self,
        run: Run,
        roots: LendableRoots,
        user: HostUser | None = None,
        lend_workspace: bool = True,
    ) -> None:
        """Give the run its OS sandbox, or make it degraded if its policy allows that.

        Error handling: PolicyViolation when the policy requires a sandbox this host
        cannot give; SandboxUnavailable when making it failed.
        """
        policy = run.spec.policy
        held = sorted(set(policy.env.allow) & self._secret_env_names())
        if held:
            raise PolicyViolation(
                f"policy {policy.name!r} passes {held[0]} into the sandbox (env.allow), and "
                "gatewayd holds a secret in that variable (a model key or secret_env); secrets "
                "never enter "
                "a sandbox: remove it from env.allow (model.chat and the in-sandbox endpoint "
                "use the key on the host)"
            )
        if self.sandbox_settings is None:
            if policy.require_os_sandbox:
                raise PolicyViolation(
                    f"policy {policy.name!r} requires the OS sandbox (require_os_sandbox: "
                    f"true) and this gatewayd has none: {self.support.reason}. Fix the host, "
                    "or set require_os_sandbox: false in the policy to run without isolation"
                )
            run.degraded = f"no OS sandbox: {self.support.reason}"
            log.warning(
                "run_degraded_no_os_sandbox",
                run_id=run.run_id,
                reason=self.support.reason,
                note="the run's commands run WITHOUT isolation; every call is audited as degraded",
            )
            return
        limits = policy.sandbox
        image = run.spec.request.sandboxImage
        async with self._isolating:
            await self._open_sandbox(run, limits, image, user, lend_workspace, roots)

    async def _open_sandbox(
        self,
        run: Run,
        limits: SandboxSection,
        image: str | None,
        user: HostUser | None,
        lend_workspace: bool,
        roots: LendableRoots,
    ) -> None:
        assert self.sandbox_settings is not None
        busy = [*self._stuck_trees]
        busy += [
            tree for other in self.registry.all() if other.sandbox for tree in other.sandbox.trees
        ]
        run.sandbox = await RunSandbox.open(
            run_id=run.run_id,
            settings=self.sandbox_settings,
            pool=self.uid_pool,
            run_dir=run.directory,
            socket_path=run.socket_path,
            workspace=run.spec.workspace,
            grants=run.spec.grants,
            env_names=run.spec.policy.env.allow,
            limits=CommandLimits(
                timeout_s=limits.timeout_s,
                cpu_s=limits.cpu_s,
                memory_mb=run.spec.request.limits.maxMemoryMb,
                max_processes=limits.max_processes,
                max_file_mb=limits.max_file_mb,
                max_open_files=limits.max_open_files,
                max_output_bytes=limits.max_output_bytes,
                tmp_mb=limits.tmp_mb,
            ),
            image_dir=None if image is None else Path(image),
            busy_trees=busy,
            services=self._services_for(run),
            user=user,
            lend_workspace=lend_workspace,
            roots=roots,
        )

    def _secret_env_names(self) -> set[str]:
        """Variables whose values gatewayd holds as secrets (model keys, secret_env)."""
        return set(self.dispatcher.scrubber.names)

    def _services_for(self, run: Run) -> Services:
        """Which in-sandbox services the run gets: the OpenAI endpoint when it may call
        model.chat with at least one alias, the egress proxy when its policy turns the
        proxy on and allows at least one domain."""
        policy = run.spec.policy
        network = policy.network
        return Services(
            model_endpoint=bool(policy.model_access.models)
            and tool_allowed("model.chat", run.spec.rules)
            and "model.chat" in self.dispatcher.tools,
            egress_proxy=network.proxy_enabled,
        )

    # -- review rules (control socket only: no run socket reaches these) ---------------

    async def change_rule(
        self, policy_ref: str, action: RuleAction, text: str, added_by: str | None
    ) -> Applied | Pending:
        """Tighten at once, or park a loosening change for confirmation; audited, and
        the audit entry is durable before the change takes effect.

        Error handling: PolicyError for an unknown policy; RuleChangeError for a change
        that cannot be made (the message says why and what the rules are).
        """
        _, source = self.registry.load_policy_by_name(policy_ref)
        change = RuleChange(policy=source, action=action, text=text, added_by=added_by)
        outcome = self.rules.request(change)
        if isinstance(outcome, Pending):
            await self.audit.append(
                "event",
                event=AuditEvent.RULE_CHANGE_PENDING,
                detail={"confirmationId": outcome.confirmation_id, **outcome.change.describe()},
            )
            return outcome
        return await self._commit_rule(outcome, confirmation_id=None)

    async def confirm_rule(self, confirmation_id: str) -> Applied:
        """Apply a pending loosening change (the confirmation from outside the sandbox)."""
        change = self.rules.pending().get(confirmation_id)
        try:
            planned = self.rules.confirm(confirmation_id)
        except RuleChangeError as exc:
            if change is not None:  # it was pending: its end is on the record
                await self.audit.append(
                    "event",
                    event=AuditEvent.RULE_CHANGE_FAILED,
                    errorCode=str(ErrorCode.BAD_REQUEST),
                    safeMessage=str(exc),
                    detail={"confirmationId": confirmation_id, **change.describe()},
                )
            raise
        return await self._commit_rule(planned, confirmation_id=confirmation_id)

    async def _commit_rule(self, planned: Planned, *, confirmation_id: str | None) -> Applied:
        detail: dict[str, Any] = {
            **planned.change.describe(),
            "rulesetBefore": planned.before,
            "rulesetAfter": planned.after,
        }
        if confirmation_id is not None:
            detail["confirmationId"] = confirmation_id
        await self.audit.append("event", event=AuditEvent.RULE_CHANGED, detail=detail)
        try:
            applied = self.rules.commit(planned)
        except RuleChangeError as exc:
            await self.audit.append(
                "event",
                event=AuditEvent.RULE_CHANGE_FAILED,
                errorCode=str(ErrorCode.BAD_REQUEST),
                safeMessage=str(exc),
                detail=detail,
            )
            raise
        log.info("rule_changed", **planned.change.describe())
        return applied

    async def cancel_rule(self, confirmation_id: str) -> RuleChange:
        change = self.rules.cancel(confirmation_id)
        await self.audit.append(
            "event",
            event=AuditEvent.RULE_CHANGE_CANCELLED,
            detail={"confirmationId": confirmation_id, **change.describe()},
        )
        return change

    async def exec_in_run(
        self,
        run_id: str,
        command: list[str],
        *,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        echo: Echo | None = None,
    ) -> ExecResult:
        """Run ``command`` in the run's sandbox (host to sandbox); audited before it
        starts (durable before bwrap runs) and when it ends: the result (or the error)
        is returned only once ``exec_ended`` is durable, so whoever is told the exit code
        finds it in the log after a crash (unless the operator opted out:
        :meth:`durable_before_answer`).

        Error handling: LookupError for an unknown run; SandboxUnavailable for a run
        without a sandbox or one that is ending; PlanError/LaunchError if bwrap cannot
        start (also audited); AuditWriteError when ``exec_ended`` cannot be made durable
        (the command ran; its result must not be given).
        """
        run = self.registry.get(run_id)
        if run is None:
            raise LookupError(f"no run {run_id}")
        structlog.contextvars.bind_contextvars(run_id=run_id)  # this task's lines
        if run.sandbox is None:
            raise SandboxUnavailable(
                f"run {run_id} has no OS sandbox ({run.degraded}); commands run only inside "
                "a sandbox"
            )
        await self.audit.append(
            "event",
            event=AuditEvent.EXEC_STARTED,
            runId=run_id,
            detail={"command": command[:64], "timeoutS": timeout_s},
        )
        try:
            result = await run.sandbox.exec(command, stdin=stdin, timeout_s=timeout_s, echo=echo)
        except Exception as exc:
            seq = self.audit.record(
                "event",
                event=AuditEvent.EXEC_ENDED,
                runId=run_id,
                errorCode=str(ErrorCode.INTERNAL),
                safeMessage=str(exc),
            )
            await self.durable_before_answer(seq)
            raise
        seq = self.audit.record(
            "event",
            event=AuditEvent.EXEC_ENDED,
            runId=run_id,
            durationMs=result.durationMs,
            detail=exec_result_json(result, ResultForm.AUDIT),
        )
        await self.durable_before_answer(seq)
        return result

    async def durable_before_answer(self, seq: int) -> None:
        """Return once the entry ``seq`` (what an answer about to leave gatewayd reports:
        a command's end, its exit code) is durable, as every call's answer waits for its
        result entry (invariant RESULT_BEFORE_REPLY); at once when the operator opted out
        (``audit_reply_after_result: false``: the entry rides the next flush).

        Error handling: AuditWriteError when the log cannot take it; the answer must
        then not say what the entry would have."""
        if self.config.audit_reply_after_result:
            await self.audit.durable(seq)

    async def _serve(self, run: Run, *, task_status: trio.TaskStatus[None]) -> None:
        # Every line logged by this task and the tasks it starts (the run's connections,
        # calls, services, egress proxy) carries the run's id.
        structlog.contextvars.bind_contextvars(run_id=run.run_id)
        max_runtime = run.spec.request.limits.maxRuntimeSec
        try:
            with trio.move_on_after(max_runtime) as scope:
                try:
                    async with trio.open_nursery() as nursery:
                        await nursery.start(self._serve_socket, run, nursery.cancel_scope)
                        await self._start_services(run, nursery, max_runtime)
                        task_status.started()
                except BaseExceptionGroup as group:
                    # The services did not come up: the caller gets that error itself
                    # (the control socket answers it with its code and reason).
                    if len(group.exceptions) == 1 and isinstance(
                        group.exceptions[0], SandboxUnavailable
                    ):
                        raise group.exceptions[0] from None
                    raise
            if scope.cancelled_caught:
                run.end_reason = "max_runtime_exceeded"
                log.warning("run_max_runtime", run_id=run.run_id, seconds=max_runtime)
        finally:
            with trio.CancelScope(shield=True):
                await self._finish(run)

    async def _serve_socket(
        self,
        run: Run,
        services: trio.CancelScope,
        *,
        task_status: trio.TaskStatus[None],
    ) -> None:
        """The run's socket; when it stops (the run ends), so do the run's services."""
        try:
            await serve_run(
                run,
                self.dispatcher,
                max_frame_bytes=self.config.max_frame_bytes,
                task_status=task_status,
            )
        finally:
            services.cancel()

    async def _start_services(self, run: Run, nursery: trio.Nursery, lifetime_s: float) -> None:
        """Start the run's egress proxy socket and its ``cogni-tool serve``, and wait
        until that listens: the run's first command finds its endpoints up.

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
                audit=self.audit,
                resolve=self._resolver or resolve_host,
                reply_after_result=self.config.audit_reply_after_result,
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
            granted = [m for m in run.spec.policy.model_access.models if m in self.config.models]
            command += ["--openai-port", str(MODEL_ENDPOINT_PORT), "--models", ",".join(granted)]
        ready = trio.Event()
        lines = bytearray()

        def out(data: bytes) -> None:
            if len(lines) < 64:  # it says one word; anything more is not read
                lines.extend(data[:64])
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
                await self.audit.append(
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
        await self.audit.append(
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

    async def end_run(self, run_id: str, reason: str = "ended") -> dict[str, Any] | None:
        """Stop serving a run and remove its socket; returns its final summary."""
        run = self.registry.get(run_id)
        if run is None:
            return None
        run.end_reason = reason
        run.cancel_scope.cancel()
        await run.finished.wait()
        return run.summary()

    async def _finish(self, run: Run) -> None:
        if run.state in (RunState.CREATED, RunState.SERVING):
            run.move_to(RunState.ENDING)
        cleanup: dict[str, Any] = {}
        if run.sandbox is not None:
            try:
                cleanup = await run.sandbox.close()
            except Exception as exc:  # keep the lease record: the next start returns it
                log.exception("sandbox_cleanup_failed", run_id=run.run_id)
                cleanup = {"cleanupFailed": str(exc)}
                self._stuck_trees.extend(run.sandbox.trees)
            else:
                self.uid_pool.release(run.sandbox.user)
        if "cleanupFailed" not in cleanup:
            self.registry.remove(run)
        else:
            self.registry.forget(run)
        run.move_to(RunState.ENDED)  # from ENDING, or from FAILED
        try:
            await self.audit.append(
                "event",
                event=AuditEvent.RUN_ENDED,
                runId=run.run_id,
                detail={"reason": run.end_reason, **_counts(run), **cleanup},
            )
        except AuditWriteError:
            log.error("run_end_not_audited", run_id=run.run_id, reason=run.end_reason)
        finally:
            run.finished.set()
            self.metrics.runs_ended.inc((run.end_reason,))
            log.info("run_ended", run_id=run.run_id, reason=run.end_reason)

    # -- reload (SIGHUP) ------------------------------------------------------------------

    async def reload_policies(self) -> dict[str, str]:
        """Re-read every live run's policy file and apply what may change under a live
        run: the tool allowlist, limits, review, model access and the network allowlist.
        Returns run id -> outcome (``reloaded``, ``unchanged``, ``kept: why``); each
        change or refusal is audited.

        What the run's sandbox was built from (``filesystem``, ``sandbox``, ``env``,
        ``require_os_sandbox``, ``network.proxy``) is fixed for its life: a file that
        changes those is not applied to the live run (it applies to new runs), and the
        run keeps its whole old policy rather than half of the new one. A call in flight
        finishes under the policy it started with; the next call sees the new one.
        """
        outcomes: dict[str, str] = {}
        for run in self.registry.all():
            source = run.spec.policy_source
            try:
                policy, _ = self.registry.load_policy(source)
            except PolicyError as exc:
                outcomes[run.run_id] = f"kept: {exc}"
                await self._audit_reload(run, AuditEvent.POLICY_RELOAD_FAILED, str(exc))
                continue
            old = run.spec.policy
            if policy == old:
                outcomes[run.run_id] = "unchanged"
                continue
            fixed = [
                name
                for name, before, after in (
                    ("filesystem", old.filesystem, policy.filesystem),
                    ("sandbox", old.sandbox, policy.sandbox),
                    ("env", old.env, policy.env),
                    ("require_os_sandbox", old.require_os_sandbox, policy.require_os_sandbox),
                    ("network.proxy", old.network.proxy, policy.network.proxy),
                )
                if before != after
            ]
            if fixed:
                why = (
                    f"{', '.join(fixed)} changed; the run's sandbox was built from them, so "
                    "the new file applies to new runs and this run keeps its policy"
                )
                outcomes[run.run_id] = f"kept: {why}"
                await self._audit_reload(run, AuditEvent.POLICY_RELOAD_SKIPPED, why)
                continue
            changed = [
                name
                for name in type(old).model_fields
                if getattr(old, name) != getattr(policy, name)
            ]
            _apply_policy(run, policy)
            outcomes[run.run_id] = "reloaded"
            await self.audit.append(
                "event",
                event=AuditEvent.POLICY_RELOADED,
                runId=run.run_id,
                detail={"policy": policy.name, "source": source, "changed": changed},
            )
            log.info("policy_reloaded", run_id=run.run_id, changed=changed)
        return outcomes

    async def reload_config(self, config: GatewaydConfig) -> list[str]:
        """Apply a re-read configuration: model aliases take effect at once; settings the
        running daemon was built from are listed back as needing a restart (audited).

        The secrets to scrub are fixed at start (the audit writer holds them): an alias
        change that names another key variable, or a changed ``secret_env``, needs a
        restart too, and until then the aliases stay as they were.
        """
        current = self.config
        config = config.with_real_dirs()  # as the running daemon's own were made at start
        restart = current.needs_restart(config)
        keys_before = {a.api_key_env for a in current.models.values() if a.api_key_env}
        keys_after = {a.api_key_env for a in config.models.values() if a.api_key_env}
        models_changed = dict(current.models) != dict(config.models)
        if models_changed and keys_after - keys_before:
            restart.append("models (a new key variable must be scrubbed from the start)")
        elif models_changed:
            self.config = current.model_copy(update={"models": dict(config.models)})
            self.dispatcher.models = self.config.models
            self.reviewer.models = dict(self.config.models)
        await self.audit.append(
            "event",
            event=AuditEvent.CONFIG_RELOADED,
            detail={
                "modelsChanged": models_changed and not (keys_after - keys_before),
                "models": sorted(self.config.models),
                "restartNeeded": restart,
            },
        )
        if restart:
            log.warning("config_reload_needs_restart", settings=restart)
        return restart

    async def _audit_reload(self, run: Run, event: AuditEvent, why: str) -> None:
        log.warning(event.value, run_id=run.run_id, reason=why)
        await self.audit.append(
            "event",
            event=event,
            runId=run.run_id,
            safeMessage=why,
            detail={"policy": run.spec.policy.name, "source": run.spec.policy_source},
        )

    async def aclose(self) -> None:
        """End every run (used at shutdown)."""
        for run in self.registry.all():
            await self.end_run(run.run_id, reason="daemon_stopping")


async def _preload_models() -> None:
    try:
        await trio.to_thread.run_sync(model_client.preload)
    except Exception:  # the first call will say what is wrong
        log.exception("model_client_preload_failed")


def raise_open_file_limit() -> int:
    """Lift the soft descriptor limit to the hard one (systemd's default soft limit is 1024):
    every connection, run socket, pinned directory and sandbox pipe is a descriptor, and
    running out would refuse every run at once. Returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


def _clean_leftovers_quietly(runs_dir: Path, prefix: str | None) -> dict[str, list[str]]:
    try:
        return clean_leftovers(runs_dir, prefix)
    except Exception as exc:  # e.g. not root: namespaces cannot be listed/removed
        log.warning("leftover_cleanup_failed", error=str(exc))
        return {"cleanupFailed": [str(exc)]}


def _remove_agent_leftovers(config: GatewaydConfig) -> list[str]:
    from gatewayd.agent.loop import remove_leftovers  # the agent flow, only when needed

    try:
        return remove_leftovers(config.resolved_agent_dir)
    except Exception as exc:
        log.warning("agent_leftover_cleanup_failed", error=str(exc))
        return [f"cleanup failed: {exc}"]


def _state_dir_reachable(state_dir: Path) -> SandboxSupport:
    """bwrap runs as the run's uid and must reach the run's socket and the client copy
    in the state directory: every directory above it must let others pass (o+x)."""
    for directory in (state_dir, *state_dir.parents):
        if not directory.stat().st_mode & stat.S_IXOTH:
            return SandboxSupport(
                False,
                f"the state directory {state_dir} lies under {directory}, which other users "
                "cannot pass through (o+x), so a sandbox (running as an unprivileged uid) "
                f"cannot reach its socket; chmod o+x {directory} or choose another "
                "--state-dir",
            )
    return SandboxSupport(True)


def _apply_policy(run: Run, policy: Policy) -> None:
    """Swap in ``policy`` for the decisions of a live run, in one step (no await): a call
    reads ``run.spec`` once per decision, so it sees the old policy or the new one."""
    spec = run.spec
    run.spec = dataclasses.replace(
        spec,
        policy=policy,
        rules=dataclasses.replace(spec.rules, tool_patterns=tuple(policy.tools.allow)),
    )
    limits = policy.limits
    if (limits.calls_per_second, limits.burst) != (run.bucket.rate, run.bucket.burst):
        run.bucket = TokenBucket(rate=limits.calls_per_second, burst=limits.burst)
    run.limiter.total_tokens = limits.max_concurrent_calls
    run.model_budget.max_requests = policy.model_access.max_requests
    run.model_budget.max_tokens = policy.model_access.max_tokens
    if run.egress is not None:
        run.egress.network = policy.network


def _service_failure(outcome: ExecResult | BaseException) -> str:
    if isinstance(outcome, BaseException):
        return str(outcome)
    text = outcome.stderr[-1024:].decode("utf-8", "replace").strip()
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


def _sandbox_detail(run: Run) -> dict[str, Any]:
    if run.sandbox is None:
        return {"os": False, "degraded": run.degraded}
    return {"os": True, "uid": run.sandbox.user.uid, "netns": run.sandbox.netns.name}


def _require_lendable(run: Run, roots: LendableRoots) -> None:
    """The run's workspace and every rw policy path may be lent (NotLendable if not)."""
    roots.require(run.spec.workspace, what="workspace")
    for grant in run.spec.grants:
        if grant.mode is PathMode.RW:
            roots.require(grant.host_root, what=f"policy path {grant.name!r} (rw)")


def _refusal_code(exc: Exception) -> ErrorCode:
    """Whose fault a refused run was: the grant, the request, or gatewayd itself."""
    if isinstance(exc, GatewayError):  # AuthzDenied, PolicyViolation, SandboxUnavailable...
        return exc.code
    if isinstance(exc, PolicyError | ValueError):
        return ErrorCode.BAD_REQUEST
    return ErrorCode.INTERNAL


def _counts(run: Run) -> dict[str, Any]:
    return {
        "calls": run.calls,
        "allowed": run.allowed,
        "denied": run.denied,
        "deniedByCode": dict(run.denied_by_code),
    }


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


@asynccontextmanager
async def open_daemon(
    config: GatewaydConfig,
    *,
    control_socket: Path | None = None,
    tools: ToolRegistry | None = None,
    resolver: Resolver | None = None,
) -> AsyncIterator[Daemon]:
    """A running daemon; on exit every run is ended and the audit log closed.

    Error handling: DaemonClash (gatewayd.sandbox.daemons) when another live daemon on
    this host has this one's state directory, namespace prefix, sandbox uids, a file of
    its audit log or its control socket, and
    DaemonRegistryError when the host's registry of daemons cannot be used; raised
    before anything is opened or swept.

    ``control_socket``: the control socket this daemon serves (``gatewayd serve``; None,
    the default: none), registered so that no second daemon binds it or a file of this
    one's audit log, and never lent to a run. ``tools`` replaces the built-in tool registry
    (tests add deliberately slow or failing tools to reach the timeout and internal
    paths). ``resolver``: how http.fetch and the egress proxy resolve names (tests map
    names to loopback); None: the host's resolver.
    """
    raise_open_file_limit()
    config = config.with_real_dirs()
    scrubber = Scrubber.for_config(config.models, config.secret_env)
    async with (
        _registered(config.host_share(control_socket=control_socket)),
        open_audit_log(
            config.resolved_audit_path,
            fsync=config.audit_fsync,
            scrubber=scrubber,
            max_bytes=config.audit_max_bytes,
        ) as audit,
        trio.open_nursery() as nursery,
    ):
        daemon = Daemon(
            config,
            audit,
            nursery,
            tools=tools,
            scrubber=scrubber,
            resolver=resolver,
            control_socket=control_socket,
        )
        if config.models:
            # litellm takes seconds to import: pay it now, beside the start, not in the
            # first review's time budget (model_client imports it on demand otherwise).
            nursery.start_soon(_preload_models)
        await daemon.prepare_sandbox()
        try:
            yield daemon
        finally:
            with trio.CancelScope(shield=True):
                await daemon.aclose()
            nursery.cancel_scope.cancel()
