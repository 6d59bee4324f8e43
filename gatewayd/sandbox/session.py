"""A run's sandbox: what gatewayd holds for a run between its start and its end, and the
one way to run a command in it (:meth:`RunSandbox.exec`).

At run start (:meth:`RunSandbox.open`): a uid from the pool, the run's network namespace
(loopback only), the writable trees lent to that uid, the run's directory opened to
the uid's group so bwrap can bind the socket. Every command of the run (``gatewayd run``'s
command, ``gatewayd exec``, the control socket's exec) gets a fresh bwrap sandbox built
from the same plan inputs, inside the same namespace, as the same uid: what the sandbox
may do is fixed when the run starts.

At run end (:meth:`RunSandbox.close`): running commands are stopped, every process of the
uid is killed, the lease is given back, the namespace removed, the uid returned.
A daemon that crashes leaves the lease record and the namespace; :func:`clean_leftovers`
removes both at the next start.

No run sees the workspace's apps folder: every plan covers it
(:mod:`gatewayd.sandbox.plan`), the start makes sure it can be covered and that no file of
it has a name outside it (:mod:`gatewayd.sandbox.appsfolder`), and the lease lends nothing
of a folder that was there before the run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

import structlog
import trio

from gatewayd.errors import GatewayError
from gatewayd.hostpaths.otherapps import other_apps_folders
from gatewayd.policy.appsfolder import APPS_DIR_NAME
from gatewayd.policy.paths import PathGrant, PathMode
from gatewayd.protocol import ErrorCode
from gatewayd.sandbox.appsfolder import (
    AppsFolder,
    AppsFolderRefused,
    prepare_apps_folder,
    refuse_linked_folders,
    remove_leftover_folder,
    remove_made_folder,
)
from gatewayd.sandbox.cgroup import CgroupError, CgroupSupport, DeferredRemovals
from gatewayd.sandbox.daemons import DaemonRegistryError, sandbox_uid_ranges
from gatewayd.sandbox.image import ImageError, require_image
from gatewayd.sandbox.launch import Echo, ExecResult, Gate, run_in_sandbox
from gatewayd.sandbox.lease import Lease, LeaseError, give_back, lend, read_lease, record_uid
from gatewayd.sandbox.lendable import LendableRoots, NotLendable
from gatewayd.sandbox.limits import HostUser, SandboxLimits
from gatewayd.sandbox.netns import (
    NetnsError,
    NetnsHandle,
    create_run_netns,
    netns_name,
    netns_path,
    remove_run_netns,
    remove_stale_netns,
)
from gatewayd.sandbox.passthrough import Passthrough
from gatewayd.sandbox.plan import (
    CALL_EGRESS_SOCKET_PREFIX,
    CALL_EGRESS_SOCKET_SUFFIX,
    CLIENT_COPY_DIR,
    COGNI_TOOL_VISIBLE_DIR,
    PIN_DIR,
    WORKSPACE,
    CheckedPlans,
    HostLayout,
    PlanError,
    PolicyMount,
    SandboxPlan,
    Services,
    build_plan,
    validate,
)
from gatewayd.sandbox.uids import UidPool, UidRange, below_every_range, pids_of_uid

log = structlog.get_logger("gatewayd.sandbox")

COGNI_TOOL_SCRIPT: Final = "cogni-tool"
# The client's modules copied into the sandbox: standard library only (its own tests
# keep it so), so any python3 in the sandbox runs it.
_CLIENT_PACKAGE: Final = Path(__file__).resolve().parent.parent.parent / "cogni_tool"
# Directories and files the sandbox uid must read but never write.
_PUBLIC_DIR_MODE: Final = 0o755  # also the script's mode: read and execute, never write
_PUBLIC_FILE_MODE: Final = 0o644
# The run's directory: root-owned, the run's group may only pass through it to the
# socket (bwrap, running as the run's uid, resolves the socket's path on the host).
RUN_DIR_MODE: Final = 0o710
# Host variables passed when present (the policy adds its own env.allow names).
PASSED_ENV: Final = ("LANG", "TERM")
_MIB: Final = 1024 * 1024
# Killing a run's leftovers: a process in uninterruptible sleep (D state, e.g. stuck on
# NFS) can take a moment to die; past this the run's cleanup fails loudly instead.
KILL_WAIT_S: Final = 5.0
KILL_POLL_S: Final = 0.005
# cogni-tool serve runs a thread per request and two per relayed connection.
SERVICE_MIN_THREADS: Final = 600


class SandboxUnavailable(GatewayError):
    """The run's sandbox could not be made; the message says what failed."""


class ImageRefused(SandboxUnavailable):
    """The run asked for a root filesystem image that cannot be a sandbox root."""

    code = ErrorCode.BAD_REQUEST


class UnsafeMounts(SandboxUnavailable):
    """The workspace or a policy path would expose what no sandbox may see (the plan's
    checks); nothing was lent or created."""

    code = ErrorCode.BAD_REQUEST


