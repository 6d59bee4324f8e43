"""The app rule desk: changing an app's allow and deny rules, tightening at once and
loosening only on the operator's confirmation.

| change | asked by a run (``app_rules``) | asked by the operator |
| --- | --- | --- |
| add_deny, remove_allow (tighten) | applied at once | applied at once |
| add_allow, remove_deny (loosen) | pending, with a confirmation id | applied at once |

(The operator's own change, on the control socket, is its own confirmation.)

Invariant LOOSENING_NEEDS_CONFIRMATION: a loosening change asked from inside a run is
never applied by that request; it is applied only by :meth:`AppRuleDesk.confirm`, which
only the control socket (root, never a sandbox) reaches. The desk is the review rule
desk's twin (:mod:`gatewayd.review.ruledesk`): the same actions, the same asymmetry,
events of the same shapes.

Applying a change, whoever asked:

1. ``<workspace>/apps`` is opened by descriptor (never through a symlink) and locked
   with the exclusive ``flock`` installs take (:mod:`gatewayd.apps.install`), so a
   change never interleaves with an install or a replacement of the app: it applies to
   the app as it is once the lock is held, waited for at most
   :data:`~gatewayd.apps.install.INSTALL_LOCK_WAIT_S`;
2. ``APP.md`` is read again, by descriptor, as discovery reads it, the change applied
   (:mod:`gatewayd.apps.rulechange`) and the manifest rendered (checked to read back);
3. the ``app_rule_changed`` entry is made durable (before the effect, invariant 8);
4. ``APP.md`` is replaced atomically in the app's folder by descriptor (a new file,
   fsync, rename, fsync of the folder) with the old file's mode; if that fails,
   ``app_rule_change_failed`` says the change did not happen.

The file is rewritten from its parsed form (:func:`~gatewayd.apps.manifest.render_manifest`):
YAML comments and the body's layout are not kept; every field, the system prompt and
every rule with its ``addedBy`` are.

Pending changes live in the daemon's memory, as the review desk's do: a restart drops
them (the ``app_rule_pending`` entries remain; the run asks again). At most
:data:`MAX_PENDING` wait at once, :data:`MAX_PENDING_PER_RUN` of one run's, so one run
cannot crowd out the others.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import structlog
import trio

from gatewayd.apps.discovery import DiscoveredApp, DiscoveryError, check_app_at, discover_apps
from gatewayd.apps.install import INSTALL_LOCK_WAIT_S
from gatewayd.apps.manifest import (
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    AppManifest,
    app_id_problem,
)
from gatewayd.apps.rulechange import (
    AppRuleChange,
    AppRuleChangeError,
    apply_rule_change,
    render_changed,
)
from gatewayd.audit import MAX_SAFE_MESSAGE_CHARS, AuditEvent
from gatewayd.errors import GatewayError, RateLimited
from gatewayd.files import write_atomically_at
from gatewayd.policy.appsfolder import APPS_DIR_NAME
from gatewayd.policy.rule_action import RuleAction
from gatewayd.protocol import ErrorCode

if TYPE_CHECKING:
    from gatewayd.audit import AuditLog

log = structlog.get_logger("gatewayd.apps.ruledesk")

# A confirmation id: unguessable, so only who was shown it can confirm it (the review
# desk's length, so both read alike: 32 hex digits).
CONFIRMATION_ID_BYTES: Final = 16
# Loosening changes nobody confirms do not pile up for ever (the review desk's cap).
MAX_PENDING: Final = 100
# One run's share of them: a run asking in a loop fills its own share, not everyone's.
MAX_PENDING_PER_RUN: Final = 10
# How often a change waiting for the apps folder's lock tries it again.
_LOCK_POLL_S: Final = 0.05
# Apps listed in an "unknown app" message.
_MAX_LISTED_APPS: Final = 20

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class AppRuleFailed(GatewayError):
    """The change could not be made now for a reason that is not the request's: the
    app's APP.md is not valid, the apps folder is locked for too long, or a file cannot
    be read or written. ``str(exc)`` says which; nothing changed."""

    code = ErrorCode.TOOL_FAILED


class UnknownConfirmation(GatewayError):
    """No pending change has this confirmation id (never one, or confirmed, cancelled or
    dropped by a restart)."""

    code = ErrorCode.BAD_REQUEST


@dataclass(frozen=True, slots=True, kw_only=True)
class AppliedAppRule:
    """A change written to APP.md: the change, and the sha256 of APP.md before and after."""

    change: AppRuleChange
    before: str
    after: str
    confirmation_id: str | None = None
    confirmed_by: str | None = None

    def describe(self) -> dict[str, Any]:
        out = {**self.change.describe(), "manifestBefore": self.before, "manifestAfter": self.after}
        if self.confirmation_id is not None:
            out["confirmationId"] = self.confirmation_id
            out["confirmedBy"] = self.confirmed_by
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingAppRule:
    """A loosening change waiting for the operator: its id, and the change."""

    confirmation_id: str
    change: AppRuleChange

    def describe(self) -> dict[str, Any]:
        return {"confirmationId": self.confirmation_id, **self.change.describe()}


class AppRuleDesk:
    """Changes the rules of the apps of any workspace, with ``audit`` recording each step
    (see the module docstring). One per daemon: it holds the pending changes."""

    def __init__(self, *, audit: AuditLog) -> None:
        self._audit = audit
        self._pending: dict[str, AppRuleChange] = {}
        # The caps are checked and the change parked in one step, not interleaved with
        # another request's (the audit write in between is a checkpoint).
        self._parking = trio.Lock()

    def pending(self) -> dict[str, PendingAppRule]:
        """Loosening changes waiting for confirmation, by confirmation id."""
        return {
            cid: PendingAppRule(confirmation_id=cid, change=change)
            for cid, change in self._pending.items()
        }

    async def change(
        self,
        workspace: Path,
        app_id: str,
        action: RuleAction,
        rule: str,
        added_by: str | None,
        run_id: str | None,
        *,
        by_operator: bool = False,
    ) -> AppliedAppRule | PendingAppRule:
        """Apply a tightening change at once; park a loosening one for confirmation,
        unless ``by_operator`` (the control socket's own change: the operator is the
        confirmer). ``run_id``: the run asking (``app_rules``), None for the operator.

        Error handling: :class:`AppRuleChangeError` (``invalid_args``) for a change that
        cannot be made as asked (an unknown app, a rule not there or already there, a
        full side); :class:`AppRuleFailed` (``tool_failed``) for an app or a file that
        cannot be read or written now; RateLimited when too many changes wait; an
        :class:`~gatewayd.audit.AuditWriteError` when the log cannot be written. Nothing
        changed in any of them.
        """
        if by_operator and run_id is not None:
            # A guard: a run's request never takes the operator's path.
            raise ValueError("an operator's change belongs to no run")
        problem = app_id_problem(app_id)
        if problem is not None:
            raise AppRuleChangeError(problem)
        change = AppRuleChange(
            workspace=os.path.realpath(workspace),
            app=app_id,
            action=action,
            rule=rule.strip(),
            added_by=added_by,
            run_id=run_id,
        )
        if action.loosens and not by_operator:
            return await self._park(change)
        return await self._apply(change, confirmation_id=None, confirmed_by=None)

    async def confirm(self, confirmation_id: str, by: str | None) -> AppliedAppRule:
        """Apply a pending loosening change, checked again against the app as it is now;
        ``by``: who confirms (the operator's name, for the record).

        Error handling: :class:`UnknownConfirmation`; otherwise as :meth:`change`, and a
        pending change that can no longer be made is dropped and audited
        ``app_rule_change_failed``.
        """
        change = self._pending.pop(confirmation_id, None)
        if change is None:
            raise UnknownConfirmation(_unknown(confirmation_id))
        return await self._apply(change, confirmation_id=confirmation_id, confirmed_by=by)

    async def cancel(self, confirmation_id: str, by: str | None = None) -> AppRuleChange:
        """Drop a pending change; audited ``app_rule_cancelled``.

        Error handling: :class:`UnknownConfirmation`."""
        change = self._pending.pop(confirmation_id, None)
        if change is None:
            raise UnknownConfirmation(_unknown(confirmation_id))
        await self._audit.append(
            "event",
            event=AuditEvent.APP_RULE_CANCELLED,
            runId=change.run_id,
            detail={"confirmationId": confirmation_id, "cancelledBy": by, **change.describe()},
        )
        log.info("app_rule_cancelled", confirmation_id=confirmation_id, app=change.app)
        return change

    # -- parking ---------------------------------------------------------------------

    async def _park(self, change: AppRuleChange) -> PendingAppRule:
        # Checked now, so the run learns at once of a rule that is not there or already
        # is, and the operator is never asked to confirm a change that cannot be made.
        await trio.to_thread.run_sync(_check, change)
        async with self._parking:
            # Once on the record, the change is parked even if its call is cancelled.
            with trio.CancelScope(shield=True):
                pending = await self._park_checked(change)
        return pending

    async def _park_checked(self, change: AppRuleChange) -> PendingAppRule:
        if len(self._pending) >= MAX_PENDING:
            raise RateLimited(
                f"{MAX_PENDING} app rule changes already wait for the operator's "
                "confirmation; ask again once they are confirmed or cancelled"
            )
        mine = sum(1 for other in self._pending.values() if other.run_id == change.run_id)
        if change.run_id is not None and mine >= MAX_PENDING_PER_RUN:
            raise RateLimited(
                f"this run already has {mine} app rule changes waiting for the operator's "
                f"confirmation (at most {MAX_PENDING_PER_RUN}); ask again once they are "
                "confirmed or cancelled"
            )
        confirmation_id = secrets.token_hex(CONFIRMATION_ID_BYTES)
        pending = PendingAppRule(confirmation_id=confirmation_id, change=change)
        # On the record before the caller is told the id (durable, like every step).
        await self._audit.append(
            "event",
            event=AuditEvent.APP_RULE_PENDING,
            runId=change.run_id,
            detail=pending.describe(),
        )
        self._pending[confirmation_id] = change
        log.info("app_rule_pending", **pending.describe())
        return pending

    # -- applying --------------------------------------------------------------------

    async def _apply(
        self, change: AppRuleChange, *, confirmation_id: str | None, confirmed_by: str | None
    ) -> AppliedAppRule:
        # A change once begun is finished, whatever cancels its caller: a lock taken in
        # the worker thread must be released, and an app_rule_changed on the record must
        # be followed by the write or by an app_rule_change_failed. Its steps are bounded
        # (the lock's wait, one small file).
        with trio.CancelScope(shield=True):
            applied = await self._apply_shielded(change, confirmation_id, confirmed_by)
        return applied

    async def _apply_shielded(
        self, change: AppRuleChange, confirmation_id: str | None, confirmed_by: str | None
    ) -> AppliedAppRule:
        try:
            locked = await trio.to_thread.run_sync(_lock_and_plan, change)
        except (AppRuleChangeError, AppRuleFailed) as exc:
            if confirmation_id is not None:  # it was pending: its end is on the record
                await self._failed(change, exc, confirmation_id, confirmed_by)
            raise
        try:
            applied = AppliedAppRule(
                change=change,
                before=locked.before,
                after=_digest(locked.text.encode()),
                confirmation_id=confirmation_id,
                confirmed_by=confirmed_by,
            )
            await self._audit.append(
                "event",
                event=AuditEvent.APP_RULE_CHANGED,
                runId=change.run_id,
                detail=applied.describe(),
            )
            try:
                await trio.to_thread.run_sync(locked.write)
            except OSError as exc:
                failed = AppRuleFailed(
                    f"cannot write the {MANIFEST_FILE} of app {change.app!r}: {exc.strerror}; "
                    "the change did not happen"
                )
                await self._failed(change, failed, confirmation_id, confirmed_by)
                raise failed from None
        finally:
            locked.close()
        log.info("app_rule_changed", **applied.describe())
        return applied

    async def _failed(
        self,
        change: AppRuleChange,
        exc: GatewayError,
        confirmation_id: str | None,
        confirmed_by: str | None,
    ) -> None:
        detail = change.describe()
        if confirmation_id is not None:
            detail = {**detail, "confirmationId": confirmation_id, "confirmedBy": confirmed_by}
        await self._audit.append(
            "event",
            event=AuditEvent.APP_RULE_CHANGE_FAILED,
            runId=change.run_id,
            errorCode=str(exc.code),
            safeMessage=str(exc)[:MAX_SAFE_MESSAGE_CHARS],
            detail=detail,
        )


# --- the app's folder, by descriptor (run in a worker thread) ----------------------------


@dataclass(slots=True, kw_only=True)
class _Locked:
    """The apps folder locked and the app's folder open; the rendered APP.md to write."""

    apps_fd: int
    app_fd: int
    text: str
    before: str
    mode: int

    def write(self) -> None:
        write_atomically_at(self.app_fd, MANIFEST_FILE, self.text.encode(), self.mode)

    def close(self) -> None:
        # Closing the apps folder's descriptor releases its lock.
        os.close(self.app_fd)
        os.close(self.apps_fd)


def _check(change: AppRuleChange) -> None:
    """Would ``change`` apply to the app as it is now? (No lock: nothing is written.)"""
    apps_fd = _open_apps_folder(change)
    try:
        app_fd = _open_app_folder(apps_fd, change)
        try:
            manifest, _ = _read(app_fd, change)
        except OSError as exc:
            raise _unreadable(change, exc) from None
        finally:
            os.close(app_fd)
    finally:
        os.close(apps_fd)
    render_changed(apply_rule_change(manifest, change.action, change.rule, change.added_by))


def _lock_and_plan(change: AppRuleChange) -> _Locked:
    """Lock the apps folder, read the app and apply ``change`` to it; the caller writes
    and closes (which unlocks)."""
    apps_fd = _open_apps_folder(change)
    try:
        _lock(apps_fd, change)
        app_fd = _open_app_folder(apps_fd, change)
        try:
            manifest, data = _read(app_fd, change)
            text = render_changed(
                apply_rule_change(manifest, change.action, change.rule, change.added_by)
            )
            st = os.stat(MANIFEST_FILE, dir_fd=app_fd, follow_symlinks=False)
        except OSError as exc:
            os.close(app_fd)
            raise _unreadable(change, exc) from None
        except BaseException:
            os.close(app_fd)
            raise
    except BaseException:
        os.close(apps_fd)  # and with it the lock
        raise
    return _Locked(
        apps_fd=apps_fd,
        app_fd=app_fd,
        text=text,
        before=_digest(data),
        mode=stat.S_IMODE(st.st_mode),
    )


def _open_apps_folder(change: AppRuleChange) -> int:
    """``<workspace>/apps`` open (the workspace followed as given; ``apps`` never)."""
    try:
        ws_fd = os.open(change.workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise AppRuleFailed(
            f"cannot open the workspace {change.workspace}: {exc.strerror}"
        ) from None
    try:
        return os.open(APPS_DIR_NAME, _DIR_FLAGS, dir_fd=ws_fd)
    except FileNotFoundError:
        raise AppRuleChangeError(_no_such_app(change, ())) from None
    except OSError as exc:
        raise AppRuleFailed(
            f"cannot open the apps folder of {change.workspace}: {exc.strerror} (it must be "
            "a real folder, never a link)"
        ) from None
    finally:
        os.close(ws_fd)


def _open_app_folder(apps_fd: int, change: AppRuleChange) -> int:
    """``apps/<id>`` open, never through a link."""
    try:
        return os.open(change.app, _DIR_FLAGS, dir_fd=apps_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            raise AppRuleChangeError(_no_such_app(change, _app_ids(change))) from None
        raise AppRuleFailed(f"cannot open app {change.app!r}: {exc.strerror}") from None


def _lock(apps_fd: int, change: AppRuleChange) -> None:
    """The install's exclusive lock on the apps folder, waited for at most
    INSTALL_LOCK_WAIT_S (a thread: a blocking flock could not be cancelled at all)."""
    deadline = time.monotonic() + INSTALL_LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(apps_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise AppRuleFailed(
                    f"an install into the apps folder of {change.workspace} has run for "
                    f"more than {INSTALL_LOCK_WAIT_S:g} s; ask again when it ends"
                ) from None
            time.sleep(_LOCK_POLL_S)


def _read(app_fd: int, change: AppRuleChange) -> tuple[AppManifest, bytes]:
    """The app's manifest as discovery reads it, and the bytes it was read from."""
    folder = Path(change.workspace, APPS_DIR_NAME, change.app)
    found = check_app_at(app_fd, folder)
    if not isinstance(found, DiscoveredApp):
        raise AppRuleFailed(
            f"app {change.app!r} cannot be used as it is ({found.describe()}), so its rules "
            "are not changed: fix its APP.md first (`gatewayd apps check` lists every problem)"
        )
    if found.manifest.name != change.app:
        raise AppRuleFailed(
            f"the manifest in apps/{change.app}/ names the app {found.manifest.name!r}, not "
            f"{change.app!r}, so discovery skips it and its rules are not changed"
        )
    # The bytes of the same file: the digest ties the audit entry to the file changed.
    # Read as discovery read it: never through a link, never blocking, only a regular
    # file, at most the manifest's cap.
    fd = os.open(MANIFEST_FILE, _READ_FLAGS, dir_fd=app_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise AppRuleFailed(
                f"the {MANIFEST_FILE} of app {change.app!r} was replaced while it was read; "
                "ask again"
            )
        data = b""
        while len(data) <= MAX_MANIFEST_BYTES and (chunk := os.read(fd, 1 << 16)):
            data += chunk
    finally:
        os.close(fd)
    return found.manifest, data


def _unreadable(change: AppRuleChange, exc: OSError) -> AppRuleFailed:
    return AppRuleFailed(f"cannot read the {MANIFEST_FILE} of app {change.app!r}: {exc.strerror}")


def _app_ids(change: AppRuleChange) -> tuple[str, ...]:
    try:
        return tuple(app.id for app in discover_apps(Path(change.workspace)).apps)
    except DiscoveryError:
        return ()


def _no_such_app(change: AppRuleChange, ids: tuple[str, ...]) -> str:
    listed = ", ".join(ids[:_MAX_LISTED_APPS]) or "none"
    more = f", and {len(ids) - _MAX_LISTED_APPS} more" if len(ids) > _MAX_LISTED_APPS else ""
    return (
        f"there is no app {change.app!r} in this workspace; its apps: {listed}{more} "
        "(install one with install_app or `gatewayd apps install`)"
    )


def _unknown(confirmation_id: str) -> str:
    shown = confirmation_id[:64]
    return (
        f"no pending app rule change {shown!r} (confirmed, cancelled, or dropped when "
        "gatewayd restarted); `gatewayd apps rules pending` lists those waiting"
    )


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
