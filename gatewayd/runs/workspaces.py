"""A run's virtual workspace: which mode it gets, and how its base is lent and given back.

Every run made from a :class:`~gatewayd.runs.model.RunRequest` (the control socket,
`gatewayd run`) works on a session of the workspace store
(:class:`~gatewayd.workspace.store.WorkspaceStore`): the sandbox and the fs tools see the
session's root, and the host directory (the *base*) changes only as the mode says:

- ``host``: the base itself, with a snapshot to diff against and to restore on discard;
- ``overlay``: a kernel overlayfs over the base; the run writes only the upper directory;
- ``agentfs``: a materialised view whose delta lives in an AgentFS database.

:func:`choose_workspace` decides the mode and what happens at the run's end, by
precedence: the request, then the policy's ``workspace`` section, then the daemon's
``workspace_mode``, then ``overlay``. A request may choose only the modes the policy's
``request_modes`` lists, and may only narrow the policy's keep time and delta limit.

Overlay: the base is lent to the run's uid *before* the overlay is mounted (a lower
layer must not change under a live overlay; :func:`lend_base`), so the sandbox writes the
merged view without a copy-up of every file. The lease lies in the session's directory,
and is given back once the session is sealed (:func:`give_back_base`), or by the store's
recovery after a crash. The policy's read-only paths beneath the workspace and an apps
folder that was there before the run are fenced out of that lease, as a host-mode
run's are.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gatewayd.errors import PolicyViolation
from gatewayd.hostpaths.binding import bind_paths
from gatewayd.policy import Policy
from gatewayd.policy.appsfolder import APPS_DIR_NAME
from gatewayd.policy.paths import PathGrant, PathMode
from gatewayd.policy.workspace_section import (
    DEFAULT_WORKSPACE_MODE,
    OnEndName,
    WorkspaceModeName,
)
from gatewayd.runs.model import WorkspaceRequest
from gatewayd.sandbox.lease import LEASE_FILE, give_back, lend, read_lease
from gatewayd.sandbox.lendable import LendableRoots
from gatewayd.sandbox.limits import HostUser
from gatewayd.sandbox.session import WorkspaceInUse, sandbox_owned
from gatewayd.sandbox.uids import UidRange

_MIB: Final = 1 << 20
# How a run ends when its work is done: asked to by its caller (`gatewayd run`'s command
# exited, the control socket's DELETE, an explicit end). Any other end (its time ran out,
# the daemon stopped, the start failed) interrupts it: its on-end commit is not made.
FINISHED_END_REASONS: Final = frozenset({"ended", "command_exited", "ended_by_operator"})
# The modes whose base is lent to the run's uid before the session is opened (the
# sandbox writes a view whose lower layer is the base itself).
BASE_LENDING_MODES: Final = frozenset({"overlay"})


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkspacePlan:
    """What a run's workspace is: its mode, its fate at the run's end, how long a kept
    session waits, and the delta limit (None: none); ``mode_from`` says who chose the
    mode (``request``, ``policy``, ``configuration`` or ``default``), for the audit."""

    mode: WorkspaceModeName
    on_end: OnEndName
    keep_for_s: int
    max_delta_bytes: int | None
    mode_from: str


def choose_workspace(
    request: WorkspaceRequest | None, policy: Policy, configured: WorkspaceModeName | None
) -> WorkspacePlan:
    """The run's workspace by precedence: request > policy > configuration > overlay.

    Error handling: :class:`PolicyViolation` (``policy_denied``) when the request asks
    for a mode the policy's ``request_modes`` does not list (the message names those it
    does), or for a longer keep time or a larger delta than the policy's.
    """
    section = policy.workspace
    asked = request or WorkspaceRequest()
    mode: WorkspaceModeName
    if asked.mode is not None:
        if asked.mode not in section.request_modes:
            allowed = ", ".join(section.request_modes) or "none"
            raise PolicyViolation(
                f"run refused: its request asks for workspace mode {asked.mode!r}, and "
                f"policy {policy.name!r} lets a request choose only: {allowed} "
                "(workspace.request_modes). Ask for one of those, or leave workspace.mode "
                "out to get the policy's"
            )
        mode, mode_from = asked.mode, "request"
    elif section.mode is not None:
        mode, mode_from = section.mode, "policy"
    elif configured is not None:
        mode, mode_from = configured, "configuration"
    else:
        mode, mode_from = DEFAULT_WORKSPACE_MODE, "default"
    keep_for_s = section.keep_for_s
    if asked.keepForSec is not None:
        if asked.keepForSec > section.keep_for_s:
            raise PolicyViolation(
                f"run refused: its request keeps the workspace for {asked.keepForSec} s, "
                f"longer than policy {policy.name!r} allows ({section.keep_for_s} s, "
                "workspace.keep_for_s); a request may only shorten it"
            )
        keep_for_s = asked.keepForSec
    delta_mb = section.max_delta_mb
    if asked.maxDeltaMb is not None:
        if delta_mb is not None and asked.maxDeltaMb > delta_mb:
            raise PolicyViolation(
                f"run refused: its request allows a workspace delta of {asked.maxDeltaMb} "
                f"MiB, more than policy {policy.name!r} does ({delta_mb} MiB, "
                "workspace.max_delta_mb); a request may only lower it"
            )
        delta_mb = asked.maxDeltaMb
    return WorkspacePlan(
        mode=mode,
        on_end=asked.onEnd or section.on_end,
        keep_for_s=keep_for_s,
        max_delta_bytes=None if delta_mb is None else delta_mb * _MIB,
        mode_from=mode_from,
    )


def refuse_host_paths_into_base(policy: Policy, grants: Sequence[PathGrant], base: Path) -> None:
    """A writable policy path given by an absolute root inside the base would write the
    host directory beside the session, and is already lent with the base: refused with
    the fix (a root relative to the workspace, which is bound in the session's view). So
    is one that holds the base (``/home/op`` for ``/home/op/repo``): bound writable, it
    would show the base itself to the sandbox.

    Error handling: :class:`PolicyViolation`."""
    rules = policy.filesystem.paths
    for grant in grants:
        rule = rules.get(grant.name)
        if rule is None or not rule.is_absolute or grant.mode is not PathMode.RW:
            continue
        if base.is_relative_to(grant.host_root):
            # Bound writable, it would show the base itself, past the session's view.
            raise PolicyViolation(
                f"run refused: policy path {grant.name!r} is {grant.host_root}, which holds "
                f"the workspace {base}, writable; on a virtual workspace the sandbox would "
                "write the host directory through it, past the session. Grant it read-only, "
                "narrow it to paths beside the workspace, or run in workspace mode host"
            )
        if grant.host_root.is_relative_to(base):
            raise PolicyViolation(
                f"run refused: policy path {grant.name!r} is {grant.host_root}, inside the "
                f"workspace {base}, by an absolute root; on a virtual workspace it would "
                "write the host directory beside the session. Write its root relative to "
                "the workspace (it then lies in the session's view), or run in workspace "
                "mode host"
            )


def require_base_free(base: Path, busy: Sequence[Path]) -> None:
    """One base serves one live run at a time when it is lent: it overlaps no tree
    another live run holds. Error handling: :class:`WorkspaceInUse`."""
    for held in busy:
        if base == held or held in base.parents or base in held.parents:
            raise WorkspaceInUse(
                f"{base} overlaps {held}, which a live run holds; one workspace (or rw "
                "policy path) serves one run at a time: end that run or use another "
                "directory"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class BaseLoan:
    """What of a base is lent for an overlay run: ``trees`` (the base, or only its rw
    policy paths when the policy grants the workspace itself read-only) and ``keep``,
    the (device, inode) of what in them stays its owner's."""

    trees: tuple[Path, ...]
    keep: frozenset[tuple[int, int]]
    # The whole base is lent (not only its rw policy paths).
    whole: bool = True


def plan_base_loan(policy: Policy, base: Path) -> BaseLoan:
    """What :class:`BaseLender` lends of ``base`` for a run of ``policy``: the whole base,
    fenced as a host-mode run's workspace is: the policy's read-only paths in it (a run
    could reach them under another name) and an apps folder there before the run (never
    lent: gatewayd.sandbox.appsfolder). A read-only grant on the workspace itself lends
    only the rw policy paths beneath it. Blocking. Error handling: PolicyError from
    binding the policy."""
    grants = [g for g in bind_paths(policy, base) if g.host_root.is_relative_to(base)]
    keep = {g.root_id for g in grants if g.mode is PathMode.RO and g.host_root != base}
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        st = os.stat(base / APPS_DIR_NAME, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            keep.add((st.st_dev, st.st_ino))
    if any(g.mode is PathMode.RO and g.host_root == base for g in grants):
        rw = tuple(g.host_root for g in grants if g.mode is PathMode.RW)
        return BaseLoan(trees=rw, keep=frozenset(keep), whole=False)
    return BaseLoan(trees=(base,), keep=frozenset(keep))


class BaseLender:
    """The store's ``before_mount`` for an overlay run: lends the base to ``user`` with
    the lease recorded in the session's directory (durable before the first chown), where
    the store's recovery finds it after a crash, and the store gives it back when the
    session then fails to open. The directory's fsync after the lease is recorded, made
    whatever is lent, makes the session's ``meta.json`` (written just before) durable
    too: the store leaves that fsync to it (``WorkspaceStore.open_session``)."""

    def __init__(
        self, loan: BaseLoan, user: HostUser, *, roots: LendableRoots, pool_range: UidRange
    ) -> None:
        self._loan = loan
        self._user = user
        self._roots = roots
        self._pool_range = pool_range

    @property
    def whole_base(self) -> bool:
        """Is the whole base lent (not only its rw policy paths)?"""
        return self._loan.whole

    def __call__(self, directory: Path) -> None:
        """Lend (blocking). Error handling: NotLendable / LeaseError from
        :func:`~gatewayd.sandbox.lease.lend` (nothing stays lent)."""
        lend(
            list(self._loan.trees),
            self._user,
            directory,
            roots=self._roots,
            keep=self._loan.keep,
            # A base a sandbox uid owns is another live run's (or a lost lease): lending
            # it again would record the wrong owner to give it back to.
            sandbox_owned=sandbox_owned(self._pool_range),
            sync_record_dir=True,
        )


def give_back_base(directory: Path) -> int:
    """Give back the base lent for the session in ``directory`` (if any) and drop the
    record; returns how many entries changed. Call once the view is unmounted and no
    process of the run's uid is left. Blocking.

    Error handling: LeaseError (the record stays, for the store's recovery)."""
    lease = read_lease(directory)
    if lease is None:
        return 0
    returned = give_back(lease)
    (directory / LEASE_FILE).unlink(missing_ok=True)
    return returned
