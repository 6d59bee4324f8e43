"""The measuring side of bench/mcp_overhead.py: MCP clients that time ``tools/call``.

Standard library only (the official SDK is imported only when asked for), so that the
same file runs on the host and inside a run's sandbox, where bench/mcp_overhead.py copies
it into the workspace and starts it with the system python3:

    python3 -I /workspace/mcp_driver.py inside ROUNDS CALLS EXEC_CALLS WARMUP [SDK_PATH
                                          [BEHIND_TOOL [ROWS [DIRECT_SERVER ...]]]]

prints one JSON line: per variant (``exec``, ``mcp_raw``, ``mcp_sdk``, and with
BEHIND_TOOL, a declared MCP server's gateway tool: ``behind_raw``, ``behind_sdk``),
every call's seconds. ROWS ``c`` times the BEHIND_TOOL variants alone (``all``, the
default: every one). DIRECT_SERVER, the command of the same MCP server that gatewayd
runs behind BEHIND_TOOL: the driver starts it as its own subprocess and calls it
directly with both clients (``direct_raw``, ``direct_sdk``), interleaved with the
BEHIND_TOOL calls: the baseline measured beside them, in the same sandbox, by the same
interpreter, at the same moments.

Two MCP clients:

- :class:`LineClient`, our own minimal stdio client (``json`` and ``subprocess``): the
  handshake (``initialize``, ``notifications/initialized``) and ``tools/call``, one
  request in flight, nothing validated beyond the answer's id and ``isError``. Written
  here, not taken from a library, because its point is to cost nothing itself: it shows
  what the server side costs per call without a client's own work.
- :func:`sdk_session`, the official SDK's (``mcp`` on PyPI: ``stdio_client`` and
  ``ClientSession``), as an agent would use it; its pydantic models and anyio streams
  cost per call on top of the server's.

Calls of all variants are interleaved round by round (:func:`run_rounds`), so drift on a
loaded machine hits each alike. That is why the direct calls of DIRECT_SERVER are made
here too, not only on the host: a baseline measured in another phase of the bench (on
the host, by the host's interpreter, outside the sandbox) drifts apart from the calls it
is compared with (their difference moved by 1.2 ms between two runs of the same tree);
the direct calls made here share those calls' sandbox, interpreter and moments.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import IO, Any, Final

# A revision both cogni-tool mcp and the reference servers (the SDK's server side) speak.
PROTOCOL_VERSION: Final = "2025-06-18"
# How long a server may take to end once its input is closed.
CLOSE_WAIT_S: Final = 30.0
# The gateway call timed inside the sandbox: the cheapest tool, so the figure is the path.
GATEWAY_TOOL: Final = "time.now"
# The arguments of mcp-server-time's get_current_time, when it is called behind gatewayd.
BEHIND_ARGUMENTS: Final = {"timezone": "UTC"}
# The same tool's own name, when the driver calls the server directly.
DIRECT_TOOL: Final = "get_current_time"

Call = Callable[[], Awaitable[float]]


class DriverError(Exception):
    """A server's answer the bench cannot use (an error, or its end); says which."""


class LineClient:
    """A minimal MCP client over a stdio server's pipes: one request at a time.

    Resource handling: the server is a child process; :meth:`close` ends its input and
    waits for it (killed after CLOSE_WAIT_S).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        stderr: IO[Any] | int | None = None,
    ) -> None:
        self.argv = list(argv)
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
        )
        self.last_id = 0

    def _send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.last_id += 1
        self._send({"jsonrpc": "2.0", "id": self.last_id, "method": method, "params": params})
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise DriverError(f"{self.argv[0]} ended before answering {method}")
            message = json.loads(line)
            if "method" in message or message.get("id") != self.last_id:
                continue  # a notification (log, progress) or a server request: not ours
            if "error" in message:
                raise DriverError(f"{method} refused: {message['error']}")
            result: dict[str, Any] = message["result"]
            return result

    def initialize(self) -> None:
        info = {"name": "mcp_driver", "version": "1"}
        params = {"protocolVersion": PROTOCOL_VERSION, "capabilities": {}, "clientInfo": info}
        self.request("initialize", params)
        self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def call(self, tool: str, arguments: dict[str, Any]) -> float:
        """One tools/call; its wall time in seconds. A tool error is a DriverError."""
        started = time.perf_counter()
        result = self.request("tools/call", {"name": tool, "arguments": arguments})
        elapsed = time.perf_counter() - started
        if result.get("isError"):
            raise DriverError(f"{tool} answered an error: {result.get('content')}")
        return elapsed

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@asynccontextmanager
async def sdk_session(
    command: str,
    args: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    errlog: Any = None,
) -> AsyncIterator[Any]:
    """An initialized official-SDK ``ClientSession`` with the stdio server ``command``."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    server = StdioServerParameters(command=command, args=list(args), env=env)
    async with (
        stdio_client(server, errlog=errlog or sys.stderr) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


def sdk_call(session: Any, tool: str, arguments: dict[str, Any]) -> Call:
    """A timed ``call_tool`` of the SDK ``session``."""

    async def call() -> float:
        started = time.perf_counter()
        result = await session.call_tool(tool, arguments)
        elapsed = time.perf_counter() - started
        if result.is_error:
            raise DriverError(f"{tool} answered an error: {result.content}")
        return elapsed

    return call


def line_call(client: LineClient, tool: str, arguments: dict[str, Any]) -> Call:
    async def call() -> float:
        return client.call(tool, arguments)  # blocking: nothing else runs meanwhile

    return call


async def run_rounds(
    variants: dict[str, Call], *, rounds: int, calls: dict[str, int], warmup: int
) -> dict[str, list[float]]:
    """Each variant's ``calls[name]`` timed calls per round after ``warmup`` untimed
    ones, the variants' order rotating each round; every call's seconds by variant."""
    names = list(variants)
    for name in names:
        for _ in range(warmup):
            await variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for number in range(rounds):
        shift = number % len(names)
        for name in names[shift:] + names[:shift]:
            for _ in range(calls[name]):
                times[name].append(await variants[name]())
    return times


def exec_call() -> Call:
    """``cogni-tool exec time.now '{}'``: a process per call, as a shell script calls."""
    argv = ["cogni-tool", "exec", GATEWAY_TOOL, "{}"]

    async def call() -> float:
        started = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, check=True)
        return time.perf_counter() - started

    return call


