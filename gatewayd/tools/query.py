"""``sandbox.query``: what this run may do, asked before doing it.

An agent learns its boundaries from this answer instead of from denials: ``can_read``,
``can_write`` and ``resolve`` for one path, and ``boundaries`` for the run as a whole
(paths and their modes, suffixes and size limits, network, models, tools, limits, the
workspace).

The path answers are exactly what a file tool's call would get, because they are made
by the same functions the tools and dispatch call, in the same order, never by a copy
of their rules:

* the policy step: :func:`gatewayd.policy.decide.check_path` on the run's grants (the
  lexical rules: outside every grant, read-only, suffix, the apps folder, malformed);
* the tool's own open beneath the grant's root (:mod:`gatewayd.hostpaths.beneath`:
  RESOLVE_BENEATH, or the no-symlink walk): :func:`~gatewayd.tools.fs.listing.open_listed`
  as fs.list opens a directory, :func:`~gatewayd.tools.fs.read.open_for_read` as fs.read
  opens a file (with ``O_PATH``: the same resolution, and nothing opened for reading, so
  a FIFO's writer is not woken), then fs.read's checks on the descriptor (a single-link
  regular file within the size limit);
* for ``can_write``, fs.write's: its parent opened beneath the root (never through a
  symlink) and :func:`~gatewayd.tools.fs.write.replaceable` on what is there now.

So ``allowed: false`` carries the code and message the call would be refused with
(``policy_denied`` or ``invalid_args``), and ``allowed: true`` means the call would not
be refused by them; a ``note`` says why it would still fail (a missing file, a
directory where a file is asked for). An answer describes the tree as it is now: the
sandbox can change it before the call, and the call checks again.

``boundaries`` is bounded in size whatever the policy holds: each list carries at most
:data:`MAX_LISTED` entries, and ``truncated`` names the lists that were cut.

Read-only: no file is opened for reading or writing, nothing is created.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from pathlib import PurePosixPath
from typing import Annotated, Any, Final, Literal

import msgspec

from gatewayd.errors import GatewayError, InvalidArguments, ToolFailed
from gatewayd.hostpaths.beneath import (
    BeneathRoot,
    require_single_link_regular,
    translate_oserror,
)
from gatewayd.policy.decide import Deny, check_path, resolve_path
from gatewayd.policy.paths import PathAccess, PathGrant, ResolvedPath
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.fs.bounds import READS_FILES, TOOL_MAX_READ_FILE_BYTES, PathArg, check_size
from gatewayd.tools.fs.listing import open_listed
from gatewayd.tools.fs.read import open_for_read
from gatewayd.tools.fs.threads import in_thread_abandoned_on_cancel
from gatewayd.tools.fs.write import replaceable
from gatewayd.tools.registry import Tool, ToolContext

# The most entries one list of ``boundaries`` carries (paths, tools, domains, models,
# environment names): a policy may hold thousands, and the answer must stay well
# inside any run's output cap; the run's policy file has the rest.
MAX_LISTED: Final = 100

QueryOp = Literal["can_read", "can_write", "resolve", "boundaries"]
PATH_OPS: Final = frozenset({"can_read", "can_write", "resolve"})

# The tools an answer's ``tools`` names, per access: those of them the run may call.
READ_TOOLS: Final = ("fs.list", "fs.read", "fs.stat")
WRITE_TOOLS: Final = ("fs.edit", "fs.write")

QUERY_TOOL: Final = "sandbox.query"


class QueryArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Ask what this run may do: ``can_read``, ``can_write`` or ``resolve`` a path, or
    the run's ``boundaries`` as a whole."""

    op: Annotated[
        QueryOp,
        msgspec.Meta(
            description=(
                "can_read / can_write: would fs.read (fs.list for a directory) or fs.write "
                "of 'path' be allowed; resolve: where 'path' leads; boundaries: the run's "
                "paths, network, models, tools and limits (no path)."
            )
        ),
    ]
    path: Annotated[
        PathArg | None,
        msgspec.Meta(
            description=(
                "The path asked about (can_read, can_write, resolve), as seen in the "
                "sandbox: absolute (e.g. /workspace/src/app.py) or relative to /workspace."
            )
        ),
    ] = None

    def __post_init__(self) -> None:
        if self.op in PATH_OPS and self.path is None:
            raise InvalidArguments(
                f"op {self.op!r} asks about a path: add 'path' (e.g. /workspace/src/app.py)"
            )
        if self.op not in PATH_OPS and self.path is not None:
            raise InvalidArguments(
                f"op {self.op!r} takes no path: remove 'path', or use can_read, can_write "
                "or resolve"
            )


