"""The policy `gatewayd tools run` makes for its one call: the tool and W, plus exactly
what the tool's manifest declares that gatewayd can grant, and a policy the policy
loader accepts."""

from __future__ import annotations

import json
from pathlib import Path

from gatewayd.cli.tools_run import one_shot_policy
from gatewayd.config import GatewaydConfig, ModelAlias
from gatewayd.policy.capabilities import Capabilities, FileCapability
from gatewayd.policy.model import load_policy_text
from gatewayd.policy.paths import PathMode
from gatewayd.tools.manifest import RunnerKind, ToolLimits, ToolManifest


def manifest(runner: RunnerKind = RunnerKind.WASM, **caps: object) -> ToolManifest:
    return ToolManifest(
        name="text.example",
        version="1.0.0",
        summary="an example",
        args_schema={"type": "object"},
        runner=runner,
        capabilities=Capabilities(**caps),  # type: ignore[arg-type]
        limits=ToolLimits(timeout_s=7),
    )


def config(*aliases: str) -> GatewaydConfig:
    models = {
        a: ModelAlias(provider="openai", model="m", api_base="http://127.0.0.1:9") for a in aliases
    }
    return GatewaydConfig(state_dir=Path("/tmp/never-made"), models=models)


def test_a_bare_wasm_tool_gets_itself_the_workspace_and_its_own_timeout() -> None:
    policy = one_shot_policy(manifest(), config())
    loaded = load_policy_text(json.dumps(policy), "tools run")
    assert loaded.tools.allow == ("text.example",)
    (rule,) = loaded.filesystem.paths.values()
    assert (rule.root, rule.mode) == (".", "rw")
    assert loaded.limits.call_timeout_s == 7
    assert loaded.require_os_sandbox is False  # a wasm tool runs inside gatewayd
    assert loaded.model_access.models == () and loaded.network.allow_domains == ()
    assert loaded.env.allow == ()


def test_what_the_manifest_declares_is_granted_and_nothing_gatewayd_cannot_give() -> None:
    declared = manifest(
        RunnerKind.PROCESS,
        files=(FileCapability(path="/workspace/src", mode=PathMode.RO),),
        model_access=("default", "missing"),
        network=("api.example.com",),
        env=("LANG",),
        exec=True,
    )
    loaded = load_policy_text(json.dumps(one_shot_policy(declared, config("default"))), "x")
    assert loaded.model_access.models == ("default",)  # "missing" is no configured alias
    assert loaded.tools.allow == ("text.example", "model.chat")  # its model requests
    assert loaded.network.allow_domains == ("api.example.com",)
    assert loaded.network.proxy.enabled  # the call's own proxy needs the run's turned on
    assert loaded.env.allow == ("LANG",)
    assert loaded.require_os_sandbox is True  # a process tool runs in the OS sandbox