class WorkspaceInUse(SandboxUnavailable):
    """Another live run holds this workspace or a directory overlapping it."""

    code = ErrorCode.BAD_REQUEST


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxSettings:
    """What every run's sandbox shares: set once when the daemon starts."""

    bwrap: str
    netns_prefix: str
    state_dir: Path
    cogni_tool_dir: Path
    layout: HostLayout
    # Memory and pids cgroups per command where the host delegates them; None: rlimits.
    cgroups: CgroupSupport | None = None

    def __post_init__(self) -> None:
        # The plan refuses a bind source at, above or beneath the state directory by
        # comparing strings, and sources are real paths: so must the state directory be.
        real = os.path.realpath(self.state_dir)
        if real != str(self.state_dir):
            raise ValueError(
                f"the state directory must be given as its real path ({real}), not "
                f"{self.state_dir}: the sandbox plan compares real paths with it"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandLimits:
    """The run-level inputs of a command's :class:`SandboxLimits` (from its policy and
    request)."""

    timeout_s: float
    cpu_s: int
    memory_mb: int
    max_processes: int
    max_file_mb: int
    max_open_files: int
    max_output_bytes: int
    tmp_mb: int  # /tmp and /dev/shm, each

    def for_command(self, timeout_s: float | None) -> SandboxLimits:
        """This run's limits, with a caller's shorter (never longer) timeout."""
        timeout = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        return SandboxLimits(
            timeout_s=timeout,
            cpu_s=self.cpu_s,
            memory_bytes=self.memory_mb * _MIB,
            max_processes=self.max_processes,
            max_file_bytes=self.max_file_mb * _MIB,
            max_open_files=self.max_open_files,
            max_output_bytes=self.max_output_bytes,
        )

    def for_services(self, lifetime_s: float) -> SandboxLimits:
        """The limits of the run's long-lived ``cogni-tool serve``: the run's lifetime
        instead of a command's timeout, CPU time to match, and threads enough for its
        connections (each thread counts as a process); memory and files as any command.
        """
        limits = self.for_command(None)
        return SandboxLimits(
            timeout_s=lifetime_s,
            cpu_s=max(self.cpu_s, int(lifetime_s) + 1),
            memory_bytes=limits.memory_bytes,
            max_processes=max(self.max_processes, SERVICE_MIN_THREADS),
            max_file_bytes=limits.max_file_bytes,
            max_open_files=max(self.max_open_files, SERVICE_MIN_THREADS * 2),
            max_output_bytes=limits.max_output_bytes,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxView:
    """How a run's sandbox sees the host beyond its policy paths. The default is every
    run's; an app's own sandbox reads its caller's workspace (``workspace_read_only``),
    sees its own folder although it lies in the covered apps folder (``exposed``: real
    host paths, bound as the app's policy paths say), and starts its commands in
    ``cwd``. A run whose policy grants the workspace itself (``root: .``) read-only gets
    ``workspace_read_only`` too (:func:`sandbox_view`)."""

    # True: /workspace is bound read-only and the workspace is not lent to the run's
    # uid; its rw policy paths still are.
    workspace_read_only: bool = False
    # False: of the workspace, only the policy paths beneath /workspace are shown (an
    # app whose caller may read only parts of it); True: all of it.
    whole_workspace: bool = True
    # False: no run socket in the sandbox (an app's calls are its conversation's).
    gateway_socket: bool = True
    exposed: tuple[Path, ...] = ()
    # Grants (by host root) that the fs tools serve but the sandbox does not show: a
    # caller's grant with suffix or size rules, which a mount cannot keep.
    unmounted: frozenset[Path] = frozenset()
    cwd: str = WORKSPACE


@dataclass(frozen=True, slots=True, kw_only=True)
class CallBind:
    """A directory or file one command sees (:class:`CallView`): ``fd`` is an ``O_PATH``
    descriptor the caller opened without following any symlink and keeps open for the
    command; bwrap binds exactly it (attached at a run-private mount point, as the run's
    pinned trees are), whatever its path has become meanwhile."""

    fd: int
    host: str  # its real host path when opened: for the plan's checks and messages
    visible: str
    writable: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class CallView:
    """One command's narrowed view of its run's sandbox (a process tool's call).

    Of the host it sees the system, as every command does, and ``binds``, nothing else:
    not the workspace (an empty read-only /workspace holds the binds beneath it), none
    of the run's policy paths, no run socket, none of the run's services; a network
    namespace of its own with loopback only; the environment ``env_names`` (from the
    values passed), and it starts in ``cwd``. Same uid, limits and launcher as the
    run's other commands.

    ``egress_socket``: the host socket of this command's own egress proxy
    (:meth:`RunSandbox.call_egress_socket`), bound where the run's would be, with the
    proxy variables set; the command starts the bridge to it in its own namespace."""

    binds: tuple[CallBind, ...]
    env_names: tuple[str, ...] = ()
    cwd: str = WORKSPACE
    egress_socket: Path | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandNetwork:
    """One command's network when it is narrower than its run's: a network namespace of
    its own with loopback only, where none of the run's in-sandbox services is (no model
    endpoint, not the run's proxy), and, with ``egress_socket``, the host socket of the
    command's own egress proxy (:meth:`RunSandbox.call_egress_socket`) bound where the
    run's would be, the proxy variables set: the command then starts its own bridge to
    it (``cogni-tool serve --proxy-port ... --``). None: no way out at all."""

    egress_socket: Path | None = None


# What a plan is made from besides the run's own fixed inputs and its command: the
# variables' values, the cwd and the network (RunSandbox.plan).
_PlanKey = tuple[frozenset[tuple[str, str]], str | None, CommandNetwork | None]


@dataclass(eq=False, kw_only=True)
class RunSandbox:
    """The OS sandbox of one live run."""

    run_id: str
    settings: SandboxSettings
    user: HostUser
    netns: NetnsHandle
    netns_id: tuple[int, int]  # (st_dev, st_ino) of the namespace: peers must match it
    lease: Lease
    workspace: Path
    mounts: tuple[PolicyMount, ...]
    socket_path: Path
    env_names: tuple[str, ...]
    limits: CommandLimits
    image_dir: Path | None = None
    services: Services = field(default_factory=Services)
    # The bind sources, opened once at run start: (descriptor, run-private mount point),
    # and host path -> mount point for the plan (see plan.Bind.via). The workspace first.
    pins: tuple[tuple[int, str], ...] = ()
    pinned: dict[str, str] = field(default_factory=dict)
    # The workspace's apps folder every command's sandbox covers (None: not looked at).
    apps_folder: AppsFolder | None = None
    # An app's own sandbox: the workspace read-only, its own folder (beneath the covered
    # apps folder) bound all the same, and its commands starting there.
    view: SandboxView = field(default_factory=SandboxView)
    # Trees this run holds without lending them: a workspace its policy makes read-only.
    unlent: tuple[Path, ...] = ()
    # Awaited after each command that sees the run's workspace ends (the workspace
    # session's sync: a backend whose view is a copy records what the command wrote).
    after_command: Callable[[], Awaitable[None]] | None = None
    _running: set[trio.CancelScope] = field(default_factory=set)
    _idle: trio.Event = field(default_factory=trio.Event)
    # The commands' cgroups, removed after their results are returned; close() waits.
    _cgroup_removals: DeferredRemovals = field(default_factory=DeferredRemovals)
    # The last plan made by plan(), by what it was made from besides its command.
    _last_plan: tuple[_PlanKey, SandboxPlan] | None = field(default=None, init=False)
    # Every plan of this run is validated through it: when built and again before its
    # start, the second time at no cost when it equals the first but for its command.
    _checks: CheckedPlans = field(default_factory=CheckedPlans, init=False)
    _closed: bool = False
    # The next free number for a call's own mount points (beside the run's pins, which
    # take 0..len(pins)-1): each narrowed command attaches its binds at fresh ones.
    _next_point: int = -1
    # The next number of a call's own egress proxy socket (never reused while the run
    # lives, as mount points are not).
    _next_egress: int = 0

    @classmethod
    async def open(
        cls,
        *,
        run_id: str,
        settings: SandboxSettings,
        pool: UidPool,
        run_dir: Path,
        socket_path: Path,
        workspace: Path,
        grants: Sequence[PathGrant],
        env_names: Sequence[str],
        limits: CommandLimits,
        roots: LendableRoots,
        image_dir: Path | None = None,
        busy_trees: Sequence[Path] = (),
        services: Services | None = None,
        user: HostUser | None = None,
        lend_workspace: bool = True,
        view: SandboxView | None = None,
        netns_ahead: NamespaceAhead | None = None,
        uid_recorded: UidRecordAhead | None = None,
        view_mounted_for_run: bool = False,
    ) -> RunSandbox:
        """Make the run's sandbox resources; on any failure, undo what was made.
        ``roots``: what the writable trees must lie beneath (the lease checks them).
        ``busy_trees`` are the trees other live runs hold: overlapping one is refused.
        ``user``: a uid the caller took from ``pool`` already (the caller releases it
        when the open fails: a base lent to it must go back first; released at close
        like one taken here). ``lend_workspace=False``: the caller made the workspace the run's
        own and disposes of it (an agent run's overlay, gatewayd/agent/; a run's session
        over a base lent before the mount, gatewayd/runs/workspaces.py), so it is not
        lent and not given back, nor is a rw policy path beneath it. ``view``: an app's
        own sandbox (:class:`SandboxView`):
        the workspace is then neither lent nor checked against ``busy_trees`` (the
        caller's run holds it; the app only reads it), and a writable tree in the app's
        own folder is not in use by the caller (whose lease never lends its apps folder).
        A ``ro`` grant on the workspace itself makes it read-only as well
        (:func:`sandbox_view`): bound so and not lent, but held all the same (gatewayd
        makes and removes its apps folder for the run); its rw policy paths are lent.
        ``netns_ahead``: the run's namespace being made already (:class:`NamespaceAhead`),
        taken instead of making one; the open then owns it (removed if it fails).
        ``uid_recorded``: ``user``'s lease of no tree being recorded in ``run_dir``
        already (:class:`UidRecordAhead`): the lease is not written again when it lends
        nothing; the record's failure is raised at the lease's step.
        ``view_mounted_for_run``: the workspace is a mount gatewayd made for this run
        alone (an overlay session's view), which no reboot leaves mounted: the record
        of an apps folder made in it, which reaches the folder only through that mount,
        is written, not flushed (:func:`prepare_apps_folder`).

        Error handling: :class:`SandboxUnavailable` naming the step and the cause
        (:class:`UnsafeMounts` for a workspace whose apps folder cannot be hidden);
        :class:`~gatewayd.sandbox.lendable.NotLendable` for a writable tree that may not
        be lent (nothing was lent).
        """
        view = view or SandboxView()
        # An app's view: the caller's run holds the workspace. A run that only reads it
        # by its policy holds it all the same: gatewayd makes and removes the apps
        # folder in it for the run, which two runs would do to each other.
        caller_holds = view.workspace_read_only
        view = sandbox_view(grants, workspace, view)
        taken_here = user is None
        user = user or pool.acquire()
        netns: NetnsHandle | None = None
        pins: list[tuple[int, str]] = []
        pinned: dict[str, str] = {}
        apps: AppsFolder | None = None
        try:
            _open_run_dir(run_dir, user)
            mounts = _policy_mounts(
                [grant for grant in grants if grant.host_root not in view.unmounted], workspace
            )
            if image_dir is not None:
                try:
                    require_image(image_dir, policy_mount_points=[m.visible for m in mounts])
                except ImageError as exc:
                    raise ImageRefused(str(exc)) from exc
            # The whole plan is checked before anything is lent: a workspace or policy
            # path at or above a host secret (/etc, /root, the state directory...) must
            # be refused before gatewayd chowns a single file of it.
            try:
                _plan(
                    run_id=run_id,
                    settings=settings,
                    workspace=workspace,
                    mounts=mounts,
                    socket_path=socket_path,
                    netns_path=netns_path(netns_name(run_id, prefix=settings.netns_prefix)),
                    env_names=env_names,
                    image_dir=image_dir,
                    limits=limits,
                    command=["true"],
                    env_values={},
                    services=services,
                    view=view,
                )
            except PlanError as exc:
                raise UnsafeMounts(f"run refused: {exc}") from exc
            if view.workspace_read_only and not caller_holds:
                _refuse_writable_workspace(grants, workspace)
            sources = [workspace, *(Path(m.host) for m in mounts)]
            pins, pinned = _pin_sources(run_dir, user, sources, grants)
            # What bwrap will bind, by identity: the lease lends exactly those directories
            # and keeps the read-only ones out of what it lends, whatever their paths
            # lead to by the time it walks.
            bound = {source: _identity(fd) for source, (fd, _) in zip(sources, pins, strict=True)}
            rw_paths = [Path(m.host) for m in mounts if m.mode is PathMode.RW]
            held = rw_paths if caller_holds else [workspace, *rw_paths]
            _check_not_in_use(
                [t for t in held if not any(t.is_relative_to(e) for e in view.exposed)],
                busy_trees,
            )
            lent_workspace = lend_workspace and not view.workspace_read_only
            if lent_workspace:
                writable = [workspace, *rw_paths]
            elif lend_workspace or caller_holds:
                writable = rw_paths
            else:
                # The caller made the workspace the run's own, with everything in it (a
                # session's view over a base lent before it was mounted): a rw path
                # beneath it is the run's already, and chowning it through the view
                # would copy every file of it into the session's delta.
                writable = [p for p in rw_paths if not p.is_relative_to(workspace)]
            workspace_fd = pins[0][0]
            devices = {os.fstat(fd).st_dev for fd, _ in pins}

            netns = await (
                netns_ahead.take(run_id)
                if netns_ahead is not None
                else trio.to_thread.run_sync(
                    lambda: create_run_netns(run_id, prefix=settings.netns_prefix)
                )
            )
            info = os.stat(netns.path)
            recorded = None if uid_recorded is None else await uid_recorded.take(user)
            read_only = {bound[Path(m.host)] for m in mounts if m.mode is PathMode.RO}

            def check_apps_folders_then_lend() -> tuple[AppsFolder, Lease]:
                # The apps folder's checks and the lease in one worker thread (one
                # hand-off, not two); ``apps`` is set as soon as the folder is made, so
                # a refusal after it (the other folders, the lease) still removes it.
                nonlocal apps
                apps = prepare_apps_folder(
                    workspace_fd, workspace, run_dir, durable_record=not view_mounted_for_run
                )
                # Other workspaces' apps folders: no file of one may have a name the run
                # sees (the run's creation refused roots holding one).
                refuse_linked_folders(other_apps_folders(settings.state_dir, workspace), devices)
                # An apps folder there before the run stays its owner's with everything
                # in it: the run's uid owns nothing there, whatever names reach it. One
                # made for the run is empty and goes with the workspace, like a
                # directory the run made.
                keep = read_only if apps.made is not None else {*read_only, apps.identity}
                lent = lend(
                    writable,
                    user,
                    run_dir,
                    roots=roots,
                    keep=keep,
                    pinned=bound,
                    sandbox_owned=sandbox_owned(pool.range),
                    recorded=recorded,
                )
                return apps, lent

            try:
                apps_checked, lease = await trio.to_thread.run_sync(check_apps_folders_then_lend)
            except AppsFolderRefused as exc:
                raise UnsafeMounts(f"run refused: {exc}") from exc
        except BaseException as exc:
            if apps is not None and apps.made is not None:
                with contextlib.suppress(OSError):
                    remove_made_folder(pins[0][0], apps.made)
            for fd, _ in pins:
                os.close(fd)
            with trio.CancelScope(shield=True):
                if netns is not None:
                    name = netns.name
                    await trio.to_thread.run_sync(remove_run_netns, name)
                if taken_here:
                    pool.release(user)
            if isinstance(exc, SandboxUnavailable | NotLendable):
                raise
            if isinstance(exc, LeaseError):  # the workspace's state, not gatewayd's fault
                raise WorkspaceInUse(f"cannot lend run {run_id}'s workspace: {exc}") from exc
            if isinstance(exc, GatewayError | OSError | ValueError | DaemonRegistryError):
                raise SandboxUnavailable(f"cannot make run {run_id}'s sandbox: {exc}") from exc
            raise
        return cls(
            run_id=run_id,
            settings=settings,
            user=user,
            netns=netns,
            netns_id=(info.st_dev, info.st_ino),
            lease=lease,
            workspace=workspace,
            mounts=mounts,
            socket_path=socket_path,
            env_names=tuple(env_names),
            limits=limits,
            image_dir=image_dir,
            services=services or Services(),
            pins=tuple(pins),
            pinned=pinned,
            apps_folder=apps_checked,
            view=view,
            unlent=(workspace,) if view.workspace_read_only and not caller_holds else (),
        )

    def plan(
        self,
        command: Sequence[str],
        env_values: Mapping[str, str],
        *,
        cwd: str | None = None,
        network: CommandNetwork | None = None,
    ) -> SandboxPlan:
        """The bwrap plan for ``command`` in this run (validated); ``cwd`` and
        ``network`` as :meth:`exec` takes them.

        A plan depends on its command only through ``SandboxPlan.command`` (which
        ``build_plan`` checks only for being non-empty and ``validate`` not at all), and
        on nothing else that changes while the run lives but these arguments: so the
        last plan made, for the same variables, cwd and network, is reused with the new
        command instead of being built and validated again (and render_argv's check
        before each start passes it at once: the run's :class:`CheckedPlans` validated
        it as it is, but for the command).
        """
        key: _PlanKey = (frozenset(env_values.items()), cwd, network)
        if command and self._last_plan is not None and self._last_plan[0] == key:
            return replace(self._last_plan[1], command=tuple(command))
        plan = self._build_plan(command, env_values, cwd=cwd, network=network)
        self._last_plan = (key, plan)
        return plan

    def _build_plan(
        self,
        command: Sequence[str],
        env_values: Mapping[str, str],
        *,
        cwd: str | None,
        network: CommandNetwork | None,
    ) -> SandboxPlan:
        egress = None if network is None else network.egress_socket
        return _plan(
            run_id=self.run_id,
            settings=self.settings,
            workspace=self.workspace,
            mounts=self.mounts,
            socket_path=self.socket_path,
            netns_path=self.netns.path,
            env_names=self.env_names,
            image_dir=self.image_dir,
            limits=self.limits,
            command=command,
            env_values=env_values,
            pinned=self.pinned,
            services=self.services
            if network is None
            else Services(egress_proxy=egress is not None),
            view=self.view if cwd is None else replace(self.view, cwd=cwd),
            run_network=network is None,
            egress_socket=None if egress is None else str(egress),
            checks=self._checks,
        )

    async def exec(
        self,
        command: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        env_values: Mapping[str, str] | None = None,
        echo: Echo | None = None,
        limits: SandboxLimits | None = None,
        passthrough: Passthrough | None = None,
        cwd: str | None = None,
        network: CommandNetwork | None = None,
        gate: Gate | None = None,
    ) -> ExecResult:
        """Run ``command`` in a fresh sandbox of this run and return what it did.
        ``gate``: the command itself waits for it, its sandbox built meanwhile
        (:func:`~gatewayd.sandbox.launch.run_in_sandbox`).
        ``limits`` replaces the run's command limits (the run's services only);
        ``passthrough`` relays its streams from and to host descriptors
        (:func:`~gatewayd.sandbox.launch.run_in_sandbox`). ``cwd``: where it starts
        (a visible path the caller checked; default the view's). ``network``: a network
        namespace of the command's own instead of the run's (:class:`CommandNetwork`).

        Must be called from the trio thread. Error handling: ``PlanError`` or
        ``LaunchError`` when the sandbox cannot start; :class:`SandboxUnavailable`
        once the run is ending.
        """
        if self._closed:
            raise SandboxUnavailable(f"run {self.run_id} is ending; no new command may start")
        values = dict(os.environ) if env_values is None else dict(env_values)
        plan = self.plan(command, values, cwd=cwd, network=network)
        result = await self._launch(
            plan,
            limits=limits or self.limits.for_command(timeout_s),
            stdin=stdin,
            echo=echo,
            pins=self.pins,
            passthrough=passthrough,
            gate=gate,
        )
        # Also after a command that timed out or was killed: it may have written first.
        if self.after_command is not None:
            await self.after_command()
        return result

    async def exec_in_view(
        self,
        command: Sequence[str],
        view: CallView,
        *,
        limits: SandboxLimits,
        env_values: Mapping[str, str],
        stdin: bytes | None = None,
        echo: Echo | None = None,
    ) -> ExecResult:
        """Run ``command`` in a fresh sandbox of this run that sees only ``view``
        (:class:`CallView`), within ``limits`` (the caller derives them from the run's).

        Each bind is attached, by its descriptor, at a mount point of its own in the
        run's directory, made for this command and removed after it, so concurrent
        commands never share one. Must be called from the trio thread.

        Error handling: ``PlanError`` for a view the plan's checks refuse (a bind of a
        denied or covered host tree, two binds at one place), ``LaunchError`` when the
        sandbox cannot start; :class:`SandboxUnavailable` once the run is ending.
        """
        if self._closed:
            raise SandboxUnavailable(f"run {self.run_id} is ending; no new command may start")
        points = self.socket_path.parent / PIN_DIR
        made: list[Path] = []
        try:
            pins: list[tuple[int, str]] = []
            pinned: dict[str, str] = {}
            for bind in view.binds:
                point = points / str(self._take_point())
                if stat.S_ISDIR(os.fstat(bind.fd).st_mode):
                    point.mkdir(mode=0o700)
                else:  # a file is mounted on a file
                    os.close(os.open(point, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
                made.append(point)
                pins.append((bind.fd, str(point)))
                pinned[bind.host] = str(point)
            plan = _plan(
                run_id=self.run_id,
                settings=self.settings,
                workspace=self.workspace,
                mounts=tuple(
                    PolicyMount(
                        host=bind.host,
                        visible=bind.visible,
                        mode=PathMode.RW if bind.writable else PathMode.RO,
                    )
                    for bind in view.binds
                ),
                socket_path=self.socket_path,
                netns_path=self.netns.path,
                env_names=view.env_names,
                image_dir=self.image_dir,
                limits=self.limits,
                command=command,
                env_values=env_values,
                pinned=pinned,
                services=Services(egress_proxy=view.egress_socket is not None),
                view=SandboxView(
                    workspace_read_only=True,
                    whole_workspace=False,
                    gateway_socket=False,
                    cwd=view.cwd,
                ),
                run_network=False,
                egress_socket=None if view.egress_socket is None else str(view.egress_socket),
                checks=self._checks,
            )
            return await self._launch(plan, limits=limits, stdin=stdin, echo=echo, pins=pins)
        finally:
            for point in made:
                with contextlib.suppress(OSError):
                    if point.is_dir():
                        point.rmdir()
                    else:
                        point.unlink()

    def call_egress_socket(self) -> Path:
        """A fresh host path, in the run's directory, for one command's own egress proxy
        socket (:class:`CallView`); nothing is made there. The caller serves it, and
        removes it after the command."""
        number = self._next_egress
        self._next_egress += 1
        name = f"{CALL_EGRESS_SOCKET_PREFIX}{number}{CALL_EGRESS_SOCKET_SUFFIX}"
        return self.socket_path.parent / name

    def _take_point(self) -> int:
        # Numbers are never reused while the run lives: a point is removed after its
        # command, but a number handed out twice could meet a concurrent command's.
        self._next_point = max(self._next_point, len(self.pins)) + 1
        return self._next_point - 1

    async def _launch(
        self,
        plan: SandboxPlan,
        *,
        limits: SandboxLimits,
        stdin: bytes | None,
        echo: Echo | None,
        pins: Sequence[tuple[int, str]],
        passthrough: Passthrough | None = None,
        gate: Gate | None = None,
    ) -> ExecResult:
        with trio.CancelScope() as scope:
            if not self._running:
                # A fresh event per busy spell: one set by an earlier command's end would
                # let close() go on while this one is still being stopped.
                self._idle = trio.Event()
            self._running.add(scope)
            try:
                return await run_in_sandbox(
                    plan,
                    netns=self.netns.path,
                    limits=limits,
                    host_user=self.user,
                    stdin=stdin,
                    bwrap=self.settings.bwrap,
                    cgroups=self.settings.cgroups,
                    echo=echo,
                    pins=pins,
                    passthrough=passthrough,
                    removals=self._cgroup_removals,
                    checks=self._checks,
                    gate=gate,
                )
            finally:
                self._running.discard(scope)
                if not self._running:
                    self._idle.set()
        raise SandboxUnavailable(f"run {self.run_id} ended while the command ran; it was stopped")

    @property
    def trees(self) -> tuple[Path, ...]:
        """The host trees lent to this run's uid."""
        return tuple(Path(tree.path) for tree in self.lease.trees)

    @property
    def held(self) -> tuple[Path, ...]:
        """The host trees no other run may take while this one lives: those lent to it,
        and a workspace it only reads."""
        return (*self.trees, *self.unlent)

    def owns_peer(self, pid: int) -> bool:
        """Does process ``pid`` live in this run's network namespace (item 6)?"""
        try:
            info = os.stat(f"/proc/{pid}/ns/net")
        except OSError:
            return False  # gone already, or not visible: not ours to serve
        return (info.st_dev, info.st_ino) == self.netns_id

    async def close(self) -> dict[str, int | list[str]]:
        """Stop every command, wait for their cgroups' removal, give back the lease,
        remove the namespace; idempotent. Returns what was cleaned, for the audit: with
        ``cgroupsLeft`` (each naming its directory and why) when a command's cgroup
        could not be removed even once the run's processes were killed."""
        self._closed = True
        for scope in list(self._running):
            scope.cancel()
        if self._running:
            await self._idle.wait()
        failed = await self._cgroup_removals.wait()
        cleanup: dict[str, int | list[str]] = {**await trio.to_thread.run_sync(self._release)}
        # A removal can fail only while something of the run was still inside (stuck in
        # the kernel past REMOVE_TIMEOUT_S); every process of the uid is gone now.
        left = []
        for cgroup, first in failed:
            with trio.CancelScope(shield=True):
                try:
                    await cgroup.remove()
                except CgroupError as exc:
                    log.error(
                        "command_cgroup_left", run_id=self.run_id, first=first, error=str(exc)
                    )
                    left.append(str(exc))
        if left:
            cleanup["cgroupsLeft"] = left
        return cleanup

    def _release(self) -> dict[str, int]:
        try:
            killed = _kill_uid(self.user.uid)
            # Only now: while a process of the run lives, the folder is its cover's mount
            # point, and removing it would lift the cover in that process's namespace.
            self._remove_made_apps_folder()
            # The trees by the descriptors pinned at the start: given back wherever they
            # are now, never whatever their paths were swapped for.
            points = {point: fd for fd, point in self.pins}
            held = {s: points[p] for s, p in self.pinned.items() if p in points}
            returned = give_back(self.lease, held=held)
        finally:
            for fd, _ in self.pins:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.pins = ()
        removed = remove_run_netns(self.netns.name)
        return {"processesKilled": killed, "entriesReturned": returned, "netnsRemoved": removed}

    def _remove_made_apps_folder(self) -> None:
        """The apps folder made for this run goes once no process of it is left (while
        the workspace's descriptor is still held); best effort (see appsfolder)."""
        made = self.apps_folder.made if self.apps_folder is not None else None
        if made is None or not self.pins:
            return
        try:
            remove_made_folder(self.pins[0][0], made)
        except OSError as exc:
            log.warning("apps_folder_not_removed", run_id=self.run_id, error=str(exc))


class NamespaceAhead:
    """A run's network namespace, made in a worker thread while the run's start does
    other work (its workspace session opens meanwhile: most of that time is spent
    waiting for the disk), and taken by :meth:`RunSandbox.open` at the step where it
    would make one itself. So every refusal before that step is raised as before, and a
    creation that failed raises there, as it did.

    Resource handling: :meth:`make` runs as a task of the caller's nursery; the caller
    awaits :meth:`drop_untaken` (shielded) once the sandbox is open or refused, which
    waits for the creation and removes a namespace nobody took: none outlives a start
    that did not end in a sandbox holding it."""

    def __init__(self, run_id: str, prefix: str) -> None:
        self._run_id = run_id
        self._prefix = prefix
        self._done = trio.Event()
        self._handle: NetnsHandle | None = None
        self._error: Exception | None = None
        self._taken = False

    async def make(self) -> None:
        """The creation (a nursery task). Error handling: kept for :meth:`take`."""
        try:
            # Shielded: a creation is a few milliseconds, and one cut short could not
            # say whether it left a namespace behind.
            with trio.CancelScope(shield=True):
                self._handle = await trio.to_thread.run_sync(
                    lambda: create_run_netns(self._run_id, prefix=self._prefix)
                )
        except Exception as exc:  # NetnsError, ValueError: raised where it is taken
            self._error = exc
        finally:
            self._done.set()

    async def take(self, run_id: str) -> NetnsHandle:
        """The namespace of run ``run_id``, once made; the caller owns it from now on.

        Error handling: ValueError for another run's namespace (it stays with its
        maker, which removes it); the creation's own error
        (:class:`~gatewayd.sandbox.netns.NetnsError`...)."""
        if run_id != self._run_id:
            raise ValueError(
                f"run {run_id} was handed run {self._run_id}'s network namespace; "
                "each run's sandbox must have a namespace of its own"
            )
        await self._done.wait()
        if self._error is not None:
            raise self._error
        if self._handle is None or self._taken:
            raise RuntimeError(f"run {self._run_id}'s namespace was taken already")
        self._taken = True
        return self._handle

    async def drop_untaken(self) -> None:
        """Wait for the creation; remove the namespace if nobody took it. Never raises
        (a removal that fails is logged; the next daemon start sweeps it)."""
        await self._done.wait()
        if self._handle is None or self._taken:
            return
        name = self._handle.name
        try:
            await trio.to_thread.run_sync(remove_run_netns, name)
        except (NetnsError, ValueError) as exc:
            log.error("netns_not_removed", run_id=self._run_id, netns=name, error=str(exc))


class UidRecordAhead:
    """A run's uid recorded in its directory (the lease of no tree,
    :func:`~gatewayd.sandbox.lease.record_uid`) by a worker thread while the run's
    workspace session opens, instead of by the sandbox's lease after it: that record's
    fsync (a millisecond or more of a busy disk) is then off the start's path. Taken by
    :meth:`RunSandbox.open` at the lease's step: a sandbox that lends no tree (an
    overlay session's, whose base was lent before the mount) leaves the record as it
    is; one that lends trees records them over it, durable before the first chown, as
    ever. The uid named early changes nothing for recovery: the next start kills the
    uid's processes (none exist before the sandbox's first command) and removes the
    run's directory, as for a directory left after the sandbox was made.

    Resource handling: :meth:`make` runs as a task of the caller's nursery; the caller
    awaits :meth:`settled` (shielded) before the uid goes back to the pool or the run's
    directory is removed, so no record is written after either."""

    def __init__(self, run_dir: Path, user: HostUser) -> None:
        self._run_dir = run_dir
        self._user = user
        self._done = trio.Event()
        self._lease: Lease | None = None
        self._error: Exception | None = None

    async def make(self) -> None:
        """The record (a nursery task). Error handling: kept for :meth:`take`."""
        try:
            # Shielded: a write cut short could not say whether it left the record.
            with trio.CancelScope(shield=True):
                self._lease = await trio.to_thread.run_sync(record_uid, self._user, self._run_dir)
        except Exception as exc:  # OSError: raised where it is taken
            self._error = exc
        finally:
            self._done.set()

    async def take(self, user: HostUser) -> Lease:
        """The lease recorded, once written. Error handling: ValueError for another
        uid's record; the write's own error (OSError)."""
        if user != self._user:
            raise ValueError(
                f"uid {user.uid}'s sandbox was handed uid {self._user.uid}'s record; each "
                "run's directory names the uid of its own sandbox"
            )
        await self._done.wait()
        if self._error is not None:
            raise self._error
        if self._lease is None:
            raise RuntimeError(f"uid {self._user.uid}'s record was never made")
        return self._lease

    async def settled(self) -> None:
        """Wait until the write has ended, whatever its outcome. Never raises."""
        await self._done.wait()


def _plan(
    *,
    run_id: str,
    settings: SandboxSettings,
    workspace: Path,
    mounts: Sequence[PolicyMount],
    socket_path: Path,
    netns_path: Path,
    env_names: Sequence[str],
    image_dir: Path | None,
    limits: CommandLimits,
    command: Sequence[str],
    env_values: Mapping[str, str],
    pinned: Mapping[str, str] | None = None,
    services: Services | None = None,
    view: SandboxView | None = None,
    run_network: bool = True,
    egress_socket: str | None = None,
    checks: CheckedPlans | None = None,
) -> SandboxPlan:
    view = view or SandboxView()
    plan = build_plan(
        run_id=run_id,
        workspace_host=str(workspace),
        policy_paths=mounts,
        gateway_socket_host=str(socket_path),
        cogni_tool_host_dir=str(settings.cogni_tool_dir),
        command=command,
        extra_env_names=env_names,
        env_values=env_values,
        state_dir=str(settings.state_dir),
        netns_path=str(netns_path),
        layout=settings.layout,
        image_dir=None if image_dir is None else str(image_dir),
        tmpfs_bytes=limits.tmp_mb * _MIB,
        pinned=pinned,
        services=services,
        # Every command of every run: the workspace's apps folder is never seen.
        covered_trees=(str(workspace / APPS_DIR_NAME),),
        exposed_trees=tuple(str(tree) for tree in view.exposed),
        workspace_read_only=view.workspace_read_only,
        whole_workspace=view.whole_workspace,
        gateway_socket=view.gateway_socket,
        cwd=view.cwd,
        run_network=run_network,
        egress_socket=egress_socket,
    )
    if checks is None:
        validate(plan)
    else:
        checks.validate(plan)
    return plan


def _pin_sources(
    run_dir: Path, user: HostUser, sources: Sequence[Path], grants: Sequence[PathGrant]
) -> tuple[list[tuple[int, str]], dict[str, str]]:
    """Open every bind source once, now, and give each a run-private mount point.

    A grant's directory must still be the one the run was created with (its device and
    inode, pinned by the policy binding); the sandbox can rename a nested grant's path
    or put a symlink there before a later command, but bwrap then binds the directory
    opened here, never what the path has become.
    """
    expected = {grant.host_root: grant.root_id for grant in grants}
    points = run_dir / PIN_DIR
    points.mkdir(mode=0o700)
    os.chown(points, 0, user.gid)
    os.chmod(points, RUN_DIR_MODE)  # bwrap, as the run's uid, passes through to them
    pins: list[tuple[int, str]] = []
    pinned: dict[str, str] = {}
    try:
        for index, source in enumerate(sources):
            fd = os.open(source, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            pins.append((fd, str(points / str(index))))
            st = os.fstat(fd)
            want = expected.get(source)
            if want is not None and (st.st_dev, st.st_ino) != want:
                raise UnsafeMounts(
                    f"{source} is no longer the directory the run was created with; "
                    "refusing to bind whatever is there now"
                )
            (points / str(index)).mkdir(mode=0o700)
            pinned[str(source)] = str(points / str(index))
    except BaseException:
        for fd, _ in pins:
            os.close(fd)
        raise
    return pins, pinned


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def _kill_uid(uid: int) -> int:
    """SIGKILL every process of ``uid`` until none is left (a fork loop cannot outrun it:
    the uid's process limit caps how many new ones appear). Blocking, bounded."""
    killed = 0
    deadline = time.monotonic() + KILL_WAIT_S
    while pids := pids_of_uid(uid):
        if time.monotonic() > deadline:
            raise SandboxUnavailable(
                f"processes {pids[:10]} of sandbox uid {uid} survive SIGKILL (stuck in the "
                "kernel?); the lease stays recorded and is given back at the next start"
            )
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(KILL_POLL_S)  # SIGKILL is delivered asynchronously
    return killed


def sandbox_owned(pool_range: UidRange) -> Callable[[int], bool]:
    """Whether a uid is a sandbox's: of this daemon's pool range, or of any live daemon's on
    this host (another daemon's live run holds the tree). Blocking (reads the registry,
    at the first uid asked about: a lease with no tree asks about none)."""
    ranges: list[UidRange] = []

    def owned(uid: int) -> bool:
        if below_every_range(uid):
            return False  # a system user's: in no daemon's range, none read
        if not ranges:
            ranges.extend([pool_range, *sandbox_uid_ranges()])
        return any(uid in uids for uids in ranges)

    return owned


def sandbox_view(grants: Sequence[PathGrant], workspace: Path, view: SandboxView) -> SandboxView:
    """``view``, with the workspace read-only when a grant on the workspace itself (seen
    at /workspace, ``root: .``) is ``ro``: a policy author who writes ``ro`` there means
    that no command may change it, not only the fs tools. Without such a grant (only
    grants beneath it, or none) the workspace stays as ``view`` says: it is the
    commands' working directory, writable unless read-only is asked for."""
    if any(_is_workspace_grant(g, workspace) and g.mode is PathMode.RO for g in grants):
        return replace(view, workspace_read_only=True)
    return view


def _is_workspace_grant(grant: PathGrant, workspace: Path) -> bool:
    """The grant is the workspace itself at /workspace (which the workspace bind shows)."""
    return grant.host_root == workspace and str(grant.visible_root) == WORKSPACE


def _refuse_writable_workspace(grants: Sequence[PathGrant], workspace: Path) -> None:
    """A read-only workspace must not be writable under another name: a ``rw`` policy
    path whose directory is the workspace itself or holds it (``out`` a symlink to
    ``.``, planted by whoever owns the workspace) would bind it read-write, and lend
    it. Raises :class:`UnsafeMounts` before anything is pinned or lent."""
    for grant in grants:
        if grant.mode is PathMode.RW and workspace.is_relative_to(grant.host_root):
            raise UnsafeMounts(
                f"run refused: policy path {grant.name!r} ({grant.visible_root}, rw) is "
                f"{grant.host_root}, which is or holds the workspace {workspace} that the "
                "run sees read-only; it would make the whole workspace writable. Point "
                f"{grant.name!r} at a directory beneath the workspace (no symlink to it or "
                "above), or grant it ro"
            )


def _policy_mounts(grants: Sequence[PathGrant], workspace: Path) -> tuple[PolicyMount, ...]:
    """The policy paths bwrap mounts besides the workspace itself (whose bind follows the
    grant on it: see :func:`sandbox_view`). A grant rooted inside the workspace is
    mounted too: its mode (``ro``) must hold in the sandbox as well."""
    mounts = []
    for grant in grants:
        if _is_workspace_grant(grant, workspace):
            continue
        mounts.append(
            PolicyMount(host=str(grant.host_root), visible=str(grant.visible_root), mode=grant.mode)
        )
    return tuple(mounts)


def _open_run_dir(run_dir: Path, user: HostUser) -> None:
    """The run's directory becomes root:<run gid> 0710: the run's uid may pass through to
    its socket (bwrap resolves the bind source as that uid), nobody else may enter."""
    os.chown(run_dir, 0, user.gid)
    os.chmod(run_dir, RUN_DIR_MODE)


def _check_not_in_use(trees: Sequence[Path], busy: Sequence[Path]) -> None:
    """One tree serves one run at a time: two runs in one workspace would each see (and
    could rewrite) the other's work, and their leases would record each other's uid."""
    for tree in trees:
        for held in busy:
            if tree == held or held in tree.parents or tree in held.parents:
                raise WorkspaceInUse(
                    f"{tree} overlaps {held}, which a live run holds; one workspace (or "
                    "rw policy path) serves one run at a time: end that run or use another "
                    "directory"
                )


def install_cogni_tool(state_dir: Path) -> Path:
    """Copy the cogni-tool client into ``state_dir/cogni-tool`` (seen in the sandbox at
    /opt/cogni-tool) with a ``cogni-tool`` script; returns the directory.

    A copy, not the installed package: the sandbox must not see the daemon's virtualenv
    or source tree, and the copy's directory is root-owned and readable by every run uid.
    """
    target = state_dir / CLIENT_COPY_DIR
    staging = state_dir / f".{CLIENT_COPY_DIR}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    package = staging / "cogni_tool"
    package.mkdir(parents=True, mode=_PUBLIC_DIR_MODE)
    for source in sorted(_CLIENT_PACKAGE.glob("*.py")):
        shutil.copyfile(source, package / source.name)
        os.chmod(package / source.name, _PUBLIC_FILE_MODE)
    script = staging / COGNI_TOOL_SCRIPT
    # /usr/bin/python3: the one interpreter path every sandbox root has (the host's, or
    # an image's, which `gatewayd image check` requires); -I: no PYTHON* variable or
    # user site-packages can change what the client imports.
    script.write_text(
        "#!/usr/bin/python3 -I\n"
        f"# gatewayd's copy of the cogni-tool client, mounted at {COGNI_TOOL_VISIBLE_DIR}.\n"
        "import sys\n\n"
        f"sys.path.insert(0, {COGNI_TOOL_VISIBLE_DIR!r})\n"
        "from cogni_tool.cli import main  # noqa: E402\n\n"
        "sys.exit(main())\n"
    )
    os.chmod(script, _PUBLIC_DIR_MODE)
    for directory in (staging, package):
        os.chmod(directory, _PUBLIC_DIR_MODE)
    if target.exists():
        shutil.rmtree(target)
    os.rename(staging, target)
    return target


def clean_leftovers(runs_dir: Path, netns_prefix: str | None) -> dict[str, list[str]]:
    """What a crashed daemon left: give back leases recorded in run directories, remove
    those directories and every namespace with our prefix (None: this daemon makes no
    namespaces, so it leaves them alone). Call before any run starts. Blocking."""
    returned: list[str] = []
    removed_dirs: list[str] = []
    failed: list[str] = []
    if runs_dir.is_dir():
        for entry in sorted(runs_dir.iterdir()):
            if not entry.is_dir() or entry.is_symlink():
                continue
            try:
                lease = read_lease(entry)
                if lease is not None:
                    _kill_uid(lease.uid)  # none should be left (pdeathsig); make sure
                    give_back(lease)
                    returned.extend(tree.path for tree in lease.trees)
                remove_leftover_folder(entry)
            except Exception as exc:
                # One bad leftover must not stop the rest; its record stays, so the
                # next start tries again.
                failed.append(f"{entry.name}: {exc}")
                continue
            shutil.rmtree(entry, ignore_errors=True)
            removed_dirs.append(entry.name)
    namespaces: list[str] = []
    if netns_prefix is not None:
        try:
            namespaces = remove_stale_netns(netns_prefix)
        except NetnsError as exc:
            failed.append(str(exc))
    result = {"leasesReturned": returned, "runDirs": removed_dirs, "netns": namespaces}
    if failed:
        result["failed"] = failed
    return result
