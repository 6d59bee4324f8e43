"""The run socket under load and abuse: pipelining with out-of-order answers, slow,
silent and non-reading clients that must not hold anyone else up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
from structlog.testing import capture_logs

from gatewayd import server
from gatewayd.tools import builtin_tools
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.registry import ToolContext, ToolRegistry
from tests.conftest import frame, make_gateway, raw_exchange, read_frame, request


class _Nap(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    seconds: float = 0.3


async def _nap(args: _Nap, _c: ToolContext) -> Any:
    await trio.sleep(args.seconds)
    return {"slept": args.seconds}


class _Big(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    chars: int


async def _big(args: _Big, _c: ToolContext) -> Any:
    return "x" * args.chars


TOOLS = ToolRegistry(
    (
        *builtin_tools().values(),
        builtin_tool(name="test.nap", summary="sleeps", args_type=_Nap, run=_nap),
        builtin_tool(name="test.big", summary="a long string", args_type=_Big, run=_big),
    )
)
POLICY = """
version: 1
name: server-tests
tools: {allow: [time.now, test.nap, test.big]}
limits: {call_timeout_s: 5, calls_per_second: 10000, burst: 10000, max_concurrent_calls: 2}
"""


async def test_pipelined_requests_are_answered_out_of_order_with_their_ids(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp, TOOLS) as gw:
        run = await gw.create_run(workspace, POLICY)
        payload = frame(request(run, "test.nap", {"seconds": 0.3}, tcid="slow")) + frame(
            request(run, "time.now", tcid="fast")
        )
        first, second = await raw_exchange(run.socket_path, payload, expect=2)
        assert first["toolCallId"] == "fast" and first["ok"]
        assert second["toolCallId"] == "slow" and second["value"] == {"slept": 0.3}


async def test_a_stalled_partial_frame_neither_blocks_others_nor_lives_forever(
    short_tmp: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "FRAME_TIMEOUT_S", 0.5)
    async with make_gateway(short_tmp, TOOLS) as gw:
        run = await gw.create_run(workspace, POLICY)
        stalled = await trio.open_unix_socket(str(run.socket_path))
        await stalled.send_all(frame(request(run, "time.now"))[:7])
        silent = await trio.open_unix_socket(str(run.socket_path))
        with trio.fail_after(2):
            [resp] = await raw_exchange(run.socket_path, frame(request(run, "time.now")))
        assert resp["ok"]
        with trio.fail_after(3):  # the stalled connection is closed by the server
            assert await stalled.receive_some(100) == b""
        await stalled.aclose()
        await silent.aclose()


async def test_a_client_that_never_reads_does_not_hold_up_others(
    short_tmp: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "SEND_TIMEOUT_S", 0.5)
    async with make_gateway(short_tmp, TOOLS) as gw:
        run = await gw.create_run(workspace, POLICY)
        hog = await trio.open_unix_socket(str(run.socket_path))
        # Enough tools.list calls that the answers overflow the socket buffers.
        burst = b"".join(frame(request(run, "tools.list", tcid=f"h{i}")) for i in range(400))
        with trio.move_on_after(2):
            await hog.send_all(burst)
        with trio.fail_after(5):
            [resp] = await raw_exchange(run.socket_path, frame(request(run, "time.now")))
        assert resp["ok"]
        await hog.aclose()


async def test_per_run_concurrency_is_bounded(short_tmp: Path, workspace: Path) -> None:
    async with make_gateway(short_tmp, TOOLS) as gw:
        run = await gw.create_run(workspace, POLICY)  # max_concurrent_calls: 2
        payload = b"".join(
            frame(request(run, "test.nap", {"seconds": 0.3}, tcid=f"n{i}")) for i in range(4)
        )
        start = trio.current_time()
        responses = await raw_exchange(run.socket_path, payload, expect=4)
        elapsed = trio.current_time() - start
        assert sorted(r["toolCallId"] for r in responses) == ["n0", "n1", "n2", "n3"]
        assert all(r["ok"] for r in responses)
        # 4 naps of 0.3 s, two at a time, cannot finish in less than two rounds.
        assert elapsed >= 0.55


async def test_many_connections_from_one_client_each_get_their_answers(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp, TOOLS) as gw:
        run = await gw.create_run(workspace, POLICY)
        results: list[dict[str, Any]] = []

        async def one(i: int) -> None:
            stream = await trio.open_unix_socket(str(run.socket_path))
            async with stream:
                for j in range(5):
                    await stream.send_all(frame(request(run, "time.now", tcid=f"c{i}-{j}")))
                    msg = await read_frame(stream, bytearray())
                    assert msg is not None
                    results.append(msg)

        async with trio.open_nursery() as nursery:
            for i in range(30):
                nursery.start_soon(one, i)
        assert len(results) == 150 and all(r["ok"] for r in results)
        assert len({r["toolCallId"] for r in results}) == 150


async def test_a_client_that_never_reads_is_disconnected_after_the_send_timeout(
    short_tmp: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "SEND_TIMEOUT_S", 0.5)
    async with make_gateway(short_tmp, TOOLS) as gw:
        run = await gw.create_run(workspace, POLICY)
        hog = await trio.open_unix_socket(str(run.socket_path))
        with capture_logs() as logs:
            async with hog:
                burst = b"".join(
                    frame(request(run, "tools.list", tcid=f"h{i}")) for i in range(400)
                )
                with trio.move_on_after(2):
                    await hog.send_all(burst)
                await trio.sleep(1.0)  # not reading, twice the send timeout
                answered = 0
                buf = bytearray()
                with trio.fail_after(5):  # what was sent before the drop, then EOF
                    while await read_frame(hog, buf) is not None:
                        answered += 1
        assert 0 < answered < 400
    # The drop is the operator's log's news, not a failure of gatewayd's.
    events = [entry["event"] for entry in logs]
    assert "client_not_reading" in events
    assert "connection_failed" not in events
    [dropped] = [entry for entry in logs if entry["event"] == "connection_dropped"]
    assert dropped["reason"] == "the connection was closed"


async def test_a_response_larger_than_the_socket_buffer_is_not_interleaved(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp, TOOLS) as gw:
        run = await gw.create_run(workspace, POLICY)
        stream = await trio.open_unix_socket(str(run.socket_path))
        async with stream:
            chars = 900_000  # several socket buffers: written in parts, with waits
            payload = frame(request(run, "test.big", {"chars": chars}, tcid="big")) + b"".join(
                frame(request(run, "time.now", tcid=f"t{i}")) for i in range(5)
            )
            await stream.send_all(payload)
            await trio.sleep(0.2)  # let the small answers queue behind the big one
            buf = bytearray()
            got: dict[str, Any] = {}
            with trio.fail_after(10):
                while len(got) < 6:
                    msg = await read_frame(stream, buf)
                    assert msg is not None
                    got[msg["toolCallId"]] = msg
        assert got["big"]["value"] == "x" * chars
        assert all(got[f"t{i}"]["ok"] for i in range(5))


async def test_calls_in_flight_on_one_connection_are_capped(
    short_tmp: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "MAX_INFLIGHT_PER_CONNECTION", 2)
    roomy = POLICY.replace("max_concurrent_calls: 2", "max_concurrent_calls: 16")
    async with make_gateway(short_tmp, TOOLS) as gw:
        run = await gw.create_run(workspace, roomy)
        payload = b"".join(
            frame(request(run, "test.nap", {"seconds": 0.3}, tcid=f"n{i}")) for i in range(4)
        )
        start = trio.current_time()
        responses = await raw_exchange(run.socket_path, payload, expect=4)
        elapsed = trio.current_time() - start
        assert sorted(r["toolCallId"] for r in responses) == ["n0", "n1", "n2", "n3"]
        # The run allows 16 at once, so only the per-connection cap makes two rounds.
        assert elapsed >= 0.55


async def test_a_connection_idle_past_the_idle_timeout_is_closed(
    short_tmp: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "IDLE_TIMEOUT_S", 0.5)
    async with make_gateway(short_tmp, TOOLS) as gw:
        run = await gw.create_run(workspace, POLICY)
        stream = await trio.open_unix_socket(str(run.socket_path))
        async with stream:
            buf = bytearray()
            for i in range(3):  # activity keeps it open past one timeout
                await trio.sleep(0.3)
                await stream.send_all(frame(request(run, "time.now", tcid=f"k{i}")))
                msg = await read_frame(stream, buf)
                assert msg is not None and msg["ok"]
            start = trio.current_time()
            with trio.fail_after(3):
                assert await stream.receive_some(100) == b""
            assert trio.current_time() - start >= 0.4


async def test_a_call_cut_short_by_the_run_ending_still_gets_a_result_entry(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp, TOOLS) as gw:
        run = await gw.create_run(workspace, POLICY)
        stream = await trio.open_unix_socket(str(run.socket_path))
        await stream.send_all(frame(request(run, "test.nap", {"seconds": 30}, tcid="long")))
        await trio.sleep(0.3)  # the call is admitted and running
        await gw.daemon.runs.end(run.run_id)
        await stream.aclose()
        mine = [e for e in await gw.audit_entries() if e.get("toolCallId") == "long"]
        assert [e["kind"] for e in mine] == ["call", "result"]
        assert mine[1]["errorCode"] == "internal"
        assert "shutting down" in mine[1]["safeMessage"]


async def test_connections_over_the_runs_limit_are_refused_with_a_reason(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp, TOOLS) as gw:
        run = await gw.create_run(workspace, POLICY)
        held = [
            await trio.open_unix_socket(str(run.socket_path))
            for _ in range(server.MAX_CONNECTIONS_PER_RUN)
        ]
        await trio.sleep(0.2)  # let the server accept them all
        [resp] = await raw_exchange(run.socket_path, frame(request(run, "time.now")))
        assert resp["errorCode"] == "rate_limited" and resp["toolCallId"] is None
        assert str(server.MAX_CONNECTIONS_PER_RUN) in resp["safeMessage"]
        for s in held:
            await s.aclose()
        await trio.sleep(0.2)
        [resp] = await raw_exchange(run.socket_path, frame(request(run, "time.now")))
        assert resp["ok"], "a slot frees when a connection closes"
        refused = [e for e in await gw.audit_entries() if e.get("event") == "connection_refused"]
        assert len(refused) == 1


async def test_a_flood_of_refused_connections_is_audited_sparingly_and_answered_fast(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp, TOOLS) as gw:
        run = await gw.create_run(workspace, POLICY)
        held = [
            await trio.open_unix_socket(str(run.socket_path))
            for _ in range(server.MAX_CONNECTIONS_PER_RUN)
        ]
        await trio.sleep(0.2)
        started = trio.current_time()
        answers = []
        for _ in range(200):  # a connect loop, as a hostile sandbox would run
            [resp] = await raw_exchange(run.socket_path, frame(request(run, "time.now")))
            answers.append(resp["errorCode"])
        elapsed = trio.current_time() - started
        for s in held:
            await s.aclose()
        assert answers == ["rate_limited"] * 200  # every one still gets its reason
        refused = [e for e in await gw.audit_entries() if e.get("event") == "connection_refused"]
        # One entry per second of flood (plus the first), each counting those left out.
        assert 1 <= len(refused) <= elapsed / server.REFUSAL_AUDIT_INTERVAL_S + 2
        counted = len(refused) + sum(
            e.get("detail", {}).get("suppressedSinceLast", 0) for e in refused
        )
        assert counted <= 200 and (len(refused) == 1 or counted > len(refused))


async def test_garbage_frames_spend_the_runs_budget_and_then_close_the_connection(
    short_tmp: Path, workspace: Path
) -> None:
    policy = """
    version: 1
    name: stingy
    tools: {allow: [time.now]}
    limits: {calls_per_second: 0.01, burst: 3}
    """
    async with make_gateway(short_tmp, TOOLS) as gw:
        run = await gw.create_run(workspace, policy)
        payload = frame(b"junk") * 10
        responses = await raw_exchange(run.socket_path, payload, expect=10)
        codes = [r["errorCode"] for r in responses]
        assert codes == ["bad_request"] * 3 + ["rate_limited"], codes
        assert "malformed frames count too" in responses[-1]["safeMessage"]


@pytest.mark.parametrize("occupant", ["a file", "a live socket"])
async def test_a_listener_is_never_put_over_an_existing_path(
    short_tmp: Path, occupant: str
) -> None:
    """The socket is linked into place, not renamed over what is there: another
    daemon's socket or a log file at the path stays as it is."""
    path = short_tmp / "taken"
    if occupant == "a file":
        path.write_text("someone's\n")
        before = path.read_bytes()
    else:
        other = await server.open_unix_listener(path)
    with pytest.raises(FileExistsError):
        await server.open_unix_listener(path)
    if occupant == "a file":
        assert path.read_bytes() == before
    else:
        async with other, await trio.open_unix_socket(str(path)):
            pass  # still the first listener's
    assert [p.name for p in short_tmp.iterdir()] == ["taken"]  # no staging name left
