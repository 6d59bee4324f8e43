"""Review verdicts remembered per rule set, tool and arguments.

The key is a digest of the rule set's hash, the tool and the arguments' canonical
encoding (msgpack with sorted keys: floats kept bit for bit, so ``inf`` is not ``null``
and ``1.0`` is not ``1``). A rule change gives a new rule-set hash, so an old entry is
never hit again; :meth:`DecisionCache.invalidate` also frees them at once. Nothing here
reads a clock: the caller passes ``now`` (monotonic seconds) to every call.

Memory: an entry holds a 32-byte digest, a reference to the rule-set hash string (one
shared object per rule set), two floats and a :class:`~gatewayd.review.verdict.Verdict`
whose reason is at most ``MAX_REASON_CHARS`` (500) characters: under 3 KiB at worst,
about 400 bytes for an ``ALLOW``, whatever the size of the arguments.

What to store is the caller's choice; ``put`` stores what it is given.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import msgspec

from gatewayd.review.verdict import Verdict

# 256 bits: a collision would hand one call another call's verdict, so the key must be
# collision-resistant against an agent choosing arguments, not only against chance.
KEY_DIGEST_BYTES: Final = 32
_canonical: Final = msgspec.msgpack.Encoder(order="sorted")
# What the canonical encoding refuses: integers past 64 bits, lone surrogates, non-str
# keys, nesting deeper than the encoder's recursion limit, values that are not data.
_UNENCODABLE: Final = (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError)


class CacheKey(NamedTuple):
    """Where a verdict is remembered: its rule set, and a digest of everything."""

    ruleset: str
    digest: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class CachedVerdict:
    """A remembered verdict and when it was stored and expires (the caller's clock)."""

    verdict: Verdict
    stored_at: float
    expires_at: float


def cache_key(ruleset_hash: str, tool: str, args: Mapping[str, Any]) -> CacheKey | None:
    """The key of a review of ``tool`` with ``args`` under the rule set ``ruleset_hash``.

    None when the arguments have no canonical encoding (see ``_UNENCODABLE``): such a
    call is reviewed every time rather than risk two calls sharing a key.
    """
    try:
        encoded = _canonical.encode((ruleset_hash, tool, args))
    except _UNENCODABLE:
        return None
    digest = hashlib.blake2b(encoded, digest_size=KEY_DIGEST_BYTES).digest()
    return CacheKey(ruleset_hash, digest)


class DecisionCache:
    """A bounded LRU of verdicts that expire ``ttl_s`` seconds after they were stored.

    ``max_entries`` 0 turns the cache off: ``put`` keeps nothing.
    """

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be 0 (off) or more, not {max_entries}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be a positive number of seconds, not {ttl_s}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[CacheKey, CachedVerdict] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: CacheKey, now: float) -> CachedVerdict | None:
        """The verdict remembered under ``key``, unless it has expired by ``now``."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if now >= entry.expires_at:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry

    def put(self, key: CacheKey, verdict: Verdict, now: float, ttl_s: float | None = None) -> None:
        """Remember ``verdict`` under ``key`` from ``now`` for ``ttl_s`` (default: the
        cache's, and never longer); the least recently used entries go when full."""
        if self.max_entries == 0:
            return
        keep = self.ttl_s if ttl_s is None else min(ttl_s, self.ttl_s)
        self._entries[key] = CachedVerdict(verdict=verdict, stored_at=now, expires_at=now + keep)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def invalidate(self, ruleset_hash: str | None = None) -> int:
        """Forget the verdicts of one rule set (all when None); returns how many went."""
        if ruleset_hash is None:
            count = len(self._entries)
            self._entries.clear()
            return count
        stale = [key for key in self._entries if key.ruleset == ruleset_hash]
        for key in stale:
            del self._entries[key]
        return len(stale)

    def clear(self) -> None:
        """Forget everything."""
        self._entries.clear()
