"""Replaying recorded calls through a policy's rule review.

``gatewayd review replay CALLS.jsonl --policy P`` lets a security team evaluate a rule
set on its own traffic with its own model: every recorded call is reviewed afresh, and
where the file says what the verdict should be, the report counts agreement, false
allows (expected deny, got allow: the dangerous kind) and false denies.

The calls file is JSON lines, one call a line::

    {"tool": "fs.write", "args": {"path": "/workspace/k.pem", "content": "..."}, "expect": "deny"}
    # a comment line; blank lines are skipped too
    {"tool": "fs.read", "args": {"path": "/workspace/notes.md"}, "expect": "allow", "id": "c2"}

``tool`` and ``args`` are required; ``expect`` (``allow`` | ``deny``), ``id`` and
``note`` are optional; any other key is refused (a typo such as ``expected`` would
otherwise silently turn a checked call into an unchecked one). A file with any bad line
is refused whole, every problem listed with its line number: an evaluation run on a
silently partial file reports figures about calls nobody chose.

Layers: :func:`parse_calls` and :func:`summarize_results` and the renderers are pure;
:func:`replay_calls` is the one async runner. Each call is reviewed as the gateway would
review it (arguments of a known tool checked and completed with their defaults, as
dispatch hands them to the reviewer), but with no decision cache: a replay answered
from the cache would measure nothing.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import msgspec
import trio

from gatewayd import strictjson
from gatewayd.argsummary import summarize
from gatewayd.config import ModelAlias
from gatewayd.errors import ArgumentsRejected, GatewayError
from gatewayd.inputfile import InputFileError, read_input_file
from gatewayd.policy.review_section import ReviewSection
from gatewayd.protocol import TOOL_NAME_RE
from gatewayd.review.reviewer import Reviewer, ReviewOutcome, Source
from gatewayd.review.ruleset import RuleSet

if TYPE_CHECKING:
    from gatewayd.tools.registry import Tool

# A calls file is an evaluation set, not an archive: 64 MiB holds hundreds of thousands
# of ordinary calls, and the whole file is read into memory before the first review.
MAX_CALLS_FILE_BYTES: Final = 64 << 20
# Every call is one model request; more than this is a load test, not an evaluation.
MAX_CALLS: Final = 100_000
# A file with a systematic mistake has one per line; the first few say what to fix.
MAX_REPORTED_PROBLEMS: Final = 20
# Reviews in flight at once: enough to hide a provider's latency, few enough that a
# rate-limited provider does not answer a replay with 429s (which would count as failed).
DEFAULT_CONCURRENCY: Final = 4
MAX_CONCURRENCY: Final = 64
# A progress line on stderr every this many reviews: model calls take about a second.
PROGRESS_EVERY: Final = 25
# Identifiers and notes are echoed in the report; keep them to one short line.
MAX_ID_CHARS: Final = 128
MAX_NOTE_CHARS: Final = 500
# The summary's lines naming a call are cut to this: a call, not its arguments in full.
LISTING_WIDTH: Final = 160
MAX_TOOL_CHARS: Final = 128
_KNOWN_KEYS: Final = ("tool", "args", "expect", "id", "note")
# Shown in place of any character that could move a terminal's cursor or colour it.
_UNPRINTABLE: Final = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e]")

Expect = Literal["allow", "deny"]


class CallsFileError(Exception):
    """The calls file cannot be read or has bad lines; ``problems`` has one line each,
    ``line N: what is wrong``, and ``str(exc)`` lists them under the file's name."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = tuple(problems) or ("invalid calls file",)
        shown = list(self.problems[:MAX_REPORTED_PROBLEMS])
        if len(self.problems) > MAX_REPORTED_PROBLEMS:
            shown.append(f"... and {len(self.problems) - MAX_REPORTED_PROBLEMS} more")
        super().__init__("\n".join(f"{source}: {p}" for p in shown))


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordedCall:
    """One call of the calls file; ``line`` is its 1-based line number."""

    line: int
    tool: str
    args: Mapping[str, Any]
    expect: Expect | None = None
    id: str | None = None
    note: str | None = None


class Check(enum.StrEnum):
    """How a call's verdict compares with what the file expected."""

    MATCH = "ok"
    FALSE_ALLOW = "FALSE ALLOW"  # expected deny, got allow: the rule set let it through
    FALSE_DENY = "FALSE DENY"  # expected allow, got deny
    FAILED = "FAILED"  # the review failed (a deny in the gateway), so it judged nothing
    UNCHECKED = "-"  # no expected verdict in the file


