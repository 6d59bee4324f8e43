"""A one-shot run's course, the same wherever its daemon lives: ``gatewayd run`` opening a
daemon in its own process, or a serving daemon running it for a ``gatewayd run`` attached
to its control socket (``POST /v1/runs/attach``, gatewayd/control.py).

The run is started, its command run in its sandbox with its standard streams relayed
(:class:`~gatewayd.sandbox.passthrough.Passthrough`), the run ended, and each step said on
a line for the operator's stderr (``say``: printed in gatewayd's own process, sent to the
attached client by a serving daemon); the command's end becomes gatewayd's exit status
(gatewayd/exitstatus.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

import structlog
import trio

from gatewayd.audit import AuditWriteError
from gatewayd.errors import GatewayError
from gatewayd.exitstatus import EXIT_FAILED, EXIT_MAX_RUNTIME, describe_exec, exec_status
from gatewayd.policy import PolicyError

if TYPE_CHECKING:
    from gatewayd.runs.lifecycle import RunManager
    from gatewayd.runs.model import Run, RunRequest
    from gatewayd.sandbox.passthrough import Passthrough

log = structlog.get_logger("gatewayd.runs")

# One whole line for the operator ("gatewayd: ..."), without its newline.
Say = Callable[[str], None]


async def attached_run(
    runs: RunManager,
    request: RunRequest,
    cmd: list[str],
    streams: Passthrough,
    say: Say,
    *,
    env_values: Mapping[str, str],
    audit_path: str,
    store_options: str,
    stop: trio.CancelScope,
) -> int | None:
    """A serving daemon's one-shot run for an attached ``gatewayd run``: start it (its
    policy may be named by a file's path: the control socket's peer is the operator),
    run its command with ``streams`` relayed and ``env_values`` as its environment's
    source, end it; gatewayd run's exit status, or None when ``stop`` was cancelled (the
    client's stop signal, or the client gone: the run is then ended as interrupted, its
    on-end commit not made). The daemon loaded every library a run can reach before it served:
    nothing is loaded here.

    The run's start does not wait for its creation's flush: the command does, at its
    exec's gate (a later entry), and the run's "started" line is said there, so the
    client hears of a run only once it is on the record (one the log could not take is
    said not to have started)."""
    try:
        run = await runs.start(request, policy_paths=True, creation_durable=False)
    except GatewayError as exc:  # no grant, no sandbox, a workspace out of reach
        say(f"gatewayd: {exc.code}: {exc}")
        return EXIT_FAILED
    except (PolicyError, ValueError) as exc:
        say(f"gatewayd: run refused: {exc}")
        return EXIT_FAILED
    except OSError as exc:
        log.exception("attached_run_create_failed")
        say(f"gatewayd: the run could not be created: {exc.strerror or exc}")
        return EXIT_FAILED
    if run.sandbox is None:  # its start waited for its creation's flush
        say(started_line(run))
        say(
            f"gatewayd: run {run.run_id} has NO OS sandbox ({run.degraded}); a serving "
            "gatewayd runs an attached command only in a sandbox"
        )
        await end_one_shot(
            runs, run, "not started", say, audit_path=audit_path, store_options=store_options
        )
        return EXIT_FAILED
    announced = False

    def announce() -> None:
        nonlocal announced
        if not announced:
            announced = True
            say(started_line(run))

    async def announce_first() -> None:
        # Before any line of the run's end, when its command never reached its gate. A
        # run whose creation is not on the record is not said to have started: after a
        # crash the log would not hold it.
        nonlocal announced
        created = run.created_seq
        if announced or created is None or runs.audit.durable_seq >= created:
            announce()
            return
        try:
            await runs.audit.durable(created)
        except AuditWriteError as exc:
            if runs.audit.durable_seq < created:  # a later entry's failure leaves it be
                announced = True
                say(not_recorded_line(run, exc.detail))
                return
        announce()

    with stop:
        return await run_in_sandbox(
            runs,
            run,
            cmd,
            run.spec.request.limits.maxRuntimeSec,
            streams,
            say,
            audit_path=audit_path,
            store_options=store_options,
            env_values=env_values,
            announce=announce,
            announce_first=announce_first,
        )
    await end_one_shot(
        runs,
        run,
        "stopped",
        say,
        audit_path=audit_path,
        store_options=store_options,
        # Not a finished end (ended_by_operator): the work was cut short, so its on-end
        # commit is not made (the session is kept), as at an in-process run's stop.
        reason="interrupted_by_operator",
    )
    return None


def started_line(run: Run) -> str:
    mode = run.workspace.mode if run.workspace is not None else None
    return (
        f"gatewayd: run {run.run_id} started (policy {run.spec.policy.name}"
        + (f", workspace mode {mode}" if mode else "")
        + ")"
    )


def not_recorded_line(run: Run, detail: str) -> str:
    """In place of the "started" line, for a run whose creation the audit log could not
    take: nothing of it ran."""
    return (
        f"gatewayd: run {run.run_id} was not started: the audit log cannot record its "
        f"creation ({detail}); fix the audit log"
    )


def max_runtime_line(run: Run, max_runtime: int) -> str:
    return (
        f"gatewayd: run {run.run_id} exceeded its {max_runtime} s (maxRuntimeSec); "
        "its command was stopped"
    )


def exec_end_not_audited(detail: str) -> str:
    """The word when a command's end cannot be made durable: the command's exit status is
    not passed on (EXIT_FAILED instead), as a call's value is withheld."""
    return (
        f"gatewayd: the audit log cannot be written ({detail}), so the command's exit "
        f"status is not passed on (exit {EXIT_FAILED}); fix the audit log"
    )


