"""The run registry: the runs one daemon serves, each under ``state_dir/runs/<runId>/``.

:meth:`RunRegistry.create` refuses a request without the sandbox grant, loads and binds
its policy, makes the run id (:func:`~gatewayd.runs.model.new_run_id`) and the run's
private directory holding its socket.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import stat
from pathlib import Path
from typing import Final

import trio

from gatewayd.errors import AuthzDenied
from gatewayd.hostpaths.binding import bind_paths
from gatewayd.hostpaths.otherapps import guard_apps_folders
from gatewayd.policy import Policy, RunRules, TokenBucket
from gatewayd.policyfile import PolicyLoader
from gatewayd.runs.model import ChildSpec, ModelBudget, Run, RunRequest, RunSpec, new_run_id
from gatewayd.sandbox.plan import SOCKET_NAME

# A unix socket path must fit in sun_path (108 bytes including the NUL).
MAX_SOCKET_PATH: Final = 107
PRIVATE_DIR_MODE: Final = 0o700
# The state directory and runs/: nobody but root may list or create anything, but a
# run's uid may pass through to its own directory (root:<run gid> 0710), whose socket
# bwrap binds into the sandbox while running as that uid. Run ids are 128-bit secrets,
# so passing through without listing reveals nothing.
PASS_THROUGH_DIR_MODE: Final = 0o711


def make_private_dir(path: Path, mode: int = PRIVATE_DIR_MODE) -> None:
    """Create ``path`` as a ``mode`` directory owned by us, refusing anything else there."""
    path.mkdir(mode=mode, parents=False, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise RuntimeError(f"{path} exists and is not a directory owned by uid {os.geteuid()}")
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


class RunRegistry:
    """The runs this daemon serves, under ``state_dir/runs/<runId>/``."""

    def __init__(self, state_dir: Path, *, policy_loader: PolicyLoader) -> None:
        self.state_dir = state_dir
        self.runs_dir = state_dir / "runs"
        self._load_policy = policy_loader
        self._runs: dict[str, Run] = {}
        state_dir.mkdir(mode=PASS_THROUGH_DIR_MODE, parents=True, exist_ok=True)
        make_private_dir(state_dir, PASS_THROUGH_DIR_MODE)
        make_private_dir(self.runs_dir, PASS_THROUGH_DIR_MODE)

    @property
    def policies(self) -> PolicyLoader:
        """What finds and loads the runs' policies (and keeps what it parsed)."""
        return self._load_policy

    def load_policy(self, ref: str) -> tuple[Policy, str]:
        """A policy by name or by path (gatewayd's own use: a live run's source file, the
        local command line): (policy, source path)."""
        return self._load_policy(ref)

    def load_policy_by_name(self, name: str) -> tuple[Policy, str]:
        """A policy by name only, from the configured policy directories (what the
        control socket may ask for): (policy, source path)."""
        return self._load_policy.by_name(name)

    def get(self, run_id: str) -> Run | None:
        return self._runs.get(run_id)

    def all(self) -> list[Run]:
        return list(self._runs.values())

    def create(self, request: RunRequest, *, policy_paths: bool = False) -> Run:
        """Make a run from ``request``; raises AuthzDenied without the sandbox grant.
        ``policy_paths``: the request's ``policy`` may name a file (gatewayd's own
        command line); otherwise it is a name in the configured policy directories.

        Error handling: AuthzDenied when the grant lacks allowSandbox; PolicyError when
        the policy cannot be loaded or bound; ValueError for a bad workspace;
        OtherAppsFolderHeld when the workspace or a policy path holds or lies in another
        workspace's apps folder; AppsRecordError when gatewayd's record of those cannot
        be read (gatewayd/hostpaths/otherapps.py).
        """
        if not request.grant.allowSandbox:
            raise AuthzDenied(
                "run refused: its grant lacks allowSandbox: true. Sandbox runs need a "
                "system grant; they cannot be started from a user-facing request."
            )
        workspace = Path(request.workspacePath)
        if not workspace.is_absolute():
            raise ValueError(f"workspacePath must be absolute, got {request.workspacePath!r}")
        if not workspace.is_dir():
            raise ValueError(f"workspacePath {request.workspacePath!r} is not a directory")
        workspace = workspace.resolve(strict=True)
        if policy_paths:
            policy, source = self._load_policy(request.policy)
        else:
            policy, source = self._load_policy.by_name(request.policy)
        grants = bind_paths(policy, workspace)
        # Before anything of the run exists: no run holds another workspace's apps.
        guard_apps_folders(self.state_dir, workspace, grants)
        rules = RunRules(
            tool_patterns=tuple(policy.tools.allow),
            run_tool_ids=request.toolIds,
            grants=grants,
        )
        run_id, directory, socket_path = self._new_directory()
        spec = RunSpec(
            runId=run_id,
            request=request,
            workspace=workspace,
            policy=policy,
            policy_source=source,
            grants=grants,
            rules=rules,
        )
        return self._add(spec, directory, socket_path)

    def rebind(self, run: Run, root: Path) -> None:
        """Make ``root`` (a workspace session's view of the run's workspace) what the
        run's sandbox binds and its fs tools resolve beneath: its policy is bound again
        against it, so policy paths beneath the workspace lead into the view, and those
        outside it stay the host paths they were.

        Error handling: PolicyError when a policy path cannot be bound in the view.
        """
        spec = run.spec
        grants = bind_paths(spec.policy, root)
        rules = RunRules(
            tool_patterns=tuple(spec.policy.tools.allow),
            run_tool_ids=spec.request.toolIds,
            grants=grants,
        )
        run.spec = dataclasses.replace(spec, workspace=root, grants=grants, rules=rules)

    def create_child(self, spec: ChildSpec) -> Run:
        """Make a child run (an app's invocation) from the spec its parent's tool made:
        its policy, grants and workspace are given, not loaded (the caller made them no
        more than the parent's). Error handling: ValueError when the state directory's
        path is too long for a socket."""
        run_id, directory, socket_path = self._new_directory()
        rules = RunRules(
            tool_patterns=tuple(spec.policy.tools.allow), run_tool_ids=None, grants=spec.grants
        )
        run_spec = RunSpec(
            runId=run_id,
            request=spec.request,
            workspace=spec.workspace,
            policy=spec.policy,
            policy_source=spec.source,
            grants=spec.grants,
            rules=rules,
            parent_run_id=spec.parent_run_id,
            made_for=spec.made_for,
        )
        return self._add(run_spec, directory, socket_path)

    def _new_directory(self) -> tuple[str, Path, Path]:
        run_id = new_run_id()
        directory = self.runs_dir / run_id
        socket_path = directory / SOCKET_NAME
        if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
            raise ValueError(
                f"state directory {self.state_dir} is too long for a unix socket path; "
                "choose a shorter --state-dir"
            )
        directory.mkdir(mode=0o700)  # a fresh id: an existing directory is an error
        return run_id, directory, socket_path

    def _add(self, spec: RunSpec, directory: Path, socket_path: Path) -> Run:
        policy = spec.policy
        limits = policy.limits
        run = Run(
            spec=spec,
            directory=directory,
            socket_path=socket_path,
            bucket=TokenBucket(rate=limits.calls_per_second, burst=limits.burst),
            model_budget=ModelBudget(
                max_requests=policy.model_access.max_requests,
                max_tokens=policy.model_access.max_tokens,
            ),
            limiter=trio.CapacityLimiter(limits.max_concurrent_calls),
        )
        self._runs[spec.runId] = run
        return run

    def remove(self, run: Run) -> None:
        """Forget ``run`` and delete its directory (socket included)."""
        self._runs.pop(run.run_id, None)
        shutil.rmtree(run.directory, ignore_errors=True)

    async def delete_directory(self, run: Run) -> None:
        """Delete the run's directory (its socket, records and mount points) in a worker
        thread (on a busy disk each unlink and rmdir can take milliseconds, which the
        event loop must not wait out), the run still known: once its sandbox is closed
        nothing there is read again, so the rest of its end need not wait for it.
        Shielded: a directory half deleted by a cancelled end would be the next start's
        leftover."""
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(
                functools.partial(shutil.rmtree, run.directory, ignore_errors=True)
            )

    def discard(self, run: Run) -> None:
        """Forget ``run``, whose directory :meth:`delete_directory` deleted."""
        self._runs.pop(run.run_id, None)

    def forget(self, run: Run) -> None:
        """Forget ``run`` but keep its directory: it holds a lease record that the next
        daemon start must still give back."""
        self._runs.pop(run.run_id, None)
        (run.directory / SOCKET_NAME).unlink(missing_ok=True)
