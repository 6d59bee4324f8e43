"""The app runner kind: each app of a run's workspace is a tool, ``app_<id>(prompt)``,
and each call of it is a child run (:mod:`gatewayd.apps.child` says what the child may
do).

When a run starts (:meth:`Apps.tools_for_run`, the run manager's hook), its workspace's
apps are discovered (a skipped app is audited) and each valid one becomes a tool of
that run alone (:meth:`~gatewayd.dispatch.Dispatcher.set_run_tools`), which the run's
policy allows or not like any tool (``app_*`` patterns). A call:

1. is checked by the policy step like any call: the tool allowed, each attachment a path
   the **caller** may read, the app's model an alias the caller's policy grants, within
   the caller's model budget;
2. starts the app's child run (its own uid and network namespace; the workspace
   read-only; its folder at ``/app``, ``data/`` writable), one invocation of an app at a
   time (its data folder is lent to one run at a time);
3. records ``app_invoked`` (durable), then runs the app's conversation on the host
   (:class:`~gatewayd.conversation.Conversation`: the app's system prompt, the five
   tools and the caller's allowed MCP tools, each call through the dispatcher with the
   app's rules as its review, always;
   the limits of its manifest; the caller's model budget charged);
4. ends the child run, lists what changed in ``data/``, records ``app_result``
   (durable), and answers: the app's final answer, or, when a limit stopped it, what it
   said last with the limit's error code (``ok`` false).
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import structlog
import trio

from gatewayd.apps.admintools import admin_tools
from gatewayd.apps.child import (
    APP_DATA_VISIBLE_ROOT,
    APP_VISIBLE_ROOT,
    AppUnavailable,
    app_models,
    child_grants,
    child_policy,
    child_spec,
    child_view,
    ensure_data_dir,
    restore_data_dir,
    review_section,
)
from gatewayd.apps.discovery import (
    DiscoveredApp,
    SkippedApp,
    check_app_folder,
    discover_apps,
    record_skipped_apps,
)
from gatewayd.apps.manifest import MANIFEST_FILE, AppManifest
from gatewayd.apps.ruledesk import AppRuleDesk
from gatewayd.argsummary import sha256_digest
from gatewayd.audit import AuditEvent
from gatewayd.conversation import Conversation, ConversationLimits, ConversationStop, LimitHints
from gatewayd.dispatch import Dispatcher, RunReview
from gatewayd.errors import ArgumentsRejected, PolicyViolation, ToolFailed
from gatewayd.mcp.tools import SOURCE as MCP
from gatewayd.policy import tool_allowed
from gatewayd.policy.capabilities import Capabilities, CapabilityRequest, FileCapability
from gatewayd.policy.decide import malformed_path, normalize_path
from gatewayd.policy.paths import WORKSPACE_VISIBLE_ROOT, PathAccess, PathMode, shown
from gatewayd.policy.review_section import ReviewSection
from gatewayd.review.ruleset import RuleSet
from gatewayd.runs import Run
from gatewayd.runs.lifecycle import RunManager
from gatewayd.tools.builtin import StructDecoder
from gatewayd.tools.manifest import RunnerKind, ToolLimits, ToolManifest
from gatewayd.tools.registry import Tool, ToolContext, ToolRegistry

log = structlog.get_logger("gatewayd.apps")

# A prompt is a task for the app, not a document: attach files for that.
MAX_PROMPT_CHARS: Final = 32_000
# Attachments are named in the app's first message; a few files, not a tree.
MAX_ATTACHMENTS: Final = 32
# The invocation's conversation ends this long before the caller's call times out, so
# its partial answer is returned instead of a bare timeout.
END_MARGIN_S: Final = 5.0
# The shortest conversation worth starting (a model turn and a tool call).
MIN_WALL_S: Final = 1.0
# data/ is compared before and after an invocation entry by entry; past this many
# entries the change list says it stopped counting (a data folder is notes, not a disk).
MAX_DATA_ENTRIES: Final = 20_000
# What an app's data folder may hold when it is called: notes and caches, not a disk.
# One invocation can still add to it (each file within sandbox.max_file_mb); the next
# is refused until the operator prunes it, so the folder grows by one call's writes at
# most past this.
MAX_DATA_BYTES: Final = 1 << 30
# The changed files listed in the answer and the audit entry; the count says the rest.
MAX_CHANGED_SHOWN: Final = 200

# How a limit of an app is raised: in its manifest.
APP_HINTS: Final = LimitHints(
    turns="raise limits.turns in the app's APP.md, or ask for less at once",
    tokens="raise limits.tokens in the app's APP.md, or ask for less at once",
    wall="raise limits.wall_time_s in the app's APP.md, or the caller's limits.call_timeout_s",
    tool_calls="raise limits.tool_calls in the app's APP.md, or ask for less at once",
)

PREAMBLE: Final = """\
You are the app "{title}" ({id}), called by another agent with a request.
Your own folder is /app (read-only); /app/data is yours to write, and what you keep \
there is there the next time you are called. Your caller's workspace is /workspace \
(read-only). Relative paths start at /app.
You have these tools: read (a file), write (a whole file), edit (replace one exact \
occurrence in a file), list (a directory) and exec (a /bin/sh command run in /app, in \
a sandbox with no network). Before it runs, every tool call is checked against your \
rules; a denied call returns the reason, and you may adapt.
When you are done, answer WITHOUT a tool call: that answer is returned to your caller.

