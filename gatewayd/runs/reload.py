"""Reload (SIGHUP): every live run's policy re-read and applied where it may change under
a live run; gatewayd's configuration re-read, its model aliases applied at once and the
settings that need a restart named. Each outcome is audited.
"""

from __future__ import annotations

import dataclasses

import structlog

from gatewayd.audit import AuditEvent, AuditLog
from gatewayd.config import GatewaydConfig
from gatewayd.dispatch import Dispatcher
from gatewayd.policy import Policy, PolicyError
from gatewayd.policy.rate import TokenBucket
from gatewayd.review.reviewer import Reviewer
from gatewayd.runs.lifecycle import RunManager
from gatewayd.runs.model import Run
from gatewayd.runs.registry import RunRegistry

log = structlog.get_logger("gatewayd.runs.reload")


async def reload_policies(registry: RunRegistry, audit: AuditLog) -> dict[str, str]:
    """Re-read every live run's policy file and apply what may change under a live
    run: the tool allowlist, limits, review, model access and the network allowlist.
    Returns run id -> outcome (``reloaded``, ``unchanged``, ``kept: why``); each
    change or refusal is audited.

    What the run's sandbox was built from (``filesystem``, ``sandbox``, ``env``,
    ``require_os_sandbox``, ``network.proxy``) is fixed for its life: a file that
    changes those is not applied to the live run (it applies to new runs), and the
    run keeps its whole old policy rather than half of the new one. A call in flight
    finishes under the policy it started with; the next call sees the new one.
    """
    outcomes: dict[str, str] = {}
    for run in registry.all():
        if run.spec.made_for is not None:
            # A child run's policy was made for it, from no file: nothing to re-read
            # (an app's review rules are read again at each call anyway).
            outcomes[run.run_id] = "unchanged"
            continue
        source = run.spec.policy_source
        try:
            policy, _ = registry.load_policy(source)
        except PolicyError as exc:
            outcomes[run.run_id] = f"kept: {exc}"
            await _audit_reload(audit, run, AuditEvent.POLICY_RELOAD_FAILED, str(exc))
            continue
        old = run.spec.policy
        if policy == old:
            outcomes[run.run_id] = "unchanged"
            continue
        fixed = [
            name
            for name, before, after in (
                ("filesystem", old.filesystem, policy.filesystem),
                ("sandbox", old.sandbox, policy.sandbox),
                ("env", old.env, policy.env),
                ("require_os_sandbox", old.require_os_sandbox, policy.require_os_sandbox),
                ("network.proxy", old.network.proxy, policy.network.proxy),
            )
            if before != after
        ]
        if fixed:
            why = (
                f"{', '.join(fixed)} changed; the run's sandbox was built from them, so "
                "the new file applies to new runs and this run keeps its policy"
            )
            outcomes[run.run_id] = f"kept: {why}"
            await _audit_reload(audit, run, AuditEvent.POLICY_RELOAD_SKIPPED, why)
            continue
        changed = [
            name for name in type(old).model_fields if getattr(old, name) != getattr(policy, name)
        ]
        _apply_policy(run, policy)
        outcomes[run.run_id] = "reloaded"
        await audit.append(
            "event",
            event=AuditEvent.POLICY_RELOADED,
            runId=run.run_id,
            detail={"policy": policy.name, "source": source, "changed": changed},
        )
        log.info("policy_reloaded", run_id=run.run_id, changed=changed)
    return outcomes


async def reload_config(
    config: GatewaydConfig,
    *,
    runs: RunManager,
    dispatcher: Dispatcher,
    reviewer: Reviewer,
    audit: AuditLog,
) -> list[str]:
    """Apply a re-read configuration: model aliases take effect at once (in the run
    manager's configuration, the dispatcher and the reviewer); settings the running
    daemon was built from are listed back as needing a restart (audited).

    The secrets to scrub are fixed at start (the audit writer holds them): an alias
    change that names another key variable, or a changed ``secret_env``, needs a
    restart too, and until then the aliases stay as they were.
    """
    current = runs.config
    config = config.with_real_dirs()  # as the running daemon's own were made at start
    restart = current.needs_restart(config)
    keys_before = {a.api_key_env for a in current.models.values() if a.api_key_env}
    keys_after = {a.api_key_env for a in config.models.values() if a.api_key_env}
    models_changed = dict(current.models) != dict(config.models)
    if models_changed and keys_after - keys_before:
        restart.append("models (a new key variable must be scrubbed from the start)")
    elif models_changed:
        runs.config = current.model_copy(update={"models": dict(config.models)})
        dispatcher.models = runs.config.models
        reviewer.models = dict(runs.config.models)
    await audit.append(
        "event",
        event=AuditEvent.CONFIG_RELOADED,
        detail={
            "modelsChanged": models_changed and not (keys_after - keys_before),
            "models": sorted(runs.config.models),
            "restartNeeded": restart,
        },
    )
    if restart:
        log.warning("config_reload_needs_restart", settings=restart)
    return restart


async def _audit_reload(audit: AuditLog, run: Run, event: AuditEvent, why: str) -> None:
    log.warning(event.value, run_id=run.run_id, reason=why)
    await audit.append(
        "event",
        event=event,
        runId=run.run_id,
        safeMessage=why,
        detail={"policy": run.spec.policy.name, "source": run.spec.policy_source},
    )


def _apply_policy(run: Run, policy: Policy) -> None:
    """Swap in ``policy`` for the decisions of a live run, in one step (no await): a call
    reads ``run.spec`` once per decision, so it sees the old policy or the new one."""
    spec = run.spec
    run.spec = dataclasses.replace(
        spec,
        policy=policy,
        rules=dataclasses.replace(spec.rules, tool_patterns=tuple(policy.tools.allow)),
    )
    limits = policy.limits
    if (limits.calls_per_second, limits.burst) != (run.bucket.rate, run.bucket.burst):
        run.bucket = TokenBucket(rate=limits.calls_per_second, burst=limits.burst)
    run.limiter.total_tokens = limits.max_concurrent_calls
    run.model_budget.max_requests = policy.model_access.max_requests
    run.model_budget.max_tokens = policy.model_access.max_tokens
    if run.egress is not None:
        run.egress.network = policy.network
