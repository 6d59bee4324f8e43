"""Capabilities: what a tool declares it may use, what one call asks for, and whether the
run grants it. Pure: the policy step of every call, for every runner kind.

A tool's manifest *declares* its capabilities once, as static bounds (:class:`Capabilities`:
files with a path and a mode, network domains, model aliases, environment names, exec).
Each call *requests* some of them, worked out from its validated arguments before it runs
(:class:`CapabilityRequest`: the paths it touches and how, the hosts it reaches, the model
aliases, environment names, whether it runs a command). :func:`check_call` then decides:

1. a request beyond the declaration is refused as ``internal``: the request is worked out
   by gatewayd's code for the tool's runner kind, never by the caller, so asking for more
   than the manifest declares is a fault of gatewayd or of the tool's definition, and the
   operator has to look (invariant CHILD_NEVER_EXCEEDS_PARENT: a tool never gets more than
   it declared);
2. what remains is checked against the run's rights (:class:`RunRights`: its path
   grants, ``model_access`` and model budget, ``network``, ``env.allow``, its OS
   sandbox), so the call gets the intersection of its declaration and the run's rights.

Every refusal says what was refused and what *is* allowed (invariant ACTIONABLE_ERRORS).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Final, Protocol

import msgspec

from gatewayd.error_codes import ErrorCode
from gatewayd.errors import GatewayError
from gatewayd.policy.decide import (
    Allow,
    Decision,
    Deny,
    check_path,
    malformed_path,
    normalize_path,
)
from gatewayd.policy.model import NetworkSection
from gatewayd.policy.network import check_any_host_allowed, check_host, domain_matches
from gatewayd.policy.paths import PathAccess, PathGrant, PathMode, shown

# In a declaration: whatever the run's policy grants (a built-in tool whose reach is the
# run's own: fs.read may read any path the run's grants allow).
ANY: Final = "*"
# A file declaration's path that covers every path.
EVERY_PATH: Final = "/"


def _check_visible_path(path: str) -> None:
    """An absolute, normalized path as the sandbox sees it (``/workspace/data``)."""
    pure = PurePosixPath(path)
    if not path.startswith("/") or path.startswith("//") or str(pure) != path or ".." in pure.parts:
        raise ValueError(
            f"file capability path {path!r} must be absolute and normalized (no '.', '..', "
            "empty or trailing components)"
        )


class FileCapability(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Files a tool may touch: every path at or below ``path``, read (``ro``) or read and
    write (``rw``). ``/`` covers every path; the run's grants still bound each call."""

    path: str
    mode: PathMode

    def __post_init__(self) -> None:
        _check_visible_path(self.path)

    def covers(self, access: PathAccess) -> bool:
        """Does this declaration cover ``access`` (its path normalized lexically)?"""
        if access.access == "write" and self.mode is not PathMode.RW:
            return False
        if self.path == EVERY_PATH:
            return True
        root = tuple(self.path.split("/")[1:])
        return normalize_path(access.path)[: len(root)] == root

    def __str__(self) -> str:
        return f"{self.path} ({self.mode})"


class Capabilities(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, rename="camel"
):
    """What a tool may ever use, declared in its manifest; nothing else is granted to it.

    ``network``, ``model_access`` and ``env`` list names (a domain may be ``*.x``, any
    list may be ``*``: whatever the run grants); ``exec``: it runs commands in the run's
    OS sandbox.
    """

    files: tuple[FileCapability, ...] = ()
    network: tuple[str, ...] = ()
    model_access: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    exec: bool = False

    def __post_init__(self) -> None:
        for kind, names in (
            ("network", self.network),
            ("model_access", self.model_access),
            ("env", self.env),
        ):
            if any(not name for name in names):
                raise ValueError(f"a {kind} capability names nothing (an empty string)")


NO_CAPABILITIES: Final = Capabilities()


# A msgspec Struct, not a dataclass, like RunRights: one is made for every call, and a
# Struct is made ten times faster.
class CapabilityRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What one call asks for, worked out from its validated arguments before it runs."""

    paths: tuple[PathAccess, ...] = ()  # as the agent wrote them, in order
    domains: tuple[str, ...] = ()  # host names (ASCII, IDNA form) it connects to
    models: tuple[str, ...] = ()  # model aliases it asks
    env: tuple[str, ...] = ()  # host environment variables it is given, by name
    exec: bool = False  # it runs a command in the run's OS sandbox


NO_REQUEST: Final = CapabilityRequest()


def no_request(_args: object) -> CapabilityRequest:
    """For tools whose calls use no capability (``time.now``)."""
    return NO_REQUEST


class ModelBudgetView(Protocol):
    """The run's model budget as the policy step reads it (``runs.ModelBudget``)."""

    def spent(self) -> str | None:
        """Why no further model request may be made, or None."""
        ...


class RunRights(msgspec.Struct, frozen=True, kw_only=True):
    """What a run may grant a call: read from its policy and its live state per call."""

    grants: tuple[PathGrant, ...]
    models: tuple[str, ...]  # the policy's model_access.models
    model_budget: ModelBudgetView | None  # None: the run has none, so no model request
    network: NetworkSection
    env: tuple[str, ...]  # the policy's env.allow
    without_sandbox: str | None  # why the run has no OS sandbox; None: it has one