# --- answers about one path ------------------------------------------------------


def _denied(code: str, message: str, tools: list[str]) -> dict[str, Any]:
    return {"allowed": False, "errorCode": code, "reason": message, "tools": tools}


def _refusal(exc: GatewayError) -> tuple[str, str] | None:
    """(code, message) when ``exc`` is a refusal the call would get; None for a failure
    the call would meet while running (it is not refused for it)."""
    if isinstance(exc, ToolFailed):
        return None
    return str(exc.code), exc.safe_message


def _grant_of(target: ResolvedPath) -> dict[str, Any]:
    grant = target.grant
    return {"path": str(grant.visible_root), "mode": str(grant.mode)}


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _allowed(
    target: ResolvedPath, tools: list[str], *, kind: str | None, note: str | None = None
) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "allowed": True,
        "path": target.visible,
        "type": kind,
        "grant": _grant_of(target),
        "tools": tools,
    }
    if note is not None:
        answer["note"] = note
    return answer


def _listed_mode(target: ResolvedPath) -> int | None:
    """The mode of what fs.list would open at ``target`` (a final symlink followed),
    None when it cannot be opened."""
    try:
        fd, _ = open_listed(target)
    except GatewayError:
        return None
    try:
        return os.fstat(fd).st_mode
    finally:
        os.close(fd)


def _check_readable_file(target: ResolvedPath) -> int:
    """fs.read's checks on ``target``, up to the read; the file's mode.

    Error handling: the GatewayError fs.read would raise there.
    """
    fd = open_for_read(target, os.O_PATH)
    try:
        st = os.fstat(fd)
        if stat.S_ISSOCK(st.st_mode):
            # fs.read's own open of a socket fails so, before any check on a descriptor.
            raise translate_oserror(OSError(errno.ENXIO, os.strerror(errno.ENXIO)), target.visible)
        require_single_link_regular(fd, target.visible)
        check_size(target, st.st_size, TOOL_MAX_READ_FILE_BYTES)
        return st.st_mode
    finally:
        os.close(fd)


def can_read(path: str, grants: Sequence[PathGrant], tools: list[str]) -> dict[str, Any]:
    """Would fs.list (for a directory) or fs.read (for anything else) of ``path`` be
    refused, and with what; blocking."""
    listed = check_path(PathAccess(path=path, access="read", metadata_only=True), grants)
    if isinstance(listed, Deny):
        return _denied(str(listed.code), listed.message, tools)
    mode = _listed_mode(listed)
    if mode is not None and stat.S_ISDIR(mode):
        return _allowed(listed, tools, kind="dir")
    target = check_path(PathAccess(path=path, access="read"), grants)
    if isinstance(target, Deny):
        return _denied(str(target.code), target.message, tools)
    try:
        mode = _check_readable_file(target)
    except GatewayError as exc:
        refused = _refusal(exc)
        if refused is not None:
            return _denied(*refused, tools)
        kind = None if mode is None else _kind(mode)
        return _allowed(target, tools, kind=kind, note=exc.safe_message)
    return _allowed(target, tools, kind=_kind(mode))


def _opens_as_dir(target: ResolvedPath, parts: tuple[str, ...]) -> bool:
    prefix = ResolvedPath(
        grant=target.grant,
        parts=parts,
        visible=str(target.grant.visible_root.joinpath(*parts)),
        access="write",
    )
    try:
        with BeneathRoot(prefix) as root:
            os.close(root.open_dir())
    except GatewayError:
        return False
    return True


