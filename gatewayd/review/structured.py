"""Deterministic review rules, decided before any model is asked.

A :class:`~gatewayd.policy.review_section.StructuredRule` matches a call when its tool
glob and every matcher it gives match; the rules are tried in order and the first match
decides. A deny ends the call without a model call; an allow with ``skip_model`` decides
it; a plain allow lets the model review as usual.

Matchers, and what a call that does not fit them means:

- ``path``: the call's path arguments (``path``, and each entry of ``paths``), normalized
  exactly as the policy normalizes agent paths (relative to /workspace, ``..`` resolved as
  text, no symlinks looked at), against an absolute glob where ``*`` matches within one
  name and a whole ``**`` component matches any number of names, none included (so
  ``/workspace/.git/**`` covers ``/workspace/.git`` itself). ``?`` and ``[`` are literal.
- ``domain``: the host of a ``url`` argument and of a ``host`` argument, lowercased, one
  trailing dot dropped. ``example.org`` matches that host only; ``*.example.org`` matches
  strict subdomains and not ``example.org`` itself (as a TLS wildcard does), so an
  operator who means both writes both.
- ``regex``: ``re.search`` on one named string argument; ``max``: one named number
  (``bool`` is not a number) is at most the bound. A missing argument or one of another
  type does not match: these name one argument explicitly, and the tool's schema types it.

Several path or host values: a deny matches when ANY of them matches, an allow only
when ALL of them match (and there is at least one), so a call cannot slip a denied path
in beside an allowed one. A value that cannot be read as a path or host (not a string,
a URL with no host, a backslash, whitespace or non-ASCII that URL parsers disagree on)
matches every deny and no allow: we refuse to guess how the tool would read it.
"""

from __future__ import annotations

import functools
import re
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

# The policy's own lexical normalization of agent paths, so that a rule and the path
# check see the same path.
from gatewayd.policy.decide import normalize_path as normalize_agent_path
from gatewayd.policy.network import domain_matches
from gatewayd.policy.paths import shown
from gatewayd.policy.review_section import StructuredRule, tool_glob_matches

# Arguments that hold one agent path, and a list of agent paths (gatewayd.tools.fs).
PATH_ARGUMENTS: Final = ("path",)
PATH_LIST_ARGUMENTS: Final = ("paths",)
# Arguments whose host the ``domain`` matcher reads: a URL, or a bare host name.
URL_ARGUMENTS: Final = ("url",)
HOST_ARGUMENTS: Final = ("host",)
# Compiled rule sets kept; a daemon has one per distinct review policy in use.
COMPILED_CACHE_SIZE: Final = 64

# A host name as the domain rules spell them (gatewayd.policy.review_section._DOMAIN_RE
# without the wildcard), plus '_' which some real host names carry.
_HOST_RE: Final = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
# Characters on which urllib and WHATWG-style URL parsers (httpx) split hosts differently.
_AMBIGUOUS_URL_RE: Final = re.compile(r"[\\\x00-\x20\x7f]|[^\x00-\x7f]")

Effect = Literal["allow", "deny"]


class _Unreadable:
    """A path or host value we cannot read; see the module docstring."""


_UNREADABLE: Final = _Unreadable()
_ANY_DEPTH: Final = "**"


@dataclass(frozen=True, slots=True, kw_only=True)
class StructuredDecision:
    """The first structured rule that matched a call.

    ``rule_index`` is the rule's 0-based position in the policy's ``structured`` list
    (for the audit). ``reason`` is the rule's reason, or for a deny without one a
    sentence naming the rule, so the agent always learns why.
    """

    effect: Effect
    skip_model: bool
    reason: str
    rule_index: int


