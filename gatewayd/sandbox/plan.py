"""The bubblewrap plan: a frozen, typed list of setup steps, checked whole before anything runs.

Like bubblewrap itself, the launcher first builds every step (``build_plan``), then checks
the whole plan (``validate``), then renders it to one command line (``render_argv``) and
only then starts a process. Everything here is pure: the one function that looks at the
host, :func:`probe_host_layout`, only reads which system directories are symlinks and which
``/etc`` entries exist, and its result is passed in as a value.

Threat model of this layer: the process in the sandbox is hostile and tries to read host
secrets or write outside its workspace. The plan decides what it can *see*; the network
namespace (joined by the launcher, see ``netns_path``), seccomp and limits are other layers.

A bound tree may hold a tree the sandbox must never see (a run's plan: the workspace's
apps folder, :mod:`gatewayd.policy.appsfolder`): each such *covered tree* gets an empty,
read-only tmpfs wherever a bind shows it, mounted after every bind and made read-only at
once, so the sandbox sees an empty directory it cannot write, remove or rename (a mount
point), and a symlink it plants resolves, inside its own mount namespace, onto the cover.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from gatewayd.errors import GatewayError
from gatewayd.policy.paths import WORKSPACE_VISIBLE_ROOT, PathMode

# Debian's bubblewrap package puts it here; a fixed path, never a PATH lookup by the daemon.
BWRAP: Final = "/usr/bin/bwrap"
# Where the run's own socket appears inside the sandbox; cogni-tool finds it there (and in
# COGNI_GATEWAY_SOCK). Nothing else of /run is visible.
SANDBOX_SOCKET: Final = "/run/cogni/gateway.sock"
# Its name on the host, in the run's private directory ($STATE/runs/<run-id>/).
SOCKET_NAME: Final = "gateway.sock"
# The run's egress proxy socket (only when the policy turns the proxy on), beside it.
SANDBOX_EGRESS_SOCKET: Final = "/run/cogni/egress.sock"
EGRESS_SOCKET_NAME: Final = "egress.sock"
# A call's own egress proxy socket (a process tool's call granted domains), in the run's
# directory too: ``egress-<n>.sock``, bound at SANDBOX_EGRESS_SOCKET in that call's
# sandbox alone, which has a network namespace of its own (``run_network=False``).
CALL_EGRESS_SOCKET_PREFIX: Final = "egress-"
CALL_EGRESS_SOCKET_SUFFIX: Final = ".sock"
# The run's in-sandbox services (``cogni-tool serve``), on the run's own loopback: fixed
# ports, since every run has a network namespace of its own.
MODEL_ENDPOINT_PORT: Final = 11411
EGRESS_PROXY_PORT: Final = 3128
# What an SDK needs to find them. Always gatewayd's to set, never passed from the host
# (a host's OPENAI_API_KEY is a real key): a policy's env.allow cannot name them.
MODEL_ENV_NAMES: Final = ("OPENAI_BASE_URL", "OPENAI_API_KEY")
PROXY_ENV_NAMES: Final = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "http_proxy",
    "https_proxy",
    "NO_PROXY",
    "no_proxy",
)
SERVICE_ENV_NAMES: Final = MODEL_ENV_NAMES + PROXY_ENV_NAMES
# The SDK insists on a key; the endpoint ignores it (gatewayd holds the real one).
SANDBOX_API_KEY: Final = "sk-cogni-gateway-holds-the-key"
WORKSPACE: Final = str(WORKSPACE_VISIBLE_ROOT)
# cogni-tool's host directory is mounted here read-only and put first on PATH.
COGNI_TOOL_VISIBLE_DIR: Final = "/opt/cogni-tool"
# What a command or a process tool's call with a network of its own runs first:
# cogni-tool's egress bridge (the run's in-sandbox services use the same code), which
# listens on the port a run's sandbox has its proxy on, forwards to the call's own proxy
# socket, and execs the command in its own place.
EGRESS_BRIDGE: Final = (
    f"{COGNI_TOOL_VISIBLE_DIR}/cogni-tool",
    "serve",
    "--proxy-port",
    str(EGRESS_PROXY_PORT),
    "--egress-socket",
    SANDBOX_EGRESS_SOCKET,
    "--",
)
# gatewayd's copy of the client inside its state directory (the only state-directory
# path besides the run's socket that a plan may bind).
CLIENT_COPY_DIR: Final = "cogni-tool"
# In a run's directory: the mount points its pinned directories are attached to, in the
# launcher child's private mount namespace (never in the daemon's).
PIN_DIR: Final = "mnt"
# HOME is the private tmpfs: tools write dotfiles (~/.cache, ~/.npm) there and they vanish
# with the run, instead of landing in the workspace (which may be committed) or needing a
# /home that the acceptance tests require to be absent.
SANDBOX_HOME: Final = "/tmp"
SANDBOX_PATH: Final = f"{COGNI_TOOL_VISIBLE_DIR}:/usr/local/bin:/usr/bin:/bin"
# Not 0: inside its user namespace the process then holds no capabilities at all.
SANDBOX_UID: Final = 1000
SANDBOX_GID: Final = 1000
SANDBOX_USER: Final = "sandbox"
# The host's name says which machine this is; the sandbox does not need to know.
SANDBOX_HOSTNAME: Final = "cogni-sandbox"
# A tmpfs smaller than a page cannot hold a file.
MIN_TMPFS_BYTES: Final = 4096
# A covered tree's tmpfs holds nothing and is read-only: the smallest size is enough.
COVER_TMPFS_BYTES: Final = MIN_TMPFS_BYTES

# Options every plan gets, in this order (bubblewrap 0.8.0, Debian 12).
ISOLATION_OPTIONS: Final[tuple[str, ...]] = (
    "--unshare-user",  # uid 0 inside is nobody outside; required by --disable-userns
    "--unshare-pid",  # the sandbox sees only its own processes (not the daemon's environ)
    "--unshare-ipc",  # no System V IPC / POSIX mqueues shared with the host
    "--unshare-uts",  # its own hostname
    "--unshare-cgroup-try",  # its own cgroup root where the kernel offers it
    "--disable-userns",  # no nested user namespace: the usual first step of a kernel exploit
    "--die-with-parent",  # gatewayd dies -> the sandbox dies, never an orphan
    "--new-session",  # setsid: no TIOCSTI typing into the operator's terminal
    "--cap-drop",
    "ALL",  # no capability even inside the namespaces
)
# No --unshare-net here on purpose: gatewayd makes the run's netns (loopback only) and the
# launcher joins it before exec'ing bwrap, so the gateway can check peers against it.
# A plan without the run's network (``run_network=False``: a process tool's call) adds it:
# bwrap then gives the command a namespace of its own, inside the run's, with nothing but
# its own loopback, so nothing listening on the run's loopback (the run's own services:
# the egress proxy, the model endpoint) is reachable from it.
UNSHARE_NET: Final = "--unshare-net"

# Host top-level directories that hold the system. On Debian 12 (merged /usr) all but /usr
# are symlinks into /usr; elsewhere they are real directories. Mounted read-only.
SYSTEM_TOP_LEVEL: Final[tuple[str, ...]] = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")

# The /etc entries the sandbox sees, bound read-only from the host. Everything else of /etc
# is absent: an allowlist, because /etc is where hosts keep credentials under names nobody
# can list in advance (pip.conf and npmrc with index tokens, gitconfig credential helpers,
# ssl/private, shadow, ssh host keys, sudoers).
ETC_ALLOWLIST: Final[tuple[str, ...]] = (
    "nsswitch.conf",  # how glibc looks up users and hosts (files only in here)
    "ld.so.cache",  # the dynamic linker's library index
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",  # the time zone
    "alternatives",  # many /usr/bin commands are symlinks through /etc/alternatives
    "ssl/certs",  # CA bundle for TLS through gateway-run proxies (not ssl/private)
    "os-release",  # platform detection (pip, python's platform module)
    "protocols",  # getprotobyname
    "services",  # getservbyname
)
# Not bound, with the reason:
#   machine-id: a stable unique host identifier (systemd documents it as confidential);
#     nothing in a network-less, D-Bus-less sandbox needs it.
#   resolv.conf: there is no network to resolve on, and it names the host's DNS servers.
#   hostname, hosts: they name the host; a minimal hosts is generated instead.
#   passwd, group: they list the host's users; generated with the sandbox user instead.

# Host paths the sandbox never sees: no step may bind one of them, anything beneath one,
# or anything above one (binding / or /etc would expose them). The state directory, which
# holds every run's socket, is added per plan.
DENIED_HOST_TREES: Final[tuple[str, ...]] = (
    "/root",  # the daemon user's keys and cloud credentials
    "/run",  # host sockets (docker.sock, dbus, systemd): each one a way out
    "/proc",  # host processes and their environments; the sandbox gets a fresh /proc
    "/sys",
    "/dev",  # the sandbox gets a minimal /dev (--dev), never the host's
    "/boot",
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/sudoers",
    "/etc/sudoers.d",
    "/etc/ssh",
    "/etc/ssl/private",
)
# Host trees never exposed as a whole (nothing at or above them may be bound), while a
# directory the operator grants beneath them may be: workspaces commonly live in
# /home/<user>/... or /var/lib/..., and such a grant is bound at its own visible path, so
# the sandbox still sees neither /home nor /var.
HIDDEN_HOST_TREES: Final[tuple[str, ...]] = ("/home", "/var")

# Destinations that hold the system: a writable bind on or under one is refused.
SYSTEM_DESTINATIONS: Final[tuple[str, ...]] = (
    "/usr",
    *(f"/{name}" for name in SYSTEM_TOP_LEVEL),
    "/etc",
    "/proc",
    "/dev",
    "/sys",
    COGNI_TOOL_VISIBLE_DIR,
)

# Environment names passed through from the caller's values when present; PATH and HOME
# are set to sandbox values, never copied from the daemon.
PASSED_ENV_NAMES: Final[tuple[str, ...]] = ("LANG", "TERM")
FIXED_ENV_NAMES: Final[tuple[str, ...]] = ("PATH", "HOME", "COGNI_GATEWAY_SOCK", "COGNI_RUN_ID")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class PlanError(GatewayError):
    """The sandbox plan is unsafe or malformed; nothing was started (a gatewayd or
    operator configuration fault, never the sandbox's)."""


# --- the setup steps -------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RoBind:
    """Bind host ``src`` read-only at ``dest``; from ``via`` when set (see ``Bind``)."""

    src: str
    dest: str
    via: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Bind:
    """Bind host ``src`` read-write at ``dest``.

    ``via``: the run-private mount point the launcher attached ``src``'s pinned directory
    to (``STATE/runs/<id>/mnt/<n>``). bwrap binds from there: a path inside the workspace
    can be renamed or replaced by a symlink by the sandbox between two commands, the
    pinned directory cannot. ``src`` stays the host path, for the checks and messages.
    """

    src: str
    dest: str
    via: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RoBindData:
    """A file made from ``data`` (passed to bwrap on a file descriptor), read-only at ``dest``."""

    data: bytes
    dest: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Tmpfs:
    """A private tmpfs at ``dest``; ``size_bytes`` caps it (None: the kernel's default,
    half of RAM, which RLIMIT_AS does not count)."""

    dest: str
    size_bytes: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Proc:
    dest: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Dev:
    dest: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Symlink:
    """A symlink at ``dest`` pointing to ``target`` (made in the sandbox, not bound)."""

    target: str
    dest: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RemountRo:
    """Make the (already mounted) ``dest`` read-only; not recursive."""

    dest: str


Step = RoBind | Bind | RoBindData | Tmpfs | Proc | Dev | Symlink | RemountRo


@dataclass(frozen=True, slots=True, kw_only=True)
class HostLayout:
    """What :func:`probe_host_layout` found: which system top-level names are symlinks
    (with their targets) or directories, and which allowlisted /etc entries exist."""

    system_links: tuple[tuple[str, str], ...] = ()  # ("bin", "usr/bin")
    system_dirs: tuple[str, ...] = ()  # ("lib64",) where not merged
    etc_entries: tuple[str, ...] = ()  # subset of ETC_ALLOWLIST


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyMount:
    """A policy path: host directory ``host`` seen at ``visible`` with ``mode``."""

    host: str
    visible: str
    mode: PathMode


@dataclass(frozen=True, slots=True, kw_only=True)
class Services:
    """Which of the run's in-sandbox services it has: fixed at run start by its policy."""

    model_endpoint: bool = False
    egress_proxy: bool = False

    def env(self) -> dict[str, str]:
        """The variables pointing clients at them."""
        env: dict[str, str] = {}
        if self.model_endpoint:
            env["OPENAI_BASE_URL"] = f"http://127.0.0.1:{MODEL_ENDPOINT_PORT}/v1"
            env["OPENAI_API_KEY"] = SANDBOX_API_KEY
        if self.egress_proxy:
            proxy = f"http://127.0.0.1:{EGRESS_PROXY_PORT}"
            for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
                env[name] = proxy
        if env:
            # The services themselves are on loopback: never through the proxy.
            env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost,::1"
        return env


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxPlan:
    """Everything bwrap needs for one sandboxed command, in order."""

    run_id: str
    steps: tuple[Step, ...]
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    extra_env_names: tuple[str, ...]
    uid: int
    gid: int
    hostname: str
    cwd: str
    # The run's network namespace: the launcher enters it before exec'ing bwrap.
    netns_path: str
    # gatewayd's state directory: never visible, except this run's socket in it. Its
    # real path (no symlink, no '..'), as every bind source is: they are compared as
    # strings, so a symlink in either would hide the overlap (SandboxSettings checks it).
    state_dir: str
    services: Services = Services()
    # Host trees inside bound trees that the sandbox never sees (real paths): each is
    # covered by an empty read-only tmpfs where a bind shows it (see the module doc).
    covered_trees: tuple[str, ...] = ()
    # Trees beneath a covered tree that this plan may still bind (real paths): an app's
    # own folder, in the sandbox of that app alone. Each lies strictly beneath a covered
    # tree; everything else of the covered tree stays hidden.
    exposed_trees: tuple[str, ...] = ()
    # Whether the run's socket is in the sandbox (an app's sandbox has none: the app's
    # calls are its conversation's, made by gatewayd, counted and limited there).
    gateway_socket: bool = True
    # Whether the command shares the run's network namespace (False: one of its own with
    # loopback only, :data:`UNSHARE_NET`; no service of the run can then be reached).
    run_network: bool = True
    # The host socket bound at SANDBOX_EGRESS_SOCKET when ``services.egress_proxy``: None,
    # the run's own (beside its socket); else a call's own proxy socket, only in a plan
    # with a network namespace of its own (the command starts its own bridge there).
    egress_socket: str | None = None

    @property
    def data_steps(self) -> tuple[RoBindData, ...]:
        """The steps whose content the launcher must hand to bwrap on file descriptors."""
        return tuple(step for step in self.steps if isinstance(step, RoBindData))


# --- building ---------------------------------------------------------------------------


def probe_host_layout(root: Path = Path("/")) -> HostLayout:
    """Look at the host (the only I/O of this module): merged-/usr symlinks, real system
    directories, and which :data:`ETC_ALLOWLIST` entries exist under ``root``."""
    links: list[tuple[str, str]] = []
    dirs: list[str] = []
    for name in SYSTEM_TOP_LEVEL:
        path = root / name
        if path.is_symlink():
            links.append((name, os.readlink(path)))
        elif path.is_dir():
            dirs.append(name)
    etc = tuple(entry for entry in ETC_ALLOWLIST if (root / "etc" / entry).exists())
    return HostLayout(system_links=tuple(links), system_dirs=tuple(dirs), etc_entries=etc)


def build_plan(
    *,
    run_id: str,
    workspace_host: str,
    policy_paths: Sequence[PolicyMount],
    gateway_socket_host: str,
    cogni_tool_host_dir: str,
    command: Sequence[str],
    extra_env_names: Sequence[str],
    env_values: Mapping[str, str],
    state_dir: str,
    netns_path: str,
    layout: HostLayout,
    image_dir: str | None = None,
    tmpfs_bytes: int | None = None,
    pinned: Mapping[str, str] | None = None,
    services: Services | None = None,
    covered_trees: Sequence[str] = (),
    exposed_trees: Sequence[str] = (),
    workspace_read_only: bool = False,
    whole_workspace: bool = True,
    gateway_socket: bool = True,
    cwd: str = WORKSPACE,
    run_network: bool = True,
    egress_socket: str | None = None,
) -> SandboxPlan:
    """The plan for ``command`` in run ``run_id``; call :func:`validate` on it before use.

    ``env_values`` is where allowlisted values come from (LANG, TERM and
    ``extra_env_names``); a name not listed is never passed, whatever the mapping holds.
    With ``image_dir`` the sandbox's root is that directory (read-only) instead of the
    host's system directories; it must contain the mount points (/workspace, /run/cogni,
    /opt/cogni-tool, and the policy paths' parents), since bwrap cannot create them there.

    ``tmpfs_bytes`` caps /tmp and /dev/shm each (None: the kernel's default).
    ``pinned`` maps a workspace or policy path to the run-private mount point bwrap binds
    it from (see :class:`Bind`). ``services`` adds the egress socket beside the run's and
    the variables naming the in-sandbox services. ``covered_trees`` (real host paths) are
    covered by an empty read-only tmpfs wherever a bind of the plan shows them;
    ``exposed_trees``, each beneath one of them, may still be bound (an app's own folder
    in the app's sandbox). ``workspace_read_only``: the workspace is bound read-only (an
    app's sandbox, which sees its caller's workspace and writes only its data folder);
    ``whole_workspace`` False: only the policy paths beneath /workspace are shown there,
    on an empty read-only tmpfs (an app whose caller may read only parts of its
    workspace). ``gateway_socket`` False: the run's socket is not in the sandbox.
    ``cwd``: where the command starts (default: the workspace). ``run_network`` False:
    a network namespace of the command's own (loopback only) instead of the run's; the
    run's services are then out of reach, so ``services`` must name none, except the
    egress proxy with ``egress_socket``: a call's own proxy socket (host path) bound at
    :data:`SANDBOX_EGRESS_SOCKET`, whose bridge the command itself starts in its own
    namespace (the proxy variables then point at it).

    Error handling: raises :class:`PlanError` for an unusable run id, environment name or
    value, a reserved extra name, a tmpfs size under one page, or a system symlink
    pointing outside /usr.
    """
    pinned = dict(pinned or {})
    if tmpfs_bytes is not None and tmpfs_bytes < MIN_TMPFS_BYTES:
        raise PlanError(f"tmpfs size {tmpfs_bytes} is under one page ({MIN_TMPFS_BYTES} bytes)")
    if not _RUN_ID.fullmatch(run_id):
        raise PlanError(f"run id {run_id!r} is not 1-64 characters of [A-Za-z0-9_-]")
    if not command:
        raise PlanError("the command is empty; give at least the program to run")
    steps: list[Step] = []
    if image_dir is None:
        steps.extend(_system_steps(layout))
        steps.extend(
            RoBind(src=f"/etc/{entry}", dest=f"/etc/{entry}") for entry in layout.etc_entries
        )
    else:
        steps.append(RoBind(src=image_dir, dest="/"))
    steps.extend(
        (
            RoBindData(data=_passwd(), dest="/etc/passwd"),
            RoBindData(data=_group(), dest="/etc/group"),
            RoBindData(data=_hosts(), dest="/etc/hosts"),
            Proc(dest="/proc"),
            Dev(dest="/dev"),
            # POSIX shared memory (multiprocessing, some databases) needs a writable
            # /dev/shm; /dev itself is made read-only at the end.
            Tmpfs(dest="/dev/shm", size_bytes=tmpfs_bytes),
            Tmpfs(dest="/tmp", size_bytes=tmpfs_bytes),
            (
                (RoBind if workspace_read_only else Bind)(
                    src=workspace_host, dest=WORKSPACE, via=pinned.get(workspace_host)
                )
                if whole_workspace
                else Tmpfs(dest=WORKSPACE, size_bytes=COVER_TMPFS_BYTES)
            ),
        )
    )
    # Parents before children: a policy path under /workspace (or under another policy
    # path) must be mounted after it, or the later parent mount would hide it.
    for mount in sorted(policy_paths, key=lambda m: (m.visible.count("/"), m.visible)):
        kind = Bind if mount.mode is PathMode.RW else RoBind
        steps.append(kind(src=mount.host, dest=mount.visible, via=pinned.get(mount.host)))
    if not whole_workspace:
        # The mount points the policy paths needed are made: nothing more in it.
        steps.append(RemountRo(dest=WORKSPACE))
    # After every bind that may show them (and no mount after them lies beneath one).
    for cover in sorted(set(_covers(steps, covered_trees)), key=lambda d: (d.count("/"), d)):
        steps.extend((Tmpfs(dest=cover, size_bytes=COVER_TMPFS_BYTES), RemountRo(dest=cover)))
    steps.append(RoBind(src=cogni_tool_host_dir, dest=COGNI_TOOL_VISIBLE_DIR))
    if gateway_socket:
        steps.append(RoBind(src=gateway_socket_host, dest=SANDBOX_SOCKET))
    services = services or Services()
    if services.egress_proxy:
        egress = egress_socket or posixpath.join(
            posixpath.dirname(gateway_socket_host), EGRESS_SOCKET_NAME
        )
        steps.append(RoBind(src=egress, dest=SANDBOX_EGRESS_SOCKET))
    # Last: the root tmpfs bwrap builds (and the directories it made for mount points) is
    # writable otherwise, and so is the tmpfs --dev makes; the mounts below them keep
    # their own modes (remounting is not recursive).
    steps.append(RemountRo(dest="/dev"))
    steps.append(RemountRo(dest="/"))
    return SandboxPlan(
        run_id=run_id,
        steps=tuple(steps),
        command=tuple(command),
        env=_build_env(run_id, extra_env_names, env_values, services),
        extra_env_names=tuple(extra_env_names),
        uid=SANDBOX_UID,
        gid=SANDBOX_GID,
        hostname=SANDBOX_HOSTNAME,
        cwd=cwd,
        netns_path=netns_path,
        state_dir=state_dir,
        services=services,
        covered_trees=tuple(covered_trees),
        exposed_trees=tuple(exposed_trees),
        gateway_socket=gateway_socket,
        run_network=run_network,
        egress_socket=egress_socket,
    )


def _covers(steps: Sequence[Step], covered_trees: Sequence[str]) -> list[str]:
    """Where each covered tree appears in the sandbox: beneath the destination of every
    bind whose source holds it."""
    covers = []
    for step in steps:
        if not isinstance(step, RoBind | Bind):
            continue
        for tree in covered_trees:
            if tree != step.src and _is_within(tree, step.src):
                rest = tree[len(step.src) :].lstrip("/")
                covers.append(posixpath.join(step.dest, rest))
    return covers


def _system_steps(layout: HostLayout) -> list[Step]:
    steps: list[Step] = [RoBind(src="/usr", dest="/usr")]
    for name, target in layout.system_links:
        if not _is_within(posixpath.normpath(posixpath.join("/", target)), "/usr"):
            raise PlanError(
                f"/{name} is a symlink to {target!r}; only symlinks into /usr (merged /usr) "
                "are mirrored into the sandbox"
            )
        steps.append(Symlink(target=target, dest=f"/{name}"))
    steps.extend(RoBind(src=f"/{name}", dest=f"/{name}") for name in layout.system_dirs)
    return steps


def _build_env(
    run_id: str, extra_env_names: Sequence[str], env_values: Mapping[str, str], services: Services
) -> tuple[tuple[str, str], ...]:
    for name in extra_env_names:
        if name in FIXED_ENV_NAMES or name in SERVICE_ENV_NAMES:
            raise PlanError(
                f"environment name {name!r} is set by gatewayd and cannot be passed through; "
                f"reserved: {', '.join((*FIXED_ENV_NAMES, *SERVICE_ENV_NAMES))}"
            )
        if not _ENV_NAME.fullmatch(name):
            raise PlanError(
                f"environment name {name!r} is not a valid name; allowed: [A-Za-z_][A-Za-z0-9_]*"
            )
    env = {
        "PATH": SANDBOX_PATH,
        "HOME": SANDBOX_HOME,
        "COGNI_GATEWAY_SOCK": SANDBOX_SOCKET,
        "COGNI_RUN_ID": run_id,
        **services.env(),
    }
    for name in (*PASSED_ENV_NAMES, *extra_env_names):
        if name in env_values:
            value = env_values[name]
            if "\0" in value:
                raise PlanError(f"environment variable {name} holds a NUL byte; values are text")
            env[name] = value
    return tuple(env.items())


def _passwd() -> bytes:
    return (
        "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        f"{SANDBOX_USER}:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox:{SANDBOX_HOME}:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    ).encode()


def _group() -> bytes:
    return (f"root:x:0:\n{SANDBOX_USER}:x:{SANDBOX_GID}:\nnogroup:x:65534:\n").encode()


def _hosts() -> bytes:
    return b"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"


# --- checking ---------------------------------------------------------------------------


def describe(index: int, step: Step) -> str:
    """How a message names a step: its position and the bwrap options it becomes."""
    return f"step {index} ({' '.join(_step_args(step, fd=None))})"


def validate(plan: SandboxPlan) -> None:
    """Check the whole plan; raise :class:`PlanError` naming the first offending step.
    Never reads ``plan.command`` (:class:`CheckedPlans` relies on it).

    Checks: every path absolute and normalized; no destination mounted twice; parents
    mounted before children; no writable bind on a system path; no source at, beneath or
    above a denied host tree (or the state directory), nor at or above a hidden one; the
    socket is exactly this run's, at exactly :data:`SANDBOX_SOCKET` (and its egress socket
    at :data:`SANDBOX_EGRESS_SOCKET` exactly when the run has the proxy), and nothing else
    of /run is mounted; no source lies at or beneath a covered tree, and wherever a bind
    shows one it is covered (a tmpfs there after that bind, made read-only by the very
    next step, with no mount beneath it); the environment holds only allowlisted names
    with gatewayd's values.
    """
    if not _RUN_ID.fullmatch(plan.run_id):
        raise PlanError(f"run id {plan.run_id!r} is not 1-64 characters of [A-Za-z0-9_-]")
    for label, path in (("state directory", plan.state_dir), ("netns path", plan.netns_path)):
        if not _is_clean_absolute(path):
            raise PlanError(f"{label} {path!r} must be an absolute, normalized path")
    if not _is_clean_absolute(plan.cwd):
        raise PlanError(f"working directory {plan.cwd!r} must be an absolute, normalized path")
    seen: dict[str, int] = {}
    sockets = {SANDBOX_SOCKET: 0, SANDBOX_EGRESS_SOCKET: 0}
    for index, step in enumerate(plan.steps):
        name = describe(index, step)
        _check_paths(name, step)
        if isinstance(step, RemountRo):
            continue
        if step.dest in seen:
            raise PlanError(
                f"{name} mounts {step.dest} again (already step {seen[step.dest]}); "
                "each destination may be mounted once"
            )
        if step.dest == "/" and index != 0:
            raise PlanError(f"{name} mounts the root; only the first step may")
        for earlier_dest, earlier_index in seen.items():
            if _is_within(earlier_dest, step.dest):
                raise PlanError(
                    f"{name} mounts {step.dest} over step {earlier_index}'s {earlier_dest}, "
                    "hiding it; mount parents before children"
                )
        seen[step.dest] = index
        if step.dest in sockets:
            sockets[step.dest] += 1
            _check_socket(plan, name, step)
            continue
        if _is_within(step.dest, "/run"):
            raise PlanError(
                f"{name} mounts under /run; the only thing there is the run's socket at "
                f"{SANDBOX_SOCKET}"
            )
        if isinstance(step, Bind) and any(_is_within(step.dest, s) for s in SYSTEM_DESTINATIONS):
            raise PlanError(
                f"{name} binds a system path writable; system paths are read-only: "
                f"{', '.join(SYSTEM_DESTINATIONS)}"
            )
        if isinstance(step, RoBind) and _is_client_copy(plan, step):
            continue  # gatewayd's own read-only copy of cogni-tool, in the state directory
        if isinstance(step, RoBind | Bind):
            _check_source(plan, name, step.src)
            if step.via is not None:
                _check_via(plan, name, step.via)
    _check_covers(plan)
    if sockets[SANDBOX_SOCKET] != int(plan.gateway_socket):
        raise PlanError(
            f"the plan mounts the run's socket {sockets[SANDBOX_SOCKET]} times; it must "
            + (f"mount it once, at {SANDBOX_SOCKET}" if plan.gateway_socket else "not mount it")
        )
    egress = sockets[SANDBOX_EGRESS_SOCKET]
    if egress != int(plan.services.egress_proxy):
        raise PlanError(
            f"the plan mounts the egress socket {egress} times; it must mount it "
            f"{'once' if plan.services.egress_proxy else 'never'} "
            f"(the run {'has' if plan.services.egress_proxy else 'has no'} egress proxy)"
        )
    own_egress = plan.services == Services(egress_proxy=True) and plan.egress_socket is not None
    if not plan.run_network and plan.services != Services() and not own_egress:
        raise PlanError(
            "the plan gives the command a network namespace of its own but names the run's "
            "services, which listen on the run's loopback and cannot be reached from it"
        )
    if plan.egress_socket is not None and plan.run_network:
        raise PlanError(
            "the plan binds a call's own egress socket into the run's network namespace, "
            "where the run's bridge serves the run's proxy; a call's own proxy is only for "
            "a command with a network namespace of its own"
        )
    _check_env(plan)


class CheckedPlans:
    """:func:`validate` for the plans of one owner (a run's sandbox), passing at once a
    plan that equals the last one it validated in everything but its command.

    Why: a run's commands reuse its last plan with a new command
    (:meth:`~gatewayd.sandbox.session.RunSandbox.plan`), and every plan is checked
    again just before its start (:func:`render_argv`); the whole check took 0.5 to
    0.9 ms of each command's start here. :func:`validate` never reads the
    command (``build_plan`` refuses an empty one), so such a plan is valid exactly when
    the one it was made from is. Only a plan this object validated itself is
    remembered: nothing a caller hands over is taken for valid unchecked.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: SandboxPlan | None = None

    def validate(self, plan: SandboxPlan) -> None:
        """Check ``plan`` as :func:`validate` does (PlanError naming the first offending
        step), unless it equals the last plan passed here but for its command."""
        last = self._last
        if last is not None and replace(last, command=plan.command) == plan:
            return
        validate(plan)
        self._last = plan


def _check_paths(name: str, step: Step) -> None:
    if not _is_clean_absolute(step.dest):
        raise PlanError(
            f"{name}: destination {step.dest!r} must be absolute and normalized "
            "(no '..', '.', '//' or trailing '/')"
        )
    if isinstance(step, RoBind | Bind) and not _is_clean_absolute(step.src):
        raise PlanError(
            f"{name}: source {step.src!r} must be absolute and normalized "
            "(no '..', '.', '//' or trailing '/')"
        )
    if isinstance(step, Symlink) and "\0" in step.target:
        raise PlanError(f"{name}: symlink target holds a NUL byte")


def _check_socket(plan: SandboxPlan, name: str, step: Step) -> None:
    if not isinstance(step, RoBind | Bind):
        raise PlanError(f"{name} puts something other than a bind of the run's socket there")
    socket_name = SOCKET_NAME if step.dest == SANDBOX_SOCKET else EGRESS_SOCKET_NAME
    run_dir = posixpath.join(plan.state_dir, "runs", plan.run_id)
    expected = posixpath.join(run_dir, socket_name)
    if step.dest == SANDBOX_EGRESS_SOCKET and plan.egress_socket is not None:
        # A call's own proxy socket: exactly the one the plan names, in this run's directory.
        number = posixpath.basename(step.src)[len(CALL_EGRESS_SOCKET_PREFIX) :]
        number = number.removesuffix(CALL_EGRESS_SOCKET_SUFFIX)
        if (
            step.src == plan.egress_socket
            and posixpath.dirname(step.src) == run_dir
            and posixpath.basename(step.src)
            == f"{CALL_EGRESS_SOCKET_PREFIX}{number}{CALL_EGRESS_SOCKET_SUFFIX}"
            and number.isdigit()
            and number.isascii()
        ):
            return
        expected = posixpath.join(
            run_dir, f"{CALL_EGRESS_SOCKET_PREFIX}<n>{CALL_EGRESS_SOCKET_SUFFIX}"
        )
    if step.src != expected:
        raise PlanError(
            f"{name} binds {step.src} as the run's socket; only this run's socket "
            f"{expected} may be bound there"
        )


def _is_client_copy(plan: SandboxPlan, step: RoBind) -> bool:
    """The one source inside the state directory a plan may bind: gatewayd's copy of
    the cogni-tool client (``STATE/cogni-tool``), read-only at its fixed place."""
    return step.dest == COGNI_TOOL_VISIBLE_DIR and step.src == posixpath.join(
        plan.state_dir, CLIENT_COPY_DIR
    )


def _check_via(plan: SandboxPlan, name: str, via: str) -> None:
    """A pinned source is one of this run's own mount points, nothing else."""
    parent = posixpath.join(plan.state_dir, "runs", plan.run_id, PIN_DIR)
    if posixpath.dirname(via) != parent or not posixpath.basename(via).isdigit():
        raise PlanError(
            f"{name} binds from {via}; a pinned source must be one of this run's mount "
            f"points {parent}/<n>"
        )


def _check_source(plan: SandboxPlan, name: str, src: str) -> None:
    """No source at, beneath or above a denied tree or the state directory, none at or
    above a hidden one. Strings only: the plan is pure, so ``src`` and ``state_dir``
    must be real paths (the run's paths are resolved when it is created, the state
    directory when the daemon starts), and the lease's check on the directory itself
    (:meth:`~gatewayd.sandbox.lendable.LendableRoots.judge`) stands behind this one."""
    for denied in (*DENIED_HOST_TREES, plan.state_dir):
        if _is_within(src, denied) or _is_within(denied, src):
            raise PlanError(
                f"{name} exposes {denied}, which the sandbox never sees; bind a directory "
                f"that neither contains nor lies in any of: {', '.join(DENIED_HOST_TREES)}, "
                f"{plan.state_dir}"
            )
    for hidden in HIDDEN_HOST_TREES:
        if _is_within(hidden, src):
            raise PlanError(
                f"{name} exposes all of {hidden}; bind the one directory beneath it the run "
                "needs instead"
            )


def _check_covers(plan: SandboxPlan) -> None:
    """Every covered tree is hidden wherever a bind shows it, and never bound itself; a
    writable bind shows one only as a child of its own root (a mount point, which the
    sandbox cannot rename), never deeper: the sandbox could rename a directory on the
    way (``/data/up/ws`` to ``/data/up/elsewhere``), and the host's tools, which find
    the tree by its path, would no longer know where it is."""
    if not plan.covered_trees:
        return
    for tree in plan.covered_trees:
        if not _is_clean_absolute(tree):
            raise PlanError(f"covered tree {tree!r} must be an absolute, normalized path")
    for shown in plan.exposed_trees:
        if not _is_clean_absolute(shown) or not any(
            shown != tree and _is_within(shown, tree) for tree in plan.covered_trees
        ):
            raise PlanError(
                f"exposed tree {shown!r} must be an absolute, normalized path strictly "
                "beneath a covered tree"
            )
    for index, step in enumerate(plan.steps):
        if not isinstance(step, RoBind | Bind):
            continue
        in_exposed = any(_is_within(step.src, tree) for tree in plan.exposed_trees)
        for tree in plan.covered_trees:
            if _is_within(step.src, tree) and not in_exposed:
                raise PlanError(
                    f"{describe(index, step)} binds {step.src}, at or beneath {tree}, which "
                    "the sandbox never sees"
                )
            below = tree[len(step.src) :].strip("/")
            if isinstance(step, Bind) and _is_within(tree, step.src) and "/" in below:
                raise PlanError(
                    f"{describe(index, step)} is writable and holds {tree}, a covered tree, "
                    f"below a directory the sandbox could rename ({below.split('/')[0]}): "
                    "bind it read-only"
                )
        for cover in _covers([step], plan.covered_trees):
            _check_cover(plan, index, step, cover)


def _check_cover(plan: SandboxPlan, bind_index: int, bind: Step, cover: str) -> None:
    """After step ``bind_index`` (which shows a covered tree at ``cover``): a tmpfs at
    ``cover``, the next step making it read-only, and no later mount at or beneath it."""
    steps = plan.steps
    at = next(
        (i for i in range(bind_index + 1, len(steps)) if steps[i].dest == cover),
        None,
    )
    what = f"{describe(bind_index, bind)} shows {cover}, a covered tree the sandbox never sees"
    if at is None or not isinstance(steps[at], Tmpfs):
        raise PlanError(f"{what}; the plan must cover it with a tmpfs after that bind")
    if at + 1 >= len(steps) or steps[at + 1] != RemountRo(dest=cover):
        raise PlanError(f"{what}; its tmpfs must be made read-only by the very next step")
    for index in range(at + 2, len(steps)):
        if _is_within(steps[index].dest, cover):
            raise PlanError(
                f"{describe(index, steps[index])} mounts at or beneath {cover}, through the "
                "cover of a tree the sandbox never sees"
            )


def _check_env(plan: SandboxPlan) -> None:
    service_env = plan.services.env()
    allowed = (*FIXED_ENV_NAMES, *service_env, *PASSED_ENV_NAMES, *plan.extra_env_names)
    names = [name for name, _ in plan.env]
    if len(set(names)) != len(names):
        raise PlanError("the environment names a variable twice; each name is set once")
    values = dict(plan.env)
    for name, value in plan.env:
        if name not in allowed:
            raise PlanError(
                f"environment variable {name} is not on the allowlist; allowed: "
                f"{', '.join(allowed)}"
            )
        if not _ENV_NAME.fullmatch(name) or "\0" in value:
            raise PlanError(f"environment variable {name!r} has an invalid name or value")
    fixed = {
        "PATH": SANDBOX_PATH,
        "HOME": SANDBOX_HOME,
        "COGNI_GATEWAY_SOCK": SANDBOX_SOCKET,
        "COGNI_RUN_ID": plan.run_id,
        **service_env,
    }
    for name, value in fixed.items():
        if values.get(name) != value:
            raise PlanError(f"environment variable {name} must be {value!r}, set by gatewayd")


def _is_clean_absolute(path: str) -> bool:
    return (
        path.startswith("/")
        and posixpath.normpath(path) == path
        and not path.startswith("//")
        and "\0" not in path
        and "\n" not in path
    )


def _is_within(path: str, root: str) -> bool:
    """``path`` is ``root`` or lies beneath it (both clean absolute paths)."""
    return root in ("/", path) or path.startswith(root + "/")


# --- rendering --------------------------------------------------------------------------


def render_argv(
    plan: SandboxPlan,
    *,
    bwrap: str = "bwrap",
    data_fds: Mapping[str, int] | None = None,
    checks: CheckedPlans | None = None,
) -> list[str]:
    """The bwrap command line for ``plan``, validated first (by ``checks`` when given:
    the owner's :class:`CheckedPlans`, which passes a plan equal but for its command to
    one it validated).

    ``data_fds`` maps each :attr:`SandboxPlan.data_steps` destination to the file
    descriptor number the child will find that step's ``data`` on (a memfd or pipe the
    launcher passes with ``pass_fds``); bwrap reads each to its end.

    Error handling: raises :class:`PlanError` if the plan does not validate or a data
    step has no descriptor.
    """
    if checks is None:
        validate(plan)
    else:
        checks.validate(plan)
    fds = dict(data_fds or {})
    argv = [bwrap, *ISOLATION_OPTIONS]
    if not plan.run_network:
        argv.append(UNSHARE_NET)
    argv += ["--uid", str(plan.uid), "--gid", str(plan.gid), "--hostname", plan.hostname]
    # --clearenv acts when parsed, so it comes before every --setenv.
    argv.append("--clearenv")
    for name, value in plan.env:
        argv += ["--setenv", name, value]
    for index, step in enumerate(plan.steps):
        fd: int | None = None
        if isinstance(step, RoBindData):
            if step.dest not in fds:
                raise PlanError(
                    f"{describe(index, step)} has no file descriptor; pass data_fds for: "
                    f"{', '.join(s.dest for s in plan.data_steps)}"
                )
            fd = fds[step.dest]
        argv += _step_args(step, fd=fd)
    argv += ["--chdir", plan.cwd, "--", *plan.command]
    return argv


def _step_args(step: Step, *, fd: int | None) -> list[str]:
    match step:
        case RoBind(src=src, dest=dest, via=via):
            return ["--ro-bind", via or src, dest]
        case Bind(src=src, dest=dest, via=via):
            return ["--bind", via or src, dest]
        case RoBindData(dest=dest):
            return ["--ro-bind-data", "FD" if fd is None else str(fd), dest]
        case Tmpfs(dest=dest, size_bytes=None):
            return ["--tmpfs", dest]
        case Tmpfs(dest=dest, size_bytes=size):
            return ["--size", str(size), "--tmpfs", dest]
        case Proc(dest=dest):
            return ["--proc", dest]
        case Dev(dest=dest):
            return ["--dev", dest]
        case Symlink(target=target, dest=dest):
            return ["--symlink", target, dest]
        case RemountRo(dest=dest):
            return ["--remount-ro", dest]
