"""The egress proxy (gatewayd/egress.py) over real sockets: ``serve_egress`` on a real unix
socket, real origins on loopback (plain HTTP, and TLS with a certificate made at test
time), names such as ``pkgs.example.org`` mapped to 127.0.0.1 by an injected resolver.
Real proxy clients (curl) reach the socket through a TCP relay standing in for the
sandbox's ``cogni-tool serve``; edge cases are driven with raw bytes. Every test checks
the connection's single ``egress`` audit entry and that the log verifies."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import trio

from gatewayd import egress
from gatewayd.audit import AuditLog, open_audit_log, verify_file
from gatewayd.egress import HEAD_TIMEOUT_S, MAX_HEAD_BYTES, EgressProxy, serve_egress
from gatewayd.errors import ToolFailed
from gatewayd.policy.model import NetworkSection, ProxySection

RUN_ID = "run-egress-test"
CHUNK = 64 * 1024

# --- origins ----------------------------------------------------------------------------


class _Origin(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):  # handshake here, not in accept()
            self.request.settimeout(5)
            self.request.do_handshake()
        super().setup()

    def _answer(self, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Keep-Alive", "timeout=5")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        self.server.seen.append(self.requestline)  # type: ignore[attr-defined]
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        if parts.path == "/hello":
            self._answer(b"hello from the origin")
        elif parts.path == "/big":
            n = int(query["n"])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            for start in range(0, n, CHUNK):  # streamed: never one buffer
                self.wfile.write(_pattern(start, min(CHUNK, n - start)))
        elif parts.path == "/headers":
            seen = {
                "line": self.requestline,
                "headers": {k.lower(): v for k, v in self.headers.items()},
            }
            self._answer(json.dumps(seen).encode(), "application/json")
        elif parts.path == "/stall":
            time.sleep(1.5)
            self._answer(b"too late")
        else:
            self.send_error(404)

    do_HEAD = do_GET

    def do_POST(self) -> None:
        self.server.seen.append(self.requestline)  # type: ignore[attr-defined]
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = bytearray()
            while (size := int(self.rfile.readline().strip(), 16)) > 0:
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            body = bytearray(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        headers = {k.lower(): v for k, v in self.headers.items()}
        echo = {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest(), "headers": headers}
        self._answer(json.dumps(echo).encode(), "application/json")


def _pattern(start: int, n: int) -> bytes:
    """Bytes start..start+n of a body whose every byte depends on its offset."""
    return bytes((start + i) % 251 for i in range(n))


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, context: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Origin)
        self.context = context
        self.seen: list[str] = []

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        if self.context is not None:
            sock = self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client the proxy cut off is expected here


@dataclass
class Origins:
    http_port: int
    tls_port: int
    closed_port: int  # nothing listens there
    cert: Path
    seen: list[str]


@pytest.fixture(scope="module")
def origins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Origins]:
    tls = tmp_path_factory.mktemp("tls")
    cert, key = tls / "cert.pem", tls / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=pkgs.example.org",
         "-addext", "subjectAltName=DNS:pkgs.example.org",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    plain, secure = _Server(), _Server(context)
    secure.seen = plain.seen
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    threads = [
        threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True) for s in (plain, secure)
    ]
    for thread in threads:
        thread.start()
    try:
        yield Origins(
            plain.server_address[1], secure.server_address[1], closed_port, cert, plain.seen
        )
    finally:
        for server in (plain, secure):
            server.shutdown()
            server.server_close()


# --- the proxy under test -------------------------------------------------------------

NAMES = {
    "pkgs.example.org": "127.0.0.1",
    "down.example.org": "127.0.0.1",
    "intranet.example.org": "10.1.2.3",
    "meta.example.org": "169.254.169.254",
}


async def resolve(host: str, _port: int) -> tuple[IPv4Address | IPv6Address, ...]:
    if host not in NAMES:
        raise ToolFailed(f"cannot resolve {host!r}: Name or service not known")
    return (ip_address(NAMES[host]),)


def network(o: Origins, **changes: Any) -> NetworkSection:
    proxy = changes.pop("proxy", {})
    base: dict[str, Any] = {
        "allow_domains": ("pkgs.example.org", "*.example.org"),
        "schemes": ("http", "https"),
        "methods": ("GET", "HEAD", "POST"),
        "ports": (o.http_port, o.tls_port, o.closed_port),
        "allow_private": ("pkgs.example.org", "down.example.org", "meta.example.org"),
        "proxy": ProxySection(**({"enabled": True, "idle_timeout_s": 5} | proxy)),
    }
    return NetworkSection(**(base | changes))


@dataclass
class Harness:
    sock: Path
    audit_path: Path
    relay_port: int = 0
    peers_asked: list[int] = field(default_factory=list)
    audit: AuditLog | None = None

    def egress_entries(self) -> list[dict[str, Any]]:
        """Every ``egress`` entry, once the proxy and its log are closed; the log verifies."""
        report = verify_file(self.audit_path)
        assert report.ok, report.render()
        lines = self.audit_path.read_text().splitlines()
        return [e for e in map(json.loads, lines) if e.get("event") == "egress"]

    def only_entry(self) -> dict[str, Any]:
        entries = self.egress_entries()
        assert len(entries) == 1, entries
        entry: dict[str, Any] = entries[0]
        assert entry["runId"] == RUN_ID and entry["kind"] == "event"
        assert entry["durationMs"] >= 0
        return entry


@asynccontextmanager
async def running(
    tmp: Path,
    net: NetworkSection,
    *,
    owns_peer: Callable[[int], bool] | None = None,
    head_timeout_s: float = HEAD_TIMEOUT_S,
    degraded: str | None = None,
    drain: bool = True,
    reply_after_result: bool = True,
) -> AsyncIterator[Harness]:
    """serve_egress on ``tmp/egress.sock`` and a TCP relay to it; stopped on exit, once
    the connections in flight have ended (``drain``) or at once."""
    harness = Harness(tmp / "egress.sock", tmp / "audit" / "audit.log")

    def asked(pid: int) -> bool:
        harness.peers_asked.append(pid)
        return owns_peer(pid) if owns_peer is not None else True

    async with open_audit_log(harness.audit_path, fsync=False) as audit:
        harness.audit = audit
        proxy = EgressProxy(
            run_id=RUN_ID,
            network=net,
            audit=audit,
            resolve=resolve,
            degraded=degraded,
            head_timeout_s=head_timeout_s,
            reply_after_result=reply_after_result,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(serve_egress, harness.sock, proxy, group=None, owns_peer=asked)
            )
            listeners = await nursery.start(
                functools.partial(
                    trio.serve_tcp, functools.partial(_relay, harness.sock), 0, host="127.0.0.1"
                )
            )
            harness.relay_port = listeners[0].socket.getsockname()[1]
            yield harness
            # Let connections the client has finished with end (and be audited) on their
            # own: stopping now would audit them as cut off by the run's end.
            with trio.fail_after(5):
                while drain and proxy.active:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()


async def _relay(sock: Path, tcp: trio.SocketStream) -> None:
    """What ``cogni-tool serve`` does in the sandbox: one TCP connection, one proxy socket
    connection, bytes both ways (EOF passed on as a half-close)."""

    async def copy(src: trio.abc.Stream, dst: trio.SocketStream) -> None:
        try:
            while data := await src.receive_some(CHUNK):
                await dst.send_all(data)
            await dst.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            nursery.cancel_scope.cancel()

    async with tcp, await trio.open_unix_socket(str(sock)) as unix, trio.open_nursery() as nursery:
        nursery.start_soon(copy, tcp, unix)
        nursery.start_soon(copy, unix, tcp)


async def curl(h: Harness, o: Origins, *args: str) -> subprocess.CompletedProcess[bytes]:
    """A real proxy client: curl with ``-x`` pointing at the relay."""
    command = ["curl", "-sS", "--max-time", "10", "-x", f"http://127.0.0.1:{h.relay_port}"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}  # no proxy variables of ours
    return await trio.run_process(
        [*command, "--cacert", str(o.cert), *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=env,
    )


async def raw(h: Harness, data: bytes, *, then: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` on a fresh connection, read to EOF; (status, headers, body)."""
    answer = await raw_bytes(h, data, then=then)
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


