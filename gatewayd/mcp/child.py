"""What a declared MCP server's instance may see and do: never more than its declaration,
and for a per-run server never more than the run that calls it.

Each instance is a run of its own (the run machinery gives it a uid of its own, a network
namespace of its own, the egress proxy when it may reach anything, cleanup, and the audit
of its creation and end):

* **per_run**: a child run of its caller. Of the caller's workspace it sees only the
  declared ``workspace_paths``, each at ``/workspace/<path>``, with the declared mode
  intersected with the caller's grant there (invariant CHILD_NEVER_EXCEEDS_PARENT): a
  path the caller may only read is read-only, one it cannot read is refused.
* **shared**: a run of gatewayd's own (no parent) whose workspace is an empty private
  directory; it sees no run's files.

Both: its ``read_only_paths`` at the same host paths, read-only; no gateway socket (the
server makes no gateway call; its answers come back over its stdio); the network only
through the egress proxy and only to ``egress_domains``; only its declared environment.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Final, get_args

from gatewayd.mcp.declaration import McpServerDeclaration, Mode
from gatewayd.policy import Policy
from gatewayd.policy.appsfolder import lies_in_apps_folder
from gatewayd.policy.model import (
    EnvSection,
    HttpMethod,
    ModelAccessSection,
    NetworkSection,
    ProxySection,
    ToolsSection,
)
from gatewayd.policy.paths import WORKSPACE_VISIBLE_ROOT, PathGrant, PathMode, holds_nested
from gatewayd.runs import ChildKind, ChildSpec, Grant, MadeFor, Run, RunLimits, RunRequest
from gatewayd.sandbox.session import SandboxView

# Grant names: with a colon, which no policy's path name may hold, so they never clash.
WORKSPACE_GRANT_PREFIX: Final = "mcp:workspace:"
READ_ONLY_GRANT_PREFIX: Final = "mcp:host:"
# A shared server's run lasts this long at most (the longest a run may); its end stops
# the instance, and the next call starts a fresh one.
SHARED_RUN_S: Final = 7 * 24 * 3600
# The actor and tenant a shared server's run is recorded under: gatewayd itself.
GATEWAYD_ACTOR: Final = "gatewayd"
# The shared server's private, empty workspace: gatewayd's alone, never bound.
SHARED_WORKSPACE_MODE: Final = 0o700


class ServerUnavailable(Exception):
    """The server cannot run for this caller as things are: ``str(exc)`` says why and
    what would fix it."""


def workspace_grants(
    name: str, declaration: McpServerDeclaration, caller: Run
) -> tuple[PathGrant, ...]:
    """The declared workspace paths as grants of the server's run: each beneath the
    caller's workspace, with the declared mode and never more than the caller's grant
    that covers it. Blocking (stats the paths).

    Error handling: ServerUnavailable for a path that is missing, not a directory, leaves
    the workspace, lies in its apps folder, changes while it is checked, is not granted
    to the caller, is granted with suffix or size rules (a mount cannot keep them), or
    would be writable (below)."""
    grants: list[PathGrant] = []
    workspace = caller.spec.workspace
    for index, entry in enumerate(declaration.workspace_paths):
        host = Path(os.path.realpath(workspace / entry.path))
        if not host.is_relative_to(workspace):
            raise ServerUnavailable(
                f"MCP server {name!r}: workspace path {entry.path!r} leads out of the calling "
                f"run's workspace (to {host}); a server sees only the caller's files"
            )
        if lies_in_apps_folder(host, workspace):
            raise ServerUnavailable(
                f"MCP server {name!r}: workspace path {entry.path!r} leads into the calling "
                f"run's apps folder ({host}), which no sandbox sees; declare another path"
            )
        covering = _covering_grant(caller, host)
        if covering is None:
            raise ServerUnavailable(
                f"MCP server {name!r} declares workspace path {entry.path!r}, which the calling "
                f"run may not read (its workspace grants: {_grants_text(caller)}); a server "
                "never gets more than its caller"
            )
        if covering.suffixes or covering.max_file_bytes is not None:
            raise ServerUnavailable(
                f"MCP server {name!r}: the calling run may read workspace path {entry.path!r} "
                f"only under suffix or size rules (grant {covering.name!r}), which a server's "
                "sandbox cannot keep; grant the caller that path without them, or declare "
                "another path"
            )
        mode = PathMode.RW if entry.mode is Mode.RW and covering.mode is PathMode.RW else None
        if mode is PathMode.RW:
            # The caller's sandbox uid holds every writable tree of its workspace (its
            # lease); lending the same tree to the server's uid too would take it from
            # the caller while both run.
            raise ServerUnavailable(
                f"MCP server {name!r} declares workspace path {entry.path!r} rw, and the "
                "calling run may write it: a tree lent to the caller's sandbox cannot be lent "
                "to a server's at the same time. Declare it mode: ro (the server then reads it)"
            )
        st = _identity_at(name, host, f"workspace path {entry.path!r}")
        grants.append(
            PathGrant(
                name=f"{WORKSPACE_GRANT_PREFIX}{index}",
                host_root=host,
                root_id=(st.st_dev, st.st_ino),
                holds_nested=False,
                visible_root=WORKSPACE_VISIBLE_ROOT / host.relative_to(workspace),
                mode=PathMode.RO,
            )
        )
    return _mark_nested(grants)


def read_only_grants(name: str, declaration: McpServerDeclaration) -> tuple[PathGrant, ...]:
    """The declared host paths, read-only, each at its own path. Blocking.

    Error handling: ServerUnavailable for one that is missing or not a directory."""
    grants = []
    for index, path in enumerate(declaration.read_only_paths):
        real = Path(os.path.realpath(path))
        st = _stat_dir(name, real, f"read_only_paths entry {str(path)!r}")
        grants.append(
            PathGrant(
                name=f"{READ_ONLY_GRANT_PREFIX}{index}",
                host_root=real,
                root_id=(st.st_dev, st.st_ino),
                holds_nested=False,
                visible_root=PurePosixPath(path),
                mode=PathMode.RO,
            )
        )
    return tuple(grants)


def server_policy(name: str, declaration: McpServerDeclaration, caller: Run | None) -> Policy:
    """The instance's policy: no tool, no model, the declared egress domains through the
    proxy (none: no network), the declared environment; a per-run server has its
    caller's limits and sandbox limits."""
    defaults = Policy(version=1, name="mcp")
    base = caller.spec.policy if caller is not None else defaults
    names = (*declaration.env, *declaration.secret_env)
    return Policy(
        version=1,
        name=f"mcp-{name.replace('_', '-')}",
        description=(
            f"the MCP server {name}"
            + (f", for run {caller.run_id}" if caller is not None else ", shared")
        ),
        tools=ToolsSection(allow=()),
        require_os_sandbox=True,
        env=EnvSection(allow=names),
        model_access=ModelAccessSection(),
        network=NetworkSection(
            allow_domains=declaration.egress_domains,
            schemes=("http", "https"),
            # The domains are the operator's choice for this program; what it does with
            # them (an API's POST) is its own: every method the proxy knows.
            methods=get_args(HttpMethod),
            ports=declaration.egress_ports,
            allow_private=declaration.egress_allow_private,
            proxy=ProxySection(enabled=bool(declaration.egress_domains)),
        ),
        limits=base.limits,
        sandbox=base.sandbox,
    )


