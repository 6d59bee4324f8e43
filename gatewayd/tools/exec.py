"""``sandbox.exec``: run a shell command inside the run's OS sandbox.

The host-owned agent loop (gatewayd/agent/loop.py) offers this to the model as ``exec``;
it is a tool like any other, so a call goes through the allowlist, the policy, review
and the audit log before the command starts. The command runs in a fresh sandbox of the
run (its uid, its network namespace, its workspace, its limits), never on the host: a run
without an OS sandbox (degraded) is refused.

Output comes back as text (invalid UTF-8 replaced), each stream cut at the run's
``sandbox.max_output_bytes`` like any sandboxed command. The result says ``failed``
(a non-zero exit, a signal, a limit) and, when the sandbox made it fail, a one-line
``hint`` saying which rule and what to use instead (:mod:`gatewayd.sandbox.hints`).

Options (note 002's), each checked by :func:`prepare_exec`, which the control socket's
exec shares, so both refuse the same things the same way:

* ``cwd``: where the command starts, ``/workspace`` or a directory beneath it (relative
  to it, like the fs tools' paths). Resolved as the fs tools resolve a path: lexically
  onto the run's path grants (outside them, or in the apps folder: ``policy_denied``
  naming the readable paths), then opened beneath the grant's root by the kernel with
  no way out (``..`` or a symlink leaving it is refused), and it must be a directory.
  The command could ``cd`` anywhere its sandbox shows; ``cwd`` is checked so a mistake
  is told clearly, not because the directory is a boundary.
* ``env``: variables for the command, by name from the policy's ``env.allow`` only (a
  name gatewayd holds a secret in is never there: a run whose policy passes one is
  refused at its start); values are text, bounded. Without ``env`` a tool's command gets
  no value for those names; the control socket's exec gives gatewayd's own values, which
  ``env`` overrides.
* ``allowedDomains`` and ``packageManagers``: the command's network, narrower than the
  run's (:func:`~gatewayd.policy.network.narrowed_network`: a domain the run may not
  reach, a set its policy does not list, is ``policy_denied`` naming it). The command
  then runs in a network namespace of its own, with an egress proxy of its own allowing
  exactly those domains (the process tools' per-call proxy, :class:`~gatewayd.tools.
  registry.CallEgress`), reached through cogni-tool's bridge at the usual
  ``HTTP_PROXY``; ``allowedDomains: []`` alone gives it no way out at all. The run's
  in-sandbox model endpoint (``OPENAI_BASE_URL``) is not in that namespace; the
  gateway socket is (``cogni-tool`` works as ever).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Final

import msgspec

from gatewayd.errors import InvalidArguments, PolicyViolation
from gatewayd.hostpaths.beneath import BeneathRoot
from gatewayd.policy.appsfolder import APPS_DIR_NAME
from gatewayd.policy.capabilities import Capabilities, CapabilityRequest, no_sandbox_refusal
from gatewayd.policy.decide import Deny, check_path, normalize_path
from gatewayd.policy.model import NetworkSection
from gatewayd.policy.network import MAX_COMMAND_DOMAINS, narrowed_network
from gatewayd.policy.package_managers import package_manager_names
from gatewayd.policy.paths import (
    MAX_PATH_BYTES,
    WORKSPACE_VISIBLE_ROOT,
    PathAccess,
    PathGrant,
    PathMode,
    shown,
)
from gatewayd.sandbox.hints import CommandEnd, CommandNetworkFacts, HintFacts, command_hint
from gatewayd.sandbox.launch import ExecResult, ResultForm, exec_result_json
from gatewayd.sandbox.plan import COGNI_TOOL_VISIBLE_DIR, EGRESS_BRIDGE
from gatewayd.sandbox.session import CommandNetwork, RunSandbox
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.registry import Tool, ToolContext

MAX_COMMAND_CHARS: Final = 32_768
MAX_STDIN_CHARS: Final = 1_000_000
# The sandbox's own per-command limit (sandbox.timeout_s) and the call's limit
# (limits.call_timeout_s) still apply; this only lets a call ask for less.
MAX_TIMEOUT_S: Final = 24 * 3600.0
SHELL: Final = "/bin/sh"
# Variables one command is given: a build needs a handful; every one is a bwrap
# argument, and the whole command line must stay far below the kernel's ARG_MAX.
MAX_ENV_VARS: Final = 64
# One value: a long PATH-like list fits; a file's worth of text is a file, not a variable.
MAX_ENV_VALUE_CHARS: Final = 32_768
# All of them together: they travel as bwrap's arguments, which with the command must
# stay well under the kernel's ARG_MAX (2 MiB here), or bwrap could not start at all.
MAX_ENV_TOTAL_CHARS: Final = 256 * 1024
# The /etc files every plan makes itself (gatewayd/sandbox/plan.py's RoBindData steps).
GENERATED_ETC: Final = ("passwd", "group", "hosts")
# Where the run's sockets are (the gateway's, the egress proxy's).
SANDBOX_SOCKET_DIR: Final = "/run/cogni"
# Where a command may always write besides its writable paths (a tmpfs of its own).
SANDBOX_TMP: Final = "/tmp"


class ExecArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Run one shell command in the run's sandbox, in /workspace (or cwd). The result
    says whether it failed and, when the sandbox made it fail, a hint: what to use
    instead."""

    command: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=MAX_COMMAND_CHARS,
            description="A /bin/sh command line, run in /workspace inside the sandbox.",
        ),
    ]
    stdin: Annotated[
        str,
        msgspec.Meta(max_length=MAX_STDIN_CHARS, description="Text for the command's stdin."),
    ] = ""
    timeout_s: Annotated[
        Annotated[float, msgspec.Meta(gt=0, le=MAX_TIMEOUT_S)] | None,
        msgspec.Meta(description="Stop the command after this many seconds (default: the run's)."),
    ] = None
    cwd: Annotated[
        Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATH_BYTES)] | None,
        msgspec.Meta(
            description="Where the command starts: /workspace or a directory beneath it "
            "(relative paths start at /workspace)."
        ),
    ] = None
    env: Annotated[
        Annotated[
            dict[str, Annotated[str, msgspec.Meta(max_length=MAX_ENV_VALUE_CHARS)]],
            msgspec.Meta(max_length=MAX_ENV_VARS),
        ]
        | None,
        msgspec.Meta(
            description="Environment variables for the command; names from the policy's "
            "env.allow only."
        ),
    ] = None
    allowedDomains: Annotated[
        Annotated[list[str], msgspec.Meta(max_length=MAX_COMMAND_DOMAINS)] | None,
        msgspec.Meta(
            description="Narrow the command's network to these domains (each one the run "
            "may reach; [] for none); reached through HTTP_PROXY."
        ),
    ] = None
    packageManagers: Annotated[
        Annotated[list[str], msgspec.Meta(max_length=len(package_manager_names()))] | None,
        msgspec.Meta(
            description="Narrow the command's network to these registries' domains (each "
            f"one the policy lists): {', '.join(package_manager_names())}."
        ),
    ] = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecOptions:
    """An exec's options, whoever asked (a tool call's arguments, the control socket's
    request): ``None`` leaves each as the run has it."""

    cwd: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    allowed_domains: Sequence[str] | None = None
    package_managers: Sequence[str] | None = None

    def audited(self) -> dict[str, Any]:
        """What an audit entry records of them: never a variable's value (a token an
        operator passes is still a token), only its name."""
        detail: dict[str, Any] = {}
        if self.cwd is not None:
            detail["cwd"] = self.cwd
        if self.env:
            detail["envNames"] = sorted(self.env)
        if self.allowed_domains is not None:
            detail["allowedDomains"] = list(self.allowed_domains)
        if self.package_managers is not None:
            detail["packageManagers"] = list(self.package_managers)
        return detail


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedExec:
    """Options checked against the run: ``cwd`` the visible directory to start in (None:
    the sandbox's default), ``env`` the values given, ``network`` the command's own
    network section (None: the run's)."""

    cwd: str | None
    env: Mapping[str, str]
    network: NetworkSection | None