async def raw_bytes(h: Harness, data: bytes, *, then: bytes = b"") -> bytes:
    stream = await trio.open_unix_socket(str(h.sock))
    async with stream:
        await stream.send_all(data)
        received = bytearray()
        with trio.fail_after(5):
            if then:  # after the first answer (a 100 Continue or a 200 to CONNECT)
                while b"\r\n\r\n" not in received:
                    received += await stream.receive_some(CHUNK)
                await stream.send_all(then)
            while chunk := await stream.receive_some(CHUNK):
                received += chunk
        return bytes(received)


def get(url: str, *headers: str, method: str = "GET") -> bytes:
    host = urlsplit(url).netloc
    return "\r\n".join([f"{method} {url} HTTP/1.1", f"Host: {host}", *headers, "", ""]).encode()


def connect(authority: str) -> bytes:
    return f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()


# --- allowed traffic --------------------------------------------------------------------


async def test_a_connect_tunnel_carries_a_real_tls_download_end_to_end(
    short_tmp: Path, origins: Origins
) -> None:
    n = 300_000
    async with running(short_tmp, network(origins)) as h:
        done = await curl(h, origins, f"https://pkgs.example.org:{origins.tls_port}/big?n={n}")
    assert done.returncode == 0, done.stderr
    # The certificate was verified by curl against the name: TLS ran end to end.
    assert done.stdout == _pattern(0, n)
    entry = h.only_entry()
    assert entry.get("errorCode") is None and "safeMessage" not in entry
    detail = entry["detail"]
    assert detail["domain"] == "pkgs.example.org" and detail["port"] == origins.tls_port
    assert detail["method"] == "CONNECT" and detail["verdict"] == "allowed"
    # Encrypted bytes: a little more than the body down, a handshake and a request up.
    assert n < detail["bytesDown"] < n + 20_000
    assert 300 < detail["bytesUp"] < 5_000
    assert "reason" not in detail and "degraded" not in entry
    # Its write-ahead entry came first: durable before the connection was made.
    lines = [json.loads(line) for line in h.audit_path.read_text().splitlines()]
    opened = [e for e in lines if e.get("event") == "egress_opened"]
    assert len(opened) == 1 and opened[0]["seq"] < entry["seq"]
    assert opened[0]["detail"] == {
        "domain": "pkgs.example.org",
        "port": origins.tls_port,
        "method": "CONNECT",
    }


