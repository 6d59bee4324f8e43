"""Calls answered on the connection's own task (no I/O on the way: ``time.now``,
``tools.list``, refusals) beside calls that get a task of their own, on one real socket
of an in-process daemon: neither kind holds the other up, each call is answered once
with its id, and the calls of one read share their audit flush."""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from gatewayd import server
from gatewayd.audit import read_entries
from gatewayd.dispatch import Dispatcher
from gatewayd.protocol import Request, Response
from gatewayd.tools import builtin_tools
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.registry import ToolContext, ToolRegistry
from tests.conftest import frame, make_gateway, raw_exchange, read_frame, request

POLICY = """
version: 1
name: server-now-tests
tools: {allow: [time.now, test.wait, test.open]}
limits: {call_timeout_s: 10, calls_per_second: 10000, burst: 10000, max_concurrent_calls: 4}
"""


class _NoArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


def gate_tools(gate: trio.Event) -> ToolRegistry:
    """``test.wait`` returns once ``test.open`` has run: on one connection it can finish
    only if the two run at the same time."""

    async def wait(_args: _NoArgs, _ctx: ToolContext) -> Any:
        await gate.wait()
        return {"waited": True}

    async def open_gate(_args: _NoArgs, _ctx: ToolContext) -> Any:
        gate.set()
        return {"opened": True}

    return ToolRegistry(
        (
            *builtin_tools().values(),
            builtin_tool(name="test.wait", summary="waits", args_type=_NoArgs, run=wait),
            builtin_tool(name="test.open", summary="opens", args_type=_NoArgs, run=open_gate),
        )
    )


