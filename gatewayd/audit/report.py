"""Summaries of a log for reviewers: ``gatewayd audit stats`` and a run's result bundle.

Pure: both take entries (dicts, as :mod:`gatewayd.audit.query` reads them) and return
plain data; the CLI prints it. The numbers count the way the daemon counts a run
(``run_ended``'s ``calls``/``allowed``/``denied``): one call per ``result`` entry,
allowed when it has no ``errorCode``, denied (refused by gatewayd, or failed) when it
has one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from gatewayd.audit.events import AuditEvent
from gatewayd.audit.query import RunFacts, error_code_of, time_ns_of

# The run result's error codes (``errorCode``).
RESULT_TIMEOUT: Final = "timeout"
RESULT_OOM: Final = "oom_killed"
RESULT_INTERNAL: Final = "internal"
RESULT_TASK_FAILED: Final = "task_failed"
# run_ended reasons that say how the run itself failed.
_REASON_CODES: Final = {"max_runtime_exceeded": RESULT_TIMEOUT, "services_failed": RESULT_INTERNAL}


@dataclass(slots=True)
class _RunTally:
    calls: int = 0
    allowed: int = 0
    denied: int = 0
    denied_by_code: Counter[str] = field(default_factory=Counter)
    started: str | None = None
    ended: str | None = None
    end_reason: str | None = None


def _tally(tally: _RunTally, entry: Mapping[str, Any]) -> None:
    tally.calls += 1
    code = entry.get("errorCode")
    if code is None:
        tally.allowed += 1
    else:
        tally.denied += 1
        tally.denied_by_code[str(code)] += 1


def _duration_ms(started: str | None, ended: str | None) -> float | None:
    begin = time_ns_of(started) if started else None
    end = time_ns_of(ended) if ended else None
    return None if begin is None or end is None else round((end - begin) / 1e6, 3)


def stats(
    entries: Iterable[Mapping[str, Any]],
    runs: Mapping[str, RunFacts] | None = None,
    *,
    top: int = 10,
) -> dict[str, Any]:
    """Counts over ``entries``: calls, allowed, denied by error code, decisions of
    ``call`` entries, the ``top`` tools by calls, events by name, and per run (calls,
    denials, duration from ``run_created`` to ``run_ended``, end reason). ``runs``
    (from ``run_index``) adds each run's actor and tenant. Broken lines are counted.
    """
    total = _RunTally()
    decisions: Counter[str] = Counter()
    events: Counter[str] = Counter()
    tools: dict[str, _RunTally] = {}
    per_run: dict[str, _RunTally] = {}
    count = broken = 0
    first: Mapping[str, Any] | None = None
    last: Mapping[str, Any] | None = None
    for entry in entries:
        count += 1
        if "broken" in entry:
            broken += 1
            continue
        first = first or entry
        last = entry
        kind, run = entry.get("kind"), entry.get("runId")
        tally = per_run.setdefault(run, _RunTally()) if isinstance(run, str) else None
        if kind == "result":
            _tally(total, entry)
            tool = entry.get("tool")
            _tally(
                tools.setdefault(tool if isinstance(tool, str) else "(none)", _RunTally()), entry
            )
            if tally is not None:
                _tally(tally, entry)
        elif kind == "call":
            decisions[str(entry.get("decision"))] += 1
        elif kind == "event":
            name = str(entry.get("event"))
            events[name] += 1
            if tally is not None and name == AuditEvent.RUN_CREATED:
                tally.started = entry.get("time")
            elif tally is not None and name == AuditEvent.RUN_ENDED:
                tally.ended = entry.get("time")
                detail = entry.get("detail")
                reason = detail.get("reason") if isinstance(detail, Mapping) else None
                tally.end_reason = reason if isinstance(reason, str) else None
    ranked = sorted(tools.items(), key=lambda item: (-item[1].calls, item[0]))[: max(top, 0)]
    facts = runs or {}
    return {
        "entries": count,
        "broken": broken,
        "firstSeq": first.get("seq") if first else None,
        "lastSeq": last.get("seq") if last else None,
        "firstTime": first.get("time") if first else None,
        "lastTime": last.get("time") if last else None,
        "calls": total.calls,
        "allowed": total.allowed,
        "denied": total.denied,
        "deniedByCode": dict(total.denied_by_code.most_common()),
        "decisions": dict(sorted(decisions.items())),
        "topTools": [{"tool": name, "calls": t.calls, "denied": t.denied} for name, t in ranked],
        "events": dict(events.most_common()),
        "runs": [
            {
                "runId": run,
                "actor": facts[run].actor if run in facts else None,
                "tenant": facts[run].tenant if run in facts else None,
                "calls": t.calls,
                "allowed": t.allowed,
                "denied": t.denied,
                "deniedByCode": dict(t.denied_by_code.most_common()),
                "started": t.started,
                "ended": t.ended,
                "durationMs": _duration_ms(t.started, t.ended),
                "endReason": t.end_reason,
            }
            for run, t in per_run.items()
        ],
    }


def render_stats(report: Mapping[str, Any]) -> str:
    """``stats`` as text."""
    lines = [
        f"entries {report['entries']} (seq {report['firstSeq']}..{report['lastSeq']}, "
        f"{report['firstTime']} .. {report['lastTime']}), {report['broken']} broken",
        f"calls {report['calls']}: {report['allowed']} allowed, {report['denied']} denied",
    ]
    if report["deniedByCode"]:
        lines.append("denied by error code:")
        lines += [f"  {code:<24} {n:>7}" for code, n in report["deniedByCode"].items()]
    decisions = ", ".join(f"{k} {v}" for k, v in report["decisions"].items()) or "none"
    lines.append(f"decisions of call entries: {decisions}")
    if report["topTools"]:
        lines.append(f"top tools:\n  {'TOOL':<32} {'CALLS':>7} {'DENIED':>7}")
        lines += [
            f"  {_text(t['tool']):<32} {t['calls']:>7} {t['denied']:>7}" for t in report["topTools"]
        ]
    if report["runs"]:
        lines.append(
            f"runs:\n  {'RUN':<32} {'ACTOR':<12} {'TENANT':<12} {'CALLS':>6} {'DENIED':>6} "
            f"{'SECONDS':>9} END"
        )
        for run in report["runs"]:
            seconds = run["durationMs"]
            lines.append(
                f"  {_text(run['runId']):<32} {_text(run['actor'] or '-'):<12} "
                f"{_text(run['tenant'] or '-'):<12} {run['calls']:>6} {run['denied']:>6} "
                f"{'-' if seconds is None else f'{seconds / 1000:.3f}':>9} "
                f"{_text(run['endReason'] or 'not ended in these entries')}"
            )
    return "\n".join(lines)


def _text(value: Any) -> str:
    # Logged text may hold control characters: never let it drive the terminal.
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in str(value))


# -- the run result bundle --------------------------------------------------------------


def _exec_line(entry: Mapping[str, Any]) -> str | None:
    name = entry.get("event")
    raw = entry.get("detail")
    facts: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    when = entry.get("time")
    if name == AuditEvent.EXEC_STARTED:
        command = msgspec.json.encode(facts.get("command")).decode()
        return f"{when} exec_started {command} (timeout {facts.get('timeoutS')} s)"
    if name != AuditEvent.EXEC_ENDED:
        return None
    if entry.get("errorCode") is not None:
        return f"{when} exec_ended {entry['errorCode']}: {entry.get('safeMessage', '')}"
    parts = [f"exit {facts.get('exitCode')}"]
    if facts.get("signal") is not None:
        parts.append(f"signal {facts['signal']}")
    if facts.get("errorCode") is not None:
        parts.append(str(facts["errorCode"]))
    if entry.get("durationMs") is not None:
        parts.append(f"{entry['durationMs']} ms")
    for stream in ("stdout", "stderr"):
        size = facts.get(f"{stream}Bytes")
        if size is not None:
            cut = " (truncated)" if facts.get(f"{stream}Truncated") else ""
            parts.append(f"{stream} {size} bytes{cut}")
    return f"{when} exec_ended " + ", ".join(parts)


def _command_failure(entry: Mapping[str, Any]) -> str | None:
    """The result error code a finished command stands for (None: it succeeded)."""
    if entry.get("errorCode") is not None:
        return RESULT_INTERNAL  # it could not be run at all
    code = error_code_of(entry)
    if code in (RESULT_TIMEOUT, RESULT_OOM):
        return code
    detail = entry.get("detail")
    if isinstance(detail, Mapping) and (detail.get("exitCode") or detail.get("signal")):
        return RESULT_TASK_FAILED
    return None


def run_result(run_id: str, entries: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The result bundle of one run, in the shape of an agent run's
    result, built from the run's entries only (see docs/audit.md).

    ``auditLog``: every entry of the run, in order. ``errorCode``: ``timeout`` when
    the run ran out of time, ``internal`` when its services or its clean-up failed
    or a command could not be run; otherwise the last failed command's ``timeout``,
    ``oom_killed`` or ``task_failed`` (non-zero exit or a signal). ``ok``: the run
    ended and nothing failed. ``logs``: one line per command started and ended, with
    exit status and output sizes: the audit log never holds the output itself.
    ``bundle`` (patches) is left out: gatewayd does not collect patches.
    """
    log = [dict(entry) for entry in entries]
    ended = next((e for e in log if e.get("event") == AuditEvent.RUN_ENDED), None)
    detail = ended.get("detail") if ended is not None else None
    detail = detail if isinstance(detail, Mapping) else {}
    reason = detail.get("reason")
    code: str | None = _REASON_CODES.get(str(reason))
    if code is None and "cleanupFailed" in detail:
        code = RESULT_INTERNAL
    if code is None:
        failures = [
            failure
            for e in log
            if e.get("event") == AuditEvent.EXEC_ENDED
            and (failure := _command_failure(e)) is not None
        ]
        code = failures[-1] if failures else None
    lines = [line for e in log if (line := _exec_line(e)) is not None]
    result: dict[str, Any] = {
        "runId": run_id,
        "ok": ended is not None and code is None,
        "ended": ended is not None,
        "endReason": reason,
        "logs": "\n".join(lines) + ("\n" if lines else ""),
        "auditLog": log,
    }
    if code is not None:
        result["errorCode"] = code
    return result