async def inside(
    rounds: int,
    calls: int,
    exec_calls: int,
    warmup: int,
    sdk_path: str,
    behind: str,
    behind_only: bool = False,
    direct: Sequence[str] = (),
) -> None:
    """The in-sandbox measurement: the same gateway call through cogni-tool exec and
    through cogni-tool mcp (our client, and the SDK's when ``sdk_path`` names it); and,
    when ``behind`` names a gateway tool of a declared MCP server, that tool through
    cogni-tool mcp with both clients (``behind_raw``, ``behind_sdk``), and when
    ``direct`` is that server's command, the server called directly as a subprocess of
    this driver with both clients (``direct_raw``, ``direct_sdk``). ``behind_only``:
    the behind and direct variants alone."""
    variants: dict[str, Call] = {} if behind_only else {"exec": exec_call()}
    counts = {"exec": exec_calls, "mcp_raw": calls, "mcp_sdk": calls}
    counts |= dict.fromkeys(("behind_raw", "behind_sdk", "direct_raw", "direct_sdk"), calls)
    async with AsyncExitStack() as stack:
        raw = LineClient(["cogni-tool", "mcp"])
        stack.callback(raw.close)
        raw.initialize()
        if not behind_only:
            variants["mcp_raw"] = line_call(raw, GATEWAY_TOOL, {})
        if behind:
            variants["behind_raw"] = line_call(raw, behind, BEHIND_ARGUMENTS)
        if direct:
            direct_raw = LineClient(direct)
            stack.callback(direct_raw.close)
            direct_raw.initialize()
            variants["direct_raw"] = line_call(direct_raw, DIRECT_TOOL, BEHIND_ARGUMENTS)
        if sdk_path:
            sys.path.insert(0, sdk_path)  # the system python3 has no SDK of its own
            # The SDK passes only a few variables to its server by default; cogni-tool
            # needs the run's (its socket and run id).
            session = await stack.enter_async_context(
                sdk_session("cogni-tool", ["mcp"], env=dict(os.environ))
            )
            if not behind_only:
                variants["mcp_sdk"] = sdk_call(session, GATEWAY_TOOL, {})
            if behind:
                variants["behind_sdk"] = sdk_call(session, behind, BEHIND_ARGUMENTS)
            if direct:
                # The SDK's default environment for its server, as on the host.
                direct_session = await stack.enter_async_context(sdk_session(direct[0], direct[1:]))
                variants["direct_sdk"] = sdk_call(direct_session, DIRECT_TOOL, BEHIND_ARGUMENTS)
        times = await run_rounds(variants, rounds=rounds, calls=counts, warmup=warmup)
    print(json.dumps(times))


def main(argv: Sequence[str]) -> int:
    if len(argv) < 5 or argv[0] != "inside" or argv[7:8] not in ([], ["all"], ["c"]):
        print(__doc__, file=sys.stderr)
        return 2
    rounds, calls, exec_calls, warmup = (int(value) for value in argv[1:5])
    sdk_path = argv[5] if len(argv) > 5 else ""
    behind = argv[6] if len(argv) > 6 else ""
    behind_only = argv[7:8] == ["c"]
    direct = argv[8:]
    asyncio.run(inside(rounds, calls, exec_calls, warmup, sdk_path, behind, behind_only, direct))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