# Serves one command's own egress proxy for ``network`` on host socket ``socket`` while
# open (a CallEgress bound to its caller).
CommandEgress = Callable[[NetworkSection, Path], AbstractAsyncContextManager[None]]


def prepare_exec(
    options: ExecOptions,
    *,
    grants: Sequence[PathGrant],
    env_allow: Sequence[str],
    network: NetworkSection,
) -> PreparedExec:
    """Check ``options`` against the run's grants, ``env.allow`` and ``network``.

    Error handling: InvalidArguments (a malformed cwd, value or domain), PolicyViolation
    (a cwd outside the readable paths, a name off env.allow, anything that would widen
    the run's network: each names what is allowed), ToolFailed (a cwd that is missing
    or not a directory).
    """
    if len(options.env) > MAX_ENV_VARS:
        raise InvalidArguments(f"{len(options.env)} environment variables; at most {MAX_ENV_VARS}")
    total = sum(len(name) + len(value) for name, value in options.env.items())
    if total > MAX_ENV_TOTAL_CHARS:
        raise InvalidArguments(
            f"the environment variables hold {total} characters; at most "
            f"{MAX_ENV_TOTAL_CHARS} in all (write longer text to a file)"
        )
    for name, value in options.env.items():
        if name not in env_allow:
            allowed = ", ".join(env_allow) or "none"
            raise PolicyViolation(
                f"environment variable {shown(name)!r} is not allowed for this run; "
                f"allowed: {allowed} (env.allow)"
            )
        if "\0" in value:
            raise InvalidArguments(f"environment variable {name} holds a NUL byte; values are text")
        if len(value) > MAX_ENV_VALUE_CHARS:
            raise InvalidArguments(
                f"environment variable {name} is {len(value)} characters; at most "
                f"{MAX_ENV_VALUE_CHARS} (write longer text to a file)"
            )
    narrowed = narrowed_network(
        network, domains=options.allowed_domains, managers=options.package_managers
    )
    cwd = None if options.cwd is None else resolve_cwd(options.cwd, grants)
    return PreparedExec(cwd=cwd, env=dict(options.env), network=narrowed)