async def test_no_connection_goes_out_when_the_audit_log_cannot_be_written(
    short_tmp: Path, origins: Origins
) -> None:
    before = len(origins.seen)
    async with running(short_tmp, network(origins)) as h:
        assert h.audit is not None
        full = os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
        os.dup2(full, h.audit.fileno())  # a real ENOSPC under the log
        os.close(full)
        status, _, body = await raw(
            h,
            f"GET http://pkgs.example.org:{origins.http_port}/big?n=10 HTTP/1.1\r\n"
            f"Host: pkgs.example.org:{origins.http_port}\r\n\r\n".encode(),
        )
    assert status == 503 and b"audit log cannot be written" in body
    assert len(origins.seen) == before  # the origin never saw the request


async def test_a_plain_http_get_streams_a_body_over_a_mebibyte(
    short_tmp: Path, origins: Origins
) -> None:
    n = 1_500_000
    async with running(short_tmp, network(origins), degraded="no OS sandbox: test") as h:
        done = await curl(h, origins, f"http://pkgs.example.org:{origins.http_port}/big?n={n}")
    assert done.returncode == 0, done.stderr
    assert done.stdout == _pattern(0, n)
    entry = h.only_entry()
    detail = entry["detail"]
    assert detail["method"] == "GET" and detail["verdict"] == "allowed"
    assert detail["port"] == origins.http_port
    assert n < detail["bytesDown"] < n + 1_000 and 50 < detail["bytesUp"] < 1_000
    assert entry["degraded"] == "no OS sandbox: test"


async def test_a_plain_request_goes_out_in_origin_form_without_proxy_or_hop_headers(
    short_tmp: Path, origins: Origins
) -> None:
    url = f"http://pkgs.example.org:{origins.http_port}/headers?x=1"
    request = get(
        url,
        "Proxy-Authorization: Basic Zm9vOmJhcg==",
        "Proxy-Connection: keep-alive",
        "Connection: keep-alive, X-Secret-Hop",
        "X-Secret-Hop: dropped",
        "Keep-Alive: timeout=100",
        "X-Agent: kept",
    )
    async with running(short_tmp, network(origins)) as h:
        status, headers, body = await raw(h, request)
    assert status == 200 and headers["connection"] == "close"
    assert "keep-alive" not in headers  # the origin's hop-by-hop header is not passed on
    seen = json.loads(body)
    assert seen["line"] == "GET /headers?x=1 HTTP/1.1"
    assert seen["headers"]["host"] == f"pkgs.example.org:{origins.http_port}"
    assert seen["headers"]["connection"] == "close" and seen["headers"]["x-agent"] == "kept"
    for dropped in ("proxy-authorization", "proxy-connection", "keep-alive", "x-secret-hop"):
        assert dropped not in seen["headers"], dropped
    assert h.only_entry()["detail"]["verdict"] == "allowed"


