"""A runner kind dispatch has never seen: registered, checked and run with no change to
dispatch.py.

The kind here stands in for a process tool read from its own manifest file: a hand-made
argument check instead of a msgspec Struct, a runner object, and capability requests
taken from the manifest's declaration (the paths it declares, its environment names).
Through the same Dispatcher and fakes as tests/unit/test_dispatch.py, each call gets
exactly what its declaration and the run's policy both allow: a path the run lacks or an
environment name its policy does not pass is ``policy_denied``, a request beyond the
declaration is ``internal``, and the manifest's own time limit stops a call.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import trio
from trio.testing import MockClock

import gatewayd.dispatch
from gatewayd.errors import ArgumentsRejected
from gatewayd.policy import load_policy_text
from gatewayd.policy.capabilities import CapabilityRequest
from gatewayd.policy.paths import PathAccess, PathMode
from gatewayd.protocol import ErrorCode
from gatewayd.runs import Run
from gatewayd.tools.manifest import ToolManifest
from gatewayd.tools.registry import Tool, ToolContext, ToolRegistry
from tests.unit.test_dispatch import (
    CALL_TIMEOUT_S,
    PEER,
    POLICY,
    FakeAuditLog,
    call,
    make_dispatcher,
    make_run,
)

OWN_TIMEOUT_S: Final = CALL_TIMEOUT_S / 5
# What an operator's tool folder would hold: the manifest, as a file would give it.
MANIFEST: Final = {
    "name": "test.wordcount",
    "version": "2.1.0",
    "summary": "Count the words of a text; keeps a tally in /workspace/data.",
    "argsSchema": {
        "type": "object",
        "properties": {"text": {"type": "string"}, "nap": {"type": "number"}},
        "required": ["text"],
        "additionalProperties": False,
    },
    "runner": "process",
    "capabilities": {"files": [{"path": "/workspace/data", "mode": "rw"}]},
    "limits": {"timeoutSeconds": OWN_TIMEOUT_S, "memoryBytes": 64 << 20},
}


def decode(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A stand-in for a JSON Schema validator: the kind's own, not msgspec's Struct."""
    unknown = sorted(set(raw) - {"text", "nap"})
    if unknown:
        raise ArgumentsRejected(f"unknown argument {unknown[0]!r}")
    if not isinstance(raw.get("text"), str):
        raise ArgumentsRejected("'text' must be a string")
    return dict(raw)


def declared_request(manifest: ToolManifest) -> CapabilityRequest:
    """Every call asks for what the manifest declares (the kind's rule, not dispatch's)."""
    declared = manifest.capabilities
    return CapabilityRequest(
        paths=tuple(
            PathAccess(
                path=f.path,
                access="write" if f.mode is PathMode.RW else "read",
                metadata_only=True,
            )
            for f in declared.files
        ),
        env=declared.env,
        exec=declared.exec,
    )


@dataclass
class ProcessRunner:
    """The kind's runner object: what it was given, and a word count."""

    seen: list[ToolContext] = field(default_factory=list)

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> Any:
        self.seen.append(ctx)
        await trio.sleep(args.get("nap", 0))
        return {"words": len(args["text"].split())}


def process_tool(
    runner: ProcessRunner, *, request: CapabilityRequest | None = None, **changes: Any
) -> Tool[dict[str, Any]]:
    """A tool of the new kind from MANIFEST with ``changes``; ``request``: what every
    call asks for instead of what the manifest declares (a kind with a bug)."""
    manifest = msgspec.convert({**MANIFEST, **changes}, ToolManifest)
    fixed = declared_request(manifest) if request is None else request
    return Tool(manifest=manifest, decode=decode, requests=lambda _args: fixed, runner=runner)


def run_with_env(tmp_path: Path, *names: str) -> Run:
    """test_dispatch's run, its policy passing ``names`` through (env.allow)."""
    run = make_run(tmp_path)
    policy = load_policy_text(POLICY + f"env:\n  allow: [{', '.join(names)}]\n", "kinds.yaml")
    run.spec = dataclasses.replace(run.spec, policy=policy)
    return run


@dataclass(frozen=True, kw_only=True)
class Row:
    id: str
    changes: dict[str, Any] = field(default_factory=dict)
    request: CapabilityRequest | None = None
    args: dict[str, Any] = field(default_factory=lambda: {"text": "one two three"})
    env: tuple[str, ...] = ()
    code: ErrorCode | None = None
    says: str = ""


