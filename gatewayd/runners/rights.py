"""What one call of a folder tool gets: the intersection of what its manifest declares
and what the calling run grants, never more (invariant CHILD_NEVER_EXCEEDS_PARENT).

Dispatch's policy step sees only the tool's *required* needs (:func:`required_request`):
a run that lacks one is refused with ``policy_denied`` naming it, before anything runs.
A need the manifest marks ``optional`` is not asked for; the runner gets it only where
the run's grants allow it (:func:`granted_files`, :func:`granted_models`,
:func:`granted_env`, :func:`granted_domains`), so the call runs with less. An optional
read-write path on a read-only grant is handed over read-only.

A runner hands each granted directory to the tool whole (a wasm preopen, a bind mount),
so the tool, not gatewayd, opens the files in it: :func:`whole_directory_refusal` says
when that would escape a rule gatewayd checks file by file.

Pure: the run's side comes in as a :class:`CallRights` (a ``ToolContext`` is one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from gatewayd.errors import GatewayError
from gatewayd.policy.capabilities import CapabilityRequest
from gatewayd.policy.decide import Deny, check_path
from gatewayd.policy.network import check_any_host_allowed, check_host
from gatewayd.policy.paths import PathAccess, PathGrant, PathMode, ResolvedPath
from gatewayd.runners.spec import FileNeed, FolderTool
from gatewayd.tools.manifest import RunnerKind

if TYPE_CHECKING:
    from gatewayd.policy.model import NetworkSection

# How a runner's refusal of a directory ends: what the tool's author can do.
NARROWER_PATH_HINT: Final = (
    "a tool is handed whole directories, so it can be given none whose files are under "
    "per-file rules; declare a narrower path in its manifest, or grant the run a "
    "directory without such rules"
)


class CallRights(Protocol):
    """What these helpers read of the call's context (``gatewayd.tools.registry.
    ToolContext`` has all of it): the run's grants, the required paths as the policy
    step resolved them (in the order :func:`required_request` asked for them), the
    run's ``env.allow``, ``model_access.models`` and network section."""

    @property
    def grants(self) -> tuple[PathGrant, ...]: ...

    @property
    def resolved(self) -> tuple[ResolvedPath, ...]: ...

    @property
    def env(self) -> tuple[str, ...]: ...

    @property
    def model_access(self) -> tuple[str, ...]: ...

    @property
    def network(self) -> NetworkSection | None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class GrantedFile:
    """A path the call may use: where the tool sees it (``/workspace/src``), the run's
    grant beneath which the runner opens it, and whether the tool may write there."""

    visible: str
    resolved: ResolvedPath
    writable: bool


def _access(need: FileNeed, mode: PathMode) -> PathAccess:
    # metadata_only: the directory itself is handed over, not one file's contents, so
    # a grant's suffix rule (which judges a file's name) is whole_directory_refusal's.
    return PathAccess(
        path=need.path, access="write" if mode is PathMode.RW else "read", metadata_only=True
    )


def required_request(tool: FolderTool) -> CapabilityRequest:
    """What every call of ``tool`` asks the policy step for: each need its manifest does
    not mark optional (paths in declaration order), and ``exec`` for a process tool,
    which runs a program and so needs the run's OS sandbox."""
    return CapabilityRequest(
        paths=tuple(_access(f, f.mode) for f in tool.files if not f.optional),
        domains=tuple(n.name for n in tool.network if not n.optional),
        models=tuple(n.name for n in tool.models if not n.optional),
        env=tuple(n.name for n in tool.env if not n.optional),
        exec=tool.runner is RunnerKind.PROCESS,
    )


def granted_files(tool: FolderTool, ctx: CallRights) -> tuple[GrantedFile, ...]:
    """The paths this call gets: the required ones as the policy step resolved them,
    then each optional one the run's grants allow (read-only where the run may only
    read it; dropped where it may not read it, or where :func:`whole_directory_refusal`
    refuses it). Declaration order within each group."""
    required = [f for f in tool.files if not f.optional]
    if len(ctx.resolved) < len(required):
        # The policy step resolved fewer paths than the tool requires: not this tool's
        # call (dispatch resolves exactly the request's paths).
        raise GatewayError(f"{tool.name}: the call's resolved paths do not match its request")
    granted = [
        GrantedFile(visible=need.path, resolved=resolved, writable=need.mode is PathMode.RW)
        for need, resolved in zip(required, ctx.resolved, strict=False)
    ]
    for need in tool.files:
        if not need.optional:
            continue
        modes = (PathMode.RW, PathMode.RO) if need.mode is PathMode.RW else (PathMode.RO,)
        for mode in modes:
            result = check_path(_access(need, mode), ctx.grants)
            if isinstance(result, Deny) or whole_directory_refusal(result, ctx.grants) is not None:
                continue
            granted.append(
                GrantedFile(visible=need.path, resolved=result, writable=mode is PathMode.RW)
            )
            break
    return tuple(granted)