def resolve_cwd(cwd: str, grants: Sequence[PathGrant]) -> str:
    """The visible, normalized directory ``cwd`` names, once it is one the run may read
    (as the fs tools resolve paths) beneath /workspace, and a directory there now.

    Error handling: as :func:`prepare_exec`'s, for the ``cwd``."""
    quoted = shown(cwd)
    if "\0" in cwd or len(cwd.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise InvalidArguments(f"cwd '{quoted}' is not a path (a NUL byte, or too long)")
    parts = normalize_path(cwd)
    root = WORKSPACE_VISIBLE_ROOT.parts[1:]
    if parts[: len(root)] != root:
        raise InvalidArguments(
            f"cwd '{quoted}' is outside /workspace; a command starts in /workspace or a "
            "directory beneath it (relative paths start at /workspace)"
        )
    resolved = check_path(PathAccess(path=cwd, access="read", metadata_only=True), grants)
    if isinstance(resolved, Deny):
        raise resolved.as_error()
    with BeneathRoot(resolved) as beneath:
        os.close(beneath.open_dir())
    return str(PurePosixPath("/", *parts))


async def run_exec_command(
    sandbox: RunSandbox,
    command: Sequence[str],
    prepared: PreparedExec,
    *,
    stdin: bytes | None,
    timeout_s: float | None,
    env_values: Mapping[str, str],
    egress: CommandEgress | None,
) -> ExecResult:
    """Run ``command`` as ``prepared`` says in a fresh sandbox of the run: in the run's
    network, or in one of its own behind its own proxy (served by ``egress`` while it
    runs). ``env_values``: where the run's env.allow names take their values from
    (``prepared.env`` overrides them).

    Error handling: PolicyViolation when the command asks for domains and there is no
    ``egress`` to hold it to them (it would run with none, or with the run's); the
    sandbox's own errors (PlanError, LaunchError, SandboxUnavailable) as they come.
    """
    values = {**env_values, **prepared.env}
    network = prepared.network
    if network is None:
        return await sandbox.exec(
            command, stdin=stdin, timeout_s=timeout_s, env_values=values, cwd=prepared.cwd
        )
    if not network.allow_domains:
        return await sandbox.exec(
            command,
            stdin=stdin,
            timeout_s=timeout_s,
            env_values=values,
            cwd=prepared.cwd,
            network=CommandNetwork(),
        )
    if egress is None:
        raise PolicyViolation(
            "this gatewayd gives a command no egress proxy of its own, so it cannot hold "
            "one to allowedDomains or packageManagers; run it without them (the run's "
            "own network) or use http.fetch"
        )
    socket = sandbox.call_egress_socket()
    async with egress(network, socket):
        return await sandbox.exec(
            [*EGRESS_BRIDGE, *command],
            stdin=stdin,
            timeout_s=timeout_s,
            env_values=values,
            cwd=prepared.cwd,
            network=CommandNetwork(egress_socket=socket),
        )


def exec_hint(
    result: ExecResult,
    *,
    sandbox: RunSandbox,
    timeout_s: float | None,
    run_network: NetworkSection,
    prepared: PreparedExec,
    fetch_allowed: bool,
) -> str | None:
    """The result's hint (:func:`~gatewayd.sandbox.hints.command_hint`) from what
    gatewayd set up for this command."""
    if prepared.network is None:
        proxy = sandbox.services.egress_proxy
        facts_net = CommandNetworkFacts(
            proxy=proxy,
            domains=run_network.reachable_domains if proxy else (),
            source="network.allow_domains"
            + (", network.package_managers" if run_network.package_managers else ""),
            fetch_domains=run_network.reachable_domains if fetch_allowed else (),
        )
    else:
        facts_net = CommandNetworkFacts(
            proxy=bool(prepared.network.allow_domains),
            domains=prepared.network.allow_domains,
            source="this command's allowedDomains and packageManagers",
            fetch_domains=run_network.reachable_domains if fetch_allowed else (),
            narrowed=True,
        )
    facts = HintFacts(
        limits=sandbox.limits.for_command(timeout_s),
        run_timeout_s=sandbox.limits.timeout_s,
        memory_limit=result.memoryLimit,
        network=facts_net,
        writable=writable_paths(sandbox),
        visible=visible_paths(sandbox),
        covered=(f"{WORKSPACE_VISIBLE_ROOT}/{APPS_DIR_NAME}",),
    )
    end = CommandEnd(
        exit_code=result.exitCode,
        signal=result.signal,
        error=result.errorCode,
        stderr=result.stderr,
        stdout_truncated=result.stdoutTruncated,
        stderr_truncated=result.stderrTruncated,
        process_limit_hit=result.processLimitHit,
    )
    return command_hint(end, facts)


def writable_paths(sandbox: RunSandbox) -> tuple[str, ...]:
    """Where a command of ``sandbox`` may write, as it sees them: the workspace (unless
    its view makes it read-only), each read-write policy path, /tmp; a read-only policy
    path inside a writable one is named as an exception."""
    ro = [m.visible for m in sandbox.mounts if m.mode is PathMode.RO]
    roots = [] if sandbox.view.workspace_read_only else [str(WORKSPACE_VISIBLE_ROOT)]
    roots += [m.visible for m in sandbox.mounts if m.mode is PathMode.RW]
    shown_roots = []
    for root in roots:
        inner = [r for r in ro if r != root and PurePosixPath(r).is_relative_to(root)]
        shown_roots.append(f"{root} (except {', '.join(inner)})" if inner else root)
    return (*shown_roots, SANDBOX_TMP)


def visible_paths(sandbox: RunSandbox) -> tuple[str, ...] | None:
    """What a command of ``sandbox`` sees of the file system (every plan's binds and
    mounts), or None where that is not a fixed list: a sandbox on an image (the image's
    whole tree) or one showing only parts of the workspace (an app's)."""
    if sandbox.image_dir is not None or not sandbox.view.whole_workspace:
        return None
    layout = sandbox.settings.layout
    return (
        "/usr",
        *(f"/{name}" for name, _ in layout.system_links),
        *(f"/{name}" for name in layout.system_dirs),
        *(f"/etc/{entry}" for entry in (*layout.etc_entries, *GENERATED_ETC)),
        "/proc",
        "/dev",
        SANDBOX_TMP,
        str(WORKSPACE_VISIBLE_ROOT),
        *(m.visible for m in sandbox.mounts),
        *(str(tree) for tree in sandbox.view.exposed),
        COGNI_TOOL_VISIBLE_DIR,
        SANDBOX_SOCKET_DIR,
    )


def exec_options(args: ExecArgs) -> ExecOptions:
    """A tool call's options."""
    return ExecOptions(
        cwd=args.cwd,
        env=args.env or {},
        allowed_domains=args.allowedDomains,
        package_managers=args.packageManagers,
    )


# Every call runs a command; the policy step refuses it in a run without an OS sandbox.
EXEC_REQUEST: Final = CapabilityRequest(exec=True)


def exec_request(_args: ExecArgs) -> CapabilityRequest:
    return EXEC_REQUEST


async def run_exec(args: ExecArgs, ctx: ToolContext) -> Any:
    sandbox = ctx.sandbox
    if sandbox is None or ctx.network is None:
        # The policy step refused this already; the check stays where the sandbox is used.
        raise PolicyViolation(no_sandbox_refusal("sandbox.exec", ctx.degraded or "no sandbox"))
    prepared = prepare_exec(
        exec_options(args), grants=ctx.grants, env_allow=ctx.env, network=ctx.network
    )
    result = await run_exec_command(
        sandbox,
        [SHELL, "-c", args.command],
        prepared,
        stdin=args.stdin.encode() if args.stdin else None,
        timeout_s=args.timeout_s,
        env_values={},
        egress=_call_egress(ctx),
    )
    fetch_allowed = ctx.allowed_tools is not None and "http.fetch" in ctx.allowed_tools()
    hint = exec_hint(
        result,
        sandbox=sandbox,
        timeout_s=args.timeout_s,
        run_network=ctx.network,
        prepared=prepared,
        fetch_allowed=fetch_allowed,
    )
    return exec_result_json(result, ResultForm.TOOL, hint=hint)


def _call_egress(ctx: ToolContext) -> CommandEgress | None:
    """The call's own proxy, bound to the call (its entries name the tool and the call)."""
    call_egress = ctx.call_egress
    if call_egress is None:
        return None

    def serve(network: NetworkSection, socket: Path) -> AbstractAsyncContextManager[None]:
        return call_egress(ctx=ctx, tool="sandbox.exec", network=network, socket=socket)

    return serve


SANDBOX_EXEC: Tool[ExecArgs] = builtin_tool(
    name="sandbox.exec",
    summary="Run a shell command inside the run's sandbox (its uid, no network but the "
    "gateway, its workspace and limits); optional cwd, env (env.allow names), and a "
    "narrower network (allowedDomains, packageManagers); returns exit code, failed, "
    "output and a hint when the sandbox made it fail.",
    args_type=ExecArgs,
    run=run_exec,
    requests=exec_request,
    capabilities=Capabilities(exec=True),
)
