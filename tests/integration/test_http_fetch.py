"""http.fetch against a real HTTP server on 127.0.0.1: through a real run socket for the
policy checks and the SSRF guard, and through ``fetch`` with an injected resolver where a
test needs a public-looking name (the connection is pinned to the resolved address)."""

from __future__ import annotations

import json
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import msgspec
import pytest
import trio

from gatewayd.config import GatewaydConfig
from gatewayd.daemon import open_daemon
from gatewayd.dialer import RESOLVER_THREADS, Resolver, resolve_host
from gatewayd.errors import PolicyViolation, ToolFailed
from gatewayd.policy.model import NetworkSection
from gatewayd.tools.http import FetchArgs, fetch
from tests.conftest import Gateway
from tests.integration.test_review import call

FIRST_BODY = "the-first-response-body-must-not-leak"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        if parts.path == "/hello":
            self._answer(200, b"hello world", {"X-Test": "yes"})
        elif parts.path == "/binary":
            self._answer(200, b"\xff\x00\xfe")
        elif parts.path == "/big":
            self._answer(200, b"x" * int(query["n"]))
        elif parts.path == "/redirect":
            self._answer(302, FIRST_BODY.encode(), {"Location": query["to"]})
        elif parts.path == "/loop":
            self._answer(302, b"", {"Location": "/loop"})
        elif parts.path == "/headers":
            seen = {k.lower(): v for k, v in self.headers.items()}
            self._answer(200, json.dumps(seen).encode())
        else:
            self._answer(404, b"no such page")

    do_HEAD = do_GET

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        self._answer(200, b"got " + self.rfile.read(length))


@pytest.fixture
def server() -> Iterator[int]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
async def gw(short_tmp: Path) -> AsyncIterator[Gateway]:
    policies = short_tmp / "policies"
    policies.mkdir()
    config = GatewaydConfig(
        state_dir=short_tmp / "state", policy_dirs=(policies,), os_sandbox=False
    )
    async with open_daemon(config, preload=True) as daemon:
        yield Gateway(daemon, policies)


def policy(network: str) -> str:
    return f"""
version: 1
name: fetcher
tools:
  allow: [http.fetch]
limits: {{calls_per_second: 1000, burst: 1000}}
require_os_sandbox: false
network: {network}
"""


def local(port: int) -> str:
    """The usual test policy; ``port`` is the loopback server's (random) port."""
    return policy(
        "{allow_domains: [localhost, 127.0.0.1, 169.254.169.254, '*.example.org'], "
        "schemes: [http], methods: [GET, HEAD, POST], max_request_bytes: 16, "
        f"max_response_bytes: 1000, max_redirects: 2, allow_private: [localhost], "
        f"ports: [80, 443, {port}]}}"
    )


async def fetch_via(
    gw: Gateway, workspace: Path, args: dict[str, Any], pol: str | None = None
) -> Any:
    """Fetch through a fresh run; the default policy allows the URL's port."""
    run = await gw.create_run(
        workspace, local(httpx.URL(args["url"]).port or 80) if pol is None else pol
    )
    return await call(run, "http.fetch", args)


# --- through the run socket -------------------------------------------------------------


async def test_an_allowed_fetch_returns_status_headers_and_text_body(
    gw: Gateway, workspace: Path, server: int
) -> None:
    answer = await fetch_via(gw, workspace, {"url": f"http://localhost:{server}/hello"})
    assert answer["ok"], answer
    value = answer["value"]
    assert value["status"] == 200 and value["body"] == "hello world"
    assert value["bodyEncoding"] == "utf-8" and value["headers"]["x-test"] == "yes"
    assert value["url"] == f"http://localhost:{server}/hello" and value["redirects"] == []


async def test_a_binary_body_comes_back_as_base64(
    gw: Gateway, workspace: Path, server: int
) -> None:
    answer = await fetch_via(gw, workspace, {"url": f"http://localhost:{server}/binary"})
    assert answer["value"]["bodyEncoding"] == "base64" and answer["value"]["body"] == "/wD+"


