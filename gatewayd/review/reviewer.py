"""Step 7 of a call: the rule review. Structured rules first, then the decision cache, then
the review model; anything but a clean ALLOW is a deny (invariant FAIL_CLOSED).

The outcome always says where the verdict came from (``structured``, ``cache``, ``model``
or ``failed``) and carries what the audit records: model, latency, tokens, verdict,
reason, cache hit. A failed review (error, timeout, unparseable answer, or an exception
gatewayd did not expect while reviewing) says the review failed, never that a rule said
no, so the agent and the reviewer of the audit log can tell the two apart.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import structlog
import trio

from gatewayd.config import ModelAlias
from gatewayd.metrics import METRICS, GatewayMetrics
from gatewayd.model_client import ModelCallError, complete, is_loaded, preload
from gatewayd.policy.review_section import ReviewSection
from gatewayd.review.cache import DecisionCache, cache_key
from gatewayd.review.prompt import build_review_prompt
from gatewayd.review.ruleset import RuleSet
from gatewayd.review.structured import decide_structured
from gatewayd.review.verdict import UNPARSEABLE_REASON, Verdict, parse_verdict

log = structlog.get_logger("gatewayd.review")

# A verdict is one word or one line: the model needs no room to ramble.
REVIEW_MAX_TOKENS: Final = 200
# Model calls in flight at once (each holds a worker thread for the whole call).
MODEL_THREADS: Final = 32


class Source(enum.StrEnum):
    """Where a verdict came from."""

    STRUCTURED = "structured"  # a structured rule decided, no model asked
    CACHE = "cache"  # the same call under the same rules was reviewed before
    MODEL = "model"  # the review model answered
    FAILED = "failed"  # the review could not be had: a deny


@dataclass(frozen=True, slots=True, kw_only=True)
class ReviewOutcome:
    """One review's verdict and what the audit records about it."""

    allowed: bool
    reason: str
    source: Source
    model: str | None = None  # the policy's alias
    provider_model: str | None = None  # the model the provider says answered
    latency_ms: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    rule_index: int | None = None  # the structured rule that decided
    failure: str | None = None  # why the review failed (FAILED only)

    def audit(self) -> dict[str, Any]:
        """The audit entry's ``review`` field."""
        record: dict[str, Any] = {
            "verdict": "allow" if self.allowed else "deny",
            "source": str(self.source),
            "cacheHit": self.source is Source.CACHE,
            "latencyMs": round(self.latency_ms, 3),
        }
        if self.reason:
            record["reason"] = self.reason
        for name, value in (
            ("model", self.model),
            ("providerModel", self.provider_model),
            ("promptTokens", self.prompt_tokens),
            ("completionTokens", self.completion_tokens),
            ("ruleIndex", self.rule_index),
            ("failure", self.failure),
        ):
            if value is not None:
                record[name] = value
        return record


def review_failed_reason(what: str, *, transient: bool) -> str:
    """What the agent reads when the review failed: that it failed (not that a rule said
    no), in words that name no host detail (endpoint, model, key variable: those are in
    the audit entry's ``failure``), and whether trying again can help."""
    advice = "try again later" if transient else "gatewayd's operator must fix it"
    return f"the rule review failed ({what}), so the call is denied; {advice}"


# What the agent reads for each kind of model failure, and whether a retry can help.
_FAILURE_WORDS: Final = {
    "timeout": ("the reviewer did not answer in time", True),
    "connection": ("the reviewer could not be reached", True),
    "rate_limited": ("the reviewer is busy", True),
    "provider_error": ("the reviewer's provider failed", True),
    "malformed": ("the reviewer's answer could not be read", True),
    "auth": ("the reviewer is not configured correctly", False),
    "missing_key": ("the reviewer is not configured correctly", False),
    "bad_request": ("the reviewer refused the request", False),
    # A verdict is one line: a reply past the alias's cap is a broken or hostile endpoint.
    "too_large": ("the reviewer's reply was too large", False),
}
# What the agent reads when reviewing raised an exception gatewayd did not expect: a bug
# of gatewayd's or a reply it could not survive; the operator's log has the traceback.
CRASHED_WORDS: Final = ("the reviewer failed inside gatewayd", False)


def review_crashed(exc: BaseException, *, model: str | None, latency_ms: float) -> ReviewOutcome:
    """The outcome of a review that raised ``exc``: a deny (invariant FAIL_CLOSED) whose
    audited ``failure`` names the exception's type only (its text may quote the reply)."""
    return ReviewOutcome(
        allowed=False,
        reason=review_failed_reason(CRASHED_WORDS[0], transient=CRASHED_WORDS[1]),
        source=Source.FAILED,
        model=model or None,
        latency_ms=latency_ms,
        failure=f"gatewayd's review step failed ({type(exc).__name__}); gatewayd's log "
        "has the traceback",
    )


