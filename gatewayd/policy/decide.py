"""Pure policy decisions: may this run call this tool on these paths?

Nothing here does I/O. Paths are the agent's view (``/workspace/notes.md`` or
``notes.md``) and are normalized lexically: ``..`` is resolved as text, never by asking
the filesystem, and the result is matched against grants by path components. The fs
tools then open the resolved components beneath the grant's host root without following
symlinks, so the lexical answer is the one that holds on disk.

Every denial says what was refused and what *is* allowed (invariant ACTIONABLE_ERRORS).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from gatewayd.error_codes import ErrorCode
from gatewayd.errors import GatewayError, InvalidArguments, PolicyViolation
from gatewayd.policy.appsfolder import apps_folder_message, in_apps_folder
from gatewayd.policy.paths import (
    MAX_PATH_BYTES,
    WORKSPACE_VISIBLE_ROOT,
    Access,
    PathAccess,
    PathGrant,
    PathMode,
    ResolvedPath,
    shown,
)
from gatewayd.policy.section import tool_pattern_matches

_WORKSPACE_PARTS: Final = WORKSPACE_VISIBLE_ROOT.parts[1:]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRules:
    """Everything :func:`decide` needs about a run, fixed when the run is created."""

    tool_patterns: tuple[str, ...]  # the policy's tools.allow
    run_tool_ids: tuple[str, ...] | None  # the run spec's toolIds (None: policy only)
    grants: tuple[PathGrant, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Allow:
    """The call may go ahead; ``resolved`` holds one entry per requested path, in order."""

    resolved: tuple[ResolvedPath, ...] = ()


_EXCEPTIONS: Final[dict[ErrorCode, type[GatewayError]]] = {
    ErrorCode.POLICY_DENIED: PolicyViolation,
    ErrorCode.INVALID_ARGS: InvalidArguments,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Deny:
    """The call is refused with ``code`` and a message safe to show to the sandbox."""

    code: ErrorCode
    message: str

    def as_error(self) -> GatewayError:
        """The matching :mod:`gatewayd.errors` exception, for code that raises."""
        return _EXCEPTIONS.get(self.code, GatewayError)(self.message)


Decision = Allow | Deny


# --- tools ----------------------------------------------------------------------------


def tool_matches(pattern: str, tool: str) -> bool:
    """``fs.read`` matches itself; ``fs.*`` every tool whose name starts ``fs.``; ``app_*``
    every one-segment continuation of ``app_`` (:func:`.section.tool_pattern_matches`, the
    one matcher of the grammar that validates the patterns)."""
    return tool_pattern_matches(pattern, tool)


def _policy_allows(tool: str, rules: RunRules) -> bool:
    return any(tool_matches(p, tool) for p in rules.tool_patterns)


def tool_allowed(tool: str, rules: RunRules) -> bool:
    """Both the policy's tools.allow and the run's toolIds (exact names, when given)
    must allow ``tool``."""
    if rules.run_tool_ids is not None and tool not in rules.run_tool_ids:
        return False
    return _policy_allows(tool, rules)


def allowed_tools(known: Iterable[str], rules: RunRules) -> tuple[str, ...]:
    """The known tools this run may call, sorted."""
    return tuple(sorted(t for t in set(known) if tool_allowed(t, rules)))


def unmatched_patterns(patterns: Iterable[str], known: Iterable[str]) -> tuple[str, ...]:
    """Entries of a tools.allow list that match no known tool (likely typos)."""
    names = tuple(known)
    return tuple(p for p in patterns if not any(tool_matches(p, t) for t in names))


def _tool_denied(tool: str, rules: RunRules) -> Deny:
    if not rules.tool_patterns:
        what = "This run's policy allows no tools."
    elif rules.run_tool_ids is None:
        what = "Allowed tools: " + ", ".join(rules.tool_patterns)
    else:
        both = [t for t in rules.run_tool_ids if _policy_allows(t, rules)]
        if both:
            what = "Allowed tools: " + ", ".join(both)
        else:
            what = "None of this run's toolIds is allowed by its policy, so no tool is allowed."
    return Deny(
        code=ErrorCode.POLICY_DENIED,
        message=f"tool '{shown(tool)}' is not allowed for this run. {what}",
    )


# --- paths ----------------------------------------------------------------------------


def normalize_path(path: str) -> tuple[str, ...]:
    """The components of the agent's ``path`` after lexical normalization.

    Relative paths start at /workspace. ``.`` and empty components vanish, ``..`` drops
    the previous component and stops at ``/`` (so ``//x`` and ``/../x`` are both ``/x``).
    Everything else is a literal name: ``%2e%2e``, backslashes and look-alike dots are
    not special on Linux, so they are not special here.
    """
    parts: list[str] = [] if path.startswith("/") else list(_WORKSPACE_PARTS)
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
        else:
            parts.append(part)
    return tuple(parts)


def _grant_for(parts: tuple[str, ...], grants: Iterable[PathGrant]) -> PathGrant | None:
    """The grant whose visible root is the longest component prefix of ``parts``."""
    best: PathGrant | None = None
    best_len = -1
    for grant in grants:
        root = grant.visible_root.parts[1:]
        if len(root) > best_len and parts[: len(root)] == root:
            best, best_len = grant, len(root)
    return best


def _path_list(roots: Iterable[str]) -> str:
    return ", ".join(roots) or "none"


def _readable(grants: Sequence[PathGrant]) -> str:
    return _path_list(str(g.visible_root) for g in grants)


def _writable(grants: Sequence[PathGrant]) -> str:
    """Writable roots, each with the read-only grants nested inside it."""
    roots = []
    for g in grants:
        if g.mode is not PathMode.RW:
            continue
        inner = [
            str(o.visible_root)
            for o in grants
            if o.mode is PathMode.RO
            and o.visible_root != g.visible_root
            and o.visible_root.is_relative_to(g.visible_root)
        ]
        roots.append(
            f"{g.visible_root} (except {', '.join(inner)})" if inner else str(g.visible_root)
        )
    return _path_list(roots)


def malformed_path(path: str) -> Deny | None:
    """Refuse (INVALID_ARGS) a path no file can have: empty, with a NUL byte, too long."""
    if not path:
        return Deny(code=ErrorCode.INVALID_ARGS, message="path is empty; name a file or directory")
    if "\x00" in path:
        return Deny(
            code=ErrorCode.INVALID_ARGS,
            message=f"path '{shown(path)}' contains a NUL byte, which no file name can hold",
        )
    size = len(path.encode("utf-8", "surrogatepass"))
    if size > MAX_PATH_BYTES:
        return Deny(
            code=ErrorCode.INVALID_ARGS,
            message=f"path is {size} bytes long; at most {MAX_PATH_BYTES} bytes are allowed",
        )
    return None


def resolve_path(path: str, access: Access, grants: Sequence[PathGrant]) -> ResolvedPath | Deny:
    """Map the agent's ``path`` onto a grant, lexically; refuse what lies outside.

    Empty paths, NUL bytes and over-long paths are INVALID_ARGS; a path outside every
    grant, at or beneath the workspace's apps folder, or a write into a read-only grant,
    is POLICY_DENIED.
    """
    malformed = malformed_path(path)
    if malformed is not None:
        return malformed
    parts = normalize_path(path)
    grant = _grant_for(parts, grants)
    quoted = shown(path)
    if grant is None:
        if access == "write":
            message = (
                f"Cannot write to '{quoted}': path is outside the writable paths.\n"
                f"Writable paths: {_writable(grants)}"
            )
        else:
            message = (
                f"Cannot read '{quoted}': path is outside the readable paths.\n"
                f"Readable paths: {_readable(grants)}"
            )
        return Deny(code=ErrorCode.POLICY_DENIED, message=message)
    below = parts[len(grant.visible_root.parts) - 1 :]
    if grant.apps_parts is not None and in_apps_folder(below, grant.apps_parts):
        folder = grant.visible_root.joinpath(*grant.apps_parts)
        spelled = below[len(grant.apps_parts) - 1]
        message = apps_folder_message(quoted, str(folder), write=access == "write", spelled=spelled)
        return Deny(code=ErrorCode.POLICY_DENIED, message=message)
    if access == "write" and grant.mode is not PathMode.RW:
        return Deny(
            code=ErrorCode.POLICY_DENIED,
            message=(
                f"Cannot write to '{quoted}': path is read-only.\n"
                f"Writable paths: {_writable(grants)}"
            ),
        )
    return ResolvedPath(grant=grant, parts=below, visible="/" + "/".join(parts), access=access)


def _has_allowed_suffix(name: str, suffixes: Iterable[str]) -> bool:
    # Case-sensitive, and the suffix must follow a stem: '.md' alone is a hidden file.
    return any(name.endswith(s) and len(name) > len(s) for s in suffixes)


def check_path(access: PathAccess, grants: Sequence[PathGrant]) -> ResolvedPath | Deny:
    """:func:`resolve_path`, then the grant's suffix rule (files only) and write size."""
    resolved = resolve_path(access.path, access.access, grants)
    if isinstance(resolved, Deny):
        return resolved
    grant = resolved.grant
    quoted = shown(access.path)
    name = resolved.visible.rsplit("/", 1)[-1]
    by_suffix = grant.suffixes and not access.metadata_only
    if by_suffix and not _has_allowed_suffix(name, grant.suffixes):
        return Deny(
            code=ErrorCode.POLICY_DENIED,
            message=(
                f"Cannot access '{quoted}': suffix not allowed.\n"
                f"Allowed suffixes: {', '.join(grant.suffixes)}"
            ),
        )
    limit = grant.max_file_bytes
    over = access.size is not None and limit is not None and access.size > limit
    if access.access == "write" and over:
        return Deny(
            code=ErrorCode.POLICY_DENIED,
            message=(
                f"Cannot write '{quoted}': {access.size} bytes is over the limit.\n"
                f"Maximum allowed: {limit} bytes"
            ),
        )
    return resolved


def check_read_size(resolved: ResolvedPath, size: int) -> Deny | None:
    """For the fs tools after a stat: refuse reading a file over the grant's size limit."""
    limit = resolved.grant.max_file_bytes
    if limit is None or size <= limit:
        return None
    return Deny(
        code=ErrorCode.POLICY_DENIED,
        message=(
            f"Cannot read '{shown(resolved.visible)}': file too large ({size} bytes).\n"
            f"Maximum allowed: {limit} bytes"
        ),
    )


def decide(tool: str, accesses: tuple[PathAccess, ...], rules: RunRules) -> Decision:
    """Whether ``tool`` may run touching ``accesses``; the first refusal wins."""
    if not tool_allowed(tool, rules):
        return _tool_denied(tool, rules)
    resolved = []
    for access in accesses:
        result = check_path(access, rules.grants)
        if isinstance(result, Deny):
            return result
        resolved.append(result)
    return Allow(resolved=tuple(resolved))
