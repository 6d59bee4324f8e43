"""Calls waiting for a person's approval: the pending set, its waiters, its durable record.

The dispatcher asks :meth:`Approvals.ask` for a call the run's policy marks
(``approvals.required``, :mod:`gatewayd.policy.approvals_section`) once the policy and the
review have allowed it and before its ``call`` entry and its run. The call then waits,
in its connection's task, for one of:

- the operator's answer (:meth:`Approvals.decide`: the control socket, ``gatewayd
  approvals approve|deny ID``), recorded with who answered (the control socket peer's uid
  and pid, and the name they give);
- ``approvals.timeout_s`` passing: denied;
- the caller going away (its connection closed) or the run ending (the wait is
  cancelled): withdrawn;
- gatewayd dying: the record left in the state directory is denied at the next start
  (:meth:`Approvals.recover`: "gatewayd restarted"). The caller's connection died with the
  daemon, so nothing can run it after that.

Order of the records, so that a crash at any point leaves a true account: the pending
record file (``STATE/approvals/<id>.json``) is durable first, then the ``approval_pending``
audit entry; only then does the operator see the call. The ``approval_decided`` entry is
durable before the record file is removed and before the call goes on (or is answered),
so a record file left behind always means "never ran". Whoever takes the approval out of
the pending set (the operator, the timeout, the withdrawal) decides it; that takes no
await, so two of them can never both decide one approval.

What waiting costs: no call slot (``limits.max_concurrent_calls`` is taken when the tool
starts, after the approval) and not the call's own time limit (``limits.call_timeout_s``
starts then too): a person answers in minutes, a tool's limit is seconds. What waiting is
bounded by: ``approvals.timeout_s``, :data:`MAX_PENDING_PER_RUN` and
:data:`MAX_PENDING_APPROVALS` (past them a call is refused at once with
``rate_limited``, never queued).

Approval never widens anything: the call runs with the rights the policy gave it, and the
dispatcher checks those again after the wait (a policy reloaded meanwhile applies).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import math
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog
import trio

from gatewayd.argsummary import args_digest, canonical_json, summarize
from gatewayd.audit import AuditEvent, AuditLog, AuditWriteError, Peer
from gatewayd.files import write_atomically
from gatewayd.inputfile import InputFileError, read_input_file
from gatewayd.policy.approvals_section import RequiredApproval
from gatewayd.protocol import ErrorCode, Request
from gatewayd.runs import Run

log = structlog.get_logger("gatewayd.approvals")

# Calls of one run waiting at once. An agent needs one or two answered at a time; more
# is a loop asking faster than a person can read, and each waiting call holds a task,
# its arguments in memory and a record file.
MAX_PENDING_PER_RUN: Final = 8
# Calls of all runs waiting at once: what one operator can take in from one list, and a
# bound on the memory the shown arguments take (times MAX_SHOWN_ARGS_BYTES: 16 MiB).
MAX_PENDING_APPROVALS: Final = 64
# The operator is shown a waiting call's arguments in full (the audit log keeps only their
# digest and summary): a call whose arguments are larger cannot be shown, so it cannot be
# approved, and is denied at once instead.
MAX_SHOWN_ARGS_BYTES: Final = 256 * 1024
# How often a waiting call looks whether its caller is still connected: a caller that
# gave up is withdrawn within this, without a task per connection to watch it.
CALLER_POLL_S: Final = 1.0
# A record file is a few hundred bytes (the summary is capped); more is not ours.
MAX_RECORD_BYTES: Final = 64 * 1024
# Decisions remembered after the fact, so an operator who answers late is told what
# happened ("denied: nobody answered within 300 s") instead of "no such approval".
MAX_REMEMBERED_DECISIONS: Final = 1024
# How long a withdrawal (run ending, gatewayd stopping) waits for its decided entry to
# be durable before it gives up and leaves the record file for the next start to deny.
WITHDRAW_FLUSH_S: Final = 5.0
# What an operator writes: a name, a reason (relayed to the agent with a denial).
MAX_OPERATOR_NAME_CHARS: Final = 200
MAX_DECISION_REASON_CHARS: Final = 500

APPROVALS_DIR: Final = "approvals"
APPROVAL_ID_RE: Final = re.compile(r"[0-9a-f]{32}")
_RECORD_NAME_RE: Final = re.compile(r"([0-9a-f]{32})\.json")
_CONTROL_CHARS_RE: Final = re.compile(r"[\x00-\x1f\x7f]")

APPROVED: Final = "approved"
DENIED: Final = "denied"
WITHDRAWN: Final = "withdrawn"

RESTARTED_REASON: Final = "gatewayd restarted while the call waited for approval; it never ran"


class ApprovalRefused(Exception):
    """The call does not go on: its code (``approval_denied``, or ``rate_limited`` for a
    full pending set) and a message for the agent."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ApprovalNotPending(Exception):
    """An operator's answer to an approval that is not waiting: ``already`` True when it
    was decided before (the message says how), False when no such approval is known."""

    def __init__(self, message: str, *, already: bool) -> None:
        super().__init__(message)
        self.message = message
        self.already = already