def server_spec(
    name: str,
    declaration: McpServerDeclaration,
    caller: Run | None,
    *,
    policy: Policy,
    grants: tuple[PathGrant, ...],
    workspace: Path,
) -> ChildSpec:
    """The run of one instance: a child of ``caller`` (per_run), or gatewayd's own with
    ``workspace`` its private empty directory (shared)."""
    request = caller.spec.request if caller is not None else None
    return ChildSpec(
        parent_run_id=caller.run_id if caller is not None else None,
        made_for=MadeFor(kind=ChildKind.MCP_SERVER, name=name),
        request=RunRequest(
            workspacePath=str(workspace),
            policy=policy.name,
            actorId=request.actorId if request else GATEWAYD_ACTOR,
            tenantId=request.tenantId if request else GATEWAYD_ACTOR,
            grant=Grant(allowSandbox=True),
            limits=(
                RunLimits(
                    maxRuntimeSec=request.limits.maxRuntimeSec,
                    maxMemoryMb=request.limits.maxMemoryMb,
                )
                if request
                else RunLimits(maxRuntimeSec=SHARED_RUN_S)
            ),
            taskInput="",
            graphId=f"mcp:{name}",
            billingAccountId=request.billingAccountId if request else None,
            sandboxImage=request.sandboxImage if request else None,
        ),
        workspace=workspace,
        policy=policy,
        source=f"MCP server {name} (gatewayd's configuration, mcp_servers.{name})",
        grants=grants,
    )


