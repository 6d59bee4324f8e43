"""`gatewayd tools run NAME ARGS --workspace W` as an operator runs it: the examples of
examples/tools/ (built by ``make tools``) in a configured tool directory, one call each
through an in-process daemon; the answer on stdout, errors with cogni-tool's exit codes,
the overlay's diff shown and discarded unless ``--commit``, the call in the audit log."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.exampletools import copy_examples
from tests.fakeprovider import FakeProvider, Text, provider_with_key
from tests.unit.test_cli_imports import WRAPPER, assert_light, clean_env

BIN = Path(sys.executable).parent
GATEWAYD = str(BIN / "gatewayd")
KEY_ENV = "COGNI_TEST_TOOLS_RUN_KEY"
KEY = "sk-tools-run-host-only-0123456789"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the overlay workspace and the runs' sandboxes need root"
)


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-trun-", dir="/tmp"))
    path.chmod(0o711)  # a sandboxed run's uid passes through to its workspace
    try:
        copy_examples(path / "tools")
        (path / "ws" / "src").mkdir(parents=True)
        (path / "ws" / "src" / "a.txt").write_text("one\ntwo\nthree\n")
        (path / "ws" / "out").mkdir()
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write_config(base: Path, **more: Any) -> Path:
    config = {
        "state_dir": str(base / "state"),
        "tool_dirs": [str(base / "tools")],
        "netns_prefix": f"cgr{secrets.token_hex(4)}-",
        "sandbox_uids": {"base": 1_720_000_000 + secrets.randbelow(50_000) * 1024, "count": 64},
        "audit_fsync": False,
        **more,
    }
    path = base / "gatewayd.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def tools_run(
    base: Path,
    name: str,
    args: str,
    *extra: str,
    sandbox: bool = False,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    config = base / "gatewayd.yaml"
    if not config.exists():
        write_config(base)
    argv = [GATEWAYD, "tools", "run", name, args, "--workspace", str(base / "ws")]
    argv += ["--config", str(config), *extra]
    if not sandbox:  # wasm tools run inside gatewayd: the run needs no OS sandbox
        argv.append("--no-os-sandbox")
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", **(env or {})},
        stdin=subprocess.DEVNULL,
        timeout=120,
        check=False,
    )


def test_the_answer_is_printed_as_json_and_the_call_is_audited(base: Path) -> None:
    done = tools_run(base, "text.wordcount", '{"text": "one two three"}')
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"words": 3, "lines": 1, "chars": 13, "bytes": 13}
    assert "calling text.wordcount (wasm, 1.0.0)" in done.stderr
    entries = [
        json.loads(line) for line in (base / "state/audit/audit.jsonl").read_text().splitlines()
    ]
    calls = [e for e in entries if e.get("kind") == "call" and e.get("tool") == "text.wordcount"]
    assert len(calls) == 1 and calls[0]["detail"]["entryDigest"].startswith("sha256:")
    assert f"audit log {base / 'state/audit/audit.jsonl'}" in done.stderr


def test_a_call_loads_only_the_libraries_its_run_can_reach(base: Path) -> None:
    # A one-shot daemon: the wasm tool's engine and its schema's library (a tool folder's),
    # not every tool's (http.fetch's HTTP libraries, the apps' markdown-it).
    listing = base / "modules.txt"
    config = write_config(base)
    argv = ["tools", "run", "text.wordcount", '{"text": "a b"}', "--workspace", str(base / "ws")]
    done = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(listing), *argv, "--config", str(config)],
        capture_output=True,
        text=True,
        env={**clean_env(), "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        stdin=subprocess.DEVNULL,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["words"] == 2
    modules = set(listing.read_text().split())
    assert {"wasmtime", "jsonschema"} <= modules
    assert_light(modules, frozenset({"httpx", "httpcore", "h11", "markdown_it", "litellm"}))


def test_an_overlay_shows_the_tools_changes_and_drops_them(base: Path) -> None:
    done = tools_run(base, "files.write", '{"path": "n/x.txt", "content": "made\\n"}')
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["path"] == "/workspace/out/n/x.txt"
    assert "+++ b/out/n/x.txt" in done.stderr and "+made" in done.stderr
    assert "changes discarded" in done.stderr
    assert list((base / "ws" / "out").iterdir()) == []  # the workspace as it was


def test_commit_applies_the_overlays_changes_to_the_workspace(base: Path) -> None:
    done = tools_run(base, "files.write", '{"path": "x.txt", "content": "kept\\n"}', "--commit")
    assert done.returncode == 0, done.stderr
    assert "changes committed" in done.stderr
    assert (base / "ws" / "out" / "x.txt").read_text() == "kept\n"


def test_commit_never_writes_git_metadata_into_the_workspace(base: Path) -> None:
    done = tools_run(
        base,
        "files.write",
        '{"path": ".git/hooks/pre-commit", "content": "#!/bin/sh\\nid\\n"}',
        "--commit",
    )
    assert done.returncode == 0, done.stderr
    assert "left out of the commit: out/.git: git metadata" in done.stderr
    assert "changes committed" in done.stderr
    assert not (base / "ws" / "out" / ".git").exists()


def test_a_configured_agentfs_mode_keeps_the_tools_changes_in_an_overlay(base: Path) -> None:
    write_config(base, workspace_mode="agentfs")
    done = tools_run(base, "files.write", '{"path": "a.txt", "content": "virtual\\n"}')
    assert done.returncode == 0, done.stderr
    assert "workspace_mode agentfs: `tools run` keeps the tool's changes in an overlay" in (
        done.stderr
    )
    assert "+virtual" in done.stderr and "changes discarded" in done.stderr
    assert list((base / "ws" / "out").iterdir()) == []  # never written during the call


def test_host_mode_writes_the_workspace_itself(base: Path) -> None:
    done = tools_run(
        base,
        "files.write",
        '{"path": "h.txt", "content": "direct\\n"}',
        "--workspace-mode",
        "host",
    )
    assert done.returncode == 0, done.stderr
    assert "+direct" not in done.stderr  # no overlay, no diff
    assert (base / "ws" / "out" / "h.txt").read_text() == "direct\n"


@pytest.mark.parametrize(
    ("name", "args", "extra", "status", "said"),
    [
        ("text.nope", "{}", (), 14, "unknown_tool: no tool 'text.nope' in the tool directories"),
        ("text.wordcount", '{"txt": "x"}', (), 16, "invalid_args: "),
        ("text.summarize", '{"text": "x"}', (), 15, "policy_denied: "),
        ("files.search", '{"query": "x", "path": "../.."}', (), 20, 'may not contain ".."'),
        ("text.wordcount", "[1]", (), 2, "ARGS must be a JSON object"),
        ("text.wordcount", '{"text": 1', (), 2, "ARGS is not JSON"),
        ("text.wordcount", "{}", ("--commit", "--workspace-mode", "host"), 2, "--commit"),
    ],
)
def test_errors_say_why_and_exit_with_cogni_tools_codes(
    base: Path, name: str, args: str, extra: tuple[str, ...], status: int, said: str
) -> None:
    done = tools_run(base, name, args, *extra)
    assert done.returncode == status, done.stderr
    assert said in done.stderr
    assert done.stdout == ""


def test_a_model_alias_gatewayd_does_not_define_is_named(base: Path) -> None:
    done = tools_run(base, "text.summarize", '{"text": "x"}')
    assert done.returncode == 15, done.stderr
    assert "declares model alias(es) default that gatewayd's configuration" in done.stderr


def test_the_model_example_asks_the_configured_model(base: Path) -> None:
    with provider_with_key(KEY_ENV, KEY) as fake:
        fake.script(Text(content="Three numbers.", prompt_tokens=9, completion_tokens=3))
        models = {
            "default": {
                "provider": "openai",
                "model": "fake-chat",
                "api_base": fake.api_base,
                "api_key_env": KEY_ENV,
            }
        }
        write_config(base, models=models)
        done = tools_run(base, "text.summarize", '{"text": "one two three"}', env={KEY_ENV: KEY})
        requests = _sent(fake)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["summary"] == "Three numbers." and answer["model"] == "default"
    assert requests == [f"Bearer {KEY}"]
    assert KEY not in done.stdout + done.stderr


def _sent(fake: FakeProvider) -> list[str | None]:
    return [request.authorization for request in fake.chat_requests]


@pytest.mark.skipif(
    not os.path.exists("/usr/bin/bwrap") or not os.path.exists("/usr/bin/python3"),
    reason="the process example runs in a bubblewrap sandbox with the system python3",
)
def test_the_process_example_runs_in_the_runs_sandbox(base: Path) -> None:
    done = tools_run(base, "files.lines", '{"paths": ["src/a.txt", "out/none.txt"]}', sandbox=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "files": [
            {"path": "/workspace/src/a.txt", "lines": 3},
            {"path": "/workspace/out/none.txt", "error": "No such file or directory"},
        ],
        "total": 3,
    }