def whole_directory_refusal(
    resolved: ResolvedPath, grants: Sequence[PathGrant] | None = None
) -> str | None:
    """Why the directory ``resolved`` cannot be handed to a tool whole, or None: its
    grant has per-file rules (``suffixes``, ``max_file_bytes``) the tool would not be
    held to; it is, holds or lies in the workspace's apps folder; or another grant's
    directory, under rules of its own, lies at or beneath it (given the run's
    ``grants``; without them, whenever its grant holds any other grant). A nested
    grant beside the directory is out of reach: a preopen or a bind mount shows the
    directory alone, and a link inside cannot lead out of it. Runners raise
    ``PolicyViolation`` with it."""
    grant = resolved.grant
    where = f"'{resolved.visible}' (granted by {grant.visible_root})"
    if grant.suffixes:
        rule = f"allows only files ending in {', '.join(grant.suffixes)}"
    elif grant.max_file_bytes is not None:
        rule = f"limits each file to {grant.max_file_bytes} bytes"
    elif grant.apps_parts is not None and _meets_apps_folder(resolved.parts, grant.apps_parts):
        return (
            f"{where} is, holds or lies in the workspace's apps folder, which no tool "
            f"reaches; {NARROWER_PATH_HINT}"
        )
    elif grant.holds_nested and _holds_a_grant(resolved, grants):
        rule = "holds another grant's directory, under rules of its own"
    else:
        return None
    return f"{where} cannot be handed to the tool: its grant {rule}; {NARROWER_PATH_HINT}"


def _holds_a_grant(resolved: ResolvedPath, grants: Sequence[PathGrant] | None) -> bool:
    """Whether another grant's root lies at or beneath the directory ``resolved``
    (lexically, on the host paths resolved when the run was created); True when the
    run's grants are not known."""
    if grants is None:
        return True
    directory = resolved.grant.host_root.joinpath(*resolved.parts)
    return any(
        other is not resolved.grant and other.host_root.is_relative_to(directory)
        for other in grants
    )


def _meets_apps_folder(parts: tuple[str, ...], apps_parts: tuple[str, ...]) -> bool:
    """Whether the directory at ``parts`` is, holds or lies in the one at ``apps_parts``
    (both beneath one grant's root); names compared as the policy compares the apps
    folder's, ignoring case (gatewayd.policy.appsfolder)."""
    common = min(len(parts), len(apps_parts))
    return tuple(p.casefold() for p in parts[:common]) == tuple(
        p.casefold() for p in apps_parts[:common]
    )


def granted_models(tool: FolderTool, ctx: CallRights) -> tuple[str, ...]:
    """The model aliases the call may ask for: the required ones (the policy step
    checked them), then each optional one in the run's ``model_access.models``. Each
    model request is still a ``model.chat`` call of the run, checked and budgeted."""
    return tuple(
        need.name for need in tool.models if not need.optional or need.name in ctx.model_access
    )


def granted_env(tool: FolderTool, ctx: CallRights, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment the tool gets: each declared name in the run's ``env.allow``
    (a required one always is: the policy step checked), with its value from
    ``environ`` (gatewayd's own environment); a name unset there, or whose value holds
    a NUL byte (no environment can), is left out. A run's ``env.allow`` never names a
    secret gatewayd holds (the run manager refuses such a run)."""
    granted: dict[str, str] = {}
    for need in tool.env:
        value = environ.get(need.name)
        if need.name in ctx.env and value is not None and "\0" not in value:
            granted[need.name] = value
    return granted


def granted_domains(tool: FolderTool, ctx: CallRights) -> tuple[str, ...]:
    """The network domains the call may reach: the required ones (the policy step
    checked them), then each optional one the run's ``network.allow_domains`` matches
    (a wildcard declaration, ``*.example.org``, only where the run grants the same)."""
    granted = []
    for need in tool.network:
        if not need.optional:
            granted.append(need.name)
            continue
        net = ctx.network
        if net is None:
            continue
        if need.name.startswith("*."):
            if need.name in net.reachable_domains:
                granted.append(need.name)
            continue
        try:
            check_any_host_allowed(net)
            check_host(need.name, net)
        except GatewayError:
            continue
        granted.append(need.name)
    return tuple(granted)
