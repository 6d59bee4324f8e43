"""What the metrics add to one call on the trio thread, in nanoseconds.

    .venv/bin/python bench/metrics_cost.py

Times the dispatcher's own metric updates (an allowed call: tool label, calls counter,
duration histogram; a denied call: tool label, calls and denials counters) against the
budget they were given: one dict lookup plus an int add. Prints figures; asserts nothing.
"""

from __future__ import annotations

import timeit
from typing import Any

from gatewayd.dispatch import Dispatcher
from gatewayd.metrics import GatewayMetrics
from gatewayd.protocol import ErrorCode
from gatewayd.tools import builtin_tools

N = 1_000_000


def per_call_ns(stmt: Any, repeat: int = 7) -> float:
    return min(timeit.repeat(stmt, number=N, repeat=repeat)) / N * 1e9


def main() -> None:
    dispatcher = Dispatcher.__new__(Dispatcher)  # no audit log: only the metric hooks run
    tools = builtin_tools()
    Dispatcher.__init__(dispatcher, None, tools, metrics=GatewayMetrics())  # type: ignore[arg-type]
    baseline: dict[tuple[str, str], int] = {("fs.read", "allowed"): 0}
    key = ("fs.read", "allowed")

    def budget() -> None:
        baseline[key] += 1

    def allowed() -> None:
        dispatcher._count_allowed("fs.read", 0.0004, None)

    def denied() -> None:
        dispatcher._count_denied("fs.read", ErrorCode.POLICY_DENIED)

    def empty() -> None:
        pass

    call = per_call_ns(empty)
    rows = [
        ("budget: dict lookup + int add", per_call_ns(budget) - call),
        ("allowed call: label, counter, histogram", per_call_ns(allowed) - call),
        ("denied call: label, two counters", per_call_ns(denied) - call),
    ]
    print(f"{'what':45} ns/call (a Python call's own {call:.0f} ns taken off)")
    for what, ns in rows:
        print(f"{what:45} {ns:7.0f}")


if __name__ == "__main__":
    main()
