"""The wasm runner over real wasmtime with WASI preview 2 components (``wasi:cli/run``
commands): the same protocol, limits, preopens, environment, stdout bound, error
mapping and disk cache as a preview 1 module. The components are the WAT modules of
tests/wasmmodules.py made components with wasm-tools and the preview 1 command adapter
(tests/wasmcomponents.py), as a toolchain makes them; a few that only a hand-written
component can be (a run that returns err, imports gatewayd refuses) are component WAT."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.errors import LimitExceeded, ToolFailed, ToolTimedOut
from gatewayd.policy.paths import PathMode
from gatewayd.protocol import ErrorCode
from gatewayd.runners.spec import FileNeed, NameNeed
from gatewayd.runners.wasm import CACHE_SUFFIX, WasmEngine
from gatewayd.tools.manifest import ToolLimits
from tests import wasmcomponents
from tests import wasmmodules as wm
from tests.unit.test_wasm_runner import call, context, failure, folder_tool, grant

WASI_EPERM = 63
# A component written by hand: its run is a core function answering ``result``'s
# discriminant (0 ok, 1 err), and ``imports`` its extra imports.
_RUN_RESULT = """(component {imports}
  (core module $m {start} (func (export "run") (result i32) i32.const {discriminant}))
  (core instance $i (instantiate $m))
  (func $run (result (result)) (canon lift (core func $i "run")))
  (instance $r (export "run" (func $run)))
  (export "wasi:cli/run@0.2.0" (instance $r)))"""


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WasmEngine]:
    with WasmEngine(tmp_path_factory.mktemp("cache") / "wasm-cache") as shared:
        yield shared


@pytest.fixture(scope="module")
def component(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], bytes]:
    """WAT of a preview 1 command -> the bytes of its command component (made once)."""
    # pytest's cache keeps the adapter between sessions; without the cache plugin
    # (-p no:cacheprovider) it is made for this session only.
    cache = getattr(request.config, "cache", None)
    where = cache.mkdir("wasi-adapter") if cache is not None else tmp_path_factory.mktemp("adapter")
    adapter = wasmcomponents.adapter(where)
    made: dict[str, bytes] = {}

    def make(wat: str) -> bytes:
        if wat not in made:
            made[wat] = wasmcomponents.component(wm.wasm(wat), adapter)
        return made[wat]

    return make


def hand_written(*, err: bool = False, imports: str = "", start: str = "") -> bytes:
    return wm.wasm(_RUN_RESULT.format(imports=imports, discriminant=int(err), start=start))


# --- the protocol ---------------------------------------------------------------------


async def test_a_component_reads_its_arguments_on_stdin_and_its_stdout_is_the_result(
    engine: WasmEngine, component: Callable[[str], bytes], tmp_path: Path
) -> None:
    data = component(wm.echo())
    assert data[4:8] == b"\x0d\x00\x01\x00"  # a component's header, not a module's
    tool = folder_tool(tmp_path / "echo", data)
    assert await call(engine, tool, text="two words", n=2) == {
        "arguments": {"text": "two words", "n": 2}
    }


async def test_a_component_that_never_reads_stdin_still_answers(
    engine: WasmEngine, component: Callable[[str], bytes], tmp_path: Path
) -> None:
    tool = folder_tool(tmp_path / "t", component(wm.constant('{"count": 3}')))
    assert await call(engine, tool, text="x" * 100_000) == {"count": 3}


async def test_a_components_stdout_that_is_not_json_is_tool_failed_saying_so(
    engine: WasmEngine, component: Callable[[str], bytes], tmp_path: Path
) -> None:
    exc = await failure(engine, folder_tool(tmp_path / "t", component(wm.constant("hello"))))
    assert exc.code is ErrorCode.TOOL_FAILED and "stdout is not one JSON value" in str(exc)


# --- error mapping --------------------------------------------------------------------


async def test_a_component_running_out_of_fuel_is_limit_exceeded_naming_fuel(
    engine: WasmEngine, component: Callable[[str], bytes], tmp_path: Path
) -> None:
    tool = folder_tool(tmp_path / "t", component(wm.spin()), limits=ToolLimits(fuel=100_000))
    exc = await failure(engine, tool)
    assert isinstance(exc, LimitExceeded) and exc.code is ErrorCode.LIMIT_EXCEEDED
    assert "used up its fuel, 100000 instructions (fuel)" in str(exc)


async def test_a_components_endless_loop_is_timeout_at_the_calls_limit(
    engine: WasmEngine, component: Callable[[str], bytes], tmp_path: Path
) -> None:
    tool = folder_tool(tmp_path / "t", component(wm.spin()))
    start = time.monotonic()
    exc = await failure(engine, tool, context(timeout_s=0.3))
    elapsed = time.monotonic() - start
    assert isinstance(exc, ToolTimedOut) and exc.code is ErrorCode.TIMEOUT
    assert "time limit of 0.3 s" in str(exc)
    assert 0.3 <= elapsed < 2.0


async def test_a_components_stdout_flood_stops_it_at_once_with_tool_failed(
    engine: WasmEngine, component: Callable[[str], bytes], tmp_path: Path
) -> None:
    tool = folder_tool(tmp_path / "t", component(wm.flood()))
    start = time.monotonic()
    exc = await failure(engine, tool, context(timeout_s=20.0, max_output=4096))
    assert time.monotonic() - start < 2.0
    assert isinstance(exc, ToolFailed) and "more than 4096 bytes on stdout" in str(exc)


async def test_a_component_declaring_more_memory_than_its_limit_is_limit_exceeded(
    engine: WasmEngine, component: Callable[[str], bytes], tmp_path: Path
) -> None:
    tool = folder_tool(
        tmp_path / "t",
        component(wm.big_memory(2000)),  # 125 MiB
        limits=ToolLimits(memory_bytes=64 * 1024 * 1024),
    )
    exc = await failure(engine, tool)
    assert isinstance(exc, LimitExceeded)
    assert "(memory)" in str(exc) and "64 MiB" in str(exc) and "limits.memory" in str(exc)


async def test_a_component_failing_at_its_memory_limit_is_tool_failed_naming_the_limit(
    engine: WasmEngine, component: Callable[[str], bytes], tmp_path: Path
) -> None:
    # Its memory is not visible from outside: the limit holds (growth refused), and the
    # failure names it rather than claiming to know it was the cause.
    tool = folder_tool(
        tmp_path / "t",
        component(wm.grow_until_refused()),
        limits=ToolLimits(memory_bytes=8 * 1024 * 1024),
    )
    exc = await failure(engine, tool)
    assert isinstance(exc, ToolFailed) and "unreachable" in str(exc)
    assert "its memory limit is 8 MiB" in str(exc) and "limits.memory" in str(exc)


async def test_a_component_trap_is_tool_failed_with_its_message(
    engine: WasmEngine, component: Callable[[str], bytes], tmp_path: Path
) -> None:
    exc = await failure(engine, folder_tool(tmp_path / "t", component(wm.trap())))
    assert isinstance(exc, ToolFailed) and "trapped" in str(exc) and "unreachable" in str(exc)


async def test_a_component_exiting_non_zero_is_tool_failed_with_stderr(
    engine: WasmEngine, component: Callable[[str], bytes], tmp_path: Path
) -> None:
    tool = folder_tool(tmp_path / "t", component(wm.exit_code(3, "bad input\n")))
    exc = await failure(engine, tool)
    # WASI 0.2 has no exit code: the adapter turns any failure into exit(err), code 1.
    assert isinstance(exc, ToolFailed)
    assert "exited with code 1" in str(exc) and "bad input" in str(exc)


async def test_a_run_returning_err_is_tool_failed(engine: WasmEngine, tmp_path: Path) -> None:
    exc = await failure(engine, folder_tool(tmp_path / "t", hand_written(err=True)))
    assert isinstance(exc, ToolFailed) and "ended with an error" in str(exc)
    ok = await failure(engine, folder_tool(tmp_path / "ok", hand_written()))
    assert "wrote nothing on stdout" in str(ok)  # ok, then the protocol's own check


async def test_code_run_while_a_component_starts_is_held_to_the_same_limits(
    engine: WasmEngine, tmp_path: Path
) -> None:
    # A core start function runs during instantiation, before run: fuel and the
    # deadline are already set.
    spin_at_start = hand_written(start="(func $spin (loop $l (br $l))) (start $spin)")
    tool = folder_tool(tmp_path / "t", spin_at_start)
    exc = await failure(engine, tool, context(timeout_s=0.3))
    assert isinstance(exc, ToolTimedOut)
    fuel = folder_tool(tmp_path / "f", spin_at_start, limits=ToolLimits(fuel=10_000))
    exc = await failure(engine, fuel)
    assert isinstance(exc, LimitExceeded) and "(fuel)" in str(exc)


async def test_components_run_at_once_each_with_its_own_streams(
    engine: WasmEngine, component: Callable[[str], bytes], tmp_path: Path
) -> None:
    tools = [
        folder_tool(tmp_path / f"t{n}", component(wm.echo()), name=f"test.echo{n}")
        for n in range(4)
    ]
    results: dict[int, Any] = {}

    async def one(n: int) -> None:
        results[n] = await call(engine, tools[n], n=n)

    async with trio.open_nursery() as nursery:
        for n in range(4):
            nursery.start_soon(one, n)
    assert results == {n: {"arguments": {"n": n}} for n in range(4)}


# --- what a component may be ------------------------------------------------------------


@pytest.mark.parametrize("cut", [9, 2000])
async def test_a_garbage_or_truncated_component_is_tool_failed(
    engine: WasmEngine, component: Callable[[str], bytes], tmp_path: Path, cut: int
) -> None:
    data = component(wm.echo())[:cut] + b"\xff" * 16
    tool = folder_tool(tmp_path / "t", data)
    exc = await failure(engine, tool)
    assert isinstance(exc, ToolFailed)
    assert "is not a valid WebAssembly component (truncated or corrupt?)" in str(exc)
    with pytest.raises(ToolFailed, match="not a valid WebAssembly component"):
        engine.load(tool)


def test_a_component_that_waits_is_refused_by_its_check(
    engine: WasmEngine, component: Callable[[str], bytes], tmp_path: Path
) -> None:
    sleep = wm._module(
        """(func (export "_start")
             (drop (call $poll (i32.const 256) (i32.const 512) (i32.const 1) (i32.const 600))))""",
        extra='(import "wasi_snapshot_preview1" "poll_oneoff" '
        "(func $poll (param i32 i32 i32 i32) (result i32)))",
    )
    tool = folder_tool(tmp_path / "t", component(sleep))
    with pytest.raises(ToolFailed, match=r"imports 'wasi:io/poll@0\.2\.\d+'.*time limit"):
        engine.load(tool)


@pytest.mark.parametrize(
    ("interface", "reason"),
    [
        ("wasi:sockets/tcp@0.2.0", "no network"),
        ("wasi:http/outgoing-handler@0.2.0", "no network"),
        ("example:evil/host@1.0.0", "cli, io/streams, clocks"),
        ("wasi:cli/stdout@0.3.0", "cli, io/streams, clocks"),
    ],
)
def test_a_component_importing_what_gatewayd_does_not_give_is_refused(
    engine: WasmEngine, tmp_path: Path, interface: str, reason: str
) -> None:
    data = hand_written(imports=f'(import "{interface}" (instance))')
    with pytest.raises(ToolFailed, match=f"imports '{interface}'.*{reason}"):
        engine.load(folder_tool(tmp_path / "t", data))


def test_a_component_without_a_run_export_is_refused(engine: WasmEngine, tmp_path: Path) -> None:
    with pytest.raises(ToolFailed, match=r"without a wasi:cli/run@0\.2\.x export"):
        engine.load(folder_tool(tmp_path / "t", wm.wasm("(component)")))


# --- files and environment -----------------------------------------------------------------


async def test_a_component_reads_a_granted_directory(
    engine: WasmEngine, component: Callable[[str], bytes], tmp_path: Path
) -> None:
    workspace = tmp_path / "workspace"
    (workspace / "src").mkdir(parents=True)
    (workspace / "src" / "data.json").write_text('{"inside": true}')
    need = FileNeed(path="/workspace/src", mode=PathMode.RO)
    tool = folder_tool(tmp_path / "probe", component(wm.file_probe("data.json")), files=(need,))
    ctx = context(grants=(grant(workspace),), files=(need,))
    assert await call(engine, tool, ctx) == {"inside": True}


async def test_a_component_cannot_write_to_a_read_only_preopen(
    engine: WasmEngine, component: Callable[[str], bytes], tmp_path: Path
) -> None:
    workspace = tmp_path / "workspace"
    (workspace / "src").mkdir(parents=True)
    need = FileNeed(path="/workspace/src", mode=PathMode.RO)
    module = component(wm.file_probe("new.json", write=True))
    tool = folder_tool(tmp_path / "probe", module, files=(need,))
    ctx = context(grants=(grant(workspace),), files=(need,))
    assert await call(engine, tool, ctx) == {"errno": f"{WASI_EPERM}"}
    assert not (workspace / "src" / "new.json").exists()
    (workspace / "secret.json").write_text('{"secret": 1}')
    (workspace / "src" / "link").symlink_to("../secret.json")
    for path in ("../secret.json", "link", str(workspace / "secret.json")):
        escape = folder_tool(tmp_path / "up", component(wm.file_probe(path)), files=(need,))
        assert "errno" in await call(engine, escape, ctx), path  # none leaves the preopen


async def test_a_component_sees_only_granted_environment_variables(
    engine: WasmEngine,
    component: Callable[[str], bytes],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COGNI_WASM_GRANTED", "visible-value")
    monkeypatch.setenv("COGNI_WASM_HOST_ONLY", "host-secret")
    tool = folder_tool(
        tmp_path / "env", component(wm.environment()), env=(NameNeed(name="COGNI_WASM_GRANTED"),)
    )
    result = await call(engine, tool, context(env=("COGNI_WASM_GRANTED",)))
    assert result == {"env": "COGNI_WASM_GRANTED=visible-value "}


# --- the cache -------------------------------------------------------------------------


async def test_a_fresh_engine_loads_a_cached_component_without_compiling(
    component: Callable[[str], bytes], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    tool = folder_tool(tmp_path / "t", component(wm.constant('{"cached": true}')))
    with WasmEngine(cache) as first:
        first.load(tool)
        assert (first.compiled, first.cache_hits) == (1, 0)
    (cached,) = cache.iterdir()
    assert cached.name.endswith(CACHE_SUFFIX) and cached.stat().st_mode & 0o777 == 0o600
    with WasmEngine(cache) as second:
        assert await call(second, tool) == {"cached": True}
        assert (second.compiled, second.cache_hits) == (0, 1)
    data = bytearray(cached.read_bytes())
    data[-100] ^= 0xFF  # a cut or altered file is compiled anew, never loaded
    cached.write_bytes(bytes(data))
    with WasmEngine(cache) as third:
        assert await call(third, tool) == {"cached": True}
        assert (third.compiled, third.cache_hits) == (1, 0)
