"""`gatewayd tools list|check|show` as an operator runs them: what each prints, its exit
status, and one line per problem (file, field, reason) for a bad folder, never a
traceback."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import wasmmodules as wm

GATEWAYD = str(Path(sys.executable).parent / "gatewayd")
COMMAND_TIMEOUT_S = 60


def manifest(name: str, **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "version": "1.0.0",
        "description": f"The tool {name}.",
        "input_schema": {"type": "object"},
        "runtime": "wasm",
        "entry": "tool.wasm",
        **fields,
    }


def folder(root: Path, name: str, data: dict[str, Any], module: bytes | None) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps(data))
    if module is not None:
        (path / "tool.wasm").write_bytes(module)
    return path


@pytest.fixture(scope="module")
def echo_module() -> bytes:
    return wm.wasm(wm.echo())


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    config = tmp_path / "gatewayd.yaml"
    config.write_text("")
    (tmp_path / "state").mkdir(mode=0o700)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")}
    return {
        **clean,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "GATEWAYD_CONFIG": str(config),
        "GATEWAYD_STATE_DIR": str(tmp_path / "state"),
        "GATEWAYD_TOOL_DIRS": str(tmp_path / "tools"),
    }


@pytest.fixture
def tools(tmp_path: Path, echo_module: bytes) -> Path:
    root = tmp_path / "tools"
    folder(root, "echo", manifest("text.echo"), echo_module)
    folder(
        root,
        "lines",
        manifest(
            "py.lines",
            runtime="process",
            entry=["python3", "/tool/lines.py"],
            capabilities={"filesystem": [{"path": "src", "access": "read", "optional": True}]},
        ),
        None,
    )
    return root


def gatewayd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [GATEWAYD, "tools", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=COMMAND_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    return done


def test_list_prints_each_tool_and_json_for_scripts(env: dict[str, str], tools: Path) -> None:
    done = gatewayd(env, "list")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"text.echo  wasm     1.0.0  {tools / 'echo'}",
        f"py.lines   process  1.0.0  {tools / 'lines'}",
    ]
    assert done.stderr == ""
    done = gatewayd(env, "list", "--json")
    assert json.loads(done.stdout) == [
        {"name": "text.echo", "runtime": "wasm", "version": "1.0.0", "folder": str(tools / "echo")},
        {
            "name": "py.lines",
            "runtime": "process",
            "version": "1.0.0",
            "folder": str(tools / "lines"),
        },
    ]


def test_check_compiles_the_modules_and_exits_0_when_all_are_valid(
    env: dict[str, str], tools: Path, tmp_path: Path
) -> None:
    done = gatewayd(env, "check")
    assert done.returncode == 0, done.stderr
    assert f"ok: text.echo (wasm, 1.0.0) in {tools / 'echo'}" in done.stdout
    assert "2 valid tool(s)" in done.stdout
    # The compiled module is in the daemon's cache now (warmed for its first call).
    assert list((tmp_path / "state" / "wasm-cache").iterdir())


def test_check_names_each_problem_and_exits_1(
    env: dict[str, str], tools: Path, tmp_path: Path
) -> None:
    folder(tools, "bad", manifest("text.bad", version=2), b"")
    folder(tools, "notwasm", manifest("text.notwasm"), b"this is not a wasm module")
    folder(tools, "clash", manifest("fs.read"), b"")
    (tools / "link").symlink_to(tools / "echo")
    done = gatewayd(env, "check")
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert f"{tools / 'bad' / 'manifest.json'}: version: 2 is not of type 'string'" in lines
    assert any(
        line.startswith(f"{tools / 'clash' / 'manifest.json'}: name: 'fs.read' is the name of")
        for line in lines
    )
    assert any(line.startswith(f"{tools / 'link'}: is a symlink") for line in lines)
    assert any(
        line.startswith(f"{tools / 'notwasm' / 'manifest.json'}: entry: ") for line in lines
    ), lines
    assert "4 problem(s), 2 valid tool(s)" in done.stderr
    # list shows what a daemon would register (it compiles nothing: a module that is
    # not wasm fails its calls), and says that others were skipped.
    done = gatewayd(env, "list")
    assert done.returncode == 0
    listed = [line.split()[0] for line in done.stdout.splitlines()]
    assert listed == ["text.echo", "py.lines", "text.notwasm"]
    assert "3 folder(s) skipped; `gatewayd tools check` says why" in done.stderr


def test_check_takes_one_folder_or_another_directory(
    env: dict[str, str], tools: Path, tmp_path: Path, echo_module: bytes
) -> None:
    absent_state = tmp_path / "no-daemon-yet"
    done = gatewayd({**env, "GATEWAYD_STATE_DIR": str(absent_state)}, "check", str(tools / "echo"))
    assert done.returncode == 0, done.stderr
    assert "1 valid tool(s)" in done.stdout
    assert not absent_state.exists()  # the daemon makes its state directory, not a check
    other = tmp_path / "other"
    folder(other, "x", manifest("text.x", capabilities={"network": ["a.org"]}), echo_module)
    done = gatewayd(env, "check", str(other))
    assert done.returncode == 1
    assert "capabilities.network: a wasm tool has no sockets" in done.stderr


def test_show_prints_one_tool_as_loaded(
    env: dict[str, str], tools: Path, echo_module: bytes
) -> None:
    done = gatewayd(env, "show", "py.lines")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["name"] == "py.lines"
    assert shown["entry"] == ["python3", "/tool/lines.py"]
    assert shown["needs"]["filesystem"] == [
        {"path": "/workspace/src", "mode": "ro", "optional": True}
    ]
    assert shown["manifest"]["capabilities"]["exec"] is True
    assert shown["manifestDigest"].startswith("sha256:")
    done = gatewayd(env, "show", "text.echo")
    assert (
        json.loads(done.stdout)["entryDigest"]
        == "sha256:" + hashlib.sha256(echo_module).hexdigest()
    )


def test_show_of_an_unknown_tool_exits_1_naming_the_tools(env: dict[str, str], tools: Path) -> None:
    done = gatewayd(env, "show", "text.nope")
    assert done.returncode == 1
    assert "no tool named 'text.nope'" in done.stderr
    assert "tools: text.echo, py.lines" in done.stderr


def test_without_tool_dirs_there_is_nothing_to_list_or_check(env: dict[str, str]) -> None:
    del env["GATEWAYD_TOOL_DIRS"]
    assert gatewayd(env, "list").stdout == "no tool directories configured (tool_dirs)\n"
    done = gatewayd(env, "check")
    assert done.returncode == 0
    assert "nothing to check" in done.stdout
