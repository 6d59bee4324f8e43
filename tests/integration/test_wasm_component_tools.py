"""The example tools (examples/tools/, C built by ``make tools``) turned into WASI
preview 2 command components, as an author would with wasm-tools and the preview 1
command adapter (tests/wasmcomponents.py), then loaded by a real daemon from a tool
directory and called in a real run through the dispatcher: a component is a wasm
tool like a module, with the same grants, preopens and audit."""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gatewayd.config import GatewaydConfig, SandboxUids
from gatewayd.daemon import open_daemon
from gatewayd.protocol import ErrorCode
from gatewayd.runs import Grant, RunLimits, RunRequest
from tests import wasmcomponents
from tests.exampletools import copy_examples
from tests.integration.test_tool_examples import (
    POLICY,
    Examples,
    _unavailable,
    make_workspace,
)
from tests.responses import failure, value

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

# The examples made components. Not the model example: it imports ``cogni``, which the
# adapter cannot make a WASI interface of (components get no model import). Not search:
# it opens files O_NONBLOCK (against a planted FIFO), and through the adapter a
# non-blocking read of a regular file answers 0 bytes, end of file, at once (WASI 0.2's
# non-blocking stream read; docs/tool-runners.md, "Components").
COMPONENTS = ("wordcount", "write")


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-comp-", dir="/tmp"))
    path.chmod(0o711)  # the run's uid passes through to its workspace
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def ex(base: Path, request: pytest.FixtureRequest) -> AsyncIterator[Examples]:
    adapter = wasmcomponents.adapter(request.config.cache.mkdir("wasi-adapter"))
    tools = copy_examples(base / "tools", COMPONENTS)
    for name in COMPONENTS:
        module = tools / name / f"{name}.wasm"
        module.write_bytes(wasmcomponents.component(module.read_bytes(), adapter))
    workspace = make_workspace(base / "ws")
    config = GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(base,),
        netns_prefix=f"cgc{secrets.token_hex(4)}-",
        sandbox_uids=SandboxUids(base=1_760_000_000 + secrets.randbelow(50_000) * 1024, count=64),
        audit_fsync=False,
        tool_dirs=(tools,),
        # What the components write is looked for in the workspace itself.
        workspace_mode="host",
    )
    async with open_daemon(config, preload=True) as daemon:
        policy = base / "policy.yaml"
        policy.write_text(POLICY)
        run = await daemon.runs.start(
            RunRequest(
                workspacePath=str(workspace),
                policy=str(policy),
                actorId="tester",
                tenantId="t1",
                grant=Grant(allowSandbox=True),
                limits=RunLimits(maxMemoryMb=1024),
            ),
            policy_paths=True,
        )
        yield Examples(daemon, base, run, workspace)


async def test_wordcount_as_a_component_counts_and_is_audited_with_its_digest(
    ex: Examples,
) -> None:
    module = ex.base / "tools" / "wordcount" / "wordcount.wasm"
    assert module.read_bytes()[4:8] == b"\x0d\x00\x01\x00"  # a component, not a module
    answer = await ex.call("text.wordcount", {"text": "héllo  big\nworld"})
    assert value(answer) == {"words": 3, "lines": 2, "chars": 16, "bytes": 17}
    (entry,) = [e for e in await ex.entries() if e.get("kind") == "call"]
    assert entry["tool"] == "text.wordcount"
    assert entry["detail"]["entryDigest"].startswith("sha256:")
    message = failure(await ex.call("text.wordcount", {"text": 5}), ErrorCode.INVALID_ARGS)
    assert "text" in message


async def test_write_as_a_component_writes_beneath_out_only(ex: Examples) -> None:
    answer = value(await ex.call("files.write", {"path": "n/x.txt", "content": "made\n"}))
    assert answer == {"path": "/workspace/out/n/x.txt", "bytes": 5, "appended": False}
    assert (ex.workspace / "out" / "n" / "x.txt").read_text() == "made\n"
    message = failure(
        await ex.call("files.write", {"path": "../escape.txt", "content": "x"}),
        ErrorCode.TOOL_FAILED,
    )
    assert 'may not contain ".."' in message and not (ex.workspace / "escape.txt").exists()
    run = await ex.start(POLICY.replace("out: {root: out, mode: rw}", "out: {root: out, mode: ro}"))
    message = failure(
        await ex.call("files.write", {"path": "x.txt", "content": "x"}, run),
        ErrorCode.POLICY_DENIED,
    )
    assert "/workspace/out" in message