"""


_WORKSPACE_PARTS: Final = WORKSPACE_VISIBLE_ROOT.parts[1:]


class AppArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a caller gives an app: a request in plain language, and files of its
    workspace the app should look at (each one the caller may read)."""

    prompt: str
    attachments: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt.strip():
            raise ArgumentsRejected("prompt: tell the app what to do (it is empty)")
        if len(self.prompt) > MAX_PROMPT_CHARS:
            raise ArgumentsRejected(
                f"prompt: at most {MAX_PROMPT_CHARS} characters (this one has "
                f"{len(self.prompt)}); attach files instead of pasting them"
            )
        if len(self.attachments) > MAX_ATTACHMENTS:
            raise ArgumentsRejected(
                f"attachments: at most {MAX_ATTACHMENTS} paths (got {len(self.attachments)})"
            )
        for path in self.attachments:
            # The app sees its caller's workspace and nothing else of the caller's.
            if malformed_path(path) is not None:
                continue  # the policy step says what is wrong with it
            if normalize_path(path)[: len(_WORKSPACE_PARTS)] != _WORKSPACE_PARTS:
                raise ArgumentsRejected(
                    f"attachments: {shown(path)!r} is not a path in the workspace; an app "
                    "sees its caller's workspace only (/workspace/..., or a relative path)"
                )


_ARGS_SCHEMA: Final = msgspec.json.schema(AppArgs)
_WORKSPACE_READS: Final = (FileCapability(path=str(WORKSPACE_VISIBLE_ROOT), mode=PathMode.RO),)


_decode: Final = StructDecoder(AppArgs)


@dataclass(eq=False, kw_only=True)
class LiveRules:
    """An app's rules as its APP.md says now, for each reviewed call: the file is read
    again when it changed (one stat a call otherwise), so a rule change applies at once,
    even to an invocation in progress. A file that no longer parses keeps the rules last
    read (the app's folder is gatewayd's and its operator's alone; no run writes it)."""

    app: DiscoveredApp
    reviewer: str
    subject: str
    # The caller policy's review settings (timeout, cache, value cut), not its rules.
    settings: ReviewSection
    _identity: tuple[int, int, int, int] | None = None
    _current: tuple[ReviewSection, RuleSet] | None = None

    def __post_init__(self) -> None:
        self._current = self._rules(self.app.manifest)

    def __call__(self) -> tuple[ReviewSection, RuleSet]:
        path = self.app.folder / MANIFEST_FILE
        try:
            st = os.stat(path, follow_symlinks=False)
            identity = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
            if identity != self._identity:
                # Read as discovery reads it: no symlink followed, its size capped.
                found = check_app_folder(self.app.folder)
                if not isinstance(found, DiscoveredApp) or found.id != self.app.id:
                    raise ValueError(
                        found.describe()
                        if isinstance(found, SkippedApp)
                        else f"APP.md now names the app {found.id!r}"
                    )
                self._current = self._rules(found.manifest)
                self._identity = identity
        except Exception as exc:  # keep the last rules; the operator's log says why
            log.warning("app_rules_unreadable", app=self.app.id, error=str(exc))
        assert self._current is not None
        return self._current

    def _rules(self, manifest: AppManifest) -> tuple[ReviewSection, RuleSet]:
        section = review_section(manifest, self.reviewer, self.settings)
        return section, RuleSet.from_section(section, subject=self.subject)


