"""The tools that manage the apps of a run's workspace from inside the run:
``app_rules`` (change an app's rules) and ``install_app`` (install an app folder the
caller may read).

Both are built-in tools (:func:`~gatewayd.tools.builtin.builtin_tool`) made per run by
:func:`admin_tools`, bound to that run's workspace and actor. The policy decides who may
call them, like any tool, but only by name: no wildcard of ``tools.allow`` grants them
(:data:`~gatewayd.policy.section.MANAGING_TOOLS`), and no app may take their names.

``app_rules {app_id, action, rule}``: a tightening change (add_deny, remove_allow) is
applied at once and answers ``{"applied": true, ...}``; a loosening one (add_allow,
remove_deny) is never applied from inside a run: the call fails with
``confirmation_required``, and its message holds the confirmation id and the operator's
command (``gatewayd apps rules confirm ID``). The rule's ``addedBy`` is the run's actor
(:func:`~gatewayd.apps.rulechange.added_by_of`). The desk does the work and the audit
(:mod:`gatewayd.apps.ruledesk`).

``install_app {source, replace?}``: ``source`` is a path as the caller sees it; the call
asks to *read* it, so the policy step checks it against the caller's grants (and
refuses the apps folder) before anything runs. The folder is then opened beneath the
grant's root with no symlink followed anywhere on the way (a link out of the grant, or
into the apps folder, is ``policy_denied``), and copied by
:func:`gatewayd.apps.install.install_app` from that descriptor into the run's workspace;
the install is audited (``app_installed``, with the run's id) and the run's apps are
discovered again (``rediscover``), so the new ``app_<id>`` is callable in the same run.
A refused or failed install is ``tool_failed`` with the installer's message, its host
paths replaced by the caller's (``/workspace``).

A replacement (``replace: true``) may not loosen the installed app's rules: one that adds
an allow rule or drops a deny rule would be add_allow or remove_deny without the
operator's confirmation, so it is ``policy_denied`` (judged by the installer under its
lock, on the copy, so the caller cannot change the source after the check).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec
import trio

from gatewayd.apps.install import InstalledApp, InstallError, install_app, record_app_installed
from gatewayd.apps.manifest import MAX_APP_ID_CHARS, AppManifest
from gatewayd.apps.rulechange import MAX_LISTED_RULE_CHARS, added_by_of, loosened_by
from gatewayd.apps.ruledesk import AppRuleDesk, PendingAppRule
from gatewayd.audit import AuditLog
from gatewayd.errors import ConfirmationRequired, PolicyViolation, ToolFailed
from gatewayd.hostpaths.beneath import BeneathRoot
from gatewayd.policy.capabilities import CapabilityRequest
from gatewayd.policy.paths import WORKSPACE_VISIBLE_ROOT, PathAccess, ResolvedPath, shown
from gatewayd.policy.review_section import MAX_RULE_CHARS
from gatewayd.policy.rule_action import RuleAction
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.fs.bounds import READS_FILES, PathArg
from gatewayd.tools.registry import Tool, ToolContext

APP_RULES_TOOL: Final = "app_rules"
INSTALL_APP_TOOL: Final = "install_app"

_DIR_READ_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# Why install_app follows no symlink to its source, as its refusal says it.
_NO_FOLLOW: Final = (
    "install_app follows no symlink to its source, so the folder the policy checked is "
    "the folder copied"
)


class AppRulesArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Change one rule of an app of this workspace: add_deny and remove_allow apply at
    once; add_allow and remove_deny wait for the operator's confirmation
    (confirmation_required, with the id)."""

    app_id: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=MAX_APP_ID_CHARS,
            description="The app's id (its tool is app_<id>, hyphens as underscores).",
        ),
    ]
    action: Annotated[
        Literal["add_deny", "remove_allow", "add_allow", "remove_deny"],
        msgspec.Meta(
            description=(
                "add_deny, remove_allow: applied at once; add_allow, remove_deny: only "
                "once the operator confirms."
            )
        ),
    ]
    rule: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=MAX_RULE_CHARS,
            description="The rule's text; a rule to remove is named by its exact text.",
        ),
    ]


class InstallAppArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Install the app folder at ``source`` (holding APP.md) into this workspace's apps;
    its tool app_<id> is callable once it is installed (if the policy allows it)."""

    source: PathArg
    replace: Annotated[
        bool,
        msgspec.Meta(description="Replace an installed app of the same id, keeping its data/."),
    ] = False


def install_request(args: InstallAppArgs) -> CapabilityRequest:
    """The source is read: the caller's grants decide whether it may be."""
    return CapabilityRequest(paths=(PathAccess(path=args.source, access="read"),))


