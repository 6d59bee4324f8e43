"""What the audit log says when an exec stops at its gate (the flush of its exec_started
entry): each exec_started has its exec_ended, and the command never ran; two execs of one
run each wait for their own entry."""

from __future__ import annotations

import pytest
import trio

from gatewayd.audit import AuditWriteError
from tests.integration.test_run_sandbox import (  # noqa: F401 (fixtures)
    MARK,
    Sandboxed,
    base,
    pids_of_uid,
    sb,
)


def _exec_events(entries: list[dict[str, object]], run_id: str) -> list[dict[str, object]]:
    return [
        e
        for e in entries
        if e.get("runId") == run_id and e.get("event") in ("exec_started", "exec_ended")
    ]


async def test_an_exec_cancelled_at_its_gate_is_on_the_record_as_stopped(
    sb: Sandboxed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ws = sb.workspace()
    run = await sb.run(workspace=ws)
    assert run.sandbox is not None
    real = sb.daemon.audit.durable
    blocked = trio.Event()

    async def never(seq: int) -> None:
        blocked.set()
        await trio.sleep_forever()

    monkeypatch.setattr(sb.daemon.audit, "durable", never)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sb.py, run, MARK)
        await blocked.wait()
        await trio.sleep(0.5)
        nursery.cancel_scope.cancel()
    monkeypatch.setattr(sb.daemon.audit, "durable", real)
    events = _exec_events(await sb.entries(), run.run_id)
    assert [e["event"] for e in events] == ["exec_started", "exec_ended"]
    assert "stopped" in events[1]["detail"]  # type: ignore[operator]
    assert not (ws / "ran").exists()
    assert pids_of_uid(run.sandbox.user.uid) == []


async def test_an_exec_whose_entry_cannot_be_flushed_ends_as_internal(
    sb: Sandboxed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ws = sb.workspace()
    run = await sb.run(workspace=ws)
    real = sb.daemon.audit.durable
    calls: list[int] = []

    async def failing_once(seq: int) -> None:
        calls.append(seq)
        if len(calls) == 1:
            await trio.sleep(0.3)
            raise AuditWriteError("the disk went away")
        await real(seq)

    monkeypatch.setattr(sb.daemon.audit, "durable", failing_once)
    with pytest.raises(AuditWriteError):
        await sb.py(run, MARK)
    monkeypatch.setattr(sb.daemon.audit, "durable", real)
    events = _exec_events(await sb.entries(), run.run_id)
    assert [e["event"] for e in events] == ["exec_started", "exec_ended"]
    assert events[1]["errorCode"] == "internal"
    assert not (ws / "ran").exists()


async def test_two_execs_of_one_run_each_wait_for_their_own_entry(
    sb: Sandboxed,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ws = sb.workspace()
    run = await sb.run(workspace=ws)
    real = sb.daemon.audit.durable
    first: list[int] = []
    let_first_go = trio.Event()

    async def held_first(seq: int) -> None:
        if not first:
            first.append(seq)
        if seq == first[0]:
            await let_first_go.wait()
        await real(seq)

    monkeypatch.setattr(sb.daemon.audit, "durable", held_first)
    done: dict[str, int] = {}

    async def mark(name: str) -> None:
        result = await sb.py(run, f"open('/workspace/{name}', 'w').write('ran')")
        done[name] = result.exitCode

    async with trio.open_nursery() as nursery:
        nursery.start_soon(mark, "a")
        await trio.sleep(0.3)
        nursery.start_soon(mark, "b")
        with trio.fail_after(20):
            while "b" not in done:
                await trio.sleep(0.05)
        assert done["b"] == 0 and (ws / "b").exists()
        await trio.sleep(0.5)
        assert not (ws / "a").exists()  # its own entry is still being flushed
        let_first_go.set()
    monkeypatch.setattr(sb.daemon.audit, "durable", real)
    assert done == {"a": 0, "b": 0} and (ws / "a").exists()