class ApprovalStoreError(Exception):
    """The state directory's approvals folder cannot be used (not a directory of ours)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Operator:
    """Who answered: the control socket peer's credentials (what the kernel says) and the
    name they gave (what they say)."""

    uid: int
    pid: int
    name: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"kind": "operator", "uid": self.uid, "pid": self.pid, "name": self.name}


def check_operator_text(value: str | None, what: str, limit: int) -> str | None:
    """An operator's name or reason: bounded, one line of printable text (it is shown to
    the agent and in terminals). ValueError saying what is wrong."""
    if value is None:
        return None
    if len(value) > limit:
        raise ValueError(f"{what} is at most {limit} characters (got {len(value)})")
    if _CONTROL_CHARS_RE.search(value):
        raise ValueError(f"{what} may not hold control characters (newlines, escapes)")
    return value.strip() or None


def _iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).isoformat(timespec="seconds")


@dataclass(eq=False, kw_only=True)
class _Pending:
    approval_id: str
    run_id: str
    tool_call_id: str
    tool: str
    args: Any
    args_digest: str
    args_summary: Any
    peer: Peer
    required: RequiredApproval
    requested_at: float
    deadline: float  # trio's clock
    record: Path
    decided: trio.Event = field(default_factory=trio.Event)
    announced: bool = False  # its approval_pending entry is recorded
    written: bool = False  # its record file exists
    verdict: str | None = None
    decided_by: dict[str, Any] | None = None
    reason: str | None = None
    decided_seq: int | None = None
    decided_at: float | None = None

    def describe(self) -> dict[str, Any]:
        """What the operator is shown of a waiting call: everything, arguments in full."""
        return {
            "approvalId": self.approval_id,
            "runId": self.run_id,
            "toolCallId": self.tool_call_id,
            "tool": self.tool,
            "args": self.args,
            "argsDigest": self.args_digest,
            "rule": self.required.describe(),
            "requestedAt": _iso(self.requested_at),
            "expiresAt": _iso(self.requested_at + self.required.timeout_s),
            "peer": {"pid": self.peer.pid, "uid": self.peer.uid, "gid": self.peer.gid},
        }

    def decision(self) -> dict[str, Any]:
        return {
            "approvalId": self.approval_id,
            "runId": self.run_id,
            "toolCallId": self.tool_call_id,
            "tool": self.tool,
            "verdict": self.verdict,
            "decidedBy": self.decided_by,
            "reason": self.reason,
            "decidedAt": None if self.decided_at is None else _iso(self.decided_at),
        }


class Approvals:
    """The calls of this daemon's runs that wait for approval.

    ``answerable``: whether anyone can answer (this daemon serves a control socket); a
    one-shot ``gatewayd run`` or ``gatewayd agent run`` has none, and a call that needs
    approval there is denied at once rather than left to time out unseen.
    """

    def __init__(
        self,
        audit: AuditLog,
        state_dir: Path,
        *,
        answerable: bool,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.audit = audit
        self.directory = state_dir / APPROVALS_DIR
        self.answerable = answerable
        self.clock = clock
        self._pending: dict[str, _Pending] = {}
        # Reserved before any await, so concurrent calls cannot overshoot the limits.
        self._per_run: collections.Counter[str] = collections.Counter()
        self._recent: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        _own_directory(self.directory)

    # -- the waiting call ------------------------------------------------------------

    async def ask(
        self,
        run: Run,
        req: Request,
        peer: Peer,
        required: RequiredApproval,
        args: Any,
        *,
        caller_gone: Callable[[], bool] | None = None,
    ) -> str:
        """Wait for the operator's answer to this call; returns the approval's id once
        it is approved and its decision durable.

        Error handling: ApprovalRefused when it is not approved (denied, timed out,
        withdrawn because the caller left) or cannot be asked (the pending set is full,
        the arguments are too large to show, nobody can answer). AuditWriteError when
        the audit log cannot take the records (the call must not run). A cancellation
        (the run ending, gatewayd stopping) withdraws it, audited, and passes through.
        """
        shown = canonical_json(args)
        where = f"approvals.required entry {required.index} of this run's policy"
        if len(shown) > MAX_SHOWN_ARGS_BYTES:
            raise ApprovalRefused(
                ErrorCode.APPROVAL_DENIED,
                f"this call of {req.tool} needs the operator's approval ({where}), and its "
                f"arguments ({len(shown)} bytes) are over the {MAX_SHOWN_ARGS_BYTES} bytes "
                "an operator is shown; nobody approves what they cannot read: send a smaller "
                "call",
            )
        if not self.answerable:
            raise ApprovalRefused(
                ErrorCode.APPROVAL_DENIED,
                f"this call of {req.tool} needs the operator's approval ({where}), and this "
                "gatewayd has no control socket to ask on (a one-shot `gatewayd run` or "
                "`gatewayd agent run`); it is denied. Run it under `gatewayd serve`",
            )
        self._reserve(run.run_id)
        approval_id = secrets.token_hex(16)
        now = self.clock()
        pending = _Pending(
            approval_id=approval_id,
            run_id=run.run_id,
            tool_call_id=req.toolCallId,
            tool=req.tool,
            args=args,
            args_digest=args_digest(req.args),
            args_summary=summarize(req.args),
            peer=peer,
            required=required,
            requested_at=now,
            deadline=trio.current_time() + required.timeout_s,
            record=self.directory / f"{approval_id}.json",
        )
        settled = False
        try:
            await self._announce(pending)
            await self._wait(pending, caller_gone)
        except BaseException:
            if self._pending.pop(approval_id, None) is pending or (
                pending.announced and pending.verdict is None
            ):
                self._decide(
                    pending,
                    WITHDRAWN,
                    {"kind": "gatewayd"},
                    "the run ended, gatewayd stopped or the audit log failed while the "
                    "call waited; it never ran",
                )
            raise
        finally:
            self._per_run[run.run_id] -= 1
            if self._per_run[run.run_id] <= 0:
                del self._per_run[run.run_id]
            with trio.CancelScope(shield=True):
                settled = await self._settle(pending)
        if not settled:
            raise AuditWriteError(f"approval {approval_id}: its decision is not durable")
        if pending.verdict == APPROVED:
            return approval_id
        if pending.verdict == WITHDRAWN:
            message = (
                f"this call of {req.tool} was withdrawn while it waited for approval "
                f"(approval {approval_id}): {pending.reason}"
            )
        elif pending.decided_by == {"kind": "timeout"}:
            message = (
                f"this call of {req.tool} needs the operator's approval ({where}) and "
                f"nobody answered within {required.timeout_s:g} s (approvals.timeout_s), "
                f"so it is denied (approval {approval_id}). It never ran; ask again later "
                "or have the operator watch `gatewayd approvals list`"
            )
        else:
            message = (
                f"the operator denied this call of {req.tool} (approval {approval_id}): "
                f"{pending.reason or 'no reason given'}. It never ran"
            )
        raise ApprovalRefused(ErrorCode.APPROVAL_DENIED, message)

    def _reserve(self, run_id: str) -> None:
        """Take a place in the pending set (no await: concurrent calls cannot overshoot)."""
        if self._per_run[run_id] >= MAX_PENDING_PER_RUN:
            raise ApprovalRefused(
                ErrorCode.RATE_LIMITED,
                f"{self._per_run[run_id]} calls of this run already wait for the operator's "
                f"approval (at most {MAX_PENDING_PER_RUN} per run); this one was not asked "
                "about: retry once the operator has answered those",
            )
        if self._per_run.total() >= MAX_PENDING_APPROVALS:
            raise ApprovalRefused(
                ErrorCode.RATE_LIMITED,
                f"{self._per_run.total()} calls already wait for the operator's approval on "
                f"this gatewayd (at most {MAX_PENDING_APPROVALS}); this one was not asked "
                "about: retry later",
            )
        self._per_run[run_id] += 1

    async def _announce(self, pending: _Pending) -> None:
        """Record file durable, then the approval_pending entry durable, then visible."""
        record = {
            "v": 1,
            "approvalId": pending.approval_id,
            "runId": pending.run_id,
            "toolCallId": pending.tool_call_id,
            "tool": pending.tool,
            "argsDigest": pending.args_digest,
            "argsSummary": pending.args_summary,
            "peer": {"pid": pending.peer.pid, "uid": pending.peer.uid, "gid": pending.peer.gid},
            "requestedAt": pending.requested_at,
            "rule": pending.required.describe(),
        }
        data = json.dumps(record, sort_keys=True).encode()
        pending.written = True  # from here a file may exist (the thread is not cancelled)
        await trio.to_thread.run_sync(write_atomically, pending.record, data, 0o600)
        seq = self.audit.record(
            "event",
            event=AuditEvent.APPROVAL_PENDING,
            runId=pending.run_id,
            toolCallId=pending.tool_call_id,
            tool=pending.tool,
            argsDigest=pending.args_digest,
            argsSummary=pending.args_summary,
            peer=pending.peer,
            detail={
                "approvalId": pending.approval_id,
                "rule": pending.required.describe(),
                "timeoutS": pending.required.timeout_s,
                "expiresAt": _iso(pending.requested_at + pending.required.timeout_s),
            },
        )
        pending.announced = True
        await self.audit.durable(seq)
        self._pending[pending.approval_id] = pending
        log.warning(
            "approval_pending",
            approval_id=pending.approval_id,
            run_id=pending.run_id,
            tool=pending.tool,
            answer=f"gatewayd approvals approve|deny {pending.approval_id}",
        )

    async def _wait(self, pending: _Pending, caller_gone: Callable[[], bool] | None) -> None:
        """Until someone decides: the operator, the timeout, or the caller leaving."""
        while not pending.decided.is_set():
            now = trio.current_time()
            if now >= pending.deadline:
                if self._pending.pop(pending.approval_id, None) is pending:
                    self._decide(
                        pending,
                        DENIED,
                        {"kind": "timeout"},
                        f"nobody answered within {pending.required.timeout_s:g} s",
                    )
                return
            with trio.move_on_at(min(pending.deadline, now + CALLER_POLL_S)):
                await pending.decided.wait()
            if (
                not pending.decided.is_set()
                and caller_gone is not None
                and caller_gone()
                and self._pending.pop(pending.approval_id, None) is pending
            ):
                self._decide(
                    pending,
                    WITHDRAWN,
                    {"kind": "gatewayd"},
                    "the caller disconnected while the call waited; it never ran",
                )

    def _decide(
        self, pending: _Pending, verdict: str, by: dict[str, Any], reason: str | None
    ) -> int:
        """Record the decision (never awaits) and wake the waiter; returns the entry's seq.
        The caller has just taken ``pending`` out of the pending set (or it never got in)."""
        pending.verdict = verdict
        pending.decided_by = by
        pending.reason = reason
        pending.decided_at = self.clock()
        seq = self.audit.record(
            "event",
            event=AuditEvent.APPROVAL_DECIDED,
            runId=pending.run_id,
            toolCallId=pending.tool_call_id,
            tool=pending.tool,
            detail={
                "approvalId": pending.approval_id,
                "verdict": verdict,
                "decidedBy": by,
                "reason": reason,
                "waitedMs": round((pending.decided_at - pending.requested_at) * 1000, 3),
            },
        )
        pending.decided_seq = seq
        pending.decided.set()
        self._recent[pending.approval_id] = pending.decision()
        while len(self._recent) > MAX_REMEMBERED_DECISIONS:
            self._recent.popitem(last=False)
        log.info("approval_decided", approval_id=pending.approval_id, verdict=verdict)
        return seq

    async def _settle(self, pending: _Pending) -> bool:
        """After the wait: the decision durable, then the record file removed. False when
        the decision could not be made durable: the file stays, and the next start denies
        it ("never ran" stays true: the call does not go on)."""
        if pending.decided_seq is not None:
            # Only a withdrawal gives up waiting: an operator's or the timeout's verdict
            # waits for its entry like any call's, so what the operator was told (and the
            # one approval_decided entry) is what happened.
            bound = WITHDRAW_FLUSH_S if pending.verdict == WITHDRAWN else math.inf
            with trio.move_on_after(bound) as flush:
                try:
                    await self.audit.durable(pending.decided_seq)
                except AuditWriteError:
                    log.error("approval_decision_not_durable", approval_id=pending.approval_id)
                    return False
            if flush.cancelled_caught:
                return False
        elif pending.announced:
            return False  # a pending entry with no decision: leave it to the restart
        if pending.written:
            with contextlib.suppress(FileNotFoundError):
                await trio.to_thread.run_sync(_remove, pending.record)
        return True

    # -- the operator ----------------------------------------------------------------

    def pending(self) -> list[dict[str, Any]]:
        """Every waiting call, oldest first, as the operator is shown it."""
        waiting = sorted(self._pending.values(), key=lambda p: p.requested_at)
        return [p.describe() for p in waiting]

    async def decide(
        self, approval_id: str, *, approve: bool, by: Operator, reason: str | None = None
    ) -> dict[str, Any]:
        """The operator's answer: the waiting call goes on (approved) or is refused with
        ``approval_denied`` carrying ``reason``. Returns the decision once it is durable.

        Error handling: ApprovalNotPending for an id that is not waiting (decided
        already: the message says how; or unknown). AuditWriteError when the decision
        cannot be made durable (the call then does not run either).
        """
        pending = self._pending.pop(approval_id, None)
        if pending is None:
            earlier = self._recent.get(approval_id)
            if earlier is not None:
                raise ApprovalNotPending(
                    f"approval {approval_id} was already decided: {earlier['verdict']} "
                    f"({earlier['reason'] or _by_words(earlier['decidedBy'])}) at "
                    f"{earlier['decidedAt']}",
                    already=True,
                )
            raise ApprovalNotPending(
                f"no call waits for approval {approval_id}; `gatewayd approvals list` "
                "shows those that do (a decided one is in the audit log: approval_decided)",
                already=False,
            )
        seq = self._decide(pending, APPROVED if approve else DENIED, by.describe(), reason)
        await self.audit.durable(seq)
        return pending.decision()

    # -- the restart -----------------------------------------------------------------

    async def recover(self) -> list[str]:
        """At start, before any run: every call a dead gatewayd left waiting is denied
        ("gatewayd restarted"), with its call and result entries; then its record is
        removed. Returns their approval ids.

        Error handling: AuditWriteError when the entries cannot be made durable (the
        records stay, for the next start).
        """
        found = await trio.to_thread.run_sync(_leftovers, self.directory)
        if not found:
            return []
        last = 0
        for path, record in found:
            approval_id = str(record.get("approvalId") or path.name.removesuffix(".json"))
            common: dict[str, Any] = {
                "runId": _text(record.get("runId")),
                "toolCallId": _text(record.get("toolCallId")),
                "tool": _text(record.get("tool")),
            }
            self.audit.record(
                "event",
                event=AuditEvent.APPROVAL_DECIDED,
                **common,
                detail={
                    "approvalId": approval_id,
                    "verdict": DENIED,
                    "decidedBy": {"kind": "gatewayd"},
                    "reason": RESTARTED_REASON,
                    "recordReadable": bool(record),
                },
            )
            message = f"{RESTARTED_REASON} (approval {approval_id})"
            self.audit.record(
                "call",
                **common,
                argsDigest=_text(record.get("argsDigest")),
                argsSummary=_summary(record.get("argsSummary")),
                decision="deny",
                errorCode=str(ErrorCode.APPROVAL_DENIED),
                safeMessage=message,
                peer=_peer(record.get("peer")),
            )
            last = self.audit.record(
                "result",
                **common,
                errorCode=str(ErrorCode.APPROVAL_DENIED),
                safeMessage=message,
                durationMs=0.0,
            )
        await self.audit.durable(last)
        await trio.to_thread.run_sync(_remove_all, [path for path, _ in found])
        ids = [str(r.get("approvalId") or p.name.removesuffix(".json")) for p, r in found]
        log.warning("approvals_denied_at_start", approvals=ids, reason=RESTARTED_REASON)
        return ids


def _by_words(by: Mapping[str, Any] | None) -> str:
    if not by:
        return "by nobody"
    if by.get("kind") == "operator":
        return f"by uid {by.get('uid')}" + (f" ({by['name']})" if by.get("name") else "")
    return f"by {by.get('kind')}"


def _text(value: Any) -> str | None:
    """A string field of a record file, or None (the file is ours, but a crash or a
    hand may have left it short)."""
    return value[:1000] if isinstance(value, str) else None


def _summary(value: Any) -> Mapping[str, Any] | None:
    return value if isinstance(value, dict) else None


def _peer(value: Any) -> Peer | None:
    if not isinstance(value, dict):
        return None
    try:
        return Peer(pid=int(value["pid"]), uid=int(value["uid"]), gid=int(value["gid"]))
    except (KeyError, TypeError, ValueError):
        return None


def _own_directory(path: Path) -> None:
    """The approvals folder: made 0700 if missing; refused unless it is a directory
    (never followed through a link: records are removed by name in it)."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ApprovalStoreError(
            f"{path} must be gatewayd's directory of pending approvals, and it is not a "
            "directory (a link or a file); remove it and start gatewayd again"
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def _leftovers(directory: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The record files in ``directory`` ({} for one that cannot be read); a write's
    temporary file left by a crash (never renamed: its call was never announced) is
    removed."""
    found: list[tuple[Path, dict[str, Any]]] = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        path = Path(entry.path)
        if not _RECORD_NAME_RE.fullmatch(entry.name):
            if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                _remove(path)
            continue
        try:
            raw = read_input_file(path, max_bytes=MAX_RECORD_BYTES, what="an approval record")
            record = json.loads(raw)
        except (InputFileError, ValueError):
            record = {}
        found.append((path, record if isinstance(record, dict) else {}))
    return found


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _remove_all(paths: list[Path]) -> None:
    for path in paths:
        _remove(path)
