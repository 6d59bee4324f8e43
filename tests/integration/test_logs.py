"""gatewayd's operational log: a real ``gatewayd serve`` writes JSON lines on stdout,
lines about a run carry its id, and no configured secret is in any line even when a
provider echoes one into an error gatewayd logs."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog

from cogni_tool.client import Client, ToolError
from gatewayd.tools import builtin_tools
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.registry import ToolContext, ToolRegistry
from tests.conftest import frame, make_gateway, raw_exchange, request
from tests.fakeprovider import FakeProvider, HttpError
from tests.integration.test_secrets import FORGE, FORGE_ENV, KEY, KEY_ENV, echoing, leaks
from tests.livedaemon import BIN, LiveDaemon, _healthy, policy_options

POLICY = """
version: 1
name: logged
tools:
  allow: [model.chat, time.now]
limits: {calls_per_second: 1000, burst: 1000}
require_os_sandbox: false
model_access:
  models: [assistant]
  max_requests: 20
  max_tokens: 100000
"""


class Logged(LiveDaemon):
    """A `gatewayd serve` whose stdout (the log) and stderr are kept apart."""

    stdout_path: Path

    def log_lines(self) -> list[str]:
        return self.stdout_path.read_text().splitlines()


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-log-", dir="/tmp"))
    (path / "ws").mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider() as provider:
        yield provider


def start_logged(base: Path, fake: FakeProvider) -> Logged:
    config = base / "gatewayd.yaml"
    config.write_text(
        textwrap.dedent(f"""
        models:
          assistant:
            provider: openai
            model: fake-chat
            api_base: {fake.api_base}
            api_key_env: {KEY_ENV}
        secret_env: [{FORGE_ENV}]
        """)
    )
    env = {
        **os.environ,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        KEY_ENV: KEY,
        FORGE_ENV: FORGE,
    }
    env.pop("CREDENTIALS_DIRECTORY", None)
    out, err = base / "stdout.log", base / "stderr.log"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [
                str(BIN / "gatewayd"),
                "serve",
                *("--config", str(config), "--state-dir", str(base / "state")),
                *policy_options(base / "state"),
                "--no-os-sandbox",
            ],
            stdout=stdout,
            stderr=stderr,
            env=env,
        )
    daemon = Logged(proc=proc, state=base / "state", log_path=err)
    daemon.stdout_path = out
    deadline = time.monotonic() + 30
    while not _healthy(daemon):
        if not daemon.alive() or time.monotonic() > deadline:
            daemon.stop()
            raise RuntimeError(f"gatewayd did not start:\n{out.read_text()}{err.read_text()}")
        time.sleep(0.02)
    return daemon


def test_log_lines_are_json_carry_the_run_id_and_hold_no_secret(
    base: Path, fake: FakeProvider
) -> None:
    # The provider quotes the request's key (and the forge token) back in its error,
    # which gatewayd logs for the operator (model_call_failed).
    echoing(fake, lambda text: HttpError(status=400, message=text), [FORGE])
    daemon = start_logged(base, fake)
    try:
        policy = base / "policy.yaml"
        policy.write_text(textwrap.dedent(POLICY))
        run = daemon.create_run(base / "ws", policy)
        with Client(run["socket"], run["runId"]) as client:
            client.call("time.now")
            with pytest.raises(ToolError):
                client.call(
                    "model.chat",
                    {"model": "assistant", "messages": [{"role": "user", "content": "hi"}]},
                )
        assert daemon.control("DELETE", f"/v1/runs/{run['runId']}")[0] == 200
    finally:
        assert daemon.stop() == 0
    lines = daemon.log_lines()
    records: list[dict[str, Any]] = []
    for line in lines:
        record = json.loads(line)  # every line, not only most: one object per line
        assert isinstance(record, dict), line
        assert {"event", "level", "timestamp"} <= set(record), line
        records.append(record)
    run_id = run["runId"]
    events = {r["event"]: r for r in records}
    for event in ("run_started", "model_call_failed", "run_ended"):
        assert events[event]["run_id"] == run_id, events[event]
    # Every line that names the run anywhere carries it as run_id.
    for record, line in zip(records, lines, strict=True):
        if run_id in line:
            assert record.get("run_id") == run_id, line
    # The echoed key reached the log line, and was replaced there.
    failed = events["model_call_failed"]["error"]
    assert f"[REDACTED:{KEY_ENV}]" in failed, failed
    text = daemon.stdout_path.read_text() + (base / "stderr.log").read_text()
    for secret in (KEY, FORGE):
        for form in leaks(secret):
            assert form not in text, f"{form!r} is in gatewayd's log"


# --- the run id reaches code that does not pass it (in-process) ---------------------------


class _Empty(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


async def _context(_a: _Empty, _c: ToolContext) -> Any:
    # What structlog's merge_contextvars adds to a line logged here, in the call's task.
    return structlog.contextvars.get_contextvars()


TOOLS = ToolRegistry(
    (
        *builtin_tools().values(),
        builtin_tool(name="test.context", summary="log context", args_type=_Empty, run=_context),
    )
)


async def test_a_line_logged_inside_a_call_gets_the_run_id_without_passing_it(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp, TOOLS) as gw:
        policy = "version: 1\nname: ctx\ntools: {allow: [test.context]}\n"
        first = await gw.create_run(workspace, policy)
        other = short_tmp / "other-ws"  # not short_tmp itself: it holds the state dir
        other.mkdir()
        second = await gw.create_run(other, policy)
        for run in (first, second, first):
            [answer] = await raw_exchange(run.socket_path, frame(request(run, "test.context", {})))
            assert answer["ok"], answer
            assert answer["value"] == {"run_id": run.run_id}


def test_litellms_own_warnings_become_gatewayds_json_lines_scrubbed() -> None:
    """litellm installs a plain-text stderr handler on its loggers; once gatewayd has
    loaded it, its records are JSON lines like gatewayd's, with secrets scrubbed."""
    from gatewayd import model_client
    from gatewayd.logs import configure_logging
    from gatewayd.secrets import Scrubber

    key = "cogni-litellm-log-secret-" + "k" * 24  # no sk- prefix: litellm masks those itself
    out = io.StringIO()
    os.environ["COGNI_TEST_LITELLM_LOG_KEY"] = key
    try:
        configure_logging(
            logging.INFO,
            scrubber=Scrubber(["COGNI_TEST_LITELLM_LOG_KEY"]),
            stream=out,
        )
        model_client.preload()
        litellm_logger = logging.getLogger("LiteLLM")
        assert litellm_logger.handlers == [] and litellm_logger.propagate
        litellm_logger.warning("provider said: bad key %s", key)
    finally:
        del os.environ["COGNI_TEST_LITELLM_LOG_KEY"]
        configure_logging(logging.INFO)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    warned = [line for line in lines if "provider said" in line.get("event", "")]
    assert warned and warned[0]["level"] == "warning"
    assert key not in out.getvalue() and "[REDACTED:COGNI_TEST_LITELLM_LOG_KEY]" in out.getvalue()
