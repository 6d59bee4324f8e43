"""The run's multiplexer on real sockets of an in-process daemon: the calls of many
parked connections are taken and answered together, each exactly once; whatever it
does not take (a frame error, a call that needs a task, EOF) goes back to the
connection's own task, in order; and a parked client that stops reading is held to
the send timeout without holding up the other connections. A connection parks only
while another connection of its run is open: the tests that watch one connection keep
a second one open, idle."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd import server
from gatewayd.audit import read_entries
from gatewayd.dispatch import Answered, Dispatcher
from gatewayd.protocol import Response
from gatewayd.tools import builtin_tools
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.registry import ToolContext, ToolRegistry
from tests.conftest import frame, make_gateway, read_frame, request
from tests.integration.test_reply_after_result import Watch
from tests.integration.test_server_now import _NoArgs, gate_tools, spy_on_handle

POLICY = """
version: 1
name: multiplexer-tests
tools: {allow: [time.now, tools.list, test.wait, test.open, test.big]}
limits: {call_timeout_s: 10, calls_per_second: 100000, burst: 100000, max_concurrent_calls: 4,
  max_output_bytes: 4000000}
"""
# An answer of several socket buffers, made at once (no I/O: the multiplexer takes it).
BIG_CHARS = 900_000


def big_tools() -> ToolRegistry:
    def big(_args: _NoArgs, _ctx: ToolContext) -> Any:
        return "x" * BIG_CHARS

    async def run(args: _NoArgs, ctx: ToolContext) -> Any:
        return big(args, ctx)

    return ToolRegistry(
        (
            *builtin_tools().values(),
            builtin_tool(
                name="test.big",
                summary="a big answer",
                args_type=_NoArgs,
                run=run,
                side_effects=False,
                immediate=big,
            ),
        )
    )


def spy_on_parked_answers(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The ids of the answers the multiplexer sent (``Connection.answer_parked``)."""
    sent: list[str | None] = []
    original = server.Connection.answer_parked

    def answer_parked(
        conn: server.Connection, responses: list[Response], taken: list[Answered]
    ) -> None:
        sent.extend(r.toolCallId for r in responses)
        original(conn, responses, taken)

    monkeypatch.setattr(server.Connection, "answer_parked", answer_parked)
    return sent


def spy_on_release(monkeypatch: pytest.MonkeyPatch) -> list[list[Answered]]:
    """Every batch ``Dispatcher.release`` was given."""
    batches: list[list[Answered]] = []
    original = Dispatcher.release

    async def release(self: Dispatcher, answered: list[Answered]) -> list[Response]:
        batches.append(list(answered))
        return await original(self, answered)

    monkeypatch.setattr(Dispatcher, "release", release)
    return batches


