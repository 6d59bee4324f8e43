"""gatewayd's configuration as an operator uses it: one file, GATEWAYD_<NAME> variables
over it, options over both, on the real `gatewayd run`, `serve`, `rules` and `config`
commands."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import OPEN_POLICY, write_policy
from tests.unit.test_config import write

GATEWAYD = str(Path(sys.executable).parent / "gatewayd")


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")}
    return {**env, "LITELLM_LOCAL_MODEL_COST_MAP": "True", **extra}


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-cfg-", dir="/tmp"))
    (path / "ws" / "docs").mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def gw(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GATEWAYD, *argv], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def test_run_writes_its_audit_where_the_option_else_variable_else_file_says(base: Path) -> None:
    """The audit log of a real one-shot run lands where the winning layer says."""
    policy = write_policy(base, OPEN_POLICY)
    config = base / "gatewayd.yaml"
    config.write_text(
        f"state_dir: {base / 'state'}\naudit_path: {base / 'file.jsonl'}\nos_sandbox: false\n"
    )
    run = ("run", "--policy", str(policy), "--workspace", str(base / "ws"), "--", "true")
    env = environment(GATEWAYD_CONFIG=str(config))
    for extra_env, options, expected in (
        ({}, (), base / "file.jsonl"),
        ({"GATEWAYD_AUDIT_PATH": str(base / "env.jsonl")}, (), base / "env.jsonl"),
        (
            {"GATEWAYD_AUDIT_PATH": str(base / "env.jsonl")},
            ("--audit", str(base / "option.jsonl")),
            base / "option.jsonl",
        ),
    ):
        done = gw(*run[:1], *options, *run[1:], env={**env, **extra_env})
        assert done.returncode == 0, done.stderr
        assert f"gatewayd: audit log {expected}" in done.stderr
        assert expected.is_file()
        # os_sandbox: false came from the file: the run is marked degraded.
        assert "NO OS sandbox" in done.stderr
    assert (base / "state" / "runs").is_dir()  # the file's state_dir


def test_a_bad_variable_stops_the_run_before_anything_starts(base: Path) -> None:
    policy = write_policy(base, OPEN_POLICY)
    done = gw(
        "run",
        "--state-dir",
        str(base / "state"),
        "--policy",
        str(policy),
        "--workspace",
        str(base / "ws"),
        "--",
        "true",
        env=environment(GATEWAYD_NETNS_PREFIX="Not A Prefix"),
    )
    assert done.returncode == 1
    assert "gatewayd: bad configuration: GATEWAYD_NETNS_PREFIX: namespace prefix" in done.stderr
    assert not (base / "state").exists()


def test_serve_and_rules_find_the_control_socket_from_the_configuration(base: Path) -> None:
    socket = base / "sockets" / "control.sock"
    socket.parent.mkdir()
    config = base / "gatewayd.yaml"
    config.write_text(f"state_dir: {base / 'state'}\ncontrol_socket: {socket}\n")
    env = environment(GATEWAYD_CONFIG=str(config), GATEWAYD_OS_SANDBOX="false")
    log = (base / "serve.log").open("wb")
    proc = subprocess.Popen([GATEWAYD, "serve"], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            pending = gw("rules", "pending", env=env)  # no option: the file's socket
            if pending.returncode == 0 or time.monotonic() > deadline or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert pending.returncode == 0, pending.stderr + (base / "serve.log").read_text()
        assert socket.is_socket()
        assert not (base / "state" / "control.sock").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def test_config_show_and_check_as_commands(base: Path) -> None:
    config = base / "gatewayd.yaml"
    config.write_text("netns_prefix: file-\nmodels: {r: {provider: openai, model: m}}\n")
    env = environment(GATEWAYD_CONFIG=str(config), GATEWAYD_MAX_FRAME_BYTES="4096")
    done = gw("config", "show", "--json", "--sandbox-uids", "1700000000+8", env=env)
    assert done.returncode == 0, done.stderr
    settings = json.loads(done.stdout)["settings"]
    assert settings["netns_prefix"]["source"] == f"file {config}"
    assert settings["max_frame_bytes"] == {"value": 4096, "source": "env GATEWAYD_MAX_FRAME_BYTES"}
    assert settings["sandbox_uids"]["source"] == "option --sandbox-uids"
    assert gw("config", "check", str(config), env=env).returncode == 0
    config.write_text("netns_prefx: file-\n")
    done = gw("config", "check", str(config), env=env)
    assert done.returncode == 1 and "did you mean 'netns_prefix'?" in done.stderr
    assert gw("config", "check", env=env).returncode == 2


# A bad file refused by `gatewayd run` (tests/unit/test_config.py: the same file refused
# by the loader itself).
def test_the_cli_refuses_a_bad_config_with_the_problem(tmp_path: Path) -> None:
    path = write(tmp_path, "models: {r: {provider: openai}}")
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "gatewayd"),
            "run",
            "--config",
            str(path),
            "--state-dir",
            str(tmp_path / "state"),
            "--policy",
            "demo",
            "--workspace",
            str(tmp_path),
            "--",
            "true",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0
    assert "gatewayd: bad configuration:" in done.stderr and "models.r.model" in done.stderr
