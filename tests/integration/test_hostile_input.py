"""Hostile input on every path gatewayd reads from outside itself.

Policy files, gatewayd's configuration (its file and GATEWAYD_MODELS), calls files to
replay, run spec files, the control socket's JSON bodies and the run socket's frames:
deep nesting, numbers of 100,000 digits, keys given twice, anchors, NaN, oversized
files, FIFOs, devices and directories. Each ends in the path's documented error: never
a traceback, an ExceptionGroup, a hang, a dropped connection or a quoted secret.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from gatewayd.review.replay import CallsFileError, load_calls
from gatewayd.tools import builtin_tools
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.registry import ToolContext, ToolRegistry
from tests.conftest import OPEN_POLICY, frame, make_gateway, read_frame, request
from tests.livedaemon import LiveDaemon, start_daemon

GATEWAYD = str(Path(sys.executable).parent / "gatewayd")
ENV = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
# A hang is a failure: every command must answer well within this.
COMMAND_TIMEOUT_S = 60
# Stands in for a secret in a file that is not what its name says; it must never be
# quoted back.
SECRET = "root:$y$j9T$SECRETHASHdoNotShow:19000:0:99999:7:::"


# --- hostile files ------------------------------------------------------------------------

# name -> (content, what the error says). YAML documents: policy and configuration files.
HOSTILE_YAML: dict[str, tuple[bytes, str]] = {
    "deep-flow": (b"[" * 100_000, "nested more than 32 levels deep"),
    "deep-flow-closed": (b"[" * 100_000 + b"]" * 100_000, "nested more than 32 levels deep"),
    "deep-block": (
        "".join(f"{'  ' * i}k{i}:\n" for i in range(200)).encode(),
        "nested more than 32 levels deep",
    ),
    "huge-integer": (
        b"version: 1\nname: p\nlimits:\n  burst: " + b"9" * 100_000 + b"\n",
        "a number of more than 4300 digits",
    ),
    "huge-hex": (b"version: 1\nname: p\nx: 0x" + b"f" * 5000 + b"\n", "more than 4300 digits"),
    "alias-bomb": (
        b"version: 1\nname: p\na: &a [x, x, x, x, x, x, x, x, x]\n"
        b"b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b, *b, *b, *b]\n",
        "anchors and aliases (&name, *name) are not accepted",
    ),
    "duplicate-key": (b"version: 1\nname: p\nname: q\n", "found a key twice in one mapping"),
    "python-tag": (b"version: 1\nname: !!python/object:os.system p\n", "YAML syntax"),
    "not-utf8": (b"version: 1\nname: \xff\xfe\n", "not UTF-8"),
    "oversized": (b"version: 1\nname: p\n" + b"#" * (1 << 20), "larger than 1048576 bytes"),
}
# Special files: name -> (how to make it at a path, what the error says).
SPECIAL_FILES: dict[str, tuple[Callable[[Path], None], str]] = {
    "fifo": (os.mkfifo, "must be a regular file, not a FIFO"),
    "directory": (lambda p: p.mkdir(), "must be a regular file, not a directory"),
    "device": (lambda p: p.symlink_to("/dev/zero"), "must be a regular file, not a device"),
    "link-to-fifo": (
        lambda p: (os.mkfifo(p.with_suffix(".real")), p.symlink_to(p.with_suffix(".real"))),
        "must be a regular file, not a FIFO",
    ),
}


def make_file(directory: Path, name: str, content: bytes | None = None) -> Path:
    path = directory / f"{name}.yaml"
    if content is not None:
        path.write_bytes(content)
    else:
        SPECIAL_FILES[name][0](path)
    return path


def all_hostile_files() -> Iterator[tuple[str, bytes | None, str]]:
    for name, (content, says) in HOSTILE_YAML.items():
        yield name, content, says
    for name, (_, says) in SPECIAL_FILES.items():
        yield name, None, says


def gatewayd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """One gatewayd command; a hang fails the test (TimeoutExpired)."""
    return subprocess.run(
        [GATEWAYD, *args],
        capture_output=True,
        text=True,
        env=env or ENV,
        timeout=COMMAND_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def assert_clean_refusal(done: subprocess.CompletedProcess[str], code: int, says: str) -> None:
    output = done.stdout + done.stderr
    assert done.returncode == code, output
    assert says in done.stderr, output
    for crash in ("Traceback", "ExceptionGroup", "RecursionError", "Error:"):
        assert crash not in output, output


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    directory = tmp_path / "hostile"
    directory.mkdir()
    return directory


@pytest.mark.parametrize(("name", "content", "says"), list(all_hostile_files()))
def test_policy_check_refuses_every_hostile_file_with_its_reason(
    hostile: Path, name: str, content: bytes | None, says: str
) -> None:
    path = make_file(hostile, name, content)
    done = gatewayd("policy", "check", str(path))
    assert_clean_refusal(done, 1, f"invalid policy: {path}: ")
    assert says in done.stderr


@pytest.mark.parametrize(("name", "content", "says"), list(all_hostile_files()))
def test_a_run_with_a_hostile_policy_file_is_refused_with_its_reason(
    tmp_path: Path, hostile: Path, name: str, content: bytes | None, says: str
) -> None:
    path = make_file(hostile, name, content)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    done = gatewayd(
        "run",
        "--no-os-sandbox",
        "--state-dir",
        str(tmp_path / "state"),
        "--policy",
        str(path),
        "--workspace",
        str(workspace),
        "--",
        "true",
    )
    assert_clean_refusal(done, 1, "gatewayd: run refused: ")
    assert says in done.stderr


@pytest.mark.parametrize(("name", "content", "says"), list(all_hostile_files()))
def test_config_check_refuses_every_hostile_file_with_its_reason(
    hostile: Path, name: str, content: bytes | None, says: str
) -> None:
    # A policy's 'version' makes no configuration: the content is made a mapping of
    # known settings where it parses, so the YAML rule is what refuses it.
    if content is not None:
        content = content.replace(b"version: 1\n", b"state_dir: /srv/x\n")
        content = content.replace(b"name:", b"bwrap:")
    path = make_file(hostile, name, content)
    done = gatewayd("config", "check", str(path))
    assert_clean_refusal(done, 1, f"gatewayd config check: invalid: {path}: ")
    assert says in done.stderr


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("[" * 100_000, "nested more than 32 levels deep"),
        ("{" * 50_000, "nested more than 32 levels deep"),
        ("{r: {provider: openai, model: m}, r: {provider: openai, model: n}}", "found a key twice"),
        ("{a: &x {provider: openai, model: m}, b: *x}", "anchors and aliases"),
        ("{r: {provider: openai, model: " + "9" * 100_000 + "}}", "more than 4300 digits"),
    ],
)
def test_a_hostile_models_variable_is_refused_without_echoing_it(value: str, says: str) -> None:
    done = gatewayd("config", "show", env={**ENV, "GATEWAYD_MODELS": value})
    assert_clean_refusal(done, 1, "GATEWAYD_MODELS: not a YAML or JSON mapping")
    assert says in done.stderr
    assert value[:40] not in done.stderr


def test_a_file_that_is_not_a_policy_is_refused_without_quoting_a_line_of_it(
    hostile: Path,
) -> None:
    secret_file = hostile / "shadow"
    secret_file.write_text(f"{SECRET}\ndaemon:*:19000:0:99999:7:::\n")
    for shown in (secret_file, hostile / "colons"):
        if shown.name == "colons":  # YAML that parses as a mapping of secret keys
            shown.write_text(f"'{SECRET}': 1\nother: 2\n")
        done = gatewayd("policy", "check", str(shown))
        assert_clean_refusal(done, 1, "not a policy: it has no top-level 'version' key")
        assert "SECRETHASH" not in done.stdout + done.stderr


# --- calls files (gatewayd review replay) and run specs (gatewayd run --spec) -------------

HOSTILE_JSON: dict[str, tuple[bytes, str]] = {
    "deep": (b'{"tool": "fs.read", "args": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests"),
    "duplicate-key": (b'{"tool": "fs.read", "tool": "fs.write", "args": {}}', "appears twice"),
    "nan": (b'{"tool": "fs.read", "args": {"n": NaN}}', "NaN is not a JSON number"),
    "infinite": (b'{"tool": "fs.read", "args": {"n": 1e999}}', "overflows to infinity"),
    "huge-integer": (
        b'{"tool": "fs.read", "args": {"n": ' + b"9" * 100_000 + b"}}",
        "more than 4300 digits",
    ),
    "lone-surrogate": (b'{"tool": "fs.read", "args": {"p": "\\ud800"}}', "lone UTF-16 surrogate"),
}


@pytest.mark.parametrize("name", [*HOSTILE_JSON, *SPECIAL_FILES])
def test_a_hostile_calls_file_is_refused_with_its_reason(hostile: Path, name: str) -> None:
    if name in HOSTILE_JSON:
        content, says = HOSTILE_JSON[name]
        path = hostile / "calls.jsonl"
        path.write_bytes(content + b"\n")
    else:
        path, says = make_file(hostile, name), SPECIAL_FILES[name][1]
    outcome = in_thread_with_deadline(lambda: load_calls(path, tools=builtin_tools()))
    assert isinstance(outcome, CallsFileError), outcome
    assert says in str(outcome)


def in_thread_with_deadline(call: Callable[[], object]) -> object:
    """What ``call`` returned or raised; a call that hangs (an open of a FIFO waiting for
    a writer) fails the test instead of the whole run."""
    outcome: list[object] = []

    def target() -> None:
        try:
            outcome.append(call())
        except Exception as exc:
            outcome.append(exc)

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(COMMAND_TIMEOUT_S)
    if worker.is_alive():
        pytest.fail(f"still running after {COMMAND_TIMEOUT_S} s: a hang")
    return outcome[0]


def test_a_calls_file_past_its_cap_is_refused_before_it_is_read(hostile: Path) -> None:
    path = hostile / "calls.jsonl"
    with path.open("wb") as sparse:
        sparse.truncate((64 << 20) + 1)  # no disk used: refused by its size alone
    with pytest.raises(CallsFileError, match="larger than 67108864 bytes; split it"):
        load_calls(path)


SPEC = {
    "workspacePath": "/tmp",
    "policy": "demo",
    "actorId": "a",
    "tenantId": "t",
    "grant": {"allowSandbox": True},
}


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (
            json.dumps(SPEC)[:-1].encode() + b', "policy": "other"}',
            "the key 'policy' appears twice",
        ),
        (
            json.dumps({**SPEC, "grant": "PLACE"}).encode().replace(b'"PLACE"', b"[" * 100_000),
            "nests",
        ),
        (json.dumps({**SPEC, "grant": {"allowSandbox": "yes"}}).encode(), "valid boolean"),
        (json.dumps({**SPEC, "limits": {"maxRuntimeSec": "60"}}).encode(), "valid integer"),
        (json.dumps({**SPEC, "toolIds": "fs.read"}).encode(), "toolIds"),
        (json.dumps(SPEC).replace('"a"', "NaN").encode(), "NaN is not a JSON number"),
    ],
)
def test_a_hostile_run_spec_is_refused_with_its_reason(
    tmp_path: Path, content: bytes, says: str
) -> None:
    spec = tmp_path / "spec.json"
    spec.write_bytes(content)
    done = run_spec(tmp_path, spec)
    assert_clean_refusal(done, 1, f"gatewayd: bad --spec {spec}: ")
    assert says in done.stderr


@pytest.mark.parametrize("name", list(SPECIAL_FILES))
def test_a_run_spec_that_is_a_special_file_is_refused(tmp_path: Path, name: str) -> None:
    done = run_spec(tmp_path, make_file(tmp_path, name))
    assert_clean_refusal(done, 1, SPECIAL_FILES[name][1])


def run_spec(tmp_path: Path, spec: Path) -> subprocess.CompletedProcess[str]:
    state = str(tmp_path / "s")
    return gatewayd(
        "run", "--no-os-sandbox", "--state-dir", state, "--spec", str(spec), "--", "true"
    )


# --- the control socket -------------------------------------------------------------------


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveDaemon]:
    daemon = start_daemon(tmp_path / "state")
    try:
        yield daemon
    finally:
        daemon.stop()


# Replaced by a real workspace when sent: each request must fail on its own fault.
WS = "@WORKSPACE@"


def run_body(**over: Any) -> dict[str, Any]:
    return {**SPEC, "workspacePath": WS, **over}


def raw_control(live: LiveDaemon, method: str, target: str, body: bytes) -> tuple[int, Any]:
    """Send exactly ``body`` (LiveDaemon.control would re-encode it)."""
    from tests.livedaemon import _UnixHTTPConnection

    conn = _UnixHTTPConnection(str(live.control_socket))
    try:
        conn.request(method, target, body=body, headers={"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


CONTROL_BODIES: dict[str, tuple[str, str, bytes, str]] = {
    # name -> (method, target, body, what the 400's message says)
    "deep-run": ("POST", "/v1/runs", b"[" * 100_000 + b"]" * 100_000, "nests 100000 levels"),
    "deep-object": ("POST", "/v1/runs", b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nests"),
    "unclosed": ("POST", "/v1/runs", b"[" * 500_000, "nests"),
    "duplicate-key": (
        "POST",
        "/v1/runs",
        json.dumps(run_body()).encode()[:-1] + b', "grant": {"allowSandbox": false}}',
        "the key 'grant' appears twice",
    ),
    "string-bool": (
        "POST",
        "/v1/runs",
        json.dumps(run_body(grant={"allowSandbox": "yes"})).encode(),
        "grant.allowSandbox: Input should be a valid boolean",
    ),
    "int-bool": (
        "POST",
        "/v1/runs",
        json.dumps(run_body(grant={"allowSandbox": 1})).encode(),
        "grant.allowSandbox: Input should be a valid boolean",
    ),
    "string-number": (
        "POST",
        "/v1/runs",
        json.dumps(run_body(limits={"maxRuntimeSec": "60"})).encode(),
        "limits.maxRuntimeSec: Input should be a valid integer",
    ),
    "nan": ("POST", "/v1/runs", b'{"limits": {"maxRuntimeSec": NaN}}', "NaN is not a JSON number"),
    "huge-integer": (
        "POST",
        "/v1/runs",
        b'{"limits": {"maxRuntimeSec": ' + b"9" * 100_000 + b"}}",
        "more than 4300 digits",
    ),
    "absolute-policy-path": (
        "POST",
        "/v1/runs",
        json.dumps(run_body(policy="/etc/shadow")).encode(),
        "'/etc/shadow' is not a policy name",
    ),
    "relative-policy-path": (
        "POST",
        "/v1/runs",
        json.dumps(run_body(policy="../../../../etc/shadow")).encode(),
        "is not a policy name",
    ),
    "policy-file-name": (
        "POST",
        "/v1/runs",
        json.dumps(run_body(policy="demo.yaml")).encode(),
        "without the suffix: 'demo'",
    ),
    "long-policy-name": (
        "POST",
        "/v1/runs",
        json.dumps(run_body(policy="p" * 10_000)).encode(),
        "String should have at most 4096 characters",
    ),
    "long-name-under-the-cap": (
        "POST",
        "/v1/runs",
        json.dumps(run_body(policy="p" * 4000)).encode(),
        "(4000 characters) is not a policy name",
    ),
    "rules-with-a-path": (
        "POST",
        "/v1/rules",
        json.dumps({"policy": "/etc/shadow", "action": "add_deny", "rule": "x"}).encode(),
        "'/etc/shadow' is not a policy name",
    ),
    "rules-duplicate": (
        "POST",
        "/v1/rules",
        b'{"policy": "demo", "action": "add_deny", "action": "add_allow", "rule": "x"}',
        "the key 'action' appears twice",
    ),
    "exec-string-timeout": (
        "POST",
        "/v1/runs/" + "0" * 32 + "/exec",
        json.dumps({"command": ["true"], "timeoutSec": "5"}).encode(),
        "timeoutSec: Input should be a valid number",
    ),
    "exec-deep": (
        "POST",
        "/v1/runs/" + "0" * 32 + "/exec",
        b'{"command": ["true"], "stdin": ' + b"[" * 100_000 + b"}",
        "nests",
    ),
}


def test_every_hostile_control_request_gets_its_400_and_the_daemon_goes_on(
    tmp_path: Path, live: LiveDaemon
) -> None:
    (tmp_path / "ws").mkdir()
    for name, (method, target, template, says) in CONTROL_BODIES.items():
        body = template.replace(WS.encode(), str(tmp_path / "ws").encode())
        status, answer = raw_control(live, method, target, body)
        assert status == 400, (name, answer)
        assert answer["errorCode"] == "bad_request", (name, answer)
        assert says in answer["message"], (name, answer["message"])
        assert len(answer["message"]) < 1000, name  # no echo of the body
    assert live.control("GET", "/v1/health") == (200, {"ok": True, "runs": 0})
    log = live.log_path.read_text()
    assert "control_connection_failed" not in log and "Traceback" not in log


def test_rules_are_read_by_name_only(live: LiveDaemon) -> None:
    status, answer = live.control("GET", "/v1/rules?policy=%2Fetc%2Fshadow")
    assert status == 400 and "'/etc/shadow' is not a policy name" in answer["message"]
    status, answer = live.control("GET", "/v1/rules?policy=demo")
    assert status == 200 and answer["policy"].endswith("policies/examples/demo.yaml")


@pytest.mark.parametrize(
    ("target", "says"),
    [
        # Two values: never silently the first.
        ("/v1/rules?policy=demo&policy=other", "query parameter 'policy' is given more than once"),
        ("/v1/rules?policy=demo&policy=demo", "query parameter 'policy' is given more than once"),
        (
            "/v1/rules?polciy=x",
            "unknown query parameter 'polciy' for GET /v1/rules; it takes: policy",
        ),
        ("/v1/runs?state=ended", "for GET /v1/runs; it takes: no query parameters"),
        ("/v1/health?verbose", "malformed query string: bad query field: 'verbose'"),
        ("/v1/rules?policy=%ff", "malformed query string: 'utf-8' codec can't decode"),
        ("/v1/rules?" + "&".join(f"p{i}=1" for i in range(17)), "Max number of fields exceeded"),
    ],
)
def test_a_repeated_unknown_or_malformed_query_parameter_is_refused(
    live: LiveDaemon, target: str, says: str
) -> None:
    status, answer = live.control("GET", target)
    assert (status, answer["errorCode"]) == (400, "bad_request"), answer
    assert says in answer["message"], answer["message"]


def test_a_policy_name_leading_to_a_file_that_is_no_policy_quotes_none_of_it(
    tmp_path: Path, live: LiveDaemon
) -> None:
    secret = tmp_path / "shadow"
    secret.write_text(f"{SECRET}\n'{SECRET}': x\n")
    (live.policy_dir / "sneaky.yaml").symlink_to(secret)
    os.mkfifo(live.policy_dir / "stuck.yaml")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    body = run_body(policy="sneaky", workspacePath=str(workspace))
    status, answer = live.control("POST", "/v1/runs", body)
    assert status == 400 and "not a policy" in answer["message"], answer
    assert "SECRETHASH" not in json.dumps(answer)
    body = run_body(policy="stuck", workspacePath=str(workspace))
    status, answer = live.control("POST", "/v1/runs", body)
    assert status == 400 and "not a FIFO" in answer["message"], answer
    status, answer = live.control("GET", "/v1/rules?policy=sneaky")
    assert status == 400 and "SECRETHASH" not in json.dumps(answer)


# --- the run socket -----------------------------------------------------------------------


class _Wait(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


async def _wait_for_release(_a: _Wait, _c: ToolContext) -> Any:
    await RELEASE[0].wait()
    return {"released": True}


RELEASE: list[trio.Event] = []
WAIT_TOOLS = ToolRegistry(
    (
        *builtin_tools().values(),
        builtin_tool(
            name="test.wait",
            summary="waits until released",
            args_type=_Wait,
            run=_wait_for_release,
        ),
    )
)
WAIT_POLICY = OPEN_POLICY.replace(
    'allow: [time.now, "fs.*"]', 'allow: [time.now, "fs.*", test.wait]'
)


async def test_hostile_frames_get_bad_request_and_the_connection_goes_on(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp) as gw:
        run = await gw.create_run(workspace)
        good = request(run, "time.now", tcid="after")
        hostile = [
            json.dumps(request(run, "fs.read", {"path": "notes.md"}))[:-1].encode()
            + b', "tool": "fs.write"}',
            json.dumps(request(run, "fs.read", {"path": "notes.md"})).encode()[:-2]
            + b', "path": "/etc/shadow"}}',
            json.dumps(request(run, "time.now", {"x": "PLACE"}))
            .encode()
            .replace(b'"PLACE"', b"[" * 100_000 + b"]" * 100_000),
            json.dumps(request(run, "time.now", {"x": "PLACE"}))
            .encode()
            .replace(b'"PLACE"', b"NaN"),
        ]
        stream = await trio.open_unix_socket(str(run.socket_path))
        async with stream:
            await stream.send_all(b"".join(frame(body) for body in hostile) + frame(good))
            buf = bytearray()
            answers = []
            with trio.fail_after(10):
                while len(answers) < len(hostile) + 1:
                    message = await read_frame(stream, buf)
                    assert message is not None, answers
                    answers.append(message)
        refused, last = answers[:-1], answers[-1]
        assert [a["errorCode"] for a in refused] == ["bad_request"] * len(hostile)
        assert "the key 'tool' appears twice" in refused[0]["safeMessage"]
        assert "the key 'path' appears twice" in refused[1]["safeMessage"]
        assert "nests 100002 levels deep" in refused[2]["safeMessage"]
        assert "NaN is not a JSON number" in refused[3]["safeMessage"]
        assert last["toolCallId"] == "after" and last["ok"] is True
        entries = await gw.audit_entries()
        denied = [
            e for e in entries if e.get("kind") == "call" and e.get("errorCode") == "bad_request"
        ]
        assert len(denied) == len(hostile)  # every refusal is on the record


async def test_a_tool_call_id_already_in_flight_is_refused_and_the_first_call_finishes(
    short_tmp: Path, workspace: Path
) -> None:
    RELEASE[:] = [trio.Event()]
    async with make_gateway(short_tmp, tools=WAIT_TOOLS) as gw:
        run: Any = await gw.create_run(workspace, WAIT_POLICY)
        stream = await trio.open_unix_socket(str(run.socket_path))
        async with stream:
            first = request(run, "test.wait", tcid="same")
            second = request(run, "time.now", tcid="same")
            await stream.send_all(frame(first) + frame(second))
            buf = bytearray()
            with trio.fail_after(10):
                refusal = await read_frame(stream, buf)
                assert refusal is not None
                assert refusal["toolCallId"] == "same" and refusal["errorCode"] == "bad_request"
                assert "already in flight on this connection" in refusal["safeMessage"]
                RELEASE[0].set()
                finished = await read_frame(stream, buf)
                assert finished is not None
                assert finished["ok"] is True and finished["value"] == {"released": True}
                # Once answered, the id is free again.
                await stream.send_all(frame(request(run, "time.now", tcid="same")))
                again = await read_frame(stream, buf)
                assert again is not None and again["ok"] is True


# --- audit logs handed to the reviewer's commands -------------------------------------


@pytest.mark.parametrize("command", ["verify", "show", "export", "stats"])
def test_the_audit_commands_report_a_hostile_line_as_broken_instead_of_crashing(
    tmp_path: Path, command: str
) -> None:
    log = tmp_path / "audit.jsonl"
    # Under the 64 KiB line cap, deep enough for any recursive decoder; then a line with
    # a key twice (gatewayd never writes one).
    log.write_bytes(
        b'{"seq":1,"x":' + b"[" * 30_000 + b"]" * 30_000 + b"}\n" + b'{"seq":2,"seq":3}\n'
    )
    done = gatewayd("audit", command, str(log))
    output = done.stdout + done.stderr
    assert "Traceback" not in output and "RecursionError" not in output, output
    if command == "verify":
        assert done.returncode == 1 and "line 1 is not a valid audit entry" in output, output
    elif command == "stats":
        assert done.returncode == 0 and "calls 0" in output, output
    else:
        assert done.returncode == 0 and "not a JSON object" in output, output