class ReplaySource(enum.StrEnum):
    """Where a replayed verdict came from."""

    MODEL = "model"
    STRUCTURED = "structured"  # a structured rule decided, no model asked
    FAILED = "failed"  # error, timeout or unparseable answer: a deny
    UNREVIEWED = "unreviewed"  # no rule matched and the model does not review the tool
    CACHE = "cache"  # never with replay_reviewer(), which keeps no cache


_SOURCES: Final = {
    Source.MODEL: ReplaySource.MODEL,
    Source.STRUCTURED: ReplaySource.STRUCTURED,
    Source.FAILED: ReplaySource.FAILED,
    Source.CACHE: ReplaySource.CACHE,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class CallResult:
    """A replayed call: its place in the file (``index``, 1-based) and the review's
    outcome, None when nothing reviewed the call (the gateway lets it pass)."""

    index: int
    call: RecordedCall
    outcome: ReviewOutcome | None

    @property
    def allowed(self) -> bool:
        return self.outcome is None or self.outcome.allowed

    @property
    def verdict(self) -> Expect:
        return "allow" if self.allowed else "deny"

    @property
    def source(self) -> ReplaySource:
        if self.outcome is None:
            return ReplaySource.UNREVIEWED
        return _SOURCES[self.outcome.source]

    @property
    def check(self) -> Check:
        if self.source is ReplaySource.FAILED:
            return Check.FAILED
        if self.call.expect is None:
            return Check.UNCHECKED
        if self.verdict == self.call.expect:
            return Check.MATCH
        return Check.FALSE_ALLOW if self.allowed else Check.FALSE_DENY

    @property
    def reason(self) -> str:
        """The failure for a failed review, else the verdict's reason."""
        if self.outcome is None:
            return "not reviewed: no structured rule matches and the model does not review it"
        return self.outcome.failure or self.outcome.reason

    @property
    def latency_ms(self) -> float:
        return 0.0 if self.outcome is None else self.outcome.latency_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class LatencyFigures:
    """Latency of the model's answers, in milliseconds (nearest-rank percentiles)."""

    count: int
    median_ms: float
    p90_ms: float
    max_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplaySummary:
    """The figures of one replay."""

    total: int
    allowed: int
    denied: int
    by_source: Mapping[ReplaySource, int]
    expected: int  # calls with an expected verdict
    agreed: int  # ... whose review did not fail and matched it
    false_allows: tuple[CallResult, ...]
    false_denies: tuple[CallResult, ...]
    failed: tuple[CallResult, ...]  # every failed review, expected verdict or not
    latency: LatencyFigures | None  # None when the model answered no call
    prompt_tokens: int | None  # None when no answer reported usage
    completion_tokens: int | None

    @property
    def agreement(self) -> float | None:
        """Share of calls with an expected verdict that got it (a failed review never
        does), or None when the file expects nothing."""
        return self.agreed / self.expected if self.expected else None

    @property
    def passed(self) -> bool:
        """No disagreement and no failed review: what a CI gate on a rule set wants."""
        return not (self.false_allows or self.false_denies or self.failed)


# --- parsing (pure) -----------------------------------------------------------------


def load_calls(
    path: Path, *, tools: Mapping[str, Tool[Any]] | None = None
) -> tuple[RecordedCall, ...]:
    """Read and parse the calls file at ``path`` (see :func:`parse_calls`).

    Error handling: :class:`CallsFileError` for an unreadable, oversized or non-UTF-8
    file and for every bad line.
    """
    source = str(path)
    try:
        data = read_input_file(path, max_bytes=MAX_CALLS_FILE_BYTES, what="the calls file")
    except InputFileError as exc:
        hint = "; split it into several replays" if "larger than" in str(exc) else ""
        raise CallsFileError(source, [f"{exc}{hint}"]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise CallsFileError(source, [f"line {line}: not UTF-8 text"]) from None
    return parse_calls(text, source, tools=tools)


def parse_calls(
    text: str, source: str = "calls", *, tools: Mapping[str, Tool[Any]] | None = None
) -> tuple[RecordedCall, ...]:
    """The calls in JSON-lines ``text``; ``source`` names it in errors.

    With ``tools``, a call of a tool found there has its arguments checked against the
    tool's schema and completed with its defaults, as dispatch hands them to the
    reviewer (a structured path rule must see the path an ``fs.list`` without one will
    list); arguments the gateway would refuse before any review are a bad line. Calls
    of other tools keep their arguments as written.

    Error handling: :class:`CallsFileError` listing every bad line; an empty file (no
    call at all) is one too.
    """
    calls: list[RecordedCall] = []
    problems: list[str] = []
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            calls.append(_parse_line(stripped, number, tools))
        except ValueError as exc:
            problems.append(f"line {number}: {exc}")
    if not calls and not problems:
        problems.append(
            'no calls: write one JSON object a line, e.g. {"tool": "fs.read", '
            '"args": {"path": "/workspace/notes.md"}, "expect": "allow"}'
        )
    if len(calls) > MAX_CALLS:
        problems.append(f"{len(calls)} calls; a replay takes at most {MAX_CALLS}")
    if problems:
        raise CallsFileError(source, problems)
    return tuple(calls)


def _parse_line(text: str, number: int, tools: Mapping[str, Tool[Any]] | None) -> RecordedCall:
    try:
        data = strictjson.loads(text)
    except strictjson.JsonInputError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(data, dict):
        raise ValueError(f"a call is a JSON object, not {_json_type(data)}")  # noqa: TRY004
    unknown = sorted(set(data) - set(_KNOWN_KEYS))
    if unknown:
        raise ValueError(
            f"unknown key {', '.join(map(repr, unknown))}; a call has {', '.join(_KNOWN_KEYS)}"
        )
    tool = data.get("tool")
    if not isinstance(tool, str) or len(tool) > MAX_TOOL_CHARS or not TOOL_NAME_RE.fullmatch(tool):
        raise ValueError("'tool' must be a dotted lowercase tool name such as 'fs.read'")
    if "args" not in data:
        raise ValueError("'args' is missing; give the call's arguments, {} for none")
    args = data["args"]
    if not isinstance(args, dict):
        raise ValueError(f"'args' must be a JSON object, not {_json_type(args)}")  # noqa: TRY004
    expect = data.get("expect")
    if expect is not None and expect not in ("allow", "deny"):
        raise ValueError(f'\'expect\' must be "allow" or "deny", not {json.dumps(expect)}')
    ident = data.get("id")
    if isinstance(ident, int) and not isinstance(ident, bool):
        ident = str(ident)
    if ident is not None and not (isinstance(ident, str) and 0 < len(ident) <= MAX_ID_CHARS):
        raise ValueError(f"'id' must be a string of 1-{MAX_ID_CHARS} characters or an integer")
    note = data.get("note")
    if note is not None and not (isinstance(note, str) and len(note) <= MAX_NOTE_CHARS):
        raise ValueError(f"'note' must be a string of at most {MAX_NOTE_CHARS} characters")
    spec = tools.get(tool) if tools is not None else None
    if spec is not None:
        args = _as_tool_sees_them(spec, args)
    return RecordedCall(line=number, tool=tool, args=args, expect=expect, id=ident, note=note)


def _as_tool_sees_them(tool: Tool[Any], args: dict[str, Any]) -> dict[str, Any]:
    try:
        typed = tool.decode(args)
    except ArgumentsRejected as exc:
        raise ValueError(
            f"the gateway would refuse these arguments before any review "
            f"(invalid arguments for {tool.name}: {exc})"
        ) from None
    except GatewayError as exc:  # a decoder refusing with a reason of its own
        raise ValueError(f"the gateway would refuse this call before any review: {exc}") from None
    completed: dict[str, Any] = msgspec.to_builtins(typed)
    return completed


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    return "a number"


# --- the runner -----------------------------------------------------------------------


def replay_reviewer(models: Mapping[str, ModelAlias]) -> Reviewer:
    """A reviewer for a replay: no decision cache, so every call is reviewed afresh."""
    return Reviewer(models, cache_entries=0)


async def replay_calls(
    calls: Sequence[RecordedCall],
    reviewer: Reviewer,
    section: ReviewSection,
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[CallResult, ...]:
    """Review every call under ``section``, ``concurrency`` at a time; the results are
    in the order of ``calls`` whatever order the answers come in.

    ``on_progress(done, total)`` is called after every review. The model client is
    loaded first (seconds, in a thread), so the first reviews' latency is the model's
    and not the import's.

    Error handling: a review that goes wrong is a failed result, never an exception
    (:meth:`Reviewer.review` fails closed); ValueError for a ``concurrency`` outside
    1..:data:`MAX_CONCURRENCY`.
    """
    if not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"concurrency must be 1..{MAX_CONCURRENCY}, not {concurrency}")
    if section.mode == "llm":
        from gatewayd import model_client

        await trio.to_thread.run_sync(model_client.preload)
    rules = RuleSet.from_section(section)
    results: list[CallResult | None] = [None] * len(calls)
    # One iterator shared by the workers: trio switches tasks only at an await, so no
    # two workers ever take the same call.
    pending = iter(enumerate(calls))
    done = 0

    async def worker() -> None:
        nonlocal done
        for position, call in pending:
            outcome = await reviewer.review(call.tool, call.args, section, rules)
            results[position] = CallResult(index=position + 1, call=call, outcome=outcome)
            done += 1
            if on_progress is not None:
                on_progress(done, len(calls))

    async with trio.open_nursery() as nursery:
        for _ in range(min(concurrency, len(calls))):
            nursery.start_soon(worker)
    return tuple(result for result in results if result is not None)


# --- the figures (pure) ---------------------------------------------------------------


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile of ``values`` (not empty), ``fraction`` in (0, 1]."""
    if not values:
        raise ValueError("no values to take a percentile of")
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


def summarize_results(results: Sequence[CallResult]) -> ReplaySummary:
    """The summary of a replay's ``results``."""
    by_check: dict[Check, list[CallResult]] = {check: [] for check in Check}
    for result in results:
        by_check[result.check].append(result)
    latencies = [r.latency_ms for r in results if r.source is ReplaySource.MODEL]
    latency = (
        LatencyFigures(
            count=len(latencies),
            median_ms=percentile(latencies, 0.5),
            p90_ms=percentile(latencies, 0.9),
            max_ms=max(latencies),
        )
        if latencies
        else None
    )
    outcomes = [r.outcome for r in results if r.outcome is not None]
    prompt = [o.prompt_tokens for o in outcomes if o.prompt_tokens is not None]
    completion = [o.completion_tokens for o in outcomes if o.completion_tokens is not None]
    sources = Counter(result.source for result in results)
    return ReplaySummary(
        total=len(results),
        allowed=sum(1 for r in results if r.allowed),
        denied=sum(1 for r in results if not r.allowed),
        by_source={source: sources[source] for source in ReplaySource if sources[source]},
        expected=sum(1 for r in results if r.call.expect is not None),
        agreed=len(by_check[Check.MATCH]),
        false_allows=tuple(by_check[Check.FALSE_ALLOW]),
        false_denies=tuple(by_check[Check.FALSE_DENY]),
        failed=tuple(by_check[Check.FAILED]),
        latency=latency,
        prompt_tokens=sum(prompt) if prompt else None,
        completion_tokens=sum(completion) if completion else None,
    )


# --- rendering (pure) -----------------------------------------------------------------


def printable(text: str) -> str:
    """``text`` on one line with no character a terminal would act on."""
    return _UNPRINTABLE.sub("?", text.replace("\n", " ").replace("\t", " "))


def _cut(text: str, width: int) -> str:
    text = printable(text)
    if len(text) <= width:
        return text
    return text[: max(0, width - 1)] + "…"


def render_table(results: Sequence[CallResult], width: int = 120) -> str:
    """One line per call: #, tool, expected, verdict, source, ms, check, reason cut to
    fit in ``width`` columns."""
    index_w = max(1, len(str(len(results))))
    tool_w = min(24, max([4, *(len(r.call.tool) for r in results)]))
    head = (
        f"{'#':>{index_w}}  {'tool':<{tool_w}}  {'expect':<6}  {'verdict':<7}  "
        f"{'source':<10}  {'ms':>7}  {'check':<11}  "
    )
    reason_w = max(10, width - len(head))
    lines = [head + "reason"]
    for r in results:
        lines.append(
            f"{r.index:>{index_w}}  {_cut(r.call.tool, tool_w):<{tool_w}}  "
            f"{r.call.expect or '-':<6}  {r.verdict:<7}  {r.source:<10}  "
            f"{r.latency_ms:>7.0f}  {r.check:<11}  {_cut(r.reason or '-', reason_w)}"
        )
    return "\n".join(lines)


def _listing(results: Iterable[CallResult]) -> list[str]:
    """Two lines per call: where it is and what it was (arguments summarized and
    redacted as in the audit log), then its note and the review's reason."""
    lines = []
    for r in results:
        ident = f", id {r.call.id}" if r.call.id else ""
        shown = json.dumps(summarize(dict(r.call.args)), ensure_ascii=False)
        lines.append(
            _cut(f"  #{r.index} (line {r.call.line}{ident}) {r.call.tool} {shown}", LISTING_WIDTH)
        )
        said = [f"note: {r.call.note}"] if r.call.note else []
        said.append(f"reason: {r.reason}" if r.reason else "reason: none given")
        lines.append(_cut("      " + "; ".join(said), LISTING_WIDTH))
    return lines


def render_summary(summary: ReplaySummary) -> str:
    """The summary in words; false allows come first, as the dangerous kind."""
    lines = [
        f"{summary.total} calls: {summary.allowed} allowed, {summary.denied} denied "
        f"({len(summary.failed)} of the denies by a failed review)",
        "by source: " + ", ".join(f"{s} {n}" for s, n in summary.by_source.items()),
    ]
    if summary.agreement is None:
        lines.append("agreement: no call in the file has an expected verdict")
    else:
        lines.append(
            f"agreement: {summary.agreed}/{summary.expected} calls with an expected verdict "
            f"({summary.agreement:.1%})"
        )
    lines.append(f"false allows (expected deny, got allow): {len(summary.false_allows)}")
    lines.extend(_listing(summary.false_allows))
    lines.append(f"false denies (expected allow, got deny): {len(summary.false_denies)}")
    lines.extend(_listing(summary.false_denies))
    lines.append(f"failed reviews (denies in the gateway): {len(summary.failed)}")
    lines.extend(_listing(summary.failed))
    if summary.latency is None:
        lines.append("latency: the model answered no call")
    else:
        lat = summary.latency
        lines.append(
            f"latency of {lat.count} model answers: median {lat.median_ms:.0f} ms, "
            f"p90 {lat.p90_ms:.0f} ms, max {lat.max_ms:.0f} ms"
        )
    if summary.prompt_tokens is not None or summary.completion_tokens is not None:
        lines.append(
            f"tokens: {summary.prompt_tokens or 0} prompt, "
            f"{summary.completion_tokens or 0} completion"
        )
    lines.append("result: " + ("PASS" if summary.passed else "FAIL"))
    return "\n".join(lines)


def result_json(result: CallResult) -> dict[str, Any]:
    """One result as the ``--json`` output has it (camelCase, like the audit log)."""
    record: dict[str, Any] = {
        "index": result.index,
        "line": result.call.line,
        "tool": result.call.tool,
        "expect": result.call.expect,
        "verdict": result.verdict,
        "source": str(result.source),
        "check": result.check.name.lower(),
        "reason": result.reason,
        "latencyMs": round(result.latency_ms, 3),
    }
    outcome = result.outcome
    for name, value in (
        ("id", result.call.id),
        ("note", result.call.note),
        ("model", outcome and outcome.model),
        ("providerModel", outcome and outcome.provider_model),
        ("promptTokens", outcome and outcome.prompt_tokens),
        ("completionTokens", outcome and outcome.completion_tokens),
        ("ruleIndex", outcome and outcome.rule_index),
    ):
        if value is not None:
            record[name] = value
    return record


def summary_json(summary: ReplaySummary) -> dict[str, Any]:
    """The summary as the ``--json`` output has it."""
    latency = summary.latency
    return {
        "total": summary.total,
        "allowed": summary.allowed,
        "denied": summary.denied,
        "bySource": {str(source): count for source, count in summary.by_source.items()},
        "expected": summary.expected,
        "agreed": summary.agreed,
        "agreement": summary.agreement,
        "falseAllows": [r.index for r in summary.false_allows],
        "falseDenies": [r.index for r in summary.false_denies],
        "failed": [r.index for r in summary.failed],
        "latencyMs": None
        if latency is None
        else {
            "count": latency.count,
            "median": round(latency.median_ms, 3),
            "p90": round(latency.p90_ms, 3),
            "max": round(latency.max_ms, 3),
        },
        "promptTokens": summary.prompt_tokens,
        "completionTokens": summary.completion_tokens,
        "passed": summary.passed,
    }
