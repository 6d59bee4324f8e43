"""Attacks on the wasm runner by a hostile module or a hostile workspace: wasm features
that reach past the store's limits (shared memory waits, extra memories, huge tables, GC
heaps), special files in a preopened directory, and host resources a call leaves behind.
Each test is one attack class; modules are WAT, compiled in milliseconds."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gatewayd.errors import LimitExceeded, ToolFailed, ToolTimedOut
from gatewayd.policy.paths import PathMode
from gatewayd.protocol import ErrorCode
from gatewayd.runners.spec import FileNeed
from gatewayd.runners.wasm import MAX_POLL_SUBSCRIPTIONS, MAX_TABLE_ELEMENTS, WasmEngine
from gatewayd.tools.manifest import ToolLimits
from tests import wasmmodules as wm
from tests.unit.test_wasm_runner import call, context, failure, folder_tool, grant

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WasmEngine]:
    with WasmEngine(tmp_path_factory.mktemp("cache") / "wasm-cache") as shared:
        yield shared


# --- wasm features that escape the store's limits -------------------------------------


async def test_shared_memory_and_its_blocking_wait_are_refused_by_the_check(
    engine: WasmEngine, tmp_path: Path
) -> None:
    # memory.atomic.wait32 parks the worker thread in the host, where no epoch tick and
    # no fuel reach it (here for 1000 s). wasmtime cannot instantiate a shared memory
    # with its shared_memory setting off; `tools check` says so up front.
    module = wm.wasm(
        """(module (memory 1 1 shared)
             (func (export "_start")
               (drop (memory.atomic.wait32 (i32.const 0) (i32.const 0)
                                           (i64.const 1000000000000)))))"""
    )
    tool = folder_tool(tmp_path / "t", module)
    with pytest.raises(ToolFailed, match=r"not a valid WebAssembly module.*shared memories"):
        engine.load(tool)
    start = time.monotonic()
    exc = await failure(engine, tool)
    assert isinstance(exc, ToolFailed) and time.monotonic() - start < 1.0


async def test_extra_memories_do_not_multiply_the_memory_limit(
    engine: WasmEngine, tmp_path: Path
) -> None:
    # Four memories of 12 MiB each under a 16 MiB limit (the limit holds per memory):
    # 48 MiB of gatewayd's memory if the module could touch them all.
    memories = " ".join(f"(memory {12 * 16})" for _ in range(4))
    module = wm.wasm(f'(module {memories} (func (export "_start")))')
    tool = folder_tool(tmp_path / "t", module, limits=ToolLimits(memory_bytes=16 * MIB))
    exc = await failure(engine, tool)
    assert isinstance(exc, LimitExceeded) and exc.code is ErrorCode.LIMIT_EXCEEDED
    assert "cannot start" in str(exc) and "memory count too high" in str(exc)
    assert "1 linear memory" in str(exc)


@pytest.mark.parametrize(
    ("tables", "reason"),
    [
        # 100 million elements: 800 MiB of gatewayd's memory, outside the memory limit.
        ("(table 100000000 funcref)", "exceeds table limits"),
        # Many tables each within the element limit.
        (" ".join("(table 1000 funcref)" for _ in range(50)), "table count too high"),
    ],
)
async def test_huge_or_many_tables_are_refused_not_allocated_on_the_host(
    engine: WasmEngine, tmp_path: Path, tables: str, reason: str
) -> None:
    module = wm.wasm(f'(module {tables} (func (export "_start")))')
    exc = await failure(engine, folder_tool(tmp_path / "t", module))
    assert isinstance(exc, LimitExceeded) and exc.code is ErrorCode.LIMIT_EXCEEDED
    assert reason in str(exc) and f"{MAX_TABLE_ELEMENTS} elements" in str(exc)


async def test_a_table_cannot_grow_past_the_element_limit(
    engine: WasmEngine, tmp_path: Path
) -> None:
    # table.grow answers -1 past the limit; the module writes what it got.
    module = wm.wasm(
        """(module
             (import "wasi_snapshot_preview1" "fd_write"
               (func $fd_write (param i32 i32 i32 i32) (result i32)))
             (table 1 funcref) (memory (export "memory") 1)
             (data (i32.const 100) "{\\"grew\\":0}")
             (func (export "_start")
               (if (i32.ne (table.grow (ref.null func) (i32.const 50000000)) (i32.const -1))
                 (then (i32.store8 (i32.const 108) (i32.const 49))))
               (i32.store (i32.const 0) (i32.const 100))
               (i32.store (i32.const 4) (i32.const 10))
               (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))"""
    )
    assert await call(engine, folder_tool(tmp_path / "t", module)) == {"grew": 0}


def test_gc_objects_are_refused_by_the_check(engine: WasmEngine, tmp_path: Path) -> None:
    # GC objects live in a heap of their own beside the linear memory, bounded by the
    # memory limit again: twice the limit in all.
    module = wm.wasm(
        """(module (type $a (array (mut i64)))
             (func (export "_start")
               (drop (array.new_default $a (i32.const 1000000)))))"""
    )
    with pytest.raises(ToolFailed, match=r"not a valid WebAssembly module.*gc feature"):
        engine.load(folder_tool(tmp_path / "t", module))


# --- host calls that outlast the deadline ---------------------------------------------

WASI_CLOCK_REALTIME = 0
WASI_EINVAL = 28
WASI_CLOCK_MONOTONIC = 1
SUBSCRIPTION_CLOCK_ABSTIME = 1


def _sleeper(
    clock: int,
    timeout_ns: int,
    *,
    abstime: bool = False,
    stdin: bool = False,
    count: int | None = None,
) -> str:
    """``poll_oneoff`` of one clock subscription (a ``sleep``), and with ``stdin`` a
    second one, fd_read of fd 0, first. Writes ``{"errno":"NN","events":"E","type":"T"}``:
    what the call answered, how many events, the first event's type. ``count``: the
    number of subscriptions passed (past the first two: whatever the memory holds)."""
    flags = SUBSCRIPTION_CLOCK_ABSTIME if abstime else 0
    out = '{"errno":"00","events":"0","type":"0"}'.replace('"', '\\"')
    clock_at = 48 if stdin else 0
    fd_read = (
        """(i32.store8 (i32.const 8) (i32.const 1)) (i32.store (i32.const 16) (i32.const 0))"""
        if stdin
        else ""
    )
    return f"""(module
      (import "wasi_snapshot_preview1" "poll_oneoff"
        (func $poll (param i32 i32 i32 i32) (result i32)))
      (import "wasi_snapshot_preview1" "fd_write"
        (func $fd_write (param i32 i32 i32 i32) (result i32)))
      (memory (export "memory") 4) (data (i32.const 800) "{out}")
      (func $digit (param $at i32) (param $value i32)
        (i32.store8 (local.get $at) (i32.add (i32.const 48) (local.get $value))))
      (func (export "_start") (local $err i32)
        {fd_read}
        (i32.store8 (i32.const {clock_at + 8}) (i32.const 0))
        (i32.store (i32.const {clock_at + 16}) (i32.const {clock}))
        (i64.store (i32.const {clock_at + 24}) (i64.const {timeout_ns}))
        (i32.store16 (i32.const {clock_at + 40}) (i32.const {flags}))
        (local.set $err (call $poll (i32.const 0) (i32.const 1024)
                                    (i32.const {count or (2 if stdin else 1)})
                                    (i32.const 2048)))
        (call $digit (i32.const 810) (i32.div_u (local.get $err) (i32.const 10)))
        (call $digit (i32.const 811) (i32.rem_u (local.get $err) (i32.const 10)))
        (call $digit (i32.const 824) (i32.load (i32.const 2048)))
        (call $digit (i32.const 835) (i32.load8_u (i32.const 1034)))
        (i32.store (i32.const 300) (i32.const 800)) (i32.store (i32.const 304) (i32.const 38))
        (drop (call $fd_write (i32.const 1) (i32.const 300) (i32.const 1) (i32.const 308)))))"""


@pytest.mark.parametrize(
    ("clock", "timeout_ns", "abstime"),
    [
        (WASI_CLOCK_MONOTONIC, 1000 * 10**9, False),  # sleep(1000)
        (WASI_CLOCK_REALTIME, 2**63 - 1, True),  # until the end of time
        (WASI_CLOCK_MONOTONIC, 2**63 - 1, True),
    ],
)
async def test_a_sleep_past_the_deadline_is_timeout_at_the_deadline(
    engine: WasmEngine, tmp_path: Path, clock: int, timeout_ns: int, abstime: bool
) -> None:
    # WASI's poll_oneoff sleeps in the host, where no epoch tick reaches: a module could
    # park its worker thread (and its call, its slot, gatewayd's shutdown) for ever.
    tool = folder_tool(tmp_path / "t", wm.wasm(_sleeper(clock, timeout_ns, abstime=abstime)))
    start = time.monotonic()
    exc = await failure(engine, tool, context(timeout_s=0.2))
    assert time.monotonic() - start < 1.0
    assert isinstance(exc, ToolTimedOut) and exc.code is ErrorCode.TIMEOUT
    assert "time limit of 0.2 s" in str(exc)


async def test_a_sleep_within_the_deadline_still_sleeps(engine: WasmEngine, tmp_path: Path) -> None:
    tool = folder_tool(tmp_path / "t", wm.wasm(_sleeper(WASI_CLOCK_MONOTONIC, 50 * 10**6)))
    start = time.monotonic()
    result = await call(engine, tool, context(timeout_s=5.0))
    assert result == {"errno": "00", "events": "1", "type": "0"}  # the clock's event
    assert time.monotonic() - start >= 0.05


async def test_a_poll_on_a_ready_descriptor_answers_at_once(
    engine: WasmEngine, tmp_path: Path
) -> None:
    # stdin is a file, always ready: its event comes at once, not the 1000 s clock's.
    module = _sleeper(WASI_CLOCK_MONOTONIC, 1000 * 10**9, stdin=True)
    start = time.monotonic()
    result = await call(engine, folder_tool(tmp_path / "t", wm.wasm(module)), context())
    assert result == {"errno": "00", "events": "1", "type": "1"}  # fd_read's event
    assert time.monotonic() - start < 1.0


async def test_a_poll_of_too_many_subscriptions_is_einval(
    engine: WasmEngine, tmp_path: Path
) -> None:
    # One past the bound (all within the module's memory): gatewayd reads none of them.
    module = _sleeper(WASI_CLOCK_MONOTONIC, 0, count=MAX_POLL_SUBSCRIPTIONS + 1)
    result = await call(engine, folder_tool(tmp_path / "t", wm.wasm(module)), context())
    assert result["errno"] == f"{WASI_EINVAL}"


# --- special files in a preopened directory -----------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="known limit: wasmtime opens a FIFO with a blocking open(2) on its own tokio "
    "thread, where neither the epoch deadline nor a cancellation reaches it; no sandbox "
    "can make a FIFO (seccomp, test_run_sandbox.py::test_the_sandbox_cannot_make_a_fifo_"
    "anywhere), so only one made on the host side reaches a wasm tool",
)
async def test_a_fifo_in_the_workspace_does_not_hang_the_call(
    engine: WasmEngine, tmp_path: Path
) -> None:
    # A FIFO where a tool opens files (a search over src/, say), made on the host side:
    # the sandbox cannot make one. open(2)
    # of a FIFO with no writer blocks until one comes: forever, holding the engine's
    # call slot and the dispatching task (the thread is not abandoned), and gatewayd's
    # shutdown, which waits for it.
    workspace = tmp_path / "workspace"
    (workspace / "src").mkdir(parents=True)
    fifo = workspace / "src" / "pipe.json"
    os.mkfifo(fifo)
    need = FileNeed(path="/workspace/src", mode=PathMode.RO)
    tool = folder_tool(tmp_path / "probe", wm.wasm(wm.file_probe("pipe.json")), files=(need,))
    ctx = context(grants=(grant(workspace),), files=(need,), timeout_s=0.2)
    done = threading.Event()

    def writer_after_a_while() -> None:
        # So that the test ends while the runner hangs: a writer comes after 0.6 s, well
        # past the call's 0.2 s timeout.
        if not done.wait(0.6):
            os.close(os.open(fifo, os.O_WRONLY))

    helper = threading.Thread(target=writer_after_a_while, daemon=True)
    helper.start()
    start = time.monotonic()
    try:
        with pytest.raises((ToolTimedOut, ToolFailed)):
            await call(engine, tool, ctx)
    finally:
        done.set()
        helper.join()
    assert time.monotonic() - start < 0.5, "the call hung on the FIFO until a writer came"


# --- what a call leaves behind --------------------------------------------------------


@pytest.mark.parametrize("outcome", ["result", "trap", "timeout"])
async def test_calls_do_not_leak_descriptors(
    engine: WasmEngine, tmp_path: Path, outcome: str
) -> None:
    # Each call opens its preopened directories and its stdin; whatever its end, they
    # are closed with its store (a leak would let a flood of calls exhaust gatewayd's
    # descriptors, or hand an old directory to a later call).
    workspace = tmp_path / "workspace"
    (workspace / "src").mkdir(parents=True)
    (workspace / "src" / "f.json").write_text("1")
    need = FileNeed(path="/workspace/src", mode=PathMode.RO)
    module = {
        "result": wm.file_probe("f.json"),
        "trap": wm.trap(),
        "timeout": wm.spin(),
    }[outcome]
    tool = folder_tool(tmp_path / "probe", wm.wasm(module), files=(need,))
    ctx = context(grants=(grant(workspace),), files=(need,), timeout_s=0.05)

    async def one() -> None:
        try:
            assert await call(engine, tool, ctx) == 1
        except (ToolFailed, ToolTimedOut):
            assert outcome != "result"

    await one()  # warm: compiled, ticker started
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(10 if outcome == "timeout" else 30):
        await one()
    assert len(os.listdir("/proc/self/fd")) - before < 3


# --- links and renames between preopens -------------------------------------------------


def _two_preopen_probe(operation: str) -> str:
    """``operation`` ("link" or "rename") of src/secret.json (fd 3, read-only) to
    out/moved.json (fd 4, writable); then, for a link, overwrites it through the new
    name. Writes ``{"errno":"NN"}`` with the first failing call's WASI errno, or
    ``{"errno":"00"}``."""
    fn = {"link": "path_link", "rename": "path_rename"}[operation]
    params = "i32 i32 i32 i32 i32 i32 i32" if operation == "link" else "i32 i32 i32 i32 i32 i32"
    flags = "(i32.const 0)" if operation == "link" else ""
    old, new, data = "secret.json", "moved.json", '{"changed":true}'
    out = '{"errno":"00"}'
    escaped_data, escaped_out = (text.replace('"', '\\"') for text in (data, out))
    overwrite = (
        ""
        if operation == "rename"
        else f"""
        (local.set $err (call $path_open (i32.const 4) (i32.const 0) (i32.const 1100)
          (i32.const {len(new)}) (i32.const 8) (i64.const {wm.RIGHT_FD_WRITE}) (i64.const 0)
          (i32.const 0) (i32.const 64)))
        (if (local.get $err) (then (call $report (local.get $err)) (return)))
        (call $write (i32.load (i32.const 64)) (i32.const 1200) (i32.const {len(data)}))"""
    )
    return f"""(module
      (import "wasi_snapshot_preview1" "fd_write"
        (func $fd_write (param i32 i32 i32 i32) (result i32)))
      (import "wasi_snapshot_preview1" "{fn}" (func $op (param {params}) (result i32)))
      (import "wasi_snapshot_preview1" "path_open"
        (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
      (memory (export "memory") 1)
      (data (i32.const 1000) "{old}") (data (i32.const 1100) "{new}")
      (data (i32.const 1200) "{escaped_data}")
      (data (i32.const 800) "{escaped_out}")
      (func $write (param $fd i32) (param $ptr i32) (param $len i32)
        (i32.store (i32.const 0) (local.get $ptr)) (i32.store (i32.const 4) (local.get $len))
        (drop (call $fd_write (local.get $fd) (i32.const 0) (i32.const 1) (i32.const 8))))
      (func $report (param $err i32)
        (i32.store8 (i32.const 810) (i32.add (i32.const 48) (i32.div_u (local.get $err) (i32.const 10))))
        (i32.store8 (i32.const 811) (i32.add (i32.const 48) (i32.rem_u (local.get $err) (i32.const 10))))
        (call $write (i32.const 1) (i32.const 800) (i32.const {len(out)})))
      (func (export "_start") (local $err i32)
        (local.set $err (call $op (i32.const 3) {flags} (i32.const 1000) (i32.const {len(old)})
                                  (i32.const 4) (i32.const 1100) (i32.const {len(new)})))
        (if (local.get $err) (then (call $report (local.get $err)) (return)))
        {overwrite}
        (call $report (i32.const 0))))"""


@pytest.mark.parametrize("operation", ["link", "rename"])
async def test_a_read_only_preopen_cannot_be_changed_through_a_writable_one(
    engine: WasmEngine, tmp_path: Path, operation: str
) -> None:
    workspace = tmp_path / "workspace"
    (workspace / "src").mkdir(parents=True)
    (workspace / "out").mkdir()
    secret = workspace / "src" / "secret.json"
    secret.write_text('{"original":true}')
    needs = (
        FileNeed(path="/workspace/src", mode=PathMode.RO),
        FileNeed(path="/workspace/out", mode=PathMode.RW),
    )
    module = wm.wasm(_two_preopen_probe(operation))
    tool = folder_tool(tmp_path / "probe", module, files=needs)
    result = await call(engine, tool, context(grants=(grant(workspace),), files=needs))
    assert result != {"errno": "00"}
    assert secret.read_text() == '{"original":true}'
    assert secret.stat().st_nlink == 1
    assert not (workspace / "out" / "moved.json").exists()


# --- the worker thread itself -------------------------------------------------------------


async def test_unbounded_recursion_is_a_trap_not_a_crash(
    engine: WasmEngine, tmp_path: Path
) -> None:
    module = wm.wasm('(module (func $down (call $down)) (func (export "_start") (call $down)))')
    exc = await failure(engine, folder_tool(tmp_path / "t", module))
    assert isinstance(exc, ToolFailed) and "call stack exhausted" in str(exc)