async def test_calls_of_many_connections_are_answered_together_and_each_once(
    short_tmp: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = spy_on_release(monkeypatch)
    by_multiplexer = spy_on_parked_answers(monkeypatch)
    conns, calls = 40, 25
    async with make_gateway(short_tmp, gate_tools(trio.Event())) as gw:
        run = await gw.create_run(workspace, POLICY)
        watch = Watch(gw.daemon.audit, monkeypatch)  # the answers' entries at each send
        answers: list[dict[str, Any]] = []

        async def client(i: int) -> None:
            stream = await trio.open_unix_socket(str(run.socket_path))
            async with stream:
                buf = bytearray()
                for j in range(calls):
                    await stream.send_all(frame(request(run, "time.now", tcid=f"c{i}-{j}")))
                    msg = await read_frame(stream, buf)
                    assert msg is not None and msg["toolCallId"] == f"c{i}-{j}"
                    answers.append(msg)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(conns):
                    nursery.start_soon(client, i)
        log = gw.daemon.audit.path
    assert len(answers) == conns * calls and all(a["ok"] for a in answers)
    assert len({a["toolCallId"] for a in answers}) == conns * calls
    # One release (one flush wait) served the calls of several connections at once.
    assert len(batches) < conns * calls
    assert max(len({a.call_id.split("-")[0] for a in b if a.call_id}) for b in batches) > 1
    entries = [e for e in read_entries(log) if e.get("tool") == "time.now"]
    kinds = Counter(e["kind"] for e in entries if e["runId"] == run.run_id)
    assert kinds == {"call": conns * calls, "result": conns * calls}
    # Most answers left through the multiplexer, each only once its result entry was
    # durable and in the file (RESULT_BEFORE_REPLY).
    assert len(by_multiplexer) > conns * calls // 2
    assert len(watch.at_send) == conns * calls
    for tcid, (seq, durable, on_disk) in watch.at_send.items():
        assert seq is not None and durable >= seq and on_disk, tcid


def epolls() -> int:
    """The epoll instances this process holds open (trio's own among them)."""
    fds = os.listdir("/proc/self/fd")
    links = []
    for fd in fds:
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # closed since the listing (the listing's own descriptor)
    return sum(link == "anon_inode:[eventpoll]" for link in links)


async def test_the_multiplexer_holds_a_descriptor_only_while_connections_share_it(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp, gate_tools(trio.Event())) as gw:
        run = await gw.create_run(workspace, POLICY)
        before = epolls()
        for round_ in range(2):  # made again after it was closed
            one = await trio.open_unix_socket(str(run.socket_path))
            two = await trio.open_unix_socket(str(run.socket_path))
            async with one, two:
                for i, stream in enumerate((one, two)):
                    await stream.send_all(frame(request(run, "time.now", tcid=f"r{round_}-{i}")))
                    with trio.fail_after(10):
                        msg = await read_frame(stream, bytearray())
                    assert msg is not None and msg["ok"]
                await trio.sleep(0.05)  # both parked again
                assert epolls() == before + 1
            with trio.fail_after(10):
                while epolls() != before:  # both gone: closed
                    await trio.sleep(0.01)


async def test_what_the_multiplexer_does_not_take_goes_back_to_the_connection_in_order(
    short_tmp: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handled = spy_on_handle(monkeypatch)
    by_multiplexer = spy_on_parked_answers(monkeypatch)
    async with make_gateway(short_tmp, gate_tools(trio.Event())) as gw:
        run = await gw.create_run(workspace, POLICY)
        idle = await trio.open_unix_socket(str(run.socket_path))
        stream = await trio.open_unix_socket(str(run.socket_path))
        async with idle, stream:
            buf = bytearray()

            async def call(payload: bytes) -> dict[str, Any]:
                await stream.send_all(payload)
                with trio.fail_after(10):
                    msg = await read_frame(stream, buf)
                assert msg is not None
                return msg

            # Each is sent once the answer before it is read: the connection is parked
            # in the multiplexer each time.
            first = await call(frame(request(run, "time.now", tcid="t1")))
            bad = await call(frame(b'{"v": 1, "toolCallId": "b1", "tool": '))
            opened = await call(frame(request(run, "test.open", tcid="o1")))
            # Taken answers, then a call that needs its task, in one read: the taken
            # answer leaves first, then the task's.
            await stream.send_all(
                frame(request(run, "time.now", tcid="t2"))
                + frame(request(run, "test.wait", tcid="w1"))
            )
            with trio.fail_after(10):
                pair = [await read_frame(stream, buf), await read_frame(stream, buf)]
            last = await call(frame(request(run, "time.now", tcid="t3")))
            # (t3 was read by the task, which reads once itself after a hand-back; t4
            # finds the connection parked again.)
            again = await call(frame(request(run, "time.now", tcid="t4")))
    assert first["ok"] and first["toolCallId"] == "t1"
    assert not bad["ok"] and bad["errorCode"] == "bad_request"
    assert opened["ok"] and opened["toolCallId"] == "o1"
    assert [m and m["toolCallId"] for m in pair] == ["t2", "w1"]
    assert all(m and m["ok"] for m in pair)
    assert last["ok"] and last["toolCallId"] == "t3"
    assert again["ok"] and again["toolCallId"] == "t4"
    assert handled == ["test.open", "test.wait"]  # only these took a task
    # The calls answered at once that came alone were sent by the multiplexer.
    assert {"t1", "t4"} <= set(by_multiplexer)


async def test_a_half_closed_parked_client_gets_its_answers_before_the_close(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp, gate_tools(trio.Event())) as gw:
        run = await gw.create_run(workspace, POLICY)
        idle = await trio.open_unix_socket(str(run.socket_path))
        for attempt in range(20):  # the EOF is read in the same round as the call, or later
            stream = await trio.open_unix_socket(str(run.socket_path))
            async with stream:
                await trio.sleep(0.01)  # parked before the call arrives
                await stream.send_all(frame(request(run, "time.now", tcid=f"h{attempt}")))
                await stream.send_eof()
                buf = bytearray()
                with trio.fail_after(10):
                    msg = await read_frame(stream, buf)
                    assert await read_frame(stream, buf) is None  # then the close
            assert msg is not None and msg["ok"] and msg["toolCallId"] == f"h{attempt}"
        await idle.aclose()


async def read_answers(
    stream: trio.SocketStream, buf: bytearray, count: int
) -> list[dict[str, Any]]:
    """The next ``count`` answers, in the order they came."""
    answers: list[dict[str, Any]] = []
    with trio.fail_after(10):
        while len(answers) < count:
            msg = await read_frame(stream, buf)
            assert msg is not None, "the connection closed first"
            answers.append(msg)
    return answers


async def test_an_answer_over_the_socket_buffer_is_finished_whole_before_the_next_one(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp, big_tools()) as gw:
        run = await gw.create_run(workspace, POLICY)
        other = await trio.open_unix_socket(str(run.socket_path))
        stream = await trio.open_unix_socket(str(run.socket_path))
        async with other, stream:
            await trio.sleep(0.05)  # both parked
            # The big answer goes out in parts, from a task of the connection's; the
            # small ones after it must not land in its middle.
            await stream.send_all(
                frame(request(run, "test.big", tcid="big"))
                + b"".join(frame(request(run, "time.now", tcid=f"t{i}")) for i in range(5))
            )
            await trio.sleep(0.2)  # the small answers queue behind the big one
            buf = bytearray()
            got = {m["toolCallId"]: m for m in await read_answers(stream, buf, 6)}
            # The connection goes on being served afterwards.
            await stream.send_all(frame(request(run, "time.now", tcid="after")))
            with trio.fail_after(10):
                after = await read_frame(stream, buf)
    assert got["big"]["value"] == "x" * BIG_CHARS
    assert all(got[f"t{i}"]["ok"] for i in range(5))
    assert after is not None and after["ok"] and after["toolCallId"] == "after"


async def test_answers_of_a_later_pass_wait_for_a_big_answer_still_being_sent(
    short_tmp: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two passes of one connection, two senders: the big answer's rest is still in the
    # outbox when the small answers of the next pass are released; they go after it,
    # whole, in order.
    original = Dispatcher.release
    released: list[list[str | None]] = []

    async def slow_big(self: Dispatcher, answered: list[Answered]) -> list[Response]:
        released.append([a.call_id for a in answered])
        if any(a.call_id == "big" for a in answered):
            await trio.sleep(0.3)  # a slow flush: the next pass is taken meanwhile
        return await original(self, answered)

    monkeypatch.setattr(Dispatcher, "release", slow_big)
    async with make_gateway(short_tmp, big_tools()) as gw:
        run = await gw.create_run(workspace, POLICY)
        idle = await trio.open_unix_socket(str(run.socket_path))
        stream = await trio.open_unix_socket(str(run.socket_path))
        async with idle, stream:
            await trio.sleep(0.05)  # both parked
            await stream.send_all(frame(request(run, "test.big", tcid="big")))
            await trio.sleep(0.1)  # taken alone; its release waits
            await stream.send_all(
                b"".join(frame(request(run, "time.now", tcid=f"t{i}")) for i in range(5))
            )
            await trio.sleep(0.5)  # both released; the big answer not read yet
            answers = await read_answers(stream, bytearray(), 6)
    order = [m["toolCallId"] for m in answers]
    got = {m["toolCallId"]: m for m in answers}
    assert ["big"] in released and any("t0" in batch for batch in released if "big" not in batch)
    assert order == ["big", "t0", "t1", "t2", "t3", "t4"]
    assert got["big"]["value"] == "x" * BIG_CHARS
    assert all(got[f"t{i}"]["ok"] for i in range(5))


async def test_a_parked_client_that_stops_reading_is_dropped_and_holds_up_nobody(
    short_tmp: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    send_timeout_s = 6.0  # roomy: each of the other connection's calls gets a quarter of it
    monkeypatch.setattr(server, "SEND_TIMEOUT_S", send_timeout_s)
    stuck: list[float] = []  # when the multiplexer first left an answer to the outbox
    to_outbox = server.Connection._to_outbox

    def watched(conn: server.Connection, rest: bytes, taken: list[Answered]) -> bool:
        if not stuck:
            stuck.append(trio.current_time())
        return to_outbox(conn, rest, taken)

    monkeypatch.setattr(server.Connection, "_to_outbox", watched)
    async with make_gateway(short_tmp, gate_tools(trio.Event())) as gw:
        run = await gw.create_run(workspace, POLICY)
        # Opened first, so the hog waits in the multiplexer from its first call.
        other = await trio.open_unix_socket(str(run.socket_path))
        hog = await trio.open_unix_socket(str(run.socket_path))
        sent = 0
        async with hog, other:
            # Rounds of calls under the per-connection cap, never reading: each round
            # is taken by the multiplexer until the answers no longer fit the socket.
            # Then the hog's socket fills too (the daemon reads no more of it).
            with trio.move_on_after(1):
                while True:
                    burst = b"".join(
                        frame(request(run, "tools.list", tcid=f"h{sent + i}")) for i in range(16)
                    )
                    await hog.send_all(burst)
                    sent += 16
                    await trio.sleep(0.005)
            assert stuck, "the hog's answers never filled its socket"
            # While the hog's answer waits for it to read, the other connection is
            # served: each call well within the send timeout the hog is held to.
            buf = bytearray()
            for i in range(20):
                await other.send_all(frame(request(run, "time.now", tcid=f"o{i}")))
                with trio.fail_after(send_timeout_s / 4):
                    msg = await read_frame(other, buf)
                assert msg is not None and msg["ok"]
            assert trio.current_time() - stuck[0] < send_timeout_s  # the hog is not dropped yet
            # Then the hog, still not reading, is dropped at the send timeout: what it
            # reads after is whole frames, each answered once, then EOF (or a reset: its
            # unread calls were queued).
            await trio.sleep_until(stuck[0] + send_timeout_s + 2 * server.IDLE_SWEEP_S)
            got: list[str] = []
            buf = bytearray()
            with trio.fail_after(10):
                try:
                    while (msg := await read_frame(hog, buf)) is not None:
                        got.append(msg["toolCallId"])
                except trio.BrokenResourceError:
                    pass
        log = gw.daemon.audit.path
    assert len(got) == len(set(got)) < sent
    # Backpressure: once its answers stopped leaving, the daemon stopped taking its
    # calls: every call it took has its result entry, and it took far fewer than sent.
    entries = [e for e in read_entries(log) if e.get("tool") == "tools.list"]
    taken = {e["toolCallId"] for e in entries if e["kind"] == "call"}
    assert taken == {e["toolCallId"] for e in entries if e["kind"] == "result"}
    # (Here about 100 of the 300 or so sent: what the socket buffers hold.)
    assert set(got) <= taken and 2 * len(taken) < sent


async def test_no_connection_parks_where_no_call_is_answered_at_once(
    short_tmp: Path, workspace: Path
) -> None:
    # With the operator's opt-out (answers not waiting for their result entries)
    # every call takes its task: parking would only add a pass; none is made.
    async with make_gateway(short_tmp, audit_reply_after_result=False) as gw:
        run = await gw.create_run(workspace, POLICY.replace("test.wait, test.open, ", ""))
        before = epolls()
        one = await trio.open_unix_socket(str(run.socket_path))
        two = await trio.open_unix_socket(str(run.socket_path))
        async with one, two:
            for round_ in range(3):
                for i, stream in enumerate((one, two)):
                    await stream.send_all(frame(request(run, "time.now", tcid=f"r{round_}-{i}")))
                    with trio.fail_after(10):
                        msg = await read_frame(stream, bytearray())
                    assert msg is not None and msg["ok"]
            assert epolls() == before
