"""What the audit log keeps of a call's arguments: a digest of all of them and a short,
redacted summary a reviewer can read.

The digest (sha256 of the canonical JSON) lets a reviewer prove which arguments a
call had without the log holding file contents or secrets; the summary keeps only
short scalar values and masks anything whose key looks like a credential.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Final

import msgspec

# Enough to recognise a path or a command in a table.
MAX_SUMMARY_STR: Final = 120
# A handful of keys tells the story; a call with hundreds of keys is itself suspicious.
MAX_SUMMARY_KEYS: Final = 16
MAX_SUMMARY_DEPTH: Final = 2
_SECRET_KEY: Final = re.compile(
    r"(pass(word|wd)?|secret|token|api[-_]?key|auth|credential|private[-_]?key|cookie)",
    re.IGNORECASE,
)
# Keys that carry file contents or message bodies: only their size is summarized
# (the digest still covers them), so the audit log never holds what a file says.
_CONTENT_KEY: Final = re.compile(r"^(content|old|new|data|body|text|messages?)$", re.IGNORECASE)
_canonical: Final = msgspec.json.Encoder(order="sorted")


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys and no whitespace: equal values give equal bytes."""
    return _canonical.encode(value)


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def args_digest(args: Any) -> str:
    """The digest recorded as ``argsDigest``."""
    if type(args) is dict and not args:
        # The arguments of most calls without any (time.now, tools.list): hashed once.
        return _EMPTY_ARGS_DIGEST
    return sha256_digest(canonical_json(args))


_EMPTY_ARGS_DIGEST: Final = sha256_digest(canonical_json({}))


def summarize(value: Any, depth: int = 0) -> Any:
    """A short, redacted copy of ``value`` for the audit log."""
    if isinstance(value, str):
        if len(value) <= MAX_SUMMARY_STR:
            return value
        return f"{value[:MAX_SUMMARY_STR]}…[{len(value)} chars]"
    if isinstance(value, bool | int | float) or value is None:
        return value
    if depth >= MAX_SUMMARY_DEPTH:
        return f"[{type(value).__name__}]"
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for i, (key, item) in enumerate(value.items()):
            if i == MAX_SUMMARY_KEYS:
                out["…"] = f"{len(value) - MAX_SUMMARY_KEYS} more keys"
                break
            k = str(key)[:MAX_SUMMARY_STR]
            if _SECRET_KEY.search(k):
                out[k] = "[redacted]"
            elif _CONTENT_KEY.match(k) and isinstance(item, str):
                out[k] = f"[{len(item)} chars]"
            else:
                out[k] = summarize(item, depth + 1)
        return out
    if isinstance(value, list):
        head = [summarize(v, depth + 1) for v in value[:MAX_SUMMARY_KEYS]]
        if len(value) > MAX_SUMMARY_KEYS:
            head.append(f"…{len(value) - MAX_SUMMARY_KEYS} more items")
        return head
    return f"[{type(value).__name__}]"
