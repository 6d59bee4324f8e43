"""What the audit log keeps of a call's arguments."""

from __future__ import annotations

import hashlib

from gatewayd.argsummary import MAX_SUMMARY_KEYS, args_digest, summarize


def test_file_contents_are_summarized_by_size_only() -> None:
    out = summarize({"path": "a.md", "content": "top secret plan", "old": "x", "new": "yy"})
    assert out == {"path": "a.md", "content": "[15 chars]", "old": "[1 chars]", "new": "[2 chars]"}


def test_credential_like_keys_are_redacted_at_any_depth() -> None:
    out = summarize({"headers": {"Authorization": "Bearer sk-1"}, "api_key": "sk-2"})
    assert out == {"headers": {"Authorization": "[redacted]"}, "api_key": "[redacted]"}


def test_long_values_and_many_keys_are_capped() -> None:
    out = summarize({"path": "p" * 500, **{f"k{i}": i for i in range(40)}})
    assert out["path"].endswith("…[500 chars]")
    assert len(out) == MAX_SUMMARY_KEYS + 1 and "…" in out


def test_the_digest_covers_everything_and_ignores_key_order() -> None:
    assert args_digest({"a": 1, "b": "x"}) == args_digest({"b": "x", "a": 1})
    assert args_digest({"content": "one"}) != args_digest({"content": "two"})


def test_no_arguments_have_the_digest_of_their_canonical_json() -> None:
    # Empty arguments take a digest computed once; it must be the one hashing gives.
    empty = "sha256:" + hashlib.sha256(b"{}").hexdigest()
    assert args_digest({}) == empty
    assert args_digest([]) == "sha256:" + hashlib.sha256(b"[]").hexdigest()
    assert args_digest({"a": None}) != empty