def admin_tools(
    *,
    workspace: Path,
    actor: str,
    desk: AppRuleDesk,
    audit: AuditLog,
    rediscover: Callable[[], Awaitable[None]],
    state_dir: Path | None,
) -> list[Tool[Any]]:
    """``app_rules`` and ``install_app`` for one run: its ``workspace`` (host path) and
    ``actor`` (its actorId, the ``addedBy`` of the rules it adds); ``rediscover`` makes
    the run's app tools again after an install; ``state_dir`` is passed to the install
    (it records the workspace as holding apps)."""
    added_by = added_by_of(actor)

    async def change_rules(args: AppRulesArgs, ctx: ToolContext) -> Any:
        outcome = await desk.change(
            workspace, args.app_id, RuleAction(args.action), args.rule, added_by, ctx.run_id
        )
        if isinstance(outcome, PendingAppRule):
            raise ConfirmationRequired(_confirmation_message(outcome))
        change = outcome.change
        return {
            "applied": True,
            "app": change.app,
            "action": str(change.action),
            "rule": change.rule,
            "addedBy": change.added_by,
        }

    async def install(args: InstallAppArgs, ctx: ToolContext) -> Any:
        target = ctx.resolved[0]
        installed = await trio.to_thread.run_sync(
            _install_beneath, target, args.replace, workspace, state_dir
        )
        # The app is in place: its entry is written even if the call is being cancelled.
        with trio.CancelScope(shield=True):
            await record_app_installed(audit, installed, run_id=ctx.run_id)
        await rediscover()
        return {
            "installed": installed.id,
            "tool": installed.tool_name,
            "replaced": installed.replaced,
            "keptData": installed.kept_data,
            "files": installed.files,
            "bytes": installed.bytes,
        }

    return [
        builtin_tool(
            name=APP_RULES_TOOL,
            summary=(
                "Change an app's rules: add_deny and remove_allow apply at once; add_allow "
                "and remove_deny wait for the operator's confirmation."
            ),
            args_type=AppRulesArgs,
            run=change_rules,
        ),
        builtin_tool(
            name=INSTALL_APP_TOOL,
            summary=(
                "Install an app folder (holding APP.md) you may read into this workspace; "
                "its tool app_<id> is then callable."
            ),
            args_type=InstallAppArgs,
            run=install,
            requests=install_request,
            capabilities=READS_FILES,
        ),
    ]


def _confirmation_message(pending: PendingAppRule) -> str:
    change = pending.change
    cid = pending.confirmation_id
    rule = _cut(change.rule)
    return (
        f"{change.action} {rule!r} loosens the rules of app {change.app!r}, so it is not "
        f"applied from inside a run: it waits for the operator's confirmation, id {cid}. The "
        f"operator applies it with `gatewayd apps rules confirm {cid}` (or drops it with "
        f"`gatewayd apps rules cancel {cid}`); until then the app's rules are unchanged"
    )


def _install_beneath(
    target: ResolvedPath, replace: bool, workspace: Path, state_dir: Path | None
) -> InstalledApp:
    """Open the source beneath its grant's root, following no symlink, and install it.
    Runs in a worker thread (blocking file work, and the install's lock)."""
    visible = shown(target.visible)
    with BeneathRoot(target, follow_symlinks=False, no_follow_reason=_NO_FOLLOW) as root:
        path_fd = root.open_dir()
    try:
        source_fd = os.open(".", _DIR_READ_FLAGS, dir_fd=path_fd)
    except OSError as exc:
        raise ToolFailed(f"cannot open '{visible}': {exc.strerror}") from None
    finally:
        os.close(path_fd)
    try:
        return install_app(
            Path(visible),
            workspace,
            replace=replace,
            state_dir=state_dir,
            source_fd=source_fd,
            vet=_no_loosening,
        )
    except InstallError as exc:
        raise ToolFailed(_for_caller(str(exc), workspace, state_dir)) from None
    finally:
        os.close(source_fd)


def _no_loosening(new: AppManifest, old: AppManifest | None) -> None:
    """A replacement from inside a run may not loosen the app's rules: that would be
    add_allow or remove_deny without the operator's confirmation (invariant
    LOOSENING_NEEDS_CONFIRMATION). Called by the installer under its lock, on the copy."""
    if old is None:
        return
    added, dropped = loosened_by(old, new)
    if not added and not dropped:
        return
    changes = [f"adds the allow rule {_cut(text)!r}" for text in added]
    changes += [f"drops the deny rule {_cut(text)!r}" for text in dropped]
    raise PolicyViolation(
        f"this replacement of app {new.name!r} loosens its rules ({'; '.join(changes)}), and "
        "no run loosens an app's rules: install it with the installed app's rules or "
        "tighter ones, and ask for each loosening with app_rules (the operator confirms "
        "it), or have the operator install it (`gatewayd apps install SRC --workspace W "
        "--replace`)"
    )


def _cut(text: str) -> str:
    if len(text) <= MAX_LISTED_RULE_CHARS:
        return text
    return text[: MAX_LISTED_RULE_CHARS - 3] + "..."


def _for_caller(message: str, workspace: Path, state_dir: Path | None) -> str:
    """The installer's message as the caller reads it: the workspace's host path as the
    caller sees it, no state directory, and the tool's argument instead of the command
    line's option."""
    message = message.replace(str(workspace), str(WORKSPACE_VISIBLE_ROOT))
    if state_dir is not None:
        message = message.replace(str(state_dir), "gatewayd's state directory")
    return message.replace("with --replace", "with replace: true")