async def test_only_the_first_request_of_a_connection_is_forwarded(
    short_tmp: Path, origins: Origins
) -> None:
    # A pipelined second request (with a method the policy refuses) never reaches the origin.
    base = f"http://pkgs.example.org:{origins.http_port}"
    first = get(f"{base}/hello")
    second = get(f"{base}/hello", method="DELETE")
    origins.seen.clear()
    async with running(short_tmp, network(origins)) as h:
        status, _, body = await raw(h, first + second)
    assert status == 200 and body == b"hello from the origin"
    assert origins.seen == ["GET /hello HTTP/1.1"]
    assert h.only_entry()["detail"]["method"] == "GET"


async def test_a_chunked_upload_waiting_for_100_continue_is_re_framed_and_delivered(
    short_tmp: Path, origins: Origins
) -> None:
    # Content-Length beside chunked would let two parsers disagree: chunked wins, CL goes.
    head = get(
        f"http://pkgs.example.org:{origins.http_port}/echo",
        "Transfer-Encoding: chunked",
        "Content-Length: 3",
        "Expect: 100-continue",
        method="POST",
    )
    body = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    async with running(short_tmp, network(origins)) as h:
        answer = await raw_bytes(h, head, then=body)
    assert answer.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")
    final = answer.split(b"\r\n\r\n", 1)[1]  # after the 100 Continue
    echo = json.loads(final.partition(b"\r\n\r\n")[2])
    assert echo["bytes"] == 11 and echo["sha256"] == hashlib.sha256(b"hello world").hexdigest()
    assert echo["headers"]["transfer-encoding"] == "chunked"
    assert "content-length" not in echo["headers"] and "expect" not in echo["headers"]
    detail = h.only_entry()["detail"]
    assert detail["method"] == "POST" and detail["verdict"] == "allowed"


# --- refused by the policy ----------------------------------------------------------------


async def test_a_refused_domain_gets_a_403_listing_the_allowed_domains(
    short_tmp: Path, origins: Origins
) -> None:
    async with running(short_tmp, network(origins)) as h:
        # A real client first: curl reports the refused tunnel...
        done = await curl(h, origins, "https://evil.example.net/")
        # ...and the body says why, and what is allowed.
        status, headers, body = await raw(h, connect("evil.example.net:443"))
    assert done.returncode != 0 and b"403" in done.stderr
    assert status == 403 and headers["content-type"] == "text/plain; charset=utf-8"
    assert headers["connection"] == "close"
    assert (
        b"host 'evil.example.net' is not allowed; allowed domains: pkgs.example.org, "
        b"*.example.org (network.allow_domains" in body
    )
    entries = h.egress_entries()
    assert len(entries) == 2
    for entry in entries:
        assert entry["errorCode"] == "policy_denied"
        assert "evil.example.net" in entry["safeMessage"]
        detail = entry["detail"]
        assert detail["domain"] == "evil.example.net" and detail["port"] == 443
        assert detail["verdict"] == "denied" and detail["method"] == "CONNECT"
        assert detail["bytesUp"] == detail["bytesDown"] == 0
        assert detail["reason"] == entry["safeMessage"]


async def test_an_empty_allowlist_says_no_domain_is_allowed(
    short_tmp: Path, origins: Origins
) -> None:
    async with running(short_tmp, network(origins, allow_domains=())) as h:
        status, _, body = await raw(h, get(f"http://pkgs.example.org:{origins.http_port}/hello"))
    assert status == 403
    assert b"allowed domains: none (network.allow_domains is empty)" in body
    assert h.only_entry()["errorCode"] == "policy_denied"


async def test_a_port_off_the_allowlist_gets_a_403_naming_the_allowed_ports(
    short_tmp: Path, origins: Origins
) -> None:
    async with running(short_tmp, network(origins, ports=(443,))) as h:
        status, _, body = await raw(h, connect(f"pkgs.example.org:{origins.tls_port}"))
    assert status == 403
    assert (
        f"port {origins.tls_port} is not allowed; allowed ports: 443 (network.ports)".encode()
        in body
    )
    entry = h.only_entry()
    assert entry["errorCode"] == "policy_denied" and entry["detail"]["port"] == origins.tls_port


