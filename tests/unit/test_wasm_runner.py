"""The wasm runner over real wasmtime: the protocol, every error path with its code and
message, the preopen attack classes, the environment allowlist, the module cache and
concurrent calls. Modules are WAT (tests/wasmmodules.py), compiled in milliseconds; one
engine serves the whole file."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import trio

from gatewayd.errors import GatewayError, LimitExceeded, PolicyViolation, ToolFailed, ToolTimedOut
from gatewayd.policy.decide import Deny, check_path
from gatewayd.policy.paths import PathAccess, PathGrant, PathMode, ResolvedPath
from gatewayd.protocol import ErrorCode
from gatewayd.runners.spec import FileNeed, FolderTool, NameNeed
from gatewayd.runners.wasm import (
    CACHE_SUFFIX,
    MAX_STDERR_BYTES,
    WasmEngine,
    WasmToolRunner,
)
from gatewayd.tools.manifest import RunnerKind, ToolLimits, ToolManifest
from gatewayd.tools.registry import ToolContext
from tests import wasmmodules as wm

MAX_OUTPUT = 64 * 1024
SECRET = '{"secret":"from outside the workspace"}'
WASI_ENOENT = 44
WASI_ENOTCAPABLE = 76
WASI_EPERM = 63
WASI_EBADF = 8
# How long a compile stood in for a slow one is held for a call that should not wait for
# it: only a call that does wait lets it run out.
HELD_COMPILE_S = 10.0
WASI_ELOOP = 32


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WasmEngine]:
    with WasmEngine(tmp_path_factory.mktemp("cache") / "wasm-cache") as shared:
        yield shared


def folder_tool(
    folder: Path,
    module: bytes,
    *,
    name: str = "test.tool",
    files: tuple[FileNeed, ...] = (),
    env: tuple[NameNeed, ...] = (),
    limits: ToolLimits | None = None,
) -> FolderTool:
    folder.mkdir(parents=True, exist_ok=True)
    entry = folder / "tool.wasm"
    entry.write_bytes(module)
    manifest = ToolManifest(
        name=name,
        version="1.0.0",
        summary="a test tool",
        args_schema={"type": "object"},
        runner=RunnerKind.WASM,
        limits=limits or ToolLimits(),
    )
    return FolderTool(
        manifest=manifest,
        folder=str(folder),
        manifest_path=str(folder / "manifest.json"),
        entry=(str(entry),),
        files=files,
        env=env,
    )


def grant(host_root: Path, mode: PathMode = PathMode.RW) -> PathGrant:
    st = os.stat(host_root)
    return PathGrant(
        name="workspace",
        host_root=host_root,
        root_id=(st.st_dev, st.st_ino),
        holds_nested=False,
        visible_root=PurePosixPath("/workspace"),
        mode=mode,
    )


def context(
    *,
    grants: tuple[PathGrant, ...] = (),
    files: tuple[FileNeed, ...] = (),
    timeout_s: float = 10.0,
    env: tuple[str, ...] = (),
    max_output: int = MAX_OUTPUT,
) -> ToolContext:
    resolved: list[ResolvedPath] = []
    for need in files:
        access = PathAccess(
            path=need.path,
            access="write" if need.mode is PathMode.RW else "read",
            metadata_only=True,
        )
        result = check_path(access, grants)
        assert not isinstance(result, Deny), result
        resolved.append(result)
    return ToolContext(
        run_id="run-1",
        grants=grants,
        max_output_bytes=max_output,
        tool_call_id="c1",
        resolved=tuple(resolved),
        timeout_s=timeout_s,
        env=env,
    )


async def call(
    engine: WasmEngine, tool: FolderTool, ctx: ToolContext | None = None, **args: Any
) -> Any:
    return await WasmToolRunner(tool, engine).run(args, ctx or context())


async def failure(
    engine: WasmEngine, tool: FolderTool, ctx: ToolContext | None = None
) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        await call(engine, tool, ctx)
    return caught.value


# --- the protocol ---------------------------------------------------------------------


async def test_the_module_reads_its_arguments_on_stdin_and_its_stdout_is_the_result(
    engine: WasmEngine, tmp_path: Path
) -> None:
    tool = folder_tool(tmp_path / "echo", wm.wasm(wm.echo()))
    assert await call(engine, tool, text="two words", n=2) == {
        "arguments": {"text": "two words", "n": 2}
    }


async def test_a_module_that_never_reads_stdin_still_answers(
    engine: WasmEngine, tmp_path: Path
) -> None:
    tool = folder_tool(tmp_path / "t", wm.wasm(wm.constant('{"count": 3}')))
    assert await call(engine, tool, text="x" * 100_000) == {"count": 3}


async def test_stdout_that_is_not_one_json_value_is_tool_failed_saying_so(
    engine: WasmEngine, tmp_path: Path
) -> None:
    for index, text in enumerate(("hello", '{"a": 1} {"b": 2}', '{"a": 1, "a": 2}')):
        tool = folder_tool(tmp_path / f"t{index}", wm.wasm(wm.constant(text)))
        exc = await failure(engine, tool)
        assert exc.code is ErrorCode.TOOL_FAILED
        assert "stdout is not one JSON value" in str(exc)


async def test_empty_stdout_is_tool_failed_saying_where_the_result_goes(
    engine: WasmEngine, tmp_path: Path
) -> None:
    exc = await failure(engine, folder_tool(tmp_path / "t", wm.wasm(wm.constant(""))))
    assert exc.code is ErrorCode.TOOL_FAILED
    assert "wrote nothing on stdout" in str(exc) and "one JSON value" in str(exc)


# --- error mapping --------------------------------------------------------------------


async def test_a_trap_is_tool_failed_with_the_traps_message(
    engine: WasmEngine, tmp_path: Path
) -> None:
    exc = await failure(engine, folder_tool(tmp_path / "t", wm.wasm(wm.trap())))
    assert isinstance(exc, ToolFailed)
    assert "trapped" in str(exc) and "unreachable" in str(exc)


async def test_a_non_zero_exit_is_tool_failed_with_the_tail_of_stderr(
    engine: WasmEngine, tmp_path: Path
) -> None:
    tool = folder_tool(tmp_path / "t", wm.wasm(wm.exit_code(3, "bad input:\nno words\n")))
    exc = await failure(engine, tool)
    assert isinstance(exc, ToolFailed)
    assert "exited with code 3" in str(exc) and "bad input: | no words" in str(exc)


async def test_running_out_of_fuel_is_limit_exceeded_naming_fuel(
    engine: WasmEngine, tmp_path: Path
) -> None:
    tool = folder_tool(tmp_path / "t", wm.wasm(wm.spin()), limits=ToolLimits(fuel=100_000))
    exc = await failure(engine, tool)
    assert isinstance(exc, LimitExceeded) and exc.code is ErrorCode.LIMIT_EXCEEDED
    assert "fuel" in str(exc) and "100000 instructions" in str(exc)
    assert "limits.fuel" in str(exc)


async def test_a_module_declaring_more_memory_than_its_limit_is_limit_exceeded_memory(
    engine: WasmEngine, tmp_path: Path
) -> None:
    tool = folder_tool(
        tmp_path / "t",
        wm.wasm(wm.big_memory(2000)),  # 125 MiB
        limits=ToolLimits(memory_bytes=64 * 1024 * 1024),
    )
    exc = await failure(engine, tool)
    assert isinstance(exc, LimitExceeded)
    assert "(memory)" in str(exc) and "64 MiB" in str(exc) and "limits.memory" in str(exc)


async def test_a_module_growing_past_its_limit_is_limit_exceeded_memory(
    engine: WasmEngine, tmp_path: Path
) -> None:
    tool = folder_tool(
        tmp_path / "t",
        wm.wasm(wm.grow_until_refused()),
        limits=ToolLimits(memory_bytes=8 * 1024 * 1024),
    )
    exc = await failure(engine, tool)
    assert isinstance(exc, LimitExceeded)
    assert "memory limit of 8 MiB" in str(exc) and "(memory)" in str(exc)


async def test_an_endless_loop_is_timeout_at_the_calls_limit(
    engine: WasmEngine, tmp_path: Path
) -> None:
    tool = folder_tool(tmp_path / "t", wm.wasm(wm.spin()))
    start = time.monotonic()
    exc = await failure(engine, tool, context(timeout_s=0.3))
    elapsed = time.monotonic() - start
    assert isinstance(exc, ToolTimedOut) and exc.code is ErrorCode.TIMEOUT
    assert "time limit of 0.3 s" in str(exc)
    assert 0.3 <= elapsed < 2.0


async def test_a_stdout_flood_stops_the_module_at_once_with_tool_failed(
    engine: WasmEngine, tmp_path: Path
) -> None:
    tool = folder_tool(tmp_path / "t", wm.wasm(wm.flood()))
    start = time.monotonic()
    exc = await failure(engine, tool, context(timeout_s=20.0, max_output=4096))
    assert time.monotonic() - start < 2.0  # stopped, not left to spin to its deadline
    assert isinstance(exc, ToolFailed)
    assert "more than 4096 bytes on stdout" in str(exc) and "stopped" in str(exc)


async def test_a_stderr_flood_stops_the_module_with_tool_failed(
    engine: WasmEngine, tmp_path: Path
) -> None:
    tool = folder_tool(tmp_path / "t", wm.wasm(wm.flood(fd=2)))
    exc = await failure(engine, tool, context(timeout_s=20.0))
    assert isinstance(exc, ToolFailed)
    assert f"more than {MAX_STDERR_BYTES} bytes on stderr" in str(exc)


async def test_a_file_that_is_not_wasm_is_tool_failed_and_never_read_as_wat(
    engine: WasmEngine, tmp_path: Path
) -> None:
    # Valid WAT text: wasmtime would compile it if handed the bytes unchecked.
    tool = folder_tool(tmp_path / "t", wm.echo().encode())
    exc = await failure(engine, tool)
    assert isinstance(exc, ToolFailed)
    assert "is not a WebAssembly module" in str(exc) and "wasm32-wasi" in str(exc)
    with pytest.raises(ToolFailed, match="is not a WebAssembly module"):
        engine.load(tool)


async def test_a_truncated_module_is_tool_failed_naming_the_cause(
    engine: WasmEngine, tmp_path: Path
) -> None:
    whole = wm.wasm(wm.echo())
    tool = folder_tool(tmp_path / "t", whole[: len(whole) // 2])
    exc = await failure(engine, tool)
    assert isinstance(exc, ToolFailed)
    assert "not a valid WebAssembly module" in str(exc) and "end-of-file" in str(exc)


def test_a_module_importing_what_gatewayd_does_not_provide_fails_its_check(
    engine: WasmEngine, tmp_path: Path
) -> None:
    module = wm.wasm('(module (import "env" "socket" (func)) (func (export "_start")))')
    with pytest.raises(ToolFailed, match=r"cannot be linked: unknown import.*WASI preview 1"):
        engine.load(folder_tool(tmp_path / "t", module))


def test_a_module_without_start_fails_its_check(engine: WasmEngine, tmp_path: Path) -> None:
    module = wm.wasm('(module (func (export "main")))')
    with pytest.raises(ToolFailed, match="exports no _start: build it as a WASI command"):
        engine.load(folder_tool(tmp_path / "t", module))


async def test_a_module_changed_since_its_folder_was_loaded_is_refused(
    engine: WasmEngine, tmp_path: Path
) -> None:
    tool = folder_tool(tmp_path / "t", wm.wasm(wm.constant("1")))
    stale = FolderTool(**{**_fields(tool), "entry_digest": "sha256:" + "0" * 64})
    exc = await failure(engine, stale)
    assert isinstance(exc, ToolFailed) and "changed since gatewayd loaded" in str(exc)
    assert "restarts gatewayd" in str(exc)  # what applies a new build: not a reload


def _fields(tool: FolderTool) -> dict[str, Any]:
    return {name: getattr(tool, name) for name in tool.__struct_fields__}


# --- preopens ----------------------------------------------------------------------------


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """A workspace with src/ (a file inside), and a directory outside it with a secret."""
    workspace = tmp_path / "workspace"
    (workspace / "src").mkdir(parents=True)
    (workspace / "src" / "inside.json").write_text('{"content":"inside"}')
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.json").write_text(SECRET)
    return workspace, outside


def probe(
    tmp_path: Path, workspace: Path, path: str, *, mode: PathMode, write: bool = False
) -> tuple[FolderTool, ToolContext]:
    need = FileNeed(path="/workspace/src", mode=mode)
    tool = folder_tool(tmp_path / "probe", wm.wasm(wm.file_probe(path, write=write)), files=(need,))
    return tool, context(grants=(grant(workspace),), files=(need,))


async def test_a_granted_directory_is_readable_at_its_visible_path(
    engine: WasmEngine, tmp_path: Path, layout: tuple[Path, Path]
) -> None:
    tool, ctx = probe(tmp_path, layout[0], "inside.json", mode=PathMode.RO)
    assert await call(engine, tool, ctx) == {"content": "inside"}


async def test_a_module_has_no_socket_to_accept_on_or_send_through(
    engine: WasmEngine, tmp_path: Path, layout: tuple[Path, Path]
) -> None:
    # WASI preview 1 has no call that opens a socket; its socket calls work only on one
    # handed over, and the runner hands over stdio and the granted directories alone.
    need = FileNeed(path="/workspace/src", mode=PathMode.RW)
    tool = folder_tool(tmp_path / "net", wm.wasm(wm.sockets()), files=(need,))
    ctx = context(grants=(grant(layout[0]),), files=(need,))
    assert await call(engine, tool, ctx) == 0


@pytest.mark.parametrize(
    "path",
    [
        "../../outside/secret.json",  # '..' above the preopen
        "../src/../../outside/secret.json",
        "/etc/passwd",  # absolute
    ],
)
async def test_dot_dot_and_absolute_paths_do_not_leave_the_preopen(
    engine: WasmEngine, tmp_path: Path, layout: tuple[Path, Path], path: str
) -> None:
    tool, ctx = probe(tmp_path, layout[0], path, mode=PathMode.RO)
    result = await call(engine, tool, ctx)
    assert result != {"secret": "from outside the workspace"}
    assert result["errno"] in {f"{WASI_ENOTCAPABLE}", f"{WASI_EPERM}", f"{WASI_ENOENT}"}


@pytest.mark.parametrize("target", ["/etc", "OUTSIDE", "../../outside"])
async def test_a_symlink_inside_the_workspace_pointing_out_is_not_followed_out(
    engine: WasmEngine, tmp_path: Path, layout: tuple[Path, Path], target: str
) -> None:
    workspace, outside = layout
    link_target = str(outside) if target == "OUTSIDE" else target
    (workspace / "src" / "escape").symlink_to(link_target)
    name = "escape/passwd" if target == "/etc" else "escape/secret.json"
    tool, ctx = probe(tmp_path, workspace, name, mode=PathMode.RO)
    result = await call(engine, tool, ctx)
    assert "errno" in result, result
    assert result["errno"] in {f"{WASI_ENOTCAPABLE}", f"{WASI_EPERM}", f"{WASI_ELOOP}"}


async def test_a_preopened_directory_swapped_for_a_symlink_is_refused(
    engine: WasmEngine, tmp_path: Path, layout: tuple[Path, Path]
) -> None:
    workspace, outside = layout
    tool, ctx = probe(tmp_path, workspace, "secret.json", mode=PathMode.RO)
    # After the policy step resolved /workspace/src, the agent swaps it for a link out.
    (workspace / "src").rename(workspace / "src.old")
    (workspace / "src").symlink_to(outside)
    exc = await failure(engine, tool, ctx)
    assert isinstance(exc, PolicyViolation)
    assert "symlink" in str(exc) and "/workspace/src" in str(exc)


async def test_a_workspace_root_swapped_for_a_symlink_is_refused(
    engine: WasmEngine, tmp_path: Path, layout: tuple[Path, Path]
) -> None:
    workspace, outside = layout
    tool, ctx = probe(tmp_path, workspace, "secret.json", mode=PathMode.RO)
    workspace.rename(tmp_path / "workspace.old")
    workspace.symlink_to(outside)
    exc = await failure(engine, tool, ctx)
    assert isinstance(exc, PolicyViolation) and "was replaced after the run started" in str(exc)


async def test_a_write_to_a_read_only_preopen_is_refused(
    engine: WasmEngine, tmp_path: Path, layout: tuple[Path, Path]
) -> None:
    workspace = layout[0]
    tool, ctx = probe(tmp_path, workspace, "new.json", mode=PathMode.RO, write=True)
    result = await call(engine, tool, ctx)
    assert "errno" in result, result
    assert not (workspace / "src" / "new.json").exists()


async def test_a_write_to_a_writable_preopen_lands_in_the_workspace(
    engine: WasmEngine, tmp_path: Path, layout: tuple[Path, Path]
) -> None:
    workspace = layout[0]
    tool, ctx = probe(tmp_path, workspace, "new.json", mode=PathMode.RW, write=True)
    assert await call(engine, tool, ctx) == {"written": True}
    assert (workspace / "src" / "new.json").read_text() == '{"written":true}'


async def test_a_directory_under_per_file_rules_is_not_handed_over_whole(
    engine: WasmEngine, tmp_path: Path, layout: tuple[Path, Path]
) -> None:
    workspace = layout[0]
    need = FileNeed(path="/workspace/src", mode=PathMode.RO)
    base = grant(workspace)
    suffixed = PathGrant(
        name=base.name,
        host_root=base.host_root,
        root_id=base.root_id,
        holds_nested=False,
        visible_root=base.visible_root,
        mode=base.mode,
        suffixes=(".json",),
    )
    tool = folder_tool(tmp_path / "probe", wm.wasm(wm.file_probe("inside.json")), files=(need,))
    exc = await failure(engine, tool, context(grants=(suffixed,), files=(need,)))
    assert isinstance(exc, PolicyViolation)
    assert "cannot be given '/workspace/src' whole" in str(exc) and "narrower path" in str(exc)


# --- environment ------------------------------------------------------------------------


async def test_only_granted_environment_variables_are_visible(
    engine: WasmEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COGNI_WASM_GRANTED", "visible-value")
    monkeypatch.setenv("COGNI_WASM_DECLARED_NOT_GRANTED", "run-lacks-it")
    monkeypatch.setenv("COGNI_WASM_HOST_ONLY", "host-secret")
    tool = folder_tool(
        tmp_path / "env",
        wm.wasm(wm.environment()),
        env=(
            NameNeed(name="COGNI_WASM_GRANTED"),
            NameNeed(name="COGNI_WASM_DECLARED_NOT_GRANTED", optional=True),
        ),
    )
    result = await call(engine, tool, context(env=("COGNI_WASM_GRANTED",)))
    assert result == {"env": "COGNI_WASM_GRANTED=visible-value "}


# --- the cache -------------------------------------------------------------------------


def test_a_fresh_engine_loads_a_cached_module_without_compiling(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    tool = folder_tool(tmp_path / "t", wm.wasm(wm.echo()))
    with WasmEngine(cache) as first:
        first.load(tool)
        assert (first.compiled, first.cache_hits) == (1, 0)
    (cached,) = cache.iterdir()
    assert cached.name.endswith(CACHE_SUFFIX)
    assert cached.stat().st_mode & 0o777 == 0o600 and cache.stat().st_mode & 0o777 == 0o700
    with WasmEngine(cache) as second:
        start = time.perf_counter()
        second.load(tool)
        elapsed = time.perf_counter() - start
        assert (second.compiled, second.cache_hits) == (0, 1)
    assert elapsed < 0.5  # generous: the benchmark measures it (target 10 ms)


@pytest.mark.parametrize("where", ["magic", "digest", "payload", "end"])
def test_a_corrupt_cache_file_is_recompiled_never_loaded(tmp_path: Path, where: str) -> None:
    cache = tmp_path / "cache"
    tool = folder_tool(tmp_path / "t", wm.wasm(wm.echo()))
    with WasmEngine(cache) as first:
        first.load(tool)
    (cached,) = cache.iterdir()
    data = bytearray(cached.read_bytes())
    offset = {"magic": 0, "digest": 30, "payload": len(data) // 2, "end": len(data) - 1}[where]
    data[offset] ^= 0xFF
    cached.write_bytes(bytes(data))
    with WasmEngine(cache) as second:
        second.load(tool)
        assert (second.compiled, second.cache_hits) == (1, 0)
    with WasmEngine(cache) as third:  # the recompiled module was written back
        third.load(tool)
        assert (third.compiled, third.cache_hits) == (0, 1)


def test_a_cache_file_others_could_write_is_not_trusted(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    tool = folder_tool(tmp_path / "t", wm.wasm(wm.echo()))
    with WasmEngine(cache) as first:
        first.load(tool)
    (cached,) = cache.iterdir()
    cached.chmod(0o666)
    with WasmEngine(cache) as second:
        second.load(tool)
        assert (second.compiled, second.cache_hits) == (1, 0)


# --- concurrency --------------------------------------------------------------------------


async def test_two_calls_run_at_once(engine: WasmEngine, tmp_path: Path) -> None:
    slow = folder_tool(tmp_path / "slow", wm.wasm(wm.spin()), name="test.slow")
    fast = folder_tool(tmp_path / "fast", wm.wasm(wm.echo()), name="test.fast")
    results: dict[str, Any] = {}

    async def slow_call() -> None:
        with pytest.raises(ToolTimedOut):
            await call(engine, slow, context(timeout_s=0.5))
        results["slow"] = time.monotonic()

    async def fast_call() -> None:
        await trio.sleep(0.05)
        results["fast"] = await call(engine, fast, n=1)
        results["fast_at"] = time.monotonic()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(slow_call)
        nursery.start_soon(fast_call)
    assert results["fast"] == {"arguments": {"n": 1}}
    assert results["fast_at"] < results["slow"]  # not queued behind the spinning module


async def test_a_module_compiling_does_not_hold_up_the_calls_of_other_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A module may take seconds to compile (a big one); the compile stands in held until
    # the other module's call is answered (or long enough to say that call waited for it).
    with WasmEngine(tmp_path / "cache") as own:
        warm = folder_tool(tmp_path / "warm", wm.wasm(wm.echo()), name="test.warm")
        assert await call(own, warm, n=0) == {"arguments": {"n": 0}}
        compile_module = own._compile
        compiling_started, warm_answered = threading.Event(), threading.Event()
        answered_while_held: list[bool] = []

        def slow_compile(data: bytes, shown_path: str) -> Any:
            compiling_started.set()
            answered_while_held.append(warm_answered.wait(HELD_COMPILE_S))
            return compile_module(data, shown_path)

        monkeypatch.setattr(own, "_compile", slow_compile)
        big = folder_tool(tmp_path / "big", wm.wasm(wm.constant('"big"')), name="test.big")

        async def compiling() -> None:
            assert await call(own, big) == "big"

        async def warm_call() -> None:
            assert await trio.to_thread.run_sync(compiling_started.wait, HELD_COMPILE_S)
            assert await call(own, warm, n=2) == {"arguments": {"n": 2}}
            warm_answered.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(compiling)
            nursery.start_soon(warm_call)
        # One compile (the big module's), held until the warm call was answered.
        assert answered_while_held == [True], "the warm call waited for the compile"