ROWS: Final = [
    Row(id="allowed"),
    Row(
        id="allowed-with-an-environment-name-the-policy-passes",
        changes={"capabilities": {**MANIFEST["capabilities"], "env": ["LANG"]}},
        env=("LANG",),
    ),
    Row(
        id="invalid_args-by-the-kinds-own-decoder",
        args={"text": 5},
        code=ErrorCode.INVALID_ARGS,
        says="invalid arguments for test.wordcount: 'text' must be a string. "
        "The schema is in tools.list.",
    ),
    Row(
        id="policy_denied-a-declared-path-the-run-lacks",
        changes={"capabilities": {"files": [{"path": "/srv/data", "mode": "rw"}]}},
        code=ErrorCode.POLICY_DENIED,
        says="Cannot write to '/srv/data': path is outside the writable paths.",
    ),
    Row(
        id="policy_denied-an-environment-name-the-policy-does-not-pass",
        changes={"capabilities": {"env": ["AWS_SECRET_ACCESS_KEY"]}},
        env=("LANG",),
        code=ErrorCode.POLICY_DENIED,
        says="environment variable 'AWS_SECRET_ACCESS_KEY' is not allowed for this run; "
        "allowed: LANG (env.allow)",
    ),
    Row(
        id="internal-a-request-beyond-the-declaration",
        request=CapabilityRequest(exec=True),
        code=ErrorCode.INTERNAL,
        says="test.wordcount asked for running a command, which its manifest does not "
        "declare (exec: no)",
    ),
    Row(
        id="timeout-by-the-manifests-own-limit",
        args={"text": "slow", "nap": 2 * OWN_TIMEOUT_S},
        code=ErrorCode.TIMEOUT,
        says=f"test.wordcount ran past its own limit of {OWN_TIMEOUT_S:g} s per call "
        "(timeoutSeconds in its manifest) and was stopped",
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
async def test_a_new_runner_kind_is_checked_and_run_like_any_tool(
    row: Row, tmp_path: Path, autojump_clock: MockClock
) -> None:
    runner = ProcessRunner()
    tools = ToolRegistry((process_tool(runner, request=row.request, **row.changes),))
    log = FakeAuditLog()
    dispatcher = make_dispatcher(log, tools, autojump_clock)
    run = run_with_env(tmp_path, *row.env)
    started = autojump_clock.current_time()

    response = await dispatcher.handle(run, call("test.wordcount", row.args), PEER)

    assert [e["kind"] for e in log.entries] == ["call", "result"]
    if row.code is None:
        assert response.ok, response
        assert isinstance(response.value, msgspec.Raw)
        assert msgspec.json.decode(response.value) == {"words": 3}
        [ctx] = runner.seen
        assert [r.visible for r in ctx.resolved] == ["/workspace/data"]
        return
    assert (response.errorCode, response.safeMessage is not None) == (row.code, True)
    assert response.safeMessage is not None and row.says in response.safeMessage
    ran = row.code is ErrorCode.TIMEOUT
    assert len(runner.seen) == ran
    assert log.entries[0]["decision"] == ("allow" if ran else "deny")
    if ran:
        assert autojump_clock.current_time() - started == pytest.approx(OWN_TIMEOUT_S)


async def test_tools_list_shows_the_new_kinds_manifest(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    tools = ToolRegistry((process_tool(ProcessRunner()),))
    dispatcher = make_dispatcher(FakeAuditLog(), tools, autojump_clock)
    response = await dispatcher.handle(make_run(tmp_path), call("tools.list"), PEER)
    assert isinstance(response.value, msgspec.Raw)
    _, shown = msgspec.json.decode(response.value)
    assert shown == {
        **MANIFEST,
        "capabilities": {
            "files": [{"path": "/workspace/data", "mode": "rw"}],
            "network": [],
            "modelAccess": [],
            "env": [],
            "exec": False,
        },
        "limits": {"timeoutSeconds": OWN_TIMEOUT_S, "memoryBytes": 64 << 20, "fuel": None},
        "sideEffects": True,
    }


def test_dispatch_never_asks_what_kind_a_tool_is() -> None:
    source = inspect.getsource(gatewayd.dispatch)
    assert "RunnerKind" not in source
    assert "manifest.runner" not in source
