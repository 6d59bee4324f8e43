"""The run's in-sandbox services (``cogni-tool serve``), proven from inside real sandboxes:
the official ``openai`` SDK, unmodified, talks to the run's OpenAI-compatible endpoint on
127.0.0.1 and gets its answer from a fake provider on the host's loopback, through the
gateway and litellm; the host's key never shows in the sandbox.

The ``openai`` package (and what it imports) comes from gatewayd's own virtualenv, granted
read-only at /opt/pylib by the test policy: the sandbox's python3 is the host's, the same
interpreter the virtualenv was built from.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import io
import ipaddress
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import textwrap
import threading
import zipfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, ClassVar

import openai
import pytest
import trio
from structlog.testing import capture_logs

from gatewayd.config import ModelAlias
from gatewayd.daemon import open_daemon
from gatewayd.errors import PolicyViolation
from gatewayd.runs import Run
from gatewayd.sandbox.plan import MODEL_ENDPOINT_PORT, SANDBOX_API_KEY
from gatewayd.sandbox.session import SandboxUnavailable
from gatewayd.sandbox.uids import pids_of_uid
from tests.fakeprovider import FakeProvider, HttpError, Text
from tests.integration.test_run_sandbox import (
    PY,
    Sandboxed,
    _unavailable,
    sandbox_config,
)

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

KEY_ENV = "COGNI_TEST_SERVICES_KEY"
FORGE_ENV = "COGNI_TEST_FORGE_TOKEN"  # a further secret (gatewayd's secret_env)
SITE_PACKAGES = Path(openai.__file__).resolve().parents[1]

POLICY = f"""
version: 1
name: with-models
tools:
  allow: [model.chat, time.now]
filesystem:
  paths:
    workspace: {{root: ., mode: rw}}
    pylib: {{root: {SITE_PACKAGES}, mount: /opt/pylib, mode: ro}}
limits: {{calls_per_second: 1000, burst: 1000}}
sandbox: {{timeout_s: 60, cpu_s: 60, max_processes: 64}}
model_access:
  models: [assistant]
  max_requests: 5
  max_tokens: 100000
