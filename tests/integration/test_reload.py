"""A live `gatewayd serve` reloads on SIGHUP and stops cleanly on SIGTERM, both while a
client keeps calling: real daemon process, real run socket, real signals."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cogni_tool.client import Client, CogniToolError, ToolError
from tests.livedaemon import BIN, LiveDaemon, start_daemon

POLICY = """
version: 1
name: reloadable
require_os_sandbox: false
tools:
  allow: [time.now, fs.read]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits: {calls_per_second: 100000, burst: 100000, max_concurrent_calls: 64}
"""


@pytest.fixture
def base(short_tmp: Path) -> Path:
    (short_tmp / "ws").mkdir()
    (short_tmp / "ws" / "notes.md").write_text("hello\n")
    return short_tmp


@pytest.fixture
def daemon(base: Path) -> Iterator[LiveDaemon]:
    live = start_daemon(base / "state")
    try:
        yield live
    finally:
        live.stop()


class Caller(threading.Thread):
    """Calls time.now in a loop on one connection; records every outcome."""

    def __init__(self, socket: str, run_id: str) -> None:
        super().__init__(daemon=True)
        self.client = Client(socket, run_id, timeout=10)
        self.stop = threading.Event()
        self.answered = 0
        self.failures: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.client.call("time.now")
                self.answered += 1
            except ToolError as exc:
                self.failures.append(f"{exc.code}: {exc.safe_message}")
            except CogniToolError as exc:  # the connection itself: a lost call
                self.failures.append(f"lost: {exc}")
                return


def entries(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_sighup_applies_a_changed_policy_to_a_live_run_without_losing_a_call(
    base: Path, daemon: LiveDaemon
) -> None:
    policy = base / "policy.yaml"
    policy.write_text(POLICY)
    run = daemon.create_run(base / "ws", policy)
    reader = Client(run["socket"], run["runId"])
    assert reader.call("fs.read", {"path": "notes.md"})["content"] == "hello\n"
    caller = Caller(run["socket"], run["runId"])
    caller.start()
    try:
        time.sleep(0.2)
        policy.write_text(POLICY.replace("[time.now, fs.read]", "[time.now]"))
        daemon.proc.send_signal(signal.SIGHUP)
        denial = _first_denial(reader, time.monotonic() + 10)
        assert denial.code == "policy_denied" and "fs.read" in denial.safe_message
        time.sleep(0.2)
    finally:
        caller.stop.set()
        caller.join(10)
    assert caller.failures == [] and caller.answered > 10
    assert daemon.stop() == 0  # every queued result entry written
    log = entries(daemon.audit_path)
    reloaded = [e for e in log if e.get("event") == "policy_reloaded"]
    assert reloaded[0]["runId"] == run["runId"]
    assert reloaded[0]["detail"]["changed"] == ["tools"]
    assert [e for e in log if e.get("event") == "config_reloaded"]
    # Every time.now call the caller sent has its result on the record.
    results = [e for e in log if e.get("kind") == "result" and e.get("tool") == "time.now"]
    assert len(results) >= caller.answered


def test_sighup_keeps_a_live_runs_policy_when_its_sandbox_sections_changed_or_it_is_broken(
    base: Path, daemon: LiveDaemon
) -> None:
    policy = base / "policy.yaml"
    policy.write_text(POLICY)
    run = daemon.create_run(base / "ws", policy)
    client = Client(run["socket"], run["runId"])
    policy.write_text(POLICY.replace("[time.now, fs.read]", "[time.now]") + "env: {allow: [TZ]}\n")
    daemon.proc.send_signal(signal.SIGHUP)
    _wait_for_event(daemon, "policy_reload_skipped")
    assert client.call("fs.read", {"path": "notes.md"})["content"] == "hello\n"  # old policy
    policy.write_text("version: 1\nname: [not a name\n")
    daemon.proc.send_signal(signal.SIGHUP)
    failed = _wait_for_event(daemon, "policy_reload_failed")
    assert "policy.yaml" in failed["safeMessage"]
    skipped = _wait_for_event(daemon, "policy_reload_skipped")
    assert "env changed" in skipped["safeMessage"] and "new runs" in skipped["safeMessage"]
    assert client.call("fs.read", {"path": "notes.md"})["content"] == "hello\n"
    assert daemon.alive()


def _first_denial(client: Client, deadline: float) -> ToolError:
    while time.monotonic() < deadline:
        try:
            client.call("fs.read", {"path": "notes.md"})
        except ToolError as exc:
            return exc
        time.sleep(0.02)
    raise AssertionError("the reloaded policy never took effect")


def _wait_for_event(daemon: LiveDaemon, event: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [e for e in entries(daemon.audit_path) if e.get("event") == event]
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"no {event} entry in the audit log")


def test_sigterm_under_load_ends_runs_and_leaves_a_log_that_verifies(base: Path) -> None:
    daemon = start_daemon(base / "state")
    policy = base / "policy.yaml"
    policy.write_text(POLICY)
    callers: list[Caller] = []
    try:
        run = daemon.create_run(base / "ws", policy)
        callers = [Caller(run["socket"], run["runId"]) for _ in range(4)]
        for caller in callers:
            caller.start()
        time.sleep(0.5)
        assert daemon.stop() == 0  # SIGTERM while four connections are calling
    finally:
        for caller in callers:
            caller.stop.set()
            caller.join(10)
    assert sum(c.answered for c in callers) > 20
    done = subprocess.run(
        [str(BIN / "gatewayd"), "audit", "verify", str(daemon.audit_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    log = entries(daemon.audit_path)
    assert log[-1]["event"] == "audit_close"
    ended = [e for e in log if e.get("event") == "run_ended"]
    assert ended and ended[-1]["detail"]["reason"] == "daemon_stopping"
    # Every call on the record was answered on the record: no call without its result.
    calls = {e["toolCallId"] for e in log if e.get("kind") == "call"}
    results = {e["toolCallId"] for e in log if e.get("kind") == "result"}
    assert calls == results


def test_sighup_rereads_model_aliases_and_says_what_needs_a_restart(base: Path) -> None:
    config = base / "gatewayd.yaml"
    alias = "{provider: openai, model: m1, api_base: 'http://127.0.0.1:9/v1', api_key_env: K1}"
    config.write_text(f"models:\n  one: {alias}\n")
    daemon = start_daemon(base / "state", "--config", str(config))
    try:
        config.write_text(f"models:\n  one: {alias}\n  two: {alias.replace('m1', 'm2')}\n")
        daemon.proc.send_signal(signal.SIGHUP)
        first = _wait_for_event(daemon, "config_reloaded")
        assert first["detail"]["models"] == ["one", "two"] and first["detail"]["modelsChanged"]
        assert first["detail"]["restartNeeded"] == []
        # An alias with a key variable gatewayd did not scrub from the start: not applied.
        three = alias.replace("m1", "m3").replace("K1", "K3")
        config.write_text(f"models:\n  one: {alias}\n  three: {three}\n")
        daemon.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while len(_events(daemon, "config_reloaded")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        second = _events(daemon, "config_reloaded")[-1]
        assert second["detail"]["models"] == ["one", "two"]  # unchanged
        assert "new key variable" in second["detail"]["restartNeeded"][0]
        config.write_text("models: [not, a, mapping]\n")
        daemon.proc.send_signal(signal.SIGHUP)
        failed = _wait_for_event(daemon, "config_reload_failed")
        assert "gatewayd.yaml" in failed["safeMessage"]
        assert daemon.alive()
    finally:
        daemon.stop()


def _events(daemon: LiveDaemon, event: str) -> list[dict[str, Any]]:
    return [e for e in entries(daemon.audit_path) if e.get("event") == event]


async def test_a_reload_reads_the_configuration_off_the_event_loop(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reading and validating the files may import (a witness's key loads cryptography):
    # never on the loop that serves the live runs' calls. A bad file still changes
    # nothing but the log and the audit.
    from gatewayd.cli import serve
    from tests.conftest import make_gateway

    read_by: list[int] = []

    def unreadable(_args: argparse.Namespace) -> None:
        read_by.append(threading.get_ident())
        raise SystemExit("gatewayd: the configuration file is broken")

    monkeypatch.setattr(serve, "config_from_options", unreadable)
    async with make_gateway(short_tmp) as gw:
        await serve._reload(gw.daemon, argparse.Namespace())
        entries = await gw.audit_entries()
    assert len(read_by) == 1 and read_by[0] != threading.get_ident()
    failed = [e for e in entries if e.get("event") == "config_reload_failed"]
    assert [e.get("safeMessage") for e in failed] == [
        "gatewayd: the configuration file is broken"
    ], entries[-3:]
