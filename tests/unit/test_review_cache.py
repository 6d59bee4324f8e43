"""The review decision cache and the rule-set hash that keys it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatewayd.policy.review_section import ReviewSection
from gatewayd.review.cache import CachedVerdict, CacheKey, DecisionCache, cache_key
from gatewayd.review.ruleset import RuleSet, ruleset_hash
from gatewayd.review.verdict import ALLOWED, Verdict

DENIED = Verdict(allowed=False, reason="writes a key", parse_ok=True)
BASE: dict[str, Any] = {
    "mode": "llm",
    "model": "reviewer",
    "rules": {
        "allow": ["Writing notes", {"text": "Reading files", "addedBy": "alice"}],
        "deny": ["Secrets"],
    },
    "structured": [
        {"effect": "deny", "tool": "fs.*", "path": "/workspace/.git/**", "reason": "git"}
    ],
}


def _section(**changes: Any) -> ReviewSection:
    return ReviewSection.model_validate({**BASE, **changes})


def _key(name: str, ruleset: str = "rs") -> CacheKey:
    key = cache_key(ruleset, "fs.read", {"path": name})
    assert key is not None
    return key


# --- the rule-set hash --------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {
            "rules": {
                "allow": ["Writing notes", "Reading files", "Deleting files"],
                "deny": ["Secrets"],
            }
        },
        {"rules": {"allow": ["Writing notes", "Reading files"], "deny": []}},
        {"rules": {"allow": ["Writing notes", "Reading files"], "deny": ["Secrets!"]}},
        {
            "rules": {"allow": ["Reading files", "Writing notes"], "deny": ["Secrets"]}
        },  # order shows
        {
            "structured": [
                {"effect": "deny", "tool": "fs.*", "path": "/workspace/.git/**", "reason": "no"}
            ]
        },
        {"structured": []},
        {"model": "other-reviewer"},
        {"max_value_chars": 100},
    ],
)
def test_any_change_that_can_change_a_verdict_changes_the_hash(changes: dict[str, Any]) -> None:
    assert ruleset_hash(_section(**changes)) != ruleset_hash(_section())


@pytest.mark.parametrize(
    "changes",
    [
        {
            "rules": {
                "allow": ["Writing notes", {"text": "Reading files", "addedBy": "bob"}],
                "deny": ["Secrets"],
            }
        },
        {
            "rules": {
                "allow": ["Writing notes", "Reading files"],
                "deny": [{"text": "Secrets", "addedBy": "eve"}],
            }
        },
        {"timeout_s": 3},
        {"tools": ["fs.*"]},
        {"cache": {"max_entries": 5, "ttl_s": 1}},
    ],
)
def test_settings_that_cannot_change_a_verdict_keep_the_hash(changes: dict[str, Any]) -> None:
    assert ruleset_hash(_section(**changes)) == ruleset_hash(_section())


def test_the_hash_is_the_same_in_another_process() -> None:
    here = ruleset_hash(_section())
    code = (
        "import json, sys\n"
        "from gatewayd.policy.review_section import ReviewSection\n"
        "from gatewayd.review.ruleset import ruleset_hash\n"
        "print(ruleset_hash(ReviewSection.model_validate(json.loads(sys.argv[1]))))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(BASE)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    assert out.stdout.strip() == here
    assert len(here) == 64 and int(here, 16) >= 0


def test_a_rule_set_holds_what_the_review_reads() -> None:
    ruleset = RuleSet.from_section(_section())
    assert ruleset.allow == ("Writing notes", "Reading files")
    assert ruleset.deny == ("Secrets",)
    assert ruleset.structured == _section().structured
    assert (ruleset.model, ruleset.max_value_chars) == ("reviewer", 2000)
    assert ruleset.digest == ruleset_hash(_section())
    assert RuleSet.from_section(_section()) == ruleset


# --- keys -----------------------------------------------------------------------------


def test_a_key_ignores_argument_order_at_every_depth() -> None:
    a = cache_key("rs", "fs.write", {"path": "a", "opts": {"x": 1, "y": [1, {"p": 1, "q": 2}]}})
    b = cache_key("rs", "fs.write", {"opts": {"y": [1, {"q": 2, "p": 1}], "x": 1}, "path": "a"})
    assert a == b


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (("rs1", "fs.read", {"path": "a"}), ("rs2", "fs.read", {"path": "a"})),
        (("rs", "fs.read", {"path": "a"}), ("rs", "fs.stat", {"path": "a"})),
        (("rs", "fs.read", {"path": "a"}), ("rs", "fs.read", {"path": "b"})),
        (("ab", "c", {}), ("a", "bc", {})),  # no ambiguity where one field ends
        (("rs", "t", {"n": 1}), ("rs", "t", {"n": 1.0})),
        (("rs", "t", {"n": 1}), ("rs", "t", {"n": True})),
        (("rs", "t", {"n": None}), ("rs", "t", {"n": float("inf")})),
        (("rs", "t", {"n": 0.0}), ("rs", "t", {"n": -0.0})),
        (("rs", "t", {"n": "1"}), ("rs", "t", {"n": 1})),
        (("rs", "t", {"n": []}), ("rs", "t", {"n": {}})),
    ],
)
def test_different_calls_get_different_keys(
    one: tuple[str, str, dict[str, Any]], other: tuple[str, str, dict[str, Any]]
) -> None:
    assert cache_key(*one) != cache_key(*other)


def test_a_key_is_bounded_whatever_the_arguments() -> None:
    key = cache_key("rs", "fs.write", {"content": "x" * 1_000_000})
    assert key is not None and len(key.digest) == 32 and key.ruleset == "rs"


def _deep(levels: int) -> Any:
    value: Any = []
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    "args",
    [
        {"n": 2**70},
        {"n": -(2**63) - 1},
        {"s": "\ud800"},
        {"d": {1: "x"}},
        {"deep": _deep(100_000)},
        {"o": object()},
    ],
)
def test_arguments_without_a_canonical_encoding_get_no_key(args: dict[str, Any]) -> None:
    assert cache_key("rs", "t", args) is None


# --- the cache --------------------------------------------------------------------------


def test_a_stored_verdict_is_found_until_it_expires() -> None:
    cache = DecisionCache(max_entries=10, ttl_s=60)
    assert cache.get(_key("a"), now=0) is None
    cache.put(_key("a"), DENIED, now=100)
    assert cache.get(_key("a"), now=159.9) == CachedVerdict(
        verdict=DENIED, stored_at=100, expires_at=160
    )
    assert cache.get(_key("a"), now=160) is None
    assert len(cache) == 0  # the expired entry is gone, not only hidden


def test_the_least_recently_used_entry_goes_when_full() -> None:
    cache = DecisionCache(max_entries=2, ttl_s=60)
    cache.put(_key("a"), ALLOWED, now=0)
    cache.put(_key("b"), ALLOWED, now=0)
    assert cache.get(_key("a"), now=1) is not None  # a is now more recent than b
    cache.put(_key("c"), ALLOWED, now=2)
    assert len(cache) == 2
    assert cache.get(_key("b"), now=3) is None
    assert cache.get(_key("a"), now=3) is not None
    assert cache.get(_key("c"), now=3) is not None


def test_putting_again_replaces_the_verdict_and_restarts_its_time() -> None:
    cache = DecisionCache(max_entries=2, ttl_s=10)
    cache.put(_key("a"), ALLOWED, now=0)
    cache.put(_key("a"), DENIED, now=5)
    hit = cache.get(_key("a"), now=12)
    assert hit is not None and hit.verdict == DENIED and hit.expires_at == 15
    assert len(cache) == 1


def test_zero_entries_turns_the_cache_off() -> None:
    cache = DecisionCache(max_entries=0, ttl_s=10)
    cache.put(_key("a"), ALLOWED, now=0)
    assert cache.get(_key("a"), now=0) is None and len(cache) == 0


def test_a_rule_change_misses_and_invalidate_frees_the_old_rule_set() -> None:
    old, new = ruleset_hash(_section()), ruleset_hash(_section(model="other"))
    cache = DecisionCache(max_entries=10, ttl_s=60)
    args = {"path": "a"}
    old_key = cache_key(old, "fs.read", args)
    new_key = cache_key(new, "fs.read", args)
    assert old_key is not None and new_key is not None
    cache.put(old_key, ALLOWED, now=0)
    cache.put(_key("b", ruleset=old), ALLOWED, now=0)
    cache.put(_key("c", ruleset="unrelated"), ALLOWED, now=0)
    assert cache.get(new_key, now=1) is None
    assert cache.invalidate(old) == 2
    assert len(cache) == 1 and cache.get(_key("c", ruleset="unrelated"), now=1) is not None
    assert cache.invalidate() == 1 and len(cache) == 0


def test_clear_forgets_everything() -> None:
    cache = DecisionCache(max_entries=10, ttl_s=60)
    for name in "abc":
        cache.put(_key(name), ALLOWED, now=0)
    cache.clear()
    assert len(cache) == 0 and cache.get(_key("a"), now=0) is None


@pytest.mark.parametrize(
    ("max_entries", "ttl_s", "message"),
    [
        (-1, 10.0, "max_entries must be 0 (off) or more, not -1"),
        (10, 0.0, "ttl_s must be a positive number of seconds, not 0.0"),
        (10, float("nan"), "ttl_s must be a positive number of seconds, not nan"),
    ],
)
def test_bad_settings_are_refused_saying_what_is_allowed(
    max_entries: int, ttl_s: float, message: str
) -> None:
    with pytest.raises(ValueError) as info:
        DecisionCache(max_entries=max_entries, ttl_s=ttl_s)
    assert str(info.value) == message


_OPS = st.lists(
    st.tuples(st.sampled_from(["put", "get"]), st.integers(0, 5), st.integers(0, 3)), max_size=60
)


@given(ops=_OPS, max_entries=st.integers(0, 4))
def test_the_cache_behaves_like_a_plain_lru_with_expiry(
    ops: list[tuple[str, int, int]], max_entries: int
) -> None:
    ttl = 5.0
    cache = DecisionCache(max_entries=max_entries, ttl_s=ttl)
    model: dict[int, float] = {}  # name -> expiry, in least-recently-used order
    now = 0.0
    for op, name, step in ops:
        now += step
        key = _key(str(name))
        if op == "put":
            if max_entries:
                model.pop(name, None)
                model[name] = now + ttl
                while len(model) > max_entries:
                    del model[next(iter(model))]
            cache.put(key, ALLOWED, now)
        else:
            expected = name in model and now < model[name]
            if name in model:
                expiry = model.pop(name)
                if expected:
                    model[name] = expiry
            assert (cache.get(key, now) is not None) is expected
        assert len(cache) == len(model) <= max_entries