async def test_a_domain_off_the_allowlist_is_refused_naming_the_allowed_ones(
    gw: Gateway, workspace: Path
) -> None:
    answer = await fetch_via(gw, workspace, {"url": "http://evil.example.net/"})
    assert answer["errorCode"] == "policy_denied"
    assert "allowed domains: localhost, 127.0.0.1" in answer["safeMessage"]


async def test_an_empty_allowlist_refuses_everything_naming_the_policy_field(
    gw: Gateway, workspace: Path, server: int
) -> None:
    answer = await fetch_via(
        gw, workspace, {"url": f"http://localhost:{server}/hello"}, policy("{}")
    )
    assert answer["errorCode"] == "policy_denied"
    assert "network.allow_domains is empty" in answer["safeMessage"]


async def test_a_scheme_or_method_the_policy_does_not_list_is_refused(
    gw: Gateway, workspace: Path, server: int
) -> None:
    https = await fetch_via(gw, workspace, {"url": f"https://localhost:{server}/hello"})
    assert https["errorCode"] == "policy_denied" and "allowed: http" in https["safeMessage"]
    delete = await fetch_via(
        gw, workspace, {"url": f"http://localhost:{server}/hello", "method": "DELETE"}
    )
    assert delete["errorCode"] == "policy_denied"
    assert "allowed: GET, HEAD, POST" in delete["safeMessage"]


async def test_a_redirect_to_a_host_off_the_allowlist_is_refused_without_the_first_body(
    gw: Gateway, workspace: Path, server: int
) -> None:
    url = f"http://localhost:{server}/redirect?to=http://evil.example.net/x"
    answer = await fetch_via(gw, workspace, {"url": url})
    assert answer["errorCode"] == "policy_denied" and "evil.example.net" in answer["safeMessage"]
    assert FIRST_BODY not in json.dumps(answer)


async def test_a_redirect_to_a_loopback_address_not_in_allow_private_is_refused(
    gw: Gateway, workspace: Path, server: int
) -> None:
    url = f"http://localhost:{server}/redirect?to=http://127.0.0.1:{server}/hello"
    answer = await fetch_via(gw, workspace, {"url": url})
    assert answer["errorCode"] == "policy_denied"
    assert "127.0.0.1, a loopback address" in answer["safeMessage"]


async def test_a_redirect_within_the_policy_is_followed_and_listed(
    gw: Gateway, workspace: Path, server: int
) -> None:
    url = f"http://localhost:{server}/redirect?to=/hello"
    answer = await fetch_via(gw, workspace, {"url": url})
    assert answer["value"]["body"] == "hello world"
    assert answer["value"]["redirects"] == [f"http://localhost:{server}/hello"]


async def test_a_name_resolving_to_a_private_address_is_refused_unless_allow_private_names_it(
    gw: Gateway, workspace: Path, server: int
) -> None:
    closed = policy(f"{{allow_domains: [localhost], schemes: [http], ports: [{server}]}}")
    answer = await fetch_via(gw, workspace, {"url": f"http://localhost:{server}/hello"}, closed)
    assert answer["errorCode"] == "policy_denied"
    assert "network.allow_private" in answer["safeMessage"]
    opened = policy(
        "{allow_domains: [localhost], schemes: [http], allow_private: [127.0.0.0/8], "
        f"ports: [{server}]}}"
    )
    answer = await fetch_via(gw, workspace, {"url": f"http://localhost:{server}/hello"}, opened)
    assert answer["ok"], answer


async def test_the_metadata_address_is_refused_even_when_allowed_as_a_domain(
    gw: Gateway, workspace: Path
) -> None:
    answer = await fetch_via(gw, workspace, {"url": "http://169.254.169.254/latest/meta-data/"})
    assert answer["errorCode"] == "policy_denied"
    assert "a cloud metadata address" in answer["safeMessage"]