def server_view(workspace: Path, grants: tuple[PathGrant, ...]) -> SandboxView:
    """The instance's sandbox: of the workspace only its grants (all of it when one is
    the workspace itself: ``path: .``), read-only; no gateway socket; commands starting
    in /workspace."""
    whole = any(
        g.host_root == workspace and g.visible_root == WORKSPACE_VISIBLE_ROOT for g in grants
    )
    return SandboxView(workspace_read_only=True, whole_workspace=whole, gateway_socket=False)


def shared_workspace(directory: Path) -> Path:
    """The shared server's private empty workspace at ``directory``, made 0700 (gatewayd's
    alone) when missing. Blocking.

    Error handling: ServerUnavailable when something else is there."""
    directory.parent.mkdir(mode=SHARED_WORKSPACE_MODE, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=SHARED_WORKSPACE_MODE)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ServerUnavailable(f"{directory} is not a directory of gatewayd's own")
    return directory


def _covering_grant(caller: Run, host: Path) -> PathGrant | None:
    """The caller's most specific grant beneath /workspace holding ``host``."""
    covering = [
        grant
        for grant in caller.spec.grants
        if grant.visible_root.is_relative_to(WORKSPACE_VISIBLE_ROOT)
        and host.is_relative_to(grant.host_root)
    ]
    return max(covering, key=lambda g: len(g.host_root.parts), default=None)


def _grants_text(caller: Run) -> str:
    inside = [
        f"{grant.visible_root} ({grant.mode})"
        for grant in caller.spec.grants
        if grant.visible_root.is_relative_to(WORKSPACE_VISIBLE_ROOT)
    ]
    return ", ".join(inside) or "none"


def _stat_dir(name: str, path: Path, what: str) -> os.stat_result:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        raise ServerUnavailable(f"MCP server {name!r}: {what}: {exc.strerror}: {path}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ServerUnavailable(
            f"MCP server {name!r}: {what} ({path}) is not a directory; declare directories"
        )
    return st


def _identity_at(name: str, host: Path, what: str) -> os.stat_result:
    """The stat of the directory at the resolved path ``host``, taken from a descriptor
    whose real path is still ``host``: the calling run's agent can swap a component for
    a symlink between the checks above and this one, and the identity pinned here is
    what the sandbox binds (gatewayd.sandbox.session checks it), so it must be the
    directory the checks judged, never what a symlink leads to. Blocking.

    Error handling: ServerUnavailable for a path that is not a directory or that moved."""
    try:
        fd = os.open(host, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        _stat_dir(name, host, what)  # the usual refusal when it is missing or no directory
        raise ServerUnavailable(f"MCP server {name!r}: {what}: {exc.strerror}: {host}") from None
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if Path(real) != host:
        raise ServerUnavailable(
            f"MCP server {name!r}: {what} changed while it was checked ({host} now leads to "
            f"{real}); the server was not started"
        )
    return st


def _mark_nested(grants: list[PathGrant]) -> tuple[PathGrant, ...]:
    roots = [grant.host_root for grant in grants]
    return tuple(
        PathGrant(
            name=grant.name,
            host_root=grant.host_root,
            root_id=grant.root_id,
            holds_nested=holds_nested(grant.host_root, roots),
            visible_root=grant.visible_root,
            mode=grant.mode,
        )
        for grant in grants
    )