async def test_connect_needs_https_and_a_plain_request_needs_http_in_the_schemes(
    short_tmp: Path, origins: Origins
) -> None:
    async with running(short_tmp, network(origins, schemes=("http",))) as h:
        status, _, body = await raw(h, connect(f"pkgs.example.org:{origins.tls_port}"))
    assert status == 403
    assert b"scheme 'https' is not allowed; allowed: http (network.schemes)" in body
    assert h.only_entry()["detail"]["verdict"] == "denied"
    async with running(short_tmp / "b", network(origins, schemes=("https",))) as h:
        status, _, body = await raw(h, get(f"http://pkgs.example.org:{origins.http_port}/hello"))
    assert status == 403
    assert b"scheme 'http' is not allowed; allowed: https (network.schemes)" in body
    assert h.only_entry()["errorCode"] == "policy_denied"


async def test_a_method_off_the_allowlist_gets_a_405_with_the_allowed_ones(
    short_tmp: Path, origins: Origins
) -> None:
    url = f"http://pkgs.example.org:{origins.http_port}/hello"
    async with running(short_tmp, network(origins)) as h:
        status, headers, body = await raw(h, get(url, method="DELETE"))
    assert status == 405 and headers["allow"] == "GET, HEAD, POST"
    assert b"method DELETE is not allowed; allowed: GET, HEAD, POST (network.methods)" in body
    entry = h.only_entry()
    assert entry["errorCode"] == "policy_denied" and entry["detail"]["method"] == "DELETE"


async def test_a_name_resolving_to_a_private_address_is_refused_without_allow_private(
    short_tmp: Path, origins: Origins
) -> None:
    async with running(short_tmp, network(origins, ports=(443,))) as h:
        status, _, body = await raw(h, connect("intranet.example.org:443"))
    assert status == 403
    assert b"intranet.example.org resolves to 10.1.2.3, a private address" in body
    assert b"network.allow_private" in body
    entry = h.only_entry()
    assert entry["errorCode"] == "policy_denied"
    assert entry["detail"]["domain"] == "intranet.example.org"


async def test_loopback_is_refused_unless_allow_private_names_the_host(
    short_tmp: Path, origins: Origins
) -> None:
    # The very origin the other tests reach, refused once allow_private is taken away.
    async with running(short_tmp, network(origins, allow_private=())) as h:
        status, _, body = await raw(h, connect(f"pkgs.example.org:{origins.tls_port}"))
    assert status == 403 and b"127.0.0.1, a loopback address" in body
    assert h.only_entry()["errorCode"] == "policy_denied"


async def test_a_metadata_address_is_refused_even_when_allow_private_names_the_host(
    short_tmp: Path, origins: Origins
) -> None:
    async with running(short_tmp, network(origins, ports=(80,))) as h:
        status, _, body = await raw(h, get("http://meta.example.org/latest/meta-data/"))
    assert status == 403 and b"169.254.169.254, a cloud metadata address" in body
    assert h.only_entry()["errorCode"] == "policy_denied"


# --- the client's mistakes ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_bytes", "status", "message"),
    [
        (b"NONSENSE\r\n\r\n", 400, b"malformed request"),
        (b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n", 400, b"send an absolute URL"),
        (get("https://pkgs.example.org/"), 400, b"goes through a CONNECT tunnel"),
        (connect("pkgs.example.org"), 400, b"CONNECT needs host:port"),
        (connect("a@pkgs.example.org:443"), 400, b"CONNECT needs host:port"),
        (
            b"GET http://pkgs.example.org/ HTTP/1.1\r\nHost: x\r\nX-Big: "
            + b"a" * MAX_HEAD_BYTES
            + b"\r\n\r\n",
            431,
            f"request head over {MAX_HEAD_BYTES} bytes".encode(),
        ),
    ],
    ids=["garbage", "origin-form", "https-absolute", "connect-no-port", "connect-userinfo", "huge"],
)
async def test_a_malformed_or_oversize_request_gets_a_4xx_saying_what_is_wrong(
    short_tmp: Path, origins: Origins, request_bytes: bytes, status: int, message: bytes
) -> None:
    async with running(short_tmp, network(origins)) as h:
        got, headers, body = await raw(h, request_bytes)
    assert got == status and message in body, body
    assert headers["connection"] == "close"
    entry = h.only_entry()
    assert entry["errorCode"] == ("too_large" if status == 431 else "bad_request")
    assert entry["detail"]["verdict"] == "denied"


