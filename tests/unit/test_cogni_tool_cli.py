"""The cogni-tool command line, run as a real subprocess against the fake gateway.

Every exit status in the documented table is produced here by a real process, because
scripts in the sandbox branch on those numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

import cogni_tool
from cogni_tool import cli, client
from cogni_tool.client import EXIT_CODES, WIRE_EXIT_CODES
from gatewayd import protocol
from tests.unit.test_cogni_tool_client import RUN_ID, TOOLS, FakeGateway, fake_gateway

REPO_ROOT = Path(__file__).resolve().parents[2]

# The contract other programs rely on (docs/cogni-tool.md). Written out, not derived,
# so that renumbering anything fails here.
EXPECTED_EXIT_CODES = {
    "bad_request": 10,
    "too_large": 11,
    "run_mismatch": 12,
    "authz_denied": 13,
    "unknown_tool": 14,
    "policy_denied": 15,
    "invalid_args": 16,
    "review_denied": 17,
    "rate_limited": 18,
    "timeout": 19,
    "tool_failed": 20,
    "internal": 21,
    "confirmation_required": 23,
    "limit_exceeded": 24,
    "approval_denied": 25,
}


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[FakeGateway]:
    with fake_gateway(tmp_path) as gw:
        yield gw


def cli_env(gw: FakeGateway | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COGNI_")}
    if gw is not None:
        env["COGNI_GATEWAY_SOCK"] = str(gw.path)
        env["COGNI_RUN_ID"] = RUN_ID
    env.update(extra)
    return env


def run_cli(
    *words: str,
    gw: FakeGateway | None = None,
    stdin: bytes = b"",
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "cogni_tool", *words],
        input=stdin,
        capture_output=True,
        env=cli_env(gw) if env is None else env,
        cwd=REPO_ROOT,
        timeout=30,
        check=False,
    )
    # Decoded strictly: cogni-tool must write UTF-8 whatever the locale.
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode("utf-8"), done.stderr.decode("utf-8")
    )


# How a sandbox launcher runs cogni-tool: no site, no os module loaded (``-m`` would load
# it through runpy), so the client reads the environment from posix.environ itself.
LAUNCHER = "import sys; from cogni_tool.cli import main; sys.argv[1:] = {words!r}; main()"


def run_launcher(*words: str, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-S", "-E", "-c", LAUNCHER.format(words=list(words))],
        capture_output=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=30,
        check=False,
    )


# --- the table -------------------------------------------------------------------------


def test_exit_code_table_is_the_documented_contract() -> None:
    assert WIRE_EXIT_CODES == EXPECTED_EXIT_CODES
    assert EXIT_CODES == {
        "ok": 0,
        "usage": 2,
        "not_configured": 3,
        "connection_failed": 3,
        "protocol_error": 4,
        **EXPECTED_EXIT_CODES,
        "unknown_error_code": 22,
    }


def test_every_gatewayd_error_code_has_its_own_exit_code() -> None:
    wire = {code.value for code in protocol.ErrorCode}
    assert wire == set(WIRE_EXIT_CODES), "add the new error code to cogni_tool.client"
    assert len(set(WIRE_EXIT_CODES.values())) == len(WIRE_EXIT_CODES)


def test_serve_answers_a_refusal_that_only_a_person_can_change_as_403_never_429() -> None:
    # An OpenAI SDK retries a 429 by itself; nothing changes these but the operator.
    from cogni_tool.serve import _STATUS

    for code in ("approval_denied", "confirmation_required", "limit_exceeded"):
        assert _STATUS[code] == (403, "permission_denied"), code


def test_cli_copies_of_client_constants_are_equal() -> None:
    assert cli.EXIT_USAGE == client.EXIT_USAGE == EXIT_CODES["usage"]
    assert cli.DEFAULT_TIMEOUT_SECONDS == client.DEFAULT_TIMEOUT_SECONDS
    assert cli.MAX_TIMEOUT_SECONDS == client.MAX_TIMEOUT_SECONDS


def test_exit_code_table_is_in_the_docs() -> None:
    doc = (REPO_ROOT / "docs" / "cogni-tool.md").read_text()
    for code, status in EXIT_CODES.items():
        assert f"| {status} | `{code}`" in doc, code


# --- success ---------------------------------------------------------------------------


def test_exec_prints_the_value_as_one_line_of_json(gateway: FakeGateway) -> None:
    result = run_cli("exec", "echo", '{"path": "notes.txt", "text": "grüße 🎉"}', gw=gateway)
    assert result.returncode == 0, result.stderr
    assert result.stdout == '{"path": "notes.txt", "text": "grüße 🎉"}\n'
    assert result.stderr == ""
    assert gateway.requests[0]["runId"] == RUN_ID


def test_output_is_utf8_even_when_the_locale_says_ascii(gateway: FakeGateway) -> None:
    env = cli_env(gateway, PYTHONIOENCODING="ascii", LC_ALL="C")
    result = run_cli(
        "exec", "fail", '{"code": "tool_failed", "message": "kein Zugriff: ü"}', env=env
    )
    assert (result.returncode, result.stderr) == (20, "cogni-tool: tool_failed: kein Zugriff: ü\n")
    result = run_cli("exec", "echo", '{"text": "日本"}', env=env)
    assert (result.returncode, result.stdout) == (0, '{"text": "日本"}\n')


def test_large_output_is_written_in_full_before_the_process_ends(gateway: FakeGateway) -> None:
    # main() ends the process without the interpreter's teardown: it must flush first.
    text = "grüße " * 100_000
    result = run_cli("exec", "echo", "-", gw=gateway, stdin=json.dumps({"t": text}).encode())
    assert result.returncode == 0, result.stderr
    assert result.stdout == json.dumps({"t": text}, ensure_ascii=False) + "\n"


def test_exec_pretty_indents(gateway: FakeGateway) -> None:
    result = run_cli("exec", "--pretty", "echo", '{"a": [1]}', gw=gateway)
    assert result.returncode == 0, result.stderr
    assert result.stdout == '{\n  "a": [\n    1\n  ]\n}\n'


def test_exec_without_args_sends_an_empty_object(gateway: FakeGateway) -> None:
    result = run_cli("exec", "echo", gw=gateway)
    assert (result.returncode, result.stdout) == (0, "{}\n")


def test_exec_reads_args_from_stdin_with_a_dash(gateway: FakeGateway) -> None:
    result = run_cli("exec", "echo", "-", gw=gateway, stdin='{"from": "stdin ✓"}'.encode())
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"from": "stdin ✓"}


def test_exec_prints_null_for_a_value_of_null(gateway: FakeGateway) -> None:
    result = run_cli("exec", "null", gw=gateway)
    assert (result.returncode, result.stdout) == (0, "null\n")


def test_list_prints_one_aligned_line_per_tool(gateway: FakeGateway) -> None:
    result = run_cli("list", gw=gateway)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "fs.read   Read a file in the workspace.\ntime.now  The current time.\n"
    )
    assert gateway.tools_called() == ["tools.list"]
    assert gateway.requests[0]["args"] == {}


def test_list_json_prints_the_raw_tool_list(gateway: FakeGateway) -> None:
    result = run_cli("list", "--json", gw=gateway)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == TOOLS


def test_help_prints_usage_and_exits_zero() -> None:
    for words in (["--help"], ["-h"], ["exec", "--help"]):
        result = run_cli(*words, env=cli_env(None))
        assert result.returncode == 0
        assert result.stdout.startswith("usage: cogni-tool exec")
        assert "COGNI_GATEWAY_SOCK" in result.stdout


def test_version_matches_the_project_version() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert cogni_tool.__version__ == project["version"]
    result = run_cli("--version", env=cli_env(None))
    assert (result.returncode, result.stdout) == (0, f"cogni-tool {project['version']}\n")


# --- errors from the gateway -----------------------------------------------------------


@pytest.mark.parametrize(("code", "status"), sorted(EXPECTED_EXIT_CODES.items()))
def test_each_gateway_error_code_exits_with_its_own_status(
    gateway: FakeGateway, code: str, status: int
) -> None:
    args = json.dumps({"code": code, "message": "allowed tools: fs.read, time.now"})
    result = run_cli("exec", "fail", args, gw=gateway)
    assert result.returncode == status
    assert result.stderr == f"cogni-tool: {code}: allowed tools: fs.read, time.now\n"
    assert result.stdout == ""


def test_error_code_this_client_does_not_know_exits_22(gateway: FakeGateway) -> None:
    result = run_cli("exec", "fail", '{"code": "budget_spent"}', gw=gateway)
    assert result.returncode == 22
    assert result.stderr == "cogni-tool: budget_spent: fake budget_spent message\n"


def test_connection_level_error_exits_with_its_code(gateway: FakeGateway) -> None:
    result = run_cli("exec", "conn_error", gw=gateway)
    assert result.returncode == 11
    assert result.stderr.startswith("cogni-tool: too_large: frame of 9999999 bytes")


# --- local failures --------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["COGNI_GATEWAY_SOCK", "COGNI_RUN_ID"])
def test_missing_environment_exits_3_naming_the_variable(
    gateway: FakeGateway, missing: str
) -> None:
    env = cli_env(gateway)
    del env[missing]
    result = run_cli("exec", "echo", env=env)
    assert result.returncode == 3
    assert result.stderr.startswith(f"cogni-tool: not_configured: {missing} is not set")
    assert "only works inside a gatewayd run" in result.stderr
    assert gateway.connections == 0


def test_launcher_without_os_reads_the_environment_as_os_environ_would(tmp_path: Path) -> None:
    # A socket path that is not UTF-8 (byte 0xff): os.environ would decode it with
    # surrogateescape, and so must the client when it reads posix.environ itself.
    with FakeGateway(tmp_path / "gw-\udcff.sock") as gw:
        env = {"COGNI_GATEWAY_SOCK": str(gw.path), "COGNI_RUN_ID": "run-ü-1"}
        done = run_launcher("exec", "echo", '{"a": "ü"}', env=env)
    assert (done.returncode, done.stdout, done.stderr) == (0, '{"a": "ü"}\n'.encode(), b"")
    assert gw.requests[0]["runId"] == "run-ü-1"


@pytest.mark.parametrize(("value", "state"), [(None, "is not set"), ("", "is empty")])
def test_launcher_without_os_names_a_missing_or_empty_variable(
    gateway: FakeGateway, value: str | None, state: str
) -> None:
    env = {"COGNI_GATEWAY_SOCK": str(gateway.path)}
    if value is not None:
        env["COGNI_RUN_ID"] = value
    done = run_launcher("exec", "echo", env=env)
    assert done.returncode == 3
    assert done.stderr.decode().startswith(f"cogni-tool: not_configured: COGNI_RUN_ID {state}")
    assert gateway.connections == 0


def test_missing_socket_exits_3_naming_the_path(tmp_path: Path) -> None:
    env = cli_env(None, COGNI_GATEWAY_SOCK=str(tmp_path / "gone.sock"), COGNI_RUN_ID=RUN_ID)
    result = run_cli("list", env=env)
    assert result.returncode == 3
    assert result.stderr.startswith("cogni-tool: connection_failed: no gateway socket at ")
    assert str(tmp_path / "gone.sock") in result.stderr


def test_gateway_hanging_up_exits_3(gateway: FakeGateway) -> None:
    result = run_cli("exec", "hangup", gw=gateway)
    assert result.returncode == 3
    assert "may or may not have run" in result.stderr


@pytest.mark.parametrize("tool", ["garbage", "wrong_id", "v2"])
def test_garbage_from_the_gateway_exits_4(gateway: FakeGateway, tool: str) -> None:
    result = run_cli("exec", tool, gw=gateway)
    assert result.returncode == 4
    assert result.stderr.startswith("cogni-tool: protocol_error: the gateway ")


def test_tool_list_that_is_not_a_list_of_tools_exits_4(gateway: FakeGateway) -> None:
    gateway.tools = {"tools": "not a list"}
    result = run_cli("list", gw=gateway)
    assert result.returncode == 4
    assert "tools.list answered with something other than a list" in result.stderr


def test_oversize_response_length_exits_4(gateway: FakeGateway) -> None:
    result = run_cli("exec", "oversize", gw=gateway)
    assert result.returncode == 4
    assert "reads at most" in result.stderr


def test_client_timeout_exits_19(gateway: FakeGateway) -> None:
    result = run_cli("exec", "--timeout", "0.3", "sleep", '{"seconds": 2}', gw=gateway)
    assert result.returncode == 19
    assert result.stderr.startswith("cogni-tool: timeout: no answer from the gateway")


def test_request_over_the_frame_limit_exits_11_and_sends_nothing(gateway: FakeGateway) -> None:
    blob = json.dumps({"text": "x" * (1 << 20)}).encode()
    result = run_cli("exec", "echo", "-", gw=gateway, stdin=blob)
    assert result.returncode == 11
    assert result.stderr.startswith("cogni-tool: too_large: the request for 'echo' is ")
    assert "at most 1048576 bytes" in result.stderr
    assert gateway.connections == 0


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ("{'path': 'a'}", "args are not valid JSON (Expecting property name"),
        ('{"a": 1', "args are not valid JSON"),
        ("[1, 2]", "args must be a JSON object, got an array"),
        ('"text"', "args must be a JSON object, got a string"),
        ("3", "args must be a JSON object, got a number"),
        ("null", "args must be a JSON object, got null"),
        ('{"n": NaN}', "NaN is not JSON"),
    ],
)
def test_bad_args_exit_2_with_an_example_of_good_ones(
    gateway: FakeGateway, args: str, expected: str
) -> None:
    result = run_cli("exec", "echo", args, gw=gateway)
    assert result.returncode == 2
    assert result.stderr.startswith("cogni-tool: usage: ")
    assert expected in result.stderr
    assert 'cogni-tool exec fs.read \'{"path": "notes.txt"}\'' in result.stderr
    assert gateway.connections == 0


def test_args_on_stdin_that_are_not_utf8_exit_2(gateway: FakeGateway) -> None:
    result = run_cli("exec", "echo", "-", gw=gateway, stdin=b'{"a": "\xff"}')
    assert result.returncode == 2
    assert "args on stdin are not UTF-8" in result.stderr


def test_bad_command_line_exits_2(gateway: FakeGateway) -> None:
    result = run_cli("frobnicate", gw=gateway)
    assert result.returncode == 2
    assert result.stderr == (
        "cogni-tool: usage: unknown command 'frobnicate'; the commands are exec and list "
        "(see cogni-tool --help)\n"
    )


# --- command line parsing (in process) ---------------------------------------------------


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        ([], "missing command: use 'exec' or 'list'"),
        (["run"], "unknown command 'run'; the commands are exec and list"),
        (["exec"], "exec needs a tool name"),
        (["exec", "a", "{}", "{}"], "at most one args argument, got 3 words"),
        (["exec", "--json", "a"], "unknown option '--json' for exec; its options are"),
        (["list", "--verbose"], "its options are --json, --pretty, --timeout"),
        (["list", "extra"], "list takes no arguments, got 'extra'"),
        (["exec", "a", "--timeout"], "--timeout needs a number of seconds"),
        (["exec", "--timeout=soon", "a"], "--timeout takes a number of seconds"),
        (["exec", "--timeout", "-1", "a"], "--timeout takes a number of seconds"),
        (["exec", "--timeout", "nan", "a"], "--timeout takes a number of seconds"),
        (["exec", "--pretty=yes", "a"], "--pretty takes no value"),
    ],
)
def test_command_line_mistakes_say_what_is_expected(words: list[str], expected: str) -> None:
    with pytest.raises(cli.UsageError) as caught:
        cli.parse_command_line(words)
    assert expected in str(caught.value)


def test_options_may_come_anywhere_after_the_command() -> None:
    options = cli.parse_command_line(["exec", "fs.read", "--timeout=2.5", "{}", "--pretty"])
    assert (options.tool, options.args_text, options.timeout, options.pretty) == (
        "fs.read",
        "{}",
        2.5,
        True,
    )


def test_double_dash_ends_options() -> None:
    options = cli.parse_command_line(["exec", "--", "--odd-tool", "-"])
    assert (options.tool, options.args_text) == ("--odd-tool", "-")


def test_timeout_zero_means_wait_forever() -> None:
    assert cli.parse_command_line(["list", "--timeout", "0"]).timeout is None
    assert cli.parse_command_line(["list"]).timeout == 60.0


def test_main_returns_the_status_for_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["exec"]) == 2
    assert capsys.readouterr().err.startswith("cogni-tool: usage: exec needs a tool name")
