"""A token bucket for a run's call rate, with the clock passed in (no I/O, no sleeping).

The bucket starts full (``burst`` tokens) and refills at ``rate`` tokens per second up
to ``burst``. Each call takes one token; with none left the call is refused and
:meth:`TokenBucket.retry_after` says how long until one is back. Time is whatever
monotonic number the caller passes, so tests drive it with a fake clock.
"""

from __future__ import annotations

import math
from typing import Final

# Float rounding of ``now + retry_after(now)`` (an ulp of a large monotonic clock reading)
# can leave 0.9999999 tokens after waiting exactly as told; a call that arrives this much
# early still gets its token. A microsecond stays above the ulp for clock values up to
# about 1e9 s and is far below any rate a policy can express usefully.
_SLACK_S: Final = 1e-6


class TokenBucket:
    """Refills at ``rate`` tokens per second, holds at most ``burst`` tokens."""

    def __init__(self, rate: float, burst: int) -> None:
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate must be a finite number above 0, got {rate!r}")
        if burst < 1:
            raise ValueError(f"burst must be at least 1, got {burst!r}")
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._last: float | None = None

    def _refill(self, now: float) -> None:
        # A clock that steps back adds no tokens and does not move the reference point.
        if self._last is None or now > self._last:
            if self._last is not None:
                self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now

    def try_take(self, now: float) -> bool:
        """Take one token at time ``now``; False (and nothing taken) when none is left."""
        self._refill(now)
        if self._tokens + self.rate * _SLACK_S >= 1:
            # Not clamped at 0: a token taken early is owed, so the slack never adds up.
            self._tokens -= 1
            return True
        return False

    def retry_after(self, now: float) -> float:
        """Seconds from ``now`` until :meth:`try_take` will succeed (0 when it would now)."""
        self._refill(now)
        missing = 1 - self._tokens
        if missing <= self.rate * _SLACK_S:
            return 0.0
        return missing / self.rate