async def test_a_request_head_not_sent_in_time_is_closed_without_an_answer(
    short_tmp: Path, origins: Origins
) -> None:
    async with running(short_tmp, network(origins), head_timeout_s=0.3) as h:
        start = trio.current_time()
        answer = await raw_bytes(h, b"GET http://pkgs.exa")
        waited = trio.current_time() - start
        # A connection closed before any request is audited too.
        async with await trio.open_unix_socket(str(h.sock)) as empty:
            await empty.send_eof()
            with trio.fail_after(5):
                assert await empty.receive_some(CHUNK) == b""  # the proxy closed it
    assert answer == b"" and 0.3 <= waited < 3
    first, second = h.egress_entries()
    assert first["errorCode"] == "timeout"
    assert "no complete request head within 0.3 s" in first["safeMessage"]
    assert second["errorCode"] == "bad_request"
    assert "closed the connection before sending a request head" in second["safeMessage"]


# --- upstream failures and limits ---------------------------------------------------------------


async def test_an_origin_that_refuses_the_connection_gets_a_502(
    short_tmp: Path, origins: Origins
) -> None:
    async with running(short_tmp, network(origins)) as h:
        status, _, body = await raw(h, connect(f"down.example.org:{origins.closed_port}"))
        unknown, _, unknown_body = await raw(h, connect(f"gone.example.org:{origins.tls_port}"))
    assert status == 502
    assert f"cannot connect to down.example.org:{origins.closed_port}:".encode() in body
    assert unknown == 502 and b"cannot resolve 'gone.example.org'" in unknown_body
    refused, unresolved = h.egress_entries()
    assert refused["errorCode"] == "tool_failed" and refused["detail"]["verdict"] == "allowed"
    assert unresolved["errorCode"] == "tool_failed"


async def test_an_origin_silent_past_the_idle_timeout_gets_a_504(
    short_tmp: Path, origins: Origins
) -> None:
    net = network(origins, proxy={"idle_timeout_s": 0.3})
    async with running(short_tmp, net) as h:
        status, _, body = await raw(h, get(f"http://pkgs.example.org:{origins.http_port}/stall"))
    assert status == 504
    assert b"no byte either way for 0.3 s (network.proxy.idle_timeout_s)" in body
    entry = h.only_entry()
    assert entry["errorCode"] == "timeout" and entry["detail"]["verdict"] == "allowed"


async def test_an_idle_tunnel_is_closed_after_the_idle_timeout(
    short_tmp: Path, origins: Origins
) -> None:
    net = network(origins, proxy={"idle_timeout_s": 0.3})
    async with running(short_tmp, net) as h:
        stream = await trio.open_unix_socket(str(h.sock))
        async with stream:
            await stream.send_all(connect(f"pkgs.example.org:{origins.tls_port}"))
            with trio.fail_after(5):
                answer = await stream.receive_some(CHUNK)
                opened = trio.current_time()
                assert await stream.receive_some(CHUNK) == b""  # closed by the proxy
            idled = trio.current_time() - opened
    assert answer == b"HTTP/1.1 200 Connection established\r\n\r\n"
    assert 0.25 <= idled < 3
    entry = h.only_entry()
    assert entry["errorCode"] == "timeout"
    assert "(network.proxy.idle_timeout_s)" in entry["safeMessage"]
    assert entry["detail"]["bytesUp"] == entry["detail"]["bytesDown"] == 0


async def test_a_tunnel_open_when_the_proxy_stops_is_closed_and_still_audited(
    short_tmp: Path, origins: Origins
) -> None:
    async with running(short_tmp, network(origins), drain=False) as h:
        stream = await trio.open_unix_socket(str(h.sock))
        await stream.send_all(connect(f"pkgs.example.org:{origins.http_port}") + b"GET ")
        with trio.fail_after(5):
            assert (await stream.receive_some(CHUNK)).startswith(b"HTTP/1.1 200")
    with trio.fail_after(5):
        assert await stream.receive_some(CHUNK) == b""  # closed by the proxy
    await stream.aclose()
    entry = h.only_entry()
    assert entry.get("errorCode") is None and entry["detail"]["verdict"] == "allowed"
    assert entry["detail"]["reason"] == "closed by gatewayd: the run is ending"
    assert entry["detail"]["bytesUp"] == 4  # the bytes sent along with the CONNECT


