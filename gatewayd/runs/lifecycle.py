"""The run lifecycle: start a run (refuse, isolate, serve), run commands in its sandbox,
and end it, each step audited.

:class:`RunManager` owns no task of its own: every run's listener and services live in
the daemon's nursery it is given, and a run ends by cancelling its scope; its end
(:meth:`RunManager._finish`) runs shielded, whatever ended it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import structlog
import trio

from gatewayd.audit import AuditEvent, AuditLog, AuditWriteError
from gatewayd.config import GatewaydConfig
from gatewayd.dialer import Resolver, resolve_host
from gatewayd.dispatch import Dispatcher, RunReview
from gatewayd.errors import GatewayError, InvalidArguments, PolicyViolation, ToolFailed
from gatewayd.metrics import GatewayMetrics, run_error_code
from gatewayd.policy import PolicyError, SandboxSection, tool_allowed
from gatewayd.policy.model import NetworkSection
from gatewayd.policy.paths import PathMode
from gatewayd.protocol import ErrorCode
from gatewayd.runs.model import ChildKind, ChildSpec, Run, RunRequest, RunState
from gatewayd.runs.registry import RunRegistry
from gatewayd.runs.services import CallEgressProxies, services_for, start_services
from gatewayd.runs.startup import HostSandbox
from gatewayd.runs.workspaces import (
    BASE_LENDING_MODES,
    FINISHED_END_REASONS,
    BaseLender,
    WorkspacePlan,
    choose_workspace,
    give_back_base,
    plan_base_loan,
    refuse_host_paths_into_base,
    require_base_free,
)
from gatewayd.sandbox.launch import Echo, ExecResult, ResultForm, exec_result_json
from gatewayd.sandbox.lease import LeaseError
from gatewayd.sandbox.lendable import LendableRoots
from gatewayd.sandbox.limits import HostUser
from gatewayd.sandbox.passthrough import Passthrough
from gatewayd.sandbox.plan import Services
from gatewayd.sandbox.session import (
    CommandLimits,
    NamespaceAhead,
    RunSandbox,
    SandboxUnavailable,
    SandboxView,
    UidRecordAhead,
    WorkspaceInUse,
)
from gatewayd.sandbox.uids import UidPool
from gatewayd.server import serve_run
from gatewayd.tools.exec import (
    CommandEgress,
    ExecOptions,
    PreparedExec,
    exec_hint,
    prepare_exec,
    run_exec_command,
)
from gatewayd.tracing import Tracer
from gatewayd.workspace import WorkspaceError, WorkspaceSession
from gatewayd.workspace.store import RunWorkspace, WorkspaceStore

log = structlog.get_logger("gatewayd.runs")

# Called once a run is created (audited) and before its socket serves: gives the run
# its own tools (Dispatcher.set_run_tools). Error handling: an exception refuses the run.
RunToolsHook = Callable[[Run], Awaitable[None]]
# Called, shielded, when a run starts to end, before its sandbox is closed: stops what
# was started on its behalf outside it (its MCP servers' instances). Error handling: an
# exception is logged; the run ends all the same.
RunEndingHook = Callable[[str], Awaitable[None]]

# An exec's command as its exec_started entry records it: the program and its first
# arguments (a command line is a few words; more is a payload, not what ran).
AUDITED_COMMAND_ARGS = 64


class EndedWhileStarting(GatewayError):
    """The run was ended (the daemon stopping, an operator's DELETE, its max runtime)
    before its start returned it, while the start waited for its creation to be durable
    or for its services: no command of it ran, and its end is audited like any run's."""

    def __init__(self, run: Run) -> None:
        super().__init__(
            f"run {run.run_id} was ended ({run.end_reason}) before its start finished, "
            "so no command of it ran; start it again"
        )


class RunManager:
    """Creates, serves, runs commands in and ends runs. Every run's listener lives in
    the nursery given; ``config`` is the configuration in force (a reload replaces its
    model aliases: :func:`gatewayd.runs.reload.reload_config`)."""

    def __init__(
        self,
        config: GatewaydConfig,
        *,
        audit: AuditLog,
        registry: RunRegistry,
        dispatcher: Dispatcher,
        nursery: trio.Nursery,
        host: HostSandbox,
        uid_pool: UidPool,
        metrics: GatewayMetrics,
        resolver: Resolver | None = None,
        control_socket: Path | None = None,
        workspaces: WorkspaceStore | None = None,
    ) -> None:
        self.config = config
        self.audit = audit
        self.registry = registry
        self.uid_pool = uid_pool
        # Whether runs get the OS sandbox (``support.reason``: why not), and what every
        # run's sandbox is made with (None without it).
        self.support = host.support
        self.sandbox_settings = host.settings
        self._dispatcher = dispatcher
        self._nursery = nursery
        self._metrics = metrics
        # How the egress proxy resolves names (None: the host's resolver).
        self._resolver = resolver
        # The control socket this daemon serves (None: none), never lent to a run.
        self._control_socket = control_socket
        # An exec narrowed to some domains gets an egress proxy of its own.
        self._call_egress = CallEgressProxies(
            audit=audit,
            resolve=resolver or resolve_host,
            reply_after_result=config.audit_reply_after_result,
        )
        # Sandboxes are made one at a time: the check that no live run holds a workspace
        # and the lease that then takes it must not interleave with another start.
        self._isolating = trio.Lock()
        # What gives a run its own tools (its workspace's apps) once it is created, set
        # by the composition root; None: no run has tools of its own.
        self.run_tools: RunToolsHook | None = None
        # What stops the processes started for a run outside its sandbox (its per-run
        # MCP servers), set by the composition root; None: nothing to stop.
        self.run_ending: RunEndingHook | None = None
        # A span per run (None, the default: tracing is off).
        self.tracer: Tracer | None = None
        # Trees of runs whose give-back failed: still (partly) a sandbox uid's, so no
        # other run may take them until the next start returns them.
        self._stuck_trees: list[Path] = []
        # Every run's workspace session (gatewayd/runs/workspaces.py). In agent_dir, not
        # the state directory: the sandbox binds a session's view, and no bind source may
        # lie in the state directory (gatewayd/sandbox/plan.py).
        self.workspaces = workspaces or WorkspaceStore(config.resolved_agent_dir)

    async def start(
        self,
        request: RunRequest,
        *,
        sandbox_user: HostUser | None = None,
        lend_workspace: bool = True,
        policy_paths: bool = False,
        own_root: Path | None = None,
        workspace_session: bool = True,
        creation_durable: bool = True,
    ) -> Run:
        """Create a run and start serving its socket. Refusals are audited, then raised.
        ``sandbox_user`` and ``lend_workspace``: see :meth:`RunSandbox.open` (an agent
        run's overlay workspace is made the run uid's before the run starts).
        ``own_root``: a directory gatewayd made for this run alone (an agent run's work
        directory), beneath which its trees may lie besides the lendable roots.
        ``policy_paths``: the request may name its policy by a file's path (gatewayd's own
        command line); otherwise only by name, from the configured policy directories.
        ``workspace_session``: the run works on a session of the workspace store in the
        mode its request, policy or configuration chooses (gatewayd/runs/workspaces.py);
        False: on ``workspacePath`` as it is (a caller that made its own session: an
        agent run, ``gatewayd tools run``).
        ``creation_durable``: return once the run's creation is durable (its
        ``run_created`` entry). False, for a caller whose next step is a command started
        through the exec's gate (an attached ``gatewayd run``): the flush is asked for,
        and a sandboxed run without services is returned while it runs (``run.created_seq``
        names the entry); the command's gate waits for its own later entry, so for this
        one too. A run with services still waits: they are processes of the run.

        Error handling: AuthzDenied (no sandbox grant), PolicyError (bad policy),
        ValueError (bad workspace), NotLendable (a workspace or rw path under no lendable
        root), PolicyViolation (a workspace mode or limit the policy does not let the
        request choose), SandboxUnavailable (the workspace session could not be opened),
        OSError (gatewayd could not make the run's files); each is recorded as a
        ``run_refused`` event with the matching code. EndedWhileStarting: the run was
        ended before its start returned it, while it waited for its creation's flush or
        for its services (the daemon stopping, a DELETE, its max runtime), recorded as
        its ``run_ended``.
        """
        roots = LendableRoots(
            configured=self.config.lendable_roots,
            own=(own_root,) if own_root else (),
            reserved=self.config.own_directories(control_socket=self._control_socket),
        )
        try:
            run = self.registry.create(request, policy_paths=policy_paths)
            structlog.contextvars.bind_contextvars(run_id=run.run_id)  # this task's lines
            try:
                # Every run, sandboxed or degraded (whose host-side tools write as
                # gatewayd), before anything of it is touched.
                _require_lendable(run, roots)
                plan = None
                if workspace_session:
                    plan = choose_workspace(
                        request.workspace, run.spec.policy, self.config.workspace_mode
                    )
                await self._isolate(run, roots, sandbox_user, lend_workspace, SandboxView(), plan)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await self._drop_workspace(run)
                self.registry.remove(run)
                raise
        except Exception as exc:
            await self._refused(
                exc,
                {
                    "actorId": request.actorId,
                    "tenantId": request.tenantId,
                    "policy": request.policy,
                    "workspacePath": request.workspacePath,
                    "allowSandbox": request.grant.allowSandbox,
                    **(
                        {"workspace": request.workspace.model_dump(exclude_none=True)}
                        if request.workspace is not None
                        else {}
                    ),
                },
            )
            raise
        try:
            # Once its sandbox is made, whatever stops the start (a cancelled caller, the
            # audit log, its tools) ends the run the usual way: nothing of it is left.
            # Both entries durable in one flush (the later one's wait covers the earlier:
            # the log is written in order), asked for now so that it runs while the run's
            # tools are made and its socket is opened; waited for before its services
            # start and before this returns (_serve).
            opened = self._record_created(run)
            opened = self._record_workspace_opened(run) or opened
            run.created_seq = opened
            self.audit.flush_soon(opened)
            if self.run_tools is not None:
                await self.run_tools(run)
        except BaseException:
            run.end_reason = "start_failed"
            with trio.CancelScope(shield=True):
                await self._finish(run)
            raise
        await self._start_serving(run, created=opened, wait=creation_durable)
        return run

    async def start_child(
        self, spec: ChildSpec, *, view: SandboxView, review: RunReview | None = None
    ) -> Run:
        """Start a child run (an app's invocation) from ``spec``, which its parent's tool
        made no more than the parent's: its own uid and network namespace, its sandbox
        seeing the workspace as ``view`` says, every call reviewed under ``review``.
        Audited like any run (``run_created`` names the parent and the app), and ended
        with :meth:`end` like any.

        Error handling: as :meth:`start` (refusals audited as ``run_refused``), and
        WorkspaceInUse when the app's data folder is lent to another invocation."""
        # Its writable trees lie in the parent's workspace, which was lendable when the
        # parent started; nothing else of the child is writable.
        roots = LendableRoots(
            configured=self.config.lendable_roots,
            own=(spec.workspace,),
            reserved=self.config.own_directories(control_socket=self._control_socket),
        )
        try:
            run = self.registry.create_child(spec)
            try:
                _require_lendable_grants(run, roots)
                await self._isolate(run, roots, None, False, view)
            except BaseException:
                self.registry.remove(run)
                raise
        except Exception as exc:
            await self._refused(
                exc,
                {
                    "parentRunId": spec.parent_run_id,
                    **spec.made_for.label(),
                    "workspacePath": str(spec.workspace),
                },
            )
            raise
        if review is not None:  # None: a run with no socket makes no call to review
            self._dispatcher.set_run_review(run.run_id, review)
        try:
            with trio.CancelScope(shield=True):
                await self._audit_created(run)
        except BaseException:
            run.end_reason = "start_failed"
            with trio.CancelScope(shield=True):
                await self._finish(run)
            raise
        await self._start_serving(run)
        return run

    async def _refused(self, exc: Exception, detail: dict[str, Any]) -> None:
        """Count and audit a run refused before it was created (``run_refused``)."""
        code = str(_refusal_code(exc))
        self._metrics.run_refused(code)
        await self.audit.append(
            "event",
            event=AuditEvent.RUN_REFUSED,
            errorCode=code,
            safeMessage=str(exc),
            detail=detail,
        )

    async def _audit_created(self, run: Run) -> None:
        """``run_created``, durable when this returns."""
        await self.audit.durable(self._record_created(run))

    def _record_created(self, run: Run) -> int:
        """Record ``run_created`` (not waiting for it); returns its seq."""
        request = run.spec.request
        detail: dict[str, Any] = {
            "actorId": request.actorId,
            "tenantId": request.tenantId,
            "policy": run.spec.policy.name,
            "policySource": run.spec.policy_source,
            "workspace": str(run.workspace_base),
            "toolIds": list(request.toolIds) if request.toolIds is not None else None,
            "sandbox": _sandbox_detail(run),
        }
        if run.spec.made_for is not None:
            detail["parentRunId"] = run.spec.parent_run_id
            detail.update(run.spec.made_for.label())
        return self.audit.record(
            "event", event=AuditEvent.RUN_CREATED, runId=run.run_id, detail=detail
        )

    def _record_workspace_opened(self, run: Run) -> int | None:
        """Record ``workspace_opened`` (not waiting for it); returns its seq, None for a
        run without a session of the store."""
        handle = run.workspace
        if handle is None:
            return None
        info = handle.info
        return self.audit.record(
            "event",
            event=AuditEvent.WORKSPACE_OPENED,
            runId=run.run_id,
            detail={
                "mode": handle.mode,
                "modeFrom": run.workspace_mode_from,
                "base": str(handle.base),
                "root": str(handle.root),
                "onEnd": info.on_end,
                "keepForS": info.keep_for_s,
                "maxDeltaBytes": info.max_delta_bytes,
            },
        )

    async def _start_serving(
        self, run: Run, *, created: int | None = None, wait: bool = True
    ) -> None:
        """Serve the run in the daemon's nursery; returns once it serves. ``created``:
        the seq of its creation's entries, when they may not be durable yet, and
        ``wait``, whether to return only once they are (see :meth:`_serve`)."""
        try:
            await self._nursery.start(self._serve, run, created, wait)
        except BaseException:
            # _serve's own cleanup (_finish) has ended the run already, sandbox and all.
            if run.state is not RunState.ENDED:
                run.move_to(RunState.FAILED)
                self._dispatcher.drop_run_tools(run.run_id)
                self.registry.remove(run)
            raise
        self._metrics.run_started()
        log.info("run_started", run_id=run.run_id, policy=run.spec.policy.name)

    async def _isolate(
        self,
        run: Run,
        roots: LendableRoots,
        user: HostUser | None = None,
        lend_workspace: bool = True,
        view: SandboxView | None = None,
        plan: WorkspacePlan | None = None,
    ) -> None:
        """Give the run its workspace session (``plan``; None: none) and its OS
        sandbox, or make it degraded if its policy allows that.

        Error handling: PolicyViolation when the policy requires a sandbox this host
        cannot give; SandboxUnavailable when making it (or the session) failed.
        """
        policy = run.spec.policy
        held = sorted(set(policy.env.allow) & self._secret_env_names())
        made_for = run.spec.made_for
        if made_for is not None and made_for.kind is ChildKind.MCP_SERVER:
            # An MCP server's own sandbox runs only the operator's declared program, to
            # which the declaration hands those secrets (secret_env): no agent's code runs
            # there, and what it answers is scrubbed of them.
            held = []
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
            if plan is not None:
                # No uid to lend to: the fs tools (gatewayd's) work on the session's view.
                await self._open_workspace(run, plan, None, roots)
            return
        limits = policy.sandbox
        image = run.spec.request.sandboxImage
        # The namespace is made in its own thread meanwhile (the session's open waits
        # for the disk most of its time); RunSandbox.open takes it at its step.
        ahead = NamespaceAhead(run.run_id, self.sandbox_settings.netns_prefix)
        await self._start_ahead(ahead.make)
        try:
            await self._isolate_sandboxed(
                run, roots, user, lend_workspace, view, plan, limits, image, ahead
            )
        finally:
            with trio.CancelScope(shield=True):
                await ahead.drop_untaken()
        if run.workspace is not None and run.sandbox is not None:
            run.sandbox.after_command = _syncer(run.workspace.session)

    async def _start_ahead(self, make: Callable[[], Awaitable[None]]) -> None:
        """Start ``make`` (what a run's sandbox takes later, made while the start goes on)
        as a task of the daemon's nursery; awaited here when that takes no new task."""
        try:
            self._nursery.start_soon(make)
        except RuntimeError:  # the daemon's nursery takes no new task (it closes)
            await make()

    async def _isolate_sandboxed(
        self,
        run: Run,
        roots: LendableRoots,
        user: HostUser | None,
        lend_workspace: bool,
        view: SandboxView | None,
        plan: WorkspacePlan | None,
        limits: SandboxSection,
        image: str | None,
        ahead: NamespaceAhead,
    ) -> None:
        """:meth:`_isolate`'s sandboxed part: the session (its uid first), then the
        sandbox, one start at a time."""
        async with self._isolating:
            taken = False
            recorded: UidRecordAhead | None = None
            try:
                if plan is not None:
                    # The uid first: an overlay's base is lent to it before the mount.
                    taken = user is None
                    user = user or self.uid_pool.acquire()
                    if plan.mode in BASE_LENDING_MODES:
                        # Its sandbox lends no tree of its own (but a rw policy path
                        # outside the base, recorded over it then): its lease, the uid's
                        # record, is written while the session opens.
                        recorded = UidRecordAhead(run.directory, user)
                        await self._start_ahead(recorded.make)
                    await self._open_workspace(run, plan, user, roots)
                    if plan.mode in BASE_LENDING_MODES:
                        lend_workspace = False  # the base is the run's already
                    elif run.workspace is not None and plan.mode != "host":
                        # A view gatewayd made for the run alone (agentfs): lent like a
                        # workspace, beneath the session's own directory.
                        roots = dataclasses.replace(
                            roots, own=(*roots.own, run.workspace.directory)
                        )
                await self._open_sandbox(
                    run, limits, image, user, lend_workspace, roots, view, ahead, recorded
                )
            except BaseException:
                if taken and user is not None:
                    # The base goes back (a session that was opened) before its uid
                    # returns to the pool, and the uid once its record is written.
                    with trio.CancelScope(shield=True):
                        await self._drop_workspace(run)
                        if recorded is not None:
                            await recorded.settled()
                    self.uid_pool.release(user)
                raise
            finally:
                if recorded is not None:  # nothing is written in the run's directory after
                    with trio.CancelScope(shield=True):
                        await recorded.settled()

    async def _open_workspace(
        self, run: Run, plan: WorkspacePlan, user: HostUser | None, roots: LendableRoots
    ) -> None:
        """Open the run's session over its workspace (the base), lend the base to
        ``user`` first when the mode needs it (overlay), and make the session's root
        what the run's sandbox and fs tools see. Called with ``_isolating`` held when
        the run has a sandbox: the check that no live run holds the base and the lease
        that then takes it must not interleave with another start.

        Error handling: PolicyViolation (a policy path the mode cannot serve),
        WorkspaceInUse (another live run holds the base), NotLendable / WorkspaceInUse
        (the base may not be lent), SandboxUnavailable naming the mode and the fix when
        the session cannot be opened."""
        base = run.spec.workspace
        policy = run.spec.policy
        lends = user is not None and plan.mode in BASE_LENDING_MODES
        if plan.mode != "host":
            # Any virtual mode: no writable policy path may show the base past the view.
            refuse_host_paths_into_base(policy, run.spec.grants, base)
        if lends:
            require_base_free(base, self._busy_trees(run))
        store = self.workspaces
        pool_range = self.uid_pool.range
        lender: BaseLender | None = None

        def open_session() -> RunWorkspace:
            # What is lent planned in the session's own hand-off (one, not two).
            nonlocal lender
            if lends and user is not None:
                loan = plan_base_loan(policy, base)
                lender = BaseLender(loan, user, roots=roots, pool_range=pool_range)
            return store.open_session(
                run.run_id,
                base,
                plan.mode,
                on_end=plan.on_end,
                keep_for_s=plan.keep_for_s,
                max_delta_bytes=plan.max_delta_bytes,
                before_mount=lender,
                commit_git_metadata=policy.workspace.commit_git_metadata,
            )

        try:
            handle = await trio.to_thread.run_sync(open_session)
        except LeaseError as exc:
            raise WorkspaceInUse(f"cannot lend run {run.run_id}'s workspace: {exc}") from exc
        except (WorkspaceError, OSError) as exc:
            if lends and lender is None:
                raise  # planning the loan failed (no session was opened): as it was
            raise SandboxUnavailable(
                f"run refused: its workspace could not be opened in mode {plan.mode} "
                f"({exc}). Fix the cause, or choose another mode: the request's "
                "workspace.mode, the policy's workspace.mode, or the daemon's "
                "workspace_mode (host works on the directory itself)"
            ) from exc
        run.workspace = handle
        run.workspace_on_end = plan.on_end
        run.workspace_mode_from = plan.mode_from
        if handle.root != base:
            if user is not None and lender is not None and lender.whole_base:
                # The view's own top directory (the overlay's upper one): the run's, like
                # the base it lies over, so it may make files at the top of /workspace.
                os.chown(handle.root, user.uid, user.gid)
            self.registry.rebind(run, handle.root)

    def _busy_trees(self, run: Run) -> list[Path]:
        """The trees ``run`` may not take: those other live runs hold (lent, or read),
        the bases lent for their sessions, and those whose give-back failed."""
        busy = [*self._stuck_trees]
        for other in self.registry.all():
            if other is run:
                continue
            if other.sandbox is not None:
                busy += other.sandbox.held
            if other.workspace is not None and other.workspace.mode in BASE_LENDING_MODES:
                busy.append(other.workspace.base)
        return busy

    async def _open_sandbox(
        self,
        run: Run,
        limits: SandboxSection,
        image: str | None,
        user: HostUser | None,
        lend_workspace: bool,
        roots: LendableRoots,
        view: SandboxView | None = None,
        netns_ahead: NamespaceAhead | None = None,
        uid_recorded: UidRecordAhead | None = None,
    ) -> None:
        settings = self.sandbox_settings
        if settings is None:  # _isolate makes a degraded run instead
            raise SandboxUnavailable(f"run {run.run_id}: no OS sandbox on this host")
        busy = self._busy_trees(run)
        run.sandbox = await RunSandbox.open(
            run_id=run.run_id,
            settings=settings,
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
            services=services_for(run, self._dispatcher.tools),
            user=user,
            lend_workspace=lend_workspace,
            roots=roots,
            view=view,
            netns_ahead=netns_ahead,
            uid_recorded=uid_recorded,
            # An overlay session's view: a mount no reboot leaves, the only way the apps
            # folder's record reaches the folder (in the upper directory, on disk).
            view_mounted_for_run=run.workspace is not None and run.workspace.mode == "overlay",
        )

    def _secret_env_names(self) -> set[str]:
        """Variables whose values gatewayd holds as secrets (model keys, secret_env)."""
        return set(self._dispatcher.scrubber.names)

    async def exec(
        self,
        run_id: str,
        command: list[str],
        *,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        echo: Echo | None = None,
        passthrough: Passthrough | None = None,
        env_values: Mapping[str, str] | None = None,
        announce: Callable[[], None] | None = None,
    ) -> ExecResult:
        """Run ``command`` in the run's sandbox (host to sandbox); audited before it
        starts (``exec_started`` durable before the command runs; its sandbox is built
        meanwhile) and when it ends: the result (or the error) is returned only once
        ``exec_ended`` is durable, so whoever is told the exit code
        finds it in the log after a crash (unless the operator opted out:
        :meth:`durable_before_answer`). ``env_values``: where the variables the policy
        lets through are read (default: gatewayd's environment; an attached ``gatewayd
        run``'s own). ``announce``: called once ``exec_started`` is durable (and so the
        run's creation, recorded before it), before the command starts.

        Error handling: LookupError for an unknown run; SandboxUnavailable for a run
        without a sandbox or one that is ending; PlanError/LaunchError if bwrap cannot
        start (also audited); AuditWriteError when ``exec_started`` cannot be made
        durable (the command never starts, ``announce`` is not called) or ``exec_ended``
        cannot (the command ran; its result must not be given).
        """
        result, _hint = await self.exec_explained(
            run_id,
            command,
            stdin=stdin,
            timeout_s=timeout_s,
            echo=echo,
            passthrough=passthrough,
            env_values=env_values,
            announce=announce,
        )
        return result

    async def exec_explained(
        self,
        run_id: str,
        command: list[str],
        *,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        echo: Echo | None = None,
        passthrough: Passthrough | None = None,
        options: ExecOptions | None = None,
        env_values: Mapping[str, str] | None = None,
        announce: Callable[[], None] | None = None,
    ) -> tuple[ExecResult, str | None]:
        """:meth:`exec`, with ``options`` (a cwd, variables, a narrower network: checked
        as sandbox.exec checks its own, :func:`~gatewayd.tools.exec.prepare_exec`), and
        the result's hint (why the sandbox made it fail, or None).

        Error handling: as :meth:`exec`; and the options' refusals (PolicyViolation,
        InvalidArguments, ToolFailed, each naming what is allowed), audited as the
        command's ``exec_ended`` before they are raised. ValueError for options with
        ``echo`` or ``passthrough`` (a command with options is captured)."""
        if options is not None and (echo is not None or passthrough is not None):
            raise ValueError("an exec with options is captured: no echo, no passthrough")
        run = self.registry.get(run_id)
        if run is None:
            raise LookupError(f"no run {run_id}")
        structlog.contextvars.bind_contextvars(run_id=run_id)  # this task's lines
        if run.sandbox is None:
            raise SandboxUnavailable(
                f"run {run_id} has no OS sandbox ({run.degraded}); commands run only inside "
                "a sandbox"
            )
        sandbox = run.sandbox
        started = self.audit.record(
            "event",
            event=AuditEvent.EXEC_STARTED,
            runId=run_id,
            detail={
                "command": command[:AUDITED_COMMAND_ARGS],
                "timeoutS": timeout_s,
                **(options.audited() if options is not None else {}),
            },
        )

        async def gate() -> None:
            await self.audit.durable(started)
            if announce is not None:
                announce()

        if options is not None:
            await gate()
        else:
            # Its flush runs while the command's sandbox is prepared and built; the
            # command waits for it at its gate.
            self.audit.flush_soon(started)
        policy = run.spec.policy
        prepared = PreparedExec(cwd=None, env={}, network=None)
        try:
            if options is None:
                # Write-ahead: the command starts once exec_started is durable; its
                # sandbox is built meanwhile (the flush runs in the audit's thread).
                result = await sandbox.exec(
                    command,
                    stdin=stdin,
                    timeout_s=timeout_s,
                    echo=echo,
                    passthrough=passthrough,
                    env_values=env_values,
                    gate=gate,
                )
            else:
                prepared = prepare_exec(
                    options,
                    grants=run.spec.grants,
                    env_allow=policy.env.allow,
                    network=policy.network,
                )
                result = await run_exec_command(
                    sandbox,
                    command,
                    prepared,
                    stdin=stdin,
                    timeout_s=timeout_s,
                    env_values=os.environ if env_values is None else env_values,
                    egress=self._command_egress(run_id, sandbox),
                )
        except (PolicyViolation, InvalidArguments, ToolFailed) as exc:
            # The options were refused: nothing ran. On the record all the same.
            seq = self.audit.record(
                "event",
                event=AuditEvent.EXEC_ENDED,
                runId=run_id,
                errorCode=str(exc.code),
                safeMessage=exc.safe_message,
            )
            await self.durable_before_answer(seq)
            raise
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
        except BaseException:
            # Cancelled (trio's, or a group of them from the launcher's nursery): its
            # caller gave up (a stop signal to gatewayd run, an attached client gone, the
            # daemon stopping), and the command was killed on the way out. On the record,
            # so no exec_started is left without its end; durable with the next flush
            # (the run's own end waits for one).
            self.audit.record(
                "event",
                event=AuditEvent.EXEC_ENDED,
                runId=run_id,
                detail={"stopped": "its caller stopped waiting; the command was killed"},
            )
            raise
        seq = self.audit.record(
            "event",
            event=AuditEvent.EXEC_ENDED,
            runId=run_id,
            durationMs=result.durationMs,
            # A passed-through command's output was never kept: its byte counts instead.
            detail=exec_result_json(
                result,
                ResultForm.AUDIT if result.streamed is None else ResultForm.STREAMED_AUDIT,
            ),
        )
        await self.durable_before_answer(seq)
        hint = exec_hint(
            result,
            sandbox=sandbox,
            timeout_s=timeout_s,
            run_network=policy.network,
            prepared=prepared,
            fetch_allowed=tool_allowed("http.fetch", run.spec.rules),
        )
        return result, hint

    def _command_egress(self, run_id: str, sandbox: RunSandbox) -> CommandEgress:
        """How an operator's exec narrowed to some domains gets its own proxy (its
        audit entries say ``exec: control``)."""

        def serve(network: NetworkSection, socket: Path) -> AbstractAsyncContextManager[None]:
            return self._call_egress.serve(
                run_id=run_id,
                sandbox=sandbox,
                network=network,
                socket=socket,
                tags={"exec": "control"},
            )

        return serve

    async def durable_before_answer(self, seq: int) -> None:
        """Return once the entry ``seq`` (what an answer about to leave gatewayd reports:
        a command's end, its exit code) is durable, as every call's answer waits for its
        result entry (invariant RESULT_BEFORE_REPLY); at once when the operator opted out
        (``audit_reply_after_result: false``: the entry rides the next flush).

        Error handling: AuditWriteError when the log cannot take it; the answer must
        then not say what the entry would have."""
        if self.config.audit_reply_after_result:
            await self.audit.durable(seq)

    async def _serve(
        self,
        run: Run,
        created: int | None,
        wait: bool = True,
        *,
        task_status: trio.TaskStatus[None],
    ) -> None:
        """The run's socket and services until it ends, then its end (:meth:`_finish`).
        With ``created``, the socket is opened while that entry's flush runs, and the
        rest waits for it: the services (processes of the run) start, and the start
        returns, only once the run's creation is durable. The socket open before that
        serves nothing: only gatewayd and the run's group may enter its directory, and
        no process of the run exists yet; and a call's own entry comes after the run's
        in the log, so no call could have an effect before the run's creation is durable.
        ``wait`` False and no services: the start returns as the socket opens (its
        caller's command waits at the exec's gate for a later entry); a failed flush
        then ends the run here.
        """
        # Every line logged by this task and the tasks it starts (the run's connections,
        # calls, services, egress proxy) carries the run's id.
        structlog.contextvars.bind_contextvars(run_id=run.run_id)
        if self.tracer is not None:
            self.tracer.run_started(run.run_id, run.spec.policy.name)
        max_runtime = run.spec.request.limits.maxRuntimeSec
        started = False
        try:
            with trio.move_on_after(max_runtime) as scope:
                run.serving_since, run.deadline = trio.current_time(), scope.deadline
                try:
                    async with trio.open_nursery() as nursery:
                        await nursery.start(self._serve_socket, run, nursery.cancel_scope)
                        early = created is not None and not wait and _starts_no_service(run)
                        if early:
                            task_status.started()
                            started = True
                        if created is not None:
                            try:
                                await self.audit.durable(created)
                            except AuditWriteError as exc:
                                if not run.cancel_scope.cancel_called:  # as below
                                    run.end_reason = "start_failed"
                                if not early:
                                    raise
                                # Its caller holds the run: it ends here, and its
                                # command's gate fails on the same log.
                                log.error("run_creation_not_durable", error=exc.detail)
                                nursery.cancel_scope.cancel()
                            except BaseException:
                                # A run ended meanwhile (end()) keeps the reason it was
                                # ended for.
                                if not run.cancel_scope.cancel_called:
                                    run.end_reason = "start_failed"
                                raise
                        if not early:
                            await start_services(
                                run,
                                nursery,
                                lifetime_s=max_runtime,
                                audit=self.audit,
                                resolve=self._resolver or resolve_host,
                                models=self.config.models,
                                reply_after_result=self.config.audit_reply_after_result,
                            )
                            # A run ended (end()) while it started is not handed
                            # over: its socket's serve notices only at its first wait,
                            # which a run with no services may not have reached yet.
                            # It ends here like any, and its start raises.
                            if not run.cancel_scope.cancel_called:
                                task_status.started()
                                started = True
                except BaseExceptionGroup as group:
                    # The services did not come up, or the run's creation could not be
                    # made durable: the caller gets that error itself (the control socket
                    # answers it with its code and reason).
                    if len(group.exceptions) == 1 and isinstance(
                        group.exceptions[0], SandboxUnavailable | AuditWriteError
                    ):
                        raise group.exceptions[0] from None
                    raise
            if scope.cancelled_caught:
                run.end_reason = "max_runtime_exceeded"
                log.warning("run_max_runtime", run_id=run.run_id, seconds=max_runtime)
        finally:
            with trio.CancelScope(shield=True):
                await self._finish(run)
        if not started:
            # Ended while its start waited for its creation's flush: its caller is told
            # why, not trio's "child exited without calling task_status.started()".
            raise EndedWhileStarting(run)

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
                self._dispatcher,
                max_frame_bytes=self.config.max_frame_bytes,
                task_status=task_status,
            )
        finally:
            services.cancel()

    async def _end_workspace(self, run: Run, sandbox_gone: bool) -> tuple[bool, int | None]:
        """The run's session at its end: sealed (its view unmounted), the base lent for
        it given back, its ``on_end`` applied (the store's ``end_of_run``), audited as
        ``workspace_ended``. ``sandbox_gone``: every process of the run is dead; if not,
        the session is left live (the store's recovery keeps it at the next start) and
        the base stays lent. Returns whether nothing stays lent, and the seq of the
        ``workspace_ended`` entry (None: no session), recorded, not waited for: the
        caller's ``run_ended`` flush makes both durable. Never raises: a step that
        fails is logged and audited, and what it left is the store's recovery's."""
        handle = run.workspace
        if handle is None:
            return True, None
        detail: dict[str, Any] = {"mode": handle.mode, "base": str(handle.base)}
        returned = False
        store = self.workspaces
        try:
            if not sandbox_gone:
                detail["action"] = "left live"
                raise SandboxUnavailable(
                    "the run's processes could not all be stopped; the session stays live "
                    "and its base lent until the next start recovers them"
                )
            interrupted = (
                None
                if run.end_reason in FINISHED_END_REASONS
                else f"the run ended before its work did ({run.end_reason})"
            )
            given_back = False

            def seal_give_back_end() -> str:
                # The three steps in order in one worker thread (one hand-off, not three),
                # the session's record written once for the seal and the on-end (a step
                # that fails between them records it sealed, as the seal did before). A
                # seal that fails leaves the session live and held, its base lent.
                nonlocal given_back
                with handle.sealed_for_its_end():
                    detail["baseEntriesReturned"] = give_back_base(handle.directory)
                    given_back = True
                    return store.end_of_run(run.run_id, interrupted=interrupted)

            try:
                run.workspace_fate = await trio.to_thread.run_sync(seal_give_back_end)
            finally:
                returned = given_back
            detail["action"] = run.workspace_fate
        except Exception as exc:
            log.exception("workspace_end_failed", run_id=run.run_id)
            detail["error"] = str(exc)
            detail.setdefault("action", "kept (its end failed; see error)")
            if not returned and handle.mode in BASE_LENDING_MODES:
                self._stuck_trees.append(handle.base)
            if returned:
                run.workspace_fate = "kept (its end failed: see the audit log)"
        detail.update(handle.info.counts)
        seq = self.audit.record(
            "event", event=AuditEvent.WORKSPACE_ENDED, runId=run.run_id, detail=detail
        )
        return returned or handle.mode not in BASE_LENDING_MODES, seq

    async def _drop_workspace(self, run: Run) -> None:
        """A run refused after its session was opened: nothing of the run ever ran in
        it, so the session is discarded and the base given back. Never raises."""
        handle = run.workspace
        if handle is None:
            return
        store = self.workspaces
        try:

            def seal_give_back_discard() -> None:
                with handle.sealed_for_its_end():
                    give_back_base(handle.directory)
                    # Whatever its on-end says: nothing ran, nothing is committed.
                    store.end_of_run(run.run_id, on_end="discard")

            await trio.to_thread.run_sync(seal_give_back_discard)
        except Exception:
            log.exception("workspace_drop_failed", run_id=run.run_id)
            if handle.mode in BASE_LENDING_MODES:
                # Perhaps still lent: no other run takes it until a start recovers it.
                self._stuck_trees.append(handle.base)
        run.workspace = None

    async def end(self, run_id: str, reason: str = "ended") -> dict[str, Any] | None:
        """Stop serving a run and remove its socket; returns its final summary."""
        run = self.registry.get(run_id)
        if run is None:
            return None
        if run.state in (RunState.CREATED, RunState.SERVING):
            # A run already ending keeps its own reason (its max runtime ran out): its
            # end (the session's seal, the give-back) may still be under way.
            run.end_reason = reason
        run.cancel_scope.cancel()
        await run.finished.wait()
        return run.summary()

    async def end_all(self) -> None:
        """End every run (used at shutdown)."""
        for run in self.registry.all():
            await self.end(run.run_id, reason="daemon_stopping")

    async def _finish(self, run: Run) -> None:
        if run.state in (RunState.CREATED, RunState.SERVING):
            run.move_to(RunState.ENDING)
        if self.run_ending is not None:
            try:
                await self.run_ending(run.run_id)
            except Exception:
                log.exception("run_ending_hook_failed", run_id=run.run_id)
        cleanup: dict[str, Any] = {}
        if run.sandbox is not None:
            try:
                cleanup = await run.sandbox.close()
            except Exception as exc:  # keep the lease record: the next start returns it
                log.exception("sandbox_cleanup_failed", run_id=run.run_id)
                cleanup = {"cleanupFailed": str(exc)}
                self._stuck_trees.extend(run.sandbox.trees)
        # Its directory (socket, records, mount points) is read no more once the sandbox
        # is closed: deleted in a worker thread while the session ends; the run stays
        # known (its trees busy for other runs) until that is done too.
        deleted = trio.Event()
        if "cleanupFailed" not in cleanup:
            try:
                self._nursery.start_soon(self._delete_directory, run, deleted)
            except RuntimeError:  # the daemon's nursery takes no new task (it closes)
                await self._delete_directory(run, deleted)
        else:
            deleted.set()
        # The uid goes back to the pool only once the base lent for the session is back.
        base_returned, workspace_ended = await self._end_workspace(
            run, "cleanupFailed" not in cleanup
        )
        if run.sandbox is not None and "cleanupFailed" not in cleanup and base_returned:
            self.uid_pool.release(run.sandbox.user)
        self._dispatcher.drop_run_tools(run.run_id)
        try:
            try:
                # Recorded, and its flush asked for, before the wait for the directory's
                # deletion: the flush (the session's workspace_ended rides along) runs in
                # the audit's flusher thread meanwhile.
                ended = self.audit.record(
                    "event",
                    event=AuditEvent.RUN_ENDED,
                    runId=run.run_id,
                    detail={"reason": run.end_reason, **_counts(run), **cleanup},
                )
                self.audit.flush_soon(ended)
            finally:
                await deleted.wait()
                if "cleanupFailed" not in cleanup:
                    self.registry.discard(run)
                else:
                    self.registry.forget(run)
                run.move_to(RunState.ENDED)  # from ENDING, or from FAILED
            await self.audit.durable(ended)
        except AuditWriteError:
            if workspace_ended is not None:
                log.error("workspace_end_not_audited", run_id=run.run_id)
            log.error("run_end_not_audited", run_id=run.run_id, reason=run.end_reason)
        finally:
            run.finished.set()
            served = run.serving_since
            self._metrics.run_ended(
                run.end_reason, None if served is None else trio.current_time() - served
            )
            if self.tracer is not None:
                self.tracer.run_ended(run.run_id, run.end_reason, run_error_code(run.end_reason))
            log.info("run_ended", run_id=run.run_id, reason=run.end_reason)

    async def _delete_directory(self, run: Run, deleted: trio.Event) -> None:
        """:meth:`RunRegistry.delete_directory`, as a task; ``deleted`` set when done."""
        try:
            await self.registry.delete_directory(run)
        finally:
            deleted.set()