async def test_an_oversize_response_is_cut_with_tool_failed(
    gw: Gateway, workspace: Path, server: int
) -> None:
    fits = await fetch_via(gw, workspace, {"url": f"http://localhost:{server}/big?n=1000"})
    assert fits["ok"] and len(fits["value"]["body"]) == 1000
    over = await fetch_via(gw, workspace, {"url": f"http://localhost:{server}/big?n=1001"})
    assert over["errorCode"] == "tool_failed"
    assert "response over 1000 bytes" in over["safeMessage"]


async def test_too_many_redirects_fail_naming_the_limit(
    gw: Gateway, workspace: Path, server: int
) -> None:
    answer = await fetch_via(gw, workspace, {"url": f"http://localhost:{server}/loop"})
    assert answer["errorCode"] == "tool_failed"
    assert "more than 2 redirects (network.max_redirects)" in answer["safeMessage"]


async def test_a_request_body_over_the_cap_is_refused_and_one_under_is_sent(
    gw: Gateway, workspace: Path, server: int
) -> None:
    url = f"http://localhost:{server}/echo"
    sent = await fetch_via(gw, workspace, {"url": url, "method": "POST", "body": "small"})
    assert sent["value"]["body"] == "got small"
    over = await fetch_via(gw, workspace, {"url": url, "method": "POST", "body": "x" * 17})
    assert over["errorCode"] == "policy_denied" and "allows 16" in over["safeMessage"]


async def test_a_host_or_hop_by_hop_header_is_refused(
    gw: Gateway, workspace: Path, server: int
) -> None:
    url = f"http://localhost:{server}/headers"
    answer = await fetch_via(gw, workspace, {"url": url, "headers": {"Host": "other.example"}})
    assert answer["errorCode"] == "invalid_args" and "set by gatewayd" in answer["safeMessage"]
    sent = await fetch_via(gw, workspace, {"url": url, "headers": {"X-Agent": "a"}})
    assert json.loads(sent["value"]["body"])["x-agent"] == "a"


# --- with an injected resolver -----------------------------------------------------------


def resolver(table: dict[str, str]) -> Resolver:
    async def resolve(host: str, _port: int) -> tuple[IPv4Address | IPv6Address, ...]:
        return (ip_address(table[host]),)

    return resolve


def wild(port: int = 80) -> NetworkSection:
    return NetworkSection(
        allow_domains=("*.example.org",),
        schemes=("http",),
        allow_private=("127.0.0.1/32",),
        ports=(port,),
    )


async def test_a_wildcard_matches_subdomains_and_the_connection_goes_to_the_checked_address(
    server: int,
) -> None:
    # api.example.org does not resolve for real: the answer proves no second lookup.
    args = msgspec.convert({"url": f"http://api.example.org:{server}/headers"}, FetchArgs)
    value = await fetch(args, wild(server), resolver({"api.example.org": "127.0.0.1"}))
    assert value["status"] == 200
    assert json.loads(value["body"])["host"] == f"api.example.org:{server}"


async def test_a_wildcard_does_not_match_the_bare_domain(server: int) -> None:
    args = msgspec.convert({"url": f"http://example.org:{server}/hello"}, FetchArgs)
    with pytest.raises(PolicyViolation, match=r"allowed domains: \*\.example\.org"):
        await fetch(args, wild(server), resolver({"example.org": "127.0.0.1"}))


async def test_a_name_resolving_to_a_private_address_outside_allow_private_is_refused() -> None:
    args = msgspec.convert({"url": "http://intranet.example.org/"}, FetchArgs)
    with pytest.raises(PolicyViolation, match=r"10\.1\.2\.3, a private address"):
        await fetch(args, wild(), resolver({"intranet.example.org": "10.1.2.3"}))


async def test_an_international_name_is_matched_in_its_ascii_form(server: int) -> None:
    net = NetworkSection(
        allow_domains=("xn--fiqs8s.example.org",),
        schemes=("http",),
        allow_private=("127.0.0.1",),
        ports=(server,),
    )
    args = msgspec.convert({"url": f"http://中国.example.org:{server}/hello"}, FetchArgs)
    value = await fetch(args, net, resolver({"xn--fiqs8s.example.org": "127.0.0.1"}))
    assert value["body"] == "hello world"