def _missing_parent(target: ResolvedPath) -> str | None:
    """When ``target``'s parent did not open: None if fs.write would make the missing
    directories (the first one that does not open is absent), else why it fails.

    Directories that open form a prefix of the parent's components, so the deepest is
    found by bisection: a path of thousands of components costs a few dozen opens.
    """
    parts = target.parts[:-1]
    low, high = 0, len(parts) - 1  # parts[:low] opens; parts[:len(parts)] does not
    while low < high:
        middle = (low + high + 1) // 2
        if _opens_as_dir(target, parts[:middle]):
            low = middle
        else:
            high = middle - 1
    blocker = ResolvedPath(
        grant=target.grant,
        parts=parts[: low + 1],
        visible=str(target.grant.visible_root.joinpath(*parts[: low + 1])),
        access="write",
    )
    try:
        with BeneathRoot(blocker) as root:
            parent_fd, name = root.open_parent()
    except GatewayError as exc:
        return exc.safe_message
    try:
        os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return translate_oserror(exc, blocker.visible).safe_message
    finally:
        os.close(parent_fd)
    return (
        f"'{blocker.visible}' already exists as something that is not a directory, so "
        "fs.write cannot make the directories below it"
    )


def can_write(path: str, grants: Sequence[PathGrant], tools: list[str]) -> dict[str, Any]:
    """Would fs.write (a whole file) of ``path`` be refused, and with what; blocking."""
    target = check_path(PathAccess(path=path, access="write"), grants)
    if isinstance(target, Deny):
        return _denied(str(target.code), target.message, tools)
    try:
        with BeneathRoot(target) as root:
            parent_fd, name = root.open_parent()
    except GatewayError as exc:
        refused = _refusal(exc)
        if refused is not None:
            return _denied(*refused, tools)
        if not target.parts:
            return _allowed(target, tools, kind="dir", note=exc.safe_message)
        note = _missing_parent(target)
        return _allowed(target, tools, kind=None, note=note)
    try:
        existing, _ = replaceable(parent_fd, name, target.visible)
    except GatewayError as exc:
        refused = _refusal(exc)
        if refused is not None:
            return _denied(*refused, tools)
        return _allowed(target, tools, kind=None, note=exc.safe_message)
    finally:
        os.close(parent_fd)
    kind = None if existing is None else _kind(existing.st_mode)
    return _allowed(target, tools, kind=kind)