@dataclass(frozen=True, slots=True, kw_only=True)
class AppRunner:
    """Runs the calls of one app's tool, for the run whose workspace holds it."""

    apps: Apps
    app: DiscoveredApp

    async def run(self, args: AppArgs, ctx: ToolContext) -> Any:
        return await self.apps.invoke(self.app, args, ctx)


@dataclass(eq=False, kw_only=True)
class Apps:
    """The app runner kind of one daemon: the run manager's hook that gives a run its
    apps, and the invocations."""

    runs: RunManager
    dispatcher: Dispatcher
    # Where app_rules asks for rule changes (loosening ones wait for the operator).
    rule_desk: AppRuleDesk
    # One invocation of an app at a time: its data folder is lent to one run at a time.
    _locks: dict[Path, trio.Lock] = field(default_factory=dict)

    async def tools_for_run(self, run: Run) -> None:
        """Discover the run's workspace's apps and make each a tool of the run's, beside
        ``app_rules`` and ``install_app`` (its policy decides which it may call); again
        after an install. Error handling: DiscoveryError when the workspace cannot be
        read (the run is then refused); a bad app is skipped and audited, never an
        error."""
        discovery = await trio.to_thread.run_sync(discover_apps, run.spec.workspace)
        await record_skipped_apps(self.runs.audit, discovery.skipped, run_id=run.run_id)

        async def rediscover() -> None:
            await self.tools_for_run(run)

        admin = admin_tools(
            workspace=run.spec.workspace,
            actor=run.spec.request.actorId,
            desk=self.rule_desk,
            audit=self.runs.audit,
            rediscover=rediscover,
            state_dir=self.runs.config.state_dir,
        )
        self.dispatcher.set_run_tools(
            run.run_id,
            ToolRegistry([*admin, *(self.app_tool(app) for app in discovery.apps)]),
        )

    def app_tool(self, app: DiscoveredApp) -> Tool[AppArgs]:
        """The tool ``app_<id>`` of ``app``."""
        manifest = app.manifest
        # The invocation's own limit and a margin; the caller's call timeout still caps it.
        timeout = manifest.limits.wall_time_s + END_MARGIN_S
        tool_manifest = ToolManifest(
            name=manifest.tool_name,
            version=_version(manifest),
            summary=manifest.description,
            args_schema=_ARGS_SCHEMA,
            runner=RunnerKind.APP,
            capabilities=Capabilities(
                files=_WORKSPACE_READS,
                model_access=(manifest.model,) if manifest.model else ("*",),
            ),
            limits=ToolLimits(timeout_s=timeout),
            side_effects=True,
        )

        def requests(args: AppArgs) -> CapabilityRequest:
            return CapabilityRequest(
                paths=tuple(PathAccess(path=path, access="read") for path in args.attachments),
                models=(manifest.model,) if manifest.model else (),
            )

        return Tool(
            manifest=tool_manifest,
            decode=_decode,
            requests=requests,
            runner=AppRunner(apps=self, app=app),
        )

    async def invoke(self, app: DiscoveredApp, args: AppArgs, ctx: ToolContext) -> Any:
        """One invocation (the module doc's steps 2-4). Error handling: PolicyViolation
        when the app cannot run for this caller (its model, its reviewer); ToolFailed
        when its child run cannot start; a limit or a failed model call is an answer
        with ``ok`` false, never an error."""
        caller = self.runs.registry.get(ctx.run_id)
        if caller is None:  # the caller's own call is in flight: it cannot have ended
            raise ToolFailed(f"run {ctx.run_id} is ending; the app was not started")
        try:
            models = app_models(app.manifest, caller, frozenset(self.runs.config.models))
        except AppUnavailable as exc:
            raise PolicyViolation(str(exc)) from None
        limits = app.manifest.limits
        call_timeout = caller.spec.policy.limits.call_timeout_s
        wall_s = max(min(limits.wall_time_s, call_timeout - END_MARGIN_S), MIN_WALL_S)
        lock = self._locks.setdefault(app.folder, trio.Lock())
        async with lock:
            try:
                data = await trio.to_thread.run_sync(ensure_data_dir, app)
                grants = await trio.to_thread.run_sync(child_grants, caller, app, data)
            except (AppUnavailable, OSError) as exc:
                raise ToolFailed(
                    f"app {app.id!r} cannot start: {_as_seen(str(exc), caller)}"
                ) from None
            subject = f'the app "{app.id}"'
            live = LiveRules(
                app=app,
                reviewer=models.reviewer,
                subject=subject,
                settings=caller.spec.policy.review,
            )
            # The caller's MCP tools its policy allows: the app may call them too
            # (never more than its caller), each reviewed under the app's rules.
            mcp = ToolRegistry(
                tool
                for name, tool in (self.dispatcher.run_tools(caller.run_id, MCP) or {}).items()
                if tool_allowed(name, caller.spec.rules)
            )
            policy = child_policy(caller, app, live()[0], extra_tools=tuple(mcp))
            before = await trio.to_thread.run_sync(_snapshot, data)
            held = _data_bytes(before)
            if held > MAX_DATA_BYTES or len(before) >= MAX_DATA_ENTRIES:
                what = (
                    f"{held} bytes, over the {MAX_DATA_BYTES}"
                    if held > MAX_DATA_BYTES
                    else f"{MAX_DATA_ENTRIES} entries or more, the most"
                )
                raise ToolFailed(
                    f"app {app.id!r} keeps {what} an app may hold in its data folder "
                    "before it is called again; the operator must prune apps/"
                    f"{app.id}/data in the workspace (it is the app's state, not a disk)"
                )
            try:
                child = await self.runs.start_child(
                    child_spec(caller, app, policy, grants, wall_s),
                    view=child_view(app, caller),
                    review=RunReview(
                        app=app.id, subject=subject, rules=live, budget=ctx.model_budget
                    ),
                )
            except Exception as exc:  # audited as run_refused by the run manager
                raise ToolFailed(
                    f"app {app.id!r} could not start its run: {_as_seen(str(exc), caller)}"
                ) from None
            outcome: dict[str, Any] | None = None
            try:
                self.dispatcher.set_run_tools(child.run_id, mcp, source=MCP)
                outcome = await self._converse(
                    app, args, ctx, caller, child, models.model, wall_s, mcp.manifests()
                )
                return outcome
            finally:
                # Whatever ended it (an answer, a limit, the caller's run ending): the
                # child's sandbox stops and data/ is given back before the list of what
                # changed is made and the answer leaves.
                with trio.CancelScope(shield=True):
                    await self.runs.end(child.run_id, reason="app_finished")
                    try:
                        await trio.to_thread.run_sync(restore_data_dir, data)
                    except OSError as exc:  # the invocation's answer still leaves
                        log.warning("app_data_mode_not_restored", app=app.id, error=str(exc))
                    await self._result_after(app, caller, child, data, before, outcome)

    async def _converse(
        self,
        app: DiscoveredApp,
        args: AppArgs,
        ctx: ToolContext,
        caller: Run,
        child: Run,
        model: str,
        wall_s: float,
        extra: tuple[ToolManifest, ...] = (),
    ) -> Any:
        limits = app.manifest.limits
        attachments = [str(resolved.visible) for resolved in ctx.resolved]
        prompt = args.prompt
        if attachments:
            prompt += "\n\nAttached (read-only, in your caller's workspace):\n" + "\n".join(
                f"- {path}" for path in attachments
            )
        seq = self.runs.audit.record(
            "event",
            event=AuditEvent.APP_INVOKED,
            runId=caller.run_id,
            detail={
                "app": app.id,
                "tool": app.tool_name,
                "callerRunId": caller.run_id,
                "childRunId": child.run_id,
                "promptDigest": sha256_digest(args.prompt.encode()),
                "promptBytes": len(args.prompt.encode()),
                "attachments": attachments,
                "model": model,
            },
        )
        await self.runs.audit.durable(seq)
        conversation = Conversation(
            dispatcher=self.dispatcher,
            audit=self.runs.audit,
            alias=self.runs.config.models[model],
            alias_name=model,
            run=child,
            system=PREAMBLE.format(title=app.manifest.title, id=app.id)
            + app.manifest.system_prompt,
            prompt=prompt,
            limits=ConversationLimits(
                turns=limits.turns,
                tokens=limits.tokens,
                wall_s=wall_s,
                tool_calls=limits.tool_calls,
            ),
            hints=APP_HINTS,
            say=lambda line: log.info("app_progress", app=app.id, line=line),
            path_base=str(APP_VISIBLE_ROOT),
            budget=ctx.model_budget,
            call_prefix=f"app.{app.id}",
            extra=extra,
        )
        outcome: dict[str, Any] = {"app": app.id, "childRunId": child.run_id}
        try:
            with trio.move_on_after(wall_s) as wall:
                await conversation.go()
            if wall.cancelled_caught:
                raise ConversationStop(
                    "timeout",
                    f"the wall time limit ({wall_s:g} s) passed before the app finished; "
                    f"{APP_HINTS.wall}",
                    limit="wall_time",
                )
            outcome.update(ok=True, answer=conversation.final_text or "")
        except ConversationStop as stop:
            outcome.update(
                ok=False,
                errorCode=stop.code,
                limit=stop.limit,
                message=str(stop),
                answer=conversation.last_text,
            )
        outcome.update(
            turns=conversation.turns,
            toolCalls=conversation.tool_calls,
            tokens=conversation.tokens,
        )
        return outcome

    async def _result_after(
        self,
        app: DiscoveredApp,
        caller: Run,
        child: Run,
        data: Path,
        before: Mapping[str, tuple[int, int, int]],
        outcome: dict[str, Any] | None,
    ) -> None:
        """The invocation's end: what changed in data/ (added to ``outcome``, the answer;
        None when the invocation failed), and ``app_result`` (durable)."""
        after = await trio.to_thread.run_sync(_snapshot, data)
        changed = _changed(before, after)
        if outcome is not None:
            outcome["changed"] = [
                f"{APP_DATA_VISIBLE_ROOT}/{path}" for path in changed[:MAX_CHANGED_SHOWN]
            ]
            if len(changed) > MAX_CHANGED_SHOWN:
                outcome["changedMore"] = len(changed) - MAX_CHANGED_SHOWN
        detail: dict[str, Any] = {
            "app": app.id,
            "callerRunId": caller.run_id,
            "childRunId": child.run_id,
            "changed": changed[:MAX_CHANGED_SHOWN],
            "changedCount": len(changed),
            "dataBytes": _data_bytes(after),
        }
        # What an operator reading data/ on the host should not follow or open blindly:
        # symlinks, FIFOs, sockets, devices the app left (gatewayd's tools refuse them).
        odd = sorted(
            path
            for path, (kind, _, _) in after.items()
            if not (stat.S_ISREG(kind) or stat.S_ISDIR(kind))
        )
        if odd:
            detail["notRegular"] = odd[:MAX_CHANGED_SHOWN]
        if outcome is None:
            detail.update(ok=False, errorCode="internal")
        else:
            detail.update(
                ok=outcome["ok"],
                errorCode=outcome.get("errorCode"),
                limit=outcome.get("limit"),
                turns=outcome["turns"],
                toolCalls=outcome["toolCalls"],
                tokens=outcome["tokens"],
                answerDigest=sha256_digest(outcome["answer"].encode()),
            )
        seq = self.runs.audit.record(
            "event", event=AuditEvent.APP_RESULT, runId=caller.run_id, detail=detail
        )
        await self.runs.durable_before_answer(seq)


