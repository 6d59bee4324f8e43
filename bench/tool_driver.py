"""The client side of bench/tool_runners.py, run inside a run's sandbox: standard library
only (the sandbox's system python3), talking to the run's socket ($COGNI_GATEWAY_SOCK)
with the gateway's framing (a 4-byte big-endian length, then the JSON request), as
cogni-tool does, one connection for all calls.

    tool_driver.py warm ROUNDS CALLS PROCESS_CALLS WARMUP
        fs.read, text.wordcount (wasm) and files.lines (process) in ROUNDS interleaved
        rounds whose order rotates: CALLS sequential calls each (PROCESS_CALLS for the
        process tool, a sandbox per call), after WARMUP calls of each.
    tool_driver.py first VARIANT
        one call of VARIANT (wasm: text.wordcount, whose module a fresh daemon compiles
        or loads from its disk cache; fs_read: the built-in baseline), the run's first,
        then one more (warm).

Prints one JSON line: {variant: [seconds, ...]}. Every answer must be ok.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from typing import Any

HEADER = struct.Struct(">I")
# The bench's calls: the arguments are the same every time.
CALLS: dict[str, tuple[str, dict[str, Any]]] = {
    "fs_read": ("fs.read", {"path": "src/small.txt"}),
    "wasm": ("text.wordcount", {"text": "the quick brown fox jumps over the lazy dog\n" * 4}),
    "process": ("files.lines", {"paths": ["src/small.txt"]}),
}


class Client:
    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(os.environ["COGNI_GATEWAY_SOCK"])
        self.run_id = os.environ["COGNI_RUN_ID"]
        self.buf = bytearray()
        self.n = 0

    def call(self, tool: str, args: dict[str, Any]) -> float:
        self.n += 1
        body = json.dumps(
            {"v": 1, "runId": self.run_id, "toolCallId": f"d{self.n}", "tool": tool, "args": args}
        ).encode()
        started = time.perf_counter()
        self.sock.sendall(HEADER.pack(len(body)) + body)
        while True:
            if len(self.buf) >= 4:
                (size,) = HEADER.unpack_from(self.buf)
                if len(self.buf) >= 4 + size:
                    frame = bytes(self.buf[4 : 4 + size])
                    del self.buf[: 4 + size]
                    break
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise SystemExit("the gateway closed the connection")
            self.buf += chunk
        elapsed = time.perf_counter() - started
        answer = json.loads(frame)
        if not answer.get("ok"):
            raise SystemExit(f"{tool} failed: {answer}")
        return elapsed


def warm(rounds: int, calls: int, process_calls: int, warmup: int) -> dict[str, list[float]]:
    client = Client()
    counts = {"fs_read": calls, "wasm": calls, "process": process_calls}
    for name, (tool, args) in CALLS.items():
        for _ in range(min(warmup, counts[name])):
            client.call(tool, args)
    times: dict[str, list[float]] = {name: [] for name in CALLS}
    order = list(CALLS)
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            tool, args = CALLS[name]
            times[name] += [client.call(tool, args) for _ in range(counts[name])]
    return times


def first(variant: str) -> dict[str, list[float]]:
    client = Client()
    tool, args = CALLS[variant]
    return {"first": [client.call(tool, args)], "second": [client.call(tool, args)]}


def main() -> None:
    if sys.argv[1] == "warm":
        rounds, calls, process_calls, warmup = (int(a) for a in sys.argv[2:6])
        times = warm(rounds, calls, process_calls, warmup)
    else:
        times = first(sys.argv[2])
    print(json.dumps(times))


if __name__ == "__main__":
    main()