class Reviewer:
    """Reviews calls for the runs of one daemon; one decision cache shared by all of them
    (entries are keyed by the rule set's hash, so runs with other rules never share)."""

    def __init__(
        self,
        models: Mapping[str, ModelAlias],
        *,
        cache_entries: int = 10_000,
        cache_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        metrics: GatewayMetrics = METRICS,
    ) -> None:
        self.models = dict(models)
        self.metrics = metrics
        self.cache = DecisionCache(cache_entries, cache_ttl_s)
        self.clock = clock
        # Model calls run in worker threads: their own pool, so reviews neither starve
        # nor are starved by the file tools' threads (trio's default pool is shared).
        self._threads: trio.CapacityLimiter | None = None

    def applies(self, section: ReviewSection, tool: str) -> bool:
        """Does this call get a review step at all (structured rules or the model)?"""
        return bool(section.structured) or section.reviews(tool)

    async def review(
        self, tool: str, args: Mapping[str, Any], section: ReviewSection, rules: RuleSet
    ) -> ReviewOutcome | None:
        """The verdict on one call under ``section``/``rules``; None when nothing reviews
        it (no structured rule matches and the model does not review this tool). Never
        raises for a review that goes wrong: that is a deny with the reason "the rule
        review failed (...)", whatever went wrong (an exception of any type included;
        only cancellation passes)."""
        started = self.clock()
        try:
            return await self._review(tool, args, section, rules, started)
        except Exception as exc:
            log.exception("review_crashed", tool=tool, model=section.model)
            return review_crashed(
                exc, model=section.model, latency_ms=(self.clock() - started) * 1000
            )

    async def _review(
        self,
        tool: str,
        args: Mapping[str, Any],
        section: ReviewSection,
        rules: RuleSet,
        started: float,
    ) -> ReviewOutcome | None:
        decided = decide_structured(tool, args, rules.structured_compiled)
        if decided is not None and (decided.effect == "deny" or decided.skip_model):
            allowed = decided.effect == "allow"
            return ReviewOutcome(
                allowed=allowed,
                reason=decided.reason or ("" if allowed else "a structured rule denies it"),
                source=Source.STRUCTURED,
                rule_index=decided.rule_index,
                latency_ms=(self.clock() - started) * 1000,
            )
        if not section.reviews(tool):
            return None
        key = cache_key(rules.digest, tool, args) if section.cache.max_entries else None
        if key is not None:
            hit = self.cache.get(key, self.clock())
            metrics = self.metrics
            (metrics.review_cache_misses if hit is None else metrics.review_cache_hits).inc()
            if hit is not None:
                return ReviewOutcome(
                    allowed=hit.verdict.allowed,
                    reason=hit.verdict.reason,
                    source=Source.CACHE,
                    model=section.model,
                    latency_ms=(self.clock() - started) * 1000,
                )
        outcome = await self._ask_model(tool, args, section, rules, started)
        if key is not None and outcome.source is Source.MODEL:
            # Only real answers are remembered: a failure or an unparseable answer is
            # asked again next time.
            self.cache.put(key, _as_verdict(outcome), self.clock(), section.cache.ttl_s)
        return outcome

    async def _ask_model(
        self,
        tool: str,
        args: Mapping[str, Any],
        section: ReviewSection,
        rules: RuleSet,
        started: float,
    ) -> ReviewOutcome:
        alias_name = section.model or ""
        alias = self.models.get(alias_name)
        if alias is None:
            known = ", ".join(sorted(self.models)) or "none"
            return self._failed(
                started,
                alias_name,
                f"no model alias {alias_name!r} in gatewayd's configuration (known: {known})",
                ("the reviewer is not configured", False),
            )
        prompt = build_review_prompt(tool, args, rules)
        # litellm's import (seconds, once per process) is not the reviewer's slowness: it
        # is paid before the review's own time starts.
        if not is_loaded():
            await trio.to_thread.run_sync(preload)
        if self._threads is None:
            self._threads = trio.CapacityLimiter(MODEL_THREADS)
        try:
            with trio.fail_after(section.timeout_s):
                completion = await complete(
                    alias,
                    prompt.messages(),
                    timeout_s=section.timeout_s,
                    max_tokens=REVIEW_MAX_TOKENS,
                    temperature=0,
                    alias_name=alias_name,
                    limiter=self._threads,
                )
        except trio.TooSlowError:
            return self._failed(
                started,
                alias_name,
                f"no answer within {section.timeout_s:g} s",
                _FAILURE_WORDS["timeout"],
            )
        except ModelCallError as exc:
            words = _FAILURE_WORDS.get(str(exc.kind), ("the reviewer failed", True))
            return self._failed(started, alias_name, f"{exc.kind}: {exc}", words)
        verdict = parse_verdict(completion.text)
        latency = (self.clock() - started) * 1000
        if not verdict.parse_ok:
            return ReviewOutcome(
                allowed=False,
                reason=review_failed_reason(UNPARSEABLE_REASON, transient=True),
                source=Source.FAILED,
                model=alias_name,
                provider_model=completion.model or None,
                latency_ms=latency,
                prompt_tokens=completion.prompt_tokens,
                completion_tokens=completion.completion_tokens,
                failure=UNPARSEABLE_REASON,
            )
        return ReviewOutcome(
            allowed=verdict.allowed,
            reason=verdict.reason,
            source=Source.MODEL,
            model=alias_name,
            provider_model=completion.model or None,
            latency_ms=latency,
            prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens,
        )

    def _failed(
        self, started: float, model: str, detail: str, words: tuple[str, bool]
    ) -> ReviewOutcome:
        return ReviewOutcome(
            allowed=False,
            reason=review_failed_reason(words[0], transient=words[1]),
            source=Source.FAILED,
            model=model or None,
            latency_ms=(self.clock() - started) * 1000,
            failure=detail,
        )


def _as_verdict(outcome: ReviewOutcome) -> Verdict:
    return Verdict(allowed=outcome.allowed, reason=outcome.reason, parse_ok=True)