def _version(manifest: AppManifest) -> str:
    """A label of the manifest as it is (its rules and prompt): a change shows in
    tools.list and in the audit."""
    canonical = manifest.model_dump_json().encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()[:16]


def _snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry beneath ``root`` by relative path: (mode, size, mtime in ns). Follows
    no symlink; stops at MAX_DATA_ENTRIES. Blocking."""
    out: dict[str, tuple[int, int, int]] = {}
    todo = [("", root)]
    while todo and len(out) < MAX_DATA_ENTRIES:
        prefix, directory = todo.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            if len(out) >= MAX_DATA_ENTRIES:
                break
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            rel = prefix + entry.name
            out[rel] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns)
            if stat.S_ISDIR(st.st_mode):
                todo.append((rel + "/", Path(entry.path)))
    return out


def _as_seen(message: str, caller: Run) -> str:
    """``message`` with the workspace's host path as the caller sees it (/workspace):
    the host's layout is the operator's to know, not the sandbox's."""
    return message.replace(str(caller.spec.workspace), str(WORKSPACE_VISIBLE_ROOT))


def _data_bytes(snapshot: Mapping[str, tuple[int, int, int]]) -> int:
    """The bytes the regular files of a snapshot hold."""
    return sum(size for kind, size, _ in snapshot.values() if stat.S_ISREG(kind))


def _changed(
    before: Mapping[str, tuple[int, int, int]], after: Mapping[str, tuple[int, int, int]]
) -> list[str]:
    """The paths added, changed or removed, sorted (a directory's own mtime is not a
    change: its entries say what happened)."""
    paths = set(before) | set(after)
    return sorted(
        path
        for path in paths
        if before.get(path) != after.get(path)
        and not (
            path in before
            and path in after
            and stat.S_ISDIR(before[path][0])
            and stat.S_ISDIR(after[path][0])
        )
    )