# --- the refusals' messages (the runners that act on a budget or a sandbox say them too) --


def model_refusal(alias: str, granted: tuple[str, ...]) -> str | None:
    """Why the run may not use model ``alias`` (the aliases it may), or None."""
    if alias in granted:
        return None
    allowed = ", ".join(granted) if granted else "none (the policy's model_access is empty)"
    return f"model {alias!r} is not granted to this run; models it may use: {allowed}"


def budget_refusal(budget: ModelBudgetView | None) -> str | None:
    """Why the run may make no further model request (``rate_limited``), or None."""
    spent = "this run has no model budget" if budget is None else budget.spent()
    if spent is None:
        return None
    return f"{spent} (model_access.max_requests / max_tokens)"


def no_sandbox_refusal(tool: str, without_sandbox: str) -> str:
    """Why ``tool`` may run no command in a run without an OS sandbox (and why it has
    none): commands never run on the host."""
    return (
        f"{tool} runs commands only inside an OS sandbox, and this run has none "
        f"({without_sandbox}); the file tools still work"
    )


# --- the declaration -------------------------------------------------------------------


def _named(declared: tuple[str, ...], name: str) -> bool:
    return ANY in declared or name in declared


def _listed(names: tuple[str, ...]) -> str:
    return ", ".join(names) or "none"


def _beyond(declared: Capabilities, request: CapabilityRequest) -> tuple[str, str] | None:
    """The first thing ``request`` asks for that ``declared`` does not cover, and what
    the declaration says of its kind; None when it covers everything."""
    for access in request.paths:
        if not any(f.covers(access) for f in declared.files):
            files = _listed(tuple(str(f) for f in declared.files))
            return f"{access.access} access to '{shown(access.path)}'", f"files: {files}"
    for host in request.domains:
        if not any(d == ANY or domain_matches(d, host) for d in declared.network):
            return f"the network host {host!r}", f"network: {_listed(declared.network)}"
    for alias in request.models:
        if not _named(declared.model_access, alias):
            return f"model {alias!r}", f"model_access: {_listed(declared.model_access)}"
    for name in request.env:
        if not _named(declared.env, name):
            return f"environment variable {name!r}", f"env: {_listed(declared.env)}"
    if request.exec and not declared.exec:
        return "running a command", "exec: no"
    return None


def undeclared(tool: str, declared: Capabilities, request: CapabilityRequest) -> Deny | None:
    """Refuse (``internal``) a request for anything ``declared`` does not cover."""
    beyond = _beyond(declared, request)
    if beyond is None:
        return None
    what, has = beyond
    return Deny(
        code=ErrorCode.INTERNAL,
        message=(
            f"{tool} asked for {what}, which its manifest does not declare ({has}); a tool "
            "gets only what it declares, so the call is refused. This is a fault of the "
            "tool's definition, not of the call: tell the operator"
        ),
    )


# --- the run's rights ------------------------------------------------------------------


def _network_refusal(host: str, net: NetworkSection) -> Deny | None:
    try:
        check_any_host_allowed(net)
        check_host(host, net)
    except GatewayError as exc:
        return Deny(code=exc.code, message=exc.safe_message)
    return None


EVERYTHING_ALLOWED: Final = Allow()


def check_call(
    tool: str, declared: Capabilities, request: CapabilityRequest, rights: RunRights
) -> Decision:
    """May this call of ``tool`` use what it requests? The first refusal wins: a
    malformed path (``invalid_args``); anything beyond the declaration (``internal``);
    then, against the run's rights, paths (``policy_denied``), network hosts, model
    aliases, the model budget (``rate_limited``), environment names and exec. Allowed:
    the requested paths resolved onto the run's grants, in order."""
    if request is NO_REQUEST:
        return EVERYTHING_ALLOWED
    # A path no file can have is the caller's mistake, whatever the tool declares.
    for access in request.paths:
        malformed = malformed_path(access.path)
        if malformed is not None:
            return malformed
    refused = undeclared(tool, declared, request)
    if refused is not None:
        return refused
    resolved = []
    for access in request.paths:
        result = check_path(access, rights.grants)
        if isinstance(result, Deny):
            return result
        resolved.append(result)
    for host in request.domains:
        refused = _network_refusal(host, rights.network)
        if refused is not None:
            return refused
    for alias in request.models:
        message = model_refusal(alias, rights.models)
        if message is not None:
            return Deny(code=ErrorCode.POLICY_DENIED, message=message)
    if request.models:
        message = budget_refusal(rights.model_budget)
        if message is not None:
            return Deny(code=ErrorCode.RATE_LIMITED, message=message)
    for name in request.env:
        if name not in rights.env:
            return Deny(
                code=ErrorCode.POLICY_DENIED,
                message=(
                    f"environment variable {name!r} is not allowed for this run; "
                    f"allowed: {_listed(rights.env)} (env.allow)"
                ),
            )
    if request.exec and rights.without_sandbox is not None:
        return Deny(
            code=ErrorCode.POLICY_DENIED, message=no_sandbox_refusal(tool, rights.without_sandbox)
        )
    return Allow(resolved=tuple(resolved))