def _syncer(session: WorkspaceSession) -> Callable[[], Awaitable[None]]:
    """What a run's sandbox awaits after each command: the session's sync (cheap when
    nothing changed; the backend's to make so), in a worker thread, one at a time; in
    the trio thread when the backend keeps the base class's sync, which only checks
    that the session is open (the hand-off to a worker thread and back cost 0.7-0.8 ms
    of every command's answer here)."""
    if type(session).sync is WorkspaceSession.sync:

        async def check() -> None:
            session.sync()

        return check
    lock = trio.Lock()

    async def sync() -> None:
        async with lock:
            await trio.to_thread.run_sync(session.sync)

    return sync


def _starts_no_service(run: Run) -> bool:
    """Whether the run is sandboxed and has no process of its own for start_services
    to start (no egress proxy, no in-sandbox endpoint)."""
    return run.sandbox is not None and run.sandbox.services == Services()


def _sandbox_detail(run: Run) -> dict[str, Any]:
    if run.sandbox is None:
        return {"os": False, "degraded": run.degraded}
    return {"os": True, "uid": run.sandbox.user.uid, "netns": run.sandbox.netns.name}


def _require_lendable(run: Run, roots: LendableRoots) -> None:
    """The run's workspace and every rw policy path may be lent (NotLendable if not)."""
    roots.require(run.spec.workspace, what="workspace")
    # A rw grant of the workspace itself (``root: .``) was judged just now, on the same
    # path; the lease judges again what it lends, on the descriptor it then chowns.
    _require_lendable_grants(run, roots, judged=run.spec.workspace)


def _require_lendable_grants(run: Run, roots: LendableRoots, judged: Path | None = None) -> None:
    """Every rw policy path of the run may be lent (NotLendable if not); ``judged``: a
    path the caller has just judged, not judged again."""
    for grant in run.spec.grants:
        if grant.mode is PathMode.RW and grant.host_root != judged:
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
