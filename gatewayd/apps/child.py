"""What an app's child run is made of: never more than its caller, and only the app's.

An app's invocation runs as a child run of the caller's (:mod:`gatewayd.apps.invoke`).
Here is what that child may do, built from the caller's run and the app's manifest
(invariant CHILD_NEVER_EXCEEDS_PARENT):

* **Files.** Each path grant of the caller inside its workspace (``/workspace/...``),
  read-only; none of its absolute policy paths. The app's own folder at ``/app``,
  read-only, and its ``data/`` at ``/app/data``, read and write: the one place it
  writes. Other apps' folders stay invisible: the workspace's apps folder is covered in
  the child's sandbox as in every run's, and only the app's own folder is bound beside
  it (:class:`~gatewayd.sandbox.session.SandboxView`).
* **Tools.** read, write, edit, list and exec, nothing else (no app, no model.chat, no
  http.fetch): ``tools.allow`` of its policy.
* **Network.** None: its policy's network section allows no domain, its sandbox has a
  network namespace of its own with nothing in it.
* **Environment.** No host variable passes (``env.allow`` empty).
* **Limits.** The caller's call, sandbox and memory limits; its run lasts the
  invocation's wall time and a little more.
* **Review.** Always on: every call is reviewed against the app's rules by the app's
  review model (or the caller policy's reviewer), and a review that fails denies.

The app's model is its caller's to grant: the caller's policy must allow the alias
(``model_access.models``), and the caller's model budget pays for it (the tool's
request names the alias; :mod:`gatewayd.apps.invoke` charges the budget).
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final

from gatewayd.apps.discovery import DiscoveredApp
from gatewayd.apps.manifest import AppManifest
from gatewayd.conversation import RUN_TOOL_IDS
from gatewayd.policy import Policy
from gatewayd.policy.model import EnvSection, ModelAccessSection, NetworkSection, ToolsSection
from gatewayd.policy.paths import WORKSPACE_VISIBLE_ROOT, PathGrant, PathMode, holds_nested
from gatewayd.policy.review_section import ReviewSection
from gatewayd.runs import ChildKind, ChildSpec, Grant, MadeFor, Run, RunLimits, RunRequest
from gatewayd.sandbox.session import SandboxView

# Where the app sees its own folder, and its data folder in it.
APP_VISIBLE_ROOT: Final = PurePosixPath("/app")
DATA_DIR_NAME: Final = "data"
APP_DATA_VISIBLE_ROOT: Final = APP_VISIBLE_ROOT / DATA_DIR_NAME
# Grant names of the app's own folders: with a colon, which no policy's path name may
# hold, so they never clash with a caller's grant they sit beside.
APP_GRANT: Final = "app:folder"
DATA_GRANT: Final = "app:data"
# The child run outlives the invocation's wall time by this much: enough for its end
# (the sandbox stopped, the data folder given back) to happen inside the run's lifetime.
CHILD_RUN_GRACE_S: Final = 60
# data/ as gatewayd makes it: the daemon's alone until it is lent to the app's run.
DATA_DIR_MODE: Final = 0o700


class AppUnavailable(Exception):
    """The app cannot run for this caller as things are: ``str(exc)`` says why and how to
    fix it (a model alias, a reviewer, the app's folder)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AppModels:
    """The aliases an invocation uses: the app's conversation and its reviewer."""

    model: str
    reviewer: str


def app_models(manifest: AppManifest, caller: Run, known: frozenset[str]) -> AppModels:
    """The app's model (its manifest's, or the first the caller's policy grants) and its
    reviewer (its manifest's, or the caller policy's review model).

    Error handling: AppUnavailable when there is none, when the caller may not use the
    app's model (the policy step has checked a model the manifest names; this covers
    the default) or the review model its manifest names (one the caller's policy grants
    or reviews with), or when an alias is not configured."""
    policy = caller.spec.policy
    granted = policy.model_access.models
    model = manifest.model or (granted[0] if granted else None)
    if model is None:
        raise AppUnavailable(
            f"app {manifest.name!r} names no model, and this run's policy grants none "
            "(model_access.models): grant one, or set model in the app's APP.md"
        )
    if model not in granted:
        raise AppUnavailable(
            f"app {manifest.name!r} uses model {model!r}, which this run's policy does not "
            f"grant (model_access.models: {', '.join(granted) or 'none'}); an app never "
            "gets more than its caller"
        )
    reviewer = manifest.review_model or policy.review.model
    if manifest.review_model is not None and reviewer not in (*granted, policy.review.model):
        # The reviewer reads every call of the app, the caller's files in its arguments:
        # a model the caller's policy neither grants nor reviews with is not the app's
        # to choose.
        raise AppUnavailable(
            f"app {manifest.name!r} asks for review model {reviewer!r}, which this run's "
            f"policy neither grants (model_access.models: {', '.join(granted) or 'none'}) "
            f"nor reviews with (review.model: {policy.review.model or 'none'}); an app "
            "never gets more than its caller"
        )
    if reviewer is None:
        raise AppUnavailable(
            f"app {manifest.name!r} has no reviewer: every call of an app is reviewed, so "
            "set review_model in its APP.md or review.model in the caller's policy"
        )
    for alias in (model, reviewer):
        if alias not in known:
            raise AppUnavailable(
                f"model alias {alias!r} of app {manifest.name!r} is not in gatewayd's "
                f"configuration (aliases: {', '.join(sorted(known)) or 'none'})"
            )
    return AppModels(model=model, reviewer=reviewer)


def review_section(manifest: AppManifest, reviewer: str, settings: ReviewSection) -> ReviewSection:
    """The app's rules as a review section: the model reviews every tool, always, with
    the caller policy's review ``settings`` (its timeout, cache, value cut)."""
    return ReviewSection.model_validate(
        {
            "mode": "llm",
            "model": reviewer,
            "timeout_s": settings.timeout_s,
            "cache": settings.cache.model_dump(),
            "max_value_chars": settings.max_value_chars,
            "rules": {
                "allow": [_rule(rule.text, rule.added_by) for rule in manifest.rules.allow],
                "deny": [_rule(rule.text, rule.added_by) for rule in manifest.rules.deny],
            },
        }
    )


def _rule(text: str, added_by: str | None) -> object:
    return text if added_by is None else {"text": text, "addedBy": added_by}


def ensure_data_dir(app: DiscoveredApp) -> Path:
    """The app's ``data/``, made (the daemon's, 0700) when the app has none yet. Blocking.

    Error handling: AppUnavailable when ``data`` is there and is not a directory."""
    folder_fd = os.open(app.folder, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            st = os.stat(DATA_DIR_NAME, dir_fd=folder_fd, follow_symlinks=False)
        except FileNotFoundError:
            os.mkdir(DATA_DIR_NAME, DATA_DIR_MODE, dir_fd=folder_fd)
            st = os.stat(DATA_DIR_NAME, dir_fd=folder_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise AppUnavailable(
                f"app {app.id!r}: {app.folder / DATA_DIR_NAME} is not a directory; it must be "
                "the app's data folder (move it away; gatewayd makes an empty one)"
            )
    finally:
        os.close(folder_fd)
    return app.folder / DATA_DIR_NAME


def restore_data_dir(data: Path) -> None:
    """Give ``data/`` its mode back (DATA_DIR_MODE) once the app's run has ended: the app
    owned it while lent and may have opened it to everyone, which its give-back (owner
    only, as for any lent tree) keeps. Blocking; never follows a symlink.

    Error handling: OSError when it cannot be opened or changed."""
    fd = os.open(data, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != DATA_DIR_MODE:
            os.fchmod(fd, DATA_DIR_MODE)
    finally:
        os.close(fd)


def child_grants(caller: Run, app: DiscoveredApp, data: Path) -> tuple[PathGrant, ...]:
    """The caller's workspace grants, read-only, then the app's folder (read-only) and
    its data folder (read and write). Blocking (stats the app's folders)."""
    own = [
        _grant(APP_GRANT, app.folder, APP_VISIBLE_ROOT, PathMode.RO),
        _grant(DATA_GRANT, data, APP_DATA_VISIBLE_ROOT, PathMode.RW),
    ]
    inside = _workspace_grants(caller)
    roots = [grant.host_root for grant in (*inside, *own)]
    borrowed = tuple(
        PathGrant(
            name=grant.name,
            host_root=grant.host_root,
            root_id=grant.root_id,
            holds_nested=holds_nested(grant.host_root, roots),
            visible_root=grant.visible_root,
            mode=PathMode.RO,
            suffixes=grant.suffixes,
            max_file_bytes=grant.max_file_bytes,
            apps_parts=grant.apps_parts,
        )
        for grant in inside
    )
    return (*borrowed, *own)


def _workspace_grants(caller: Run) -> list[PathGrant]:
    """The caller's grants inside its workspace (seen beneath /workspace): of the
    caller's paths, all an app may ever read."""
    return [
        grant
        for grant in caller.spec.grants
        if grant.visible_root.is_relative_to(WORKSPACE_VISIBLE_ROOT)
    ]


def _grant(name: str, host: Path, visible: PurePosixPath, mode: PathMode) -> PathGrant:
    st = os.stat(host, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        raise AppUnavailable(f"{host} is not a directory")
    return PathGrant(
        name=name,
        host_root=host,
        root_id=(st.st_dev, st.st_ino),
        holds_nested=name == APP_GRANT,  # data/ lies beneath it
        visible_root=visible,
        mode=mode,
    )


def child_policy(
    caller: Run, app: DiscoveredApp, section: ReviewSection, extra_tools: tuple[str, ...] = ()
) -> Policy:
    """The child run's policy: the five tools and ``extra_tools`` (tools its caller may
    call: its MCP tools), no network, no environment, the caller's limits, the app's
    rules as its review."""
    policy = caller.spec.policy
    return Policy(
        version=1,
        name=app.id,  # an app id is a policy name (and the audit says it is an app's)
        description=f"the app {app.id}, invoked by run {caller.run_id}",
        tools=ToolsSection(allow=(*RUN_TOOL_IDS, *extra_tools)),
        limits=policy.limits,
        require_os_sandbox=policy.require_os_sandbox,
        env=EnvSection(),
        sandbox=policy.sandbox,
        review=section,
        model_access=ModelAccessSection(),
        network=NetworkSection(),
        # The caller's approvals hold for what its app does on its behalf.
        approvals=policy.approvals,
    )


def child_spec(
    caller: Run, app: DiscoveredApp, policy: Policy, grants: tuple[PathGrant, ...], wall_s: float
) -> ChildSpec:
    """The child run of ``caller`` invoking ``app`` for at most ``wall_s`` seconds."""
    request = caller.spec.request
    return ChildSpec(
        parent_run_id=caller.run_id,
        made_for=MadeFor(kind=ChildKind.APP, name=app.id),
        request=RunRequest(
            workspacePath=str(caller.spec.workspace),
            policy=policy.name,
            actorId=request.actorId,
            tenantId=request.tenantId,
            grant=Grant(allowSandbox=True),
            limits=RunLimits(
                maxRuntimeSec=math.ceil(wall_s) + CHILD_RUN_GRACE_S,
                maxMemoryMb=request.limits.maxMemoryMb,
            ),
            taskInput="",
            graphId=f"app:{app.id}",
            billingAccountId=request.billingAccountId,
            sandboxImage=request.sandboxImage,
        ),
        workspace=caller.spec.workspace,
        policy=policy,
        source=f"app {app.id} ({app.folder / 'APP.md'})",
        grants=grants,
    )


def child_view(app: DiscoveredApp, caller: Run) -> SandboxView:
    """The app's sandbox: of the workspace what its caller may read, read-only (all of
    it when the caller's grant of it has no suffix or size rule; otherwise only the
    caller's grants beneath /workspace that have none: a mount cannot keep such a rule,
    so a grant with one is served by the fs tools alone); its own folder shown; commands
    in it; no run socket (every call of the app is its conversation's, counted and
    limited)."""
    inside = _workspace_grants(caller)
    ruled = frozenset(
        grant.host_root for grant in inside if grant.suffixes or grant.max_file_bytes is not None
    )
    whole = any(
        grant.host_root == caller.spec.workspace
        and grant.visible_root == WORKSPACE_VISIBLE_ROOT
        and grant.host_root not in ruled
        for grant in inside
    )
    return SandboxView(
        workspace_read_only=True,
        whole_workspace=whole,
        gateway_socket=False,
        exposed=(app.folder,),
        unmounted=ruled,
        cwd=str(APP_VISIBLE_ROOT),
    )
