"""Every event name gatewayd writes to the audit log, in one registry.

An ``event`` entry names one of these; the writer (``AuditLog.record``) refuses any
other name, and the type of the ``event`` field (``EntryFields``) is this enum, so
mypy catches a bare string. Reading stays lenient: any snake_case name is accepted
(``entry.EventName``), so a log written by another version still verifies.
docs/audit.md lists every member (tests/unit/test_audit_events.py holds them equal).
"""

from __future__ import annotations

import enum

# typing's flag without importing typing: the readers start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final


class AuditEvent(enum.StrEnum):
    """An event gatewayd writes; the comment says when."""

    # -- the log itself
    # Each time the log is opened: pid, the seq it continues, whether the head file was found.
    AUDIT_OPEN = "audit_open"
    # At a clean close, as its last entry.
    AUDIT_CLOSE = "audit_close"
    # At open, before audit_open, when a crash left a torn tail (its line, size, sha256).
    TORN_TAIL_RECOVERED = "torn_tail_recovered"
    # The first entry of a new active segment: names the closed segment before it.
    SEGMENT_OPEN = "segment_open"
    # In place of an event whose fields held a configured secret that could not be scrubbed.
    ENTRY_WITHHELD = "entry_withheld"

    # -- the daemon
    # At start, when a crashed daemon left leases, run directories or network namespaces.
    LEFTOVERS_REMOVED = "leftovers_removed"
    # At every start: whether the OS sandbox and cgroups are available.
    SANDBOX_SUPPORT = "sandbox_support"
    # On SIGHUP, when the configuration was re-read (what changed, what needs a restart).
    CONFIG_RELOADED = "config_reloaded"
    # On SIGHUP, when the configuration file no longer validates: nothing changed.
    CONFIG_RELOAD_FAILED = "config_reload_failed"
    # The checkpointer stopped signing (the log is no extension of the latest checkpoint
    # its key signed), or a checkpoint could not be written (detail: reason); written once
    # per distinct reason, not per attempt.
    AUDIT_CHECKPOINT_FAILED = "audit_checkpoint_failed"
    # A configured witness refused a checkpoint, or answered without a valid cosignature
    # (detail: witness, reason, status); written when its state changes, not per checkpoint.
    WITNESS_REFUSED = "witness_refused"
    # That witness cosigned again after refusing or being unreachable (detail: witness).
    WITNESS_RECOVERED = "witness_recovered"

    # -- a run
    # A run was created (its spec), durable before its sandbox starts.
    RUN_CREATED = "run_created"
    # A run was refused after its request was read (grant, policy, sandbox).
    RUN_REFUSED = "run_refused"
    # A run ended (why, its call tally).
    RUN_ENDED = "run_ended"
    # A run's workspace session was opened, before its sandbox started (mode, base, root).
    WORKSPACE_OPENED = "workspace_opened"
    # That session was sealed at the run's end and its on_end applied (what, the counts).
    WORKSPACE_ENDED = "workspace_ended"
    # A kept session was committed / discarded by the operator (`gatewayd workspace`, the
    # control socket), durable before the base is written (run id, the diff's counts).
    WORKSPACE_COMMITTED = "workspace_committed"
    WORKSPACE_DISCARDED = "workspace_discarded"
    # A kept session past its keep time was discarded by the daemon (run id).
    WORKSPACE_EXPIRED = "workspace_expired"
    # At daemon start, what recovery did to a session a crash left (run id, what).
    WORKSPACE_RECOVERED = "workspace_recovered"
    # A peer was refused on a run's socket (at most one a second per code per run).
    CONNECTION_REFUSED = "connection_refused"
    # A command started in a run (gatewayd run, gatewayd exec, the control route).
    EXEC_STARTED = "exec_started"
    # That command ended (exit code, signal, or the error that stopped it).
    EXEC_ENDED = "exec_ended"
    # A run's in-sandbox services (cogni-tool serve) listen.
    SERVICES_STARTED = "services_started"
    # Those services died while the run went on.
    SERVICES_EXITED = "services_exited"
    # On SIGHUP, a live run's policy file changed and was applied (the sections changed).
    POLICY_RELOADED = "policy_reloaded"
    # On SIGHUP, a live run's new policy changes what its sandbox was built from: kept.
    POLICY_RELOAD_SKIPPED = "policy_reload_skipped"
    # On SIGHUP, a live run's policy file no longer validates: the run keeps its policy.
    POLICY_RELOAD_FAILED = "policy_reload_failed"

    # -- the rule desk
    # A loosening rule change waits for confirmation from outside the sandbox.
    RULE_CHANGE_PENDING = "rule_change_pending"
    # A rule change, durable before the policy file is written.
    RULE_CHANGED = "rule_changed"
    # The file write after a rule_changed failed: that change did not happen.
    RULE_CHANGE_FAILED = "rule_change_failed"
    # A pending rule change was cancelled.
    RULE_CHANGE_CANCELLED = "rule_change_cancelled"

    # -- the egress proxy
    # An allowed egress-proxy connection, durable before it goes out, so a crash
    # mid-tunnel still leaves its destination on the record (invariant 8).
    EGRESS_OPENED = "egress_opened"
    # Every egress-proxy connection when it ends, allowed or refused (bytes, verdict).
    EGRESS = "egress"

    # -- a host-owned agent run (gatewayd agent run)
    # The agent run started (its repository, commit, model and backend).
    AGENT_RUN_STARTED = "agent_run_started"
    # One model turn: tokens, the tool calls asked for, digests of the text.
    AGENT_TURN = "agent_turn"
    # A tool call the model asked for that never became a request.
    AGENT_CALL_REFUSED = "agent_call_refused"
    # The patch the run produced.
    AGENT_PATCH = "agent_patch"
    # The branch was pushed, or the push failed.
    AGENT_PUSH = "agent_push"
    # The pull request was opened, or opening it failed.
    AGENT_PULL_REQUEST = "agent_pull_request"
    # The agent run ended (the result's error code in detail.errorCode).
    AGENT_RUN_ENDED = "agent_run_ended"
    # The agent run could not start: no work directory, a failed clone, no OS sandbox.
    AGENT_RUN_REFUSED = "agent_run_refused"
    # An agent run workflow's end, written by the worker that recorded it (scale-out:
    # the workflow id, the host that ran the run, its audit head there, the branch).
    AGENT_WORKFLOW_COMPLETED = "agent_workflow_completed"

    # -- apps
    # An app folder that discovery could not use (file, line, field, reason): the app is
    # not offered; the other apps are.
    APP_SKIPPED = "app_skipped"
    # An app installed into a workspace's apps/ (app, tool, whether it replaced one and
    # kept its data/, files and bytes copied); written by an install the daemon makes.
    APP_INSTALLED = "app_installed"
    # -- an app's rules (gatewayd/apps/ruledesk.py; detail: app, workspace, action, rule,
    # addedBy, runId: the run that asked, or null for the operator)
    # A loosening change asked from inside a run waits for the operator (confirmationId).
    APP_RULE_PENDING = "app_rule_pending"
    # A change applied, durable before APP.md is written (manifestBefore/After: sha256
    # of the file; confirmationId and confirmedBy for a confirmed one).
    APP_RULE_CHANGED = "app_rule_changed"
    # A change that did not happen: the write after an app_rule_changed failed, or a
    # confirmed change could no longer be made (errorCode, safeMessage say why).
    APP_RULE_CHANGE_FAILED = "app_rule_change_failed"
    # A pending change dropped by the operator (confirmationId, cancelledBy).
    APP_RULE_CANCELLED = "app_rule_cancelled"
    # A caller run prompted an app (detail: app, tool, callerRunId, childRunId,
    # promptDigest, promptBytes, attachments); durable before the app's child run starts.
    APP_INVOKED = "app_invoked"
    # The app's invocation ended (detail: app, callerRunId, childRunId, ok, errorCode,
    # turns, toolCalls, tokens, answerDigest, changed: the data/ files it changed).
    APP_RESULT = "app_result"

    # -- MCP servers' tools (gatewayd/mcp/tools.py, gatewayd/cli/mcp.py)
    # The operator approved a server's tools (detail: server, pinnedBy, tools: each
    # tool's MCP name, gateway name and digest, and which were added, changed, removed).
    MCP_TOOLS_PINNED = "mcp_tools_pinned"
    # A call of a pinned tool refused because the server's live tool is not the one
    # pinned (detail: server, tool, gatewayName, changes: kind and what differs).
    MCP_TOOL_CHANGED = "mcp_tool_changed"
    # A server's pin file failed its checks at a run's start: none of its tools is
    # offered to that run (detail: server, reason).
    MCP_PINS_REFUSED = "mcp_pins_refused"

    # -- approvals (gatewayd/approvals.py; runId, toolCallId, tool; detail.approvalId)
    # A call the policy marks (approvals.required) waits for the operator: durable before
    # anyone is asked (argsDigest, argsSummary, peer; detail: rule, timeoutS, expiresAt).
    APPROVAL_PENDING = "approval_pending"
    # Its end: detail.verdict approved, denied (by the operator, the timeout, or a restart)
    # or withdrawn (the caller left, the run ended); decidedBy, reason, waitedMs.
    APPROVAL_DECIDED = "approval_decided"


# The names the writer accepts. A str subclass hashes as its value, so a member and
# the plain string of a registered name are both found here; nothing else is.
REGISTERED_EVENTS: Final[frozenset[str]] = frozenset(AuditEvent)