def exec_start_not_audited(detail: str) -> str:
    """The word when a command's start cannot be made durable: it never ran."""
    return (
        f"gatewayd: the audit log cannot be written ({detail}), so the command was not "
        f"started (exit {EXIT_FAILED}); fix the audit log"
    )


async def run_in_sandbox(
    runs: RunManager,
    run: Run,
    cmd: list[str],
    max_runtime: int,
    streams: Passthrough,
    say: Say,
    *,
    audit_path: str,
    store_options: str = "",
    env_values: Mapping[str, str] | None = None,
    announce: Callable[[], None] | None = None,
    announce_first: Callable[[], Awaitable[None]] | None = None,
) -> int:
    """Run the one-shot run's command in its sandbox with ``streams`` relayed, end the
    run, and return gatewayd's exit status. ``env_values``: where the variables the
    policy lets through come from (default: this process's environment).
    ``store_options``: the options a later ``gatewayd workspace`` command needs to find
    the same sessions (said with the kept session's commands). ``announce``: said at
    the command's gate (:meth:`RunManager.exec`); ``announce_first``: awaited once the
    exec is over, before any other line, for an exec that ended before its gate."""
    gated = False  # past its gate: its start is on the record and the command released

    def at_gate() -> None:
        nonlocal gated
        gated = True
        if announce is not None:
            announce()

    try:
        try:
            result = await runs.exec(
                run.run_id,
                cmd,
                timeout_s=max_runtime,
                passthrough=streams,
                env_values=env_values,
                announce=at_gate,
            )
        finally:
            if announce_first is not None:
                with trio.CancelScope(shield=True):
                    await announce_first()
    except AuditWriteError as exc:
        say(exec_end_not_audited(exc.detail) if gated else exec_start_not_audited(exc.detail))
        await end_one_shot(
            runs,
            run,
            "its end not audited" if gated else "not started",
            say,
            audit_path=audit_path,
            store_options=store_options,
        )
        return EXIT_FAILED
    except GatewayError as exc:
        if run.end_reason == "max_runtime_exceeded":
            # The run's own time ran out while its command ran: not a failed start.
            say(max_runtime_line(run, max_runtime))
            await end_one_shot(
                runs,
                run,
                "max runtime exceeded",
                say,
                audit_path=audit_path,
                store_options=store_options,
            )
            return EXIT_MAX_RUNTIME
        say(f"gatewayd: the sandbox could not start: {exc}")
        await end_one_shot(
            runs, run, "not started", say, audit_path=audit_path, store_options=store_options
        )
        return EXIT_FAILED
    error = None if result.errorCode is None else str(result.errorCode)
    await end_one_shot(
        runs,
        run,
        describe_exec(result.exitCode, result.signal, error),
        say,
        audit_path=audit_path,
        store_options=store_options,
    )
    return exec_status(result.exitCode, result.signal, error)


async def end_one_shot(
    runs: RunManager,
    run: Run,
    outcome: str,
    say: Say,
    *,
    audit_path: str,
    store_options: str = "",
    reason: str = "command_exited",
) -> None:
    """End the run (``reason``, unless it is already ending with its own) and say how it
    went: its calls, what became of its workspace session, where its audit log is."""
    # The run may already have ended (maxRuntimeSec); its counters stay on it. Shielded:
    # a stop arriving now must not cut the summary short.
    with trio.CancelScope(shield=True):
        await runs.end(run.run_id, reason=reason)
    by_code = ", ".join(f"{k}: {v}" for k, v in sorted(run.denied_by_code.items()))
    say(
        f"gatewayd: run {run.run_id} ended: {outcome}; {run.calls} calls, "
        f"{run.allowed} allowed, {run.denied} denied" + (f" ({by_code})" if by_code else "")
    )
    for line in workspace_fate_lines(run, store_options):
        say(f"gatewayd: {line}")
    say(f"gatewayd: audit log {audit_path}")


def workspace_fate_lines(run: Run, store_options: str = "") -> list[str]:
    """What became of the run's workspace session, and, when it is kept, the commands
    that show, commit or discard it (with ``store_options``, which find the same store)."""
    handle = run.workspace
    if handle is None:
        return []
    counts = handle.info.counts
    changes = ", ".join(
        f"{counts.get(what, 0)} {what}" for what in ("added", "modified", "removed", "renamed")
    )
    fate = run.workspace_fate or "unknown (see the audit log's workspace_ended)"
    lines = [f"workspace ({handle.mode}) of {handle.base}: {fate}; {changes}"]
    if fate.startswith("kept"):
        lines += [
            f"  gatewayd workspace {verb}{store_options} {run.run_id}"
            for verb in ("diff", "commit", "discard")
        ]
    return lines