def _visible_of(fd: int, grant: PathGrant) -> str | None:
    """The visible path of the open descriptor ``fd`` beneath ``grant``'s root, from
    the kernel's own name for it; None when that name is not beneath the root."""
    try:
        host = PurePosixPath(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None
    if not host.is_relative_to(grant.host_root):
        return None
    return str(grant.visible_root.joinpath(host.relative_to(grant.host_root)))


def resolve(path: str, grants: Sequence[PathGrant], tools: list[str]) -> dict[str, Any]:
    """Where ``path`` leads: its grant and normalized visible path, and where a read
    ends up once symlinks inside the root are followed (``target``); blocking."""
    lexical = resolve_path(path, "read", grants)
    if isinstance(lexical, Deny):
        return _denied(str(lexical.code), lexical.message, tools)
    try:
        fd, _ = open_listed(lexical)
    except GatewayError as exc:
        refused = _refusal(exc)
        answer = _allowed(lexical, tools, kind=None, note=exc.safe_message)
        answer["target"] = None
        if refused is not None:
            answer["targetRefused"] = {"errorCode": refused[0], "reason": refused[1]}
        return answer
    try:
        kind = _kind(os.fstat(fd).st_mode)
        target = _visible_of(fd, lexical.grant)
    finally:
        os.close(fd)
    answer = _allowed(lexical, tools, kind=kind)
    answer["target"] = target
    return answer


# --- the run's boundaries --------------------------------------------------------


def _capped(items: Iterable[Any], name: str, truncated: list[str]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        if len(out) >= MAX_LISTED:
            truncated.append(name)
            break
        out.append(item)
    return out


def _path_entry(grant: PathGrant) -> dict[str, Any]:
    return {
        "path": str(grant.visible_root),
        "mode": str(grant.mode),
        "suffixes": list(grant.suffixes) or None,
        "maxFileBytes": grant.max_file_bytes,
    }


def boundaries(ctx: ToolContext, allowed: tuple[str, ...]) -> dict[str, Any]:
    """The run's boundaries in one answer, each list bounded (see the module doc)."""
    run = ctx.run
    if run is None:
        raise ToolFailed(f"{QUERY_TOOL} boundaries describes a run; this call has none")
    policy = run.spec.policy
    truncated: list[str] = []
    net = policy.network
    box = policy.sandbox
    limits = policy.limits
    budget = run.model_budget
    return {
        "paths": _capped(map(_path_entry, run.spec.rules.grants), "paths", truncated),
        "tools": _capped(allowed, "tools", truncated),
        "network": {
            "allowDomains": _capped(net.allow_domains, "network.allowDomains", truncated),
            # Named registry sets whose domains are reachable too (sandbox.exec's
            # packageManagers narrows a command to them).
            "packageManagers": _capped(net.package_managers, "network.packageManagers", truncated),
            "schemes": list(net.schemes),
            "methods": list(net.methods),
            "ports": _capped(net.ports, "network.ports", truncated),
            "proxy": net.proxy_enabled,
            "maxResponseBytes": net.max_response_bytes,
        },
        "models": {
            "aliases": _capped(policy.model_access.models, "models.aliases", truncated),
            "maxRequests": budget.max_requests,
            "maxTokens": budget.max_tokens,
        },
        "env": _capped(policy.env.allow, "env", truncated),
        "limits": {
            "maxRuntimeSec": run.spec.request.limits.maxRuntimeSec,
            "maxMemoryMb": run.spec.request.limits.maxMemoryMb,
            "callTimeoutSec": limits.call_timeout_s,
            "maxOutputBytes": limits.max_output_bytes,
            "callsPerSecond": limits.calls_per_second,
            "burst": limits.burst,
            "maxConcurrentCalls": limits.max_concurrent_calls,
        },
        "sandbox": {
            "osSandbox": run.sandbox is not None,
            "degraded": run.degraded,
            "command": {
                "timeoutSec": box.timeout_s,
                "cpuSec": box.cpu_s,
                "maxProcesses": box.max_processes,
                "maxFileMb": box.max_file_mb,
                "maxOpenFiles": box.max_open_files,
                "maxOutputBytes": box.max_output_bytes,
                "tmpMb": box.tmp_mb,
            },
        },
        "workspace": _workspace(run.workspace_summary()),
        "truncated": truncated,
    }


def _workspace(summary: dict[str, object]) -> dict[str, Any]:
    """The run's workspace mode and what becomes of it at its end, from the run's own
    account of it; never its host paths (base, root). Mode None: the run works on the
    directory it was given as it is (a caller's own session: an agent run's)."""
    return {"mode": summary.get("mode"), "onEnd": summary.get("onEnd")}


# --- the tool --------------------------------------------------------------------

_PATH_ANSWERS: Final[
    dict[
        str, tuple[Callable[[str, Sequence[PathGrant], list[str]], dict[str, Any]], tuple[str, ...]]
    ]
] = {
    "can_read": (can_read, READ_TOOLS),
    "can_write": (can_write, WRITE_TOOLS),
    "resolve": (resolve, READ_TOOLS),
}


async def run_query(args: QueryArgs, ctx: ToolContext) -> dict[str, Any]:
    allowed = ctx.allowed_tools() if ctx.allowed_tools is not None else ()
    if args.op == "boundaries":
        return {"op": args.op, **boundaries(ctx, allowed)}
    answer_for, tool_names = _PATH_ANSWERS[args.op]
    tools = [name for name in tool_names if name in allowed]
    grants = ctx.run.spec.rules.grants if ctx.run is not None else ctx.grants
    path = args.path or ""  # __post_init__: present for every path op
    answer = await in_thread_abandoned_on_cancel(lambda _stop: answer_for(path, grants, tools))
    return {"op": args.op, **answer}


SANDBOX_QUERY: Tool[QueryArgs] = builtin_tool(
    name=QUERY_TOOL,
    summary=(
        "Ask before acting: can_read / can_write / resolve a path (the answer the file "
        "tools would give), or the run's boundaries (paths, network, models, tools, limits)."
    ),
    args_type=QueryArgs,
    run=run_query,
    capabilities=READS_FILES,
    side_effects=False,
)