"""

# Each script prints one JSON line; the openai SDK is imported from the granted tree.
PRELUDE = """
import json, os, sys
sys.path.insert(0, "/opt/pylib")
import openai
client = openai.OpenAI()
"""


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-sv-", dir="/tmp"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def key() -> Iterator[str]:
    value = "sk-host-only-" + secrets.token_hex(12)
    os.environ[KEY_ENV] = value
    try:
        yield value
    finally:
        del os.environ[KEY_ENV]


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider() as provider:
        yield provider


@pytest.fixture
async def sb(base: Path, key: str, fake: FakeProvider) -> AsyncIterator[Sandboxed]:
    alias = ModelAlias(
        provider="openai", model="fake-chat", api_base=fake.api_base, api_key_env=KEY_ENV
    )
    config = sandbox_config(base).changed(models={"assistant": alias}, secret_env=(FORGE_ENV,))
    async with open_daemon(config, preload=True) as daemon:
        assert daemon.runs.support.available, daemon.runs.support.reason
        yield Sandboxed(daemon, base)


async def script(sb: Sandboxed, run: Run, code: str) -> dict[str, Any]:
    result = await sb.py(run, PRELUDE + textwrap.dedent(code), timeout=60)
    assert result.exitCode == 0, result.stderr.decode(errors="replace")[-3000:]
    value: dict[str, Any] = json.loads(result.stdout.decode().strip().splitlines()[-1])
    return value


async def test_the_openai_sdk_inside_gets_the_providers_answer_and_never_sees_the_key(
    sb: Sandboxed, fake: FakeProvider, key: str
) -> None:
    fake.script(Text(content="hello from the host's model", prompt_tokens=5, completion_tokens=3))
    run = await sb.run(POLICY)
    out = await script(
        sb,
        run,
        """
        answer = client.chat.completions.create(
            model="assistant",
            messages=[{"role": "system", "content": "be brief"},
                      {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            max_tokens=50,
        )
        print(json.dumps({
            "content": answer.choices[0].message.content,
            "finish": answer.choices[0].finish_reason,
            "usage": answer.usage.model_dump(),
            "model": answer.model,
            "base": os.environ["OPENAI_BASE_URL"],
            "env": dict(os.environ),
            "raw": client.chat.completions.with_raw_response.create(
                model="assistant", messages=[{"role": "user", "content": "again"}]
            ).http_response.text,
        }))
        """,
    )
    assert out["content"] == "hello from the host's model"
    assert out["finish"] == "stop"
    assert out["usage"]["prompt_tokens"] == 5 and out["usage"]["total_tokens"] == 8
    assert out["model"] == "assistant"
    assert out["base"] == f"http://127.0.0.1:{MODEL_ENDPOINT_PORT}/v1"
    # The key: only on the host's request to the provider, nowhere in the sandbox.
    sent = fake.chat_requests
    assert len(sent) == 2
    assert sent[0].authorization == f"Bearer {key}"
    assert sent[0].body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert sent[0].body["max_tokens"] == 50
    assert out["env"]["OPENAI_API_KEY"] == SANDBOX_API_KEY
    assert key not in json.dumps(out)
    assert KEY_ENV not in out["env"]
    found = await sb.daemon.runs.exec(
        run.run_id,
        [
            "sh",
            "-c",
            # The key on stdin: in argv it would be in the audit's exec_started entry.
            'read k; printf %s "$k" > /tmp/canary; grep -rlsF "$k" / --exclude-dir=usr --exclude-dir=proc '
            "--exclude-dir=sys --exclude-dir=pylib; "
            'cat /proc/*/environ 2>/dev/null | grep -cF "$k"',
        ],
        stdin=f"{key}\n".encode(),
        timeout_s=60,
    )
    # Only the canary the probe itself wrote (proof that it looks where the key could be).
    assert found.stdout.decode().split() == ["/tmp/canary", "0"], found.stdout
    # Every model call is audited as a gateway call of this run, after services_started.
    entries = await sb.entries()
    started = [e for e in entries if e.get("event") == "services_started"]
    assert started and started[0]["runId"] == run.run_id
    assert started[0]["detail"]["modelEndpoint"] == f"127.0.0.1:{MODEL_ENDPOINT_PORT}"
    chats = [
        e
        for e in entries
        if e["kind"] == "result" and e.get("tool") == "model.chat" and e["runId"] == run.run_id
    ]
    assert len(chats) == 2 and all(e.get("errorCode") is None for e in chats)
    assert key not in sb.audit_path.read_text()


async def test_a_provider_echoing_the_key_leaks_it_to_no_response_inside(
    sb: Sandboxed, fake: FakeProvider, key: str
) -> None:
    def echo(_body: Any) -> Any:
        auth = fake.requests[-1].authorization or ""
        encoded = base64.b64encode(auth.encode()).decode()
        return Text(content=f"you sent {auth} ({encoded})")

    fake.respond = echo
    fake.script(HttpError(status=400, message=f"bad key {key}"))
    run = await sb.run(POLICY)
    out = await script(
        sb,
        run,
        """
        hi = [{"role": "user", "content": "hi"}]
        try:
            client.chat.completions.create(model="assistant", messages=hi)
            error = None
        except openai.APIStatusError as exc:
            error = exc.response.text
        raw = client.chat.completions.with_raw_response.create(model="assistant", messages=hi)
        stream = client.chat.completions.with_raw_response.create(
            model="assistant", messages=hi, stream=True
        )
        print(json.dumps({"error": error, "raw": raw.http_response.text,
                          "stream": stream.http_response.read().decode()}))
        """,
    )
    assert fake.chat_requests[1].authorization == f"Bearer {key}"  # the provider had it
    text = json.dumps(out)
    assert key not in text
    assert base64.b64encode(f"Bearer {key}".encode()).decode() not in text
    assert f"[REDACTED:{KEY_ENV}]" in out["raw"] and f"[REDACTED:{KEY_ENV}]" in out["stream"]
    assert out["error"] is not None and f"[REDACTED:{KEY_ENV}]" in out["error"]
    assert key.encode() not in sb.audit_path.read_bytes()


async def test_models_listing_and_a_stream_work_through_the_sdk(
    sb: Sandboxed, fake: FakeProvider
) -> None:
    fake.script(Text(content="streamed answer"))
    run = await sb.run(POLICY)
    out = await script(
        sb,
        run,
        """
        ids = [m.id for m in client.models.list()]
        one = client.models.retrieve("assistant").id
        try:
            client.models.retrieve("gpt-4o")
            missing = None
        except openai.NotFoundError as exc:
            missing = exc.message
        pieces, finish, usage = [], None, None
        for chunk in client.chat.completions.create(
            model="assistant", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk.usage:
                usage = chunk.usage.total_tokens
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        print(json.dumps({"ids": ids, "one": one, "missing": missing,
                          "text": "".join(pieces), "finish": finish, "usage": usage}))
        """,
    )
    assert out["ids"] == ["assistant"] and out["one"] == "assistant"
    assert "not granted to this run" in out["missing"] and "assistant" in out["missing"]
    assert out["text"] == "streamed answer"
    assert out["finish"] == "stop"
    assert out["usage"] == 18


async def test_refusals_reach_the_sdk_as_its_own_errors_and_are_not_retried(
    sb: Sandboxed, fake: FakeProvider
) -> None:
    run = await sb.run(POLICY.replace("max_requests: 5", "max_requests: 1"))
    out = await script(
        sb,
        run,
        """
        def attempt(**kw):
            try:
                client.chat.completions.create(**kw)
                return "ok"
            except openai.APIStatusError as exc:
                return [type(exc).__name__, exc.status_code, exc.message]
        hi = [{"role": "user", "content": "hi"}]
        print(json.dumps({
            "other_model": attempt(model="gpt-4o", messages=hi),
            "tools": attempt(model="assistant", messages=hi, tools=[{"type": "function",
                             "function": {"name": "f", "parameters": {}}}]),
            "tool_role": attempt(model="assistant",
                                 messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]),
            "two": attempt(model="assistant", messages=hi, n=2),
            "first": attempt(model="assistant", messages=hi),
            "spent": attempt(model="assistant", messages=hi),
        }))
        """,
    )
    kind, status, message = out["other_model"]
    assert (kind, status) == ("PermissionDeniedError", 403)
    assert "not granted" in message and "assistant" in message
    assert out["tools"][:2] == ["BadRequestError", 400] and "tool calling" in out["tools"][2]
    assert out["tool_role"][:2] == ["BadRequestError", 400] and "'tool'" in out["tool_role"][2]
    assert out["two"][:2] == ["BadRequestError", 400] and "one choice" in out["two"][2]
    assert out["first"] == "ok"
    assert out["spent"][:2] == ["RateLimitError", 429] and "max_requests" in out["spent"][2]
    # No retry: the budget's one request reached the provider once, the refusal never.
    assert len(fake.chat_requests) == 1
    entries = await sb.entries()
    codes = [
        e.get("errorCode")
        for e in entries
        if e["kind"] == "result" and e.get("tool") == "model.chat"
    ]
    assert codes == ["policy_denied", None, "rate_limited"]


async def test_a_run_without_model_access_has_no_endpoint_and_no_openai_variables(
    sb: Sandboxed,
) -> None:
    policy = POLICY.replace("models: [assistant]", "models: []")
    run = await sb.run(policy)
    result = await sb.py(
        run,
        f"""
        import os, socket
        names = sorted(n for n in os.environ if "OPENAI" in n or "PROXY" in n.upper())
        try:
            socket.create_connection(("127.0.0.1", {MODEL_ENDPOINT_PORT}), timeout=2)
            print(names, "connected")
        except OSError as exc:
            print(names, type(exc).__name__)
        """,
    )
    assert result.stdout.decode().split() == ["[]", "ConnectionRefusedError"]
    assert not [e for e in await sb.entries() if e.get("event") == "services_started"]


async def test_bad_http_to_the_endpoint_gets_openai_style_errors(sb: Sandboxed) -> None:
    run = await sb.run(POLICY)
    result = await sb.py(
        run,
        f"""
        import http.client, json
        def ask(method, path, body=None, headers=None):
            conn = http.client.HTTPConnection("127.0.0.1", {MODEL_ENDPOINT_PORT}, timeout=10)
            conn.request(method, path, body=body, headers=headers or {{}})
            resp = conn.getresponse()
            data = json.loads(resp.read())
            return [resp.status, data["error"]["message"], resp.getheader("x-should-retry")]
        print(json.dumps([
            ask("GET", "/v1/nothing"),
            ask("POST", "/v1/chat/completions", b"{{not json"),
            ask("POST", "/v1/chat/completions", b"[]"),
            ask("POST", "/v1/chat/completions", json.dumps({{"model": "assistant"}})),
            ask("POST", "/v1/chat/completions",
                json.dumps({{"model": "assistant", "messages": [{{"role": "user",
                "content": "x"}}], "frobnicate": 1}})),
            ask("POST", "/v1/chat/completions", b"", {{"Content-Length": "99999999999"}}),
        ]))
        """,
    )
    assert result.exitCode == 0, result.stderr
    answers = json.loads(result.stdout)
    assert answers[0][0] == 404 and "POST /v1/chat/completions" in answers[0][1]
    assert answers[1][0] == 400 and "not JSON" in answers[1][1]
    assert answers[2][0] == 400 and "JSON object" in answers[2][1]
    assert answers[3][0] == 400 and "'messages'" in answers[3][1]
    assert answers[4][0] == 400 and "'frobnicate'" in answers[4][1]
    assert answers[5][0] == 413 and "Content-Length" in answers[5][1]
    assert all(a[2] == "false" for a in answers)


@pytest.mark.parametrize("name", [KEY_ENV, FORGE_ENV])
async def test_a_policy_passing_a_secrets_variable_into_the_sandbox_is_refused(
    sb: Sandboxed, name: str
) -> None:
    policy = POLICY + f"env:\n  allow: [LANG, {name}]\n"
    with pytest.raises(PolicyViolation, match=f"passes {name} into the sandbox"):
        await sb.run(policy)
    refused = [e for e in await sb.entries() if e.get("event") == "run_refused"]
    assert refused and refused[-1]["errorCode"] == "policy_denied"


async def test_services_that_die_are_audited_and_the_run_goes_on(sb: Sandboxed) -> None:
    run = await sb.run(POLICY)
    assert run.sandbox is not None
    # Its commands cannot reach the services' process (another pid namespace); a crash
    # or the OOM killer can: kill every process of the run's uid from the host.
    for pid in pids_of_uid(run.sandbox.user.uid):
        os.kill(pid, signal.SIGKILL)
    with trio.fail_after(10):
        while not [e for e in await sb.entries() if e.get("event") == "services_exited"]:
            await trio.sleep(0.02)
    exited = [e for e in await sb.entries() if e.get("event") == "services_exited"]
    assert exited[0]["runId"] == run.run_id and exited[0]["detail"]["signal"] == signal.SIGKILL
    again = await sb.py(run, "print('still here')")
    assert again.stdout == b"still here\n"


# --- the egress proxy, from inside ------------------------------------------------------

ALLOWED_HOST = "pkgs.example.org"
REFUSED_HOST = "elsewhere.example.net"


class _Files(http.server.BaseHTTPRequestHandler):
    """A package host: serves the bytes in ``files`` by path."""

    files: ClassVar[dict[str, bytes]] = {}

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = self.files.get(self.path.split("?", 1)[0])
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        kind = "text/html" if self.path.endswith("/") else "application/octet-stream"
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def package_host(files: dict[str, bytes], tls: tuple[Path, Path] | None = None) -> Iterator[int]:
    handler = type("Files", (_Files,), {"files": files})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(tls[0]), str(tls[1]))
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def certificate(directory: Path, host: str) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", f"/CN={host}"),
            *("-addext", f"subjectAltName=DNS:{host}"),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def wheel(name: str, version: str) -> bytes:
    """A minimal valid wheel (what pip downloads and checks)."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{name.replace('-', '_')}/__init__.py": b"",
        f"{dist}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        ).encode(),
        f"{dist}.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(f"{path},,\n" for path in files) + f"{dist}.dist-info/RECORD,,\n"
    files[f"{dist}.dist-info/RECORD"] = record.encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return buffer.getvalue()


def proxy_policy(port: int) -> str:
    return f"""
    version: 1
    name: with-proxy
    tools:
      allow: [time.now]
    filesystem:
      paths:
        workspace: {{root: ., mode: rw}}
    limits: {{calls_per_second: 1000, burst: 1000}}
    sandbox: {{timeout_s: 60, cpu_s: 60, max_processes: 64}}
    network:
      allow_domains: [{ALLOWED_HOST}]
      schemes: [http, https]
      ports: [{port}]
      allow_private: [{ALLOWED_HOST}]
      proxy: {{enabled: true}}
    """


@pytest.fixture
async def proxied(base: Path) -> AsyncIterator[Sandboxed]:
    async def resolve(host: str, port: int) -> tuple[Any, ...]:
        if host in (ALLOWED_HOST, REFUSED_HOST):
            return (ipaddress.ip_address("127.0.0.1"),)
        raise OSError(f"no such host {host}")

    async with open_daemon(sandbox_config(base), preload=True, resolver=resolve) as daemon:
        assert daemon.runs.support.available, daemon.runs.support.reason
        yield Sandboxed(daemon, base)


async def test_downloads_through_the_proxy_reach_allowed_names_only_and_are_audited(
    proxied: Sandboxed, base: Path
) -> None:
    payload = secrets.token_bytes(300_000)
    cert, key = certificate(base, ALLOWED_HOST)
    with package_host({"/pkg.bin": payload}) as port:
        run = await proxied.run(proxy_policy(port))
        ws = Path(run.spec.workspace)
        (ws / "payload.sha").write_text(hashlib.sha256(payload).hexdigest())
        fetched = await proxied.daemon.runs.exec(
            run.run_id,
            [
                "sh",
                "-c",
                f"curl -sS -o /workspace/pkg.bin http://{ALLOWED_HOST}:{port}/pkg.bin "
                f"&& sha256sum /workspace/pkg.bin; "
                f"curl -sS -w ' %{{http_code}}' http://{REFUSED_HOST}:{port}/pkg.bin",
            ],
            timeout_s=30,
        )
    assert fetched.exitCode == 0, fetched.stderr
    lines = fetched.stdout.decode()
    assert hashlib.sha256(payload).hexdigest() in lines
    assert lines.rstrip().endswith(" 403")
    assert f"'{REFUSED_HOST}' is not allowed" in lines and ALLOWED_HOST in lines.split("403")[0]
    # HTTPS: CONNECT, TLS end to end (the sandbox checks the host's certificate).
    (ws / "ca.pem").write_bytes(cert.read_bytes())
    with package_host({"/secure.bin": b"over tls"}, tls=(cert, key)) as tls_port:
        run2 = await proxied.run(proxy_policy(tls_port), workspace=proxied.workspace("ws2"))
        ws2 = Path(run2.spec.workspace)
        (ws2 / "ca.pem").write_bytes(cert.read_bytes())
        secure = await proxied.daemon.runs.exec(
            run2.run_id,
            [
                "sh",
                "-c",
                f"curl -sS --cacert /workspace/ca.pem https://{ALLOWED_HOST}:{tls_port}/secure.bin;"
                f" curl -sS --cacert /workspace/ca.pem https://{REFUSED_HOST}:{tls_port}/ 2>&1;"
                " echo exit=$?",
            ],
            timeout_s=30,
        )
    out = secure.stdout.decode()
    assert out.startswith("over tls"), out
    assert "403" in out and "exit=56" in out  # curl: CONNECT refused with 403
    entries = [e for e in await proxied.entries() if e.get("event") == "egress"]
    summary = [
        (e["runId"], e["detail"]["domain"], e["detail"]["method"], e["detail"]["verdict"])
        for e in entries
    ]
    assert summary == [
        (run.run_id, ALLOWED_HOST, "GET", "allowed"),
        (run.run_id, REFUSED_HOST, "GET", "denied"),
        (run2.run_id, ALLOWED_HOST, "CONNECT", "allowed"),
        (run2.run_id, REFUSED_HOST, "CONNECT", "denied"),
    ]
    assert entries[0]["detail"]["bytesDown"] >= len(payload)
    assert entries[1]["errorCode"] == "policy_denied"
    assert all(e["detail"]["port"] in (port, tls_port) for e in entries)


async def test_pip_downloads_a_package_through_the_proxy_over_https(
    proxied: Sandboxed, base: Path
) -> None:
    package = wheel("demo-pkg", "1.0")
    filename = "demo_pkg-1.0-py3-none-any.whl"
    digest = hashlib.sha256(package).hexdigest()
    index = (
        f'<html><body><a href="/files/{filename}#sha256={digest}">{filename}</a></body></html>'
    ).encode()
    cert, key = certificate(base, ALLOWED_HOST)
    files = {"/simple/demo-pkg/": index, f"/files/{filename}": package}
    with package_host(files, tls=(cert, key)) as port:
        run = await proxied.run(proxy_policy(port))
        (Path(run.spec.workspace) / "ca.pem").write_bytes(cert.read_bytes())
        result = await proxied.daemon.runs.exec(
            run.run_id,
            [
                PY,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "--cert",
                "/workspace/ca.pem",
                "--index-url",
                f"https://{ALLOWED_HOST}:{port}/simple/",
                "--dest",
                "/workspace/dl",
                "demo-pkg",
            ],
            timeout_s=60,
        )
    assert result.exitCode == 0, result.stderr.decode()[-2000:]
    assert (Path(run.spec.workspace) / "dl" / filename).read_bytes() == package
    domains = {e["detail"]["domain"] for e in await proxied.entries() if e.get("event") == "egress"}
    assert domains == {ALLOWED_HOST}


async def test_a_run_without_the_proxy_has_no_bridge_no_socket_and_no_variables(
    proxied: Sandboxed,
) -> None:
    policy = proxy_policy(443).replace("proxy: {enabled: true}", "proxy: {enabled: false}")
    run = await proxied.run(policy)
    result = await proxied.py(
        run,
        """
        import os, socket
        names = sorted(n for n in os.environ if "PROXY" in n.upper())
        try:
            socket.create_connection(("127.0.0.1", 3128), timeout=2)
            state = "connected"
        except OSError as exc:
            state = type(exc).__name__
        print(names, state, os.path.exists("/run/cogni/egress.sock"))
        """,
    )
    assert result.stdout.decode().split() == ["[]", "ConnectionRefusedError", "False"]


async def test_http_fetch_from_inside_uses_the_daemons_resolver_and_allowlist(
    proxied: Sandboxed,
) -> None:
    with package_host({"/notes.txt": b"fetched on the host"}) as port:
        policy = proxy_policy(port).replace("allow: [time.now]", "allow: [http.fetch]")
        run = await proxied.run(policy)
        result = await proxied.daemon.runs.exec(
            run.run_id,
            [
                "sh",
                "-c",
                f'cogni-tool exec http.fetch \'{{"url": "http://{ALLOWED_HOST}:{port}/notes.txt"}}\';'
                f' cogni-tool exec http.fetch \'{{"url": "http://{REFUSED_HOST}:{port}/"}}\';'
                " echo exit=$?",
            ],
            timeout_s=30,
        )
    out = result.stdout.decode()
    assert json.loads(out.splitlines()[0])["body"] == "fetched on the host"
    assert out.rstrip().endswith("exit=15"), out  # policy_denied
    assert f"'{REFUSED_HOST}' is not allowed" in result.stderr.decode()


async def test_services_that_do_not_come_up_refuse_the_run_with_the_reason(
    sb: Sandboxed, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gatewayd.runs.services.SERVICE_READY_TIMEOUT_S", 0.001)
    with pytest.raises(SandboxUnavailable, match=r"in-sandbox services .* did not start: it did"):
        await sb.run(POLICY)
    entries = await sb.entries()
    ended = [e for e in entries if e.get("event") == "run_ended"]
    assert ended and ended[-1]["detail"]["reason"] == "services_failed"
    assert ended[-1]["detail"]["netnsRemoved"]  # the run's sandbox was taken down
    assert not sb.daemon.registry.all()
    run = await sb.run(POLICY.replace("models: [assistant]", "models: []"))  # others still start
    assert run.sandbox is not None


async def test_clients_resetting_the_endpoint_do_not_reach_gatewayds_log(sb: Sandboxed) -> None:
    run = await sb.run(POLICY)
    with capture_logs() as logs:
        result = await sb.py(
            run,
            f"""
            import socket, struct
            for _ in range(50):
                s = socket.create_connection(("127.0.0.1", {MODEL_ENDPOINT_PORT}))
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\\r\\nContent-Length: 100\\r\\n\\r\\n{{")
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()  # an RST mid-request
            print("done")
            """,
        )
        await trio.sleep(0.5)
    assert result.stdout == b"done\n"
    assert not [e for e in logs if e["event"].startswith("sandbox_services_stderr")], logs