# --- ports ---------------------------------------------------------------------------------


async def test_a_port_off_the_allowlist_is_refused_naming_the_allowed_ports(
    gw: Gateway, workspace: Path, server: int
) -> None:
    # The server is really there: only the policy stands in the way.
    pol = policy("{allow_domains: [localhost], schemes: [http], allow_private: [localhost]}")
    answer = await fetch_via(gw, workspace, {"url": f"http://localhost:{server}/hello"}, pol)
    assert answer["errorCode"] == "policy_denied"
    assert (
        f"port {server} is not allowed; allowed ports: 80, 443 (network.ports)"
        in (answer["safeMessage"])
    )


async def test_a_url_without_a_port_is_checked_as_80_or_443() -> None:
    net = NetworkSection(allow_domains=("example.org",), schemes=("http", "https"), ports=(8443,))
    for url, port in (("http://example.org/", 80), ("https://example.org/", 443)):
        args = msgspec.convert({"url": url}, FetchArgs)
        with pytest.raises(
            PolicyViolation, match=f"port {port} is not allowed; allowed ports: 8443"
        ):
            await fetch(args, net, resolver({}))


async def test_a_redirect_to_another_port_is_re_checked(
    gw: Gateway, workspace: Path, server: int
) -> None:
    pol = policy(
        "{allow_domains: [localhost], schemes: [http], allow_private: [localhost], "
        f"ports: [{server}]}}"
    )
    url = f"http://localhost:{server}/redirect?to=http://localhost:8081/hello"
    answer = await fetch_via(gw, workspace, {"url": url}, pol)
    assert answer["errorCode"] == "policy_denied"
    assert f"port 8081 is not allowed; allowed ports: {server}" in answer["safeMessage"]
    assert FIRST_BODY not in json.dumps(answer)


# --- hanging name servers ------------------------------------------------------------


async def test_hanging_dns_lookups_hold_their_own_threads_not_trios_shared_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name server that never answers (the C library's getaddrinfo blocks): lookups
    wait in their own few threads; trio's pool, which run set-up and the file tools use,
    stays free, and a caller's timeout ends its wait."""
    release = threading.Event()
    entered: list[str] = []

    def hanging(host: str, *args: Any, **kwargs: Any) -> Any:
        entered.append(host)
        release.wait(30)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    try:
        async with trio.open_nursery() as nursery:
            for i in range(RESOLVER_THREADS * 3):
                nursery.start_soon(_resolve_briefly, f"slow{i}.example.org")
            await trio.sleep(0.2)
            # Only RESOLVER_THREADS lookups got a thread; the others queue for one.
            assert len(entered) == RESOLVER_THREADS
            # trio's shared pool still serves everyone else at once.
            with trio.fail_after(2):
                assert await trio.to_thread.run_sync(lambda: "free") == "free"
    finally:
        release.set()
    assert len(entered) == RESOLVER_THREADS


async def _resolve_briefly(host: str) -> None:
    with trio.move_on_after(0.5):
        await resolve_host(host, 443)


async def test_the_host_s_ca_store_is_read_off_the_event_loop(
    server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reading the CA store takes tens of milliseconds: on the loop, every https hop
    # would hold up every other call. The plain-http server refuses the handshake; the
    # context was made before that.
    real = ssl.create_default_context
    made_in: list[threading.Thread] = []

    def recording(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        made_in.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", recording)
    net = NetworkSection(
        allow_domains=("api.example.org",),
        schemes=("https",),
        allow_private=("127.0.0.1/32",),
        ports=(server,),
    )
    args = msgspec.convert({"url": f"https://api.example.org:{server}/hello"}, FetchArgs)
    with pytest.raises(ToolFailed, match=r"GET https://api\.example\.org:\d+/hello failed"):
        await fetch(args, net, resolver({"api.example.org": "127.0.0.1"}))
    assert made_in, "no TLS context was made for an https URL"
    assert all(thread is not threading.main_thread() for thread in made_in), made_in
