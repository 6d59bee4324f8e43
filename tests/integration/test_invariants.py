"""DESIGN.md invariants 1, 2, 5, 6, 8 and 10, each over real sockets."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import pydantic
import pytest
import trio

from cogni_tool.client import Client, ToolError
from gatewayd.audit import verify_file
from gatewayd.config import GatewaydConfig
from gatewayd.runs import RunRequest
from tests.conftest import ROOT, Gateway, frame, raw_exchange, request


async def call(run: Any, tool: str, args: dict[str, Any] | None = None) -> Any:
    def go() -> Any:
        with Client(str(run.socket_path), run.run_id) as client:
            return client.call(tool, args or {})

    return await trio.to_thread.run_sync(go)


# 1 HOST_GENERATED_RUN_ID


def test_a_run_request_carrying_a_run_id_is_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="assigned by gatewayd"):
        RunRequest.model_validate(
            {
                "runId": "attacker-chosen",
                "workspacePath": "/",
                "policy": "demo",
                "actorId": "a",
                "tenantId": "t",
                "grant": {"allowSandbox": True},
            }
        )


async def test_run_ids_are_fresh_128_bit_values_made_by_gatewayd(
    gateway: Gateway, workspace: Path
) -> None:
    ids = {(await gateway.create_run(workspace)).run_id for _ in range(20)}
    assert len(ids) == 20
    for run_id in ids:
        assert re.fullmatch(r"[0-9a-f]{32}", run_id), run_id  # 32 hex chars = 128 bits
    # random, not a counter or a clock: every position varies across 20 ids
    assert all(len({r[i] for r in ids}) > 1 for i in range(32))


# 2 ONE_SOCKET_PER_RUN


async def test_each_run_has_its_own_socket_in_a_private_directory(
    gateway: Gateway, workspace: Path
) -> None:
    a = await gateway.create_run(workspace)
    b = await gateway.create_run(workspace)
    assert a.socket_path != b.socket_path
    for run in (a, b):
        st = os.stat(run.directory)
        assert stat.S_IMODE(st.st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(run.socket_path).st_mode)
        assert stat.S_IMODE(os.stat(run.socket_path).st_mode) == 0o600
    # runs/ can be passed through (a sandbox's uid reaches its own run's directory, which
    # is 0710 root:<run gid>; see test_run_sandbox.py) but listed by nobody but root.
    assert stat.S_IMODE(os.stat(gateway.daemon.registry.runs_dir).st_mode) == 0o711
    # a's socket serves only a: b's id is refused there.
    [resp] = await raw_exchange(a.socket_path, frame(request(b, "time.now")))
    assert resp["errorCode"] == "run_mismatch"


async def test_ending_a_run_removes_its_socket_and_directory(
    gateway: Gateway, workspace: Path
) -> None:
    run = await gateway.create_run(workspace)
    summary = await gateway.daemon.runs.end(run.run_id)
    assert summary is not None and summary["state"] == "ended"
    assert not run.directory.exists()
    with pytest.raises(OSError):
        await trio.open_unix_socket(str(run.socket_path))
    ended = [e for e in (await gateway.audit_entries()) if e.get("event") == "run_ended"]
    assert ended and ended[0]["runId"] == run.run_id


# 5 SINGLE_CHOKEPOINT and 8 APPEND_ONLY_AUDIT


async def test_every_call_leaves_a_call_and_a_result_entry_and_the_chain_verifies(
    gateway: Gateway, workspace: Path
) -> None:
    run = await gateway.create_run(workspace)
    ok_calls = [("time.now", {}), ("fs.read", {"path": "notes.md"}), ("fs.list", {})]
    bad_calls = [("fs.read", {"path": "/etc/shadow"}), ("nope.tool", {}), ("fs.read", {})]
    for tool, args in ok_calls:
        await call(run, tool, args)
    for tool, args in bad_calls:
        with pytest.raises(ToolError):
            await call(run, tool, args)
    await raw_exchange(run.socket_path, frame(b"garbage"))
    entries = [e for e in (await gateway.audit_entries()) if e.get("runId") == run.run_id]
    calls = [e for e in entries if e["kind"] == "call"]
    results = [e for e in entries if e["kind"] == "result"]
    assert len(calls) == len(results) == len(ok_calls) + len(bad_calls) + 1
    assert [e["decision"] for e in calls].count("allow") == len(ok_calls)
    for e in calls:
        assert e["peer"]["pid"] > 0 and e["peer"]["uid"] == os.getuid()
    # calls were sequential: each write-ahead entry is directly followed by its result
    kinds = [e["kind"] for e in entries if e["kind"] in ("call", "result")]
    assert kinds == ["call", "result"] * len(calls)
    assert verify_file(gateway.audit_path).ok


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tiny tmpfs needs root")
async def test_no_effect_happens_when_the_audit_entry_cannot_be_made_durable(
    short_tmp: Path, workspace: Path
) -> None:
    """Fill the audit log's filesystem for real: the write must not happen."""
    from gatewayd.daemon import open_daemon

    small = short_tmp / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], check=True)
    try:
        policies = short_tmp / "pol"
        policies.mkdir()
        config = GatewaydConfig(
            state_dir=short_tmp / "state",
            audit_path=small / "audit.jsonl",
            policy_dirs=(policies,),
            # The effect that must not happen is looked for in the workspace itself.
            workspace_mode="host",
        )
        async with open_daemon(config, preload=True) as daemon:
            gw = Gateway(daemon, policies)
            run = await gw.create_run(workspace)
            filler = small / "filler"
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
            try:  # take every free block
                while os.write(fd, b"\0" * 4096):
                    pass
            except OSError:
                pass
            finally:
                os.close(fd)
            # The audit file's last page may still have room for a few entries: call
            # until the log is really full, then the failed call must have no effect.
            failure: ToolError | None = None
            for i in range(100):
                try:
                    await call(run, "fs.write", {"path": f"effect{i}.txt", "content": "x"})
                except ToolError as exc:
                    failure = exc
                    break
                assert (workspace / f"effect{i}.txt").exists()
            assert failure is not None, "the audit log never filled up"
            assert failure.code == "internal" and "audit" in str(failure)
            # The failing write was either the call entry (then no effect may have
            # happened) or the result entry after a durable call entry.
            logged = (
                f'"argsSummary":{{"path":"effect{i}.txt"'
                in config.resolved_audit_path.read_text(errors="replace")
            )
            assert (workspace / f"effect{i}.txt").exists() == logged
            # Once the log has failed, nothing runs at all: fail closed.
            with pytest.raises(ToolError) as info:
                await call(run, "fs.write", {"path": "after.txt", "content": "x"})
            assert info.value.code == "internal"
            assert not (workspace / "after.txt").exists(), "an unaudited effect happened"
            filler.unlink()
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