# --- compiled rules -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PathGlob:
    """A parsed path glob: per component, ``**`` or the literal pieces between '*'s."""

    tokens: tuple[str | tuple[str, ...], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class _CompiledRule:
    index: int
    rule: StructuredRule
    path: PathGlob | None
    regex: re.Pattern[str] | None


@dataclass(frozen=True, slots=True)
class CompiledRules:
    """Structured rules with their globs parsed and regexes compiled, once."""

    rules: tuple[_CompiledRule, ...]


def compile_path_glob(glob: str) -> PathGlob:
    """``glob`` (absolute, as the sandbox sees paths) parsed; normalized like a path."""
    return PathGlob(
        tuple(
            _ANY_DEPTH if part == _ANY_DEPTH else tuple(part.split("*"))
            for part in normalize_agent_path(glob)
        )
    )


@functools.lru_cache(maxsize=COMPILED_CACHE_SIZE)
def _compile(rules: tuple[StructuredRule, ...]) -> CompiledRules:
    return CompiledRules(
        tuple(
            _CompiledRule(
                index=i,
                rule=rule,
                path=None if rule.path is None else compile_path_glob(rule.path),
                regex=None if rule.regex is None else re.compile(rule.regex.pattern),
            )
            for i, rule in enumerate(rules)
        )
    )


def compile_rules(rules: Sequence[StructuredRule]) -> CompiledRules:
    """``rules`` ready to match; equal rule lists share one compiled copy."""
    return _compile(tuple(rules))


# --- globs ----------------------------------------------------------------------


def _name_matches(pieces: tuple[str, ...], name: str) -> bool:
    """Does ``name`` match the glob whose literal pieces, between '*'s, are ``pieces``?"""
    if len(pieces) == 1:
        return name == pieces[0]
    first, *middle, last = pieces
    if len(name) < len(first) + len(last):
        return False
    if not (name.startswith(first) and name.endswith(last)):
        return False
    # The leftmost place for each middle piece leaves the most room for the rest, so
    # the greedy scan is exact, and linear (no regex backtracking on agent input).
    at, end = len(first), len(name) - len(last)
    for piece in middle:
        found = name.find(piece, at, end)
        if found < 0:
            return False
        at = found + len(piece)
    return True


def path_glob_matches(glob: PathGlob, path: str) -> bool:
    """Does the agent's ``path``, normalized as the policy does, match ``glob``?"""
    return _parts_match(glob, normalize_agent_path(path))


def _parts_match(glob: PathGlob, parts: Sequence[str]) -> bool:
    """Do the path components ``parts`` match ``glob``? ``**`` spans zero or more.

    The classic wildcard scan over components: on a mismatch, go back to the last
    ``**`` and let it take one more component. O(len(glob) * len(parts)) matches.
    """
    tokens = glob.tokens
    t = p = 0
    star_t, star_p = -1, 0
    while p < len(parts):
        token = tokens[t] if t < len(tokens) else None
        if token == _ANY_DEPTH:
            star_t, star_p = t, p
            t += 1
        elif isinstance(token, tuple) and _name_matches(token, parts[p]):
            t += 1
            p += 1
        elif star_t >= 0:
            star_p += 1
            t, p = star_t + 1, star_p
        else:
            return False
    return all(token == _ANY_DEPTH for token in tokens[t:])


# --- reading the call -------------------------------------------------------------


def _path_values(args: Mapping[str, Any]) -> list[tuple[str, ...] | _Unreadable]:
    raw: list[object] = [args[name] for name in PATH_ARGUMENTS if name in args]
    for name in PATH_LIST_ARGUMENTS:
        if name in args:
            value = args[name]
            if isinstance(value, list | tuple):
                raw.extend(value)
            else:
                raw.append(_UNREADABLE)
    return [normalize_agent_path(v) if isinstance(v, str) else _UNREADABLE for v in raw]


def _clean_host(host: str) -> str | _Unreadable:
    host = host.lower()
    if host.endswith("."):
        host = host[:-1]
    return host if _HOST_RE.fullmatch(host) else _UNREADABLE


def _url_host(url: object) -> str | _Unreadable:
    if not isinstance(url, str) or _AMBIGUOUS_URL_RE.search(url):
        return _UNREADABLE
    try:
        host = urllib.parse.urlsplit(url).hostname
    except ValueError:  # a malformed IPv6 literal, for one
        return _UNREADABLE
    return _UNREADABLE if host is None else _clean_host(host)


def _host_values(args: Mapping[str, Any]) -> list[str | _Unreadable]:
    hosts = [_url_host(args[name]) for name in URL_ARGUMENTS if name in args]
    for name in HOST_ARGUMENTS:
        if name in args:
            value = args[name]
            hosts.append(_clean_host(value) if isinstance(value, str) else _UNREADABLE)
    return hosts


# --- matching ---------------------------------------------------------------------


def _over_values(values: Sequence[Any], effect: Effect, test: Callable[[Any], bool]) -> bool:
    """ANY value for a deny, ALL (at least one) for an allow; unreadable fails closed."""
    if effect == "deny":
        return any(isinstance(v, _Unreadable) or test(v) for v in values)
    return bool(values) and all(not isinstance(v, _Unreadable) and test(v) for v in values)


def _rule_matches(compiled: _CompiledRule, tool: str, args: Mapping[str, Any]) -> bool:
    rule = compiled.rule
    if not tool_glob_matches(rule.tool, tool):
        return False
    glob = compiled.path
    if glob is not None and not _over_values(
        _path_values(args), rule.effect, lambda parts: _parts_match(glob, parts)
    ):
        return False
    domain = rule.domain
    if domain is not None and not _over_values(
        _host_values(args), rule.effect, lambda host: domain_matches(domain, host)
    ):
        return False
    if compiled.regex is not None and rule.regex is not None:
        text = args.get(rule.regex.field)
        if not isinstance(text, str) or compiled.regex.search(text) is None:
            return False
    if rule.max is not None:
        number = args.get(rule.max.field)
        if isinstance(number, bool) or not isinstance(number, int | float):
            return False
        if not number <= rule.max.value:
            return False  # NaN compares false: no match
    return True


def decide_structured(
    tool: str, args: Mapping[str, Any], rules: Sequence[StructuredRule] | CompiledRules
) -> StructuredDecision | None:
    """The first of ``rules`` that matches ``tool`` called with ``args``, or None.

    Pass the arguments as the tool will see them (defaults filled in), so a rule reads
    the same path the tool opens.
    """
    compiled = rules if isinstance(rules, CompiledRules) else compile_rules(rules)
    for candidate in compiled.rules:
        if _rule_matches(candidate, tool, args):
            rule = candidate.rule
            reason = rule.reason
            if not reason and rule.effect == "deny":
                reason = (
                    f"the review policy's structured rule {candidate.index + 1} "
                    f"denies this call of {shown(tool)}"
                )
            return StructuredDecision(
                effect=rule.effect,
                skip_model=rule.skip_model,
                reason=reason,
                rule_index=candidate.index,
            )
    return None