async def test_a_connection_over_max_connection_bytes_is_cut_and_audited(
    short_tmp: Path, origins: Origins
) -> None:
    cap = 100_000
    net = network(origins, proxy={"max_connection_bytes": cap})
    url = f"http://pkgs.example.org:{origins.http_port}/big?n=300000"
    async with running(short_tmp, net) as h:
        answer = await raw_bytes(h, get(url))
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert len(answer) <= cap  # cut: far less than the 300000-byte body arrived
    entry = h.only_entry()
    assert entry["errorCode"] == "too_large"
    assert (
        f"more than {cap} bytes (both ways, network.proxy.max_connection_bytes)"
        in (entry["safeMessage"])
    )
    detail = entry["detail"]
    assert detail["verdict"] == "allowed"
    assert cap - CHUNK <= detail["bytesUp"] + detail["bytesDown"] <= cap


async def test_a_connection_over_max_connections_gets_a_503(
    short_tmp: Path, origins: Origins
) -> None:
    net = network(origins, proxy={"max_connections": 1})
    async with running(short_tmp, net) as h:
        first = await trio.open_unix_socket(str(h.sock))
        async with first:
            await first.send_all(connect(f"pkgs.example.org:{origins.http_port}"))
            with trio.fail_after(5):
                assert (await first.receive_some(CHUNK)).startswith(b"HTTP/1.1 200")
            status, _, body = await raw(h, get(f"http://pkgs.example.org:{origins.http_port}/"))
    assert status == 503
    assert b"already has 1 proxy connections open (network.proxy.max_connections)" in body
    entries = h.egress_entries()
    assert len(entries) == 2
    busy = next(e for e in entries if e.get("errorCode") == "rate_limited")
    assert busy["detail"]["verdict"] == "denied" and busy["peer"]["pid"] == os.getpid()
    tunnel = next(e for e in entries if e is not busy)
    assert tunnel["detail"]["verdict"] == "allowed" and tunnel["detail"]["method"] == "CONNECT"


async def test_connections_faster_than_the_rate_get_a_429_and_the_audit_grows_slowly(
    short_tmp: Path, origins: Origins
) -> None:
    net = network(origins, proxy={"connections_per_second": 0.5, "connection_burst": 2})
    url = f"http://pkgs.example.org:{origins.http_port}/big?n=10"
    async with running(short_tmp, net) as h:
        answers = [await raw(h, get(url)) for _ in range(12)]
    statuses = [status for status, _, _ in answers]
    assert statuses[:2] == [200, 200] and set(statuses[2:]) == {429}, statuses
    assert b"faster than 0.5 a second (network.proxy.connections_per_second)" in answers[2][2]
    entries = h.egress_entries()
    # The two served, then one refusal on the record (throttled), the rest counted.
    assert [e["detail"]["verdict"] for e in entries[:2]] == ["allowed", "allowed"]
    refused = [e for e in entries[2:] if e.get("errorCode") == "rate_limited"]
    assert 1 <= len(refused) <= 3 and len(entries) < 12
    # Each refused connection is one entry or counted in a later one's suppressedSinceLast
    # (the last count in an entry of its own when the proxy stops: no domain).
    on_record = [e for e in refused if "domain" in e["detail"]]
    assert sum(e["detail"].get("suppressedSinceLast", 0) for e in refused) + len(on_record) == 10


async def test_a_peer_outside_the_sandbox_is_refused_and_refusals_are_throttled(
    short_tmp: Path, origins: Origins
) -> None:
    async with running(short_tmp, network(origins), owns_peer=lambda pid: False) as h:
        url = f"http://pkgs.example.org:{origins.http_port}/hello"
        answers = [await raw(h, get(url)) for _ in range(3)]
    assert h.peers_asked == [os.getpid()] * 3
    for status, _, body in answers:
        assert status == 403 and b"serves only processes inside its run's sandbox" in body
    first, leftover = h.egress_entries()  # one per second, then the count of the rest
    assert first["errorCode"] == "authz_denied" and first["peer"]["pid"] == os.getpid()
    assert first["detail"]["verdict"] == "denied" and first["detail"]["domain"] is None
    assert leftover["errorCode"] == "authz_denied"
    assert leftover["detail"]["suppressedSinceLast"] == 2