# 6 DENY_BY_DEFAULT


async def test_the_shipped_default_policy_allows_nothing(gateway: Gateway, workspace: Path) -> None:
    text = (ROOT / "policies" / "default.yaml").read_text()
    run = await gateway.create_run(workspace, text)
    listing = await call(run, "tools.list")
    assert [t["name"] for t in listing] == ["tools.list"]
    for tool, args in [
        ("time.now", {}),
        ("fs.read", {"path": "notes.md"}),
        ("fs.write", {"path": "a.txt", "content": "x"}),
    ]:
        with pytest.raises(ToolError) as info:
            await call(run, tool, args)
        assert info.value.code == "policy_denied"
        assert "allows no tools" in str(info.value)


async def test_tools_list_shows_only_allowed_tools_with_json_schemas(
    gateway: Gateway, workspace: Path
) -> None:
    run = await gateway.create_run(workspace, tool_ids=("fs.read", "time.now"))
    listing = await call(run, "tools.list")
    assert [t["name"] for t in listing] == ["tools.list", "fs.read", "time.now"]
    fs_read = listing[1]
    schema = json.dumps(fs_read["argsSchema"])
    assert "path" in schema and "limit" in schema


# 10 ACTIONABLE_ERRORS


async def test_denials_say_what_is_allowed(gateway: Gateway, workspace: Path) -> None:
    run = await gateway.create_run(workspace)
    cases = {
        ("fs.write", "docs/new.md"): ["read-only", "Writable paths", "/workspace"],
        ("fs.write", "notes.exe"): ["suffix", ".md", ".txt", ".json"],
        ("fs.read", "/etc/hosts"): ["outside", "Readable paths", "/workspace", "/workspace/docs"],
    }
    for (tool, path), needles in cases.items():
        args: dict[str, Any] = {"path": path}
        if tool == "fs.write":
            args["content"] = "x"
        with pytest.raises(ToolError) as info:
            await call(run, tool, args)
        assert info.value.code == "policy_denied"
        for needle in needles:
            assert needle in str(info.value), (path, needle, str(info.value))
    (workspace / "big.txt").write_text("x" * 200_000)
    with pytest.raises(ToolError) as info:
        await call(run, "fs.read", {"path": "big.txt"})
    assert info.value.code == "policy_denied"
    assert "200000" in str(info.value) and "100000" in str(info.value)