def spy_on_handle(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The tools of the calls that went through ``Dispatcher.handle`` (a task each)."""
    handled: list[str] = []
    original: Callable[..., Awaitable[Response]] = Dispatcher.handle

    async def handle(self: Dispatcher, run: Any, req: Request, *a: Any, **k: Any) -> Response:
        handled.append(req.tool)
        return await original(self, run, req, *a, **k)

    monkeypatch.setattr(Dispatcher, "handle", handle)
    return handled


async def test_calls_without_io_are_answered_in_place_and_calls_with_io_still_run_together(
    short_tmp: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handled = spy_on_handle(monkeypatch)
    async with make_gateway(short_tmp, gate_tools(trio.Event())) as gw:
        run = await gw.create_run(workspace, POLICY)
        payload = b"".join(
            frame(request(run, tool, tcid=tcid))
            for tool, tcid in (
                ("test.wait", "w"),
                ("time.now", "t1"),
                ("tools.list", "l"),
                ("test.open", "o"),
                ("time.now", "t2"),
            )
        )
        answers = await raw_exchange(run.socket_path, payload, expect=5)
        ids = [a["toolCallId"] for a in answers]
        assert sorted(ids) == ["l", "o", "t1", "t2", "w"]
        assert all(a["ok"] for a in answers), answers
        # The waiting call did not hold up the calls behind it, and finished only
        # because test.open ran beside it on the same connection.
        assert ids.index("t1") < ids.index("w") and ids.index("l") < ids.index("w")
        assert sorted(handled) == ["test.open", "test.wait"]  # the rest: no task each
        entries = await gw.audit_entries()
        for tcid in ids:
            kinds = [e["kind"] for e in entries if e.get("toolCallId") == tcid]
            assert kinds == ["call", "result"], tcid


async def test_a_burst_answered_in_place_shares_flushes_and_answers_each_call_once(
    short_tmp: Path, workspace: Path
) -> None:
    calls = 64
    async with make_gateway(short_tmp, gate_tools(trio.Event())) as gw:
        run = await gw.create_run(workspace, POLICY)
        syncs = gw.daemon.audit.fsync_count
        payload = b"".join(frame(request(run, "time.now", tcid=f"n{i}")) for i in range(calls))
        answers = await raw_exchange(run.socket_path, payload, expect=calls)
        assert sorted(a["toolCallId"] for a in answers) == sorted(f"n{i}" for i in range(calls))
        assert all(a["ok"] for a in answers)
        # One flush per read of the socket, not one per call.
        assert gw.daemon.audit.fsync_count - syncs <= calls // 4


async def test_one_id_twice_in_one_read_is_refused_the_second_time(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp, gate_tools(trio.Event())) as gw:
        run = await gw.create_run(workspace, POLICY)
        payload = frame(request(run, "time.now", tcid="same")) * 2
        answers = await raw_exchange(run.socket_path, payload, expect=2)
        # In the order sent: the first call's answer, then the refusal of the second.
        assert [a["ok"] for a in answers] == [True, False]
        [refusal] = [a for a in answers if not a["ok"]]
        assert refusal["errorCode"] == "bad_request"
        assert "already in flight on this connection" in refusal["safeMessage"]


async def test_answers_in_place_go_out_before_a_fatal_frame_closes_the_connection(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp, gate_tools(trio.Event())) as gw:
        run = await gw.create_run(workspace, POLICY)
        oversize = struct.pack(">I", 0xFFFFFFFF)  # a length no frame may have
        payload = frame(request(run, "time.now", tcid="before")) + oversize
        answers = await raw_exchange(run.socket_path, payload, expect=3)
        assert [a["toolCallId"] for a in answers] == ["before", None]
        assert answers[0]["ok"]
        assert answers[1]["errorCode"] == "too_large"
        assert "bytes" in answers[1]["safeMessage"]  # says what the limit is


async def test_a_partial_frame_trickled_byte_by_byte_still_times_out(
    short_tmp: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The idle deadline is set only while a read waits: a client that keeps a byte
    # ready for most reads must still be cut off once its frame is overdue.
    monkeypatch.setattr(server, "FRAME_TIMEOUT_S", 0.5)
    async with make_gateway(short_tmp, gate_tools(trio.Event())) as gw:
        run = await gw.create_run(workspace, POLICY)
        stream = await trio.open_unix_socket(str(run.socket_path))
        partial = frame(request(run, "time.now"))[:-1]  # never the last byte
        started = trio.current_time()
        closed = False
        with trio.fail_after(5):
            for byte in partial:
                try:
                    await stream.send_all(bytes([byte]))
                except trio.BrokenResourceError:
                    closed = True
                    break
                await trio.sleep(0.05)
            if not closed:
                assert await stream.receive_some(100) == b""
        assert trio.current_time() - started < 3  # not the whole trickle
        await stream.aclose()


async def test_answers_whose_flush_outlasts_the_idle_timeout_are_still_sent(
    short_tmp: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Waiting for the answers' flush is not the client idling: no deadline applies
    # while they wait (sweeps come and go meanwhile), and the client's idle time starts
    # once they left: the connection still serves the next call.
    monkeypatch.setattr(server, "IDLE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(server, "IDLE_SWEEP_S", 0.02)
    async with make_gateway(short_tmp, gate_tools(trio.Event())) as gw:
        run = await gw.create_run(workspace, POLICY)
        audit = gw.daemon.audit
        write_batch = audit._write_batch
        slow = threading.Event()

        def slow_write(batch: bytes, head: Any) -> None:
            if slow.is_set():
                time.sleep(1.0)  # a disk slower than the idle timeout
            write_batch(batch, head)

        monkeypatch.setattr(audit, "_write_batch", slow_write)
        stream = await trio.open_unix_socket(str(run.socket_path))
        async with stream:
            await trio.sleep(0.05)  # the server's read waits, under the idle deadline
            slow.set()
            await stream.send_all(
                b"".join(frame(request(run, "time.now", tcid=f"s{i}")) for i in range(3))
            )
            buf = bytearray()
            with trio.fail_after(5):
                answers = [await read_frame(stream, buf) for _ in range(3)]
            slow.clear()
            await trio.sleep(0.1)  # within the idle timeout, counted from the answers
            await stream.send_all(frame(request(run, "time.now", tcid="after")))
            with trio.fail_after(5):
                after = await read_frame(stream, buf)
        assert sorted(a["toolCallId"] for a in answers if a) == ["s0", "s1", "s2"]
        assert all(a and a["ok"] for a in answers)
        assert after is not None and after["ok"] and after["toolCallId"] == "after"


async def test_pipelined_answers_in_place_leave_in_order_across_flushes(
    short_tmp: Path, workspace: Path
) -> None:
    calls = 300
    async with make_gateway(short_tmp, gate_tools(trio.Event())) as gw:
        run = await gw.create_run(workspace, POLICY)
        stream = await trio.open_unix_socket(str(run.socket_path))
        async with stream:
            buf = bytearray()
            ids: list[str] = []
            with trio.fail_after(20):
                for part in range(3):  # three writes: several reads, several flushes
                    await stream.send_all(
                        b"".join(
                            frame(request(run, "time.now", tcid=f"p{part * 100 + i}"))
                            for i in range(100)
                        )
                    )
                    await trio.sleep(0.01)
                while len(ids) < calls:
                    msg = await read_frame(stream, buf)
                    assert msg is not None and msg["ok"]
                    ids.append(msg["toolCallId"])
        assert ids == [f"p{i}" for i in range(calls)]


async def test_a_client_that_half_closes_still_gets_every_answer_in_place(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp, gate_tools(trio.Event())) as gw:
        run = await gw.create_run(workspace, POLICY)
        stream = await trio.open_unix_socket(str(run.socket_path))
        async with stream:
            await stream.send_all(
                b"".join(frame(request(run, "time.now", tcid=f"h{i}")) for i in range(40))
            )
            await stream.send_eof()  # EOF while the answers wait for their flush
            buf = bytearray()
            answers: list[dict[str, Any]] = []
            with trio.fail_after(10):
                while (msg := await read_frame(stream, buf)) is not None:
                    answers.append(msg)
        assert [a["toolCallId"] for a in answers] == [f"h{i}" for i in range(40)]
        assert all(a["ok"] for a in answers)


async def test_a_client_gone_before_its_answers_leave_has_each_call_audited_and_counted_once(
    short_tmp: Path, workspace: Path
) -> None:
    calls = 50
    async with make_gateway(short_tmp, gate_tools(trio.Event())) as gw:
        run = await gw.create_run(workspace, POLICY)
        before = run.calls
        first_seq = gw.daemon.audit.last_seq
        for _ in range(3):
            stream = await trio.open_unix_socket(str(run.socket_path))
            await stream.send_all(
                b"".join(frame(request(run, "time.now", tcid=f"g{i}")) for i in range(calls))
            )
            stream.socket.close()  # gone while its answers wait (or before they are read)
        with trio.fail_after(10):
            while run.calls - before < 3 * calls:
                await trio.sleep(0.01)
        # The connections the server closed meanwhile are served as usual.
        [resp] = await raw_exchange(run.socket_path, frame(request(run, "time.now")))
        assert resp["ok"]
        await trio.sleep(0.1)
        assert run.calls - before == 3 * calls + 1  # each call tallied once
        await gw.daemon.audit.durable(gw.daemon.audit.last_seq)
        entries = [e for e in read_entries(gw.daemon.audit.path) if e["seq"] > first_seq]
        results = [e for e in entries if e["kind"] == "result" and e.get("tool") == "time.now"]
        assert len(results) == 3 * calls + 1


async def test_a_connection_answered_waits_for_its_socket_instead_of_reading_it_empty(
    short_tmp: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A client that waits for each answer has sent nothing since its request: a read
    # before the socket is readable again would find nothing (a system call, and a
    # hand-off of the interpreter to the audit flusher, for naught).
    empty_reads = 0
    real_read = server.os.read

    def read(fd: int, size: int) -> bytes:
        nonlocal empty_reads
        try:
            return real_read(fd, size)
        except BlockingIOError:
            empty_reads += 1
            raise

    async with make_gateway(short_tmp, gate_tools(trio.Event())) as gw:
        run = await gw.create_run(workspace, POLICY)
        stream = await trio.open_unix_socket(str(run.socket_path))
        async with stream:
            buf = bytearray()
            await stream.send_all(frame(request(run, "time.now", tcid="w0")))
            assert (await read_frame(stream, buf) or {}).get("ok")
            monkeypatch.setattr(server.os, "read", read)
            for i in range(1, 6):
                await stream.send_all(frame(request(run, "time.now", tcid=f"w{i}")))
                msg = await read_frame(stream, buf)
                assert msg is not None and msg["ok"] and msg["toolCallId"] == f"w{i}"
            monkeypatch.undo()
    assert empty_reads == 0