# --- every error answer waits for its entry (invariant RESULT_BEFORE_REPLY) ---------------


class AnswerWatch:
    """At each error answer the proxy sends: how many ``egress`` entries were recorded by
    then, the last one's seq, the durable seq, and whether that line was in the file."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seqs: list[int] = []
        self.at_answer: list[tuple[int, int, int, bool]] = []
        self._audit: AuditLog | None = None
        answer = egress._answer

        async def watched(stream: trio.abc.Stream, data: bytes, *, linger: bool) -> None:
            if self._audit is not None and self.seqs:
                seq = self.seqs[-1]
                lines = self._audit.path.read_text().splitlines()
                on_disk = any(f'{{"seq":{seq},' in line for line in lines)
                self.at_answer.append((len(self.seqs), seq, self._audit.durable_seq, on_disk))
            else:
                self.at_answer.append((0, 0, 0, False))
            await answer(stream, data, linger=linger)

        monkeypatch.setattr(egress, "_answer", watched)
        self._monkeypatch = monkeypatch

    def watch(self, audit: AuditLog) -> None:
        self._audit = audit
        record = audit.record

        def recording(kind: str, **fields: Any) -> int:
            seq = record(kind, **fields)
            if fields.get("event") == "egress":
                self.seqs.append(seq)
            return seq

        self._monkeypatch.setattr(audit, "record", recording)


@pytest.mark.parametrize("reply_after_result", [True, False])
async def test_every_error_answer_is_sent_only_once_its_egress_entry_is_durable(
    short_tmp: Path, origins: Origins, monkeypatch: pytest.MonkeyPatch, reply_after_result: bool
) -> None:
    """Refused by policy (domain, port, method, a private address), malformed, a name
    that does not resolve, an origin that refuses (after ``egress_opened``), an origin
    silent past the idle timeout, a peer outside the sandbox: each answer leaves once
    the connection's ``egress`` entry saying so is durable; with the opt-out, at once
    (the entry recorded, not yet written)."""
    watch = AnswerWatch(monkeypatch)
    http = origins.http_port
    asked = [
        (get("http://evil.example.net/"), 403),
        (get("http://pkgs.example.org:1/"), 403),
        (get(f"http://pkgs.example.org:{http}/", method="DELETE"), 405),
        (get(f"http://intranet.example.org:{http}/"), 403),
        (b"garbage\r\n\r\n", 400),
        (connect(f"gone.example.org:{origins.tls_port}"), 502),
        (connect(f"down.example.org:{origins.closed_port}"), 502),
        (get(f"http://pkgs.example.org:{http}/stall"), 504),
    ]
    net = network(origins, proxy={"idle_timeout_s": 0.3})
    async with running(short_tmp, net, reply_after_result=reply_after_result) as h:
        assert h.audit is not None
        watch.watch(h.audit)
        statuses = [(await raw(h, data))[0] for data, _ in asked]
    assert statuses == [status for _, status in asked]
    outsider = short_tmp / "outsider"
    outsider.mkdir()
    async with running(
        outsider, net, owns_peer=lambda pid: False, reply_after_result=reply_after_result
    ) as h:
        assert h.audit is not None
        watch.watch(h.audit)
        assert (await raw(h, get(f"http://pkgs.example.org:{http}/hello")))[0] == 403
    assert len(watch.at_answer) == len(asked) + 1
    for number, (recorded, seq, durable, on_disk) in enumerate(watch.at_answer, 1):
        # One entry per connection, recorded before its answer: the latest is its own.
        assert recorded == number, f"answer {number} left before its egress entry"
        if reply_after_result:
            assert durable >= seq and on_disk, f"answer {number} left before seq {seq}"
        else:
            assert durable < seq, f"answer {number}: the opt-out waited"


async def test_a_refusal_whose_entry_cannot_be_written_is_answered_503(
    short_tmp: Path, origins: Origins
) -> None:
    async with running(short_tmp, network(origins)) as h:
        assert h.audit is not None
        full = os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
        os.dup2(full, h.audit.fileno())  # a real ENOSPC under the log
        os.close(full)
        status, _, body = await raw(h, get("http://evil.example.net/"))
    assert status == 503 and b"audit log cannot be written" in body
